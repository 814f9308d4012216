//! Checks of values that parse but make no sense, each naming the field it is about so that
//! the error can be placed in the file.

use std::collections::BTreeMap;
use std::time::Duration;

use super::schema::{url_has_password, url_user};
use super::{
    database_reached, CleanerConfig, Config, ConfigError, InstanceConfig, NamespaceConfig,
    RegistryKind, RoutingConfig, ShardConfig, TelemetryConfig, TlsMode, DEFAULT_CLOCK_DRIFT,
};
use crate::BreakerConfig;

impl Config {
    /// Checks values that parse but make no sense. The error names the field.
    ///
    /// Texts and paths given empty are refused first, then durations longer than
    /// [`MAX_DURATION`]; then sections are checked in
    /// the order the struct declares them, and the first error wins: a file with several
    /// mistakes reports them one at a time, always in the same order.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_no_empty_text(self)?;
        check_durations(self)?;
        check_instance(&self.instance)?;
        check_shards(&self.shards)?;
        check_routing(&self.routing)?;
        check_namespaces(&self.namespaces)?;
        check_clock_margins(&self.instance, &self.shards, &self.namespaces)?;
        check_breaker(&self.breaker)?;
        check_cleaner(&self.cleaner)?;
        // The spread counts only where heartbeats are read (the lapse is theirs).
        let spread = match self.cleaner.registry {
            RegistryKind::Heartbeat => self.node_clock_spread(),
            _ => Duration::ZERO,
        };
        check_lapse(&self.instance, &self.cleaner, spread)?;
        check_telemetry(&self.telemetry)
    }
}

/// Every optional text or path given is something: an empty one (a `${VAR}` set to nothing)
/// would otherwise pass for a setting (an empty TLS server name fails every connection, which
/// looks like the shard down) or send its check astray.
fn check_no_empty_text(config: &Config) -> Result<(), ConfigError> {
    let empty = |field: String| {
        Err(ConfigError::field(
            field,
            "is empty (a variable set to nothing, say): give a value or leave the field out",
        ))
    };
    let path_empty =
        |p: &Option<std::path::PathBuf>| p.as_ref().is_some_and(|p| p.as_os_str().is_empty());
    let text_empty = |t: &Option<String>| t.as_deref() == Some("");
    for (i, shard) in config.shards.iter().enumerate() {
        let field = |name: &str| format!("shards[{i}].{name}");
        let tls = &shard.tls;
        if text_empty(&shard.user) {
            return empty(field("user"));
        }
        for (name, path) in [
            ("password-file", &shard.password_file),
            ("tls.ca-file", &tls.ca_file),
            ("tls.cert-file", &tls.cert_file),
            ("tls.key-file", &tls.key_file),
        ] {
            if path_empty(path) {
                return empty(field(name));
            }
        }
        if text_empty(&tls.server_name) {
            return empty(field("tls.server-name"));
        }
        if url_user(&shard.url) == Some("") && shard.user.is_none() {
            return Err(ConfigError::field(
                field("url"),
                "names an empty user (a variable set to nothing, say): give one in the URL or \
                 in `user`",
            ));
        }
    }
    let t = &config.telemetry;
    if text_empty(&t.prometheus_listen) {
        return empty("telemetry.prometheus-listen".into());
    }
    if text_empty(&t.otlp_endpoint) {
        return empty("telemetry.otlp-endpoint".into());
    }
    if path_empty(&t.otlp_ca_file) {
        return empty("telemetry.otlp-ca-file".into());
    }
    if t.service_name.is_empty() {
        return empty("telemetry.service-name".into());
    }
    Ok(())
}

/// The longest duration any setting takes (a year): a longer one is a typo (`30000d`), and
/// would overflow the clock arithmetic it enters (a panic, not an error naming the field).
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// Every duration of `config`, named as in the file, is at most [`MAX_DURATION`].
fn check_durations(config: &Config) -> Result<(), ConfigError> {
    let (c, b) = (&config.cleaner, &config.breaker);
    let mut all: Vec<(String, Duration)> = [
        (
            "routing.move-window",
            config.routing.move_window.unwrap_or_default(),
        ),
        ("breaker.window", b.window),
        ("breaker.slow-call", b.slow_call),
        ("breaker.cooldown", b.cooldown),
        ("breaker.max-cooldown", b.max_cooldown),
        ("cleaner.interval", c.interval),
        ("cleaner.grace", c.grace),
        ("cleaner.batch-pause", c.batch_pause),
        ("cleaner.heartbeat-interval", c.heartbeat_interval),
        ("cleaner.heartbeat-timeout", c.heartbeat_timeout),
        ("cleaner.instance-retention", c.instance_retention),
        ("telemetry.hot-key-window", config.telemetry.hot_key_window),
    ]
    .into_iter()
    .map(|(f, d)| (f.to_owned(), d))
    .collect();
    for (i, shard) in config.shards.iter().enumerate() {
        let pool = &shard.pool;
        all.extend(
            [
                ("node-clock-skew", shard.node_clock_skew),
                ("statement-timeout", shard.statement_timeout),
                ("pool.wait-timeout", pool.wait_timeout),
                ("pool.create-timeout", pool.create_timeout),
                ("pool.recycle-timeout", pool.recycle_timeout),
                ("pool.idle-check", pool.idle_check),
                ("pool.max-lifetime", pool.max_lifetime),
                ("pool.idle-timeout", pool.idle_timeout),
            ]
            .map(|(f, d)| (format!("shards[{i}].{f}"), d)),
        );
    }
    for (name, ns) in &config.namespaces {
        all.extend(
            [
                ("ttl", ns.ttl),
                ("renew-interval", ns.renew_interval.unwrap_or_default()),
                ("wait", ns.wait),
                ("backoff-base", ns.backoff_base),
                ("backoff-cap", ns.backoff_cap),
                ("handoff-max-time", ns.handoff_max_time),
            ]
            .map(|(f, d)| (format!("namespaces.{name}.{f}"), d)),
        );
    }
    match all.into_iter().find(|(_, d)| *d > MAX_DURATION) {
        Some((field, d)) => Err(ConfigError::field(
            field,
            format!("{d:?} is longer than any setting takes (at most 365d)"),
        )),
        None => Ok(()),
    }
}

/// The id and the fleet are stored in the registry's 100-byte columns, and the id is the
/// first part of every owner, whose parts ':' separates.
fn check_instance(instance: &InstanceConfig) -> Result<(), ConfigError> {
    if let Some(id) = &instance.id {
        if id.is_empty() || id.len() > 100 || id.contains(':') {
            return Err(ConfigError::field(
                "instance.id",
                "must be 1 to 100 bytes without ':' (it prefixes every owner), or `auto`",
            ));
        }
    }
    if let Some(fleet) = &instance.fleet {
        if fleet.is_empty() || fleet.len() > 100 {
            return Err(ConfigError::field(
                "instance.fleet",
                "must be 1 to 100 bytes",
            ));
        }
    }
    if let Some(drift) = instance.clock_drift {
        if !(0.0..=0.5).contains(&drift) {
            return Err(ConfigError::field(
                "instance.clock-drift",
                format!("must be a fraction between 0 and 0.5 (0.01 is 1%), got {drift}"),
            ));
        }
    }
    Ok(())
}

/// A shard's name is what places its keys on the ring and labels its errors and metrics, so
/// names must be unique plain tokens; shards are checked in file order, so a repeated name
/// is reported where it repeats, not where it first appears.
fn check_shards(shards: &[ShardConfig]) -> Result<(), ConfigError> {
    if shards.is_empty() {
        return Err(ConfigError::field(
            "shards",
            "at least one shard is required",
        ));
    }
    for (i, shard) in shards.iter().enumerate() {
        let field = |f: &str| format!("shards[{i}].{f}");
        let name_ok = !shard.name.is_empty()
            && shard.name.len() <= 64
            && shard
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !name_ok {
            return Err(ConfigError::field(
                field("name"),
                format!(
                    "`{}` is not a valid shard name: use 1-64 of [A-Za-z0-9_-]",
                    shard.name
                ),
            ));
        }
        if let Some(j) = shards[..i].iter().position(|s| s.name == shard.name) {
            return Err(ConfigError::field(
                field("name"),
                format!("shard name `{}` is already used by shards[{j}]", shard.name),
            ));
        }
        if !shard.url.starts_with("mysql://") {
            return Err(ConfigError::field(
                field("url"),
                "must look like mysql://user:password@host:port/database",
            ));
        }
        if let Some(problem) = super::schema::url_problem(&shard.url) {
            return Err(ConfigError::field(field("url"), problem));
        }
        // Two shards on one table would each take the other's rows for their own: a lease
        // that a reload moves from one to the other takes its companion row in its own row,
        // and releasing the row it left would free the key it still holds.
        let (addresses, database) = database_reached(&shard.url, &shard.nodes);
        let same = shards[..i].iter().enumerate().find_map(|(j, other)| {
            let (theirs, their_database) = database_reached(&other.url, &other.nodes);
            let shared = addresses.iter().find(|a| theirs.contains(a))?;
            (their_database == database).then_some((j, shared))
        });
        if let Some((j, address)) = same {
            return Err(ConfigError::field(
                field(if shard.nodes.is_empty() {
                    "url"
                } else {
                    "nodes"
                }),
                format!(
                    "reaches database `{database}` at {address}, as shards[{j}] (`{}`) does: \
                     each shard needs a database of its own (its rows would be the other's)",
                    shards[j].name
                ),
            ));
        }
        if shard.node_clock_skew.is_zero() || shard.node_clock_skew > Duration::from_secs(10) {
            return Err(ConfigError::field(
                field("node-clock-skew"),
                "must be above zero and at most 10s (leases end locally twice this early)",
            ));
        }
        for (j, node) in shard.nodes.iter().enumerate() {
            let (host, port) = node.rsplit_once(':').unwrap_or((node.as_str(), "3306"));
            if host.is_empty()
                || host.contains(['/', '@', '?', ' '])
                || port.parse::<u16>().map_or(true, |p| p == 0)
            {
                return Err(ConfigError::field(
                    field(&format!("nodes[{j}]")),
                    format!("`{node}` is not a node address such as db-1.internal:3306"),
                ));
            }
            if let Some(k) = shard.nodes[..j].iter().position(|n| n == node) {
                return Err(ConfigError::field(
                    field(&format!("nodes[{j}]")),
                    format!("`{node}` is listed twice (also nodes[{k}])"),
                ));
            }
        }
        let (addresses, _) = database_reached(&shard.url, &[]);
        if !shard.nodes.is_empty() && addresses.iter().any(|a| a.starts_with("socket ")) {
            return Err(ConfigError::field(
                field("url"),
                "has a `socket`, which every node's connection would use (each reaching the \
                 local server): a Galera shard's nodes are reached over TCP",
            ));
        }
        if shard.password.is_some() && shard.password_file.is_some() {
            return Err(ConfigError::field(
                field("password-file"),
                "give either password or password-file, not both",
            ));
        }
        if (shard.password.is_some() || shard.password_file.is_some())
            && url_has_password(&shard.url)
        {
            return Err(ConfigError::field(
                field("url"),
                "the URL has a password and so does the shard (password or password-file): keep one",
            ));
        }
        let tls = &shard.tls;
        if matches!(tls.mode, TlsMode::VerifyCa | TlsMode::VerifyIdentity) && tls.ca_file.is_none()
        {
            return Err(ConfigError::field(
                field("tls.ca-file"),
                "verify-ca and verify-identity check the server's certificate against this CA: name its file",
            ));
        }
        if tls.cert_file.is_some() != tls.key_file.is_some() {
            return Err(ConfigError::field(
                field(if tls.cert_file.is_some() {
                    "tls.key-file"
                } else {
                    "tls.cert-file"
                }),
                "a client certificate needs both cert-file and key-file",
            ));
        }
        if tls.ca_file.is_some() && matches!(tls.mode, TlsMode::Preferred | TlsMode::Required) {
            return Err(ConfigError::field(
                field("tls.ca-file"),
                "preferred and required check no certificate: use verify-identity to check it against this CA",
            ));
        }
        if tls.server_name.is_some() && tls.mode != TlsMode::VerifyIdentity {
            return Err(ConfigError::field(
                field("tls.server-name"),
                "the name is checked by verify-identity only",
            ));
        }
        if tls.mode == TlsMode::Disabled && (tls.ca_file.is_some() || tls.cert_file.is_some()) {
            return Err(ConfigError::field(
                field("tls.mode"),
                "TLS files are given but the mode is `disabled`: set a mode",
            ));
        }
        if shard.weight == 0 || shard.weight > 100 {
            return Err(ConfigError::field(
                field("weight"),
                "must be between 1 and 100",
            ));
        }
        if shard.pool.max_size == 0 {
            return Err(ConfigError::field(
                field("pool.max-size"),
                "must be at least 1",
            ));
        }
        for (name, value) in [
            ("pool.max-lifetime", shard.pool.max_lifetime),
            ("pool.idle-timeout", shard.pool.idle_timeout),
        ] {
            if value < Duration::from_secs(1) {
                return Err(ConfigError::field(field(name), "must be at least 1s"));
            }
        }
        // Zero would make every new connection, every checkout under load and every reuse of
        // a connection fail at once: the shard counted down while it answers.
        for (name, value) in [
            ("pool.wait-timeout", shard.pool.wait_timeout),
            ("pool.create-timeout", shard.pool.create_timeout),
            ("pool.recycle-timeout", shard.pool.recycle_timeout),
        ] {
            if value.is_zero() {
                return Err(ConfigError::field(field(name), "must be greater than zero"));
            }
        }
        if let Some(n) = shard.pool.batches_in_flight {
            if n == 0 || n > shard.pool.max_size {
                return Err(ConfigError::field(
                    field("pool.batches-in-flight"),
                    format!(
                        "must be between 1 and pool.max-size ({})",
                        shard.pool.max_size
                    ),
                ));
            }
        }
        if shard.statement_timeout.is_zero() {
            return Err(ConfigError::field(
                field("statement-timeout"),
                "must be greater than zero",
            ));
        }
    }
    Ok(())
}

/// A shard gets `virtual-nodes` times its weight points on the ring; with the weight's own
/// bound this keeps one shard below a million points.
fn check_routing(routing: &RoutingConfig) -> Result<(), ConfigError> {
    if routing.virtual_nodes == 0 || routing.virtual_nodes > 10_000 {
        return Err(ConfigError::field(
            "routing.virtual-nodes",
            "must be between 1 and 10000",
        ));
    }
    // No time at all for a lease to follow its moved key, nor for the fleet to reload.
    if routing.move_window.is_some_and(|w| w.is_zero()) {
        return Err(ConfigError::field(
            "routing.move-window",
            "must be greater than zero (default: twice the longest ttl plus 10s)",
        ));
    }
    Ok(())
}

/// A lease ends locally before its ttl: a millisecond (the shard's truncation) and the share
/// `instance.clock-drift` the shard's clock may run ahead of ours go first, and on a Galera
/// shard `2 × node-clock-skew` more, since two of its nodes' clocks may be that far apart.
/// Every namespace's leases (a key may live on any shard) must last more than twice the
/// Galera margin, and be renewed within what is left of them: a renewal due later finds the
/// lease already lost.
fn check_clock_margins(
    instance: &InstanceConfig,
    shards: &[ShardConfig],
    namespaces: &BTreeMap<String, NamespaceConfig>,
) -> Result<(), ConfigError> {
    let drift = instance.clock_drift.unwrap_or(DEFAULT_CLOCK_DRIFT);
    let galera = shards
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.nodes.is_empty())
        .max_by_key(|(_, s)| s.node_clock_skew);
    let margin = galera.map_or(Duration::ZERO, |(_, s)| s.node_clock_skew * 2);
    for (name, ns) in namespaces {
        let field = |f: &str| format!("namespaces.{name}.{f}");
        if let Some((i, _)) = galera.filter(|_| ns.ttl <= margin * 2) {
            return Err(ConfigError::field(
                field("ttl"),
                format!(
                    "must be above {:?}: leases on shards[{i}] (Galera) end {margin:?} early \
                     (2 × its node-clock-skew); lengthen the ttl or lower node-clock-skew",
                    margin * 2
                ),
            ));
        }
        let ends = (ns.ttl.saturating_sub(Duration::from_millis(1)))
            .mul_f64(1.0 - drift)
            .saturating_sub(margin);
        // The default too (a third of the ttl): a Galera margin and a large drift together
        // can end a lease before it.
        if ns.renew_interval_for(ns.ttl) >= ends {
            let galera = match galera {
                Some((i, _)) => format!(", less {margin:?} on shards[{i}] (Galera)"),
                None => String::new(),
            };
            return Err(ConfigError::field(
                field("renew-interval"),
                format!(
                    "must be below {ends:?}: a lease ends locally at (ttl − 1ms) × (1 − \
                     instance.clock-drift){galera}, and would be lost before its renewal"
                ),
            ));
        }
    }
    Ok(())
}

/// Each namespace is checked against its own ttl, since renewal and in-memory hand-offs are
/// timed within one lease of that namespace.
fn check_namespaces(namespaces: &BTreeMap<String, NamespaceConfig>) -> Result<(), ConfigError> {
    for (name, ns) in namespaces {
        let field = |f: &str| format!("namespaces.{name}.{f}");
        if name.is_empty() || name.len() > 64 {
            return Err(ConfigError::field(
                format!("namespaces.{name}"),
                "names are 1-64 bytes",
            ));
        }
        check_ttl(ns.ttl).map_err(|m| ConfigError::field(field("ttl"), m))?;
        if let Some(every) = ns.renew_interval {
            if every.is_zero() || every >= ns.ttl {
                return Err(ConfigError::field(
                    field("renew-interval"),
                    format!("must be above zero and below the ttl ({:?})", ns.ttl),
                ));
            }
        }
        if ns.buckets == 0 || ns.buckets > MAX_BUCKETS {
            return Err(ConfigError::field(
                field("buckets"),
                format!("must be between 1 and {MAX_BUCKETS}"),
            ));
        }
        if ns.handoff_max_count > 1_000_000 {
            return Err(ConfigError::field(
                field("handoff-max-count"),
                "must be at most 1000000",
            ));
        }
        if ns.handoff_max_time >= ns.ttl {
            return Err(ConfigError::field(
                field("handoff-max-time"),
                format!("must be below the ttl ({:?})", ns.ttl),
            ));
        }
        if ns.backoff_base.is_zero() || ns.backoff_cap < ns.backoff_base {
            return Err(ConfigError::field(
                field("backoff-base"),
                "backoff-base must be above zero and at most backoff-cap",
            ));
        }
        if let Some(prefix) = &ns.key_prefix {
            if prefix.is_empty() || prefix.len() > 64 {
                return Err(ConfigError::field(
                    field("key-prefix"),
                    "must be 1-64 bytes (leave it out for keys as given)",
                ));
            }
            // Scopes must not overlap: with `bill` and `billing`, `bill` + `ing:1` would be
            // `billing` + `:1`.
            let overlapping = namespaces.iter().find(|(other, o)| {
                *other != name
                    && o.key_prefix
                        .as_deref()
                        .is_some_and(|p| p.len() > prefix.len() && p.starts_with(prefix.as_str()))
            });
            if let Some((other, _)) = overlapping {
                return Err(ConfigError::field(
                    field("key-prefix"),
                    format!(
                        "`{prefix}` begins namespaces.{other}.key-prefix: a key of one scope \
                         could be a key of the other; end prefixes with a separator such as `/`"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Every breaker field is bounded on its own (only the cool-down looks at another), so the
/// checks read as a table.
fn check_breaker(b: &BreakerConfig) -> Result<(), ConfigError> {
    first_failed(&[
        (
            "breaker.failure-rate",
            b.failure_rate > 0.0 && b.failure_rate <= 1.0,
            "must be above 0 and at most 1",
        ),
        ("breaker.window", !b.window.is_zero(), "must be above zero"),
        (
            "breaker.consecutive-failures",
            b.consecutive_failures > 0,
            "must be at least 1",
        ),
        ("breaker.min-calls", b.min_calls > 0, "must be at least 1"),
        (
            "breaker.slow-call",
            !b.slow_call.is_zero(),
            "must be above zero",
        ),
        (
            "breaker.cooldown",
            !b.cooldown.is_zero() && b.cooldown <= b.max_cooldown,
            "must be above zero and at most max-cooldown",
        ),
        ("breaker.probes", b.probes > 0, "must be at least 1"),
    ])
}

/// Like the breaker's, the cleaner's checks are one condition per field. The heartbeat pair
/// matters most: the cleaner deletes an expired lease once its holder's instance looks dead.
fn check_cleaner(c: &CleanerConfig) -> Result<(), ConfigError> {
    first_failed(&[
        (
            "cleaner.interval",
            !c.interval.is_zero(),
            "must be above zero",
        ),
        (
            "cleaner.batch-size",
            (1..=10_000).contains(&c.batch_size),
            "must be between 1 and 10000",
        ),
        (
            "cleaner.heartbeat-interval",
            !c.heartbeat_interval.is_zero(),
            "must be above zero",
        ),
        (
            "cleaner.heartbeat-timeout",
            c.heartbeat_timeout >= c.heartbeat_interval * 2,
            "must be at least twice heartbeat-interval, or a late heartbeat makes a live \
             instance look dead",
        ),
        (
            "cleaner.heartbeat-timeout",
            c.heartbeat_timeout <= Duration::from_secs(24 * 3600),
            "must be at most 24h: every process counts an instance live for as long as its \
             own timeout says",
        ),
        (
            "cleaner.instance-retention",
            c.instance_retention >= c.heartbeat_timeout.max(Duration::from_secs(3600)),
            "must be at least 1h and at least heartbeat-timeout: only rows that no process of any \
             fleet sharing these shards can still count as alive may go",
        ),
    ])?;
    check_live_instances(c)
}

/// `live-instances` are instance ids, matched against the first part of each owner: an entry
/// that can be no such id (empty, too long, an owner pasted whole) never matches, and the
/// holders it was meant to keep would count as dead. Read only by the `static` registry.
fn check_live_instances(c: &CleanerConfig) -> Result<(), ConfigError> {
    if c.registry != RegistryKind::Static && !c.live_instances.is_empty() {
        return Err(ConfigError::field(
            "cleaner.live-instances",
            "is read only with `registry: static` (this registry is heartbeat, whose \
             instances say themselves that they live): remove it, or set the registry",
        ));
    }
    for (i, id) in c.live_instances.iter().enumerate() {
        if id.is_empty() || id.len() > 100 || id.contains(':') {
            return Err(ConfigError::field(
                format!("cleaner.live-instances[{i}]"),
                "must be an instance id, 1 to 100 bytes without ':' (an owner's first part, \
                 as `instance.id` sets it)",
            ));
        }
    }
    Ok(())
}

/// A router stops granting once its latest heartbeat is `timeout / (1 + clock-drift) −
/// interval / 2 − spread` old by its own clock (at the latest; see `state.rs`; `spread` is
/// how far apart two nodes of a Galera shard may read the heartbeat's age), so that it has
/// stopped before the others count it dead even by a clock that slow, read through another
/// node. That must leave it more than its next heartbeat, or it lapses on every one.
fn check_lapse(
    instance: &InstanceConfig,
    c: &CleanerConfig,
    spread: Duration,
) -> Result<(), ConfigError> {
    let drift = instance.clock_drift.unwrap_or(DEFAULT_CLOCK_DRIFT);
    let least = (c.heartbeat_interval.mul_f64(1.75) + spread).mul_f64(1.0 + drift);
    if c.heartbeat_timeout < least {
        return Err(ConfigError::field(
            "cleaner.heartbeat-timeout",
            format!(
                "must be at least (1.75 × heartbeat-interval + 2 × the largest node-clock-skew \
                 of a Galera shard) × (1 + instance.clock-drift) = {least:?}: a router stops \
                 granting at heartbeat-timeout / (1 + clock-drift) − heartbeat-interval / 2 − \
                 2 × node-clock-skew after its latest heartbeat (the others may read its age \
                 through a node whose clock is that far ahead), which must leave it its next one"
            ),
        ));
    }
    Ok(())
}

/// The exporters start after the config is loaded (`shardlock::telemetry::init`); checking
/// their addresses here makes a typo fail with the file's line instead of at that later start.
fn check_telemetry(t: &TelemetryConfig) -> Result<(), ConfigError> {
    if let Some(listen) = &t.prometheus_listen {
        if listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(ConfigError::field(
                "telemetry.prometheus-listen",
                format!("`{listen}` is not an address such as 127.0.0.1:9464"),
            ));
        }
    }
    if let Some(endpoint) = &t.otlp_endpoint {
        let scheme = endpoint.to_ascii_lowercase();
        if !scheme.starts_with("http://") && !scheme.starts_with("https://") {
            return Err(ConfigError::field(
                "telemetry.otlp-endpoint",
                format!("`{endpoint}` is not a URL such as http://127.0.0.1:4318"),
            ));
        }
    }
    if t.otlp_ca_file.is_some()
        && !t
            .otlp_endpoint
            .as_deref()
            .is_some_and(|e| e.to_ascii_lowercase().starts_with("https://"))
    {
        return Err(ConfigError::field(
            "telemetry.otlp-ca-file",
            "a CA is only used with an https:// otlp-endpoint",
        ));
    }
    if !(0.0..=1.0).contains(&t.trace_sample_ratio) {
        return Err(ConfigError::field(
            "telemetry.trace-sample-ratio",
            "must be between 0 and 1",
        ));
    }
    if !(1..=1000).contains(&t.hot_keys) || t.hot_key_window.is_zero() {
        return Err(ConfigError::field(
            "telemetry.hot-keys",
            "hot-keys must be 1-1000 and hot-key-window above zero",
        ));
    }
    Ok(())
}

/// The first `(field, ok, message)` row whose condition fails, as the error on its field.
fn first_failed(checks: &[(&str, bool, &str)]) -> Result<(), ConfigError> {
    match checks.iter().find(|(_, ok, _)| !ok) {
        Some((field, _, message)) => Err(ConfigError::field(*field, *message)),
        None => Ok(()),
    }
}

/// Most buckets a key may be split into.
pub const MAX_BUCKETS: u32 = 1024;

/// The shortest lease accepted: renewal must fit comfortably inside it.
pub const MIN_TTL: Duration = Duration::from_millis(100);
/// The longest lease accepted (stored as milliseconds in an unsigned 32-bit column).
pub const MAX_TTL: Duration = Duration::from_secs(86_400);

/// Checks a lease length, for the file and for per-call overrides alike.
pub fn check_ttl(ttl: Duration) -> Result<(), String> {
    if ttl < MIN_TTL || ttl > MAX_TTL {
        Err(format!(
            "a lease must last between {MIN_TTL:?} and {MAX_TTL:?}, got {ttl:?}"
        ))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, ShardConfig, DEFAULT_FLEET, GOOD};

    #[test]
    fn a_heartbeat_timeout_too_short_for_the_clock_drift_is_refused() {
        let yaml = |drift: &str| {
            format!(
                "instance:\n  clock-drift: {drift}\ncleaner:\n  heartbeat-interval: 1s\n  \
                 heartbeat-timeout: 2s\n{GOOD}"
            )
        };
        assert!(Config::from_yaml_str(&yaml("0.01")).is_ok());
        let e = Config::from_yaml_str(&yaml("0.5")).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("cleaner.heartbeat-timeout"), "{e}");
    }

    /// A heartbeat written through one Galera node and read through another looks older by up
    /// to twice `node-clock-skew`: the timeout must leave room for that before the writer's
    /// next heartbeat.
    #[test]
    fn a_heartbeat_timeout_too_short_for_a_galera_shards_node_clock_skew_is_refused() {
        let yaml = |timeout: &str| {
            format!(
                "shards:\n  - name: g\n    url: mysql://root@127.0.0.1:3307/db\n    \
                 nodes: [127.0.0.1:3307, 127.0.0.1:3308]\n    node-clock-skew: 800ms\n\
                 cleaner:\n  heartbeat-interval: 1s\n  heartbeat-timeout: {timeout}\n\
                 namespaces:\n  default:\n    ttl: 10s\n"
            )
        };
        let e = Config::from_yaml_str(&yaml("3s")).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("cleaner.heartbeat-timeout"), "{e}");
        assert!(Config::from_yaml_str(&yaml("4s")).is_ok());
        // Nobody reads heartbeats under the static registry.
        let unread = yaml("3s").replace("cleaner:\n", "cleaner:\n  registry: static\n");
        assert!(Config::from_yaml_str(&unread).is_ok());
    }

    /// A URL the driver would read otherwise than its text says is refused on its field, with
    /// no part of its password in the error; a password holding `@`, an IPv6 host and a
    /// socket path are read alike by both.
    #[test]
    fn a_url_the_driver_would_misread_is_refused_without_its_password() {
        let with = |url: &str| {
            let yaml = GOOD.replace("mysql://root@127.0.0.1:33061/shardlock", url);
            assert_ne!(yaml, GOOD, "the URL was not replaced");
            Config::from_yaml_str(&yaml)
        };
        for (url, says) in [
            ("mysql://u:ab/cd@db:3306/locks", "percent-encode"),
            ("mysql://u:p@ssw?rd123@db/locks", "percent-encode"),
            ("mysql://u:p@ss/w0rd@db/locks", "percent-encode"),
            ("mysql://u:se#cret9@db/locks", "percent-encode"),
            ("mysql://u:a@evil?x=y@db/locks", "percent-encode"),
            ("mysql://u:a@b:c?x=y@db:3306/locks", "percent-encode"),
            ("mysql://u@db:33o6/locks", "port is not a number"),
            ("mysql://u@db:0/locks", "port is not a number"),
        ] {
            let e = with(url).unwrap_err();
            assert_eq!(e.field.as_deref(), Some("shards[0].url"), "{url}: {e}");
            let text = e.to_string();
            assert!(text.contains(says), "{url}: {text}");
            for secret in ["cd@", "rd123", "w0rd", "cret9", "evil", "`c`", "33o6"] {
                assert!(
                    !text.contains(secret),
                    "{url}: the error shows the password: {text}"
                );
            }
        }
        for url in [
            "mysql://u:p@ss@db:3306/locks",
            "mysql://u:p%2Fss@db:3306/locks",
            "mysql://u@[::1]:3306/locks",
            "mysql://u@localhost/locks?socket=/run/mysqld/a@b.sock",
            "mysql://db.internal/locks?socket=/run/mysqld/a@b.sock",
            "mysql://db.internal:/locks",
        ] {
            assert!(with(url).is_ok(), "{url}: {:?}", with(url).err());
        }
        // Whatever it is refused for, its `Debug` shows no password.
        let shard = crate::config::ShardConfig {
            url: "mysql://app:Tr/9?x=1@db/locks".into(),
            ..ShardConfig::default()
        };
        let shown = format!("{shard:?}");
        assert!(!shown.contains("Tr/9"), "{shown}");
    }

    /// An optional text or path given empty (a variable set to nothing) is refused on its
    /// field, an empty user in the URL too; a URL whose socket path holds an `@` has no
    /// password of its own, so one given beside it is taken.
    #[test]
    fn empty_settings_are_refused_on_their_field() {
        let shard = |url: &str, more: &str| {
            Config::from_yaml_str(&format!("shards:\n  - name: s1\n    url: {url}\n{more}"))
        };
        for (more, field) in [
            ("    user: \"\"\n", "shards[0].user"),
            ("    password-file: \"\"\n", "shards[0].password-file"),
            (
                "    tls: {mode: verify-identity, ca-file: /ca.pem, server-name: \"\"}\n",
                "shards[0].tls.server-name",
            ),
            (
                "telemetry:\n  otlp-endpoint: \"\"\n",
                "telemetry.otlp-endpoint",
            ),
            (
                "telemetry:\n  service-name: \"\"\n",
                "telemetry.service-name",
            ),
        ] {
            let e = shard("mysql://root@127.0.0.1:3306/db", more).unwrap_err();
            assert_eq!(e.field.as_deref(), Some(field), "{more}: {e}");
        }
        let e = shard("mysql://:pw@127.0.0.1:3306/db", "").unwrap_err();
        assert_eq!(e.field.as_deref(), Some("shards[0].url"), "{e}");
        // An empty password in the URL (a variable set to nothing) is no password beside
        // `password-file`.
        let file = shard("mysql://app:@127.0.0.1:3306/db", "    password-file: /pw\n");
        assert!(file.is_ok(), "{file:?}");
        let both = shard(
            "mysql://app:pw@127.0.0.1:3306/db",
            "    password-file: /pw\n",
        );
        assert_eq!(both.unwrap_err().field.as_deref(), Some("shards[0].url"));
        let socket = "mysql://db:3306/locks?socket=/run/mysqld/mysqld@main.sock";
        let given = shard(socket, "    user: app\n    password: x\n");
        assert!(given.is_ok(), "{given:?}");
    }

    /// A Galera shard's nodes are reached over TCP: a socket in its URL would make every node
    /// the local server, and failover would go nowhere.
    #[test]
    fn a_galera_shard_with_a_socket_in_its_url_is_refused() {
        let yaml = |query: &str| {
            format!(
                "shards:\n  - name: g\n    url: mysql://root@127.0.0.1:3307/db{query}\n    \
                 nodes: [127.0.0.1:3307, 127.0.0.1:3308]\n"
            )
        };
        assert!(Config::from_yaml_str(&yaml("")).is_ok());
        let e = Config::from_yaml_str(&yaml("?socket=/run/mysqld/mysqld.sock")).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("shards[0].url"), "{e}");
    }

    #[test]
    fn key_prefixes_must_be_short_and_must_not_overlap() {
        let with = |prefixes: &[(&str, &str)]| {
            // GOOD ends inside `namespaces:`.
            let mut yaml = GOOD.to_owned();
            for (name, prefix) in prefixes {
                yaml.push_str(&format!("  {name}:\n    key-prefix: \"{prefix}\"\n"));
            }
            Config::from_yaml_str(&yaml)
        };
        let c = with(&[("billing", "billing/"), ("orders", "orders/")]).unwrap();
        let billing = c.namespace("billing").unwrap();
        assert_eq!(billing.key_prefix.as_deref(), Some("billing/"));
        // Two namespaces may share one scope on purpose.
        assert!(with(&[("a", "shared/"), ("b", "shared/")]).is_ok());
        let e = with(&[("billing", "")]).unwrap_err();
        assert_eq!(
            e.field.as_deref(),
            Some("namespaces.billing.key-prefix"),
            "{e}"
        );
        let e = with(&[("bill", "bill"), ("billing", "billing")]).unwrap_err();
        assert_eq!(
            e.field.as_deref(),
            Some("namespaces.bill.key-prefix"),
            "{e}"
        );
        assert!(
            e.to_string().contains("namespaces.billing.key-prefix"),
            "{e}"
        );
    }

    /// A duration past any use is refused naming its field: the heartbeat's arithmetic
    /// panicked on one (`heartbeat-interval × 2` overflowed), and others would have later.
    #[test]
    fn durations_past_a_year_are_refused_naming_their_field() {
        for (yaml, field) in [
            (
                format!("cleaner:\n  heartbeat-interval: 10000000000000000000s\n{GOOD}"),
                "cleaner.heartbeat-interval",
            ),
            (
                format!("telemetry:\n  hot-key-window: 400d\n{GOOD}"),
                "telemetry.hot-key-window",
            ),
            (
                format!("routing:\n  move-window: 1000000d\n{GOOD}"),
                "routing.move-window",
            ),
            (
                format!("{GOOD}  jobs:\n    wait: 366d\n"),
                "namespaces.jobs.wait",
            ),
        ] {
            let e = Config::from_yaml_str(&yaml).unwrap_err();
            assert_eq!(e.field.as_deref(), Some(field), "{e}");
            assert!(e.to_string().contains("365d"), "{e}");
        }
        let year = format!("cleaner:\n  instance-retention: 365d\n{GOOD}");
        Config::from_yaml_str(&year).unwrap();
    }

    /// Entries of `live-instances` are instance ids, and only the static registry reads them.
    #[test]
    fn live_instances_are_instance_ids_read_by_the_static_registry() {
        let cleaner = |more: &str| {
            Config::from_yaml_str(&format!(
                "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:3306/db\ncleaner:\n{more}"
            ))
        };
        assert!(cleaner("  registry: static\n  live-instances: [w1, w2]\n").is_ok());
        assert!(cleaner("  live-instances: []\n").is_ok());
        for (entries, field) in [
            ("[w1, \"\"]", "cleaner.live-instances[1]"),
            ("[\"svc:ab12:7\"]", "cleaner.live-instances[0]"),
        ] {
            let e = cleaner(&format!(
                "  registry: static\n  live-instances: {entries}\n"
            ))
            .unwrap_err();
            assert_eq!(e.field.as_deref(), Some(field), "{entries}: {e}");
        }
        let e = cleaner("  live-instances: [w1]\n").unwrap_err();
        assert_eq!(e.field.as_deref(), Some("cleaner.live-instances"), "{e}");
    }

    #[test]
    fn an_empty_fleet_is_refused_and_none_means_default() {
        let c = Config::from_yaml_str(GOOD).unwrap();
        assert_eq!(c.instance.fleet(), DEFAULT_FLEET);
        let e = Config::from_yaml_str(&format!("instance:\n  fleet: ''\n{GOOD}")).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("instance.fleet"), "{e}");
    }

    #[test]
    fn the_first_section_in_declaration_order_names_the_error() {
        let mut c = Config::default();
        c.instance.id = Some("a:b".into());
        c.breaker.probes = 0;
        c.telemetry.trace_sample_ratio = 2.0;
        let field = |c: &Config| c.validate().unwrap_err().field;
        assert_eq!(field(&c).as_deref(), Some("instance.id"));
        c.instance.id = None;
        assert_eq!(field(&c).as_deref(), Some("shards"));
        c.shards.push(ShardConfig {
            name: "s1".into(),
            url: "mysql://root@127.0.0.1:33061/shardlock".into(),
            ..ShardConfig::default()
        });
        assert_eq!(field(&c).as_deref(), Some("breaker.probes"));
        c.breaker.probes = 1;
        assert_eq!(field(&c).as_deref(), Some("telemetry.trace-sample-ratio"));
        c.telemetry.trace_sample_ratio = 1.0;
        assert_eq!(c.validate(), Ok(()));
    }

    /// Each TLS section a shard would not honour as written is refused, naming the field.
    #[test]
    fn tls_settings_that_would_not_be_honoured_are_refused_by_field() {
        let shard = |url: &str, tls: &str| {
            format!("shards:\n  - name: s1\n    url: {url}\n    tls:\n{tls}")
        };
        let url = "mysql://root@db.internal:3306/shardlock";
        for (yaml, field) in [
            (shard(url, "      mode: verify-identity\n"), "shards[0].tls.ca-file"),
            (
                shard(url, "      mode: required\n      ca-file: /ca.pem\n"),
                "shards[0].tls.ca-file",
            ),
            (
                shard(url, "      mode: verify-identity\n      ca-file: /ca.pem\n      cert-file: /c.pem\n"),
                "shards[0].tls.key-file",
            ),
            (
                shard(url, "      mode: required\n      server-name: db\n"),
                "shards[0].tls.server-name",
            ),
            (
                shard(url, "      mode: disabled\n      ca-file: /ca.pem\n"),
                "shards[0].tls.mode",
            ),
        ] {
            let e = Config::from_yaml_str(&yaml).unwrap_err();
            assert_eq!(e.field.as_deref(), Some(field), "{yaml}\n{e}");
        }
    }

    /// A Galera shard ends leases `2 × node-clock-skew` early: every namespace's ttl must be
    /// above twice that, and its renewals come before the early end.
    #[test]
    fn leases_must_outlast_a_galera_shards_clock_margin() {
        let config = |skew: &str, ns: &str| {
            format!(
                "shards:\n  - name: s1\n    url: mysql://root@db-1:3306/shardlock\n    \
                 nodes: [db-1:3306, db-2:3306]\n    node-clock-skew: {skew}\n\
                 namespaces:\n  default: {{ {ns} }}\n"
            )
        };
        // 10 s leases: the margin of 2 × 2 s fits twice, that of 2 × 3 s does not.
        assert!(Config::from_yaml_str(&config("2s", "ttl: 10s")).is_ok());
        let e = Config::from_yaml_str(&config("3s", "ttl: 10s")).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("namespaces.default.ttl"), "{e}");
        assert!(e.to_string().contains("shards[0]"), "{e}");
        // Renewals every 7 s would come after leases ended locally at 10 - 4 s.
        let e = Config::from_yaml_str(&config("2s", "ttl: 10s, renew-interval: 7s")).unwrap_err();
        assert_eq!(
            e.field.as_deref(),
            Some("namespaces.default.renew-interval"),
            "{e}"
        );
        // Without nodes the skew is not used.
        let plain = config("3s", "ttl: 10s").replace("    nodes: [db-1:3306, db-2:3306]\n", "");
        assert!(Config::from_yaml_str(&plain).is_ok(), "{plain}");
    }

    /// Two shards reaching one database would share its rows: refused, naming the second
    /// shard's field and the first shard. The same server with another database, or another
    /// server with the same database name, is fine.
    #[test]
    fn two_shards_reaching_one_database_are_refused() {
        let config = |second: &str| {
            format!(
                "shards:\n  - name: a\n    url: mysql://u:p@DB-1:3306/locks\n  - name: b\n{second}"
            )
        };
        for second in [
            "    url: mysql://other:secret@db-1/locks\n",
            "    url: mysql://u@db-1:3306/locks?ssl-mode=required\n",
            "    url: mysql://u@db-2:3306/locks\n    nodes: [db-2:3306, db-1]\n",
        ] {
            let e = Config::from_yaml_str(&config(second)).unwrap_err();
            let field = if second.contains("nodes") {
                "nodes"
            } else {
                "url"
            };
            assert_eq!(
                e.field.as_deref(),
                Some(&*format!("shards[1].{field}")),
                "{e}"
            );
            assert!(
                e.to_string()
                    .contains("`locks` at db-1:3306, as shards[0] (`a`)"),
                "{e}"
            );
        }
        for second in [
            "    url: mysql://u:p@db-1:3306/locks2\n",
            "    url: mysql://u:p@db-1:3307/locks\n",
            "    url: mysql://u:p@db-2:3306/locks\n",
            "    url: mysql://u:p@localhost/locks?socket=/run/mysqld/b.sock\n",
        ] {
            assert!(Config::from_yaml_str(&config(second)).is_ok(), "{second}");
        }
    }

    /// On any shard a lease ends locally `instance.clock-drift` of its ttl early: renewals
    /// due after that found every lease lost, and the config was taken without a word. So
    /// did the default renewal (a third of the ttl) with a Galera margin and a large drift.
    #[test]
    fn renewals_must_come_before_a_lease_ends_by_the_clock_drift() {
        let galera = "instance:\n  clock-drift: 0.25\nshards:\n  - name: g\n    \
                      url: mysql://root@db-1:3306/shardlock\n    nodes: [db-1:3306]\n    \
                      node-clock-skew: 450ms\nnamespaces:\n  default: { ttl: 2s }\n";
        let e = Config::from_yaml_str(galera).unwrap_err();
        assert_eq!(
            e.field.as_deref(),
            Some("namespaces.default.renew-interval"),
            "{e}"
        );
        let config = |drift: &str, every: &str| {
            format!(
                "instance:\n  clock-drift: {drift}\nshards:\n  - name: s1\n    \
                 url: mysql://root@db-1:3306/shardlock\n\
                 namespaces:\n  default: {{ ttl: 10s, renew-interval: {every} }}\n"
            )
        };
        assert!(Config::from_yaml_str(&config("0.01", "8s")).is_ok());
        // 10 s less 30 %: leases end locally at about 7 s.
        let e = Config::from_yaml_str(&config("0.3", "8s")).unwrap_err();
        assert_eq!(
            e.field.as_deref(),
            Some("namespaces.default.renew-interval"),
            "{e}"
        );
        assert!(e.to_string().contains("clock-drift"), "{e}");
        assert!(Config::from_yaml_str(&config("0.3", "6s")).is_ok());
    }
}
