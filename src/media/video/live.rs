//! Live fragmented MP4 for a session: one zero-latency x264 process that takes raw RGB frames
//! on stdin and the session's audio (s16le, 16 kHz mono) through a FIFO, and writes H.264 +
//! AAC as fMP4 with a fragment per frame; [`Fragments`] cuts its output into the init segment
//! and `moof`+`mdat` fragments, and counts the video frames they hold.
//!
//! Video and audio are written by two threads, so ffmpeg, which reads its inputs in turn, can
//! never block on one pipe while the caller waits on the other.

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::sync::mpsc::{self, Sender};
use std::thread::JoinHandle;

use super::process::{spawn_thread, Process};
use super::{strings, EncoderSettings};
use crate::media::image::Frame;
use crate::media::Error;

/// Receives the encoder's output: `Some(bytes)` as they come, `None` once at the end.
pub type StdoutConsumer = Box<dyn FnMut(Option<&[u8]>) + Send>;

/// The live encoder (see the module documentation).
pub struct LiveEncoder {
    settings: EncoderSettings,
    process: Process,
    video: Option<Sender<Vec<u8>>>,
    audio: Option<Sender<Vec<u8>>>,
    writers: Vec<JoinHandle<()>>,
    _dir: tempfile::TempDir,
    buf: Vec<u8>,
}

impl EncoderSettings {
    fn live_args(&self, fifo: &str) -> Vec<String> {
        // No stream probing: both inputs are described exactly, and the probe would hold the
        // first frames back (a second and more of latency at a session's start).
        const NO_PROBE: [&str; 4] = ["-probesize", "32", "-analyzeduration", "0"];
        let mut a = self.raw_input_args();
        let video_input = a.iter().position(|x| x == "-i").unwrap_or(a.len());
        a.splice(video_input..video_input, strings(&NO_PROBE));
        a.extend(strings(&NO_PROBE));
        a.extend(strings(&["-f", "s16le", "-ar", "16000", "-ac", "1", "-i"]));
        a.push(fifo.to_string());
        a.extend(strings(&["-map", "0:v:0", "-map", "1:a:0"]));
        a.extend(self.x264_args(self.threads));
        // As the file encoder: trim the AAC priming so speech and lips stay in step.
        a.extend(strings(&[
            "-af",
            "atrim=start_sample=1024",
            "-c:a",
            "aac",
            "-b:a",
            "64k",
            "-avoid_negative_ts",
            "disabled",
            "-flush_packets",
            "1",
            "-movflags",
            "frag_keyframe+empty_moov+default_base_moof+frag_every_frame",
            "-f",
            "mp4",
            "pipe:1",
        ]));
        a
    }
}

impl LiveEncoder {
    /// Starts ffmpeg; its output goes to `consume` (on ffmpeg's stdout thread).
    pub fn spawn(settings: EncoderSettings, consume: StdoutConsumer) -> Result<Self, Error> {
        settings.validate()?;
        let dir = tempfile::tempdir()
            .map_err(|e| Error::Internal(format!("cannot make a temporary folder: {e}")))?;
        let fifo: PathBuf = dir.path().join("audio.pcm");
        let made = Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .map_err(|e| Error::Internal(format!("cannot run mkfifo: {e}")))?;
        if !made.success() {
            return Err(Error::Internal("mkfifo failed".into()));
        }
        let fifo_arg = fifo.display().to_string();
        let mut process = Process::spawn(
            &settings.ffmpeg,
            settings.nice,
            &settings.live_args(&fifo_arg),
            "live encoder",
            consume,
        )?;
        let mut stdin = process
            .take_stdin()
            .ok_or_else(|| Error::Encoder("the live encoder has no stdin".into()))?;
        let (vtx, vrx) = mpsc::channel::<Vec<u8>>();
        let (atx, arx) = mpsc::channel::<Vec<u8>>();
        let video = spawn_thread("live-video", move || {
            for data in vrx {
                if stdin.write_all(&data).is_err() {
                    break;
                }
            }
        })?;
        let audio = spawn_thread("live-audio", move || {
            // Opening blocks until ffmpeg opens its end.
            let Ok(mut pipe) = std::fs::OpenOptions::new().write(true).open(&fifo) else {
                return;
            };
            for data in arx {
                if pipe.write_all(&data).is_err() {
                    break;
                }
            }
        })?;
        Ok(LiveEncoder {
            settings,
            process,
            video: Some(vtx),
            audio: Some(atx),
            writers: vec![video, audio],
            _dir: dir,
            buf: Vec::new(),
        })
    }

    /// The next frame and its audio (16 kHz mono s16le).
    pub fn write(&mut self, frame: &Frame, audio_s16le: Vec<u8>) -> Result<(), Error> {
        let data = self.settings.coded_frame(frame, &mut self.buf)?.to_vec();
        let gone = || Error::Encoder("the live encoder stopped".into());
        self.video
            .as_ref()
            .ok_or_else(gone)?
            .send(data)
            .map_err(|_| gone())?;
        self.audio
            .as_ref()
            .ok_or_else(gone)?
            .send(audio_s16le)
            .map_err(|_| gone())?;
        Ok(())
    }

    /// Closes both inputs and waits for ffmpeg to write the rest.
    pub fn finish(mut self) -> Result<(), Error> {
        self.video = None;
        self.audio = None;
        for w in self.writers.drain(..) {
            let _ = w.join();
        }
        self.process.finish().map(|_| ())
    }
}

impl Drop for LiveEncoder {
    fn drop(&mut self) {
        // Unfinished: kill ffmpeg first so that neither writer stays blocked on it.
        self.process.signal_kill();
        self.video = None;
        self.audio = None;
        for w in self.writers.drain(..) {
            let _ = w.join();
        }
    }
}

/// A piece of live fMP4 output.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece {
    /// `ftyp` + `moov`.
    Init(Vec<u8>),
    /// `moof` + `mdat` (and anything before them), with the video frames it holds.
    Fragment(Vec<u8>, u32),
}

/// Cuts a growing fMP4 byte stream into [`Piece`]s.
#[derive(Default)]
pub struct Fragments {
    buf: Vec<u8>,
    /// Complete boxes of the piece being gathered.
    group: Vec<u8>,
    video_track: Option<u32>,
    frames_in_group: u32,
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// The children of a box's payload: `(type, payload)`.
fn children(mut b: &[u8]) -> Vec<([u8; 4], &[u8])> {
    let mut out = Vec::new();
    while b.len() >= 8 {
        let size = be32(b) as usize;
        if size < 8 || size > b.len() {
            break;
        }
        out.push(([b[4], b[5], b[6], b[7]], &b[8..size]));
        b = &b[size..];
    }
    out
}

impl Fragments {
    /// Adds bytes; returns the pieces they complete.
    pub fn push(&mut self, data: &[u8]) -> Vec<Piece> {
        self.buf.extend_from_slice(data);
        let mut out = Vec::new();
        loop {
            if self.buf.len() < 8 {
                break;
            }
            let mut size = u64::from(be32(&self.buf));
            let mut header = 8;
            if size == 1 {
                if self.buf.len() < 16 {
                    break;
                }
                size = u64::from_be_bytes(self.buf[8..16].try_into().expect("8 bytes"));
                header = 16;
            }
            if size < header as u64 {
                // Not an MP4 box stream: pass the bytes on as they are.
                out.push(Piece::Fragment(std::mem::take(&mut self.buf), 0));
                break;
            }
            let Ok(size) = usize::try_from(size) else {
                break;
            };
            if self.buf.len() < size {
                break;
            }
            let kind: [u8; 4] = self.buf[4..8].try_into().expect("4 bytes");
            let body: Vec<u8> = self.buf.drain(..size).collect();
            match &kind {
                b"moov" => {
                    self.video_track = video_track(&body[header..]);
                    self.group.extend_from_slice(&body);
                    out.push(Piece::Init(std::mem::take(&mut self.group)));
                }
                b"moof" => {
                    self.frames_in_group += self.video_samples(&body[header..]);
                    self.group.extend_from_slice(&body);
                }
                b"mdat" => {
                    self.group.extend_from_slice(&body);
                    let frames = std::mem::take(&mut self.frames_in_group);
                    out.push(Piece::Fragment(std::mem::take(&mut self.group), frames));
                }
                _ => self.group.extend_from_slice(&body),
            }
        }
        out
    }

    /// Video samples in a `moof` payload (all of them when the video track is unknown).
    fn video_samples(&self, moof: &[u8]) -> u32 {
        let mut n = 0;
        for (kind, traf) in children(moof) {
            if &kind != b"traf" {
                continue;
            }
            let boxes = children(traf);
            let track = boxes
                .iter()
                .find(|(k, _)| k == b"tfhd")
                .filter(|(_, p)| p.len() >= 8)
                .map(|(_, p)| be32(&p[4..8]));
            if self.video_track.is_some() && track != self.video_track {
                continue;
            }
            for (k, p) in &boxes {
                if k == b"trun" && p.len() >= 8 {
                    n += be32(&p[4..8]);
                }
            }
        }
        n
    }
}

/// The track id of the `vide` track in a `moov` payload.
fn video_track(moov: &[u8]) -> Option<u32> {
    for (kind, trak) in children(moov) {
        if &kind != b"trak" {
            continue;
        }
        let boxes = children(trak);
        let id = boxes.iter().find(|(k, _)| k == b"tkhd").and_then(|(_, p)| {
            // version 0: id at 12; version 1: at 20.
            let at = if p.first() == Some(&1) { 20 } else { 12 };
            p.get(at..at + 4).map(be32)
        });
        let is_video = boxes.iter().any(|(k, p)| {
            k == b"mdia"
                && children(p)
                    .iter()
                    .any(|(k, h)| k == b"hdlr" && h.get(8..12) == Some(b"vide"))
        });
        if is_video {
            return id;
        }
    }
    None
}

/// The MSE type of an init segment: `video/mp4; codecs="avc1.PPCCLL, mp4a.40.2"` from its
/// `avcC` box.
pub fn mime_type(init: &[u8]) -> String {
    let avc = init
        .windows(4)
        .position(|w| w == b"avcC")
        .and_then(|i| init.get(i + 5..i + 8))
        .map(|p| format!("avc1.{:02X}{:02X}{:02X}", p[0], p[1], p[2]))
        .unwrap_or_else(|| "avc1.64001F".into());
    format!("video/mp4; codecs=\"{avc}, mp4a.40.2\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_stream_comes_out_as_an_init_segment_and_one_fragment_per_frame() {
        let mut s = EncoderSettings::new(64, 48, crate::media::audio::Fps::DEFAULT);
        s.preset = "ultrafast".into();
        let (tx, rx) = mpsc::channel::<Vec<u8>>();
        let consume: StdoutConsumer = Box::new(move |d| {
            if let Some(d) = d {
                let _ = tx.send(d.to_vec());
            }
        });
        let mut enc = LiveEncoder::spawn(s, consume).unwrap();
        let frame = Frame::new(64, 48, vec![90; 64 * 48 * 3]);
        for _ in 0..25 {
            enc.write(&frame, vec![0u8; 640 * 2]).unwrap();
        }
        enc.finish().unwrap();
        let mut f = Fragments::default();
        let pieces: Vec<Piece> = rx.iter().flat_map(|d| f.push(&d)).collect();
        let Piece::Init(init) = &pieces[0] else {
            panic!("no init segment first")
        };
        // ultrafast: Constrained Baseline (42 C0), level 1 for this tiny size.
        assert_eq!(
            mime_type(init),
            "video/mp4; codecs=\"avc1.42C00A, mp4a.40.2\""
        );
        let frames: u32 = pieces
            .iter()
            .map(|p| match p {
                Piece::Fragment(_, n) => *n,
                Piece::Init(_) => 0,
            })
            .sum();
        assert_eq!(frames, 25);
        let most = pieces
            .iter()
            .map(|p| match p {
                Piece::Fragment(_, n) => *n,
                Piece::Init(_) => 0,
            })
            .max()
            .unwrap();
        assert!(most <= 5, "a fragment holds {most} frames (over 200 ms)");
    }
}
