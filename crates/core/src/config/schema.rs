//! The shape of the file: one struct per section, its defaults, and the derived values
//! (fleet, move window, renewal period) that other layers read instead of the raw fields.
//!
//! Defaults live here as named consts, each with its reason, so that `Default` impls, the
//! reference YAML and the docs quote one number.

use std::collections::BTreeMap;
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
/// How long a caller may wait for a free pooled connection: as long as one statement may take.
/// Running out of it fails the call as a timeout, which the shard's breaker counts as a failure
/// of the shard, so a pool too small for its load shows up as breaker trips.
pub const DEFAULT_POOL_WAIT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long opening a connection may take before the shard counts as unreachable.
pub const DEFAULT_POOL_CREATE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long checking a pooled connection (reset or ping) may take before it is discarded: both
/// are one round trip, so a second means the connection or the shard is in trouble.
pub const DEFAULT_POOL_RECYCLE_TIMEOUT: Duration = Duration::from_secs(1);
/// Pooled connections idle longer than this are pinged before reuse. Servers (`wait_timeout`)
/// and firewalls drop idle connections; the ping finds a dead one before a lock statement
/// fails on it, and connections in steady use never pay for it.
pub const DEFAULT_POOL_IDLE_CHECK: Duration = Duration::from_secs(30);
/// Pooled connections older than this are closed instead of reused. After a managed MySQL's
/// failover flips its DNS name to the new primary, connections opened before stay with the
/// demoted server; a read-only error closes them all at once, and this bounds how long any
/// other staleness (a load balancer's target change, say) can last.
pub const DEFAULT_POOL_MAX_LIFETIME: Duration = Duration::from_secs(30 * 60);
/// Pooled connections idle longer than this are closed instead of reused, so that a quiet
/// process holds no connection the server or a firewall has long forgotten.
pub const DEFAULT_POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(10 * 60);
/// Upper bound for one lock statement; a lease statement is a primary-key operation.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(2);
/// The namespace used when a call names none.
pub const DEFAULT_NAMESPACE: &str = "default";

/// The whole configuration file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
#[non_exhaustive]
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
#[non_exhaustive]
pub struct TelemetryConfig {
    /// Serve the metrics for Prometheus at `http://<this address>/metrics` (e.g.
    /// `127.0.0.1:9464`); none when absent.
    pub prometheus_listen: Option<String>,
    /// Export spans and metrics over OTLP/HTTP (JSON) to this collector base URL, e.g.
    /// `http://127.0.0.1:4318` (`/v1/traces` and `/v1/metrics` are appended); none when absent.
    pub otlp_endpoint: Option<String>,
    /// For an `https://` OTLP endpoint: the CA (PEM) that signed the collector's certificate,
    /// trusted alone; the system's roots when absent. Needs the `otlp-https` feature.
    pub otlp_ca_file: Option<std::path::PathBuf>,
    /// Share of traces sampled for OTLP export (0.0-1.0), honouring a sampled parent.
    pub trace_sample_ratio: f64,
    /// `service.name` of the exported telemetry.
    pub service_name: String,
    /// Put raw keys in spans and hot-key metrics. Off: a stable hash of the key (`#…`) instead,
    /// so key contents (user ids, order numbers) stay out of telemetry. The hash has no secret
    /// (see [`crate::LockKey::label_hash`]): keys that can be guessed can be recovered from it.
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
            otlp_ca_file: None,
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
#[non_exhaustive]
pub struct CleanerConfig {
    /// Time between cleaning passes.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// A row is removed only once its lease ended (released or expired) longer ago than this.
    #[serde(with = "humantime_serde")]
    pub grace: Duration,
    /// Rows examined and deleted per statement.
    pub batch_size: u32,
    /// Pause after each batch with rows to delete, so acquires on the same shard keep their
    /// latency.
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
    /// The cleaner deletes the registry rows of instances silent this long (dead, or shut
    /// down, that long ago): they decide nothing any more. At least an hour and at least
    /// `heartbeat-timeout` (other fleets on the same shards may use a longer one).
    #[serde(with = "humantime_serde")]
    pub instance_retention: Duration,
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
            // A day: long enough to read who died overnight in `shardlock status`.
            instance_retention: Duration::from_secs(24 * 60 * 60),
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
#[non_exhaustive]
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

/// A password: kept as given, shown nowhere (`Debug` prints `***`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// A secret holding `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that must send it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// Default `shards[].node-clock-skew`: NTP keeps servers within milliseconds of each other.
pub const DEFAULT_NODE_CLOCK_SKEW: Duration = Duration::from_millis(250);

/// One MySQL shard.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
#[non_exhaustive]
pub struct ShardConfig {
    /// Unique name used in errors, metrics and placement. Renaming a shard moves its keys.
    pub name: String,
    /// `mysql://user:password@host:port/database`; the database must exist. The credentials
    /// may instead (not as well) be given by `user` and `password` or `password-file`, which
    /// keeps the password out of the URL and of `${VAR}` pasting inside it.
    pub url: String,
    /// The nodes (`host:port`, port 3306 when left out) of a Galera cluster serving this
    /// shard, in preference order; the URL gives everything but its host and port. Every
    /// process writes through the first node that is in the cluster's primary component, so
    /// concurrent grants of a key meet on one node, and moves to the next one when it fails.
    /// Empty (the default): the shard is the one server of the URL.
    pub nodes: Vec<String>,
    /// With `nodes`: how far a node's clock may be from this process's (measured on every new
    /// connection; a node further off is not used). Lease expiry is computed by the node that
    /// answers, so leases on the shard end locally twice this earlier.
    #[serde(with = "humantime_serde")]
    pub node_clock_skew: Duration,
    /// The user to connect as, instead of the URL's.
    pub user: Option<String>,
    /// The password, instead of the URL's.
    pub password: Option<Secret>,
    /// A file holding the password (a mounted secret; one trailing newline is ignored), read
    /// at start and again for every new connection (a rotated secret takes effect without a
    /// reload).
    pub password_file: Option<std::path::PathBuf>,
    /// Relative share of keys (1 = one share).
    pub weight: u32,
    /// Upper bound for one lock statement on this shard.
    #[serde(with = "humantime_serde")]
    pub statement_timeout: Duration,
    /// The connection pool.
    pub pool: PoolConfig,
    /// TLS to the shard.
    pub tls: TlsConfig,
}

/// TLS to a shard, in MySQL's `--ssl-mode` terms.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
#[non_exhaustive]
pub struct TlsConfig {
    /// How much TLS to ask for (default: `disabled`).
    pub mode: TlsMode,
    /// The CA (PEM) that signed the server's certificate; required by `verify-ca` and
    /// `verify-identity`, which trust it alone.
    pub ca_file: Option<std::path::PathBuf>,
    /// A client certificate chain (PEM), for a user that requires one (`REQUIRE X509`).
    pub cert_file: Option<std::path::PathBuf>,
    /// The client certificate's private key (PEM).
    pub key_file: Option<std::path::PathBuf>,
    /// `verify-identity`: the name the server's certificate is issued for, when the URL's host
    /// is not it (an IP address, a proxy, a tunnel).
    pub server_name: Option<String>,
}

/// MySQL's TLS modes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TlsMode {
    /// Plaintext.
    #[default]
    Disabled,
    /// TLS when the server offers it, plaintext otherwise; the certificate is not checked.
    Preferred,
    /// TLS or no connection; the certificate is not checked.
    Required,
    /// TLS with a certificate signed by `ca-file`; the host name is not checked.
    VerifyCa,
    /// TLS with a certificate signed by `ca-file` and issued for the host of the URL.
    VerifyIdentity,
}

impl std::fmt::Debug for ShardConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardConfig")
            .field("name", &self.name)
            .field("url", &redact_url(&self.url))
            .field("nodes", &self.nodes)
            .field("node_clock_skew", &self.node_clock_skew)
            .field("user", &self.user)
            .field("password", &self.password)
            .field("password_file", &self.password_file)
            .field("weight", &self.weight)
            .field("statement_timeout", &self.statement_timeout)
            .field("pool", &self.pool)
            .field("tls", &self.tls)
            .finish()
    }
}

/// `url` with the password of its `user:password@` part replaced by `***`.
pub fn redact_url(url: &str) -> String {
    let Some(rest) = url.strip_prefix("mysql://") else {
        return url.to_owned();
    };
    // Hiding too much rather than too little: a password holding `/` and `?` leaves no `@` that
    // surely ends it, and then the last `@` of all does (for display only: `url_has_password`
    // decides whether it holds one).
    match credentials_end(rest).or_else(|| rest.rfind('@')) {
        Some(at) => match rest[..at].split_once(':') {
            Some((user, _)) => format!("mysql://{user}:***{}", &rest[at..]),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// The user a shard's `url` names, if it has credentials (`mysql://user:password@…`).
pub(crate) fn url_user(url: &str) -> Option<&str> {
    let rest = url.strip_prefix("mysql://")?;
    let at = credentials_end(rest)?;
    Some(rest[..at].split(':').next().unwrap_or_default())
}

/// Whether a shard's `url` holds a password (`mysql://user:password@…`; an empty one, as a
/// variable set to nothing leaves, is none).
pub(crate) fn url_has_password(url: &str) -> bool {
    url.strip_prefix("mysql://")
        .and_then(|rest| {
            let (_, password) = rest[..credentials_end(rest)?].split_once(':')?;
            Some(!password.is_empty())
        })
        .unwrap_or(false)
}

/// Where the query string (`?name=...`) of a URL's text after `mysql://` starts.
fn query_start(rest: &str) -> Option<usize> {
    (rest.match_indices('?').map(|(i, _)| i)).find(|&i| {
        let name = rest[i + 1..].split('=').next().unwrap_or_default();
        rest[i + 1..].contains('=')
            && !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    })
}

/// The `@` that ends the credentials of a URL's text after `mysql://`, if it has any: the last
/// `@` before the query string (`?name=`; a socket path there may hold an `@`). A careless
/// password may hold `/`, `#`, `?` or `@` unencoded, and is hidden all the same. A password
/// that looks like a query's start (`p?a=b`) leaves no `@` before it: then the last `@` of all
/// ends them, which may hide more than the password, unless a `/` comes before that `@` (a
/// path, or a socket path in a real query, as in `mysql://db/x?socket=/run/a@b.sock`).
fn credentials_end(rest: &str) -> Option<usize> {
    let query = query_start(rest).unwrap_or(rest.len());
    rest[..query].rfind('@').or_else(|| {
        let at = rest.rfind('@')?;
        (!rest[..at].contains('/')).then_some(at)
    })
}

/// What the driver would read differently from what a shard's `url` (starting `mysql://`)
/// says, as far as its text tells, without its password in the answer: a user or password
/// holding `/`, `?` or `#` unencoded (the driver's URL parser ends the address there, so it
/// would reach a host named after part of the password and print the rest in its error), an
/// `@` after the credentials in what reads as the query (a password's `@` and `?x=` that would
/// make part of it the host), or a port that is no port.
pub(crate) fn url_problem(url: &str) -> Option<String> {
    let rest = url.strip_prefix("mysql://")?;
    let after = match credentials_end(rest) {
        Some(at) if rest[..at].contains(['/', '?', '#']) => {
            return Some(
                "its user or password holds `/`, `?` or `#` unencoded, which ends a URL's \
                 address: percent-encode them (`%2F`, `%3F`, `%23`), or give the password in \
                 `password` or `password-file`"
                    .into(),
            )
        }
        Some(at) => &rest[at + 1..],
        None => rest,
    };
    let query = query_start(after).unwrap_or(after.len());
    let parameters = after.get(query + 1..).unwrap_or_default();
    if parameters
        .split('&')
        .any(|pair| !pair.starts_with("socket=") && pair.contains('@'))
    {
        return Some(
            "it holds an `@` after its credentials, in what reads as its query: an `@`, `?` or \
             `#` in the password must be percent-encoded (`%40`, `%3F`, `%23`), or give the \
             password in `password` or `password-file`"
                .into(),
        );
    }
    let server = after[..query].split('/').next().unwrap_or_default();
    match server.rsplit_once(':') {
        Some((_, port))
            if !server.ends_with(']')
                && !port.is_empty()
                && port.parse::<u16>().map_or(true, |p| p == 0) =>
        {
            // The port's text is not shown: where the URL is misread it may be a password's.
            Some("its port is not a number from 1 to 65535".into())
        }
        _ => None,
    }
}

/// Which database a shard's `url` (and `nodes`, for a Galera shard) reach, as far as their
/// text tells: the server addresses (`host:port`, the host in lower case, 3306 if no port is
/// given; or the `socket` path), and the database's name. Two shards whose databases have one
/// name and share an address reach the same table (another name for one host is not told).
pub fn database_reached(url: &str, nodes: &[String]) -> (Vec<String>, String) {
    let rest = url.strip_prefix("mysql://").unwrap_or(url);
    let rest = match credentials_end(rest) {
        Some(at) => &rest[at + 1..],
        None => rest,
    };
    let (place, query) = match query_start(rest) {
        Some(q) => (&rest[..q], &rest[q + 1..]),
        None => (rest, ""),
    };
    let (server, database) = place.split_once('/').unwrap_or((place, ""));
    let address = |server: &str| {
        // An empty port (`db:/x`) is the default one.
        let server = server.trim_end_matches(':').to_ascii_lowercase();
        match server.rsplit_once(':') {
            Some((_, port)) if !server.ends_with(']') && port.parse::<u16>().is_ok() => server,
            _ => format!("{server}:3306"),
        }
    };
    let socket = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("socket="))
        .map(|path| format!("socket {path}"));
    let addresses = match (socket, nodes.is_empty()) {
        (Some(socket), _) => vec![socket],
        (None, true) => vec![address(server)],
        (None, false) => nodes.iter().map(|n| address(n)).collect(),
    };
    (addresses, database.trim_end_matches('/').to_owned())
}

impl Default for ShardConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            url: String::new(),
            nodes: Vec::new(),
            node_clock_skew: DEFAULT_NODE_CLOCK_SKEW,
            user: None,
            password: None,
            password_file: None,
            weight: 1,
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            pool: PoolConfig::default(),
            tls: TlsConfig::default(),
        }
    }
}

/// A shard's connection pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
#[non_exhaustive]
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
    /// Connections older than this are closed instead of reused.
    #[serde(with = "humantime_serde")]
    pub max_lifetime: Duration,
    /// Connections idle longer than this are closed instead of reused.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// How many batches of acquires (and, apart, of releases) may be in flight to the shard
    /// at once. Requests that arrive while that many are out wait and go together in the
    /// next batch; fewer in flight means bigger batches (fewer statements, more waiting per
    /// lock), more means smaller ones. While 8 or more requests of a kind wait, more go out:
    /// up to twice as many, the extra ones of both kinds taking at most half of the
    /// connections that `2 × batches-in-flight` leaves of `max-size` (none on a pool that small);
    /// they stop once fewer than 8 wait. Default: an eighth of `max-size`, at least 1.
    pub batches_in_flight: Option<usize>,
}

impl PoolConfig {
    /// The batches in flight in force (see [`PoolConfig::batches_in_flight`]).
    pub fn batches_in_flight(&self) -> usize {
        self.batches_in_flight.unwrap_or(self.max_size / 8).max(1)
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            max_size: DEFAULT_POOL_MAX_SIZE,
            wait_timeout: DEFAULT_POOL_WAIT_TIMEOUT,
            create_timeout: DEFAULT_POOL_CREATE_TIMEOUT,
            recycle_timeout: DEFAULT_POOL_RECYCLE_TIMEOUT,
            idle_check: DEFAULT_POOL_IDLE_CHECK,
            max_lifetime: DEFAULT_POOL_MAX_LIFETIME,
            idle_timeout: DEFAULT_POOL_IDLE_TIMEOUT,
            batches_in_flight: None,
        }
    }
}

/// Placement of keys on shards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
#[non_exhaustive]
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

    /// How far apart the clocks of two nodes of one Galera shard (listed with `nodes`) may
    /// be: twice the largest `node-clock-skew` (each node is used only within it of this
    /// process's clock); zero without such a shard. A heartbeat written through one node and
    /// read through another looks this much older than it is.
    pub fn node_clock_spread(&self) -> Duration {
        (self.shards.iter())
            .filter(|s| !s.nodes.is_empty())
            .map(|s| s.node_clock_skew * 2)
            .max()
            .unwrap_or_default()
    }

    /// The policy of `namespace`, if configured.
    pub fn namespace(&self, namespace: &str) -> Option<&NamespaceConfig> {
        self.namespaces.get(namespace)
    }
}

/// The lock policy of a namespace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
#[non_exhaustive]
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
    /// Bytes put before every key locked in this namespace (`key-prefix: "billing/"` makes
    /// `order:1` the lock `billing/order:1`), so that teams sharing shards cannot take each
    /// other's locks by accident. Unset: keys are locks as given. Cannot change in a reload.
    pub key_prefix: Option<String>,
}

/// What an acquire does while the breaker of the key's shard is open (the shard failed).
///
/// Keys are never moved to another shard because their own failed: that would let two
/// processes hold the same key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
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
            key_prefix: None,
        }
    }
}

impl NamespaceConfig {
    /// The renewal period for a lease of `ttl` in this namespace.
    ///
    /// A configured `renew-interval` applies only to leases of the namespace's own ttl: it
    /// was validated against that ttl alone, and a per-call ttl shorter than the interval
    /// would expire before its first renewal. Any other ttl is renewed every third of itself,
    /// so that after a failed renewal there is still time for the next one.
    pub fn renew_interval_for(&self, ttl: Duration) -> Duration {
        match self.renew_interval {
            Some(every) if ttl == self.ttl => every,
            _ => ttl / 3,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GOOD;

    /// A password reaches no `Debug` output, from the URL or from its own field, and the
    /// two ways of giving one cannot both be used.
    #[test]
    fn passwords_are_redacted_and_given_once() {
        let text = GOOD
            .replace("root@127.0.0.1:33061", "app:hunter2@127.0.0.1:33061")
            .replace(
                "url: mysql://root@127.0.0.1:33062/shardlock",
                "url: mysql://127.0.0.1:33062/shardlock\n    user: app\n    password: 'p@ss: #w'",
            );
        let c = Config::from_yaml_str(&text).unwrap();
        assert_eq!(c.shards[1].password.as_ref().unwrap().expose(), "p@ss: #w");
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("p@ss"),
            "{shown}"
        );
        assert!(
            shown.contains("mysql://app:***@127.0.0.1:33061/shardlock"),
            "{shown}"
        );
        assert_eq!(redact_url("mysql://root@h/db"), "mysql://root@h/db");
        assert_eq!(redact_url("mysql://u:a@b@h:1/db"), "mysql://u:***@h:1/db");
        assert_eq!(
            redact_url("mysql://u:p/a#s@h/db?x=1"),
            "mysql://u:***@h/db?x=1"
        );
        // It showed a password holding `?`, taken for the query string.
        assert_eq!(redact_url("mysql://u:p?ss@h/db"), "mysql://u:***@h/db");
        assert_eq!(redact_url("mysql://u:p@a?s@h/db"), "mysql://u:***@h/db");
        assert_eq!(redact_url("mysql://u:pa?ss=w@h/db"), "mysql://u:***@h/db");
        // An `@` in a socket path is no password's end.
        let socket = "mysql://app@db:3306/shardlock?socket=/run/mysqld/mysqld@main.sock";
        assert_eq!(redact_url(socket), socket);
        assert_eq!(
            redact_url("mysql://u:p?x@h/db?socket=/a@b"),
            "mysql://u:***@h/db?socket=/a@b"
        );

        let both = GOOD.replace(
            "url: mysql://root@127.0.0.1:33061/shardlock",
            "url: mysql://root@127.0.0.1:33061/shardlock\n    password: a\n    password-file: /p",
        );
        let e = Config::from_yaml_str(&both).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("shards[0].password-file"), "{e}");
        let twice = GOOD.replace(
            "url: mysql://root@127.0.0.1:33061/shardlock",
            "url: mysql://root:x@127.0.0.1:33061/shardlock\n    password: a",
        );
        let e = Config::from_yaml_str(&twice).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("shards[0].url"), "{e}");
        assert!(!e.to_string().contains(":x@"), "{e}");
    }

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
