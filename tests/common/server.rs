//! `lipsync serve` as a process on a loopback port, for the tests that drive it over HTTP:
//! started with test weights and its own temporary data directory (batch jobs' files and
//! SQLite store), its log drained, killed when dropped.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use reqwest::multipart::{Form, Part};

use super::media;

/// Servers run one at a time: model timing on two shared cores is the point of some tests.
static SERIAL: Mutex<()> = Mutex::new(());

/// The "checkpoint" of a server on the echo device (`--device echo`, no checkpoint): the
/// model stand-in that costs nothing, for the tests of the media side (compositing,
/// encoding, streaming, live clocks) rather than the model.
pub const ECHO: &str = "echo";

/// The engine defaults `serve` takes on the CPU device where echo takes a GPU's (flag and
/// value pairs): one instance, f32, unpadded batches, a queue of 2000 frames, one encoder
/// process per stream.
pub const CPU_DEFAULTS: &[&str] = &[
    "--instances",
    "1",
    "--dtype",
    "f32",
    "--pad-batches",
    "false",
    "--max-queue-frames",
    "2000",
    "--encoder-workers",
    "1",
];

pub struct Server {
    pub child: Child,
    pub base: String,
    checkpoint: String,
    log: std::sync::Arc<Mutex<Vec<String>>>,
    /// The data directory (`--data-dir`): the test's own, or a temporary one of this
    /// server's, removed when it is dropped (after the process is gone).
    data_dir: PathBuf,
    _temp_data: Option<tempfile::TempDir>,
    _serial: Option<MutexGuard<'static, ()>>,
}

impl Server {
    /// Starts `lipsync serve --device echo` (see [`ECHO`]) on a free port.
    pub fn start_echo(extra: &[&str]) -> Server {
        Self::start_with(ECHO, extra, &[])
    }

    /// Starts `lipsync serve --device echo` with the CPU device's engine defaults rather than
    /// a GPU's (see [`CPU_DEFAULTS`]; a flag the test sets wins), and these environment
    /// variables (e.g. `LIPSYNC_TEST_FAULTS=batch_delay_ms:N` for a model as slow as the
    /// CPU's): for a test of the media side written against the CPU server's configuration.
    pub fn start_echo_as_cpu(extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut args: Vec<&str> = CPU_DEFAULTS
            .chunks(2)
            .filter(|pair| !extra.contains(&pair[0]))
            .flatten()
            .copied()
            .collect();
        args.extend_from_slice(extra);
        Self::start_with(ECHO, &args, env)
    }

    /// Starts `lipsync serve` on a free port with the test checkpoint; returns once it listens.
    pub fn start(extra: &[&str]) -> Server {
        Self::start_with_checkpoint(
            &super::checkpoint("zip_bare.pt").display().to_string(),
            extra,
        )
    }

    pub fn start_with_checkpoint(checkpoint: &str, extra: &[&str]) -> Server {
        Self::start_with(checkpoint, extra, &[])
    }

    /// With environment variables too (e.g. `LIPSYNC_TEST_FAULTS`).
    pub fn start_with(checkpoint: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        Self::spawn(checkpoint, extra, env, Some(serial))
    }

    /// A second server beside this one (replicas sharing something), with its checkpoint
    /// (or on echo like it): it runs under this one's turn, so it must be dropped first.
    pub fn start_beside(&self, extra: &[&str]) -> Server {
        Self::spawn(&self.checkpoint.clone(), extra, &[], None)
    }

    fn spawn(
        checkpoint: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        serial: Option<MutexGuard<'static, ()>>,
    ) -> Server {
        // Never the user's data directory (nor another server's): a temporary one, unless
        // the test names its own.
        let given = extra
            .iter()
            .position(|a| *a == "--data-dir")
            .and_then(|i| extra.get(i + 1))
            .map(PathBuf::from)
            .or_else(|| {
                extra
                    .iter()
                    .find_map(|a| a.strip_prefix("--data-dir="))
                    .map(PathBuf::from)
            })
            .or_else(|| {
                env.iter()
                    .find(|(k, _)| *k == "LIPSYNC_DATA_DIR")
                    .map(|(_, v)| PathBuf::from(v))
            });
        let temp_data = given.is_none().then(|| {
            tempfile::Builder::new()
                .prefix("lipsync-data-")
                .tempdir()
                .expect("creating the server's temporary data directory")
        });
        let data_dir = given.unwrap_or_else(|| temp_data.as_ref().unwrap().path().to_path_buf());
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_lipsync"));
        cmd.arg("serve");
        if let Some(t) = &temp_data {
            cmd.arg("--data-dir").arg(t.path());
        }
        if checkpoint == ECHO {
            cmd.args(["--device", "echo"]);
        } else {
            cmd.arg("--checkpoint").arg(checkpoint);
        }
        let mut child = cmd
            .args(["--port", "0"])
            // Small batches keep CPU warm-up short, and shutdown is unhurried, unless the test
            // sets its own (clap refuses a flag given twice).
            .args(
                [
                    ("--max-batch", "8"),
                    ("--first-batch", "2"),
                    ("--shutdown-timeout", "60"),
                ]
                .iter()
                .filter(|(flag, _)| !extra.contains(flag))
                .flat_map(|(flag, value)| [*flag, *value]),
            )
            .args(extra)
            .env("LIPSYNC_LOG", "info")
            .envs(env.iter().copied())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut seen = Vec::new();
        let base = loop {
            let Some(Ok(line)) = lines.next() else {
                panic!("server exited before listening:\n{}", seen.join("\n"));
            };
            seen.push(line.clone());
            if let Some(rest) = line.split("listening on ").nth(1) {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        };
        // Keep draining the log (and keeping it) so the server never blocks on it.
        let log = std::sync::Arc::new(Mutex::new(seen));
        let keep = log.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                keep.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        });
        Server {
            child,
            base,
            checkpoint: checkpoint.to_string(),
            log,
            data_dir,
            _temp_data: temp_data,
            _serial: serial,
        }
    }

    /// This server started again, with the same checkpoint and data directory (unless `extra`
    /// names one) and these flags, once its process is gone (killed now if it still runs):
    /// in this one's turn, so no other test's server runs in between (a restart's timing is
    /// its own).
    pub fn restart(mut self, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let serial = self._serial.take();
        let temp_data = self._temp_data.take();
        let data_dir = self.data_dir.display().to_string();
        let mut args = extra.to_vec();
        if !extra.iter().any(|a| a.starts_with("--data-dir")) {
            args.extend(["--data-dir", data_dir.as_str()]);
        }
        let mut next = Self::spawn(&self.checkpoint, &args, env, serial);
        next._temp_data = temp_data;
        next
    }

    /// With faults injected through the test build's fault hook (`point:n,...`).
    pub fn start_with_faults(faults: &str) -> Server {
        Self::start_with(
            &super::checkpoint("zip_bare.pt").display().to_string(),
            &[],
            &[("LIPSYNC_TEST_FAULTS", faults)],
        )
    }

    /// `POST /v1/lipsync` with one second of speech on the astronaut photo (25 video frames).
    pub async fn post_short(&self) -> reqwest::Response {
        reqwest::Client::new()
            .post(self.url("/v1/lipsync"))
            .multipart(lipsync_form("arctic_a0007_1s.wav", "astronaut.png"))
            .send()
            .await
            .unwrap()
    }

    /// `POST /v1/avatars` with the astronaut photo: the avatar's id.
    pub async fn upload_avatar(&self) -> String {
        let v = self.upload_avatar_file("image", "astronaut.png").await;
        v["id"].as_str().unwrap().to_string()
    }

    /// `POST /v1/avatars` with `tests/media/FILE` as the form's `field` (`image` or `video`):
    /// the created avatar (201 or 200 asserted).
    pub async fn upload_avatar_file(&self, field: &str, file: &str) -> serde_json::Value {
        let form = Form::new().part(
            field.to_string(),
            Part::bytes(super::media(file)).file_name(file.to_string()),
        );
        let r = reqwest::Client::new()
            .post(self.url("/v1/avatars"))
            .multipart(form)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.status());
        r.json().await.unwrap()
    }

    /// The server's data directory (`--data-dir`): batch jobs' files (`jobs/<id>/`) and,
    /// without `--jobs-db`, their SQLite store (`jobs.db`).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The server's log lines so far.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if let Ok(r) = reqwest::get(self.url("/ready")).await {
                if r.status() == 200 {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("server never became ready");
    }

    /// `GET /info`.
    pub async fn info(&self) -> serde_json::Value {
        reqwest::get(self.url("/info"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    pub async fn metrics(&self) -> String {
        reqwest::get(self.url("/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// The value of the series `name` (with its labels, exactly as exported).
    pub async fn metric(&self, name: &str) -> f64 {
        self.metrics()
            .await
            .lines()
            .filter_map(|l| l.rsplit_once(' '))
            .find(|(series, _)| *series == name)
            .map(|(_, v)| v.parse().unwrap())
            .unwrap_or_else(|| panic!("no metric {name}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn lipsync_form(audio: &str, image: &str) -> Form {
    Form::new()
        .part(
            "audio",
            Part::bytes(media(audio)).file_name(audio.to_string()),
        )
        .part(
            "image",
            Part::bytes(media(image)).file_name(image.to_string()),
        )
}

/// ffprobe's codec names of an MP4's streams, comma-separated in order (`h264,aac`).
pub fn codecs(bytes: &[u8]) -> String {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), bytes).unwrap();
    let out = Command::new("ffprobe")
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
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(",")
}

/// Frames ffprobe decodes from an MP4 (or a prefix of one).
pub fn decoded_frames(bytes: &[u8]) -> u64 {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), bytes).unwrap();
    let out = Command::new("ffprobe")
        .args([
            "-v",
            "error",
            "-count_frames",
            "-select_streams",
            "v",
            "-show_entries",
            "stream=nb_read_frames",
            "-of",
            "csv=p=0",
        ])
        .arg(f.path())
        .output()
        .expect("ffprobe is needed (scripts/test.sh installs it)");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}

/// A multipart/form-data body by hand, for raw-socket clients.
pub fn multipart_body(boundary: &str, files: &[(&str, &[u8])], texts: &[(&str, &str)]) -> Vec<u8> {
    let mut b = Vec::new();
    for (name, data) in files {
        b.extend(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\n\r\n").bytes());
        b.extend_from_slice(data);
        b.extend(b"\r\n");
    }
    for (name, value) in texts {
        b.extend(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n").bytes());
    }
    b.extend(format!("--{boundary}--\r\n").bytes());
    b
}
