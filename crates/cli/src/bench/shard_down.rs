//! The `shard-down` scenario: latency of healthy shards' keys while another shard is down.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use shardlock::{AcquireOptions, LockRouter};
use shardlock_testkit::{Proxy, ProxyMode};

use super::harness::{bench_config, Round};
use super::report::Measurement;
use crate::{AnyError, ConfigSource};

/// `args.tasks` tasks acquiring and releasing keys of every shard but the last, while 4 tasks
/// keep calling keys of the last one; with `down`, that shard is reached through a proxy that
/// resets every connection, old and new, from the moment the router is up (see [`cut_off`]).
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
    let proxy = if down {
        Some(cut_off(&mut victim.url).await?)
    } else {
        None
    };
    let router = LockRouter::new(config).await?;
    router.migrate().await?;
    if let Some(proxy) = &proxy {
        proxy.set(ProxyMode::Reset);
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

/// Puts a proxy between `url`'s shard and its clients, and points `url` at it; the proxy
/// passes everything until it is set otherwise.
///
/// The router starts with the shard up: a router that cannot read the instance registry on
/// every shard when it starts grants nothing until it can (it cannot tell which topology the
/// others run), so a shard down from the start would measure nothing. What the scenario
/// measures is the running service whose shard dies.
async fn cut_off(url: &mut String) -> Result<Proxy, AnyError> {
    let mut through = url::Url::parse(url).map_err(|e| format!("shard URL `{url}`: {e}"))?;
    let host = through
        .host_str()
        .ok_or_else(|| format!("shard URL `{url}` names no host"))?;
    let upstream = tokio::net::lookup_host((host, through.port().unwrap_or(3306)))
        .await?
        .next()
        .ok_or_else(|| format!("shard URL `{url}`: `{host}` resolves to no address"))?;
    let proxy = Proxy::start_to(upstream).await?;
    through.set_host(Some("127.0.0.1"))?;
    through
        .set_port(Some(proxy.port()))
        .map_err(|()| format!("shard URL `{url}` cannot name a port"))?;
    // On loopback the driver would switch to the server's Unix socket, past the proxy.
    through
        .query_pairs_mut()
        .append_pair("prefer_socket", "false");
    *url = through.into();
    Ok(proxy)
}
