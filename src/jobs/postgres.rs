//! The shared job store: PostgreSQL (`--jobs-db postgres://…`), one queue for every replica.
//!
//! A job is claimed inside a transaction by `SELECT … FOR UPDATE SKIP LOCKED`: a replica
//! skips the rows another one is taking, so two never claim the same job and none waits on
//! another. A claim is a lease (`lease_owner`, `lease_until`): a running job whose lease has
//! expired (its replica died) is claimable again. Webhook deliveries are claimed the same way
//! with columns of their own (`webhook_owner`, `webhook_until`), so a delivery never waits
//! for a run's lease nor a run for a delivery. Inserts take an advisory lock so that the
//! `--max-queued-jobs` check holds across replicas.
//!
//! The schema is created (or migrated) on open under an advisory lock, so replicas starting
//! together do it once. Connections are plain TCP or a Unix socket (`?host=/path`): TLS is
//! not built in.

use std::collections::HashMap;
use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::Row;

use super::sql::{self, big, record, until};
use super::store::{JobStore, Outcome, StoreError};
use super::{JobRecord, JobStatus, Millis, NewJob};

/// Connections per store (per replica).
const MAX_CONNECTIONS: u32 = 8;

/// How long a call waits for a free connection, and an open for the server.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(30);

/// Advisory lock keys (`pg_advisory_xact_lock`): one taken while the schema is created or
/// migrated, one while a job is inserted (the queued count checked, then the row added).
const SCHEMA_LOCK: i64 = 0x6c69_7073_796e_6301; // "lipsync" 01
const INSERT_LOCK: i64 = 0x6c69_7073_796e_6302; // "lipsync" 02

/// The PostgreSQL job store (see the module documentation).
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
}

impl PgStore {
    /// Connects to `url` (`postgres://…` or `postgresql://…`) and brings the schema to this
    /// build's version. Fails on a database written by a newer build. Errors never repeat the
    /// URL (it may hold a password).
    pub async fn open(url: &str) -> Result<PgStore, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect(url)
            .await
            .map_err(|e| StoreError::Db(format!("connecting to PostgreSQL: {e}")))?;
        let store = PgStore { pool };
        store
            .migrate()
            .await
            .map_err(|e| StoreError::Db(format!("PostgreSQL schema: {e}")))?;
        Ok(store)
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(SCHEMA_LOCK)
            .execute(&mut *tx)
            .await?;
        sqlx::query(sql::CREATE_SCHEMA_TABLE)
            .execute(&mut *tx)
            .await?;
        let found: Option<i64> = sqlx::query_scalar(sql::SELECT_SCHEMA_VERSION)
            .fetch_optional(&mut *tx)
            .await?;
        let from = found.unwrap_or(0);
        if from > sql::SCHEMA_VERSION {
            return Err(sql::newer_schema(from));
        }
        if from == sql::SCHEMA_VERSION {
            return Ok(());
        }
        for step in &sql::MIGRATIONS[from as usize..] {
            sqlx::raw_sql(step).execute(&mut *tx).await?;
        }
        let set = if found.is_some() {
            sql::UPDATE_SCHEMA_VERSION
        } else {
            sql::INSERT_SCHEMA_VERSION
        };
        sqlx::query(set)
            .bind(sql::SCHEMA_VERSION)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Takes the job a claim's select finds for `owner` until `now + lease`: the select locks
    /// the row and skips those other replicas hold, the update takes it, one transaction.
    async fn claim_one(
        &self,
        kind: sql::Claim,
        owner: &str,
        now: Millis,
        lease: Duration,
    ) -> Result<Option<JobRecord>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let select = format!("{} FOR UPDATE SKIP LOCKED", kind.select());
        let id: Option<String> = sqlx::query_scalar(&select)
            .bind(now)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(id) = id else {
            return Ok(None);
        };
        let row = sqlx::query(kind.update())
            .bind(now)
            .bind(owner)
            .bind(until(now, lease))
            .bind(id)
            .fetch_one(&mut *tx)
            .await?;
        let job = record(&row)?;
        tx.commit().await?;
        Ok(Some(job))
    }
}

#[async_trait::async_trait]
impl JobStore for PgStore {
    async fn insert(&self, job: &NewJob, max_queued: u64) -> Result<JobRecord, StoreError> {
        let (spec, metadata) = sql::json_columns(&job.spec, job.metadata.as_ref())?;
        let mut tx = self.pool.begin().await?;
        // Inserts are the only way the queued count grows: one at a time, every replica.
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(INSERT_LOCK)
            .execute(&mut *tx)
            .await?;
        let queued: i64 = sqlx::query_scalar(sql::COUNT_QUEUED)
            .fetch_one(&mut *tx)
            .await?;
        if queued >= big(max_queued) {
            return Err(StoreError::TooManyQueued(queued as u64));
        }
        let row = sqlx::query(sql::INSERT)
            .bind(&job.id)
            .bind(job.created_at)
            .bind(metadata)
            .bind(spec)
            .bind(big(job.bytes))
            .bind(job.webhook_url.as_deref())
            .fetch_one(&mut *tx)
            .await?;
        let job = record(&row)?;
        tx.commit().await?;
        Ok(job)
    }

    async fn get(&self, id: &str) -> Result<Option<JobRecord>, StoreError> {
        let row = sqlx::query(sql::GET)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(record).transpose()
    }

    async fn list(
        &self,
        status: Option<JobStatus>,
        limit: usize,
        after: Option<&str>,
    ) -> Result<(Vec<JobRecord>, Option<String>), StoreError> {
        if limit == 0 {
            return Ok((Vec::new(), None));
        }
        let rows = sqlx::query(sql::LIST)
            .bind(status.map(JobStatus::as_str))
            .bind(after)
            .bind(big(limit as u64).saturating_add(1))
            .fetch_all(&self.pool)
            .await?;
        let jobs = rows.iter().map(record).collect::<Result<Vec<_>, _>>()?;
        Ok(sql::page(jobs, limit))
    }

    async fn claim(
        &self,
        owner: &str,
        now: Millis,
        lease: Duration,
    ) -> Result<Option<JobRecord>, StoreError> {
        self.claim_one(sql::Claim::Run, owner, now, lease).await
    }

    async fn renew(
        &self,
        id: &str,
        owner: &str,
        now: Millis,
        lease: Duration,
        frames_done: u64,
        frames_total: u64,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(sql::RENEW)
            .bind(until(now, lease))
            .bind(big(frames_done))
            .bind(big(frames_total))
            .bind(id)
            .bind(owner)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release(&self, id: &str, owner: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(sql::RELEASE)
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
        now: Millis,
        outcome: Outcome,
        bytes: u64,
    ) -> Result<bool, StoreError> {
        let (status, error, event) = sql::outcome_values(&outcome);
        let done = sqlx::query(sql::FINISH)
            .bind(status.as_str())
            .bind(now)
            .bind(error)
            .bind(big(bytes))
            .bind(event)
            .bind(id)
            .bind(owner)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn cancel(&self, id: &str, now: Millis) -> Result<Option<JobRecord>, StoreError> {
        let row = sqlx::query(sql::CANCEL)
            .bind(now)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        match row {
            Some(row) => Ok(Some(record(&row)?)),
            // Unknown, or it had already ended: as it is.
            None => self.get(id).await,
        }
    }

    async fn delete(&self, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(sql::DELETE)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn claim_webhook(
        &self,
        owner: &str,
        now: Millis,
        lease: Duration,
    ) -> Result<Option<JobRecord>, StoreError> {
        self.claim_one(sql::Claim::Webhook, owner, now, lease).await
    }

    async fn record_webhook(
        &self,
        id: &str,
        owner: &str,
        last_status: &str,
        next_at: Option<Millis>,
    ) -> Result<(), StoreError> {
        sqlx::query(sql::RECORD_WEBHOOK)
            .bind(last_status)
            .bind(next_at)
            .bind(id)
            .bind(owner)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn ended_before(&self, before: Millis) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar(sql::ENDED_BEFORE)
            .bind(before)
            .fetch_all(&self.pool)
            .await?)
    }

    async fn counts(&self) -> Result<HashMap<JobStatus, u64>, StoreError> {
        let rows = sqlx::query(sql::COUNTS).fetch_all(&self.pool).await?;
        let mut counts = sql::zero_counts();
        for row in rows {
            let status: String = row.try_get(0)?;
            let n: i64 = row.try_get(1)?;
            if let Some(s) = JobStatus::parse(&status) {
                counts.insert(s, n.max(0) as u64);
            }
        }
        Ok(counts)
    }

    async fn total_bytes(&self) -> Result<u64, StoreError> {
        let total: i64 = sqlx::query_scalar(sql::TOTAL_BYTES)
            .fetch_one(&self.pool)
            .await?;
        Ok(total.max(0) as u64)
    }
}
