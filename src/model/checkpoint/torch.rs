//! PyTorch's containers: legacy `torch.save`, zip `torch.save` and TorchScript archives.
//!
//! Both containers pickle the saved object with tensors written as calls to
//! `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, …)`, where `storage` is a
//! persistent id `('storage', <torch.FloatStorage…>, key, location, numel[, view_metadata])`.
//! They differ in where a storage's bytes live: in the zip entry `<archive>/data/<key>`, or,
//! for legacy files, after the pickles, in the order of a pickled key list, each preceded by
//! its element count as a little-endian i64.

use std::collections::{HashMap, HashSet};
use std::io::Cursor;
use std::sync::Arc;

use super::pickle::{self, Id, Pickle, Value};
use super::{Checkpoint, Error, Format, Storage, StorageDtype, TensorRef};

/// Storage classes PyTorch writes: `(class name, element size, dtype when readable)`.
const STORAGE_TYPES: &[(&str, usize, Option<StorageDtype>)] = &[
    ("FloatStorage", 4, Some(StorageDtype::F32)),
    ("DoubleStorage", 8, Some(StorageDtype::F64)),
    ("HalfStorage", 2, Some(StorageDtype::F16)),
    ("BFloat16Storage", 2, Some(StorageDtype::BF16)),
    ("LongStorage", 8, Some(StorageDtype::I64)),
    ("IntStorage", 4, Some(StorageDtype::I32)),
    ("ShortStorage", 2, Some(StorageDtype::I16)),
    ("CharStorage", 1, Some(StorageDtype::I8)),
    ("ByteStorage", 1, Some(StorageDtype::U8)),
    ("BoolStorage", 1, Some(StorageDtype::Bool)),
    ("ComplexFloatStorage", 8, None),
    ("ComplexDoubleStorage", 16, None),
    ("QInt8Storage", 1, None),
    ("QUInt8Storage", 1, None),
    ("QInt32Storage", 4, None),
];

/// A storage as described by its persistent id.
#[derive(Debug, Clone)]
struct StorageId {
    key: String,
    type_name: String,
    elem_size: usize,
    dtype: Option<StorageDtype>,
    numel: usize,
    /// Legacy files may reference part of a storage: `(offset, numel)` in elements.
    view: Option<(usize, usize)>,
}

/// A tensor found in the pickle, before its storage bytes are located.
#[derive(Debug, Clone)]
struct TensorDesc {
    storage: StorageId,
    offset: usize,
    shape: Vec<usize>,
    strides: Vec<usize>,
}

/// What the pickle contained.
enum Found {
    StateDict(Vec<(String, TensorDesc)>),
    Module(Vec<(String, TensorDesc)>),
}

fn corrupt(msg: impl Into<String>) -> Error {
    Error::Corrupt(msg.into())
}

// ---------------------------------------------------------------------------------------------
// Zip archives (torch.save since 1.6, torch.jit.save)

pub(super) fn read_zip(bytes: Arc<[u8]>) -> Result<Checkpoint, Error> {
    let mut zip = zip::ZipArchive::new(Cursor::new(&bytes[..])).map_err(|e| {
        if bytes.starts_with(b"PK\x03\x04") {
            Error::Truncated {
                size: bytes.len() as u64,
                expected: None,
                detail: format!(
                    "the zip archive has no readable central directory at its end ({e})"
                ),
            }
        } else {
            corrupt(format!("unreadable zip archive: {e}"))
        }
    })?;
    let names: Vec<String> = zip
        .file_names()
        .filter_map(|n| n.ok().map(|n| n.into_owned()))
        .collect();
    let pkl = names
        .iter()
        .filter(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
        .min_by_key(|n| n.len())
        .ok_or_else(|| Error::NotACheckpoint("a zip archive without a PyTorch data.pkl".into()))?;
    let prefix = pkl.trim_end_matches("data.pkl").to_string();
    let torchscript = names.iter().any(|n| {
        *n == format!("{prefix}constants.pkl") || n.starts_with(&format!("{prefix}code/"))
    });
    if let Some(order) = entry(&mut zip, &bytes, &format!("{prefix}byteorder"))? {
        if order.trim_ascii() == b"big" {
            return Err(Error::Unsupported("big-endian checkpoints".into()));
        }
    }
    let data_pkl = entry(&mut zip, &bytes, pkl)?.ok_or_else(|| corrupt("data.pkl unreadable"))?;
    let (pk, _) = pickle::load(&data_pkl).map_err(|e| match e {
        Error::PickleEnded { .. } => corrupt("data.pkl ends early"),
        e => e,
    })?;

    let (format, tensors) = if torchscript {
        let mut out = Vec::new();
        collect_module(&pk, pk.root, "", &mut out, &mut HashSet::new(), 0)?;
        (Format::TorchScript, out)
    } else {
        match find_tensors(&pk)? {
            Found::StateDict(t) => (Format::ZipTorchSave, t),
            Found::Module(t) => (Format::ZipModulePickle, t),
        }
    };

    let mut storages: HashMap<String, Storage> = HashMap::new();
    let mut out = Vec::with_capacity(tensors.len());
    for (key, desc) in tensors {
        let sid = &desc.storage;
        let storage = match storages.get(&sid.key) {
            Some(s) => s.clone(),
            None => {
                let name = format!("{prefix}data/{}", sid.key);
                let (start, len) = stored_range(&mut zip, &name)?
                    .ok_or_else(|| corrupt(format!("storage {name} missing from the archive")))?;
                let dtype = readable(sid, &key)?;
                if sid.numel.checked_mul(sid.elem_size) != Some(len) {
                    return Err(corrupt(format!(
                        "storage {name} holds {len} bytes, expected {} elements of {} bytes",
                        sid.numel, sid.elem_size
                    )));
                }
                let s = Storage::new(bytes.clone(), start, sid.numel, dtype)
                    .ok_or_else(|| corrupt(format!("storage {name} lies outside the file")))?;
                storages.insert(sid.key.clone(), s.clone());
                s
            }
        };
        out.push((key, view_of(storage, desc)?));
    }
    Ok(Checkpoint {
        format,
        tensors: out,
        metadata: Default::default(),
    })
}

/// Byte range `(start, len)` of a stored (uncompressed) zip entry.
fn stored_range(
    zip: &mut zip::ZipArchive<Cursor<&[u8]>>,
    name: &str,
) -> Result<Option<(usize, usize)>, Error> {
    let Some(index) = zip.index_for_name(name) else {
        return Ok(None);
    };
    let f = zip
        .by_index_raw(index)
        .map_err(|e| corrupt(format!("zip entry {name}: {e}")))?;
    if f.compression() != zip::CompressionMethod::Stored {
        return Err(Error::Unsupported(format!(
            "compressed zip entry {name} (PyTorch writes them uncompressed)"
        )));
    }
    let start = f
        .data_start()
        .ok_or_else(|| corrupt(format!("zip entry {name} has no data offset")))?;
    let start = usize::try_from(start).map_err(|_| corrupt("zip offset too large"))?;
    let len = usize::try_from(f.size()).map_err(|_| corrupt("zip entry too large"))?;
    Ok(Some((start, len)))
}

/// The bytes of a small stored entry, if present.
fn entry(
    zip: &mut zip::ZipArchive<Cursor<&[u8]>>,
    bytes: &[u8],
    name: &str,
) -> Result<Option<Vec<u8>>, Error> {
    Ok(match stored_range(zip, name)? {
        Some((start, len)) => Some(
            start
                .checked_add(len)
                .and_then(|end| bytes.get(start..end))
                .ok_or_else(|| corrupt(format!("zip entry {name} lies outside the file")))?
                .to_vec(),
        ),
        None => None,
    })
}

// ---------------------------------------------------------------------------------------------
// Legacy torch.save (before PyTorch 1.6)

const LEGACY_PROTOCOL: i64 = 1001;
const LEGACY_MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];

pub(super) fn read_legacy(bytes: Arc<[u8]>) -> Result<Checkpoint, Error> {
    let size = bytes.len() as u64;
    let header_cut = |detail: &str| Error::Truncated {
        size,
        expected: None,
        detail: detail.to_string(),
    };
    let next = |pos: usize, what: &str| -> Result<(Pickle, usize), Error> {
        let (pk, used) = pickle::load(&bytes[pos..]).map_err(|e| match e {
            Error::PickleEnded { .. } => header_cut(&format!("the file ends inside its {what}")),
            e => e,
        })?;
        Ok((pk, pos + used))
    };

    let (magic, pos) = next(0, "header")?;
    if magic.get(magic.root) != &Value::BigInt(LEGACY_MAGIC.to_vec()) {
        return Err(Error::NotACheckpoint(
            "wrong legacy torch.save magic number".into(),
        ));
    }
    let (proto, pos) = next(pos, "header")?;
    if proto.as_int(proto.root) != Some(LEGACY_PROTOCOL) {
        return Err(Error::Unsupported(
            "a legacy torch.save protocol other than 1001".into(),
        ));
    }
    let (sys_info, pos) = next(pos, "header")?;
    if let Some(le) = sys_info.dict_get(sys_info.root, "little_endian") {
        if sys_info.get(le) == &Value::Bool(false) {
            return Err(Error::Unsupported("big-endian checkpoints".into()));
        }
    }
    let (pk, pos) = next(pos, "pickled object")?;
    let (keys_pk, pos) = next(pos, "storage list")?;
    let keys: Vec<String> = keys_pk
        .as_seq(keys_pk.root)
        .ok_or_else(|| corrupt("legacy storage key list is not a list"))?
        .iter()
        .map(|&k| key_string(&keys_pk, k))
        .collect::<Option<_>>()
        .ok_or_else(|| corrupt("legacy storage keys must be strings"))?;

    // Every storage the object refers to (including optimizer state we will not read), so the
    // raw section can be walked and the full file size known.
    let mut ids: HashMap<String, StorageId> = HashMap::new();
    for v in 0..pk.len() {
        if let Value::Persistent(pid) = pk.get(v) {
            if let Some(sid) = storage_id(&pk, *pid)? {
                ids.entry(sid.key.clone()).or_insert(sid);
            }
        }
    }
    let mut expected = pos as u64;
    let mut ranges: HashMap<&str, usize> = HashMap::new();
    for key in &keys {
        let sid = ids
            .get(key)
            .ok_or_else(|| corrupt(format!("storage {key} is listed but never used")))?;
        ranges.insert(key, expected as usize);
        let len = (sid.numel as u64)
            .checked_mul(sid.elem_size as u64)
            .and_then(|n| n.checked_add(8))
            .ok_or_else(|| corrupt("storage size overflows"))?;
        expected = expected
            .checked_add(len)
            .ok_or_else(|| corrupt("storage size overflows"))?;
    }
    if size < expected {
        return Err(Error::Truncated {
            size,
            expected: Some(expected),
            detail: "the tensor data stops early".into(),
        });
    }
    // Each section starts with its own element count; it must agree with the pickle.
    for key in &keys {
        let at = ranges[key.as_str()];
        let mut n = [0u8; 8];
        n.copy_from_slice(&bytes[at..at + 8]);
        if u64::from_le_bytes(n) != ids[key].numel as u64 {
            return Err(corrupt(format!("storage {key} has a wrong element count")));
        }
    }

    let (tensors, format) = match find_tensors(&pk)? {
        Found::StateDict(t) | Found::Module(t) => (t, Format::LegacyTorchSave),
    };
    let mut out = Vec::with_capacity(tensors.len());
    for (key, desc) in tensors {
        let sid = &desc.storage;
        let root = ranges
            .get(sid.key.as_str())
            .ok_or_else(|| corrupt(format!("storage {} of {key} is not in the file", sid.key)))?;
        let dtype = readable(sid, &key)?;
        let (off, numel) = sid.view.unwrap_or((0, sid.numel));
        if off
            .checked_add(numel)
            .is_none_or(|end| end > ids[&sid.key].numel)
        {
            return Err(corrupt(format!(
                "storage view of {key} exceeds its storage"
            )));
        }
        let storage = Storage::new(bytes.clone(), root + 8 + off * sid.elem_size, numel, dtype)
            .ok_or_else(|| corrupt(format!("storage of {key} lies outside the file")))?;
        out.push((key, view_of(storage, desc)?));
    }
    Ok(Checkpoint {
        format,
        tensors: out,
        metadata: Default::default(),
    })
}

// ---------------------------------------------------------------------------------------------
// Interpreting the pickled object

fn readable(sid: &StorageId, key: &str) -> Result<StorageDtype, Error> {
    sid.dtype
        .ok_or_else(|| Error::Unsupported(format!("tensor {key} is stored as {}", sid.type_name)))
}

fn view_of(storage: Storage, desc: TensorDesc) -> Result<TensorRef, Error> {
    TensorRef::new(storage, desc.offset, desc.shape, desc.strides)
}

fn key_string(pk: &Pickle, id: Id) -> Option<String> {
    match pk.get(id) {
        Value::Str(s) => Some(s.clone()),
        Value::Bytes(b) => String::from_utf8(b.clone()).ok(),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn usize_of(pk: &Pickle, id: Id, what: &str) -> Result<usize, Error> {
    pk.as_int(id)
        .and_then(|i| usize::try_from(i).ok())
        .ok_or_else(|| corrupt(format!("{what} is not a non-negative integer")))
}

fn usizes(pk: &Pickle, id: Id, what: &str) -> Result<Vec<usize>, Error> {
    pk.as_seq(id)
        .ok_or_else(|| corrupt(format!("{what} is not a tuple")))?
        .iter()
        .map(|&i| usize_of(pk, i, what))
        .collect()
}

/// Parses `('storage', StorageClass, key, location, numel[, view_metadata])`.
/// Returns `None` for other persistent ids (legacy module sources).
fn storage_id(pk: &Pickle, pid: Id) -> Result<Option<StorageId>, Error> {
    let Some(t) = pk.as_seq(pid) else {
        return Ok(None);
    };
    if t.first().and_then(|&i| key_string(pk, i)).as_deref() != Some("storage") {
        return Ok(None);
    }
    if t.len() < 5 {
        return Err(corrupt("short storage persistent id"));
    }
    let (_, type_name) = pk
        .as_global(t[1])
        .ok_or_else(|| corrupt("storage type is not a class"))?;
    let (elem_size, dtype) = STORAGE_TYPES
        .iter()
        .find(|(n, _, _)| *n == type_name)
        .map(|&(_, s, d)| (s, d))
        .ok_or_else(|| Error::Unsupported(format!("storage type {type_name}")))?;
    let key = key_string(pk, t[2]).ok_or_else(|| corrupt("storage key is not a string"))?;
    let numel = usize_of(pk, t[4], "storage size")?;
    let view = match t.get(5).map(|&v| (v, pk.get(v))) {
        None | Some((_, Value::None)) => None,
        Some((v, _)) => {
            let m = pk
                .as_seq(v)
                .filter(|m| m.len() == 3)
                .ok_or_else(|| corrupt("bad storage view metadata"))?;
            // The view gets its own key; the bytes belong to the root storage `key`.
            Some((
                usize_of(pk, m[1], "view offset")?,
                usize_of(pk, m[2], "view size")?,
            ))
        }
    };
    Ok(Some(StorageId {
        key,
        type_name: type_name.to_string(),
        elem_size,
        dtype,
        numel,
        view,
    }))
}

/// `module.name` of the callable an object was made from (resolving legacy module ids).
fn class_of(pk: &Pickle, id: Id) -> Option<(&str, &str)> {
    let Value::Object { class, .. } = pk.get(id) else {
        return None;
    };
    match pk.get(*class) {
        Value::Global { module, name } => Some((module, name)),
        // Legacy whole-module files: ('module', cls, source_file, source).
        Value::Persistent(pid) => pk
            .as_seq(*pid)
            .and_then(|t| t.get(1))
            .and_then(|&c| pk.as_global(c)),
        _ => None,
    }
}

fn args_of(pk: &Pickle, id: Id) -> &[Id] {
    match pk.get(id) {
        Value::Object { args, .. } => pk.as_seq(*args).unwrap_or(&[]),
        _ => &[],
    }
}

/// If `id` is a pickled tensor or parameter, describes it.
fn tensor_desc(pk: &Pickle, id: Id) -> Result<Option<TensorDesc>, Error> {
    let Some((module, name)) = class_of(pk, id) else {
        return Ok(None);
    };
    tensor_call(pk, module, name, args_of(pk, id))
}

fn tensor_call(
    pk: &Pickle,
    module: &str,
    name: &str,
    args: &[Id],
) -> Result<Option<TensorDesc>, Error> {
    let arg = |i: usize| {
        args.get(i)
            .copied()
            .ok_or_else(|| corrupt(format!("{name} called with too few arguments")))
    };
    match (module, name) {
        ("torch._utils", "_rebuild_tensor" | "_rebuild_tensor_v2" | "_rebuild_tensor_v3") => {
            let Value::Persistent(pid) = pk.get(arg(0)?) else {
                return Err(corrupt("tensor storage is not a persistent id"));
            };
            let storage =
                storage_id(pk, *pid)?.ok_or_else(|| corrupt("tensor without a storage"))?;
            let offset = usize_of(pk, arg(1)?, "storage offset")?;
            let shape = usizes(pk, arg(2)?, "tensor size")?;
            let strides = usizes(pk, arg(3)?, "tensor stride")?;
            Ok(Some(TensorDesc {
                storage,
                offset,
                shape,
                strides,
            }))
        }
        ("torch._utils", "_rebuild_parameter" | "_rebuild_parameter_with_state") => {
            let data = arg(0)?;
            tensor_desc(pk, data)?
                .map(Some)
                .ok_or_else(|| corrupt("parameter without tensor data"))
        }
        ("torch._tensor", "_rebuild_from_type" | "_rebuild_from_type_v2") => {
            let (m, n) = pk
                .as_global(arg(0)?)
                .ok_or_else(|| corrupt("tensor rebuild function is not a global"))?;
            let inner = pk
                .as_seq(arg(2)?)
                .ok_or_else(|| corrupt("tensor rebuild arguments are not a tuple"))?;
            tensor_call(pk, m, n, inner)
        }
        ("torch._utils", other) if other.starts_with("_rebuild_") => Err(Error::Unsupported(
            format!("tensors rebuilt with torch._utils.{other} (quantized, sparse or meta)"),
        )),
        _ => Ok(None),
    }
}

/// The tensors of a dict `{key: tensor}`; non-tensor values are skipped.
fn dict_tensors(pk: &Pickle, dict: Id, prefix: &str) -> Result<Vec<(String, TensorDesc)>, Error> {
    let mut out = Vec::new();
    for &(k, v) in pk.as_dict(dict).unwrap_or(&[]) {
        let Some(key) = key_string(pk, k) else {
            continue;
        };
        if let Some(t) = tensor_desc(pk, v)? {
            out.push((format!("{prefix}{key}"), t));
        }
    }
    Ok(out)
}

/// The top-level keys that hold a state dict, in order of preference: PyTorch's usual
/// `state_dict`, then BasicSR's `params_ema` (the averaged weights that Real-ESRGAN and GFPGAN
/// publish) over its `params`.
const STATE_DICT_KEYS: [&str; 3] = ["state_dict", "params_ema", "params"];

/// Finds the model weights in a `torch.save`d object: a dict with `state_dict` (or
/// `params_ema` / `params`), a bare state dict, or a whole pickled module.
fn find_tensors(pk: &Pickle) -> Result<Found, Error> {
    let root = pk.root;
    match pk.get(root) {
        Value::Dict(entries) => {
            if let Some(sd) = STATE_DICT_KEYS.iter().find_map(|k| pk.dict_get(root, k)) {
                return match pk.get(sd) {
                    Value::Dict(_) => Ok(Found::StateDict(dict_tensors(pk, sd, "")?)),
                    Value::Object { .. } => {
                        let mut out = Vec::new();
                        collect_module(pk, sd, "", &mut out, &mut HashSet::new(), 0)?;
                        Ok(Found::Module(out))
                    }
                    _ => Err(Error::NotACheckpoint(
                        "the checkpoint's state dict is not a dict".into(),
                    )),
                };
            }
            let tensors = dict_tensors(pk, root, "")?;
            if tensors.is_empty() {
                let keys: Vec<String> = entries
                    .iter()
                    .filter_map(|&(k, _)| key_string(pk, k))
                    .take(10)
                    .collect();
                return Err(Error::NotACheckpoint(format!(
                    "a torch.save file without a state_dict or tensors (top-level keys: {})",
                    keys.join(", ")
                )));
            }
            Ok(Found::StateDict(tensors))
        }
        Value::Object { .. } => {
            let mut out = Vec::new();
            collect_module(pk, root, "", &mut out, &mut HashSet::new(), 0)?;
            if out.is_empty() {
                return Err(Error::NotACheckpoint(
                    "a pickled object that holds no module parameters".into(),
                ));
            }
            Ok(Found::Module(out))
        }
        _ => Err(Error::NotACheckpoint(
            "a torch.save file holding neither a dict nor a module".into(),
        )),
    }
}

const MAX_MODULE_DEPTH: usize = 64;

/// Collects parameters and persistent buffers by module path, like `Module.state_dict()`.
///
/// A pickled `nn.Module` keeps them in `_parameters`, `_buffers` and `_modules` of its
/// `__dict__`; a TorchScript object keeps submodules and tensors as plain attributes.
fn collect_module(
    pk: &Pickle,
    obj: Id,
    prefix: &str,
    out: &mut Vec<(String, TensorDesc)>,
    seen: &mut HashSet<Id>,
    depth: usize,
) -> Result<(), Error> {
    if depth > MAX_MODULE_DEPTH || !seen.insert(obj) {
        return Ok(());
    }
    let Value::Object {
        state: Some(state), ..
    } = pk.get(obj)
    else {
        return Ok(());
    };
    let state = *state;
    if pk.as_dict(state).is_none() {
        return Ok(());
    }
    let is_nn_module =
        pk.dict_get(state, "_modules").is_some() || pk.dict_get(state, "_parameters").is_some();
    if is_nn_module {
        if let Some(params) = pk.dict_get(state, "_parameters") {
            out.extend(dict_tensors(pk, params, prefix)?);
        }
        if let Some(buffers) = pk.dict_get(state, "_buffers") {
            let skip: HashSet<String> = pk
                .dict_get(state, "_non_persistent_buffers_set")
                .and_then(|s| match pk.get(s) {
                    Value::Set(items) | Value::List(items) => Some(items),
                    _ => None,
                })
                .map(|items| items.iter().filter_map(|&i| key_string(pk, i)).collect())
                .unwrap_or_default();
            for (k, t) in dict_tensors(pk, buffers, prefix)? {
                if !skip.contains(&k[prefix.len()..]) {
                    out.push((k, t));
                }
            }
        }
        if let Some(modules) = pk.dict_get(state, "_modules") {
            for &(k, m) in pk.as_dict(modules).unwrap_or(&[]) {
                if let Some(name) = key_string(pk, k) {
                    collect_module(pk, m, &format!("{prefix}{name}."), out, seen, depth + 1)?;
                }
            }
        }
    } else {
        // TorchScript: attributes in declaration order.
        for &(k, v) in pk.as_dict(state).unwrap_or(&[]) {
            let Some(name) = key_string(pk, k) else {
                continue;
            };
            if let Some(t) = tensor_desc(pk, v)? {
                out.push((format!("{prefix}{name}"), t));
            } else if class_of(pk, v).is_some_and(|(m, _)| m.starts_with("__torch__")) {
                collect_module(pk, v, &format!("{prefix}{name}."), out, seen, depth + 1)?;
            }
        }
    }
    Ok(())
}
