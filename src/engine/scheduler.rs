//! The batcher shared by the model instances: a [`Batcher`] of frames behind a mutex, with a
//! condition variable that wakes instances when work arrives, per-request context (where
//! results go), and a short wait that lets a batch fill up. Each frame carries its own face
//! input, so a request may change faces from frame to frame (video avatars).
//!
//! Three classes share the batches ([`super::batcher`]): live sessions' frames first (with
//! deadlines), then interactive requests', then background (batch job) frames in what is
//! left. A batch holding live frames takes background frames only up to the size whose
//! measured cost still meets the earliest live deadline.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use super::batcher::{Batcher, Limits, Overloaded, RequestId};
use super::enhance_pool::EnhancePool;
use super::metrics as m;

/// One frame's model input.
#[derive(Debug, Clone)]
pub struct FrameWork {
    /// Frame number within its request (its submission's order).
    pub index: usize,
    /// The frame's number in the video it is drawn for: `index` for a file request, the
    /// session's frame number for a live session's frame. Only the echo stand-in looks at
    /// it (its mouth moves by it).
    pub shown: usize,
    /// The `(1, 80, 16)` mel window.
    pub mel: Vec<f32>,
    /// The 96×96 BGR face crop, shared between frames that show the same face (the instance
    /// makes the `(6, 96, 96)` model input from it when it builds the batch, so queued frames
    /// hold 27 KB each at most instead of 221 KB).
    pub face: Arc<Vec<u8>>,
    /// The enhancer to run on the predicted face, if the request asked for one.
    pub enhance: Option<super::enhance::EnhanceWith>,
    /// Where the face is restored, when `enhance` is a restorer (GFPGAN).
    pub restore: Option<super::restore::Restore>,
    /// When a live session's frame is due (set on admission by [`Scheduler::admit_realtime`];
    /// the enhancers' batches order live frames by it).
    pub due: Option<Instant>,
}

/// The class of a frame's request, ordered as batches serve them: live frames first,
/// earliest deadline first, then interactive requests', then background (batch job) frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    Live(Instant),
    Interactive,
    Background,
}

/// What the engine gives back for one frame.
#[derive(Debug, Clone, PartialEq)]
pub struct Drawn {
    /// The predicted face, 96×96×3 BGR (96·s × 96·s when an enhancer of scale s ran on it).
    pub face: Vec<u8>,
    /// With a face restorer (GFPGAN, [`super::restore`]): the avatar frame's region with the
    /// face pasted and restored in it, which is written instead of pasting `face`.
    pub restored: Option<Arc<super::restore::Patch>>,
}

impl Drawn {
    /// A face to paste.
    pub fn face(face: Vec<u8>) -> Drawn {
        Drawn {
            face,
            restored: None,
        }
    }
}

/// One frame's [`Drawn`] face, or why the model failed.
pub type FrameResult = Result<(usize, Drawn), String>;

/// A frame taken for a batch, with what the instance needs to run and answer it.
pub struct BatchItem {
    pub request: RequestId,
    pub work: FrameWork,
    pub reply: Sender<FrameResult>,
    pub class: Class,
}

struct Lane {
    reply: Sender<FrameResult>,
    admitted: Instant,
    first_taken: bool,
    /// A batch job's: its wait is not a request's queue time.
    background: bool,
}

struct State {
    batcher: Batcher<FrameWork>,
    /// Where real-time deadlines are counted from (microseconds).
    epoch: Instant,
    /// The instances' measured batch cost, once known: real-time batches wait for more
    /// frames as long as their earliest deadline allows.
    cost: Option<super::pool::BatchCost>,
    /// Model instances sharing the queue (for the queue time).
    instances: usize,
    lanes: HashMap<RequestId, Lane>,
    shutdown: bool,
    /// How long a batch of one frame has been taking, as run (a moving average): live frames
    /// that cannot be done by their deadline in that time are not run (see
    /// [`State::next_alone`]).
    one_frame: Option<Duration>,
}

thread_local! {
    /// When this thread (a model instance) was handed a batch of one frame, and by which
    /// scheduler: it comes back for the next batch once it has run it.
    static HANDED_ONE: std::cell::Cell<Option<(usize, Instant)>> =
        const { std::cell::Cell::new(None) };
}

impl State {
    /// A batch of one frame took `took` to run.
    fn ran_one(&mut self, took: Duration) {
        self.one_frame = Some(match self.one_frame {
            Some(avg) => avg.mul_f64(0.7) + took.mul_f64(0.3),
            None => took,
        });
    }

    /// The live frame to run alone (a batch of one): the one with the earliest deadline that
    /// a batch of one frame, at the time it has been taking, can still finish by it. Those
    /// before it leave the queue unrun: their sessions will hold them anyway, and running
    /// them would only make the frames behind them late too (when sessions ask for more faces
    /// than the engine draws, every frame would then miss, one after the other). Their lanes
    /// stay until their sessions drop them. A frame due by the time it was submitted (a
    /// session's idle face) wants its face as soon as possible, and is never dropped.
    fn next_alone(&mut self, now: Instant) -> Vec<(RequestId, FrameWork)> {
        let mut dropped = 0;
        let batch = loop {
            let due = self.batcher.earliest_deadline();
            let batch = self.batcher.next_batch_filled(1, usize::MAX);
            let (Some((id, _)), Some(due), Some(one)) = (batch.first(), due, self.one_frame) else {
                break batch;
            };
            let due = self.epoch + Duration::from_micros(due);
            let asap = self.lanes.get(id).is_some_and(|l| due <= l.admitted);
            if asap || due >= now + one {
                break batch;
            }
            dropped += 1;
        };
        m::dropped_frames(dropped);
        batch
    }

    /// Publishes the queue's size: frames, and per class the seconds of model work they
    /// stand for at the measured batch cost ([`super::pool::BatchCost::queue_seconds`]; 0
    /// while no cost is measured). Called whenever the queue changes.
    fn publish_queue(&self) {
        m::queue_frames(self.batcher.queued());
        let q = self.queue_seconds();
        m::queue_seconds("live", q.live);
        m::queue_seconds("interactive", q.interactive);
        m::queue_seconds("batch", q.batch);
    }

    /// Seconds of model work queued per class.
    fn queue_seconds(&self) -> QueueSeconds {
        let live = self.batcher.queued_realtime();
        let batch = self.batcher.queued_background();
        let interactive = self.batcher.queued().saturating_sub(live + batch);
        let max_batch = self.batcher.limits().max_batch;
        let seconds = |frames: usize| {
            self.cost
                .map_or(0.0, |c| c.queue_seconds(frames, max_batch, self.instances))
        };
        QueueSeconds {
            live: seconds(live),
            interactive: seconds(interactive),
            batch: seconds(batch),
        }
    }

    /// How big a batch may grow with background frames: while live frames are waiting, the
    /// largest batch whose measured cost (with the same margin as the live batches' own
    /// wait) ends before the earliest live deadline; unbounded otherwise.
    fn background_up_to(&self, now: Instant) -> usize {
        let (Some(cost), Some(due)) = (self.cost, self.batcher.earliest_deadline()) else {
            return usize::MAX;
        };
        let due = self.epoch + Duration::from_micros(due);
        let left = due
            .saturating_duration_since(now)
            .saturating_sub(Duration::from_millis(5));
        if cost.per_frame <= 0.0 {
            return usize::MAX;
        }
        let n = (left.as_secs_f64() / 1.25 - cost.fixed) / cost.per_frame;
        n.max(0.0).floor() as usize
    }
}

/// [`State::queue_seconds`]: seconds of model work queued in each class.
#[derive(Debug, Clone, Copy, PartialEq)]
struct QueueSeconds {
    live: f64,
    interactive: f64,
    batch: f64,
}

/// See the module documentation.
pub struct Scheduler {
    state: Mutex<State>,
    work: Condvar,
    fill_wait: Duration,
    /// The enhancers' instances, where enhancers are loaded: the model instances hand them
    /// the faces that asked for one, and a cancelled request's faces are dropped there too.
    enhance: OnceLock<Arc<EnhancePool>>,
}

impl Scheduler {
    /// `fill_wait`: how long a batch may wait for more frames before it runs short;
    /// `instances`: the model instances taking batches (they share the queue time).
    pub fn new(limits: Limits, fill_wait: Duration, instances: usize) -> Self {
        Scheduler {
            state: Mutex::new(State {
                batcher: Batcher::new(limits),
                epoch: Instant::now(),
                cost: None,
                instances: instances.max(1),
                lanes: HashMap::new(),
                shutdown: false,
                one_frame: None,
            }),
            work: Condvar::new(),
            fill_wait,
            enhance: OnceLock::new(),
        }
    }

    /// Connects the enhancers' instances (once, when the engine loads enhancers).
    pub fn set_enhance_pool(&self, pool: Arc<EnhancePool>) {
        let _ = self.enhance.set(pool);
    }

    /// The enhancers' instances, if enhancers are loaded.
    pub fn enhance_pool(&self) -> Option<&Arc<EnhancePool>> {
        self.enhance.get()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking holder cannot leave the batcher half-updated in a way that matters more
        // than stopping the service would.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn limits(&self) -> Limits {
        self.lock().batcher.limits()
    }

    /// Frames waiting for a model instance.
    pub fn queued(&self) -> usize {
        self.lock().batcher.queued()
    }

    /// Requests admitted and not yet finished or cancelled.
    pub fn requests(&self) -> usize {
        self.lock().lanes.len()
    }

    /// Whether request `id` was admitted and is neither finished nor cancelled. A request
    /// with a face not yet read is never finished, so for such a face `false` means its
    /// request was cancelled.
    pub fn is_open(&self, id: RequestId) -> bool {
        self.lock().lanes.contains_key(&id)
    }

    /// The measured cost of a batch (from the warm-up).
    pub fn set_batch_cost(&self, cost: super::pool::BatchCost) {
        let mut s = self.lock();
        s.cost = Some(cost);
        s.publish_queue();
    }

    /// Sets the largest batch formed while a new request waits for its first frames.
    pub fn set_fill_batch(&self, n: usize) {
        self.lock().batcher.set_fill_batch(n);
    }

    /// Admits a request's frames (all of them); results arrive, in any order, on the returned
    /// receiver.
    pub fn admit(
        &self,
        frames: Vec<FrameWork>,
    ) -> Result<(RequestId, Receiver<FrameResult>), Overloaded> {
        let (reply, results) = mpsc::channel();
        let mut s = self.lock();
        let id = s.batcher.admit(frames)?;
        self.opened(s, id, reply, false);
        Ok((id, results))
    }

    /// Admits a batch job's frames: never refused and outside the request bound, they wait
    /// and only fill what live and interactive frames leave of each batch.
    pub fn admit_background(&self, frames: Vec<FrameWork>) -> (RequestId, Receiver<FrameResult>) {
        let (reply, results) = mpsc::channel();
        let mut s = self.lock();
        let id = s.batcher.admit_background(frames);
        self.opened(s, id, reply, true);
        (id, results)
    }

    /// Registers the lane of a request just admitted (`s`: the state, still locked) and wakes
    /// the instances.
    fn opened(
        &self,
        mut s: MutexGuard<'_, State>,
        id: RequestId,
        reply: Sender<FrameResult>,
        background: bool,
    ) {
        s.lanes.insert(
            id,
            Lane {
                reply,
                admitted: Instant::now(),
                first_taken: false,
                background,
            },
        );
        s.publish_queue();
        drop(s);
        self.work.notify_all();
    }

    /// Admits a live session's frames, each with the time it must be delivered by; they are
    /// served before file requests, earliest deadline first, and never refused.
    pub fn admit_realtime(
        &self,
        frames: Vec<(FrameWork, Instant)>,
    ) -> (RequestId, Receiver<FrameResult>) {
        let (reply, results) = mpsc::channel();
        let mut s = self.lock();
        let epoch = s.epoch;
        let id = s
            .batcher
            .admit_realtime(frames.into_iter().map(|(mut f, due)| {
                f.due = Some(due);
                let us = due.saturating_duration_since(epoch).as_micros();
                (f, u64::try_from(us).unwrap_or(u64::MAX))
            }));
        self.opened(s, id, reply, false);
        (id, results)
    }

    /// Blocks until a batch can be formed (waiting up to the fill time for it to grow to a full
    /// batch); `None` after [`Scheduler::shutdown`].
    pub fn next_batch(&self) -> Option<Vec<BatchItem>> {
        self.next_batch_within(usize::MAX)
    }

    /// [`Scheduler::next_batch`] with at most `limit` frames.
    pub fn next_batch_within(&self, limit: usize) -> Option<Vec<BatchItem>> {
        loop {
            // Another instance may have taken the frames this one waited for.
            match self.try_batch_within(limit) {
                Some(batch) if batch.is_empty() => continue,
                other => return other,
            }
        }
    }

    fn try_batch_within(&self, limit: usize) -> Option<Vec<BatchItem>> {
        let mut s = self.lock();
        let me = self as *const Scheduler as usize;
        if let Some((_, handed)) = HANDED_ONE.take().filter(|(by, _)| *by == me) {
            s.ran_one(handed.elapsed());
        }
        loop {
            if s.shutdown {
                return None;
            }
            if s.batcher.has_work() {
                break;
            }
            s = self.work.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        // Let the batch fill: more frames may arrive within the fill time.
        let deadline = Instant::now() + self.fill_wait;
        let full = |s: &State| s.batcher.ready_items() >= s.batcher.batch_cap().min(limit);
        while !full(&s) && !s.shutdown {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = self
                .work
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        // Only real-time frames waiting: let the batch grow until its earliest deadline
        // leaves just the time to run it (a bigger batch costs less per frame), so many
        // sessions share batches instead of each frame running nearly alone. Where a batch's
        // fixed cost is below one frame's (a CPU), waiting saves nothing and only spends the
        // margin that absorbs a slower batch: run at once.
        while !s.shutdown && !full(&s) && s.batcher.realtime_only() {
            let (Some(cost), Some(due)) = (s.cost, s.batcher.earliest_deadline()) else {
                break;
            };
            if cost.fixed < cost.per_frame {
                break;
            }
            let n = s.batcher.ready_items().max(1) as f64;
            let run = Duration::from_secs_f64((cost.fixed + cost.per_frame * n) * 1.25);
            let due = s.epoch + Duration::from_micros(due);
            let start_by = due.checked_sub(run + Duration::from_millis(5));
            let Some(left) = start_by.and_then(|t| t.checked_duration_since(Instant::now())) else {
                break;
            };
            s = self
                .work
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        // Only real-time frames, where a batch's fixed cost is below one frame's (a CPU): each
        // frame runs alone, earliest deadline first, and those that cannot be in time any
        // more are not run. A batch's faces all come when the whole batch is done, so a batch
        // of n holds its earliest frame back by n − 1 frames' time: when the sessions ask for
        // more faces than the engine draws, the queue grows and the frames of such batches
        // miss together.
        let now = Instant::now();
        let alone = matches!(s.cost, Some(c) if c.fixed < c.per_frame);
        let batch = if alone && s.batcher.realtime_only() {
            s.next_alone(now)
        } else {
            let background_up_to = s.background_up_to(now);
            s.batcher.next_batch_filled(limit, background_up_to)
        };
        let mut items = Vec::with_capacity(batch.len());
        for (request, work) in batch {
            let Some(lane) = s.lanes.get_mut(&request) else {
                continue;
            };
            if !lane.first_taken {
                lane.first_taken = true;
                if !lane.background {
                    m::stage("queue", now - lane.admitted);
                }
            }
            let class = match (work.due, lane.background) {
                (Some(due), _) => Class::Live(due),
                (None, false) => Class::Interactive,
                (None, true) => Class::Background,
            };
            items.push(BatchItem {
                request,
                work,
                reply: lane.reply.clone(),
                class,
            });
        }
        s.publish_queue();
        if items.len() == 1 {
            HANDED_ONE.set(Some((me, Instant::now())));
        }
        Some(items)
    }

    /// The consumer has used `n` frames of `id` (they stop counting against its run-ahead).
    /// Instances are woken only when that lets the request offer more frames: a compositor
    /// acknowledges every frame, and waking every waiting instance for each (to find nothing
    /// new) cost a 40 s request thousands of thread wake-ups.
    pub fn ack(&self, id: RequestId, n: usize) {
        let more = self.lock().batcher.ack(id, n);
        if more {
            self.work.notify_all();
        }
    }

    /// Drops the request's queued frames (its client went away); returns how many.
    pub fn cancel(&self, id: RequestId) -> usize {
        let mut s = self.lock();
        s.lanes.remove(&id);
        let mut dropped = s.batcher.cancel(id);
        s.publish_queue();
        drop(s);
        if let Some(pool) = self.enhance.get() {
            dropped += pool.cancel(id);
        }
        m::dropped_frames(dropped);
        dropped
    }

    /// Forgets a finished request.
    pub fn finish(&self, id: RequestId) {
        let mut s = self.lock();
        s.lanes.remove(&id);
        s.batcher.finish(id);
        s.publish_queue();
    }

    /// Wakes every instance and makes [`Scheduler::next_batch`] return `None`.
    pub fn shutdown(&self) {
        self.lock().shutdown = true;
        self.work.notify_all();
        if let Some(pool) = self.enhance.get() {
            pool.shutdown();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(n: usize) -> Vec<FrameWork> {
        let face = Arc::new(vec![0u8; 1]);
        (0..n)
            .map(|index| FrameWork {
                index,
                shown: index,
                mel: vec![0.0; 4],
                face: face.clone(),
                enhance: None,
                restore: None,
                due: None,
            })
            .collect()
    }

    fn limits() -> Limits {
        Limits {
            max_batch: 8,
            first_batch: 2,
            fill_batch: 2,
            max_queue: 100,
            max_ahead: 100,
        }
    }

    #[test]
    fn a_batch_waits_briefly_to_fill_then_runs() {
        let s = Arc::new(Scheduler::new(limits(), Duration::from_millis(300), 1));
        let (a, _ra) = s.admit(frames(1)).unwrap();
        // The first batch is capped at first_batch (2): it waits for a second frame...
        let s2 = s.clone();
        let waiter = std::thread::spawn(move || s2.next_batch().unwrap());
        std::thread::sleep(Duration::from_millis(50));
        let (b, _rb) = s.admit(frames(1)).unwrap();
        let batch = waiter.join().unwrap();
        let reqs: Vec<RequestId> = batch.iter().map(|i| i.request).collect();
        assert_eq!(reqs, vec![a, b]);
    }

    #[test]
    fn shutdown_releases_waiting_instances() {
        let s = Arc::new(Scheduler::new(limits(), Duration::from_millis(10), 1));
        let s2 = s.clone();
        let waiter = std::thread::spawn(move || s2.next_batch().is_none());
        std::thread::sleep(Duration::from_millis(30));
        s.shutdown();
        assert!(waiter.join().unwrap());
    }

    #[test]
    fn a_request_is_open_until_it_is_cancelled_or_finished() {
        let s = Scheduler::new(limits(), Duration::ZERO, 1);
        let (a, _ra) = s.admit(frames(2)).unwrap();
        let (b, _rb) = s.admit(frames(2)).unwrap();
        assert!(s.is_open(a) && s.is_open(b));
        s.cancel(a);
        assert!(!s.is_open(a) && s.is_open(b));
        s.finish(b);
        assert!(!s.is_open(b));
        assert!(!s.is_open(RequestId(999)));
    }

    #[test]
    fn cancelled_requests_lose_their_queued_frames() {
        let s = Scheduler::new(limits(), Duration::ZERO, 1);
        let (a, ra) = s.admit(frames(10)).unwrap();
        let batch = s.next_batch().unwrap();
        assert_eq!(batch.len(), 2);
        assert_eq!(s.cancel(a), 8);
        assert_eq!(s.queued(), 0);
        // Replies for frames already taken go nowhere once the receiver is gone.
        drop(ra);
        assert!(batch[0].reply.send(Ok((0, Drawn::face(vec![])))).is_err());
    }

    #[test]
    fn queue_time_counts_each_class_at_the_measured_cost() {
        let s = Scheduler::new(limits(), Duration::ZERO, 2);
        let (_a, _ra) = s.admit(frames(10)).unwrap();
        // No cost measured yet: no time.
        let zero = QueueSeconds {
            live: 0.0,
            interactive: 0.0,
            batch: 0.0,
        };
        assert_eq!(s.lock().queue_seconds(), zero);
        let cost = crate::engine::pool::BatchCost {
            fixed: 0.01,
            per_frame: 0.001,
        };
        s.set_batch_cost(cost);
        // 10 frames at batches of 8: 2 batches, over 2 instances.
        let want = (10.0 * 0.001 + 2.0 * 0.01) / 2.0;
        let q = s.lock().queue_seconds();
        assert_eq!((q.live, q.batch), (0.0, 0.0));
        assert!((q.interactive - want).abs() < 1e-12);
        let due = Instant::now() + Duration::from_secs(10);
        let (_b, _rb) = s.admit_realtime(frames(3).into_iter().map(|f| (f, due)).collect());
        let (_c, _rc) = s.admit_background(frames(20));
        let q = s.lock().queue_seconds();
        assert!((q.live - cost.queue_seconds(3, 8, 2)).abs() < 1e-12);
        assert!((q.interactive - want).abs() < 1e-12);
        // The same formula for batch jobs' frames: 20 frames, 3 batches, 2 instances.
        assert!((q.batch - (20.0 * 0.001 + 3.0 * 0.01) / 2.0).abs() < 1e-12);
        // Live frames go first; everything taken leaves nothing queued.
        while s.queued() > 0 {
            s.next_batch().unwrap();
        }
        assert_eq!(s.lock().queue_seconds(), zero);
    }

    #[test]
    fn real_time_batches_grow_while_their_deadline_allows() {
        let s = Arc::new(Scheduler::new(limits(), Duration::ZERO, 1));
        s.set_batch_cost(crate::engine::pool::BatchCost {
            fixed: 0.01,
            per_frame: 0.001,
        });
        let face = Arc::new(vec![0u8; 1]);
        let frame = |index| FrameWork {
            index,
            shown: index,
            mel: vec![],
            face: face.clone(),
            enhance: None,
            restore: None,
            due: None,
        };
        let due = Instant::now() + Duration::from_millis(400);
        let (_a, _ra) = s.admit_realtime(vec![(frame(0), due)]);
        let s2 = s.clone();
        let t = Instant::now();
        let waiter = std::thread::spawn(move || s2.next_batch().unwrap().len());
        std::thread::sleep(Duration::from_millis(100));
        let (_b, _rb) = s.admit_realtime(vec![(frame(0), due)]);
        // Both frames in one batch, taken before the deadline leaves only the run time.
        assert_eq!(waiter.join().unwrap(), 2);
        assert!(t.elapsed() < Duration::from_millis(400));
        // A frame already at its deadline runs at once.
        let (_c, _rc) = s.admit_realtime(vec![(frame(0), Instant::now())]);
        let t = Instant::now();
        assert_eq!(s.next_batch().unwrap().len(), 1);
        assert!(t.elapsed() < Duration::from_millis(50));
    }

    #[test]
    fn on_a_cpu_live_frames_run_alone_and_those_that_cannot_be_in_time_do_not_run() {
        let s = Scheduler::new(limits(), Duration::ZERO, 1);
        // All of a batch's cost is per frame (a CPU): batching saves nothing.
        s.set_batch_cost(crate::engine::pool::BatchCost {
            fixed: 0.0,
            per_frame: 0.05,
        });
        let live =
            |due: Instant| s.admit_realtime(frames(1).into_iter().map(|f| (f, due)).collect());
        let ids = |b: Vec<BatchItem>| b.iter().map(|i| i.request).collect::<Vec<_>>();
        let t0 = Instant::now();
        let (a, _ra) = live(t0 + Duration::from_secs(5));
        let (b, _rb) = live(t0 + Duration::from_secs(3));
        let (c, _rc) = live(t0 + Duration::from_secs(8));
        // One frame at a time, earliest deadline first (nothing dropped before a batch of one
        // has been timed).
        assert_eq!(ids(s.next_batch().unwrap()), vec![b]);
        // That frame takes this instance (this thread) 300 ms to run.
        std::thread::sleep(Duration::from_millis(300));
        // A frame due in 100 ms cannot be done in time, one wanted as soon as possible (due
        // when submitted: an idle face) always runs, and goes first.
        let (d, _rd) = live(Instant::now() + Duration::from_millis(100));
        let (e, _re) = live(Instant::now());
        assert_eq!(ids(s.next_batch().unwrap()), vec![e]);
        // d is not run (its session will hold it): a comes next, then c.
        assert_eq!(ids(s.next_batch().unwrap()), vec![a]);
        assert_eq!(ids(s.next_batch().unwrap()), vec![c]);
        assert_eq!(s.queued(), 0);
        // d's lane stays until its session drops it.
        assert_eq!(s.requests(), 5);
        s.cancel(d);
        assert_eq!(s.requests(), 4);
    }

    #[test]
    fn background_frames_fill_behind_interactive_ones_and_leave_with_their_request() {
        let s = Scheduler::new(limits(), Duration::ZERO, 1);
        let (job, _rj) = s.admit_background(frames(50));
        // Never refused, even beyond the queue bound (100 frames).
        let (other, _ro) = s.admit_background(frames(500));
        let (req, _rr) = s.admit(frames(10)).unwrap();
        // The interactive request's first frames come first (here they fill the first
        // batch's cap, 2), then its other frames, then background frames.
        let batch: Vec<RequestId> = s.next_batch().unwrap().iter().map(|i| i.request).collect();
        assert_eq!(batch, vec![req, req]);
        let batch: Vec<RequestId> = s.next_batch().unwrap().iter().map(|i| i.request).collect();
        assert_eq!(batch, vec![req; 8]);
        let batch: Vec<RequestId> = s.next_batch().unwrap().iter().map(|i| i.request).collect();
        assert_eq!(batch, vec![job; 8]);
        // A cancelled batch job's queued frames are dropped.
        assert_eq!(s.cancel(job), 42);
        assert_eq!(s.queued(), 500);
        s.cancel(other);
        assert_eq!(s.queued(), 0);
        assert_eq!(s.requests(), 1);
    }

    #[test]
    fn background_fill_keeps_a_live_batch_within_its_deadline() {
        let s = Scheduler::new(limits(), Duration::ZERO, 1);
        // 10 ms a batch plus 20 ms a frame.
        s.set_batch_cost(crate::engine::pool::BatchCost {
            fixed: 0.010,
            per_frame: 0.020,
        });
        let (job, _rj) = s.admit_background(frames(100));
        // A live frame due in 200 ms: (200 - 5) / 1.25 = 156 ms holds a batch of 7 frames
        // (fewer if this thread is slow to get there), not a full one (8).
        let due = Instant::now() + Duration::from_millis(200);
        let (live, _rl) = s.admit_realtime(frames(1).into_iter().map(|f| (f, due)).collect());
        let batch: Vec<RequestId> = s.next_batch().unwrap().iter().map(|i| i.request).collect();
        assert_eq!(batch[0], live);
        assert!(batch[1..].iter().all(|r| *r == job), "{batch:?}");
        assert!((4..=7).contains(&batch.len()), "{batch:?}");
        // Without live frames, background batches are full.
        assert_eq!(s.next_batch().unwrap().len(), 8);
    }
}
