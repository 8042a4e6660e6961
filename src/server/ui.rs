//! The try-it page: `GET /` and its script and style, embedded in the binary (plain HTML, CSS
//! and JavaScript: no build step, nothing fetched from elsewhere). On by default; `--no-ui`
//! leaves these routes out, so `/` gets the usual 404 JSON. They never need the API key: the
//! page asks for it (when `/info` says `auth`) and sends it with its own `/v1/` calls.

use std::sync::Arc;

use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use super::App;

const INDEX: &str = include_str!("ui/index.html");
const SCRIPT: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/app.css");

/// Only this server's own resources; `blob:` for the MSE video, the download link, image
/// previews and the microphone's audio worklet.
const CSP: &str = "default-src 'self'; script-src 'self' blob:; style-src 'self'; \
                   img-src 'self' blob: data:; media-src 'self' blob:; connect-src 'self'; \
                   object-src 'none'; base-uri 'none'; frame-ancestors 'none'";

fn page(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
}

async fn index() -> impl IntoResponse {
    page("text/html; charset=utf-8", INDEX)
}

async fn script() -> impl IntoResponse {
    page("text/javascript; charset=utf-8", SCRIPT)
}

async fn style() -> impl IntoResponse {
    page("text/css; charset=utf-8", STYLE)
}

/// `GET /`, `GET /ui/app.js`, `GET /ui/app.css`.
pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route("/", get(index))
        .route("/ui/app.js", get(script))
        .route("/ui/app.css", get(style))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_works_without_scripts_and_names_only_its_own_files() {
        // The plain form posts to the API before (or without) the script.
        assert!(INDEX.contains(
            r#"<form id="form" action="/v1/lipsync" method="post" enctype="multipart/form-data""#
        ));
        assert!(INDEX.contains(r#"accept="image/*,video/*""#));
        assert!(INDEX.contains(r#"accept="audio/*""#));
        assert!(INDEX.contains(r#"src="/ui/app.js""#));
        assert!(INDEX.contains(r#"href="/ui/app.css""#));
        // Nothing from another origin.
        for text in [INDEX, SCRIPT, STYLE] {
            assert!(!text.contains("http://") && !text.contains("https://"));
        }
    }
}
