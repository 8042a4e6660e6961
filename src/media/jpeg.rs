//! Baseline JPEG in restart segments: a frame encoded with a restart marker every few
//! macroblocks ([`encode_segmented`]: each MCU row cut into equal segments, [`segment_mcus`]
//! MCUs wide) can take new pixels in a rectangle by encoding only the segments over it and
//! copying the others' entropy-coded data ([`Segments::with_region`]).
//!
//! A restart marker resets the DC predictions and aligns the bit stream to a byte, and a
//! 4:2:0 MCU (16×16 pixels) is encoded from its own pixels only, so a segment's coded bytes
//! depend on nothing but its pixels and the tables. A frame that equals the base JPEG's
//! picture outside a rectangle is therefore, byte for byte, the base's segments outside it
//! and the segments over it encoded alone, with the restart markers numbered for their
//! place. Live sessions use it for frames whose face is all that changed (a photo's idle
//! frame, a clip's stored frame), where encoding the whole frame cost most of a frame's CPU;
//! [`Segments::decode_region`] decodes only the segments over a face the same way.
//!
//! A JPEG with one segment per MCU row (what this module wrote before segments were cut
//! narrower, and what clips stored then hold) is read the same way.

use std::ops::Range;

use super::image::Frame;
use super::yuv::Region;
use super::Error;

/// Pixels on a side of an MCU (4:2:0).
pub const MCU: u32 = 16;

/// The segment width [`segment_mcus`] aims at, in MCUs (64 pixels): a restart costs its
/// marker, the bits to the next byte and a DC value coded whole, a few bytes against a few
/// hundred for the segment, and a face 200–300 pixels wide spans 4–6 segments of a row.
const SEGMENT_AIM: u32 = 4;

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
    width.div_ceil(MCU)
}

/// The restart interval, in MCUs, of a frame with `columns` MCU columns: the largest divisor
/// of `columns` up to [`SEGMENT_AIM`] other than 1, else its smallest divisor above that (the
/// whole row when `columns` is a prime), so that segments never straddle two rows.
pub fn segment_mcus(columns: u32) -> u32 {
    (2..=SEGMENT_AIM)
        .rev()
        .chain(SEGMENT_AIM + 1..columns)
        .find(|d| columns % d == 0)
        .unwrap_or(columns.max(1))
}

/// Encodes `frame` as baseline 4:2:0 JPEG at `quality` (1–100) with a restart marker every
/// [`segment_mcus`] MCUs, into `out`: the picture [`super::image::encode_jpeg`] gives, a few
/// bytes larger.
pub fn encode_segmented(frame: &Frame, quality: u8, out: &mut Vec<u8>) -> Result<(), Error> {
    encode(frame, quality, true, out)
}

/// Baseline 4:2:0 at every quality (the crate's default above 89 is 4:4:4), with a restart
/// marker every [`segment_mcus`] MCUs when `segmented`.
pub(super) fn encode(
    frame: &Frame,
    quality: u8,
    segmented: bool,
    out: &mut Vec<u8>,
) -> Result<(), Error> {
    let mut e = jpeg_encoder::Encoder::new(out, quality);
    e.set_sampling_factor(jpeg_encoder::SamplingFactor::F_2_2);
    if segmented {
        e.set_restart_interval(side(segment_mcus(mcu_columns(frame.width)))?);
    }
    e.encode(
        &frame.rgb,
        side(frame.width)?,
        side(frame.height)?,
        jpeg_encoder::ColorType::Rgb,
    )
    .map_err(failed)
}

/// Writes `total` segments' coded data as a scan: a restart marker, numbered from RST0 modulo
/// 8, after each but the last, and the end of the image after it.
fn write_scan<'d>(out: &mut Vec<u8>, coded: impl Iterator<Item = &'d [u8]>, total: usize) {
    for (k, data) in coded.enumerate() {
        out.extend_from_slice(data);
        let marker = if k + 1 < total {
            RST0 + (k % 8) as u8
        } else {
            EOI
        };
        out.extend_from_slice(&[0xFF, marker]);
    }
}

/// A JPEG from [`encode_segmented`], cut into its parts.
#[derive(Debug)]
pub struct Segments<'a> {
    bytes: &'a [u8],
    /// Everything up to the first segment's coded data (the headers, the scan header last).
    head: Range<usize>,
    /// Where the frame header's height and width are (two bytes each).
    size_at: usize,
    width: u32,
    height: u32,
    /// MCUs in a segment (the restart interval), and segments in an MCU row.
    interval: u32,
    per_row: u32,
    /// Each segment's coded data, without its restart marker, in raster order.
    segments: Vec<Range<usize>>,
    /// The quantization tables (0: luma, 1: chroma) in natural order.
    tables: [[u16; 64]; 2],
}

/// Segment columns and MCU rows: a rectangle of whole segments.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Blocks {
    columns: Range<u32>,
    rows: Range<u32>,
}

impl Blocks {
    fn is_empty(&self) -> bool {
        self.columns.is_empty() || self.rows.is_empty()
    }
}

impl<'a> Segments<'a> {
    /// `bytes` cut into its parts, or `None` unless it is a baseline YCbCr JPEG with 4:2:0
    /// sampling and a restart interval that divides its MCU rows (a JPEG from elsewhere, or
    /// one stored before frames were stored by segments or rows).
    pub fn parse(bytes: &'a [u8]) -> Option<Segments<'a>> {
        let b = bytes;
        if b.get(..2)? != [0xFF, SOI] {
            return None;
        }
        let mut at = 2;
        let (mut size, mut size_at, mut interval) = (None, 0, None);
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
                    size_at = at + 5;
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
        let interval = u32::from(interval?);
        if interval == 0 || mcu_columns(width) % interval != 0 {
            return None;
        }
        let per_row = mcu_columns(width) / interval;
        // The coded data: 0xFF 0x00 is a data byte, 0xFF RSTn ends a segment, 0xFF EOI the
        // scan.
        let mut segments = Vec::new();
        let mut start = scan;
        let mut i = scan;
        loop {
            let ff = i + memchr::memchr(0xFF, b.get(i..)?)?;
            let next = *b.get(ff + 1)?;
            match next {
                0x00 => i = ff + 2,
                RST0..=0xD7 => {
                    if next - RST0 != (segments.len() % 8) as u8 {
                        return None;
                    }
                    segments.push(start..ff);
                    start = ff + 2;
                    i = start;
                }
                EOI => {
                    segments.push(start..ff);
                    break;
                }
                _ => return None,
            }
        }
        if segments.len() != (per_row * height.div_ceil(MCU)) as usize {
            return None;
        }
        Some(Segments {
            bytes,
            head: 0..scan,
            size_at,
            width,
            height,
            interval,
            per_row,
            segments,
            tables,
        })
    }

    /// The picture's size.
    pub fn size(&self) -> (u32, u32) {
        (self.width, self.height)
    }

    /// Segments in a row of MCUs (1: a restart per row, as this module wrote before
    /// segments were cut narrower).
    pub fn per_row(&self) -> u32 {
        self.per_row
    }

    fn mcu_rows(&self) -> u32 {
        self.height.div_ceil(MCU)
    }

    /// The segments that hold the pixels of `changed` (the part of it inside the picture;
    /// nothing for an empty change or one past the picture's edge).
    fn blocks(&self, changed: &Region) -> Blocks {
        let across = self.interval * MCU;
        let x0 = (changed.x / across).min(self.per_row);
        let y0 = (changed.y / MCU).min(self.mcu_rows());
        if changed.width == 0
            || changed.height == 0
            || changed.x >= self.width
            || changed.y >= self.height
        {
            return Blocks {
                columns: x0..x0,
                rows: y0..y0,
            };
        }
        let x1 = (changed.x + changed.width).min(self.width).div_ceil(across);
        let y1 = (changed.y + changed.height).min(self.height).div_ceil(MCU);
        Blocks {
            columns: x0..x1.max(x0),
            rows: y0..y1.max(y0),
        }
    }

    /// The pixels of `blocks` (cut at the picture's edges).
    fn pixels(&self, blocks: &Blocks) -> Region {
        let across = self.interval * MCU;
        let x = (blocks.columns.start * across).min(self.width);
        let y = (blocks.rows.start * MCU).min(self.height);
        Region {
            x,
            y,
            width: (blocks.columns.end * across).min(self.width) - x,
            height: (blocks.rows.end * MCU).min(self.height) - y,
        }
    }

    /// The rectangle of whole segments over `changed`: what [`Segments::decode_region`]
    /// decodes and [`Segments::with_region`] encodes for it.
    pub fn cover(&self, changed: &Region) -> Region {
        self.pixels(&self.blocks(changed))
    }

    /// The JPEG of `frame`, whose pixels equal this JPEG's source outside `changed`: the
    /// segments that hold `changed` encoded from `frame` with this JPEG's tables, the others
    /// copied (byte for byte what [`encode_segmented`] would give for `frame`). `None` when
    /// this JPEG's headers are not what the encoder writes for its tables (another encoder,
    /// or optimised Huffman tables): encode the frame whole.
    pub fn with_region(&self, frame: &Frame, changed: &Region) -> Result<Option<Vec<u8>>, Error> {
        if (frame.width, frame.height) != (self.width, self.height) {
            return Err(Error::Internal(format!(
                "a {}x{} frame on a {}x{} JPEG",
                frame.width, frame.height, self.width, self.height
            )));
        }
        let blocks = self.blocks(changed);
        let part = self.pixels(&blocks).crop(frame);
        self.splice(&part, &blocks)
    }

    /// [`Segments::with_region`] from the changed segments alone: `part` is the picture's
    /// pixels at `at` that [`Segments::decode_region`] gave (whole segments), drawn on.
    pub fn with_part(&self, part: &Frame, at: (u32, u32)) -> Result<Option<Vec<u8>>, Error> {
        let place = Region {
            x: at.0,
            y: at.1,
            width: part.width,
            height: part.height,
        };
        let blocks = self.blocks(&place);
        if self.pixels(&blocks) != place && !(blocks.is_empty() && part.rgb.is_empty()) {
            return Err(Error::Internal(format!(
                "{}x{} pixels at {at:?} are not whole segments of a {}x{} JPEG",
                part.width, part.height, self.width, self.height
            )));
        }
        self.splice(part, &blocks)
    }

    /// The pixels of the segments over `changed` ([`Segments::cover`]), decoded alone, and
    /// where they are: the same pixels as the whole picture decoded, as the segments around
    /// them are decoded with them (a decoder's chroma upsampling reads the pixels next to
    /// each).
    pub fn decode_region(&self, changed: &Region) -> Result<(Frame, (u32, u32)), Error> {
        let blocks = self.blocks(changed);
        let want = self.pixels(&blocks);
        if blocks.is_empty() {
            return Ok((Frame::new(0, 0, Vec::new()), (want.x, want.y)));
        }
        let context = Blocks {
            columns: blocks.columns.start.saturating_sub(1)
                ..(blocks.columns.end + 1).min(self.per_row),
            rows: blocks.rows.start.saturating_sub(1)..(blocks.rows.end + 1).min(self.mcu_rows()),
        };
        let around = self.pixels(&context);
        let mut jpeg = Vec::with_capacity(self.bytes.len() / 2);
        jpeg.extend_from_slice(&self.bytes[self.head.clone()]);
        jpeg[self.size_at..self.size_at + 2].copy_from_slice(&side(around.height)?.to_be_bytes());
        jpeg[self.size_at + 2..self.size_at + 4]
            .copy_from_slice(&side(around.width)?.to_be_bytes());
        let per_row = self.per_row;
        let coded = context
            .rows
            .clone()
            .flat_map(|r| {
                context
                    .columns
                    .clone()
                    .map(move |c| (r * per_row + c) as usize)
            })
            .map(|g| &self.bytes[self.segments[g].clone()]);
        write_scan(&mut jpeg, coded, context.columns.len() * context.rows.len());
        let decoded = super::image::decode_jpeg(std::io::Cursor::new(&jpeg))?;
        let inner = Region {
            x: want.x - around.x,
            y: want.y - around.y,
            ..want
        };
        Ok((inner.crop(&decoded), (want.x, want.y)))
    }

    /// This JPEG with the segments of `blocks` encoded from `part` (their pixels).
    fn splice(&self, part: &Frame, blocks: &Blocks) -> Result<Option<Vec<u8>>, Error> {
        let mut coded = Vec::new();
        if !blocks.is_empty() {
            let mut e = jpeg_encoder::Encoder::new(&mut coded, 100);
            e.set_sampling_factor(jpeg_encoder::SamplingFactor::F_2_2);
            e.set_restart_interval(side(self.interval)?);
            e.set_quantization_tables(
                jpeg_encoder::QuantizationTableType::Custom(Box::new(self.tables[0])),
                jpeg_encoder::QuantizationTableType::Custom(Box::new(self.tables[1])),
            );
            e.encode(
                &part.rgb,
                side(part.width)?,
                side(part.height)?,
                jpeg_encoder::ColorType::Rgb,
            )
            .map_err(failed)?;
        }
        let new = if blocks.is_empty() {
            None
        } else {
            match Segments::parse(&coded) {
                Some(s)
                    if s.same_head(self)
                        && s.segments.len() == blocks.columns.len() * blocks.rows.len() =>
                {
                    Some(s)
                }
                _ => return Ok(None),
            }
        };
        let mut out = Vec::with_capacity(self.bytes.len() + coded.len());
        out.extend_from_slice(&self.bytes[self.head.clone()]);
        let across = blocks.columns.len();
        let coded = self.segments.iter().enumerate().map(|(g, own)| {
            let (r, c) = ((g as u32) / self.per_row, (g as u32) % self.per_row);
            match &new {
                Some(s) if blocks.rows.contains(&r) && blocks.columns.contains(&c) => {
                    let k = (r - blocks.rows.start) as usize * across
                        + (c - blocks.columns.start) as usize;
                    &s.bytes[s.segments[k].clone()]
                }
                _ => &self.bytes[own.clone()],
            }
        });
        write_scan(&mut out, coded, self.segments.len());
        Ok(Some(out))
    }

    /// Whether `other`'s headers are this JPEG's but for the picture's size (so its
    /// segments' coded data can stand in for this one's).
    fn same_head(&self, other: &Segments<'_>) -> bool {
        let (a, b) = (
            &self.bytes[self.head.clone()],
            &other.bytes[other.head.clone()],
        );
        a.len() == b.len()
            && self.size_at == other.size_at
            && self.interval == other.interval
            && a.iter()
                .zip(b)
                .enumerate()
                .all(|(i, (x, y))| x == y || (self.size_at..self.size_at + 4).contains(&i))
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
        // Smooth gradients with noise: coded segments of many sizes.
        let rgb = (0..w * h * 3)
            .map(|i| {
                let (p, c) = (i / 3, i % 3);
                let (x, y) = (p % w, p / w);
                ((x * (c + 1) + y * 2) % 200 + rng.in_range(0..40)) as u8
            })
            .collect();
        Frame::new(w, h, rgb)
    }

    /// `frame` encoded as [`encode_segmented`] does, with one segment per MCU row when
    /// `by_rows` (what clips stored before segments were narrower hold).
    fn encoded(frame: &Frame, quality: u8, by_rows: bool) -> Vec<u8> {
        let mut out = Vec::new();
        if by_rows {
            let mut e = jpeg_encoder::Encoder::new(&mut out, quality);
            e.set_sampling_factor(jpeg_encoder::SamplingFactor::F_2_2);
            e.set_restart_interval(mcu_columns(frame.width) as u16);
            e.encode(
                &frame.rgb,
                frame.width as u16,
                frame.height as u16,
                jpeg_encoder::ColorType::Rgb,
            )
            .unwrap();
        } else {
            encode_segmented(frame, quality, &mut out).unwrap();
        }
        out
    }

    #[test]
    fn segments_divide_the_rows() {
        for (columns, want) in [(1, 1), (2, 2), (3, 3), (5, 5), (7, 7), (32, 4), (45, 3)] {
            assert_eq!(segment_mcus(columns), want, "{columns} columns");
        }
        assert_eq!(segment_mcus(80), 4); // 1280 pixels
        assert_eq!(segment_mcus(25), 5);
        assert_eq!(segment_mcus(49), 7);
        for columns in 1..400 {
            let s = segment_mcus(columns);
            assert!(s >= 1 && columns % s == 0, "{columns} columns");
        }
    }

    #[test]
    fn new_segments_spliced_in_are_the_whole_frame_encoded() {
        let mut rng = Rng::new(7);
        for case in 0..80u64 {
            let w = rng.in_range(1..300);
            let h = rng.in_range(1..120);
            let quality = [95, 85, 80, 50][case as usize % 4];
            let by_rows = case % 5 == 4;
            let base = noise(w, h, case);
            let base_jpeg = encoded(&base, quality, by_rows);
            let segments = Segments::parse(&base_jpeg).expect("a JPEG by segments");
            assert_eq!(segments.size(), (w, h));
            // Another picture in any rectangle, not aligned to MCUs.
            let (x0, y0) = (rng.in_range(0..w), rng.in_range(0..h));
            let (x1, y1) = (rng.in_range(x0..w + 1), rng.in_range(y0..h + 1));
            let changed = Region {
                x: x0,
                y: y0,
                width: x1 - x0,
                height: y1 - y0,
            };
            let other = noise(w, h, 1000 + case);
            let mut frame = base.clone();
            let stride = w as usize * 3;
            for y in y0 as usize..y1 as usize {
                let row = y * stride + x0 as usize * 3..y * stride + x1 as usize * 3;
                frame.rgb[row.clone()].copy_from_slice(&other.rgb[row]);
            }
            let whole = encoded(&frame, quality, by_rows);
            let spliced = segments
                .with_region(&frame, &changed)
                .unwrap()
                .expect("same tables");
            assert!(
                spliced == whole,
                "case {case}: {w}x{h} q{quality}, {changed:?}"
            );
            // The segments over the change decoded alone are those pixels of the whole
            // picture decoded, and spliced back from them give what the whole decoded
            // picture gives.
            let decoded =
                super::super::image::decode_jpeg(std::io::Cursor::new(&base_jpeg)).unwrap();
            let (part, at) = segments.decode_region(&changed).unwrap();
            let cover = segments.cover(&changed);
            assert_eq!(
                (at, part.width, part.height),
                ((cover.x, cover.y), cover.width, cover.height)
            );
            if changed.width > 0 && changed.height > 0 {
                assert!(
                    cover.x <= x0
                        && cover.y <= y0
                        && cover.x + cover.width >= x1
                        && cover.y + cover.height >= y1,
                    "case {case}: {cover:?} does not hold {changed:?}"
                );
            } else {
                assert!(cover.width == 0 || cover.height == 0, "case {case}");
            }
            assert!(
                part == cover.crop(&decoded),
                "case {case}: {cover:?} decoded alone differs"
            );
            let from_whole = segments.with_region(&decoded, &changed).unwrap().unwrap();
            assert!(
                segments.with_part(&part, at).unwrap().unwrap() == from_whole,
                "case {case}"
            );
        }
    }

    #[test]
    fn a_jpeg_without_restarts_is_not_taken() {
        let f = noise(64, 48, 1);
        let mut plain = Vec::new();
        super::super::image::encode_jpeg(&f, 85, &mut plain).unwrap();
        assert!(Segments::parse(&plain).is_none());
        let segmented = encoded(&f, 85, false);
        assert!(Segments::parse(&segmented).is_some());
        // Cut short, or with a byte of its coded data turned into a marker: refused, no panic.
        for cut in [10, segmented.len() / 2, segmented.len() - 1] {
            assert!(Segments::parse(&segmented[..cut]).is_none());
        }
        let mut broken = segmented.clone();
        let at = broken.len() - 20;
        broken[at] = 0xFF;
        broken[at + 1] = 0xC4;
        assert!(Segments::parse(&broken).is_none());
        // A restart interval that does not divide the rows.
        let mut odd = Vec::new();
        let mut e = jpeg_encoder::Encoder::new(&mut odd, 85);
        e.set_sampling_factor(jpeg_encoder::SamplingFactor::F_2_2);
        e.set_restart_interval(3);
        e.encode(&f.rgb, 64, 48, jpeg_encoder::ColorType::Rgb)
            .unwrap();
        assert!(Segments::parse(&odd).is_none());
    }

    #[test]
    fn a_change_past_the_edges_holds_nothing_outside() {
        let f = noise(200, 20, 4);
        let j = encoded(&f, 85, false);
        let segments = Segments::parse(&j).unwrap();
        let decoded = super::super::image::decode_jpeg(std::io::Cursor::new(&j)).unwrap();
        let at = |x, y, width, height| Region {
            x,
            y,
            width,
            height,
        };
        for changed in [
            at(0, 20, 200, 0),
            at(0, 21, 200, 9),
            at(190, 35, 50, 1),
            at(0, 16, 200, 24),
            at(200, 0, 10, 20),
            at(150, 4, 100, 100),
            at(10, 10, 0, 5),
        ] {
            let cover = segments.cover(&changed);
            let outside = changed.x >= 200 || changed.y >= 20 || changed.width == 0;
            assert!(
                !outside || cover.width == 0 || cover.height == 0,
                "{changed:?}: {cover:?}"
            );
            assert!(
                cover.x + cover.width <= 200 && cover.y + cover.height <= 20,
                "{changed:?}: {cover:?}"
            );
            assert!(segments.with_region(&f, &changed).unwrap().is_some());
            let (part, at) = segments.decode_region(&changed).unwrap();
            assert_eq!(part.rgb.len(), (part.width * part.height * 3) as usize);
            assert_eq!(
                segments.with_part(&part, at).unwrap(),
                segments.with_region(&decoded, &changed).unwrap()
            );
        }
    }

    #[test]
    fn pixels_that_are_not_whole_segments_are_an_error() {
        let j = encoded(&noise(128, 32, 2), 85, false);
        let segments = Segments::parse(&j).unwrap();
        assert!(segments
            .with_region(
                &noise(32, 16, 3),
                &segments.cover(&Region {
                    x: 0,
                    y: 0,
                    width: 8,
                    height: 8
                })
            )
            .is_err());
        assert!(segments.with_part(&noise(64, 16, 3), (8, 0)).is_err());
        assert!(segments.with_part(&noise(64, 10, 3), (0, 0)).is_err());
        assert!(segments
            .with_part(&noise(64, 16, 3), (64, 16))
            .unwrap()
            .is_some());
    }
}
