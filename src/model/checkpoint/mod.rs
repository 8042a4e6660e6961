//! Reading checkpoint files in every form Wav2Lip weights are published in.
//!
//! [`read`] (or [`Checkpoint::from_bytes`]) sniffs the format from the bytes, never from the
//! file name:
//!
//! | first bytes | format |
//! |---|---|
//! | `80 02 8a 0a 6c fc 9c 46 f9 20 6a a8 50 19` | legacy (pre-1.6) `torch.save`: five pickles, then raw storages |
//! | `PK\x03\x04` | zip `torch.save` (state dict or whole module) or a TorchScript archive |
//! | 8-byte header length + `{` | safetensors |
//!
//! The result is the model's state dict as [`TensorRef`]s: views (dtype, shape, strides,
//! offset) into storages that stay in the file's bytes until a tensor is materialised, so an
//! optimizer state of hundreds of megabytes is never copied. Everything is bounds-checked: a
//! hostile or damaged file gives an [`Error`], never a panic, and a file cut short (the usual
//! partial download) is reported as [`Error::Truncated`].

mod pickle;
mod safetensors_io;
mod torch;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

pub use super::Error;
pub use safetensors_io::{write_safetensors, FOLDED_METADATA_KEY};

/// The container a checkpoint was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// Pre-1.6 `torch.save` (the 2020 `wav2lip.pth` / `wav2lip_gan.pth`).
    LegacyTorchSave,
    /// Zip-format `torch.save` of a dict holding `state_dict`, or of a bare state dict.
    ZipTorchSave,
    /// Zip-format `torch.save(model)`: a pickled module object.
    ZipModulePickle,
    /// `torch.jit.save` archive.
    TorchScript,
    Safetensors,
}

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Format::LegacyTorchSave => "legacy-torch-save",
            Format::ZipTorchSave => "zip-torch-save",
            Format::ZipModulePickle => "zip-module-pickle",
            Format::TorchScript => "torchscript",
            Format::Safetensors => "safetensors",
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageDtype {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl StorageDtype {
    pub fn size(self) -> usize {
        match self {
            StorageDtype::F64 | StorageDtype::I64 => 8,
            StorageDtype::F32 | StorageDtype::I32 => 4,
            StorageDtype::F16 | StorageDtype::BF16 | StorageDtype::I16 => 2,
            StorageDtype::I8 | StorageDtype::U8 | StorageDtype::Bool => 1,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(
            self,
            StorageDtype::F64 | StorageDtype::F32 | StorageDtype::F16 | StorageDtype::BF16
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            StorageDtype::F64 => "f64",
            StorageDtype::F32 => "f32",
            StorageDtype::F16 => "f16",
            StorageDtype::BF16 => "bf16",
            StorageDtype::I64 => "i64",
            StorageDtype::I32 => "i32",
            StorageDtype::I16 => "i16",
            StorageDtype::I8 => "i8",
            StorageDtype::U8 => "u8",
            StorageDtype::Bool => "bool",
        }
    }

    fn candle(self) -> Option<DType> {
        match self {
            StorageDtype::F64 => Some(DType::F64),
            StorageDtype::F32 => Some(DType::F32),
            StorageDtype::F16 => Some(DType::F16),
            StorageDtype::BF16 => Some(DType::BF16),
            StorageDtype::I64 => Some(DType::I64),
            StorageDtype::U8 => Some(DType::U8),
            _ => None,
        }
    }
}

/// Largest tensor the reader will materialise (the biggest Wav2Lip weight is 18.9 MB in f32).
const MAX_TENSOR_BYTES: usize = 1 << 32;

/// A byte range of the checkpoint holding one storage (or a whole safetensors tensor).
#[derive(Debug, Clone)]
pub(crate) struct Storage {
    bytes: Arc<[u8]>,
    start: usize,
    /// Length in elements of `dtype`.
    numel: usize,
    dtype: StorageDtype,
}

impl Storage {
    /// `numel` elements of `dtype` at byte `start`; `None` when they do not fit in `bytes`.
    pub(crate) fn new(
        bytes: Arc<[u8]>,
        start: usize,
        numel: usize,
        dtype: StorageDtype,
    ) -> Option<Self> {
        let end = numel.checked_mul(dtype.size())?.checked_add(start)?;
        (end <= bytes.len()).then_some(Storage {
            bytes,
            start,
            numel,
            dtype,
        })
    }

    fn data(&self) -> &[u8] {
        &self.bytes[self.start..self.start + self.numel * self.dtype.size()]
    }
}

/// A tensor in a checkpoint, not yet copied out of the file. Construction checks that the view
/// lies inside its storage, so materialising it cannot fail on bounds.
#[derive(Debug, Clone)]
pub struct TensorRef {
    pub dtype: StorageDtype,
    pub shape: Vec<usize>,
    strides: Vec<usize>,
    /// Offset into the storage, in elements.
    offset: usize,
    storage: Storage,
}

impl TensorRef {
    pub(crate) fn new(
        storage: Storage,
        offset: usize,
        shape: Vec<usize>,
        strides: Vec<usize>,
    ) -> Result<Self, Error> {
        let bad = |m: String| Error::Corrupt(m);
        if shape.len() != strides.len() {
            return Err(bad(format!(
                "tensor has {} dimensions but {} strides",
                shape.len(),
                strides.len()
            )));
        }
        let numel = shape
            .iter()
            .try_fold(1usize, |a, &n| a.checked_mul(n))
            .filter(|&n| n.saturating_mul(storage.dtype.size()) <= MAX_TENSOR_BYTES)
            .ok_or_else(|| bad(format!("tensor of shape {shape:?} is implausibly large")))?;
        if numel > 0 {
            // Highest element index the view touches; must lie inside the storage.
            let mut last = offset;
            for (&n, &s) in shape.iter().zip(&strides) {
                last = (n - 1)
                    .checked_mul(s)
                    .and_then(|x| x.checked_add(last))
                    .ok_or_else(|| bad("tensor view overflows".into()))?;
            }
            if last >= storage.numel {
                return Err(bad(format!(
                    "tensor view reaches element {last} of a storage of {} elements",
                    storage.numel
                )));
            }
        }
        Ok(TensorRef {
            dtype: storage.dtype,
            shape,
            strides,
            offset,
            storage,
        })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the elements are laid out row-major without gaps.
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1usize;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n != 1 && s != expected {
                return false;
            }
            expected = expected.saturating_mul(n);
        }
        true
    }

    /// Copies the elements out in row-major order, honouring offset and strides.
    pub fn to_bytes(&self) -> Vec<u8> {
        let es = self.dtype.size();
        let numel = self.numel();
        if numel == 0 {
            return Vec::new();
        }
        let data = self.storage.data();
        if self.is_contiguous() {
            let start = self.offset * es;
            return data[start..start + numel * es].to_vec();
        }
        let mut out = Vec::with_capacity(numel * es);
        let rank = self.shape.len();
        let mut index = vec![0usize; rank];
        let mut pos = self.offset;
        for _ in 0..numel {
            out.extend_from_slice(&data[pos * es..(pos + 1) * es]);
            // Odometer increment over the shape, moving `pos` by the strides.
            for d in (0..rank).rev() {
                index[d] += 1;
                pos += self.strides[d];
                if index[d] < self.shape[d] {
                    break;
                }
                pos -= self.strides[d] * self.shape[d];
                index[d] = 0;
            }
        }
        out
    }

    /// The tensor on the CPU in its stored dtype.
    pub fn to_tensor(&self) -> Result<Tensor, Error> {
        let dtype = self
            .dtype
            .candle()
            .ok_or_else(|| Error::Unsupported(format!("tensors of dtype {}", self.dtype.name())))?;
        let bytes = self.to_bytes();
        Ok(Tensor::from_raw_buffer(
            &bytes,
            dtype,
            &self.shape,
            &Device::Cpu,
        )?)
    }
}

/// A checkpoint's state dict: tensors by their key in the file, in file order.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub format: Format,
    pub tensors: Vec<(String, TensorRef)>,
    /// The safetensors `__metadata__` map (empty for PyTorch files).
    pub metadata: BTreeMap<String, String>,
}

/// Reads and parses a checkpoint file.
pub fn read(path: &Path) -> Result<Checkpoint, Error> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Checkpoint::from_bytes(bytes.into())
}

const LEGACY_MAGIC: &[u8] = &[
    0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19,
];

impl Checkpoint {
    /// Parses a checkpoint held in memory; the format is recognised from the bytes.
    pub fn from_bytes(bytes: Arc<[u8]>) -> Result<Self, Error> {
        if bytes.is_empty() {
            return Err(Error::NotACheckpoint("the file is empty".into()));
        }
        if bytes.starts_with(b"PK\x03\x04") || bytes.starts_with(b"PK\x05\x06") {
            return torch::read_zip(bytes);
        }
        if bytes.starts_with(LEGACY_MAGIC) {
            return torch::read_legacy(bytes);
        }
        if LEGACY_MAGIC.starts_with(&bytes) {
            return Err(Error::Truncated {
                size: bytes.len() as u64,
                expected: None,
                detail: "only the start of a legacy torch.save header is present".into(),
            });
        }
        if safetensors_io::looks_like_safetensors(&bytes) {
            return safetensors_io::read(bytes);
        }
        if bytes.starts_with(b"\x80") || bytes.starts_with(b"\x1f\x8b") {
            return Err(Error::NotACheckpoint(
                "a pickle or gzip file that is not a torch.save checkpoint".into(),
            ));
        }
        Err(Error::NotACheckpoint(
            "not a PyTorch (legacy or zip), TorchScript or safetensors file".into(),
        ))
    }

    pub fn get(&self, key: &str) -> Option<&TensorRef> {
        self.tensors.iter().find(|(k, _)| k == key).map(|(_, t)| t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(
        shape: &[usize],
        strides: &[usize],
        offset: usize,
        data: &[f32],
    ) -> Result<TensorRef, Error> {
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        let storage = Storage::new(bytes.into(), 0, data.len(), StorageDtype::F32).unwrap();
        TensorRef::new(storage, offset, shape.to_vec(), strides.to_vec())
    }

    fn floats(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    #[test]
    fn strided_views_are_gathered_in_row_major_order() {
        let data: Vec<f32> = (0..12).map(|x| x as f32).collect();
        // Column-major 3x4 (like MTCNN's legacy weights): element [i][j] at i + 3j.
        let t = view(&[3, 4], &[1, 3], 0, &data).unwrap();
        assert!(!t.is_contiguous());
        assert_eq!(
            floats(&t.to_bytes()),
            vec![0., 3., 6., 9., 1., 4., 7., 10., 2., 5., 8., 11.]
        );
        // Offset plus overlapping stride-0 broadcast.
        let t = view(&[2, 3], &[0, 2], 1, &data).unwrap();
        assert_eq!(floats(&t.to_bytes()), vec![1., 3., 5., 1., 3., 5.]);
    }

    #[test]
    fn views_outside_their_storage_are_errors() {
        let data = [0f32; 6];
        assert!(view(&[2, 3], &[3, 1], 1, &data).is_err());
        assert!(view(&[2, usize::MAX], &[1, 2], 0, &data).is_err());
        assert!(view(&[1 << 40], &[0], 0, &data).is_err()); // a stride-0 decompression bomb
        assert!(view(&[2, 3], &[3], 0, &data).is_err());
        assert!(view(&[0, 5], &[5, 1], 100, &data)
            .unwrap()
            .to_bytes()
            .is_empty());
        assert!(Storage::new(vec![0u8; 8].into(), 4, 2, StorageDtype::F32).is_none());
    }

    #[test]
    fn unknown_bytes_are_not_a_checkpoint() {
        for junk in [&b"hello world"[..], b"\x00\x00", b"GIF89a"] {
            let e = Checkpoint::from_bytes(junk.into()).unwrap_err();
            assert!(matches!(e, Error::NotACheckpoint(_)), "{e}");
        }
        let e = Checkpoint::from_bytes(Arc::from(&LEGACY_MAGIC[..5])).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
    }
}
