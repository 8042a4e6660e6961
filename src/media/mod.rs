//! Media in and out: audio decoding, the mel front end and the frame plan; images, face boxes,
//! crops and compositing; video encoding. CPU only; knows nothing of tokio, HTTP or the model.

pub mod audio;
pub mod face;
pub mod image;
pub mod jpeg;
pub mod video;
pub mod yuv;

/// Errors of the media layer, each a problem with what the user supplied (or a limit it hit).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    #[error("the audio is empty (0 bytes)")]
    EmptyAudio,
    #[error(
        "not an audio file lipsync can read ({0}); send WAV, MP3, FLAC, Ogg Vorbis or M4A/AAC"
    )]
    NotAudio(String),
    #[error("unsupported audio codec: {0}; send WAV (PCM), MP3, FLAC, Ogg Vorbis or M4A/AAC")]
    UnsupportedCodec(String),
    #[error("the audio file is truncated: {0}")]
    TruncatedAudio(String),
    #[error("the audio file is damaged: {0}")]
    CorruptAudio(String),
    #[error("the audio holds no sound samples")]
    NoSamples,
    #[error(
        "the audio is too short: {seconds:.3} s, but lip sync needs at least {min_seconds:.3} s \
         (one 16-frame mel window)"
    )]
    AudioTooShort { seconds: f64, min_seconds: f64 },
    #[error("the audio is too long: {seconds:.1} s, the limit is {max_seconds:.1} s")]
    AudioTooLong { seconds: f64, max_seconds: f64 },
    #[error("the audio contains NaN or infinite samples")]
    NonFiniteAudio,
    #[error("bad frame rate: {0}")]
    BadFps(String),
    #[error("the image is empty (0 bytes)")]
    EmptyImage,
    #[error("not an image ({0}); send a PNG, JPEG or WebP photo")]
    NotAnImage(String),
    #[error("unsupported image: {0}")]
    UnsupportedImage(String),
    #[error("the image is damaged: {0}")]
    CorruptImage(String),
    #[error("the image is too large: {width}x{height} pixels, the limit is {max_pixels} pixels")]
    TooManyPixels {
        width: u32,
        height: u32,
        max_pixels: u64,
    },
    #[error("no face: {0}")]
    NoFace(String),
    #[error("bad box: {0}")]
    BadBox(String),
    #[error("bad pads: {0}")]
    BadPads(String),
    #[error("bad landmarks: {0}")]
    BadLandmarks(String),
    #[error("bad blend mode: {0}")]
    BadBlend(String),
    #[error("bad loop mode: {0}")]
    BadLoop(String),
    #[error("not a video: {0}")]
    NotVideo(String),
    #[error("the video is damaged: {0}")]
    DamagedVideo(String),
    #[error("frame rate too high: {0}")]
    FpsTooHigh(String),
    #[error(
        "the avatar clip is too long: {seconds:.1} s, the limit is {max_seconds:.1} s \
         (--max-avatar-seconds)"
    )]
    AvatarTooLong { seconds: f64, max_seconds: f64 },
    #[error("ffmpeg is not available: {0}")]
    FfmpegMissing(String),
    #[error("video encoding failed: {0}")]
    Encoder(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// A stable snake_case name for the kind of error (JSON `error_type`, metrics).
    pub fn kind(&self) -> &'static str {
        match self {
            Error::EmptyAudio => "empty_audio",
            Error::NotAudio(_) => "not_audio",
            Error::UnsupportedCodec(_) => "unsupported_codec",
            Error::TruncatedAudio(_) => "truncated_audio",
            Error::CorruptAudio(_) => "corrupt_audio",
            Error::NoSamples => "no_samples",
            Error::AudioTooShort { .. } => "audio_too_short",
            Error::AudioTooLong { .. } => "audio_too_long",
            Error::NonFiniteAudio => "non_finite_audio",
            Error::BadFps(_) => "bad_fps",
            Error::EmptyImage => "empty_image",
            Error::NotAnImage(_) => "not_an_image",
            Error::UnsupportedImage(_) => "unsupported_image",
            Error::CorruptImage(_) => "corrupt_image",
            Error::TooManyPixels { .. } => "image_too_large",
            Error::NoFace(_) => "no_face",
            Error::BadBox(_) => "bad_box",
            Error::BadPads(_) => "bad_pads",
            Error::BadLandmarks(_) => "bad_landmarks",
            Error::BadBlend(_) => "bad_blend",
            Error::BadLoop(_) => "bad_loop",
            Error::NotVideo(_) => "not_video",
            Error::DamagedVideo(_) => "damaged_video",
            Error::FpsTooHigh(_) => "fps_too_high",
            Error::AvatarTooLong { .. } => "avatar_too_long",
            Error::FfmpegMissing(_) => "ffmpeg_missing",
            Error::Encoder(_) => "encoder_failed",
            Error::Internal(_) => "internal",
        }
    }
}
