//! GFPGAN v1.3 / v1.4 (TencentARC/GFPGAN, Apache-2.0): `GFPGANv1Clean` with out_size 512,
//! channel_multiplier 2, `sft_half`, `different_w` and `input_is_latent`, as the published
//! `GFPGANv1.3.pth` / `GFPGANv1.4.pth` hold it (legacy `torch.save` of `params_ema`, 285
//! tensors), recognised from its keys.
//!
//! It restores a face aligned to the FFHQ 512 template (see `media::face::align`):
//! - **U-Net encoder**: a 1×1 convolution 3 → 32 and LeakyReLU(0.2), seven down ResBlocks to
//!   4×4 (conv1 3×3 → LeakyReLU → bilinear ×½ → conv2 3×3 → LeakyReLU, plus a 1×1 convolution
//!   without bias of the bilinear-resized input), `final_conv` 3×3 and LeakyReLU, then
//!   `final_linear` (4096 → 16 × 512: one W+ latent per decoder layer, read in NCHW order).
//! - **U-Net decoder**: the encoder's outputs added back level by level, seven up ResBlocks
//!   (bilinear ×2), and at each level `condition_scale` and `condition_shift` (3×3, LeakyReLU,
//!   3×3). The encoder's `toRGB` outputs are not needed and not run; the 8-layer `style_mlp`
//!   is in the file but not run (the latents are given).
//! - **StyleGAN2 decoder**: a constant 512×4×4; per level an upsampling StyleConv (bilinear ×2,
//!   then a modulated 3×3 convolution), the SFT on the second half of the channels
//!   (`x · scale + shift`), a second StyleConv, and a ToRGB (modulated 1×1 without
//!   demodulation, plus bias, plus the previous RGB upsampled). A StyleConv is
//!   `LeakyReLU(0.2)(√2 · modconv + noise_weight · noise + bias)` with the noise stored in the
//!   file (never fresh noise: the same face gives the same output, no flicker).
//!
//! A modulated convolution with style `s` (a linear map of the latent) and demodulation
//! `d[o] = 1 / √(Σ_{i,k} (W[o,i,k] · s[i])² + 10⁻⁸)` is run as the input channels scaled by
//! `s`, one ordinary convolution with the shared weight, and the output channels scaled by
//! `d`: the same sums, and batched like any convolution. The weights are used as stored (the
//! clean architecture folds no equalised learning rate at run time).
//!
//! Input RGB in [0, 1] is `(x − 0.5) / 0.5`; the output is clamped to [−1, 1] and mapped
//! back to [0, 1], as GFPGAN's own wrapper does.
//!
//! Two passes run the same weights in f32 (f16/bf16 wait for a device check: a flat-colour
//! f16 failure is reported upstream): the CPU pass (the generator's NHWC gather + gemm
//! convolutions) and the tensor pass on any candle device ([`EnhancerNet::on_device`]:
//! `conv2d` or the own cuDNN path on CUDA), built from the CPU pass's own weights so the file
//! is read once. Its bilinear ×2 is two fixed blends per axis, its ×½ a 2×2 mean (what
//! `align_corners=False` reads), and the modulation two broadcast scalings around the
//! shared convolution.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::device::{on_device, ConvPath, TensorPass, WarmUp, Weights};
use super::{dims, strict_tensors, Applies, DeviceNet, EnhancerNet, Kind};
use crate::model::checkpoint::Checkpoint;
use crate::model::cpu::{nchw_to_nhwc, nhwc_to_nchw, Act, Activation, Conv};
use crate::model::{Error, Result};

/// The face side GFPGAN takes and gives.
pub const SIDE: usize = 512;
const LOG_SIDE: usize = 9;
/// Style (latent) width.
const STYLE: usize = 512;
/// Latents: one per decoder layer, `2 · log2(512) − 2`.
const LATENTS: usize = 2 * LOG_SIDE - 2;
/// Up/down levels between 4×4 and 512×512.
const LEVELS: usize = LOG_SIDE - 2;
const LEAKY: f32 = 0.2;
const MODEL: &str = "GFPGANv1Clean";

/// Decoder channels at side `2^i` (narrow 1, channel multiplier 2).
fn decoder_channels(i: usize) -> usize {
    match 1 << i {
        4..=64 => 512,
        128 => 256,
        256 => 128,
        512 => 64,
        _ => unreachable!("side {}", 1 << i),
    }
}

/// The U-Net's channels: half the decoder's.
fn unet_channels(i: usize) -> usize {
    decoder_channels(i) / 2
}

/// A GFPGAN network when the checkpoint has its keys.
pub fn recognise(ck: &Checkpoint) -> Option<Result<Arc<dyn EnhancerNet>>> {
    dims(ck, "stylegan_decoder.constant_input.weight")?;
    dims(ck, "conv_body_first.weight")?;
    Some(Gfpgan::load(ck).map(|n| Arc::new(n) as Arc<dyn EnhancerNet>))
}

/// Every tensor of the published files (key, shape), in a fixed order.
pub fn keys() -> Vec<(String, Vec<usize>)> {
    let mut k: Vec<(String, Vec<usize>)> = Vec::with_capacity(285);
    let conv = |k: &mut Vec<(String, Vec<usize>)>, p: &str, o: usize, i: usize, s: usize| {
        k.push((format!("{p}.weight"), vec![o, i, s, s]));
        k.push((format!("{p}.bias"), vec![o]));
    };
    conv(&mut k, "conv_body_first", unet_channels(LOG_SIDE), 3, 1);
    let resblock = |k: &mut Vec<(String, Vec<usize>)>, p: &str, i: usize, o: usize| {
        k.push((format!("{p}.conv1.weight"), vec![i, i, 3, 3]));
        k.push((format!("{p}.conv1.bias"), vec![i]));
        k.push((format!("{p}.conv2.weight"), vec![o, i, 3, 3]));
        k.push((format!("{p}.conv2.bias"), vec![o]));
        k.push((format!("{p}.skip.weight"), vec![o, i, 1, 1]));
    };
    for (j, i) in (3..=LOG_SIDE).rev().enumerate() {
        resblock(
            &mut k,
            &format!("conv_body_down.{j}"),
            unet_channels(i),
            unet_channels(i - 1),
        );
    }
    conv(&mut k, "final_conv", unet_channels(2), unet_channels(2), 3);
    for (j, i) in (3..=LOG_SIDE).enumerate() {
        resblock(
            &mut k,
            &format!("conv_body_up.{j}"),
            unet_channels(i - 1),
            unet_channels(i),
        );
    }
    for (j, i) in (3..=LOG_SIDE).enumerate() {
        conv(&mut k, &format!("toRGB.{j}"), 3, unet_channels(i), 1);
    }
    k.push((
        "final_linear.weight".into(),
        vec![LATENTS * STYLE, unet_channels(2) * 16],
    ));
    k.push(("final_linear.bias".into(), vec![LATENTS * STYLE]));
    let d = "stylegan_decoder";
    for m in (1..=15).step_by(2) {
        k.push((format!("{d}.style_mlp.{m}.weight"), vec![STYLE, STYLE]));
        k.push((format!("{d}.style_mlp.{m}.bias"), vec![STYLE]));
    }
    k.push((
        format!("{d}.constant_input.weight"),
        vec![1, decoder_channels(2), 4, 4],
    ));
    let modulated = |k: &mut Vec<(String, Vec<usize>)>, p: &str, i: usize, o: usize, s: usize| {
        k.push((format!("{p}.modulated_conv.weight"), vec![1, o, i, s, s]));
        k.push((
            format!("{p}.modulated_conv.modulation.weight"),
            vec![i, STYLE],
        ));
        k.push((format!("{p}.modulated_conv.modulation.bias"), vec![i]));
    };
    let style_conv = |k: &mut Vec<(String, Vec<usize>)>, p: &str, i: usize, o: usize| {
        modulated(k, p, i, o, 3);
        k.push((format!("{p}.weight"), vec![1]));
        k.push((format!("{p}.bias"), vec![1, o, 1, 1]));
    };
    let to_rgb = |k: &mut Vec<(String, Vec<usize>)>, p: &str, i: usize| {
        modulated(k, p, i, 3, 1);
        k.push((format!("{p}.bias"), vec![1, 3, 1, 1]));
    };
    style_conv(
        &mut k,
        &format!("{d}.style_conv1"),
        decoder_channels(2),
        decoder_channels(2),
    );
    to_rgb(&mut k, &format!("{d}.to_rgb1"), decoder_channels(2));
    for (j, i) in (3..=LOG_SIDE).enumerate() {
        let (cin, cout) = (decoder_channels(i - 1), decoder_channels(i));
        style_conv(&mut k, &format!("{d}.style_convs.{}", 2 * j), cin, cout);
        style_conv(
            &mut k,
            &format!("{d}.style_convs.{}", 2 * j + 1),
            cout,
            cout,
        );
        to_rgb(&mut k, &format!("{d}.to_rgbs.{j}"), cout);
    }
    for n in 0..(2 * LEVELS + 1) {
        let side = 1usize << ((n + 5) / 2);
        k.push((format!("{d}.noises.noise{n}"), vec![1, 1, side, side]));
    }
    for (j, i) in (3..=LOG_SIDE).enumerate() {
        let c = unet_channels(i);
        for which in ["condition_scale", "condition_shift"] {
            conv(&mut k, &format!("{which}.{j}.0"), c, c, 3);
            conv(&mut k, &format!("{which}.{j}.2"), c, c, 3);
        }
    }
    k
}

/// A U-Net ResBlock (down: ×½, up: ×2).
struct ResBlock {
    conv1: Conv,
    conv2: Conv,
    skip: Conv,
    up: bool,
}

impl ResBlock {
    fn forward(&self, x: &Act) -> Act {
        let resize = |a: &Act| {
            if self.up {
                upsample2(a)
            } else {
                downsample2(a)
            }
        };
        let out = self.conv1.forward(x, None, Activation::Leaky(LEAKY));
        let out = self
            .conv2
            .forward(&resize(&out), None, Activation::Leaky(LEAKY));
        let skip = self.skip.forward(&resize(x), None, Activation::None);
        add(out, &skip)
    }

    fn multiply_adds(&self, side_in: usize) -> usize {
        let side_out = if self.up { 2 * side_in } else { side_in / 2 };
        side_in * side_in * 9 * self.conv1.cin() * self.conv1.cout()
            + side_out * side_out * (9 * self.conv2.cin() + self.skip.cin()) * self.conv2.cout()
    }
}

/// A modulated convolution: the style's linear map, the shared weight as an ordinary
/// convolution, and per (output, input) channel `Σ_k W²` for the demodulation.
struct Modulated {
    conv: Conv,
    modulation_w: Vec<f32>,
    modulation_b: Vec<f32>,
    /// `[cout][cin]`: `Σ over the kernel of W[o, i, ·, ·]²`; `None`: no demodulation.
    squares: Option<Vec<f32>>,
}

impl Modulated {
    /// From the `[1, cout, cin, k, k]` weight and the modulation's `[cin, STYLE]` weight and
    /// `[cin]` bias.
    fn new(
        weight: &[f32],
        mod_w: Vec<f32>,
        mod_b: Vec<f32>,
        (cin, cout, k): (usize, usize, usize),
        demodulate: bool,
    ) -> Self {
        let squares = demodulate.then(|| {
            weight
                .chunks_exact(k * k)
                .map(|kernel| kernel.iter().map(|w| w * w).sum())
                .collect()
        });
        Modulated {
            conv: Conv::new(weight, &vec![0.0; cout], cin, cout, k),
            modulation_w: mod_w,
            modulation_b: mod_b,
            squares,
        }
    }

    /// `conv(x · s) · d` for each image's latent (`latents[b]`, `STYLE` values).
    fn forward(&self, x: &Act, latents: &[&[f32]]) -> Act {
        let (cin, cout) = (self.conv.cin(), self.conv.cout());
        let styles: Vec<Vec<f32>> = latents
            .iter()
            .map(|w| {
                (0..cin)
                    .map(|i| {
                        let row = &self.modulation_w[i * STYLE..(i + 1) * STYLE];
                        row.iter().zip(*w).map(|(a, b)| a * b).sum::<f32>() + self.modulation_b[i]
                    })
                    .collect()
            })
            .collect();
        let mut scaled = x.clone();
        let image = x.h * x.w * cin;
        scaled
            .data
            .par_chunks_mut(image)
            .zip(&styles)
            .for_each(|(img, s)| {
                for px in img.chunks_exact_mut(cin) {
                    px.iter_mut().zip(s).for_each(|(v, s)| *v *= s);
                }
            });
        let mut out = self.conv.forward(&scaled, None, Activation::None);
        if let Some(squares) = &self.squares {
            let image = out.h * out.w * cout;
            out.data
                .par_chunks_mut(image)
                .zip(&styles)
                .for_each(|(img, s)| {
                    let d: Vec<f32> = squares
                        .chunks_exact(cin)
                        .map(|sq| {
                            let sum: f32 = sq.iter().zip(s).map(|(q, s)| q * s * s).sum();
                            1.0 / (sum + 1e-8).sqrt()
                        })
                        .collect();
                    for px in img.chunks_exact_mut(cout) {
                        px.iter_mut().zip(&d).for_each(|(v, d)| *v *= d);
                    }
                });
        }
        out
    }
}

/// `LeakyReLU(√2 · modconv(x) + noise_weight · noise + bias)`, after a bilinear ×2 when
/// `up`.
struct StyleConv {
    conv: Modulated,
    noise_weight: f32,
    bias: Vec<f32>,
    up: bool,
}

impl StyleConv {
    fn forward(&self, x: &Act, latents: &[&[f32]], noise: &[f32]) -> Act {
        let mut out = if self.up {
            self.conv.forward(&upsample2(x), latents)
        } else {
            self.conv.forward(x, latents)
        };
        let c = out.c;
        let plane = out.h * out.w;
        assert_eq!(noise.len(), plane, "noise of the layer's size");
        let (nw, bias) = (self.noise_weight, &self.bias);
        out.data.par_chunks_mut(plane * c).for_each(|img| {
            for (px, n) in img.chunks_exact_mut(c).zip(noise) {
                for (v, b) in px.iter_mut().zip(bias) {
                    let y = std::f32::consts::SQRT_2 * *v + nw * n + b;
                    *v = if y < 0.0 { LEAKY * y } else { y };
                }
            }
        });
        out
    }
}

/// A modulated 1×1 convolution to RGB without demodulation, plus bias, plus the previous
/// level's RGB upsampled.
struct ToRgb {
    conv: Modulated,
    bias: Vec<f32>,
}

impl ToRgb {
    fn forward(&self, x: &Act, latents: &[&[f32]], skip: Option<&Act>) -> Act {
        let mut out = self.conv.forward(x, latents);
        for px in out.data.chunks_exact_mut(3) {
            px.iter_mut().zip(&self.bias).for_each(|(v, b)| *v += b);
        }
        match skip {
            Some(s) => add(out, &upsample2(s)),
            None => out,
        }
    }
}

/// The loaded network.
pub struct Gfpgan {
    first: Conv,
    down: Vec<ResBlock>,
    final_conv: Conv,
    /// `[LATENTS · STYLE][4096]` and its bias.
    final_linear: (Vec<f32>, Vec<f32>),
    up: Vec<ResBlock>,
    /// Per level: the two convolutions of `condition_scale`, then of `condition_shift`.
    conditions: Vec<[Conv; 4]>,
    constant: Act,
    style_conv1: StyleConv,
    to_rgb1: ToRgb,
    /// Per level: the upsampling StyleConv, the second StyleConv, the ToRGB.
    levels: Vec<(StyleConv, StyleConv, ToRgb)>,
    /// `noise0` … `noise14`, each a square plane.
    noises: Vec<Vec<f32>>,
}

/// The checkpoint's tensors in [`keys`]' order, taken one by one.
type Tensors = std::vec::IntoIter<Vec<f32>>;

fn take(t: &mut Tensors) -> Vec<f32> {
    t.next().expect("one tensor per key")
}

fn conv(t: &mut Tensors, cin: usize, cout: usize, k: usize) -> Conv {
    let (w, b) = (take(t), take(t));
    Conv::new(&w, &b, cin, cout, k)
}

fn resblock(t: &mut Tensors, cin: usize, cout: usize, up: bool) -> ResBlock {
    let conv1 = conv(t, cin, cin, 3);
    let conv2 = conv(t, cin, cout, 3);
    let skip = Conv::new(&take(t), &vec![0.0; cout], cin, cout, 1);
    ResBlock {
        conv1,
        conv2,
        skip,
        up,
    }
}

fn modulated(t: &mut Tensors, cin: usize, cout: usize, k: usize, demodulate: bool) -> Modulated {
    let (w, mw, mb) = (take(t), take(t), take(t));
    Modulated::new(&w, mw, mb, (cin, cout, k), demodulate)
}

fn style_conv(t: &mut Tensors, cin: usize, cout: usize, up: bool) -> StyleConv {
    StyleConv {
        conv: modulated(t, cin, cout, 3, true),
        noise_weight: take(t)[0],
        bias: take(t),
        up,
    }
}

fn to_rgb(t: &mut Tensors, cin: usize) -> ToRgb {
    ToRgb {
        conv: modulated(t, cin, 3, 1, false),
        bias: take(t),
    }
}

impl Gfpgan {
    fn load(ck: &Checkpoint) -> Result<Gfpgan> {
        let t = &mut strict_tensors(ck, MODEL, &keys())?.into_iter();
        let first = conv(t, 3, unet_channels(LOG_SIDE), 1);
        let down = (3..=LOG_SIDE)
            .rev()
            .map(|i| resblock(t, unet_channels(i), unet_channels(i - 1), false))
            .collect();
        let c4 = unet_channels(2);
        let final_conv = conv(t, c4, c4, 3);
        let up = (3..=LOG_SIDE)
            .map(|i| resblock(t, unet_channels(i - 1), unet_channels(i), true))
            .collect();
        // The encoder's toRGB (not run: GFPGAN's wrapper asks for no intermediate RGB).
        t.nth(2 * LEVELS - 1);
        let final_linear = (take(t), take(t));
        // The style MLP (not run: the latents come from final_linear).
        t.nth(15);
        let c = decoder_channels(2);
        let constant = nchw_to_nhwc(&take(t), 1, c, 4, 4);
        let style_conv1 = style_conv(t, c, c, false);
        let to_rgb1 = to_rgb(t, c);
        let levels = (3..=LOG_SIDE)
            .map(|i| {
                let (cin, cout) = (decoder_channels(i - 1), decoder_channels(i));
                let a = style_conv(t, cin, cout, true);
                let b = style_conv(t, cout, cout, false);
                (a, b, to_rgb(t, cout))
            })
            .collect();
        let noises = (0..2 * LEVELS + 1).map(|_| take(t)).collect();
        let conditions = (3..=LOG_SIDE)
            .map(|i| {
                let c = unet_channels(i);
                [(); 4].map(|_| conv(t, c, c, 3))
            })
            .collect();
        assert!(t.next().is_none(), "every tensor used");
        Ok(Gfpgan {
            first,
            down,
            final_conv,
            final_linear,
            up,
            conditions,
            constant,
            style_conv1,
            to_rgb1,
            levels,
            noises,
        })
    }

    /// The restored faces, `(n, 3, 512, 512)` in [−1, 1] before the clamp.
    fn forward(&self, x: &Act) -> Act {
        let n = x.n;
        // Encoder.
        let first = self.first.forward(x, None, Activation::Leaky(LEAKY));
        // Each level's output is both the next level's input and the decoder's skip.
        let mut skips: Vec<Act> = Vec::with_capacity(LEVELS);
        for block in &self.down {
            let next = block.forward(skips.last().unwrap_or(&first));
            skips.push(next);
        }
        drop(first);
        let feat4 = self.final_conv.forward(
            skips.last().expect("seven levels"),
            None,
            Activation::Leaky(LEAKY),
        );
        // The latents: final_linear over the 4×4 features in NCHW order.
        let flat = nhwc_to_nchw(&feat4);
        let inputs = flat.len() / n;
        let (w, b) = &self.final_linear;
        let latents: Vec<Vec<f32>> = flat
            .chunks_exact(inputs)
            .map(|v| {
                w.par_chunks_exact(inputs)
                    .zip(b.par_iter())
                    .map(|(row, b)| row.iter().zip(v).map(|(a, b)| a * b).sum::<f32>() + b)
                    .collect()
            })
            .collect();
        let latent = |j: usize| -> Vec<&[f32]> {
            latents
                .iter()
                .map(|l| &l[j * STYLE..(j + 1) * STYLE])
                .collect()
        };
        // U-Net decoder: the conditions of each level.
        let mut feat = feat4;
        let mut conditions = Vec::with_capacity(LEVELS);
        for (level, block) in self.up.iter().enumerate() {
            feat = add(feat, &skips[LEVELS - 1 - level]);
            feat = block.forward(&feat);
            let [s0, s1, h0, h1] = &self.conditions[level];
            let scale = s1.forward(
                &s0.forward(&feat, None, Activation::Leaky(LEAKY)),
                None,
                Activation::None,
            );
            let shift = h1.forward(
                &h0.forward(&feat, None, Activation::Leaky(LEAKY)),
                None,
                Activation::None,
            );
            conditions.push((scale, shift));
        }
        drop(skips);
        // StyleGAN2 decoder.
        let c = &self.constant;
        let constant = Act {
            n,
            h: c.h,
            w: c.w,
            c: c.c,
            data: c.data.repeat(n),
        };
        let mut out = self
            .style_conv1
            .forward(&constant, &latent(0), &self.noises[0]);
        let mut rgb = self.to_rgb1.forward(&out, &latent(1), None);
        for (level, (conv1, conv2, to_rgb)) in self.levels.iter().enumerate() {
            let j = 2 * level + 1;
            out = conv1.forward(&out, &latent(j), &self.noises[j]);
            let (scale, shift) = &conditions[level];
            sft_half(&mut out, scale, shift);
            out = conv2.forward(&out, &latent(j + 1), &self.noises[j + 1]);
            rgb = to_rgb.forward(&out, &latent(j + 2), Some(&rgb));
        }
        rgb
    }
}

impl EnhancerNet for Gfpgan {
    fn kind(&self) -> Kind {
        Kind::Gfpgan
    }

    fn applies(&self) -> Applies {
        Applies::AlignedFace(SIDE)
    }

    fn describe(&self) -> String {
        "GFPGANv1Clean (512, channel multiplier 2)".into()
    }

    fn scale(&self) -> usize {
        1
    }

    fn check_size(&self, height: usize, width: usize) -> Result<()> {
        if (height, width) != (SIDE, SIDE) {
            return Err(Error::BadInput(format!(
                "GFPGAN restores a face aligned to the {SIDE}x{SIDE} FFHQ template, not a \
                 {width}x{height} image"
            )));
        }
        Ok(())
    }

    fn multiply_adds(&self, height: usize, width: usize) -> f64 {
        if (height, width) != (SIDE, SIDE) {
            return 0.0;
        }
        let conv = |c: &Conv, k: usize, side: usize| side * side * k * k * c.cin() * c.cout();
        let mut total = conv(&self.first, 1, SIDE) + conv(&self.final_conv, 3, 4);
        let mut side = SIDE;
        for b in &self.down {
            total += b.multiply_adds(side);
            side /= 2;
        }
        total += self.final_linear.0.len();
        for (level, b) in self.up.iter().enumerate() {
            total += b.multiply_adds(side);
            side *= 2;
            total += self.conditions[level]
                .iter()
                .map(|c| conv(c, 3, side))
                .sum::<usize>();
        }
        let modulated = |m: &Modulated, k: usize, side: usize| conv(&m.conv, k, side);
        total += modulated(&self.style_conv1.conv, 3, 4) + modulated(&self.to_rgb1.conv, 1, 4);
        let mut side = 4;
        for (a, b, rgb) in &self.levels {
            side *= 2;
            total += modulated(&a.conv, 3, side)
                + modulated(&b.conv, 3, side)
                + modulated(&rgb.conv, 1, side);
        }
        total as f64
    }

    fn forward_cpu(&self, n: usize, height: usize, width: usize, rgb: &[f32]) -> Result<Vec<f32>> {
        self.check_size(height, width)?;
        if rgb.len() != n * 3 * height * width {
            return Err(Error::BadInput(format!(
                "{} values for {n} RGB images of {width}x{height}",
                rgb.len()
            )));
        }
        let mut x = nchw_to_nhwc(rgb, n, 3, height, width);
        x.data.iter_mut().for_each(|v| *v = (*v - 0.5) / 0.5);
        let out = self.forward(&x);
        let mut y = nhwc_to_nchw(&out);
        y.iter_mut()
            .for_each(|v| *v = (v.clamp(-1.0, 1.0) + 1.0) / 2.0);
        Ok(y)
    }

    fn on_device(&self, device: &Device) -> Result<Arc<dyn DeviceNet>> {
        let tensors = GfpganTensors::of(self)?.to(device)?;
        Ok(on_device(tensors, device, WARM_UP, self))
    }
}

/// The most aligned faces one pass takes: at 512×512 each holds about 0.6 GB of activations
/// at the pass's peak (the decoder's conditions of every level, and the last level's
/// upsampled input), so the engine cuts a batch into pieces of this.
pub const MAX_FACES: usize = 4;

/// The own cuDNN path's warm-up: aligned faces, at one and at a full pass.
const WARM_UP: WarmUp = WarmUp {
    side: SIDE,
    batch: MAX_FACES,
};

fn lrelu(x: &Tensor) -> Result<Tensor> {
    super::device::leaky(x, LEAKY)
}

/// Bilinear ×2 of an NCHW tensor, as [`upsample2`]: PyTorch's `interpolate(scale_factor=2,
/// mode='bilinear', align_corners=False)`, which candle implements on the CPU and on CUDA
/// (one kernel, one output).
fn upsample2_t(x: &Tensor) -> Result<Tensor> {
    Ok(x.upsample_bilinear2d_with_scale(2.0, 2.0, false)?)
}

/// Bilinear ×½ (align_corners=False reads the middle of each 2×2 block: its mean), as
/// [`downsample2`].
fn downsample2_t(x: &Tensor) -> Result<Tensor> {
    Ok(x.avg_pool2d(2)?)
}

/// A convolution of the CPU pass as tensors on the CPU; `bias` false for the bias-less
/// ones (the ResBlocks' skips, the modulated convolutions).
fn weights_of(name: &str, c: &Conv, bias: bool) -> Result<Weights> {
    let (w, b) = c.torch_weights();
    Weights::new(
        format!("gfpgan {name}"),
        w,
        bias.then_some(b),
        (c.cin(), c.cout(), c.kernel()),
    )
}

#[derive(Clone)]
struct ResBlockT {
    conv1: Weights,
    conv2: Weights,
    skip: Weights,
    up: bool,
}

impl ResBlockT {
    fn of(name: &str, b: &ResBlock) -> Result<Self> {
        Ok(ResBlockT {
            conv1: weights_of(&format!("{name}.conv1"), &b.conv1, true)?,
            conv2: weights_of(&format!("{name}.conv2"), &b.conv2, true)?,
            skip: weights_of(&format!("{name}.skip"), &b.skip, false)?,
            up: b.up,
        })
    }

    fn to(&self, d: &Device) -> Result<Self> {
        Ok(ResBlockT {
            conv1: self.conv1.to(d)?,
            conv2: self.conv2.to(d)?,
            skip: self.skip.to(d)?,
            up: self.up,
        })
    }

    fn run(&self, x: &Tensor, path: &ConvPath) -> Result<Tensor> {
        let resize = |a: &Tensor| {
            if self.up {
                upsample2_t(a)
            } else {
                downsample2_t(a)
            }
        };
        let out = lrelu(&self.conv1.conv(x, path)?)?;
        let out = lrelu(&self.conv2.conv(&resize(&out)?, path)?)?;
        Ok((out + self.skip.conv(&resize(x)?, path)?)?)
    }

    fn elements(&self) -> usize {
        self.conv1.elements() + self.conv2.elements() + self.skip.elements()
    }
}

/// A modulated convolution as tensors: the style `latent · Mᵀ + b` per image scales the
/// input channels, the shared weight convolves, the demodulation scales the output channels.
#[derive(Clone)]
struct ModulatedT {
    conv: Weights,
    /// The modulation's weight transposed, `(STYLE, cin)`, and bias `(1, cin)`.
    modulation_t: Tensor,
    modulation_b: Tensor,
    /// `(cin, cout)`: `Σ over the kernel of W[o, i]²`, transposed; `None`: no demodulation.
    squares_t: Option<Tensor>,
}

impl ModulatedT {
    fn of(name: &str, m: &Modulated) -> Result<Self> {
        let (cin, cout) = (m.conv.cin(), m.conv.cout());
        let cpu = &Device::Cpu;
        Ok(ModulatedT {
            conv: weights_of(name, &m.conv, false)?,
            modulation_t: Tensor::from_slice(&m.modulation_w, (cin, STYLE), cpu)?
                .t()?
                .contiguous()?,
            modulation_b: Tensor::from_slice(&m.modulation_b, (1, cin), cpu)?,
            squares_t: m
                .squares
                .as_ref()
                .map(|q| Tensor::from_slice(q, (cout, cin), cpu)?.t()?.contiguous())
                .transpose()?,
        })
    }

    fn to(&self, d: &Device) -> Result<Self> {
        Ok(ModulatedT {
            conv: self.conv.to(d)?,
            modulation_t: self.modulation_t.to_device(d)?,
            modulation_b: self.modulation_b.to_device(d)?,
            squares_t: self
                .squares_t
                .as_ref()
                .map(|q| q.to_device(d))
                .transpose()?,
        })
    }

    /// `conv(x · s) · d`, with `latent` `(n, STYLE)`.
    fn run(&self, x: &Tensor, latent: &Tensor, path: &ConvPath) -> Result<Tensor> {
        let (n, cin, _, _) = x.dims4()?;
        let s = latent
            .matmul(&self.modulation_t)?
            .broadcast_add(&self.modulation_b)?;
        let out = self
            .conv
            .conv(&x.broadcast_mul(&s.reshape((n, cin, 1, 1))?)?, path)?;
        match &self.squares_t {
            None => Ok(out),
            Some(q) => {
                let cout = out.dim(1)?;
                let d = (s.sqr()?.matmul(q)? + 1e-8)?.sqrt()?.recip()?;
                Ok(out.broadcast_mul(&d.reshape((n, cout, 1, 1))?)?)
            }
        }
    }

    fn elements(&self) -> usize {
        self.conv.elements()
            + self.modulation_t.elem_count()
            + self.modulation_b.elem_count()
            + self.squares_t.as_ref().map_or(0, Tensor::elem_count)
    }
}

#[derive(Clone)]
struct StyleConvT {
    conv: ModulatedT,
    /// The layer's stored noise times its weight, `(1, 1, side, side)`.
    noise: Tensor,
    /// `(1, cout, 1, 1)`.
    bias: Tensor,
    up: bool,
}

impl StyleConvT {
    fn of(name: &str, s: &StyleConv, noise: &[f32]) -> Result<Self> {
        let side = (noise.len() as f64).sqrt() as usize;
        let cpu = &Device::Cpu;
        let cout = s.bias.len();
        Ok(StyleConvT {
            conv: ModulatedT::of(name, &s.conv)?,
            noise: Tensor::from_slice(noise, (1, 1, side, side), cpu)?
                .affine(f64::from(s.noise_weight), 0.0)?,
            bias: Tensor::from_slice(&s.bias, (1, cout, 1, 1), cpu)?,
            up: s.up,
        })
    }

    fn to(&self, d: &Device) -> Result<Self> {
        Ok(StyleConvT {
            conv: self.conv.to(d)?,
            noise: self.noise.to_device(d)?,
            bias: self.bias.to_device(d)?,
            up: self.up,
        })
    }

    fn run(&self, x: &Tensor, latent: &Tensor, path: &ConvPath) -> Result<Tensor> {
        let out = if self.up {
            self.conv.run(&upsample2_t(x)?, latent, path)?
        } else {
            self.conv.run(x, latent, path)?
        };
        let out = out
            .affine(std::f64::consts::SQRT_2, 0.0)?
            .broadcast_add(&self.noise)?
            .broadcast_add(&self.bias)?;
        lrelu(&out)
    }

    fn elements(&self) -> usize {
        self.conv.elements() + self.noise.elem_count() + self.bias.elem_count()
    }
}

#[derive(Clone)]
struct ToRgbT {
    conv: ModulatedT,
    bias: Tensor,
}

impl ToRgbT {
    fn of(name: &str, t: &ToRgb) -> Result<Self> {
        Ok(ToRgbT {
            conv: ModulatedT::of(name, &t.conv)?,
            bias: Tensor::from_slice(&t.bias, (1, 3, 1, 1), &Device::Cpu)?,
        })
    }

    fn to(&self, d: &Device) -> Result<Self> {
        Ok(ToRgbT {
            conv: self.conv.to(d)?,
            bias: self.bias.to_device(d)?,
        })
    }

    fn run(
        &self,
        x: &Tensor,
        latent: &Tensor,
        skip: Option<&Tensor>,
        path: &ConvPath,
    ) -> Result<Tensor> {
        let out = self.conv.run(x, latent, path)?.broadcast_add(&self.bias)?;
        Ok(match skip {
            Some(s) => (out + upsample2_t(s)?)?,
            None => out,
        })
    }
}

/// GFPGAN's tensor pass: the CPU pass's layers as candle tensors, in the same order.
#[derive(Clone)]
struct GfpganTensors {
    first: Weights,
    down: Vec<ResBlockT>,
    final_conv: Weights,
    /// `final_linear`'s weight transposed, `(4096, LATENTS · STYLE)`, and bias `(1, …)`.
    final_linear: (Tensor, Tensor),
    up: Vec<ResBlockT>,
    conditions: Vec<[Weights; 4]>,
    /// `(1, 512, 4, 4)`.
    constant: Tensor,
    style_conv1: StyleConvT,
    to_rgb1: ToRgbT,
    levels: Vec<(StyleConvT, StyleConvT, ToRgbT)>,
}

impl GfpganTensors {
    fn of(g: &Gfpgan) -> Result<Self> {
        let cpu = &Device::Cpu;
        let (w, b) = &g.final_linear;
        let inputs = w.len() / b.len();
        let names = |prefix: &'static str, n: usize| (0..n).map(move |j| format!("{prefix}.{j}"));
        let levels = g
            .levels
            .iter()
            .enumerate()
            .map(|(l, (a, b, rgb))| {
                let d = "stylegan_decoder";
                Ok((
                    StyleConvT::of(
                        &format!("{d}.style_convs.{}", 2 * l),
                        a,
                        &g.noises[2 * l + 1],
                    )?,
                    StyleConvT::of(
                        &format!("{d}.style_convs.{}", 2 * l + 1),
                        b,
                        &g.noises[2 * l + 2],
                    )?,
                    ToRgbT::of(&format!("{d}.to_rgbs.{l}"), rgb)?,
                ))
            })
            .collect::<Result<_>>()?;
        let c = &g.constant;
        Ok(GfpganTensors {
            first: weights_of("conv_body_first", &g.first, true)?,
            down: names("conv_body_down", g.down.len())
                .zip(&g.down)
                .map(|(n, b)| ResBlockT::of(&n, b))
                .collect::<Result<_>>()?,
            final_conv: weights_of("final_conv", &g.final_conv, true)?,
            final_linear: (
                Tensor::from_slice(w, (b.len(), inputs), cpu)?
                    .t()?
                    .contiguous()?,
                Tensor::from_slice(b, (1, b.len()), cpu)?,
            ),
            up: names("conv_body_up", g.up.len())
                .zip(&g.up)
                .map(|(n, b)| ResBlockT::of(&n, b))
                .collect::<Result<_>>()?,
            conditions: g
                .conditions
                .iter()
                .enumerate()
                .map(|(l, convs)| {
                    let name = |i: usize| {
                        let which = ["condition_scale", "condition_shift"][i / 2];
                        format!("{which}.{l}.{}", 2 * (i % 2))
                    };
                    Ok([
                        weights_of(&name(0), &convs[0], true)?,
                        weights_of(&name(1), &convs[1], true)?,
                        weights_of(&name(2), &convs[2], true)?,
                        weights_of(&name(3), &convs[3], true)?,
                    ])
                })
                .collect::<Result<_>>()?,
            constant: Tensor::from_slice(&nhwc_to_nchw(c), (1, c.c, c.h, c.w), cpu)?,
            style_conv1: StyleConvT::of(
                "stylegan_decoder.style_conv1",
                &g.style_conv1,
                &g.noises[0],
            )?,
            to_rgb1: ToRgbT::of("stylegan_decoder.to_rgb1", &g.to_rgb1)?,
            levels,
        })
    }

    fn to(&self, d: &Device) -> Result<Self> {
        let four = |c: &[Weights; 4]| -> Result<[Weights; 4]> {
            Ok([c[0].to(d)?, c[1].to(d)?, c[2].to(d)?, c[3].to(d)?])
        };
        Ok(GfpganTensors {
            first: self.first.to(d)?,
            down: self.down.iter().map(|b| b.to(d)).collect::<Result<_>>()?,
            final_conv: self.final_conv.to(d)?,
            final_linear: (
                self.final_linear.0.to_device(d)?,
                self.final_linear.1.to_device(d)?,
            ),
            up: self.up.iter().map(|b| b.to(d)).collect::<Result<_>>()?,
            conditions: self.conditions.iter().map(four).collect::<Result<_>>()?,
            constant: self.constant.to_device(d)?,
            style_conv1: self.style_conv1.to(d)?,
            to_rgb1: self.to_rgb1.to(d)?,
            levels: self
                .levels
                .iter()
                .map(|(a, b, c)| Ok((a.to(d)?, b.to(d)?, c.to(d)?)))
                .collect::<Result<_>>()?,
        })
    }
}

impl TensorPass for GfpganTensors {
    fn run(&self, x: &Tensor, path: &ConvPath) -> Result<Tensor> {
        let n = x.dim(0)?;
        let x = x.affine(2.0, -1.0)?;
        // Encoder.
        let first = lrelu(&self.first.conv(&x, path)?)?;
        let mut skips: Vec<Tensor> = Vec::with_capacity(LEVELS);
        for block in &self.down {
            let next = block.run(skips.last().unwrap_or(&first), path)?;
            skips.push(next);
        }
        drop(first);
        let feat4 = lrelu(
            &self
                .final_conv
                .conv(skips.last().expect("seven levels"), path)?,
        )?;
        // The latents: final_linear over the 4×4 features in NCHW order.
        let (w, b) = &self.final_linear;
        let latents = feat4.flatten_from(1)?.matmul(w)?.broadcast_add(b)?;
        let latent = |j: usize| latents.narrow(1, j * STYLE, STYLE)?.contiguous();
        // U-Net decoder: the conditions of each level.
        let mut feat = feat4;
        let mut conditions = Vec::with_capacity(LEVELS);
        for (level, block) in self.up.iter().enumerate() {
            feat = block.run(&(feat + &skips[LEVELS - 1 - level])?, path)?;
            let [s0, s1, h0, h1] = &self.conditions[level];
            let scale = s1.conv(&lrelu(&s0.conv(&feat, path)?)?, path)?;
            let shift = h1.conv(&lrelu(&h0.conv(&feat, path)?)?, path)?;
            conditions.push((scale, shift));
        }
        drop((skips, feat));
        // StyleGAN2 decoder.
        let (_, c, h, w) = self.constant.dims4()?;
        let constant = self.constant.broadcast_as((n, c, h, w))?.contiguous()?;
        let mut out = self.style_conv1.run(&constant, &latent(0)?, path)?;
        let mut rgb = self.to_rgb1.run(&out, &latent(1)?, None, path)?;
        for (level, (conv1, conv2, to_rgb)) in self.levels.iter().enumerate() {
            let j = 2 * level + 1;
            out = conv1.run(&out, &latent(j)?, path)?;
            // The SFT on the second half of the channels.
            let (scale, shift) = &conditions[level];
            let half = out.dim(1)? / 2;
            let kept = out.narrow(1, 0, half)?;
            let modulated = ((out.narrow(1, half, half)? * scale)? + shift)?;
            out = Tensor::cat(&[kept, modulated], 1)?;
            out = conv2.run(&out, &latent(j + 1)?, path)?;
            rgb = to_rgb.run(&out, &latent(j + 2)?, Some(&rgb), path)?;
        }
        // [−1, 1] back to [0, 1] (the caller clamps).
        Ok(rgb.affine(0.5, 0.5)?)
    }

    fn elements(&self) -> usize {
        let blocks: usize = self
            .down
            .iter()
            .chain(&self.up)
            .map(ResBlockT::elements)
            .sum();
        let conditions: usize = self
            .conditions
            .iter()
            .flatten()
            .map(Weights::elements)
            .sum();
        let levels: usize = self
            .levels
            .iter()
            .map(|(a, b, c)| a.elements() + b.elements() + c.conv.elements() + 3)
            .sum();
        self.first.elements()
            + blocks
            + self.final_conv.elements()
            + self.final_linear.0.elem_count()
            + self.final_linear.1.elem_count()
            + conditions
            + self.constant.elem_count()
            + self.style_conv1.elements()
            + self.to_rgb1.conv.elements()
            + 3
            + levels
    }

    fn peak_values(&self, n: usize, h: usize, w: usize) -> usize {
        // Held through the StyleGAN decoder: every level's scale and shift.
        let conditions: usize = (3..=LOG_SIDE)
            .map(|i| 2 * unet_channels(i) * (1 << (2 * i)))
            .sum();
        // At the last level's upsampling StyleConv: its input (the level below), the
        // upsampled input and its scaled copy, the convolution's output and its next step,
        // the RGB and its upsampled skip.
        let (cin, cout) = (decoder_channels(LOG_SIDE - 1), decoder_channels(LOG_SIDE));
        let last = h * w * (cin / 4 + 2 * cin + 2 * cout + 6);
        n * (conditions + last)
    }
}

/// `a + b`, elementwise (same shape).
fn add(mut a: Act, b: &Act) -> Act {
    assert_eq!(
        a.data.len(),
        b.data.len(),
        "sum of activations of one shape"
    );
    a.data
        .par_iter_mut()
        .zip(b.data.par_iter())
        .for_each(|(x, y)| *x += y);
    a
}

/// The SFT on the second half of the channels: `x · scale + shift`.
fn sft_half(x: &mut Act, scale: &Act, shift: &Act) {
    let (c, half) = (x.c, x.c / 2);
    assert_eq!(scale.c, half, "SFT conditions of half the channels");
    x.data
        .par_chunks_mut(c)
        .zip(scale.data.par_chunks(half))
        .zip(shift.data.par_chunks(half))
        .for_each(|((px, s), h)| {
            for ((v, s), h) in px[half..].iter_mut().zip(s).zip(h) {
                *v = *v * s + h;
            }
        });
}

/// PyTorch's `interpolate(scale_factor=0.5, mode='bilinear', align_corners=False)` on even
/// sides: each output pixel the mean of a 2×2 block.
fn downsample2(x: &Act) -> Act {
    let (h, w, c) = (x.h / 2, x.w / 2, x.c);
    let mut data = vec![0f32; x.n * h * w * c];
    data.par_chunks_mut(w * c)
        .enumerate()
        .for_each(|(row, out)| {
            let (b, y) = (row / h, row % h);
            let at = |yy: usize, xx: usize| ((b * x.h + yy) * x.w + xx) * c;
            for xo in 0..w {
                let (p00, p01) = (at(2 * y, 2 * xo), at(2 * y, 2 * xo + 1));
                let (p10, p11) = (at(2 * y + 1, 2 * xo), at(2 * y + 1, 2 * xo + 1));
                for ch in 0..c {
                    let top = 0.5 * x.data[p00 + ch] + 0.5 * x.data[p01 + ch];
                    let bottom = 0.5 * x.data[p10 + ch] + 0.5 * x.data[p11 + ch];
                    out[xo * c + ch] = 0.5 * top + 0.5 * bottom;
                }
            }
        });
    Act {
        n: x.n,
        h,
        w,
        c,
        data,
    }
}

/// PyTorch's `interpolate(scale_factor=2, mode='bilinear', align_corners=False)`: output
/// `2i` reads `0.25·x[i−1] + 0.75·x[i]`, `2i+1` reads `0.75·x[i] + 0.25·x[i+1]`, the
/// neighbours clamped at the edges.
fn upsample2(x: &Act) -> Act {
    let (h, w, c) = (2 * x.h, 2 * x.w, x.c);
    // Source rows/columns and the weight of the second, per output position.
    let taps = |n: usize, o: usize| -> (usize, usize, f32) {
        let i = o / 2;
        if o % 2 == 0 {
            if i == 0 {
                (0, 0, 0.0)
            } else {
                (i - 1, i, 0.75)
            }
        } else {
            (i, (i + 1).min(n - 1), 0.25)
        }
    };
    let mut data = vec![0f32; x.n * h * w * c];
    data.par_chunks_mut(w * c)
        .enumerate()
        .for_each(|(row, out)| {
            let (b, yo) = (row / h, row % h);
            let (y0, y1, ly) = taps(x.h, yo);
            let at = |yy: usize, xx: usize| ((b * x.h + yy) * x.w + xx) * c;
            for xo in 0..w {
                let (x0, x1, lx) = taps(x.w, xo);
                let (p00, p01, p10, p11) = (at(y0, x0), at(y0, x1), at(y1, x0), at(y1, x1));
                for ch in 0..c {
                    let top = (1.0 - lx) * x.data[p00 + ch] + lx * x.data[p01 + ch];
                    let bottom = (1.0 - lx) * x.data[p10 + ch] + lx * x.data[p11 + ch];
                    out[xo * c + ch] = (1.0 - ly) * top + ly * bottom;
                }
            }
        });
    Act {
        n: x.n,
        h,
        w,
        c,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_layout_has_285_tensors_and_86_million_parameters() {
        let k = keys();
        assert_eq!(k.len(), 285);
        let params: usize = k
            .iter()
            .filter(|(name, _)| !name.contains(".noises."))
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        // 86.4 M parameters as published, besides the 15 noise buffers.
        assert!((86_000_000..86_900_000).contains(&params), "{params}");
    }

    #[test]
    fn bilinear_halving_and_doubling_follow_pytorch() {
        let x = Act {
            n: 1,
            h: 2,
            w: 2,
            c: 1,
            data: vec![0.0, 4.0, 8.0, 12.0],
        };
        assert_eq!(downsample2(&x).data, vec![6.0]);
        let up = upsample2(&x);
        // Row 0 of the 4x4: columns at x = 0, 0.25, 0.75, 1 of the first row.
        assert_eq!(&up.data[..4], &[0.0, 1.0, 3.0, 4.0]);
        // Row 1 (y = 0.25): a quarter of the way to the second row.
        assert_eq!(&up.data[4..8], &[2.0, 3.0, 5.0, 6.0]);
        assert_eq!(&up.data[12..], &[8.0, 9.0, 11.0, 12.0]);
    }

    #[test]
    fn the_tensor_resizes_match_the_cpu_passes() {
        // 3 channels of 5x6 with distinct values: both halves of the tensor pass's resizes
        // against the CPU pass's (which the test above ties to PyTorch).
        let (c, h, w) = (3, 6, 5);
        let nchw: Vec<f32> = (0..c * h * w).map(|i| ((i * 29) % 97) as f32).collect();
        let t = Tensor::from_slice(&nchw, (1, c, h, w), &Device::Cpu).unwrap();
        let act = nchw_to_nhwc(&nchw, 1, c, h, w);
        let up: Vec<f32> = upsample2_t(&t)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let want = nhwc_to_nchw(&upsample2(&act));
        assert_eq!(up.len(), want.len());
        // candle blends in f64, the CPU pass in f32: an ulp apart at most (values up to 96).
        let worst = up
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst <= 1e-5, "{worst}");
        let even = t.narrow(3, 0, 4).unwrap().contiguous().unwrap();
        let down: Vec<f32> = downsample2_t(&even)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let even: Vec<f32> = even.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(
            down,
            nhwc_to_nchw(&downsample2(&nchw_to_nhwc(&even, 1, c, h, 4)))
        );
    }

    #[test]
    fn the_tensor_pass_computes_what_the_cpu_pass_does() {
        // The CPU pass is checked against the upstream GFPGANv1Clean (tests/enhancer.rs);
        // the tensor pass (what CUDA runs) against it here, on candle's CPU device, on two
        // different faces in one batch (each its own latents, styles and demodulation).
        let net = super::super::recognise(&super::super::testing::checkpoint(&keys())).unwrap();
        let plane = 3 * SIDE * SIDE;
        let faces: Vec<f32> = (0..2 * plane)
            .map(|i| {
                let (face, p) = (i / plane, i % plane);
                let (y, x) = (p % (SIDE * SIDE) / SIDE, p % SIDE);
                let ramp = (x + 2 * y) as f32 / (3 * SIDE) as f32;
                let texture = ((p * 37 + face * 11) % 101) as f32 / 400.0;
                if face == 0 {
                    ramp * 0.7 + texture
                } else {
                    1.0 - ramp * 0.8 - texture
                }
            })
            .collect();
        let cpu = net.forward_cpu(2, SIDE, SIDE, &faces).unwrap();
        let on = net.on_device(&Device::Cpu).unwrap();
        assert_eq!(on.conv_path(), "candle");
        let tensors = on.forward(2, SIDE, SIDE, &faces).unwrap();
        assert_eq!(cpu.len(), tensors.len());
        let worst = cpu
            .iter()
            .zip(&tensors)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        // Measured: 9e-7 (the same f32 sums in another order).
        assert!(worst < 1e-5, "the passes differ by {worst}");
        // Not a trivial output: values inside (0, 1), and the two faces differ.
        let inside = cpu.iter().filter(|v| **v > 0.01 && **v < 0.99).count();
        assert!(
            inside > cpu.len() / 4,
            "{inside} of {} inside (0, 1)",
            cpu.len()
        );
        let apart = cpu[..plane]
            .iter()
            .zip(&cpu[plane..])
            .filter(|(a, b)| (*a - *b).abs() > 0.01)
            .count();
        assert!(apart > plane / 50, "the two faces differ at {apart} values");
        let (one, four) = (on.bytes(1, SIDE, SIDE), on.bytes(MAX_FACES, SIDE, SIDE));
        let weights = on.bytes(0, SIDE, SIDE);
        // The published file's 86 M parameters (less the unused style MLP), and about
        // 0.6 GB of activations per face.
        assert!((300_000_000..360_000_000).contains(&weights), "{weights}");
        assert!(
            (300_000_000..700_000_000).contains(&(one - weights)),
            "{one}"
        );
        assert_eq!(four - weights, 4 * (one - weights));
    }
}
