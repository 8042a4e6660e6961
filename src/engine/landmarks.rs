//! An avatar's landmarks from a landmark detector (RetinaFace, loaded with
//! `--enhancer-checkpoint`): found once per avatar frame, on the region around the frame's face
//! box only, when a restorer that needs them (GFPGAN) is asked for or the avatar is prepared on
//! a server that has both loaded.
//!
//! Per frame the detector runs on the box grown by half its width and height on every side
//! (clamped to the frame); the face taken is the best-scoring one above [`MIN_SCORE`] whose
//! box centre lies inside the avatar's box. A clip's landmarks are then smoothed over
//! [`SMOOTH_WINDOW`] frames, as its boxes are. Frames where no face is found take the
//! landmarks of the nearest frame that has one; with none found at all, the avatar keeps its
//! box's landmarks.

use super::{Avatar, Error};
use crate::media::face::{fill_missing, smoothing_window, FaceBox, Landmarks, SMOOTH_WINDOW};
use crate::media::image::Frame;
use crate::model::retinaface::RetinaFace;

/// Faces scored below this are not taken.
pub const MIN_SCORE: f32 = 0.5;
/// How far the searched region reaches beyond the box, as a share of its size on each side.
const MARGIN: f64 = 0.5;
/// The most candidates decoded before suppression (Pytorch_Retinaface's `top_k`).
const TOP_K: usize = 5000;
const NMS: f32 = 0.4;

/// Landmarks of every avatar frame, in the video's pixels (`None`: no frame had a face).
pub fn detect(avatar: &Avatar, net: &RetinaFace) -> Result<Option<Vec<Landmarks>>, Error> {
    let found = (0..avatar.frame_count())
        .map(|i| {
            let frame = avatar.background(i)?;
            in_frame(&frame, avatar.face_at(i), net)
        })
        .collect::<Result<Vec<_>, Error>>()?;
    let Some(mut all) = fill_missing(&found) else {
        return Ok(None);
    };
    if all.len() > 1 {
        smooth(&mut all, SMOOTH_WINDOW);
    }
    Ok(Some(all))
}

/// The region searched around box `b` in a `width × height` frame: `[x0, y0, x1, y1)`.
pub fn region(b: FaceBox, width: u32, height: u32) -> [u32; 4] {
    let (w, h) = (f64::from(b.width()), f64::from(b.height()));
    let grow =
        |v: u32, by: f64, max: u32| (f64::from(v) + by).clamp(0.0, f64::from(max)).round() as u32;
    [
        grow(b.x1, -MARGIN * w, width),
        grow(b.y1, -MARGIN * h, height),
        grow(b.x2, MARGIN * w, width),
        grow(b.y2, MARGIN * h, height),
    ]
}

/// The face in `frame` around `b` (see the module documentation).
pub fn in_frame(frame: &Frame, b: FaceBox, net: &RetinaFace) -> Result<Option<Landmarks>, Error> {
    let [x0, y0, x1, y1] = region(b, frame.width, frame.height);
    if x1 <= x0 || y1 <= y0 {
        return Ok(None);
    }
    let (cw, ch) = ((x1 - x0) as usize, (y1 - y0) as usize);
    let mut rgb = Vec::with_capacity(cw * ch * 3);
    for y in y0..y1 {
        let at = ((y * frame.width + x0) * 3) as usize;
        rgb.extend_from_slice(&frame.rgb[at..at + cw * 3]);
    }
    let faces = net.detect(&rgb, cw, ch, MIN_SCORE, Some(TOP_K), NMS)?;
    let inside = |x: f32, y: f32| {
        let (x, y) = (f64::from(x) + f64::from(x0), f64::from(y) + f64::from(y0));
        (f64::from(b.x1)..=f64::from(b.x2)).contains(&x)
            && (f64::from(b.y1)..=f64::from(b.y2)).contains(&y)
    };
    // Best first: the first face centred in the box.
    let Some(face) = faces
        .iter()
        .find(|f| inside((f.bbox[0] + f.bbox[2]) / 2.0, (f.bbox[1] + f.bbox[3]) / 2.0))
    else {
        return Ok(None);
    };
    let mut points = [[0f64; 2]; 5];
    for (k, p) in points.iter_mut().enumerate() {
        *p = [
            f64::from(face.landmarks[2 * k]) + f64::from(x0),
            f64::from(face.landmarks[2 * k + 1]) + f64::from(y0),
        ];
    }
    let l = Landmarks(points);
    // Points the alignment cannot use (off the frame, eyes together) count as no face.
    Ok(l.check(frame.width, frame.height).is_ok().then_some(l))
}

/// Each frame's points averaged over a window of `t` frames, as the clip's boxes are
/// smoothed (`media::face::smooth_boxes`: the window starts at the frame, and ends at the
/// clip's end for the last frames).
fn smooth(all: &mut [Landmarks], t: usize) {
    let n = all.len();
    let original: Vec<Landmarks> = all.to_vec();
    for (i, out) in all.iter_mut().enumerate() {
        let window = &original[smoothing_window(i, n, t)];
        let mut mean = [[0f64; 2]; 5];
        for l in window {
            for (m, p) in mean.iter_mut().zip(&l.0) {
                m[0] += p[0];
                m[1] += p[1];
            }
        }
        let len = window.len() as f64;
        *out = Landmarks(mean.map(|[x, y]| [x / len, y / len]));
    }
}

/// Detected landmarks an avatar keeps, shared by its copies: found once, by one caller at a
/// time (others asking meanwhile wait for its result rather than run the detector again).
#[derive(Debug, Default)]
pub struct Detected {
    running: std::sync::Mutex<()>,
    value: std::sync::OnceLock<Option<Vec<Landmarks>>>,
}

impl Detected {
    /// A detection that has already run (read back from an avatar file).
    pub fn found(found: Option<Vec<Landmarks>>) -> Detected {
        let d = Detected::default();
        let _ = d.value.set(found);
        d
    }

    /// The result, once a detection has run (`Some(None)`: it found no face).
    pub fn get(&self) -> Option<&Option<Vec<Landmarks>>> {
        self.value.get()
    }

    /// Runs `find` unless a detection has already run (then or meanwhile); `true` when this
    /// call stored its result. A failure stores nothing: the next caller tries again.
    pub fn run_once(
        &self,
        find: impl FnOnce() -> Result<Option<Vec<Landmarks>>, Error>,
    ) -> Result<bool, Error> {
        if self.value.get().is_some() {
            return Ok(false);
        }
        let _one = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if self.value.get().is_some() {
            return Ok(false);
        }
        let found = find()?;
        Ok(self.value.set(found).is_ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_without_a_face_take_the_nearest_and_a_clip_is_smoothed() {
        let at = |x: f64| {
            Landmarks([
                [x, 0.0],
                [x + 10.0, 0.0],
                [x + 5.0, 5.0],
                [x, 10.0],
                [x + 10.0, 10.0],
            ])
        };
        let filled = fill_missing(&[None, Some(at(1.0)), None, None, Some(at(4.0))]).unwrap();
        let xs: Vec<f64> = filled.iter().map(|l| l.0[0][0]).collect();
        assert_eq!(xs, [1.0, 1.0, 1.0, 4.0, 4.0]);
        assert!(fill_missing::<Landmarks>(&[None, None]).is_none());
        let mut all = vec![at(0.0), at(2.0), at(4.0)];
        smooth(&mut all, 2);
        let xs: Vec<f64> = all.iter().map(|l| l.0[0][0]).collect();
        assert_eq!(xs, [1.0, 3.0, 3.0]);
    }

    #[test]
    fn a_detection_runs_once_while_others_wait_and_a_failure_is_retried() {
        let d = std::sync::Arc::new(Detected::default());
        let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        assert!(d.run_once(|| Err(Error::Inference("no".into()))).is_err());
        assert!(d.get().is_none());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (d, runs) = (d.clone(), runs.clone());
                std::thread::spawn(move || {
                    d.run_once(|| {
                        runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_millis(50));
                        Ok(None)
                    })
                    .unwrap()
                })
            })
            .collect();
        let stored: usize = threads
            .into_iter()
            .map(|t| usize::from(t.join().unwrap()))
            .sum();
        assert_eq!(
            (stored, runs.load(std::sync::atomic::Ordering::SeqCst)),
            (1, 1)
        );
        assert_eq!(d.get(), Some(&None));
    }
}
