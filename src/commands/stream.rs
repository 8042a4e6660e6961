//! `lipsync stream`: the reference client of `GET /v1/stream`. Uploads the photo (or names a
//! cached avatar), opens a session with fMP4 output, sends the speech as 16 kHz s16le in
//! 20 ms messages paced in real time (or as fast as the socket takes them with `--no-pace`),
//! writes what comes back to `--out`, and prints the latency of each audio chunk (sent →
//! fragment holding its first drawn frame received) and the server's late frames.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

use super::{read_file, CliError};
use lipsync::media::audio;
use lipsync::media::video::live::{Fragments, Piece};

#[derive(Debug, clap::Args)]
pub struct StreamArgs {
    /// The server, e.g. http://127.0.0.1:8080 (or ws://…; the path /v1/stream is added).
    pub url: String,
    /// Speech to send (any format `lipsync audio` reads).
    #[arg(long)]
    pub audio: PathBuf,
    /// A photo to upload as the avatar.
    #[arg(
        long,
        conflicts_with = "avatar_id",
        required_unless_present = "avatar_id"
    )]
    pub image: Option<PathBuf>,
    /// An avatar already uploaded (`POST /v1/avatars`).
    #[arg(long)]
    pub avatar_id: Option<String>,
    /// Where to write the fragmented MP4 that comes back.
    #[arg(long)]
    pub out: PathBuf,
    /// Frames per second asked for.
    #[arg(long, default_value = "25")]
    pub fps: String,
    /// Send the audio as fast as the socket takes it instead of in real time.
    #[arg(long)]
    pub no_pace: bool,
    /// Seconds of idle video to wait for before speaking.
    #[arg(long, default_value_t = 1.0)]
    pub lead_in: f64,
    /// The least drawing rate (faces/s) to accept; the server refuses the session below it
    /// (`over_capacity`) [server's default: 5].
    #[arg(long)]
    pub min_draw_fps: Option<f64>,
    /// API key (sent as `Authorization: Bearer`).
    #[arg(long, env = "LIPSYNC_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Samples per message: 20 ms at 16 kHz.
const CHUNK: usize = 320;

fn fail(msg: impl Into<String>) -> CliError {
    CliError::Serve(msg.into())
}

/// `host:port` and the base path of `url`.
fn parse_url(url: &str) -> Result<(bool, String), CliError> {
    let (secure, rest) = if let Some(r) = url.strip_prefix("http://") {
        (false, r)
    } else if let Some(r) = url.strip_prefix("ws://") {
        (false, r)
    } else if let Some(r) = url.strip_prefix("https://").or(url.strip_prefix("wss://")) {
        (true, r)
    } else {
        return Err(fail(format!("{url}: give an http:// or ws:// URL")));
    };
    Ok((secure, rest.trim_end_matches('/').to_string()))
}

/// `POST /v1/avatars` with the photo (plain HTTP/1.1): the avatar's id.
async fn upload(host: &str, image: &[u8], key: Option<&str>) -> Result<String, CliError> {
    let authority = host.split('/').next().unwrap_or(host);
    let mut sock = tokio::net::TcpStream::connect(authority)
        .await
        .map_err(|e| fail(format!("cannot connect to {authority}: {e}")))?;
    let boundary = "lipsyncstreamboundary7MA4YWxk";
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"image\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(image);
    body.extend(format!("\r\n--{boundary}--\r\n").bytes());
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    let head = format!(
        "POST /v1/avatars HTTP/1.1\r\nHost: {authority}\r\n{auth}Content-Type: \
         multipart/form-data; boundary={boundary}\r\nContent-Length: {}\r\nConnection: \
         close\r\n\r\n",
        body.len()
    );
    let io = |e: std::io::Error| fail(format!("uploading the avatar: {e}"));
    sock.write_all(head.as_bytes()).await.map_err(io)?;
    sock.write_all(&body).await.map_err(io)?;
    let mut reply = Vec::new();
    sock.read_to_end(&mut reply).await.map_err(io)?;
    let text = String::from_utf8_lossy(&reply);
    let (status, json) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    // A chunked body: take the JSON object out of it.
    let json = json
        .find('{')
        .and_then(|a| json.rfind('}').map(|b| &json[a..=b]))
        .unwrap_or(json);
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
    if !status.starts_with("HTTP/1.1 20") {
        return Err(fail(format!(
            "the avatar upload was refused: {}",
            v["error"]
                .as_str()
                .unwrap_or(status.lines().next().unwrap_or(""))
        )));
    }
    v["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| fail("the avatar upload answered without an id"))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[(((sorted.len() - 1) as f64) * p).round() as usize]
}

pub fn stream(a: StreamArgs) -> Result<(), CliError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| fail(e.to_string()))?;
    runtime.block_on(run(a))
}

async fn run(a: StreamArgs) -> Result<(), CliError> {
    let (secure, host) = parse_url(&a.url)?;
    if secure {
        return Err(fail(
            "TLS is not supported by this client: use http:// or ws://",
        ));
    }
    let speech = audio::load(&read_file(&a.audio)?, audio::DEFAULT_MAX_SECONDS)?;
    let fps: audio::Fps = a.fps.parse()?;
    let avatar = match (&a.avatar_id, &a.image) {
        (Some(id), _) => id.clone(),
        (None, Some(path)) => upload(&host, &read_file(path)?, a.api_key.as_deref()).await?,
        (None, None) => return Err(fail("give --image or --avatar-id")),
    };
    let mut req = format!("ws://{host}/v1/stream")
        .into_client_request()
        .map_err(|e| fail(e.to_string()))?;
    if let Some(k) = &a.api_key {
        let v = format!("Bearer {k}")
            .parse()
            .map_err(|_| fail("bad API key"))?;
        req.headers_mut().insert("authorization", v);
    }
    let (ws, _) = tokio_tungstenite::connect_async(req)
        .await
        .map_err(|e| match e {
            tokio_tungstenite::tungstenite::Error::Http(r) => fail(format!(
                "the server refused the session: {} {}",
                r.status(),
                r.body()
                    .as_deref()
                    .map(String::from_utf8_lossy)
                    .unwrap_or_default()
            )),
            e => fail(format!("cannot open the session: {e}")),
        })?;
    let (mut tx, mut rx) = ws.split();
    let mut opening = serde_json::json!({
        "avatar_id": avatar, "fps": a.fps,
        "audio": {"format": "s16le", "sample_rate": 16000, "channels": 1},
        "output": "fmp4",
    });
    if let Some(m) = a.min_draw_fps {
        opening["min_draw_fps"] = serde_json::json!(m);
    }
    tx.send(Message::Text(opening.to_string().into()))
        .await
        .map_err(|e| fail(e.to_string()))?;

    // Receive everything on its own task; note when each fragment arrives.
    let out_path = a.out.clone();
    let receiver = tokio::spawn(async move {
        let mut file = Vec::new();
        let mut texts: Vec<serde_json::Value> = Vec::new();
        let mut cut = Fragments::default();
        let mut frames = 0u64;
        // (arrival, video frames received so far)
        let mut arrivals: Vec<(Instant, u64)> = Vec::new();
        let mut close = None;
        while let Some(msg) = rx.next().await {
            match msg {
                Ok(Message::Text(t)) => {
                    texts.push(serde_json::from_str(&t).unwrap_or_default());
                }
                Ok(Message::Binary(b)) => {
                    let now = Instant::now();
                    for p in cut.push(&b) {
                        if let Piece::Fragment(_, n) = p {
                            frames += u64::from(n);
                        }
                    }
                    arrivals.push((now, frames));
                    file.extend_from_slice(&b);
                }
                Ok(Message::Close(c)) => {
                    close = c.map(|c| (u16::from(c.code), c.reason.to_string()));
                    break;
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let written = std::fs::write(&out_path, &file);
        (texts, arrivals, close, written)
    });

    // Wait for `ready`, then a little idle video, then speak.
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(a.lead_in.max(0.0))).await;
    let samples = &speech.samples;
    let mut sent: Vec<(Instant, usize)> = Vec::new();
    let t0 = Instant::now();
    for (i, chunk) in samples.chunks(CHUNK).enumerate() {
        if !a.no_pace {
            let due = t0 + Duration::from_secs_f64((i * CHUNK) as f64 / 16_000.0);
            tokio::time::sleep_until(due.into()).await;
        }
        let bytes: Vec<u8> = chunk
            .iter()
            .flat_map(|s| ((s * 32_768.0).round().clamp(-32_768.0, 32_767.0) as i16).to_le_bytes())
            .collect();
        sent.push((Instant::now(), i * CHUNK));
        if tx.send(Message::Binary(bytes.into())).await.is_err() {
            break;
        }
    }
    let _ = tx.send(Message::Text(r#"{"type":"end"}"#.into())).await;
    let (texts, arrivals, close, written) = receiver.await.map_err(|e| fail(e.to_string()))?;
    written.map_err(|source| CliError::Read {
        path: a.out.clone(),
        source,
    })?;
    if let Some(err) = texts.iter().find(|t| t["type"] == "error") {
        return Err(fail(format!(
            "the session failed: {} ({})",
            err["error"].as_str().unwrap_or("?"),
            err["error_type"].as_str().unwrap_or("?")
        )));
    }
    let speaking = texts
        .iter()
        .find(|t| t["type"] == "speaking")
        .and_then(|t| t["frame"].as_u64());
    let end = texts.iter().find(|t| t["type"] == "end").cloned();
    // Each chunk's first drawn frame, and when the fragment holding it came.
    let mut latencies: Vec<f64> = Vec::new();
    if let Some(k0) = speaking {
        for (at, first_sample) in &sent {
            let frame = k0 + (*first_sample as f64 * fps.value() / 16_000.0) as u64;
            if let Some((got, _)) = arrivals.iter().find(|(_, n)| *n > frame) {
                latencies.push(got.saturating_duration_since(*at).as_secs_f64());
            }
        }
    }
    latencies.sort_by(f64::total_cmp);
    let stats = end.as_ref().map(|e| e["stats"].clone()).unwrap_or_default();
    let summary = serde_json::json!({
        "out": a.out,
        "bytes": std::fs::metadata(&a.out).map(|m| m.len()).unwrap_or(0),
        "chunks": sent.len(),
        "latency_ms": {
            "p50": percentile(&latencies, 0.5) * 1e3,
            "p95": percentile(&latencies, 0.95) * 1e3,
            "p99": percentile(&latencies, 0.99) * 1e3,
            "max": latencies.last().copied().unwrap_or(f64::NAN) * 1e3,
        },
        "late_frames": stats["late_frames"],
        "frames": stats["frames"],
        "speaking_frames": stats["speaking_frames"],
        "server": stats,
        "close": close.as_ref().map(|c| c.0),
        "seconds": started.elapsed().as_secs_f64(),
    });
    if a.json {
        println!("{summary:#}");
    } else {
        println!(
            "{}: {} frames ({} speaking, {} late); chunk → first frame latency p50 {:.0} ms, \
             p95 {:.0} ms, p99 {:.0} ms over {} chunks",
            a.out.display(),
            stats["frames"],
            stats["speaking_frames"],
            stats["late_frames"],
            percentile(&latencies, 0.5) * 1e3,
            percentile(&latencies, 0.95) * 1e3,
            percentile(&latencies, 0.99) * 1e3,
            latencies.len()
        );
    }
    if end.is_none() || close.map(|c| c.0) != Some(1000) {
        return Err(fail("the session ended without `end` and a normal close"));
    }
    Ok(())
}
