//! `serve --device echo`, the model stand-in, as a user meets it: no checkpoint, `/info`
//! says `echo`, the log says no faces are generated, and 40 s of speech come back as a
//! playable MP4 with every frame, whose mouth moves and whose photo stays still. Without
//! `--checkpoint`, every other device refuses to start.

mod common;

use std::process::Command;

use common::media;
use common::server::Server;

/// `seconds` of the ARCTIC clip looped, as a 16 kHz mono 16-bit WAV.
fn speech_wav(seconds: usize) -> Vec<u8> {
    let one = lipsync::media::audio::load(&media("arctic_a0007_1s.wav"), 60.0)
        .unwrap()
        .samples;
    let mut out = std::io::Cursor::new(Vec::new());
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 16_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::new(&mut out, spec).unwrap();
    for s in one.iter().cycle().take(16_000 * seconds) {
        w.write_sample((s * 32_767.0).round() as i16).unwrap();
    }
    w.finalize().unwrap();
    out.into_inner()
}

/// The video's frames as 8-bit gray at `w`×`h`.
fn gray_frames(path: &std::path::Path, w: usize, h: usize) -> Vec<Vec<u8>> {
    let out = Command::new("ffmpeg")
        .args(["-v", "error", "-i"])
        .arg(path)
        .args(["-f", "rawvideo", "-pix_fmt", "gray", "pipe:"])
        .output()
        .unwrap();
    assert!(out.status.success());
    out.stdout.chunks_exact(w * h).map(<[u8]>::to_vec).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_echo_server_without_a_checkpoint_renders_40_s_with_a_moving_mouth() {
    // The GPU's batch sizes, as echo stands in for a GPU (the tests' defaults are smaller).
    let s = Server::start_echo(&["--max-batch", "512", "--first-batch", "16"]);
    s.wait_ready().await;
    let info = s.info().await;
    assert_eq!(info["device"], "echo", "{info}");
    assert_eq!(info["checkpoint"], serde_json::Value::Null, "{info}");
    assert_eq!(info["conv_path"], "echo", "{info}");
    assert_eq!(info["instances"], 3, "{info}");
    assert_eq!(info["max_batch"], 512, "{info}");
    assert!(
        s.log().iter().any(|l| l.contains("no faces are generated")),
        "{:?}",
        s.log()
    );

    let form = reqwest::multipart::Form::new()
        .part(
            "audio",
            reqwest::multipart::Part::bytes(speech_wav(40)).file_name("speech.wav"),
        )
        .part(
            "image",
            reqwest::multipart::Part::bytes(media("astronaut.png")).file_name("astronaut.png"),
        );
    let r = reqwest::Client::new()
        .post(s.url("/v1/lipsync"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body = r.bytes().await.unwrap();
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), &body).unwrap();
    assert_eq!(common::server::codecs(&body), "h264,aac");
    assert_eq!(common::server::decoded_frames(&body), 1000);

    // The mouth moves: consecutive frames differ, and only in one small region: the photo
    // stays still (pixels that change in more than a tenth of the frames lie in the lower
    // face; elsewhere only the encoder's noise flickers now and then).
    let frames = gray_frames(file.path(), 512, 512);
    assert_eq!(frames.len(), 1000);
    // How often each pixel changes between consecutive frames.
    let mut changed = vec![0u32; 512 * 512];
    let mut moving = 0;
    for pair in frames.windows(2) {
        let mut differs = 0;
        for (i, (a, b)) in pair[0].iter().zip(&pair[1]).enumerate() {
            if a.abs_diff(*b) > 12 {
                changed[i] += 1;
                differs += 1;
            }
        }
        if differs > 50 {
            moving += 1;
        }
    }
    assert!(
        moving >= 900,
        "{moving} of 999 frames differ from the one before"
    );
    let (mut x0, mut y0, mut x1, mut y1) = (512, 512, 0, 0);
    for (i, _) in changed.iter().enumerate().filter(|(_, c)| **c > 100) {
        let (x, y) = (i % 512, i / 512);
        (x0, y0, x1, y1) = (x0.min(x), y0.min(y), x1.max(x), y1.max(y));
    }
    let area = (x1 + 1 - x0) * (y1 + 1 - y0);
    assert!(
        area > 0 && area < 512 * 512 / 8,
        "changes within x {x0}..={x1}, y {y0}..={y1}"
    );
}

#[test]
fn without_a_checkpoint_only_echo_starts() {
    let out = Command::new(env!("CARGO_BIN_EXE_lipsync"))
        .args(["serve", "--device", "cpu", "--port", "0"])
        .env_remove("LIPSYNC_CHECKPOINT")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--checkpoint") && err.contains("--device echo"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_lipsync"))
        .args(["render", "--device", "cpu", "--audio"])
        .arg(common::media_path("arctic_a0007_1s.wav"))
        .arg("--image")
        .arg(common::media_path("astronaut.png"))
        .args(["--out", "/nonexistent/out.mp4"])
        .env_remove("LIPSYNC_CHECKPOINT")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--checkpoint"), "{err}");
}
