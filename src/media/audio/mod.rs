//! Speech in: any common audio file to Wav2Lip's mel spectrogram and frame plan.
//!
//! `bytes → decode (hound / symphonia) → mono → resample to 16 kHz (rubato) → mel (80 × T)`,
//! then [`FramePlan`] says which 16-column window drives each video frame.

pub mod decode;
pub mod mel;
pub mod plan;
pub mod resample;

pub use decode::Decoded;
pub use mel::{mel_spectrogram, Mel};
pub use plan::{Fps, FramePlan, WINDOW};

use std::time::{Duration, Instant};

use crate::media::Error;

/// Default longest accepted audio: ten minutes.
pub const DEFAULT_MAX_SECONDS: f64 = 600.0;

/// Shortest usable audio: one 16-column mel window needs 15 hops of 200 samples at 16 kHz.
pub const MIN_SAMPLES: usize = (WINDOW - 1) * mel::HOP;

/// Speech ready for the model: 16 kHz mono, plus what the upload was.
#[derive(Debug, Clone)]
pub struct Speech {
    /// 16 kHz mono samples.
    pub samples: Vec<f32>,
    pub source_rate: u32,
    pub source_channels: u16,
    pub container: &'static str,
    pub codec: String,
    /// Time spent decoding and resampling (for metrics and benchmarks).
    pub decode_time: Duration,
    pub resample_time: Duration,
}

impl Speech {
    pub fn seconds(&self) -> f64 {
        self.samples.len() as f64 / f64::from(mel::SAMPLE_RATE)
    }

    pub fn mel(&self) -> Mel {
        mel_spectrogram(&self.samples)
    }
}

/// Decodes, checks and resamples an uploaded audio file. Refuses empty, unreadable, truncated,
/// non-finite, too short (under one mel window) and too long (over `max_seconds`) audio.
pub fn load(bytes: &[u8], max_seconds: f64) -> Result<Speech, Error> {
    let start = Instant::now();
    let decoded = decode::decode(bytes, max_seconds)?;
    let decode_time = start.elapsed();
    let samples = resample::to_16k(&decoded.samples, decoded.sample_rate)?;
    let resample_time = start.elapsed() - decode_time;
    if samples.len() < MIN_SAMPLES {
        return Err(Error::AudioTooShort {
            seconds: decoded.seconds(),
            min_seconds: MIN_SAMPLES as f64 / f64::from(mel::SAMPLE_RATE),
        });
    }
    Ok(Speech {
        samples,
        source_rate: decoded.sample_rate,
        source_channels: decoded.channels,
        container: decoded.container,
        codec: decoded.codec,
        decode_time,
        resample_time,
    })
}
