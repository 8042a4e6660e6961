//! A throwaway PostgreSQL server for the tests: its own cluster in a temporary directory,
//! listening only on a Unix socket there, trusted, unsynced (fast, not durable).
//!
//! ```ignore
//! let cluster = pg::shared();               // one per test binary, or Cluster::start()
//! let url = cluster.create_db("jobs_a");    // postgres://lipsync@localhost:5432/jobs_a?host=…
//! ```
//!
//! The server is Debian's `postgresql` (`/usr/lib/postgresql/<version>/bin`, the newest
//! version there), or the binaries in `$LIPSYNC_PG_BIN`. Without them the tests fail and say
//! how to install it: they never skip. PostgreSQL refuses to run as root, so as root the
//! cluster belongs to `nobody` (the directory is handed to it and the server runs under its
//! uid); otherwise it runs as the current user.
//!
//! Nothing is left behind: a small `sh` watchdog owns the server and reads its standard
//! input from this process; when that pipe closes (the [`Cluster`] dropped, or the test
//! process gone however it ended) it stops the server (fast shutdown, SIGKILL after 10 s)
//! and removes the directory. Starting is bounded (60 s), and so is dropping (20 s).
#![allow(dead_code)]

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The superuser the clusters are created with (trusted: no password).
pub const USER: &str = "lipsync";

/// The port in the socket's name (`.s.PGSQL.5432`): only a Unix socket is opened, in a
/// directory of the cluster's own, so it never collides.
const PORT: u16 = 5432;

const START_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(20);
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Stops the server and removes `$dir` once standard input closes. `$1` the directory, `$2`
/// the binaries, `$3` the superuser.
const WATCHDOG: &str = r#"
dir=$1; bin=$2; user=$3
pg=
if "$bin/initdb" -D "$dir/data" -U "$user" -A trust -E UTF8 --no-locale --no-sync \
    >"$dir/initdb.log" 2>&1; then
  "$bin/postgres" -D "$dir/data" -k "$dir" -p 5432 -c listen_addresses= \
    -c fsync=off -c synchronous_commit=off -c full_page_writes=off \
    -c max_connections=200 >"$dir/postgres.log" 2>&1 &
  pg=$!
else
  : >"$dir/initdb.failed"
fi
read _ignored || true
if [ -n "$pg" ]; then
  kill -INT "$pg" 2>/dev/null
  i=0
  while kill -0 "$pg" 2>/dev/null && [ "$i" -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
  kill -KILL "$pg" 2>/dev/null
  wait "$pg" 2>/dev/null
fi
rm -rf "$dir"
"#;

/// A running throwaway PostgreSQL server (see the module documentation). Dropping it stops
/// the server and removes its directory.
pub struct Cluster {
    dir: PathBuf,
    bin: PathBuf,
    watchdog: Child,
    /// The watchdog's standard input: closing it stops everything.
    stdin: Option<ChildStdin>,
}

/// One cluster for the whole test binary, started on first use. It is never dropped: the
/// watchdog stops it and removes its directory when the test process exits.
pub fn shared() -> &'static Cluster {
    static SHARED: OnceLock<Cluster> = OnceLock::new();
    SHARED.get_or_init(Cluster::start)
}

impl Cluster {
    /// Creates and starts a cluster; returns once it accepts connections. Panics (with the
    /// server's log) when it cannot, and when PostgreSQL is not installed.
    pub fn start() -> Cluster {
        let bin = find_bin();
        let dir = make_dir();
        let mut sh = Command::new("sh");
        sh.arg("-c")
            .arg(WATCHDOG)
            .arg("watchdog")
            .arg(&dir)
            .arg(&bin)
            .arg(USER)
            .current_dir(&dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some((uid, gid)) = run_as() {
            sh.uid(uid).gid(gid);
        }
        let mut watchdog = sh
            .spawn()
            .expect("starting sh for the PostgreSQL test cluster");
        let stdin = watchdog.stdin.take();
        let cluster = Cluster {
            dir,
            bin,
            watchdog,
            stdin,
        };
        cluster.wait_ready();
        cluster
    }

    /// The cluster's directory (its socket, `data/`, `postgres.log`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The URL of database `db` (which [`Cluster::create_db`] creates; `postgres` always
    /// exists): `postgres://lipsync@localhost:5432/<db>?host=<dir>`.
    pub fn url(&self, db: &str) -> String {
        format!(
            "postgres://{USER}@localhost:{PORT}/{db}?host={}",
            self.dir.display()
        )
    }

    /// Creates database `name` (letters, digits, `_`) and returns its URL.
    pub fn create_db(&self, name: &str) -> String {
        assert!(
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'),
            "database name {name:?}: letters, digits and _ only"
        );
        let out = self.psql("postgres", &format!("CREATE DATABASE {name}"));
        assert!(
            out.status.success(),
            "CREATE DATABASE {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.url(name)
    }

    /// A database with a fresh name (`<prefix>_<n>`), created; returns its URL.
    pub fn fresh_db(&self, prefix: &str) -> String {
        static N: AtomicU32 = AtomicU32::new(0);
        self.create_db(&format!("{prefix}_{}", N.fetch_add(1, Ordering::Relaxed)))
    }

    /// Runs `sql` in database `db` with `psql` (stops at the first error), bounded in time.
    pub fn psql(&self, db: &str, sql: &str) -> Output {
        let mut cmd = Command::new(self.bin.join("psql"));
        cmd.arg("-X")
            .arg("-q")
            .args(["-v", "ON_ERROR_STOP=1"])
            .arg("-h")
            .arg(&self.dir)
            .args(["-p", &PORT.to_string(), "-U", USER, "-d", db, "-c", sql]);
        run_bounded(cmd, COMMAND_TIMEOUT)
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        let mut log = String::new();
        for name in ["initdb.log", "postgres.log"] {
            if let Ok(text) = std::fs::read_to_string(self.dir.join(name)) {
                log.push_str(&format!("--- {name}\n{text}"));
            }
        }
        log
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if self.dir.join("initdb.failed").exists() {
                panic!("initdb failed:\n{}", self.log());
            }
            if self.dir.join("data/postmaster.pid").exists() {
                let mut cmd = Command::new(self.bin.join("pg_isready"));
                cmd.arg("-q").arg("-h").arg(&self.dir).args([
                    "-p",
                    &PORT.to_string(),
                    "-U",
                    USER,
                    "-d",
                    "postgres",
                ]);
                if run_bounded(cmd, COMMAND_TIMEOUT).status.success() {
                    return;
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "the PostgreSQL test cluster in {} did not accept connections within {:?}:\n{}",
                    self.dir.display(),
                    START_TIMEOUT,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Closing the pipe tells the watchdog to stop the server and remove the directory.
        drop(self.stdin.take());
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            match self.watchdog.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() > deadline => {
                    let _ = self.watchdog.kill();
                    let _ = self.watchdog.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The directory of PostgreSQL's binaries, or a panic saying how to install them.
fn find_bin() -> PathBuf {
    if let Some(dir) = std::env::var_os("LIPSYNC_PG_BIN") {
        let dir = PathBuf::from(dir);
        assert!(
            dir.join("initdb").exists(),
            "LIPSYNC_PG_BIN={}: no initdb there",
            dir.display()
        );
        return dir;
    }
    // Debian's layout: /usr/lib/postgresql/<major>/bin; the newest major.
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let major = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((major, bin))
        })
        .collect();
    found.sort();
    match found.pop() {
        Some((_, bin)) => bin,
        None => panic!(
            "PostgreSQL is not installed: no /usr/lib/postgresql/*/bin/initdb. The job store's \
             PostgreSQL tests need it: `apt-get install postgresql` (scripts/test.sh installs it; \
             the system service need not run), or set LIPSYNC_PG_BIN to a directory holding \
             initdb, postgres, pg_isready and psql"
        ),
    }
}

/// The uid and gid to run the server as: `nobody`'s when this process is root (PostgreSQL
/// refuses root), none otherwise.
fn run_as() -> Option<(u32, u32)> {
    if current_uid() != 0 {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let nobody = passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        (f.len() > 3 && f[0] == "nobody").then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
    });
    Some(nobody.flatten().unwrap_or((65534, 65534)))
}

fn current_uid() -> u32 {
    std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(u32::MAX)
}

/// A new empty directory for a cluster, owned by the user the server runs as. Short, for
/// the socket path's 107-byte limit.
fn make_dir() -> PathBuf {
    let mut base = std::env::temp_dir();
    // nobody must reach it; and the socket path must stay short.
    if run_as().is_some() || base.as_os_str().len() > 60 {
        base = PathBuf::from("/tmp");
    }
    let dir = tempfile::Builder::new()
        .prefix("lipsync-pg-")
        .tempdir_in(&base)
        .expect("creating the PostgreSQL test cluster's directory")
        .keep();
    if let Some((uid, gid)) = run_as() {
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid))
            .expect("handing the PostgreSQL test cluster's directory to nobody");
    }
    dir
}

/// Runs `cmd` to completion, killing it after `timeout`.
fn run_bounded(mut cmd: Command, timeout: Duration) -> Output {
    let program = format!("{:?}", cmd.get_program());
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {program}: {e}"));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for a command") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{program} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    if let Some(mut s) = child.stdout.take() {
        let _ = s.read_to_end(&mut stdout);
    }
    if let Some(mut s) = child.stderr.take() {
        let _ = s.read_to_end(&mut stderr);
    }
    Output {
        status,
        stdout,
        stderr,
    }
}
