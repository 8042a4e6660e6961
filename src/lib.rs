//! lipsync: Wav2Lip inference — speech and an avatar photo in, a talking-head video out.
//!
//! Layers, each depending only on those above it in this list:
//! - [`model`]: the Wav2Lip generator in candle and checkpoint reading;
//! - [`media`]: audio decoding, the mel front end and the frame plan.
//!
//! `model` and `media` are independent of each other and of any async runtime.

pub mod media;
pub mod model;
