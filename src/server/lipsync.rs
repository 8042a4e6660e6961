//! `POST /v1/lipsync`: speech and an avatar in, a fragmented MP4 streamed out while it is made.
//!
//! Everything that can be checked is checked before the first byte (form, audio, image or
//! avatar id, face, limits, admission, the encoder starting); then the response starts and
//! the video follows as fragments are produced. A failure after that point can only abort
//! the connection, so the client never mistakes a cut-off video for a complete one.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::multipart::{Multipart, MultipartRejection};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use tokio::sync::mpsc;

use super::error::ApiError;
use super::{avatars, form, App};
use crate::engine::job::Job;
use crate::engine::metrics as m;
use crate::engine::render::video_frames;
use crate::engine::scheduler::FrameWork;
use crate::engine::{self, Avatar};
use crate::media::audio::{self, Fps, FramePlan, WINDOW};
use crate::media::face::{Blend, FaceBox, Pads};
use crate::media::video::{self, EncoderSettings};

const FILES: &[&str] = &["audio", "image"];
const TEXTS: &[&str] = &["avatar_id", "box", "pads", "fps", "blend", "crf"];

/// Encoded chunks buffered between ffmpeg and the client (the rest waits in ffmpeg's pipe:
/// a slow reader slows the encoder, which slows the model work of that request).
const BODY_CHUNKS: usize = 4;

/// Counts a refused request and passes the error on.
pub fn refused(e: ApiError) -> ApiError {
    let outcome = match e.status.as_u16() {
        429 => "overloaded",
        503 => "unavailable",
        400..=499 => "client_error",
        _ => "failed",
    };
    metrics::counter!(m::REQUESTS_TOTAL, "outcome" => outcome).increment(1);
    e
}

/// What a request asks for, parsed.
struct Request {
    audio: Bytes,
    avatar: AvatarSource,
    fps: Fps,
    blend: Blend,
    crf: u8,
}

enum AvatarSource {
    Image {
        bytes: Bytes,
        face_box: Option<FaceBox>,
        pads: Pads,
    },
    Cached(String),
}

async fn parse(
    multipart: Result<Multipart, MultipartRejection>,
    app: &App,
) -> Result<Request, ApiError> {
    let mut f = form::read(multipart, FILES, TEXTS, app.args.max_body_bytes).await?;
    let audio = f
        .file("audio")
        .ok_or_else(|| ApiError::bad_request("missing_field", "the form needs an `audio` file"))?;
    let face_box: Option<FaceBox> = f.parse("box")?;
    let pads: Option<Pads> = f.parse("pads")?;
    let avatar = match (f.file("image"), f.text("avatar_id")) {
        (Some(bytes), None) => AvatarSource::Image {
            bytes,
            face_box,
            pads: pads.unwrap_or_default(),
        },
        (None, Some(id)) => {
            if face_box.is_some() || pads.is_some() {
                return Err(ApiError::bad_request(
                    "bad_field",
                    "`box` and `pads` belong to the avatar: give them when creating it, not with `avatar_id`",
                ));
            }
            AvatarSource::Cached(id)
        }
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "bad_field",
                "give either `image` or `avatar_id`, not both",
            ))
        }
        (None, None) => {
            return Err(ApiError::bad_request(
                "missing_field",
                "the form needs an `image` file or an `avatar_id`",
            ))
        }
    };
    let crf: Option<u8> = f.parse("crf")?;
    if crf.is_some_and(|c| c > 51) {
        return Err(ApiError::bad_request(
            "bad_field",
            "field `crf`: must be 0-51",
        ));
    }
    Ok(Request {
        audio,
        avatar,
        fps: f.parse("fps")?.unwrap_or_default(),
        blend: f.parse("blend")?.unwrap_or_default(),
        crf: crf.unwrap_or(app.args.crf),
    })
}

/// Decoded and planned, ready for admission.
struct Prepared {
    speech_seconds: f64,
    frames: Vec<FrameWork>,
    video_frames: usize,
    avatar: Arc<Avatar>,
}

fn prepare(app: &App, req: &Request, avatar: Arc<Avatar>) -> Result<Prepared, ApiError> {
    let t = Instant::now();
    let speech = audio::load(&req.audio, app.args.max_audio_seconds)?;
    m::stage("decode", t.elapsed());
    let t = Instant::now();
    let mel = speech.mel();
    let plan = FramePlan::new(mel.frames(), req.fps)?;
    let frames = (0..plan.len())
        .map(|index| FrameWork {
            index,
            mel: mel.window(plan.start(index), WINDOW),
        })
        .collect();
    m::stage("mel", t.elapsed());
    let avatar = if avatar.blend == req.blend {
        avatar
    } else {
        Arc::new(avatar.with_blend(req.blend))
    };
    Ok(Prepared {
        speech_seconds: speech.seconds(),
        video_frames: video_frames(speech.seconds(), req.fps, plan.len()),
        frames,
        avatar,
    })
}

pub async fn lipsync(
    State(app): State<Arc<App>>,
    multipart: Result<Multipart, MultipartRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let pool = app.ready_pool().map_err(refused)?;
    let req = parse(multipart, &app).await.map_err(refused)?;
    // Slots are limited; take one before the CPU work of decoding.
    let permit = app
        .requests
        .clone()
        .try_acquire_owned()
        .map_err(|_| refused(overloaded(&app, "too many streams in progress")))?;

    let cached = match &req.avatar {
        AvatarSource::Cached(id) => Some(avatars::lookup(&app, id).map_err(refused)?),
        AvatarSource::Image { .. } => None,
    };
    let app2 = app.clone();
    let (prepared, req) =
        tokio::task::spawn_blocking(move || -> Result<(Prepared, Request), ApiError> {
            let avatar = match (&req.avatar, cached) {
                (
                    AvatarSource::Image {
                        bytes,
                        face_box,
                        pads,
                    },
                    _,
                ) => {
                    let t = Instant::now();
                    let a =
                        Avatar::prepare(bytes, &app2.image_limits(), *face_box, *pads, req.blend)?;
                    m::stage("decode", t.elapsed());
                    Arc::new(a)
                }
                (AvatarSource::Cached(_), Some(a)) => a,
                (AvatarSource::Cached(_), None) => {
                    unreachable!("cached avatars are looked up first")
                }
            };
            Ok((prepare(&app2, &req, avatar)?, req))
        })
        .await
        .map_err(|e| {
            refused(ApiError::internal(format!(
                "request preparation panicked: {e}"
            )))
        })?
        .map_err(refused)?;

    let scheduler = pool.scheduler().clone();
    let face = Arc::new(prepared.avatar.input.clone());
    let model_frames = prepared.frames.len();
    let (request, results) = scheduler.admit(prepared.frames, face).map_err(|o| {
        refused(overloaded(
            &app,
            &format!("{} frames are already waiting", o.queued),
        ))
    })?;

    // The encoder reads the speech from a file, which lives as long as the job.
    let (tx, body) = mpsc::channel::<Result<Bytes, std::io::Error>>(BODY_CHUNKS);
    let started_encoder = (|| -> Result<_, ApiError> {
        let mut audio_file = tempfile::Builder::new()
            .prefix("lipsync-audio-")
            .tempfile()
            .map_err(ApiError::internal)?;
        audio_file
            .write_all(&req.audio)
            .map_err(ApiError::internal)?;
        let frame = &prepared.avatar.frame;
        let mut settings = EncoderSettings::new(frame.width, frame.height, req.fps);
        settings.preset = app.args.preset.clone();
        settings.crf = req.crf;
        settings.audio = Some(audio_file.path().to_path_buf());
        settings.ffmpeg = app.args.ffmpeg.clone();
        settings.threads = app.args.encoder_threads.map(usize::from);
        settings.workers = app.cfg.encoder_workers;
        let sink = ChannelSink {
            tx: tx.clone(),
            started,
            first: false,
        };
        let encoder = video::spawn(settings, Box::new(sink)).map_err(ApiError::from)?;
        Ok((audio_file, encoder))
    })();
    let (audio_file, encoder) = match started_encoder {
        Ok(x) => x,
        Err(e) => {
            scheduler.cancel(request);
            return Err(refused(e));
        }
    };

    let job = Job {
        request,
        results,
        model_frames,
        video_frames: prepared.video_frames,
        avatar: prepared.avatar,
    };
    let seconds = prepared.speech_seconds;
    std::thread::Builder::new()
        .name(format!("lipsync-job-{}", request.0))
        .spawn(move || {
            let _permit = permit;
            let _audio_file = audio_file;
            // The body stream dropped its receiver: the client is gone.
            let gone = || tx.is_closed();
            let result = job.run(&scheduler, encoder, &gone);
            let outcome = match &result {
                Ok(summary) => {
                    tracing::info!(
                        "request {}: {} frames, {:.2} s of speech, {} bytes in {:.2} s",
                        request.0,
                        summary.frames,
                        seconds,
                        summary.bytes,
                        started.elapsed().as_secs_f64()
                    );
                    "success"
                }
                Err(engine::Error::Cancelled) => {
                    tracing::info!("request {}: the client went away", request.0);
                    "cancelled"
                }
                Err(e) => {
                    // After the first byte only the connection can carry the failure: ending
                    // the body with an error aborts it (no final chunk).
                    tracing::error!(
                        "request {} failed after the response started: {e}",
                        request.0
                    );
                    let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
                    "failed"
                }
            };
            metrics::counter!(m::REQUESTS_TOTAL, "outcome" => outcome).increment(1);
            metrics::histogram!(m::REQUEST_DURATION).record(started.elapsed().as_secs_f64());
        })
        .map_err(|e| {
            refused(ApiError::internal(format!(
                "cannot start the request thread: {e}"
            )))
        })?;

    let stream = futures_util::stream::unfold(body, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    Ok((
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "video/mp4"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

fn overloaded(app: &App, why: &str) -> ApiError {
    ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "overloaded",
        format!("the server is busy ({why}); retry later"),
    )
    .with_retry_after(app.retry_after())
}

/// Feeds ffmpeg's output into the HTTP body. Blocking: it runs on the encoder's reader
/// thread, so a slow client slows the encoder (and no further).
struct ChannelSink {
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
    started: Instant,
    first: bool,
}

impl Write for ChannelSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.tx
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "client gone"))?;
        if !self.first {
            self.first = true;
            metrics::histogram!(m::TIME_TO_FIRST_BYTE).record(self.started.elapsed().as_secs_f64());
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
