//! The own convolution path on CUDA: every layer's convolution through cuDNN directly, with
//! the algorithm chosen by timing (what PyTorch's `cudnn.benchmark` does) instead of candle's
//! heuristic, descriptors built once per layer and batch size, one persistent workspace per
//! instance, stride-2 transposed convolutions as a forward convolution and a pixel shuffle
//! and the others as `ConvolutionBackwardData` (candle runs them with a naive kernel), f16/bf16 with f32 accumulation, and bias + residual + ReLU fused into the
//! convolution (`cudnnConvolutionBiasActivationForward`) where that was measured faster.
//!
//! - **Autotuning.** The first time a (layer shape, batch, dtype, layout) is run during warm-up,
//!   `cudnnFind…AlgorithmEx` times every algorithm on the real buffers (one search workspace
//!   of at most [`ConvSettings::workspace_limit`], halved until it can be allocated, not
//!   zeroed, for the whole warm-up); the fastest usable one
//!   ([`pick`]: succeeded, fits, f32 only without tensor cores) is kept for the process
//!   (shared by all instances) with the math type it runs with ([`MathType::to_run`]: for
//!   f32 always FMA, whether cuDNN reported FMA or DEFAULT math, so never TF32; for f16/bf16
//!   exactly the one the search reported) and, with a cache file ([`configure`]), written to
//!   JSON once warm-up ends, so a restart skips the search. The file records the GPU, the
//!   cuDNN version and the workspace limit; a file from another GPU, version or limit is
//!   ignored (a lower limit could not run its choices, a higher one would never be used). After
//!   [`CudnnEngine::finish_warm_up`] a shape not seen yet takes cuDNN's heuristic choice
//!   (`cudnnGet…Algorithm_v7`): no search in the middle of a request.
//! - **Fusion.** The algorithm is timed unfused, and the fused call can be much slower than
//!   the convolution it wraps outside tensor-op math. So during warm-up each plan's first run
//!   is followed by a timing of the fused call against the unfused sequence (convolution,
//!   then bias, residual and ReLU as separate operations) on its buffers, and the layer fuses
//!   only if that was faster ([`fuse_decision`]); the timing is kept with the choice (and in
//!   the cache file, so a restart does not time again). Heuristic choices after warm-up fuse
//!   only under tensor-op math, as PyTorch does. A fused call cuDNN refuses runs unfused from
//!   then on ([`Fusion`]).
//! - **Plans.** Descriptors, algorithm, math type, the workspace size cuDNN reports for
//!   them and the fusion state are kept per [`PlanKey`]: the layer and its full input and
//!   weight shape.
//! - **Errors.** A failed call is a [`CudnnError`] (`model::Error::Cudnn`): out of memory
//!   (cuDNN 9's host and device allocation failures) or not (e.g. NOT_SUPPORTED), so callers
//!   split the batch on the first and switch to candle's operations on the second.
//! - **Reference.** At load each instance compares the own path and candle's operations with
//!   an exact f32 reference ([`super::Wav2Lip::check_conv_path`]) and falls back to candle's,
//!   with a warning, when the own path is worse; `tests/gpu.rs` compares every layer.
//!
//! - **Layout.** Activations between layers are NCHW (candle's layout) or NHWC
//!   ([`ConvLayout`]): in NHWC the model converts its inputs once and its output back once,
//!   concatenates on the last axis, and the engine keeps each layer's weights in cuDNN's
//!   NHWC filter layout (`(k, r, s, c)`), so half-precision tensor-core kernels run without
//!   the layout transformations (and their batch-sized workspace) that NCHW needs.
//! - **Upsampling.** The decoder's stride-2 transposed convolutions run as one forward
//!   convolution with four phases of output channels and a pixel shuffle
//!   ([`crate::model::subpixel`], [`Upsampling`]): cuDNN's backward-data kernels were the
//!   slowest part of the pass.
//! - **Workspace.** An algorithm may use at most [`ConvSettings::workspace_limit`] bytes of
//!   workspace (the search allocates that much once, for the warm-up).
//!
//! This module's settings exist in every build (the flags are the same everywhere); the
//! engine only in CUDA builds.

use std::path::PathBuf;
use std::sync::OnceLock;

use serde::Serialize;

use crate::model::upsample::UpForm;

#[cfg(feature = "cuda")]
mod engine;
#[cfg(feature = "cuda")]
mod net;
mod plan;
#[cfg(feature = "cuda")]
pub use candle_core::cuda_backend::cudarc::driver::CudaEvent;
#[cfg(feature = "cuda")]
pub use engine::{autotune_counts, ChoiceSource, CudnnEngine, FormChoice, LayerReport};
#[cfg(feature = "cuda")]
pub use net::{PassOutput, PlannedNet};
pub use plan::{fuse_decision, ConvDims, FuseTiming, FuseTimings, Fusion, PlanCache, PlanKey};
pub use plan::{pick, status_is_out_of_memory, Candidate, Choice, CudnnError, MathType};

/// Counter of the own path's convolution calls in forward passes (not the warm-up's fusion
/// timing runs), labelled `fused="true"` (bias, residual and ReLU inside cuDNN's call) or
/// `"false"` (applied afterwards), so a silent loss of fusion shows.
pub const CONVOLUTIONS_METRIC: &str = "lipsync_cudnn_convolutions_total";

/// The most workspace an algorithm may use by default (the search allocates this much once).
pub const DEFAULT_WORKSPACE_LIMIT: usize = 256 << 20;

/// How the own path lays out activations between layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ConvLayout {
    /// candle's layout: `(n, c, h, w)`.
    Nchw,
    /// Channels last: `(n, h, w, c)`, what tensor-core kernels read natively.
    Nhwc,
}

named_enum!(ConvLayout, "a layout", { "nchw" => Nchw, "nhwc" => Nhwc });

impl ConvLayout {
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

impl ConvLayout {
    /// The axis channels are on in a 4-D activation.
    pub fn channel_axis(self) -> usize {
        match self {
            ConvLayout::Nchw => 1,
            ConvLayout::Nhwc => 3,
        }
    }

    /// `(n, c, h, w)` of an activation whose dimensions in this layout are `dims`.
    pub fn logical(self, dims: [usize; 4]) -> [usize; 4] {
        match self {
            ConvLayout::Nchw => dims,
            ConvLayout::Nhwc => [dims[0], dims[3], dims[1], dims[2]],
        }
    }

    /// An NCHW activation in this layout (a copy in NHWC).
    pub fn from_nchw(self, x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        match self {
            ConvLayout::Nchw => Ok(x.clone()),
            ConvLayout::Nhwc => x.permute((0, 2, 3, 1))?.contiguous(),
        }
    }

    /// An activation in this layout as NCHW (a copy from NHWC).
    pub fn to_nchw(self, x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        match self {
            ConvLayout::Nchw => Ok(x.clone()),
            ConvLayout::Nhwc => x.permute((0, 3, 1, 2))?.contiguous(),
        }
    }

    /// The dimensions in this layout of an activation of `(n, c, h, w)`.
    pub fn physical(self, [n, c, h, w]: [usize; 4]) -> [usize; 4] {
        match self {
            ConvLayout::Nchw => [n, c, h, w],
            ConvLayout::Nhwc => [n, h, w, c],
        }
    }
}

/// Which convolution path CUDA models use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ConvEngine {
    /// Own cuDNN calls: timed algorithm choice, persistent descriptors and workspace.
    Cudnn,
    /// candle's convolution operations (heuristic algorithm choice).
    Candle,
}

/// Process-wide settings of the CUDA convolution path.
#[derive(Debug, Clone)]
pub struct ConvSettings {
    pub engine: ConvEngine,
    /// Where chosen algorithms are kept between runs (none: only in memory).
    pub cache_file: Option<PathBuf>,
    /// Activation layout between the own path's layers.
    pub layout: ConvLayout,
    /// The most workspace one convolution's algorithm may use, in bytes.
    pub workspace_limit: usize,
    /// How the decoder's stride-2 transposed convolutions run.
    pub upsampling: Upsampling,
    /// What follows each convolution: the own epilogue kernel, cuDNN's fused call where
    /// timed faster, or separate operations.
    pub epilogue: Epilogue,
    /// Whether the 6-channel face and 1-channel mel inputs are padded to 8 channels.
    pub input_pad: InputPad,
    /// Whether the planned path's activations live in one arena per instance.
    pub arena: Arena,
}

impl Default for ConvSettings {
    /// The flags' defaults, chosen from the H100 comparisons of 2026-11-26 (docs/BENCHMARKS.md,
    /// "GPU (H100): the planned path against torch.compile"): `auto` upsampling and epilogue,
    /// inputs padded to 8 channels, the arena.
    fn default() -> Self {
        ConvSettings {
            engine: ConvEngine::Cudnn,
            cache_file: None,
            layout: ConvLayout::Nhwc,
            workspace_limit: DEFAULT_WORKSPACE_LIMIT,
            upsampling: Upsampling::Auto,
            epilogue: Epilogue::Auto,
            input_pad: InputPad::Eight,
            arena: Arena::On,
        }
    }
}

impl ConvSettings {
    /// Whether the forward pass runs as one planned graph ([`crate::model::netplan`]): the
    /// own or automatic epilogue in NHWC. The separate epilogue (and NCHW) runs layer by
    /// layer on candle's buffers.
    pub fn planned(&self) -> bool {
        self.epilogue != Epilogue::Separate && self.layout == ConvLayout::Nhwc
    }

    /// The settings an autotune cache file belongs to (with the GPU and cuDNN version): a
    /// file written under other settings is not reused.
    pub fn cache_identity(&self) -> String {
        format!(
            "workspace {} MiB / layout {} / upsampling {} / epilogue {} / input pad {} / arena {}",
            self.workspace_limit >> 20,
            self.layout.name(),
            self.upsampling.name(),
            self.epilogue.name(),
            self.input_pad.name(),
            self.arena.name()
        )
    }

    /// Why these settings cannot run, if they cannot: the own epilogue needs NHWC.
    pub fn check(&self) -> Result<(), String> {
        if self.epilogue == Epilogue::Own && self.layout != ConvLayout::Nhwc {
            return Err(
                "--conv-epilogue own needs --conv-layout nhwc (its kernels write \
                        channels-last activations)"
                    .into(),
            );
        }
        Ok(())
    }
}

/// How the own path runs the stride-2 transposed convolutions ([`crate::model::upsample`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Upsampling {
    /// Every form timed per layer and batch during warm-up; the fastest is kept (and stored
    /// in the autotune cache).
    Auto,
    /// One 3×3 forward convolution with four phases of output channels, then a pixel shuffle.
    Subpixel,
    /// One 2×2 forward convolution to the four phases, then a pixel shuffle.
    Subpixel2x2,
    /// Four phase convolutions (1×1, 1×2, 2×1, 2×2), interleaved by the epilogue.
    Phases,
    /// cuDNN's backward-data convolution.
    Transposed,
}

named_enum!(Upsampling, "an upsampling", {
    "auto" => Auto,
    "subpixel" => Subpixel,
    "subpixel2x2" => Subpixel2x2,
    "phases" => Phases,
    "transposed" => Transposed,
});

impl Upsampling {
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// The setting that runs one form.
    pub fn of(form: UpForm) -> Upsampling {
        match form {
            UpForm::Subpixel => Upsampling::Subpixel,
            UpForm::Subpixel2x2 => Upsampling::Subpixel2x2,
            UpForm::Phases => Upsampling::Phases,
            UpForm::Transposed => Upsampling::Transposed,
        }
    }

    /// The one form this setting runs (`None`: `auto`, chosen per layer).
    pub fn form(self) -> Option<UpForm> {
        match self {
            Upsampling::Auto => None,
            Upsampling::Subpixel => Some(UpForm::Subpixel),
            Upsampling::Subpixel2x2 => Some(UpForm::Subpixel2x2),
            Upsampling::Phases => Some(UpForm::Phases),
            Upsampling::Transposed => Some(UpForm::Transposed),
        }
    }
}

/// What runs after each convolution (`--conv-epilogue`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Epilogue {
    /// Per layer, cuDNN's fused call (bias + residual + ReLU inside the convolution) where it
    /// was timed faster than the convolution and the own kernel, else the own kernel.
    Auto,
    /// Every convolution followed by the own kernel: bias + ReLU (+ residual), the pixel
    /// shuffle, the write into its slice of the concatenation (with the skip feature), the
    /// output's sigmoid.
    Own,
    /// Layer by layer on candle's buffers: bias, ReLU, shuffle, concatenation and sigmoid as
    /// separate operations (or cuDNN's fused call where timed faster).
    Separate,
}

named_enum!(Epilogue, "an epilogue", { "auto" => Auto, "own" => Own, "separate" => Separate });

impl Epilogue {
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

/// Whether the first layers' inputs are padded to 8 channels (`--conv-input-pad`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum InputPad {
    /// Face (6 channels) and mel (1 channel) padded with zero channels to 8, so half-precision
    /// tensor-core NHWC kernels apply to the first layers.
    #[serde(rename = "8")]
    Eight,
    #[serde(rename = "none")]
    None,
}

named_enum!(InputPad, "an input padding", { "8" => Eight, "none" => None });

impl InputPad {
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// Channels of a `c`-channel input as the first layer reads it.
    pub fn channels(self, c: usize) -> usize {
        match self {
            InputPad::Eight => c.next_multiple_of(8),
            InputPad::None => c,
        }
    }
}

/// Whether the planned path's activations come from one arena (`--conv-arena`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arena {
    /// One device buffer per instance, every activation at its planned offset (a buffer is
    /// reused once its last reader has run).
    On,
    /// Each activation allocated when first written and freed after its last reader.
    Off,
}

named_enum!(Arena, "an arena setting", { "on" => On, "off" => Off });

impl Arena {
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

static SETTINGS: OnceLock<ConvSettings> = OnceLock::new();

/// Sets the convolution path for models created from now on (once per process; later calls
/// are ignored). Without a call: the flags' defaults ([`ConvSettings::default`]).
pub fn configure(settings: ConvSettings) {
    if let Err(settings) = SETTINGS.set(settings) {
        let set = SETTINGS.get().expect("set");
        if format!("{set:?}") != format!("{settings:?}") {
            tracing::warn!(
                "the convolution settings were already fixed ({set:?}); {settings:?} is ignored"
            );
        }
    }
}

pub fn settings() -> &'static ConvSettings {
    SETTINGS.get_or_init(ConvSettings::default)
}

/// Whether CUDA models use the own path.
pub fn enabled() -> bool {
    settings().engine == ConvEngine::Cudnn
}

named_enum!(ConvEngine, "a convolution engine", { "cudnn" => Cudnn, "candle" => Candle });

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_map_dimensions_both_ways() {
        let nchw = [2, 3, 5, 7];
        assert_eq!(ConvLayout::Nhwc.physical(nchw), [2, 5, 7, 3]);
        assert_eq!(ConvLayout::Nhwc.logical([2, 5, 7, 3]), nchw);
        assert_eq!(ConvLayout::Nchw.physical(nchw), nchw);
        assert_eq!(ConvLayout::Nchw.logical(nchw), nchw);
        assert_eq!(ConvLayout::Nchw.channel_axis(), 1);
        assert_eq!(ConvLayout::Nhwc.channel_axis(), 3);
        // The channel axis of the physical dimensions holds c.
        for layout in [ConvLayout::Nchw, ConvLayout::Nhwc] {
            assert_eq!(layout.physical(nchw)[layout.channel_axis()], 3);
        }
    }

    #[test]
    fn layout_and_upsampling_names_parse_and_others_do_not() {
        for name in ConvLayout::NAMES {
            let l: ConvLayout = name.parse().unwrap();
            assert_eq!(serde_json::to_value(l).unwrap(), *name);
        }
        for name in Upsampling::NAMES {
            let u: Upsampling = name.parse().unwrap();
            assert_eq!(serde_json::to_value(u).unwrap(), *name);
        }
        for name in Epilogue::NAMES {
            let e: Epilogue = name.parse().unwrap();
            assert_eq!(serde_json::to_value(e).unwrap(), *name);
            assert_eq!(e.name(), *name);
        }
        for name in InputPad::NAMES {
            let p: InputPad = name.parse().unwrap();
            assert_eq!(serde_json::to_value(p).unwrap(), *name);
        }
        for name in Arena::NAMES {
            let a: Arena = name.parse().unwrap();
            assert_eq!(serde_json::to_value(a).unwrap(), *name);
        }
        assert!("NCHWC".parse::<ConvLayout>().is_err());
        assert!("bilinear".parse::<Upsampling>().is_err());
        assert!("4".parse::<InputPad>().is_err());
        // Every form has its setting, and `auto` none.
        assert_eq!(Upsampling::Auto.form(), None);
        for u in Upsampling::NAMES.iter().skip(1) {
            let form = u.parse::<Upsampling>().unwrap().form().unwrap();
            assert_eq!(form.name(), *u);
        }
        assert_eq!(InputPad::Eight.channels(6), 8);
        assert_eq!(InputPad::Eight.channels(1), 8);
        assert_eq!(InputPad::None.channels(6), 6);
    }

    #[test]
    fn the_own_epilogue_needs_nhwc_and_every_flag_is_in_the_cache_identity() {
        let base = ConvSettings::default();
        assert!(base.check().is_ok());
        let nchw_own = ConvSettings {
            layout: ConvLayout::Nchw,
            epilogue: Epilogue::Own,
            ..base.clone()
        };
        assert!(nchw_own.check().unwrap_err().contains("nhwc"));
        assert!(!nchw_own.planned());
        let variants = [
            ConvSettings {
                upsampling: Upsampling::Phases,
                ..base.clone()
            },
            ConvSettings {
                epilogue: Epilogue::Own,
                ..base.clone()
            },
            ConvSettings {
                input_pad: InputPad::None,
                ..base.clone()
            },
            ConvSettings {
                arena: Arena::Off,
                ..base.clone()
            },
            ConvSettings {
                workspace_limit: 1 << 30,
                ..base.clone()
            },
            ConvSettings {
                layout: ConvLayout::Nchw,
                ..base.clone()
            },
        ];
        for v in &variants {
            assert_ne!(v.cache_identity(), base.cache_identity(), "{v:?}");
        }
        assert!(base.planned(), "the default is the planned path");
        assert!(!ConvSettings {
            epilogue: Epilogue::Separate,
            ..base
        }
        .planned());
    }
}
