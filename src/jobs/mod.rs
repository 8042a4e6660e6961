//! Batch jobs: a render submitted now and collected later, with a signed webhook when it ends.
//!
//! A job's record lives in a [`store::JobStore`] (embedded SQLite by default, PostgreSQL when
//! replicas share one queue); its input and output files live under the data directory. A
//! worker ([`worker`]) claims queued jobs with a lease it renews while it renders, through the
//! same engine call as every other door, in the engine's background class; a job whose worker
//! died is claimed again once its lease has expired. Webhooks ([`webhook`]) are delivered from
//! the store too, so a restart loses none and sends none twice.
//!
//! Uses `engine`; knows nothing of HTTP routing (the HTTP door is `server::jobs`).
//!
//! The names here are the batch job's own: `engine::Job` is one admitted render in the engine,
//! not a batch job.

pub mod postgres;
mod sql;
pub mod sqlite;
pub mod store;
pub mod webhook;
pub mod worker;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Where a batch job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobStatus {
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobStatus {
    pub const ALL: [JobStatus; 5] = [
        JobStatus::Queued,
        JobStatus::Running,
        JobStatus::Succeeded,
        JobStatus::Failed,
        JobStatus::Cancelled,
    ];

    /// The name used on the wire, in the store and in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            JobStatus::Queued => "queued",
            JobStatus::Running => "running",
            JobStatus::Succeeded => "succeeded",
            JobStatus::Failed => "failed",
            JobStatus::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<JobStatus> {
        JobStatus::ALL.into_iter().find(|v| v.as_str() == s)
    }

    /// Succeeded, failed or cancelled: nothing more will happen to the job but its webhook.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            JobStatus::Succeeded | JobStatus::Failed | JobStatus::Cancelled
        )
    }

    /// The `X-Lipsync-Event` of the webhook sent when a job ends this way.
    pub fn event(self) -> Option<&'static str> {
        match self {
            JobStatus::Succeeded => Some("job.succeeded"),
            JobStatus::Failed => Some("job.failed"),
            JobStatus::Cancelled => Some("job.cancelled"),
            _ => None,
        }
    }
}

/// Milliseconds since the Unix epoch: how the store keeps times.
pub type Millis = i64;

pub fn now_millis() -> Millis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_millis() as Millis
}

/// A time from the store as RFC 3339 (UTC, milliseconds), as the API shows it.
pub fn rfc3339(ms: Millis) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

/// A new job's id: `job_` + 12 hex digits of the creation time in milliseconds + 12 random
/// hex digits. Ids sort by creation time, which the listing's `after` cursor relies on.
pub fn new_job_id(created: Millis) -> String {
    let rand = uuid::Uuid::new_v4().as_u128() & 0xffff_ffff_ffff;
    format!("job_{:012x}{:012x}", created.max(0) as u64, rand)
}

/// Whether `s` has the shape of a job id (checked before it reaches a path or a query).
pub fn is_job_id(s: &str) -> bool {
    s.len() == 28
        && s.starts_with("job_")
        && s[4..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// What a job renders, as given at submit and checked then: everything the worker needs
/// besides the files in the job's directory. Stored as JSON with the record.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    /// The avatar's source file in the job's directory: a photo or a clip (`avatar.<ext>`), or
    /// the prepared avatar (`avatar.avatar`, the avatar store's format) when the job named an
    /// `avatar_id`.
    pub avatar_file: String,
    /// Whether `avatar_file` is a clip (`video`) rather than a photo (`image`) or a prepared
    /// avatar (`prepared`).
    pub avatar_kind: String,
    /// The speech in the job's directory (`speech.<ext>`).
    pub speech_file: String,
    /// The form fields of `/v1/lipsync` that shape the render, as given (`box`, `pads`,
    /// `smooth`, `loop`, `fps`, `blend`, `crf`).
    #[serde(default)]
    pub fields: std::collections::BTreeMap<String, String>,
}

/// One job as the store keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct JobRecord {
    pub id: String,
    pub status: JobStatus,
    pub created_at: Millis,
    pub started_at: Option<Millis>,
    pub finished_at: Option<Millis>,
    pub frames_done: u64,
    pub frames_total: u64,
    /// Why it failed (a client-safe message), when it failed.
    pub error: Option<String>,
    /// The `metadata` given at submit, as given (a JSON object).
    pub metadata: Option<serde_json::Value>,
    pub spec: JobSpec,
    /// Times a worker started it.
    pub runs: u32,
    /// The files' bytes under the data directory (input, then output too), for the budget.
    pub bytes: u64,
    pub webhook: Option<WebhookState>,
    /// The worker holding the job (while running) and until when.
    pub lease_owner: Option<String>,
    pub lease_until: Option<Millis>,
}

/// A job's webhook and its deliveries.
#[derive(Debug, Clone, PartialEq)]
pub struct WebhookState {
    pub url: String,
    pub attempts: u32,
    /// The last attempt's HTTP status, or why it got none (`"timeout"`, `"connect"`, …).
    pub last_status: Option<String>,
    /// When the next attempt is due: set when the job ends, cleared once delivered or given
    /// up on.
    pub next_at: Option<Millis>,
    /// The event still to deliver (`job.succeeded`, …), or none.
    pub pending_event: Option<String>,
}

/// What a submit asks the store to keep.
#[derive(Debug, Clone)]
pub struct NewJob {
    pub id: String,
    pub created_at: Millis,
    pub metadata: Option<serde_json::Value>,
    pub spec: JobSpec,
    pub webhook_url: Option<String>,
    pub bytes: u64,
}

/// The job as `GET /v1/jobs/{id}` and the webhooks show it.
pub fn job_json(r: &JobRecord) -> serde_json::Value {
    serde_json::json!({
        "id": r.id,
        "status": r.status.as_str(),
        "progress": {"frames_done": r.frames_done, "frames_total": r.frames_total},
        "created_at": rfc3339(r.created_at),
        "started_at": r.started_at.map(rfc3339),
        "finished_at": r.finished_at.map(rfc3339),
        "error": r.error,
        "metadata": r.metadata,
        "video_url": format!("/v1/jobs/{}/video", r.id),
        "runs": r.runs,
        "webhook": r.webhook.as_ref().map(|w| serde_json::json!({
            "url": w.url,
            "attempts": w.attempts,
            "last_status": w.last_status,
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_sort_by_creation_and_are_recognised() {
        let a = new_job_id(1_700_000_000_000);
        let b = new_job_id(1_700_000_000_001);
        assert!(a < b);
        assert!(is_job_id(&a) && is_job_id(&b));
        assert!(!is_job_id("job_../../etc/passwd00000000"));
        assert!(!is_job_id("av_0123"));
    }

    #[test]
    fn statuses_round_trip_by_name() {
        for s in JobStatus::ALL {
            assert_eq!(JobStatus::parse(s.as_str()), Some(s));
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
        assert_eq!(JobStatus::parse("done"), None);
    }

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
    }
}
