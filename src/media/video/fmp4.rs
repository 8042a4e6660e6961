//! Fragmented MP4 (ISO/IEC 14496-12, H.264 in `avc1` and AAC in `mp4a`) for live sessions,
//! written here from the coded pictures and AAC frames: an init segment (`ftyp` + `moov`),
//! then a `moof` + `mdat` fragment per picture, holding the picture and the audio that came
//! out of the encoder since the last one. ffmpeg's MP4 muxer writes a fragment only once the
//! next packet arrives (it needs the last sample's duration); here every picture lasts one
//! frame of a fixed rate, so its fragment goes out when it is encoded.
//!
//! Times: the video's timescale is the frame rate's numerator doubled until it reaches
//! 10 000 (12 800 at 25 fps, as ffmpeg chooses); a picture's decode time is its index ×
//! the rate's denominator in that scale (no B-frames: presentation = decode). The audio's
//! timescale is its sample rate; AAC frame `k` starts at `k` × its frame length (1 024).

use crate::media::Error;

/// Track ids.
const VIDEO: u32 = 1;
const AUDIO: u32 = 2;

/// What the init segment describes.
#[derive(Debug, Clone)]
pub(super) struct Tracks {
    pub width: u32,
    pub height: u32,
    /// Frames per second as `num / den`.
    pub fps: (u32, u32),
    /// The AVCDecoderConfigurationRecord.
    pub avc: Vec<u8>,
    /// The AAC AudioSpecificConfig.
    pub aac: Vec<u8>,
}

/// An AAC configuration's sample rate, channels and samples per frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct AacFormat {
    pub sample_rate: u32,
    pub channels: u16,
    pub frame_samples: u32,
}

const AAC_RATES: [u32; 13] = [
    96_000, 88_200, 64_000, 48_000, 44_100, 32_000, 24_000, 22_050, 16_000, 12_000, 11_025, 8_000,
    7_350,
];

/// Reads an AudioSpecificConfig: object type (5 bits), sampling frequency index (4),
/// channel configuration (4), then for AAC LC the frame length flag (1024 or 960 samples).
pub(super) fn aac_format(asc: &[u8]) -> Result<AacFormat, Error> {
    let bad = |what: &str| Error::Encoder(format!("unexpected AAC configuration: {what}"));
    if asc.len() < 2 {
        return Err(bad("too short"));
    }
    let bits = u16::from_be_bytes([asc[0], asc[1]]);
    let object = bits >> 11;
    if object != 2 {
        return Err(bad(&format!("object type {object}, not AAC LC")));
    }
    let index = usize::from((bits >> 7) & 0x0f);
    let rate = AAC_RATES
        .get(index)
        .copied()
        .ok_or_else(|| bad(&format!("sampling frequency index {index}")))?;
    let channels = (bits >> 3) & 0x0f;
    if !(1..=2).contains(&channels) {
        return Err(bad(&format!("channel configuration {channels}")));
    }
    let frame_samples = if bits & 0x04 != 0 { 960 } else { 1024 };
    Ok(AacFormat {
        sample_rate: rate,
        channels,
        frame_samples,
    })
}

/// One coded picture: its index in the stream, whether it is a keyframe (IDR), and its NAL
/// units with their 4-byte (or as the record says) lengths.
pub(super) struct Picture<'a> {
    pub index: u64,
    pub key: bool,
    pub data: &'a [u8],
}

/// Writes the init segment and the fragments of one stream.
pub(super) struct Writer {
    tracks: Tracks,
    audio: AacFormat,
    video_timescale: u32,
    /// One frame in the video's timescale.
    frame_ticks: u32,
    /// The last fragment's sequence number.
    sequence: u32,
    /// AAC frames written so far.
    audio_frames: u64,
}

/// Big-endian writes.
trait Put {
    fn u16(&mut self, v: u16);
    fn u32(&mut self, v: u32);
    fn u64(&mut self, v: u64);
    fn zeros(&mut self, n: usize);
}

impl Put for Vec<u8> {
    fn u16(&mut self, v: u16) {
        self.extend_from_slice(&v.to_be_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.extend_from_slice(&v.to_be_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.extend_from_slice(&v.to_be_bytes());
    }
    fn zeros(&mut self, n: usize) {
        self.resize(self.len() + n, 0);
    }
}

/// A box: its size (filled in once `body` has written it), type, and body.
fn boxed(out: &mut Vec<u8>, kind: &[u8; 4], body: impl FnOnce(&mut Vec<u8>)) {
    let at = out.len();
    out.u32(0);
    out.extend_from_slice(kind);
    body(out);
    let size = u32::try_from(out.len() - at).expect("a box under 4 GiB");
    out[at..at + 4].copy_from_slice(&size.to_be_bytes());
}

/// A full box: a box whose body starts with a version and 24 bits of flags.
fn full(
    out: &mut Vec<u8>,
    kind: &[u8; 4],
    version: u8,
    flags: u32,
    body: impl FnOnce(&mut Vec<u8>),
) {
    boxed(out, kind, |o| {
        o.push(version);
        o.extend_from_slice(&flags.to_be_bytes()[1..]);
        body(o);
    });
}

/// An MPEG-4 descriptor (in `esds`): tag, length in 7-bit groups, body.
fn descriptor(out: &mut Vec<u8>, tag: u8, body: impl FnOnce(&mut Vec<u8>)) {
    let mut b = Vec::new();
    body(&mut b);
    out.push(tag);
    let n = b.len();
    let groups = (1..=4)
        .find(|g| n < 1 << (7 * g))
        .expect("a descriptor under 256 MiB");
    for g in (0..groups).rev() {
        let more = if g > 0 { 0x80 } else { 0 };
        out.push(more | ((n >> (7 * g)) & 0x7f) as u8);
    }
    out.extend_from_slice(&b);
}

/// The identity transformation of `mvhd` and `tkhd`.
fn matrix(out: &mut Vec<u8>) {
    for v in [0x0001_0000, 0, 0, 0, 0x0001_0000, 0, 0, 0, 0x4000_0000] {
        out.u32(v);
    }
}

/// Sample flags (14496-12 8.8.3.1): a keyframe depends on no other sample; any other
/// picture depends on others and is not a sync sample.
const KEY_FLAGS: u32 = 0x0200_0000;
const DELTA_FLAGS: u32 = 0x0101_0000;

/// `tfhd` flag: offsets are relative to the `moof`.
const DEFAULT_BASE_IS_MOOF: u32 = 0x02_0000;

impl Writer {
    pub fn new(tracks: Tracks) -> Result<Self, Error> {
        let audio = aac_format(&tracks.aac)?;
        let (num, den) = tracks.fps;
        if num == 0 || den == 0 {
            return Err(Error::Encoder(format!("frame rate {num}/{den}")));
        }
        let mut scale = 1u32;
        while num.saturating_mul(scale) < 10_000 {
            scale *= 2;
        }
        let (Some(video_timescale), Some(frame_ticks)) =
            (num.checked_mul(scale), den.checked_mul(scale))
        else {
            return Err(Error::Encoder(format!(
                "frame rate {num}/{den} has no MP4 timescale"
            )));
        };
        Ok(Writer {
            video_timescale,
            frame_ticks,
            audio,
            tracks,
            sequence: 0,
            audio_frames: 0,
        })
    }

    /// `ftyp` + `moov`.
    pub fn init(&self) -> Vec<u8> {
        let mut out = Vec::new();
        boxed(&mut out, b"ftyp", |o| {
            o.extend_from_slice(b"isom");
            o.u32(0x200);
            for brand in [b"isom", b"iso6", b"avc1", b"mp41"] {
                o.extend_from_slice(brand);
            }
        });
        boxed(&mut out, b"moov", |o| {
            full(o, b"mvhd", 0, 0, |o| {
                o.zeros(8); // creation, modification
                o.u32(1000);
                o.u32(0); // duration: unknown, the stream is fragmented
                o.u32(0x0001_0000); // rate 1.0
                o.u16(0x0100); // volume 1.0
                o.zeros(10);
                matrix(o);
                o.zeros(24);
                o.u32(AUDIO + 1); // next track id
            });
            self.video_trak(o);
            self.audio_trak(o);
            boxed(o, b"mvex", |o| {
                for track in [VIDEO, AUDIO] {
                    full(o, b"trex", 0, 0, |o| {
                        o.u32(track);
                        o.u32(1); // sample description
                        o.zeros(12); // duration, size, flags: every fragment says them
                    });
                }
            });
        });
        out
    }

    fn tkhd(o: &mut Vec<u8>, track: u32, volume: u16, size: (u32, u32)) {
        // Flags: enabled, in the movie.
        full(o, b"tkhd", 0, 3, |o| {
            o.zeros(8);
            o.u32(track);
            o.zeros(4);
            o.u32(0); // duration
            o.zeros(8);
            o.u16(0); // layer
            o.u16(0); // alternate group
            o.u16(volume);
            o.zeros(2);
            matrix(o);
            o.u32(size.0 << 16);
            o.u32(size.1 << 16);
        });
    }

    fn mdhd_hdlr(o: &mut Vec<u8>, timescale: u32, handler: &[u8; 4], name: &str) {
        full(o, b"mdhd", 0, 0, |o| {
            o.zeros(8);
            o.u32(timescale);
            o.u32(0);
            o.u16(0x55c4); // language "und"
            o.u16(0);
        });
        full(o, b"hdlr", 0, 0, |o| {
            o.u32(0);
            o.extend_from_slice(handler);
            o.zeros(12);
            o.extend_from_slice(name.as_bytes());
            o.push(0);
        });
    }

    /// `dinf` (the media is in this file) and `stbl` with `entry` as the only sample
    /// description and no samples (they are in the fragments).
    fn dinf_stbl(o: &mut Vec<u8>, entry: impl FnOnce(&mut Vec<u8>)) {
        boxed(o, b"dinf", |o| {
            full(o, b"dref", 0, 0, |o| {
                o.u32(1);
                full(o, b"url ", 0, 1, |_| {});
            });
        });
        boxed(o, b"stbl", |o| {
            full(o, b"stsd", 0, 0, |o| {
                o.u32(1);
                entry(o);
            });
            full(o, b"stts", 0, 0, |o| o.u32(0));
            full(o, b"stsc", 0, 0, |o| o.u32(0));
            full(o, b"stsz", 0, 0, |o| o.zeros(8));
            full(o, b"stco", 0, 0, |o| o.u32(0));
        });
    }

    /// A track: `tkhd`, then `mdia` with the media's timescale and handler, and `minf` with
    /// its media header box (`mhd`) and `entry` as its one sample description.
    fn trak(
        o: &mut Vec<u8>,
        (track, volume, size): (u32, u16, (u32, u32)),
        timescale: u32,
        (handler, name): (&[u8; 4], &str),
        mhd: impl FnOnce(&mut Vec<u8>),
        entry: impl FnOnce(&mut Vec<u8>),
    ) {
        boxed(o, b"trak", |o| {
            Self::tkhd(o, track, volume, size);
            boxed(o, b"mdia", |o| {
                Self::mdhd_hdlr(o, timescale, handler, name);
                boxed(o, b"minf", |o| {
                    mhd(o);
                    Self::dinf_stbl(o, entry);
                });
            });
        });
    }

    fn video_trak(&self, o: &mut Vec<u8>) {
        let (w, h) = (self.tracks.width, self.tracks.height);
        Self::trak(
            o,
            (VIDEO, 0, (w, h)),
            self.video_timescale,
            (b"vide", "VideoHandler"),
            |o| full(o, b"vmhd", 0, 1, |o| o.zeros(8)),
            |o| {
                boxed(o, b"avc1", |o| {
                    o.zeros(6);
                    o.u16(1); // data reference
                    o.zeros(16);
                    o.u16(w as u16);
                    o.u16(h as u16);
                    o.u32(0x0048_0000); // 72 dpi
                    o.u32(0x0048_0000);
                    o.u32(0);
                    o.u16(1); // frames per sample
                    o.zeros(32); // compressor name
                    o.u16(0x0018); // depth
                    o.u16(0xffff);
                    boxed(o, b"avcC", |o| o.extend_from_slice(&self.tracks.avc));
                })
            },
        );
    }

    fn audio_trak(&self, o: &mut Vec<u8>) {
        let a = self.audio;
        Self::trak(
            o,
            (AUDIO, 0x0100, (0, 0)),
            a.sample_rate,
            (b"soun", "SoundHandler"),
            |o| full(o, b"smhd", 0, 0, |o| o.zeros(4)),
            |o| {
                boxed(o, b"mp4a", |o| {
                    o.zeros(6);
                    o.u16(1);
                    o.zeros(8);
                    o.u16(a.channels);
                    o.u16(16);
                    o.zeros(4);
                    // 16.16 fixed point; 0 where it does not fit (the configuration says it).
                    o.u32(if a.sample_rate < 1 << 16 {
                        a.sample_rate << 16
                    } else {
                        0
                    });
                    full(o, b"esds", 0, 0, |o| {
                        descriptor(o, 3, |o| {
                            o.u16(AUDIO as u16); // ES id
                            o.push(0);
                            descriptor(o, 4, |o| {
                                o.push(0x40); // MPEG-4 audio
                                o.push(0x15); // audio stream
                                o.zeros(3 + 4 + 4); // buffer size, bit rates
                                descriptor(o, 5, |o| o.extend_from_slice(&self.tracks.aac));
                            });
                            descriptor(o, 6, |o| o.push(2));
                        });
                    });
                })
            },
        );
    }

    /// A `moof` + `mdat` holding `picture` (if any) and `audio` (raw AAC frames, in order,
    /// following those of the last fragment).
    pub fn fragment(&mut self, picture: Option<&Picture<'_>>, audio: &[Vec<u8>]) -> Vec<u8> {
        self.sequence += 1;
        let mut out = Vec::new();
        // Where each track's data offset goes, and the data's position in the mdat.
        let mut offsets: Vec<(usize, usize)> = Vec::new();
        let mut in_mdat = 0usize;
        boxed(&mut out, b"moof", |o| {
            full(o, b"mfhd", 0, 0, |o| o.u32(self.sequence));
            if let Some(p) = picture {
                boxed(o, b"traf", |o| {
                    full(o, b"tfhd", 0, DEFAULT_BASE_IS_MOOF, |o| o.u32(VIDEO));
                    full(o, b"tfdt", 1, 0, |o| {
                        o.u64(p.index * u64::from(self.frame_ticks))
                    });
                    // Data offset, sample duration, size and flags present.
                    full(o, b"trun", 0, 0x701, |o| {
                        o.u32(1);
                        offsets.push((o.len(), in_mdat));
                        o.u32(0);
                        o.u32(self.frame_ticks);
                        o.u32(p.data.len() as u32);
                        o.u32(if p.key { KEY_FLAGS } else { DELTA_FLAGS });
                    });
                });
                in_mdat += p.data.len();
            }
            if !audio.is_empty() {
                boxed(o, b"traf", |o| {
                    full(o, b"tfhd", 0, DEFAULT_BASE_IS_MOOF, |o| o.u32(AUDIO));
                    full(o, b"tfdt", 1, 0, |o| {
                        o.u64(self.audio_frames * u64::from(self.audio.frame_samples))
                    });
                    // Data offset, sample duration and size present.
                    full(o, b"trun", 0, 0x301, |o| {
                        o.u32(audio.len() as u32);
                        offsets.push((o.len(), in_mdat));
                        o.u32(0);
                        for frame in audio {
                            o.u32(self.audio.frame_samples);
                            o.u32(frame.len() as u32);
                        }
                    });
                });
            }
        });
        let moof = out.len();
        for (at, data) in offsets {
            let offset = u32::try_from(moof + 8 + data).expect("a fragment under 4 GiB");
            out[at..at + 4].copy_from_slice(&offset.to_be_bytes());
        }
        boxed(&mut out, b"mdat", |o| {
            if let Some(p) = picture {
                o.extend_from_slice(p.data);
            }
            for frame in audio {
                o.extend_from_slice(frame);
            }
        });
        self.audio_frames += audio.len() as u64;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::media::video::live::{mime_type, Fragments, Piece};

    fn tracks() -> Tracks {
        Tracks {
            width: 64,
            height: 48,
            fps: (25, 1),
            avc: vec![
                1, 0x42, 0xc0, 0x0a, 0xff, 0xe1, 0, 2, 0x67, 0x42, 1, 0, 1, 0x68,
            ],
            aac: vec![0x14, 0x08],
        }
    }

    #[test]
    fn aac_configurations_are_read_and_odd_ones_refused() {
        assert_eq!(
            aac_format(&[0x14, 0x08]).unwrap(),
            AacFormat {
                sample_rate: 16_000,
                channels: 1,
                frame_samples: 1024
            }
        );
        assert_eq!(
            aac_format(&[0x11, 0x90]).unwrap(),
            AacFormat {
                sample_rate: 48_000,
                channels: 2,
                frame_samples: 1024
            }
        );
        assert_eq!(aac_format(&[0x14, 0x0c]).unwrap().frame_samples, 960);
        assert!(aac_format(&[0x14]).is_err());
        assert!(aac_format(&[0x2c, 0x08]).is_err(), "HE-AAC (object type 5)");
        assert!(
            aac_format(&[0x17, 0x88]).is_err(),
            "an explicit rate (index 15)"
        );
        assert!(aac_format(&[0x16, 0x88]).is_err(), "a reserved index (13)");
        assert!(
            aac_format(&[0x14, 0x00]).is_err(),
            "channels in the program config"
        );
    }

    #[test]
    fn frame_rates_get_exact_timescales_and_absurd_ones_an_error() {
        let w = |fps| Writer::new(Tracks { fps, ..tracks() });
        let scales = |fps| {
            let w = w(fps).unwrap();
            (w.video_timescale, w.frame_ticks)
        };
        assert_eq!(scales((25, 1)), (12_800, 512));
        assert_eq!(scales((30_000, 1001)), (30_000, 1001));
        assert_eq!(scales((60, 1)), (15_360, 256));
        assert!(w((1, 1_000_000)).is_err());
        assert!(w((0, 1)).is_err());
    }

    #[test]
    fn descriptor_lengths_take_as_many_groups_as_they_need() {
        let mut d = Vec::new();
        descriptor(&mut d, 5, |o| o.zeros(127));
        assert_eq!(&d[..2], &[5, 127]);
        let mut d = Vec::new();
        descriptor(&mut d, 5, |o| o.zeros(200));
        assert_eq!(&d[..3], &[5, 0x81, 0x48]);
        assert_eq!(d.len(), 203);
    }

    #[test]
    fn fragments_count_their_pictures_and_point_at_their_data() {
        let mut w = Writer::new(tracks()).unwrap();
        let mut stream = w.init();
        let key = [0, 0, 0, 2, 0x65, 0x88];
        let delta = [0, 0, 0, 3, 0x41, 0x9a, 0x02];
        stream.extend(w.fragment(
            Some(&Picture {
                index: 0,
                key: true,
                data: &key,
            }),
            &[vec![0xaa; 5], vec![0xbb; 7]],
        ));
        stream.extend(w.fragment(
            Some(&Picture {
                index: 1,
                key: false,
                data: &delta,
            }),
            &[],
        ));
        let last = w.fragment(None, &[vec![0xcc; 3]]);
        stream.extend(&last);
        let pieces = Fragments::default().push(&stream);
        assert_eq!(pieces.len(), 4);
        let Piece::Init(init) = &pieces[0] else {
            panic!("no init segment first")
        };
        assert_eq!(
            mime_type(init),
            "video/mp4; codecs=\"avc1.42C00A, mp4a.40.2\""
        );
        let counts: Vec<u32> = pieces[1..]
            .iter()
            .map(|p| match p {
                Piece::Fragment(_, n) => *n,
                Piece::Init(_) => u32::MAX,
            })
            .collect();
        assert_eq!(counts, [1, 1, 0]);
        // The audio-only fragment: its trun's data offset points at the mdat's payload,
        // which holds the frame; its tfdt follows the two frames before.
        let mdat = last.windows(4).position(|w| w == b"mdat").unwrap() + 4;
        assert_eq!(&last[mdat..], &[0xcc; 3]);
        let trun = last.windows(4).position(|w| w == b"trun").unwrap() + 4;
        let offset = u32::from_be_bytes(last[trun + 8..trun + 12].try_into().unwrap());
        assert_eq!(offset as usize, mdat);
        let tfdt = last.windows(4).position(|w| w == b"tfdt").unwrap() + 4;
        assert_eq!(
            &last[tfdt..tfdt + 12],
            &[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8, 0]
        );
    }
}
