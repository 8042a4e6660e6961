//! Running the model on speech and avatars: avatar preparation, the render pipeline (mel
//! windows and face crops in batches through the model, faces composited back, frames to the
//! encoder), and later the instance pool and cross-request batcher of the service.
//!
//! Uses `model` and `media`; knows nothing of HTTP. GPU work runs on the thread that calls in
//! (the CLI's main thread, or a model instance's own OS thread), never on an async runtime.

pub mod avatar;
pub mod batcher;
pub mod cache;
pub mod compositor;
pub mod job;
pub mod metrics;
pub mod pool;
pub mod render;
pub mod scheduler;

pub use avatar::Avatar;
pub use render::{render, RenderOptions, RenderStats};

use crate::{media, model};

/// Errors of the engine layer: which layer failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Model(#[from] model::Error),
    #[error(transparent)]
    Media(#[from] media::Error),
    #[error("cannot write {path}: {source}")]
    Output {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("the model failed: {0}")]
    Inference(String),
    #[error("out of device memory: {0}")]
    OutOfMemory(String),
    #[error("the client went away")]
    Cancelled,
}

impl Error {
    /// A stable snake_case name for the kind of error.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Model(e) => e.kind(),
            Error::Media(e) => e.kind(),
            Error::Output { .. } => "output",
            Error::Inference(_) => "inference_failed",
            Error::OutOfMemory(_) => "out_of_memory",
            Error::Cancelled => "cancelled",
        }
    }
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Model(model::Error::Candle(e))
    }
}
