//! Model instances, each on its own OS thread with its own copy of the weights on the device
//! (and on CUDA its own stream), pulling batches from the shared [`Scheduler`].
//!
//! An instance loads, runs warm-up batches at every batch size it will run, then reports ready;
//! the service answers `/ready` only when every instance has.
//!
//! - **Fixed batch sizes.** With padding (the default on CUDA) a batch of n frames runs at the
//!   smallest power of two >= n (or the maximum), filled with copies of its last frame, so
//!   warm-up (and convolution autotuning) covers every shape ever served.
//! - **Precision.** A batch whose f16/bf16 output holds NaN or infinity is recomputed in f32
//!   (the f32 copy of the model is made on first need) and counted.
//! - **Out of memory.** A batch that runs out of device memory is split in halves and retried,
//!   and the instance asks for smaller batches from then on; one frame that does not fit
//!   fails alone. `memory_limit` makes the instance treat any batch whose estimated memory
//!   exceeds it as out of memory (to cap its share of a GPU, and to test this path).

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
    /// Run batches at fixed sizes (powers of two up to the maximum).
    pub pad_batches: bool,
    /// Device memory an instance may use, in bytes (estimated per batch).
    pub memory_limit: Option<u64>,
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

/// Estimated device memory of a forward pass of `n` frames: the weights plus, per frame, the
/// widest activations (1.5 M elements at the final concatenation) and convolution scratch
/// (the im2col buffer of the 80->32 output convolution is 6.6 M elements), rounded up.
pub fn estimated_bytes(n: usize, dtype: DType) -> u64 {
    const WEIGHTS: u64 = 36_275_283;
    const PER_FRAME: u64 = 8_500_000;
    (WEIGHTS + PER_FRAME * n as u64) * dtype.size_in_bytes() as u64
}

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
    weights: &Arc<GeneratorWeights>,
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
    let model = match load(weights, cfg.device, cfg.precision) {
        Ok(m) => m,
        Err(e) => return fail(e.to_string()),
    };
    *status.dtype.lock().unwrap_or_else(|p| p.into_inner()) = Some(model.dtype());
    *status.conv_path.lock().unwrap_or_else(|p| p.into_inner()) = Some(model.conv_engine());
    let mut inst = Instance {
        id: i,
        model,
        fallback: None,
        weights: weights.clone(),
        device: cfg.device,
        sizes: batch_sizes(
            cfg.limits.max_batch,
            cfg.limits.first_batch,
            cfg.pad_batches,
        ),
        pad: cfg.pad_batches,
        cap: cfg.limits.max_batch,
        memory_limit: cfg.memory_limit,
    };
    // Warm-up at every size this instance will run (kernels, allocations, autotuning); a size
    // that does not fit in memory lowers the instance's batch limit.
    for n in inst.sizes.clone() {
        if n > inst.cap {
            break;
        }
        match inst.forward(&warm_up_items(n)) {
            Ok(_) => {}
            Err(e) if is_out_of_memory(&e) && n > 1 => {
                inst.lower_cap(n / 2);
                break;
            }
            Err(e) => return fail(format!("warm-up at batch {n} failed: {e}")),
        }
    }
    status.ready.fetch_add(1, Ordering::SeqCst);
    metrics::gauge!(m::INSTANCES_READY).set(status.ready() as f64);
    tracing::info!(
        "instance {i} ready in {:.1} s (batches up to {})",
        start.elapsed().as_secs_f64(),
        inst.cap
    );
    while let Some(batch) = scheduler.next_batch_within(inst.cap) {
        if batch.is_empty() {
            continue;
        }
        let busy = status.busy.fetch_add(1, Ordering::SeqCst) + 1;
        metrics::gauge!(m::INSTANCES_BUSY).set(busy as f64);
        let (t, n) = (Instant::now(), batch.len());
        inst.serve(batch);
        status.record_batch(n, t.elapsed());
        let busy = status.busy.fetch_sub(1, Ordering::SeqCst) - 1;
        metrics::gauge!(m::INSTANCES_BUSY).set(busy as f64);
    }
}

fn load(
    weights: &GeneratorWeights,
    device: DeviceKind,
    precision: Precision,
) -> Result<Wav2Lip, model::Error> {
    let device = device.open_instance()?;
    let dtype = model::compute_dtype(&device, precision);
    let mut model = Wav2Lip::load(weights, &device, dtype)?;
    // The own cuDNN path must agree with candle's operations before it serves.
    model.verify_cudnn_path()?;
    Ok(model)
}

/// Inputs for a warm-up batch (zeros; the face input is shared).
fn warm_up_items(n: usize) -> Vec<(Vec<f32>, Arc<Vec<f32>>)> {
    let face = Arc::new(vec![0f32; FACE_CHANNELS * FACE_SIZE * FACE_SIZE]);
    (0..n)
        .map(|_| (vec![0f32; MEL_BINS * MEL_STEPS], face.clone()))
        .collect()
}

/// Whether an error is the device running out of memory (real or under `memory_limit`).
pub fn is_out_of_memory(e: &super::Error) -> bool {
    match e {
        super::Error::OutOfMemory(_) => true,
        other => {
            let s = other.to_string();
            s.contains("out of memory") || s.contains("OUT_OF_MEMORY")
        }
    }
}

/// One model instance's state (owned by its thread).
struct Instance {
    id: usize,
    model: Wav2Lip,
    /// An f32 copy for batches whose half-precision output is not finite.
    fallback: Option<Wav2Lip>,
    weights: Arc<GeneratorWeights>,
    device: DeviceKind,
    sizes: Vec<usize>,
    pad: bool,
    /// Largest batch this instance asks for.
    cap: usize,
    memory_limit: Option<u64>,
}

impl Instance {
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

    /// Predicted faces for `(mel, face)` inputs, padded to the batch size set.
    fn forward(
        &mut self,
        items: &[(Vec<f32>, Arc<Vec<f32>>)],
    ) -> Result<Vec<Vec<u8>>, super::Error> {
        let n = items.len();
        let size = self.padded(n);
        if let Some(limit) = self.memory_limit {
            let need = estimated_bytes(size, self.model.dtype());
            if need > limit {
                return Err(super::Error::OutOfMemory(format!(
                    "a batch of {size} needs about {need} bytes, over the {limit}-byte limit"
                )));
            }
        }
        let mut mel = Vec::with_capacity(size * MEL_BINS * MEL_STEPS);
        let mut face = Vec::with_capacity(size * FACE_CHANNELS * FACE_SIZE * FACE_SIZE);
        for k in 0..size {
            let (m, f) = &items[k.min(n - 1)];
            mel.extend_from_slice(m);
            face.extend_from_slice(f);
        }
        let dev = self.model.device().clone();
        let mel = Tensor::from_vec(mel, (size, 1, MEL_BINS, MEL_STEPS), &dev)?;
        let face = Tensor::from_vec(face, (size, FACE_CHANNELS, FACE_SIZE, FACE_SIZE), &dev)?;
        let mut pred = self.model.forward(&mel, &face)?.to_dtype(DType::F32)?;
        if self.model.dtype() != DType::F32 && !all_finite(&pred)? {
            metrics::counter!(m::PRECISION_FALLBACKS).increment(1);
            tracing::warn!(
                "instance {}: {:?} output not finite; recomputing the batch in f32",
                self.id,
                self.model.dtype()
            );
            if self.fallback.is_none() {
                self.fallback = Some(load(&self.weights, self.device, Precision::F32)?);
            }
            let f32_model = self.fallback.as_ref().expect("just loaded");
            pred = f32_model.forward(&mel, &face)?;
        }
        let mut faces = predictions_to_bgr(&pred)?;
        faces.truncate(n);
        Ok(faces)
    }

    /// Runs a batch and answers every frame; out of memory splits it and retries.
    fn serve(&mut self, items: Vec<BatchItem>) {
        let t = Instant::now();
        let inputs: Vec<(Vec<f32>, Arc<Vec<f32>>)> = items
            .iter()
            .map(|i| (i.work.mel.clone(), i.face.clone()))
            .collect();
        match self.forward(&inputs) {
            Ok(faces) => {
                m::stage("inference", t.elapsed());
                let mut requests: Vec<_> = items.iter().map(|i| i.request).collect();
                requests.sort();
                requests.dedup();
                m::batch(items.len(), requests.len());
                for (item, face) in items.into_iter().zip(faces) {
                    // A closed receiver means the request was cancelled meanwhile.
                    let _ = item.reply.send(Ok((item.work.index, face)));
                }
            }
            Err(e) if is_out_of_memory(&e) && items.len() > 1 => {
                metrics::counter!(m::OOM_SPLITS).increment(1);
                let mut first = items;
                let rest = first.split_off(first.len() / 2);
                self.lower_cap(first.len());
                self.serve(first);
                self.serve(rest);
            }
            Err(e) => {
                tracing::error!(
                    "instance {}: batch of {} frames failed: {e}",
                    self.id,
                    items.len()
                );
                for item in items {
                    let _ = item.reply.send(Err(e.to_string()));
                }
            }
        }
    }
}

fn all_finite(t: &Tensor) -> Result<bool, super::Error> {
    let v = t.flatten_all()?.to_vec1::<f32>()?;
    Ok(v.iter().all(|x| x.is_finite()))
}

#[cfg(test)]
mod tests {
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
        assert!(estimated_bytes(512, DType::F16) > 8_000_000_000);
        assert!(estimated_bytes(2, DType::F16) > one);
        assert_eq!(estimated_bytes(1, DType::F32), 2 * one);
    }
}
