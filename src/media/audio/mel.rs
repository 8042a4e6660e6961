//! Wav2Lip's mel spectrogram, exactly as `Rudrabha/Wav2Lip:audio.py` computes it with the
//! `hparams.py` values and librosa 0.7 semantics (`wav2lip-spec.md` §3.2):
//!
//! 1. pre-emphasis `y[n] = x[n] − 0.97·x[n−1]` (`y[0] = x[0]`);
//! 2. STFT: n_fft 800, hop 200, periodic Hann window of 800, centred with **reflect** padding
//!    of 400 samples each side (librosa 0.7's default; librosa ≥ 0.10 pads with zeros);
//! 3. magnitude, then the 80-band Slaney mel filterbank (55–7600 Hz, Slaney area
//!    normalisation, librosa's float32 weights);
//! 4. `20·log10(max(1e-5, M)) − 20`, then `clip(8·(S + 100)/100 − 4, −4, 4)`.
//!
//! Everything is computed in f64 and stored as f32, shape (80, T) with T = 1 + ⌊len / 200⌋.

use std::sync::{Arc, OnceLock};

use realfft::{RealFftPlanner, RealToComplex};

pub const SAMPLE_RATE: u32 = 16_000;
pub const N_FFT: usize = 800;
pub const HOP: usize = 200;
pub const N_MELS: usize = 80;
/// Mel frames per second of audio.
pub const MEL_FPS: f64 = SAMPLE_RATE as f64 / HOP as f64;

const FMIN: f64 = 55.0;
const FMAX: f64 = 7600.0;
const PREEMPHASIS: f64 = 0.97;
const MIN_LEVEL_DB: f64 = -100.0;
const REF_LEVEL_DB: f64 = 20.0;
const MAX_ABS_VALUE: f64 = 4.0;

/// A mel spectrogram: `N_MELS` rows (row 0 = lowest band) by `frames` columns.
#[derive(Debug, Clone, PartialEq)]
pub struct Mel {
    data: Vec<f32>,
    frames: usize,
}

impl Mel {
    pub fn frames(&self) -> usize {
        self.frames
    }

    /// Value of mel band `bin` at frame `t`.
    pub fn get(&self, bin: usize, t: usize) -> f32 {
        self.data[bin * self.frames + t]
    }

    /// Row-major (80, T) values.
    pub fn as_slice(&self) -> &[f32] {
        &self.data
    }

    /// Columns `start .. start + width`, row-major (80, width): the layout of one
    /// `(1, 80, 16)` model input. Panics if the window does not fit (frame plans never ask).
    pub fn window(&self, start: usize, width: usize) -> Vec<f32> {
        assert!(start + width <= self.frames, "mel window out of range");
        let mut out = Vec::with_capacity(N_MELS * width);
        for bin in 0..N_MELS {
            let row = bin * self.frames;
            out.extend_from_slice(&self.data[row + start..row + start + width]);
        }
        out
    }
}

/// One triangular filter: its first FFT bin and its weights.
struct Filter {
    start: usize,
    weights: Vec<f64>,
}

/// Slaney mel scale (librosa `htk=False`): linear below 1 kHz, logarithmic above.
fn hz_to_mel(hz: f64) -> f64 {
    let f_sp = 200.0 / 3.0;
    let min_log_hz = 1000.0;
    let min_log_mel = min_log_hz / f_sp;
    let logstep = 6.4f64.ln() / 27.0;
    if hz >= min_log_hz {
        min_log_mel + (hz / min_log_hz).ln() / logstep
    } else {
        hz / f_sp
    }
}

fn mel_to_hz(mel: f64) -> f64 {
    let f_sp = 200.0 / 3.0;
    let min_log_hz = 1000.0;
    let min_log_mel = min_log_hz / f_sp;
    let logstep = 6.4f64.ln() / 27.0;
    if mel >= min_log_mel {
        min_log_hz * (logstep * (mel - min_log_mel)).exp()
    } else {
        f_sp * mel
    }
}

/// `librosa.filters.mel(sr=16000, n_fft=800, n_mels=80, fmin=55, fmax=7600)` (Slaney scale and
/// normalisation), rounded to f32 at the same two points librosa's float32 array is.
fn filterbank() -> &'static [Filter] {
    static BANK: OnceLock<Vec<Filter>> = OnceLock::new();
    BANK.get_or_init(|| {
        let n_bins = N_FFT / 2 + 1;
        let fft_freqs: Vec<f64> = (0..n_bins)
            .map(|k| k as f64 * f64::from(SAMPLE_RATE) / N_FFT as f64)
            .collect();
        let (lo, hi) = (hz_to_mel(FMIN), hz_to_mel(FMAX));
        let points = N_MELS + 2;
        let mel_f: Vec<f64> = (0..points)
            .map(|i| mel_to_hz(lo + (hi - lo) * i as f64 / (points - 1) as f64))
            .collect();
        (0..N_MELS)
            .map(|i| {
                let (f0, f1, f2) = (mel_f[i], mel_f[i + 1], mel_f[i + 2]);
                let enorm = 2.0 / (f2 - f0);
                let w: Vec<f64> = fft_freqs
                    .iter()
                    .map(|&f| {
                        let lower = (f - f0) / (f1 - f0);
                        let upper = (f2 - f) / (f2 - f1);
                        let tri = lower.min(upper).max(0.0) as f32;
                        f64::from((f64::from(tri) * enorm) as f32)
                    })
                    .collect();
                let start = w.iter().position(|&x| x != 0.0).unwrap_or(0);
                let end = w.iter().rposition(|&x| x != 0.0).map_or(start, |e| e + 1);
                Filter {
                    start,
                    weights: w[start..end].to_vec(),
                }
            })
            .collect()
    })
}

fn fft() -> Arc<dyn RealToComplex<f64>> {
    static FFT: OnceLock<Arc<dyn RealToComplex<f64>>> = OnceLock::new();
    FFT.get_or_init(|| RealFftPlanner::<f64>::new().plan_fft_forward(N_FFT))
        .clone()
}

/// numpy's `reflect` padding index for position `i` of a signal of length `n` padded by
/// `pad` on the left (works for pads longer than the signal, like numpy).
fn reflect(i: usize, pad: usize, n: usize) -> usize {
    if n == 1 {
        return 0;
    }
    let period = 2 * (n - 1) as i64;
    let m = (i as i64 - pad as i64).rem_euclid(period);
    (if m >= n as i64 { period - m } else { m }) as usize
}

/// The mel spectrogram of 16 kHz mono samples. Empty input gives zero frames.
pub fn mel_spectrogram(samples: &[f32]) -> Mel {
    let n = samples.len();
    if n == 0 {
        return Mel {
            data: Vec::new(),
            frames: 0,
        };
    }
    let mut y = Vec::with_capacity(n);
    y.push(f64::from(samples[0]));
    for i in 1..n {
        y.push(f64::from(samples[i]) - PREEMPHASIS * f64::from(samples[i - 1]));
    }

    let frames = 1 + n / HOP;
    // Columns are independent: split them over the cores (a minute of speech is 4801 FFTs).
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(8)
        .min(frames.div_ceil(256));
    let per = frames.div_ceil(threads.max(1));
    let mut columns = vec![0f32; N_MELS * frames]; // column-major while computing
    std::thread::scope(|scope| {
        for (i, chunk) in columns.chunks_mut(per * N_MELS).enumerate() {
            let y = &y;
            scope.spawn(move || mel_columns(y, i * per, chunk));
        }
    });
    // Transpose to (80, T).
    let mut data = vec![0f32; N_MELS * frames];
    for (t, col) in columns.chunks_exact(N_MELS).enumerate() {
        for (bin, &v) in col.iter().enumerate() {
            data[bin * frames + t] = v;
        }
    }
    Mel { data, frames }
}

/// Mel columns `first ..` of the pre-emphasised signal `y`, written column by column into `out`
/// (`N_MELS` values per column).
fn mel_columns(y: &[f64], first: usize, out: &mut [f32]) {
    let n = y.len();
    let pad = N_FFT / 2;
    let window: Vec<f64> = (0..N_FFT)
        .map(|k| 0.5 - 0.5 * (2.0 * std::f64::consts::PI * k as f64 / N_FFT as f64).cos())
        .collect();
    let bank = filterbank();
    let fft = fft();
    let mut input = fft.make_input_vec();
    let mut spectrum = fft.make_output_vec();
    let mut scratch = fft.make_scratch_vec();
    let mut magnitude = vec![0f64; N_FFT / 2 + 1];
    for (c, col) in out.chunks_exact_mut(N_MELS).enumerate() {
        let t = first + c;
        for (k, x) in input.iter_mut().enumerate() {
            let i = t * HOP + k;
            let v = if i >= pad && i - pad < n {
                y[i - pad]
            } else {
                y[reflect(i, pad, n)]
            };
            *x = v * window[k];
        }
        // Lengths are the planner's own, so processing cannot fail.
        fft.process_with_scratch(&mut input, &mut spectrum, &mut scratch)
            .expect("FFT buffers sized by the planner");
        for (m, c) in magnitude.iter_mut().zip(&spectrum) {
            *m = (c.re * c.re + c.im * c.im).sqrt();
        }
        for (v, f) in col.iter_mut().zip(bank) {
            let energy: f64 = f
                .weights
                .iter()
                .zip(&magnitude[f.start..])
                .map(|(w, m)| w * m)
                .sum();
            let db = 20.0 * energy.max(1e-5).log10() - REF_LEVEL_DB;
            let norm =
                (2.0 * MAX_ABS_VALUE) * ((db - MIN_LEVEL_DB) / -MIN_LEVEL_DB) - MAX_ABS_VALUE;
            *v = norm.clamp(-MAX_ABS_VALUE, MAX_ABS_VALUE) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spec's golden tone (`wav2lip-spec.md` §3.2), computed there with librosa (reflect)
    /// and independently with numpy.
    #[test]
    fn golden_tone_matches_the_spec() {
        let x: Vec<f32> = (0..16_000)
            .map(|n| {
                let t = n as f64 / 16_000.0;
                (0.5 * (2.0 * std::f64::consts::PI * 440.0 * t).sin()
                    + 0.25 * (2.0 * std::f64::consts::PI * 1234.5 * t).sin()) as f32
            })
            .collect();
        let mel = mel_spectrogram(&x);
        assert_eq!(mel.frames(), 81);
        let v = mel.as_slice();
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        let min = v.iter().copied().fold(f32::INFINITY, f32::min);
        let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-4;
        assert!(close(mean, -3.316411), "mean {mean}");
        assert!(close(f64::from(min), -4.0), "min {min}");
        assert!(close(f64::from(max), 2.216128), "max {max}");
        for (bin, t, want) in [
            (0, 0, -0.753225),
            (10, 40, 1.989764),
            (40, 40, -4.0),
            (79, 80, -2.474212),
        ] {
            let got = f64::from(mel.get(bin, t));
            assert!(close(got, want), "S[{bin},{t}] = {got}, want {want}");
        }
    }

    #[test]
    fn filterbank_has_the_published_support() {
        // First/last nonzero FFT bins (spec §3.2): filter 0 → 3–6, 1 → 5–8, 79 → 353–379.
        let bank = filterbank();
        let span = |i: usize| (bank[i].start, bank[i].start + bank[i].weights.len() - 1);
        assert_eq!(span(0), (3, 6));
        assert_eq!(span(1), (5, 8));
        assert_eq!(span(79), (353, 379));
    }

    #[test]
    fn reflect_padding_mirrors_without_repeating_the_edge() {
        // numpy.pad([0, 1, 2, 3], 5, 'reflect') -> [3 2 1 2 1 | 0 1 2 3 | 2 1 0 1 2]
        let idx: Vec<usize> = (0..14).map(|i| reflect(i, 5, 4)).collect();
        assert_eq!(idx, vec![1, 2, 3, 2, 1, 0, 1, 2, 3, 2, 1, 0, 1, 2]);
    }

    #[test]
    fn frame_count_follows_the_hop() {
        assert_eq!(mel_spectrogram(&vec![0.0; 3199]).frames(), 16);
        assert_eq!(mel_spectrogram(&vec![0.0; 64_000]).frames(), 321);
        assert_eq!(mel_spectrogram(&[]).frames(), 0);
        // Silence sits on the floor: 20·log10(1e-5) − 20 = −120 dB → −4.
        assert!(mel_spectrogram(&vec![0.0; 800])
            .as_slice()
            .iter()
            .all(|&v| v == -4.0));
    }

    #[test]
    fn windows_are_band_major() {
        let x: Vec<f32> = (0..8000).map(|n| (n as f32 * 0.1).sin()).collect();
        let mel = mel_spectrogram(&x);
        let w = mel.window(3, 16);
        assert_eq!(w.len(), 80 * 16);
        assert_eq!(w[0], mel.get(0, 3));
        assert_eq!(w[16 * 7 + 5], mel.get(7, 8));
    }
}
