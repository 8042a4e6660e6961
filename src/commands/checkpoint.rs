//! `convert`, `info`, `init-weights`: checkpoints.

use std::path::PathBuf;

use lipsync::config::choice;
use lipsync::model::{self, GeneratorWeights, Precision};

use super::{json_error, thousands, CliError};

#[derive(Debug, clap::Args)]
pub struct ConvertArgs {
    /// Checkpoint to read (any supported form; recognised from its bytes).
    pub input: PathBuf,
    /// safetensors file to write (replaced atomically).
    pub output: PathBuf,
    /// Storage dtype of the written tensors.
    #[arg(long, default_value = "f32", value_parser = choice::<Precision>(Precision::NAMES))]
    pub dtype: Precision,
    /// Fold BatchNorm into the convolutions (102 tensors instead of 302; marked in the
    /// file's metadata, and read back as folded).
    #[arg(long)]
    pub fold_bn: bool,
}

#[derive(Debug, clap::Args)]
pub struct InfoArgs {
    /// Checkpoint to describe.
    pub checkpoint: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct InitWeightsArgs {
    /// safetensors file to write.
    pub output: PathBuf,
    /// Random seed; the same seed gives the same weights everywhere.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

pub fn convert(a: ConvertArgs) -> Result<(), CliError> {
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

pub fn info(a: InfoArgs) -> Result<(), CliError> {
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

pub fn init_weights(a: InitWeightsArgs) -> Result<(), CliError> {
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
