//! The embedded job store: SQLite in `<data dir>/jobs.db`, the default (nothing to install).
//!
//! Made for one process: a pool of one connection, so every call runs alone and each
//! multi-statement change is one `BEGIN IMMEDIATE` transaction. The file is in WAL mode with
//! `synchronous = FULL`, so a job accepted is on disk when `insert` returns; a second handle
//! on the same file (another store, the `sqlite3` shell) waits its turn through the busy
//! timeout rather than failing. Replicas that share one queue use PostgreSQL instead.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use super::sql::{self, record};
use super::store::StoreError;
use super::{JobRecord, Millis, NewJob};

/// The file name of the store under the data directory.
pub const FILE_NAME: &str = "jobs.db";

/// How long a call waits for the file while another handle writes it.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// SQLite's "database is locked" (SQLITE_BUSY, or one of its extended codes).
fn is_busy(e: &sqlx::Error) -> bool {
    const SQLITE_BUSY: i32 = 5;
    e.as_database_error()
        .and_then(|d| d.code()?.parse::<i32>().ok())
        .is_some_and(|code| code & 0xff == SQLITE_BUSY)
}

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
        // Turning a new file to WAL takes an exclusive lock that the busy timeout does not
        // wait for: a handle opening the file at the same moment (another process starting)
        // is told "database is locked" at once. Opening is retried until the busy timeout.
        let started = std::time::Instant::now();
        let pool = loop {
            let opened = SqlitePoolOptions::new()
                .max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_with(options.clone())
                .await;
            match opened {
                Err(e) if is_busy(&e) && started.elapsed() < BUSY_TIMEOUT => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                r => {
                    break r
                        .map_err(|e| StoreError::Db(format!("opening {}: {e}", path.display())))?
                }
            }
        };
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
        sql::migrate_in!(tx)
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
        Ok(sql::claim_in!(tx, kind, kind.select(), owner, now, lease))
    }
}

sql::job_store!(SqliteStore {
    async fn insert(&self, job: &NewJob, max_queued: u64) -> Result<JobRecord, StoreError> {
        let (spec, metadata) = sql::json_columns(&job.spec, job.metadata.as_ref())?;
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        Ok(sql::insert_in!(tx, job, spec, metadata, max_queued))
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
});

#[cfg(test)]
mod tests {
    use super::*;

    /// Two stores opening one new file at the same moment (two processes starting on one data
    /// directory): both open, neither is told the database is locked.
    #[tokio::test]
    async fn two_stores_opening_one_new_file_at_once_both_open() {
        let mut failed = Vec::new();
        for _ in 0..40 {
            let dir = tempfile::tempdir().unwrap();
            let (a, b) = tokio::join!(SqliteStore::open(dir.path()), SqliteStore::open(dir.path()));
            failed.extend(a.err());
            failed.extend(b.err());
        }
        assert!(failed.is_empty(), "{failed:?}");
    }
}
