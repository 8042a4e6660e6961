//! Sample-rate conversion to the model's 16 kHz with rubato's FFT resampler (band-limited,
//! synchronous; the whole clip at once, start-up delay trimmed, `ceil(n · 16000 / rate)`
//! samples out, as librosa's resampling gives).

use audioadapter_buffers::direct::InterleavedSlice;
use rubato::{Fft, FixedSync, Resampler};

use super::mel::SAMPLE_RATE;
use crate::media::Error;

/// Input frames per FFT block, roughly: long blocks give a sharp anti-aliasing filter (the
/// passband reaches close to 8 kHz, above the mel filterbank's 7.6 kHz top).
const CHUNK: usize = 4096;

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// An input block size near [`CHUNK`] whose output block is an even number of samples: the
/// resampler's delay is half the output block, and an odd block would leave the output half a
/// sample late (96 kHz → 16 kHz with 4096 gives 683).
fn block_size(rate: usize) -> usize {
    let g = gcd(rate, SAMPLE_RATE as usize);
    let (block_in, block_out) = (rate / g, SAMPLE_RATE as usize / g);
    let mut blocks = CHUNK.div_ceil(block_in);
    if blocks * block_out % 2 == 1 {
        blocks += 1;
    }
    blocks * block_in
}

/// Resamples mono audio to 16 kHz; 16 kHz input is returned unchanged.
pub fn to_16k(samples: &[f32], rate: u32) -> Result<Vec<f32>, Error> {
    if rate == SAMPLE_RATE || samples.is_empty() {
        return Ok(samples.to_vec());
    }
    let fail = |e: String| Error::CorruptAudio(format!("cannot resample {rate} Hz audio: {e}"));
    let mut resampler = Fft::<f32>::new_custom(
        rate as usize,
        SAMPLE_RATE as usize,
        block_size(rate as usize),
        1,
        1,
        rubato::WindowFunction::BlackmanHarris2,
        FixedSync::Input,
    )
    .map_err(|e| fail(e.to_string()))?;
    let input =
        InterleavedSlice::new(samples, 1, samples.len()).map_err(|e| fail(e.to_string()))?;
    let out = resampler
        .process_all(&input, samples.len(), None)
        .map_err(|e| fail(e.to_string()))?;
    Ok(out.take_data())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sine(rate: u32, hz: f64, seconds: f64) -> Vec<f32> {
        let n = (f64::from(rate) * seconds) as usize;
        (0..n)
            .map(|i| {
                (2.0 * std::f64::consts::PI * hz * i as f64 / f64::from(rate)).sin() as f32 * 0.5
            })
            .collect()
    }

    #[test]
    fn a_tone_keeps_its_level_phase_and_length() {
        for rate in [8000, 11025, 22050, 24000, 44100, 48000, 96000, 192000] {
            let x = sine(rate, 440.0, 1.0);
            let y = to_16k(&x, rate).unwrap();
            assert_eq!(
                y.len(),
                (x.len() as u64 * 16000).div_ceil(u64::from(rate)) as usize
            );
            let want = sine(16000, 440.0, 1.0);
            // Away from the clip edges the resampled tone equals the tone sampled at 16 kHz.
            let err = y[800..15200]
                .iter()
                .zip(&want[800..15200])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err < 1e-3, "{rate} Hz: max error {err}");
        }
    }

    #[test]
    fn content_above_8k_is_removed() {
        let y = to_16k(&sine(44100, 12_000.0, 1.0), 44100).unwrap();
        let rms = (y[800..15200].iter().map(|v| v * v).sum::<f32>() / 14400.0).sqrt();
        assert!(rms < 1e-3, "aliasing rms {rms}");
    }
}
