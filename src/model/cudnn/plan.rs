//! The engine's bookkeeping that needs no GPU, so CPU tests cover it: what a plan is keyed on,
//! cuDNN math types, choosing among an algorithm search's results, whether a layer runs cuDNN's
//! fused call, and telling cuDNN's out-of-memory statuses from its other failures.

use std::collections::HashMap;
use std::hash::Hash;

use candle_core::DType;
use serde::{Deserialize, Serialize};

use super::ConvLayout;
use crate::model::arch::{LayerKind, LayerSpec};
use crate::model::upsample::FormConv;

// ---------------------------------------------------------------------------------------------
// Plan keys.

/// One convolution as cuDNN runs it: a layer's, or one of an upsampling form's (whose
/// kernels may be 1×2 with padding on one axis only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConvDims {
    /// A transposed convolution (cuDNN's backward-data) rather than a convolution.
    pub transposed: bool,
    pub cin: usize,
    pub cout: usize,
    /// Kernel height and width.
    pub kh: usize,
    pub kw: usize,
    pub stride: (usize, usize),
    /// Symmetric zero padding, rows and columns.
    pub pad: (usize, usize),
    pub output_padding: usize,
}

impl ConvDims {
    /// A layer's convolution.
    pub fn of(spec: &LayerSpec) -> Self {
        ConvDims {
            transposed: spec.kind == LayerKind::ConvTranspose,
            cin: spec.cin,
            cout: spec.cout,
            kh: spec.kernel,
            kw: spec.kernel,
            stride: spec.stride,
            pad: (spec.padding, spec.padding),
            output_padding: spec.output_padding,
        }
    }

    /// One convolution of an upsampling form for the layer `spec`.
    pub fn of_form(c: &FormConv, spec: &LayerSpec) -> Self {
        ConvDims {
            transposed: false,
            cin: spec.cin,
            cout: c.cout(spec.cout),
            kh: c.kh,
            kw: c.kw,
            stride: (1, 1),
            pad: (c.ph, c.pw),
            output_padding: 0,
        }
    }

    /// The same convolution reading `cin` input channels (an input padded with zero
    /// channels, read by zero weights).
    pub fn with_cin(self, cin: usize) -> Self {
        ConvDims { cin, ..self }
    }

    /// Output height and width for an `h`×`w` input.
    pub fn output(&self, h: usize, w: usize) -> (usize, usize) {
        if self.transposed {
            (
                (h - 1) * self.stride.0 + self.kh + self.output_padding - 2 * self.pad.0,
                (w - 1) * self.stride.1 + self.kw + self.output_padding - 2 * self.pad.1,
            )
        } else {
            (
                (h + 2 * self.pad.0 - self.kh) / self.stride.0 + 1,
                (w + 2 * self.pad.1 - self.kw) / self.stride.1 + 1,
            )
        }
    }

    /// The weight's dimensions in PyTorch's layout: `(cout, cin, kh, kw)`, transposed
    /// `(cin, cout, kh, kw)`.
    pub fn weight(&self) -> [usize; 4] {
        if self.transposed {
            [self.cin, self.cout, self.kh, self.kw]
        } else {
            [self.cout, self.cin, self.kh, self.kw]
        }
    }
}

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
    /// The weight in PyTorch layout: `(cout, cin, kh, kw)`, transposed `(cin, cout, kh, kw)`.
    pub weight: [usize; 4],
    pub stride: (usize, usize),
    /// Rows and columns.
    pub padding: (usize, usize),
    pub output_padding: usize,
}

impl PlanKey {
    pub fn new(path: &str, spec: &LayerSpec, input: [usize; 4], weight: [usize; 4]) -> Self {
        let mut key = Self::of_dims(path, &ConvDims::of(spec), input);
        key.weight = weight;
        key
    }

    /// The key of a convolution of `dims` at `path` on an input of `(n, c, h, w)`.
    pub fn of_dims(path: &str, dims: &ConvDims, input: [usize; 4]) -> Self {
        PlanKey {
            path: path.to_string(),
            transposed: dims.transposed,
            input,
            weight: dims.weight(),
            stride: dims.stride,
            padding: dims.pad,
            output_padding: dims.output_padding,
        }
    }

    /// The convolution's dimensions.
    pub fn dims(&self) -> ConvDims {
        let [a, b, kh, kw] = self.weight;
        let (cin, cout) = if self.transposed { (a, b) } else { (b, a) };
        ConvDims {
            transposed: self.transposed,
            cin,
            cout,
            kh,
            kw,
            stride: self.stride,
            pad: self.padding,
            output_padding: self.output_padding,
        }
    }

    /// The key of the process-wide algorithm choice (and of the cache file): the shape,
    /// type and layout of the convolution without the layer's name, so layers of equal shape
    /// share one search. NCHW keys have no layout word (the cache files written before NHWC
    /// existed stay valid), nor do square paddings a second number.
    pub fn tune_key(&self, dtype: DType, layout: ConvLayout) -> String {
        let [n, c, h, w] = self.input;
        let [a, b, kh, kw] = self.weight;
        let (ph, pw) = self.padding;
        format!(
            "{}{} {dtype:?} x{n}x{c}x{h}x{w} w{a}x{b}x{kh}x{kw} s{}x{} p{ph}{} op{}",
            if self.transposed { "bwd_data" } else { "fwd" },
            if layout == ConvLayout::Nhwc {
                " nhwc"
            } else {
                ""
            },
            self.stride.0,
            self.stride.1,
            if ph == pw {
                String::new()
            } else {
                format!("x{pw}")
            },
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

    /// The plan for `key`, if one was made.
    pub fn get_mut(&mut self, key: &PlanKey) -> Option<&mut P> {
        self.plans.get_mut(key)
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

/// cuDNN's `cudnnMathType_t` (cudnn_graph.h values).
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

    /// Whether a model computing in `dtype` may run an algorithm that cuDNN reported with
    /// this math type: f32 only without tensor cores (FMA, or DEFAULT, which cuDNN 9 may
    /// report for FMA kernels found under FMA math; it runs with FMA set, see
    /// [`Self::to_run`]), half types any.
    pub fn allowed_for(self, dtype: DType) -> bool {
        dtype != DType::F32 || matches!(self, MathType::Fma | MathType::Default)
    }

    /// The math type to set on the descriptor (and query the workspace with) to run an
    /// algorithm reported with this one: always FMA for f32 (DEFAULT_MATH on the descriptor
    /// would let cuDNN use TF32 tensor cores on Ampere and later), exactly the reported one for
    /// half types.
    pub fn to_run(self, dtype: DType) -> MathType {
        if dtype == DType::F32 {
            MathType::Fma
        } else {
            self
        }
    }

    /// Whether the algorithm uses tensor cores: the only math under which an untimed choice
    /// runs cuDNN's fused call ([`fuse_decision`]).
    pub fn is_tensor_op(self) -> bool {
        matches!(self, MathType::TensorOp | MathType::TensorOpAllowConversion)
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
    /// The math type set on the descriptor: for half types exactly the one the search
    /// reported for this algorithm, for f32 always FMA ([`MathType::to_run`]).
    pub math: MathType,
    /// The workspace the search reported (informative: runs query cuDNN for the chosen
    /// algorithm and math type).
    pub workspace: usize,
    /// Measured milliseconds (informative; negative for a heuristic choice).
    pub ms: f32,
    /// The fused call timed against the unfused sequence with this algorithm (absent in
    /// cache files written before it was timed, which still load).
    #[serde(default, skip_serializing_if = "FuseTimings::is_empty")]
    pub fuse: FuseTimings,
}

impl Choice {
    /// A choice known to the process (or read from the cache file) as a model computing in
    /// `dtype` runs it: `None` when its math type is not allowed for `dtype`, else with the
    /// math type to set ([`MathType::to_run`]), so a file that says DEFAULT_MATH for f32 still
    /// runs without TF32.
    pub fn usable_for(&self, dtype: DType) -> Option<Choice> {
        self.math.allowed_for(dtype).then(|| Choice {
            math: self.math.to_run(dtype),
            ..self.clone()
        })
    }
}

/// The first usable entry of cuDNN's results (Find sorts them by time, the heuristic by
/// expected speed): it succeeded, its math type is known and allowed for `dtype`, and it needs
/// at most `max_workspace` bytes. The choice carries the math type to run it with
/// ([`MathType::to_run`]).
pub fn pick(candidates: &[Candidate], dtype: DType, max_workspace: usize) -> Option<Choice> {
    candidates.iter().find_map(|c| {
        let math = c.math?;
        (c.ok && math.allowed_for(dtype) && c.workspace <= max_workspace).then(|| Choice {
            algo: c.algo.clone(),
            math: math.to_run(dtype),
            workspace: c.workspace,
            ms: c.ms,
            fuse: FuseTimings::default(),
        })
    })
}

// ---------------------------------------------------------------------------------------------
// Fusion: bias, residual and ReLU inside the convolution call, or after it.

/// The fused call (`cudnnConvolutionBiasActivationForward`) and the unfused sequence
/// (convolution, then bias, residual and ReLU as separate operations) timed on one layer's
/// real buffers: the least of a few runs of each, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FuseTiming {
    pub fused_ms: f32,
    pub unfused_ms: f32,
}

/// A choice's fusion timings. Layers with and without a residual add run different fused and
/// unfused sequences, so each is timed on its own; so are the two paths' unfused sequences
/// (separate operations, or the own epilogue kernel of the planned path).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct FuseTimings {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plain: Option<FuseTiming>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residual: Option<FuseTiming>,
    /// The fused call against the convolution and the own epilogue kernel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub own_plain: Option<FuseTiming>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub own_residual: Option<FuseTiming>,
}

impl FuseTimings {
    pub fn is_empty(&self) -> bool {
        self.plain.is_none()
            && self.residual.is_none()
            && self.own_plain.is_none()
            && self.own_residual.is_none()
    }

    /// The timing against the own epilogue of layers with (`residual`) or without a
    /// residual add.
    pub fn get_own(&self, residual: bool) -> Option<FuseTiming> {
        if residual {
            self.own_residual
        } else {
            self.own_plain
        }
    }

    pub fn set_own(&mut self, residual: bool, timing: FuseTiming) {
        if residual {
            self.own_residual = Some(timing);
        } else {
            self.own_plain = Some(timing);
        }
    }

    /// The timing of layers with (`residual`) or without a residual add.
    pub fn get(&self, residual: bool) -> Option<FuseTiming> {
        if residual {
            self.residual
        } else {
            self.plain
        }
    }

    pub fn set(&mut self, residual: bool, timing: FuseTiming) {
        if residual {
            self.residual = Some(timing);
        } else {
            self.plain = Some(timing);
        }
    }
}

/// Whether a layer runs the fused call: where it was timed, only if it was faster than the
/// unfused sequence; untimed (cuDNN's heuristic choice after warm-up, when no timing may run
/// in the middle of a request), only under tensor-op math, as PyTorch does (the fused call is
/// otherwise much slower than the convolution it wraps).
pub fn fuse_decision(timed: Option<FuseTiming>, math: MathType) -> bool {
    match timed {
        Some(t) => t.fused_ms < t.unfused_ms,
        None => math.is_tensor_op(),
    }
}

/// Whether a plan runs bias, residual and ReLU inside cuDNN's call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fusion {
    /// After the convolution: the layer has no fused form (transposed convolutions, the bare
    /// output convolution), the fused call was slower or untimed outside tensor-op math
    /// ([`fuse_decision`]), or cuDNN refused it.
    Unfused,
    /// Inside the convolution call.
    Fused,
    /// Not decided yet: runs unfused until both forms are timed on the layer's buffers
    /// (during warm-up, right after the plan's first run).
    ToTime,
}

impl Fusion {
    /// A new plan's state. `fusable`: the layer has a fused form; `timed`: the choice's
    /// timing for this kind of layer, if any; `may_time`: timing is allowed now (warm-up).
    pub fn new(fusable: bool, timed: Option<FuseTiming>, math: MathType, may_time: bool) -> Fusion {
        if !fusable {
            Fusion::Unfused
        } else if timed.is_none() && may_time {
            Fusion::ToTime
        } else {
            Fusion::decided(timed, math)
        }
    }

    /// The state [`fuse_decision`] gives.
    pub fn decided(timed: Option<FuseTiming>, math: MathType) -> Fusion {
        if fuse_decision(timed, math) {
            Fusion::Fused
        } else {
            Fusion::Unfused
        }
    }

    /// cuDNN refused the fused call (not every type, layout and algorithm has a fused
    /// kernel): unfused from now on.
    pub fn refused(&mut self) {
        *self = Fusion::Unfused;
    }

    /// Whether a normal run calls the fused form.
    pub fn runs_fused(self) -> bool {
        self == Fusion::Fused
    }
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
    fn conv_dims_give_output_sizes_weights_and_keys_for_layers_and_forms() {
        use crate::model::upsample::{self, UpForm};
        let up = *arch::FACE_DECODER_BLOCKS
            .iter()
            .flat_map(|b| b.iter())
            .find(|s| upsample::applies(s))
            .unwrap();
        let d = ConvDims::of(&up);
        assert!(d.transposed);
        assert_eq!(d.output(3, 3), (6, 6));
        assert_eq!(d.weight(), [up.cin, up.cout, 3, 3]);
        for form in [UpForm::Subpixel, UpForm::Subpixel2x2, UpForm::Phases] {
            for c in form.convs() {
                let fd = ConvDims::of_form(&c, &up);
                assert_eq!(fd.output(3, 5), c.out_size(3, 5), "{form:?}");
                let key = PlanKey::of_dims("x", &fd, [2, up.cin, 3, 5]);
                assert_eq!(key.dims(), fd);
                // Unequal paddings show in the tune key; equal ones as before.
                let text = key.tune_key(DType::F16, ConvLayout::Nhwc);
                if c.ph != c.pw {
                    assert!(text.contains(&format!("p{}x{}", c.ph, c.pw)), "{text}");
                } else {
                    assert!(text.contains(&format!("p{} ", c.ph)), "{text}");
                }
            }
        }
        let s = conv_spec();
        let d = ConvDims::of(&s).with_cin(s.cin + 2);
        assert_eq!(d.weight(), [s.cout, s.cin + 2, 3, 3]);
        assert_eq!(d.output(48, 48), (48, 48));
        let strided = ConvDims::of(&arch::AUDIO_ENCODER[3]);
        assert_eq!(strided.output(80, 16), (27, 16));
    }

    #[test]
    fn a_failed_plan_is_not_cached() {
        let s = conv_spec();
        let key = PlanKey::new("x", &s, [1, s.cin, 8, 8], [s.cout, s.cin, 3, 3]);
        let mut cache: PlanCache<u8> = PlanCache::default();
        assert!(cache.get_or_try_insert(&key, || Err("no")).is_err());
        assert!(cache.is_empty());
        assert!(cache.get_mut(&key).is_none());
        assert_eq!(
            *cache.get_or_try_insert(&key, || Ok::<_, ()>(7)).unwrap(),
            7
        );
        // Found again without making it (the fusion timing updates a plan this way).
        *cache.get_mut(&key).unwrap() = 8;
        assert_eq!(
            *cache.get_or_try_insert(&key, || Ok::<_, ()>(9)).unwrap(),
            8
        );
    }

    #[test]
    fn tune_keys_share_equal_shapes_and_separate_others() {
        let s = conv_spec();
        let w = [s.cout, s.cin, 3, 3];
        let a = PlanKey::new("a", &s, [4, s.cin, 48, 48], w);
        let b = PlanKey::new("b", &s, [4, s.cin, 48, 48], w);
        let c = PlanKey::new("a", &s, [4, s.cin, 24, 24], w);
        let key = |k: &PlanKey, dtype| k.tune_key(dtype, ConvLayout::Nchw);
        assert_ne!(a, b);
        assert_eq!(key(&a, DType::F16), key(&b, DType::F16));
        assert_ne!(key(&a, DType::F16), key(&c, DType::F16));
        assert_ne!(key(&a, DType::F16), key(&a, DType::BF16));
        // NHWC choices are their own; NCHW keys read as before the layout existed.
        assert_ne!(
            key(&a, DType::F16),
            a.tune_key(DType::F16, ConvLayout::Nhwc)
        );
        assert_eq!(
            key(&a, DType::F16),
            format!(
                "fwd F16 x4x{}x48x48 w{}x{}x3x3 s1x1 p1 op0",
                s.cin, s.cout, s.cin
            )
        );
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
    fn half_types_run_exactly_the_reported_math_type() {
        // DEFAULT_MATH stays DEFAULT_MATH (it once became FMA) and ALLOW_CONVERSION stays.
        let c = pick(&[cand("A", true, 0, 0)], DType::F16, 1 << 20).unwrap();
        assert_eq!(c.math, MathType::Default);
        let c = pick(&[cand("B", true, 2, 0)], DType::BF16, 1 << 20).unwrap();
        assert_eq!(c.math, MathType::TensorOpAllowConversion);
        let c = pick(&[cand("F", true, 3, 0)], DType::F16, 1 << 20).unwrap();
        assert_eq!(c.math, MathType::Fma);
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
    fn f32_accepts_default_or_fma_reports_and_always_runs_fma() {
        // cuDNN 9 may report DEFAULT_MATH for the FMA kernels a search under FMA math found:
        // usable, but run with FMA set (DEFAULT on the descriptor would allow TF32).
        let c = pick(&[cand("D", true, 0, 0)], DType::F32, 1 << 20).unwrap();
        assert_eq!((c.algo.as_str(), c.math), ("D", MathType::Fma));
        let c = pick(&[cand("F", true, 3, 0)], DType::F32, 1 << 20).unwrap();
        assert_eq!(c.math, MathType::Fma);
        // Tensor-op entries (TF32) are skipped, even when they come first.
        let results = [
            cand("TF32", true, 1, 0),
            cand("TF32_CONV", true, 2, 0),
            cand("D", true, 0, 0),
        ];
        let c = pick(&results, DType::F32, 1 << 20).unwrap();
        assert_eq!((c.algo.as_str(), c.math), ("D", MathType::Fma));
        assert!(pick(&results[..2], DType::F32, 1 << 20).is_none());
        // A cache entry that says DEFAULT for f32 also runs FMA; one with tensor-op math is
        // not used for f32; half types keep the recorded math type.
        let mut known = c.clone();
        known.math = MathType::Default;
        assert_eq!(known.usable_for(DType::F32).unwrap().math, MathType::Fma);
        assert_eq!(
            known.usable_for(DType::F16).unwrap().math,
            MathType::Default
        );
        known.math = MathType::TensorOp;
        assert!(known.usable_for(DType::F32).is_none());
        assert_eq!(known.usable_for(DType::BF16).unwrap(), known);
        for m in 0..4 {
            let m = MathType::from_raw(m).unwrap();
            assert_eq!(m.to_run(DType::F32), MathType::Fma);
            assert_eq!(m.to_run(DType::F16), m);
        }
    }

    #[test]
    fn pick_skips_failed_oversized_unknown_and_tf32_entries() {
        let results = [
            cand("FAILED", false, 1, 0),
            cand("TOO_BIG", true, 1, 2 << 20),
            cand("UNKNOWN_MATH", true, 9, 0),
            cand("TENSOR", true, 1, 1 << 20),
            cand("FAILED_FMA", false, 3, 0),
            cand("FMA", true, 3, 0),
        ];
        assert_eq!(pick(&results, DType::F16, 1 << 20).unwrap().algo, "TENSOR");
        // f32 runs only FMA math: no TF32 through TENSOR_OP math.
        let c = pick(&results, DType::F32, 1 << 20).unwrap();
        assert_eq!((c.algo.as_str(), c.math), ("FMA", MathType::Fma));
        assert!(pick(&results[..3], DType::F16, 1 << 20).is_none());
        assert!(pick(&results[..5], DType::F32, 1 << 20).is_none());
        assert_eq!(MathType::for_search(DType::F32), MathType::Fma);
        assert_eq!(MathType::for_search(DType::BF16), MathType::TensorOp);
    }

    fn timing(fused_ms: f32, unfused_ms: f32) -> FuseTiming {
        FuseTiming {
            fused_ms,
            unfused_ms,
        }
    }

    #[test]
    fn fusion_is_kept_only_where_measured_faster_or_under_tensor_ops() {
        use MathType::*;
        for math in [Default, TensorOp, TensorOpAllowConversion, Fma] {
            // Timed: the measurement decides, whatever the math type.
            assert!(fuse_decision(Some(timing(1.0, 2.0)), math));
            assert!(!fuse_decision(Some(timing(2.0, 1.0)), math));
            assert!(
                !fuse_decision(Some(timing(1.0, 1.0)), math),
                "a tie stays unfused"
            );
        }
        // Untimed (heuristic choices after warm-up): PyTorch's rule.
        assert!(!fuse_decision(None, Fma));
        assert!(!fuse_decision(None, Default));
        assert!(fuse_decision(None, TensorOp));
        assert!(fuse_decision(None, TensorOpAllowConversion));
    }

    #[test]
    fn a_plans_fusion_state_follows_timing_heuristics_and_refusals() {
        use MathType::*;
        let faster = Some(timing(1.0, 2.0));
        let slower = Some(timing(3.0, 2.0));
        // No fused form: never fused, never timed.
        for may_time in [false, true] {
            assert_eq!(
                Fusion::new(false, faster, TensorOp, may_time),
                Fusion::Unfused
            );
        }
        // A timed search during warm-up (or a cached choice without a timing): timed on the
        // first run, unfused until then.
        let mut f = Fusion::new(true, None, Fma, true);
        assert_eq!(f, Fusion::ToTime);
        assert!(!f.runs_fused());
        // The timing decides.
        assert_eq!(Fusion::decided(faster, Fma), Fusion::Fused);
        assert_eq!(Fusion::decided(slower, TensorOp), Fusion::Unfused);
        // A cached timing is reused without timing again.
        assert_eq!(Fusion::new(true, faster, Fma, true), Fusion::Fused);
        assert_eq!(Fusion::new(true, slower, TensorOp, true), Fusion::Unfused);
        // After warm-up, untimed: tensor-op math only.
        assert_eq!(Fusion::new(true, None, Fma, false), Fusion::Unfused);
        assert_eq!(Fusion::new(true, None, Default, false), Fusion::Unfused);
        f = Fusion::new(true, None, TensorOp, false);
        assert!(f.runs_fused());
        // A fused call cuDNN refuses later: unfused from then on.
        f.refused();
        assert_eq!(f, Fusion::Unfused);
        let mut g = Fusion::new(true, None, Fma, true);
        g.refused();
        assert_eq!(g, Fusion::Unfused, "refused while waiting for its timing");
    }

    #[test]
    fn fusion_timings_are_kept_per_kind_of_layer_and_old_cache_entries_load() {
        let mut c = pick(&[cand("A", true, 1, 0)], DType::F16, 1 << 20).unwrap();
        assert!(c.fuse.is_empty());
        // Written before fusion was timed: no `fuse` field, and none is written while empty.
        let old = r#"{"algo":"A","math":"CUDNN_TENSOR_OP_MATH","workspace":0,"ms":1.0}"#;
        assert_eq!(serde_json::from_str::<Choice>(old).unwrap(), c);
        assert!(!serde_json::to_string(&c).unwrap().contains("fuse"));
        c.fuse.set(true, timing(1.0, 2.0));
        assert_eq!(c.fuse.get(true), Some(timing(1.0, 2.0)));
        assert_eq!(
            c.fuse.get(false),
            None,
            "a residual layer's timing is not a plain one's"
        );
        c.fuse.set(false, timing(4.0, 3.0));
        assert_eq!(c.fuse.get(false), Some(timing(4.0, 3.0)));
        // The planned path's timings (against the own epilogue) are kept apart.
        assert_eq!(c.fuse.get_own(false), None);
        c.fuse.set_own(false, timing(5.0, 6.0));
        c.fuse.set_own(true, timing(7.0, 6.0));
        assert_eq!(c.fuse.get(false), Some(timing(4.0, 3.0)));
        assert_eq!(c.fuse.get_own(true), Some(timing(7.0, 6.0)));
        let back: Choice = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        // A cached choice keeps its timings when made usable for a dtype.
        assert_eq!(back.usable_for(DType::F16).unwrap().fuse, c.fuse);
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
