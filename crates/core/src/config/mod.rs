//! The YAML configuration: instance, shards, routing and namespace policies.
//!
//! Every struct denies unknown fields and uses kebab-case names; durations are written like
//! `10s` or `250ms`. `${VAR}` (or `${VAR:-default}`) in the text is replaced from the
//! environment before parsing, so secrets stay out of the file. Every error names the file,
//! the line and column, and the field. `config/reference.yaml` documents every field.
//!
//! One file per concern, so a change to one does not mean reading the others: `schema` (the
//! structs and defaults), `parse` (text to a checked config), `validate` (one check per
//! section), `env` (`${VAR}` substitution), `locate` (a field's place in the YAML) and
//! `error`. Everything public is re-exported here, at the paths it has always had.

mod env;
mod error;
mod locate;
mod parse;
mod schema;
mod validate;

pub use error::ConfigError;
pub use parse::read_file;
pub use schema::{
    database_reached, redact_url, CleanerConfig, Config, FailurePolicy, InstanceConfig,
    NamespaceConfig, PoolConfig, RegistryKind, RoutingConfig, Secret, ShardConfig, TelemetryConfig,
    TlsConfig, TlsMode, DEFAULT_BACKOFF_BASE, DEFAULT_BACKOFF_CAP, DEFAULT_CLOCK_DRIFT,
    DEFAULT_FLEET, DEFAULT_HANDOFF_MAX_COUNT, DEFAULT_HANDOFF_MAX_TIME, DEFAULT_NAMESPACE,
    DEFAULT_NODE_CLOCK_SKEW, DEFAULT_POOL_CREATE_TIMEOUT, DEFAULT_POOL_IDLE_CHECK,
    DEFAULT_POOL_IDLE_TIMEOUT, DEFAULT_POOL_MAX_LIFETIME, DEFAULT_POOL_MAX_SIZE,
    DEFAULT_POOL_RECYCLE_TIMEOUT, DEFAULT_POOL_WAIT_TIMEOUT, DEFAULT_STATEMENT_TIMEOUT,
    DEFAULT_TTL, DEFAULT_VIRTUAL_NODES, DEFAULT_WAIT,
};
pub use validate::{check_ttl, MAX_BUCKETS, MAX_DURATION, MAX_TTL, MIN_TTL};

/// A small valid config that the tests of each part vary by one edit, so every test reads
/// as "this config, but ...".
#[cfg(test)]
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
