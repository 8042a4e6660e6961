//! `POST /v1/lipsync`: speech and an avatar in, a fragmented MP4 streamed out while it is made.
//!
//! Everything that can be checked is checked before the first byte (form, audio, image or
//! avatar id, face, limits, admission, the encoder starting); then the response starts and
//! the video follows as fragments are produced. A failure after that point can only abort
//! the connection, so the client never mistakes a cut-off video for a complete one.

use std::io::Write;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::multipart::{Multipart, MultipartRejection};
use axum::extract::{ConnectInfo, FromRequest, State};
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use tokio::sync::mpsc;

use super::avatars::{self, Upload};
use super::conn::ConnInfo;
use super::error::ApiError;
use super::{form, App};
use crate::engine::enhance::EnhanceWith;
use crate::engine::metrics as m;
use crate::engine::pipeline::{self, Class, Speech, StartError};
use crate::engine::pool::panic_message;
use crate::engine::{self, Avatar, Loop};
use crate::media::audio::Fps;
use crate::media::face::Blend;
use crate::media::video;

/// The file fields of a render request (also of a batch job).
pub(super) const FILES: &[&str] = &["audio", "image", "video"];
/// The text fields of a render request (a batch job adds its own).
pub(super) const TEXTS: &[&str] = &[
    "avatar_id",
    "box",
    "pads",
    "landmarks",
    "smooth",
    "loop",
    "fps",
    "blend",
    "crf",
    "enhance",
];

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
pub(super) struct Request {
    pub audio: Bytes,
    pub avatar: AvatarSource,
    /// For a photo; a clip runs at its own rate.
    pub fps: Fps,
    pub loop_mode: Loop,
    pub blend: Blend,
    pub crf: u8,
    /// The enhancer run on every predicted face (`enhance`; default none).
    pub enhance: Option<EnhanceWith>,
}

pub(super) enum AvatarSource {
    Upload(Upload),
    Cached(String),
}

async fn parse(
    multipart: Result<Multipart, MultipartRejection>,
    app: &App,
) -> Result<Request, ApiError> {
    let mut f = form::read(multipart, FILES, TEXTS, app.args.max_body_bytes).await?;
    parse_form(&mut f, app)
}

/// The render request in a form read with [`FILES`] and [`TEXTS`] (and maybe more).
pub(super) fn parse_form(f: &mut form::Form, app: &App) -> Result<Request, ApiError> {
    let audio = f
        .file("audio")
        .ok_or_else(|| ApiError::bad_request("missing_field", "the form needs an `audio` file"))?;
    let avatar = match (Upload::from_form(f)?, f.text("avatar_id")) {
        (Some(upload), None) => AvatarSource::Upload(upload),
        (None, Some(id)) => AvatarSource::Cached(id),
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "bad_field",
                "give one of `image`, `video` or `avatar_id`, not several",
            ))
        }
        (None, None) => {
            return Err(ApiError::bad_request(
                "missing_field",
                "the form needs an `image` or `video` file, or an `avatar_id`",
            ))
        }
    };
    let crf: Option<u8> = f.parse("crf")?;
    let crf = crf
        .map(video::check_crf)
        .transpose()
        .map_err(|e| ApiError::bad_request("bad_field", format!("field `crf`: {e}")))?;
    let enhance = app.enhancers.resolve(f.text("enhance").as_deref())?;
    Ok(Request {
        audio,
        avatar,
        fps: f.parse("fps")?.unwrap_or_default(),
        loop_mode: f.parse("loop")?.unwrap_or_default(),
        blend: f.parse("blend")?.unwrap_or_default(),
        crf: crf.unwrap_or(app.args.media.crf),
        enhance,
    })
}

pub async fn lipsync(
    State(app): State<Arc<App>>,
    ConnectInfo(conn): ConnectInfo<ConnInfo>,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let request_id = super::request_id_of(&req);
    // Refusals before the body is read drain it first (see `refuse_unread`).
    if let Err(e) = app.ready_engine() {
        return Ok(refuse_unread(req, &app, e).await);
    }
    // Slots are limited; take one before buffering the body or decoding anything.
    let permit = match app.requests.clone().try_acquire_owned() {
        Ok(p) => p,
        Err(_) => {
            let e = overloaded(&app, "too many streams in progress");
            return Ok(refuse_unread(req, &app, e).await);
        }
    };
    let multipart = Multipart::from_request(req, &()).await;
    let req = parse(multipart, &app).await.map_err(refused)?;

    let cached = match &req.avatar {
        AvatarSource::Cached(id) => Some(avatars::lookup(&app, id).await.map_err(refused)?),
        AvatarSource::Upload(_) => None,
    };
    // The encoder writes into the body channel; the render starts (or is refused) before
    // the first byte.
    let (tx, body) = mpsc::channel::<Result<Bytes, std::io::Error>>(BODY_CHUNKS);
    let sink = ChannelSink {
        tx: tx.clone(),
        started,
        first: false,
    };
    let app2 = app.clone();
    let span = tracing::Span::current();
    let render = tokio::task::spawn_blocking(move || {
        let _enter = span.enter();
        start(&app2, req, cached, Box::new(sink))
    })
    .await
    .map_err(|e| {
        refused(ApiError::internal(format!(
            "request preparation panicked: {e}"
        )))
    })?
    .map_err(refused)?;
    let speech_seconds = render.speech_seconds();
    let video_frames = render.video_frames();

    let complete = Arc::new(AtomicBool::new(false));
    let completed = complete.clone();
    let span = tracing::Span::current();
    std::thread::Builder::new()
        .name(format!("lipsync-job-{request_id}"))
        .spawn(move || {
            let _enter = span.enter();
            let _permit = permit;
            // The body stream dropped its receiver: the client is gone.
            let gone = || tx.is_closed();
            let result =
                std::panic::catch_unwind(AssertUnwindSafe(|| render.run(&gone, &mut |_, _| {})))
                    .unwrap_or_else(|panic| {
                        Err(engine::Error::Inference(format!(
                            "the request's job panicked: {}",
                            panic_message(&panic)
                        )))
                    });
            let outcome = match &result {
                Ok(stats) => {
                    completed.store(true, Ordering::SeqCst);
                    tracing::info!(
                        "{} frames, {speech_seconds:.2} s of speech, {} bytes in {:.2} s",
                        stats.summary.frames,
                        stats.summary.bytes,
                        started.elapsed().as_secs_f64()
                    );
                    "success"
                }
                Err(engine::Error::Cancelled) if conn.timed_out() => {
                    tracing::warn!(
                        "the client took no bytes within the send timeout; stream aborted"
                    );
                    "client_timeout"
                }
                Err(engine::Error::Cancelled) => {
                    tracing::info!("the client went away");
                    "cancelled"
                }
                Err(e) => {
                    // After the first byte only the connection can carry the failure: ending
                    // the body with an error aborts it (no final chunk).
                    tracing::error!("failed after the response started: {e}");
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

    // The body ends cleanly only when the job says the video is complete; a channel closed
    // any other way (the job failed or panicked) aborts the connection, so a client never
    // takes a cut-off video for a whole one.
    let stream = futures_util::stream::unfold(Some(body), move |rx| {
        let complete = complete.clone();
        async move {
            let mut rx = rx?;
            match rx.recv().await {
                Some(item) => Some((item, Some(rx))),
                None if complete.load(Ordering::SeqCst) => None,
                None => Some((
                    Err(std::io::Error::other("the video could not be completed")),
                    None,
                )),
            }
        }
    });
    Ok((
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, HeaderValue::from_static("video/mp4")),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
            // Known before the first byte: a player can show progress ("n of N").
            (VIDEO_FRAMES, HeaderValue::from(video_frames)),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// `X-Video-Frames` of a `POST /v1/lipsync` response: the frames the video will hold.
pub(super) const VIDEO_FRAMES: HeaderName = HeaderName::from_static("x-video-frames");

/// The request's avatar: the upload prepared (blocking: decoding, face detection), or the
/// one looked up by id (`cached`).
pub(super) fn prepare_avatar(
    app: &App,
    req: &Request,
    cached: Option<Arc<Avatar>>,
) -> Result<Arc<Avatar>, ApiError> {
    Ok(match (&req.avatar, cached) {
        (AvatarSource::Upload(upload), _) => {
            let t = Instant::now();
            let a = upload.prepare(app, req.blend)?;
            m::stage("decode", t.elapsed());
            Arc::new(a)
        }
        (AvatarSource::Cached(_), Some(a)) => a,
        (AvatarSource::Cached(id), None) => {
            return Err(ApiError::internal(format!("avatar {id} was not looked up")))
        }
    })
}

/// Prepares the avatar (or takes the cached one) and starts the render into `sink`.
fn start(
    app: &App,
    req: Request,
    cached: Option<Arc<Avatar>>,
    sink: video::Sink,
) -> Result<pipeline::Started, ApiError> {
    let avatar = prepare_avatar(app, &req, cached)?;
    // Checked ready before the body was read.
    let engine = app
        .engine
        .get()
        .ok_or_else(|| ApiError::internal("the engine is gone"))?;
    let settings = app.render_settings();
    let work = pipeline::Work {
        speech: Speech::bytes(req.audio),
        avatar,
        options: pipeline::Options {
            fps: req.fps,
            loop_mode: req.loop_mode,
            blend: req.blend,
            crf: Some(req.crf),
            preset: None,
            enhance: req.enhance,
        },
        class: Class::Interactive,
        keep: Default::default(),
    };
    pipeline::start(engine, &settings, work, sink).map_err(|e| match e {
        StartError::Overloaded(_) => overloaded(app, &e.to_string()),
        StartError::Failed(e) => e.into(),
    })
}

/// A refusal sent before the request body was read: the body is drained first (up to the
/// body limit, within the read timeout) and the connection closed after the answer, so the
/// client sees the status instead of a reset, and does not reuse a half-read connection.
async fn refuse_unread(req: axum::extract::Request, app: &App, e: ApiError) -> Response {
    form::drain(req.into_body(), app.args.max_body_bytes).await;
    let mut res = refused(e).into_response();
    res.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    res
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
