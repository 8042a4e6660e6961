//! Model instances, each on its own OS thread with its own copy of the weights on the device
//! (and on CUDA its own stream), pulling batches from the shared [`Scheduler`].
//!
//! An instance loads, runs warm-up batches at the first-batch and full-batch sizes, then
//! reports ready; the service answers `/ready` only when every instance has.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};

use super::batcher::Limits;
use super::metrics as m;
use super::render::predictions_to_bgr;
use super::scheduler::{BatchItem, Scheduler};
use crate::model::arch::{FACE_CHANNELS, FACE_SIZE, MEL_BINS, MEL_STEPS};
use crate::model::{self, DeviceKind, GeneratorWeights, Precision, Wav2Lip};

/// How to run the pool.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    pub device: DeviceKind,
    pub precision: Precision,
    pub instances: usize,
    pub limits: Limits,
    /// How long a batch may wait to fill.
    pub batch_wait: Duration,
}

/// What the pool is doing, for `/ready`, `/info` and metrics.
#[derive(Debug, Default)]
pub struct PoolStatus {
    pub instances: usize,
    ready: AtomicUsize,
    busy: AtomicUsize,
    failed: Mutex<Option<String>>,
    dtype: Mutex<Option<DType>>,
    /// Moving average of one instance's frames per second.
    rate: Mutex<f64>,
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

    pub fn all_ready(&self) -> bool {
        self.ready() == self.instances
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
    pub fn start(weights: Arc<GeneratorWeights>, cfg: PoolConfig) -> Pool {
        let scheduler = Arc::new(Scheduler::new(cfg.limits, cfg.batch_wait));
        let status = Arc::new(PoolStatus {
            instances: cfg.instances,
            ..Default::default()
        });
        let threads = (0..cfg.instances)
            .map(|i| {
                let (weights, cfg, scheduler, status) = (
                    weights.clone(),
                    cfg.clone(),
                    scheduler.clone(),
                    status.clone(),
                );
                std::thread::Builder::new()
                    .name(format!("lipsync-instance-{i}"))
                    .spawn(move || instance(i, &weights, &cfg, &scheduler, &status))
                    .expect("spawning an instance thread")
            })
            .collect();
        Pool {
            scheduler,
            status,
            threads: Mutex::new(threads),
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
        self.scheduler.shutdown();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

fn instance(
    i: usize,
    weights: &GeneratorWeights,
    cfg: &PoolConfig,
    scheduler: &Scheduler,
    status: &PoolStatus,
) {
    let fail = |e: String| {
        tracing::error!("instance {i} cannot start: {e}");
        status
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
    };
    let start = Instant::now();
    let model = match load(weights, cfg) {
        Ok(m) => m,
        Err(e) => return fail(e.to_string()),
    };
    *status.dtype.lock().unwrap_or_else(|p| p.into_inner()) = Some(model.dtype());
    // Warm-up at every batch size the instance will see first (kernels, allocations).
    for n in [cfg.limits.first_batch, cfg.limits.max_batch] {
        if let Err(e) = warm_up(&model, n) {
            return fail(format!("warm-up at batch {n} failed: {e}"));
        }
    }
    status.ready.fetch_add(1, Ordering::SeqCst);
    metrics::gauge!(m::INSTANCES_READY).set(status.ready() as f64);
    tracing::info!(
        "instance {i} ready in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    while let Some(batch) = scheduler.next_batch() {
        if batch.is_empty() {
            continue;
        }
        let busy = status.busy.fetch_add(1, Ordering::SeqCst) + 1;
        metrics::gauge!(m::INSTANCES_BUSY).set(busy as f64);
        let (t, n) = (Instant::now(), batch.len());
        run(&model, batch);
        status.record_batch(n, t.elapsed());
        let busy = status.busy.fetch_sub(1, Ordering::SeqCst) - 1;
        metrics::gauge!(m::INSTANCES_BUSY).set(busy as f64);
    }
}

fn load(weights: &GeneratorWeights, cfg: &PoolConfig) -> Result<Wav2Lip, model::Error> {
    let device = cfg.device.open_instance()?;
    let dtype = model::compute_dtype(&device, cfg.precision);
    Wav2Lip::load(weights, &device, dtype)
}

fn warm_up(model: &Wav2Lip, n: usize) -> Result<(), model::Error> {
    let dev = model.device();
    let mel = Tensor::zeros((n, 1, MEL_BINS, MEL_STEPS), DType::F32, dev)?;
    let face = Tensor::zeros((n, FACE_CHANNELS, FACE_SIZE, FACE_SIZE), DType::F32, dev)?;
    model
        .forward(&mel, &face)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok(())
}

/// Runs one batch and answers every frame (a failure goes to every request in the batch).
fn run(model: &Wav2Lip, items: Vec<BatchItem>) {
    let t = Instant::now();
    let n = items.len();
    let mut requests: Vec<_> = items.iter().map(|i| i.request).collect();
    requests.sort();
    requests.dedup();
    let result = (|| -> Result<Vec<Vec<u8>>, super::Error> {
        let dev = model.device();
        let mut mel = Vec::with_capacity(n * MEL_BINS * MEL_STEPS);
        let mut face = Vec::with_capacity(n * FACE_CHANNELS * FACE_SIZE * FACE_SIZE);
        for item in &items {
            mel.extend_from_slice(&item.work.mel);
            face.extend_from_slice(&item.face);
        }
        let mel = Tensor::from_vec(mel, (n, 1, MEL_BINS, MEL_STEPS), dev)?;
        let face = Tensor::from_vec(face, (n, FACE_CHANNELS, FACE_SIZE, FACE_SIZE), dev)?;
        predictions_to_bgr(&model.forward(&mel, &face)?)
    })();
    m::stage("inference", t.elapsed());
    m::batch(n, requests.len());
    match result {
        Ok(faces) => {
            for (item, face) in items.into_iter().zip(faces) {
                // A closed receiver means the request was cancelled meanwhile.
                let _ = item.reply.send(Ok((item.work.index, face)));
            }
        }
        Err(e) => {
            tracing::error!("batch of {n} frames failed: {e}");
            for item in items {
                let _ = item.reply.send(Err(e.to_string()));
            }
        }
    }
}
