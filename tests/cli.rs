//! The `lipsync` binary as a user runs it: `convert`, `info`, `init-weights`, exit codes.

mod common;

use std::path::Path;

use common::{
    checkpoint, expected_tensors, lipsync, media_path, sha256_f32, text, CHECKPOINT_FORMS,
};
use lipsync::model::GeneratorWeights;

#[test]
fn convert_writes_the_302_source_tensors_from_every_form() {
    let dir = tempfile::tempdir().unwrap();
    let expected = expected_tensors();
    for &(file, _, _) in CHECKPOINT_FORMS {
        let out = dir.path().join(format!("{file}.safetensors"));
        let o = lipsync(&[&"convert", &checkpoint(file), &out]);
        assert!(o.status.success(), "{file}: {}", text(&o.stderr));
        let ck = lipsync::model::checkpoint::read(&out).unwrap();
        assert_eq!(ck.tensors.len(), 302, "{file}");
        for (key, shape, sha) in &expected {
            let t = ck
                .get(key)
                .unwrap_or_else(|| panic!("{file}: {key} missing"));
            assert_eq!(t.dtype.name(), "f32");
            assert_eq!(&t.shape, shape);
            assert_eq!(&sha256_f32(&t.to_tensor().unwrap()), sha, "{file}: {key}");
        }
    }
}

#[test]
fn convert_folds_and_casts_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("folded-f16.safetensors");
    let o = lipsync(&[
        &"convert",
        &checkpoint("torchscript.pt"),
        &out,
        &"--fold-bn",
        &"--dtype",
        &"f16",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = lipsync(&[&"info", &out, &"--json"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["format"], "safetensors");
    assert_eq!(v["folded"], true);
    assert_eq!(v["tensors"], 102);
    assert_eq!(v["dtype"], "f16");
    // Folded: conv weights and biases only (BN gamma/beta are absorbed).
    assert_eq!(v["parameters"], 36_298_035 - 22_752);

    // bf16 too, unfolded; the result loads again.
    let out = dir.path().join("bf16.safetensors");
    let o = lipsync(&[
        &"convert",
        &checkpoint("zip_dict.pt"),
        &out,
        &"--dtype",
        &"bf16",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let (_, s) = GeneratorWeights::from_file(&out).unwrap();
    assert_eq!(
        (s.dtype.as_str(), s.tensors, s.folded),
        ("bf16", 302, false)
    );
}

#[test]
fn info_describes_a_published_checkpoint() {
    let o = lipsync(&[&"info", &checkpoint("legacy_module_prefix.pth")]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    for want in [
        "legacy-torch-save",
        "folded      no",
        "tensors     302",
        "parameters  36,298,035",
        "dtype       f32",
        "module.",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
    let o = lipsync(&[&"info", &checkpoint("zip_module.pt"), &"--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["format"], "zip-module-pickle");
    assert_eq!(v["parameters"], 36_298_035);
    assert_eq!(v["tensors"], 302);
}

fn truncated_copy(dir: &Path, src: &Path, keep: f64) -> std::path::PathBuf {
    let bytes = std::fs::read(src).unwrap();
    let cut = dir.join(format!(
        "cut-{keep}-{}",
        src.file_name().unwrap().to_string_lossy()
    ));
    std::fs::write(&cut, &bytes[..(bytes.len() as f64 * keep) as usize]).unwrap();
    cut
}

#[test]
fn info_on_a_truncated_download_says_truncated_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    for &(file, _, _) in CHECKPOINT_FORMS {
        for keep in [0.3, 0.97] {
            let cut = truncated_copy(dir.path(), &checkpoint(file), keep);
            let o = lipsync(&[&"info", &cut]);
            let err = text(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "{file} {keep}: {err}");
            assert!(err.contains("truncated"), "{file} {keep}: {err}");
            assert!(!err.contains("panicked"), "{err}");
            // JSON mode reports the same on stdout.
            let o = lipsync(&[&"info", &cut, &"--json"]);
            assert_eq!(o.status.code(), Some(2));
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(v["error_type"], "truncated");
        }
    }
    // A legacy file cut inside its tensor data knows how long it should have been.
    let full = std::fs::metadata(checkpoint("legacy_plain.pth"))
        .unwrap()
        .len();
    let cut = truncated_copy(dir.path(), &checkpoint("legacy_plain.pth"), 0.97);
    let err = text(&lipsync(&[&"info", &cut]).stderr);
    assert!(err.contains(&format!("should have {full}")), "{err}");
}

#[test]
fn errors_exit_2_and_usage_errors_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.pth");
    std::fs::write(&junk, b"<html>404 Not Found</html>").unwrap();
    let o = lipsync(&[&"info", &junk]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("not a checkpoint"));

    let o = lipsync(&[&"info", &dir.path().join("missing.pth")]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("cannot read"));

    let o = lipsync(&[&"convert", &junk, &dir.path().join("out.safetensors")]);
    assert_eq!(o.status.code(), Some(2));
    assert!(!dir.path().join("out.safetensors").exists());

    assert_eq!(lipsync(&[&"info"]).status.code(), Some(1));
    assert_eq!(
        lipsync(&[&"convert", &junk, &"o", &"--dtype", &"f8"])
            .status
            .code(),
        Some(1)
    );
    assert_eq!(lipsync(&[&"no-such-command"]).status.code(), Some(1));
    assert_eq!(lipsync(&[&"--help"]).status.code(), Some(0));
}

#[test]
fn init_weights_writes_loadable_random_weights() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("random.safetensors");
    let o = lipsync(&[&"init-weights", &out, &"--seed", &"3"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stderr).contains("noise"));
    let o = lipsync(&[&"info", &out]);
    let info = text(&o.stdout);
    assert!(info.contains("tensors     302"), "{info}");
    assert!(info.contains("random test weights (seed 3)"), "{info}");
    // The marker survives conversion.
    let folded = dir.path().join("folded.safetensors");
    assert!(lipsync(&[&"convert", &out, &folded, &"--fold-bn"])
        .status
        .success());
    let (_, s) = GeneratorWeights::from_file(&folded).unwrap();
    assert_eq!(s.random_init_seed, Some(3));
}

#[test]
fn audio_reports_frames_for_every_format() {
    for file in [
        "arctic_a0007.wav",
        "arctic_a0007_44k_stereo.flac",
        "arctic_a0007_44k_stereo.mp3",
        "arctic_a0007_44k_stereo.ogg",
        "arctic_a0007_44k_stereo.m4a",
    ] {
        let o = lipsync(&[&"audio", &media_path(file), &"--json"]);
        assert!(o.status.success(), "{file}: {}", text(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["frames"], 97, "{file}");
        assert_eq!(v["mel_frames"], 321, "{file}");
        assert_eq!(v["seconds"], 4.0, "{file}");
    }
    // 10 s at 29.97 fps is the spec's second example; here 4 s at 29.97 and 30000/1001.
    for fps in ["29.97", "30000/1001"] {
        let o = lipsync(&[
            &"audio",
            &media_path("arctic_a0007.wav"),
            &"--fps",
            &fps,
            &"--json",
        ]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["frames"], 116, "{fps}");
    }
    let o = lipsync(&[&"audio", &media_path("arctic_a0007.wav")]);
    assert!(
        text(&o.stdout).contains("97 at 25 fps"),
        "{}",
        text(&o.stdout)
    );
}

#[test]
fn audio_errors_are_typed_and_exit_2() {
    let png = checkpoint("expected.json"); // any non-audio file
    let o = lipsync(&[&"audio", &png, &"--json"]);
    assert_eq!(o.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["error_type"], "not_audio");
    let o = lipsync(&[
        &"audio",
        &media_path("arctic_a0007.wav"),
        &"--max-seconds",
        &"2",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("too long"), "{}", text(&o.stderr));
    assert_eq!(
        lipsync(&[&"audio", &media_path("arctic_a0007.wav"), &"--fps", &"61"])
            .status
            .code(),
        Some(1)
    );
}
