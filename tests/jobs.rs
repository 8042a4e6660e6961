//! Batch jobs (`/v1/jobs`) as a user meets them: the real `lipsync serve` on the echo device
//! (the model stand-in), driven over HTTP, its webhooks received by a loopback receiver that records them,
//! against the embedded SQLite store and a real PostgreSQL (tests/common/pg.rs: these fail,
//! never skip, without PostgreSQL). Needs ffmpeg and ffprobe.
//!
//! Renders are made slow on purpose where a test must catch a job queued or running (the
//! test build's fault hook `LIPSYNC_TEST_FAULTS=batch_delay_ms:N` stalls every model batch),
//! so those states last seconds, not milliseconds.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::routing::post;
use axum::Router;
use hmac::{Hmac, Mac};
use reqwest::multipart::{Form, Part};
use serde_json::{json, Value};
use sha2::Sha256;

use common::pg;
use common::server::Server;
use common::{media, num, probe, stream, top_level_boxes};

/// One second of speech: 25 video frames.
const SHORT: &str = "arctic_a0007_1s.wav";
/// Four seconds: 100 video frames.
const LONG: &str = "arctic_a0007.wav";
/// 0.4 s (the start of `SHORT`): 10 video frames, for jobs that only need to be done.
const TINY: &str = "tiny";
const PHOTO: &str = "astronaut.png";
const SECRET: &str = "hook-s3cret";
const RETRIES: &str = "0.2,0.4";
/// The longest any single wait may take (a loaded two-core machine) before the test fails.
const WAIT: Duration = Duration::from_secs(180);

// ---------------------------------------------------------------------------------------------
// The webhook receiver

/// One request the receiver got.
#[derive(Debug, Clone)]
struct Hook {
    path: String,
    headers: HeaderMap,
    body: Bytes,
    at: Instant,
}

impl Hook {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map_or("", |v| v.to_str().unwrap_or(""))
    }

    fn event(&self) -> &str {
        self.header("x-lipsync-event")
    }

    fn job(&self) -> Value {
        serde_json::from_slice(&self.body).expect("a webhook's body is JSON")
    }
}

#[derive(Clone, Default)]
struct Hooks(Arc<Mutex<Vec<Hook>>>);

impl Hooks {
    fn all(&self) -> Vec<Hook> {
        self.0.lock().unwrap().clone()
    }

    /// The requests about job `id`, in order.
    fn of(&self, id: &str) -> Vec<Hook> {
        self.all()
            .into_iter()
            .filter(|h| h.job()["id"] == id)
            .collect()
    }
}

/// `/ok` answers 204; `/flaky` 500 to the first attempt of every delivery, then 200.
async fn record(
    State(hooks): State<Hooks>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    let first = headers.get("x-lipsync-attempt").is_some_and(|v| v == "1");
    hooks.0.lock().unwrap().push(Hook {
        path: uri.path().to_string(),
        headers,
        body,
        at: Instant::now(),
    });
    match uri.path() {
        "/ok" => StatusCode::NO_CONTENT,
        "/flaky" if first => StatusCode::INTERNAL_SERVER_ERROR,
        "/flaky" => StatusCode::OK,
        _ => StatusCode::NOT_FOUND,
    }
}

/// A receiver on 127.0.0.1: its base URL and what it got.
async fn receiver() -> (String, Hooks) {
    let hooks = Hooks::default();
    let app = Router::new()
        .route("/{*path}", post(record))
        .with_state(hooks.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), hooks)
}

/// `X-Lipsync-Signature` as a receiver computes it, independently of lipsync's code.
fn signature(body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(SECRET.as_bytes()).unwrap();
    mac.update(body);
    let hex: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256={hex}")
}

/// A delivery of `event` for job `id`: headers, signature over the exact body, the job's JSON.
fn check_delivery(h: &Hook, id: &str, event: &str, attempt: u32) {
    assert_eq!(h.event(), event, "{h:?}");
    assert_eq!(h.header("x-lipsync-delivery"), format!("{id}:{event}"));
    assert_eq!(h.header("x-lipsync-attempt"), attempt.to_string());
    assert_eq!(h.header("content-type"), "application/json");
    assert_eq!(h.header("x-lipsync-signature"), signature(&h.body), "{h:?}");
    let job = h.job();
    assert_eq!(job["id"], id);
    assert_eq!(
        Some(job["status"].as_str().unwrap()),
        event.strip_prefix("job.")
    );
}

// ---------------------------------------------------------------------------------------------
// Servers, forms and jobs

/// `Server::start_with` off the runtime's worker (it blocks until the server listens), so the
/// receiver keeps answering meanwhile. On the echo device: these tests are about jobs, their
/// store, files and webhooks, not the model.
fn start(flags: &[&str], env: &[(&str, &str)]) -> Server {
    tokio::task::block_in_place(|| Server::start_with(common::server::ECHO, flags, env))
}

fn start_beside(first: &Server, flags: &[&str]) -> Server {
    tokio::task::block_in_place(|| first.start_beside(flags))
}

/// The bytes of speech `SHORT`, `LONG` or `TINY`.
fn speech_bytes(audio: &str) -> Vec<u8> {
    if audio != TINY {
        return media(audio);
    }
    static TINY_WAV: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    TINY_WAV
        .get_or_init(|| {
            let wav = media(SHORT);
            let mut r = hound::WavReader::new(std::io::Cursor::new(wav)).unwrap();
            assert_eq!(r.spec().sample_rate, 16_000);
            let samples: Vec<f32> = r
                .samples::<i16>()
                .take(6400)
                .map(|s| f32::from(s.unwrap()) / 32768.0)
                .collect();
            common::wav(&samples, 16_000, 1)
        })
        .clone()
}

/// Speech on the astronaut photo.
fn speech(audio: &str) -> Form {
    Form::new()
        .part("audio", part("speech.wav", speech_bytes(audio)))
        .part("image", part(PHOTO, media(PHOTO)))
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

/// An answer: status, headers, the body as JSON (null when it is not).
struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    json: Value,
}

impl Answer {
    fn error_type(&self) -> &str {
        self.json["error_type"].as_str().unwrap_or("")
    }
}

async fn answer(r: reqwest::Response) -> Answer {
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let bytes = r.bytes().await.unwrap();
    Answer {
        status,
        headers,
        json: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    }
}

async fn post_form(s: &Server, path: &str, form: Form) -> Answer {
    answer(
        client()
            .post(s.url(path))
            .multipart(form)
            .send()
            .await
            .unwrap(),
    )
    .await
}

async fn get(s: &Server, path: &str) -> Answer {
    answer(client().get(s.url(path)).send().await.unwrap()).await
}

async fn post_empty(s: &Server, path: &str) -> Answer {
    answer(client().post(s.url(path)).send().await.unwrap()).await
}

async fn delete(s: &Server, path: &str) -> Answer {
    answer(client().delete(s.url(path)).send().await.unwrap()).await
}

/// Submits a job that must be accepted: `202`, `Location`, queued; returns its id.
async fn submit(s: &Server, form: Form) -> String {
    let a = post_form(s, "/v1/jobs", form).await;
    assert_eq!(a.status, 202, "{}", a.json);
    let id = a.json["id"].as_str().unwrap().to_string();
    assert_eq!(a.headers["location"], format!("/v1/jobs/{id}").as_str());
    assert_eq!(a.json["status"], "queued", "{}", a.json);
    id
}

async fn job(s: &Server, id: &str) -> Value {
    let a = get(s, &format!("/v1/jobs/{id}")).await;
    assert_eq!(a.status, 200, "{}", a.json);
    a.json
}

fn tail(s: &Server) -> String {
    let log = s.log();
    log[log.len().saturating_sub(40)..].join("\n")
}

/// Polls job `id` until `pred` holds (a job that failed when `pred` wanted otherwise ends the
/// wait at once).
async fn wait_job(s: &Server, id: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let j = job(s, id).await;
        if pred(&j) {
            return j;
        }
        if j["status"] == "failed" || Instant::now() > deadline {
            panic!("job {id} never {what}: {j:#}\nserver log:\n{}", tail(s));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn succeeded(j: &Value) -> bool {
    j["status"] == "succeeded"
}

fn running(j: &Value) -> bool {
    j["status"] == "running"
}

/// Succeeded, and its webhook delivered and recorded (`attempts` of them).
fn delivered(attempts: u64) -> impl Fn(&Value) -> bool {
    move |j| succeeded(j) && j["webhook"]["attempts"] == attempts
}

/// Waits for a line of the server's log holding `text`.
async fn wait_log(s: &Server, text: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !s.log().iter().any(|l| l.contains(text)) {
        assert!(
            Instant::now() < deadline,
            "no {text:?} in the log:\n{}",
            tail(s)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls until the receiver holds what `pred` wants.
async fn wait_hooks(hooks: &Hooks, what: &str, pred: impl Fn(&[Hook]) -> bool) -> Vec<Hook> {
    let deadline = Instant::now() + WAIT;
    loop {
        let all = hooks.all();
        if pred(&all) {
            return all;
        }
        assert!(Instant::now() < deadline, "never {what}: {all:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `/metrics` until series `name` (labels exactly as exported) has `value`.
async fn wait_metric(s: &Server, name: &str, value: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = s.metric(name).await;
        if now == value {
            return;
        }
        assert!(Instant::now() < deadline, "{name} is {now}, not {value}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The ids of a `GET /v1/jobs` page, and its `next`.
async fn list(s: &Server, query: &str) -> (Vec<String>, Value) {
    let a = get(s, &format!("/v1/jobs{query}")).await;
    assert_eq!(a.status, 200, "{query}: {}", a.json);
    let ids = a.json["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap().to_string())
        .collect();
    (ids, a.json["next"].clone())
}

/// The job directories under a data directory (names of `jobs/*`, temporary ones included).
fn job_dirs(data_dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(data_dir.join("jobs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

fn job_dir(data_dir: &Path, id: &str) -> PathBuf {
    data_dir.join("jobs").join(id)
}

/// The files in a job's directory.
fn files(data_dir: &Path, id: &str) -> BTreeSet<String> {
    std::fs::read_dir(job_dir(data_dir, id))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Sends SIGTERM to the server.
fn sigterm(s: &Server) {
    let st = std::process::Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

/// Waits (bounded) for the server process to exit.
fn wait_exit(s: &mut Server) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Downloads a finished job's video (checking the download's headers).
async fn download(s: &Server, job: &Value) -> Vec<u8> {
    let r = client()
        .get(s.url(job["video_url"].as_str().unwrap()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "video/mp4");
    assert_eq!(r.headers()["accept-ranges"], "bytes");
    let len: usize = r.headers()["content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let bytes = r.bytes().await.unwrap().to_vec();
    assert_eq!(bytes.len(), len);
    bytes
}

/// A finished job's video: a faststart MP4 (index first, not fragmented), H.264 and AAC, as
/// long as its speech, `frames` video frames.
fn check_video(bytes: &[u8], seconds: f64, frames: u64) {
    let boxes = top_level_boxes(bytes);
    let at = |name: &str| boxes.iter().position(|b| b == name);
    assert_eq!(boxes.first().map(String::as_str), Some("ftyp"), "{boxes:?}");
    assert!(at("moov").unwrap() < at("mdat").unwrap(), "{boxes:?}");
    assert!(at("moof").is_none(), "fragmented: {boxes:?}");
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), bytes).unwrap();
    let p = probe(f.path());
    assert_eq!(stream(&p, "video")["codec_name"], "h264");
    assert_eq!(stream(&p, "audio")["codec_name"], "aac");
    let duration = num(&p["format"]["duration"]);
    assert!(
        (duration - seconds).abs() < 0.15,
        "{duration} s, not {seconds}"
    );
    assert_eq!(num(&stream(&p, "video")["nb_read_frames"]) as u64, frames);
}

/// A job's progress at its end: every frame done.
fn frames_done(j: &Value) -> u64 {
    let p = &j["progress"];
    assert_eq!(p["frames_done"], p["frames_total"], "{j}");
    let n = p["frames_total"].as_u64().unwrap();
    assert!(n > 0, "{j}");
    n
}

// ---------------------------------------------------------------------------------------------
// Submit, follow, download; webhooks; listing; metrics (both stores)

/// Flags of the lifecycle servers: one job at a time, signed webhooks retried quickly.
const LIFECYCLE: &[&str] = &[
    "--job-concurrency",
    "1",
    "--webhook-secret",
    SECRET,
    "--webhook-retry-seconds",
    RETRIES,
];

/// Batches stalled 400 ms: a second of speech renders for seconds.
const SLOW: &[(&str, &str)] = &[("LIPSYNC_TEST_FAULTS", "batch_delay_ms:400")];

#[tokio::test(flavor = "multi_thread")]
async fn a_job_is_submitted_followed_and_downloaded_with_a_signed_webhook_sqlite() {
    let s = start(LIFECYCLE, SLOW);
    s.wait_ready().await;
    lifecycle(&s).await;
    // The embedded store is in the data directory.
    assert!(s.data_dir().join("jobs.db").is_file());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_job_is_submitted_followed_and_downloaded_with_a_signed_webhook_postgresql() {
    let url = tokio::task::block_in_place(|| pg::shared().fresh_db("jobs_lifecycle"));
    let mut flags = LIFECYCLE.to_vec();
    flags.extend(["--jobs-db", &url]);
    let s = start(&flags, SLOW);
    s.wait_ready().await;
    lifecycle(&s).await;
    assert!(!s.data_dir().join("jobs.db").exists());
}

async fn lifecycle(s: &Server) {
    let (hook_base, hooks) = receiver().await;
    let metadata = json!({
        "order": "A-1042",
        "customer": {"name": "Zoë", "tier": 2, "vip": true},
        "tags": ["a", "b"],
        "note": null,
    });
    // The first job (batches stalled) keeps the only worker busy for seconds; the second
    // waits behind it.
    let first = submit(
        s,
        speech(SHORT)
            .text("webhook_url", format!("{hook_base}/ok"))
            .text("metadata", metadata.to_string()),
    )
    .await;
    let early = get(s, &format!("/v1/jobs/{first}/video")).await;
    assert_eq!(
        (early.status, early.error_type()),
        (409, "job_not_finished")
    );
    let a = post_form(
        s,
        "/v1/jobs",
        speech(TINY).text("webhook_url", format!("{hook_base}/flaky")),
    )
    .await;
    assert_eq!(a.status, 202, "{}", a.json);
    let second = a.json["id"].as_str().unwrap().to_string();
    assert_eq!(a.headers["location"], format!("/v1/jobs/{second}").as_str());
    let j = &a.json;
    assert_eq!(j["status"], "queued");
    assert_eq!(j["runs"], 0);
    assert_eq!(j["metadata"], Value::Null);
    assert_eq!(j["started_at"], Value::Null);
    assert_eq!(j["finished_at"], Value::Null);
    assert_eq!(j["video_url"], format!("/v1/jobs/{second}/video"));
    assert_eq!(
        j["webhook"],
        json!({"url": format!("{hook_base}/flaky"), "attempts": 0, "last_status": null})
    );
    let early = get(s, &format!("/v1/jobs/{second}/video")).await;
    assert_eq!(
        (early.status, early.error_type()),
        (409, "job_not_finished")
    );
    let now = job(s, &second).await;
    assert!(
        now["status"] == "queued" || now["status"] == "running",
        "{now}"
    );

    // Both succeed, each run once, every frame done, the metadata as given.
    let one = wait_job(s, &first, "succeeded", succeeded).await;
    let two = wait_job(s, &second, "succeeded", succeeded).await;
    for j in [&one, &two] {
        assert_eq!(j["runs"], 1, "{j}");
        assert_eq!(j["error"], Value::Null, "{j}");
        assert!(j["started_at"].as_str().unwrap() <= j["finished_at"].as_str().unwrap());
    }
    assert_eq!(one["metadata"], metadata);
    let frames = frames_done(&one);
    assert_eq!(frames, 25);
    assert_eq!(frames_done(&two), 10);

    // The video: a faststart MP4 of the speech's length; a range of it.
    let video = download(s, &one).await;
    check_video(&video, 1.0, frames);
    check_video(&download(s, &two).await, 0.4, 10);
    let url = s.url(&format!("/v1/jobs/{first}/video"));
    let r = client()
        .get(&url)
        .header("range", "bytes=1000-1999")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    assert_eq!(
        r.headers()["content-range"],
        format!("bytes 1000-1999/{}", video.len()).as_str()
    );
    assert_eq!(&r.bytes().await.unwrap()[..], &video[1000..2000]);
    let r = client()
        .get(&url)
        .header("range", format!("bytes={}-", video.len()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 416);

    // Webhooks: one for the first; the second's receiver failed once, so it was retried.
    let one = wait_job(s, &first, "recorded its webhook", delivered(1)).await;
    let two = wait_job(s, &second, "recorded its webhooks", delivered(2)).await;
    assert_eq!(one["webhook"]["last_status"], "204");
    assert_eq!(two["webhook"]["last_status"], "200");
    let got = hooks.of(&first);
    assert_eq!(got.len(), 1, "{got:#?}");
    check_delivery(&got[0], &first, "job.succeeded", 1);
    assert_eq!(got[0].path, "/ok");
    // The body is the job as GET shows it (but for the webhook's own state, which changed
    // with the delivery).
    let without_webhook = |mut j: Value| {
        j.as_object_mut().unwrap().remove("webhook");
        j
    };
    assert_eq!(without_webhook(got[0].job()), without_webhook(one.clone()));
    assert_eq!(got[0].job()["metadata"], metadata);
    let got = hooks.of(&second);
    assert_eq!(got.len(), 2, "{got:#?}");
    check_delivery(&got[0], &second, "job.succeeded", 1);
    check_delivery(&got[1], &second, "job.succeeded", 2);
    assert!(got.iter().all(|h| h.path == "/flaky"));
    let gap = got[1].at - got[0].at;
    assert!(gap >= Duration::from_millis(180), "retried after {gap:?}");
    assert_eq!(without_webhook(got[1].job()), without_webhook(two.clone()));

    // The listing: newest first, in pages, by status; what it refuses.
    assert_eq!(
        list(s, "").await,
        (vec![second.clone(), first.clone()], Value::Null)
    );
    assert_eq!(
        list(s, "?limit=1").await,
        (vec![second.clone()], json!(second))
    );
    assert_eq!(
        list(s, &format!("?limit=1&after={second}")).await,
        (vec![first.clone()], Value::Null)
    );
    assert_eq!(list(s, "?status=succeeded").await.0.len(), 2);
    assert_eq!(list(s, "?status=queued").await.0.len(), 0);
    for (query, error_type) in [
        ("?status=done", "bad_field"),
        ("?limit=0", "bad_field"),
        ("?limit=101", "bad_field"),
        ("?after=job_x", "bad_field"),
        ("?limit=", "bad_field"),
        ("?limit=1&limit=2", "bad_field"),
        ("?stauts=queued", "unknown_field"),
    ] {
        let a = get(s, &format!("/v1/jobs{query}")).await;
        assert_eq!((a.status, a.error_type()), (400, error_type), "{query}");
    }

    // Metrics.
    wait_metric(s, r#"lipsync_jobs{status="succeeded"}"#, 2.0).await;
    for status in ["queued", "running", "failed", "cancelled"] {
        assert_eq!(
            s.metric(&format!(r#"lipsync_jobs{{status="{status}"}}"#))
                .await,
            0.0
        );
    }
    assert_eq!(s.metric("lipsync_job_duration_seconds_count").await, 2.0);
    assert_eq!(
        s.metric(r#"lipsync_webhook_deliveries_total{outcome="success"}"#)
            .await,
        2.0
    );
    assert_eq!(
        s.metric(r#"lipsync_webhook_deliveries_total{outcome="retry"}"#)
            .await,
        1.0
    );
    assert_eq!(
        s.metric(r#"lipsync_webhook_deliveries_total{outcome="failed"}"#)
            .await,
        0.0
    );
    // The files: the inputs and the video, nothing left over.
    for id in [&first, &second] {
        assert_eq!(
            files(s.data_dir(), id),
            names(&["avatar.avatar", "speech", "video.mp4"])
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Restarts

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_or_killed_server_loses_no_job_and_sends_no_webhook_twice() {
    let (hook_base, hooks) = receiver().await;
    let flags = |lease: &'static str| {
        vec![
            "--job-concurrency",
            "1",
            "--job-lease-seconds",
            lease,
            "--webhook-secret",
            SECRET,
            "--webhook-retry-seconds",
            RETRIES,
        ]
    };
    // Batches stalled: a second of speech renders for seconds, so the stops land mid-render.
    let slow = [("LIPSYNC_TEST_FAULTS", "batch_delay_ms:500")];

    // SIGTERM while the first of four jobs renders: the job goes back to the queue, and the
    // server started again on the same data directory runs it at once, not after its 60 s
    // lease.
    let mut s = start(&flags("60"), &slow);
    s.wait_ready().await;
    let mut ids = Vec::new();
    for audio in [SHORT, SHORT, TINY, TINY] {
        ids.push(
            submit(
                &s,
                speech(audio).text("webhook_url", format!("{hook_base}/ok")),
            )
            .await,
        );
    }
    wait_job(&s, &ids[0], "rendering", |j| {
        running(j) && j["progress"]["frames_done"].as_u64() > Some(0)
    })
    .await;
    sigterm(&s);
    let stopped = Instant::now();
    let status = tokio::task::block_in_place(|| wait_exit(&mut s));
    assert!(status.success(), "{status}");
    wait_log(&s, &format!("job {} given back to the queue", ids[0])).await;
    let s = tokio::task::block_in_place(|| s.restart(&flags("2"), &slow));
    s.wait_ready().await;
    let ready = stopped.elapsed();
    wait_job(&s, &ids[0], "started again", |j| j["runs"] == 2).await;
    let again = stopped.elapsed();
    println!(
        "SIGTERM → restarted server ready {:.2} s → the job given back running again {:.2} s",
        ready.as_secs_f64(),
        again.as_secs_f64()
    );
    assert!(
        again - ready < Duration::from_secs(5),
        "the job given back waited {:?} after the server was ready",
        again - ready
    );
    assert!(again < Duration::from_secs(50), "{again:?}");

    // kill -9 while the second job renders (the first done, its webhook delivered and
    // recorded): nothing is given back; the next server claims the job when its 2 s lease has
    // run out.
    wait_job(&s, &ids[0], "delivered", delivered(1)).await;
    wait_job(&s, &ids[1], "rendering", |j| running(j) && j["runs"] == 1).await;
    let mut s = s;
    s.child.kill().unwrap();
    s.child.wait().unwrap();
    let killed = Instant::now();
    assert!(!job_dir(s.data_dir(), &ids[1]).join("video.mp4").exists());
    let s = tokio::task::block_in_place(|| s.restart(&flags("2"), &[]));
    let listening = killed.elapsed();
    s.wait_ready().await;
    let ready = killed.elapsed();
    wait_job(&s, &ids[1], "started again", |j| j["runs"] == 2).await;
    let again = killed.elapsed();
    for id in &ids {
        wait_job(&s, id, "succeeded", succeeded).await;
    }
    let all = killed.elapsed();
    println!(
        "kill -9 recovery: listening {:.2} s, ready {:.2} s, the killed job running again \
         {:.2} s, all 4 jobs succeeded {:.2} s",
        listening.as_secs_f64(),
        ready.as_secs_f64(),
        again.as_secs_f64(),
        all.as_secs_f64()
    );

    // Every job succeeded with one webhook; the two interrupted ran twice.
    let mut runs = Vec::new();
    for (id, seconds) in ids.iter().zip([1.0, 1.0, 0.4, 0.4]) {
        let j = wait_job(&s, id, "delivered", delivered(1)).await;
        runs.push(j["runs"].as_u64().unwrap());
        check_video(&download(&s, &j).await, seconds, frames_done(&j));
        assert_eq!(
            files(s.data_dir(), id),
            names(&["avatar.avatar", "speech", "video.mp4"])
        );
        let got = hooks.of(id);
        assert_eq!(got.len(), 1, "{id}: {got:#?}");
        check_delivery(&got[0], id, "job.succeeded", 1);
    }
    assert_eq!(runs, [2, 2, 1, 1]);
    assert_eq!(hooks.all().len(), 4);
}

// ---------------------------------------------------------------------------------------------
// Replicas

#[tokio::test(flavor = "multi_thread")]
async fn two_servers_on_one_postgresql_database_render_each_job_once() {
    let url = tokio::task::block_in_place(|| pg::shared().fresh_db("jobs_replicas"));
    let (hook_base, hooks) = receiver().await;
    let data = tempfile::tempdir().unwrap();
    let flags = [
        "--jobs-db",
        &url,
        "--data-dir",
        data.path().to_str().unwrap(),
        "--job-lease-seconds",
        "5",
        "--webhook-secret",
        SECRET,
        "--webhook-retry-seconds",
        RETRIES,
    ];
    let a = start(&flags, &[]);
    let b = start_beside(&a, &flags);
    a.wait_ready().await;
    b.wait_ready().await;

    // 20 jobs, submitted to either, four at a time.
    let started = Instant::now();
    let mut ids = Vec::new();
    for round in 0..5 {
        let submits = (0..4).map(|i| {
            let s = if (round * 4 + i) % 2 == 0 { &a } else { &b };
            submit(
                s,
                speech(TINY).text("webhook_url", format!("{hook_base}/ok")),
            )
        });
        ids.extend(futures_util::future::join_all(submits).await);
    }
    for id in &ids {
        let j = wait_job(&a, id, "delivered", delivered(1)).await;
        assert_eq!(j["runs"], 1, "{j}");
        assert_eq!(frames_done(&j), 10);
    }
    println!(
        "20 jobs on two servers: {:.2} s",
        started.elapsed().as_secs_f64()
    );

    // Each rendered once, by one server; both took some.
    let rendered = |s: &Server| -> BTreeSet<String> {
        s.log()
            .iter()
            .filter_map(|l| {
                let end = l.find(": run 1 started")?;
                l.get(end.checked_sub(28)?..end).map(str::to_string)
            })
            .collect()
    };
    let (by_a, by_b) = (rendered(&a), rendered(&b));
    assert!(by_a.is_disjoint(&by_b), "{by_a:?} {by_b:?}");
    let all: BTreeSet<String> = ids.iter().cloned().collect();
    assert_eq!(by_a.union(&by_b).cloned().collect::<BTreeSet<_>>(), all);
    let (na, nb) = (
        a.metric("lipsync_job_duration_seconds_count").await,
        b.metric("lipsync_job_duration_seconds_count").await,
    );
    println!("rendered: {na} by one server, {nb} by the other");
    assert!(na >= 1.0 && nb >= 1.0, "{na} + {nb}");
    assert_eq!(na + nb, 20.0);
    assert_eq!(na, by_a.len() as f64);

    // Exactly one webhook each.
    let got = wait_hooks(&hooks, "20 webhooks", |h| h.len() >= 20).await;
    assert_eq!(got.len(), 20);
    let mut per_job: HashMap<String, usize> = HashMap::new();
    for h in &got {
        check_delivery(h, h.job()["id"].as_str().unwrap(), "job.succeeded", 1);
        *per_job
            .entry(h.job()["id"].as_str().unwrap().into())
            .or_default() += 1;
    }
    assert!(per_job.values().all(|n| *n == 1) && per_job.len() == 20);

    // Either server lists every job (pages of 7, newest first) and serves every video.
    let mut seen = Vec::new();
    let mut query = "?limit=7".to_string();
    loop {
        let (page, next) = list(&b, &query).await;
        assert!(page.len() <= 7);
        seen.extend(page);
        match next.as_str() {
            Some(n) => query = format!("?limit=7&after={n}"),
            None => break,
        }
    }
    let mut newest_first = ids.clone();
    newest_first.sort_by(|x, y| y.cmp(x));
    assert_eq!(seen, newest_first);
    assert_eq!(list(&a, "?status=succeeded&limit=100").await.0.len(), 20);
    let one = job(&a, &ids[0]).await;
    assert_eq!(download(&a, &one).await, download(&b, &one).await);
    // Both count the shared store's jobs.
    wait_metric(&a, r#"lipsync_jobs{status="succeeded"}"#, 20.0).await;
    wait_metric(&b, r#"lipsync_jobs{status="succeeded"}"#, 20.0).await;
    drop(b);
}

// ---------------------------------------------------------------------------------------------
// Cancel, delete, the queue bound

#[tokio::test(flavor = "multi_thread")]
async fn jobs_are_cancelled_queued_or_running_and_deleted_with_their_files() {
    let (hook_base, hooks) = receiver().await;
    // One worker, one waiting job at most; batches stalled 800 ms so the running job renders
    // for seconds.
    let s = start(
        &[
            "--job-concurrency",
            "1",
            "--max-queued-jobs",
            "1",
            "--webhook-secret",
            SECRET,
            "--webhook-retry-seconds",
            RETRIES,
        ],
        &[("LIPSYNC_TEST_FAULTS", "batch_delay_ms:800")],
    );
    s.wait_ready().await;
    let hook = |form: Form| form.text("webhook_url", format!("{hook_base}/ok"));
    let running_id = submit(&s, hook(speech(LONG))).await;
    wait_job(&s, &running_id, "running", running).await;
    let queued_id = submit(&s, hook(speech(SHORT))).await;

    // The queue is full: refused, nothing kept.
    let refused = post_form(&s, "/v1/jobs", speech(SHORT)).await;
    assert_eq!(
        (refused.status, refused.error_type()),
        (429, "too_many_jobs"),
        "{}",
        refused.json
    );
    assert!(refused.headers.contains_key("retry-after"));
    assert_eq!(
        list(&s, "").await,
        (vec![queued_id.clone(), running_id.clone()], Value::Null)
    );
    assert_eq!(job_dirs(s.data_dir()), names(&[&queued_id, &running_id]));
    assert_eq!(job(&s, &running_id).await["status"], "running");
    assert_eq!(job(&s, &queued_id).await["status"], "queued");

    // Cancelled while queued: it never runs.
    let a = post_empty(&s, &format!("/v1/jobs/{queued_id}/cancel")).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json["status"], "cancelled");
    assert!(a.json["finished_at"].is_string());
    // Cancelled while running: its render stops, no video is kept.
    let a = post_empty(&s, &format!("/v1/jobs/{running_id}/cancel")).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json["status"], "cancelled");
    let finished_at = a.json["finished_at"].clone();
    wait_log(&s, &format!("job {running_id} stopped")).await;
    for id in [&queued_id, &running_id] {
        let v = get(&s, &format!("/v1/jobs/{id}/video")).await;
        assert_eq!((v.status, v.error_type()), (409, "job_not_finished"));
        assert_eq!(files(s.data_dir(), id), names(&["avatar.avatar", "speech"]));
    }
    // A job.cancelled webhook each.
    for id in [&queued_id, &running_id] {
        let j = wait_job(&s, id, "delivered", |j| j["webhook"]["attempts"] == 1).await;
        assert_eq!(j["status"], "cancelled");
        assert!(j["finished_at"].is_string());
        let got = hooks.of(id);
        assert_eq!(got.len(), 1, "{got:#?}");
        check_delivery(&got[0], id, "job.cancelled", 1);
    }
    let queued = job(&s, &queued_id).await;
    assert_eq!(queued["runs"], 0);
    assert_eq!(queued["started_at"], Value::Null);
    let was_running = job(&s, &running_id).await;
    assert_eq!(was_running["runs"], 1);
    assert_eq!(was_running["finished_at"], finished_at);
    // Cancelling an ended job returns it as it is.
    let again = post_empty(&s, &format!("/v1/jobs/{running_id}/cancel")).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.json, was_running);

    // The worker is free again: a new job runs and succeeds.
    let done_id = submit(&s, speech(TINY)).await;
    let done = wait_job(&s, &done_id, "succeeded", succeeded).await;
    assert_eq!(done["webhook"], Value::Null);
    assert_eq!(list(&s, "?status=succeeded").await.0, vec![done_id.clone()]);
    assert_eq!(
        list(&s, "?status=cancelled").await.0,
        vec![queued_id.clone(), running_id.clone()]
    );

    // Deleted: 204, then 404, the files gone; a running job is stopped first.
    let deleting_id = submit(&s, speech(LONG)).await;
    wait_job(&s, &deleting_id, "rendering", |j| {
        running(j) && j["progress"]["frames_done"].as_u64() > Some(0)
    })
    .await;
    for id in [&running_id, &done_id, &deleting_id] {
        let d = delete(&s, &format!("/v1/jobs/{id}")).await;
        assert_eq!(d.status, 204, "{}", d.json);
        for path in [format!("/v1/jobs/{id}"), format!("/v1/jobs/{id}/video")] {
            let g = get(&s, &path).await;
            assert_eq!((g.status, g.error_type()), (404, "job_not_found"), "{path}");
        }
        let c = post_empty(&s, &format!("/v1/jobs/{id}/cancel")).await;
        assert_eq!((c.status, c.error_type()), (404, "job_not_found"));
        let d = delete(&s, &format!("/v1/jobs/{id}")).await;
        assert_eq!((d.status, d.error_type()), (404, "job_not_found"));
        assert!(!job_dir(s.data_dir(), id).exists(), "{id}'s files are kept");
    }
    wait_log(&s, &format!("job {deleting_id} stopped")).await;
    // Nothing came back once the render stopped.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(job_dirs(s.data_dir()), names(&[&queued_id]));
    assert_eq!(list(&s, "").await.0, vec![queued_id.clone()]);
    wait_metric(&s, r#"lipsync_jobs{status="cancelled"}"#, 1.0).await;
    assert_eq!(s.metric(r#"lipsync_jobs{status="succeeded"}"#).await, 0.0);
    assert_eq!(s.metric(r#"lipsync_jobs{status="running"}"#).await, 0.0);
    // The last one, never run: the data directory is empty again.
    let d = delete(&s, &format!("/v1/jobs/{queued_id}")).await;
    assert_eq!(d.status, 204);
    assert!(job_dirs(s.data_dir()).is_empty());
    assert_eq!(list(&s, "").await, (vec![], Value::Null));
    // An id of the wrong shape is not found either.
    let g = get(&s, "/v1/jobs/..%2F..%2Fjobs.db").await;
    assert_eq!((g.status, g.error_type()), (404, "job_not_found"));
}

// ---------------------------------------------------------------------------------------------
// Refusals; expiry; the disk budget

/// 0.1 s of silence: less than one mel window.
fn too_short_wav() -> Vec<u8> {
    common::wav(&[0.0; 1600], 16_000, 1)
}

fn gray_png() -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    image::RgbImage::from_pixel(200, 200, image::Rgb([120, 120, 120]))
        .write_to(&mut out, image::ImageFormat::Png)
        .unwrap();
    out.into_inner()
}

fn part(name: &str, bytes: Vec<u8>) -> Part {
    Part::bytes(bytes).file_name(name.to_string())
}

/// Makes a form afresh (a form is sent once).
type MakeForm = Box<dyn Fn() -> Form>;

/// Bad forms, and what is wrong with each.
fn bad_forms() -> Vec<(&'static str, MakeForm)> {
    vec![
        (
            "no audio",
            Box::new(|| Form::new().part("image", part("i.png", media(PHOTO)))),
        ),
        (
            "no image",
            Box::new(|| Form::new().part("audio", part("a.wav", media(SHORT)))),
        ),
        (
            "a photo as the audio",
            Box::new(|| {
                Form::new()
                    .part("audio", part("a.wav", media(PHOTO)))
                    .part("image", part("i.png", media(PHOTO)))
            }),
        ),
        (
            "speech as the image",
            Box::new(|| {
                Form::new()
                    .part("audio", part("a.wav", media(SHORT)))
                    .part("image", part("i.png", media(SHORT)))
            }),
        ),
        ("a bad fps", Box::new(|| speech(SHORT).text("fps", "90"))),
        ("a bad crf", Box::new(|| speech(SHORT).text("crf", "99"))),
        ("a bad box", Box::new(|| speech(SHORT).text("box", "1,2,3"))),
        (
            "an enhancer that is not loaded",
            Box::new(|| speech(SHORT).text("enhance", "esrgan")),
        ),
        (
            "an unknown field",
            Box::new(|| speech(SHORT).text("color", "red")),
        ),
        (
            "a photo without a face",
            Box::new(|| {
                Form::new()
                    .part("audio", part("a.wav", media(SHORT)))
                    .part("image", part("i.png", gray_png()))
            }),
        ),
        (
            "speech too short",
            Box::new(|| {
                Form::new()
                    .part("audio", part("a.wav", too_short_wav()))
                    .part("image", part("i.png", media(PHOTO)))
            }),
        ),
        (
            "an unknown avatar",
            Box::new(|| {
                Form::new()
                    .part("audio", part("a.wav", media(SHORT)))
                    .text("avatar_id", "0123456789abcdef")
            }),
        ),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_submits_are_refused_as_v1_lipsync_refuses_them_and_finished_jobs_expire() {
    let s = start(&["--job-ttl", "1"], &[]);
    s.wait_ready().await;

    // The same form, the same refusal as /v1/lipsync; no job is made.
    for (what, form) in bad_forms() {
        let direct = post_form(&s, "/v1/lipsync", form()).await;
        let job = post_form(&s, "/v1/jobs", form()).await;
        assert!(
            (400..500).contains(&direct.status),
            "{what}: /v1/lipsync {}",
            direct.status
        );
        assert_eq!(
            (job.status, job.error_type()),
            (direct.status, direct.error_type()),
            "{what}: {} / {}",
            job.json,
            direct.json
        );
    }
    // The job's own fields.
    let big = json!({"blob": "x".repeat(4100)}).to_string();
    for (what, field, value, error_type) in [
        (
            "cloud metadata",
            "webhook_url",
            "http://169.254.169.254/latest/meta-data/",
            "webhook_not_allowed",
        ),
        (
            "link-local",
            "webhook_url",
            "http://[fe80::1]/hook",
            "webhook_not_allowed",
        ),
        (
            "not http",
            "webhook_url",
            "ftp://127.0.0.1/hook",
            "bad_field",
        ),
        ("not a URL", "webhook_url", "hook", "bad_field"),
        ("metadata not an object", "metadata", "[1, 2]", "bad_field"),
        ("metadata a string", "metadata", "\"A-1042\"", "bad_field"),
        ("metadata not JSON", "metadata", "{order: 1}", "bad_field"),
        ("metadata over 4 KiB", "metadata", big.as_str(), "bad_field"),
    ] {
        let a = post_form(&s, "/v1/jobs", speech(SHORT).text(field, value.to_string())).await;
        assert_eq!(
            (a.status, a.error_type()),
            (400, error_type),
            "{what}: {}",
            a.json
        );
    }
    assert_eq!(list(&s, "").await, (vec![], Value::Null));
    assert!(job_dirs(s.data_dir()).is_empty());

    // Metadata of exactly 4 KiB is accepted; a finished job is deleted --job-ttl (1 s) after
    // it ended, with its files.
    let pad = 4096 - json!({"blob": ""}).to_string().len();
    let metadata = json!({"blob": "y".repeat(pad)}).to_string();
    assert_eq!(metadata.len(), 4096);
    let id = submit(&s, speech(TINY).text("metadata", metadata.clone())).await;
    let j = wait_job(&s, &id, "succeeded", succeeded).await;
    let ended = Instant::now();
    assert_eq!(j["metadata"].to_string(), metadata);
    assert!(job_dir(s.data_dir(), &id).join("video.mp4").is_file());
    let deadline = ended + Duration::from_secs(10);
    while get(&s, &format!("/v1/jobs/{id}")).await.status != 404 {
        assert!(Instant::now() < deadline, "job {id} never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "expired {:.2} s after it ended (--job-ttl 1)",
        ended.elapsed().as_secs_f64()
    );
    assert!(!job_dir(s.data_dir(), &id).exists());
    assert_eq!(list(&s, "").await.0.len(), 0);
    wait_metric(&s, r#"lipsync_jobs{status="succeeded"}"#, 0.0).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_job_over_the_data_directory_budget_is_refused_and_nothing_is_kept() {
    // Refused before anything needs the model: no need to wait for warm-up.
    let s = start(&["--data-dir-bytes", "10K"], &[]);
    let a = post_form(&s, "/v1/jobs", speech(SHORT)).await;
    assert_eq!(
        (a.status, a.error_type()),
        (507, "insufficient_storage"),
        "{}",
        a.json
    );
    assert_eq!(list(&s, "").await, (vec![], Value::Null));
    assert!(job_dirs(s.data_dir()).is_empty());
    assert_eq!(s.metric(r#"lipsync_jobs{status="queued"}"#).await, 0.0);
}
