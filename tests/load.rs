//! Load and fault suite: the RELEASE server (`target/release/lipsync serve`, built by
//! scripts/test.sh before the tests) on 127.0.0.1 with random weights (`lipsync
//! init-weights`), driven by ApacheBench (`ab`, Debian's apache2-utils; scripts/test.sh
//! installs it) for the concurrent and sequential load and by raw sockets for the faults.
//! Requests are short (≤ 1 s of speech on a small photo, with an explicit `box` so no face
//! detection runs); every wait has a deadline. The checks run one at a time (two cores).
//! Those of the HTTP and media side alone run the server on the echo device instead (the model
//! stand-in that costs nothing); those that need the model's cost (a queue, a batch's time,
//! a stream still being computed) run the random weights.
//!
//! - 200 concurrent requests: only 200 or 429, no 5xx, no reset, and /health still answers;
//! - 200 sequential requests: resident memory grows < 5 % from request 40 to request 200;
//! - four clients that never read, with `--max-requests 4 --send-timeout 2`: their streams
//!   are aborted (`client_timeout`) and a normal request then succeeds;
//! - a client that hangs up mid-stream: `lipsync_queue_frames` is 0 within about one batch;
//! - SIGTERM mid-stream: the stream completes (every frame decodes) and the exit status is 0.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use common::media;

/// One server at a time: the checks measure a CPU-bound service on shared cores.
static SERIAL: Mutex<()> = Mutex::new(());

const BOUNDARY: &str = "lipsyncLoadTestBoundary7MA4YWxkTrZu0gW";
/// The small photo's face box (x1,y1,x2,y2), given explicitly so detection is skipped.
const SMALL_BOX: &str = "56,40,152,168";

fn target_dir() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => root.join(d),
        None => root.join("target"),
    }
}

/// The release binary under test: target/release/lipsync, which under scripts/test.sh is the
/// tests' build (release, with the fault hooks, which the load suite does not use).
fn release_binary() -> PathBuf {
    let bin = target_dir().join("release/lipsync");
    assert!(
        bin.is_file(),
        "{} is missing: the load suite tests the release server; build it with \
         `cargo build --release --locked` (scripts/test.sh does this before the tests)",
        bin.display()
    );
    static WARNED: OnceLock<()> = OnceLock::new();
    WARNED.get_or_init(|| {
        let built = std::fs::metadata(&bin).and_then(|m| m.modified()).ok();
        if newest(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")) > built {
            eprintln!(
                "warning: {} is older than src/: the load suite tests that binary;                  `cargo build --release --locked` first (scripts/test.sh does)",
                bin.display()
            );
        }
    });
    bin
}

/// The newest modification time of the files under `dir`.
fn newest(dir: &Path) -> Option<std::time::SystemTime> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            if m.is_dir() {
                newest(&e.path())
            } else {
                m.modified().ok()
            }
        })
        .max()
}

/// Random weights from `lipsync init-weights`, written again whenever the binary is newer.
fn weights() -> &'static Path {
    static W: OnceLock<PathBuf> = OnceLock::new();
    W.get_or_init(|| {
        let dir = target_dir().join("load-test");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("random-seed0.safetensors");
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        if modified(&path) < modified(&release_binary()) {
            let tmp = dir.join(format!("random-{}.tmp.safetensors", std::process::id()));
            let out = Command::new(release_binary())
                .arg("init-weights")
                .arg(&tmp)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "lipsync init-weights failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::fs::rename(&tmp, &path).unwrap();
        }
        path
    })
}

struct Server {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
    /// Batch jobs' files and store: a temporary directory, never the user's.
    _data_dir: tempfile::TempDir,
    _serial: MutexGuard<'static, ()>,
}

impl Server {
    /// `lipsync serve` (release) on 127.0.0.1 and a free port with the random weights, small
    /// batches; returns once it listens.
    fn start(extra: &[&str]) -> Server {
        Self::spawn(&["--checkpoint", &weights().display().to_string()], extra)
    }

    /// As [`Server::start`], on the echo device (the model stand-in that costs nothing) with
    /// the CPU server's engine settings (one instance, one encoder process per stream...:
    /// `CPU_DEFAULTS` in tests/common/server.rs), for the checks of the HTTP and media side.
    fn start_echo(extra: &[&str]) -> Server {
        let mut model = vec!["--device", "echo"];
        model.extend(
            common::server::CPU_DEFAULTS
                .chunks(2)
                .filter(|pair| !extra.contains(&pair[0]))
                .flatten(),
        );
        Self::spawn(&model, extra)
    }

    /// `lipsync serve` (release) with the `model` flags and `extra`.
    fn spawn(model: &[&str], extra: &[&str]) -> Server {
        let serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let data_dir = tempfile::Builder::new()
            .prefix("lipsync-data-")
            .tempdir()
            .unwrap();
        let mut child = Command::new(release_binary())
            .arg("serve")
            .args(model)
            .arg("--data-dir")
            .arg(data_dir.path())
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--shutdown-timeout",
                "60",
            ])
            .args(
                [("--max-batch", "8"), ("--first-batch", "2")]
                    .iter()
                    .filter(|(flag, _)| !extra.contains(flag))
                    .flat_map(|(flag, value)| [*flag, *value]),
            )
            .args(extra)
            .env("LIPSYNC_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut seen = Vec::new();
        let addr = loop {
            let Some(Ok(line)) = lines.next() else {
                let _ = child.kill();
                panic!(
                    "the release server exited before listening (flags {extra:?}):\n{}",
                    seen.join("\n")
                );
            };
            seen.push(line.clone());
            if let Some(rest) = line.split("listening on ").nth(1) {
                let url = rest.split_whitespace().next().unwrap();
                break url.trim_start_matches("http://").parse().unwrap();
            }
        };
        let log = Arc::new(Mutex::new(seen));
        let sink = log.clone();
        // Keep draining the log (the server must never block on it); keep it for failures.
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Server {
            child,
            addr,
            log,
            _data_dir: data_dir,
            _serial: serial,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn log_tail(&self) -> String {
        let log = self.log.lock().unwrap();
        log[log.len().saturating_sub(30)..].join("\n")
    }

    async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if let Ok(r) = reqwest::get(self.url("/ready")).await {
                if r.status() == 200 {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("server never became ready:\n{}", self.log_tail());
    }

    async fn metrics(&self) -> String {
        let get = reqwest::Client::new()
            .get(self.url("/metrics"))
            .timeout(Duration::from_secs(10))
            .send();
        get.await.unwrap().text().await.unwrap()
    }

    /// The value of the series `name` (labels exactly as exported).
    async fn metric(&self, name: &str) -> f64 {
        let m = self.metrics().await;
        series(&m, name).unwrap_or_else(|| panic!("no metric {name} in /metrics:\n{m}"))
    }

    /// Resident memory of the server process (VmRSS), in bytes.
    fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("VmRSS in /proc/PID/status");
        kb * 1024
    }

    async fn health(&self) -> u16 {
        let get = reqwest::Client::new()
            .get(self.url("/health"))
            .timeout(Duration::from_secs(10))
            .send();
        get.await.map(|r| r.status().as_u16()).unwrap_or(0)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn series(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(s, _)| *s == name)
        .map(|(_, v)| v.parse().unwrap())
}

/// A photo of `side`×`side` pixels: the astronaut scaled (smooth), or fixed-seed noise (which
/// no encoder compresses: a lossless keyframe is about 3 bytes a pixel).
fn png(side: u32, noise: bool) -> Vec<u8> {
    let img = if noise {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        image::RgbImage::from_fn(side, side, |_, _| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            image::Rgb([x as u8, (x >> 8) as u8, (x >> 16) as u8])
        })
    } else {
        image::load_from_memory(&media("astronaut.png"))
            .unwrap()
            .resize_exact(side, side, image::imageops::FilterType::Triangle)
            .to_rgb8()
    };
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// The first `seconds` of the 1 s test clip, as 16 kHz mono WAV.
fn speech(seconds: f64) -> Vec<u8> {
    let clip = lipsync::media::audio::load(&media("arctic_a0007_1s.wav"), 60.0)
        .unwrap()
        .samples;
    let n = ((seconds * 16_000.0) as usize).min(clip.len());
    common::wav(&clip[..n], 16_000, 1)
}

/// A multipart/form-data body for `POST /v1/lipsync`.
fn lipsync_body(audio: &[u8], image: &[u8], texts: &[(&str, &str)]) -> Vec<u8> {
    let mut b = Vec::new();
    for (name, data) in [("audio", audio), ("image", image)] {
        b.extend(
            format!(
                "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"; \
                 filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
            )
            .bytes(),
        );
        b.extend_from_slice(data);
        b.extend(b"\r\n");
    }
    for (name, value) in texts {
        b.extend(
            format!(
                "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
            )
            .bytes(),
        );
    }
    b.extend(format!("--{BOUNDARY}--\r\n").bytes());
    b
}

/// The short request every load check sends: `seconds` of speech on a 192×192 photo.
fn short_body(seconds: f64) -> Vec<u8> {
    lipsync_body(&speech(seconds), &png(192, false), &[("box", SMALL_BOX)])
}

/// What one `ab` run saw.
#[derive(Debug)]
struct AbRun {
    /// HTTP status of every response, in order of arrival.
    codes: Vec<u16>,
    complete: u64,
    /// Connect, receive and exception failures (`-l`: lengths may differ).
    failures: u64,
    output: String,
}

/// `ab -n requests -c concurrency` POSTing `body` to `/v1/lipsync`, killed after `limit`.
fn ab(s: &Server, body: &[u8], requests: usize, concurrency: usize, limit: Duration) -> AbRun {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), body).unwrap();
    let child = Command::new("ab")
        .args(["-r", "-l", "-v", "3", "-s", "120"])
        .args(["-n", &requests.to_string(), "-c", &concurrency.to_string()])
        .arg("-p")
        .arg(file.path())
        .args(["-T", &format!("multipart/form-data; boundary={BOUNDARY}")])
        .arg(s.url("/v1/lipsync"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => panic!(
            "cannot run ab ({e}): the load suite needs ApacheBench (Debian package \
             apache2-utils; scripts/test.sh installs it)"
        ),
    };
    // Read both pipes on threads so ab never blocks on them, and enforce the time limit.
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "ab did not finish {requests} requests (concurrency {concurrency}) within {limit:?}:\n{}",
                s.log_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let output = format!("{}{}", out.join().unwrap(), err.join().unwrap());
    assert!(status.success(), "ab failed ({status}):\n{}", tail(&output));
    // With -v 3, ab logs every response's status: 2xx as "LOG: Response code = 200", others
    // as "WARNING: Response code not 2xx (429)".
    let codes = output
        .lines()
        .filter_map(|l| {
            l.strip_prefix("LOG: Response code = ")
                .or_else(|| l.strip_prefix("WARNING: Response code not 2xx ("))
        })
        .map(|c| c.trim().trim_end_matches(')').parse().unwrap())
        .collect();
    let field = |name: &str| -> u64 {
        output
            .lines()
            .find_map(|l| l.trim().strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.trim_matches(|c: char| !c.is_ascii_digit()).parse().ok())
            .unwrap_or_else(|| panic!("no '{name}' in ab's output:\n{}", tail(&output)))
    };
    let failures = ["(Connect:", "Receive:", "Exceptions:"]
        .iter()
        .map(|f| {
            output
                .split(f)
                .nth(1)
                .and_then(|v| v.split([',', ')']).next())
                .map(|v| v.trim().parse::<u64>().unwrap())
                .unwrap_or(0)
        })
        .sum();
    AbRun {
        codes,
        complete: field("Complete requests:"),
        failures,
        output,
    }
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Frames ffprobe decodes from an MP4.
fn decoded_frames(bytes: &[u8]) -> u64 {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), bytes).unwrap();
    let out = Command::new("ffprobe")
        .args(["-v", "error", "-count_frames", "-select_streams", "v"])
        .args(["-show_entries", "stream=nb_read_frames", "-of", "csv=p=0"])
        .arg(f.path())
        .output()
        .expect("ffprobe is needed (scripts/test.sh installs it)");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}

/// Video frames the server makes for `audio` (from `lipsync audio --json`).
fn video_frames(audio: &[u8]) -> u64 {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), audio).unwrap();
    let out = Command::new(release_binary())
        .arg("audio")
        .arg(f.path())
        .arg("--json")
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("lipsync audio --json: {e}: {out:?}"));
    // As the server plans it: the speech's length at its frame rate, never fewer frames than
    // the model draws.
    let (seconds, fps, model) = (
        v["seconds"].as_f64().unwrap(),
        v["fps"].as_f64().unwrap(),
        v["frames"].as_u64().unwrap(),
    );
    ((seconds * fps - 1e-9).ceil() as u64).max(model)
}

/// A raw client that sends `body` to `/v1/lipsync` with a tiny receive buffer.
fn raw_post(addr: SocketAddr, body: &[u8]) -> TcpStream {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    sock.connect_timeout(&addr.into(), Duration::from_secs(10))
        .unwrap();
    let mut tcp: TcpStream = sock.into();
    tcp.set_write_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "POST /v1/lipsync HTTP/1.1\r\nHost: {addr}\r\nContent-Type: multipart/form-data; \
         boundary={BOUNDARY}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).unwrap();
    tcp.write_all(body).unwrap();
    tcp
}

/// A normal client: POSTs `body`, reads the whole response; (status, body).
async fn post(s: &Server, body: Vec<u8>) -> (u16, Vec<u8>) {
    let r = reqwest::Client::new()
        .post(s.url("/v1/lipsync"))
        .header(
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .body(body)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.bytes().await.unwrap().to_vec())
}

#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_concurrent_requests_get_only_200_or_429() {
    // On echo: the refusals come from the request slots (--max-requests), whatever the
    // model's cost (8 × 200 and 192 × 429 on echo as on the model).
    let s = Server::start_echo(&["--max-requests", "8"]);
    s.wait_ready().await;
    let t = Instant::now();
    let run = ab(&s, &short_body(1.0), 200, 200, Duration::from_secs(240));
    let (ok, busy) = (
        run.codes.iter().filter(|&&c| c == 200).count(),
        run.codes.iter().filter(|&&c| c == 429).count(),
    );
    eprintln!(
        "200 concurrent: {ok} × 200, {busy} × 429 in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let other: Vec<u16> = run
        .codes
        .iter()
        .copied()
        .filter(|c| *c != 200 && *c != 429)
        .collect();
    assert!(other.is_empty(), "statuses other than 200/429: {other:?}");
    assert_eq!(run.complete, 200, "{}", tail(&run.output));
    assert_eq!(
        run.failures,
        0,
        "connections failed (reset or refused) instead of answering:\n{}",
        tail(&run.output)
    );
    assert_eq!(run.codes.len(), 200, "{}", tail(&run.output));
    assert!(ok >= 1, "no request succeeded");
    let m = s.metrics().await;
    assert_eq!(
        series(&m, "lipsync_requests_total{outcome=\"failed\"}"),
        Some(0.0),
        "{m}"
    );
    assert_eq!(
        series(&m, "lipsync_requests_total{outcome=\"success\"}"),
        Some(ok as f64)
    );
    assert_eq!(s.health().await, 200, "/health after the load");
}

#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_sequential_requests_do_not_grow_memory() {
    // On the model, whose process (about 500 MB) the bound was set for: on echo the process
    // is about 22 MB and grew 0.8-1.0 MB from request 40 to 200 (3.9-4.4 %, at the bound;
    // 0.1-0.6 MB on the model).
    let s = Server::start(&[]);
    s.wait_ready().await;
    // 0.3 s of speech (3 model frames, 8 video frames): the shortest request worth making.
    let body = short_body(0.3);
    let t = Instant::now();
    let first = ab(&s, &body, 40, 1, Duration::from_secs(120));
    assert_eq!(first.codes, vec![200; 40], "{}", tail(&first.output));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after_40 = s.rss();
    let rest = ab(&s, &body, 160, 1, Duration::from_secs(360));
    assert_eq!(rest.codes, vec![200; 160], "{}", tail(&rest.output));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after_200 = s.rss();
    let growth = after_200 as f64 / after_40 as f64 - 1.0;
    eprintln!(
        "200 sequential in {:.1} s: VmRSS {:.1} MB after 40, {:.1} MB after 200 ({:+.2} %)",
        t.elapsed().as_secs_f64(),
        after_40 as f64 / 1e6,
        after_200 as f64 / 1e6,
        growth * 100.0
    );
    assert!(
        growth < 0.05,
        "resident memory grew {:.1} % from request 40 ({after_40} B) to 200 ({after_200} B)",
        growth * 100.0
    );
    assert_eq!(
        s.metric("lipsync_requests_total{outcome=\"success\"}")
            .await,
        200.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn clients_that_stop_reading_are_timed_out_and_free_their_slots() {
    // On echo: the timeouts are the HTTP side's, the frames' cost is the encoder's.
    let s = Server::start_echo(&["--max-requests", "4", "--send-timeout", "2"]);
    s.wait_ready().await;
    // A long-ish clip (4 s) on a large photo of noise, lossless: each one-second fragment
    // starts with a keyframe of about 11 MB, more than the socket and pipe buffers between
    // the encoder and a client that reads nothing hold.
    let body = lipsync_body(
        &media("arctic_a0007.wav"),
        &png(1920, true),
        &[("box", "768,768,1152,1152"), ("crf", "0")],
    );
    let t = Instant::now();
    let stalled: Vec<TcpStream> = (0..4).map(|_| raw_post(s.addr, &body)).collect();
    // They never read a byte. Within the send timeout of their stalling, the server gives
    // up on them.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let timed_out = s
            .metric("lipsync_requests_total{outcome=\"client_timeout\"}")
            .await;
        if timed_out >= 4.0 {
            assert_eq!(timed_out, 4.0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after {:.0} s only {timed_out} of the 4 non-reading clients were timed out \
             (--send-timeout 2); frames computed: {}\n{}",
            t.elapsed().as_secs_f64(),
            s.metric("lipsync_frames_total").await,
            s.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!(
        "4 non-reading clients timed out after {:.1} s",
        t.elapsed().as_secs_f64()
    );
    // Their slots are free although their connections are still open: a normal request is
    // served in full.
    let (status, video) = post(&s, short_body(1.0)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&video));
    assert_eq!(decoded_frames(&video), video_frames(&speech(1.0)));
    drop(stalled);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_hangs_up_mid_stream_leaves_an_empty_queue_within_a_batch() {
    // On the model: frames must wait behind its batches, whose time is the bound.
    let s = Server::start(&[]);
    s.wait_ready().await;
    // 4 s of speech (97 model frames) on the small photo.
    let body = lipsync_body(
        &media("arctic_a0007.wav"),
        &png(192, false),
        &[("box", SMALL_BOX)],
    );
    let mut tcp = raw_post(s.addr, &body);
    let mut got = vec![0u8; 4096];
    let n = tcp.read(&mut got).unwrap();
    assert!(
        got[..n].starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got[..n])
    );
    // Wait until the model is working on it (frames computed, more queued), then hang up.
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.metric("lipsync_frames_total").await < 8.0 {
        assert!(Instant::now() < deadline, "no frames computed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let queued = s.metric("lipsync_queue_frames").await;
    assert!(queued > 0.0, "nothing queued any more: hung up too late");
    drop(tcp);
    let hung_up = Instant::now();
    let deadline = hung_up + Duration::from_secs(30);
    while s.metric("lipsync_queue_frames").await > 0.0 {
        assert!(Instant::now() < deadline, "the queue never emptied");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let emptied = hung_up.elapsed().as_secs_f64();
    let m = s.metrics().await;
    let batches = series(
        &m,
        "lipsync_stage_duration_seconds_count{stage=\"inference\"}",
    )
    .unwrap();
    let batch_s = series(
        &m,
        "lipsync_stage_duration_seconds_sum{stage=\"inference\"}",
    )
    .unwrap()
        / batches.max(1.0);
    eprintln!(
        "hang-up with {queued} frames queued: queue empty after {emptied:.2} s (a batch takes \
         {batch_s:.2} s)"
    );
    // One batch may be running when the client goes; allow it plus a little detection slack.
    assert!(
        emptied <= 1.5 * batch_s + 0.3,
        "the queue took {emptied:.2} s to empty after the hang-up; a batch takes {batch_s:.2} s"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while series(
        &s.metrics().await,
        "lipsync_requests_total{outcome=\"cancelled\"}",
    ) != Some(1.0)
    {
        assert!(
            Instant::now() < deadline,
            "the request was never counted cancelled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(s.metric("lipsync_frames_total").await < 97.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_mid_stream_completes_the_stream_and_exits_0() {
    // On the model: the stream must still be being computed when SIGTERM comes (without
    // relying on the fault hook that would slow echo down).
    let mut s = Server::start(&[]);
    s.wait_ready().await;
    let audio = media("arctic_a0007.wav");
    let expected = video_frames(&audio);
    let body = lipsync_body(&audio, &png(192, false), &[("box", SMALL_BOX)]);
    let res = reqwest::Client::new()
        .post(s.url("/v1/lipsync"))
        .header(
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .body(body)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let mut res = res;
    let mut video = res.chunk().await.unwrap().expect("a first chunk").to_vec();
    // Mid-stream: frames computed, not all of them.
    let frames = s.metric("lipsync_frames_total").await;
    assert!(
        frames < 97.0,
        "the stream was already complete ({frames} frames)"
    );
    let kill = Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    while let Some(chunk) = res
        .chunk()
        .await
        .unwrap_or_else(|e| panic!("the stream was aborted after SIGTERM: {e}"))
    {
        video.extend_from_slice(&chunk);
    }
    assert_eq!(decoded_frames(&video), expected, "the stream was cut short");
    let deadline = Instant::now() + Duration::from_secs(60);
    let exit = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "no exit within 60 s of SIGTERM");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(exit.code(), Some(0), "{exit:?}\n{}", s.log_tail());
}
