//! Which mel window drives which video frame (`wav2lip-spec.md` §4.3).
//!
//! `inference.py` walks i = 0, 1, 2, …: the window for frame i starts at mel column
//! `int(i * (80 / fps))` (the ratio is computed first, in double precision, which differs from
//! `i * 80 / fps` at some fractional rates); when a window would run past the end, the last 16
//! columns are taken instead and the walk stops. One video frame per window.

use std::fmt;
use std::str::FromStr;

use super::mel::MEL_FPS;
use crate::media::Error;

/// Mel columns per model input window (200 ms).
pub const WINDOW: usize = 16;

/// Highest frame rate accepted.
pub const MAX_FPS: f64 = 60.0;

/// A video frame rate: the value the frame plan uses, and the exact rational the encoder
/// timestamps with (29.97 → 30000/1001, as NTSC rates really are).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fps {
    value: f64,
    num: u32,
    den: u32,
}

impl Fps {
    /// Wav2Lip's default for still images.
    pub const DEFAULT: Fps = Fps {
        value: 25.0,
        num: 25,
        den: 1,
    };

    /// A rate given as a number, e.g. 25 or 29.97; must lie in (0, 60].
    pub fn new(value: f64) -> Result<Self, Error> {
        if !(value.is_finite() && value > 0.0 && value <= MAX_FPS) {
            return Err(Error::BadFps(format!(
                "{value} is not a frame rate in (0, {MAX_FPS}]"
            )));
        }
        let (num, den) = rational(value)
            .ok_or_else(|| Error::BadFps(format!("{value} frames per second is too slow")))?;
        Ok(Fps { value, num, den })
    }

    /// A rate given as an exact fraction, e.g. 30000/1001.
    pub fn from_ratio(num: u32, den: u32) -> Result<Self, Error> {
        if den == 0 {
            return Err(Error::BadFps(format!("{num}/{den} divides by zero")));
        }
        let mut fps = Fps::new(f64::from(num) / f64::from(den))?;
        let g = gcd(num, den);
        (fps.num, fps.den) = (num / g, den / g);
        Ok(fps)
    }

    pub fn value(&self) -> f64 {
        self.value
    }

    /// `(numerator, denominator)` in lowest terms.
    pub fn ratio(&self) -> (u32, u32) {
        (self.num, self.den)
    }

    /// Presentation time of frame `i`, in seconds.
    pub fn seconds(&self, i: usize) -> f64 {
        i as f64 * f64::from(self.den) / f64::from(self.num)
    }
}

impl Default for Fps {
    fn default() -> Self {
        Fps::DEFAULT
    }
}

impl fmt::Display for Fps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.value)
    }
}

impl FromStr for Fps {
    type Err = Error;

    /// `25`, `29.97` or `30000/1001`.
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || {
            Error::BadFps(format!(
                "{s:?} is not a frame rate (e.g. 25, 29.97, 30000/1001)"
            ))
        };
        let s = s.trim();
        match s.split_once('/') {
            Some((n, d)) => Fps::from_ratio(
                n.trim().parse().map_err(|_| bad())?,
                d.trim().parse().map_err(|_| bad())?,
            ),
            None => Fps::new(s.parse().map_err(|_| bad())?),
        }
    }
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a.max(1)
    } else {
        gcd(b, a % b)
    }
}

/// The exact fraction for a decimal rate: NTSC rates (23.976, 29.97, 47.952, 59.94) become
/// `n·1000/1001`; anything else the fraction of its value to 1/1 000 000.
fn rational(value: f64) -> Option<(u32, u32)> {
    let ntsc = (value * 1.001).round();
    if ntsc >= 1.0 && (ntsc / 1.001 - value).abs() < 0.0006 && (ntsc / 1.001 - ntsc).abs() > 0.01 {
        return Some((ntsc as u32 * 1000, 1001));
    }
    let num = (value * 1e6).round() as u32;
    let g = gcd(num, 1_000_000);
    (num > 0).then_some((num / g, 1_000_000 / g))
}

/// Frame i uses mel columns `starts[i] .. starts[i] + 16`.
#[derive(Debug, Clone, PartialEq)]
pub struct FramePlan {
    starts: Vec<usize>,
    fps: Fps,
    mel_frames: usize,
}

impl FramePlan {
    /// The original inference's windows for a mel spectrogram of `mel_frames` columns.
    pub fn new(mel_frames: usize, fps: Fps) -> Result<Self, Error> {
        if mel_frames < WINDOW {
            return Err(Error::AudioTooShort {
                seconds: (mel_frames.saturating_sub(1)) as f64 / MEL_FPS,
                min_seconds: (WINDOW - 1) as f64 / MEL_FPS,
            });
        }
        let step = MEL_FPS / fps.value; // 80 / fps, ratio first, as the original
        let mut starts = Vec::new();
        for i in 0usize.. {
            let start = (i as f64 * step) as usize;
            if start + WINDOW > mel_frames {
                starts.push(mel_frames - WINDOW);
                break;
            }
            starts.push(start);
        }
        Ok(FramePlan {
            starts,
            fps,
            mel_frames,
        })
    }

    /// Number of video frames the model draws.
    pub fn len(&self) -> usize {
        self.starts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.starts.is_empty()
    }

    /// First mel column of frame `i`'s window.
    pub fn start(&self, i: usize) -> usize {
        self.starts[i]
    }

    pub fn starts(&self) -> &[usize] {
        &self.starts
    }

    pub fn fps(&self) -> Fps {
        self.fps
    }

    pub fn mel_frames(&self) -> usize {
        self.mel_frames
    }

    /// Presentation time of frame `i`, in seconds.
    pub fn seconds(&self, i: usize) -> f64 {
        self.fps.seconds(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The original loop, transcribed literally, as the oracle.
    fn original(t_mel: usize, fps: f64) -> Vec<usize> {
        let mel_idx_multiplier = 80.0 / fps;
        let mut out = Vec::new();
        let mut i = 0usize;
        loop {
            let start_idx = (i as f64 * mel_idx_multiplier) as usize;
            if start_idx + 16 > t_mel {
                out.push(t_mel - 16);
                break;
            }
            out.push(start_idx);
            i += 1;
        }
        out
    }

    fn plan(seconds: f64, fps: &str) -> FramePlan {
        let samples = (seconds * 16_000.0).round() as usize;
        FramePlan::new(1 + samples / 200, fps.parse().unwrap()).unwrap()
    }

    #[test]
    fn counts_match_the_original_inference() {
        assert_eq!(plan(4.0, "25").len(), 97);
        assert_eq!(plan(1.0, "25").len(), 22);
        assert_eq!(plan(10.0, "25").len(), 247);
        assert_eq!(plan(10.0, "29.97").len(), 296);
        assert_eq!(plan(10.0, "30").len(), 296);
        assert_eq!(plan(60.0, "25").len(), 1497);
    }

    #[test]
    fn windows_equal_the_original_loop_at_many_rates() {
        for fps in [
            "25",
            "29.97",
            "30000/1001",
            "24",
            "23.976",
            "12.5",
            "59.94",
            "60",
            "7",
            "0.5",
        ] {
            let f: Fps = fps.parse().unwrap();
            for t_mel in [16, 17, 81, 321, 801, 4801] {
                let p = FramePlan::new(t_mel, f).unwrap();
                assert_eq!(
                    p.starts(),
                    original(t_mel, f.value()).as_slice(),
                    "{fps} {t_mel}"
                );
            }
        }
    }

    #[test]
    fn the_last_window_is_the_last_16_columns() {
        let p = plan(4.0, "25");
        assert_eq!(p.start(p.len() - 1), p.mel_frames() - WINDOW);
        assert!(p.starts().windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn presentation_times_are_exact_for_ntsc() {
        let f: Fps = "29.97".parse().unwrap();
        assert_eq!(f.ratio(), (30000, 1001));
        assert_eq!("30000/1001".parse::<Fps>().unwrap().ratio(), (30000, 1001));
        assert_eq!("23.976".parse::<Fps>().unwrap().ratio(), (24000, 1001));
        assert_eq!("12.5".parse::<Fps>().unwrap().ratio(), (25, 2));
        assert_eq!("25".parse::<Fps>().unwrap().ratio(), (25, 1));
        assert_eq!("60/2".parse::<Fps>().unwrap().ratio(), (30, 1));
        assert!((f.seconds(30000) - 1001.0).abs() < 1e-9);
        assert_eq!(plan(4.0, "25").seconds(96), 3.84);
    }

    #[test]
    fn bad_rates_and_too_little_audio_are_errors() {
        for s in [
            "0", "-25", "61", "nan", "inf", "abc", "30/0", "", "1e9", "1e-9",
        ] {
            assert!(matches!(s.parse::<Fps>(), Err(Error::BadFps(_))), "{s}");
        }
        assert!(matches!(
            FramePlan::new(15, Fps::DEFAULT),
            Err(Error::AudioTooShort { .. })
        ));
        // Exactly one window of audio: the original still emits two frames (i = 1 runs past
        // the end and takes the last 16 columns again).
        assert_eq!(FramePlan::new(16, Fps::DEFAULT).unwrap().starts(), &[0, 0]);
    }
}
