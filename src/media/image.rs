//! Avatar images in: PNG, JPEG or WebP bytes to an RGB frame, and OpenCV-exact bilinear
//! resizing (the crops Wav2Lip was trained on came from `cv2.resize`).

use std::io::Cursor;
use std::ops::Range;

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader};

use crate::media::Error;

/// Default largest image accepted, in pixels (decompression bombs are refused before their
/// pixels are decoded).
pub const DEFAULT_MAX_PIXELS: u64 = 40_000_000;

/// Default longest side of the output video: larger photos are downscaled first.
pub const DEFAULT_MAX_SIDE: u32 = 1920;

/// An 8-bit RGB image, rows top to bottom, no padding.
#[derive(Clone, PartialEq, Eq)]
pub struct Frame {
    pub width: u32,
    pub height: u32,
    /// `width · height · 3` bytes.
    pub rgb: Vec<u8>,
}

impl std::fmt::Debug for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Frame({}x{})", self.width, self.height)
    }
}

impl Frame {
    pub fn new(width: u32, height: u32, rgb: Vec<u8>) -> Self {
        assert_eq!(
            rgb.len(),
            width as usize * height as usize * 3,
            "frame size"
        );
        Frame { width, height, rgb }
    }

    /// Luma (ITU-R 601, as the face detector expects).
    pub fn gray(&self) -> Vec<u8> {
        self.rgb
            .chunks_exact(3)
            .map(|p| {
                ((u32::from(p[0]) * 299 + u32::from(p[1]) * 587 + u32::from(p[2]) * 114 + 500)
                    / 1000) as u8
            })
            .collect()
    }

    /// Writes the frame as an 8-bit RGB PNG.
    pub fn save_png(&self, path: &std::path::Path) -> std::io::Result<()> {
        image::save_buffer(
            path,
            &self.rgb,
            self.width,
            self.height,
            image::ColorType::Rgb8,
        )
        .map_err(std::io::Error::other)
    }
}

/// What `load` accepts.
#[derive(Debug, Clone, Copy)]
pub struct ImageLimits {
    /// Images with more pixels are refused before decoding.
    pub max_pixels: u64,
    /// Larger images are downscaled so their longer side is this long.
    pub max_side: u32,
}

impl Default for ImageLimits {
    fn default() -> Self {
        ImageLimits {
            max_pixels: DEFAULT_MAX_PIXELS,
            max_side: DEFAULT_MAX_SIDE,
        }
    }
}

fn image_error(e: image::ImageError) -> Error {
    use image::ImageError as E;
    match e {
        E::Unsupported(u) => Error::UnsupportedImage(u.to_string()),
        E::Limits(l) => Error::CorruptImage(format!("the image exceeds a decoder limit ({l})")),
        E::IoError(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            Error::CorruptImage("the image data stops early (truncated file?)".into())
        }
        e => Error::CorruptImage(e.to_string()),
    }
}

/// Decodes a PNG, JPEG or WebP avatar: format from the bytes, pixel limit checked from the
/// header, EXIF orientation applied, alpha dropped (colour channels as stored, like OpenCV's
/// `imread`), then downscaled if its longer side exceeds `limits.max_side`.
pub fn load(bytes: &[u8], limits: &ImageLimits) -> Result<Frame, Error> {
    Ok(downscale_to(
        decode(bytes, limits.max_pixels)?,
        limits.max_side,
    ))
}

/// [`load`] without the downscaling: the photo at its own size.
pub fn decode(bytes: &[u8], max_pixels: u64) -> Result<Frame, Error> {
    if bytes.is_empty() {
        return Err(Error::EmptyImage);
    }
    let format = image::guess_format(bytes).map_err(|_| Error::NotAnImage(sniff_other(bytes)))?;
    if !matches!(
        format,
        ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP
    ) {
        return Err(Error::UnsupportedImage(format!(
            "{format:?} images (send PNG, JPEG or WebP)"
        )));
    }
    let reader = || ImageReader::with_format(Cursor::new(bytes), format);
    let (w, h) = reader().into_dimensions().map_err(image_error)?;
    let pixels = u64::from(w) * u64::from(h);
    if pixels > max_pixels {
        return Err(Error::TooManyPixels {
            width: w,
            height: h,
            max_pixels,
        });
    }
    if pixels == 0 {
        return Err(Error::CorruptImage("the image has no pixels".into()));
    }
    // The decoders fill in what is missing from a file cut short (or skip what they cannot
    // read) instead of failing; a damaged photo must be refused, not rendered half grey.
    check_structure(bytes, format).map_err(Error::CorruptImage)?;
    let mut reader = reader();
    let mut decoder_limits = image::Limits::default();
    decoder_limits.max_alloc = Some(pixels.saturating_mul(16).max(1 << 20));
    reader.limits(decoder_limits);
    let mut decoder = reader.into_decoder().map_err(image_error)?;
    let orientation = decoder.orientation().map_err(image_error)?;
    let mut img = DynamicImage::from_decoder(decoder).map_err(image_error)?;
    img.apply_orientation(orientation);
    let rgb = img.to_rgb8();
    let (w, h) = rgb.dimensions();
    Ok(Frame::new(w, h, rgb.into_raw()))
}

/// Checks that the file is complete and well-formed at the container level: every PNG chunk
/// present with a correct CRC up to `IEND`; every JPEG marker segment complete and the data
/// ending with an end-of-image marker; the WebP RIFF container as long as it says it is and
/// its chunks within it. `Err` says what is wrong, in words for the client.
pub fn check_structure(bytes: &[u8], format: ImageFormat) -> Result<(), String> {
    match format {
        ImageFormat::Png => check_png(bytes),
        ImageFormat::Jpeg => check_jpeg(bytes),
        ImageFormat::WebP => check_webp(bytes),
        _ => Ok(()),
    }
}

const TRUNCATED: &str = "the file stops early (truncated upload?)";

fn be32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// PNG: the signature, then chunks (length, type, data, CRC-32 of type and data) until `IEND`.
fn check_png(b: &[u8]) -> Result<(), String> {
    const SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";
    if !b.starts_with(SIGNATURE) {
        return Err("the PNG signature is damaged".into());
    }
    let mut at = SIGNATURE.len();
    loop {
        let no_end = || format!("{TRUNCATED}: the PNG has no IEND chunk");
        let (Some(len), Some(kind)) = (be32(b, at), b.get(at + 4..at + 8)) else {
            return Err(no_end());
        };
        if len > 0x7fff_ffff {
            return Err(format!("a PNG chunk at byte {at} has an impossible length"));
        }
        if !kind.iter().all(u8::is_ascii_alphabetic) {
            return Err(format!("the PNG chunk at byte {at} has no valid type"));
        }
        let data_end = at + 8 + len as usize;
        let Some(stored) = be32(b, data_end) else {
            return Err(format!(
                "{TRUNCATED}: the PNG's {} chunk is cut off",
                String::from_utf8_lossy(kind)
            ));
        };
        if crc32(&b[at + 4..data_end]) != stored {
            return Err(format!(
                "the PNG's {} chunk at byte {at} fails its CRC check",
                String::from_utf8_lossy(kind)
            ));
        }
        if kind == b"IEND" {
            return Ok(());
        }
        at = data_end + 4;
    }
}

/// CRC-32 (ISO-HDLC, as PNG uses), a byte at a time from a table.
fn crc32(bytes: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (n, e) in t.iter_mut().enumerate() {
            let mut c = n as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0xedb8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
            *e = c;
        }
        t
    });
    !bytes.iter().fold(!0u32, |c, &x| {
        table[((c ^ u32::from(x)) & 0xff) as usize] ^ (c >> 8)
    })
}

/// JPEG: start-of-image, marker segments of the length they give, after each start-of-scan
/// the entropy-coded data (where 0xFF is followed by a stuffed 0x00 or a restart marker) up
/// to the next marker, and finally an end-of-image marker after at least one frame and scan.
/// Bytes after the end-of-image marker are allowed (some cameras append data).
fn check_jpeg(b: &[u8]) -> Result<(), String> {
    if !b.starts_with(&[0xff, 0xd8]) {
        return Err("the JPEG start-of-image marker is damaged".into());
    }
    let no_end = || format!("{TRUNCATED}: the JPEG has no end-of-image marker");
    let (mut frame, mut scan) = (false, false);
    let mut at = 2;
    loop {
        match b.get(at) {
            None => return Err(no_end()),
            Some(0xff) => {}
            Some(_) => {
                return Err(format!(
                    "the JPEG has no marker where one belongs (byte {at})"
                ))
            }
        }
        // Any number of 0xFF fill bytes may come before a marker code.
        while b.get(at) == Some(&0xff) {
            at += 1;
        }
        let Some(&code) = b.get(at) else {
            return Err(no_end());
        };
        at += 1;
        match code {
            0xd9 if frame && scan => return Ok(()),
            0xd9 => return Err("the JPEG ends before any image data".into()),
            // Markers without a length: TEM and restart markers.
            0x01 | 0xd0..=0xd7 => continue,
            0x00 | 0xd8 => {
                return Err(format!("the JPEG has an invalid marker at byte {}", at - 2))
            }
            _ => {}
        }
        let len = match b.get(at..at + 2) {
            Some(l) => usize::from(u16::from_be_bytes([l[0], l[1]])),
            None => return Err(no_end()),
        };
        if len < 2 {
            return Err(format!(
                "the JPEG segment at byte {} has an impossible length",
                at - 2
            ));
        }
        let end = at + len;
        if end > b.len() {
            return Err(format!("{TRUNCATED}: a JPEG segment is cut off"));
        }
        match code {
            // Start of frame: every SOFn except DHT (C4), JPG (C8) and DAC (CC).
            0xc0..=0xcf if !matches!(code, 0xc4 | 0xc8 | 0xcc) => frame = true,
            0xda if !frame => return Err("the JPEG has image data before its frame header".into()),
            0xda => scan = true,
            _ => {}
        }
        at = end;
        if code == 0xda {
            // Entropy-coded data: runs until a 0xFF that starts a real marker.
            loop {
                let Some(ff) = b[at..].iter().position(|&x| x == 0xff) else {
                    return Err(no_end());
                };
                at += ff;
                match b.get(at + 1) {
                    None => return Err(no_end()),
                    Some(0x00 | 0xd0..=0xd7) => at += 2,
                    Some(0xff) => at += 1,
                    Some(_) => break,
                }
            }
        }
    }
}

/// WebP: `RIFF`, the size of what follows, `WEBP`, then chunks (fourcc, little-endian size,
/// data padded to an even length) that fill the size the header gives.
fn check_webp(b: &[u8]) -> Result<(), String> {
    if b.get(..4) != Some(b"RIFF") || b.get(8..12) != Some(b"WEBP") {
        return Err("the WebP RIFF header is damaged".into());
    }
    let riff_end = le32(b, 4).ok_or(TRUNCATED)? as usize + 8;
    if riff_end > b.len() {
        return Err(format!(
            "{TRUNCATED}: the WebP says it holds {riff_end} bytes but {} arrived",
            b.len()
        ));
    }
    let mut at = 12;
    let mut chunks = 0;
    while at < riff_end {
        let Some(len) = le32(b, at + 4).filter(|_| at + 8 <= riff_end) else {
            return Err(format!("the WebP chunk at byte {at} is cut off"));
        };
        let end = (at + 8).saturating_add(len as usize);
        if end > riff_end {
            return Err(format!(
                "the WebP chunk at byte {at} runs past the end of the file"
            ));
        }
        chunks += 1;
        at = end + (len as usize & 1);
    }
    if chunks == 0 {
        return Err("the WebP holds no image chunks".into());
    }
    Ok(())
}

/// Names common non-image uploads for a better error message.
fn sniff_other(b: &[u8]) -> String {
    let at = |i: usize, sig: &[u8]| b.get(i..i + sig.len()) == Some(sig);
    match () {
        _ if at(0, b"RIFF") && at(8, b"WAVE") => "WAV audio".into(),
        _ if at(0, b"ID3") || at(0, b"fLaC") || at(0, b"OggS") => "audio".into(),
        _ if at(4, b"ftyp") => "an MP4/M4A file".into(),
        _ if at(0, b"%PDF") => "a PDF document".into(),
        _ => "unrecognised data".into(),
    }
}

/// Encodes `frame` as a baseline 4:2:0 JPEG of the given quality (1–100) into `out`, with the
/// `jpeg-encoder` crate (AVX2 where the CPU has it). 4:2:0 is what the video encoder keeps of
/// the colour anyway; it halves the blocks to decode against the `image` crate's 4:4:4 (a
/// 1280×720 frame of similar size and quality after conversion to 4:2:0 decodes in about 0.8
/// of the time, and encodes in a third).
pub fn encode_jpeg(frame: &Frame, quality: u8, out: &mut Vec<u8>) -> Result<(), Error> {
    super::jpeg::encode(frame, quality, false, out)
}

/// Decodes a JPEG this process wrote (no limits: its size is known).
pub fn decode_jpeg(bytes: impl std::io::BufRead + std::io::Seek) -> Result<Frame, Error> {
    let img = ImageReader::with_format(bytes, ImageFormat::Jpeg)
        .decode()
        .map_err(|e| Error::Internal(format!("stored JPEG unreadable: {e}")))?
        .into_rgb8();
    let (w, h) = img.dimensions();
    Ok(Frame::new(w, h, img.into_raw()))
}

/// Downscales (area-averaging filter) so that the longer side is at most `max_side`;
/// smaller frames are returned unchanged.
pub fn downscale_to(frame: Frame, max_side: u32) -> Frame {
    let long = frame.width.max(frame.height);
    if long <= max_side || max_side == 0 {
        return frame;
    }
    let scale = f64::from(max_side) / f64::from(long);
    let w = ((f64::from(frame.width) * scale).round() as u32).max(1);
    let h = ((f64::from(frame.height) * scale).round() as u32).max(1);
    let buf = image::RgbImage::from_raw(frame.width, frame.height, frame.rgb)
        .expect("frame buffer has its own size");
    let out = image::imageops::resize(&buf, w, h, image::imageops::FilterType::Triangle);
    Frame::new(w, h, out.into_raw())
}

/// Per output coordinate: source index and the two fixed-point weights (sum 2048).
fn linear_coeffs(dst: usize, src: usize) -> Vec<(usize, [i32; 2])> {
    let inv_scale = dst as f64 / src as f64;
    let scale = 1.0 / inv_scale;
    (0..dst)
        .map(|d| {
            let mut f = ((d as f64 + 0.5) * scale - 0.5) as f32;
            let mut s = f.floor() as i64;
            f -= s as f32;
            if s < 0 {
                (f, s) = (0.0, 0);
            }
            if s >= src as i64 - 1 {
                (f, s) = (0.0, src as i64 - 1);
            }
            let w0 = ((1.0 - f) * 2048.0).round_ties_even() as i32;
            let w1 = (f * 2048.0).round_ties_even() as i32;
            (s as usize, [w0, w1])
        })
        .collect()
}

/// `cv2.resize(src, (dw, dh), interpolation=cv2.INTER_LINEAR)` for 8-bit images with `cn`
/// interleaved channels: half-pixel centres, no antialiasing, OpenCV's 11-bit fixed-point
/// weights and rounding. Matches OpenCV 5.0 exactly except, on some sizes, by 1 on the first and
/// last rows (measured in tests/reference/render_reference.py).
pub fn resize_linear(src: &[u8], sw: usize, sh: usize, cn: usize, dw: usize, dh: usize) -> Vec<u8> {
    resize_linear_window(src, sw, sh, cn, dw, dh, 0..dw, 0..dh)
}

/// The window `cols` × `rows` of [`resize_linear`]'s `dw` × `dh` output, row by row: the
/// same values, computing only the source rows and output pixels the window needs (a face
/// paste whose blend mask leaves most of the box untouched resizes only what it blends).
#[allow(clippy::too_many_arguments)]
pub fn resize_linear_window(
    src: &[u8],
    sw: usize,
    sh: usize,
    cn: usize,
    dw: usize,
    dh: usize,
    cols: Range<usize>,
    rows: Range<usize>,
) -> Vec<u8> {
    assert_eq!(src.len(), sw * sh * cn, "resize_linear source size");
    assert!(
        cols.end <= dw && rows.end <= dh,
        "resize_linear window outside the output"
    );
    if cols.is_empty() || rows.is_empty() {
        return Vec::new();
    }
    // The channel count as a constant where it is one of the usual ones, so the inner loops
    // unroll (a face paste is a few hundred of these per second per session).
    let w = Window { dw, dh, cols, rows };
    match cn {
        1 => resize_linear_cn::<1>(src, sw, sh, cn, w),
        3 => resize_linear_cn::<3>(src, sw, sh, cn, w),
        4 => resize_linear_cn::<4>(src, sw, sh, cn, w),
        _ => resize_linear_cn::<0>(src, sw, sh, cn, w),
    }
}

/// The part of a `dw` × `dh` resize that is computed.
struct Window {
    dw: usize,
    dh: usize,
    cols: Range<usize>,
    rows: Range<usize>,
}

/// [`resize_linear_window`] with `CN` channels, or `cn` where `CN` is 0.
fn resize_linear_cn<const CN: usize>(
    src: &[u8],
    sw: usize,
    sh: usize,
    cn: usize,
    w: Window,
) -> Vec<u8> {
    let cn = if CN == 0 { cn } else { CN };
    let xs = &linear_coeffs(w.dw, sw)[w.cols];
    let ys = &linear_coeffs(w.dh, sh)[w.rows];
    let row_len = xs.len() * cn;
    // Horizontal pass into one buffer of source rows, each computed once and only if the
    // vertical pass uses it.
    let mut rows = vec![0i32; sh * row_len];
    let mut done = vec![false; sh];
    let mut dst = vec![0u8; ys.len() * row_len];
    for (out, &(sy, [b0, b1])) in dst.chunks_exact_mut(row_len).zip(ys) {
        let sy1 = (sy + 1).min(sh - 1);
        for y in [sy, sy1] {
            if !done[y] {
                done[y] = true;
                let line = &src[y * sw * cn..(y + 1) * sw * cn];
                let row = &mut rows[y * row_len..(y + 1) * row_len];
                for (px, &(sx, [a0, a1])) in row.chunks_exact_mut(cn).zip(xs) {
                    let sx1 = (sx + 1).min(sw - 1);
                    let (p0, p1) = (&line[sx * cn..sx * cn + cn], &line[sx1 * cn..sx1 * cn + cn]);
                    for ((v, &q0), &q1) in px.iter_mut().zip(p0).zip(p1) {
                        *v = i32::from(q0) * a0 + i32::from(q1) * a1;
                    }
                }
            }
        }
        let r0 = &rows[sy * row_len..(sy + 1) * row_len];
        let r1 = &rows[sy1 * row_len..(sy1 + 1) * row_len];
        vertical(r0, r1, b0, b1, out);
    }
    dst
}

/// OpenCV's vectorised vertical step: 16-bit multiply-high, then a rounding shift; with
/// AVX2 where the CPU has it (the build targets plain x86-64, whose SSE2 has no 32-bit
/// multiply, so this loop would stay scalar). Integer arithmetic: the same bytes either way.
fn vertical(r0: &[i32], r1: &[i32], b0: i32, b1: i32, out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { vertical_avx2(r0, r1, b0, b1, out) };
        return;
    }
    vertical_any(r0, r1, b0, b1, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn vertical_avx2(r0: &[i32], r1: &[i32], b0: i32, b1: i32, out: &mut [u8]) {
    vertical_any(r0, r1, b0, b1, out);
}

#[inline(always)]
fn vertical_any(r0: &[i32], r1: &[i32], b0: i32, b1: i32, out: &mut [u8]) {
    for ((o, &s0), &s1) in out.iter_mut().zip(r0).zip(r1) {
        let v = (((s0 >> 4) * b0) >> 16) + (((s1 >> 4) * b1) >> 16);
        *o = ((v + 2) >> 2).clamp(0, 255) as u8;
    }
}

/// A seeded generator of numbers below its argument, for tests of many random shapes.
#[cfg(test)]
pub(crate) fn lcg(mut seed: u64) -> impl FnMut(usize) -> usize {
    move |m: usize| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as usize) % m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The implementation before the one-buffer rewrite, kept as its oracle.
    fn resize_linear_before(
        src: &[u8],
        sw: usize,
        sh: usize,
        cn: usize,
        dw: usize,
        dh: usize,
    ) -> Vec<u8> {
        assert_eq!(src.len(), sw * sh * cn, "resize_linear source size");
        if dw == 0 || dh == 0 {
            return Vec::new();
        }
        let xs = linear_coeffs(dw, sw);
        let ys = linear_coeffs(dh, sh);
        // Horizontal pass, only for the source rows the vertical pass uses.
        let row_len = dw * cn;
        let mut rows: Vec<Option<Vec<i32>>> = vec![None; sh];
        let hrow = |y: usize| -> Vec<i32> {
            let line = &src[y * sw * cn..(y + 1) * sw * cn];
            let mut out = Vec::with_capacity(row_len);
            for &(sx, [a0, a1]) in &xs {
                let sx1 = (sx + 1).min(sw - 1);
                for c in 0..cn {
                    out.push(
                        i32::from(line[sx * cn + c]) * a0 + i32::from(line[sx1 * cn + c]) * a1,
                    );
                }
            }
            out
        };
        let mut dst = Vec::with_capacity(dh * row_len);
        for &(sy, [b0, b1]) in &ys {
            let sy1 = (sy + 1).min(sh - 1);
            for y in [sy, sy1] {
                if rows[y].is_none() {
                    rows[y] = Some(hrow(y));
                }
            }
            let (r0, r1) = (rows[sy].as_ref().unwrap(), rows[sy1].as_ref().unwrap());
            // OpenCV's vectorised vertical step: 16-bit multiply-high, then a rounding shift.
            for (&s0, &s1) in r0.iter().zip(r1) {
                let v = (((s0 >> 4) * b0) >> 16) + (((s1 >> 4) * b1) >> 16);
                dst.push(((v + 2) >> 2).clamp(0, 255) as u8);
            }
        }
        dst
    }

    /// A random source (sides up to `src_max`, 1 to 5 channels) and output size (sides up to
    /// `dst_max`): `(src, sw, sh, cn, dw, dh)`.
    fn random_resize(
        next: &mut impl FnMut(usize) -> usize,
        src_max: usize,
        dst_max: usize,
    ) -> (Vec<u8>, usize, usize, usize, usize, usize) {
        let (sw, sh, cn) = (
            1 + next(src_max),
            1 + next(src_max),
            [1, 2, 3, 4, 5][next(5)],
        );
        let (dw, dh) = (1 + next(dst_max), 1 + next(dst_max));
        let src: Vec<u8> = (0..sw * sh * cn).map(|_| next(256) as u8).collect();
        (src, sw, sh, cn, dw, dh)
    }

    #[test]
    fn the_rewrite_gives_the_same_bytes_as_before_for_every_shape() {
        let mut next = lcg(12345);
        for _ in 0..300 {
            let (src, sw, sh, cn, dw, dh) = random_resize(&mut next, 140, 200);
            assert_eq!(
                resize_linear(&src, sw, sh, cn, dw, dh),
                resize_linear_before(&src, sw, sh, cn, dw, dh),
                "{sw}x{sh}x{cn} -> {dw}x{dh}"
            );
        }
    }

    #[test]
    fn a_window_of_the_resize_is_that_part_of_the_whole_resize() {
        let mut next = lcg(777);
        for _ in 0..300 {
            let (src, sw, sh, cn, dw, dh) = random_resize(&mut next, 120, 220);
            let (x0, y0) = (next(dw + 1), next(dh + 1));
            let (x1, y1) = (x0 + next(dw - x0 + 1), y0 + next(dh - y0 + 1));
            let whole = resize_linear(&src, sw, sh, cn, dw, dh);
            let want: Vec<u8> = (y0..y1)
                .flat_map(|y| whole[(y * dw + x0) * cn..(y * dw + x1) * cn].to_vec())
                .collect();
            assert_eq!(
                resize_linear_window(&src, sw, sh, cn, dw, dh, x0..x1, y0..y1),
                want,
                "{sw}x{sh}x{cn} -> {dw}x{dh}, window {x0}..{x1} x {y0}..{y1}"
            );
        }
    }

    #[test]
    fn resizing_a_constant_image_keeps_it_constant() {
        let src = vec![77u8; 13 * 7 * 3];
        for (dw, dh) in [(96, 96), (5, 3), (13, 7), (200, 9)] {
            assert!(resize_linear(&src, 13, 7, 3, dw, dh)
                .iter()
                .all(|&v| v == 77));
        }
    }

    #[test]
    fn identity_size_is_a_copy() {
        let src: Vec<u8> = (0..40 * 30 * 3).map(|i| (i * 7 % 256) as u8).collect();
        assert_eq!(resize_linear(&src, 40, 30, 3, 40, 30), src);
    }

    #[test]
    fn half_pixel_centres_halve_by_averaging_pairs() {
        // 4 -> 2 samples: output d maps to source 2d + 0.5, the mean of the pair.
        let src = [0u8, 100, 200, 250];
        assert_eq!(resize_linear(&src, 4, 1, 1, 2, 1), vec![50, 225]);
    }

    #[test]
    fn downscaling_respects_the_longest_side() {
        let f = Frame::new(400, 100, vec![10; 400 * 100 * 3]);
        let g = downscale_to(f.clone(), 200);
        assert_eq!((g.width, g.height), (200, 50));
        assert_eq!(downscale_to(f.clone(), 400), f);
    }
}
