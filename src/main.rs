//! The `lipsync` command line.
//!
//! Exit status: 0 on success, 2 on any error, 1 for usage errors (bad flags).

use std::path::PathBuf;
use std::process::ExitCode;

use std::time::Instant;

use clap::{Parser, Subcommand};
use lipsync::media::{self, audio};
use lipsync::model::{self, GeneratorWeights, Precision};

#[derive(Debug, Parser)]
#[command(
    name = "lipsync",
    version,
    about = "Wav2Lip lip-sync: speech + avatar photo in, talking video out"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Convert a Wav2Lip checkpoint (legacy or zip torch.save, whole-module pickle,
    /// TorchScript or safetensors) to safetensors, for fast start-up.
    Convert(ConvertArgs),
    /// Describe a checkpoint: format, whether BatchNorm is folded, tensors, parameters, dtype.
    Info(InfoArgs),
    /// Write deterministic random generator weights, to try the pipeline without the real
    /// checkpoint (the faces they draw are noise).
    InitWeights(InitWeightsArgs),
    /// Decode an audio file the way rendering will: what it is, its duration, the mel
    /// spectrogram size and how many video frames it drives.
    Audio(AudioArgs),
}

#[derive(Debug, clap::Args)]
struct ConvertArgs {
    /// Checkpoint to read (any supported form; recognised from its bytes).
    input: PathBuf,
    /// safetensors file to write (replaced atomically).
    output: PathBuf,
    /// Storage dtype of the written tensors.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Precision,
    /// Fold BatchNorm into the convolutions (102 tensors instead of 302; marked in the
    /// file's metadata, and read back as folded).
    #[arg(long)]
    fold_bn: bool,
}

#[derive(Debug, clap::Args)]
struct InfoArgs {
    /// Checkpoint to describe.
    checkpoint: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct InitWeightsArgs {
    /// safetensors file to write.
    output: PathBuf,
    /// Random seed; the same seed gives the same weights everywhere.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Debug, clap::Args)]
struct AudioArgs {
    /// Audio file (WAV, MP3, FLAC, Ogg Vorbis, M4A/AAC; recognised from its bytes).
    audio: PathBuf,
    /// Video frame rate: a number in (0, 60] or a fraction such as 30000/1001.
    #[arg(long, default_value = "25")]
    fps: audio::Fps,
    /// Longest accepted audio, in seconds.
    #[arg(long, default_value_t = audio::DEFAULT_MAX_SECONDS)]
    max_seconds: f64,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Run decode, resample and mel this many times and report the median times (benchmarks).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
}

/// Errors of the command line: whichever layer failed.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error(transparent)]
    Model(#[from] model::Error),
    #[error(transparent)]
    Media(#[from] media::Error),
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl CliError {
    fn kind(&self) -> &'static str {
        match self {
            CliError::Model(e) => e.kind(),
            CliError::Media(e) => e.kind(),
            CliError::Read { .. } => "io",
        }
    }
}

fn read_file(path: &std::path::Path) -> Result<Vec<u8>, CliError> {
    std::fs::read(path).map_err(|source| CliError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS // --help, --version
            };
        }
    };
    init_logging();
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn init_logging() {
    use tracing_subscriber::EnvFilter;
    // symphonia logs routine demuxer notes (junk skipped, streams found) at info/warn.
    let filter = EnvFilter::try_from_env("LIPSYNC_LOG")
        .unwrap_or_else(|_| EnvFilter::new("info,symphonia=error"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}

fn run(command: Command) -> Result<(), CliError> {
    match command {
        Command::Convert(a) => convert(a),
        Command::Info(a) => info(a),
        Command::InitWeights(a) => init_weights(a),
        Command::Audio(a) => audio_info(a),
    }
}

/// Prints `{"error", "error_type"}` on stdout for `--json` callers, then returns the error.
fn json_error<T>(json: bool, r: Result<T, CliError>) -> Result<T, CliError> {
    if let (true, Err(e)) = (json, &r) {
        println!(
            "{:#}",
            serde_json::json!({ "error": e.to_string(), "error_type": e.kind() })
        );
    }
    r
}

fn convert(a: ConvertArgs) -> Result<(), CliError> {
    let (weights, summary) = GeneratorWeights::from_file(&a.input)?;
    let weights = if a.fold_bn { weights.fold()? } else { weights };
    weights.save(&a.output, a.dtype.dtype())?;
    eprintln!(
        "wrote {} ({} tensors, {}, {}) from a {} checkpoint",
        a.output.display(),
        model::arch::tensor_specs(weights.is_folded()).len(),
        a.dtype.dtype().as_str(),
        if weights.is_folded() {
            "BatchNorm folded"
        } else {
            "unfolded"
        },
        summary.format,
    );
    Ok(())
}

fn info(a: InfoArgs) -> Result<(), CliError> {
    let (_, s) = json_error(
        a.json,
        GeneratorWeights::from_file(&a.checkpoint).map_err(CliError::from),
    )?;
    if a.json {
        let value = serde_json::json!({
            "path": a.checkpoint,
            "format": s.format,
            "folded": s.folded,
            "tensors": s.tensors,
            "parameters": s.parameters,
            "dtype": s.dtype,
            "module_prefix": s.module_prefix,
            "random_init_seed": s.random_init_seed,
        });
        println!("{value:#}");
    } else {
        println!("checkpoint  {}", a.checkpoint.display());
        println!("format      {}", s.format);
        println!("folded      {}", if s.folded { "yes" } else { "no" });
        println!("tensors     {}", s.tensors);
        println!("parameters  {}", thousands(s.parameters));
        println!("dtype       {}", s.dtype);
        if s.module_prefix {
            println!("keys        prefixed with `module.` (stripped)");
        }
        if let Some(seed) = s.random_init_seed {
            println!(
                "note        random test weights (seed {seed}): the faces they draw are noise"
            );
        }
    }
    Ok(())
}

fn init_weights(a: InitWeightsArgs) -> Result<(), CliError> {
    let weights = model::init::random_weights(a.seed)?;
    weights.save(&a.output, candle_core::DType::F32)?;
    eprintln!(
        "wrote random Wav2Lip weights (seed {}) to {}. They let the pipeline and the service \
         run end to end, but the faces they draw are noise: use the real checkpoint \
         (see weights/README.md) for real lip sync.",
        a.seed,
        a.output.display()
    );
    Ok(())
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

fn audio_info(a: AudioArgs) -> Result<(), CliError> {
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

/// 36298035 → "36,298,035".
fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}
