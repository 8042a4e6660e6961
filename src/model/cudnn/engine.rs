//! The cuDNN engine itself (CUDA builds); see the parent module.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cudnn::sys;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::{CustomOp1, DType, Layout, Shape, Storage, Tensor};
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use super::{settings, FIND_WORKSPACE_BYTES};
use crate::model::arch::{LayerKind, LayerSpec};
use crate::model::wav2lip::ConvBlock;
use crate::model::Result;

static AUTOTUNE: OnceLock<Mutex<Autotune>> = OnceLock::new();

/// How many (shape, batch, dtype) choices the process knows, and how many of them were
/// searched (not loaded from the cache file): for logs and tests.
pub fn autotune_counts() -> (usize, usize) {
    AUTOTUNE.get().map_or((0, 0), |a| {
        let a = a.lock().unwrap();
        (a.algos.len(), a.searched)
    })
}

// ---------------------------------------------------------------------------------------------
// Errors and RAII wrappers over cuDNN's C objects.

fn check(status: sys::cudnnStatus_t, what: &str) -> candle_core::Result<()> {
    use sys::cudnnStatus_t as S;
    match status {
        S::CUDNN_STATUS_SUCCESS => Ok(()),
        // The pool recognises running out of memory by this text.
        S::CUDNN_STATUS_ALLOC_FAILED => Err(candle_core::Error::Msg(format!(
            "cuDNN {what}: out of memory ({status:?})"
        ))),
        other => Err(candle_core::Error::Msg(format!("cuDNN {what}: {other:?}"))),
    }
}

fn is_out_of_memory(e: &candle_core::Error) -> bool {
    e.to_string().contains("out of memory")
}

struct Handle(sys::cudnnHandle_t);
// SAFETY: a cuDNN handle may be used from any thread, one call at a time; the engine keeps it
// behind a mutex.
unsafe impl Send for Handle {}
impl Drop for Handle {
    fn drop(&mut self) {
        unsafe { sys::cudnnDestroy(self.0) };
    }
}

macro_rules! descriptor {
    ($name:ident, $raw:ty, $create:ident, $destroy:ident) => {
        struct $name($raw);
        // SAFETY: host-side parameter objects, only used under the engine's mutex.
        unsafe impl Send for $name {}
        impl $name {
            fn new() -> candle_core::Result<Self> {
                let mut raw = std::ptr::null_mut();
                check(unsafe { sys::$create(&mut raw) }, stringify!($create))?;
                Ok($name(raw))
            }
        }
        impl Drop for $name {
            fn drop(&mut self) {
                unsafe { sys::$destroy(self.0) };
            }
        }
    };
}
descriptor!(
    TensorDesc,
    sys::cudnnTensorDescriptor_t,
    cudnnCreateTensorDescriptor,
    cudnnDestroyTensorDescriptor
);
descriptor!(
    FilterDesc,
    sys::cudnnFilterDescriptor_t,
    cudnnCreateFilterDescriptor,
    cudnnDestroyFilterDescriptor
);
descriptor!(
    ConvDesc,
    sys::cudnnConvolutionDescriptor_t,
    cudnnCreateConvolutionDescriptor,
    cudnnDestroyConvolutionDescriptor
);
descriptor!(
    ActDesc,
    sys::cudnnActivationDescriptor_t,
    cudnnCreateActivationDescriptor,
    cudnnDestroyActivationDescriptor
);

fn data_type(dtype: DType) -> candle_core::Result<sys::cudnnDataType_t> {
    use sys::cudnnDataType_t as D;
    Ok(match dtype {
        DType::F16 => D::CUDNN_DATA_HALF,
        DType::BF16 => D::CUDNN_DATA_BFLOAT16,
        DType::F32 => D::CUDNN_DATA_FLOAT,
        other => candle_core::bail!("no cuDNN convolution for {other:?}"),
    })
}

fn tensor4(dtype: DType, dims: [usize; 4]) -> candle_core::Result<TensorDesc> {
    let d = TensorDesc::new()?;
    let [n, c, h, w] = dims.map(|v| v as c_int);
    check(
        unsafe {
            sys::cudnnSetTensor4dDescriptor(
                d.0,
                sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
                data_type(dtype)?,
                n,
                c,
                h,
                w,
            )
        },
        "tensor descriptor",
    )?;
    Ok(d)
}

fn set_math(conv: &ConvDesc, tensor_ops: bool) -> candle_core::Result<()> {
    // f32 stays true f32 (FMA math, no TF32): it is the reference precision.
    let math = if tensor_ops {
        sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH
    } else {
        sys::cudnnMathType_t::CUDNN_FMA_MATH
    };
    check(
        unsafe { sys::cudnnSetConvolutionMathType(conv.0, math) },
        "math type",
    )
}

// ---------------------------------------------------------------------------------------------
// Algorithm choice, shared by the process and persisted.

/// One timed choice.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Choice {
    /// cuDNN's name of the algorithm (`CUDNN_CONVOLUTION_FWD_ALGO_…` / `…_BWD_DATA_ALGO_…`).
    algo: String,
    /// Tensor-op math (the math type the search used).
    tensor_ops: bool,
    workspace: usize,
    /// Measured milliseconds (informative).
    ms: f32,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct CacheFile {
    /// GPU name and cuDNN version: choices are only valid for the same pair.
    device: String,
    algos: BTreeMap<String, Choice>,
}

struct Autotune {
    device: String,
    algos: BTreeMap<String, Choice>,
    searched: usize,
}

impl Autotune {
    /// The process's choices, read from the cache file on first use.
    fn get(device: &str) -> &'static Mutex<Autotune> {
        AUTOTUNE.get_or_init(|| {
            let mut algos = BTreeMap::new();
            if let Some(path) = &settings().cache_file {
                match std::fs::read(path) {
                    Ok(bytes) => match serde_json::from_slice::<CacheFile>(&bytes) {
                        Ok(file) if file.device == device => {
                            tracing::info!(
                                "autotune cache {}: {} convolution choices",
                                path.display(),
                                file.algos.len()
                            );
                            algos = file.algos;
                        }
                        Ok(file) => tracing::warn!(
                            "autotune cache {} is for {:?}, not {device:?}; searching again",
                            path.display(),
                            file.device
                        ),
                        Err(e) => tracing::warn!(
                            "autotune cache {} unreadable ({e}); searching again",
                            path.display()
                        ),
                    },
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => tracing::warn!("autotune cache {}: {e}", path.display()),
                }
            }
            Mutex::new(Autotune {
                device: device.to_string(),
                algos,
                searched: 0,
            })
        })
    }

    /// Writes the cache file (a temporary file renamed over it).
    fn save(&self) {
        let Some(path) = &settings().cache_file else {
            return;
        };
        let file = CacheFile {
            device: self.device.clone(),
            algos: self.algos.clone(),
        };
        let write = || -> std::io::Result<()> {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, serde_json::to_vec_pretty(&file)?)?;
            std::fs::rename(&tmp, path)
        };
        if let Err(e) = write() {
            tracing::warn!("cannot write autotune cache {}: {e}", path.display());
        }
    }
}

const FWD_ALGOS: [sys::cudnnConvolutionFwdAlgo_t; 8] = {
    use sys::cudnnConvolutionFwdAlgo_t as A;
    [
        A::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        A::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        A::CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        A::CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        A::CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        A::CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        A::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        A::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
    ]
};

const BWD_ALGOS: [sys::cudnnConvolutionBwdDataAlgo_t; 6] = {
    use sys::cudnnConvolutionBwdDataAlgo_t as A;
    [
        A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
        A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
    ]
};

#[derive(Debug, Clone, Copy)]
enum Algo {
    Fwd(sys::cudnnConvolutionFwdAlgo_t),
    Bwd(sys::cudnnConvolutionBwdDataAlgo_t),
}

impl Algo {
    fn from_name(transposed: bool, name: &str) -> Option<Algo> {
        if transposed {
            BWD_ALGOS
                .iter()
                .find(|a| format!("{a:?}") == name)
                .map(|&a| Algo::Bwd(a))
        } else {
            FWD_ALGOS
                .iter()
                .find(|a| format!("{a:?}") == name)
                .map(|&a| Algo::Fwd(a))
        }
    }
}

/// The fastest successful entry of a search's results, as a choice.
macro_rules! best_of {
    ($perf:expr, $count:expr, $variant:path) => {{
        let best = $perf[..$count as usize]
            .iter()
            .find(|p| p.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS)
            .ok_or_else(|| candle_core::Error::Msg("cuDNN: no usable algorithm".into()))?;
        Ok((
            $variant(best.algo),
            Choice {
                algo: format!("{:?}", best.algo),
                tensor_ops: best.mathType != sys::cudnnMathType_t::CUDNN_DEFAULT_MATH
                    && best.mathType != sys::cudnnMathType_t::CUDNN_FMA_MATH,
                workspace: best.memory,
                ms: best.time,
            },
        ))
    }};
}

// ---------------------------------------------------------------------------------------------
// The engine: one per model instance (its stream, its workspace, its descriptors).

/// A layer at one batch size, ready to run.
struct Plan {
    x: TensorDesc,
    w: FilterDesc,
    conv: ConvDesc,
    y: TensorDesc,
    bias: TensorDesc,
    algo: Algo,
    workspace: usize,
    /// Bias, residual and ReLU inside the convolution call (else applied afterwards).
    fused: bool,
}

struct Inner {
    handle: Handle,
    relu: ActDesc,
    /// Grown to the largest chosen algorithm's need; reused by every call.
    workspace: Option<CudaSlice<u8>>,
    plans: HashMap<(String, usize), Plan>,
}

/// The own cuDNN convolution path of one model instance.
pub struct CudnnEngine {
    dev: CudaDevice,
    stream: Arc<CudaStream>,
    dtype: DType,
    device_name: String,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for CudnnEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudnnEngine")
            .field("dtype", &self.dtype)
            .field("device", &self.device_name)
            .finish()
    }
}

impl CudnnEngine {
    /// An engine on the device's stream (the instance's own stream).
    pub fn new(dev: &CudaDevice, dtype: DType) -> Result<Self> {
        data_type(dtype)?;
        let stream = dev.cuda_stream();
        // cuDNN binds its handle to the context current on this thread.
        stream
            .context()
            .bind_to_thread()
            .map_err(candle_core::Error::from)?;
        let mut raw = std::ptr::null_mut();
        check(unsafe { sys::cudnnCreate(&mut raw) }, "create handle")?;
        let handle = Handle(raw);
        check(
            unsafe { sys::cudnnSetStream(handle.0, stream.cu_stream() as sys::cudaStream_t) },
            "set stream",
        )?;
        let relu = ActDesc::new()?;
        check(
            unsafe {
                sys::cudnnSetActivationDescriptor(
                    relu.0,
                    sys::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU,
                    sys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN,
                    0.0,
                )
            },
            "activation descriptor",
        )?;
        let gpu = stream
            .context()
            .name()
            .unwrap_or_else(|_| "unknown GPU".into());
        let version = unsafe { sys::cudnnGetVersion() };
        Ok(CudnnEngine {
            dev: dev.clone(),
            stream,
            dtype,
            device_name: format!("{gpu} / cuDNN {version}"),
            inner: Mutex::new(Inner {
                handle,
                relu,
                workspace: None,
                plans: HashMap::new(),
            }),
        })
    }

    /// One layer: convolution (or transposed convolution) + bias (+ residual) (+ ReLU), as
    /// [`ConvBlock::forward`] computes it.
    pub fn forward(&self, block: &ConvBlock, x: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        let op = LayerOp {
            engine: self,
            block,
            fused: std::cell::Cell::new(false),
        };
        let y = x.apply_op1_no_bwd(&op)?;
        if op.fused.get() {
            return Ok(y);
        }
        let s = block.spec();
        let y = y.broadcast_add(&block.bias().reshape((1, s.cout, 1, 1))?)?;
        block.activate(y, &x)
    }

    /// Makes the plan for a layer at a batch (searching its algorithm unless known).
    fn make_plan(
        &self,
        inner: &mut Inner,
        block: &ConvBlock,
        [n, c, h, w]: [usize; 4],
        bufs: (u64, u64, u64),
    ) -> candle_core::Result<Plan> {
        let s = block.spec();
        let transposed = s.kind == LayerKind::ConvTranspose;
        let (oh, ow) = output_size(s, h, w);
        let x = tensor4(self.dtype, [n, c, h, w])?;
        let y = tensor4(self.dtype, [n, s.cout, oh, ow])?;
        let bias = tensor4(self.dtype, [1, s.cout, 1, 1])?;
        let wd = FilterDesc::new()?;
        // PyTorch layouts: conv (cout, cin, k, k); transposed (cin, cout, k, k), which is the
        // filter of the forward convolution whose data gradient the transposed conv is.
        let dims = block.weight().dims().to_vec();
        check(
            unsafe {
                sys::cudnnSetFilter4dDescriptor(
                    wd.0,
                    data_type(self.dtype)?,
                    sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
                    dims[0] as c_int,
                    dims[1] as c_int,
                    dims[2] as c_int,
                    dims[3] as c_int,
                )
            },
            "filter descriptor",
        )?;
        let conv = ConvDesc::new()?;
        check(
            unsafe {
                sys::cudnnSetConvolution2dDescriptor(
                    conv.0,
                    s.padding as c_int,
                    s.padding as c_int,
                    s.stride.0 as c_int,
                    s.stride.1 as c_int,
                    1,
                    1,
                    sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                    // Accumulate in f32 whatever the storage type.
                    sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
                )
            },
            "convolution descriptor",
        )?;
        set_math(&conv, self.dtype != DType::F32)?;

        let key = format!(
            "{} {:?} x{n}x{c}x{h}x{w} w{}x{}x{}x{} s{}x{} p{} op{}",
            if transposed { "bwd_data" } else { "fwd" },
            self.dtype,
            dims[0],
            dims[1],
            dims[2],
            dims[3],
            s.stride.0,
            s.stride.1,
            s.padding,
            s.output_padding,
        );
        // Held during the search, so instances do not time each other's kernels.
        let mut tune = Autotune::get(&self.device_name).lock().unwrap();
        let known = tune
            .algos
            .get(&key)
            .and_then(|c| Algo::from_name(transposed, &c.algo).map(|a| (a, c.clone())));
        let (algo, choice) = match known {
            Some(found) => found,
            None => {
                let found = self.find(inner, transposed, (&x, &wd, &conv, &y), bufs);
                // The search's large workspace goes; runs keep only what they need.
                inner.workspace = None;
                let found = found?;
                tracing::debug!("autotuned {key}: {:?}", found.1);
                tune.algos.insert(key, found.1.clone());
                tune.searched += 1;
                tune.save();
                found
            }
        };
        drop(tune);
        set_math(&conv, choice.tensor_ops)?;
        Ok(Plan {
            x,
            w: wd,
            conv,
            y,
            bias,
            algo,
            workspace: choice.workspace,
            fused: s.kind == LayerKind::Conv,
        })
    }

    /// Times every algorithm on the real buffers (`y` is scratch) and keeps the fastest.
    fn find(
        &self,
        inner: &mut Inner,
        transposed: bool,
        (x, w, conv, y): (&TensorDesc, &FilterDesc, &ConvDesc, &TensorDesc),
        (x_ptr, w_ptr, y_ptr): (u64, u64, u64),
    ) -> candle_core::Result<(Algo, Choice)> {
        let ws = self.workspace(inner, FIND_WORKSPACE_BYTES)?;
        let mut count: c_int = 0;
        if transposed {
            let mut perf = [unsafe { std::mem::zeroed::<sys::cudnnConvolutionBwdDataAlgoPerf_t>() };
                BWD_ALGOS.len()];
            check(
                unsafe {
                    sys::cudnnFindConvolutionBackwardDataAlgorithmEx(
                        inner.handle.0,
                        w.0,
                        w_ptr as *const c_void,
                        x.0,
                        x_ptr as *const c_void,
                        conv.0,
                        y.0,
                        y_ptr as *mut c_void,
                        perf.len() as c_int,
                        &mut count,
                        perf.as_mut_ptr(),
                        ws as *mut c_void,
                        FIND_WORKSPACE_BYTES,
                    )
                },
                "find backward-data algorithm",
            )?;
            best_of!(perf, count, Algo::Bwd)
        } else {
            let mut perf = [unsafe { std::mem::zeroed::<sys::cudnnConvolutionFwdAlgoPerf_t>() };
                FWD_ALGOS.len()];
            check(
                unsafe {
                    sys::cudnnFindConvolutionForwardAlgorithmEx(
                        inner.handle.0,
                        x.0,
                        x_ptr as *const c_void,
                        w.0,
                        w_ptr as *const c_void,
                        conv.0,
                        y.0,
                        y_ptr as *mut c_void,
                        perf.len() as c_int,
                        &mut count,
                        perf.as_mut_ptr(),
                        ws as *mut c_void,
                        FIND_WORKSPACE_BYTES,
                    )
                },
                "find forward algorithm",
            )?;
            best_of!(perf, count, Algo::Fwd)
        }
    }

    /// The instance's workspace, grown to at least `bytes`; its device address.
    fn workspace(&self, inner: &mut Inner, bytes: usize) -> candle_core::Result<u64> {
        let bytes = bytes.max(1);
        if inner.workspace.as_ref().is_none_or(|w| w.len() < bytes) {
            inner.workspace = None;
            inner.workspace = Some(self.stream.alloc_zeros::<u8>(bytes)?);
        }
        let ws = inner.workspace.as_ref().expect("allocated above");
        let (ptr, _sync) = ws.device_ptr(&self.stream);
        Ok(ptr)
    }

    /// Runs one layer on buffers of element type `T`.
    fn run<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
        &self,
        op: &LayerOp<'_>,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let block = op.block;
        let s = block.spec();
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("cuDNN layer {}: input not contiguous", block.path());
        };
        let dims: [usize; 4] = layout
            .dims()
            .try_into()
            .map_err(|_| candle_core::Error::Msg("cuDNN layer: input is not 4-D".into()))?;
        let (oh, ow) = output_size(s, dims[2], dims[3]);
        let x = storage.as_cuda_slice::<T>()?.slice(start..end);
        let (w_store, w_layout) = block.weight().storage_and_layout();
        let (b_store, b_layout) = block.bias().storage_and_layout();
        let weight = cuda_slice_of::<T>(&w_store, w_layout)?;
        let bias = cuda_slice_of::<T>(&b_store, b_layout)?;
        let len = dims[0] * s.cout * oh * ow;
        let fusable = s.kind == LayerKind::Conv;
        let y = if fusable && !s.residual {
            // The fused call's z is the output itself, scaled by 0: start from zeros, not
            // from whatever the allocation held (0 × NaN is NaN).
            self.dev.alloc_zeros::<T>(len)?
        } else {
            // SAFETY: every element is written by the convolution (beta = 0) before it is
            // read.
            unsafe { self.dev.alloc::<T>(len)? }
        };

        let stream = &self.stream;
        let (x_ptr, sx) = x.device_ptr(stream);
        let (w_ptr, sw) = weight.device_ptr(stream);
        let (b_ptr, sb) = bias.device_ptr(stream);
        let (y_ptr, sy) = y.device_ptr(stream);

        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        let key = (block.path().to_string(), dims[0]);
        if !inner.plans.contains_key(&key) {
            let plan = self.make_plan(inner, block, dims, (x_ptr, w_ptr, y_ptr))?;
            inner.plans.insert(key.clone(), plan);
        }
        let (need, fused) = {
            let plan = &inner.plans[&key];
            (plan.workspace, plan.fused)
        };
        let ws = self.workspace(inner, need)? as *mut c_void;
        // f32 scaling factors for every storage type (f32 compute).
        let (one, zero) = (1f32, 0f32);
        let one_p = &one as *const f32 as *const c_void;
        let zero_p = &zero as *const f32 as *const c_void;
        let (xp, wp, yp) = (
            x_ptr as *const c_void,
            w_ptr as *const c_void,
            y_ptr as *mut c_void,
        );
        let plan = &inner.plans[&key];
        let mut done_fused = false;
        if let (true, Algo::Fwd(algo)) = (fused, plan.algo) {
            // z: the input itself for residual layers (same shape as the output), else the
            // zeroed output scaled by 0.
            let (alpha2, z, zp) = if s.residual {
                (one_p, plan.x.0, xp)
            } else {
                (zero_p, plan.y.0, yp as *const c_void)
            };
            let status = unsafe {
                sys::cudnnConvolutionBiasActivationForward(
                    inner.handle.0,
                    one_p,
                    plan.x.0,
                    xp,
                    plan.w.0,
                    wp,
                    plan.conv.0,
                    algo,
                    ws,
                    need,
                    alpha2,
                    z,
                    zp,
                    plan.bias.0,
                    b_ptr as *const c_void,
                    inner.relu.0,
                    plan.y.0,
                    yp,
                )
            };
            match check(status, "fused convolution") {
                Ok(()) => done_fused = true,
                Err(e) if is_out_of_memory(&e) => return Err(e),
                Err(e) => {
                    // Not every type/layout/algorithm combination has a fused kernel.
                    tracing::debug!("{}: {e}; running it unfused", block.path());
                }
            }
        }
        if !done_fused {
            let status = match plan.algo {
                Algo::Fwd(algo) => unsafe {
                    sys::cudnnConvolutionForward(
                        inner.handle.0,
                        one_p,
                        plan.x.0,
                        xp,
                        plan.w.0,
                        wp,
                        plan.conv.0,
                        algo,
                        ws,
                        need,
                        zero_p,
                        plan.y.0,
                        yp,
                    )
                },
                Algo::Bwd(algo) => unsafe {
                    sys::cudnnConvolutionBackwardData(
                        inner.handle.0,
                        one_p,
                        plan.w.0,
                        wp,
                        plan.x.0,
                        xp,
                        plan.conv.0,
                        algo,
                        ws,
                        need,
                        zero_p,
                        plan.y.0,
                        yp,
                    )
                },
            };
            check(status, "convolution")?;
            if fused {
                // No fused kernel for this layer: run it unfused from now on.
                if let Some(p) = inner.plans.get_mut(&key) {
                    p.fused = false;
                }
            }
        }
        op.fused.set(done_fused);
        drop(guard);
        drop((sx, sw, sb, sy));
        drop((w_store, b_store));
        Ok((
            CudaStorage::wrap_cuda_slice(y, self.dev.clone()),
            Shape::from((dims[0], s.cout, oh, ow)),
        ))
    }
}

/// Output height and width of a layer for an input of `h`×`w`.
fn output_size(s: &LayerSpec, h: usize, w: usize) -> (usize, usize) {
    if s.kind == LayerKind::ConvTranspose {
        (
            (h - 1) * s.stride.0 + s.kernel + s.output_padding - 2 * s.padding,
            (w - 1) * s.stride.1 + s.kernel + s.output_padding - 2 * s.padding,
        )
    } else {
        (
            (h + 2 * s.padding - s.kernel) / s.stride.0 + 1,
            (w + 2 * s.padding - s.kernel) / s.stride.1 + 1,
        )
    }
}

/// The CUDA buffer behind a contiguous tensor that starts at offset 0 (the weights).
fn cuda_slice_of<'a, T: CudaDType>(
    storage: &'a Storage,
    layout: &Layout,
) -> candle_core::Result<&'a CudaSlice<T>> {
    if !layout.is_contiguous() || layout.start_offset() != 0 {
        candle_core::bail!("cuDNN weights must be contiguous from offset 0");
    }
    match storage {
        Storage::Cuda(s) => s.as_cuda_slice::<T>(),
        _ => candle_core::bail!("cuDNN weights must be on the GPU"),
    }
}

/// The custom operation candle runs for one layer.
struct LayerOp<'a> {
    engine: &'a CudnnEngine,
    block: &'a ConvBlock,
    /// Set when bias, residual and ReLU were applied inside the call.
    fused: std::cell::Cell<bool>,
}

impl CustomOp1 for LayerOp<'_> {
    fn name(&self) -> &'static str {
        "cudnn-conv"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("the cuDNN path runs on CUDA tensors only")
    }

    fn cuda_fwd(
        &self,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        if storage.dtype() != self.engine.dtype {
            candle_core::bail!(
                "cuDNN layer: input is {:?}, the model {:?}",
                storage.dtype(),
                self.engine.dtype
            );
        }
        match self.engine.dtype {
            DType::F16 => self.engine.run::<f16>(self, storage, layout),
            DType::BF16 => self.engine.run::<bf16>(self, storage, layout),
            DType::F32 => self.engine.run::<f32>(self, storage, layout),
            other => candle_core::bail!("no cuDNN path for {other:?}"),
        }
    }
}
