//! What a model instance runs: a small trait over the model, so the pool (warm-up, padding,
//! precision fallback, out-of-memory splitting, restarts) does not depend on one backend, and
//! tests can drive it with doubles that fail or panic on cue.
//!
//! [`Wav2LipLoader`] is the production backend: the candle generator (own CPU pass, own cuDNN
//! path or candle's operations) on the configured device.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Tensor};

use super::Error;
use crate::model::arch::{FACE_CHANNELS, FACE_SIZE, MEL_BINS, MEL_STEPS};
use crate::model::wav2lip::ActivationRanges;
use crate::model::{self, DeviceKind, GeneratorWeights, Precision, Wav2Lip};

/// Values in one frame's mel window, face input and prediction.
pub const MEL_LEN: usize = MEL_BINS * MEL_STEPS;
pub const FACE_LEN: usize = FACE_CHANNELS * FACE_SIZE * FACE_SIZE;
pub const PRED_LEN: usize = 3 * FACE_SIZE * FACE_SIZE;

/// What [`Model::predict`] returns for a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// Faces `(n, 3, 96, 96)` in f32.
    pub faces: Vec<f32>,
    /// The model saw its half-precision arithmetic overflow in this batch (see
    /// [`Wav2Lip::forward_guarded`]): the faces may be wrong even where finite, and the pool
    /// recomputes the batch in f32. Always `false` in f32.
    pub overflow: bool,
}

/// One loaded model, owned by one instance thread.
pub trait Model: Send {
    /// The dtype it computes in.
    fn dtype(&self) -> DType;
    /// Its convolution path (`cpu`, `cudnn`, `candle`, ...), for `/info`.
    fn conv_path(&self) -> &'static str;
    /// Predictions for `n` mel windows (`n * MEL_LEN` values) and face inputs
    /// (`n * FACE_LEN`), which it takes over (the pool builds them per batch and keeps no
    /// copy).
    fn predict(&mut self, n: usize, mel: Vec<f32>, face: Vec<f32>) -> Result<Prediction, Error>;
    /// [`Model::predict`] for frames numbered `indices` within their requests (padding
    /// repeats the last number). A model's faces do not depend on the numbers; a stand-in's
    /// may (the echo device moves its mouth by them).
    fn predict_frames(
        &mut self,
        indices: &[usize],
        mel: Vec<f32>,
        face: Vec<f32>,
    ) -> Result<Prediction, Error> {
        self.predict(indices.len(), mel, face)
    }
    /// Switches to the reference path after the fast one failed; `false` when it already
    /// runs the reference path (nothing left to fall back to).
    fn use_reference_path(&mut self) -> bool;
    /// Warm-up is over: batch sizes not seen yet must not start an algorithm search in the
    /// middle of a request.
    fn finish_warm_up(&mut self) {}
}

/// Makes models for instances (and their f32 fallback copies).
pub trait Loader: Send + Sync {
    /// A model computing in `precision`. Start-up checks that run batches (the own cuDNN
    /// path's accuracy check) run them at batch 2 and `check_batch` at most: the pool passes
    /// the largest batch the instance will run within its memory limit, and a small one for
    /// the f32 fallback copy.
    fn load(&self, precision: Precision, check_batch: usize) -> Result<Box<dyn Model>, Error>;
}

/// The Wav2Lip generator on a device.
pub struct Wav2LipLoader {
    weights: Arc<GeneratorWeights>,
    device: DeviceKind,
    /// The GPU on CUDA (ignored on the CPU).
    cuda_device: usize,
    /// The largest batch the instances run (start-up checks never run a larger one).
    max_batch: usize,
    /// The checkpoint's activation ranges, measured by the first half-precision load and
    /// shared by every instance, restart and f32 copy after it (the same weights every time).
    ranges: Mutex<Option<Arc<ActivationRanges>>>,
}

impl Wav2LipLoader {
    /// `cuda_device`: the GPU on CUDA (ignored on the CPU).
    pub fn new(
        weights: Arc<GeneratorWeights>,
        device: DeviceKind,
        cuda_device: usize,
        max_batch: usize,
    ) -> Self {
        Wav2LipLoader {
            weights,
            device,
            cuda_device,
            max_batch,
            ranges: Mutex::new(None),
        }
    }

    /// The activation ranges, measured on first need.
    fn ranges(&self) -> Result<Arc<ActivationRanges>, model::Error> {
        // Held while measuring: instances loading at once wait for one measurement.
        let mut ranges = self.ranges.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = ranges.as_ref() {
            return Ok(r.clone());
        }
        let r = Arc::new(ActivationRanges::measure(&self.weights)?);
        *ranges = Some(r.clone());
        Ok(r)
    }
}

impl Loader for Wav2LipLoader {
    fn load(&self, precision: Precision, check_batch: usize) -> Result<Box<dyn Model>, Error> {
        Ok(Box::new(load_wav2lip_with(
            &self.weights,
            self.device,
            self.cuda_device,
            precision,
            check_batch.clamp(1, self.max_batch.max(1)),
            || self.ranges(),
        )?))
    }
}

/// Loads the generator for one instance (on CUDA with its own stream). In f16/bf16 it first
/// measures the checkpoint's activation ranges in f32 and checks the layers at risk of
/// overflow in every batch ([`Wav2Lip::check_overflow`]). Then it checks the own cuDNN path
/// against an exact reference at batch 2 and `max_batch` (no larger) before it serves.
/// `cuda_device`: the GPU on CUDA (ignored on the CPU).
pub fn load_wav2lip(
    weights: &GeneratorWeights,
    device: DeviceKind,
    cuda_device: usize,
    precision: Precision,
    max_batch: usize,
) -> Result<Wav2Lip, model::Error> {
    load_wav2lip_with(weights, device, cuda_device, precision, max_batch, || {
        ActivationRanges::measure(weights).map(Arc::new)
    })
}

/// [`load_wav2lip`] with the activation ranges from `ranges` (asked only in f16/bf16).
fn load_wav2lip_with(
    weights: &GeneratorWeights,
    device: DeviceKind,
    cuda_device: usize,
    precision: Precision,
    max_batch: usize,
    ranges: impl FnOnce() -> Result<Arc<ActivationRanges>, model::Error>,
) -> Result<Wav2Lip, model::Error> {
    let device = device.open_instance(cuda_device)?;
    let dtype = model::compute_dtype(&device, precision);
    let mut model = Wav2Lip::load(weights, &device, dtype)?;
    if dtype != DType::F32 {
        let ranges = ranges()?;
        model.check_overflow(&ranges);
        tracing::info!(
            "{dtype:?} model: overflow checked at {}",
            model.checked_layers().join(", ")
        );
    }
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

    fn predict(&mut self, n: usize, mel: Vec<f32>, face: Vec<f32>) -> Result<Prediction, Error> {
        let dev = self.device().clone();
        let mel = Tensor::from_vec(mel, (n, 1, MEL_BINS, MEL_STEPS), &dev)?;
        let face = Tensor::from_vec(face, (n, FACE_CHANNELS, FACE_SIZE, FACE_SIZE), &dev)?;
        let (faces, overflow) = self.forward_guarded_to_host(&mel, &face)?;
        Ok(Prediction { faces, overflow })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::wav2lip::tests::{fixture_weights, one_frame};

    #[test]
    fn a_half_precision_model_reports_the_overflow_that_its_output_hides() {
        // A hidden layer overflows in f16: the faces come back finite, flagged.
        let weights = fixture_weights(Some(("face_encoder_blocks.3.0.conv_block.0.weight", 1e5)));
        let (mel_t, face_t) = one_frame();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (mel, face) = (flat(&mel_t), flat(&face_t));
        let mut half = load_wav2lip(&weights, DeviceKind::Cpu, 0, Precision::F16, 2).unwrap();
        let p = half.predict(1, mel.clone(), face.clone()).unwrap();
        assert!(p.overflow);
        assert_eq!(p.faces.len(), PRED_LEN);
        assert!(p.faces.iter().all(|v| v.is_finite()));
        // The one-copy host path gives exactly the faces and verdict of the tensor path.
        let (faces, overflow) = half.forward_guarded(&mel_t, &face_t).unwrap();
        assert!(overflow);
        assert_eq!(flat(&faces.to_dtype(DType::F32).unwrap()), p.faces);
        // f32 checks nothing (there is nothing to recompute in).
        let mut full = load_wav2lip(&weights, DeviceKind::Cpu, 0, Precision::F32, 2).unwrap();
        assert!(full.checked_layers().is_empty());
        assert!(!full.predict(1, mel, face).unwrap().overflow);
    }
}
