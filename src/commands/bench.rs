//! `bench`: model-only frames/s and device memory by batch size, precision and convolution
//! path; one instance against several at the same frames in flight; accuracy of every
//! precision and path against an exact f32 reference; load and warm-up time with and without
//! the autotune cache; encoder frames/s; end-to-end seconds and time to first byte through
//! the service's pipeline (pool, batcher, job, compositor, encoder), without HTTP; and the
//! media side of the real service on the echo device (`media`, see [`media`]).
//!
//! `--sections` runs only some parts, so a time-boxed run (a GPU stage) takes what fits. The
//! instance, autotune and end-to-end parts run in the precision `serve` would run
//! (`--service-dtype` to choose another); the model and accuracy parts in every `--dtypes`.

mod enhancers;
mod media;
mod model_runs;

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{DType, Tensor};
use clap::Parser;
use lipsync::config::{choice, EngineArgs, MediaArgs, Resolved};
use lipsync::engine::pipeline::{self, Class, Options, Speech, Work};
use lipsync::engine::{Avatar, Engine};
use lipsync::media::audio::{self, Fps};
use lipsync::media::face::{Blend, Pads};
use lipsync::media::image::ImageLimits;
use lipsync::media::video::{self, EncoderSettings};
use lipsync::model::arch::{FACE_CHANNELS, FACE_SIZE, MEL_BINS, MEL_STEPS};
use lipsync::model::{self, DeviceKind, GeneratorWeights, Precision, Wav2Lip};

use super::{read_file, CliError};

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Wav2Lip checkpoint (any form; `lipsync init-weights` output is fine: speed does not
    /// depend on the values). Every section but media needs one (and --video none).
    #[arg(long, env = "LIPSYNC_CHECKPOINT")]
    pub checkpoint: Option<PathBuf>,
    /// Where the model runs [default: cuda when built with CUDA and a GPU is present, else cpu].
    /// echo (the model stand-in) runs only the media section, which always runs on it.
    #[arg(long, value_parser = choice::<DeviceKind>(DeviceKind::NAMES))]
    pub device: Option<DeviceKind>,
    /// The GPU to measure, numbered from 0 as CUDA numbers them, as `serve --cuda-device`
    /// (ignored on the CPU).
    #[arg(long, env = "LIPSYNC_CUDA_DEVICE", default_value_t = 0)]
    pub cuda_device: usize,
    /// Parts to run, comma-separated (they run in this order whatever the order given):
    /// model (frames/s and device memory by dtype, convolution path and batch), instances
    /// (one instance against several at the same frames in flight), accuracy (every dtype and
    /// path against an exact f32 reference), autotune (load and warm-up without and with the
    /// autotune cache file), encoder, e2e, layers (each layer's time in one forward pass of
    /// the own cuDNN path, by batch), memory (the planned path's arena peak per batch size,
    /// no GPU needed), compare (the model path's configurations of --compare-configs in one
    /// process: each upsampling form timed per layer, frames/s, per-layer times, peak memory
    /// and accuracy; CUDA), media (the real service on the echo device as a child process:
    /// requests on a photo, a 720p photo and a 720p clip with their CPU against one ffmpeg's
    /// encode of the same video, one core against two, live sessions; no checkpoint needed;
    /// with its model and a checkpoint by --media-device),
    /// enhancers (each --enhancer-checkpoint's faces/s by batch, and the seconds
    /// it adds to a request of --enhance-seconds on the echo device; no Wav2Lip checkpoint
    /// needed) [default: all but memory, compare, media and enhancers; encoder
    /// only with --encode-frames above 0, layers only on CUDA; with --device echo: media].
    #[arg(long, value_delimiter = ',', value_parser = choice::<Section>(Section::NAMES))]
    pub sections: Vec<Section>,
    /// Precisions of the model and accuracy runs, comma-separated [default: f32,f16,bf16 on
    /// CUDA, f32 on CPU].
    #[arg(long, value_delimiter = ',', value_parser = choice::<Precision>(Precision::NAMES))]
    pub dtypes: Vec<Precision>,
    /// Precision of the instance, autotune and end-to-end runs [default: the one `serve`
    /// runs: f16 on CUDA, f32 on CPU].
    #[arg(long, value_parser = choice::<Precision>(Precision::NAMES))]
    pub service_dtype: Option<Precision>,
    #[command(flatten)]
    pub conv: lipsync::config::ConvArgs,
    /// Batch sizes to measure [default: 1,16,64,128,256,512 on CUDA, 1,4,16 on CPU]. The
    /// autotune run warms up as `serve --max-batch` the largest. The enhancers section
    /// measures these batches too when given [default there: 1,4,16, and 64 on CUDA;
    /// a restorer's stop at 4].
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub batches: Vec<u32>,
    /// On CUDA, measure candle's operations (the reference path beside the own cuDNN path)
    /// only up to this batch: they are slow at large batches [default: every batch].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub candle_max_batch: Option<u32>,
    /// Instance counts for the concurrency run [default: 1,2,3 on CUDA, 1,2 on CPU].
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=64))]
    pub instances: Vec<u32>,
    /// Frames in flight in the concurrency run, split evenly among the instances: one
    /// instance runs batches of this size, three run a third each [default: 384 on CUDA, 4 on
    /// CPU].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub instance_batch: Option<u32>,
    /// Seconds to measure each configuration.
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// Also write the accuracy run's inputs here (safetensors: f32 `mel` (N, 1, 80, 16) and
    /// `face` (N, 6, 96, 96)), for `bench/pytorch_reference.py --inputs`.
    #[arg(long)]
    pub accuracy_inputs: Option<PathBuf>,
    /// Frames to encode in the encoder-only run (0 skips it): 1000 is 40 s of video.
    #[arg(long, default_value_t = 1000)]
    pub encode_frames: usize,
    /// Encoder worker counts for the encoder-only run [default: 1, 2, 4, 8, 16 up to the
    /// number of cores, and the serve default].
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..=64))]
    pub encoder_workers: Vec<u16>,
    /// Seconds of speech for the end-to-end runs [default: 10,40 on CUDA, 10 on CPU].
    #[arg(long, value_delimiter = ',')]
    pub e2e: Vec<f64>,
    /// Speech for the accuracy and end-to-end runs (looped to length).
    #[arg(long, default_value = "tests/media/arctic_a0007.wav")]
    pub audio: PathBuf,
    /// Avatar for the accuracy, encoder and end-to-end runs.
    #[arg(long, default_value = "tests/media/astronaut.png")]
    pub image: PathBuf,
    /// Measure a clip avatar instead of the model: its preparation and size, and compositing
    /// plus encoding on it vs on a photo vs x264 alone (no model, no checkpoint needed).
    #[arg(long)]
    pub video: Option<PathBuf>,
    /// Also write the results as JSON here (rewritten after each part).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// An enhancer's checkpoint (repeatable), for the enhancers section: faces/s of each on
    /// 96x96 faces in f32 where `serve` runs them (batches 1 and 16 on the CPU, 1, 16 and 64
    /// on CUDA), and what it adds to a request.
    #[arg(long = "enhancer-checkpoint", value_name = "FILE")]
    pub enhancer_checkpoint: Vec<PathBuf>,
    /// Seconds of speech of the enhancers section's request, run on the echo device once
    /// plain and once with each enhancer (what `enhance` adds to a request); 0 skips it.
    #[arg(long, default_value_t = 4.0)]
    pub enhance_seconds: f64,
    /// The ffmpeg executable.
    #[arg(long, env = "LIPSYNC_FFMPEG", default_value = "ffmpeg")]
    pub ffmpeg: PathBuf,
    /// Internal (the autotune part runs it in a fresh process, since the process keeps its
    /// algorithm choices): time one instance's load and warm-up as `serve` does it, print
    /// JSON.
    #[arg(long, hide = true)]
    pub autotune_probe: bool,
    /// The configurations the compare section runs, comma-separated, at most 4, each
    /// UPSAMPLING:EPILOGUE:INPUT_PAD:ARENA (the --conv-* flags' values) [default: the old
    /// default subpixel:separate:none:on, auto:auto:8:on, and two ablations: auto:own:8:on
    /// (no cuDNN fusion) and auto:auto:none:on (unpadded inputs)].
    #[arg(long, value_delimiter = ',')]
    pub compare_configs: Vec<String>,
    #[command(flatten)]
    pub media: media::MediaFlags,
}

/// A part of the bench.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Section {
    Model,
    Instances,
    Accuracy,
    Autotune,
    Encoder,
    E2e,
    Layers,
    Memory,
    Compare,
    Media,
    Enhancers,
}

impl Section {
    /// The names `FromStr` accepts, in running order.
    pub const NAMES: &'static [&'static str] = &[
        "model",
        "instances",
        "accuracy",
        "autotune",
        "encoder",
        "e2e",
        "layers",
        "memory",
        "compare",
        "media",
        "enhancers",
    ];
    const ALL: [Section; 11] = [
        Section::Model,
        Section::Instances,
        Section::Accuracy,
        Section::Autotune,
        Section::Encoder,
        Section::E2e,
        Section::Layers,
        Section::Memory,
        Section::Compare,
        Section::Media,
        Section::Enhancers,
    ];

    fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }
}

impl std::str::FromStr for Section {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::NAMES
            .iter()
            .position(|&n| n == s.trim())
            .map(|i| Self::ALL[i])
            .ok_or_else(|| format!("{s:?} is not a bench section ({})", Self::NAMES.join(", ")))
    }
}

/// A bench run with the device-dependent defaults filled in.
#[derive(Debug, Clone, PartialEq)]
struct Plan {
    device: DeviceKind,
    /// The GPU on CUDA (`--cuda-device`).
    cuda_device: usize,
    sections: Vec<Section>,
    dtypes: Vec<Precision>,
    /// The precision of the instance, autotune and end-to-end runs.
    service: Precision,
    /// Whether `service` was given (`--service-dtype`) rather than serve's.
    service_given: bool,
    batches: Vec<usize>,
    instances: Vec<usize>,
    /// Frames in flight in the concurrency run.
    instance_frames: usize,
    e2e: Vec<f64>,
}

impl Plan {
    /// Table header cells, one per batch size: `batch 64{unit} | batch 512{unit}`.
    fn batch_columns(&self, unit: &str) -> String {
        self.batches
            .iter()
            .map(|b| format!("batch {b}{unit}"))
            .collect::<Vec<_>>()
            .join(" | ")
    }

    /// Fills in the defaults for `device` (no device is opened).
    fn new(a: &BenchArgs, device: DeviceKind) -> Result<Plan, CliError> {
        let cuda = device == DeviceKind::Cuda;
        let or = |v: &[u32], d: &[usize]| -> Vec<usize> {
            if v.is_empty() {
                d.to_vec()
            } else {
                v.iter().map(|&x| x as usize).collect()
            }
        };
        let mut sections = if a.sections.is_empty() && device == DeviceKind::Echo {
            vec![Section::Media]
        } else if a.sections.is_empty() {
            Section::ALL
                .into_iter()
                .filter(|&s| s != Section::Encoder || a.encode_frames > 0)
                .filter(|&s| s != Section::Layers || cuda)
                .filter(|&s| {
                    !matches!(
                        s,
                        Section::Memory | Section::Compare | Section::Media | Section::Enhancers
                    )
                })
                .collect()
        } else {
            if a.sections.contains(&Section::Encoder) && a.encode_frames == 0 {
                return Err(CliError::Jobs(
                    "--sections encoder needs --encode-frames above 0".into(),
                ));
            }
            if a.sections.contains(&Section::Enhancers) && a.enhancer_checkpoint.is_empty() {
                return Err(CliError::Jobs(
                    "--sections enhancers needs --enhancer-checkpoint FILE".into(),
                ));
            }
            a.sections.clone()
        };
        sections.sort();
        sections.dedup();
        if device == DeviceKind::Echo {
            if let Some(s) = sections
                .iter()
                .find(|&&s| !matches!(s, Section::Media | Section::Enhancers))
            {
                return Err(CliError::Jobs(format!(
                    "--device echo runs only --sections media (the {} section measures a model)",
                    s.name()
                )));
            }
        }
        if sections.contains(&Section::Media) {
            a.media.check().map_err(CliError::Jobs)?;
            if a.media.media_device != DeviceKind::Echo && a.checkpoint.is_none() {
                return Err(CliError::Jobs(format!(
                    "--media-device {} needs --checkpoint (a Wav2Lip checkpoint; `lipsync \
                     init-weights FILE` writes random weights, as fast as real ones)",
                    a.media.media_device.name()
                )));
            }
        }
        let dtypes = if !a.dtypes.is_empty() {
            a.dtypes.clone()
        } else if cuda {
            vec![Precision::F32, Precision::F16, Precision::Bf16]
        } else {
            vec![Precision::F32]
        };
        let e2e = if !a.e2e.is_empty() {
            a.e2e.clone()
        } else if cuda {
            vec![10.0, 40.0]
        } else {
            vec![10.0]
        };
        if let Some(s) = e2e.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            return Err(CliError::Jobs(format!(
                "--e2e {s}: seconds must be above 0"
            )));
        }
        let service = match a.service_dtype {
            Some(p) => p,
            None => serve_settings(device, a.cuda_device, &[])?.1.precision,
        };
        Ok(Plan {
            device,
            cuda_device: a.cuda_device,
            sections,
            dtypes,
            service,
            service_given: a.service_dtype.is_some(),
            batches: or(
                &a.batches,
                if cuda {
                    &[1, 16, 64, 128, 256, 512]
                } else {
                    &[1, 4, 16]
                },
            ),
            instances: or(&a.instances, if cuda { &[1, 2, 3] } else { &[1, 2] }),
            instance_frames: a
                .instance_batch
                .map_or(if cuda { 384 } else { 4 }, |b| b as usize),
            e2e,
        })
    }

    fn largest_batch(&self) -> usize {
        self.batches.iter().copied().max().unwrap_or(1)
    }

    /// The service precision and where it came from, e.g. `f16 (serve's default on cuda)`.
    fn service_text(&self) -> String {
        let name = self.service.dtype().as_str();
        if self.service_given {
            format!("{name} (--service-dtype)")
        } else {
            format!("{name} (serve's default on {})", device_name(self.device))
        }
    }
}

/// Batch of each of `n` instances sharing `frames` frames in flight (at least 1).
fn per_instance_batch(frames: usize, n: usize) -> usize {
    (frames / n.max(1)).max(1)
}

fn device_name(d: DeviceKind) -> &'static str {
    d.name()
}

/// `serve`'s engine and media flags.
#[derive(Parser)]
struct ServeFlags {
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    media: MediaArgs,
}

/// The engine settings `serve` runs with on `device`, given `flags` (the others at serve's
/// defaults, or from the `LIPSYNC_*` variables serve reads): one source for the defaults.
fn serve_settings(
    device: DeviceKind,
    cuda_device: usize,
    flags: &[String],
) -> Result<(EngineArgs, Resolved), CliError> {
    let s = serve_flags(device, cuda_device, flags)?;
    let r = s.engine.resolve(&s.media);
    Ok((s.engine, r))
}

/// `serve`'s flags on `device` given `flags`, as [`serve_settings`] reads them (the media
/// flags too: the encoder's preset, quality and threads).
fn serve_flags(
    device: DeviceKind,
    cuda_device: usize,
    flags: &[String],
) -> Result<ServeFlags, CliError> {
    let mut argv: Vec<String> = [
        "serve",
        "--checkpoint",
        "-",
        "--device",
        device_name(device),
        "--cuda-device",
        &cuda_device.to_string(),
    ]
    .map(String::from)
    .to_vec();
    argv.extend(flags.iter().cloned());
    ServeFlags::try_parse_from(argv).map_err(|e| CliError::Jobs(format!("serve's settings: {e}")))
}

/// Runs `f` repeatedly for at least `seconds` (and 3 times); returns (runs, elapsed).
fn timed(
    seconds: f64,
    mut f: impl FnMut() -> Result<(), CliError>,
) -> Result<(usize, std::time::Duration), CliError> {
    let start = Instant::now();
    let mut runs = 0;
    while runs < 3 || start.elapsed().as_secs_f64() < seconds {
        f()?;
        runs += 1;
    }
    Ok((runs, start.elapsed()))
}

fn inputs(n: usize, dev: &candle_core::Device) -> Result<(Tensor, Tensor), CliError> {
    let mel =
        Tensor::randn(0f32, 1.0, (n, 1, MEL_BINS, MEL_STEPS), dev).map_err(model::Error::from)?;
    let face = Tensor::rand(0f32, 1.0, (n, FACE_CHANNELS, FACE_SIZE, FACE_SIZE), dev)
        .map_err(model::Error::from)?;
    Ok((mel, face))
}

/// One forward, waited for (reading a scalar back synchronises the device): the plain pass,
/// or with `guarded` the service's (with the half-precision overflow check the model was
/// given, [`Wav2Lip::forward_guarded`]).
fn forward_sync(
    model: &Wav2Lip,
    mel: &Tensor,
    face: &Tensor,
    guarded: bool,
) -> Result<(), CliError> {
    let out = if guarded {
        model.forward_guarded(mel, face)?.0
    } else {
        model.forward(mel, face)?
    };
    out.to_dtype(DType::F32)
        .and_then(|t| t.sum_all())
        .and_then(|t| t.to_scalar::<f32>())
        .map_err(model::Error::from)?;
    Ok(())
}

pub fn bench(a: BenchArgs) -> Result<(), CliError> {
    if let Some(clip) = &a.video {
        let results = super::bench_clip::bench_clip(&a, clip)?;
        if let Some(path) = &a.json {
            write_json(path, &results)?;
        }
        return Ok(());
    }
    a.conv.apply()?;
    let device = a.device.unwrap_or_else(DeviceKind::default_for_host);
    let plan = Plan::new(&a, device)?;
    // The media section runs the service on echo: no model, no checkpoint.
    let model_sections = a.autotune_probe
        || plan
            .sections
            .iter()
            .any(|&s| !matches!(s, Section::Media | Section::Enhancers));
    let (checkpoint, weights) = if model_sections {
        let checkpoint = a.checkpoint.clone().ok_or_else(|| {
            CliError::Jobs(
                "--checkpoint is needed by every bench section but media (and by none with \
                 --video)"
                    .into(),
            )
        })?;
        let (weights, _) = GeneratorWeights::from_file(&checkpoint)?;
        (checkpoint, Some(Arc::new(weights.fold()?)))
    } else {
        (PathBuf::new(), None)
    };
    if a.autotune_probe {
        return model_runs::autotune_probe(&plan, weights.expect("loaded"));
    }
    let weights = || weights.as_ref().expect("loaded for the model sections");
    let mut results = serde_json::json!({
        "device": device, "host_cpus": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "version": env!("CARGO_PKG_VERSION"), "sections": plan.sections,
        "dtypes": plan.dtypes, "service_dtype": plan.service, "batches": plan.batches,
    });
    let save = |results: &serde_json::Value| match &a.json {
        Some(path) => write_json(path, results),
        None => Ok(()),
    };
    if model_sections {
        println!(
            "Sections: {}; device {}; instance, autotune and end-to-end runs in {}.\n",
            plan.sections
                .iter()
                .map(|s| s.name())
                .collect::<Vec<_>>()
                .join(", "),
            device_name(device),
            plan.service_text()
        );
    } else {
        println!(
            "Sections: {} (no Wav2Lip model in this process{}).",
            plan.sections
                .iter()
                .map(|s| s.name())
                .collect::<Vec<_>>()
                .join(", "),
            match a.media.media_device {
                DeviceKind::Echo => String::new(),
                d => format!("; the media section's servers run it on {}", d.name()),
            }
        );
    }
    let mut prepared = None;
    let mut avatar = || -> Result<Avatar, CliError> {
        if prepared.is_none() {
            prepared = Some(Avatar::prepare(
                &read_file(&a.image)?,
                &ImageLimits::default(),
                None,
                Pads::default(),
                Blend::Feather,
            )?);
        }
        Ok(prepared.clone().expect("prepared"))
    };
    for &section in &plan.sections {
        match section {
            Section::Model => {
                let (rows, memory) = model_runs::model(&a, &plan, weights())?;
                results["model"] = rows;
                results["memory"] = memory;
            }
            Section::Instances => {
                results["instances"] = model_runs::instances(&a, &plan, weights())?
            }
            Section::Accuracy => {
                results["accuracy"] = model_runs::accuracy(&a, &plan, weights(), &avatar()?)?
            }
            Section::Autotune => {
                results["autotune"] = model_runs::autotune(&a, &plan, &checkpoint)?
            }
            Section::Encoder => results["encoder"] = encoder(&a, &plan, &avatar()?)?,
            Section::E2e => results["end_to_end"] = end_to_end(&a, &plan, weights(), &avatar()?)?,
            Section::Layers => results["layers"] = model_runs::layers(&plan, weights())?,
            Section::Memory => results["planned_memory"] = model_runs::memory(&a, &plan)?,
            Section::Compare => results["compare"] = model_runs::compare(&a, &plan, weights())?,
            Section::Media => results["media"] = media::media(&a)?,
            Section::Enhancers => {
                results["enhancers"] =
                    enhancers::enhancers(&a, &avatar()?, plan.device, plan.cuda_device)?
            }
        }
        save(&results)?;
    }
    Ok(())
}

/// x264 alone on frames of the avatar, by encoder worker count (and serve's count).
fn encoder(a: &BenchArgs, plan: &Plan, avatar: &Avatar) -> Result<serde_json::Value, CliError> {
    let serve_workers = serve_settings(plan.device, plan.cuda_device, &[])?
        .1
        .encoder_workers;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut workers: Vec<usize> = a.encoder_workers.iter().map(|&w| w as usize).collect();
    if workers.is_empty() {
        workers = [1, 2, 4, 8, 16]
            .into_iter()
            .filter(|&w| w <= cores)
            .collect();
        if !workers.contains(&serve_workers) {
            workers.push(serve_workers);
        }
    }
    let frames = moving_frames(avatar, 50);
    let (w, h) = (avatar.frame.width, avatar.frame.height);
    println!(
        "\n## Encoder only ({} frames of {w}x{h}, x264 veryfast crf 20, fragmented MP4; {cores} cores)\n",
        a.encode_frames
    );
    println!("| encoder workers | x264 threads each | frames/s | seconds | vs one worker |");
    println!("|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut one = None;
    for &n in &workers {
        let mut settings = EncoderSettings::new(w, h, Fps::DEFAULT);
        settings.ffmpeg = a.ffmpeg.clone();
        settings.workers = n;
        let threads = if n == 1 {
            "auto".to_string()
        } else {
            settings.worker_threads().to_string()
        };
        let t = Instant::now();
        let mut enc = video::spawn(settings, Box::new(std::io::sink()))?;
        for i in 0..a.encode_frames {
            enc.write_frame(&frames[i % frames.len()])?;
        }
        enc.finish()?;
        let secs = t.elapsed().as_secs_f64();
        let fps = a.encode_frames as f64 / secs;
        let base = *one.get_or_insert(fps);
        println!(
            "| {n} | {threads} | {fps:.1} | {secs:.2} | {:.2}x |",
            fps / base
        );
        rows.push(
            serde_json::json!({ "workers": n, "threads": threads, "fps": fps, "seconds": secs }),
        );
    }
    Ok(serde_json::json!({ "frames": a.encode_frames, "width": w, "height": h, "runs": rows }))
}

/// Whole requests through the engine `serve` would start (its instances, batch sizes and
/// encoder workers), in the service precision.
fn end_to_end(
    a: &BenchArgs,
    plan: &Plan,
    weights: &Arc<GeneratorWeights>,
    avatar: &Avatar,
) -> Result<serde_json::Value, CliError> {
    let dtype = plan.service.dtype().as_str().to_string();
    let (args, r) = serve_settings(plan.device, plan.cuda_device, &["--dtype".into(), dtype])?;
    println!(
        "\n## End to end ({}, {} instance(s), batches up to {}; pool, batcher, compositor, \
         encoder with {} worker(s); no HTTP)\n",
        plan.service_text(),
        r.instances,
        r.max_batch,
        r.encoder_workers
    );
    println!("| speech | model frames | video frames | total | time to first byte |");
    println!("|---|---|---|---|---|");
    let loader = lipsync::engine::backend::Wav2LipLoader::new(
        weights.clone(),
        r.device,
        r.cuda_device,
        r.max_batch,
    );
    let mut cfg = args.pool_config(&r);
    cfg.limits.max_queue = usize::MAX;
    let engine = Engine::start(Arc::new(loader), cfg);
    engine.wait_ready().map_err(CliError::Jobs)?;
    let conv_path = engine.status().conv_path().unwrap_or("unknown");
    let clip = audio::load(&read_file(&a.audio)?, 3600.0)?.samples;
    let settings = request_settings(a, r.encoder_workers);
    let mut rows = Vec::new();
    for &seconds in &plan.e2e {
        let run = request(
            &engine,
            &settings,
            avatar,
            &clip,
            seconds,
            Options::default(),
        )?;
        println!(
            "| {seconds} s | {} | {} | {:.2} s | {:.2} s |",
            run.model_frames, run.video_frames, run.seconds, run.ttfb_seconds
        );
        rows.push(serde_json::json!({
            "dtype": plan.service, "instances": r.instances, "max_batch": r.max_batch,
            "conv_path": conv_path, "encoder_workers": r.encoder_workers,
            "speech_seconds": seconds, "model_frames": run.model_frames,
            "video_frames": run.video_frames, "seconds": run.seconds,
            "ttfb_seconds": run.ttfb_seconds
        }));
    }
    engine.shutdown();
    Ok(serde_json::Value::Array(rows))
}

/// The renders' shared settings for [`request`]: `serve`'s encoder with `workers` workers.
fn request_settings(a: &BenchArgs, workers: usize) -> pipeline::Settings {
    pipeline::Settings::new(3600.0, |w, h, fps| {
        let mut s = EncoderSettings::new(w, h, fps);
        s.ffmpeg = a.ffmpeg.clone();
        s.workers = workers;
        s
    })
}

/// One whole request through the pipeline, as the service runs it, without HTTP.
struct RequestRun {
    model_frames: usize,
    video_frames: u64,
    seconds: f64,
    ttfb_seconds: f64,
}

/// Renders `seconds` of `clip` (16 kHz, looped to length) on `avatar` with `options`,
/// discarding the video.
fn request(
    engine: &Engine,
    settings: &pipeline::Settings,
    avatar: &Avatar,
    clip: &[f32],
    seconds: f64,
    options: Options,
) -> Result<RequestRun, CliError> {
    let n = (seconds * 16_000.0) as usize;
    let samples: Vec<f32> = clip.iter().copied().cycle().take(n).collect();
    let wav = tempfile::Builder::new()
        .suffix(".wav")
        .tempfile()
        .map_err(|e| CliError::Jobs(e.to_string()))?;
    write_wav(wav.path(), &samples)?;
    let speech = Speech::file(wav.path()).map_err(|source| CliError::Read {
        path: wav.path().to_path_buf(),
        source,
    })?;
    let start = Instant::now();
    let first = Arc::new(Mutex::new(None));
    let sink = FirstByte {
        start,
        first: first.clone(),
    };
    let work = Work {
        speech,
        avatar: Arc::new(avatar.clone()),
        options,
        class: Class::Interactive,
        keep: Default::default(),
    };
    let started = pipeline::start(engine, settings, work, Box::new(sink))
        .map_err(|e| CliError::Jobs(e.to_string()))?;
    let model_frames = started.model_frames();
    let summary = started.run(&|| false, &mut |_, _| {})?.summary;
    let seconds = start.elapsed().as_secs_f64();
    let ttfb_seconds = first.lock().unwrap().unwrap_or(f64::NAN);
    Ok(RequestRun {
        model_frames,
        video_frames: summary.frames,
        seconds,
        ttfb_seconds,
    })
}

fn write_json(path: &std::path::Path, results: &serde_json::Value) -> Result<(), CliError> {
    std::fs::write(path, serde_json::to_vec_pretty(results).unwrap_or_default()).map_err(|source| {
        CliError::Read {
            path: path.to_path_buf(),
            source,
        }
    })
}

/// `n` different frames of the avatar, as lip sync makes them: the picture stays, the face
/// box changes from frame to frame (a moving texture, so x264 has real work there).
fn moving_frames(avatar: &Avatar, n: usize) -> Vec<lipsync::media::image::Frame> {
    let f = &avatar.frame;
    let b = avatar.face;
    (0..n)
        .map(|i| {
            let mut frame = f.clone();
            for y in b.y1 as usize..(b.y2 as usize).min(f.height as usize) {
                for x in b.x1 as usize..(b.x2 as usize).min(f.width as usize) {
                    let p = (y * f.width as usize + x) * 3;
                    for c in 0..3 {
                        let t = ((x * 7 + y * 3 + i * 11 + c * 13) % 64) as u8;
                        frame.rgb[p + c] = frame.rgb[p + c] / 2 + 2 * t;
                    }
                }
            }
            frame
        })
        .collect()
}

/// Discards the video, noting when its first byte came.
struct FirstByte {
    start: Instant,
    first: Arc<Mutex<Option<f64>>>,
}

impl Write for FirstByte {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.first
            .lock()
            .unwrap()
            .get_or_insert_with(|| self.start.elapsed().as_secs_f64());
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn write_wav(path: &std::path::Path, samples: &[f32]) -> Result<(), CliError> {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 16_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let err = |e: hound::Error| CliError::Jobs(format!("cannot write {}: {e}", path.display()));
    let mut w = hound::WavWriter::create(path, spec).map_err(err)?;
    for s in samples {
        w.write_sample((s.clamp(-1.0, 1.0) * 32767.0) as i16)
            .map_err(err)?;
    }
    w.finalize().map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `lipsync bench` flags as clap parses them.
    fn args(flags: &[&str]) -> BenchArgs {
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            bench: BenchArgs,
        }
        let mut argv = vec!["bench", "--checkpoint", "w.safetensors"];
        argv.extend(flags);
        Cli::try_parse_from(argv).unwrap().bench
    }

    #[test]
    fn the_service_runs_use_serves_precision_not_the_first_listed() {
        // f32 is listed first, but serve runs f16 on CUDA: the instance, autotune and
        // end-to-end runs measure f16.
        let cuda = Plan::new(&args(&["--dtypes", "f32,f16,bf16"]), DeviceKind::Cuda).unwrap();
        assert_eq!(cuda.dtypes[0], Precision::F32);
        assert_eq!(cuda.service, Precision::F16);
        assert_eq!(cuda.service_text(), "f16 (serve's default on cuda)");
        let cpu = Plan::new(&args(&["--dtypes", "bf16,f32"]), DeviceKind::Cpu).unwrap();
        assert_eq!(cpu.service, Precision::F32);
        // An explicit choice wins, and says so.
        let given = Plan::new(&args(&["--service-dtype", "bf16"]), DeviceKind::Cuda).unwrap();
        assert_eq!(given.service, Precision::Bf16);
        assert_eq!(given.service_text(), "bf16 (--service-dtype)");
    }

    #[test]
    fn sections_run_in_a_fixed_order_and_default_to_all_that_apply() {
        let all = Plan::new(&args(&[]), DeviceKind::Cpu).unwrap();
        assert_eq!(all.sections, Section::ALL[..6].to_vec());
        let all = Plan::new(&args(&[]), DeviceKind::Cuda).unwrap();
        assert_eq!(all.sections, Section::ALL[..7].to_vec());
        let named = Plan::new(&args(&["--sections", "compare,memory"]), DeviceKind::Cpu).unwrap();
        assert_eq!(named.sections, [Section::Memory, Section::Compare]);
        let no_encoder = Plan::new(&args(&["--encode-frames", "0"]), DeviceKind::Cpu).unwrap();
        assert!(!no_encoder.sections.contains(&Section::Encoder));
        assert!(no_encoder.sections.contains(&Section::E2e));
        let some = Plan::new(
            &args(&["--sections", "autotune,model,accuracy,model"]),
            DeviceKind::Cuda,
        )
        .unwrap();
        assert_eq!(
            some.sections,
            [Section::Model, Section::Accuracy, Section::Autotune]
        );
        assert!(Plan::new(
            &args(&["--sections", "encoder", "--encode-frames", "0"]),
            DeviceKind::Cpu
        )
        .is_err());
        assert!("kernels".parse::<Section>().is_err());
        assert_eq!(Section::E2e.name(), "e2e");
    }

    #[test]
    fn media_runs_only_when_named_and_is_all_echo_runs() {
        let all = Plan::new(&args(&[]), DeviceKind::Cuda).unwrap();
        assert!(!all.sections.contains(&Section::Media));
        let echo = Plan::new(&args(&[]), DeviceKind::Echo).unwrap();
        assert_eq!(echo.sections, [Section::Media]);
        let named = Plan::new(&args(&["--sections", "media,model"]), DeviceKind::Cpu).unwrap();
        assert_eq!(named.sections, [Section::Model, Section::Media]);
        // echo draws no faces: the model sections would measure nothing.
        assert!(Plan::new(&args(&["--sections", "media,model"]), DeviceKind::Echo).is_err());
        assert!(Plan::new(
            &args(&["--sections", "media", "--media-seconds", "0"]),
            DeviceKind::Echo
        )
        .is_err());
        let a = args(&["--sections", "media", "--live-sessions", "1,3"]);
        assert_eq!(a.media.live_sessions, [1, 3]);
        assert_eq!(args(&[]).media.live_sessions, [1, 2, 4, 8, 16, 32, 64]);
        assert_eq!(Section::Media.name(), "media");
        // The same parts against the service with its model: only with a checkpoint.
        let mut with = args(&["--sections", "media", "--media-device", "cuda"]);
        assert!(Plan::new(&with, DeviceKind::Cuda).is_ok());
        assert_eq!(with.media.media_device, DeviceKind::Cuda);
        with.checkpoint = None;
        assert!(Plan::new(&with, DeviceKind::Cuda).is_err());
        assert_eq!(args(&[]).media.media_device, DeviceKind::Echo);
        let parts = args(&[
            "--media-parts",
            "requests,live",
            "--live-avatars",
            "photo",
            "--live-outputs",
            "fmp4",
            "--media-serve-arg=--autotune-cache=a.json",
            "--media-serve-arg",
            "--max-sessions=300",
        ]);
        assert_eq!(parts.media.media_parts, ["requests", "live"]);
        assert_eq!(parts.media.live_avatars, ["photo"]);
        assert_eq!(parts.media.live_outputs, ["fmp4"]);
        assert_eq!(
            parts.media.media_serve_args,
            ["--autotune-cache=a.json", "--max-sessions=300"]
        );
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            _bench: BenchArgs,
        }
        for bad in [["--media-parts", "floors"], ["--live-outputs", "webm"]] {
            assert!(Cli::try_parse_from([&["bench"][..], &bad[..]].concat()).is_err());
        }
    }

    #[test]
    fn instances_share_the_frames_in_flight() {
        let plan = Plan::new(&args(&["--instances", "1,3"]), DeviceKind::Cuda).unwrap();
        assert_eq!(plan.instance_frames, 384);
        let batches: Vec<usize> = plan
            .instances
            .iter()
            .map(|&n| per_instance_batch(plan.instance_frames, n))
            .collect();
        assert_eq!(batches, [384, 128]);
        // Never an empty batch.
        assert_eq!(per_instance_batch(1, 2), 1);
    }

    #[test]
    fn defaults_follow_the_device() {
        let cuda = Plan::new(&args(&[]), DeviceKind::Cuda).unwrap();
        assert_eq!(cuda.batches, [1, 16, 64, 128, 256, 512]);
        assert_eq!(
            cuda.dtypes,
            [Precision::F32, Precision::F16, Precision::Bf16]
        );
        let cpu = Plan::new(&args(&["--batches", "1,2"]), DeviceKind::Cpu).unwrap();
        assert_eq!(
            (cpu.batches.as_slice(), cpu.largest_batch()),
            (&[1, 2][..], 2)
        );
        assert_eq!(cpu.dtypes, [Precision::F32]);
        assert!(Plan::new(&args(&["--e2e", "0"]), DeviceKind::Cpu).is_err());
    }
}
