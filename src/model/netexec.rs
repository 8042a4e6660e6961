//! Runs a planned pass ([`super::netplan::Graph`]) through a [`Backend`]: the operations in
//! order, each epilogue's kernel arguments built from the graph and the buffers' addresses.
//! The CUDA backend (`src/model/cudnn/net.rs`) runs cuDNN and the own kernels on the device;
//! the tests run a host backend (candle's convolutions and the host build of the kernels on
//! an arena in host memory, at the planned offsets), so the whole planned pass — graph, plan,
//! kernel arguments and kernels — is checked against the model's CPU pass without a GPU.

use super::cudnn::ConvDims;
use super::kernels::{LsEpilogue, LsInput, LsMaxAbs, LsSrc, ACT_NONE, ACT_RELU, ACT_SIGMOID};
use super::netplan::{Act, ConvPart, Dest, Epilogue, Graph, Layer, Op};

/// Where everything a pass touches lives (device addresses, or host addresses in tests).
#[derive(Debug, Clone)]
pub struct Addresses {
    /// Each buffer of the graph.
    pub buffers: Vec<u64>,
    /// Each layer's bias (`cout` values), by layer index.
    pub biases: Vec<u64>,
    /// Each layer's overflow-check slot (one i32 the kernels raise to the largest |value|),
    /// or 0 for an unchecked layer.
    pub amax: Vec<u64>,
    /// The NCHW inputs: mel windows `(n, 1, 80, 16)` and faces `(n, 6, 96, 96)`.
    pub mel: u64,
    pub face: u64,
    /// The NCHW output `(n, 3, 96, 96)`.
    pub output: u64,
}

/// What runs a pass's operations.
pub trait Backend {
    type Error;

    /// The input conversion.
    fn input(&mut self, a: &LsInput) -> Result<(), Self::Error>;

    /// Convolution `part` of `layer` (of `dims`) on the NHWC activation at `x` of logical
    /// shape `input` (`(n, c, h, w)`), into `y`: raw (no bias), or for a fused layer with
    /// bias, residual (the input) and ReLU. `slice`: the input channels (first, count) of
    /// the layer's weights `x` holds; `accumulate`: added to what `y` holds.
    #[allow(clippy::too_many_arguments)]
    fn conv(
        &mut self,
        layer: &Layer,
        part: ConvPart,
        dims: &ConvDims,
        input: [usize; 4],
        x_y: (u64, u64),
        slice: (usize, usize),
        accumulate: bool,
    ) -> Result<(), Self::Error>;

    fn epilogue(&mut self, a: &LsEpilogue) -> Result<(), Self::Error>;

    fn max_abs(&mut self, a: &LsMaxAbs) -> Result<(), Self::Error>;

    /// Layer `layer`'s operations start (`end: false`) or have all been issued.
    fn layer_boundary(
        &mut self,
        _layer: usize,
        _end: bool,
        _addr: &Addresses,
    ) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Before operation `k`: a backend that allocates buffers one by one sets the addresses
    /// of those `k` writes first.
    fn before_op(&mut self, _k: usize, _addr: &mut Addresses) -> Result<(), Self::Error> {
        Ok(())
    }

    /// After operation `k` is issued: such a backend frees the buffers `k` read last.
    fn after_op(&mut self, _k: usize) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// The convolution an [`Op::Conv`] runs over `slice.1` of the layer's input channels.
pub fn conv_dims(layer: &Layer, part: ConvPart, slice: (usize, usize)) -> ConvDims {
    let d = match part {
        ConvPart::Layer => layer.dims(),
        ConvPart::Form(i) => layer.convs()[i],
    };
    d.with_cin(slice.1)
}

/// The input conversion of the mel windows or the faces at batch `n`.
pub fn input_args(g: &Graph, n: usize, face: bool, addr: &Addresses) -> LsInput {
    let (buf, src, c) = if face {
        (g.inputs.1, addr.face, super::arch::FACE_CHANNELS)
    } else {
        (g.inputs.0, addr.mel, 1)
    };
    let b = &g.buffers[buf];
    LsInput {
        src,
        dst: addr.buffers[buf],
        n: n as i32,
        c: c as i32,
        h: b.h as i32,
        w: b.w as i32,
        cpad: b.c as i32,
        unused: 0,
    }
}

/// The sources of a layer's epilogue at batch `n`: its raw convolution outputs at `srcs`
/// (one per convolution of the layer, [`Layer::convs`]), shuffled for an upsampling form.
/// Also sets the output size and channels.
pub fn layer_sources(layer: &Layer, n: usize, srcs: &[u64], a: &mut LsEpilogue) {
    let (oh, ow) = layer.output_hw;
    let cout = layer.spec.cout;
    (a.n, a.oh, a.ow, a.cout) = (n as i32, oh as i32, ow as i32, cout as i32);
    let convs = layer.convs();
    let (h, w) = layer.input_hw;
    if let (true, Some(form)) = (layer.shuffles(), layer.form) {
        a.shuffle = 1;
        for (p, s) in form.sources(cout).iter().enumerate() {
            let (zh, zw) = convs[s.conv].output(h, w);
            a.src[p] = LsSrc {
                ptr: srcs[s.conv],
                h: zh as i32,
                w: zw as i32,
                c: convs[s.conv].cout as i32,
                base: s.channel_base as i32,
                cy: s.crop.0 as i32,
                cx: s.crop.1 as i32,
            };
        }
    } else {
        a.src[0] = LsSrc {
            ptr: srcs[0],
            h: oh as i32,
            w: ow as i32,
            c: cout as i32,
            ..Default::default()
        };
    }
}

/// The epilogue kernel's arguments for `e` at batch `n`, with `wide` channels per item
/// where every count allows ([`LsEpilogue::choose_vec`]).
pub fn epilogue_args(g: &Graph, n: usize, e: &Epilogue, addr: &Addresses, wide: i32) -> LsEpilogue {
    let mut a = LsEpilogue {
        n: n as i32,
        ..Default::default()
    };
    let srcs: Vec<u64> = e.srcs.iter().map(|&b| addr.buffers[b]).collect();
    layer_sources(&g.layers[e.layer], n, &srcs, &mut a);
    a.bias = addr.biases[e.layer];
    a.amax = addr.amax[e.layer];
    if let Some(r) = e.residual {
        a.residual = addr.buffers[r];
    }
    if let Some(s) = e.skip {
        a.skip = addr.buffers[s];
        a.skip_c = g.buffers[s].c as i32;
    }
    match e.dst {
        Dest::Buffer { buf, offset } => {
            a.dst = addr.buffers[buf];
            a.dst_c = g.buffers[buf].c as i32;
            a.dst_off = offset as i32;
            a.skip_off = offset as i32 + a.cout;
        }
        Dest::Output => {
            a.dst = addr.output;
            a.dst_c = a.cout;
            a.nchw_out = 1;
        }
    }
    a.act = match e.act {
        Act::None => ACT_NONE,
        Act::Relu => ACT_RELU,
        Act::Sigmoid => ACT_SIGMOID,
    };
    a.choose_vec(wide);
    a
}

/// Runs the pass at batch `n`: every operation of `g` in order through `backend`.
pub fn run<B: Backend>(
    g: &Graph,
    n: usize,
    addr: &mut Addresses,
    wide: i32,
    backend: &mut B,
) -> Result<(), B::Error> {
    let groups = g.layer_ops();
    let mut starts = vec![None; g.ops.len()];
    let mut ends = vec![None; g.ops.len()];
    for (layer, ops) in &groups {
        starts[ops[0]] = Some(*layer);
        ends[*ops.last().expect("a layer has operations")] = Some(*layer);
    }
    for (k, op) in g.ops.iter().enumerate() {
        backend.before_op(k, addr)?;
        let addr = &*addr;
        if let Some(l) = starts[k] {
            backend.layer_boundary(l, false, addr)?;
        }
        match op {
            Op::Input { face, .. } => backend.input(&input_args(g, n, *face, addr))?,
            Op::Conv {
                layer,
                part,
                src,
                dst,
                slice,
                accumulate,
            } => {
                let l = &g.layers[*layer];
                let x = &g.buffers[*src];
                let dims = conv_dims(l, *part, *slice);
                backend.conv(
                    l,
                    *part,
                    &dims,
                    [n, x.c, x.h, x.w],
                    (addr.buffers[*src], addr.buffers[*dst]),
                    *slice,
                    *accumulate,
                )?;
                if l.fused && addr.amax[*layer] != 0 {
                    backend.max_abs(&LsMaxAbs {
                        src: addr.buffers[*dst],
                        amax: addr.amax[*layer],
                        count: (n * g.buffers[*dst].values()) as i64,
                    })?;
                }
            }
            Op::Epilogue(e) => backend.epilogue(&epilogue_args(g, n, e, addr, wide))?,
        }
        if let Some(l) = ends[k] {
            backend.layer_boundary(l, true, addr)?;
        }
        backend.after_op(k)?;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::model::cudnn::{ConvLayout, InputPad};
    use crate::model::kernels::{amax_value, host};
    use crate::model::netplan::{ArenaPlan, NetOptions};
    use crate::model::upsample::{self, UpForm};
    use crate::model::wav2lip::tests::{fixture_weights, max_diff};
    use crate::model::wav2lip::{conv_layer, face_psnr, ConvBlock};
    use crate::model::{Error, Wav2Lip};

    /// Candle's convolutions and the host kernels on f32 host memory.
    /// Without an arena: the graph, the batch and each buffer's lifetime.
    pub(crate) type OneByOne<'a> = (&'a Graph, usize, Vec<(usize, usize)>);

    pub(crate) struct HostBackend<'a> {
        pub model: &'a Wav2Lip,
        /// Without an arena (`--conv-arena off`'s way): the buffers allocated so far
        /// (NaN-filled, freed after their last reader).
        pub one_by_one: Option<OneByOne<'a>>,
        pub owned: Vec<Option<Vec<f32>>>,
    }

    fn read(at: u64, len: usize) -> Vec<f32> {
        // SAFETY: the tests' addresses point into vectors they keep alive, sized by the plan.
        unsafe { std::slice::from_raw_parts(at as *const f32, len) }.to_vec()
    }

    fn write(at: u64, values: &[f32]) {
        // SAFETY: as `read`; the destination is a buffer of at least this many values.
        unsafe { std::slice::from_raw_parts_mut(at as *mut f32, values.len()) }
            .copy_from_slice(values);
    }

    /// A layer's weights reading `cin` channels (zero weights for padded channels).
    pub(crate) fn padded(block: &ConvBlock, cin: usize) -> Tensor {
        let w = block.weight().clone();
        let have = w.dim(1).unwrap();
        if cin > have && block.spec().kind != crate::model::arch::LayerKind::ConvTranspose {
            w.pad_with_zeros(1, 0, cin - have).unwrap()
        } else {
            w
        }
    }

    impl Backend for HostBackend<'_> {
        type Error = Error;

        fn input(&mut self, a: &LsInput) -> Result<(), Error> {
            unsafe { host::input(a) };
            Ok(())
        }

        fn conv(
            &mut self,
            layer: &Layer,
            part: ConvPart,
            dims: &ConvDims,
            [n, c, h, w]: [usize; 4],
            (x, y): (u64, u64),
            (first, count): (usize, usize),
            accumulate: bool,
        ) -> Result<(), Error> {
            assert_eq!(
                c, count,
                "{}: the input holds the slice's channels",
                layer.path
            );
            let xt = Tensor::from_vec(read(x, n * c * h * w), (n, h, w, c), &Device::Cpu)?;
            let xt = ConvLayout::Nhwc.to_nchw(&xt)?;
            let block = self.model.layer(&layer.path).expect("the model's layer");
            let weight = padded(block, layer.cin);
            let out = match part {
                ConvPart::Layer if layer.fused => {
                    let b = ConvBlock::from_parts(
                        &layer.path,
                        *block.spec(),
                        weight,
                        block.bias().clone(),
                    );
                    b.forward(&xt)?
                }
                ConvPart::Layer => {
                    // The input channels' weights: dim 1 of (cout, cin, ..), dim 0 of a
                    // transposed layer's (cin, cout, ..).
                    let axis = usize::from(!dims.transposed);
                    let weight = weight.narrow(axis, first, count)?;
                    assert_eq!(weight.dims()[..2], dims.weight()[..2], "{}", layer.path);
                    let zero = Tensor::zeros(dims.cout, DType::F32, &Device::Cpu)?;
                    conv_layer(&xt, &weight, &zero, block.spec())?
                }
                ConvPart::Form(i) => {
                    let form = layer.form.expect("a form convolution");
                    let parts = upsample::form_parts(form, block.spec(), &weight, block.bias())?;
                    let w = parts[i].1.narrow(1, first, count)?;
                    upsample::conv_candle(&parts[i].0, &xt, &w)?
                }
            };
            let (oh, ow) = dims.output(h, w);
            assert_eq!(out.dims(), [n, dims.cout, oh, ow], "{}", layer.path);
            let mut out: Vec<f32> = ConvLayout::Nhwc.from_nchw(&out)?.flatten_all()?.to_vec1()?;
            if accumulate {
                for (o, v) in out.iter_mut().zip(read(y, n * oh * ow * dims.cout)) {
                    *o += v;
                }
            }
            write(y, &out);
            Ok(())
        }

        fn epilogue(&mut self, a: &LsEpilogue) -> Result<(), Error> {
            unsafe { host::epilogue(a) };
            Ok(())
        }

        fn max_abs(&mut self, a: &LsMaxAbs) -> Result<(), Error> {
            unsafe { host::max_abs(a) };
            Ok(())
        }

        fn before_op(&mut self, k: usize, addr: &mut Addresses) -> Result<(), Error> {
            if let Some((g, n, iv)) = &self.one_by_one {
                for (b, &(first, _)) in iv.iter().enumerate() {
                    if first == k {
                        let buf = vec![f32::NAN; g.buffers[b].bytes(*n, 4) / 4];
                        addr.buffers[b] = buf.as_ptr() as u64;
                        self.owned[b] = Some(buf);
                    }
                }
            }
            Ok(())
        }

        fn after_op(&mut self, k: usize) -> Result<(), Error> {
            if let Some((_, _, iv)) = &self.one_by_one {
                for (b, &(_, last)) in iv.iter().enumerate() {
                    if last == k {
                        self.owned[b] = None;
                    }
                }
            }
            Ok(())
        }
    }

    /// One planned pass on the host: the arena as the plan lays it out (filled with NaN, so
    /// a value read before it is written shows), every operation through the host backend.
    /// Returns the faces (NCHW) and each checked layer's largest |value|.
    pub(crate) fn host_pass(
        model: &Wav2Lip,
        g: &Graph,
        mel: &Tensor,
        face: &Tensor,
        checked: &[&str],
        arena_on: bool,
    ) -> (Tensor, Vec<f32>) {
        let n = mel.dim(0).unwrap();
        let plan = ArenaPlan::new(g, n, 4);
        plan.check(g).unwrap();
        let arena = vec![f32::NAN; plan.bytes / 4 + 1];
        let base = arena.as_ptr() as u64;
        let biases: Vec<Vec<f32>> = g
            .layers
            .iter()
            .map(|l| {
                let b = model.layer(&l.path).unwrap().bias();
                b.flatten_all().unwrap().to_vec1().unwrap()
            })
            .collect();
        let mut slots = vec![0i32; g.layers.len()];
        let mel_v: Vec<f32> = mel.flatten_all().unwrap().to_vec1().unwrap();
        let face_v: Vec<f32> = face.flatten_all().unwrap().to_vec1().unwrap();
        let out = vec![f32::NAN; n * 3 * 96 * 96];
        let mut addr = Addresses {
            buffers: (0..g.buffers.len())
                .map(|b| plan.address(base, b))
                .collect(),
            biases: biases.iter().map(|b| b.as_ptr() as u64).collect(),
            amax: g
                .layers
                .iter()
                .enumerate()
                .map(|(i, l)| {
                    if checked.contains(&l.path.as_str()) {
                        &mut slots[i] as *mut i32 as u64
                    } else {
                        0
                    }
                })
                .collect(),
            mel: mel_v.as_ptr() as u64,
            face: face_v.as_ptr() as u64,
            output: out.as_ptr() as u64,
        };
        let mut backend = HostBackend {
            model,
            one_by_one: (!arena_on).then(|| (g, n, g.intervals())),
            owned: (0..g.buffers.len()).map(|_| None).collect(),
        };
        if !arena_on {
            addr.buffers.fill(0);
        }
        run(g, n, &mut addr, 4, &mut backend).unwrap();
        assert!(
            backend.owned.iter().all(Option::is_none),
            "every buffer freed after its last reader"
        );
        drop(arena);
        let maxima = g
            .layers
            .iter()
            .enumerate()
            .filter(|(_, l)| checked.contains(&l.path.as_str()))
            .map(|(i, _)| amax_value(slots[i]))
            .collect();
        let faces = Tensor::from_vec(out, (n, 3, 96, 96), &Device::Cpu).unwrap();
        (faces, maxima)
    }

    fn inputs(n: usize) -> (Tensor, Tensor) {
        let dev = Device::Cpu;
        let mel = Tensor::rand(0f32, 1.0, (n, 1, 80, 16), &dev)
            .unwrap()
            .affine(8.0, -4.0)
            .unwrap();
        let face = Tensor::rand(0f32, 1.0, (n, 6, 96, 96), &dev).unwrap();
        (mel, face)
    }

    /// The whole planned pass on the host against the model's own CPU pass, on the test
    /// checkpoint's weights, in configurations that between them cover every upsampling form
    /// (one per layer), both input paddings, layers run fused, concatenations split and
    /// written directly, and the overflow checks of an epilogue-run, a fused and the output
    /// layer.
    #[test]
    fn the_planned_pass_equals_the_models_cpu_pass() {
        let weights = fixture_weights(None);
        let model = Wav2Lip::load(&weights, &Device::Cpu, DType::F32).unwrap();
        let (mel, face) = inputs(2);
        let reference = model.forward(&mel, &face).unwrap();
        let ups: Vec<String> = crate::model::arch::layers()
            .into_iter()
            .filter(|(_, s)| upsample::applies(s))
            .map(|(p, _)| p)
            .collect();
        assert_eq!(ups.len(), 5);
        let mut mixed = NetOptions::new(InputPad::Eight, UpForm::Phases);
        for (p, f) in ups.iter().zip([
            UpForm::Subpixel,
            UpForm::Subpixel2x2,
            UpForm::Phases,
            UpForm::Transposed,
            UpForm::Subpixel2x2,
        ]) {
            mixed.forms.insert(p.clone(), f);
        }
        mixed.fused = [
            "audio_encoder.1",
            "face_encoder_blocks.2.1",
            "face_decoder_blocks.3.1",
        ]
        .map(String::from)
        .into();
        let plain = NetOptions::new(InputPad::None, UpForm::Transposed);
        let checked = [
            "face_encoder_blocks.2.1",
            "face_decoder_blocks.4.2",
            "output_block.1",
        ];
        // The second without an arena: each buffer allocated when first written and freed
        // after its last reader, as `--conv-arena off` runs.
        let configs = [
            (mixed, BTreeSet::from([2, 6]), true),
            (plain, BTreeSet::new(), false),
        ];
        for (opts, split, arena_on) in configs {
            let g = Graph::build(&opts, &split);
            let (faces, maxima) = host_pass(&model, &g, &mel, &face, &checked, arena_on);
            let psnr = face_psnr(&faces, &reference).unwrap();
            let diff = max_diff(&faces, &reference);
            // f32 throughout, but candle's convolutions sum in another order than the CPU
            // pass, and the test checkpoint's decoder runs near 35 000: a broken kernel or
            // plan gives 10-25 dB.
            assert!(
                psnr > 80.0 && diff < 5e-3,
                "{opts:?} {split:?}: max difference {diff} ({psnr:.1} dB)"
            );
            // The checked layers' largest |values| are the f32 pass's.
            let mut want: BTreeMap<String, f32> = BTreeMap::new();
            model
                .forward_with(&mel, &face, &mut |b, x| {
                    let y = b.forward(x)?;
                    if checked.contains(&b.path()) {
                        let v: Vec<f32> = y.flatten_all()?.to_vec1()?;
                        want.insert(
                            b.path().to_string(),
                            v.iter().fold(0f32, |m, x| m.max(x.abs())),
                        );
                    }
                    Ok(y)
                })
                .unwrap();
            for (path, got) in checked.iter().zip(&maxima) {
                let w = want[*path];
                assert!(
                    (got - w).abs() <= 1e-3 * w.max(1.0),
                    "{path}: {got} against {w}"
                );
            }
        }
    }

    #[test]
    fn epilogue_arguments_follow_the_graph() {
        let opts = NetOptions::new(InputPad::Eight, UpForm::Phases);
        let g = Graph::build(&opts, &BTreeSet::new());
        let addr = Addresses {
            buffers: (0..g.buffers.len())
                .map(|b| 4096 * (b as u64 + 1))
                .collect(),
            biases: vec![256; g.layers.len()],
            amax: vec![0; g.layers.len()],
            mel: 7,
            face: 9,
            output: 11,
        };
        let e = g.epilogue_of("face_decoder_blocks.6.0").unwrap();
        let a = epilogue_args(&g, 3, e, &addr, 8);
        assert_eq!((a.shuffle, a.oh, a.ow, a.cout, a.vec), (1, 96, 96, 64, 8));
        // Phase (1, 1) is the 2×2 convolution, cropped by one row and column.
        assert_eq!(
            (a.src[3].h, a.src[3].w, a.src[3].cy, a.src[3].cx),
            (49, 49, 1, 1)
        );
        assert_eq!((a.src[0].h, a.src[0].w, a.src[0].cy), (48, 48, 0));
        // The last decoder layer writes its slice and the skip beside it.
        let e = g.epilogue_of("face_decoder_blocks.6.2").unwrap();
        let a = epilogue_args(&g, 3, e, &addr, 8);
        assert_eq!((a.dst_c, a.dst_off, a.skip_off, a.skip_c), (80, 0, 64, 16));
        assert_ne!(a.residual, 0);
        let e = g.epilogue_of("output_block.1").unwrap();
        let a = epilogue_args(&g, 3, e, &addr, 8);
        assert_eq!((a.nchw_out, a.dst, a.vec, a.act), (1, 11, 1, ACT_SIGMOID));
        let i = input_args(&g, 3, true, &addr);
        assert_eq!((i.src, i.c, i.cpad, i.h), (9, 6, 8, 96));
    }
}
