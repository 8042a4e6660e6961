//! `lipsync serve` configuration: the shared engine and media flags ([`crate::config`]) and
//! the HTTP ones, every field a flag with a `LIPSYNC_*` environment variable; its doc comments
//! are the `--help`.

use std::path::PathBuf;

pub use crate::config::Resolved;
use crate::config::{parse_bytes, EngineArgs, MediaArgs};

#[derive(Clone, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on (use 0.0.0.0 to accept connections from other hosts).
    #[arg(long, env = "LIPSYNC_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the address is logged).
    #[arg(long, env = "LIPSYNC_PORT", default_value_t = 8080)]
    pub port: u16,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub media: MediaArgs,
    /// Requests streaming at once; more are refused with 429.
    #[arg(long, env = "LIPSYNC_MAX_REQUESTS", default_value_t = 32)]
    pub max_requests: usize,
    /// Largest request body in bytes (audio and image together); larger gets 413.
    #[arg(long, env = "LIPSYNC_MAX_BODY_BYTES", default_value_t = 64 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a response may wait with encoded bytes that the client does not take (the
    /// clock restarts whenever the socket takes a byte); then the stream is aborted and its
    /// work freed. Decimals allowed; 0 turns it off.
    #[arg(long, env = "LIPSYNC_SEND_TIMEOUT", default_value_t = 30.0, value_parser = parse_seconds)]
    pub send_timeout: f64,
    /// Seconds allowed between two pieces of a request body while it uploads; then 408.
    /// Decimals allowed; 0 turns it off.
    #[arg(long, env = "LIPSYNC_READ_TIMEOUT", default_value_t = 30.0, value_parser = parse_seconds)]
    pub read_timeout: f64,
    /// Prepared avatars kept in memory (least recently used evicted first).
    #[arg(long, env = "LIPSYNC_AVATAR_CACHE_ENTRIES", default_value_t = 256)]
    pub avatar_cache_entries: usize,
    /// Memory for prepared avatars, in bytes.
    #[arg(long, env = "LIPSYNC_AVATAR_CACHE_BYTES", default_value_t = 1 << 30)]
    pub avatar_cache_bytes: u64,
    /// Directory that keeps every prepared avatar (photo or clip) on disk: found again after a
    /// restart, and shared by replicas that mount the same volume (the memory cache sits on
    /// top). Without it avatars live in memory only.
    #[arg(long, env = "LIPSYNC_AVATAR_DIR")]
    pub avatar_dir: Option<PathBuf>,
    /// Disk for --avatar-dir, in bytes (e.g. 10G, 512M): least recently used avatars are
    /// removed first; one larger than this is refused with 413.
    #[arg(long, env = "LIPSYNC_AVATAR_DIR_BYTES", default_value = "10G", value_parser = parse_bytes)]
    pub avatar_dir_bytes: u64,
    /// Seconds to let in-flight streams finish after SIGTERM/SIGINT before exiting.
    #[arg(long, env = "LIPSYNC_SHUTDOWN_TIMEOUT", default_value_t = 30)]
    pub shutdown_timeout: u64,
    /// Live sessions (`GET /v1/stream`): an utterance ends after this many milliseconds
    /// without audio.
    #[arg(long, env = "LIPSYNC_UTTERANCE_GAP_MS", default_value_t = 300)]
    pub utterance_gap_ms: u64,
    /// Seconds a live session may go without a message from its client; then it is closed.
    /// Decimals allowed; 0 turns it off.
    #[arg(long, env = "LIPSYNC_SESSION_IDLE_TIMEOUT", default_value_t = 60.0, value_parser = parse_seconds)]
    pub session_idle_timeout: f64,
    /// Live sessions open at once; more are refused with 429 [default: the 25 fps sessions
    /// the warm-up's measured batch times sustain, at least 1].
    #[arg(long, env = "LIPSYNC_MAX_SESSIONS")]
    pub max_sessions: Option<usize>,
    /// Require `Authorization: Bearer <key>` on every /v1/ route.
    #[arg(long, env = "LIPSYNC_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Origins allowed to call the API from a browser (comma-separated, or `*` for any);
    /// no CORS headers otherwise.
    #[arg(long, env = "LIPSYNC_CORS_ORIGINS", value_delimiter = ',')]
    pub cors_origins: Vec<String>,
    /// Leave out the try-it page at `/` (then `/` answers 404 like any unknown path).
    #[arg(long, env = "LIPSYNC_NO_UI")]
    pub no_ui: bool,
}

/// A number of seconds, decimals allowed, not negative.
fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!(
            "{s:?} is not a number of seconds (e.g. 30 or 2.5; 0 = off)"
        )),
    }
}

/// Seconds as a duration; `None` for 0 (off).
pub fn timeout(seconds: f64) -> Option<std::time::Duration> {
    (seconds > 0.0).then(|| std::time::Duration::from_secs_f64(seconds))
}

/// The API key stays out of logs.
impl std::fmt::Debug for ServeArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeArgs")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("engine", &self.engine)
            .field("media", &self.media)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("cors_origins", &self.cors_origins)
            .field("no_ui", &self.no_ui)
            .finish_non_exhaustive()
    }
}

impl ServeArgs {
    pub fn resolve(&self) -> Resolved {
        self.engine.resolve(&self.media)
    }
}
