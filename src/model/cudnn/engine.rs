//! The cuDNN engine itself (CUDA builds); see the parent module.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cudnn::sys;
use candle_core::cuda_backend::cudarc::driver::{
    result as driver_result, sys as driver_sys, CudaEvent, CudaSlice, CudaStream, DevicePtr,
    DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::{CustomOp1, DType, Layout, Shape, Storage, Tensor};
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use super::plan::{
    pick, Candidate, Choice, CudnnError, FuseTiming, Fusion, MathType, PlanCache, PlanKey,
};
use super::{settings, ConvLayout, ConvSettings, CONVOLUTIONS_METRIC};
use crate::model::arch::LayerKind;
use crate::model::upsample::{self, UpForm};
use crate::model::wav2lip::ConvBlock;
use crate::model::{Error, Result};

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

fn check(status: sys::cudnnStatus_t, what: &str) -> std::result::Result<(), CudnnError> {
    if status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    Err(CudnnError {
        call: what.to_string(),
        status: format!("{status:?}"),
        code: status as u32,
    })
}

/// A model error from a candle error, keeping a cuDNN failure as [`Error::Cudnn`].
pub(super) fn lift(e: candle_core::Error) -> Error {
    match CudnnError::find_in(&e) {
        Some(c) => Error::Cudnn(c.clone()),
        None => Error::Candle(e),
    }
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

fn format(layout: ConvLayout) -> sys::cudnnTensorFormat_t {
    match layout {
        ConvLayout::Nchw => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
        ConvLayout::Nhwc => sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
    }
}

/// A descriptor of an activation of `(n, c, h, w)` stored in `layout`.
fn tensor4(dtype: DType, dims: [usize; 4], layout: ConvLayout) -> candle_core::Result<TensorDesc> {
    let d = TensorDesc::new()?;
    let [n, c, h, w] = dims.map(|v| v as c_int);
    check(
        unsafe {
            sys::cudnnSetTensor4dDescriptor(d.0, format(layout), data_type(dtype)?, n, c, h, w)
        },
        "tensor descriptor",
    )?;
    Ok(d)
}

fn sys_math(math: MathType) -> sys::cudnnMathType_t {
    use sys::cudnnMathType_t as M;
    match math {
        MathType::Default => M::CUDNN_DEFAULT_MATH,
        MathType::TensorOp => M::CUDNN_TENSOR_OP_MATH,
        MathType::TensorOpAllowConversion => M::CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
        MathType::Fma => M::CUDNN_FMA_MATH,
    }
}

fn set_math(conv: &ConvDesc, math: MathType) -> candle_core::Result<()> {
    check(
        unsafe { sys::cudnnSetConvolutionMathType(conv.0, sys_math(math)) },
        "math type",
    )?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Algorithm choice, shared by the process and persisted.

#[derive(Debug, Default, Serialize, Deserialize)]
struct CacheFile {
    /// GPU name, cuDNN version and the convolution settings: choices are only valid for the
    /// same.
    device: String,
    algos: BTreeMap<String, Choice>,
    /// `--conv-upsampling auto`'s choices, by layer shape, batch and path (absent in files
    /// written before it existed).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    upsampling: BTreeMap<String, FormChoice>,
}

/// The form `--conv-upsampling auto` chose for an upsampling layer at one batch, with every
/// form's time (the least of a few runs, milliseconds, including what joins the phases).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FormChoice {
    pub form: UpForm,
    pub ms: BTreeMap<UpForm, f32>,
}

impl FormChoice {
    /// The fastest of the timed forms (ties: the first in [`UpForm::ALL`]'s order).
    pub fn fastest(ms: BTreeMap<UpForm, f32>) -> Option<FormChoice> {
        let form = UpForm::ALL
            .into_iter()
            .filter(|f| ms.get(f).is_some_and(|t| t.is_finite()))
            .min_by(|a, b| ms[a].total_cmp(&ms[b]))?;
        Some(FormChoice { form, ms })
    }
}

struct Autotune {
    device: String,
    algos: BTreeMap<String, Choice>,
    forms: BTreeMap<String, FormChoice>,
    searched: usize,
    /// Choices not yet written to the cache file.
    dirty: bool,
}

impl Autotune {
    /// The process's choices, read from the cache file on first use.
    fn get(device: &str) -> &'static Mutex<Autotune> {
        AUTOTUNE.get_or_init(|| {
            let mut algos = BTreeMap::new();
            let mut forms = BTreeMap::new();
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
                            forms = file.upsampling;
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
                forms,
                searched: 0,
                dirty: false,
            })
        })
    }

    /// Writes the cache file if it lacks choices: replaced atomically through a temporary
    /// file of its own ([`crate::fsutil::write_atomic`]), so processes sharing the file on one
    /// volume never see a part of one and never write through each other's temporary file.
    /// A reader (the next process's [`Autotune::get`]) reads the whole file at once: it gets
    /// the old file or the new one.
    fn save(&mut self) {
        let Some(path) = &settings().cache_file else {
            return;
        };
        if !self.dirty {
            return;
        }
        let file = CacheFile {
            device: self.device.clone(),
            algos: self.algos.clone(),
            upsampling: self.forms.clone(),
        };
        let write = || -> std::io::Result<()> {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            crate::fsutil::write_atomic(path, &serde_json::to_vec_pretty(&file)?)
        };
        match write() {
            Ok(()) => self.dirty = false,
            Err(e) => tracing::warn!("cannot write autotune cache {}: {e}", path.display()),
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

/// One entry of a search's (or the heuristic's) results as cuDNN writes it
/// (`cudnnConvolutionFwdAlgoPerf_t` and `cudnnConvolutionBwdDataAlgoPerf_t` have this layout),
/// with its enumerations as plain integers: an entry may hold a value the bindings' Rust
/// enums lack (a status or algorithm of a newer cuDNN, or whatever cuDNN leaves in a failed
/// entry), and reading that as a Rust enum would be undefined behaviour.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RawPerf {
    algo: u32,
    status: u32,
    time: f32,
    memory: usize,
    determinism: u32,
    math_type: u32,
    reserved: [c_int; 3],
}

macro_rules! same_layout {
    ($t:ty) => {
        const _: () = {
            use std::mem::{align_of, offset_of, size_of};
            assert!(size_of::<RawPerf>() == size_of::<$t>());
            assert!(align_of::<RawPerf>() == align_of::<$t>());
            assert!(offset_of!(RawPerf, algo) == offset_of!($t, algo));
            assert!(offset_of!(RawPerf, status) == offset_of!($t, status));
            assert!(offset_of!(RawPerf, time) == offset_of!($t, time));
            assert!(offset_of!(RawPerf, memory) == offset_of!($t, memory));
            assert!(offset_of!(RawPerf, determinism) == offset_of!($t, determinism));
            assert!(offset_of!(RawPerf, math_type) == offset_of!($t, mathType));
            assert!(offset_of!(RawPerf, reserved) == offset_of!($t, reserved));
        };
    };
}
same_layout!(sys::cudnnConvolutionFwdAlgoPerf_t);
same_layout!(sys::cudnnConvolutionBwdDataAlgoPerf_t);

/// The first `count` results as candidates, in cuDNN's order. An algorithm this build does
/// not know is named by its number and never usable.
fn candidates(perf: &[RawPerf], count: c_int, transposed: bool) -> Vec<Candidate> {
    let name = |algo: u32| -> Option<String> {
        if transposed {
            BWD_ALGOS
                .iter()
                .find(|&&a| a as u32 == algo)
                .map(|a| format!("{a:?}"))
        } else {
            FWD_ALGOS
                .iter()
                .find(|&&a| a as u32 == algo)
                .map(|a| format!("{a:?}"))
        }
    };
    perf[..(count.max(0) as usize).min(perf.len())]
        .iter()
        .map(|p| {
            let known = name(p.algo);
            Candidate {
                ok: p.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS as u32 && known.is_some(),
                algo: known.unwrap_or_else(|| format!("unknown algorithm {}", p.algo)),
                math: MathType::from_raw(p.math_type),
                ms: p.time,
                workspace: p.memory,
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The engine: one per model instance (its stream, its workspace, its descriptors).

/// How a plan's algorithm was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChoiceSource {
    /// Timed by `cudnnFind…AlgorithmEx` in this process.
    Searched,
    /// Timed earlier: this process's choices or the cache file.
    Known,
    /// cuDNN's heuristic (`cudnnGet…Algorithm_v7`), for shapes first seen after warm-up.
    Heuristic,
}

/// What the engine runs for one layer at one input shape (for logs and the GPU tests).
#[derive(Debug, Clone)]
pub struct LayerReport {
    pub path: String,
    /// `(n, c, h, w)` of the input.
    pub input: [usize; 4],
    pub algo: String,
    pub math: MathType,
    /// Bytes of workspace cuDNN asked for this algorithm and math type.
    pub workspace: usize,
    /// Whether bias, residual and ReLU run inside the convolution call: false for layers
    /// without a fused form, where the fused call was timed slower than the unfused sequence
    /// (or, untimed, outside tensor-op math: [`super::fuse_decision`]), while the timing is
    /// still to come, and once cuDNN refused the fused call.
    pub fused: bool,
    /// The fused call and the unfused sequence as timed on this layer's kind (with or
    /// without a residual add) with this choice: here or read from the cache file.
    pub fuse_timing: Option<FuseTiming>,
    pub source: ChoiceSource,
}

/// A layer at one input shape, ready to run.
struct Plan {
    x: TensorDesc,
    w: FilterDesc,
    conv: ConvDesc,
    y: TensorDesc,
    bias: TensorDesc,
    algo: Algo,
    choice: Choice,
    /// What cuDNN needs for `algo` with `choice.math`, queried after setting both.
    workspace: usize,
    /// Bias, residual and ReLU inside the convolution call, or applied afterwards.
    fusion: Fusion,
    /// cuDNN refused this plan's fused call (it is never tried again).
    refused: bool,
    /// The timing that decided `fusion`, if any (`choice.fuse` for this kind of layer).
    fuse_timing: Option<FuseTiming>,
    source: ChoiceSource,
}

struct Inner {
    handle: Handle,
    relu: ActDesc,
    /// Grown to the largest chosen algorithm's need; reused by every call.
    workspace: Option<CudaSlice<u8>>,
    /// The searches' workspace (at most the workspace limit, not zeroed), kept for the whole
    /// warm-up and freed by [`CudnnEngine::finish_warm_up`].
    search_workspace: Option<CudaSlice<u8>>,
    plans: PlanCache<Plan>,
    /// Layers whose fused call failed once (warned about once).
    unfusable: HashSet<String>,
    /// NHWC only: each layer's weights in cuDNN's NHWC filter layout `(k, r, s, c)`, made on
    /// first use from the PyTorch layout `(k, c, r, s)`; by layer and weight shape.
    nhwc_weights: HashMap<String, Tensor>,
    /// The forward convolutions of each stride-2 transposed layer's upsampling forms, made
    /// on first use; by layer and form.
    forms: HashMap<(String, UpForm), Vec<ConvBlock>>,
    /// The first layers reading inputs padded with zero channels (`--conv-input-pad 8`):
    /// their weights padded to match, made on first use; by layer and channels.
    padded: HashMap<(String, usize), ConvBlock>,
    /// `auto`'s choices by layer (at any batch): the forms whose weights stay after warm-up.
    chosen: HashSet<(String, UpForm)>,
    /// Layers over a part of their input channels (a split concatenation), made on first
    /// use; by layer path, first channel and count.
    slices: HashMap<(String, usize, usize), ConvBlock>,
}

/// The own cuDNN convolution path of one model instance.
///
/// Field order matters: `inner` (the cuDNN handle, descriptors and buffers) is dropped first,
/// while the stream and device it uses still exist.
pub struct CudnnEngine {
    inner: Mutex<Inner>,
    /// Until [`Self::finish_warm_up`], shapes without a known choice are searched; after it,
    /// cuDNN's heuristic picks (no search in the middle of a request).
    searching: AtomicBool,
    stream: Arc<CudaStream>,
    dev: CudaDevice,
    dtype: DType,
    /// How activations are laid out, the workspace limit, upsampling, epilogue, input
    /// padding and arena.
    settings: ConvSettings,
    device_name: String,
}

impl std::fmt::Debug for CudnnEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudnnEngine")
            .field("dtype", &self.dtype)
            .field("layout", &self.settings.layout)
            .field("device", &self.device_name)
            .finish()
    }
}

impl Drop for CudnnEngine {
    fn drop(&mut self) {
        // cuDNN destroys its handle in the context current on the calling thread; the fields
        // drop after this, `inner` first.
        let _ = self.stream.context().bind_to_thread();
        if let Some(tune) = AUTOTUNE.get() {
            if let Ok(mut tune) = tune.lock() {
                tune.save();
            }
        }
    }
}

impl CudnnEngine {
    /// An engine on the device's stream (the instance's own stream), with the process's
    /// settings ([`super::ConvSettings`]).
    pub fn new(dev: &CudaDevice, dtype: DType) -> Result<Self> {
        Self::with_settings(dev, dtype, settings().clone())
    }

    /// An engine whose layers take and return activations in `layout` (the process's other
    /// settings).
    pub fn with_layout(dev: &CudaDevice, dtype: DType, layout: ConvLayout) -> Result<Self> {
        Self::with_settings(
            dev,
            dtype,
            ConvSettings {
                layout,
                ..settings().clone()
            },
        )
    }

    /// An engine with its own settings (one process comparing several: `lipsync bench
    /// --sections compare`). Algorithm choices are shared by the process whatever the
    /// settings: they are keyed by shape, dtype and layout.
    pub fn with_settings(dev: &CudaDevice, dtype: DType, settings: ConvSettings) -> Result<Self> {
        let identity = settings.cache_identity();
        Self::with_identity(dev, dtype, settings, &identity)
    }

    /// An engine for another network's layers beside the generator's (an enhancer's 3×3
    /// convolutions, layer by layer in `layout`, each with its bias, nothing fused after it):
    /// the process's settings otherwise, and its choices kept in the process's autotune
    /// cache under the process's identity (they are keyed by shape, dtype and layout, so
    /// they never mix with the generator's).
    pub fn beside(dev: &CudaDevice, dtype: DType, layout: ConvLayout) -> Result<Self> {
        let identity = settings().cache_identity();
        let own = ConvSettings {
            layout,
            epilogue: super::Epilogue::Separate,
            ..settings().clone()
        };
        Self::with_identity(dev, dtype, own, &identity)
    }

    /// [`Self::with_settings`], its autotune cache file named by `identity` (with the GPU and
    /// cuDNN version).
    fn with_identity(
        dev: &CudaDevice,
        dtype: DType,
        settings: ConvSettings,
        identity: &str,
    ) -> Result<Self> {
        settings.check().map_err(Error::Settings)?;
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
                    // What PyTorch, TensorFlow, ONNX Runtime and oneDNN pass: other values may
                    // be NOT_SUPPORTED by the fused kernels.
                    sys::cudnnNanPropagation_t::CUDNN_NOT_PROPAGATE_NAN,
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
            inner: Mutex::new(Inner {
                handle,
                relu,
                workspace: None,
                search_workspace: None,
                plans: PlanCache::default(),
                unfusable: HashSet::new(),
                nhwc_weights: HashMap::new(),
                forms: HashMap::new(),
                padded: HashMap::new(),
                chosen: HashSet::new(),
                slices: HashMap::new(),
            }),
            searching: AtomicBool::new(true),
            stream,
            dev: dev.clone(),
            dtype,
            // The autotune cache file's identity: choices made under other settings are not
            // reused (a lower workspace limit could not run them, a higher one never
            // searches; another upsampling, epilogue, padding or arena times other things).
            device_name: format!("{gpu} / cuDNN {version} / {identity}"),
            settings,
        })
    }

    /// The instance's stream, which every call of the engine is on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The instance's device.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// The engine's settings.
    pub fn settings(&self) -> &ConvSettings {
        &self.settings
    }

    /// The model's dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Whether the warm-up is still on (searches and timings allowed).
    pub fn searching(&self) -> bool {
        self.searching.load(Ordering::SeqCst)
    }

    /// Ends the warm-up: shapes seen from now on take cuDNN's heuristic choice instead of a
    /// search, the search workspace is freed and new choices are written to the cache file.
    pub fn finish_warm_up(&self) {
        self.searching.store(false, Ordering::SeqCst);
        // The upsampling forms a layer does not run: their weights (and filter-layout copies)
        // are freed; with `auto` every form was made for the timing. A form needed later (a
        // batch size never timed) is made again.
        let fixed = self.settings.upsampling.form();
        let mut inner = self.inner.lock().unwrap();
        inner.search_workspace = None;
        let keep = |inner: &Inner, key: &(String, UpForm)| {
            fixed == Some(key.1) || inner.chosen.contains(key)
        };
        let dropped: Vec<String> = inner
            .forms
            .iter()
            .filter(|(key, _)| !keep(&inner, key))
            .flat_map(|(_, blocks)| blocks.iter().map(|b| format!("{} ", b.path())))
            .collect();
        let kept: Vec<(String, UpForm)> = inner
            .forms
            .keys()
            .filter(|key| keep(&inner, key))
            .cloned()
            .collect();
        inner.forms.retain(|key, _| kept.contains(key));
        inner
            .nhwc_weights
            .retain(|key, _| !dropped.iter().any(|p| key.starts_with(p.as_str())));
        drop(inner);
        if let Some(tune) = AUTOTUNE.get() {
            tune.lock().unwrap().save();
        }
    }

    /// How the engine's layers take and return activations.
    pub fn layout(&self) -> ConvLayout {
        self.settings.layout
    }

    /// The forward convolutions an upsampling form of a stride-2 transposed layer runs (none
    /// for `Transposed`), made once per layer and form.
    pub fn form_blocks(&self, block: &ConvBlock, form: UpForm) -> Result<Vec<ConvBlock>> {
        if form == UpForm::Transposed {
            return Ok(Vec::new());
        }
        let key = (block.path().to_string(), form);
        if let Some(b) = self.inner.lock().unwrap().forms.get(&key) {
            return Ok(b.clone());
        }
        let parts = upsample::form_parts(form, block.spec(), block.weight(), block.bias())?;
        let blocks: Vec<ConvBlock> = parts
            .into_iter()
            .enumerate()
            .map(|(i, (c, w, b))| block.form_part(form, i, &c, w, b))
            .collect();
        self.inner.lock().unwrap().forms.insert(key, blocks.clone());
        Ok(blocks)
    }

    /// `block` reading an input of `cin` channels: itself, or (an input padded with zero
    /// channels) a copy with zero weights for them, made once.
    pub fn padded_block(&self, block: &ConvBlock, cin: usize) -> Result<ConvBlock> {
        if cin <= block.dims().cin {
            return Ok(block.clone());
        }
        let key = (block.path().to_string(), cin);
        if let Some(b) = self.inner.lock().unwrap().padded.get(&key) {
            return Ok(b.clone());
        }
        let b = block.with_input_channels(cin)?;
        self.inner.lock().unwrap().padded.insert(key, b.clone());
        Ok(b)
    }

    /// `block` over `count` of its input channels from `first` ([`ConvBlock::input_slice`]),
    /// made once.
    pub fn slice_block(&self, block: &ConvBlock, first: usize, count: usize) -> Result<ConvBlock> {
        if first == 0 && count == block.dims().cin {
            return Ok(block.clone());
        }
        let key = (block.path().to_string(), first, count);
        if let Some(b) = self.inner.lock().unwrap().slices.get(&key) {
            return Ok(b.clone());
        }
        let b = block.input_slice(first, count)?;
        self.inner.lock().unwrap().slices.insert(key, b.clone());
        Ok(b)
    }

    /// The key of an upsampling layer's form choice: its shape at this input, the dtype and
    /// layout, and whether the planned path (own epilogue) or the separate one joins the
    /// phases (they cost differently).
    fn form_key(&self, block: &ConvBlock, input: [usize; 4], planned: bool) -> String {
        let key = PlanKey::of_dims(block.path(), block.dims(), input);
        format!(
            "{} {}",
            key.tune_key(self.dtype, self.layout()),
            if planned { "planned" } else { "separate" }
        )
    }

    /// The form an upsampling layer runs at this input: the setting's, or with `auto` the
    /// one timed for this shape (`None`: not timed yet).
    pub fn known_form(
        &self,
        block: &ConvBlock,
        input: [usize; 4],
        planned: bool,
    ) -> Option<UpForm> {
        if let Some(f) = self.settings.upsampling.form() {
            return Some(f);
        }
        let key = self.form_key(block, input, planned);
        let form = Autotune::get(&self.device_name)
            .lock()
            .unwrap()
            .forms
            .get(&key)
            .map(|c| c.form)?;
        self.inner
            .lock()
            .unwrap()
            .chosen
            .insert((block.path().to_string(), form));
        Some(form)
    }

    /// The form to run when none was timed for a shape: subpixel, the first GPU run's
    /// default.
    pub const FALLBACK_FORM: UpForm = UpForm::Subpixel;

    /// Records `auto`'s choice for an upsampling layer at this input (and marks the cache
    /// file for writing).
    pub fn record_form(
        &self,
        block: &ConvBlock,
        input: [usize; 4],
        planned: bool,
        choice: FormChoice,
    ) {
        let key = self.form_key(block, input, planned);
        tracing::debug!("upsampling {key}: {choice:?}");
        self.inner
            .lock()
            .unwrap()
            .chosen
            .insert((block.path().to_string(), choice.form));
        let mut tune = Autotune::get(&self.device_name).lock().unwrap();
        tune.forms.insert(key, choice);
        tune.dirty = true;
    }

    /// The planned path's fusion timing of `block` at `input` (`(n, c, h, w)`): cuDNN's
    /// fused call against the convolution followed by the own epilogue, if timed.
    pub(super) fn own_fusion(&self, block: &ConvBlock, input: [usize; 4]) -> Option<FuseTiming> {
        let key = PlanKey::of_dims(block.path(), block.dims(), input);
        let tune = Autotune::get(&self.device_name).lock().unwrap();
        tune.algos
            .get(&key.tune_key(self.dtype, self.layout()))?
            .fuse
            .get_own(block.spec().residual)
    }

    /// Records [`Self::own_fusion`]'s timing with the process's choice for the shape (and
    /// marks the cache file for writing).
    pub(super) fn record_own_fusion(
        &self,
        block: &ConvBlock,
        input: [usize; 4],
        timing: FuseTiming,
    ) {
        let key = PlanKey::of_dims(block.path(), block.dims(), input);
        let tune_key = key.tune_key(self.dtype, self.layout());
        tracing::debug!(
            "{} {input:?}: fused {:.3} ms, convolution + own epilogue {:.3} ms",
            block.path(),
            timing.fused_ms,
            timing.unfused_ms
        );
        let mut tune = Autotune::get(&self.device_name).lock().unwrap();
        if let Some(c) = tune.algos.get_mut(&tune_key) {
            c.fuse.set_own(block.spec().residual, timing);
            tune.dirty = true;
        }
    }

    /// Every form choice the process knows, by key (for the bench's table).
    pub fn form_choices(&self) -> BTreeMap<String, FormChoice> {
        Autotune::get(&self.device_name)
            .lock()
            .unwrap()
            .forms
            .clone()
    }

    /// Times `run` for each form, interleaved: one untimed run each (its searches), then the
    /// least of [`FORM_TIMING_RUNS`] timed runs, CUDA events on the instance's stream. A
    /// form whose run fails is left out (with a debug line).
    pub fn time_forms(
        &self,
        forms: &[UpForm],
        mut run: impl FnMut(UpForm) -> Result<()>,
    ) -> Result<BTreeMap<UpForm, f32>> {
        let mut ok: Vec<UpForm> = Vec::new();
        for &f in forms {
            match run(f) {
                Ok(()) => ok.push(f),
                Err(e) if e.is_out_of_memory() => return Err(e),
                Err(e) => tracing::debug!("upsampling form {f:?} cannot run here: {e}"),
            }
        }
        // Every run queued with its events first, read after: reading an event waits for
        // the device, and a run started on an idle device would pay its launches.
        let mut marks = Vec::with_capacity(FORM_TIMING_RUNS * ok.len());
        for _ in 0..FORM_TIMING_RUNS {
            for &f in &ok {
                let start = self.mark()?;
                run(f)?;
                marks.push((f, start, self.mark()?));
            }
        }
        let mut best: BTreeMap<UpForm, f32> = ok.iter().map(|&f| (f, f32::INFINITY)).collect();
        for (f, start, end) in &marks {
            let ms = start.elapsed_ms(end).map_err(candle_core::Error::from)?;
            let t = best.get_mut(f).expect("timed forms");
            *t = t.min(ms);
        }
        Ok(best)
    }

    /// An event recorded now on the instance's stream (for timing layers).
    pub fn mark(&self) -> Result<CudaEvent> {
        Ok(self
            .stream
            .record_event(Some(driver_sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(candle_core::Error::from)?)
    }

    /// Every plan made so far, sorted by layer and input shape.
    pub fn report(&self) -> Vec<LayerReport> {
        let inner = self.inner.lock().unwrap();
        let mut out: Vec<LayerReport> = inner
            .plans
            .iter()
            .map(|(key, plan)| LayerReport {
                path: key.path.clone(),
                input: key.input,
                algo: plan.choice.algo.clone(),
                math: plan.choice.math,
                workspace: plan.workspace,
                fused: plan.fusion.runs_fused(),
                fuse_timing: plan.fuse_timing,
                source: plan.source,
            })
            .collect();
        out.sort_by(|a, b| (&a.path, a.input).cmp(&(&b.path, b.input)));
        out
    }

    /// One layer: convolution (or transposed convolution) + bias (+ residual) (+ ReLU), as
    /// [`ConvBlock::forward`] computes it, on an activation in the engine's layout
    /// ([`Self::layout`]; the output is in it too). A failed cuDNN call comes back as
    /// [`Error::Cudnn`]. During warm-up, a plan's first run is followed by the timing of its
    /// fused call against the unfused sequence ([`Self::time_fusion`]).
    pub fn forward(&self, block: &ConvBlock, x: &Tensor) -> Result<Tensor> {
        let layout = self.layout();
        let logical = {
            let (a, b, c, d) = x.dims4()?;
            layout.logical([a, b, c, d])
        };
        if logical[1] > block.dims().cin {
            let padded = self.padded_block(block, logical[1])?;
            return self.forward(&padded, x);
        }
        if upsample::applies(block.spec()) {
            let form = match self.known_form(block, logical, false) {
                Some(f) => f,
                None if self.searching() => {
                    let x = x.contiguous()?;
                    let ms = self
                        .time_forms(&UpForm::ALL, |f| self.forward_form(block, &x, f).map(drop))?;
                    let choice = FormChoice::fastest(ms).ok_or_else(|| {
                        Error::Settings(format!("no upsampling form runs {}", block.path()))
                    })?;
                    let form = choice.form;
                    self.record_form(block, logical, false, choice);
                    form
                }
                None => Self::FALLBACK_FORM,
            };
            return self.forward_form(block, x, form);
        }
        self.forward_one(block, x)
    }

    /// An upsampling layer through `form`: its convolutions (bias and ReLU as the plans
    /// fuse them), the phases joined by candle's operations.
    fn forward_form(&self, block: &ConvBlock, x: &Tensor, form: UpForm) -> Result<Tensor> {
        if form == UpForm::Transposed {
            return self.forward_one(block, x);
        }
        let layout = self.layout();
        let (a, b, c, d) = x.dims4()?;
        let [_, _, h, w] = layout.logical([a, b, c, d]);
        let z = self
            .form_blocks(block, form)?
            .iter()
            .map(|part| self.forward_one(part, x))
            .collect::<Result<Vec<_>>>()?;
        upsample::assemble(form, &z, block.spec().cout, (h, w), layout)
    }

    /// One convolution layer as it is (no form, no padding).
    fn forward_one(&self, block: &ConvBlock, x: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        let ran = self.layer(block, &x, Mode::Planned)?;
        if ran.to_time {
            self.time_fusion(block, &x);
        }
        Ok(ran.y)
    }

    /// One run of a layer in `mode`, with bias, residual and ReLU applied after the
    /// convolution call when it did not apply them itself.
    fn layer(&self, block: &ConvBlock, x: &Tensor, mode: Mode) -> Result<Ran> {
        let op = LayerOp {
            engine: self,
            block,
            mode,
            fused: std::cell::Cell::new(false),
            to_time: std::cell::Cell::new(false),
        };
        let y = x.apply_op1_no_bwd(&op).map_err(lift)?;
        let fused = op.fused.get();
        let y = if fused {
            y
        } else {
            let s = block.spec();
            let bias = block
                .bias()
                .reshape(self.layout().physical([1, s.cout, 1, 1]).to_vec())?;
            let y = y.broadcast_add(&bias)?;
            block.activate(y, x)?
        };
        Ok(Ran {
            y,
            fused,
            to_time: op.to_time.get(),
        })
    }

    /// Times the fused call against the unfused sequence on the layer's own buffers, keeps
    /// the faster for the plan ([`Fusion::decided`]) and records the timing with the
    /// process's choice, so the cache file carries it and a restart does not time again. A
    /// fused call cuDNN refuses leaves the plan unfused (nothing recorded); a timing that
    /// fails otherwise falls back to the untimed rule, with a warning (the layer's result is
    /// already computed: the request does not fail for it).
    fn time_fusion(&self, block: &ConvBlock, x: &Tensor) {
        let Ok(key) = plan_key(block, x.dims(), self.layout()) else {
            return;
        };
        let residual = block.spec().residual;
        if !self.searching.load(Ordering::SeqCst) {
            // The warm-up ended since the plan was made (its first forward pass failed after
            // the convolution, say): no timing in the middle of a request.
            let mut inner = self.inner.lock().unwrap();
            if let Some(plan) = inner.plans.get_mut(&key) {
                if plan.fusion == Fusion::ToTime {
                    plan.fusion = Fusion::decided(None, plan.choice.math);
                }
            }
            return;
        }
        let measured = self.measure_fusion(block, x);
        let mut inner = self.inner.lock().unwrap();
        let Some(plan) = inner.plans.get_mut(&key) else {
            return;
        };
        if plan.fusion != Fusion::ToTime {
            // Refused by cuDNN while timing: already unfused.
            return;
        }
        let timing = match measured {
            Ok(Some(t)) => t,
            Ok(None) => {
                plan.fusion.refused();
                return;
            }
            Err(e) => {
                plan.fusion = Fusion::decided(None, plan.choice.math);
                tracing::warn!(
                    "{} {:?}: timing the fused convolution failed ({e}); {}",
                    block.path(),
                    key.input,
                    if plan.fusion.runs_fused() {
                        "fusing (tensor-op math)"
                    } else {
                        "running it unfused"
                    }
                );
                return;
            }
        };
        plan.fusion = Fusion::decided(Some(timing), plan.choice.math);
        plan.fuse_timing = Some(timing);
        plan.choice.fuse.set(residual, timing);
        let (algo, math, fused) = (
            plan.choice.algo.clone(),
            plan.choice.math,
            plan.fusion.runs_fused(),
        );
        drop(inner);
        tracing::debug!(
            "{} {:?} ({algo}, {math:?}): fused {:.3} ms, unfused {:.3} ms; fused: {fused}",
            block.path(),
            key.input,
            timing.fused_ms,
            timing.unfused_ms
        );
        let mut tune = Autotune::get(&self.device_name).lock().unwrap();
        if let Some(c) = tune.algos.get_mut(&key.tune_key(self.dtype, self.layout())) {
            // Only for the choice the plan runs (another instance may have replaced it).
            if c.algo == algo && c.math.to_run(self.dtype) == math {
                c.fuse.set(residual, timing);
                tune.dirty = true;
            }
        }
    }

    /// The least time of [`FUSE_TIMING_RUNS`] runs of the fused call and of the unfused
    /// sequence (convolution, then bias, residual and ReLU as [`Self::layer`] applies them),
    /// interleaved, after one untimed run of each; CUDA events on the instance's stream.
    /// `None` when cuDNN refuses the fused call.
    fn measure_fusion(&self, block: &ConvBlock, x: &Tensor) -> Result<Option<FuseTiming>> {
        if !self.layer(block, x, Mode::Fused)?.fused {
            return Ok(None);
        }
        self.layer(block, x, Mode::Unfused)?;
        let event = || self.mark();
        let mut marks = Vec::with_capacity(FUSE_TIMING_RUNS);
        for _ in 0..FUSE_TIMING_RUNS {
            let start = event()?;
            let fused = self.layer(block, x, Mode::Fused)?;
            let middle = event()?;
            let unfused = self.layer(block, x, Mode::Unfused)?;
            let end = event()?;
            if !fused.fused {
                return Ok(None);
            }
            // The outputs are freed in stream order after the events.
            drop((fused, unfused));
            marks.push((start, middle, end));
        }
        let ms = |a: &CudaEvent, b: &CudaEvent| -> Result<f32> {
            Ok(a.elapsed_ms(b).map_err(candle_core::Error::from)?)
        };
        let mut timing = FuseTiming {
            fused_ms: f32::INFINITY,
            unfused_ms: f32::INFINITY,
        };
        for (start, middle, end) in &marks {
            timing.fused_ms = timing.fused_ms.min(ms(start, middle)?);
            timing.unfused_ms = timing.unfused_ms.min(ms(middle, end)?);
        }
        Ok(Some(timing))
    }

    /// Makes the plan for a layer at an input shape: the choice known to the process, else a
    /// search (during warm-up; it leaves arbitrary values in the output buffer) or cuDNN's
    /// heuristic (after it).
    fn make_plan(
        &self,
        handle: &Handle,
        search_workspace: &mut Option<CudaSlice<u8>>,
        block: &ConvBlock,
        key: &PlanKey,
        bufs: (u64, u64, u64),
    ) -> candle_core::Result<Plan> {
        let s = block.spec();
        let d = key.dims();
        let transposed = key.transposed;
        let [n, c, h, w] = key.input;
        let (oh, ow) = d.output(h, w);
        let x = tensor4(self.dtype, [n, c, h, w], self.layout())?;
        let y = tensor4(self.dtype, [n, d.cout, oh, ow], self.layout())?;
        let bias = tensor4(self.dtype, [1, d.cout, 1, 1], self.layout())?;
        let wd = FilterDesc::new()?;
        // PyTorch layouts: conv (cout, cin, k, k); transposed (cin, cout, k, k), which is the
        // filter of the forward convolution whose data gradient the transposed conv is. The
        // dimensions are given in that order for either format; in NHWC the weights are
        // stored (k, r, s, c) ([`Self::weight`]).
        let [k0, k1, k2, k3] = key.weight.map(|v| v as c_int);
        check(
            unsafe {
                sys::cudnnSetFilter4dDescriptor(
                    wd.0,
                    data_type(self.dtype)?,
                    format(self.layout()),
                    k0,
                    k1,
                    k2,
                    k3,
                )
            },
            "filter descriptor",
        )?;
        let conv = ConvDesc::new()?;
        check(
            unsafe {
                sys::cudnnSetConvolution2dDescriptor(
                    conv.0,
                    d.pad.0 as c_int,
                    d.pad.1 as c_int,
                    d.stride.0 as c_int,
                    d.stride.1 as c_int,
                    1,
                    1,
                    sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                    // Accumulate in f32 whatever the storage type.
                    sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
                )
            },
            "convolution descriptor",
        )?;
        set_math(&conv, MathType::for_search(self.dtype))?;
        let descs = (&x, &wd, &conv, &y);

        let tune_key = key.tune_key(self.dtype, self.layout());
        // Held during the search, so instances do not time each other's kernels.
        let mut tune = Autotune::get(&self.device_name).lock().unwrap();
        let known = tune.algos.get(&tune_key).and_then(|c| {
            let c = c.usable_for(self.dtype)?;
            Algo::from_name(transposed, &c.algo).map(|a| (a, c))
        });
        let searching = self.searching.load(Ordering::SeqCst);
        let (algo, choice, source) = match known {
            Some((a, c)) => (a, c, ChoiceSource::Known),
            None if searching => {
                let (a, c) = self.find(handle, search_workspace, transposed, descs, bufs)?;
                tracing::debug!("autotuned {tune_key}: {c:?}");
                tune.algos.insert(tune_key, c.clone());
                tune.searched += 1;
                tune.dirty = true;
                (a, c, ChoiceSource::Searched)
            }
            None => {
                let (a, c) = self.heuristic(handle, transposed, descs)?;
                tracing::debug!("heuristic choice for {tune_key} (after warm-up): {c:?}");
                (a, c, ChoiceSource::Heuristic)
            }
        };
        drop(tune);
        // The math type the choice runs with (f32: FMA; half types: exactly the one the
        // search reported), then what cuDNN needs for it.
        set_math(&conv, choice.math)?;
        let workspace = workspace_size(handle, algo, descs)?;
        // Only convolutions followed by BatchNorm and ReLU have a fused form. Timing is for
        // the warm-up, like searching.
        let fuse_timing = choice.fuse.get(s.residual);
        let fusion = Fusion::new(
            s.kind == LayerKind::Conv,
            fuse_timing,
            choice.math,
            searching,
        );
        Ok(Plan {
            x,
            w: wd,
            conv,
            y,
            bias,
            algo,
            choice,
            workspace,
            fusion,
            refused: false,
            fuse_timing,
            source,
        })
    }

    /// Times every algorithm on the real buffers (`y` is scratch) and keeps the fastest that
    /// is usable ([`pick`]).
    fn find(
        &self,
        handle: &Handle,
        search_workspace: &mut Option<CudaSlice<u8>>,
        transposed: bool,
        (x, w, conv, y): (&TensorDesc, &FilterDesc, &ConvDesc, &TensorDesc),
        (x_ptr, w_ptr, y_ptr): (u64, u64, u64),
    ) -> candle_core::Result<(Algo, Choice)> {
        if search_workspace.is_none() {
            *search_workspace = Some(self.search_buffer()?);
        }
        let ws_buf = search_workspace.as_mut().expect("allocated above");
        let ws_bytes = ws_buf.len();
        let (ws, _ws_sync) = ws_buf.device_ptr_mut(&self.stream);
        let mut count: c_int = 0;
        let cands = if transposed {
            let mut perf = [RawPerf::default(); BWD_ALGOS.len()];
            check(
                unsafe {
                    sys::cudnnFindConvolutionBackwardDataAlgorithmEx(
                        handle.0,
                        w.0,
                        w_ptr as *const c_void,
                        x.0,
                        x_ptr as *const c_void,
                        conv.0,
                        y.0,
                        y_ptr as *mut c_void,
                        perf.len() as c_int,
                        &mut count,
                        perf.as_mut_ptr()
                            .cast::<sys::cudnnConvolutionBwdDataAlgoPerf_t>(),
                        ws as *mut c_void,
                        ws_bytes,
                    )
                },
                "find backward-data algorithm",
            )?;
            candidates(&perf, count, transposed)
        } else {
            let mut perf = [RawPerf::default(); FWD_ALGOS.len()];
            check(
                unsafe {
                    sys::cudnnFindConvolutionForwardAlgorithmEx(
                        handle.0,
                        x.0,
                        x_ptr as *const c_void,
                        w.0,
                        w_ptr as *const c_void,
                        conv.0,
                        y.0,
                        y_ptr as *mut c_void,
                        perf.len() as c_int,
                        &mut count,
                        perf.as_mut_ptr()
                            .cast::<sys::cudnnConvolutionFwdAlgoPerf_t>(),
                        ws as *mut c_void,
                        ws_bytes,
                    )
                },
                "find forward algorithm",
            )?;
            candidates(&perf, count, transposed)
        };
        // Within what the search could allocate, which may be less than the limit.
        self.choose(
            transposed,
            &cands,
            "search",
            ws_bytes.min(self.settings.workspace_limit),
        )
    }

    /// The searches' workspace: the workspace limit, halved until the device can hold it (down
    /// to 16 MiB), so a large `--cudnn-workspace` narrows the search instead of failing every
    /// warm-up batch; algorithms are then timed only within what was allocated.
    fn search_buffer(&self) -> candle_core::Result<CudaSlice<u8>> {
        let mut bytes = self.settings.workspace_limit.max(1);
        loop {
            // SAFETY: scratch memory for cuDNN; never read by us.
            match unsafe { self.stream.alloc::<u8>(bytes) } {
                Ok(buf) => {
                    if bytes < self.settings.workspace_limit {
                        tracing::warn!(
                            "cuDNN search workspace: {} MiB of the {} MiB allowed could be \
                             allocated; algorithms needing more are not considered",
                            bytes >> 20,
                            self.settings.workspace_limit >> 20
                        );
                    }
                    return Ok(buf);
                }
                Err(e) if bytes <= SEARCH_WORKSPACE_FLOOR => return Err(e.into()),
                Err(_) => bytes = (bytes / 2).max(SEARCH_WORKSPACE_FLOOR),
            }
        }
    }

    /// cuDNN's heuristic order (no timing, no buffers), first usable entry.
    fn heuristic(
        &self,
        handle: &Handle,
        transposed: bool,
        (x, w, conv, y): (&TensorDesc, &FilterDesc, &ConvDesc, &TensorDesc),
    ) -> candle_core::Result<(Algo, Choice)> {
        let mut count: c_int = 0;
        let cands = if transposed {
            let mut perf = [RawPerf::default(); BWD_ALGOS.len()];
            check(
                unsafe {
                    sys::cudnnGetConvolutionBackwardDataAlgorithm_v7(
                        handle.0,
                        w.0,
                        x.0,
                        conv.0,
                        y.0,
                        perf.len() as c_int,
                        &mut count,
                        perf.as_mut_ptr()
                            .cast::<sys::cudnnConvolutionBwdDataAlgoPerf_t>(),
                    )
                },
                "heuristic backward-data algorithm",
            )?;
            candidates(&perf, count, transposed)
        } else {
            let mut perf = [RawPerf::default(); FWD_ALGOS.len()];
            check(
                unsafe {
                    sys::cudnnGetConvolutionForwardAlgorithm_v7(
                        handle.0,
                        x.0,
                        w.0,
                        conv.0,
                        y.0,
                        perf.len() as c_int,
                        &mut count,
                        perf.as_mut_ptr()
                            .cast::<sys::cudnnConvolutionFwdAlgoPerf_t>(),
                    )
                },
                "heuristic forward algorithm",
            )?;
            candidates(&perf, count, transposed)
        };
        let (algo, mut choice) = self.choose(
            transposed,
            &cands,
            "heuristic",
            self.settings.workspace_limit,
        )?;
        choice.ms = -1.0;
        Ok((algo, choice))
    }

    fn choose(
        &self,
        transposed: bool,
        cands: &[Candidate],
        how: &str,
        max_workspace: usize,
    ) -> candle_core::Result<(Algo, Choice)> {
        // Nothing usable is cuDNN not supporting this layer here (a cuDNN failure other than
        // memory: candle's operations may run it).
        let unsupported = |what: String| CudnnError {
            call: format!("{how} for {:?}", self.dtype),
            status: format!("CUDNN_STATUS_NOT_SUPPORTED ({what})"),
            code: sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED as u32,
        };
        let choice = pick(cands, self.dtype, max_workspace)
            .ok_or_else(|| unsupported(format!("no usable algorithm among {cands:?}")))?;
        let algo = Algo::from_name(transposed, &choice.algo)
            .ok_or_else(|| unsupported(format!("unknown algorithm {}", choice.algo)))?;
        Ok((algo, choice))
    }

    /// The instance's run workspace, grown to at least `bytes` (not zeroed: cuDNN's
    /// scratch); its device address.
    fn workspace(
        &self,
        workspace: &mut Option<CudaSlice<u8>>,
        bytes: usize,
    ) -> candle_core::Result<u64> {
        let bytes = bytes.max(1);
        if workspace.as_ref().is_none_or(|w| w.len() < bytes) {
            *workspace = None;
            // SAFETY: scratch memory for cuDNN; never read by us.
            *workspace = Some(unsafe { self.stream.alloc::<u8>(bytes)? });
        }
        let ws = workspace.as_mut().expect("allocated above");
        let (ptr, _sync) = ws.device_ptr_mut(&self.stream);
        Ok(ptr)
    }

    /// Runs one layer's cuDNN call on buffers of element type `T`: the fused call where
    /// `op.mode` asks for it and the plan allows it, else the plain convolution.
    fn run<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
        &self,
        op: &LayerOp<'_>,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let block = op.block;
        let d = *block.dims();
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("cuDNN layer {}: input not contiguous", block.path());
        };
        let key = plan_key(block, layout.dims(), self.layout())?;
        let dims = key.input;
        let (oh, ow) = d.output(dims[2], dims[3]);
        let x = storage.as_cuda_slice::<T>()?.slice(start..end);
        let len = dims[0] * d.cout * oh * ow;
        // SAFETY: every element is written before it is read: the convolution calls run with
        // beta = 0 (the output is not read), and the fused call reads the output as z only
        // after it is zeroed ([`Self::call`]).
        let mut y = unsafe { self.dev.alloc::<T>(len)? };
        let ran = {
            let (x_ptr, _sx) = x.device_ptr(&self.stream);
            // cuDNN writes the output: a mutable access, so cudarc records the write.
            let (y_ptr, _sy) = y.device_ptr_mut(&self.stream);
            self.call(
                block,
                &key,
                (x_ptr, y_ptr),
                len * std::mem::size_of::<T>(),
                op.mode,
            )?
        };
        if op.mode == Mode::Planned {
            // The forward passes' calls only, not the warm-up's timing runs.
            metrics::counter!(CONVOLUTIONS_METRIC, "fused" => if ran.fused { "true" } else { "false" })
                .increment(1);
            op.to_time.set(ran.to_time);
        }
        op.fused.set(ran.fused);
        Ok((
            CudaStorage::wrap_cuda_slice(y, self.dev.clone()),
            Shape::from(self.layout().physical([dims[0], d.cout, oh, ow]).to_vec()),
        ))
    }

    /// The device address of a contiguous tensor's first element.
    pub(super) fn address(&self, t: &Tensor) -> candle_core::Result<u64> {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            candle_core::bail!("cuDNN path: a tensor is not on the GPU");
        };
        if !layout.is_contiguous() {
            candle_core::bail!("cuDNN path: a tensor is not contiguous");
        }
        let base = match t.dtype() {
            DType::F16 => s.as_cuda_slice::<f16>()?.device_ptr(&self.stream).0,
            DType::BF16 => s.as_cuda_slice::<bf16>()?.device_ptr(&self.stream).0,
            DType::F32 => s.as_cuda_slice::<f32>()?.device_ptr(&self.stream).0,
            other => candle_core::bail!("cuDNN path: no {other:?} tensors"),
        };
        Ok(base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
    }

    /// The cuDNN call of one layer on device addresses: its input `x` (the plan's shape in
    /// `key`) and its output `y` of `y_bytes`. In `mode`, the fused call (bias, residual =
    /// the input, ReLU: only convolutions have one, and cuDNN may refuse it, which leaves the
    /// plan unfused from then on) or the convolution alone (beta = 0). Makes the plan first
    /// if there is none (a search during warm-up writes `y`).
    pub(super) fn call(
        &self,
        block: &ConvBlock,
        key: &PlanKey,
        (x_ptr, y_ptr): (u64, u64),
        y_bytes: usize,
        mode: Mode,
    ) -> candle_core::Result<Ran<()>> {
        let s = block.spec();
        let w_tensor = self.weight(block)?;
        let w_ptr = self.address(&w_tensor)?;
        let b_ptr = self.address(block.bias())?;
        let stream = &self.stream;
        let mut guard = self.inner.lock().unwrap();
        let Inner {
            handle,
            relu,
            workspace,
            search_workspace,
            plans,
            unfusable,
            ..
        } = &mut *guard;
        // A search writes its output: when adding to an output, it searches on a scratch one.
        let mut search_y: Option<CudaSlice<u8>> = None;
        let search_ptr = if mode == Mode::Accumulate && plans.get_mut(key).is_none() {
            // SAFETY: cuDNN's scratch output for the search; never read by us.
            let buf = search_y.insert(unsafe { stream.alloc::<u8>(y_bytes.max(1))? });
            buf.device_ptr_mut(stream).0
        } else {
            y_ptr
        };
        let plan = plans.get_or_try_insert(key, || {
            self.make_plan(
                handle,
                search_workspace,
                block,
                key,
                (x_ptr, w_ptr, search_ptr),
            )
        })?;
        drop(search_y);
        let try_fused = match mode {
            Mode::Planned => plan.fusion.runs_fused(),
            // Timings ask for the fused call whatever was decided, unless cuDNN refused it.
            Mode::Fused => !plan.refused && s.kind == LayerKind::Conv,
            Mode::Unfused | Mode::Accumulate => false,
        };
        if try_fused && !s.residual {
            // The fused call's z is the output itself, scaled by 0: start from zeros, not from
            // whatever the allocation (or a search) left there (0 × NaN is NaN).
            // SAFETY: `y_ptr` is a live allocation of at least `y_bytes` on this stream.
            unsafe {
                driver_result::memset_d8_async(y_ptr, 0, y_bytes, stream.cu_stream())
                    .map_err(candle_core::Error::from)?;
            }
        }
        let need = plan.workspace;
        let ws = self.workspace(workspace, need)? as *mut c_void;
        // f32 scaling factors for every storage type (f32 compute; cuDNN takes float
        // factors for FLOAT, HALF and BFLOAT16 data).
        let (one, zero) = (1f32, 0f32);
        let one_p = &one as *const f32 as *const c_void;
        let zero_p = &zero as *const f32 as *const c_void;
        // The convolution's beta: 0 overwrites the output, 1 adds to it.
        let beta_p = if mode == Mode::Accumulate {
            one_p
        } else {
            zero_p
        };
        let (xp, wp, yp) = (
            x_ptr as *const c_void,
            w_ptr as *const c_void,
            y_ptr as *mut c_void,
        );
        let mut done_fused = false;
        if let (true, Algo::Fwd(algo)) = (try_fused, plan.algo) {
            // z: the input itself for residual layers (same shape as the output), else
            // the zeroed output scaled by 0.
            let (alpha2, z, zp) = if s.residual {
                (one_p, plan.x.0, xp)
            } else {
                (zero_p, plan.y.0, yp as *const c_void)
            };
            let status = unsafe {
                sys::cudnnConvolutionBiasActivationForward(
                    handle.0,
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
                    relu.0,
                    plan.y.0,
                    yp,
                )
            };
            match check(status, "fused convolution") {
                Ok(()) => done_fused = true,
                Err(e) if e.is_out_of_memory() => return Err(e.into()),
                Err(e) => {
                    // Not every type/layout/algorithm combination has a fused kernel: run
                    // this plan unfused from now on, and say so once per layer.
                    plan.fusion.refused();
                    plan.refused = true;
                    if unfusable.insert(block.path().to_string()) {
                        tracing::warn!(
                            "{} ({:?}, {}, {:?}): {e}; running it unfused",
                            block.path(),
                            self.dtype,
                            plan.choice.algo,
                            plan.choice.math
                        );
                    }
                }
            }
        }
        if !done_fused {
            let status = match plan.algo {
                Algo::Fwd(algo) => unsafe {
                    sys::cudnnConvolutionForward(
                        handle.0,
                        one_p,
                        plan.x.0,
                        xp,
                        plan.w.0,
                        wp,
                        plan.conv.0,
                        algo,
                        ws,
                        need,
                        beta_p,
                        plan.y.0,
                        yp,
                    )
                },
                Algo::Bwd(algo) => unsafe {
                    sys::cudnnConvolutionBackwardData(
                        handle.0,
                        one_p,
                        plan.w.0,
                        wp,
                        plan.x.0,
                        xp,
                        plan.conv.0,
                        algo,
                        ws,
                        need,
                        beta_p,
                        plan.y.0,
                        yp,
                    )
                },
            };
            check(status, "convolution")?;
        }
        let to_time = plan.fusion == Fusion::ToTime;
        drop(guard);
        // The weights stay alive in the engine's caches and the model: nothing is freed
        // before the stream has used it.
        drop(w_tensor);
        Ok(Ran {
            y: (),
            fused: done_fused,
            to_time,
        })
    }

    /// A layer's weights as the engine's filter descriptor reads them: PyTorch's layout in
    /// NCHW; in NHWC `(k, r, s, c)`, permuted once per layer and kept.
    fn weight(&self, block: &ConvBlock) -> candle_core::Result<Tensor> {
        if self.layout() == ConvLayout::Nchw {
            return Ok(block.weight().clone());
        }
        let key = format!("{} {:?}", block.path(), block.weight().dims());
        let mut inner = self.inner.lock().unwrap();
        if let Some(w) = inner.nhwc_weights.get(&key) {
            return Ok(w.clone());
        }
        let w = block.weight().permute((0, 2, 3, 1))?.contiguous()?;
        inner.nhwc_weights.insert(key, w.clone());
        Ok(w)
    }
}

/// What cuDNN needs as workspace for `algo` with the math type set on `conv`.
fn workspace_size(
    handle: &Handle,
    algo: Algo,
    (x, w, conv, y): (&TensorDesc, &FilterDesc, &ConvDesc, &TensorDesc),
) -> candle_core::Result<usize> {
    let mut bytes = 0usize;
    match algo {
        Algo::Fwd(a) => check(
            unsafe {
                sys::cudnnGetConvolutionForwardWorkspaceSize(
                    handle.0, x.0, w.0, conv.0, y.0, a, &mut bytes,
                )
            },
            "forward workspace size",
        )?,
        Algo::Bwd(a) => check(
            unsafe {
                sys::cudnnGetConvolutionBackwardDataWorkspaceSize(
                    handle.0, w.0, x.0, conv.0, y.0, a, &mut bytes,
                )
            },
            "backward-data workspace size",
        )?,
    }
    Ok(bytes)
}

/// A plan's key for a layer and its input's dimensions in `layout`.
fn plan_key(
    block: &ConvBlock,
    input: &[usize],
    layout: ConvLayout,
) -> candle_core::Result<PlanKey> {
    let dims: [usize; 4] = input
        .try_into()
        .map_err(|_| candle_core::Error::Msg("cuDNN layer: input is not 4-D".into()))?;
    let dims = layout.logical(dims);
    if dims[1] != block.dims().cin {
        candle_core::bail!(
            "cuDNN layer {}: input has {} channels, the layer reads {}",
            block.path(),
            dims[1],
            block.dims().cin
        );
    }
    Ok(PlanKey::of_dims(block.path(), block.dims(), dims))
}

/// The smallest search workspace tried when the limit cannot be allocated.
const SEARCH_WORKSPACE_FLOOR: usize = 16 << 20;

/// Timed runs of the fused call and of the unfused sequence, per plan, once (during warm-up).
pub(super) const FUSE_TIMING_RUNS: usize = 3;

/// Timed runs of each upsampling form, per layer and batch, once (during warm-up).
const FORM_TIMING_RUNS: usize = 3;

/// Which form of a layer a run calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// The plan's (making the plan first if there is none).
    Planned,
    /// The fused call unless the layer has none or cuDNN refused it (fusion timing).
    Fused,
    /// The convolution alone (fusion timing, the planned path).
    Unfused,
    /// The convolution alone, added to what the output holds (beta = 1: the second part of
    /// a split concatenation).
    Accumulate,
}

/// A layer's output, and how it was made.
pub(super) struct Ran<Y = Tensor> {
    pub(super) y: Y,
    /// Bias, residual and ReLU were applied inside the convolution call.
    pub(super) fused: bool,
    /// The plan waits for its fusion timing.
    pub(super) to_time: bool,
}

/// The custom operation candle runs for one layer.
struct LayerOp<'a> {
    engine: &'a CudnnEngine,
    block: &'a ConvBlock,
    mode: Mode,
    /// Set when bias, residual and ReLU were applied inside the call.
    fused: std::cell::Cell<bool>,
    /// Set when the plan waits for its fusion timing ([`Mode::Planned`] runs only).
    to_time: std::cell::Cell<bool>,
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
