//! A rig for shard-failure tests: three shards, `s1` reached through a TCP proxy, a router with
//! a quick breaker, keys placed on the failing shard and on the healthy ones, and a steady
//! load on the healthy keys whose throughput can be sampled.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use shardlock::{AcquireOptions, LockRouter};
use shardlock_testkit::{Cluster, Proxy};
use tokio::time::Instant;

/// How long every acquire in these tests may wait.
pub const WAIT: Duration = Duration::from_millis(500);
/// Above the breaker's slow-call threshold below, below the statement timeout.
pub const SLOW_LINK: Duration = Duration::from_millis(150);

/// The breaker and timeouts used by the fault tests: a failed shard is noticed within a
/// few calls, and probed again after 300 ms.
pub const BREAKER_YAML: &str = "
breaker:
  consecutive-failures: 3
  min-calls: 20
  failure-rate: 0.5
  window: 5s
  slow-call: 200ms
  cooldown: 300ms
  max-cooldown: 1s
  probes: 2
";

/// The pool of every shard in these tests: short timeouts.
pub const POOL: &str =
    "{ max-size: 8, wait-timeout: 400ms, create-timeout: 400ms, recycle-timeout: 400ms }";
/// A pool that a few slow calls exhaust: 2 connections, callers wait 100 ms at most.
pub const SMALL_POOL: &str =
    "{ max-size: 2, wait-timeout: 100ms, create-timeout: 400ms, recycle-timeout: 400ms }";

/// The whole config: the shards of `cluster` (`s1` at `s1_url` with `s1_pool`), the breaker,
/// and a `default` namespace (ttl 2 s, wait 500 ms) with `policy`.
pub fn config_yaml(cluster: &Cluster, s1_url: &str, s1_pool: &str, policy: &str) -> String {
    let mut yaml = String::from("shards:\n");
    for (i, s) in cluster.shards().iter().enumerate() {
        let (url, pool) = if i == 0 {
            (s1_url.to_owned(), s1_pool)
        } else {
            (s.url(), POOL)
        };
        yaml.push_str(&format!(
            "  - name: {}\n    url: {url}\n    statement-timeout: 1s\n    pool: {pool}\n",
            s.name()
        ));
    }
    format!(
        "{yaml}{BREAKER_YAML}namespaces:\n  default:\n    ttl: 2s\n    wait: 500ms\n    on-shard-failure: {policy}\n"
    )
}

/// Three shards with `s1` behind a proxy, and a migrated router over them.
pub struct Rig {
    pub cluster: Cluster,
    pub proxy: Proxy,
    pub router: LockRouter,
    pub yaml: String,
}

impl Rig {
    /// Starts the rig; `s1_user` (created here, its connections counted by the server)
    /// replaces `root` in `s1`'s URL.
    pub async fn start(policy: &str, s1_user: Option<&str>, s1_pool: &str) -> Self {
        let cluster = Cluster::start(3).await.expect("start shards");
        let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
        let mut s1_url = proxy.url();
        if let Some(user) = s1_user {
            let mut c = cluster.shard(0).connect().await.unwrap();
            use shardlock::mysql_async::prelude::Queryable;
            // A connection limit makes the server count this user's connections.
            c.query_drop(format!(
                "CREATE USER '{user}'@'%' WITH MAX_USER_CONNECTIONS 1000"
            ))
            .await
            .unwrap();
            // Rights on the lock database only, as an application's user has: no global
            // privilege lets it write to a read-only server.
            c.query_drop(format!(
                "GRANT ALL ON {}.* TO '{user}'@'%'",
                shardlock_testkit::DATABASE
            ))
            .await
            .unwrap();
            s1_url = s1_url.replace("root@", &format!("{user}@"));
        }
        let yaml = config_yaml(&cluster, &s1_url, s1_pool, policy);
        let router = LockRouter::from_yaml_str(&yaml).await.expect("router");
        router.migrate().await.expect("migrate");
        Self {
            cluster,
            proxy,
            router,
            yaml,
        }
    }

    /// `n` keys with `prefix` whose shard is `s1` (or, with `healthy`, not `s1`).
    pub fn keys(&self, prefix: &str, n: usize, healthy: bool) -> Vec<String> {
        (0..)
            .map(|i| format!("{prefix}:{i}"))
            .filter(|k| (self.router.shard_for(k).unwrap() == "s1") != healthy)
            .take(n)
            .collect()
    }
}

/// Acquire-release cycles on healthy keys by `tasks` tasks, each on keys of its own.
pub struct Load {
    done: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    pub fn start(router: &LockRouter, keys: &[String], tasks: usize) -> Self {
        let done = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let per_task = keys.len() / tasks;
        let handles = (0..tasks)
            .map(|t| {
                let mine = keys[t * per_task..(t + 1) * per_task].to_vec();
                let (router, done, failed, stop) =
                    (router.clone(), done.clone(), failed.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut i = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let key = &mine[i % mine.len()];
                        i += 1;
                        let cycle =
                            match router.acquire(key, AcquireOptions::new().wait(WAIT)).await {
                                Ok(guard) => guard.release().await,
                                Err(e) => Err(e),
                            };
                        let counter = if cycle.is_ok() { &done } else { &failed };
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        Self {
            done,
            failed,
            stop,
            tasks: handles,
        }
    }

    /// Cycles per second over `window`.
    pub async fn rate(&self, window: Duration) -> f64 {
        let (start, at) = (self.done.load(Ordering::Relaxed), Instant::now());
        tokio::time::sleep(window).await;
        (self.done.load(Ordering::Relaxed) - start) as f64 / at.elapsed().as_secs_f64()
    }

    /// Stops the tasks; returns how many cycles failed in all.
    pub async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        self.failed.load(Ordering::Relaxed)
    }
}
