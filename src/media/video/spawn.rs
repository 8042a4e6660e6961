//! Starting an ffmpeg child without copying the service's address space.
//!
//! `std::process::Command` forks whenever code has to run in the child before `exec` (a
//! `pre_exec` closure: descriptor 3 for the speech, the niceness of a background encoder).
//! A fork copies the page tables of the whole service (the batch buffers of every model
//! instance, the avatars) and leaves each of its pages copy-on-write: after the child has
//! exec'd, the first write to every page, on every thread, still takes a fault. `perf` of a
//! 40 s request on the echo device counted that as most of the instances' kernel time.
//! `posix_spawn` (glibc: `clone(CLONE_VM | CLONE_VFORK)`, then `exec`) shares the memory
//! until `exec` and copies nothing; descriptor 3 is a file action, and a niced process is
//! started through `nice(1)`, which sets its niceness before it runs ffmpeg (setting it from
//! here after the start would race with the threads ffmpeg starts).

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{ChildStderr, ChildStdin, ChildStdout, ExitStatus};

/// Where programs are looked for when the environment has no PATH.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// `program` itself if it names a directory, else the first executable file of that name
/// in `path` (a PATH value); not found otherwise.
fn resolve(program: &OsStr, path: &OsStr) -> io::Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if program.as_bytes().contains(&b'/') {
        return Ok(program.into());
    }
    let found = std::env::split_paths(path)
        .map(|dir| dir.join(program))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        });
    found.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("{} is not on the PATH", program.to_string_lossy()),
        )
    })
}

/// A pipe, both ends close-on-exec: (read end, write end).
pub(super) fn pipe() -> io::Result<(File, File)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two descriptors into the array it is given, which has room for
    // them; on success both are new and owned by nothing else, so each becomes one File.
    unsafe {
        if libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])))
    }
}

/// `fd` itself if it is above the descriptors the child is given (0–3), else a
/// close-on-exec copy of it above them: the file actions then never overwrite a descriptor
/// that a later action still reads (a service started with its stdio closed gets pipes at
/// 0–2).
fn above_child_fds(fd: File) -> io::Result<File> {
    if fd.as_raw_fd() > 3 {
        return Ok(fd);
    }
    // SAFETY: F_DUPFD_CLOEXEC returns a new descriptor (or -1), owned by nothing else.
    let copy = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 4) };
    if copy < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above, `copy` is a fresh descriptor.
    Ok(unsafe { File::from_raw_fd(copy) })
}

fn c_string(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in an argument"))
}

/// A non-zero return of a posix_spawn function as an error.
fn check(ret: libc::c_int) -> io::Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(ret))
    }
}

/// The spawn's file actions and attributes, destroyed however the spawn ends.
struct SpawnSetup {
    actions: libc::posix_spawn_file_actions_t,
    attr: libc::posix_spawnattr_t,
}

impl SpawnSetup {
    /// Boxed and initialised in place: the structures are not moved once initialised, and
    /// `Drop` only ever sees both initialised.
    fn new() -> io::Result<Box<Self>> {
        let mut b: Box<std::mem::MaybeUninit<Self>> = Box::new_uninit();
        let p = b.as_mut_ptr();
        // SAFETY: the init functions initialise the fields in place; on a failure the
        // uninitialised box is dropped as plain memory (no `Drop`), after destroying what
        // was initialised.
        unsafe {
            check(libc::posix_spawn_file_actions_init(&raw mut (*p).actions))?;
            if let Err(e) = check(libc::posix_spawnattr_init(&raw mut (*p).attr)) {
                libc::posix_spawn_file_actions_destroy(&raw mut (*p).actions);
                return Err(e);
            }
            Ok(b.assume_init())
        }
    }
}

impl Drop for SpawnSetup {
    fn drop(&mut self) {
        // SAFETY: both were initialised in `new` and are destroyed once.
        unsafe {
            libc::posix_spawn_file_actions_destroy(&mut self.actions);
            libc::posix_spawnattr_destroy(&mut self.attr);
        }
    }
}

/// A child process started by [`spawn`]: the parts of `std::process::Child` the encoders
/// use.
#[derive(Debug)]
pub(super) struct Child {
    pid: libc::pid_t,
    /// Set once reaped: the pid may belong to another process after that.
    status: Option<ExitStatus>,
    pub stdin: Option<ChildStdin>,
    pub stdout: Option<ChildStdout>,
    pub stderr: Option<ChildStderr>,
}

impl Child {
    pub fn id(&self) -> u32 {
        self.pid as u32
    }

    fn reap(&mut self, flags: libc::c_int) -> io::Result<Option<ExitStatus>> {
        if let Some(s) = self.status {
            return Ok(Some(s));
        }
        let mut raw: libc::c_int = 0;
        loop {
            // SAFETY: waitpid on our own child, writing its status into a local.
            let r = unsafe { libc::waitpid(self.pid, &mut raw, flags) };
            if r == self.pid {
                let s = ExitStatus::from_raw(raw);
                self.status = Some(s);
                return Ok(Some(s));
            }
            if r == 0 {
                return Ok(None);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// The exit status if the process has exited (reaping it), else `None`.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.reap(libc::WNOHANG)
    }

    /// Waits for the process to exit and reaps it. Closes its stdin first, as
    /// `std::process::Child::wait` does, so a process reading it sees the end.
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        drop(self.stdin.take());
        self.reap(0)
            .map(|s| s.expect("waitpid without WNOHANG returns a status"))
    }

    /// Sends SIGKILL, unless the process has been reaped already.
    pub fn kill(&mut self) -> io::Result<()> {
        if self.status.is_some() {
            return Ok(());
        }
        // SAFETY: kill(2) on our own child, which is not reaped yet, so the pid is still
        // its own (a zombie at worst).
        if unsafe { libc::kill(self.pid, libc::SIGKILL) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// glibc's malloc thresholds for the encoders, unless the environment sets its own: ffmpeg
/// allocates a buffer for every raw frame it reads (0.4 MB at 512², 1.4 MB at 720p) and frees
/// it once the frame is encoded. glibc's dynamic thresholds handed that memory back to the
/// kernel and took it again frame after frame, so ffmpeg page-faulted in every frame's
/// buffer as it copied the frame in from its pipe. Fixed thresholds keep it: `mmap` only for
/// blocks of 16 MiB and more, the heap trimmed only when 256 MiB at its top is free.
const MALLOC_TUNABLES: &str =
    "glibc.malloc.mmap_threshold=16777216:glibc.malloc.trim_threshold=268435456";

/// The environment a child gets: this one, with [`MALLOC_TUNABLES`] added to
/// `GLIBC_TUNABLES` unless a malloc threshold is set already (there, or by glibc's older
/// `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_`).
fn child_env(
    mut env: Vec<(std::ffi::OsString, std::ffi::OsString)>,
) -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
    if env
        .iter()
        .any(|(k, _)| k == "MALLOC_MMAP_THRESHOLD_" || k == "MALLOC_TRIM_THRESHOLD_")
    {
        return env;
    }
    match env.iter_mut().find(|(k, _)| k == "GLIBC_TUNABLES") {
        Some((_, v)) => {
            let set = v.to_string_lossy();
            if !set.contains("glibc.malloc.mmap_threshold")
                && !set.contains("glibc.malloc.trim_threshold")
            {
                let mut joined = std::ffi::OsString::from(MALLOC_TUNABLES);
                if !v.is_empty() {
                    joined.push(":");
                    joined.push(&*v);
                }
                *v = joined;
            }
        }
        None => env.push(("GLIBC_TUNABLES".into(), MALLOC_TUNABLES.into())),
    }
    env
}

/// Starts `program` (searched on the PATH if it names no directory) with `args`, stdin,
/// stdout and stderr piped, `fd3` (if any) as its descriptor 3, and `nice` added to this
/// process's niceness by `nice(1)` (nothing for 0 or less; at most 19 in all). A program
/// that is not there, or cannot be run, fails here, as with `std::process::Command` (glibc's
/// `posix_spawn` reports the `exec`'s error, since glibc 2.24; closing the other
/// descriptors needs 2.34, Debian 12 has 2.36).
pub(super) fn spawn(
    program: &Path,
    args: &[String],
    fd3: Option<File>,
    nice: i32,
) -> io::Result<Child> {
    let (stdin_r, stdin_w) = pipe()?;
    let (stdout_r, stdout_w) = pipe()?;
    let (stderr_r, stderr_w) = pipe()?;
    let child_ends = [
        above_child_fds(stdin_r)?,
        above_child_fds(stdout_w)?,
        above_child_fds(stderr_w)?,
    ];
    let fd3 = fd3.map(above_child_fds).transpose()?;

    // The environment is read once, under the standard library's lock, and the programs
    // are looked up in its PATH here: posix_spawnp would read PATH with getenv, unguarded
    // against a thread changing the environment.
    let env: Vec<(std::ffi::OsString, std::ffi::OsString)> = std::env::vars_os().collect();
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| DEFAULT_PATH.into());
    let target = resolve(program.as_os_str(), &path)?;
    // A niced process: `nice -n STEPS -- program args…` (nice(1) adds to the niceness it
    // inherits from this process; the kernel stops at 19).
    let (exe, mut argv_owned) = if nice > 0 {
        let exe = resolve(OsStr::new("nice"), &path).map_err(|_| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "nice(1), which starts a niced encoder, is not on the PATH",
            )
        })?;
        let head = vec![
            c_string(OsStr::new("nice"))?,
            c_string(OsStr::new("-n"))?,
            c_string(OsStr::new(&nice.to_string()))?,
            c_string(OsStr::new("--"))?,
            c_string(target.as_os_str())?,
        ];
        (c_string(exe.as_os_str())?, head)
    } else {
        (
            c_string(target.as_os_str())?,
            vec![c_string(program.as_os_str())?],
        )
    };
    for a in args {
        argv_owned.push(c_string(OsStr::new(a))?);
    }
    let mut argv: Vec<*mut libc::c_char> = argv_owned
        .iter()
        .map(|a| a.as_ptr() as *mut libc::c_char)
        .collect();
    argv.push(std::ptr::null_mut());
    let env_owned = child_env(env)
        .into_iter()
        .map(|(k, v)| {
            let mut kv = k;
            kv.push("=");
            kv.push(v);
            c_string(&kv)
        })
        .collect::<io::Result<Vec<_>>>()?;
    let mut envp: Vec<*mut libc::c_char> = env_owned
        .iter()
        .map(|a| a.as_ptr() as *mut libc::c_char)
        .collect();
    envp.push(std::ptr::null_mut());

    let mut setup = SpawnSetup::new()?;
    let mut pid: libc::pid_t = 0;
    // SAFETY: every pointer handed over points into values that outlive the call
    // (`argv_owned`, `env_owned`, `setup`, the descriptors); the arrays end with a null;
    // the sets are initialised by sigemptyset before use.
    unsafe {
        let mut targets: Vec<(RawFd, RawFd)> = child_ends
            .iter()
            .zip(0..)
            .map(|(f, to)| (f.as_raw_fd(), to))
            .collect();
        if let Some(f) = &fd3 {
            targets.push((f.as_raw_fd(), 3));
        }
        let first_other = targets.len() as RawFd;
        for (from, to) in targets {
            check(libc::posix_spawn_file_actions_adddup2(
                &mut setup.actions,
                from,
                to,
            ))?;
        }
        // Nothing else goes with it: descriptors this process inherited without
        // close-on-exec (a supervisor's pipe, a test harness's) would otherwise stay open in
        // every encoder, spares kept for minutes included, and whoever waits for their
        // other end to close would wait that long.
        check(libc::posix_spawn_file_actions_addclosefrom_np(
            &mut setup.actions,
            first_other,
        ))?;
        // The child starts with no signal blocked and SIGPIPE at its default (the service
        // ignores it, and ignored signals stay ignored across exec): an encoder whose
        // output is gone ends, as std::process::Command arranges too.
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        let mut default: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut default);
        libc::sigaddset(&mut default, libc::SIGPIPE);
        check(libc::posix_spawnattr_setsigmask(&mut setup.attr, &empty))?;
        check(libc::posix_spawnattr_setsigdefault(
            &mut setup.attr,
            &default,
        ))?;
        check(libc::posix_spawnattr_setflags(
            &mut setup.attr,
            (libc::POSIX_SPAWN_SETSIGMASK | libc::POSIX_SPAWN_SETSIGDEF) as libc::c_short,
        ))?;
        check(libc::posix_spawn(
            &mut pid,
            exe.as_ptr(),
            &setup.actions,
            &setup.attr,
            argv.as_ptr(),
            envp.as_ptr(),
        ))?;
    }
    // The child's ends are its own now (they close here, in this process).
    drop(child_ends);
    drop(fd3);
    Ok(Child {
        pid,
        status: None,
        stdin: Some(ChildStdin::from(OwnedFd::from(stdin_w))),
        stdout: Some(ChildStdout::from(OwnedFd::from(stdout_r))),
        stderr: Some(ChildStderr::from(OwnedFd::from(stderr_r))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
        pairs.iter().map(|(k, v)| (k.into(), v.into())).collect()
    }

    fn tunables(e: &[(std::ffi::OsString, std::ffi::OsString)]) -> Option<String> {
        e.iter()
            .find(|(k, _)| k == "GLIBC_TUNABLES")
            .map(|(_, v)| v.to_string_lossy().into_owned())
    }

    #[test]
    fn encoders_get_fixed_malloc_thresholds_unless_the_environment_sets_them() {
        let plain = child_env(env(&[("PATH", "/bin")]));
        assert_eq!(tunables(&plain).as_deref(), Some(MALLOC_TUNABLES));
        assert_eq!(plain.len(), 2, "nothing else changes");
        // Other tunables stay, after ours.
        let other = child_env(env(&[("GLIBC_TUNABLES", "glibc.rtld.nns=4")]));
        assert_eq!(
            tunables(&other),
            Some(format!("{MALLOC_TUNABLES}:glibc.rtld.nns=4"))
        );
        // A threshold of the operator's own wins, in either spelling.
        let own = "glibc.malloc.trim_threshold=1000";
        assert_eq!(
            tunables(&child_env(env(&[("GLIBC_TUNABLES", own)]))).as_deref(),
            Some(own)
        );
        let old = child_env(env(&[("MALLOC_MMAP_THRESHOLD_", "65536")]));
        assert_eq!(tunables(&old), None);
        // And the child sees them.
        let mut child = spawn(
            Path::new("sh"),
            &["-c".into(), "printf %s \"$GLIBC_TUNABLES\"".into()],
            None,
            0,
        )
        .unwrap();
        let mut out = String::new();
        std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut out).unwrap();
        assert!(child.wait().unwrap().success());
        let aliased = std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some()
            || std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_some();
        let expected = match std::env::var("GLIBC_TUNABLES") {
            _ if aliased => std::env::var("GLIBC_TUNABLES").unwrap_or_default(),
            Ok(v)
                if v.contains("glibc.malloc.mmap_threshold")
                    || v.contains("glibc.malloc.trim_threshold") =>
            {
                v
            }
            Ok(v) if !v.is_empty() => format!("{MALLOC_TUNABLES}:{v}"),
            _ => MALLOC_TUNABLES.to_string(),
        };
        assert_eq!(out, expected);
    }
}
