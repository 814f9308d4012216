//! The `shard-down` scenario: latency of healthy shards' keys while another shard is down.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use shardlock::{AcquireOptions, LockRouter};

use super::harness::{bench_config, Round};
use super::report::Measurement;
use crate::{AnyError, ConfigSource};

/// `args.tasks` tasks acquiring and releasing keys of every shard but the last, while 4 tasks
/// keep calling keys of the last one; with `down`, that shard's URL points at a closed port.
pub(super) async fn with_a_shard_down(
    source: &ConfigSource,
    down: bool,
    round: Round<'_>,
) -> Result<Measurement, AnyError> {
    let mut config = bench_config(source, "shard-down");
    if config.shards.len() < 2 {
        return Err("the shard-down scenario needs at least 2 shards".into());
    }
    let victim = config.shards.last_mut().expect("at least 2 shards");
    let victim_name = victim.name.clone();
    if down {
        victim.url = "mysql://root@127.0.0.1:1/shardlock".into(); // nothing listens on port 1
    }
    let router = LockRouter::new(config).await?;
    if !down {
        router.migrate().await?;
    }
    let keys = |healthy: bool, n: usize| -> Result<Vec<String>, AnyError> {
        let mut keys = Vec::with_capacity(n);
        for i in 0.. {
            let key = format!("bench:down:{}:{i}", round.tag);
            if (router.shard_for(&key)? != victim_name) == healthy {
                keys.push(key);
                if keys.len() == n {
                    break;
                }
            }
        }
        Ok(keys)
    };
    let (healthy, dead) = (
        Arc::new(keys(true, round.args.tasks as usize * 8)?),
        keys(false, 4)?,
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let callers: Vec<_> = dead
        .into_iter()
        .map(|key| {
            let (router, stop) = (router.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(Some(g)) = router.try_acquire(&key, AcquireOptions::new()).await {
                        drop(g.release().await);
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
        })
        .collect();
    let name = if down {
        "shardlock, healthy keys, one shard down"
    } else {
        "shardlock, healthy keys, all shards up"
    };
    let m = round
        .measure_cycles(
            name,
            round.args.tasks,
            &router,
            AcquireOptions::new().wait(Duration::from_secs(5)),
            move |task, i| healthy[task as usize * 8 + (i % 8) as usize].clone(),
        )
        .await;
    stop.store(true, Ordering::Relaxed);
    for c in callers {
        c.await?;
    }
    let _ = router.shutdown().await;
    m
}
