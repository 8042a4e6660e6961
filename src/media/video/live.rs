//! Live fragmented MP4 for a session: one zero-latency x264 process that takes raw YUV 4:2:0
//! frames on stdin and the session's audio (s16le, 16 kHz mono) through a FIFO, and writes
//! the H.264 pictures as FLV on stdout and the AAC frames as FLV on its descriptor 3. The
//! two streams are muxed here into fMP4 ([`super::fmp4`]): an init segment, then a fragment
//! per picture, written the moment the picture is encoded, with the AAC frames encoded since
//! the last one. [`Fragments`] cuts that output into its pieces and counts the video frames
//! they hold.
//!
//! Why not ffmpeg's MP4 muxer: it writes a fragment only once the next packet arrives, and
//! interleaves the two streams by time, so every frame waited one frame interval (40 ms at
//! 25 fps) or for its audio. Two outputs of one stream each are written as they come.
//!
//! Video and audio are written by two threads, so ffmpeg, which reads its inputs in turn, can
//! never block on one pipe while the caller waits on the other; its two outputs are read by
//! two more (its stdout reader and [`AUDIO_READER`]), for the same reason.
//!
//! [`LiveEncoder::spawn`] returns once ffmpeg has started (it has opened the audio input,
//! its first, which the writer primes with [`PRIME_SAMPLES`] of silence that the filter trims
//! again): a session's clock then starts with its encoder up, and many sessions opened at once
//! do not see their first frames late while their encoders load.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::flv;
use super::fmp4;
use super::process::{spawn_thread, Fd3, Process};
use super::splice::{FrameFeed, FramePool, History, Pooled};
use super::{strings, EncoderSettings, NO_PROBE, QUIET};
use crate::media::yuv::{Region, Yuv420};
use crate::media::Error;

/// Receives the encoder's output: `Some(bytes)` as they come, `None` once at the end.
pub type StdoutConsumer = Box<dyn FnMut(Option<&[u8]>) + Send>;

/// The name of the thread that reads the AAC output.
const AUDIO_READER: &str = "live-aac";

/// The live encoder (see the module documentation).
pub struct LiveEncoder {
    settings: EncoderSettings,
    process: Process,
    video: Option<Sender<Pooled>>,
    audio: Option<Sender<Vec<u8>>>,
    /// Buffers of frames ffmpeg has read, to fill again.
    pool: FramePool,
    /// Where each frame written differed from the one before, for [`FramePool::updated`].
    history: History,
    writers: Vec<JoinHandle<()>>,
    /// Reads the AAC output into the muxer.
    audio_out: Option<JoinHandle<()>>,
    /// What went wrong in the muxer, if anything (apart from it: the muxer's lock is held
    /// while the consumer sends, which may wait on a slow client).
    muxed: Failure,
    fifo: PathBuf,
    _dir: tempfile::TempDir,
}

/// Silence written to the audio input as soon as ffmpeg opens it (one read of its PCM
/// demuxer), so that ffmpeg gets past probing that input without the session's audio; the
/// filter trims it again.
pub const PRIME_SAMPLES: usize = 1024;

/// How far ahead of the video a session's audio should reach the encoder. A frame's fragment
/// goes out when the frame is encoded, with the AAC frames encoded by then; the AAC encoder
/// gives out a frame of 1024 samples 1024 samples late: 128 ms at 16 kHz. Audio that runs
/// this far ahead (with 20 ms to spare) puts the sound of a frame's time in the frame's own
/// fragment or an earlier one, so a player, which plays only where it has both, can play the
/// frame as soon as it arrives.
pub const AUDIO_LEAD: Duration = Duration::from_millis(148);

/// AAC frames gathered with no picture to go with them before they go out alone (0.5 s at
/// 16 kHz): only at the end of a stream, or if ffmpeg's video stalled.
const AUDIO_ALONE: usize = 8;

/// Pictures (or AAC frames) that may wait for the init segment: 10 s at 25 fps.
const EARLY_MAX: usize = 250;

/// Frame buffers kept for reuse: those the pipe may still reference, and a few queued.
const FRAMES_KEPT: usize = 4;

/// How long ffmpeg may take to start.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Lets a writer blocked opening `fifo` (its reader never came), or about to open it, go on:
/// the read end this opens completes its open. Keep it until the writer has been joined; its
/// writes fail once it is closed.
fn release_writer(fifo: &Path) -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc_nonblock())
        .open(fifo)
        .ok()
}

/// `O_NONBLOCK` on Linux (an open for reading that does not wait for a writer).
const fn libc_nonblock() -> i32 {
    0o4000
}

impl EncoderSettings {
    fn live_args(&self, fifo: &str) -> Vec<String> {
        // The audio first: ffmpeg opens its inputs in order, and the audio's opening tells
        // that it has started (see the module documentation). Both are described exactly: no
        // probing (see NO_PROBE).
        let mut a: Vec<String> = strings(&QUIET).chain(strings(&NO_PROBE)).collect();
        a.extend(strings(&["-f", "s16le", "-ar", "16000", "-ac", "1", "-i"]));
        a.push(fifo.to_string());
        a.extend(self.raw_video_input_args());
        // Each output writes a packet as soon as it is encoded: FLV frames it with its length.
        let flv = [
            "-flush_packets",
            "1",
            "-flvflags",
            "no_duration_filesize",
            "-f",
            "flv",
        ];
        a.extend(strings(&["-map", "1:v:0"]));
        a.extend(self.x264_args(self.threads));
        a.extend(strings(&flv));
        a.push("pipe:1".into());
        a.extend(strings(&["-map", "0:a:0"]));
        // As the file encoder: trim the AAC priming (1024 samples) so speech and lips stay in
        // step (the first AAC frame starts at 0), and the writer's PRIME_SAMPLES. (AAC at
        // 48 kHz would cut the delay of a frame's sound from about 128 to 43 ms, as its
        // 1024-sample frames are 21 ms long instead of 64, and stays in step; but Chromium's
        // MSE playback of it stalled, so the AAC stays at the session's 16 kHz.)
        a.extend(strings(&["-af"]));
        a.push(format!("atrim=start_sample={}", 1024 + PRIME_SAMPLES));
        // ffmpeg's fast AAC coder: a fifth of the default (twoloop) coder's CPU, which was
        // 15 % of all the CPU with 16 sessions speaking on 2 cores, at the same quality for
        // speech at 64 kb/s (SNR 32.2 against 31.9 dB on the ARCTIC clip) and the same
        // framing and delay.
        a.extend(strings(&[
            "-c:a",
            "aac",
            "-aac_coder",
            "fast",
            "-b:a",
            "64k",
        ]));
        a.extend(strings(&flv));
        a.push("pipe:3".into());
        a
    }
}

/// Locks a mutex, whatever a thread that panicked holding it left.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The first thing that went wrong with the encoder's output.
type Failure = Arc<Mutex<Option<String>>>;

/// One of the encoder's two outputs.
#[derive(Clone, Copy)]
enum Output {
    Video,
    Audio,
}

/// Muxes the encoder's two FLV outputs into fMP4 for the consumer (see the module
/// documentation).
struct Muxer {
    consume: StdoutConsumer,
    /// The init segment's size and frame rate; the configurations come from the outputs.
    width: u32,
    height: u32,
    fps: (u32, u32),
    avc: Option<Vec<u8>>,
    aac: Option<Vec<u8>>,
    writer: Option<fmp4::Writer>,
    /// Pictures `(index, key, data)` that came before the init segment could be written.
    early: Vec<(u64, bool, Vec<u8>)>,
    /// AAC frames not yet in a fragment.
    audio: Vec<Vec<u8>>,
    video_tags: flv::Tags,
    audio_tags: flv::Tags,
    video_ended: bool,
    audio_ended: bool,
    /// What went wrong with the output, if anything: nothing more is muxed.
    error: Failure,
}

impl Muxer {
    fn new(settings: &EncoderSettings, consume: StdoutConsumer, error: Failure) -> Self {
        let (width, height) = settings.coded_size();
        Muxer {
            consume,
            width,
            height,
            fps: settings.fps.ratio(),
            avc: None,
            aac: None,
            writer: None,
            early: Vec::new(),
            audio: Vec::new(),
            video_tags: flv::Tags::default(),
            audio_tags: flv::Tags::default(),
            video_ended: false,
            audio_ended: false,
            error,
        }
    }

    /// Bytes of the video output; `None` at its end.
    fn video_bytes(&mut self, data: Option<&[u8]>) {
        self.bytes(Output::Video, data);
    }

    /// Bytes of the audio output; `None` at its end.
    fn audio_bytes(&mut self, data: Option<&[u8]>) {
        self.bytes(Output::Audio, data);
    }

    fn bytes(&mut self, output: Output, data: Option<&[u8]>) {
        let read = match (output, data) {
            (Output::Video, Some(d)) => self.video_tags(d),
            (Output::Audio, Some(d)) => self.audio_tags(d),
            (Output::Video, None) => {
                self.video_ended = true;
                self.video_tags.end()
            }
            (Output::Audio, None) => {
                self.audio_ended = true;
                self.audio_tags.end()
            }
        };
        if let Err(e) = read {
            let name = match output {
                Output::Video => "video",
                Output::Audio => "audio",
            };
            self.fail(format!("the live encoder's {name}: {e}"));
        }
        if data.is_none() {
            self.end_if_done();
        }
    }

    fn fail(&mut self, e: String) {
        lock(&self.error).get_or_insert(e);
    }

    fn failed(&self) -> bool {
        lock(&self.error).is_some()
    }

    fn video_tags(&mut self, data: &[u8]) -> Result<(), String> {
        if self.failed() {
            return Ok(());
        }
        for tag in self.video_tags.push(data)? {
            if tag.kind != flv::VIDEO {
                continue;
            }
            match flv::avc(&tag.data)? {
                flv::Avc::Config(record) => self.avc = Some(record.to_vec()),
                flv::Avc::Picture {
                    key,
                    nals,
                    composition_ms,
                } => {
                    // Presentation = decode: x264 runs without B-frames (see x264_args).
                    if composition_ms != 0 {
                        return Err(format!(
                            "a picture shown {composition_ms} ms after its decoding (B-frames), \
                             which the live muxer does not write"
                        ));
                    }
                    // The frame's index from its time (milliseconds, rounded by the muxer).
                    let (num, den) = (u64::from(self.fps.0), u64::from(self.fps.1));
                    let index = (2 * u64::from(tag.timestamp_ms) * num + 1000 * den) / (2000 * den);
                    self.early.push((index, key, nals.to_vec()));
                    self.waited_too_long()?;
                    self.ready()?;
                    if self.writer.is_some() {
                        self.write_pictures();
                    }
                }
                flv::Avc::Other => {}
            }
        }
        Ok(())
    }

    fn audio_tags(&mut self, data: &[u8]) -> Result<(), String> {
        if self.failed() {
            return Ok(());
        }
        for tag in self.audio_tags.push(data)? {
            if tag.kind != flv::AUDIO {
                continue;
            }
            match flv::aac(&tag.data)? {
                flv::Aac::Config(asc) => {
                    self.aac = Some(asc.to_vec());
                    self.ready()?;
                    if self.writer.is_some() {
                        self.write_pictures();
                    }
                }
                flv::Aac::Frame(frame) => {
                    self.audio.push(frame.to_vec());
                    self.waited_too_long()?;
                    if self.writer.is_some() && self.audio.len() >= AUDIO_ALONE {
                        self.write_audio();
                    }
                }
                flv::Aac::Other => {}
            }
        }
        Ok(())
    }

    /// The configurations not come yet.
    fn missing(&self) -> &'static str {
        match (&self.avc, &self.aac) {
            (None, None) => "video and audio configurations",
            (None, Some(_)) => "video configuration",
            _ => "audio configuration",
        }
    }

    /// An error once more than [`EARLY_MAX`] pictures or AAC frames wait for the init
    /// segment: one of the configurations is not coming.
    fn waited_too_long(&self) -> Result<(), String> {
        if self.writer.is_none() && self.early.len().max(self.audio.len()) > EARLY_MAX {
            return Err(format!(
                "no {} after {EARLY_MAX} pictures or AAC frames",
                self.missing()
            ));
        }
        Ok(())
    }

    /// Writes the init segment once both configurations are known.
    fn ready(&mut self) -> Result<(), String> {
        if self.writer.is_some() {
            return Ok(());
        }
        let (Some(avc), Some(aac)) = (&self.avc, &self.aac) else {
            return Ok(());
        };
        let writer = fmp4::Writer::new(fmp4::Tracks {
            width: self.width,
            height: self.height,
            fps: self.fps,
            avc: avc.clone(),
            aac: aac.clone(),
        })
        .map_err(|e| e.to_string())?;
        (self.consume)(Some(&writer.init()));
        self.writer = Some(writer);
        Ok(())
    }

    /// A fragment for every picture waiting, the audio gathered so far with the first.
    fn write_pictures(&mut self) {
        let Some(writer) = self.writer.as_mut() else {
            return;
        };
        for (index, key, data) in std::mem::take(&mut self.early) {
            let picture = fmp4::Picture {
                index,
                key,
                data: &data,
            };
            let fragment = writer.fragment(Some(&picture), &std::mem::take(&mut self.audio));
            (self.consume)(Some(&fragment));
        }
    }

    fn write_audio(&mut self) {
        if let Some(writer) = self.writer.as_mut() {
            if !self.audio.is_empty() {
                let fragment = writer.fragment(None, &std::mem::take(&mut self.audio));
                (self.consume)(Some(&fragment));
            }
        }
    }

    /// Once both outputs have ended: the rest of the audio, then the end.
    fn end_if_done(&mut self) {
        if !(self.video_ended && self.audio_ended) {
            return;
        }
        if !self.failed() {
            if self.writer.is_none() && !self.early.is_empty() {
                let e = format!("the live encoder gave no {}", self.missing());
                self.fail(e);
            }
            self.write_audio();
        }
        (self.consume)(None);
    }
}

impl LiveEncoder {
    /// Starts ffmpeg; its output goes to `consume` (on one of the threads reading ffmpeg's
    /// outputs).
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
        // Never from the spares: the command line names this session's FIFO.
        let launch = settings.launch(settings.live_args(&fifo_arg), Fd3::Output);
        let muxed = Failure::default();
        let muxer = Arc::new(Mutex::new(Muxer::new(&settings, consume, muxed.clone())));
        let video_muxer = muxer.clone();
        let mut process = Process::spawn(
            &launch,
            None,
            "live encoder",
            Box::new(move |data| lock(&video_muxer).video_bytes(data)),
        )?;
        // Without its audio reader the muxer is told the audio has ended, so that the
        // consumer still gets its end once the video's reader ends (the process, dropped on
        // the way out, is killed).
        let Some(mut aac) = process.take_fd3() else {
            lock(&muxer).audio_bytes(None);
            return Err(Error::Encoder(
                "the live encoder has no audio output".into(),
            ));
        };
        let audio_muxer = muxer.clone();
        let audio_out = spawn_thread(AUDIO_READER, move || {
            let mut buf = vec![0u8; 16 << 10];
            loop {
                match aac.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => lock(&audio_muxer).audio_bytes(Some(&buf[..n])),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            lock(&audio_muxer).audio_bytes(None);
        });
        let audio_out = match audio_out {
            Ok(t) => t,
            Err(e) => {
                lock(&muxer).audio_bytes(None);
                return Err(e);
            }
        };
        let stdin = process
            .take_stdin()
            .ok_or_else(|| Error::Encoder("the live encoder has no stdin".into()))?;
        let (vtx, vrx) = mpsc::channel::<Pooled>();
        let (atx, arx) = mpsc::channel::<Vec<u8>>();
        // Frames go in by reference, not copied into the pipe ([`FrameFeed`]), through a pipe
        // that holds a whole frame.
        let pool = FramePool::new(FRAMES_KEPT);
        let mut feed = FrameFeed::new(stdin, pool.clone());
        let (w, h) = settings.coded_size();
        feed.widen(w as usize * h as usize * 3 / 2);
        let video = spawn_thread("live-video", move || {
            for data in vrx {
                if feed.write(data).is_err() {
                    break;
                }
            }
            // Dropping the feed waits until ffmpeg has read the last frames (or has gone).
        })?;
        let (opened_tx, opened) = mpsc::channel::<()>();
        let audio_fifo = fifo.clone();
        let audio = spawn_thread("live-audio", move || {
            // Opening blocks until ffmpeg opens its end.
            let Ok(mut pipe) = std::fs::OpenOptions::new().write(true).open(&audio_fifo) else {
                return;
            };
            if pipe.write_all(&[0; 2 * PRIME_SAMPLES]).is_err() {
                return;
            }
            let _ = opened_tx.send(());
            for data in arx {
                if pipe.write_all(&data).is_err() {
                    break;
                }
            }
        })?;
        let encoder = LiveEncoder {
            settings,
            process,
            video: Some(vtx),
            audio: Some(atx),
            pool,
            history: History::default(),
            writers: vec![video, audio],
            audio_out: Some(audio_out),
            muxed,
            fifo,
            _dir: dir,
        };
        // Dropping the encoder on a failure kills ffmpeg and releases the writers.
        let until = std::time::Instant::now() + START_TIMEOUT;
        let mut encoder = encoder;
        loop {
            match opened.recv_timeout(Duration::from_millis(20)) {
                Ok(()) => return Ok(encoder),
                Err(mpsc::RecvTimeoutError::Timeout) if !encoder.process.exited() => {
                    if std::time::Instant::now() >= until {
                        return Err(Error::Encoder(format!(
                            "the live encoder did not start within {} s",
                            START_TIMEOUT.as_secs()
                        )));
                    }
                }
                // ffmpeg stopped before it took the audio: its stderr says why.
                Err(_) => {
                    encoder.video = None;
                    encoder.audio = None;
                    let _reader = release_writer(&encoder.fifo);
                    for w in encoder.writers.drain(..) {
                        let _ = w.join();
                    }
                    return Err(match encoder.process.finish() {
                        Err(e) => e,
                        Ok(_) => Error::Encoder("the live encoder stopped at once".into()),
                    });
                }
            }
        }
    }

    /// The next frame and the audio that goes with it (16 kHz mono s16le; any length: the
    /// audio is one stream, which may run ahead of the frames, see [`AUDIO_LEAD`]).
    pub fn write(&mut self, frame: &Yuv420, audio_s16le: Vec<u8>) -> Result<(), Error> {
        self.write_changed(frame, None, audio_s16le)
    }

    /// [`Self::write`] for a frame that differs from the frame written last only within
    /// `changed` (`None`: anywhere, or not known; an empty region: nowhere): only that is
    /// copied for ffmpeg where it can be (see [`FramePool::updated`]).
    pub fn write_changed(
        &mut self,
        frame: &Yuv420,
        changed: Option<Region>,
        audio_s16le: Vec<u8>,
    ) -> Result<(), Error> {
        self.check()?;
        self.settings.coded_frame(frame)?;
        self.history.push(changed);
        let data = self.pool.updated(frame, &self.history);
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

    /// Audio alone (16 kHz mono s16le), after what went before.
    pub fn write_audio(&mut self, audio_s16le: Vec<u8>) -> Result<(), Error> {
        self.audio
            .as_ref()
            .ok_or_else(|| Error::Encoder("the live encoder stopped".into()))?
            .send(audio_s16le)
            .map_err(|_| Error::Encoder("the live encoder stopped".into()))
    }

    /// An error if ffmpeg's output could not be muxed.
    fn check(&self) -> Result<(), Error> {
        match &*lock(&self.muxed) {
            Some(e) => Err(Error::Encoder(e.clone())),
            None => Ok(()),
        }
    }

    /// Closes both inputs and waits for ffmpeg to write the rest, and for the muxer to pass
    /// it on.
    pub fn finish(mut self) -> Result<(), Error> {
        self.video = None;
        self.audio = None;
        for w in self.writers.drain(..) {
            let _ = w.join();
        }
        let done = self.process.finish().map(|_| ());
        // ffmpeg has exited: the audio output has ended.
        if let Some(t) = self.audio_out.take() {
            let _ = t.join();
        }
        done?;
        self.check()
    }
}

impl Drop for LiveEncoder {
    fn drop(&mut self) {
        // Unfinished: kill ffmpeg first so that neither writer stays blocked on it.
        self.process.signal_kill();
        self.video = None;
        self.audio = None;
        // The audio writer may be blocked opening the FIFO (ffmpeg never opened it), which
        // this read end completes, or writing into it while it is full: the FIFO then still
        // has a reader, this one, so the write would not fail. What it writes is read and
        // dropped until it has finished.
        let reader = release_writer(&self.fifo);
        let mut scrap = [0u8; 16 << 10];
        for w in self.writers.drain(..) {
            while !w.is_finished() {
                if let Some(mut r) = reader.as_ref() {
                    while matches!(r.read(&mut scrap), Ok(n) if n > 0) {}
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            let _ = w.join();
        }
        // ffmpeg reaped (and its video reader done), its audio output has ended: the audio
        // reader passes the end on and stops.
        self.process.kill();
        if let Some(t) = self.audio_out.take() {
            let _ = t.join();
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

    /// What a muxer wrote, and how many times its end came.
    type Written = Arc<Mutex<(Vec<u8>, u32)>>;

    /// A muxer whose output is gathered, and its failure slot.
    fn muxer() -> (Muxer, Written, Failure) {
        let out = Arc::new(Mutex::new((Vec::new(), 0u32)));
        let sink = out.clone();
        let consume: StdoutConsumer = Box::new(move |d| {
            let mut o = sink.lock().unwrap();
            match d {
                Some(d) => o.0.extend_from_slice(d),
                None => o.1 += 1,
            }
        });
        let failed = Failure::default();
        let s = EncoderSettings::new(64, 48, crate::media::audio::Fps::DEFAULT);
        (Muxer::new(&s, consume, failed.clone()), out, failed)
    }

    fn video_flv(pictures: std::ops::Range<u32>, config: bool) -> Vec<u8> {
        use crate::media::video::flv::tests::tag_at;
        let mut tags = Vec::new();
        if config {
            let mut c = vec![0x17, 0, 0, 0, 0];
            c.extend_from_slice(&[
                1, 0x42, 0xc0, 0x0a, 0xff, 0xe1, 0, 2, 0x67, 0x42, 1, 0, 1, 0x68,
            ]);
            tags.push(tag_at(flv::VIDEO, 0, &c));
        }
        for k in pictures {
            let key = if k == 0 { 0x17 } else { 0x27 };
            tags.push(tag_at(
                flv::VIDEO,
                k * 40,
                &[key, 1, 0, 0, 0, 0, 0, 0, 1, 0x65],
            ));
        }
        let mut f = crate::media::video::flv::tests::flv(&tags);
        if !config {
            f.drain(..13); // the header went before
        }
        f
    }

    fn audio_flv(frames: usize, config: bool) -> Vec<u8> {
        use crate::media::video::flv::tests::tag_at;
        let mut tags = Vec::new();
        if config {
            tags.push(tag_at(flv::AUDIO, 0, &[0xaf, 0, 0x14, 0x08]));
        }
        for _ in 0..frames {
            tags.push(tag_at(flv::AUDIO, 0, &[0xaf, 1, 0x21, 0x10]));
        }
        let mut f = crate::media::video::flv::tests::flv(&tags);
        if !config {
            f.drain(..13);
        }
        f
    }

    fn frames_per_piece(bytes: &[u8]) -> Vec<Option<u32>> {
        Fragments::default()
            .push(bytes)
            .into_iter()
            .map(|p| match p {
                Piece::Init(_) => None,
                Piece::Fragment(_, n) => Some(n),
            })
            .collect()
    }

    #[test]
    fn pictures_wait_for_the_audio_configuration_then_go_out_one_per_fragment() {
        let (mut m, out, failed) = muxer();
        m.video_bytes(Some(&video_flv(0..2, true)));
        assert!(
            out.lock().unwrap().0.is_empty(),
            "no init segment without the AAC config"
        );
        m.audio_bytes(Some(&audio_flv(1, true)));
        m.video_bytes(Some(&video_flv(2..3, false)));
        // Audio with no picture to ride with: it goes alone once AUDIO_ALONE frames gather.
        m.audio_bytes(Some(&audio_flv(AUDIO_ALONE, false)));
        m.audio_bytes(Some(&audio_flv(3, false)));
        m.video_bytes(None);
        assert_eq!(
            out.lock().unwrap().1,
            0,
            "the end waits for the audio's end"
        );
        m.audio_bytes(None);
        let (bytes, ends) = out.lock().unwrap().clone();
        assert_eq!(ends, 1);
        assert!(failed.lock().unwrap().is_none());
        // init; the two early pictures; the third (with the first AAC frame); 8 AAC frames
        // alone; the last 3 at the end.
        assert_eq!(
            frames_per_piece(&bytes),
            [None, Some(1), Some(1), Some(1), Some(0), Some(0)]
        );
    }

    #[test]
    fn output_that_is_not_flv_fails_the_encoder_and_still_ends() {
        let (mut m, out, failed) = muxer();
        m.audio_bytes(Some(&audio_flv(0, true)));
        m.video_bytes(Some(b"RIFF\0\0\0\0WAVEfmt "));
        m.video_bytes(Some(&video_flv(0..3, true)));
        m.video_bytes(None);
        m.audio_bytes(None);
        let (bytes, ends) = out.lock().unwrap().clone();
        assert_eq!(ends, 1);
        assert!(
            bytes.is_empty(),
            "nothing after the failure: {} bytes",
            bytes.len()
        );
        let e = failed.lock().unwrap().clone().unwrap();
        assert!(e.contains("video") && e.contains("not FLV"), "{e}");

        // An audio output that never says its configuration: the pictures cannot go out.
        let (mut m, _, failed) = muxer();
        m.video_bytes(Some(&video_flv(0..2, true)));
        m.audio_bytes(Some(&audio_flv(0, false)[..0]));
        m.video_bytes(None);
        m.audio_bytes(None);
        let e = failed.lock().unwrap().clone().unwrap();
        assert!(e.contains("no audio configuration"), "{e}");

        // Nor is it waited for without end: the stream fails once EARLY_MAX pictures wait.
        let (mut m, _, failed) = muxer();
        m.video_bytes(Some(&video_flv(0..EARLY_MAX as u32, true)));
        assert!(failed.lock().unwrap().is_none());
        m.video_bytes(Some(&video_flv(
            EARLY_MAX as u32..EARLY_MAX as u32 + 1,
            false,
        )));
        let e = failed.lock().unwrap().clone().unwrap();
        assert!(e.contains("no audio configuration after 250"), "{e}");

        // A picture shown after its decoding (B-frames) is refused, not written wrong.
        let (mut m, _, failed) = muxer();
        m.audio_bytes(Some(&audio_flv(0, true)));
        let mut b = video_flv(0..1, true);
        let n = b.len();
        b[n - 4 - 10 + 4] = 40; // the last tag's composition time: 40 ms
        m.video_bytes(Some(&b));
        let e = failed.lock().unwrap().clone().unwrap();
        assert!(e.contains("B-frames"), "{e}");
    }

    #[test]
    fn every_frame_comes_out_in_its_own_fragment_before_the_next_is_written() {
        let mut s = EncoderSettings::new(64, 48, crate::media::audio::Fps::DEFAULT);
        s.preset = "ultrafast".into();
        let (tx, rx) = mpsc::channel::<Vec<u8>>();
        let all = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = all.clone();
        let mut cut = Fragments::default();
        let consume: StdoutConsumer = Box::new(move |d| {
            if let Some(d) = d {
                sink.lock().unwrap().extend_from_slice(d);
                for piece in cut.push(d) {
                    let _ = tx.send(match piece {
                        Piece::Init(b) => b,
                        Piece::Fragment(_, n) => vec![n as u8],
                    });
                }
            }
        });
        let mut enc = LiveEncoder::spawn(s, consume).unwrap();
        // As a session does: the audio runs AUDIO_LEAD ahead of the frames (4 frames' worth).
        // Without it ffmpeg reads the audio, whose encoder has not started, before each frame.
        enc.write_audio(vec![0u8; 4 * 640 * 2]).unwrap();
        let wait = Duration::from_secs(10);
        let mut init = None;
        for k in 0..25u8 {
            let frame = crate::media::image::Frame::new(64, 48, vec![k * 9; 64 * 48 * 3]);
            enc.write(&Yuv420::from_rgb(&frame), vec![0u8; 640 * 2])
                .unwrap();
            // The frame's fragment comes without the next frame (ffmpeg's MP4 muxer waited
            // for it), and holds that frame alone; an audio-only fragment may come first.
            loop {
                let got = rx
                    .recv_timeout(wait)
                    .unwrap_or_else(|_| panic!("frame {k}'s fragment did not come"));
                if got.len() > 1 {
                    init = Some(got);
                    continue;
                }
                match got[0] {
                    0 => continue,
                    1 => break,
                    n => panic!("a fragment holds {n} frames"),
                }
            }
        }
        enc.finish().unwrap();
        let init = init.expect("an init segment");
        // ultrafast: Constrained Baseline (42 C0), level 1 for this tiny size.
        assert_eq!(
            mime_type(&init),
            "video/mp4; codecs=\"avc1.42C00A, mp4a.40.2\""
        );
        // ffprobe reads the stream whole: 25 frames at exactly k/25 s, a keyframe first, an
        // AAC track at 16 kHz, and nothing it complains about.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("live.mp4");
        std::fs::write(&path, &*all.lock().unwrap()).unwrap();
        let probe = |args: &[&str]| {
            let out = std::process::Command::new(crate::media::video::clip::ffprobe_for(
                &super::super::default_ffmpeg(),
            ))
            .args(["-v", "error"])
            .args(args)
            .arg(&path)
            .output()
            .unwrap();
            assert!(out.status.success() && out.stderr.is_empty(), "{out:?}");
            String::from_utf8(out.stdout).unwrap()
        };
        let frames = probe(&[
            "-select_streams",
            "v",
            "-show_entries",
            "frame=pts_time,key_frame",
            "-of",
            "json",
        ]);
        let frames: serde_json::Value = serde_json::from_str(&frames).unwrap();
        let frames = frames["frames"].as_array().unwrap();
        assert_eq!(frames.len(), 25, "{frames:?}");
        for (k, f) in frames.iter().enumerate() {
            let t: f64 = f["pts_time"].as_str().unwrap().parse().unwrap();
            assert!((t - k as f64 / 25.0).abs() < 1e-6, "frame {k} at {t} s");
            assert_eq!(f["key_frame"] == 1, k == 0, "frame {k}: {f}");
        }
        let audio = probe(&[
            "-select_streams",
            "a",
            "-show_entries",
            "stream=codec_name,sample_rate,channels",
            "-of",
            "csv=p=0",
        ]);
        assert_eq!(audio.trim(), "aac,16000,1");
    }

    /// A live encoder with `s` whose whole output gathers in the vector returned.
    fn collecting(s: EncoderSettings) -> (LiveEncoder, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
        let out = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = out.clone();
        let consume: StdoutConsumer = Box::new(move |d| {
            if let Some(d) = d {
                sink.lock().unwrap().extend_from_slice(d);
            }
        });
        (LiveEncoder::spawn(s, consume).unwrap(), out)
    }

    /// The live stream of `frames` frames of fresh noise (every pixel new in every frame,
    /// x264's worst case), 256×192 at 25 fps, with the session's preset and `max_bitrate`.
    fn live_noise(frames: usize, max_bitrate: Option<u64>) -> Vec<u8> {
        let mut s = EncoderSettings::new(256, 192, crate::media::audio::Fps::DEFAULT);
        s.preset = "ultrafast".into();
        s.max_bitrate = max_bitrate;
        let (mut enc, out) = collecting(s);
        let mut seed = 0x2545_f491_u32;
        for _ in 0..frames {
            let rgb: Vec<u8> = (0..256 * 192 * 3)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (seed >> 24) as u8
                })
                .collect();
            let frame = crate::media::image::Frame::new(256, 192, rgb);
            enc.write(&Yuv420::from_rgb(&frame), vec![0u8; 640 * 2])
                .unwrap();
        }
        enc.finish().unwrap();
        let bytes = out.lock().unwrap().clone();
        bytes
    }

    #[test]
    fn frames_told_where_they_changed_arrive_whole() {
        // A photo session's frames differ only in the face's region, and only that is copied
        // into a reused buffer for ffmpeg. Lossless (crf 0, no cap), the decoded stream must
        // be every frame as written, whether the next changed in a region, nowhere or all over.
        let (w, h) = (128u32, 96u32);
        let mut s = EncoderSettings::new(w, h, crate::media::audio::Fps::DEFAULT);
        s.preset = "ultrafast".into();
        s.crf = 0;
        s.max_bitrate = None;
        let (mut enc, out) = collecting(s);
        let mut seed = 7u32;
        let mut noise = |w: u32, h: u32| {
            let rgb = (0..w * h * 3)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (seed >> 24) as u8
                })
                .collect();
            crate::media::image::Frame::new(w, h, rgb)
        };
        let face = Region {
            x: 32,
            y: 40,
            width: 48,
            height: 32,
        };
        let mut frame = Yuv420::from_rgb(&noise(w, h));
        let mut written = Vec::new();
        for k in 0..40 {
            let changed = match k % 7 {
                0 => {
                    frame = Yuv420::from_rgb(&noise(w, h));
                    None
                }
                3 => Some(Region::EMPTY),
                _ => {
                    frame.write_rgb(face.x, face.y, &noise(face.width, face.height));
                    Some(face)
                }
            };
            enc.write_changed(&frame, changed, vec![0u8; 640 * 2])
                .unwrap();
            written.push(frame.bytes().to_vec());
            // Paced, as a session's frames are, so that buffers come back to be reused.
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        enc.finish().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("live.mp4");
        std::fs::write(&path, &*out.lock().unwrap()).unwrap();
        let decoded = std::process::Command::new(super::super::default_ffmpeg())
            .args(["-v", "error", "-i"])
            .arg(&path)
            .args(["-f", "rawvideo", "-pix_fmt", "yuv420p", "-"])
            .output()
            .unwrap();
        assert!(decoded.status.success(), "{decoded:?}");
        let got: Vec<&[u8]> = decoded.stdout.chunks_exact(written[0].len()).collect();
        assert_eq!(got.len(), written.len());
        for (k, (got, want)) in got.iter().zip(&written).enumerate() {
            assert!(got == want, "frame {k}");
        }
    }

    /// Each video packet's size in `stream`, in order (ffprobe).
    fn video_packet_sizes(stream: &[u8]) -> Vec<u64> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("live.mp4");
        std::fs::write(&path, stream).unwrap();
        let out = std::process::Command::new(crate::media::video::clip::ffprobe_for(
            &super::super::default_ffmpeg(),
        ))
        .args(["-v", "error", "-select_streams", "v"])
        .args(["-show_entries", "packet=size", "-of", "csv=p=0"])
        .arg(&path)
        .output()
        .unwrap();
        assert!(out.status.success() && out.stderr.is_empty(), "{out:?}");
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| l.trim().parse().unwrap())
            .collect()
    }

    #[test]
    fn a_bit_rate_cap_holds_the_live_video_to_it() {
        // Three seconds of noise: without a cap, crf 20 spends megabits a second on it.
        let cap = 400_000u64;
        let capped = video_packet_sizes(&live_noise(75, Some(cap)));
        let free = video_packet_sizes(&live_noise(75, None));
        assert_eq!((capped.len(), free.len()), (75, 75));
        let bytes = |p: &[u64]| p.iter().sum::<u64>();
        assert!(
            bytes(&free) > 4 * 3 * cap / 8,
            "uncapped noise took only {} bytes",
            bytes(&free)
        );
        // With the cap's one-second buffer, T seconds of video carry at most T + 1 seconds
        // at the cap, and the whole stream no more than the cap over it and its buffer.
        for (t, second) in capped.windows(25).enumerate() {
            assert!(
                bytes(second) <= 2 * cap / 8,
                "the second from frame {t}: {} bytes against a cap of {} a second",
                bytes(second),
                cap / 8
            );
        }
        assert!(
            bytes(&capped) <= (3 + 1) * cap / 8,
            "{} bytes in 3 s",
            bytes(&capped)
        );
        // x264 kept to it, not far under it: the quality below the cap is spent.
        assert!(bytes(&capped) >= 2 * cap / 8, "{} bytes", bytes(&capped));
    }

    #[test]
    fn speech_and_lips_stay_in_step_in_a_live_stream() {
        // Frames 0-49 dark and silent, 50-99 bright with a 1 kHz tone: the tone must start
        // at 2.000 s in the decoded stream, as the bright picture does.
        let mut s = EncoderSettings::new(64, 48, crate::media::audio::Fps::DEFAULT);
        s.preset = "ultrafast".into();
        let (mut enc, out) = collecting(s);
        for k in 0..100usize {
            let level = if k < 50 { 16 } else { 235 };
            let frame = crate::media::image::Frame::new(64, 48, vec![level; 64 * 48 * 3]);
            let audio: Vec<u8> = (0..640)
                .flat_map(|i| {
                    let t = (k * 640 + i) as f32 / 16_000.0;
                    let v = if k < 50 {
                        0.0
                    } else {
                        (t * 1000.0 * std::f32::consts::TAU).sin() * 12_000.0
                    };
                    (v as i16).to_le_bytes()
                })
                .collect();
            enc.write(&Yuv420::from_rgb(&frame), audio).unwrap();
        }
        enc.finish().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("live.mp4");
        std::fs::write(&path, &*out.lock().unwrap()).unwrap();
        let probe = std::process::Command::new(super::super::default_ffmpeg())
            .args(["-hide_banner", "-nostdin", "-i"])
            .arg(&path)
            .args([
                "-map",
                "0:a",
                "-af",
                "silencedetect=n=-20dB:d=0.3",
                "-f",
                "null",
                "-",
            ])
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&probe.stderr);
        let end: f64 = log
            .split("silence_end: ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no silence end in: {log}"));
        assert!((end - 2.0).abs() <= 0.005, "the tone starts at {end} s");
    }
}
