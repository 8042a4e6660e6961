//! The enhancers (Real-ESRGAN, GFPGAN) against the upstream PyTorch networks
//! (tests/reference/esrgan_reference.py, gfpgan_reference.py): random checkpoints in each
//! published layout, made at test time, run through `lipsync enhance` as a user runs it; and
//! the files it must refuse.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::server::Server;
use common::{
    compact_tensors, lipsync, media, text, tiny_enhancer, torch_python, write_checkpoint,
};

/// An RGB crop of the astronaut photo: (name, x, y, width, height).
const CROPS: [(&str, u32, u32, u32, u32); 3] = [
    // The face, at the generator's 96×96.
    ("face", 180, 60, 96, 96),
    // Odd sides, not square.
    ("odd", 150, 120, 37, 29),
    // Smaller, even: the ×4 RRDBNet's 330 GFLOP at 96×96 would make the test slow.
    ("small", 196, 92, 48, 40),
];

/// Which crops each published file runs on.
const RUNS: [(&str, &[&str]); 4] = [
    ("realesr-general-x4v3", &["face", "odd"]),
    ("realesr-animevideov3", &["face"]),
    ("RealESRGAN_x4plus", &["small"]),
    ("RealESRGAN_x2plus", &["face"]),
];

/// The crops as PNG (for `lipsync enhance`) and raw RGB (for the reference).
fn write_crops(dir: &Path) -> Vec<(String, u32, u32)> {
    let photo = image::load_from_memory(&media("astronaut.png"))
        .unwrap()
        .to_rgb8();
    CROPS
        .iter()
        .map(|&(name, x, y, w, h)| {
            let crop = image::imageops::crop_imm(&photo, x, y, w, h).to_image();
            crop.save(dir.join(format!("{name}.png"))).unwrap();
            std::fs::write(dir.join(format!("{name}.rgb")), crop.as_raw()).unwrap();
            (name.to_string(), w, h)
        })
        .collect()
}

/// The reference's checkpoints and outputs in `dir`, for `runs`.
fn reference(python: &str, dir: &Path, crops: &[(String, u32, u32)], runs: &[(&str, &[&str])]) {
    let upstream = upstream(python);
    let mut cmd = reference_command(python, "esrgan_reference.py", &upstream, dir);
    for (name, w, h) in crops {
        cmd.arg("--input").arg(format!(
            "{name}={w}x{h}:{}",
            dir.join(format!("{name}.rgb")).display()
        ));
    }
    cmd.arg("--only");
    for (stem, inputs) in runs {
        cmd.arg(format!("{stem}:{}", inputs.join(",")));
    }
    run_reference(cmd, &upstream);
}

/// The upstream Real-ESRGAN files: `LIPSYNC_ESRGAN_UPSTREAM`, or where scripts/torch-venv.sh
/// puts them beside `python`'s venv.
fn upstream(python: &str) -> PathBuf {
    let venv = Path::new(python).parent().and_then(Path::parent).unwrap();
    std::env::var_os("LIPSYNC_ESRGAN_UPSTREAM")
        .map(PathBuf::from)
        .unwrap_or_else(|| venv.join("upstream"))
}

/// `python tests/reference/<script> --upstream <upstream> --out <out>`, for more arguments.
fn reference_command(python: &str, script: &str, upstream: &Path, out: &Path) -> Command {
    let mut cmd = Command::new(python);
    cmd.arg(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/reference")
            .join(script),
    )
    .arg("--upstream")
    .arg(upstream)
    .arg("--out")
    .arg(out);
    cmd
}

fn run_reference(mut cmd: Command, upstream: &Path) {
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "the reference failed (is {} there? scripts/torch-venv.sh fetches it):\n{}",
        upstream.display(),
        text(&o.stderr)
    );
    eprint!("{}", text(&o.stderr));
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn every_published_layout_matches_the_upstream_network() {
    let Some(python) = torch_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let crops = write_crops(dir.path());
    reference(&python, dir.path(), &crops, &RUNS);
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("expected.json")).unwrap())
            .unwrap();
    for (stem, inputs) in RUNS {
        let ck = dir.path().join(format!("{stem}.pth"));
        for input in inputs {
            let out = dir.path().join(format!("{stem}.{input}.png"));
            let o = lipsync(&[
                &"enhance",
                &"--enhancer-checkpoint",
                &ck,
                &"--image",
                &dir.path().join(format!("{input}.png")),
                &"--out",
                &out,
                &"--json",
            ]);
            assert!(o.status.success(), "{stem} on {input}: {}", text(&o.stderr));
            let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(summary["enhancer"], stem);
            assert_eq!(summary["kind"], "esrgan");
            let got = image::open(&out).unwrap().to_rgb8();
            let shape = &expected[stem][input]["shape"];
            let (c, h, w) = (
                shape[0].as_u64().unwrap() as usize,
                shape[1].as_u64().unwrap() as usize,
                shape[2].as_u64().unwrap() as usize,
            );
            assert_eq!(c, 3);
            assert_eq!(
                (got.width() as usize, got.height() as usize),
                (w, h),
                "{stem} on {input}"
            );
            let want = read_f32(&dir.path().join(format!("{stem}.{input}.f32")));
            assert_eq!(want.len(), 3 * w * h);
            // Max |Δ| in 8-bit levels against the reference's f32 (before its rounding).
            let mut worst = 0f32;
            for (i, px) in got.pixels().enumerate() {
                for ch in 0..3 {
                    let d = (f32::from(px[ch]) - want[ch * w * h + i] * 255.0).abs();
                    worst = worst.max(d);
                }
            }
            let clamped = expected[stem][input]["clamped_fraction"].as_f64().unwrap();
            eprintln!(
                "{stem} on {input}: max |Δ| {worst:.3} of 255, {:.1}% clamped",
                clamped * 100.0
            );
            assert!(
                worst <= 2.0,
                "{stem} on {input}: max |Δ| {worst} levels (goal ≤ 2)"
            );
            // The comparison sees the network, not the clamp.
            assert!(
                clamped < 0.25,
                "{stem} on {input}: {clamped} of the output clamped"
            );
        }
    }
}

fn enhance(ck: &Path, image: &Path, out: &Path) -> std::process::Output {
    lipsync(&[
        &"enhance",
        &"--enhancer-checkpoint",
        &ck,
        &"--image",
        &image,
        &"--out",
        &out,
    ])
}

#[test]
fn a_compact_network_with_zero_weights_gives_the_nearest_upsampled_image() {
    // Every convolution zero: the network adds nothing to its nearest-neighbour base, so the
    // output is exactly the input, each pixel repeated s × s.
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("tiny-x2.safetensors");
    tiny_enhancer(&ck, 0.0);
    let crops = write_crops(dir.path());
    let (name, w, h) = &crops[1]; // odd sides
    let out = dir.path().join("out.png");
    let o = enhance(&ck, &dir.path().join(format!("{name}.png")), &out);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let input = image::open(dir.path().join(format!("{name}.png")))
        .unwrap()
        .to_rgb8();
    let got = image::open(&out).unwrap().to_rgb8();
    assert_eq!((got.width(), got.height()), (w * 2, h * 2));
    for (x, y, px) in got.enumerate_pixels() {
        assert_eq!(px, input.get_pixel(x / 2, y / 2), "pixel ({x}, {y})");
    }
}

#[test]
fn files_that_are_not_a_complete_enhancer_are_refused_with_exit_2_and_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let crops = write_crops(dir.path());
    let image = dir.path().join(format!("{}.png", crops[1].0));
    let out = dir.path().join("out.png");
    let refused = |ck: &Path, needle: &str| {
        let o = enhance(ck, &image, &out);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{}: {err}", ck.display());
        assert!(
            err.contains(needle),
            "{}: {err:?} lacks {needle:?}",
            ck.display()
        );
        assert!(!err.contains("panicked"), "{err}");
        assert!(!out.exists(), "nothing is written for a refused file");
    };
    let small = |_: &str, i: usize| 0.01 * ((i % 7) as f32 - 3.0);
    let good = compact_tensors(4, 2, 2);
    let path = |name: &str| dir.path().join(name);

    refused(&path("absent.pth"), "cannot read");
    // Not an enhancer: the Wav2Lip test checkpoint.
    refused(
        &common::checkpoint("zip_bare.pt"),
        "no enhancer is recognised",
    );
    // A tensor missing, one of the wrong shape, one too many.
    let mut missing = good.clone();
    missing.retain(|(k, _)| k != "body.2.bias");
    write_checkpoint(&path("missing.safetensors"), &missing, &small);
    refused(
        &path("missing.safetensors"),
        "not a complete SRVGGNetCompact checkpoint: the tensor body.2.bias is missing",
    );
    let mut wrong = good.clone();
    wrong[3].1 = vec![4, 4, 1, 1];
    write_checkpoint(&path("wrong.safetensors"), &wrong, &small);
    refused(
        &path("wrong.safetensors"),
        "body.2.weight has shape [4, 4, 1, 1], not [4, 4, 3, 3]",
    );
    let mut extra = good.clone();
    extra.push(("head.weight".into(), vec![2]));
    write_checkpoint(&path("extra.safetensors"), &extra, &small);
    refused(
        &path("extra.safetensors"),
        "a tensor it does not use: head.weight",
    );
    // Cut short, like a partial download.
    write_checkpoint(&path("whole.safetensors"), &good, &small);
    let bytes = std::fs::read(path("whole.safetensors")).unwrap();
    std::fs::write(path("cut.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    refused(&path("cut.safetensors"), "truncated");
    // An RRDBNet x2 takes only even sides; the image is 37x29.
    let (f, g) = (4, 2);
    let mut rrdb = vec![
        ("conv_first.weight".to_string(), vec![f, 12, 3, 3]),
        ("conv_first.bias".into(), vec![f]),
    ];
    for r in 1..=3 {
        for c in 1..=5 {
            let (i, o) = (f + (c - 1) * g, if c == 5 { f } else { g });
            rrdb.push((format!("body.0.rdb{r}.conv{c}.weight"), vec![o, i, 3, 3]));
            rrdb.push((format!("body.0.rdb{r}.conv{c}.bias"), vec![o]));
        }
    }
    for name in ["conv_body", "conv_up1", "conv_up2", "conv_hr"] {
        rrdb.push((format!("{name}.weight"), vec![f, f, 3, 3]));
        rrdb.push((format!("{name}.bias"), vec![f]));
    }
    rrdb.push(("conv_last.weight".into(), vec![3, f, 3, 3]));
    rrdb.push(("conv_last.bias".into(), vec![3]));
    write_checkpoint(&path("rrdb-x2.safetensors"), &rrdb, &small);
    refused(&path("rrdb-x2.safetensors"), "multiples of 2, not 37x29");
    // The same file on an even image works.
    let o = enhance(&path("rrdb-x2.safetensors"), &path("face.png"), &out);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(image::image_dimensions(&out).unwrap(), (192, 192));
}

/// Runs `lipsync` with `args`, killed after `limit` (a server that should have refused to
/// start must not hang the test).
fn lipsync_bounded(
    args: &[&dyn AsRef<std::ffi::OsStr>],
    limit: std::time::Duration,
) -> std::process::Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lipsync"))
        .args(args.iter().map(|a| a.as_ref()))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let until = std::time::Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > until {
            let _ = child.kill();
            panic!(
                "lipsync {:?} still running after {limit:?}",
                args.iter().map(|a| a.as_ref()).collect::<Vec<_>>()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// `lipsync render` on the echo device with one second of speech on the astronaut photo,
/// writing `out`, then `extra`.
fn echo_render(out: &Path, extra: &[std::ffi::OsString]) -> std::process::Output {
    let mut args: Vec<std::ffi::OsString> = vec!["render".into(), "--device".into(), "echo".into()];
    args.extend([
        "--audio".into(),
        common::media_path("arctic_a0007_1s.wav").into(),
    ]);
    args.extend(["--image".into(), common::media_path("astronaut.png").into()]);
    args.extend(["--out".into(), out.as_os_str().to_owned()]);
    args.extend(extra.iter().cloned());
    let refs: Vec<&dyn AsRef<std::ffi::OsStr>> = args.iter().map(|a| a as _).collect();
    lipsync_bounded(&refs, std::time::Duration::from_secs(300))
}

#[test]
fn serve_and_render_stop_at_start_up_on_a_bad_enhancer_file() {
    let dir = tempfile::tempdir().unwrap();
    let absent = dir.path().join("absent.pth");
    let limit = std::time::Duration::from_secs(60);
    let data = dir.path().join("data");
    // `serve` on the echo device with these enhancer files: it must stop before listening.
    let serve = |files: &[&Path]| {
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![
            &"serve",
            &"--device",
            &"echo",
            &"--port",
            &"0",
            &"--data-dir",
            &data,
        ];
        for f in files {
            args.push(&"--enhancer-checkpoint");
            args.push(f);
        }
        lipsync_bounded(&args, limit)
    };
    let o = serve(&[&absent]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("absent.pth"), "{err}");
    // Two files with one name: requests could not tell them apart.
    std::fs::create_dir(dir.path().join("a")).unwrap();
    std::fs::create_dir(dir.path().join("b")).unwrap();
    tiny_enhancer(&dir.path().join("a/same.safetensors"), 0.0);
    tiny_enhancer(&dir.path().join("b/same.safetensors"), 0.0);
    let o = serve(&[
        &dir.path().join("a/same.safetensors"),
        &dir.path().join("b/same.safetensors"),
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("two enhancers named \"same\""), "{err}");
    // Not an enhancer (the Wav2Lip test checkpoint), on render.
    let o = echo_render(
        &dir.path().join("x.mp4"),
        &[
            "--enhancer-checkpoint".into(),
            common::checkpoint("zip_bare.pt").into(),
        ],
    );
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("no enhancer is recognised"), "{err}");
    // A render asking for an enhancer that is not loaded stops before it starts.
    let o = echo_render(
        &dir.path().join("y.mp4"),
        &["--enhance".into(), "esrgan".into()],
    );
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("no esrgan enhancer is loaded"), "{err}");
    assert!(!dir.path().join("y.mp4").exists());
}

/// The images `render --faces-dir` or `--frames-dir` kept, as RGB in frame order.
fn images(dir: &Path) -> Vec<image::RgbImage> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    names
        .iter()
        .map(|p| image::open(p).unwrap().to_rgb8())
        .collect()
}

#[test]
fn render_enhances_every_predicted_face_before_it_is_pasted() {
    // On the echo device (its faces are the reference crop with the mouth moved), once plain
    // and once with a x2 enhancer that repeats each pixel 2 x 2 and raises red by 0.2: each
    // kept face must be the plain one so transformed (within a level: the plain face is
    // truncated to 8 bits, the enhanced one rounded), in RGB order.
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("tiny-x2.safetensors");
    tiny_enhancer(&ck, 0.2);
    let run = |name: &str, extra: &[&str]| {
        let faces_dir = dir.path().join(name);
        let out = dir.path().join(format!("{name}.mp4"));
        let mut more: Vec<std::ffi::OsString> =
            vec!["--faces-dir".into(), faces_dir.clone().into()];
        more.extend(extra.iter().map(Into::into));
        let o = echo_render(&out, &more);
        assert!(o.status.success(), "{name}: {}", text(&o.stderr));
        assert_eq!(
            common::probe(&out)["streams"].as_array().unwrap().len(),
            2,
            "{name}"
        );
        images(&faces_dir)
    };
    let plain = run("plain", &[]);
    let ck_arg = ck.display().to_string();
    let enhanced = run(
        "enhanced",
        &["--enhancer-checkpoint", &ck_arg, "--enhance", "tiny-x2"],
    );
    assert_eq!(plain.len(), enhanced.len());
    assert!(!plain.is_empty());
    for (k, (p, e)) in plain.iter().zip(&enhanced).enumerate() {
        assert_eq!(p.dimensions(), (96, 96));
        assert_eq!(e.dimensions(), (192, 192), "face {k}");
        for (x, y, px) in e.enumerate_pixels() {
            let src = p.get_pixel(x / 2, y / 2);
            let want = [
                (f32::from(src[0]) + 0.2 * 255.0).min(255.0),
                f32::from(src[1]),
                f32::from(src[2]),
            ];
            for c in 0..3 {
                let d = (f32::from(px[c]) - want[c]).abs();
                assert!(
                    d <= 1.5,
                    "face {k} ({x}, {y}) channel {c}: {} vs {}",
                    px[c],
                    want[c]
                );
            }
        }
    }
}

#[test]
fn every_enhanced_frame_matches_the_pytorch_opencv_reference() {
    // The whole frame: `render --device echo --box B --enhance` on the astronaut photo with a
    // random realesr-animevideov3 checkpoint, each composited frame (`--frames-dir`) against
    // tests/reference/enhanced_frame_reference.py, which does the same steps with cv2.resize,
    // the upstream network and the feathered blend. The 96x96 crop itself may differ from
    // cv2.resize by a level in under 1 % of values (tests/image.rs), hence 2 levels here
    // (measured: 0 on every frame).
    let Some(python) = torch_python() else {
        return;
    };
    const BOX: &str = "180,90,270,187";
    const MODEL: &str = "realesr-animevideov3";
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("reference");
    // The reference makes the checkpoint and more frames than one second of speech needs.
    const REFERENCE_FRAMES: usize = 30;
    let photo = common::media_path("astronaut.png");
    let upstream = upstream(&python);
    let mut cmd = reference_command(
        &python,
        "enhanced_frame_reference.py",
        &upstream,
        &reference,
    );
    cmd.arg("--photo")
        .arg(&photo)
        .args(["--box", BOX, "--model", MODEL, "--frames"])
        .arg(REFERENCE_FRAMES.to_string());
    run_reference(cmd, &upstream);
    let ours = dir.path().join("frames");
    let o = echo_render(
        &dir.path().join("out.mp4"),
        &[
            "--box".into(),
            BOX.into(),
            "--enhancer-checkpoint".into(),
            reference.join(format!("{MODEL}.pth")).into(),
            "--enhance".into(),
            MODEL.into(),
            "--frames-dir".into(),
            ours.clone().into(),
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let ours = images(&ours);
    // One second of speech at 25 fps: the original's mel windows give 22 model frames.
    assert!(
        (20..=REFERENCE_FRAMES).contains(&ours.len()),
        "{} frames",
        ours.len()
    );
    let theirs = images(&reference.join("frames"));
    let photo = image::open(&photo).unwrap().to_rgb8();
    let mut worst = 0u8;
    for (k, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(a.dimensions(), photo.dimensions(), "frame {k}");
        let d = a
            .as_raw()
            .iter()
            .zip(b.as_raw())
            .map(|(x, y)| x.abs_diff(*y))
            .max()
            .unwrap();
        worst = worst.max(d);
        // The enhanced mouth is there: the frame is not the photo.
        let changed = a
            .as_raw()
            .iter()
            .zip(photo.as_raw())
            .filter(|(x, y)| x != y)
            .count();
        assert!(changed > 1000, "frame {k}: only {changed} values changed");
    }
    eprintln!(
        "{} whole enhanced frames: max difference from the PyTorch + OpenCV reference {worst}/255",
        ours.len()
    );
    assert!(worst <= 2, "frames differ by {worst}/255");
}

/// `POST /v1/jobs` with `form`, then the job's video once it has succeeded (within 120 s).
async fn job_video(s: &Server, form: reqwest::multipart::Form) -> bytes::Bytes {
    let r = reqwest::Client::new()
        .post(s.url("/v1/jobs"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let id = r.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let job = loop {
        let j: serde_json::Value = reqwest::get(s.url(&format!("/v1/jobs/{id}")))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if j["status"] == "succeeded" {
            break j;
        }
        assert!(
            j["status"] != "failed" && std::time::Instant::now() < deadline,
            "{j}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    reqwest::get(s.url(job["video_url"].as_str().unwrap()))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
}

/// A 400 `enhancer_not_loaded` whose message says `needle`.
async fn not_loaded(r: reqwest::Response, needle: &str) {
    assert_eq!(r.status(), 400);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error_type"], "enhancer_not_loaded", "{v}");
    assert!(v["error"].as_str().unwrap().contains(needle), "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_name_a_loaded_enhancer_or_are_refused_with_400() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("tiny-x2.safetensors");
    tiny_enhancer(&ck, 0.2);
    let post = |s: &Server, enhance: &str| {
        let form = common::server::lipsync_form("arctic_a0007_1s.wav", "astronaut.png")
            .text("enhance", enhance.to_string());
        reqwest::Client::new()
            .post(s.url("/v1/lipsync"))
            .multipart(form)
            .send()
    };
    {
        // Two enhancer instances beside the model's: the faces that ask go to them.
        let s = Server::start_echo(&[
            "--enhancer-checkpoint",
            &ck.display().to_string(),
            "--enhancer-instances",
            "2",
        ]);
        s.wait_ready().await;
        let info = s.info().await;
        let e = &info["enhancers"][0];
        assert_eq!(e["name"], "tiny-x2", "{info}");
        assert_eq!(e["kind"], "esrgan");
        assert_eq!(e["scale"], 2);
        assert_eq!(e["instances"], 2, "{e}");
        assert_eq!(e["conv_path"], "cpu", "{e}");
        assert!(e["ms_per_face"].as_f64().unwrap() > 0.0, "{e}");
        for ask in ["esrgan", "tiny-x2", "none"] {
            let r = post(&s, ask).await.unwrap();
            assert_eq!(r.status(), 200, "enhance={ask}");
            let body = r.bytes().await.unwrap();
            assert_eq!(common::server::codecs(&body), "h264,aac", "enhance={ask}");
        }
        // Every face handed to the enhancers came back: none waits.
        let metrics = reqwest::get(s.url("/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            metrics.contains("lipsync_enhance_queue_frames 0"),
            "{metrics}"
        );
        not_loaded(
            post(&s, "realesr-general-x4v3").await.unwrap(),
            "tiny-x2 (esrgan)",
        )
        .await;
        // A batch job asks the same way, and renders with it.
        let form = common::server::lipsync_form("arctic_a0007_1s.wav", "astronaut.png")
            .text("enhance", "esrgan");
        let video = job_video(&s, form).await;
        assert_eq!(common::server::codecs(&video), "h264,aac");
    }
    {
        // Two of a kind: the kind alone is ambiguous, names pick.
        let other = dir.path().join("tiny-b.safetensors");
        tiny_enhancer(&other, 0.0);
        let both = format!("{},{}", ck.display(), other.display());
        let s = Server::start_with(
            common::server::ECHO,
            &[],
            &[("LIPSYNC_ENHANCER_CHECKPOINT", both.as_str())],
        );
        s.wait_ready().await;
        assert_eq!(s.info().await["enhancers"].as_array().unwrap().len(), 2);
        not_loaded(
            post(&s, "esrgan").await.unwrap(),
            "name one (tiny-x2, tiny-b)",
        )
        .await;
        assert_eq!(post(&s, "tiny-b").await.unwrap().status(), 200);
    }
    let s = Server::start_echo(&[]);
    s.wait_ready().await;
    assert_eq!(s.info().await["enhancers"], serde_json::json!([]));
    not_loaded(post(&s, "esrgan").await.unwrap(), "--enhancer-checkpoint").await;
}

/// `lipsync bench --device echo --sections enhancers` with the enhancer `ck` and `extra`
/// flags, on the astronaut: its stdout (the run succeeded) and its JSON.
fn bench_enhancers(ck: &Path, extra: &[&str]) -> (String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("bench.json");
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![
        &"bench",
        &"--device",
        &"echo",
        &"--sections",
        &"enhancers",
        &"--enhancer-checkpoint",
        &ck,
    ];
    args.extend(extra.iter().map(|a| a as &dyn AsRef<std::ffi::OsStr>));
    let (image, audio) = (
        common::media_path("astronaut.png"),
        common::media_path("arctic_a0007.wav"),
    );
    args.extend([
        &"--image" as &dyn AsRef<std::ffi::OsStr>,
        &image,
        &"--audio",
        &audio,
        &"--json",
        &json,
    ]);
    let o = lipsync_bounded(&args, std::time::Duration::from_secs(300));
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    (text(&o.stdout), v)
}

#[test]
fn bench_reports_each_enhancers_speed_and_what_it_adds_to_a_request() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("tiny-x2.safetensors");
    tiny_enhancer(&ck, 0.0);
    let (stdout, v) = bench_enhancers(&ck, &["--enhance-seconds", "1"]);
    assert!(stdout.contains("| tiny-x2 |"), "{stdout}");
    assert!(
        stdout.contains("What an enhancer adds to a request"),
        "{stdout}"
    );
    let e = &v["enhancers"][0];
    assert_eq!(e["name"], "tiny-x2", "{v}");
    for b in ["1", "16"] {
        assert!(e["faces_per_second"][b].as_f64().unwrap() > 0.0, "{v}");
    }
    let r = &e["request"];
    // One second of speech at 25 fps: 22 model frames.
    assert!(r["model_frames"].as_u64().unwrap() >= 20, "{v}");
    assert_eq!(r["speech_seconds"], 1.0);
    let (plain, with) = (
        r["plain_seconds"].as_f64().unwrap(),
        r["seconds"].as_f64().unwrap(),
    );
    assert!(plain > 0.0 && with > 0.0, "{v}");
    assert!((r["added_seconds"].as_f64().unwrap() - (with - plain)).abs() < 1e-9);

    // --batches chooses the batches measured (the GPU run's rehearsal measures batch 1 only:
    // GFPGAN takes seconds a face on the CPU); --enhance-seconds 0 skips the request.
    let (stdout, v) = bench_enhancers(&ck, &["--batches", "2,3", "--enhance-seconds", "0"]);
    assert!(
        stdout.contains("| batch 2 faces/s | batch 3 faces/s |"),
        "{stdout}"
    );
    assert!(!stdout.contains("What an enhancer adds"), "{stdout}");
    let rates = v["enhancers"][0]["faces_per_second"].as_object().unwrap();
    assert_eq!(rates.keys().collect::<Vec<_>>(), ["2", "3"], "{v}");
    assert!(rates.values().all(|r| r.as_f64().unwrap() > 0.0), "{v}");
}

#[test]
fn gfpgan_matches_the_upstream_network_on_a_random_v14_checkpoint() {
    // tests/reference/gfpgan_reference.py makes a random GFPGANv1.4-layout checkpoint (legacy
    // torch.save, 285 tensors, the published 348 632 874 bytes) and runs the upstream
    // GFPGANv1Clean on the astronaut photo (512x512, as an aligned face would be) with the
    // stored noise; `lipsync enhance` runs ours on the same PNG. Goal: max |Δ| ≤ 2/255 (ours
    // is rounded to 8 bits, the reference is f32).
    let Some(python) = torch_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let photo = common::media_path("astronaut.png");
    let rgb = image::open(&photo).unwrap().to_rgb8();
    assert_eq!(rgb.dimensions(), (512, 512));
    std::fs::write(dir.path().join("face.rgb"), rgb.as_raw()).unwrap();
    let upstream = upstream(&python);
    let mut cmd = reference_command(&python, "gfpgan_reference.py", &upstream, dir.path());
    cmd.arg("--input").arg(dir.path().join("face.rgb"));
    run_reference(cmd, &upstream);
    let ck = dir.path().join("GFPGANv1.4.pth");
    assert_eq!(std::fs::metadata(&ck).unwrap().len(), 348_632_874);
    let out = dir.path().join("restored.png");
    let o = lipsync(&[
        &"enhance",
        &"--enhancer-checkpoint",
        &ck,
        &"--image",
        &photo,
        &"--out",
        &out,
        &"--json",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(summary["kind"], "gfpgan", "{summary}");
    assert_eq!(summary["enhancer"], "GFPGANv1.4", "{summary}");
    assert_eq!(summary["output"]["width"], 512, "{summary}");
    // 197.8 G multiply-adds a face, counted layer by layer from the architecture as GFPGAN's
    // wrapper runs it (no intermediate RGB, no style MLP): the published 395.5 GFLOP.
    assert_eq!(summary["multiply_adds"], 197_765_619_712f64, "{summary}");
    let ours = image::open(&out).unwrap().to_rgb8();
    let theirs = read_f32(&dir.path().join("output.f32"));
    assert_eq!(theirs.len(), 3 * 512 * 512);
    let plane = 512 * 512;
    let mut worst = 0f32;
    for (i, px) in ours.as_raw().chunks_exact(3).enumerate() {
        for (c, v) in px.iter().enumerate() {
            worst = worst.max((f32::from(*v) - theirs[c * plane + i] * 255.0).abs());
        }
    }
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("expected.json")).unwrap())
            .unwrap();
    eprintln!("GFPGAN vs upstream: max |Δ| {worst:.3}/255 ({expected})");
    // The comparison can fail: the reference's output is an image, not a clamped flat colour.
    assert!(
        expected["clamped_fraction"].as_f64().unwrap() < 0.05,
        "{expected}"
    );
    assert!(expected["std"].as_f64().unwrap() > 0.05, "{expected}");
    assert!(worst <= 2.0, "max |Δ| {worst}/255");

    // Any other size is refused, with exit 2.
    let small = dir.path().join("small.png");
    image::imageops::crop_imm(&rgb, 180, 60, 96, 96)
        .to_image()
        .save(&small)
        .unwrap();
    let o = enhance(&ck, &small, &dir.path().join("no.png"));
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("512x512 FFHQ template"), "{err}");
    restored_frames_match_the_reference(&python, &upstream, &ck, dir.path());
    // A random RetinaFace beside it (tests/reference/retinaface_reference.py).
    let detectors = dir.path().join("detectors");
    let mut cmd = reference_command(&python, "retinaface_reference.py", &upstream, &detectors);
    cmd.arg("--image").arg(common::media_path("astronaut.png"));
    run_reference(cmd, &upstream);
    let detector = detectors.join("mobilenet0.25_Final.pth");
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(every_door_restores_with_gfpgan(&ck, &detector, dir.path()));
}

/// Landmarks given for the astronaut's face (slightly tilted: not the box's proportions).
const GFPGAN_LANDMARKS: &str = "203.5,104.2,246.1,103.1,225.4,133.0,206.0,150.2,244.1,149.3";
const GFPGAN_BOX: &str = "180,90,270,187";

/// The first 0.2 s of the test speech (two frames drawn, five in the video): GFPGAN takes
/// seconds per face on the CPU.
fn short_speech(dir: &Path) -> PathBuf {
    let mut r = hound::WavReader::open(common::media_path("arctic_a0007_1s.wav")).unwrap();
    let spec = r.spec();
    let n = (spec.sample_rate / 5 * u32::from(spec.channels)) as usize;
    let samples: Vec<i16> = r.samples::<i16>().take(n).map(Result::unwrap).collect();
    let path = dir.join("short.wav");
    let mut w = hound::WavWriter::create(&path, spec).unwrap();
    samples.iter().for_each(|v| w.write_sample(*v).unwrap());
    w.finalize().unwrap();
    path
}

/// `render --device echo --enhance gfpgan --landmarks L --frames-dir` on the astronaut photo,
/// every composited frame against tests/reference/gfpgan_frame_reference.py (the paste, the
/// alignment with cv2.warpAffine, the upstream GFPGANv1Clean with the same weights, the warp
/// back and the lower-face blend). Goal: 2 levels (measured: 0 on every frame). The eyes and
/// everything above the mask stay the photo's bytes.
fn restored_frames_match_the_reference(python: &str, upstream: &Path, ck: &Path, dir: &Path) {
    let speech = short_speech(dir);
    let ours = dir.join("frames");
    let o = lipsync_bounded(
        &[
            &"render",
            &"--device",
            &"echo",
            &"--audio",
            &speech,
            &"--image",
            &common::media_path("astronaut.png"),
            &"--box",
            &GFPGAN_BOX,
            &"--landmarks",
            &GFPGAN_LANDMARKS,
            &"--enhancer-checkpoint",
            &ck,
            &"--enhance",
            &"gfpgan",
            &"--frames-dir",
            &ours,
            &"--out",
            &dir.join("restored.mp4"),
        ],
        std::time::Duration::from_secs(300),
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let ours = images(&ours);
    assert_eq!(ours.len(), 2, "0.2 s of speech: two drawn frames");
    let reference = dir.join("frame-reference");
    let mut cmd = reference_command(python, "gfpgan_frame_reference.py", upstream, &reference);
    cmd.arg("--checkpoint")
        .arg(ck)
        .arg("--photo")
        .arg(common::media_path("astronaut.png"))
        .args(["--box", GFPGAN_BOX, "--landmarks", GFPGAN_LANDMARKS])
        .args(["--frames", "2"]);
    run_reference(cmd, upstream);
    let theirs = images(&reference.join("frames"));
    let photo = image::open(common::media_path("astronaut.png"))
        .unwrap()
        .to_rgb8();
    let mut worst = 0u8;
    for (k, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert_eq!(a.dimensions(), photo.dimensions(), "frame {k}");
        for (x, y) in a.as_raw().iter().zip(b.as_raw()) {
            worst = worst.max(x.abs_diff(*y));
        }
        // Restored: the lower face changed a lot; above the nose (the eyes' rows, y ≤ 110)
        // nothing changed.
        let (mut changed, mut above) = (0, 0);
        for (x, y, p) in a.enumerate_pixels() {
            if p != photo.get_pixel(x, y) {
                changed += 1;
                if y <= 110 {
                    above += 1;
                }
            }
        }
        assert!(changed > 2000, "frame {k}: {changed} pixels changed");
        assert_eq!(above, 0, "frame {k}: pixels at the eyes' height changed");
    }
    eprintln!("whole GFPGAN-restored frames: max difference from the PyTorch + OpenCV reference {worst}/255");
    assert!(worst <= 2, "frames differ by {worst}/255");
}

/// The service with GFPGAN and a RetinaFace loaded: `/info`, the avatar's landmarks (found by
/// RetinaFace at upload), `POST /v1/lipsync`, a batch job and a live session, each with
/// `enhance=gfpgan`.
async fn every_door_restores_with_gfpgan(ck: &Path, detector: &Path, dir: &Path) {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let avatars = dir.join("avatars");
    let avatar_dir = ["--avatar-dir", avatars.to_str().unwrap()];
    let s = Server::start_echo(&[
        "--enhancer-checkpoint",
        &ck.display().to_string(),
        "--enhancer-checkpoint",
        &detector.display().to_string(),
        avatar_dir[0],
        avatar_dir[1],
    ]);
    s.wait_ready().await;
    let info = s.info().await;
    let d = &info["landmark_detector"];
    assert_eq!(d["kind"], "retinaface", "{info}");
    assert_eq!(d["architecture"], "RetinaFace (MobileNet-0.25)", "{d}");
    assert_eq!(d["used"], true, "{d}");
    assert_eq!(info["enhancers"].as_array().unwrap().len(), 1, "{info}");
    let e = &info["enhancers"][0];
    assert_eq!(e["kind"], "gfpgan", "{info}");
    assert_eq!(e["applies_to"], "aligned_face", "{e}");
    assert_eq!(e["face_side"], 512, "{e}");
    assert_eq!(e["multiply_adds_per_face"], 197_765_619_712f64, "{e}");
    // Its measured cost is a whole restoration: seconds, not the milliseconds of a 96x96 face.
    assert!(e["ms_per_face"].as_f64().unwrap() > 100.0, "{e}");
    let avatar = s.upload_avatar_file("image", "astronaut.png").await;
    assert_eq!(avatar["landmarks_source"], "retinaface", "{avatar}");
    // Given landmarks win over the detector's.
    let form = reqwest::multipart::Form::new()
        .part(
            "image",
            reqwest::multipart::Part::bytes(common::media("astronaut.png")).file_name("a.png"),
        )
        .text("landmarks", GFPGAN_LANDMARKS);
    let given: serde_json::Value = reqwest::Client::new()
        .post(s.url("/v1/avatars"))
        .multipart(form)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(given["landmarks_source"], "client", "{given}");
    assert_eq!(
        avatar["landmarks"].as_array().unwrap().len(),
        10,
        "{avatar}"
    );
    let id = avatar["id"].as_str().unwrap().to_string();
    let speech = std::fs::read(short_speech(dir)).unwrap();
    let form = || {
        reqwest::multipart::Form::new()
            .part(
                "audio",
                reqwest::multipart::Part::bytes(speech.clone()).file_name("short.wav"),
            )
            .text("avatar_id", id.clone())
            .text("enhance", "gfpgan")
    };
    let http = reqwest::Client::new();
    let r = http
        .post(s.url("/v1/lipsync"))
        .multipart(form())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let video = r.bytes().await.unwrap();
    assert_eq!(common::server::codecs(&video), "h264,aac");
    assert_eq!(common::server::decoded_frames(&video), 5);
    // A clip: RetinaFace runs on every frame at upload, and every drawn frame is restored
    // on its own clip frame.
    let clip = s.upload_avatar_file("video", "clip_rgb_25fps.mp4").await;
    assert_eq!(clip["landmarks_source"], "retinaface", "{clip}");
    let clip_form = reqwest::multipart::Form::new()
        .part(
            "audio",
            reqwest::multipart::Part::bytes(speech.clone()).file_name("short.wav"),
        )
        .text("avatar_id", clip["id"].as_str().unwrap().to_string())
        .text("enhance", "gfpgan");
    let r = http
        .post(s.url("/v1/lipsync"))
        .multipart(clip_form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let video = r.bytes().await.unwrap();
    assert_eq!(common::server::decoded_frames(&video), 5);
    let video = job_video(&s, form()).await;
    assert_eq!(common::server::decoded_frames(&video), 5);
    // A live session: admitted at any drawing rate, its idle face restored too (on the
    // avatar with the given landmarks: the random detector's would put the mouth elsewhere).
    let url = s.url("/v1/stream").replacen("http://", "ws://", 1);
    let (mut ws, _) = tokio_tungstenite::connect_async(url).await.unwrap();
    let open = serde_json::json!({
        "avatar_id": given["id"], "output": "jpeg", "min_draw_fps": 0, "enhance": "gfpgan",
    });
    ws.send(Message::Text(open.to_string().into()))
        .await
        .unwrap();
    let frame = tokio::time::timeout(std::time::Duration::from_secs(120), async {
        loop {
            match ws.next().await.expect("the session closed").unwrap() {
                Message::Binary(b) => break b,
                Message::Text(t) => assert!(!t.contains("\"error\""), "{t}"),
                _ => {}
            }
        }
    })
    .await
    .expect("no frame within 120 s");
    // Each frame: index (u32), pts (f64), JPEG length (u32), the JPEG, then its audio.
    let n = u32::from_le_bytes(frame[12..16].try_into().unwrap()) as usize;
    let frame = image::load_from_memory(&frame[16..16 + n])
        .unwrap()
        .to_rgb8();
    let photo = image::open(common::media_path("astronaut.png"))
        .unwrap()
        .to_rgb8();
    let mean_diff = |y0: u32, y1: u32| {
        let (mut sum, mut n) = (0u64, 0u64);
        for y in y0..y1 {
            for x in 200..250 {
                for c in 0..3 {
                    sum += u64::from(frame.get_pixel(x, y)[c].abs_diff(photo.get_pixel(x, y)[c]));
                    n += 1;
                }
            }
        }
        sum as f64 / n as f64
    };
    let (eyes, mouth) = (mean_diff(95, 110), mean_diff(140, 160));
    eprintln!("live idle frame against the photo: eyes {eyes:.1}, mouth {mouth:.1} levels");
    assert!(eyes < 6.0 && mouth > 20.0, "eyes {eyes}, mouth {mouth}");
    let _ = ws.close(None).await;
    drop(s);
    // The landmarks found at upload are kept in the avatar files: a server started again on
    // the directory, without any detector, reports them as found, for the photo and the clip.
    let again = Server::start_echo(&avatar_dir);
    again.wait_ready().await;
    for uploaded in [&avatar, &clip] {
        let id = uploaded["id"].as_str().unwrap();
        let r = http
            .get(again.url(&format!("/v1/avatars/{id}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let read: serde_json::Value = r.json().await.unwrap();
        assert_eq!(read, *uploaded, "after a restart");
    }
}

#[test]
fn retinaface_matches_facexlib_on_random_checkpoints_of_both_published_layouts() {
    // tests/reference/retinaface_reference.py makes a random checkpoint in each published
    // layout (facexlib's detection_Resnet50_Final.pth, zip; Pytorch_Retinaface's
    // mobilenet0.25_Final.pth, legacy with `module.` keys) and runs facexlib's RetinaFace on
    // the two test photos. Goals: the raw outputs within 1e-4 of the largest reference
    // magnitude; the 50 best priors decoded and suppressed (NMS 0.4) give the same faces,
    // boxes and landmarks within 0.5 px, and at least 5 of them.
    let Some(python) = torch_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let photos = ["astronaut.png", "grace_hopper.jpg"];
    let upstream = upstream(&python);
    let mut cmd = reference_command(&python, "retinaface_reference.py", &upstream, dir.path());
    // Both sides see the same pixels: the photos as decoded here, handed over as PNG (JPEG
    // decoders differ by a level here and there).
    let decoded: Vec<image::RgbImage> = photos
        .iter()
        .map(|p| image::open(common::media_path(p)).unwrap().to_rgb8())
        .collect();
    for (i, rgb) in decoded.iter().enumerate() {
        let png = dir.path().join(format!("photo{i}.png"));
        rgb.save(&png).unwrap();
        cmd.arg("--image").arg(png);
    }
    // An avatar's landmark search: the region around its box, through facexlib's own
    // detect_faces there (threshold 0.5, NMS 0.4).
    let face = lipsync::media::face::FaceBox {
        x1: 180,
        y1: 90,
        x2: 270,
        y2: 187,
    };
    let [x0, y0, x1, y1] = lipsync::engine::landmarks::region(face, 512, 512);
    cmd.arg("--crop").arg(format!("{x0},{y0},{x1},{y1}"));
    run_reference(cmd, &upstream);
    let mut found = 0;
    for (file, backbone) in [
        ("detection_Resnet50_Final.pth", "ResNet-50"),
        ("mobilenet0.25_Final.pth", "MobileNet-0.25"),
    ] {
        let ck = lipsync::model::checkpoint::read(&dir.path().join(file)).unwrap();
        let net = lipsync::model::retinaface::recognise(&ck)
            .expect("recognised as RetinaFace")
            .unwrap();
        assert_eq!(net.backbone().name(), backbone);
        let stem = file.split('_').next().unwrap();
        for (i, photo) in photos.iter().enumerate() {
            let rgb = &decoded[i];
            let (w, h) = (rgb.width() as usize, rgb.height() as usize);
            let raw = net.forward(rgb.as_raw(), w, h).unwrap();
            let reference =
                |name: &str| read_f32(&dir.path().join(format!("{stem}_{i}_{name}.f32")));
            let ours: [Vec<f32>; 3] = [
                raw.loc.iter().flatten().copied().collect(),
                raw.conf.iter().flatten().copied().collect(),
                raw.landms.iter().flatten().copied().collect(),
            ];
            for (name, ours) in ["loc", "conf", "landms"].iter().zip(&ours) {
                let theirs = reference(name);
                assert_eq!(ours.len(), theirs.len(), "{file} {photo} {name}");
                let largest = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
                let worst = ours
                    .iter()
                    .zip(&theirs)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                eprintln!("{file} {photo} {name}: max |Δ| {worst:.3e} of {largest:.3e}");
                assert!(
                    worst <= 1e-4 * largest,
                    "{file} {photo} {name}: {worst} of {largest}"
                );
            }
            let faces =
                lipsync::model::retinaface::decode(&raw, w, h, f32::NEG_INFINITY, Some(50), 0.4);
            let theirs: Vec<Vec<f32>> = serde_json::from_str(
                &std::fs::read_to_string(dir.path().join(format!("{stem}_{i}.json"))).unwrap(),
            )
            .unwrap();
            assert!(theirs.len() >= 5, "{file} {photo}: {} faces", theirs.len());
            assert_eq!(faces.len(), theirs.len(), "{file} {photo}");
            let mut worst = 0f32;
            for (f, t) in faces.iter().zip(&theirs) {
                let ours = f.bbox.iter().chain(&f.landmarks);
                let theirs = t[..4].iter().chain(&t[5..15]);
                for (a, b) in ours.zip(theirs) {
                    worst = worst.max((a - b).abs());
                }
                assert!(
                    (f.score - t[4]).abs() <= 1e-4,
                    "{file} {photo}: {} vs {}",
                    f.score,
                    t[4]
                );
            }
            eprintln!(
                "{file} {photo}: {} faces, boxes and landmarks within {worst:.4} px",
                faces.len()
            );
            assert!(worst <= 0.5, "{file} {photo}: {worst} px");
        }
        // The landmarks an avatar with that box gets: facexlib's best face centred in the
        // box, in the photo's pixels.
        let frame = lipsync::media::image::Frame::new(512, 512, decoded[0].as_raw().clone());
        let ours = lipsync::engine::landmarks::in_frame(&frame, face, &net).unwrap();
        let theirs: Vec<Vec<f32>> = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join(format!("{stem}_crop.json"))).unwrap(),
        )
        .unwrap();
        let centred = theirs.iter().find(|f| {
            let (cx, cy) = (
                (f[0] + f[2]) / 2.0 + x0 as f32,
                (f[1] + f[3]) / 2.0 + y0 as f32,
            );
            (180.0..=270.0).contains(&cx) && (90.0..=187.0).contains(&cy)
        });
        match (ours, centred) {
            (Some(l), Some(f)) => {
                found += 1;
                let offset = |k: usize| f64::from(if k % 2 == 0 { x0 } else { y0 });
                let worst = l
                    .to_array()
                    .iter()
                    .zip(&f[5..15])
                    .enumerate()
                    .map(|(k, (a, b))| (a - f64::from(*b) - offset(k)).abs())
                    .fold(0f64, f64::max);
                eprintln!("{file}: the avatar's landmarks within {worst:.4} px of facexlib's");
                assert!(worst <= 0.5, "{file}: {worst} px");
            }
            (None, None) => {}
            (ours, theirs) => panic!("{file}: ours {ours:?}, facexlib's {theirs:?}"),
        }
    }
    // The comparison can fail: at least one network finds a face there.
    assert!(found >= 1, "no network found a face in the region");
}
