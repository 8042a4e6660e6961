//! What a model instance runs: a small trait over the model, so the pool (warm-up, padding,
//! precision fallback, out-of-memory splitting, restarts) does not depend on one backend, and
//! tests can drive it with doubles that fail or panic on cue.
//!
//! [`Wav2LipLoader`] is the production backend: the candle generator (own CPU pass, own cuDNN
//! path or candle's operations) on the configured device.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::Error;
use crate::model::arch::{FACE_CHANNELS, FACE_SIZE, MEL_BINS, MEL_STEPS};
use crate::model::{self, DeviceKind, GeneratorWeights, Precision, Wav2Lip};

/// Values in one frame's mel window, face input and prediction.
pub const MEL_LEN: usize = MEL_BINS * MEL_STEPS;
pub const FACE_LEN: usize = FACE_CHANNELS * FACE_SIZE * FACE_SIZE;
pub const PRED_LEN: usize = 3 * FACE_SIZE * FACE_SIZE;

/// One loaded model, owned by one instance thread.
pub trait Model: Send {
    /// The dtype it computes in.
    fn dtype(&self) -> DType;
    /// Its convolution path (`cpu`, `cudnn`, `candle`, ...), for `/info`.
    fn conv_path(&self) -> &'static str;
    /// Predictions `(n, 3, 96, 96)` in f32 for `n` mel windows (`n * MEL_LEN` values) and
    /// face inputs (`n * FACE_LEN`).
    fn predict(&mut self, n: usize, mel: Vec<f32>, face: Vec<f32>) -> Result<Vec<f32>, Error>;
    /// Switches to the reference path after the fast one failed; `false` when it already
    /// runs the reference path (nothing left to fall back to).
    fn use_reference_path(&mut self) -> bool;
    /// Warm-up is over: batch sizes not seen yet must not start an algorithm search in the
    /// middle of a request.
    fn finish_warm_up(&mut self) {}
}

/// Makes models for instances (and their f32 fallback copies).
pub trait Loader: Send + Sync {
    fn load(&self, precision: Precision) -> Result<Box<dyn Model>, Error>;
}

/// The Wav2Lip generator on a device.
pub struct Wav2LipLoader {
    pub weights: Arc<GeneratorWeights>,
    pub device: DeviceKind,
    /// The largest batch the instances run (the own cuDNN path is checked at it too).
    pub max_batch: usize,
}

impl Loader for Wav2LipLoader {
    fn load(&self, precision: Precision) -> Result<Box<dyn Model>, Error> {
        Ok(Box::new(load_wav2lip(
            &self.weights,
            self.device,
            precision,
            self.max_batch,
        )?))
    }
}

/// Loads the generator for one instance (on CUDA with its own stream), and checks the own
/// cuDNN path against an exact reference at batch 2 and `max_batch` before it serves.
pub fn load_wav2lip(
    weights: &GeneratorWeights,
    device: DeviceKind,
    precision: Precision,
    max_batch: usize,
) -> Result<Wav2Lip, model::Error> {
    let device = device.open_instance()?;
    let dtype = model::compute_dtype(&device, precision);
    let mut model = Wav2Lip::load(weights, &device, dtype)?;
    model.verify_cudnn_path_at(max_batch)?;
    Ok(model)
}

impl Model for Wav2Lip {
    fn dtype(&self) -> DType {
        Wav2Lip::dtype(self)
    }

    fn conv_path(&self) -> &'static str {
        self.conv_engine()
    }

    fn predict(&mut self, n: usize, mel: Vec<f32>, face: Vec<f32>) -> Result<Vec<f32>, Error> {
        let dev = self.device().clone();
        let mel = Tensor::from_vec(mel, (n, 1, MEL_BINS, MEL_STEPS), &dev)?;
        let face = Tensor::from_vec(face, (n, FACE_CHANNELS, FACE_SIZE, FACE_SIZE), &dev)?;
        let pred = self.forward(&mel, &face)?;
        Ok(pred.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    }

    fn use_reference_path(&mut self) -> bool {
        if self.conv_engine() == "candle" {
            return false;
        }
        self.use_candle_operations();
        true
    }

    fn finish_warm_up(&mut self) {
        Wav2Lip::finish_warm_up(self);
    }
}
