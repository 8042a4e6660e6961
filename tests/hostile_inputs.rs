//! What a careless or hostile client can send, over a real loopback socket: `lipsync serve`
//! started as a process (tests/common/server.rs), driven with HTTP. Needs ffmpeg
//! (scripts/test.sh). The refusals happen before the model: those servers run on the echo
//! device (no model load or warm-up); the one whose stream must hold its request slot for a
//! while runs the CPU model with test weights.

mod common;

use common::media;
use common::server::Server;

use std::time::{Duration, Instant};

use reqwest::multipart::{Form, Part};

fn file(name: &str, bytes: Vec<u8>) -> Part {
    Part::bytes(bytes).file_name(name.to_string())
}

fn avatar_form(name: &str, bytes: Vec<u8>) -> Form {
    Form::new().part("image", file(name, bytes))
}

fn lipsync_form(audio: &str, image: &str, image_bytes: Vec<u8>) -> Form {
    Form::new()
        .part("audio", file(audio, media(audio)))
        .part("image", file(image, image_bytes))
}

/// The photo with its last `cut` bytes missing, as an interrupted upload leaves it.
fn cut_short(name: &str, cut: usize) -> Vec<u8> {
    let mut b = media(name);
    b.truncate(b.len() - cut);
    b
}

/// Status and JSON error body of a refused request.
async fn refused(res: reqwest::Response) -> (u16, serde_json::Value) {
    let status = res.status().as_u16();
    let body: serde_json::Value = res.json().await.expect("a JSON error body");
    (status, body)
}

#[tokio::test(flavor = "multi_thread")]
async fn cors_star_means_any_origin() {
    // `*` alone, and `*` inside a list: both used to panic the server at start-up.
    for origins in ["*", "https://app.example,*"] {
        let s = Server::start_echo(&["--cors-origins", origins]);
        let client = reqwest::Client::new();
        let res = client
            .get(s.url("/health"))
            .header("origin", "https://anywhere.example")
            .send()
            .await
            .unwrap_or_else(|e| panic!("--cors-origins {origins}: server gone ({e})"));
        assert_eq!(res.status(), 200);
        assert_eq!(res.headers()["access-control-allow-origin"], "*");
        // A browser's preflight for an authorised upload.
        let pre = client
            .request(reqwest::Method::OPTIONS, s.url("/v1/avatars"))
            .header("origin", "https://anywhere.example")
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "authorization")
            .send()
            .await
            .unwrap();
        assert!(pre.status().is_success(), "{}", pre.status());
        assert_eq!(pre.headers()["access-control-allow-origin"], "*");
        let methods = pre.headers()["access-control-allow-methods"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(methods.contains("POST"), "{methods}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn cors_lists_allow_only_their_origins() {
    let s = Server::start_echo(&["--cors-origins", "https://a.example, https://b.example"]);
    let client = reqwest::Client::new();
    for (origin, allowed) in [
        ("https://a.example", true),
        ("https://b.example", true),
        ("https://evil.example", false),
    ] {
        let res = client
            .get(s.url("/health"))
            .header("origin", origin)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
        let got = res.headers().get("access-control-allow-origin");
        if allowed {
            assert_eq!(got.unwrap(), origin);
        } else {
            assert!(got.is_none(), "{origin} was allowed: {got:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn images_cut_short_are_refused_with_400_damaged() {
    let s = Server::start_echo(&[]);
    s.wait_ready().await;
    let client = reqwest::Client::new();
    for (name, cut) in [
        ("grace_hopper.jpg", 2),
        ("grace_hopper.jpg", 20_000),
        ("astronaut.png", 4),
        ("astronaut.png", 300_000),
        ("small.webp", 1),
    ] {
        let res = client
            .post(s.url("/v1/avatars"))
            .multipart(avatar_form(name, cut_short(name, cut)))
            .send()
            .await
            .unwrap();
        let (status, e) = refused(res).await;
        assert_eq!(status, 400, "avatar from {name} cut by {cut}: {e}");
        assert_eq!(e["error_type"], "corrupt_image", "{e}");
        assert!(e["error"].as_str().unwrap().contains("damaged"), "{e}");

        let res = client
            .post(s.url("/v1/lipsync"))
            .multipart(lipsync_form(
                "arctic_a0007_1s.wav",
                name,
                cut_short(name, cut),
            ))
            .send()
            .await
            .unwrap();
        let (status, e) = refused(res).await;
        assert_eq!(status, 400, "render of {name} cut by {cut}: {e}");
        assert_eq!(e["error_type"], "corrupt_image", "{e}");
    }
    // The whole file is still fine.
    let res = client
        .post(s.url("/v1/avatars"))
        .multipart(avatar_form("grace_hopper.jpg", media("grace_hopper.jpg")))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_avatar_larger_than_the_cache_is_413_and_no_id_is_given() {
    // 600 kB: less than one prepared 512x512 avatar (its frame alone is 786 kB), more than
    // the avatar of a 64x32 photo (about 250 kB, mostly the model's 96x96 input).
    let s = Server::start_echo(&["--avatar-cache-bytes", "600000"]);
    s.wait_ready().await;
    let client = reqwest::Client::new();
    let res = client
        .post(s.url("/v1/avatars"))
        .multipart(avatar_form("astronaut.png", media("astronaut.png")))
        .send()
        .await
        .unwrap();
    let (status, e) = refused(res).await;
    assert_eq!(status, 413, "{e}");
    assert_eq!(e["error_type"], "avatar_too_large");
    assert!(e["error"].as_str().unwrap().contains("600000"), "{e}");
    assert!(e.get("id").is_none());
    // A small photo fits (its face given: the detector finds none in a 64x32 picture).
    let res = client
        .post(s.url("/v1/avatars"))
        .multipart(avatar_form("small.webp", media("small.webp")).text("box", "0,0,64,32"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    let made: serde_json::Value = res.json().await.unwrap();
    let id = made["id"].as_str().unwrap();
    let got = reqwest::get(s.url(&format!("/v1/avatars/{id}")))
        .await
        .unwrap();
    assert_eq!(got.status(), 200, "a returned id must exist");
    // One-off renders are not cached, so the cache's size does not apply to them.
    let res = client
        .post(s.url("/v1/lipsync"))
        .multipart(lipsync_form(
            "arctic_a0007_1s.wav",
            "astronaut.png",
            media("astronaut.png"),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let video = res.bytes().await.unwrap();
    assert!(video.len() > 1000);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_avatar_cache_of_no_entries_refuses_instead_of_giving_dead_ids() {
    let s = Server::start_echo(&["--avatar-cache-entries", "0"]);
    let res = reqwest::Client::new()
        .post(s.url("/v1/avatars"))
        .multipart(avatar_form("small.webp", media("small.webp")).text("box", "0,0,64,32"))
        .send()
        .await
        .unwrap();
    let (status, e) = refused(res).await;
    assert_eq!(status, 403, "{e}");
    assert_eq!(e["error_type"], "avatars_disabled");
}

#[tokio::test(flavor = "multi_thread")]
async fn avatar_preparation_takes_a_request_slot() {
    let s = Server::start(&["--max-requests", "1"]);
    s.wait_ready().await;
    let client = reqwest::Client::new();
    // A stream holds the only slot while it runs (its body is not read yet).
    let stream = client
        .post(s.url("/v1/lipsync"))
        .multipart(lipsync_form(
            "arctic_a0007.wav",
            "astronaut.png",
            media("astronaut.png"),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let res = client
        .post(s.url("/v1/avatars"))
        .multipart(avatar_form("astronaut.png", media("astronaut.png")))
        .send()
        .await
        .unwrap();
    let retry: u64 = res
        .headers()
        .get("retry-after")
        .expect("a Retry-After header")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1);
    let (status, e) = refused(res).await;
    assert_eq!(status, 429, "{e}");
    assert_eq!(e["error_type"], "overloaded");
    // Once the stream is done the slot is free again.
    let video = stream.bytes().await.unwrap();
    assert!(!video.is_empty());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let res = client
            .post(s.url("/v1/avatars"))
            .multipart(avatar_form("astronaut.png", media("astronaut.png")))
            .send()
            .await
            .unwrap();
        match res.status().as_u16() {
            201 => break,
            429 if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            other => panic!("{other}: {}", res.text().await.unwrap()),
        }
    }
}
