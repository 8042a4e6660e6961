//! Frames as the encoder takes them: planar YUV 4:2:0 (ITU-R BT.601, limited range, as
//! ffmpeg's own RGB conversion makes it), converted here rather than by ffmpeg so that only
//! what changes is converted: an avatar's background once, then per frame only the region
//! around the face ([`Yuv420::write_rgb`]).
//!
//! The planes are laid out as ffmpeg's `rawvideo` `yuv420p` reads them (Y, then U, then V,
//! no row padding) at the coded size: odd widths and heights are padded by one column or row
//! repeating the last one, as H.264 4:2:0 needs even sizes.

use crate::media::image::Frame;

/// A YUV 4:2:0 frame (see the module documentation).
#[derive(Clone, PartialEq, Eq)]
pub struct Yuv420 {
    /// The picture's size (the coded size is this rounded up to even).
    pub width: u32,
    pub height: u32,
    data: Vec<u8>,
}

impl std::fmt::Debug for Yuv420 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Yuv420({}x{})", self.width, self.height)
    }
}

/// Even dimensions for a picture size.
pub fn coded_size(width: u32, height: u32) -> (u32, u32) {
    (width + width % 2, height + height % 2)
}

/// Bytes of one coded frame.
pub fn frame_bytes(width: u32, height: u32) -> usize {
    let (w, h) = coded_size(width, height);
    let (w, h) = (w as usize, h as usize);
    w * h + 2 * (w / 2) * (h / 2)
}

/// Cb and Cr of the sums of 4 pixels' R, G and B.
#[inline(always)]
fn chroma4(r: i32, g: i32, b: i32) -> (u8, u8) {
    let u = ((-38 * r - 74 * g + 112 * b + 512) >> 10) + 128;
    let v = ((112 * r - 94 * g - 18 * b + 512) >> 10) + 128;
    (u.clamp(0, 255) as u8, v.clamp(0, 255) as u8)
}

/// Two RGB rows (even length) to their two luma rows and one row of each chroma plane, in
/// BT.601 limited range, 8-bit fixed point (coefficients × 256, rounded). The
/// rows are converted in passes the compiler can vectorise: luma pixel by pixel in 16 bits
/// (`66·255 + 129·255 + 25·255 + 128` fits), then chroma over 2×2 blocks in 32 bits; with
/// AVX2 where the CPU has it (the build targets plain x86-64).
fn convert_row_pair(rgb: [&[u8]; 2], luma_rows: [&mut [u8]; 2], u: &mut [u8], v: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { convert_row_pair_avx2(rgb, luma_rows, u, v) };
        return;
    }
    convert_row_pair_any(rgb, luma_rows, u, v);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn convert_row_pair_avx2(
    rgb: [&[u8]; 2],
    luma_rows: [&mut [u8]; 2],
    u: &mut [u8],
    v: &mut [u8],
) {
    convert_row_pair_any(rgb, luma_rows, u, v);
}

#[inline(always)]
fn convert_row_pair_any(rgb: [&[u8]; 2], luma_rows: [&mut [u8]; 2], u: &mut [u8], v: &mut [u8]) {
    for (row, out) in rgb.iter().zip(luma_rows) {
        for (p, l) in row.chunks_exact(3).zip(out.iter_mut()) {
            let (r, g, b) = (u16::from(p[0]), u16::from(p[1]), u16::from(p[2]));
            *l = (((66 * r + 129 * g + 25 * b + 128) >> 8) + 16) as u8;
        }
    }
    for (((t, b), u), v) in rgb[0]
        .chunks_exact(6)
        .zip(rgb[1].chunks_exact(6))
        .zip(u.iter_mut())
        .zip(v.iter_mut())
    {
        let sum = |k: usize| {
            i32::from(t[k]) + i32::from(t[k + 3]) + i32::from(b[k]) + i32::from(b[k + 3])
        };
        (*u, *v) = chroma4(sum(0), sum(1), sum(2));
    }
}

/// A rectangle of a frame, every edge on an even coordinate of the coded size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub x: u32,
    pub y: u32,
    pub width: u32,
    pub height: u32,
}

impl Region {
    /// No pixels.
    pub const EMPTY: Region = Region {
        x: 0,
        y: 0,
        width: 0,
        height: 0,
    };

    /// The smallest region that holds both.
    pub fn union(&self, other: &Region) -> Region {
        let (x, y) = (self.x.min(other.x), self.y.min(other.y));
        Region {
            x,
            y,
            width: (self.x + self.width).max(other.x + other.width) - x,
            height: (self.y + self.height).max(other.y + other.height) - y,
        }
    }

    /// The smallest even-aligned region of a `frame_w`×`frame_h` picture's coded size that
    /// holds the pixels `x1..x2`, `y1..y2`.
    pub fn around(x1: u32, y1: u32, x2: u32, y2: u32, frame_w: u32, frame_h: u32) -> Region {
        let (cw, ch) = coded_size(frame_w, frame_h);
        let (x0, y0) = (x1 & !1, y1 & !1);
        let (xe, ye) = ((x2 + x2 % 2).min(cw), (y2 + y2 % 2).min(ch));
        Region {
            x: x0.min(xe),
            y: y0.min(ye),
            width: xe.saturating_sub(x0),
            height: ye.saturating_sub(y0),
        }
    }

    /// The region's pixels of `frame` as RGB rows, reading the padding of an odd-sized
    /// frame as its last column or row.
    pub fn crop(&self, frame: &Frame) -> Frame {
        let (w, h) = (frame.width as usize, frame.height as usize);
        let mut rgb = Vec::with_capacity(self.width as usize * self.height as usize * 3);
        for y in self.y..self.y + self.height {
            let row = (y as usize).min(h - 1) * w * 3;
            let x0 = self.x as usize;
            let x1 = (self.x + self.width) as usize;
            let inside = x1.min(w);
            rgb.extend_from_slice(&frame.rgb[row + x0.min(inside) * 3..row + inside * 3]);
            for _ in inside.max(x0)..x1 {
                rgb.extend_from_slice(&frame.rgb[row + (w - 1) * 3..row + w * 3]);
            }
        }
        Frame::new(self.width, self.height, rgb)
    }
}

impl Yuv420 {
    /// A black frame (Y 16, U and V 128).
    pub fn black(width: u32, height: u32) -> Yuv420 {
        let (cw, ch) = coded_size(width, height);
        let luma = cw as usize * ch as usize;
        let mut data = vec![128u8; frame_bytes(width, height)];
        data[..luma].fill(16);
        Yuv420 {
            width,
            height,
            data,
        }
    }

    /// The whole frame converted.
    pub fn from_rgb(frame: &Frame) -> Yuv420 {
        let mut out = Yuv420::black(frame.width, frame.height);
        out.write_whole(frame);
        out
    }

    /// Converts `frame`, of this frame's size, over all of it (odd sizes padded by the last
    /// column and row).
    fn write_whole(&mut self, frame: &Frame) {
        let (cw, ch) = coded_size(frame.width, frame.height);
        if (cw, ch) == (frame.width, frame.height) {
            self.write_rgb(0, 0, frame);
        } else {
            let all = Region {
                x: 0,
                y: 0,
                width: cw,
                height: ch,
            };
            self.write_rgb(0, 0, &all.crop(frame));
        }
    }

    /// The coded frame's bytes: Y, U, V planes.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// The coded size.
    pub fn coded_size(&self) -> (u32, u32) {
        coded_size(self.width, self.height)
    }

    /// Converts an RGB patch (even width and height) into the frame at `(x, y)` (even), over
    /// what was there. The patch must lie within the coded size.
    pub fn write_rgb(&mut self, x: u32, y: u32, patch: &Frame) {
        let (cw, ch) = self.coded_size();
        assert!(
            x % 2 == 0
                && y % 2 == 0
                && patch.width % 2 == 0
                && patch.height % 2 == 0
                && x + patch.width <= cw
                && y + patch.height <= ch,
            "a {}x{} patch at ({x}, {y}) of a {cw}x{ch} frame",
            patch.width,
            patch.height
        );
        let (cw, ch) = (cw as usize, ch as usize);
        let (pw, ph) = (patch.width as usize, patch.height as usize);
        let (x, y) = (x as usize, y as usize);
        let (y_plane, chroma) = self.data.split_at_mut(cw * ch);
        let (u_plane, v_plane) = chroma.split_at_mut((cw / 2) * (ch / 2));
        for py in (0..ph).step_by(2) {
            let top = &patch.rgb[py * pw * 3..(py + 1) * pw * 3];
            let bottom = &patch.rgb[(py + 1) * pw * 3..(py + 2) * pw * 3];
            let (y_top, y_bottom) = y_plane[(y + py) * cw..(y + py + 2) * cw].split_at_mut(cw);
            let c_row = (y + py) / 2 * (cw / 2) + x / 2;
            convert_row_pair(
                [top, bottom],
                [&mut y_top[x..x + pw], &mut y_bottom[x..x + pw]],
                &mut u_plane[c_row..c_row + pw / 2],
                &mut v_plane[c_row..c_row + pw / 2],
            );
        }
    }

    /// Copies `region` (even edges, within the coded size) of the three planes into `out`,
    /// the bytes of a coded frame of this size ([`Self::bytes`]'s layout).
    pub fn copy_region_into(&self, region: &Region, out: &mut [u8]) {
        let (cw, ch) = self.coded_size();
        let Region {
            x,
            y,
            width,
            height,
        } = *region;
        assert!(
            x % 2 == 0
                && y % 2 == 0
                && width % 2 == 0
                && height % 2 == 0
                && x + width <= cw
                && y + height <= ch
                && out.len() == self.data.len(),
            "region {region:?} of a {cw}x{ch} frame into {} bytes",
            out.len()
        );
        let (cw, ch) = (cw as usize, ch as usize);
        let (x, y, w, h) = (x as usize, y as usize, width as usize, height as usize);
        let luma = cw * ch;
        let chroma = (cw / 2) * (ch / 2);
        // (plane start, row stride, x, y, width, height) of the region in each plane.
        let planes = [
            (0, cw, x, y, w, h),
            (luma, cw / 2, x / 2, y / 2, w / 2, h / 2),
            (luma + chroma, cw / 2, x / 2, y / 2, w / 2, h / 2),
        ];
        for (start, stride, px, py, pw, ph) in planes {
            for row in py..py + ph {
                let at = start + row * stride + px;
                out[at..at + pw].copy_from_slice(&self.data[at..at + pw]);
            }
        }
    }

    /// Back to RGB (BT.601 limited range, each chroma sample over its 2×2 block), at the
    /// picture's size: for checks and tests.
    pub fn to_rgb(&self) -> Frame {
        let (cw, ch) = self.coded_size();
        let (cw, ch) = (cw as usize, ch as usize);
        let (w, h) = (self.width as usize, self.height as usize);
        let (luma, chroma) = self.data.split_at(cw * ch);
        let (u_plane, v_plane) = chroma.split_at((cw / 2) * (ch / 2));
        let mut rgb = Vec::with_capacity(w * h * 3);
        for y in 0..h {
            for x in 0..w {
                let c = y / 2 * (cw / 2) + x / 2;
                let l = (f64::from(luma[y * cw + x]) - 16.0) * 255.0 / 219.0;
                let u = (f64::from(u_plane[c]) - 128.0) * 255.0 / 224.0;
                let v = (f64::from(v_plane[c]) - 128.0) * 255.0 / 224.0;
                let r = l + 1.402 * v;
                let g = l - 0.344_136 * u - 0.714_136 * v;
                let b = l + 1.772 * u;
                rgb.extend([r, g, b].map(|c| c.round().clamp(0.0, 255.0) as u8));
            }
        }
        Frame::new(self.width, self.height, rgb)
    }
}

/// `frame` converted whole into `slot`, in the buffer it holds when that is a frame of the same
/// size (a stream of frames is converted without a fresh frame-sized buffer each time).
pub fn convert_into<'s>(slot: &'s mut Option<Yuv420>, frame: &Frame) -> &'s mut Yuv420 {
    let reusable = slot
        .as_ref()
        .is_some_and(|kept| (kept.width, kept.height) == (frame.width, frame.height));
    if !reusable {
        *slot = Some(Yuv420::black(frame.width, frame.height));
    }
    let out = slot.as_mut().expect("set above");
    out.write_whole(frame);
    out
}

/// A frame kept converted, for a stream of frames that differ from each other only within a
/// known region (a photo avatar's face): each new frame converts only that region.
#[derive(Debug, Default)]
pub struct Converted(Option<Yuv420>);

impl Converted {
    /// `frame` converted. `changed`: where it differs from the previous frame given (`None`:
    /// anywhere, or unknown); the first frame, and any frame of another size, is converted
    /// whole.
    pub fn update(&mut self, frame: &Frame, changed: Option<Region>) -> &Yuv420 {
        match (&mut self.0, changed) {
            (Some(kept), Some(r)) if (kept.width, kept.height) == (frame.width, frame.height) => {
                kept.write_rgb(r.x, r.y, &r.crop(frame));
            }
            (kept, _) => {
                convert_into(kept, frame);
            }
        }
        self.0.as_ref().expect("set above")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_union_holds_both_regions() {
        let r = |x, y, width, height| Region {
            x,
            y,
            width,
            height,
        };
        assert_eq!(r(10, 20, 30, 40).union(&r(0, 30, 20, 50)), r(0, 20, 40, 60));
        assert_eq!(r(4, 4, 8, 8).union(&r(6, 6, 2, 2)), r(4, 4, 8, 8));
    }

    fn noise(w: u32, h: u32, seed: u32) -> Frame {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        let rgb = (0..w * h * 3)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s >> 24) as u8
            })
            .collect();
        Frame::new(w, h, rgb)
    }

    /// The reference: BT.601 limited range in floating point (the matrix ffmpeg's swscale
    /// uses for `rgb24` → `yuv420p` by default), chroma the mean of each 2×2 block.
    fn reference(frame: &Frame) -> Vec<f64> {
        let (cw, ch) = coded_size(frame.width, frame.height);
        let (w, h) = (frame.width as usize, frame.height as usize);
        let px = |x: usize, y: usize| {
            let i = (y.min(h - 1) * w + x.min(w - 1)) * 3;
            [0, 1, 2].map(|c| f64::from(frame.rgb[i + c]))
        };
        let (cw, ch) = (cw as usize, ch as usize);
        let mut out = Vec::new();
        for y in 0..ch {
            for x in 0..cw {
                let [r, g, b] = px(x, y);
                out.push(16.0 + (65.481 * r + 128.553 * g + 24.966 * b) / 255.0);
            }
        }
        let mut u = Vec::new();
        let mut v = Vec::new();
        for y in (0..ch).step_by(2) {
            for x in (0..cw).step_by(2) {
                let mut s = [0.0; 3];
                for (dx, dy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                    let p = px(x + dx, y + dy);
                    for c in 0..3 {
                        s[c] += p[c] / 4.0;
                    }
                }
                let [r, g, b] = s;
                u.push(128.0 + (-37.797 * r - 74.203 * g + 112.0 * b) / 255.0);
                v.push(128.0 + (112.0 * r - 93.786 * g - 18.214 * b) / 255.0);
            }
        }
        out.extend(u);
        out.extend(v);
        out
    }

    #[test]
    fn conversion_matches_bt601_within_one_level() {
        for (w, h) in [(64, 48), (37, 21), (1, 1), (2, 3)] {
            let f = noise(w, h, w * 31 + h);
            let yuv = Yuv420::from_rgb(&f);
            assert_eq!(yuv.bytes().len(), frame_bytes(w, h));
            let want = reference(&f);
            let worst = yuv
                .bytes()
                .iter()
                .zip(&want)
                .map(|(&a, &b)| (f64::from(a) - b).abs())
                .fold(0.0, f64::max);
            assert!(worst <= 1.0, "{w}x{h}: off by {worst}");
        }
    }

    /// The AVX2 build of the row conversion gives the same bytes as the plain one, and both
    /// the per-pixel formula (rows of every length, from the whole 0–255 range).
    #[test]
    fn the_vectorised_rows_equal_the_per_pixel_formula() {
        for width in [2usize, 6, 34, 96, 1282] {
            let f = noise(width as u32, 2, width as u32);
            let rows = [&f.rgb[..width * 3], &f.rgb[width * 3..]];
            type RowPair = fn([&[u8]; 2], [&mut [u8]; 2], &mut [u8], &mut [u8]);
            let run = |convert: RowPair| {
                let (mut y0, mut y1) = (vec![0; width], vec![0; width]);
                let (mut u, mut v) = (vec![0; width / 2], vec![0; width / 2]);
                convert(rows, [&mut y0, &mut y1], &mut u, &mut v);
                (y0, y1, u, v)
            };
            let dispatched = run(convert_row_pair);
            assert_eq!(dispatched, run(convert_row_pair_any));
            let (y0, y1, u, v) = dispatched;
            let px = |row: usize, x: usize| {
                let p = &rows[row][x * 3..x * 3 + 3];
                (i32::from(p[0]), i32::from(p[1]), i32::from(p[2]))
            };
            for x in 0..width {
                for (row, out) in [&y0, &y1].into_iter().enumerate() {
                    let (r, g, b) = px(row, x);
                    assert_eq!(
                        i32::from(out[x]),
                        ((66 * r + 129 * g + 25 * b + 128) >> 8) + 16
                    );
                }
            }
            for c in 0..width / 2 {
                let s = |k: usize| {
                    [(0, 2 * c), (0, 2 * c + 1), (1, 2 * c), (1, 2 * c + 1)]
                        .into_iter()
                        .map(|(row, x)| {
                            let p = px(row, x);
                            [p.0, p.1, p.2][k]
                        })
                        .sum::<i32>()
                };
                assert_eq!((u[c], v[c]), chroma4(s(0), s(1), s(2)));
            }
        }
    }

    /// A slot holding a frame of the same size is converted over in its own buffer, with the
    /// bytes a fresh conversion gives; a frame of another size replaces it.
    #[test]
    fn a_slot_is_converted_in_place_and_equals_a_fresh_conversion() {
        let mut slot = None;
        let first = convert_into(&mut slot, &noise(51, 39, 1)).bytes().as_ptr();
        let second = noise(51, 39, 2);
        let again = convert_into(&mut slot, &second);
        assert_eq!(again.bytes().as_ptr(), first);
        assert_eq!(*again, Yuv420::from_rgb(&second));
        let other = noise(20, 10, 3);
        assert_eq!(*convert_into(&mut slot, &other), Yuv420::from_rgb(&other));
    }

    #[test]
    fn a_patch_converts_exactly_as_the_whole_frame_would() {
        let (w, h) = (51, 39);
        let bg = noise(w, h, 1);
        let fg = noise(w, h, 2);
        // The whole foreground frame, against the background with the region pasted in.
        let region = Region::around(13, 7, 30, 26, w, h);
        assert_eq!(
            (region.x, region.y, region.width, region.height),
            (12, 6, 18, 20)
        );
        let mut composed = bg.clone();
        for y in region.y..region.y + region.height {
            for x in region.x..region.x + region.width {
                let i = (y * w + x) as usize * 3;
                composed.rgb[i..i + 3].copy_from_slice(&fg.rgb[i..i + 3]);
            }
        }
        let mut yuv = Yuv420::from_rgb(&bg);
        yuv.write_rgb(region.x, region.y, &region.crop(&fg));
        assert_eq!(yuv, Yuv420::from_rgb(&composed));
        // A region reaching the odd edge takes the padding from the last column and row.
        let edge = Region::around(40, 30, w, h, w, h);
        assert_eq!((edge.x + edge.width, edge.y + edge.height), (52, 40));
        let mut yuv = Yuv420::from_rgb(&bg);
        yuv.write_rgb(edge.x, edge.y, &edge.crop(&fg));
        let mut composed = bg.clone();
        for y in 30..h {
            for x in 40..w {
                let i = (y * w + x) as usize * 3;
                composed.rgb[i..i + 3].copy_from_slice(&fg.rgb[i..i + 3]);
            }
        }
        assert_eq!(yuv, Yuv420::from_rgb(&composed));
    }

    #[test]
    fn a_kept_frame_converts_only_the_region_and_equals_a_whole_conversion() {
        let (w, h) = (40, 30);
        let mut kept = Converted::default();
        let first = noise(w, h, 5);
        assert_eq!(kept.update(&first, None), &Yuv420::from_rgb(&first));
        let mut next = first.clone();
        let r = Region::around(9, 9, 21, 17, w, h);
        for y in 9..17 {
            for x in 9..21 {
                next.rgb[((y * w + x) * 3) as usize] ^= 0x5a;
            }
        }
        assert_eq!(kept.update(&next, Some(r)), &Yuv420::from_rgb(&next));
        // Another size: converted whole, whatever the region says.
        let small = noise(10, 8, 6);
        assert_eq!(kept.update(&small, Some(r)), &Yuv420::from_rgb(&small));
    }

    #[test]
    fn a_round_trip_keeps_smooth_colours() {
        let rgb = (0..32 * 32)
            .flat_map(|i| [(i % 32 * 8) as u8, (i / 32 * 8) as u8, 128])
            .collect();
        let f = Frame::new(32, 32, rgb);
        let back = Yuv420::from_rgb(&f).to_rgb();
        let worst = f
            .rgb
            .iter()
            .zip(&back.rgb)
            .map(|(&a, &b)| a.abs_diff(b))
            .max()
            .unwrap();
        assert!(worst <= 8, "{worst}");
    }
}
