//! lipsync: Wav2Lip inference — speech and an avatar photo in, a talking-head video out.
//!
//! Layers, each depending only on those above it in this list:
//! - [`fsutil`]: small file helpers (atomic replace) that any layer may use;
//! - [`model`]: the Wav2Lip generator in candle and checkpoint reading;
//! - [`media`]: audio decoding, the mel front end and the frame plan; images, faces,
//!   compositing; video encoding;
//! - [`engine`]: avatars and the render pipeline (model batches, compositing, encoding), the
//!   model instance pool and the cross-request batcher;
//! - [`server`]: the HTTP service (axum) on top of the engine;
//! - [`config`]: the engine and media flags that `serve` and `render` share.
//!
//! `model` and `media` are independent of each other and of any async runtime.

pub mod config;
pub mod engine;
pub mod fsutil;
pub mod jobs;
pub mod media;
pub mod model;
pub mod server;
