//! Model inputs and outputs of the original inference, as tensors: mel windows and face
//! inputs for a batch, predictions back to 8-bit faces, and how many video frames cover the
//! audio. (Rendering itself goes through the engine front: [`super::front`].)

use candle_core::{Device, Tensor};

use super::{Avatar, Error};
use crate::media::audio::{Fps, FramePlan, Mel, WINDOW};
use crate::media::face::{self, FACE_SIZE};
use crate::model::arch::MEL_BINS;

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
