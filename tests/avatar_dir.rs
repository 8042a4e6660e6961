//! `--avatar-dir`: prepared avatars on disk, found again after a restart, shared by replicas on
//! one directory, damaged files skipped and removed, the byte budget kept by removing the least
//! recently used. `lipsync serve` as a process on the echo device (the avatars are under test,
//! not the model), driven over HTTP (needs ffmpeg and ffprobe).

mod common;

use common::media;
use common::server::{decoded_frames, Server};

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use reqwest::multipart::{Form, Part};
use serde_json::Value;

fn photo(name: &str, extra: &[(&'static str, &'static str)]) -> Form {
    let mut f = Form::new().part(
        "image",
        Part::bytes(media(name)).file_name(name.to_string()),
    );
    for (k, v) in extra {
        f = f.text(*k, *v);
    }
    f
}

/// carphone.mp4 (120 frames of 176×144 at 29.97 fps) with a pinned box (no detection pass).
fn clip() -> Form {
    Form::new()
        .part(
            "video",
            Part::bytes(media("carphone.mp4")).file_name("carphone.mp4"),
        )
        .text("box", "50,20,130,120")
}

async fn create(s: &Server, form: Form) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(s.url("/v1/avatars"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

async fn get(s: &Server, id: &str) -> (u16, Value) {
    let r = reqwest::get(s.url(&format!("/v1/avatars/{id}")))
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

async fn delete(s: &Server, id: &str) -> u16 {
    reqwest::Client::new()
        .delete(s.url(&format!("/v1/avatars/{id}")))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// `POST /v1/lipsync` with one second of speech on avatar `id`: the status, and the frames of
/// the video (0 when it failed).
async fn render(s: &Server, id: &str) -> (u16, u64, Value) {
    let form = Form::new()
        .part(
            "audio",
            Part::bytes(media("arctic_a0007_1s.wav")).file_name("a.wav"),
        )
        .text("avatar_id", id.to_string());
    let r = reqwest::Client::new()
        .post(s.url("/v1/lipsync"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let body = r.bytes().await.unwrap();
    if status == 200 {
        (status, decoded_frames(&body), Value::Null)
    } else {
        (
            status,
            0,
            serde_json::from_slice(&body).unwrap_or(Value::Null),
        )
    }
}

fn file(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.avatar"))
}

/// The directory's entries, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

fn set_age(path: &Path, seconds: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(SystemTime::now() - Duration::from_secs(seconds))
        .unwrap();
}

fn id_of(v: &Value) -> String {
    v["id"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn avatars_outlive_a_restart_and_so_does_their_deletion() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("avatars");
    let flags = ["--avatar-dir", d.to_str().unwrap()];
    let (a, c) = {
        let s = Server::start_echo(&flags);
        let (status, a) = create(&s, photo("astronaut.png", &[])).await;
        assert_eq!(status, 201, "{a}");
        let (status, c) = create(&s, clip()).await;
        assert_eq!(status, 201, "{c}");
        assert_eq!(c["kind"], "video");
        assert_eq!(c["frames"], 120);
        let mut want = vec![
            format!("{}.avatar", id_of(&a)),
            format!("{}.avatar", id_of(&c)),
        ];
        want.sort();
        assert_eq!(entries(&d), want, "one file each, no temporary file left");
        (a, c)
    };
    let (pid, cid) = (id_of(&a), id_of(&c));

    // A new process on the same directory: nothing in memory, everything on disk.
    let s = Server::start_echo(&flags);
    s.wait_ready().await;
    assert_eq!(get(&s, &pid).await, (200, a.clone()));
    assert_eq!(get(&s, &cid).await, (200, c.clone()));
    // Uploading the same photo again finds it (200, not 201).
    assert_eq!(
        create(&s, photo("astronaut.png", &[])).await,
        (200, a.clone())
    );
    let (status, frames, _) = render(&s, &pid).await;
    assert_eq!((status, frames), (200, 25));
    let (status, frames, _) = render(&s, &cid).await;
    assert_eq!(status, 200);
    assert!(frames >= 25, "{frames} frames from the clip avatar");

    assert_eq!(delete(&s, &pid).await, 204);
    assert!(!file(&d, &pid).exists(), "DELETE removes the file");
    assert_eq!(get(&s, &pid).await.0, 404);
    assert_eq!(delete(&s, &pid).await, 404);
    drop(s);

    let s = Server::start_echo(&flags);
    let (status, e) = get(&s, &pid).await;
    assert_eq!(
        (status, e["error_type"].as_str()),
        (404, Some("avatar_not_found"))
    );
    assert_eq!(get(&s, &cid).await, (200, c));
}

#[tokio::test(flavor = "multi_thread")]
async fn replicas_on_one_directory_serve_and_delete_each_others_avatars() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let flags = ["--avatar-dir", d.to_str().unwrap()];
    let one = Server::start_echo(&flags);
    let two = one.start_beside(&flags);
    let (status, a) = create(&one, photo("astronaut.png", &[])).await;
    assert_eq!(status, 201);
    let id = id_of(&a);
    // The second replica never saw it.
    assert_eq!(get(&two, &id).await, (200, a.clone()));
    two.wait_ready().await;
    let (status, frames, _) = render(&two, &id).await;
    assert_eq!((status, frames), (200, 25));

    // Both create the same avatar at once: one id, one whole file, no temporary file left.
    let (x, y) = tokio::join!(
        create(&one, photo("grace_hopper.jpg", &[])),
        create(&two, photo("grace_hopper.jpg", &[]))
    );
    assert!(
        [200, 201].contains(&x.0) && [200, 201].contains(&y.0),
        "{x:?} {y:?}"
    );
    assert_eq!(x.1, y.1);
    let mut want = vec![format!("{id}.avatar"), format!("{}.avatar", id_of(&x.1))];
    want.sort();
    assert_eq!(entries(d), want);
    assert_eq!(get(&two, &id_of(&x.1)).await.0, 200);

    // Deleted on one replica: gone on the other too, though its memory still held it.
    assert_eq!(delete(&two, &id).await, 204);
    assert_eq!(get(&one, &id).await.0, 404);
    one.wait_ready().await;
    let (status, _, e) = render(&one, &id).await;
    assert_eq!(
        (status, e["error_type"].as_str()),
        (404, Some("avatar_not_found"))
    );
    drop(two);
}

#[tokio::test(flavor = "multi_thread")]
async fn damaged_files_are_404_and_removed_and_the_others_still_served() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let flags = ["--avatar-dir", d.to_str().unwrap()];
    let ids: Vec<String> = {
        let s = Server::start_echo(&flags);
        let mut ids = Vec::new();
        for form in [
            photo("astronaut.png", &[]),
            photo("astronaut.png", &[("box", "180,90,270,187")]),
            photo("grace_hopper.jpg", &[]),
        ] {
            let (status, v) = create(&s, form).await;
            assert_eq!(status, 201, "{v}");
            ids.push(id_of(&v));
        }
        ids
    };
    let (cut, flipped, good) = (&ids[0], &ids[1], &ids[2]);
    let bytes = std::fs::read(file(d, cut)).unwrap();
    std::fs::write(file(d, cut), &bytes[..bytes.len() / 2]).unwrap();
    let mut bytes = std::fs::read(file(d, flipped)).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(file(d, flipped), &bytes).unwrap();

    let s = Server::start_echo(&flags);
    s.wait_ready().await;
    let (status, e) = get(&s, cut).await;
    assert_eq!(
        (status, e["error_type"].as_str()),
        (404, Some("avatar_not_found"))
    );
    assert!(!file(d, cut).exists(), "the truncated file is removed");
    let (status, _, e) = render(&s, flipped).await;
    assert_eq!(
        (status, e["error_type"].as_str()),
        (404, Some("avatar_not_found"))
    );
    assert!(!file(d, flipped).exists(), "the damaged file is removed");
    assert_eq!(get(&s, flipped).await.0, 404);
    assert_eq!(get(&s, good).await.0, 200);
    let (status, frames, _) = render(&s, good).await;
    assert_eq!((status, frames), (200, 25));
    let log = s.log().join("\n");
    assert!(
        log.matches("is damaged").count() >= 2,
        "both damaged files are logged:\n{log}"
    );
    // Uploading the photo again makes it anew.
    let (status, _) = create(&s, photo("astronaut.png", &[])).await;
    assert_eq!(status, 201);
    assert!(file(d, cut).exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_byte_budget_removes_the_least_recently_used_first() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A 512×512 photo avatar takes a little more than 768 KiB: two fit, three do not.
    let flags = [
        "--avatar-dir",
        d.to_str().unwrap(),
        "--avatar-dir-bytes",
        "2000000",
    ];
    let s = Server::start_echo(&flags);
    let mut ids = Vec::new();
    for pads in ["0,10,0,0", "0,20,0,0", "0,30,0,0"] {
        let (status, v) = create(&s, photo("astronaut.png", &[("pads", pads)])).await;
        assert_eq!(status, 201, "{v}");
        ids.push(id_of(&v));
        if ids.len() == 2 {
            // `a` was used longest ago, then `b`; a use of `a` makes `b` the oldest.
            set_age(&file(d, &ids[0]), 7200);
            set_age(&file(d, &ids[1]), 3600);
            assert_eq!(get(&s, &ids[0]).await.0, 200);
        }
    }
    let (a, b, c) = (&ids[0], &ids[1], &ids[2]);
    assert!(file(d, a).exists() && file(d, c).exists());
    assert!(
        !file(d, b).exists(),
        "the least recently used avatar is removed"
    );
    // Gone from the directory, so gone (though memory still held it).
    assert_eq!(get(&s, b).await.0, 404);
    let used = s.metric("lipsync_avatar_dir_bytes").await;
    assert!(used > 1_500_000.0 && used <= 2_000_000.0, "{used}");
    drop(s);

    // An avatar larger than the whole budget is refused, and nothing is removed for it.
    let small = [
        "--avatar-dir",
        d.to_str().unwrap(),
        "--avatar-dir-bytes",
        "900K",
    ];
    let s = Server::start_echo(&small);
    let before = entries(d);
    assert_eq!(
        before.len(),
        1,
        "the smaller budget trims the directory at start"
    );
    let (status, e) = create(&s, photo("grace_hopper.jpg", &[])).await;
    assert_eq!(
        (status, e["error_type"].as_str()),
        (413, Some("avatar_too_large")),
        "{e}"
    );
    assert!(e["error"].as_str().unwrap().contains("--avatar-dir-bytes"));
    assert_eq!(entries(d), before);
}
