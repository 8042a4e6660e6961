//! What the SQLite and PostgreSQL job stores share: the schema, the statements both dialects
//! accept (`$N` parameters, `RETURNING`, partial indexes), a row's decoding into a
//! [`JobRecord`], and the code running them: [`job_store!`] writes the `impl JobStore` of
//! both stores, [`migrate_in!`], [`claim_in!`] and [`insert_in!`] the steps of a transaction
//! once begun. Each store adds what only its database can do (PostgreSQL's
//! `FOR UPDATE SKIP LOCKED` and advisory locks, SQLite's `BEGIN IMMEDIATE`) and its own
//! `cancel`.
//!
//! Times are `BIGINT` milliseconds, counts and sizes `BIGINT` (clamped into `u64`/`u32` when
//! read), `metadata` and `spec` JSON as `TEXT` (kept as given: `jsonb` would reorder keys).

use std::collections::HashMap;
use std::time::Duration;

use sqlx::{ColumnIndex, Decode, Row, Type};

use super::store::StoreError;
use super::{JobRecord, JobSpec, JobStatus, Millis, WebhookState};

/// The schema, one entry per version: entry `i` takes the database from version `i` to
/// `i + 1`. Append a migration to change the schema; never edit a released one.
pub(crate) const MIGRATIONS: &[&str] = &[
    // Version 1.
    "CREATE TABLE lipsync_jobs (
        id TEXT PRIMARY KEY,
        status TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        started_at BIGINT,
        finished_at BIGINT,
        frames_done BIGINT NOT NULL DEFAULT 0,
        frames_total BIGINT NOT NULL DEFAULT 0,
        error TEXT,
        metadata TEXT,
        spec TEXT NOT NULL,
        runs BIGINT NOT NULL DEFAULT 0,
        bytes BIGINT NOT NULL DEFAULT 0,
        lease_owner TEXT,
        lease_until BIGINT,
        webhook_url TEXT,
        webhook_attempts BIGINT NOT NULL DEFAULT 0,
        webhook_last_status TEXT,
        webhook_next_at BIGINT,
        webhook_event TEXT,
        webhook_owner TEXT,
        webhook_until BIGINT
    );
    CREATE INDEX lipsync_jobs_runnable ON lipsync_jobs (status, created_at, id);
    CREATE INDEX lipsync_jobs_webhook_due ON lipsync_jobs (webhook_next_at)
        WHERE webhook_event IS NOT NULL;
    CREATE INDEX lipsync_jobs_finished ON lipsync_jobs (finished_at)
        WHERE finished_at IS NOT NULL;",
];

/// The schema version this build writes and reads.
pub(crate) const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// The table holding the schema version (one row), created before any migration.
pub(crate) const CREATE_SCHEMA_TABLE: &str =
    "CREATE TABLE IF NOT EXISTS lipsync_schema (version BIGINT NOT NULL)";
pub(crate) const SELECT_SCHEMA_VERSION: &str = "SELECT version FROM lipsync_schema";
pub(crate) const INSERT_SCHEMA_VERSION: &str = "INSERT INTO lipsync_schema (version) VALUES ($1)";
pub(crate) const UPDATE_SCHEMA_VERSION: &str = "UPDATE lipsync_schema SET version = $1";

/// The error for a database written by a newer build: refuse rather than misread it.
pub(crate) fn newer_schema(found: i64) -> StoreError {
    StoreError::Db(format!(
        "the database has schema version {found}, newer than this build's {SCHEMA_VERSION}: \
         run a newer lipsync"
    ))
}

/// Every column of a job, in the order [`record`] reads them.
macro_rules! columns {
    () => {
        "id, status, created_at, started_at, finished_at, frames_done, frames_total, error, \
         metadata, spec, runs, bytes, lease_owner, lease_until, webhook_url, webhook_attempts, \
         webhook_last_status, webhook_next_at, webhook_event, webhook_owner, webhook_until"
    };
}

pub(crate) const INSERT: &str = concat!(
    "INSERT INTO lipsync_jobs (id, status, created_at, metadata, spec, bytes, webhook_url) \
     VALUES ($1, 'queued', $2, $3, $4, $5, $6) RETURNING ",
    columns!()
);

pub(crate) const COUNT_QUEUED: &str = "SELECT COUNT(*) FROM lipsync_jobs WHERE status = 'queued'";

pub(crate) const GET: &str = concat!("SELECT ", columns!(), " FROM lipsync_jobs WHERE id = $1");

/// `$1` status or null, `$2` the `after` id or null, `$3` the limit.
pub(crate) const LIST: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM lipsync_jobs WHERE ($1 IS NULL OR status = $1) AND ($2 IS NULL OR id < $2) \
     ORDER BY id DESC LIMIT $3"
);

/// The oldest runnable job at `$1`: queued, or running under an expired lease. PostgreSQL
/// appends `FOR UPDATE SKIP LOCKED`.
pub(crate) const CLAIMABLE: &str = "SELECT id FROM lipsync_jobs \
     WHERE status = 'queued' OR (status = 'running' AND lease_until <= $1) \
     ORDER BY created_at, id LIMIT 1";

/// Starts a run of `$4` at `$1` for owner `$2` until `$3`.
pub(crate) const START_RUN: &str = concat!(
    "UPDATE lipsync_jobs SET status = 'running', runs = runs + 1, started_at = $1, \
     frames_done = 0, lease_owner = $2, lease_until = $3 WHERE id = $4 RETURNING ",
    columns!()
);

/// `$1` lease until, `$2` frames done, `$3` frames total, `$4` id, `$5` owner.
pub(crate) const RENEW: &str = "UPDATE lipsync_jobs \
     SET lease_until = $1, frames_done = $2, frames_total = $3 \
     WHERE id = $4 AND status = 'running' AND lease_owner = $5";

/// `$1` id, `$2` owner: the run given back to the queue (its worker is shutting down).
pub(crate) const RELEASE: &str = "UPDATE lipsync_jobs \
     SET status = 'queued', lease_owner = NULL, lease_until = NULL, frames_done = 0 \
     WHERE id = $1 AND status = 'running' AND lease_owner = $2";

/// `$1` final status, `$2` now, `$3` error, `$4` bytes, `$5` webhook event, `$6` id,
/// `$7` owner.
pub(crate) const FINISH: &str = "UPDATE lipsync_jobs SET status = $1, finished_at = $2, \
     error = $3, bytes = $4, \
     frames_done = CASE WHEN $1 = 'succeeded' THEN frames_total ELSE frames_done END, \
     lease_owner = NULL, lease_until = NULL, \
     webhook_event = CASE WHEN webhook_url IS NULL THEN NULL ELSE $5 END, \
     webhook_next_at = CASE WHEN webhook_url IS NULL THEN NULL ELSE $2 END \
     WHERE id = $6 AND status = 'running' AND lease_owner = $7";

/// `$1` now, `$2` id.
pub(crate) const CANCEL: &str = concat!(
    "UPDATE lipsync_jobs SET status = 'cancelled', finished_at = $1, \
     lease_owner = NULL, lease_until = NULL, \
     webhook_event = CASE WHEN webhook_url IS NULL THEN NULL ELSE 'job.cancelled' END, \
     webhook_next_at = CASE WHEN webhook_url IS NULL THEN NULL ELSE $1 END \
     WHERE id = $2 AND status IN ('queued', 'running') RETURNING ",
    columns!()
);

pub(crate) const DELETE: &str = "DELETE FROM lipsync_jobs WHERE id = $1";

/// The job whose webhook is due soonest at `$1` and not claimed (or claimed under an expired
/// claim). PostgreSQL appends `FOR UPDATE SKIP LOCKED`.
pub(crate) const WEBHOOK_DUE: &str = "SELECT id FROM lipsync_jobs \
     WHERE webhook_event IS NOT NULL AND webhook_next_at <= $1 \
     AND (webhook_owner IS NULL OR webhook_until <= $1) \
     ORDER BY webhook_next_at, id LIMIT 1";

/// Claims `$4`'s webhook at `$1` for owner `$2` until `$3` (`$1` is there to share
/// [`START_RUN`]'s parameters).
pub(crate) const CLAIM_WEBHOOK: &str = concat!(
    "UPDATE lipsync_jobs SET webhook_owner = $2, webhook_until = $3 \
     WHERE id = $4 AND webhook_next_at <= $1 RETURNING ",
    columns!()
);

/// The two things claimed under a lease: a job's run, a job's webhook delivery. Each is a
/// select finding the job (bound: now) and an update taking it (bound: now, owner, until,
/// id).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Claim {
    Run,
    Webhook,
}

impl Claim {
    pub(crate) fn select(self) -> &'static str {
        match self {
            Claim::Run => CLAIMABLE,
            Claim::Webhook => WEBHOOK_DUE,
        }
    }

    pub(crate) fn update(self) -> &'static str {
        match self {
            Claim::Run => START_RUN,
            Claim::Webhook => CLAIM_WEBHOOK,
        }
    }
}

/// `$1` last status, `$2` next attempt or null (delivered or given up), `$3` id, `$4` owner.
pub(crate) const RECORD_WEBHOOK: &str = "UPDATE lipsync_jobs \
     SET webhook_attempts = webhook_attempts + 1, webhook_last_status = $1, \
     webhook_next_at = $2, \
     webhook_event = CASE WHEN $2 IS NULL THEN NULL ELSE webhook_event END, \
     webhook_owner = NULL, webhook_until = NULL \
     WHERE id = $3 AND webhook_owner = $4";

pub(crate) const ENDED_BEFORE: &str = "SELECT id FROM lipsync_jobs \
     WHERE status IN ('succeeded', 'failed', 'cancelled') AND finished_at < $1 \
     ORDER BY finished_at, id";

pub(crate) const COUNTS: &str = "SELECT status, COUNT(*) FROM lipsync_jobs GROUP BY status";

pub(crate) const TOTAL_BYTES: &str =
    "SELECT CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM lipsync_jobs";

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        StoreError::Db(e.to_string())
    }
}

/// Trims `jobs`, fetched with `limit + 1` rows, to a page: the jobs, and the id to pass as
/// `after` for the next page when there is one.
pub(crate) fn page(mut jobs: Vec<JobRecord>, limit: usize) -> (Vec<JobRecord>, Option<String>) {
    let next = if jobs.len() > limit {
        jobs.truncate(limit);
        jobs.last().map(|j| j.id.clone())
    } else {
        None
    };
    (jobs, next)
}

/// Every status at 0, for [`super::store::JobStore::counts`].
pub(crate) fn zero_counts() -> HashMap<JobStatus, u64> {
    JobStatus::ALL.into_iter().map(|s| (s, 0)).collect()
}

/// A count or size as the database keeps it (`BIGINT`).
pub(crate) fn big(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// `now + lease`, saturating.
pub(crate) fn until(now: Millis, lease: Duration) -> Millis {
    now.saturating_add(i64::try_from(lease.as_millis()).unwrap_or(i64::MAX))
}

/// The values [`FINISH`] binds for an outcome: status, error, webhook event.
pub(crate) fn outcome_values(
    outcome: &super::store::Outcome,
) -> (JobStatus, Option<&str>, &'static str) {
    let status = match outcome {
        super::store::Outcome::Succeeded => JobStatus::Succeeded,
        super::store::Outcome::Failed(_) => JobStatus::Failed,
    };
    let error = match outcome {
        super::store::Outcome::Succeeded => None,
        super::store::Outcome::Failed(e) => Some(e.as_str()),
    };
    (status, error, status.event().unwrap_or_default())
}

/// The job's spec and metadata as stored.
pub(crate) fn json_columns(
    spec: &JobSpec,
    metadata: Option<&serde_json::Value>,
) -> Result<(String, Option<String>), StoreError> {
    let spec = serde_json::to_string(spec).map_err(|e| StoreError::Db(format!("spec: {e}")))?;
    let metadata = metadata
        .map(serde_json::to_string)
        .transpose()
        .map_err(|e| StoreError::Db(format!("metadata: {e}")))?;
    Ok((spec, metadata))
}

/// A row of [`columns!`] as a record.
pub(crate) fn record<R>(row: &R) -> Result<JobRecord, StoreError>
where
    R: Row,
    for<'a> &'a str: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
{
    let id: String = row.try_get("id")?;
    let bad = |what: &str, e: &dyn std::fmt::Display| {
        StoreError::Db(format!("job {id}: unreadable {what}: {e}"))
    };
    let status: String = row.try_get("status")?;
    let status = JobStatus::parse(&status).ok_or_else(|| bad("status", &status))?;
    let spec: String = row.try_get("spec")?;
    let spec: JobSpec = serde_json::from_str(&spec).map_err(|e| bad("spec", &e))?;
    let metadata = row
        .try_get::<Option<String>, _>("metadata")?
        .map(|m| serde_json::from_str(&m))
        .transpose()
        .map_err(|e| bad("metadata", &e))?;
    let count = |v: i64| u64::try_from(v).unwrap_or(0);
    let small = |v: i64| u32::try_from(v.max(0)).unwrap_or(u32::MAX);
    let webhook = match row.try_get::<Option<String>, _>("webhook_url")? {
        None => None,
        Some(url) => Some(WebhookState {
            url,
            attempts: small(row.try_get("webhook_attempts")?),
            last_status: row.try_get("webhook_last_status")?,
            next_at: row.try_get("webhook_next_at")?,
            pending_event: row.try_get("webhook_event")?,
        }),
    };
    Ok(JobRecord {
        status,
        created_at: row.try_get("created_at")?,
        started_at: row.try_get("started_at")?,
        finished_at: row.try_get("finished_at")?,
        frames_done: count(row.try_get("frames_done")?),
        frames_total: count(row.try_get("frames_total")?),
        error: row.try_get("error")?,
        metadata,
        spec,
        runs: small(row.try_get("runs")?),
        bytes: count(row.try_get("bytes")?),
        webhook,
        lease_owner: row.try_get("lease_owner")?,
        lease_until: row.try_get("lease_until")?,
        id,
    })
}

/// The steps of a schema migration both stores share, inside the transaction `$tx` the store
/// has begun (and locked as it must): the version table created when missing, the version
/// read, the missing migrations run, the version written, committed. Evaluates to
/// `Result<(), StoreError>`: `Ok(())` without committing when the schema is already current,
/// the [`newer_schema`] error for a database written by a newer build.
macro_rules! migrate_in {
    ($tx:ident) => {{
        use $crate::jobs::sql;
        sqlx::query(sql::CREATE_SCHEMA_TABLE)
            .execute(&mut *$tx)
            .await?;
        let found: Option<i64> = sqlx::query_scalar(sql::SELECT_SCHEMA_VERSION)
            .fetch_optional(&mut *$tx)
            .await?;
        let from = found.unwrap_or(0);
        if from > sql::SCHEMA_VERSION {
            Err(sql::newer_schema(from))
        } else if from == sql::SCHEMA_VERSION {
            Ok(())
        } else {
            for step in &sql::MIGRATIONS[from as usize..] {
                sqlx::raw_sql(step).execute(&mut *$tx).await?;
            }
            let set = if found.is_some() {
                sql::UPDATE_SCHEMA_VERSION
            } else {
                sql::INSERT_SCHEMA_VERSION
            };
            sqlx::query(set)
                .bind(sql::SCHEMA_VERSION)
                .execute(&mut *$tx)
                .await?;
            $tx.commit().await?;
            Ok(())
        }
    }};
}
pub(crate) use migrate_in;

/// The steps of a claim both stores share, inside the transaction `$tx` the store has begun:
/// `$select` (the [`Claim`] `$kind`'s select, as the store runs it) finds the job at `$now`,
/// the claim's update takes it for `$owner` until `$now + $lease`, committed. Evaluates to
/// `Option<JobRecord>`: the job taken, or `None` (nothing committed) when there is none.
macro_rules! claim_in {
    ($tx:ident, $kind:expr, $select:expr, $owner:expr, $now:expr, $lease:expr) => {{
        use $crate::jobs::sql;
        let id: Option<String> = sqlx::query_scalar($select)
            .bind($now)
            .fetch_optional(&mut *$tx)
            .await?;
        match id {
            None => None,
            Some(id) => {
                let row = sqlx::query($kind.update())
                    .bind($now)
                    .bind($owner)
                    .bind(sql::until($now, $lease))
                    .bind(id)
                    .fetch_one(&mut *$tx)
                    .await?;
                let job = sql::record(&row)?;
                $tx.commit().await?;
                Some(job)
            }
        }
    }};
}
pub(crate) use claim_in;

/// The steps of an insert both stores share, inside the transaction `$tx` the store has begun
/// (and locked so that no other insert runs meanwhile): the queued jobs counted against
/// `$max_queued` (returning [`StoreError::TooManyQueued`] from the enclosing function when
/// that many are queued), the job `$job` (a `&NewJob`, its `$spec` and `$metadata` from
/// [`json_columns`]) added, committed. Evaluates to the new job's record.
macro_rules! insert_in {
    ($tx:ident, $job:expr, $spec:expr, $metadata:expr, $max_queued:expr) => {{
        use $crate::jobs::sql;
        let job: &$crate::jobs::NewJob = $job;
        let queued: i64 = sqlx::query_scalar(sql::COUNT_QUEUED)
            .fetch_one(&mut *$tx)
            .await?;
        if queued >= sql::big($max_queued) {
            return Err($crate::jobs::store::StoreError::TooManyQueued(
                queued as u64,
            ));
        }
        let row = sqlx::query(sql::INSERT)
            .bind(&job.id)
            .bind(job.created_at)
            .bind($metadata)
            .bind($spec)
            .bind(sql::big(job.bytes))
            .bind(job.webhook_url.as_deref())
            .fetch_one(&mut *$tx)
            .await?;
        let job = sql::record(&row)?;
        $tx.commit().await?;
        job
    }};
}
pub(crate) use insert_in;

/// `#[async_trait] impl JobStore for $store`, `$store` having a `pool` field (a
/// `sqlx::Pool` of its database) and an inherent `claim_one(kind, owner, now, lease)` (the
/// claim in one transaction, as its database locks it): the methods given (those the store
/// does its own way: `insert`, `cancel`), then every other method, the same statements on
/// `self.pool` for both databases. (One macro around the whole impl, so that
/// `#[async_trait]` sees every method.)
macro_rules! job_store {
    ($store:ty { $($specific:tt)* }) => {
        #[async_trait::async_trait]
        impl $crate::jobs::store::JobStore for $store {
            $($specific)*

            async fn get(
                &self,
                id: &str,
            ) -> Result<Option<$crate::jobs::JobRecord>, $crate::jobs::store::StoreError> {
                let row = sqlx::query($crate::jobs::sql::GET)
                    .bind(id)
                    .fetch_optional(&self.pool)
                    .await?;
                row.as_ref().map($crate::jobs::sql::record).transpose()
            }

            async fn list(
                &self,
                status: Option<$crate::jobs::JobStatus>,
                limit: usize,
                after: Option<&str>,
            ) -> Result<
                (Vec<$crate::jobs::JobRecord>, Option<String>),
                $crate::jobs::store::StoreError,
            > {
                use $crate::jobs::sql;
                if limit == 0 {
                    return Ok((Vec::new(), None));
                }
                let rows = sqlx::query(sql::LIST)
                    .bind(status.map($crate::jobs::JobStatus::as_str))
                    .bind(after)
                    .bind(sql::big(limit as u64).saturating_add(1))
                    .fetch_all(&self.pool)
                    .await?;
                let jobs = rows.iter().map(sql::record).collect::<Result<Vec<_>, _>>()?;
                Ok(sql::page(jobs, limit))
            }

            async fn claim(
                &self,
                owner: &str,
                now: $crate::jobs::Millis,
                lease: std::time::Duration,
            ) -> Result<Option<$crate::jobs::JobRecord>, $crate::jobs::store::StoreError> {
                self.claim_one($crate::jobs::sql::Claim::Run, owner, now, lease)
                    .await
            }

            async fn renew(
                &self,
                id: &str,
                owner: &str,
                now: $crate::jobs::Millis,
                lease: std::time::Duration,
                frames_done: u64,
                frames_total: u64,
            ) -> Result<bool, $crate::jobs::store::StoreError> {
                use $crate::jobs::sql;
                let done = sqlx::query(sql::RENEW)
                    .bind(sql::until(now, lease))
                    .bind(sql::big(frames_done))
                    .bind(sql::big(frames_total))
                    .bind(id)
                    .bind(owner)
                    .execute(&self.pool)
                    .await?;
                Ok(done.rows_affected() == 1)
            }

            async fn release(
                &self,
                id: &str,
                owner: &str,
            ) -> Result<bool, $crate::jobs::store::StoreError> {
                let done = sqlx::query($crate::jobs::sql::RELEASE)
                    .bind(id)
                    .bind(owner)
                    .execute(&self.pool)
                    .await?;
                Ok(done.rows_affected() == 1)
            }

            async fn finish(
                &self,
                id: &str,
                owner: &str,
                now: $crate::jobs::Millis,
                outcome: $crate::jobs::store::Outcome,
                bytes: u64,
            ) -> Result<bool, $crate::jobs::store::StoreError> {
                use $crate::jobs::sql;
                let (status, error, event) = sql::outcome_values(&outcome);
                let done = sqlx::query(sql::FINISH)
                    .bind(status.as_str())
                    .bind(now)
                    .bind(error)
                    .bind(sql::big(bytes))
                    .bind(event)
                    .bind(id)
                    .bind(owner)
                    .execute(&self.pool)
                    .await?;
                Ok(done.rows_affected() == 1)
            }

            async fn delete(&self, id: &str) -> Result<bool, $crate::jobs::store::StoreError> {
                let done = sqlx::query($crate::jobs::sql::DELETE)
                    .bind(id)
                    .execute(&self.pool)
                    .await?;
                Ok(done.rows_affected() == 1)
            }

            async fn claim_webhook(
                &self,
                owner: &str,
                now: $crate::jobs::Millis,
                lease: std::time::Duration,
            ) -> Result<Option<$crate::jobs::JobRecord>, $crate::jobs::store::StoreError> {
                self.claim_one($crate::jobs::sql::Claim::Webhook, owner, now, lease)
                    .await
            }

            async fn record_webhook(
                &self,
                id: &str,
                owner: &str,
                last_status: &str,
                next_at: Option<$crate::jobs::Millis>,
            ) -> Result<(), $crate::jobs::store::StoreError> {
                sqlx::query($crate::jobs::sql::RECORD_WEBHOOK)
                    .bind(last_status)
                    .bind(next_at)
                    .bind(id)
                    .bind(owner)
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }

            async fn ended_before(
                &self,
                before: $crate::jobs::Millis,
            ) -> Result<Vec<String>, $crate::jobs::store::StoreError> {
                Ok(sqlx::query_scalar($crate::jobs::sql::ENDED_BEFORE)
                    .bind(before)
                    .fetch_all(&self.pool)
                    .await?)
            }

            async fn counts(
                &self,
            ) -> Result<
                std::collections::HashMap<$crate::jobs::JobStatus, u64>,
                $crate::jobs::store::StoreError,
            > {
                use sqlx::Row as _;
                let rows = sqlx::query($crate::jobs::sql::COUNTS)
                    .fetch_all(&self.pool)
                    .await?;
                let mut counts = $crate::jobs::sql::zero_counts();
                for row in rows {
                    let status: String = row.try_get(0)?;
                    let n: i64 = row.try_get(1)?;
                    if let Some(s) = $crate::jobs::JobStatus::parse(&status) {
                        counts.insert(s, n.max(0) as u64);
                    }
                }
                Ok(counts)
            }

            async fn total_bytes(&self) -> Result<u64, $crate::jobs::store::StoreError> {
                let total: i64 = sqlx::query_scalar($crate::jobs::sql::TOTAL_BYTES)
                    .fetch_one(&self.pool)
                    .await?;
                Ok(total.max(0) as u64)
            }
        }
    };
}
pub(crate) use job_store;
