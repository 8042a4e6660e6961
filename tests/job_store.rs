//! The job store's contract (`lipsync::jobs::store::JobStore`), one body per behaviour run
//! against both stores: SQLite in a temporary directory, and PostgreSQL in a throwaway
//! cluster (`common::pg`, a fresh database per test). The PostgreSQL tests fail, never skip,
//! when PostgreSQL is not installed.

mod common;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::pg;
use lipsync::jobs::store::{self, JobStore, Outcome, StoreError};
use lipsync::jobs::{new_job_id, JobSpec, JobStatus, Millis, NewJob};

const T0: Millis = 1_700_000_000_000;
const LEASE: Duration = Duration::from_secs(10);
const MAX: u64 = 1000;

#[derive(Debug, Clone, Copy)]
enum Backend {
    Sqlite,
    Postgres,
}

/// Where one test's store lives: a directory for SQLite, a database for PostgreSQL.
struct Db {
    dir: tempfile::TempDir,
    url: Option<String>,
}

impl Db {
    fn new(backend: Backend) -> Db {
        let dir = tempfile::tempdir().unwrap();
        let url = match backend {
            Backend::Sqlite => None,
            Backend::Postgres => Some(pg::shared().fresh_db("jobs")),
        };
        Db { dir, url }
    }

    /// A store on this database: every call opens another (a "replica" for PostgreSQL).
    async fn open(&self) -> Arc<dyn JobStore> {
        self.try_open().await.unwrap()
    }

    async fn try_open(&self) -> Result<Arc<dyn JobStore>, StoreError> {
        store::open(self.url.as_deref(), &self.data_dir()).await
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Runs one statement on the database behind the store's back.
    async fn exec(&self, statement: &str) {
        match &self.url {
            Some(url) => {
                let db = url.split('/').nth(3).unwrap().split('?').next().unwrap();
                let out = pg::shared().psql(db, statement);
                assert!(out.status.success(), "{out:?}");
            }
            None => {
                use sqlx::Connection;
                let path = self.data_dir().join("jobs.db");
                let mut conn =
                    sqlx::SqliteConnection::connect(&format!("sqlite:{}", path.display()))
                        .await
                        .unwrap();
                sqlx::raw_sql(statement).execute(&mut conn).await.unwrap();
                conn.close().await.unwrap();
            }
        }
    }
}

fn spec(n: u32) -> JobSpec {
    let mut spec = JobSpec {
        avatar_file: "avatar.png".into(),
        avatar_kind: "image".into(),
        speech_file: "speech.wav".into(),
        fields: Default::default(),
    };
    spec.fields.insert("fps".into(), "25".into());
    spec.fields.insert("n".into(), n.to_string());
    spec
}

/// A job created at `T0 + n` seconds, with a webhook or not.
fn new_job(n: u32, webhook: bool) -> NewJob {
    let created_at = T0 + i64::from(n) * 1000;
    NewJob {
        id: new_job_id(created_at),
        created_at,
        metadata: Some(serde_json::json!({"z": n, "a": "first key given last"})),
        spec: spec(n),
        webhook_url: webhook.then(|| format!("https://example.test/hook/{n}")),
        bytes: 100 + u64::from(n),
    }
}

/// Inserts jobs 1..=n (no webhook), oldest first; returns their ids.
async fn insert_n(s: &dyn JobStore, n: u32) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 1..=n {
        ids.push(s.insert(&new_job(i, false), MAX).await.unwrap().id);
    }
    ids
}

fn ids(jobs: &[lipsync::jobs::JobRecord]) -> Vec<String> {
    jobs.iter().map(|j| j.id.clone()).collect()
}

async fn insert_get_list(b: Backend) {
    let db = Db::new(b);
    let s = db.open().await;
    let job = new_job(1, true);
    let kept = s.insert(&job, MAX).await.unwrap();
    let got = s.get(&job.id).await.unwrap().unwrap();
    assert_eq!(kept, got);
    assert_eq!(got.status, JobStatus::Queued);
    assert_eq!(got.created_at, job.created_at);
    assert_eq!(got.spec, job.spec);
    assert_eq!(got.metadata, job.metadata);
    // Kept as given, key order included.
    assert_eq!(
        serde_json::to_string(got.metadata.as_ref().unwrap()).unwrap(),
        serde_json::to_string(job.metadata.as_ref().unwrap()).unwrap()
    );
    assert_eq!(got.bytes, 101);
    assert_eq!((got.runs, got.frames_done, got.frames_total), (0, 0, 0));
    assert_eq!(
        (got.started_at, got.finished_at, got.error.clone()),
        (None, None, None)
    );
    assert_eq!((got.lease_owner.clone(), got.lease_until), (None, None));
    let hook = got.webhook.unwrap();
    assert_eq!(hook.url, "https://example.test/hook/1");
    assert_eq!((hook.attempts, hook.next_at), (0, None));
    assert_eq!((hook.last_status, hook.pending_event), (None, None));
    assert!(s.get(&new_job_id(T0)).await.unwrap().is_none());
    assert!(s
        .insert(&job, MAX)
        .await
        .is_err_and(|e| matches!(e, StoreError::Db(_))));

    let mut all = vec![job.id.clone()];
    for i in 2..=5 {
        all.push(s.insert(&new_job(i, false), MAX).await.unwrap().id);
    }
    all.reverse(); // newest first
    let (jobs, next) = s.list(None, 10, None).await.unwrap();
    assert_eq!((ids(&jobs), next), (all.clone(), None));

    // Pages of 2: [5 4] [3 2] [1]; a last full page says there is no next one.
    let (p1, n1) = s.list(None, 2, None).await.unwrap();
    assert_eq!(
        (ids(&p1), n1.clone()),
        (all[0..2].to_vec(), Some(all[1].clone()))
    );
    let (p2, n2) = s.list(None, 2, n1.as_deref()).await.unwrap();
    assert_eq!(
        (ids(&p2), n2.clone()),
        (all[2..4].to_vec(), Some(all[3].clone()))
    );
    let (p3, n3) = s.list(None, 2, n2.as_deref()).await.unwrap();
    assert_eq!((ids(&p3), n3), (all[4..].to_vec(), None));
    let (p, n) = s.list(None, 5, None).await.unwrap();
    assert_eq!((p.len(), n), (5, None));
    let (p, n) = s.list(None, 0, None).await.unwrap();
    assert_eq!((p.len(), n), (0, None));

    // Status filter: job 1 (the oldest) runs.
    let claimed = s.claim("w", T0, LEASE).await.unwrap().unwrap();
    assert_eq!(claimed.id, all[4]);
    let (running, _) = s.list(Some(JobStatus::Running), 10, None).await.unwrap();
    assert_eq!(ids(&running), vec![all[4].clone()]);
    let (queued, next) = s.list(Some(JobStatus::Queued), 3, None).await.unwrap();
    assert_eq!(
        (ids(&queued), next.clone()),
        (all[0..3].to_vec(), Some(all[2].clone()))
    );
    let (queued, next) = s
        .list(Some(JobStatus::Queued), 3, next.as_deref())
        .await
        .unwrap();
    assert_eq!((ids(&queued), next), (vec![all[3].clone()], None));
    let (failed, next) = s.list(Some(JobStatus::Failed), 10, None).await.unwrap();
    assert!(failed.is_empty() && next.is_none());
}

async fn max_queued_refused(b: Backend) {
    let db = Db::new(b);
    let s = db.open().await;
    s.insert(&new_job(1, false), 2).await.unwrap();
    s.insert(&new_job(2, false), 2).await.unwrap();
    let third = new_job(3, false);
    match s.insert(&third, 2).await {
        Err(StoreError::TooManyQueued(2)) => {}
        other => panic!("expected TooManyQueued(2), got {other:?}"),
    }
    assert!(s.get(&third.id).await.unwrap().is_none());
    assert!(matches!(
        s.insert(&third, 0).await,
        Err(StoreError::TooManyQueued(2))
    ));
    // A running job is not queued any more.
    s.claim("w", T0, LEASE).await.unwrap().unwrap();
    s.insert(&third, 2).await.unwrap();
    assert!(matches!(
        s.insert(&new_job(4, false), 2).await,
        Err(StoreError::TooManyQueued(2))
    ));
}

async fn claim_order_and_lease_expiry(b: Backend) {
    let db = Db::new(b);
    let s = db.open().await;
    // Inserted out of creation order: the claim goes by creation.
    let c = s.insert(&new_job(3, false), MAX).await.unwrap().id;
    let a = s.insert(&new_job(1, false), MAX).await.unwrap().id;
    let bb = s.insert(&new_job(2, false), MAX).await.unwrap().id;

    let ja = s.claim("w1", T0, LEASE).await.unwrap().unwrap();
    assert_eq!(ja.id, a);
    assert_eq!(ja.status, JobStatus::Running);
    assert_eq!((ja.runs, ja.started_at), (1, Some(T0)));
    assert_eq!(ja.lease_owner.as_deref(), Some("w1"));
    assert_eq!(ja.lease_until, Some(T0 + 10_000));
    assert_eq!(s.get(&a).await.unwrap().unwrap(), ja);
    let jb = s.claim("w2", T0, LEASE).await.unwrap().unwrap();
    assert_eq!(jb.id, bb);

    // w1 reports progress; w2 renews later, so only a's lease runs out at T0 + 10 s.
    assert!(s.renew(&a, "w1", T0 + 1000, LEASE, 5, 10).await.unwrap());
    let ra = s.get(&a).await.unwrap().unwrap();
    assert_eq!((ra.frames_done, ra.frames_total), (5, 10));
    assert_eq!(ra.lease_until, Some(T0 + 11_000));
    assert!(s.renew(&bb, "w2", T0 + 5000, LEASE, 1, 4).await.unwrap());
    // Not a's owner.
    assert!(!s.renew(&a, "w2", T0 + 5000, LEASE, 9, 10).await.unwrap());

    // Before the lease runs out the queued c comes next; a is not claimable yet.
    let jc = s.claim("w3", T0 + 10_999, LEASE).await.unwrap().unwrap();
    assert_eq!(jc.id, c);
    assert!(s.claim("w3", T0 + 10_999, LEASE).await.unwrap().is_none());

    // a's lease has run out (w1 died): claimed again, a second run from 0.
    let again = s.claim("w4", T0 + 11_000, LEASE).await.unwrap().unwrap();
    assert_eq!(again.id, a);
    assert_eq!(again.runs, 2);
    assert_eq!(again.started_at, Some(T0 + 11_000));
    assert_eq!((again.frames_done, again.frames_total), (0, 10));
    assert_eq!(again.lease_owner.as_deref(), Some("w4"));
    assert!(s.claim("w4", T0 + 11_000, LEASE).await.unwrap().is_none());
    // The old owner is told to stop; the new one goes on.
    assert!(!s.renew(&a, "w1", T0 + 11_001, LEASE, 6, 10).await.unwrap());
    assert!(!s
        .finish(&a, "w1", T0 + 11_001, Outcome::Succeeded, 1)
        .await
        .unwrap());
    assert!(s.renew(&a, "w4", T0 + 11_001, LEASE, 1, 10).await.unwrap());
    assert!(s
        .finish(&a, "w4", T0 + 12_000, Outcome::Succeeded, 500)
        .await
        .unwrap());
    // A finished job is not claimable, whatever the time.
    assert!(s.claim("w5", T0 + 14_999, LEASE).await.unwrap().is_none());
    assert_eq!(
        s.claim("w5", T0 + 15_000, LEASE).await.unwrap().unwrap().id,
        bb
    );
}

async fn renew_after_cancel_or_delete(b: Backend) {
    let db = Db::new(b);
    let s = db.open().await;
    let [a, c] = insert_n(&*s, 2).await.try_into().unwrap();
    s.claim("w", T0, LEASE).await.unwrap().unwrap();
    s.claim("w", T0, LEASE).await.unwrap().unwrap();
    let cancelled = s.cancel(&a, T0 + 1).await.unwrap().unwrap();
    assert_eq!(cancelled.status, JobStatus::Cancelled);
    assert!(!s.renew(&a, "w", T0 + 2, LEASE, 1, 2).await.unwrap());
    assert!(!s
        .finish(&a, "w", T0 + 2, Outcome::Succeeded, 1)
        .await
        .unwrap());
    assert_eq!(s.get(&a).await.unwrap().unwrap(), cancelled);
    assert!(s.delete(&c).await.unwrap());
    assert!(!s.renew(&c, "w", T0 + 2, LEASE, 1, 2).await.unwrap());
    assert!(!s
        .finish(&c, "w", T0 + 2, Outcome::Succeeded, 1)
        .await
        .unwrap());
    // A queued job has no owner to renew.
    let q = s.insert(&new_job(3, false), MAX).await.unwrap().id;
    assert!(!s.renew(&q, "w", T0 + 2, LEASE, 1, 2).await.unwrap());
}

async fn release_requeues_at_once(b: Backend) {
    let db = Db::new(b);
    let s = db.open().await;
    let [a] = insert_n(&*s, 1).await.try_into().unwrap();
    s.claim("w1", T0, LEASE).await.unwrap().unwrap();
    assert!(s.renew(&a, "w1", T0 + 1, LEASE, 3, 10).await.unwrap());
    // Only the owner gives it back.
    assert!(!s.release(&a, "w2").await.unwrap());
    assert!(s.release(&a, "w1").await.unwrap());
    let j = s.get(&a).await.unwrap().unwrap();
    assert_eq!(j.status, JobStatus::Queued);
    assert_eq!((j.frames_done, j.lease_owner.clone()), (0, None));
    assert!(!s.renew(&a, "w1", T0 + 2, LEASE, 4, 10).await.unwrap());
    // Claimable at once, well before the old lease would have run out; the stopped run counts.
    let again = s.claim("w2", T0 + 2, LEASE).await.unwrap().unwrap();
    assert_eq!((again.id.as_str(), again.runs), (a.as_str(), 2));
    assert!(!s.release(&a, "w1").await.unwrap());
}

async fn finish_sets_webhook_when_url(b: Backend) {
    let db = Db::new(b);
    let s = db.open().await;
    let with = s.insert(&new_job(1, true), MAX).await.unwrap().id;
    let without = s.insert(&new_job(2, false), MAX).await.unwrap().id;
    let failing = s.insert(&new_job(3, true), MAX).await.unwrap().id;
    for _ in 0..3 {
        s.claim("w", T0, LEASE).await.unwrap().unwrap();
    }
    assert!(s.renew(&with, "w", T0 + 1, LEASE, 7, 10).await.unwrap());
    assert!(s.renew(&without, "w", T0 + 1, LEASE, 3, 10).await.unwrap());

    assert!(s
        .finish(&with, "w", T0 + 5000, Outcome::Succeeded, 4242)
        .await
        .unwrap());
    let j = s.get(&with).await.unwrap().unwrap();
    assert_eq!(j.status, JobStatus::Succeeded);
    assert_eq!((j.frames_done, j.frames_total), (10, 10));
    assert_eq!(
        (j.finished_at, j.bytes, j.error.clone()),
        (Some(T0 + 5000), 4242, None)
    );
    assert_eq!((j.lease_owner, j.lease_until), (None, None));
    let hook = j.webhook.unwrap();
    assert_eq!(hook.pending_event.as_deref(), Some("job.succeeded"));
    assert_eq!((hook.next_at, hook.attempts), (Some(T0 + 5000), 0));
    // Finished once.
    assert!(!s
        .finish(&with, "w", T0 + 6000, Outcome::Failed("late".into()), 1)
        .await
        .unwrap());

    assert!(s
        .finish(&without, "w", T0 + 5000, Outcome::Succeeded, 7)
        .await
        .unwrap());
    let j = s.get(&without).await.unwrap().unwrap();
    assert_eq!((j.status, j.webhook.clone()), (JobStatus::Succeeded, None));

    assert!(s
        .finish(
            &failing,
            "w",
            T0 + 6000,
            Outcome::Failed("no face found".into()),
            9
        )
        .await
        .unwrap());
    let j = s.get(&failing).await.unwrap().unwrap();
    assert_eq!(j.status, JobStatus::Failed);
    assert_eq!(j.error.as_deref(), Some("no face found"));
    assert_eq!((j.frames_done, j.bytes), (0, 9));
    let hook = j.webhook.unwrap();
    assert_eq!(hook.pending_event.as_deref(), Some("job.failed"));
    assert_eq!(hook.next_at, Some(T0 + 6000));
}

async fn cancel_each_status(b: Backend) {
    let db = Db::new(b);
    let s = db.open().await;
    let running = s.insert(&new_job(1, true), MAX).await.unwrap().id;
    let done = s.insert(&new_job(2, true), MAX).await.unwrap().id;
    let queued = s.insert(&new_job(3, true), MAX).await.unwrap().id;
    let plain = s.insert(&new_job(4, false), MAX).await.unwrap().id;
    s.claim("w", T0, LEASE).await.unwrap().unwrap();
    s.claim("w", T0, LEASE).await.unwrap().unwrap();
    assert!(s
        .finish(&done, "w", T0 + 5, Outcome::Succeeded, 1)
        .await
        .unwrap());

    let j = s.cancel(&queued, T0 + 10).await.unwrap().unwrap();
    assert_eq!(
        (j.status, j.finished_at),
        (JobStatus::Cancelled, Some(T0 + 10))
    );
    let hook = j.webhook.clone().unwrap();
    assert_eq!(hook.pending_event.as_deref(), Some("job.cancelled"));
    assert_eq!(hook.next_at, Some(T0 + 10));
    assert_eq!(s.get(&queued).await.unwrap().unwrap(), j);

    let j = s.cancel(&running, T0 + 20).await.unwrap().unwrap();
    assert_eq!(
        (j.status, j.finished_at),
        (JobStatus::Cancelled, Some(T0 + 20))
    );
    assert_eq!((j.lease_owner, j.lease_until, j.runs), (None, None, 1));
    assert_eq!(
        j.webhook.unwrap().pending_event.as_deref(),
        Some("job.cancelled")
    );
    assert!(
        s.claim("w", T0 + 1_000_000, LEASE)
            .await
            .unwrap()
            .unwrap()
            .id
            == plain
    );

    // Ended already: unchanged, its webhook untouched.
    let before = s.get(&done).await.unwrap().unwrap();
    assert_eq!(s.cancel(&done, T0 + 30).await.unwrap().unwrap(), before);
    let cancelled = s.get(&queued).await.unwrap().unwrap();
    assert_eq!(
        s.cancel(&queued, T0 + 40).await.unwrap().unwrap(),
        cancelled
    );
    assert!(s.cancel(&new_job_id(T0), T0).await.unwrap().is_none());

    // Without a webhook nothing is pending.
    let plain2 = s.insert(&new_job(5, false), MAX).await.unwrap().id;
    let j = s.cancel(&plain2, T0 + 50).await.unwrap().unwrap();
    assert_eq!((j.status, j.webhook), (JobStatus::Cancelled, None));
}

async fn delete_removes(b: Backend) {
    let db = Db::new(b);
    let s = db.open().await;
    let [a, c] = insert_n(&*s, 2).await.try_into().unwrap();
    assert!(s.delete(&a).await.unwrap());
    assert!(s.get(&a).await.unwrap().is_none());
    assert!(!s.delete(&a).await.unwrap());
    let (jobs, _) = s.list(None, 10, None).await.unwrap();
    assert_eq!(ids(&jobs), vec![c]);
}

async fn webhook_claims_and_records(b: Backend) {
    let db = Db::new(b);
    let s = db.open().await;
    let id = s.insert(&new_job(1, true), MAX).await.unwrap().id;
    s.insert(&new_job(2, false), MAX).await.unwrap();
    // Nothing has ended: nothing is due.
    assert!(s.claim_webhook("o1", T0, LEASE).await.unwrap().is_none());
    for _ in 0..2 {
        let j = s.claim("w", T0, LEASE).await.unwrap().unwrap();
        assert!(s
            .finish(&j.id, "w", T0 + 100, Outcome::Succeeded, 1)
            .await
            .unwrap());
    }
    let t = T0 + 100;
    // Not due yet.
    assert!(s.claim_webhook("o1", t - 1, LEASE).await.unwrap().is_none());
    let j = s.claim_webhook("o1", t, LEASE).await.unwrap().unwrap();
    assert_eq!(j.id, id);
    assert_eq!(
        j.webhook.as_ref().unwrap().pending_event.as_deref(),
        Some("job.succeeded")
    );
    // Claimed: no other replica gets it while the claim holds.
    assert!(s.claim_webhook("o2", t + 1, LEASE).await.unwrap().is_none());
    // A failed attempt: retry at t + 1 s.
    s.record_webhook(&id, "o1", "500", Some(t + 1000))
        .await
        .unwrap();
    let hook = s.get(&id).await.unwrap().unwrap().webhook.unwrap();
    assert_eq!(
        (hook.attempts, hook.last_status.as_deref()),
        (1, Some("500"))
    );
    assert_eq!(hook.next_at, Some(t + 1000));
    assert_eq!(hook.pending_event.as_deref(), Some("job.succeeded"));
    assert!(s
        .claim_webhook("o2", t + 999, LEASE)
        .await
        .unwrap()
        .is_none());
    let j = s
        .claim_webhook("o2", t + 1000, LEASE)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(j.id, id);
    // o2 died mid-delivery: its claim runs out and o3 takes the delivery.
    assert!(s
        .claim_webhook("o3", t + 10_999, LEASE)
        .await
        .unwrap()
        .is_none());
    assert!(s
        .claim_webhook("o3", t + 11_000, LEASE)
        .await
        .unwrap()
        .is_some());
    // o2's late record is ignored: the claim is o3's now.
    s.record_webhook(&id, "o2", "timeout", Some(t + 20_000))
        .await
        .unwrap();
    let hook = s.get(&id).await.unwrap().unwrap().webhook.unwrap();
    assert_eq!(
        (hook.attempts, hook.last_status.as_deref()),
        (1, Some("500"))
    );
    // Delivered: nothing pending any more.
    s.record_webhook(&id, "o3", "200", None).await.unwrap();
    let hook = s.get(&id).await.unwrap().unwrap().webhook.unwrap();
    assert_eq!(
        (hook.attempts, hook.last_status.as_deref()),
        (2, Some("200"))
    );
    assert_eq!((hook.next_at, hook.pending_event), (None, None));
    assert!(s
        .claim_webhook("o1", t + 1_000_000, LEASE)
        .await
        .unwrap()
        .is_none());

    // Given up: the same (next_at none clears the pending event).
    let other = s.insert(&new_job(3, true), MAX).await.unwrap().id;
    s.cancel(&other, t).await.unwrap();
    let j = s.claim_webhook("o1", t, LEASE).await.unwrap().unwrap();
    assert_eq!(
        j.webhook.unwrap().pending_event.as_deref(),
        Some("job.cancelled")
    );
    s.record_webhook(&other, "o1", "connect", None)
        .await
        .unwrap();
    let hook = s.get(&other).await.unwrap().unwrap().webhook.unwrap();
    assert_eq!((hook.attempts, hook.pending_event), (1, None));
    assert!(s
        .claim_webhook("o1", t + 1_000_000, LEASE)
        .await
        .unwrap()
        .is_none());
}

async fn ended_before_lists_ended(b: Backend) {
    let db = Db::new(b);
    let s = db.open().await;
    let [a, c, d, e] = insert_n(&*s, 4).await.try_into().unwrap();
    s.claim("w", T0, LEASE).await.unwrap().unwrap(); // a
    s.claim("w", T0, LEASE).await.unwrap().unwrap(); // c
    assert!(s
        .finish(&a, "w", T0 + 1000, Outcome::Succeeded, 1)
        .await
        .unwrap());
    assert!(s
        .finish(&c, "w", T0 + 3000, Outcome::Failed("x".into()), 1)
        .await
        .unwrap());
    s.cancel(&d, T0 + 2000).await.unwrap();
    s.claim("w", T0, LEASE).await.unwrap().unwrap(); // e, running
    assert_eq!(
        s.ended_before(T0 + 1000).await.unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(s.ended_before(T0 + 1001).await.unwrap(), vec![a.clone()]);
    let mut ended = s.ended_before(T0 + 10_000).await.unwrap();
    ended.sort();
    let mut want = vec![a, c, d];
    want.sort();
    assert_eq!(ended, want);
    assert!(!s.ended_before(i64::MAX).await.unwrap().contains(&e));
}

async fn counts_and_total_bytes(b: Backend) {
    let db = Db::new(b);
    let s = db.open().await;
    let counts = s.counts().await.unwrap();
    assert_eq!(counts.len(), JobStatus::ALL.len());
    assert!(counts.values().all(|&n| n == 0));
    assert_eq!(s.total_bytes().await.unwrap(), 0);

    let all = insert_n(&*s, 5).await; // bytes 101..=105
    assert_eq!(s.total_bytes().await.unwrap(), 515);
    s.claim("w", T0, LEASE).await.unwrap().unwrap();
    s.claim("w", T0, LEASE).await.unwrap().unwrap();
    s.claim("w", T0, LEASE).await.unwrap().unwrap();
    assert!(s
        .finish(&all[0], "w", T0, Outcome::Succeeded, 10_101)
        .await
        .unwrap());
    assert!(s
        .finish(&all[1], "w", T0, Outcome::Failed("x".into()), 102)
        .await
        .unwrap());
    s.cancel(&all[3], T0).await.unwrap();
    let counts = s.counts().await.unwrap();
    for (status, n) in [
        (JobStatus::Queued, 1),
        (JobStatus::Running, 1),
        (JobStatus::Succeeded, 1),
        (JobStatus::Failed, 1),
        (JobStatus::Cancelled, 1),
    ] {
        assert_eq!(counts[&status], n, "{status:?}");
    }
    assert_eq!(s.total_bytes().await.unwrap(), 515 + 10_000);
    s.delete(&all[0]).await.unwrap();
    assert_eq!(s.total_bytes().await.unwrap(), 515 - 101);
    assert_eq!(s.counts().await.unwrap()[&JobStatus::Succeeded], 0);
}

/// Two stores on one database (two replicas for PostgreSQL), eight tasks claiming from 20
/// queued jobs at once: every job is claimed exactly once.
async fn concurrent_claims_once(b: Backend) {
    let db = Db::new(b);
    let stores = [db.open().await, db.open().await];
    let queued = insert_n(&*stores[0], 20).await;
    let mut tasks = Vec::new();
    for t in 0..8 {
        let s = stores[t % 2].clone();
        tasks.push(tokio::spawn(async move {
            let owner = format!("replica{}-worker{t}", t % 2);
            let mut got = Vec::new();
            while let Some(j) = s.claim(&owner, T0, LEASE).await.unwrap() {
                assert_eq!(
                    (j.runs, j.lease_owner.as_deref()),
                    (1, Some(owner.as_str()))
                );
                got.push(j.id);
                tokio::task::yield_now().await;
            }
            got
        }));
    }
    let mut claimed = Vec::new();
    for task in tasks {
        claimed.extend(task.await.unwrap());
    }
    let unique: HashSet<&String> = claimed.iter().collect();
    assert_eq!(claimed.len(), 20, "claims: {claimed:?}");
    assert_eq!(unique, queued.iter().collect::<HashSet<_>>());
    let counts = stores[1].counts().await.unwrap();
    assert_eq!(
        (counts[&JobStatus::Running], counts[&JobStatus::Queued]),
        (20, 0)
    );
}

/// Opening is idempotent (twice at once, then again) and keeps the data; a database from a
/// newer build is refused.
async fn reopen_and_schema_version(b: Backend) {
    let db = Db::new(b);
    let (s1, s2) = tokio::join!(db.try_open(), db.try_open());
    let (s1, s2) = (s1.unwrap(), s2.unwrap());
    let id = s1.insert(&new_job(1, false), MAX).await.unwrap().id;
    assert!(s2.get(&id).await.unwrap().is_some());
    drop((s1, s2));
    let s = db.open().await;
    assert_eq!(s.get(&id).await.unwrap().unwrap().status, JobStatus::Queued);
    drop(s);
    db.exec("UPDATE lipsync_schema SET version = 99").await;
    let err = db
        .try_open()
        .await
        .err()
        .expect("a newer schema is refused");
    assert!(err.to_string().contains("newer"), "{err}");
}

macro_rules! both_stores {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Backend::Sqlite).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Backend::Postgres).await
                }
            )*
        }
    };
}

both_stores!(
    insert_get_list,
    max_queued_refused,
    claim_order_and_lease_expiry,
    renew_after_cancel_or_delete,
    release_requeues_at_once,
    finish_sets_webhook_when_url,
    cancel_each_status,
    delete_removes,
    webhook_claims_and_records,
    ended_before_lists_ended,
    counts_and_total_bytes,
    concurrent_claims_once,
    reopen_and_schema_version,
);

#[tokio::test]
async fn open_refuses_other_urls() {
    let dir = tempfile::tempdir().unwrap();
    for url in ["mysql://u:secret@h/db", "sqlite:jobs.db", "jobs.db"] {
        let err = store::open(Some(url), dir.path())
            .await
            .err()
            .expect("refused");
        let msg = err.to_string();
        assert!(msg.contains("postgres://"), "{msg}");
        assert!(!msg.contains("secret"), "{msg}");
    }
    // None: SQLite under the data directory, created.
    let data = dir.path().join("data");
    store::open(None, &data).await.unwrap();
    assert!(data.join("jobs.db").exists());
}

#[tokio::test]
async fn postgres_unreachable_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "postgres://nobody@localhost/none?host={}",
        dir.path().display()
    );
    let err = store::open(Some(&url), dir.path())
        .await
        .err()
        .expect("no server");
    assert!(err.to_string().contains("PostgreSQL"), "{err}");
}
