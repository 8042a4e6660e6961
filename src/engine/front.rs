//! The engine's one front door. The CLI (`render`, one job or many), the HTTP handlers and
//! the benchmarks all hand work to an [`Engine`] the same way: plan the frames of a speech on
//! a face input ([`plan`]), [`Engine::submit`] them, and read the predicted faces back in
//! order from the [`Submission`] (usually through a [`super::job::Job`], which composites and
//! encodes them). The same instances, batcher, precision fallback and out-of-memory handling
//! serve every door.

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::backend::Loader;
use super::batcher::{Overloaded, RequestId};
use super::enhance::Enhancers;
use super::enhance_pool::EnhancePool;
use super::pool::{Pool, PoolConfig, PoolStatus};
use super::render::video_frames;
use super::scheduler::{Drawn, FrameResult, FrameWork, Scheduler};
use super::Error;
use crate::media::audio::{Fps, FramePlan, Speech, WINDOW};

/// The model instances and their batcher, and the enhancers requests may ask for.
pub struct Engine {
    pool: Pool,
    enhancers: Arc<Enhancers>,
}

impl Engine {
    /// Starts the instances (they load and warm up in the background).
    pub fn start(loader: Arc<dyn Loader>, cfg: PoolConfig) -> Engine {
        Engine {
            pool: Pool::start(loader, cfg),
            enhancers: Arc::default(),
        }
    }

    /// The engine with these enhancers loaded, and their own instances started
    /// ([`super::enhance_pool`]): the model instances hand them the faces that ask for one.
    pub fn with_enhancers(mut self, enhancers: Arc<Enhancers>) -> Engine {
        if !enhancers.is_empty() {
            let pool = EnhancePool::start(enhancers.clone());
            self.pool.scheduler().set_enhance_pool(pool);
        }
        self.enhancers = enhancers;
        self
    }

    pub fn enhancers(&self) -> &Arc<Enhancers> {
        &self.enhancers
    }

    pub fn status(&self) -> &Arc<PoolStatus> {
        self.pool.status()
    }

    pub fn scheduler(&self) -> &Arc<Scheduler> {
        self.pool.scheduler()
    }

    /// Blocks until every instance is ready, or says why one could not start.
    pub fn wait_ready(&self) -> Result<(), String> {
        self.pool.wait_ready()
    }

    /// Admits a request's frames; its faces come back through the [`Submission`].
    pub fn submit(&self, frames: Vec<FrameWork>) -> Result<Submission, Overloaded> {
        let total = frames.len();
        let scheduler = self.pool.scheduler().clone();
        let (id, results) = scheduler.admit(frames)?;
        Ok(Submission::new(scheduler, id, results, total))
    }

    /// Admits a background render's (a batch job's) frames: never refused and outside the
    /// interactive admission bound; they wait, and fill only what live sessions' and
    /// interactive requests' frames leave of each batch (see [`super::batcher`]). What bounds
    /// them is the number of background renders the caller runs at once.
    pub fn submit_background(&self, frames: Vec<FrameWork>) -> Submission {
        let total = frames.len();
        let scheduler = self.pool.scheduler().clone();
        let (id, results) = scheduler.admit_background(frames);
        Submission::new(scheduler, id, results, total)
    }

    /// Admits a live session's frames with their delivery deadlines (served first, earliest
    /// deadline first; never refused: sessions are admitted by their own bound).
    pub fn submit_realtime(&self, frames: Vec<(FrameWork, Instant)>) -> Submission {
        let total = frames.len();
        let scheduler = self.pool.scheduler().clone();
        let (id, results) = scheduler.admit_realtime(frames);
        Submission::new(scheduler, id, results, total)
    }

    /// Stops the instances after their current batch and waits for them.
    pub fn shutdown(&self) {
        self.pool.shutdown();
    }
}

/// The frames of one request, planned: what the model draws and how long the video is.
pub struct Planned {
    pub frames: Vec<FrameWork>,
    /// Frames in the video (the last drawn one held to the end of the audio).
    pub video_frames: usize,
    pub speech_seconds: f64,
}

/// The original inference's frame plan for `speech` at `fps`: one mel window per frame, each
/// frame with the face crop `face_for(k)` (the same `Arc` for a photo; see
/// [`Avatar::crops`](super::Avatar::crops)).
pub fn plan(
    speech: &Speech,
    fps: Fps,
    face_for: &dyn Fn(usize) -> Arc<Vec<u8>>,
) -> Result<Planned, Error> {
    let mel = speech.mel();
    let plan = FramePlan::new(mel.frames(), fps)?;
    let frames = (0..plan.len())
        .map(|index| FrameWork {
            index,
            shown: index,
            mel: mel.window(plan.start(index), WINDOW),
            face: face_for(index),
            enhance: None,
            restore: None,
            due: None,
        })
        .collect();
    Ok(Planned {
        frames,
        video_frames: video_frames(speech.seconds(), fps, plan.len()),
        speech_seconds: speech.seconds(),
    })
}

/// An admitted request. Its predicted faces (96×96 BGR) come out in frame order; dropping it
/// before the last one drops its queued frames, however the consumer ended (error, panic,
/// client gone), so no lane is ever left behind in the batcher.
pub struct Submission {
    scheduler: Arc<Scheduler>,
    id: RequestId,
    results: Receiver<FrameResult>,
    pending: BTreeMap<usize, Drawn>,
    next: usize,
    total: usize,
}

impl Submission {
    /// A request admitted as `id`, its faces arriving on `results`.
    fn new(
        scheduler: Arc<Scheduler>,
        id: RequestId,
        results: Receiver<FrameResult>,
        total: usize,
    ) -> Submission {
        Submission {
            scheduler,
            id,
            results,
            pending: BTreeMap::new(),
            next: 0,
            total,
        }
    }

    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Frames the model draws for this request.
    pub fn total(&self) -> usize {
        self.total
    }

    /// The next face in order, waiting at most `wait`: `Ok(None)` when it has not come yet
    /// (or every face has been handed out). Each face handed out is acknowledged, so the
    /// batcher keeps this request within its look-ahead.
    pub fn next_face(&mut self, wait: Duration) -> Result<Option<Drawn>, Error> {
        if self.next >= self.total {
            return Ok(None);
        }
        if !self.pending.contains_key(&self.next) {
            match self.results.recv_timeout(wait) {
                Ok(Ok((index, face))) => {
                    self.pending.insert(index, face);
                }
                Ok(Err(e)) => return Err(Error::Inference(e)),
                Err(RecvTimeoutError::Timeout) => return Ok(None),
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::Inference("the model instances stopped".into()))
                }
            }
        }
        match self.pending.remove(&self.next) {
            Some(face) => {
                self.next += 1;
                self.scheduler.ack(self.id, 1);
                if self.next == self.total {
                    self.scheduler.finish(self.id);
                }
                Ok(Some(face))
            }
            None => Ok(None),
        }
    }
}

impl Drop for Submission {
    fn drop(&mut self) {
        if self.next < self.total {
            self.scheduler.cancel(self.id);
        }
    }
}
