//! Helpers shared by the integration tests: fixture paths and expected values written by
//! `tests/reference/wav2lip_reference.py`.
#![allow(dead_code)]

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
