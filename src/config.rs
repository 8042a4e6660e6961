//! The engine and media flags that `serve` and `render` share: one definition (with its
//! `LIPSYNC_*` environment variable and its `--help` text), one place where the
//! device-dependent defaults are filled in. `serve` adds the HTTP flags
//! ([`crate::server::ServeArgs`]), `render` its input and output flags.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::engine::backend::Wav2LipLoader;
use crate::engine::batcher::Limits;
use crate::engine::clip::ClipOptions;
use crate::engine::enhance::Enhancers;
use crate::engine::pool::PoolConfig;
use crate::engine::Engine;
use crate::media::audio::DEFAULT_MAX_SECONDS;
use crate::media::image::{ImageLimits, DEFAULT_MAX_PIXELS, DEFAULT_MAX_SIDE};
use crate::media::video::clip::{ClipLimits, DEFAULT_MAX_CLIP_SECONDS};
use crate::media::video::{self, EncoderSettings, PRESETS};
use crate::model::cudnn::{
    Arena, ConvEngine, ConvLayout, ConvSettings, Epilogue, InputPad, Upsampling,
};
use crate::model::{self, DeviceKind, GeneratorWeights, Precision};

/// The model, its instances and the batcher.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// Wav2Lip checkpoint: any form `lipsync convert` reads (legacy or zip torch.save,
    /// whole-module pickle, TorchScript, safetensors). Needed on cpu and cuda; optional
    /// with --device echo, which draws no faces.
    #[arg(long, env = "LIPSYNC_CHECKPOINT")]
    pub checkpoint: Option<PathBuf>,
    /// Where the model runs [default: cuda when built with CUDA and a GPU is present, else
    /// cpu]. echo is a model stand-in that costs nothing (each face is the frame's reference
    /// face with the mouth moved, no checkpoint needed), with a GPU's defaults: for measuring
    /// and testing everything but the model on any machine.
    #[arg(long, env = "LIPSYNC_DEVICE", value_parser = choice::<DeviceKind>(DeviceKind::NAMES))]
    pub device: Option<DeviceKind>,
    /// The GPU the model instances run on and whose memory /metrics reports, numbered from 0
    /// as CUDA numbers them (after CUDA_VISIBLE_DEVICES); a number with no GPU stops
    /// start-up. Accepted and ignored on the CPU (--device cpu, or a build without CUDA).
    #[arg(long, env = "LIPSYNC_CUDA_DEVICE", default_value_t = 0)]
    pub cuda_device: usize,
    /// Model precision [default: f16 on CUDA, f32 on CPU; bf16 on the CPU computes in f32].
    #[arg(long, env = "LIPSYNC_DTYPE", value_parser = choice::<Precision>(Precision::NAMES))]
    pub dtype: Option<Precision>,
    /// Model instances, each on its own thread (and CUDA stream) [default: 3 on CUDA, 1 on CPU].
    #[arg(long, env = "LIPSYNC_INSTANCES", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub instances: Option<u32>,
    /// Largest batch of frames per model call [default: 512 on CUDA, 16 on CPU].
    #[arg(long, visible_alias = "batch", env = "LIPSYNC_MAX_BATCH", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_batch: Option<u32>,
    /// Frames of a new request in its first batch, so its video starts streaming early
    /// [default: 16 on CUDA, 4 on CPU].
    #[arg(long, env = "LIPSYNC_FIRST_BATCH", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub first_batch: Option<u32>,
    /// While a new request waits for its first frames, the rest of that batch is filled with
    /// running requests' frames up to the size the instances compute within this many
    /// milliseconds (measured at warm-up), instead of running a small batch.
    #[arg(long, env = "LIPSYNC_FILL_LATENCY_MS", default_value_t = 150)]
    pub fill_latency_ms: u64,
    /// How long the batcher may wait for more frames to fill a batch, in milliseconds.
    #[arg(long, env = "LIPSYNC_BATCH_WAIT_MS", default_value_t = 2)]
    pub batch_wait_ms: u64,
    /// Run model batches at fixed sizes (powers of two up to --max-batch, padded with copies),
    /// so warm-up covers every shape served [default: true on CUDA, false on CPU].
    #[arg(long, env = "LIPSYNC_PAD_BATCHES", value_parser = clap::builder::BoolishValueParser::new())]
    pub pad_batches: Option<bool>,
    /// Device memory each model instance may use, e.g. 20G or 512M: a batch estimated to need
    /// more is treated as out of memory (split and retried smaller) [default: no limit].
    #[arg(long, env = "LIPSYNC_GPU_MEMORY_LIMIT", value_parser = parse_bytes)]
    pub gpu_memory_limit: Option<u64>,
    #[command(flatten)]
    pub conv: ConvArgs,
    /// Frames waiting for the model that could run now, across all requests (each request
    /// counts at most its --max-ahead-frames); a request that would exceed it is refused with
    /// 429 and Retry-After [default: 50000 on CUDA, 2000 on CPU].
    #[arg(long, env = "LIPSYNC_MAX_QUEUE_FRAMES")]
    pub max_queue_frames: Option<usize>,
    /// Frames the model may compute ahead of a request's encoder and client, so a slow reader
    /// holds back its own work instead of piling up frames [default: twice the largest batch].
    #[arg(long, env = "LIPSYNC_MAX_AHEAD_FRAMES")]
    pub max_ahead_frames: Option<usize>,
    /// An enhancer's checkpoint as published (Real-ESRGAN's realesr-general-x4v3.pth,
    /// realesr-animevideov3.pth, RealESRGAN_x4plus.pth or RealESRGAN_x2plus.pth; GFPGAN's
    /// GFPGANv1.4.pth or GFPGANv1.3.pth; the kind is recognised from its keys). A RetinaFace
    /// file (detection_Resnet50_Final.pth, mobilenet0.25_Final.pth) loads the landmark
    /// detector that finds avatars' landmarks for GFPGAN. Repeatable (the variable: comma-separated). Requests pick one
    /// with `enhance` (a kind when one of that kind is loaded, or the file's stem). A missing,
    /// damaged or unrecognised file stops start-up. Enhancers run in f32: on the CPU with cpu
    /// and echo, on the GPU with cuda (their weights and activations then come out of
    /// --gpu-memory-limit).
    #[arg(
        long = "enhancer-checkpoint",
        value_name = "FILE",
        env = "LIPSYNC_ENHANCER_CHECKPOINT",
        value_delimiter = ','
    )]
    pub enhancer_checkpoint: Vec<PathBuf>,
    /// Instances that run the enhancers, beside the model's (each with its own copy of the
    /// enhancers' weights on a GPU; on the CPU each batch already uses every core). The model
    /// instances hand them the faces that ask for an enhancer and go on drawing; live faces
    /// go first.
    #[arg(
        long = "enhancer-instances",
        value_name = "N",
        env = "LIPSYNC_ENHANCER_INSTANCES",
        default_value_t = 1,
        value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(1..=64), usize::from)
    )]
    pub enhancer_instances: usize,
}

/// The convolution-path flags of `serve`, `render` and `bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct ConvArgs {
    /// Convolution path on CUDA: own cuDNN calls with timed algorithm choice, or candle's
    /// operations (the reference). Each instance checks the cuDNN path at start-up and falls
    /// back to candle's if it is not accurate enough.
    #[arg(long, env = "LIPSYNC_CONV_ENGINE", default_value = "cudnn", value_parser = choice::<ConvEngine>(ConvEngine::NAMES))]
    pub conv_engine: ConvEngine,
    /// JSON file keeping the timed cuDNN algorithm choices, so a restart skips the search
    /// (its directory must be writable) [default: none, kept in memory].
    #[arg(long, env = "LIPSYNC_AUTOTUNE_CACHE")]
    pub autotune_cache: Option<PathBuf>,
    /// Activation layout between the cuDNN path's layers: nhwc (channels last, what
    /// half-precision tensor-core kernels read without conversions) or nchw (candle's).
    #[arg(long, env = "LIPSYNC_CONV_LAYOUT", default_value = "nhwc", value_parser = choice::<ConvLayout>(ConvLayout::NAMES))]
    pub conv_layout: ConvLayout,
    /// How the cuDNN path runs the decoder's stride-2 transposed convolutions: subpixel (one
    /// 3×3 forward convolution to four phases of output channels, then a pixel shuffle: 4× the
    /// multiply-adds), subpixel2x2 (a 2×2 window: 1.78×), phases (four phase convolutions:
    /// 1×), transposed (cuDNN's backward-data convolution: 1×), or auto (every form timed per
    /// layer and batch during warm-up, the fastest kept in the autotune cache).
    #[arg(long, env = "LIPSYNC_CONV_UPSAMPLING", default_value = "auto", value_parser = choice::<Upsampling>(Upsampling::NAMES))]
    pub conv_upsampling: Upsampling,
    /// What follows each convolution on the cuDNN path: own (one kernel of lipsync's applies
    /// bias + ReLU + residual, the pixel shuffle, and writes into the layer's slice of the
    /// skip concatenation, the output's sigmoid included; activations planned in one arena),
    /// auto (as own, but cuDNN's fused convolution where it was timed faster), or separate
    /// (layer by layer: bias, shuffle, concatenation and sigmoid as separate operations).
    /// own needs --conv-layout nhwc; with nchw, auto runs the separate path.
    #[arg(long, env = "LIPSYNC_CONV_EPILOGUE", default_value = "auto", value_parser = choice::<Epilogue>(Epilogue::NAMES))]
    pub conv_epilogue: Epilogue,
    /// Pad the 6-channel face and 1-channel mel inputs to 8 channels (zero channels and zero
    /// weights), so half-precision tensor-core NHWC kernels apply to the first layers.
    #[arg(long, env = "LIPSYNC_CONV_INPUT_PAD", default_value = "8", value_parser = choice::<InputPad>(InputPad::NAMES))]
    pub conv_input_pad: InputPad,
    /// With --conv-epilogue own or auto: the activations in one device arena per instance,
    /// planned from the graph's liveness (on), or allocated one by one (off).
    #[arg(long, env = "LIPSYNC_CONV_ARENA", default_value = "on", value_parser = choice::<Arena>(Arena::NAMES))]
    pub conv_arena: Arena,
    /// The most workspace one cuDNN convolution may use, e.g. 256M or 2G: faster algorithms
    /// that need more are not considered. The search allocates this much once during warm-up.
    #[arg(long, env = "LIPSYNC_CUDNN_WORKSPACE", default_value = "256M", value_parser = parse_bytes)]
    pub cudnn_workspace: u64,
}

impl ConvArgs {
    /// Makes these the process's settings (see [`crate::model::cudnn::configure`]), or says
    /// why they cannot run together.
    pub fn apply(&self) -> Result<(), model::Error> {
        let settings = self.settings();
        settings.check().map_err(model::Error::Settings)?;
        crate::model::cudnn::configure(settings);
        Ok(())
    }

    /// The settings these flags give.
    pub fn settings(&self) -> ConvSettings {
        ConvSettings {
            engine: self.conv_engine,
            cache_file: self.autotune_cache.clone(),
            layout: self.conv_layout,
            workspace_limit: self.cudnn_workspace as usize,
            upsampling: self.conv_upsampling,
            epilogue: self.conv_epilogue,
            input_pad: self.conv_input_pad,
            arena: self.conv_arena,
        }
    }
}

/// A flag value that is one of `names`, parsed with the type's `FromStr` (the model and media
/// layers know nothing of clap; their enums list their names).
pub fn choice<T>(names: &'static [&'static str]) -> impl clap::builder::TypedValueParser<Value = T>
where
    T: std::str::FromStr + Clone + Send + Sync + 'static,
    T::Err: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
{
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(names).try_map(|s| s.parse::<T>())
}

/// Decoding limits and the encoder.
#[derive(Debug, Clone, clap::Args)]
pub struct MediaArgs {
    /// Largest image in pixels (checked from its header before decoding); larger is refused.
    #[arg(long, env = "LIPSYNC_MAX_PIXELS", default_value_t = DEFAULT_MAX_PIXELS)]
    pub max_pixels: u64,
    /// Photos longer than this on their long side are downscaled before rendering.
    #[arg(long, env = "LIPSYNC_MAX_SIDE", default_value_t = DEFAULT_MAX_SIDE)]
    pub max_side: u32,
    /// Longest avatar clip in seconds; longer is refused (413 avatar_too_long).
    #[arg(long, env = "LIPSYNC_MAX_AVATAR_SECONDS", default_value_t = DEFAULT_MAX_CLIP_SECONDS)]
    pub max_avatar_seconds: f64,
    /// Longest audio in seconds; longer is refused.
    #[arg(long, env = "LIPSYNC_MAX_AUDIO_SECONDS", default_value_t = DEFAULT_MAX_SECONDS)]
    pub max_audio_seconds: f64,
    /// The ffmpeg executable (needs libx264 and aac).
    #[arg(long, env = "LIPSYNC_FFMPEG", default_value = "ffmpeg")]
    pub ffmpeg: PathBuf,
    /// x264 preset of rendered videos (requests, jobs, `render`); live sessions have
    /// `--live-preset`.
    #[arg(long, env = "LIPSYNC_PRESET", default_value = "veryfast", value_parser = clap::builder::PossibleValuesParser::new(PRESETS))]
    pub preset: String,
    /// x264 quality, 0 (lossless) to 51 (worst): the default when a request or job gives none.
    #[arg(long, env = "LIPSYNC_CRF", default_value_t = 20, value_parser = clap::value_parser!(u8).range(0..=51))]
    pub crf: u8,
    /// x264 threads per encoder process [default: ffmpeg's choice with one worker, the
    /// cores shared among the workers with several].
    #[arg(long, env = "LIPSYNC_ENCODER_THREADS", value_parser = clap::value_parser!(u16).range(1..=256))]
    pub encoder_threads: Option<u16>,
    /// x264 preset of live sessions' fMP4 output: one x264 per session at 25 fps, where the
    /// CPU per frame decides how many sessions the cores carry. (The CPU offer weighs a video
    /// avatar's live frame as measured at the defaults; a slower preset or no cap makes
    /// such sessions dearer, which the offer learns as their frames go out.)
    #[arg(long, env = "LIPSYNC_LIVE_PRESET", default_value = "ultrafast", value_parser = clap::builder::PossibleValuesParser::new(PRESETS))]
    pub live_preset: String,
    /// Cap on a live session's video bit rate, bits per second (`2M`, `1500k`, `2500000`;
    /// `0`: no cap, `--crf` alone decides): a stream a viewer's connection carries. `--crf` is
    /// the quality below it; with the cap's one-second buffer any T seconds of video carry at
    /// most T + 1 seconds' worth.
    #[arg(long, env = "LIPSYNC_LIVE_MAX_BITRATE", default_value = "2M", value_parser = parse_bitrate)]
    pub live_max_bitrate: u64,
    /// x264 processes per stream, encoding one-second segments in parallel (1-64) [default:
    /// one per core, at most 8, on cuda and echo; 1 on cpu, where the model is the bottleneck].
    #[arg(long, env = "LIPSYNC_ENCODER_WORKERS", value_parser = clap::value_parser!(u16).range(1..=64))]
    pub encoder_workers: Option<u16>,
}

/// A bit rate in bits per second: `2500000`, `1500k`, `2M`, `2.5M` (powers of 1000, as bit
/// rates go); `0` for none. Anything else must be a cap x264 can keep
/// ([`crate::media::video::check_max_bitrate`]).
pub fn parse_bitrate(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1e3),
        Some('M' | 'm') => (&t[..t.len() - 1], 1e6),
        _ => (t, 1.0),
    };
    let v = num
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v >= 0.0)
        .ok_or_else(|| format!("{s:?} is not a bit rate (e.g. 2M, 1500k, 2500000, 0 for none)"))?;
    if v == 0.0 {
        return Ok(0);
    }
    // Anything else is a cap, however small (which the check refuses).
    let bits = (v * mult).round();
    crate::media::video::check_max_bitrate(if bits > u64::MAX as f64 {
        u64::MAX
    } else {
        bits as u64
    })
}

/// `1000`, `512K`, `20M`, `8G` (powers of 1024 for the suffixes).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim()
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a size (e.g. 8G, 512M, 1000000)"))
}

/// Settings with the device-dependent defaults filled in.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub device: DeviceKind,
    /// The GPU (`--cuda-device`), used only when `device` is CUDA.
    pub cuda_device: usize,
    pub precision: Precision,
    pub instances: usize,
    pub max_batch: usize,
    pub first_batch: usize,
    pub max_queue_frames: usize,
    pub max_ahead_frames: usize,
    pub pad_batches: bool,
    pub encoder_workers: usize,
}

impl EngineArgs {
    /// Fills in the defaults for the device (`encoder_workers` from `media`).
    pub fn resolve(&self, media: &MediaArgs) -> Resolved {
        let device = self.device.unwrap_or_else(DeviceKind::default_for_host);
        // Echo stands in for a GPU: it takes a GPU's defaults.
        let cuda = device.gpu_like();
        let max_batch = self
            .max_batch
            .map_or(if cuda { 512 } else { 16 }, |b| b as usize);
        let first_batch = self
            .first_batch
            .map_or(if cuda { 16 } else { 4 }, |b| b as usize)
            .min(max_batch);
        Resolved {
            device,
            cuda_device: self.cuda_device,
            precision: self.dtype.unwrap_or(device.default_precision()),
            instances: self
                .instances
                .map_or(if cuda { 3 } else { 1 }, |n| n as usize),
            max_batch,
            first_batch,
            max_queue_frames: self
                .max_queue_frames
                .unwrap_or(if cuda { 50_000 } else { 2_000 }),
            max_ahead_frames: self.max_ahead_frames.unwrap_or(2 * max_batch).max(1),
            pad_batches: self.pad_batches.unwrap_or(cuda),
            encoder_workers: media
                .encoder_workers
                .map_or_else(|| video::default_workers(cuda), |n| n as usize),
        }
    }

    /// The pool configuration for `r` (from [`EngineArgs::resolve`]).
    pub fn pool_config(&self, r: &Resolved) -> PoolConfig {
        PoolConfig {
            precision: r.precision,
            instances: r.instances,
            limits: Limits {
                max_batch: r.max_batch,
                first_batch: r.first_batch,
                fill_batch: r.first_batch,
                max_queue: r.max_queue_frames,
                max_ahead: r.max_ahead_frames,
            },
            batch_wait: Duration::from_millis(self.batch_wait_ms),
            pad_batches: r.pad_batches,
            memory_limit: self.gpu_memory_limit,
            warm_up: true,
            fill_latency: Duration::from_millis(self.fill_latency_ms),
            // The planned path's memory estimate where it runs: on a GPU with the arena.
            planned_memory: {
                let s = self.conv.settings();
                (r.device == DeviceKind::Cuda && s.planned() && s.arena == Arena::On).then_some(s)
            },
        }
    }

    /// The checkpoint, or why there is none to run: every device but echo needs one.
    pub fn checkpoint_for(&self, device: DeviceKind) -> Result<Option<&PathBuf>, model::Error> {
        match (&self.checkpoint, device) {
            (Some(path), _) => Ok(Some(path)),
            (None, DeviceKind::Echo) => Ok(None),
            (None, _) => Err(model::Error::Settings(format!(
                "--checkpoint (or LIPSYNC_CHECKPOINT) is needed on --device {}: a Wav2Lip \
                 checkpoint (`lipsync init-weights FILE` writes random test weights); only \
                 --device echo runs without one",
                device.name()
            ))),
        }
    }

    /// Reads the `--enhancer-checkpoint` files and measures each one's cost (see
    /// [`Enhancers::load`]): on CUDA their weights go to the GPU (`--cuda-device`) and they
    /// run there, on the CPU (and echo) on the CPU.
    pub fn load_enhancers(&self, r: &Resolved) -> Result<Arc<Enhancers>, model::Error> {
        if self.enhancer_checkpoint.is_empty() {
            return Ok(Arc::default());
        }
        // The convolution settings first: on CUDA the enhancers' own cuDNN path reads them
        // (and they are set once per process).
        if r.device == DeviceKind::Cuda {
            self.conv.apply()?;
        }
        // One device per enhancer instance: on CUDA each with its own stream, as the model
        // instances have.
        let devices = (0..self.enhancer_instances)
            .map(|_| r.device.open_instance(r.cuda_device))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Arc::new(Enhancers::load(
            &self.enhancer_checkpoint,
            &devices,
        )?))
    }

    /// Checks that the device exists, reads the checkpoint and starts the engine's instances
    /// (they load and warm up in the background). Logs a warning for random test weights.
    /// On echo it reads no checkpoint (a given one is checked and ignored) and the summary
    /// is `None`.
    pub fn start_engine(
        &self,
        r: &Resolved,
        warm_up: bool,
        enhancers: Arc<Enhancers>,
    ) -> Result<(Engine, Option<model::weights::Summary>), model::Error> {
        r.device.check(r.cuda_device)?;
        let checkpoint = self.checkpoint_for(r.device)?;
        if r.device == DeviceKind::Echo {
            tracing::warn!(
                "--device echo: no faces are generated; every face is the frame's reference \
                 face with its mouth moved (for measuring and testing the media side)"
            );
            if let Some(path) = checkpoint {
                GeneratorWeights::from_file(path)?;
                tracing::info!("{} is readable; echo does not use it", path.display());
            }
            let mut cfg = self.pool_config(r);
            cfg.warm_up = warm_up;
            let loader = crate::engine::echo::EchoLoader;
            return Ok((
                Engine::start(Arc::new(loader), cfg).with_enhancers(enhancers),
                None,
            ));
        }
        self.conv.apply()?;
        let checkpoint = checkpoint.expect("checked above: only echo runs without one");
        let (mut weights, summary) = GeneratorWeights::from_file(checkpoint)?;
        if !weights.is_folded() {
            weights = weights.fold()?; // once for all instances
        }
        if let Some(seed) = summary.random_init_seed {
            tracing::warn!(
                "{} holds random test weights (seed {seed}): the faces they draw are noise",
                checkpoint.display()
            );
        }
        let loader = Wav2LipLoader::new(
            std::sync::Arc::new(weights),
            r.device,
            r.cuda_device,
            r.max_batch,
        );
        let mut cfg = self.pool_config(r);
        cfg.warm_up = warm_up;
        // The enhancers' instances hold their weights and activations on the same GPU: they
        // come out of the model instances' --gpu-memory-limit, shared evenly.
        let enhancer_bytes = enhancers
            .device_bytes()
            .div_ceil(cfg.instances.max(1) as u64);
        if let Some(limit) = cfg.memory_limit.filter(|_| enhancer_bytes > 0) {
            cfg.memory_limit = Some(limit.saturating_sub(enhancer_bytes));
            tracing::info!(
                "--gpu-memory-limit: {:.0} MB of each model instance's {:.0} MB go to the \
                 enhancers ({} instances: weights, and activations at {} faces)",
                enhancer_bytes as f64 / 1e6,
                limit as f64 / 1e6,
                enhancers.instances(),
                crate::engine::enhance::CHUNK
            );
        }
        Ok((
            Engine::start(Arc::new(loader), cfg).with_enhancers(enhancers),
            Some(summary),
        ))
    }
}

impl MediaArgs {
    /// How to prepare a clip avatar (`smooth`: temporal smoothing of detected boxes).
    pub fn clip_options(&self, smooth: bool) -> ClipOptions {
        ClipOptions {
            ffmpeg: self.ffmpeg.clone(),
            limits: ClipLimits {
                max_seconds: self.max_avatar_seconds,
                max_pixels: self.max_pixels,
            },
            max_side: self.max_side,
            smooth,
        }
    }

    pub fn image_limits(&self) -> ImageLimits {
        ImageLimits {
            max_pixels: self.max_pixels,
            max_side: self.max_side,
        }
    }

    /// Encoder settings for a `width`×`height` video at `fps` with this configuration's
    /// ffmpeg, threads and `workers`.
    pub fn encoder(
        &self,
        width: u32,
        height: u32,
        fps: crate::media::audio::Fps,
        workers: usize,
    ) -> EncoderSettings {
        let mut s = EncoderSettings::new(width, height, fps);
        s.preset = self.preset.clone();
        s.crf = self.crf;
        s.ffmpeg = self.ffmpeg.clone();
        s.threads = self.encoder_threads.map(usize::from);
        s.workers = workers;
        s
    }

    /// A live session's encoder for a `width`×`height` video at `fps`: one process with the
    /// live preset and bit-rate cap, and one x264 thread unless `--encoder-threads` says
    /// otherwise (the sessions give the parallelism; x264's own threads only add their
    /// overhead beside them).
    pub fn live_encoder(
        &self,
        width: u32,
        height: u32,
        fps: crate::media::audio::Fps,
    ) -> EncoderSettings {
        let mut s = self.encoder(width, height, fps, 1);
        s.preset = self.live_preset.clone();
        s.max_bitrate = (self.live_max_bitrate > 0).then_some(self.live_max_bitrate);
        s.threads.get_or_insert(1);
        s
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{parse_bitrate, parse_bytes, EngineArgs, MediaArgs};
    use crate::model::DeviceKind;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
        #[command(flatten)]
        media: MediaArgs,
    }

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(
            ["lipsync", "--checkpoint", "w.safetensors"]
                .iter()
                .chain(args),
        )
        .unwrap()
    }

    #[test]
    fn the_cuda_device_is_0_unless_a_flag_or_variable_says_otherwise() {
        // One test sets and clears the variable, so no other test sees it.
        std::env::remove_var("LIPSYNC_CUDA_DEVICE");
        let cli = parse(&["--device", "cuda"]);
        assert_eq!(cli.engine.cuda_device, 0);
        assert_eq!(cli.engine.resolve(&cli.media).cuda_device, 0);

        let cli = parse(&["--device", "cuda", "--cuda-device", "3"]);
        let r = cli.engine.resolve(&cli.media);
        assert_eq!((r.device, r.cuda_device), (DeviceKind::Cuda, 3));

        std::env::set_var("LIPSYNC_CUDA_DEVICE", "2");
        let from_env = parse(&["--device", "cuda"]);
        let flag_wins = parse(&["--device", "cuda", "--cuda-device", "1"]);
        std::env::remove_var("LIPSYNC_CUDA_DEVICE");
        assert_eq!(from_env.engine.resolve(&from_env.media).cuda_device, 2);
        assert_eq!(flag_wins.engine.cuda_device, 1);

        assert!(
            Cli::try_parse_from(["lipsync", "--checkpoint", "w", "--cuda-device", "-1"]).is_err()
        );
        assert!(
            Cli::try_parse_from(["lipsync", "--checkpoint", "w", "--cuda-device", "gpu1"]).is_err()
        );
    }

    #[test]
    fn the_cuda_device_is_accepted_and_ignored_on_the_cpu() {
        let cli = parse(&["--device", "cpu", "--cuda-device", "7"]);
        let r = cli.engine.resolve(&cli.media);
        assert_eq!((r.device, r.cuda_device), (DeviceKind::Cpu, 7));
        // Nothing to check: the CPU starts whatever the number.
        assert!(r.device.check(r.cuda_device).is_ok());
    }

    #[test]
    fn the_cudnn_path_defaults_to_the_planned_path_in_nhwc_and_takes_each_flag() {
        use crate::model::cudnn::{Arena, ConvEngine, ConvLayout, Epilogue, InputPad, Upsampling};
        let c = parse(&[]).engine.conv;
        assert_eq!(c.conv_engine, ConvEngine::Cudnn);
        assert_eq!(c.conv_layout, ConvLayout::Nhwc);
        assert_eq!(c.conv_upsampling, Upsampling::Auto);
        assert_eq!(c.cudnn_workspace, 256 << 20);
        assert_eq!(c.conv_epilogue, Epilogue::Auto);
        assert_eq!(c.conv_input_pad, InputPad::Eight);
        assert_eq!(c.conv_arena, Arena::On);
        let c = parse(&[
            "--conv-upsampling",
            "phases",
            "--conv-epilogue",
            "own",
            "--conv-input-pad",
            "none",
            "--conv-arena",
            "off",
        ])
        .engine
        .conv;
        assert_eq!(c.conv_upsampling, Upsampling::Phases);
        assert_eq!(c.conv_epilogue, Epilogue::Own);
        assert_eq!(c.conv_input_pad, InputPad::None);
        assert_eq!(c.conv_arena, Arena::Off);
        for up in ["auto", "subpixel2x2"] {
            let c = parse(&["--conv-upsampling", up]).engine.conv;
            assert_eq!(c.conv_upsampling.name(), up);
        }
        let c = parse(&[
            "--conv-layout",
            "nchw",
            "--conv-upsampling",
            "transposed",
            "--cudnn-workspace",
            "2G",
        ])
        .engine
        .conv;
        assert_eq!(c.conv_layout, ConvLayout::Nchw);
        assert_eq!(c.conv_upsampling, Upsampling::Transposed);
        assert_eq!(c.cudnn_workspace, 2 << 30);
        for bad in [
            ["--conv-layout", "chwn"],
            ["--conv-upsampling", "nearest"],
            ["--conv-epilogue", "fused"],
            ["--conv-input-pad", "16"],
            ["--conv-arena", "maybe"],
            ["--cudnn-workspace", "lots"],
        ] {
            let args = ["lipsync", "--checkpoint", "w", bad[0], bad[1]];
            assert!(Cli::try_parse_from(args).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert_eq!(parse_bytes("512K"), Ok(512 << 10));
        assert_eq!(parse_bytes("20m"), Ok(20 << 20));
        assert_eq!(parse_bytes("8G"), Ok(8 << 30));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("99999999999999999999G").is_err());
    }

    #[test]
    fn bit_rates_parse_in_powers_of_1000_and_0_is_no_cap() {
        assert_eq!(parse_bitrate("2M"), Ok(2_000_000));
        assert_eq!(parse_bitrate("2.5m"), Ok(2_500_000));
        assert_eq!(parse_bitrate("1500k"), Ok(1_500_000));
        assert_eq!(parse_bitrate("800000"), Ok(800_000));
        assert_eq!(parse_bitrate("0"), Ok(0));
        for bad in ["fast", "-2M", "10k", "3000M", "NaNk", "inf", "0.4", "1e-9M"] {
            assert!(parse_bitrate(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn live_sessions_encode_with_their_own_preset_and_cap_and_one_thread() {
        let fps = crate::media::audio::Fps::DEFAULT;
        let live = |m: &MediaArgs| {
            let l = m.live_encoder(512, 512, fps);
            assert_eq!(l.workers, 1);
            (l.preset, l.crf, l.max_bitrate, l.threads)
        };
        let m = parse(&[]).media;
        assert_eq!(live(&m), ("ultrafast".into(), 20, Some(2_000_000), Some(1)));
        // Files keep theirs.
        let file = m.encoder(512, 512, fps, 2);
        assert_eq!((file.preset.as_str(), file.max_bitrate), ("veryfast", None));
        let m = parse(&[
            "--live-preset",
            "veryfast",
            "--live-max-bitrate",
            "0",
            "--crf",
            "26",
            "--encoder-threads",
            "2",
        ])
        .media;
        assert_eq!(live(&m), ("veryfast".into(), 26, None, Some(2)));
        for bad in [["--live-preset", "instant"], ["--live-max-bitrate", "1k"]] {
            let args = ["lipsync", "--checkpoint", "w", bad[0], bad[1]];
            assert!(Cli::try_parse_from(args).is_err(), "{bad:?}");
        }
    }
}
