//! The CPU's side of the live offer: what a live frame costs the process tree, measured as
//! frames go out, and how many frames per second the cores can take; and the process-tree
//! CPU accounting from `/proc` it rests on (which `bench --sections media` uses too).
//!
//! Every live frame is composited and encoded on the CPU whether its face was drawn or held,
//! and the cost grows with the frame's pixels. So the meter keeps one figure, CPU seconds per
//! megapixel of live frame, as a moving average of samples: the process tree's CPU time
//! (this process's threads, its reaped children and its live children, i.e. the session
//! encoders), less the model instances' threads (the model's side of the offer counts them),
//! over the live pixels sent in the same second ([`metered_pixels`]: weighed by what a frame
//! of a photo or a video avatar, as fMP4 or as JPEG, costs against a photo's fMP4 frame). Until live frames have gone out it uses
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

/// CPU seconds per megapixel of live frame before any has been measured: 512×512 sessions
/// on the echo device took 2.5–3.5 ms of CPU per frame, fMP4 or JPEG, speaking half the
/// time (0.010–0.013 s per megapixel; 2-core VM, 2026-11-27, `lipsync bench --sections
/// media`, docs/BENCHMARKS.md), rounded up to leave room for larger avatars' compositing.
pub const PRIOR_SECONDS_PER_MEGAPIXEL: f64 = 0.014;

/// What a video avatar's live fMP4 frame costs the cores against a photo's of the same size:
/// the stored frame decoded, converted whole and encoded with its motion, where a photo's
/// frame converts only the face's region and x264 finds the rest unchanged. Measured with
/// `lipsync bench --sections media` on the echo device at the live encoder's defaults
/// (x264 ultrafast, at most 2 Mbit/s; 25 fps, speaking half the time; 2-vCPU VM,
/// 2026-11-29, docs/BENCHMARKS.md, two runs): 9.4–11.3 ms of CPU per 1280×720 frame of the
/// bench's clip (a pan with film grain) against 2.3–3.4 ms per 512×512 photo frame. Per
/// megapixel, at the same number of sessions, 0.91–1.16 of the photo's cost; the highest,
/// rounded up. (At veryfast with no cap, before, it was 2.2: 40.6 against 5.3 ms per frame;
/// a server set back to those pays that, and the meter's measured figure follows it.)
pub const CLIP_FRAME_COST: f64 = 1.2;

/// What a video avatar's live JPEG frame costs when the clip was stored as whole JPEGs (by a
/// version before segments): every frame decoded and encoded whole. Not measured on its own:
/// the fMP4 clip frame's weight from before the live encoder's defaults changed, kept as the
/// safe side (decoding and encoding a whole 720p JPEG costs about what converting and
/// encoding it did).
pub const CLIP_JPEG_WHOLE_FRAME_COST: f64 = 2.2;

/// What a video avatar's live frame sent as JPEG costs the cores against a photo's frame of
/// the same size: it is sent as stored while idle, and encoded only in the segments its face
/// changed while speaking (see [`crate::media::jpeg`]). Measured with `lipsync bench
/// --sections media` on the echo device (25 fps, speaking half the time; 2-vCPU VM,
/// 2026-11-29, docs/BENCHMARKS.md, 1, 4 and 16 sessions): 0.78–1.39 ms of CPU per 1280×720
/// clip JPEG frame against 2.41–3.47 ms per 512×512 photo fMP4 frame (0.09–0.11 of its cost
/// per megapixel), rounded up, as a clip's speaking frames cost several times its idle ones
/// and come in bursts: on the prior, 2 cores then admit 24 clip JPEG sessions, which held
/// every speaking frame in the same bench, where 32 (0.15) held half of them. A photo's
/// frames count the same whatever the output (`/info`'s `max_sessions` counts 512×512 photo
/// sessions).
pub const CLIP_JPEG_FRAME_COST: f64 = 0.2;

/// [`CLIP_JPEG_FRAME_COST`] for a clip whose frames were stored with one segment per row of
/// MCUs (by the version before segments were cut narrower): a speaking frame decodes and
/// encodes the whole rows over its face. Measured the same way (2026-11-29): 2.0–2.9 ms of
/// CPU per 1280×720 frame against 3.4–4.6 ms per 512×512 photo fMP4 frame on a slower day
/// of the VM, rounded up: 16 sessions on 2 cores.
pub const CLIP_JPEG_ROWS_FRAME_COST: f64 = 0.3;

/// What a live frame is, as the CPU meter weighs it ([`metered_pixels`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LiveFrame {
    /// A photo's frame, fMP4 or JPEG.
    Photo,
    /// A video avatar's fMP4 frame ([`CLIP_FRAME_COST`]).
    Clip,
    /// A video avatar's JPEG frame, stored as a whole JPEG ([`CLIP_JPEG_WHOLE_FRAME_COST`]).
    ClipJpegWhole,
    /// A video avatar's JPEG frame, stored in segments narrower than a row
    /// ([`CLIP_JPEG_FRAME_COST`]).
    ClipJpeg,
    /// A video avatar's JPEG frame, stored with one segment per row
    /// ([`CLIP_JPEG_ROWS_FRAME_COST`]).
    ClipJpegRows,
}

/// The pixels the meter counts for a live frame of `width` × `height` of `kind`: its pixels,
/// weighed by what such a frame costs against a photo's, so one figure per megapixel serves
/// every kind and each session is offered what it takes.
pub fn metered_pixels(width: u32, height: u32, kind: LiveFrame) -> u64 {
    let pixels = u64::from(width) * u64::from(height);
    let cost = match kind {
        LiveFrame::Photo => 1.0,
        LiveFrame::Clip => CLIP_FRAME_COST,
        LiveFrame::ClipJpegWhole => CLIP_JPEG_WHOLE_FRAME_COST,
        LiveFrame::ClipJpeg => CLIP_JPEG_FRAME_COST,
        LiveFrame::ClipJpegRows => CLIP_JPEG_ROWS_FRAME_COST,
    };
    ((pixels as f64 * cost).round() as u64).max(1)
}

/// Share of the cores live sessions may fill: the rest absorbs bursts (a batch's frames
/// composited at once, an utterance's first frames) and the server's other work.
pub const CPU_UTILISATION: f64 = 0.8;

/// How often a sample is taken, at most.
const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// Live pixels a sample needs (20 frames of 512×512): fewer say too little.
const SAMPLE_PIXELS: u64 = 20 * 512 * 512;

/// Weight of a new sample in the moving average.
const SAMPLE_WEIGHT: f64 = 0.3;

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

/// CPU seconds of this process and its descendants, reaped ones included
/// ([`tree_cpu_seconds_of`] this process).
pub fn tree_cpu_seconds() -> f64 {
    tree_cpu_seconds_of(std::process::id())
}

/// Threads of the model instances (`lipsync-instance-N`, cut to 15 bytes by the kernel).
const INSTANCE_THREAD: &str = "lipsync-instanc";

/// [`tree_cpu_seconds`] less the CPU time of the model instances' threads that are running.
pub fn media_cpu_seconds() -> f64 {
    let model: u64 = std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.trim_end().starts_with(INSTANCE_THREAD))
        })
        .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
        .filter_map(|s| parse_stat(&s))
        .map(|f| f.ticks)
        .sum();
    tree_cpu_seconds() - model as f64 / clock_ticks()
}

/// Clock ticks per second of /proc's CPU times (`getconf CLK_TCK`, 100 where it cannot say;
/// asked once).
pub fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .filter(|t: &f64| *t > 0.0)
            .unwrap_or(100.0)
    })
}

/// One process (or thread) as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone)]
pub struct ProcStat {
    pub pid: u32,
    pub ppid: u32,
    /// Its command name (15 bytes at most).
    pub comm: String,
    /// utime + stime + cutime + cstime, in clock ticks: its own CPU and that of every
    /// descendant it has reaped (a thread's reaped children are 0).
    pub ticks: u64,
}

/// Parses a stat line. The command may hold spaces and parentheses, so it is cut at the last
/// `)`; after it come state, ppid, ... utime (the 14th field), stime, cutime, cstime.
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let pid = text[..open].trim().parse().ok()?;
    let comm = text[open + 1..close].to_string();
    let f: Vec<&str> = text[close + 1..].split_whitespace().collect();
    // f[0] is field 3 (state): field k is f[k - 3].
    let num = |k: usize| f.get(k - 3).and_then(|x| x.parse::<u64>().ok());
    Some(ProcStat {
        pid,
        ppid: u32::try_from(num(4)?).ok()?,
        comm,
        ticks: num(14)? + num(15)? + num(16)? + num(17)?,
    })
}

/// Every process on the machine.
pub fn processes() -> Vec<ProcStat> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|t| parse_stat(&t))
        .collect()
}

/// `root` (first) and its live descendants.
pub fn tree(root: u32) -> Vec<ProcStat> {
    let all = processes();
    let mut children: std::collections::HashMap<u32, Vec<&ProcStat>> = Default::default();
    for p in &all {
        children.entry(p.ppid).or_default().push(p);
    }
    let mut out: Vec<ProcStat> = all.iter().filter(|p| p.pid == root).cloned().collect();
    let mut i = 0;
    while i < out.len() {
        if let Some(c) = children.get(&out[i].pid) {
            out.extend(c.iter().map(|p| (*p).clone()));
        }
        i += 1;
    }
    out
}

/// CPU seconds of `root`'s process tree so far: each live process's own time plus what it
/// has reaped (a process that ended is in its parent's reaped time). Linux's `/proc`; 0
/// where it cannot be read.
pub fn tree_cpu_seconds_of(root: u32) -> f64 {
    tree(root).iter().map(|p| p.ticks).sum::<u64>() as f64 / clock_ticks()
}

/// CPU seconds of this process's reaped children so far (cutime + cstime).
pub fn reaped_children_seconds() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|t| {
            // Fields 16 and 17 (cutime, cstime): 13 and 14 after the command.
            let f: Vec<&str> = t[t.rfind(')')? + 1..].split_whitespace().collect();
            Some(f.get(13)?.parse::<u64>().ok()? + f.get(14)?.parse::<u64>().ok()?)
        })
        .map_or(0.0, |t| t as f64 / clock_ticks())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clip_frame_counts_its_cost_against_a_photo_frames() {
        assert_eq!(metered_pixels(512, 512, LiveFrame::Photo), 512 * 512);
        assert_eq!(metered_pixels(1280, 720, LiveFrame::Clip), 1_105_920);
        assert_eq!(
            metered_pixels(1280, 720, LiveFrame::ClipJpegWhole),
            2_027_520
        );
        assert_eq!(metered_pixels(1280, 720, LiveFrame::ClipJpeg), 184_320);
        assert_eq!(metered_pixels(1280, 720, LiveFrame::ClipJpegRows), 276_480);
        // With the prior on two cores, 512² photo sessions: 17 fMP4 or JPEG; 720p clip
        // sessions: 4 fMP4, 24 JPEG (16 stored by rows, 2 stored whole).
        let meter = CpuMeter::new(2);
        let sessions =
            |kind, w, h| (meter.frames_per_second(metered_pixels(w, h, kind)) / 25.0).floor();
        assert_eq!(sessions(LiveFrame::Photo, 512, 512), 17.0);
        assert_eq!(sessions(LiveFrame::Clip, 1280, 720), 4.0);
        assert_eq!(sessions(LiveFrame::ClipJpegWhole, 1280, 720), 2.0);
        assert_eq!(sessions(LiveFrame::ClipJpeg, 1280, 720), 24.0);
        assert_eq!(sessions(LiveFrame::ClipJpegRows, 1280, 720), 16.0);
    }

    #[test]
    fn stat_lines_give_the_parent_and_the_cpu_of_the_process_and_its_reaped_children() {
        let line = "4242 (ffmpeg (x264) a) S 17 4242 17 0 -1 4194304 900 0 0 0 \
                    250 40 7 3 20 0 3 0 1000 2000000 500 18446744073709551615";
        let s = parse_stat(line).unwrap();
        assert_eq!(
            (s.pid, s.ppid, s.comm.as_str()),
            (4242, 17, "ffmpeg (x264) a")
        );
        assert_eq!(s.ticks, 300);
        assert!(parse_stat("garbage").is_none());
        // This process is its own tree's root.
        let me = std::process::id();
        assert_eq!(tree(me)[0].pid, me);
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
