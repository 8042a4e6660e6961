//! The service's errors: one JSON shape, `{"error": "...", "error_type": "..."}`, and one
//! mapping from every layer's errors to HTTP status codes. Internal failures are logged in
//! full and answered with a generic message.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::{engine, media};

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    /// Seconds, for 429 and 503.
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            retry_after: None,
        }
    }

    pub fn bad_request(kind: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, kind, message)
    }

    pub fn not_found(kind: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, kind, message)
    }

    /// Something went wrong on our side: logged in full, answered generically.
    pub fn internal(what: impl std::fmt::Display) -> Self {
        tracing::error!("internal error: {what}");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the server failed to process the request",
        )
    }

    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }
}

impl From<media::Error> for ApiError {
    fn from(e: media::Error) -> Self {
        use media::Error as E;
        let status = match &e {
            E::NotAudio(_)
            | E::UnsupportedCodec(_)
            | E::NotAnImage(_)
            | E::UnsupportedImage(_)
            | E::NotVideo(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            E::AudioTooLong { .. } | E::TooManyPixels { .. } | E::AvatarTooLong { .. } => {
                StatusCode::PAYLOAD_TOO_LARGE
            }
            E::AudioTooShort { .. } | E::NoSamples | E::NonFiniteAudio | E::NoFace(_) => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            E::EmptyAudio
            | E::TruncatedAudio(_)
            | E::CorruptAudio(_)
            | E::BadFps(_)
            | E::EmptyImage
            | E::CorruptImage(_)
            | E::BadBox(_)
            | E::BadPads(_)
            | E::BadLandmarks(_)
            | E::BadBlend(_)
            | E::BadLoop(_)
            | E::DamagedVideo(_)
            | E::FpsTooHigh(_) => StatusCode::BAD_REQUEST,
            E::FfmpegMissing(_) | E::Encoder(_) | E::Internal(_) => return ApiError::internal(e),
        };
        ApiError::new(status, e.kind(), e.to_string())
    }
}

impl From<engine::Error> for ApiError {
    fn from(e: engine::Error) -> Self {
        match e {
            engine::Error::Media(m) => m.into(),
            e @ engine::Error::EnhancerNotLoaded(_) => {
                ApiError::bad_request(e.kind(), e.to_string())
            }
            other => ApiError::internal(other),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.message, "error_type": self.kind });
        let mut res = (self.status, axum::Json(body)).into_response();
        if let Some(s) = self.retry_after {
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            res.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn media_errors_map_to_client_statuses() {
        let cases = [
            (media::Error::NotAudio("x".into()), 415),
            (media::Error::NotAnImage("x".into()), 415),
            (
                media::Error::AudioTooLong {
                    seconds: 9.0,
                    max_seconds: 1.0,
                },
                413,
            ),
            (
                media::Error::TooManyPixels {
                    width: 1,
                    height: 1,
                    max_pixels: 0,
                },
                413,
            ),
            (media::Error::NoFace("x".into()), 422),
            (
                media::Error::AudioTooShort {
                    seconds: 0.1,
                    min_seconds: 0.2,
                },
                422,
            ),
            (media::Error::BadBox("x".into()), 400),
            (media::Error::EmptyAudio, 400),
            (media::Error::Encoder("x".into()), 500),
        ];
        for (e, status) in cases {
            let kind = e.kind();
            let api = ApiError::from(e);
            assert_eq!(api.status.as_u16(), status, "{kind}");
        }
    }
}
