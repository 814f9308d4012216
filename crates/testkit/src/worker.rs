//! Second OS processes for tests: the test binary re-entered at one named test function.

use std::io;
use std::process::{ExitStatus, Stdio};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

/// Set in a worker's environment to the role it should play.
pub const WORKER_ENV: &str = "SHARDLOCK_TESTKIT_WORKER";

/// Lines a worker prints for its parent start with this; everything else is test noise.
const LINE_PREFIX: &str = "@@ ";

/// Inside a worker process: the role it was started with. `None` in a normal test run.
pub fn worker_main() -> Option<String> {
    std::env::var(WORKER_ENV).ok()
}

/// Prints a protocol line for the parent (see [`Worker::line`]).
#[macro_export]
macro_rules! report {
    ($($arg:tt)*) => {{
        println!("\n@@ {}", format!($($arg)*));
    }};
}

/// A worker process: this test binary, running only the test named `entry`.
///
/// The entry test reads its role with [`worker_main`] and talks back by printing lines with
/// [`report!`]. The process is killed when the `Worker` is dropped.
#[derive(Debug)]
pub struct Worker {
    child: Child,
    stdout: Lines<BufReader<ChildStdout>>,
    pid: Pid,
}

impl Worker {
    /// Starts the worker with `role` and extra environment variables.
    pub fn spawn(entry: &str, role: &str, env: &[(&str, String)]) -> io::Result<Self> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args([
            entry,
            "--exact",
            "--nocapture",
            "--include-ignored",
            "--test-threads=1",
        ])
        .env(WORKER_ENV, role)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn()?;
        let pid = Pid::from_raw(
            child
                .id()
                .ok_or_else(|| io::Error::other("worker exited at once"))? as i32,
        );
        let stdout = BufReader::new(child.stdout.take().expect("piped")).lines();
        Ok(Self { child, stdout, pid })
    }

    /// The next protocol line, without its prefix; `None` once the worker's stdout closes.
    pub async fn line(&mut self) -> io::Result<Option<String>> {
        while let Some(line) = self.stdout.next_line().await? {
            // libtest may have printed "test worker ... " on the same line first.
            if let Some(at) = line.find(LINE_PREFIX) {
                return Ok(Some(line[at + LINE_PREFIX.len()..].to_owned()));
            }
        }
        Ok(None)
    }

    /// Reads protocol lines until one starts with `prefix`; returns the rest of it.
    pub async fn expect(&mut self, prefix: &str) -> io::Result<String> {
        loop {
            match self.line().await? {
                Some(l) if l.starts_with(prefix) => return Ok(l[prefix.len()..].trim().to_owned()),
                Some(_) => continue,
                None => {
                    return Err(io::Error::other(format!(
                        "worker ended before printing `{prefix}`"
                    )))
                }
            }
        }
    }

    /// The worker's process id.
    pub fn pid(&self) -> i32 {
        self.pid.as_raw()
    }

    /// SIGKILL the worker, as a crash would.
    pub async fn kill(&mut self) -> io::Result<()> {
        self.child.kill().await
    }

    /// SIGSTOP: freeze the worker (its leases stop being renewed).
    pub fn pause(&self) -> io::Result<()> {
        kill(self.pid, Signal::SIGSTOP).map_err(io::Error::from)
    }

    /// Sends `signal` (SIGHUP to reload, SIGTERM to shut down, as the worker handles them).
    pub fn signal(&self, signal: Signal) -> io::Result<()> {
        kill(self.pid, signal).map_err(io::Error::from)
    }

    /// SIGCONT after [`Worker::pause`].
    pub fn resume(&self) -> io::Result<()> {
        kill(self.pid, Signal::SIGCONT).map_err(io::Error::from)
    }

    /// Waits for the worker to exit successfully and returns the numbers on its last protocol
    /// line starting with `prefix` (e.g. `done 5 120` gives `[5, 120]`). A failed worker or a
    /// missing line is an error that shows what the worker printed.
    pub async fn finish_report(self, prefix: &str) -> io::Result<Vec<u64>> {
        let (status, lines) = self.finish().await?;
        if !status.success() {
            return Err(io::Error::other(format!(
                "worker failed ({status}): {lines:?}"
            )));
        }
        let line = lines
            .iter()
            .rev()
            .find_map(|l| l.strip_prefix(prefix))
            .ok_or_else(|| {
                io::Error::other(format!("worker printed no `{prefix}` line: {lines:?}"))
            })?;
        line.split_whitespace()
            .map(|n| {
                n.parse()
                    .map_err(|e| io::Error::other(format!("`{prefix}{line}`: {e}")))
            })
            .collect()
    }

    /// Waits for the worker to exit, draining its remaining protocol lines into the result.
    pub async fn finish(mut self) -> io::Result<(ExitStatus, Vec<String>)> {
        let mut lines = Vec::new();
        while let Some(l) = self.line().await? {
            lines.push(l);
        }
        Ok((self.child.wait().await?, lines))
    }
}
