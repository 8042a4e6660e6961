//! The service under faults and hostile clients, over a real loopback socket: admission that a
//! long request cannot monopolise, refusals that reach the client, stalled uploads, panics in
//! a request's job and in a model instance (injected through the test build's fault hook,
//! `LIPSYNC_TEST_FAULTS`), and `render` on the same engine as the service.
//!
//! The servers run on the echo device (the model stand-in that costs nothing: these tests are
//! about admission, HTTP, the job and the instance's supervision, whose faults are injected
//! in code echo shares) with the CPU server's engine settings, slowed where a request must
//! still be running ([`SLOW`]); `render`'s half-precision recompute runs the model.

mod common;

use common::media;
use common::server::{decoded_frames, lipsync_form, multipart_body, Server};

use std::io::{Read, Write};
use std::process::Command;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use reqwest::multipart::{Form, Part};

/// `seconds` of speech: the ARCTIC clip repeated, as 16 kHz WAV.
fn long_speech(seconds: f64) -> Vec<u8> {
    let clip = lipsync::media::audio::load(&media("arctic_a0007.wav"), 60.0)
        .unwrap()
        .samples;
    let n = (seconds * 16_000.0) as usize;
    let samples: Vec<f32> = clip.iter().copied().cycle().take(n).collect();
    common::wav(&samples, 16_000, 1)
}

/// Every batch of the echo device stalled by 200 ms (at most 8 frames: 40 frames/s or
/// fewer), so a long request keeps streaming (and holds its slot) for seconds, as on the CPU
/// model.
const SLOW: &[(&str, &str)] = &[("LIPSYNC_TEST_FAULTS", "batch_delay_ms:200")];

/// The test build's fault hook set to `faults`.
fn faults(faults: &str) -> [(&str, &str); 1] {
    [("LIPSYNC_TEST_FAULTS", faults)]
}

fn form(audio: Vec<u8>) -> Form {
    Form::new()
        .part("audio", Part::bytes(audio).file_name("speech.wav"))
        .part(
            "image",
            Part::bytes(media("astronaut.png")).file_name("a.png"),
        )
}

#[tokio::test(flavor = "multi_thread")]
async fn short_requests_are_served_while_a_long_one_streams() {
    // The long request (500 frames) is far over the queue bound (40); it counts only its
    // look-ahead (16), so short requests (22 frames) are still admitted beside it.
    let s = Server::start_echo_as_cpu(
        &["--max-queue-frames", "40", "--max-ahead-frames", "16"],
        SLOW,
    );
    s.wait_ready().await;
    let client = reqwest::Client::new();
    let long = client
        .post(s.url("/v1/lipsync"))
        .multipart(form(long_speech(20.0)))
        .send()
        .await
        .unwrap();
    assert_eq!(long.status(), 200);
    let mut long_body = long.bytes_stream();
    long_body.next().await.unwrap().unwrap();
    for _ in 0..2 {
        let short = client
            .post(s.url("/v1/lipsync"))
            .multipart(lipsync_form("arctic_a0007_1s.wav", "astronaut.png"))
            .send()
            .await
            .unwrap();
        assert_eq!(short.status(), 200, "a short request was refused");
        assert_eq!(decoded_frames(&short.bytes().await.unwrap()), 25);
    }
    // The long one was still streaming all along.
    assert!(long_body.next().await.unwrap().is_ok());
    assert!(s.metric("lipsync_queue_frames").await > 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_panic_in_a_requests_job_aborts_its_stream_instead_of_ending_it_cleanly() {
    let s = Server::start_echo_as_cpu(&[], &faults("job_panic:5"));
    s.wait_ready().await;
    let r = s.post_short().await;
    assert_eq!(r.status(), 200);
    // The body ends with an error (no final chunk), never as a short "complete" MP4.
    assert!(r.bytes().await.is_err(), "a cut-off video looked complete");
    // Counted as failed once the job thread has finished; its frames are gone from the queue.
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.metric("lipsync_requests_total{outcome=\"failed\"}").await != 1.0 {
        assert!(Instant::now() < deadline, "the failure was not counted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(s.metric("lipsync_queue_frames").await, 0.0);
    // The server goes on serving.
    let r = s.post_short().await;
    assert_eq!(decoded_frames(&r.bytes().await.unwrap()), 25);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_panicking_instance_fails_its_requests_and_is_restarted() {
    // The instance panics in the third batch it serves.
    let s = Server::start_echo_as_cpu(&[], &faults("instance_panic:3"));
    s.wait_ready().await;
    let r = s.post_short().await;
    assert_eq!(r.status(), 200);
    // Within a bounded time the stream is aborted: its frames failed, nothing waits forever.
    let body = tokio::time::timeout(Duration::from_secs(60), r.bytes())
        .await
        .expect("the request hung after its instance panicked");
    assert!(body.is_err(), "a cut-off video looked complete");
    // The instance is restarted; the service is ready again and serves.
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.metric("lipsync_instance_restarts_total").await < 1.0 {
        assert!(Instant::now() < deadline, "the instance was not restarted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.wait_ready().await;
    let r = s.post_short().await;
    assert_eq!(decoded_frames(&r.bytes().await.unwrap()), 25);
    let info: serde_json::Value = reqwest::get(s.url("/info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["instance_restarts"], 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refusal_before_the_body_is_read_reaches_the_client_and_closes_the_connection() {
    let s = Server::start_echo_as_cpu(&["--max-requests", "1"], SLOW);
    s.wait_ready().await;
    let client = reqwest::Client::new();
    // Hold the only slot with a long stream.
    let held = client
        .post(s.url("/v1/lipsync"))
        .multipart(form(long_speech(10.0)))
        .send()
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    // A raw client uploads a body of 2 MB: the 429 comes after the body is drained, with
    // `Connection: close`, not as a reset in the middle of the upload.
    let boundary = "xyzzy";
    let body = multipart_body(
        boundary,
        &[
            ("audio", &vec![1u8; 2 << 20]),
            ("image", &media("astronaut.png")),
        ],
        &[],
    );
    let addr = s.base.trim_start_matches("http://").to_string();
    let answer = tokio::task::spawn_blocking(move || {
        let mut sock = std::net::TcpStream::connect(addr).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            sock,
            "POST /v1/lipsync HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .unwrap();
        sock.write_all(&body).unwrap();
        let mut answer = String::new();
        sock.read_to_string(&mut answer).unwrap();
        answer
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    let lower = answer.to_ascii_lowercase();
    assert!(lower.contains("connection: close"), "{answer}");
    assert!(lower.contains("retry-after:"), "{answer}");
    assert!(answer.contains("\"error_type\":\"overloaded\""), "{answer}");
    drop(held);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upload_that_stalls_gets_408_after_the_read_timeout() {
    let s = Server::start_echo(&["--read-timeout", "1"]);
    s.wait_ready().await;
    let addr = s.base.trim_start_matches("http://").to_string();
    let started = Instant::now();
    let answer = tokio::task::spawn_blocking(move || {
        let mut sock = std::net::TcpStream::connect(addr).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        write!(
            sock,
            "POST /v1/lipsync HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000\r\n\r\n--b\r\nContent-Disposition: form-data; name=\"audio\"; filename=\"a.wav\"\r\n\r\nRIFF"
        )
        .unwrap();
        // ...and nothing more.
        let mut buf = [0u8; 4096];
        let n = sock.read(&mut buf).unwrap_or(0);
        String::from_utf8_lossy(&buf[..n]).to_string()
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("\"error_type\":\"read_timeout\""),
        "{answer}"
    );
    assert!(started.elapsed() < Duration::from_secs(15));
    // The slot it held is free again.
    let r = s.post_short().await;
    assert_eq!(r.status(), 200);
}

#[test]
fn render_recomputes_non_finite_half_precision_batches_like_the_service() {
    let dir = tempfile::tempdir().unwrap();
    let ck = common::overflowing_checkpoint(dir.path());
    // 0.4 s of speech (7 model frames): f16 convolutions are slow on the CPU.
    let clip = lipsync::media::audio::load(&media("arctic_a0007.wav"), 60.0)
        .unwrap()
        .samples;
    let wav = dir.path().join("a.wav");
    std::fs::write(&wav, common::wav(&clip[16_000..22_400], 16_000, 1)).unwrap();
    let render = |dtype: &str| {
        let faces = dir.path().join(format!("faces-{dtype}"));
        let out = dir.path().join(format!("{dtype}.mp4"));
        let st = Command::new(env!("CARGO_BIN_EXE_lipsync"))
            .args(["render", "--checkpoint"])
            .arg(&ck)
            .arg("--audio")
            .arg(&wav)
            .arg("--image")
            .arg(common::media_path("astronaut.png"))
            .args(["--dtype", dtype, "--batch", "4", "--out"])
            .arg(&out)
            .arg("--faces-dir")
            .arg(&faces)
            .status()
            .unwrap();
        assert!(st.success());
        assert_eq!(decoded_frames(&std::fs::read(&out).unwrap()), 10);
        let mut names: Vec<_> = std::fs::read_dir(&faces)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        names.sort();
        names
            .iter()
            .map(|p| image::open(p).unwrap().to_rgb8().into_raw())
            .collect::<Vec<_>>()
    };
    let half = render("f16");
    let full = render("f32");
    assert_eq!(half.len(), 7);
    // Without the recompute the f16 faces are NaN, written as black; with it, the f16 run
    // draws what f32 draws (the same f32 computation on the same batches: within one level).
    for (h, f) in half.iter().zip(&full) {
        let diff: u64 = h
            .iter()
            .zip(f)
            .map(|(a, b)| u64::from(a.abs_diff(*b)))
            .sum();
        assert!(diff as f64 / h.len() as f64 <= 1.0);
        assert!(f.iter().any(|&v| v != 0), "the f32 faces are black");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_that_fails_before_its_first_frame_leaves_no_work_behind() {
    // An ffmpeg that passes the start-up check but dies at once when asked to encode.
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("ffmpeg");
    std::fs::write(
        &fake,
        "#!/bin/sh\ncase \"$*\" in *-encoders*) exec ffmpeg \"$@\";; esac\nexit 1\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let s = Server::start_echo_as_cpu(&["--ffmpeg", &fake.display().to_string()], &[]);
    s.wait_ready().await;
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let r = client
            .post(s.url("/v1/lipsync"))
            .multipart(form(long_speech(4.0)))
            .send()
            .await
            .unwrap();
        if r.status() == 200 {
            assert!(r.bytes().await.is_err(), "a failed video looked complete");
        } else {
            assert_eq!(r.status(), 500);
        }
    }
    // Every admitted frame was taken back: nothing stays queued, no slot stays taken.
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.metric("lipsync_queue_frames").await != 0.0 {
        assert!(Instant::now() < deadline, "frames were left in the queue");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let info: serde_json::Value = reqwest::get(s.url("/info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["requests_in_flight"], 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn every_log_line_of_a_request_carries_its_request_id() {
    let s = Server::start_echo(&[]);
    s.wait_ready().await;
    let r = reqwest::Client::new()
        .post(s.url("/v1/lipsync"))
        .header("x-request-id", "trace-me-4711")
        .multipart(lipsync_form("arctic_a0007_1s.wav", "astronaut.png"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-request-id"], "trace-me-4711");
    assert_eq!(decoded_frames(&r.bytes().await.unwrap()), 25);
    // The job thread's summary line (written after the body ends) carries the id too.
    let deadline = Instant::now() + Duration::from_secs(20);
    let done = loop {
        if let Some(l) = s.log().into_iter().find(|l| l.contains("s of speech")) {
            break l;
        }
        assert!(Instant::now() < deadline, "no summary line: {:?}", s.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(done.contains("trace-me-4711"), "{done}");
}
