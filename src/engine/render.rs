//! One render, start to finish, on the calling thread: the original inference's frame plan,
//! model batches, compositing, and frames streamed to the encoder as soon as they exist.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};

use super::compositor::Compositor;
use super::{Avatar, Error};
use crate::media::audio::{Fps, FramePlan, Mel, Speech, WINDOW};
use crate::media::face::{self, FACE_SIZE};
use crate::media::video::VideoEncoder;
use crate::model::arch::MEL_BINS;
use crate::model::Wav2Lip;

/// How to render.
#[derive(Debug, Clone)]
pub struct RenderOptions {
    pub fps: Fps,
    /// Frames per model call.
    pub batch: usize,
    /// Where to write every predicted 96×96 face as `00000.png`, `00001.png`, … (RGB).
    pub faces_dir: Option<PathBuf>,
}

/// What a render did.
#[derive(Debug, Clone, Default)]
pub struct RenderStats {
    /// Frames the model drew (the original inference's count).
    pub model_frames: usize,
    /// Frames in the video: the model's, then the last one held until the audio ends.
    pub video_frames: usize,
    pub mel_time: Duration,
    pub inference_time: Duration,
    pub composite_time: Duration,
    pub encode_time: Duration,
}

/// Video frames needed to cover `seconds` of audio at `fps` (never fewer than the model draws).
pub fn video_frames(seconds: f64, fps: Fps, model_frames: usize) -> usize {
    let n = (seconds * fps.value() - 1e-9).ceil().max(0.0) as usize;
    n.max(model_frames)
}

/// The model's mel input for frames `first .. first + n`: `(n, 1, 80, 16)`.
pub fn mel_batch(
    mel: &Mel,
    plan: &FramePlan,
    first: usize,
    n: usize,
    device: &Device,
) -> Result<Tensor, Error> {
    let mut v = Vec::with_capacity(n * MEL_BINS * WINDOW);
    for i in first..first + n {
        v.extend(mel.window(plan.start(i), WINDOW));
    }
    Ok(Tensor::from_vec(v, (n, 1, MEL_BINS, WINDOW), device)?)
}

/// The avatar's face input repeated for a batch: `(n, 6, 96, 96)`.
pub fn face_batch(avatar: &Avatar, n: usize, device: &Device) -> Result<Tensor, Error> {
    let one = Tensor::from_slice(&avatar.input, (1, 6, FACE_SIZE, FACE_SIZE), device)?;
    Ok(one.repeat((n, 1, 1, 1))?)
}

/// Renders `speech` on `avatar` into `encoder`. `progress(done, total)` is called after each
/// batch with video frames written.
pub fn render(
    model: &Wav2Lip,
    avatar: &Avatar,
    speech: &Speech,
    opts: &RenderOptions,
    encoder: &mut dyn VideoEncoder,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<RenderStats, Error> {
    let mut stats = RenderStats::default();
    let t = Instant::now();
    let mel = speech.mel();
    let plan = FramePlan::new(mel.frames(), opts.fps)?;
    stats.mel_time = t.elapsed();
    stats.model_frames = plan.len();
    stats.video_frames = video_frames(speech.seconds(), opts.fps, plan.len());
    let batch = opts.batch.max(1);
    let device = model.device().clone();
    let full_faces = face_batch(avatar, batch.min(plan.len()), &device)?;
    let mut out = Compositor::new(avatar, encoder, opts.faces_dir.as_deref())?;
    let mut first = 0;
    while first < plan.len() {
        let n = batch.min(plan.len() - first);
        let t = Instant::now();
        let faces = if n == full_faces.dim(0)? {
            full_faces.clone()
        } else {
            full_faces.narrow(0, 0, n)?
        };
        let pred = model.forward(&mel_batch(&mel, &plan, first, n, &device)?, &faces)?;
        let faces = predictions_to_bgr(&pred)?;
        stats.inference_time += t.elapsed();
        for bgr in &faces {
            out.push(bgr)?;
        }
        first += n;
        progress(first, stats.video_frames);
    }
    // The model draws a little less than the audio lasts: hold the last frame to the end.
    out.hold_until(stats.video_frames)?;
    stats.composite_time = out.composite_time;
    stats.encode_time = out.encode_time;
    progress(stats.video_frames, stats.video_frames);
    Ok(stats)
}

/// A batch of predictions `(n, 3, 96, 96)` to n 8-bit BGR faces.
pub fn predictions_to_bgr(pred: &Tensor) -> Result<Vec<Vec<u8>>, Error> {
    let v = pred
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok(v.chunks_exact(3 * FACE_SIZE * FACE_SIZE)
        .map(face::prediction_to_bgr)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_video_covers_the_audio() {
        // 4.00 s at 25 fps: the model draws 97 frames, the video needs 100.
        assert_eq!(video_frames(4.0, Fps::DEFAULT, 97), 100);
        assert_eq!(video_frames(4.01, Fps::DEFAULT, 97), 101);
        assert_eq!(video_frames(0.19, Fps::DEFAULT, 2), 5);
        assert_eq!(video_frames(0.05, Fps::DEFAULT, 2), 2);
    }
}
