//! Starting, faulting and stopping local `mariadbd` shards.

use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use mysql_async::prelude::Queryable;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// The database every shard serves locks from.
pub const DATABASE: &str = "shardlock";

/// Bumped whenever the template's contents must change.
const TEMPLATE_VERSION: &str = "v1";
/// How long a server may take to accept connections (crash recovery after SIGKILL included).
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Several local shards, killed and deleted on drop.
#[derive(Debug)]
pub struct Cluster {
    shards: Vec<Shard>,
}

impl Cluster {
    /// Starts `n` shards named `s1..sN` in parallel and waits until each accepts connections
    /// and has the [`DATABASE`] database.
    pub async fn start(n: usize) -> io::Result<Self> {
        Self::start_with_clocks(n, &[]).await
    }

    /// Starts `n` shards like [`Cluster::start`], running shard `i` under libfaketime with
    /// `FAKETIME=spec` for each `(i, spec)` in `clocks` (`"+60s"`: a wall clock 60 s ahead;
    /// see faketime(1)). Only the shard's wall clock is faked, not its monotonic one.
    pub async fn start_with_clocks(n: usize, clocks: &[(usize, &str)]) -> io::Result<Self> {
        Self::launch(n, clocks, &[]).await
    }

    /// Starts `n` shards like [`Cluster::start`], each with `args` added to its `mariadbd`
    /// command line (`--ssl-cert=…`, say; see [`TestCerts::server_args`](crate::TestCerts)).
    pub async fn start_with_args(n: usize, args: &[String]) -> io::Result<Self> {
        Self::launch(n, &[], args).await
    }

    async fn launch(n: usize, clocks: &[(usize, &str)], args: &[String]) -> io::Result<Self> {
        let template = template_dir()?;
        let mut starting = Vec::with_capacity(n);
        for i in 0..n {
            let dir = tempfile::Builder::new()
                .prefix("shardlock-shard-")
                .tempdir()?;
            copy_dir(&template, dir.path())?;
            let clock = clocks
                .iter()
                .find(|(at, _)| *at == i)
                .map(|(_, spec)| spec.to_string());
            starting.push(Shard::launch(
                format!("s{}", i + 1),
                dir,
                clock,
                args.to_vec(),
            )?);
        }
        let mut shards = Vec::with_capacity(n);
        for shard in starting {
            shard.wait_ready_or_move().await?;
            shards.push(shard);
        }
        Ok(Self { shards })
    }

    /// The shards, in name order.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// Shard `i` (0-based).
    pub fn shard(&self, i: usize) -> &Shard {
        &self.shards[i]
    }

    /// A shardlock YAML config listing every shard, followed by `extra` (top-level sections
    /// such as `namespaces:`).
    pub fn config_yaml(&self, extra: &str) -> String {
        let mut yaml = String::from("shards:\n");
        for s in &self.shards {
            yaml.push_str(&format!("  - name: {}\n    url: {}\n", s.name, s.url()));
        }
        yaml.push_str(extra);
        yaml
    }
}

/// libfaketime's preload library (Debian package `faketime`), its thread-safe build: with the
/// plain one, a multi-threaded server reading its offset from a file now and then gets the
/// real time instead (about one clock read in 1,500, measured): a clock that jumps forward.
fn libfaketime() -> io::Result<PathBuf> {
    let candidates = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
        "/usr/lib/faketime/libfaketimeMT.so.1",
    ];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "libfaketime is not installed (apt-get install faketime)",
            )
        })
}

/// The server's counters of row-writing statements: every lock statement counts in one of
/// them (an acquire is an `INSERT ... SELECT`, a release an `UPDATE`).
pub const ROW_WRITES: &[&str] = &[
    "Com_insert",
    "Com_insert_select",
    "Com_update",
    "Com_delete",
];

/// One local `mariadbd` with its data directory.
#[derive(Debug)]
pub struct Shard {
    name: String,
    port: AtomicU16,
    dir: tempfile::TempDir,
    process: Mutex<Option<Guarded>>,
    /// `FAKETIME` for a shard whose clock is skewed (libfaketime).
    clock: Option<String>,
    /// Arguments added to the server's command line.
    extra_args: Mutex<Vec<String>>,
    /// A server configured by its own option file (a Galera node): passed first, instead of
    /// the testkit's arguments.
    defaults_file: Option<PathBuf>,
}

/// A running server under its `sh` guardian.
#[derive(Debug)]
struct Guarded {
    guardian: Child,
    // Closing this makes the guardian kill the server.
    stdin: ChildStdin,
    server_pid: Pid,
}

impl Shard {
    fn launch(
        name: String,
        dir: tempfile::TempDir,
        clock: Option<String>,
        extra_args: Vec<String>,
    ) -> io::Result<Self> {
        let shard = Self::unstarted(name, dir, claim_port()?, clock, extra_args, None);
        shard.spawn()?;
        Ok(shard)
    }

    fn unstarted(
        name: String,
        dir: tempfile::TempDir,
        port: u16,
        clock: Option<String>,
        extra_args: Vec<String>,
        defaults_file: Option<PathBuf>,
    ) -> Self {
        Self {
            name,
            port: AtomicU16::new(port),
            dir,
            process: Mutex::new(None),
            clock,
            extra_args: Mutex::new(extra_args),
            defaults_file,
        }
    }

    /// A server on `port` configured by the option file `defaults_file` (which names `dir`
    /// and `port`), started with `extra_args`.
    pub(crate) fn launch_configured(
        name: String,
        dir: tempfile::TempDir,
        port: u16,
        defaults_file: PathBuf,
        extra_args: Vec<String>,
        clock: Option<String>,
    ) -> io::Result<Self> {
        let shard = Self::unstarted(name, dir, port, clock, extra_args, Some(defaults_file));
        shard.spawn()?;
        Ok(shard)
    }

    /// The server's data directory.
    pub(crate) fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Replaces the arguments the next start adds to the command line.
    pub(crate) fn set_extra_args(&self, args: Vec<String>) {
        *self.extra_args.lock().unwrap() = args;
    }

    /// Starts the server process (after [`Shard::kill`]) without waiting for it.
    pub(crate) fn start_process(&self) -> io::Result<()> {
        self.kill()?;
        self.spawn()
    }

    fn spawn(&self) -> io::Result<()> {
        let mut command = Command::new("sh");
        if let Some(spec) = &self.clock {
            // The offset is read from a file on every clock read, so `set_clock` can step or
            // skew the running server's clock.
            let file = self.clock_file();
            if !file.exists() {
                fs::write(&file, spec)?;
            }
            command
                .env("LD_PRELOAD", libfaketime()?)
                .env("FAKETIME_TIMESTAMP_FILE", file)
                .env("FAKETIME_NO_CACHE", "1")
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
                .env("FAKETIME_DONT_RESET", "1");
        }
        command
            .arg("-c")
            .arg(r#""$@" & pid=$!; echo $pid; read line; kill -9 $pid 2>/dev/null; wait $pid"#)
            .arg("sh")
            .arg(mariadbd()?);
        match &self.defaults_file {
            // It must come first.
            Some(file) => command.arg(format!("--defaults-file={}", file.display())),
            None => command.args(server_args(self.dir.path(), self.port())),
        };
        let mut guardian = command
            .args(self.extra_args.lock().unwrap().iter())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let mut first = String::new();
        BufReader::new(guardian.stdout.take().expect("piped")).read_line(&mut first)?;
        let server_pid = first.trim().parse().map(Pid::from_raw).map_err(|_| {
            io::Error::other(format!("guardian printed `{first}` instead of a pid"))
        })?;
        let stdin = guardian.stdin.take().expect("piped");
        *self.process.lock().unwrap() = Some(Guarded {
            guardian,
            stdin,
            server_pid,
        });
        Ok(())
    }

    fn clock_file(&self) -> PathBuf {
        self.dir.path().join("faketime")
    }

    /// Sets the clock of a shard started under libfaketime (see
    /// [`Cluster::start_with_clocks`]) to `spec`, at once: `"-10s"` steps it ten seconds back
    /// from the real time, `"+0 x1.01"` makes it run 1% fast (see faketime(1)).
    pub fn set_clock(&self, spec: &str) -> io::Result<()> {
        if self.clock.is_none() {
            return Err(io::Error::other(format!(
                "shard {} was not started under libfaketime",
                self.name
            )));
        }
        // Written whole, then renamed: the server never reads half a spec.
        let staged = self.dir.path().join("faketime.new");
        fs::write(&staged, spec)?;
        fs::rename(staged, self.clock_file())
    }

    /// The shard's name (`s1`, `s2`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port.load(Ordering::Relaxed)
    }

    /// `mysql://root@127.0.0.1:PORT/shardlock`.
    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/{DATABASE}", self.port())
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.process
            .lock()
            .unwrap()
            .as_ref()
            .map(|g| g.server_pid.as_raw())
    }

    fn signal(&self, signal: Signal) -> io::Result<()> {
        let pid = self
            .pid()
            .ok_or_else(|| io::Error::other("shard is not running"))?;
        kill(Pid::from_raw(pid), signal).map_err(io::Error::from)
    }

    /// SIGKILL: the server dies at once, without flushing or closing connections cleanly.
    pub fn kill(&self) -> io::Result<()> {
        if let Some(mut g) = self.process.lock().unwrap().take() {
            // A server that died by itself may have been reaped, and its pid reused.
            if alive(g.server_pid) {
                let _ = kill(g.server_pid, Signal::SIGKILL);
            }
            drop(g.stdin);
            g.guardian.wait()?;
        }
        Ok(())
    }

    /// SIGSTOP: the server freezes; its sockets stay open but nothing answers. Returns once
    /// every thread of it is stopped (a signal is delivered a moment after it is sent, and a
    /// statement sent meanwhile would still be answered); an error if that takes 10 s.
    pub fn pause(&self) -> io::Result<()> {
        self.signal(Signal::SIGSTOP)?;
        let pid = self
            .pid()
            .ok_or_else(|| io::Error::other("shard is not running"))?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !all_threads_stopped(pid) {
            if std::time::Instant::now() > deadline {
                return Err(io::Error::other(format!(
                    "shard process {pid} did not stop within 10 s of SIGSTOP"
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(())
    }

    /// SIGCONT after [`Shard::pause`].
    pub fn resume(&self) -> io::Result<()> {
        self.signal(Signal::SIGCONT)
    }

    /// Starts the server again on the same port and data (after [`Shard::kill`]) and waits
    /// until it accepts connections.
    pub async fn restart(&self) -> io::Result<()> {
        self.kill()?;
        self.spawn()?;
        self.wait_ready().await
    }

    /// Opens a plain connection (for test assertions and setup).
    pub async fn connect(&self) -> mysql_async::Result<mysql_async::Conn> {
        mysql_async::Conn::from_url(self.url()).await
    }

    /// Row-writing statements the server has run ([`ROW_WRITES`]).
    pub async fn row_writes(&self) -> mysql_async::Result<u64> {
        self.global_status_sum(ROW_WRITES).await
    }

    /// A global status counter, e.g. `Com_update` or `Innodb_deadlocks`.
    pub async fn global_status(&self, name: &str) -> mysql_async::Result<u64> {
        self.global_status_sum(&[name]).await
    }

    /// The sum of several global status counters, read in one statement (a `SELECT`, so it
    /// does not disturb the [`ROW_WRITES`] counters).
    pub async fn global_status_sum(&self, names: &[&str]) -> mysql_async::Result<u64> {
        let mut conn = self.connect().await?;
        let list = vec!["?"; names.len()].join(",");
        let sql = format!(
            "SELECT CAST(COALESCE(SUM(VARIABLE_VALUE), 0) AS UNSIGNED) \
             FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME IN ({list})"
        );
        let upper: Vec<String> = names.iter().map(|n| n.to_uppercase()).collect();
        let sum: Option<u64> = conn.exec_first(sql, upper).await?;
        conn.disconnect().await?;
        Ok(sum.unwrap_or(0))
    }

    /// Waits until the server answers; if something else took its port between our probe
    /// and its start, moves it to a new port and tries again.
    async fn wait_ready_or_move(&self) -> io::Result<()> {
        let mut tries = 0;
        loop {
            match self.wait_ready().await {
                // Ours found another server on the port, or the server logged that it could
                // not bind it.
                Err(e)
                    if tries < 5
                        && (e.kind() == io::ErrorKind::AddrInUse
                            || e.to_string().contains("already in use")) =>
                {
                    tries += 1;
                    self.kill()?;
                    self.port.store(claim_port()?, Ordering::Relaxed);
                    self.spawn()?;
                }
                other => return other,
            }
        }
    }

    async fn wait_ready(&self) -> io::Result<()> {
        wait_ready(self.port(), self.dir.path(), || self.exited()).await
    }

    /// Whether the server process is gone (killed, or exited by itself: its guardian lives
    /// on until told to end, so the server is looked up by its pid).
    pub(crate) fn exited(&self) -> bool {
        let mut p = self.process.lock().unwrap();
        match p.as_mut() {
            Some(g) => !matches!(g.guardian.try_wait(), Ok(None)) || !alive(g.server_pid),
            None => true,
        }
    }
}

impl Drop for Shard {
    fn drop(&mut self) {
        // A server that died by itself mid-test leaves a test failing on closed connections,
        // and its log is deleted with its data directory: keep the log's end in the test's
        // output.
        if self.pid().is_some() && self.exited() {
            eprintln!(
                "shard {} (port {}) had exited by itself; end of its log:\n{}",
                self.name,
                self.port(),
                log_tail(self.dir.path())
            );
        }
        let _ = self.kill();
    }
}

/// Whether process `pid` runs: it exists and is not a zombie its parent has yet to reap. A
/// process this one may not look at (`/proc` mounted with `hidepid`) counts as running.
pub(crate) fn alive(pid: Pid) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses and may hold any byte.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(e) => e.kind() != io::ErrorKind::NotFound,
    }
}

/// Waits until the server on `port` answers and has our database; gives up when `exited`
/// says the process is gone or after [`READY_TIMEOUT`], with the end of its error log, and
/// at once if the server answering on `port` is another one (its data directory is not
/// `dir`): a test must never run against, nor later lose, a server that is not its own.
pub(crate) async fn wait_ready(port: u16, dir: &Path, exited: impl Fn() -> bool) -> io::Result<()> {
    let started = Instant::now();
    let root_url = format!("mysql://root@127.0.0.1:{port}");
    loop {
        if let Ok(mut conn) = mysql_async::Conn::from_url(root_url.as_str()).await {
            let ready = match ensure_ours(&mut conn, port, dir).await {
                Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
                    let _ = conn.disconnect().await;
                    return Err(e);
                }
                Err(_) => false,
                Ok(()) => conn
                    .query_drop(format!("CREATE DATABASE IF NOT EXISTS {DATABASE}"))
                    .await
                    .is_ok(),
            };
            let _ = conn.disconnect().await;
            if ready {
                return Ok(());
            }
        }
        if exited() || started.elapsed() > READY_TIMEOUT {
            return Err(io::Error::other(format!(
                "mariadbd on port {port} did not become ready; end of its log:\n{}",
                log_tail(dir)
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Fails with [`io::ErrorKind::AddrInUse`] if the server `conn` reached on `port` is not the
/// one whose data directory is `dir`.
pub(crate) async fn ensure_ours(
    conn: &mut mysql_async::Conn,
    port: u16,
    dir: &Path,
) -> io::Result<()> {
    let datadir: Option<String> = conn
        .query_first("SELECT @@datadir")
        .await
        .map_err(io::Error::other)?;
    let ours = fs::canonicalize(dir)?;
    match datadir {
        Some(theirs) if fs::canonicalize(&theirs).ok().as_ref() == Some(&ours) => Ok(()),
        theirs => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "port {port} is already in use by another server (data in {}, not {})",
                theirs.as_deref().unwrap_or("?"),
                ours.display()
            ),
        )),
    }
}

pub(crate) fn log_tail(dir: &Path) -> String {
    let log = fs::read_to_string(dir.join("error.log")).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    // A crash report (its stack and the query that crashed) runs on for some 50 lines, whose
    // end shows only the process's limits: it is shown from its start.
    let from = lines
        .iter()
        .rposition(|l| l.contains("got signal"))
        .unwrap_or(lines.len().saturating_sub(15));
    lines[from..]
        .iter()
        .take(60)
        .copied()
        .collect::<Vec<_>>()
        .join("\n")
}

fn server_args(dir: &Path, port: u16) -> Vec<String> {
    let d = dir.display();
    let mut args = vec![
        "--no-defaults".to_owned(),
        format!("--datadir={d}"),
        format!("--port={port}"),
        "--bind-address=127.0.0.1".to_owned(),
        format!("--socket={d}/mysqld.sock"),
        format!("--pid-file={d}/mysqld.pid"),
        format!("--log-error={d}/error.log"),
        // Throwaway servers: durability is traded for speed, never correctness of locking.
        "--innodb-buffer-pool-size=64M".to_owned(),
        "--innodb-log-file-size=32M".to_owned(),
        "--innodb-flush-log-at-trx-commit=2".to_owned(),
        "--innodb-doublewrite=0".to_owned(),
        "--skip-log-bin".to_owned(),
        "--performance-schema=OFF".to_owned(),
        "--max-connections=1000".to_owned(),
        "--skip-name-resolve".to_owned(),
        // Sessions of the tests' own connections read and write times in UTC, like
        // shardlock's sessions, whatever the machine's time zone.
        "--default-time-zone=+00:00".to_owned(),
    ];
    if nix::unistd::geteuid().is_root() {
        // mariadbd refuses to run as root unless told to.
        args.push("--user=root".to_owned());
    }
    args
}

pub(crate) fn mariadbd() -> io::Result<PathBuf> {
    find_program(
        "mariadbd",
        &["/usr/sbin/mariadbd", "/usr/local/mysql/bin/mariadbd"],
    )
}

fn find_program(name: &str, fallbacks: &[&str]) -> io::Result<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(name));
    on_path
        .chain(fallbacks.iter().map(PathBuf::from))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("`{name}` not found on PATH: install the MariaDB server (apt-get install mariadb-server)"),
            )
        })
}

/// Where server ports are claimed: one file per port, holding the claimant's pid.
const PORT_CLAIMS: &str = "ports";
/// The ports servers are given: outside the kernel's ephemeral range (client ends of
/// connections, `bind` to port 0), preferably 20000 up to its start (32768 by default), else
/// above its end. While a server is down between a kill and its restart, or has not yet bound
/// its port (InnoDB starts first), a client connection of any process could otherwise take the
/// port as its own end.
fn server_ports() -> io::Result<std::ops::Range<u16>> {
    const RANGE: &str = "/proc/sys/net/ipv4/ip_local_port_range";
    const ENOUGH: usize = 1_000;
    let ephemeral: Vec<u16> = fs::read_to_string(RANGE)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect();
    let (low, high) = match ephemeral[..] {
        [low, high] => (low, high),
        _ => (32_768, 60_999),
    };
    let below = 20_000..low.min(32_768);
    let above = high.saturating_add(1).max(20_000)..u16::MAX;
    [below, above]
        .into_iter()
        .find(|r| r.len() >= ENOUGH)
        .ok_or_else(|| {
            io::Error::other(format!(
                "the kernel hands out ports {low}-{high} to client connections ({RANGE}), which \
                 leaves too few for test servers outside it; narrow it, e.g. \
                 `sysctl net.ipv4.ip_local_port_range=\"32768 60999\"`"
            ))
        })
}

/// A loopback port for a server of this process: free now, outside the ephemeral range, and
/// claimed for this process until it exits. Test processes run side by side, and each once
/// probed "free now" alone: two of them were handed one port, one server failed to bind it,
/// and its test ran against the other's server until that test ended and killed it. A claim
/// of a process that is gone is taken over.
pub(crate) fn claim_port() -> io::Result<u16> {
    use rand::Rng;
    let ports = server_ports()?;
    let mut rng = rand::rng();
    claim_port_in(&testkit_root()?.join(PORT_CLAIMS), || {
        rng.random_range(ports.clone())
    })
}

/// [`claim_port`] with the claims kept in `claims` and candidate ports drawn from `pick`.
fn claim_port_in(claims: &Path, mut pick: impl FnMut() -> u16) -> io::Result<u16> {
    const TRIES: usize = 500;
    fs::create_dir_all(claims)?;
    let lock = File::create(claims.join(".lock"))?;
    lock.lock()?;
    for _ in 0..TRIES {
        let port = pick();
        let claim = claims.join(port.to_string());
        let holder = fs::read_to_string(&claim)
            .ok()
            .and_then(|pid| pid.trim().parse().ok())
            .map(Pid::from_raw);
        if holder.is_some_and(alive) || TcpListener::bind(("127.0.0.1", port)).is_err() {
            continue;
        }
        fs::write(&claim, std::process::id().to_string())?;
        return Ok(port);
    }
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        format!("no unclaimed free port after {TRIES} tries"),
    ))
}

/// The testkit's directory under the machine's temporary directory, shared by every test
/// process.
fn testkit_root() -> io::Result<PathBuf> {
    let root = std::env::temp_dir().join("shardlock-testkit");
    fs::create_dir_all(&root)?;
    Ok(root)
}

/// The initialised data directory every shard starts from, made once per machine.
pub(crate) fn template_dir() -> io::Result<PathBuf> {
    made_once(&format!("template-{TEMPLATE_VERSION}"), |staging| {
        let mut install = Command::new(find_program(
            "mariadb-install-db",
            &["/usr/bin/mariadb-install-db", "/usr/bin/mysql_install_db"],
        )?);
        install
            .arg("--no-defaults")
            .arg(format!("--datadir={}", staging.display()))
            .arg("--auth-root-authentication-method=normal")
            .arg("--skip-test-db");
        if nix::unistd::geteuid().is_root() {
            install.arg("--user=root");
        }
        let out = install.output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "mariadb-install-db failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(())
    })
}

/// The directory `name` under the testkit's temporary root, filled by `make` once per
/// machine: made in a staging directory under a file lock (parallel test processes share
/// it), marked ready, then renamed into place.
pub(crate) fn made_once(
    name: &str,
    make: impl FnOnce(&Path) -> io::Result<()>,
) -> io::Result<PathBuf> {
    let root = testkit_root()?;
    let made = root.join(name);
    let ready = made.join("SHARDLOCK_TEMPLATE_READY");
    if ready.exists() {
        return Ok(made);
    }
    let lock = File::create(root.join(format!("{name}.lock")))?;
    lock.lock()?;
    if ready.exists() {
        return Ok(made);
    }
    let _ = fs::remove_dir_all(&made);
    let staging = root.join(format!("{name}.tmp{}", std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging)?;
    make(&staging)?;
    File::create(staging.join("SHARDLOCK_TEMPLATE_READY"))?.write_all(b"ok\n")?;
    fs::rename(&staging, &made)?;
    Ok(made)
}

pub(crate) fn copy_dir(from: &Path, to: &Path) -> io::Result<()> {
    let status = Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", from.display()))
        .arg(to)
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "cp -a {} {} failed",
            from.display(),
            to.display()
        )))
    }
}

/// The local shards of `shardlock dev`: fixed ports, data kept under one directory, servers
/// detached so they outlive the command that started them.
#[derive(Debug)]
pub struct DevCluster {
    root: PathBuf,
    ports: Vec<u16>,
}

impl DevCluster {
    /// The dev cluster rooted at `root` on `ports` (one shard per port, named `s1..`).
    pub fn new(root: impl Into<PathBuf>, ports: Vec<u16>) -> Self {
        Self {
            root: root.into(),
            ports,
        }
    }

    fn shard_dir(&self, i: usize) -> PathBuf {
        self.root.join(format!("s{}", i + 1))
    }

    /// Whether every shard answers.
    pub async fn is_up(&self) -> bool {
        for port in &self.ports {
            let url = format!("mysql://root@127.0.0.1:{port}/{DATABASE}");
            match mysql_async::Conn::from_url(url).await {
                Ok(conn) => drop(conn.disconnect().await),
                Err(_) => return false,
            }
        }
        true
    }

    /// Starts every shard that is not running (initialising its data directory the first
    /// time) and waits until all accept connections. Returns how many were started.
    pub async fn up(&self) -> io::Result<usize> {
        let mut started = Vec::new();
        for (i, &port) in self.ports.iter().enumerate() {
            let url = format!("mysql://root@127.0.0.1:{port}");
            if let Ok(conn) = mysql_async::Conn::from_url(url).await {
                let _ = conn.disconnect().await;
                continue;
            }
            let dir = self.shard_dir(i);
            if !dir.join("SHARDLOCK_TEMPLATE_READY").exists() {
                let _ = fs::remove_dir_all(&dir);
                fs::create_dir_all(&dir)?;
                copy_dir(&template_dir()?, &dir)?;
            }
            let log = File::create(dir.join("console.log"))?;
            let child = Command::new(mariadbd()?)
                .args(server_args(&dir, port))
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .process_group(0)
                .spawn()?;
            fs::write(dir.join("server.pid"), child.id().to_string())?;
            started.push((port, dir, Pid::from_raw(child.id() as i32)));
        }
        for (port, dir, pid) in &started {
            wait_ready(*port, dir, || !alive(*pid)).await?;
        }
        Ok(started.len())
    }

    /// SIGKILLs shard `i` (0-based), as a crash would; [`DevCluster::up`] starts it again.
    pub fn kill(&self, i: usize) -> io::Result<()> {
        let pid = fs::read_to_string(self.shard_dir(i).join("server.pid"))?;
        let pid = pid.trim().parse::<i32>().map_err(io::Error::other)?;
        kill(Pid::from_raw(pid), Signal::SIGKILL).map_err(io::Error::from)?;
        let _ = fs::remove_file(self.shard_dir(i).join("server.pid"));
        Ok(())
    }

    /// Stops every shard started by [`DevCluster::up`] (SIGTERM, then SIGKILL after 20 s).
    /// With `wipe`, deletes their data too. Returns how many were stopped.
    pub fn down(&self, wipe: bool) -> io::Result<usize> {
        let mut stopped = 0;
        for i in 0..self.ports.len() {
            let dir = self.shard_dir(i);
            let Ok(pid) = fs::read_to_string(dir.join("server.pid")) else {
                continue;
            };
            let Ok(pid) = pid.trim().parse::<i32>() else {
                continue;
            };
            let pid = Pid::from_raw(pid);
            // A pid file outlives its process (a reboot): its number may name another one.
            if is_mariadbd(pid) && kill(pid, Signal::SIGTERM).is_ok() {
                stopped += 1;
                let deadline = Instant::now() + Duration::from_secs(20);
                while kill(pid, None).is_ok() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = kill(pid, Signal::SIGKILL);
            }
            let _ = fs::remove_file(dir.join("server.pid"));
        }
        // The shard directories only: the root may be a directory of the user's
        // (`SHARDLOCK_DEV_DIR`) holding more than the shards.
        if wipe {
            for i in 0..self.ports.len() {
                match fs::remove_dir_all(self.shard_dir(i)) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => {
                        return Err(io::Error::new(
                            e.kind(),
                            format!("cannot delete {}: {e}", self.shard_dir(i).display()),
                        ))
                    }
                    _ => {}
                }
            }
        }
        Ok(stopped)
    }
}

/// Whether `pid` is a running `mariadbd` (or `mysqld`).
fn is_mariadbd(pid: Pid) -> bool {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .is_ok_and(|comm| matches!(comm.trim(), "mariadbd" | "mysqld"))
}

use std::os::unix::process::CommandExt as _;

/// Whether every thread of process `pid` is stopped (state `T` in its `/proc` stat), or the
/// process is gone (or dead, `Z` or `X`).
fn all_threads_stopped(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat")).map_or(true, |stat| {
            // After the command's closing parenthesis: " T ...".
            let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start());
            state.is_none_or(|rest| rest.starts_with(['T', 't', 'Z', 'X']))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dev down --wipe` deletes the shards' data, not what else the dev directory holds (it
    /// may be one of the user's, `SHARDLOCK_DEV_DIR`); a pid file naming another process
    /// (the shard gone, its number reused) signals nothing.
    #[test]
    fn a_wipe_deletes_the_shards_alone_and_signals_no_stranger() {
        let root = tempfile::tempdir().unwrap();
        let dev = DevCluster::new(root.path(), vec![1, 2]);
        fs::create_dir_all(dev.shard_dir(0)).unwrap();
        fs::write(dev.shard_dir(0).join("ibdata1"), "x").unwrap();
        fs::write(root.path().join("notes.txt"), "mine").unwrap();
        let mut stranger = Command::new("sleep").arg("60").spawn().unwrap();
        fs::write(
            dev.shard_dir(0).join("server.pid"),
            stranger.id().to_string(),
        )
        .unwrap();
        assert_eq!(
            dev.down(true).unwrap(),
            0,
            "a process not a shard's was stopped"
        );
        assert!(
            stranger.try_wait().unwrap().is_none(),
            "the stranger was signalled"
        );
        stranger.kill().unwrap();
        let _ = stranger.wait();
        assert!(!dev.shard_dir(0).exists());
        assert!(
            root.path().join("notes.txt").exists(),
            "the wipe took the user's file"
        );
    }

    /// The two processes' race this guards against: a server that cannot bind its port, while
    /// another server answers there, is moved to a port of its own; the test then runs
    /// against its own server, which outlives the other.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_server_whose_port_another_server_holds_moves_and_is_never_mistaken_for_it() {
        let other = Cluster::start(1).await.unwrap();
        let taken = other.shard(0).port();
        let dir = tempfile::Builder::new()
            .prefix("shardlock-shard-")
            .tempdir()
            .unwrap();
        copy_dir(&template_dir().unwrap(), dir.path()).unwrap();
        let shard = Shard::unstarted("late".into(), dir, taken, None, Vec::new(), None);
        shard.spawn().unwrap();
        shard.wait_ready_or_move().await.unwrap();
        assert_ne!(shard.port(), taken);
        drop(other);
        let mut conn = shard.connect().await.unwrap();
        let datadir: String = conn.query_first("SELECT @@datadir").await.unwrap().unwrap();
        assert_eq!(
            fs::canonicalize(datadir).unwrap(),
            fs::canonicalize(shard.dir()).unwrap()
        );
    }

    /// A port another live process claimed is never handed out, one whose claimant is gone
    /// is, and no port is handed out twice.
    #[test]
    fn claims_of_live_processes_hold_and_those_of_gone_ones_are_taken_over() {
        // Free ports no other test process will start a server on.
        let ports: Vec<u16> = (0..3).map(|_| claim_port().unwrap()).collect();
        let claims = tempfile::tempdir().unwrap();
        let mut live = Command::new("sleep").arg("60").spawn().unwrap();
        // No process has a pid above the kernel's largest.
        let pid_max: u32 = fs::read_to_string("/proc/sys/kernel/pid_max")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        fs::write(
            claims.path().join(ports[0].to_string()),
            live.id().to_string(),
        )
        .unwrap();
        fs::write(
            claims.path().join(ports[1].to_string()),
            (pid_max + 1).to_string(),
        )
        .unwrap();
        let mut turn = 0;
        let mut pick = || {
            turn += 1;
            ports[turn % ports.len()]
        };
        let mut handed: Vec<u16> = (0..2)
            .map(|_| claim_port_in(claims.path(), &mut pick).unwrap())
            .collect();
        let spent = claim_port_in(claims.path(), &mut pick).unwrap_err();
        live.kill().unwrap();
        live.wait().unwrap();
        handed.sort();
        let mut expected = vec![ports[1], ports[2]];
        expected.sort();
        assert_eq!(handed, expected);
        assert_eq!(spent.kind(), io::ErrorKind::AddrInUse);
        for port in handed {
            let holder = fs::read_to_string(claims.path().join(port.to_string())).unwrap();
            assert_eq!(holder, std::process::id().to_string());
        }
    }
}
