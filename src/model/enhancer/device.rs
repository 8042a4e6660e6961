//! The tensor pass shared by every enhancer: its weights as candle tensors on a device, its
//! convolutions on candle's `conv2d` or (CUDA, `--conv-engine cudnn`) the generator's own
//! cuDNN path, warmed up and checked against candle's, one batch at a time with inputs and
//! outputs in host memory ([`DeviceNet`]).

use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};

use super::DeviceNet;
use crate::model::{Error, Result};

/// A square convolution (stride 1, padding `k / 2`) for the tensor pass: PyTorch's
/// `(cout, cin, k, k)` weight and the bias as `(1, cout, 1, 1)`, if it has one.
#[derive(Clone)]
pub(super) struct Weights {
    w: Tensor,
    b: Option<Tensor>,
    /// The layer's name for the own cuDNN path's plans and reports (`esrgan body.2`).
    path: Arc<str>,
}

impl Weights {
    /// From PyTorch's weight (row-major `[cout, cin, k, k]`) and bias, on the CPU.
    pub(super) fn new(
        path: impl Into<Arc<str>>,
        weight: Vec<f32>,
        bias: Option<&[f32]>,
        (cin, cout, k): (usize, usize, usize),
    ) -> Result<Weights> {
        Ok(Weights {
            w: Tensor::from_vec(weight, (cout, cin, k, k), &Device::Cpu)?,
            b: bias
                .map(|b| Tensor::from_slice(b, (1, cout, 1, 1), &Device::Cpu))
                .transpose()?,
            path: path.into(),
        })
    }

    pub(super) fn to(&self, device: &Device) -> Result<Weights> {
        Ok(Weights {
            w: self.w.to_device(device)?,
            b: self.b.as_ref().map(|b| b.to_device(device)).transpose()?,
            path: self.path.clone(),
        })
    }

    pub(super) fn conv(&self, x: &Tensor, path: &ConvPath) -> Result<Tensor> {
        let (cout, cin, k, _) = self.w.dims4()?;
        let _ = (cout, cin);
        match path {
            ConvPath::Candle => {
                let y = x.conv2d(&self.w, k / 2, 1, 1, 1)?;
                Ok(match &self.b {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                })
            }
            #[cfg(feature = "cuda")]
            ConvPath::Own(engine) => {
                let spec = crate::model::arch::LayerSpec {
                    kind: crate::model::arch::LayerKind::Plain,
                    cin,
                    cout,
                    kernel: k,
                    stride: (1, 1),
                    padding: k / 2,
                    output_padding: 0,
                    residual: false,
                };
                let bias = match &self.b {
                    Some(b) => b.clone(),
                    None => Tensor::zeros((1, cout, 1, 1), self.w.dtype(), self.w.device())?,
                };
                let block = crate::model::wav2lip::ConvBlock::from_parts(
                    &self.path,
                    spec,
                    self.w.clone(),
                    bias,
                );
                engine.forward(&block, &x.contiguous()?)
            }
        }
    }

    pub(super) fn elements(&self) -> usize {
        self.w.elem_count() + self.b.as_ref().map_or(0, Tensor::elem_count)
    }
}

pub(super) fn leaky(x: &Tensor, slope: f32) -> Result<Tensor> {
    Ok(candle_nn::ops::leaky_relu(x, f64::from(slope))?)
}

/// What a tensor pass computes, on the device its weights are on.
pub(super) trait TensorPass: Send + Sync {
    /// RGB in [0, 1] in; the network's output, clamped to [0, 1] by the caller.
    fn run(&self, x: &Tensor, path: &ConvPath) -> Result<Tensor>;
    fn elements(&self) -> usize;
    /// Values alive at once at the pass's peak, for `n` images of `h × w`.
    fn peak_values(&self, n: usize, h: usize, w: usize) -> usize;
}

/// What the own path's warm-up runs: images of `side × side`, at one image and at `batch`
/// (the most a pass takes).
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) struct WarmUp {
    pub side: usize,
    pub batch: usize,
}

/// How a tensor pass runs its convolutions.
pub(super) enum ConvPath {
    /// candle's `conv2d` (on CUDA: cuDNN with candle's choice of algorithm).
    Candle,
    /// The own cuDNN path (CUDA with `--conv-engine cudnn`), as the generator's layers run
    /// it: each shape's algorithm timed during the warm-up, f32 with FMA math (never TF32).
    #[cfg(feature = "cuda")]
    Own(Arc<crate::model::cudnn::CudnnEngine>),
}

impl ConvPath {
    fn name(&self) -> &'static str {
        match self {
            ConvPath::Candle => "candle",
            #[cfg(feature = "cuda")]
            ConvPath::Own(_) => "cudnn",
        }
    }
}

/// An enhancer's weights on one device, run one batch at a time (inputs and outputs go
/// through host memory).
struct OnDevice<N> {
    net: N,
    device: Device,
    /// Held while a batch runs; the own path gives way to candle's for good if a cuDNN call
    /// fails or panics.
    path: Mutex<ConvPath>,
    /// Whether `path` is the own path (read without waiting for a batch: `/info`).
    own: std::sync::atomic::AtomicBool,
}

impl<N: TensorPass> OnDevice<N> {
    /// The pass on the path in use; on the own path a failed cuDNN call or a panic switches
    /// to candle's `conv2d` for good, and the batch runs again there.
    fn run(&self, x: &Tensor) -> Result<Tensor> {
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut path = self.path.lock().unwrap_or_else(|p| p.into_inner());
        #[cfg(feature = "cuda")]
        if let ConvPath::Own(engine) = &*path {
            // The engine's cuDNN handle was made on the loading thread: make its context
            // current on this one.
            engine
                .stream()
                .context()
                .bind_to_thread()
                .map_err(candle_core::Error::from)?;
            let ran =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.net.run(x, &path)));
            let why = match ran {
                Ok(Ok(y)) => return Ok(y),
                Ok(Err(e)) if !e.is_cudnn_failure() => return Err(e),
                Ok(Err(e)) => e.to_string(),
                Err(p) => format!("panicked: {}", crate::model::panic_message(&*p)),
            };
            tracing::warn!(
                "an enhancer's own cuDNN path failed ({why}); it runs candle's conv2d from now on"
            );
            *path = ConvPath::Candle;
            self.own.store(false, std::sync::atomic::Ordering::SeqCst);
        }
        self.net.run(x, &path)
    }
}

impl<N: TensorPass> DeviceNet for OnDevice<N> {
    fn forward(&self, n: usize, height: usize, width: usize, rgb: &[f32]) -> Result<Vec<f32>> {
        if rgb.len() != n * 3 * height * width {
            return Err(Error::BadInput(format!(
                "{} values for {n} RGB images of {width}x{height}",
                rgb.len()
            )));
        }
        let x = Tensor::from_slice(rgb, (n, 3, height, width), &self.device)?;
        let y = self.run(&x)?;
        Ok(y.clamp(0f32, 1f32)?.flatten_all()?.to_vec1()?)
    }

    fn bytes(&self, n: usize, height: usize, width: usize) -> u64 {
        let tensors = 4 * (self.net.elements() + self.net.peak_values(n, height, width)) as u64;
        // The own path's convolution workspace, up to --cudnn-workspace.
        let workspace = if self.own.load(std::sync::atomic::Ordering::SeqCst) {
            crate::model::cudnn::settings().workspace_limit as u64
        } else {
            0
        };
        tensors + workspace
    }

    fn conv_path(&self) -> &'static str {
        if self.own.load(std::sync::atomic::Ordering::SeqCst) {
            "cudnn"
        } else {
            "candle"
        }
    }
}

/// `net`'s tensors (already on `device`) as a [`DeviceNet`]: on CUDA with `--conv-engine
/// cudnn` on the own path, warmed up as `warm` says.
pub(super) fn on_device<N: TensorPass + 'static>(
    net: N,
    device: &Device,
    warm: WarmUp,
) -> Arc<dyn DeviceNet> {
    let path = own_path(&net, device, warm);
    Arc::new(OnDevice {
        net,
        device: device.clone(),
        own: std::sync::atomic::AtomicBool::new(path.name() == "cudnn"),
        path: Mutex::new(path),
    })
}

/// The own cuDNN path for `net` on a CUDA `device` (with `--conv-engine cudnn`), warmed up,
/// or candle's `conv2d` (with a warning when the own path could not start).
#[cfg(feature = "cuda")]
fn own_path<N: TensorPass>(net: &N, device: &Device, warm: WarmUp) -> ConvPath {
    let Device::Cuda(cuda) = device else {
        return ConvPath::Candle;
    };
    if !crate::model::cudnn::enabled() {
        return ConvPath::Candle;
    }
    match warm_own_path(net, device, cuda, warm) {
        Ok(path) => path,
        Err(e) => {
            tracing::warn!(
                "an enhancer's own cuDNN path is unavailable ({e}); it runs candle's conv2d"
            );
            ConvPath::Candle
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn own_path<N: TensorPass>(_: &N, _: &Device, _: WarmUp) -> ConvPath {
    ConvPath::Candle
}

/// Starts the own path: its algorithms timed at one image and at `warm.batch` images
/// (other batch sizes take cuDNN's heuristic), and its output at both checked against
/// candle's `conv2d` on the same faces: within [`OWN_PATH_TOLERANCE`], or the own path is
/// refused.
#[cfg(feature = "cuda")]
fn warm_own_path<N: TensorPass>(
    net: &N,
    device: &Device,
    cuda: &candle_core::cuda_backend::CudaDevice,
    warm: WarmUp,
) -> Result<ConvPath> {
    use crate::model::cudnn::{ConvLayout, CudnnEngine};
    let engine = Arc::new(CudnnEngine::beside(
        cuda,
        candle_core::DType::F32,
        ConvLayout::Nchw,
    )?);
    let own = ConvPath::Own(engine.clone());
    let side = warm.side;
    for n in [1, warm.batch] {
        let len = n * 3 * side * side;
        // A smooth face-like ramp with some texture.
        let faces: Vec<f32> = (0..len).map(|i| ((i * 37) % 251) as f32 / 250.0).collect();
        let x = Tensor::from_vec(faces, (n, 3, side, side), device)?;
        let got = net.run(&x, &own)?;
        let want = net.run(&x, &ConvPath::Candle)?;
        let worst: f32 = (got - want)?.abs()?.flatten_all()?.max(0)?.to_scalar()?;
        if worst.is_nan() || worst > OWN_PATH_TOLERANCE {
            return Err(Error::Settings(format!(
                "at {n} faces its output differs from candle's conv2d by {worst} (at most \
                 {OWN_PATH_TOLERANCE})"
            )));
        }
    }
    engine.finish_warm_up();
    Ok(own)
}

/// How far the own path's f32 output may be from candle's (both f32 with FMA; the sums run
/// in another order): well below an 8-bit level (0.0039).
#[cfg(feature = "cuda")]
const OWN_PATH_TOLERANCE: f32 = 1e-3;
