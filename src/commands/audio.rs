//! `audio`: what an audio file decodes to, and how many frames it drives.

use std::path::PathBuf;
use std::time::Instant;

use lipsync::media::audio;

use super::{json_error, read_file, CliError};

#[derive(Debug, clap::Args)]
pub struct AudioArgs {
    /// Audio file (WAV, MP3, FLAC, Ogg Vorbis, M4A/AAC; recognised from its bytes).
    pub audio: PathBuf,
    /// Video frame rate: a number in (0, 60] or a fraction such as 30000/1001.
    #[arg(long, default_value = "25")]
    pub fps: audio::Fps,
    /// Longest accepted audio, in seconds.
    #[arg(long, default_value_t = audio::DEFAULT_MAX_SECONDS)]
    pub max_seconds: f64,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Run decode, resample and mel this many times and report the median times (benchmarks).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeat: u32,
}

/// One pass of the audio front end, for `lipsync audio`.
struct AudioRun {
    speech: audio::Speech,
    mel: audio::Mel,
    plan: audio::FramePlan,
    mel_time: std::time::Duration,
}

fn median_ms(runs: &[AudioRun], stage: impl Fn(&AudioRun) -> std::time::Duration) -> f64 {
    let mut v: Vec<f64> = runs.iter().map(|r| stage(r).as_secs_f64() * 1e3).collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn audio_info(a: AudioArgs) -> Result<(), CliError> {
    let result = (|| {
        let bytes = read_file(&a.audio)?;
        let mut runs = Vec::new();
        for _ in 0..a.repeat {
            let speech = audio::load(&bytes, a.max_seconds)?;
            let start = Instant::now();
            let mel = speech.mel();
            let mel_time = start.elapsed();
            let plan = audio::FramePlan::new(mel.frames(), a.fps)?;
            runs.push(AudioRun {
                speech,
                mel,
                plan,
                mel_time,
            });
        }
        Ok(runs)
    })();
    let runs = json_error(a.json, result)?;
    let decode = median_ms(&runs, |r| r.speech.decode_time);
    let resample = median_ms(&runs, |r| r.speech.resample_time);
    let mel_ms = median_ms(&runs, |r| r.mel_time);
    let total = median_ms(&runs, |r| {
        r.speech.decode_time + r.speech.resample_time + r.mel_time
    });
    let AudioRun {
        speech, mel, plan, ..
    } = &runs[0];
    let video_seconds = speech.seconds().max(plan.seconds(plan.len()));
    if a.json {
        let v = serde_json::json!({
            "path": a.audio,
            "container": speech.container,
            "codec": speech.codec,
            "sample_rate": speech.source_rate,
            "channels": speech.source_channels,
            "seconds": speech.seconds(),
            "mel_frames": mel.frames(),
            "fps": plan.fps().value(),
            "frames": plan.len(),
            "repeat": a.repeat,
            "median_ms": { "decode": decode, "resample": resample, "mel": mel_ms, "total": total },
        });
        println!("{v:#}");
    } else {
        println!("audio       {}", a.audio.display());
        println!(
            "format      {} ({}), {} Hz, {} channel{}",
            speech.container,
            speech.codec,
            speech.source_rate,
            speech.source_channels,
            if speech.source_channels == 1 { "" } else { "s" }
        );
        println!("duration    {:.3} s", speech.seconds());
        println!("mel         80 x {}", mel.frames());
        println!(
            "frames      {} at {} fps drawn by the model (video {:.2} s, last frame held)",
            plan.len(),
            plan.fps(),
            video_seconds
        );
        println!(
            "time        decode {decode:.1} ms, resample {resample:.1} ms, mel {mel_ms:.1} ms{}",
            if a.repeat > 1 {
                format!(" (median of {})", a.repeat)
            } else {
                String::new()
            }
        );
    }
    Ok(())
}
