//! The `lipsync` command line.
//!
//! Exit status: 0 on success, 2 on any error, 1 for usage errors (bad flags).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
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
    let filter = EnvFilter::try_from_env("LIPSYNC_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}

fn run(command: Command) -> Result<(), model::Error> {
    match command {
        Command::Convert(a) => convert(a),
        Command::Info(a) => info(a),
        Command::InitWeights(a) => init_weights(a),
    }
}

fn convert(a: ConvertArgs) -> Result<(), model::Error> {
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

fn info(a: InfoArgs) -> Result<(), model::Error> {
    let result = GeneratorWeights::from_file(&a.checkpoint);
    if a.json {
        let value = match &result {
            Ok((_, s)) => serde_json::json!({
                "path": a.checkpoint,
                "format": s.format,
                "folded": s.folded,
                "tensors": s.tensors,
                "parameters": s.parameters,
                "dtype": s.dtype,
                "module_prefix": s.module_prefix,
                "random_init_seed": s.random_init_seed,
            }),
            Err(e) => serde_json::json!({ "error": e.to_string(), "error_type": e.kind() }),
        };
        println!("{value:#}");
    }
    let (_, s) = result?;
    if !a.json {
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

fn init_weights(a: InitWeightsArgs) -> Result<(), model::Error> {
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
