//! Capacity of live sessions: the service's real scheduler and batcher
//! (`lipsync::engine::scheduler`, real-time lanes, earliest deadline first) driven by
//! simulated model instances whose batch of `n` frames takes `a + b·n` ms (`n` rounded up to a
//! power of two with `--pad-batches`, as the pool pads on CUDA), and by simulated sessions that
//! speak half the time (utterances of `--speak-s` seconds separated by as much silence, each
//! session starting at a random phase, fixed seed).
//!
//! A session's speaking frame `j` is handed to the scheduler when its audio is complete (the
//! utterance's start + j/fps + 212.5 ms, as `engine::session` does when audio arrives in real
//! time) with the deadline start + lag + j/fps, where lag is what the server uses: 212.5 ms +
//! one frame + one first batch at `a + b·first_batch`. Idle frames cost the model nothing.
//! Lateness is the time an instance finishes a frame's batch minus the frame's deadline.
//!
//!     cargo run --release --example stream_capacity -- --a-ms 40 --b-ms 4.8 --instances 3 \
//!         --max-batch 512 --first-batch 16 --pad-batches --sessions 25,50,75,100 --speed 1
//!
//! Prints one Markdown row per session count: frames drawn per second, mean batch, lateness
//! p50/p99/max and the share of late frames. Compositing and encoding (CPU work beside the
//! model) are not simulated.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use lipsync::engine::batcher::{Limits, RequestId};
use lipsync::engine::pool::BatchCost;
use lipsync::engine::scheduler::{FrameWork, Scheduler};

#[derive(Parser, Debug, Clone)]
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
    #[arg(long)]
    pad_batches: bool,
    /// Session counts to try.
    #[arg(long, value_delimiter = ',', default_value = "25,50,75,100")]
    sessions: Vec<usize>,
    #[arg(long, default_value_t = 25.0)]
    fps: f64,
    /// Seconds of each utterance (and of each silence between two).
    #[arg(long, default_value_t = 4.0)]
    speak_s: f64,
    /// Simulated seconds per session count.
    #[arg(long, default_value_t = 20.0)]
    seconds: f64,
    /// Run the clock this many times faster than real time.
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// How long a batch may wait to fill, ms (the server's --batch-wait-ms).
    #[arg(long, default_value_t = 2.0)]
    fill_wait_ms: f64,
    #[arg(long, default_value = "sim")]
    label: String,
}

struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[(((sorted.len() - 1) as f64) * p).round() as usize]
}

fn run(args: &Args, sessions: usize) -> String {
    let real = |ms: f64| Duration::from_secs_f64(ms / 1e3 / args.speed);
    let limits = Limits {
        max_batch: args.max_batch,
        first_batch: args.first_batch,
        fill_batch: args.max_batch,
        max_queue: 1_000_000,
        max_ahead: 1_000_000,
    };
    let sched = Arc::new(Scheduler::new(
        limits,
        real(args.fill_wait_ms),
        args.instances,
    ));
    // As the pool does after warm-up (in real time: the clock runs `speed` times faster).
    sched.set_batch_cost(BatchCost {
        fixed: args.a_ms / 1e3 / args.speed,
        per_frame: args.b_ms / 1e3 / args.speed,
    });
    let deadlines: Arc<Mutex<HashMap<RequestId, Instant>>> = Arc::default();
    let lateness: Arc<Mutex<Vec<f64>>> = Arc::default();
    let batches: Arc<Mutex<Vec<usize>>> = Arc::default();
    let mut workers = Vec::new();
    for _ in 0..args.instances {
        let (s, d, l, b) = (
            sched.clone(),
            deadlines.clone(),
            lateness.clone(),
            batches.clone(),
        );
        let (a, per) = (args.a_ms, args.b_ms);
        let pad = args.pad_batches;
        let speed = args.speed;
        workers.push(std::thread::spawn(move || {
            while let Some(batch) = s.next_batch() {
                let n = batch.len();
                let runs = if pad { n.next_power_of_two() } else { n };
                std::thread::sleep(Duration::from_secs_f64(
                    (a + per * runs as f64) / 1e3 / speed,
                ));
                let done = Instant::now();
                b.lock().unwrap().push(n);
                for item in batch {
                    let due = d.lock().unwrap().remove(&item.request);
                    if let Some(due) = due {
                        let late = if done >= due {
                            (done - due).as_secs_f64()
                        } else {
                            -(due - done).as_secs_f64()
                        };
                        // Back to simulated milliseconds.
                        l.lock().unwrap().push(late * 1e3 * speed);
                    }
                    s.ack(item.request, 1);
                    s.finish(item.request);
                }
            }
        }));
    }
    // Every speaking frame of every session: (release, deadline) in simulated seconds.
    let lag = 0.2125 + 1.0 / args.fps + (args.a_ms + args.b_ms * args.first_batch as f64) / 1e3;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let period = 2.0 * args.speak_s;
    let mut frames: Vec<(f64, f64)> = Vec::new();
    for _ in 0..sessions {
        let phase = rng.unit() * period;
        let mut start = phase - period;
        while start < args.seconds {
            // Utterances start on a frame boundary.
            let u = (start * args.fps).ceil() / args.fps;
            let n = (args.speak_s * args.fps) as usize;
            for j in 0..n {
                let t = u + j as f64 / args.fps;
                let release = t + 0.2125;
                if (0.0..args.seconds).contains(&release) {
                    frames.push((release, t + lag));
                }
            }
            start += period;
        }
    }
    frames.sort_by(|a, b| a.0.total_cmp(&b.0));
    let t0 = Instant::now();
    let at = |s: f64| t0 + Duration::from_secs_f64(s / args.speed);
    let face = Arc::new(vec![0u8; 1]);
    for (release, deadline) in &frames {
        if let Some(wait) = at(*release).checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let work = FrameWork {
            index: 0,
            shown: 0,
            mel: Vec::new(),
            face: face.clone(),
            enhance: None,
            restore: None,
            due: None,
        };
        // Register the deadline before the frame can be taken.
        let mut d = deadlines.lock().unwrap();
        let (id, _results) = sched.admit_realtime(vec![(work, at(*deadline))]);
        d.insert(id, at(*deadline));
    }
    while sched.queued() > 0 || !deadlines.lock().unwrap().is_empty() {
        std::thread::sleep(Duration::from_millis(5));
    }
    sched.shutdown();
    for w in workers {
        let _ = w.join();
    }
    let mut l = lateness.lock().unwrap().clone();
    l.sort_by(f64::total_cmp);
    let b = batches.lock().unwrap();
    let mean_batch = b.iter().sum::<usize>() as f64 / b.len().max(1) as f64;
    let late = l.iter().filter(|v| **v > 0.0).count() as f64 / l.len().max(1) as f64;
    format!(
        "| {} | {sessions} | {:.0} | {:.0} | {mean_batch:.1} | {:.0} ms | {:.0} ms | {:.0} ms | {:.1} % |",
        args.label,
        lag * 1e3,
        l.len() as f64 / args.seconds,
        percentile(&l, 0.5),
        percentile(&l, 0.99),
        l.last().copied().unwrap_or(f64::NAN),
        late * 100.0
    )
}

fn main() {
    let args = Args::parse();
    println!(
        "| profile | sessions | lag | frames/s drawn | mean batch | lateness p50 | p99 | max | late |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for &n in &args.sessions {
        println!("{}", run(&args, n));
    }
}
