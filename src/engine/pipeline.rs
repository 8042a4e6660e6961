//! One render, whatever the door: speech and a prepared avatar in, an encoded MP4 out, through
//! the engine: decode the speech, plan the frames, submit them, composite the predicted faces
//! and encode. `POST /v1/lipsync` (an HTTP body), `lipsync render` (files) and `lipsync
//! bench` all render through here; each door only parses its input and chooses the sink.
//!
//! It runs in two phases, because the service must refuse a request (overloaded, bad audio,
//! an encoder that cannot start) before the first byte of its response:
//!
//! 1. [`start`] decodes the speech, plans and submits the frames, and starts the encoder on
//!    the sink. Whatever fails here fails cleanly: nothing has been written to the sink, and
//!    the submitted frames are taken back out of the queue.
//! 2. [`Started::run`], on the caller's thread, composites the faces as they come and
//!    encodes them into the sink, until the video is complete, the caller says its client is
//!    gone, or something fails.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use lipsync::engine::{pipeline::{self, Options, Speech, Work}, Avatar, Engine};
//! # fn f(engine: &Engine, settings: &pipeline::Settings, avatar: Arc<Avatar>) -> Result<(), Box<dyn std::error::Error>> {
//! let work = Work {
//!     speech: Speech::file("speech.wav")?,
//!     avatar,
//!     options: Options::default(),
//!     faces_dir: None,
//! };
//! let out = std::fs::File::create("out.mp4")?;
//! let started = pipeline::start(engine, settings, work, Box::new(std::io::BufWriter::new(out)))?;
//! let stats = started.run(&|| false, &mut |done, total| eprintln!("{done}/{total}"))?;
//! # Ok(()) }
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use super::batcher::Overloaded;
use super::clip::Loop;
use super::metrics as m;
use super::{Avatar, Engine, Error, Job, JobStats};
use crate::media::audio::{self, Fps};
use crate::media::face::Blend;
use crate::media::video::{self, EncoderSettings, Sink, VideoEncoder};

/// The speech of a render: its file's bytes (any format [`audio::load`] reads), decoded for
/// the model, and the same file muxed by the encoder as the video's sound track.
#[derive(Debug, Clone)]
pub struct Speech {
    pub bytes: Bytes,
    /// Where `bytes` are on disk, if they are: the encoder reads the sound track from there.
    /// `None` (an upload in memory): they are written to a temporary file that lives as long
    /// as the render.
    pub file: Option<PathBuf>,
}

impl Speech {
    /// Speech held in memory (written to a temporary file for the encoder).
    pub fn bytes(bytes: impl Into<Bytes>) -> Speech {
        Speech {
            bytes: bytes.into(),
            file: None,
        }
    }

    /// The speech in a file, read now.
    pub fn file(path: impl AsRef<Path>) -> std::io::Result<Speech> {
        let path = path.as_ref();
        Ok(Speech {
            bytes: std::fs::read(path)?.into(),
            file: Some(path.to_path_buf()),
        })
    }
}

/// How one render looks: what a request or a job chooses.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The video's frame rate for a photo (a clip runs at its own).
    pub fps: Fps,
    /// How a clip's frames follow each other when the speech is longer (ignored for a photo).
    pub loop_mode: Loop,
    /// How the predicted face is put back (the avatar is re-masked if it was prepared with
    /// another blend).
    pub blend: Blend,
    /// x264 quality (`None`: [`Settings::encoder`]'s).
    pub crf: Option<u8>,
    /// x264 preset (`None`: [`Settings::encoder`]'s).
    pub preset: Option<String>,
}

/// What a render does.
pub struct Work {
    pub speech: Speech,
    /// The photo or clip, prepared (decoded, face found): see [`Avatar::prepare`] and
    /// [`super::clip::prepare`].
    pub avatar: Arc<Avatar>,
    pub options: Options,
    /// Also write every predicted 96×96 face as `00000.png`, … (RGB) here.
    pub faces_dir: Option<PathBuf>,
}

/// What every render of a process shares (from the command line or the service's flags).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Longer speech is refused.
    pub max_audio_seconds: f64,
    /// The encoder every render starts from: ffmpeg, preset, crf, threads, workers. Each
    /// render sets its own frame size, frame rate and sound track (and its [`Options`]'
    /// preset and crf).
    pub encoder: EncoderSettings,
}

impl Settings {
    /// `max_audio_seconds` and the encoder settings `encoder` returns for a frame size and
    /// rate (e.g. `|w, h, fps| media_args.encoder(w, h, fps, workers)`): only its other
    /// fields are kept.
    pub fn new(
        max_audio_seconds: f64,
        encoder: impl FnOnce(u32, u32, Fps) -> EncoderSettings,
    ) -> Settings {
        Settings {
            max_audio_seconds,
            encoder: encoder(0, 0, Fps::DEFAULT),
        }
    }
}

/// Why a render did not start. Nothing was written to the sink.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The engine's queue is full: try again later (the service answers 429).
    #[error("{} frames are already waiting", .0.queued)]
    Overloaded(Overloaded),
    /// The speech cannot be used (not audio, too long, too short, …), or the encoder cannot
    /// start.
    #[error(transparent)]
    Failed(#[from] Error),
}

impl From<crate::media::Error> for StartError {
    fn from(e: crate::media::Error) -> Self {
        StartError::Failed(e.into())
    }
}

/// A render whose frames are submitted and whose encoder is running; [`Started::run`] makes
/// the video. Dropping it instead takes the frames back out of the queue and stops the
/// encoder.
pub struct Started {
    job: Job,
    encoder: Box<dyn VideoEncoder>,
    fps: Fps,
    speech_seconds: f64,
    /// The speech the encoder reads, when it had to be written out.
    _audio_file: Option<tempfile::NamedTempFile>,
}

/// Starts a render: decodes the speech, plans and submits the frames (refused when the
/// engine is overloaded) and starts the encoder writing into `sink`. Blocking (decoding and
/// planning take a while for long speech): call it off any async runtime.
pub fn start(
    engine: &Engine,
    settings: &Settings,
    work: Work,
    sink: Sink,
) -> Result<Started, StartError> {
    let Work {
        speech,
        avatar,
        options,
        faces_dir,
    } = work;
    let avatar = if avatar.blend == options.blend {
        avatar
    } else {
        Arc::new(avatar.with_blend(options.blend))
    };
    let fps = avatar.fps().unwrap_or(options.fps);
    let t = Instant::now();
    let decoded = audio::load(&speech.bytes, settings.max_audio_seconds)?;
    m::stage("decode", t.elapsed());
    let t = Instant::now();
    let planned = super::plan(&decoded, fps, &avatar.crops(options.loop_mode))?;
    m::stage("mel", t.elapsed());
    let video_frames = planned.video_frames;
    let submission = engine
        .submit(planned.frames)
        .map_err(StartError::Overloaded)?;

    // If the encoder cannot start, dropping the submission takes the frames back out.
    let (audio_path, audio_file) = match speech.file {
        Some(path) => (path, None),
        None => {
            let file = audio_file(&speech.bytes)?;
            (file.path().to_path_buf(), Some(file))
        }
    };
    let encoder = video::spawn(
        encoder_settings(settings, &options, &avatar, fps, audio_path),
        sink,
    )?;
    Ok(Started {
        job: Job {
            submission,
            video_frames,
            avatar,
            loop_mode: options.loop_mode,
            faces_dir,
        },
        encoder,
        fps,
        speech_seconds: planned.speech_seconds,
        _audio_file: audio_file,
    })
}

/// The encoder of one render: the shared settings with its size, rate, sound and options.
fn encoder_settings(
    settings: &Settings,
    options: &Options,
    avatar: &Avatar,
    fps: Fps,
    audio: PathBuf,
) -> EncoderSettings {
    let mut s = settings.encoder.clone();
    s.width = avatar.frame.width;
    s.height = avatar.frame.height;
    s.fps = fps;
    s.audio = Some(audio);
    if let Some(crf) = options.crf {
        s.crf = crf;
    }
    if let Some(preset) = &options.preset {
        s.preset = preset.clone();
    }
    s
}

/// The speech in a temporary file, for the encoder.
fn audio_file(bytes: &[u8]) -> Result<tempfile::NamedTempFile, Error> {
    let failed = |source| Error::Output {
        path: std::env::temp_dir(),
        source,
    };
    let mut file = tempfile::Builder::new()
        .prefix("lipsync-audio-")
        .tempfile()
        .map_err(failed)?;
    file.write_all(bytes).map_err(failed)?;
    Ok(file)
}

impl Started {
    /// Frames in the video (the last drawn one held to the end of the speech): known before
    /// the first byte.
    pub fn video_frames(&self) -> usize {
        self.job.video_frames
    }

    /// Frames the model draws.
    pub fn model_frames(&self) -> usize {
        self.job.submission.total()
    }

    /// The video's frame rate.
    pub fn fps(&self) -> Fps {
        self.fps
    }

    /// Seconds of speech.
    pub fn speech_seconds(&self) -> f64 {
        self.speech_seconds
    }

    /// Makes the video, on the calling thread: faces composited as the engine returns them,
    /// encoded into the sink, then the encoder finished. `gone()` is asked between frames
    /// (at least every 50 ms): once it says the consumer has left, the render stops with
    /// [`Error::Cancelled`], its queued frames are dropped and the encoder killed.
    /// `progress(done, total)` is called with the video frames written so far (and once at
    /// the end with `done == total`).
    pub fn run(
        self,
        gone: &dyn Fn() -> bool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<JobStats, Error> {
        let Started {
            job,
            encoder,
            _audio_file,
            ..
        } = self;
        job.run(encoder, gone, progress)
    }
}
