//! Webhook delivery (src/jobs/webhook.rs) against a real receiver on loopback that records
//! what it is sent.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use lipsync::jobs::webhook::{self, Allow, Client, Delivery, Event};

/// One request the receiver got.
#[derive(Debug, Clone)]
struct Received {
    path: String,
    headers: HeaderMap,
    body: Bytes,
}

#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<Received>>>);

impl Log {
    fn all(&self) -> Vec<Received> {
        self.0.lock().unwrap().clone()
    }
}

async fn record(State(log): State<Log>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    log.0.lock().unwrap().push(Received {
        path: uri.path().to_string(),
        headers,
        body,
    });
    match uri.path() {
        "/ok" => StatusCode::NO_CONTENT.into_response(),
        "/fail" => (StatusCode::INTERNAL_SERVER_ERROR, "no").into_response(),
        "/gone" => StatusCode::GONE.into_response(),
        "/redirect" => (StatusCode::FOUND, [("location", "/ok")]).into_response(),
        "/slow" => {
            tokio::time::sleep(Duration::from_secs(5)).await;
            StatusCode::OK.into_response()
        }
        _ => StatusCode::NOT_FOUND.into_response(),
    }
}

/// A receiver on 127.0.0.1: its base URL and its log.
async fn receiver() -> (String, Log) {
    let log = Log::default();
    let app = Router::new()
        .route("/{*path}", post(record))
        .with_state(log.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), log)
}

const BODY: &[u8] = br#"{"id":"job_0190000000000123456789ab","status":"succeeded"}"#;

fn event(attempt: u32) -> Event<'static> {
    Event {
        name: "job.succeeded",
        delivery_id: "job_0190000000000123456789ab:job.succeeded",
        attempt,
    }
}

fn header<'a>(r: &'a Received, name: &str) -> Option<&'a str> {
    r.headers.get(name).map(|v| v.to_str().unwrap())
}

async fn send(url: &str, secret: Option<&[u8]>, allow: &Allow) -> Delivery {
    webhook::deliver(&Client::default(), url, &event(1), BODY, secret, allow).await
}

/// The signature computed independently of the module, as a receiver would.
fn expected_signature(secret: &[u8], body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).unwrap();
    mac.update(body);
    let tag = mac.finalize().into_bytes();
    let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256={hex}")
}

#[tokio::test]
async fn a_signed_delivery_carries_the_body_and_headers() {
    let (base, log) = receiver().await;
    let d = send(&format!("{base}/ok"), Some(b"s3cret"), &Allow::any()).await;
    assert_eq!(
        d,
        Delivery {
            ok: true,
            status: "204".into()
        }
    );
    let got = log.all();
    assert_eq!(got.len(), 1);
    let r = &got[0];
    assert_eq!(r.path, "/ok");
    assert_eq!(&r.body[..], BODY);
    assert_eq!(header(r, "content-type"), Some("application/json"));
    assert_eq!(header(r, "x-lipsync-event"), Some("job.succeeded"));
    assert_eq!(
        header(r, "x-lipsync-delivery"),
        Some("job_0190000000000123456789ab:job.succeeded")
    );
    assert_eq!(header(r, "x-lipsync-attempt"), Some("1"));
    assert!(header(r, "user-agent").unwrap().starts_with("lipsync/"));
    let sig = header(r, "x-lipsync-signature").unwrap();
    assert_eq!(sig, expected_signature(b"s3cret", &r.body));
    assert!(webhook::verify_signature(b"s3cret", &r.body, sig));
    assert!(!webhook::verify_signature(b"wrong", &r.body, sig));
}

#[tokio::test]
async fn without_a_secret_there_is_no_signature() {
    let (base, log) = receiver().await;
    let d = send(&format!("{base}/ok"), None, &Allow::any()).await;
    assert!(d.ok, "{d:?}");
    let got = log.all();
    assert_eq!(got.len(), 1);
    assert_eq!(header(&got[0], "x-lipsync-signature"), None);
    assert_eq!(header(&got[0], "x-lipsync-event"), Some("job.succeeded"));
}

#[tokio::test]
async fn the_attempt_number_and_event_are_sent() {
    let (base, log) = receiver().await;
    let e = Event {
        name: "job.cancelled",
        delivery_id: "job_x:job.cancelled",
        attempt: 4,
    };
    let d = webhook::deliver(
        &Client::default(),
        &format!("{base}/ok"),
        &e,
        b"{}",
        None,
        &Allow::any(),
    )
    .await;
    assert!(d.ok);
    let r = &log.all()[0];
    assert_eq!(header(r, "x-lipsync-event"), Some("job.cancelled"));
    assert_eq!(header(r, "x-lipsync-attempt"), Some("4"));
    assert_eq!(header(r, "x-lipsync-delivery"), Some("job_x:job.cancelled"));
}

#[tokio::test]
async fn a_non_2xx_answer_fails_with_its_status() {
    let (base, log) = receiver().await;
    let d = send(&format!("{base}/fail"), None, &Allow::any()).await;
    assert_eq!((d.ok, d.status.as_str()), (false, "500"));
    let d = send(&format!("{base}/gone"), None, &Allow::any()).await;
    assert_eq!((d.ok, d.status.as_str()), (false, "410"));
    assert_eq!(log.all().len(), 2);
}

#[tokio::test]
async fn a_redirect_is_not_followed() {
    let (base, log) = receiver().await;
    let d = send(&format!("{base}/redirect"), None, &Allow::any()).await;
    assert_eq!((d.ok, d.status.as_str()), (false, "302"));
    let paths: Vec<String> = log.all().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, ["/redirect"]);
}

#[tokio::test]
async fn a_refused_connection_is_connect() {
    // A port that was just free and is closed again.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let d = send(&format!("http://127.0.0.1:{port}/ok"), None, &Allow::any()).await;
    assert_eq!((d.ok, d.status.as_str()), (false, "connect"));
}

#[tokio::test]
async fn https_is_spoken() {
    // TLS to a plain-HTTP receiver fails in the handshake: a connect failure, which shows
    // that the client speaks https at all (without TLS support it would be a builder error).
    let (base, log) = receiver().await;
    let url = base.replace("http://", "https://") + "/ok";
    let d = send(&url, None, &Allow::any()).await;
    assert_eq!((d.ok, d.status.as_str()), (false, "connect"));
    assert!(log.all().is_empty());
}

#[tokio::test]
async fn a_slow_receiver_times_out() {
    let (base, log) = receiver().await;
    let client = Client::new(Duration::from_millis(300));
    let t = Instant::now();
    let d = webhook::deliver(
        &client,
        &format!("{base}/slow"),
        &event(1),
        BODY,
        None,
        &Allow::any(),
    )
    .await;
    assert_eq!((d.ok, d.status.as_str()), (false, "timeout"));
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert_eq!(log.all().len(), 1);
}

#[tokio::test]
async fn a_target_refused_at_delivery_is_not_contacted() {
    let (base, log) = receiver().await;
    let only_private: Allow = "10.0.0.0/8".parse().unwrap();
    let d = send(&format!("{base}/ok"), None, &only_private).await;
    assert_eq!((d.ok, d.status.as_str()), (false, "not_allowed"));
    let d = send(
        "http://169.254.169.254/latest/meta-data/",
        None,
        &Allow::any(),
    )
    .await;
    assert_eq!((d.ok, d.status.as_str()), (false, "not_allowed"));
    let d = send("http://metadata.google.internal/", None, &Allow::any()).await;
    assert_eq!((d.ok, d.status.as_str()), (false, "not_allowed"));
    assert!(log.all().is_empty());
    // Listed, the same receiver is reached.
    let loopback: Allow = "127.0.0.0/8".parse().unwrap();
    assert!(send(&format!("{base}/ok"), None, &loopback).await.ok);
    assert_eq!(log.all().len(), 1);
}

#[tokio::test]
async fn a_host_name_is_resolved_checked_and_kept_in_the_request() {
    let (base, log) = receiver().await;
    let port = base.rsplit(':').next().unwrap();
    let url = format!("http://localhost:{port}/ok");
    webhook::check_target(&url, &Allow::any()).await.unwrap();
    // By name, and by the addresses `localhost` resolves to.
    for allow in ["localhost", "127.0.0.0/8,::1"] {
        let allow: Allow = allow.parse().unwrap();
        let d = send(&url, None, &allow).await;
        assert!(d.ok, "{allow}: {d:?}");
    }
    let got = log.all();
    assert_eq!(got.len(), 2);
    for r in &got {
        assert_eq!(
            header(r, "host"),
            Some(format!("localhost:{port}").as_str())
        );
    }
    // Not listed by name, and its addresses outside the list.
    let other: Allow = "hooks.example.com,10.0.0.0/8".parse().unwrap();
    assert!(webhook::check_target(&url, &other).await.is_err());
    assert_eq!(send(&url, None, &other).await.status, "not_allowed");
}

#[tokio::test]
async fn the_default_policy_at_submit() {
    let any = Allow::any();
    webhook::check_target("http://127.0.0.1:8080/hook", &any)
        .await
        .unwrap();
    webhook::check_target("http://[::1]:8080/hook", &any)
        .await
        .unwrap();
    webhook::check_target("https://10.1.2.3/hook", &any)
        .await
        .unwrap();
    for url in [
        "http://169.254.169.254/latest/meta-data/",
        "http://[fe80::1]/",
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://100.100.100.200/",
        "http://[fd00:ec2::254]/",
    ] {
        let e = webhook::check_target(url, &any).await.unwrap_err();
        assert_eq!(e.error_type(), "webhook_not_allowed", "{url}: {e}");
    }
}

#[tokio::test]
async fn retries_follow_the_schedule() {
    // What the store does with the schedule: a receiver failing every time gets exactly the
    // schedule's tries.
    let (base, log) = receiver().await;
    let schedule: webhook::RetrySchedule = "0.05,0.1".parse().unwrap();
    let mut attempts = 0u32;
    let t = Instant::now();
    while let Some(delay) = schedule.next_delay(attempts) {
        tokio::time::sleep(delay).await;
        attempts += 1;
        let d = webhook::deliver(
            &Client::default(),
            &format!("{base}/fail"),
            &event(attempts),
            BODY,
            None,
            &Allow::any(),
        )
        .await;
        assert!(!d.ok);
    }
    assert_eq!(attempts, 3);
    assert!(t.elapsed() >= Duration::from_millis(150));
    let got = log.all();
    let numbers: Vec<&str> = got
        .iter()
        .map(|r| header(r, "x-lipsync-attempt").unwrap())
        .collect();
    assert_eq!(numbers, ["1", "2", "3"]);
    assert!(got
        .iter()
        .all(|r| header(r, "x-lipsync-delivery") == Some(event(1).delivery_id)));
}
