//! The Wav2Lip generator (`Rudrabha/Wav2Lip:models/wav2lip.py`), inference only, with every
//! BatchNorm folded into the convolution before it.

use candle_core::{DType, Device, Tensor};

use super::arch::{self, LayerKind, LayerSpec};
use super::cpu::CpuNet;
use super::weights::GeneratorWeights;
use super::{Error, Result};

/// One convolution layer: `models/conv.py`'s `Conv2d` (conv + BN [+ residual] + ReLU) or
/// `Conv2dTranspose` (transposed conv + BN + ReLU) with BN folded, or the bare output
/// `nn.Conv2d`.
#[derive(Debug, Clone)]
pub struct ConvBlock {
    path: String,
    spec: LayerSpec,
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

    /// A layer from its parts (tests build single layers this way).
    pub fn from_parts(path: &str, spec: LayerSpec, weight: Tensor, bias: Tensor) -> Self {
        ConvBlock {
            path: path.to_string(),
            spec,
            weight,
            bias,
        }
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
        conv_layer(x, &self.weight, &self.bias, &self.spec)
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

/// Least agreement (PSNR of faces in 0–1) the cuDNN path must show with candle's operations
/// at start-up. f32 paths differ only by summation order (the CPU pass: > 80 dB); f16/bf16
/// paths also by where rounding happens (f16 against f32 on the CPU: about 46 dB on real
/// faces). A wrong layer gives 10–25 dB.
pub const CUDNN_CHECK_MIN_PSNR_F32: f64 = 60.0;
/// See [`CUDNN_CHECK_MIN_PSNR_F32`].
pub const CUDNN_CHECK_MIN_PSNR_HALF: f64 = 35.0;

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
        Ok(Wav2Lip {
            face_encoder_blocks,
            audio_encoder,
            face_decoder_blocks,
            output_block,
            cpu,
            #[cfg(feature = "cuda")]
            cudnn: match device {
                Device::Cuda(dev) if super::cudnn::enabled() => {
                    match super::cudnn::CudnnEngine::new(dev, dtype) {
                        Ok(engine) => Some(std::sync::Arc::new(engine)),
                        Err(e) => {
                            tracing::warn!(
                                "cuDNN path unavailable ({e}); using candle's operations"
                            );
                            None
                        }
                    }
                }
                _ => None,
            },
            device: device.clone(),
            dtype,
        })
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

    /// Compares the own path with candle's operations on a deterministic test batch of `n`
    /// and returns their agreement as PSNR in dB (faces in 0–1; infinite when identical).
    /// When the own path fails or agrees to less than `min_psnr`, the model switches to
    /// candle's operations (with a warning), so a broken fast path never serves wrong faces.
    pub fn check_conv_engine(&mut self, n: usize, min_psnr: f64) -> Result<f64> {
        use arch::{FACE_CHANNELS, FACE_SIZE, MEL_BINS, MEL_STEPS};
        if self.conv_engine() == "candle" {
            return Ok(f64::INFINITY);
        }
        // A smooth, deterministic input in the ranges the model sees.
        let wave = |len: usize, scale: f32, shift: f32| -> Vec<f32> {
            (0..len)
                .map(|i| shift + scale * ((i as f32) * 0.37).sin() * ((i as f32) * 0.011).cos())
                .collect()
        };
        let mel = Tensor::from_vec(
            wave(n * MEL_BINS * MEL_STEPS, 4.0, 0.0),
            (n, 1, MEL_BINS, MEL_STEPS),
            &self.device,
        )?;
        let face = Tensor::from_vec(
            wave(n * FACE_CHANNELS * FACE_SIZE * FACE_SIZE, 0.5, 0.5),
            (n, FACE_CHANNELS, FACE_SIZE, FACE_SIZE),
            &self.device,
        )?;
        let reference = self.forward_candle(&mel, &face)?.to_dtype(DType::F32)?;
        let psnr = match self.forward(&mel, &face) {
            Ok(own) => face_psnr(&own, &reference)?,
            Err(e) => {
                tracing::warn!(
                    "the {} convolution path failed ({e}); using candle's operations",
                    self.conv_engine()
                );
                self.use_candle_operations();
                return Ok(f64::NAN);
            }
        };
        if psnr.is_nan() || psnr < min_psnr {
            tracing::warn!(
                "the {} convolution path agrees with candle's operations only to {psnr:.1} dB \
                 (at least {min_psnr} dB wanted); using candle's operations",
                self.conv_engine()
            );
            self.use_candle_operations();
        }
        Ok(psnr)
    }

    /// On the cuDNN path, [`Self::check_conv_engine`] at batch 2 with the standard
    /// thresholds ([`CUDNN_CHECK_MIN_PSNR_F32`], [`CUDNN_CHECK_MIN_PSNR_HALF`]), logged; the
    /// PSNR found, or `None` on other paths.
    pub fn verify_cudnn_path(&mut self) -> Result<Option<f64>> {
        if self.conv_engine() != "cudnn" {
            return Ok(None);
        }
        let min_psnr = if self.dtype == DType::F32 {
            CUDNN_CHECK_MIN_PSNR_F32
        } else {
            CUDNN_CHECK_MIN_PSNR_HALF
        };
        let psnr = self.check_conv_engine(2, min_psnr)?;
        tracing::info!(
            "{:?} model: {} convolutions, agreeing with candle's to {psnr:.1} dB",
            self.dtype,
            self.conv_engine()
        );
        Ok(Some(psnr))
    }

    /// Runs candle's operations from now on (the reference path).
    pub fn use_candle_operations(&mut self) {
        self.cpu = None;
        #[cfg(feature = "cuda")]
        {
            self.cudnn = None;
        }
    }

    /// Predicts faces for a batch. Inputs may be any float dtype and device; the output is on
    /// the model's device in its dtype. f32 on the CPU runs the own CPU pass
    /// ([`super::cpu`]); everything else candle's operations.
    pub fn forward(&self, mel: &Tensor, face: &Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(engine) = &self.cudnn {
            return self.forward_with(mel, face, &mut |block, x| engine.forward(block, x));
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
        let n = check_inputs(mel, face)?;
        let mel = mel.to_device(&self.device)?.to_dtype(self.dtype)?;
        let face = face.to_device(&self.device)?.to_dtype(self.dtype)?;
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
                x = Tensor::cat(&[&x, &skip], 1)?;
            }
        }
        let _span = tracing::trace_span!("output_block", n).entered();
        let x = run(&self.output_block, x)?;
        Ok(candle_nn::ops::sigmoid(&x)?)
    }
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
