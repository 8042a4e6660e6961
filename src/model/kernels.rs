//! lipsync's own kernels (`src/model/kernels/*.cu`, `*.h`): the argument structs as the C
//! source has them, the PTX built by build.rs (CUDA builds), and the host build of the same
//! per-item code, which the CPU tests check against candle's operations.
//!
//! - **Epilogue** ([`LsEpilogue`]): for every output pixel and channel, the raw convolution
//!   value (read at the pixel, or for an upsampling form at its phase's source and crop) plus
//!   bias, plus the residual, through ReLU or sigmoid, written at the layer's channel offset
//!   of its destination (NHWC) or as the network's NCHW output; the skip feature's channels
//!   copied after it; the largest |value| reduced for the overflow check.
//! - **Input** ([`LsInput`]): NCHW to NHWC with zero channels up to the padded count.
//! - **Max abs** ([`LsMaxAbs`]): the largest |value| of a buffer (layers cuDNN ran fused).

/// Where one output phase reads its raw convolution output (see the C header).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LsSrc {
    pub ptr: u64,
    pub h: i32,
    pub w: i32,
    pub c: i32,
    pub base: i32,
    pub cy: i32,
    pub cx: i32,
}

/// No activation.
pub const ACT_NONE: i32 = 0;
/// ReLU (NaN gives 0, as cuDNN's with `NOT_PROPAGATE_NAN`).
pub const ACT_RELU: i32 = 1;
/// Sigmoid (the checked value is taken before it).
pub const ACT_SIGMOID: i32 = 2;

/// The epilogue's arguments (see the C header for each field).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LsEpilogue {
    pub src: [LsSrc; 4],
    pub bias: u64,
    pub residual: u64,
    pub skip: u64,
    pub dst: u64,
    pub amax: u64,
    pub n: i32,
    pub oh: i32,
    pub ow: i32,
    pub cout: i32,
    pub skip_c: i32,
    pub dst_c: i32,
    pub dst_off: i32,
    pub skip_off: i32,
    pub shuffle: i32,
    pub act: i32,
    pub nchw_out: i32,
    pub vec: i32,
}

impl LsEpilogue {
    /// Work items at its `vec` channels per item.
    pub fn items(&self) -> u64 {
        self.n as u64
            * self.oh as u64
            * self.ow as u64
            * ((self.cout + self.skip_c) / self.vec.max(1)) as u64
    }

    /// The widest channel grouping every count and offset allows: `wide` (16 bytes of the
    /// element type) or 1; always 1 for the NCHW output.
    pub fn choose_vec(&mut self, wide: i32) {
        let src_ok = |s: &LsSrc| s.ptr == 0 || (s.c % wide == 0 && s.base % wide == 0);
        // 16-byte accesses need 16-byte aligned buffers (the arena's and fresh allocations
        // are; a view into another buffer might not be).
        let aligned = [self.bias, self.residual, self.skip, self.dst]
            .into_iter()
            .chain(self.src.iter().map(|s| s.ptr))
            .all(|p| p % 16 == 0);
        let ok = aligned
            && self.nchw_out == 0
            && [
                self.cout,
                self.skip_c,
                self.dst_c,
                self.dst_off,
                self.skip_off,
            ]
            .iter()
            .all(|v| v % wide == 0)
            && self.src.iter().all(src_ok);
        self.vec = if ok { wide } else { 1 };
    }
}

/// The input conversion's arguments.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LsInput {
    pub src: u64,
    pub dst: u64,
    pub n: i32,
    pub c: i32,
    pub h: i32,
    pub w: i32,
    pub cpad: i32,
    pub unused: i32,
}

impl LsInput {
    pub fn items(&self) -> u64 {
        self.n as u64 * self.h as u64 * self.w as u64 * self.cpad as u64
    }
}

/// The max-abs reduction's arguments.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LsMaxAbs {
    pub src: u64,
    pub amax: u64,
    pub count: i64,
}

const _: () = {
    assert!(std::mem::size_of::<LsSrc>() == 32);
    assert!(std::mem::size_of::<LsEpilogue>() == 216);
    assert!(std::mem::size_of::<LsInput>() == 40);
    assert!(std::mem::size_of::<LsMaxAbs>() == 24);
};

/// The checked value as the kernels store it (the bits of a non-negative float).
pub fn amax_value(bits: i32) -> f32 {
    f32::from_bits(bits as u32)
}

#[cfg(feature = "cuda")]
mod device {
    use candle_core::cuda_backend::cudarc::driver::DeviceRepr;

    // SAFETY: plain C structs of integers, laid out as the kernels declare them (checked by
    // size above and by static_assert in the header).
    unsafe impl DeviceRepr for super::LsEpilogue {}
    unsafe impl DeviceRepr for super::LsInput {}
    unsafe impl DeviceRepr for super::LsMaxAbs {}

    /// The kernels' PTX (build.rs).
    pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/lipsync_kernels.ptx"));
}
#[cfg(feature = "cuda")]
pub use device::PTX;

/// The host build of the kernels, in f32 (for tests: the GPU runs the same per-item code).
pub mod host {
    use super::{LsEpilogue, LsInput, LsMaxAbs};

    extern "C" {
        fn lipsync_host_epilogue_f32(a: *const LsEpilogue) -> i32;
        fn lipsync_host_input_f32(a: *const LsInput);
        fn lipsync_host_max_abs_f32(a: *const LsMaxAbs);
    }

    /// Runs the epilogue over f32 buffers.
    ///
    /// # Safety
    /// Every address in `a` must point at host memory holding the f32 values the arguments
    /// describe (see the C header), writable where the kernel writes.
    pub unsafe fn epilogue(a: &LsEpilogue) {
        let status = unsafe { lipsync_host_epilogue_f32(a) };
        assert_eq!(
            status, 0,
            "the host epilogue runs vec 1 or 4, not {}",
            a.vec
        );
    }

    /// Runs the input conversion over f32 buffers.
    ///
    /// # Safety
    /// As [`epilogue`].
    pub unsafe fn input(a: &LsInput) {
        unsafe { lipsync_host_input_f32(a) }
    }

    /// Runs the max-abs reduction over f32 values.
    ///
    /// # Safety
    /// As [`epilogue`].
    pub unsafe fn max_abs(a: &LsMaxAbs) {
        unsafe { lipsync_host_max_abs_f32(a) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::arch::{self, LayerSpec};
    use crate::model::cudnn::ConvLayout;
    use crate::model::upsample::{self, UpForm};
    use candle_core::{Device, Tensor};

    fn addr(v: &[f32]) -> u64 {
        v.as_ptr() as u64
    }

    fn vec_of(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// Every upsampling form's convolutions (candle, NHWC) shuffled by the epilogue with
    /// bias and ReLU into its channel slice of a concatenation with the skip copied beside
    /// it, against candle's `conv_transpose2d` + bias + ReLU + `cat`; at both channel
    /// groupings the GPU instantiates (1 and 16 bytes).
    #[test]
    fn the_epilogue_shuffles_every_form_into_its_concatenation_slice() {
        let dev = Device::Cpu;
        let full = *arch::FACE_DECODER_BLOCKS
            .iter()
            .flat_map(|b| b.iter())
            .find(|s| upsample::applies(s))
            .unwrap();
        let spec = LayerSpec {
            cin: 12,
            cout: 8,
            ..full
        };
        let (n, h, w, skip_c) = (2, 5, 3, 4);
        let x = Tensor::randn(0f32, 1.0, (n, spec.cin, h, w), &dev).unwrap();
        let wt = Tensor::randn(0f32, 0.3, (spec.cin, spec.cout, 3, 3), &dev).unwrap();
        let bias = Tensor::randn(0f32, 1.0, spec.cout, &dev).unwrap();
        let skip = Tensor::randn(0f32, 1.0, (n, 2 * h, 2 * w, skip_c), &dev).unwrap();
        let reference = crate::model::wav2lip::conv_layer(&x, &wt, &bias, &spec)
            .unwrap()
            .relu()
            .unwrap();
        let reference = Tensor::cat(
            &[&ConvLayout::Nhwc.from_nchw(&reference).unwrap(), &skip],
            3,
        )
        .unwrap();
        let (bias_v, skip_v) = (vec_of(&bias), vec_of(&skip));
        for form in UpForm::ALL {
            let z: Vec<Vec<f32>> = if form == UpForm::Transposed {
                let y = crate::model::wav2lip::conv_layer(
                    &x,
                    &wt,
                    &Tensor::zeros(spec.cout, candle_core::DType::F32, &dev).unwrap(),
                    &spec,
                )
                .unwrap();
                vec![vec_of(&ConvLayout::Nhwc.from_nchw(&y).unwrap())]
            } else {
                upsample::form_parts(form, &spec, &wt, &bias)
                    .unwrap()
                    .iter()
                    .map(|(c, w, _)| {
                        let z = upsample::conv_candle(c, &x, w).unwrap();
                        vec_of(&ConvLayout::Nhwc.from_nchw(&z).unwrap())
                    })
                    .collect()
            };
            for wide in [1, 4] {
                let mut out = vec![f32::NAN; n * 4 * h * w * (spec.cout + skip_c)];
                let mut amax = 0i32;
                let mut a = LsEpilogue {
                    bias: addr(&bias_v),
                    skip: addr(&skip_v),
                    dst: out.as_mut_ptr() as u64,
                    amax: &mut amax as *mut i32 as u64,
                    n: n as i32,
                    oh: 2 * h as i32,
                    ow: 2 * w as i32,
                    cout: spec.cout as i32,
                    skip_c: skip_c as i32,
                    dst_c: (spec.cout + skip_c) as i32,
                    dst_off: 0,
                    skip_off: spec.cout as i32,
                    act: ACT_RELU,
                    ..Default::default()
                };
                if form == UpForm::Transposed {
                    a.src[0] = LsSrc {
                        ptr: addr(&z[0]),
                        h: 2 * h as i32,
                        w: 2 * w as i32,
                        c: spec.cout as i32,
                        ..Default::default()
                    };
                } else {
                    a.shuffle = 1;
                    let convs = form.convs();
                    for (p, s) in form.sources(spec.cout).iter().enumerate() {
                        let c = &convs[s.conv];
                        let (zh, zw) = c.out_size(h, w);
                        a.src[p] = LsSrc {
                            ptr: addr(&z[s.conv]),
                            h: zh as i32,
                            w: zw as i32,
                            c: c.cout(spec.cout) as i32,
                            base: s.channel_base as i32,
                            cy: s.crop.0 as i32,
                            cx: s.crop.1 as i32,
                        };
                    }
                }
                a.choose_vec(wide);
                assert_eq!(a.vec, wide, "{form:?}: every count is a multiple of {wide}");
                unsafe { host::epilogue(&a) };
                let d = max_diff(&out, &vec_of(&reference));
                assert!(d < 1e-4, "{form:?} vec {wide}: max difference {d}");
                let largest = vec_of(&reference)
                    .chunks(spec.cout + skip_c)
                    .flat_map(|px| px[..spec.cout].to_vec())
                    .fold(0f32, f32::max);
                assert!((amax_value(amax) - largest).abs() < 1e-4);
            }
        }
    }

    /// A residual layer's epilogue written over its input, and the output layer's sigmoid
    /// into NCHW, against candle's operations; the checked value of the output layer is its
    /// largest |value| before the sigmoid, and NaN reaches it.
    #[test]
    fn the_epilogue_adds_the_residual_in_place_and_writes_the_sigmoid_output_as_nchw() {
        let dev = Device::Cpu;
        let (n, h, w, c) = (3, 4, 5, 8);
        let z = Tensor::randn(0f32, 1.0, (n, h, w, c), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (n, h, w, c), &dev).unwrap();
        let bias = Tensor::randn(0f32, 1.0, c, &dev).unwrap();
        let want = z
            .broadcast_add(&bias)
            .unwrap()
            .add(&x)
            .unwrap()
            .relu()
            .unwrap();
        let (z_v, bias_v) = (vec_of(&z), vec_of(&bias));
        for wide in [1, 4] {
            let mut inout = vec_of(&x);
            let mut a = LsEpilogue {
                bias: addr(&bias_v),
                residual: inout.as_ptr() as u64,
                dst: inout.as_mut_ptr() as u64,
                n: n as i32,
                oh: h as i32,
                ow: w as i32,
                cout: c as i32,
                dst_c: c as i32,
                act: ACT_RELU,
                ..Default::default()
            };
            a.src[0] = LsSrc {
                ptr: addr(&z_v),
                h: h as i32,
                w: w as i32,
                c: c as i32,
                ..Default::default()
            };
            a.choose_vec(wide);
            assert_eq!(a.vec, wide, "8 channels and 16-byte aligned buffers");
            unsafe { host::epilogue(&a) };
            assert!(max_diff(&inout, &vec_of(&want)) < 1e-5);
            // A buffer that is not 16-byte aligned takes one channel per item.
            let mut b = a;
            b.bias += 4;
            b.choose_vec(wide);
            assert_eq!(b.vec, 1);
        }
        // The output layer: 3 channels, sigmoid, NCHW.
        let c = 3;
        let z = Tensor::randn(0f32, 2.0, (n, h, w, c), &dev).unwrap();
        let bias = Tensor::randn(0f32, 1.0, c, &dev).unwrap();
        let pre = z.broadcast_add(&bias).unwrap();
        let want = candle_nn::ops::sigmoid(&ConvLayout::Nhwc.to_nchw(&pre).unwrap()).unwrap();
        let (mut z_v, bias_v) = (vec_of(&z), vec_of(&bias));
        let mut out = vec![f32::NAN; n * c * h * w];
        let mut amax = 0i32;
        let mut a = LsEpilogue {
            bias: addr(&bias_v),
            dst: out.as_mut_ptr() as u64,
            amax: &mut amax as *mut i32 as u64,
            n: n as i32,
            oh: h as i32,
            ow: w as i32,
            cout: c as i32,
            dst_c: c as i32,
            act: ACT_SIGMOID,
            nchw_out: 1,
            ..Default::default()
        };
        a.src[0] = LsSrc {
            ptr: addr(&z_v),
            h: h as i32,
            w: w as i32,
            c: c as i32,
            ..Default::default()
        };
        a.choose_vec(4);
        assert_eq!(
            a.vec, 1,
            "3 channels and an NCHW output: one channel per item"
        );
        unsafe { host::epilogue(&a) };
        assert!(max_diff(&out, &vec_of(&want)) < 1e-6);
        let largest = vec_of(&pre).iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!((amax_value(amax) - largest).abs() < 1e-5);
        // NaN is above every finite value and infinity.
        z_v[7] = f32::NAN;
        a.src[0].ptr = addr(&z_v);
        amax = 0;
        a.amax = &mut amax as *mut i32 as u64;
        unsafe { host::epilogue(&a) };
        assert!(amax_value(amax).is_nan());
    }

    #[test]
    fn the_input_is_converted_to_nhwc_with_zero_channels_and_max_abs_sees_every_value() {
        let dev = Device::Cpu;
        let (n, c, h, w) = (2, 6, 3, 4);
        let x = Tensor::randn(0f32, 1.0, (n, c, h, w), &dev).unwrap();
        let want = ConvLayout::Nhwc
            .from_nchw(&x.pad_with_zeros(1, 0, 2).unwrap())
            .unwrap();
        let xv = vec_of(&x);
        let mut out = vec![f32::NAN; n * h * w * 8];
        let a = LsInput {
            src: addr(&xv),
            dst: out.as_mut_ptr() as u64,
            n: n as i32,
            c: c as i32,
            h: h as i32,
            w: w as i32,
            cpad: 8,
            unused: 0,
        };
        assert_eq!(a.items() as usize, out.len());
        unsafe { host::input(&a) };
        assert_eq!(out, vec_of(&want));
        let mut values = vec![0.5f32, -3.0, 2.0];
        let mut amax = 0i32;
        let m = LsMaxAbs {
            src: addr(&values),
            amax: &mut amax as *mut i32 as u64,
            count: 3,
        };
        unsafe { host::max_abs(&m) };
        assert_eq!(amax_value(amax), 3.0);
        values[1] = f32::NEG_INFINITY;
        unsafe { host::max_abs(&m) };
        assert_eq!(amax_value(amax), f32::INFINITY);
    }
}
