//! Face restoration's frame side: the face cut out aligned to the FFHQ 512 template, and the
//! restored face put back into the frame through a feathered lower-face mask, so that the
//! eyes and the rest of the photo stay exactly as they were.
//!
//! Everything that depends only on the avatar frame is made once, in [`RestoreMask::new`]:
//! the similarity from the frame's landmarks to the template, the region of the frame the
//! mask reaches, and the mask's weights there (the mask's formula evaluated at each frame
//! pixel's position in the template). Per generated frame there remain the warp to the template
//! ([`RestoreMask::aligned`]) and the warp back with the blend ([`RestoreMask::blend_back`]),
//! both in OpenCV's `warpAffine` arithmetic ([`super::align`]).
//!
//! The mask, in template pixels: an ellipse around the mouth and jaw, centre (256, 370), radii
//! 130 × 96 (from below the nose's bridge, y 274, to the chin, y 466), 1 inside, falling
//! linearly to 0 over the outer quarter of its radius. The template's eyes (y ≈ 240) are
//! outside it.

use super::align::{self, Affine, FFHQ_BORDER};
use super::Landmarks;
use crate::media::image::Frame;

/// The template's side.
pub const SIDE: u32 = 512;
const CENTRE: (f32, f32) = (256.0, 370.0);
const RADII: (f32, f32) = (130.0, 96.0);
/// The part of the radius over which the mask falls from 1 to 0.
const FEATHER: f32 = 0.25;

/// The lower-face mask at template pixel `(x, y)` (pixel centres at integers, as the warp
/// samples them).
pub fn template_mask(x: f32, y: f32) -> f32 {
    let dx = (x - CENTRE.0) / RADII.0;
    let dy = (y - CENTRE.1) / RADII.1;
    let r = (dx * dx + dy * dy).sqrt();
    ((1.0 - r) / FEATHER).clamp(0.0, 1.0)
}

/// What restoring one avatar frame's face needs, made once per avatar frame.
#[derive(Debug, Clone)]
pub struct RestoreMask {
    /// Frame → template.
    to_template: Affine,
    /// The frame region the mask reaches: left, top, width, height.
    region: (u32, u32, u32, u32),
    /// The mask's weight at each pixel of `region`, row-major.
    weights: Vec<f32>,
}

impl RestoreMask {
    /// For a `width × height` frame whose face has landmarks `l`; `None` when the landmarks
    /// give no usable similarity or the mask falls outside the frame.
    pub fn new(l: &Landmarks, width: u32, height: u32) -> Option<RestoreMask> {
        let (to_template, (left, top, w, h)) = placement(l, width, height)?;
        let [[a, b, c], [d, e, f]] = to_template.0;
        let weights = (0..h)
            .flat_map(|y| (0..w).map(move |x| (x, y)))
            .map(|(x, y)| {
                let (fx, fy) = (f64::from(left + x), f64::from(top + y));
                template_mask((a * fx + b * fy + c) as f32, (d * fx + e * fy + f) as f32)
            })
            .collect();
        Some(RestoreMask {
            to_template,
            region: (left, top, w, h),
            weights,
        })
    }

    /// Whether landmarks `l` give a usable mask in a `width × height` frame (what
    /// [`RestoreMask::new`] needs), without making its weights.
    pub fn fits(l: &Landmarks, width: u32, height: u32) -> bool {
        placement(l, width, height).is_some()
    }

    /// The frame region the restored face can change: left, top, width, height.
    pub fn region(&self) -> (u32, u32, u32, u32) {
        self.region
    }

    /// The frame's face aligned to the 512×512 template (facexlib's border colour outside
    /// the frame): what the restoration network takes.
    pub fn aligned(&self, frame: &Frame) -> Frame {
        align::warp_affine(frame, &self.to_template, SIDE, SIDE, FFHQ_BORDER)
            .expect("an invertible similarity")
    }

    /// The restored 512×512 face warped back into `frame` and blended through the mask:
    /// `round(frame · (1 − m) + restored · m)`; pixels where the mask is 0 are left as they
    /// were.
    pub fn blend_back(&self, frame: &mut Frame, restored: &Frame) {
        let (left, top, w, h) = self.region;
        let mut back = Frame::new(w, h, vec![0; (w * h * 3) as usize]);
        // warp_rows samples its source through the destination → source map: frame → template.
        align::warp_rows(
            restored,
            &self.to_template,
            &mut back,
            (left, top),
            FFHQ_BORDER,
        );
        let fw = frame.width as usize;
        for y in 0..h as usize {
            for x in 0..w as usize {
                let m = self.weights[y * w as usize + x];
                if m <= 0.0 {
                    continue;
                }
                let at = ((top as usize + y) * fw + left as usize + x) * 3;
                let from = (y * w as usize + x) * 3;
                for ch in 0..3 {
                    let old = f32::from(frame.rgb[at + ch]);
                    let new = f32::from(back.rgb[from + ch]);
                    frame.rgb[at + ch] = (old + m * (new - old)).round().clamp(0.0, 255.0) as u8;
                }
            }
        }
    }
}

/// The similarity from the frame to the template for landmarks `l`, and the frame region the
/// mask reaches (left, top, width, height); `None` when either is empty or degenerate.
fn placement(l: &Landmarks, width: u32, height: u32) -> Option<(Affine, (u32, u32, u32, u32))> {
    let to_template = align::to_ffhq_512(l)?;
    let to_frame = to_template.invert()?;
    // The mask's support is inside the ellipse's bounding box in the template: its
    // corners, mapped into the frame, bound the region.
    let (x0, x1) = (CENTRE.0 - RADII.0, CENTRE.0 + RADII.0);
    let (y0, y1) = (CENTRE.1 - RADII.1, CENTRE.1 + RADII.1);
    let corners = [(x0, y0), (x1, y0), (x0, y1), (x1, y1)]
        .map(|(x, y)| to_frame.apply([f64::from(x), f64::from(y)]));
    let lo = |i: usize| corners.iter().map(|c| c[i]).fold(f64::INFINITY, f64::min);
    let hi = |i: usize| {
        corners
            .iter()
            .map(|c| c[i])
            .fold(f64::NEG_INFINITY, f64::max)
    };
    let clamp = |v: f64, max: u32| v.clamp(0.0, f64::from(max)) as u32;
    let (left, top) = (clamp(lo(0).floor(), width), clamp(lo(1).floor(), height));
    let (right, bottom) = (
        clamp(hi(0).ceil() + 1.0, width),
        clamp(hi(1).ceil() + 1.0, height),
    );
    if right <= left || bottom <= top {
        return None;
    }
    Some((to_template, (left, top, right - left, bottom - top)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_covers_the_mouth_and_chin_and_spares_the_eyes() {
        // Mouth corners and the space between them: fully restored.
        for (x, y) in [(201.3, 371.4), (313.1, 371.2), (256.0, 380.0)] {
            assert_eq!(template_mask(x, y), 1.0, "({x}, {y})");
        }
        // The eyes and everything at their height: untouched.
        for x in (0..512).step_by(8) {
            assert_eq!(template_mask(x as f32, 240.0), 0.0);
        }
        // Feathered: strictly between 0 and 1 near the edge.
        let edge = template_mask(CENTRE.0, CENTRE.1 + 0.9 * RADII.1);
        assert!(edge > 0.0 && edge < 1.0, "{edge}");
    }

    #[test]
    fn restoring_with_the_aligned_face_itself_changes_almost_nothing_and_only_in_the_region() {
        let (w, h) = (200u32, 160u32);
        let rgb: Vec<u8> = (0..w * h * 3)
            .map(|i| ((i / 3 % w) * 255 / w) as u8 ^ ((i / 3 / w) as u8 & 0x20))
            .collect();
        let frame = Frame::new(w, h, rgb);
        let l: Landmarks = "80,60,120,61,100,85,84,104,117,104".parse().unwrap();
        let mask = RestoreMask::new(&l, w, h).unwrap();
        let (left, top, rw, rh) = mask.region();
        assert!(left + rw <= w && top + rh <= h);
        // The eyes' rows are above the region.
        assert!(top > 61, "{:?}", mask.region());
        let aligned = mask.aligned(&frame);
        assert_eq!((aligned.width, aligned.height), (512, 512));
        let mut out = frame.clone();
        mask.blend_back(&mut out, &aligned);
        let mut worst = 0;
        for y in 0..h {
            for x in 0..w {
                let i = ((y * w + x) * 3) as usize;
                let inside = (left..left + rw).contains(&x) && (top..top + rh).contains(&y);
                for c in 0..3 {
                    let d = out.rgb[i + c].abs_diff(frame.rgb[i + c]);
                    if !inside {
                        assert_eq!(d, 0, "({x}, {y}) outside the region changed");
                    }
                    worst = worst.max(d);
                }
            }
        }
        // Two bilinear warps of a pattern with sharp edges blur it a little, no more.
        assert!(worst < 128, "{worst}");
        // A restored face of one colour shows through the mask: the mouth takes it.
        let grey = Frame::new(512, 512, vec![7; 512 * 512 * 3]);
        let mut out = frame.clone();
        mask.blend_back(&mut out, &grey);
        let mouth = ((104 * w + 100) * 3) as usize;
        assert_eq!(&out.rgb[mouth..mouth + 3], &[7, 7, 7]);
        let eye = ((60 * w + 80) * 3) as usize;
        assert_eq!(&out.rgb[eye..eye + 3], &frame.rgb[eye..eye + 3]);
    }
}
