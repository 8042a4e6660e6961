//! The own cuDNN path and candle's operations on the GPU, layer by layer and for the whole
//! generator, in f32, f16 and bf16, at batch 2 and 512, against the f32 CPU pass on the same
//! inputs. Built only with `--features cuda`; needs a GPU:
//!
//!   ../shared/scripts/build-cuda.sh test --release --locked --features cuda --test gpu --no-run
//!   ../shared/scripts/run-on-gpu.sh target/release/deps/gpu-<hash> --test-threads=1 --nocapture
//!
//! (`bench/gpu_run.sh` runs it when the binary is carried as `target/release/gpu-test`;
//! `LIPSYNC_GPU_TEST_BATCHES=2` for a small run.)
//!
//! The own path runs in both activation layouts (`--conv-layout nhwc`, the default, whose tests
//! end in `_nhwc`, and `nchw`), with the decoder's upsampling as the process's settings have
//! it (subpixel by default: `src/model/subpixel.rs`).
//!
//! Prints per layer the chosen algorithm, math type, whether bias/residual/ReLU were fused,
//! the largest difference and the PSNR of both paths; fails on a layer (or a generator) whose
//! own path is broken: NaN, below the dtype's floor, or (whole generator) more than
//! `CONV_CHECK_MARGIN_DB` worse than candle's operations.
//!
//! Also the enhancers' tensor pass on the GPU against their CPU pass
//! (`enhancers_on_the_gpu_match_their_cpu_pass`, with faces/s at batches 1, 16 and 64; and
//! `gfpgan_on_the_gpu_matches_its_cpu_pass`, with faces/s at 1 and 4).
//!
//! Frames do not interact, so a batch of N repeats 4 distinct frames and only the first and
//! last 4 frames are compared: the CPU reference stays at 4 frames however large N is.
#![cfg(feature = "cuda")]

use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Tensor};
use lipsync::model::arch::{FACE_CHANNELS, FACE_SIZE, MEL_BINS, MEL_STEPS};
use lipsync::model::cudnn::{
    Arena, ChoiceSource, ConvLayout, ConvSettings, CudnnEngine, Epilogue, InputPad, Upsampling,
};
use lipsync::model::wav2lip::{
    accept_own_path, cudnn_check_floor, face_psnr, ActivationRanges, ConvBlock,
    CONV_CHECK_MARGIN_DB,
};
use lipsync::model::{init, DeviceKind, Wav2Lip};

/// Distinct frames; every batch repeats them.
const BASE: usize = 4;
/// The batches compared; `LIPSYNC_GPU_TEST_BATCHES=2` keeps a run small (e.g. under
/// `compute-sanitizer --tool memcheck`).
fn batches() -> Vec<usize> {
    std::env::var("LIPSYNC_GPU_TEST_BATCHES")
        .ok()
        .map(|v| {
            v.split(',')
                .map(|b| b.trim().parse().expect("LIPSYNC_GPU_TEST_BATCHES: numbers"))
                .collect()
        })
        .unwrap_or_else(|| vec![2, 512])
}
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// A device as a model instance opens it (its own stream, cudarc's event tracking off).
fn gpu() -> (Device, CudaDevice) {
    let dev = DeviceKind::Cuda
        .open_instance(0)
        .expect("these tests need a CUDA GPU");
    let Device::Cuda(cuda) = &dev else {
        unreachable!("open_instance(Cuda) gives a CUDA device")
    };
    assert!(
        !cuda.is_event_tracking(),
        "an instance's device runs one stream: cudarc's event tracking must be off"
    );
    let cuda = cuda.clone();
    (dev, cuda)
}

/// Least per-layer PSNR (peak: the reference's largest magnitude) of the own path: f32 runs
/// FMA math (no TF32), so only summation order differs; f16/bf16 round every input, weight
/// and output (bf16 3 mantissa bits fewer). A broken layer gives < 20 dB.
fn layer_floor(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 80.0,
        DType::F16 => 45.0,
        _ => 30.0,
    }
}

/// candle's operations are not under test, only reported; but a NaN or a far-off layer there
/// also fails (f32 may run TF32 in candle: about 10 mantissa bits).
fn candle_layer_floor(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 40.0,
        DType::F16 => 40.0,
        _ => 25.0,
    }
}

/// Rows of a batch of `n` that are compared: the first and last `BASE` (deduplicated).
fn rows(n: usize) -> Vec<usize> {
    let mut r: Vec<usize> = (0..n.min(BASE)).collect();
    r.extend(n.saturating_sub(BASE).max(BASE.min(n))..n);
    r.dedup();
    r
}

fn index(rows: &[usize], dev: &Device) -> Tensor {
    let v: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    Tensor::from_vec(v, rows.len(), dev).unwrap()
}

/// `base` (BASE frames) repeated to `n` frames (row r is base row r % BASE), on `dev` in
/// `dtype`.
fn tile(base: &Tensor, n: usize, dev: &Device, dtype: DType) -> Tensor {
    let idx: Vec<usize> = (0..n).map(|r| r % BASE).collect();
    base.to_device(dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .index_select(&index(&idx, dev), 0)
        .unwrap()
}

/// The reference rows matching [`rows`]`(n)`.
fn reference_rows(reference: &Tensor, n: usize) -> Tensor {
    let idx: Vec<usize> = rows(n).iter().map(|&r| r % BASE).collect();
    reference
        .index_select(&index(&idx, &Device::Cpu), 0)
        .unwrap()
}

/// Largest absolute difference and PSNR against `reference` (peak: its largest magnitude, 1
/// at least), both f32 on the CPU.
fn compare(out: &Tensor, reference: &Tensor) -> (f32, f64) {
    let out = out
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let diff = (out - reference).unwrap();
    let max = diff.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
    let max = max.to_scalar::<f32>().unwrap();
    let mse = diff
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap() as f64;
    let peak = reference
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .max(1.0) as f64;
    let psnr = if mse == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (peak * peak / mse).log10()
    };
    (if max.is_nan() { f32::NAN } else { max }, psnr)
}

/// Deterministic inputs of BASE distinct frames in the model's ranges.
fn inputs() -> (Tensor, Tensor) {
    let wave = |len: usize, scale: f32, shift: f32, phase: f32| -> Vec<f32> {
        (0..len)
            .map(|i| {
                let t = i as f32 + phase;
                shift + scale * (t * 0.37).sin() * (t * 0.011).cos()
            })
            .collect()
    };
    let mel = Tensor::from_vec(
        wave(BASE * MEL_BINS * MEL_STEPS, 4.0, 0.0, 0.5),
        (BASE, 1, MEL_BINS, MEL_STEPS),
        &Device::Cpu,
    )
    .unwrap();
    let face = Tensor::from_vec(
        wave(BASE * FACE_CHANNELS * FACE_SIZE * FACE_SIZE, 0.5, 0.5, 3.0),
        (BASE, FACE_CHANNELS, FACE_SIZE, FACE_SIZE),
        &Device::Cpu,
    )
    .unwrap();
    (mel, face)
}

/// The f32 CPU model on calibrated random weights (its `forward` is the own CPU pass).
fn cpu_model() -> Wav2Lip {
    let weights = init::random_weights(7).unwrap();
    let model = Wav2Lip::load(&weights, &Device::Cpu, DType::F32).unwrap();
    assert_eq!(model.conv_engine(), "cpu");
    model
}

/// Every layer with the input it sees for the BASE frames (f32, CPU).
fn layers_and_inputs(model: &Wav2Lip) -> Vec<(ConvBlock, Tensor)> {
    let (mel, face) = inputs();
    let mut seen = Vec::new();
    model
        .forward_with(&mel, &face, &mut |block, x| {
            seen.push((block.clone(), x.clone()));
            block.forward(x)
        })
        .unwrap();
    seen
}

fn to_gpu(block: &ConvBlock, dev: &Device, dtype: DType) -> ConvBlock {
    let move_ = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(dev).unwrap();
    ConvBlock::from_parts(
        block.path(),
        *block.spec(),
        move_(block.weight()),
        move_(block.bias()),
    )
}

fn layers_in(dtype: DType, layout: ConvLayout) {
    let (dev, cuda) = gpu();
    let cpu = cpu_model();
    let layers = layers_and_inputs(&cpu);
    let engine = CudnnEngine::with_layout(&cuda, dtype, layout).unwrap();
    let (floor, candle_floor) = (layer_floor(dtype), candle_layer_floor(dtype));
    let mut broken = Vec::new();
    eprintln!("\n{dtype:?} {layout:?}: layer | batch | algorithm | math | fused | own max diff | own PSNR | candle max diff | candle PSNR");
    for n in batches() {
        for (block, x) in &layers {
            // The f32 CPU reference on the BASE frames (candle's CPU convolution: exact f32).
            let reference = reference_rows(&block.forward(x).unwrap(), n);
            let g = to_gpu(block, &dev, dtype);
            let xg = layout.from_nchw(&tile(x, n, &dev, dtype)).unwrap();
            let sel = index(&rows(n), &dev);
            // Twice: the first call searches, runs unfused and then times the fused call
            // against the unfused sequence; the second is the steady state (fused only where
            // that timing found it faster).
            let mut own_runs = Vec::new();
            for _ in 0..2 {
                let own = engine
                    .forward(&g, &xg)
                    .map_err(|e| format!("{} at batch {n}: {e}", block.path()))
                    .unwrap();
                let own = layout.to_nchw(&own).unwrap().index_select(&sel, 0).unwrap();
                own_runs.push(compare(&own, &reference));
            }
            let candle = g
                .forward(&tile(x, n, &dev, dtype))
                .unwrap()
                .index_select(&sel, 0)
                .unwrap();
            let (first_max, first_psnr) = own_runs[0];
            let (own_max, own_psnr) = own_runs[1];
            let (candle_max, candle_psnr) = compare(&candle, &reference);
            let input = [n, x.dim(1).unwrap(), x.dim(2).unwrap(), x.dim(3).unwrap()];
            let report = engine
                .report()
                .into_iter()
                .find(|r| r.path == block.path() && r.input == input)
                .expect("a plan for every layer run");
            // No finish_warm_up here: every plan is a timed choice.
            assert_ne!(report.source, ChoiceSource::Heuristic, "{}", block.path());
            eprintln!(
                "{} | {n} | {} | {:?} | {} | {own_max:.3e} | {own_psnr:.1} | {candle_max:.3e} | {candle_psnr:.1}",
                block.path(),
                report.algo,
                report.math,
                report.fused,
            );
            if own_psnr.is_nan() || own_psnr < floor {
                broken.push(format!(
                    "own {} batch {n}: {own_psnr:.1} dB (floor {floor})",
                    block.path()
                ));
            }
            if first_psnr.is_nan() || first_psnr < floor {
                broken.push(format!(
                    "own {} batch {n}, first call: {first_psnr:.1} dB, max diff {first_max:.3e} \
                     (floor {floor})",
                    block.path()
                ));
            }
            if candle_psnr.is_nan() || candle_psnr < candle_floor {
                broken.push(format!(
                    "candle {} batch {n}: {candle_psnr:.1} dB (floor {candle_floor})",
                    block.path()
                ));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "{dtype:?} {layout:?}: broken layers:\n{}",
        broken.join("\n")
    );
}

fn generator_in(dtype: DType, layout: ConvLayout) {
    generator_with(
        dtype,
        ConvSettings {
            layout,
            ..ConvSettings::default()
        },
    );
}

/// The planned path (`--conv-epilogue own|auto`) in `dtype` with these choices.
fn planned_in(dtype: DType, up: Upsampling, epilogue: Epilogue, pad: InputPad, arena: Arena) {
    generator_with(
        dtype,
        ConvSettings {
            upsampling: up,
            epilogue,
            input_pad: pad,
            arena,
            ..ConvSettings::default()
        },
    );
}

fn generator_with(dtype: DType, settings: ConvSettings) {
    let (dev, _) = gpu();
    let cpu = cpu_model();
    let (mel, face) = inputs();
    let reference = cpu.forward(&mel, &face).unwrap();
    let weights = init::random_weights(7).unwrap();
    let mut own = Wav2Lip::load(&weights, &dev, dtype).unwrap();
    own.use_conv_settings(settings.clone()).unwrap();
    let layout = settings.layout;
    let dtype_layout = format!("{dtype:?} {}", settings.cache_identity());
    assert_eq!(own.conv_engine(), "cudnn", "the own path must be available");
    let mut candle = Wav2Lip::load(&weights, &dev, dtype).unwrap();
    candle.use_candle_operations();
    let floor = cudnn_check_floor(dtype);
    eprintln!("\n{dtype_layout} generator: batch | own max diff | own face PSNR | candle max diff | candle face PSNR");
    let mut broken = Vec::new();
    let run = |n: usize, broken: &mut Vec<String>| {
        let (m, f) = (tile(&mel, n, &dev, dtype), tile(&face, n, &dev, dtype));
        let sel = index(&rows(n), &dev);
        let r = reference_rows(&reference, n);
        let o = own.forward(&m, &f).unwrap().index_select(&sel, 0).unwrap();
        let c = candle
            .forward(&m, &f)
            .unwrap()
            .index_select(&sel, 0)
            .unwrap();
        let (own_max, _) = compare(&o, &r);
        let (candle_max, _) = compare(&c, &r);
        // Faces in 0–1: the start-up check's measure.
        let own_psnr = face_psnr(&o.to_device(&Device::Cpu).unwrap(), &r).unwrap();
        let candle_psnr = face_psnr(&c.to_device(&Device::Cpu).unwrap(), &r).unwrap();
        eprintln!("{n} | {own_max:.3e} | {own_psnr:.1} | {candle_max:.3e} | {candle_psnr:.1}");
        if !accept_own_path(own_psnr, Some(candle_psnr), floor, CONV_CHECK_MARGIN_DB) {
            broken.push(format!(
                "batch {n}: own {own_psnr:.1} dB, candle {candle_psnr:.1} dB (floor {floor})"
            ));
        }
    };
    for n in batches() {
        // The planned path's first pass at a batch times what `auto` leaves open; the
        // second runs the choices.
        for _ in 0..if settings.planned() { 2 } else { 1 } {
            run(n, &mut broken);
        }
    }
    if let Some(g) = own.planned_graph(2).unwrap() {
        let forms: Vec<String> = g
            .layers
            .iter()
            .filter_map(|l| l.form.map(|f| format!("{} {}", l.path, f.name())))
            .collect();
        let fused: Vec<&str> = g
            .layers
            .iter()
            .filter(|l| l.fused)
            .map(|l| l.path.as_str())
            .collect();
        eprintln!(
            "  forms at batch 2: {forms:?}; fused: {fused:?}; split skips {:?}",
            g.split
        );
    }
    // After warm-up, a batch size never seen takes cuDNN's heuristic choice (no search).
    own.finish_warm_up();
    run(3, &mut broken);
    let report = own.cudnn_report();
    for r in &report {
        eprintln!(
            "  {} {:?}: {} {:?} fused={} workspace={} ({:?})",
            r.path, r.input, r.algo, r.math, r.fused, r.workspace, r.source
        );
    }
    assert!(
        report
            .iter()
            .filter(|r| r.input[0] == 3)
            .all(|r| r.source == ChoiceSource::Heuristic),
        "batch 3 after warm-up must not search"
    );
    assert!(
        report
            .iter()
            .filter(|r| r.input[0] != 3)
            .all(|r| r.source != ChoiceSource::Heuristic),
        "warm-up batches must be timed"
    );
    // Overflow checks on every layer: the maxima come back and nothing overflows.
    let ranges = ActivationRanges::measure(&weights).unwrap();
    own.check_overflow(&ranges);
    let n = 2;
    let (m, f) = (tile(&mel, n, &dev, dtype), tile(&face, n, &dev, dtype));
    let (guarded, overflow) = own.forward_guarded(&m, &f).unwrap();
    assert!(
        !overflow,
        "{dtype_layout}: overflow flagged on calibrated weights"
    );
    let plain = own.forward(&m, &f).unwrap();
    let same = face_psnr(&guarded, &plain).unwrap();
    assert!(
        same > 60.0,
        "{dtype_layout}: guarded and plain passes differ ({same:.1} dB)"
    );
    assert!(
        broken.is_empty(),
        "{dtype_layout} ({layout:?}): {}",
        broken.join("\n")
    );
}

#[test]
fn planned_generator_in_f16_own_phases_padded() {
    planned_in(
        DType::F16,
        Upsampling::Phases,
        Epilogue::Own,
        InputPad::Eight,
        Arena::On,
    );
}

#[test]
fn planned_generator_in_f16_auto() {
    planned_in(
        DType::F16,
        Upsampling::Auto,
        Epilogue::Auto,
        InputPad::Eight,
        Arena::On,
    );
}

#[test]
fn planned_generator_in_bf16_auto() {
    planned_in(
        DType::BF16,
        Upsampling::Auto,
        Epilogue::Auto,
        InputPad::Eight,
        Arena::On,
    );
}

#[test]
fn planned_generator_in_f32_subpixel2x2_arena_off() {
    planned_in(
        DType::F32,
        Upsampling::Subpixel2x2,
        Epilogue::Own,
        InputPad::None,
        Arena::Off,
    );
}

#[test]
fn planned_generator_in_f16_transposed_unpadded() {
    planned_in(
        DType::F16,
        Upsampling::Transposed,
        Epilogue::Own,
        InputPad::None,
        Arena::On,
    );
}

#[test]
fn separate_generator_in_f16_every_form() {
    for up in [
        Upsampling::Auto,
        Upsampling::Subpixel2x2,
        Upsampling::Phases,
    ] {
        planned_in(
            DType::F16,
            up,
            Epilogue::Separate,
            InputPad::Eight,
            Arena::On,
        );
    }
}

#[test]
fn every_layer_in_f32() {
    layers_in(DType::F32, ConvLayout::Nchw);
}

#[test]
fn every_layer_in_f32_nhwc() {
    layers_in(DType::F32, ConvLayout::Nhwc);
}

#[test]
fn every_layer_in_f16() {
    layers_in(DType::F16, ConvLayout::Nchw);
}

#[test]
fn every_layer_in_f16_nhwc() {
    layers_in(DType::F16, ConvLayout::Nhwc);
}

#[test]
fn every_layer_in_bf16() {
    layers_in(DType::BF16, ConvLayout::Nchw);
}

#[test]
fn every_layer_in_bf16_nhwc() {
    layers_in(DType::BF16, ConvLayout::Nhwc);
}

#[test]
fn generator_in_f32() {
    generator_in(DType::F32, ConvLayout::Nchw);
}

#[test]
fn generator_in_f32_nhwc() {
    generator_in(DType::F32, ConvLayout::Nhwc);
}

#[test]
fn generator_in_f16() {
    generator_in(DType::F16, ConvLayout::Nchw);
}

#[test]
fn generator_in_f16_nhwc() {
    generator_in(DType::F16, ConvLayout::Nhwc);
}

#[test]
fn generator_in_bf16() {
    generator_in(DType::BF16, ConvLayout::Nchw);
}

#[test]
fn generator_in_bf16_nhwc() {
    generator_in(DType::BF16, ConvLayout::Nhwc);
}

#[test]
fn the_start_up_check_accepts_the_own_path_at_the_largest_batch() {
    let (dev, _) = gpu();
    let weights = init::random_weights(7).unwrap();
    let planned = ConvSettings {
        upsampling: Upsampling::Auto,
        epilogue: Epilogue::Auto,
        input_pad: InputPad::Eight,
        ..ConvSettings::default()
    };
    for (dtype, settings) in DTYPES
        .into_iter()
        .map(|d| (d, ConvSettings::default()))
        .chain(DTYPES.into_iter().map(|d| (d, planned.clone())))
    {
        let mut m = Wav2Lip::load(&weights, &dev, dtype).unwrap();
        m.use_conv_settings(settings).unwrap();
        let largest = batches().into_iter().max().unwrap_or(2);
        let psnr = m.verify_cudnn_path_at(largest).unwrap();
        eprintln!(
            "{dtype:?}: start-up check {psnr:?} dB, path {}",
            m.conv_engine()
        );
        assert_eq!(
            m.conv_engine(),
            "cudnn",
            "{dtype:?}: the check refused the own path"
        );
    }
}

/// A 3×3 convolution's keys and shapes.
fn enhancer_conv(prefix: &str, cin: usize, cout: usize) -> [(String, Vec<usize>); 2] {
    [
        (format!("{prefix}.weight"), vec![cout, cin, 3, 3]),
        (format!("{prefix}.bias"), vec![cout]),
    ]
}

/// Writes an enhancer checkpoint (safetensors) of these keys with small deterministic
/// weights (N(0, 1/fan_in)-like, PReLU slopes in [0, 0.25)) and loads it as `serve` does.
fn enhancer_file(
    dir: &std::path::Path,
    name: &str,
    keys: &[(String, Vec<usize>)],
) -> lipsync::model::enhancer::Enhancer {
    let mut state = 0x2545_f491_u32;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        f32::from(state as u16) / 65536.0
    };
    let tensors: std::collections::HashMap<String, Tensor> = keys
        .iter()
        .map(|(k, shape)| {
            let n: usize = shape.iter().product();
            let fan_in = shape.iter().skip(1).product::<usize>().max(1) as f32;
            let prelu = shape.len() == 1 && !k.ends_with(".bias");
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    if prelu {
                        next() * 0.25
                    } else {
                        (next() - 0.5) * 1.5 / fan_in.sqrt()
                    }
                })
                .collect();
            (
                k.clone(),
                Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).unwrap(),
            )
        })
        .collect();
    let path = dir.join(format!("{name}.safetensors"));
    candle_core::safetensors::save(&tensors, &path).unwrap();
    lipsync::model::enhancer::load(&path).unwrap()
}

/// The enhancers' tensor pass on `device` (what `serve --device cuda --enhancer-checkpoint`
/// runs) against their CPU pass (which tests/enhancer.rs checks against the upstream
/// networks), on the own cuDNN path, at batches 1, 16 and 5 (every face compared; 5 is a
/// size not timed at warm-up, which takes cuDNN's heuristic), for a compact x4 network of
/// realesr-general-x4v3's shapes and a 2-block x2 RRDBNet; prints faces/s at 1, 16 and 64.
fn enhancers_on(device: &Device) {
    let dir = tempfile::tempdir().unwrap();
    let mut compact = Vec::new();
    for i in 0..=32 {
        compact.extend(enhancer_conv(
            &format!("body.{}", 2 * i),
            if i == 0 { 3 } else { 64 },
            64,
        ));
        compact.push((format!("body.{}.weight", 2 * i + 1), vec![64]));
    }
    compact.extend(enhancer_conv("body.66", 64, 48));
    let mut rrdb = Vec::new();
    rrdb.extend(enhancer_conv("conv_first", 12, 64));
    for b in 0..2 {
        for r in 1..=3 {
            for c in 1..=5 {
                let (i, o) = (64 + (c - 1) * 32, if c == 5 { 64 } else { 32 });
                rrdb.extend(enhancer_conv(&format!("body.{b}.rdb{r}.conv{c}"), i, o));
            }
        }
    }
    for name in ["conv_body", "conv_up1", "conv_up2", "conv_hr"] {
        rrdb.extend(enhancer_conv(name, 64, 64));
    }
    rrdb.extend(enhancer_conv("conv_last", 64, 3));
    for (name, keys) in [("compact-x4", compact), ("rrdb-x2", rrdb)] {
        let e = enhancer_file(dir.path(), name, &keys);
        let on = e.net.on_device(device).unwrap();
        // Its convolutions on the own cuDNN path (the default --conv-engine), which
        // `on_device` warmed up and checked against candle's conv2d; `candle` here means that
        // check or its start failed (the log says why).
        println!(
            "enhancer {name}: convolutions on the {} path",
            on.conv_path()
        );
        assert_eq!(
            on.conv_path(),
            "cudnn",
            "{name}: the own cuDNN path did not start"
        );
        let faces = |n: usize| -> Vec<f32> {
            (0..n * 3 * FACE_SIZE * FACE_SIZE)
                .map(|i| ((i * 7919) % 1009) as f32 / 1008.0)
                .collect()
        };
        for n in [1usize, 16, 5] {
            let x = faces(n);
            let want = e.net.forward_cpu(n, FACE_SIZE, FACE_SIZE, &x).unwrap();
            let got = on.forward(n, FACE_SIZE, FACE_SIZE, &x).unwrap();
            assert_eq!(want.len(), got.len(), "{name} batch {n}");
            let worst = want
                .iter()
                .zip(&got)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            println!("enhancer {name} batch {n}: max |tensor pass - CPU pass| = {worst:.2e}");
            // Within 1/255 of an 8-bit level (TF32 convolutions may round more than f32).
            assert!(
                worst.is_finite() && worst < 1.0 / 255.0,
                "{name} batch {n}: {worst}"
            );
        }
        for n in [1usize, 16, 64] {
            let x = faces(n);
            on.forward(n, FACE_SIZE, FACE_SIZE, &x).unwrap();
            let t = std::time::Instant::now();
            on.forward(n, FACE_SIZE, FACE_SIZE, &x).unwrap();
            let rate = n as f64 / t.elapsed().as_secs_f64();
            println!(
                "enhancer {name} batch {n}: {rate:.1} faces/s, {:.0} MB estimated",
                on.bytes(n, FACE_SIZE, FACE_SIZE) as f64 / 1e6
            );
        }
    }
}

#[test]
fn enhancers_on_the_gpu_match_their_cpu_pass() {
    // A device as `serve --device cuda` opens one per enhancer instance.
    let device = DeviceKind::Cuda
        .open_instance(0)
        .expect("these tests need a CUDA GPU");
    enhancers_on(&device);
}

#[test]
fn gfpgan_on_the_gpu_matches_its_cpu_pass() {
    // GFPGANv1Clean in the published layout (random weights, 349 MB written and loaded as
    // `serve` does), its tensor pass on the GPU against the CPU pass (which tests/enhancer.rs
    // checks against the upstream network) on aligned 512x512 faces: at 1 face and at 3 (not
    // a warm-up size: cuDNN's heuristic), each face its own latents.
    use lipsync::model::enhancer::gfpgan::{keys, MAX_FACES, SIDE};
    let device = DeviceKind::Cuda
        .open_instance(0)
        .expect("these tests need a CUDA GPU");
    let dir = tempfile::tempdir().unwrap();
    let e = enhancer_file(dir.path(), "GFPGANv1.4", &keys());
    let on = e.net.on_device(&device).unwrap();
    println!("gfpgan: convolutions on the {} path", on.conv_path());
    assert_eq!(on.conv_path(), "cudnn", "the own cuDNN path did not start");
    let plane = 3 * SIDE * SIDE;
    let faces = |n: usize| -> Vec<f32> {
        (0..n * plane)
            .map(|i| ((i * 7919 + (i / plane) * 131) % 1009) as f32 / 1008.0)
            .collect()
    };
    for n in [1usize, 3] {
        let x = faces(n);
        let want = e.net.forward_cpu(n, SIDE, SIDE, &x).unwrap();
        let got = on.forward(n, SIDE, SIDE, &x).unwrap();
        assert_eq!(want.len(), got.len(), "batch {n}");
        // Not a saturated output: the comparison means something.
        let inside = want.iter().filter(|v| **v > 0.01 && **v < 0.99).count();
        assert!(
            inside > want.len() / 4,
            "{inside} of {} inside (0, 1)",
            want.len()
        );
        // A NaN anywhere counts as the largest difference.
        let worst = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(
                0f32,
                |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
            );
        println!("gfpgan batch {n}: max |tensor pass - CPU pass| = {worst:.2e}");
        assert!(
            worst.is_finite() && worst < 1.0 / 255.0,
            "batch {n}: {worst}"
        );
    }
    for n in [1usize, MAX_FACES] {
        let x = faces(n);
        on.forward(n, SIDE, SIDE, &x).unwrap();
        let t = std::time::Instant::now();
        on.forward(n, SIDE, SIDE, &x).unwrap();
        let rate = n as f64 / t.elapsed().as_secs_f64();
        println!(
            "gfpgan batch {n}: {rate:.1} faces/s, {:.0} MB estimated",
            on.bytes(n, SIDE, SIDE) as f64 / 1e6
        );
    }
}
