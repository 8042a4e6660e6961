//! Inputs the fuzzers (fuzz/) once found problems with, or damaged files kept as regressions:
//! each must now give a result or a typed error, without panicking, along the same path as
//! its fuzz target. A folder that is missing or empty fails the test: a test that checked
//! nothing must not pass.

use std::path::PathBuf;
use std::sync::Arc;

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions")
        .join(target);
    let entries = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("no regression inputs for {target}: {}: {e}", dir.display()));
    let found: Vec<_> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect();
    assert!(
        !found.is_empty(),
        "{} holds no regression inputs",
        dir.display()
    );
    found
}

#[test]
fn audio_regressions_give_errors_not_panics() {
    for (path, bytes) in inputs("audio") {
        match lipsync::media::audio::load(&bytes, 30.0) {
            Ok(speech) => {
                let mel = speech.mel();
                let _ = lipsync::media::audio::FramePlan::new(
                    mel.frames(),
                    lipsync::media::audio::Fps::DEFAULT,
                );
            }
            Err(e) => eprintln!("{}: rejected ({})", path.display(), e.kind()),
        }
    }
}

#[test]
fn checkpoint_regressions_give_errors_not_panics() {
    for (path, bytes) in inputs("checkpoint") {
        match lipsync::model::checkpoint::Checkpoint::from_bytes(Arc::from(bytes.as_slice())) {
            Ok(ck) => {
                for (_, t) in &ck.tensors {
                    let _ = t.to_bytes();
                }
                let _ = lipsync::model::GeneratorWeights::from_checkpoint(&ck);
            }
            Err(e) => eprintln!("{}: rejected ({e})", path.display()),
        }
    }
}

#[test]
fn image_regressions_give_errors_not_panics() {
    let limits = lipsync::media::image::ImageLimits {
        max_pixels: 1 << 18,
        max_side: 256,
    };
    for (path, bytes) in inputs("image") {
        match lipsync::media::image::load(&bytes, &limits) {
            Ok(f) => {
                assert_eq!(f.rgb.len(), f.width as usize * f.height as usize * 3);
                // Photos cut short (an interrupted upload) are damaged, never rendered.
                assert!(!is_cut(&path), "{} was accepted", path.display());
            }
            Err(e) => eprintln!("{}: rejected ({})", path.display(), e.kind()),
        }
    }
}

/// Regression files named for damage: cut short, or a header that points past the end.
fn is_cut(path: &std::path::Path) -> bool {
    let name = path.file_name().unwrap().to_string_lossy();
    name.contains("cut") || name.contains("past_end")
}

/// The damaged checkpoints kept as regressions (files cut short, a header that points past
/// the end) must be refused, not half-read.
#[test]
fn damaged_checkpoints_are_refused() {
    let damaged: Vec<_> = inputs("checkpoint")
        .into_iter()
        .filter(|(p, _)| is_cut(p))
        .collect();
    assert!(!damaged.is_empty());
    for (path, bytes) in damaged {
        assert!(
            lipsync::model::checkpoint::Checkpoint::from_bytes(Arc::from(bytes.as_slice()))
                .is_err(),
            "{} was accepted",
            path.display()
        );
    }
}
