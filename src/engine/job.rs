//! One service request after admission, on its own OS thread: results from the instances
//! (in any order) reordered, composited and encoded, each used frame acknowledged so the
//! batcher keeps this request within its run-ahead allowance; cancelled as soon as the client
//! is gone.

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use super::batcher::RequestId;
use super::compositor::Compositor;
use super::metrics as m;
use super::scheduler::{FrameResult, Scheduler};
use super::{Avatar, Error};
use crate::media::video::{EncodeSummary, VideoEncoder};

/// How often a waiting job checks whether its client is still there.
const POLL: Duration = Duration::from_millis(50);

/// An admitted request.
pub struct Job {
    pub request: RequestId,
    pub results: Receiver<FrameResult>,
    /// Frames the model draws.
    pub model_frames: usize,
    /// Frames in the video (the last one held to the end of the audio).
    pub video_frames: usize,
    pub avatar: Arc<Avatar>,
}

/// Releases the request in the scheduler however the job ends.
struct Release<'a> {
    scheduler: &'a Scheduler,
    request: RequestId,
    finished: bool,
}

impl Drop for Release<'_> {
    fn drop(&mut self) {
        if self.finished {
            self.scheduler.finish(self.request);
        } else {
            self.scheduler.cancel(self.request);
        }
    }
}

impl Job {
    /// Runs to the end of the video. `gone()` says whether the client has left; then the job
    /// stops, and the request's queued frames are dropped.
    pub fn run(
        self,
        scheduler: &Scheduler,
        mut encoder: Box<dyn VideoEncoder>,
        gone: &dyn Fn() -> bool,
    ) -> Result<EncodeSummary, Error> {
        let mut release = Release {
            scheduler,
            request: self.request,
            finished: false,
        };
        let mut pending: BTreeMap<usize, Vec<u8>> = BTreeMap::new();
        let mut out = Compositor::new(&self.avatar, encoder.as_mut(), None)?;
        let failed = |e: Error| if gone() { Error::Cancelled } else { e };
        while out.frames < self.model_frames {
            if gone() {
                return Err(Error::Cancelled);
            }
            match self.results.recv_timeout(POLL) {
                Ok(Ok((index, face))) => {
                    pending.insert(index, face);
                }
                Ok(Err(e)) => return Err(Error::Inference(e)),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::Inference("the model instances stopped".into()))
                }
            }
            while let Some(face) = pending.remove(&out.frames) {
                out.push(&face).map_err(failed)?;
                scheduler.ack(self.request, 1);
            }
        }
        release.finished = true;
        drop(release);
        out.hold_until(self.video_frames).map_err(failed)?;
        m::stage("composite", out.composite_time);
        let encode_time = out.encode_time;
        drop(out);
        let t = std::time::Instant::now();
        let summary = encoder.finish().map_err(|e| failed(e.into()))?;
        m::stage("encode", encode_time + t.elapsed());
        Ok(summary)
    }
}
