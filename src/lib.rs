//! lipsync: Wav2Lip inference — speech and an avatar photo in, a talking-head video out.
//!
//! Layers, each depending only on those above it in this list:
//! - [`model`]: the Wav2Lip generator in candle and checkpoint reading.

pub mod model;
