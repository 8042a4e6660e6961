//! A live session's engine side: speech arriving in pieces becomes utterances, each
//! utterance's frames go to the engine with deadlines as soon as their audio is there, and a
//! continuous video comes out at the session's frame rate, idle between utterances.
//!
//! - **Clock.** Frame `k` is due at `start + lag + k / fps`. `lag` covers the 212.5 ms of audio
//!   Wav2Lip needs after a frame's time (16 mel columns plus half an 800-sample window) and the
//!   time to draw it. Every frame goes out by its due time (within half a frame), drawn or
//!   held: idle frames when due (all at once when the session is behind, so it catches up
//!   without a gap in the frame numbers); a speaking frame as soon as its face is drawn, or,
//!   when the face has not come by then, *held*: the last drawn face shown again (a video
//!   avatar: that face on frame `k`'s own background). Its audio goes out with it either way,
//!   so sound is never dropped or delayed and frame `k` always carries the speech at `k / fps`.
//! - **Drawing rate.** A session draws every `fps / rate`-th speaking frame (fractional
//!   strides spread the drawn frames evenly) and holds the rest. The rate starts from what
//!   the engine can give the session ([`SessionConfig::draw_fps`]) and adapts to what happens,
//!   additive increase and multiplicative decrease, so that sessions sharing the engine
//!   converge to equal rates: each face in time adds about one face per second per second, a
//!   face that misses its frame takes 30 % off its session's rate, and off every other
//!   session's when the engine falls behind: when at least 5 % of the faces all the sessions
//!   asked for in a window of one `lag` missed (each session judges its own consecutive
//!   windows, whole; a rate is cut at most once per `lag`). One late face among many in time
//!   (a thread that ran late) slows only its own session: with many sessions such a miss
//!   somewhere is frequent, and every session slowing for each of them held half the frames
//!   of an engine far from full. The rate stays between one face per second and every
//!   frame, so the mouth keeps moving while the engine can draw anything at all, and is drawn
//!   within the session's fair share ([`SessionConfig::fair_share`], with
//!   [`FairShare::HEADROOM`]), which the server sets as sessions open and close and as the
//!   engine's measured capacity changes; a share that dips and rises again gives the rate
//!   back at once. Frames whose due time has passed before their audio is complete are held
//!   without being drawn, and a drawn frame that is held drops its queued work, so an
//!   overloaded engine does not keep drawing faces nobody will see.
//! - **Utterances.** Audio that arrives while idle starts an utterance at the next frame
//!   boundary (`ceil((arrival − start) · fps)`, or the next frame not yet sent, or the next
//!   whose audio has not gone out ahead). It ends at `end`, at `clear` (dropped, but for
//!   the frames whose audio has gone out), or after `utterance_gap` without audio.
//! - **Audio ahead.** A sink with an audio lead ([`Sink::audio_lead`], the fMP4 encoder's)
//!   gets the audio of the frames after those sent, up to the lead, as soon as it is final,
//!   so that its encoder never holds a frame back waiting for the audio of its time. Its frames follow the
//!   file rule ([`crate::media::audio::FramePlan`]): frame `j` uses mel columns
//!   `⌊j · 80 / fps⌋ ..+16` of the utterance's own spectrogram, and its last frames the
//!   windows the file rule gives for the end of its audio; like a file's video, it then has
//!   as many frames as cover all of its audio, those past the model's last one held. A column is computed once the audio
//!   around it is there, from a slice long enough that it equals the whole utterance's column,
//!   so the model inputs are those of `POST /v1/lipsync` on the same 16 kHz audio.
//! - **Idle face.** A photo avatar idles on the face the model draws for a silent mel window,
//!   computed once per session, so speech starts without a jump in the face's look.
//!   A video avatar idles on its raw frames (session frame `k` shows clip frame
//!   `loop_mode.select(k)`), and speech continues from the frame it has reached.
//!
//! Runs on its own OS thread; the server hands it client messages through a channel and
//! receives frames and events through a [`Sink`].

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rubato::{Fft, FixedSync, Resampler};

use super::avatar::Picture;
use super::front::{Engine, Submission};
use super::metrics as m;
use super::render::video_frames;
use super::restore::Restore;
use super::scheduler::{Drawn, FrameWork};
use super::{Avatar, Error};
use crate::media::audio::mel::{self, HOP, SAMPLE_RATE};
use crate::media::audio::{mel_spectrogram, Fps, FramePlan, MIN_SAMPLES, WINDOW};
use crate::media::face;
use crate::media::image::Frame;
use crate::media::jpeg;
use crate::media::yuv::Region;

/// Audio after a frame's time that the model needs to draw it: 16 mel columns of 200 samples
/// minus one, plus half of the 800-sample STFT window (= 212.5 ms at 16 kHz).
pub const AUDIO_LOOKAHEAD: Duration = Duration::from_micros(
    (((WINDOW - 1) * HOP + mel::N_FFT / 2) as u64 * 1_000_000) / SAMPLE_RATE as u64,
);

/// A frame's audio that has not come this long after the frame's time, in an utterance, is
/// taken as a pause, for a sink with an audio lead ([`Sink::audio_lead`]).
pub const LATE_AUDIO: Duration = Duration::from_millis(30);

/// How often a session waiting for faces looks for them.
const POLL: Duration = Duration::from_millis(2);

/// Sample encodings a client may send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleFormat {
    S16le,
    F32le,
}

impl std::str::FromStr for SampleFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "s16le" => Ok(SampleFormat::S16le),
            "f32le" => Ok(SampleFormat::F32le),
            _ => Err(format!("audio format {s:?}: use \"s16le\" or \"f32le\"")),
        }
    }
}

/// The raw audio a client streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AudioFormat {
    pub sample: SampleFormat,
    pub rate: u32,
    pub channels: u16,
}

impl AudioFormat {
    pub const MIN_RATE: u32 = 8_000;
    pub const MAX_RATE: u32 = 192_000;

    /// Checks the rate (8–192 kHz) and channels (1 or 2).
    pub fn new(sample: SampleFormat, rate: u32, channels: u16) -> Result<Self, String> {
        if !(Self::MIN_RATE..=Self::MAX_RATE).contains(&rate) {
            return Err(format!(
                "sample rate {rate}: use {}–{} Hz",
                Self::MIN_RATE,
                Self::MAX_RATE
            ));
        }
        if !(1..=2).contains(&channels) {
            return Err(format!("{channels} channels: use 1 or 2"));
        }
        Ok(AudioFormat {
            sample,
            rate,
            channels,
        })
    }

    fn bytes_per_frame(&self) -> usize {
        usize::from(self.channels)
            * match self.sample {
                SampleFormat::S16le => 2,
                SampleFormat::F32le => 4,
            }
    }
}

/// How a session runs.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    pub fps: Fps,
    pub audio: AudioFormat,
    /// An utterance ends after this long without audio.
    pub utterance_gap: Duration,
    /// Frame `k` is due at `start + lag + k / fps` (at least [`AUDIO_LOOKAHEAD`]).
    pub lag: Duration,
    /// Audio received but not yet drawn, at most (seconds).
    pub max_undrawn_seconds: f64,
    /// How a video avatar's frames run (frame `k` of the session shows clip frame
    /// `loop_mode.select(k)`, idle or speaking, so speech continues from the idle position).
    pub loop_mode: super::Loop,
    /// Faces per second the engine is expected to draw for this session (the rest are held);
    /// `None` or anything at or above `fps`: draw every frame to begin with.
    pub draw_fps: Option<f64>,
    /// The session's fair share of the engine as it changes while sessions open and close:
    /// its drawing rate stays within [`FairShare::HEADROOM`] of it, so a session that opened
    /// alone gives way when others join (`None`: no bound).
    pub fair_share: Option<Arc<FairShare>>,
    /// The enhancer run on every face drawn for the session (its idle face included).
    pub enhance: Option<super::enhance::EnhanceWith>,
}

/// A drawing rate (faces per second) one side sets and a session reads, as it changes.
#[derive(Debug)]
pub struct FairShare(std::sync::atomic::AtomicU64);

impl FairShare {
    /// How far above its share a session may draw while the engine keeps up.
    pub const HEADROOM: f64 = 1.25;

    pub fn new(rate: f64) -> FairShare {
        FairShare(std::sync::atomic::AtomicU64::new(rate.to_bits()))
    }

    pub fn set(&self, rate: f64) {
        self.0
            .store(rate.to_bits(), std::sync::atomic::Ordering::Relaxed);
    }

    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// What the client sent.
#[derive(Debug)]
pub enum Input {
    /// Raw audio bytes in the session's format, and when they arrived.
    Audio(Vec<u8>, Instant),
    /// Drop the audio not yet drawn; idle again.
    Clear,
    /// Draw everything sent, then stop.
    End,
}

/// Whether the avatar is speaking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activity {
    Idle,
    Speaking,
}

impl Activity {
    pub fn as_str(self) -> &'static str {
        match self {
            Activity::Idle => "idle",
            Activity::Speaking => "speaking",
        }
    }
}

/// One video frame going out.
pub struct OutFrame<'a> {
    pub index: u64,
    /// Presentation time, `index / fps` seconds.
    pub pts: f64,
    /// The frame's pixels: a video avatar's idle frame as the avatar stores it (see
    /// [`Picture`]), others decoded.
    pub picture: Picture<'a>,
    /// Where this frame can differ from the session's other frames: a photo avatar's face
    /// region (the rest is always the photo); `None` (a video avatar): anywhere. A sink that
    /// keeps a converted copy of the frame converts only this part again.
    pub region: Option<Region>,
    /// This frame's share of the session's audio (16 kHz mono; silence while idle), or
    /// nothing when it went out ahead of the frame through [`Sink::audio`]. Over a session
    /// the two give the session's audio, in order, once.
    pub audio: &'a [f32],
    /// The idle frame (the same image every time: sinks may cache its encoding).
    pub idle: bool,
}

/// What a session's scratch frame holds of a video avatar's frame it composed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Composed {
    /// The whole frame.
    Whole,
    /// The frame's pixels at this place (whole segments of the stored JPEG), a face drawn on
    /// them ([`Picture::Part`]).
    Part((u32, u32)),
    /// Nothing: the frame is its stored JPEG as it is.
    Stored,
}

/// Where a session's output goes (the server's WebSocket, a test).
pub trait Sink {
    /// The avatar starts speaking or goes idle at `frame`; `so_far` counts the frames sent
    /// before it.
    fn event(
        &mut self,
        activity: Activity,
        frame: u64,
        pts: f64,
        so_far: &SessionStats,
    ) -> Result<(), Error>;
    fn frame(&mut self, frame: OutFrame<'_>) -> Result<(), Error>;
    /// Whether this sink takes a video avatar's frames as stored ([`Picture::StoredJpeg`],
    /// [`Picture::Part`]): a JPEG output, which sends them or re-encodes only the segments a
    /// face changed, so the session decodes only those.
    fn takes_stored_jpeg(&self) -> bool {
        false
    }
    /// How far ahead of the frames this sink wants the session's audio (an encoder whose
    /// audio codec holds samples back before it gives out a packet, which the video would
    /// otherwise wait for). Whole frames' audio goes ahead through [`Sink::audio`] once it is
    /// final: all of it has come; or it is silence between utterances (a new utterance then
    /// starts after it); or it is a pause in an utterance that has lasted [`LATE_AUDIO`] past
    /// the frame's time (the silence goes out, and audio that comes later follows it).
    fn audio_lead(&self) -> Duration {
        Duration::ZERO
    }
    /// Audio of the frames after those sent, in order (only for a sink with a lead).
    fn audio(&mut self, _audio: &[f32]) -> Result<(), Error> {
        Ok(())
    }
    /// Called after each run of frames sent together (a batch drawn, or idle frames due):
    /// a sink that buffers sends what it has.
    fn flush(&mut self) -> Result<(), Error> {
        Ok(())
    }
    /// Frame `frame`, the first drawn one of an audio chunk that arrived at `arrived`, has
    /// been handed over (and flushed). Returns the chunk's latency in seconds when the frame
    /// has gone out now; a sink that sends later (after encoding) measures it itself, records
    /// [`m::STREAM_LATENCY`], and returns `None`.
    fn drawn(&mut self, _frame: u64, arrived: Instant) -> Option<f64> {
        Some(arrived.elapsed().as_secs_f64())
    }
}

/// What a session did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SessionStats {
    pub frames: u64,
    pub speaking_frames: u64,
    /// Speaking frames with a face drawn for them.
    pub drawn_frames: u64,
    /// Speaking frames that showed the last drawn face again (see the module documentation).
    pub held_frames: u64,
    /// Of the held frames, those whose face was asked for but was not back by the frame's
    /// time (the others were planned held: the session's drawing rate left them out).
    pub missed_frames: u64,
    /// Times the session lowered its drawing rate (a cut at the floor of one face a second,
    /// which changes nothing, is not counted): after a face of its own missed its frame, and
    /// when the other sessions' faces missed (`backoffs_for_others`; idle sessions too).
    pub backoffs: u64,
    pub backoffs_for_others: u64,
    pub idle_frames: u64,
    pub late_frames: u64,
    pub utterances: u64,
    pub interrupted: u64,
    /// Audio chunk arrival → its first drawn frame sent, milliseconds.
    pub latency_ms_p50: Option<f64>,
    pub latency_ms_p95: Option<f64>,
    /// Largest delay of a speaking frame past its due time, milliseconds.
    pub max_lateness_ms: f64,
    #[serde(skip)]
    pub latencies: Vec<f64>,
    #[serde(skip)]
    pub lateness: Vec<f64>,
}

fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    Some(sorted[i.min(sorted.len() - 1)])
}

impl SessionStats {
    /// Fills the percentiles from `latencies`.
    pub fn finish(&mut self) {
        let mut l = self.latencies.clone();
        l.sort_by(f64::total_cmp);
        self.latency_ms_p50 = percentile(&l, 0.5).map(|s| s * 1e3);
        self.latency_ms_p95 = percentile(&l, 0.95).map(|s| s * 1e3);
    }
}

/// The face the model draws for silence on `avatar`, 96×96 BGR (waits for the engine),
/// enhanced by `enhance` if given (restored on the avatar's first frame by a restorer).
pub fn idle_face(
    engine: &Engine,
    avatar: &Arc<Avatar>,
    enhance: Option<super::enhance::EnhanceWith>,
    wait: Duration,
) -> Result<Drawn, Error> {
    let restore = Restore::when(enhance.as_ref(), avatar, 0);
    let silence = mel_spectrogram(&vec![0.0; MIN_SAMPLES]);
    let work = FrameWork {
        index: 0,
        shown: 0,
        mel: silence.window(0, WINDOW),
        face: avatar.crop(0),
        enhance,
        restore,
        due: None,
    };
    let mut sub = engine.submit_realtime(vec![(work, Instant::now())]);
    let until = Instant::now() + wait;
    loop {
        if let Some(face) = sub.next_face(Duration::from_millis(50))? {
            return Ok(face);
        }
        if Instant::now() >= until {
            return Err(Error::Inference(
                "the idle face was not drawn in time".into(),
            ));
        }
    }
}

/// Streaming resampler to 16 kHz (10 ms blocks; its start-up delay trimmed).
struct StreamResampler {
    r: Fft<f32>,
    pending: Vec<f32>,
    to_trim: usize,
    fed: usize,
    produced: usize,
}

impl StreamResampler {
    fn new(rate: u32) -> Result<Self, Error> {
        let fail = |e: String| Error::Stream(format!("cannot resample {rate} Hz audio: {e}"));
        let g = gcd(rate as usize, SAMPLE_RATE as usize);
        let (block_in, block_out) = (rate as usize / g, SAMPLE_RATE as usize / g);
        let mut blocks = (rate as usize / 100).div_ceil(block_in).max(1);
        if blocks * block_out % 2 == 1 {
            blocks += 1;
        }
        let r = Fft::<f32>::new_custom(
            rate as usize,
            SAMPLE_RATE as usize,
            blocks * block_in,
            1,
            1,
            rubato::WindowFunction::BlackmanHarris2,
            FixedSync::Input,
        )
        .map_err(|e| fail(e.to_string()))?;
        Ok(StreamResampler {
            to_trim: r.output_delay(),
            r,
            pending: Vec::new(),
            fed: 0,
            produced: 0,
        })
    }

    fn run(&mut self, input: &[f32], partial: Option<usize>, out: &mut Vec<f32>) {
        use audioadapter_buffers::direct::InterleavedSlice;
        let need = self.r.input_frames_next();
        let mut block = input.to_vec();
        block.resize(need, 0.0);
        let Ok(adapter) = InterleavedSlice::new(&block[..], 1, need) else {
            return;
        };
        let indexing = rubato::Indexing {
            input_offset: 0,
            output_offset: 0,
            partial_len: partial,
            active_channels_mask: None,
        };
        if let Ok(res) = self.r.process(&adapter, Some(&indexing)) {
            let data = res.take_data();
            let skip = self.to_trim.min(data.len());
            self.to_trim -= skip;
            self.produced += data.len() - skip;
            out.extend_from_slice(&data[skip..]);
        }
    }

    fn push(&mut self, x: &[f32], out: &mut Vec<f32>) {
        self.pending.extend_from_slice(x);
        self.fed += x.len();
        loop {
            let need = self.r.input_frames_next();
            if self.pending.len() < need {
                break;
            }
            let block: Vec<f32> = self.pending.drain(..need).collect();
            self.run(&block, None, out);
        }
    }

    /// The rest, padded with silence, to `ceil(fed · 16000 / rate)` samples in all.
    fn finish(&mut self, rate: u32, out: &mut Vec<f32>) {
        let expected = (self.fed as u64 * u64::from(SAMPLE_RATE)).div_ceil(u64::from(rate));
        let pending = std::mem::take(&mut self.pending);
        let mut first = true;
        let mut guard = 0;
        while (self.produced as u64) < expected && guard < 64 {
            let partial = if first { pending.len() } else { 0 };
            let input = if first { &pending[..] } else { &[][..] };
            self.run(input, Some(partial), out);
            first = false;
            guard += 1;
        }
        let extra = self.produced as u64 - expected.min(self.produced as u64);
        out.truncate(out.len() - extra as usize);
        self.produced -= extra as usize;
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The mel window `start ..start + 16` of an utterance whose first `samples.len()` samples
/// are known: computed from a slice that starts three hops before the window (so the
/// pre-emphasis and the STFT frame see the same samples as the whole utterance's) and ends
/// where the last column's frame ends, or at the end of the audio (then its reflect padding is
/// the whole utterance's too).
pub fn mel_window(samples: &[f32], start: usize) -> Vec<f32> {
    let from = start.saturating_sub(3) * HOP;
    let to = samples
        .len()
        .min((start + WINDOW - 1) * HOP + mel::N_FFT / 2);
    let mel = mel_spectrogram(&samples[from..to]);
    mel.window(start - from / HOP, WINDOW)
}

/// [`mel_window`] of an utterance still coming, whose samples may end before the window's:
/// the rest is taken as silence.
fn open_mel_window(samples: &[f32], start: usize) -> Vec<f32> {
    let end = (start + WINDOW - 1) * HOP + mel::N_FFT / 2;
    if samples.len() >= end {
        return mel_window(samples, start);
    }
    let from = start.saturating_sub(3) * HOP;
    let mut padded = samples[from.min(samples.len())..].to_vec();
    padded.resize(end - from, 0.0);
    mel_spectrogram(&padded).window(start - from / HOP, WINDOW)
}

/// Mel columns of `n` samples that no later sample changes.
fn final_columns(n: usize) -> usize {
    let half = mel::N_FFT / 2;
    if n >= half {
        (n - half) / HOP + 1
    } else {
        0
    }
}

struct Utterance {
    /// Video frame of the utterance's frame 0.
    first: u64,
    /// 16 kHz mono.
    samples: Vec<f32>,
    resampler: Option<StreamResampler>,
    closed: bool,
    last_audio: Instant,
    /// Frames decided (drawn or held).
    planned: usize,
    /// All its frames, once closed.
    total: Option<usize>,
    /// Cut short by `clear`: `total` and `planned` stay as the cut left them.
    cut: bool,
    /// The frames handed to the engine, in order: `(utterance frame, its submission)`.
    draws: VecDeque<(usize, Submission)>,
    /// The next frame at or after which one is drawn.
    next_draw: f64,
    /// Frames sent.
    sent: usize,
    /// The face of frame `sent`, when it is drawn and has come.
    ready: Option<Drawn>,
    /// `(first 16 kHz sample, arrival)` of each audio chunk not yet in a drawn frame.
    arrivals: VecDeque<(usize, Instant)>,
}

impl Utterance {
    fn done(&self) -> bool {
        self.total == Some(self.sent)
    }

    /// Takes the face of frame `sent` into `ready` when it is drawn and has come. The
    /// submissions of frames already sent (held) are dropped, which cancels their queued work.
    fn pull(&mut self) -> Result<(), Error> {
        while self.draws.front().is_some_and(|(j, _)| *j < self.sent) {
            self.draws.pop_front();
        }
        if self.ready.is_none() {
            if let Some((j, sub)) = self.draws.front_mut() {
                if *j == self.sent {
                    if let Some(face) = sub.next_face(Duration::ZERO)? {
                        self.ready = Some(face);
                        self.draws.pop_front();
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether frame `sent` was handed to the engine (its face may still come).
    fn drawing_next(&self) -> bool {
        self.ready.is_some() || self.draws.front().is_some_and(|(j, _)| *j == self.sent)
    }
}

/// Faces that missed their frame and faces in time, counted across the live sessions that
/// share an engine: when enough of them miss, every session slows down (see
/// [`Stride::others_missed`]).
#[derive(Debug, Default)]
struct Tally {
    misses: std::sync::atomic::AtomicU64,
    hits: std::sync::atomic::AtomicU64,
}

impl Tally {
    const fn new() -> Tally {
        Tally {
            misses: std::sync::atomic::AtomicU64::new(0),
            hits: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// (misses, faces in time) so far.
    fn now(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.misses.load(Relaxed), self.hits.load(Relaxed))
    }

    fn hit(&self) {
        self.hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Counts a miss; the tally just after it.
    fn miss(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (
            self.misses.fetch_add(1, Relaxed) + 1,
            self.hits.load(Relaxed),
        )
    }
}

/// The tally of this process's live sessions (they share its engine).
static LIVE: Tally = Tally::new();

/// How fast a session draws (see the module documentation): a rate in faces per second,
/// additive increase, multiplicative decrease, so that sessions sharing an engine converge
/// to equal rates whatever rate each started from.
#[derive(Debug, Clone)]
struct Stride {
    /// Faces per second aimed at, from 1 to `fps`.
    rate: f64,
    fps: f64,
    last_missed: Option<Instant>,
    /// The tally shared with the other sessions ([`LIVE`]), and what it held when this
    /// session's current window (one `lag`, judged whole) began.
    tally: &'static Tally,
    seen: (u64, u64),
    window: Instant,
    /// The fair share the rate stays within [`FairShare::HEADROOM`] of.
    share: Option<Arc<FairShare>>,
}

impl Stride {
    /// Faces per second gained per second of faces in time.
    const GAIN_PER_SECOND: f64 = 1.0;
    /// A missed face multiplies the rate by this.
    const BACK_OFF: f64 = 0.7;
    /// Other sessions' misses slow this one when at least this share of the faces asked for
    /// across the sessions in a window of one `lag` missed: the engine is behind. Below it
    /// they are hiccups of the sessions that had them (which slow down themselves).
    const SHARED_MISS_SHARE: f64 = 0.05;

    fn new(fps: f64, draw_fps: Option<f64>, share: Option<Arc<FairShare>>) -> Stride {
        Stride::with_tally(fps, draw_fps, share, &LIVE, Instant::now())
    }

    /// A stride counting on `tally`, its first window beginning `now`.
    fn with_tally(
        fps: f64,
        draw_fps: Option<f64>,
        share: Option<Arc<FairShare>>,
        tally: &'static Tally,
        now: Instant,
    ) -> Stride {
        let fps = fps.max(1.0);
        Stride {
            rate: draw_fps.unwrap_or(fps).clamp(1.0, fps),
            fps,
            last_missed: None,
            tally,
            seen: tally.now(),
            window: now,
            share,
        }
    }

    /// The most the rate may be now: every frame, or within the headroom of the fair share.
    fn ceiling(&self) -> f64 {
        match &self.share {
            Some(s) => (s.get() * FairShare::HEADROOM).clamp(1.0, self.fps),
            None => self.fps,
        }
    }

    /// The rate drawn at: the session's own, within the ceiling as it is now. The ceiling
    /// does not lower the session's own rate: a share that dipped for a moment (the engine
    /// measured on a busy second) gives the session its rate back as soon as it rises again.
    fn drawing(&self) -> f64 {
        self.rate.min(self.ceiling())
    }

    /// Frames from one drawn frame to the next.
    fn value(&mut self) -> f64 {
        self.fps / self.drawing()
    }

    /// A face in time: about `GAIN_PER_SECOND` more faces/s per second at any rate (each of
    /// the `rate` faces a second adds its share), up to the ceiling. A rate above the ceiling
    /// (the share dipped under it) stays as it was, to be drawn at again when the share rises.
    fn hit(&mut self) {
        self.tally.hit();
        let ceiling = self.ceiling();
        if self.rate < ceiling {
            self.rate = (self.rate + Self::GAIN_PER_SECOND / self.rate).min(ceiling);
        }
    }

    /// A drawn frame missed its time: slower, unless the last miss was less than `lag` ago
    /// (the frames queued before then would miss for the same reason). Whether the rate
    /// fell (at the floor of one face a second it cannot).
    fn missed(&mut self, now: Instant, lag: Duration) -> bool {
        if self
            .last_missed
            .is_some_and(|t| now.saturating_duration_since(t) < lag)
        {
            return false;
        }
        // From the rate it was drawing at: above the ceiling, a cut would change nothing.
        let before = self.rate;
        self.rate = (self.drawing() * Self::BACK_OFF).max(1.0);
        self.last_missed = Some(now);
        self.rate < before
    }

    /// A drawn frame of this session missed its time: slower ([`Self::missed`]), and the
    /// other sessions are told ([`Self::others_missed`]). Whether it slowed.
    fn own_miss(&mut self, now: Instant, lag: Duration) -> bool {
        // It has cut its own rate: its next window starts after this miss (another session's
        // miss counted in between is in the window that ends here).
        self.seen = self.tally.miss();
        self.window = now;
        self.missed(now, lag)
    }

    /// Slower when other sessions' faces missed their frames since this session's window
    /// began, and were at least [`Self::SHARED_MISS_SHARE`] of the faces the sessions asked
    /// for meanwhile (missed and in time): the engine is behind. A
    /// session's frames only wait behind the other sessions' (its own are a stride apart), so
    /// the sessions that draw least would see most of the misses: backing off alone, they would
    /// slow down further while the others speed up. Backing off together, every session loses
    /// the same share of its rate and gains the same faces per second, so their rates converge.
    /// A window is judged whole, once a `lag` has passed since it began (a part of one would
    /// weigh one miss against the few faces of a few milliseconds); the next begins then. An
    /// engine that draws few faces a lag, overloaded, has every miss over the share: there
    /// all sessions slow together, as this argument needs; below the share only the sessions
    /// that missed slow. Whether the rate fell.
    fn others_missed(&mut self, now: Instant, lag: Duration) -> bool {
        if now.saturating_duration_since(self.window) < lag {
            return false;
        }
        let (misses, hits) = self.tally.now();
        let missed = misses.saturating_sub(self.seen.0) as f64;
        let in_time = hits.saturating_sub(self.seen.1) as f64;
        self.seen = (misses, hits);
        self.window = now;
        missed > 0.0
            && missed >= Self::SHARED_MISS_SHARE * (missed + in_time)
            && self.missed(now, lag)
    }
}

/// A running session (see the module documentation).
pub struct Session<'a> {
    engine: &'a Engine,
    avatar: Arc<Avatar>,
    face_input: Arc<Vec<u8>>,
    cfg: SessionConfig,
    idle_frame: Frame,
    /// Where a photo avatar's frames change ([`OutFrame::region`]).
    region: Option<Region>,
    /// Whether the session's faces are restored (they change more than the face box).
    restoring: bool,
    /// A video avatar: what `scratch` holds of the frame composed last.
    composed: Composed,
    start: Instant,
    /// Next frame to send.
    next: u64,
    shown: Option<Activity>,
    utts: VecDeque<Utterance>,
    carry: Vec<u8>,
    ending: bool,
    /// Frames whose audio has gone to the sink: `next` and, with an audio lead, up to
    /// `lead` frames more.
    audio_until: u64,
    /// [`Sink::audio_lead`] in frames.
    lead: u64,
    scratch: Frame,
    stats: SessionStats,
    /// A video avatar: idles on its raw frames, speaks on the frame it is at.
    clip: bool,
    /// Blend masks of clip boxes whose size differs from the first frame's.
    masks: super::avatar::BlendMasks,
    /// Which speaking frames are drawn.
    stride: Stride,
    /// The last face drawn, shown again on held frames of a video avatar (a photo avatar's
    /// held frames repeat `scratch`, which holds it composited).
    last_face: Option<Drawn>,
}

impl<'a> Session<'a> {
    /// A session whose frame 0 is due at `start + cfg.lag`; `idle_face` from [`idle_face`]
    /// (unused for a video avatar, which idles on its own frames).
    pub fn new(
        engine: &'a Engine,
        avatar: Arc<Avatar>,
        idle_face: &Drawn,
        cfg: SessionConfig,
        start: Instant,
    ) -> Self {
        let clip = avatar.clip.is_some();
        let mut idle_frame = avatar.frame.clone();
        if !clip {
            avatar.draw_at(
                &mut idle_frame,
                (0, 0),
                0,
                idle_face,
                &mut Default::default(),
            );
        }
        let restoring = cfg.enhance.as_ref().is_some_and(|e| e.restores());
        Session {
            stride: Stride::new(cfg.fps.value(), cfg.draw_fps, cfg.fair_share.clone()),
            last_face: None,
            clip,
            masks: Default::default(),
            engine,
            face_input: avatar.crop(0),
            scratch: idle_frame.clone(),
            idle_frame,
            region: (!clip).then(|| avatar.drawn_region(0, restoring)),
            restoring,
            composed: Composed::Whole,
            avatar,
            cfg,
            start,
            next: 0,
            shown: None,
            utts: VecDeque::new(),
            carry: Vec::new(),
            ending: false,
            audio_until: 0,
            lead: 0,
            stats: SessionStats::default(),
        }
    }

    fn fps(&self) -> f64 {
        self.cfg.fps.value()
    }

    fn due(&self, k: u64) -> Instant {
        self.start + self.cfg.lag + Duration::from_secs_f64(k as f64 / self.fps())
    }

    /// When frame `k` is drawn at the latest, with the rest of its window silent if that has
    /// not come: half a frame after its window would have come in real time (audio a little
    /// late is still heard), which leaves the face the lag's time for a batch and half a
    /// frame, and [`Self::grace`] after its due time.
    fn draw_by(&self, k: u64) -> Instant {
        let late = Duration::from_secs_f64(0.5 / self.fps());
        self.due(k) + late - self.cfg.lag.saturating_sub(AUDIO_LOOKAHEAD)
    }

    /// Whether all of utterance frame `j`'s own audio has come (a frame never goes out with
    /// part of its speech).
    fn heard(&self, u: &Utterance, j: usize) -> bool {
        let end = self.sample_at(u.first + j as u64 + 1) - self.sample_at(u.first);
        end as usize <= u.samples.len()
    }

    /// How long after its due time a drawn face may still come before its frame is held.
    fn grace(&self) -> Duration {
        Duration::from_secs_f64(0.5 / self.fps())
    }

    fn pts(&self, k: u64) -> f64 {
        self.cfg.fps.seconds(k as usize)
    }

    /// First 16 kHz sample of frame `k` on the session's timeline.
    fn sample_at(&self, k: u64) -> u64 {
        let (num, den) = self.cfg.fps.ratio();
        k * u64::from(SAMPLE_RATE) * u64::from(den) / u64::from(num)
    }

    /// Runs until `end` has been drawn (then returns the stats) or the client goes away.
    pub fn run(
        mut self,
        inputs: &Receiver<Input>,
        sink: &mut dyn Sink,
    ) -> Result<SessionStats, Error> {
        self.lead = (sink.audio_lead().as_secs_f64() * self.fps()).ceil() as u64;
        loop {
            let wait = self.wait_time();
            match inputs.recv_timeout(wait) {
                Ok(input) => {
                    self.input(input)?;
                    while let Ok(input) = inputs.try_recv() {
                        self.input(input)?;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    if !self.ending {
                        return Err(Error::Cancelled);
                    }
                    // Nothing more will come: only the clock and the faces matter.
                    std::thread::sleep(wait);
                }
            }
            self.close_quiet_utterances();
            self.plan()?;
            self.emit(sink)?;
            self.send_audio_ahead(sink)?;
            if self.ending && self.utts.is_empty() {
                if self.shown != Some(Activity::Idle) {
                    self.send_idle(sink)?;
                    sink.flush()?;
                }
                self.stats.finish();
                return Ok(self.stats);
            }
        }
    }

    fn wait_time(&self) -> Duration {
        if self.utts.iter().any(|u| !u.draws.is_empty()) {
            return POLL;
        }
        let now = Instant::now();
        let speaking = self.utts.front().is_some_and(|u| self.next >= u.first);
        let mut until = self.due(self.next)
            + if speaking {
                self.grace()
            } else {
                Duration::ZERO
            };
        // A pause in an utterance whose audio would go ahead.
        let ahead = self.audio_until;
        if ahead < self.next + self.lead
            && self
                .utts
                .iter()
                .rev()
                .find(|u| u.first <= ahead)
                .is_some_and(|u| !u.closed)
        {
            until = until.min(self.audio_late_at(ahead));
        }
        for u in &self.utts {
            if !u.closed {
                until = until.min(u.last_audio + self.cfg.utterance_gap);
                if self.heard(u, u.planned) {
                    until = until.min(self.draw_by(u.first + u.planned as u64));
                }
            }
        }
        until
            .saturating_duration_since(now)
            .clamp(Duration::from_millis(1), POLL * 25)
    }

    fn input(&mut self, input: Input) -> Result<(), Error> {
        match input {
            Input::Audio(bytes, arrived) if !self.ending => self.audio(&bytes, arrived)?,
            Input::Audio(..) => {}
            Input::Clear => {
                if !self.utts.is_empty() {
                    self.stats.interrupted += 1;
                }
                // Speech ends where the audio that went out ends: the frames sent, and those
                // whose audio went ahead of them (an audio lead), which keep their faces so
                // that lips and sound stay together. Dropping the submissions of the rest
                // cancels their queued frames.
                let until = self.audio_until;
                self.utts.retain(|u| u.first < until);
                let starts: Vec<(usize, usize)> = self
                    .utts
                    .iter()
                    .map(|u| {
                        let frames = (until - u.first) as usize;
                        let samples = self.sample_at(until) - self.sample_at(u.first);
                        (frames, samples as usize)
                    })
                    .collect();
                for (u, (frames, samples)) in self.utts.iter_mut().zip(starts) {
                    cut(u, frames, samples);
                }
                self.carry.clear();
            }
            Input::End => {
                self.ending = true;
                if let Some(u) = self.utts.back_mut() {
                    if !u.closed {
                        close(u, self.cfg.audio.rate);
                    }
                }
            }
        }
        Ok(())
    }

    fn audio(&mut self, bytes: &[u8], arrived: Instant) -> Result<(), Error> {
        let fmt = self.cfg.audio;
        self.carry.extend_from_slice(bytes);
        let frame_bytes = fmt.bytes_per_frame();
        let whole = self.carry.len() / frame_bytes * frame_bytes;
        if whole == 0 {
            return Ok(());
        }
        let raw: Vec<u8> = self.carry.drain(..whole).collect();
        let channels = usize::from(fmt.channels);
        let values: Vec<f32> = match fmt.sample {
            SampleFormat::S16le => raw
                .chunks_exact(2)
                .map(|c| f32::from(i16::from_le_bytes([c[0], c[1]])) / 32_768.0)
                .collect(),
            SampleFormat::F32le => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        };
        if values.iter().any(|v| !v.is_finite()) {
            return Err(Error::Stream(
                "the audio holds NaN or infinite samples".into(),
            ));
        }
        let mono: Vec<f32> = if channels == 1 {
            values
        } else {
            let inv = 1.0 / channels as f32;
            values
                .chunks_exact(channels)
                .map(|f| f.iter().sum::<f32>() * inv)
                .collect()
        };
        // Audio while idle (or after the last utterance closed) starts a new utterance.
        if self.utts.back().is_none_or(|u| u.closed) {
            let t = arrived.saturating_duration_since(self.start).as_secs_f64();
            // Not before audio that went out ahead of its frames as silence.
            let mut first = ((t * self.fps()).ceil() as u64)
                .max(self.next)
                .max(self.audio_until);
            if let Some(prev) = self.utts.back() {
                first = first.max(prev.first + prev.total.unwrap_or(0) as u64);
            }
            let resampler = if fmt.rate == SAMPLE_RATE {
                None
            } else {
                Some(StreamResampler::new(fmt.rate)?)
            };
            self.utts.push_back(Utterance {
                first,
                samples: Vec::new(),
                resampler,
                closed: false,
                last_audio: arrived,
                planned: 0,
                total: None,
                cut: false,
                draws: VecDeque::new(),
                next_draw: 0.0,
                sent: 0,
                ready: None,
                arrivals: VecDeque::new(),
            });
            self.stats.utterances += 1;
        }
        // Silence that went out ahead of the frames in a pause of this utterance stays in it:
        // this audio follows it.
        let (rate, first) = (fmt.rate, self.utts.back().expect("an utterance").first);
        let gone = (self.sample_at(self.audio_until.max(first)) - self.sample_at(first)) as usize;
        let u = self.utts.back_mut().expect("an open utterance");
        if u.samples.len() < gone {
            flush_resampler(u, rate)?;
            let len = u.samples.len().max(gone);
            u.samples.resize(len, 0.0);
        }
        u.last_audio = arrived;
        let at = u.samples.len();
        match &mut u.resampler {
            None => u.samples.extend_from_slice(&mono),
            Some(r) => r.push(&mono, &mut u.samples),
        }
        u.arrivals.push_back((at, arrived));
        // Undrawn audio is bounded.
        let per_frame = f64::from(SAMPLE_RATE) / self.fps();
        let undrawn: f64 = self
            .utts
            .iter()
            .map(|u| (u.samples.len() as f64 - u.sent as f64 * per_frame).max(0.0))
            .sum();
        if undrawn > self.cfg.max_undrawn_seconds * f64::from(SAMPLE_RATE) {
            return Err(Error::Stream(format!(
                "more than {} s of audio is waiting to be drawn: send it no faster than real \
                 time",
                self.cfg.max_undrawn_seconds
            )));
        }
        Ok(())
    }

    fn close_quiet_utterances(&mut self) {
        let now = Instant::now();
        let gap = self.cfg.utterance_gap;
        let rate = self.cfg.audio.rate;
        for u in self.utts.iter_mut() {
            if !u.closed && now.saturating_duration_since(u.last_audio) >= gap {
                close(u, rate);
            }
        }
    }

    /// Decides, for every frame whose audio is complete, whether it is drawn (handed to the
    /// engine, one submission per frame so that a frame held later can drop its work) or held.
    fn plan(&mut self) -> Result<(), Error> {
        let step = mel::MEL_FPS / self.fps();
        let now = Instant::now();
        if self.stride.others_missed(now, self.cfg.lag) {
            self.stats.backoffs += 1;
            self.stats.backoffs_for_others += 1;
        }
        for i in 0..self.utts.len() {
            let u = &self.utts[i];
            let (total, plan) = if u.cut {
                // Its frames not yet decided are drawn from the audio that went out, then
                // silence: what the client hears.
                (u.total.unwrap_or(u.planned), None)
            } else if u.closed {
                let cols = 1 + u.samples.len() / HOP;
                let plan = FramePlan::new(cols, self.cfg.fps)?;
                // As a file: the frames that cover all of its audio, those past the model's
                // last one holding its face (so no speech is cut).
                // Frames already drawn while it was open stay its frames.
                let seconds = u.samples.len() as f64 / f64::from(SAMPLE_RATE);
                let frames = video_frames(seconds, self.cfg.fps, plan.len()).max(u.planned);
                (frames, Some(plan))
            } else {
                let cols = final_columns(u.samples.len());
                let mut n = u.planned;
                // (Below 5 fps a frame's window can be final before all of its own audio has
                // come: a frame never goes out with part of its speech.)
                while ((n as f64 * step) as usize) + WINDOW <= cols && self.heard(u, n) {
                    n += 1;
                }
                // A frame whose own audio has come but not all of its window's (the speech
                // paused or ended; the utterance closes only after the gap) is drawn when its
                // time to be drawn comes, the rest of its window silent: waiting for the
                // close would show the utterance's last frames late, with the mouth frozen.
                while self.heard(u, n) && now >= self.draw_by(u.first + n as u64) {
                    n += 1;
                }
                (n, None)
            };
            if u.closed {
                self.utts[i].total = Some(total);
            }
            let u = &self.utts[i];
            if total <= u.planned {
                continue;
            }
            let (first, from) = (u.first, u.planned);
            let mut next_draw = u.next_draw;
            let mut draws = Vec::new();
            for j in from..total {
                let due = self.due(first + j as u64);
                // Held: between drawn frames, past the model's last frame, or due already (its
                // face could only be late).
                let beyond = plan.as_ref().is_some_and(|p| j >= p.len());
                if (j as f64) < next_draw || beyond || now >= due {
                    continue;
                }
                next_draw = j as f64 + self.stride.value();
                let u = &self.utts[i];
                let mel = match &plan {
                    Some(p) => mel_window(&u.samples, p.start(j)),
                    None => open_mel_window(&u.samples, (j as f64 * step) as usize),
                };
                let c = self
                    .avatar
                    .select((first + j as u64) as usize, self.cfg.loop_mode);
                let face = if self.clip {
                    self.avatar.crop(c)
                } else {
                    self.face_input.clone()
                };
                let work = FrameWork {
                    index: 0,
                    shown: (first + j as u64) as usize,
                    mel,
                    face,
                    enhance: self.cfg.enhance.clone(),
                    restore: Restore::when(self.cfg.enhance.as_ref(), &self.avatar, c),
                    due: None,
                };
                draws.push((j, self.engine.submit_realtime(vec![(work, due)])));
            }
            let u = &mut self.utts[i];
            u.draws.extend(draws);
            u.next_draw = next_draw;
            u.planned = total;
        }
        Ok(())
    }

    /// The utterance that frame `k` is in (`None`: silence).
    fn utterance_at(&self, k: u64) -> Option<&Utterance> {
        let u = self.utts.iter().rev().find(|u| u.first <= k)?;
        let j = (k - u.first) as usize;
        u.total.is_none_or(|t| j < t).then_some(u)
    }

    /// Appends frame `k`'s share of the session's audio to `out`.
    fn audio_of(&self, k: u64, out: &mut Vec<f32>) {
        let len = (self.sample_at(k + 1) - self.sample_at(k)) as usize;
        let at = out.len();
        if let Some(u) = self.utterance_at(k) {
            let from = (self.sample_at(k) - self.sample_at(u.first)) as usize;
            let to = (from + len).min(u.samples.len());
            out.extend_from_slice(u.samples.get(from..to).unwrap_or(&[]));
        }
        out.resize(at + len, 0.0);
    }

    /// When frame `k`'s audio, not come, counts as a pause ([`LATE_AUDIO`] after its time).
    fn audio_late_at(&self, k: u64) -> Instant {
        self.start + Duration::from_secs_f64(self.pts(k + 1)) + LATE_AUDIO
    }

    /// Whether frame `k`'s audio can no longer change (see [`Sink::audio_lead`]). A pause
    /// first takes out what the utterance's resampler holds, which comes before it.
    fn settle(&mut self, k: u64, now: Instant) -> Result<bool, Error> {
        // Ending: nothing goes ahead past the last utterance (the last frame carries its own
        // audio, so the audio does not run on past the video).
        let past_last = |u: &Utterance| u.total.is_some_and(|t| k >= u.first + t as u64);
        if self.ending && self.utts.back().is_none_or(past_last) {
            return Ok(false);
        }
        let Some(i) = self.utts.iter().rposition(|u| u.first <= k) else {
            return Ok(true);
        };
        let u = &self.utts[i];
        if u.closed {
            return Ok(u.total.is_some());
        }
        if self.heard(u, (k - u.first) as usize) {
            return Ok(true);
        }
        if now < self.audio_late_at(k) {
            return Ok(false);
        }
        flush_resampler(&mut self.utts[i], self.cfg.audio.rate)?;
        Ok(true)
    }

    /// Frame `k`'s own audio, unless it went out ahead of it ([`OutFrame::audio`]).
    fn audio_out(&mut self, k: u64) -> Vec<f32> {
        let mut out = Vec::new();
        while self.audio_until <= k {
            self.audio_of(self.audio_until, &mut out);
            self.audio_until += 1;
        }
        out
    }

    /// Hands the sink the audio of the frames after those sent, up to its lead, as far as
    /// that audio is final.
    fn send_audio_ahead(&mut self, sink: &mut dyn Sink) -> Result<(), Error> {
        let now = Instant::now();
        let mut out = Vec::new();
        while self.audio_until < self.next + self.lead && self.settle(self.audio_until, now)? {
            self.audio_of(self.audio_until, &mut out);
            self.audio_until += 1;
        }
        if out.is_empty() {
            Ok(())
        } else {
            sink.audio(&out)
        }
    }

    fn send_idle(&mut self, sink: &mut dyn Sink) -> Result<(), Error> {
        let k = self.next;
        if self.shown != Some(Activity::Idle) {
            sink.event(Activity::Idle, k, self.pts(k), &self.stats)?;
            self.shown = Some(Activity::Idle);
        }
        let audio = self.audio_out(k);
        let picture = if self.clip {
            self.avatar
                .picture(self.avatar.select(k as usize, self.cfg.loop_mode))
        } else {
            Picture::Image(&self.idle_frame)
        };
        sink.frame(OutFrame {
            index: k,
            pts: self.pts(k),
            picture,
            region: self.region,
            audio: &audio,
            idle: !self.clip,
        })?;
        self.stats.frames += 1;
        self.stats.idle_frames += 1;
        self.next += 1;
        Ok(())
    }

    /// Sends every frame that is due or drawn, in order: a speaking frame drawn as soon as
    /// its face has come, held at its due time (plus [`Self::grace`]) when it has not.
    fn emit(&mut self, sink: &mut dyn Sink) -> Result<(), Error> {
        let mut sent_any = false;
        let mut sent_speaking: Vec<(u64, Instant)> = Vec::new();
        loop {
            let k = self.next;
            // An utterance whose frames all went out before it closed ends with its close.
            if self.utts.front().is_some_and(Utterance::done) {
                self.utts.pop_front();
            }
            let speaking_now = match self.utts.front_mut() {
                Some(u) => {
                    u.pull()?;
                    k >= u.first
                }
                None => false,
            };
            if !speaking_now {
                // An idle frame: when due, or at once when a drawn face waits behind it.
                let face_waiting = self.utts.front().is_some_and(|u| u.ready.is_some());
                if Instant::now() >= self.due(k) || face_waiting {
                    self.send_idle(sink)?;
                    sent_any = true;
                    continue;
                }
                break;
            }
            let (first, j, planned, drawing) = {
                let u = self.utts.front().expect("speaking");
                (u.first, (k - u.first) as usize, u.planned, u.drawing_next())
            };
            // Its audio must be complete (a frame never goes out with part of its speech).
            if j >= planned {
                break;
            }
            let face = self.utts.front_mut().and_then(|u| u.ready.take());
            let now = Instant::now();
            if face.is_none() {
                if now < self.due(k) + self.grace() {
                    break;
                }
                if drawing {
                    self.stats.missed_frames += 1;
                    if self.stride.own_miss(now, self.cfg.lag) {
                        self.stats.backoffs += 1;
                    }
                }
            }
            if j == 0 || self.shown != Some(Activity::Speaking) {
                sink.event(Activity::Speaking, k, self.pts(k), &self.stats)?;
                self.shown = Some(Activity::Speaking);
            }
            let drawn = face.is_some();
            let in_parts = sink.takes_stored_jpeg();
            if let Some(face) = face {
                self.compose(k, Some(&face), in_parts)?;
                self.last_face = Some(face);
            } else if self.clip {
                let last = self.last_face.take();
                let r = self.compose(k, last.as_ref(), in_parts);
                self.last_face = last;
                r?;
            }
            // A photo avatar's held frame repeats `scratch` as it is: the last face drawn,
            // or the idle face before any.
            let audio = self.audio_out(k);
            let image = std::mem::replace(&mut self.scratch, Frame::new(0, 0, Vec::new()));
            let stored = if self.clip {
                self.avatar
                    .stored_jpeg(self.avatar.select(k as usize, self.cfg.loop_mode))
            } else {
                None
            };
            let picture = match (self.composed, stored) {
                (Composed::Part(at), Some(stored)) => Picture::Part {
                    part: &image,
                    at,
                    stored,
                },
                (Composed::Stored, Some(stored)) => Picture::StoredJpeg(stored),
                _ => Picture::Image(&image),
            };
            let r = sink.frame(OutFrame {
                index: k,
                pts: self.pts(k),
                picture,
                region: self.region,
                audio: &audio,
                idle: false,
            });
            self.scratch = image;
            r?;
            let now = Instant::now();
            let lateness = now.saturating_duration_since(self.due(k)).as_secs_f64();
            self.stats.lateness.push(lateness);
            self.stats.max_lateness_ms = self.stats.max_lateness_ms.max(lateness * 1e3);
            // Late: out more than a frame after its due time (a held frame goes out within
            // half a frame of it).
            if lateness > 1.0 / self.fps() {
                self.stats.late_frames += 1;
                metrics::counter!(m::STREAM_LATE_FRAMES).increment(1);
            }
            self.stats.frames += 1;
            self.stats.speaking_frames += 1;
            if drawn {
                self.stats.drawn_frames += 1;
                self.stride.hit();
            } else {
                self.stats.held_frames += 1;
                metrics::counter!(m::STREAM_HELD_FRAMES).increment(1);
            }
            self.next += 1;
            sent_any = true;
            let end_sample = (self.sample_at(k + 1) - self.sample_at(first)) as usize;
            let u = self.utts.front_mut().expect("speaking");
            u.sent = j + 1;
            // Audio chunks whose first sample is in this frame or before: this is their first
            // drawn frame (held frames leave them to the next drawn one).
            if drawn {
                while u.arrivals.front().is_some_and(|(s, _)| *s < end_sample) {
                    let (_, at) = u.arrivals.pop_front().expect("checked");
                    sent_speaking.push((k, at));
                }
            }
            if u.done() {
                self.utts.pop_front();
            }
        }
        if sent_any {
            sink.flush()?;
            for (k, at) in sent_speaking {
                if let Some(l) = sink.drawn(k, at) {
                    self.stats.latencies.push(l);
                    metrics::histogram!(m::STREAM_LATENCY).record(l);
                }
            }
        }
        Ok(())
    }

    /// Composites frame `k` into `scratch`: `face` pasted on the avatar's frame, or its
    /// restored region written there (a video avatar: on clip frame `k`'s background; with
    /// no face, the background alone).
    /// `in_parts`: the sink takes stored frames ([`Sink::takes_stored_jpeg`]), so a video
    /// avatar's frame is decoded and drawn only in the segments its face changes.
    fn compose(&mut self, k: u64, face: Option<&Drawn>, in_parts: bool) -> Result<(), Error> {
        if self.clip {
            let a = self.avatar.clone();
            let i = a.select(k as usize, self.cfg.loop_mode);
            // In parts: only the stored frame's segments that the face changes are decoded.
            let segments = a
                .stored_jpeg(i)
                .filter(|_| in_parts)
                .and_then(jpeg::Segments::parse);
            self.composed = Composed::Whole;
            let Some(face) = face else {
                if segments.is_some() {
                    self.composed = Composed::Stored;
                } else {
                    self.scratch = a.background(i)?.into_owned();
                }
                return Ok(());
            };
            match segments {
                Some(segments) => {
                    let mut r = if self.restoring {
                        a.drawn_region(i, true)
                    } else {
                        a.face_region(i, &mut self.masks)
                    };
                    // A face restored on this frame writes its own region, which the
                    // avatar's landmarks, if found since (by another session), may not hold.
                    if let Some(p) = face.restored.as_ref().filter(|p| p.frame == i) {
                        r = r.union(&p.region);
                    }
                    let (part, at) = segments.decode_region(&r)?;
                    self.scratch = part;
                    a.draw_at(&mut self.scratch, at, i, face, &mut self.masks);
                    self.composed = Composed::Part(at);
                }
                None => {
                    self.scratch = a.background(i)?.into_owned();
                    a.draw_at(&mut self.scratch, (0, 0), i, face, &mut self.masks);
                }
            }
        } else if let Some(Drawn {
            restored: Some(patch),
            ..
        }) = face
        {
            // The patch covers everything a drawn frame changes (`self.region`).
            patch.write_into(&mut self.scratch, (0, 0));
        } else if let Some(Drawn { face, .. }) = face {
            // Only the face box changes: the rest of `scratch` is the photo already.
            let b = &self.avatar.face;
            let stride = self.scratch.width as usize * 3;
            for y in b.y1 as usize..b.y2 as usize {
                let row = y * stride + b.x1 as usize * 3..y * stride + b.x2 as usize * 3;
                self.scratch.rgb[row.clone()].copy_from_slice(&self.avatar.frame.rgb[row]);
            }
            face::paste(
                &mut self.scratch,
                &self.avatar.face,
                face,
                &self.avatar.mask,
            );
        }
        Ok(())
    }
}

/// `clear`: `u` ends after its first `frames` frames (`samples` of its audio), whatever it
/// has drawn or been sent beyond them.
fn cut(u: &mut Utterance, frames: usize, samples: usize) {
    let frames = u.total.map_or(frames, |t| t.min(frames));
    u.samples.truncate(samples);
    u.resampler = None;
    u.closed = true;
    u.cut = true;
    u.total = Some(frames);
    u.planned = u.planned.min(frames);
    u.draws.retain(|(j, _)| *j < frames);
    u.arrivals.retain(|(s, _)| *s < samples);
    if u.sent >= frames {
        u.ready = None;
    }
}

/// Everything `u`'s resampler holds into its samples (the resampler starts again).
fn flush_resampler(u: &mut Utterance, rate: u32) -> Result<(), Error> {
    if let Some(r) = &mut u.resampler {
        r.finish(rate, &mut u.samples);
        *r = StreamResampler::new(rate)?;
    }
    Ok(())
}

/// No more audio for `u`: the rest of its resampled audio, and at least one mel window.
fn close(u: &mut Utterance, rate: u32) {
    if let Some(r) = &mut u.resampler {
        r.finish(rate, &mut u.samples);
    }
    if u.samples.len() < MIN_SAMPLES {
        u.samples.resize(MIN_SAMPLES, 0.0);
    }
    u.closed = true;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn speech(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 * 0.013).sin() * 0.3 + (i as f32 * 0.0021).cos() * 0.2)
            .collect()
    }

    #[test]
    fn windows_from_a_growing_utterance_equal_the_whole_utterances() {
        let x = speech(16_000);
        let whole = mel_spectrogram(&x);
        let plan = FramePlan::new(whole.frames(), Fps::DEFAULT).unwrap();
        let step = mel::MEL_FPS / 25.0;
        for j in 0..plan.len() {
            let start = plan.start(j);
            let want = whole.window(start, WINDOW);
            // The shortest prefix that makes this window final (or all of it at the end).
            let open = (j as f64 * step) as usize == start;
            let n = if open && start + WINDOW <= final_columns(x.len()) {
                (start + WINDOW - 1) * HOP + mel::N_FFT / 2
            } else {
                x.len()
            };
            assert!(start + WINDOW <= final_columns(n) || n == x.len());
            assert_eq!(mel_window(&x[..n], start), want, "frame {j}");
        }
    }

    #[test]
    fn an_open_utterances_frame_drawn_before_its_window_came_hears_silence_after_its_audio() {
        let x = speech(16_000);
        for (n, start) in [(8_000, 30), (12_345, 50), (3_000, 2), (16_000, 40)] {
            let mut silent = x[..n].to_vec();
            silent.resize(n + 16_000, 0.0);
            assert_eq!(
                open_mel_window(&x[..n], start),
                mel_window(&silent, start),
                "{n} samples, window at {start}"
            );
        }
        // With the whole window there, it is the plain window.
        assert_eq!(open_mel_window(&x, 10), mel_window(&x, 10));
    }

    #[test]
    fn a_miss_in_one_session_slows_every_session_and_they_converge() {
        let lag = Duration::from_millis(500);
        let t = Instant::now();
        // Their own tally: other tests' sessions do not count.
        let tally: &'static Tally = Box::leak(Box::default());
        let mut a = Stride::with_tally(25.0, Some(8.0), None, tally, t);
        let mut b = Stride::with_tally(25.0, Some(2.0), None, tally, t);
        assert!(!b.others_missed(t + lag, lag));
        assert_eq!(b.rate, 2.0, "no miss yet");
        // a misses (an engine drawing a few faces a second: every miss is over the share):
        // a slows at once, b when its window ends, once however many misses it holds; each
        // says when it slowed (the sessions' `backoffs`).
        let t1 = t + lag + Duration::from_millis(10);
        assert!(a.own_miss(t1, lag));
        assert!(
            !a.own_miss(t1, lag),
            "a second miss within the lag slows nothing"
        );
        assert!((a.rate - 5.6).abs() < 1e-9, "{a:?}");
        assert!(!b.others_missed(t1, lag), "b's window is not over yet");
        assert!(b.others_missed(t + 2 * lag, lag));
        assert!(
            !b.others_missed(t + 3 * lag, lag),
            "a window without misses"
        );
        assert!((b.rate - 1.4).abs() < 1e-9, "{b:?}");
        // Each second, each draws its rate's faces in time (about one face/s more for each),
        // then a miss takes the same share off both: their rates meet (at 0.7 / 0.3 faces/s,
        // where a second's gain and a cut balance).
        let mut now = t + 3 * lag;
        for _ in 0..8 {
            now += Duration::from_secs(1);
            for s in [&mut a, &mut b] {
                for _ in 0..s.rate.round() as usize {
                    s.hit();
                }
            }
            assert!(a.own_miss(now, lag));
            assert!(b.others_missed(now + lag, lag), "{a:?} {b:?}");
        }
        assert!((a.rate / b.rate - 1.0).abs() < 0.3, "{a:?} {b:?}");
    }

    #[test]
    fn a_miss_among_many_faces_in_time_slows_only_its_own_session() {
        let lag = Duration::from_millis(250);
        let t = Instant::now();
        let tally: &'static Tally = Box::leak(Box::default());
        let mut s: Vec<Stride> = (0..64)
            .map(|_| Stride::with_tally(25.0, Some(25.0), None, tally, t))
            .collect();
        let draw = |s: &mut [Stride], each: usize| {
            for x in s.iter_mut() {
                for _ in 0..each {
                    x.hit();
                }
            }
        };
        // In one lag every session draws 10 faces in time (640 in all) and one face misses:
        // that session slows down at once, the 63 others do not when their window ends.
        draw(&mut s, 10);
        let t1 = t + Duration::from_millis(100);
        assert!(s[0].own_miss(t1, lag));
        assert!((s[0].rate - 17.5).abs() < 1e-9, "{:?}", s[0]);
        for x in &mut s[1..] {
            assert!(!x.others_missed(t1, lag), "the window is not over");
            assert!(!x.others_missed(t + lag, lag), "1 of 641");
            assert_eq!(x.rate, 25.0);
        }
        // A window is judged whole: one miss just after a window began, with only a few faces
        // counted yet, slows no one; the whole window's 640 faces weigh it.
        let t2 = t + lag + Duration::from_millis(5);
        draw(&mut s[..2], 1);
        s[0].own_miss(t2, lag);
        for x in &mut s[1..] {
            assert!(!x.others_missed(t2, lag), "2 faces so far: not judged");
        }
        draw(&mut s[1..], 10);
        for x in &mut s[1..] {
            assert!(!x.others_missed(t + 2 * lag, lag), "1 of 633");
            assert_eq!(x.rate, 25.0);
        }
        // The engine falls behind: 40 misses against 640 faces in time in a window (6 %):
        // every session slows, once.
        let t3 = t + 2 * lag + Duration::from_millis(100);
        draw(&mut s, 10);
        for i in 0..40 {
            s[i % 8].own_miss(t3, lag);
        }
        for x in &mut s[8..] {
            assert!(x.others_missed(t + 3 * lag, lag), "{x:?}");
            assert!((x.rate - 17.5).abs() < 1e-9, "{x:?}");
            assert!(
                !x.others_missed(t + 4 * lag, lag),
                "the next window has no misses"
            );
        }
    }

    #[test]
    fn the_fair_share_caps_the_rate_without_lowering_it_and_a_miss_cuts_from_the_cap() {
        let lag = Duration::from_millis(250);
        let t = Instant::now();
        let share = Arc::new(FairShare::new(16.0));
        let tally: &'static Tally = Box::leak(Box::default());
        let mut s = Stride::with_tally(25.0, Some(12.5), Some(share.clone()), tally, t);
        // Below the ceiling (16 with its headroom: 20), faces in time raise the rate.
        assert_eq!(s.value(), 2.0);
        for _ in 0..13 {
            s.hit();
        }
        let before = s.rate;
        assert!(before > 13.0 && before < 14.0, "{s:?}");
        // The share dips (a busy second measured): the session draws within it (8 × 1.25),
        // and faces in time meanwhile do not raise its own rate...
        share.set(8.0);
        assert!((s.value() - 2.5).abs() < 1e-9, "{s:?}");
        for _ in 0..20 {
            s.hit();
        }
        assert_eq!(s.rate, before, "{s:?}");
        // ...which it draws at again as soon as the share rises, not a face a second later.
        share.set(16.0);
        assert!((s.value() - 25.0 / before).abs() < 1e-9, "{s:?}");
        // A miss under the cap cuts from the rate drawn at (10), not from the session's own.
        share.set(8.0);
        s.own_miss(t, lag);
        assert!((s.rate - 7.0).abs() < 1e-9, "{s:?}");
        share.set(16.0);
        assert!((s.value() - 25.0 / 7.0).abs() < 1e-9, "{s:?}");
    }

    #[test]
    fn the_lookahead_is_212_5_ms() {
        assert_eq!(AUDIO_LOOKAHEAD, Duration::from_micros(212_500));
    }

    #[test]
    fn streamed_resampling_keeps_length_and_tone() {
        let rate = 48_000;
        let x: Vec<f32> = (0..rate)
            .map(|i| (2.0 * std::f32::consts::PI * 440.0 * i as f32 / rate as f32).sin() * 0.5)
            .collect();
        let mut r = StreamResampler::new(rate).unwrap();
        let mut out = Vec::new();
        for chunk in x.chunks(777) {
            r.push(chunk, &mut out);
        }
        r.finish(rate, &mut out);
        assert_eq!(out.len(), 16_000);
        let whole = crate::media::audio::resample::to_16k(&x, rate).unwrap();
        let err = out[800..15200]
            .iter()
            .zip(&whole[800..15200])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < 1e-2, "max difference from the file path {err}");
    }

    #[test]
    fn audio_formats_are_checked() {
        assert!(AudioFormat::new(SampleFormat::S16le, 16_000, 1).is_ok());
        assert!(AudioFormat::new(SampleFormat::F32le, 44_100, 2).is_ok());
        assert!(AudioFormat::new(SampleFormat::S16le, 4_000, 1).is_err());
        assert!(AudioFormat::new(SampleFormat::S16le, 16_000, 3).is_err());
        assert!("u8".parse::<SampleFormat>().is_err());
    }
}
