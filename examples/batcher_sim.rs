//! The service's real batcher and scheduler (`lipsync::engine::scheduler`) under simulated load,
//! without a model or a GPU: each simulated model instance is a thread that takes batches with
//! `Scheduler::next_batch_within` exactly as `engine::pool` does, and "runs" a batch of `n`
//! frames by sleeping `a + b·n` ms (`n` rounded up to a power of two with `--pad-batches`, as
//! the pool pads on CUDA). Requests arrive as a Poisson process (fixed seed) with lengths drawn
//! from `--lengths`; each has a consumer thread that receives its frames and acknowledges them
//! in order (like `engine::job`, with an encoder that costs nothing), then finishes it.
//!
//!     cargo run --release --example batcher_sim -- --a-ms 40 --b-ms 4.8 --instances 3 \
//!         --max-batch 512 --first-batch 16 --pad-batches --lengths 25,100,250,1000 \
//!         --rates 0.5,1,1.5,2 --requests 150 --speed 10
//!
//! Prints one Markdown table row per arrival rate: mean batch size, the share of batches no
//! larger than `--first-batch`, frames/s (frames computed over the time from the first arrival
//! to the last frame), time to first frame (arrival to the instance finishing the batch that
//! holds the request's first frame; p50/p95) and requests refused (429: queue bound or
//! `--max-requests`). All times are simulated time; `--speed S` runs the clock S times faster
//! than real time (sleeps and the scheduler's fill wait divided by S).
//!
//! Only `limits` and `admit` below touch the scheduler's API: adapt them when it changes.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use lipsync::engine::batcher::{Limits, Overloaded, RequestId};
use lipsync::engine::pool::{self, BatchCost};
use lipsync::engine::scheduler::{Drawn, FrameResult, FrameWork, Scheduler};

#[derive(Parser, Debug, Clone)]
#[command(about = "The real batcher/scheduler driven by simulated model instances")]
struct Args {
    /// Fixed cost of one batch, ms.
    #[arg(long)]
    a_ms: f64,
    /// Cost per frame of a batch, ms.
    #[arg(long)]
    b_ms: f64,
    #[arg(long, default_value_t = 3)]
    instances: usize,
    #[arg(long, default_value_t = 512)]
    max_batch: usize,
    #[arg(long, default_value_t = 16)]
    first_batch: usize,
    /// Queue bound in frames (the server's --max-queue-frames) [default: 50000].
    #[arg(long, default_value_t = 50_000)]
    max_queue: usize,
    /// Frames a request may run ahead of its consumer [default: 2 × max batch].
    #[arg(long)]
    max_ahead: Option<usize>,
    /// Requests in flight at once; more are refused (the server's --max-requests).
    #[arg(long, default_value_t = 32)]
    max_requests: usize,
    /// How long a batch may wait to fill, ms (the server's --batch-wait-ms).
    #[arg(long, default_value_t = 2.0)]
    fill_wait_ms: f64,
    /// While a new request waits, fill its batch up to the size done within this many ms
    /// (`(latency - a) / b`, as the pool derives it from the cost it measures at warm-up; the
    /// server's --fill-latency-ms).
    #[arg(long, default_value_t = 150.0)]
    fill_latency_ms: f64,
    /// Run batches at the next power of two (the pool's padding on CUDA).
    #[arg(long)]
    pad_batches: bool,
    /// Request lengths in frames (25 per second of speech), drawn uniformly; repeat a value to
    /// weight it.
    #[arg(long, value_delimiter = ',', default_value = "25,100,250,1000")]
    lengths: Vec<usize>,
    /// Mean arrival rates to run, requests per second (one table row each).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    rates: Vec<f64>,
    /// Requests per run.
    #[arg(long, default_value_t = 150)]
    requests: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Simulated time runs this many times faster than real time.
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// A label for the first column.
    #[arg(long, default_value = "")]
    label: String,
}

/// The scheduler's bounds. With `fill_batch` (this tree's scheduler), batches formed while a
/// new request waits are filled up to it; without (the older scheduler), they stay at
/// `first_batch`.
fn limits_without_fill(args: &Args) -> Limits {
    Limits {
        max_batch: args.max_batch,
        first_batch: args.first_batch,
        fill_batch: args.first_batch,
        max_queue: args.max_queue,
        max_ahead: args.max_ahead.unwrap_or(2 * args.max_batch),
    }
}

fn limits(args: &Args) -> Limits {
    Limits {
        fill_batch: fill_batch(args),
        ..limits_without_fill(args)
    }
}

/// Admits a request of `n` frames (one shared face input, as for a photo avatar).
fn admit(s: &Scheduler, n: usize) -> Result<(RequestId, Receiver<FrameResult>), Overloaded> {
    let face = Arc::new(Vec::new());
    let frames = (0..n)
        .map(|index| FrameWork {
            index,
            shown: index,
            mel: Vec::new(),
            face: face.clone(),
            enhance: None,
            restore: None,
            due: None,
        })
        .collect();
    s.admit(frames)
}

/// SplitMix64: a fixed-seed generator, enough for arrivals and lengths.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
}

#[derive(Default)]
struct Record {
    /// (frames, requests) per batch.
    batches: Vec<(usize, usize)>,
    /// Simulated ms from arrival to first frame, per admitted request.
    ttff_ms: Vec<f64>,
    frames: usize,
    last_frame: Option<Instant>,
}

struct Row {
    rate: f64,
    admitted: usize,
    refused: usize,
    offered_fps: f64,
    mean_batch: f64,
    small_share: f64,
    fps: f64,
    ttff_p50: f64,
    ttff_p95: f64,
    busy: f64,
}

/// The largest batch done within `--fill-latency-ms`, in `first_batch..=max_batch`.
fn fill_batch(args: &Args) -> usize {
    // The pool's own rule, from the cost it would measure at warm-up.
    let cost = BatchCost {
        fixed: args.a_ms / 1000.0,
        per_frame: args.b_ms / 1000.0,
    };
    pool::fill_batch(
        &cost,
        Duration::from_secs_f64(args.fill_latency_ms / 1000.0),
        &limits_without_fill(args),
        args.pad_batches,
    )
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn run(args: &Args, rate: f64) -> Row {
    let speed = args.speed;
    let real = move |ms: f64| Duration::from_secs_f64((ms / 1000.0 / speed).max(0.0));
    let sim_ms = move |d: Duration| d.as_secs_f64() * 1000.0 * speed;
    let sched = Arc::new(Scheduler::new(
        limits(args),
        real(args.fill_wait_ms),
        args.instances,
    ));
    let record = Arc::new(Mutex::new(Record::default()));
    let busy_ns = Arc::new(AtomicUsize::new(0));

    let instances: Vec<_> = (0..args.instances)
        .map(|_| {
            let (sched, record, busy_ns) = (sched.clone(), record.clone(), busy_ns.clone());
            let (a, b, pad, cap) = (args.a_ms, args.b_ms, args.pad_batches, args.max_batch);
            std::thread::spawn(move || {
                while let Some(batch) = sched.next_batch_within(cap) {
                    if batch.is_empty() {
                        continue;
                    }
                    let n = batch.len();
                    let runs_at = if pad {
                        n.next_power_of_two().min(cap.max(n))
                    } else {
                        n
                    };
                    let t = Instant::now();
                    std::thread::sleep(real(a + b * runs_at as f64));
                    busy_ns.fetch_add(t.elapsed().as_nanos() as usize, Ordering::Relaxed);
                    let requests: BTreeSet<RequestId> = batch.iter().map(|i| i.request).collect();
                    {
                        let mut r = record.lock().unwrap();
                        r.batches.push((n, requests.len()));
                        r.frames += n;
                        r.last_frame = Some(Instant::now());
                    }
                    for item in batch {
                        let _ = item
                            .reply
                            .send(Ok((item.work.index, Drawn::face(Vec::new()))));
                    }
                }
            })
        })
        .collect();

    let mut rng = Rng(args.seed);
    let active = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut due = 0.0f64; // simulated ms since start
    let (mut admitted, mut refused, mut offered_frames) = (0, 0, 0usize);
    let mut consumers = Vec::new();
    for _ in 0..args.requests {
        due += -rng.unit().ln() / rate * 1000.0;
        let n = args.lengths[(rng.next_u64() % args.lengths.len() as u64) as usize];
        offered_frames += n;
        let at = start + real(due);
        if let Some(wait) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        if active.load(Ordering::SeqCst) >= args.max_requests {
            refused += 1;
            continue;
        }
        let arrived = Instant::now();
        let Ok((id, results)) = admit(&sched, n) else {
            refused += 1;
            continue;
        };
        admitted += 1;
        active.fetch_add(1, Ordering::SeqCst);
        let (sched, record, active) = (sched.clone(), record.clone(), active.clone());
        consumers.push(std::thread::spawn(move || {
            // In order, as engine::job does: acknowledge each frame once all before it came.
            let (mut next, mut pending, mut first) = (0usize, BTreeSet::new(), None);
            while next < n {
                let Ok(Ok((index, _))) = results.recv() else {
                    break;
                };
                first.get_or_insert_with(|| arrived.elapsed());
                pending.insert(index);
                while pending.remove(&next) {
                    next += 1;
                    sched.ack(id, 1);
                }
            }
            sched.finish(id);
            active.fetch_sub(1, Ordering::SeqCst);
            if let Some(f) = first {
                record.lock().unwrap().ttff_ms.push(sim_ms(f));
            }
        }));
    }
    for c in consumers {
        c.join().unwrap();
    }
    sched.shutdown();
    for i in instances {
        i.join().unwrap();
    }

    let r = record.lock().unwrap();
    let span = r
        .last_frame
        .map(|t| sim_ms(t - start) / 1000.0)
        .unwrap_or(f64::NAN);
    let mut ttff = r.ttff_ms.clone();
    ttff.sort_by(f64::total_cmp);
    let batches = r.batches.len().max(1) as f64;
    Row {
        rate,
        admitted,
        refused,
        offered_fps: offered_frames as f64 / (due / 1000.0),
        mean_batch: r.frames as f64 / batches,
        small_share: r
            .batches
            .iter()
            .filter(|(n, _)| *n <= args.first_batch)
            .count() as f64
            / batches,
        fps: r.frames as f64 / span,
        ttff_p50: percentile(&ttff, 0.5),
        ttff_p95: percentile(&ttff, 0.95),
        busy: busy_ns.load(Ordering::Relaxed) as f64 / 1e9 * speed / (span * args.instances as f64),
    }
}

fn main() {
    let args = Args::parse();
    assert!(!args.lengths.is_empty() && args.speed > 0.0 && args.instances > 0);
    let full = args.max_batch as f64 / (args.a_ms + args.b_ms * args.max_batch as f64) * 1000.0;
    println!(
        "a = {} ms, b = {} ms/frame, {} instance(s), max batch {}, first batch {}, fill batch {} \
         ({} ms target), fill wait {} ms, pad {}, lengths {:?} frames, {} requests per rate, \
         seed {}, speed ×{}; capacity at full batches {:.0} frames/s\n",
        args.a_ms,
        args.b_ms,
        args.instances,
        args.max_batch,
        args.first_batch,
        fill_batch(&args),
        args.fill_latency_ms,
        args.fill_wait_ms,
        args.pad_batches,
        args.lengths,
        args.requests,
        args.seed,
        args.speed,
        full * args.instances as f64
    );
    println!(
        "| profile | arrivals/s | admitted / 429 | offered frames/s | mean batch | batches ≤ first | \
         frames/s | busy | TTFF p50 | TTFF p95 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for &rate in &args.rates {
        let r = run(&args, rate);
        println!(
            "| {} | {} | {} / {} | {:.0} | {:.1} | {:.0} % | {:.0} | {:.0} % | {:.0} ms | {:.0} ms |",
            args.label,
            r.rate,
            r.admitted,
            r.refused,
            r.offered_fps,
            r.mean_batch,
            r.small_share * 100.0,
            r.fps,
            r.busy * 100.0,
            r.ttff_p50,
            r.ttff_p95
        );
    }
}
