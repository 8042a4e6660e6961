//! The echo device (`--device echo`): a model stand-in that costs nothing, so the media side
//! of the service (audio, avatars, scheduler, batcher, compositor, encoder, HTTP, live
//! sessions, jobs) can be measured and tested at a GPU's pace on any machine.
//!
//! Its "prediction" for a frame is the frame's reference face (the unmasked half of the model
//! input, already in the model's output format: channel-major BGR in 0..1) with its lower 48
//! rows shifted down by `frame index mod 5` pixels (the rows uncovered at the top of the lower
//! half repeat its first row), so encoders see a moving mouth rather than identical frames.

use candle_core::DType;

use super::backend::{Loader, Model, Prediction, FACE_LEN, PRED_LEN};
use super::Error;
use crate::model::arch::FACE_SIZE;
use crate::model::Precision;

/// Rows of the face the echo moves (the lower half, the model's masked region).
const MOVED_ROWS: usize = FACE_SIZE / 2;

/// How far frame `index`'s mouth moves down, in pixels.
pub fn shift(index: usize) -> usize {
    index % 5
}

/// Makes [`Echo`] models.
#[derive(Debug, Default)]
pub struct EchoLoader;

impl Loader for EchoLoader {
    fn load(&self, precision: Precision, _check_batch: usize) -> Result<Box<dyn Model>, Error> {
        Ok(Box::new(Echo {
            dtype: precision.dtype(),
        }))
    }
}

/// The stand-in model (see the module's documentation).
#[derive(Debug)]
pub struct Echo {
    /// The precision it was asked for (it reports it and computes nothing).
    dtype: DType,
}

impl Model for Echo {
    fn dtype(&self) -> DType {
        self.dtype
    }

    fn conv_path(&self) -> &'static str {
        "echo"
    }

    fn predict(&mut self, n: usize, mel: Vec<f32>, face: Vec<f32>) -> Result<Prediction, Error> {
        let indices: Vec<usize> = (0..n).collect();
        self.predict_frames(&indices, mel, face)
    }

    fn predict_frames(
        &mut self,
        indices: &[usize],
        _mel: Vec<f32>,
        face: Vec<f32>,
    ) -> Result<Prediction, Error> {
        let n = indices.len();
        if face.len() != n * FACE_LEN {
            return Err(Error::Model(crate::model::Error::BadInput(format!(
                "{} face values for {n} frames (want {})",
                face.len(),
                n * FACE_LEN
            ))));
        }
        // Written over the input, front to back: face k's output lies before its reference
        // half and after every reference half read so far. The pool then reuses the buffer
        // (with the input's capacity) for its next batch's input.
        let mut faces = face;
        for (k, &index) in indices.iter().enumerate() {
            echo_face(
                &mut faces,
                k * FACE_LEN + PRED_LEN,
                k * PRED_LEN,
                shift(index),
            );
        }
        faces.truncate(n * PRED_LEN);
        Ok(Prediction {
            faces,
            overflow: false,
        })
    }

    fn use_reference_path(&mut self) -> bool {
        false
    }
}

/// Copies the reference face at `buf[src..]` (`(3, 96, 96)`) to `buf[dst..]` (a range apart
/// from it) with its lower [`MOVED_ROWS`] rows shifted down by `shift` pixels.
fn echo_face(buf: &mut [f32], src: usize, dst: usize, shift: usize) {
    let plane = FACE_SIZE * FACE_SIZE;
    let top = FACE_SIZE - MOVED_ROWS;
    for c in 0..3 {
        for row in 0..FACE_SIZE {
            let from = if row < top {
                row
            } else {
                (row.saturating_sub(shift)).max(top)
            };
            let at = src + c * plane + from * FACE_SIZE;
            buf.copy_within(at..at + FACE_SIZE, dst + c * plane + row * FACE_SIZE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::media::face;

    /// A crop whose every pixel differs: BGR from its row, column and channel.
    fn crop() -> Vec<u8> {
        (0..FACE_SIZE * FACE_SIZE * 3)
            .map(|i| {
                let (px, c) = (i / 3, i % 3);
                ((px / FACE_SIZE) * 2 + (px % FACE_SIZE) + c * 7) as u8
            })
            .collect()
    }

    #[test]
    fn the_echo_draws_the_reference_face_with_its_mouth_shifted_by_the_frame_number() {
        let crop = crop();
        let mut input = Vec::new();
        for _ in 0..7 {
            face::model_input_into(&crop, &mut input);
        }
        let indices = [0, 1, 2, 3, 4, 5, 13];
        let mut echo = EchoLoader.load(Precision::F16, 8).unwrap();
        assert_eq!(echo.dtype(), DType::F16);
        let out = echo
            .predict_frames(&indices, vec![0.0; 7 * 80 * 16], input)
            .unwrap();
        assert!(!out.overflow);
        assert_eq!(out.faces.len(), 7 * PRED_LEN);
        let px = |f: &[f32], c: usize, row: usize, col: usize| {
            f[c * FACE_SIZE * FACE_SIZE + row * FACE_SIZE + col]
        };
        let source = |c: usize, row: usize, col: usize| {
            f32::from(crop[(row * FACE_SIZE + col) * 3 + c]) / 255.0
        };
        for (k, &index) in indices.iter().enumerate() {
            let f = &out.faces[k * PRED_LEN..(k + 1) * PRED_LEN];
            let s = index % 5;
            for c in 0..3 {
                for row in 0..FACE_SIZE {
                    let from = if row < 48 {
                        row
                    } else {
                        row.saturating_sub(s).max(48)
                    };
                    for col in [0, 31, 95] {
                        assert_eq!(
                            px(f, c, row, col),
                            source(c, from, col),
                            "{index} {c} {row}"
                        );
                    }
                }
            }
        }
        // Frame 0 is the reference itself; frames 1-4 differ from it and from each other
        // below the middle only; frame 5 is frame 0 again, 13 is 3.
        let frame = |k: usize| &out.faces[k * PRED_LEN..(k + 1) * PRED_LEN];
        for k in 1..5 {
            assert_ne!(frame(k), frame(k - 1));
        }
        assert_eq!(frame(5), frame(0));
        assert_eq!(frame(6), frame(3));
        // The plain call numbers the frames 0, 1, ...
        let mut input = Vec::new();
        face::model_input_into(&crop, &mut input);
        face::model_input_into(&crop, &mut input);
        let plain = echo.predict(2, vec![0.0; 2 * 80 * 16], input).unwrap();
        assert_eq!(&plain.faces[..], &out.faces[..2 * PRED_LEN]);
    }

    #[test]
    fn a_batch_of_the_wrong_size_is_an_error_not_a_panic() {
        let mut echo = EchoLoader.load(Precision::F32, 1).unwrap();
        assert!(echo.predict(2, vec![], vec![0.0; FACE_LEN]).is_err());
    }
}
