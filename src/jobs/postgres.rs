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

use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};

use super::sql::{self, record};
use super::store::StoreError;
use super::{JobRecord, Millis, NewJob};

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
        sql::migrate_in!(tx)
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
        Ok(sql::claim_in!(tx, kind, &select, owner, now, lease))
    }
}

sql::job_store!(PgStore {
    async fn insert(&self, job: &NewJob, max_queued: u64) -> Result<JobRecord, StoreError> {
        let (spec, metadata) = sql::json_columns(&job.spec, job.metadata.as_ref())?;
        let mut tx = self.pool.begin().await?;
        // Inserts are the only way the queued count grows: one at a time, every replica.
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(INSERT_LOCK)
            .execute(&mut *tx)
            .await?;
        Ok(sql::insert_in!(tx, job, spec, metadata, max_queued))
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
});
