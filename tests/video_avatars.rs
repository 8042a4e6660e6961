//! Video avatars end to end: `lipsync render --video` and the service's `video` field, with
//! the repository's clips (a real one, carphone.mp4, and lossless pans made by
//! tests/reference/clip_reference.py) and variants made here with ffmpeg (rotated, WebM, MKV,
//! MOV, 120 fps, damaged, faceless, 720p). Needs ffmpeg and ffprobe (scripts/test.sh).
//!
//! Only the comparison with the PyTorch reference's faces runs the model (test weights on
//! the CPU); the rest is about reading clips, their rates, loops, boxes and errors, and runs
//! on the echo device (the model stand-in that costs nothing: each face is the frame's
//! reference face with the mouth moved), `render --device echo` and `Server::start_echo`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::server::{decoded_frames, Server};
use common::{checkpoint, decode_frames, lipsync, media, media_path, num, probe, stream, text};
use lipsync::engine::Loop;
use lipsync::media::face::{self, FaceBox};
use lipsync::media::video::clip::{ClipFile, ClipLimits};
use reqwest::multipart::{Form, Part};

const SPEECH: &str = "arctic_a0007_1s.wav";

fn ffmpeg(args: &[&str]) {
    let o = Command::new("ffmpeg")
        .args(["-v", "error", "-y"])
        .args(args)
        .output()
        .expect("ffmpeg is needed (scripts/test.sh installs it)");
    assert!(o.status.success(), "ffmpeg {args:?}: {}", text(&o.stderr));
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A clip derived from the 25 fps lossless pan with extra ffmpeg output options.
fn variant(dir: &Path, name: &str, options: &[&str]) -> PathBuf {
    let out = dir.join(name);
    let src = media_path("clip_rgb_25fps.mp4");
    let mut args = vec!["-i", path_str(&src)];
    args.extend_from_slice(options);
    args.push(path_str(&out));
    ffmpeg(&args);
    out
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(common::fixture("clip/reference.json")).unwrap())
        .unwrap()
}

fn render(args: &[&dyn AsRef<std::ffi::OsStr>]) -> std::process::Output {
    let ck = checkpoint("legacy_plain.pth");
    let mut all: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![&"render", &"--checkpoint", &ck];
    all.extend_from_slice(args);
    lipsync(&all)
}

/// `lipsync render --device echo` with `args`: for the tests of the media side.
fn render_echo(args: &[&dyn AsRef<std::ffi::OsStr>]) -> std::process::Output {
    let mut all: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![&"render", &"--device", &"echo"];
    all.extend_from_slice(args);
    lipsync(&all)
}

fn max_face_difference(ours: &Path, reference: &Path) -> u8 {
    let a = image::open(ours).unwrap().to_rgb8();
    let b = image::open(reference).unwrap().to_rgb8();
    a.as_raw()
        .iter()
        .zip(b.as_raw())
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap()
}

#[test]
fn clip_faces_match_the_pytorch_opencv_reference_shorter_and_longer_than_the_speech() {
    let meta = reference();
    let b = meta["box"].as_array().unwrap();
    let box_arg = format!("{},{},{},{}", b[0], b[1], b[2], b[3]);
    for (name, clip) in meta["clips"].as_object().unwrap() {
        let dir = tempfile::tempdir().unwrap();
        let faces = dir.path().join("faces");
        let out = dir.path().join("out.mp4");
        let o = render(&[
            &"--audio",
            &media_path(SPEECH),
            &"--video",
            &media_path(&format!("{name}.mp4")),
            &"--box",
            &box_arg,
            &"--loop",
            &"repeat",
            &"--blend",
            &"hard",
            &"--faces-dir",
            &faces,
            &"--out",
            &out,
        ]);
        assert!(o.status.success(), "{name}: {}", text(&o.stderr));
        let m = clip["model_frames"].as_u64().unwrap() as usize;
        let mut worst = 0;
        for k in 0..m {
            let f = format!("{k:05}.png");
            worst = worst.max(max_face_difference(
                &faces.join(&f),
                &common::fixture(&format!("clip/{name}/{f}")),
            ));
        }
        assert_eq!(std::fs::read_dir(&faces).unwrap().count(), m, "{name}");
        eprintln!("{name}: {m} faces, max difference from the reference {worst}/255");
        assert!(worst <= 2, "{name}: faces differ by {worst}/255");
        // The video runs at the clip's rate and covers the speech: V = max(ceil(s·fps), M).
        let p = probe(&out);
        let v = stream(&p, "video");
        let fps = clip["fps"].as_u64().unwrap();
        assert_eq!(v["r_frame_rate"], format!("{fps}/1"), "{name}");
        let frames = v["nb_read_frames"]
            .as_str()
            .unwrap()
            .parse::<usize>()
            .unwrap();
        assert_eq!(frames, (fps as usize).max(m), "{name}");
    }
}

#[test]
fn box_smoothing_matches_a_transcription_of_inference_py() {
    let cases: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixture("clip/smoothing.json")).unwrap(),
    )
    .unwrap();
    let boxes = |v: &serde_json::Value| -> Vec<FaceBox> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|b| {
                let c: Vec<u32> = b
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect();
                FaceBox {
                    x1: c[0],
                    y1: c[1],
                    x2: c[2],
                    y2: c[3],
                }
            })
            .collect()
    };
    let cases = cases.as_array().unwrap();
    assert!(cases.len() >= 4);
    for case in cases {
        let mut got = boxes(&case["boxes"]);
        assert!(got.len() >= 5);
        face::smooth_boxes(&mut got, face::SMOOTH_WINDOW);
        assert_eq!(got, boxes(&case["smoothed"]), "n = {}", got.len());
    }
}

/// Mean absolute difference of two RGB frames outside a box.
fn difference_outside(a: &[u8], b: &[u8], width: usize, r: &FaceBox) -> f64 {
    let (mut sum, mut n) = (0u64, 0u64);
    for (i, (x, y)) in a.chunks_exact(3).zip(b.chunks_exact(3)).enumerate() {
        let (px, py) = ((i % width) as u32, (i / width) as u32);
        if px >= r.x1 && px < r.x2 && py >= r.y1 && py < r.y2 {
            continue;
        }
        sum += x
            .iter()
            .zip(y)
            .map(|(p, q)| u64::from(p.abs_diff(*q)))
            .sum::<u64>();
        n += 3;
    }
    sum as f64 / n as f64
}

#[test]
fn the_video_follows_the_clip_in_both_loop_modes() {
    // 12 clip frames, 22 model frames: the loop modes differ from frame 12 on.
    let clip = media_path("clip_rgb_25fps.mp4");
    let source = decode_frames(&clip, 160, 160);
    assert_eq!(source.len(), 12);
    let face = FaceBox {
        x1: 40,
        y1: 30,
        x2: 128,
        y2: 130,
    };
    for mode in [Loop::PingPong, Loop::Repeat] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.mp4");
        let o = render_echo(&[
            &"--audio",
            &media_path(SPEECH),
            &"--video",
            &clip,
            &"--box",
            &"40,30,128,130",
            &"--loop",
            &mode.to_string(),
            &"--crf",
            &"10",
            &"--out",
            &out,
        ]);
        assert!(o.status.success(), "{}", text(&o.stderr));
        let frames = decode_frames(&out, 160, 160);
        assert_eq!(frames.len(), 25);
        for (k, frame) in frames.iter().enumerate() {
            let best = (0..source.len())
                .min_by(|&a, &b| {
                    let da = difference_outside(frame, &source[a], 160, &face);
                    let db = difference_outside(frame, &source[b], 160, &face);
                    da.total_cmp(&db)
                })
                .unwrap();
            // Frames after the last model frame (21) hold it.
            let want = mode.select(k.min(21), source.len());
            assert_eq!(
                best, want,
                "{mode}: video frame {k} shows clip frame {best}"
            );
        }
    }
}

#[test]
fn a_real_clip_renders_at_its_own_rate_with_detected_boxes() {
    let dir = tempfile::tempdir().unwrap();
    let faces = dir.path().join("faces");
    let out = dir.path().join("out.mp4");
    let o = render_echo(&[
        &"--audio",
        &media_path(SPEECH),
        &"--video",
        &media_path("carphone.mp4"),
        &"--fps",
        &"25",
        &"--faces-dir",
        &faces,
        &"--out",
        &out,
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let p = probe(&out);
    let v = stream(&p, "video");
    assert_eq!(
        (v["width"].as_u64(), v["height"].as_u64()),
        (Some(176), Some(144))
    );
    // --fps is for photos: the clip's 30000/1001 wins; 1 s of speech -> 26 model frames.
    assert_eq!(v["r_frame_rate"], "30000/1001");
    assert_eq!(v["nb_read_frames"], "30");
    assert_eq!(stream(&p, "audio")["codec_name"], "aac");
    assert!((num(&p["format"]["duration"]) - 1.0).abs() < 0.1);
    assert_eq!(std::fs::read_dir(&faces).unwrap().count(), 26);
}

/// Brows-to-chin boxes labelled by hand on 4× zoomed, gridded frames of carphone.mp4.
const CARPHONE_BOXES: [(usize, FaceBox); 3] = [
    (
        0,
        FaceBox {
            x1: 64,
            y1: 56,
            x2: 109,
            y2: 96,
        },
    ),
    (
        60,
        FaceBox {
            x1: 55,
            y1: 44,
            x2: 100,
            y2: 96,
        },
    ),
    (
        119,
        FaceBox {
            x1: 50,
            y1: 45,
            x2: 96,
            y2: 92,
        },
    ),
];

#[test]
fn detection_on_a_real_clip_matches_hand_labelled_boxes() {
    let bytes = media("carphone.mp4");
    let clip = ClipFile::open(
        &bytes,
        Path::new("ffmpeg"),
        ClipLimits {
            max_seconds: 60.0,
            max_pixels: 1 << 24,
        },
    )
    .unwrap();
    assert_eq!(clip.info.fps.ratio(), (30000, 1001));
    assert_eq!(clip.info.codec, "h264");
    let mut found = Vec::new();
    let n = clip
        .decode(&mut |i, frame| {
            if let Some((_, want)) = CARPHONE_BOXES.iter().find(|(k, _)| *k == i) {
                let got = face::detect(&frame).unwrap().face;
                found.push((i, got, got.iou(want)));
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(n, 120);
    assert_eq!(found.len(), 3);
    for (i, got, iou) in found {
        eprintln!("frame {i}: detected {got}, IoU {iou:.2} with the hand-labelled box");
        assert!(iou >= 0.6, "frame {i}: {got}, IoU {iou:.2}");
    }
}

#[test]
fn rotated_webm_mkv_and_mov_clips_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Rotation metadata is written by a stream copy (ffmpeg 5 drops it when encoding).
    let wide = variant(
        d,
        "wide.mp4",
        &["-vf", "crop=160:120:0:0", "-c:v", "libx264"],
    );
    let wide_rotated = d.join("wide_rotated.mp4");
    ffmpeg(&[
        "-i",
        path_str(&wide),
        "-c",
        "copy",
        "-metadata:s:v:0",
        "rotate=90",
        path_str(&wide_rotated),
    ]);
    // (file, expected output size, expected rate)
    let cases = [
        (
            variant(
                d,
                "rotated.mp4",
                &["-c", "copy", "-metadata:s:v:0", "rotate=90"],
            ),
            (160, 160),
            "25/1",
        ),
        (wide_rotated, (120, 160), "25/1"),
        (
            variant(d, "vp9.webm", &["-c:v", "libvpx-vp9", "-b:v", "300k"]),
            (160, 160),
            "25/1",
        ),
        (
            variant(d, "vp8.webm", &["-c:v", "libvpx", "-b:v", "300k"]),
            (160, 160),
            "25/1",
        ),
        (
            variant(d, "clip.mkv", &["-c:v", "libx264"]),
            (160, 160),
            "25/1",
        ),
        (
            variant(d, "clip.mov", &["-c:v", "libx264"]),
            (160, 160),
            "25/1",
        ),
        (
            variant(
                d,
                "clip30.mp4",
                &["-vf", "setpts=N/30/TB", "-r", "30", "-c:v", "libx264"],
            ),
            (160, 160),
            "30/1",
        ),
    ];
    for (clip, (w, h), rate) in cases {
        let out = d.join("out.mp4");
        let o = render_echo(&[
            &"--audio",
            &media_path(SPEECH),
            &"--video",
            &clip,
            &"--box",
            &"10,10,100,110",
            &"--out",
            &out,
        ]);
        assert!(o.status.success(), "{clip:?}: {}", text(&o.stderr));
        let p = probe(&out);
        let v = stream(&p, "video");
        assert_eq!(
            (v["width"].as_u64().unwrap(), v["height"].as_u64().unwrap()),
            (w, h),
            "{clip:?}"
        );
        assert_eq!(v["r_frame_rate"], rate, "{clip:?}");
    }
}

#[test]
fn render_needs_exactly_one_avatar_and_jobs_accept_clips() {
    // Usage errors exit with 1, failed renders with 2.
    let o = lipsync(&[&"render", &"--audio", &media_path(SPEECH)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("--video"), "{}", text(&o.stderr));
    let o = lipsync(&[
        &"render",
        &"--audio",
        &media_path(SPEECH),
        &"--image",
        &media_path("astronaut.png"),
        &"--video",
        &media_path("carphone.mp4"),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));

    let dir = tempfile::tempdir().unwrap();
    let jobs = dir.path().join("jobs.jsonl");
    let line = |out: &str, extra: &str| {
        format!(
            "{{\"audio\": {:?}, \"video\": {:?}, \"out\": {:?}{extra}}}\n",
            media_path(SPEECH),
            media_path("clip_rgb_30fps.mp4"),
            dir.path().join(out)
        )
    };
    std::fs::write(
        &jobs,
        line(
            "a.mp4",
            ", \"loop\": \"repeat\", \"box\": \"40,30,128,130\"",
        ) + &line("b.mp4", ", \"smooth\": false, \"box\": \"40,30,128,130\"")
            + &line("c.mp4", ", \"loop\": \"sideways\""),
    )
    .unwrap();
    let o = render_echo(&[&"--jobs", &jobs]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(
        err.contains("jobs.jsonl:3") && err.contains("sideways"),
        "{err}"
    );
    for out in ["a.mp4", "b.mp4"] {
        let p = probe(&dir.path().join(out));
        assert_eq!(stream(&p, "video")["r_frame_rate"], "30/1");
    }
}

fn part(name: &str, bytes: Vec<u8>) -> Part {
    Part::bytes(bytes).file_name(name.to_string())
}

fn clip_form(video: Vec<u8>) -> Form {
    Form::new()
        .part("audio", part(SPEECH, media(SPEECH)))
        .part("video", part("clip.mp4", video))
}

async fn error_of(r: reqwest::Response) -> (u16, String) {
    let status = r.status().as_u16();
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    (status, v["error_type"].as_str().unwrap().to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_service_takes_clips_directly_and_as_avatars() {
    let s = Server::start_echo(&[]);
    s.wait_ready().await;
    let client = reqwest::Client::new();
    // Directly: the video is at the clip's rate.
    let r = client
        .post(s.url("/v1/lipsync"))
        .multipart(clip_form(media("carphone.mp4")).text("loop", "repeat"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body = r.bytes().await.unwrap();
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), &body).unwrap();
    let p = probe(f.path());
    assert_eq!(stream(&p, "video")["r_frame_rate"], "30000/1001");
    assert_eq!(decoded_frames(&body), 30);

    // As an avatar: described, then reused with either loop mode.
    let create = || {
        Form::new()
            .part("video", part("clip.mp4", media("clip_rgb_30fps.mp4")))
            .text("box", "40,30,128,130")
    };
    let r = client
        .post(s.url("/v1/avatars"))
        .multipart(create())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let a: serde_json::Value = r.json().await.unwrap();
    assert_eq!(a["kind"], "video");
    assert_eq!(a["frames"], 40);
    assert_eq!(a["fps"], 30.0);
    assert!((a["duration"].as_f64().unwrap() - 40.0 / 30.0).abs() < 1e-9);
    assert_eq!(a["box"], serde_json::json!([40, 30, 128, 130]));
    assert_eq!(
        (a["width"].as_u64(), a["height"].as_u64()),
        (Some(160), Some(160))
    );
    let id = a["id"].as_str().unwrap().to_string();
    let again = client
        .post(s.url("/v1/avatars"))
        .multipart(create())
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    let got: serde_json::Value = reqwest::get(s.url(&format!("/v1/avatars/{id}")))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(got, a);
    for mode in ["pingpong", "repeat"] {
        let r = client
            .post(s.url("/v1/lipsync"))
            .multipart(
                Form::new()
                    .part("audio", part(SPEECH, media(SPEECH)))
                    .text("avatar_id", id.clone())
                    .text("loop", mode),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{mode}");
        let body = r.bytes().await.unwrap();
        assert_eq!(decoded_frames(&body), 30, "{mode}");
    }
    // Frames without a face take the nearest detected box: five gray frames, then the pan.
    let dir = tempfile::tempdir().unwrap();
    let mixed = dir.path().join("mixed.mp4");
    let pan = media_path("clip_rgb_25fps.mp4");
    ffmpeg(&[
        "-f",
        "lavfi",
        "-i",
        "color=gray:s=160x160:r=25:d=0.2",
        "-i",
        path_str(&pan),
        "-filter_complex",
        "[0:v]format=yuv420p[a];[1:v]format=yuv420p[b];[a][b]concat=n=2:v=1[v]",
        "-map",
        "[v]",
        "-c:v",
        "libx264",
        "-crf",
        "12",
        path_str(&mixed),
    ]);
    let describe = |bytes: Vec<u8>, smooth: &'static str| {
        let client = client.clone();
        let url = s.url("/v1/avatars");
        async move {
            let r = client
                .post(url)
                .multipart(
                    Form::new()
                        .part("video", part("v.mp4", bytes))
                        .text("smooth", smooth),
                )
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 201);
            r.json::<serde_json::Value>().await.unwrap()
        }
    };
    let m = describe(std::fs::read(&mixed).unwrap(), "false").await;
    assert_eq!(m["frames"], 17);
    let pan_alone = describe(media("clip_rgb_25fps.mp4"), "false").await;
    let (got, want) = (&m["box"], &pan_alone["box"]);
    let near = (0..4).all(|i| got[i].as_i64().unwrap().abs_diff(want[i].as_i64().unwrap()) <= 3);
    assert!(near, "gray frame 0 took {got}, the first face is at {want}");
    let info: serde_json::Value = reqwest::get(s.url("/info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["limits"]["max_avatar_seconds"], 60.0);

    // `smooth` belongs to the avatar.
    let r = client
        .post(s.url("/v1/lipsync"))
        .multipart(
            Form::new()
                .part("audio", part(SPEECH, media(SPEECH)))
                .text("avatar_id", id.clone())
                .text("smooth", "false"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(r).await, (400, "bad_field".into()));
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_clips_get_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let fast = variant(
        d,
        "fast.mp4",
        &["-vf", "setpts=N/120/TB", "-r", "120", "-c:v", "libx264"],
    );
    let gray = d.join("gray.mp4");
    ffmpeg(&[
        "-f",
        "lavfi",
        "-i",
        "color=gray:s=160x160:r=25:d=1",
        "-c:v",
        "libx264",
        path_str(&gray),
    ]);
    let big = d.join("big.mp4");
    ffmpeg(&[
        "-f",
        "lavfi",
        "-i",
        "color=gray:s=200x160:r=25:d=1",
        "-c:v",
        "libx264",
        path_str(&big),
    ]);
    let whole = media("carphone.mp4");
    let mut truncated = whole[..whole.len() / 3].to_vec();
    // Keep the ftyp box, lose the rest: a known container that cannot be read.
    truncated.truncate(truncated.len().min(40_000));

    let s = Server::start_echo(&["--max-avatar-seconds", "2", "--max-pixels", "30000"]);
    s.wait_ready().await;
    let client = reqwest::Client::new();
    let cases: Vec<(&str, Form, (u16, &str))> = vec![
        (
            "audio as video",
            clip_form(media(SPEECH)),
            (415, "not_video"),
        ),
        (
            "photo as video",
            clip_form(media("astronaut.png")),
            (415, "not_video"),
        ),
        (
            "random bytes",
            clip_form(b"not a video at all".repeat(50)),
            (415, "not_video"),
        ),
        (
            "truncated mp4",
            clip_form(truncated),
            (400, "damaged_video"),
        ),
        (
            "120 fps",
            clip_form(std::fs::read(&fast).unwrap()),
            (400, "fps_too_high"),
        ),
        (
            "4 s clip, 2 s limit",
            clip_form(whole.clone()),
            (413, "avatar_too_long"),
        ),
        (
            "no face",
            clip_form(std::fs::read(&gray).unwrap()),
            (422, "no_face"),
        ),
        (
            "image and video",
            clip_form(media("clip_rgb_25fps.mp4"))
                .part("image", part("a.png", media("astronaut.png"))),
            (400, "bad_field"),
        ),
        (
            "smooth with a photo",
            Form::new()
                .part("audio", part(SPEECH, media(SPEECH)))
                .part("image", part("a.png", media("astronaut.png")))
                .text("smooth", "false"),
            (400, "bad_field"),
        ),
        (
            "unknown loop mode",
            clip_form(media("clip_rgb_25fps.mp4")).text("loop", "sideways"),
            (400, "bad_field"),
        ),
    ];
    for (what, form, want) in cases {
        let r = client
            .post(s.url("/v1/lipsync"))
            .multipart(form)
            .send()
            .await
            .unwrap();
        let (status, kind) = error_of(r).await;
        assert_eq!((status, kind.as_str()), want, "{what}");
    }
    // The avatar endpoint says the same, and the server is still serving.
    let r = client
        .post(s.url("/v1/avatars"))
        .multipart(Form::new().part("video", part("x.wav", media(SPEECH))))
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(r).await, (415, "not_video".into()));
    let r = client
        .post(s.url("/v1/lipsync"))
        .multipart(clip_form(media("clip_rgb_25fps.mp4")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(decoded_frames(&r.bytes().await.unwrap()), 25);
}

/// The cache budget of the issue: a prepared 10 s 1280×720 clip at 25 fps costs at most
/// 64 MB, counted in the avatar's size. The clip is a pan over a photo with film grain
/// (noise makes JPEG frames larger than a typical camera clip's).
#[tokio::test(flavor = "multi_thread")]
async fn a_ten_second_720p_clip_fits_the_cache_budget() {
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("hd.mp4");
    let astronaut = media_path("astronaut.png");
    ffmpeg(&[
        "-loop",
        "1",
        "-i",
        path_str(&astronaut),
        "-vf",
        "scale=1280:1280,crop=1280:720:0:'200+100*sin(t)',noise=alls=6:allf=t,format=yuv420p",
        "-t",
        "10",
        "-r",
        "25",
        "-c:v",
        "libx264",
        "-preset",
        "ultrafast",
        "-crf",
        "18",
        path_str(&clip),
    ]);
    let s = Server::start_echo(&[]);
    s.wait_ready().await;
    let r = reqwest::Client::new()
        .post(s.url("/v1/avatars"))
        .multipart(
            Form::new()
                .part("video", part("hd.mp4", std::fs::read(&clip).unwrap()))
                .text("box", "500,300,800,700"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let a: serde_json::Value = r.json().await.unwrap();
    assert_eq!(a["frames"], 250);
    let bytes = s.metric("lipsync_avatar_cache_bytes").await;
    eprintln!(
        "prepared 10 s 720p clip: {:.1} MB in the cache",
        bytes / 1e6
    );
    assert!(bytes > 5e6, "{bytes}");
    assert!(bytes <= 64e6, "{bytes} bytes");
}
