//! The enhancers' own instances: threads that run enhancers on the faces the model instances
//! hand over, in batches of their own, ordered by the same classes as the generator's.
//!
//! A model instance answers the frames that asked for no enhancer itself and hands the others
//! here ([`EnhancePool::hand_over`]) as soon as its batch is drawn, then takes its next batch:
//! the generator never waits for an enhancer. Each enhancer instance takes the most urgent
//! face waiting and makes a batch of up to [`CHUNK`](super::enhance::CHUNK) faces for the same
//! enhancer:
//! - a live face first, earliest deadline first; a batch led by a live face takes only live
//!   faces, so no file or job face delays it;
//! - then interactive requests' faces, in the order they were drawn, filled with background
//!   (batch job) faces; such a batch takes at most what the enhancer draws in 0.1 s by its
//!   cost measured at start-up (at least one face), so a live face that arrives meanwhile
//!   does not wait behind a long batch.
//!
//! A face's request stays within its look-ahead while its face waits here (the frame is taken
//! but not acknowledged), so this queue is bounded by the requests' look-ahead. A cancelled
//! request's faces are dropped ([`EnhancePool::cancel`]). An instance's fault (an error or a
//! panic) fails the frames of that batch, and the instance goes on with the next.
//!
//! On a GPU each instance has its own copy of every enhancer's weights
//! ([`Enhancers::instance_net`]); on the CPU the instances share the CPU pass, which spreads
//! each batch over the cores itself.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use super::batcher::RequestId;
use super::enhance::{EnhanceWith, Enhancers, CHUNK};
use super::metrics as m;
use super::restore::Restore;
use super::scheduler::{Class, Drawn, FrameResult};
use crate::model::enhancer::DeviceNet;

/// One face waiting for its enhancer.
pub struct Handed {
    pub request: RequestId,
    pub class: Class,
    /// The frame's number in its request (what its answer carries).
    pub index: usize,
    pub with: EnhanceWith,
    /// Where the face is restored, for a restorer ([`super::restore`]).
    pub restore: Option<Restore>,
    /// The predicted face, `(3, 96, 96)` planar BGR in [0, 1], as the generator drew it.
    pub pred: Vec<f32>,
    pub reply: Sender<FrameResult>,
}

struct State {
    /// Waiting faces by (class, arrival): the first is the most urgent.
    queue: BTreeMap<(Class, u64), Handed>,
    arrivals: u64,
    shutdown: bool,
}

/// See the module documentation.
pub struct EnhancePool {
    state: Mutex<State>,
    work: Condvar,
    instances: usize,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl EnhancePool {
    /// Starts one thread per enhancer instance ([`Enhancers::instances`]).
    pub fn start(enhancers: Arc<Enhancers>) -> Arc<EnhancePool> {
        let pool = Arc::new(EnhancePool {
            state: Mutex::new(State {
                queue: BTreeMap::new(),
                arrivals: 0,
                shutdown: false,
            }),
            work: Condvar::new(),
            instances: enhancers.instances(),
            threads: Mutex::new(Vec::new()),
        });
        let threads = (0..pool.instances)
            .map(|k| {
                let (pool, enhancers) = (pool.clone(), enhancers.clone());
                std::thread::Builder::new()
                    .name(format!("lipsync-enhancer-{k}"))
                    .spawn(move || pool.serve(k, &enhancers))
                    .expect("spawning an enhancer thread")
            })
            .collect();
        *pool.threads.lock().unwrap_or_else(|p| p.into_inner()) = threads;
        pool
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Enhancer instances.
    pub fn instances(&self) -> usize {
        self.instances
    }

    /// Faces waiting for an enhancer.
    pub fn queued(&self) -> usize {
        self.lock().queue.len()
    }

    /// Queues faces for their enhancers (from a model instance's batch) and wakes the
    /// instances. After [`EnhancePool::shutdown`] the faces fail at once.
    pub fn hand_over(&self, faces: Vec<Handed>) {
        if faces.is_empty() {
            return;
        }
        let mut s = self.lock();
        if s.shutdown {
            drop(s);
            for f in faces {
                let _ = f.reply.send(Err("the server is shutting down".into()));
            }
            return;
        }
        for f in faces {
            let key = (f.class, s.arrivals);
            s.arrivals += 1;
            s.queue.insert(key, f);
        }
        metrics::gauge!(m::ENHANCE_QUEUE_FRAMES).set(s.queue.len() as f64);
        drop(s);
        self.work.notify_all();
    }

    /// Drops a cancelled request's waiting faces; returns how many.
    pub fn cancel(&self, request: RequestId) -> usize {
        let mut s = self.lock();
        let before = s.queue.len();
        s.queue.retain(|_, f| f.request != request);
        metrics::gauge!(m::ENHANCE_QUEUE_FRAMES).set(s.queue.len() as f64);
        before - s.queue.len()
    }

    /// Stops the instances after their current batch (waiting faces fail) and waits for
    /// them.
    pub fn shutdown(&self) {
        let waiting = {
            let mut s = self.lock();
            s.shutdown = true;
            std::mem::take(&mut s.queue)
        };
        self.work.notify_all();
        for f in waiting.into_values() {
            let _ = f.reply.send(Err("the server is shutting down".into()));
        }
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }

    /// Blocks for the next batch (see the module documentation); `None` after shutdown.
    fn next_batch(&self) -> Option<Vec<Handed>> {
        let mut s = self.lock();
        loop {
            if s.shutdown {
                return None;
            }
            if !s.queue.is_empty() {
                break;
            }
            s = self.work.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        let batch = take_batch(&mut s.queue, CHUNK);
        metrics::gauge!(m::ENHANCE_QUEUE_FRAMES).set(s.queue.len() as f64);
        Some(batch)
    }

    /// Instance `k`'s life: batches until shutdown.
    fn serve(&self, k: usize, enhancers: &Enhancers) {
        while let Some(batch) = self.next_batch() {
            let t = Instant::now();
            let with = batch[0].with.clone();
            let net = enhancers.instance_net(&with, k);
            let result =
                std::panic::catch_unwind(AssertUnwindSafe(|| run(&with, net.as_deref(), &batch)))
                    .unwrap_or_else(|p| {
                        Err(format!("panicked: {}", super::pool::panic_message(&p)))
                    });
            m::stage("enhance", t.elapsed());
            match result {
                Ok(out) => {
                    for (h, face) in batch.into_iter().zip(out) {
                        if let Err(e) = &face {
                            tracing::error!("enhancer instance {k}: a face failed: {e}");
                        }
                        let face = face
                            .map(|f| (h.index, f))
                            .map_err(|e| format!("enhancer {}: {e}", with.name));
                        // A closed receiver means the request was cancelled meanwhile.
                        let _ = h.reply.send(face);
                    }
                }
                Err(e) => {
                    tracing::error!(
                        "enhancer instance {k}: a batch of {} faces failed: {e}",
                        batch.len()
                    );
                    for h in batch {
                        let _ = h.reply.send(Err(format!("enhancer {}: {e}", with.name)));
                    }
                }
            }
        }
    }
}

/// A batch through its enhancer: the faces enhanced, or pasted and restored by a restorer;
/// a result per face (a restorer's face can fail alone), or the batch's failure.
fn run(
    with: &EnhanceWith,
    net: Option<&dyn DeviceNet>,
    batch: &[Handed],
) -> Result<Vec<Result<Drawn, String>>, String> {
    if !with.restores() {
        let faces: Vec<&[f32]> = batch.iter().map(|h| h.pred.as_slice()).collect();
        let out = super::enhance::run_batch(with, net, &faces)?;
        return Ok(out.into_iter().map(|f| Ok(Drawn::face(f))).collect());
    }
    let faces = batch
        .iter()
        .map(|h| {
            let at = h.restore.as_ref().ok_or_else(|| {
                format!(
                    "{} restores a pasted face: the frame says not where",
                    with.name
                )
            })?;
            Ok((h.pred.as_slice(), at))
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(super::restore::run_batch(with, net, &faces))
}

/// Seconds a batch without live faces may take, by the enhancer's cost measured at start-up:
/// a live face that arrives meanwhile waits at most about this long for an instance.
const NON_LIVE_BATCH_SECONDS: f64 = 0.1;

/// Takes the next batch from `queue`: the most urgent face and up to `max − 1` more for the
/// same enhancer, in order. A batch led by a live face takes only live faces; one without
/// takes at most what the enhancer draws in [`NON_LIVE_BATCH_SECONDS`] (at least one face).
fn take_batch(queue: &mut BTreeMap<(Class, u64), Handed>, max: usize) -> Vec<Handed> {
    let Some(first) = queue.first_key_value().map(|(k, h)| (*k, h.with.clone())) else {
        return Vec::new();
    };
    let ((lead, _), with) = first;
    let live = matches!(lead, Class::Live(_));
    let max = if live || with.seconds_per_face <= 0.0 {
        max
    } else {
        let fits = (NON_LIVE_BATCH_SECONDS / with.seconds_per_face).floor() as usize;
        max.min(fits.max(1))
    };
    let keys: Vec<(Class, u64)> = queue
        .iter()
        .filter(|((class, _), h)| h.with == with && (!live || matches!(class, Class::Live(_))))
        .take(max)
        .map(|(k, _)| *k)
        .collect();
    keys.iter().filter_map(|k| queue.remove(k)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::arch::FACE_SIZE;
    use crate::model::enhancer::testing::{checkpoint, compact_keys};
    use crate::model::enhancer::{self, EnhancerNet};
    use std::sync::mpsc;
    use std::time::Duration;

    fn with(name: &str, net: &Arc<dyn EnhancerNet>) -> EnhanceWith {
        EnhanceWith {
            name: name.into(),
            net: net.clone(),
            on_device: None,
            seconds_per_face: 0.0,
            landmarks: None,
        }
    }

    fn tiny() -> Arc<dyn EnhancerNet> {
        enhancer::recognise(&checkpoint(&compact_keys(4, 1, 2))).unwrap()
    }

    fn handed(request: u64, class: Class, index: usize, w: &EnhanceWith) -> Handed {
        let (reply, _) = mpsc::channel();
        Handed {
            request: RequestId(request),
            class,
            index,
            with: w.clone(),
            restore: None,
            pred: Vec::new(),
            reply,
        }
    }

    fn queue_of(faces: Vec<Handed>) -> BTreeMap<(Class, u64), Handed> {
        faces
            .into_iter()
            .enumerate()
            .map(|(i, h)| ((h.class, i as u64), h))
            .collect()
    }

    #[test]
    fn batches_go_live_first_by_deadline_then_in_order_one_enhancer_at_a_time() {
        let (a, b) = (with("a", &tiny()), with("b", &tiny()));
        let now = Instant::now();
        let soon = Class::Live(now + Duration::from_millis(10));
        let later = Class::Live(now + Duration::from_millis(50));
        let mut q = queue_of(vec![
            handed(1, Class::Background, 0, &a),
            handed(2, Class::Interactive, 0, &a),
            handed(3, later, 0, &a),
            handed(4, Class::Interactive, 1, &b),
            handed(5, soon, 0, &b),
            handed(2, Class::Interactive, 1, &a),
            handed(6, later, 0, &b),
        ]);
        let order = |batch: Vec<Handed>| -> Vec<(u64, usize)> {
            batch.iter().map(|h| (h.request.0, h.index)).collect()
        };
        // The earliest live face leads, with the other live face of its enhancer only.
        assert_eq!(order(take_batch(&mut q, 32)), vec![(5, 0), (6, 0)]);
        assert_eq!(order(take_batch(&mut q, 32)), vec![(3, 0)]);
        // Then interactive faces in order, filled with background ones of the same enhancer.
        assert_eq!(order(take_batch(&mut q, 32)), vec![(2, 0), (2, 1), (1, 0)]);
        assert_eq!(order(take_batch(&mut q, 32)), vec![(4, 1)]);
        assert!(take_batch(&mut q, 32).is_empty());
        // A batch takes at most `max` faces.
        let mut q = queue_of(
            (0..5)
                .map(|i| handed(1, Class::Interactive, i, &a))
                .collect(),
        );
        assert_eq!(take_batch(&mut q, 2).len(), 2);
        assert_eq!(q.len(), 3);
        // Without live faces, at most what the enhancer draws in 0.1 s (at least one); live
        // faces are not capped.
        let costed = |name: &str, seconds_per_face: f64| EnhanceWith {
            seconds_per_face,
            ..with(name, &tiny())
        };
        let (slow, crawl) = (costed("slow", 0.03), costed("crawl", 0.5));
        let eight = |class: Class, w: &EnhanceWith| {
            queue_of((0..8).map(|i| handed(1, class, i, w)).collect())
        };
        assert_eq!(
            take_batch(&mut eight(Class::Interactive, &slow), 32).len(),
            3
        );
        assert_eq!(
            take_batch(&mut eight(Class::Background, &crawl), 32).len(),
            1
        );
        assert_eq!(take_batch(&mut eight(soon, &crawl), 32).len(), 8);
    }

    #[test]
    fn the_instances_answer_every_face_and_drop_a_cancelled_requests() {
        // Two instances, three requests' faces: each answered face is what the enhancer makes
        // of that face alone; a cancelled request's waiting faces are dropped, not answered.
        let net = tiny();
        let enhancers = Arc::new(Enhancers::for_tests(vec![with("tiny", &net)], 2));
        let pool = EnhancePool::start(enhancers);
        assert_eq!(pool.instances(), 2);
        let w = with("tiny", &net);
        let plane = 3 * FACE_SIZE * FACE_SIZE;
        let face = |i: usize| -> Vec<f32> {
            (0..plane)
                .map(|v| ((v * 7 + i * 13) % 256) as f32 / 255.0)
                .collect()
        };
        let (tx, rx) = mpsc::channel();
        let faces: Vec<Handed> = (0..40)
            .map(|i| Handed {
                request: RequestId(1 + (i % 2) as u64),
                class: Class::Interactive,
                index: i,
                with: w.clone(),
                restore: None,
                pred: face(i),
                reply: tx.clone(),
            })
            .collect();
        pool.hand_over(faces);
        let mut got = BTreeMap::new();
        while got.len() < 40 {
            let (i, f) = rx.recv_timeout(Duration::from_secs(60)).unwrap().unwrap();
            got.insert(i, f);
        }
        for (i, f) in &got {
            let alone = super::super::enhance::run_batch(&w, None, &[&face(*i)]).unwrap();
            assert_eq!(f, &Drawn::face(alone[0].clone()), "face {i}");
        }
        // Cancelling drops what waits: hold both instances' next batches behind a queue of
        // one request, cancel it, and see nothing of it answered.
        let (tx, rx) = mpsc::channel();
        let many: Vec<Handed> = (0..6 * CHUNK)
            .map(|i| Handed {
                request: RequestId(9),
                class: Class::Background,
                index: i,
                with: w.clone(),
                restore: None,
                pred: face(i),
                reply: tx.clone(),
            })
            .collect();
        pool.hand_over(many);
        let dropped = pool.cancel(RequestId(9));
        // At most a few batches were taken before the cancel.
        assert!(dropped >= CHUNK, "only {dropped} dropped");
        let answered = 6 * CHUNK - dropped;
        for _ in 0..answered {
            rx.recv_timeout(Duration::from_secs(60)).unwrap().unwrap();
        }
        assert_eq!(pool.queued(), 0);
        pool.shutdown();
        drop(tx);
        assert!(rx.recv_timeout(Duration::from_secs(5)).is_err());
    }

    /// An enhancer that runs only once the test lets it (the tiny network behind a gate).
    struct Gated {
        inner: Arc<dyn EnhancerNet>,
        open: Mutex<bool>,
        opened: Condvar,
    }

    impl Gated {
        fn open(&self) {
            *self.open.lock().unwrap() = true;
            self.opened.notify_all();
        }
    }

    impl EnhancerNet for Gated {
        fn kind(&self) -> enhancer::Kind {
            self.inner.kind()
        }
        fn describe(&self) -> String {
            self.inner.describe()
        }
        fn scale(&self) -> usize {
            self.inner.scale()
        }
        fn check_size(&self, h: usize, w: usize) -> crate::model::Result<()> {
            self.inner.check_size(h, w)
        }
        fn multiply_adds(&self, h: usize, w: usize) -> f64 {
            self.inner.multiply_adds(h, w)
        }
        fn forward_cpu(
            &self,
            n: usize,
            h: usize,
            w: usize,
            rgb: &[f32],
        ) -> crate::model::Result<Vec<f32>> {
            let mut open = self.open.lock().unwrap();
            while !*open {
                open = self.opened.wait(open).unwrap();
            }
            drop(open);
            self.inner.forward_cpu(n, h, w, rgb)
        }
        fn on_device(
            &self,
            device: &candle_core::Device,
        ) -> crate::model::Result<Arc<dyn enhancer::DeviceNet>> {
            self.inner.on_device(device)
        }
    }

    #[test]
    fn the_model_draws_on_while_an_enhancer_works() {
        // An enhanced request first, then a plain one, on one model instance: the plain
        // request's faces all come while the enhancer has not run yet (the instance handed
        // the enhanced faces over and went on), and the enhanced faces come once it runs.
        use crate::engine::backend::FACE_LEN;
        use crate::engine::echo::EchoLoader;
        use crate::engine::pool::PoolConfig;
        use crate::engine::scheduler::FrameWork;
        use crate::engine::Engine;

        let gated = Arc::new(Gated {
            inner: tiny(),
            open: Mutex::new(false),
            opened: Condvar::new(),
        });
        let net: Arc<dyn EnhancerNet> = gated.clone();
        let w = with("gated", &net);
        let cfg = PoolConfig::testing(4, 4, 1000);
        let engine = Engine::start(Arc::new(EchoLoader), cfg)
            .with_enhancers(Arc::new(Enhancers::for_tests(vec![w.clone()], 1)));
        engine.wait_ready().unwrap();
        let face = Arc::new(vec![128u8; FACE_LEN / 2]);
        let frames = |n: usize, enhance: Option<EnhanceWith>| -> Vec<FrameWork> {
            (0..n)
                .map(|index| FrameWork {
                    index,
                    shown: index,
                    mel: vec![0.0; crate::engine::backend::MEL_LEN],
                    face: face.clone(),
                    enhance: enhance.clone(),
                    restore: None,
                    due: None,
                })
                .collect()
        };
        let mut enhanced = engine.submit(frames(8, Some(w))).unwrap();
        let mut plain = engine.submit(frames(8, None)).unwrap();
        for i in 0..8 {
            let f = plain.next_face(Duration::from_secs(30)).unwrap();
            let f = f.unwrap_or_else(|| panic!("plain face {i} waited for the enhancer"));
            assert_eq!(f.face.len(), 3 * 96 * 96);
        }
        assert_eq!(enhanced.next_face(Duration::from_millis(50)).unwrap(), None);
        gated.open();
        for i in 0..8 {
            let f = enhanced.next_face(Duration::from_secs(60)).unwrap();
            assert_eq!(
                f.map(|f| f.face.len()),
                Some(3 * 192 * 192),
                "enhanced face {i}"
            );
        }
        engine.shutdown();
    }
}
