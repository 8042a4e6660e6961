//! Where batch jobs' records live: [`JobStore`], with an embedded SQLite store (the default:
//! nothing to install) and a PostgreSQL store (`--jobs-db postgres://…`: one queue shared by
//! replicas; a job is claimed with `SELECT … FOR UPDATE SKIP LOCKED` under a lease).
//!
//! Every change of a job goes through one call here, atomically: the store is the truth, the
//! workers and the HTTP door hold nothing a restart would lose.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::postgres::PgStore;
use super::sqlite::SqliteStore;
use super::{JobRecord, JobStatus, Millis, NewJob};

/// Opens the job store `--jobs-db` names: none, SQLite at `<data_dir>/jobs.db` (created when
/// missing); a `postgres://…` or `postgresql://…` URL, that PostgreSQL database (the schema
/// created when missing). Anything else is refused.
pub async fn open(url: Option<&str>, data_dir: &Path) -> Result<Arc<dyn JobStore>, StoreError> {
    match url {
        None => Ok(Arc::new(SqliteStore::open(data_dir).await?)),
        Some(u) if u.starts_with("postgres://") || u.starts_with("postgresql://") => {
            Ok(Arc::new(PgStore::open(u).await?))
        }
        Some(u) => {
            // Only the scheme: the rest may hold a password.
            let scheme = u.split_once("://").map_or("(none)", |(s, _)| s);
            Err(StoreError::Db(format!(
                "unsupported job store URL scheme {scheme:?}: give a postgres://… or \
                 postgresql://… URL, or none for SQLite at {}",
                data_dir.join(super::sqlite::FILE_NAME).display()
            )))
        }
    }
}

/// Errors of the job store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// `--max-queued-jobs` jobs are already queued.
    #[error("{0} jobs are already queued")]
    TooManyQueued(u64),
    #[error("job store: {0}")]
    Db(String),
}

/// What ended a run (see [`JobStore::finish`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Succeeded,
    Failed(String),
}

/// The records of batch jobs, shared by the HTTP door and the workers (and, with PostgreSQL,
/// by every replica). All times are [`Millis`]; `now` is passed in so tests can move it.
///
/// An `owner` names one worker (or webhook sender) in one process: it must differ between
/// replicas and between restarts (e.g. a random id per process plus the worker's number), since
/// the lease checks trust it.
#[async_trait::async_trait]
pub trait JobStore: Send + Sync {
    /// Keeps a new job as `queued`, unless `max_queued` jobs are already queued
    /// ([`StoreError::TooManyQueued`] with the number queued); checked and inserted
    /// atomically, across replicas too. An id already kept is a [`StoreError::Db`].
    async fn insert(&self, job: &NewJob, max_queued: u64) -> Result<JobRecord, StoreError>;

    async fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError>;

    /// Newest first, optionally only one status, at most `limit`, only ids before `after`
    /// (ids sort by creation time). The second value is the id to pass as `after` for the
    /// next page, when there is one (`None` after a last page, even a full one). `limit` 0
    /// gives an empty page.
    async fn list(
        &self,
        status: Option<JobStatus>,
        limit: usize,
        after: Option<&str>,
    ) -> Result<(Vec<JobRecord>, Option<String>), StoreError>;

    /// Claims the oldest runnable job for `owner` until `now + lease`: a queued job, or a
    /// running one whose lease has expired (its worker died). The job becomes `running`,
    /// `runs` grows by one, `started_at` is `now`, `frames_done` restarts from 0. Oldest
    /// means by `created_at`. A lease has run out when `lease_until <= now`. With PostgreSQL
    /// two replicas never claim the same job (`FOR UPDATE SKIP LOCKED`).
    async fn claim(
        &self,
        owner: &str,
        now: Millis,
        lease: Duration,
    ) -> Result<Option<JobRecord>, StoreError>;

    /// Renews `owner`'s lease on a running job and records its progress. `false` when the
    /// job is no longer `owner`'s running job (cancelled, deleted, or claimed by another
    /// after the lease ran out): the worker must stop. A lease that ran out but that nobody
    /// claimed yet is still `owner`'s, and renewed.
    async fn renew(
        &self,
        id: &str,
        owner: &str,
        now: Millis,
        lease: Duration,
        frames_done: u64,
        frames_total: u64,
    ) -> Result<bool, StoreError>;

    /// Gives `owner`'s running job back to the queue (`queued`, lease released, progress
    /// 0; `runs` keeps counting the run that was stopped), so that the next worker claims it
    /// at once instead of after the lease: a replica shutting down does this for the jobs it
    /// cannot finish. `false` when the job is not `owner`'s running job.
    async fn release(&self, id: &str, owner: &str) -> Result<bool, StoreError>;

    /// Ends `owner`'s run: `succeeded` (progress set to complete: `frames_done` =
    /// `frames_total`) or `failed` with its error; `bytes` is the job's files now, either
    /// way; `finished_at` is `now`; the lease is released; a job with a webhook gets its
    /// event pending, due at `now` (`attempts` untouched). `false` (and nothing changed)
    /// when the job is not `owner`'s running job.
    async fn finish(
        &self,
        id: &str,
        owner: &str,
        now: Millis,
        outcome: Outcome,
        bytes: u64,
    ) -> Result<bool, StoreError>;

    /// Cancels a queued or running job (`finished_at` = `now`, lease released, a
    /// `job.cancelled` webhook pending when it has one). Returns the job as it is after the
    /// call (unchanged when it had already ended), or `None` for an unknown id.
    async fn cancel(&self, id: &str, now: Millis) -> Result<Option<JobRecord>, StoreError>;

    /// Removes the record. `false` for an unknown id.
    async fn delete(&self, id: &str) -> Result<bool, StoreError>;

    /// Claims a job whose webhook is due (`next_at <= now`, an event pending) for `owner`
    /// until `now + lease`, so that one replica delivers it; the soonest due first. A claim
    /// whose lease ran out (`<= now`) is claimable again. `None` when nothing is due. The
    /// claim has columns of its own: it neither waits for nor disturbs a run's lease.
    async fn claim_webhook(
        &self,
        owner: &str,
        now: Millis,
        lease: Duration,
    ) -> Result<Option<JobRecord>, StoreError>;

    /// Records one delivery attempt of the pending webhook: `attempts` grows by one,
    /// `last_status` is set; `next_at` is the next try's time, or `None` when it was
    /// delivered or given up (the pending event is then cleared). Releases the claim.
    /// Ignored (`Ok`) when `owner` no longer holds the claim (it ran out and another took
    /// it, or the job was deleted): that one records its own attempt.
    async fn record_webhook(
        &self,
        id: &str,
        owner: &str,
        last_status: &str,
        next_at: Option<Millis>,
    ) -> Result<(), StoreError>;

    /// Ids of jobs that ended (succeeded, failed, cancelled) before `before`
    /// (`finished_at < before`), the earliest first, for `--job-ttl`. A webhook still
    /// pending does not keep a job out of the list.
    async fn ended_before(&self, before: Millis) -> Result<Vec<String>, StoreError>;

    /// Jobs per status (every status present, 0 when none), for `lipsync_jobs{status}`.
    async fn counts(&self) -> Result<HashMap<JobStatus, u64>, StoreError>;

    /// The bytes of every job's files, for `--data-dir-bytes`.
    async fn total_bytes(&self) -> Result<u64, StoreError>;
}
