//! The audio front end against librosa (tests/reference/audio_reference.py) and across formats.

mod common;

use common::media;

use lipsync::media::audio::{self, mel_spectrogram, Fps, FramePlan, Mel};
use lipsync::media::Error;

/// A reference mel from tests/fixtures/audio/mel.safetensors, as (80, T) values.
fn reference(name: &str) -> (Vec<f32>, usize) {
    let ck = lipsync::model::checkpoint::read(&common::fixture("audio/mel.safetensors")).unwrap();
    let t = ck.get(name).unwrap().to_tensor().unwrap();
    let frames = t.dims()[1];
    (t.flatten_all().unwrap().to_vec1::<f32>().unwrap(), frames)
}

/// (max, mean) absolute difference over the columns both spectrograms have.
fn diff(mel: &Mel, reference: &(Vec<f32>, usize)) -> (f32, f32) {
    let (r, rf) = reference;
    let t = mel.frames().min(*rf);
    let mut max = 0f32;
    let mut sum = 0f64;
    for bin in 0..80 {
        for col in 0..t {
            let d = (mel.get(bin, col) - r[bin * rf + col]).abs();
            max = max.max(d);
            sum += f64::from(d);
        }
    }
    (max, (sum / (80 * t) as f64) as f32)
}

const MAX_SECONDS: f64 = audio::DEFAULT_MAX_SECONDS;

#[test]
fn speech_mel_matches_librosa() {
    let speech = audio::load(&media("arctic_a0007.wav"), MAX_SECONDS).unwrap();
    assert_eq!(speech.samples.len(), 64_000);
    assert_eq!((speech.source_rate, speech.container), (16_000, "wav"));
    let mel = speech.mel();
    let reference = reference("arctic_16k");
    assert_eq!(mel.frames(), reference.1);
    let (max, mean) = diff(&mel, &reference);
    eprintln!("arctic 16 kHz WAV vs librosa: max {max:.2e} mean {mean:.2e}");
    assert!(max < 1e-4, "max abs difference {max}");
}

#[test]
fn golden_tone_matches_librosa() {
    let x: Vec<f32> = (0..16_000)
        .map(|n| {
            let t = n as f64 / 16_000.0;
            (0.5 * (2.0 * std::f64::consts::PI * 440.0 * t).sin()
                + 0.25 * (2.0 * std::f64::consts::PI * 1234.5 * t).sin()) as f32
        })
        .collect();
    let (max, _) = diff(&mel_spectrogram(&x), &reference("tone"));
    assert!(max < 1e-4, "{max}");
}

#[test]
fn every_format_gives_the_same_frames_and_close_mels() {
    let base = audio::load(&media("arctic_a0007.wav"), MAX_SECONDS).unwrap();
    let base_mel = base.mel();
    let base_plan = FramePlan::new(base_mel.frames(), Fps::DEFAULT).unwrap();
    assert_eq!(base_plan.len(), 97);
    let reference16 = (base_mel.as_slice().to_vec(), base_mel.frames());
    for (file, codec) in [
        ("arctic_a0007_44k_stereo.flac", "flac"),
        ("arctic_a0007_44k_stereo.mp3", "mp3"),
        ("arctic_a0007_44k_stereo.ogg", "vorbis"),
        ("arctic_a0007_44k_stereo.m4a", "aac"),
    ] {
        let s = audio::load(&media(file), MAX_SECONDS).unwrap();
        assert_eq!((s.source_rate, s.source_channels), (44_100, 2), "{file}");
        assert_eq!(s.codec, codec);
        let mel = s.mel();
        let plan = FramePlan::new(mel.frames(), Fps::DEFAULT).unwrap();
        let (max, mean) = diff(&mel, &reference16);
        eprintln!(
            "{file}: {} samples, {} frames, vs 16 kHz WAV mel: max {max:.3} mean {mean:.4}",
            s.samples.len(),
            plan.len()
        );
        assert!(
            plan.len().abs_diff(base_plan.len()) <= 1,
            "{file}: {} frames",
            plan.len()
        );
        // Lossless: resampling differences only; lossy codecs: their coding noise.
        let limit = if codec == "flac" { 0.005 } else { 0.1 };
        assert!(mean < limit, "{file}: mean mel difference {mean}");
    }
}

#[test]
fn resampled_speech_matches_librosa_resampling() {
    let mel = audio::load(&media("arctic_a0007_44k_stereo.flac"), MAX_SECONDS)
        .unwrap()
        .mel();
    let (max, mean) = diff(&mel, &reference("arctic_flac"));
    eprintln!("44.1 kHz FLAC: rubato vs librosa (soxr_hq): max {max:.3} mean {mean:.4}");
    assert!(mean < 1e-3 && max < 0.2, "max {max}, mean {mean}");
}

/// Lag (in 16 kHz samples) at which `b` best matches `a`, over the loud middle of the clip.
fn best_lag(a: &[f32], b: &[f32]) -> i64 {
    (-40i64..=40)
        .max_by(|&x, &y| {
            let score = |lag: i64| -> f64 {
                (8000..56000)
                    .map(|i| f64::from(a[i]) * f64::from(b[(i as i64 + lag) as usize]))
                    .sum()
            };
            score(x).total_cmp(&score(y))
        })
        .unwrap()
}

#[test]
fn encoder_delay_is_removed_so_speech_starts_at_zero() {
    let base = audio::load(&media("arctic_a0007.wav"), MAX_SECONDS)
        .unwrap()
        .samples;
    for file in [
        "arctic_a0007_44k_stereo.flac",
        "arctic_a0007_44k_stereo.mp3",
        "arctic_a0007_44k_stereo.ogg",
        "arctic_a0007_44k_stereo.m4a",
    ] {
        let s = audio::load(&media(file), MAX_SECONDS).unwrap().samples;
        assert_eq!(best_lag(&base, &s), 0, "{file}");
    }
}

fn wav_bytes(spec: hound::WavSpec, samples: &[f64]) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    let mut w = hound::WavWriter::new(&mut out, spec).unwrap();
    for &x in samples {
        for _ in 0..spec.channels {
            match (spec.sample_format, spec.bits_per_sample) {
                (hound::SampleFormat::Float, _) => w.write_sample(x as f32).unwrap(),
                (_, 8) => w
                    .write_sample((x * 128.0).round().clamp(-128.0, 127.0) as i8)
                    .unwrap(),
                (_, 16) => w
                    .write_sample((x * 32768.0).round().clamp(-32768.0, 32767.0) as i16)
                    .unwrap(),
                (_, bits) => {
                    let scale = (1i64 << (bits - 1)) as f64;
                    w.write_sample((x * scale).round().clamp(-scale, scale - 1.0) as i32)
                        .unwrap()
                }
            }
        }
    }
    w.finalize().unwrap();
    out.into_inner()
}

fn arctic_samples() -> Vec<f64> {
    audio::load(&media("arctic_a0007.wav"), MAX_SECONDS)
        .unwrap()
        .samples
        .iter()
        .map(|&x| f64::from(x))
        .collect()
}

#[test]
fn wav_of_every_bit_depth_and_channel_count_decodes() {
    let x = arctic_samples();
    let base = mel_spectrogram(&x.iter().map(|&v| v as f32).collect::<Vec<_>>());
    let base = (base.as_slice().to_vec(), base.frames());
    for (bits, format, channels, tol) in [
        (8, hound::SampleFormat::Int, 1, 1.0 / 128.0),
        (16, hound::SampleFormat::Int, 2, 1e-6),
        (24, hound::SampleFormat::Int, 1, 1e-6),
        (32, hound::SampleFormat::Int, 6, 1e-6),
        (32, hound::SampleFormat::Float, 3, 1e-7),
    ] {
        let spec = hound::WavSpec {
            channels,
            sample_rate: 16_000,
            bits_per_sample: bits,
            sample_format: format,
        };
        let s = audio::load(&wav_bytes(spec, &x), MAX_SECONDS)
            .unwrap_or_else(|e| panic!("{bits}-bit {format:?}: {e}"));
        assert_eq!(s.source_channels, channels);
        assert_eq!(s.samples.len(), x.len());
        let err = s
            .samples
            .iter()
            .zip(&x)
            .map(|(a, b)| (f64::from(*a) - b).abs())
            .fold(0.0, f64::max);
        assert!(err <= tol, "{bits}-bit {format:?} x{channels}: {err}");
        // 8-bit quantisation noise (−48 dB) lifts silent frames far above the −100 dB mel
        // floor, so only deeper formats are compared in the mel domain.
        if bits > 8 {
            let (_, mean) = diff(&s.mel(), &base);
            assert!(mean < 1e-4, "{bits}-bit: mel mean diff {mean}");
        }
    }
}

#[test]
fn streamed_wav_headers_without_a_length_decode() {
    let mut b = media("arctic_a0007.wav");
    let data = b.windows(4).position(|w| w == b"data").unwrap();
    b[data + 4..data + 8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(audio::load(&b, MAX_SECONDS).unwrap().samples.len(), 64_000);
}

#[test]
fn truncated_files_are_reported_as_truncated() {
    for file in [
        "arctic_a0007.wav",
        "arctic_a0007_44k_stereo.flac",
        "arctic_a0007_44k_stereo.mp3",
        "arctic_a0007_44k_stereo.ogg",
        "arctic_a0007_44k_stereo.m4a",
    ] {
        let b = media(file);
        for keep in [0.5, 0.9] {
            let cut = &b[..(b.len() as f64 * keep) as usize];
            match audio::load(cut, MAX_SECONDS) {
                Err(Error::TruncatedAudio(m)) => assert!(!m.is_empty()),
                other => panic!("{file} cut to {keep}: {:?}", other.map(|s| s.samples.len())),
            }
        }
    }
}

#[test]
fn bad_audio_gets_a_clear_error() {
    let kind = |b: &[u8], max: f64| audio::load(b, max).err().map(|e| e.kind());
    assert_eq!(kind(b"", MAX_SECONDS), Some("empty_audio"));
    let png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x10\0\0\0\x10\x08\x02";
    assert_eq!(kind(png, MAX_SECONDS), Some("not_audio"));
    assert_eq!(
        kind(b"just some text, not audio", MAX_SECONDS),
        Some("not_audio")
    );
    // Longer than the limit: refused from the header, before decoding.
    let e = audio::load(&media("arctic_a0007.wav"), 1.5).unwrap_err();
    assert!(
        matches!(e, Error::AudioTooLong { seconds, max_seconds } if seconds == 4.0 && max_seconds == 1.5)
    );
    assert_eq!(
        kind(&media("arctic_a0007_44k_stereo.mp3"), 1.5),
        Some("audio_too_long")
    );
    // Shorter than one 16-column mel window (0.1875 s).
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 16_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    assert_eq!(
        kind(&wav_bytes(spec, &[0.1; 2999]), MAX_SECONDS),
        Some("audio_too_short")
    );
    assert!(audio::load(&wav_bytes(spec, &[0.1; 3000]), MAX_SECONDS).is_ok());
    assert_eq!(kind(&wav_bytes(spec, &[]), MAX_SECONDS), Some("no_samples"));
    // NaN in a float WAV.
    let fspec = hound::WavSpec {
        sample_format: hound::SampleFormat::Float,
        bits_per_sample: 32,
        ..spec
    };
    let mut x = vec![0.1; 8000];
    x[100] = f64::NAN;
    assert_eq!(
        kind(&wav_bytes(fspec, &x), MAX_SECONDS),
        Some("non_finite_audio")
    );
}
