//! Aligning a face to a template: a similarity transform fitted to five landmarks by least
//! squares, and an affine warp with bilinear interpolation and a constant border that gives
//! OpenCV's `warpAffine(..., INTER_LINEAR, BORDER_CONSTANT)` bytes.
//!
//! The warp follows the arithmetic of OpenCV's current `warpAffine` (4.11 and later; checked
//! bit for bit against opencv-python-headless 5.0 by `tests/image.rs`), so that a face aligned
//! here is the face the upstream pipelines align: the inverse map is computed in f64 and kept
//! in f32; per row `b·y + c` in f32, per pixel the source position `a·x + (b·y + c)` as one
//! fused multiply-add; the four neighbours mixed in f32 along x, then along y, rounded to the
//! nearest level (ties to even). A neighbour outside the source takes the border colour.
//! (OpenCV up to 4.10 quantised positions to 1/32 of a pixel: up to 3 levels apart.)

use super::landmarks::Landmarks;
use crate::media::image::Frame;

/// FFHQ's five-point template for 512×512 faces (facexlib's `face_template`), in the order of
/// [`Landmarks`].
pub const FFHQ_512: [[f64; 2]; 5] = [
    [192.98138, 239.94708],
    [318.90277, 240.1936],
    [256.63416, 314.01935],
    [201.26117, 371.41043],
    [313.08905, 371.15118],
];

/// The border colour facexlib's alignment uses (RGB).
pub const FFHQ_BORDER: [u8; 3] = [135, 133, 132];

/// A 2×3 affine map `[x', y'] = [[a, b, c], [d, e, f]] · [x, y, 1]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Affine(pub [[f64; 3]; 2]);

impl Affine {
    /// Where `p` goes.
    pub fn apply(&self, [x, y]: [f64; 2]) -> [f64; 2] {
        let [[a, b, c], [d, e, f]] = self.0;
        [a * x + b * y + c, d * x + e * y + f]
    }

    /// The inverse map, as OpenCV's `invertAffineTransform` computes it; `None` when the map
    /// is singular.
    pub fn invert(&self) -> Option<Affine> {
        let [[a, b, c], [d, e, f]] = self.0;
        let det = a * e - b * d;
        if det == 0.0 || !det.is_finite() {
            return None;
        }
        let r = 1.0 / det;
        let (ia, ib, id, ie) = (e * r, -b * r, -d * r, a * r);
        Some(Affine([
            [ia, ib, -ia * c - ib * f],
            [id, ie, -id * c - ie * f],
        ]))
    }
}

/// The similarity (rotation, uniform scale, translation: four degrees of freedom) that maps
/// `from` onto `to` with the least sum of squared distances. `None` when the points of `from`
/// all coincide.
pub fn similarity(from: &[[f64; 2]], to: &[[f64; 2]]) -> Option<Affine> {
    assert_eq!(from.len(), to.len(), "point lists of different lengths");
    let n = from.len() as f64;
    let mean = |p: &[[f64; 2]]| {
        let (sx, sy) = p
            .iter()
            .fold((0.0, 0.0), |(sx, sy), [x, y]| (sx + x, sy + y));
        (sx / n, sy / n)
    };
    let (mx, my) = mean(from);
    let (mu, mv) = mean(to);
    // With both sets centred the normal equations of x' = a·x − b·y + tx, y' = b·x + a·y + ty
    // separate: a and b from the centred sums, then the translation from the means.
    let (mut sxx, mut sa, mut sb) = (0.0, 0.0, 0.0);
    for ([x, y], [u, v]) in from.iter().zip(to) {
        let (x, y) = (x - mx, y - my);
        let (u, v) = (u - mu, v - mv);
        sxx += x * x + y * y;
        sa += x * u + y * v;
        sb += x * v - y * u;
    }
    if sxx <= f64::EPSILON {
        return None;
    }
    let (a, b) = (sa / sxx, sb / sxx);
    Some(Affine([
        [a, -b, mu - a * mx + b * my],
        [b, a, mv - b * mx - a * my],
    ]))
}

/// The similarity that takes a face's landmarks onto the FFHQ 512 template.
pub fn to_ffhq_512(l: &Landmarks) -> Option<Affine> {
    similarity(&l.0, &FFHQ_512)
}

/// `src` warped by `m` (source → destination, as `cv2.warpAffine` takes it) into a
/// `width × height` RGB frame, bilinear, with `border` outside the source. Returns `None`
/// when `m` is singular.
pub fn warp_affine(
    src: &Frame,
    m: &Affine,
    width: u32,
    height: u32,
    border: [u8; 3],
) -> Option<Frame> {
    let inv = m.invert()?;
    let mut out = Frame::new(width, height, vec![0; width as usize * height as usize * 3]);
    warp_rows(src, &inv, &mut out, (0, 0), border);
    Some(out)
}

/// Fills `out`, whose top left pixel is destination pixel `origin`, with `src` sampled through
/// `inv` (destination → source), in OpenCV's arithmetic (see the module).
pub fn warp_rows(src: &Frame, inv: &Affine, out: &mut Frame, origin: (u32, u32), border: [u8; 3]) {
    let [[a, b, c], [d, e, f]] = inv.0.map(|row| row.map(|v| v as f32));
    // fma(p, q, r) for f32: the product is exact in f64, the sum rounded once there.
    let fma = |p: f32, q: f32, r: f32| (f64::from(p) * f64::from(q) + f64::from(r)) as f32;
    let (sw, sh) = (src.width as i64, src.height as i64);
    let border = border.map(f32::from);
    let ow = out.width as usize;
    for (row, line) in out.rgb.chunks_exact_mut(ow * 3).enumerate() {
        let y = (u64::from(origin.1) + row as u64) as f32;
        let (row_x, row_y) = (b * y + c, e * y + f);
        for (col, px) in line.chunks_exact_mut(3).enumerate() {
            let x = (u64::from(origin.0) + col as u64) as f32;
            let (sx, sy) = (fma(a, x, row_x), fma(d, x, row_y));
            let (fx, fy) = (sx.floor(), sy.floor());
            if !(fx.is_finite() && fy.is_finite()) {
                px.copy_from_slice(&border.map(|v| v as u8));
                continue;
            }
            let (alpha, beta) = (sx - fx, sy - fy);
            let (x0, y0) = (fx as i64, fy as i64);
            let at = |x: i64, y: i64, ch: usize| {
                if (0..sw).contains(&x) && (0..sh).contains(&y) {
                    f32::from(src.rgb[((y * sw + x) * 3) as usize + ch])
                } else {
                    border[ch]
                }
            };
            for (ch, out) in px.iter_mut().enumerate() {
                let (x1, y1) = (x0.saturating_add(1), y0.saturating_add(1));
                let (f00, f01) = (at(x0, y0, ch), at(x1, y0, ch));
                let (f10, f11) = (at(x0, y1, ch), at(x1, y1, ch));
                let top = alpha * (f01 - f00) + f00;
                let bottom = alpha * (f11 - f10) + f10;
                let v = beta * (bottom - top) + top;
                *out = v.round_ties_even().clamp(0.0, 255.0) as u8;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_a_known_similarity_and_inverts() {
        let (s, t) = (1.7f64, 0.3f64);
        let truth = Affine([
            [s * t.cos(), -s * t.sin(), 12.5],
            [s * t.sin(), s * t.cos(), -40.0],
        ]);
        let from = [
            [10.0, 20.0],
            [60.0, 22.0],
            [35.0, 50.0],
            [15.0, 70.0],
            [58.0, 71.0],
        ];
        let to = from.map(|p| truth.apply(p));
        let fit = similarity(&from, &to).unwrap();
        for (r, q) in fit.0.iter().flatten().zip(truth.0.iter().flatten()) {
            assert!((r - q).abs() < 1e-9, "{fit:?} vs {truth:?}");
        }
        let back = fit.invert().unwrap();
        let p = back.apply(fit.apply([3.0, 4.0]));
        assert!((p[0] - 3.0).abs() < 1e-9 && (p[1] - 4.0).abs() < 1e-9);
        assert!(similarity(&[[1.0, 1.0]; 5], &to).is_none());
    }

    #[test]
    fn the_identity_warp_copies_and_outside_is_the_border() {
        let rgb: Vec<u8> = (0..8 * 6 * 3).map(|i| (i * 7 % 251) as u8).collect();
        let src = Frame::new(8, 6, rgb.clone());
        let id = Affine([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]);
        let out = warp_affine(&src, &id, 8, 6, [1, 2, 3]).unwrap();
        assert_eq!(out.rgb, rgb);
        // Shifted right by 20 pixels: nothing of the source is left.
        let far = Affine([[1.0, 0.0, 20.0], [0.0, 1.0, 0.0]]);
        let out = warp_affine(&src, &far, 8, 6, [1, 2, 3]).unwrap();
        assert!(out.rgb.chunks(3).all(|p| p == [1, 2, 3]));
        // Half a pixel: the mean of two neighbours, rounded to even on a tie.
        let half = Affine([[1.0, 0.0, -0.5], [0.0, 1.0, 0.0]]);
        let out = warp_affine(&src, &half, 8, 6, [0, 0, 0]).unwrap();
        for x in 0..7 {
            let mean = (f32::from(rgb[3 * x]) + f32::from(rgb[3 * x + 3])) / 2.0;
            assert_eq!(f32::from(out.rgb[3 * x]), mean.round_ties_even(), "x {x}");
        }
        assert!(warp_affine(&src, &Affine([[0.0; 3]; 2]), 4, 4, [0; 3]).is_none());
    }
}
