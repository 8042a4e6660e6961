//! The embedded job store: SQLite in `<data dir>/jobs.db`, the default (nothing to install).
//!
//! Made for one process: a pool of one connection, so every call runs alone and each
//! multi-statement change is one `BEGIN IMMEDIATE` transaction. The file is in WAL mode with
//! `synchronous = FULL`, so a job accepted is on disk when `insert` returns; a second handle
//! on the same file (another store, the `sqlite3` shell) waits its turn through the busy
//! timeout rather than failing. Replicas that share one queue use PostgreSQL instead.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::Row;

use super::sql::{self, big, record, until};
use super::store::{JobStore, Outcome, StoreError};
use super::{JobRecord, JobStatus, Millis, NewJob};

/// The file name of the store under the data directory.
pub const FILE_NAME: &str = "jobs.db";

/// How long a call waits for the file while another handle writes it.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// The SQLite job store (see the module documentation).
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    path: PathBuf,
}

impl SqliteStore {
    /// Opens (creating it and `dir` when missing) `dir/jobs.db` and brings its schema to this
    /// build's version. Fails on a database written by a newer build.
    pub async fn open(dir: &Path) -> Result<SqliteStore, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError::Db(format!("creating {}: {e}", dir.display())))?;
        let path = dir.join(FILE_NAME);
        let options = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(BUSY_TIMEOUT);
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options)
            .await
            .map_err(|e| StoreError::Db(format!("opening {}: {e}", path.display())))?;
        let store = SqliteStore { pool, path };
        store
            .migrate()
            .await
            .map_err(|e| StoreError::Db(format!("{}: {e}", store.path.display())))?;
        Ok(store)
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
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

    /// Takes the job a claim's select finds for `owner` until `now + lease`, in one
    /// transaction.
    async fn claim_one(
        &self,
        kind: sql::Claim,
        owner: &str,
        now: Millis,
        lease: Duration,
    ) -> Result<Option<JobRecord>, StoreError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let id: Option<String> = sqlx::query_scalar(kind.select())
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
impl JobStore for SqliteStore {
    async fn insert(&self, job: &NewJob, max_queued: u64) -> Result<JobRecord, StoreError> {
        let (spec, metadata) = sql::json_columns(&job.spec, job.metadata.as_ref())?;
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
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
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut row = sqlx::query(sql::CANCEL)
            .bind(now)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        if row.is_none() {
            row = sqlx::query(sql::GET)
                .bind(id)
                .fetch_optional(&mut *tx)
                .await?;
        }
        let job = row.as_ref().map(record).transpose()?;
        tx.commit().await?;
        Ok(job)
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
