//! Live sessions over the engine's capacity (`GET /v1/stream`, issue 23): every frame still
//! goes out at its due time, drawn or held (the last face again), with all of its audio; the
//! drawn frames are spread over the speech, and sessions sharing an engine share its faces.
//!
//! The server runs on the echo device (the model stand-in that costs nothing: these tests are
//! about the sessions' clocks, audio and shares, not the model), one instance with batches of
//! one frame, slowed on purpose (the test build's fault hook, `batch_delay_ms`: every batch
//! stalls that long), so a 25 fps session is over capacity on any machine, and the cores stay
//! free for the sessions' own work (on the CPU model they were not: a busy 2-core CI machine
//! delivered frames late). The stall stays well inside a session's lag (which covers the 212.5 ms of audio
//! the model needs, a frame and one batch at the measured cost), so the engine can still draw
//! some of the frames in time. Sessions use JPEG output: one message per frame, with its index
//! and its audio.

mod common;

use common::media;
use common::server::Server;

use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Every wait in these tests is bounded by this.
const LIMIT: Duration = Duration::from_secs(120);

/// The stall added to every batch.
const FAULTS: &str = "batch_delay_ms:50";

const FPS: f64 = 25.0;

/// 16 kHz samples per frame at 25 fps.
const PER_FRAME: usize = 640;

fn start_slowed() -> Server {
    Server::start_with(
        common::server::ECHO,
        &[
            "--utterance-gap-ms",
            "1000",
            "--max-sessions",
            "4",
            "--instances",
            "1",
            "--max-batch",
            "1",
        ],
        &[("LIPSYNC_TEST_FAULTS", FAULTS)],
    )
}

/// `seconds` of speech, 16 kHz s16le mono: the one-second ARCTIC clip over and over.
fn speech(seconds: usize) -> Vec<i16> {
    let one = lipsync::media::audio::load(&media("arctic_a0007_1s.wav"), 60.0)
        .unwrap()
        .samples;
    let one: Vec<i16> = one
        .iter()
        .map(|s| (s * 32_768.0).round().clamp(-32_768.0, 32_767.0) as i16)
        .collect();
    one.iter()
        .copied()
        .cycle()
        .take(one.len() * seconds)
        .collect()
}

/// A sample as the session gives it back: s16 → f32 (÷ 32768) → s16 (× 32767, rounded).
fn round_trip(s: i16) -> i16 {
    let f = f32::from(s) / 32_768.0;
    (f.clamp(-1.0, 1.0) * 32_767.0).round() as i16
}

/// One JPEG frame as it arrived.
struct Frame {
    index: u32,
    pts: f64,
    jpeg: Vec<u8>,
    audio: Vec<i16>,
    at: Instant,
}

/// What a session sent, in order.
#[derive(Default)]
struct Received {
    texts: Vec<serde_json::Value>,
    frames: Vec<Frame>,
    close: Option<u16>,
}

impl Received {
    fn events(&self, kind: &str) -> Vec<&serde_json::Value> {
        self.texts.iter().filter(|t| t["type"] == kind).collect()
    }

    fn end(&self) -> &serde_json::Value {
        let end = self.texts.iter().find(|t| t["type"] == "end");
        &end.unwrap_or_else(|| panic!("no end message: {:?}", self.texts))["stats"]
    }
}

/// Reads everything until the close (or `LIMIT`).
async fn read_all(mut rx: futures_util::stream::SplitStream<Ws>) -> Received {
    let mut got = Received::default();
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let msg = match tokio::time::timeout_at(deadline, rx.next()).await {
            Err(_) => panic!("timed out; so far: {:?}", got.texts),
            Ok(None) | Ok(Some(Err(_))) => return got,
            Ok(Some(Ok(m))) => m,
        };
        match msg {
            Message::Text(t) => got.texts.push(serde_json::from_str(&t).unwrap()),
            Message::Binary(b) => {
                let index = u32::from_le_bytes(b[0..4].try_into().unwrap());
                let pts = f64::from_le_bytes(b[4..12].try_into().unwrap());
                let n = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
                let jpeg = b[16..16 + n].to_vec();
                assert_eq!(&jpeg[..2], &[0xff, 0xd8], "frame {index} is not a JPEG");
                let audio = b[16 + n..]
                    .chunks_exact(2)
                    .map(|c| i16::from_le_bytes([c[0], c[1]]))
                    .collect();
                got.frames.push(Frame {
                    index,
                    pts,
                    jpeg,
                    audio,
                    at: Instant::now(),
                });
            }
            Message::Close(c) => {
                got.close = c.map(|c| u16::from(c.code));
                return got;
            }
            _ => {}
        }
    }
}

/// A session's run: opened (JPEG output, `min_draw_fps` 0), a second of idle frames, then
/// `speech` in 20 ms messages paced in real time, then `end`; returns what came back.
async fn run_session(s: &Server, avatar: &str, speech: &[i16], idle_first: Duration) -> Session {
    let url = s.url("/v1/stream").replacen("http://", "ws://", 1);
    let (ws, _) = tokio::time::timeout(LIMIT, tokio_tungstenite::connect_async(url))
        .await
        .expect("connect timed out")
        .unwrap();
    let (mut tx, mut rx) = ws.split();
    let opening = serde_json::json!({
        "avatar_id": avatar, "fps": FPS, "output": "jpeg", "min_draw_fps": 0,
        "audio": {"format": "s16le", "sample_rate": 16000, "channels": 1},
    });
    tx.send(Message::Text(opening.to_string().into()))
        .await
        .unwrap();
    // `ready` first (read here, so the reader below has only the session's frames).
    let ready = loop {
        match tokio::time::timeout(LIMIT, rx.next()).await.unwrap() {
            Some(Ok(Message::Text(t))) => {
                break serde_json::from_str::<serde_json::Value>(&t).unwrap()
            }
            Some(Ok(_)) => continue,
            other => panic!("no ready: {other:?}"),
        }
    };
    assert_eq!(ready["type"], "ready", "{ready}");
    let reader = tokio::spawn(read_all(rx));
    tokio::time::sleep(idle_first).await;
    let bytes: Vec<u8> = speech.iter().flat_map(|s| s.to_le_bytes()).collect();
    let t0 = Instant::now();
    for (i, chunk) in bytes.chunks(640).enumerate() {
        tx.send(Message::Binary(chunk.to_vec().into()))
            .await
            .unwrap();
        let due = t0 + Duration::from_secs_f64((i + 1) as f64 * 0.02);
        tokio::time::sleep_until(due.into()).await;
    }
    tx.send(Message::Text(r#"{"type":"end"}"#.into()))
        .await
        .unwrap();
    let got = tokio::time::timeout(LIMIT, reader)
        .await
        .expect("the session never closed")
        .unwrap();
    Session { ready, got }
}

struct Session {
    ready: serde_json::Value,
    got: Received,
}

/// What one session's run shows (see [`check_session`]).
#[derive(Debug)]
struct Measured {
    promised: f64,
    drawn: u64,
    held: u64,
    speaking: u64,
    /// Drawn faces per second of speech.
    drawn_fps: f64,
    /// The longest run of speaking frames that show the same image as the frame before them.
    longest_repeat: usize,
    max_lateness_ms: f64,
    late_frames: u64,
    latency_ms_p50: f64,
    latency_ms_p95: f64,
}

/// Checks what every live session over capacity must show, whatever its share: every frame
/// (indices and timestamps without a gap, one per 40 ms of the session's time), the speech
/// complete and in place in the frames' audio, drawn and held frames counted alike by the
/// events and the end message, held frames showing the last face again.
fn check_session(name: &str, s: &Session, speech: &[i16]) -> Measured {
    let got = &s.got;
    assert_eq!(got.close, Some(1000), "{name}: {:?}", got.texts);
    let end = got.end();
    // Every frame from the first to the last: numbered without a gap, 40 ms apart in pts,
    // and as many as the session's time holds (one per 40 ms from the first frame to the
    // last, within 5 %: none missing, none extra).
    for (i, f) in got.frames.iter().enumerate() {
        assert_eq!(f.index as usize, i, "{name}: frame numbers");
        assert!(
            (f.pts - i as f64 / FPS).abs() < 1e-9,
            "{name}: pts of frame {i}"
        );
        assert_eq!(f.audio.len(), PER_FRAME, "{name}: audio of frame {i}");
    }
    let n = got.frames.len();
    assert_eq!(end["frames"], n as u64, "{name}: {end}");
    let span = got.frames[n - 1]
        .at
        .duration_since(got.frames[0].at)
        .as_secs_f64();
    let due = span * FPS + 1.0;
    assert!(
        (n as f64 - due).abs() <= 0.05 * due,
        "{name}: {n} frames in {span:.2} s: {due:.0} were due"
    );

    // One utterance: idle, speaking, idle; its frames are those that cover the speech.
    let speaking = got.events("speaking");
    let idle = got.events("idle");
    assert_eq!(speaking.len(), 1, "{name}: {:?}", got.texts);
    assert_eq!(idle.len(), 2, "{name}: {:?}", got.texts);
    let first = speaking[0]["frame"].as_u64().unwrap() as usize;
    let after = idle[1]["frame"].as_u64().unwrap() as usize;
    let want = (speech.len() as f64 / 16_000.0 * FPS).ceil() as usize;
    assert_eq!(after - first, want, "{name}: {:?}", got.texts);
    let (drawn, held) = (
        end["drawn_frames"].as_u64().unwrap(),
        end["held_frames"].as_u64().unwrap(),
    );
    assert_eq!(end["speaking_frames"], want as u64, "{name}: {end}");
    assert_eq!(drawn + held, want as u64, "{name}: {end}");
    // The events count the same frames: none before the speech, all of them after it.
    assert_eq!(speaking[0]["drawn_frames"], 0, "{name}: {:?}", speaking[0]);
    assert_eq!(speaking[0]["held_frames"], 0, "{name}: {:?}", speaking[0]);
    assert_eq!(idle[1]["drawn_frames"], drawn, "{name}: {:?}", idle[1]);
    assert_eq!(idle[1]["held_frames"], held, "{name}: {:?}", idle[1]);

    // The audio: silence before the speech, then the speech sample for sample from the first
    // speaking frame on (nothing dropped, cut or shifted), then silence.
    let audio: Vec<i16> = got.frames.iter().flat_map(|f| f.audio.clone()).collect();
    let at = first * PER_FRAME;
    assert!(
        audio[..at].iter().all(|&s| s == 0),
        "{name}: sound before the speech"
    );
    let back = &audio[at..at + speech.len()];
    let bad = back
        .iter()
        .zip(speech)
        .position(|(&got, &sent)| got != round_trip(sent));
    assert_eq!(
        bad, None,
        "{name}: the speech's audio differs from sample {bad:?} on"
    );
    assert!(
        audio[at + speech.len()..].iter().all(|&s| s == 0),
        "{name}: sound after the speech"
    );

    // A held frame shows the last drawn face again: the same image as the frame before it.
    // So the speaking frames change image at most once per drawn frame, and the longest run
    // of repeats is the longest run of held frames (or longer, where two drawn faces look
    // alike).
    let frames = &got.frames[first..after];
    let changes = frames.windows(2).filter(|w| w[0].jpeg != w[1].jpeg).count()
        + usize::from(frames[0].jpeg != got.frames[first - 1].jpeg);
    assert!(
        changes as u64 <= drawn,
        "{name}: {changes} changes of image, {drawn} drawn frames"
    );
    let mut longest_repeat = 0;
    let mut run = 0;
    let mut previous = &got.frames[first - 1].jpeg;
    for f in frames {
        run = if &f.jpeg == previous { run + 1 } else { 0 };
        longest_repeat = longest_repeat.max(run);
        previous = &f.jpeg;
    }

    let speaking_seconds = want as f64 / FPS;
    Measured {
        promised: s.ready["draw_fps"].as_f64().unwrap(),
        drawn,
        held,
        speaking: want as u64,
        drawn_fps: drawn as f64 / speaking_seconds,
        longest_repeat,
        max_lateness_ms: end["max_lateness_ms"].as_f64().unwrap(),
        late_frames: end["late_frames"].as_u64().unwrap(),
        latency_ms_p50: end["latency_ms_p50"].as_f64().unwrap_or(f64::NAN),
        latency_ms_p95: end["latency_ms_p95"].as_f64().unwrap_or(f64::NAN),
    }
}

/// What every session over capacity keeps, whatever it draws: every frame by its due time
/// (held frames half a frame after it; a busy machine may delay a few), and a chunk's first
/// drawn frame within the lag and the gap between drawn frames.
fn check_clock(name: &str, m: &Measured, latency_ms: f64) {
    assert!(m.late_frames * 5 <= m.speaking, "{name}: {m:?}");
    assert!(m.max_lateness_ms < 250.0, "{name}: {m:?}");
    assert!(
        m.latency_ms_p50 > 212.0 && m.latency_ms_p95 < latency_ms,
        "{name}: {m:?}"
    );
}

/// One 25 fps session with four seconds of speech on an engine that draws a few faces a
/// second: all its frames on time, all its audio, and the faces the engine can draw, spread.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_over_capacity_keeps_its_clock_its_audio_and_draws_what_it_can() {
    let t = Instant::now();
    let s = start_slowed();
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let offered = s.info().await["sessions"]["draw_fps"].as_f64().unwrap();
    let speech = speech(4);
    let run = run_session(&s, &avatar, &speech, Duration::from_secs(1)).await;
    let m = check_session("session", &run, &speech);
    eprintln!("over capacity: {m:?}; test took {:?}", t.elapsed());

    // Promised what /info offered, below 25 fps: over capacity.
    assert_eq!(m.promised, offered, "{m:?}");
    assert!(m.promised > 0.0 && m.promised < FPS, "{m:?}");
    // Frames held, and faces drawn: at least most of the promise, spread over the speech
    // (the mouth keeps moving: never a second of held frames).
    assert!(m.drawn > 0 && m.held > 0, "{m:?}");
    assert!(m.drawn_fps >= 0.8 * m.promised, "{m:?}");
    assert!(m.longest_repeat <= 25, "{m:?}");
    check_clock("session", &m, 2_000.0);
    // The server counts the held frames.
    assert_eq!(
        s.metric("lipsync_stream_held_frames_total").await,
        m.held as f64
    );
}

/// Two 25 fps sessions speaking at once on an engine that draws a few faces a second: the
/// second is promised the share left beside the first, and they end up sharing the faces
/// drawn: both draw, neither starves nor takes the lion's share, and together they draw what
/// the engine offered them.
#[tokio::test(flavor = "multi_thread")]
async fn sessions_over_capacity_share_the_drawn_frames_fairly() {
    let t = Instant::now();
    let s = start_slowed();
    s.wait_ready().await;
    let avatar = s.upload_avatar().await;
    let speech = speech(6);
    // The second opens a little after the first; they speak at the same time.
    let (a, b) = tokio::join!(
        run_session(&s, &avatar, &speech, Duration::from_millis(1500)),
        async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            run_session(&s, &avatar, &speech, Duration::from_millis(1200)).await
        }
    );
    let ma = check_session("first", &a, &speech);
    let mb = check_session("second", &b, &speech);
    eprintln!(
        "two sessions over capacity: {ma:?}\n  {mb:?}\ntest took {:?}",
        t.elapsed()
    );

    // Max-min fair promises: the second gets the share left beside the first.
    assert!(mb.promised < ma.promised, "{ma:?} {mb:?}");
    // Both draw, neither more than twice the other, together at least most of what the
    // engine offers two sessions (the second's share, each).
    assert!(ma.drawn > 0 && mb.drawn > 0, "{ma:?} {mb:?}");
    let (lo, hi) = (ma.drawn.min(mb.drawn), ma.drawn.max(mb.drawn));
    assert!(hi <= 2 * lo, "{ma:?} {mb:?}");
    assert!(
        ma.drawn_fps + mb.drawn_fps >= 0.8 * 2.0 * mb.promised,
        "{ma:?} {mb:?}"
    );
    // Neither mouth stops for long (misses, shared by both sessions, come in runs).
    assert!(
        ma.longest_repeat <= 50 && mb.longest_repeat <= 50,
        "{ma:?} {mb:?}"
    );
    check_clock("first", &ma, 3_000.0);
    check_clock("second", &mb, 3_000.0);
    assert_eq!(
        s.metric("lipsync_stream_held_frames_total").await,
        (ma.held + mb.held) as f64
    );
}
