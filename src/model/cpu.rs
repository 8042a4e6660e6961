//! The generator's f32 forward pass on the CPU, without candle's convolution kernels.
//!
//! candle's CPU convolutions reach about a sixth of what the cores can do on Wav2Lip (its
//! transposed convolution is a direct loop; its convolution builds small im2col tiles per
//! image, in NCHW, and scatters the result), which made the CPU path several times slower than
//! PyTorch. Here activations stay in NHWC for the whole pass, and every layer is one
//! matrix product per tile of output pixels:
//!
//! - a convolution gathers, for each output pixel, the `k·k` input pixels' channel vectors
//!   (contiguous in NHWC) into a row, and multiplies the rows by the weights laid out as
//!   `[k·k·cin, cout]`; the product rows are output pixels in NHWC, written in place, with
//!   bias, residual and ReLU applied in the same pass. 1×1 convolutions use the input rows
//!   directly;
//! - a transposed convolution with stride `s` is `s²` ordinary convolutions, one per output
//!   phase (`oy mod s`, `ox mod s`), each over the taps of the kernel that reach that phase
//!   (`iy = a + (py + p − kh) / s` where that divides): no zero-stuffing, no scatter-add;
//!   the phases are interleaved into the output at the end.
//!
//! Tiles run in parallel on rayon's pool; the products are `gemm`'s kernels (what candle
//! itself calls for matrix products). candle's own operations stay the reference: tests
//! compare both passes, and both against PyTorch.

use rayon::prelude::*;

use super::arch::{LayerKind, LayerSpec, FACE_SIZE};
use super::wav2lip::ConvBlock;
use super::Result;

/// Activations, NHWC.
#[derive(Debug, Clone)]
pub(crate) struct Act {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub data: Vec<f32>,
}

/// What follows a convolution's bias (and residual), applied in the same pass.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Activation<'a> {
    None,
    Relu,
    /// `max(x, 0) + slope · min(x, 0)`.
    Leaky(f32),
    /// [`Activation::Leaky`] with one slope per output channel (PyTorch's `PReLU(c)`).
    PRelu(&'a [f32]),
}

impl Activation<'_> {
    /// Applies the activation to one output pixel's channel vector.
    fn apply(self, row: &mut [f32]) {
        match self {
            Activation::None => {}
            Activation::Relu => row.iter_mut().for_each(|v| *v = v.max(0.0)),
            Activation::Leaky(a) => row.iter_mut().for_each(|v| {
                if *v < 0.0 {
                    *v *= a
                }
            }),
            Activation::PRelu(a) => row.iter_mut().zip(a).for_each(|(v, a)| {
                if *v < 0.0 {
                    *v *= a
                }
            }),
        }
    }
}

/// A stride-1 convolution with a square kernel, "same" padding and bias, in NHWC, for the
/// networks that run beside the generator on the CPU (the enhancers): the generator's own
/// product kernel behind a plain interface.
#[derive(Debug, Clone)]
pub(crate) struct Conv {
    gather: Gather,
    bias: Vec<f32>,
    cin: usize,
    cout: usize,
    /// Kernel side, stride and padding (on every side).
    k: usize,
    stride: usize,
    pad: usize,
}

impl Conv {
    /// From PyTorch's `[cout, cin, k, k]` weight (row-major) and `[cout]` bias, padding
    /// `k / 2` on every side.
    pub fn new(weight: &[f32], bias: &[f32], cin: usize, cout: usize, k: usize) -> Self {
        Self::strided(weight, bias, (cin, cout, k), 1, k / 2)
    }

    /// From PyTorch's weight and bias, with `stride` and `pad` on every side (the output is
    /// `(h + 2·pad − k) / stride + 1` high, as PyTorch's).
    pub fn strided(
        weight: &[f32],
        bias: &[f32],
        (cin, cout, k): (usize, usize, usize),
        stride: usize,
        pad: usize,
    ) -> Self {
        assert_eq!(weight.len(), cout * cin * k * k, "convolution weight size");
        assert_eq!(bias.len(), cout, "convolution bias size");
        Conv {
            gather: Gather::conv(weight, cin, cout, k, pad, (stride, stride)),
            bias: bias.to_vec(),
            cin,
            cout,
            k,
            stride,
            pad,
        }
    }

    pub fn cin(&self) -> usize {
        self.cin
    }

    pub fn cout(&self) -> usize {
        self.cout
    }

    /// The kernel's side.
    pub fn kernel(&self) -> usize {
        self.k
    }

    /// The weight in PyTorch's `[cout, cin, k, k]` layout (what it was made from) and the
    /// bias: for a tensor pass of the same network.
    pub fn torch_weights(&self) -> (Vec<f32>, &[f32]) {
        let (cin, cout, k) = (self.cin, self.cout, self.k);
        let g = &self.gather.weight;
        let mut w = vec![0f32; cout * cin * k * k];
        for (i, v) in w.iter_mut().enumerate() {
            let (o, c, t) = (i / (cin * k * k), i / (k * k) % cin, i % (k * k));
            *v = g[(t * cin + c) * cout + o];
        }
        (w, &self.bias)
    }

    /// `act(conv(x) + bias + residual)`: the same size as `x` at stride 1 with "same"
    /// padding; the residual has the output's shape.
    pub fn forward(&self, x: &Act, residual: Option<&Act>, act: Activation) -> Act {
        assert_eq!(x.c, self.cin, "convolution input channels");
        let out = |side: usize| (side + 2 * self.pad).saturating_sub(self.k) / self.stride + 1;
        let (h, w) = (out(x.h), out(x.w));
        let data = self
            .gather
            .run(x, (h, w), self.cout, &self.bias, residual, act);
        Act {
            n: x.n,
            h,
            w,
            c: self.cout,
            data,
        }
    }
}

/// Where a layer's output pixels come from: each position `(a, b)` of an output grid reads
/// the input at `(a·sy + dy, b·sx + dx)` for every tap `(dy, dx)`.
#[derive(Debug, Clone)]
struct Gather {
    stride: (usize, usize),
    taps: Vec<(isize, isize)>,
    /// `[taps·cin, cout]`, row `t·cin + ci`.
    weight: Vec<f32>,
}

#[derive(Debug, Clone)]
enum Op {
    Conv(Gather),
    /// One gather per output phase `(py, px)`, in row-major phase order.
    Transposed {
        stride: usize,
        phases: Vec<Gather>,
    },
}

#[derive(Debug, Clone)]
struct Layer {
    /// The layer's path in the checkpoint (`face_encoder_blocks.1.0`, ...).
    path: String,
    spec: LayerSpec,
    op: Op,
    bias: Vec<f32>,
}

/// The generator's layers, ready for the CPU pass.
#[derive(Debug, Clone)]
pub struct CpuNet {
    face_encoder: Vec<Vec<Layer>>,
    audio_encoder: Vec<Layer>,
    face_decoder: Vec<Vec<Layer>>,
    output_block: Vec<Layer>,
}

/// Output pixels per tile: about 2 MiB of gathered input per tile, within 64–1024 rows.
fn tile_rows(k: usize) -> usize {
    ((1usize << 19) / k.max(1)).clamp(64, 1024)
}

impl CpuNet {
    /// Rearranges the (folded, f32, CPU) weights of every block.
    pub(super) fn new(
        face_encoder: &[Vec<ConvBlock>],
        audio_encoder: &[ConvBlock],
        face_decoder: &[Vec<ConvBlock>],
        output_block: &[ConvBlock],
    ) -> Result<Self> {
        let seq = |blocks: &[ConvBlock]| blocks.iter().map(Layer::new).collect::<Result<Vec<_>>>();
        Ok(CpuNet {
            face_encoder: face_encoder.iter().map(|b| seq(b)).collect::<Result<_>>()?,
            audio_encoder: seq(audio_encoder)?,
            face_decoder: face_decoder.iter().map(|b| seq(b)).collect::<Result<_>>()?,
            output_block: seq(output_block)?,
        })
    }

    /// Mel windows `(n, 1, 80, 16)` and faces `(n, 6, 96, 96)`, NCHW, in; predicted faces
    /// `(n, 3, 96, 96)`, NCHW, in (0, 1), out.
    pub fn forward(&self, mel: &[f32], face: &[f32], n: usize) -> Vec<f32> {
        self.forward_observed(mel, face, n, &mut |_, _| {})
    }

    /// [`Self::forward`], showing `observe` every layer's output (its path and values, after
    /// bias, residual and ReLU; NHWC) as it is computed. The output layer's values are the
    /// sigmoid's input.
    pub fn forward_observed(
        &self,
        mel: &[f32],
        face: &[f32],
        n: usize,
        observe: &mut dyn FnMut(&str, &[f32]),
    ) -> Vec<f32> {
        use super::arch::{FACE_CHANNELS, MEL_BINS, MEL_STEPS};
        // Every block starts with a layer reading its input by reference, so encoder outputs
        // are kept once (as skips) and not copied.
        let mut run = |layers: &[Layer], x: &Act| {
            let (first, rest) = layers.split_first().expect("blocks have layers");
            let mut apply = |l: &Layer, x: &Act| {
                let y = l.forward(x);
                observe(&l.path, &y.data);
                y
            };
            let y = apply(first, x);
            rest.iter().fold(y, |x, l| apply(l, &x))
        };
        // One input channel: NCHW and NHWC are the same bytes.
        let mel = Act {
            n,
            h: MEL_BINS,
            w: MEL_STEPS,
            c: 1,
            data: mel.to_vec(),
        };
        let audio = run(&self.audio_encoder, &mel);
        let face = nchw_to_nhwc(face, n, FACE_CHANNELS, FACE_SIZE, FACE_SIZE);
        let mut feats: Vec<Act> = Vec::with_capacity(self.face_encoder.len());
        for block in &self.face_encoder {
            let x = run(block, feats.last().unwrap_or(&face));
            feats.push(x);
        }
        let mut x = audio;
        for block in &self.face_decoder {
            x = run(block, &x);
            let skip = feats
                .pop()
                .expect("as many encoder blocks as decoder blocks");
            x = concat_channels(&x, &skip);
        }
        let mut x = run(&self.output_block, &x);
        x.data
            .par_iter_mut()
            .for_each(|v| *v = 1.0 / (1.0 + (-*v).exp()));
        nhwc_to_nchw(&x)
    }
}

impl Layer {
    fn new(block: &ConvBlock) -> Result<Self> {
        let s = *block.spec();
        let w: Vec<f32> = block.weight().flatten_all()?.to_vec1()?;
        let bias: Vec<f32> = block.bias().flatten_all()?.to_vec1()?;
        let (k, p) = (s.kernel, s.padding as isize);
        let op = match s.kind {
            LayerKind::Conv | LayerKind::Plain => {
                Op::Conv(Gather::conv(&w, s.cin, s.cout, k, s.padding, s.stride))
            }
            LayerKind::ConvTranspose => {
                let st = s.stride.0 as isize;
                // Kernel offsets reaching output phase `q` and the input offset they read.
                let reach = |q: usize| -> Vec<(usize, isize)> {
                    (0..k)
                        .filter_map(|kk| {
                            let d = q as isize + p - kk as isize;
                            (d.rem_euclid(st) == 0).then(|| (kk, d.div_euclid(st)))
                        })
                        .collect()
                };
                let mut phases = Vec::new();
                for py in 0..s.stride.0 {
                    for px in 0..s.stride.0 {
                        let (ry, rx) = (reach(py), reach(px));
                        let mut taps = Vec::new();
                        // PyTorch [cin, cout, kh, kw] → [t·cin + ci, cout].
                        let mut weight = Vec::with_capacity(ry.len() * rx.len() * s.cin * s.cout);
                        for &(kh, dy) in &ry {
                            for &(kw, dx) in &rx {
                                taps.push((dy, dx));
                                for c in 0..s.cin {
                                    for o in 0..s.cout {
                                        weight.push(w[((c * s.cout + o) * k + kh) * k + kw]);
                                    }
                                }
                            }
                        }
                        phases.push(Gather {
                            stride: (1, 1),
                            taps,
                            weight,
                        });
                    }
                }
                Op::Transposed {
                    stride: s.stride.0,
                    phases,
                }
            }
        };
        Ok(Layer {
            path: block.path().to_string(),
            spec: s,
            op,
            bias,
        })
    }

    fn forward(&self, x: &Act) -> Act {
        let s = &self.spec;
        let act = if s.kind == LayerKind::Plain {
            Activation::None
        } else {
            Activation::Relu
        };
        match &self.op {
            Op::Conv(g) => {
                let oh = (x.h + 2 * s.padding - s.kernel) / s.stride.0 + 1;
                let ow = (x.w + 2 * s.padding - s.kernel) / s.stride.1 + 1;
                let residual = s.residual.then_some(x);
                let data = g.run(x, (oh, ow), s.cout, &self.bias, residual, act);
                Act {
                    n: x.n,
                    h: oh,
                    w: ow,
                    c: s.cout,
                    data,
                }
            }
            Op::Transposed { stride, phases } => {
                let st = *stride;
                let oh = (x.h - 1) * st + s.kernel + s.output_padding - 2 * s.padding;
                let ow = (x.w - 1) * st + s.kernel + s.output_padding - 2 * s.padding;
                let count = |len: usize, q: usize| (len + st - 1 - q) / st;
                let outs: Vec<Vec<f32>> = phases
                    .iter()
                    .enumerate()
                    .map(|(i, g)| {
                        let grid = (count(oh, i / st), count(ow, i % st));
                        g.run(x, grid, s.cout, &self.bias, None, act)
                    })
                    .collect();
                let c = s.cout;
                let mut data = vec![0f32; x.n * oh * ow * c];
                data.par_chunks_mut(ow * c)
                    .enumerate()
                    .for_each(|(row, out)| {
                        let (b, oy) = (row / oh, row % oh);
                        let (py, a) = (oy % st, oy / st);
                        for ox in 0..ow {
                            let (px, bb) = (ox % st, ox / st);
                            let rows = count(oh, py);
                            let cols = count(ow, px);
                            let src = ((b * rows + a) * cols + bb) * c;
                            out[ox * c..(ox + 1) * c]
                                .copy_from_slice(&outs[py * st + px][src..src + c]);
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
        }
    }
}

impl Gather {
    /// A convolution from PyTorch's `[cout, cin, k, k]` weight:
    /// `[(kh·k + kw)·cin + ci, cout]`, with taps offset by the padding.
    fn conv(
        w: &[f32],
        cin: usize,
        cout: usize,
        k: usize,
        pad: usize,
        stride: (usize, usize),
    ) -> Self {
        let p = pad as isize;
        let mut weight = vec![0f32; k * k * cin * cout];
        for o in 0..cout {
            for c in 0..cin {
                for kh in 0..k {
                    for kw in 0..k {
                        weight[((kh * k + kw) * cin + c) * cout + o] =
                            w[((o * cin + c) * k + kh) * k + kw];
                    }
                }
            }
        }
        let taps = (0..k * k)
            .map(|t| ((t / k) as isize - p, (t % k) as isize - p))
            .collect();
        Gather {
            stride,
            taps,
            weight,
        }
    }

    /// Every output pixel of the grid, `[n·rows·cols, cout]`: bias (+ residual, the input
    /// pixel at the same position) + gathered rows × weight, then the activation.
    fn run(
        &self,
        x: &Act,
        (rows, cols): (usize, usize),
        cout: usize,
        bias: &[f32],
        residual: Option<&Act>,
        act: Activation,
    ) -> Vec<f32> {
        let cin = x.c;
        let k = self.taps.len() * cin;
        let pixels = x.n * rows * cols;
        let mut out = vec![0f32; pixels * cout];
        if pixels == 0 {
            return out;
        }
        // A 1×1, stride-1 convolution reads the input rows as they are.
        let direct = self.taps == [(0, 0)] && self.stride == (1, 1) && (rows, cols) == (x.h, x.w);
        let tile = tile_rows(k);
        let tiles = pixels.div_ceil(tile);
        // Few tiles (small images, large channel counts): parallelise inside the product.
        let threads = rayon::current_num_threads();
        let inner = if tiles < threads {
            gemm::Parallelism::Rayon(threads)
        } else {
            gemm::Parallelism::None
        };
        out.par_chunks_mut(tile * cout).enumerate().for_each_init(
            Vec::<f32>::new,
            |col, (t, dst)| {
                let first = t * tile;
                let m = dst.len() / cout;
                for r in 0..m {
                    let row = &mut dst[r * cout..(r + 1) * cout];
                    row.copy_from_slice(bias);
                    if let Some(res) = residual {
                        let src = &res.data[(first + r) * cout..(first + r + 1) * cout];
                        row.iter_mut().zip(src).for_each(|(o, v)| *o += v);
                    }
                }
                if k == 0 {
                    // No tap reaches these pixels: bias only.
                } else if direct {
                    let lhs = &x.data[first * cin..(first + m) * cin];
                    product(dst, lhs, &self.weight, m, k, cout, inner);
                } else {
                    col.resize(m * k, 0.0);
                    self.gather_rows(x, cols, rows * cols, first, col);
                    product(dst, col, &self.weight, m, k, cout, inner);
                }
                dst.chunks_exact_mut(cout).for_each(|row| act.apply(row));
            },
        );
        out
    }

    /// Fills `col` with the gathered rows of output pixels `first..` (as many as fit), for
    /// a grid `cols` wide with `per_image` positions per image.
    fn gather_rows(&self, x: &Act, cols: usize, per_image: usize, first: usize, col: &mut [f32]) {
        let cin = x.c;
        let k = self.taps.len() * cin;
        for (r, dst) in col.chunks_exact_mut(k).enumerate() {
            let g = first + r;
            let (b, rem) = (g / per_image, g % per_image);
            let (a, bb) = (rem / cols, rem % cols);
            let y0 = (a * self.stride.0) as isize;
            let x0 = (bb * self.stride.1) as isize;
            for (t, &(dy, dx)) in self.taps.iter().enumerate() {
                let (iy, ix) = (y0 + dy, x0 + dx);
                let seg = &mut dst[t * cin..(t + 1) * cin];
                if iy < 0 || ix < 0 || iy >= x.h as isize || ix >= x.w as isize {
                    seg.fill(0.0);
                } else {
                    let src = ((b * x.h + iy as usize) * x.w + ix as usize) * cin;
                    seg.copy_from_slice(&x.data[src..src + cin]);
                }
            }
        }
    }
}

/// `dst[m, n] += lhs[m, k] · rhs[k, n]`, all row-major and contiguous.
fn product(
    dst: &mut [f32],
    lhs: &[f32],
    rhs: &[f32],
    m: usize,
    k: usize,
    n: usize,
    parallelism: gemm::Parallelism,
) {
    assert!(dst.len() >= m * n && lhs.len() >= m * k && rhs.len() >= k * n);
    // SAFETY: the three buffers hold the m×n, m×k and k×n row-major matrices described by
    // these dimensions and strides (checked above); `dst` is exclusively borrowed.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            true,
            lhs.as_ptr(),
            1,
            k as isize,
            rhs.as_ptr(),
            1,
            n as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

pub(crate) fn nchw_to_nhwc(x: &[f32], n: usize, c: usize, h: usize, w: usize) -> Act {
    let mut data = vec![0f32; n * c * h * w];
    data.par_chunks_mut(w * c)
        .enumerate()
        .for_each(|(row, out)| {
            let (b, y) = (row / h, row % h);
            for ch in 0..c {
                let src = &x[((b * c + ch) * h + y) * w..][..w];
                for (xx, v) in src.iter().enumerate() {
                    out[xx * c + ch] = *v;
                }
            }
        });
    Act { n, h, w, c, data }
}

pub(crate) fn nhwc_to_nchw(x: &Act) -> Vec<f32> {
    let (n, c, h, w) = (x.n, x.c, x.h, x.w);
    let mut out = vec![0f32; n * c * h * w];
    out.par_chunks_mut(h * w)
        .enumerate()
        .for_each(|(plane, dst)| {
            let (b, ch) = (plane / c, plane % c);
            for (i, v) in dst.iter_mut().enumerate() {
                *v = x.data[(b * h * w + i) * c + ch];
            }
        });
    out
}

/// `[a, b]` along channels (decoder output first, as in the original).
pub(crate) fn concat_channels(a: &Act, b: &Act) -> Act {
    concat_all(&[a, b])
}

/// The parts side by side along channels, in order (`torch.cat(parts, 1)`).
pub(crate) fn concat_all(parts: &[&Act]) -> Act {
    let first = parts.first().expect("something to concatenate");
    debug_assert!(parts
        .iter()
        .all(|p| (p.n, p.h, p.w) == (first.n, first.h, first.w)));
    let c: usize = parts.iter().map(|p| p.c).sum();
    let mut data = vec![0f32; first.n * first.h * first.w * c];
    data.par_chunks_mut(c).enumerate().for_each(|(px, out)| {
        let mut at = 0;
        for p in parts {
            out[at..at + p.c].copy_from_slice(&p.data[px * p.c..(px + 1) * p.c]);
            at += p.c;
        }
    });
    Act {
        n: first.n,
        h: first.h,
        w: first.w,
        c,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// One layer through candle and through the CPU pass, on the same random input.
    fn compare(s: LayerSpec, n: usize, h: usize, w: usize) {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (n, s.cin, h, w), &dev).unwrap();
        let weight = Tensor::randn(0f32, 0.2, s.weight_shape(), &dev).unwrap();
        let bias = Tensor::randn(0f32, 0.5, (1, s.cout, 1, 1), &dev).unwrap();
        let block = ConvBlock::from_parts("test", s, weight, bias);
        let want = block.forward(&x).unwrap();
        let layer = Layer::new(&block).unwrap();
        let flat: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        let got = layer.forward(&nchw_to_nhwc(&flat, n, s.cin, h, w));
        assert_eq!(got.n, n);
        assert_eq!(got.c, s.cout);
        let got = Tensor::from_vec(nhwc_to_nchw(&got), (n, got.c, got.h, got.w), &dev).unwrap();
        assert_eq!(got.dims(), want.dims(), "{s:?}");
        let diff: f32 = (got - &want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        assert!(diff < 1e-4, "{s:?}: max difference {diff}");
    }

    #[test]
    fn every_layer_kind_matches_candle() {
        use LayerKind::*;
        // (kind, cin, cout, kernel, stride, padding, output padding, residual, n, h, w)
        #[rustfmt::skip]
        let cases = [
            (Conv, 6, 16, 7, (1, 1), 3, 0, false, 2, 20, 17),
            (Conv, 16, 32, 3, (2, 2), 1, 0, false, 3, 19, 24),
            (Conv, 32, 32, 3, (1, 1), 1, 0, true, 2, 9, 11),
            (Conv, 8, 16, 3, (3, 1), 1, 0, false, 2, 80, 16),
            (Conv, 16, 32, 3, (3, 2), 1, 0, false, 2, 9, 6),
            (Conv, 24, 24, 3, (1, 1), 0, 0, false, 2, 3, 3),
            (Conv, 40, 20, 1, (1, 1), 0, 0, false, 5, 1, 1),
            (Plain, 32, 3, 1, (1, 1), 0, 0, false, 2, 12, 12),
            (ConvTranspose, 48, 24, 3, (2, 2), 1, 1, false, 2, 6, 5),
            (ConvTranspose, 64, 32, 3, (1, 1), 0, 0, false, 3, 1, 1),
            (ConvTranspose, 8, 4, 3, (1, 1), 1, 0, false, 1, 7, 7),
            // Many tiles, and a product parallelised inside (one tile, large channels).
            (Conv, 16, 16, 3, (1, 1), 1, 0, false, 4, 48, 48),
            (Conv, 256, 256, 3, (1, 1), 1, 0, false, 2, 3, 3),
        ];
        for (kind, cin, cout, kernel, stride, padding, output_padding, residual, n, h, w) in cases {
            let s = LayerSpec {
                kind,
                cin,
                cout,
                kernel,
                stride,
                padding,
                output_padding,
                residual,
            };
            compare(s, n, h, w);
        }
    }

    #[test]
    fn layout_changes_and_concat_round_trip() {
        let (n, c, h, w) = (2, 3, 4, 5);
        let x: Vec<f32> = (0..n * c * h * w).map(|i| i as f32).collect();
        let a = nchw_to_nhwc(&x, n, c, h, w);
        // (b=1, y=2, x=3, ch=1) in NHWC is (1, 1, 2, 3) in NCHW.
        assert_eq!(
            a.data[((h + 2) * w + 3) * c + 1],
            x[((c + 1) * h + 2) * w + 3]
        );
        assert_eq!(nhwc_to_nchw(&a), x);
        let b = Act {
            c: 1,
            data: vec![-1.0; n * h * w],
            ..a.clone()
        };
        let cat = concat_channels(&a, &b);
        assert_eq!(cat.c, 4);
        assert_eq!(&cat.data[..4], &[a.data[0], a.data[1], a.data[2], -1.0]);
    }
}
