//! Face detection with the SeetaFace frontal detector (rustface), whose model is compiled into
//! the binary: nothing is downloaded at run time.
//!
//! SeetaFace returns square windows that start well above the brows and stop around the chin.
//! The boxes Wav2Lip was trained on (S3FD's) span brows to chin, so the detection is
//! calibrated to that: measured by hand on the two public-domain test photos
//! (`tests/media/README.md`), the brows sit 0.24 of the window below its top, the chin 1.04
//! below, and the cheeks 0.06 inside its sides. The model file is BSD-2 licensed
//! (`LICENSE.seetaface` beside this file).

use std::sync::OnceLock;

use rustface::{FaceInfo, ImageData, Model};

use super::FaceBox;
use crate::media::image::{downscale_to, Frame};
use crate::media::Error;

static MODEL_BYTES: &[u8] = include_bytes!("seeta_fd_frontal_v1.0.bin");

/// Calibration from a SeetaFace window (left, top, side) to a brows-to-chin box, as fractions
/// of the side: (left, top, right, bottom).
const CALIBRATION: [f64; 4] = [0.06, 0.24, 0.94, 1.04];

/// Faces are searched in a copy of the image at most this large (a portrait's face is big).
const DETECT_MAX_SIDE: u32 = 1024;

/// The best face found in an image.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Detection {
    /// Calibrated brows-to-chin box, before pads.
    pub face: FaceBox,
    /// The detector's own window.
    pub window: FaceBox,
    /// Detector confidence (SeetaFace score; 2 is the acceptance threshold).
    pub score: f64,
}

fn model() -> Result<Model, Error> {
    static MODEL: OnceLock<Result<Model, String>> = OnceLock::new();
    MODEL
        .get_or_init(|| rustface::read_model(MODEL_BYTES).map_err(|e| e.to_string()))
        .clone()
        .map_err(|e| Error::Internal(format!("embedded face model unreadable: {e}")))
}

/// Finds the face with the highest score; [`Error::NoFace`] when there is none.
pub fn detect(frame: &Frame) -> Result<Detection, Error> {
    // Search a smaller copy of large photos, then map back.
    let small = downscale_to(frame.clone(), DETECT_MAX_SIDE);
    let scale = f64::from(frame.width) / f64::from(small.width);
    let (w, h) = (small.width, small.height);
    if w < 20 || h < 20 {
        return Err(Error::NoFace(format!("the image is only {w}x{h} pixels")));
    }
    let mut detector = rustface::create_detector_with_model(model()?);
    detector.set_min_face_size((w.min(h) / 16).max(20));
    detector.set_score_thresh(2.0);
    detector.set_pyramid_scale_factor(0.8);
    detector.set_slide_window_step(4, 4);
    let gray = small.gray();
    let faces: Vec<FaceInfo> = detector.detect(&ImageData::new(&gray, w, h));
    let best = faces
        .iter()
        .max_by(|a, b| a.score().total_cmp(&b.score()))
        .ok_or_else(|| {
            Error::NoFace(
                "no face found; use a clear, frontal photo or give the box explicitly".into(),
            )
        })?;
    let bb = best.bbox();
    let (left, top) = (f64::from(bb.x()) * scale, f64::from(bb.y()) * scale);
    let (side_w, side_h) = (
        f64::from(bb.width()) * scale,
        f64::from(bb.height()) * scale,
    );
    let clip = |v: f64, hi: u32| v.round().clamp(0.0, f64::from(hi)) as u32;
    let window = FaceBox {
        x1: clip(left, frame.width),
        y1: clip(top, frame.height),
        x2: clip(left + side_w, frame.width),
        y2: clip(top + side_h, frame.height),
    };
    let [cl, ct, cr, cb] = CALIBRATION;
    let face = FaceBox {
        x1: clip(left + cl * side_w, frame.width),
        y1: clip(top + ct * side_h, frame.height),
        x2: clip(left + cr * side_w, frame.width),
        y2: clip(top + cb * side_h, frame.height),
    };
    if face.x1 >= face.x2 || face.y1 >= face.y2 {
        return Err(Error::NoFace(
            "the face found lies outside the image".into(),
        ));
    }
    Ok(Detection {
        face,
        window,
        score: best.score(),
    })
}
