//! The `lipsync` command line.
//!
//! Exit status: 0 on success, 2 on any error, 1 for usage errors (bad flags).

mod commands;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use commands::CliError;

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
    /// Run the HTTP service: POST speech and a photo, get the video streamed back.
    #[command(after_help = "Logging: LIPSYNC_LOG sets the log filter (default: info).")]
    Serve(Box<lipsync::server::ServeArgs>),
    /// Render a talking-head video from speech and a photo (or many, with --jobs).
    Render(Box<commands::render::RenderArgs>),
    /// Find the face in a photo and print its box, to pin it with --box.
    Detect(commands::render::DetectArgs),
    /// Convert a Wav2Lip checkpoint (legacy or zip torch.save, whole-module pickle,
    /// TorchScript or safetensors) to safetensors, for fast start-up.
    Convert(commands::checkpoint::ConvertArgs),
    /// Describe a checkpoint: format, whether BatchNorm is folded, tensors, parameters, dtype.
    Info(commands::checkpoint::InfoArgs),
    /// Write deterministic random generator weights, to try the pipeline without the real
    /// checkpoint (the faces they draw are noise).
    InitWeights(commands::checkpoint::InitWeightsArgs),
    /// Measure model frames/s (by batch, precision, instances), encoder frames/s and
    /// end-to-end time and time to first byte.
    Bench(Box<commands::bench::BenchArgs>),
    /// Decode an audio file the way rendering will: what it is, its duration, the mel
    /// spectrogram size and how many video frames it drives.
    Audio(commands::audio::AudioArgs),
    /// Stream speech to a running server's live session (`GET /v1/stream`) in real time and
    /// write the video that comes back; prints latency and late frames.
    Stream(Box<commands::stream::StreamArgs>),
    /// Run one enhancer (Real-ESRGAN, ...) on one image as given, on the CPU in f32: for
    /// checks, scripts and comparing models.
    Enhance(commands::enhance::EnhanceArgs),
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

fn serve(args: lipsync::server::ServeArgs) -> Result<(), CliError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("lipsync-http")
        .build()
        .map_err(|e| CliError::Serve(e.to_string()))?;
    runtime
        .block_on(lipsync::server::run(args))
        .map_err(|e| CliError::Serve(e.to_string()))
}

fn run(command: Command) -> Result<(), CliError> {
    match command {
        Command::Serve(a) => serve(*a),
        Command::Render(a) => commands::render::render(*a),
        Command::Detect(a) => commands::render::detect(a),
        Command::Convert(a) => commands::checkpoint::convert(a),
        Command::Info(a) => commands::checkpoint::info(a),
        Command::InitWeights(a) => commands::checkpoint::init_weights(a),
        Command::Audio(a) => commands::audio::audio_info(a),
        Command::Bench(a) => commands::bench::bench(*a),
        Command::Stream(a) => commands::stream::stream(*a),
        Command::Enhance(a) => commands::enhance::enhance(a),
    }
}
