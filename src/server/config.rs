//! `lipsync serve` configuration: one struct, every field a flag with a `LIPSYNC_*`
//! environment variable; its doc comments are the `--help`.

use std::path::PathBuf;

use crate::media::audio::DEFAULT_MAX_SECONDS;
use crate::media::image::{DEFAULT_MAX_PIXELS, DEFAULT_MAX_SIDE};
use crate::media::video::{self, PRESETS};
use crate::model::{DeviceKind, Precision};

#[derive(Clone, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on (use 0.0.0.0 to accept connections from other hosts).
    #[arg(long, env = "LIPSYNC_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the address is logged).
    #[arg(long, env = "LIPSYNC_PORT", default_value_t = 8080)]
    pub port: u16,
    /// Wav2Lip checkpoint: any form `lipsync convert` reads (legacy or zip torch.save,
    /// whole-module pickle, TorchScript, safetensors).
    #[arg(long, env = "LIPSYNC_CHECKPOINT")]
    pub checkpoint: PathBuf,
    /// Where the model runs [default: cuda when built with CUDA and a GPU is present, else cpu].
    #[arg(long, env = "LIPSYNC_DEVICE", value_enum)]
    pub device: Option<DeviceKind>,
    /// Model precision [default: f16 on CUDA, f32 on CPU; bf16 on the CPU computes in f32].
    #[arg(long, env = "LIPSYNC_DTYPE", value_enum)]
    pub dtype: Option<Precision>,
    /// Model instances, each on its own thread (and CUDA stream) [default: 3 on CUDA, 1 on CPU].
    #[arg(long, env = "LIPSYNC_INSTANCES", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub instances: Option<u32>,
    /// Largest batch of frames per model call [default: 512 on CUDA, 16 on CPU].
    #[arg(long, env = "LIPSYNC_MAX_BATCH", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_batch: Option<u32>,
    /// Size of each request's first batch, so its video starts streaming early [default: 16
    /// on CUDA, 4 on CPU].
    #[arg(long, env = "LIPSYNC_FIRST_BATCH", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub first_batch: Option<u32>,
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
    pub conv: crate::model::cudnn::ConvArgs,
    /// Frames allowed to wait for the model across all requests; a request that would exceed
    /// it is refused with 429 and Retry-After [default: 50000 on CUDA, 2000 on CPU].
    #[arg(long, env = "LIPSYNC_MAX_QUEUE_FRAMES")]
    pub max_queue_frames: Option<usize>,
    /// Frames the model may compute ahead of a request's encoder and client, so a slow reader
    /// holds back its own work instead of piling up frames [default: twice the largest batch].
    #[arg(long, env = "LIPSYNC_MAX_AHEAD_FRAMES")]
    pub max_ahead_frames: Option<usize>,
    /// Requests streaming at once; more are refused with 429.
    #[arg(long, env = "LIPSYNC_MAX_REQUESTS", default_value_t = 32)]
    pub max_requests: usize,
    /// Largest request body in bytes (audio and image together); larger gets 413.
    #[arg(long, env = "LIPSYNC_MAX_BODY_BYTES", default_value_t = 64 << 20)]
    pub max_body_bytes: usize,
    /// Largest image in pixels (checked from its header before decoding); larger gets 413.
    #[arg(long, env = "LIPSYNC_MAX_PIXELS", default_value_t = DEFAULT_MAX_PIXELS)]
    pub max_pixels: u64,
    /// Photos longer than this on their long side are downscaled before rendering.
    #[arg(long, env = "LIPSYNC_MAX_SIDE", default_value_t = DEFAULT_MAX_SIDE)]
    pub max_side: u32,
    /// Longest audio in seconds; longer gets 413.
    #[arg(long, env = "LIPSYNC_MAX_AUDIO_SECONDS", default_value_t = DEFAULT_MAX_SECONDS)]
    pub max_audio_seconds: f64,
    /// Prepared avatars kept in memory (least recently used evicted first).
    #[arg(long, env = "LIPSYNC_AVATAR_CACHE_ENTRIES", default_value_t = 256)]
    pub avatar_cache_entries: usize,
    /// Memory for prepared avatars, in bytes.
    #[arg(long, env = "LIPSYNC_AVATAR_CACHE_BYTES", default_value_t = 1 << 30)]
    pub avatar_cache_bytes: u64,
    /// Seconds to let in-flight streams finish after SIGTERM/SIGINT before exiting.
    #[arg(long, env = "LIPSYNC_SHUTDOWN_TIMEOUT", default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// Require `Authorization: Bearer <key>` on every /v1/ route.
    #[arg(long, env = "LIPSYNC_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Origins allowed to call the API from a browser (comma-separated); no CORS headers
    /// otherwise.
    #[arg(long, env = "LIPSYNC_CORS_ORIGINS", value_delimiter = ',')]
    pub cors_origins: Vec<String>,
    /// The ffmpeg executable (needs libx264 and aac).
    #[arg(long, env = "LIPSYNC_FFMPEG", default_value = "ffmpeg")]
    pub ffmpeg: PathBuf,
    /// x264 preset of every stream.
    #[arg(long, env = "LIPSYNC_PRESET", default_value = "veryfast", value_parser = clap::builder::PossibleValuesParser::new(PRESETS))]
    pub preset: String,
    /// Default x264 quality (0-51) when a request gives no `crf`.
    #[arg(long, env = "LIPSYNC_CRF", default_value_t = 20, value_parser = clap::value_parser!(u8).range(0..=51))]
    pub crf: u8,
    /// x264 threads per encoder process [default: ffmpeg's choice with one worker, the
    /// cores shared among the workers with several].
    #[arg(long, env = "LIPSYNC_ENCODER_THREADS", value_parser = clap::value_parser!(u16).range(1..=256))]
    pub encoder_threads: Option<u16>,
    /// x264 processes per stream, encoding one-second segments in parallel (1-64) [default:
    /// half the cores, at most 8, on cuda; 1 on cpu, where the model is the bottleneck].
    #[arg(long, env = "LIPSYNC_ENCODER_WORKERS", value_parser = clap::value_parser!(u16).range(1..=64))]
    pub encoder_workers: Option<u16>,
}

/// The API key stays out of logs.
impl std::fmt::Debug for ServeArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeArgs")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("checkpoint", &self.checkpoint)
            .field("device", &self.device)
            .field("dtype", &self.dtype)
            .field("instances", &self.instances)
            .field("max_batch", &self.max_batch)
            .field("first_batch", &self.first_batch)
            .field("max_queue_frames", &self.max_queue_frames)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("cors_origins", &self.cors_origins)
            .finish_non_exhaustive()
    }
}

/// `1000`, `512K`, `20M`, `8G` (powers of 1024 for the suffixes).
fn parse_bytes(s: &str) -> Result<u64, String> {
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
    pub precision: Precision,
    pub instances: usize,
    pub max_batch: usize,
    pub first_batch: usize,
    pub max_queue_frames: usize,
    pub max_ahead_frames: usize,
    pub pad_batches: bool,
    pub encoder_workers: usize,
}

impl ServeArgs {
    pub fn resolve(&self) -> Resolved {
        let device = self.device.unwrap_or_else(DeviceKind::default_for_host);
        let cuda = device == DeviceKind::Cuda;
        let max_batch = self
            .max_batch
            .map_or(if cuda { 512 } else { 16 }, |b| b as usize);
        let first_batch = self
            .first_batch
            .map_or(if cuda { 16 } else { 4 }, |b| b as usize)
            .min(max_batch);
        Resolved {
            device,
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
            encoder_workers: self
                .encoder_workers
                .map_or_else(|| video::default_workers(cuda), |n| n as usize),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert_eq!(parse_bytes("512K"), Ok(512 << 10));
        assert_eq!(parse_bytes("20m"), Ok(20 << 20));
        assert_eq!(parse_bytes("8G"), Ok(8 << 30));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("99999999999999999999G").is_err());
    }
}
