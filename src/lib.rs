#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod acquire;
mod cleaner;
mod clock;
mod election;
mod fence;
mod guard;
mod listing;
mod moves;
mod options;
pub mod patterns;
mod placement_record;
mod queue;
mod registry;
mod router;
mod rwlock;
mod schedule;
mod semaphore;
mod shard;
mod state;
mod stats;
mod status;
mod sync;
pub mod telemetry;
mod topology;
#[cfg(feature = "tower")]
pub mod tower;

pub use cleaner::{CleanerReport, ForceReleased, HolderSearch, ShardCleaned, CLEANER_LOCK_KEY};
pub use election::{Leader, Leadership};
pub use fence::fenced_exec;
pub use guard::{LockGuard, LockMode, LOCAL_FENCE_BIT};
pub use listing::{ListOptions, ListedLease, Listing, DEFAULT_LIST_LIMIT};
pub use options::AcquireOptions;
pub use registry::{InstanceRegistry, StaticRegistry};
pub use router::{LockRouter, RouterBuilder};
pub use rwlock::{ReadGuard, RwLock, WriteGuard};
pub use schedule::ScheduledRun;
pub use semaphore::{Permit, Semaphore};
pub use shardlock_core::config::FailurePolicy;
pub use shardlock_core::Transition as BreakerTransition;
pub use stats::LockStats;
pub use status::ShardStatus;

pub use shardlock_core::config;
pub use shardlock_core::{
    BackendError, BackendErrorKind, Backoff, BreakerConfig, BreakerState, Config, ConfigError,
    Error, LockKey, Report, Result, Ring, RingHash,
};
pub use shardlock_mysql::{
    connect_opts, mysql_async, InstanceRow, InstanceVerdict, LeaseRow, MigrateReport, PoolStatus,
    MAX_DATA_BYTES, MIGRATIONS,
};

/// Services hold routers and guards across `.await` points in spawned tasks: each must stay
/// `Send + Sync`, which this checks at compile time.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<LockRouter>();
    send_sync::<LockGuard>();
    send_sync::<Leadership>();
    send_sync::<ScheduledRun>();
    send_sync::<Permit>();
    send_sync::<ReadGuard>();
    send_sync::<WriteGuard>();
    send_sync::<patterns::TxLockGuard>();
    send_sync::<patterns::CasGuard>();
    send_sync::<Error>();
};
#[cfg(feature = "exporters")]
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<telemetry::TelemetryGuard>();
};
