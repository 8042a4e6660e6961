//! Model instances, each on its own OS thread with its own model (on CUDA its own stream),
//! pulling batches from the shared [`Scheduler`].
//!
//! An instance loads, runs warm-up batches at every batch size it will run, measures what a
//! batch costs, then reports ready; the service answers `/ready` only while every instance is.
//!
//! - **Fixed batch sizes.** With padding (the default on CUDA) a batch of n frames runs at the
//!   smallest power of two >= n (or the maximum), filled with copies of its last frame, so
//!   warm-up (and convolution autotuning) covers every shape ever served.
//! - **Precision.** A batch whose f16/bf16 output holds NaN or infinity, or in which the model
//!   saw an activation overflow (finite but wrong faces; see `Wav2Lip::forward_guarded`), is
//!   recomputed in f32 and counted by reason. The f32 copy of the model is made on first need,
//!   checked at a small batch within the memory limit and its warm-up finished at once, so its
//!   batch sizes never start an algorithm search; its batches are split to fit the memory
//!   limit, where its weights count from then on. A batch's inputs are built when it runs and built again only for its recompute
//!   (no copy is kept in case one is needed).
//! - **Out of memory.** A batch that runs out of device memory is split in halves and retried,
//!   and the instance asks for smaller batches from then on; one frame that does not fit
//!   fails alone. `memory_limit` makes the instance treat any batch whose estimated memory
//!   exceeds it as out of memory (to cap its share of a GPU, and to test this path).
//! - **Warm-up errors.** Any other error during warm-up switches the instance to the
//!   reference convolution path and warms up again; only when that fails too does it fail.
//! - **Faults.** A batch that panics or fails (other than out of memory) fails the frames it
//!   held (their requests end with an error, never a short video), and the instance is
//!   restarted: it reloads its model and warms up again, and is not ready meanwhile.
//! - **Batch cost.** Warm-up measures `a + b·n` (seconds per batch of n); the batcher uses it
//!   to fill batches while a new request waits, up to the size done within `fill_latency`.

use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::DType;

use super::backend::{Loader, Model, FACE_LEN, MEL_LEN, PRED_LEN};
use super::batcher::Limits;
use super::enhance_pool::Handed;
use super::metrics as m;
use super::scheduler::{BatchItem, Drawn, Scheduler};
use crate::media::face;
use crate::model::Precision;

/// How to run the pool.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    pub precision: Precision,
    pub instances: usize,
    pub limits: Limits,
    /// How long a batch may wait to fill.
    pub batch_wait: Duration,
    /// Run batches at fixed sizes (powers of two up to the maximum).
    pub pad_batches: bool,
    /// Device memory an instance may use, in bytes (estimated per batch).
    pub memory_limit: Option<u64>,
    /// Warm up (and measure batch cost) before reporting ready.
    pub warm_up: bool,
    /// While a new request waits, batches are filled up to the size computed within this.
    pub fill_latency: Duration,
    /// How a batch's device memory is estimated against `memory_limit`: the layer-by-layer
    /// figure ([`estimated_bytes`]) unless the instances run the planned path on a GPU
    /// (`Some`: its settings, [`estimated_bytes_with`]).
    pub planned_memory: Option<crate::model::cudnn::ConvSettings>,
}

impl PoolConfig {
    /// The engine's tests: one f32 instance, no warm-up, batches up to `max_batch` (a new
    /// request's first one `first_batch`), `max_queue` runnable frames and as many ahead.
    #[cfg(test)]
    pub(crate) fn testing(max_batch: usize, first_batch: usize, max_queue: usize) -> PoolConfig {
        PoolConfig {
            precision: Precision::F32,
            instances: 1,
            limits: Limits {
                max_batch,
                first_batch,
                fill_batch: first_batch,
                max_queue,
                max_ahead: max_queue,
            },
            batch_wait: Duration::ZERO,
            pad_batches: false,
            memory_limit: None,
            warm_up: false,
            fill_latency: Duration::from_millis(150),
            planned_memory: None,
        }
    }

    /// A batch of `n` in `dtype`, as [`PoolConfig::planned_memory`] says to estimate it.
    pub fn estimate(&self, n: usize, dtype: DType) -> u64 {
        match &self.planned_memory {
            Some(s) => estimated_bytes_with(n, dtype, s),
            None => estimated_bytes(n, dtype),
        }
    }
}

/// Seconds a batch of `n` frames takes: `fixed + per_frame · n` (measured at warm-up).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct BatchCost {
    pub fixed: f64,
    pub per_frame: f64,
}

impl BatchCost {
    /// From two measurements `(n, seconds)` (one is enough: all per frame).
    pub fn fit(small: (usize, f64), large: (usize, f64)) -> BatchCost {
        let (n1, t1) = (small.0 as f64, small.1.max(0.0));
        let (n2, t2) = (large.0 as f64, large.1.max(0.0));
        if n2 > n1 && t2 > t1 {
            let per_frame = (t2 - t1) / (n2 - n1);
            BatchCost {
                fixed: (t1 - per_frame * n1).max(0.0),
                per_frame,
            }
        } else {
            BatchCost {
                fixed: 0.0,
                per_frame: t2.max(t1) / n2.max(n1).max(1.0),
            }
        }
    }

    pub fn seconds(&self, n: usize) -> f64 {
        self.fixed + self.per_frame * n as f64
    }

    /// Seconds of model work that `frames` waiting frames stand for when `instances` share
    /// them: `(frames · per_frame + batches · fixed) / instances`, with
    /// `batches = ⌈frames / max_batch⌉` (the fewest batches that hold them).
    pub fn queue_seconds(&self, frames: usize, max_batch: usize, instances: usize) -> f64 {
        if frames == 0 {
            return 0.0;
        }
        let batches = frames.div_ceil(max_batch.max(1));
        (frames as f64 * self.per_frame + batches as f64 * self.fixed) / instances.max(1) as f64
    }

    /// The largest batch in `lo..=hi` done within `latency` (at least `lo`).
    pub fn largest_within(&self, latency: Duration, lo: usize, hi: usize) -> usize {
        if self.per_frame <= 0.0 {
            return hi;
        }
        let n = ((latency.as_secs_f64() - self.fixed) / self.per_frame).floor();
        (n.max(0.0) as usize).clamp(lo, hi.max(lo))
    }
}

/// The largest batch formed while a new request waits: what an instance computes within
/// `latency` at `cost`, between the first and the largest batch, and with padding rounded
/// down to a padded size (a fill between two would run padded to the larger one).
pub fn fill_batch(cost: &BatchCost, latency: Duration, limits: &Limits, pad: bool) -> usize {
    let fill = cost.largest_within(latency, limits.first_batch, limits.max_batch);
    if pad {
        batch_sizes(limits.max_batch, limits.first_batch, true)
            .into_iter()
            .filter(|&n| n <= fill)
            .max()
            .unwrap_or(fill)
            .max(limits.first_batch.min(limits.max_batch))
    } else {
        fill
    }
}

/// Batch sizes an instance runs: with padding, the powers of two up to `max_batch` and
/// `max_batch` itself; without, the first and full batch sizes (warm-up only).
pub fn batch_sizes(max_batch: usize, first_batch: usize, pad: bool) -> Vec<usize> {
    let mut sizes: Vec<usize> = if pad {
        std::iter::successors(Some(1usize), |s| Some(s * 2))
            .take_while(|&s| s < max_batch)
            .collect()
    } else {
        vec![first_batch.min(max_batch)]
    };
    sizes.push(max_batch);
    sizes.dedup();
    sizes
}

/// Values in the (folded) weights.
const WEIGHT_VALUES: u64 = 36_275_283;
/// Values per frame of a forward pass (see [`estimated_bytes`]).
const FRAME_VALUES: u64 = 3_000_000;
/// Device memory an instance holds beside its weights and activations: cuDNN's handle,
/// plans and workspace (see [`estimated_bytes`]).
const WORKSPACE_BYTES: u64 = 700 << 20;

/// Device memory of the model's weights in `dtype`.
pub fn weight_bytes(dtype: DType) -> u64 {
    WEIGHT_VALUES * dtype.size_in_bytes() as u64
}

/// Estimated device memory of a forward pass of `n` frames on the layer-by-layer path (see
/// [`estimated_bytes_with`]).
pub fn estimated_bytes(n: usize, dtype: DType) -> u64 {
    weight_bytes(dtype) + WORKSPACE_BYTES + FRAME_VALUES * n as u64 * dtype.size_in_bytes() as u64
}

/// Device memory an instance of the planned path (`--conv-epilogue own|auto`, arena on)
/// holds outside its arena, its weights and its batch's inputs and output: the cuDNN and
/// cuBLAS handles, the chosen algorithms' workspace, the weights in cuDNN's filter layout and
/// the upsampling forms'. Measured on an H100 (2026-11-26, docs/gpu-runs/2026-11-26d,
/// `bench --sections instances` with `auto:auto:8:on`): one instance at batch 1536 and three
/// at 512 in f16 held 6147 and 6823 MiB with arenas of 3960 MiB in all (the planner, for the
/// forms `auto` chose), so each instance 338 MiB beside its arena and batch, 72 MiB of it its
/// weights: 266 MiB, rounded up. Memory the process holds once whatever the instances (the
/// CUDA context and libraries: 1.6 GiB there) is not an instance's.
pub const PLANNED_OUTSIDE_BYTES: u64 = 280 << 20;

/// [`planned_bytes`] for these options, batch and element size, computed once per process
/// (the pool asks before every batch).
fn planned_arena(opts: &crate::model::netplan::NetOptions, n: usize, elem: usize) -> usize {
    use std::collections::HashMap;
    use std::sync::LazyLock;
    type Key = (crate::model::netplan::NetOptions, usize, usize);
    static CACHE: LazyLock<Mutex<HashMap<Key, usize>>> = LazyLock::new(Default::default);
    let key = (opts.clone(), n, elem);
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    *cache
        .entry(key)
        .or_insert_with(|| crate::model::netplan::planned_bytes(opts, n, elem))
}

/// Estimated device memory of a forward pass of `n` frames.
///
/// - **Planned path** (`--conv-epilogue own|auto` in NHWC with `--conv-arena on`): the
///   planned peak of the arena at `n` ([`crate::model::netplan`]), the inputs and output of
///   the batch, the weights, and [`PLANNED_OUTSIDE_BYTES`].
/// - **Otherwise**: the weights, the workspace, and per frame the activations and
///   convolution scratch. Measured on an H200 (2026-11-26, `lipsync bench --sections model`,
///   peak device memory during two forwards, own cuDNN path, less the CUDA context): f16 1.6
///   GiB at batch 64, 2.1 at 256, 3.5 at 512, a slope of about 5.7 MiB (3.0 M half values)
///   per frame and about 0.7 GiB at none; f32 6.3 GiB at 512 (its algorithms need less
///   scratch per value). This estimate is those figures rounded up: 3.9 GB at 512 in f16,
///   7.0 GB in f32.
pub fn estimated_bytes_with(
    n: usize,
    dtype: DType,
    settings: &crate::model::cudnn::ConvSettings,
) -> u64 {
    use crate::model::arch::{FACE_CHANNELS, FACE_SIZE, MEL_BINS, MEL_STEPS};
    use crate::model::cudnn::Arena;
    use crate::model::netplan::NetOptions;
    let elem = dtype.size_in_bytes() as u64;
    if settings.planned() && settings.arena == Arena::On {
        // `auto` may choose any form per layer: the largest plan of them.
        let forms = match settings.upsampling.form() {
            Some(f) => vec![f],
            None => crate::model::upsample::UpForm::ALL.to_vec(),
        };
        let arena = forms
            .into_iter()
            .map(|form| planned_arena(&NetOptions::new(settings.input_pad, form), n, elem as usize))
            .max()
            .unwrap_or(0) as u64;
        let io = n as u64
            * (MEL_BINS * MEL_STEPS
                + FACE_CHANNELS * FACE_SIZE * FACE_SIZE
                + 3 * FACE_SIZE * FACE_SIZE) as u64
            * elem;
        return weight_bytes(dtype) + PLANNED_OUTSIDE_BYTES + arena + io;
    }
    estimated_bytes(n, dtype)
}

/// Estimated device memory of recomputing `n` frames in f32 for a model in `half`: the f32
/// copy's forward pass, and the half-precision model's weights, which stay loaded.
pub fn fallback_bytes(n: usize, half: DType) -> u64 {
    estimated_bytes(n, DType::F32) + weight_bytes(half)
}

/// The largest of `sizes` whose `need` is within `limit` (any, without a limit).
fn largest_fitting(
    sizes: impl IntoIterator<Item = usize>,
    limit: Option<u64>,
    need: impl Fn(usize) -> u64,
) -> Option<usize> {
    sizes
        .into_iter()
        .filter(|&k| k > 0 && limit.is_none_or(|l| need(k) <= l))
        .max()
}

/// The batch at which the f32 fallback copy is checked when it loads (or 1 where a batch of
/// 2 is over the memory limit).
const FALLBACK_CHECK_BATCH: usize = 2;

/// Served batches whose time is within this ratio of the warm-up's prediction leave the
/// offer at the warm-up's figure ([`PoolStatus::recent_batch_cost`]).
pub const COST_BAND: (f64, f64) = (0.7, 1.4);

/// What the pool is doing, for `/ready`, `/info` and metrics.
#[derive(Debug, Default)]
pub struct PoolStatus {
    pub instances: usize,
    ready: AtomicUsize,
    busy: AtomicUsize,
    failed: Mutex<Option<String>>,
    dtype: Mutex<Option<DType>>,
    /// The convolution path the instances run (`cpu`, `cudnn`, `candle`).
    conv_path: Mutex<Option<&'static str>>,
    /// Moving average of one instance's frames per second.
    rate: Mutex<f64>,
    /// What a batch costs, measured at warm-up.
    cost: Mutex<Option<BatchCost>>,
    /// Moving average of served batches' time against what the warm-up's cost predicts for
    /// their size (1 until a batch has been served; see [`PoolStatus::recent_batch_cost`]).
    cost_scale: Mutex<Option<f64>>,
    /// Instances restarted after a fault.
    restarts: AtomicUsize,
    shutdown: AtomicBool,
}

impl PoolStatus {
    /// Instances loaded and warmed up.
    pub fn ready(&self) -> usize {
        self.ready.load(Ordering::SeqCst)
    }

    pub fn busy(&self) -> usize {
        self.busy.load(Ordering::SeqCst)
    }

    /// Why an instance could not start, if one could not.
    pub fn failed(&self) -> Option<String> {
        self.failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The dtype the instances compute in (once one has loaded).
    pub fn dtype(&self) -> Option<DType> {
        *self.dtype.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The convolution path of the instances, once one has loaded.
    pub fn conv_path(&self) -> Option<&'static str> {
        *self.conv_path.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn all_ready(&self) -> bool {
        self.ready() == self.instances
    }

    /// What a batch costs, once an instance has measured it.
    pub fn batch_cost(&self) -> Option<BatchCost> {
        *self.cost.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What a batch costs now: the warm-up's measurement scaled by how served batches
    /// compared with it lately (a moving average of their ratio), so a warm-up on a busy
    /// machine, or a machine that got busier, does not fix the figure until a restart. Within
    /// [`COST_BAND`] of the warm-up's figure the warm-up's stands: batch times wander a little
    /// all the time, and an offer that moved with them would differ from one moment to the
    /// next for nothing.
    pub fn recent_batch_cost(&self) -> Option<BatchCost> {
        let cost = self.batch_cost()?;
        let scale = self
            .cost_scale
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .filter(|s| !(COST_BAND.0..=COST_BAND.1).contains(s))
            .unwrap_or(1.0);
        Some(BatchCost {
            fixed: cost.fixed * scale,
            per_frame: cost.per_frame * scale,
        })
    }

    /// A served batch of `size` frames (as run, padding included) took `took` in the model.
    pub fn observe_batch(&self, size: usize, took: Duration) {
        let Some(cost) = self.batch_cost() else {
            return;
        };
        let predicted = cost.seconds(size);
        if predicted <= 0.0 {
            return;
        }
        let ratio = (took.as_secs_f64() / predicted).clamp(0.05, 20.0);
        let mut scale = self.cost_scale.lock().unwrap_or_else(|p| p.into_inner());
        *scale = Some(match *scale {
            None => ratio,
            Some(s) => 0.8 * s + 0.2 * ratio,
        });
    }

    /// Instances restarted after a fault so far.
    pub fn restarts(&self) -> usize {
        self.restarts.load(Ordering::SeqCst)
    }

    fn set_ready(&self, up: bool) {
        if up {
            self.ready.fetch_add(1, Ordering::SeqCst);
        } else {
            self.ready.fetch_sub(1, Ordering::SeqCst);
        }
        metrics::gauge!(m::INSTANCES_READY).set(self.ready() as f64);
    }

    /// Frames per second the pool has been computing (all instances together).
    pub fn frames_per_second(&self) -> f64 {
        *self.rate.lock().unwrap_or_else(|p| p.into_inner()) * self.instances as f64
    }

    fn record_batch(&self, frames: usize, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        if secs <= 0.0 {
            return;
        }
        let mut rate = self.rate.lock().unwrap_or_else(|p| p.into_inner());
        let now = frames as f64 / secs;
        *rate = if *rate == 0.0 {
            now
        } else {
            0.8 * *rate + 0.2 * now
        };
    }
}

pub struct Pool {
    scheduler: Arc<Scheduler>,
    status: Arc<PoolStatus>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Pool {
    /// Starts the instances (returns at once; they load and warm up in the background).
    pub fn start(loader: Arc<dyn Loader>, cfg: PoolConfig) -> Pool {
        let scheduler = Arc::new(Scheduler::new(cfg.limits, cfg.batch_wait, cfg.instances));
        let status = Arc::new(PoolStatus {
            instances: cfg.instances,
            ..Default::default()
        });
        let threads = (0..cfg.instances)
            .map(|i| {
                let (loader, cfg, scheduler, status) = (
                    loader.clone(),
                    cfg.clone(),
                    scheduler.clone(),
                    status.clone(),
                );
                std::thread::Builder::new()
                    .name(format!("lipsync-instance-{i}"))
                    .spawn(move || supervise(i, loader.as_ref(), &cfg, &scheduler, &status))
                    .expect("spawning an instance thread")
            })
            .collect();
        Pool {
            scheduler,
            status,
            threads: Mutex::new(threads),
        }
    }

    /// Blocks until every instance is ready, or returns why one could not start.
    pub fn wait_ready(&self) -> Result<(), String> {
        loop {
            if let Some(e) = self.status.failed() {
                return Err(e);
            }
            if self.status.all_ready() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn scheduler(&self) -> &Arc<Scheduler> {
        &self.scheduler
    }

    pub fn status(&self) -> &Arc<PoolStatus> {
        &self.status
    }

    /// Stops the instances after their current batch and waits for them.
    pub fn shutdown(&self) {
        self.status.shutdown.store(true, Ordering::SeqCst);
        self.scheduler.shutdown();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

/// How an instance's life ended.
enum Exit {
    /// The pool is shutting down.
    Shutdown,
    /// A fault: restart the instance.
    Fault(String),
}

/// Runs instance `i` until shutdown, restarting it after faults. The first start failing is
/// fatal for the pool (`status.failed`); later restarts are retried with a growing pause.
fn supervise(
    i: usize,
    loader: &dyn Loader,
    cfg: &PoolConfig,
    scheduler: &Scheduler,
    status: &PoolStatus,
) {
    let mut started_once = false;
    let mut pause = Duration::from_millis(100);
    loop {
        let ready = AtomicBool::new(false);
        let run = std::panic::catch_unwind(AssertUnwindSafe(|| {
            run_instance(i, loader, cfg, scheduler, status, &ready, started_once)
        }));
        if ready.load(Ordering::SeqCst) {
            status.set_ready(false);
            started_once = true;
        }
        let why = match run {
            Ok(Ok(Exit::Shutdown)) => return,
            Ok(Ok(Exit::Fault(why))) => why,
            Ok(Err(e)) if !started_once => {
                tracing::error!("instance {i} cannot start: {e}");
                status
                    .failed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
                return;
            }
            Ok(Err(e)) => e,
            Err(panic) => format!("panicked: {}", panic_message(&panic)),
        };
        if status.shutdown.load(Ordering::SeqCst) {
            return;
        }
        status.restarts.fetch_add(1, Ordering::SeqCst);
        metrics::counter!(m::INSTANCE_RESTARTS).increment(1);
        tracing::error!("instance {i} failed ({why}); restarting it");
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_secs(10));
    }
}

pub use crate::model::panic_message;

/// One life of an instance: load, warm up, serve until shutdown or a fault. `Err` when it
/// could not load or warm up.
fn run_instance(
    i: usize,
    loader: &dyn Loader,
    cfg: &PoolConfig,
    scheduler: &Scheduler,
    status: &PoolStatus,
    ready: &AtomicBool,
    restart: bool,
) -> Result<Exit, String> {
    let start = Instant::now();
    let sizes = batch_sizes(
        cfg.limits.max_batch,
        cfg.limits.first_batch,
        cfg.pad_batches,
    );
    // Start-up checks run at the largest batch the instance will run within its memory limit.
    let check_batch = largest_fitting(sizes.iter().copied(), cfg.memory_limit, |k| {
        cfg.estimate(k, cfg.precision.dtype())
    })
    .unwrap_or(1);
    let model = loader
        .load(cfg.precision, check_batch)
        .map_err(|e| e.to_string())?;
    let mut inst = Instance {
        id: i,
        loader,
        scheduler,
        model,
        fallback: None,
        sizes,
        pad: cfg.pad_batches,
        cap: cfg.limits.max_batch,
        memory_limit: cfg.memory_limit,
        planned_memory: cfg.planned_memory.clone(),
        spare: Vec::new(),
    };
    if cfg.warm_up {
        let cost = inst.warm_up()?;
        if let Some(cost) = cost {
            *status.cost.lock().unwrap_or_else(|p| p.into_inner()) = Some(cost);
            let fill = fill_batch(&cost, cfg.fill_latency, &cfg.limits, cfg.pad_batches);
            scheduler.set_fill_batch(fill);
            scheduler.set_batch_cost(cost);
            tracing::info!(
                "instance {i}: a batch costs {:.1} ms + {:.2} ms per frame; batches fill to {fill} \
                 frames while a new request waits ({} ms target)",
                cost.fixed * 1e3,
                cost.per_frame * 1e3,
                cfg.fill_latency.as_millis()
            );
        }
    }
    *status.dtype.lock().unwrap_or_else(|p| p.into_inner()) = Some(inst.model.dtype());
    *status.conv_path.lock().unwrap_or_else(|p| p.into_inner()) = Some(inst.model.conv_path());
    ready.store(true, Ordering::SeqCst);
    status.set_ready(true);
    tracing::info!(
        "instance {i} {} in {:.1} s (batches up to {})",
        if restart { "restarted" } else { "ready" },
        start.elapsed().as_secs_f64(),
        inst.cap
    );
    while let Some(batch) = scheduler.next_batch_within(inst.cap) {
        if batch.is_empty() {
            continue;
        }
        let busy = status.busy.fetch_add(1, Ordering::SeqCst) + 1;
        metrics::gauge!(m::INSTANCES_BUSY).set(busy as f64);
        // Where each frame's answer goes, kept outside the batch: a panic while serving it
        // must still fail those frames, or their requests would wait forever.
        let held: Vec<_> = batch
            .iter()
            .map(|b| (b.work.index, b.reply.clone()))
            .collect();
        let (t, n) = (Instant::now(), batch.len());
        let size = inst.padded(n);
        let served = std::panic::catch_unwind(AssertUnwindSafe(|| inst.serve(batch)));
        let busy = status.busy.fetch_sub(1, Ordering::SeqCst) - 1;
        metrics::gauge!(m::INSTANCES_BUSY).set(busy as f64);
        let fault = match served {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(panic) => Some(format!("panicked: {}", panic_message(&panic))),
        };
        if let Some(why) = fault {
            for (_, reply) in held {
                // A frame answered already (or handed to the enhancers, in the part of an
                // out-of-memory split that ran) gets a second message: its request takes the
                // first of the two for that frame, or stops at this error; either way none
                // waits for ever.
                let _ = reply.send(Err(format!("the model instance failed: {why}")));
            }
            return Ok(Exit::Fault(why));
        }
        status.record_batch(n, t.elapsed());
        // The model's time, without a test's injected stall (the live offer adds that itself).
        let stall = super::faults::delay("batch_delay_ms").unwrap_or_default();
        status.observe_batch(size, t.elapsed().saturating_sub(stall));
    }
    Ok(Exit::Shutdown)
}

/// Where a batch's model inputs come from. They are built into fresh buffers that the model
/// takes over when the batch runs, and built once more from here only if the batch has to be
/// recomputed in f32: keeping a copy of every half-precision batch's inputs just in case
/// (about 113 MB at 512 frames) cost about as much as the GPU work.
trait BatchInputs {
    /// Frames in the batch.
    fn frames(&self) -> usize;
    /// Appends frame `i`'s mel window (`MEL_LEN` values) and face input (`FACE_LEN`).
    fn push(&self, i: usize, mel: &mut Vec<f32>, face: &mut Vec<f32>);
    /// Frame `i`'s number in the video it is drawn for ([`super::scheduler::FrameWork::shown`]).
    fn index(&self, i: usize) -> usize;
}

/// A warm-up batch of `n` frames of zeros.
struct Zeros(usize);

impl BatchInputs for Zeros {
    fn frames(&self) -> usize {
        self.0
    }
    fn push(&self, _: usize, mel: &mut Vec<f32>, face: &mut Vec<f32>) {
        mel.resize(mel.len() + MEL_LEN, 0.0);
        face.resize(face.len() + FACE_LEN, 0.0);
    }
    fn index(&self, i: usize) -> usize {
        i
    }
}

/// A batch being served: each frame's mel window and its face crop turned into the model's
/// input.
struct Items<'a>(&'a [BatchItem]);

impl BatchInputs for Items<'_> {
    fn frames(&self) -> usize {
        self.0.len()
    }
    fn push(&self, i: usize, mel: &mut Vec<f32>, face: &mut Vec<f32>) {
        mel.extend_from_slice(&self.0[i].work.mel);
        face::model_input_into(&self.0[i].work.face, face);
    }
    fn index(&self, i: usize) -> usize {
        self.0[i].work.shown
    }
}

/// The inputs of frames `range` of a batch, padded with copies of the last one to `size`
/// frames, in buffers of exactly that size.
fn build_inputs(
    inputs: &dyn BatchInputs,
    range: Range<usize>,
    size: usize,
    mut face: Vec<f32>,
) -> (Vec<f32>, Vec<f32>) {
    let n = range.len();
    debug_assert!(n > 0 && n <= size);
    let mut mel = Vec::with_capacity(size * MEL_LEN);
    face.clear();
    face.reserve(size * FACE_LEN);
    for i in range {
        inputs.push(i, &mut mel, &mut face);
    }
    for _ in n..size {
        mel.extend_from_within((n - 1) * MEL_LEN..n * MEL_LEN);
        face.extend_from_within((n - 1) * FACE_LEN..n * FACE_LEN);
    }
    (mel, face)
}

/// The frame numbers of frames `range` of a batch, padded like [`build_inputs`].
fn batch_indices(inputs: &dyn BatchInputs, range: Range<usize>, size: usize) -> Vec<usize> {
    let mut indices: Vec<usize> = range.map(|i| inputs.index(i)).collect();
    let last = indices.last().copied().unwrap_or(0);
    indices.resize(size, last);
    indices
}

/// Whether an error is the device running out of memory (real or under `memory_limit`).
pub fn is_out_of_memory(e: &super::Error) -> bool {
    match e {
        super::Error::OutOfMemory(_) => true,
        super::Error::Model(m) => m.is_out_of_memory(),
        other => {
            let s = other.to_string();
            s.contains("out of memory") || s.contains("OUT_OF_MEMORY")
        }
    }
}

/// One model instance's state (owned by its thread).
struct Instance<'a> {
    id: usize,
    loader: &'a dyn Loader,
    /// Where the batches come from; its enhancers' instances take the faces that ask for one.
    scheduler: &'a Scheduler,
    model: Box<dyn Model>,
    /// An f32 copy for batches whose half-precision output is not finite or overflowed.
    fallback: Option<Box<dyn Model>>,
    sizes: Vec<usize>,
    pad: bool,
    /// Largest batch this instance asks for.
    cap: usize,
    memory_limit: Option<u64>,
    /// The planned path's settings, when the instances run it ([`PoolConfig::planned_memory`]).
    planned_memory: Option<crate::model::cudnn::ConvSettings>,
    /// The last batch's output, once answered: the next batch's face input is built in it
    /// when it is large enough (a model that answers in its input's buffer, as the echo
    /// does, then allocates nothing per batch: a fresh buffer of this size is mapped page
    /// by page, which cost more than the echo's work).
    spare: Vec<f32>,
}

impl Instance<'_> {
    fn lower_cap(&mut self, to: usize) {
        let to = to.max(1);
        if to < self.cap {
            tracing::warn!(
                "instance {}: out of memory; batches limited to {to} frames",
                self.id
            );
            self.cap = to;
        }
    }

    /// The size a batch of `n` runs at.
    fn padded(&self, n: usize) -> usize {
        if self.pad {
            self.sizes.iter().copied().find(|&s| s >= n).unwrap_or(n)
        } else {
            n
        }
    }

    /// Runs a batch at every size this instance will serve (kernels, allocations,
    /// autotuning), then times the smallest and largest once more for the batch cost. A size
    /// that does not fit in memory lowers the batch limit; another error switches to the
    /// reference path and starts over.
    fn warm_up(&mut self) -> Result<Option<BatchCost>, String> {
        'again: loop {
            // Every size up to the cap, and the cap itself: after an out-of-memory result the
            // cap is half the size that failed, which need not be one of the sizes (without
            // padding) and need not fit either, so it is run again until one does.
            let mut sizes: Vec<usize> = self
                .sizes
                .iter()
                .copied()
                .filter(|&n| n < self.cap)
                .collect();
            sizes.push(self.cap);
            for n in sizes {
                match self.forward_raw(&Zeros(n)) {
                    Ok(_) => {}
                    Err(e) if is_out_of_memory(&e) && n > 1 => {
                        self.lower_cap(n / 2);
                        continue 'again;
                    }
                    Err(e) => {
                        if self.model.use_reference_path() {
                            tracing::warn!(
                                "instance {}: warm-up at batch {n} failed ({e}); switching to the \
                                 reference convolution path ({})",
                                self.id,
                                self.model.conv_path()
                            );
                            continue 'again;
                        }
                        return Err(format!("warm-up at batch {n} failed: {e}"));
                    }
                }
            }
            break;
        }
        // Batch sizes first seen from now on take cuDNN's heuristic choice, not a search.
        self.model.finish_warm_up();
        let small = self.sizes.first().copied().unwrap_or(1).min(self.cap);
        let large = self.cap;
        let mut time = |n: usize| -> Result<f64, String> {
            let t = Instant::now();
            self.forward_raw(&Zeros(n)).map_err(|e| e.to_string())?;
            Ok(t.elapsed().as_secs_f64())
        };
        let t_small = time(small)?;
        let t_large = if large > small { time(large)? } else { t_small };
        Ok(Some(BatchCost::fit((small, t_small), (large, t_large))))
    }

    /// A batch of `n` in `dtype` as this instance runs it: the planned path's estimate while
    /// it runs the own cuDNN path with planned settings, else the layer-by-layer one.
    fn estimate(&self, n: usize, dtype: DType) -> u64 {
        match &self.planned_memory {
            Some(s) if self.model.conv_path() == "cudnn" => estimated_bytes_with(n, dtype, s),
            _ => estimated_bytes(n, dtype),
        }
    }

    /// Fails with out of memory when `need` bytes are over the memory limit.
    fn within_limit(&self, need: u64, what: impl std::fmt::Display) -> Result<(), super::Error> {
        match self.memory_limit {
            Some(limit) if need > limit => Err(self.over_limit(need, what)),
            _ => Ok(()),
        }
    }

    /// The out-of-memory error of `what`, which needs `need` bytes.
    fn over_limit(&self, need: u64, what: impl std::fmt::Display) -> super::Error {
        let limit = self.memory_limit.unwrap_or(0);
        super::Error::OutOfMemory(format!(
            "{what} needs about {need} bytes, over the {limit}-byte limit"
        ))
    }

    /// Device memory the f32 fallback copy's weights hold, once it is loaded.
    fn fallback_weights(&self) -> u64 {
        self.fallback
            .as_ref()
            .map_or(0, |f| weight_bytes(f.dtype()))
    }

    /// Predictions (f32, `n * PRED_LEN`) for the batch's `n` frames, padded to the batch
    /// size set, within the memory limit, and recomputed in f32 when the half-precision
    /// output is not finite or the model saw an overflow.
    fn forward_raw(&mut self, inputs: &dyn BatchInputs) -> Result<Vec<f32>, super::Error> {
        let n = inputs.frames();
        let size = self.padded(n);
        let dtype = self.model.dtype();
        self.within_limit(
            self.estimate(size, dtype) + self.fallback_weights(),
            format_args!("a batch of {size}"),
        )?;
        let (mel, face) = build_inputs(inputs, 0..n, size, std::mem::take(&mut self.spare));
        let indices = batch_indices(inputs, 0..n, size);
        let out = self.model.predict_frames(&indices, mel, face)?;
        let mut pred = out.faces;
        if dtype != DType::F32 {
            let reason = if out.overflow {
                Some("overflow")
            } else if !all_finite(&pred) {
                Some("nan")
            } else {
                None
            };
            if let Some(reason) = reason {
                m::precision_fallback(reason);
                tracing::warn!(
                    "instance {}: {dtype:?} batch of {n} {}; recomputing it in f32",
                    self.id,
                    if reason == "overflow" {
                        "overflowed"
                    } else {
                        "gave a non-finite output"
                    }
                );
                drop(pred);
                pred = self.recompute_in_f32(inputs)?;
            }
        }
        pred.truncate(n * PRED_LEN);
        Ok(pred)
    }

    /// The batch's frames in f32 (exactly `n * PRED_LEN` values), its inputs built again, in
    /// chunks as large as the memory limit allows for the f32 copy ([`fallback_bytes`]),
    /// padded to the batch size set like any batch.
    fn recompute_in_f32(&mut self, inputs: &dyn BatchInputs) -> Result<Vec<f32>, super::Error> {
        let n = inputs.frames();
        let half = self.model.dtype();
        let candidates: Vec<usize> = if self.pad {
            let top = self.padded(n);
            self.sizes.iter().copied().filter(|&s| s <= top).collect()
        } else {
            (1..=n).collect()
        };
        let chunk = largest_fitting(candidates, self.memory_limit, |k| fallback_bytes(k, half));
        // None: not even one frame fits.
        let chunk = chunk.ok_or_else(|| {
            self.over_limit(fallback_bytes(1, half), "recomputing a frame in f32")
        })?;
        if chunk < n {
            tracing::info!(
                "instance {}: recomputing {n} frames in f32 in batches of {chunk} (memory limit)",
                self.id
            );
        }
        let plan: Vec<(Range<usize>, usize)> = (0..n)
            .step_by(chunk)
            .map(|s| {
                let e = (s + chunk).min(n);
                (s..e, self.padded(e - s).min(chunk))
            })
            .collect();
        let model = match &mut self.fallback {
            Some(model) => model,
            slot => slot.insert(Self::load_fallback(
                self.loader,
                self.id,
                half,
                self.memory_limit,
            )?),
        };
        let mut pred = Vec::with_capacity(n * PRED_LEN);
        for (range, size) in plan {
            let m = range.len();
            let indices = batch_indices(inputs, range.clone(), size);
            let (mel, face) = build_inputs(inputs, range, size, Vec::new());
            let out = model.predict_frames(&indices, mel, face)?;
            pred.extend_from_slice(&out.faces[..m * PRED_LEN]);
        }
        Ok(pred)
    }

    /// Loads the f32 copy for recomputes: checked at a small batch within the memory limit
    /// ([`FALLBACK_CHECK_BATCH`]), and its warm-up finished at once, so the batch sizes it
    /// meets take cuDNN's heuristic algorithm instead of a search (which would hold the
    /// process's tuning lock in the middle of a request). Recomputes are rare; their speed
    /// matters less than the instance's.
    fn load_fallback(
        loader: &dyn Loader,
        id: usize,
        half: DType,
        memory_limit: Option<u64>,
    ) -> Result<Box<dyn Model>, super::Error> {
        let check = largest_fitting(1..=FALLBACK_CHECK_BATCH, memory_limit, |k| {
            fallback_bytes(k, half)
        })
        .unwrap_or(1);
        let mut model = loader.load(Precision::F32, check)?;
        model.finish_warm_up();
        tracing::info!(
            "instance {id}: f32 copy loaded for recomputes (checked at batch {check}, {})",
            model.conv_path()
        );
        Ok(model)
    }

    /// Runs a batch and answers every frame, or hands it to the enhancers' instances (which
    /// answer it) when it asked for an enhancer; out of memory splits it and retries. `Err`
    /// when the model failed otherwise (the caller fails the frames and restarts the
    /// instance).
    fn serve(&mut self, items: Vec<BatchItem>) -> Result<(), String> {
        if super::faults::hit("instance_panic") {
            panic!("injected fault: instance_panic");
        }
        if let Some(stall) = super::faults::delay("batch_delay_ms") {
            std::thread::sleep(stall);
        }
        let t = Instant::now();
        let n = items.len();
        match self.forward_raw(&Items(&items)) {
            Ok(pred) => {
                m::stage("inference", t.elapsed());
                let mut requests: Vec<_> = items.iter().map(|i| i.request).collect();
                requests.sort();
                requests.dedup();
                m::batch(n, requests.len());
                // Faces that asked for an enhancer go to the enhancers' instances (which
                // answer them); the others are answered here.
                let mut handed = Vec::new();
                for (item, p) in items.into_iter().zip(pred.chunks_exact(PRED_LEN)) {
                    match item.work.enhance {
                        Some(with) => handed.push(Handed {
                            request: item.request,
                            class: item.class,
                            index: item.work.index,
                            with,
                            restore: item.work.restore,
                            pred: p.to_vec(),
                            reply: item.reply,
                        }),
                        None => {
                            let face = Drawn::face(face::prediction_to_bgr(p));
                            // A closed receiver means the request was cancelled meanwhile.
                            let _ = item.reply.send(Ok((item.work.index, face)));
                        }
                    }
                }
                // A request cancelled while its faces were drawn has no use for their
                // enhancement (a whole batch of it, on a GPU).
                handed.retain(|h| self.scheduler.is_open(h.request));
                if !handed.is_empty() {
                    match self.scheduler.enhance_pool() {
                        Some(pool) => pool.hand_over(handed),
                        None => {
                            for h in handed {
                                let _ = h.reply.send(Err(format!(
                                    "enhancer {} is not running on this engine",
                                    h.with.name
                                )));
                            }
                        }
                    }
                }
                self.spare = pred;
                Ok(())
            }
            Err(e) if is_out_of_memory(&e) && n > 1 => {
                metrics::counter!(m::OOM_SPLITS).increment(1);
                let mut first = items;
                let rest = first.split_off(n / 2);
                self.lower_cap(first.len());
                self.serve(first)?;
                self.serve(rest)
            }
            Err(e) if is_out_of_memory(&e) => {
                tracing::error!("instance {}: one frame does not fit: {e}", self.id);
                for item in items {
                    let _ = item.reply.send(Err(e.to_string()));
                }
                Ok(())
            }
            Err(super::Error::Model(e))
                if e.is_cudnn_failure() && self.model.use_reference_path() =>
            {
                tracing::warn!(
                    "instance {}: the own cuDNN path failed ({e}); this instance runs candle's \
                     operations from now on",
                    self.id
                );
                self.serve(items)
            }
            Err(e) => {
                tracing::error!("instance {}: batch of {n} frames failed: {e}", self.id);
                Err(e.to_string())
            }
        }
    }
}

/// Whether every value is finite: the largest magnitude's bits below an infinity's, a
/// reduction the compiler vectorises (with AVX2 where the CPU has it), where `all` stops at
/// each value to test it.
fn all_finite(values: &[f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { all_finite_avx2(values) };
    }
    all_finite_any(values)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn all_finite_avx2(values: &[f32]) -> bool {
    all_finite_any(values)
}

#[inline(always)]
fn all_finite_any(values: &[f32]) -> bool {
    const INFINITY_BITS: u32 = 0x7f80_0000;
    let largest = values
        .iter()
        .fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    largest < INFINITY_BITS
}

#[cfg(test)]
mod tests {
    #[test]
    fn all_finite_finds_any_infinity_or_nan() {
        let mut v: Vec<f32> = (0..1000).map(|i| i as f32 * 1e35 - 5e37).collect();
        v.push(f32::MAX);
        v.push(-f32::MAX);
        v.push(f32::MIN_POSITIVE / 2.0);
        assert!(all_finite(&v) && all_finite_any(&v) && all_finite(&[]));
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN] {
            for at in [0, 500, v.len() - 1] {
                let mut w = v.clone();
                w[at] = bad;
                assert!(!all_finite(&w) && !all_finite_any(&w), "{bad} at {at}");
            }
        }
    }

    use super::*;

    #[test]
    fn padded_batch_sizes_cover_every_batch() {
        assert_eq!(
            batch_sizes(512, 16, true),
            vec![1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
        );
        assert_eq!(batch_sizes(12, 4, true), vec![1, 2, 4, 8, 12]);
        assert_eq!(batch_sizes(16, 4, false), vec![4, 16]);
        assert_eq!(batch_sizes(4, 4, false), vec![4]);
    }

    #[test]
    fn memory_estimates_grow_with_the_batch() {
        let one = estimated_bytes(1, DType::F16);
        // At least what an H200 measured (less the CUDA context), at most 15 % more.
        let f16_512 = estimated_bytes(512, DType::F16) as f64;
        let measured_f16_512 = (4307.0 - 709.0) * 1048576.0;
        assert!(
            (measured_f16_512..measured_f16_512 * 1.15).contains(&f16_512),
            "{f16_512}"
        );
        let f32_512 = estimated_bytes(512, DType::F32) as f64;
        let measured_f32_512 = (7075.0 - 595.0) * 1048576.0;
        assert!(
            (measured_f32_512..measured_f32_512 * 1.15).contains(&f32_512),
            "{f32_512}"
        );
        assert!(estimated_bytes(2, DType::F16) > one);
        assert!(estimated_bytes(1, DType::F32) > one);
    }

    #[test]
    fn the_planned_paths_estimate_is_its_arena_plan_and_what_lies_outside() {
        use crate::model::cudnn::{Arena, ConvSettings, Epilogue, InputPad, Upsampling};
        use crate::model::netplan::{planned_bytes, NetOptions};
        use crate::model::upsample::UpForm;
        let planned = ConvSettings {
            epilogue: Epilogue::Own,
            input_pad: InputPad::Eight,
            upsampling: Upsampling::Phases,
            ..ConvSettings::default()
        };
        for n in [1, 64, 512] {
            let est = estimated_bytes_with(n, DType::F16, &planned);
            let arena = planned_bytes(&NetOptions::new(InputPad::Eight, UpForm::Phases), n, 2);
            let io = (n * (80 * 16 + 6 * 96 * 96 + 3 * 96 * 96) * 2) as u64;
            assert_eq!(
                est,
                weight_bytes(DType::F16) + PLANNED_OUTSIDE_BYTES + arena as u64 + io
            );
        }
        // The arena is the planned peak: at 512 in f16 within 1.5 GiB, so one instance's
        // estimate stays under 2.3 GiB and three fit 6 GB with the CUDA context.
        let at_512 = estimated_bytes_with(512, DType::F16, &planned);
        assert!(at_512 < (23 << 30) / 10, "{at_512}");
        assert!(at_512 < estimated_bytes(512, DType::F16));
        // The separate path (and an arena turned off) keep the measured layer-by-layer figure.
        let off = ConvSettings {
            arena: Arena::Off,
            ..planned.clone()
        };
        assert_eq!(
            estimated_bytes_with(512, DType::F16, &off),
            estimated_bytes(512, DType::F16)
        );
        let separate = ConvSettings {
            epilogue: Epilogue::Separate,
            ..planned.clone()
        };
        assert_eq!(
            estimated_bytes_with(512, DType::F16, &separate),
            estimated_bytes(512, DType::F16)
        );
        // A pool estimates by what its instances run.
        let mut cfg = config(true);
        assert_eq!(
            cfg.estimate(64, DType::F16),
            estimated_bytes(64, DType::F16)
        );
        cfg.planned_memory = Some(planned.clone());
        assert_eq!(
            cfg.estimate(64, DType::F16),
            estimated_bytes_with(64, DType::F16, &planned)
        );
    }

    use crate::engine::backend::Prediction;
    use crate::engine::scheduler::FrameWork;
    use std::sync::atomic::AtomicUsize;

    /// Each frame's prediction: its first mel value / 255, repeated.
    fn first_mel_values(n: usize, mel: &[f32]) -> Vec<f32> {
        (0..n)
            .flat_map(|i| std::iter::repeat_n(mel[i * MEL_LEN] / 255.0, PRED_LEN))
            .collect()
    }

    /// A model double: predictions are the frame's first mel value; it can fail warm-up
    /// (before switching to its reference path) and panic in a given call.
    struct Double {
        calls: Arc<AtomicUsize>,
        panic_at: Option<usize>,
        fast_path_fails: bool,
        reference: bool,
    }

    impl Model for Double {
        fn dtype(&self) -> DType {
            DType::F32
        }
        fn conv_path(&self) -> &'static str {
            if self.reference {
                "reference"
            } else {
                "fast"
            }
        }
        fn predict(
            &mut self,
            n: usize,
            mel: Vec<f32>,
            _face: Vec<f32>,
        ) -> Result<Prediction, crate::engine::Error> {
            let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
            if self.panic_at == Some(call) {
                panic!("double panics at call {call}");
            }
            if self.fast_path_fails && !self.reference {
                return Err(crate::engine::Error::Inference(
                    "CUDNN_STATUS_NOT_SUPPORTED".into(),
                ));
            }
            Ok(Prediction {
                faces: first_mel_values(n, &mel),
                overflow: false,
            })
        }
        fn use_reference_path(&mut self) -> bool {
            !std::mem::replace(&mut self.reference, true)
        }
    }

    struct DoubleLoader {
        calls: Arc<AtomicUsize>,
        loads: AtomicUsize,
        panic_at: Option<usize>,
        fast_path_fails: bool,
    }

    impl Loader for DoubleLoader {
        fn load(&self, _: Precision, _: usize) -> Result<Box<dyn Model>, crate::engine::Error> {
            self.loads.fetch_add(1, Ordering::SeqCst);
            Ok(Box::new(Double {
                calls: self.calls.clone(),
                panic_at: self.panic_at,
                fast_path_fails: self.fast_path_fails,
                reference: false,
            }))
        }
    }

    fn config(warm_up: bool) -> PoolConfig {
        PoolConfig {
            warm_up,
            ..PoolConfig::testing(4, 2, 1000)
        }
    }

    fn frames(n: usize) -> Vec<FrameWork> {
        let face = Arc::new(vec![0u8; FACE_LEN / 2]);
        (0..n)
            .map(|index| FrameWork {
                index,
                shown: index,
                mel: vec![index as f32; MEL_LEN],
                face: face.clone(),
                enhance: None,
                restore: None,
                due: None,
            })
            .collect()
    }

    fn loader(panic_at: Option<usize>, fast_path_fails: bool) -> Arc<DoubleLoader> {
        Arc::new(DoubleLoader {
            calls: Arc::new(AtomicUsize::new(0)),
            loads: AtomicUsize::new(0),
            panic_at,
            fast_path_fails,
        })
    }

    #[test]
    fn a_warm_up_error_switches_to_the_reference_path_instead_of_failing() {
        let l = loader(None, true);
        let pool = Pool::start(l.clone(), config(true));
        pool.wait_ready()
            .expect("the instance falls back and becomes ready");
        assert_eq!(pool.status().conv_path(), Some("reference"));
        let (_, rx) = pool.scheduler().admit(frames(3)).unwrap();
        let mut got: Vec<usize> = (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap().unwrap().0)
            .collect();
        got.sort();
        assert_eq!(got, vec![0, 1, 2]);
        pool.shutdown();
    }

    #[test]
    fn a_panicking_instance_fails_its_frames_and_is_restarted() {
        // No warm-up: the second model call (the second batch) panics.
        let l = loader(Some(2), false);
        let pool = Pool::start(l.clone(), config(false));
        pool.wait_ready().unwrap();
        let (a, rx) = pool.scheduler().admit(frames(2)).unwrap();
        for _ in 0..2 {
            assert!(rx.recv_timeout(Duration::from_secs(5)).unwrap().is_ok());
        }
        pool.scheduler().finish(a);
        let (_, rx) = pool.scheduler().admit(frames(2)).unwrap();
        // The frames the panicking batch held fail; the request does not hang.
        let r = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(r.unwrap_err().contains("panicked"));
        // The instance comes back (reloaded) and serves again.
        let t = Instant::now();
        while pool.status().restarts() == 0 || !pool.status().all_ready() {
            assert!(t.elapsed() < Duration::from_secs(10), "not restarted");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(l.loads.load(Ordering::SeqCst), 2);
        let (_, rx) = pool.scheduler().admit(frames(3)).unwrap();
        for _ in 0..3 {
            assert!(rx.recv_timeout(Duration::from_secs(5)).unwrap().is_ok());
        }
        pool.shutdown();
    }

    #[test]
    fn queued_frames_cost_their_frames_and_the_batches_they_need_shared_by_the_instances() {
        let c = BatchCost {
            fixed: 0.040,
            per_frame: 0.005,
        };
        assert_eq!(c.queue_seconds(0, 512, 3), 0.0);
        // One frame: one batch.
        assert!((c.queue_seconds(1, 512, 1) - 0.045).abs() < 1e-12);
        // 1000 frames at batches of 512: two batches; three instances share the work.
        let want = (1000.0 * 0.005 + 2.0 * 0.040) / 3.0;
        assert!((c.queue_seconds(1000, 512, 3) - want).abs() < 1e-12);
        // Exactly full batches need no extra one.
        assert!((c.queue_seconds(1024, 512, 1) - (1024.0 * 0.005 + 2.0 * 0.040)).abs() < 1e-12);
        // Degenerate settings do not divide by zero.
        assert!((c.queue_seconds(2, 0, 0) - (2.0 * 0.005 + 2.0 * 0.040)).abs() < 1e-12);
    }

    #[test]
    fn batch_costs_fit_two_points_and_give_the_fill_size() {
        let c = BatchCost::fit((16, 0.010 + 16.0 * 0.0002), (512, 0.010 + 512.0 * 0.0002));
        assert!((c.fixed - 0.010).abs() < 1e-9 && (c.per_frame - 0.0002).abs() < 1e-12);
        assert_eq!(c.largest_within(Duration::from_millis(150), 16, 512), 512);
        assert_eq!(c.largest_within(Duration::from_millis(60), 16, 512), 250);
        assert_eq!(c.largest_within(Duration::from_millis(5), 16, 512), 16);
    }

    // Half-precision batches, their f32 recompute and its copy of the model.

    /// What the doubles below saw, in order.
    #[derive(Debug, Clone, PartialEq)]
    enum Seen {
        /// `Loader::load(precision, check_batch)`.
        Load(Precision, usize),
        /// `Model::finish_warm_up` on a model in this dtype.
        Finished(DType),
        /// `Model::predict` in this dtype at this batch size, with each frame's first mel
        /// value, the address of the mel buffer and its capacity in frames.
        Predict {
            dtype: DType,
            size: usize,
            firsts: Vec<f32>,
            mel_at: usize,
            capacity: usize,
        },
    }

    type Log = Arc<Mutex<Vec<Seen>>>;

    /// A model double in f16 or f32: predictions are each frame's first mel value / 255 in
    /// f32, and -1 in f16, where a frame whose first mel value is `OVERFLOW` (or `NAN`) makes
    /// the batch report an overflow (or a NaN output).
    struct Scripted {
        dtype: DType,
        log: Log,
    }

    const OVERFLOW: f32 = 1000.0;
    const NAN: f32 = 2000.0;

    impl Model for Scripted {
        fn dtype(&self) -> DType {
            self.dtype
        }
        fn conv_path(&self) -> &'static str {
            "scripted"
        }
        fn predict(
            &mut self,
            n: usize,
            mel: Vec<f32>,
            face: Vec<f32>,
        ) -> Result<Prediction, crate::engine::Error> {
            assert_eq!((mel.len(), face.len()), (n * MEL_LEN, n * FACE_LEN));
            let firsts: Vec<f32> = (0..n).map(|i| mel[i * MEL_LEN]).collect();
            self.log.lock().unwrap().push(Seen::Predict {
                dtype: self.dtype,
                size: n,
                firsts: firsts.clone(),
                mel_at: mel.as_ptr() as usize,
                capacity: mel.capacity() / MEL_LEN,
            });
            if self.dtype == DType::F32 {
                return Ok(Prediction {
                    faces: first_mel_values(n, &mel),
                    overflow: false,
                });
            }
            let nan = firsts.contains(&NAN);
            Ok(Prediction {
                faces: vec![if nan { f32::NAN } else { -1.0 }; n * PRED_LEN],
                overflow: firsts.contains(&OVERFLOW),
            })
        }
        fn use_reference_path(&mut self) -> bool {
            false
        }
        fn finish_warm_up(&mut self) {
            self.log.lock().unwrap().push(Seen::Finished(self.dtype));
        }
    }

    struct ScriptedLoader {
        log: Log,
    }

    impl Loader for ScriptedLoader {
        fn load(
            &self,
            precision: Precision,
            check_batch: usize,
        ) -> Result<Box<dyn Model>, crate::engine::Error> {
            self.log
                .lock()
                .unwrap()
                .push(Seen::Load(precision, check_batch));
            Ok(Box::new(Scripted {
                dtype: precision.dtype(),
                log: self.log.clone(),
            }))
        }
    }

    /// Frames whose first mel values are `firsts`, counting the frames built and keeping the
    /// address of the mel buffer the first frame was written to.
    struct Counted {
        firsts: Vec<f32>,
        built: std::cell::Cell<usize>,
        mel_at: std::cell::Cell<usize>,
    }

    impl Counted {
        fn new(firsts: &[f32]) -> Counted {
            Counted {
                firsts: firsts.to_vec(),
                built: Default::default(),
                mel_at: Default::default(),
            }
        }
    }

    impl BatchInputs for Counted {
        fn frames(&self) -> usize {
            self.firsts.len()
        }
        fn push(&self, i: usize, mel: &mut Vec<f32>, face: &mut Vec<f32>) {
            mel.push(self.firsts[i]);
            mel.resize(mel.len() + MEL_LEN - 1, 0.5);
            face.resize(face.len() + FACE_LEN, 0.25);
            self.built.set(self.built.get() + 1);
            if mel.len() == MEL_LEN {
                self.mel_at.set(mel.as_ptr() as usize);
            }
        }
        fn index(&self, i: usize) -> usize {
            100 + i
        }
    }

    #[test]
    fn the_recent_batch_cost_follows_served_batches_outside_the_band() {
        let status = PoolStatus::default();
        assert_eq!(status.recent_batch_cost(), None);
        let warm = BatchCost {
            fixed: 0.01,
            per_frame: 0.001,
        };
        *status.cost.lock().unwrap() = Some(warm);
        assert_eq!(status.recent_batch_cost(), Some(warm));
        // Batches a little slower than the warm-up's figure: it stands.
        for _ in 0..20 {
            status.observe_batch(10, Duration::from_secs_f64(0.024));
        }
        assert_eq!(status.recent_batch_cost(), Some(warm));
        // Three times slower (a busier machine): the cost follows, towards 3x.
        for _ in 0..30 {
            status.observe_batch(10, Duration::from_secs_f64(0.06));
        }
        let now = status.recent_batch_cost().unwrap();
        assert!(
            (now.per_frame / warm.per_frame - 3.0).abs() < 0.05,
            "{now:?}"
        );
        assert!((now.fixed / warm.fixed - 3.0).abs() < 0.05, "{now:?}");
        // Four times faster than the warm-up (a warm-up on a busy machine): it follows.
        for _ in 0..40 {
            status.observe_batch(10, Duration::from_secs_f64(0.005));
        }
        let now = status.recent_batch_cost().unwrap();
        assert!(
            (now.per_frame / warm.per_frame - 0.25).abs() < 0.02,
            "{now:?}"
        );
        // The warm-up's batch cost itself is kept.
        assert_eq!(status.batch_cost(), Some(warm));
    }

    #[test]
    fn a_batchs_frame_numbers_are_padded_like_its_inputs() {
        let inputs = Counted::new(&[1.0, 2.0, 3.0]);
        assert_eq!(batch_indices(&inputs, 0..3, 4), vec![100, 101, 102, 102]);
        assert_eq!(batch_indices(&inputs, 1..3, 2), vec![101, 102]);
        assert_eq!(batch_indices(&Zeros(2), 0..2, 4), vec![0, 1, 1, 1]);
    }

    /// An f16 instance with padding to 1, 2, 4, 8 frames on the scripted doubles.
    fn half_instance<'a>(loader: &'a ScriptedLoader, memory_limit: Option<u64>) -> Instance<'a> {
        // A scheduler of its own that no batch comes from (the tests call the instance).
        let scheduler: &'static Scheduler = Box::leak(Box::new(Scheduler::new(
            config(false).limits,
            Duration::ZERO,
            1,
        )));
        Instance {
            id: 0,
            loader,
            scheduler,
            model: loader.load(Precision::F16, 8).unwrap(),
            fallback: None,
            sizes: batch_sizes(8, 2, true),
            pad: true,
            cap: 8,
            memory_limit,
            planned_memory: None,
            spare: Vec::new(),
        }
    }

    fn predicts(log: &Log, dtype: DType) -> Vec<(usize, Vec<f32>)> {
        log.lock()
            .unwrap()
            .iter()
            .filter_map(|s| match s {
                Seen::Predict {
                    dtype: d,
                    size,
                    firsts,
                    ..
                } if *d == dtype => Some((*size, firsts.clone())),
                _ => None,
            })
            .collect()
    }

    /// Runs `f` with a Prometheus recorder of its own and returns what it renders.
    fn with_metrics(f: impl FnOnce()) -> String {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, f);
        handle.render()
    }

    #[test]
    fn a_half_precision_batch_builds_its_inputs_once_into_the_buffers_the_model_takes() {
        let log = Log::default();
        let loader = ScriptedLoader { log: log.clone() };
        let mut inst = half_instance(&loader, None);
        let inputs = Counted::new(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        let pred = inst.forward_raw(&inputs).unwrap();
        assert_eq!(pred, vec![-1.0; 5 * PRED_LEN]);
        // Each frame built once; no f32 copy of the model.
        assert_eq!(inputs.built.get(), 5);
        assert!(inst.fallback.is_none());
        let seen = log.lock().unwrap().clone();
        assert_eq!(seen.len(), 2, "{seen:?}");
        // The model got the very buffers built, padded to 8 in place (never reallocated).
        let Seen::Predict {
            size,
            firsts,
            mel_at,
            capacity,
            ..
        } = &seen[1]
        else {
            panic!("{seen:?}")
        };
        assert_eq!(*size, 8);
        assert_eq!(firsts, &[1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0]);
        assert_eq!(*mel_at, inputs.mel_at.get());
        assert_eq!(*capacity, 8);
    }

    #[test]
    fn overflowed_and_non_finite_batches_are_recomputed_in_f32_from_rebuilt_inputs() {
        let log = Log::default();
        let loader = ScriptedLoader { log: log.clone() };
        let mut inst = half_instance(&loader, None);
        let text = with_metrics(|| {
            for (firsts, rebuilt) in [
                (vec![1.0, OVERFLOW, 3.0], true),
                (vec![NAN, 7.0], true),
                (vec![8.0, 9.0], false),
                (vec![OVERFLOW], true),
            ] {
                let inputs = Counted::new(&firsts);
                let pred = inst.forward_raw(&inputs).unwrap();
                let want: Vec<f32> = if rebuilt {
                    first_mel_values(
                        firsts.len(),
                        &build_inputs(&inputs, 0..firsts.len(), firsts.len(), Vec::new()).0,
                    )
                } else {
                    vec![-1.0; firsts.len() * PRED_LEN]
                };
                assert_eq!(pred.len(), want.len());
                assert!(pred.iter().zip(&want).all(|(a, b)| a == b));
                let builds = if rebuilt { 3 } else { 1 };
                assert_eq!(inputs.built.get(), builds * firsts.len());
            }
        });
        // The f32 copy got the same frames, padded like any batch.
        assert_eq!(
            predicts(&log, DType::F32),
            vec![
                (4, vec![1.0, OVERFLOW, 3.0, 3.0]),
                (2, vec![NAN, 7.0]),
                (1, vec![OVERFLOW]),
            ]
        );
        // Loaded once, for the first recompute.
        let loads = log
            .lock()
            .unwrap()
            .iter()
            .filter(|s| matches!(s, Seen::Load(Precision::F32, _)))
            .count();
        assert_eq!(loads, 1);
        assert!(
            text.contains("lipsync_precision_fallbacks_total{reason=\"overflow\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("lipsync_precision_fallbacks_total{reason=\"nan\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn the_f32_copy_is_checked_small_warmed_up_at_once_and_split_to_the_memory_limit() {
        // (limit, the check batch, the f32 batches of a batch of 8 frames and of 3 frames;
        // none where the f16 batch of 3, padded to 4, no longer fits beside the f32 copy's
        // weights).
        let cases = [
            (fallback_bytes(5, DType::F16), 2, vec![4, 4], Some(vec![4])),
            (
                fallback_bytes(2, DType::F16) + estimated_bytes(8, DType::F16),
                2,
                vec![8],
                Some(vec![4]),
            ),
            (fallback_bytes(1, DType::F16) + 1, 1, vec![1; 8], None),
        ];
        for (limit, check, eights, threes) in cases {
            let log = Log::default();
            let loader = ScriptedLoader { log: log.clone() };
            let mut inst = half_instance(&loader, Some(limit));
            let mut firsts: Vec<f32> = (0..8).map(|i| i as f32).collect();
            firsts[5] = OVERFLOW;
            let pred = inst.forward_raw(&Counted::new(&firsts)).unwrap();
            assert_eq!(pred.len(), 8 * PRED_LEN);
            assert_eq!(pred[5 * PRED_LEN], OVERFLOW / 255.0);
            assert_eq!(pred[7 * PRED_LEN], 7.0 / 255.0);
            let three = inst.forward_raw(&Counted::new(&[OVERFLOW, 1.0, 2.0]));
            match &threes {
                Some(_) => assert_eq!(three.unwrap()[0], OVERFLOW / 255.0),
                None => assert!(is_out_of_memory(&three.unwrap_err())),
            }
            let seen = log.lock().unwrap().clone();
            // The f32 copy: loaded once, checked at a small batch within the limit, its
            // warm-up finished before its first batch.
            let first_f32 = seen
                .iter()
                .position(|s| {
                    matches!(
                        s,
                        Seen::Predict {
                            dtype: DType::F32,
                            ..
                        }
                    )
                })
                .unwrap();
            let loads: Vec<_> = seen
                .iter()
                .enumerate()
                .filter(|(_, s)| matches!(s, Seen::Load(Precision::F32, _)))
                .collect();
            assert_eq!(loads.len(), 1, "{seen:?}");
            assert_eq!(
                loads[0].1,
                &Seen::Load(Precision::F32, check),
                "limit {limit}"
            );
            assert!(fallback_bytes(check, DType::F16) <= limit);
            assert_eq!(seen[loads[0].0 + 1], Seen::Finished(DType::F32));
            assert!(loads[0].0 + 1 < first_f32);
            let finished = seen
                .iter()
                .filter(|s| **s == Seen::Finished(DType::F32))
                .count();
            assert_eq!(finished, 1);
            // Its batches fit the limit.
            let sizes: Vec<usize> = predicts(&log, DType::F32).iter().map(|p| p.0).collect();
            let want: Vec<usize> = eights
                .iter()
                .chain(threes.iter().flatten())
                .copied()
                .collect();
            assert_eq!(sizes, want, "limit {limit}");
            for size in sizes {
                assert!(fallback_bytes(size, DType::F16) <= limit);
            }
        }
    }

    #[test]
    fn a_recompute_that_cannot_fit_one_frame_is_out_of_memory() {
        let log = Log::default();
        let loader = ScriptedLoader { log: log.clone() };
        // The f16 batch of 2 fits; one frame in f32 does not.
        let mut inst = half_instance(&loader, Some(fallback_bytes(1, DType::F16) - 1));
        let e = inst
            .forward_raw(&Counted::new(&[OVERFLOW, 1.0]))
            .unwrap_err();
        assert!(is_out_of_memory(&e), "{e}");
        assert!(predicts(&log, DType::F32).is_empty());
    }

    #[test]
    fn warm_up_lowers_the_cap_until_a_batch_fits_the_memory_limit() {
        // Without padding the sizes are 2 and 16: 16 is over the limit, and so is half of it
        // (8, never one of the sizes); the cap halves again to 4, which fits, and the
        // instance starts instead of failing its warm-up.
        let log = Log::default();
        let loader = Arc::new(ScriptedLoader { log: log.clone() });
        let mut cfg = config(true);
        cfg.limits.max_batch = 16;
        cfg.memory_limit = Some(estimated_bytes(5, DType::F32));
        let pool = Pool::start(loader, cfg);
        pool.wait_ready().unwrap();
        pool.shutdown();
        let sizes: Vec<usize> = log
            .lock()
            .unwrap()
            .iter()
            .filter_map(|s| match s {
                Seen::Predict { size, .. } => Some(*size),
                _ => None,
            })
            .collect();
        assert!(sizes.contains(&4), "{sizes:?}");
        assert!(sizes.iter().all(|&n| n <= 5), "{sizes:?}");
    }

    #[test]
    fn instances_are_checked_at_their_largest_batch_within_the_memory_limit() {
        let log = Log::default();
        let loader = Arc::new(ScriptedLoader { log: log.clone() });
        let mut cfg = config(false);
        cfg.limits.max_batch = 16;
        cfg.pad_batches = true;
        for (limit, check) in [
            (None, 16),
            (Some(estimated_bytes(8, DType::F32)), 8),
            (Some(estimated_bytes(5, DType::F32)), 4),
            (Some(estimated_bytes(1, DType::F32) - 1), 1),
        ] {
            log.lock().unwrap().clear();
            cfg.memory_limit = limit;
            let pool = Pool::start(loader.clone(), cfg.clone());
            pool.wait_ready().unwrap();
            pool.shutdown();
            assert_eq!(
                log.lock().unwrap()[0],
                Seen::Load(Precision::F32, check),
                "{limit:?}"
            );
        }
    }
}
