//! `lipsync serve` configuration: the shared engine and media flags ([`crate::config`]) and
//! the HTTP ones, every field a flag with a `LIPSYNC_*` environment variable; its doc comments
//! are the `--help`.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use crate::config::Resolved;
use crate::config::{parse_bytes, EngineArgs, MediaArgs};
use crate::jobs::webhook::{Allow, RetrySchedule, DEFAULT_RETRY_SECONDS};

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
    #[command(flatten)]
    pub jobs: JobArgs,
}

/// The batch job flags of `serve` (`/v1/jobs`): where jobs are kept, how long, how many, and
/// their webhooks.
#[derive(Clone, clap::Args)]
pub struct JobArgs {
    /// Directory for batch jobs' files (the uploads, then the finished videos) and, without
    /// --jobs-db, their SQLite database (`jobs.db`); created if missing. Replicas sharing
    /// --jobs-db must mount the same directory [default: $XDG_DATA_HOME/lipsync, else
    /// ~/.local/share/lipsync].
    #[arg(long, env = "LIPSYNC_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// PostgreSQL URL of the job store (`postgres://user:password@host/db`), so that replicas
    /// share one queue; the files stay under --data-dir, on a volume every replica mounts
    /// [default: none, an embedded SQLite database under --data-dir].
    #[arg(long, env = "LIPSYNC_JOBS_DB", hide_env_values = true, value_parser = JobsDbParser)]
    pub jobs_db: Option<String>,
    /// Seconds a finished (succeeded, failed or cancelled) job is kept; then its record and
    /// files are deleted.
    #[arg(long, env = "LIPSYNC_JOB_TTL", default_value_t = 86400, value_parser = clap::value_parser!(u64).range(1..))]
    pub job_ttl: u64,
    /// Jobs waiting to run (across the replicas sharing --jobs-db); a submit beyond it is
    /// refused with 429 too_many_jobs.
    #[arg(long, env = "LIPSYNC_MAX_QUEUED_JOBS", default_value_t = 1000)]
    pub max_queued_jobs: usize,
    /// Disk for the jobs' files under --data-dir, in bytes (e.g. 50G, 512M); a submit that
    /// would go over it is refused with 507 insufficient_storage.
    #[arg(long, env = "LIPSYNC_DATA_DIR_BYTES", default_value = "50G", value_parser = parse_bytes)]
    pub data_dir_bytes: u64,
    /// Batch jobs this process renders at once. They run in the engine's background class,
    /// in what live sessions and `POST /v1/lipsync` leave of each batch.
    #[arg(long, env = "LIPSYNC_JOB_CONCURRENCY", default_value_t = 2, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    pub job_concurrency: usize,
    /// Seconds a running job is leased to the process rendering it (renewed while it runs);
    /// a job whose lease ran out, its process gone, is started again by another. Decimals
    /// allowed.
    #[arg(long, env = "LIPSYNC_JOB_LEASE_SECONDS", default_value_t = 15.0, value_parser = parse_positive_seconds)]
    pub job_lease_seconds: f64,
    /// Key of the webhooks' `X-Lipsync-Signature: sha256=<hex HMAC-SHA256 of the body>`;
    /// without it webhooks are sent unsigned. Never logged or shown in /info.
    #[arg(long, env = "LIPSYNC_WEBHOOK_SECRET", hide_env_values = true, value_parser = parse_secret)]
    pub webhook_secret: Option<String>,
    /// Seconds to wait before each retry of a webhook that failed (no 2xx answer),
    /// comma-separated, decimals allowed; `none`: no retries.
    #[arg(long, env = "LIPSYNC_WEBHOOK_RETRY_SECONDS", default_value = DEFAULT_RETRY_SECONDS)]
    pub webhook_retry_seconds: RetrySchedule,
    /// Hosts webhooks may be sent to, comma-separated: names (`hooks.example.com`,
    /// `*.example.com`), addresses and CIDRs (`10.0.0.0/8`); a `webhook_url` elsewhere is
    /// refused with 400 webhook_not_allowed [default: any host except link-local addresses
    /// and cloud metadata services].
    #[arg(long, env = "LIPSYNC_WEBHOOK_ALLOW")]
    pub webhook_allow: Option<Allow>,
}

impl JobArgs {
    /// The data directory: `--data-dir`, else [`default_data_dir`] from this process's
    /// environment. An error when neither gives one (no `HOME`).
    pub fn data_dir(&self) -> Result<PathBuf, String> {
        match &self.data_dir {
            Some(dir) => Ok(dir.clone()),
            None => default_data_dir(
                std::env::var_os("XDG_DATA_HOME").as_deref(),
                std::env::var_os("HOME").as_deref(),
            )
            .ok_or_else(|| {
                "no data directory for batch jobs: HOME is not set; give --data-dir \
                 (LIPSYNC_DATA_DIR)"
                    .to_string()
            }),
        }
    }

    /// --job-ttl as a duration.
    pub fn job_ttl(&self) -> Duration {
        Duration::from_secs(self.job_ttl)
    }

    /// --job-lease-seconds as a duration.
    pub fn job_lease(&self) -> Duration {
        Duration::from_secs_f64(self.job_lease_seconds)
    }

    /// --webhook-allow, or its default: any host except link-local and cloud metadata.
    pub fn webhook_allow(&self) -> Allow {
        self.webhook_allow.clone().unwrap_or_default()
    }

    /// --jobs-db with its password hidden, for logs and /info; `None` for SQLite.
    pub fn jobs_db_redacted(&self) -> Option<String> {
        self.jobs_db.as_deref().map(redact_url)
    }
}

/// The user's data directory for lipsync, as the XDG Base Directory specification places it:
/// `$XDG_DATA_HOME/lipsync` when `XDG_DATA_HOME` is an absolute path (a relative or empty one
/// is ignored, as the specification asks), else `$HOME/.local/share/lipsync` when `HOME` is
/// an absolute path; `None` otherwise. Takes the two variables' values so that it can be
/// tested without changing the process's environment.
pub fn default_data_dir(xdg_data_home: Option<&OsStr>, home: Option<&OsStr>) -> Option<PathBuf> {
    fn absolute(v: Option<&OsStr>) -> Option<&Path> {
        v.map(Path::new).filter(|p| p.is_absolute())
    }
    if let Some(xdg) = absolute(xdg_data_home) {
        return Some(xdg.join("lipsync"));
    }
    absolute(home).map(|h| h.join(".local/share/lipsync"))
}

/// `--jobs-db`: a `postgres://` (or `postgresql://`) URL; anything else is refused at
/// start-up rather than taken for a file name, with a message that shows the value without its
/// password (clap's own message would quote it whole).
#[derive(Clone)]
struct JobsDbParser;

impl clap::builder::TypedValueParser for JobsDbParser {
    type Value = String;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<String, clap::Error> {
        let s = value.to_string_lossy();
        let s = s.trim();
        let rest = s
            .strip_prefix("postgres://")
            .or_else(|| s.strip_prefix("postgresql://"));
        match rest {
            Some(rest) if !rest.is_empty() && value.to_str().is_some() => Ok(s.to_string()),
            _ => {
                let name = arg.map_or("--jobs-db".to_string(), |a| a.to_string());
                let msg = format!(
                    "invalid value {:?} for '{name}': not a PostgreSQL URL \
                     (postgres://user:password@host:5432/db); leave it out for the embedded \
                     SQLite database under --data-dir\n",
                    redact_url(s)
                );
                Err(clap::Error::raw(clap::error::ErrorKind::ValueValidation, msg).with_cmd(cmd))
            }
        }
    }
}

/// A secret must not be empty: an empty variable would otherwise turn signing off unnoticed.
fn parse_secret(s: &str) -> Result<String, String> {
    if s.is_empty() {
        Err("empty; leave it unset to send webhooks unsigned".into())
    } else {
        Ok(s.to_string())
    }
}

/// A URL with the password of its user info and any `password=` query parameter replaced by
/// `***` (`postgres://app:s3cret@db/lipsync` → `postgres://app:***@db/lipsync`).
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), url),
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{user}:***@{host}"),
            None => format!("{userinfo}@{host}"),
        },
        None => authority.to_string(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|kv| match kv.split_once('=') {
                    Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                    _ => kv.to_string(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_string(),
    };
    format!("{scheme}{authority}{tail}")
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

/// A number of seconds above 0, decimals allowed.
fn parse_positive_seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 1e9 => Ok(v),
        _ => Err(format!(
            "{s:?} is not a number of seconds above 0 (e.g. 15 or 0.5)"
        )),
    }
}

/// Seconds as a duration; `None` for 0 (off).
pub fn timeout(seconds: f64) -> Option<std::time::Duration> {
    (seconds > 0.0).then(|| std::time::Duration::from_secs_f64(seconds))
}

/// The secrets and the database password stay out of logs.
impl std::fmt::Debug for JobArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobArgs")
            .field("data_dir", &self.data_dir)
            .field("jobs_db", &self.jobs_db_redacted())
            .field("job_ttl", &self.job_ttl)
            .field("max_queued_jobs", &self.max_queued_jobs)
            .field("data_dir_bytes", &self.data_dir_bytes)
            .field("job_concurrency", &self.job_concurrency)
            .field("job_lease_seconds", &self.job_lease_seconds)
            .field(
                "webhook_secret",
                &self.webhook_secret.as_ref().map(|_| "<redacted>"),
            )
            .field("webhook_retry_seconds", &self.webhook_retry_seconds)
            .field("webhook_allow", &self.webhook_allow)
            .finish()
    }
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
            .field("jobs", &self.jobs)
            .finish_non_exhaustive()
    }
}

impl ServeArgs {
    pub fn resolve(&self) -> Resolved {
        self.engine.resolve(&self.media)
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;
    use std::path::PathBuf;
    use std::time::Duration;

    use clap::Parser;

    use super::{default_data_dir, redact_url, JobArgs};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        jobs: JobArgs,
    }

    /// Parses the job flags. The defaults are checked by a test that makes sure no
    /// `LIPSYNC_*` job variable is set in its environment.
    fn parse(args: &[&str]) -> Result<JobArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once(&"lipsync").chain(args)).map(|c| c.jobs)
    }

    #[test]
    fn job_flags_have_their_documented_defaults() {
        let set: Vec<_> = std::env::vars()
            .map(|(k, _)| k)
            .filter(|k| {
                k.starts_with("LIPSYNC_")
                    && ["DATA_DIR", "JOB", "WEBHOOK", "MAX_QUEUED"]
                        .iter()
                        .any(|w| k.contains(w))
            })
            .collect();
        if !set.is_empty() {
            eprintln!("skipped: {set:?} set in the environment");
            return;
        }
        let a = parse(&[]).unwrap();
        assert_eq!(a.data_dir, None);
        assert_eq!(a.jobs_db, None);
        assert_eq!(a.job_ttl(), Duration::from_secs(86400));
        assert_eq!(a.max_queued_jobs, 1000);
        assert_eq!(a.data_dir_bytes, 50 << 30);
        assert_eq!(a.job_concurrency, 2);
        assert_eq!(a.job_lease(), Duration::from_secs(15));
        assert_eq!(a.webhook_secret, None);
        let secs: Vec<u64> = a
            .webhook_retry_seconds
            .delays()
            .iter()
            .map(Duration::as_secs)
            .collect();
        assert_eq!(secs, [20, 40, 80, 160, 320]);
        assert!(a.webhook_allow.is_none() && a.webhook_allow().is_any());
    }

    #[test]
    fn job_flags_parse() {
        let a = parse(&[
            "--data-dir",
            "/srv/lipsync",
            "--jobs-db",
            "postgres://lipsync:pw@db:5432/lipsync",
            "--job-ttl",
            "3600",
            "--max-queued-jobs",
            "5",
            "--data-dir-bytes",
            "512M",
            "--job-concurrency",
            "4",
            "--job-lease-seconds",
            "0.5",
            "--webhook-secret",
            "s3cret",
            "--webhook-retry-seconds",
            "0.2,1",
            "--webhook-allow",
            "hooks.example.com,10.0.0.0/8",
        ])
        .unwrap();
        assert_eq!(a.data_dir(), Ok(PathBuf::from("/srv/lipsync")));
        assert_eq!(
            a.jobs_db.as_deref(),
            Some("postgres://lipsync:pw@db:5432/lipsync")
        );
        assert_eq!(a.job_ttl(), Duration::from_secs(3600));
        assert_eq!(a.max_queued_jobs, 5);
        assert_eq!(a.data_dir_bytes, 512 << 20);
        assert_eq!(a.job_concurrency, 4);
        assert_eq!(a.job_lease(), Duration::from_millis(500));
        assert_eq!(a.webhook_secret.as_deref(), Some("s3cret"));
        assert_eq!(
            a.webhook_retry_seconds.delays(),
            [Duration::from_millis(200), Duration::from_secs(1)]
        );
        assert!(!a.webhook_allow().is_any());
        assert!(parse(&["--webhook-retry-seconds", "none"])
            .unwrap()
            .webhook_retry_seconds
            .delays()
            .is_empty());
        assert!(
            parse(&["--jobs-db", "postgresql://db/lipsync"]).is_ok(),
            "libpq's other scheme"
        );
    }

    #[test]
    fn bad_job_flags_are_refused() {
        for args in [
            &["--jobs-db", "/var/lib/lipsync/jobs.sqlite"][..],
            &["--jobs-db", "mysql://db/lipsync"],
            &["--jobs-db", "postgres://"],
            &["--job-ttl", "0"],
            &["--job-ttl", "-1"],
            &["--data-dir-bytes", "lots"],
            &["--job-concurrency", "0"],
            &["--job-lease-seconds", "0"],
            &["--job-lease-seconds", "nan"],
            &["--webhook-secret", ""],
            &["--webhook-retry-seconds", "20,forty"],
            &["--webhook-retry-seconds", "-1"],
            &["--webhook-allow", ""],
            &["--webhook-allow", "10.0.0.0/99"],
        ] {
            assert!(parse(args).is_err(), "{args:?} accepted");
        }
        // The refusal of a wrong URL does not print its password.
        let e = parse(&["--jobs-db", "mysql://app:s3cret@db/x"])
            .err()
            .unwrap()
            .to_string();
        assert!(!e.contains("s3cret"), "{e}");
    }

    #[test]
    fn the_data_dir_defaults_to_the_users_data_directory() {
        let os = |s: &'static str| Some(OsStr::new(s));
        assert_eq!(
            default_data_dir(os("/data/xdg"), os("/home/u")),
            Some(PathBuf::from("/data/xdg/lipsync"))
        );
        assert_eq!(
            default_data_dir(None, os("/home/u")),
            Some(PathBuf::from("/home/u/.local/share/lipsync"))
        );
        // The XDG rule: a relative or empty XDG_DATA_HOME is ignored.
        assert_eq!(
            default_data_dir(os("relative/data"), os("/home/u")),
            Some(PathBuf::from("/home/u/.local/share/lipsync"))
        );
        assert_eq!(
            default_data_dir(os(""), os("/home/u")),
            Some(PathBuf::from("/home/u/.local/share/lipsync"))
        );
        assert_eq!(default_data_dir(None, None), None);
        assert_eq!(default_data_dir(os(""), os("")), None);
        assert_eq!(
            default_data_dir(os("/data/xdg"), None),
            Some(PathBuf::from("/data/xdg/lipsync"))
        );
        // --data-dir wins over both.
        let a = parse(&["--data-dir", "rel/dir"]).unwrap();
        assert_eq!(a.data_dir(), Ok(PathBuf::from("rel/dir")));
    }

    #[test]
    fn secrets_stay_out_of_debug_output() {
        let a = parse(&[
            "--jobs-db",
            "postgres://app:hunter2@db/lipsync?sslmode=require&password=hunter3",
            "--webhook-secret",
            "whsec-42",
        ])
        .unwrap();
        let shown = format!("{a:?}");
        for secret in ["hunter2", "hunter3", "whsec-42"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert_eq!(
            a.jobs_db_redacted().as_deref(),
            Some("postgres://app:***@db/lipsync?sslmode=require&password=***")
        );
    }

    #[test]
    fn urls_are_redacted() {
        assert_eq!(redact_url("postgres://db/x"), "postgres://db/x");
        assert_eq!(redact_url("postgres://app@db/x"), "postgres://app@db/x");
        assert_eq!(
            redact_url("postgres://app:p%40ss@db:5432"),
            "postgres://app:***@db:5432"
        );
        // An `@` in the password (unescaped) is still inside the user info.
        assert_eq!(
            redact_url("postgres://app:p@ss@db/x"),
            "postgres://app:***@db/x"
        );
        assert_eq!(redact_url("not a url"), "not a url");
    }
}
