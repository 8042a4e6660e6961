//! `lipsync bench` on the CPU with tiny sizes, as the GPU run's CPU rehearsal runs it: every
//! part prints its table with measured numbers and writes its JSON, `--sections` runs only the
//! parts named, and `bench/pytorch_reference.py` (the PyTorch yardstick) reads the same
//! `init-weights` file and computes the same faces.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use candle_core::{DType, Device, Tensor};
use common::{checkpoint, lipsync, text, torch_python};
use lipsync::model::{GeneratorWeights, Wav2Lip};

fn bench(args: &[&str], json: &Path) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_lipsync"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["bench", "--checkpoint"])
        .arg(checkpoint("zip_bare.pt"))
        .args(["--device", "cpu", "--seconds", "0.2"])
        .args(args)
        .arg("--json")
        .arg(json)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    o
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn bench_runs_every_section_and_writes_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let inputs = dir.path().join("accuracy-inputs.safetensors");
    let o = bench(
        &[
            "--batches",
            "1,2",
            "--instances",
            "1,2",
            "--instance-batch",
            "2",
            "--dtypes",
            "f32,bf16",
            "--encode-frames",
            "30",
            "--encoder-workers",
            "1,2",
            "--e2e",
            "0.5",
            "--accuracy-inputs",
            inputs.to_str().unwrap(),
        ],
        &json,
    );
    let out = text(&o.stdout);
    // Every section but the per-layer profile, which is CUDA's.
    assert!(
        !out.contains("## Layers"),
        "layers ran by default on the CPU:\n{out}"
    );
    for section in [
        "## Model only",
        "## Device memory in use",
        "## Instances",
        "## Accuracy",
        "## Autotune",
        "## Encoder only",
        "## End to end",
    ] {
        assert!(out.contains(section), "{section} missing:\n{out}");
    }
    // The service runs say their precision: serve's, not the first of --dtypes.
    assert!(
        out.contains("## Instances (2 frames in flight shared by the instances, f32 (serve's default on cpu)"),
        "{out}"
    );
    assert!(out.contains("## End to end (f32 (serve's default on cpu), 1 instance(s)"));
    // No invented memory figures on the CPU.
    assert!(out.contains("| f32 | cpu | n/a (cpu) | n/a (cpu) | n/a (cpu) | n/a (cpu) |"));

    let v = read_json(&json);
    assert_eq!(
        v["sections"],
        serde_json::json!([
            "model",
            "instances",
            "accuracy",
            "autotune",
            "encoder",
            "e2e"
        ])
    );
    assert_eq!(v["service_dtype"], "f32");
    // f32 and bf16 (computed in f32 on the CPU), at batches 1 and 2.
    let model = v["model"].as_array().unwrap();
    assert_eq!(model.len(), 4);
    assert!(model.iter().all(|r| r["fps"].as_f64().unwrap() > 0.0));
    assert!(model.iter().all(|r| r["peak_memory_bytes"].is_null()));
    assert_eq!(model[0]["path"], "cpu");
    assert_eq!(v["memory"]["note"], "n/a (cpu)");
    assert_eq!(v["memory"]["rows"].as_array().unwrap().len(), 2);

    // One instance at batch 2 against two at batch 1: the same frames in flight.
    let inst = v["instances"].as_array().unwrap();
    let shape: Vec<_> = inst
        .iter()
        .map(|r| {
            (
                r["instances"].as_u64(),
                r["batch"].as_u64(),
                r["frames_in_flight"].as_u64(),
            )
        })
        .collect();
    assert_eq!(
        shape,
        [(Some(1), Some(2), Some(2)), (Some(2), Some(1), Some(2))]
    );
    assert!(inst
        .iter()
        .all(|r| r["fps"].as_f64().unwrap() > 0.0 && r["dtype"] == "f32"));

    // The own CPU pass against candle's f32 operations on real faces: equal up to summation
    // order.
    let acc = v["accuracy"].as_array().unwrap();
    assert_eq!(acc.len(), 2, "{acc:?}");
    for row in acc {
        assert_eq!(row["path"], "cpu");
        assert_eq!(row["reference"], "candle's f32 operations on the CPU");
        assert!(row["max_diff"].as_f64().unwrap() < 1e-3, "{acc:?}");
        assert!(row["psnr_db"].as_f64().is_none_or(|p| p > 80.0), "{acc:?}");
    }
    // The inputs it compared on, for the PyTorch yardstick.
    let ck = lipsync::model::checkpoint::read(&inputs).unwrap();
    assert_eq!(ck.get("mel").unwrap().shape, [8, 1, 80, 16]);
    assert_eq!(ck.get("face").unwrap().shape, [8, 6, 96, 96]);

    // Two fresh processes, each loading and warming up one instance (nothing to search on
    // the CPU).
    let tune = v["autotune"].as_array().unwrap();
    assert_eq!(tune.len(), 2);
    assert_eq!(
        (tune[0]["run"].as_str(), tune[1]["run"].as_str()),
        (Some("cold"), Some("cached"))
    );
    assert!(tune
        .iter()
        .all(|r| r["seconds"].as_f64().unwrap() > 0.0 && r["searched"] == 0));

    let runs = v["encoder"]["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(
        (runs[0]["workers"].as_u64(), runs[1]["workers"].as_u64()),
        (Some(1), Some(2))
    );
    assert!(runs.iter().all(|r| r["fps"].as_f64().unwrap() > 0.0));
    let e2e = &v["end_to_end"][0];
    assert_eq!(e2e["model_frames"], 10); // 0.5 s: 41 mel columns, windows at i = 0..8, then the last 16
    assert_eq!(e2e["video_frames"], 13);
    assert_eq!(e2e["dtype"], "f32");
    assert!(e2e["ttfb_seconds"].as_f64().unwrap() <= e2e["seconds"].as_f64().unwrap());
}

#[test]
fn bench_sections_run_only_the_parts_named() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    // Given out of order and repeated: run once each, in the fixed order.
    let o = bench(
        &["--sections", "autotune,model,model", "--batches", "1"],
        &json,
    );
    let out = text(&o.stdout);
    let model_at = out.find("## Model only").expect("model table");
    let tune_at = out.find("## Autotune").expect("autotune table");
    assert!(model_at < tune_at, "{out}");
    for absent in [
        "## Instances",
        "## Accuracy",
        "## Encoder only",
        "## End to end",
    ] {
        assert!(!out.contains(absent), "{absent} ran:\n{out}");
    }
    let v = read_json(&json);
    assert_eq!(v["sections"], serde_json::json!(["model", "autotune"]));
    for absent in ["instances", "accuracy", "encoder", "end_to_end"] {
        assert!(v.get(absent).is_none(), "{absent} in {v}");
    }
    assert_eq!(v["model"].as_array().unwrap().len(), 1);

    // The per-layer profile is the own cuDNN path's: asked for on the CPU, it says why there
    // is no table instead of printing an empty one.
    let o = bench(&["--sections", "layers", "--batches", "1"], &json);
    let out = text(&o.stdout);
    assert!(out.contains("## Layers"), "{out}");
    assert!(
        out.contains("Only in CUDA builds") || out.contains("The own path is not in use"),
        "{out}"
    );
    assert!(!out.contains("| layer |"), "{out}");

    // A section that cannot run with the other flags is refused before anything runs.
    let o = Command::new(env!("CARGO_BIN_EXE_lipsync"))
        .args(["bench", "--checkpoint"])
        .arg(checkpoint("zip_bare.pt"))
        .args([
            "--device",
            "cpu",
            "--sections",
            "encoder",
            "--encode-frames",
            "0",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("--encode-frames"),
        "{}",
        text(&o.stderr)
    );
}

#[test]
fn pytorch_reference_reads_init_weights_and_draws_the_same_faces() {
    let Some(python) = torch_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let weights = dir.path().join("w.safetensors");
    let o = lipsync(&[&"init-weights", &weights, &"--seed", &"7"]);
    assert!(o.status.success(), "{}", text(&o.stderr));

    // lipsync's f32 faces on two deterministic frames.
    let (w, _) = GeneratorWeights::from_file(&weights).unwrap();
    let model = Wav2Lip::load(&w, &Device::Cpu, DType::F32).unwrap();
    let wave = |len: usize, scale: f32, shift: f32| -> Vec<f32> {
        (0..len)
            .map(|i| shift + scale * ((i as f32) * 0.37).sin() * ((i as f32) * 0.011).cos())
            .collect()
    };
    let mel = Tensor::from_vec(wave(2 * 80 * 16, 2.0, 0.0), (2, 1, 80, 16), &Device::Cpu).unwrap();
    let face = Tensor::from_vec(
        wave(2 * 6 * 96 * 96, 0.5, 0.5),
        (2, 6, 96, 96),
        &Device::Cpu,
    )
    .unwrap();
    let faces = model.forward(&mel, &face).unwrap();
    let file = dir.path().join("case.safetensors");
    let tensors = std::collections::HashMap::from([
        ("mel".to_string(), mel),
        ("face".to_string(), face),
        ("expected".to_string(), faces),
    ]);
    candle_core::safetensors::save(&tensors, &file).unwrap();

    // The script's own loader and model on the same file and inputs.
    let script = "import sys, torch\n\
        sys.path.insert(0, 'bench')\n\
        import pytorch_reference as p\n\
        m = p.Wav2Lip(); p.load_weights(m, sys.argv[1]); m.eval()\n\
        t = p.read_safetensors(sys.argv[2])\n\
        with torch.inference_mode():\n    out = m(t['mel'], t['face'])\n\
        print((out - t['expected']).abs().max().item())\n";
    let o = Command::new(&python)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["-c", script])
        .arg(&weights)
        .arg(&file)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let diff: f64 = text(&o.stdout).trim().parse().unwrap();
    assert!(diff < 1e-4, "PyTorch and lipsync differ by {diff}");

    // A folded checkpoint (no BatchNorm tensors) is refused, not run with defaults.
    let folded = dir.path().join("folded.safetensors");
    let o = lipsync(&[&"convert", &weights, &folded, &"--fold-bn"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = Command::new(&python)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "bench/pytorch_reference.py",
            "--device",
            "cpu",
            "--checkpoint",
        ])
        .arg(&folded)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("BatchNorm folded"),
        "{}",
        text(&o.stderr)
    );
}

#[test]
fn pytorch_reference_runs_on_the_cpu_with_tiny_sizes() {
    let Some(python) = torch_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("torch.json");
    let o = Command::new(&python)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["bench/pytorch_reference.py", "--checkpoint"])
        .arg(checkpoint("zip_bare.pt"))
        .args(["--device", "cpu", "--batches", "1", "--dtypes", "f32,bf16"])
        .args(["--layouts", "nchw,channels_last", "--seconds", "0.1"])
        .args(["--accuracy-frames", "2", "--threads", "1", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(
        out.contains("| dtype | layout | mode | batch | frames/s |"),
        "{out}"
    );
    assert!(
        out.contains("| bf16 | channels_last | eager | 1 |"),
        "{out}"
    );
    let v = read_json(&json);
    assert_eq!(v["tf32"], false);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    assert!(rows.iter().all(|r| r["fps"].as_f64().unwrap() > 0.0));
    // bf16 against PyTorch's own f32: close, not equal; f32 channels-last: equal up to
    // summation order.
    let acc = v["accuracy"].as_array().unwrap();
    assert_eq!(acc.len(), 3);
    let psnr = |dtype: &str, layout: &str| {
        acc.iter()
            .find(|r| r["dtype"] == dtype && r["layout"] == layout)
            .and_then(|r| r["psnr_db"].as_f64())
            .unwrap_or(f64::INFINITY)
    };
    assert!(psnr("f32", "channels_last") > 80.0, "{acc:?}");
    let bf16 = psnr("bf16", "nchw");
    assert!(bf16 > 20.0 && bf16 < 80.0, "{acc:?}");
}

#[test]
fn bench_media_measures_the_service_on_echo_against_its_encoders_floor() {
    // No checkpoint: the section runs `lipsync serve --device echo` as its child.
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("media.json");
    let o = Command::new(env!("CARGO_BIN_EXE_lipsync"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["bench", "--device", "echo", "--sections", "media"])
        .args(["--media-seconds", "2", "--media-repeats", "1"])
        .args(["--live-sessions", "1", "--live-seconds", "4", "--json"])
        .arg(&json)
        .env_remove("LIPSYNC_CHECKPOINT")
        .output()
        .unwrap();
    let out = text(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", text(&o.stderr));
    for line in [
        "## Media side on the echo device (2 s of speech, 50 frames at 25 fps",
        "| photo 512x512 |",
        "| photo 1280x720 |",
        "| clip 1280x720 |",
        "### One core against two",
        "### Live sessions",
        "| photo 512x512 | fmp4 | 1 |",
        "| photo 512x512 | jpeg | 1 |",
        "| clip 1280x720 | fmp4 | 1 |",
        "| clip 1280x720 | jpeg | 1 |",
        "Largest number of sessions that holds",
    ] {
        assert!(out.contains(line), "{line} missing:\n{out}");
    }

    let v = read_json(&json);
    assert_eq!(v["sections"], serde_json::json!(["media"]));
    let m = &v["media"];
    let rows = m["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "{m}");
    for r in rows {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        // A playable MP4 (H.264 + AAC, 2 s × 25 frames), first byte before the last.
        assert_eq!(r["playable"], true, "{r}");
        assert_eq!(r["frames"], 50);
        assert!(
            f("wall_s") > 0.0 && f("ttfb_s") > 0.0 && f("ttfb_s") <= f("wall_s"),
            "{r}"
        );
        // The tree's CPU and the floor's (one ffmpeg), and their ratio: the service does at
        // least most of the floor's work, and not absurdly more.
        assert!(f("tree_cpu_s") > 0.0 && f("floor_cpu_s") > 0.0, "{r}");
        let ratio = f("ratio");
        assert!(
            (ratio - f("tree_cpu_s") / f("floor_cpu_s")).abs() < 1e-9,
            "{r}"
        );
        assert!(ratio > 0.5 && ratio < 50.0, "{r}");
    }
    // 720p costs the encoder more than 512².
    assert!(
        rows[1]["floor_cpu_s"].as_f64() > rows[0]["floor_cpu_s"].as_f64(),
        "{m}"
    );

    // One core against two, where there are two.
    let cores = m["cores"].as_array().unwrap();
    assert!(!cores.is_empty(), "{m}");
    assert_eq!(cores[0]["cpus"], "0");
    assert!(cores.iter().all(|c| c["wall_s"].as_f64().unwrap() > 0.0));

    // One live level per avatar and output, measured from the client and the server's
    // process tree.
    let levels = m["live"]["levels"].as_array().unwrap();
    let outputs: Vec<_> = levels
        .iter()
        .map(|l| (l["avatar"].as_str().unwrap(), l["output"].as_str().unwrap()))
        .collect();
    assert_eq!(
        outputs,
        [
            ("photo 512x512", "fmp4"),
            ("photo 512x512", "jpeg"),
            ("clip 1280x720", "fmp4"),
            ("clip 1280x720", "jpeg")
        ]
    );
    for l in levels {
        assert_eq!(l["sessions"], 1);
        assert!(l["frames_received"].as_u64().unwrap() > 50, "{l}");
        let p50 = l["latency_ms"]["p50"].as_f64().unwrap();
        assert!(p50 > 0.0 && p50 < 10_000.0, "{l}");
        assert!(l["cpu_ms_per_frame"].as_f64().unwrap() > 0.0, "{l}");
        assert!(l["sessions_stats"][0]["held_frames"].is_u64(), "{l}");
    }
    // The fMP4 sessions' encoders were seen.
    for l in [&levels[0], &levels[2]] {
        assert!(l["encoders_pss_mb"].as_f64().unwrap() > 0.0, "{l}");
    }
    for avatar in ["photo 512x512", "clip 1280x720"] {
        assert!(
            m["live"]["largest_holding"][avatar].get("fmp4").is_some(),
            "{m}"
        );
    }
    // What x264 alone allows per avatar, from the floors: fewer sessions of the larger clip.
    let bound = |a: &str| {
        m["live"]["x264_floor_sessions"][a]["sessions"]
            .as_f64()
            .unwrap()
    };
    assert!(
        bound("clip 1280x720") > 0.0 && bound("clip 1280x720") < bound("photo 512x512"),
        "{m}"
    );
}
