//! Baseline JPEG in MCU rows: a frame encoded with a restart marker after every row of
//! macroblocks ([`encode_rows`]) can take new pixels in a few rows by encoding only those
//! rows and copying the others' entropy-coded data ([`Rows::with_rows`]).
//!
//! A restart marker resets the DC predictions and aligns the bit stream to a byte, and a
//! 4:2:0 MCU row (16 pixel rows) is encoded from its own pixels only, so a row's coded bytes
//! depend on nothing but its pixels, the tables and the width. A frame that equals the base
//! JPEG's picture outside some rows is therefore, byte for byte, the base's rows outside them
//! and the new rows encoded alone, with the restart markers numbered for their place. Live
//! sessions use it for frames whose face is all that changed (a photo's idle frame, a clip's
//! stored frame), where encoding the whole frame cost most of a frame's CPU.

use std::ops::Range;

use super::image::Frame;
use super::Error;

/// Pixel rows in an MCU row (4:2:0).
pub const MCU_ROWS: u32 = 16;

const SOI: u8 = 0xD8;
const EOI: u8 = 0xD9;
const SOF0: u8 = 0xC0;
const DQT: u8 = 0xDB;
const DRI: u8 = 0xDD;
const SOS: u8 = 0xDA;
const RST0: u8 = 0xD0;

/// JPEG's zig-zag order: the natural (row-major) index of each coefficient as a DQT lists them.
const ZIGZAG: [usize; 64] = [
    0, 1, 8, 16, 9, 2, 3, 10, 17, 24, 32, 25, 18, 11, 4, 5, 12, 19, 26, 33, 40, 48, 41, 34, 27, 20,
    13, 6, 7, 14, 21, 28, 35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51, 58, 59,
    52, 45, 38, 31, 39, 46, 53, 60, 61, 54, 47, 55, 62, 63,
];

fn failed(e: impl std::fmt::Display) -> Error {
    Error::Internal(format!("JPEG encoding failed: {e}"))
}

fn side(v: u32) -> Result<u16, Error> {
    u16::try_from(v).map_err(|_| failed(format!("a side of {v} px")))
}

/// MCU columns of a frame `width` pixels wide (4:2:0).
fn mcu_columns(width: u32) -> u32 {
    width.div_ceil(MCU_ROWS)
}

/// Encodes `frame` as baseline 4:2:0 JPEG at `quality` (1–100) with a restart marker after every
/// MCU row, into `out`: the picture [`super::image::encode_jpeg`] gives, a few bytes larger.
pub fn encode_rows(frame: &Frame, quality: u8, out: &mut Vec<u8>) -> Result<(), Error> {
    encode(frame, quality, true, out)
}

/// Baseline 4:2:0 at every quality (the crate's default above 89 is 4:4:4), with a restart
/// marker after every MCU row when `by_rows`.
pub(super) fn encode(
    frame: &Frame,
    quality: u8,
    by_rows: bool,
    out: &mut Vec<u8>,
) -> Result<(), Error> {
    let mut e = jpeg_encoder::Encoder::new(out, quality);
    e.set_sampling_factor(jpeg_encoder::SamplingFactor::F_2_2);
    if by_rows {
        e.set_restart_interval(side(mcu_columns(frame.width))?);
    }
    e.encode(
        &frame.rgb,
        side(frame.width)?,
        side(frame.height)?,
        jpeg_encoder::ColorType::Rgb,
    )
    .map_err(failed)
}

/// A JPEG from [`encode_rows`], cut into its parts.
#[derive(Debug)]
pub struct Rows<'a> {
    bytes: &'a [u8],
    /// Everything up to the first row's coded data (the headers, the scan header last).
    head: Range<usize>,
    /// Where the frame header's height is (two bytes).
    height_at: usize,
    width: u32,
    height: u32,
    /// Each MCU row's coded data, without its restart marker.
    rows: Vec<Range<usize>>,
    /// The quantization tables (0: luma, 1: chroma) in natural order.
    tables: [[u16; 64]; 2],
}

impl<'a> Rows<'a> {
    /// `bytes` cut into its parts, or `None` unless it is a baseline YCbCr JPEG with 4:2:0
    /// sampling and a restart interval of one MCU row (a JPEG from elsewhere, or one stored
    /// before frames were stored by rows).
    pub fn parse(bytes: &'a [u8]) -> Option<Rows<'a>> {
        let b = bytes;
        if b.get(..2)? != [0xFF, SOI] {
            return None;
        }
        let mut at = 2;
        let (mut size, mut height_at, mut interval) = (None, 0, None);
        let mut tables = [[0u16; 64]; 2];
        let mut have_tables = [false; 2];
        let scan = loop {
            if *b.get(at)? != 0xFF {
                return None;
            }
            let marker = *b.get(at + 1)?;
            let len = usize::from(u16::from_be_bytes([*b.get(at + 2)?, *b.get(at + 3)?]));
            let body = b.get(at + 4..at + 2 + len)?;
            match marker {
                SOF0 => {
                    // Precision 8, three components: Y 2×2 sampled, Cb and Cr 1×1.
                    if body.len() != 15 || body[0] != 8 || body[5] != 3 {
                        return None;
                    }
                    if [body[7], body[10], body[13]] != [0x22, 0x11, 0x11] {
                        return None;
                    }
                    height_at = at + 5;
                    size = Some((
                        u32::from(u16::from_be_bytes([body[3], body[4]])),
                        u32::from(u16::from_be_bytes([body[1], body[2]])),
                    ));
                }
                0xC1..=0xCF if marker != 0xC4 && marker != 0xC8 && marker != 0xCC => {
                    return None; // not baseline
                }
                DQT => {
                    let mut t = body;
                    while !t.is_empty() {
                        let (precision, id) = (t[0] >> 4, usize::from(t[0] & 15));
                        if precision != 0 || id > 1 || t.len() < 65 {
                            return None;
                        }
                        for (k, &natural) in ZIGZAG.iter().enumerate() {
                            tables[id][natural] = u16::from(t[1 + k]);
                        }
                        have_tables[id] = true;
                        t = &t[65..];
                    }
                }
                DRI => interval = Some(u16::from_be_bytes([*body.first()?, *body.get(1)?])),
                SOS => break at + 2 + len,
                _ => {}
            }
            at += 2 + len;
        };
        let (width, height) = size?;
        if width == 0 || height == 0 || have_tables != [true, true] {
            return None;
        }
        if u32::from(interval?) != mcu_columns(width) {
            return None;
        }
        // The coded data: 0xFF 0x00 is a data byte, 0xFF RSTn ends a row, 0xFF EOI the scan.
        let mut rows = Vec::new();
        let mut start = scan;
        let mut i = scan;
        loop {
            let ff = i + memchr::memchr(0xFF, b.get(i..)?)?;
            let next = *b.get(ff + 1)?;
            match next {
                0x00 => i = ff + 2,
                RST0..=0xD7 => {
                    if next - RST0 != (rows.len() % 8) as u8 {
                        return None;
                    }
                    rows.push(start..ff);
                    start = ff + 2;
                    i = start;
                }
                EOI => {
                    rows.push(start..ff);
                    break;
                }
                _ => return None,
            }
        }
        if rows.len() != height.div_ceil(MCU_ROWS) as usize {
            return None;
        }
        Some(Rows {
            bytes,
            head: 0..scan,
            height_at,
            width,
            height,
            rows,
            tables,
        })
    }

    /// The picture's size.
    pub fn size(&self) -> (u32, u32) {
        (self.width, self.height)
    }

    /// The MCU rows `first..end` that hold the pixel rows `changed`, and their pixel rows.
    /// A change that starts at or past the last pixel row holds no row.
    pub fn mcu_rows(&self, changed: Range<u32>) -> (Range<u32>, Range<u32>) {
        let first = (changed.start / MCU_ROWS).min(self.rows.len() as u32);
        let end = changed.end.min(self.height).div_ceil(MCU_ROWS).max(first);
        (
            first..end,
            (first * MCU_ROWS).min(self.height)..(end * MCU_ROWS).min(self.height),
        )
    }

    /// The JPEG of `frame`, whose pixels equal this JPEG's source outside the pixel rows
    /// `changed`: the MCU rows that hold `changed` encoded from `frame` with this JPEG's
    /// tables, the others copied (byte for byte what [`encode_rows`] would give for `frame`).
    /// `None` when this JPEG's headers are not what the encoder writes for its tables (another
    /// encoder, or optimised Huffman tables): encode the frame whole.
    pub fn with_rows(&self, frame: &Frame, changed: Range<u32>) -> Result<Option<Vec<u8>>, Error> {
        if (frame.width, frame.height) != (self.width, self.height) {
            return Err(Error::Internal(format!(
                "a {}x{} frame on a {}x{} JPEG",
                frame.width, frame.height, self.width, self.height
            )));
        }
        let (mcus, pixels) = self.mcu_rows(changed);
        let stride = frame.width as usize * 3;
        let rgb = &frame.rgb[pixels.start as usize * stride..pixels.end as usize * stride];
        self.splice(rgb, mcus)
    }

    /// [`Rows::with_rows`] from the changed rows alone: `band` is the picture's pixel rows
    /// from `top`, which [`Rows::decode_rows`] gave (the MCU rows over the change).
    pub fn with_band(&self, band: &Frame, top: u32) -> Result<Option<Vec<u8>>, Error> {
        let (mcus, pixels) = self.mcu_rows(top..top + band.height);
        if band.width != self.width || pixels != (top..top + band.height) {
            return Err(Error::Internal(format!(
                "a band of {}x{} from row {top} is not whole MCU rows of a {}x{} JPEG",
                band.width, band.height, self.width, self.height
            )));
        }
        self.splice(&band.rgb, mcus)
    }

    /// The pixel rows of the MCU rows over `changed` (see [`Rows::mcu_rows`]), decoded
    /// alone, and the first of them: the same pixels as the whole picture decoded, as one MCU
    /// row more on each side is decoded with them (a decoder's chroma upsampling reads the
    /// rows next to each).
    pub fn decode_rows(&self, changed: Range<u32>) -> Result<(Frame, u32), Error> {
        let (mcus, pixels) = self.mcu_rows(changed);
        let n = self.rows.len() as u32;
        let context = mcus.start.saturating_sub(1)..(mcus.end + 1).min(n);
        let top = context.start * MCU_ROWS;
        let height = (context.end * MCU_ROWS).min(self.height) - top;
        let mut jpeg = Vec::with_capacity(self.bytes.len() / 2);
        jpeg.extend_from_slice(&self.bytes[self.head.clone()]);
        jpeg[self.height_at..self.height_at + 2].copy_from_slice(&(height as u16).to_be_bytes());
        let last = context.end.saturating_sub(1);
        for r in context.clone() {
            jpeg.extend_from_slice(&self.bytes[self.rows[r as usize].clone()]);
            let marker = if r < last {
                RST0 + ((r - context.start) % 8) as u8
            } else {
                EOI
            };
            jpeg.extend_from_slice(&[0xFF, marker]);
        }
        let decoded = super::image::decode_jpeg(std::io::Cursor::new(&jpeg))?;
        let stride = self.width as usize * 3;
        let from = (pixels.start - top) as usize * stride;
        let rgb = decoded.rgb[from..from + pixels.len() * stride].to_vec();
        Ok((
            Frame::new(self.width, pixels.len() as u32, rgb),
            pixels.start,
        ))
    }

    /// This JPEG with MCU rows `mcus` encoded from `rgb` (their pixel rows).
    fn splice(&self, rgb: &[u8], mcus: Range<u32>) -> Result<Option<Vec<u8>>, Error> {
        let stride = self.width as usize * 3;
        let mut band = Vec::new();
        if !rgb.is_empty() {
            let mut e = jpeg_encoder::Encoder::new(&mut band, 100);
            e.set_sampling_factor(jpeg_encoder::SamplingFactor::F_2_2);
            e.set_restart_interval(side(mcu_columns(self.width))?);
            e.set_quantization_tables(
                jpeg_encoder::QuantizationTableType::Custom(Box::new(self.tables[0])),
                jpeg_encoder::QuantizationTableType::Custom(Box::new(self.tables[1])),
            );
            e.encode(
                rgb,
                side(self.width)?,
                side((rgb.len() / stride) as u32)?,
                jpeg_encoder::ColorType::Rgb,
            )
            .map_err(failed)?;
        }
        let band = if rgb.is_empty() {
            None
        } else {
            match Rows::parse(&band) {
                Some(r) if r.same_head(self) && r.rows.len() == mcus.len() => Some(r),
                _ => return Ok(None),
            }
        };
        let n = self.rows.len() as u32;
        let mut out =
            Vec::with_capacity(self.bytes.len() + band.as_ref().map_or(0, |b| b.bytes.len()));
        out.extend_from_slice(&self.bytes[self.head.clone()]);
        for r in 0..n {
            let coded = match &band {
                Some(b) if mcus.contains(&r) => &b.bytes[b.rows[(r - mcus.start) as usize].clone()],
                _ => &self.bytes[self.rows[r as usize].clone()],
            };
            out.extend_from_slice(coded);
            let marker = if r + 1 < n { RST0 + (r % 8) as u8 } else { EOI };
            out.extend_from_slice(&[0xFF, marker]);
        }
        Ok(Some(out))
    }

    /// Whether `other`'s headers are this JPEG's but for the height (so its rows' coded data
    /// can stand in for this one's).
    fn same_head(&self, other: &Rows<'_>) -> bool {
        let (a, b) = (
            &self.bytes[self.head.clone()],
            &other.bytes[other.head.clone()],
        );
        a.len() == b.len()
            && self.height_at == other.height_at
            && a.iter()
                .zip(b)
                .enumerate()
                .all(|(i, (x, y))| x == y || (self.height_at..self.height_at + 2).contains(&i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift64*).
    struct Rng(u64);

    impl Rng {
        fn new(seed: u64) -> Rng {
            Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
        }

        /// A number in `range`.
        fn in_range(&mut self, range: Range<u32>) -> u32 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let r = (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32;
            range.start + r % (range.end - range.start).max(1)
        }
    }

    fn noise(w: u32, h: u32, seed: u64) -> Frame {
        let mut rng = Rng::new(seed);
        // Smooth gradients with noise: coded rows of many sizes.
        let rgb = (0..w * h * 3)
            .map(|i| {
                let (p, c) = (i / 3, i % 3);
                let (x, y) = (p % w, p / w);
                ((x * (c + 1) + y * 2) % 200 + rng.in_range(0..40)) as u8
            })
            .collect();
        Frame::new(w, h, rgb)
    }

    #[test]
    fn new_rows_spliced_in_are_the_whole_frame_encoded() {
        let mut rng = Rng::new(7);
        for case in 0..60u64 {
            let w = rng.in_range(1..200);
            let h = rng.in_range(1..120);
            let quality = [95, 85, 80, 50][case as usize % 4];
            let base = noise(w, h, case);
            let mut base_jpeg = Vec::new();
            encode_rows(&base, quality, &mut base_jpeg).unwrap();
            let rows = Rows::parse(&base_jpeg).expect("a JPEG by rows");
            assert_eq!(rows.size(), (w, h));
            // Another picture in pixel rows y0..y1 (any rows, not aligned to MCUs).
            let y0 = rng.in_range(0..h);
            let y1 = rng.in_range(y0..h + 1);
            let other = noise(w, h, 1000 + case);
            let mut frame = base.clone();
            let stride = w as usize * 3;
            frame.rgb[y0 as usize * stride..y1 as usize * stride]
                .copy_from_slice(&other.rgb[y0 as usize * stride..y1 as usize * stride]);
            let mut whole = Vec::new();
            encode_rows(&frame, quality, &mut whole).unwrap();
            let spliced = rows
                .with_rows(&frame, y0..y1)
                .unwrap()
                .expect("same tables");
            assert!(
                spliced == whole,
                "case {case}: {w}x{h} q{quality}, rows {y0}..{y1}"
            );
            // The changed rows decoded alone are those rows of the whole picture decoded, and
            // spliced back from them give what the whole decoded picture gives.
            let decoded =
                super::super::image::decode_jpeg(std::io::Cursor::new(&base_jpeg)).unwrap();
            let (band, top) = rows.decode_rows(y0..y1).unwrap();
            let (_, pixels) = rows.mcu_rows(y0..y1);
            assert_eq!((top, band.height), (pixels.start, pixels.len() as u32));
            assert!(
                band.rgb == decoded.rgb[top as usize * stride..pixels.end as usize * stride],
                "case {case}: rows {pixels:?} decoded alone differ"
            );
            let from_whole = rows.with_rows(&decoded, y0..y1).unwrap().unwrap();
            assert!(
                rows.with_band(&band, top).unwrap().unwrap() == from_whole,
                "case {case}"
            );
        }
    }

    #[test]
    fn a_jpeg_without_row_restarts_is_not_taken() {
        let f = noise(64, 48, 1);
        let mut plain = Vec::new();
        super::super::image::encode_jpeg(&f, 85, &mut plain).unwrap();
        assert!(Rows::parse(&plain).is_none());
        let mut by_rows = Vec::new();
        encode_rows(&f, 85, &mut by_rows).unwrap();
        assert!(Rows::parse(&by_rows).is_some());
        // Cut short, or with a byte of its coded data turned into a marker: refused, no panic.
        for cut in [10, by_rows.len() / 2, by_rows.len() - 1] {
            assert!(Rows::parse(&by_rows[..cut]).is_none());
        }
        let mut broken = by_rows.clone();
        let at = broken.len() - 20;
        broken[at] = 0xFF;
        broken[at + 1] = 0xC4;
        assert!(Rows::parse(&broken).is_none());
    }

    #[test]
    fn a_change_past_the_last_row_holds_no_row() {
        let f = noise(40, 20, 4);
        let mut j = Vec::new();
        encode_rows(&f, 85, &mut j).unwrap();
        let rows = Rows::parse(&j).unwrap();
        for changed in [20..20, 21..30, 35..36, 16..40] {
            let (_, pixels) = rows.mcu_rows(changed.clone());
            assert!(
                pixels.start <= pixels.end && pixels.end <= 20,
                "{changed:?}"
            );
            assert!(rows.with_rows(&f, changed.clone()).unwrap().is_some());
            let (band, _) = rows.decode_rows(changed).unwrap();
            assert_eq!(band.rgb.len(), pixels.len() * 40 * 3);
        }
    }

    #[test]
    fn a_frame_of_another_size_is_an_error() {
        let mut j = Vec::new();
        encode_rows(&noise(32, 32, 2), 85, &mut j).unwrap();
        let rows = Rows::parse(&j).unwrap();
        assert!(rows.with_rows(&noise(32, 16, 3), 0..8).is_err());
    }
}
