//! Face restoration in a render (GFPGAN): after the generator's face is pasted, the face is
//! aligned to the restorer's template from the avatar frame's landmarks, restored, warped back
//! and blended into the frame through the lower-face mask ([`crate::media::face::restore`]).
//!
//! It runs on the enhancers' instances ([`super::enhance_pool`]), which take the predicted
//! faces that asked for a restorer as they take those for Real-ESRGAN. What a restored frame
//! gives back is a [`Patch`]: the avatar frame's region that the face and the restoration
//! changed ([`Avatar::drawn_region`]), with the face pasted and restored in it. The compositor
//! (and a live session) writes that region instead of pasting the face, so every door gets the
//! same frames.
//!
//! Everything that depends only on the avatar frame (the similarity, the mask's weights) is
//! made once per avatar frame ([`Avatar::restore_mask`]); per generated frame there remain the
//! paste, the warp to the template, the network and the warp back with the blend.

use std::sync::Arc;

use super::avatar::BlendMasks;
use super::enhance::EnhanceWith;
use super::scheduler::Drawn;
use super::{Avatar, Error};
use crate::media::face;
use crate::media::face::restore::RestoreMask;
use crate::media::image::Frame;
use crate::media::yuv::Region;
use crate::model::enhancer::{self, DeviceNet};

/// Aligned faces run through the network at once: at 512×512 each holds about 0.6 GB of
/// activations at the pass's peak, so a batch is cut into pieces of this.
pub const CHUNK: usize = enhancer::gfpgan::MAX_FACES;

/// Where a frame's face is restored: its avatar and the avatar frame it is drawn on.
#[derive(Debug, Clone)]
pub struct Restore {
    pub avatar: Arc<Avatar>,
    /// The avatar frame ([`Avatar::select`]).
    pub frame: usize,
}

impl Restore {
    /// Where a frame drawn on avatar frame `frame` is restored, when `enhance` is a restorer
    /// (else `None`).
    pub fn when(
        enhance: Option<&EnhanceWith>,
        avatar: &Arc<Avatar>,
        frame: usize,
    ) -> Option<Restore> {
        enhance.filter(|e| e.restores()).map(|_| Restore {
            avatar: avatar.clone(),
            frame,
        })
    }
}

/// Readies `avatar` for restoration by `enhance` (nothing to do for another enhancer): its
/// landmarks found by the restorer's landmark detector when one is loaded and the avatar has
/// none of its own (once: [`Avatar::detect_landmarks`]), and, for a photo, a check that they
/// align the face, so a request that cannot be restored is refused before it starts.
pub fn prepare(avatar: &Avatar, enhance: Option<&EnhanceWith>) -> Result<(), Error> {
    let Some(with) = enhance.filter(|e| e.restores()) else {
        return Ok(());
    };
    if let Some(net) = &with.landmarks {
        avatar.detect_landmarks(net)?;
    }
    let (w, h) = (avatar.frame.width, avatar.frame.height);
    if let Some(i) =
        (0..avatar.frame_count()).find(|&i| !RestoreMask::fits(&avatar.landmarks_at(i), w, h))
    {
        return Err(crate::media::Error::BadLandmarks(format!(
            "the avatar's landmarks ({}) do not align a face to {}'s template{}",
            avatar.landmarks_source().as_str(),
            with.name,
            if avatar.clip.is_some() {
                format!(" on frame {i}")
            } else {
                String::new()
            }
        ))
        .into());
    }
    Ok(())
}

/// A region of an avatar frame as a restored frame shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Patch {
    /// The avatar frame it was restored on.
    pub frame: usize,
    /// Where it is, even-aligned within the frame's coded size (see [`Region`]).
    pub region: Region,
    /// Its pixels, `region.width × region.height` RGB.
    pub rgb: Frame,
}

impl Patch {
    /// Writes the patch into `frame`, the part of the avatar frame whose top left corner is at
    /// `origin` (the whole frame: `(0, 0)`). Pixels outside `frame` (the coded padding of an
    /// odd-sized frame) are left out.
    pub fn write_into(&self, frame: &mut Frame, origin: (u32, u32)) {
        let r = self.region;
        let (fw, fh) = (frame.width as usize, frame.height as usize);
        let x0 = (r.x as usize).saturating_sub(origin.0 as usize);
        let skip = (origin.0 as usize).saturating_sub(r.x as usize);
        let width = (r.width as usize)
            .saturating_sub(skip)
            .min(fw.saturating_sub(x0));
        if width == 0 {
            return;
        }
        for y in 0..r.height as usize {
            let Some(fy) = (r.y as usize + y).checked_sub(origin.1 as usize) else {
                continue;
            };
            if fy >= fh {
                break;
            }
            let from = (y * r.width as usize + skip) * 3;
            let to = (fy * fw + x0) * 3;
            frame.rgb[to..to + width * 3].copy_from_slice(&self.rgb.rgb[from..from + width * 3]);
        }
    }
}

/// Restores a batch of predicted faces with `with` (a restorer: [`EnhanceWith::restores`]):
/// each of `faces` is a prediction, `(3, 96, 96)` planar BGR in [0, 1], and where it is shown.
/// `net` is the weights on the device to run on (`None`: the CPU pass). Returns, per face,
/// the face itself (96×96 BGR) and its restored region, or why that face could not be
/// restored (a face's own failure fails that face alone; the network's fails its chunk).
pub fn run_batch(
    with: &EnhanceWith,
    net: Option<&dyn DeviceNet>,
    faces: &[(&[f32], &Restore)],
) -> Vec<Result<Drawn, String>> {
    let side = with.side();
    let plane = side * side;
    let mut out = Vec::with_capacity(faces.len());
    for chunk in faces.chunks(CHUNK) {
        let mut rgb = Vec::with_capacity(chunk.len() * 3 * plane);
        // Each face pasted into its frame, or why not.
        let pasted: Vec<Result<Pasted, String>> = chunk
            .iter()
            .map(|(pred, at)| {
                let p = paste(with, pred, at)?;
                for c in 0..3 {
                    rgb.extend(
                        p.aligned.rgb[c..]
                            .iter()
                            .step_by(3)
                            .map(|&v| f32::from(v) / 255.0),
                    );
                }
                Ok(p)
            })
            .collect();
        let n = pasted.iter().filter(|p| p.is_ok()).count();
        let restored = match n {
            0 => Ok(Vec::new()),
            _ => match net {
                Some(d) => d.forward(n, side, side, &rgb),
                None => with.net.forward_cpu(n, side, side, &rgb),
            }
            .map_err(|e| e.to_string()),
        };
        let mut k = 0;
        for (p, (_, at)) in pasted.into_iter().zip(chunk) {
            out.push(p.and_then(|mut p| {
                let v = restored.as_ref().map_err(Clone::clone)?;
                let face = Frame::new(
                    side as u32,
                    side as u32,
                    enhancer::planar_to_rgb8(&v[k * 3 * plane..][..3 * plane]),
                );
                k += 1;
                p.mask.blend_back(&mut p.frame, &face);
                let region = at.avatar.drawn_region(at.frame, true);
                Ok(Drawn {
                    face: p.bgr,
                    restored: Some(Arc::new(Patch {
                        frame: at.frame,
                        region,
                        rgb: region.crop(&p.frame),
                    })),
                })
            }));
        }
    }
    out
}

/// A predicted face pasted into its avatar frame, and that frame aligned to the template.
struct Pasted {
    bgr: Vec<u8>,
    frame: Frame,
    mask: Arc<RestoreMask>,
    aligned: Frame,
}

fn paste(with: &EnhanceWith, pred: &[f32], at: &Restore) -> Result<Pasted, String> {
    if pred.len() != 3 * crate::model::arch::FACE_SIZE.pow(2) {
        return Err(format!("a face of {} values", pred.len()));
    }
    let a = &at.avatar;
    let mask = a.restore_mask(at.frame).ok_or_else(|| {
        format!(
            "avatar frame {}: its landmarks give no face to restore",
            at.frame
        )
    })?;
    let bgr = face::prediction_to_bgr(pred);
    let mut frame = a
        .background(at.frame)
        .map_err(|e| e.to_string())?
        .into_owned();
    a.paste_at(
        &mut frame,
        (0, 0),
        at.frame,
        &bgr,
        &mut BlendMasks::default(),
    );
    let aligned = mask.aligned(&frame);
    let side = with.side() as u32;
    if (aligned.width, aligned.height) != (side, side) {
        return Err(format!(
            "{} takes {side}x{side} faces, the template is {}x{}",
            with.name, aligned.width, aligned.height
        ));
    }
    Ok(Pasted {
        bgr,
        frame,
        mask,
        aligned,
    })
}

/// Seconds of CPU that restoring one face takes besides the network, on a `side`×`side`
/// frame whose face fills the template: the warp to the template, the warp back and the
/// blend. What live admission adds to a restorer's measured cost per face.
pub fn warp_seconds(side: usize) -> f64 {
    use crate::media::face::{align::FFHQ_512, Landmarks};
    let s = side as f64 / 512.0;
    let l = Landmarks(FFHQ_512.map(|[x, y]| [x * s, y * s]));
    let frame = Frame::new(side as u32, side as u32, vec![128; 3 * side * side]);
    let Some(mask) = RestoreMask::new(&l, frame.width, frame.height) else {
        return 0.0;
    };
    let t = std::time::Instant::now();
    let aligned = mask.aligned(&frame);
    let mut out = frame.clone();
    mask.blend_back(&mut out, &aligned);
    t.elapsed().as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_patch_is_written_where_it_belongs_and_clipped_to_the_frame() {
        // A 5x3 frame (coded 6x4) and a patch over its right and bottom edges: the padding
        // column and row are left out; written into a part of the frame, it shifts.
        let mut frame = Frame::new(5, 3, vec![0; 5 * 3 * 3]);
        let region = Region {
            x: 2,
            y: 2,
            width: 4,
            height: 2,
        };
        let rgb = Frame::new(4, 2, (1..=24).collect());
        let patch = Patch {
            frame: 0,
            region,
            rgb,
        };
        patch.write_into(&mut frame, (0, 0));
        let px = |f: &Frame, x: usize, y: usize| f.rgb[(y * f.width as usize + x) * 3];
        assert_eq!(px(&frame, 2, 2), 1);
        assert_eq!(px(&frame, 4, 2), 7);
        assert_eq!(px(&frame, 1, 2), 0);
        assert_eq!(px(&frame, 2, 1), 0);
        let mut part = Frame::new(3, 2, vec![0; 3 * 2 * 3]);
        patch.write_into(&mut part, (3, 1));
        // Frame pixel (3, 2) is the part's (0, 1): the patch's column 1, row 0.
        assert_eq!(px(&part, 0, 1), 4);
        assert_eq!(px(&part, 0, 0), 0);
    }

    /// A restorer that gives back the aligned face it is given.
    struct Identity;

    impl crate::model::enhancer::EnhancerNet for Identity {
        fn kind(&self) -> crate::model::enhancer::Kind {
            crate::model::enhancer::Kind::Gfpgan
        }
        fn applies(&self) -> crate::model::enhancer::Applies {
            crate::model::enhancer::Applies::AlignedFace(512)
        }
        fn describe(&self) -> String {
            "identity".into()
        }
        fn scale(&self) -> usize {
            1
        }
        fn check_size(&self, _: usize, _: usize) -> crate::model::Result<()> {
            Ok(())
        }
        fn multiply_adds(&self, _: usize, _: usize) -> f64 {
            0.0
        }
        fn forward_cpu(
            &self,
            _: usize,
            _: usize,
            _: usize,
            rgb: &[f32],
        ) -> crate::model::Result<Vec<f32>> {
            Ok(rgb.to_vec())
        }
        fn on_device(
            &self,
            _: &candle_core::Device,
        ) -> crate::model::Result<Arc<dyn crate::model::enhancer::DeviceNet>> {
            Err(crate::model::Error::Unsupported("none".into()))
        }
    }

    #[test]
    fn each_face_of_a_batch_is_restored_or_fails_on_its_own() {
        use crate::media::face::{Blend, FaceBox};
        let (w, h) = (160u32, 120u32);
        let rgb: Vec<u8> = (0..w * h * 3).map(|i| (i * 7 % 251) as u8).collect();
        let face = FaceBox {
            x1: 50,
            y1: 30,
            x2: 110,
            y2: 96,
        };
        let avatar = Arc::new(Avatar::from_frame(
            Frame::new(w, h, rgb),
            face,
            Blend::Feather,
        ));
        let with = EnhanceWith {
            name: "identity".into(),
            net: Arc::new(Identity),
            on_device: None,
            seconds_per_face: 0.0,
            landmarks: None,
        };
        let at = Restore::when(Some(&with), &avatar, 0).expect("a restorer");
        let pred = vec![0.5f32; 3 * 96 * 96];
        let short = vec![0.5f32; 10];
        let got = run_batch(&with, None, &[(&pred, &at), (&short, &at), (&pred, &at)]);
        assert_eq!(got.len(), 3);
        assert!(
            got[1].as_ref().is_err_and(|e| e.contains("10 values")),
            "{:?}",
            got[1]
        );
        for d in [&got[0], &got[2]] {
            let d = d.as_ref().expect("restored");
            let p = d.restored.as_ref().expect("a patch");
            assert_eq!((p.frame, p.region), (0, avatar.drawn_region(0, true)));
            assert_eq!(
                (p.rgb.width, p.rgb.height),
                (p.region.width, p.region.height)
            );
            // The region holds the face box and reaches beyond it (the mask).
            assert!(p.region.x <= 50 && p.region.x + p.region.width >= 110);
        }
        assert_eq!(got[0], got[2]);
    }
}
