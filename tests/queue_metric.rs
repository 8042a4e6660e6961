//! `lipsync_queue_seconds{class}`, the queue-time signal for autoscaling, on a running server:
//! above 0 while a request's frames wait for the model, back to 0 once it is done. Batches
//! are stalled through the test build's fault hook (`LIPSYNC_TEST_FAULTS=batch_delay_ms:N`)
//! so the frames stay queued long enough to be seen.

mod common;

use std::time::{Duration, Instant};

use common::server::{decoded_frames, Server};

const LIVE: &str = "lipsync_queue_seconds{class=\"live\"}";
const INTERACTIVE: &str = "lipsync_queue_seconds{class=\"interactive\"}";
const BATCH: &str = "lipsync_queue_seconds{class=\"batch\"}";

#[tokio::test(flavor = "multi_thread")]
async fn queue_seconds_rise_while_a_request_waits_and_return_to_zero() {
    // 25 frames at batches of 8 (first batch 2): four batches of at least 300 ms each.
    let s = Server::start_with_faults("batch_delay_ms:300");
    s.wait_ready().await;
    let text = s.metrics().await;
    assert!(
        text.contains("# HELP lipsync_queue_seconds Model work waiting, in seconds"),
        "no description:\n{text}"
    );
    assert!(text.contains("# TYPE lipsync_queue_seconds gauge"));
    assert_eq!(s.metric(LIVE).await, 0.0);
    assert_eq!(s.metric(INTERACTIVE).await, 0.0);
    assert_eq!(s.metric(BATCH).await, 0.0);

    let url = s.url("/v1/lipsync");
    let request = tokio::spawn(async move {
        let r = reqwest::Client::new()
            .post(url)
            .multipart(common::server::lipsync_form(
                "arctic_a0007_1s.wav",
                "astronaut.png",
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap()
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = 0.0f64;
    while seen <= 0.0 && !request.is_finished() {
        assert!(Instant::now() < deadline, "the request never finished");
        seen = seen.max(s.metric(INTERACTIVE).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(seen > 0.0, "the queued frames never showed as queue time");
    // No live session, no batch job: nothing queued there.
    assert_eq!(s.metric(LIVE).await, 0.0);
    assert_eq!(s.metric(BATCH).await, 0.0);

    let body = request.await.unwrap();
    assert_eq!(decoded_frames(&body), 25);
    // Every frame has been through the model: nothing waits.
    assert_eq!(s.metric(INTERACTIVE).await, 0.0);
    assert_eq!(s.metric("lipsync_queue_frames").await, 0.0);
}
