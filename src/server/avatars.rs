//! Avatars: a photo prepared once (decoded, face found, crop and mask made) and reused by id.
//!
//! The id is the SHA-256 (hex) of the image bytes and the box or pads given, so uploading the
//! same photo with the same options again finds the same avatar (`200` instead of `201`).

use std::sync::Arc;

use axum::extract::multipart::{Multipart, MultipartRejection};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::{form, App};
use crate::engine::cache::NotKept;
use crate::engine::Avatar;
use crate::media::face::{Blend, FaceBox, Pads};

/// The JSON that describes an avatar.
fn describe(id: &str, a: &Avatar) -> serde_json::Value {
    serde_json::json!({
        "id": id,
        "box": a.source_face.to_array(),
        "width": a.source_size.0,
        "height": a.source_size.1,
    })
}

/// The avatar id of an upload: SHA-256 over the image bytes and the canonical options.
pub fn avatar_id(image: &[u8], face_box: Option<FaceBox>, pads: Pads) -> String {
    let mut h = Sha256::new();
    h.update(image);
    match face_box {
        Some(b) => h.update(format!("\0box={b}")),
        None => h.update(format!("\0pads={pads}")),
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn unknown(id: &str) -> ApiError {
    ApiError::not_found(
        "avatar_not_found",
        format!("no avatar {id:?} (unknown, deleted or evicted from the cache; upload it again)"),
    )
}

/// A cached avatar by id.
pub fn lookup(app: &App, id: &str) -> Result<Arc<Avatar>, ApiError> {
    app.avatars().get(id).ok_or_else(|| unknown(id))
}

/// `POST /v1/avatars`
pub async fn create(
    State(app): State<Arc<App>>,
    multipart: Result<Multipart, MultipartRejection>,
) -> Result<Response, ApiError> {
    let mut f = form::read(
        multipart,
        &["image"],
        &["box", "pads"],
        app.args.max_body_bytes,
    )
    .await?;
    let image = f
        .file("image")
        .ok_or_else(|| ApiError::bad_request("missing_field", "the form needs an `image` file"))?;
    let face_box: Option<FaceBox> = f.parse("box")?;
    let pads: Pads = f.parse("pads")?.unwrap_or_default();
    let id = avatar_id(&image, face_box, pads);
    if let Some(a) = app.avatars().get(&id) {
        return Ok((StatusCode::OK, Json(describe(&id, &a))).into_response());
    }
    // Preparing runs face detection on a blocking thread: it takes one of the request slots
    // (--max-requests) like a stream does, so a flood of uploads cannot pile up unbounded
    // work. The permit moves into the blocking task: a client that hangs up does not free
    // the slot before the work it started is done.
    let permit = app.requests.clone().try_acquire_owned().map_err(|_| {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "overloaded",
            "too many requests in progress (avatar preparation shares the --max-requests \
             slots with streams); retry later",
        )
        .with_retry_after(app.retry_after())
    })?;
    let limits = app.image_limits();
    let avatar = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        Avatar::prepare(&image, &limits, face_box, pads, Blend::Feather)
    })
    .await
    .map_err(|e| ApiError::internal(format!("avatar preparation panicked: {e}")))??;
    let body = describe(&id, &avatar);
    // Only an id that the cache really holds is returned.
    app.avatars()
        .insert(id, Arc::new(avatar))
        .map_err(not_kept)?;
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

fn not_kept(e: NotKept) -> ApiError {
    match e {
        NotKept::TooLarge { .. } => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "avatar_too_large",
            format!("{e}; send a smaller photo, or send the image with each /v1/lipsync request"),
        ),
        NotKept::Disabled => ApiError::new(
            StatusCode::FORBIDDEN,
            "avatars_disabled",
            format!("{e}; send the image with each /v1/lipsync request"),
        ),
    }
}

/// `GET /v1/avatars/{id}`
pub async fn get(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let a = lookup(&app, &id)?;
    Ok(Json(describe(&id, &a)))
}

/// `DELETE /v1/avatars/{id}`
pub async fn delete(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    if app.avatars().remove(&id) {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(unknown(&id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_depend_on_bytes_and_options() {
        let a = avatar_id(b"img", None, Pads::default());
        assert_eq!(a.len(), 64);
        assert_eq!(a, avatar_id(b"img", None, Pads::default()));
        assert_ne!(a, avatar_id(b"img2", None, Pads::default()));
        assert_ne!(a, avatar_id(b"img", None, "0,0,0,0".parse().unwrap()));
        let b = FaceBox {
            x1: 1,
            y1: 2,
            x2: 3,
            y2: 4,
        };
        assert_ne!(a, avatar_id(b"img", Some(b), Pads::default()));
    }
}
