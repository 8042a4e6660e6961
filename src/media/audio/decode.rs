//! Audio decoding: WAV through hound, MP3 / FLAC / Ogg Vorbis / M4A (AAC) through symphonia.
//!
//! The container is recognised from its first bytes (never the file name), and only those
//! containers are handed to a decoder, so an image or a text file is reported as "not audio"
//! instead of being scanned for MP3 frame headers. Channels are averaged to mono.
//!
//! Encoder delay is removed so that sound lines up with time 0: MP3 (LAME header) and Vorbis
//! by symphonia's gapless decoding, AAC in MP4 by the file's edit list, which symphonia
//! ignores (ffmpeg's AAC encoder primes 1024 samples, Apple's 2112).
//!
//! A file that ends early is an error ([`Error::TruncatedAudio`]) rather than a shorter clip:
//! a WAV whose data chunk is longer than the file, a FLAC or Ogg stream that stops mid-frame,
//! or an MP3/M4A that decodes to fewer frames than its header declares.

use std::io::Cursor;

use symphonia::core::codecs::audio::AudioDecoderOptions;
use symphonia::core::errors::Error as SymError;
use symphonia::core::formats::probe::ProbeableFormat;
use symphonia::core::formats::{FormatOptions, FormatReader, TrackType};
use symphonia::core::io::{MediaSourceStream, MediaSourceStreamOptions};

use crate::media::Error;

/// Decoded audio at its own sample rate.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    /// Mono samples (the mean of all channels), nominally in [−1, 1].
    pub samples: Vec<f32>,
    pub sample_rate: u32,
    pub channels: u16,
    /// `wav`, `mp3`, `flac`, `ogg`, `mp4` or `aac` (ADTS).
    pub container: &'static str,
    /// e.g. `pcm_s16le`, `mp3`, `vorbis`, `aac`.
    pub codec: String,
}

impl Decoded {
    pub fn seconds(&self) -> f64 {
        self.samples.len() as f64 / f64::from(self.sample_rate)
    }
}

/// Containers lipsync reads, recognised from the leading bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Container {
    Wav,
    Flac,
    Ogg,
    Mp3,
    Mp4,
    Adts,
}

impl Container {
    fn name(self) -> &'static str {
        match self {
            Container::Wav => "wav",
            Container::Flac => "flac",
            Container::Ogg => "ogg",
            Container::Mp3 => "mp3",
            Container::Mp4 => "mp4",
            Container::Adts => "aac",
        }
    }
}

fn sniff(b: &[u8]) -> Result<Container, Error> {
    let at = |i: usize, sig: &[u8]| b.get(i..i + sig.len()) == Some(sig);
    if at(0, b"RIFF") && at(8, b"WAVE") || at(0, b"RF64") || at(0, b"BW64") {
        return Ok(Container::Wav);
    }
    if at(0, b"fLaC") {
        return Ok(Container::Flac);
    }
    if at(0, b"OggS") {
        return Ok(Container::Ogg);
    }
    if at(0, b"ID3") {
        // An ID3v2 tag in front of MP3 (or, rarely, AAC or FLAC) data.
        let skip = id3v2_len(b);
        return match sniff(&b[skip.min(b.len())..]) {
            Ok(c @ (Container::Mp3 | Container::Adts | Container::Flac)) => Ok(c),
            _ if skip >= b.len() => Err(Error::NotAudio("an ID3 tag without audio".into())),
            _ => Err(Error::NotAudio(
                "an ID3 tag followed by unrecognised data".into(),
            )),
        };
    }
    if at(4, b"ftyp") {
        return Ok(Container::Mp4);
    }
    if b.len() >= 2 && b[0] == 0xff {
        if b[1] & 0xf6 == 0xf0 {
            return Ok(Container::Adts); // sync + layer 0
        }
        if b[1] & 0xe0 == 0xe0 && b[1] & 0x06 != 0 {
            return Ok(Container::Mp3); // MPEG audio frame sync, layer I–III
        }
    }
    let what = match () {
        _ if at(0, b"\x89PNG") => "a PNG image",
        _ if at(0, b"\xff\xd8\xff") => "a JPEG image",
        _ if at(0, b"RIFF") && at(8, b"WEBP") => "a WebP image",
        _ if at(0, b"GIF8") => "a GIF image",
        _ if at(0, b"%PDF") => "a PDF document",
        _ if at(0, b"PK\x03\x04") => "a zip archive",
        _ if at(0, b"\x1aE\xdf\xa3") => "a Matroska/WebM file (extract the audio first)",
        _ => "unrecognised data",
    };
    Err(Error::NotAudio(what.to_string()))
}

/// Length of a leading ID3v2 tag (header, body and optional footer).
fn id3v2_len(b: &[u8]) -> usize {
    let Some(h) = b.get(..10) else {
        return b.len();
    };
    // The size is "syncsafe": four 7-bit bytes.
    let size = h[6..10]
        .iter()
        .fold(0usize, |acc, &x| (acc << 7) | usize::from(x & 0x7f));
    let footer = if h[5] & 0x10 != 0 { 10 } else { 0 };
    10 + size + footer
}

/// Decodes an audio file held in memory. `max_seconds` bounds the work: longer audio is
/// refused, before decoding where the header tells the length.
pub fn decode(bytes: &[u8], max_seconds: f64) -> Result<Decoded, Error> {
    if bytes.is_empty() {
        return Err(Error::EmptyAudio);
    }
    let container = sniff(bytes)?;
    let decoded = match container {
        Container::Wav if !bytes.starts_with(b"RIFF") => {
            return Err(Error::UnsupportedCodec(
                "RF64/BW64 WAV (the over-4-GB variant)".into(),
            ))
        }
        Container::Wav => match decode_wav(bytes, max_seconds) {
            // Integer and float PCM are read here; other WAV codecs (µ-law, A-law, ADPCM) go
            // to symphonia.
            Err(Error::UnsupportedCodec(_)) => decode_symphonia(bytes, container, max_seconds)?,
            other => other?,
        },
        _ => decode_symphonia(bytes, container, max_seconds)?,
    };
    if decoded.samples.is_empty() {
        return Err(Error::NoSamples);
    }
    if decoded.samples.iter().any(|s| !s.is_finite()) {
        return Err(Error::NonFiniteAudio);
    }
    Ok(decoded)
}

fn too_long(frames: u64, rate: u32, max_seconds: f64) -> Result<(), Error> {
    let seconds = frames as f64 / f64::from(rate.max(1));
    if seconds > max_seconds {
        return Err(Error::AudioTooLong {
            seconds,
            max_seconds,
        });
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// WAV

/// Where a WAV file's samples are, from its RIFF chunk list.
struct WavLayout {
    /// Bytes per sample frame (all channels), from the `fmt ` chunk.
    block_align: usize,
    data_start: usize,
    /// Declared length; `None` for a streamed header (0 or 0xFFFFFFFF).
    data_len: Option<usize>,
}

fn wav_layout(b: &[u8]) -> Result<WavLayout, Error> {
    let mut pos = 12;
    let mut block_align = None;
    loop {
        let Some(head) = b.get(pos..pos + 8) else {
            return Err(Error::TruncatedAudio(
                "the WAV file ends before its data chunk".into(),
            ));
        };
        let size = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        match &head[..4] {
            b"fmt " => {
                block_align = b
                    .get(pos + 20..pos + 22)
                    .map(|a| usize::from(u16::from_le_bytes([a[0], a[1]])));
            }
            b"data" => {
                let block_align = block_align.filter(|&a| a > 0).ok_or_else(|| {
                    Error::CorruptAudio("WAV without a usable fmt chunk before its data".into())
                })?;
                return Ok(WavLayout {
                    block_align,
                    data_start: pos + 8,
                    data_len: (size != 0 && size != u32::MAX).then_some(size as usize),
                });
            }
            _ => {}
        }
        // Chunks are padded to an even size.
        pos = pos
            .checked_add(8 + size as usize + (size as usize & 1))
            .ok_or_else(|| Error::CorruptAudio("WAV chunk size overflows".into()))?;
    }
}

fn decode_wav(bytes: &[u8], max_seconds: f64) -> Result<Decoded, Error> {
    let layout = wav_layout(bytes)?;
    let frame = layout.block_align;
    let available = bytes.len().saturating_sub(layout.data_start);
    // A streamed header (length unknown) means "to the end of the file"; a declared length
    // beyond the end means the file was cut.
    let len = match layout.data_len {
        Some(n) if n > available => {
            return Err(Error::TruncatedAudio(format!(
                "the WAV data chunk declares {n} bytes but only {available} are present"
            )))
        }
        Some(n) => n,
        None => available,
    };
    let len = len - len % frame;
    // hound parses and validates the header (PCM, IEEE float, WAVE_FORMAT_EXTENSIBLE), given
    // the header alone with the data length set to the whole frames present; the samples are
    // then converted straight from the bytes, far faster than hound's per-sample reader.
    let mut header = bytes[..layout.data_start].to_vec();
    let n = u32::try_from(len).map_err(|_| Error::CorruptAudio("WAV data over 4 GiB".into()))?;
    header[layout.data_start - 4..].copy_from_slice(&n.to_le_bytes());
    let spec = hound::WavReader::new(Cursor::new(header))
        .map_err(wav_error)?
        .spec();
    let channels = usize::from(spec.channels);
    if channels == 0 || spec.sample_rate == 0 || frame % channels != 0 {
        return Err(Error::CorruptAudio(
            "WAV header with 0 channels, 0 Hz or a frame size that does not fit them".into(),
        ));
    }
    let width = frame / channels;
    too_long((len / frame) as u64, spec.sample_rate, max_seconds)?;
    let data = &bytes[layout.data_start..layout.data_start + len];
    use hound::SampleFormat::{Float, Int};
    // Integer samples are MSB-aligned in their container, so the container size scales them.
    let interleaved: Vec<f32> = match (spec.sample_format, width) {
        (Int, 1) => data
            .iter()
            .map(|&b| (f32::from(b) - 128.0) / 128.0)
            .collect(),
        (Int, 2) => data
            .chunks_exact(2)
            .map(|c| f32::from(i16::from_le_bytes([c[0], c[1]])) / 32_768.0)
            .collect(),
        (Int, 3) => data
            .chunks_exact(3)
            .map(|c| (i32::from_le_bytes([0, c[0], c[1], c[2]]) >> 8) as f32 / 8_388_608.0)
            .collect(),
        (Int, 4) => data
            .chunks_exact(4)
            .map(|c| {
                (f64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])) / 2_147_483_648.0) as f32
            })
            .collect(),
        (Float, 4) => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        (Float, 8) => data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f32)
            .collect(),
        _ => {
            return Err(Error::UnsupportedCodec(format!(
                "{}-bit {:?} WAV",
                spec.bits_per_sample, spec.sample_format
            )))
        }
    };
    let codec = match (spec.sample_format, width) {
        (Float, _) => format!("pcm_f{}le", width * 8),
        (Int, 1) => "pcm_u8".into(),
        (Int, _) => format!("pcm_s{}le", width * 8),
    };
    Ok(Decoded {
        samples: mix_to_mono(&interleaved, channels),
        sample_rate: spec.sample_rate,
        channels: spec.channels,
        container: Container::Wav.name(),
        codec,
    })
}

fn wav_error(e: hound::Error) -> Error {
    match e {
        hound::Error::IoError(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            Error::TruncatedAudio("the WAV data stops early".into())
        }
        hound::Error::IoError(io) => Error::CorruptAudio(io.to_string()),
        hound::Error::Unsupported => Error::UnsupportedCodec("this WAV sample format".into()),
        e => Error::CorruptAudio(format!("WAV: {e}")),
    }
}

fn mix_to_mono(interleaved: &[f32], channels: usize) -> Vec<f32> {
    if channels <= 1 {
        return interleaved.to_vec();
    }
    let inv = 1.0 / channels as f32;
    interleaved
        .chunks_exact(channels)
        .map(|frame| frame.iter().sum::<f32>() * inv)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Everything else: symphonia

fn decode_symphonia(
    bytes: &[u8],
    container: Container,
    max_seconds: f64,
) -> Result<Decoded, Error> {
    // Last line of defence: a decoder bug on hostile input becomes an error, not a crash.
    std::panic::catch_unwind(|| symphonia_inner(bytes, container, max_seconds)).unwrap_or_else(
        |_| {
            Err(Error::CorruptAudio(format!(
                "the {} decoder failed on this file",
                container.name()
            )))
        },
    )
}

fn sym_error(e: SymError, container: Container) -> Error {
    match e {
        SymError::IoError(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            Error::TruncatedAudio(format!("the {} stream stops early", container.name()))
        }
        SymError::Unsupported(what) if what.contains("missing moov") => Error::TruncatedAudio(
            "the MP4 index (moov atom) is missing; the upload was probably cut off".into(),
        ),
        SymError::Unsupported(what) if what.contains("no suitable") => {
            Error::NotAudio(format!("no {} audio stream found", container.name()))
        }
        SymError::Unsupported(what) => Error::UnsupportedCodec(what.to_string()),
        e => Error::CorruptAudio(e.to_string()),
    }
}

/// The demuxer for the container the bytes were recognised as. Readers are made directly, not
/// through symphonia's probe, which scans forward for any known signature and so could pick a
/// container buried inside the data.
fn open_reader(bytes: &[u8], container: Container) -> Result<Box<dyn FormatReader>, SymError> {
    use symphonia::default::formats::{
        AdtsReader, FlacReader, IsoMp4Reader, MpaReader, OggReader, WavReader,
    };
    let body = if bytes.starts_with(b"ID3") {
        &bytes[id3v2_len(bytes).min(bytes.len())..]
    } else {
        bytes
    };
    let mss = MediaSourceStream::new(
        Box::new(Cursor::new(body.to_vec())),
        MediaSourceStreamOptions::default(),
    );
    let opts = FormatOptions::default();
    match container {
        Container::Wav => WavReader::try_probe_new(mss, opts),
        Container::Flac => FlacReader::try_probe_new(mss, opts),
        Container::Ogg => OggReader::try_probe_new(mss, opts),
        Container::Mp3 => MpaReader::try_probe_new(mss, opts),
        Container::Mp4 => IsoMp4Reader::try_probe_new(mss, opts),
        Container::Adts => AdtsReader::try_probe_new(mss, opts),
    }
}

fn symphonia_inner(bytes: &[u8], container: Container, max_seconds: f64) -> Result<Decoded, Error> {
    let mut format = open_reader(bytes, container).map_err(|e| sym_error(e, container))?;
    let track = format
        .default_track(TrackType::Audio)
        .ok_or_else(|| Error::NotAudio(format!("a {} file without audio", container.name())))?;
    let track_id = track.id;
    let declared = track.num_frames;
    let params = track
        .codec_params
        .as_ref()
        .and_then(|p| p.audio())
        .ok_or_else(|| Error::NotAudio("a track without audio parameters".into()))?
        .clone();
    if let (Some(n), Some(rate)) = (declared, params.sample_rate) {
        too_long(n, rate, max_seconds)?;
    }
    let options = AudioDecoderOptions::default().gapless(true);
    let mut decoder = symphonia::default::get_codecs()
        .make_audio_decoder(&params, &options)
        .map_err(|e| match e {
            SymError::Unsupported(_) => Error::UnsupportedCodec(format!(
                "{} in {}",
                codec_name(params.codec),
                container.name()
            )),
            e => sym_error(e, container),
        })?;
    let codec = decoder.codec_info().short_name.to_string();

    let mut mono: Vec<f32> = Vec::new();
    let mut buf: Vec<f32> = Vec::new();
    let (mut rate, mut channels) = (
        params.sample_rate,
        params.channels.as_ref().map(|c| c.count()),
    );
    let (mut packets, mut bad_packets) = (0usize, 0usize);
    let mut truncated = false;
    loop {
        let packet = match format.next_packet() {
            Ok(Some(p)) => p,
            Ok(None) => break,
            Err(SymError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                truncated = true;
                break;
            }
            Err(SymError::ResetRequired) => break, // a chained stream: keep the first one
            Err(SymError::DecodeError(_)) if container == Container::Mp4 && mono.is_empty() => {
                truncated = true; // sample table points past the end of the file
                break;
            }
            Err(e) => return Err(sym_error(e, container)),
        };
        if packet.track_id != track_id {
            continue;
        }
        packets += 1;
        match decoder.decode(&packet) {
            Ok(decoded) => {
                let spec = decoded.spec();
                let ch = spec.channels().count().max(1);
                rate.get_or_insert(spec.rate());
                channels.get_or_insert(ch);
                decoded.copy_to_vec_interleaved(&mut buf);
                mono.extend(mix_to_mono(&buf, ch));
            }
            Err(SymError::DecodeError(_)) | Err(SymError::IoError(_)) => bad_packets += 1,
            Err(SymError::ResetRequired) => decoder.reset(),
            Err(e) => return Err(sym_error(e, container)),
        }
        if let Some(r) = rate {
            too_long(mono.len() as u64, r, max_seconds)?;
        }
    }
    let rate = rate.filter(|&r| r > 0).ok_or_else(|| {
        Error::CorruptAudio(format!("{} stream without a sample rate", container.name()))
    })?;
    if packets > 0 && bad_packets * 2 > packets {
        return Err(Error::CorruptAudio(format!(
            "{bad_packets} of {packets} {codec} packets could not be decoded"
        )));
    }
    if container == Container::Mp4 {
        if let Some((skip, keep)) = mp4_audio_edit(bytes, rate) {
            let end = skip
                .saturating_add(keep.unwrap_or(usize::MAX))
                .min(mono.len());
            mono = mono.get(skip.min(end)..end).unwrap_or(&[]).to_vec();
        }
    }
    // MP3 and MP4 streams cut short end "normally"; their headers tell the length.
    if let Some(n) = declared.and_then(|n| usize::try_from(n).ok()) {
        let slack = params.max_frames_per_packet.unwrap_or(4096) as usize * 2;
        if mono.len().saturating_add(slack) < n {
            truncated = true;
        }
    }
    if truncated {
        return Err(Error::TruncatedAudio(format!(
            "the {codec} stream stops after {:.2} s{}",
            mono.len() as f64 / f64::from(rate),
            declared.map_or(String::new(), |n| format!(
                " of {:.2} s",
                n as f64 / f64::from(rate)
            ))
        )));
    }
    Ok(Decoded {
        samples: mono,
        sample_rate: rate,
        channels: channels.unwrap_or(1).min(usize::from(u16::MAX)) as u16,
        container: container.name(),
        codec,
    })
}

/// A readable name for codecs users send that symphonia has no decoder for.
fn codec_name(id: symphonia::core::codecs::audio::AudioCodecId) -> String {
    use symphonia::core::codecs::audio::well_known::*;
    match id {
        CODEC_ID_OPUS => "Opus".into(),
        CODEC_ID_SPEEX => "Speex".into(),
        CODEC_ID_AC3 => "AC-3".into(),
        CODEC_ID_WMA => "WMA".into(),
        other => format!("codec {other}"),
    }
}

// ---------------------------------------------------------------------------------------------
// MP4 edit lists

/// For the first audio track of an MP4 file: `(frames to skip, frames to keep)` from its edit
/// list (`moov/trak/edts/elst`, media time in the `mdhd` timescale, duration in the `mvhd`
/// timescale), converted to `rate`. `None` when the file has no usable edit list.
fn mp4_audio_edit(b: &[u8], rate: u32) -> Option<(usize, Option<usize>)> {
    let moov = child(b, b"moov")?;
    let movie_scale = full_box_u32(child(moov, b"mvhd")?, 12, 20)?;
    for trak in children(moov, b"trak") {
        let mdia = child(trak, b"mdia")?;
        let hdlr = child(mdia, b"hdlr")?;
        if hdlr.get(8..12) != Some(b"soun") {
            continue;
        }
        let media_scale = full_box_u32(child(mdia, b"mdhd")?, 12, 20)?;
        let elst = child(child(trak, b"edts")?, b"elst")?;
        let version = *elst.first()?;
        let count = be_u32(elst, 4)?;
        let mut pos = 8;
        for _ in 0..count.min(16) {
            let (duration, media_time, next) = if version == 1 {
                (be_u64(elst, pos)?, be_u64(elst, pos + 8)? as i64, pos + 20)
            } else {
                (
                    u64::from(be_u32(elst, pos)?),
                    i64::from(be_u32(elst, pos + 4)? as i32),
                    pos + 12,
                )
            };
            pos = next;
            if media_time < 0 {
                continue; // an empty edit (a gap before the media starts)
            }
            let to_rate = |v: u64, scale: u32| -> Option<usize> {
                (scale > 0)
                    .then(|| (v as f64 * f64::from(rate) / f64::from(scale)).round() as usize)
            };
            let skip = to_rate(media_time as u64, media_scale)?;
            let keep = if duration > 0 {
                to_rate(duration, movie_scale)
            } else {
                None
            };
            return Some((skip, keep));
        }
        return None;
    }
    None
}

fn be_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn be_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// A version-0/1 full box's u32 field: at `v0` in version 0, at `v1` in version 1
/// (the timescale of `mvhd` and `mdhd`).
fn full_box_u32(body: &[u8], v0: usize, v1: usize) -> Option<u32> {
    be_u32(body, if *body.first()? == 1 { v1 } else { v0 })
}

/// Bodies of the boxes of type `kind` directly inside `b`.
fn children<'a>(b: &'a [u8], kind: &'a [u8; 4]) -> impl Iterator<Item = &'a [u8]> + 'a {
    let mut pos = 0usize;
    std::iter::from_fn(move || {
        while pos + 8 <= b.len() {
            let size = be_u32(b, pos)? as usize;
            let (header, size) = match size {
                1 => (16, usize::try_from(be_u64(b, pos + 8)?).ok()?),
                0 => (8, b.len() - pos),
                s => (8, s),
            };
            if size < header || pos.checked_add(size)? > b.len() {
                return None;
            }
            let here = pos;
            pos += size;
            if &b[here + 4..here + 8] == kind {
                return Some(&b[here + header..here + size]);
            }
        }
        None
    })
}

fn child<'a>(b: &'a [u8], kind: &'a [u8; 4]) -> Option<&'a [u8]> {
    children(b, kind).next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn containers_are_recognised_from_bytes_not_names() {
        assert_eq!(sniff(b"RIFF\0\0\0\0WAVEfmt ").unwrap(), Container::Wav);
        assert_eq!(sniff(b"fLaC\0").unwrap(), Container::Flac);
        assert_eq!(sniff(b"OggS\0").unwrap(), Container::Ogg);
        let mut tagged = b"ID3\x04\0\0\0\0\0\x02xx".to_vec();
        tagged.extend_from_slice(b"\xff\xfb\x90\x00");
        assert_eq!(sniff(&tagged).unwrap(), Container::Mp3);
        assert!(sniff(b"ID3\x04\0\0\0\0\0\x02xxGIF8").is_err());
        assert_eq!(sniff(b"\xff\xfb\x90\x00").unwrap(), Container::Mp3);
        assert_eq!(sniff(b"\xff\xf1\x50\x80").unwrap(), Container::Adts);
        assert_eq!(sniff(b"\0\0\0\x20ftypM4A ").unwrap(), Container::Mp4);
        for (bytes, what) in [
            (&b"\x89PNG\r\n\x1a\n"[..], "PNG"),
            (b"\xff\xd8\xff\xe0", "JPEG"),
            (b"RIFF\0\0\0\0WEBPVP8 ", "WebP"),
            (b"hello", "unrecognised"),
        ] {
            match sniff(bytes) {
                Err(Error::NotAudio(m)) => assert!(m.contains(what), "{m}"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn channels_are_averaged() {
        assert_eq!(
            mix_to_mono(&[1.0, 0.0, 0.5, 0.5, -1.0, 1.0], 2),
            vec![0.5, 0.5, 0.0]
        );
        assert_eq!(mix_to_mono(&[0.3, 0.6, 0.9], 3), vec![0.6]);
    }

    #[test]
    fn mp4_boxes_are_walked_safely() {
        assert_eq!(child(b"\0\0\0\x0cmoovabcd", b"moov"), Some(&b"abcd"[..]));
        assert_eq!(child(b"\0\0\0\x04moov", b"moov"), None); // size below the header
        assert_eq!(child(b"\0\0\x01\0moov", b"moov"), None); // runs past the end
        assert_eq!(mp4_audio_edit(b"garbage", 44100), None);
    }
}
