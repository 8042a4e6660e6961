//! Small enhancer checkpoints for unit tests.

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use crate::model::checkpoint::{self, Checkpoint};

/// A deterministic checkpoint of the given (key, shape) list: weights small and
/// varied, PReLU slopes in [0, 0.25).
pub(crate) fn checkpoint(keys: &[(String, Vec<usize>)]) -> Checkpoint {
    let mut state = 0x9e37_79b9_u32;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        f32::from(state as u16) / 65536.0
    };
    let tensors: HashMap<String, Tensor> = keys
        .iter()
        .map(|(k, shape)| {
            let n: usize = shape.iter().product();
            let fan_in = shape.iter().skip(1).product::<usize>().max(1) as f32;
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    if shape.len() == 1 && !k.ends_with(".bias") {
                        next() * 0.25
                    } else {
                        (next() - 0.5) * 2.0 / fan_in.sqrt()
                    }
                })
                .collect();
            (
                k.clone(),
                Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).unwrap(),
            )
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("net.safetensors");
    candle_core::safetensors::save(&tensors, &path).unwrap();
    checkpoint::read(&path).unwrap()
}

/// SRVGGNetCompact's tensors with `feat` features, `k` body convolutions, upscale `s`.
pub(crate) fn compact_keys(feat: usize, k: usize, s: usize) -> Vec<(String, Vec<usize>)> {
    super::esrgan::compact_keys(feat, k, 3 * s * s)
}
