//! ffmpeg processes started ahead of the renders that will use them.
//!
//! Starting Debian's ffmpeg costs about 0.07–0.1 s of CPU (most of it the dynamic linker
//! binding some 200 libraries), and a render starts two or three of them just when its first
//! frames are being drawn: on a small machine that is most of the time to the first byte. A
//! [`Spares`] pool keeps, for each command line recently used, up to [`PER_LAUNCH`] processes
//! that have already started and wait on their empty stdin. A render takes one instead of
//! starting its own, and a replacement for the next render starts [`REFILL_DELAY`] later on
//! the pool's own thread (past the render's first byte, and ready for a request that follows
//! this one at once; until 2026-11-29 it started when the process ended, so such a request
//! started its own). Only what is the same for every render of a
//! shape can be started ahead: the command lines take the speech through a pipe (`pipe:3`),
//! never a file name.
//!
//! An idle spare costs a process that is blocked on read (a few MB of its own memory; the
//! libraries are shared). Spares idle longer than [`MAX_IDLE_AGE`] are ended, at most
//! [`MAX_IDLE`] are kept, and every spare ends by itself when the service exits (its stdin
//! closes).
//!
//! The pool also keeps the segmented encoder's x264 workers between renders
//! ([`super::segmented`]): a worker never sees the end of its input, so one render's workers
//! serve the next render of the same shape, already started and with x264 set up, instead of
//! two or more processes started (and their replacements started) for every render. Kept
//! workers go by the same rules: at most [`MAX_KEPT`], ended after [`MAX_IDLE_AGE`] unused.

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::process::{Launch, Started};
use super::segmented::KeptWorker;

/// Spares kept per command line: a render takes one (its muxer, or its single encoder; the
/// x264 workers are kept, not spares), and two let two requests of the same shape that
/// arrive together both find one.
pub const PER_LAUNCH: usize = 2;
/// Spares kept in all (the oldest go first).
pub const MAX_IDLE: usize = 12;
/// A spare unused this long is ended.
pub const MAX_IDLE_AGE: Duration = Duration::from_secs(600);
/// Encoder workers kept between renders, at most (the oldest go first): eight workers, a
/// GPU host's default for one video, for two shapes.
pub const MAX_KEPT: usize = 16;
/// How long after a render takes a process (or starts its own) the replacement starts: past
/// the render's first byte, which the start would slow (0.1–0.2 s on a 2-core machine).
pub const REFILL_DELAY: Duration = Duration::from_millis(250);

/// A pool of started ffmpeg processes; clones share it.
#[derive(Clone, Default)]
pub struct Spares(Arc<Pool>);

#[derive(Default)]
struct Pool {
    idle: Mutex<Vec<Spare>>,
    /// Workers a render has finished with, most recent last.
    kept: Mutex<Vec<Kept>>,
    /// The refill thread's queue, once it runs (it ends with the pool).
    refills: Mutex<Option<Sender<Launch>>>,
}

struct Spare {
    launch: Launch,
    started: Started,
    born: Instant,
}

struct Kept {
    launch: Launch,
    worker: KeptWorker,
    since: Instant,
}

impl std::fmt::Debug for Spares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Only counted: formatting ends no process.
        write!(
            f,
            "Spares({} idle, {} kept)",
            self.lock().len(),
            self.lock_kept().len()
        )
    }
}

impl Spares {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Spare>> {
        self.0.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`Self::refill`] [`REFILL_DELAY`] from now, on the pool's thread.
    pub(super) fn refill_later(&self, launch: Launch) {
        if let Some(tx) = self.thread().as_ref() {
            let _ = tx.send(launch);
        }
    }

    /// The pool's thread (started on first use), which starts spares and ends the ones,
    /// and the kept workers, that wait too long. None if it cannot start: then renders
    /// start their own processes, and kept workers are ended only as others replace them.
    fn thread(&self) -> std::sync::MutexGuard<'_, Option<Sender<Launch>>> {
        let mut refills = self.0.refills.lock().unwrap_or_else(|p| p.into_inner());
        if refills.is_none() {
            let (tx, rx) = channel();
            let pool = Arc::downgrade(&self.0);
            let started = std::thread::Builder::new()
                .name("encoder-spares".into())
                .spawn(move || refill_loop(&pool, &rx));
            if started.is_ok() {
                *refills = Some(tx);
            }
        }
        refills
    }

    /// Spares waiting now.
    pub fn idle(&self) -> usize {
        let mut idle = self.lock();
        expire(&mut idle);
        idle.len()
    }

    /// The process ids of the spares waiting now.
    pub fn idle_ids(&self) -> Vec<u32> {
        let mut idle = self.lock();
        expire(&mut idle);
        idle.iter().filter_map(|s| s.started.id()).collect()
    }

    /// Workers kept for the next render now.
    pub fn kept(&self) -> usize {
        self.expire_kept();
        self.lock_kept().len()
    }

    /// Workers kept now for `launch`.
    pub(super) fn kept_for(&self, launch: &Launch) -> usize {
        self.expire_kept();
        self.lock_kept()
            .iter()
            .filter(|k| &k.launch == launch)
            .count()
    }

    /// The process ids of the workers kept now, most recently kept last.
    pub fn kept_ids(&self) -> Vec<u32> {
        self.expire_kept();
        self.lock_kept()
            .iter()
            .filter_map(|k| k.worker.id())
            .collect()
    }

    fn lock_kept(&self) -> std::sync::MutexGuard<'_, Vec<Kept>> {
        self.0.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `worker`, started for `launch`, for the next render that asks for it.
    pub(super) fn keep(&self, launch: Launch, worker: KeptWorker) {
        drop(self.thread()); // it ends the workers that wait too long
        let ended: Vec<Kept> = {
            let mut kept = self.lock_kept();
            kept.push(Kept {
                launch,
                worker,
                since: Instant::now(),
            });
            let over = kept.len().saturating_sub(MAX_KEPT);
            kept.drain(..over).collect()
        };
        drop(ended); // ends those processes outside the lock
    }

    /// A kept worker for `launch`, if one waits (the one kept last: its pages are warmest).
    pub(super) fn take_kept(&self, launch: &Launch) -> Option<KeptWorker> {
        self.expire_kept();
        let mut kept = self.lock_kept();
        let i = kept.iter().rposition(|k| &k.launch == launch)?;
        Some(kept.remove(i).worker)
    }

    /// Ends the kept workers that exited or waited too long (outside the lock).
    fn expire_kept(&self) {
        let ended: Vec<Kept> = {
            let mut kept = self.lock_kept();
            let mut go = Vec::new();
            let mut stay = Vec::with_capacity(kept.len());
            for mut k in kept.drain(..) {
                if k.since.elapsed() < MAX_IDLE_AGE && k.worker.running() {
                    stay.push(k);
                } else {
                    go.push(k);
                }
            }
            *kept = stay;
            go
        };
        drop(ended);
    }

    /// A started process for `launch`, if one waits.
    pub(super) fn take(&self, launch: &Launch) -> Option<Started> {
        let mut idle = self.lock();
        expire(&mut idle);
        let i = idle.iter().position(|s| &s.launch == launch)?;
        Some(idle.remove(i).started)
    }

    /// Starts one spare for `launch` unless [`PER_LAUNCH`] already wait. A spare that cannot
    /// start is not an error (the next render starts its own and reports why).
    pub(super) fn refill(&self, launch: &Launch) {
        drop(self.thread()); // it ends the spares that wait too long
        {
            let mut idle = self.lock();
            expire(&mut idle);
            if idle.iter().filter(|s| &s.launch == launch).count() >= PER_LAUNCH {
                return;
            }
        }
        // Started outside the lock: renders taking spares do not wait for this fork.
        let Ok(started) = launch.start() else {
            return;
        };
        let mut idle = self.lock();
        idle.push(Spare {
            launch: launch.clone(),
            started,
            born: Instant::now(),
        });
        // Oldest first: the ones used longest ago go when there are too many.
        while idle.len() > MAX_IDLE {
            idle.remove(0);
        }
    }
}

/// Starts the spares asked for, a while after each request, and ends the ones idle too long
/// (checked every minute), until the pool is dropped.
fn refill_loop(pool: &Weak<Pool>, requests: &Receiver<Launch>) {
    loop {
        let first = match requests.recv_timeout(Duration::from_secs(60)) {
            Ok(launch) => Some(launch),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        if first.is_some() {
            std::thread::sleep(REFILL_DELAY);
        }
        let launches: Vec<Launch> = first.into_iter().chain(requests.try_iter()).collect();
        let Some(pool) = pool.upgrade() else {
            return;
        };
        let spares = Spares(pool);
        for launch in &launches {
            spares.refill(launch);
        }
        expire(&mut spares.lock());
        spares.expire_kept();
    }
}

/// Drops (ends and reaps) the spares that exited by themselves or waited too long.
fn expire(idle: &mut Vec<Spare>) {
    idle.retain_mut(|s| s.born.elapsed() < MAX_IDLE_AGE && s.started.running());
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn cat(arg: &str) -> Launch {
        Launch {
            ffmpeg: "cat".into(),
            nice: 0,
            args: vec![arg.to_string()],
            fd3: crate::media::video::Fd3::None,
        }
    }

    #[test]
    fn spares_are_kept_per_command_line_and_bounded() {
        let spares = Spares::new();
        let a = cat("-");
        for _ in 0..3 {
            spares.refill(&a);
        }
        assert_eq!(spares.idle(), PER_LAUNCH);
        assert!(spares.take(&cat("-u")).is_none());
        assert!(spares.take(&a).is_some());
        assert_eq!(spares.idle(), PER_LAUNCH - 1);
        for i in 0..2 * MAX_IDLE {
            spares.refill(&cat(&format!("/dev/null{}", "/".repeat(i))));
        }
        // `cat /dev/null` exits at once: exited spares are never handed out.
        assert!(spares.idle() <= MAX_IDLE);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            spares.idle(),
            PER_LAUNCH - 1,
            "only the waiting cat is left"
        );
    }
}
