//! The engine's bookkeeping that needs no GPU, so CPU tests cover it: what a plan is keyed on,
//! cuDNN math types, choosing among an algorithm search's results, and telling cuDNN's
//! out-of-memory statuses from its other failures.

use std::collections::HashMap;
use std::hash::Hash;

use candle_core::DType;
use serde::{Deserialize, Serialize};

use crate::model::arch::{LayerKind, LayerSpec};

// ---------------------------------------------------------------------------------------------
// Plan keys.

/// Everything a layer's descriptors and algorithm depend on: the layer (path and spec), the
/// full input shape and the weight shape. Two layers, or one layer at two input sizes, never
/// share a plan, even at the same batch size.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PlanKey {
    pub path: String,
    /// A transposed convolution (cuDNN's backward-data) rather than a convolution.
    pub transposed: bool,
    /// `(n, c, h, w)` of the input.
    pub input: [usize; 4],
    /// The weight in PyTorch layout: `(cout, cin, k, k)`, transposed `(cin, cout, k, k)`.
    pub weight: [usize; 4],
    pub stride: (usize, usize),
    pub padding: usize,
    pub output_padding: usize,
}

impl PlanKey {
    pub fn new(path: &str, spec: &LayerSpec, input: [usize; 4], weight: [usize; 4]) -> Self {
        PlanKey {
            path: path.to_string(),
            transposed: spec.kind == LayerKind::ConvTranspose,
            input,
            weight,
            stride: spec.stride,
            padding: spec.padding,
            output_padding: spec.output_padding,
        }
    }

    /// The key of the process-wide algorithm choice (and of the cache file): the shape and
    /// type of the convolution without the layer's name, so layers of equal shape share one
    /// search.
    pub fn tune_key(&self, dtype: DType) -> String {
        let [n, c, h, w] = self.input;
        let [a, b, kh, kw] = self.weight;
        format!(
            "{} {dtype:?} x{n}x{c}x{h}x{w} w{a}x{b}x{kh}x{kw} s{}x{} p{} op{}",
            if self.transposed { "bwd_data" } else { "fwd" },
            self.stride.0,
            self.stride.1,
            self.padding,
            self.output_padding,
        )
    }
}

/// An engine's plans by [`PlanKey`].
#[derive(Debug)]
pub struct PlanCache<P> {
    plans: HashMap<PlanKey, P>,
}

impl<P> Default for PlanCache<P> {
    fn default() -> Self {
        PlanCache {
            plans: HashMap::new(),
        }
    }
}

impl<P> PlanCache<P> {
    /// The plan for `key`, made by `make` when there is none yet (a failed `make` stores
    /// nothing).
    pub fn get_or_try_insert<E>(
        &mut self,
        key: &PlanKey,
        make: impl FnOnce() -> Result<P, E>,
    ) -> Result<&mut P, E> {
        if !self.plans.contains_key(key) {
            let plan = make()?;
            self.plans.insert(key.clone(), plan);
        }
        Ok(self.plans.get_mut(key).expect("inserted above"))
    }

    pub fn iter(&self) -> impl Iterator<Item = (&PlanKey, &P)> {
        self.plans.iter()
    }

    pub fn len(&self) -> usize {
        self.plans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.plans.is_empty()
    }
}

// ---------------------------------------------------------------------------------------------
// Math types and algorithm choice.

/// cuDNN's `cudnnMathType_t`, kept exactly as a search reported it (cudnn_graph.h values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MathType {
    #[serde(rename = "CUDNN_DEFAULT_MATH")]
    Default,
    #[serde(rename = "CUDNN_TENSOR_OP_MATH")]
    TensorOp,
    #[serde(rename = "CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION")]
    TensorOpAllowConversion,
    #[serde(rename = "CUDNN_FMA_MATH")]
    Fma,
}

impl MathType {
    /// From cuDNN's numeric value.
    pub fn from_raw(v: u32) -> Option<MathType> {
        Some(match v {
            0 => MathType::Default,
            1 => MathType::TensorOp,
            2 => MathType::TensorOpAllowConversion,
            3 => MathType::Fma,
            _ => return None,
        })
    }

    /// cuDNN's numeric value.
    pub fn raw(self) -> u32 {
        match self {
            MathType::Default => 0,
            MathType::TensorOp => 1,
            MathType::TensorOpAllowConversion => 2,
            MathType::Fma => 3,
        }
    }

    /// The math type set on the descriptor for the search: f32 plain FMA (no TF32: f32 is the
    /// reference precision, as PyTorch does with `allow_tf32 = False`), f16/bf16 tensor cores.
    pub fn for_search(dtype: DType) -> MathType {
        if dtype == DType::F32 {
            MathType::Fma
        } else {
            MathType::TensorOp
        }
    }

    /// Whether a model computing in `dtype` may run an algorithm with this math type: f32
    /// only FMA (DEFAULT_MATH permits TF32 tensor cores on Ampere and later), half types any.
    pub fn allowed_for(self, dtype: DType) -> bool {
        dtype != DType::F32 || self == MathType::Fma
    }
}

/// One entry of a search's (or the heuristic's) results, in cuDNN's order.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// cuDNN's name of the algorithm (`CUDNN_CONVOLUTION_FWD_ALGO_…` / `…_BWD_DATA_ALGO_…`).
    pub algo: String,
    /// Whether cuDNN ran (or could run) it.
    pub ok: bool,
    /// The math type cuDNN reported (`None`: a value this build does not know).
    pub math: Option<MathType>,
    pub ms: f32,
    pub workspace: usize,
}

/// One algorithm choice, shared by the process and kept in the cache file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    pub algo: String,
    /// Exactly the math type the search reported for this algorithm; set on the descriptor.
    pub math: MathType,
    /// The workspace the search reported (informative: runs query cuDNN for the chosen
    /// algorithm and math type).
    pub workspace: usize,
    /// Measured milliseconds (informative; negative for a heuristic choice).
    pub ms: f32,
}

/// The first usable entry of cuDNN's results (Find sorts them by time, the heuristic by
/// expected speed): it succeeded, its math type is known and allowed for `dtype`, and it needs
/// at most `max_workspace` bytes.
pub fn pick(candidates: &[Candidate], dtype: DType, max_workspace: usize) -> Option<Choice> {
    candidates.iter().find_map(|c| {
        let math = c.math?;
        (c.ok && math.allowed_for(dtype) && c.workspace <= max_workspace).then(|| Choice {
            algo: c.algo.clone(),
            math,
            workspace: c.workspace,
            ms: c.ms,
        })
    })
}

// ---------------------------------------------------------------------------------------------
// Errors.

/// A failed cuDNN call. Out-of-memory statuses are told apart from the others, so the pool
/// can split a batch on the first and fall back to candle's operations on the second.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudnnError {
    /// What was called (`"find forward algorithm"`, `"fused convolution"`…).
    pub call: String,
    /// cuDNN's name of the status.
    pub status: String,
    /// cuDNN's numeric status.
    pub code: u32,
}

impl CudnnError {
    /// cuDNN 9's host (4003, which cuDNN 8 called ALLOC_FAILED) and device (4004) allocation
    /// failures, and cuDNN 8's ALLOC_FAILED (2).
    pub fn is_out_of_memory(&self) -> bool {
        status_is_out_of_memory(self.code)
    }
}

/// See [`CudnnError::is_out_of_memory`].
pub fn status_is_out_of_memory(code: u32) -> bool {
    matches!(code, 2 | 4003 | 4004)
}

impl std::fmt::Display for CudnnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cuDNN {}: {}", self.call, self.status)?;
        if self.is_out_of_memory() {
            // The pool also recognises running out of memory by this text.
            write!(f, " (out of memory)")?;
        }
        Ok(())
    }
}

impl std::error::Error for CudnnError {}

impl CudnnError {
    /// The cuDNN error inside a candle error (the engine raises them as
    /// `candle_core::Error::Cuda`), through candle's context and backtrace wrappers.
    pub fn find_in(e: &candle_core::Error) -> Option<&CudnnError> {
        use candle_core::Error as E;
        match e {
            E::Cuda(inner) => inner.downcast_ref::<CudnnError>(),
            E::WithBacktrace { inner, .. }
            | E::Context { inner, .. }
            | E::WithPath { inner, .. } => CudnnError::find_in(inner),
            _ => None,
        }
    }
}

impl From<CudnnError> for candle_core::Error {
    fn from(e: CudnnError) -> Self {
        candle_core::Error::Cuda(Box::new(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::arch;

    fn conv_spec() -> LayerSpec {
        // A 3×3 stride-1 residual layer of the face encoder.
        *arch::FACE_ENCODER_BLOCKS
            .iter()
            .flat_map(|b| b.iter())
            .find(|s| s.kind == LayerKind::Conv && s.residual && s.kernel == 3)
            .expect("the face encoder has residual 3×3 layers")
    }

    #[test]
    fn plans_are_keyed_on_the_full_shape_not_only_path_and_batch() {
        let s = conv_spec();
        let w = [s.cout, s.cin, s.kernel, s.kernel];
        let mut cache: PlanCache<usize> = PlanCache::default();
        let mut made = 0;
        let mut get = |cache: &mut PlanCache<usize>, input: [usize; 4], weight: [usize; 4]| {
            let key = PlanKey::new("face_encoder_blocks.1.1", &s, input, weight);
            *cache
                .get_or_try_insert(&key, || {
                    made += 1;
                    Ok::<_, ()>(made)
                })
                .unwrap()
        };
        let a = get(&mut cache, [2, s.cin, 48, 48], w);
        assert_eq!(
            get(&mut cache, [2, s.cin, 48, 48], w),
            a,
            "same shape: same plan"
        );
        // Same path and batch, other height, width, channels or weight: other plans.
        let b = get(&mut cache, [2, s.cin, 24, 48], w);
        let c = get(&mut cache, [2, s.cin, 48, 24], w);
        let d = get(&mut cache, [2, s.cin + 1, 48, 48], w);
        let e = get(&mut cache, [2, s.cin, 48, 48], [s.cout, s.cin, 1, 1]);
        let all = [a, b, c, d, e];
        for (i, x) in all.iter().enumerate() {
            for y in &all[i + 1..] {
                assert_ne!(x, y);
            }
        }
        assert_eq!(cache.len(), 5);
        // The batch still matters.
        get(&mut cache, [3, s.cin, 48, 48], w);
        assert_eq!(cache.len(), 6);
    }

    #[test]
    fn a_failed_plan_is_not_cached() {
        let s = conv_spec();
        let key = PlanKey::new("x", &s, [1, s.cin, 8, 8], [s.cout, s.cin, 3, 3]);
        let mut cache: PlanCache<u8> = PlanCache::default();
        assert!(cache.get_or_try_insert(&key, || Err("no")).is_err());
        assert!(cache.is_empty());
        assert_eq!(
            *cache.get_or_try_insert(&key, || Ok::<_, ()>(7)).unwrap(),
            7
        );
    }

    #[test]
    fn tune_keys_share_equal_shapes_and_separate_others() {
        let s = conv_spec();
        let w = [s.cout, s.cin, 3, 3];
        let a = PlanKey::new("a", &s, [4, s.cin, 48, 48], w);
        let b = PlanKey::new("b", &s, [4, s.cin, 48, 48], w);
        let c = PlanKey::new("a", &s, [4, s.cin, 24, 24], w);
        assert_ne!(a, b);
        assert_eq!(a.tune_key(DType::F16), b.tune_key(DType::F16));
        assert_ne!(a.tune_key(DType::F16), c.tune_key(DType::F16));
        assert_ne!(a.tune_key(DType::F16), a.tune_key(DType::BF16));
    }

    fn cand(algo: &str, ok: bool, math: u32, ws: usize) -> Candidate {
        Candidate {
            algo: algo.into(),
            ok,
            math: MathType::from_raw(math),
            ms: 1.0,
            workspace: ws,
        }
    }

    #[test]
    fn math_types_round_trip_cudnn_values() {
        for v in 0..4 {
            assert_eq!(MathType::from_raw(v).unwrap().raw(), v);
        }
        assert_eq!(MathType::from_raw(4), None);
    }

    #[test]
    fn the_chosen_math_type_is_exactly_the_reported_one() {
        // DEFAULT_MATH stays DEFAULT_MATH (it once became FMA) and ALLOW_CONVERSION stays.
        let c = pick(&[cand("A", true, 0, 0)], DType::F16, 1 << 20).unwrap();
        assert_eq!(c.math, MathType::Default);
        let c = pick(&[cand("B", true, 2, 0)], DType::BF16, 1 << 20).unwrap();
        assert_eq!(c.math, MathType::TensorOpAllowConversion);
        let c = pick(&[cand("C", true, 1, 0)], DType::F16, 1 << 20).unwrap();
        assert_eq!(c.math, MathType::TensorOp);
        // And survives the cache file.
        let json = serde_json::to_string(&c).unwrap();
        assert!(json.contains("CUDNN_TENSOR_OP_MATH"), "{json}");
        assert_eq!(serde_json::from_str::<Choice>(&json).unwrap(), c);
        let c = pick(&[cand("B", true, 2, 0)], DType::BF16, 1 << 20).unwrap();
        let back: Choice = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back.math, MathType::TensorOpAllowConversion);
    }

    #[test]
    fn pick_skips_failed_oversized_unknown_and_tf32_entries() {
        let results = [
            cand("FAILED", false, 1, 0),
            cand("TOO_BIG", true, 1, 2 << 20),
            cand("UNKNOWN_MATH", true, 9, 0),
            cand("TENSOR", true, 1, 1 << 20),
            cand("FMA", true, 3, 0),
        ];
        assert_eq!(pick(&results, DType::F16, 1 << 20).unwrap().algo, "TENSOR");
        // f32 runs only FMA math: no TF32 through DEFAULT or TENSOR_OP math.
        let c = pick(&results, DType::F32, 1 << 20).unwrap();
        assert_eq!((c.algo.as_str(), c.math), ("FMA", MathType::Fma));
        assert!(pick(&[cand("D", true, 0, 0)], DType::F32, 1 << 20).is_none());
        assert!(pick(&results[..3], DType::F16, 1 << 20).is_none());
        assert_eq!(MathType::for_search(DType::F32), MathType::Fma);
        assert_eq!(MathType::for_search(DType::BF16), MathType::TensorOp);
    }

    #[test]
    fn device_and_host_allocation_failures_are_out_of_memory() {
        let err = |status: &str, code| CudnnError {
            call: "convolution".into(),
            status: status.into(),
            code,
        };
        let device = err("CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED", 4004);
        let host = err("CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED", 4003);
        let unsupported = err("CUDNN_STATUS_NOT_SUPPORTED", 3000);
        let internal = err("CUDNN_STATUS_INTERNAL_ERROR", 4000);
        assert!(device.is_out_of_memory() && host.is_out_of_memory());
        assert!(!unsupported.is_out_of_memory() && !internal.is_out_of_memory());
        assert!(device.to_string().contains("out of memory"));
        assert!(!unsupported.to_string().contains("out of memory"));
        // Found again inside candle's wrappers.
        let wrapped = candle_core::Error::from(unsupported.clone())
            .bt()
            .context("layer face_encoder_blocks.0.0");
        assert_eq!(CudnnError::find_in(&wrapped), Some(&unsupported));
        assert_eq!(
            CudnnError::find_in(&candle_core::Error::Msg("x".into())),
            None
        );
    }
}
