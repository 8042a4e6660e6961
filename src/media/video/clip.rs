//! Clips in: what the bytes are (recognised from their first bytes, then `ffprobe` for the
//! video stream, its frame rate and duration) and their frames, decoded by `ffmpeg` as they
//! are (rotation metadata applied, no frame-rate conversion: `-fps_mode passthrough`) and
//! handed over one at a time, so no caller needs the whole clip decoded in memory.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::missing;
use crate::media::audio::Fps;
use crate::media::image::Frame;
use crate::media::Error;

/// The highest clip frame rate accepted.
pub const MAX_CLIP_FPS: f64 = 60.0;

/// Default longest clip accepted, in seconds.
pub const DEFAULT_MAX_CLIP_SECONDS: f64 = 60.0;

/// What a clip is, from `ffprobe`.
#[derive(Debug, Clone, PartialEq)]
pub struct ClipInfo {
    /// ffmpeg's name of the container format (e.g. `mov,mp4,m4a,3gp,3g2,mj2`).
    pub container: String,
    /// ffmpeg's name of the video codec (e.g. `h264`).
    pub codec: String,
    /// The frame rate: the stream's average rate, else its base rate.
    pub fps: Fps,
    /// Seconds, from the stream or the container (0 when neither says).
    pub duration: f64,
}

/// Limits on a clip.
#[derive(Debug, Clone)]
pub struct ClipLimits {
    pub max_seconds: f64,
    /// Largest frame, in pixels (as for photos).
    pub max_pixels: u64,
}

/// A clip's bytes in a temporary file (ffmpeg needs to seek in MP4 and MOV), with the tools.
pub struct ClipFile {
    file: tempfile::NamedTempFile,
    ffmpeg: PathBuf,
    ffprobe: PathBuf,
    pub info: ClipInfo,
    limits: ClipLimits,
}

/// The container a clip's first bytes announce, if any: a guess that only decides between
/// "not a video" and "a damaged video" when ffprobe cannot read the file.
pub fn sniff(bytes: &[u8]) -> Option<&'static str> {
    let at = |i: usize, m: &[u8]| bytes.len() >= i + m.len() && &bytes[i..i + m.len()] == m;
    if at(4, b"ftyp") {
        Some("mp4")
    } else if ["moov", "mdat", "wide", "free", "skip"]
        .iter()
        .any(|b| at(4, b.as_bytes()))
    {
        Some("mov")
    } else if at(0, &[0x1a, 0x45, 0xdf, 0xa3]) {
        Some("matroska")
    } else if at(0, b"RIFF") && at(8, b"AVI ") {
        Some("avi")
    } else if at(0, b"OggS") {
        Some("ogg")
    } else if at(0, b"FLV") {
        Some("flv")
    } else if at(0, b"GIF8") {
        Some("gif")
    } else if bytes.len() > 188 && bytes[0] == 0x47 && bytes[188] == 0x47 {
        Some("mpegts")
    } else {
        None
    }
}

/// What a still image's first bytes look like, for a clearer error.
fn still_image(bytes: &[u8]) -> Option<&'static str> {
    if bytes.starts_with(b"\x89PNG") {
        Some("PNG")
    } else if bytes.starts_with(&[0xff, 0xd8, 0xff]) {
        Some("JPEG")
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Some("WebP")
    } else {
        None
    }
}

/// `ffprobe` beside `ffmpeg` (same directory, same naming), else `ffprobe` on the PATH.
pub fn ffprobe_for(ffmpeg: &Path) -> PathBuf {
    match ffmpeg.file_name().map(|n| n.to_string_lossy()) {
        Some(n) if n.contains("ffmpeg") => {
            ffmpeg.with_file_name(n.replacen("ffmpeg", "ffprobe", 1))
        }
        _ => PathBuf::from("ffprobe"),
    }
}

/// The tail of a tool's error output, for messages.
fn tail(stderr: &[u8]) -> String {
    let s = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    let from = lines.len().saturating_sub(3);
    let t = lines[from..].join("; ");
    if t.is_empty() {
        "no error message".into()
    } else {
        t
    }
}

fn parse_rate(s: Option<&str>) -> Option<f64> {
    let s = s?;
    let (n, d) = s.split_once('/').unwrap_or((s, "1"));
    let (n, d): (f64, f64) = (n.trim().parse().ok()?, d.trim().parse().ok()?);
    (n > 0.0 && d > 0.0).then_some(n / d)
}

/// The clip's frame rate from ffprobe's `avg_frame_rate` (else `r_frame_rate`), exact when it
/// is a ratio of integers.
fn clip_fps(avg: Option<&str>, base: Option<&str>) -> Result<Fps, Error> {
    let text = [avg, base]
        .into_iter()
        .flatten()
        .find(|s| parse_rate(Some(s)).is_some())
        .ok_or_else(|| Error::DamagedVideo("the video stream has no frame rate".into()))?;
    let value = parse_rate(Some(text)).expect("checked");
    if value > MAX_CLIP_FPS {
        return Err(Error::FpsTooHigh(format!(
            "the clip runs at {value:.2} fps; the limit is {MAX_CLIP_FPS} fps"
        )));
    }
    let ratio = text
        .split_once('/')
        .and_then(|(n, d)| Some((n.parse::<u32>().ok()?, d.parse::<u32>().ok()?)));
    match ratio {
        Some((n, d)) => Fps::from_ratio(n, d),
        None => Fps::new(value),
    }
    .map_err(|e| Error::DamagedVideo(format!("bad frame rate {text:?}: {e}")))
}

impl ClipFile {
    /// Writes `bytes` to a temporary file and probes it. Errors: `not_video` (nothing ffmpeg
    /// reads as a video, or no video stream), `damaged_video` (a known container ffprobe
    /// cannot read), `fps_too_high`, `avatar_too_long` (duration over `limits.max_seconds`).
    pub fn open(bytes: &[u8], ffmpeg: &Path, limits: ClipLimits) -> Result<ClipFile, Error> {
        if bytes.is_empty() {
            return Err(Error::NotVideo("the file is empty (0 bytes)".into()));
        }
        if let Some(kind) = still_image(bytes) {
            return Err(Error::NotVideo(format!(
                "this is a {kind} image; send a photo as `image` (`--image`), a clip as `video`"
            )));
        }
        let mut file = tempfile::Builder::new()
            .prefix("lipsync-clip-")
            .tempfile()
            .map_err(|e| Error::Internal(format!("cannot write a temporary file: {e}")))?;
        file.write_all(bytes)
            .and_then(|_| file.flush())
            .map_err(|e| Error::Internal(format!("cannot write a temporary file: {e}")))?;
        let ffprobe = ffprobe_for(ffmpeg);
        let out = Command::new(&ffprobe)
            .args([
                "-v",
                "error",
                "-print_format",
                "json",
                "-show_format",
                "-show_streams",
            ])
            .arg(file.path())
            .stdin(Stdio::null())
            .output()
            .map_err(|e| missing(&ffprobe, &e))?;
        let sniffed = sniff(bytes);
        if !out.status.success() {
            let why = tail(&out.stderr);
            return Err(match sniffed {
                Some(c) => Error::DamagedVideo(format!("the {c} file cannot be read ({why})")),
                None => Error::NotVideo(format!(
                    "not a container ffmpeg reads ({why}); send MP4, MOV, WebM or MKV"
                )),
            });
        }
        let json: serde_json::Value = serde_json::from_slice(&out.stdout)
            .map_err(|e| Error::Internal(format!("ffprobe printed no JSON: {e}")))?;
        let container = json["format"]["format_name"]
            .as_str()
            .unwrap_or("")
            .to_string();
        if container.ends_with("_pipe") || container == "image2" {
            return Err(Error::NotVideo(format!(
                "this is a still image ({container}); send a photo as `image`"
            )));
        }
        let stream = json["streams"]
            .as_array()
            .and_then(|s| {
                s.iter()
                    .find(|s| s["codec_type"] == "video" && s["disposition"]["attached_pic"] != 1)
            })
            .ok_or_else(|| {
                Error::NotVideo(format!("the {container} file holds no video stream"))
            })?;
        // A decode bomb (a tiny file declaring huge frames) is refused before decoding.
        let (w, h) = (
            stream["width"].as_u64().unwrap_or(0),
            stream["height"].as_u64().unwrap_or(0),
        );
        if w * h > limits.max_pixels {
            return Err(Error::TooManyPixels {
                width: w.min(u64::from(u32::MAX)) as u32,
                height: h.min(u64::from(u32::MAX)) as u32,
                max_pixels: limits.max_pixels,
            });
        }
        let fps = clip_fps(
            stream["avg_frame_rate"].as_str(),
            stream["r_frame_rate"].as_str(),
        )?;
        let seconds = |v: &serde_json::Value| v.as_str().and_then(|s| s.parse::<f64>().ok());
        let duration = seconds(&stream["duration"])
            .or_else(|| seconds(&json["format"]["duration"]))
            .filter(|d| d.is_finite() && *d >= 0.0)
            .unwrap_or(0.0);
        if duration > limits.max_seconds {
            return Err(Error::AvatarTooLong {
                seconds: duration,
                max_seconds: limits.max_seconds,
            });
        }
        let info = ClipInfo {
            container,
            codec: stream["codec_name"].as_str().unwrap_or("").to_string(),
            fps,
            duration,
        };
        Ok(ClipFile {
            file,
            ffmpeg: ffmpeg.to_path_buf(),
            ffprobe,
            info,
            limits,
        })
    }

    /// The most frames a clip within the duration limit can have (with one frame of slack).
    fn max_frames(&self) -> usize {
        (self.limits.max_seconds * self.info.fps.value()).floor() as usize + 1
    }

    /// Decodes every frame, in order, into `each(index, frame)`; returns the frame count.
    /// An error from `each` stops decoding and is returned. Errors: `damaged_video` (a decode
    /// error, or no frame at all), `avatar_too_long`, `image_too_large`.
    pub fn decode(
        &self,
        each: &mut dyn FnMut(usize, Frame) -> Result<(), Error>,
    ) -> Result<usize, Error> {
        let mut child = Command::new(&self.ffmpeg)
            .args(["-hide_banner", "-nostdin", "-v", "error", "-xerror", "-i"])
            .arg(self.file.path())
            .args([
                "-map",
                "0:v:0",
                "-an",
                "-sn",
                "-dn",
                "-fps_mode",
                "passthrough",
                "-f",
                "image2pipe",
                "-c:v",
                "ppm",
                "pipe:1",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| missing(&self.ffmpeg, &e))?;
        let mut stderr = child.stderr.take().expect("piped stderr");
        let errors = std::thread::Builder::new()
            .name("ffmpeg-stderr".into())
            .spawn(move || {
                let mut all = Vec::new();
                let _ = stderr.read_to_end(&mut all);
                all
            })
            .map_err(|e| Error::Internal(format!("cannot start a thread: {e}")));
        let errors = match errors {
            Ok(t) => t,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        };
        let mut out = BufReader::with_capacity(1 << 20, child.stdout.take().expect("piped"));
        let max_frames = self.max_frames();
        let mut count = 0usize;
        let result = loop {
            let frame = match read_ppm(&mut out, self.limits.max_pixels) {
                Ok(Some(f)) => f,
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            };
            if count >= max_frames {
                break Err(Error::AvatarTooLong {
                    seconds: (count + 1) as f64 / self.info.fps.value(),
                    max_seconds: self.limits.max_seconds,
                });
            }
            if let Err(e) = each(count, frame) {
                break Err(e);
            }
            count += 1;
        };
        if result.is_err() {
            let _ = child.kill();
        }
        drop(out);
        let status = child.wait();
        let stderr = errors.join().unwrap_or_default();
        result?;
        match status {
            Ok(s) if s.success() => {}
            Ok(_) => {
                return Err(Error::DamagedVideo(format!(
                    "decoding failed after {count} frame(s) ({})",
                    tail(&stderr)
                )))
            }
            Err(e) => return Err(Error::Internal(format!("cannot wait for ffmpeg: {e}"))),
        }
        if count == 0 {
            return Err(Error::DamagedVideo(format!(
                "no frame could be decoded ({})",
                tail(&stderr)
            )));
        }
        Ok(count)
    }

    /// The ffprobe used (for messages).
    pub fn ffprobe(&self) -> &Path {
        &self.ffprobe
    }
}

/// Reads one binary PPM (`P6 w h 255`, then w·h·3 bytes) or `None` at the end.
fn read_ppm(r: &mut impl BufRead, max_pixels: u64) -> Result<Option<Frame>, Error> {
    let bad = |what: &str| Error::Internal(format!("ffmpeg wrote a bad frame: {what}"));
    if r.fill_buf().map_err(|e| bad(&e.to_string()))?.is_empty() {
        return Ok(None);
    }
    let mut fields = [0u64; 4];
    let mut magic = [0u8; 2];
    r.read_exact(&mut magic).map_err(|e| bad(&e.to_string()))?;
    if &magic != b"P6" {
        return Err(bad("not P6"));
    }
    for field in fields.iter_mut().skip(1) {
        let mut byte = [0u8; 1];
        // Whitespace, then digits, then one whitespace byte.
        loop {
            r.read_exact(&mut byte).map_err(|e| bad(&e.to_string()))?;
            if !byte[0].is_ascii_whitespace() {
                break;
            }
        }
        let mut v: u64 = 0;
        while byte[0].is_ascii_digit() {
            v = v * 10 + u64::from(byte[0] - b'0');
            if v > u64::from(u32::MAX) {
                return Err(bad("header value too large"));
            }
            r.read_exact(&mut byte).map_err(|e| bad(&e.to_string()))?;
        }
        if !byte[0].is_ascii_whitespace() {
            return Err(bad("header"));
        }
        *field = v;
    }
    let (w, h, maxval) = (fields[1], fields[2], fields[3]);
    if maxval != 255 || w == 0 || h == 0 {
        return Err(bad("not 8-bit RGB"));
    }
    if w * h > max_pixels {
        return Err(Error::TooManyPixels {
            width: w as u32,
            height: h as u32,
            max_pixels,
        });
    }
    let mut rgb = vec![0u8; (w * h * 3) as usize];
    r.read_exact(&mut rgb).map_err(|e| bad(&e.to_string()))?;
    Ok(Some(Frame::new(w as u32, h as u32, rgb)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containers_are_recognised_from_their_first_bytes() {
        assert_eq!(sniff(b"\0\0\0\x20ftypisom...."), Some("mp4"));
        assert_eq!(sniff(b"\0\0\0\x08wide\0\0"), Some("mov"));
        assert_eq!(sniff(&[0x1a, 0x45, 0xdf, 0xa3, 1, 2]), Some("matroska"));
        assert_eq!(sniff(b"RIFF\0\0\0\0AVI LIST"), Some("avi"));
        assert_eq!(sniff(b"hello world"), None);
        assert_eq!(sniff(b""), None);
        assert_eq!(still_image(b"\x89PNG\r\n"), Some("PNG"));
    }

    #[test]
    fn frame_rates_come_from_the_average_then_the_base_rate() {
        assert_eq!(
            clip_fps(Some("25/1"), Some("25/1")).unwrap().ratio(),
            (25, 1)
        );
        assert_eq!(
            clip_fps(Some("0/0"), Some("30000/1001")).unwrap().ratio(),
            (30000, 1001)
        );
        assert_eq!(
            clip_fps(Some("120/1"), None).unwrap_err().kind(),
            "fps_too_high"
        );
        assert_eq!(
            clip_fps(Some("0/0"), Some("0/0")).unwrap_err().kind(),
            "damaged_video"
        );
    }

    #[test]
    fn ppm_frames_are_read_in_sequence() {
        let mut data = b"P6\n2 1\n255\n".to_vec();
        data.extend([1, 2, 3, 4, 5, 6]);
        data.extend(b"P6\n1 1\n255\n");
        data.extend([7, 8, 9]);
        let mut r = std::io::Cursor::new(data);
        let a = read_ppm(&mut r, 100).unwrap().unwrap();
        assert_eq!(
            (a.width, a.height, a.rgb.clone()),
            (2, 1, vec![1, 2, 3, 4, 5, 6])
        );
        let b = read_ppm(&mut r, 100).unwrap().unwrap();
        assert_eq!(b.rgb, vec![7, 8, 9]);
        assert!(read_ppm(&mut r, 100).unwrap().is_none());
        let mut big = std::io::Cursor::new(b"P6\n20 20\n255\n".to_vec());
        assert_eq!(
            read_ppm(&mut big, 100).unwrap_err().kind(),
            "image_too_large"
        );
    }

    #[test]
    fn ffprobe_sits_beside_ffmpeg() {
        assert_eq!(ffprobe_for(Path::new("ffmpeg")), PathBuf::from("ffprobe"));
        assert_eq!(
            ffprobe_for(Path::new("/opt/ff/bin/ffmpeg")),
            PathBuf::from("/opt/ff/bin/ffprobe")
        );
        assert_eq!(
            ffprobe_for(Path::new("/usr/local/bin/my-encoder")),
            PathBuf::from("ffprobe")
        );
    }
}
