//! Inputs the fuzzers (fuzz/) once found problems with: each must now give a result or a
//! typed error, without panicking.

use std::path::PathBuf;
use std::sync::Arc;

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions")
        .join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    entries
        .map(|e| e.unwrap().path())
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect()
}

#[test]
fn audio_regressions_give_errors_not_panics() {
    let found = inputs("audio");
    assert!(!found.is_empty());
    for (path, bytes) in found {
        if let Ok(speech) = lipsync::media::audio::load(&bytes, 30.0) {
            let _ = speech.mel();
        } else {
            eprintln!("{}: rejected", path.display());
        }
    }
}

#[test]
fn checkpoint_regressions_give_errors_not_panics() {
    for (_, bytes) in inputs("checkpoint") {
        let _ = lipsync::model::checkpoint::Checkpoint::from_bytes(Arc::from(bytes.as_slice()));
    }
}
