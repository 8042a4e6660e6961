//! Clip avatars: a short video of the person, prepared once. Per frame only what a request
//! needs is kept: the face box, the 96×96 crop the model sees (from the decoded frame, before
//! any recompression) and the frame itself as a high-quality JPEG (random access, about a
//! tenth of the raw size); the model input and the blend mask are derived when used.
//!
//! Preparing: with an explicit box, one decoding pass makes the crops. Without one, a first
//! pass detects the face in every frame (frames without a face take the nearest detected box;
//! a clip with none is refused), pads and smooths the boxes (inference.py's
//! `get_smoothened_boxes`, once over the whole clip), and a second pass makes the crops.

use std::io::Cursor;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};

use crate::media::audio::Fps;
use crate::media::face::{self, Blend, Detection, FaceBox, Pads, SMOOTH_WINDOW};
use crate::media::image::{self, Frame};
use crate::media::video::clip::{ClipFile, ClipLimits};
use crate::media::Error;

use super::avatar::{scale_box, Avatar};

/// JPEG qualities tried for a stored clip frame (4:2:0), best first: the first whose JPEG fits
/// [`JPEG_BYTES_PER_PIXEL`] is kept (measured in docs/BENCHMARKS.md).
pub const JPEG_QUALITIES: &[u8] = &[95, 90, 80, 70, 60, 50];

/// The most bytes per pixel a stored frame may take unless even the lowest quality is larger.
/// 0.2 keeps a 10 s 1280×720 clip at 25 fps (with its crops) under 64 MB.
pub const JPEG_BYTES_PER_PIXEL: f64 = 0.2;

/// How a clip is repeated when the speech is longer than it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Loop {
    /// Forwards, then backwards, without repeating the end frames.
    #[default]
    PingPong,
    /// From the start again (inference.py).
    Repeat,
}

impl Loop {
    pub const NAMES: &'static [&'static str] = &["pingpong", "repeat"];

    /// The clip frame (of `n`) that model frame `k` is drawn on.
    pub fn select(self, k: usize, n: usize) -> usize {
        if n <= 1 {
            return 0;
        }
        match self {
            Loop::Repeat => k % n,
            Loop::PingPong => {
                let p = k % (2 * n - 2);
                if p < n {
                    p
                } else {
                    2 * n - 2 - p
                }
            }
        }
    }
}

impl FromStr for Loop {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim() {
            "pingpong" => Ok(Loop::PingPong),
            "repeat" => Ok(Loop::Repeat),
            other => Err(Error::BadLoop(format!(
                "unknown loop mode {other:?}; use pingpong or repeat"
            ))),
        }
    }
}

impl std::fmt::Display for Loop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Loop::PingPong => "pingpong",
            Loop::Repeat => "repeat",
        })
    }
}

/// How to prepare a clip.
#[derive(Debug, Clone)]
pub struct ClipOptions {
    pub ffmpeg: PathBuf,
    pub limits: ClipLimits,
    /// Longest side of the output video (larger frames are downscaled, as photos are).
    pub max_side: u32,
    /// Temporal box smoothing (detected boxes only).
    pub smooth: bool,
}

/// One prepared clip frame.
#[derive(Clone)]
struct ClipFrame {
    face: FaceBox,
    crop_bgr: Arc<Vec<u8>>,
    jpeg: Vec<u8>,
}

/// A prepared clip.
#[derive(Clone)]
pub struct Clip {
    pub fps: Fps,
    /// Seconds (frames / fps).
    pub duration: f64,
    pub width: u32,
    pub height: u32,
    frames: Vec<ClipFrame>,
}

impl std::fmt::Debug for Clip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Clip({} frames of {}x{} at {} fps)",
            self.frames.len(),
            self.width,
            self.height,
            self.fps
        )
    }
}

impl Clip {
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Frame `i`'s face box (output pixels).
    pub fn face(&self, i: usize) -> FaceBox {
        self.frames[i].face
    }

    /// Frame `i`'s 96×96 BGR crop.
    pub fn crop_bgr(&self, i: usize) -> &[u8] {
        &self.frames[i].crop_bgr
    }

    /// Frame `i`'s crop, shared.
    pub fn crop(&self, i: usize) -> Arc<Vec<u8>> {
        self.frames[i].crop_bgr.clone()
    }

    /// Frame `i` decoded.
    pub fn frame(&self, i: usize) -> Result<Frame, Error> {
        decode_jpeg(&self.frames[i].jpeg)
    }

    /// Memory held.
    pub fn bytes(&self) -> usize {
        self.frames
            .iter()
            .map(|f| f.jpeg.len() + f.crop_bgr.len() + std::mem::size_of::<ClipFrame>())
            .sum()
    }

    /// Bytes of the stored JPEG frames alone.
    pub fn jpeg_bytes(&self) -> usize {
        self.frames.iter().map(|f| f.jpeg.len()).sum()
    }

    /// Frame `i`'s stored JPEG (what the avatar directory writes).
    pub(super) fn jpeg(&self, i: usize) -> &[u8] {
        &self.frames[i].jpeg
    }

    /// A clip from its stored parts: per frame the box (output pixels), the 96×96 BGR crop
    /// and the JPEG (the avatar directory reads them back).
    pub(super) fn from_stored(
        fps: Fps,
        duration: f64,
        (width, height): (u32, u32),
        frames: Vec<(FaceBox, Vec<u8>, Vec<u8>)>,
    ) -> Clip {
        let frames = frames
            .into_iter()
            .map(|(face, crop_bgr, jpeg)| ClipFrame {
                face,
                crop_bgr: Arc::new(crop_bgr),
                jpeg,
            })
            .collect();
        Clip {
            fps,
            duration,
            width,
            height,
            frames,
        }
    }
}

/// The frame as a JPEG at the best quality within the size budget, 4:2:0, in restart segments
/// (so a live JPEG session re-encodes only the segments a face changes: see
/// [`crate::media::jpeg`]).
fn encode_jpeg(frame: &Frame) -> Result<Vec<u8>, Error> {
    let budget = (f64::from(frame.width) * f64::from(frame.height) * JPEG_BYTES_PER_PIXEL) as usize;
    let mut out = Vec::with_capacity(budget);
    for &q in JPEG_QUALITIES {
        out.clear();
        crate::media::jpeg::encode_segmented(frame, q, &mut out)?;
        if out.len() <= budget {
            break;
        }
    }
    Ok(out)
}

fn decode_jpeg(bytes: &[u8]) -> Result<Frame, Error> {
    image::decode_jpeg(Cursor::new(bytes))
}

/// Decodes every frame of `clip` and runs `work` on each, on as many threads as there are
/// cores (up to 8) while decoding goes on; the results in frame order. The first error stops
/// decoding and is returned.
fn per_frame<T: Send>(
    clip: &ClipFile,
    work: impl Fn(usize, Frame) -> Result<T, Error> + Sync,
) -> Result<Vec<T>, Error> {
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    let failed = AtomicBool::new(false);
    let (tx, rx) = mpsc::sync_channel::<(usize, Frame)>(workers * 2);
    let rx = Mutex::new(rx);
    let (done_tx, done_rx) = mpsc::channel::<(usize, Result<T, Error>)>();
    let decoded = std::thread::scope(|scope| {
        for _ in 0..workers {
            let done_tx = done_tx.clone();
            let (rx, work, failed) = (&rx, &work, &failed);
            scope.spawn(move || loop {
                let next = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                let Ok((i, frame)) = next else { break };
                let r = work(i, frame);
                if r.is_err() {
                    failed.store(true, Ordering::SeqCst);
                }
                if done_tx.send((i, r)).is_err() {
                    break;
                }
            });
        }
        drop(done_tx);
        let decoded = clip.decode(&mut |i, frame| {
            if failed.load(Ordering::SeqCst) {
                // The worker's error is reported below.
                return Err(Error::Internal("stopped".into()));
            }
            tx.send((i, frame))
                .map_err(|_| Error::Internal("clip workers stopped".into()))
        });
        drop(tx);
        decoded
    });
    let mut results: Vec<(usize, Result<T, Error>)> = done_rx.into_iter().collect();
    results.sort_by_key(|(i, _)| *i);
    let mut out = Vec::with_capacity(results.len());
    for (_, r) in results {
        out.push(r?);
    }
    let n = decoded?;
    if out.len() != n {
        return Err(Error::Internal(format!(
            "{} of {n} clip frames were prepared",
            out.len()
        )));
    }
    Ok(out)
}

/// The detected (padded, smoothed) boxes of every frame, in the clip's own pixels, and the
/// first frame's detection.
fn detect_boxes(
    clip: &ClipFile,
    pads: Pads,
    smooth: bool,
) -> Result<(Vec<FaceBox>, Option<Detection>), Error> {
    let found = per_frame(clip, |_, frame| match face::detect(&frame) {
        Ok(d) => Ok(Some((pads.apply(d.face, frame.width, frame.height)?, d))),
        Err(Error::NoFace(_)) => Ok(None),
        Err(e) => Err(e),
    })?;
    let first = found[0].map(|(_, d)| d);
    let found: Vec<Option<FaceBox>> = found.iter().map(|f| f.map(|(b, _)| b)).collect();
    let mut boxes = face::fill_missing(&found).ok_or_else(|| {
        Error::NoFace(format!(
            "no face was found in any of the clip's {} frames; give the face box (`box`)",
            found.len()
        ))
    })?;
    if smooth {
        face::smooth_boxes(&mut boxes, SMOOTH_WINDOW);
    }
    Ok((boxes, first))
}

/// Prepares a clip avatar: decodes `bytes`, finds the face in every frame (or uses
/// `explicit`, exactly, on every frame, in the clip's own pixels), and keeps per frame the
/// box, the crop and a JPEG of the (downscaled) frame.
pub fn prepare(
    bytes: &[u8],
    options: &ClipOptions,
    explicit: Option<FaceBox>,
    pads: Pads,
    blend: Blend,
) -> Result<Avatar, Error> {
    let file = ClipFile::open(bytes, &options.ffmpeg, options.limits.clone())?;
    let (source_boxes, detection) = match explicit {
        Some(_) => (Vec::new(), None),
        None => detect_boxes(&file, pads, options.smooth)?,
    };
    let source_size = OnceLock::new();
    let first = Mutex::new(None);
    let frames = per_frame(&file, |i, source| {
        let (sw, sh) = (source.width, source.height);
        let &(w, h) = source_size.get_or_init(|| (sw, sh));
        if (w, h) != (sw, sh) {
            return Err(Error::DamagedVideo(format!(
                "frame {i} is {sw}x{sh}, another frame {w}x{h}; the size must not change"
            )));
        }
        let source_face = match explicit {
            Some(b) => {
                b.check(sw, sh)?;
                b
            }
            None => *source_boxes.get(i).ok_or_else(|| {
                Error::DamagedVideo("the clip decoded to more frames the second time".into())
            })?,
        };
        let frame = image::downscale_to(source, options.max_side);
        let face = scale_box(source_face, (sw, sh), (frame.width, frame.height));
        let crop_bgr = Arc::new(face::crop_bgr(&frame, &face));
        let jpeg = encode_jpeg(&frame)?;
        if i == 0 {
            *first.lock().unwrap_or_else(|p| p.into_inner()) = Some((frame, source_face));
        }
        Ok(ClipFrame {
            face,
            crop_bgr,
            jpeg,
        })
    })?;
    if explicit.is_none() && frames.len() != source_boxes.len() {
        return Err(Error::DamagedVideo(format!(
            "the clip decoded to {} frames, then to {}",
            source_boxes.len(),
            frames.len()
        )));
    }
    let (frame, source_face) = first
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .expect("decode returns at least one frame");
    let source_size = *source_size.get().expect("at least one frame");
    let fps = file.info.fps;
    let clip = Clip {
        fps,
        duration: frames.len() as f64 / fps.value(),
        width: frame.width,
        height: frame.height,
        frames,
    };
    Ok(Avatar::from_clip(
        frame,
        source_face,
        source_size,
        detection,
        blend,
        Arc::new(clip),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loops_select_frames_as_documented() {
        let seq = |mode: Loop, n: usize| (0..10).map(|k| mode.select(k, n)).collect::<Vec<_>>();
        assert_eq!(seq(Loop::Repeat, 4), [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]);
        assert_eq!(seq(Loop::PingPong, 4), [0, 1, 2, 3, 2, 1, 0, 1, 2, 3]);
        assert_eq!(seq(Loop::PingPong, 2), [0, 1, 0, 1, 0, 1, 0, 1, 0, 1]);
        assert_eq!(seq(Loop::PingPong, 1), [0; 10]);
        assert_eq!(seq(Loop::Repeat, 1), [0; 10]);
        // A clip longer than the speech is simply cut.
        assert_eq!(seq(Loop::PingPong, 100), (0..10).collect::<Vec<_>>());
        assert_eq!("repeat".parse::<Loop>().unwrap(), Loop::Repeat);
        assert_eq!("loop".parse::<Loop>().unwrap_err().kind(), "bad_loop");
        assert_eq!(Loop::default().to_string(), "pingpong");
    }
}
