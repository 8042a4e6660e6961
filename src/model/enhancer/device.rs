//! The tensor pass shared by every enhancer: its weights as candle tensors on a device, its
//! convolutions on candle's `conv2d` or (CUDA, `--conv-engine cudnn`) the generator's own
//! cuDNN path, warmed up and checked against the CPU pass, one batch at a time with inputs and
//! outputs in host memory ([`DeviceNet`]).

use std::sync::{Arc, Mutex};

use candle_core::{Device, Tensor};

use super::{DeviceNet, EnhancerNet};
use crate::model::{Error, Result};

/// A square convolution (stride 1, padding `k / 2`) for the tensor pass: PyTorch's
/// `(cout, cin, k, k)` weight and the bias as `(1, cout, 1, 1)` (zeros for a convolution
/// without one: what the own cuDNN path's blocks take; candle's path skips it).
#[derive(Clone)]
pub(super) struct Weights {
    w: Tensor,
    b: Tensor,
    has_bias: bool,
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
        let zeros = vec![0f32; cout];
        Ok(Weights {
            w: Tensor::from_vec(weight, (cout, cin, k, k), &Device::Cpu)?,
            b: Tensor::from_slice(bias.unwrap_or(&zeros), (1, cout, 1, 1), &Device::Cpu)?,
            has_bias: bias.is_some(),
            path: path.into(),
        })
    }

    pub(super) fn to(&self, device: &Device) -> Result<Weights> {
        Ok(Weights {
            w: self.w.to_device(device)?,
            b: self.b.to_device(device)?,
            has_bias: self.has_bias,
            path: self.path.clone(),
        })
    }

    pub(super) fn conv(&self, x: &Tensor, path: &ConvPath) -> Result<Tensor> {
        let k = self.w.dim(2)?;
        match path {
            ConvPath::Candle => {
                let y = x.conv2d(&self.w, k / 2, 1, 1, 1)?;
                Ok(if self.has_bias {
                    y.broadcast_add(&self.b)?
                } else {
                    y
                })
            }
            #[cfg(feature = "cuda")]
            ConvPath::Own(engine) => {
                let (cout, cin, _, _) = self.w.dims4()?;
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
                let block = crate::model::wav2lip::ConvBlock::from_parts(
                    &self.path,
                    spec,
                    self.w.clone(),
                    self.b.clone(),
                );
                engine.forward(&block, &x.contiguous()?)
            }
        }
    }

    pub(super) fn elements(&self) -> usize {
        self.w.elem_count()
            + if self.has_bias {
                self.b.elem_count()
            } else {
                0
            }
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

/// The network whose exact f32 CPU pass ([`EnhancerNet::forward_cpu`]) the own path is
/// checked against.
pub(super) type Reference<'a> = &'a dyn EnhancerNet;

/// `net`'s tensors (already on `device`) as a [`DeviceNet`]: on CUDA with `--conv-engine
/// cudnn` on the own path, warmed up as `warm` says and checked against `reference`.
pub(super) fn on_device<N: TensorPass + 'static>(
    net: N,
    device: &Device,
    warm: WarmUp,
    reference: Reference,
) -> Arc<dyn DeviceNet> {
    let path = own_path(&net, device, warm, reference);
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
fn own_path<N: TensorPass>(
    net: &N,
    device: &Device,
    warm: WarmUp,
    reference: Reference,
) -> ConvPath {
    let Device::Cuda(cuda) = device else {
        return ConvPath::Candle;
    };
    if !crate::model::cudnn::enabled() {
        return ConvPath::Candle;
    }
    match warm_own_path(net, device, cuda, warm, reference) {
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
fn own_path<N: TensorPass>(_: &N, _: &Device, _: WarmUp, _: Reference) -> ConvPath {
    ConvPath::Candle
}

/// Starts the own path: its algorithms timed at one image and at `warm.batch` images
/// (other batch sizes take cuDNN's heuristic), and at both the first image's output checked
/// against the exact CPU pass (`reference`, run once on that image): every value finite and
/// within [`OWN_PATH_TOLERANCE`], or the own path is refused. Not against candle's `conv2d`,
/// which may compute in TF32 on Ampere and later and drifts further through a deep network
/// than the own path's f32 (FMA, never TF32).
#[cfg(feature = "cuda")]
fn warm_own_path<N: TensorPass>(
    net: &N,
    device: &Device,
    cuda: &candle_core::cuda_backend::CudaDevice,
    warm: WarmUp,
    reference: Reference,
) -> Result<ConvPath> {
    use crate::model::cudnn::{ConvLayout, CudnnEngine};
    let engine = Arc::new(CudnnEngine::beside(
        cuda,
        candle_core::DType::F32,
        ConvLayout::Nchw,
    )?);
    let own = ConvPath::Own(engine.clone());
    let side = warm.side;
    let plane = 3 * side * side;
    // A smooth face-like ramp with some texture; the first image of every batch is the same.
    let faces = |n: usize| -> Vec<f32> {
        (0..n * plane)
            .map(|i| ((i * 37) % 251) as f32 / 250.0)
            .collect()
    };
    let want = reference.forward_cpu(1, side, side, &faces(1))?;
    for n in [1, warm.batch] {
        let x = Tensor::from_vec(faces(n), (n, 3, side, side), device)?;
        let out: Vec<f32> = net.run(&x, &own)?.flatten_all()?.to_vec1()?;
        let first = out.get(..want.len()).unwrap_or(&[]);
        if first.len() != want.len() || first.iter().any(|v| !v.is_finite()) {
            return Err(Error::Settings(format!(
                "at {n} faces its output has values that are not finite (or the wrong size)"
            )));
        }
        let worst = first
            .iter()
            .zip(&want)
            .map(|(a, b)| (a.clamp(0.0, 1.0) - b).abs())
            .fold(0f32, f32::max);
        if worst > OWN_PATH_TOLERANCE {
            return Err(Error::Settings(format!(
                "at {n} faces its output differs from the CPU pass by {worst} (at most \
                 {OWN_PATH_TOLERANCE})"
            )));
        }
    }
    engine.finish_warm_up();
    Ok(own)
}

/// How far the own path's f32 output may be from the CPU pass's (both f32; the sums run in
/// another order): well below an 8-bit level (0.0039).
#[cfg(feature = "cuda")]
const OWN_PATH_TOLERANCE: f32 = 1e-3;
