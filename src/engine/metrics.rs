//! Metric names and the engine's measurements (through the `metrics` facade; the server
//! installs the Prometheus recorder and renders `/metrics`). Names follow Prometheus
//! conventions: `lipsync_` prefix, unit suffixes, `_total` counters, bounded labels.

use std::time::Duration;

pub const REQUESTS_TOTAL: &str = "lipsync_requests_total";
pub const REQUEST_DURATION: &str = "lipsync_request_duration_seconds";
pub const TIME_TO_FIRST_BYTE: &str = "lipsync_time_to_first_byte_seconds";
pub const STAGE_DURATION: &str = "lipsync_stage_duration_seconds";
pub const BATCH_FRAMES: &str = "lipsync_batch_frames";
pub const BATCH_REQUESTS: &str = "lipsync_batch_requests";
pub const FRAMES_TOTAL: &str = "lipsync_frames_total";
pub const DROPPED_FRAMES_TOTAL: &str = "lipsync_dropped_frames_total";
pub const QUEUE_FRAMES: &str = "lipsync_queue_frames";
/// Model work waiting, in seconds, by `class` ([`QUEUE_CLASSES`]): see [`queue_seconds`].
pub const QUEUE_SECONDS: &str = "lipsync_queue_seconds";
pub const INSTANCES_BUSY: &str = "lipsync_instances_busy";
/// Faces drawn and waiting for an enhancer's instance.
pub const ENHANCE_QUEUE_FRAMES: &str = "lipsync_enhance_queue_frames";
pub const INSTANCES_READY: &str = "lipsync_instances_ready";
pub const AVATAR_CACHE_HITS: &str = "lipsync_avatar_cache_hits_total";
pub const AVATAR_CACHE_MISSES: &str = "lipsync_avatar_cache_misses_total";
pub const AVATAR_CACHE_BYTES: &str = "lipsync_avatar_cache_bytes";
pub const AVATAR_CACHE_ENTRIES: &str = "lipsync_avatar_cache_entries";
pub const AVATAR_DIR_BYTES: &str = "lipsync_avatar_dir_bytes";
pub const RESIDENT_MEMORY: &str = "process_resident_memory_bytes";
pub const GPU_MEMORY_USED: &str = "lipsync_gpu_memory_used_bytes";
pub const GPU_MEMORY_TOTAL: &str = "lipsync_gpu_memory_total_bytes";
pub const OOM_SPLITS: &str = "lipsync_oom_splits_total";
pub const INSTANCE_RESTARTS: &str = "lipsync_instance_restarts_total";
/// Half-precision batches recomputed in f32, by `reason` ([`FALLBACK_REASONS`]).
pub const PRECISION_FALLBACKS: &str = "lipsync_precision_fallbacks_total";
pub const STREAM_SESSIONS: &str = "lipsync_stream_sessions";
pub const STREAM_LATENCY: &str = "lipsync_stream_latency_seconds";
pub const STREAM_LATE_FRAMES: &str = "lipsync_stream_late_frames_total";
pub const STREAM_HELD_FRAMES: &str = "lipsync_stream_held_frames_total";

/// Why a half-precision batch was recomputed in f32, the `reason` label of
/// [`PRECISION_FALLBACKS`]: `nan`, its output was not finite; `overflow`, an activation the
/// model checks overflowed (finite but wrong faces otherwise; see
/// `model::wav2lip::forward_guarded`).
pub const FALLBACK_REASONS: [&str; 2] = ["nan", "overflow"];

/// Counts a batch recomputed in f32 for `reason` (one of [`FALLBACK_REASONS`]).
pub fn precision_fallback(reason: &'static str) {
    debug_assert!(FALLBACK_REASONS.contains(&reason), "{reason}");
    metrics::counter!(PRECISION_FALLBACKS, "reason" => reason).increment(1);
}

/// Buckets of [`STREAM_LATENCY`]: 0.05 to 1.0 s in steps of 0.05.
pub fn stream_latency_buckets() -> Vec<f64> {
    (1..=20).map(|i| f64::from(i) / 20.0).collect()
}

/// Stages timed per request (and per batch for inference).
pub const STAGES: [&str; 6] = ["decode", "mel", "queue", "inference", "composite", "encode"];

pub fn stage(stage: &'static str, d: Duration) {
    metrics::histogram!(STAGE_DURATION, "stage" => stage).record(d.as_secs_f64());
}

pub fn queue_frames(n: usize) {
    metrics::gauge!(QUEUE_FRAMES).set(n as f64);
}

/// The `class` label of [`QUEUE_SECONDS`]: `live`, frames of live sessions (deadlines, served
/// first); `interactive`, frames of `POST /v1/lipsync` requests and renders; `batch`, frames
/// of background renders (batch jobs, served in what the others leave of each batch).
pub const QUEUE_CLASSES: [&str; 3] = ["live", "interactive", "batch"];

/// What [`QUEUE_SECONDS`] says (the `# HELP` line of `/metrics`).
pub const QUEUE_SECONDS_HELP: &str = "Model work waiting, in seconds: the frames queued in the \
     class times the per-frame cost measured at warm-up, plus the fixed cost per batch they \
     need, divided by the instances (0 until warm-up has measured the cost). Independent of \
     the GPU model, unlike utilisation.";

/// Sets [`QUEUE_SECONDS`] for `class` (one of [`QUEUE_CLASSES`]).
pub fn queue_seconds(class: &'static str, seconds: f64) {
    debug_assert!(QUEUE_CLASSES.contains(&class), "{class}");
    metrics::gauge!(QUEUE_SECONDS, "class" => class).set(seconds);
}

pub fn dropped_frames(n: usize) {
    if n > 0 {
        metrics::counter!(DROPPED_FRAMES_TOTAL).increment(n as u64);
    }
}

pub fn batch(frames: usize, requests: usize) {
    metrics::histogram!(BATCH_FRAMES).record(frames as f64);
    metrics::histogram!(BATCH_REQUESTS).record(requests as f64);
    metrics::counter!(FRAMES_TOTAL).increment(frames as u64);
}
