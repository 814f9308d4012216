//! Checks of values that parse but make no sense, each naming the field it is about so that
//! the error can be placed in the file.

use std::time::Duration;

use super::{Config, ConfigError};

impl Config {
    /// Checks values that parse but make no sense. The error names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field: String, message: String| ConfigError {
            field: Some(field),
            message,
            ..ConfigError::default()
        };
        if let Some(id) = &self.instance.id {
            if id.is_empty() || id.len() > 100 || id.contains(':') {
                return Err(invalid(
                    "instance.id".into(),
                    "must be 1 to 100 bytes without ':' (it prefixes every owner), or `auto`"
                        .into(),
                ));
            }
        }
        if let Some(fleet) = &self.instance.fleet {
            if fleet.is_empty() || fleet.len() > 100 {
                return Err(invalid(
                    "instance.fleet".into(),
                    "must be 1 to 100 bytes".into(),
                ));
            }
        }
        if let Some(drift) = self.instance.clock_drift {
            if !(0.0..=0.5).contains(&drift) {
                return Err(invalid(
                    "instance.clock-drift".into(),
                    format!("must be a fraction between 0 and 0.5 (0.01 is 1%), got {drift}"),
                ));
            }
        }
        if self.shards.is_empty() {
            return Err(invalid(
                "shards".into(),
                "at least one shard is required".into(),
            ));
        }
        for (i, shard) in self.shards.iter().enumerate() {
            let field = |f: &str| format!("shards[{i}].{f}");
            let name_ok = !shard.name.is_empty()
                && shard.name.len() <= 64
                && shard
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !name_ok {
                return Err(invalid(
                    field("name"),
                    format!(
                        "`{}` is not a valid shard name: use 1-64 of [A-Za-z0-9_-]",
                        shard.name
                    ),
                ));
            }
            if let Some(j) = self.shards[..i].iter().position(|s| s.name == shard.name) {
                return Err(invalid(
                    field("name"),
                    format!("shard name `{}` is already used by shards[{j}]", shard.name),
                ));
            }
            if !shard.url.starts_with("mysql://") {
                return Err(invalid(
                    field("url"),
                    "must look like mysql://user:password@host:port/database".into(),
                ));
            }
            if shard.weight == 0 || shard.weight > 100 {
                return Err(invalid(field("weight"), "must be between 1 and 100".into()));
            }
            if shard.pool.max_size == 0 {
                return Err(invalid(field("pool.max-size"), "must be at least 1".into()));
            }
            if shard.statement_timeout.is_zero() {
                return Err(invalid(
                    field("statement-timeout"),
                    "must be greater than zero".into(),
                ));
            }
        }
        if self.routing.virtual_nodes == 0 || self.routing.virtual_nodes > 10_000 {
            return Err(invalid(
                "routing.virtual-nodes".into(),
                "must be between 1 and 10000".into(),
            ));
        }
        for (name, ns) in &self.namespaces {
            let field = |f: &str| format!("namespaces.{name}.{f}");
            if name.is_empty() || name.len() > 64 {
                return Err(invalid(
                    format!("namespaces.{name}"),
                    "names are 1-64 bytes".into(),
                ));
            }
            check_ttl(ns.ttl).map_err(|m| invalid(field("ttl"), m))?;
            if let Some(every) = ns.renew_interval {
                if every.is_zero() || every >= ns.ttl {
                    return Err(invalid(
                        field("renew-interval"),
                        format!("must be above zero and below the ttl ({:?})", ns.ttl),
                    ));
                }
            }
            if ns.buckets == 0 || ns.buckets > MAX_BUCKETS {
                return Err(invalid(
                    field("buckets"),
                    format!("must be between 1 and {MAX_BUCKETS}"),
                ));
            }
            if ns.handoff_max_count > 1_000_000 {
                return Err(invalid(
                    field("handoff-max-count"),
                    "must be at most 1000000".into(),
                ));
            }
            if ns.handoff_max_time >= ns.ttl {
                return Err(invalid(
                    field("handoff-max-time"),
                    format!("must be below the ttl ({:?})", ns.ttl),
                ));
            }
            if ns.backoff_base.is_zero() || ns.backoff_cap < ns.backoff_base {
                return Err(invalid(
                    field("backoff-base"),
                    "backoff-base must be above zero and at most backoff-cap".into(),
                ));
            }
        }
        let b = &self.breaker;
        let breaker_checks = [
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
        ];
        if let Some((field, _, message)) = breaker_checks.iter().find(|(_, ok, _)| !ok) {
            return Err(invalid((*field).into(), (*message).into()));
        }
        let c = &self.cleaner;
        let cleaner_checks = [
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
        ];
        if let Some((field, _, message)) = cleaner_checks.iter().find(|(_, ok, _)| !ok) {
            return Err(invalid((*field).into(), (*message).into()));
        }
        if let Some(listen) = &self.telemetry.prometheus_listen {
            if listen.parse::<std::net::SocketAddr>().is_err() {
                return Err(invalid(
                    "telemetry.prometheus-listen".into(),
                    format!("`{listen}` is not an address such as 127.0.0.1:9464"),
                ));
            }
        }
        if let Some(endpoint) = &self.telemetry.otlp_endpoint {
            if !endpoint.starts_with("http://") && !endpoint.starts_with("https://") {
                return Err(invalid(
                    "telemetry.otlp-endpoint".into(),
                    format!("`{endpoint}` is not a URL such as http://127.0.0.1:4318"),
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.telemetry.trace_sample_ratio) {
            return Err(invalid(
                "telemetry.trace-sample-ratio".into(),
                "must be between 0 and 1".into(),
            ));
        }
        if !(1..=1000).contains(&self.telemetry.hot_keys) || self.telemetry.hot_key_window.is_zero()
        {
            return Err(invalid(
                "telemetry.hot-keys".into(),
                "hot-keys must be 1-1000 and hot-key-window above zero".into(),
            ));
        }
        Ok(())
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
    use crate::config::{Config, DEFAULT_FLEET, GOOD};

    #[test]
    fn an_empty_fleet_is_refused_and_none_means_default() {
        let c = Config::from_yaml_str(GOOD).unwrap();
        assert_eq!(c.instance.fleet(), DEFAULT_FLEET);
        let e = Config::from_yaml_str(&format!("instance:\n  fleet: ''\n{GOOD}")).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("instance.fleet"), "{e}");
    }
}
