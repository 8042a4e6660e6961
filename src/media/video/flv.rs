//! FLV as ffmpeg writes it to a pipe, read incrementally: every tag carries its length, and
//! ffmpeg writes a tag as soon as its packet is encoded (`-flush_packets 1`), so a reader
//! can hand on each coded picture or audio frame the moment it exists, without waiting for
//! the next one to find where it ends (as a raw H.264 or MP4 stream would make it).

/// One FLV tag: its type (8 audio, 9 video, 18 script data), timestamp and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Tag {
    pub kind: u8,
    pub timestamp_ms: u32,
    pub data: Vec<u8>,
}

/// FLV tag types.
pub(super) const AUDIO: u8 = 8;
pub(super) const VIDEO: u8 = 9;

/// Splits a growing FLV byte stream into [`Tag`]s.
#[derive(Default)]
pub(super) struct Tags {
    buf: Vec<u8>,
    header_done: bool,
}

/// A big-endian unsigned number of up to 8 bytes.
pub(super) fn be(bytes: &[u8]) -> usize {
    bytes.iter().fold(0, |acc, &b| (acc << 8) | b as usize)
}

impl Tags {
    /// Adds bytes; returns the tags they complete, or what is wrong with the stream.
    pub fn push(&mut self, data: &[u8]) -> Result<Vec<Tag>, String> {
        self.buf.extend_from_slice(data);
        let mut pos = 0;
        let mut out = Vec::new();
        if !self.header_done {
            // "FLV", version, flags, header size (u32), then PreviousTagSize0 (u32).
            if self.buf.len() < 9 {
                return Ok(out);
            }
            if &self.buf[..3] != b"FLV" {
                return Err("not FLV".into());
            }
            let header = be(&self.buf[5..9]);
            if self.buf.len() < header + 4 {
                return Ok(out);
            }
            pos = header + 4;
            self.header_done = true;
        }
        // Tag: type (u8), data size (u24), timestamp (u24, then its upper 8 bits), stream id
        // (u24), data, then PreviousTagSize (u32).
        while self.buf.len() >= pos + 11 {
            let size = be(&self.buf[pos + 1..pos + 4]);
            let end = pos + 11 + size + 4;
            if self.buf.len() < end {
                break;
            }
            let low = be(&self.buf[pos + 4..pos + 7]) as u32;
            let high = u32::from(self.buf[pos + 7]);
            out.push(Tag {
                kind: self.buf[pos] & 0x1f,
                timestamp_ms: (high << 24) | low,
                data: self.buf[pos + 11..pos + 11 + size].to_vec(),
            });
            pos = end;
        }
        self.buf.drain(..pos);
        Ok(out)
    }

    /// At the end of the stream: an error if it stopped inside a tag.
    pub fn end(&self) -> Result<(), String> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(format!("{} bytes of a truncated tag", self.buf.len()))
        }
    }
}

/// What an H.264 video tag holds.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Avc<'a> {
    /// The AVCDecoderConfigurationRecord (the `avcC` box's payload).
    Config(&'a [u8]),
    /// One coded picture: its NAL units, each after its length (of the record's size), and
    /// how long after its decoding it is shown (0 without B-frames).
    Picture {
        key: bool,
        nals: &'a [u8],
        composition_ms: i32,
    },
    /// Anything else (end of sequence).
    Other,
}

/// Reads a video tag's payload: legacy AVC tags and enhanced-FLV `avc1` tags.
pub(super) fn avc(tag: &[u8]) -> Result<Avc<'_>, String> {
    let Some(&first) = tag.first() else {
        return Ok(Avc::Other);
    };
    if first & 0x80 != 0 {
        // Enhanced FLV: frame type (3 bits), packet type (4 bits), FourCC.
        if tag.len() < 5 || &tag[1..5] != b"avc1" {
            return Err("not H.264".into());
        }
        let key = (first >> 4) & 0x07 == 1;
        return Ok(match first & 0x0f {
            0 => Avc::Config(&tag[5..]),
            // Coded frames, the composition time (s24) first.
            1 if tag.len() >= 8 => Avc::Picture {
                key,
                nals: &tag[8..],
                composition_ms: s24(&tag[5..8]),
            },
            // Coded frames without composition time.
            3 => Avc::Picture {
                key,
                nals: &tag[5..],
                composition_ms: 0,
            },
            _ => Avc::Other,
        });
    }
    if first & 0x0f != 7 {
        return Err("not H.264".into());
    }
    if tag.len() < 5 {
        return Err("short AVC tag".into());
    }
    // Frame type (4 bits), codec (4 bits), AVC packet type, composition time (s24), payload.
    let key = first >> 4 == 1;
    Ok(match tag[1] {
        0 => Avc::Config(&tag[5..]),
        1 => Avc::Picture {
            key,
            nals: &tag[5..],
            composition_ms: s24(&tag[2..5]),
        },
        _ => Avc::Other,
    })
}

/// A signed big-endian 24-bit number.
fn s24(b: &[u8]) -> i32 {
    (i32::from_be_bytes([b[0], b[1], b[2], 0])) >> 8
}

/// What an AAC audio tag holds.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Aac<'a> {
    /// The AudioSpecificConfig (the `esds` box's decoder-specific information).
    Config(&'a [u8]),
    /// One raw AAC frame.
    Frame(&'a [u8]),
    /// Anything else (the end of the sequence, a channel layout).
    Other,
}

/// Reads an audio tag's payload. Legacy tags: sound format (4 bits; 10 is AAC), rate, size
/// and channels (ignored for AAC, the configuration says them), the AAC packet type, the
/// data. Enhanced-FLV tags: sound format 9, the packet type (4 bits), the FourCC `mp4a`,
/// the data.
pub(super) fn aac(tag: &[u8]) -> Result<Aac<'_>, String> {
    match tag.first().map(|b| b >> 4) {
        Some(10) if tag.len() >= 2 => match tag[1] {
            0 => Ok(Aac::Config(&tag[2..])),
            1 => Ok(Aac::Frame(&tag[2..])),
            t => Err(format!("AAC packet type {t}")),
        },
        Some(9) if tag.len() >= 5 && &tag[1..5] == b"mp4a" => Ok(match tag[0] & 0x0f {
            0 => Aac::Config(&tag[5..]),
            1 => Aac::Frame(&tag[5..]),
            _ => Aac::Other,
        }),
        _ => Err("not AAC".into()),
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A tag with `data` at `timestamp_ms`.
    pub fn tag_at(kind: u8, timestamp_ms: u32, data: &[u8]) -> Vec<u8> {
        let mut t = vec![kind];
        t.extend_from_slice(&(data.len() as u32).to_be_bytes()[1..]);
        t.extend_from_slice(&timestamp_ms.to_be_bytes()[1..]);
        t.push((timestamp_ms >> 24) as u8);
        t.extend_from_slice(&[0; 3]);
        t.extend_from_slice(data);
        t.extend_from_slice(&(11 + data.len() as u32).to_be_bytes());
        t
    }

    /// A whole FLV stream of `tags`.
    pub fn flv(tags: &[Vec<u8>]) -> Vec<u8> {
        let mut f = b"FLV\x01\x01\x00\x00\x00\x09\x00\x00\x00\x00".to_vec();
        for t in tags {
            f.extend_from_slice(t);
        }
        f
    }

    #[test]
    fn tags_come_out_whole_with_their_timestamps_however_the_bytes_arrive() {
        let s = flv(&[
            tag_at(18, 0, b"onMetaData"),
            tag_at(AUDIO, 64, &[0xaf, 0, 0x14, 0x08]),
            tag_at(AUDIO, 0x0100_0040, &[0xaf, 1, 1, 2, 3]),
        ]);
        let want = vec![
            Tag {
                kind: 18,
                timestamp_ms: 0,
                data: b"onMetaData".to_vec(),
            },
            Tag {
                kind: AUDIO,
                timestamp_ms: 64,
                data: vec![0xaf, 0, 0x14, 0x08],
            },
            Tag {
                kind: AUDIO,
                timestamp_ms: 0x0100_0040,
                data: vec![0xaf, 1, 1, 2, 3],
            },
        ];
        let mut t = Tags::default();
        assert_eq!(t.push(&s).unwrap(), want);
        t.end().unwrap();
        let mut t = Tags::default();
        let mut got = Vec::new();
        for b in &s {
            got.extend(t.push(std::slice::from_ref(b)).unwrap());
        }
        t.end().unwrap();
        assert_eq!(got, want);

        assert_eq!(aac(&want[1].data), Ok(Aac::Config(&[0x14, 0x08][..])));
        assert_eq!(aac(&want[2].data), Ok(Aac::Frame(&[1, 2, 3][..])));
        assert!(aac(&[0x2f, 1, 0]).is_err(), "MP3 is not AAC");
        assert!(aac(&[0xaf]).is_err());
        assert!(aac(&[0xaf, 7, 0]).is_err());
        // Enhanced FLV: packet type in the first byte, then the FourCC.
        assert_eq!(aac(b"\x90mp4a\x14\x08"), Ok(Aac::Config(&[0x14, 0x08][..])));
        assert_eq!(aac(b"\x91mp4a\x01\x02"), Ok(Aac::Frame(&[1, 2][..])));
        assert_eq!(aac(b"\x92mp4a"), Ok(Aac::Other));
        assert!(aac(b"\x91Opus\x01").is_err(), "Opus is not AAC");

        // A picture's composition time, signed, in legacy and enhanced tags.
        let legacy = [0x27, 1, 0xff, 0xff, 0xd8, 0, 0, 0, 1, 0x41];
        assert_eq!(
            avc(&legacy),
            Ok(Avc::Picture {
                key: false,
                nals: &legacy[5..],
                composition_ms: -40,
            })
        );
        let enhanced = b"\x91avc1\x00\x00\x50\x00\x00\x00\x01\x65";
        assert_eq!(
            avc(enhanced),
            Ok(Avc::Picture {
                key: true,
                nals: &enhanced[8..],
                composition_ms: 80,
            })
        );

        let mut t = Tags::default();
        t.push(&s[..s.len() - 1]).unwrap();
        assert!(t.end().is_err(), "a truncated tag is reported");
        assert!(Tags::default().push(b"RIFF\0\0\0\0\0\0\0\0").is_err());
    }
}
