//! The face: where it is (detection, or a box the user pins), the 96×96 crop the model reads,
//! and pasting the predicted mouth back into the photo.
//!
//! Boxes are `x1,y1,x2,y2` in integer pixels with `x2`/`y2` exclusive: the face is columns
//! `x1 .. x2−1` and rows `y1 .. y2−1`.

pub mod align;
mod detect;
mod landmarks;
pub mod restore;

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

pub use detect::{detect, Detection};
pub use landmarks::{LandmarkSource, Landmarks};

use crate::media::image::{resize_linear, resize_linear_window, Frame};
use crate::media::Error;

/// Side of the model's square face input and output.
pub const FACE_SIZE: usize = 96;

/// A face box: columns `x1 .. x2` and rows `y1 .. y2`, end exclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct FaceBox {
    pub x1: u32,
    pub y1: u32,
    pub x2: u32,
    pub y2: u32,
}

impl FaceBox {
    pub fn width(&self) -> u32 {
        self.x2 - self.x1
    }

    pub fn height(&self) -> u32 {
        self.y2 - self.y1
    }

    /// Refuses a box that is empty or leaves a `width × height` image: it must satisfy
    /// `0 ≤ x1 < x2 ≤ width` and `0 ≤ y1 < y2 ≤ height`.
    pub fn check(&self, width: u32, height: u32) -> Result<(), Error> {
        if self.x1 < self.x2 && self.y1 < self.y2 && self.x2 <= width && self.y2 <= height {
            Ok(())
        } else {
            Err(Error::BadBox(format!(
                "box {self} does not fit the {width}x{height} image \
                 (need 0 <= x1 < x2 <= {width} and 0 <= y1 < y2 <= {height})"
            )))
        }
    }

    /// Intersection over union.
    pub fn iou(&self, o: &FaceBox) -> f64 {
        let iw = self.x2.min(o.x2).saturating_sub(self.x1.max(o.x1));
        let ih = self.y2.min(o.y2).saturating_sub(self.y1.max(o.y1));
        let inter = f64::from(iw) * f64::from(ih);
        let area = |b: &FaceBox| f64::from(b.width()) * f64::from(b.height());
        inter / (area(self) + area(o) - inter)
    }

    pub fn to_array(&self) -> [u32; 4] {
        [self.x1, self.y1, self.x2, self.y2]
    }
}

impl fmt::Display for FaceBox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{},{},{},{}", self.x1, self.y1, self.x2, self.y2)
    }
}

/// Four comma-separated integers.
fn four<T: FromStr>(s: &str, what: &str, example: &str) -> Result<[T; 4], String> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    let bad = || format!("{s:?} is not a {what} (four integers, e.g. {example})");
    if parts.len() != 4 {
        return Err(bad());
    }
    let mut out = Vec::with_capacity(4);
    for p in parts {
        out.push(p.parse::<T>().map_err(|_| bad())?);
    }
    out.try_into().map_err(|_| bad())
}

impl FromStr for FaceBox {
    type Err = Error;

    /// `x1,y1,x2,y2`; whether it fits an image is checked by [`FaceBox::check`].
    fn from_str(s: &str) -> Result<Self, Error> {
        let [x1, y1, x2, y2] =
            four::<u32>(s, "box x1,y1,x2,y2", "120,80,280,260").map_err(Error::BadBox)?;
        if x1 >= x2 || y1 >= y2 {
            return Err(Error::BadBox(format!(
                "box {s:?} is empty: need x1 < x2 and y1 < y2"
            )));
        }
        Ok(FaceBox { x1, y1, x2, y2 })
    }
}

/// Pixels added to a detected box: `top,bottom,left,right` (Wav2Lip's `--pads`; negative
/// values shrink the box).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Pads {
    pub top: i32,
    pub bottom: i32,
    pub left: i32,
    pub right: i32,
}

impl Default for Pads {
    /// Wav2Lip's default: 10 pixels below the chin.
    fn default() -> Self {
        Pads {
            top: 0,
            bottom: 10,
            left: 0,
            right: 0,
        }
    }
}

impl fmt::Display for Pads {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{},{},{},{}",
            self.top, self.bottom, self.left, self.right
        )
    }
}

impl FromStr for Pads {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let [top, bottom, left, right] =
            four::<i32>(s, "pads top,bottom,left,right", "0,10,0,0").map_err(Error::BadPads)?;
        if [top, bottom, left, right].iter().any(|p| p.abs() > 100_000) {
            return Err(Error::BadPads(format!("pads {s:?} are implausibly large")));
        }
        Ok(Pads {
            top,
            bottom,
            left,
            right,
        })
    }
}

impl Pads {
    /// The padded box clipped to a `width × height` image (as Wav2Lip does); an error if
    /// negative pads leave nothing.
    pub fn apply(&self, b: FaceBox, width: u32, height: u32) -> Result<FaceBox, Error> {
        let clip = |v: i64, hi: u32| v.clamp(0, i64::from(hi)) as u32;
        let out = FaceBox {
            x1: clip(i64::from(b.x1) - i64::from(self.left), width),
            y1: clip(i64::from(b.y1) - i64::from(self.top), height),
            x2: clip(i64::from(b.x2) + i64::from(self.right), width),
            y2: clip(i64::from(b.y2) + i64::from(self.bottom), height),
        };
        if out.x1 >= out.x2 || out.y1 >= out.y2 {
            return Err(Error::BadPads(format!(
                "pads {self} leave an empty box around {b}"
            )));
        }
        Ok(out)
    }
}

/// The face box to use: `explicit` exactly as given (after checking it fits), else the
/// detected face with `pads` applied.
pub fn locate(frame: &Frame, explicit: Option<FaceBox>, pads: Pads) -> Result<FaceBox, Error> {
    match explicit {
        Some(b) => {
            b.check(frame.width, frame.height)?;
            Ok(b)
        }
        None => pads.apply(detect(frame)?.face, frame.width, frame.height),
    }
}

/// Frames in the temporal box-smoothing window (inference.py's `T = 5`).
pub const SMOOTH_WINDOW: usize = 5;

/// Wav2Lip's `get_smoothened_boxes`: in place and in order, box `i` becomes the mean of boxes
/// `i..i + t`, truncated to integers; where that window runs past the end it is the last `t`
/// boxes (already smoothed ones included). With fewer than `t` boxes the window is the whole
/// clip (a deviation: the original's negative slice there is a quirk).
pub fn smooth_boxes(boxes: &mut [FaceBox], t: usize) {
    let n = boxes.len();
    for i in 0..n {
        let window = &boxes[smoothing_window(i, n, t)];
        let len = window.len() as u64;
        let mean = |f: fn(&FaceBox) -> u32| {
            (window.iter().map(|b| u64::from(f(b))).sum::<u64>() / len) as u32
        };
        boxes[i] = FaceBox {
            x1: mean(|b| b.x1),
            y1: mean(|b| b.y1),
            x2: mean(|b| b.x2),
            y2: mean(|b| b.y2),
        };
    }
}

/// The frames frame `i` of `n` is averaged over when smoothing over `t` frames: `i..i + t`,
/// or the last `t` where that runs past the end (the whole clip when it is shorter).
pub fn smoothing_window(i: usize, n: usize, t: usize) -> std::ops::Range<usize> {
    let t = t.max(1);
    let start = if i + t > n { n.saturating_sub(t) } else { i };
    start..(start + t).min(n)
}

/// For frames without a face (`None`), the value (box, landmarks) of the nearest frame with
/// one (the earlier on a tie); `None` when no frame has a face.
pub fn fill_missing<T: Copy>(boxes: &[Option<T>]) -> Option<Vec<T>> {
    let found: Vec<usize> = (0..boxes.len()).filter(|&i| boxes[i].is_some()).collect();
    if found.is_empty() {
        return None;
    }
    Some(
        (0..boxes.len())
            .map(|i| {
                let j = match found.binary_search(&i) {
                    Ok(p) => found[p],
                    Err(0) => found[0],
                    Err(p) if p == found.len() => found[p - 1],
                    Err(p) if i - found[p - 1] <= found[p] - i => found[p - 1],
                    Err(p) => found[p],
                };
                boxes[j].expect("found")
            })
            .collect(),
    )
}

/// The box's pixels resized to 96×96 as `cv2.resize` would (INTER_LINEAR), in BGR order,
/// the model's channel order.
pub fn crop_bgr(frame: &Frame, b: &FaceBox) -> Vec<u8> {
    let (w, h) = (b.width() as usize, b.height() as usize);
    let stride = frame.width as usize * 3;
    let mut region = Vec::with_capacity(w * h * 3);
    for y in b.y1 as usize..b.y2 as usize {
        let start = y * stride + b.x1 as usize * 3;
        region.extend_from_slice(&frame.rgb[start..start + w * 3]);
    }
    let mut out = resize_linear(&region, w, h, 3, FACE_SIZE, FACE_SIZE);
    swap_red_blue(&mut out);
    out
}

/// RGB ⇄ BGR in place.
pub fn swap_red_blue(pixels: &mut [u8]) {
    for p in pixels.chunks_exact_mut(3) {
        p.swap(0, 2);
    }
}

/// The model's face input for one frame, `(6, 96, 96)` channel-major in [0, 1]: the crop with
/// its lower half zeroed, then the crop itself (both BGR), divided by 255.
pub fn model_input(crop_bgr: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(6 * FACE_SIZE * FACE_SIZE);
    model_input_into(crop_bgr, &mut out);
    out
}

/// [`model_input`] appended to `out` (a batch being built): each value `v / 255` as an `f32`
/// division, channel by channel, with AVX2 where the CPU has it (the build targets plain
/// x86-64), so the compiler vectorises it.
pub fn model_input_into(crop_bgr: &[u8], batch: &mut Vec<f32>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { model_input_into_avx2(crop_bgr, batch) };
        return;
    }
    model_input_into_any(crop_bgr, batch);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn model_input_into_avx2(crop_bgr: &[u8], batch: &mut Vec<f32>) {
    model_input_into_any(crop_bgr, batch);
}

/// One pass over the crop writes its three planes (channels 3–5); the upper halves are then
/// copied into channels 0–2 and their lower halves zeroed. Written into the batch's spare
/// capacity, so nothing is filled twice; six strided passes over the crop cost 40 % more.
#[inline(always)]
fn model_input_into_any(crop_bgr: &[u8], batch: &mut Vec<f32>) {
    let n = FACE_SIZE * FACE_SIZE;
    let upper = FACE_SIZE / 2 * FACE_SIZE;
    let pixels = &crop_bgr[..3 * n];
    let start = batch.len();
    batch.reserve(6 * n);
    let (masked, whole) = batch.spare_capacity_mut()[..6 * n].split_at_mut(3 * n);
    let (b, gr) = whole.split_at_mut(n);
    let (g, r) = gr.split_at_mut(n);
    for (((px, b), g), r) in pixels.chunks_exact(3).zip(b).zip(g).zip(r) {
        b.write(f32::from(px[0]) / 255.0);
        g.write(f32::from(px[1]) / 255.0);
        r.write(f32::from(px[2]) / 255.0);
    }
    for (plane, src) in masked.chunks_exact_mut(n).zip(whole.chunks_exact(n)) {
        let (top, bottom) = plane.split_at_mut(upper);
        top.copy_from_slice(&src[..upper]);
        bottom.fill(std::mem::MaybeUninit::new(0.0));
    }
    // SAFETY: the 6·n values after `start` were all written just above, within the capacity
    // reserved for them.
    unsafe { batch.set_len(start + 6 * n) };
}

/// The side of a square BGR face: 96 for the generator's, 96·s after an enhancer of scale s.
pub fn face_side(face_bgr: &[u8]) -> usize {
    let side = ((face_bgr.len() / 3) as f64).sqrt().round() as usize;
    debug_assert_eq!(side * side * 3, face_bgr.len(), "a square BGR face");
    side
}

/// One predicted face `(3, 96, 96)` channel-major BGR in (0, 1) to 8-bit BGR pixels: ×255 and
/// truncated, as the original's `astype(np.uint8)` (values outside 0..=255 clamped, NaN 0),
/// with AVX2 where the CPU has it.
pub fn prediction_to_bgr(pred: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; 3 * FACE_SIZE * FACE_SIZE];
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { prediction_to_bgr_avx2(pred, &mut out) };
        return out;
    }
    prediction_to_bgr_any(pred, &mut out);
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn prediction_to_bgr_avx2(pred: &[f32], out: &mut [u8]) {
    prediction_to_bgr_any(pred, out);
}

/// [`prediction_to_bgr`] into `out`: the value clamped into 0..=255 before it is truncated
/// (NaN to 0, as `as u8` gives), so the truncation needs no saturation and vectorises.
#[inline(always)]
fn prediction_to_bgr_any(pred: &[f32], out: &mut [u8]) {
    let n = FACE_SIZE * FACE_SIZE;
    let (b, g, r) = (&pred[..n], &pred[n..2 * n], &pred[2 * n..3 * n]);
    // Not `clamp`, which keeps NaN: `max` returns 0 for it. Infinities go to the ends.
    #[allow(clippy::manual_clamp)]
    let to_u8 = |v: f32| {
        let v = (v * 255.0).max(0.0).min(255.0);
        // SAFETY: `v` is finite and within 0..=255, so it truncates into an i32.
        unsafe { v.to_int_unchecked::<i32>() as u8 }
    };
    for (((o, &b), &g), &r) in out.chunks_exact_mut(3).zip(b).zip(g).zip(r) {
        o[0] = to_u8(b);
        o[1] = to_u8(g);
        o[2] = to_u8(r);
    }
}

/// How the predicted face goes back into the photo.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Blend {
    /// A soft lower-face mask: pixels outside the box are untouched and the mask fades to zero
    /// before the box edge, so no rectangle shows.
    #[default]
    Feather,
    /// The original's paste of the whole box (for parity checks).
    Hard,
}

impl Blend {
    /// The names `FromStr` accepts.
    pub const NAMES: &'static [&'static str] = &["feather", "hard"];
}

impl FromStr for Blend {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim() {
            "feather" => Ok(Blend::Feather),
            "hard" => Ok(Blend::Hard),
            _ => Err(Error::BadBlend(format!("{s:?} (use feather or hard)"))),
        }
    }
}

/// Per-pixel weights of the predicted face over a box, 0–256 (fixed point).
#[derive(Debug, Clone, PartialEq)]
pub struct BlendMask {
    width: usize,
    height: usize,
    alpha: Vec<u16>,
    /// The columns and rows of the smallest rectangle holding every non-zero weight (empty
    /// if there is none): all that a paste changes.
    support: (Range<usize>, Range<usize>),
}

fn smoothstep(e0: f32, e1: f32, x: f32) -> f32 {
    let t = ((x - e0) / (e1 - e0)).clamp(0.0, 1.0);
    t * t * (3.0 - 2.0 * t)
}

impl BlendMask {
    /// The mask for a box of the given size: full weight over mouth and jaw, fading out towards
    /// the cheeks and the box's bottom edge, and above the nose (the model redraws only the
    /// lower half; the upper half stays the photo's own).
    pub fn new(blend: Blend, width: u32, height: u32) -> Self {
        let (w, h) = (width as usize, height as usize);
        let alpha = match blend {
            Blend::Hard => vec![256; w * h],
            Blend::Feather => {
                let mut a = Vec::with_capacity(w * h);
                for y in 0..h {
                    let v = (y as f32 + 0.5) / h as f32;
                    let vertical = smoothstep(0.42, 0.62, v) * (1.0 - smoothstep(0.80, 0.96, v));
                    for x in 0..w {
                        let u = (x as f32 + 0.5) / w as f32;
                        let horizontal =
                            smoothstep(0.04, 0.24, u) * smoothstep(0.04, 0.24, 1.0 - u);
                        a.push((vertical * horizontal * 256.0).round() as u16);
                    }
                }
                a
            }
        };
        let support = support(&alpha, w, h);
        BlendMask {
            width: w,
            height: h,
            alpha,
            support,
        }
    }

    /// The columns and rows of the box that a paste with this mask changes (the smallest
    /// rectangle around its non-zero weights; empty ranges if it has none). The feathered
    /// mask leaves the upper half of the box and the cheeks' edges untouched.
    pub fn support(&self) -> (Range<usize>, Range<usize>) {
        self.support.clone()
    }

    /// Weight (0–256) at box pixel `(x, y)`.
    pub fn at(&self, x: usize, y: usize) -> u16 {
        self.alpha[y * self.width + x]
    }

    pub fn size(&self) -> (usize, usize) {
        (self.width, self.height)
    }
}

/// The columns and rows of the smallest rectangle holding every non-zero weight of `alpha`
/// (`w` × `h`), or empty ranges.
fn support(alpha: &[u16], w: usize, h: usize) -> (Range<usize>, Range<usize>) {
    let (mut cols, mut rows) = ((w, 0), (h, 0));
    for (y, line) in alpha.chunks_exact(w.max(1)).take(h).enumerate() {
        if let Some(first) = line.iter().position(|&a| a != 0) {
            let last = line.iter().rposition(|&a| a != 0).unwrap_or(first);
            cols = (cols.0.min(first), cols.1.max(last + 1));
            rows = (rows.0.min(y), y + 1);
        }
    }
    if rows.0 >= rows.1 {
        return (0..0, 0..0);
    }
    (cols.0..cols.1, rows.0..rows.1)
}

/// Resizes a predicted BGR face (96×96, or square and larger after an enhancer) to the box
/// (`cv2.resize`, INTER_LINEAR) and blends it
/// into `frame` with `mask` (sized to the box). Pixels outside the box, and those of the box
/// the mask gives no weight, are never touched (and only the mask's support is resized).
pub fn paste(frame: &mut Frame, b: &FaceBox, face_bgr: &[u8], mask: &BlendMask) {
    paste_into(frame, (0, 0), b, face_bgr, mask);
}

/// [`paste`] into a part of the picture: `frame` is the part whose top-left pixel is at
/// `origin` (in the picture, as the box is). It must hold the mask's support (see
/// [`BlendMask::support`]), not necessarily the whole box.
pub fn paste_into(
    frame: &mut Frame,
    origin: (u32, u32),
    b: &FaceBox,
    face_bgr: &[u8],
    mask: &BlendMask,
) {
    let (w, h) = (b.width() as usize, b.height() as usize);
    debug_assert_eq!(mask.size(), (w, h));
    let side = face_side(face_bgr);
    let (cols, rows) = mask.support();
    let resized = resize_linear_window(face_bgr, side, side, 3, w, h, cols.clone(), rows.clone());
    let ww = cols.len();
    let stride = frame.width as usize * 3;
    // The support's top-left pixel in `frame`.
    let (x0, y0) = (
        (b.x1 as usize + cols.start)
            .checked_sub(origin.0 as usize)
            .expect("the part holds the mask's support"),
        (b.y1 as usize + rows.start)
            .checked_sub(origin.1 as usize)
            .expect("the part holds the mask's support"),
    );
    for (ry, y) in rows.enumerate() {
        let row = (y0 + ry) * stride + x0 * 3;
        for (rx, x) in cols.clone().enumerate() {
            let a = u32::from(mask.at(x, y));
            if a == 0 {
                continue;
            }
            let src = &resized[(ry * ww + rx) * 3..(ry * ww + rx) * 3 + 3];
            let dst = &mut frame.rgb[row + rx * 3..row + rx * 3 + 3];
            // src is BGR, dst RGB.
            for c in 0..3 {
                let face = u32::from(src[2 - c]);
                let photo = u32::from(dst[c]);
                dst[c] = ((face * a + photo * (256 - a) + 128) >> 8) as u8;
            }
        }
    }
}

#[cfg(test)]
mod tests {

    fn bx(v: u32) -> FaceBox {
        FaceBox {
            x1: v,
            y1: v,
            x2: v + 10,
            y2: v + 10,
        }
    }

    /// The paste as it was: the whole box resized, every pixel with a weight blended.
    fn paste_whole_box(frame: &mut Frame, b: &FaceBox, face_bgr: &[u8], mask: &BlendMask) {
        let (w, h) = (b.width() as usize, b.height() as usize);
        let side = face_side(face_bgr);
        let resized = resize_linear(face_bgr, side, side, 3, w, h);
        let stride = frame.width as usize * 3;
        for y in 0..h {
            for x in 0..w {
                let a = u32::from(mask.at(x, y));
                let at = (b.y1 as usize + y) * stride + (b.x1 as usize + x) * 3;
                for c in 0..3 {
                    let face = u32::from(resized[(y * w + x) * 3 + 2 - c]);
                    let photo = u32::from(frame.rgb[at + c]);
                    frame.rgb[at + c] = ((face * a + photo * (256 - a) + 128) >> 8) as u8;
                }
            }
        }
    }

    #[test]
    fn pasting_only_the_masks_support_changes_no_byte() {
        let mut lcg = crate::media::image::lcg(99);
        let mut next = move |m: u32| lcg(m as usize) as u32;
        for round in 0..60 {
            let (fw, fh) = (40 + next(300), 40 + next(300));
            let (bw, bh) = (8 + next(fw - 8), 8 + next(fh - 8));
            let (x1, y1) = (next(fw - bw + 1), next(fh - bh + 1));
            let b = FaceBox {
                x1,
                y1,
                x2: x1 + bw,
                y2: y1 + bh,
            };
            let side = [96usize, 192][round % 2];
            let face: Vec<u8> = (0..side * side * 3).map(|_| next(256) as u8).collect();
            let photo = Frame {
                width: fw,
                height: fh,
                rgb: (0..(fw * fh * 3) as usize)
                    .map(|_| next(256) as u8)
                    .collect(),
            };
            for blend in [Blend::Feather, Blend::Hard] {
                let mask = BlendMask::new(blend, bw, bh);
                let (cols, rows) = mask.support();
                // Outside the support every weight is zero, inside the edges are not.
                for y in 0..bh as usize {
                    for x in 0..bw as usize {
                        if !cols.contains(&x) || !rows.contains(&y) {
                            assert_eq!(mask.at(x, y), 0);
                        }
                    }
                }
                if blend == Blend::Hard {
                    assert_eq!(
                        (cols.clone(), rows.clone()),
                        (0..bw as usize, 0..bh as usize)
                    );
                } else if bh >= 16 {
                    assert!(rows.len() < bh as usize * 2 / 3, "{rows:?} of {bh}");
                }
                let (mut got, mut want) = (photo.clone(), photo.clone());
                paste(&mut got, &b, &face, &mask);
                paste_whole_box(&mut want, &b, &face, &mask);
                assert!(
                    got.rgb == want.rgb,
                    "round {round}, {blend:?}, box {b:?} in {fw}x{fh}"
                );
                // Into a part that holds the support alone: that part of the same picture.
                if !cols.is_empty() && !rows.is_empty() {
                    let (px, py) = (x1 + cols.start as u32, y1 + rows.start as u32);
                    let (pw, ph) = (cols.len(), rows.len());
                    let crop = |f: &Frame| -> Vec<u8> {
                        (0..ph)
                            .flat_map(|y| {
                                let at = ((py as usize + y) * fw as usize + px as usize) * 3;
                                f.rgb[at..at + pw * 3].to_vec()
                            })
                            .collect()
                    };
                    let mut part = Frame {
                        width: pw as u32,
                        height: ph as u32,
                        rgb: crop(&photo),
                    };
                    paste_into(&mut part, (px, py), &b, &face, &mask);
                    assert!(
                        part.rgb == crop(&want),
                        "round {round}, {blend:?}: the part"
                    );
                }
            }
        }
    }

    #[test]
    fn frames_without_a_face_take_the_nearest_box() {
        let got = fill_missing(&[None, Some(bx(1)), None, None, None, Some(bx(5)), None]).unwrap();
        let firsts: Vec<u32> = got.iter().map(|b| b.x1).collect();
        assert_eq!(firsts, [1, 1, 1, 1, 5, 5, 5]);
        assert!(fill_missing::<FaceBox>(&[None, None]).is_none());
    }

    #[test]
    fn short_clips_smooth_over_the_whole_clip() {
        // n < 5: every box is the running mean of the whole (partly smoothed) clip.
        let mut b = vec![bx(0), bx(3), bx(9)];
        smooth_boxes(&mut b, SMOOTH_WINDOW);
        // i=0: (0+3+9)/3 = 4; i=1: (4+3+9)/3 = 5; i=2: (4+5+9)/3 = 6.
        assert_eq!(b.iter().map(|b| b.x1).collect::<Vec<_>>(), [4, 5, 6]);
        let mut one = vec![bx(7)];
        smooth_boxes(&mut one, SMOOTH_WINDOW);
        assert_eq!(one, [bx(7)]);
    }
    use super::*;

    #[test]
    fn boxes_parse_check_and_print() {
        let b: FaceBox = "10, 20,110,140".parse().unwrap();
        assert_eq!(
            b,
            FaceBox {
                x1: 10,
                y1: 20,
                x2: 110,
                y2: 140
            }
        );
        assert_eq!((b.width(), b.height()), (100, 120));
        assert_eq!(b.to_string(), "10,20,110,140");
        assert!(b.check(110, 140).is_ok());
        assert!(b.check(109, 140).is_err());
        for bad in [
            "1,2,3",
            "1,2,3,4,5",
            "a,b,c,d",
            "5,5,5,9",
            "9,1,3,4",
            "-1,0,4,4",
        ] {
            assert!(
                matches!(bad.parse::<FaceBox>(), Err(Error::BadBox(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn pads_follow_the_original_and_clip_to_the_image() {
        let b = FaceBox {
            x1: 10,
            y1: 20,
            x2: 110,
            y2: 140,
        };
        let p: Pads = "5,10,-3,200".parse().unwrap();
        assert_eq!(
            p.apply(b, 200, 145).unwrap(),
            FaceBox {
                x1: 13,
                y1: 15,
                x2: 200,
                y2: 145
            }
        );
        assert_eq!(Pads::default().to_string(), "0,10,0,0");
        assert!("0,0,0".parse::<Pads>().is_err());
        assert!("0,-200,0,0"
            .parse::<Pads>()
            .unwrap()
            .apply(b, 200, 200)
            .is_err());
    }

    #[test]
    fn iou_of_boxes() {
        let a = FaceBox {
            x1: 0,
            y1: 0,
            x2: 10,
            y2: 10,
        };
        let b = FaceBox {
            x1: 5,
            y1: 0,
            x2: 15,
            y2: 10,
        };
        assert!((a.iou(&b) - 50.0 / 150.0).abs() < 1e-12);
        assert_eq!(a.iou(&a), 1.0);
    }

    #[test]
    fn model_input_masks_the_lower_half_of_the_first_copy() {
        let crop: Vec<u8> = (0..FACE_SIZE * FACE_SIZE * 3)
            .map(|i| (i % 251) as u8)
            .collect();
        let x = model_input(&crop);
        let n = FACE_SIZE * FACE_SIZE;
        let top = 10 * FACE_SIZE + 7; // row 10
        let bottom = 60 * FACE_SIZE + 7; // row 60
        for c in 0..3 {
            assert_eq!(x[c * n + top], f32::from(crop[top * 3 + c]) / 255.0);
            assert_eq!(x[c * n + bottom], 0.0);
            assert_eq!(
                x[(3 + c) * n + bottom],
                f32::from(crop[bottom * 3 + c]) / 255.0
            );
        }
        // Every element, against the per-pixel formula (the division itself, bit for bit).
        for i in 0..n {
            let lower = i / FACE_SIZE >= FACE_SIZE / 2;
            for c in 0..3 {
                let v = f32::from(crop[i * 3 + c]) / 255.0;
                assert_eq!(x[(3 + c) * n + i].to_bits(), v.to_bits());
                assert_eq!(
                    x[c * n + i].to_bits(),
                    if lower { 0.0 } else { v }.to_bits()
                );
            }
        }
        // Appended after what a batch already holds.
        let mut batch = vec![7.0f32; 3];
        model_input_into(&crop, &mut batch);
        assert_eq!(&batch[..3], &[7.0; 3]);
        assert_eq!(&batch[3..], &x[..]);
        // The same without AVX2.
        let mut any = Vec::new();
        model_input_into_any(&crop, &mut any);
        assert!(any.iter().zip(&x).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert_eq!(any.len(), x.len());
    }

    #[test]
    fn feather_mask_is_zero_at_the_box_edge_and_full_at_the_mouth() {
        let m = BlendMask::new(Blend::Feather, 120, 140);
        for x in 0..120 {
            assert_eq!(m.at(x, 0), 0);
            assert_eq!(m.at(x, 139), 0);
        }
        for y in 0..140 {
            assert_eq!(m.at(0, y), 0);
            assert_eq!(m.at(119, y), 0);
        }
        assert_eq!(m.at(60, 100), 256);
        assert_eq!(m.at(60, 30), 0); // eyes stay the photo's own
        assert!(BlendMask::new(Blend::Hard, 3, 2)
            .alpha
            .iter()
            .all(|&a| a == 256));
    }

    #[test]
    fn paste_touches_only_the_box() {
        let mut frame = Frame::new(50, 40, vec![100; 50 * 40 * 3]);
        let b = FaceBox {
            x1: 10,
            y1: 5,
            x2: 30,
            y2: 35,
        };
        let face = vec![200u8; FACE_SIZE * FACE_SIZE * 3];
        paste(&mut frame, &b, &face, &BlendMask::new(Blend::Hard, 20, 30));
        for y in 0..40u32 {
            for x in 0..50u32 {
                let inside = (10..30).contains(&x) && (5..35).contains(&y);
                let v = frame.rgb[((y * 50 + x) * 3) as usize];
                assert_eq!(v, if inside { 200 } else { 100 }, "({x},{y})");
            }
        }
    }

    #[test]
    fn predictions_are_truncated_like_astype_uint8() {
        let n = FACE_SIZE * FACE_SIZE;
        let mut pred = vec![0.5f32; 3 * n];
        pred[0] = 0.999_99; // B of pixel 0
        pred[n] = 0.003_92; // G of pixel 0 -> 0.99996 -> 0
        pred[3 * n - 1] = 1.5; // R of the last pixel, clamped
        pred[2 * n - 1] = -0.2; // G of the last pixel, clamped
        let bgr = prediction_to_bgr(&pred);
        assert_eq!(&bgr[..3], &[254, 0, 127]);
        assert_eq!(&bgr[3 * n - 3..], &[127, 0, 255]);
        assert_eq!(bgr.len(), 3 * n);
        // Every value against `as u8` of the clamped product (saturating, NaN to 0), with and
        // without AVX2: a sweep past both ends, and the values that are not numbers.
        let mut pred: Vec<f32> = (0..3 * n)
            .map(|i| (i as f32 / (3 * n) as f32) * 1.4 - 0.2)
            .collect();
        pred[5] = f32::NAN;
        pred[n + 9] = f32::INFINITY;
        pred[2 * n + 11] = f32::NEG_INFINITY;
        pred[17] = -0.0;
        let want: Vec<u8> = (0..n)
            .flat_map(|i| [0, 1, 2].map(|c| (pred[c * n + i] * 255.0).clamp(0.0, 255.0) as u8))
            .collect();
        assert_eq!(prediction_to_bgr(&pred), want);
        let mut any = vec![0u8; 3 * n];
        prediction_to_bgr_any(&pred, &mut any);
        assert_eq!(any, want);
        assert_eq!((want[15], want[3 * 9 + 1], want[3 * 11 + 2]), (0, 255, 0));
    }
}
