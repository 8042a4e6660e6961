//! Avatars: a photo or a clip prepared once (decoded, face found, crops and masks made) and
//! reused by id.
//!
//! The id is the SHA-256 (hex) of the uploaded bytes and the box or pads given, the landmarks
//! given (and, for a clip, whether boxes are smoothed), so uploading the same file with the same options again
//! finds the same avatar (`200` instead of `201`).
//!
//! With `--avatar-dir` every avatar is also a file there ([`crate::engine::avatar_store`]):
//! lookups by id check the directory (another replica sharing it may have written, deleted or
//! evicted the avatar) and load what memory lacks, on a blocking thread.

use std::sync::Arc;

use axum::extract::multipart::{Multipart, MultipartRejection};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::{form, App};
use crate::engine::avatar_store::StoreError;
use crate::engine::cache::NotKept;
use crate::engine::{clip, Avatar};
use crate::media::face::{Blend, FaceBox, Landmarks, Pads};

/// The JSON that describes an avatar.
fn describe(id: &str, a: &Avatar) -> serde_json::Value {
    let mut v = serde_json::json!({
        "id": id,
        "kind": a.kind(),
        "box": a.source_face.to_array(),
        "landmarks": a.source_landmarks().to_array(),
        "landmarks_source": a.landmarks_source().as_str(),
        "width": a.source_size.0,
        "height": a.source_size.1,
    });
    if let Some(c) = &a.clip {
        v["frames"] = c.len().into();
        v["fps"] = c.fps.value().into();
        v["duration"] = c.duration.into();
    }
    v
}

/// An uploaded photo or clip and how to prepare it.
pub struct Upload {
    pub bytes: Bytes,
    pub video: bool,
    pub face_box: Option<FaceBox>,
    pub pads: Pads,
    /// The five landmarks the client gave (`landmarks`), in the upload's pixels.
    pub landmarks: Option<Landmarks>,
    /// Temporal smoothing of a clip's detected boxes.
    pub smooth: bool,
}

impl Upload {
    /// Takes `image` or `video` and the options that belong to the avatar (`box`, `pads`,
    /// `landmarks`, `smooth`) from a form; `None` when it holds neither file (then it must not hold the
    /// options either: they belong to the avatar).
    pub fn from_form(f: &mut form::Form) -> Result<Option<Upload>, ApiError> {
        let face_box: Option<FaceBox> = f.parse("box")?;
        let pads: Option<Pads> = f.parse("pads")?;
        let landmarks: Option<Landmarks> = f.parse("landmarks")?;
        let smooth: Option<bool> = f.parse("smooth")?;
        let (bytes, video) = match (f.file("image"), f.file("video")) {
            (Some(b), None) => (b, false),
            (None, Some(b)) => (b, true),
            (Some(_), Some(_)) => {
                return Err(ApiError::bad_request(
                    "bad_field",
                    "give one of `image`, `video` or `avatar_id`, not several",
                ))
            }
            (None, None) => {
                if face_box.is_some() || pads.is_some() || landmarks.is_some() || smooth.is_some() {
                    return Err(ApiError::bad_request(
                        "bad_field",
                        "`box`, `pads`, `landmarks` and `smooth` belong to the avatar: give \
                         them when creating it, not with `avatar_id`",
                    ));
                }
                return Ok(None);
            }
        };
        if smooth.is_some() && !video {
            return Err(ApiError::bad_request(
                "bad_field",
                "`smooth` applies to a `video` avatar only",
            ));
        }
        Ok(Some(Upload {
            bytes,
            video,
            face_box,
            pads: pads.unwrap_or_default(),
            landmarks,
            smooth: smooth.unwrap_or(true),
        }))
    }

    /// The avatar id: SHA-256 over the bytes and the canonical options.
    pub fn id(&self) -> String {
        let mut h = Sha256::new();
        h.update(&self.bytes);
        match self.face_box {
            Some(b) => h.update(format!("\0box={b}")),
            None => h.update(format!("\0pads={}", self.pads)),
        }
        if let Some(l) = self.landmarks {
            h.update(format!("\0landmarks={l}"));
        }
        if self.video {
            h.update(format!("\0video smooth={}", self.smooth));
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Decodes and prepares the avatar (blocking: face detection, clip decoding).
    pub fn prepare(&self, app: &App, blend: Blend) -> Result<Avatar, crate::media::Error> {
        let media = &app.args.media;
        let avatar = if self.video {
            let options = media.clip_options(self.smooth);
            clip::prepare(&self.bytes, &options, self.face_box, self.pads, blend)?
        } else {
            let limits = media.image_limits();
            Avatar::prepare(&self.bytes, &limits, self.face_box, self.pads, blend)?
        };
        match self.landmarks {
            Some(l) => avatar.with_landmarks(l),
            None => Ok(avatar),
        }
    }
}

fn unknown(id: &str) -> ApiError {
    ApiError::not_found(
        "avatar_not_found",
        format!("no avatar {id:?} (unknown, deleted or evicted from the cache; upload it again)"),
    )
}

/// An avatar by id: from the memory cache, or with `--avatar-dir` from the directory (which
/// another replica may have written), then kept in memory. With a directory, the file must
/// still be there (another replica may have deleted or evicted it): the disk is the truth.
pub async fn lookup(app: &Arc<App>, id: &str) -> Result<Arc<Avatar>, ApiError> {
    find(app, id).await?.ok_or_else(|| unknown(id))
}

/// [`lookup`], `None` for an unknown id.
async fn find(app: &Arc<App>, id: &str) -> Result<Option<Arc<Avatar>>, ApiError> {
    if app.avatar_store.is_none() {
        return Ok(app.avatars().get(id));
    }
    let (app, id) = (app.clone(), id.to_string());
    tokio::task::spawn_blocking(move || load(&app, &id))
        .await
        .map_err(|e| ApiError::internal(format!("avatar lookup panicked: {e}")))?
}

/// [`find`] with a directory, on a blocking thread (file system calls, and a read and a
/// checksum of up to the avatar's size when memory does not hold it).
fn load(app: &App, id: &str) -> Result<Option<Arc<Avatar>>, ApiError> {
    let store = app.avatar_store.as_ref().expect("called with a directory");
    if !store.touch(id).map_err(store_failed)? {
        app.avatars().remove(id);
        return Ok(None);
    }
    if let Some(a) = app.avatars().get(id) {
        return Ok(Some(a));
    }
    let Some(a) = store.get(id).map_err(store_failed)? else {
        return Ok(None);
    };
    let a = Arc::new(a);
    if let Err(e) = app.avatars().insert(id.to_string(), a.clone()) {
        tracing::debug!("avatar {id} read from the directory is not kept in memory: {e}");
    }
    Ok(Some(a))
}

/// The directory failed (not the avatar: a damaged file reads as absent).
fn store_failed(e: StoreError) -> ApiError {
    match e {
        StoreError::TooLarge { .. } => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "avatar_too_large",
            format!(
                "{e}; send a smaller photo or a shorter clip, or send the file with each \
                 /v1/lipsync request"
            ),
        ),
        StoreError::Io { .. } => ApiError::internal(e),
    }
}

/// `POST /v1/avatars`
pub async fn create(
    State(app): State<Arc<App>>,
    multipart: Result<Multipart, MultipartRejection>,
) -> Result<Response, ApiError> {
    let mut f = form::read(
        multipart,
        &["image", "video"],
        &["box", "pads", "landmarks", "smooth"],
        app.args.max_body_bytes,
    )
    .await?;
    let upload = Upload::from_form(&mut f)?.ok_or_else(|| {
        ApiError::bad_request(
            "missing_field",
            "the form needs an `image` or a `video` file",
        )
    })?;
    let id = upload.id();
    if let Some(a) = find(&app, &id).await? {
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
    let app2 = app.clone();
    let id2 = id.clone();
    let avatar = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let avatar = upload.prepare(&app2, Blend::Feather)?;
        // With a landmark detector and a restorer loaded, the landmarks are found now, so the
        // avatar's JSON says where they came from.
        if let Some(net) = app2.enhancers.landmark_detector() {
            avatar.detect_landmarks(net)?;
        }
        // Its first render's encoder processes (workers and muxer, or the single encoder)
        // start now, not when that render asks for them (a failure here is the render's to
        // report, if it happens again).
        if let Err(e) =
            crate::engine::pipeline::start_encoders_ahead(&app2.render_settings(), &avatar)
        {
            tracing::warn!("cannot start encoder processes ahead: {e}");
        }
        // Written to the directory (when there is one) only if memory will keep it too, so
        // the answer does not depend on which replica reads it.
        if let Some(store) = &app2.avatar_store {
            app2.avatars()
                .admits(avatar.bytes() as u64)
                .map_err(not_kept)?;
            store.put(&id2, &avatar).map_err(store_failed)?;
        }
        Ok::<_, ApiError>(avatar)
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
            format!(
                "{e}; send a smaller photo or a shorter clip, or send the file with each \
                 /v1/lipsync request"
            ),
        ),
        NotKept::Disabled => ApiError::new(
            StatusCode::FORBIDDEN,
            "avatars_disabled",
            format!("{e}; send the image or video with each /v1/lipsync request"),
        ),
    }
}

/// `GET /v1/avatars/{id}`
pub async fn get(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let a = lookup(&app, &id).await?;
    Ok(Json(describe(&id, &a)))
}

/// `DELETE /v1/avatars/{id}`: from memory and from the directory.
pub async fn delete(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let in_memory = app.avatars().remove(&id);
    let on_disk = match app.avatar_store.clone() {
        Some(store) => {
            let id = id.clone();
            tokio::task::spawn_blocking(move || store.remove(&id))
                .await
                .map_err(|e| ApiError::internal(format!("avatar removal panicked: {e}")))?
                .map_err(store_failed)?
        }
        None => false,
    };
    if in_memory || on_disk {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(unknown(&id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upload(bytes: &'static [u8], video: bool, face_box: Option<FaceBox>, pads: &str) -> Upload {
        Upload {
            bytes: Bytes::from_static(bytes),
            video,
            face_box,
            pads: pads.parse().unwrap(),
            landmarks: None,
            smooth: true,
        }
    }

    #[test]
    fn ids_depend_on_bytes_and_options() {
        let a = upload(b"img", false, None, "0,10,0,0").id();
        assert_eq!(a.len(), 64);
        assert_eq!(a, upload(b"img", false, None, "0,10,0,0").id());
        assert_ne!(a, upload(b"img2", false, None, "0,10,0,0").id());
        assert_ne!(a, upload(b"img", false, None, "0,0,0,0").id());
        let b = FaceBox {
            x1: 1,
            y1: 2,
            x2: 3,
            y2: 4,
        };
        assert_ne!(a, upload(b"img", false, Some(b), "0,10,0,0").id());
        let v = upload(b"img", true, None, "0,10,0,0");
        assert_ne!(a, v.id());
        let unsmoothed = Upload {
            smooth: false,
            ..upload(b"img", true, None, "0,10,0,0")
        };
        assert_ne!(v.id(), unsmoothed.id());
        let marked = Upload {
            landmarks: Some("10,10,30,10,20,20,12,30,28,30".parse().unwrap()),
            ..upload(b"img", false, None, "0,10,0,0")
        };
        assert_ne!(a, marked.id());
    }
}
