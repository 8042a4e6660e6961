//! Running the model on speech and avatars: avatar preparation and cache, the engine front
//! (one way in for the CLI, the service and the benchmarks), the model instances and the
//! cross-request batcher, per-request jobs (faces composited back, frames to the encoder), and
//! the one render call every door uses ([`pipeline`]).
//!
//! Uses `model` and `media`; knows nothing of HTTP. Model work runs on the instances' own OS
//! threads, never on an async runtime.

pub mod avatar;
pub mod avatar_store;
pub mod backend;
pub mod batcher;
pub mod cache;
pub mod clip;
pub mod compositor;
pub mod echo;
pub mod enhance;
pub mod enhance_pool;
pub mod faults;
pub mod front;
pub mod job;
pub mod landmarks;
pub mod metrics;
pub mod pipeline;
pub mod pool;
pub mod render;
pub mod restore;
pub mod scheduler;
pub mod session;

pub use avatar::Avatar;
pub use clip::Loop;
pub use front::{plan, Engine, Planned, Submission};
pub use job::{Job, JobStats};

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
    /// A live session's client sent something it cannot use.
    #[error("{0}")]
    Stream(String),
    /// A request asked for an enhancer that is not loaded (or named a kind several share).
    #[error("{0}")]
    EnhancerNotLoaded(String),
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
            Error::Stream(_) => "bad_stream",
            Error::EnhancerNotLoaded(_) => "enhancer_not_loaded",
        }
    }
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Model(model::Error::Candle(e))
    }
}
