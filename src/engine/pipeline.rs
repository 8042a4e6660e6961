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
//! A render is [`Class::Interactive`] (a request someone waits for: refused when the engine
//! is overloaded) or [`Class::Background`] (a batch job: never refused, its frames fill what
//! live sessions and interactive requests leave of each batch).
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use lipsync::engine::{pipeline::{self, Class, Options, Speech, Work}, Avatar, Engine};
//! # fn f(engine: &Engine, settings: &pipeline::Settings, avatar: Arc<Avatar>) -> Result<(), Box<dyn std::error::Error>> {
//! let work = Work {
//!     speech: Speech::file("speech.wav")?,
//!     avatar,
//!     options: Options::default(),
//!     class: Class::Background,
//!     keep: Default::default(),
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
pub use super::compositor::Keep;
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
    /// The enhancer run on every predicted face ([`super::enhance`]), if any.
    pub enhance: Option<super::enhance::EnhanceWith>,
}

/// Who waits for a render.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Class {
    /// Someone waits for it (`POST /v1/lipsync`, `lipsync render`): its frames come before
    /// batch jobs', and it is refused when the engine's queue is full.
    #[default]
    Interactive,
    /// A batch job: never refused, it waits; its frames only fill what live sessions and
    /// interactive requests leave of each batch ([`Engine::submit_background`]), and its
    /// encoder runs niced ([`video::BACKGROUND_NICE`]).
    Background,
}

/// What a render does.
pub struct Work {
    pub speech: Speech,
    /// The photo or clip, prepared (decoded, face found): see [`Avatar::prepare`] and
    /// [`super::clip::prepare`].
    pub avatar: Arc<Avatar>,
    pub options: Options,
    pub class: Class,
    /// Faces and frames also written as images (`render --faces-dir`, `--frames-dir`).
    pub keep: Keep,
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
    /// The engine's queue is full: try again later (the service answers 429). Only
    /// [`Class::Interactive`] renders are refused so.
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

/// Starts a render: decodes the speech, plans and submits the frames (an interactive one is
/// refused when the engine is overloaded) and starts the encoder writing into `sink`. Blocking (decoding and
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
        class,
        keep,
    } = work;
    let avatar = if avatar.blend == options.blend {
        avatar
    } else {
        Arc::new(avatar.with_blend(options.blend))
    };
    super::restore::prepare(&avatar, options.enhance.as_ref())?;
    let fps = avatar.fps().unwrap_or(options.fps);
    let t = Instant::now();
    let decoded = audio::load(&speech.bytes, settings.max_audio_seconds)?;
    m::stage("decode", t.elapsed());
    let t = Instant::now();
    let mut planned = super::plan(&decoded, fps, &avatar.crops(options.loop_mode))?;
    if let Some(with) = &options.enhance {
        for f in &mut planned.frames {
            f.enhance = Some(with.clone());
            let i = avatar.select(f.index, options.loop_mode);
            f.restore = super::restore::Restore::when(Some(with), &avatar, i);
        }
    }
    m::stage("mel", t.elapsed());
    let video_frames = planned.video_frames;
    let submission = match class {
        Class::Interactive => engine
            .submit(planned.frames)
            .map_err(StartError::Overloaded)?,
        Class::Background => engine.submit_background(planned.frames),
    };

    // If the encoder cannot start, dropping the submission takes the frames back out.
    let (audio_path, audio_file) = match speech.file {
        Some(path) => (path, None),
        None => {
            let file = audio_file(&speech.bytes)?;
            (file.path().to_path_buf(), Some(file))
        }
    };
    let encoder = video::spawn(
        encoder_settings(settings, &options, class, &avatar, fps, audio_path),
        sink,
    )?;
    Ok(Started {
        job: Job {
            submission,
            video_frames,
            avatar,
            loop_mode: options.loop_mode,
            keep,
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
    class: Class,
    avatar: &Avatar,
    fps: Fps,
    audio: PathBuf,
) -> EncoderSettings {
    let mut s = sized_for(settings, avatar, fps);
    s.audio = Some(audio);
    if let Some(crf) = options.crf {
        s.crf = crf;
    }
    if let Some(preset) = &options.preset {
        s.preset = preset.clone();
    }
    if class == Class::Background {
        s.nice = video::BACKGROUND_NICE;
    }
    s
}

/// Starts ahead the encoder processes a render on `avatar` will take at its own size and
/// rate (a photo's: the default rate), so that its first render does not wait for them.
pub fn start_encoders_ahead(settings: &Settings, avatar: &Avatar) -> Result<(), Error> {
    let fps = avatar.fps().unwrap_or_default();
    Ok(video::start_encoders_ahead(&sized_for(
        settings, avatar, fps,
    ))?)
}

/// The shared encoder settings at `avatar`'s frame size and rate `fps`.
fn sized_for(settings: &Settings, avatar: &Avatar, fps: Fps) -> EncoderSettings {
    let mut s = settings.encoder.clone();
    s.width = avatar.frame.width;
    s.height = avatar.frame.height;
    s.fps = fps;
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
    /// encoded into the sink, then the encoder finished. `gone()` is asked before each frame
    /// (every 50 ms while the model's faces are awaited): once it says true (the client
    /// left, the job was cancelled), the render stops with [`Error::Cancelled`], its queued
    /// frames are dropped and the encoder killed. `progress(done, total)` is called with the
    /// video frames written so far (and once at the end with `done == total`). A panic
    /// inside (a bug) unwinds to the caller, which may catch it, as the service does.
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

#[cfg(test)]
mod tests {
    use std::sync::{Condvar, Mutex};

    use candle_core::DType;

    use super::*;
    use crate::engine::backend::{Loader, Model, Prediction, PRED_LEN};
    use crate::engine::pool::PoolConfig;
    use crate::media::face::FaceBox;
    use crate::media::image::Frame;
    use crate::model::Precision;

    /// Closed: every batch waits until it opens.
    #[derive(Default)]
    struct Gate {
        open: Mutex<bool>,
        opened: Condvar,
    }

    impl Gate {
        fn open(&self) {
            *self.open.lock().unwrap() = true;
            self.opened.notify_all();
        }
    }

    /// A model that draws gray faces once the gate is open.
    struct Gray(Arc<Gate>);

    impl Model for Gray {
        fn dtype(&self) -> DType {
            DType::F32
        }
        fn conv_path(&self) -> &'static str {
            "test"
        }
        fn predict(&mut self, n: usize, _: Vec<f32>, _: Vec<f32>) -> Result<Prediction, Error> {
            let mut open = self.0.open.lock().unwrap();
            while !*open {
                open = self.0.opened.wait(open).unwrap();
            }
            Ok(Prediction {
                faces: vec![0.5; n * PRED_LEN],
                overflow: false,
            })
        }
        fn use_reference_path(&mut self) -> bool {
            false
        }
    }

    struct GrayLoader(Arc<Gate>);

    impl Loader for GrayLoader {
        fn load(&self, _: Precision, _: usize) -> Result<Box<dyn Model>, Error> {
            Ok(Box::new(Gray(self.0.clone())))
        }
    }

    /// An engine of one gray instance admitting 4 runnable frames.
    fn engine(gate: &Arc<Gate>) -> Engine {
        let engine = Engine::start(
            Arc::new(GrayLoader(gate.clone())),
            PoolConfig::testing(4, 2, 4),
        );
        engine.wait_ready().unwrap();
        engine
    }

    fn settings() -> Settings {
        Settings::new(60.0, |w, h, fps| {
            let mut s = EncoderSettings::new(w, h, fps);
            s.preset = "ultrafast".into();
            s
        })
    }

    /// One second of a tone at 16 kHz, as a new WAV file in `dir`, named after `class` (a
    /// file of its own per call: a render's encoder reads its speech while it runs, so
    /// rewriting one in use would corrupt it).
    fn speech(dir: &Path, class: Class) -> Speech {
        static MADE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!("speech-{class:?}-{n}.wav"));
        let spec = hound::WavSpec {
            channels: 1,
            sample_rate: 16_000,
            bits_per_sample: 16,
            sample_format: hound::SampleFormat::Int,
        };
        let mut w = hound::WavWriter::create(&path, spec).unwrap();
        for i in 0..16_000 {
            let t = i as f32 / 16_000.0;
            w.write_sample(((t * 440.0 * std::f32::consts::TAU).sin() * 8000.0) as i16)
                .unwrap();
        }
        w.finalize().unwrap();
        Speech::file(&path).unwrap()
    }

    fn work(dir: &Path, class: Class) -> Work {
        let frame = Frame::new(64, 64, vec![128; 64 * 64 * 3]);
        let face = FaceBox {
            x1: 16,
            y1: 16,
            x2: 48,
            y2: 48,
        };
        Work {
            speech: speech(dir, class),
            avatar: Arc::new(Avatar::from_frame(frame, face, Blend::Feather)),
            options: Options::default(),
            class,
            keep: Default::default(),
        }
    }

    /// A sink the test can read.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_background_render_waits_instead_of_being_refused_and_completes() {
        let gate = Arc::new(Gate::default());
        let engine = engine(&gate);
        let dir = tempfile::tempdir().unwrap();
        let first = Shared::default();
        let interactive = start(
            &engine,
            &settings(),
            work(dir.path(), Class::Interactive),
            Box::new(first.clone()),
        )
        .unwrap();
        assert_eq!(
            (interactive.model_frames(), interactive.video_frames()),
            (22, 25)
        );
        // Its look-ahead fills the queue bound (4): another interactive render is refused...
        let refused = start(
            &engine,
            &settings(),
            work(dir.path(), Class::Interactive),
            Box::new(Shared::default()),
        );
        assert!(matches!(refused, Err(StartError::Overloaded(_))));
        // ...a background one is not.
        let out = Shared::default();
        let background = start(
            &engine,
            &settings(),
            work(dir.path(), Class::Background),
            Box::new(out.clone()),
        )
        .unwrap();
        gate.open();
        interactive.run(&|| false, &mut |_, _| {}).unwrap();
        let mut seen = Vec::new();
        let stats = background
            .run(&|| false, &mut |done, total| seen.push((done, total)))
            .unwrap();
        assert_eq!((stats.model_frames, stats.video_frames), (22, 25));
        assert_eq!(seen.last(), Some(&(25, 25)));
        for sink in [first, out] {
            let bytes = sink.0.lock().unwrap();
            assert_eq!(&bytes[4..8], b"ftyp");
        }
        assert_eq!(engine.scheduler().queued(), 0);
        engine.shutdown();
    }

    #[test]
    fn a_cancelled_background_render_stops_and_drops_its_frames() {
        let gate = Arc::new(Gate::default());
        let engine = engine(&gate);
        let dir = tempfile::tempdir().unwrap();
        let background = start(
            &engine,
            &settings(),
            work(dir.path(), Class::Background),
            Box::new(Shared::default()),
        )
        .unwrap();
        assert_eq!(engine.scheduler().requests(), 1);
        let result = background.run(&|| true, &mut |_, _| {});
        assert!(matches!(result, Err(Error::Cancelled)), "{result:?}");
        assert_eq!(engine.scheduler().requests(), 0);
        assert_eq!(engine.scheduler().queued(), 0);
        gate.open();
        engine.shutdown();
    }

    /// This process's niceness (the 19th field of its stat, after the command name).
    #[cfg(target_os = "linux")]
    fn own_nice() -> i32 {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
        let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
        fields[16].parse().unwrap()
    }

    /// An executable in `dir` that appends its niceness to `log`, then runs the real ffmpeg
    /// in its place (same process, same niceness).
    #[cfg(target_os = "linux")]
    fn nice_recording_ffmpeg(dir: &Path, log: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join("ffmpeg-nice");
        let script = format!(
            "#!/bin/sh\nnice >> '{}'\nexec '{}' \"$@\"\n",
            log.display(),
            video::default_ffmpeg().display()
        );
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_background_renders_encoder_runs_niced() {
        let gate = Arc::new(Gate::default());
        gate.open();
        let engine = engine(&gate);
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("nice.log");
        let ffmpeg = nice_recording_ffmpeg(dir.path(), &log);
        let settings = Settings::new(60.0, |w, h, fps| {
            let mut s = EncoderSettings::new(w, h, fps);
            s.preset = "ultrafast".into();
            s.ffmpeg = ffmpeg;
            s
        });
        let own = own_nice();
        for (class, want) in [
            (Class::Interactive, own),
            (Class::Background, (own + video::BACKGROUND_NICE).min(19)),
        ] {
            let _ = std::fs::remove_file(&log);
            let started = start(
                &engine,
                &settings,
                work(dir.path(), class),
                Box::new(Shared::default()),
            )
            .unwrap();
            started.run(&|| false, &mut |_, _| {}).unwrap();
            // Every ffmpeg process of the encoder (one, or a muxer and its workers).
            let seen: Vec<i32> = std::fs::read_to_string(&log)
                .unwrap()
                .lines()
                .map(|l| l.trim().parse().unwrap())
                .collect();
            assert!(
                !seen.is_empty() && seen.iter().all(|&n| n == want),
                "{class:?}: want {want}, the encoder's processes ran at {seen:?}"
            );
        }
        engine.shutdown();
    }
}
