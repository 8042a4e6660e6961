//! The service over a real loopback socket, as a client uses it: `lipsync serve` started as a
//! process, driven with HTTP. Needs ffmpeg and ffprobe (scripts/test.sh).
//!
//! Tests of the media and HTTP side run on the echo device (the model stand-in that costs
//! nothing) with the CPU server's engine settings (`Server::start_echo_as_cpu`), slowed where
//! they need a model that is still working (the test build's fault hook `batch_delay_ms`,
//! [`SLOW`]: every batch stalls that long, near the CPU model's pace); those of the model
//! (/info's checkpoint fields, half precision's recompute) run the test weights on the CPU.

mod common;

use common::media;
use common::server::{decoded_frames, lipsync_form, multipart_body, Server};

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use reqwest::multipart::{Form, Part};

/// Every batch of the echo device stalled by 200 ms (at most 8 frames: 40 frames/s or fewer,
/// the CPU model's test weights draw about 18), so a request's model work lasts seconds, as
/// on the CPU model, and can be caught queued, running or mid-stream.
const SLOW: &[(&str, &str)] = &[("LIPSYNC_TEST_FAULTS", "batch_delay_ms:200")];

#[tokio::test(flavor = "multi_thread")]
async fn the_video_streams_and_its_first_fragment_arrives_before_the_last_frame_is_computed() {
    // Two encoder workers (segments encoded in parallel, joined in order): the stream must
    // look exactly like the single encoder's. (The other tests use one, the CPU default.)
    let s = Server::start_echo_as_cpu(&["--encoder-workers", "2"], SLOW);
    // The server answers before the model is ready.
    let health = reqwest::get(s.url("/health")).await.unwrap();
    assert_eq!(health.status(), 200);
    s.wait_ready().await;

    let client = reqwest::Client::new();
    let res = client
        .post(s.url("/v1/lipsync"))
        .header("x-request-id", "test-stream-1")
        .multipart(lipsync_form("arctic_a0007.wav", "astronaut.png"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["content-type"], "video/mp4");
    assert_eq!(res.headers()["x-request-id"], "test-stream-1");
    assert_eq!(res.headers()["transfer-encoding"], "chunked");
    let mut body = res.bytes_stream();
    let mut bytes = Vec::new();
    let mut first_fragment = None;
    while let Some(chunk) = body.next().await {
        bytes.extend_from_slice(&chunk.unwrap());
        let b = common::top_level_boxes(&bytes);
        if first_fragment.is_none()
            && b.iter().any(|x| x == "moof")
            && b.iter().any(|x| x == "mdat")
        {
            // The first fragment (holding frame 0) is here: the model is still working.
            let computed = s.metric("lipsync_frames_total").await;
            first_fragment = Some((bytes.len(), computed));
            assert!(
                computed < 97.0,
                "all {computed} frames were computed before the first fragment"
            );
            // What has arrived so far already decodes.
            assert!(decoded_frames(&bytes) >= 1);
        }
    }
    assert!(first_fragment.is_some(), "no fragment ever arrived");
    assert_eq!(common::server::codecs(&bytes), "h264,aac");
    assert_eq!(decoded_frames(&bytes), 100);
    let m = s.metrics().await;
    assert!(
        m.contains("lipsync_requests_total{outcome=\"success\"} 1"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_requests_share_batches() {
    let s = Server::start_echo_as_cpu(&[], SLOW);
    s.wait_ready().await;
    let client = reqwest::Client::new();
    let one = || {
        let c = client.clone();
        let url = s.url("/v1/lipsync");
        async move {
            let r = c
                .post(url)
                .multipart(lipsync_form("arctic_a0007_1s.wav", "astronaut.png"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.bytes().await.unwrap()
        }
    };
    let (a, b) = tokio::join!(one(), one());
    assert_eq!(decoded_frames(&a), 25);
    assert_eq!(decoded_frames(&b), 25);
    let batches = s.metric("lipsync_batch_requests_count").await;
    let single = s.metric("lipsync_batch_requests_bucket{le=\"1\"}").await;
    assert!(
        single < batches,
        "no batch held frames of both requests ({single} of {batches} single)"
    );
    assert_eq!(s.metric("lipsync_frames_total").await, 44.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn overload_is_refused_with_429_and_retry_after() {
    let s = Server::start_echo_as_cpu(&["--max-queue-frames", "30"], SLOW);
    s.wait_ready().await;
    let client = reqwest::Client::new();
    // 97 frames fill the queue (a request larger than the bound still runs alone)...
    let first = client
        .post(s.url("/v1/lipsync"))
        .multipart(lipsync_form("arctic_a0007.wav", "astronaut.png"))
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    // ...so the next is refused up front.
    let second = client
        .post(s.url("/v1/lipsync"))
        .multipart(lipsync_form("arctic_a0007_1s.wav", "astronaut.png"))
        .send()
        .await
        .unwrap();
    assert_eq!(second.status(), 429);
    let retry: u64 = second.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1);
    let e: serde_json::Value = second.json().await.unwrap();
    assert_eq!(e["error_type"], "overloaded");
    drop(first);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_disconnects_frees_its_queued_work() {
    let s = Server::start_echo_as_cpu(&[], SLOW);
    s.wait_ready().await;
    let res = reqwest::Client::new()
        .post(s.url("/v1/lipsync"))
        .multipart(lipsync_form("arctic_a0007.wav", "astronaut.png"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let mut body = res.bytes_stream();
    body.next().await.unwrap().unwrap();
    drop(body); // hang up mid-stream
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = s.metrics().await;
        if m.contains("lipsync_requests_total{outcome=\"cancelled\"} 1") {
            break;
        }
        assert!(Instant::now() < deadline, "the server never noticed: {m}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(s.metric("lipsync_dropped_frames_total").await > 0.0);
    assert_eq!(s.metric("lipsync_queue_frames").await, 0.0);
    assert!(s.metric("lipsync_frames_total").await < 97.0);
    // The server is still there and serves the next request.
    let r = reqwest::Client::new()
        .post(s.url("/v1/lipsync"))
        .multipart(lipsync_form("arctic_a0007_1s.wav", "astronaut.png"))
        .send()
        .await
        .unwrap();
    assert_eq!(decoded_frames(&r.bytes().await.unwrap()), 25);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slow_reader_holds_back_its_own_work_instead_of_growing_memory() {
    use std::io::{Read, Write};
    // (One encoder process, the CPU default; tests/video.rs checks that the segmented
    // encoder passes backpressure on too.) On echo, unslowed: the model runs ahead as fast as
    // backpressure lets it.
    let s = Server::start_echo_as_cpu(&["--max-ahead-frames", "8"], &[]);
    s.wait_ready().await;
    let rss_before = s.metric("process_resident_memory_bytes").await;
    // A client with a tiny receive window that stops reading after the first bytes (a stalled
    // mobile client), and a large lossless video: a 1920x1920 photo gives about 7 MB, more
    // than the buffers on the way (pipes, channel, a socket's 4 MB at most) hold.
    let big =
        image::open(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/media/astronaut.png"))
            .unwrap()
            .resize_exact(1920, 1920, image::imageops::FilterType::Triangle);
    let mut png = std::io::Cursor::new(Vec::new());
    big.write_to(&mut png, image::ImageFormat::Png).unwrap();
    let png = png.into_inner();
    let addr: std::net::SocketAddr = s.base.trim_start_matches("http://").parse().unwrap();
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    sock.connect(&addr.into()).unwrap();
    let mut tcp: std::net::TcpStream = sock.into();
    // 8 s of speech (the clip twice): 197 model frames.
    let clip = lipsync::media::audio::load(&media("arctic_a0007.wav"), 60.0)
        .unwrap()
        .samples;
    let speech = common::wav(&[clip.as_slice(), clip.as_slice()].concat(), 16_000, 1);
    let body = multipart_body(
        "XyZbOuNdArY",
        &[("audio", &speech), ("image", &png)],
        &[("crf", "0")],
    );
    let head = format!(
        "POST /v1/lipsync HTTP/1.1\r\nHost: {addr}\r\nContent-Type: multipart/form-data; boundary=XyZbOuNdArY\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).unwrap();
    tcp.write_all(&body).unwrap();
    let mut raw = vec![0u8; 16 << 10];
    tcp.read_exact(&mut raw).unwrap();
    assert!(
        raw.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&raw[..64])
    );

    // Stop reading. Once the buffers between encoder and client are full (ffmpeg also holds
    // the current one-second fragment until it is complete), the model work stalls.
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut previous = -1.0;
    let stalled = loop {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let now = s.metric("lipsync_frames_total").await;
        if now == previous {
            break now;
        }
        assert!(
            Instant::now() < deadline,
            "work never stalled without a reader ({now} frames)"
        );
        previous = now;
    };
    eprintln!("stalled at {stalled} of 197 frames");
    assert!(
        stalled < 160.0,
        "{stalled} frames computed for a client that is not reading"
    );
    let rss = s.metric("process_resident_memory_bytes").await;
    assert!(
        rss < rss_before + 300e6,
        "memory grew from {rss_before} to {rss}"
    );

    // Hanging up releases the stalled work.
    drop(tcp);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !s
        .metrics()
        .await
        .contains("lipsync_requests_total{outcome=\"cancelled\"} 1")
    {
        assert!(
            Instant::now() < deadline,
            "the stalled request was never cancelled"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(s.metric("lipsync_dropped_frames_total").await > 0.0);
    assert_eq!(s.metric("lipsync_queue_frames").await, 0.0);
}

/// 0.1 s of silence: less than one 16-column mel window.
fn short_wav() -> Vec<u8> {
    common::wav(&[0.0; 1600], 16_000, 1)
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_inputs_get_the_right_4xx_and_the_server_stays_up() {
    let s = Server::start_echo(&[
        "--max-audio-seconds",
        "3",
        "--max-pixels",
        "300000",
        "--max-body-bytes",
        "2000000",
    ]);
    s.wait_ready().await;
    let client = reqwest::Client::new();
    let gray = {
        let mut out = std::io::Cursor::new(Vec::new());
        image::RgbImage::from_pixel(200, 200, image::Rgb([120, 120, 120]))
            .write_to(&mut out, image::ImageFormat::Png)
            .unwrap();
        out.into_inner()
    };
    let part = |name: &str, b: Vec<u8>| Part::bytes(b).file_name(name.to_string());
    let cases: Vec<(&str, Form, u16, &str)> = vec![
        (
            "audio sent as the image",
            Form::new()
                .part("audio", part("a", media("astronaut.png")))
                .part("image", part("i", media("astronaut.png"))),
            415,
            "not_audio",
        ),
        (
            "image sent as the audio",
            Form::new()
                .part("audio", part("a", media("arctic_a0007_1s.wav")))
                .part("image", part("i", media("arctic_a0007_1s.wav"))),
            415,
            "not_an_image",
        ),
        (
            "no audio",
            Form::new().part("image", part("i", media("astronaut.png"))),
            400,
            "missing_field",
        ),
        (
            "no image",
            Form::new().part("audio", part("a", media("arctic_a0007_1s.wav"))),
            400,
            "missing_field",
        ),
        (
            "unknown field",
            lipsync_form("arctic_a0007_1s.wav", "astronaut.png").text("color", "red"),
            400,
            "unknown_field",
        ),
        (
            "bad box",
            lipsync_form("arctic_a0007_1s.wav", "astronaut.png").text("box", "1,2,3"),
            400,
            "bad_field",
        ),
        (
            "box outside",
            lipsync_form("arctic_a0007_1s.wav", "astronaut.png").text("box", "400,400,600,600"),
            400,
            "bad_box",
        ),
        (
            "bad fps",
            lipsync_form("arctic_a0007_1s.wav", "astronaut.png").text("fps", "90"),
            400,
            "bad_field",
        ),
        (
            "bad blend",
            lipsync_form("arctic_a0007_1s.wav", "astronaut.png").text("blend", "soft"),
            400,
            "bad_field",
        ),
        (
            "bad crf",
            lipsync_form("arctic_a0007_1s.wav", "astronaut.png").text("crf", "99"),
            400,
            "bad_field",
        ),
        (
            "no face",
            Form::new()
                .part("audio", part("a", media("arctic_a0007_1s.wav")))
                .part("image", part("i", gray)),
            422,
            "no_face",
        ),
        (
            "too short",
            Form::new()
                .part("audio", part("a", short_wav()))
                .part("image", part("i", media("astronaut.png"))),
            422,
            "audio_too_short",
        ),
        (
            "truncated audio",
            Form::new()
                .part(
                    "audio",
                    part("a", media("arctic_a0007_1s.wav")[..3000].to_vec()),
                )
                .part("image", part("i", media("astronaut.png"))),
            400,
            "truncated_audio",
        ),
        (
            "too long",
            lipsync_form("arctic_a0007.wav", "astronaut.png"),
            413,
            "audio_too_long",
        ),
        (
            "too many pixels",
            Form::new()
                .part("audio", part("a", media("arctic_a0007_1s.wav")))
                .part("image", part("i", media("grace_hopper.jpg"))),
            413,
            "image_too_large",
        ),
        (
            "body too large",
            Form::new()
                .part("audio", part("a", vec![0u8; 3_000_000]))
                .part("image", part("i", media("astronaut.png"))),
            413,
            "body_too_large",
        ),
        (
            "unknown avatar",
            Form::new()
                .part("audio", part("a", media("arctic_a0007_1s.wav")))
                .text("avatar_id", "0".repeat(64)),
            404,
            "avatar_not_found",
        ),
        (
            "empty audio",
            Form::new()
                .part("audio", part("a", vec![]))
                .part("image", part("i", media("astronaut.png"))),
            400,
            "empty_audio",
        ),
    ];
    for (what, form, status, kind) in cases {
        let r = client
            .post(s.url("/v1/lipsync"))
            .multipart(form)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status, "{what}");
        assert!(r.headers().contains_key("x-request-id"), "{what}");
        let e: serde_json::Value = r.json().await.unwrap();
        assert_eq!(e["error_type"], kind, "{what}: {e}");
        assert!(e["error"].as_str().is_some_and(|m| !m.is_empty()), "{what}");
        assert_eq!(e.as_object().unwrap().len(), 2, "{what}: {e}");
    }
    let r = client
        .post(s.url("/v1/lipsync"))
        .body("not a form")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let r = reqwest::get(s.url("/v1/nothing")).await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap()["error_type"],
        "not_found"
    );
    let r = client.delete(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    // Still up, and the refusals are counted.
    assert_eq!(reqwest::get(s.url("/ready")).await.unwrap().status(), 200);
    assert!(
        s.metric("lipsync_requests_total{outcome=\"client_error\"}")
            .await
            >= 18.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn avatars_are_made_once_and_reused() {
    let s = Server::start_echo(&["--avatar-cache-entries", "2"]);
    s.wait_ready().await;
    let client = reqwest::Client::new();
    let make = || {
        Form::new().part(
            "image",
            Part::bytes(media("astronaut.png")).file_name("a.png"),
        )
    };
    let r = client
        .post(s.url("/v1/avatars"))
        .multipart(make())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let a: serde_json::Value = r.json().await.unwrap();
    let id = a["id"].as_str().unwrap().to_string();
    assert_eq!(id.len(), 64);
    assert_eq!(
        (a["width"].as_u64(), a["height"].as_u64()),
        (Some(512), Some(512))
    );
    assert_eq!(a["box"].as_array().unwrap().len(), 4);
    let r = client
        .post(s.url("/v1/avatars"))
        .multipart(make())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<serde_json::Value>().await.unwrap(), a);
    // A pinned box is another avatar.
    let pinned = make().text("box", "180,90,270,187");
    let r = client
        .post(s.url("/v1/avatars"))
        .multipart(pinned)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let b: serde_json::Value = r.json().await.unwrap();
    assert_eq!(b["box"], serde_json::json!([180, 90, 270, 187]));
    assert_ne!(b["id"], a["id"]);

    let got: serde_json::Value = reqwest::get(s.url(&format!("/v1/avatars/{id}")))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(got, a);
    let form = Form::new()
        .part(
            "audio",
            Part::bytes(media("arctic_a0007_1s.wav")).file_name("a.wav"),
        )
        .text("avatar_id", id.clone());
    let r = client
        .post(s.url("/v1/lipsync"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(decoded_frames(&r.bytes().await.unwrap()), 25);
    let with_box = Form::new()
        .part(
            "audio",
            Part::bytes(media("arctic_a0007_1s.wav")).file_name("a.wav"),
        )
        .text("avatar_id", id.clone())
        .text("box", "1,2,3,4");
    let r = client
        .post(s.url("/v1/lipsync"))
        .multipart(with_box)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(s.metric("lipsync_avatar_cache_hits_total").await >= 2.0);
    assert!(s.metric("lipsync_avatar_cache_bytes").await > 0.0);

    let r = client
        .delete(s.url(&format!("/v1/avatars/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let r = reqwest::get(s.url(&format!("/v1/avatars/{id}")))
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap()["error_type"],
        "avatar_not_found"
    );
    let r = client
        .delete(s.url(&format!("/v1/avatars/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    // Without a detector or given landmarks, the five points are placed in the box: eyes,
    // then nose, then mouth, left before right, all inside it.
    assert_eq!(b["landmarks_source"], "box");
    let points: Vec<f64> = serde_json::from_value(b["landmarks"].clone()).unwrap();
    assert_eq!(points.len(), 10);
    for p in points.chunks(2) {
        assert!(
            (180.0..270.0).contains(&p[0]) && (90.0..187.0).contains(&p[1]),
            "{points:?}"
        );
    }
    assert!(points[0] < points[2] && points[6] < points[8], "{points:?}");
    assert!(points[1] < points[5] && points[5] < points[7], "{points:?}");
    assert_eq!(a["landmarks_source"], "box");
    // Landmarks given are the avatar's own: another id, reported as given.
    let given = "202.8,101.7,245.3,103.3,225,128.3,203.7,140,245.3,141.7";
    let r = client
        .post(s.url("/v1/avatars"))
        .multipart(make().text("landmarks", given))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let c: serde_json::Value = r.json().await.unwrap();
    assert_eq!(c["landmarks_source"], "client");
    assert_eq!(
        c["landmarks"],
        serde_json::json!([202.8, 101.7, 245.3, 103.3, 225.0, 128.3, 203.7, 140.0, 245.3, 141.7])
    );
    assert_eq!(c["box"], a["box"]);
    assert_ne!(c["id"], a["id"]);
    for (bad, error_type) in [
        ("202.8,101.7,245.3", "bad_field"),
        (
            "202.8,101.7,645.3,103.3,225,128.3,203.7,140,245.3,141.7",
            "bad_landmarks",
        ),
    ] {
        let r = client
            .post(s.url("/v1/avatars"))
            .multipart(make().text("landmarks", bad))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{bad}");
        let e: serde_json::Value = r.json().await.unwrap();
        assert_eq!(e["error_type"], error_type, "{e}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn api_key_and_cors() {
    let s = Server::start_echo(&[
        "--api-key",
        "s3cret",
        "--cors-origins",
        "https://app.example",
    ]);
    let client = reqwest::Client::new();
    let r = client.post(s.url("/v1/lipsync")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    assert_eq!(
        r.json::<serde_json::Value>().await.unwrap()["error_type"],
        "unauthorized"
    );
    let r = reqwest::get(s.url("/v1/avatars/x")).await.unwrap();
    assert_eq!(r.status(), 401);
    let r = client
        .get(s.url("/v1/avatars/x"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = client
        .get(s.url("/v1/avatars/x"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    for open in ["/health", "/info", "/metrics", "/openapi.yaml"] {
        assert_eq!(
            reqwest::get(s.url(open)).await.unwrap().status(),
            200,
            "{open}"
        );
    }
    let preflight = |origin: &'static str| {
        client
            .request(reqwest::Method::OPTIONS, s.url("/v1/lipsync"))
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .send()
    };
    let r = preflight("https://app.example").await.unwrap();
    assert_eq!(
        r.headers()["access-control-allow-origin"],
        "https://app.example"
    );
    let r = preflight("https://evil.example").await.unwrap();
    assert!(!r.headers().contains_key("access-control-allow-origin"));
    // A page on an allowed origin can read the request id and the video's frame count.
    let r = client
        .get(s.url("/health"))
        .header("origin", "https://app.example")
        .send()
        .await
        .unwrap();
    let exposed = r.headers()["access-control-expose-headers"]
        .to_str()
        .unwrap()
        .to_ascii_lowercase();
    assert!(
        exposed.contains("x-request-id") && exposed.contains("x-video-frames"),
        "{exposed}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn ready_info_metrics_and_openapi() {
    // On the CPU model: /info describes the checkpoint and the path the model runs.
    let s = Server::start(&[]);
    let early = reqwest::get(s.url("/ready")).await.unwrap();
    if early.status() != 200 {
        assert_eq!(early.status(), 503);
        assert_eq!(
            early.json::<serde_json::Value>().await.unwrap()["error_type"],
            "not_ready"
        );
    }
    s.wait_ready().await;
    let info: serde_json::Value = reqwest::get(s.url("/info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["device"], "cpu");
    assert_eq!(info["dtype"], "f32");
    assert_eq!(info["format"], "zip-torch-save");
    assert_eq!(info["folded"], false);
    assert_eq!(info["sessions"]["utterance_gap_ms"], 300);
    assert!(info["sessions"]["max_sessions"]
        .as_u64()
        .is_some_and(|n| n >= 1));
    assert_eq!(
        (info["instances"].as_u64(), info["instances_ready"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(
        (info["max_batch"].as_u64(), info["first_batch"].as_u64()),
        (Some(8), Some(2))
    );
    assert_eq!(info["limits"]["max_audio_seconds"], 600.0);
    assert_eq!(
        info["encoder"]["workers"], 1,
        "one encoder process per stream on CPU"
    );
    // f32 on the CPU runs the own CPU pass; no cuDNN cache without CUDA.
    assert_eq!(info["conv_path"], "cpu");
    assert!(info["autotune_cache"].is_null());
    let m = s.metrics().await;
    for name in [
        "lipsync_requests_total",
        "lipsync_frames_total",
        "lipsync_dropped_frames_total",
        "lipsync_queue_frames",
        "lipsync_instances_busy",
        "lipsync_avatar_cache_hits_total",
        "lipsync_avatar_cache_misses_total",
        "lipsync_avatar_cache_bytes",
        "process_resident_memory_bytes",
        "lipsync_stage_duration_seconds",
        "lipsync_batch_frames",
    ] {
        assert!(m.contains(name), "{name} missing from /metrics");
    }
    let r = reqwest::get(s.url("/openapi.yaml")).await.unwrap();
    assert_eq!(r.headers()["content-type"], "application/yaml");
    assert!(r.text().await.unwrap().starts_with("openapi: 3.0"));
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_the_stream_in_flight_finish() {
    // Slowed: the stream is still being computed when SIGTERM comes.
    let mut s = Server::start_echo_as_cpu(&[], SLOW);
    s.wait_ready().await;
    let res = reqwest::Client::new()
        .post(s.url("/v1/lipsync"))
        .multipart(lipsync_form("arctic_a0007_1s.wav", "astronaut.png"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let status = Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let bytes = res.bytes().await.unwrap();
    assert_eq!(decoded_frames(&bytes), 25);
    // New connections are refused once it is shutting down; then it exits cleanly.
    let deadline = Instant::now() + Duration::from_secs(60);
    let exit = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "server did not exit");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(exit.success(), "{exit:?}");
    assert!(reqwest::get(s.url("/health")).await.is_err());
}

#[tokio::test(flavor = "multi_thread")]
async fn out_of_memory_splits_batches_and_the_request_completes() {
    // f32 estimates (src/engine/pool.rs: weights, cuDNN's workspace, 12 MB a frame): a batch
    // of 8 needs ~975 MB, of 4 ~927 MB, of 2 ~903 MB; 870 MiB is 912 MB. The pool checks a
    // batch's estimate against the limit before the model runs, so echo in f32 meets the
    // same limit as the model would.
    let s = Server::start_echo_as_cpu(
        &["--gpu-memory-limit", "870M", "--pad-batches", "true"],
        &[],
    );
    s.wait_ready().await;
    let r = reqwest::Client::new()
        .post(s.url("/v1/lipsync"))
        .multipart(lipsync_form("arctic_a0007_1s.wav", "astronaut.png"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(decoded_frames(&r.bytes().await.unwrap()), 25);
    assert_eq!(s.metric("lipsync_frames_total").await, 22.0);
    let info: serde_json::Value = reqwest::get(s.url("/info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["pad_batches"], true);
    assert_eq!(info["gpu_memory_limit"], 870u64 << 20);
    // No batch larger than 2 ran.
    assert_eq!(
        s.metric("lipsync_batch_frames_bucket{le=\"2\"}").await,
        s.metric("lipsync_batch_frames_count").await
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn half_precision_overflow_is_recomputed_in_f32() {
    // The test weights with the output block's convolution scaled up: in f16 its activations
    // overflow to infinity (the sigmoid's input turns NaN); in f32 they stay finite.
    let dir = tempfile::tempdir().unwrap();
    let path = common::overflowing_checkpoint(dir.path());
    let path = path.display().to_string();
    let s = Server::start_with_checkpoint(
        &path,
        &["--dtype", "f16", "--max-batch", "2", "--first-batch", "2"],
    );
    s.wait_ready().await;
    // 0.4 s of speech (7 model frames): f16 convolutions are slow on the CPU.
    let clip = lipsync::media::audio::load(&media("arctic_a0007.wav"), 60.0)
        .unwrap()
        .samples;
    let speech = common::wav(&clip[16_000..22_400], 16_000, 1);
    let form = Form::new()
        .part("audio", Part::bytes(speech).file_name("a.wav"))
        .part(
            "image",
            Part::bytes(media("astronaut.png")).file_name("a.png"),
        );
    let r = reqwest::Client::new()
        .post(s.url("/v1/lipsync"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(decoded_frames(&r.bytes().await.unwrap()), 10);
    // Caught where it happens (the output convolution's activations), before the NaN.
    assert!(
        s.metric("lipsync_precision_fallbacks_total{reason=\"overflow\"}")
            .await
            >= 1.0
    );
    assert_eq!(
        s.metric("lipsync_precision_fallbacks_total{reason=\"nan\"}")
            .await,
        0.0
    );
    let info: serde_json::Value = reqwest::get(s.url("/info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["compute_dtype"], "f16");
}

/// The ffmpeg processes among `pid`'s children whose command line holds `arg`.
fn children_with_arg(pid: u32, arg: &str) -> usize {
    child_ids_with_arg(pid, arg).len()
}

/// Their process ids, in order.
fn child_ids_with_arg(pid: u32, arg: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut ids: Vec<u32> = dir
        .filter_map(Result::ok)
        .filter(|e| {
            let p = e.path();
            let stat = std::fs::read_to_string(p.join("stat")).unwrap_or_default();
            let ppid = stat
                .rfind(')')
                .and_then(|i| stat[i + 2..].split(' ').nth(1))
                .and_then(|x| x.parse::<u32>().ok());
            let cmdline = std::fs::read(p.join("cmdline")).unwrap_or_default();
            ppid == Some(pid) && cmdline.split(|&b| b == 0).any(|a| a == arg.as_bytes())
        })
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    ids.sort_unstable();
    ids
}

#[tokio::test(flavor = "multi_thread")]
async fn encoder_processes_started_ahead_serve_the_next_requests_with_any_speech() {
    // Two encoder workers: a request starts a muxer and two workers.
    let s = Server::start_echo_as_cpu(&["--encoder-workers", "2"], &[]);
    s.wait_ready().await;
    let id = s.upload_avatar().await;
    let pid = s.child.id();
    let dir = tempfile::tempdir().unwrap();
    let client = reqwest::Client::new();
    // The avatar's upload starts the two workers and the muxer its first request will take.
    let until = Instant::now() + Duration::from_secs(10);
    while (children_with_arg(pid, "flv") < 2 || children_with_arg(pid, "pipe:3") < 1)
        && Instant::now() < until
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ahead = child_ids_with_arg(pid, "flv");
    assert_eq!(ahead.len(), 2, "workers started with the upload");
    let mut workers = Some(ahead);
    let muxer_ahead = child_ids_with_arg(pid, "pipe:3");
    assert_eq!(muxer_ahead.len(), 1, "a muxer started with the upload");
    // WAV, MP3 and FLAC go to ffmpeg through a pipe (`pipe:3`), the processes started ahead;
    // M4A by name (its index may be at the end, which a pipe cannot seek to).
    for (round, audio) in [
        "arctic_a0007.wav",
        "arctic_a0007_44k_stereo.mp3",
        "arctic_a0007_44k_stereo.m4a",
        "arctic_a0007_44k_stereo.flac",
        "arctic_a0007.wav",
    ]
    .into_iter()
    .enumerate()
    {
        let form = Form::new()
            .text("avatar_id", id.clone())
            .part("audio", Part::bytes(media(audio)).file_name(audio));
        let res = client
            .post(s.url("/v1/lipsync"))
            .multipart(form)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{audio}");
        let bytes = res.bytes().await.unwrap();
        let mp4 = dir.path().join(format!("{round}.mp4"));
        std::fs::write(&mp4, &bytes).unwrap();
        let p = common::probe(&mp4);
        // The whole speech (4 s) is in the video, with its 100 frames.
        let a = common::num(&common::stream(&p, "audio")["duration"]);
        let v = common::num(&common::stream(&p, "video")["nb_read_frames"]);
        assert!((a - 4.0).abs() < 0.1, "{audio}: {a} s of audio");
        assert_eq!(v, 100.0, "{audio}");
        // Each request's muxer (speech through the pipe) is replaced, a quarter of a second
        // after the request took it, by one that waits for the next request; the workers
        // (no speech) are the request's own, kept.
        let until = Instant::now() + Duration::from_secs(10);
        while (children_with_arg(pid, "pipe:3") == 0 || children_with_arg(pid, "flv") == 0)
            && Instant::now() < until
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(children_with_arg(pid, "pipe:3"), 1, "after {audio}");
        if round == 0 {
            // The first request took the muxer the upload started: a replacement waits.
            assert_ne!(child_ids_with_arg(pid, "pipe:3"), muxer_ahead, "muxer used");
        }
        // The same two workers serve every request, whatever its speech: those the upload
        // started.
        let ids = child_ids_with_arg(pid, "flv");
        assert_eq!(ids, *workers.get_or_insert(ids.clone()), "after {audio}");
        assert_eq!(ids.len(), 2, "after {audio}");
    }
    // None was started for the M4A request's command line, which names its file.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(children_with_arg(pid, "flv"), 2);
    assert_eq!(
        children_with_arg(pid, "-hide_banner"),
        3,
        "the muxer and the two workers"
    );
}
