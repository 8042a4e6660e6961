//! The checkpoint reader against files written by PyTorch (tests/reference/).

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{checkpoint, expected_tensors, fixture, sha256_f32, CHECKPOINT_FORMS};
use lipsync::model::checkpoint::{Checkpoint, Format};
use lipsync::model::{Error, GeneratorWeights};

#[test]
fn every_published_form_loads_to_the_source_state_dict() {
    let expected = expected_tensors();
    assert_eq!(expected.len(), 302);
    for &(file, format, prefixed) in CHECKPOINT_FORMS {
        let (w, s) = GeneratorWeights::from_file(&checkpoint(file))
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(s.format.as_str(), format, "{file}");
        assert_eq!(s.module_prefix, prefixed, "{file}");
        assert!(!s.folded);
        assert_eq!(s.tensors, 302);
        assert_eq!(s.parameters, 36_298_035);
        assert_eq!(s.dtype, "f32");
        for (key, shape, sha) in &expected {
            let t = w.get(key).unwrap();
            assert_eq!(t.dims(), shape.as_slice(), "{file}: {key}");
            assert_eq!(&sha256_f32(t), sha, "{file}: {key} differs from the source");
        }
    }
}

#[test]
fn fixtures_exercise_non_contiguous_storage_views() {
    let text = std::fs::read_to_string(checkpoint("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(v["non_contiguous"].as_u64().unwrap() > 100);
    let ck = lipsync::model::checkpoint::read(&checkpoint("legacy_plain.pth")).unwrap();
    assert!(
        ck.tensors
            .iter()
            .filter(|(_, t)| !t.is_contiguous())
            .count()
            > 100
    );
}

#[test]
fn float_storages_of_every_dtype_and_layout_read_exactly() {
    let text = std::fs::read_to_string(fixture("dtypes/expected.json")).unwrap();
    let expected: HashMap<String, serde_json::Value> = serde_json::from_str(&text).unwrap();
    for (file, format) in [
        ("dtypes/dtypes_legacy.pth", Format::LegacyTorchSave),
        ("dtypes/dtypes_zip.pt", Format::ZipTorchSave),
        ("dtypes/dtypes.safetensors", Format::Safetensors),
    ] {
        let ck = lipsync::model::checkpoint::read(&fixture(file)).unwrap();
        assert_eq!(ck.format, format);
        assert_eq!(ck.tensors.len(), expected.len(), "{file}");
        for (key, want) in &expected {
            let t = ck.get(key).unwrap_or_else(|| panic!("{file}: {key}"));
            let shape: Vec<usize> = want["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(t.shape, shape, "{file}: {key}");
            let got = t
                .to_tensor()
                .unwrap()
                .to_dtype(candle_core::DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            let want: Vec<f64> = want["values"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            assert_eq!(got, want, "{file}: {key}");
        }
    }
}

fn read_bytes(bytes: &[u8]) -> Result<Checkpoint, Error> {
    Checkpoint::from_bytes(Arc::from(bytes))
}

#[test]
fn truncated_files_are_reported_as_truncated() {
    let mut files: Vec<_> = CHECKPOINT_FORMS.iter().map(|f| checkpoint(f.0)).collect();
    files.push(fixture("dtypes/dtypes.safetensors"));
    for path in files {
        let full = std::fs::read(&path).unwrap();
        for frac in [0.001, 0.1, 0.5, 0.9, 0.999] {
            let cut = ((full.len() as f64 * frac) as usize).max(16);
            let e = read_bytes(&full[..cut])
                .err()
                .unwrap_or_else(|| panic!("{} cut at {cut} read fine", path.display()));
            assert!(
                matches!(e, Error::Truncated { .. }),
                "{} cut at {cut}: {e}",
                path.display()
            );
            assert!(e.to_string().contains("truncated"));
        }
    }
}

#[test]
fn truncated_tensor_data_reports_the_expected_size() {
    for file in ["legacy_plain.pth", "legacy_module_prefix.pth"] {
        let full = std::fs::read(checkpoint(file)).unwrap();
        let e = read_bytes(&full[..full.len() - 1000]).unwrap_err();
        match e {
            Error::Truncated { size, expected, .. } => {
                assert_eq!(size as usize, full.len() - 1000);
                assert_eq!(expected, Some(full.len() as u64));
            }
            e => panic!("{e}"),
        }
        assert!(read_bytes(&full[..full.len() - 1000])
            .unwrap_err()
            .to_string()
            .contains(&full.len().to_string()));
    }
    let full = std::fs::read(fixture("dtypes/dtypes.safetensors")).unwrap();
    match read_bytes(&full[..full.len() - 3]).unwrap_err() {
        Error::Truncated { expected, .. } => assert_eq!(expected, Some(full.len() as u64)),
        e => panic!("{e}"),
    }
}

#[test]
fn files_that_are_not_checkpoints_say_so() {
    for bytes in [
        &b""[..],
        b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR",
        b"RIFF\x24\0\0\0WAVEfmt ",
        b"{\"state_dict\": {}}",
    ] {
        let e = read_bytes(bytes).unwrap_err();
        assert!(matches!(e, Error::NotACheckpoint(_)), "{e}");
    }
    // A pickle of a plain dict (no tensors) in a zip archive with a data.pkl.
    let mut buf = std::io::Cursor::new(Vec::new());
    {
        let mut z = zip::ZipWriter::new(&mut buf);
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        z.start_file("archive/data.pkl", opts).unwrap();
        use std::io::Write;
        z.write_all(b"\x80\x02}q\x00X\x01\x00\x00\x00aK\x01s.")
            .unwrap();
        z.finish().unwrap();
    }
    let e = read_bytes(buf.get_ref()).unwrap_err();
    assert!(matches!(e, Error::NotACheckpoint(_)), "{e}");
    assert!(e.to_string().contains("top-level keys: a"), "{e}");
}

fn weights_from(tensors: Vec<(String, candle_core::Tensor)>) -> Result<GeneratorWeights, Error> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    lipsync::model::checkpoint::write_safetensors(&path, &tensors, &Default::default()).unwrap();
    GeneratorWeights::from_file(&path).map(|(w, _)| w)
}

fn source_tensors() -> Vec<(String, candle_core::Tensor)> {
    let (w, _) = GeneratorWeights::from_file(&checkpoint("zip_bare.pt")).unwrap();
    expected_tensors()
        .into_iter()
        .map(|(k, _, _)| {
            let t = w.get(&k).unwrap().clone();
            (k, t)
        })
        .collect()
}

#[test]
fn a_missing_tensor_is_named() {
    let mut t = source_tensors();
    t.retain(|(k, _)| k != "audio_encoder.9.conv_block.1.running_var");
    match weights_from(t).unwrap_err() {
        Error::MissingKey { key } => assert_eq!(key, "audio_encoder.9.conv_block.1.running_var"),
        e => panic!("{e}"),
    }
}

#[test]
fn a_wrong_shape_names_key_expected_and_found() {
    let mut t = source_tensors();
    for (k, v) in t.iter_mut() {
        if k == "face_decoder_blocks.3.0.conv_block.0.weight" {
            *v = v.transpose(0, 1).unwrap().contiguous().unwrap();
        }
    }
    let e = weights_from(t).unwrap_err();
    match &e {
        Error::WrongShape {
            key,
            expected,
            found,
        } => {
            assert_eq!(key, "face_decoder_blocks.3.0.conv_block.0.weight");
            assert_eq!(expected, &vec![768, 384, 3, 3]);
            assert_eq!(found, &vec![384, 768, 3, 3]);
        }
        e => panic!("{e}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains("[768, 384, 3, 3]") && msg.contains("[384, 768, 3, 3]"),
        "{msg}"
    );
}

#[test]
fn tensors_of_another_model_are_refused() {
    let mut t = source_tensors();
    let extra = t[0].1.clone();
    t.push(("face_encoder_blocks.7.0.conv_block.0.weight".into(), extra));
    let e = weights_from(t).unwrap_err();
    assert!(matches!(e, Error::UnexpectedKeys(_)), "{e}");
    assert!(e.to_string().contains("face_encoder_blocks.7.0"), "{e}");
}

#[test]
fn non_finite_weights_are_refused() {
    let mut t = source_tensors();
    for (k, v) in t.iter_mut() {
        if k == "output_block.1.bias" {
            *v = candle_core::Tensor::new(&[0f32, f32::NAN, 0.0], &candle_core::Device::Cpu)
                .unwrap();
        }
    }
    assert!(matches!(
        weights_from(t).unwrap_err(),
        Error::NonFinite { .. }
    ));
}

/// Deterministic mutation sweep over the fixtures (the fuzz target in fuzz/ goes further):
/// byte flips, truncations and insertions must give errors or checkpoints, never panics.
#[test]
fn mutated_files_never_panic() {
    let mut state = 0x5eed_u64;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut files: Vec<_> = CHECKPOINT_FORMS.iter().map(|f| checkpoint(f.0)).collect();
    for f in ["dtypes_legacy.pth", "dtypes_zip.pt", "dtypes.safetensors"] {
        files.push(fixture(&format!("dtypes/{f}")));
    }
    let mut outcomes = [0usize; 2];
    for path in files {
        let orig = std::fs::read(&path).unwrap();
        for round in 0..150 {
            let mut b = orig.clone();
            // Mutations cluster in the first 4 KiB, where the headers and pickles are.
            let hot = b.len().min(4096);
            for _ in 0..1 + next() % 4 {
                let at = if next() % 4 == 0 {
                    next() as usize % b.len()
                } else {
                    next() as usize % hot
                };
                match next() % 4 {
                    0 => b[at] ^= 1 << (next() % 8),
                    1 => b[at] = next() as u8,
                    2 => b.insert(at, next() as u8),
                    _ => b[at] = [0x00, 0xff, 0x7f, 0x80][next() as usize % 4],
                }
            }
            if round % 10 == 0 {
                b.truncate(next() as usize % b.len());
            }
            match read_bytes(&b) {
                Ok(ck) => {
                    outcomes[0] += 1;
                    for (_, t) in ck.tensors.iter().take(4) {
                        let _ = t.to_tensor();
                    }
                    if round % 25 == 0 {
                        let _ = GeneratorWeights::from_checkpoint(&ck);
                    }
                }
                Err(_) => outcomes[1] += 1,
            }
        }
    }
    // Both outcomes occur: mutations in tensor data still read, header damage does not.
    assert!(outcomes[0] > 0 && outcomes[1] > 0, "{outcomes:?}");
}
