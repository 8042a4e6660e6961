//! The generator's weights, normalised and validated against the architecture.
//!
//! From any [`Checkpoint`]: a leading `module.` (from `nn.DataParallel`) is stripped,
//! `num_batches_tracked` counters are dropped, and every tensor the architecture needs must be
//! present with its exact shape; anything else is an error, as with PyTorch's strict
//! `load_state_dict`. BatchNorm can then be folded into the convolutions:
//!
//! `scale = γ / √(running_var + 1e-5)`, `W' = W · scale` along the output-channel axis (dim 0
//! of a convolution weight `[cout, cin, k, k]`, dim 1 of a transposed-convolution weight
//! `[cin, cout, k, k]`), `b' = (b − running_mean) · scale + β`.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{DType, Tensor};

use super::arch::{self, LayerKind, TensorSpec};
use super::checkpoint::{self, Checkpoint, Format, StorageDtype, FOLDED_METADATA_KEY};
use super::{Error, Result};

/// BatchNorm epsilon of every Wav2Lip layer (PyTorch's default).
pub const BN_EPS: f64 = 1e-5;

/// Validated generator tensors on the CPU, keyed by their state-dict names.
#[derive(Debug, Clone)]
pub struct GeneratorWeights {
    tensors: HashMap<String, Tensor>,
    folded: bool,
    /// Set for weights made by `lipsync init-weights`: they draw noise, not faces.
    random_seed: Option<u64>,
}

/// Metadata key carrying the seed of random test weights.
pub const RANDOM_SEED_METADATA_KEY: &str = "lipsync.random_init_seed";

/// What a checkpoint turned out to hold, for `lipsync info`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Summary {
    pub format: Format,
    pub folded: bool,
    /// Generator tensors (302 unfolded, 102 folded).
    pub tensors: usize,
    /// Trainable parameters; BatchNorm running statistics are not counted.
    pub parameters: usize,
    /// Storage dtype(s) of the generator tensors in the file, e.g. `f32`.
    pub dtype: String,
    /// Whether the keys carried `nn.DataParallel`'s `module.` prefix.
    pub module_prefix: bool,
    /// Seed of random test weights made by `lipsync init-weights`, if they are such.
    pub random_init_seed: Option<u64>,
}

impl GeneratorWeights {
    /// Reads and validates a checkpoint file of any supported form.
    pub fn from_file(path: &Path) -> Result<(Self, Summary)> {
        Self::from_checkpoint(&checkpoint::read(path)?)
    }

    pub fn from_checkpoint(ck: &Checkpoint) -> Result<(Self, Summary)> {
        let folded = ck
            .metadata
            .get(FOLDED_METADATA_KEY)
            .is_some_and(|v| v == "true");
        let module_prefix =
            !ck.tensors.is_empty() && ck.tensors.iter().all(|(k, _)| k.starts_with("module."));
        let mut found: BTreeMap<&str, &checkpoint::TensorRef> = BTreeMap::new();
        for (key, t) in &ck.tensors {
            let key = if module_prefix {
                &key["module.".len()..]
            } else {
                key.as_str()
            };
            if !key.ends_with("num_batches_tracked") {
                found.insert(key, t);
            }
        }

        let specs = arch::tensor_specs(folded);
        let mut tensors = HashMap::with_capacity(specs.len());
        let mut dtypes: Vec<StorageDtype> = Vec::new();
        for TensorSpec { key, shape, .. } in &specs {
            let t = found
                .remove(key.as_str())
                .ok_or_else(|| Error::MissingKey { key: key.clone() })?;
            if &t.shape != shape {
                return Err(Error::WrongShape {
                    key: key.clone(),
                    expected: shape.clone(),
                    found: t.shape.clone(),
                });
            }
            if !t.dtype.is_float() {
                return Err(Error::Unsupported(format!(
                    "tensor {key} is stored as {}, not floating point",
                    t.dtype.name()
                )));
            }
            if !dtypes.contains(&t.dtype) {
                dtypes.push(t.dtype);
            }
            let tensor = t.to_tensor()?;
            if !all_finite(&tensor)? {
                return Err(Error::NonFinite { key: key.clone() });
            }
            tensors.insert(key.clone(), tensor);
        }
        if !found.is_empty() {
            let mut extra: Vec<String> = found.keys().take(8).map(|k| k.to_string()).collect();
            if found.len() > extra.len() {
                extra.push(format!("and {} more", found.len() - extra.len()));
            }
            return Err(Error::UnexpectedKeys(extra));
        }
        let random_seed = ck
            .metadata
            .get(RANDOM_SEED_METADATA_KEY)
            .and_then(|s| s.parse().ok());
        let weights = GeneratorWeights {
            tensors,
            folded,
            random_seed,
        };
        let summary = Summary {
            format: ck.format,
            folded,
            tensors: specs.len(),
            parameters: weights.parameter_count(),
            dtype: dtypes
                .iter()
                .map(|d| d.name())
                .collect::<Vec<_>>()
                .join("+"),
            module_prefix,
            random_init_seed: random_seed,
        };
        Ok((weights, summary))
    }

    /// Builds weights from tensors already keyed like the state dict (tests, random init).
    pub(crate) fn from_tensors(
        tensors: HashMap<String, Tensor>,
        folded: bool,
        random_seed: Option<u64>,
    ) -> Result<Self> {
        for TensorSpec { key, shape, .. } in arch::tensor_specs(folded) {
            let t = tensors
                .get(&key)
                .ok_or(Error::MissingKey { key: key.clone() })?;
            if t.dims() != shape.as_slice() {
                return Err(Error::WrongShape {
                    key,
                    expected: shape,
                    found: t.dims().to_vec(),
                });
            }
        }
        Ok(GeneratorWeights {
            tensors,
            folded,
            random_seed,
        })
    }

    /// The seed, when these are random test weights from `lipsync init-weights`.
    pub fn random_seed(&self) -> Option<u64> {
        self.random_seed
    }

    pub fn is_folded(&self) -> bool {
        self.folded
    }

    /// A tensor by state-dict key.
    pub fn get(&self, key: &str) -> Result<&Tensor> {
        self.tensors.get(key).ok_or_else(|| Error::MissingKey {
            key: key.to_string(),
        })
    }

    /// Trainable parameters (BatchNorm running statistics excluded): 36,298,035 unfolded.
    pub fn parameter_count(&self) -> usize {
        arch::tensor_specs(self.folded)
            .iter()
            .filter(|s| s.parameter)
            .map(|s| s.shape.iter().product::<usize>())
            .sum()
    }

    /// BatchNorm folded into the convolutions (computed in f64, stored as f32).
    pub fn fold(&self) -> Result<GeneratorWeights> {
        if self.folded {
            return Ok(self.clone());
        }
        let f64_of = |k: &str| -> Result<Tensor> { Ok(self.get(k)?.to_dtype(DType::F64)?) };
        let mut out = HashMap::new();
        for (path, spec) in arch::layers() {
            let conv = spec.conv_prefix(&path);
            let w = f64_of(&format!("{conv}.weight"))?;
            let b = f64_of(&format!("{conv}.bias"))?;
            let (w, b) = if spec.has_batch_norm() {
                let bn = |name: &str| f64_of(&format!("{path}.conv_block.1.{name}"));
                let scale = (bn("weight")? / (bn("running_var")? + BN_EPS)?.sqrt()?)?;
                let axis_shape = match spec.kind {
                    LayerKind::ConvTranspose => (1, spec.cout, 1, 1),
                    _ => (spec.cout, 1, 1, 1),
                };
                let w = w.broadcast_mul(&scale.reshape(axis_shape)?)?;
                let b = ((b - bn("running_mean")?)? * &scale)?.add(&bn("bias")?)?;
                (w, b)
            } else {
                (w, b)
            };
            out.insert(format!("{conv}.weight"), w.to_dtype(DType::F32)?);
            out.insert(format!("{conv}.bias"), b.to_dtype(DType::F32)?);
        }
        Ok(GeneratorWeights {
            tensors: out,
            folded: true,
            random_seed: self.random_seed,
        })
    }

    /// Writes the weights as safetensors in `dtype`, under their state-dict names; folded
    /// weights carry the [`FOLDED_METADATA_KEY`] marker.
    pub fn save(&self, path: &Path, dtype: DType) -> Result<()> {
        let mut tensors = Vec::with_capacity(self.tensors.len());
        for spec in arch::tensor_specs(self.folded) {
            let t = self.get(&spec.key)?.to_dtype(dtype)?;
            if !all_finite(&t)? {
                return Err(Error::NonFinite { key: spec.key });
            }
            tensors.push((spec.key, t));
        }
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        meta.insert("lipsync.model".to_string(), "wav2lip".to_string());
        meta.insert(FOLDED_METADATA_KEY.to_string(), self.folded.to_string());
        if let Some(seed) = self.random_seed {
            meta.insert(RANDOM_SEED_METADATA_KEY.to_string(), seed.to_string());
        }
        checkpoint::write_safetensors(path, &tensors, &meta)
    }
}

/// Whether every element is finite (a conversion to f16 can overflow to ±inf).
fn all_finite(t: &Tensor) -> Result<bool> {
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(v.iter().all(|x| x.is_finite()))
}
