//! A load client for a running `lipsync serve`, for the GPU run (`bench/gpu_run.sh`, stages
//! `service` and `live`), where no load generator is installed: built here once (a CPU build
//! is enough, it only talks HTTP) and carried.
//!
//!     cargo build --release --locked --example service_load
//!
//! `http`: `POST /v1/lipsync` with the same speech and avatar, `c` requests at once for each
//! concurrency level (`--repeat` times each, e.g. 2 for cold then warm): per level the
//! requests answered 200 and refused, time to the response's first body byte and last byte
//! (p50/p99, max), the frames received (`X-Video-Frames`) per second of wall time.
//!
//!     target/release/examples/service_load http --url http://127.0.0.1:8080 \
//!         --audio speech10.wav --image tests/media/astronaut.png --concurrency 1,4,16,64
//!
//! `live`: the avatar uploaded once (`POST /v1/avatars`), then `n` live sessions
//! (`GET /v1/stream`, fMP4) opened over `--ramp` seconds, each speaking the audio in 20 ms
//! messages paced in real time as `lipsync stream` does: per level the sessions opened,
//! refused (429) and failed, the latency of each audio chunk (sent → the fragment holding its
//! first drawn frame received; all sessions' chunks pooled: p50/p95/p99/max) and the frames
//! the server counted late.
//!
//!     target/release/examples/service_load live --url http://127.0.0.1:8080 \
//!         --audio speech8.wav --image tests/media/astronaut.png --sessions 1,10,50,100
//!
//! Prints one Markdown table (rows as each level ends); `--json` also writes the rows.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use futures_util::{SinkExt, StreamExt};
use lipsync::media::audio;
use lipsync::media::video::live::{Fragments, Piece};
use tokio_tungstenite::tungstenite::Message;

#[derive(Parser, Debug)]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// Concurrent `POST /v1/lipsync` requests.
    Http(HttpArgs),
    /// Concurrent live sessions (`GET /v1/stream`).
    Live(LiveArgs),
}

#[derive(clap::Args, Debug)]
struct Common {
    /// The server, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    url: String,
    /// Speech to send.
    #[arg(long)]
    audio: PathBuf,
    /// A label for the rows (e.g. the avatar and speech length).
    #[arg(long, default_value = "")]
    label: String,
    /// Also write the rows as a JSON array here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Seconds after which a request or session counts as failed.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
}

#[derive(clap::Args, Debug)]
struct HttpArgs {
    #[command(flatten)]
    common: Common,
    /// A photo avatar.
    #[arg(long, conflicts_with = "video", required_unless_present = "video")]
    image: Option<PathBuf>,
    /// A clip avatar.
    #[arg(long)]
    video: Option<PathBuf>,
    /// Requests at once, one level after another.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    concurrency: Vec<usize>,
    /// Runs of each level (the first is cold for a new avatar, the next warm).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Send a request refused with 429 again after its Retry-After (at most 5 s), as a
    /// client under load would; its times count from its first try.
    #[arg(long)]
    retry_429: bool,
}

#[derive(clap::Args, Debug)]
struct LiveArgs {
    #[command(flatten)]
    common: Common,
    /// The photo avatar, uploaded once.
    #[arg(long)]
    image: PathBuf,
    /// Sessions at once, one level after another.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    sessions: Vec<usize>,
    /// Seconds over which a level's sessions are opened.
    #[arg(long, default_value_t = 1.0)]
    ramp: f64,
    /// Seconds of idle video each session takes before speaking.
    #[arg(long, default_value_t = 1.0)]
    lead_in: f64,
    /// Frames per second asked for.
    #[arg(long, default_value = "25")]
    fps: String,
    /// Stop after the first level where the server refused a session (the most it takes).
    #[arg(long)]
    stop_when_refused: bool,
    /// `min_draw_fps` in each opening (the least drawing rate a session accepts; the server's
    /// default, 5, when not given). A session refused for it (`over_capacity`) counts as refused.
    #[arg(long)]
    min_draw_fps: Option<f64>,
}

type Res<T> = Result<T, String>;

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    Some(sorted[(((sorted.len() - 1) as f64) * p).round() as usize])
}

fn ms(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{:.0}", v * 1e3))
}

fn secs(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.2}"))
}

fn read(path: &PathBuf) -> Res<Vec<u8>> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

fn write_json(path: &Option<PathBuf>, rows: &[serde_json::Value]) -> Res<()> {
    if let Some(p) = path {
        let text = serde_json::to_string_pretty(rows).unwrap_or_default();
        std::fs::write(p, text).map_err(|e| format!("cannot write {}: {e}", p.display()))?;
    }
    Ok(())
}

/// One request's outcome.
#[derive(Debug, Default, Clone)]
struct Outcome {
    status: u16,
    ttfb: Option<f64>,
    total: f64,
    bytes: u64,
    frames: u64,
    /// 429 answers retried.
    retried: u64,
    error: Option<String>,
}

async fn one_request(
    client: reqwest::Client,
    url: String,
    audio: Arc<Vec<u8>>,
    avatar: Arc<(String, Vec<u8>)>,
    retry_429: bool,
) -> Outcome {
    let start = Instant::now();
    let mut out = Outcome::default();
    let resp = loop {
        let form = reqwest::multipart::Form::new()
            .part(
                "audio",
                reqwest::multipart::Part::bytes(audio.to_vec()).file_name("speech.wav"),
            )
            .part(
                avatar.0.clone(),
                reqwest::multipart::Part::bytes(avatar.1.clone()).file_name(avatar.0.clone()),
            );
        let resp = match client
            .post(format!("{url}/v1/lipsync"))
            .multipart(form)
            .send()
            .await
        {
            Ok(r) => r,
            Err(e) => {
                out.error = Some(format!("request failed: {e}"));
                out.total = start.elapsed().as_secs_f64();
                return out;
            }
        };
        if resp.status().as_u16() == 429 && retry_429 {
            let wait = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(1.0)
                .clamp(0.05, 5.0);
            let _ = resp.bytes().await;
            out.retried += 1;
            tokio::time::sleep(Duration::from_secs_f64(wait)).await;
            continue;
        }
        break resp;
    };
    out.status = resp.status().as_u16();
    out.frames = resp
        .headers()
        .get("x-video-frames")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let ok = resp.status().is_success();
    let mut resp = resp;
    let mut body = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(c)) => {
                out.ttfb
                    .get_or_insert_with(|| start.elapsed().as_secs_f64());
                out.bytes += c.len() as u64;
                if !ok && body.len() < 4096 {
                    body.extend_from_slice(&c);
                }
            }
            Ok(None) => break,
            Err(e) => {
                out.error = Some(format!("the stream broke off: {e}"));
                break;
            }
        }
    }
    out.total = start.elapsed().as_secs_f64();
    if !ok && out.error.is_none() {
        out.error = Some(format!(
            "HTTP {}: {}",
            out.status,
            String::from_utf8_lossy(&body).trim()
        ));
    }
    out
}

async fn http(a: HttpArgs) -> Res<()> {
    let url = a.common.url.trim_end_matches('/').to_string();
    let audio = Arc::new(read(&a.common.audio)?);
    let avatar = Arc::new(match (&a.image, &a.video) {
        (Some(p), _) => ("image".to_string(), read(p)?),
        (None, Some(p)) => ("video".to_string(), read(p)?),
        (None, None) => return Err("give --image or --video".into()),
    });
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs_f64(a.common.timeout))
        .pool_max_idle_per_host(0)
        .build()
        .map_err(|e| e.to_string())?;
    println!(
        "| label | concurrent | run | 200 | refused | 429 retried | failed | frames | wall s | \
         frames/s | TTFB p50 ms | TTFB p99 ms | last byte p50 s | last byte max s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut first_error = None;
    for &c in &a.concurrency {
        for run in 1..=a.repeat.max(1) {
            let start = Instant::now();
            let tasks: Vec<_> = (0..c)
                .map(|_| {
                    tokio::spawn(one_request(
                        client.clone(),
                        url.clone(),
                        audio.clone(),
                        avatar.clone(),
                        a.retry_429,
                    ))
                })
                .collect();
            let mut outcomes = Vec::new();
            for t in tasks {
                outcomes.push(t.await.map_err(|e| e.to_string())?);
            }
            let wall = start.elapsed().as_secs_f64();
            let good: Vec<&Outcome> = outcomes
                .iter()
                .filter(|o| o.status == 200 && o.error.is_none())
                .collect();
            let refused = outcomes.iter().filter(|o| o.status == 429).count();
            let failed = outcomes.len() - good.len() - refused;
            if let Some(e) = outcomes.iter().find_map(|o| o.error.clone()) {
                first_error.get_or_insert(e);
            }
            let frames: u64 = good.iter().map(|o| o.frames).sum();
            let retried: u64 = outcomes.iter().map(|o| o.retried).sum();
            let mut ttfb: Vec<f64> = good.iter().filter_map(|o| o.ttfb).collect();
            ttfb.sort_by(f64::total_cmp);
            let mut last: Vec<f64> = good.iter().map(|o| o.total).collect();
            last.sort_by(f64::total_cmp);
            let fps = frames as f64 / wall;
            println!(
                "| {} | {c} | {run} | {} | {refused} | {retried} | {failed} | {frames} | {wall:.2} \
                 | {fps:.1} | {} | {} | {} | {} |",
                a.common.label,
                good.len(),
                ms(percentile(&ttfb, 0.5)),
                ms(percentile(&ttfb, 0.99)),
                secs(percentile(&last, 0.5)),
                secs(last.last().copied()),
            );
            rows.push(serde_json::json!({
                "label": a.common.label, "concurrency": c, "run": run, "ok": good.len(),
                "refused": refused, "retried_429": retried, "failed": failed, "frames": frames,
                "wall_seconds": wall,
                "frames_per_second": fps,
                "ttfb_seconds": {"p50": percentile(&ttfb, 0.5), "p99": percentile(&ttfb, 0.99),
                                 "max": ttfb.last()},
                "last_byte_seconds": {"p50": percentile(&last, 0.5),
                                      "p99": percentile(&last, 0.99), "max": last.last()},
                "bytes": good.iter().map(|o| o.bytes).sum::<u64>(),
            }));
            write_json(&a.common.json, &rows)?;
        }
    }
    if let Some(e) = first_error {
        eprintln!("service_load: first error: {e}");
    }
    Ok(())
}

/// `POST /v1/avatars`: the avatar's id.
async fn upload_avatar(url: &str, image: Vec<u8>) -> Res<String> {
    let form = reqwest::multipart::Form::new().part(
        "image",
        reqwest::multipart::Part::bytes(image).file_name("image"),
    );
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/avatars"))
        .multipart(form)
        .send()
        .await
        .map_err(|e| format!("uploading the avatar: {e}"))?;
    let status = resp.status();
    let v: serde_json::Value = resp.json().await.unwrap_or_default();
    if !status.is_success() {
        return Err(format!("the avatar upload was refused: {status} {v}"));
    }
    v["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| "the avatar upload answered without an id".into())
}

/// Samples per message: 20 ms at 16 kHz.
const CHUNK: usize = 320;

/// One live session's outcome.
#[derive(Debug, Default)]
struct Session {
    refused: bool,
    error: Option<String>,
    latencies: Vec<f64>,
    late_frames: u64,
    frames: u64,
    speaking_frames: u64,
}

async fn one_session(
    url: String,
    avatar: String,
    fps: String,
    speech: Arc<Vec<i16>>,
    delay: Duration,
    lead_in: f64,
    min_draw_fps: Option<f64>,
) -> Session {
    tokio::time::sleep(delay).await;
    let mut s = Session::default();
    let fps_value: f64 = match fps.parse::<audio::Fps>() {
        Ok(f) => f.value(),
        Err(e) => {
            s.error = Some(e.to_string());
            return s;
        }
    };
    let ws_url = format!("{}/v1/stream", url.replacen("http://", "ws://", 1));
    let ws = match tokio_tungstenite::connect_async(ws_url.as_str()).await {
        Ok((ws, _)) => ws,
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => {
            s.refused = r.status().as_u16() == 429;
            s.error = Some(format!("the server refused the session: {}", r.status()));
            return s;
        }
        Err(e) => {
            s.error = Some(format!("cannot open the session: {e}"));
            return s;
        }
    };
    let (mut tx, mut rx) = ws.split();
    let mut opening = serde_json::json!({
        "avatar_id": avatar, "fps": fps,
        "audio": {"format": "s16le", "sample_rate": 16000, "channels": 1},
        "output": "fmp4",
    });
    if let Some(m) = min_draw_fps {
        opening["min_draw_fps"] = serde_json::json!(m);
    }
    if let Err(e) = tx.send(Message::Text(opening.to_string().into())).await {
        s.error = Some(e.to_string());
        return s;
    }
    // Receive on its own task; note when each fragment arrives and the frames so far.
    let receiver = tokio::spawn(async move {
        let mut texts: Vec<serde_json::Value> = Vec::new();
        let mut cut = Fragments::default();
        let mut frames = 0u64;
        let mut arrivals: Vec<(Instant, u64)> = Vec::new();
        let mut close = None;
        while let Some(msg) = rx.next().await {
            match msg {
                Ok(Message::Text(t)) => texts.push(serde_json::from_str(&t).unwrap_or_default()),
                Ok(Message::Binary(b)) => {
                    let now = Instant::now();
                    for p in cut.push(&b) {
                        if let Piece::Fragment(_, n) = p {
                            frames += u64::from(n);
                        }
                    }
                    arrivals.push((now, frames));
                }
                Ok(Message::Close(c)) => {
                    close = c.map(|c| u16::from(c.code));
                    break;
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        (texts, arrivals, close)
    });
    tokio::time::sleep(Duration::from_secs_f64(lead_in.max(0.0))).await;
    let mut sent: Vec<(Instant, usize)> = Vec::new();
    let t0 = Instant::now();
    for (i, chunk) in speech.chunks(CHUNK).enumerate() {
        let due = t0 + Duration::from_secs_f64((i * CHUNK) as f64 / 16_000.0);
        tokio::time::sleep_until(due.into()).await;
        let bytes: Vec<u8> = chunk.iter().flat_map(|s| s.to_le_bytes()).collect();
        sent.push((Instant::now(), i * CHUNK));
        if tx.send(Message::Binary(bytes.into())).await.is_err() {
            break;
        }
    }
    let _ = tx.send(Message::Text(r#"{"type":"end"}"#.into())).await;
    let (texts, arrivals, close) = match receiver.await {
        Ok(r) => r,
        Err(e) => {
            s.error = Some(e.to_string());
            return s;
        }
    };
    if let Some(err) = texts.iter().find(|t| t["type"] == "error") {
        s.refused = err["error_type"] == "over_capacity";
        s.error = Some(format!("the session failed: {}", err["error"]));
        return s;
    }
    let speaking = texts
        .iter()
        .find(|t| t["type"] == "speaking")
        .and_then(|t| t["frame"].as_u64());
    if let Some(k0) = speaking {
        for (at, first_sample) in &sent {
            let frame = k0 + (*first_sample as f64 * fps_value / 16_000.0) as u64;
            if let Some((got, _)) = arrivals.iter().find(|(_, n)| *n > frame) {
                s.latencies
                    .push(got.saturating_duration_since(*at).as_secs_f64());
            }
        }
    }
    let end = texts.iter().find(|t| t["type"] == "end");
    let stats = end.map(|e| e["stats"].clone()).unwrap_or_default();
    s.late_frames = stats["late_frames"].as_u64().unwrap_or(0);
    s.frames = stats["frames"].as_u64().unwrap_or(0);
    s.speaking_frames = stats["speaking_frames"].as_u64().unwrap_or(0);
    if end.is_none() || close != Some(1000) {
        s.error = Some(format!(
            "the session ended without `end` and a normal close (close code {close:?})"
        ));
    }
    s
}

async fn live(a: LiveArgs) -> Res<()> {
    let url = a.common.url.trim_end_matches('/').to_string();
    let speech = audio::load(&read(&a.common.audio)?, audio::DEFAULT_MAX_SECONDS)
        .map_err(|e| e.to_string())?;
    let pcm: Arc<Vec<i16>> = Arc::new(
        speech
            .samples
            .iter()
            .map(|s| (s * 32_768.0).round().clamp(-32_768.0, 32_767.0) as i16)
            .collect(),
    );
    let avatar = upload_avatar(&url, read(&a.image)?).await?;
    println!(
        "| label | sessions | opened | refused | failed | chunks | latency p50 ms | p95 ms | \
         p99 ms | max ms | late frames | frames | speaking frames |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut first_error = None;
    for &n in &a.sessions {
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                let delay = Duration::from_secs_f64(a.ramp.max(0.0) * i as f64 / n.max(1) as f64);
                let work = one_session(
                    url.clone(),
                    avatar.clone(),
                    a.fps.clone(),
                    pcm.clone(),
                    delay,
                    a.lead_in,
                    a.min_draw_fps,
                );
                let limit = Duration::from_secs_f64(a.common.timeout);
                tokio::spawn(async move {
                    tokio::time::timeout(limit, work)
                        .await
                        .unwrap_or_else(|_| Session {
                            error: Some("timed out".into()),
                            ..Session::default()
                        })
                })
            })
            .collect();
        let mut sessions = Vec::new();
        for t in tasks {
            sessions.push(t.await.map_err(|e| e.to_string())?);
        }
        let refused = sessions.iter().filter(|s| s.refused).count();
        let failed = sessions
            .iter()
            .filter(|s| !s.refused && s.error.is_some())
            .count();
        let opened = n - refused;
        if let Some(e) = sessions.iter().find_map(|s| s.error.clone()) {
            first_error.get_or_insert(e);
        }
        let mut lat: Vec<f64> = sessions
            .iter()
            .flat_map(|s| s.latencies.iter().copied())
            .collect();
        lat.sort_by(f64::total_cmp);
        let late: u64 = sessions.iter().map(|s| s.late_frames).sum();
        let frames: u64 = sessions.iter().map(|s| s.frames).sum();
        let speaking: u64 = sessions.iter().map(|s| s.speaking_frames).sum();
        println!(
            "| {} | {n} | {opened} | {refused} | {failed} | {} | {} | {} | {} | {} | {late} | \
             {frames} | {speaking} |",
            a.common.label,
            lat.len(),
            ms(percentile(&lat, 0.5)),
            ms(percentile(&lat, 0.95)),
            ms(percentile(&lat, 0.99)),
            ms(lat.last().copied()),
        );
        rows.push(serde_json::json!({
            "label": a.common.label, "sessions": n, "opened": opened, "refused": refused,
            "failed": failed, "chunks": lat.len(),
            "latency_seconds": {"p50": percentile(&lat, 0.5), "p95": percentile(&lat, 0.95),
                                "p99": percentile(&lat, 0.99), "max": lat.last()},
            "late_frames": late, "frames": frames, "speaking_frames": speaking,
        }));
        write_json(&a.common.json, &rows)?;
        if a.stop_when_refused && refused > 0 {
            break;
        }
    }
    if let Some(e) = first_error {
        eprintln!("service_load: first error: {e}");
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("service_load: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let result = runtime.block_on(async {
        match cli.mode {
            Mode::Http(a) => http(a).await,
            Mode::Live(a) => live(a).await,
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("service_load: {e}");
            std::process::ExitCode::from(2)
        }
    }
}
