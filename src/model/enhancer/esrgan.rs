//! Real-ESRGAN (xinntao/Real-ESRGAN, BSD-3; its RRDBNet is BasicSR's, Apache-2.0): both
//! architectures of the published files, recognised from their keys.
//!
//! - **SRVGGNetCompact** (`realesr-general-x4v3.pth`, K = 32; `realesr-animevideov3.pth`,
//!   K = 16): `body.0` a 3×3 convolution 3 → F, `body.1` a PReLU with one slope per channel,
//!   then K × (3×3 convolution F → F, PReLU), then `body.{2K+2}` a 3×3 convolution
//!   F → 3·s²; a pixel shuffle by s (`out[c, s·y + i, s·x + j] = in[s²·c + s·i + j, y, x]`)
//!   and the input, upsampled by nearest neighbour, added. No output activation.
//! - **RRDBNet** (`RealESRGAN_x4plus.pth`; `RealESRGAN_x2plus.pth`, which first
//!   pixel-unshuffles the input by 2 into 12 channels): `conv_first`, B residual-in-residual
//!   dense blocks, `conv_body` added to `conv_first`'s output, two nearest ×2 upsamplings
//!   each followed by a 3×3 convolution and LeakyReLU(0.2), `conv_hr` with LeakyReLU(0.2),
//!   `conv_last`. A dense block's five convolutions read the concatenation of its input and
//!   every earlier output (LeakyReLU(0.2) after the first four) and return
//!   `0.2 · conv5 + input`; three of them make an RRDB, which returns `0.2 · out + input`.
//!
//! The output is clamped to [0, 1], as Real-ESRGAN's own wrapper does before rounding.
//!
//! Two passes run the same weights: the CPU pass (the generator's NHWC gather + gemm
//! convolutions, [`EnhancerNet::forward_cpu`]) and the tensor pass on any candle device
//! ([`EnhancerNet::on_device`]: `conv2d`, cuDNN's on CUDA), in f32.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::device::{on_device, ConvPath, TensorPass, WarmUp, Weights};
use super::{dims, mismatch, strict_tensors, DeviceNet, EnhancerNet, Kind};
use crate::model::checkpoint::Checkpoint;
use crate::model::cpu::{concat_all, nchw_to_nhwc, nhwc_to_nchw, Act, Activation, Conv};
use crate::model::{Error, Result};

/// LeakyReLU's slope in RRDBNet.
const LEAKY: f32 = 0.2;
/// The scale of RRDBNet's residuals.
const RESIDUAL: f32 = 0.2;

/// A Real-ESRGAN network when the checkpoint has the keys of one.
pub fn recognise(ck: &Checkpoint) -> Option<Result<Arc<dyn EnhancerNet>>> {
    if dims(ck, "conv_first.weight").is_some() && dims(ck, "body.0.rdb1.conv1.weight").is_some() {
        return Some(Rrdb::load(ck).map(|n| Arc::new(n) as Arc<dyn EnhancerNet>));
    }
    let first = dims(ck, "body.0.weight")?;
    if first.len() != 4 || dims(ck, "conv_first.weight").is_some() {
        return None;
    }
    if dims(ck, "body.1.weight").is_none() {
        return Some(Err(Error::Unsupported(
            "an SRVGGNetCompact without PReLU weights (act_type relu or leakyrelu, which the \
             published files do not use)"
                .into(),
        )));
    }
    Some(Compact::load(ck).map(|n| Arc::new(n) as Arc<dyn EnhancerNet>))
}

/// A 3×3 convolution's tensors: `{prefix}.weight` `[cout, cin, 3, 3]` and `{prefix}.bias`.
/// SRVGGNetCompact's tensors (key, shape): `feat` features, `k` body convolutions, the
/// last convolution with `out` channels (3·s²), at `body.{2k+2}`.
pub(crate) fn compact_keys(feat: usize, k: usize, out: usize) -> Vec<(String, Vec<usize>)> {
    let mut keys = Vec::new();
    for i in 0..=k {
        let cin = if i == 0 { 3 } else { feat };
        keys.extend(conv_keys(&format!("body.{}", 2 * i), cin, feat));
        keys.push((format!("body.{}.weight", 2 * i + 1), vec![feat]));
    }
    keys.extend(conv_keys(&format!("body.{}", 2 * k + 2), feat, out));
    keys
}

/// RRDBNet's tensors (key, shape): `cin` input channels (3, or 12 / 48 after the
/// unshuffle), `feat` features, growth `grow`, `blocks` RRDBs.
pub(crate) fn rrdb_keys(
    cin: usize,
    feat: usize,
    grow: usize,
    blocks: usize,
) -> Vec<(String, Vec<usize>)> {
    let mut keys = Vec::new();
    keys.extend(conv_keys("conv_first", cin, feat));
    for b in 0..blocks {
        for r in 1..=3 {
            for c in 1..=5 {
                let (i, o) = (feat + (c - 1) * grow, if c == 5 { feat } else { grow });
                keys.extend(conv_keys(&format!("body.{b}.rdb{r}.conv{c}"), i, o));
            }
        }
    }
    for name in ["conv_body", "conv_up1", "conv_up2", "conv_hr"] {
        keys.extend(conv_keys(name, feat, feat));
    }
    keys.extend(conv_keys("conv_last", feat, 3));
    keys
}

fn conv_keys(prefix: &str, cin: usize, cout: usize) -> [(String, Vec<usize>); 2] {
    [
        (format!("{prefix}.weight"), vec![cout, cin, 3, 3]),
        (format!("{prefix}.bias"), vec![cout]),
    ]
}

/// Takes a convolution's weight and bias (in [`conv_keys`] order) from the loaded tensors.
/// The next convolution's weight and bias, times `scale`: for the CPU pass and, as
/// tensors on the CPU, for the tensor pass.
fn take_conv(
    t: &mut impl Iterator<Item = (String, Vec<f32>)>,
    cin: usize,
    cout: usize,
    scale: f32,
) -> Result<(Conv, Weights)> {
    let (key, mut w) = t.next().expect("a weight per convolution");
    let (_, mut b) = t.next().expect("a bias per convolution");
    if scale != 1.0 {
        w.iter_mut().chain(b.iter_mut()).for_each(|v| *v *= scale);
    }
    let conv = Conv::new(&w, &b, cin, cout, 3);
    let path = format!("esrgan {}", key.trim_end_matches(".weight"));
    let weights = Weights::new(path, w, Some(&b), (cin, cout, 3))?;
    Ok((conv, weights))
}

/// The loaded tensors with their keys, in the checkpoint list's order.
fn named(
    expected: &[(String, Vec<usize>)],
    tensors: Vec<Vec<f32>>,
) -> impl Iterator<Item = (String, Vec<f32>)> + '_ {
    expected.iter().map(|(k, _)| k.clone()).zip(tensors)
}

/// The own cuDNN path's warm-up: the generator's faces, at one and at a full pass.
const WARM_UP: WarmUp = WarmUp {
    side: crate::model::arch::FACE_SIZE,
    batch: super::MAX_BATCH,
};

/// LeakyReLU(0.2).
fn lrelu(x: &Tensor) -> Result<Tensor> {
    super::device::leaky(x, LEAKY)
}

fn prelu(x: &Tensor, slope: &Tensor) -> Result<Tensor> {
    Ok((x.relu()? + x.minimum(0f32)?.broadcast_mul(slope)?)?)
}

/// SRVGGNetCompact.
pub struct Compact {
    feat: usize,
    upscale: usize,
    /// `body.0`, then the K body convolutions.
    convs: Vec<Conv>,
    /// The PReLU slopes after each of `convs`.
    slopes: Vec<Vec<f32>>,
    last: Conv,
    /// The same weights for the tensor pass, on the CPU.
    tensors: CompactTensors,
}

/// SRVGGNetCompact's tensor pass.
#[derive(Clone)]
struct CompactTensors {
    upscale: usize,
    /// Each body convolution with its PReLU slopes, `(1, F, 1, 1)`.
    body: Vec<(Weights, Tensor)>,
    last: Weights,
}

impl CompactTensors {
    fn to(&self, device: &Device) -> Result<CompactTensors> {
        Ok(CompactTensors {
            upscale: self.upscale,
            body: self
                .body
                .iter()
                .map(|(c, s)| Ok((c.to(device)?, s.to_device(device)?)))
                .collect::<Result<_>>()?,
            last: self.last.to(device)?,
        })
    }
}

impl TensorPass for CompactTensors {
    fn run(&self, x: &Tensor, path: &ConvPath) -> Result<Tensor> {
        let (_, _, h, w) = x.dims4()?;
        let mut y = x.clone();
        for (conv, slope) in &self.body {
            y = prelu(&conv.conv(&y, path)?, slope)?;
        }
        let s = self.upscale;
        let y = candle_nn::ops::pixel_shuffle(&self.last.conv(&y, path)?, s)?;
        Ok((y + x.upsample_nearest2d(h * s, w * s)?)?)
    }

    fn elements(&self) -> usize {
        let body: usize = self
            .body
            .iter()
            .map(|(c, s)| c.elements() + s.elem_count())
            .sum();
        body + self.last.elements()
    }

    fn peak_values(&self, n: usize, h: usize, w: usize) -> usize {
        let feat = self.body.first().map_or(0, |(_, s)| s.elem_count());
        let s2 = self.upscale * self.upscale;
        // A layer's input, output and the PReLU's two temporaries; at the end the shuffled
        // output, the upsampled input and their sum.
        (n * h * w * 4 * feat).max(n * h * w * 3 * s2 * 3)
    }
}

impl Compact {
    const MODEL: &'static str = "SRVGGNetCompact";

    fn load(ck: &Checkpoint) -> Result<Self> {
        let mismatch = |detail: String| mismatch(Self::MODEL, detail);
        let first = dims(ck, "body.0.weight").unwrap_or(&[]);
        let feat = first[0];
        if first[1] != 3 {
            return Err(mismatch(format!(
                "body.0.weight has shape {first:?}: the input must have 3 channels (RGB)"
            )));
        }
        // The last convolution is the highest `body.N`; convolutions sit at even N.
        let last_index = ck
            .tensors
            .iter()
            .filter_map(|(k, _)| {
                k.strip_prefix("body.")?
                    .strip_suffix(".weight")?
                    .parse()
                    .ok()
            })
            .max()
            .unwrap_or(0usize);
        if last_index < 2 || last_index % 2 != 0 {
            return Err(mismatch(format!(
                "its last layer is body.{last_index}, which is not a convolution"
            )));
        }
        let k = (last_index - 2) / 2;
        let out = dims(ck, &format!("body.{last_index}.weight"))
            .and_then(|d| d.first().copied())
            .unwrap_or(0);
        let upscale = (1..=8).find(|s| 3 * s * s == out).ok_or_else(|| {
            mismatch(format!(
                "body.{last_index} has {out} output channels, not 3·s² for an upscale s"
            ))
        })?;
        let expected = compact_keys(feat, k, out);
        let mut t = named(&expected, strict_tensors(ck, Self::MODEL, &expected)?);
        let mut convs = Vec::with_capacity(k + 1);
        let mut slopes = Vec::with_capacity(k + 1);
        let mut body = Vec::with_capacity(k + 1);
        for i in 0..=k {
            let (conv, weights) = take_conv(&mut t, if i == 0 { 3 } else { feat }, feat, 1.0)?;
            let (_, slope) = t.next().expect("a PReLU per convolution");
            body.push((
                weights,
                Tensor::from_slice(&slope, (1, feat, 1, 1), &Device::Cpu)?,
            ));
            convs.push(conv);
            slopes.push(slope);
        }
        let (last, last_weights) = take_conv(&mut t, feat, out, 1.0)?;
        Ok(Compact {
            feat,
            upscale,
            convs,
            slopes,
            last,
            tensors: CompactTensors {
                upscale,
                body,
                last: last_weights,
            },
        })
    }
}

impl EnhancerNet for Compact {
    fn kind(&self) -> Kind {
        Kind::Esrgan
    }

    fn describe(&self) -> String {
        format!(
            "SRVGGNetCompact ({} body convolutions, {} features, x{})",
            self.convs.len() - 1,
            self.feat,
            self.upscale
        )
    }

    fn scale(&self) -> usize {
        self.upscale
    }

    fn check_size(&self, height: usize, width: usize) -> Result<()> {
        check_nonempty(height, width)
    }

    fn multiply_adds(&self, height: usize, width: usize) -> f64 {
        let per_pixel: usize = self
            .convs
            .iter()
            .chain([&self.last])
            .map(|c| 9 * c.cin() * c.cout())
            .sum();
        (height * width * per_pixel) as f64
    }

    fn forward_cpu(&self, n: usize, height: usize, width: usize, rgb: &[f32]) -> Result<Vec<f32>> {
        check_input(self, n, height, width, rgb)?;
        let x = nchw_to_nhwc(rgb, n, 3, height, width);
        let mut y: Option<Act> = None;
        for (conv, slope) in self.convs.iter().zip(&self.slopes) {
            let input = y.as_ref().unwrap_or(&x);
            y = Some(conv.forward(input, None, Activation::PRelu(slope)));
        }
        let y = self
            .last
            .forward(y.as_ref().unwrap_or(&x), None, Activation::None);
        // Pixel shuffle, the nearest-upsampled input added, clamped; NCHW out.
        let s = self.upscale;
        let (oh, ow) = (height * s, width * s);
        let mut out = vec![0f32; n * 3 * oh * ow];
        out.par_chunks_mut(ow).enumerate().for_each(|(row, dst)| {
            let (plane, oy) = (row / oh, row % oh);
            let (b, c) = (plane / 3, plane % 3);
            let (iy, i) = (oy / s, oy % s);
            for (ox, v) in dst.iter_mut().enumerate() {
                let (ix, j) = (ox / s, ox % s);
                let conv = y.data[((b * height + iy) * width + ix) * y.c + (c * s + i) * s + j];
                let base = rgb[((b * 3 + c) * height + iy) * width + ix];
                *v = (conv + base).clamp(0.0, 1.0);
            }
        });
        Ok(out)
    }

    fn on_device(&self, device: &Device) -> Result<Arc<dyn DeviceNet>> {
        Ok(on_device(self.tensors.to(device)?, device, WARM_UP, self))
    }
}

/// One residual dense block: five convolutions, the last scaled by [`RESIDUAL`].
struct DenseBlock([Conv; 5]);

impl DenseBlock {
    fn forward(&self, x: &Act) -> Act {
        let mut outs: Vec<Act> = Vec::with_capacity(4);
        for conv in &self.0[..4] {
            let input = if outs.is_empty() {
                conv.forward(x, None, Activation::Leaky(LEAKY))
            } else {
                let parts: Vec<&Act> = std::iter::once(x).chain(&outs).collect();
                conv.forward(&concat_all(&parts), None, Activation::Leaky(LEAKY))
            };
            outs.push(input);
        }
        let parts: Vec<&Act> = std::iter::once(x).chain(&outs).collect();
        // `0.2 · conv5(...) + x`, with the 0.2 folded into conv5's weights at load.
        self.0[4].forward(&concat_all(&parts), Some(x), Activation::None)
    }
}

/// RRDBNet.
pub struct Rrdb {
    scale: usize,
    feat: usize,
    grow: usize,
    first: Conv,
    /// Three dense blocks per RRDB.
    blocks: Vec<[DenseBlock; 3]>,
    body: Conv,
    up1: Conv,
    up2: Conv,
    hr: Conv,
    last: Conv,
    /// The same weights for the tensor pass, on the CPU.
    tensors: RrdbTensors,
}

/// RRDBNet's tensor pass: `first`, the blocks' dense convolutions (the fifth of each
/// already times 0.2), then `conv_body`, `conv_up1`, `conv_up2`, `conv_hr`, `conv_last`.
#[derive(Clone)]
struct RrdbTensors {
    unshuffle: usize,
    feat: usize,
    grow: usize,
    first: Weights,
    blocks: Vec<[[Weights; 5]; 3]>,
    tail: [Weights; 5],
}

fn five_to(d: &[Weights; 5], device: &Device) -> Result<[Weights; 5]> {
    let v: Vec<Weights> = d.iter().map(|c| c.to(device)).collect::<Result<_>>()?;
    Ok(v.try_into()
        .unwrap_or_else(|_| unreachable!("five convolutions")))
}

impl RrdbTensors {
    fn to(&self, device: &Device) -> Result<RrdbTensors> {
        Ok(RrdbTensors {
            unshuffle: self.unshuffle,
            feat: self.feat,
            grow: self.grow,
            first: self.first.to(device)?,
            blocks: self
                .blocks
                .iter()
                .map(|b| {
                    Ok([
                        five_to(&b[0], device)?,
                        five_to(&b[1], device)?,
                        five_to(&b[2], device)?,
                    ])
                })
                .collect::<Result<_>>()?,
            tail: five_to(&self.tail, device)?,
        })
    }

    /// One dense block: `conv5(cat(x, x1..x4)) + x` (conv5 already times 0.2).
    fn dense(convs: &[Weights; 5], x: &Tensor, path: &ConvPath) -> Result<Tensor> {
        let mut parts = vec![x.clone()];
        for conv in &convs[..4] {
            let y = lrelu(&conv.conv(&Tensor::cat(&parts, 1)?, path)?)?;
            parts.push(y);
        }
        Ok((convs[4].conv(&Tensor::cat(&parts, 1)?, path)? + x)?)
    }
}

impl TensorPass for RrdbTensors {
    fn run(&self, x: &Tensor, path: &ConvPath) -> Result<Tensor> {
        let x = if self.unshuffle > 1 {
            candle_nn::ops::pixel_unshuffle(x, self.unshuffle)?
        } else {
            x.clone()
        };
        let feat = self.first.conv(&x, path)?;
        let mut y = feat.clone();
        for rrdb in &self.blocks {
            let mut out = y.clone();
            for dense in rrdb {
                out = Self::dense(dense, &out, path)?;
            }
            y = ((out * f64::from(RESIDUAL))? + y)?;
        }
        let [body, up1, up2, hr, last] = &self.tail;
        let feat = (body.conv(&y, path)? + feat)?;
        let (_, _, h, w) = feat.dims4()?;
        let f = lrelu(&up1.conv(&feat.upsample_nearest2d(2 * h, 2 * w)?, path)?)?;
        let f = lrelu(&up2.conv(&f.upsample_nearest2d(4 * h, 4 * w)?, path)?)?;
        last.conv(&lrelu(&hr.conv(&f, path)?)?, path)
    }

    fn elements(&self) -> usize {
        let blocks: usize = self
            .blocks
            .iter()
            .flatten()
            .flatten()
            .map(Weights::elements)
            .sum();
        let tail: usize = self.tail.iter().map(Weights::elements).sum();
        self.first.elements() + blocks + tail
    }

    fn peak_values(&self, n: usize, h: usize, w: usize) -> usize {
        let u = self.unshuffle;
        let (bh, bw) = (h / u, w / u);
        // In a dense block: the block's input, the concatenation and a layer's output.
        let body = n * bh * bw * (3 * self.feat + 2 * (self.feat + 4 * self.grow));
        // At 4x the body's size: a layer's input, output and activation.
        let top = n * 16 * bh * bw * self.feat * 3;
        body.max(top)
    }
}

impl Rrdb {
    const MODEL: &'static str = "RRDBNet";

    fn load(ck: &Checkpoint) -> Result<Self> {
        let mismatch = |detail: String| mismatch(Self::MODEL, detail);
        let first = dims(ck, "conv_first.weight").unwrap_or(&[]);
        let grow_dims = dims(ck, "body.0.rdb1.conv1.weight").unwrap_or(&[]);
        if first.len() != 4 || grow_dims.len() != 4 {
            return Err(mismatch(
                "conv_first or the first dense block is not a 2-D convolution".into(),
            ));
        }
        let (feat, cin, grow) = (first[0], first[1], grow_dims[0]);
        // x4 reads RGB; x2 and x1 pixel-unshuffle it by 2 and 4 first.
        let scale = match cin {
            3 => 4,
            12 => 2,
            48 => 1,
            _ => {
                return Err(mismatch(format!(
                    "conv_first reads {cin} channels: 3 (x4), 12 (x2) or 48 (x1) expected"
                )))
            }
        };
        let blocks = (0..)
            .take_while(|i| dims(ck, &format!("body.{i}.rdb1.conv1.weight")).is_some())
            .count();
        let expected = rrdb_keys(cin, feat, grow, blocks);
        let mut t = named(&expected, strict_tensors(ck, Self::MODEL, &expected)?);
        let (first, first_weights) = take_conv(&mut t, cin, feat, 1.0)?;
        // Five convolutions in a row, each (input channels, output channels, scale).
        let mut five = |shape: &dyn Fn(usize) -> (usize, usize, f32)| -> Result<_> {
            let mut convs = Vec::with_capacity(5);
            let mut weights = Vec::with_capacity(5);
            for c in 0..5 {
                let (i, o, scale) = shape(c);
                let (conv, w) = take_conv(&mut t, i, o, scale)?;
                convs.push(conv);
                weights.push(w);
            }
            let convs: [Conv; 5] = convs.try_into().unwrap_or_else(|_| unreachable!());
            let weights: [Weights; 5] = weights.try_into().unwrap_or_else(|_| unreachable!());
            Ok((convs, weights))
        };
        let dense_shape = |c: usize| {
            let (i, o) = (feat + c * grow, if c == 4 { feat } else { grow });
            (i, o, if c == 4 { RESIDUAL } else { 1.0 })
        };
        let mut block_convs = Vec::with_capacity(blocks);
        let mut block_weights = Vec::with_capacity(blocks);
        for _ in 0..blocks {
            let (c1, w1) = five(&dense_shape)?;
            let (c2, w2) = five(&dense_shape)?;
            let (c3, w3) = five(&dense_shape)?;
            block_convs.push([DenseBlock(c1), DenseBlock(c2), DenseBlock(c3)]);
            block_weights.push([w1, w2, w3]);
        }
        let (tail, tail_weights) = five(&|i| (feat, if i == 4 { 3 } else { feat }, 1.0))?;
        let [body, up1, up2, hr, last] = tail;
        Ok(Rrdb {
            scale,
            feat,
            grow,
            first,
            blocks: block_convs,
            body,
            up1,
            up2,
            hr,
            last,
            tensors: RrdbTensors {
                unshuffle: 4 / scale,
                feat,
                grow,
                first: first_weights,
                blocks: block_weights,
                tail: tail_weights,
            },
        })
    }

    /// The pixel-unshuffle factor before `conv_first` (1 for x4).
    fn unshuffle(&self) -> usize {
        4 / self.scale
    }
}

impl EnhancerNet for Rrdb {
    fn kind(&self) -> Kind {
        Kind::Esrgan
    }

    fn describe(&self) -> String {
        format!(
            "RRDBNet ({} blocks, {} features, growth {}, x{})",
            self.blocks.len(),
            self.feat,
            self.grow,
            self.scale
        )
    }

    fn scale(&self) -> usize {
        self.scale
    }

    fn check_size(&self, height: usize, width: usize) -> Result<()> {
        check_nonempty(height, width)?;
        let u = self.unshuffle();
        if height % u != 0 || width % u != 0 {
            return Err(Error::BadInput(format!(
                "this x{} RRDBNet pixel-unshuffles its input by {u}: the image's sides must be \
                 multiples of {u}, not {width}x{height}",
                self.scale
            )));
        }
        Ok(())
    }

    fn multiply_adds(&self, height: usize, width: usize) -> f64 {
        let u = self.unshuffle();
        let body_px = (height / u) * (width / u);
        let conv = |c: &Conv| 9 * c.cin() * c.cout();
        let dense: usize = self
            .blocks
            .iter()
            .flatten()
            .flat_map(|d| d.0.iter())
            .map(conv)
            .sum();
        let at_body = conv(&self.first) + dense + conv(&self.body);
        let at_2x = conv(&self.up1);
        let at_4x = conv(&self.up2) + conv(&self.hr) + conv(&self.last);
        (body_px * (at_body + 4 * at_2x + 16 * at_4x)) as f64
    }

    fn forward_cpu(&self, n: usize, height: usize, width: usize, rgb: &[f32]) -> Result<Vec<f32>> {
        check_input(self, n, height, width, rgb)?;
        let x = pixel_unshuffle(rgb, n, height, width, self.unshuffle());
        let feat = self.first.forward(&x, None, Activation::None);
        drop(x);
        let mut y: Option<Act> = None;
        for rrdb in &self.blocks {
            let input = y.as_ref().unwrap_or(&feat);
            let mut out = rrdb[0].forward(input);
            out = rrdb[1].forward(&out);
            out = rrdb[2].forward(&out);
            // `0.2 · out + input`.
            out.data
                .par_iter_mut()
                .zip(input.data.par_iter())
                .for_each(|(o, i)| *o = RESIDUAL * *o + i);
            y = Some(out);
        }
        let feat = self
            .body
            .forward(y.as_ref().unwrap_or(&feat), Some(&feat), Activation::None);
        let f = self
            .up1
            .forward(&nearest2(&feat), None, Activation::Leaky(LEAKY));
        drop(feat);
        let f = self
            .up2
            .forward(&nearest2(&f), None, Activation::Leaky(LEAKY));
        let f = self.hr.forward(&f, None, Activation::Leaky(LEAKY));
        let out = self.last.forward(&f, None, Activation::None);
        Ok(to_nchw_clamped(&out))
    }

    fn on_device(&self, device: &Device) -> Result<Arc<dyn DeviceNet>> {
        Ok(on_device(self.tensors.to(device)?, device, WARM_UP, self))
    }
}

fn check_nonempty(height: usize, width: usize) -> Result<()> {
    if height == 0 || width == 0 {
        return Err(Error::BadInput(format!(
            "an empty image ({width}x{height})"
        )));
    }
    Ok(())
}

fn check_input(net: &dyn EnhancerNet, n: usize, h: usize, w: usize, rgb: &[f32]) -> Result<()> {
    net.check_size(h, w)?;
    if rgb.len() != n * 3 * h * w {
        return Err(Error::BadInput(format!(
            "{} values for {n} RGB images of {w}x{h}",
            rgb.len()
        )));
    }
    Ok(())
}

/// `(n, 3, h, w)` NCHW → NHWC with `3·u²` channels, channel `c·u² + i·u + j` holding
/// `x[c, u·y + i, u·x + j]` (BasicSR's `pixel_unshuffle`); `u = 1` is the plain layout change.
fn pixel_unshuffle(rgb: &[f32], n: usize, h: usize, w: usize, u: usize) -> Act {
    if u == 1 {
        return nchw_to_nhwc(rgb, n, 3, h, w);
    }
    let (oh, ow, c) = (h / u, w / u, 3 * u * u);
    let mut data = vec![0f32; n * oh * ow * c];
    data.par_chunks_mut(ow * c)
        .enumerate()
        .for_each(|(row, dst)| {
            let (b, y) = (row / oh, row % oh);
            for x in 0..ow {
                for ch in 0..c {
                    let (plane, i, j) = (ch / (u * u), (ch / u) % u, ch % u);
                    dst[x * c + ch] = rgb[((b * 3 + plane) * h + y * u + i) * w + x * u + j];
                }
            }
        });
    Act {
        n,
        h: oh,
        w: ow,
        c,
        data,
    }
}

/// Nearest-neighbour ×2 (`F.interpolate(scale_factor=2, mode='nearest')`), NHWC.
fn nearest2(x: &Act) -> Act {
    let (oh, ow, c) = (x.h * 2, x.w * 2, x.c);
    let mut data = vec![0f32; x.n * oh * ow * c];
    data.par_chunks_mut(ow * c)
        .enumerate()
        .for_each(|(row, dst)| {
            let (b, y) = (row / oh, row % oh);
            let src = &x.data[(b * x.h + y / 2) * x.w * c..][..x.w * c];
            for (xx, px) in dst.chunks_exact_mut(c).enumerate() {
                px.copy_from_slice(&src[(xx / 2) * c..(xx / 2 + 1) * c]);
            }
        });
    Act {
        n: x.n,
        h: oh,
        w: ow,
        c,
        data,
    }
}

/// NHWC → NCHW, clamped to [0, 1].
fn to_nchw_clamped(x: &Act) -> Vec<f32> {
    let mut out = nhwc_to_nchw(x);
    out.par_iter_mut().for_each(|v| *v = v.clamp(0.0, 1.0));
    out
}

#[cfg(test)]
mod tests {
    use super::super::testing::{checkpoint, compact_keys};
    use super::{rrdb_keys, *};

    #[test]
    fn the_tensor_pass_computes_what_the_cpu_pass_does() {
        // The CPU pass is checked against the upstream networks (tests/enhancer.rs); the
        // tensor pass (what CUDA runs) is checked against it, here on candle's CPU device,
        // for both architectures and the x2 RRDBNet's pixel-unshuffle.
        let (n, h, w) = (2, 12, 8);
        let rgb: Vec<f32> = (0..n * 3 * h * w)
            .map(|i| ((i * 37) % 101) as f32 / 100.0)
            .collect();
        for (what, keys) in [
            ("compact x4", compact_keys(4, 2, 4)),
            ("compact x2", compact_keys(6, 1, 2)),
            ("rrdb x4", rrdb_keys(3, 8, 4, 1)),
            ("rrdb x2", rrdb_keys(12, 8, 4, 2)),
        ] {
            let net = super::super::recognise(&checkpoint(&keys)).unwrap();
            let cpu = net.forward_cpu(n, h, w, &rgb).unwrap();
            let on = net.on_device(&Device::Cpu).unwrap();
            let tensors = on.forward(n, h, w, &rgb).unwrap();
            assert_eq!(cpu.len(), tensors.len(), "{what}");
            let s = net.scale();
            assert_eq!(cpu.len(), n * 3 * h * s * w * s, "{what}");
            let worst = cpu
                .iter()
                .zip(&tensors)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-5, "{what}: the passes differ by {worst}");
            // Not a trivial output: values inside (0, 1) as well as clamped ones.
            assert!(cpu.iter().any(|v| *v > 0.01 && *v < 0.99), "{what}");
            assert!(on.bytes(16, 96, 96) > on.bytes(1, 96, 96), "{what}");
        }
    }
}
