//! The YAML configuration: instance, shards, routing and namespace policies.
//!
//! Every struct denies unknown fields and uses kebab-case names; durations are written like
//! `10s` or `250ms`. `${VAR}` (or `${VAR:-default}`) in the text is replaced from the
//! environment before parsing, so secrets stay out of the file. Every error names the file,
//! the line and column, and the field. `config/reference.yaml` documents every field.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Virtual nodes per unit of shard weight: enough that, over 100,000 keys, the busiest of up
/// to 8 equal shards carries at most 1.1x the mean (pinned by a ring test).
pub const DEFAULT_VIRTUAL_NODES: u32 = 512;
/// Lease length when neither the call nor the namespace says: long enough to ride out a few
/// missed renewals (renewal runs every ttl/3), short enough that a crash frees keys quickly.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);
/// How long `acquire` waits by default before giving up with `Error::Timeout`.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(5);
/// First backoff step while waiting: about one round trip to a loaded shard.
pub const DEFAULT_BACKOFF_BASE: Duration = Duration::from_millis(2);
/// Longest backoff step: bounds how late a waiter of another process notices a released lock
/// (a waiting process polls a busy key at most 50 times a second), and how long a process
/// that released a key for another one lets it poll before its own waiters try again.
pub const DEFAULT_BACKOFF_CAP: Duration = Duration::from_millis(20);
/// Fences reserved per shard grant for in-memory hand-offs: a process alone on a hot key
/// makes this many grants per round trip to the shard.
pub const DEFAULT_HANDOFF_MAX_COUNT: u32 = 128;
/// How long a process may keep handing a key over in memory before it goes back to the shard
/// (where it yields if another process asked for the key). Other processes wait at most about
/// this plus one of their backoff steps, a few round trips on a busy shard.
pub const DEFAULT_HANDOFF_MAX_TIME: Duration = Duration::from_millis(20);
/// Connections per shard pool: a lock statement is short, so a few connections serve many
/// callers; raise it for many concurrent transaction locks.
pub const DEFAULT_POOL_MAX_SIZE: usize = 16;
/// How long a caller may wait for a free pooled connection.
pub const DEFAULT_POOL_WAIT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long opening a connection may take before the shard counts as unreachable.
pub const DEFAULT_POOL_CREATE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long checking a pooled connection (reset or ping) may take before it is discarded.
pub const DEFAULT_POOL_RECYCLE_TIMEOUT: Duration = Duration::from_secs(1);
/// Pooled connections idle longer than this are pinged before reuse.
pub const DEFAULT_POOL_IDLE_CHECK: Duration = Duration::from_secs(30);
/// Upper bound for one lock statement; a lease statement is a primary-key operation.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(2);
/// The namespace used when a call names none.
pub const DEFAULT_NAMESPACE: &str = "default";

/// The whole configuration file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct Config {
    /// This process.
    pub instance: InstanceConfig,
    /// The MySQL shards locks are spread over (at least one).
    pub shards: Vec<ShardConfig>,
    /// Placement of keys on shards.
    pub routing: RoutingConfig,
    /// Lock policies by namespace; `default` always exists.
    pub namespaces: BTreeMap<String, NamespaceConfig>,
    /// When a shard counts as failed, and when it is tried again (one breaker per shard).
    pub breaker: crate::BreakerConfig,
    /// The lease cleaner and the instance registry it asks.
    pub cleaner: CleanerConfig,
    /// Spans, metrics and their export.
    pub telemetry: TelemetryConfig,
}

/// Telemetry: what spans and metrics carry, and where `shardlock::telemetry::init` serves them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct TelemetryConfig {
    /// Serve the metrics for Prometheus at `http://<this address>/metrics` (e.g.
    /// `127.0.0.1:9464`); none when absent.
    pub prometheus_listen: Option<String>,
    /// Export spans and metrics over OTLP/HTTP (JSON) to this collector base URL, e.g.
    /// `http://127.0.0.1:4318` (`/v1/traces` and `/v1/metrics` are appended); none when absent.
    pub otlp_endpoint: Option<String>,
    /// Share of traces sampled for OTLP export (0.0-1.0), honouring a sampled parent.
    pub trace_sample_ratio: f64,
    /// `service.name` of the exported telemetry.
    pub service_name: String,
    /// Put raw keys in spans and hot-key metrics. Off: a stable hash of the key (`#…`) instead,
    /// so key contents (user ids, order numbers) stay out of telemetry.
    pub record_keys: bool,
    /// How many hot keys (most wait time) the `shardlock.hot_key.wait` metric reports.
    pub hot_keys: u32,
    /// The window hot keys are measured over (the report covers one to two windows).
    #[serde(with = "humantime_serde")]
    pub hot_key_window: Duration,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            prometheus_listen: None,
            otlp_endpoint: None,
            trace_sample_ratio: 1.0,
            service_name: "shardlock".into(),
            record_keys: false,
            hot_keys: 10,
            hot_key_window: Duration::from_secs(60),
        }
    }
}

/// The lease cleaner (`LockRouter::run_cleaner`, `shardlock cleaner`) and the instance
/// registry that vouches for holders.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct CleanerConfig {
    /// Time between cleaning passes.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// A row is removed only once its lease ended (released or expired) longer ago than this.
    #[serde(with = "humantime_serde")]
    pub grace: Duration,
    /// Rows examined and deleted per statement.
    pub batch_size: u32,
    /// Pause between batches, so acquires on the same shard keep their latency.
    #[serde(with = "humantime_serde")]
    pub batch_pause: Duration,
    /// Who says an instance is dead.
    pub registry: RegistryKind,
    /// How often an instance heartbeats (`heartbeat` registry).
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// An instance silent this long is dead (`heartbeat` registry).
    #[serde(with = "humantime_serde")]
    pub heartbeat_timeout: Duration,
    /// Instances that are alive whatever happens (`static` registry); all others are dead.
    pub live_instances: Vec<String>,
}

impl Default for CleanerConfig {
    fn default() -> Self {
        Self {
            // Garbage is harmless for a while; a pass a minute keeps tables small.
            interval: Duration::from_secs(60),
            // Longer than any renewal hiccup and any clock step between shard and holder.
            grace: Duration::from_secs(60),
            // A batch deletes in a few milliseconds on a loaded shard.
            batch_size: 1000,
            batch_pause: Duration::from_millis(10),
            registry: RegistryKind::Heartbeat,
            heartbeat_interval: Duration::from_secs(5),
            // Six missed heartbeats.
            heartbeat_timeout: Duration::from_secs(30),
            live_instances: Vec::new(),
        }
    }
}

/// The instance registry the cleaner asks before deleting a lease that was never released.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RegistryKind {
    /// Every instance registers in `shardlock_instance` on every shard and heartbeats there;
    /// dead = deregistered, or no heartbeat for `heartbeat-timeout`.
    #[default]
    Heartbeat,
    /// For deployments with a registry of their own: the instances in `live-instances` are
    /// alive, all others dead (empty: lease expiry plus `grace` alone decides). A custom
    /// registry can be plugged in with `LockRouter::set_registry`.
    Static,
}

/// Who this process is.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct InstanceConfig {
    /// The instance id written into every owner (`<id>:<start nonce>:<grant seq>`). Absent or `auto`:
    /// derived from host name, process id and a random suffix, unique per process start.
    pub id: Option<String>,
    /// How much faster than this process's clock a shard's clock may run, as a fraction
    /// (`0.01`: 1%). A lease's local end comes that much before its ttl (and 1 ms more for the
    /// shard's millisecond time), so its holder learns it lost the lock before anyone else can
    /// get it. Default [`DEFAULT_CLOCK_DRIFT`].
    pub clock_drift: Option<f64>,
    /// The processes that share keys with this one (default `default`): a router that starts
    /// while another live process of its fleet runs another topology, or is moving keys after a
    /// reload, grants nothing until they agree (it cannot know where they place a moved key).
    /// Services that share lock shards but never each other's keys may run different
    /// topologies: give each its own fleet.
    pub fleet: Option<String>,
}

/// The fleet of a config without `instance.fleet`.
pub const DEFAULT_FLEET: &str = "default";

/// Clocks of healthy machines drift apart by parts per million, NTP slews by at most 500 ppm;
/// 1% leaves room for a VM whose clock misbehaves, and costs a 10 s lease 100 ms of notice.
pub const DEFAULT_CLOCK_DRIFT: f64 = 0.01;

impl InstanceConfig {
    /// [`InstanceConfig::fleet`], or [`DEFAULT_FLEET`].
    pub fn fleet(&self) -> &str {
        self.fleet.as_deref().unwrap_or(DEFAULT_FLEET)
    }

    /// [`InstanceConfig::clock_drift`] in parts per million.
    pub fn clock_drift_ppm(&self) -> u32 {
        (self.clock_drift.unwrap_or(DEFAULT_CLOCK_DRIFT) * 1e6).round() as u32
    }
}

/// One MySQL shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct ShardConfig {
    /// Unique name used in errors, metrics and placement. Renaming a shard moves its keys.
    pub name: String,
    /// `mysql://user:password@host:port/database`; the database must exist.
    pub url: String,
    /// Relative share of keys (1 = one share).
    pub weight: u32,
    /// Upper bound for one lock statement on this shard.
    #[serde(with = "humantime_serde")]
    pub statement_timeout: Duration,
    /// The connection pool.
    pub pool: PoolConfig,
}

impl Default for ShardConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            url: String::new(),
            weight: 1,
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            pool: PoolConfig::default(),
        }
    }
}

/// A shard's connection pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct PoolConfig {
    /// Most connections open at once.
    pub max_size: usize,
    /// Longest wait for a free connection.
    #[serde(with = "humantime_serde")]
    pub wait_timeout: Duration,
    /// Longest time to open a connection.
    #[serde(with = "humantime_serde")]
    pub create_timeout: Duration,
    /// Longest time to check a pooled connection before reuse.
    #[serde(with = "humantime_serde")]
    pub recycle_timeout: Duration,
    /// Connections idle longer than this are pinged before reuse.
    #[serde(with = "humantime_serde")]
    pub idle_check: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            max_size: DEFAULT_POOL_MAX_SIZE,
            wait_timeout: DEFAULT_POOL_WAIT_TIMEOUT,
            create_timeout: DEFAULT_POOL_CREATE_TIMEOUT,
            recycle_timeout: DEFAULT_POOL_RECYCLE_TIMEOUT,
            idle_check: DEFAULT_POOL_IDLE_CHECK,
        }
    }
}

/// Placement of keys on shards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct RoutingConfig {
    /// Ring points per unit of shard weight.
    pub virtual_nodes: u32,
    /// After a reload moves keys, how long an acquire of a moved key also takes it on the
    /// shard(s) it lived on before. Every process must pick up a topology change within this
    /// window of the others. Default: twice the longest namespace ttl, plus 10 s.
    #[serde(with = "humantime_serde")]
    pub move_window: Option<Duration>,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            virtual_nodes: DEFAULT_VIRTUAL_NODES,
            move_window: None,
        }
    }
}

impl Config {
    /// The move window in force (see [`RoutingConfig::move_window`]).
    pub fn move_window(&self) -> Duration {
        self.routing.move_window.unwrap_or_else(|| {
            let longest = self
                .namespaces
                .values()
                .map(|n| n.ttl)
                .max()
                .unwrap_or(DEFAULT_TTL);
            longest * 2 + Duration::from_secs(10)
        })
    }
}

/// The lock policy of a namespace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct NamespaceConfig {
    /// Lease length.
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// How often held leases are renewed; default ttl/3.
    #[serde(with = "humantime_serde")]
    pub renew_interval: Option<Duration>,
    /// How long `acquire` waits by default.
    #[serde(with = "humantime_serde")]
    pub wait: Duration,
    /// First backoff step while waiting.
    #[serde(with = "humantime_serde")]
    pub backoff_base: Duration,
    /// Longest backoff step while waiting.
    #[serde(with = "humantime_serde")]
    pub backoff_cap: Duration,
    /// In-memory hand-offs per shard grant (0: every grant goes through the shard).
    pub handoff_max_count: u32,
    /// Sub-locks each key of this namespace is split into for `acquire_bucket` (1: none).
    pub buckets: u32,
    /// Whether `acquire_bucket` tries the other buckets once when its own is busy.
    pub bucket_spill: bool,
    /// How long a chain of in-memory hand-offs may run before going back to the shard.
    #[serde(with = "humantime_serde")]
    pub handoff_max_time: Duration,
    /// What an acquire does while the key's shard breaker is open.
    pub on_shard_failure: FailurePolicy,
}

/// What an acquire does while the breaker of the key's shard is open (the shard failed).
///
/// Keys are never moved to another shard because their own failed: that would let two
/// processes hold the same key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailurePolicy {
    /// Return `Error::Unavailable { shard }` at once: no caller waits on a dead shard, and
    /// mutual exclusion across processes is never weakened. The default.
    #[default]
    #[serde(alias = "fail_fast")]
    FailFast,
    /// Grant an in-process lock (`LockMode::LocalFallback`): mutual exclusion holds inside this
    /// process only, until the shard is back and the key is re-acquired there.
    Local,
}

impl Default for NamespaceConfig {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            renew_interval: None,
            wait: DEFAULT_WAIT,
            backoff_base: DEFAULT_BACKOFF_BASE,
            backoff_cap: DEFAULT_BACKOFF_CAP,
            handoff_max_count: DEFAULT_HANDOFF_MAX_COUNT,
            buckets: 1,
            bucket_spill: false,
            handoff_max_time: DEFAULT_HANDOFF_MAX_TIME,
            on_shard_failure: FailurePolicy::FailFast,
        }
    }
}

impl NamespaceConfig {
    /// The renewal period for a lease of `ttl` in this namespace.
    pub fn renew_interval_for(&self, ttl: Duration) -> Duration {
        match self.renew_interval {
            Some(every) if ttl == self.ttl => every,
            _ => ttl / 3,
        }
    }
}

impl Config {
    /// Parses and validates YAML text (after `${VAR}` substitution).
    pub fn from_yaml_str(text: &str) -> Result<Self, ConfigError> {
        Self::parse(text, None)
    }

    /// Reads, parses and validates a YAML file.
    pub fn from_yaml_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        Self::parse(&read_file(path)?, Some(path))
    }

    /// Parses and validates YAML text that was read from `path` (errors name the file).
    pub fn from_yaml_text(text: &str, path: &Path) -> Result<Self, ConfigError> {
        Self::parse(text, Some(path))
    }

    fn parse(raw: &str, path: Option<&Path>) -> Result<Self, ConfigError> {
        let with_path = |mut e: ConfigError| {
            e.path = path.map(Path::to_owned);
            e
        };
        let text = substitute_env(raw).map_err(with_path)?;
        let de = serde_yaml::Deserializer::from_str(&text);
        let mut config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            let inner = e.into_inner();
            let location = inner.location();
            let message = inner.to_string();
            // serde_yaml appends " at line L column C"; we report those separately.
            let message = match message.find(" at line ") {
                Some(at) => message[..at].to_owned(),
                None => message,
            };
            with_path(ConfigError {
                line: location.as_ref().map(|l| l.line()),
                column: location.as_ref().map(|l| l.column()),
                field: (field != ".").then_some(field),
                message,
                path: None,
            })
        })?;
        config
            .namespaces
            .entry(DEFAULT_NAMESPACE.to_owned())
            .or_default();
        config.validate().map_err(|mut e| {
            if let Some(field) = &e.field {
                if let Some((line, column)) = locate(&text, field) {
                    e.line = Some(line);
                    e.column = Some(column);
                }
            }
            with_path(e)
        })?;
        Ok(config)
    }

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

    /// The policy of `namespace`, if configured.
    pub fn namespace(&self, namespace: &str) -> Option<&NamespaceConfig> {
        self.namespaces.get(namespace)
    }
}

/// Reads a config file; the error names it.
pub fn read_file(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|e| ConfigError {
        path: Some(path.to_owned()),
        message: format!("cannot read the file: {e}"),
        ..ConfigError::default()
    })
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

/// A configuration error: which file, where in it, which field, and what is wrong.
#[derive(Debug, Clone, Default, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// The file, when the config came from one.
    pub path: Option<PathBuf>,
    /// 1-based line.
    pub line: Option<usize>,
    /// 1-based column.
    pub column: Option<usize>,
    /// The field, as a path like `shards[1].url`.
    pub field: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.path {
            Some(p) => write!(f, "{}", p.display())?,
            None => f.write_str("<config>")?,
        }
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(col) = self.column {
                write!(f, ":{col}")?;
            }
        }
        f.write_str(": ")?;
        if let Some(field) = &self.field {
            write!(f, "field `{field}`: ")?;
        }
        f.write_str(&self.message)
    }
}

impl ConfigError {
    /// Adds the file and, for an error that names a field, the field's line and column in
    /// `text` (the YAML the config was parsed from).
    pub fn located(mut self, text: &str, path: Option<&Path>) -> Self {
        if self.line.is_none() {
            if let Some((line, column)) = self.field.as_deref().and_then(|f| locate(text, f)) {
                self.line = Some(line);
                self.column = Some(column);
            }
        }
        if self.path.is_none() {
            self.path = path.map(Path::to_owned);
        }
        self
    }

    /// An error about `field` (a path like `shards[0].url`) with no location yet.
    pub fn field(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: Some(field.into()),
            message: message.into(),
            ..Self::default()
        }
    }
}

/// Replaces `${VAR}` and `${VAR:-default}` from the environment; `$$` stands for `$`.
/// Whole-line comments are left alone.
fn substitute_env(text: &str) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(text.len());
    for (line_no, line) in text.split_inclusive('\n').enumerate() {
        if line.trim_start().starts_with('#') {
            out.push_str(line);
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find('$') {
            out.push_str(&rest[..at]);
            let tail = &rest[at..];
            if let Some(after) = tail.strip_prefix("$$") {
                out.push('$');
                rest = after;
            } else if let Some(body) = tail.strip_prefix("${") {
                let column = line.len() - tail.len() + 1;
                let err = |message: String| ConfigError {
                    line: Some(line_no + 1),
                    column: Some(column),
                    message,
                    ..ConfigError::default()
                };
                let end = body
                    .find('}')
                    .ok_or_else(|| err("`${` without a closing `}`".to_owned()))?;
                let (name, default) = match body[..end].split_once(":-") {
                    Some((n, d)) => (n, Some(d)),
                    None => (&body[..end], None),
                };
                if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                {
                    return Err(err(format!(
                        "`${{{}}}` is not a valid variable reference",
                        &body[..end]
                    )));
                }
                match (std::env::var(name), default) {
                    (Ok(value), _) => out.push_str(&value),
                    (Err(_), Some(d)) => out.push_str(d),
                    (Err(_), None) => {
                        return Err(err(format!(
                            "environment variable `{name}` is not set (write `${{{name}:-default}}` to allow a default)"
                        )))
                    }
                }
                rest = &body[end + 1..];
            } else {
                out.push('$');
                rest = &tail[1..];
            }
        }
        out.push_str(rest);
    }
    Ok(out)
}

/// One significant line of block YAML: its 1-based number, the indent of its content (list
/// dashes count as indentation) and whether it starts a list item.
struct YamlLine<'a> {
    number: usize,
    indent: usize,
    item: bool,
    content: &'a str,
}

fn yaml_lines(text: &str) -> Vec<YamlLine<'_>> {
    text.lines()
        .enumerate()
        .filter_map(|(i, raw)| {
            let trimmed = raw.trim_start();
            if trimmed.is_empty() || trimmed.starts_with('#') || trimmed == "---" {
                return None;
            }
            let mut indent = raw.len() - trimmed.len();
            let mut content = trimmed;
            let mut item = false;
            while let Some(rest) = content.strip_prefix("- ") {
                let rest_trim = rest.trim_start();
                indent += content.len() - rest_trim.len();
                content = rest_trim;
                item = true;
            }
            Some(YamlLine {
                number: i + 1,
                indent,
                item,
                content,
            })
        })
        .collect()
}

/// Finds the line and column of `field` (`a.b[2].c`) in block-style YAML, for validation
/// errors that serde cannot place. Returns `None` where the text is not plain block style.
fn locate(text: &str, field: &str) -> Option<(usize, usize)> {
    let lines = yaml_lines(text);
    let (mut lo, mut hi) = (0usize, lines.len());
    let mut found = None;
    let mut parent_indent: Option<usize> = None;
    for seg in field.split('.') {
        let (key, index) = match seg.find('[') {
            Some(b) => (&seg[..b], seg[b + 1..seg.len() - 1].parse::<usize>().ok()),
            None => (seg, None),
        };
        let depth = lines[lo..hi]
            .iter()
            .filter(|l| parent_indent.is_none_or(|p| l.indent > p))
            .map(|l| l.indent)
            .min()?;
        let at = (lo..hi).find(|&i| {
            let l = &lines[i];
            l.indent == depth && (l.content.starts_with(&format!("{key}:")) || l.content == key)
        })?;
        found = Some((lines[at].number, lines[at].indent + 1));
        lo = at + 1;
        hi = (lo..hi).find(|&i| lines[i].indent <= depth).unwrap_or(hi);
        parent_indent = Some(depth);
        if let Some(index) = index {
            let items: Vec<usize> = (lo..hi).filter(|&i| lines[i].item).collect();
            let item_indent = items.iter().map(|&i| lines[i].indent).min()?;
            let items: Vec<usize> = items
                .into_iter()
                .filter(|&i| lines[i].indent == item_indent)
                .collect();
            let start = *items.get(index)?;
            found = Some((lines[start].number, lines[start].indent + 1));
            let end = items.get(index + 1).copied().unwrap_or(hi);
            lo = start;
            hi = end;
            parent_indent = Some(item_indent - 1);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "\
shards:
  - name: s1
    url: mysql://root@127.0.0.1:33061/shardlock
  - name: s2
    url: mysql://root@127.0.0.1:33062/shardlock
    weight: 2
namespaces:
  stock:
    ttl: 5s
";

    #[test]
    fn parses_and_fills_defaults() {
        let c = Config::from_yaml_str(GOOD).unwrap();
        assert_eq!(c.shards.len(), 2);
        assert_eq!(c.shards[1].weight, 2);
        assert_eq!(c.namespaces["stock"].ttl, Duration::from_secs(5));
        assert_eq!(c.namespaces["default"].ttl, DEFAULT_TTL);
        assert_eq!(c.routing.virtual_nodes, DEFAULT_VIRTUAL_NODES);
    }

    #[test]
    fn unknown_field_names_line_column_and_field() {
        let text = GOOD.replace("    weight: 2\n", "    wieght: 2\n");
        let e = Config::from_yaml_str(&text).unwrap_err();
        assert_eq!(e.line, Some(6), "{e}");
        assert!(e.message.contains("unknown field `wieght`"), "{e}");
        assert_eq!(e.field.as_deref(), Some("shards[1].wieght"), "{e}");
    }

    #[test]
    fn an_empty_fleet_is_refused_and_none_means_default() {
        let c = Config::from_yaml_str(GOOD).unwrap();
        assert_eq!(c.instance.fleet(), DEFAULT_FLEET);
        let e = Config::from_yaml_str(&format!("instance:\n  fleet: ''\n{GOOD}")).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("instance.fleet"), "{e}");
    }

    #[test]
    fn broken_yaml_reports_line_and_column() {
        let e = Config::from_yaml_str("shards:\n  - name: s1\n    url: [oops\n").unwrap_err();
        assert!(e.line.is_some() && e.column.is_some(), "{e}");
    }

    #[test]
    fn validation_errors_are_located() {
        let text = GOOD.replace("ttl: 5s", "ttl: 0s");
        let e = Config::from_yaml_str(&text).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("namespaces.stock.ttl"));
        assert_eq!((e.line, e.column), (Some(9), Some(5)), "{e}");
        let text = GOOD.replace("name: s2", "name: s1");
        let e = Config::from_yaml_str(&text).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("shards[1].name"));
        assert_eq!(e.line, Some(4), "{e}");
        assert!(e.to_string().starts_with("<config>:4:"), "{e}");
    }

    #[test]
    fn substitutes_environment_variables() {
        std::env::set_var("SHARDLOCK_TEST_PASSWORD", "s3cret");
        let text = GOOD
            .replace("root@", "root:${SHARDLOCK_TEST_PASSWORD}@")
            .replace("33062", "${SHARDLOCK_TEST_NO_SUCH_PORT:-33099}");
        let c = Config::from_yaml_str(&text).unwrap();
        assert!(c.shards[0].url.contains("root:s3cret@"));
        assert!(c.shards[1].url.contains(":33099/"));
        let e = Config::from_yaml_str(&GOOD.replace("33061", "${SHARDLOCK_TEST_UNSET_VAR}"))
            .unwrap_err();
        assert_eq!(e.line, Some(3));
        assert!(e.message.contains("SHARDLOCK_TEST_UNSET_VAR"), "{e}");
    }

    #[test]
    fn failure_policies_parse_in_both_spellings() {
        for (written, policy) in [
            ("fail-fast", FailurePolicy::FailFast),
            ("fail_fast", FailurePolicy::FailFast),
            ("local", FailurePolicy::Local),
        ] {
            let text = GOOD.replace(
                "ttl: 5s",
                &format!("ttl: 5s\n    on-shard-failure: {written}"),
            );
            let c = Config::from_yaml_str(&text).unwrap();
            assert_eq!(c.namespace("stock").unwrap().on_shard_failure, policy);
        }
        assert_eq!(
            Config::from_yaml_str(GOOD)
                .unwrap()
                .namespace("stock")
                .unwrap()
                .on_shard_failure,
            FailurePolicy::FailFast,
            "fail-fast unless asked"
        );
    }
}
