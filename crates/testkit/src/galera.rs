//! A local MariaDB Galera cluster on loopback: one shard served by three synchronously
//! replicated nodes, each a [`Shard`] that tests kill, pause and restart.
//!
//! Every node starts from one data directory bootstrapped once per machine (initialised, the
//! cluster started on it alone, the database created, shut down cleanly, its view and cache
//! files removed): the first node bootstraps a new cluster from it, the others join it by
//! incremental state transfer, which moves only the few writes since — a cluster is ready in
//! seconds. Each node has its own option file (the state transfer scripts read it), ports
//! (client, group communication, IST, SST) and Galera timeouts tightened for loopback, so that
//! a dead node is evicted in two to four seconds rather than six (tighter, a node starved of
//! CPU on a busy 2-core machine is evicted for nothing).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use mysql_async::prelude::Queryable;

use crate::server::{
    alive, claim_port, copy_dir, ensure_ours, log_tail, made_once, mariadbd, template_dir,
    wait_ready, Shard, DATABASE,
};

/// Bumped whenever the bootstrapped template's contents must change.
const TEMPLATE_VERSION: &str = "galera-v1";
/// How long a node may take to join (a full state transfer included).
const JOIN_TIMEOUT: Duration = Duration::from_secs(90);
/// The Galera provider, from Debian's `galera-4`.
const PROVIDER: &str = "/usr/lib/galera/libgalera_smm.so";

/// Three Galera nodes serving one shard, killed and deleted on drop.
#[derive(Debug)]
pub struct GaleraCluster {
    nodes: Vec<Shard>,
}

/// The ports of one node.
#[derive(Debug, Clone, Copy)]
struct Ports {
    client: u16,
    group: u16,
    ist: u16,
    sst: u16,
}

impl Ports {
    /// Claimed ports ([`claim_port`]), not merely free ones: a node binds its IST and SST
    /// ports only when it receives a state transfer, so a port free now once became another
    /// node's client port, and the first node's rejoin failed.
    fn free() -> io::Result<Self> {
        Ok(Self {
            client: claim_port()?,
            group: claim_port()?,
            ist: claim_port()?,
            sst: claim_port()?,
        })
    }
}

impl GaleraCluster {
    /// Starts a cluster of `n` nodes (`g1..gN`) and waits until every one is synced.
    pub async fn start(n: usize) -> io::Result<Self> {
        Self::start_with_clocks(n, &[]).await
    }

    /// Starts a cluster like [`GaleraCluster::start`], running node `i` under libfaketime
    /// with `FAKETIME=spec` for each `(i, spec)` in `clocks` (`"-30s"`: its wall clock 30 s
    /// behind), as [`Cluster::start_with_clocks`](crate::Cluster::start_with_clocks) does.
    pub async fn start_with_clocks(n: usize, clocks: &[(usize, &str)]) -> io::Result<Self> {
        if !Path::new(PROVIDER).exists() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "the Galera provider is not installed (apt-get install galera-4 mariadb-backup socat)",
            ));
        }
        let template = template()?;
        let ports: Vec<Ports> = (0..n).map(|_| Ports::free()).collect::<io::Result<_>>()?;
        let peers: Vec<String> = ports
            .iter()
            .map(|p| format!("127.0.0.1:{}", p.group))
            .collect();
        let mut nodes = Vec::with_capacity(n);
        for (i, p) in ports.iter().enumerate() {
            let dir = tempfile::Builder::new()
                .prefix("shardlock-galera-")
                .tempdir()?;
            copy_dir(&template, dir.path())?;
            let cnf = write_option_file(dir.path(), &format!("g{}", i + 1), *p, &peers)?;
            let args = if i == 0 {
                // The first node starts the cluster from the template's state.
                let state = dir.path().join("grastate.dat");
                let text = fs::read_to_string(&state)?
                    .replace("safe_to_bootstrap: 0", "safe_to_bootstrap: 1");
                fs::write(&state, text)?;
                vec!["--wsrep-new-cluster".to_owned()]
            } else {
                Vec::new()
            };
            let clock = clocks
                .iter()
                .find(|(at, _)| *at == i)
                .map(|(_, spec)| spec.to_string());
            let node =
                Shard::launch_configured(format!("g{}", i + 1), dir, p.client, cnf, args, clock)?;
            // On a busy machine a joining node can miss the membership protocol's tightened
            // timeouts and give up; it is started again (twice at most).
            let mut tries = 0;
            while let Err(e) = wait_synced(&node).await {
                tries += 1;
                if i == 0 || tries > 2 {
                    return Err(e);
                }
                node.start_process()?;
            }
            // Restarted later, it joins the cluster like the others.
            node.set_extra_args(Vec::new());
            nodes.push(node);
        }
        Ok(Self { nodes })
    }

    /// The nodes, in name order (`g1` first).
    pub fn nodes(&self) -> &[Shard] {
        &self.nodes
    }

    /// Node `i` (0-based).
    pub fn node(&self, i: usize) -> &Shard {
        &self.nodes[i]
    }

    /// A shardlock config whose shard `name` is this cluster, its nodes in order `g1..`, with
    /// `extra` appended.
    pub fn config_yaml(&self, name: &str, extra: &str) -> String {
        format!("shards:\n{}{extra}", self.shard_yaml(name))
    }

    /// This cluster as one entry of a config's `shards:` list, named `name`.
    pub fn shard_yaml(&self, name: &str) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        format!(
            "  - name: {name}\n    url: {}\n    nodes: [{}]\n",
            self.nodes[0].url(),
            nodes.join(", ")
        )
    }

    /// Restarts node `i` after a [`Shard::kill`]: recovers the position it had reached, starts
    /// it from there (so it joins by incremental transfer) and waits until it is synced.
    pub async fn restart_node(&self, i: usize) -> io::Result<()> {
        let node = &self.nodes[i];
        node.kill()?;
        let cnf = node.dir().join("my.cnf");
        let recover = Command::new(mariadbd()?)
            .arg(format!("--defaults-file={}", cnf.display()))
            .arg("--wsrep-recover")
            .output()?;
        if !recover.status.success() {
            return Err(io::Error::other(format!(
                "mariadbd --wsrep-recover failed:\n{}",
                log_tail(node.dir())
            )));
        }
        let log = fs::read_to_string(node.dir().join("error.log"))?;
        let position = log
            .lines()
            .rev()
            .find_map(|l| l.split("WSREP: Recovered position: ").nth(1))
            .map(|p| p.trim().to_owned())
            .ok_or_else(|| {
                io::Error::other(format!(
                    "no recovered position in the log:\n{}",
                    log_tail(node.dir())
                ))
            })?;
        node.set_extra_args(vec![format!("--wsrep-start-position={position}")]);
        node.start_process()?;
        let synced = wait_synced(node).await;
        node.set_extra_args(Vec::new());
        synced
    }

    /// Waits until node `i` says it is outside the primary component (`wsrep_cluster_status`
    /// other than `Primary`): cut off from the majority.
    pub async fn wait_non_primary(&self, i: usize, timeout: Duration) -> io::Result<()> {
        let node = &self.nodes[i];
        let started = Instant::now();
        loop {
            if let Ok(status) = wsrep_status(node.port()).await {
                if status
                    .iter()
                    .any(|(n, v)| n.eq_ignore_ascii_case("wsrep_cluster_status") && v != "Primary")
                {
                    return Ok(());
                }
            }
            if started.elapsed() > timeout {
                return Err(io::Error::other(format!(
                    "node {} stayed in the primary component for {timeout:?}",
                    node.name()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until node `i` is synced with the cluster.
    pub async fn wait_synced(&self, i: usize) -> io::Result<()> {
        wait_synced(&self.nodes[i]).await
    }
}

/// Each status variable of the node on `port` whose name starts with `wsrep_`.
async fn wsrep_status(port: u16) -> mysql_async::Result<Vec<(String, String)>> {
    let mut conn = mysql_async::Conn::from_url(format!("mysql://root@127.0.0.1:{port}")).await?;
    let rows = conn.query("SHOW GLOBAL STATUS LIKE 'wsrep_%'").await;
    let _ = conn.disconnect().await;
    rows
}

/// Waits until `node` is synced, ready and in the primary component, and has the database.
async fn wait_synced(node: &Shard) -> io::Result<()> {
    let started = Instant::now();
    loop {
        if let Ok(status) = wsrep_status(node.port()).await {
            let is = |name: &str, value: &str| {
                status
                    .iter()
                    .any(|(n, v)| n.eq_ignore_ascii_case(name) && v.eq_ignore_ascii_case(value))
            };
            if is("wsrep_local_state_comment", "Synced")
                && is("wsrep_ready", "ON")
                && is("wsrep_cluster_status", "Primary")
            {
                let mut conn = node.connect().await.map_err(io::Error::other)?;
                ensure_ours(&mut conn, node.port(), node.dir()).await?;
                let has: Option<String> = conn
                    .query_first(format!("SHOW DATABASES LIKE '{DATABASE}'"))
                    .await
                    .map_err(io::Error::other)?;
                let _ = conn.disconnect().await;
                if has.is_some() {
                    return Ok(());
                }
            }
        }
        if started.elapsed() > JOIN_TIMEOUT || node.exited() {
            return Err(io::Error::other(format!(
                "Galera node {} did not become synced; end of its log:\n{}",
                node.name(),
                log_tail(node.dir())
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Writes the node's option file into `dir` (its data directory) and returns its path.
fn write_option_file(
    dir: &Path,
    name: &str,
    ports: Ports,
    peers: &[String],
) -> io::Result<PathBuf> {
    let d = dir.display();
    let user = if nix::unistd::geteuid().is_root() {
        "user=root\n"
    } else {
        ""
    };
    // Membership timeouts, as in `ops/mariadb/galera-lock-shard.cnf`: a dead node is suspected
    // after 1 s, and the survivors agree on a view without it a moment later (their join
    // messages are sent again every 0.25 s, not every second, which kept them from agreeing
    // in time on this loaded machine and split them into non-primary views);
    // `SHARDLOCK_TEST_GALERA_EVS` replaces them, to measure failover under other settings.
    let evs = std::env::var("SHARDLOCK_TEST_GALERA_EVS").unwrap_or_else(|_| {
        "evs.suspect_timeout=PT1S;evs.inactive_timeout=PT2S;evs.keepalive_period=PT0.25S;\
         evs.inactive_check_period=PT0.25S;evs.join_retrans_period=PT0.25S;\
         evs.install_timeout=PT2S"
            .to_owned()
    });
    let options = format!(
        "[mysqld]\n\
         datadir={d}\n\
         port={client}\n\
         bind-address=127.0.0.1\n\
         socket={d}/mysqld.sock\n\
         pid-file={d}/mysqld.pid\n\
         log-error={d}/error.log\n\
         {user}\
         skip-name-resolve\n\
         innodb-buffer-pool-size=64M\n\
         innodb-log-file-size=32M\n\
         innodb-flush-log-at-trx-commit=2\n\
         performance-schema=OFF\n\
         max-connections=1000\n\
         default-time-zone=+00:00\n\
         binlog_format=ROW\n\
         innodb_autoinc_lock_mode=2\n\
         wsrep_on=ON\n\
         wsrep_provider={PROVIDER}\n\
         wsrep_cluster_name=shardlock-test\n\
         wsrep_cluster_address=gcomm://{peers}\n\
         wsrep_node_name={name}\n\
         wsrep_node_address=127.0.0.1:{group}\n\
         wsrep_node_incoming_address=127.0.0.1:{client}\n\
         wsrep_sst_receive_address=127.0.0.1:{sst}\n\
         wsrep_sst_method=mariabackup\n\
         wsrep_sst_auth=root:\n\
         wsrep_provider_options=\"gmcast.listen_addr=tcp://127.0.0.1:{group};ist.recv_addr=127.0.0.1:{ist};\
         {evs};pc.wait_prim_timeout=PT10S;gcache.size=32M\"\n",
        client = ports.client,
        group = ports.group,
        ist = ports.ist,
        sst = ports.sst,
        peers = peers.join(","),
    );
    let path = dir.join("my.cnf");
    fs::write(&path, options)?;
    Ok(path)
}

/// The data directory every node starts from: the testkit's initialised template, started
/// once as a one-node cluster that created the database, then shut down cleanly. Made once
/// per machine, under a file lock.
fn template() -> io::Result<PathBuf> {
    made_once(&format!("template-{TEMPLATE_VERSION}"), |staging| {
        copy_dir(&template_dir()?, staging)?;
        let _ = fs::remove_file(staging.join("SHARDLOCK_TEMPLATE_READY"));
        let ports = Ports::free()?;
        let cnf = write_option_file(
            staging,
            "bootstrap",
            ports,
            &[format!("127.0.0.1:{}", ports.group)],
        )?;
        let mut server = Command::new(mariadbd()?)
            .arg(format!("--defaults-file={}", cnf.display()))
            .arg("--wsrep-new-cluster")
            .spawn()?;
        let pid = nix::unistd::Pid::from_raw(server.id() as i32);
        let made = futures_block_on(wait_ready(ports.client, staging, || !alive(pid)));
        // A clean shutdown records the cluster's state (grastate.dat) for the nodes to
        // start from.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(server.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        server.wait()?;
        made.map_err(|e| {
            io::Error::other(format!(
                "bootstrapping the Galera template failed: {e}\n{}",
                log_tail(staging)
            ))
        })?;
        for file in [
            "gvwstate.dat",
            "galera.cache",
            "error.log",
            "mysqld.pid",
            "my.cnf",
        ] {
            let _ = fs::remove_file(staging.join(file));
        }
        Ok(())
    })
}

/// Runs `future` to completion from synchronous code, inside or outside a runtime.
fn futures_block_on<F: std::future::Future<Output = io::Result<()>> + Send>(
    future: F,
) -> io::Result<()> {
    std::thread::scope(|s| {
        s.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?
                .block_on(future)
        })
        .join()
        .map_err(|_| io::Error::other("bootstrap thread panicked"))?
    })
}
