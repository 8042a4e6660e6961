//! The HTTP service: `lipsync serve`.
//!
//! Routes: `POST /v1/lipsync` (streamed MP4), `POST /v1/avatars`, `GET`/`DELETE
//! /v1/avatars/{id}`, `GET /health` (liveness), `GET /ready` (every model instance loaded and
//! warmed up), `GET /info`, `GET /metrics` (Prometheus), `GET /openapi.yaml`. The server binds
//! first and loads the model in the background; SIGTERM/SIGINT stop it accepting, let
//! in-flight streams finish up to `--shutdown-timeout`, then exit.

pub mod avatars;
pub mod config;
pub mod conn;
pub mod error;
pub mod form;
pub mod jobs;
pub mod lipsync;
pub mod live_cpu;
pub mod stream;
pub mod ui;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::sync::Semaphore;

use config::Resolved;
pub use config::ServeArgs;
use error::ApiError;

use crate::engine::avatar_store::{AvatarStore, StoreError};
use crate::engine::cache::AvatarCache;
use crate::engine::metrics as m;
use crate::engine::Engine;
use crate::model::weights::Summary;
use crate::{media, model};

/// The OpenAPI description, served at `/openapi.yaml`.
pub const OPENAPI: &str = include_str!("../../openapi.yaml");

static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Why the service could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Media(#[from] media::Error),
    #[error("cannot load the model: {0}")]
    Model(#[from] model::Error),
    #[error("cannot open the avatar directory: {0}")]
    AvatarDir(#[from] StoreError),
    #[error("batch jobs: {0}")]
    Jobs(String),
    #[error("cannot set up metrics: {0}")]
    Metrics(String),
    #[error("server error: {0}")]
    Io(#[from] std::io::Error),
}

/// State shared by every handler.
pub struct App {
    pub args: ServeArgs,
    pub cfg: Resolved,
    engine: OnceLock<Engine>,
    summary: OnceLock<Summary>,
    avatars: Mutex<AvatarCache>,
    /// `--avatar-dir`: the prepared avatars on disk, under the memory cache.
    avatar_store: Option<Arc<AvatarStore>>,
    prometheus: PrometheusHandle,
    requests: Arc<Semaphore>,
    sessions: Arc<stream::Sessions>,
    shutting_down: AtomicBool,
    started: Instant,
    /// Batch jobs (`/v1/jobs`): the store, the data directory and the workers.
    jobs: Arc<crate::jobs::worker::Jobs>,
    /// The enhancers loaded at start-up (`--enhancer-checkpoint`), also the engine's.
    enhancers: Arc<crate::engine::enhance::Enhancers>,
    /// Encoder processes started ahead of the renders (every door's renders share them).
    spares: media::video::Spares,
}

impl App {
    fn avatars(&self) -> MutexGuard<'_, AvatarCache> {
        self.avatars.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether SIGTERM/SIGINT arrived.
    fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// The render settings every door shares (from the media flags).
    fn render_settings(&self) -> crate::engine::pipeline::Settings {
        let media = &self.args.media;
        crate::engine::pipeline::Settings::new(media.max_audio_seconds, |w, h, fps| {
            let mut s = media.encoder(w, h, fps, self.cfg.encoder_workers);
            s.spares = Some(self.spares.clone());
            s
        })
    }

    /// The engine, if every instance is loaded and warmed up and the server is not stopping.
    fn ready_engine(&self) -> Result<&Engine, ApiError> {
        let unavailable = |why: String| {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "not_ready", why).with_retry_after(5)
        };
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(unavailable("the server is shutting down".into()));
        }
        let Some(engine) = self.engine.get() else {
            return Err(unavailable("the model is loading".into()));
        };
        let status = engine.status();
        if let Some(e) = status.failed() {
            return Err(unavailable(format!(
                "a model instance failed to start: {e}"
            )));
        }
        if !status.all_ready() {
            return Err(unavailable(format!(
                "model instances {} ({} of {} ready)",
                if status.restarts() > 0 {
                    "restarting"
                } else {
                    "warming up"
                },
                status.ready(),
                status.instances
            )));
        }
        Ok(engine)
    }

    /// Seconds a refused client should wait: the queued frames at the observed rate.
    fn retry_after(&self) -> u64 {
        let queued = self.engine.get().map_or(0, |p| p.scheduler().queued()) as f64;
        let fps = self
            .engine
            .get()
            .map_or(0.0, |p| p.status().frames_per_second());
        if fps > 0.0 {
            (queued / fps).ceil().clamp(1.0, 300.0) as u64
        } else {
            5
        }
    }
}

/// The batch jobs' workers render with this process's engine once it is ready.
impl crate::jobs::worker::Host for App {
    fn engine(&self) -> Option<&Engine> {
        self.ready_engine().ok()
    }

    fn render_settings(&self) -> crate::engine::pipeline::Settings {
        App::render_settings(self)
    }
}

/// Reads a request id from the client or makes one; every response carries it, and every log
/// line written while handling the request (its job thread included) is in a span with it.
async fn request_id(mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(&REQUEST_ID)
        .filter(|v| v.len() <= 128 && v.to_str().is_ok_and(|s| !s.is_empty()))
        .cloned()
        .unwrap_or_else(|| {
            HeaderValue::from_str(&uuid::Uuid::new_v4().simple().to_string())
                .expect("hex is a valid header value")
        });
    req.headers_mut().insert(REQUEST_ID.clone(), id.clone());
    let span = tracing::info_span!("request", id = %id.to_str().unwrap_or("?"), method = %req.method(), path = %req.uri().path());
    let mut res = {
        use tracing::Instrument;
        async {
            tracing::debug!("started");
            next.run(req).await
        }
        .instrument(span)
        .await
    };
    res.headers_mut().insert(REQUEST_ID.clone(), id);
    res
}

/// The request's id (set by the `request_id` middleware).
pub fn request_id_of(req: &Request) -> String {
    req.headers()
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_string()
}

/// With `--api-key`: `Authorization: Bearer <key>` on the /v1/ routes.
async fn require_key(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.args.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !constant_time_eq(given.as_bytes(), key.as_bytes()) {
            return lipsync::refused(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "missing or wrong API key (send `Authorization: Bearer <key>`)",
            ))
            .into_response();
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

async fn ready(State(app): State<Arc<App>>) -> Result<Json<serde_json::Value>, ApiError> {
    let engine = app.ready_engine()?;
    Ok(Json(serde_json::json!({
        "status": "ready",
        "instances": engine.status().instances,
    })))
}

/// `/info`'s `enhancers`, each with the drawing rate one more live session using it would get
/// (its faces weighed by the enhancer's cost; null until the engine has measured its batches).
fn enhancer_info(app: &App) -> serde_json::Value {
    let mut list = app.enhancers.info();
    let engine = app.engine.get();
    if let Some(items) = list.as_array_mut() {
        for (item, with) in items.iter_mut().zip(app.enhancers.all()) {
            item["live_draw_fps"] = engine
                .and_then(|e| stream::next_draw_fps_with(app, e, with.seconds_per_face))
                .into();
            item["live_max_sessions"] = engine
                .map(|e| stream::max_sessions_with(app, e, with.seconds_per_face))
                .into();
        }
    }
    list
}

async fn info(State(app): State<Arc<App>>) -> Json<serde_json::Value> {
    let a = &app.args;
    let e = &a.engine;
    let md = &a.media;
    // The live settings as a session gets them (its size does not change them).
    let live = md.live_encoder(512, 512, crate::media::audio::Fps::DEFAULT);
    let c = &app.cfg;
    let summary = app.summary.get();
    let status = app.engine.get().map(|p| p.status().clone());
    let fill_batch = app.engine.get().map(|p| p.scheduler().limits().fill_batch);
    Json(serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "checkpoint": e.checkpoint,
        "format": summary.map(|s| s.format),
        "folded": summary.map(|s| s.folded),
        "random_weights": summary.map(|s| s.random_init_seed.is_some()),
        "device": c.device,
        "cuda_device": (c.device == crate::model::DeviceKind::Cuda).then_some(c.cuda_device),
        "dtype": c.precision,
        "compute_dtype": status.as_ref().and_then(|s| s.dtype()).map(|d| d.as_str()),
        "conv_path": status.as_ref().and_then(|s| s.conv_path()),
        "autotune_cache": e.conv.autotune_cache,
        "instances": c.instances,
        "instances_ready": status.as_ref().map_or(0, |s| s.ready()),
        "max_batch": c.max_batch,
        "first_batch": c.first_batch,
        "fill_batch": fill_batch,
        "fill_latency_ms": e.fill_latency_ms,
        "batch_cost": status.as_ref().and_then(|s| s.batch_cost()),
        "instance_restarts": status.as_ref().map_or(0, |s| s.restarts()),
        "batch_wait_ms": e.batch_wait_ms,
        "pad_batches": c.pad_batches,
        "gpu_memory_limit": e.gpu_memory_limit,
        "enhancers": enhancer_info(&app),
        "landmark_detector": app.enhancers.detector_info(),
        "limits": {
            "max_queue_frames": c.max_queue_frames,
            "max_ahead_frames": c.max_ahead_frames,
            "max_requests": a.max_requests,
            "max_body_bytes": a.max_body_bytes,
            "max_pixels": md.max_pixels,
            "max_side": md.max_side,
            "max_audio_seconds": md.max_audio_seconds,
            "max_avatar_seconds": md.max_avatar_seconds,
            "send_timeout_seconds": a.send_timeout,
            "read_timeout_seconds": a.read_timeout,
            "avatar_cache_entries": a.avatar_cache_entries,
            "avatar_cache_bytes": a.avatar_cache_bytes,
        },
        "encoder": {
            "preset": md.preset,
            "crf": md.crf,
            "workers": app.cfg.encoder_workers,
            "threads": md.encoder_threads,
        },
        "sessions": {
            "max_sessions": app.engine.get().map(|e| stream::max_sessions(&app, e)),
            "draw_fps": app.engine.get().and_then(|e| stream::next_draw_fps(&app, e)),
            // What a live frame costs the CPU (the offer's second limit): measured as frames
            // go out, or the prior until then.
            "cpu_seconds_per_megapixel": app.sessions.cpu.seconds_per_megapixel(),
            "cpu_measured": app.sessions.cpu.measured(),
            // The fMP4 output's encoder: one x264 process per session.
            "encoder": {
                "preset": live.preset,
                "crf": live.crf,
                "max_bitrate": live.max_bitrate,
                "threads": live.threads,
            },
            "utterance_gap_ms": a.utterance_gap_ms,
            "idle_timeout_seconds": a.session_idle_timeout,
        },
        "auth": a.api_key.is_some(),
        "requests_in_flight": app.engine.get().map_or(0, |e| e.scheduler().requests()),
        "uptime_seconds": app.started.elapsed().as_secs_f64(),
    }))
}

/// Resident memory of this process, from /proc (Linux).
fn resident_memory() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024.0)
}

/// Used and total memory of CUDA device `index` (`--cuda-device`), from NVML (loaded at run
/// time; `None` without it). NVML numbers every GPU of the machine, CUDA only those in
/// `CUDA_VISIBLE_DEVICES` (and maybe in another order), so the GPU is found by its UUID, by
/// number only when the UUID cannot be read.
#[cfg(feature = "cuda")]
fn gpu_memory(index: usize) -> Option<(u64, u64)> {
    static UUID: OnceLock<Option<String>> = OnceLock::new();
    let uuid = UUID.get_or_init(|| model::cuda_device_uuid(index));
    static NVML: OnceLock<Option<nvml_wrapper::Nvml>> = OnceLock::new();
    let nvml = NVML
        .get_or_init(|| match nvml_wrapper::Nvml::init() {
            Ok(n) => Some(n),
            Err(e) => {
                tracing::warn!("NVML unavailable, no GPU memory metrics: {e}");
                None
            }
        })
        .as_ref()?;
    let device = match uuid.as_deref().map(|u| nvml.device_by_uuid(u)) {
        Some(Ok(d)) => d,
        _ => nvml.device_by_index(u32::try_from(index).ok()?).ok()?,
    };
    let info = device.memory_info().ok()?;
    Some((info.used, info.total))
}

#[cfg(not(feature = "cuda"))]
fn gpu_memory(_index: usize) -> Option<(u64, u64)> {
    None
}

async fn metrics_text(State(app): State<Arc<App>>) -> impl IntoResponse {
    if let Some(rss) = resident_memory() {
        metrics::gauge!(m::RESIDENT_MEMORY).set(rss);
    }
    if app.cfg.device == crate::model::DeviceKind::Cuda {
        if let Some((used, total)) = gpu_memory(app.cfg.cuda_device) {
            metrics::gauge!(m::GPU_MEMORY_USED).set(used as f64);
            metrics::gauge!(m::GPU_MEMORY_TOTAL).set(total as f64);
        }
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.prometheus.render(),
    )
}

async fn openapi() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/yaml")], OPENAPI)
}

async fn not_found(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::not_found("not_found", format!("no route for {method} {}", uri.path()))
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not allowed on {}", uri.path()),
    )
}

/// Bodies larger than this are not even drained.
fn hard_body_cap(limit: usize) -> usize {
    limit.saturating_mul(4).max(limit.saturating_add(64 << 20))
}

/// The routes, with their middleware.
pub fn router(app: Arc<App>) -> Router {
    let v1 = Router::new()
        .route("/v1/lipsync", post(lipsync::lipsync))
        .route("/v1/avatars", post(avatars::create))
        .route(
            "/v1/avatars/{id}",
            get(avatars::get).delete(avatars::delete),
        )
        .route("/v1/jobs", post(jobs::submit).get(jobs::list))
        .route("/v1/jobs/{id}", get(jobs::get).delete(jobs::delete))
        .route("/v1/jobs/{id}/video", get(jobs::video))
        .route("/v1/jobs/{id}/cancel", post(jobs::cancel))
        .route_layer(middleware::from_fn_with_state(app.clone(), require_key));
    let mut router = Router::new()
        .merge(v1)
        // Checks its key itself: browsers cannot set headers on a WebSocket.
        .route("/v1/stream", get(stream::stream))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/info", get(info))
        .route("/metrics", get(metrics_text))
        .route("/openapi.yaml", get(openapi))
        // The page is outside the key check: it asks for the key and sends it itself.
        .merge(if app.args.no_ui {
            Router::new()
        } else {
            ui::routes()
        })
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Forms enforce --max-body-bytes themselves and drain what is over it (see form.rs);
        // beyond this hard cap the connection is simply cut.
        .layer(DefaultBodyLimit::max(hard_body_cap(
            app.args.max_body_bytes,
        )));
    if !app.args.cors_origins.is_empty() {
        // `*` (alone or in the list) means any origin; tower-http refuses it inside a list.
        let origins = &app.args.cors_origins;
        let allow = if origins.iter().any(|o| o.trim() == "*") {
            tower_http::cors::AllowOrigin::any()
        } else {
            tower_http::cors::AllowOrigin::list(
                origins
                    .iter()
                    .filter_map(|o| HeaderValue::from_str(o.trim()).ok()),
            )
        };
        router = router.layer(
            tower_http::cors::CorsLayer::new()
                .allow_origin(allow)
                .allow_methods([Method::GET, Method::POST, Method::DELETE])
                .allow_headers([
                    header::AUTHORIZATION,
                    header::CONTENT_TYPE,
                    REQUEST_ID.clone(),
                ])
                .expose_headers([
                    REQUEST_ID.clone(),
                    lipsync::VIDEO_FRAMES,
                    header::LOCATION,
                    header::CONTENT_RANGE,
                ]),
        );
    }
    if let Some(t) = config::timeout(app.args.read_timeout) {
        router = router.layer(middleware::from_fn(move |req, next| {
            form::read_timeout_layer(t, req, next)
        }));
    }
    router
        .layer(middleware::from_fn(request_id))
        .with_state(app)
}

fn install_metrics() -> Result<PrometheusHandle, ServeError> {
    let seconds = [
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    ];
    let frames = [
        1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
    ];
    let requests = [1.0, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0];
    let err = |e: metrics_exporter_prometheus::BuildError| ServeError::Metrics(e.to_string());
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &seconds)
        .map_err(err)?
        .set_buckets_for_metric(
            Matcher::Full(m::STREAM_LATENCY.into()),
            &m::stream_latency_buckets(),
        )
        .map_err(err)?
        .set_buckets_for_metric(Matcher::Full(m::BATCH_FRAMES.into()), &frames)
        .map_err(err)?
        .set_buckets_for_metric(Matcher::Full(m::BATCH_REQUESTS.into()), &requests)
        .map_err(err)?
        .install_recorder()
        .map_err(err)?;
    // Series that exist from the start, so dashboards and alerts see zeros, not gaps.
    for outcome in [
        "success",
        "client_error",
        "overloaded",
        "unavailable",
        "cancelled",
        "client_timeout",
        "failed",
    ] {
        metrics::counter!(m::REQUESTS_TOTAL, "outcome" => outcome).absolute(0);
    }
    for stage in m::STAGES {
        let _ = metrics::histogram!(m::STAGE_DURATION, "stage" => stage);
    }
    for name in [
        m::REQUEST_DURATION,
        m::TIME_TO_FIRST_BYTE,
        m::BATCH_FRAMES,
        m::BATCH_REQUESTS,
        m::STREAM_LATENCY,
    ] {
        let _ = metrics::histogram!(name);
    }
    metrics::gauge!(m::STREAM_SESSIONS).set(0.0);
    metrics::counter!(m::STREAM_LATE_FRAMES).absolute(0);
    metrics::counter!(m::STREAM_HELD_FRAMES).absolute(0);
    metrics::counter!(m::FRAMES_TOTAL).absolute(0);
    metrics::counter!(m::OOM_SPLITS).absolute(0);
    metrics::counter!(m::INSTANCE_RESTARTS).absolute(0);
    for reason in m::FALLBACK_REASONS {
        metrics::counter!(m::PRECISION_FALLBACKS, "reason" => reason).absolute(0);
    }
    metrics::counter!(m::DROPPED_FRAMES_TOTAL).absolute(0);
    metrics::counter!(m::AVATAR_CACHE_HITS).absolute(0);
    metrics::counter!(m::AVATAR_CACHE_MISSES).absolute(0);
    metrics::gauge!(m::QUEUE_FRAMES).set(0.0);
    metrics::describe_gauge!(
        m::QUEUE_SECONDS,
        metrics::Unit::Seconds,
        m::QUEUE_SECONDS_HELP
    );
    for class in m::QUEUE_CLASSES {
        m::queue_seconds(class, 0.0);
    }
    for status in crate::jobs::JobStatus::ALL {
        metrics::gauge!(crate::jobs::worker::JOBS, "status" => status.as_str()).set(0.0);
    }
    let _ = metrics::histogram!(crate::jobs::worker::JOB_DURATION);
    for outcome in ["success", "retry", "failed"] {
        metrics::counter!(crate::jobs::worker::WEBHOOK_DELIVERIES, "outcome" => outcome)
            .absolute(0);
    }
    metrics::gauge!(m::INSTANCES_BUSY).set(0.0);
    metrics::gauge!(m::INSTANCES_READY).set(0.0);
    metrics::gauge!(m::AVATAR_CACHE_BYTES).set(0.0);
    metrics::gauge!(m::AVATAR_CACHE_ENTRIES).set(0.0);
    Ok(handle)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Opens the job store and the data directory (before listening: a store that cannot be
/// used ends the server at once).
async fn open_jobs(args: &ServeArgs) -> Result<Arc<crate::jobs::worker::Jobs>, ServeError> {
    let j = &args.jobs;
    let data_dir = j.data_dir().map_err(ServeError::Jobs)?;
    std::fs::create_dir_all(data_dir.join("jobs")).map_err(|e| {
        ServeError::Jobs(format!(
            "cannot create the data directory {}: {e}",
            data_dir.display()
        ))
    })?;
    let store = crate::jobs::store::open(j.jobs_db.as_deref(), &data_dir)
        .await
        .map_err(|e| ServeError::Jobs(e.to_string()))?;
    tracing::info!(
        "batch jobs: data directory {}, store {}",
        data_dir.display(),
        j.jobs_db_redacted()
            .unwrap_or_else(|| "SQLite (jobs.db)".into())
    );
    let cfg = crate::jobs::worker::Config {
        data_dir,
        ttl: j.job_ttl(),
        max_queued: j.max_queued_jobs as u64,
        data_dir_bytes: j.data_dir_bytes,
        concurrency: j.job_concurrency,
        lease: j.job_lease(),
        webhook_secret: j.webhook_secret.clone().map(String::into_bytes),
        webhook_retry: j.webhook_retry_seconds.clone(),
        webhook_allow: j.webhook_allow(),
        webhook_timeout: crate::jobs::webhook::DEFAULT_TIMEOUT,
    };
    Ok(Arc::new(crate::jobs::worker::Jobs::new(store, cfg)))
}

/// Runs the service until SIGTERM/SIGINT (or a fatal start-up error).
pub async fn run(args: ServeArgs) -> Result<(), ServeError> {
    crate::media::video::check_ffmpeg(&args.media.ffmpeg)?;
    let prometheus = install_metrics()?;
    let cfg = args.resolve();
    // A server that could never load a model stops before it listens.
    args.engine.checkpoint_for(cfg.device)?;
    let enhancers = args.engine.load_enhancers(&cfg)?;
    // Opened before listening: a directory that cannot be used ends the server at once.
    let avatar_store = match &args.avatar_dir {
        Some(dir) => {
            let store = AvatarStore::open(dir, args.avatar_dir_bytes)?;
            tracing::info!(
                "avatar directory {}: {} avatars, {} of {} bytes",
                dir.display(),
                store.ids()?.len(),
                store.bytes()?,
                args.avatar_dir_bytes
            );
            Some(Arc::new(store))
        }
        None => None,
    };
    let jobs = open_jobs(&args).await?;
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ServeError::Bind {
            addr: addr.clone(),
            source,
        })?;
    let local = listener.local_addr()?;
    tracing::info!(
        "listening on http://{local} ({:?} x{}, {:?})",
        cfg.device,
        cfg.instances,
        cfg.precision
    );
    let app = Arc::new(App {
        avatars: Mutex::new(AvatarCache::new(
            args.avatar_cache_entries,
            args.avatar_cache_bytes,
        )),
        avatar_store,
        requests: Arc::new(Semaphore::new(args.max_requests.max(1))),
        sessions: Arc::default(),
        args,
        cfg,
        engine: OnceLock::new(),
        summary: OnceLock::new(),
        prometheus,
        shutting_down: AtomicBool::new(false),
        started: Instant::now(),
        jobs,
        enhancers,
        spares: media::video::Spares::new(),
    });
    app.jobs.start(app.clone());
    // The live offer's CPU figure follows the frames that go out (one sample a second); the
    // cores limit the offer where the model does not run on them.
    app.sessions.cpu.set_limiting(app.cfg.device.gpu_like());
    let meter = app.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            // It reads /proc: off the runtime's workers. The sessions' fair shares follow the
            // engine's capacity as measured now.
            let m = meter.clone();
            let _ = tokio::task::spawn_blocking(move || {
                m.sessions.cpu.sample();
                if let Some(engine) = m.engine.get() {
                    m.sessions.reshare(&m, engine);
                }
            })
            .await;
        }
    });

    // Load in the background: /health answers at once, /ready once the instances are warm.
    // A model that cannot load, or instances that cannot start, end the server with an error
    // (a server that can never be ready should not pretend to be one).
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<model::Error>();
    let loader = app.clone();
    std::thread::Builder::new()
        .name("lipsync-loader".into())
        .spawn(move || {
            let enhancers = loader.enhancers.clone();
            let (engine, summary) =
                match loader
                    .args
                    .engine
                    .start_engine(&loader.cfg, true, enhancers)
                {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = failed_tx.send(e);
                        return;
                    }
                };
            let status = engine.status().clone();
            if let Some(summary) = summary {
                let _ = loader.summary.set(summary);
            }
            let _ = loader.engine.set(engine);
            while !status.all_ready() {
                if let Some(e) = status.failed() {
                    let _ = failed_tx.send(model::Error::Device(e));
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })?;

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let stopping = app.clone();
    let listener = conn::TimeoutListener::new(listener, config::timeout(app.args.send_timeout));
    let service = router(app.clone()).into_make_service_with_connect_info::<conn::ConnInfo>();
    let server = axum::serve(listener, service).with_graceful_shutdown(async move {
        shutdown_signal().await;
        tracing::info!("shutting down: no new connections; letting in-flight streams finish");
        stopping.shutting_down.store(true, Ordering::SeqCst);
        // Jobs rendering here go back to the queue, for the next process.
        stopping.jobs.shutdown().await;
        let _ = stop_tx.send(());
    });
    let timeout = Duration::from_secs(app.args.shutdown_timeout);
    // Each of these stays pending unless its event happens (a dropped sender is not one).
    let load_failed = async {
        match failed_rx.await {
            Ok(e) => e,
            Err(_) => std::future::pending().await,
        }
    };
    let shutdown_expired = async {
        match stop_rx.await {
            Ok(()) => tokio::time::sleep(timeout).await,
            Err(_) => std::future::pending().await,
        }
    };
    let result = tokio::select! {
        r = std::future::IntoFuture::into_future(server) => r.map_err(ServeError::from),
        e = load_failed => Err(ServeError::Model(e)),
        _ = shutdown_expired => {
            tracing::warn!("shutdown timeout ({} s) reached; closing the remaining streams", timeout.as_secs());
            Ok(())
        }
    };
    stream::wait_closed(&app.sessions, timeout).await;
    if let Some(engine) = app.engine.get() {
        engine.shutdown();
    }
    tracing::info!("stopped");
    result
}
