//! safetensors: an 8-byte little-endian header length, a JSON header, then the raw tensors.
//!
//! Read with an own parser so that a cut-off file is reported with its expected size (the
//! header tells exactly how long the file must be); written with the `safetensors` crate.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use candle_core::Tensor;
use serde::Deserialize;

use super::{Checkpoint, Error, Format, Storage, StorageDtype, TensorRef};

/// Metadata key that marks a file whose BatchNorm layers are folded into the convolutions.
pub const FOLDED_METADATA_KEY: &str = "lipsync.bn_folded";

/// Headers larger than this are not safetensors (the format's own limit is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

pub(super) fn looks_like_safetensors(b: &[u8]) -> bool {
    b.len() >= 9 && header_len(b) <= MAX_HEADER && b[8] == b'{'
}

fn header_len(b: &[u8]) -> u64 {
    let mut n = [0u8; 8];
    n.copy_from_slice(&b[..8]);
    u64::from_le_bytes(n)
}

#[derive(Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

pub(super) fn read(bytes: Arc<[u8]>) -> Result<Checkpoint, Error> {
    let size = bytes.len() as u64;
    let n = header_len(&bytes) as usize;
    let Some(header) = bytes.get(8..8 + n) else {
        return Err(Error::Truncated {
            size,
            expected: None,
            detail: format!("the safetensors header alone needs {} bytes", 8 + n),
        });
    };
    let raw: HashMap<String, serde_json::Value> = serde_json::from_slice(header)
        .map_err(|e| Error::Corrupt(format!("bad safetensors header: {e}")))?;
    let mut metadata = BTreeMap::new();
    let mut entries = Vec::new();
    for (name, value) in raw {
        if name == "__metadata__" {
            metadata = serde_json::from_value(value)
                .map_err(|e| Error::Corrupt(format!("bad safetensors metadata: {e}")))?;
            continue;
        }
        let e: Entry = serde_json::from_value(value)
            .map_err(|e| Error::Corrupt(format!("bad safetensors entry {name}: {e}")))?;
        entries.push((name, e));
    }
    entries.sort_by_key(|(_, e)| e.data_offsets);
    let data_start = 8 + n;
    let data_len = entries
        .iter()
        .map(|(_, e)| e.data_offsets.1)
        .max()
        .unwrap_or(0);
    let expected = (data_start as u64).saturating_add(data_len as u64);
    if size < expected {
        return Err(Error::Truncated {
            size,
            expected: Some(expected),
            detail: "the tensor data stops early".into(),
        });
    }
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, e) in entries {
        let dtype = dtype_of(&e.dtype)
            .ok_or_else(|| Error::Unsupported(format!("safetensors dtype {}", e.dtype)))?;
        let (begin, end) = e.data_offsets;
        let numel = e
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::Corrupt(format!("{name}: shape overflows")))?;
        if end < begin || numel.checked_mul(dtype.size()) != Some(end - begin) {
            return Err(Error::Corrupt(format!(
                "{name}: data offsets do not match its shape and dtype"
            )));
        }
        let storage = Storage::new(bytes.clone(), data_start + begin, numel, dtype)
            .ok_or_else(|| Error::Corrupt(format!("{name} lies outside the file")))?;
        let strides = contiguous_strides(&e.shape);
        tensors.push((name, TensorRef::new(storage, 0, e.shape, strides)?));
    }
    Ok(Checkpoint {
        format: Format::Safetensors,
        tensors,
        metadata,
    })
}

fn dtype_of(s: &str) -> Option<StorageDtype> {
    Some(match s {
        "F64" => StorageDtype::F64,
        "F32" => StorageDtype::F32,
        "F16" => StorageDtype::F16,
        "BF16" => StorageDtype::BF16,
        "I64" => StorageDtype::I64,
        "I32" => StorageDtype::I32,
        "I16" => StorageDtype::I16,
        "I8" => StorageDtype::I8,
        "U8" => StorageDtype::U8,
        "BOOL" => StorageDtype::Bool,
        _ => return None,
    })
}

fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1].saturating_mul(shape[d + 1]);
    }
    strides
}

/// Writes tensors (moved to the CPU) and metadata to `path`, replacing it atomically: the file
/// appears complete or not at all.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<(), Error> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let cpu: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(k, t)| {
            Ok((
                k.clone(),
                t.to_device(&candle_core::Device::Cpu)?.contiguous()?,
            ))
        })
        .collect::<Result<_, candle_core::Error>>()?;
    let meta: HashMap<String, String> = metadata.clone().into_iter().collect();
    let bytes = safetensors::serialize(cpu.iter().map(|(k, t)| (k.as_str(), t)), Some(meta))
        .map_err(|e| Error::Corrupt(format!("cannot serialise safetensors: {e}")))?;
    crate::fsutil::write_atomic(path, &bytes).map_err(io)
}
