//! The batch jobs of one process: files under the data directory, the workers that claim and
//! render queued jobs, webhook delivery and expiry. Everything durable is in the store; what
//! this holds (cancel flags of the jobs rendering here) a restart may lose.
//!
//! A worker claims a job under a lease, renews it (with the progress) every third of the
//! lease while it renders on its own OS thread through [`pipeline`] in the background class,
//! and ends the run in the store. A job cancelled elsewhere (another replica's HTTP door)
//! shows up here as a renewal refused: the render stops. A process stopping gives its
//! unfinished jobs back to the queue ([`JobStore::release`]); one that dies leaves them to be
//! claimed again when their lease runs out.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, Semaphore};

use super::store::{JobStore, Outcome, StoreError};
use super::webhook::{self, Allow, RetrySchedule};
use super::{now_millis, JobRecord, JobStatus};
use crate::engine::pipeline::{self, Class, Options, Speech, Work};
use crate::engine::{avatar_store, Engine};

/// Metric names of batch jobs.
pub const JOBS: &str = "lipsync_jobs";
pub const JOB_DURATION: &str = "lipsync_job_duration_seconds";
pub const WEBHOOK_DELIVERIES: &str = "lipsync_webhook_deliveries_total";

/// The files of a job in its directory.
pub const SPEECH_FILE: &str = "speech";
pub const AVATAR_FILE: &str = "avatar.avatar";
pub const VIDEO_FILE: &str = "video.mp4";
const PART_FILE: &str = "video.part.mp4";

/// How often an idle worker looks for work when nobody wakes it (other replicas' submits).
const IDLE_POLL: Duration = Duration::from_millis(500);

/// How often `lipsync_jobs` is read again from the store besides this process's own changes,
/// so that it follows what the other replicas sharing the store do.
const COUNTS_EVERY: Duration = Duration::from_secs(5);

/// What the jobs of a process are configured with (from `serve`'s flags).
#[derive(Debug, Clone)]
pub struct Config {
    pub data_dir: PathBuf,
    pub ttl: Duration,
    pub max_queued: u64,
    pub data_dir_bytes: u64,
    pub concurrency: usize,
    pub lease: Duration,
    pub webhook_secret: Option<Vec<u8>>,
    pub webhook_retry: RetrySchedule,
    pub webhook_allow: Allow,
    pub webhook_timeout: Duration,
}

/// What the workers need from the process they run in: the engine once it is ready, and the
/// render settings every door shares.
pub trait Host: Send + Sync + 'static {
    /// `None` until every model instance is loaded and warmed up.
    fn engine(&self) -> Option<&Engine>;
    fn render_settings(&self) -> pipeline::Settings;
}

/// The batch jobs of one process.
pub struct Jobs {
    pub store: Arc<dyn JobStore>,
    pub cfg: Config,
    /// Unique to this process (and restart): the owner of its leases.
    owner: String,
    /// Cancel flags of the jobs rendering here.
    running: Mutex<HashMap<String, Arc<AtomicBool>>>,
    wake: Notify,
    stopping: AtomicBool,
    client: webhook::Client,
}

impl Jobs {
    pub fn new(store: Arc<dyn JobStore>, cfg: Config) -> Jobs {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "lipsync".into());
        let owner = format!(
            "{host}/{}/{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let client = webhook::Client::new(cfg.webhook_timeout);
        Jobs {
            store,
            cfg,
            owner,
            running: Mutex::new(HashMap::new()),
            wake: Notify::new(),
            stopping: AtomicBool::new(false),
            client,
        }
    }

    /// The directory of a job's files.
    pub fn dir(&self, id: &str) -> PathBuf {
        self.cfg.data_dir.join("jobs").join(id)
    }

    /// The finished video of a job.
    pub fn video(&self, id: &str) -> PathBuf {
        self.dir(id).join(VIDEO_FILE)
    }

    /// Wakes an idle worker (a job was just submitted).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Stops the render of a job if it runs here (after the store said it is cancelled or
    /// deleted).
    pub fn stop_local(&self, id: &str) {
        if let Some(flag) = self.running.lock().unwrap().get(id) {
            flag.store(true, Ordering::SeqCst);
        }
    }

    /// Removes a job's files.
    pub fn remove_files(&self, id: &str) {
        let dir = self.dir(id);
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("cannot remove {}: {e}", dir.display());
            }
        }
    }

    /// Publishes `lipsync_jobs{status}`.
    pub async fn publish_counts(&self) {
        match self.store.counts().await {
            Ok(counts) => {
                for s in JobStatus::ALL {
                    let n = counts.get(&s).copied().unwrap_or(0);
                    metrics::gauge!(JOBS, "status" => s.as_str()).set(n as f64);
                }
            }
            Err(e) => tracing::warn!("cannot count jobs: {e}"),
        }
    }

    /// Starts the workers, the webhook sender, the expiry and the counts' refresh on the
    /// current runtime.
    pub fn start(self: &Arc<Self>, host: Arc<dyn Host>) {
        let permits = Arc::new(Semaphore::new(self.cfg.concurrency.max(1)));
        tokio::spawn(self.clone().claim_loop(host, permits));
        tokio::spawn(self.clone().webhook_loop());
        tokio::spawn(self.clone().expiry_loop());
        tokio::spawn(self.clone().counts_loop());
    }

    /// Stops claiming, stops the renders running here and gives their jobs back to the
    /// queue, so that the next process claims them at once.
    pub async fn shutdown(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.wake.notify_waiters();
        let ids: Vec<String> = {
            let running = self.running.lock().unwrap();
            for flag in running.values() {
                flag.store(true, Ordering::SeqCst);
            }
            running.keys().cloned().collect()
        };
        for id in ids {
            match self.store.release(&id, &self.owner).await {
                Ok(true) => tracing::info!("job {id} given back to the queue"),
                Ok(false) => {}
                Err(e) => tracing::warn!("cannot give job {id} back: {e}"),
            }
        }
    }

    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    async fn claim_loop(self: Arc<Self>, host: Arc<dyn Host>, permits: Arc<Semaphore>) {
        self.publish_counts().await;
        loop {
            let Ok(permit) = permits.clone().acquire_owned().await else {
                return;
            };
            if self.stopping() {
                return;
            }
            if host.engine().is_none() {
                tokio::time::sleep(IDLE_POLL).await;
                continue;
            }
            let claimed = self
                .store
                .claim(&self.owner, now_millis(), self.cfg.lease)
                .await;
            match claimed {
                Ok(Some(job)) => {
                    self.publish_counts().await;
                    let jobs = self.clone();
                    let host = host.clone();
                    tokio::spawn(async move {
                        jobs.run(job, host).await;
                        drop(permit);
                    });
                }
                Ok(None) => {
                    drop(permit);
                    let _ = tokio::time::timeout(IDLE_POLL, self.wake.notified()).await;
                }
                Err(e) => {
                    drop(permit);
                    tracing::warn!("cannot claim a job: {e}");
                    tokio::time::sleep(IDLE_POLL * 4).await;
                }
            }
        }
    }

    /// One run of a claimed job: the render on its own thread, the lease renewed here.
    async fn run(self: &Arc<Self>, job: JobRecord, host: Arc<dyn Host>) {
        let id = job.id.clone();
        let started = Instant::now();
        tracing::info!("job {id}: run {} started", job.runs);
        let cancel = Arc::new(AtomicBool::new(false));
        self.running
            .lock()
            .unwrap()
            .insert(id.clone(), cancel.clone());
        let progress = Arc::new((AtomicU64::new(0), AtomicU64::new(job.frames_total)));

        let dir = self.dir(&id);
        let ffmpeg_host = host.clone();
        let (flag, prog) = (cancel.clone(), progress.clone());
        let mut render = tokio::task::spawn_blocking(move || {
            render(&job, &dir, ffmpeg_host.as_ref(), &flag, &prog)
        });

        // Progress is shown from the store: renew at least every second.
        let every = (self.cfg.lease / 3).min(Duration::from_secs(1));
        let result = loop {
            tokio::select! {
                r = &mut render => break r,
                _ = tokio::time::sleep(every) => {
                    let (done, total) = (progress.0.load(Ordering::Relaxed), progress.1.load(Ordering::Relaxed));
                    match self.store.renew(&id, &self.owner, now_millis(), self.cfg.lease, done, total).await {
                        Ok(true) => {}
                        Ok(false) => {
                            tracing::info!("job {id}: no longer this worker's (cancelled or deleted); stopping");
                            cancel.store(true, Ordering::SeqCst);
                        }
                        Err(e) => tracing::warn!("job {id}: cannot renew the lease: {e}"),
                    }
                }
            }
        };
        self.running.lock().unwrap().remove(&id);

        let outcome = match result {
            Ok(Ok(bytes)) => Some((Outcome::Succeeded, bytes)),
            Ok(Err(RunError::Stopped)) => None,
            Ok(Err(RunError::Failed(msg))) => {
                tracing::warn!("job {id} failed: {msg}");
                Some((Outcome::Failed(msg), dir_bytes(&self.dir(&id))))
            }
            Err(e) => {
                let msg = format!("the render panicked: {e}");
                tracing::error!("job {id}: {msg}");
                Some((Outcome::Failed(msg), dir_bytes(&self.dir(&id))))
            }
        };
        match outcome {
            Some((outcome, bytes)) => {
                let ok = outcome == Outcome::Succeeded;
                // The last progress (and the frame count of a render shorter than a renewal).
                let (done, total) = (
                    progress.0.load(Ordering::Relaxed),
                    progress.1.load(Ordering::Relaxed),
                );
                if let Err(e) = self
                    .store
                    .renew(&id, &self.owner, now_millis(), self.cfg.lease, done, total)
                    .await
                {
                    tracing::warn!("job {id}: cannot record its progress: {e}");
                }
                match self
                    .store
                    .finish(&id, &self.owner, now_millis(), outcome, bytes)
                    .await
                {
                    Ok(true) => {
                        tracing::info!(
                            "job {id} {} in {:.2} s",
                            if ok { "succeeded" } else { "failed" },
                            started.elapsed().as_secs_f64()
                        );
                        metrics::histogram!(JOB_DURATION).record(started.elapsed().as_secs_f64());
                        self.wake.notify_waiters();
                    }
                    // Cancelled or taken over meanwhile: its video is not wanted.
                    Ok(false) => remove_file(&self.video(&id)),
                    Err(e) => tracing::warn!("job {id}: cannot record its end: {e}"),
                }
            }
            None if self.stopping() => {
                // `shutdown` gives it back to the queue.
            }
            None => {
                tracing::info!("job {id} stopped");
                // Deleted while it rendered: the render may have created files after the
                // delete removed the directory.
                if matches!(self.store.get(&id).await, Ok(None)) {
                    self.remove_files(&id);
                }
            }
        }
        self.publish_counts().await;
    }

    /// Delivers due webhooks, one at a time, from the store (any replica's jobs).
    async fn webhook_loop(self: Arc<Self>) {
        let claim_for = self.client.timeout() * 2 + Duration::from_secs(5);
        loop {
            if self.stopping() {
                return;
            }
            let claimed = self
                .store
                .claim_webhook(&self.owner, now_millis(), claim_for)
                .await;
            let job = match claimed {
                Ok(Some(job)) => job,
                Ok(None) => {
                    let _ = tokio::time::timeout(IDLE_POLL, self.wake.notified()).await;
                    continue;
                }
                Err(e) => {
                    tracing::warn!("cannot claim a webhook: {e}");
                    tokio::time::sleep(IDLE_POLL * 4).await;
                    continue;
                }
            };
            self.deliver(job).await;
        }
    }

    async fn deliver(&self, job: JobRecord) {
        let Some(hook) = job.webhook.clone() else {
            return;
        };
        let Some(event) = hook.pending_event.clone() else {
            return;
        };
        let attempt = hook.attempts + 1;
        let delivery_id = webhook::delivery_id(&job.id, &event);
        let body = webhook::job_body(&job);
        let d = webhook::deliver(
            &self.client,
            &hook.url,
            &webhook::Event {
                name: &event,
                delivery_id: &delivery_id,
                attempt,
            },
            &body,
            self.cfg.webhook_secret.as_deref(),
            &self.cfg.webhook_allow,
        )
        .await;
        let next_at = if d.ok {
            None
        } else {
            self.cfg.webhook_retry.next_at(now_millis(), attempt)
        };
        let outcome = match (d.ok, next_at) {
            (true, _) => "success",
            (false, Some(_)) => "retry",
            (false, None) => "failed",
        };
        tracing::info!(
            "job {}: webhook {event} attempt {attempt} → {} ({outcome})",
            job.id,
            d.status
        );
        metrics::counter!(WEBHOOK_DELIVERIES, "outcome" => outcome).increment(1);
        if let Err(e) = self
            .store
            .record_webhook(&job.id, &self.owner, &d.status, next_at)
            .await
        {
            tracing::warn!("job {}: cannot record the webhook attempt: {e}", job.id);
        }
    }

    /// Publishes `lipsync_jobs` every [`COUNTS_EVERY`]: a job another replica claims or
    /// finishes changes the counts without anything happening here.
    async fn counts_loop(self: Arc<Self>) {
        loop {
            tokio::time::sleep(COUNTS_EVERY).await;
            if self.stopping() {
                return;
            }
            self.publish_counts().await;
        }
    }

    /// Deletes jobs (records and files) that ended more than `--job-ttl` ago.
    async fn expiry_loop(self: Arc<Self>) {
        let every = (self.cfg.ttl / 4).clamp(Duration::from_millis(200), Duration::from_secs(60));
        loop {
            tokio::time::sleep(every).await;
            if self.stopping() {
                return;
            }
            if let Err(e) = self.expire().await {
                tracing::warn!("cannot expire jobs: {e}");
            }
        }
    }

    /// One pass of expiry; returns how many jobs were deleted.
    pub async fn expire(&self) -> Result<usize, StoreError> {
        let before = now_millis() - self.cfg.ttl.as_millis() as i64;
        let ids = self.store.ended_before(before).await?;
        let mut n = 0;
        for id in ids {
            if self.store.delete(&id).await? {
                self.remove_files(&id);
                n += 1;
            }
        }
        if n > 0 {
            tracing::info!("{n} expired jobs deleted");
            self.publish_counts().await;
        }
        Ok(n)
    }
}

enum RunError {
    /// Cancelled, deleted, taken over or the process is stopping: nothing to record.
    Stopped,
    Failed(String),
}

/// Renders a job into its directory (blocking): the prepared avatar and the speech from its
/// files, the video written fragmented, then made a faststart MP4. Returns the bytes of the
/// job's files.
fn render(
    job: &JobRecord,
    dir: &Path,
    host: &dyn Host,
    cancel: &AtomicBool,
    progress: &(AtomicU64, AtomicU64),
) -> Result<u64, RunError> {
    let failed = |what: &str, e: &dyn std::fmt::Display| RunError::Failed(format!("{what}: {e}"));
    let Some(engine) = host.engine() else {
        return Err(RunError::Stopped);
    };
    let avatar_bytes =
        std::fs::read(dir.join(&job.spec.avatar_file)).map_err(|e| failed("the avatar", &e))?;
    let avatar = avatar_store::decode(&avatar_bytes).map_err(|e| failed("the avatar", &e))?;
    let speech =
        Speech::file(dir.join(&job.spec.speech_file)).map_err(|e| failed("the speech", &e))?;
    let options =
        options(&job.spec.fields, engine.enhancers()).map_err(|e| failed("the options", &e))?;
    let settings = host.render_settings();
    let ffmpeg = settings.encoder.ffmpeg.clone();

    let part = dir.join(PART_FILE);
    let file = std::fs::File::create(&part).map_err(|e| failed("the video file", &e))?;
    let work = Work {
        speech,
        avatar: Arc::new(avatar),
        options,
        class: Class::Background,
        keep: Default::default(),
    };
    let started = pipeline::start(
        engine,
        &settings,
        work,
        Box::new(std::io::BufWriter::new(file)),
    )
    .map_err(|e| failed("cannot start", &e))?;
    progress
        .1
        .store(started.video_frames() as u64, Ordering::Relaxed);
    let gone = || cancel.load(Ordering::SeqCst);
    let result = started.run(&gone, &mut |done, _| {
        progress.0.store(done as u64, Ordering::Relaxed)
    });
    match result {
        Ok(_) => {}
        Err(crate::engine::Error::Cancelled) => {
            remove_file(&part);
            return Err(RunError::Stopped);
        }
        Err(e) => {
            remove_file(&part);
            return Err(RunError::Failed(e.to_string()));
        }
    }
    let tmp = dir.join(format!("{VIDEO_FILE}.tmp"));
    let made = crate::media::video::faststart(&ffmpeg, &part, &tmp).and_then(|()| {
        std::fs::rename(&tmp, dir.join(VIDEO_FILE))
            .map_err(|e| crate::media::Error::Encoder(format!("cannot keep the video: {e}")))
    });
    remove_file(&part);
    if let Err(e) = made {
        remove_file(&tmp);
        return Err(RunError::Failed(e.to_string()));
    }
    if cancel.load(Ordering::SeqCst) {
        return Err(RunError::Stopped);
    }
    Ok(dir_bytes(dir))
}

/// A job's render options from the form fields it was submitted with (checked then; the
/// enhancer it asked for must still be loaded).
pub fn options(
    fields: &std::collections::BTreeMap<String, String>,
    enhancers: &crate::engine::enhance::Enhancers,
) -> Result<Options, String> {
    fn field<T: std::str::FromStr>(
        fields: &std::collections::BTreeMap<String, String>,
        name: &str,
    ) -> Result<Option<T>, String>
    where
        T::Err: std::fmt::Display,
    {
        fields
            .get(name)
            .map(|v| v.parse::<T>().map_err(|e| format!("field `{name}`: {e}")))
            .transpose()
    }
    Ok(Options {
        fps: field(fields, "fps")?.unwrap_or_default(),
        loop_mode: field(fields, "loop")?.unwrap_or_default(),
        blend: field(fields, "blend")?.unwrap_or_default(),
        crf: field(fields, "crf")?,
        preset: None,
        enhance: enhancers
            .resolve(fields.get("enhance").map(String::as_str))
            .map_err(|e| format!("field `enhance`: {e}"))?,
    })
}

fn remove_file(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("cannot remove {}: {e}", path.display());
        }
    }
}

/// The bytes of the files in a job's directory.
pub fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}
