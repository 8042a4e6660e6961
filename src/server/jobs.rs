//! The batch jobs door: `POST /v1/jobs`, `GET /v1/jobs`, `GET`/`DELETE /v1/jobs/{id}`,
//! `GET /v1/jobs/{id}/video`, `POST /v1/jobs/{id}/cancel`.
//!
//! A submit is checked as `POST /v1/lipsync` checks a request (form, speech, avatar, face,
//! limits) and answered with the same errors, before anything is kept; then the job's own
//! copy of its inputs (the speech file and the prepared avatar) is written under the data
//! directory, its record put in the store, and `202` returned. The workers
//! ([`crate::jobs::worker`]) do the rest.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::multipart::Multipart;
use axum::extract::{FromRequest, Path, RawQuery, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use tower::ServiceExt;

use super::error::ApiError;
use super::lipsync::{self, AvatarSource};
use super::{form, App};
use crate::engine::avatar_store;
use crate::jobs::store::StoreError;
use crate::jobs::worker;
use crate::jobs::{self, job_json, now_millis, JobSpec, JobStatus, NewJob};
use crate::media::audio;

/// Longest `metadata` accepted, in bytes of JSON.
pub const MAX_METADATA: usize = 4096;

/// Text fields of a job besides those of `/v1/lipsync`.
const JOB_TEXTS: &[&str] = &["webhook_url"];

/// Fields of a job read as raw bytes, as files are: `metadata` may be up to
/// [`MAX_METADATA`] bytes, and the form reader keeps its text fields much shorter.
const JOB_RAW: &[&str] = &["metadata"];

/// Fields of `/v1/lipsync` kept with a job to shape its render (the avatar's own `box`,
/// `pads` and `smooth` are already applied to the prepared avatar it keeps).
const RENDER_FIELDS: &[&str] = &["fps", "loop", "blend", "enhance"];

/// Largest page of `GET /v1/jobs`.
const MAX_LIMIT: usize = 100;

fn store_error(e: StoreError) -> ApiError {
    match e {
        StoreError::TooManyQueued(n) => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_jobs",
            format!("{n} jobs are already queued (--max-queued-jobs); submit again later"),
        )
        .with_retry_after(30),
        StoreError::Db(e) => ApiError::internal(format!("job store: {e}")),
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found("job_not_found", format!("no job {id:?}"))
}

/// A job id from the path: the shape is checked before it reaches a path or a query.
fn job_id(id: &str) -> Result<&str, ApiError> {
    if jobs::is_job_id(id) {
        Ok(id)
    } else {
        Err(not_found(id))
    }
}

pub async fn submit(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    let jobs = app.jobs.clone();
    if app.is_shutting_down() {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            "the server is shutting down",
        )
        .with_retry_after(5));
    }
    let multipart = Multipart::from_request(req, &()).await;
    let texts: Vec<&str> = lipsync::TEXTS.iter().chain(JOB_TEXTS).copied().collect();
    let files: Vec<&str> = lipsync::FILES.iter().chain(JOB_RAW).copied().collect();
    let mut f = form::read(multipart, &files, &texts, app.args.max_body_bytes).await?;
    let webhook_url = f.text("webhook_url");
    let metadata = match f.file("metadata") {
        Some(raw) => parse_metadata(&raw)?,
        None => None,
    };
    let mut fields = BTreeMap::new();
    for name in RENDER_FIELDS {
        if let Some(v) = f.peek(name) {
            fields.insert(name.to_string(), v.to_string());
        }
    }
    let req = lipsync::parse_form(&mut f, &app)?;
    fields.insert("crf".into(), req.crf.to_string());
    // The enhancer by its name, not a kind: the job renders with this one even if more of
    // its kind are loaded by the time it runs.
    match &req.enhance {
        Some(e) => fields.insert("enhance".into(), e.name.to_string()),
        None => fields.remove("enhance"),
    };

    if let Some(url) = &webhook_url {
        crate::jobs::webhook::check_target(url, &jobs.cfg.webhook_allow)
            .await
            .map_err(|e| ApiError::bad_request(e.error_type(), e.to_string()))?;
    }
    let cached = match &req.avatar {
        AvatarSource::Cached(id) => Some(super::avatars::lookup(&app, id).await?),
        AvatarSource::Upload(_) => None,
    };

    // Check the speech and prepare the avatar as a render would, then keep both.
    let app2 = app.clone();
    let span = tracing::Span::current();
    let (audio_bytes, avatar) = tokio::task::spawn_blocking(move || {
        let _enter = span.enter();
        audio::load(&req.audio, app2.args.media.max_audio_seconds)?;
        let avatar = lipsync::prepare_avatar(&app2, &req, cached)?;
        Ok::<_, ApiError>((req.audio, avatar_store::encode(&avatar)))
    })
    .await
    .map_err(|e| ApiError::internal(format!("job preparation panicked: {e}")))??;

    let bytes = (audio_bytes.len() + avatar.len()) as u64;
    let used = jobs.store.total_bytes().await.map_err(store_error)?;
    if used.saturating_add(bytes) > jobs.cfg.data_dir_bytes {
        return Err(ApiError::new(
            StatusCode::INSUFFICIENT_STORAGE,
            "insufficient_storage",
            format!(
                "the job's {bytes} bytes would take the data directory over its {} bytes \
                 (--data-dir-bytes); delete finished jobs or submit later",
                jobs.cfg.data_dir_bytes
            ),
        ));
    }

    let created = now_millis();
    let id = jobs::new_job_id(created);
    // ffmpeg and the decoder find the format from the content.
    let speech_file = worker::SPEECH_FILE.to_string();
    let spec = JobSpec {
        avatar_file: worker::AVATAR_FILE.into(),
        avatar_kind: "prepared".into(),
        speech_file: speech_file.clone(),
        fields,
    };
    // The files first, in a temporary directory renamed into place: a job in the store
    // always has its inputs.
    let dir = jobs.dir(&id);
    let write = {
        let dir = dir.clone();
        tokio::task::spawn_blocking(move || {
            let parent = dir.parent().expect("a job's directory has a parent");
            std::fs::create_dir_all(parent)?;
            let tmp = tempfile::Builder::new()
                .prefix(".incoming-")
                .tempdir_in(parent)?;
            std::fs::write(tmp.path().join(&speech_file), &audio_bytes)?;
            std::fs::write(tmp.path().join(worker::AVATAR_FILE), &avatar)?;
            std::fs::rename(tmp.keep(), &dir)?;
            Ok::<_, std::io::Error>(())
        })
    };
    write
        .await
        .map_err(|e| ApiError::internal(format!("keeping the job's files panicked: {e}")))?
        .map_err(|e| ApiError::internal(format!("cannot keep the job's files: {e}")))?;
    let new = NewJob {
        id: id.clone(),
        created_at: created,
        metadata,
        spec,
        webhook_url,
        bytes,
    };
    let record = match jobs.store.insert(&new, jobs.cfg.max_queued).await {
        Ok(r) => r,
        Err(e) => {
            jobs.remove_files(&id);
            return Err(store_error(e));
        }
    };
    tracing::info!("job {id} queued");
    jobs.wake();
    jobs.publish_counts().await;
    let location = format!("/v1/jobs/{id}");
    Ok((
        StatusCode::ACCEPTED,
        [(
            header::LOCATION,
            HeaderValue::from_str(&location).expect("a job id is a valid header value"),
        )],
        Json(job_json(&record)),
    )
        .into_response())
}

/// `metadata`: a JSON object of at most [`MAX_METADATA`] bytes; empty (or blank) is none, as
/// for the text fields.
fn parse_metadata(raw: &[u8]) -> Result<Option<serde_json::Value>, ApiError> {
    if raw.len() > MAX_METADATA {
        return Err(ApiError::bad_request(
            "bad_field",
            format!(
                "field `metadata`: {} bytes, at most {MAX_METADATA}",
                raw.len()
            ),
        ));
    }
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    match serde_json::from_slice::<serde_json::Value>(raw) {
        Ok(v @ serde_json::Value::Object(_)) => Ok(Some(v)),
        Ok(_) => Err(ApiError::bad_request(
            "bad_field",
            "field `metadata`: must be a JSON object",
        )),
        Err(e) => Err(ApiError::bad_request(
            "bad_field",
            format!("field `metadata`: not JSON: {e}"),
        )),
    }
}

pub async fn get(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let jobs = &app.jobs;
    let id = job_id(&id)?;
    match jobs.store.get(id).await.map_err(store_error)? {
        Some(r) => Ok(Json(job_json(&r))),
        None => Err(not_found(id)),
    }
}

#[derive(Debug, Default)]
pub struct ListQuery {
    status: Option<String>,
    limit: Option<String>,
    after: Option<String>,
}

impl ListQuery {
    /// The query string of `GET /v1/jobs`: each of `status`, `limit`, `after` at most once,
    /// nothing else (a parameter misspelt is an error, not a silently unfiltered list), and
    /// every refusal a JSON error.
    fn parse(raw: Option<&str>) -> Result<ListQuery, ApiError> {
        let mut q = ListQuery::default();
        for (name, value) in url::form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
            let slot = match &*name {
                "status" => &mut q.status,
                "limit" => &mut q.limit,
                "after" => &mut q.after,
                _ => {
                    return Err(ApiError::bad_request(
                        "unknown_field",
                        format!("unknown query parameter {name:?} (status, limit, after)"),
                    ))
                }
            };
            if slot.replace(value.into_owned()).is_some() {
                return Err(ApiError::bad_request(
                    "bad_field",
                    format!("query parameter `{name}` given more than once"),
                ));
            }
        }
        Ok(q)
    }
}

pub async fn list(
    State(app): State<Arc<App>>,
    RawQuery(raw): RawQuery,
) -> Result<Json<serde_json::Value>, ApiError> {
    let jobs = &app.jobs;
    let q = ListQuery::parse(raw.as_deref())?;
    let status = match q.status.as_deref() {
        None => None,
        Some(s) => Some(JobStatus::parse(s).ok_or_else(|| {
            ApiError::bad_request(
                "bad_field",
                format!(
                    "`status` {s:?} is not one of queued, running, succeeded, failed, cancelled"
                ),
            )
        })?),
    };
    let limit = match q.limit.as_deref() {
        None => 20,
        Some(s) => match s.parse::<usize>() {
            Ok(n) if (1..=MAX_LIMIT).contains(&n) => n,
            _ => {
                return Err(ApiError::bad_request(
                    "bad_field",
                    format!("`limit` must be a whole number from 1 to {MAX_LIMIT}"),
                ))
            }
        },
    };
    let after = match q.after.as_deref() {
        None => None,
        Some(a) if jobs::is_job_id(a) => Some(a),
        Some(_) => {
            return Err(ApiError::bad_request(
                "bad_field",
                "`after` must be a job id (the `next` of the previous page)",
            ))
        }
    };
    let (page, next) = jobs
        .store
        .list(status, limit, after)
        .await
        .map_err(store_error)?;
    Ok(Json(serde_json::json!({
        "jobs": page.iter().map(job_json).collect::<Vec<_>>(),
        "next": next,
    })))
}

pub async fn cancel(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let jobs = &app.jobs;
    let id = job_id(&id)?;
    let r = jobs
        .store
        .cancel(id, now_millis())
        .await
        .map_err(store_error)?
        .ok_or_else(|| not_found(id))?;
    jobs.stop_local(id);
    jobs.wake();
    jobs.publish_counts().await;
    Ok(Json(job_json(&r)))
}

pub async fn delete(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let jobs = &app.jobs;
    let id = job_id(&id)?;
    jobs.store
        .cancel(id, now_millis())
        .await
        .map_err(store_error)?
        .ok_or_else(|| not_found(id))?;
    jobs.stop_local(id);
    if !jobs.store.delete(id).await.map_err(store_error)? {
        return Err(not_found(id));
    }
    let j = jobs.clone();
    let owned = id.to_string();
    let _ = tokio::task::spawn_blocking(move || j.remove_files(&owned)).await;
    jobs.publish_counts().await;
    Ok(StatusCode::NO_CONTENT)
}

/// The finished video, with `Range` support (206).
pub async fn video(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    let jobs = &app.jobs;
    let id = job_id(&id)?;
    let r = jobs
        .store
        .get(id)
        .await
        .map_err(store_error)?
        .ok_or_else(|| not_found(id))?;
    if r.status != JobStatus::Succeeded {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "job_not_finished",
            format!(
                "job {id} is {}: its video exists once it has succeeded",
                r.status.as_str()
            ),
        ));
    }
    let path = jobs.video(id);
    if !path.is_file() {
        return Err(ApiError::internal(format!(
            "job {id} succeeded but its video is missing"
        )));
    }
    let res = tower_http::services::ServeFile::new(&path)
        .oneshot(req)
        .await
        .map_err(|e| ApiError::internal(format!("cannot read the video: {e}")))?;
    let mut res = res.map(axum::body::Body::new);
    res.headers_mut().insert(
        header::CONTENT_DISPOSITION,
        HeaderValue::from_str(&format!("attachment; filename=\"{id}.mp4\""))
            .expect("a job id is a valid header value"),
    );
    Ok(res)
}
