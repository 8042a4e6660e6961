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

#[cfg(feature = "cuda")]
mod engine;
mod plan;
#[cfg(feature = "cuda")]
pub use candle_core::cuda_backend::cudarc::driver::CudaEvent;
#[cfg(feature = "cuda")]
pub use engine::{autotune_counts, ChoiceSource, CudnnEngine, LayerReport};
pub use plan::{fuse_decision, FuseTiming, FuseTimings, Fusion, PlanCache, PlanKey};
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
}

/// How the own path runs the stride-2 transposed convolutions ([`crate::model::subpixel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Upsampling {
    /// One forward convolution with four phases of output channels, then a pixel shuffle.
    Subpixel,
    /// cuDNN's backward-data convolution.
    Transposed,
}

named_enum!(Upsampling, "an upsampling", { "subpixel" => Subpixel, "transposed" => Transposed });

static SETTINGS: OnceLock<ConvSettings> = OnceLock::new();

/// Sets the convolution path for models created from now on (once per process; later calls
/// are ignored). Without a call: cuDNN, no cache file.
pub fn configure(settings: ConvSettings) {
    let _ = SETTINGS.set(settings);
}

pub fn settings() -> &'static ConvSettings {
    SETTINGS.get_or_init(|| ConvSettings {
        engine: ConvEngine::Cudnn,
        cache_file: None,
        layout: ConvLayout::Nhwc,
        workspace_limit: DEFAULT_WORKSPACE_LIMIT,
        upsampling: Upsampling::Subpixel,
    })
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
        assert!("NCHWC".parse::<ConvLayout>().is_err());
        assert!("bilinear".parse::<Upsampling>().is_err());
    }
}
