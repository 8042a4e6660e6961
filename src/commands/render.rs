//! `render` (one video, or many with `--jobs` and the model loaded once) and `detect`.

use std::io::{BufRead, IsTerminal};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use lipsync::config::{choice, EngineArgs, MediaArgs, Resolved as EngineConfig};
use lipsync::engine::pipeline::{self, Class, Keep, Options, Speech, StartError, Work};
use lipsync::engine::{self, Avatar, Engine, Loop};
use lipsync::media::audio::Fps;
use lipsync::media::face::{self, Blend, FaceBox, Landmarks, Pads};
use lipsync::media::image::DEFAULT_MAX_PIXELS;
use lipsync::media::video;

use super::{json_error, read_file, CliError};

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("avatar").args(["image", "video", "jobs"]).required(true)))]
pub struct RenderArgs {
    /// Speech: WAV, MP3, FLAC, Ogg Vorbis or M4A/AAC.
    #[arg(long, required_unless_present = "jobs")]
    pub audio: Option<PathBuf>,
    /// Avatar photo: PNG, JPEG or WebP with one frontal face.
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// Avatar clip (MP4, MOV, WebM, MKV, ...): its face is redrawn on its frames, looped when
    /// the speech is longer; the video runs at the clip's frame rate.
    #[arg(long)]
    pub video: Option<PathBuf>,
    /// Face box x1,y1,x2,y2 in the photo's (or every clip frame's) pixels (x2, y2 exclusive):
    /// skips detection, pads and smoothing.
    #[arg(long = "box")]
    pub face_box: Option<FaceBox>,
    /// The face's five landmarks in the photo's (or every clip frame's) pixels, ten numbers
    /// x1,y1,...,x5,y5: left eye, right eye, nose tip, left and right mouth corner (for face
    /// restoration's alignment; without them they are placed in the face box).
    #[arg(long)]
    pub landmarks: Option<Landmarks>,
    /// Pixels added to a detected box: top,bottom,left,right.
    #[arg(long, default_value = "0,10,0,0", allow_hyphen_values = true)]
    pub pads: Pads,
    /// How a clip repeats when the speech is longer: pingpong (forwards, backwards) or repeat.
    #[arg(long = "loop", default_value = "pingpong", value_parser = choice::<Loop>(Loop::NAMES))]
    pub loop_mode: Loop,
    /// Use a clip's detected face boxes as they are, without temporal smoothing.
    #[arg(long)]
    pub no_smooth: bool,
    /// Frame rate of a photo's video: a number in (0, 60] or a fraction such as 30000/1001
    /// (a clip runs at its own rate).
    #[arg(long, default_value = "25")]
    pub fps: Fps,
    /// How the predicted face is put back: feather (soft lower-face mask) or hard (whole box).
    #[arg(long, default_value = "feather", value_parser = choice::<Blend>(Blend::NAMES))]
    pub blend: Blend,
    /// Output MP4.
    #[arg(long, default_value = "out.mp4")]
    pub out: PathBuf,
    /// Also write every predicted 96x96 face as a PNG (00000.png, 00001.png, ...; larger
    /// when an enhancer ran on it).
    #[arg(long)]
    pub faces_dir: Option<PathBuf>,
    /// Also write every composited frame, whole, as a PNG (00000.png, ...; before the
    /// conversion for the encoder; the frames held after the speech are not repeated).
    #[arg(long)]
    pub frames_dir: Option<PathBuf>,
    /// Run an enhancer loaded with --enhancer-checkpoint on every predicted face: its kind
    /// (esrgan, gfpgan) when one of that kind is loaded, or its name (the file's stem); none
    /// for none. GFPGAN restores the pasted face aligned by the avatar's landmarks
    /// (--landmarks, or placed in the box).
    #[arg(long, default_value = "none")]
    pub enhance: String,
    /// Run many renders with the model loaded once: a JSON Lines file, one object per line with
    /// the keys audio, out and image or video (required) and box, pads, fps, loop, smooth,
    /// blend, crf, preset, faces_dir, frames_dir, enhance.
    #[arg(
        long,
        conflicts_with_all = ["audio", "image", "video", "face_box", "faces_dir", "frames_dir"]
    )]
    pub jobs: Option<PathBuf>,
    /// The model, its instances and the batcher: the same engine as `lipsync serve`.
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub media: MediaArgs,
}

/// One render: the flags, or a line of a jobs file.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Job {
    audio: PathBuf,
    image: Option<PathBuf>,
    video: Option<PathBuf>,
    out: PathBuf,
    #[serde(rename = "box")]
    face_box: Option<String>,
    pads: Option<String>,
    landmarks: Option<String>,
    fps: Option<serde_json::Value>,
    #[serde(rename = "loop")]
    loop_mode: Option<String>,
    smooth: Option<bool>,
    blend: Option<Blend>,
    crf: Option<u8>,
    preset: Option<String>,
    faces_dir: Option<PathBuf>,
    frames_dir: Option<PathBuf>,
    enhance: Option<String>,
}

/// The avatar of a job: a photo or a clip.
enum AvatarFile {
    Image(PathBuf),
    Video(PathBuf),
}

/// A job with every option resolved.
struct Resolved {
    audio: PathBuf,
    avatar: AvatarFile,
    out: PathBuf,
    face_box: Option<FaceBox>,
    pads: Pads,
    landmarks: Option<Landmarks>,
    fps: Fps,
    loop_mode: Loop,
    smooth: bool,
    blend: Blend,
    crf: u8,
    preset: String,
    keep: Keep,
    /// The enhancer asked for (resolved against the loaded ones when the job runs).
    enhance: String,
}

impl Job {
    /// Fills unset keys from the command line's defaults and parses the rest.
    fn resolve(self, a: &RenderArgs) -> Result<Resolved, String> {
        let fps = match &self.fps {
            None => a.fps,
            Some(serde_json::Value::Number(n)) => {
                Fps::new(n.as_f64().unwrap_or(f64::NAN)).map_err(|e| e.to_string())?
            }
            Some(serde_json::Value::String(s)) => s
                .parse()
                .map_err(|e: lipsync::media::Error| e.to_string())?,
            Some(v) => return Err(format!("fps {v} is not a number")),
        };
        let preset = self.preset.unwrap_or_else(|| a.media.preset.clone());
        if !video::PRESETS.contains(&preset.as_str()) {
            return Err(format!("unknown preset {preset:?}"));
        }
        let crf = video::check_crf(self.crf.unwrap_or(a.media.crf)).map_err(|e| e.to_string())?;
        let avatar = match (self.image, self.video) {
            (Some(i), None) => AvatarFile::Image(i),
            (None, Some(v)) => AvatarFile::Video(v),
            _ => return Err("give exactly one of image and video".into()),
        };
        if self.smooth.is_some() && matches!(avatar, AvatarFile::Image(_)) {
            return Err("smooth applies to a video avatar only".into());
        }
        let loop_mode = match &self.loop_mode {
            Some(l) => l
                .parse()
                .map_err(|e: lipsync::media::Error| e.to_string())?,
            None => a.loop_mode,
        };
        Ok(Resolved {
            audio: self.audio,
            avatar,
            out: self.out,
            loop_mode,
            smooth: self.smooth.unwrap_or(!a.no_smooth),
            face_box: self
                .face_box
                .map(|b| b.parse())
                .transpose()
                .map_err(|e: lipsync::media::Error| e.to_string())?,
            pads: self
                .pads
                .map(|p| p.parse())
                .transpose()
                .map_err(|e: lipsync::media::Error| e.to_string())?
                .unwrap_or(a.pads),
            landmarks: self
                .landmarks
                .map(|l| l.parse())
                .transpose()
                .map_err(|e: lipsync::media::Error| e.to_string())?,
            fps,
            blend: self.blend.unwrap_or(a.blend),
            crf,
            preset,
            keep: Keep {
                faces: self.faces_dir,
                frames: self.frames_dir,
            },
            enhance: self.enhance.unwrap_or_else(|| a.enhance.clone()),
        })
    }
}

pub fn render(a: RenderArgs) -> Result<(), CliError> {
    video::check_ffmpeg(&a.media.ffmpeg)?;
    let cfg = a.engine.resolve(&a.media);
    let t = Instant::now();
    // Warm-up measures batch costs for a server's batcher; one render on the CPU skips it.
    let warm_up = cfg.device == lipsync::model::DeviceKind::Cuda;
    let enhancers = a.engine.load_enhancers(&cfg)?;
    // Checked before the model loads: a render that asks for a missing enhancer stops now.
    enhancers.resolve(Some(&a.enhance))?;
    let (engine, summary) = a.engine.start_engine(&cfg, warm_up, enhancers)?;
    engine
        .wait_ready()
        .map_err(|e| CliError::Model(lipsync::model::Error::Device(e)))?;
    tracing::info!(
        "loaded {} on {:?} ({} instance(s), batches up to {}) in {:.1} s",
        match (&a.engine.checkpoint, &summary) {
            (Some(path), Some(s)) => format!("{} ({})", path.display(), s.format),
            _ => "the echo stand-in (no checkpoint)".to_string(),
        },
        cfg.device,
        cfg.instances,
        cfg.max_batch,
        t.elapsed().as_secs_f64()
    );
    let result = match &a.jobs {
        None => {
            let job = Job {
                audio: a.audio.clone().expect("clap requires --audio"),
                image: a.image.clone(),
                video: a.video.clone(),
                out: a.out.clone(),
                face_box: None,
                pads: None,
                landmarks: None,
                fps: None,
                loop_mode: None,
                smooth: None,
                blend: None,
                crf: None,
                preset: None,
                faces_dir: a.faces_dir.clone(),
                frames_dir: a.frames_dir.clone(),
                enhance: None,
            };
            let mut job = job.resolve(&a).map_err(CliError::Jobs)?;
            job.face_box = a.face_box;
            job.landmarks = a.landmarks;
            render_one(&a, &engine, &cfg, &job)
        }
        Some(path) => run_jobs(&a, &engine, &cfg, path),
    };
    engine.shutdown();
    result
}

fn run_jobs(
    a: &RenderArgs,
    engine: &Engine,
    cfg: &EngineConfig,
    path: &Path,
) -> Result<(), CliError> {
    let file = std::fs::File::open(path).map_err(|source| CliError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let (mut done, mut failed) = (0usize, Vec::new());
    let start = Instant::now();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| CliError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        let label = format!("{}:{}", path.display(), n + 1);
        let result = serde_json::from_str::<Job>(&line)
            .map_err(|e| format!("not a job ({e})"))
            .and_then(|j| j.resolve(a))
            .and_then(|j| render_one(a, engine, cfg, &j).map_err(|e| e.to_string()));
        match result {
            Ok(()) => done += 1,
            Err(e) => {
                eprintln!("error: job {label}: {e}");
                failed.push(label);
            }
        }
    }
    eprintln!(
        "{} jobs in {:.1} s: {done} succeeded, {} failed{}",
        done + failed.len(),
        start.elapsed().as_secs_f64(),
        failed.len(),
        if failed.is_empty() {
            String::new()
        } else {
            format!(" ({})", failed.join(", "))
        }
    );
    if failed.is_empty() {
        Ok(())
    } else {
        Err(CliError::Jobs(format!(
            "{} of {} jobs failed",
            failed.len(),
            done + failed.len()
        )))
    }
}

/// Writes to `<out>.partial` and renames on success, so a failed render leaves no
/// half-written video under the requested name.
fn render_one(
    a: &RenderArgs,
    engine: &Engine,
    cfg: &EngineConfig,
    job: &Resolved,
) -> Result<(), CliError> {
    let start = Instant::now();
    let speech = Speech {
        bytes: read_file(&job.audio)?.into(),
        file: Some(job.audio.clone()),
    };
    let avatar = match &job.avatar {
        AvatarFile::Image(path) => Avatar::prepare(
            &read_file(path)?,
            &a.media.image_limits(),
            job.face_box,
            job.pads,
            job.blend,
        )?,
        AvatarFile::Video(path) => engine::clip::prepare(
            &read_file(path)?,
            &a.media.clip_options(job.smooth),
            job.face_box,
            job.pads,
            job.blend,
        )?,
    };
    let avatar = match job.landmarks {
        Some(l) => avatar.with_landmarks(l)?,
        None => avatar,
    };
    let source_face = avatar.source_face;
    let avatar = Arc::new(avatar);
    let enhance = engine.enhancers().resolve(Some(&job.enhance))?;
    let restores = enhance.as_ref().is_some_and(|e| e.restores());
    let work = Work {
        speech,
        avatar: avatar.clone(),
        options: Options {
            fps: job.fps,
            loop_mode: job.loop_mode,
            blend: job.blend,
            crf: Some(job.crf),
            preset: Some(job.preset.clone()),
            enhance,
        },
        class: Class::Interactive,
        keep: job.keep.clone(),
    };
    let settings = pipeline::Settings::new(a.media.max_audio_seconds, |w, h, fps| {
        a.media.encoder(w, h, fps, cfg.encoder_workers)
    });
    let partial = partial_path(&job.out);
    let file = std::fs::File::create(&partial).map_err(|source| engine::Error::Output {
        path: partial.clone(),
        source,
    })?;
    let sink = Box::new(std::io::BufWriter::new(file));
    let bar = progress_bar(&job.out);
    let result = pipeline::start(engine, &settings, work, sink)
        .map_err(|e| match e {
            StartError::Overloaded(o) => CliError::Jobs(format!(
                "the engine's queue is full ({} frames waiting)",
                o.queued
            )),
            StartError::Failed(e) => e.into(),
        })
        .and_then(|started| {
            let about = (
                started.fps(),
                started.speech_seconds(),
                started.model_frames(),
            );
            let stats = started.run(&|| false, &mut |done, total| {
                if let Some(b) = &bar {
                    b.set_length(total as u64);
                    b.set_position(done as u64);
                }
            })?;
            Ok((about, stats))
        });
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let ((fps, speech_seconds, model_frames), stats) = match result {
        Ok(r) => r,
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
    };
    std::fs::rename(&partial, &job.out).map_err(|source| engine::Error::Output {
        path: job.out.clone(),
        source,
    })?;
    // A restored render says where its landmarks came from (the detector may have run).
    let landmarks = if restores {
        format!("; landmarks from {}", avatar.landmarks_source().as_str())
    } else {
        String::new()
    };
    eprintln!(
        "wrote {}: {} frames at {} fps ({model_frames} drawn by the model), {:.2} s of speech, {:.1} MB, in {:.1} s \
         (waiting for the model {:.1} s, composite {:.1} s, encode {:.1} s); face box {}{landmarks}",
        job.out.display(),
        stats.video_frames,
        fps,
        speech_seconds,
        stats.summary.bytes as f64 / 1e6,
        start.elapsed().as_secs_f64(),
        stats.model_wait.as_secs_f64(),
        stats.composite_time.as_secs_f64(),
        stats.encode_time.as_secs_f64(),
        source_face,
    );
    Ok(())
}

fn partial_path(out: &Path) -> PathBuf {
    let mut p = out.as_os_str().to_owned();
    p.push(".partial");
    PathBuf::from(p)
}

/// A progress bar on a terminal; nothing when stderr is a pipe or file.
fn progress_bar(out: &Path) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {pos}/{len} frames {elapsed} (eta {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_message(out.display().to_string());
    Some(bar)
}

#[derive(Debug, clap::Args)]
pub struct DetectArgs {
    /// Photo: PNG, JPEG or WebP.
    pub image: PathBuf,
    /// Pixels added to the detected box: top,bottom,left,right.
    #[arg(long, default_value = "0,10,0,0", allow_hyphen_values = true)]
    pub pads: Pads,
    /// Photos with more pixels are refused.
    #[arg(long, default_value_t = DEFAULT_MAX_PIXELS)]
    pub max_pixels: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn detect(a: DetectArgs) -> Result<(), CliError> {
    let result = (|| {
        let photo = lipsync::media::image::decode(&read_file(&a.image)?, a.max_pixels)?;
        let d = face::detect(&photo)?;
        let padded = a.pads.apply(d.face, photo.width, photo.height)?;
        Ok((photo, d, padded))
    })();
    let (photo, d, padded) = json_error(a.json, result)?;
    if a.json {
        println!(
            "{:#}",
            serde_json::json!({
                "box": padded.to_array(),
                "score": d.score,
                "pads": a.pads.to_string(),
                "unpadded": d.face.to_array(),
                "detector_window": d.window.to_array(),
                "width": photo.width,
                "height": photo.height,
            })
        );
    } else {
        println!("{padded}");
        eprintln!(
            "face box x1,y1,x2,y2 = {padded} (pads {}; score {:.2}) in a {}x{} photo; \
             reuse it with --box {padded}",
            a.pads, d.score, photo.width, photo.height
        );
    }
    Ok(())
}
