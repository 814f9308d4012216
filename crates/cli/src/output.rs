//! Text and JSON output of the read commands.

use serde_json::json;
use shardlock::{BreakerState, LeaseRow, LockRouter, MigrateReport, ShardStatus};

pub(crate) fn migrate(reports: &[(String, MigrateReport)], as_json: bool) {
    if as_json {
        let shards: Vec<_> = reports
            .iter()
            .map(|(name, r)| json!({"shard": name, "applied": r.applied, "version": r.version}))
            .collect();
        println!("{}", json!({ "shards": shards }));
        return;
    }
    for (name, r) in reports {
        if r.applied.is_empty() {
            println!("{name}: up to date (schema version {})", r.version);
        } else {
            println!(
                "{name}: applied {:?}, now at schema version {}",
                r.applied, r.version
            );
        }
    }
}

/// A breaker state as `status` prints it.
pub(crate) fn breaker_name(state: BreakerState) -> &'static str {
    match state {
        BreakerState::Closed => "closed",
        BreakerState::Open => "open",
        BreakerState::HalfOpen => "half-open",
    }
}

pub(crate) fn status(router: &LockRouter, status: &[ShardStatus], as_json: bool) {
    if as_json {
        let shards: Vec<_> = status
            .iter()
            .map(|s| {
                json!({
                    "shard": s.name,
                    "reachable": s.reachable,
                    "current": s.current,
                    "error": s.error,
                    "held_leases": s.held_leases,
                    "breaker": breaker_name(s.breaker),
                    "local_fallback_leases": s.local_fallback_leases,
                    "pool": {"max_size": s.pool.max_size, "size": s.pool.size, "available": s.pool.available, "waiting": s.pool.waiting},
                })
            })
            .collect();
        println!(
            "{}",
            json!({ "instance": router.instance_id(), "shards": shards })
        );
        return;
    }
    println!(
        "{:<12} {:<11} {:<10} {:>12} {:>18}",
        "SHARD", "REACHABLE", "BREAKER", "HELD LEASES", "POOL size/avail/wait"
    );
    for s in status {
        let held = s.held_leases.map_or("-".to_owned(), |n| n.to_string());
        let pool = format!(
            "{}/{}/{} (max {})",
            s.pool.size, s.pool.available, s.pool.waiting, s.pool.max_size
        );
        let name = if s.current {
            s.name.clone()
        } else {
            format!("{} (leaving)", s.name)
        };
        println!(
            "{:<12} {:<11} {:<10} {:>12} {:>18}",
            name,
            if s.reachable { "yes" } else { "NO" },
            breaker_name(s.breaker),
            held,
            pool
        );
        if let Some(e) = &s.error {
            println!("             {e}");
        }
    }
}

pub(crate) fn inspect(key: &str, shard: &str, row: Option<&LeaseRow>, as_json: bool) {
    if as_json {
        let lease = row.map(|r| {
            json!({
                "held": r.is_held(),
                "owner": r.owner,
                "fence": r.fence,
                "ttl_ms": r.ttl_ms,
                "expires_in_ms": r.expires_in_ms,
                "held_for_ms": r.held_for_ms,
                "wanted_ms_ago": r.wanted_ms_ago,
            })
        });
        println!("{}", json!({ "key": key, "shard": shard, "lease": lease }));
        return;
    }
    println!("key:     {key}");
    println!("shard:   {shard}");
    match row {
        None => println!("lease:   never granted on this shard"),
        Some(r) if r.is_held() => {
            println!("holder:  {}", r.owner.as_deref().unwrap_or("-"));
            println!("fence:   up to {} (reserved by the current grant)", r.fence);
            println!(
                "expires: in {} ms (shard clock), lease {} ms",
                r.expires_in_ms, r.ttl_ms
            );
            println!("held:    {} ms", r.held_for_ms);
            if let Some(ago) = r.wanted_ms_ago {
                println!("wanted:  by another owner {ago} ms ago");
            }
        }
        Some(r) => {
            let why = if r.owner.is_some() {
                "expired (holder stopped renewing)"
            } else {
                "released"
            };
            println!("lease:   free, {why}");
            println!("fence:   {} (the next grant gets a larger one)", r.fence);
        }
    }
}
