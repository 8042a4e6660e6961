//! Video out: H.264 + AAC in fragmented MP4, emitted while frames are still being made.
//!
//! [`VideoEncoder`] is the interface; [`FfmpegEncoder`] drives an `ffmpeg` child process: raw
//! RGB frames on its stdin, libx264 tuned for low latency (no B-frames, no lookahead, a
//! keyframe at least every second), the speech file as the AAC audio track at its own rate and
//! channels, and fragmented MP4 (`frag_keyframe+empty_moov+default_base_moof`) read from its
//! stdout and passed to a sink as it arrives. A reader thread drains stdout (and another
//! stderr) so ffmpeg can never block; the child is killed and reaped if the encoder is dropped
//! unfinished.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::media::audio::Fps;
use crate::media::image::Frame;
use crate::media::Error;

/// x264 presets, fastest first.
pub const PRESETS: &[&str] = &[
    "ultrafast",
    "superfast",
    "veryfast",
    "faster",
    "fast",
    "medium",
    "slow",
    "slower",
    "veryslow",
];

/// Where encoded MP4 bytes go (a file, an HTTP body channel).
pub type Sink = Box<dyn Write + Send>;

/// Encodes frames, in order, into a video.
pub trait VideoEncoder: Send {
    /// Appends the next frame (RGB, the size the encoder was made for).
    fn write_frame(&mut self, frame: &Frame) -> Result<(), Error>;
    /// Flushes everything to the sink and waits for the encoder to finish.
    fn finish(self: Box<Self>) -> Result<EncodeSummary, Error>;
}

/// What an encoder produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeSummary {
    pub frames: u64,
    pub bytes: u64,
}

/// How to encode.
#[derive(Debug, Clone)]
pub struct EncoderSettings {
    pub width: u32,
    pub height: u32,
    pub fps: Fps,
    /// x264 preset (see [`PRESETS`]).
    pub preset: String,
    /// x264 constant rate factor, 0–51 (lower is better quality).
    pub crf: u8,
    /// Audio file muxed as the AAC track (ffmpeg decodes it: any format it reads).
    pub audio: Option<PathBuf>,
    /// The ffmpeg executable.
    pub ffmpeg: PathBuf,
    /// x264 threads (`None`: ffmpeg's choice).
    pub threads: Option<usize>,
}

impl EncoderSettings {
    pub fn new(width: u32, height: u32, fps: Fps) -> Self {
        EncoderSettings {
            width,
            height,
            fps,
            preset: "veryfast".into(),
            crf: 20,
            audio: None,
            ffmpeg: default_ffmpeg(),
            threads: None,
        }
    }

    fn validate(&self) -> Result<(), Error> {
        if !PRESETS.contains(&self.preset.as_str()) {
            return Err(Error::Encoder(format!(
                "unknown x264 preset {:?} (one of {})",
                self.preset,
                PRESETS.join(", ")
            )));
        }
        if self.crf > 51 {
            return Err(Error::Encoder(format!("crf {} is outside 0–51", self.crf)));
        }
        if self.width == 0 || self.height == 0 {
            return Err(Error::Encoder("empty frame size".into()));
        }
        Ok(())
    }

    /// Frames between keyframes: at most one second's worth.
    fn gop(&self) -> u32 {
        (self.fps.value().floor() as u32).max(1)
    }

    /// H.264 in 4:2:0 needs even dimensions: odd sizes are padded by one row/column.
    fn coded_size(&self) -> (u32, u32) {
        (self.width + self.width % 2, self.height + self.height % 2)
    }

    fn args(&self) -> Vec<String> {
        let (w, h) = self.coded_size();
        let (num, den) = self.fps.ratio();
        let gop = self.gop().to_string();
        let mut a: Vec<String> = [
            "-hide_banner",
            "-nostdin",
            "-loglevel",
            "error",
            "-f",
            "rawvideo",
            "-pix_fmt",
            "rgb24",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(["-video_size".into(), format!("{w}x{h}")]);
        a.extend(["-framerate".into(), format!("{num}/{den}")]);
        a.extend(["-i".into(), "pipe:0".into()]);
        if let Some(audio) = &self.audio {
            a.extend(["-i".into(), audio.display().to_string()]);
        }
        a.extend(["-map".into(), "0:v:0".into()]);
        if self.audio.is_some() {
            a.extend(["-map".into(), "1:a:0".into()]);
        }
        for (k, v) in [
            ("-c:v", "libx264"),
            ("-preset", self.preset.as_str()),
            ("-tune", "zerolatency"),
            ("-bf", "0"),
            ("-g", gop.as_str()),
            ("-keyint_min", gop.as_str()),
            ("-sc_threshold", "0"),
            ("-pix_fmt", "yuv420p"),
        ] {
            a.extend([k.to_string(), v.to_string()]);
        }
        a.extend(["-crf".into(), self.crf.to_string()]);
        if let Some(t) = self.threads {
            a.extend(["-threads".into(), t.to_string()]);
        }
        if self.audio.is_some() {
            // ffmpeg's AAC encoder starts with 1024 samples of priming, which a fragmented MP4
            // written up front (empty_moov) cannot mark with an edit list: they would play,
            // and the speech would lag the lips by 1024 samples. Trimming the same amount
            // from the input keeps speech and video in step, both streams starting at 0.
            a.extend(
                [
                    "-af",
                    "atrim=start_sample=1024",
                    "-c:a",
                    "aac",
                    "-b:a",
                    "128k",
                ]
                .iter()
                .map(|s| s.to_string()),
            );
        }
        // Keep frame timestamps exact (i/fps); by default ffmpeg would shift all but the first
        // frame to compensate for the audio priming instead.
        a.extend(["-avoid_negative_ts".into(), "disabled".into()]);
        a.extend(
            [
                "-movflags",
                "frag_keyframe+empty_moov+default_base_moof",
                "-frag_duration",
                "1000000",
                "-f",
                "mp4",
                "pipe:1",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        a
    }
}

/// `$LIPSYNC_FFMPEG`, else `ffmpeg` on the PATH.
pub fn default_ffmpeg() -> PathBuf {
    std::env::var_os("LIPSYNC_FFMPEG")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("ffmpeg"))
}

fn missing(ffmpeg: &std::path::Path, e: &std::io::Error) -> Error {
    Error::FfmpegMissing(format!(
        "cannot run {:?} ({e}); install ffmpeg (e.g. apt-get install ffmpeg) or point \
         LIPSYNC_FFMPEG at it",
        ffmpeg
    ))
}

/// Checks that `ffmpeg` runs and has the libx264 and aac encoders.
pub fn check_ffmpeg(ffmpeg: &std::path::Path) -> Result<(), Error> {
    let out = Command::new(ffmpeg)
        .args(["-hide_banner", "-encoders"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map_err(|e| missing(ffmpeg, &e))?;
    let list = String::from_utf8_lossy(&out.stdout);
    for enc in ["libx264", "aac"] {
        if !list.split_whitespace().any(|w| w == enc) {
            return Err(Error::FfmpegMissing(format!(
                "{:?} has no {enc} encoder",
                ffmpeg
            )));
        }
    }
    Ok(())
}

/// The ffmpeg-backed encoder.
pub struct FfmpegEncoder {
    settings: EncoderSettings,
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    stdout: Option<JoinHandle<u64>>,
    stderr: Option<JoinHandle<Vec<u8>>>,
    /// Set by the stdout thread when the sink refuses data (e.g. the client went away).
    sink_error: Arc<Mutex<Option<std::io::Error>>>,
    frames: u64,
    buf: Vec<u8>,
}

/// Keeps the last 16 KiB of ffmpeg's stderr for error messages.
const STDERR_TAIL: usize = 16 << 10;

impl FfmpegEncoder {
    /// Starts ffmpeg; encoded bytes are written to `sink` from a background thread.
    pub fn spawn(settings: EncoderSettings, mut sink: Sink) -> Result<Self, Error> {
        settings.validate()?;
        if let Some(audio) = &settings.audio {
            if !audio.is_file() {
                return Err(Error::Encoder(format!(
                    "audio file {} not found",
                    audio.display()
                )));
            }
        }
        let mut child = Command::new(&settings.ffmpeg)
            .args(settings.args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| missing(&settings.ffmpeg, &e))?;
        let stdin = child.stdin.take();
        let mut out = child.stdout.take().expect("piped stdout");
        let mut err = child.stderr.take().expect("piped stderr");
        let sink_error = Arc::new(Mutex::new(None));
        let flag = sink_error.clone();
        let stdout = std::thread::Builder::new()
            .name("ffmpeg-stdout".into())
            .spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                let mut total = 0u64;
                let mut failed = false;
                loop {
                    let n = match out.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    total += n as u64;
                    // After a sink error keep draining (and discarding) so ffmpeg never blocks.
                    if !failed {
                        if let Err(e) = sink.write_all(&buf[..n]).and_then(|_| sink.flush()) {
                            *flag.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                            failed = true;
                        }
                    }
                }
                total
            })
            .map_err(|e| Error::Internal(format!("cannot start a thread: {e}")))?;
        let stderr = std::thread::Builder::new()
            .name("ffmpeg-stderr".into())
            .spawn(move || {
                let mut tail = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n) = err.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    tail.extend_from_slice(&buf[..n]);
                    if tail.len() > 2 * STDERR_TAIL {
                        tail.drain(..tail.len() - STDERR_TAIL);
                    }
                }
                tail
            })
            .map_err(|e| Error::Internal(format!("cannot start a thread: {e}")))?;
        let (w, h) = settings.coded_size();
        Ok(FfmpegEncoder {
            buf: Vec::with_capacity(w as usize * h as usize * 3),
            settings,
            child: Some(child),
            stdin,
            stdout: Some(stdout),
            stderr: Some(stderr),
            sink_error,
            frames: 0,
        })
    }

    fn sink_failed(&self) -> Option<Error> {
        self.sink_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|e| Error::Encoder(format!("the output went away: {e}")))
    }

    /// Waits for ffmpeg; its stderr explains a failure.
    fn reap(&mut self) -> Result<u64, Error> {
        drop(self.stdin.take());
        let status = self.child.take().map(|mut c| c.wait());
        let bytes = self.stdout.take().map_or(0, |t| t.join().unwrap_or(0));
        let stderr = self
            .stderr
            .take()
            .map(|t| t.join().unwrap_or_default())
            .unwrap_or_default();
        match status {
            Some(Ok(s)) if s.success() => Ok(bytes),
            Some(Ok(s)) => Err(Error::Encoder(format!(
                "ffmpeg exited with {s}: {}",
                String::from_utf8_lossy(&stderr).trim()
            ))),
            Some(Err(e)) => Err(Error::Encoder(format!("waiting for ffmpeg: {e}"))),
            None => Ok(bytes),
        }
    }
}

impl VideoEncoder for FfmpegEncoder {
    fn write_frame(&mut self, frame: &Frame) -> Result<(), Error> {
        let s = &self.settings;
        if (frame.width, frame.height) != (s.width, s.height) {
            return Err(Error::Encoder(format!(
                "frame is {}x{}, the encoder expects {}x{}",
                frame.width, frame.height, s.width, s.height
            )));
        }
        if let Some(e) = self.sink_failed() {
            return Err(e);
        }
        let data: &[u8] = if s.coded_size() == (s.width, s.height) {
            &frame.rgb
        } else {
            // Odd size: repeat the last column and/or row.
            let (w, h) = (s.width as usize, s.height as usize);
            let (cw, ch) = s.coded_size();
            self.buf.clear();
            for y in 0..ch as usize {
                let row = &frame.rgb[y.min(h - 1) * w * 3..(y.min(h - 1) + 1) * w * 3];
                self.buf.extend_from_slice(row);
                if cw as usize > w {
                    self.buf.extend_from_slice(&row[(w - 1) * 3..]);
                }
            }
            &self.buf
        };
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| Error::Encoder("encoder closed".into()))?;
        if let Err(e) = stdin.write_all(data) {
            // ffmpeg stopped reading: it failed; its stderr says why.
            return Err(match self.reap() {
                Err(err) => err,
                Ok(_) => Error::Encoder(format!("ffmpeg stopped reading frames: {e}")),
            });
        }
        self.frames += 1;
        Ok(())
    }

    fn finish(mut self: Box<Self>) -> Result<EncodeSummary, Error> {
        let bytes = self.reap()?;
        if let Some(e) = self.sink_failed() {
            return Err(e);
        }
        Ok(EncodeSummary {
            frames: self.frames,
            bytes,
        })
    }
}

impl Drop for FfmpegEncoder {
    /// An unfinished encoder (an error, a client that left) kills ffmpeg and reaps it.
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
        }
        let _ = self.reap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gop_is_at_most_one_second() {
        for (fps, gop) in [
            ("25", 25),
            ("29.97", 29),
            ("30000/1001", 29),
            ("0.5", 1),
            ("60", 60),
        ] {
            let s = EncoderSettings::new(64, 64, fps.parse().unwrap());
            assert_eq!(s.gop(), gop, "{fps}");
        }
    }

    #[test]
    fn odd_sizes_are_coded_even() {
        let s = EncoderSettings::new(101, 75, Fps::DEFAULT);
        assert_eq!(s.coded_size(), (102, 76));
        let args = s.args().join(" ");
        assert!(args.contains("-video_size 102x76"), "{args}");
        assert!(args.contains("-framerate 25/1"));
        assert!(args.contains("frag_keyframe+empty_moov+default_base_moof"));
    }

    #[test]
    fn bad_settings_are_refused() {
        let mut s = EncoderSettings::new(64, 64, Fps::DEFAULT);
        s.preset = "warp".into();
        assert!(s.validate().is_err());
        s.preset = "veryfast".into();
        s.crf = 52;
        assert!(s.validate().is_err());
    }

    #[test]
    fn a_missing_ffmpeg_is_a_clear_error() {
        let mut s = EncoderSettings::new(64, 64, Fps::DEFAULT);
        s.ffmpeg = "/nonexistent/ffmpeg".into();
        match FfmpegEncoder::spawn(s, Box::new(std::io::sink())) {
            Err(Error::FfmpegMissing(m)) => assert!(m.contains("install ffmpeg"), "{m}"),
            other => panic!("{:?}", other.map(|_| ())),
        }
        assert!(check_ffmpeg(std::path::Path::new("/nonexistent/ffmpeg")).is_err());
    }
}
