//! The Wav2Lip generator in candle, and everything needed to load it: checkpoint reading in
//! every published form, key normalisation, shape validation and BatchNorm folding.
//!
//! This layer knows nothing of tokio, HTTP or media; it turns a checkpoint file into a
//! [`Wav2Lip`] that maps mel windows and face crops to predicted faces.

/// The names of a fieldless enum's values, as flags and settings spell them: `NAMES` in
/// order, and `FromStr` (input trimmed) whose error reads `"x" is not <what> (a, b or c)`.
macro_rules! named_enum {
    ($ty:ident, $what:literal, { $($name:literal => $variant:ident),+ $(,)? }) => {
        impl $ty {
            /// The names `FromStr` accepts.
            pub const NAMES: &'static [&'static str] = &[$($name),+];
        }

        impl std::str::FromStr for $ty {
            type Err = String;

            fn from_str(s: &str) -> std::result::Result<Self, String> {
                match s.trim() {
                    $($name => Ok($ty::$variant),)+
                    _ => Err(format!(
                        "{s:?} is not {} ({})",
                        $what,
                        $crate::model::one_of(Self::NAMES)
                    )),
                }
            }
        }
    };
}

/// `a`, `a or b`, `a, b or c`.
fn one_of(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [only] => only.to_string(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

pub mod arch;
pub mod checkpoint;
pub mod cpu;
pub mod cudnn;
pub mod enhancer;
pub mod init;
pub mod kernels;
pub mod netexec;
pub mod netplan;
pub mod retinaface;
pub mod upsample;
pub mod wav2lip;
pub mod weights;

use std::path::PathBuf;

use candle_core::{DType, Device};

pub use wav2lip::Wav2Lip;
pub use weights::GeneratorWeights;

/// Errors of the model layer. Messages are written for the person who supplied the file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("not a checkpoint: {0}")]
    NotACheckpoint(String),
    #[error("{}", truncated_message(*size, *expected, detail))]
    Truncated {
        size: u64,
        expected: Option<u64>,
        detail: String,
    },
    #[error("corrupt checkpoint: {0}")]
    Corrupt(String),
    #[error("unsupported checkpoint content: {0}")]
    Unsupported(String),
    /// A pickle stopped before its STOP opcode (mapped to `Truncated` or `Corrupt` by callers).
    #[error("pickle data ends early (at byte {at})")]
    PickleEnded { at: usize },
    #[error("checkpoint is missing the Wav2Lip tensor {key}")]
    MissingKey { key: String },
    #[error("tensor {key} has shape {found:?}, but Wav2Lip needs {expected:?}")]
    WrongShape {
        key: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("checkpoint has tensors Wav2Lip does not use (another model or variant?): {}", .0.join(", "))]
    UnexpectedKeys(Vec<String>),
    /// A file recognised as a model's that does not hold exactly its tensors.
    #[error("not a complete {model} checkpoint: {detail}")]
    Mismatch { model: String, detail: String },
    #[error("tensor {key} holds non-finite values")]
    NonFinite { key: String },
    #[error("{0}")]
    Device(String),
    #[error("bad model input: {0}")]
    BadInput(String),
    /// Convolution-path flags that cannot run together.
    #[error("{0}")]
    Settings(String),
    /// A cuDNN call of the own convolution path failed. Out of memory
    /// ([`Error::is_out_of_memory`]) may pass with a smaller batch; any other status
    /// ([`Error::is_cudnn_failure`], e.g. NOT_SUPPORTED) means the own path cannot run this
    /// and the instance should switch to candle's operations
    /// ([`Wav2Lip::use_candle_operations`]) and retry.
    #[error(transparent)]
    Cudnn(#[from] cudnn::CudnnError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl Error {
    /// A stable snake_case name for the kind of error (for JSON output and metrics).
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Io { .. } => "io",
            Error::NotACheckpoint(_) => "not_a_checkpoint",
            Error::Truncated { .. } => "truncated",
            Error::Corrupt(_) | Error::PickleEnded { .. } => "corrupt",
            Error::Unsupported(_) => "unsupported",
            Error::MissingKey { .. } => "missing_key",
            Error::WrongShape { .. } => "wrong_shape",
            Error::UnexpectedKeys(_) => "unexpected_keys",
            Error::Mismatch { .. } => "mismatch",
            Error::NonFinite { .. } => "non_finite",
            Error::Device(_) => "device",
            Error::BadInput(_) => "bad_input",
            Error::Settings(_) => "settings",
            Error::Cudnn(_) => "cudnn",
            Error::Candle(_) => "internal",
        }
    }

    /// Whether the device (or cuDNN) ran out of memory: a smaller batch may pass. Covers
    /// cuDNN's host and device allocation failures and CUDA's out-of-memory error.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::Cudnn(e) => e.is_out_of_memory(),
            Error::Candle(e) => match cudnn::CudnnError::find_in(e) {
                Some(c) => c.is_out_of_memory(),
                None => {
                    let text = e.to_string();
                    text.contains("OUT_OF_MEMORY") || text.contains("out of memory")
                }
            },
            _ => false,
        }
    }

    /// Whether a cuDNN call of the own path failed for another reason than memory: candle's
    /// operations may still run this batch.
    pub fn is_cudnn_failure(&self) -> bool {
        let cudnn = match self {
            Error::Cudnn(e) => Some(e),
            Error::Candle(e) => cudnn::CudnnError::find_in(e),
            _ => None,
        };
        cudnn.is_some_and(|e| !e.is_out_of_memory())
    }
}

fn truncated_message(size: u64, expected: Option<u64>, detail: &str) -> String {
    match expected {
        Some(e) => format!(
            "checkpoint is truncated: the file has {size} bytes but should have {e} ({detail}); \
             the download is probably incomplete"
        ),
        None => format!(
            "checkpoint is truncated: {detail} (file has {size} bytes); \
             the download is probably incomplete"
        ),
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    Cpu,
    Cuda,
    /// A model stand-in that costs nothing (`--device echo`): every face it "draws" is the
    /// frame's reference face with the mouth region shifted (see `engine::echo`), so the rest
    /// of the service (audio, avatars, batches, compositing, encoding) can be measured and
    /// tested at a GPU's pace on any machine. It runs nothing on a device.
    Echo,
}

/// The precision the model computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    F32,
    F16,
    Bf16,
}

named_enum!(DeviceKind, "a device", { "cpu" => Cpu, "cuda" => Cuda, "echo" => Echo });
named_enum!(Precision, "a precision", { "f32" => F32, "f16" => F16, "bf16" => Bf16 });

impl Precision {
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::F16 => DType::F16,
            Precision::Bf16 => DType::BF16,
        }
    }
}

impl DeviceKind {
    /// `cuda` when this binary was built with the `cuda` feature and a GPU is present, else
    /// `cpu`.
    pub fn default_for_host() -> Self {
        if cfg!(feature = "cuda") && candle_core::utils::cuda_is_available() {
            match Device::new_cuda(0) {
                Ok(_) => DeviceKind::Cuda,
                Err(_) => DeviceKind::Cpu,
            }
        } else {
            DeviceKind::Cpu
        }
    }

    /// f16 on CUDA (and echo, which stands in for a GPU), f32 on CPU.
    pub fn default_precision(self) -> Precision {
        match self {
            DeviceKind::Cuda | DeviceKind::Echo => Precision::F16,
            DeviceKind::Cpu => Precision::F32,
        }
    }

    /// The name flags use (`cpu`, `cuda`, `echo`).
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// Whether the service runs with a GPU's defaults here (instances, batch sizes, encoder
    /// workers, padded batches): on CUDA, and on echo, which stands in for a GPU.
    pub fn gpu_like(self) -> bool {
        matches!(self, DeviceKind::Cuda | DeviceKind::Echo)
    }

    /// Opens the device: for CUDA the GPU numbered `cuda_device` (CUDA's numbering, from 0;
    /// ignored on the CPU).
    pub fn open(self, cuda_device: usize) -> Result<Device> {
        match self {
            DeviceKind::Cpu | DeviceKind::Echo => Ok(Device::Cpu),
            DeviceKind::Cuda if !cfg!(feature = "cuda") => Err(no_cuda_support()),
            DeviceKind::Cuda => {
                Device::new_cuda(cuda_device).map_err(|e| cuda_error(cuda_device, e))
            }
        }
    }

    /// Checks, without opening it, that the device exists: for CUDA that GPU `cuda_device`
    /// is one of the GPUs the CUDA driver sees, so a wrong number fails at start-up with the
    /// number of GPUs there are. Nothing to check on the CPU.
    pub fn check(self, cuda_device: usize) -> Result<()> {
        match self {
            DeviceKind::Cpu | DeviceKind::Echo => Ok(()),
            DeviceKind::Cuda if !cfg!(feature = "cuda") => Err(no_cuda_support()),
            DeviceKind::Cuda => match cuda_device_count() {
                Ok(count) => match missing_cuda_device(cuda_device, count) {
                    Some(message) => Err(Error::Device(message)),
                    None => Ok(()),
                },
                Err(e) => Err(Error::Device(format!(
                    "cannot open CUDA device {cuda_device}: cannot count the GPUs ({e})"
                ))),
            },
        }
    }
}

fn no_cuda_support() -> Error {
    Error::Device(
        "this lipsync binary was built without CUDA support (cargo feature `cuda`)".into(),
    )
}

/// GPUs the CUDA driver sees (after `CUDA_VISIBLE_DEVICES`).
#[cfg(feature = "cuda")]
fn cuda_device_count() -> std::result::Result<usize, String> {
    use candle_core::cuda_backend::cudarc::driver::CudaContext;
    CudaContext::device_count()
        .map(|n| usize::try_from(n).unwrap_or(0))
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn cuda_device_count() -> std::result::Result<usize, String> {
    Err("built without CUDA support".into())
}

/// The UUID of CUDA device `ordinal` as NVML writes it (`GPU-` and 32 hex digits grouped
/// 8-4-4-4-12): how to find that GPU in NVML, whose numbering is not CUDA's (NVML ignores
/// `CUDA_VISIBLE_DEVICES`). `None` without CUDA or without that device.
pub fn cuda_device_uuid(ordinal: usize) -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::result;
        result::init().ok()?;
        let device = result::device::get(i32::try_from(ordinal).ok()?).ok()?;
        let uuid = result::device::get_uuid(device).ok()?;
        Some(nvml_uuid(&uuid.bytes.map(|b| b as u8)))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        None
    }
}

/// 16 UUID bytes in NVML's text form.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn nvml_uuid(bytes: &[u8; 16]) -> String {
    let hex = |r: std::ops::Range<usize>| -> String {
        bytes[r].iter().map(|b| format!("{b:02x}")).collect()
    };
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}

/// Why GPU `ordinal` cannot be used on a machine with `count` GPUs (`None`: it can).
fn missing_cuda_device(ordinal: usize, count: usize) -> Option<String> {
    match count {
        _ if ordinal < count => None,
        0 => Some(format!(
            "CUDA device {ordinal} does not exist: the CUDA driver sees no GPU"
        )),
        1 => Some(format!(
            "CUDA device {ordinal} does not exist: there is 1 GPU (device 0)"
        )),
        n => Some(format!(
            "CUDA device {ordinal} does not exist: there are {n} GPUs (devices 0 to {})",
            n - 1
        )),
    }
}

impl DeviceKind {
    /// A device for one model instance: on CUDA with its own stream, so instances on one GPU
    /// overlap instead of serialising on the default stream, and without cudarc's event
    /// tracking (two CUDA events per allocation and an event record or wait per use, to order
    /// uses across streams), since all of an instance's work is on that one stream.
    ///
    /// Its tensors must not be moved to another CUDA device with `Tensor::to_device`: candle
    /// copies them on the destination's stream, which nothing would order after this one's
    /// work. Move data between instances through host memory (as the engine does: inputs and
    /// outputs are host vectors).
    ///
    /// `cuda_device`: which GPU, as in [`DeviceKind::open`].
    pub fn open_instance(self, cuda_device: usize) -> Result<Device> {
        match self {
            DeviceKind::Cpu | DeviceKind::Echo => Ok(Device::Cpu),
            DeviceKind::Cuda if !cfg!(feature = "cuda") => self.open(cuda_device),
            DeviceKind::Cuda => {
                let device = Device::new_cuda_with_stream(cuda_device)
                    .map_err(|e| cuda_error(cuda_device, e))?;
                #[cfg(feature = "cuda")]
                if let Device::Cuda(cuda) = &device {
                    // SAFETY: cudarc's contract for turning tracking off is that no buffer is
                    // used on another stream than the one it was allocated on without the
                    // caller ordering the two (freed before a use elsewhere ends, used
                    // elsewhere before its allocation ends, written by two streams at once).
                    // - The switch is scoped to this instance: candle's `new_with_stream` calls
                    //   `CudaContext::new(cuda_device)`, which retains the GPU's primary context but
                    //   returns a new `CudaContext` object with its own tracking flag and
                    //   stream count, held only by this device and its buffers. Other
                    //   instances (and `Device::new_cuda` devices) keep their own flags.
                    // - That object has exactly one stream (the one `new_with_stream`
                    //   created), and every use of this device's buffers is on it: candle's
                    //   kernels, cuBLAS and cuRAND take the device's stream, and so does the
                    //   own cuDNN path (`CudnnEngine::new` binds its handle to
                    //   `cuda_stream()`); copies from and to host memory are issued on it
                    //   too, and a buffer is freed on the stream it was allocated on
                    //   (`cuMemFreeAsync`, or after a synchronise without memory pools).
                    // - Nothing hands these buffers to another stream: per-instance weights
                    //   and inputs come from host memory, results go back to it (see above).
                    // Buffers allocated before this call keep their events, which cudarc then
                    // no longer records or waits on.
                    unsafe { cuda.disable_event_tracking() };
                }
                Ok(device)
            }
        }
    }
}

/// A CUDA device error in one line (candle's text may carry a backtrace), saying how many
/// GPUs there are when `ordinal` is not one of them.
fn cuda_error(ordinal: usize, e: candle_core::Error) -> Error {
    if let Some(message) = cuda_device_count()
        .ok()
        .and_then(|n| missing_cuda_device(ordinal, n))
    {
        return Error::Device(message);
    }
    let text = e.to_string();
    let first = text.lines().next().unwrap_or("unknown error");
    Error::Device(format!("cannot open CUDA device {ordinal}: {first}"))
}

/// The dtype the model will actually compute in on `device`. candle's CPU backend has no bf16
/// convolution, so bf16 on the CPU runs in f32 (the caller is warned).
pub fn compute_dtype(device: &Device, precision: Precision) -> DType {
    match (device, precision) {
        (Device::Cpu, Precision::Bf16) => {
            tracing::warn!("bf16 convolutions are not available on the CPU; computing in f32");
            DType::F32
        }
        _ => precision.dtype(),
    }
}

/// The text of a panic payload.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

#[cfg(test)]
mod tests {
    use super::cudnn::{Arena, CudnnError, Epilogue, InputPad, Upsampling};
    use super::{one_of, DeviceKind, Error, Precision};

    #[test]
    fn unknown_names_are_refused_with_the_names_there_are() {
        let err = |r: Result<(), String>| r.unwrap_err();
        assert_eq!(
            err(" F64 ".parse::<Precision>().map(drop)),
            r#"" F64 " is not a precision (f32, f16 or bf16)"#
        );
        assert_eq!(
            err("gpu".parse::<DeviceKind>().map(drop)),
            r#""gpu" is not a device (cpu, cuda or echo)"#
        );
        assert_eq!(
            err("bilinear".parse::<Upsampling>().map(drop)),
            r#""bilinear" is not an upsampling (auto, subpixel, subpixel2x2, phases or transposed)"#
        );
        assert_eq!(
            err("fused".parse::<Epilogue>().map(drop)),
            r#""fused" is not an epilogue (auto, own or separate)"#
        );
        assert_eq!(
            err("16".parse::<InputPad>().map(drop)),
            r#""16" is not an input padding (8 or none)"#
        );
        assert_eq!(
            err("yes".parse::<Arena>().map(drop)),
            r#""yes" is not an arena setting (on or off)"#
        );
        assert_eq!(" bf16\n".parse::<Precision>(), Ok(Precision::Bf16));
        assert_eq!(one_of(&["a"]), "a");
    }

    fn cudnn(status: &str, code: u32) -> CudnnError {
        CudnnError {
            call: "convolution".into(),
            status: status.into(),
            code,
        }
    }

    #[test]
    fn a_missing_cuda_device_is_named_with_the_gpus_there_are() {
        use super::missing_cuda_device;
        assert_eq!(missing_cuda_device(0, 1), None);
        assert_eq!(missing_cuda_device(7, 8), None);
        assert_eq!(
            missing_cuda_device(2, 2).as_deref(),
            Some("CUDA device 2 does not exist: there are 2 GPUs (devices 0 to 1)")
        );
        assert_eq!(
            missing_cuda_device(1, 1).as_deref(),
            Some("CUDA device 1 does not exist: there is 1 GPU (device 0)")
        );
        assert_eq!(
            missing_cuda_device(0, 0).as_deref(),
            Some("CUDA device 0 does not exist: the CUDA driver sees no GPU")
        );
        // The CPU needs no GPU, whatever the number.
        assert!(super::DeviceKind::Cpu.check(5).is_ok());
    }

    #[test]
    fn cuda_uuids_are_written_as_nvml_writes_them() {
        let bytes: [u8; 16] = std::array::from_fn(|i| (i as u8) * 17);
        assert_eq!(
            super::nvml_uuid(&bytes),
            "GPU-00112233-4455-6677-8899-aabbccddeeff"
        );
    }

    #[test]
    fn cudnn_errors_tell_out_of_memory_from_other_failures() {
        let oom = Error::Cudnn(cudnn(
            "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
            4004,
        ));
        assert!(oom.is_out_of_memory() && !oom.is_cudnn_failure());
        let unsupported = Error::Cudnn(cudnn("CUDNN_STATUS_NOT_SUPPORTED", 3000));
        assert!(!unsupported.is_out_of_memory() && unsupported.is_cudnn_failure());
        assert_eq!(unsupported.kind(), "cudnn");
        // Still recognised when it reaches the caller inside a candle error.
        let inside = Error::Candle(candle_core::Error::from(cudnn(
            "CUDNN_STATUS_BAD_PARAM",
            2000,
        )));
        assert!(inside.is_cudnn_failure() && !inside.is_out_of_memory());
        let inside = Error::Candle(candle_core::Error::from(cudnn(
            "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
            4003,
        )));
        assert!(inside.is_out_of_memory() && !inside.is_cudnn_failure());
        // CUDA's own out-of-memory error, as text.
        let cuda = Error::Candle(candle_core::Error::Msg(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
        ));
        assert!(cuda.is_out_of_memory() && !cuda.is_cudnn_failure());
        let other = Error::BadInput("x".into());
        assert!(!other.is_out_of_memory() && !other.is_cudnn_failure());
    }
}
