//! The CPU's side of the live offer: what a live frame costs the process tree, measured as
//! frames go out, and how many frames per second the cores can take.
//!
//! Every live frame is composited and encoded on the CPU whether its face was drawn or held,
//! and the cost grows with the frame's pixels. So the meter keeps one figure, CPU seconds per
//! megapixel of live frame, as a moving average of samples: the process tree's CPU time
//! (this process's threads, its reaped children and its live children, i.e. the session
//! encoders), less the model instances' threads (the model's side of the offer counts them),
//! over the live pixels sent in the same second. Until live frames have gone out it uses
//! [`PRIOR_SECONDS_PER_MEGAPIXEL`], measured on a 2-core VM.
//!
//! The limit applies where the model does not run on the CPU (cuda, echo). On the CPU device
//! the model's own threads are not all the instances' (its matrix products run on a shared
//! pool), and the model's measured capacity already leaves the cores' share to the media
//! side, so the meter measures there but does not limit.
//!
//! The sample counts all of the process's CPU, not only the sessions': HTTP renders running
//! beside the sessions make a live frame look dearer, and the offer shrinks while they run,
//! which is what the sessions would meet.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// CPU seconds per megapixel of live frame before any has been measured: 512×512 JPEG and
/// fMP4 sessions on the echo device, 2-core VM, 2026-11-26 (`lipsync bench --sections media`,
/// docs/BENCHMARKS.md), rounded up.
pub const PRIOR_SECONDS_PER_MEGAPIXEL: f64 = 0.040;

/// Share of the cores live sessions may fill: the rest absorbs bursts (a batch's frames
/// composited at once, an utterance's first frames) and the server's other work.
pub const CPU_UTILISATION: f64 = 0.8;

/// How often a sample is taken, at most.
const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// Live pixels a sample needs (20 frames of 512×512): fewer say too little.
const SAMPLE_PIXELS: u64 = 20 * 512 * 512;

/// Weight of a new sample in the moving average.
const SAMPLE_WEIGHT: f64 = 0.3;

/// Clock ticks per second in `/proc/<pid>/stat` (USER_HZ, 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

/// The meter (one per server).
#[derive(Debug)]
pub struct CpuMeter {
    cores: f64,
    /// Whether the cores limit the offer ([`CpuMeter::set_limiting`]).
    limiting: std::sync::atomic::AtomicBool,
    /// Live frame pixels handed to the sessions' outputs so far.
    pixels: AtomicU64,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    at: Instant,
    cpu: f64,
    pixels: u64,
    per_megapixel: f64,
    samples: u64,
}

impl Default for CpuMeter {
    /// A meter for the cores this process may run on.
    fn default() -> Self {
        CpuMeter::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

impl CpuMeter {
    /// A meter for `cores` cores.
    pub fn new(cores: usize) -> Self {
        CpuMeter {
            cores: cores.max(1) as f64,
            limiting: std::sync::atomic::AtomicBool::new(true),
            pixels: AtomicU64::new(0),
            state: Mutex::new(State {
                at: Instant::now(),
                cpu: media_cpu_seconds(),
                pixels: 0,
                per_megapixel: PRIOR_SECONDS_PER_MEGAPIXEL,
                samples: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A live frame of `pixels` pixels went out.
    pub fn frame_sent(&self, pixels: u64) {
        self.pixels.fetch_add(pixels, Ordering::Relaxed);
    }

    /// Takes a sample if a second has passed and enough live pixels went out since the last
    /// one (the server calls it every second).
    pub fn sample(&self) {
        let mut s = self.lock();
        let now = Instant::now();
        if now.duration_since(s.at) < SAMPLE_EVERY {
            return;
        }
        let pixels = self.pixels.load(Ordering::Relaxed);
        let cpu = media_cpu_seconds();
        let sent = pixels.saturating_sub(s.pixels);
        if sent >= SAMPLE_PIXELS {
            let used = (cpu - s.cpu).max(0.0);
            let sample = used / (sent as f64 / 1e6);
            s.per_megapixel = if s.samples == 0 {
                sample
            } else {
                (1.0 - SAMPLE_WEIGHT) * s.per_megapixel + SAMPLE_WEIGHT * sample
            };
            s.samples += 1;
        }
        // A window without enough live frames starts over (its CPU was not theirs).
        s.at = now;
        s.cpu = cpu;
        s.pixels = pixels;
    }

    /// CPU seconds per megapixel of live frame (measured, or the prior).
    pub fn seconds_per_megapixel(&self) -> f64 {
        self.lock().per_megapixel
    }

    /// Whether the figure has been measured here (else it is the prior).
    pub fn measured(&self) -> bool {
        self.lock().samples > 0
    }

    /// Whether the cores limit the offer (on by default; the server turns it off on the CPU
    /// device, see the module's documentation).
    pub fn set_limiting(&self, on: bool) {
        self.limiting.store(on, Ordering::Relaxed);
    }

    /// Live megapixels per second the cores take ([`CPU_UTILISATION`] of them); infinite
    /// when they do not limit the offer.
    pub fn megapixels_per_second(&self) -> f64 {
        if !self.limiting.load(Ordering::Relaxed) {
            return f64::INFINITY;
        }
        self.cores * CPU_UTILISATION / self.seconds_per_megapixel().max(1e-6)
    }

    /// Live frames per second of `pixels` pixels each the cores take.
    pub fn frames_per_second(&self, pixels: u64) -> f64 {
        self.megapixels_per_second() / (pixels.max(1) as f64 / 1e6)
    }
}

/// CPU seconds of this process and its children, reaped ones included: the process's own
/// user and system time, its waited-for children's, and each live child's (with its own
/// reaped children). Linux's `/proc`; 0 where it cannot be read.
pub fn tree_cpu_seconds() -> f64 {
    let me = std::process::id();
    let own = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| stat_fields(&s))
        .map_or(0.0, |f| f.cpu_ticks);
    let children: f64 = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|s| stat_fields(&s))
        .filter(|f| f.ppid == me)
        .map(|f| f.cpu_ticks)
        .sum();
    (own + children) / TICKS_PER_SECOND
}

/// Threads of the model instances (`lipsync-instance-N`, cut to 15 bytes by the kernel).
const INSTANCE_THREAD: &str = "lipsync-instanc";

/// [`tree_cpu_seconds`] less the CPU time of the model instances' threads that are running.
pub fn media_cpu_seconds() -> f64 {
    let model: f64 = std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.trim_end().starts_with(INSTANCE_THREAD))
        })
        .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
        .filter_map(|s| stat_fields(&s))
        .map(|f| f.cpu_ticks)
        .sum();
    tree_cpu_seconds() - model / TICKS_PER_SECOND
}

/// What the meter reads from a `/proc/<pid>/stat` line.
struct Stat {
    ppid: u32,
    /// utime + stime + cutime + cstime (a thread's children's are 0).
    cpu_ticks: f64,
}

/// Parses a stat line: the fields after the command (which may hold spaces and parentheses,
/// so it is cut at the last `)`): state, ppid, ... utime (14th field), stime, cutime, cstime.
fn stat_fields(line: &str) -> Option<Stat> {
    let rest = &line[line.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // f[0] is field 3 (state): field k is f[k - 3].
    let field = |k: usize| f.get(k - 3).and_then(|v| v.parse::<f64>().ok());
    Some(Stat {
        ppid: f.get(1)?.parse().ok()?,
        cpu_ticks: field(14)? + field(15)? + field(16)? + field(17)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_give_the_parent_and_the_cpu_of_the_process_and_its_reaped_children() {
        let line = "4242 (ffmpeg (x264) a) S 17 4242 17 0 -1 4194304 900 0 0 0 \
                    250 40 7 3 20 0 3 0 1000 2000000 500 18446744073709551615";
        let s = stat_fields(line).unwrap();
        assert_eq!(s.ppid, 17);
        assert_eq!(s.cpu_ticks, 300.0);
        assert!(stat_fields("garbage").is_none());
    }

    #[test]
    fn the_tree_counts_a_child_while_it_runs_and_after_it_is_reaped() {
        let before = tree_cpu_seconds();
        // A child that burns about 0.3 s of CPU.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done"])
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(150));
        let running = tree_cpu_seconds();
        child.wait().unwrap();
        let reaped = tree_cpu_seconds();
        // Other tests' children come and go in this process too: only the growth is sure.
        assert!(running - before > 0.0, "{before} {running}");
        assert!(reaped - before >= 0.05, "{before} {running} {reaped}");
    }

    #[test]
    fn the_model_instances_threads_are_not_the_media_sides() {
        let spin = |name: &str| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(|| {
                    let t = std::time::Instant::now();
                    let mut x = 0u64;
                    while t.elapsed() < Duration::from_millis(400) {
                        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
                    }
                    // Parked until the measurement: a finished thread leaves /proc's list.
                    std::thread::sleep(Duration::from_millis(400));
                })
                .unwrap()
        };
        let (tree, media) = (tree_cpu_seconds(), media_cpu_seconds());
        let model = spin("lipsync-instance-7");
        std::thread::sleep(Duration::from_millis(600));
        let (tree_after, media_after) = (tree_cpu_seconds(), media_cpu_seconds());
        model.join().unwrap();
        // The instance thread's 0.4 s count in the tree and not in the media side.
        let in_tree = tree_after - tree;
        let in_media = media_after - media;
        assert!(in_tree - in_media >= 0.2, "tree {in_tree} media {in_media}");
    }

    #[test]
    fn the_meter_follows_samples_with_enough_live_pixels_and_gives_frames_per_second() {
        let meter = CpuMeter::new(2);
        assert!(!meter.measured());
        let prior = meter.frames_per_second(512 * 512);
        let want = 2.0 * CPU_UTILISATION / (PRIOR_SECONDS_PER_MEGAPIXEL * 0.262_144);
        assert!((prior - want).abs() < 1e-6 * want, "{prior} {want}");
        // Too few pixels: no sample.
        meter.lock().at -= SAMPLE_EVERY;
        meter.frame_sent(10);
        meter.sample();
        assert!(!meter.measured());
        // Enough pixels and some CPU: a sample replaces the prior.
        meter.lock().at -= SAMPLE_EVERY;
        // 50 s of CPU (and whatever the tests beside this one burn) over 10 000 megapixels.
        meter.lock().cpu -= 50.0;
        meter.frame_sent(10_000 * 1_000_000);
        meter.sample();
        assert!(meter.measured());
        let per = meter.seconds_per_megapixel();
        assert!((0.005..0.02).contains(&per), "{per}");
        // Twice the pixels, half the frames.
        let a = meter.frames_per_second(1_000_000);
        let b = meter.frames_per_second(2_000_000);
        assert!((a - 2.0 * b).abs() < 1e-9 * a);
    }
}
