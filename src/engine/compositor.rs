//! Predicted faces, in frame order, to encoded video: each face (optionally saved as a PNG)
//! pasted into the avatar's frame it was drawn on (the photo, or the clip frame the loop mode
//! selects) and handed to the encoder as YUV 4:2:0; at the end the last frame is held until
//! the audio ends. Shared by `lipsync render` and the service.
//!
//! A photo is converted to YUV once; each frame then pastes the face into a copy of the
//! face's region alone and converts that region into the kept frame
//! ([`crate::media::yuv`]). A clip frame is decoded, pasted and converted whole.

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::avatar::BlendMasks;
use super::clip::{Clip, Loop};
use super::scheduler::Drawn;
use super::{Avatar, Error};
use crate::media::face;
use crate::media::image::Frame;
use crate::media::video::VideoEncoder;
use crate::media::yuv::{self, Yuv420};

/// Clip frames decoded ahead of the compositor.
const PREFETCH: usize = 4;

/// Images a render also writes, for checks and for comparing settings: every predicted face
/// (`--faces-dir`) and every composited frame (`--frames-dir`), as `00000.png`, `00001.png`,
/// … in frame order (RGB). The held frames at the end of the audio repeat the last one and
/// are not written again.
#[derive(Debug, Clone, Default)]
pub struct Keep {
    /// Each predicted face: 96×96, or 96·s × 96·s after an enhancer of scale s.
    pub faces: Option<PathBuf>,
    /// Each whole frame as it goes to the encoder (before the conversion to YUV).
    pub frames: Option<PathBuf>,
}

pub struct Compositor<'a> {
    avatar: &'a Avatar,
    mode: Loop,
    /// A clip's frames, decoded ahead on their own thread in the order they are shown.
    prefetched: Option<mpsc::Receiver<Result<Frame, crate::media::Error>>>,
    /// Blend masks of clip boxes whose size differs from the first frame's.
    masks: BlendMasks,
    encoder: &'a mut dyn VideoEncoder,
    keep: Keep,
    /// The frame last written; for a photo, also the photo converted once, whose face
    /// region each frame overwrites.
    last: Option<Yuv420>,
    pub frames: usize,
    pub composite_time: Duration,
    pub encode_time: Duration,
}

impl<'a> Compositor<'a> {
    pub fn new(
        avatar: &'a Avatar,
        mode: Loop,
        encoder: &'a mut dyn VideoEncoder,
        keep: &Keep,
    ) -> Result<Self, Error> {
        for dir in keep.faces.iter().chain(&keep.frames) {
            std::fs::create_dir_all(dir).map_err(|source| Error::Output {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        Ok(Compositor {
            avatar,
            mode,
            prefetched: avatar.clip.clone().and_then(|clip| prefetch(clip, mode)),
            masks: BlendMasks::default(),
            encoder,
            keep: keep.clone(),
            last: None,
            frames: 0,
            composite_time: Duration::ZERO,
            encode_time: Duration::ZERO,
        })
    }

    /// The next frame's predicted face, 96×96 BGR (or larger and square, enhanced), or its
    /// restored region.
    pub fn push(&mut self, drawn: &Drawn) -> Result<(), Error> {
        let t = Instant::now();
        let face_bgr = drawn.face.as_slice();
        if let Some(dir) = &self.keep.faces {
            save_face(dir, self.frames, face_bgr)?;
        }
        let a = self.avatar;
        let i = a.select(self.frames, self.mode);
        // Where this frame differs from the last one written (`None`: anywhere).
        let mut changed = None;
        let first = self.last.is_none();
        let frame = if a.clip.is_some() {
            let mut frame = match self.prefetched.as_ref().map(mpsc::Receiver::recv) {
                Some(Ok(f)) => f?,
                _ => a.background(i)?.into_owned(),
            };
            a.draw_at(&mut frame, (0, 0), i, drawn, &mut self.masks);
            if let Some(dir) = &self.keep.frames {
                save_frame(dir, self.frames, &frame)?;
            }
            yuv::convert_into(&mut self.last, &frame)
        } else if let Some(restored) = &drawn.restored {
            // The region a restored face changed, ready: written as it is.
            if let Some(dir) = &self.keep.frames {
                let mut whole = a.frame.clone();
                restored.write_into(&mut whole, (0, 0));
                save_frame(dir, self.frames, &whole)?;
            }
            let kept = self.last.get_or_insert_with(|| Yuv420::from_rgb(&a.frame));
            let r = restored.region;
            kept.write_rgb(r.x, r.y, &restored.rgb);
            changed = (!first).then_some(r);
            kept
        } else {
            let region = a.face_region(i, &mut self.masks);
            let patch = match &self.keep.frames {
                None => {
                    let mut patch = region.crop(&a.frame);
                    let origin = (region.x, region.y);
                    a.paste_at(&mut patch, origin, i, face_bgr, &mut self.masks);
                    patch
                }
                // Kept whole: the face pasted into the whole photo, its region cut from it.
                Some(dir) => {
                    let mut whole = a.frame.clone();
                    a.paste_at(&mut whole, (0, 0), i, face_bgr, &mut self.masks);
                    save_frame(dir, self.frames, &whole)?;
                    region.crop(&whole)
                }
            };
            let kept = self.last.get_or_insert_with(|| Yuv420::from_rgb(&a.frame));
            kept.write_rgb(region.x, region.y, &patch);
            changed = (!first).then_some(region);
            kept
        };
        self.composite_time += t.elapsed();
        let t = Instant::now();
        self.encoder.write_yuv_changed(frame, changed)?;
        self.encode_time += t.elapsed();
        self.frames += 1;
        Ok(())
    }

    /// Repeats the last frame until the video has `total` frames.
    pub fn hold_until(&mut self, total: usize) -> Result<(), Error> {
        let t = Instant::now();
        if let Some(frame) = &self.last {
            while self.frames < total {
                self.encoder
                    .write_yuv_changed(frame, Some(yuv::Region::EMPTY))?;
                self.frames += 1;
            }
        }
        self.encode_time += t.elapsed();
        Ok(())
    }
}

/// Clip frames decoded ahead, in display order, a few at a time (the thread stops when the
/// receiver is dropped). `None` if no thread can be started: frames are then decoded inline.
fn prefetch(
    clip: Arc<Clip>,
    mode: Loop,
) -> Option<mpsc::Receiver<Result<Frame, crate::media::Error>>> {
    let (tx, rx) = mpsc::sync_channel(PREFETCH);
    std::thread::Builder::new()
        .name("clip-frames".into())
        .spawn(move || {
            for k in 0.. {
                if tx.send(clip.frame(mode.select(k, clip.len()))).is_err() {
                    break;
                }
            }
        })
        .ok()?;
    Some(rx)
}

fn save_frame(dir: &Path, index: usize, frame: &Frame) -> Result<(), Error> {
    let path = dir.join(format!("{index:05}.png"));
    frame
        .save_png(&path)
        .map_err(|source| Error::Output { path, source })
}

fn save_face(dir: &Path, index: usize, bgr: &[u8]) -> Result<(), Error> {
    let mut rgb = bgr.to_vec();
    face::swap_red_blue(&mut rgb);
    let path = dir.join(format!("{index:05}.png"));
    let side = face::face_side(bgr) as u32;
    Frame::new(side, side, rgb)
        .save_png(&path)
        .map_err(|source| Error::Output { path, source })
}
