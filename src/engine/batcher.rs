//! Fair, bounded batching of work items across requests, as a plain data structure: no
//! threads, no model, no clock. [`super::scheduler`] wraps it for the model instances.
//!
//! - A request is admitted with all its items (a video's frames) at once. The admission bound
//!   counts the work that is *runnable now*: each request counts at most its look-ahead
//!   (`max_ahead`) of queued items, since it can never have more than that in flight. A
//!   request that would push that load over `max_queue` is refused up front (so the service
//!   can answer 429), unless nothing is queued. A long request therefore occupies one
//!   look-ahead of the bound, never all of it, and short requests keep being admitted beside
//!   it.
//! - Batches take items round-robin across requests, so a long clip never starves others.
//! - A request that has not had a batch yet goes first: the next batch takes up to
//!   `first_batch` of its items, so its output can start streaming early. The rest of that
//!   batch is filled from running requests up to `fill_batch` (the largest batch the
//!   instances compute within the latency target), so batches stay full under steady
//!   arrivals instead of collapsing to `first_batch`.
//! - Each request may have at most `max_ahead` items taken but not yet acknowledged by its
//!   consumer: a slow reader stops getting work instead of piling results up.
//! - Cancelling a request drops its queued items (and says how many).
//! - Real-time requests (live sessions) carry a deadline per item, in any monotonic unit the
//!   caller picks. They are admitted outside the queue bound (sessions have their own
//!   admission) and served first, earliest deadline first; other requests fill what is left.
//! - Background requests (batch jobs) come last: their items only fill what is left of a
//!   batch after real-time and interactive items, so an interactive request that arrives
//!   while background work is queued waits at most for the batches already taken. They are
//!   never refused and count neither against `max_queue` nor as new requests: they wait. The
//!   caller bounds them (each holds all its planned items, as an interactive request does).
//!   Among themselves they are served oldest first, so the oldest job finishes soonest
//!   instead of every job crawling; each still takes at most `max_ahead` unacknowledged
//!   items, and the next one takes the rest.

use std::collections::VecDeque;

/// Identifies an admitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// The batcher's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_batch: usize,
    /// Items of a new request in its first batch.
    pub first_batch: usize,
    /// Largest batch while a new request waits for its first one (at least `first_batch`).
    pub fill_batch: usize,
    /// Runnable items across all requests: each request counts at most `max_ahead` queued.
    pub max_queue: usize,
    /// Items per request taken but not acknowledged.
    pub max_ahead: usize,
}

/// A request refused because the queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overloaded {
    /// Runnable items (the admission load) when refused.
    pub queued: usize,
}

#[derive(Debug)]
struct Lane<T> {
    id: RequestId,
    items: VecDeque<T>,
    /// Taken but not acknowledged.
    outstanding: usize,
    /// Has had at least one batch.
    started: bool,
    /// Real-time requests: each queued item's deadline, front first (empty otherwise).
    deadlines: VecDeque<u64>,
    realtime: bool,
    background: bool,
}

impl<T> Lane<T> {
    fn eligible(&self, max_ahead: usize) -> bool {
        !self.items.is_empty() && self.outstanding < max_ahead
    }

    fn take(&mut self) -> Option<T> {
        let item = self.items.pop_front()?;
        self.deadlines.pop_front();
        self.outstanding += 1;
        Some(item)
    }
}

/// See the module documentation.
#[derive(Debug)]
pub struct Batcher<T> {
    limits: Limits,
    lanes: Vec<Lane<T>>,
    /// Lane index where the next round-robin pass starts.
    cursor: usize,
    queued: usize,
    next_id: u64,
}

impl<T> Batcher<T> {
    pub fn new(limits: Limits) -> Self {
        let max_batch = limits.max_batch.max(1);
        let first_batch = limits.first_batch.clamp(1, max_batch);
        let limits = Limits {
            max_batch,
            first_batch,
            fill_batch: limits.fill_batch.clamp(first_batch, max_batch),
            max_queue: limits.max_queue,
            max_ahead: limits.max_ahead.max(1),
        };
        Batcher {
            limits,
            lanes: Vec::new(),
            cursor: 0,
            queued: 0,
            next_id: 1,
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Sets the largest batch formed while a new request waits (clamped to
    /// `first_batch..=max_batch`).
    pub fn set_fill_batch(&mut self, n: usize) {
        self.limits.fill_batch = n.clamp(self.limits.first_batch, self.limits.max_batch);
    }

    /// The admission load: queued items runnable now, each request counting at most its
    /// look-ahead.
    pub fn load(&self) -> usize {
        self.lanes
            .iter()
            .filter(|l| !l.realtime && !l.background)
            .map(|l| l.items.len().min(self.limits.max_ahead))
            .sum()
    }

    /// Items queued across all requests.
    pub fn queued(&self) -> usize {
        self.queued
    }

    /// Items of real-time requests queued (the rest of [`Batcher::queued`] is other
    /// requests').
    pub fn queued_realtime(&self) -> usize {
        self.lanes
            .iter()
            .filter(|l| l.realtime)
            .map(|l| l.items.len())
            .sum()
    }

    /// Items of background requests queued.
    pub fn queued_background(&self) -> usize {
        self.lanes
            .iter()
            .filter(|l| l.background)
            .map(|l| l.items.len())
            .sum()
    }

    /// Requests admitted and not yet finished.
    pub fn requests(&self) -> usize {
        self.lanes.len()
    }

    /// Admits a request with all its items, or refuses it when the admission load would
    /// exceed its bound (anything is admitted when nothing is queued).
    pub fn admit(&mut self, items: impl IntoIterator<Item = T>) -> Result<RequestId, Overloaded> {
        let items: VecDeque<T> = items.into_iter().collect();
        let load = self.load();
        if load > 0 && load + items.len().min(self.limits.max_ahead) > self.limits.max_queue {
            return Err(Overloaded { queued: load });
        }
        Ok(self.push_lane(items, None, false))
    }

    /// Admits a real-time request: `(item, deadline)` pairs in the order they are to be
    /// delivered. Never refused (the caller bounds its sessions); served before any other
    /// request, earliest deadline first.
    pub fn admit_realtime(&mut self, items: impl IntoIterator<Item = (T, u64)>) -> RequestId {
        let (items, deadlines): (VecDeque<T>, VecDeque<u64>) = items.into_iter().unzip();
        self.push_lane(items, Some(deadlines), false)
    }

    /// Admits a background request: never refused, outside the queue bound; its items only
    /// fill what real-time and interactive items leave of a batch.
    pub fn admit_background(&mut self, items: impl IntoIterator<Item = T>) -> RequestId {
        self.push_lane(items.into_iter().collect(), None, true)
    }

    /// A new lane (real-time when it has deadlines) under a new id.
    fn push_lane(
        &mut self,
        items: VecDeque<T>,
        deadlines: Option<VecDeque<u64>>,
        background: bool,
    ) -> RequestId {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        self.queued += items.len();
        let realtime = deadlines.is_some();
        self.lanes.push(Lane {
            id,
            items,
            outstanding: 0,
            // A real-time lane's deadlines, not the first-batch rule, decide when it runs; a
            // background lane never hurries.
            started: realtime || background,
            deadlines: deadlines.unwrap_or_default(),
            realtime,
            background,
        });
        id
    }

    /// Whether every item that could be taken now is a real-time one.
    pub fn realtime_only(&self) -> bool {
        let ahead = self.limits.max_ahead;
        self.lanes
            .iter()
            .filter(|l| l.eligible(ahead))
            .all(|l| l.realtime)
    }

    /// The earliest deadline of a real-time item that could be taken now.
    pub fn earliest_deadline(&self) -> Option<u64> {
        let ahead = self.limits.max_ahead;
        self.lanes
            .iter()
            .filter(|l| l.realtime && l.eligible(ahead))
            .filter_map(|l| l.deadlines.front().copied())
            .min()
    }

    /// Whether a batch could be formed now.
    pub fn has_work(&self) -> bool {
        self.lanes.iter().any(|l| l.eligible(self.limits.max_ahead))
    }

    /// Whether a request that has not had a batch yet is waiting.
    fn fresh_waiting(&self) -> bool {
        let ahead = self.limits.max_ahead;
        self.lanes.iter().any(|l| !l.started && l.eligible(ahead))
    }

    /// The size limit of a batch formed now: `fill_batch` while a request that has not had a
    /// batch is waiting (so its first frames come within the latency target), else
    /// `max_batch`.
    pub fn batch_cap(&self) -> usize {
        if self.fresh_waiting() {
            self.limits.fill_batch
        } else {
            self.limits.max_batch
        }
    }

    /// Items a batch formed now would hold (without forming it).
    pub fn ready_items(&self) -> usize {
        let ahead = self.limits.max_ahead;
        let fresh = self.fresh_waiting();
        let cap = self.batch_cap();
        self.lanes
            .iter()
            .map(|l| {
                let n = l.items.len().min(ahead.saturating_sub(l.outstanding));
                if fresh && !l.started {
                    n.min(self.limits.first_batch)
                } else {
                    n
                }
            })
            .sum::<usize>()
            .min(cap)
    }

    /// The next batch (empty when no request has eligible work).
    pub fn next_batch(&mut self) -> Vec<(RequestId, T)> {
        self.next_batch_within(usize::MAX)
    }

    /// The next batch, at most `limit` items (an instance that ran out of memory asks for
    /// less than the configured maximum).
    pub fn next_batch_within(&mut self, limit: usize) -> Vec<(RequestId, T)> {
        self.next_batch_filled(limit, usize::MAX)
    }

    /// The next batch, at most `limit` items, of which background items only fill it up to
    /// `background_up_to` items (so a batch holding real-time items stays small enough to
    /// meet their deadline).
    pub fn next_batch_filled(
        &mut self,
        limit: usize,
        background_up_to: usize,
    ) -> Vec<(RequestId, T)> {
        let ahead = self.limits.max_ahead;
        let fresh = self.fresh_waiting();
        let cap = self.batch_cap().min(limit.max(1));
        let mut batch = Vec::with_capacity(cap);
        let n = self.lanes.len();
        // Real-time items first, earliest deadline first.
        while batch.len() < cap {
            let next = self
                .lanes
                .iter()
                .enumerate()
                .filter(|(_, l)| l.realtime && l.eligible(ahead))
                .min_by_key(|(_, l)| l.deadlines.front().copied().unwrap_or(u64::MAX))
                .map(|(i, _)| i);
            let Some(i) = next else { break };
            let lane = &mut self.lanes[i];
            let item = lane.take().expect("eligible lane has items");
            batch.push((lane.id, item));
        }
        // New requests first: up to `first_batch` items each, round-robin one at a time.
        if fresh {
            let first = self.limits.first_batch;
            let mut taken = vec![0usize; n];
            let mut idle_in_a_row = 0;
            let mut i = self.cursor % n.max(1);
            while batch.len() < cap && idle_in_a_row < n {
                let lane = &mut self.lanes[i];
                if !lane.started && taken[i] < first && lane.eligible(ahead) {
                    let item = lane.items.pop_front().expect("eligible lane has items");
                    lane.outstanding += 1;
                    taken[i] += 1;
                    batch.push((lane.id, item));
                    idle_in_a_row = 0;
                } else {
                    idle_in_a_row += 1;
                }
                i = (i + 1) % n;
            }
        }
        // Then running requests fill the rest (or, with no new request waiting, everyone),
        // round-robin one item at a time starting after the lane served first last time.
        let mut idle_in_a_row = 0;
        let mut i = self.cursor % n.max(1);
        while batch.len() < cap && idle_in_a_row < n {
            let lane = &mut self.lanes[i];
            let interactive = !lane.realtime && !lane.background;
            if interactive && (lane.started || !fresh) && lane.eligible(ahead) {
                let item = lane.take().expect("eligible lane has items");
                batch.push((lane.id, item));
                idle_in_a_row = 0;
            } else {
                idle_in_a_row += 1;
            }
            i = (i + 1) % n;
        }
        // Background requests fill what is left, oldest first.
        let cap = cap.min(background_up_to);
        for lane in self.lanes.iter_mut().filter(|l| l.background) {
            while batch.len() < cap && lane.eligible(ahead) {
                let item = lane.take().expect("eligible lane has items");
                batch.push((lane.id, item));
            }
        }
        for (id, _) in &batch {
            if let Some(l) = self.lanes.iter_mut().find(|l| l.id == *id) {
                l.started = true;
            }
        }
        if !self.lanes.is_empty() {
            self.cursor = (self.cursor + 1) % self.lanes.len();
        }
        self.queued -= batch.len();
        batch
    }

    /// The consumer is done with `n` items of `id`: they no longer count against its
    /// run-ahead allowance.
    ///
    /// Returns whether that lets the request offer more items than before (it has items
    /// queued beyond its look-ahead's room): only then can a waiting batch grow from it.
    pub fn ack(&mut self, id: RequestId, n: usize) -> bool {
        let ahead = self.limits.max_ahead;
        let Some(l) = self.lanes.iter_mut().find(|l| l.id == id) else {
            return false;
        };
        let held_back = l.items.len() > ahead.saturating_sub(l.outstanding);
        l.outstanding = l.outstanding.saturating_sub(n);
        held_back && n > 0
    }

    /// Drops the request's queued items and the request; returns how many items were dropped.
    pub fn cancel(&mut self, id: RequestId) -> usize {
        let Some(pos) = self.lanes.iter().position(|l| l.id == id) else {
            return 0;
        };
        let lane = self.lanes.remove(pos);
        if pos < self.cursor {
            self.cursor -= 1;
        }
        self.queued -= lane.items.len();
        lane.items.len()
    }

    /// Forgets a request whose items have all been taken (same as [`Batcher::cancel`] with
    /// nothing left to drop).
    pub fn finish(&mut self, id: RequestId) {
        self.cancel(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_batch: usize, first_batch: usize, max_queue: usize, max_ahead: usize) -> Limits {
        Limits {
            max_batch,
            first_batch,
            fill_batch: first_batch,
            max_queue,
            max_ahead,
        }
    }

    fn ids(batch: &[(RequestId, u32)]) -> Vec<u64> {
        batch.iter().map(|(r, _)| r.0).collect()
    }

    #[test]
    fn a_single_request_is_served_in_order_in_full_batches_after_a_small_first_one() {
        let mut b = Batcher::new(limits(4, 2, 100, 100));
        let r = b.admit(0..9u32).unwrap();
        let first = b.next_batch();
        assert_eq!(first, vec![(r, 0), (r, 1)]);
        let items: Vec<u32> = b.next_batch().into_iter().map(|(_, i)| i).collect();
        assert_eq!(items, vec![2, 3, 4, 5]);
        let items: Vec<u32> = b.next_batch().into_iter().map(|(_, i)| i).collect();
        assert_eq!(items, vec![6, 7, 8]);
        assert!(b.next_batch().is_empty());
        assert_eq!(b.queued(), 0);
    }

    #[test]
    fn frames_are_taken_round_robin_across_requests() {
        let mut b = Batcher::new(limits(6, 6, 100, 100));
        let a = b.admit(0..10u32).unwrap();
        let c = b.admit(100..110u32).unwrap();
        let batch = b.next_batch();
        assert_eq!(ids(&batch), vec![a.0, c.0, a.0, c.0, a.0, c.0]);
        // Per request, items stay in order.
        let of_c: Vec<u32> = batch
            .iter()
            .filter(|(r, _)| *r == c)
            .map(|(_, i)| *i)
            .collect();
        assert_eq!(of_c, vec![100, 101, 102]);
    }

    #[test]
    fn a_long_clip_never_starves_a_new_requests_first_batch() {
        let mut b = Batcher::new(limits(8, 2, 10_000, 10_000));
        let long = b.admit(0..5000u32).unwrap();
        b.next_batch();
        b.next_batch();
        let new = b.admit(0..50u32).unwrap();
        // The very next batch is the new request's first one, small, and it comes first.
        let batch = b.next_batch();
        assert_eq!(ids(&batch), vec![new.0, new.0]);
        // Then both share.
        let batch = b.next_batch();
        assert!(batch.iter().any(|(r, _)| *r == long) && batch.iter().any(|(r, _)| *r == new));
        assert_eq!(batch.len(), 8);
    }

    #[test]
    fn the_queue_bound_counts_frames_and_refuses_up_front() {
        let mut b = Batcher::new(limits(4, 4, 10, 100));
        b.admit(0..6u32).unwrap();
        assert_eq!(b.admit(0..5u32), Err(Overloaded { queued: 6 }));
        assert!(b.admit(0..4u32).is_ok());
        assert_eq!(b.queued(), 10);
        // A request bigger than the bound still runs alone.
        let mut b = Batcher::new(limits(4, 4, 10, 100));
        assert!(b.admit(0..50u32).is_ok());
    }

    #[test]
    fn a_slow_consumer_stops_getting_work_until_it_catches_up() {
        let mut b = Batcher::new(limits(4, 4, 100, 5));
        let r = b.admit(0..20u32).unwrap();
        assert_eq!(b.next_batch().len(), 4);
        assert_eq!(b.next_batch().len(), 1); // 5 outstanding: the allowance is used up
        assert!(b.next_batch().is_empty());
        assert!(!b.has_work());
        assert!(
            b.ack(r, 3),
            "frames held back by the look-ahead are offered again"
        );
        assert!(b.has_work());
        assert_eq!(b.ready_items(), 3);
        assert_eq!(b.next_batch().len(), 3);
    }

    #[test]
    fn an_ack_says_whether_it_lets_the_request_offer_more() {
        let mut b = Batcher::new(limits(4, 4, 100, 6));
        let r = b.admit(0..8u32).unwrap();
        assert_eq!(b.next_batch().len(), 4); // 4 queued, room for 2 more
        assert_eq!(b.ready_items(), 2);
        assert!(b.ack(r, 1), "2 of its 4 queued items were held back");
        assert_eq!(b.ready_items(), 3);
        assert_eq!(b.next_batch().len(), 3); // 1 queued, 6 outstanding
        assert!(b.ack(r, 1), "its last item waited for room");
        assert_eq!(b.next_batch().len(), 1); // nothing queued
        assert!(!b.ack(r, 4), "nothing left to offer");
        assert!(!b.ack(RequestId(999), 1), "an unknown request");
        // Room to spare: its queued item is offered already; an ack changes nothing.
        let r = b.admit(0..5u32).unwrap();
        assert_eq!(b.next_batch().len(), 4); // 1 queued, 4 outstanding, room for 2
        assert_eq!(b.ready_items(), 1);
        assert!(!b.ack(r, 1));
        assert_eq!(b.ready_items(), 1);
    }

    #[test]
    fn a_stalled_request_does_not_block_others() {
        let mut b = Batcher::new(limits(4, 4, 100, 2));
        let slow = b.admit(0..10u32).unwrap();
        let fast = b.admit(0..10u32).unwrap();
        b.next_batch(); // 2 + 2
        b.ack(fast, 2);
        let batch = b.next_batch();
        assert_eq!(ids(&batch), vec![fast.0, fast.0]);
        assert!(!batch.iter().any(|(r, _)| *r == slow));
    }

    #[test]
    fn cancelling_drops_queued_work() {
        let mut b = Batcher::new(limits(4, 4, 100, 100));
        let gone = b.admit(0..10u32).unwrap();
        let stays = b.admit(0..3u32).unwrap();
        b.next_batch();
        assert_eq!(b.cancel(gone), 8);
        assert_eq!(b.queued(), 1);
        assert_eq!(ids(&b.next_batch()), vec![stays.0]);
        assert_eq!(b.cancel(gone), 0);
        b.finish(stays);
        assert_eq!(b.requests(), 0);
        assert!(b.next_batch().is_empty());
    }

    #[test]
    fn an_instance_can_ask_for_smaller_batches() {
        let mut b = Batcher::new(limits(8, 8, 100, 100));
        b.admit(0..20u32).unwrap();
        assert_eq!(b.next_batch_within(3).len(), 3);
        assert_eq!(b.next_batch_within(0).len(), 1);
        assert_eq!(b.next_batch().len(), 8);
    }

    #[test]
    fn a_long_request_counts_only_its_look_ahead_against_admission() {
        let mut b = Batcher::new(limits(4, 4, 10, 4));
        let long = b.admit(0..10_000u32).unwrap();
        assert_eq!(b.load(), 4);
        // Short requests are admitted beside it...
        let short = b.admit(0..5u32).unwrap();
        assert_eq!(b.load(), 8);
        // ...until the runnable work reaches the bound.
        assert_eq!(b.admit(0..3u32), Err(Overloaded { queued: 8 }));
        // Serving the short one makes room again; the long one still counts 4.
        for _ in 0..4 {
            let batch = b.next_batch();
            for (r, _) in &batch {
                b.ack(*r, 1);
            }
        }
        b.finish(short);
        assert!(b.load() <= 4);
        assert!(b.admit(0..3u32).is_ok());
        assert!(b.queued() > 9_000);
        b.cancel(long);
    }

    #[test]
    fn a_new_request_gets_its_first_frames_and_running_ones_fill_the_batch() {
        let mut l = limits(8, 2, 10_000, 10_000);
        l.fill_batch = 8;
        let mut b = Batcher::new(l);
        let long = b.admit(0..5000u32).unwrap();
        // Alone, a new request's first batch is small (its video starts early)...
        assert_eq!(b.next_batch().len(), 2);
        assert_eq!(b.next_batch().len(), 8);
        let new = b.admit(0..50u32).unwrap();
        let batch = b.next_batch();
        assert_eq!(batch.len(), 8);
        // The new request's first two frames lead the batch; the long one fills the rest.
        assert_eq!(&ids(&batch)[..2], &[new.0, new.0]);
        assert_eq!(batch.iter().filter(|(r, _)| *r == long).count(), 6);
        // Without a fill allowance the batch collapses to the first batch.
        let mut b = Batcher::new(limits(8, 2, 10_000, 10_000));
        b.admit(0..5000u32).unwrap();
        b.next_batch();
        b.admit(0..50u32).unwrap();
        assert_eq!(b.next_batch().len(), 2);
    }

    #[test]
    fn each_new_request_gets_its_first_batch_in_the_same_batch() {
        let mut l = limits(16, 2, 10_000, 10_000);
        l.fill_batch = 16;
        let mut b = Batcher::new(l);
        let r: Vec<RequestId> = (0..3).map(|_| b.admit(0..10u32).unwrap()).collect();
        let batch = b.next_batch();
        for id in &r {
            assert_eq!(batch.iter().filter(|(x, _)| x == id).count(), 2);
        }
        // Nothing is running yet, so nothing fills the rest: the first frames come fast.
        assert_eq!(batch.len(), 6);
    }

    #[test]
    fn first_batch_never_exceeds_max_batch() {
        let b: Batcher<u32> = Batcher::new(limits(4, 16, 100, 100));
        assert_eq!(b.limits().first_batch, 4);
    }
    #[test]
    fn real_time_items_go_first_earliest_deadline_first_outside_the_queue_bound() {
        let mut l = limits(4, 2, 5, 5);
        l.fill_batch = 4;
        let mut b = Batcher::new(l);
        let file = b.admit(0..10u32).unwrap();
        // The bound (5 runnable) is full, yet sessions are admitted and do not count.
        let late = b.admit_realtime([(100u32, 50u64), (101, 90)]);
        let early = b.admit_realtime([(200u32, 10u64), (201, 60), (202, 70)]);
        assert_eq!(b.load(), 5);
        assert_eq!(b.earliest_deadline(), Some(10));
        let batch = b.next_batch();
        let items: Vec<u32> = batch.iter().map(|(_, i)| *i).collect();
        assert_eq!(items, vec![200, 100, 201, 202]);
        // What is left of the sessions still comes before the file request.
        let batch = b.next_batch();
        assert_eq!(batch[0], (late, 101));
        // (the file request's first batch: first_batch items)
        assert_eq!(batch[1..].iter().filter(|(id, _)| *id == file).count(), 2);
        assert_eq!(b.earliest_deadline(), None);
        assert_eq!(b.cancel(early), 0);
    }

    #[test]
    fn interactive_items_come_first_and_background_fills_the_rest() {
        let mut b = Batcher::new(limits(8, 8, 100, 100));
        let job = b.admit_background(0..100u32);
        let live = b.admit_realtime([(500u32, 5u64)]);
        let req = b.admit(200..203u32).unwrap();
        let batch = b.next_batch();
        assert_eq!(
            ids(&batch),
            vec![live.0, req.0, req.0, req.0, job.0, job.0, job.0, job.0]
        );
        // The background request's items stay in order.
        let of_job: Vec<u32> = batch
            .iter()
            .filter(|(r, _)| *r == job)
            .map(|(_, i)| *i)
            .collect();
        assert_eq!(of_job, vec![0, 1, 2, 3]);
        assert_eq!(b.queued_background(), 96);
        // Alone, it gets whole batches.
        assert_eq!(ids(&b.next_batch()), vec![job.0; 8]);
    }

    #[test]
    fn an_interactive_request_waits_at_most_for_the_batch_already_taken() {
        let mut l = limits(8, 2, 100, 100);
        l.fill_batch = 4;
        let mut b = Batcher::new(l);
        let job = b.admit_background(0..1000u32);
        // Background alone: full batches (it never counts as a new request).
        assert_eq!(b.batch_cap(), 8);
        assert_eq!(ids(&b.next_batch()), vec![job.0; 8]);
        // An interactive request arrives while that batch runs: the very next batch leads
        // with its first frames, and is capped as any new request's first batch is.
        let req = b.admit(0..20u32).unwrap();
        let batch = b.next_batch();
        assert_eq!(ids(&batch), vec![req.0, req.0, job.0, job.0]);
        // Then the interactive request takes what it can and background fills the rest.
        let batch = b.next_batch();
        assert_eq!(&ids(&batch)[..], &[req.0; 8][..]);
        b.cancel(req);
        assert_eq!(ids(&b.next_batch()), vec![job.0; 8]);
    }

    #[test]
    fn background_requests_wait_instead_of_being_refused() {
        let mut b = Batcher::new(limits(4, 4, 4, 4));
        b.admit(0..8u32).unwrap();
        // The interactive bound is full...
        assert_eq!(b.admit(0..4u32), Err(Overloaded { queued: 4 }));
        // ...yet background work is admitted, however much, and does not count against it.
        let job = b.admit_background(0..10_000u32);
        let other = b.admit_background(0..10_000u32);
        assert_ne!(job, other);
        assert_eq!(b.load(), 4);
        assert_eq!(b.admit(0..4u32), Err(Overloaded { queued: 4 }));
        assert_eq!(b.queued_background(), 20_000);
        assert_eq!(b.queued(), 20_008);
    }

    #[test]
    fn background_requests_are_served_oldest_first_within_their_look_ahead() {
        let mut b = Batcher::new(limits(8, 8, 100, 5));
        let old = b.admit_background(0..100u32);
        let new = b.admit_background(0..100u32);
        // The oldest takes its look-ahead (5), the next one the rest of the batch.
        assert_eq!(
            ids(&b.next_batch()),
            vec![old.0, old.0, old.0, old.0, old.0, new.0, new.0, new.0]
        );
        b.ack(old, 5);
        b.ack(new, 3);
        assert_eq!(&ids(&b.next_batch())[..5], &[old.0; 5][..]);
    }

    #[test]
    fn background_fills_only_up_to_the_size_the_caller_allows() {
        let mut b = Batcher::new(limits(8, 8, 100, 100));
        let job = b.admit_background(0..100u32);
        let live = b.admit_realtime([(1u32, 5u64), (2, 6)]);
        // A batch with live frames stays as small as their deadline needs.
        let batch = b.next_batch_filled(usize::MAX, 3);
        assert_eq!(ids(&batch), vec![live.0, live.0, job.0]);
        // Never below what real-time and interactive items need.
        b.admit_realtime([(3u32, 7u64), (4, 8)]);
        assert_eq!(b.next_batch_filled(usize::MAX, 0).len(), 2);
    }

    #[test]
    fn cancelling_a_background_request_drops_its_queued_items() {
        let mut b = Batcher::new(limits(4, 4, 100, 100));
        let job = b.admit_background(0..10u32);
        let req = b.admit(0..2u32).unwrap();
        assert_eq!(ids(&b.next_batch()), vec![req.0, req.0, job.0, job.0]);
        assert_eq!(b.cancel(job), 8);
        assert_eq!(b.queued_background(), 0);
        assert_eq!(b.queued(), 0);
        assert!(b.next_batch().is_empty());
        assert!(!b.has_work());
    }
}
