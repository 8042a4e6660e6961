//! One ffmpeg child process: stdin for the caller, stdout handed to a consumer on its own
//! thread (so ffmpeg can never block on a full pipe), the tail of stderr kept for error
//! messages, and the child killed and reaped if it is dropped unfinished.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ChildStdin;
use std::thread::JoinHandle;

use super::missing;
use super::spares::Spares;
use super::spawn::{pipe, spawn, Child};
use crate::media::Error;

/// Keeps the last 16 KiB of ffmpeg's stderr for error messages.
const STDERR_TAIL: usize = 16 << 10;

/// Receives ffmpeg's stdout: `Some(bytes)` as they arrive, `None` once at the end.
pub(super) type StdoutConsumer = Box<dyn FnMut(Option<&[u8]>) + Send>;

pub(super) struct Process {
    /// What this process is, for error messages ("ffmpeg", "encoder worker 2", ...).
    role: String,
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    stdout: Option<JoinHandle<u64>>,
    stderr: Option<JoinHandle<Vec<u8>>>,
    /// The write end of descriptor 3's pipe until it is fed.
    fd3: Option<File>,
    /// Copies a file into descriptor 3: a read error, or none.
    fd3_feeder: Option<JoinHandle<std::io::Result<()>>>,
}

pub(super) fn spawn_thread<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<JoinHandle<T>, Error> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| Error::Internal(format!("cannot start a thread: {e}")))
}

/// What one ffmpeg process is started with; equal launches are interchangeable (see
/// [`Spares`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Launch {
    pub ffmpeg: PathBuf,
    /// Added to the niceness (see [`super::EncoderSettings::nice`]).
    pub nice: i32,
    pub args: Vec<String>,
    /// What the process's descriptor 3 is (`pipe:3` in the arguments).
    pub fd3: Fd3,
}

/// A process's descriptor 3: none, or a pipe for a second input, which the caller feeds
/// ([`Process::feed_fd3`]), or for a second output, which the caller reads
/// ([`Process::take_fd3`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Fd3 {
    None,
    Input,
    Output,
}

/// A started process whose pipes nobody reads yet; killed and reaped if dropped.
pub(super) struct Started {
    child: Option<Child>,
    fd3: Option<File>,
}

impl Started {
    /// Its process id (none once reaped).
    pub(super) fn id(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the process still runs.
    pub(super) fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Launch {
    /// Starts the process, its stdio piped (and descriptor 3, see [`Self::fd3`]), without
    /// forking the service ([`spawn`]).
    pub(super) fn start(&self) -> Result<Started, Error> {
        let made = || pipe().map_err(|e| Error::Internal(format!("cannot make a pipe: {e}")));
        // (the child's end, ours)
        let (theirs, fd3) = match self.fd3 {
            Fd3::None => (None, None),
            Fd3::Input => {
                let (reader, writer) = made()?;
                (Some(reader), Some(writer))
            }
            Fd3::Output => {
                let (reader, writer) = made()?;
                (Some(writer), Some(reader))
            }
        };
        // The parent's copy of the child's end closes once the child has it, so the child's
        // exit breaks the pipe for the writer, or ends the reader's input.
        let child = spawn(&self.ffmpeg, &self.args, theirs, self.nice)
            .map_err(|e| missing(&self.ffmpeg, &e))?;
        Ok(Started {
            child: Some(child),
            fd3,
        })
    }
}

impl Process {
    /// Starts `launch` (or takes a process already started for it from `spares`); its
    /// stdout goes to `consume` on a thread of its own.
    pub(super) fn spawn(
        launch: &Launch,
        spares: Option<&Spares>,
        role: &str,
        mut consume: StdoutConsumer,
    ) -> Result<Self, Error> {
        let mut started = match spares.and_then(|s| s.take(launch)) {
            Some(s) => s,
            None => launch.start()?,
        };
        // The replacement starts now (a moment later, on the pool's thread), not when this
        // process ends: a request that follows this one at once finds it started.
        if let Some(spares) = spares {
            spares.refill_later(launch.clone());
        }
        let mut child = started.child.take().expect("a started child");
        let fd3 = started.fd3.take();
        let stdin = child.stdin.take();
        let mut out = child.stdout.take().expect("piped stdout");
        let mut err = child.stderr.take().expect("piped stderr");
        let stdout = spawn_thread("ffmpeg-stdout", move || {
            let mut buf = vec![0u8; 64 << 10];
            let mut total = 0u64;
            loop {
                let n = match out.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                total += n as u64;
                consume(Some(&buf[..n]));
            }
            consume(None);
            total
        });
        let stdout = match stdout {
            Ok(t) => t,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        };
        let stderr = spawn_thread("ffmpeg-stderr", move || {
            let mut tail = Vec::new();
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                tail.extend_from_slice(&buf[..n]);
                if tail.len() > 2 * STDERR_TAIL {
                    tail.drain(..tail.len() - STDERR_TAIL);
                }
            }
            tail
        });
        let mut p = Process {
            role: role.to_string(),
            child: Some(child),
            stdin,
            stdout: Some(stdout),
            stderr: None,
            fd3,
            fd3_feeder: None,
        };
        p.stderr = Some(stderr?); // on error, Drop kills and reaps the child
        Ok(p)
    }

    /// Copies the file at `path` into the process's descriptor 3 on a thread of its own,
    /// then closes it (the end of that input).
    pub(super) fn feed_fd3(&mut self, path: &Path) -> Result<(), Error> {
        let mut pipe = self
            .fd3
            .take()
            .ok_or_else(|| Error::Internal(format!("{} has no descriptor 3", self.role)))?;
        let mut file = std::fs::File::open(path)
            .map_err(|e| Error::Encoder(format!("cannot read {}: {e}", path.display())))?;
        let feeder = spawn_thread("ffmpeg-fd3", move || {
            std::io::copy(&mut file, &mut pipe).map(|_| ())
        })?;
        self.fd3_feeder = Some(feeder);
        Ok(())
    }

    /// Hands the read end of descriptor 3's pipe ([`Fd3::Output`]) to the caller.
    pub(super) fn take_fd3(&mut self) -> Option<File> {
        self.fd3.take()
    }

    /// Hands the stdin pipe to someone else (closing it is then their business).
    pub(super) fn take_stdin(&mut self) -> Option<ChildStdin> {
        self.stdin.take()
    }

    /// Writes to stdin; if ffmpeg stopped reading, it failed, and its stderr says why.
    pub(super) fn write_all(&mut self, data: &[u8]) -> Result<(), Error> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| Error::Encoder(format!("{} closed", self.role)))?;
        if let Err(e) = stdin.write_all(data) {
            return Err(match self.finish() {
                Err(err) => err,
                Ok(_) => Error::Encoder(format!("{} stopped reading: {e}", self.role)),
            });
        }
        Ok(())
    }

    /// Closes stdin, waits for ffmpeg and its stdout consumer; returns the bytes it wrote.
    pub(super) fn finish(&mut self) -> Result<u64, Error> {
        drop(self.stdin.take());
        drop(self.fd3.take());
        let status = self.child.take().map(|mut c| c.wait());
        let bytes = self.stdout.take().map_or(0, |t| t.join().unwrap_or(0));
        let stderr = self
            .stderr
            .take()
            .map(|t| t.join().unwrap_or_default())
            .unwrap_or_default();
        // The child has exited, so its end of the pipe is closed and the feeder is done.
        let fed = self.fd3_feeder.take().map(|t| {
            t.join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the feeder panicked")))
        });
        match status {
            // A broken pipe means ffmpeg stopped reading that input: its own choice, as it
            // succeeded.
            Some(Ok(s)) if s.success() => match fed {
                Some(Err(e)) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Error::Encoder(
                    format!("feeding the second input of {}: {e}", self.role),
                )),
                _ => Ok(bytes),
            },
            Some(Ok(s)) => Err(Error::Encoder(format!(
                "{} exited with {s}: {}",
                self.role,
                String::from_utf8_lossy(&stderr).trim()
            ))),
            Some(Err(e)) => Err(Error::Encoder(format!("waiting for {}: {e}", self.role))),
            None => Ok(bytes),
        }
    }

    /// Renames the process in its error messages (a kept worker serving another render).
    pub(super) fn set_role(&mut self, role: &str) {
        role.clone_into(&mut self.role);
    }

    /// The process id, while it has not been reaped.
    pub(super) fn id(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Whether the process has exited (it is reaped by [`Self::finish`]).
    pub(super) fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_none_or(|c| !matches!(c.try_wait(), Ok(None)))
    }

    /// Kills ffmpeg if it is still running, without waiting for anything.
    pub(super) fn signal_kill(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
        }
    }

    /// Kills ffmpeg (if still running) and reaps it.
    pub(super) fn kill(&mut self) {
        self.signal_kill();
        let _ = self.finish();
    }
}

impl Drop for Process {
    /// An unfinished process (an error, a client that left) is killed and reaped.
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The niceness of process `pid` once it runs `cat` (a niced one starts as `nice`, which
    /// sets its niceness and then runs the program).
    fn nice_of_cat(pid: &str) -> i32 {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap() != "cat\n" {
            assert!(std::time::Instant::now() < until, "{pid} never ran cat");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        nice_of(pid)
    }

    /// The niceness of process `pid` (the 19th field of its stat).
    fn nice_of(pid: &str) -> i32 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
        fields[16].parse().unwrap()
    }

    fn cat(nice: i32, args: &[&str]) -> Launch {
        Launch {
            ffmpeg: "cat".into(),
            nice,
            args: args.iter().map(|a| a.to_string()).collect(),
            fd3: Fd3::None,
        }
    }

    /// What a process wrote to its stdout, gathered by its consumer.
    fn collector() -> (StdoutConsumer, std::sync::Arc<std::sync::Mutex<Vec<u8>>>) {
        let out = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let o = out.clone();
        let consume: StdoutConsumer = Box::new(move |d| {
            if let Some(d) = d {
                o.lock().unwrap().extend_from_slice(d);
            }
        });
        (consume, out)
    }

    #[test]
    fn descriptor_3_carries_a_file_and_spares_are_the_same_processes() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("speech.bin");
        // More than a pipe holds, so the feeder has to wait for the reader.
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&file, &data).unwrap();
        // `cat - /dev/fd/3`: stdin, then descriptor 3.
        let mut launch = cat(0, &["-", "/dev/fd/3"]);
        launch.fd3 = Fd3::Input;
        let spares = Spares::new();
        spares.refill(&launch);
        assert_eq!(spares.idle(), 1);
        for round in 0..2 {
            let (consume, out) = collector();
            let mut p = Process::spawn(&launch, Some(&spares), "cat", consume).unwrap();
            // It takes the spare, and a replacement starts a moment later on the pool's
            // thread, while it still runs: a request right after this one finds it.
            let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while spares.idle() == 0 && std::time::Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            // One, not two: had it not taken the spare, the refill would have added a second.
            std::thread::sleep(super::super::spares::REFILL_DELAY * 2);
            assert_eq!(spares.idle(), 1, "round {round}");
            p.feed_fd3(&file).unwrap();
            p.write_all(b"head:").unwrap();
            assert_eq!(p.finish().unwrap(), 5 + data.len() as u64);
            assert_eq!(out.lock().unwrap()[..5], *b"head:");
            assert!(out.lock().unwrap()[5..] == data[..]);
        }
        // A killed process does not leave its feeder waiting on a full pipe.
        let (consume, _) = collector();
        let mut p = Process::spawn(&launch, Some(&spares), "cat", consume).unwrap();
        p.feed_fd3(&file).unwrap();
        let t = std::time::Instant::now();
        p.kill();
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn a_started_process_has_its_own_stdio_and_sigpipe_at_its_default() {
        // The service ignores SIGPIPE; an encoder must not (it ends when its output goes).
        let launch = Launch {
            ffmpeg: "sh".into(),
            nice: 0,
            args: [
                "-c",
                "read line; echo \"$line\"; grep SigIgn /proc/self/status",
            ]
            .iter()
            .map(|a| a.to_string())
            .collect(),
            fd3: Fd3::None,
        };
        let (consume, out) = collector();
        let mut p = Process::spawn(&launch, None, "sh", consume).unwrap();
        p.write_all(b"hello\n").unwrap();
        p.finish().unwrap();
        let out = String::from_utf8(out.lock().unwrap().clone()).unwrap();
        assert!(out.starts_with("hello\n"), "{out}");
        let ignored = |status: &str| {
            let line = status.lines().find(|l| l.starts_with("SigIgn")).unwrap();
            u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap()
        };
        let sigpipe = 1u64 << (13 - 1);
        let own = std::fs::read_to_string("/proc/self/status").unwrap();
        assert_ne!(ignored(&own) & sigpipe, 0, "this process ignores SIGPIPE");
        assert_eq!(ignored(&out) & sigpipe, 0, "the child does not: {out}");
        // A command that is not there is reported as ffmpeg missing, not as a crash.
        let mut missing = launch.clone();
        missing.ffmpeg = "/nonexistent/ffmpeg".into();
        let e = Process::spawn(&missing, None, "ffmpeg", Box::new(|_| {}))
            .err()
            .expect("no such program");
        assert!(e.to_string().contains("/nonexistent/ffmpeg"), "{e}");
    }

    #[test]
    fn a_started_process_gets_no_other_descriptor_of_this_one() {
        // A descriptor this process holds without close-on-exec, as one inherited from
        // whoever started the service would be.
        let null = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: F_DUPFD returns a new descriptor (or -1), closed below.
        let leaky =
            unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&null), libc::F_DUPFD, 200) };
        assert!(leaky >= 200, "{leaky}");
        let fds = |fd3: Fd3| {
            let launch = Launch {
                ffmpeg: "sh".into(),
                nice: 0,
                args: ["-c", "exec ls /proc/self/fd"]
                    .iter()
                    .map(|a| a.to_string())
                    .collect(),
                fd3,
            };
            let (consume, out) = collector();
            let mut p = Process::spawn(&launch, None, "sh", consume).unwrap();
            p.finish().unwrap();
            let out = String::from_utf8(out.lock().unwrap().clone()).unwrap();
            let mut fds: Vec<i32> = out.split_whitespace().map(|f| f.parse().unwrap()).collect();
            fds.sort_unstable();
            fds
        };
        let plain = fds(Fd3::None);
        let with_fd3 = fds(Fd3::Output);
        // SAFETY: `leaky` is this test's own descriptor.
        unsafe { libc::close(leaky) };
        // `ls` lists its own handle on the directory too, the lowest free number.
        assert_eq!(plain, [0, 1, 2, 3], "the child's stdio and ls's handle");
        assert_eq!(
            with_fd3,
            [0, 1, 2, 3, 4],
            "the child's stdio, fd 3 and ls's handle"
        );
    }

    #[test]
    fn a_niced_process_runs_at_a_lower_priority() {
        let own = nice_of("self");
        for steps in [0, 7] {
            // `cat` waits on its stdin, like an encoder waiting for frames.
            let p = Process::spawn(&cat(steps, &[]), None, "cat", Box::new(|_| {})).unwrap();
            let pid = p.child.as_ref().unwrap().id().to_string();
            assert_eq!(nice_of_cat(&pid), (own + steps).min(19), "nice {steps}");
        }
        // Never more priority than the caller.
        let p = Process::spawn(&cat(-5, &[]), None, "cat", Box::new(|_| {})).unwrap();
        assert_eq!(
            nice_of_cat(&p.child.as_ref().unwrap().id().to_string()),
            own
        );
    }
}
