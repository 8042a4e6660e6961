//! A stride-2 transposed convolution (kernel 3, padding 1, output padding 1: every upsampling
//! layer of Wav2Lip's decoder) as one stride-1 forward convolution with four times the output
//! channels, followed by a pixel shuffle.
//!
//! PyTorch's transposed convolution writes `y[o] = Σ x[i]·w[k]` over `o = 2i − 1 + k` (per
//! axis). An even output `o = 2m` takes only `k = 1` at `i = m`; an odd one `o = 2m + 1` takes
//! `k = 2` at `i = m` and `k = 0` at `i = m + 1`. So output phase `(a, b)` (row and column
//! parity) is a stride-1 cross-correlation of the input with a 3×3 kernel (padding 1) whose
//! taps at offsets 0 and +1 hold those weights and whose other taps are zero. Stacking the
//! four phases as output channels `(a·2 + b)·cout + co` makes one convolution; the pixel
//! shuffle then puts phase `(a, b)` of input pixel `(i, j)` at output pixel `(2i + a, 2j + b)`.
//! Bias and ReLU commute with the shuffle, so they fuse into the convolution.
//!
//! The forward convolution does four times the multiply-adds the transposed one needs (most
//! taps are zero) but runs cuDNN's forward kernels, which on tensor cores are many times
//! faster than its backward-data kernels for these shapes (docs/BENCHMARKS.md, "Profiling the
//! own path").

use candle_core::{DType, Device, Tensor};

use super::arch::{LayerKind, LayerSpec};
use super::cudnn::ConvLayout;
use super::Result;

/// Whether a layer is a transposed convolution this rewrite covers (without a residual add,
/// whose input could not match the upsampled output anyway).
pub fn applies(spec: &LayerSpec) -> bool {
    spec.kind == LayerKind::ConvTranspose
        && !spec.residual
        && spec.kernel == 3
        && spec.stride == (2, 2)
        && spec.padding == 1
        && spec.output_padding == 1
}

/// The forward convolution's spec: same input channels, four phases of output channels, 3×3,
/// stride 1, padding 1, followed by ReLU as the transposed layer is.
pub fn conv_spec(spec: &LayerSpec) -> LayerSpec {
    LayerSpec {
        kind: LayerKind::Conv,
        cin: spec.cin,
        cout: 4 * spec.cout,
        kernel: 3,
        stride: (1, 1),
        padding: 1,
        output_padding: 0,
        residual: false,
    }
}

/// The tap of the transposed kernel that forward tap `t` (0, 1, 2: offsets −1, 0, +1) holds
/// for output parity `p`, if any.
fn tap(p: usize, t: usize) -> Option<usize> {
    match (p, t) {
        (0, 1) => Some(1),
        (1, 1) => Some(2),
        (1, 2) => Some(0),
        _ => None,
    }
}

/// The forward convolution's weights `(4·cout, cin, 3, 3)` from the transposed layer's
/// `(cin, cout, 3, 3)` (PyTorch layout), in f32.
pub fn conv_weights(w: &[f32], cin: usize, cout: usize) -> Vec<f32> {
    assert_eq!(
        w.len(),
        cin * cout * 9,
        "transposed weights of (cin, cout, 3, 3)"
    );
    let mut out = vec![0f32; 4 * cout * cin * 9];
    for a in 0..2 {
        for b in 0..2 {
            for co in 0..cout {
                let oc = (a * 2 + b) * cout + co;
                for ci in 0..cin {
                    for ty in 0..3 {
                        let Some(ky) = tap(a, ty) else { continue };
                        for tx in 0..3 {
                            let Some(kx) = tap(b, tx) else { continue };
                            out[((oc * cin + ci) * 3 + ty) * 3 + tx] =
                                w[((ci * cout + co) * 3 + ky) * 3 + kx];
                        }
                    }
                }
            }
        }
    }
    out
}

/// The forward convolution's weights and bias (the bias repeated for each phase) from the
/// transposed layer's, on the same device in the same dtype.
pub fn conv_parts(spec: &LayerSpec, weight: &Tensor, bias: &Tensor) -> Result<(Tensor, Tensor)> {
    let (cin, cout) = (spec.cin, spec.cout);
    let host = weight
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let w = Tensor::from_vec(
        conv_weights(&host, cin, cout),
        (4 * cout, cin, 3, 3),
        &Device::Cpu,
    )?
    .to_dtype(weight.dtype())?
    .to_device(weight.device())?;
    let b = bias.flatten_all()?;
    let b = Tensor::cat(&[&b, &b, &b, &b], 0)?;
    Ok((w, b))
}

/// Puts the four phases of a forward convolution's output (`4·cout` channels, `h`×`w`) at
/// their pixels: `cout` channels, `2h`×`2w`, in `layout` (input and output alike).
pub fn shuffle(z: &Tensor, cout: usize, layout: ConvLayout) -> Result<Tensor> {
    let (n, d1, d2, d3) = z.dims4()?;
    Ok(match layout {
        ConvLayout::Nchw => {
            let (h, w) = (d2, d3);
            z.reshape((n, 2, 2, cout, h, w))?
                .permute((0, 3, 4, 1, 5, 2))?
                .contiguous()?
                .reshape((n, cout, 2 * h, 2 * w))?
        }
        ConvLayout::Nhwc => {
            let (h, w) = (d1, d2);
            z.reshape((n, h, w, 2, 2, cout))?
                .permute((0, 1, 3, 2, 4, 5))?
                .contiguous()?
                .reshape((n, 2 * h, 2 * w, cout))?
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::arch;
    use crate::model::wav2lip::conv_layer;

    /// candle's transposed convolution (f32, CPU) against the forward convolution and the
    /// shuffle, in both layouts, for every decoder layer the rewrite covers (channels cut to
    /// keep the test short), with odd and even sizes and a batch above 1.
    #[test]
    fn the_forward_convolution_and_shuffle_equal_the_transposed_convolution() {
        let specs: Vec<LayerSpec> = arch::FACE_DECODER_BLOCKS
            .iter()
            .flat_map(|b| b.iter().copied())
            .filter(applies)
            .collect();
        assert_eq!(specs.len(), 5, "Wav2Lip's five upsampling layers");
        for (i, full) in specs.iter().enumerate() {
            let spec = LayerSpec {
                cin: 3 + i,
                cout: 5,
                ..*full
            };
            let (h, w) = [(3, 3), (6, 5), (1, 1), (4, 7), (2, 2)][i];
            let dev = Device::Cpu;
            let x = Tensor::randn(0f32, 1.0, (2, spec.cin, h, w), &dev).unwrap();
            let wt = Tensor::randn(0f32, 1.0, (spec.cin, spec.cout, 3, 3), &dev).unwrap();
            let bias = Tensor::randn(0f32, 1.0, spec.cout, &dev).unwrap();
            let reference = conv_layer(&x, &wt, &bias, &spec).unwrap();
            assert_eq!(reference.dims(), [2, spec.cout, 2 * h, 2 * w]);
            let (cw, cb) = conv_parts(&spec, &wt, &bias).unwrap();
            let z = conv_layer(&x, &cw, &cb, &conv_spec(&spec)).unwrap();
            for layout in [ConvLayout::Nchw, ConvLayout::Nhwc] {
                let shuffled = shuffle(&layout.from_nchw(&z).unwrap(), spec.cout, layout).unwrap();
                let y = layout.to_nchw(&shuffled).unwrap();
                let diff = (y - &reference)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(diff < 1e-4, "{spec:?} {layout:?}: max difference {diff}");
            }
        }
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
        let up = all.iter().find(|s| applies(s)).unwrap();
        let c = conv_spec(up);
        assert_eq!(
            (c.kind, c.cin, c.cout),
            (LayerKind::Conv, up.cin, 4 * up.cout)
        );
        assert_eq!((c.kernel, c.stride, c.padding), (3, (1, 1), 1));
    }
}
