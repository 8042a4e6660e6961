//! `bench --sections media`: the media side of the service (audio, avatars, batcher,
//! compositor, encoders, HTTP, live sessions) on the echo device, a model stand-in that costs
//! nothing, so it can be measured on any machine. The real service runs as a child process
//! (`lipsync serve --device echo`), and the bench is its client.
//!
//! - **Requests.** `POST /v1/lipsync` with the speech looped to `--media-seconds` on a photo
//!   (`--image`), on a 1280×720 photo and on a 720p clip avatar (with the box of its first
//!   frame, as bench/clip_avatar.sh uploads it), each uploaded once and named by
//!   `avatar_id`: wall time, first byte, and the CPU seconds of the server's process tree
//!   (the process and every descendant, reaped ones included), taken across the request once
//!   its encoders have exited. The response must be H.264 + AAC with seconds × 25 frames.
//! - **The floor** beside each row: the response's own video decoded to yuv420p and encoded
//!   again from a pipe by one ffmpeg with the service's x264 options at `-threads 1`, the same
//!   speech with its AAC options, into fragmented MP4 ([`EncoderSettings::yuv420p_args`]). Its
//!   CPU is that ffmpeg's alone (not the decoder's); the row shows tree ÷ floor.
//! - **Cores.** The first row again with the server pinned to one core and to two
//!   (`taskset`).
//! - **Live.** N sessions at 25 fps on the photo, then on the clip (fMP4, then JPEG), each
//!   speaking 2 s (20 ms chunks paced in real time) then silent 2 s (nothing sent: the
//!   utterance ends after the server's gap and the session idles), for `--live-seconds`.
//!   Levels of `--live-sessions` run on a fresh server each, until one does not hold.
//!
//! `--media-device cuda` (with `--checkpoint`) runs the same parts against the service with
//! its model, so a GPU host's rows stand beside its echo rows; `--media-parts`,
//! `--live-avatars` and `--live-outputs` choose what runs, `--media-serve-arg` adds serve flags,
//! `--live-min-draw-fps` sets the live sessions' `min_draw_fps` (0 on a device as slow as a CPU).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use lipsync::media::audio::{self, Fps};
use lipsync::media::video::live::{Fragments, Piece};
use lipsync::media::video::EncoderSettings;
use lipsync::model::DeviceKind;
use lipsync::server::live_cpu::{self, tree};
use tokio_tungstenite::tungstenite::{self, Message};

use lipsync::config::choice;

use super::{read_file, write_wav, BenchArgs, CliError};

/// The media section's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct MediaFlags {
    /// Seconds of speech in each request of the media section (the speech file looped).
    #[arg(long, default_value_t = 40.0)]
    pub media_seconds: f64,
    /// Runs of each request of the media section; medians are reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub media_repeats: u32,
    /// The media section's 1280×720 photo [default: --image scaled to 1280×1280 and cropped
    /// to 1280×720 from row 200, the first frame of bench/clip_avatar.sh's clip without grain].
    #[arg(long)]
    pub media_photo_720p: Option<PathBuf>,
    /// The media section's 720p clip avatar, e.g. target/bench-clip/hd.mp4 from
    /// bench/clip_avatar.sh [default: made from --image as that script makes it (x264
    /// veryfast instead of medium), at most 10 s and no longer than --media-seconds].
    #[arg(long)]
    pub media_clip: Option<PathBuf>,
    /// Live session counts of the media section, tried in order until one does not hold.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub live_sessions: Vec<u32>,
    /// Seconds of each live session: 2 s of speech, 2 s of silence, repeated.
    #[arg(long, default_value_t = 12.0)]
    pub live_seconds: f64,
    /// A live level holds only if the 99th percentile of chunk sent → frame received stays
    /// under this many milliseconds.
    #[arg(long, default_value_t = 1000.0)]
    pub live_latency_bound_ms: f64,
    /// The live sessions' `min_draw_fps` (sent in their opening message) [default: the
    /// server's]; 0 lets a slow device (the CPU) admit them at any drawing rate.
    #[arg(long, value_parser = non_negative_fps)]
    pub live_min_draw_fps: Option<f64>,
    /// Where the media section's servers run the model: echo (the stand-in that costs
    /// nothing; no checkpoint), or cuda or cpu with --checkpoint, to measure the whole service
    /// with the same client and beside the echo rows.
    #[arg(long, default_value = "echo", value_parser = choice::<DeviceKind>(DeviceKind::NAMES))]
    pub media_device: DeviceKind,
    /// A flag for the media section's servers, repeatable, e.g.
    /// `--media-serve-arg=--autotune-cache=FILE`.
    #[arg(
        long = "media-serve-arg",
        value_name = "ARG",
        allow_hyphen_values = true
    )]
    pub media_serve_args: Vec<String>,
    /// The media section's parts, comma-separated: requests (the three avatars, each against
    /// its floor), cores (the first request pinned to one core and to two), live (sessions).
    #[arg(long, value_delimiter = ',', default_value = "requests,cores,live",
          value_parser = ["requests", "cores", "live"])]
    pub media_parts: Vec<String>,
    /// The live sessions' avatars, comma-separated: photo (--image), clip (the 720p clip).
    #[arg(long, value_delimiter = ',', default_value = "photo,clip", value_parser = ["photo", "clip"])]
    pub live_avatars: Vec<String>,
    /// The live sessions' outputs, comma-separated: fmp4, jpeg.
    #[arg(long, value_delimiter = ',', default_value = "fmp4,jpeg", value_parser = ["fmp4", "jpeg"])]
    pub live_outputs: Vec<String>,
}

impl MediaFlags {
    /// Whether the part is to run (`--media-parts`).
    fn part(&self, name: &str) -> bool {
        self.media_parts.iter().any(|p| p == name)
    }

    /// Refuses values the section cannot run with (before anything runs).
    pub fn check(&self) -> Result<(), String> {
        let s = self.media_seconds;
        if !(s.is_finite() && s > 0.0 && s <= audio::DEFAULT_MAX_SECONDS) {
            return Err(format!(
                "--media-seconds {s}: above 0 and at most {} (serve's longest audio)",
                audio::DEFAULT_MAX_SECONDS
            ));
        }
        let l = self.live_seconds;
        if !(l.is_finite() && (1.0..=600.0).contains(&l)) {
            return Err(format!("--live-seconds {l}: 1 to 600"));
        }
        if !(self.live_latency_bound_ms.is_finite() && self.live_latency_bound_ms > 0.0) {
            return Err("--live-latency-bound-ms: above 0".into());
        }
        Ok(())
    }
}

/// The live sessions' frame rate.
const FPS: f64 = 25.0;
/// Live audio: 20 ms of 16 kHz s16le mono per message.
const CHUNK_SAMPLES: usize = 320;
/// One cycle of a live session: speech, then as long without.
const SPEAK_SECONDS: f64 = 2.0;
const CYCLE_SECONDS: f64 = 4.0;
/// Frames received may differ from frames due by this share in a level that holds.
const FRAMES_TOLERANCE: f64 = 0.05;
/// A level's latency rises when the last utterance's p50 exceeds the first one's by more
/// than this share and [`RISE_MS`].
const RISE_SHARE: f64 = 0.2;
const RISE_MS: f64 = 50.0;

fn fail(msg: impl Into<String>) -> CliError {
    CliError::Jobs(msg.into())
}

fn io(what: &str) -> impl Fn(std::io::Error) -> CliError + '_ {
    move |e| fail(format!("{what}: {e}"))
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

/// The `p`-th quantile of `sorted` (nearest rank), NaN when empty.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[(((sorted.len() - 1) as f64) * p).round() as usize]
}

// ---------------------------------------------------------------------------------------
// Processes: CPU of a tree, memory.

/// Waits until `root`'s encoders are done, at most `limit`: whether it got there. What stays
/// are the encoder processes the service starts ahead of the next render and the workers it
/// keeps between renders (its spares, [`lipsync::media::video::Spares`]), blocked on their
/// input: the tree is quiet once its CPU has not grown for 200 ms and no more processes are
/// left than those may be. (The
/// spares' start is counted where it happens: a render's tree CPU includes the start of the
/// processes that replace the ones it took.)
fn wait_quiet(root: u32, limit: Duration) -> bool {
    let until = Instant::now() + limit;
    let mut last = None;
    loop {
        let procs = tree(root);
        let ticks: u64 = procs.iter().map(|p| p.ticks).sum();
        let idle =
            lipsync::media::video::spares::MAX_IDLE + lipsync::media::video::spares::MAX_KEPT;
        if procs.len() <= 1 + idle && last == Some(ticks) {
            return true;
        }
        last = Some(ticks);
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// CPU seconds of this process's reaped children so far (/proc/self/stat cutime + cstime).
fn reaped_children_cpu() -> f64 {
    live_cpu::reaped_children_seconds()
}

/// A `kB` line of a /proc file (`VmRSS:`, `Pss:`), in bytes.
fn proc_kb(path: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// Memory of a server during a live level, sampled.
#[derive(Debug, Default, Clone, Copy)]
struct MemoryPeak {
    rss: u64,
    /// Largest total PSS of the encoders (ffmpeg descendants) at one sample, and how many
    /// there were then.
    encoders_pss: u64,
    encoders: usize,
}

/// Samples the server's RSS and its encoders' PSS every 250 ms until dropped.
struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<MemoryPeak>>,
}

impl Sampler {
    fn start(root: u32) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peak = MemoryPeak::default();
            while !flag.load(Ordering::SeqCst) {
                peak.rss = peak
                    .rss
                    .max(proc_kb(&format!("/proc/{root}/status"), "VmRSS:").unwrap_or(0));
                let encoders: Vec<u64> = tree(root)
                    .iter()
                    .filter(|p| p.pid != root && p.comm == "ffmpeg")
                    .filter_map(|p| proc_kb(&format!("/proc/{}/smaps_rollup", p.pid), "Pss:"))
                    .collect();
                let total: u64 = encoders.iter().sum();
                if total > peak.encoders_pss {
                    peak.encoders_pss = total;
                    peak.encoders = encoders.len();
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            peak
        });
        Sampler {
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> MemoryPeak {
        self.stop.store(true, Ordering::SeqCst);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

// ---------------------------------------------------------------------------------------
// The server.

/// How the section starts `lipsync serve`: the device, and the flags beside the bench's own
/// (the checkpoint for a model, `--media-serve-arg`s).
struct Launch<'a> {
    ffmpeg: &'a Path,
    device: DeviceKind,
    args: Vec<std::ffi::OsString>,
}

impl Launch<'_> {
    /// What the log and errors call the server.
    fn name(&self) -> String {
        format!("lipsync serve --device {}", self.device.name())
    }
}

/// `lipsync serve` as a child process (pinned to `cpus` with taskset), on a free loopback
/// port, with its own data directory; killed when dropped.
struct Server {
    child: Child,
    pid: u32,
    base: String,
    name: String,
    log: Arc<Mutex<Vec<String>>>,
    _data: tempfile::TempDir,
}

impl Server {
    fn start(launch: &Launch, cpus: Option<&str>, http: &Http) -> Result<Server, CliError> {
        let exe = std::env::current_exe().map_err(io("cannot find this executable"))?;
        let data = tempfile::Builder::new()
            .prefix("lipsync-bench-media-")
            .tempdir()
            .map_err(io("cannot make a data directory"))?;
        let mut cmd = match cpus {
            Some(c) => {
                let mut t = Command::new("taskset");
                t.args(["-c", c]).arg(&exe);
                t
            }
            None => Command::new(&exe),
        };
        cmd.args(["serve", "--device", launch.device.name()])
            .args(["--host", "127.0.0.1", "--port", "0"])
            .arg("--data-dir")
            .arg(data.path())
            .arg("--ffmpeg")
            .arg(launch.ffmpeg)
            .args(&launch.args)
            .env("LIPSYNC_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let name = launch.name();
        let mut child = cmd
            .spawn()
            .map_err(|e| fail(format!("cannot start `{name}`: {e}")))?;
        let pid = child.id();
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let keep = log.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on ").nth(1) {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
                }
                let mut log = keep.lock().unwrap_or_else(|p| p.into_inner());
                log.push(line);
                if log.len() > 400 {
                    log.drain(..200);
                }
            }
        });
        let mut server = Server {
            child,
            pid,
            base: String::new(),
            name,
            log,
            _data: data,
        };
        server.base = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(base) => base,
            Err(_) => {
                // Its log closed or the time ran out: say which, once it has had a moment
                // to exit.
                let mut why = "did not listen within 60 s".to_string();
                for _ in 0..20 {
                    if let Ok(Some(status)) = server.child.try_wait() {
                        why = format!("exited ({status}) before it listened");
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                return Err(server.failed(&why));
            }
        };
        // A model's warm-up (autotuning, without a cache file) takes longer than echo's.
        let ready = if launch.device == DeviceKind::Echo {
            120
        } else {
            600
        };
        let until = Instant::now() + Duration::from_secs(ready);
        loop {
            if http.ready(&server.base) {
                return Ok(server);
            }
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(server.failed(&format!("exited ({status})")));
            }
            if Instant::now() >= until {
                return Err(server.failed(&format!("was not ready within {ready} s")));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// An error saying what the server did, with the end of its log.
    fn failed(&self, what: &str) -> CliError {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        let tail = log[log.len().saturating_sub(20)..].join("\n");
        fail(format!("`{}` {what}:\n{tail}", self.name))
    }

    /// Waits until its encoders have exited, then its tree's CPU seconds.
    fn quiet_cpu(&self) -> f64 {
        wait_quiet(self.pid, Duration::from_secs(20));
        live_cpu::tree_cpu_seconds_of(self.pid)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------
// HTTP.

/// The bench's HTTP client and the runtime it runs on.
struct Http {
    rt: tokio::runtime::Runtime,
    client: reqwest::Client,
}

/// A multipart form body: `(name, file name or None for a text field, bytes)`.
fn multipart(parts: &[(&str, Option<&str>, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "lipsync-bench-media-boundary-5c1d3e";
    let mut body = Vec::new();
    for (name, file, bytes) in parts {
        body.extend(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"").bytes(),
        );
        if let Some(f) = file {
            body.extend(
                format!("; filename=\"{f}\"\r\nContent-Type: application/octet-stream").bytes(),
            );
        }
        body.extend(b"\r\n\r\n");
        body.extend_from_slice(bytes);
        body.extend(b"\r\n");
    }
    body.extend(format!("--{boundary}--\r\n").bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// A whole `POST /v1/lipsync` as the client saw it.
struct Rendered {
    wall: f64,
    ttfb: f64,
    body: Vec<u8>,
}

impl Http {
    fn new() -> Result<Http, CliError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io("cannot start a runtime"))?;
        let client = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(900))
            .build()
            .map_err(|e| fail(format!("cannot make an HTTP client: {e}")))?;
        Ok(Http { rt, client })
    }

    fn ready(&self, base: &str) -> bool {
        self.rt.block_on(async {
            self.client
                .get(format!("{base}/ready"))
                .timeout(Duration::from_secs(5))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        })
    }

    async fn post(
        &self,
        url: String,
        parts: &[(&str, Option<&str>, &[u8])],
    ) -> Result<reqwest::Response, CliError> {
        let (content_type, body) = multipart(parts);
        let r = self
            .client
            .post(&url)
            .header(reqwest::header::CONTENT_TYPE, content_type)
            .body(body)
            .send()
            .await
            .map_err(|e| fail(format!("POST {url}: {e}")))?;
        if !r.status().is_success() {
            let status = r.status();
            let text = r.text().await.unwrap_or_default();
            return Err(fail(format!("POST {url}: {status} {text}")));
        }
        Ok(r)
    }

    /// `POST /v1/avatars` with `bytes` as `field` (`image` or `video`) and `box` if given:
    /// the avatar's id.
    fn upload(
        &self,
        base: &str,
        field: &str,
        bytes: &[u8],
        face_box: Option<&str>,
    ) -> Result<String, CliError> {
        let v = self.avatar(base, field, bytes, face_box)?;
        v["id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| fail(format!("the avatar upload answered without an id: {v}")))
    }

    /// [`Http::upload`]'s whole answer (`id`, `box`, …).
    fn avatar(
        &self,
        base: &str,
        field: &str,
        bytes: &[u8],
        face_box: Option<&str>,
    ) -> Result<serde_json::Value, CliError> {
        self.rt.block_on(async {
            let url = format!("{base}/v1/avatars");
            let mut parts = vec![(field, Some("avatar"), bytes)];
            if let Some(b) = face_box {
                parts.push(("box", None, b.as_bytes()));
            }
            let r = self.post(url, &parts).await?;
            let body = r
                .bytes()
                .await
                .map_err(|e| fail(format!("the avatar upload's answer: {e}")))?;
            Ok(serde_json::from_slice(&body).unwrap_or_default())
        })
    }

    /// `POST /v1/lipsync` with the speech on `avatar`, the whole response read.
    fn render(&self, base: &str, avatar: &str, wav: &[u8]) -> Result<Rendered, CliError> {
        self.rt.block_on(async {
            let url = format!("{base}/v1/lipsync");
            let start = Instant::now();
            let mut r = self
                .post(
                    url,
                    &[
                        ("avatar_id", None, avatar.as_bytes()),
                        ("audio", Some("speech.wav"), wav),
                    ],
                )
                .await?;
            let mut first = None;
            let mut body = Vec::new();
            while let Some(chunk) = r
                .chunk()
                .await
                .map_err(|e| fail(format!("reading the video: {e}")))?
            {
                first.get_or_insert_with(|| start.elapsed().as_secs_f64());
                body.extend_from_slice(&chunk);
            }
            Ok(Rendered {
                wall: start.elapsed().as_secs_f64(),
                ttfb: first.unwrap_or(f64::NAN),
                body,
            })
        })
    }
}

// ---------------------------------------------------------------------------------------
// Checking a response, and the floor.

/// What ffprobe finds in a response.
#[derive(Debug, Default)]
struct Probe {
    video: String,
    audio: String,
    width: u32,
    height: u32,
    /// Video packets (frames) in the container.
    frames: u64,
}

fn ffprobe_of(ffmpeg: &Path) -> PathBuf {
    match ffmpeg.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.join("ffprobe"),
        _ => PathBuf::from("ffprobe"),
    }
}

fn probe(ffprobe: &Path, file: &Path) -> Result<Probe, CliError> {
    let o = Command::new(ffprobe)
        .args(["-v", "error", "-count_packets", "-show_entries"])
        .args([
            "stream=codec_type,codec_name,width,height,nb_read_packets",
            "-of",
            "json",
        ])
        .arg(file)
        .stdin(Stdio::null())
        .output()
        .map_err(io("cannot run ffprobe"))?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
    let mut p = Probe::default();
    for s in v["streams"].as_array().into_iter().flatten() {
        let codec = s["codec_name"].as_str().unwrap_or("").to_string();
        match s["codec_type"].as_str() {
            Some("video") => {
                p.video = codec;
                p.width = s["width"].as_u64().unwrap_or(0) as u32;
                p.height = s["height"].as_u64().unwrap_or(0) as u32;
                p.frames = s["nb_read_packets"]
                    .as_str()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
            }
            Some("audio") => p.audio = codec,
            _ => {}
        }
    }
    Ok(p)
}

/// The floor's encode of one response.
#[derive(Debug, Clone, Copy)]
struct Floor {
    /// CPU seconds of the encoding ffmpeg (not the decoder).
    cpu: f64,
    wall: f64,
    /// Frames the decoder gave it.
    frames: u64,
}

/// Decodes `mp4`'s video to yuv420p and pipes it to one ffmpeg encoding it with `settings`
/// ([`EncoderSettings::yuv420p_args`]: the service's x264 and AAC options) to nowhere.
fn floor(settings: &EncoderSettings, mp4: &Path) -> Result<Floor, CliError> {
    let frame_bytes = settings.width as usize * settings.height as usize * 3 / 2;
    let mut decoder = Command::new(&settings.ffmpeg)
        .args(["-hide_banner", "-nostdin", "-loglevel", "error", "-i"])
        .arg(mp4)
        .args([
            "-map", "0:v:0", "-f", "rawvideo", "-pix_fmt", "yuv420p", "pipe:1",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io("cannot run ffmpeg"))?;
    let start = Instant::now();
    let mut encoder = match Command::new(&settings.ffmpeg)
        .args(settings.yuv420p_args())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            let _ = decoder.kill();
            let _ = decoder.wait();
            return Err(fail(format!("cannot run ffmpeg: {e}")));
        }
    };
    // Relay the raw frames (the bench's work, not the floor's).
    let mut from = decoder.stdout.take().expect("piped stdout");
    let mut to = encoder.stdin.take().expect("piped stdin");
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0usize;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        bytes += n;
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let stderr = |c: &mut Child| {
        let mut s = String::new();
        if let Some(mut e) = c.stderr.take() {
            let _ = e.read_to_string(&mut s);
        }
        s
    };
    // The decoder is reaped first, then the encoder alone: the reaped children's CPU grows by
    // the encoder's between the two readings (no other child of this process ends meanwhile).
    let decoded = decoder.wait().map_err(io("ffmpeg"))?;
    let before = reaped_children_cpu();
    drop(to);
    let encoded = encoder.wait().map_err(io("ffmpeg"))?;
    let cpu = reaped_children_cpu() - before;
    let wall = start.elapsed().as_secs_f64();
    if !decoded.success() {
        return Err(fail(format!(
            "decoding {} failed: {}",
            mp4.display(),
            stderr(&mut decoder)
        )));
    }
    if !encoded.success() {
        return Err(fail(format!(
            "the floor's encode failed: {}",
            stderr(&mut encoder)
        )));
    }
    Ok(Floor {
        cpu,
        wall,
        frames: (bytes / frame_bytes.max(1)) as u64,
    })
}

// ---------------------------------------------------------------------------------------
// Inputs.

/// `--image` scaled to 1280×1280 and cropped to 1280×720 from row 200 (PNG).
fn photo_720p(image: &[u8]) -> Result<Vec<u8>, CliError> {
    let img = image::load_from_memory(image)
        .map_err(|e| fail(format!("cannot decode --image: {e}")))?
        .to_rgb8();
    let big = image::imageops::resize(&img, 1280, 1280, image::imageops::FilterType::Triangle);
    let crop = image::imageops::crop_imm(&big, 0, 200, 1280, 720).to_image();
    let mut png = Vec::new();
    crop.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
        .map_err(|e| fail(format!("cannot encode the 720p photo: {e}")))?;
    Ok(png)
}

/// bench/clip_avatar.sh's clip (a slow pan over the photo with film grain), `seconds` long.
fn make_clip(ffmpeg: &Path, image: &Path, seconds: f64, out: &Path) -> Result<(), CliError> {
    let o = Command::new(ffmpeg)
        .args(["-v", "error", "-y", "-loop", "1", "-i"])
        .arg(image)
        .args([
            "-vf",
            "scale=1280:1280,crop=1280:720:0:'200+100*sin(t)',noise=alls=6:allf=t,format=yuv420p",
            "-t",
            &format!("{seconds}"),
            "-r",
            "25",
            "-c:v",
            "libx264",
            "-preset",
            "veryfast",
            "-crf",
            "20",
        ])
        .arg(out)
        .stdin(Stdio::null())
        .output()
        .map_err(io("cannot run ffmpeg"))?;
    if !o.status.success() {
        return Err(fail(format!(
            "making the 720p clip failed: {}",
            String::from_utf8_lossy(&o.stderr)
        )));
    }
    Ok(())
}

/// The first frame of `clip` as PNG.
fn first_frame(ffmpeg: &Path, clip: &Path) -> Result<Vec<u8>, CliError> {
    let o = Command::new(ffmpeg)
        .args(["-v", "error", "-i"])
        .arg(clip)
        .args([
            "-frames:v",
            "1",
            "-f",
            "image2pipe",
            "-c:v",
            "png",
            "pipe:1",
        ])
        .stdin(Stdio::null())
        .output()
        .map_err(io("cannot run ffmpeg"))?;
    if !o.status.success() || o.stdout.is_empty() {
        return Err(fail(format!(
            "cannot read the first frame of {}: {}",
            clip.display(),
            String::from_utf8_lossy(&o.stderr)
        )));
    }
    Ok(o.stdout)
}

/// `POST /v1/avatars` with the clip, with the box detected on its first frame, as
/// bench/clip_avatar.sh uploads it: preparation decodes and crops without detecting the face
/// in every frame (what a request costs does not depend on it).
fn upload_clip(
    http: &Http,
    base: &str,
    ffmpeg: &Path,
    clip: &Path,
    bytes: &[u8],
) -> Result<String, CliError> {
    let first = http.avatar(base, "image", &first_frame(ffmpeg, clip)?, None)?;
    let face_box = first["box"]
        .as_array()
        .map(|b| {
            b.iter()
                .map(|x| x.as_u64().unwrap_or(0).to_string())
                .collect::<Vec<_>>()
                .join(",")
        })
        .ok_or_else(|| fail(format!("no box for the clip's first frame: {first}")))?;
    http.upload(base, "video", bytes, Some(&face_box))
}

fn image_size(bytes: &[u8]) -> (u32, u32) {
    image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .ok()
        .and_then(|r| r.into_dimensions().ok())
        .unwrap_or((0, 0))
}

// ---------------------------------------------------------------------------------------
// The requests.

/// One request and its floor.
#[derive(Debug, Clone, Copy)]
struct Run {
    wall: f64,
    ttfb: f64,
    cpu: f64,
    floor: Floor,
    /// CPU seconds of the floor's encode with a live session's settings (x264 alone against
    /// the live encoder's options).
    live_floor_cpu: f64,
    playable: bool,
}

/// Runs the request `repeats` times: each response checked and, `with_floor`, its floor
/// measured, with the service's file settings `encoder` and a live session's `live` ones
/// (their size taken from the response).
#[allow(clippy::too_many_arguments)]
fn runs(
    http: &Http,
    server: &Server,
    avatar: &str,
    wav: &[u8],
    speech: &Path,
    (encoder, live): (&EncoderSettings, &EncoderSettings),
    ffprobe: &Path,
    frames: u64,
    repeats: u32,
    with_floor: bool,
) -> Result<(Vec<Run>, Vec<String>), CliError> {
    let dir = tempfile::tempdir().map_err(io("cannot make a temporary folder"))?;
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for _ in 0..repeats {
        let before = server.quiet_cpu();
        let r = http.render(&server.base, avatar, wav)?;
        let cpu = server.quiet_cpu() - before;
        let mp4 = dir.path().join("response.mp4");
        std::fs::write(&mp4, &r.body).map_err(io("cannot write the response"))?;
        let p = probe(ffprobe, &mp4)?;
        let mut playable = p.video == "h264" && p.audio == "aac" && p.frames == frames;
        if !playable {
            problems.push(format!(
                "response: video {:?}, audio {:?}, {} frames (expected h264, aac, {frames})",
                p.video, p.audio, p.frames
            ));
        }
        let sized = |e: &EncoderSettings| {
            let mut s = e.clone();
            s.width = p.width;
            s.height = p.height;
            s.threads = Some(1);
            s.workers = 1;
            s.audio = Some(speech.to_path_buf());
            s
        };
        let (floor, live_floor_cpu) = if with_floor {
            let f = floor(&sized(encoder), &mp4)?;
            if f.frames != frames {
                playable = false;
                problems.push(format!("{} frames decoded, {frames} expected", f.frames));
            }
            (f, self::floor(&sized(live), &mp4)?.cpu)
        } else {
            let none = Floor {
                cpu: f64::NAN,
                wall: f64::NAN,
                frames: 0,
            };
            (none, f64::NAN)
        };
        out.push(Run {
            wall: r.wall,
            ttfb: r.ttfb,
            cpu,
            floor,
            live_floor_cpu,
            playable,
        });
    }
    Ok((out, problems))
}

fn run_json(r: &Run) -> serde_json::Value {
    serde_json::json!({
        "wall_s": r.wall, "ttfb_s": r.ttfb, "tree_cpu_s": r.cpu, "floor_cpu_s": r.floor.cpu,
        "floor_wall_s": r.floor.wall, "live_floor_cpu_s": r.live_floor_cpu,
        "playable": r.playable,
    })
}

// ---------------------------------------------------------------------------------------
// Live sessions.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    Fmp4,
    Jpeg,
}

impl Output {
    fn name(self) -> &'static str {
        match self {
            Output::Fmp4 => "fmp4",
            Output::Jpeg => "jpeg",
        }
    }
}

/// What one session saw.
#[derive(Debug, Default)]
struct SessionOut {
    /// Refused: HTTP status or `over_capacity`.
    refused: Option<String>,
    failed: Option<String>,
    /// JPEG: (frame index, arrival); fMP4: (frames received so far, arrival), per message.
    frames: Vec<(u64, Instant)>,
    /// The frame each utterance starts at (`speaking` events, in order).
    speaking: Vec<u64>,
    /// Chunks sent: (utterance, first sample within it, when).
    sent: Vec<(usize, usize, Instant)>,
    /// The `end` message's stats.
    stats: Option<serde_json::Value>,
    /// The `ready` message.
    ready: Option<serde_json::Value>,
}

impl SessionOut {
    fn received(&self, output: Output) -> u64 {
        match output {
            Output::Jpeg => self.frames.len() as u64,
            Output::Fmp4 => self.frames.last().map_or(0, |f| f.0),
        }
    }

    /// Frames the session's clock called for between the first frame and the last received.
    fn due(&self, output: Output) -> f64 {
        let first = match output {
            Output::Jpeg => self.frames.first(),
            Output::Fmp4 => self.frames.iter().find(|f| f.0 > 0),
        };
        match (first, self.frames.last()) {
            (Some(a), Some(b)) => b.1.saturating_duration_since(a.1).as_secs_f64() * FPS + 1.0,
            _ => 0.0,
        }
    }

    /// (the chunk's utterance, chunk sent → message holding its frame in seconds).
    fn latencies(&self, output: Output) -> Vec<(usize, f64)> {
        let by_index: HashMap<u64, Instant> = match output {
            Output::Jpeg => {
                let mut m = HashMap::new();
                for &(k, at) in &self.frames {
                    m.entry(k).or_insert(at);
                }
                m
            }
            Output::Fmp4 => HashMap::new(),
        };
        let mut out = Vec::new();
        for &(u, first_sample, at) in &self.sent {
            let Some(&k0) = self.speaking.get(u) else {
                continue;
            };
            let k = k0 + (first_sample as f64 * FPS / 16_000.0) as u64;
            let got = match output {
                Output::Jpeg => by_index.get(&k).copied(),
                Output::Fmp4 => {
                    let i = self.frames.partition_point(|(n, _)| *n <= k);
                    self.frames.get(i).map(|f| f.1)
                }
            };
            if let Some(got) = got {
                out.push((u, got.saturating_duration_since(at).as_secs_f64()));
            }
        }
        out
    }
}

/// `--live-min-draw-fps`: a finite number ≥ 0.
fn non_negative_fps(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a number of faces per second ≥ 0")),
    }
}

/// One live session: open (with `min_draw_fps` where given), wait for `ready`, speak and pause
/// for `seconds`, `end`.
async fn session(
    base: String,
    avatar: String,
    output: Output,
    speech: Arc<Vec<u8>>,
    seconds: f64,
    min_draw_fps: Option<f64>,
) -> SessionOut {
    let mut out = SessionOut::default();
    let url = format!("{}/v1/stream", base.replacen("http://", "ws://", 1));
    let connect = tokio::time::timeout(
        Duration::from_secs(20),
        tokio_tungstenite::connect_async(url),
    )
    .await;
    let ws = match connect {
        Err(_) => {
            out.failed = Some("no connection within 20 s".into());
            return out;
        }
        Ok(Err(tungstenite::Error::Http(r))) => {
            out.refused = Some(format!("HTTP {}", r.status()));
            return out;
        }
        Ok(Err(e)) => {
            out.failed = Some(format!("cannot connect: {e}"));
            return out;
        }
        Ok(Ok((ws, _))) => ws,
    };
    let (mut tx, mut rx) = ws.split();
    let mut opening = serde_json::json!({
        "avatar_id": avatar, "fps": FPS, "output": output.name(),
        "audio": {"format": "s16le", "sample_rate": 16000, "channels": 1},
    });
    if let Some(min) = min_draw_fps {
        opening["min_draw_fps"] = serde_json::json!(min);
    }
    if tx
        .send(Message::Text(opening.to_string().into()))
        .await
        .is_err()
    {
        out.failed = Some("the opening could not be sent".into());
        return out;
    }

    // Everything that comes back, on its own task.
    let (ready_tx, ready_rx) =
        tokio::sync::oneshot::channel::<Result<serde_json::Value, serde_json::Value>>();
    let reader = tokio::spawn(async move {
        let mut ready = Some(ready_tx);
        let mut got = SessionOut::default();
        let mut error = None;
        let mut cut = Fragments::default();
        let mut so_far = 0u64;
        while let Some(Ok(msg)) = rx.next().await {
            let now = Instant::now();
            match msg {
                Message::Text(t) => {
                    let v: serde_json::Value = serde_json::from_str(&t).unwrap_or_default();
                    match v["type"].as_str() {
                        Some("ready") => {
                            if let Some(r) = ready.take() {
                                let _ = r.send(Ok(v.clone()));
                            }
                        }
                        Some("speaking") => got.speaking.extend(v["frame"].as_u64()),
                        Some("end") => got.stats = Some(v["stats"].clone()),
                        Some("error") => {
                            if let Some(r) = ready.take() {
                                let _ = r.send(Err(v.clone()));
                            }
                            error = Some(v);
                        }
                        _ => {}
                    }
                }
                Message::Binary(b) => match output {
                    Output::Jpeg if b.len() >= 4 => {
                        let k = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                        got.frames.push((u64::from(k), now));
                    }
                    Output::Jpeg => {}
                    Output::Fmp4 => {
                        for p in cut.push(&b) {
                            if let Piece::Fragment(_, n) = p {
                                so_far += u64::from(n);
                            }
                        }
                        got.frames.push((so_far, now));
                    }
                },
                Message::Close(_) => break,
                _ => {}
            }
        }
        if let Some(e) = error {
            got.failed = Some(format!(
                "{} ({})",
                e["error"].as_str().unwrap_or("?"),
                e["error_type"].as_str().unwrap_or("?")
            ));
        }
        got
    });

    let ready = tokio::time::timeout(Duration::from_secs(30), ready_rx).await;
    match ready {
        Ok(Ok(Ok(v))) => out.ready = Some(v),
        Ok(Ok(Err(e))) => {
            let kind = e["error_type"].as_str().unwrap_or("?");
            if matches!(kind, "over_capacity" | "overloaded") {
                out.refused = Some(kind.to_string());
            } else {
                out.failed = Some(format!("{} ({kind})", e["error"].as_str().unwrap_or("?")));
            }
            reader.abort();
            return out;
        }
        _ => {
            out.failed = Some("no `ready` within 30 s".into());
            reader.abort();
            return out;
        }
    }

    // 2 s of speech in 20 ms chunks paced in real time, 2 s without, until `seconds`.
    let t0 = Instant::now();
    let chunk_bytes = CHUNK_SAMPLES * 2;
    let mut pos = 0usize;
    let mut cycle = 0usize;
    'speak: while (cycle as f64) * CYCLE_SECONDS < seconds {
        let start = cycle as f64 * CYCLE_SECONDS;
        let stop = (start + SPEAK_SECONDS).min(seconds);
        let chunks = ((stop - start) * 16_000.0 / CHUNK_SAMPLES as f64).round() as usize;
        for j in 0..chunks {
            let since = start + (j * CHUNK_SAMPLES) as f64 / 16_000.0;
            tokio::time::sleep_until((t0 + Duration::from_secs_f64(since)).into()).await;
            let chunk: Vec<u8> = (0..chunk_bytes)
                .map(|i| speech[(pos + i) % speech.len()])
                .collect();
            pos = (pos + chunk_bytes) % speech.len();
            out.sent.push((cycle, j * CHUNK_SAMPLES, Instant::now()));
            if tx.send(Message::Binary(chunk.into())).await.is_err() {
                break 'speak;
            }
        }
        cycle += 1;
    }
    tokio::time::sleep_until((t0 + Duration::from_secs_f64(seconds)).into()).await;
    let _ = tx
        .send(Message::Text(r#"{"type":"end"}"#.to_string().into()))
        .await;
    match tokio::time::timeout(Duration::from_secs(30), reader).await {
        Ok(Ok(got)) => {
            out.frames = got.frames;
            out.speaking = got.speaking;
            out.stats = got.stats;
            out.failed = got.failed;
            if out.stats.is_none() && out.failed.is_none() {
                out.failed = Some("closed without `end`".into());
            }
        }
        _ => out.failed = Some("no `end` within 30 s of sending it".into()),
    }
    out
}

/// A live level's results.
struct Level {
    json: serde_json::Value,
    row: String,
    holds: bool,
}

#[allow(clippy::too_many_arguments)]
fn live_level(
    http: &Http,
    launch: &Launch,
    avatar: &LiveAvatar,
    speech: &Arc<Vec<u8>>,
    output: Output,
    n: usize,
    seconds: f64,
    bound_ms: f64,
    min_draw_fps: Option<f64>,
) -> Result<Level, CliError> {
    let server = Server::start(launch, None, http)?;
    let label = &avatar.label;
    let avatar = (avatar.upload)(http, &server.base)?;
    let rss0 = proc_kb(&format!("/proc/{}/status", server.pid), "VmRSS:").unwrap_or(0);
    let cpu0 = server.quiet_cpu();
    let sampler = Sampler::start(server.pid);
    let sessions: Vec<SessionOut> = http.rt.block_on(async {
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                tokio::spawn(session(
                    server.base.clone(),
                    avatar.clone(),
                    output,
                    speech.clone(),
                    seconds,
                    min_draw_fps,
                ))
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap_or_else(|e| SessionOut {
                failed: Some(format!("the session's task failed: {e}")),
                ..SessionOut::default()
            }));
        }
        out
    });
    let cpu = server.quiet_cpu() - cpu0;
    let memory = sampler.finish();
    drop(server);

    let refused = sessions.iter().filter(|s| s.refused.is_some()).count();
    let failed: Vec<&str> = sessions
        .iter()
        .filter_map(|s| s.failed.as_deref())
        .collect();
    let received: u64 = sessions.iter().map(|s| s.received(output)).sum();
    let due: f64 = sessions.iter().map(|s| s.due(output)).sum();
    let admitted = || sessions.iter().filter(|s| s.refused.is_none());
    let frames_ok = admitted().all(|s| {
        let due = s.due(output);
        due > 0.0 && (s.received(output) as f64 / due - 1.0).abs() <= FRAMES_TOLERANCE
    });
    let stat = |key: &str| -> u64 {
        sessions
            .iter()
            .filter_map(|s| s.stats.as_ref()?[key].as_u64())
            .sum()
    };
    let (held, speaking) = (stat("held_frames"), stat("speaking_frames"));
    // Held because a face asked for came late, not because the drawing rate left it out;
    // and how often the sessions slowed their rate (after another session's miss too).
    let (missed, backoffs, for_others) = (
        stat("missed_frames"),
        stat("backoffs"),
        stat("backoffs_for_others"),
    );
    let mut lat: Vec<(usize, f64)> = sessions.iter().flat_map(|s| s.latencies(output)).collect();
    lat.sort_by(|a, b| a.1.total_cmp(&b.1));
    let all: Vec<f64> = lat.iter().map(|l| l.1 * 1e3).collect();
    // The trend: the first utterance against the last (whole utterances: the last chunks of
    // one wait for its end, so parts of utterances would not compare).
    let utterance = |u: usize| -> f64 {
        let v: Vec<f64> = lat.iter().filter(|l| l.0 == u).map(|l| l.1 * 1e3).collect();
        percentile(&v, 0.5)
    };
    let (p50, p99) = (percentile(&all, 0.5), percentile(&all, 0.99));
    let last_utterance = lat.iter().map(|l| l.0).max().unwrap_or(0);
    let (first, last) = (utterance(0), utterance(last_utterance));
    let rising = last > first * (1.0 + RISE_SHARE) && last > first + RISE_MS;
    let holds = refused == 0
        && failed.is_empty()
        && frames_ok
        && !all.is_empty()
        && p99 < bound_ms
        && !rising;
    let cpu_per_frame_ms = cpu / received.max(1) as f64 * 1e3;
    // The largest lag a session was given (its `ready`): the issue's bound is p99 ≤ lag + 100 ms.
    let lag_ms = sessions
        .iter()
        .filter_map(|s| s.ready.as_ref()?["lag_ms"].as_f64())
        .fold(f64::NAN, f64::max);
    let rss_per_session = memory.rss.saturating_sub(rss0) as f64 / n as f64 / 1e6;
    let pss = (memory.encoders > 0).then(|| {
        (
            memory.encoders_pss as f64 / 1e6,
            memory.encoders_pss as f64 / memory.encoders as f64 / 1e6,
        )
    });
    let mut why = Vec::new();
    if refused > 0 {
        why.push(format!("{refused} refused"));
    }
    if !failed.is_empty() {
        why.push(format!("{} failed: {}", failed.len(), failed[0]));
    }
    if !frames_ok {
        why.push("frames off due".into());
    }
    if p99.is_nan() || p99 >= bound_ms {
        why.push("p99".into());
    }
    if rising {
        why.push("rising".into());
    }
    let verdict = if holds {
        "yes".to_string()
    } else {
        format!("no ({})", why.join(", "))
    };
    let row = format!(
        "| {label} | {} | {n} | {verdict} | {received} / {due:.0} ({:+.1} %) | {held} ({missed} missed) / {speaking} | {backoffs} ({for_others}) | {p50:.0} | {p99:.0} | {lag_ms:.0} | {first:.0} → {last:.0} | {cpu_per_frame_ms:.2} | {rss_per_session:.1} | {} |",
        output.name(),
        (received as f64 / due.max(1.0) - 1.0) * 100.0,
        pss.map_or("n/a".to_string(), |(t, each)| format!(
            "{t:.1} ({each:.1} × {})",
            memory.encoders
        )),
    );
    let json = serde_json::json!({
        "avatar": label, "output": output.name(), "sessions": n, "holds": holds, "refused": refused,
        "failed": failed, "frames_received": received, "frames_due": due,
        "held_frames": held, "speaking_frames": speaking, "missed_frames": missed,
        "backoffs": backoffs, "backoffs_for_others": for_others,
        "latency_ms": {"p50": p50, "p99": p99, "p50_first_utterance": first,
                       "p50_last_utterance": last, "chunks": all.len()},
        "lag_ms": lag_ms,
        "rising": rising, "tree_cpu_s": cpu, "cpu_ms_per_frame": cpu_per_frame_ms,
        "server_rss_bytes_before": rss0, "server_rss_bytes_peak": memory.rss,
        "rss_mb_per_session": rss_per_session,
        "encoders_pss_mb": pss.map(|p| p.0), "encoders_at_peak": memory.encoders,
        "sessions_stats": sessions.iter().map(|s| s.stats.clone()).collect::<Vec<_>>(),
        "sessions_ready": sessions.iter().map(|s| s.ready.clone()).collect::<Vec<_>>(),
    });
    Ok(Level { json, row, holds })
}

/// Uploads an avatar to the server at a base URL; its id.
type Upload<'a> = Box<dyn Fn(&Http, &str) -> Result<String, CliError> + 'a>;

/// The avatar of a live level, uploaded to each level's fresh server.
struct LiveAvatar<'a> {
    label: String,
    upload: Upload<'a>,
}

// ---------------------------------------------------------------------------------------
// The section.

pub fn media(a: &BenchArgs) -> Result<serde_json::Value, CliError> {
    let f = &a.media;
    f.check().map_err(fail)?;
    lipsync::media::video::check_ffmpeg(&a.ffmpeg)?;
    let ffprobe = ffprobe_of(&a.ffmpeg);
    live_cpu::clock_ticks(); // its child process ends before any measurement
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let device = f.media_device;
    let mut launch = Launch {
        ffmpeg: &a.ffmpeg,
        device,
        args: Vec::new(),
    };
    if device != DeviceKind::Echo {
        // Plan::new has refused a model without a checkpoint, with the whole message.
        let checkpoint = a
            .checkpoint
            .as_ref()
            .ok_or_else(|| fail("--media-device needs --checkpoint"))?;
        launch.args.push("--checkpoint".into());
        launch.args.push(checkpoint.into());
        launch.args.push("--cuda-device".into());
        launch.args.push(a.cuda_device.to_string().into());
    }
    launch
        .args
        .extend(f.media_serve_args.iter().map(Into::into));
    // serve's engine and media settings as the servers will read them, for the header (the
    // flags of serve's other parts, --max-sessions say, are not read here).
    let serve = match super::serve_flags(device, a.cuda_device, &f.media_serve_args) {
        Ok(s) => s,
        Err(_) => {
            println!(
                "(--media-serve-arg holds flags this header does not read: the settings below \
                 are serve's defaults on {} without them)",
                device.name()
            );
            super::serve_flags(device, a.cuda_device, &[])?
        }
    };
    let r = serve.engine.resolve(&serve.media);
    let encoder = serve.media.encoder(64, 64, Fps::DEFAULT, 1);
    let live = serve.media.live_encoder(64, 64, Fps::DEFAULT);
    let live_x264 = format!(
        "x264 {}{}",
        live.preset,
        live.max_bitrate
            .map_or(String::new(), |b| format!(" at most {} kbit/s", b / 1000))
    );
    let http = Http::new()?;
    let dir = tempfile::tempdir().map_err(io("cannot make a temporary folder"))?;

    // The speech, looped to length.
    let clip = audio::load(&read_file(&a.audio)?, 3600.0)?.samples;
    let n = (f.media_seconds * 16_000.0).round() as usize;
    let samples: Vec<f32> = clip.iter().copied().cycle().take(n).collect();
    let speech = dir.path().join("speech.wav");
    write_wav(&speech, &samples)?;
    let wav = read_file(&speech)?;
    let frames = (n as f64 * FPS / 16_000.0 - 1e-9).ceil() as u64;

    let photo = read_file(&a.image)?;
    let (pw, ph) = image_size(&photo);
    let photo_720 = match &f.media_photo_720p {
        Some(p) => read_file(p)?,
        None => photo_720p(&photo)?,
    };
    let (hw, hh) = image_size(&photo_720);
    let clip_path = match &f.media_clip {
        Some(p) => p.clone(),
        None => {
            let p = dir.path().join("hd.mp4");
            make_clip(&a.ffmpeg, &a.image, f.media_seconds.min(10.0), &p)?;
            p
        }
    };
    let clip_bytes = read_file(&clip_path)?;
    let (cw, ch) = {
        let p = probe(&ffprobe, &clip_path)?;
        (p.width, p.height)
    };

    let device_name = device.name();
    println!(
        "\n## Media side on the {device_name} device ({:.0} s of speech, {frames} frames at 25 \
         fps; serve --device {device_name}{}: {} instance(s), batches up to {}, {} encoder \
         worker(s), x264 {} crf {}, live {}; {cores} cores; medians of {})\n",
        f.media_seconds,
        f.media_serve_args
            .iter()
            .map(|a| format!(" {a}"))
            .collect::<String>(),
        r.instances,
        r.max_batch,
        r.encoder_workers,
        encoder.preset,
        encoder.crf,
        live_x264,
        f.media_repeats
    );
    let avatars = [
        (format!("photo {pw}x{ph}"), "image", &photo),
        (format!("photo {hw}x{hh}"), "image", &photo_720),
        (format!("clip {cw}x{ch}"), "video", &clip_bytes),
    ];
    let mut rows = Vec::new();
    let mut problems = Vec::new();
    if f.part("requests") {
        println!(
            "CPU: the server's process tree (itself and every descendant, reaped ones included), \
         across the request. Floor: the response's video decoded to yuv420p and encoded again \
         from a pipe by one ffmpeg with the service's x264 options at -threads 1 and its AAC \
         options, into fMP4 (that ffmpeg's CPU alone).\n"
        );
        println!(
        "| avatar | wall | first byte | tree CPU | floor CPU | floor wall | tree ÷ floor | playable |"
    );
        println!("|---|---|---|---|---|---|---|---|");
        let server = Server::start(&launch, None, &http)?;
        for (label, field, bytes) in &avatars {
            let id = if *field == "video" {
                upload_clip(&http, &server.base, &a.ffmpeg, &clip_path, bytes)?
            } else {
                http.upload(&server.base, field, bytes, None)?
            };
            let (runs, p) = runs(
                &http,
                &server,
                &id,
                &wav,
                &speech,
                (&encoder, &live),
                &ffprobe,
                frames,
                f.media_repeats,
                true,
            )?;
            problems.extend(p.into_iter().map(|p| format!("{label}: {p}")));
            let m = |g: fn(&Run) -> f64| median(&runs.iter().map(g).collect::<Vec<_>>());
            let (wall, ttfb, cpu, floor_cpu, floor_wall, live_floor_cpu) = (
                m(|r| r.wall),
                m(|r| r.ttfb),
                m(|r| r.cpu),
                m(|r| r.floor.cpu),
                m(|r| r.floor.wall),
                m(|r| r.live_floor_cpu),
            );
            let playable = runs.iter().all(|r| r.playable);
            println!(
                "| {label} | {wall:.2} s | {ttfb:.2} s | {cpu:.2} s | {floor_cpu:.2} s | \
             {floor_wall:.2} s | {:.2}× | {} |",
                cpu / floor_cpu,
                if playable {
                    format!("yes (H.264 + AAC, {frames} frames)")
                } else {
                    "NO".to_string()
                }
            );
            rows.push(serde_json::json!({
                "avatar": label, "frames": frames, "wall_s": wall, "ttfb_s": ttfb,
                "tree_cpu_s": cpu, "floor_cpu_s": floor_cpu, "floor_wall_s": floor_wall,
                "live_floor_cpu_s": live_floor_cpu, "ratio": cpu / floor_cpu, "playable": playable,
                "runs": runs.iter().map(run_json).collect::<Vec<_>>(),
            }));
        }
        drop(server);
    }
    for p in &problems {
        println!("\n{p}");
    }

    // One core against two.
    let mut pinned = Vec::new();
    let taskset = Command::new("taskset")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !f.part("cores") {
    } else if taskset {
        println!(
            "\n### One core against two (the server under taskset; {})\n",
            avatars[0].0
        );
        println!("| CPUs | wall | first byte | tree CPU | wall vs one core |");
        println!("|---|---|---|---|---|");
        let sets: &[&str] = if cores >= 2 { &["0", "0,1"] } else { &["0"] };
        let mut one = None;
        for cpus in sets {
            let server = Server::start(&launch, Some(cpus), &http)?;
            let id = http.upload(&server.base, "image", &photo, None)?;
            let (runs, p) = runs(
                &http,
                &server,
                &id,
                &wav,
                &speech,
                (&encoder, &live),
                &ffprobe,
                frames,
                f.media_repeats,
                false,
            )?;
            drop(server);
            problems.extend(p.into_iter().map(|p| format!("taskset -c {cpus}: {p}")));
            let m = |g: fn(&Run) -> f64| median(&runs.iter().map(g).collect::<Vec<_>>());
            let (wall, ttfb, cpu) = (m(|r| r.wall), m(|r| r.ttfb), m(|r| r.cpu));
            let base = *one.get_or_insert(wall);
            println!(
                "| {cpus} | {wall:.2} s | {ttfb:.2} s | {cpu:.2} s | {:.2}× |",
                wall / base
            );
            pinned.push(serde_json::json!({
                "avatar": avatars[0].0, "cpus": cpus, "cores": cpus.split(',').count(),
                "wall_s": wall, "ttfb_s": ttfb, "tree_cpu_s": cpu,
                "runs": runs.iter().map(run_json).collect::<Vec<_>>(),
            }));
        }
    } else {
        println!("\n(no taskset here: the one-core/two-core comparison is skipped)");
    }

    // Live sessions.
    let mut levels = Vec::new();
    let mut largest = serde_json::Map::new();
    let mut floor_bound = serde_json::Map::new();
    if f.part("live") {
        let pcm: Arc<Vec<u8>> = Arc::new(
            clip.iter()
                .flat_map(|s| {
                    ((s * 32_768.0).round().clamp(-32_768.0, 32_767.0) as i16).to_le_bytes()
                })
                .collect(),
        );
        let mut live_avatars = Vec::new();
        if f.live_avatars.iter().any(|a| a == "photo") {
            live_avatars.push(LiveAvatar {
                label: avatars[0].0.clone(),
                upload: Box::new(|http: &Http, base: &str| {
                    http.upload(base, "image", &photo, None)
                }),
            });
        }
        if f.live_avatars.iter().any(|a| a == "clip") {
            live_avatars.push(LiveAvatar {
                label: avatars[2].0.clone(),
                upload: Box::new(|http: &Http, base: &str| {
                    upload_clip(http, base, &a.ffmpeg, &clip_path, &clip_bytes)
                }),
            });
        }
        let outputs: Vec<Output> = [Output::Fmp4, Output::Jpeg]
            .into_iter()
            .filter(|o| f.live_outputs.iter().any(|n| n == o.name()))
            .collect();
        println!(
            "\n### Live sessions ({}, 25 fps, {:.0} s each: 2 s of speech in 20 ms chunks \
         paced in real time, then 2 s with nothing sent; a fresh server per level)\n",
            live_avatars
                .iter()
                .map(|l| l.label.as_str())
                .collect::<Vec<_>>()
                .join(" and "),
            f.live_seconds
        );
        println!(
            "A level holds when no session is refused or fails, every session receives its frames \
         within {:.0} % of those due (first to last frame at 25 fps), latency (chunk sent → the \
         message holding its frame) has p99 under {:.0} ms, and the p50 of the last utterance \
         (all sessions pooled) is not more than {:.0} % and {RISE_MS:.0} ms above the first's. \
         Held: speaking frames that showed the last face again, of which missed: its face \
         was asked for but came too late (the others the sessions' drawing rates left out). \
         Rate cuts: times a session lowered its drawing rate, all sessions together (in \
         brackets, after another session's face missed). \
         Lag: the largest lag the server gave a session when it opened (ready's lag_ms). CPU \
         per frame: the tree's CPU over the level ÷ frames received. The client runs on the \
         same machine.\n",
            FRAMES_TOLERANCE * 100.0,
            f.live_latency_bound_ms,
            RISE_SHARE * 100.0
        );
        println!(
            "| avatar | output | sessions | holds | frames received / due | held / speaking | \
         rate cuts (after others' misses) | \
         latency p50 ms | p99 ms | lag ms | p50 first → last utterance ms | CPU ms per frame | \
         server RSS MB per session | encoders' PSS MB |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        for avatar in &live_avatars {
            let mut by_output = serde_json::Map::new();
            for &output in &outputs {
                let mut best = None;
                for &n in &f.live_sessions {
                    let level = live_level(
                        &http,
                        &launch,
                        avatar,
                        &pcm,
                        output,
                        n as usize,
                        f.live_seconds,
                        f.live_latency_bound_ms,
                        f.live_min_draw_fps,
                    )?;
                    println!("{}", level.row);
                    levels.push(level.json);
                    if !level.holds {
                        break;
                    }
                    best = Some(n);
                }
                by_output.insert(output.name().into(), serde_json::json!(best));
            }
            largest.insert(avatar.label.clone(), by_output.into());
        }
        println!(
            "\nLargest number of sessions that holds: {} (of --live-sessions {}).",
            largest
                .iter()
                .map(|(label, l)| {
                    let by = l.as_object().into_iter().flatten();
                    let each: Vec<String> = by.map(|(o, n)| format!("{o} {n}")).collect();
                    format!("{label}: {}", each.join(", "))
                })
                .collect::<Vec<_>>()
                .join("; "),
            f.live_sessions
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        // What x264 alone allows: the floor's CPU per frame with a live session's x264 options
        // (the file rows' responses encoded again) at 25 fps per session, on every core.
        let measured = |i: usize| rows.iter().find(|r| r["avatar"] == avatars[i].0.as_str());
        for (avatar, row) in [0, 2]
            .into_iter()
            .filter_map(|i| Some((&avatars[i].0, measured(i)?)))
        {
            let per_frame =
                row["live_floor_cpu_s"].as_f64().unwrap_or(f64::NAN) / frames.max(1) as f64;
            let sessions = cores as f64 / (per_frame * FPS);
            println!(
                "{avatar}: x264 alone takes {:.2} ms of CPU per frame with the live options \
             ({live_x264}, one thread; the file rows' responses encoded again), so {cores} \
             core(s) encode at most {sessions:.1} sessions at 25 fps.",
                per_frame * 1e3,
            );
            floor_bound.insert(
                avatar.clone(),
                serde_json::json!({"floor_ms_per_frame": per_frame * 1e3, "sessions": sessions}),
            );
        }
    }
    Ok(serde_json::json!({
        "device": device_name, "host_cpus": cores, "speech_seconds": f.media_seconds,
        "frames": frames, "repeats": f.media_repeats,
        "serve": {"instances": r.instances, "max_batch": r.max_batch,
                  "encoder_workers": r.encoder_workers, "preset": encoder.preset,
                  "crf": encoder.crf, "live_preset": live.preset,
                  "live_max_bitrate": live.max_bitrate},
        "rows": rows, "cores": pinned, "problems": problems,
        "live": {"seconds": f.live_seconds, "latency_bound_ms": f.live_latency_bound_ms,
                 "levels": levels, "largest_holding": largest,
                 "x264_floor_sessions": floor_bound},
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_its_own_tree_root() {
        let me = std::process::id();
        let t = tree(me);
        assert_eq!(t[0].pid, me);
        assert!(live_cpu::tree_cpu_seconds_of(me) >= 0.0);
        assert!(proc_kb(&format!("/proc/{me}/status"), "VmRSS:").unwrap() > 0);
    }

    #[test]
    fn the_floor_takes_yuv420p_with_the_services_options() {
        let mut s = EncoderSettings::new(1280, 720, Fps::DEFAULT);
        s.threads = Some(1);
        s.audio = Some("speech.wav".into());
        let args = s.yuv420p_args().join(" ");
        assert!(
            args.contains("-pix_fmt yuv420p -video_size 1280x720"),
            "{args}"
        );
        assert!(!args.contains("rgb24"), "{args}");
        assert!(
            args.contains("-c:v libx264 -preset veryfast -tune zerolatency"),
            "{args}"
        );
        assert!(args.contains("-threads 1"), "{args}");
        assert!(args.contains("-c:a aac"), "{args}");
        assert!(args.contains("frag_keyframe+empty_moov"), "{args}");
    }

    #[test]
    fn a_live_min_draw_fps_is_a_finite_rate_of_zero_or_more() {
        assert_eq!(non_negative_fps("0"), Ok(0.0));
        assert_eq!(non_negative_fps("2.5"), Ok(2.5));
        for bad in ["-1", "nan", "inf", "five", ""] {
            assert!(non_negative_fps(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn multipart_bodies_hold_text_and_file_fields() {
        let (ct, body) = multipart(&[
            ("avatar_id", None, b"abc"),
            ("audio", Some("a.wav"), b"RIFF"),
        ]);
        let boundary = ct.split("boundary=").nth(1).unwrap();
        let text = String::from_utf8(body).unwrap();
        assert!(text.starts_with(&format!("--{boundary}\r\n")));
        assert!(text.contains("name=\"avatar_id\"\r\n\r\nabc\r\n"));
        assert!(text.contains("name=\"audio\"; filename=\"a.wav\""));
        assert!(text.ends_with(&format!("--{boundary}--\r\n")));
    }

    #[test]
    fn latencies_map_chunks_to_their_frames() {
        let t = Instant::now();
        let at = |ms: u64| t + Duration::from_millis(ms);
        let mut s = SessionOut {
            speaking: vec![10, 200],
            sent: vec![(0, 0, at(0)), (0, 640, at(40)), (1, 0, at(4000))],
            ..SessionOut::default()
        };
        // JPEG: frame 10 at 300 ms, 11 at 350 ms, 200 at 4300 ms.
        s.frames = vec![(10, at(300)), (11, at(350)), (200, at(4300))];
        let l: Vec<(usize, f64)> = s
            .latencies(Output::Jpeg)
            .iter()
            .map(|x| (x.0, (x.1 * 1e3).round()))
            .collect();
        assert_eq!(l, [(0, 300.0), (0, 310.0), (1, 300.0)]);
        // fMP4: counts so far; frame 10 is in the message that brings the count past 10.
        s.frames = vec![(0, at(5)), (10, at(200)), (12, at(320)), (201, at(4250))];
        let l: Vec<f64> = s
            .latencies(Output::Fmp4)
            .iter()
            .map(|x| (x.1 * 1e3).round())
            .collect();
        assert_eq!(l, [320.0, 280.0, 250.0]);
        assert_eq!(s.received(Output::Fmp4), 201);
    }
}
