//! Text and JSON output of the read commands.

use serde_json::json;
use shardlock::{
    BreakerState, CleanerReport, ForceReleased, InstanceRow, LeaseRow, LockKey, LockRouter,
    MigrateReport, ShardStatus,
};

/// What may leave a command's answer of who holds a key short: shards where the key does not
/// live under this config that did not answer, and a fleet running another topology than
/// this config's (its holders may be where this config does not look).
#[derive(Debug, Default)]
pub(crate) struct Doubts {
    pub(crate) unread: Vec<(String, String)>,
    pub(crate) fleet: Option<String>,
}

impl Doubts {
    /// The doubts of a search of the key's holders by `router`, the fleet read now when its
    /// processes heartbeat (`registry`, the deployment's: the tool's own router has none).
    pub(crate) async fn of(
        router: &LockRouter,
        registry: shardlock::config::RegistryKind,
        unread: Vec<(String, String)>,
    ) -> Self {
        let fleet = match registry {
            shardlock::config::RegistryKind::Heartbeat => router.fleet_disagreement().await,
            _ => Some(
                "the fleet's topology was not checked: under `cleaner.registry: static` its \
                 processes do not say which they run; make sure this config is the fleet's"
                    .to_owned(),
            ),
        };
        Self { unread, fleet }
    }

    /// The failure a command ends with when some shard was not read: what it said may be
    /// short of a holder there.
    pub(crate) fn unread_failure(&self) -> Result<(), crate::AnyError> {
        match self.unread.is_empty() {
            true => Ok(()),
            false => Err(crate::failure::fail(
                crate::failure::Exit::Unavailable,
                "some shards could not be read (see above): a holder there was not looked for",
            )),
        }
    }

    fn json(&self) -> serde_json::Value {
        let unread: Vec<_> = (self.unread.iter())
            .map(|(shard, error)| json!({"shard": shard, "error": error}))
            .collect();
        json!({"unread": unread, "fleet": self.fleet})
    }

    /// Warns of each doubt on stderr (text output; JSON carries them in its object).
    pub(crate) fn warn(&self) {
        for (shard, error) in &self.unread {
            eprintln!(
                "warning: shard {shard} did not answer ({}): a holder of the key there (under \
                 another config) was not looked for",
                shown(error)
            );
        }
        if let Some(fleet) = &self.fleet {
            eprintln!("warning: {}", shown(fleet));
        }
    }
}

pub(crate) fn migrate(reports: &[(String, shardlock::Result<MigrateReport>)], as_json: bool) {
    if as_json {
        let shards: Vec<_> = reports
            .iter()
            .map(|(name, r)| match r {
                Ok(r) => json!({"shard": name, "applied": r.applied, "version": r.version}),
                Err(e) => json!({"shard": name, "error": shardlock::Report(e).to_string()}),
            })
            .collect();
        println!("{}", json!({ "shards": shards }));
        return;
    }
    let known = shardlock::MIGRATIONS.last().map_or(0, |m| m.0);
    for (name, r) in reports {
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                println!(
                    "{name}: NOT migrated: {}",
                    shown(&shardlock::Report(e).to_string())
                );
                continue;
            }
        };
        if r.version > known {
            println!(
                "{name}: schema version {}, newer than this shardlock's ({known}): nothing \
                 applied; migrate with the newest shardlock of the fleet",
                r.version
            );
        } else if r.applied.is_empty() {
            println!("{name}: up to date (schema version {})", r.version);
        } else {
            println!(
                "{name}: applied {:?}, now at schema version {}",
                r.applied, r.version
            );
        }
    }
}

pub(crate) fn status(
    router: &LockRouter,
    status: &[ShardStatus],
    instances: &[(String, shardlock::Result<Vec<InstanceRow>>)],
    as_json: bool,
) {
    let registry = merge_instances(instances);
    // The verdict the cleaner acts on, by this config's timeout.
    let timeout = router.config().cleaner.heartbeat_timeout;
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
                    "breaker": BreakerState::name(s.breaker),
                    "local_fallback_leases": s.local_fallback_leases,
                    "batch_waiting": s.batch_waiting,
                    "batches_in_flight": s.batches_in_flight,
                    "pool": {"max_size": s.pool.max_size, "size": s.pool.size, "available": s.pool.available, "waiting": s.pool.waiting, "stranded": s.pool.stranded},
                })
            })
            .collect();
        let registry: Vec<_> = registry
            .iter()
            .map(|i| {
                json!({
                    "instance": i.instance_id,
                    "host": i.host,
                    "pid": i.pid,
                    "started_at": i.started_at,
                    "heartbeat_ms_ago": i.heartbeat_ms_ago,
                    "deregistered": i.deregistered,
                    "state": i.verdict(timeout).name(),
                })
            })
            .collect();
        let unread: Vec<_> = unread_registries(instances)
            .map(|(shard, error)| json!({"shard": shard, "error": error}))
            .collect();
        println!(
            "{}",
            json!({ "instance": router.instance_id(), "shards": shards, "instances": registry, "registry_unread": unread })
        );
        return;
    }
    // This command's own breaker and pool (always fresh): an application's are in its
    // metrics (`status --watch --metrics URL`).
    println!(
        "{:<12} {:<11} {:<10} {:>12} {:>18}",
        "SHARD", "REACHABLE", "BREAKER*", "HELD LEASES", "POOL* size/avail/wait"
    );
    for s in status {
        let held = s.held_leases.map_or("-".to_owned(), |n| n.to_string());
        let mut pool = format!(
            "{}/{}/{} (max {})",
            s.pool.size, s.pool.available, s.pool.waiting, s.pool.max_size
        );
        if s.pool.stranded > 0 {
            pool.push_str(&format!(", {} stranded", s.pool.stranded));
        }
        let name = if s.current {
            s.name.clone()
        } else {
            format!("{} (leaving)", s.name)
        };
        println!(
            "{:<12} {:<11} {:<10} {:>12} {:>18}",
            name,
            if s.reachable { "yes" } else { "NO" },
            BreakerState::name(s.breaker),
            held,
            pool
        );
        if let Some(e) = &s.error {
            println!("             {}", shown(e));
        }
    }
    println!("* this command's own; an application's: status --watch --metrics URL");
    println!();
    // Instances registered only there are missing below.
    for (shard, error) in unread_registries(instances) {
        println!("registry not read on {shard}: {}", shown(&error));
    }
    if registry.is_empty() {
        println!("No instances registered (cleaner.registry: heartbeat registers them).");
        return;
    }
    println!(
        "{:<40} {:<20} {:>8} {:>16}  STATE",
        "INSTANCE", "HOST", "PID", "LAST HEARTBEAT"
    );
    for i in &registry {
        println!(
            "{:<40} {:<20} {:>8} {:>13} ms  {}",
            shown(&i.instance_id),
            shown(&i.host),
            i.pid,
            i.heartbeat_ms_ago,
            i.verdict(timeout).name()
        );
    }
}

/// One row per instance over all shards: the freshest heartbeat wins.
/// The shards whose registry could not be read, with the error.
fn unread_registries(
    per_shard: &[(String, shardlock::Result<Vec<InstanceRow>>)],
) -> impl Iterator<Item = (&str, String)> {
    (per_shard.iter()).filter_map(|(shard, r)| {
        let error = r.as_ref().err()?;
        Some((shard.as_str(), shardlock::Report(error).to_string()))
    })
}

fn merge_instances(
    per_shard: &[(String, shardlock::Result<Vec<InstanceRow>>)],
) -> Vec<InstanceRow> {
    let mut merged: std::collections::BTreeMap<String, InstanceRow> = Default::default();
    for row in per_shard
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok())
        .flatten()
    {
        let fresher = merged
            .get(&row.instance_id)
            .is_none_or(|seen| row.heartbeat_ms_ago < seen.heartbeat_ms_ago);
        if fresher {
            merged.insert(row.instance_id.clone(), row.clone());
        }
    }
    merged.into_values().collect()
}

/// What `release --force` did: `released` on each shard that held the key (the key's own
/// shard under this config, `shard`, first if it did). JSON: `released` is the first of
/// them (or null), `everywhere` all of them.
/// How a lock is named in text: its whole name (with its namespace's prefix), and its bucket
/// as `list` shows it.
pub(crate) fn lock_name(lock: &LockKey) -> String {
    match lock.bucket_number() {
        Some(bucket) => format!("{} [bucket {bucket}]", shown(lock.scoped_str())),
        None => shown(lock.scoped_str()).into_owned(),
    }
}

/// `text` (a key, an owner, a lease's data: whatever applications stored) as it may reach
/// an operator's terminal: control characters escaped (`\u{1b}`), so that none moves the
/// cursor, recolours the screen or hides what follows.
pub(crate) fn shown(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(is_hidden) {
        return text.into();
    }
    text.chars()
        .map(|c| match is_hidden(c) {
            true => c.escape_default().to_string(),
            false => c.to_string(),
        })
        .collect::<String>()
        .into()
}

/// A character that does not show as itself on a terminal: a control character, or one that
/// reorders or hides text around it (bidirectional overrides and isolates, zero-width
/// characters, the byte-order mark): a key holding `U+202E` reads as another key.
fn is_hidden(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{00AD}'
                | '\u{061C}'
                | '\u{180E}'
                | '\u{200B}'..='\u{200F}'
                | '\u{202A}'..='\u{202E}'
                | '\u{2060}'..='\u{2069}'
                | '\u{FEFF}'
        )
}

pub(crate) fn force_released(
    lock: &LockKey,
    shard: &str,
    released: &[ForceReleased],
    doubts: &Doubts,
    as_json: bool,
) {
    if as_json {
        let each = |r: &ForceReleased| json!({"shard": r.shard, "owner": r.owner, "was_live": r.was_live, "fence": r.fence});
        let everywhere: Vec<_> = released.iter().map(each).collect();
        println!(
            "{}",
            json!({
                "key": lock.scoped_str(),
                "bucket": lock.bucket_number(),
                "shard": shard,
                "released": released.first().map(each),
                "everywhere": everywhere,
                "doubts": doubts.json(),
            })
        );
        return;
    }
    doubts.warn();
    let key = lock_name(lock);
    if released.is_empty() {
        println!(
            "{key} on {shard}: nobody holds it; nothing to release (`shardlock list` shows \
             the locks held: their whole names, and buckets to give with --bucket)"
        );
    }
    for r in released {
        println!(
            "{key} on {}: released from {} ({}); fence raised to {}",
            r.shard,
            shown(&r.owner),
            if r.was_live {
                "its lease was live"
            } else {
                "its lease had expired"
            },
            r.fence
        );
    }
}

/// A pass that could not run (the cleaner lock's shard down, this process not joined to its
/// fleet): said where its reports go, so that a script reading them sees it.
pub(crate) fn cleaner_failed(error: &shardlock::Error, as_json: bool) {
    let error = shardlock::Report(error).to_string();
    match as_json {
        true => println!("{}", json!({ "pass_failed": error })),
        false => println!("pass failed: {}", shown(&error)),
    }
}

/// The outcome of a reload of the cleaner daemon's config file (SIGHUP): the epoch in force
/// after it, or why the old topology stays.
pub(crate) fn cleaner_reloaded(reloaded: Result<u64, shardlock::Error>, as_json: bool) {
    match (reloaded, as_json) {
        (Ok(epoch), true) => println!("{}", json!({ "reloaded": { "epoch": epoch } })),
        (Ok(epoch), false) => println!("reloaded the config file: epoch {epoch}"),
        (Err(e), true) => {
            println!(
                "{}",
                json!({ "reload_failed": shardlock::Report(&e).to_string() })
            )
        }
        (Err(e), false) => println!(
            "reload failed, the old topology stays: {}",
            shown(&shardlock::Report(&e).to_string())
        ),
    }
}

pub(crate) fn cleaner_report(report: &CleanerReport, as_json: bool) {
    if as_json {
        let shards: Vec<_> = report
            .shards
            .iter()
            .map(|s| {
                json!({
                    "shard": s.shard,
                    "released": s.released,
                    "abandoned": s.abandoned,
                    "kept_live_holder": s.kept_live_holder,
                    "unjudged": s.unjudged,
                    "in_use": s.in_use,
                    "batches": s.batches,
                    "instances_forgotten": s.instances_forgotten,
                    "error": s.error,
                })
            })
            .collect();
        println!(
            "{}",
            json!({ "pass": report.pass, "leader": report.leader, "deleted": report.deleted(), "shards": shards })
        );
        return;
    }
    if !report.leader {
        println!(
            "pass {}: another instance is the cleaner; standing by",
            report.pass
        );
        return;
    }
    let shards: Vec<String> = report
        .shards
        .iter()
        .map(|s| {
            let mut line = format!(
                "{}: {} released, {} abandoned deleted, {} kept (holder alive)",
                s.shard, s.released, s.abandoned, s.kept_live_holder
            );
            if s.in_use > 0 {
                line.push_str(&format!(
                    ", {} in use by another session (left to a later pass)",
                    s.in_use
                ));
            }
            if s.unjudged > 0 {
                line.push_str(&format!(
                    ", {} kept (the registry could not say)",
                    s.unjudged
                ));
            }
            if s.instances_forgotten > 0 {
                line.push_str(&format!(
                    ", {} long-dead instances forgotten",
                    s.instances_forgotten
                ));
            }
            if let Some(e) = &s.error {
                line.push_str(&format!(" [stopped: {}]", shown(&e.to_string())));
            }
            line
        })
        .collect();
    println!("pass {}: {}", report.pass, shards.join("; "));
}

/// What `inspect` found of `key`: its `row` on its `shard`, and, when it is not held there,
/// where it is held `elsewhere` (a fleet's move, a config older or newer than the fleet's).
pub(crate) fn inspect(
    lock: &LockKey,
    shard: &str,
    row: Option<&LeaseRow>,
    elsewhere: &Result<Vec<(String, LeaseRow)>, String>,
    doubts: &Doubts,
    as_json: bool,
) {
    if as_json {
        let held_elsewhere = elsewhere.as_ref().map(|held| {
            held.iter()
                .map(|(on, r)| json!({"shard": on, "owner": r.owner, "fence": r.fence, "expires_in_ms": r.expires_in_ms}))
                .collect::<Vec<_>>()
        });
        let lease = row.map(|r| {
            json!({
                "held": r.is_held(),
                "owner": r.owner,
                "fence": r.fence,
                "ttl_ms": r.ttl_ms,
                "expires_in_ms": r.expires_in_ms,
                "held_for_ms": r.held_for_ms,
                "wanted_ms_ago": r.wanted_ms_ago,
                "data": r.data.as_deref().map(String::from_utf8_lossy),
            })
        });
        let (held_elsewhere, unread) = match held_elsewhere {
            Ok(held) => (Some(held), None),
            Err(why) => (None, Some(why)),
        };
        println!(
            "{}",
            json!({
                "key": lock.scoped_str(),
                "bucket": lock.bucket_number(),
                "shard": shard,
                "lease": lease,
                "held_elsewhere": held_elsewhere,
                "elsewhere_unread": unread,
                "doubts": doubts.json(),
            })
        );
        return;
    }
    doubts.warn();
    println!("key:     {}", lock_name(lock));
    println!("shard:   {shard}");
    match row {
        None => println!("lease:   never granted on this shard"),
        Some(r) if r.is_held() => {
            println!("holder:  {}", shown(r.owner.as_deref().unwrap_or("-")));
            println!("fence:   up to {} (reserved by the current grant)", r.fence);
            println!(
                "expires: in {} ms (shard clock), lease {} ms",
                r.expires_in_ms, r.ttl_ms
            );
            println!("held:    {} ms", r.held_for_ms);
            if let Some(ago) = r.wanted_ms_ago {
                println!("wanted:  by another owner {ago} ms ago");
            }
            if let Some(data) = &r.data {
                println!("data:    {}", shown(&String::from_utf8_lossy(data)));
            }
        }
        Some(r) => {
            let why = match (&r.owner, r.ttl_ms) {
                // A release with a minimum hold keeps the owner until the hold ends.
                (Some(_), 0) => "released (kept until its minimum hold ended)",
                (Some(_), _) => "expired (holder stopped renewing)",
                (None, _) => "released",
            };
            println!("lease:   free, {why}");
            println!("fence:   {} (the next grant gets a larger one)", r.fence);
        }
    }
    match elsewhere {
        Ok(held) => {
            for (on, r) in held {
                println!(
                    "held on: {on} by {} (fence {}, expires in {} ms): a move, or a config \
                     other than the fleet's",
                    shown(r.owner.as_deref().unwrap_or("-")),
                    r.fence,
                    r.expires_in_ms
                );
            }
        }
        Err(why) => println!("elsewhere: not read ({})", shown(&why.to_string())),
    }
}

/// Data shown in a table cell: its text, cut to `width` characters.
fn cell(data: Option<&[u8]>, width: usize) -> String {
    let Some(data) = data else {
        return "-".into();
    };
    let text = shown(&String::from_utf8_lossy(data).replace(['\n', '\t'], " ")).into_owned();
    if text.chars().count() <= width {
        return text;
    }
    let cut: String = text.chars().take(width.saturating_sub(1)).collect();
    format!("{cut}…")
}

pub(crate) fn list(listing: &shardlock::Listing, as_json: bool) {
    if as_json {
        let leases: Vec<_> = listing
            .leases
            .iter()
            .map(|l| {
                json!({
                    "key": l.key,
                    "bucket": l.bucket,
                    "shard": l.shard,
                    "held": l.row.is_held(),
                    "owner": l.row.owner,
                    "fence": l.row.fence,
                    "expires_in_ms": l.row.expires_in_ms,
                    "held_for_ms": l.row.held_for_ms,
                    "data": l.row.data.as_deref().map(String::from_utf8_lossy),
                })
            })
            .collect();
        let failed: Vec<_> = listing
            .failed
            .iter()
            .map(|(shard, e)| json!({ "shard": shard, "error": e.report().to_string() }))
            .collect();
        println!(
            "{}",
            json!({ "leases": leases, "failed": failed, "truncated": listing.truncated })
        );
        return;
    }
    println!(
        "{:<40} {:<8} {:<36} {:>18} {:>12} {:<24}",
        "KEY", "SHARD", "HOLDER", "FENCE", "EXPIRES IN", "DATA"
    );
    for l in &listing.leases {
        let key = match l.bucket {
            Some(b) => format!("{} [bucket {b}]", shown(&l.key)),
            None => shown(&l.key).into_owned(),
        };
        let (holder, expires) = if l.row.is_held() {
            (
                shown(l.row.owner.as_deref().unwrap_or_default()).into_owned(),
                format!("{} ms", l.row.expires_in_ms),
            )
        } else if l.row.owner.is_some() {
            ("(expired)".into(), "-".into())
        } else {
            ("(free)".into(), "-".into())
        };
        println!(
            "{key:<40} {:<8} {holder:<36} {:>18} {expires:>12} {:<24}",
            l.shard,
            l.row.fence,
            cell(l.row.data.as_deref(), 24)
        );
    }
    if listing.truncated {
        println!("(more leases match: raise --limit or narrow --prefix)");
    }
    for (shard, e) in &listing.failed {
        println!("{shard}: not read: {}", shown(&e.report().to_string()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key or data holding terminal escapes (stored by any application) reaches the
    /// operator's terminal escaped: `\x1b[2J` cleared the screen of whoever ran `list`.
    #[test]
    fn control_characters_are_shown_escaped() {
        assert_eq!(shown("order:1"), "order:1");
        assert!(matches!(shown("order:1"), std::borrow::Cow::Borrowed(_)));
        assert_eq!(shown("a\u{1b}[2Jb\r"), "a\\u{1b}[2Jb\\r");
        // Text that reorders what follows it, or hides: `order:1` shown with its override.
        assert_eq!(shown("order:\u{202e}1"), "order:\\u{202e}1");
        assert_eq!(shown("a\u{200b}b"), "a\\u{200b}b");
        assert_eq!(
            cell(Some(b"x\x1b]0;owned\x07"), 24),
            "x\\u{1b}]0;owned\\u{7}"
        );
        let bucket = LockKey::bucket("sku\u{1b}:1", 3).unwrap();
        assert_eq!(lock_name(&bucket), "sku\\u{1b}:1 [bucket 3]");
    }
}
