//! The decoder's stride-2 transposed convolutions (kernel 3, padding 1, output padding 1: every
//! upsampling layer of Wav2Lip) as forward convolutions whose outputs are interleaved by a
//! pixel shuffle, in the forms `--conv-upsampling` names ([`UpForm`]).
//!
//! PyTorch's transposed convolution writes `y[o] = Σ x[i]·w[k]` over `o = 2i − 1 + k` (per
//! axis). Output `o = 2m + p` (parity `p`) takes input `i = m + d` with tap `k = p + 1 − 2d`:
//! an even output only `k = 1` at `d = 0`, an odd one `k = 2` at `d = 0` and `k = 0` at
//! `d = 1`. So each output phase `(a, b)` (row and column parity) is a stride-1
//! cross-correlation of the input over a small window, and the forms differ only in which
//! window each forward convolution uses ([`FormConv`]):
//!
//! - [`UpForm::Subpixel`]: one 3×3 convolution (window offsets −1, 0, +1, padding 1) with the
//!   four phases stacked as output channels `(a·2 + b)·cout + co`: 4× the multiply-adds of
//!   the transposed convolution (most taps are zero).
//! - [`UpForm::Subpixel2x2`]: one 2×2 convolution (offsets 0, +1) to the four phases: 16/9 =
//!   1.78× (only the zero taps of the window are wasted).
//! - [`UpForm::Phases`]: four convolutions of 1×1, 1×2, 2×1 and 2×2, one per phase: exactly
//!   the transposed convolution's multiply-adds.
//! - [`UpForm::Transposed`]: cuDNN's backward-data convolution (no rewrite).
//!
//! The convolutions use symmetric padding (cuDNN's and candle's), so a window starting at
//! offset 0 with padding 1 comes out one row (column) late: output pixel `(i, j)` of phase
//! `(a, b)` is at `(i + crop_y, j + crop_x)` of its convolution's output ([`FormConv::crop`]).
//! Bias and ReLU commute with the shuffle and the crop, so they can be applied before or
//! after it (the own epilogue kernel does it while shuffling).

use candle_core::{DType, Device, Tensor};

use super::arch::{LayerKind, LayerSpec};
use super::cudnn::ConvLayout;
use super::Result;

/// A concrete way to run one upsampling layer (`--conv-upsampling` without `auto`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum UpForm {
    Subpixel,
    Subpixel2x2,
    Phases,
    Transposed,
}

named_enum!(UpForm, "an upsampling form", {
    "subpixel" => Subpixel,
    "subpixel2x2" => Subpixel2x2,
    "phases" => Phases,
    "transposed" => Transposed,
});

impl UpForm {
    pub const ALL: [UpForm; 4] = [
        UpForm::Subpixel,
        UpForm::Subpixel2x2,
        UpForm::Phases,
        UpForm::Transposed,
    ];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// Multiply-adds against the transposed convolution's.
    pub fn mac_ratio(self) -> f64 {
        match self {
            UpForm::Subpixel => 4.0,
            UpForm::Subpixel2x2 => 16.0 / 9.0,
            UpForm::Phases | UpForm::Transposed => 1.0,
        }
    }

    /// The forward convolutions the form runs, in order (none for `Transposed`).
    pub fn convs(self) -> Vec<FormConv> {
        const ALL4: &[(usize, usize)] = &[(0, 0), (0, 1), (1, 0), (1, 1)];
        const ONE: [&[(usize, usize)]; 4] = [&[(0, 0)], &[(0, 1)], &[(1, 0)], &[(1, 1)]];
        match self {
            UpForm::Subpixel => vec![FormConv {
                phases: ALL4,
                kh: 3,
                kw: 3,
                dy: -1,
                dx: -1,
                ph: 1,
                pw: 1,
            }],
            UpForm::Subpixel2x2 => vec![FormConv {
                phases: ALL4,
                kh: 2,
                kw: 2,
                dy: 0,
                dx: 0,
                ph: 1,
                pw: 1,
            }],
            UpForm::Phases => ONE
                .iter()
                .map(|phases| {
                    let (a, b) = phases[0];
                    // Parity 0 reads one input pixel (offset 0), parity 1 two (offsets 0, +1).
                    FormConv {
                        phases,
                        kh: a + 1,
                        kw: b + 1,
                        dy: 0,
                        dx: 0,
                        ph: a,
                        pw: b,
                    }
                })
                .collect(),
            UpForm::Transposed => Vec::new(),
        }
    }

    /// Where the epilogue finds each output phase, by phase `a·2 + b` (see [`PhaseSource`]);
    /// empty for `Transposed`, whose output needs no shuffle.
    pub fn sources(self, cout: usize) -> Vec<PhaseSource> {
        let convs = self.convs();
        let mut out = Vec::new();
        for phase in [(0, 0), (0, 1), (1, 0), (1, 1)] {
            for (i, c) in convs.iter().enumerate() {
                if let Some(slot) = c.phases.iter().position(|&p| p == phase) {
                    out.push(PhaseSource {
                        conv: i,
                        channel_base: slot * cout,
                        crop: c.crop(),
                    });
                }
            }
        }
        out
    }
}

/// Whether a layer is a transposed convolution the forms cover (without a residual add,
/// whose input could not match the upsampled output anyway).
pub fn applies(spec: &LayerSpec) -> bool {
    spec.kind == LayerKind::ConvTranspose
        && !spec.residual
        && spec.kernel == 3
        && spec.stride == (2, 2)
        && spec.padding == 1
        && spec.output_padding == 1
}

/// One forward convolution of a form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FormConv {
    /// The output phases `(a, b)` it computes, `cout` channels each, in channel order.
    pub phases: &'static [(usize, usize)],
    /// Kernel height and width.
    pub kh: usize,
    pub kw: usize,
    /// Offset of the window's first row (column) from the input pixel: −1 or 0.
    pub dy: isize,
    pub dx: isize,
    /// Symmetric zero padding, rows and columns.
    pub ph: usize,
    pub pw: usize,
}

impl FormConv {
    /// Output pixel `(i, j)` of a phase is at `(i + crop.0, j + crop.1)` of this
    /// convolution's output.
    pub fn crop(&self) -> (usize, usize) {
        (
            (self.dy + self.ph as isize) as usize,
            (self.dx + self.pw as isize) as usize,
        )
    }

    /// The convolution's output height and width for an `h`×`w` input.
    pub fn out_size(&self, h: usize, w: usize) -> (usize, usize) {
        (h + 2 * self.ph + 1 - self.kh, w + 2 * self.pw + 1 - self.kw)
    }

    /// Its output channels for a layer of `cout`.
    pub fn cout(&self, cout: usize) -> usize {
        self.phases.len() * cout
    }

    /// Its weights `(phases·cout, cin, kh, kw)` from the transposed layer's `(cin, cout, 3, 3)`
    /// (PyTorch layouts), in f32.
    pub fn weights(&self, w: &[f32], cin: usize, cout: usize) -> Vec<f32> {
        assert_eq!(
            w.len(),
            cin * cout * 9,
            "transposed weights of (cin, cout, 3, 3)"
        );
        let (kh, kw) = (self.kh, self.kw);
        let mut out = vec![0f32; self.cout(cout) * cin * kh * kw];
        for (slot, &(a, b)) in self.phases.iter().enumerate() {
            for ty in 0..kh {
                let Some(ky) = tap(a, self.dy + ty as isize) else {
                    continue;
                };
                for tx in 0..kw {
                    let Some(kx) = tap(b, self.dx + tx as isize) else {
                        continue;
                    };
                    for co in 0..cout {
                        let oc = slot * cout + co;
                        for ci in 0..cin {
                            out[((oc * cin + ci) * kh + ty) * kw + tx] =
                                w[((ci * cout + co) * 3 + ky) * 3 + kx];
                        }
                    }
                }
            }
        }
        out
    }
}

/// Where output phase `(a, b)` of an upsampling layer comes from: convolution `conv` of the
/// form, channels from `channel_base`, offset by `crop`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhaseSource {
    pub conv: usize,
    pub channel_base: usize,
    pub crop: (usize, usize),
}

/// The tap of the 3×3 transposed kernel that input offset `d` holds for output parity `p`.
fn tap(p: usize, d: isize) -> Option<usize> {
    let k = p as isize + 1 - 2 * d;
    (0..3).contains(&k).then_some(k as usize)
}

/// A form's convolutions as weights and biases (the layer's bias repeated for each phase a
/// convolution computes), on the device and in the dtype of the transposed layer's weight.
pub fn form_parts(
    form: UpForm,
    spec: &LayerSpec,
    weight: &Tensor,
    bias: &Tensor,
) -> Result<Vec<(FormConv, Tensor, Tensor)>> {
    let (cin, cout) = (spec.cin, spec.cout);
    let host = weight
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let b = bias.flatten_all()?;
    form.convs()
        .into_iter()
        .map(|c| {
            let w = Tensor::from_vec(
                c.weights(&host, cin, cout),
                (c.cout(cout), cin, c.kh, c.kw),
                &Device::Cpu,
            )?
            .to_dtype(weight.dtype())?
            .to_device(weight.device())?;
            let bias = Tensor::cat(&vec![&b; c.phases.len()], 0)?;
            Ok((c, w, bias))
        })
        .collect()
}

/// A form convolution's output from its input with candle's operations, NCHW, without bias:
/// the padding is applied explicitly (candle pads both axes alike).
pub fn conv_candle(c: &FormConv, x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let x = x
        .pad_with_zeros(2, c.ph, c.ph)?
        .pad_with_zeros(3, c.pw, c.pw)?;
    Ok(x.conv2d(weight, 0, 1, 1, 1)?)
}

/// The upsampled `cout`×`2h`×`2w` output from the form's convolution outputs `z` (in
/// `layout`, one per [`UpForm::convs`]), for an `h`×`w` input: each phase cropped and the
/// phases interleaved. With candle's operations (any device).
pub fn assemble(
    form: UpForm,
    z: &[Tensor],
    cout: usize,
    (h, w): (usize, usize),
    layout: ConvLayout,
) -> Result<Tensor> {
    let sources = form.sources(cout);
    let n = z[0].dim(0)?;
    // Each phase as (n, cout, h, w) in NCHW or (n, h, w, cout) in NHWC.
    let phase = |s: &PhaseSource| -> Result<Tensor> {
        let t = &z[s.conv];
        let (cy, cx) = s.crop;
        let (hc, wc, cc) = match layout {
            ConvLayout::Nchw => (2, 3, 1),
            ConvLayout::Nhwc => (1, 2, 3),
        };
        Ok(t.narrow(hc, cy, h)?
            .narrow(wc, cx, w)?
            .narrow(cc, s.channel_base, cout)?)
    };
    let p: Vec<Tensor> = sources.iter().map(phase).collect::<Result<_>>()?;
    Ok(match layout {
        ConvLayout::Nhwc => {
            // (n, h, w, b, c) per row parity, then (n, h, a, w, b, c).
            let even = Tensor::stack(&[&p[0], &p[1]], 3)?;
            let odd = Tensor::stack(&[&p[2], &p[3]], 3)?;
            Tensor::stack(&[&even, &odd], 2)?.reshape((n, 2 * h, 2 * w, cout))?
        }
        ConvLayout::Nchw => {
            // (n, c, h, w, b) per row parity, then (n, c, h, a, w, b).
            let even = Tensor::stack(&[&p[0], &p[1]], 4)?;
            let odd = Tensor::stack(&[&p[2], &p[3]], 4)?;
            Tensor::stack(&[&even, &odd], 3)?.reshape((n, cout, 2 * h, 2 * w))?
        }
    })
}

/// The layer's transposed convolution plus bias (no activation) through `form` with candle's
/// operations, NCHW: what the own path's forms must equal.
pub fn forward_candle(
    form: UpForm,
    spec: &LayerSpec,
    weight: &Tensor,
    bias: &Tensor,
    x: &Tensor,
) -> Result<Tensor> {
    if form == UpForm::Transposed {
        return super::wav2lip::conv_layer(x, weight, bias, spec);
    }
    let (_, _, h, w) = x.dims4()?;
    let z = form_parts(form, spec, weight, bias)?
        .iter()
        .map(|(c, w, b)| {
            let z = conv_candle(c, x, w)?;
            Ok(z.broadcast_add(&b.reshape((1, b.dim(0)?, 1, 1))?)?)
        })
        .collect::<Result<Vec<_>>>()?;
    assemble(form, &z, spec.cout, (h, w), ConvLayout::Nchw)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::arch;
    use crate::model::wav2lip::conv_layer;
    use crate::model::wav2lip::tests::max_diff;

    /// The five upsampling layers of Wav2Lip at their real channels and sizes, and a random
    /// odd shape.
    pub(crate) fn shapes() -> Vec<(LayerSpec, usize, usize)> {
        let mut v: Vec<(LayerSpec, usize, usize)> = arch::FACE_DECODER_BLOCKS
            .iter()
            .flat_map(|b| b.iter().copied())
            .filter(applies)
            .zip([3usize, 6, 12, 24, 48])
            .map(|(s, hw)| (s, hw, hw))
            .collect();
        let random = *v.first().expect("five layers");
        v.push((
            LayerSpec {
                cin: 7,
                cout: 5,
                ..random.0
            },
            5,
            9,
        ));
        v
    }

    /// Every form against candle's `conv_transpose2d` (f32, CPU) on the five real shapes (full
    /// channels, batch 1) and a random one (batch 2), in both layouts for the shuffle: the
    /// forms equal the transposed convolution to f32 rounding.
    #[test]
    fn every_form_equals_the_transposed_convolution_on_the_real_shapes() {
        let real: Vec<usize> = shapes().iter().map(|(s, _, _)| s.cin).collect();
        assert_eq!(
            real,
            [1024, 768, 512, 320, 160, 7],
            "Wav2Lip's five upsampling layers"
        );
        let dev = Device::Cpu;
        for (i, (spec, h, w)) in shapes().into_iter().enumerate() {
            let n = if i == 5 { 2 } else { 1 };
            let x = Tensor::randn(0f32, 1.0, (n, spec.cin, h, w), &dev).unwrap();
            let scale = (1.0 / (9.0 * spec.cin as f64)).sqrt() as f32;
            let wt = Tensor::randn(0f32, scale, (spec.cin, spec.cout, 3, 3), &dev).unwrap();
            let bias = Tensor::randn(0f32, 1.0, spec.cout, &dev).unwrap();
            let reference = conv_layer(&x, &wt, &bias, &spec).unwrap();
            assert_eq!(reference.dims(), [n, spec.cout, 2 * h, 2 * w]);
            for form in UpForm::ALL {
                let y = forward_candle(form, &spec, &wt, &bias, &x).unwrap();
                let d = max_diff(&y, &reference);
                assert!(
                    d < 1e-4,
                    "{form:?} on {spec:?} at {h}×{w}: max difference {d}"
                );
                if form == UpForm::Transposed {
                    continue;
                }
                // The shuffle in NHWC gives the same pixels.
                let parts = form_parts(form, &spec, &wt, &bias).unwrap();
                let z: Vec<Tensor> = parts
                    .iter()
                    .map(|(c, w, b)| {
                        let z = conv_candle(c, &x, w).unwrap();
                        let z = z
                            .broadcast_add(&b.reshape((1, b.dim(0).unwrap(), 1, 1)).unwrap())
                            .unwrap();
                        ConvLayout::Nhwc.from_nchw(&z).unwrap()
                    })
                    .collect();
                let nhwc = assemble(form, &z, spec.cout, (h, w), ConvLayout::Nhwc).unwrap();
                let d = max_diff(&ConvLayout::Nhwc.to_nchw(&nhwc).unwrap(), &reference);
                assert!(d < 1e-4, "{form:?} NHWC on {spec:?}: max difference {d}");
            }
        }
    }

    #[test]
    fn the_forms_multiply_adds_are_as_documented() {
        // Taps per output pixel of all four phases: 1 + 2 + 2 + 4 = 9 for the transposed
        // convolution; the forms compute every tap of their windows.
        for form in UpForm::ALL {
            let macs: usize = form
                .convs()
                .iter()
                .map(|c| c.phases.len() * c.kh * c.kw)
                .sum();
            let macs = if form == UpForm::Transposed { 9 } else { macs };
            assert_eq!(macs as f64 / 9.0, form.mac_ratio(), "{form:?}");
        }
        // Nonzero weights: exactly the transposed kernel's 9 taps per (cin, cout), once.
        let (cin, cout) = (2, 3);
        let w: Vec<f32> = (1..=cin * cout * 9).map(|v| v as f32).collect();
        for form in [UpForm::Subpixel, UpForm::Subpixel2x2, UpForm::Phases] {
            let mut seen: Vec<f32> = form
                .convs()
                .iter()
                .flat_map(|c| c.weights(&w, cin, cout))
                .filter(|&v| v != 0.0)
                .collect();
            seen.sort_by(f32::total_cmp);
            assert_eq!(seen, w, "{form:?}");
        }
    }

    #[test]
    fn every_phase_has_one_source_and_crops_stay_inside_the_convolution() {
        for form in [UpForm::Subpixel, UpForm::Subpixel2x2, UpForm::Phases] {
            let convs = form.convs();
            let sources = form.sources(5);
            assert_eq!(sources.len(), 4, "{form:?}");
            for s in &sources {
                let c = &convs[s.conv];
                let (h, w) = (7, 4);
                let (oh, ow) = c.out_size(h, w);
                assert!(s.crop.0 + h <= oh && s.crop.1 + w <= ow, "{form:?} {c:?}");
                assert!(s.channel_base + 5 <= c.cout(5));
            }
        }
        assert!(UpForm::Transposed.sources(5).is_empty());
        assert_eq!(UpForm::Phases.convs().len(), 4);
        assert_eq!(UpForm::Subpixel.sources(4)[3].channel_base, 12);
    }

    #[test]
    fn only_stride_two_kernel_three_upsampling_is_rewritten() {
        let all: Vec<LayerSpec> = arch::FACE_DECODER_BLOCKS
            .iter()
            .flat_map(|b| b.iter().copied())
            .collect();
        // The first transposed layer (1×1 to 3×3, stride 1) stays a transposed convolution.
        let first = all
            .iter()
            .find(|s| s.kind == LayerKind::ConvTranspose)
            .unwrap();
        assert!(!applies(first));
        assert!(all
            .iter()
            .filter(|s| s.kind == LayerKind::Conv)
            .all(|s| !applies(s)));
        assert_eq!(all.iter().filter(|s| applies(s)).count(), 5);
    }
}
