//! Parallel encoding: keyframe-aligned segments encoded round-robin by several x264
//! processes, joined in order into one H.264 stream, muxed into MP4 by one more ffmpeg.
//!
//! ```text
//!             ┌─ worker 0: ffmpeg rgb→x264→FLV ─ segments 0, K, 2K, …  ─┐
//! write_frame ┼─ worker 1: …                     segments 1, K+1, …    ─┼─ joiner ─ muxer ─ sink
//!             └─ worker K-1                                            ─┘  (Annex B)  (ffmpeg: copy
//!                                                                                      + AAC → fMP4)
//! ```
//!
//! A segment is one GOP: `gop` frames (one second), the last one shorter. Each worker encodes
//! its segments back to back with an IDR frame every `gop` frames, so every segment starts
//! with one; the joiner checks that. Workers write FLV because it frames every encoded
//! picture with its length, and ffmpeg writes each one as soon as it is encoded
//! (`-flush_packets 1`): the joiner can forward a picture the moment it exists, without
//! waiting for the next one to find where it ends. It forwards segment 0 from worker 0,
//! then segment 1 from worker 1, and so on, converting to Annex B (an access unit
//! delimiter, the parameter sets before every IDR frame); the muxer rewrites timestamps to
//! frame index / fps and copies the stream into fragmented MP4 with the audio, exactly as
//! the single-process encoder would lay it out.
//!
//! Every queue is bounded, so a slow client still slows the producer down: sink ← muxer ←
//! joiner ← workers' output queues ← workers ← frame queues ← `write_frame`.
//!
//! **Workers kept between renders.** With a process pool ([`EncoderSettings::spares`], the
//! service's), a worker's input is never closed: at the end of a render each worker gets
//! padding frames up to its next keyframe (flat grey, whose pictures are dropped), so it
//! stands at a segment boundary with nothing in flight, and the pool keeps it
//! ([`super::Spares`]) for the next render of the same command line, whose first frame is then
//! its next IDR picture. Its stdout reader stays with it and sends its pictures wherever the
//! render holding it says ([`Route`]). A worker is kept only after a render that finished
//! cleanly with all its pictures out; one that failed or was dropped is ended as before.

use std::collections::VecDeque;
use std::process::ChildStdin;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::flv::{self, be};
use super::process::{spawn_thread, Fd3, Launch, Process, StdoutConsumer};
use super::single::SinkError;
use super::splice::{FrameFeed, FramePool, History, Pooled};
use super::{EncodeSummary, EncoderSettings, Sink, VideoEncoder, PIPED_SPEECH};
use crate::media::yuv::{self, Region, Yuv420};
use crate::media::Error;

/// Raw frames queued for all workers together, at most (a 512×512 frame is 0.75 MiB).
const FRAME_QUEUE_BYTES: usize = 128 << 20;
/// Encoded pictures waiting in each worker's output for their turn, at most (one picture
/// always fits).
const PICTURE_QUEUE_BYTES: usize = 16 << 20;
/// How long the end of a render waits for a worker's last pictures and padding before it
/// ends that worker instead of keeping it (x264 at zero latency returns each picture as its
/// frame is read, so this only bounds a worker that holds pictures back, or a slow client).
const KEEP_WAIT: Duration = Duration::from_secs(2);
/// Frames a kept worker encodes in all before it is ended (22 hours of video at 25 fps): its
/// FLV timestamps grow with them, and although the joiner does not read them, ffmpeg should
/// not have to write ones near their 32-bit limit.
const MAX_WORKER_FRAMES: u64 = 2_000_000;

/// The segmented encoder (`workers > 1`).
pub struct SegmentedEncoder {
    settings: EncoderSettings,
    segment_len: u64,
    /// Worker `i` starts with its first segment (frame `i · segment_len`): the first
    /// segment's worker and the muxer then start without the others loading beside them,
    /// and a short video starts only the workers it needs.
    workers: Vec<Option<Worker>>,
    /// Each worker's output queue, which the joiner reads.
    outputs: Vec<PictureQueue>,
    /// Frames queued for each worker, at most.
    frame_queue: usize,
    /// Frame buffers the workers' feeders are done with.
    pool: FramePool,
    /// Where each frame written differed from the one before, for [`FramePool::updated`].
    history: History,
    joiner: Option<JoinHandle<Result<u64, Error>>>,
    muxer: Process,
    sink_error: SinkError,
    frames: u64,
}

struct Worker {
    /// Frames for this worker; dropping it ends this render's input.
    frames: Option<SyncSender<Pooled>>,
    /// Writes queued frames to ffmpeg's stdin; returns the stdin if every frame went in.
    feeder: Option<JoinHandle<Option<ChildStdin>>>,
    process: Process,
    /// Where its pictures go.
    route: Arc<Route>,
    /// Frames of this render sent to it.
    sent: u64,
    /// Frames it encoded before this render (a kept worker).
    before: u64,
}

/// A worker between renders: its process, blocked on its open stdin at a keyframe boundary,
/// and its stdout reader's route.
pub(super) struct KeptWorker {
    process: Process,
    stdin: ChildStdin,
    route: Arc<Route>,
    /// Frames it has encoded so far.
    frames: u64,
}

impl KeptWorker {
    /// Whether its process still runs.
    pub(super) fn running(&mut self) -> bool {
        !self.process.exited()
    }

    pub(super) fn id(&self) -> Option<u32> {
        self.process.id()
    }
}

impl SegmentedEncoder {
    pub fn spawn(settings: EncoderSettings, sink: Sink) -> Result<Self, Error> {
        settings.validate()?;
        let k = settings.workers.max(1);
        let segment_len = settings.gop() as usize;
        // Enough queued frames per worker that the producer can hand each its next segment
        // while the others encode, within the memory budget for large frames.
        let frame_queue = (FRAME_QUEUE_BYTES
            / (k * yuv::frame_bytes(settings.width, settings.height)))
        .clamp(2, segment_len);

        let sink_error = SinkError::default();
        let mut muxer = settings.start_with_speech(
            |speech| settings.muxer_args_with(speech),
            "the ffmpeg muxer",
            sink_error.consumer(sink),
        )?;
        let muxer_stdin = muxer
            .take_stdin()
            .ok_or_else(|| Error::Internal("muxer without stdin".into()))?;

        // One segment of pictures per worker: a worker can finish its next segment while the
        // joiner forwards the others', and no more.
        let outputs: Vec<PictureQueue> = (0..k)
            .map(|_| PictureQueue::new(segment_len, PICTURE_QUEUE_BYTES))
            .collect();
        let queues = outputs.clone();
        let joiner = spawn_thread("encoder-joiner", move || {
            join_segments(queues, segment_len, muxer_stdin)
        })?;
        let mut encoder = SegmentedEncoder {
            settings,
            segment_len: segment_len as u64,
            workers: (0..k).map(|_| None).collect(),
            outputs,
            frame_queue,
            // Room for every buffer that can be out at once (each worker's queue, the two
            // its pipe may still reference, and the one being filled): a buffer that comes
            // back while the pool is full is dropped, and a frame that then finds it empty is
            // copied whole into a fresh buffer instead of only where it changed. With room
            // for 6 at 512×512, a third of a 40 s request's frames were.
            pool: FramePool::new(k * frame_queue + 2 * k + 2),
            history: History::default(),
            joiner: Some(joiner),
            muxer,
            sink_error,
            frames: 0,
        };
        encoder.workers[0] = Some(encoder.start_worker(0)?);
        Ok(encoder)
    }

    /// Starts worker `i`: a kept one from the pool if one waits for this command line, else
    /// a new ffmpeg; and the thread that feeds it.
    fn start_worker(&self, i: usize) -> Result<Worker, Error> {
        let role = format!("encoder worker {i}");
        let launch = self.worker_launch();
        let kept = self
            .settings
            .spares
            .as_ref()
            .and_then(|s| s.take_kept(&launch))
            // One whose output has ended since it was kept is ended (dropped) here.
            .filter(|k| k.route.start(self.outputs[i].clone()));
        let (process, stdin, route, before) = match kept {
            Some(k) => {
                let mut process = k.process;
                process.set_role(&role);
                (process, k.stdin, k.route, k.frames)
            }
            None => {
                // The route has the queue before the reader starts: an output that ends at
                // once still closes it.
                let route = Arc::new(Route::to(self.outputs[i].clone()));
                let (process, stdin) = spawn_worker(&launch, &role, &route)?;
                (process, stdin, route, 0)
            }
        };
        let (tx, rx) = sync_channel::<Pooled>(self.frame_queue);
        let pool = self.pool.clone();
        let feeder = spawn_thread("encoder-feeder", move || feed(stdin, rx, pool))?;
        Ok(Worker {
            frames: Some(tx),
            feeder: Some(feeder),
            process,
            route,
            sent: 0,
            before,
        })
    }

    fn worker_launch(&self) -> Launch {
        self.settings.launch(self.settings.worker_args(), Fd3::None)
    }

    /// Closes the output queues of the workers that never started: the joiner then sees
    /// their segments end (empty) instead of waiting for them.
    fn close_unstarted(&self) {
        for (w, q) in self.workers.iter().zip(&self.outputs) {
            if w.is_none() {
                q.close();
            }
        }
    }

    /// Ends every worker's input, waits for all processes and threads, and reports the
    /// first failure in causal order: the output going away, a worker, the muxer, the
    /// joiner. Returns the bytes written and the frames the joiner forwarded. With `keep`
    /// (a render that ends normally, with a process pool) the workers are padded to their
    /// next keyframe and, if all went well, kept in the pool instead of ended.
    fn wind_down(&mut self, keep: bool) -> Result<(u64, u64), Error> {
        self.close_unstarted();
        let pool = if keep {
            self.settings.spares.clone()
        } else {
            None
        };
        let grey = pool
            .as_ref()
            .map(|_| vec![128u8; yuv::frame_bytes(self.settings.width, self.settings.height)]);
        for w in self.workers.iter_mut().flatten() {
            if let Some(grey) = &grey {
                // Up to the worker's next keyframe; the route drops these pictures.
                let pad = (self.segment_len - w.sent % self.segment_len) % self.segment_len;
                w.route.end_render(w.sent, pad);
                if let Some(tx) = &w.frames {
                    for _ in 0..pad {
                        if tx.send(self.pool.filled(grey)).is_err() {
                            break;
                        }
                        w.sent += 1;
                    }
                }
            }
            drop(w.frames.take());
        }
        // A worker to be kept has its stdin back once all it was sent is in the pipe, and
        // is kept once all its pictures are out; any other worker's input is closed here,
        // so it finishes and exits.
        let mut stdins: Vec<Option<ChildStdin>> = self
            .workers
            .iter_mut()
            .map(|w| {
                let w = w.as_mut()?;
                let stdin = w.feeder.take().and_then(|f| f.join().ok()).flatten();
                stdin.filter(|_| pool.is_some())
            })
            .collect();
        let deadline = Instant::now() + KEEP_WAIT;
        for (w, stdin) in self.workers.iter().zip(&mut stdins) {
            if let Some(w) = w {
                if stdin.is_some() && !w.route.wait_through(deadline) {
                    drop(stdin.take());
                }
            }
        }
        let mut worker_error = None;
        for ((w, stdin), queue) in self.workers.iter_mut().zip(&stdins).zip(&self.outputs) {
            if let (Some(w), None) = (w, stdin) {
                if let Err(e) = w.process.finish() {
                    worker_error.get_or_insert(e);
                }
                // Its reader has ended with it; the joiner must not wait for it any more.
                queue.close();
            }
        }
        let joined = match self.joiner.take().map(|j| j.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(Error::Internal("the segment joiner panicked".into())),
            None => Ok(0),
        };
        let muxed = self.muxer.finish();
        let result = if let Some(e) = self.sink_error.get() {
            Err(e)
        } else if let Some(e) = worker_error {
            // A failed worker starves the muxer, never the other way round.
            Err(e)
        } else {
            muxed.and_then(|m| joined.map(|j| (m, j)))
        };
        // Kept only after a render whose every frame came out.
        let whole = matches!(&result, Ok((_, joined)) if *joined == self.frames);
        if let (Some(pool), true) = (pool, whole) {
            let launch = self.worker_launch();
            for (slot, stdin) in self.workers.iter_mut().zip(stdins) {
                let Some(stdin) = stdin else { continue };
                if let Some(w) = slot.take() {
                    let frames = w.before + w.sent;
                    if frames < MAX_WORKER_FRAMES {
                        pool.keep(
                            launch.clone(),
                            KeptWorker {
                                process: w.process,
                                stdin,
                                route: w.route,
                                frames,
                            },
                        );
                    }
                    // else: dropped here, and ended (a fresh worker takes over)
                }
            }
        }
        // Workers not kept (a failure): their stdin closes here, and Drop ends them.
        result
    }
}

impl VideoEncoder for SegmentedEncoder {
    fn write_yuv(&mut self, frame: &Yuv420) -> Result<(), Error> {
        self.write_yuv_changed(frame, None)
    }

    fn write_yuv_changed(&mut self, frame: &Yuv420, changed: Option<Region>) -> Result<(), Error> {
        if let Some(e) = self.sink_error.get() {
            return Err(e);
        }
        if self.joiner.as_ref().is_some_and(|j| j.is_finished()) {
            // The joiner only stops early when something failed.
            return Err(match self.wind_down(false) {
                Err(e) => e,
                Ok(_) => Error::Encoder("the encoder stopped early".into()),
            });
        }
        self.settings.coded_frame(frame)?;
        self.history.push(changed);
        let data = self.pool.updated(frame, &self.history);
        let k = self.workers.len() as u64;
        let w = ((self.frames / self.segment_len) % k) as usize;
        if self.workers[w].is_none() {
            let started = self.start_worker(w);
            match started {
                Ok(worker) => self.workers[w] = Some(worker),
                Err(e) => {
                    let _ = self.wind_down(false);
                    return Err(e);
                }
            }
        }
        let sent = self.workers[w].as_mut().is_some_and(|worker| {
            let ok = worker
                .frames
                .as_ref()
                .is_some_and(|tx| tx.send(data).is_ok());
            worker.sent += u64::from(ok);
            ok
        });
        if !sent {
            // That worker's ffmpeg stopped reading: it failed, and its stderr says why.
            return Err(match self.wind_down(false) {
                Err(e) => e,
                Ok(_) => Error::Encoder(format!("encoder worker {w} stopped reading frames")),
            });
        }
        self.frames += 1;
        Ok(())
    }

    fn finish(mut self: Box<Self>) -> Result<EncodeSummary, Error> {
        let (bytes, joined) = self.wind_down(true)?;
        if joined != self.frames {
            return Err(Error::Encoder(format!(
                "the encoder workers returned {joined} of {} frames",
                self.frames
            )));
        }
        Ok(EncodeSummary {
            frames: self.frames,
            bytes,
        })
    }
}

impl Drop for SegmentedEncoder {
    /// An unfinished encoder kills every process first (so no thread can wait on another
    /// that is still blocked), then reaps them and joins the threads.
    fn drop(&mut self) {
        self.close_unstarted();
        for w in self.workers.iter_mut().flatten() {
            drop(w.frames.take());
        }
        self.muxer.signal_kill();
        for w in self.workers.iter_mut().flatten() {
            w.process.signal_kill();
        }
        for w in self.workers.iter_mut().flatten() {
            if let Some(f) = w.feeder.take() {
                let _ = f.join();
            }
            w.process.kill();
        }
        // Every reader has ended with its process: nothing more comes to the joiner.
        for q in &self.outputs {
            q.close();
        }
        if let Some(j) = self.joiner.take() {
            let _ = j.join();
        }
        self.muxer.kill();
    }
}

/// Starts what a render with `settings` will take and its pool does not hold already, so
/// that the first render of a new frame size waits for no ffmpeg start: the segmented
/// encoder's workers and a spare of its muxer, or the single encoder's process, for speech
/// through a pipe (MP4/M4A speech is read by name, so its render starts its own). The
/// service calls it when an avatar is prepared. Nothing without a pool.
pub fn start_encoders_ahead(settings: &EncoderSettings) -> Result<(), Error> {
    let Some(pool) = settings.spares.as_ref() else {
        return Ok(());
    };
    settings.validate()?;
    let piped = Some(PIPED_SPEECH);
    if settings.workers <= 1 {
        pool.refill(&settings.speech_launch(|s| settings.single_args_with(s), piped));
        return Ok(());
    }
    let launch = settings.launch(settings.worker_args(), Fd3::None);
    for _ in pool.kept_for(&launch)..settings.workers {
        let route = Arc::new(Route::default());
        let (process, stdin) = spawn_worker(&launch, "encoder worker", &route)?;
        pool.keep(
            launch.clone(),
            KeptWorker {
                process,
                stdin,
                route,
                frames: 0,
            },
        );
    }
    pool.refill(&settings.speech_launch(|s| settings.muxer_args_with(s), piped));
    Ok(())
}

/// A new worker's ffmpeg, its output read into `route`, and its stdin. Never from the
/// spares: a worker is kept after its render, not replaced.
fn spawn_worker(
    launch: &Launch,
    role: &str,
    route: &Arc<Route>,
) -> Result<(Process, ChildStdin), Error> {
    let mut process = Process::spawn(launch, None, role, routed_consumer(route.clone()))?;
    let stdin = process
        .take_stdin()
        .ok_or_else(|| Error::Internal("worker without stdin".into()))?;
    Ok((process, stdin))
}

/// Writes queued frames to a worker's stdin until the queue closes or ffmpeg stops reading
/// (the worker's exit status then tells why), handing their buffers back to `pool` once
/// ffmpeg has read them ([`FrameFeed`]). Returns the stdin, once ffmpeg has read every
/// frame, if all went in.
fn feed(stdin: ChildStdin, frames: Receiver<Pooled>, pool: FramePool) -> Option<ChildStdin> {
    let mut feed = FrameFeed::new(stdin, pool);
    while let Ok(frame) = frames.recv() {
        feed.write(frame).ok()?;
    }
    Some(feed.into_pipe())
}

/// Forwards the workers' pictures to the muxer, segment by segment in round-robin order,
/// until a worker's output ends inside (or at the start of) its segment. Returns the
/// number of pictures forwarded.
fn join_segments(
    outputs: Vec<PictureQueue>,
    segment_len: usize,
    muxer: ChildStdin,
) -> Result<u64, Error> {
    let result = forward_segments(&outputs, segment_len, muxer);
    // Whatever happened, the workers' readers must not wait for this joiner any more.
    for q in &outputs {
        q.close();
    }
    result
}

fn forward_segments(
    outputs: &[PictureQueue],
    segment_len: usize,
    mut muxer: ChildStdin,
) -> Result<u64, Error> {
    use std::io::Write;
    let mut forwarded = 0u64;
    let mut params: Option<Arc<Vec<u8>>> = None;
    for segment in 0.. {
        let w = segment % outputs.len();
        let mut count = 0;
        while count < segment_len {
            let picture = match outputs[w].pop() {
                Some(p) => p?,
                None => break, // that worker has finished (or failed: its status says)
            };
            if count == 0 && !picture.key {
                return Err(Error::Encoder(format!(
                    "segment {segment} from encoder worker {w} does not start with a keyframe"
                )));
            }
            let mut au: &[u8] = &picture.data;
            let mut with_params = Vec::new();
            if picture.key {
                match &params {
                    None => params = Some(picture.params.clone()),
                    Some(p) if **p != *picture.params => {
                        return Err(Error::Encoder(
                            "encoder workers disagree on the H.264 parameter sets".into(),
                        ))
                    }
                    Some(_) => {}
                }
                with_params.extend_from_slice(AUD);
                with_params.extend_from_slice(&picture.params);
                with_params.extend_from_slice(&picture.data[AUD.len()..]);
                au = &with_params;
            }
            muxer
                .write_all(au)
                .map_err(|e| Error::Encoder(format!("the ffmpeg muxer stopped reading: {e}")))?;
            count += 1;
            forwarded += 1;
        }
        if count < segment_len {
            break;
        }
    }
    Ok(forwarded)
}

/// A worker's encoded pictures on their way to the joiner, bounded by count and bytes: when
/// it is full the worker's reader waits, its ffmpeg blocks on its stdout, and so on back to
/// `write_frame`. Either side going away (the reader at the end of ffmpeg's output, the
/// joiner when it stops) closes it, and the other side's next call says so.
#[derive(Clone)]
struct PictureQueue(Arc<(Mutex<QueueState>, Condvar)>);

struct QueueState {
    items: VecDeque<Result<Picture, Error>>,
    bytes: usize,
    max_items: usize,
    max_bytes: usize,
    closed: bool,
}

impl PictureQueue {
    fn new(max_items: usize, max_bytes: usize) -> Self {
        PictureQueue(Arc::new((
            Mutex::new(QueueState {
                items: VecDeque::new(),
                bytes: 0,
                max_items: max_items.max(1),
                max_bytes,
                closed: false,
            }),
            Condvar::new(),
        )))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.0 .0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for room (an empty queue always has room); false once closed.
    fn push(&self, item: Result<Picture, Error>) -> bool {
        let size = item.as_ref().map_or(0, |p| p.data.len());
        let mut q = self.lock();
        while !q.closed
            && !q.items.is_empty()
            && (q.items.len() >= q.max_items || q.bytes + size > q.max_bytes)
        {
            q = self.0 .1.wait(q).unwrap_or_else(|p| p.into_inner());
        }
        if q.closed {
            return false;
        }
        q.bytes += size;
        q.items.push_back(item);
        self.0 .1.notify_all();
        true
    }

    /// The next picture; `None` once the queue is closed and empty.
    fn pop(&self) -> Option<Result<Picture, Error>> {
        let mut q = self.lock();
        loop {
            if let Some(item) = q.items.pop_front() {
                q.bytes -= item.as_ref().map_or(0, |p| p.data.len());
                self.0 .1.notify_all();
                return Some(item);
            }
            if q.closed {
                return None;
            }
            q = self.0 .1.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn close(&self) {
        self.lock().closed = true;
        self.0 .1.notify_all();
    }
}

/// Annex B start code.
const START: &[u8] = &[0, 0, 0, 1];
/// An access unit delimiter NAL (type 9, primary_pic_type 7: any slice type).
const AUD: &[u8] = &[0, 0, 0, 1, 0x09, 0xF0];

/// One encoded picture, in Annex B.
#[derive(Debug, Clone)]
struct Picture {
    key: bool,
    /// Access unit delimiter, then the picture's NAL units.
    data: Vec<u8>,
    /// SPS and PPS (inserted before keyframes by the joiner).
    params: Arc<Vec<u8>>,
}

/// Where a worker's pictures go: the output queue of the render that holds the worker. The
/// worker's stdout reader ([`routed_consumer`]) outlives a render when the worker is kept.
#[derive(Default)]
struct Route {
    state: Mutex<RouteState>,
    changed: Condvar,
}

#[derive(Default)]
struct RouteState {
    /// The render's queue, until all its pictures are in it.
    queue: Option<PictureQueue>,
    /// Pictures of this render read from the worker's output.
    seen: u64,
    /// Of those, the ones passed on (or dropped as padding).
    through: u64,
    /// Set at the end of the render: its frames, and its frames with the padding.
    frames: Option<u64>,
    total: Option<u64>,
    /// The worker's output ended, could not be read, or the render stopped taking it: the
    /// worker cannot be kept.
    broken: bool,
}

impl RouteState {
    /// Closes the render's queue once all its pictures are in it.
    fn settle(&mut self) {
        if self.frames.is_some_and(|f| self.through >= f) {
            if let Some(q) = self.queue.take() {
                q.close();
            }
        }
    }
}

impl Route {
    fn lock(&self) -> MutexGuard<'_, RouteState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new worker's route, to `queue`.
    fn to(queue: PictureQueue) -> Self {
        Route {
            state: Mutex::new(RouteState {
                queue: Some(queue),
                ..RouteState::default()
            }),
            changed: Condvar::new(),
        }
    }

    /// A render takes a kept worker: its pictures go to `queue` from now on. False (and
    /// the queue untouched) if the worker's output has ended meanwhile.
    fn start(&self, queue: PictureQueue) -> bool {
        let mut s = self.lock();
        if s.broken {
            return false;
        }
        s.queue = Some(queue);
        s.seen = 0;
        s.through = 0;
        s.frames = None;
        s.total = None;
        true
    }

    /// The render has sent its last frame to the worker, `frames` in all, followed by
    /// `padding` frames whose pictures are dropped.
    fn end_render(&self, frames: u64, padding: u64) {
        let mut s = self.lock();
        s.frames = Some(frames);
        s.total = Some(frames + padding);
        s.settle();
        self.changed.notify_all();
    }

    /// One picture from the worker: into the render's queue, or dropped if it is padding.
    fn deliver(&self, picture: Picture) {
        let queue = {
            let mut s = self.lock();
            s.seen += 1;
            if s.frames.is_some_and(|f| s.seen > f) {
                None
            } else {
                s.queue.clone()
            }
        };
        // Outside the lock: the push waits while the render's queue is full.
        let delivered = queue.is_none_or(|q| q.push(Ok(picture)));
        let mut s = self.lock();
        s.through += 1;
        // More pictures than frames and padding: the worker is off its keyframe phase.
        s.broken |= !delivered || s.total.is_some_and(|t| s.seen > t);
        s.settle();
        self.changed.notify_all();
    }

    /// The worker's output failed: the render hears why, and the worker is not kept.
    fn fail(&self, error: Error) {
        let queue = {
            let mut s = self.lock();
            s.broken = true;
            s.queue.clone()
        };
        if let Some(q) = queue {
            q.push(Err(error));
        }
        self.changed.notify_all();
    }

    /// The worker's output has ended: the render's queue closes (the joiner then sees the
    /// worker's last segment end).
    fn end(&self) {
        let mut s = self.lock();
        s.broken = true;
        if let Some(q) = s.queue.take() {
            q.close();
        }
        self.changed.notify_all();
    }

    /// Waits until every picture of the render and its padding has come out of the worker
    /// (true), or it broke or `deadline` passed (false).
    fn wait_through(&self, deadline: Instant) -> bool {
        let mut s = self.lock();
        loop {
            if s.broken {
                return false;
            }
            if s.total.is_some_and(|t| s.seen == t && s.through == t) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            s = self
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A stdout consumer that parses a worker's FLV and sends its pictures (or the first parse
/// error) where `route` says; after an error it just drains.
fn routed_consumer(route: Arc<Route>) -> StdoutConsumer {
    let mut reader = FlvReader::default();
    let mut failed = false;
    Box::new(move |data| {
        let end = data.is_none();
        if !failed {
            let result = match data {
                Some(d) => reader.push(d),
                None => reader.end().map(|_| Vec::new()),
            };
            match result {
                Ok(pictures) => pictures.into_iter().for_each(|p| route.deliver(p)),
                Err(e) => {
                    route.fail(e);
                    failed = true;
                }
            }
        }
        if end {
            route.end();
        }
    })
}

/// Incremental FLV reader for ffmpeg's H.264 output (legacy AVC tags and enhanced-FLV
/// `avc1` tags, see [`flv`]): yields every coded picture, converted to Annex B.
#[derive(Default)]
struct FlvReader {
    tags: flv::Tags,
    /// Bytes of each NAL unit's length prefix (from the decoder configuration).
    length_size: usize,
    params: Option<Arc<Vec<u8>>>,
}

fn flv_error(what: impl std::fmt::Display) -> Error {
    Error::Encoder(format!("unexpected output from an encoder worker: {what}"))
}

impl FlvReader {
    fn push(&mut self, data: &[u8]) -> Result<Vec<Picture>, Error> {
        let mut out = Vec::new();
        for tag in self.tags.push(data).map_err(flv_error)? {
            if tag.kind == flv::VIDEO {
                if let Some(p) = self.video_tag(&tag.data)? {
                    out.push(p);
                }
            }
        }
        Ok(out)
    }

    fn end(&self) -> Result<(), Error> {
        self.tags.end().map_err(flv_error)
    }

    fn video_tag(&mut self, tag: &[u8]) -> Result<Option<Picture>, Error> {
        match flv::avc(tag).map_err(flv_error)? {
            flv::Avc::Config(record) => {
                self.configure(record)?;
                Ok(None)
            }
            flv::Avc::Picture { key, nals, .. } => {
                let params = self
                    .params
                    .clone()
                    .ok_or_else(|| flv_error("picture before the decoder configuration"))?;
                let mut data = AUD.to_vec();
                let mut rest = nals;
                while !rest.is_empty() {
                    if rest.len() < self.length_size {
                        return Err(flv_error("truncated NAL length"));
                    }
                    let n = be(&rest[..self.length_size]);
                    let nal = rest
                        .get(self.length_size..self.length_size + n)
                        .ok_or_else(|| flv_error("truncated NAL unit"))?;
                    // The workers' own delimiters and parameter sets are replaced by ours.
                    if !matches!(nal.first().map(|b| b & 0x1f), Some(7..=9)) {
                        data.extend_from_slice(START);
                        data.extend_from_slice(nal);
                    }
                    rest = &rest[self.length_size + n..];
                }
                Ok(Some(Picture { key, data, params }))
            }
            flv::Avc::Other => Ok(None),
        }
    }

    /// Reads an AVCDecoderConfigurationRecord: NAL length size, SPS and PPS.
    fn configure(&mut self, rec: &[u8]) -> Result<(), Error> {
        let short = || flv_error("short decoder configuration");
        if rec.len() < 7 || rec[0] != 1 {
            return Err(flv_error("bad decoder configuration"));
        }
        self.length_size = (rec[4] & 0x03) as usize + 1;
        let mut params = Vec::new();
        let mut pos = 5;
        for (i, mask) in [0x1f, 0xff].into_iter().enumerate() {
            // SPS count (low 5 bits), then PPS count (a whole byte).
            let count = (*rec.get(pos).ok_or_else(short)? & mask) as usize;
            pos += 1;
            if count == 0 {
                return Err(flv_error(if i == 0 { "no SPS" } else { "no PPS" }));
            }
            for _ in 0..count {
                let n = be(rec.get(pos..pos + 2).ok_or_else(short)?);
                let nal = rec.get(pos + 2..pos + 2 + n).ok_or_else(short)?;
                params.extend_from_slice(START);
                params.extend_from_slice(nal);
                pos += 2 + n;
            }
        }
        self.params = Some(Arc::new(params));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::media::video::flv::tests::{flv, tag_at};

    fn tag(kind: u8, data: &[u8]) -> Vec<u8> {
        tag_at(kind, 0, data)
    }

    const SPS: &[u8] = &[0x67, 0x64, 0x00, 0x1f, 0xac];
    const PPS: &[u8] = &[0x68, 0xeb, 0xe3];

    fn avcc() -> Vec<u8> {
        let mut r = vec![1, 0x64, 0x00, 0x1f, 0xff, 0xe1, 0, SPS.len() as u8];
        r.extend_from_slice(SPS);
        r.extend_from_slice(&[1, 0, PPS.len() as u8]);
        r.extend_from_slice(PPS);
        r
    }

    fn nals(units: &[&[u8]]) -> Vec<u8> {
        let mut v = Vec::new();
        for u in units {
            v.extend_from_slice(&(u.len() as u32).to_be_bytes());
            v.extend_from_slice(u);
        }
        v
    }

    fn stream() -> Vec<u8> {
        let mut config = vec![0x17, 0, 0, 0, 0];
        config.extend_from_slice(&avcc());
        let mut idr = vec![0x17, 1, 0, 0, 0];
        idr.extend_from_slice(&nals(&[&[0x06, 0x05, 0x01], &[0x65, 0x88, 0x84]]));
        let mut p = vec![0x27, 1, 0, 0, 0];
        p.extend_from_slice(&nals(&[&[0x09, 0x10], &[0x41, 0x9a, 0x02]]));
        flv(&[
            tag(18, b"onMetaData"),
            tag(9, &config),
            tag(9, &idr),
            tag(9, &p),
            tag(9, &[0x17, 2, 0, 0, 0]), // end of sequence
        ])
    }

    fn check(pictures: &[Picture]) {
        assert_eq!(pictures.len(), 2);
        assert!(pictures[0].key && !pictures[1].key);
        let params = [START, SPS, START, PPS].concat();
        assert_eq!(*pictures[0].params, params);
        let idr = [AUD, START, &[0x06, 0x05, 0x01], START, &[0x65, 0x88, 0x84]].concat();
        assert_eq!(pictures[0].data, idr);
        // The worker's own delimiter is dropped (ours leads every picture).
        assert_eq!(pictures[1].data, [AUD, START, &[0x41, 0x9a, 0x02]].concat());
    }

    #[test]
    fn flv_pictures_become_annex_b_in_one_piece_or_byte_by_byte() {
        let s = stream();
        let mut r = FlvReader::default();
        let all = r.push(&s).unwrap();
        r.end().unwrap();
        check(&all);

        let mut r = FlvReader::default();
        let mut all = Vec::new();
        for b in &s {
            all.extend(r.push(std::slice::from_ref(b)).unwrap());
        }
        r.end().unwrap();
        check(&all);
    }

    #[test]
    fn enhanced_flv_avc_tags_are_read_too() {
        let mut config = vec![0x90];
        config.extend_from_slice(b"avc1");
        config.extend_from_slice(&avcc());
        let mut idr = vec![0x93]; // key frame, coded frames without composition time
        idr.extend_from_slice(b"avc1");
        idr.extend_from_slice(&nals(&[&[0x65, 0x88]]));
        let mut r = FlvReader::default();
        let p = r.push(&flv(&[tag(9, &config), tag(9, &idr)])).unwrap();
        assert_eq!(p.len(), 1);
        assert!(p[0].key);
        assert_eq!(p[0].data, [AUD, START, &[0x65, 0x88]].concat());
    }

    #[test]
    fn broken_flv_is_an_error_not_a_panic() {
        let s = stream();
        let mut r = FlvReader::default();
        r.push(&s[..s.len() - 3]).unwrap();
        assert!(r.end().is_err(), "a truncated tag is reported");

        let mut r = FlvReader::default();
        assert!(r.push(b"RIFF\0\0\0\0\0\0\0\0\0").is_err());

        // A picture before its decoder configuration, a non-H.264 codec, junk lengths.
        let mut p = vec![0x27, 1, 0, 0, 0];
        p.extend_from_slice(&nals(&[&[0x41, 0x9a]]));
        assert!(FlvReader::default().push(&flv(&[tag(9, &p)])).is_err());
        assert!(FlvReader::default()
            .push(&flv(&[tag(9, &[0x12, 0, 0, 0, 0])]))
            .is_err());
        let mut config = vec![0x17, 0, 0, 0, 0];
        config.extend_from_slice(&avcc());
        let bad = [0x27, 1, 0, 0, 0, 0, 0, 0, 99, 0x41];
        assert!(FlvReader::default()
            .push(&flv(&[tag(9, &config), tag(9, &bad)]))
            .is_err());
        for cut in 0..avcc().len() {
            let mut c = vec![0x17, 0, 0, 0, 0];
            c.extend_from_slice(&avcc()[..cut]);
            let _ = FlvReader::default().push(&flv(&[tag(9, &c)]));
        }
    }
}
