//! # shardlock
//!
//! Distributed lease locks stored in MySQL, spread over N shards.
//!
//! ```no_run
//! # async fn demo() -> shardlock::Result<()> {
//! use std::time::Duration;
//! let router = shardlock::LockRouter::from_yaml_file("config/local.yaml").await?;
//! router.migrate().await?;
//! let opts = shardlock::AcquireOptions::new()
//!     .namespace("stock")
//!     .ttl(Duration::from_secs(10))
//!     .wait(Duration::from_secs(2));
//! let guard = router.acquire("order:1001", opts).await?;
//! // ... critical section; guard writes to your own tables with `fenced_exec` ...
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! Each key lives on one shard, chosen by a consistent-hash ring. A lock is a lease row there:
//! granted in one statement round trip, released in one, renewed in the background (one
//! statement per shard per tick for all leases), and judged by the shard's clock only. Every
//! grant carries a fencing token that only goes up per key; use it to guard writes
//! ([`fenced_exec`]). When a lease is lost, [`LockGuard::lost`] completes and
//! [`LockGuard::is_held`] turns false.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod fence;
mod guard;
mod keeper;
mod options;
mod queue;
mod router;

pub use fence::fenced_exec;
pub use guard::{LockGuard, LockMode};
pub use options::AcquireOptions;
pub use router::{LockRouter, LockStats, ShardStatus};

pub use shardlock_core::config;
pub use shardlock_core::{
    BackendError, BackendErrorKind, Backoff, Config, ConfigError, Error, LockKey, Result, Ring,
    RingHash,
};
pub use shardlock_mysql::{mysql_async, LeaseRow, MigrateReport, PoolStatus, MIGRATIONS};
