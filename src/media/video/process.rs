//! One ffmpeg child process: stdin for the caller, stdout handed to a consumer on its own
//! thread (so ffmpeg can never block on a full pipe), the tail of stderr kept for error
//! messages, and the child killed and reaped if it is dropped unfinished.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::thread::JoinHandle;

use super::missing;
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
}

/// Makes `command`'s process start `steps` nicer than this one (nothing for 0 or less: an
/// encoder is never given more priority than the service).
#[cfg(unix)]
fn lower_priority(command: &mut Command, steps: i32) {
    use std::os::unix::process::CommandExt;

    extern "C" {
        /// POSIX nice(3): adds `inc` to the calling process's niceness (libc, which the
        /// standard library links).
        fn nice(inc: std::ffi::c_int) -> std::ffi::c_int;
    }

    if steps <= 0 {
        return;
    }
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe work is allowed: nice(3) is a system call on the child itself (no
    // allocation, no lock). Failing (already at the lowest priority) leaves it as it is.
    unsafe {
        command.pre_exec(move || {
            nice(steps);
            Ok(())
        });
    }
}

#[cfg(not(unix))]
fn lower_priority(_: &mut Command, _: i32) {}

pub(super) fn spawn_thread<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<JoinHandle<T>, Error> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| Error::Internal(format!("cannot start a thread: {e}")))
}

impl Process {
    /// Starts `ffmpeg` with `args`, `nice` added to its niceness (see
    /// [`super::EncoderSettings::nice`]).
    pub(super) fn spawn(
        ffmpeg: &Path,
        nice: i32,
        args: &[String],
        role: &str,
        mut consume: StdoutConsumer,
    ) -> Result<Self, Error> {
        let mut command = Command::new(ffmpeg);
        command
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        lower_priority(&mut command, nice);
        let mut child = command.spawn().map_err(|e| missing(ffmpeg, &e))?;
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
        };
        p.stderr = Some(stderr?); // on error, Drop kills and reaps the child
        Ok(p)
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
        let status = self.child.take().map(|mut c| c.wait());
        let bytes = self.stdout.take().map_or(0, |t| t.join().unwrap_or(0));
        let stderr = self
            .stderr
            .take()
            .map(|t| t.join().unwrap_or_default())
            .unwrap_or_default();
        match status {
            Some(Ok(s)) if s.success() => Ok(bytes),
            Some(Ok(s)) => Err(Error::Encoder(format!(
                "{} exited with {s}: {}",
                self.role,
                String::from_utf8_lossy(&stderr).trim()
            ))),
            Some(Err(e)) => Err(Error::Encoder(format!("waiting for {}: {e}", self.role))),
            None => Ok(bytes),
        }
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

    /// The niceness of process `pid` (the 19th field of its stat).
    fn nice_of(pid: &str) -> i32 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
        fields[16].parse().unwrap()
    }

    #[test]
    fn a_niced_process_runs_at_a_lower_priority() {
        let own = nice_of("self");
        for steps in [0, 7] {
            // `cat` waits on its stdin, like an encoder waiting for frames.
            let p = Process::spawn(Path::new("cat"), steps, &[], "cat", Box::new(|_| {})).unwrap();
            let pid = p.child.as_ref().unwrap().id().to_string();
            assert_eq!(nice_of(&pid), (own + steps).min(19), "nice {steps}");
        }
        // Never more priority than the caller.
        let p = Process::spawn(Path::new("cat"), -5, &[], "cat", Box::new(|_| {})).unwrap();
        assert_eq!(nice_of(&p.child.as_ref().unwrap().id().to_string()), own);
    }
}
