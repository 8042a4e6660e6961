//! Deterministic random generator weights, so the whole pipeline (and the service) can run
//! without the real, non-commercial checkpoint. The faces such weights draw are noise.
//!
//! Convolutions get PyTorch-like uniform initialisation (±1/√fan_in); BatchNorm γ and β are
//! drawn near 1 and 0; the running statistics are then *calibrated*: one forward pass over a
//! synthetic batch sets each layer's running mean and variance to the batch statistics of its
//! convolution output, so activations stay in range through all 50 layers, and the output
//! convolution is rescaled so that the sigmoid sees unit-variance inputs and does not saturate.
//!
//! Every number comes from SplitMix64 seeded by the seed and the tensor's key, so a given seed
//! gives the same weights on every machine and in every version that keeps this generator.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use super::arch::{self, LayerKind, FACE_CHANNELS, FACE_SIZE, MEL_BINS, MEL_STEPS};
use super::wav2lip::ConvBlock;
use super::weights::{GeneratorWeights, BN_EPS};
use super::{Result, Wav2Lip};

/// Frames in the calibration batch.
const CALIBRATION_FRAMES: usize = 8;

/// SplitMix64 (Steele, Lea, Flood 2014): small, fast and fully specified.
struct SplitMix64(u64);

impl SplitMix64 {
    fn new(seed: u64, key: &str) -> Self {
        // FNV-1a of the key, mixed with the seed.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in key.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        SplitMix64(seed ^ h)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * unit
    }
}

fn uniform(seed: u64, key: &str, shape: &[usize], lo: f32, hi: f32) -> Result<Tensor> {
    let mut rng = SplitMix64::new(seed, key);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.uniform(lo, hi)).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// Random, calibrated, unfolded generator weights (f32, CPU) for `seed`.
pub fn random_weights(seed: u64) -> Result<GeneratorWeights> {
    let mut raw = HashMap::new(); // conv weights and biases: a "folded" model with identity BN
    let mut bn = HashMap::new(); // path -> (gamma, beta)
    for (path, spec) in arch::layers() {
        let conv = spec.conv_prefix(&path);
        let shape = spec.weight_shape();
        let fan_in = match spec.kind {
            // What the layer sums over per output element, on average.
            LayerKind::ConvTranspose => {
                spec.cin * spec.kernel * spec.kernel / (spec.stride.0 * spec.stride.1)
            }
            _ => spec.cin * spec.kernel * spec.kernel,
        };
        let bound = 1.0 / (fan_in as f32).sqrt();
        let w_key = format!("{conv}.weight");
        let b_key = format!("{conv}.bias");
        raw.insert(w_key.clone(), uniform(seed, &w_key, &shape, -bound, bound)?);
        raw.insert(
            b_key.clone(),
            uniform(seed, &b_key, &[spec.cout], -bound, bound)?,
        );
        if spec.has_batch_norm() {
            let g = format!("{path}.conv_block.1.weight");
            let b = format!("{path}.conv_block.1.bias");
            bn.insert(
                path.clone(),
                (
                    uniform(seed, &g, &[spec.cout], 0.8, 1.2)?,
                    uniform(seed, &b, &[spec.cout], -0.1, 0.1)?,
                ),
            );
        }
    }

    let model = Wav2Lip::load(
        &GeneratorWeights::from_tensors(raw.clone(), true, None)?,
        &Device::Cpu,
        DType::F32,
    )?;
    let (mel, face) = calibration_batch(seed)?;
    // path -> (mean, var) of the conv output, or the output conv's (mean, std).
    let mut stats: HashMap<String, (Tensor, Tensor)> = HashMap::new();
    model.forward_with(&mel, &face, &mut |block: &ConvBlock, x: &Tensor| {
        let y = block.conv(x)?;
        let mean = y.mean_keepdim(0)?.mean_keepdim(2)?.mean_keepdim(3)?;
        let centred = y.broadcast_sub(&mean)?;
        let var = centred
            .sqr()?
            .mean_keepdim(0)?
            .mean_keepdim(2)?
            .mean_keepdim(3)?;
        let (std, y) = match bn.get(block.path()) {
            Some((gamma, beta)) => {
                let std = (&var + BN_EPS)?.sqrt()?;
                let g = gamma.reshape((1, (), 1, 1))?;
                let b = beta.reshape((1, (), 1, 1))?;
                let y = centred
                    .broadcast_div(&std)?
                    .broadcast_mul(&g)?
                    .broadcast_add(&b)?;
                (var, y)
            }
            None => {
                // The output conv: unit variance into the sigmoid.
                let std = (&var + 1e-12)?.sqrt()?;
                (std.clone(), centred.broadcast_div(&std)?)
            }
        };
        stats.insert(
            block.path().to_string(),
            (mean.flatten_all()?, std.flatten_all()?),
        );
        block.activate(y, x)
    })?;

    let mut tensors = HashMap::new();
    for (path, spec) in arch::layers() {
        let conv = spec.conv_prefix(&path);
        let w_key = format!("{conv}.weight");
        let b_key = format!("{conv}.bias");
        let (mean, second) = &stats[&path];
        if let Some((gamma, beta)) = bn.remove(&path) {
            tensors.insert(w_key.clone(), raw[&w_key].clone());
            tensors.insert(b_key.clone(), raw[&b_key].clone());
            let p = format!("{path}.conv_block.1");
            tensors.insert(format!("{p}.weight"), gamma);
            tensors.insert(format!("{p}.bias"), beta);
            tensors.insert(format!("{p}.running_mean"), mean.clone());
            tensors.insert(format!("{p}.running_var"), second.clone());
        } else {
            // y' = (W·x + b − mean) / std
            let w = raw[&w_key].broadcast_div(&second.reshape(((), 1, 1, 1))?)?;
            let b = ((&raw[&b_key] - mean)? / second)?;
            tensors.insert(w_key, w);
            tensors.insert(b_key, b);
        }
    }
    GeneratorWeights::from_tensors(tensors, false, Some(seed))
}

/// A synthetic batch in the ranges real inputs have: mel values in [−4, 2], faces in [0, 1]
/// with the lower half of the masked copy zeroed.
fn calibration_batch(seed: u64) -> Result<(Tensor, Tensor)> {
    let n = CALIBRATION_FRAMES;
    let mel = uniform(
        seed,
        "calibration.mel",
        &[n, 1, MEL_BINS, MEL_STEPS],
        -4.0,
        2.0,
    )?;
    let face = uniform(
        seed,
        "calibration.face",
        &[n, FACE_CHANNELS, FACE_SIZE, FACE_SIZE],
        0.0,
        1.0,
    )?;
    let half = FACE_SIZE / 2;
    let mask = Tensor::cat(
        &[
            Tensor::ones((1, 3, half, FACE_SIZE), DType::F32, &Device::Cpu)?,
            Tensor::zeros((1, 3, half, FACE_SIZE), DType::F32, &Device::Cpu)?,
        ],
        2,
    )?;
    let mask = Tensor::cat(
        &[
            &mask,
            &Tensor::ones((1, 3, FACE_SIZE, FACE_SIZE), DType::F32, &Device::Cpu)?,
        ],
        1,
    )?;
    Ok((mel, face.broadcast_mul(&mask)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_is_stable() {
        // First outputs of SplitMix64 for state 0 (reference values of the published algorithm).
        let mut r = SplitMix64(0);
        assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        let mut a = SplitMix64::new(7, "x");
        let mut b = SplitMix64::new(7, "x");
        assert_eq!(a.uniform(0.0, 1.0), b.uniform(0.0, 1.0));
    }
}
