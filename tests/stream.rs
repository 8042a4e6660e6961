//! Live sessions (`GET /v1/stream`) over a real loopback WebSocket: auth and Origin before the
//! upgrade, 426 without one, the opening message and its refusals, idle frames before speech,
//! speech, interrupt, end, session admission and a client that vanishes; and, on the engine
//! directly, that a session draws exactly the frames of the file path for the same audio.
//!
//! The servers run on the echo device (`Server::start_echo`: the model stand-in that costs
//! nothing), since these tests are about the sessions, not the model; the refusal below
//! `min_draw_fps` runs on the CPU model it measures, and the parity tests on the engine run
//! the real model.

mod common;

use common::media;
use common::server::Server;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use lipsync::engine::scheduler::Drawn;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{self, Message};

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Every wait in these tests is bounded by this.
const LIMIT: Duration = Duration::from_secs(120);

fn ws_url(s: &Server, query: &str) -> String {
    s.url(&format!("/v1/stream{query}"))
        .replacen("http://", "ws://", 1)
}

async fn connect_with(
    s: &Server,
    query: &str,
    headers: &[(&str, &str)],
) -> Result<Ws, tungstenite::Error> {
    let mut req = ws_url(s, query).into_client_request().unwrap();
    for (k, v) in headers {
        req.headers_mut().insert(
            tungstenite::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    tokio::time::timeout(LIMIT, tokio_tungstenite::connect_async(req))
        .await
        .expect("connect timed out")
        .map(|(ws, _)| ws)
}

fn refused_status(r: Result<Ws, tungstenite::Error>) -> u16 {
    match r {
        Err(tungstenite::Error::Http(res)) => res.status().as_u16(),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("the upgrade was accepted"),
    }
}

/// 16 kHz mono s16le of the one-second ARCTIC clip.
fn speech_pcm() -> (Vec<f32>, Vec<u8>) {
    let samples = lipsync::media::audio::load(&media("arctic_a0007_1s.wav"), 60.0)
        .unwrap()
        .samples;
    let pcm = samples
        .iter()
        .flat_map(|s| ((s * 32_768.0).round().clamp(-32_768.0, 32_767.0) as i16).to_le_bytes())
        .collect();
    (samples, pcm)
}

/// What a session sent, in order.
#[derive(Debug, Default)]
struct Received {
    texts: Vec<serde_json::Value>,
    /// (index, pts, jpeg length, audio bytes)
    frames: Vec<(u32, f64, usize, usize)>,
    close: Option<(u16, String)>,
    /// `fmp4` output: the binary messages as they came.
    fmp4: bool,
    raw: Vec<Vec<u8>>,
    /// `jpeg` output: keep each frame's JPEG in `jpegs`.
    keep_jpegs: bool,
    jpegs: Vec<Vec<u8>>,
}

impl Received {
    fn events(&self, kind: &str) -> Vec<u64> {
        self.texts
            .iter()
            .filter(|t| t["type"] == kind)
            .map(|t| t["frame"].as_u64().unwrap())
            .collect()
    }
}

/// Reads messages until `stop` says so, the socket closes, or `LIMIT`.
async fn read_until(ws: &mut Ws, got: &mut Received, stop: impl Fn(&Received) -> bool) {
    let deadline = Instant::now() + LIMIT;
    while !stop(got) {
        let left = deadline.saturating_duration_since(Instant::now());
        let msg = match tokio::time::timeout(left, ws.next()).await {
            Err(_) => panic!("timed out; so far: {:?}", got.texts),
            Ok(None) | Ok(Some(Err(_))) => return,
            Ok(Some(Ok(m))) => m,
        };
        match msg {
            Message::Text(t) => got.texts.push(serde_json::from_str(&t).unwrap()),
            Message::Binary(b) if got.fmp4 => got.raw.push(b.to_vec()),
            Message::Binary(b) => {
                let index = u32::from_le_bytes(b[0..4].try_into().unwrap());
                let pts = f64::from_le_bytes(b[4..12].try_into().unwrap());
                let n = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
                let jpeg = &b[16..16 + n];
                assert_eq!(&jpeg[..2], &[0xff, 0xd8], "frame {index} is not a JPEG");
                if got.keep_jpegs {
                    got.jpegs.push(jpeg.to_vec());
                }
                got.frames.push((index, pts, n, b.len() - 16 - n));
            }
            Message::Close(c) => {
                got.close = c.map(|c| (u16::from(c.code), c.reason.to_string()));
                return;
            }
            _ => {}
        }
    }
}

/// The opening of a 25 fps session on 16 kHz s16le mono that takes any drawing rate
/// (`min_draw_fps` 0): these tests are about the session, not admission, and a test build on
/// a busy CPU draws far below the default 5 faces/s.
fn opening(avatar: &str, output: &str) -> Message {
    Message::Text(
        serde_json::json!({
            "avatar_id": avatar, "fps": 25,
            "audio": {"format": "s16le", "sample_rate": 16000, "channels": 1},
            "output": output, "min_draw_fps": 0,
        })
        .to_string()
        .into(),
    )
}

async fn open_session(s: &Server, avatar: &str) -> (Ws, Received) {
    let mut ws = connect_with(s, "", &[]).await.unwrap();
    ws.send(opening(avatar, "jpeg")).await.unwrap();
    let mut got = Received::default();
    read_until(&mut ws, &mut got, |g| !g.texts.is_empty()).await;
    assert_eq!(got.texts[0]["type"], "ready", "{:?}", got.texts);
    (ws, got)
}

/// Speaking frames of an utterance of `samples` 16 kHz samples at 25 fps, as a file's video
/// has: the frames that cover all of its audio (the model draws the file rule's; those past
/// its last one hold its face).
fn utterance_frames(samples: &[f32]) -> u64 {
    let mel = lipsync::media::audio::mel_spectrogram(samples);
    let plan = lipsync::media::audio::FramePlan::new(mel.frames(), "25".parse().unwrap()).unwrap();
    let covering = (samples.len() as f64 / 16_000.0 * 25.0).ceil() as usize;
    covering.max(plan.len()) as u64
}

/// Sends `pcm` in 40 ms messages, paced in real time, split at odd byte offsets (samples cut
/// across messages). Returns when the last message was sent (it then waits out that message's
/// 40 ms before returning).
async fn send_paced(ws: &mut Ws, pcm: &[u8]) -> Instant {
    let t0 = Instant::now();
    let mut last = t0;
    for (i, chunk) in pcm.chunks(1281).enumerate() {
        ws.send(Message::Binary(chunk.to_vec().into()))
            .await
            .unwrap();
        last = Instant::now();
        let due = t0 + Duration::from_secs_f64((i + 1) as f64 * 1281.0 / 32_000.0);
        tokio::time::sleep_until(due.into()).await;
    }
    last
}

#[tokio::test(flavor = "multi_thread")]
async fn auth_origin_and_upgrade_are_checked_before_the_session() {
    let s = Server::start_echo(&[
        "--max-sessions",
        "20",
        "--api-key",
        "sekret",
        "--cors-origins",
        "https://app.example",
    ]);
    s.wait_ready().await;
    // A plain GET: 426 with the JSON error shape (with the key, so auth passes).
    let r = reqwest::Client::new()
        .get(s.url("/v1/stream"))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 426);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error_type"], "upgrade_required");
    // No key, a wrong key: 401.
    assert_eq!(refused_status(connect_with(&s, "", &[]).await), 401);
    assert_eq!(
        refused_status(connect_with(&s, "?api_key=nope", &[]).await),
        401
    );
    // The key as a header or in the query.
    connect_with(&s, "", &[("authorization", "Bearer sekret")])
        .await
        .unwrap();
    connect_with(&s, "?api_key=sekret", &[]).await.unwrap();
    // Origins: a listed one and the server's own host pass, another site does not.
    let host = s.base.trim_start_matches("http://").to_string();
    let own = format!("http://{host}");
    for (origin, ok) in [
        ("https://app.example", true),
        (own.as_str(), true),
        ("https://evil.example", false),
    ] {
        let r = connect_with(&s, "?api_key=sekret", &[("origin", origin)]).await;
        if ok {
            r.unwrap_or_else(|e| panic!("{origin}: {e}"));
        } else {
            assert_eq!(refused_status(r), 403, "{origin}");
        }
    }
    // The key in a query string never reaches the log.
    assert!(s.log().iter().all(|l| !l.contains("sekret")));
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_openings_get_an_error_and_a_close_code() {
    let s = Server::start_echo(&["--max-sessions", "20"]);
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let cases: Vec<(Message, u16, &str)> = vec![
        (Message::Text("hello".into()), 1008, "bad_message"),
        (Message::Binary(vec![0u8; 64].into()), 1008, "bad_message"),
        (
            Message::Text(
                serde_json::json!({"avatar_id": avatar, "audio": {"format": "s16le", "sample_rate": 16000, "channels": 3}})
                    .to_string()
                    .into(),
            ),
            1008,
            "bad_audio_format",
        ),
        (
            Message::Text(
                serde_json::json!({"avatar_id": avatar, "audio": {"format": "mp3"}})
                    .to_string()
                    .into(),
            ),
            1008,
            "bad_audio_format",
        ),
        (
            Message::Text(serde_json::json!({"avatar_id": avatar, "fps": 0}).to_string().into()),
            1008,
            "bad_fps",
        ),
        (
            Message::Text(
                serde_json::json!({"avatar_id": avatar, "min_draw_fps": -1})
                    .to_string()
                    .into(),
            ),
            1008,
            "bad_min_draw_fps",
        ),
        (
            // No enhancer is loaded on this server.
            Message::Text(
                serde_json::json!({"avatar_id": avatar, "enhance": "esrgan"})
                    .to_string()
                    .into(),
            ),
            1008,
            "enhancer_not_loaded",
        ),
        (opening("0123456789abcdef", "jpeg"), 4404, "avatar_not_found"),
    ];
    for (first, code, kind) in cases {
        let mut ws = connect_with(&s, "", &[]).await.unwrap();
        ws.send(first).await.unwrap();
        let mut got = Received::default();
        read_until(&mut ws, &mut got, |g| g.close.is_some()).await;
        assert_eq!(got.texts.len(), 1, "{kind}: {:?}", got.texts);
        assert_eq!(got.texts[0]["type"], "error");
        assert_eq!(got.texts[0]["error_type"], kind, "{:?}", got.texts[0]);
        assert!(got.texts[0]["error"].as_str().unwrap().len() > 5);
        assert_eq!(got.close.as_ref().map(|c| c.0), Some(code), "{kind}");
    }
    // The server is fine afterwards.
    assert_eq!(reqwest::get(s.url("/health")).await.unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_session_with_an_enhancer_draws_its_frames_through_it() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("tiny-x2.safetensors");
    common::tiny_enhancer(&ck, 0.2);
    let s = Server::start_echo(&[
        "--utterance-gap-ms",
        "2000",
        "--enhancer-checkpoint",
        &ck.display().to_string(),
    ]);
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let mut ws = connect_with(&s, "", &[]).await.unwrap();
    let open = serde_json::json!({
        "avatar_id": avatar, "output": "jpeg", "min_draw_fps": 0, "enhance": "tiny-x2",
    });
    ws.send(Message::Text(open.to_string().into()))
        .await
        .unwrap();
    let mut got = Received::default();
    read_until(&mut ws, &mut got, |g| g.frames.len() >= 5).await;
    assert_eq!(got.texts[0]["type"], "ready", "{:?}", got.texts);
    let (_, pcm) = speech_pcm();
    send_paced(&mut ws, &pcm).await;
    ws.send(Message::Text(r#"{"type":"end"}"#.into()))
        .await
        .unwrap();
    read_until(&mut ws, &mut got, |g| g.close.is_some()).await;
    let end = got.texts.iter().find(|t| t["type"] == "end").expect("end");
    assert_eq!(end["stats"]["speaking_frames"], 25, "{end}");
    assert!(end["stats"]["drawn_frames"].as_u64().unwrap() > 0, "{end}");
    assert_eq!(got.close.as_ref().map(|c| c.0), Some(1000));
}

/// An echo server with a full-size compact x4 enhancer, `heavy-x4` (realesr-general-x4v3's
/// shapes, small random weights): a third of a second or more per face on these cores, where
/// the echo stand-in draws thousands of faces a second.
fn heavy_enhancer_server(dir: &std::path::Path) -> Server {
    let ck = dir.join("heavy-x4.safetensors");
    let keys = common::compact_tensors(64, 32, 4);
    common::write_checkpoint(&ck, &keys, &|_, i| 0.01 * ((i % 13) as f32 - 6.0));
    Server::start_echo(&["--enhancer-checkpoint", &ck.display().to_string()])
}

/// An opening on `avatar` for JPEG frames, with `min_draw_fps` and maybe an enhancer.
fn enhanced_opening(avatar: &str, min_draw_fps: f64, enhance: Option<&str>) -> Message {
    let mut o = serde_json::json!({
        "avatar_id": avatar, "output": "jpeg", "min_draw_fps": min_draw_fps,
    });
    if let Some(e) = enhance {
        o["enhance"] = e.into();
    }
    Message::Text(o.to_string().into())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_enhanced_session_takes_the_session_slots_its_faces_weigh() {
    // One heavy-x4 face costs more than the engine's whole budget of generator faces for a
    // 25 fps session, so /info offers one such session beside many plain ones. While one is
    // open (it accepts any drawing rate), the slots are taken: a second enhanced session and
    // a plain one are refused with over_capacity; once it has closed, a plain one opens.
    let dir = tempfile::tempdir().unwrap();
    let s = heavy_enhancer_server(dir.path());
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let info = s.info().await;
    let plain_max = info["sessions"]["max_sessions"].as_u64().unwrap();
    assert!(plain_max >= 2, "{info}");
    assert_eq!(info["enhancers"][0]["live_max_sessions"], 1, "{info}");
    let mut first = connect_with(&s, "", &[]).await.unwrap();
    first
        .send(enhanced_opening(&avatar, 0.0, Some("heavy-x4")))
        .await
        .unwrap();
    let mut got = Received::default();
    read_until(&mut first, &mut got, |g| !g.texts.is_empty()).await;
    assert_eq!(got.texts[0]["type"], "ready", "{:?}", got.texts);
    for enhance in [Some("heavy-x4"), None] {
        let mut ws = connect_with(&s, "", &[]).await.unwrap();
        ws.send(enhanced_opening(&avatar, 0.0, enhance))
            .await
            .unwrap();
        let mut got = Received::default();
        read_until(&mut ws, &mut got, |g| g.close.is_some()).await;
        let refusal = &got.texts[0];
        assert_eq!(
            refusal["error_type"], "over_capacity",
            "{enhance:?}: {refusal}"
        );
        assert!(
            refusal["error"]
                .as_str()
                .unwrap()
                .contains("live sessions at 25 fps"),
            "{refusal}"
        );
    }
    first
        .send(Message::Text(r#"{"type":"end"}"#.into()))
        .await
        .unwrap();
    read_until(&mut first, &mut got, |g| g.close.is_some()).await;
    // The slot is freed when the session's thread has ended.
    let deadline = Instant::now() + LIMIT;
    while s.metric("lipsync_stream_sessions").await != 0.0 {
        assert!(
            Instant::now() < deadline,
            "the enhanced session never closed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let (_ws, got) = open_session(&s, &avatar).await;
    assert_eq!(got.texts[0]["type"], "ready");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_enhancers_cost_counts_in_a_sessions_drawing_rate() {
    // A full-size compact x4 network (realesr-general-x4v3's shapes, small random weights):
    // a third of a second or more per face on these cores, where the echo stand-in draws
    // thousands of faces a second. A session asking to draw every frame is admitted without
    // it and refused with it.
    let dir = tempfile::tempdir().unwrap();
    let s = heavy_enhancer_server(dir.path());
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    // Let the instances' recent batches be measured.
    let info = s.info().await;
    let plain = info["sessions"]["draw_fps"].as_f64().unwrap();
    let heavy = info["enhancers"][0]["live_draw_fps"].as_f64().unwrap();
    assert!(plain >= 25.0, "{info}");
    assert!(heavy < 25.0 && heavy > 0.0, "{info}");
    let open = |enhance: Option<&str>| enhanced_opening(&avatar, 25.0, enhance);
    let mut ws = connect_with(&s, "", &[]).await.unwrap();
    ws.send(open(Some("heavy-x4"))).await.unwrap();
    let mut got = Received::default();
    read_until(&mut ws, &mut got, |g| g.close.is_some()).await;
    assert_eq!(
        got.texts[0]["error_type"], "over_capacity",
        "{:?}",
        got.texts
    );
    assert!(
        got.texts[0]["draw_fps"].as_f64().unwrap() < 25.0,
        "{:?}",
        got.texts
    );
    let mut ws = connect_with(&s, "", &[]).await.unwrap();
    ws.send(open(None)).await.unwrap();
    let mut got = Received::default();
    read_until(&mut ws, &mut got, |g| !g.texts.is_empty()).await;
    assert_eq!(got.texts[0]["type"], "ready", "{:?}", got.texts);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_session_idles_speaks_the_file_plan_and_ends() {
    let s = Server::start_echo(&["--utterance-gap-ms", "2000"]);
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let (mut ws, mut got) = open_session(&s, &avatar).await;
    let ready = &got.texts[0];
    assert_eq!(ready["mime"], "image/jpeg");
    assert_eq!(ready["fps"], 25.0);
    assert!(ready["width"].as_u64().unwrap() > 0);
    // Idle frames come before any speech.
    read_until(&mut ws, &mut got, |g| g.frames.len() >= 5).await;
    assert_eq!(got.events("idle"), vec![0]);
    let (_, pcm) = speech_pcm();
    send_paced(&mut ws, &pcm).await;
    ws.send(Message::Text(r#"{"type":"end"}"#.into()))
        .await
        .unwrap();
    read_until(&mut ws, &mut got, |g| g.close.is_some()).await;

    // Frame numbers and timestamps without gaps; every frame carries 40 ms of audio.
    for (i, f) in got.frames.iter().enumerate() {
        assert_eq!(f.0 as usize, i);
        assert!((f.1 - i as f64 / 25.0).abs() < 1e-9);
        assert_eq!(f.3, 640 * 2);
    }
    let speaking = got.events("speaking");
    let idle = got.events("idle");
    assert_eq!(speaking.len(), 1, "{:?}", got.texts);
    assert_eq!(idle.len(), 2, "{:?}", got.texts);
    // The utterance has the frames that cover its audio (one second: 25), drawn or held.
    let (samples, _) = speech_pcm();
    let n = utterance_frames(&samples);
    assert_eq!(n, 25);
    assert_eq!(idle[1] - speaking[0], n, "{:?}", got.texts);
    let end = got
        .texts
        .iter()
        .find(|t| t["type"] == "end")
        .expect("end message");
    let stats = &end["stats"];
    assert_eq!(stats["speaking_frames"], n, "{end}");
    assert_eq!(stats["utterances"], 1);
    let (drawn, held) = (
        stats["drawn_frames"].as_u64().unwrap(),
        stats["held_frames"].as_u64().unwrap(),
    );
    assert!(drawn > 0, "{end}");
    assert_eq!(drawn + held, n, "{end}");
    // The closing `idle` counts the utterance's frames as the end message does.
    let closing = got
        .texts
        .iter()
        .filter(|t| t["type"] == "idle")
        .nth(1)
        .unwrap();
    assert_eq!(closing["drawn_frames"], drawn, "{closing}");
    assert_eq!(closing["held_frames"], held, "{closing}");
    // A frame waits for its mel window, 212.5 ms of audio past its start; these chunks hold
    // 40 ms each and arrive as they begin, so that audio comes with a chunk arriving at least
    // 172.5 ms after the frame's own.
    let p50 = end["stats"]["latency_ms_p50"].as_f64().unwrap();
    assert!(p50 > 172.0, "{end}");
    assert_eq!(got.close.as_ref().map(|c| c.0), Some(1000));
    // Events precede their frames: `end` is the last text.
    assert_eq!(got.texts.last().unwrap()["type"], "end");
    let metrics = s.metrics().await;
    assert!(
        metrics.contains("lipsync_stream_latency_seconds_bucket{le=\"0.3\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("lipsync_stream_late_frames_total"));
    assert_eq!(s.metric("lipsync_stream_sessions").await, 0.0);
}

/// An echo server that draws faces one at a time, each batch stalled 20 ms (the debug
/// build's fault hook): at most 50 a second, whatever the machine. Speech sent faster than
/// real time is drawn, and its frames sent, as fast as the engine and encoder go; a test of
/// what happens to speech not yet sent must not depend on how fast that is.
fn start_paced_echo(extra: &[&str]) -> Server {
    let mut args = vec!["--instances", "1", "--max-batch", "1"];
    args.extend_from_slice(extra);
    Server::start_with(
        common::server::ECHO,
        &args,
        &[("LIPSYNC_TEST_FAULTS", "batch_delay_ms:20")],
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn clear_interrupts_speech_at_once() {
    let s = start_paced_echo(&["--utterance-gap-ms", "5000"]);
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let (mut ws, mut got) = open_session(&s, &avatar).await;
    // Ten seconds of speech at once, then an interrupt once speech has begun.
    let (_, pcm) = speech_pcm();
    let long: Vec<u8> = pcm.iter().copied().cycle().take(pcm.len() * 10).collect();
    ws.send(Message::Binary(long.into())).await.unwrap();
    read_until(&mut ws, &mut got, |g| !g.events("speaking").is_empty()).await;
    let t = Instant::now();
    ws.send(Message::Text(r#"{"type":"clear"}"#.into()))
        .await
        .unwrap();
    read_until(&mut ws, &mut got, |g| {
        let speaking = g.events("speaking");
        g.events("idle").iter().any(|&i| i > speaking[0])
    })
    .await;
    let back_to_idle = t.elapsed();
    // (Speech that reaches the server at once may start on frame 0, before any idle frame.)
    let speaking = got.events("speaking");
    let idle_again = got.events("idle").into_iter().find(|&i| i > speaking[0]);
    let idle_again = idle_again.expect("idle after the interrupt");
    assert!(
        idle_again - speaking[0] < 250,
        "speech was not cut: {:?}",
        got.texts
    );
    assert!(back_to_idle < Duration::from_secs(20), "{back_to_idle:?}");
    ws.send(Message::Text(r#"{"type":"end"}"#.into()))
        .await
        .unwrap();
    read_until(&mut ws, &mut got, |g| g.close.is_some()).await;
    let end = got.texts.iter().find(|t| t["type"] == "end").expect("end");
    assert_eq!(end["stats"]["interrupted"], 1);
    // The interrupted frames left the queue.
    assert_eq!(s.metric("lipsync_queue_frames").await, 0.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn sessions_are_bounded_and_a_vanished_client_frees_its_slot() {
    let s = Server::start_echo(&["--max-sessions", "1"]);
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let (mut ws, _) = open_session(&s, &avatar).await;
    let (_, pcm) = speech_pcm();
    ws.send(Message::Binary(pcm.into())).await.unwrap();
    // A second session: 429 with Retry-After at the upgrade.
    let mut req = ws_url(&s, "").into_client_request().unwrap();
    req.headers_mut().insert("x-test", "1".parse().unwrap());
    match tokio_tungstenite::connect_async(req).await {
        Err(tungstenite::Error::Http(res)) => {
            assert_eq!(res.status(), 429);
            assert!(res.headers().contains_key("retry-after"));
        }
        other => panic!("second session not refused: {:?}", other.map(|_| ())),
    }
    // The first client vanishes mid-speech (no close frame).
    drop(ws);
    let deadline = Instant::now() + LIMIT;
    while s.metric("lipsync_stream_sessions").await != 0.0 {
        assert!(Instant::now() < deadline, "the session never closed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    while s.metric("lipsync_queue_frames").await != 0.0 {
        assert!(Instant::now() < deadline, "its frames stayed queued");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Its slot is free again.
    let (mut ws, _) = open_session(&s, &avatar).await;
    ws.send(Message::Close(Some(tungstenite::protocol::CloseFrame {
        code: CloseCode::Normal,
        reason: "".into(),
    })))
    .await
    .unwrap();
}

/// The engine with the test weights, as `serve` would start it (small batches), and the media
/// settings that go with it.
fn test_engine() -> (lipsync::engine::Engine, lipsync::config::MediaArgs) {
    engine_from(&[
        "--checkpoint",
        common::checkpoint("zip_bare.pt").to_str().unwrap(),
        "--max-batch",
        "8",
        "--first-batch",
        "2",
    ])
}

/// The astronaut photo prepared as an avatar, as `serve` would with these settings.
fn astronaut(media_args: &lipsync::config::MediaArgs) -> Arc<lipsync::engine::Avatar> {
    Arc::new(
        lipsync::engine::Avatar::prepare(
            &media("astronaut.png"),
            &media_args.image_limits(),
            None,
            Default::default(),
            Default::default(),
        )
        .unwrap(),
    )
}

/// The engine and media settings `serve` would make of these flags.
fn engine_from(flags: &[&str]) -> (lipsync::engine::Engine, lipsync::config::MediaArgs) {
    use clap::Parser;
    #[derive(Parser)]
    struct Args {
        #[command(flatten)]
        engine: lipsync::config::EngineArgs,
        #[command(flatten)]
        media: lipsync::config::MediaArgs,
    }
    let args = Args::parse_from(std::iter::once(&"t").chain(flags));
    let cfg = args.engine.resolve(&args.media);
    let (engine, _) = args
        .engine
        .start_engine(&cfg, false, Default::default())
        .unwrap();
    engine.wait_ready().unwrap();
    (engine, args.media)
}

/// A session on 16 kHz s16le mono that only `end` closes (a long utterance gap), drawing
/// every frame, with a lag long enough that every face the model draws comes in time on a busy
/// CPU: a frame whose face has not come by its due time is held (the last face again), and
/// these tests compare every drawn face with the file path's. (A drawn frame goes out as soon
/// as its face comes; only the held ones, past the model's last frame, wait for their time.)
fn session_config(
    fps: lipsync::media::audio::Fps,
    loop_mode: lipsync::engine::Loop,
) -> lipsync::engine::session::SessionConfig {
    use lipsync::engine::session::{AudioFormat, SampleFormat, SessionConfig};
    SessionConfig {
        fps,
        audio: AudioFormat::new(SampleFormat::S16le, 16_000, 1).unwrap(),
        utterance_gap: Duration::from_secs(30),
        lag: Duration::from_secs(20),
        max_undrawn_seconds: 60.0,
        loop_mode,
        draw_fps: None,
        fair_share: None,
        enhance: None,
    }
}

/// The engine directly, on the echo device: a sink with an audio lead (the fMP4 encoder's)
/// gets the session's audio ahead of the frames as far as it is final, every frame's own
/// share by the time the frame goes out. A `clear` ends the speech where the audio that went
/// out ends, so the frames that carry it still speak and no frame speaks without its sound.
/// When speech stops, the silence after it goes ahead once it is [`LATE_AUDIO`] late,
/// without waiting for the utterance to close.
#[test]
fn audio_goes_ahead_of_the_frames_as_far_as_it_is_final_and_clear_keeps_it_with_its_frames() {
    use lipsync::engine::session::{Activity, Input, OutFrame, Session, Sink};
    let (engine, media_args) = engine_from(&["--device", "echo", "--max-batch", "8"]);
    let avatar = astronaut(&media_args);

    const LEAD: Duration = Duration::from_millis(148); // 4 frames at 25 fps
    const PER_FRAME: usize = 640;
    /// What the sink got, in order.
    enum Got {
        /// A frame: its index, whether the avatar was speaking, its own audio.
        Frame(u64, bool, Vec<f32>),
        /// Audio ahead of the frames.
        Ahead(Vec<f32>),
    }
    struct Lead {
        got: Vec<Got>,
        speaking: bool,
        spoken: usize,
        told: std::sync::mpsc::Sender<()>,
    }
    impl Sink for Lead {
        fn event(
            &mut self,
            a: Activity,
            _: u64,
            _: f64,
            _: &lipsync::engine::session::SessionStats,
        ) -> Result<(), lipsync::engine::Error> {
            self.speaking = a == Activity::Speaking;
            if a == Activity::Idle && self.spoken > 0 {
                let _ = self.told.send(());
            }
            Ok(())
        }
        fn frame(&mut self, f: OutFrame<'_>) -> Result<(), lipsync::engine::Error> {
            self.got
                .push(Got::Frame(f.index, self.speaking, f.audio.to_vec()));
            if self.speaking {
                self.spoken += 1;
                // Ten speaking frames out: time for the clear.
                if self.spoken == 10 {
                    let _ = self.told.send(());
                }
            }
            Ok(())
        }
        fn audio_lead(&self) -> Duration {
            LEAD
        }
        fn audio(&mut self, audio: &[f32]) -> Result<(), lipsync::engine::Error> {
            self.got.push(Got::Ahead(audio.to_vec()));
            Ok(())
        }
    }
    let (_, pcm) = speech_pcm();
    let speech: Vec<f32> = pcm
        .chunks_exact(2)
        .map(|c| f32::from(i16::from_le_bytes([c[0], c[1]])) / 32_768.0)
        .collect();
    let mut scfg = session_config("25".parse().unwrap(), Default::default());
    scfg.lag = Duration::from_millis(500);
    let start = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    let (told, said) = std::sync::mpsc::channel();
    let mut sink = Lead {
        got: Vec::new(),
        speaking: false,
        spoken: 0,
        told,
    };
    // Sends `pcm` in real time from `from` (after the session's start), in 40 ms pieces,
    // until `said` has something.
    let send = |pcm: &[u8], from: Duration| {
        for (i, piece) in pcm.chunks(2 * PER_FRAME).enumerate() {
            let at = start + from + Duration::from_millis(40 * i as u64);
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
            if said.try_recv().is_ok() {
                return;
            }
            tx.send(Input::Audio(piece.to_vec(), at)).unwrap();
        }
    };
    let session = Session::new(
        &engine,
        avatar.clone(),
        &Drawn::face(vec![0; 96 * 96 * 3]),
        scfg,
        start,
    );
    let stats = std::thread::scope(|scope| {
        let sink = &mut sink;
        let run = scope.spawn(move || session.run(&rx, sink).unwrap());
        // The second of speech from 0.4 s (frame 10 on), cut once ten speaking frames have
        // gone out.
        send(&pcm, Duration::from_millis(400));
        tx.send(Input::Clear).unwrap();
        said.recv_timeout(LIMIT).expect("idle after the clear");
        // Then 0.6 s of it from 2 s (frame 50 on), and nothing more for a while: the
        // utterance stays open (a 30 s gap) until `end`.
        send(&pcm[..2 * 15 * PER_FRAME], Duration::from_secs(2));
        std::thread::sleep(
            (start + Duration::from_secs(4)).saturating_duration_since(Instant::now()),
        );
        tx.send(Input::End).unwrap();
        run.join().unwrap()
    });
    engine.shutdown();
    assert_eq!(stats.interrupted, 1, "{stats:?}");
    assert_eq!(stats.utterances, 2, "{stats:?}");
    // Every speaking frame drawn, those kept by the clear included (the echo draws at once).
    assert_eq!(stats.held_frames, 0, "{stats:?}");

    // The audio stream as the sink wrote it, and how far it ran ahead of each frame.
    let mut stream: Vec<f32> = Vec::new();
    let mut frames: Vec<(u64, bool, usize)> = Vec::new(); // index, speaking, ahead (frames)
    for g in &sink.got {
        match g {
            Got::Ahead(a) => {
                assert_eq!(a.len() % PER_FRAME, 0, "whole frames go ahead");
                stream.extend_from_slice(a);
            }
            Got::Frame(k, speaking, own) => {
                assert!(own.is_empty() || own.len() == PER_FRAME);
                stream.extend_from_slice(own);
                let i = frames.len();
                assert_eq!(*k, i as u64, "frames in order");
                let own_end = (i + 1) * PER_FRAME;
                assert!(
                    stream.len() >= own_end,
                    "frame {i} went out before its audio"
                );
                frames.push((*k, *speaking, (stream.len() - own_end) / PER_FRAME));
            }
        }
    }
    // A frame goes out with the audio of the next three frames in the sink already (the
    // fourth follows it at once): no further, and that far.
    let most = frames.iter().map(|f| f.2).max().unwrap();
    assert_eq!(
        most, 3,
        "the audio went no further ahead than the lead, and that far"
    );
    // Two runs of speaking frames: from frame 10, and from frame 50.
    let speaking: Vec<u64> = frames.iter().filter(|f| f.1).map(|f| f.0).collect();
    let first = speaking[0];
    let second = *speaking
        .iter()
        .find(|&&k| k >= 40)
        .expect("the second utterance");
    assert_eq!((first, second), (10, 50));
    let spoken = speaking.iter().filter(|&&k| k < second).count();
    assert_eq!(
        speaking[..spoken],
        (first..first + spoken as u64).collect::<Vec<_>>()[..]
    );
    assert!(
        (11..=16).contains(&spoken),
        "{spoken} speaking frames: the clear came after 10 (or one or two more drawn at \
         once), with at most 4 frames of audio ahead"
    );
    assert_eq!(speaking[spoken..], (50..65).collect::<Vec<u64>>()[..]);
    // What the stream should hold: the first speech up to the cut, the second whole, silence
    // around them.
    let mut want = vec![0.0; stream.len()];
    let cut = spoken * PER_FRAME;
    want[first as usize * PER_FRAME..][..cut].copy_from_slice(&speech[..cut]);
    want[50 * PER_FRAME..][..15 * PER_FRAME].copy_from_slice(&speech[..15 * PER_FRAME]);
    assert!(
        stream == want,
        "the audio stream is not the speech where its frames speak"
    );
    // The silence after the second speech went ahead before `end` closed the utterance: the
    // frame after its last speaking frame, which waits for that close, had its audio out
    // already, and three more.
    let after = &frames[65];
    assert!(!after.1);
    assert_eq!(after.2, 3, "the pause's silence did not go ahead");
}

/// Speaking frames against the file path's (RGB, frame by frame): how the engine batches a
/// session's frames depends on timing, and batches of other sizes may round a value of the
/// CPU pass to the other side of a u8 step, never more, and rarely (at most 1 value in
/// 10 000).
fn assert_like_the_file_path<F: AsRef<[u8]>>(frames: &[F], want: &[Vec<u8>], how: &str) {
    assert_eq!(frames.len(), want.len(), "speaking frames ({how})");
    for (j, (got, want)) in frames.iter().zip(want).enumerate() {
        let got = got.as_ref();
        assert_eq!(
            got.len(),
            want.len(),
            "speaking frame {j} ({how}): its size"
        );
        let n = got.iter().zip(want).filter(|(a, b)| a != b).count();
        let most = got.iter().zip(want).map(|(a, b)| a.abs_diff(*b)).max();
        assert!(
            most <= Some(1) && n * 10_000 <= got.len(),
            "speaking frame {j} ({how}) differs from the file path's: {n} values, by up to \
             {most:?}"
        );
    }
}

/// The engine directly: a session fed the clip in small pieces draws, for its utterance, the
/// same faces as the file path's plan on the same 16 kHz audio (compared composited, pixel
/// for pixel).
#[test]
fn a_session_draws_the_file_paths_frames() {
    use lipsync::engine::session::{self, Activity, Input, OutFrame, Session, Sink};

    let (engine, media_args) = test_engine();
    let avatar = astronaut(&media_args);
    let (samples, pcm) = speech_pcm();
    let fps = "25".parse().unwrap();

    // The file path: plan, submit, composite.
    let speech = lipsync::media::audio::load(&media("arctic_a0007_1s.wav"), 60.0).unwrap();
    assert_eq!(speech.samples, samples);
    let planned = lipsync::engine::plan(&speech, fps, &|_| avatar.crop(0)).unwrap();
    // The session's model inputs are the file plan's, exactly: each window computed from
    // the audio that had arrived when it became final.
    let step = 80.0 / 25.0;
    for (j, f) in planned.frames.iter().enumerate() {
        let first = (j as f64 * step) as usize;
        let prefix = if first + 16 <= (samples.len() - 400) / 200 + 1 {
            (first + 15) * 200 + 400
        } else {
            samples.len()
        };
        let plan_start = if prefix == samples.len() {
            lipsync::media::audio::FramePlan::new(1 + samples.len() / 200, fps)
                .unwrap()
                .start(j)
        } else {
            first
        };
        assert_eq!(
            session::mel_window(&samples[..prefix], plan_start),
            f.mel,
            "frame {j}'s mel window"
        );
    }
    let mut sub = engine.submit(planned.frames).unwrap();
    let mut want = Vec::new();
    while want.len() < sub.total() {
        if let Some(face) = sub.next_face(Duration::from_millis(100)).unwrap() {
            let mut f = avatar.frame.clone();
            lipsync::media::face::paste(&mut f, &avatar.face, &face.face, &avatar.mask);
            want.push(f.rgb);
        }
    }

    // The session: the same audio in 333-byte pieces, then `end`.
    struct Collect(Vec<(u64, Vec<u8>, bool)>, Vec<(Activity, u64)>);
    impl Sink for Collect {
        fn event(
            &mut self,
            a: Activity,
            frame: u64,
            _: f64,
            _: &lipsync::engine::session::SessionStats,
        ) -> Result<(), lipsync::engine::Error> {
            self.1.push((a, frame));
            Ok(())
        }
        fn frame(&mut self, f: OutFrame<'_>) -> Result<(), lipsync::engine::Error> {
            self.0
                .push((f.index, f.picture.decoded()?.rgb.clone(), f.idle));
            Ok(())
        }
    }
    let face = session::idle_face(&engine, &avatar, None, Duration::from_secs(60)).unwrap();
    let scfg = session_config(fps, Default::default());
    let (tx, rx) = std::sync::mpsc::channel();
    for piece in pcm.chunks(333) {
        tx.send(Input::Audio(piece.to_vec(), Instant::now()))
            .unwrap();
    }
    tx.send(Input::End).unwrap();
    let mut sink = Collect(Vec::new(), Vec::new());
    // The session began a second ago: speech starts after 25 idle frames.
    let start = Instant::now() - Duration::from_secs(1);
    let stats = Session::new(&engine, avatar.clone(), &face, scfg, start)
        .run(&rx, &mut sink)
        .unwrap();
    // The utterance covers its second of audio: the model's 22 frames, all drawn, then 3
    // held frames that show its last face again.
    let speaking: Vec<&Vec<u8>> = sink.0.iter().filter(|f| !f.2).map(|f| &f.1).collect();
    assert_eq!(want.len(), 22);
    assert_eq!(stats.speaking_frames, 25, "{stats:?}");
    assert_eq!(speaking.len(), 25);
    assert_eq!(
        (stats.drawn_frames, stats.held_frames),
        (22, 3),
        "{stats:?}"
    );
    for (j, held) in speaking.iter().enumerate().skip(want.len()) {
        assert!(
            *held == speaking[want.len() - 1],
            "frame {j} is not the last face"
        );
    }
    // The model inputs are equal (checked above).
    assert_like_the_file_path(&speaking[..want.len()], &want, "decoded");
    // Idle, speaking, idle.
    let kinds: Vec<Activity> = sink.1.iter().map(|e| e.0).collect();
    assert_eq!(
        kinds,
        vec![Activity::Idle, Activity::Speaking, Activity::Idle]
    );
    // The idle frame is the silent face, not the photo.
    let idle = sink.0.iter().find(|f| f.2).unwrap();
    assert_ne!(idle.1, avatar.frame.rgb);
    engine.shutdown();
}

#[tokio::test(flavor = "multi_thread")]
async fn fmp4_output_is_an_init_segment_then_playable_fragments() {
    let s = Server::start_echo(&["--utterance-gap-ms", "2000"]);
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let mut ws = connect_with(&s, "", &[]).await.unwrap();
    ws.send(opening(&avatar, "fmp4")).await.unwrap();
    let mut got = Received {
        fmp4: true,
        ..Default::default()
    };
    read_until(&mut ws, &mut got, |g| !g.texts.is_empty()).await;
    assert_eq!(got.texts[0]["type"], "ready", "{:?}", got.texts);
    let mime = got.texts[0]["mime"].as_str().unwrap().to_string();
    assert!(
        mime.starts_with("video/mp4; codecs=\"avc1.") && mime.ends_with(", mp4a.40.2\""),
        "{mime}"
    );
    read_until(&mut ws, &mut got, |g| g.raw.len() >= 3).await;
    let (_, pcm) = speech_pcm();
    send_paced(&mut ws, &pcm).await;
    ws.send(Message::Text(r#"{"type":"end"}"#.into()))
        .await
        .unwrap();
    read_until(&mut ws, &mut got, |g| g.close.is_some()).await;
    assert_eq!(
        got.close.as_ref().map(|c| c.0),
        Some(1000),
        "{:?}",
        got.texts
    );
    // The init segment first, then moof+mdat fragments, one per message.
    assert_eq!(&got.raw[0][4..8], b"ftyp");
    assert!(got.raw[0].windows(4).any(|w| w == b"moov"));
    for (i, m) in got.raw[1..].iter().enumerate() {
        assert!(
            m.windows(4).any(|w| w == b"moof"),
            "message {i} has no moof"
        );
        assert!(
            m.windows(4).any(|w| w == b"mdat"),
            "message {i} has no mdat"
        );
    }
    // Together a playable video with every frame sent (idle frames that were due while late
    // speech was drawn come at once, so the count is the session's), and an audio track.
    let video: Vec<u8> = got.raw.concat();
    let end = got.texts.iter().find(|t| t["type"] == "end").expect("end");
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), &video).unwrap();
    let probe = std::process::Command::new("ffprobe")
        .args(["-v", "error", "-count_packets", "-select_streams", "v"])
        .args(["-show_entries", "stream=nb_read_packets", "-of", "csv=p=0"])
        .arg(f.path())
        .output()
        .unwrap();
    let frames: u64 = String::from_utf8_lossy(&probe.stdout)
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        frames,
        end["stats"]["frames"].as_u64().unwrap(),
        "{:?}",
        got.texts
    );
    // (ffprobe decodes all but the first one or two: the stream is cut into fragments as it
    // is encoded, and its decoder starts on them late, as a player joining it does)
    assert!(common::server::decoded_frames(&video) + 3 > frames);
    let probe = std::process::Command::new("ffprobe")
        .args([
            "-v",
            "error",
            "-show_entries",
            "stream=codec_name",
            "-of",
            "csv=p=0",
        ])
        .arg(f.path())
        .output()
        .unwrap();
    let codecs = String::from_utf8_lossy(&probe.stdout);
    assert!(
        codecs.contains("h264") && codecs.contains("aac"),
        "{codecs}"
    );
    // Latency counts from a chunk's arrival until the fragment with its frame goes out, so
    // it holds the mel window's 212.5 ms of audio past the frame's start, which comes with a
    // 40 ms chunk arriving at least 172.5 ms after the frame's own (as for JPEG above); the
    // encode adds little (a millisecond or two with ultrafast).
    assert!(
        end["stats"]["latency_ms_p50"].as_f64().unwrap() > 172.0,
        "{end}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_reference_client_streams_a_file_and_reports_latency() {
    let s = Server::start_echo(&[]);
    s.wait_ready().await;
    let out = tempfile::tempdir().unwrap();
    let mp4 = out.path().join("live.mp4");
    let base = s.base.clone();
    let mp4_arg = mp4.clone();
    let run = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_lipsync"))
            .arg("stream")
            .arg(&base)
            .args(["--audio", media_path("arctic_a0007_1s.wav").as_str()])
            .args(["--image", media_path("astronaut.png").as_str()])
            .arg("--out")
            .arg(&mp4_arg)
            .args([
                "--no-pace",
                "--lead-in",
                "0.2",
                "--min-draw-fps",
                "0",
                "--json",
            ])
            .output()
            .unwrap()
    });
    let done = tokio::time::timeout(LIMIT, run)
        .await
        .expect("client timed out")
        .unwrap();
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&done.stdout).unwrap();
    assert_eq!(v["close"], 1000);
    assert_eq!(v["speaking_frames"], 25, "{v}");
    assert!(v["latency_ms"]["p50"].as_f64().unwrap() > 0.0, "{v}");
    let bytes = std::fs::read(&mp4).unwrap();
    assert_eq!(&bytes[4..8], b"ftyp");
    assert!(common::server::decoded_frames(&bytes) > 20);
    // A refused session is a clear error, not a hang: an unknown avatar.
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_lipsync"))
        .arg("stream")
        .arg(&s.base)
        .args(["--audio", media_path("arctic_a0007_1s.wav").as_str()])
        .args(["--avatar-id", "0123456789abcdef", "--no-pace"])
        .arg("--out")
        .arg(out.path().join("bad.mp4"))
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("avatar_not_found"));
}

fn media_path(name: &str) -> String {
    format!("{}/tests/media/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// Opens a session with this opening and reads its first message (`ready` or an error),
/// and, after an error, up to the close.
async fn try_open(s: &Server, opening: serde_json::Value) -> (Ws, Received) {
    let mut ws = connect_with(s, "", &[]).await.unwrap();
    ws.send(Message::Text(opening.to_string().into()))
        .await
        .unwrap();
    let mut got = Received::default();
    read_until(&mut ws, &mut got, |g| !g.texts.is_empty()).await;
    if got.texts[0]["type"] == "error" {
        read_until(&mut ws, &mut got, |g| g.close.is_some()).await;
    }
    (ws, got)
}

/// `/info`'s `sessions.draw_fps`: what one more session would be offered.
async fn offered_draw_fps(s: &Server) -> f64 {
    let v: serde_json::Value = reqwest::get(s.url("/info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["sessions"]["draw_fps"]
        .as_f64()
        .unwrap_or_else(|| panic!("no sessions.draw_fps: {v}"))
}

/// Admission by drawing rate: a session is offered its max-min fair share of the engine's
/// faces beside the open sessions (what `/info` says), and refused after its opening when
/// that is below its `min_draw_fps` (default 5): `over_capacity` with the rate it could get,
/// close 1013. The engine is slowed on purpose (every batch stalls 100 ms), so it offers
/// fewer than 4.5 faces/s on any machine.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_is_refused_below_its_min_draw_fps_beside_the_open_ones() {
    let s = Server::start_with(
        &common::checkpoint("zip_bare.pt").display().to_string(),
        &["--max-sessions", "5"],
        &[("LIPSYNC_TEST_FAULTS", "batch_delay_ms:100")],
    );
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let open = |min_draw_fps: Option<f64>| {
        let mut o = serde_json::json!({"avatar_id": avatar, "fps": 25, "output": "jpeg"});
        if let Some(m) = min_draw_fps {
            o["min_draw_fps"] = m.into();
        }
        o
    };
    let refused = |got: &Received| -> f64 {
        let e = &got.texts[0];
        assert_eq!(e["type"], "error", "{:?}", got.texts);
        assert_eq!(e["error_type"], "over_capacity", "{e}");
        assert!(e["error"].as_str().unwrap().contains("min_draw_fps"), "{e}");
        assert_eq!(got.texts.len(), 1, "{:?}", got.texts);
        assert_eq!(
            got.close.as_ref().map(|c| (c.0, c.1.as_str())),
            Some((1013, "over_capacity"))
        );
        e["draw_fps"]
            .as_f64()
            .unwrap_or_else(|| panic!("no draw_fps: {e}"))
    };
    let alone = offered_draw_fps(&s).await;
    assert!(alone > 0.0 && alone < 4.5, "{alone}");

    // Asking for more than the engine offers: refused, told the rate it could get.
    let (_, got) = try_open(&s, open(Some(alone + 1.0))).await;
    assert_eq!(refused(&got), alone);
    // The default least rate (5 faces/s) is more than this engine draws.
    let (_, got) = try_open(&s, open(None)).await;
    assert_eq!(refused(&got), alone);
    // Refused sessions hold nothing: still the whole engine on offer.
    assert_eq!(offered_draw_fps(&s).await, alone);

    // A session that takes any rate is admitted, and promised what was offered.
    let (mut first, got) = try_open(&s, open(Some(0.0))).await;
    assert_eq!(got.texts[0]["type"], "ready", "{:?}", got.texts);
    assert_eq!(got.texts[0]["draw_fps"], alone, "{:?}", got.texts);
    // Beside it a new session gets a share of what is left (half, the engine's cost being
    // all per frame on a CPU), and one that needs more than that share is refused.
    let beside = offered_draw_fps(&s).await;
    assert!(
        beside > 0.0 && beside < alone,
        "{beside} beside one, {alone} alone"
    );
    let between = (alone + beside) / 2.0;
    let (_, got) = try_open(&s, open(Some(between))).await;
    assert_eq!(refused(&got), beside);
    // (a hair below the share offered, which /info rounds to a tenth)
    let (mut second, got) = try_open(&s, open(Some((beside - 0.1).max(0.0)))).await;
    assert_eq!(got.texts[0]["type"], "ready", "{:?}", got.texts);
    assert_eq!(got.texts[0]["draw_fps"], beside, "{:?}", got.texts);

    // Once the others have gone, the whole engine is on offer again.
    for ws in [&mut first, &mut second] {
        ws.send(Message::Close(None)).await.unwrap();
    }
    let deadline = Instant::now() + LIMIT;
    while s.metric("lipsync_stream_sessions").await != 0.0 {
        assert!(Instant::now() < deadline, "the sessions never closed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(offered_draw_fps(&s).await, alone);
    let (_, got) = try_open(&s, open(Some(between))).await;
    assert_eq!(got.texts[0]["type"], "ready", "{:?}", got.texts);

    // A least rate that is no rate at all: a bad opening.
    let (_, got) = try_open(&s, open(Some(-1.0))).await;
    assert_eq!(
        got.texts[0]["error_type"], "bad_min_draw_fps",
        "{:?}",
        got.texts
    );
    assert_eq!(got.close.as_ref().map(|c| c.0), Some(1008));
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_a_session_finish_its_utterance_then_closes_1001() {
    let s = Server::start_echo(&["--utterance-gap-ms", "5000"]);
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let (mut ws, mut got) = open_session(&s, &avatar).await;
    let (_, pcm) = speech_pcm();
    ws.send(Message::Binary(pcm.into())).await.unwrap();
    read_until(&mut ws, &mut got, |g| !g.events("speaking").is_empty()).await;
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    read_until(&mut ws, &mut got, |g| g.close.is_some()).await;
    assert_eq!(
        got.close.as_ref().map(|c| c.0),
        Some(1001),
        "{:?}",
        got.texts
    );
    let end = got.texts.iter().find(|t| t["type"] == "end").expect("end");
    assert_eq!(
        end["stats"]["speaking_frames"], 25,
        "the utterance was cut: {end}"
    );
    let mut s = s;
    let status = wait_exit(&mut s);
    assert!(status.success(), "{status}");
}

/// Waits (bounded by `LIMIT`) for the server process to exit.
fn wait_exit(s: &mut Server) -> std::process::ExitStatus {
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_mid_utterance_closes_1001_at_the_shutdown_timeout() {
    let s = start_paced_echo(&["--utterance-gap-ms", "5000", "--shutdown-timeout", "1"]);
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let (mut ws, mut got) = open_session(&s, &avatar).await;
    // Ten seconds of speech: far more than the one-second shutdown timeout lets it draw.
    let (_, pcm) = speech_pcm();
    let long: Vec<u8> = pcm.iter().copied().cycle().take(pcm.len() * 10).collect();
    ws.send(Message::Binary(long.into())).await.unwrap();
    read_until(&mut ws, &mut got, |g| !g.events("speaking").is_empty()).await;
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let t = Instant::now();
    read_until(&mut ws, &mut got, |g| g.close.is_some()).await;
    let closed_after = t.elapsed();
    assert_eq!(
        got.close.as_ref().map(|c| (c.0, c.1.as_str())),
        Some((1001, "shutting_down")),
        "{:?}",
        got.texts
    );
    // Closed by the timeout, not by the utterance's end: no `end`, no idle after speech, and
    // far fewer frames than ten seconds of speech.
    let last = got.texts.last().unwrap();
    assert_eq!(last["type"], "error", "{:?}", got.texts);
    assert_eq!(last["error_type"], "shutting_down");
    assert!(
        got.texts.iter().all(|t| t["type"] != "end"),
        "{:?}",
        got.texts
    );
    assert_eq!(got.events("idle"), vec![0], "{:?}", got.texts);
    let speaking = got.events("speaking")[0];
    let spoken = got
        .frames
        .iter()
        .filter(|f| u64::from(f.0) >= speaking)
        .count();
    assert!(
        spoken < 200,
        "{spoken} speaking frames: the utterance was not cut"
    );
    // At the timeout (1 s, checked every 100 ms), not at once and not much later.
    assert!(
        closed_after >= Duration::from_millis(900) && closed_after < Duration::from_secs(10),
        "{closed_after:?}"
    );
    // The server exits cleanly once the session has closed.
    let mut s = s;
    let status = wait_exit(&mut s);
    assert!(status.success(), "{status}");
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
}

#[tokio::test(flavor = "multi_thread")]
async fn silence_longer_than_the_utterance_gap_splits_utterances_and_a_short_pause_does_not() {
    // Gap 500 ms; the pause inside the second burst is 150 ms, the silence between bursts is
    // at least 1.5 s (the second burst waits for the first utterance's closing `idle`).
    const GAP: Duration = Duration::from_millis(500);
    let s = Server::start_echo(&["--utterance-gap-ms", "500"]);
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let (mut ws, mut got) = open_session(&s, &avatar).await;
    let (samples, pcm) = speech_pcm();

    // First burst, then no messages: the utterance closes after the gap and the server goes
    // back to idle on its own.
    // The gap runs from the last audio's arrival (on a fast engine the closing `idle` goes
    // out when the gap ends; a slow one's lag hid when it was measured from).
    let quiet = send_paced(&mut ws, &pcm).await;
    read_until(&mut ws, &mut got, |g| g.events("idle").len() >= 2).await;
    let back_to_idle = quiet.elapsed();
    assert!(back_to_idle >= GAP, "idle after {back_to_idle:?}");
    assert_eq!(got.events("speaking").len(), 1, "{:?}", got.texts);
    let left = Duration::from_millis(1500).saturating_sub(quiet.elapsed());
    tokio::time::sleep(left).await;

    // Second burst, with a pause shorter than the gap half way (at a sample boundary).
    let half = pcm.len() / 4 * 2;
    send_paced(&mut ws, &pcm[..half]).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    send_paced(&mut ws, &pcm[half..]).await;
    // Let it close by the gap too, then end.
    read_until(&mut ws, &mut got, |g| g.events("idle").len() >= 3).await;
    ws.send(Message::Text(r#"{"type":"end"}"#.into()))
        .await
        .unwrap();
    read_until(&mut ws, &mut got, |g| g.close.is_some()).await;
    assert_eq!(
        got.close.as_ref().map(|c| c.0),
        Some(1000),
        "{:?}",
        got.texts
    );

    let speaking = got.events("speaking");
    let idle = got.events("idle");
    assert_eq!(speaking.len(), 2, "{:?}", got.texts);
    assert_eq!(idle.len(), 3, "{:?}", got.texts);
    // idle, speaking, idle, speaking, idle: each utterance has the frames that cover its
    // audio (the second one's two halves joined: the pause adds nothing), idle between.
    let n = utterance_frames(&samples);
    assert_eq!(idle[0], 0);
    assert_eq!(idle[1] - speaking[0], n, "{:?}", got.texts);
    assert_eq!(idle[2] - speaking[1], n, "{:?}", got.texts);
    // The silence shows as idle frames (at least half its 1.5 s), not as speech.
    assert!(speaking[1] - idle[1] >= 18, "{:?}", got.texts);
    let end = got.texts.iter().find(|t| t["type"] == "end").expect("end");
    assert_eq!(end["stats"]["utterances"], 2, "{end}");
    assert_eq!(end["stats"]["speaking_frames"], 2 * n, "{end}");
    // Frame numbers stay continuous across both utterances.
    for (i, f) in got.frames.iter().enumerate() {
        assert_eq!(f.0 as usize, i);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn f32_stereo_48k_is_averaged_and_resampled() {
    let s = Server::start_echo(&["--utterance-gap-ms", "2000", "--max-sessions", "4"]);
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let mut ws = connect_with(&s, "", &[]).await.unwrap();
    let open = serde_json::json!({
        "avatar_id": avatar, "fps": "25/1", "loop": "repeat",
        "audio": {"format": "f32le", "sample_rate": 48000, "channels": 2},
        "output": "jpeg", "min_draw_fps": 0,
    });
    ws.send(Message::Text(open.to_string().into()))
        .await
        .unwrap();
    let mut got = Received::default();
    read_until(&mut ws, &mut got, |g| !g.texts.is_empty()).await;
    assert_eq!(got.texts[0]["type"], "ready", "{:?}", got.texts);
    // One second of a tone on the left channel only, in odd-sized pieces.
    let mut bytes = Vec::new();
    for i in 0..48_000 {
        let v = (2.0 * std::f32::consts::PI * 220.0 * i as f32 / 48_000.0).sin() * 0.5;
        bytes.extend_from_slice(&v.to_le_bytes());
        bytes.extend_from_slice(&0f32.to_le_bytes());
    }
    for piece in bytes.chunks(7_777) {
        ws.send(Message::Binary(piece.to_vec().into()))
            .await
            .unwrap();
    }
    ws.send(Message::Text(r#"{"type":"end"}"#.into()))
        .await
        .unwrap();
    read_until(&mut ws, &mut got, |g| g.close.is_some()).await;
    let end = got.texts.iter().find(|t| t["type"] == "end").expect("end");
    // 16000 samples at 16 kHz: the 25 frames of one second (the model draws the file rule's
    // 22, for its 81 mel columns; the last 3 hold the last face).
    assert_eq!(end["stats"]["speaking_frames"], 25, "{end}");
    assert_eq!(got.close.map(|c| c.0), Some(1000));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_video_avatar_idles_on_its_own_frames_and_speaks_on_them() {
    let s = Server::start_echo(&["--utterance-gap-ms", "2000", "--max-sessions", "4"]);
    s.wait_ready().await;
    let v = s.upload_avatar_file("video", "carphone.mp4").await;
    assert_eq!(v["kind"], "video");
    let id = v["id"].as_str().unwrap().to_string();
    let mut ws = connect_with(&s, "", &[]).await.unwrap();
    let open = serde_json::json!({
        "avatar_id": id, "fps": 25, "loop": "repeat", "output": "jpeg", "min_draw_fps": 0,
    });
    ws.send(Message::Text(open.to_string().into()))
        .await
        .unwrap();
    let mut got = Received {
        keep_jpegs: true,
        ..Received::default()
    };
    read_until(&mut ws, &mut got, |g| g.frames.len() >= 6).await;
    assert_eq!(got.texts[0]["type"], "ready", "{:?}", got.texts);
    assert_eq!(got.texts[0]["width"], v["width"]);
    let size = |k: &str| v[k].as_u64().unwrap() as u32;
    let (width, height) = (size("width"), size("height"));
    // Idle frames are the clip's own frames: they change (photo idle frames are all alike).
    let sizes: std::collections::BTreeSet<usize> = got.frames.iter().map(|f| f.2).collect();
    assert!(sizes.len() > 1, "idle frames do not move: {sizes:?}");
    let (_, pcm) = speech_pcm();
    ws.send(Message::Binary(pcm.into())).await.unwrap();
    ws.send(Message::Text(r#"{"type":"end"}"#.into()))
        .await
        .unwrap();
    read_until(&mut ws, &mut got, |g| g.close.is_some()).await;
    let end = got.texts.iter().find(|t| t["type"] == "end").expect("end");
    assert_eq!(end["stats"]["speaking_frames"], 25, "{end}");
    for (i, f) in got.frames.iter().enumerate() {
        assert_eq!(f.0 as usize, i);
    }
    // Idle frames go out as the clip stores them and speaking ones with only the face's rows
    // encoded again: every one is a whole JPEG of the clip's size.
    assert_eq!(got.jpegs.len(), got.frames.len());
    for (i, j) in got.jpegs.iter().enumerate() {
        let f = lipsync::media::image::decode_jpeg(std::io::Cursor::new(j))
            .unwrap_or_else(|e| panic!("frame {i}: {e}"));
        assert_eq!((f.width, f.height), (width, height), "frame {i}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_silent_client_times_out_and_audio_far_ahead_is_refused() {
    let s = Server::start_echo(&[
        "--session-idle-timeout",
        "1.5",
        "--max-audio-seconds",
        "3",
        "--max-sessions",
        "4",
    ]);
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    // No message after the opening: closed after the idle timeout (frames kept coming).
    let (mut ws, mut got) = open_session(&s, &avatar).await;
    let t = Instant::now();
    read_until(&mut ws, &mut got, |g| g.close.is_some()).await;
    assert!(t.elapsed() < Duration::from_secs(30));
    assert!(!got.frames.is_empty());
    let err = got
        .texts
        .iter()
        .find(|t| t["type"] == "error")
        .expect("error");
    assert_eq!(err["error_type"], "idle_timeout");
    assert_eq!(got.close.map(|c| c.0), Some(1008));
    // Ten seconds of speech at once is over --max-audio-seconds of undrawn audio.
    let (mut ws, mut got) = open_session(&s, &avatar).await;
    let (_, pcm) = speech_pcm();
    let long: Vec<u8> = pcm.iter().copied().cycle().take(pcm.len() * 10).collect();
    ws.send(Message::Binary(long.into())).await.unwrap();
    read_until(&mut ws, &mut got, |g| g.close.is_some()).await;
    let err = got
        .texts
        .iter()
        .find(|t| t["type"] == "error")
        .expect("error");
    assert_eq!(err["error_type"], "bad_stream", "{err}");
    assert!(err["error"].as_str().unwrap().contains("real time"));
    assert_eq!(got.close.map(|c| c.0), Some(1008));
    assert_eq!(reqwest::get(s.url("/health")).await.unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_stops_reading_is_cut_by_the_send_timeout() {
    let s = Server::start_echo(&["--send-timeout", "2", "--max-sessions", "4"]);
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let (mut ws, _) = open_session(&s, &avatar).await;
    // Keep sending audio (so the idle timeout never fires) but read nothing: the frames pile
    // up in the socket buffers until the send timeout cuts the connection.
    let (_, pcm) = speech_pcm();
    let deadline = Instant::now() + LIMIT;
    loop {
        assert!(Instant::now() < deadline, "the session was never cut");
        if s.metric("lipsync_stream_sessions").await == 0.0 {
            break;
        }
        let _ = tokio::time::timeout(
            Duration::from_millis(500),
            ws.send(Message::Binary(pcm[..3200].to_vec().into())),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = (deadline - LIMIT).elapsed();
    assert_eq!(s.metric("lipsync_queue_frames").await, 0.0);
    assert_eq!(reqwest::get(s.url("/health")).await.unwrap().status(), 200);
    drop(s);
    // The same client without a send timeout keeps its session for as long (and longer).
    let s = Server::start_echo(&["--send-timeout", "0", "--max-sessions", "4"]);
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let (mut ws, _) = open_session(&s, &avatar).await;
    let until = Instant::now() + took.max(Duration::from_secs(10));
    while Instant::now() < until {
        let _ = tokio::time::timeout(
            Duration::from_millis(500),
            ws.send(Message::Binary(pcm[..3200].to_vec().into())),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(s.metric("lipsync_stream_sessions").await, 1.0);
}

/// The engine directly, a video avatar: speech that starts at the session's first frame is
/// drawn on the clip frames the file path uses (model frame k on clip frame loop(k)), with the
/// same face inputs, so the composited frames match the file path's.
#[test]
fn a_video_avatar_session_draws_the_file_paths_frames() {
    use lipsync::engine::avatar::Picture;
    use lipsync::engine::session::{Activity, Input, OutFrame, Session, Sink};
    use lipsync::engine::Loop;

    // On the echo device: what is checked here is the media side (which clip frame each
    // frame uses, how it comes, its pixels); the model's faces in a session against the file
    // path's are a_session_draws_the_file_paths_frames'. Its faces come at once, so the
    // sessions' lag is 3 s, not session_config's 20 s (on the CPU model with that lag, the
    // three held frames past the speech waited 20 s in each session: 49 s in all).
    let (engine, media_args) = engine_from(&["--device", "echo", "--max-batch", "8"]);
    // The clip padded to 320 pixels wide, its face moved 72 pixels right: 20 MCU columns,
    // stored in segments of 4 (64 pixels), so a face's segments start inside a row.
    let dir = tempfile::tempdir().unwrap();
    let wide = dir.path().join("carphone_wide.mp4");
    let padded = std::process::Command::new("ffmpeg")
        .args(["-v", "error", "-i"])
        .arg(common::media_path("carphone.mp4"))
        .args(["-vf", "pad=320:144:72:0", "-c:v", "libx264", "-crf", "12"])
        .args(["-pix_fmt", "yuv420p", "-an"])
        .arg(&wide)
        .status()
        .unwrap();
    assert!(padded.success());
    let avatar = Arc::new(
        lipsync::engine::clip::prepare(
            &std::fs::read(&wide).unwrap(),
            &media_args.clip_options(true),
            None,
            Default::default(),
            Default::default(),
        )
        .unwrap(),
    );
    let (_, pcm) = speech_pcm();
    let fps = "25".parse().unwrap();
    let mode = Loop::Repeat;

    // The file path: the clip's face inputs, composited on the frame each model frame uses.
    let speech = lipsync::media::audio::load(&media("arctic_a0007_1s.wav"), 60.0).unwrap();
    let planned = lipsync::engine::plan(&speech, fps, &avatar.crops(mode)).unwrap();
    let mut sub = engine.submit(planned.frames).unwrap();
    let composite = |k: usize, face: &[u8]| {
        let i = avatar.select(k, mode);
        let mut f = avatar.background(i).unwrap().into_owned();
        let b = avatar.face_at(i);
        let mask = lipsync::media::face::BlendMask::new(avatar.blend, b.width(), b.height());
        lipsync::media::face::paste(&mut f, &b, face, &mask);
        f.rgb
    };
    let mut want = Vec::new();
    let mut last_face = Vec::new();
    while want.len() < sub.total() {
        if let Some(face) = sub.next_face(Duration::from_millis(100)).unwrap() {
            want.push(composite(want.len(), &face.face));
            last_face = face.face;
        }
    }
    // The frames past the model's last one, to the end of the audio's second: its last face
    // on the clip frames they show.
    assert_eq!(want.len(), 22);
    for k in want.len()..25 {
        want.push(composite(k, &last_face));
    }

    /// Each frame's pixels, the events, and how each frame came (0: decoded, 1: as the clip
    /// stores it, 2: decoded only in the segments of its face); whether it takes stored
    /// frames; where the decoded parts were.
    struct Collect(Vec<Vec<u8>>, Vec<Activity>, Vec<u8>, bool, Vec<(u32, u32)>);
    impl Sink for Collect {
        fn takes_stored_jpeg(&self) -> bool {
            self.3
        }
        fn event(
            &mut self,
            a: Activity,
            _: u64,
            _: f64,
            _: &lipsync::engine::session::SessionStats,
        ) -> Result<(), lipsync::engine::Error> {
            self.1.push(a);
            Ok(())
        }
        fn frame(&mut self, f: OutFrame<'_>) -> Result<(), lipsync::engine::Error> {
            self.2.push(match f.picture {
                Picture::Image(_) => 0,
                Picture::StoredJpeg(_) => 1,
                Picture::Part { at, .. } => {
                    self.4.push(at);
                    2
                }
            });
            self.0.push(f.picture.decoded()?.into_owned().rgb);
            Ok(())
        }
    }
    let session = |takes_stored| {
        let scfg = lipsync::engine::session::SessionConfig {
            lag: Duration::from_secs(3),
            ..session_config(fps, mode)
        };
        // The audio arrives at the session's start: speech from frame 0.
        let start = Instant::now();
        let (tx, rx) = std::sync::mpsc::channel();
        for piece in pcm.chunks(640) {
            tx.send(Input::Audio(piece.to_vec(), start)).unwrap();
        }
        tx.send(Input::End).unwrap();
        let mut sink = Collect(Vec::new(), Vec::new(), Vec::new(), takes_stored, Vec::new());
        let stats = Session::new(
            &engine,
            avatar.clone(),
            &Drawn::face(Vec::new()),
            scfg,
            start,
        )
        .run(&rx, &mut sink)
        .unwrap();
        (sink, stats)
    };
    let (sink, stats) = session(false);
    assert_eq!(sink.1[0], Activity::Speaking, "speech starts at frame 0");
    assert_eq!(stats.speaking_frames as usize, want.len());
    assert_eq!(
        (stats.drawn_frames, stats.held_frames),
        (22, 3),
        "{stats:?}"
    );
    // The speaking frames, then one idle frame.
    let next = sink.0.len() - 1;
    assert_like_the_file_path(&sink.0[..next], &want, "decoded");
    // After the speech the clip idles on its raw frame (the one the next frame shows).
    let raw = avatar
        .background(avatar.select(next, mode))
        .unwrap()
        .into_owned();
    assert_eq!(sink.0[next], raw.rgb);
    // Speaking frames come decoded (their face pasted); the idle one as the clip stores it
    // (a JPEG output sends it as it is), but for clip frame 0, which the avatar keeps decoded.
    assert!(sink.2[..next].iter().all(|&how| how == 0));
    assert_ne!(avatar.select(next, mode), 0);
    assert_eq!(
        sink.2[next], 1,
        "the idle frame was decoded before the sink"
    );
    // A sink that takes stored frames (JPEG output) gets the speaking frames decoded only in
    // their face's segments, and the same pixels.
    assert!(avatar.stored_by_segments());
    assert_eq!(
        avatar.stored_segments_per_row(),
        Some(5),
        "20 MCUs in segments of 4"
    );
    let (in_parts, stats) = session(true);
    assert_eq!((stats.drawn_frames, stats.held_frames), (22, 3));
    let how: Vec<u8> = (0..=next)
        .map(|k| match (k == next, avatar.select(k, mode)) {
            (true, _) => 1,
            (false, 0) => 0,
            (false, _) => 2,
        })
        .collect();
    assert_eq!(in_parts.2, how);
    // The same pixels as the decoded path's frames: those of the file path (within the
    // batches' rounding), and the idle frame exactly.
    assert_eq!(in_parts.0.len(), sink.0.len());
    assert_like_the_file_path(&in_parts.0[..next], &want, "decoded in segments");
    assert_eq!(in_parts.0[next], sink.0[next]);
    assert!(
        in_parts
            .4
            .iter()
            .all(|&(x, y)| x > 0 && x % 64 == 0 && y % 16 == 0),
        "parts at {:?}",
        in_parts.4
    );
    engine.shutdown();
}
