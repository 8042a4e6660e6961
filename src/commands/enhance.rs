//! `enhance`: one enhancer on one image, as given — for checks, scripts and comparing models.

use std::path::PathBuf;
use std::time::Instant;

use lipsync::media::image::{self, Frame};
use lipsync::model::enhancer;

use super::{json_error, read_file, CliError};

#[derive(Debug, clap::Args)]
pub struct EnhanceArgs {
    /// The enhancer's checkpoint, as published (Real-ESRGAN's `.pth`, ...); its kind is
    /// recognised from its keys.
    #[arg(long, value_name = "FILE")]
    pub enhancer_checkpoint: PathBuf,
    /// The image to enhance (PNG, JPEG or WebP), at its own size.
    #[arg(long, value_name = "IN")]
    pub image: PathBuf,
    /// Where to write the enhanced image (8-bit RGB PNG).
    #[arg(long, value_name = "OUT.png")]
    pub out: PathBuf,
    /// Print a JSON summary (or `{"error", "error_type"}`) on stdout.
    #[arg(long)]
    pub json: bool,
}

/// The largest image taken (about 16 megapixels): the output is up to 16 times larger.
const MAX_PIXELS: u64 = 4096 * 4096;

pub fn enhance(a: EnhanceArgs) -> Result<(), CliError> {
    json_error(a.json, run(&a)).map(|summary| {
        if a.json {
            println!("{summary:#}");
        }
    })
}

fn run(a: &EnhanceArgs) -> Result<serde_json::Value, CliError> {
    let started = Instant::now();
    let e = enhancer::load(&a.enhancer_checkpoint)?;
    let loaded = started.elapsed().as_secs_f64();
    let frame = image::decode(&read_file(&a.image)?, MAX_PIXELS)?;
    let (w, h) = (frame.width as usize, frame.height as usize);
    e.net.check_size(h, w)?;
    let started = Instant::now();
    let out = e.net.forward_cpu(1, h, w, &to_planes(&frame))?;
    let seconds = started.elapsed().as_secs_f64();
    let s = e.net.scale();
    let enhanced = Frame::new(
        (w * s) as u32,
        (h * s) as u32,
        enhancer::planar_to_rgb8(&out),
    );
    enhanced
        .save_png(&a.out)
        .map_err(|source| CliError::Write {
            path: a.out.clone(),
            source,
        })?;
    eprintln!(
        "enhanced {} ({w}x{h}) into {} ({}x{}) with {} ({}) in {seconds:.2} s",
        a.image.display(),
        a.out.display(),
        enhanced.width,
        enhanced.height,
        e.name,
        e.net.describe(),
    );
    Ok(serde_json::json!({
        "enhancer": e.name,
        "kind": e.kind(),
        "architecture": e.net.describe(),
        "scale": s,
        "multiply_adds": e.net.multiply_adds(h, w),
        "input": { "width": w, "height": h },
        "output": { "width": enhanced.width, "height": enhanced.height, "path": a.out },
        "load_seconds": loaded,
        "seconds": seconds,
        "device": "cpu",
        "dtype": "f32",
    }))
}

/// 8-bit RGB → `(1, 3, h, w)` in [0, 1].
fn to_planes(f: &Frame) -> Vec<f32> {
    let n = f.width as usize * f.height as usize;
    let mut out = vec![0f32; 3 * n];
    for (i, px) in f.rgb.chunks_exact(3).enumerate() {
        for c in 0..3 {
            out[c * n + i] = f32::from(px[c]) / 255.0;
        }
    }
    out
}
