//! The candle Wav2Lip against the PyTorch reference (tests/reference/wav2lip_reference.py).

mod common;

use candle_core::{DType, Device, Tensor};
use common::{checkpoint, max_abs_diff, parity};
use lipsync::model::arch::{self, AUDIO_ENCODER};
use lipsync::model::wav2lip::conv_layer;
use lipsync::model::{Error, GeneratorWeights, Wav2Lip};

/// Absolute tolerance on the sigmoid output (the reference is computed in float64; PyTorch's
/// own float32 result differs from it by about 1e-5).
const TOL: f32 = 1e-4;

fn reference_weights() -> GeneratorWeights {
    GeneratorWeights::from_file(&checkpoint("legacy_module_prefix.pth"))
        .unwrap()
        .0
}

#[test]
fn full_forward_matches_pytorch_in_f32() {
    let model = Wav2Lip::load(&reference_weights(), &Device::Cpu, DType::F32).unwrap();
    let out = model.forward(&parity("mel"), &parity("face")).unwrap();
    assert_eq!(out.dims(), &[4, 3, 96, 96]);
    let err = max_abs_diff(&out, &parity("out"));
    eprintln!("max |candle f32 - PyTorch f64| = {err:.2e}");
    assert!(err < TOL, "max abs difference {err}");
}

#[test]
fn the_own_cpu_pass_and_candles_operations_agree_with_pytorch() {
    // `forward` on the CPU in f32 is the own NHWC/GEMM pass; `forward_candle` candle's
    // convolutions. Both against the float64 reference, and against each other.
    let model = Wav2Lip::load(&reference_weights(), &Device::Cpu, DType::F32).unwrap();
    let own = model.forward(&parity("mel"), &parity("face")).unwrap();
    let candle = model
        .forward_candle(&parity("mel"), &parity("face"))
        .unwrap();
    let (e_own, e_candle) = (
        max_abs_diff(&own, &parity("out")),
        max_abs_diff(&candle, &parity("out")),
    );
    eprintln!("max |own - PyTorch f64| = {e_own:.2e}, |candle - PyTorch f64| = {e_candle:.2e}");
    assert!(e_own < TOL && e_candle < TOL, "{e_own} {e_candle}");
    assert!(max_abs_diff(&own, &candle) < TOL);
    // Batches of any size (tiles split differently) give each frame the same face.
    for n in [1, 3] {
        let one = model
            .forward(
                &parity("mel").narrow(0, 1, n).unwrap(),
                &parity("face").narrow(0, 1, n).unwrap(),
            )
            .unwrap();
        let want = parity("out").narrow(0, 1, n).unwrap();
        assert!(max_abs_diff(&one, &want) < TOL, "batch {n}");
    }
}

#[test]
fn a_fast_path_that_disagrees_with_candle_is_switched_off() {
    // Every instance checks its fast path (the CPU pass here, cuDNN on CUDA) against candle's
    // operations before serving; disagreement switches the model to candle's operations.
    let mut model = Wav2Lip::load(&reference_weights(), &Device::Cpu, DType::F32).unwrap();
    assert_eq!(model.conv_engine(), "cpu");
    let psnr = model.check_conv_engine(2, 60.0).unwrap();
    assert!(psnr > 80.0, "{psnr}");
    assert_eq!(model.conv_engine(), "cpu");
    // Less agreement than asked for (no finite PSNR reaches infinity): switched off.
    model.check_conv_engine(2, f64::INFINITY).unwrap();
    assert_eq!(model.conv_engine(), "candle");
    let out = model.forward(&parity("mel"), &parity("face")).unwrap();
    assert!(max_abs_diff(&out, &parity("out")) < TOL);
    // Off the cuDNN path, the start-up check is a no-op.
    assert_eq!(model.verify_cudnn_path().unwrap(), None);
}

#[test]
fn every_checkpoint_form_gives_the_same_faces() {
    let mel = parity("mel").narrow(0, 0, 1).unwrap();
    let face = parity("face").narrow(0, 0, 1).unwrap();
    let want = parity("out").narrow(0, 0, 1).unwrap();
    for &(file, _, _) in common::CHECKPOINT_FORMS {
        let (w, _) = GeneratorWeights::from_file(&checkpoint(file)).unwrap();
        let model = Wav2Lip::load(&w, &Device::Cpu, DType::F32).unwrap();
        let err = max_abs_diff(&model.forward(&mel, &face).unwrap(), &want);
        assert!(err < TOL, "{file}: {err}");
    }
}

#[test]
fn asymmetric_stride_convolutions_match_pytorch() {
    let w = reference_weights();
    for (layer, stride) in [(3usize, (3usize, 1usize)), (9, (3, 2))] {
        let spec = AUDIO_ENCODER[layer];
        assert_eq!(spec.stride, stride);
        let p = format!("audio_encoder.{layer}.conv_block.0");
        let x = parity(&format!("audio_encoder.{layer}.in"));
        let want = parity(&format!("audio_encoder.{layer}.out"));
        let got = conv_layer(
            &x,
            w.get(&format!("{p}.weight")).unwrap(),
            w.get(&format!("{p}.bias")).unwrap(),
            &spec,
        )
        .unwrap();
        assert_eq!(got.dims(), want.dims(), "{p}");
        let err = max_abs_diff(&got, &want);
        assert!(err < 1e-4, "{p}: {err}");
    }
}

#[test]
fn folded_file_equals_unfolded_checkpoint() {
    let w = reference_weights();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("folded.safetensors");
    w.fold().unwrap().save(&path, DType::F32).unwrap();
    let (folded, s) = GeneratorWeights::from_file(&path).unwrap();
    assert!(s.folded && folded.is_folded());
    assert_eq!(s.tensors, 102);
    let mel = parity("mel");
    let face = parity("face");
    let a = Wav2Lip::load(&w, &Device::Cpu, DType::F32)
        .unwrap()
        .forward(&mel, &face)
        .unwrap();
    let b = Wav2Lip::load(&folded, &Device::Cpu, DType::F32)
        .unwrap()
        .forward(&mel, &face)
        .unwrap();
    assert_eq!(max_abs_diff(&a, &b), 0.0);
}

/// BatchNorm folding against BatchNorm applied explicitly, for a convolution (scale on weight
/// dim 0) and a transposed convolution (scale on weight dim 1).
#[test]
fn folding_equals_explicit_batch_norm() {
    let w = reference_weights();
    let folded = w.fold().unwrap();
    let mut checked = 0;
    for (path, spec) in arch::layers() {
        if !matches!(
            path.as_str(),
            "face_encoder_blocks.1.0" | "face_decoder_blocks.3.0"
        ) {
            continue;
        }
        let (c, h) = (spec.cin, 6);
        let x = Tensor::randn(0f32, 1.0, (2, c, h, h), &Device::Cpu).unwrap();
        let p = format!("{path}.conv_block");
        let g = |k: &str| {
            w.get(&format!("{p}.{k}"))
                .unwrap()
                .reshape((1, (), 1, 1))
                .unwrap()
        };
        let y = conv_layer(
            &x,
            w.get(&format!("{p}.0.weight")).unwrap(),
            w.get(&format!("{p}.0.bias")).unwrap(),
            &spec,
        )
        .unwrap();
        let bn = y
            .broadcast_sub(&g("1.running_mean"))
            .unwrap()
            .broadcast_div(&(g("1.running_var") + 1e-5).unwrap().sqrt().unwrap())
            .unwrap()
            .broadcast_mul(&g("1.weight"))
            .unwrap()
            .broadcast_add(&g("1.bias"))
            .unwrap();
        let fy = conv_layer(
            &x,
            folded.get(&format!("{p}.0.weight")).unwrap(),
            folded.get(&format!("{p}.0.bias")).unwrap(),
            &spec,
        )
        .unwrap();
        let err = max_abs_diff(&bn, &fy);
        assert!(err < 1e-4, "{path}: {err}");
        checked += 1;
    }
    assert_eq!(checked, 2);
}

#[test]
fn bf16_on_cpu_computes_in_f32() {
    let device = Device::Cpu;
    let dtype = lipsync::model::compute_dtype(&device, lipsync::model::Precision::Bf16);
    assert_eq!(dtype, DType::F32);
}

#[test]
fn f16_on_cpu_stays_close_to_f32() {
    let model = Wav2Lip::load(&reference_weights(), &Device::Cpu, DType::F16).unwrap();
    let mel = parity("mel").narrow(0, 0, 1).unwrap();
    let face = parity("face").narrow(0, 0, 1).unwrap();
    let out = model.forward(&mel, &face).unwrap();
    assert_eq!(out.dtype(), DType::F16);
    let err = max_abs_diff(&out, &parity("out").narrow(0, 0, 1).unwrap());
    eprintln!("max |candle f16 - PyTorch f64| = {err:.2e}");
    assert!(err < 0.05, "{err}");
}

#[test]
fn wrong_input_shapes_are_errors() {
    let model = Wav2Lip::load(&reference_weights(), &Device::Cpu, DType::F32).unwrap();
    let mel = parity("mel");
    let face = parity("face");
    for (m, f) in [
        (mel.narrow(0, 0, 2).unwrap(), face.clone()),
        (mel.narrow(3, 0, 8).unwrap(), face.clone()),
        (mel.clone(), face.narrow(1, 0, 3).unwrap()),
        (mel.narrow(0, 0, 0).unwrap(), face.narrow(0, 0, 0).unwrap()),
    ] {
        assert!(matches!(model.forward(&m, &f), Err(Error::BadInput(_))));
    }
}

#[test]
fn random_weights_are_deterministic_and_draw_unsaturated_faces() {
    let a = lipsync::model::init::random_weights(7).unwrap();
    let b = lipsync::model::init::random_weights(7).unwrap();
    let c = lipsync::model::init::random_weights(8).unwrap();
    let key = "face_decoder_blocks.6.2.conv_block.1.running_var";
    assert_eq!(
        common::sha256_f32(a.get(key).unwrap()),
        common::sha256_f32(b.get(key).unwrap())
    );
    assert_ne!(
        common::sha256_f32(a.get(key).unwrap()),
        common::sha256_f32(c.get(key).unwrap())
    );
    assert_eq!(a.random_seed(), Some(7));
    assert_eq!(a.parameter_count(), 36_298_035);

    let model = Wav2Lip::load(&a, &Device::Cpu, DType::F32).unwrap();
    let out = model.forward(&parity("mel"), &parity("face")).unwrap();
    let v = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let saturated = v.iter().filter(|&&x| !(0.01..=0.99).contains(&x)).count();
    let mean = v.iter().sum::<f32>() / v.len() as f32;
    let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32).sqrt();
    assert!(
        saturated * 20 < v.len(),
        "{saturated} of {} saturated",
        v.len()
    );
    assert!(std > 0.05, "std {std}");
}
