//! Raw frames into an encoder's stdin without copying them in the kernel.
//!
//! `write(2)` into a pipe copies every byte of every frame (a 1280×720 frame is 1.4 MB; `perf`
//! of a 40 s request on the 720p photo counted the feeders' copies at about 4 % of the
//! request's CPU). `vmsplice(2)` hands the pipe references to the frame's pages instead, and
//! ffmpeg's `read` copies from them: one copy instead of two. The price is that a frame's
//! buffer must stay unchanged until ffmpeg has read it. A pipe references at most its
//! capacity of data, so once later frames have filled that capacity an earlier frame's pages
//! are out of it: [`FrameFeed`] keeps the buffers of the last frames it spliced, hands older
//! ones back for reuse ([`FramePool`]), and at the end waits for the pipe to drain (or its
//! reader to go) before it lets its last buffers go. That holds for a reader that copies
//! with `read(2)`, as ffmpeg reads its input; one that moved the pages on with `splice(2)` or
//! `tee(2)` would take the references out of this pipe's count.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::process::ChildStdin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::media::yuv::{Region, Yuv420};

/// The longest pause between two looks at a draining pipe.
const DRAIN_POLL_MAX: Duration = Duration::from_millis(20);

/// Frame buffers handed back by the feeders, for the producer to fill again (a fresh buffer
/// of a frame's size is mapped page by page on each use).
#[derive(Clone)]
pub(super) struct FramePool {
    free: Arc<Mutex<Vec<Pooled>>>,
    /// Buffers kept at most.
    cap: usize,
}

/// A frame's bytes on their way through a [`FrameFeed`] and back to their [`FramePool`],
/// with the frame they hold, if they hold one: `(its producer's History's id, its number
/// there)`.
pub(super) struct Pooled {
    bytes: Vec<u8>,
    frame: Option<(u64, u64)>,
}

impl std::ops::Deref for Pooled {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl From<Vec<u8>> for Pooled {
    fn from(bytes: Vec<u8>) -> Self {
        Pooled { bytes, frame: None }
    }
}

impl FramePool {
    pub(super) fn new(cap: usize) -> Self {
        FramePool {
            free: Arc::default(),
            cap,
        }
    }

    /// `bytes` in a buffer from the pool, or a new one.
    pub(super) fn filled(&self, bytes: &[u8]) -> Pooled {
        refilled(self.lock().pop(), bytes)
    }

    /// The latest frame of `history`, `frame`, in a buffer from the pool: where the buffer
    /// holds an earlier frame of the same history and the history knows where the frames
    /// since differ from it, only that region is copied (a photo's face, not the whole
    /// frame); else the whole frame.
    pub(super) fn updated(&self, frame: &Yuv420, history: &History) -> Pooled {
        let bytes = frame.bytes();
        let mut buf = match self.lock().pop() {
            Some(mut buf) if buf.bytes.len() == bytes.len() => {
                let since = buf
                    .frame
                    .filter(|&(id, _)| id == history.id)
                    .and_then(|(_, n)| history.since(n));
                match since {
                    Some(Some(r)) => frame.copy_region_into(&r, &mut buf.bytes),
                    Some(None) => {}
                    None => buf.bytes.copy_from_slice(bytes),
                }
                buf
            }
            other => refilled(other, bytes),
        };
        buf.frame = history.latest().map(|n| (history.id, n));
        buf
    }

    fn put(&self, buf: Pooled) {
        let mut free = self.lock();
        if free.len() < self.cap {
            free.push(buf);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Pooled>> {
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// `bytes` in `reused`'s buffer (or a new one), holding no known frame.
fn refilled(reused: Option<Pooled>, bytes: &[u8]) -> Pooled {
    let mut buf = reused.map(|p| p.bytes).unwrap_or_default();
    buf.clear();
    buf.extend_from_slice(bytes);
    buf.into()
}

/// Frames a [`History`] remembers the changes of: more than are usually in flight between a
/// producer and its pool (a segmented encoder queues a second of frames per worker, within
/// 128 MiB: 2 × 25 and the pipes' few at 512×512 on two workers; 325 at most at 512×512), so
/// that a reused buffer's frame is still known. An older one is copied whole.
const HISTORY: usize = 1024;

/// Ids of histories, so that a buffer is only ever brought up to date by its own.
static HISTORIES: AtomicU64 = AtomicU64::new(0);

/// Where each of a producer's last frames differs from the frame before it, so that a pooled
/// buffer holding one of them is brought up to the latest by copying only what changed since
/// ([`FramePool::updated`]).
#[derive(Debug)]
pub(super) struct History {
    /// Unique in this process.
    id: u64,
    /// Frames recorded.
    frames: u64,
    /// The changes of the last frames recorded, oldest first: `None` anywhere (or unknown),
    /// `Some(None)` nowhere.
    recent: VecDeque<Option<Option<Region>>>,
}

impl Default for History {
    fn default() -> Self {
        History {
            id: HISTORIES.fetch_add(1, Ordering::Relaxed),
            frames: 0,
            recent: VecDeque::new(),
        }
    }
}

impl History {
    /// Records the next frame: where it differs from the one before (`None`: anywhere, or
    /// not known; an empty region: nowhere).
    pub(super) fn push(&mut self, changed: Option<Region>) {
        if self.recent.len() == HISTORY {
            self.recent.pop_front();
        }
        let change = changed.map(|r| (r.width > 0 && r.height > 0).then_some(r));
        self.recent.push_back(change);
        self.frames += 1;
    }

    /// The number of the latest frame (`None` before the first).
    fn latest(&self) -> Option<u64> {
        self.frames.checked_sub(1)
    }

    /// Where the latest frame differs from frame `n`: `Some(None)` nowhere, `Some(region)`
    /// within it, `None` anywhere or not known (a frame too old, or a change not told).
    fn since(&self, n: u64) -> Option<Option<Region>> {
        let latest = self.latest()?;
        if n > latest || latest - n > self.recent.len() as u64 {
            return None;
        }
        let later = (latest - n) as usize;
        let mut union: Option<Region> = None;
        for change in self.recent.iter().skip(self.recent.len() - later) {
            if let Some(r) = (*change)? {
                union = Some(union.map_or(r, |u| u.union(&r)));
            }
        }
        Some(union)
    }
}

/// Writes whole frames into a pipe (see the module's documentation).
pub(super) struct FrameFeed {
    /// The pipe (taken out only by [`Self::into_pipe`]).
    pipe: Option<ChildStdin>,
    /// The last frames spliced, oldest first: the pipe may still reference their pages.
    held: VecDeque<Pooled>,
    /// Bytes the pipe can reference (its capacity).
    capacity: usize,
    /// `vmsplice` works on this pipe (else plain writes).
    splice: bool,
    pool: FramePool,
    /// Bytes [`Self::widen`] added to the pipe (counted in [`WIDENED`] until dropped).
    widened: usize,
}

/// Pipe capacity added by [`FrameFeed::widen`] in this process, held within
/// [`widen_budget`].
static WIDENED: AtomicUsize = AtomicUsize::new(0);

/// How much pipe capacity this process may add by widening: a quarter of the per-user
/// allowance (`/proc/sys/fs/pipe-user-pages-soft`, 64 MiB by default). Past the allowance
/// Linux gives every new pipe of an unprivileged user (a container's root without
/// CAP_SYS_RESOURCE included) two pages, which would slow every encoder's pipes; so widening
/// stops well before it, and the rest of the sessions keep the default pipes.
fn widen_budget() -> usize {
    static BUDGET: OnceLock<usize> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        let pages = std::fs::read_to_string("/proc/sys/fs/pipe-user-pages-soft")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(16_384);
        if pages == 0 {
            usize::MAX // no allowance set
        } else {
            pages * 4096 / 4
        }
    })
}

impl FrameFeed {
    pub(super) fn new(pipe: ChildStdin, pool: FramePool) -> Self {
        // SAFETY: F_GETPIPE_SZ reads the pipe's capacity; -1 if `pipe` is not a pipe.
        let capacity = unsafe { libc::fcntl(pipe.as_raw_fd(), libc::F_GETPIPE_SZ) };
        FrameFeed {
            pipe: Some(pipe),
            held: VecDeque::new(),
            capacity: usize::try_from(capacity).unwrap_or(0),
            splice: capacity > 0,
            pool,
            widened: 0,
        }
    }

    /// Asks for a pipe that holds `bytes` (a frame) at once, at most 1 MiB (Linux's default
    /// `pipe-max-size`): a frame then goes in with one call and its reader takes it with
    /// one wake-up, where the default 64 KiB pipe passes a 512×512 frame in six rounds of
    /// both sides sleeping and waking. Nothing changes where the system refuses, or where
    /// this process's widening would pass its budget ([`widen_budget`]).
    pub(super) fn widen(&mut self, bytes: usize) {
        let want = bytes.clamp(4096, 1 << 20).next_power_of_two().min(1 << 20);
        if want <= self.capacity {
            return;
        }
        let add = want - self.capacity;
        if WIDENED.fetch_add(add, Ordering::Relaxed) + add > widen_budget() {
            WIDENED.fetch_sub(add, Ordering::Relaxed);
            return;
        }
        // SAFETY: F_SETPIPE_SZ asks the kernel to resize the pipe; it returns the size set,
        // or -1 and leaves the pipe as it was.
        let set = unsafe { libc::fcntl(self.fd(), libc::F_SETPIPE_SZ, want as libc::c_int) };
        let added = usize::try_from(set).map_or(0, |set| set.saturating_sub(self.capacity));
        WIDENED.fetch_sub(add - added.min(add), Ordering::Relaxed);
        self.widened += added.min(add);
        self.capacity += added;
    }

    /// Writes `frame`; an error means the reader has gone (or the pipe failed).
    pub(super) fn write(&mut self, frame: Pooled) -> io::Result<()> {
        if !self.splice {
            self.pipe_mut().write_all(&frame)?;
            self.pool.put(frame);
            return Ok(());
        }
        let mut at = 0;
        while at < frame.len() {
            let iov = libc::iovec {
                iov_base: frame[at..].as_ptr() as *mut libc::c_void,
                iov_len: frame.len() - at,
            };
            // SAFETY: the iovec points into `frame`, which is kept unchanged in `held` until
            // the pipe can no longer reference it (see `release`).
            let n = unsafe { libc::vmsplice(self.fd(), &iov, 1, 0) };
            if n >= 0 {
                at += n as usize;
                continue;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => {}
                // Not a pipe this can splice into, or vmsplice refused (a sandbox): copy, as
                // write(2) does, from here on.
                Some(libc::EINVAL | libc::ENOSYS | libc::EPERM) if at == 0 => {
                    self.splice = false;
                    return self.write(frame);
                }
                // The reader has gone, so nothing will read the pages any more.
                Some(libc::EPIPE) => {
                    self.held.clear();
                    return Err(e);
                }
                // Anything else: the pipe may still reference this frame's pages and those
                // held, so they stay held until the end of the feed.
                _ => {
                    self.held.push_back(frame);
                    return Err(e);
                }
            }
        }
        // Some of this frame's pages (or all of a small one's) may be in the pipe now.
        self.held.push_back(frame);
        self.release();
        Ok(())
    }

    fn fd(&self) -> std::os::fd::RawFd {
        self.pipe.as_ref().map_or(-1, |p| p.as_raw_fd())
    }

    fn pipe_mut(&mut self) -> &mut ChildStdin {
        self.pipe
            .as_mut()
            .expect("the pipe is taken only by into_pipe")
    }

    /// Waits for the pipe to drain (see [`Drop`]), hands every held buffer back, and returns
    /// the pipe for more frames later (an encoder process kept for the next render).
    pub(super) fn into_pipe(mut self) -> ChildStdin {
        self.release_all();
        self.pipe.take().expect("the pipe is taken only once")
    }

    /// After the pipe has drained (or lost its reader), no buffer is referenced any more.
    fn release_all(&mut self) {
        if self.held.is_empty() {
            return;
        }
        self.drain();
        for f in std::mem::take(&mut self.held) {
            self.pool.put(f);
        }
    }

    /// Hands back the held frames the pipe can no longer reference: those with at least
    /// the pipe's capacity spliced after them.
    fn release(&mut self) {
        // The reader could have enlarged the pipe since: count the largest capacity seen.
        // SAFETY: F_GETPIPE_SZ reads the pipe's capacity (-1 on error).
        let now = unsafe { libc::fcntl(self.fd(), libc::F_GETPIPE_SZ) };
        self.capacity = self.capacity.max(usize::try_from(now).unwrap_or(0));
        let mut after = 0;
        let mut keep = 0;
        for f in self.held.iter().rev() {
            if after >= self.capacity {
                break;
            }
            after += f.len();
            keep += 1;
        }
        while self.held.len() > keep {
            if let Some(f) = self.held.pop_front() {
                self.pool.put(f);
            }
        }
    }

    /// Waits until the pipe is empty or has no reader, so the held buffers can go. A reader
    /// that has stopped reading keeps it waiting, as a blocking `write` of the last frame
    /// would; an encoder dropped unfinished kills its processes first, which ends the wait.
    fn drain(&self) {
        let fd = self.fd();
        let mut pause = Duration::from_micros(500);
        loop {
            let mut queued: libc::c_int = 0;
            // SAFETY: FIONREAD writes the bytes in the pipe into `queued`.
            let r = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut queued) };
            if r != 0 || queued == 0 {
                return;
            }
            let mut p = libc::pollfd {
                fd,
                events: 0,
                revents: 0,
            };
            // SAFETY: poll on one descriptor of ours; POLLERR on a pipe's write end means
            // its reader has closed it.
            unsafe { libc::poll(&mut p, 1, 0) };
            if p.revents & libc::POLLERR != 0 {
                return;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(DRAIN_POLL_MAX);
        }
    }
}

impl Drop for FrameFeed {
    fn drop(&mut self) {
        WIDENED.fetch_sub(std::mem::take(&mut self.widened), Ordering::Relaxed);
        if self.pipe.is_some() {
            self.release_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::Read;

    /// Frames that differ in every byte from the next, so a buffer reused under the reader
    /// would show.
    fn frame(k: usize, len: usize) -> Vec<u8> {
        (0..len).map(|i| ((i * 31 + k * 17) % 251) as u8).collect()
    }

    /// A pipe whose write end is a `ChildStdin`, as a worker's is.
    fn pipe_pair() -> (File, ChildStdin) {
        let (r, w) = super::super::spawn::pipe().unwrap();
        (r, ChildStdin::from(std::os::fd::OwnedFd::from(w)))
    }

    #[test]
    fn a_widened_pipe_holds_a_whole_frame_and_frames_still_arrive_whole() {
        let (mut out, stdin) = pipe_pair();
        let mut feed = FrameFeed::new(stdin, FramePool::new(4));
        feed.widen(393_216);
        // SAFETY: F_GETPIPE_SZ reads the pipe's capacity.
        let size = unsafe { libc::fcntl(feed.fd(), libc::F_GETPIPE_SZ) };
        assert_eq!(size, 1 << 19, "a 512×512 frame's pipe");
        // The whole frame goes in with nobody reading yet.
        let f = frame(0, 393_216);
        feed.write(f.clone().into()).unwrap();
        let mut got = vec![0u8; f.len()];
        out.read_exact(&mut got).unwrap();
        assert!(got == f);
        // Never past 1 MiB, never smaller than it is.
        feed.widen(5 << 20);
        feed.widen(10);
        let size = unsafe { libc::fcntl(feed.fd(), libc::F_GETPIPE_SZ) };
        assert_eq!(size, 1 << 20);
        // What it added is counted while it lives (other tests' feeds may count too).
        assert_eq!(feed.widened, (1 << 20) - 65_536);
        assert!(WIDENED.load(Ordering::Relaxed) >= feed.widened);
    }

    #[test]
    fn spliced_frames_arrive_whole_and_in_order_while_their_buffers_are_reused() {
        for len in [1000usize, 4096, 70_000, 393_216] {
            let (mut out, stdin) = pipe_pair();
            // A slow reader that copies with read(2), as ffmpeg does: the feed runs ahead
            // as far as the pipe lets it.
            let reader = std::thread::spawn(move || {
                let mut all = Vec::new();
                let mut buf = vec![0u8; 3000];
                loop {
                    match out.read(&mut buf).unwrap() {
                        0 => break,
                        n => all.extend_from_slice(&buf[..n]),
                    }
                    std::thread::sleep(Duration::from_micros(50));
                }
                all
            });
            let pool = FramePool::new(4);
            let mut feed = FrameFeed::new(stdin, pool.clone());
            assert!(feed.splice, "a pipe splices");
            let frames = 40;
            for k in 0..frames {
                // Filled from the pool: the buffers the feed handed back are written over.
                let buf = pool.filled(&frame(k, len));
                feed.write(buf).unwrap();
            }
            drop(feed);
            let all = reader.join().unwrap();
            assert_eq!(all.len(), frames * len, "frame size {len}");
            for k in 0..frames {
                assert!(
                    all[k * len..(k + 1) * len] == frame(k, len)[..],
                    "frame {k} of size {len}"
                );
            }
            assert!(pool.lock().len() <= 4);
        }
    }

    /// A `width`×`height` RGB picture, pseudo-random from the seed.
    fn noise(width: u32, height: u32, seed: u32) -> crate::media::image::Frame {
        let rgb = (0..width * height * 3)
            .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) >> 7)
            .map(|v| v as u8)
            .collect();
        crate::media::image::Frame::new(width, height, rgb)
    }

    /// A 64×48 frame whose bytes differ from seed to seed.
    fn yuv(seed: u32) -> Yuv420 {
        Yuv420::from_rgb(&noise(64, 48, seed))
    }

    fn region(x: u32, y: u32, width: u32, height: u32) -> Region {
        Region {
            x,
            y,
            width,
            height,
        }
    }

    #[test]
    fn a_history_knows_where_the_latest_frame_differs_from_an_earlier_one() {
        let mut h = History::default();
        assert_eq!(h.latest(), None);
        assert_eq!(h.since(0), None, "nothing recorded");
        h.push(None); // frame 0: anything
        h.push(Some(region(0, 0, 4, 4))); // 1
        h.push(Some(Region::EMPTY)); // 2: the same again
        h.push(Some(region(8, 2, 2, 6))); // 3
        assert_eq!(h.latest(), Some(3));
        assert_eq!(h.since(3), Some(None), "the latest itself");
        assert_eq!(h.since(2), Some(Some(region(8, 2, 2, 6))));
        assert_eq!(
            h.since(1),
            Some(Some(region(8, 2, 2, 6))),
            "2 changed nothing"
        );
        assert_eq!(h.since(0), Some(Some(region(0, 0, 10, 8))), "the union");
        h.push(None); // 4: anywhere
        assert_eq!(h.since(3), None);
        assert_eq!(h.since(5), None, "a frame not yet written");
        // Frames older than the history remembers are not known.
        for _ in 0..HISTORY {
            h.push(Some(Region::EMPTY));
        }
        assert_eq!(h.since(4), Some(None), "the oldest remembered");
        assert_eq!(h.since(3), None, "one too old");
    }

    #[test]
    fn a_reused_buffer_is_brought_up_to_the_latest_frame_by_copying_what_changed() {
        let pool = FramePool::new(8);
        let mut history = History::default();
        // Each frame is the last with one region changed, or all of it (`None`).
        let changes = [
            None,
            Some(region(0, 0, 16, 16)),
            Some(region(48, 32, 16, 16)),
            Some(Region::EMPTY),
            None,
            Some(region(10, 20, 30, 20)),
            Some(region(2, 2, 2, 2)),
            Some(region(0, 46, 64, 2)),
        ];
        let mut frame = yuv(0);
        // Buffers come back to the pool three frames after they were filled, as a feed
        // hands them back once later frames fill the pipe.
        let mut in_flight: VecDeque<Pooled> = VecDeque::new();
        for (k, changed) in changes.iter().cycle().take(200).enumerate() {
            let seed = k as u32 + 1;
            match changed {
                None => frame = yuv(seed),
                Some(r) if r.width > 0 => {
                    frame.write_rgb(r.x, r.y, &noise(r.width, r.height, seed))
                }
                Some(_) => {}
            }
            history.push(*changed);
            let buf = pool.updated(&frame, &history);
            assert!(&buf[..] == frame.bytes(), "frame {k}");
            in_flight.push_back(buf);
            if in_flight.len() > 3 {
                pool.put(in_flight.pop_front().expect("queued"));
            }
        }
    }

    #[test]
    fn only_the_region_told_is_copied() {
        // A producer that says a frame changed only in a region, when it changed elsewhere
        // too, gets the old pixels there: what shows that the rest was not copied.
        let pool = FramePool::new(2);
        let mut history = History::default();
        let first = yuv(1);
        history.push(None);
        let buf = pool.updated(&first, &history);
        assert!(&buf[..] == first.bytes());
        pool.put(buf);
        let second = yuv(2); // differs everywhere
        let face = region(16, 8, 32, 24);
        history.push(Some(face));
        let buf = pool.updated(&second, &history);
        let mut expected = first.bytes().to_vec();
        second.copy_region_into(&face, &mut expected);
        assert!(buf[..] == expected[..]);
        assert!(buf[..] != second.bytes()[..]);
        // A buffer of another size, or one holding no known frame, is filled whole.
        pool.put(Pooled::from(vec![7u8; 10]));
        history.push(Some(face));
        assert!(&pool.updated(&second, &history)[..] == second.bytes());
        pool.put(Pooled::from(vec![7u8; second.bytes().len()]));
        history.push(Some(Region::EMPTY));
        let buf = pool.updated(&second, &history);
        assert!(&buf[..] == second.bytes());
        // A buffer filled for another producer's history is copied whole, whatever its number.
        let mut other = History::default();
        for _ in 0..4 {
            other.push(Some(face));
        }
        pool.put(buf);
        let third = yuv(3);
        assert!(&pool.updated(&third, &other)[..] == third.bytes());
    }

    #[test]
    fn a_reader_that_goes_is_an_error_and_nothing_waits() {
        let (mut out, stdin) = pipe_pair();
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 10];
            out.read_exact(&mut buf).unwrap();
            // `out` closes here, with most of a frame still in the pipe.
        });
        let mut feed = FrameFeed::new(stdin, FramePool::new(2));
        let t = std::time::Instant::now();
        let mut failed = false;
        for k in 0..100 {
            if feed.write(frame(k, 100_000).into()).is_err() {
                failed = true;
                break;
            }
        }
        reader.join().unwrap();
        assert!(failed, "writing after the reader went must fail");
        drop(feed);
        assert!(t.elapsed() < Duration::from_secs(10));
    }
}
