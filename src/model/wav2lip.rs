//! The Wav2Lip generator (`Rudrabha/Wav2Lip:models/wav2lip.py`), inference only, with every
//! BatchNorm folded into the convolution before it.

use std::collections::HashSet;

use candle_core::{DType, Device, Tensor};

use super::arch::{self, LayerKind, LayerSpec};
use super::cpu::CpuNet;
use super::cudnn::{ConvDims, ConvLayout, InputPad};
use super::upsample::{FormConv, UpForm};
use super::weights::GeneratorWeights;
use super::{Error, Result};

/// One convolution layer: `models/conv.py`'s `Conv2d` (conv + BN [+ residual] + ReLU) or
/// `Conv2dTranspose` (transposed conv + BN + ReLU) with BN folded, or the bare output
/// `nn.Conv2d`.
#[derive(Debug, Clone)]
pub struct ConvBlock {
    path: String,
    spec: LayerSpec,
    /// The convolution as cuDNN runs it: the spec's, or an upsampling form's (non-square
    /// kernels, padding on one axis), with the input channels the weight reads.
    dims: ConvDims,
    weight: Tensor,
    /// Shaped `(1, cout, 1, 1)` to broadcast over the output.
    bias: Tensor,
}

impl ConvBlock {
    fn load(
        path: &str,
        spec: LayerSpec,
        w: &GeneratorWeights,
        dev: &Device,
        dt: DType,
    ) -> Result<Self> {
        let prefix = spec.conv_prefix(path);
        let weight = w
            .get(&format!("{prefix}.weight"))?
            .to_dtype(dt)?
            .to_device(dev)?;
        let bias = w
            .get(&format!("{prefix}.bias"))?
            .reshape((1, spec.cout, 1, 1))?
            .to_dtype(dt)?
            .to_device(dev)?;
        Ok(ConvBlock {
            path: path.to_string(),
            dims: ConvDims::of(&spec),
            spec,
            weight,
            bias,
        })
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    pub fn spec(&self) -> &LayerSpec {
        &self.spec
    }

    /// A layer from its parts (tests build single layers this way). The input channels are
    /// the weight's.
    pub fn from_parts(path: &str, spec: LayerSpec, weight: Tensor, bias: Tensor) -> Self {
        let mut dims = ConvDims::of(&spec);
        if let [a, b, ..] = *weight.dims() {
            dims.cin = if dims.transposed { a } else { b };
        }
        ConvBlock {
            path: path.to_string(),
            spec,
            dims,
            weight,
            bias,
        }
    }

    /// Convolution `c` of an upsampling form of this (transposed) layer as a layer of its
    /// own: its weights and bias ([`upsample::form_parts`]), followed by ReLU. Its path is
    /// the layer's with the form and the convolution's number.
    pub fn form_part(
        &self,
        form: UpForm,
        i: usize,
        c: &FormConv,
        weight: Tensor,
        bias: Tensor,
    ) -> Self {
        ConvBlock {
            path: format!("{} {}.{i}", self.path, form.name()),
            spec: LayerSpec {
                kind: LayerKind::Conv,
                cin: self.spec.cin,
                cout: c.cout(self.spec.cout),
                kernel: c.kh.max(c.kw),
                stride: (1, 1),
                padding: c.ph.max(c.pw),
                output_padding: 0,
                residual: false,
            },
            dims: ConvDims::of_form(c, &self.spec).with_cin(self.dims.cin),
            weight,
            bias,
        }
    }

    /// This layer reading an input of `cin` channels, the channels beyond its own read by
    /// zero weights (`--conv-input-pad`).
    pub fn with_input_channels(&self, cin: usize) -> Result<Self> {
        if cin <= self.dims.cin || self.dims.transposed {
            return Ok(self.clone());
        }
        Ok(ConvBlock {
            dims: self.dims.with_cin(cin),
            weight: self.weight.pad_with_zeros(1, 0, cin - self.dims.cin)?,
            ..self.clone()
        })
    }

    /// This layer over `count` of its input channels from `first` (a split concatenation's
    /// part: the layer's result is the sum over the parts), without its bias's place changed.
    /// Its path names the slice.
    pub fn input_slice(&self, first: usize, count: usize) -> Result<Self> {
        if first == 0 && count == self.dims.cin {
            return Ok(self.clone());
        }
        let axis = usize::from(!self.dims.transposed);
        Ok(ConvBlock {
            path: format!("{} in[{first}+{count}]", self.path),
            dims: self.dims.with_cin(count),
            weight: self.weight.narrow(axis, first, count)?.contiguous()?,
            ..self.clone()
        })
    }

    /// The convolution as cuDNN runs it.
    pub fn dims(&self) -> &ConvDims {
        &self.dims
    }

    /// The (folded) convolution weight, PyTorch layout.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The (folded) bias, broadcastable over the output.
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    /// The convolution plus bias, before residual and activation.
    pub fn conv(&self, x: &Tensor) -> Result<Tensor> {
        let d = &self.dims;
        if d.kh == d.kw && d.pad.0 == d.pad.1 && d.kh == self.spec.kernel {
            return conv_layer(x, &self.weight, &self.bias, &self.spec);
        }
        // An upsampling form's convolution: stride 1, padding per axis.
        let x = x
            .pad_with_zeros(2, d.pad.0, d.pad.0)?
            .pad_with_zeros(3, d.pad.1, d.pad.1)?;
        let y = x.conv2d(&self.weight, 0, 1, 1, 1)?;
        Ok(y.broadcast_add(&self.bias.reshape((1, d.cout, 1, 1))?)?)
    }

    /// Residual add (after BN, before ReLU) and ReLU; the bare output conv has neither.
    pub fn activate(&self, y: Tensor, x: &Tensor) -> Result<Tensor> {
        Ok(match (self.spec.kind, self.spec.residual) {
            (LayerKind::Plain, _) => y,
            (_, true) => (y + x)?.relu()?,
            (_, false) => y.relu()?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.activate(self.conv(x)?, x)
    }
}

/// The convolution (or transposed convolution) of a layer plus its bias, which must broadcast
/// over the output (`(cout,)` or `(1, cout, 1, 1)`). Weights are in PyTorch layout.
pub fn conv_layer(x: &Tensor, weight: &Tensor, bias: &Tensor, s: &LayerSpec) -> Result<Tensor> {
    let y = match s.kind {
        LayerKind::ConvTranspose => {
            x.conv_transpose2d(weight, s.padding, s.output_padding, s.stride.0, 1)?
        }
        LayerKind::Conv | LayerKind::Plain if s.stride.0 == s.stride.1 => {
            x.conv2d(weight, s.padding, s.stride.0, 1, 1)?
        }
        LayerKind::Conv | LayerKind::Plain => conv2d_strided(x, weight, s)?,
    };
    let bias = bias.reshape((1, s.cout, 1, 1))?;
    Ok(y.broadcast_add(&bias)?)
}

/// A convolution with unequal strides `(sh, sw)`, which candle cannot express: the stride-1
/// convolution, keeping every `sh`-th row and `sw`-th column (`out[i, j] = full[i·sh, j·sw]`,
/// exact). Only the audio encoder's two small layers use it.
fn conv2d_strided(x: &Tensor, w: &Tensor, s: &LayerSpec) -> Result<Tensor> {
    let (_, _, h, wd) = x.dims4()?;
    let (sh, sw) = s.stride;
    let out_h = (h + 2 * s.padding - s.kernel) / sh + 1;
    let out_w = (wd + 2 * s.padding - s.kernel) / sw + 1;
    let full = x.conv2d(w, s.padding, 1, 1, 1)?;
    let pick = |t: Tensor, dim: usize, step: usize, n: usize| -> Result<Tensor> {
        if step == 1 {
            return Ok(t);
        }
        let idx = Tensor::arange_step(0u32, (n * step) as u32, step as u32, t.device())?;
        Ok(t.index_select(&idx, dim)?)
    };
    let rows = pick(full, 2, sh, out_h)?;
    pick(rows, 3, sw, out_w)
}

/// Least agreement (PSNR of faces in 0–1) with an exact f32 reference (no TF32) that the own
/// convolution path must show at start-up, per dtype; the own path must also be no more than
/// [`CONV_CHECK_MARGIN_DB`] worse than candle's operations on the same reference. A wrong layer
/// gives 10–25 dB. Set from an H200 (2026-11-26, `tests/gpu.rs` and the start-up checks of
/// `lipsync bench`, random weights, batches 2 to 512): the own path measured 102.6–109.1 dB in
/// f32, 48.9–54.7 dB in f16 and 32.0–35.1 dB in bf16 (PyTorch's bf16 against its own f32:
/// 32.5 dB); each floor leaves room for real weights and other GPUs below the least measured.
pub const CUDNN_CHECK_MIN_PSNR_F32: f64 = 80.0;
/// See [`CUDNN_CHECK_MIN_PSNR_F32`].
pub const CUDNN_CHECK_MIN_PSNR_F16: f64 = 40.0;
/// See [`CUDNN_CHECK_MIN_PSNR_F32`].
pub const CUDNN_CHECK_MIN_PSNR_BF16: f64 = 28.0;
/// How much less accurate than candle's operations the own path may be (dB).
pub const CONV_CHECK_MARGIN_DB: f64 = 1.0;

/// The start-up floor for `dtype` (see [`CUDNN_CHECK_MIN_PSNR_F32`]).
pub fn cudnn_check_floor(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => CUDNN_CHECK_MIN_PSNR_F16,
        DType::BF16 => CUDNN_CHECK_MIN_PSNR_BF16,
        _ => CUDNN_CHECK_MIN_PSNR_F32,
    }
}

/// Whether the own path may serve: its PSNR against the exact reference is a number, at least
/// `floor`, and at least candle's (when measured and a number) minus `margin`.
pub fn accept_own_path(own: f64, candle: Option<f64>, floor: f64, margin: f64) -> bool {
    if own.is_nan() || own < floor {
        return false;
    }
    match candle {
        Some(c) if !c.is_nan() => own >= c - margin,
        _ => true,
    }
}

/// One start-up comparison of the own convolution path ([`Wav2Lip::check_conv_path`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PathCheck {
    pub batch: usize,
    /// The own path against the exact f32 reference (dB; NaN if it failed or gave NaN).
    pub own_psnr: f64,
    /// candle's operations against the same reference (on CUDA only).
    pub candle_psnr: Option<f64>,
    pub floor: f64,
    pub accepted: bool,
}

/// The generator. Inputs: mel windows `(N, 1, 80, 16)` and faces `(N, 6, 96, 96)` (masked
/// and reference crop, BGR, in [0, 1]); output `(N, 3, 96, 96)` in (0, 1), BGR.
#[derive(Debug, Clone)]
pub struct Wav2Lip {
    face_encoder_blocks: Vec<Vec<ConvBlock>>,
    audio_encoder: Vec<ConvBlock>,
    face_decoder_blocks: Vec<Vec<ConvBlock>>,
    output_block: Vec<ConvBlock>,
    /// The same layers for the own CPU pass (f32 on the CPU only).
    cpu: Option<CpuNet>,
    /// The own cuDNN convolution path (CUDA with `--conv-engine cudnn`).
    #[cfg(feature = "cuda")]
    cudnn: Option<std::sync::Arc<super::cudnn::CudnnEngine>>,
    /// The planned pass over it (`--conv-epilogue own|auto` in NHWC).
    #[cfg(feature = "cuda")]
    planned: Option<std::sync::Arc<super::cudnn::PlannedNet>>,
    /// Layers whose output [`Self::forward_guarded`] checks for overflow (none until
    /// [`Self::check_overflow`]).
    overflow: OverflowChecks,
    device: Device,
    dtype: DType,
}

impl Wav2Lip {
    /// Builds the model on `device` computing in `dtype`, folding BatchNorm first if the
    /// weights are not folded yet.
    pub fn load(weights: &GeneratorWeights, device: &Device, dtype: DType) -> Result<Self> {
        let folded;
        let w = if weights.is_folded() {
            weights
        } else {
            folded = weights.fold()?;
            &folded
        };
        let seq = |prefix: &str, specs: &[LayerSpec]| -> Result<Vec<ConvBlock>> {
            specs
                .iter()
                .enumerate()
                .map(|(i, spec)| ConvBlock::load(&format!("{prefix}.{i}"), *spec, w, device, dtype))
                .collect()
        };
        let blocks = |name: &str, table: &[&[LayerSpec]]| -> Result<Vec<Vec<ConvBlock>>> {
            table
                .iter()
                .enumerate()
                .map(|(b, block)| seq(&format!("{name}.{b}"), block))
                .collect()
        };
        let face_encoder_blocks = blocks("face_encoder_blocks", arch::FACE_ENCODER_BLOCKS)?;
        let audio_encoder = seq("audio_encoder", arch::AUDIO_ENCODER)?;
        let face_decoder_blocks = blocks("face_decoder_blocks", arch::FACE_DECODER_BLOCKS)?;
        let output_block = seq("output_block", arch::OUTPUT_BLOCK)?;
        let cpu = if device.is_cpu() && dtype == DType::F32 {
            Some(CpuNet::new(
                &face_encoder_blocks,
                &audio_encoder,
                &face_decoder_blocks,
                &output_block,
            )?)
        } else {
            None
        };
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut model = Wav2Lip {
            face_encoder_blocks,
            audio_encoder,
            face_decoder_blocks,
            output_block,
            cpu,
            #[cfg(feature = "cuda")]
            cudnn: None,
            #[cfg(feature = "cuda")]
            planned: None,
            overflow: OverflowChecks::default(),
            device: device.clone(),
            dtype,
        };
        #[cfg(feature = "cuda")]
        if super::cudnn::enabled() {
            if let Err(e) = model.use_conv_settings(super::cudnn::settings().clone()) {
                tracing::warn!("cuDNN path unavailable ({e}); using candle's operations");
                model.use_candle_operations();
            }
        }
        Ok(model)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Which convolution path `forward` takes: `cpu` (own CPU pass), `cudnn` (own cuDNN
    /// calls) or `candle` (candle's operations).
    pub fn conv_engine(&self) -> &'static str {
        #[cfg(feature = "cuda")]
        if self.cudnn.is_some() {
            return "cudnn";
        }
        if self.cpu.is_some() {
            "cpu"
        } else {
            "candle"
        }
    }

    /// Checks the own path on a deterministic test batch of `n` against an exact f32
    /// reference and returns its PSNR in dB (faces in 0–1; infinite when identical). See
    /// [`Self::check_conv_path`], which this wraps.
    pub fn check_conv_engine(&mut self, n: usize, min_psnr: f64) -> Result<f64> {
        Ok(self.check_conv_path(n, min_psnr)?.own_psnr)
    }

    /// Compares the own path and (on CUDA) candle's operations with an exact f32 reference
    /// computed without TF32 on a deterministic batch of `n`. On CUDA the reference is the own
    /// f32 CPU pass ([`super::cpu`]) on the model's weights, for the first, middle and last
    /// frame of the batch (frames do not interact, and the batch size matters: cuDNN picks
    /// algorithms per batch size); on the CPU it is candle's f32 operations on every frame.
    /// When the own path fails, or [`accept_own_path`] refuses its figure (`floor` and
    /// [`CONV_CHECK_MARGIN_DB`]), the model switches to candle's operations with a warning, so
    /// a broken fast path never serves wrong faces.
    pub fn check_conv_path(&mut self, n: usize, floor: f64) -> Result<PathCheck> {
        use arch::{FACE_CHANNELS, FACE_SIZE, MEL_BINS, MEL_STEPS};
        let engine = self.conv_engine();
        if engine == "candle" {
            return Ok(PathCheck {
                batch: n,
                own_psnr: f64::INFINITY,
                candle_psnr: None,
                floor,
                accepted: true,
            });
        }
        if n == 0 {
            return Err(Error::BadInput("empty check batch".into()));
        }
        // A smooth, deterministic input in the ranges the model sees (every frame differs).
        let wave = |len: usize, scale: f32, shift: f32| -> Vec<f32> {
            (0..len)
                .map(|i| shift + scale * ((i as f32) * 0.37).sin() * ((i as f32) * 0.011).cos())
                .collect()
        };
        let (mel_len, face_len) = (MEL_BINS * MEL_STEPS, FACE_CHANNELS * FACE_SIZE * FACE_SIZE);
        let mel_v = wave(n * mel_len, 4.0, 0.0);
        let face_v = wave(n * face_len, 0.5, 0.5);
        let mel = Tensor::from_vec(mel_v.clone(), (n, 1, MEL_BINS, MEL_STEPS), &self.device)?;
        let face = Tensor::from_vec(
            face_v.clone(),
            (n, FACE_CHANNELS, FACE_SIZE, FACE_SIZE),
            &self.device,
        )?;
        let on_cpu = self.cpu.is_some();
        let rows: Vec<usize> = if on_cpu {
            (0..n).collect()
        } else {
            let mut r = vec![0, n / 2, n - 1];
            r.dedup();
            r
        };
        let reference = if on_cpu {
            self.forward_candle(&mel, &face)?.to_dtype(DType::F32)?
        } else {
            let net = self.cpu_reference()?;
            let pick = |v: &[f32], len: usize| -> Vec<f32> {
                rows.iter()
                    .flat_map(|&r| v[r * len..(r + 1) * len].iter().copied())
                    .collect()
            };
            let out = net.forward(&pick(&mel_v, mel_len), &pick(&face_v, face_len), rows.len());
            Tensor::from_vec(out, (rows.len(), 3, FACE_SIZE, FACE_SIZE), &Device::Cpu)?
        };
        let index = Tensor::from_vec(
            rows.iter().map(|&r| r as u32).collect::<Vec<_>>(),
            rows.len(),
            &Device::Cpu,
        )?;
        let take = |t: Tensor| -> Result<Tensor> {
            Ok(t.to_device(&Device::Cpu)?
                .to_dtype(DType::F32)?
                .index_select(&index, 0)?)
        };
        let candle_psnr = if on_cpu {
            None
        } else {
            Some(match self.forward_candle(&mel, &face) {
                Ok(y) => face_psnr(&take(y)?, &reference)?,
                Err(e) => {
                    tracing::warn!("candle's operations failed in the start-up check: {e}");
                    f64::NAN
                }
            })
        };
        let own_psnr = match self.forward(&mel, &face) {
            Ok(y) => face_psnr(&take(y)?, &reference)?,
            Err(e) => {
                tracing::warn!(
                    "the {engine} convolution path failed at batch {n} ({e}); using candle's \
                     operations"
                );
                self.use_candle_operations();
                return Ok(PathCheck {
                    batch: n,
                    own_psnr: f64::NAN,
                    candle_psnr,
                    floor,
                    accepted: false,
                });
            }
        };
        let accepted = accept_own_path(own_psnr, candle_psnr, floor, CONV_CHECK_MARGIN_DB);
        let candle_text = candle_psnr.map_or(String::new(), |c| format!(", candle's {c:.1} dB"));
        if accepted {
            tracing::info!(
                "{:?} model, batch {n}: {engine} convolutions {own_psnr:.1} dB from the exact \
                 f32 reference{candle_text} (at least {floor} dB wanted)",
                self.dtype
            );
        } else {
            tracing::warn!(
                "{:?} model, batch {n}: the {engine} convolution path is {own_psnr:.1} dB from \
                 the exact f32 reference{candle_text} (at least {floor} dB, and no more than \
                 {CONV_CHECK_MARGIN_DB} dB below candle's, wanted); using candle's operations",
                self.dtype
            );
            self.use_candle_operations();
        }
        Ok(PathCheck {
            batch: n,
            own_psnr,
            candle_psnr,
            floor,
            accepted,
        })
    }

    /// The own f32 CPU pass on this model's weights (as stored, so f16/bf16 rounding of the
    /// weights is shared with the paths under test and only their arithmetic is compared).
    fn cpu_reference(&self) -> Result<CpuNet> {
        let to_cpu = |b: &ConvBlock| -> Result<ConvBlock> {
            Ok(ConvBlock::from_parts(
                &b.path,
                b.spec,
                b.weight.to_device(&Device::Cpu)?.to_dtype(DType::F32)?,
                b.bias.to_device(&Device::Cpu)?.to_dtype(DType::F32)?,
            ))
        };
        let seq = |bs: &[ConvBlock]| bs.iter().map(to_cpu).collect::<Result<Vec<_>>>();
        let blocks = |bs: &[Vec<ConvBlock>]| bs.iter().map(|b| seq(b)).collect::<Result<Vec<_>>>();
        CpuNet::new(
            &blocks(&self.face_encoder_blocks)?,
            &seq(&self.audio_encoder)?,
            &blocks(&self.face_decoder_blocks)?,
            &seq(&self.output_block)?,
        )
    }

    /// On the cuDNN path, [`Self::check_conv_path`] at batch 2 with the floor of the model's
    /// dtype ([`cudnn_check_floor`]); the own path's PSNR, or `None` on other paths. Prefer
    /// [`Self::verify_cudnn_path_at`] with the largest batch the caller will run.
    pub fn verify_cudnn_path(&mut self) -> Result<Option<f64>> {
        self.verify_cudnn_path_at(2)
    }

    /// On the cuDNN path, [`Self::check_conv_path`] at batch 2 and at `max_batch` (cuDNN
    /// picks algorithms per batch size, and FFT/Winograd differ in accuracy; never above
    /// `max_batch`, which may be 1 where memory is tight), with the floor of the model's
    /// dtype; the own path's lowest PSNR, or `None` on other paths. A failed check leaves the
    /// model on candle's operations.
    pub fn verify_cudnn_path_at(&mut self, max_batch: usize) -> Result<Option<f64>> {
        if self.conv_engine() != "cudnn" {
            return Ok(None);
        }
        let floor = cudnn_check_floor(self.dtype);
        let max_batch = max_batch.max(1);
        let mut batches = vec![2.min(max_batch), max_batch];
        batches.dedup();
        let mut worst = f64::INFINITY;
        for n in batches {
            let check = self.check_conv_path(n, floor)?;
            worst = worst.min(check.own_psnr);
            if !check.accepted {
                return Ok(Some(check.own_psnr));
            }
        }
        Ok(Some(worst))
    }

    /// Ends the warm-up of the cuDNN path (see [`super::cudnn::CudnnEngine::finish_warm_up`]):
    /// batch sizes first seen after this take cuDNN's heuristic algorithm instead of a search
    /// in the middle of a request, the search workspace is freed and the autotune cache file
    /// is written. Call it once the instance has run every batch size it pads to. Nothing on
    /// other paths.
    pub fn finish_warm_up(&self) {
        #[cfg(feature = "cuda")]
        if let Some(engine) = &self.cudnn {
            engine.finish_warm_up();
        }
        #[cfg(feature = "cuda")]
        if let Some(planned) = &self.planned {
            planned.finish_warm_up();
        }
    }

    /// `--conv-upsampling auto`'s choices the process knows (empty on other paths).
    #[cfg(feature = "cuda")]
    pub fn cudnn_form_choices(
        &self,
    ) -> std::collections::BTreeMap<String, super::cudnn::FormChoice> {
        self.cudnn
            .as_ref()
            .map_or_else(Default::default, |e| e.form_choices())
    }

    /// What the cuDNN path runs for each layer and input shape so far (empty on other paths).
    #[cfg(feature = "cuda")]
    pub fn cudnn_report(&self) -> Vec<super::cudnn::LayerReport> {
        self.cudnn.as_ref().map_or(Vec::new(), |e| e.report())
    }

    /// Runs the own cuDNN path with its activations in `layout` from now on (a new engine:
    /// plans are made again; the process's timed choices are kept). Nothing on other paths.
    #[cfg(feature = "cuda")]
    pub fn use_conv_layout(&mut self, layout: ConvLayout) -> Result<()> {
        if let Some(engine) = &self.cudnn {
            if engine.layout() != layout {
                let settings = super::cudnn::ConvSettings {
                    layout,
                    ..engine.settings().clone()
                };
                self.use_conv_settings(settings)?;
            }
        }
        Ok(())
    }

    /// Runs the own cuDNN path with `settings` from now on (a new engine, and a planned pass
    /// where the settings ask for one; the process's timed choices are kept). On the CPU
    /// nothing changes.
    #[cfg(feature = "cuda")]
    pub fn use_conv_settings(&mut self, settings: super::cudnn::ConvSettings) -> Result<()> {
        let Device::Cuda(dev) = &self.device else {
            return Ok(());
        };
        let planned = settings.planned();
        let engine = std::sync::Arc::new(super::cudnn::CudnnEngine::with_settings(
            dev, self.dtype, settings,
        )?);
        self.planned = if planned {
            Some(std::sync::Arc::new(super::cudnn::PlannedNet::new(
                engine.clone(),
            )?))
        } else {
            None
        };
        self.cudnn = Some(engine);
        Ok(())
    }

    /// The planned pass's graph at batch `n`, when the model runs one (for reports).
    #[cfg(feature = "cuda")]
    pub fn planned_graph(&self, n: usize) -> Result<Option<std::sync::Arc<super::netplan::Graph>>> {
        match &self.planned {
            Some(p) => Ok(Some(p.graph_for(self, n)?)),
            None => Ok(None),
        }
    }

    /// Runs candle's operations from now on (the reference path).
    pub fn use_candle_operations(&mut self) {
        self.cpu = None;
        #[cfg(feature = "cuda")]
        {
            self.cudnn = None;
            self.planned = None;
        }
    }

    /// Predicts faces for a batch. Inputs may be any float dtype and device; the output is on
    /// the model's device in its dtype. f32 on the CPU runs the own CPU pass
    /// ([`super::cpu`]); everything else candle's operations.
    pub fn forward(&self, mel: &Tensor, face: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(planned) = &self.planned {
            check_inputs(mel, face)?;
            let none = HashSet::new();
            return Ok(planned.forward(self, mel, face, &none, false)?.faces);
        }
        #[cfg(feature = "cuda")]
        if let Some(engine) = &self.cudnn {
            return self.forward_own(engine, mel, face, &mut |block, x| engine.forward(block, x));
        }
        let Some(net) = &self.cpu else {
            return self.forward_candle(mel, face);
        };
        let n = check_inputs(mel, face)?;
        let flat = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.to_device(&Device::Cpu)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1()?)
        };
        let (mel, face) = (flat(mel)?, flat(face)?);
        let _span = tracing::trace_span!("cpu_forward", n).entered();
        let out = net.forward(&mel, &face, n);
        Ok(Tensor::from_vec(
            out,
            (n, 3, arch::FACE_SIZE, arch::FACE_SIZE),
            &self.device,
        )?)
    }

    /// One forward pass on the own cuDNN path with CUDA events around every layer, for
    /// `lipsync bench --sections layers`: each layer's time and the whole pass's (from the
    /// first layer's inputs, already on the device, to the faces: the difference is the
    /// concatenations, layout conversions and sigmoid). `None` without the own path.
    #[cfg(feature = "cuda")]
    pub fn profile_layers(&self, mel: &Tensor, face: &Tensor) -> Result<Option<LayerProfile>> {
        if let Some(planned) = &self.planned {
            check_inputs(mel, face)?;
            let none = HashSet::new();
            return Ok(planned.forward(self, mel, face, &none, true)?.profile);
        }
        let Some(engine) = &self.cudnn else {
            return Ok(None);
        };
        let layout = engine.layout();
        let mut marks = Vec::new();
        let start = engine.mark()?;
        let y = self.forward_own(engine, mel, face, &mut |b, x| {
            let (d0, d1, d2, d3) = x.dims4()?;
            let before = engine.mark()?;
            let y = engine.forward(b, x)?;
            marks.push((
                b.path.clone(),
                layout.logical([d0, d1, d2, d3]),
                before,
                engine.mark()?,
            ));
            Ok(y)
        })?;
        let end = engine.mark()?;
        let ms = |a: &super::cudnn::CudaEvent, b: &super::cudnn::CudaEvent| -> Result<f32> {
            Ok(a.elapsed_ms(b).map_err(candle_core::Error::from)?)
        };
        let total_ms = ms(&start, &end)?;
        drop(y);
        let layers = marks
            .iter()
            .map(|(path, input, a, b)| {
                Ok(LayerTime {
                    path: path.clone(),
                    input: *input,
                    ms: ms(a, b)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(LayerProfile { layers, total_ms }))
    }

    /// The layer at `path` (`face_encoder_blocks.1.0`, `output_block.1`, ...).
    pub fn layer(&self, path: &str) -> Option<&ConvBlock> {
        self.face_encoder_blocks
            .iter()
            .flatten()
            .chain(&self.audio_encoder)
            .chain(self.face_decoder_blocks.iter().flatten())
            .chain(&self.output_block)
            .find(|b| b.path == path)
    }

    /// Checks the layers [`layers_at_risk`] names for `ranges` in the model's dtype in
    /// [`Self::forward_guarded`] (nothing in f32). See the section on half-precision overflow
    /// above [`OVERFLOW_HEADROOM`].
    pub fn check_overflow(&mut self, ranges: &ActivationRanges) {
        self.overflow = OverflowChecks {
            layers: layers_at_risk(ranges, self.dtype).into_iter().collect(),
        };
    }

    /// The layers [`Self::forward_guarded`] checks, in forward order.
    pub fn checked_layers(&self) -> Vec<&str> {
        self.audio_encoder
            .iter()
            .chain(self.face_encoder_blocks.iter().flatten())
            .chain(self.face_decoder_blocks.iter().flatten())
            .chain(&self.output_block)
            .filter(|b| self.overflow.layers.contains(&b.path))
            .map(|b| b.path.as_str())
            .collect()
    }

    /// [`Self::forward`], and whether the batch overflowed: the largest absolute value of each
    /// checked layer's output ([`Self::check_overflow`]) is reduced on the device to one
    /// scalar, the scalars of a batch come to the host together once the pass is queued, and
    /// [`overflow_suspected`] decides. Without checked layers this is `forward` and `false`.
    pub fn forward_guarded(&self, mel: &Tensor, face: &Tensor) -> Result<(Tensor, bool)> {
        let (y, maxima) = self.forward_checked(mel, face)?;
        let overflow = match maxima {
            Some(m) => overflow_suspected(&m.to_dtype(DType::F32)?.to_vec1()?, self.dtype),
            None => false,
        };
        Ok((y, overflow))
    }

    /// [`Self::forward_guarded`] with the faces on the host (f32, `n * 3 * 96 * 96` values):
    /// the faces and the checked layers' maxima come back in one copy, so a batch waits for
    /// the device once.
    pub fn forward_guarded_to_host(&self, mel: &Tensor, face: &Tensor) -> Result<(Vec<f32>, bool)> {
        let (y, maxima) = self.forward_checked(mel, face)?;
        let faces = y.to_dtype(DType::F32)?.flatten_all()?;
        let Some(maxima) = maxima else {
            return Ok((faces.to_vec1()?, false));
        };
        let k = maxima.dim(0)?;
        let mut all: Vec<f32> =
            Tensor::cat(&[&faces, &maxima.to_dtype(DType::F32)?], 0)?.to_vec1()?;
        let overflow = overflow_suspected(&all[all.len() - k..], self.dtype);
        all.truncate(all.len() - k);
        Ok((all, overflow))
    }

    /// The forward pass and, where layers are checked, their largest absolute values stacked
    /// on the device (not copied yet).
    fn forward_checked(&self, mel: &Tensor, face: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        if self.overflow.layers.is_empty() || self.cpu.is_some() {
            return Ok((self.forward(mel, face)?, None));
        }
        let mut maxima: Vec<Tensor> = Vec::new();
        let mut checked = |block: &ConvBlock, y: Tensor| -> Result<Tensor> {
            if self.overflow.layers.contains(&block.path) {
                maxima.push(max_abs_on_device(&y, block.spec.kind == LayerKind::Plain)?);
            }
            Ok(y)
        };
        #[cfg(feature = "cuda")]
        if let Some(planned) = &self.planned {
            check_inputs(mel, face)?;
            let out = planned.forward(self, mel, face, &self.overflow.layers, false)?;
            return Ok((out.faces, out.maxima));
        }
        #[cfg(feature = "cuda")]
        let y = if let Some(engine) = &self.cudnn {
            self.forward_own(engine, mel, face, &mut |b, x| {
                checked(b, engine.forward(b, x)?)
            })?
        } else {
            self.forward_with(mel, face, &mut |b, x| checked(b, b.forward(x)?))?
        };
        #[cfg(not(feature = "cuda"))]
        let y = self.forward_with(mel, face, &mut |b, x| checked(b, b.forward(x)?))?;
        if maxima.is_empty() {
            return Ok((y, None));
        }
        Ok((y, Some(Tensor::stack(&maxima, 0)?)))
    }

    /// The forward pass in candle's operations on any device (the reference for the CPU
    /// pass, and the pass on CUDA).
    pub fn forward_candle(&self, mel: &Tensor, face: &Tensor) -> Result<Tensor> {
        self.forward_with(mel, face, &mut |block, x| block.forward(x))
    }

    /// The forward pass with every layer applied through `layer(block, input)`; `forward` uses
    /// `ConvBlock::forward`, random initialisation uses it to calibrate BatchNorm statistics.
    pub fn forward_with(
        &self,
        mel: &Tensor,
        face: &Tensor,
        layer: &mut dyn FnMut(&ConvBlock, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.forward_in(ConvLayout::Nchw, InputPad::None, mel, face, layer)
    }

    /// The layer-by-layer pass of the own cuDNN path: in its layout, its inputs padded as
    /// its settings say.
    #[cfg(feature = "cuda")]
    fn forward_own(
        &self,
        engine: &super::cudnn::CudnnEngine,
        mel: &Tensor,
        face: &Tensor,
        layer: &mut dyn FnMut(&ConvBlock, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let s = engine.settings();
        self.forward_in(s.layout, s.input_pad, mel, face, layer)
    }

    /// [`Self::forward_with`] with the activations between layers in `layout`: inputs and
    /// output are NCHW; in NHWC the inputs are converted once, `layer` takes and returns NHWC
    /// activations, skips are concatenated on the last axis and the output converted back.
    fn forward_in(
        &self,
        layout: ConvLayout,
        pad: InputPad,
        mel: &Tensor,
        face: &Tensor,
        layer: &mut dyn FnMut(&ConvBlock, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let n = check_inputs(mel, face)?;
        let to_layout = |t: &Tensor| -> Result<Tensor> {
            let t = t.to_device(&self.device)?.to_dtype(self.dtype)?;
            // Zero channels up to the padded count (`--conv-input-pad 8`): the first layers
            // read them with zero weights ([`ConvBlock::with_input_channels`]).
            let c = t.dim(1)?;
            let t = match pad.channels(c) {
                p if p > c => t.pad_with_zeros(1, 0, p - c)?,
                _ => t,
            };
            Ok(layout.from_nchw(&t)?)
        };
        let (mel, face) = (to_layout(mel)?, to_layout(face)?);
        let mut run = |blocks: &[ConvBlock], x: Tensor| -> Result<Tensor> {
            blocks.iter().try_fold(x, |x, b| layer(b, &x))
        };

        let audio = {
            let _span = tracing::trace_span!("audio_encoder", n).entered();
            run(&self.audio_encoder, mel)?
        };
        let mut feats = Vec::with_capacity(self.face_encoder_blocks.len());
        let mut x = face;
        {
            let _span = tracing::trace_span!("face_encoder", n).entered();
            for block in &self.face_encoder_blocks {
                x = run(block, x)?;
                feats.push(x.clone());
            }
        }
        // The decoder starts from the audio embedding; after each block the matching encoder
        // feature map is appended on the channel axis (decoder output first).
        let mut x = audio;
        {
            let _span = tracing::trace_span!("face_decoder", n).entered();
            for block in &self.face_decoder_blocks {
                x = run(block, x)?;
                let skip = feats
                    .pop()
                    .ok_or_else(|| Error::BadInput("decoder deeper than encoder".into()))?;
                x = Tensor::cat(&[&x, &skip], layout.channel_axis())?;
            }
        }
        let _span = tracing::trace_span!("output_block", n).entered();
        let x = run(&self.output_block, x)?;
        Ok(candle_nn::ops::sigmoid(&layout.to_nchw(&x)?)?)
    }
}

/// One layer's time in a profiled forward pass ([`Wav2Lip::profile_layers`]).
#[derive(Debug, Clone)]
pub struct LayerTime {
    pub path: String,
    /// `(n, c, h, w)` of the layer's input.
    pub input: [usize; 4],
    pub ms: f32,
}

/// Every layer's time in one forward pass and the whole pass's.
#[derive(Debug, Clone)]
pub struct LayerProfile {
    pub layers: Vec<LayerTime>,
    pub total_ms: f32,
}

// ---------------------------------------------------------------------------------------------
// Half-precision overflow.
//
// In f16 a value above 65504 becomes infinity. The next convolution then sums `inf·w` terms of
// both signs, `inf − inf = NaN`, and the ReLU after it (cuDNN's fused ReLU with
// `CUDNN_NOT_PROPAGATE_NAN`, candle's `relu`) turns NaN into 0: a few layers later every value
// is finite again, the sigmoid draws a face, and a check of the output for NaN sees nothing
// while the face is wrong. An overflow is only visible at the layer that produced it, as a
// `+inf` (or a value near the dtype's limit) in that layer's output: a ReLU keeps `+inf`,
// and an overflow to `−inf` is harmless (the ReLU gives 0, as it would for the true value).
//
// Reducing every layer's output at run time would read all activations once more (about a
// third of a batch's memory traffic). Instead the checkpoint is run once in f32 on
// calibration inputs spanning the inputs' range ([`ActivationRanges::measure`]), and only the
// layers whose largest activation comes within [`OVERFLOW_HEADROOM`] of the half dtype's
// largest finite value are checked, plus always the output layer (the sigmoid's input, 3
// channels: cheap). A checked layer costs one device reduction to a scalar per batch, and the
// scalars of a batch come to the host together; a batch is suspect when a checked maximum is
// not finite or has reached the dtype's largest finite value ([`overflow_suspected`]). Large
// but finite values are not suspect: a checkpoint may legitimately run close to f16's range
// (the test checkpoint's decoder reaches 35 000), and every layer that could overflow next is
// itself checked. An unchecked layer would need activations 64 times larger than any
// calibration input produced to overflow; inputs are bounded (faces in [0, 1], mel windows in
// [−4, 4]), so that is not expected, and the output's NaN check stays as a second net.
// `lipsync init-weights` weights stay below 200 everywhere, so only their output is checked;
// bf16 has f32's range, so in practice only its output is checked too.
// ---------------------------------------------------------------------------------------------

/// A layer is checked for overflow at run time when its largest calibrated activation times
/// this reaches the half dtype's largest finite value (f16: 65504 / 64 = 1023.5).
pub const OVERFLOW_HEADROOM: f64 = 64.0;

/// Frames in the calibration batch of [`ActivationRanges::measure`].
const CALIBRATION_FRAMES: usize = 4;

/// The largest finite value of a float dtype (f16 65504, bf16 about 3.39e38).
pub fn finite_max(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => f64::from(half::f16::MAX),
        DType::BF16 => f64::from(half::bf16::MAX),
        DType::F64 => f64::MAX,
        _ => f64::from(f32::MAX),
    }
}

/// One layer's largest absolute activation (its output after bias, residual and ReLU).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerRange {
    pub path: String,
    pub kind: LayerKind,
    pub max_abs: f32,
}

/// Every layer's largest absolute activation, in forward order, measured in f32.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ActivationRanges {
    pub layers: Vec<LayerRange>,
}

impl ActivationRanges {
    /// Runs the weights in f32 on the CPU (the own pass) on [`CALIBRATION_FRAMES`]
    /// calibration frames and records each layer's largest absolute activation. The frames
    /// span the inputs' range: a smooth pattern, the brightest face with the loudest mel, the
    /// darkest with the quietest, and uniform noise (edges everywhere).
    pub fn measure(weights: &GeneratorWeights) -> Result<Self> {
        let model = Wav2Lip::load(weights, &Device::Cpu, DType::F32)?;
        let net = model
            .cpu
            .as_ref()
            .ok_or_else(|| Error::BadInput("no CPU pass for the calibration".into()))?;
        let (mel, face) = calibration_inputs();
        let mut layers: Vec<LayerRange> = Vec::new();
        net.forward_observed(&mel, &face, CALIBRATION_FRAMES, &mut |path, values| {
            let max_abs = values.iter().fold(0f32, |m, v| {
                if v.is_finite() {
                    m.max(v.abs())
                } else {
                    f32::INFINITY
                }
            });
            layers.push(LayerRange {
                path: path.to_string(),
                kind: model.layer(path).map_or(LayerKind::Conv, |b| b.spec.kind),
                max_abs,
            });
        });
        Ok(ActivationRanges { layers })
    }
}

/// The calibration batch of [`ActivationRanges::measure`] (mel windows, faces; NCHW).
fn calibration_inputs() -> (Vec<f32>, Vec<f32>) {
    use arch::{FACE_CHANNELS, FACE_SIZE, MEL_BINS, MEL_STEPS};
    let (mel_len, face_len) = (MEL_BINS * MEL_STEPS, FACE_CHANNELS * FACE_SIZE * FACE_SIZE);
    let mut mel = Vec::with_capacity(CALIBRATION_FRAMES * mel_len);
    let mut face = Vec::with_capacity(CALIBRATION_FRAMES * face_len);
    // Smooth.
    let wave = |i: usize| ((i as f32) * 0.37).sin() * ((i as f32) * 0.011).cos();
    mel.extend((0..mel_len).map(|i| 4.0 * wave(i)));
    face.extend((0..face_len).map(|i| 0.5 + 0.5 * wave(i)));
    // Extremes.
    mel.extend(std::iter::repeat_n(4.0, mel_len));
    face.extend(std::iter::repeat_n(1.0, face_len));
    mel.extend(std::iter::repeat_n(-4.0, mel_len));
    face.extend(std::iter::repeat_n(0.0, face_len));
    // Noise (a fixed xorshift sequence).
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut unit = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    mel.extend((0..mel_len).map(|_| 8.0 * unit() - 4.0));
    face.extend((0..face_len).map(|_| unit()));
    (mel, face)
}

/// The layers to check for overflow at run time in `dtype`: the output layer (the sigmoid's
/// input) always, and every layer whose calibrated maximum times [`OVERFLOW_HEADROOM`]
/// reaches the dtype's largest finite value, or is not finite. None in f32 (no wider dtype to
/// recompute in).
pub fn layers_at_risk(ranges: &ActivationRanges, dtype: DType) -> Vec<String> {
    if !matches!(dtype, DType::F16 | DType::BF16) {
        return Vec::new();
    }
    let max = finite_max(dtype);
    ranges
        .layers
        .iter()
        .filter(|l| {
            l.kind == LayerKind::Plain
                || !l.max_abs.is_finite()
                || f64::from(l.max_abs) * OVERFLOW_HEADROOM >= max
        })
        .map(|l| l.path.clone())
        .collect()
}

/// Whether the largest absolute values of the checked activations of a batch (in any order)
/// mean that it overflowed in `dtype`: one is not finite (infinity or NaN) or has reached the
/// dtype's largest finite value (a conversion that saturates instead of giving infinity).
pub fn overflow_suspected(maxima: &[f32], dtype: DType) -> bool {
    let max = finite_max(dtype);
    maxima
        .iter()
        .any(|&m| !m.is_finite() || f64::from(m.abs()) >= max)
}

/// The layers a half-precision model checks at run time ([`Wav2Lip::check_overflow`]).
#[derive(Debug, Clone, Default)]
struct OverflowChecks {
    layers: HashSet<String>,
}

/// The largest absolute value of an activation as a 0-dimensional tensor on its device,
/// reduced in two steps (each row of `h·w` values, then the rows) so that a large batch is
/// spread over many GPU blocks. After a ReLU values are not negative and only the maximum is
/// needed; `signed` also takes the negated minimum.
fn max_abs_on_device(y: &Tensor, signed: bool) -> Result<Tensor> {
    let rows = match y.dims() {
        [n, c, h, w] => y.reshape((n * c, h * w))?,
        _ => y.flatten_all()?.unsqueeze(0)?,
    };
    let max = rows.max(1)?.max(0)?;
    if !signed {
        return Ok(max);
    }
    let neg_min = rows.min(1)?.min(0)?.neg()?;
    Ok(max.maximum(&neg_min)?)
}

/// How closely two batches of predicted faces (values in 0–1, any dtype and device) agree:
/// PSNR in dB, infinite when identical, NaN when either holds NaN.
pub fn face_psnr(a: &Tensor, b: &Tensor) -> Result<f64> {
    let mse = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .sqr()?
        .mean_all()?
        .to_scalar::<f32>()? as f64;
    Ok(if mse == 0.0 {
        f64::INFINITY
    } else {
        -10.0 * mse.log10()
    })
}

/// Checks the input shapes and returns the batch size.
fn check_inputs(mel: &Tensor, face: &Tensor) -> Result<usize> {
    use arch::{FACE_CHANNELS, FACE_SIZE, MEL_BINS, MEL_STEPS};
    let bad = |what: &str, t: &Tensor, want: String| {
        Error::BadInput(format!("{what} must have shape {want}, got {:?}", t.dims()))
    };
    let n = mel
        .dim(0)
        .map_err(|_| bad("mel", mel, "(N, 1, 80, 16)".into()))?;
    if mel.dims() != [n, 1, MEL_BINS, MEL_STEPS] {
        return Err(bad(
            "mel",
            mel,
            format!("({n}, 1, {MEL_BINS}, {MEL_STEPS})"),
        ));
    }
    if face.dims() != [n, FACE_CHANNELS, FACE_SIZE, FACE_SIZE] {
        return Err(bad(
            "face",
            face,
            format!("({n}, {FACE_CHANNELS}, {FACE_SIZE}, {FACE_SIZE})"),
        ));
    }
    if n == 0 {
        return Err(Error::BadInput("empty batch".into()));
    }
    if !mel.dtype().is_float() || !face.dtype().is_float() {
        return Err(Error::BadInput("mel and face must be float tensors".into()));
    }
    Ok(n)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn the_own_path_is_accepted_when_as_close_as_candles_and_above_the_floor() {
        let (floor, margin) = (35.0, 1.0);
        // No candle figure (CPU): the floor alone.
        assert!(accept_own_path(40.0, None, floor, margin));
        assert!(!accept_own_path(34.9, None, floor, margin));
        assert!(accept_own_path(f64::INFINITY, None, floor, margin));
        // NaN is never accepted.
        assert!(!accept_own_path(f64::NAN, None, floor, margin));
        assert!(!accept_own_path(f64::NAN, Some(50.0), floor, margin));
        // Against candle's figure, within the margin (candle's f16 accumulates in f16, so the
        // own path is usually the closer one).
        assert!(accept_own_path(44.5, Some(45.0), floor, margin));
        assert!(accept_own_path(50.0, Some(45.0), floor, margin));
        assert!(!accept_own_path(43.5, Some(45.0), floor, margin));
        // Above candle's but below the floor: refused.
        assert!(!accept_own_path(30.0, Some(29.0), floor, margin));
        // candle broken (NaN): the floor decides.
        assert!(accept_own_path(40.0, Some(f64::NAN), floor, margin));
    }

    #[test]
    fn floors_are_per_dtype_and_bf16s_is_lowest() {
        assert_eq!(cudnn_check_floor(DType::F32), CUDNN_CHECK_MIN_PSNR_F32);
        assert_eq!(cudnn_check_floor(DType::F16), CUDNN_CHECK_MIN_PSNR_F16);
        assert_eq!(cudnn_check_floor(DType::BF16), CUDNN_CHECK_MIN_PSNR_BF16);
        let floors = [DType::BF16, DType::F16, DType::F32].map(cudnn_check_floor);
        assert!(floors[0] < floors[1] && floors[1] < floors[2], "{floors:?}");
    }

    fn range(path: &str, kind: LayerKind, max_abs: f32) -> LayerRange {
        LayerRange {
            path: path.into(),
            kind,
            max_abs,
        }
    }

    #[test]
    fn the_layers_at_risk_are_the_output_and_those_near_the_half_dtypes_range() {
        let ranges = ActivationRanges {
            layers: vec![
                range("a", LayerKind::Conv, 12.0),
                range("b", LayerKind::Conv, 1000.0),
                range("c", LayerKind::ConvTranspose, 1024.0),
                range("d", LayerKind::Conv, f32::INFINITY),
                range("e", LayerKind::Conv, 1e30),
                range("out", LayerKind::Plain, 3.0),
            ],
        };
        // f16: 65504 / 64 = 1023.5.
        assert_eq!(layers_at_risk(&ranges, DType::F16), ["c", "d", "e", "out"]);
        // bf16 has f32's range: only what is not finite, and the output.
        assert_eq!(layers_at_risk(&ranges, DType::BF16), ["d", "out"]);
        // f32 has nothing to fall back to.
        assert!(layers_at_risk(&ranges, DType::F32).is_empty());
    }

    #[test]
    fn overflow_is_suspected_from_maxima_that_are_not_finite_or_at_the_limit() {
        assert!(!overflow_suspected(&[], DType::F16));
        // Large but in range: not suspect.
        assert!(!overflow_suspected(&[0.0, 17.5, -3.0, 65000.0], DType::F16));
        // Infinity, NaN, or the largest finite value (saturated), either sign.
        assert!(overflow_suspected(&[1.0, f32::INFINITY], DType::F16));
        assert!(overflow_suspected(&[f32::NEG_INFINITY], DType::F16));
        assert!(overflow_suspected(&[f32::NAN], DType::F16));
        assert!(overflow_suspected(&[65504.0], DType::F16));
        assert!(overflow_suspected(&[-65504.0], DType::F16));
        // Far inside bf16's range.
        assert!(!overflow_suspected(&[65504.0, 1e30], DType::BF16));
        assert!(overflow_suspected(&[f32::INFINITY], DType::BF16));
        assert_eq!(finite_max(DType::F16), 65504.0);
    }

    /// The largest absolute difference of two tensors of one shape (f32).
    pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// The test checkpoint's weights, with one tensor multiplied by `scale`.
    pub(crate) fn fixture_weights(scaled: Option<(&str, f64)>) -> GeneratorWeights {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/checkpoints/zip_bare.pt");
        let ck = crate::model::checkpoint::read(&path).unwrap();
        let tensors: Vec<(String, Tensor)> = ck
            .tensors
            .iter()
            .filter(|(k, _)| !k.ends_with("num_batches_tracked"))
            .map(|(k, t)| {
                let mut v = t.to_tensor().unwrap();
                if let Some((key, f)) = scaled.filter(|(key, _)| key == k) {
                    v = (v * f).unwrap_or_else(|e| panic!("{key}: {e}"));
                }
                (k.clone(), v)
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("w.safetensors");
        crate::model::checkpoint::write_safetensors(&out, &tensors, &Default::default()).unwrap();
        GeneratorWeights::from_file(&out).unwrap().0
    }

    /// One calibration frame (the smooth one), as tensors.
    pub(crate) fn one_frame() -> (Tensor, Tensor) {
        use arch::{FACE_CHANNELS, FACE_SIZE, MEL_BINS, MEL_STEPS};
        let (mel, face) = calibration_inputs();
        let (mel_len, face_len) = (MEL_BINS * MEL_STEPS, FACE_CHANNELS * FACE_SIZE * FACE_SIZE);
        (
            Tensor::from_slice(&mel[..mel_len], (1, 1, MEL_BINS, MEL_STEPS), &Device::Cpu).unwrap(),
            Tensor::from_slice(
                &face[..face_len],
                (1, FACE_CHANNELS, FACE_SIZE, FACE_SIZE),
                &Device::Cpu,
            )
            .unwrap(),
        )
    }

    #[test]
    fn an_f16_overflow_in_a_hidden_layer_draws_finite_wrong_faces_that_the_guard_catches() {
        // A middle encoder layer scaled up: in f16 its output overflows to infinity, the next
        // layer's sums turn it into NaN and its ReLU into 0.
        let layer = "face_encoder_blocks.3.0";
        let weights = fixture_weights(Some(("face_encoder_blocks.3.0.conv_block.0.weight", 1e5)));
        let ranges = ActivationRanges::measure(&weights).unwrap();
        assert!(ranges.layers.iter().all(|l| l.max_abs.is_finite()));
        let at_risk = layers_at_risk(&ranges, DType::F16);
        assert!(at_risk.iter().any(|l| l == layer), "{at_risk:?}");
        let mut half = Wav2Lip::load(&weights, &Device::Cpu, DType::F16).unwrap();
        let (mel, face) = one_frame();
        // Unguarded, nothing shows it: every value is finite.
        let (faces, overflow) = half.forward_guarded(&mel, &face).unwrap();
        assert!(!overflow);
        let values: Vec<f32> = faces
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(values.iter().all(|v| v.is_finite()));
        // ... but they are not f32's faces.
        let full = Wav2Lip::load(&weights, &Device::Cpu, DType::F32).unwrap();
        let psnr = face_psnr(&faces, &full.forward(&mel, &face).unwrap()).unwrap();
        assert!(psnr < 30.0, "{psnr} dB");
        // Guarded, the batch is flagged.
        half.check_overflow(&ranges);
        assert!(half.checked_layers().contains(&layer));
        let (again, overflow) = half.forward_guarded(&mel, &face).unwrap();
        assert!(overflow);
        assert_eq!(face_psnr(&again, &faces).unwrap(), f64::INFINITY);
    }

    #[test]
    fn the_test_checkpoint_in_f16_checks_its_large_layers_and_sees_no_overflow() {
        // Its decoder runs close to f16's range (up to about 35 000): checked, not flagged.
        let weights = fixture_weights(None);
        let ranges = ActivationRanges::measure(&weights).unwrap();
        let paths: Vec<String> = ranges.layers.iter().map(|l| l.path.clone()).collect();
        let mut forward_order: Vec<String> = arch::layers().into_iter().map(|l| l.0).collect();
        // `arch::layers` lists the face encoder first; the pass runs the audio encoder first.
        forward_order.sort_by_key(|p| !p.starts_with("audio_encoder"));
        assert_eq!(paths, forward_order);
        let large: Vec<&str> = ranges
            .layers
            .iter()
            .filter(|l| l.max_abs >= 1024.0 || l.kind == LayerKind::Plain)
            .map(|l| l.path.as_str())
            .collect();
        assert!(large.contains(&"face_decoder_blocks.4.2"), "{large:?}");
        assert!(!large.contains(&"face_encoder_blocks.0.0"), "{large:?}");
        let mut half = Wav2Lip::load(&weights, &Device::Cpu, DType::F16).unwrap();
        half.check_overflow(&ranges);
        assert_eq!(half.checked_layers(), large);
        let (mel, face) = one_frame();
        let (faces, overflow) = half.forward_guarded(&mel, &face).unwrap();
        assert!(!overflow);
        // And the faces are f32's, to f16's rounding.
        let full = Wav2Lip::load(&weights, &Device::Cpu, DType::F32).unwrap();
        let psnr = face_psnr(&faces, &full.forward(&mel, &face).unwrap()).unwrap();
        assert!(psnr > 35.0, "{psnr} dB");
    }
}
