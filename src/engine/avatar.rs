//! An avatar prepared once: a photo (decoded, face box, the model's face input and the blend
//! mask) or a clip (the same per frame, see [`super::clip`]). The service caches these;
//! `lipsync render` makes one per job.

use std::borrow::Cow;
use std::sync::Arc;

use super::clip::{Clip, Loop};
use crate::media::audio::Fps;
use crate::media::face::restore::RestoreMask;
use crate::media::face::{
    self, Blend, BlendMask, Detection, FaceBox, LandmarkSource, Landmarks, Pads,
};
use crate::media::image::{self, Frame, ImageLimits};
use crate::media::yuv::Region;
use crate::media::Error;
use crate::model::retinaface::RetinaFace;

/// Blend masks of a video avatar's face boxes whose size differs from its first frame's, made
/// once each (see [`Avatar::paste_at`]).
#[derive(Default)]
pub struct BlendMasks(std::collections::HashMap<(u32, u32), BlendMask>);

/// Restore masks of an avatar's frames, made on first use (see [`Avatar::restore_mask`]).
#[derive(Default)]
pub struct RestoreMasks(
    std::sync::Mutex<std::collections::HashMap<usize, Option<Arc<RestoreMask>>>>,
);

impl std::fmt::Debug for RestoreMasks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map_or(0, |m| m.len());
        write!(f, "RestoreMasks({n} made)")
    }
}

/// Restore masks an avatar keeps at most (a long clip's are made again after this many; each
/// holds its region's weights, up to a few hundred kB).
const MAX_RESTORE_MASKS: usize = 32;

/// A photo or a clip ready to be animated. The fields describe the photo, or a clip's first
/// frame; per-frame access goes through the methods.
#[derive(Debug, Clone)]
pub struct Avatar {
    /// The photo as it will appear in the video (downscaled if it was larger than allowed).
    pub frame: Frame,
    /// The face box in `frame`'s pixels.
    pub face: FaceBox,
    /// The face box in the uploaded photo's own pixels (what `--box` and `detect` speak).
    pub source_face: FaceBox,
    /// The uploaded photo's size.
    pub source_size: (u32, u32),
    /// The detection, when the box was not given.
    pub detection: Option<Detection>,
    /// The five landmarks the client gave, in the uploaded photo's (or clip's) own pixels, for
    /// every frame; `None`: each frame's are placed in its box ([`Landmarks::from_box`]).
    pub given_landmarks: Option<Landmarks>,
    /// The 96×96 BGR crop the model sees.
    pub crop_bgr: Arc<Vec<u8>>,
    /// The model's face input, `(6, 96, 96)`.
    pub input: Vec<f32>,
    pub mask: BlendMask,
    pub blend: Blend,
    /// The clip, for a video avatar.
    pub clip: Option<Arc<Clip>>,
    /// Each avatar frame's restore mask, once made (shared by the avatar's copies).
    pub restore_masks: Arc<RestoreMasks>,
    /// Each avatar frame's landmarks as a detector found them, once it has run (see
    /// [`Avatar::detect_landmarks`]); the client's take precedence.
    pub detected_landmarks: Arc<super::landmarks::Detected>,
}

impl Avatar {
    /// Decodes the photo, finds the face (or checks `explicit`, used exactly as given, in the
    /// photo's own pixels), applies `pads` to a detected box, downscales a photo larger than
    /// `limits.max_side` (the box with it) and prepares the crop and mask.
    pub fn prepare(
        bytes: &[u8],
        limits: &ImageLimits,
        explicit: Option<FaceBox>,
        pads: Pads,
        blend: Blend,
    ) -> Result<Avatar, Error> {
        let photo = image::decode(bytes, limits.max_pixels)?;
        let source_size = (photo.width, photo.height);
        let (source_face, detection) = match explicit {
            Some(b) => {
                b.check(photo.width, photo.height)?;
                (b, None)
            }
            None => {
                let d = face::detect(&photo)?;
                (pads.apply(d.face, photo.width, photo.height)?, Some(d))
            }
        };
        let frame = image::downscale_to(photo, limits.max_side);
        let face = scale_box(source_face, source_size, (frame.width, frame.height));
        Ok(Avatar::from_parts(
            frame,
            face,
            source_face,
            source_size,
            detection,
            blend,
        ))
    }

    /// An avatar from an already decoded frame and a box in its pixels.
    pub fn from_frame(frame: Frame, face: FaceBox, blend: Blend) -> Avatar {
        let size = (frame.width, frame.height);
        Avatar::from_parts(frame, face, face, size, None, blend)
    }

    /// A clip avatar from its first frame (output pixels), that frame's box in the clip's own
    /// pixels, and the prepared clip.
    pub(super) fn from_clip(
        frame: Frame,
        source_face: FaceBox,
        source_size: (u32, u32),
        detection: Option<Detection>,
        blend: Blend,
        clip: Arc<Clip>,
    ) -> Avatar {
        let face = clip.face(0);
        let mut a = Avatar::from_parts(frame, face, source_face, source_size, detection, blend);
        a.clip = Some(clip);
        a
    }

    /// The avatar with the client's landmarks (in the upload's own pixels), checked against
    /// its size.
    pub fn with_landmarks(mut self, l: Landmarks) -> Result<Avatar, Error> {
        l.check(self.source_size.0, self.source_size.1)?;
        self.given_landmarks = Some(l);
        self.restore_masks = Arc::default();
        self.detected_landmarks = Arc::default();
        Ok(self)
    }

    /// Runs a landmark detector on every avatar frame, around its box (see
    /// [`super::landmarks`]), once: an avatar with the client's landmarks, or whose
    /// detection has run, is left as it is. Frames restored before keep nothing stale: the
    /// restore masks are made again from the new landmarks.
    pub fn detect_landmarks(&self, net: &RetinaFace) -> Result<(), super::Error> {
        if self.given_landmarks.is_some() {
            return Ok(());
        }
        let stored = self
            .detected_landmarks
            .run_once(|| super::landmarks::detect(self, net))?;
        if stored {
            self.restore_masks
                .0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clear();
        }
        Ok(())
    }

    /// The detected landmarks, when a detector has run and found a face.
    fn detected(&self) -> Option<&[Landmarks]> {
        self.detected_landmarks.get().and_then(|d| d.as_deref())
    }

    /// Where the landmarks come from.
    pub fn landmarks_source(&self) -> LandmarkSource {
        match (self.given_landmarks, self.detected()) {
            (Some(_), _) => LandmarkSource::Client,
            (None, Some(_)) => LandmarkSource::RetinaFace,
            (None, None) => LandmarkSource::Box,
        }
    }

    /// The first frame's landmarks in the upload's own pixels (what the avatar JSON reports,
    /// beside `box`).
    pub fn source_landmarks(&self) -> Landmarks {
        match (self.given_landmarks, self.detected()) {
            (Some(l), _) => l,
            (None, Some(d)) => d[0].scale((self.frame.width, self.frame.height), self.source_size),
            (None, None) => Landmarks::from_box(self.source_face),
        }
    }

    /// Avatar frame `i`'s landmarks in the video's pixels. A clip's client landmarks are its
    /// first frame's: on later frames they follow the face box (the same place in it).
    pub fn landmarks_at(&self, i: usize) -> Landmarks {
        match (self.given_landmarks, self.detected()) {
            (Some(l), _) => {
                let l = l.scale(self.source_size, (self.frame.width, self.frame.height));
                let (from, to) = (self.face_at(0), self.face_at(i));
                if from == to {
                    return l;
                }
                let sx = f64::from(to.width()) / f64::from(from.width());
                let sy = f64::from(to.height()) / f64::from(from.height());
                Landmarks(l.0.map(|[x, y]| {
                    [
                        f64::from(to.x1) + (x - f64::from(from.x1)) * sx,
                        f64::from(to.y1) + (y - f64::from(from.y1)) * sy,
                    ]
                }))
            }
            (None, Some(d)) => d[i.min(d.len() - 1)],
            (None, None) => Landmarks::from_box(self.face_at(i)),
        }
    }

    /// `image` or `video`.
    pub fn kind(&self) -> &'static str {
        if self.clip.is_some() {
            "video"
        } else {
            "image"
        }
    }

    /// Frames of the avatar: 1 for a photo.
    pub fn frame_count(&self) -> usize {
        self.clip.as_ref().map_or(1, |c| c.len())
    }

    /// A clip's own frame rate (`None` for a photo, whose rate the request chooses).
    pub fn fps(&self) -> Option<Fps> {
        self.clip.as_ref().map(|c| c.fps)
    }

    /// The avatar frame that model frame `k` is drawn on.
    pub fn select(&self, k: usize, mode: Loop) -> usize {
        mode.select(k, self.frame_count())
    }

    /// Avatar frame `i`'s face box.
    pub fn face_at(&self, i: usize) -> FaceBox {
        self.clip.as_ref().map_or(self.face, |c| c.face(i))
    }

    /// Pastes a predicted face (96×96 BGR) into `frame` at avatar frame `i`'s face box, with
    /// the avatar's blend mask, or one from `masks` for a box of another size. `frame` is
    /// the part of the avatar frame whose top left corner is at `origin` (the whole frame:
    /// `(0, 0)`); it must hold the part of the box the mask weighs ([`Self::face_region`]).
    pub fn paste_at(
        &self,
        frame: &mut Frame,
        origin: (u32, u32),
        i: usize,
        face_bgr: &[u8],
        masks: &mut BlendMasks,
    ) {
        let b = self.face_at(i);
        let mask = self.mask_for(&b, masks);
        face::paste_into(frame, origin, &b, face_bgr, mask);
    }

    /// Draws a frame's answer on avatar frame `i` (`frame` is its part at `origin`, see
    /// [`Avatar::paste_at`]): the restored region when the face was restored on this frame,
    /// else the face pasted (a held frame shown on another clip frame takes the face alone,
    /// not the other frame's pixels around it).
    pub fn draw_at(
        &self,
        frame: &mut Frame,
        origin: (u32, u32),
        i: usize,
        drawn: &super::scheduler::Drawn,
        masks: &mut BlendMasks,
    ) {
        match &drawn.restored {
            Some(patch) if patch.frame == i => patch.write_into(frame, origin),
            _ => self.paste_at(frame, origin, i, &drawn.face, masks),
        }
    }

    /// The blend mask of box `b` (the avatar's own, or one made for a clip box of another
    /// size).
    fn mask_for<'m>(&'m self, b: &FaceBox, masks: &'m mut BlendMasks) -> &'m BlendMask {
        if (b.width(), b.height()) == (self.face.width(), self.face.height()) {
            &self.mask
        } else {
            masks
                .0
                .entry((b.width(), b.height()))
                .or_insert_with(|| BlendMask::new(self.blend, b.width(), b.height()))
        }
    }

    /// The even-aligned region around the part of avatar frame `i`'s face box that its
    /// blend mask weighs: all that a pasted face changes (see [`crate::media::yuv`]).
    pub fn face_region(&self, i: usize, masks: &mut BlendMasks) -> Region {
        let b = self.face_at(i);
        let (cols, rows) = self.mask_for(&b, masks).support();
        if cols.is_empty() || rows.is_empty() {
            // Nothing changes; the whole box, as any region holds that.
            return Region::around(b.x1, b.y1, b.x2, b.y2, self.frame.width, self.frame.height);
        }
        Region::around(
            b.x1 + cols.start as u32,
            b.y1 + rows.start as u32,
            b.x1 + cols.end as u32,
            b.y1 + rows.end as u32,
            self.frame.width,
            self.frame.height,
        )
    }

    /// What restoring a face on avatar frame `i` needs (the alignment of its landmarks to the
    /// template and the lower-face mask), made once per frame; `None` when its landmarks give
    /// no usable alignment.
    pub fn restore_mask(&self, i: usize) -> Option<Arc<RestoreMask>> {
        let made = || {
            self.restore_masks
                .0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
        };
        let l = {
            let made = made();
            if let Some(m) = made.get(&i) {
                return m.clone();
            }
            self.landmarks_at(i)
        };
        // Made outside the lock: the enhancer instances restore other frames meanwhile.
        let m = RestoreMask::new(&l, self.frame.width, self.frame.height).map(Arc::new);
        let mut made = made();
        // Landmarks found by a detection meanwhile (which cleared the masks): not kept.
        if self.landmarks_at(i) != l {
            return m;
        }
        if made.len() >= MAX_RESTORE_MASKS {
            made.clear();
        }
        made.insert(i, m.clone());
        m
    }

    /// The even-aligned region of avatar frame `i` that a drawn frame changes: the face box's
    /// ([`Avatar::face_region`]), and with face restoration (`restoring`) also what the
    /// restore mask reaches.
    pub fn drawn_region(&self, i: usize, restoring: bool) -> Region {
        let b = self.face_at(i);
        let (mut x1, mut y1, mut x2, mut y2) = (b.x1, b.y1, b.x2, b.y2);
        if let Some(m) = restoring.then(|| self.restore_mask(i)).flatten() {
            let (left, top, w, h) = m.region();
            (x1, y1) = (x1.min(left), y1.min(top));
            (x2, y2) = (x2.max(left + w), y2.max(top + h));
        }
        Region::around(x1, y1, x2, y2, self.frame.width, self.frame.height)
    }

    /// Avatar frame `i`'s 96×96 BGR crop.
    pub fn crop_bgr(&self, i: usize) -> &[u8] {
        match &self.clip {
            Some(c) => c.crop_bgr(i),
            None => &self.crop_bgr,
        }
    }

    /// Avatar frame `i`'s crop, shared (what a frame's work carries to the model).
    pub fn crop(&self, i: usize) -> Arc<Vec<u8>> {
        match &self.clip {
            Some(c) => c.crop(i),
            None => self.crop_bgr.clone(),
        }
    }

    /// The crop of each model frame `k` of a request (the clip frame `mode` selects).
    pub fn crops(&self, mode: Loop) -> impl Fn(usize) -> Arc<Vec<u8>> + '_ {
        move |k| self.crop(self.select(k, mode))
    }

    /// Avatar frame `i` as it appears in the video.
    pub fn background(&self, i: usize) -> Result<Cow<'_, Frame>, Error> {
        self.picture(i).decoded()
    }

    /// Avatar frame `i` as it appears in the video, not yet decoded: a video avatar's frames
    /// (but the first, which the avatar keeps decoded) as it stores them.
    pub fn picture(&self, i: usize) -> Picture<'_> {
        match self.stored_jpeg(i) {
            Some(j) => Picture::StoredJpeg(j),
            None => Picture::Image(&self.frame),
        }
    }

    /// Whether a video avatar's frames are stored in restart segments
    /// ([`crate::media::jpeg`]; one per MCU row or narrower): a clip stored by an earlier
    /// version is not, and a live JPEG session encodes its frames whole.
    pub fn stored_by_segments(&self) -> bool {
        self.stored_segments_per_row().is_some()
    }

    /// The segments in a row of MCUs of a video avatar's stored frames (1: a restart per row,
    /// as clips stored before segments were cut narrower have), or `None` (a photo, or a clip
    /// stored as whole JPEGs).
    pub fn stored_segments_per_row(&self) -> Option<u32> {
        let c = self.clip.as_ref().filter(|c| !c.is_empty())?;
        crate::media::jpeg::Segments::parse(c.jpeg(0)).map(|s| s.per_row())
    }

    /// A video avatar's frame `i` as it stores it (JPEG); `None` for a photo, and for a
    /// clip's first frame, which the avatar keeps decoded as it came.
    pub fn stored_jpeg(&self, i: usize) -> Option<&[u8]> {
        self.clip.as_ref().filter(|_| i > 0).map(|c| c.jpeg(i))
    }

    /// The same avatar with another blend mode (a new mask; the rest is shared data copied).
    pub fn with_blend(&self, blend: Blend) -> Avatar {
        let mut a = self.clone();
        a.mask = BlendMask::new(blend, a.face.width(), a.face.height());
        a.blend = blend;
        a
    }

    /// An avatar from its decoded frame, boxes and detection: the crop, the model input and
    /// the mask are derived (deterministically) here.
    pub(super) fn from_parts(
        frame: Frame,
        face: FaceBox,
        source_face: FaceBox,
        source_size: (u32, u32),
        detection: Option<Detection>,
        blend: Blend,
    ) -> Avatar {
        let crop_bgr = Arc::new(face::crop_bgr(&frame, &face));
        let input = face::model_input(&crop_bgr);
        let mask = BlendMask::new(blend, face.width(), face.height());
        Avatar {
            frame,
            face,
            source_face,
            source_size,
            detection,
            given_landmarks: None,
            crop_bgr,
            input,
            mask,
            blend,
            clip: None,
            restore_masks: Arc::default(),
            detected_landmarks: Arc::default(),
        }
    }

    /// Approximate memory held, for cache accounting.
    pub fn bytes(&self) -> usize {
        self.clip.as_ref().map_or(0, |c| c.bytes())
            + self.frame.rgb.len()
            + self.crop_bgr.len()
            + self.input.len() * 4
            + (self.face.width() * self.face.height()) as usize * 2
    }
}

/// A box in a `from`-sized image mapped into a `to`-sized copy (identity when equal).
pub(super) fn scale_box(b: FaceBox, from: (u32, u32), to: (u32, u32)) -> FaceBox {
    if from == to {
        return b;
    }
    let sx = f64::from(to.0) / f64::from(from.0);
    let sy = f64::from(to.1) / f64::from(from.1);
    let lo = |v: u32, s: f64, hi: u32| ((f64::from(v) * s).floor() as u32).min(hi - 1);
    let hi = |v: u32, s: f64, hi: u32| ((f64::from(v) * s).ceil() as u32).min(hi);
    let x1 = lo(b.x1, sx, to.0);
    let y1 = lo(b.y1, sy, to.1);
    FaceBox {
        x1,
        y1,
        x2: hi(b.x2, sx, to.0).max(x1 + 1),
        y2: hi(b.y2, sy, to.1).max(y1 + 1),
    }
}

/// A frame's pixels: decoded, or a video avatar's frame as the avatar stores it (a JPEG in
/// restart segments, 4:2:0, at the quality it was stored with: see [`crate::media::jpeg`]).
/// What takes a picture decodes it only if it needs the pixels: a live session's JPEG output
/// sends a stored frame as it is, and encodes only the segments a face changed on one.
#[derive(Debug, Clone)]
pub enum Picture<'a> {
    Image(&'a Frame),
    StoredJpeg(&'a [u8]),
    /// A stored frame with a face drawn on it, decoded only in the segments the face changed:
    /// `part` is the frame's pixels at `at` (whole segments, see
    /// [`crate::media::jpeg::Segments::decode_region`]), the rest is `stored` as it is. Only
    /// for a sink that takes stored frames ([`super::session::Sink::takes_stored_jpeg`]).
    Part {
        part: &'a Frame,
        at: (u32, u32),
        stored: &'a [u8],
    },
}

impl<'a> Picture<'a> {
    /// The pixels (a stored frame decoded).
    pub fn decoded(self) -> Result<Cow<'a, Frame>, Error> {
        let decode = |j: &[u8]| image::decode_jpeg(std::io::Cursor::new(j));
        match self {
            Picture::Image(f) => Ok(Cow::Borrowed(f)),
            Picture::StoredJpeg(j) => Ok(Cow::Owned(decode(j)?)),
            Picture::Part { part, at, stored } => {
                let mut f = decode(stored)?;
                if at.0 + part.width > f.width || at.1 + part.height > f.height {
                    return Err(Error::Internal("a part outside its frame".into()));
                }
                let (stride, across) = (f.width as usize * 3, part.width as usize * 3);
                for (y, row) in part.rgb.chunks_exact(across.max(1)).enumerate() {
                    let from = (at.1 as usize + y) * stride + at.0 as usize * 3;
                    f.rgb[from..from + across].copy_from_slice(row);
                }
                Ok(Cow::Owned(f))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxes_follow_a_downscale() {
        let b = FaceBox {
            x1: 1000,
            y1: 500,
            x2: 1500,
            y2: 1201,
        };
        let s = scale_box(b, (4000, 3000), (1920, 1440));
        assert_eq!(
            s,
            FaceBox {
                x1: 480,
                y1: 240,
                x2: 720,
                y2: 577
            }
        );
        assert_eq!(scale_box(b, (4000, 3000), (4000, 3000)), b);
    }
}
