//! One request after admission, on the calling thread (a request thread of the service, or
//! the CLI's main thread): predicted faces from the engine, in order, composited into the
//! avatar's frame and encoded, the last frame held to the end of the audio. Stops as soon as
//! the client is gone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::clip::Loop;
use super::compositor::{Compositor, Keep};
use super::front::Submission;
use super::metrics as m;
use super::{Avatar, Error};
use crate::media::video::{EncodeSummary, VideoEncoder};

/// How often a waiting job checks whether its client is still there.
const POLL: Duration = Duration::from_millis(50);

/// An admitted request and where its frames go.
pub struct Job {
    pub submission: Submission,
    /// Frames in the video (the last one held to the end of the audio).
    pub video_frames: usize,
    pub avatar: Arc<Avatar>,
    /// How a clip avatar's frames follow each other (ignored for a photo).
    pub loop_mode: Loop,
    /// The faces and frames also written as images.
    pub keep: Keep,
}

/// What a job did.
#[derive(Debug, Clone, Default)]
pub struct JobStats {
    pub model_frames: usize,
    pub video_frames: usize,
    /// Time spent waiting for the model's faces.
    pub model_wait: Duration,
    pub composite_time: Duration,
    pub encode_time: Duration,
    pub summary: EncodeSummary,
}

impl Job {
    /// Runs to the end of the video. `gone()` says whether the client has left: then the job
    /// stops and the request's queued frames are dropped. `progress(done, total)` is called
    /// with video frames written.
    pub fn run(
        mut self,
        mut encoder: Box<dyn VideoEncoder>,
        gone: &dyn Fn() -> bool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<JobStats, Error> {
        let model_frames = self.submission.total();
        let mut stats = JobStats {
            model_frames,
            video_frames: self.video_frames,
            ..Default::default()
        };
        let failed = |e: Error| if gone() { Error::Cancelled } else { e };
        let mut out = Compositor::new(&self.avatar, self.loop_mode, encoder.as_mut(), &self.keep)?;
        while out.frames < model_frames {
            if gone() {
                return Err(Error::Cancelled);
            }
            let t = Instant::now();
            let face = self.submission.next_face(POLL).map_err(failed)?;
            stats.model_wait += t.elapsed();
            if let Some(face) = face {
                if super::faults::hit("job_panic") {
                    panic!("injected fault: job_panic");
                }
                out.push(&face).map_err(failed)?;
                progress(out.frames, self.video_frames);
            }
        }
        out.hold_until(self.video_frames).map_err(failed)?;
        stats.composite_time = out.composite_time;
        m::stage("composite", out.composite_time);
        let encode_time = out.encode_time;
        drop(out);
        let t = Instant::now();
        stats.summary = encoder.finish().map_err(|e| failed(e.into()))?;
        stats.encode_time = encode_time + t.elapsed();
        m::stage("encode", stats.encode_time);
        progress(self.video_frames, self.video_frames);
        Ok(stats)
    }
}
