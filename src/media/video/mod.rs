//! Video out: H.264 + AAC in fragmented MP4, emitted while frames are still being made.
//!
//! [`VideoEncoder`] is the interface; [`spawn`] picks the implementation:
//!
//! - [`FfmpegEncoder`] (one worker): a single `ffmpeg` child process takes raw YUV 4:2:0
//!   frames on its stdin (converted here, [`crate::media::yuv`], so that only what changes
//!   is converted), encodes them with libx264 tuned for low latency (no B-frames, no lookahead, a
//!   keyframe every second), muxes the speech file as the AAC track, and writes fragmented MP4
//!   (`frag_keyframe+empty_moov+default_base_moof`) to its stdout, which is passed to a sink
//!   as it arrives.
//! - [`SegmentedEncoder`] (several workers): x264 on one process is bounded by one process's
//!   serial work (pixel conversion, muxing), so the frames are cut into keyframe-aligned
//!   one-second segments, encoded round-robin by several x264 processes (one thread each by
//!   default: the workers give the parallelism), joined in order into
//!   one H.264 stream and muxed (stream copy, plus the AAC track) by a last ffmpeg process.
//!   The result is the same kind of file, streamed the same way.
//!
//! Every process's stdout is drained by its own thread (and stderr kept for error messages),
//! so ffmpeg can never block on a full pipe; unfinished processes are killed and reaped.

pub mod clip;
mod flv;
mod fmp4;
pub mod live;
mod process;
mod remux;
mod segmented;
mod single;
pub mod spares;
mod spawn;
mod splice;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use process::{Fd3, Launch, Process, StdoutConsumer};

use crate::media::audio::Fps;
use crate::media::image::Frame;
use crate::media::yuv::{self, Region, Yuv420};
use crate::media::Error;

pub use remux::faststart;
pub use segmented::{start_encoders_ahead, SegmentedEncoder};
pub use single::FfmpegEncoder;
pub use spares::Spares;

/// No stream probing for an input that is described exactly: by default ffmpeg reads up to
/// 5 MB of it first (13 frames of 512², or a second and more of a live session), holding the
/// first frames back.
const NO_PROBE: [&str; 4] = ["-probesize", "32", "-analyzeduration", "0"];

/// An ffmpeg that says nothing but errors and never reads the terminal.
const QUIET: [&str; 4] = ["-hide_banner", "-nostdin", "-loglevel", "error"];

/// The speech input of a command line that reads it from descriptor 3.
const PIPED_SPEECH: &str = "pipe:3";

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

/// The most encoder workers one video may use.
pub const MAX_WORKERS: usize = 64;

/// Where encoded MP4 bytes go (a file, an HTTP body channel).
pub type Sink = Box<dyn std::io::Write + Send>;

/// Encodes frames, in order, into a video.
pub trait VideoEncoder: Send {
    /// Appends the next frame (YUV 4:2:0, the size the encoder was made for).
    fn write_yuv(&mut self, frame: &Yuv420) -> Result<(), Error>;
    /// Appends the next frame, which differs from the frame appended last only within
    /// `changed` (`None`: anywhere, or not known; an empty region: nowhere). An encoder that
    /// copies each frame for its process copies only that where it can (a photo's face
    /// instead of the whole frame); by default, [`Self::write_yuv`].
    fn write_yuv_changed(&mut self, frame: &Yuv420, changed: Option<Region>) -> Result<(), Error> {
        let _ = changed;
        self.write_yuv(frame)
    }
    /// Appends the next frame given as RGB (converted whole: where only a part of each frame
    /// changes, convert that part into a kept [`Yuv420`] and use [`Self::write_yuv_changed`]).
    fn write_frame(&mut self, frame: &Frame) -> Result<(), Error> {
        self.write_yuv(&Yuv420::from_rgb(frame))
    }
    /// Flushes everything to the sink and waits for the encoder to finish.
    fn finish(self: Box<Self>) -> Result<EncodeSummary, Error>;
}

/// What an encoder produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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
    /// A cap on the video's bit rate, in bits per second (x264's VBV with a one-second
    /// buffer: any T seconds of video carry at most T + 1 seconds at the cap; `None`: `crf`
    /// alone decides). Live sessions have one: a stream that a viewer's connection can
    /// carry, and x264 spends its time on bits.
    pub max_bitrate: Option<u64>,
    /// Audio file muxed as the AAC track (ffmpeg decodes it: any format it reads).
    pub audio: Option<PathBuf>,
    /// The ffmpeg executable.
    pub ffmpeg: PathBuf,
    /// x264 threads per process (`None`: ffmpeg's choice with one worker, the cores divided
    /// among the workers with several).
    pub threads: Option<usize>,
    /// x264 processes encoding segments in parallel (1: a single ffmpeg process).
    pub workers: usize,
    /// Added to the niceness of every ffmpeg process of this encoder (0: they run at the
    /// caller's priority): batch jobs' encoders run niced ([`BACKGROUND_NICE`]), so the CPU
    /// goes to interactive requests' and live sessions' encoders first.
    pub nice: i32,
    /// Processes started ahead for these settings' command lines (none: every process starts
    /// when its encoder does). The service keeps one pool for all its renders.
    pub spares: Option<Spares>,
}

/// The niceness added to a background render's encoder processes.
pub const BACKGROUND_NICE: i32 = 10;

/// Encoder workers for one stream when frames come from a model on a GPU (faster than one
/// x264 process can take them): one per core, at most 8 (with more cores each worker's x264
/// gets `cores / 8` threads). x264 with zero latency and one thread is the most efficient
/// per frame (the floor `bench --sections media` measures); its own threads scale poorly.
/// One when frames come from the CPU, where the model is the bottleneck and needs the cores.
pub fn default_workers(gpu: bool) -> usize {
    if !gpu {
        return 1;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores.clamp(1, 8)
}

/// Starts the encoder `settings` ask for; encoded bytes go to `sink` as they are made.
pub fn spawn(settings: EncoderSettings, sink: Sink) -> Result<Box<dyn VideoEncoder>, Error> {
    Ok(if settings.workers <= 1 {
        Box::new(FfmpegEncoder::spawn(settings, sink)?)
    } else {
        Box::new(SegmentedEncoder::spawn(settings, sink)?)
    })
}

fn strings<'a>(items: &'a [&'a str]) -> impl Iterator<Item = String> + 'a {
    items.iter().map(|s| s.to_string())
}

impl EncoderSettings {
    pub fn new(width: u32, height: u32, fps: Fps) -> Self {
        EncoderSettings {
            width,
            height,
            fps,
            preset: "veryfast".into(),
            crf: 20,
            max_bitrate: None,
            audio: None,
            ffmpeg: default_ffmpeg(),
            threads: None,
            workers: 1,
            nice: 0,
            spares: None,
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
        if self.workers == 0 || self.workers > MAX_WORKERS {
            return Err(Error::Encoder(format!(
                "{} encoder workers: use 1–{MAX_WORKERS}",
                self.workers
            )));
        }
        if self.threads == Some(0) {
            return Err(Error::Encoder("0 encoder threads".into()));
        }
        if let Some(b) = self.max_bitrate {
            check_max_bitrate(b).map_err(Error::Encoder)?;
        }
        if let Some(audio) = &self.audio {
            if !audio.is_file() {
                return Err(Error::Encoder(format!(
                    "audio file {} not found",
                    audio.display()
                )));
            }
        }
        Ok(())
    }

    /// Frames between keyframes (and per segment): at most one second's worth.
    fn gop(&self) -> u32 {
        (self.fps.value().floor() as u32).max(1)
    }

    /// H.264 in 4:2:0 needs even dimensions: odd sizes are padded by one row/column.
    fn coded_size(&self) -> (u32, u32) {
        yuv::coded_size(self.width, self.height)
    }

    /// The frame's bytes as the encoder takes them, after checking its size.
    fn coded_frame<'a>(&self, frame: &'a Yuv420) -> Result<&'a [u8], Error> {
        if (frame.width, frame.height) != (self.width, self.height) {
            return Err(Error::Encoder(format!(
                "frame is {}x{}, the encoder expects {}x{}",
                frame.width, frame.height, self.width, self.height
            )));
        }
        Ok(frame.bytes())
    }

    /// Quiet ffmpeg reading raw YUV 4:2:0 frames from stdin.
    fn raw_input_args(&self) -> Vec<String> {
        let mut a: Vec<String> = strings(&QUIET).collect();
        a.extend(self.raw_video_input_args());
        a
    }

    /// Raw YUV 4:2:0 frames from stdin as an input, unprobed.
    fn raw_video_input_args(&self) -> Vec<String> {
        let (w, h) = self.coded_size();
        let (num, den) = self.fps.ratio();
        let mut a: Vec<String> = strings(&NO_PROBE)
            .chain(strings(&["-f", "rawvideo", "-pix_fmt", "yuv420p"]))
            .collect();
        a.extend(["-video_size".into(), format!("{w}x{h}")]);
        a.extend(["-framerate".into(), format!("{num}/{den}")]);
        a.extend(["-i".into(), "pipe:0".into()]);
        a
    }

    /// libx264, low latency: no B-frames, no lookahead, an IDR frame exactly every `gop`.
    fn x264_args(&self, threads: Option<usize>) -> Vec<String> {
        let gop = self.gop().to_string();
        let mut a = Vec::new();
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
        if let Some(b) = self.max_bitrate {
            // Capped CRF: the buffer holds one second at the cap, so a keyframe can take
            // several frames' share, and any T seconds stay under T + 1 seconds' worth.
            a.extend([
                "-maxrate".into(),
                b.to_string(),
                "-bufsize".into(),
                b.to_string(),
            ]);
        }
        if let Some(t) = threads {
            a.extend(["-threads".into(), t.to_string()]);
        }
        a
    }

    /// How ffmpeg reads the speech: its argument to `-i`, and the file to copy into descriptor
    /// 3 when that argument is `pipe:3`. Through the pipe, the command line is the same for
    /// every render of a shape, so its process can be started ahead ([`Spares`]); by name only
    /// where the container needs seeking (MP4/M4A, whose index may be at the end).
    fn speech_input(&self) -> Option<(String, Option<&Path>)> {
        let audio = self.audio.as_deref()?;
        let mut head = [0u8; 8];
        let mp4 = std::fs::File::open(audio)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
            .is_ok_and(|_| &head[4..8] == b"ftyp");
        Some(if mp4 {
            (audio.display().to_string(), None)
        } else {
            (PIPED_SPEECH.into(), Some(audio))
        })
    }

    /// The inputs and the stream mapping: the speech (if any) as the first input (`-i
    /// speech`), then `video` (the video input's options and its `-i`); the video is mapped
    /// first, so the MP4's tracks are video then audio.
    ///
    /// The speech comes first because ffmpeg opens its inputs in order, each with its probe,
    /// and writes the MP4's header (the response's first bytes) only after: the speech is
    /// there from the start of a render, the video only once the first frames are encoded.
    /// Opened first, its probe runs while they are. A scratch harness (/tmp only) fed a
    /// spare muxer a 40 s 512² render's H.264, its first picture 31 ms after the speech began,
    /// then one picture every 1.5 ms: the header came 38 ms after the first picture with the
    /// video first, 28 ms with the speech first (medians of 5); the MP4s are byte for byte the
    /// same.
    fn inputs_with_speech(&self, video: Vec<String>, speech: Option<&str>) -> Vec<String> {
        let mut a: Vec<String> = strings(&QUIET).collect();
        if let Some(speech) = speech {
            a.extend(["-i".into(), speech.to_string()]);
        }
        a.extend(video);
        if speech.is_some() {
            a.extend(strings(&["-map", "1:v:0", "-map", "0:a:0"]));
        } else {
            a.extend(strings(&["-map", "0:v:0"]));
        }
        a
    }

    /// This encoder's ffmpeg with `args`, and descriptor 3 as `fd3` says.
    fn launch(&self, args: Vec<String>, fd3: Fd3) -> Launch {
        Launch {
            ffmpeg: self.ffmpeg.clone(),
            nice: self.nice,
            args,
            fd3,
        }
    }

    /// The process `args_for(speech)` describes, `speech` being its `-i` argument for the
    /// speech (if any): descriptor 3 an input where that is [`PIPED_SPEECH`]. A render and
    /// the processes started ahead for it ([`start_encoders_ahead`]) both make their command
    /// lines here, so a spare matches the render it was started for.
    fn speech_launch(
        &self,
        args_for: impl FnOnce(Option<&str>) -> Vec<String>,
        speech: Option<&str>,
    ) -> Launch {
        let fd3 = if speech == Some(PIPED_SPEECH) {
            Fd3::Input
        } else {
            Fd3::None
        };
        self.launch(args_for(speech), fd3)
    }

    /// Starts (or takes from the spares) the process `args_for(speech input)` describes, with
    /// the speech fed to it through descriptor 3 where the arguments say `pipe:3`.
    fn start_with_speech(
        &self,
        args_for: impl FnOnce(Option<&str>) -> Vec<String>,
        role: &str,
        consume: StdoutConsumer,
    ) -> Result<Process, Error> {
        let (arg, feed) = match self.speech_input() {
            Some((arg, feed)) => (Some(arg), feed),
            None => (None, None),
        };
        // A command line naming the speech file is never started ahead: no spare would match.
        let spares = match (&arg, feed) {
            (Some(_), None) => None,
            _ => self.spares.as_ref(),
        };
        let launch = self.speech_launch(args_for, arg.as_deref());
        let mut process = Process::spawn(&launch, spares, role, consume)?;
        if let Some(file) = feed {
            process.feed_fd3(file)?;
        }
        Ok(process)
    }

    /// AAC audio (if any) and fragmented MP4 on stdout.
    fn mp4_output_args(&self, speech: bool) -> Vec<String> {
        let mut a = Vec::new();
        if speech {
            // ffmpeg's AAC encoder starts with 1024 samples of priming, which a fragmented MP4
            // written up front (empty_moov) cannot mark with an edit list: they would play,
            // and the speech would lag the lips by 1024 samples. Trimming the same amount
            // from the input keeps speech and video in step, both streams starting at 0.
            // ffmpeg's fast AAC coder, as the live encoder's: the default (twoloop) coder
            // took 17 % of a 40 s 512² request's CPU on 16 kHz mono speech (0.51 s against
            // 0.21 s) and 1.42 s against 0.42 s on 44.1 kHz stereo, with the decoded speech
            // as close to its source (SNR 36.6 against 36.1 dB; 28.3 against 42.5 dB).
            a.extend(strings(&[
                "-af",
                "atrim=start_sample=1024",
                "-c:a",
                "aac",
                "-aac_coder",
                "fast",
                "-b:a",
                "128k",
            ]));
        }
        // Keep frame timestamps exact (i/fps); by default ffmpeg would shift all but the first
        // frame to compensate for the audio priming instead.
        a.extend(strings(&["-avoid_negative_ts", "disabled"]));
        a.extend(strings(&[
            "-movflags",
            "frag_keyframe+empty_moov+default_base_moof",
            "-frag_duration",
            "1000000",
            "-f",
            "mp4",
            "pipe:1",
        ]));
        a
    }

    /// The single-process encoder: raw frames in, MP4 out, the speech read by name.
    fn single_args(&self) -> Vec<String> {
        let speech = self.audio.as_ref().map(|a| a.display().to_string());
        self.single_args_with(speech.as_deref())
    }

    /// The single-process encoder, the speech read from `speech` (an `-i` argument).
    fn single_args_with(&self, speech: Option<&str>) -> Vec<String> {
        let mut a = self.inputs_with_speech(self.raw_video_input_args(), speech);
        a.extend(self.x264_args(self.threads));
        a.extend(self.mp4_output_args(speech.is_some()));
        a
    }

    /// The single-process encoder's command line (yuv420p frames on stdin, the x264 options,
    /// audio track and fragmented MP4 on stdout). `bench --sections media` runs it as the
    /// floor of the service's encode.
    pub fn yuv420p_args(&self) -> Vec<String> {
        self.single_args()
    }

    /// x264 threads of each segment worker.
    pub fn worker_threads(&self) -> usize {
        self.threads.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / self.workers).max(1)
        })
    }

    /// A segment worker: raw frames in, H.264 out in FLV (each frame a tag with its length,
    /// written as soon as it is encoded).
    fn worker_args(&self) -> Vec<String> {
        let mut a = self.raw_input_args();
        a.extend(self.x264_args(Some(self.worker_threads())));
        a.extend(strings(&["-flush_packets", "1", "-f", "flv", "pipe:1"]));
        a
    }

    /// The muxer of the segmented encoder: the joined H.264 stream (Annex B, timestamps
    /// rewritten to frame index / fps) copied into MP4, plus the speech read from `speech`
    /// (an `-i` argument).
    fn muxer_args_with(&self, speech: Option<&str>) -> Vec<String> {
        let (num, den) = self.fps.ratio();
        // Read the stream as it comes rather than probing seconds of it first.
        let mut video: Vec<String> = strings(&NO_PROBE).chain(strings(&["-f", "h264"])).collect();
        video.extend(["-framerate".into(), format!("{num}/{den}")]);
        video.extend(strings(&["-i", "pipe:0"]));
        let mut a = self.inputs_with_speech(video, speech);
        // Raw H.264 carries no timestamps: picture N is at N/fps, in the raw demuxer's time
        // base (TB, 1/1200000), which the MP4 keeps. (Setting another track timescale here
        // makes ffmpeg 5 apply the expression in the wrong time base.)
        a.extend(strings(&["-c:v", "copy", "-bsf:v"]));
        a.push(format!(
            "setts=pts=N*{den}/({num}*TB):dts=N*{den}/({num}*TB)"
        ));
        a.extend(self.mp4_output_args(speech.is_some()));
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
/// The lowest bit-rate cap taken: below it x264 cannot hold even a still picture's frames
/// at a usable quality.
pub const MIN_MAX_BITRATE: u64 = 64_000;

/// A bit-rate cap in bits per second if it is at least [`MIN_MAX_BITRATE`] (and fits x264's
/// kbit/s setting).
pub fn check_max_bitrate(bits_per_second: u64) -> Result<u64, String> {
    if !(MIN_MAX_BITRATE..=2_000_000_000).contains(&bits_per_second) {
        return Err(format!(
            "a bit rate of {bits_per_second} bit/s is outside {MIN_MAX_BITRATE} to 2000000000"
        ));
    }
    Ok(bits_per_second)
}

/// x264's quality scale: `crf` if it is within 0 (lossless) to 51 (worst).
pub fn check_crf(crf: u8) -> Result<u8, String> {
    if crf <= 51 {
        Ok(crf)
    } else {
        Err(format!("crf {crf} is outside 0-51 (0 lossless, 51 worst)"))
    }
}

/// Checks that ffmpeg runs and has the libx264 and aac encoders.
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

    /// The command lines of a file's two encoders, the single process and the segmented
    /// encoder's muxer, with `speech` as their speech input.
    fn file_lines(s: &EncoderSettings, speech: Option<&str>) -> [String; 2] {
        [
            s.single_args_with(speech).join(" "),
            s.muxer_args_with(speech).join(" "),
        ]
    }

    #[test]
    fn files_speech_is_aac_by_the_fast_coder() {
        // The README's promise: the fast coder (under half of the default coder's CPU),
        // 128 kb/s, the priming trimmed, in the single encoder and the segmented muxer alike.
        let s = EncoderSettings::new(64, 64, Fps::DEFAULT);
        for line in file_lines(&s, Some(PIPED_SPEECH)) {
            assert!(
                line.contains("-af atrim=start_sample=1024 -c:a aac -aac_coder fast -b:a 128k"),
                "{line}"
            );
        }
        // Without speech, no audio options.
        assert!(!s.muxer_args_with(None).join(" ").contains("aac"));
    }

    #[test]
    fn the_speech_is_opened_before_the_video_and_mapped_after_it() {
        // ffmpeg opens its inputs in order and writes the MP4's header after: the speech,
        // there from the start of a render, goes first, so its probe runs while the first
        // pictures are encoded; the tracks stay video then audio.
        let s = EncoderSettings::new(64, 64, Fps::DEFAULT);
        for line in file_lines(&s, Some(PIPED_SPEECH)) {
            let speech = line.find("-i pipe:3").expect("the speech is an input");
            let video = line.find("-i pipe:0").expect("the video is an input");
            assert!(speech < video, "{line}");
            assert!(line.contains("-map 1:v:0 -map 0:a:0"), "{line}");
        }
        for line in file_lines(&s, None) {
            assert!(line.contains("-i pipe:0 "), "{line}");
            assert!(line.contains("-map 0:v:0"), "{line}");
            assert!(!line.contains("pipe:3") && !line.contains(":a:0"), "{line}");
        }
    }

    #[test]
    fn odd_sizes_are_coded_even() {
        let s = EncoderSettings::new(101, 75, Fps::DEFAULT);
        assert_eq!(s.coded_size(), (102, 76));
        let args = s.single_args().join(" ");
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
