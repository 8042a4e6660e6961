//! Reading multipart forms: known fields only, each at most once, text fields short and UTF-8,
//! the body within its size limit, and every failure in the service's JSON error shape.
//!
//! An oversized body is read to its end (up to the router's hard cap) and discarded before
//! the 413 is sent: answering while the client is still uploading would close a connection
//! with unread data, and the resulting TCP reset can destroy the answer on its way.

use std::collections::HashMap;
use std::time::Duration;

use axum::body::Body;
use axum::extract::multipart::{Multipart, MultipartRejection};
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use bytes::Bytes;
use futures_util::StreamExt;

use super::error::ApiError;

/// Longest accepted text field (box, pads, fps, ids...).
const MAX_TEXT: usize = 256;

/// The fields of a form, by name.
#[derive(Debug, Default)]
pub struct Form {
    files: HashMap<String, Bytes>,
    texts: HashMap<String, String>,
}

impl Form {
    /// Takes a file field.
    pub fn file(&mut self, name: &str) -> Option<Bytes> {
        self.files.remove(name)
    }

    /// Takes a text field (trimmed; an empty value counts as absent).
    pub fn text(&mut self, name: &str) -> Option<String> {
        self.texts.remove(name).filter(|s| !s.is_empty())
    }

    /// A text field, left in the form (as [`Form::text`] would return it).
    pub fn peek(&self, name: &str) -> Option<&str> {
        self.texts
            .get(name)
            .map(String::as_str)
            .filter(|s| !s.is_empty())
    }

    /// Parses a text field with `FromStr`, mapping failures to a 400.
    pub fn parse<T>(&mut self, name: &str) -> Result<Option<T>, ApiError>
    where
        T: std::str::FromStr,
        T::Err: std::fmt::Display,
    {
        self.text(name)
            .map(|s| {
                s.parse::<T>()
                    .map_err(|e| ApiError::bad_request("bad_field", format!("field `{name}`: {e}")))
            })
            .transpose()
    }
}

/// A request body that sent nothing for longer than `--read-timeout`.
#[derive(Debug)]
pub struct ReadTimedOut(pub Duration);

impl std::fmt::Display for ReadTimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the request body stalled for more than {:.1} s (--read-timeout)",
            self.0.as_secs_f64()
        )
    }
}

impl std::error::Error for ReadTimedOut {}

/// Middleware: every request body fails with [`ReadTimedOut`] when the gap between two of
/// its pieces exceeds `timeout` (the forms answer that with 408).
pub fn with_read_timeout(req: Request, timeout: Duration) -> Request {
    let (parts, body) = req.into_parts();
    let stream = futures_util::stream::unfold(
        (body.into_data_stream(), false),
        move |(mut s, failed)| async move {
            if failed {
                return None;
            }
            match tokio::time::timeout(timeout, s.next()).await {
                Ok(Some(Ok(chunk))) => Some((Ok(chunk), (s, false))),
                Ok(Some(Err(e))) => Some((Err(axum::Error::new(e)), (s, true))),
                Ok(None) => None,
                Err(_) => Some((Err(axum::Error::new(ReadTimedOut(timeout))), (s, true))),
            }
        },
    );
    Request::from_parts(parts, Body::from_stream(stream))
}

/// [`with_read_timeout`] as an axum middleware function.
pub async fn read_timeout_layer(timeout: Duration, req: Request, next: Next) -> Response {
    next.run(with_read_timeout(req, timeout)).await
}

/// Whether `e` (or what caused it) is a read timeout.
fn stalled(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<ReadTimedOut>() {
            return true;
        }
        cur = err.source();
    }
    false
}

fn read_timeout() -> ApiError {
    ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        "read_timeout",
        "the request body stopped arriving (--read-timeout); send it again",
    )
}

/// Reads and discards a body that will not be used (up to `limit` bytes, within the read
/// timeout), so that a refusal sent before the upload ends reaches the client instead of a
/// TCP reset.
pub async fn drain(body: Body, limit: usize) {
    let mut s = body.into_data_stream();
    let mut total = 0usize;
    while let Some(Ok(chunk)) = s.next().await {
        total += chunk.len();
        if total > limit {
            break;
        }
    }
}

fn rejection(e: MultipartRejection) -> ApiError {
    ApiError::new(
        e.status(),
        "bad_form",
        format!("expected a multipart/form-data body: {}", e.body_text()),
    )
}

fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        axum::http::StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("the request body is over {limit} bytes"),
    )
}

/// Reads the whole form. `files` and `texts` name the fields allowed as each kind; the body
/// may hold at most `limit` bytes of field data.
pub async fn read(
    multipart: Result<Multipart, MultipartRejection>,
    files: &[&str],
    texts: &[&str],
    limit: usize,
) -> Result<Form, ApiError> {
    let mut mp = multipart.map_err(rejection)?;
    let mut form = Form::default();
    let mut total = 0usize;
    let mut over = false;
    loop {
        let mut field = match mp.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(_) if over => return Err(too_large(limit)),
            Err(e) if stalled(&e) => return Err(read_timeout()),
            Err(e) => {
                let status = e.status();
                if status.as_u16() == 413 {
                    return Err(too_large(limit));
                }
                return Err(ApiError::new(
                    status,
                    "bad_form",
                    format!("cannot read the form: {}", e.body_text()),
                ));
            }
        };
        let name = field.name().unwrap_or_default().to_string();
        // Over the limit: drain what is left, then refuse.
        let mut data = Vec::new();
        loop {
            match field.chunk().await {
                Ok(Some(c)) => {
                    total += c.len();
                    over |= total > limit;
                    if !over {
                        data.extend_from_slice(&c);
                    }
                }
                Ok(None) => break,
                Err(_) if over => return Err(too_large(limit)),
                Err(e) if stalled(&e) => return Err(read_timeout()),
                Err(e) if e.status().as_u16() == 413 => return Err(too_large(limit)),
                Err(e) => {
                    return Err(ApiError::new(
                        e.status(),
                        "bad_form",
                        format!("cannot read field `{name}`: {}", e.body_text()),
                    ))
                }
            }
        }
        if over {
            continue;
        }
        let is_file = files.contains(&name.as_str());
        if !is_file && !texts.contains(&name.as_str()) {
            let known: Vec<&str> = files.iter().chain(texts).copied().collect();
            return Err(ApiError::bad_request(
                "unknown_field",
                format!("unknown field `{name}` (fields: {})", known.join(", ")),
            ));
        }
        if form.files.contains_key(&name) || form.texts.contains_key(&name) {
            return Err(ApiError::bad_request(
                "bad_field",
                format!("field `{name}` given twice"),
            ));
        }
        if is_file {
            form.files.insert(name, Bytes::from(data));
        } else {
            if data.len() > MAX_TEXT {
                return Err(ApiError::bad_request(
                    "bad_field",
                    format!("field `{name}` is too long"),
                ));
            }
            let text = String::from_utf8(data).map_err(|_| {
                ApiError::bad_request("bad_field", format!("field `{name}` is not UTF-8 text"))
            })?;
            form.texts.insert(name, text.trim().to_string());
        }
    }
    if over {
        return Err(too_large(limit));
    }
    Ok(form)
}
