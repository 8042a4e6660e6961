//! Helpers shared by the integration tests: fixture paths and expected values written by
//! `tests/reference/wav2lip_reference.py`.
#![allow(dead_code)]

pub mod pg;
pub mod server;

use std::path::PathBuf;

use candle_core::{DType, Tensor};
use sha2::{Digest, Sha256};

pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// Every checkpoint form the reference script writes: (file, expected format, `module.` prefix).
pub const CHECKPOINT_FORMS: &[(&str, &str, bool)] = &[
    ("legacy_module_prefix.pth", "legacy-torch-save", true),
    ("legacy_plain.pth", "legacy-torch-save", false),
    ("legacy_bare.pth", "legacy-torch-save", false),
    ("zip_dict.pt", "zip-torch-save", false),
    ("zip_bare.pt", "zip-torch-save", false),
    ("zip_module.pt", "zip-module-pickle", false),
    ("torchscript.pt", "torchscript", false),
];

pub fn checkpoint(name: &str) -> PathBuf {
    fixture(&format!("checkpoints/{name}"))
}

/// `expected.json`: state-dict key -> (shape, SHA-256 of contiguous f32 bytes).
pub fn expected_tensors() -> Vec<(String, Vec<usize>, String)> {
    let text = std::fs::read_to_string(checkpoint("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["tensors"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, e)| {
            let shape = e["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            (k.clone(), shape, e["sha256"].as_str().unwrap().to_string())
        })
        .collect()
}

pub fn sha256_f32(t: &Tensor) -> String {
    let v = t
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A tensor from `parity.safetensors` (inputs and goldens of the reference forward).
pub fn parity(name: &str) -> Tensor {
    let ck = lipsync::model::checkpoint::read(&fixture("parity.safetensors")).unwrap();
    ck.get(name)
        .unwrap_or_else(|| panic!("{name} not in parity.safetensors"))
        .to_tensor()
        .unwrap()
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// A file of `tests/media`.
pub fn media_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/media")
        .join(name)
}

/// The bytes of a file of `tests/media`.
pub fn media(name: &str) -> Vec<u8> {
    std::fs::read(media_path(name)).unwrap()
}

/// Runs the `lipsync` binary.
pub fn lipsync(args: &[&dyn AsRef<std::ffi::OsStr>]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_lipsync"))
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .unwrap()
}

/// The Python with PyTorch. `LIPSYNC_TORCH_PYTHON` set (as `scripts/test.sh` does, with the
/// venv it makes): that Python, which must have torch and numpy (the test fails otherwise, so
/// the suite never skips these silently). Unset: `python3` if it has them, else `None`, after
/// saying SKIPPED (a bare `cargo test` on a machine without PyTorch passes).
pub fn torch_python() -> Option<String> {
    let set = std::env::var("LIPSYNC_TORCH_PYTHON").ok();
    let python = set.clone().unwrap_or_else(|| "python3".into());
    let o = std::process::Command::new(&python)
        .args(["-c", "import torch, numpy"])
        .output();
    let ok = o.as_ref().is_ok_and(|o| o.status.success());
    if !ok && set.is_some() {
        panic!(
            "LIPSYNC_TORCH_PYTHON={python} cannot import torch and numpy: {}",
            o.map(|o| text(&o.stderr)).unwrap_or_else(|e| e.to_string())
        );
    }
    if !ok {
        eprintln!("SKIPPED: no PyTorch (set LIPSYNC_TORCH_PYTHON to a Python that has it)");
    }
    ok.then_some(python)
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A 16-bit WAV of interleaved samples in [-1, 1].
pub fn wav(samples: &[f32], rate: u32, channels: u16) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    let spec = hound::WavSpec {
        channels,
        sample_rate: rate,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::new(&mut out, spec).unwrap();
    for s in samples {
        w.write_sample((s.clamp(-1.0, 1.0) * 32767.0).round() as i16)
            .unwrap();
    }
    w.finalize().unwrap();
    out.into_inner()
}

/// The complete top-level boxes at the start of an MP4 (or a prefix of one), in order.
pub fn top_level_boxes(bytes: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    let mut pos = 0usize;
    while pos + 8 <= bytes.len() {
        let size = u32::from_be_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
        if size < 8 || pos + size > bytes.len() {
            break;
        }
        out.push(String::from_utf8_lossy(&bytes[pos + 4..pos + 8]).into_owned());
        pos += size;
    }
    out
}

/// ffprobe's JSON for the streams of `path` (with a counted video frame total).
pub fn probe(path: &std::path::Path) -> serde_json::Value {
    let out = std::process::Command::new("ffprobe")
        .args([
            "-v",
            "error",
            "-count_frames",
            "-show_streams",
            "-show_format",
            "-of",
            "json",
        ])
        .arg(path)
        .output()
        .expect("ffprobe is needed for these tests (scripts/test.sh installs it)");
    assert!(out.status.success(), "ffprobe: {}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

pub fn stream<'a>(p: &'a serde_json::Value, kind: &str) -> &'a serde_json::Value {
    p["streams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["codec_type"] == kind)
        .unwrap_or_else(|| panic!("no {kind} stream"))
}

pub fn num(v: &serde_json::Value) -> f64 {
    v.as_str()
        .map_or_else(|| v.as_f64().unwrap(), |s| s.parse().unwrap())
}

/// The decoded video as RGB frames.
pub fn decode_frames(path: &std::path::Path, width: usize, height: usize) -> Vec<Vec<u8>> {
    let out = std::process::Command::new("ffmpeg")
        .args(["-v", "error", "-i"])
        .arg(path)
        .args(["-map", "0:v", "-f", "rawvideo", "-pix_fmt", "rgb24", "-"])
        .output()
        .unwrap();
    out.stdout
        .chunks_exact(width * height * 3)
        .map(<[u8]>::to_vec)
        .collect()
}

/// Test weights whose output convolution overflows in f16 (finite in f32).
pub fn overflowing_checkpoint(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("overflow.safetensors");
    let ck = lipsync::model::checkpoint::read(&checkpoint("zip_bare.pt")).unwrap();
    let tensors: Vec<(String, candle_core::Tensor)> = ck
        .tensors
        .iter()
        .filter(|(k, _)| !k.ends_with("num_batches_tracked"))
        .map(|(k, t)| {
            let mut v = t.to_tensor().unwrap();
            if k == "output_block.0.conv_block.0.weight" {
                v = (v * 1e5).unwrap();
            }
            (k.clone(), v)
        })
        .collect();
    lipsync::model::checkpoint::write_safetensors(&path, &tensors, &Default::default()).unwrap();
    path
}

/// The keys and shapes of a small SRVGGNetCompact (F features, K body convolutions, upscale s).
pub fn compact_tensors(f: usize, k: usize, s: usize) -> Vec<(String, Vec<usize>)> {
    let mut t = Vec::new();
    for i in 0..=k {
        let cin = if i == 0 { 3 } else { f };
        t.push((format!("body.{}.weight", 2 * i), vec![f, cin, 3, 3]));
        t.push((format!("body.{}.bias", 2 * i), vec![f]));
        t.push((format!("body.{}.weight", 2 * i + 1), vec![f]));
    }
    t.push((
        format!("body.{}.weight", 2 * k + 2),
        vec![3 * s * s, f, 3, 3],
    ));
    t.push((format!("body.{}.bias", 2 * k + 2), vec![3 * s * s]));
    t
}

/// Writes `keys` as a safetensors checkpoint, values from `fill(key, index)`.
pub fn write_checkpoint(
    path: &std::path::Path,
    keys: &[(String, Vec<usize>)],
    fill: &dyn Fn(&str, usize) -> f32,
) {
    let tensors: Vec<(String, candle_core::Tensor)> = keys
        .iter()
        .map(|(k, shape)| {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n).map(|i| fill(k, i)).collect();
            let t = candle_core::Tensor::from_vec(v, shape.as_slice(), &candle_core::Device::Cpu)
                .unwrap();
            (k.clone(), t)
        })
        .collect();
    lipsync::model::checkpoint::write_safetensors(path, &tensors, &Default::default()).unwrap();
}

/// A small Real-ESRGAN SRVGGNetCompact (x2, 4 features, 2 body convolutions) saved as
/// `path`: every convolution zero, so it adds nothing to its nearest-neighbour base, except the
/// last one's bias on the red output channels, `red` (then clamped): the enhanced face is the
/// input repeated 2 x 2 with its red raised by `red`.
pub fn tiny_enhancer(path: &std::path::Path, red: f32) {
    let keys = compact_tensors(4, 2, 2);
    let last_bias = keys[keys.len() - 1].0.clone();
    let prelu = ["body.1.weight", "body.3.weight", "body.5.weight"];
    write_checkpoint(path, &keys, &|k, i| {
        if prelu.contains(&k) {
            0.25
        } else if k == last_bias && i < 4 {
            // Output channels 0..4 are red's four sub-pixels (`c·s² + i·s + j`).
            red
        } else {
            0.0
        }
    });
}
