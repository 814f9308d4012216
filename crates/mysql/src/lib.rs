//! shardlock's MySQL backend: one deadpool pool of `mysql_async` connections per shard, every
//! statement shardlock runs (leases, the registry and cleaner, the other lock patterns), and
//! the versioned migrations.
//!
//! The SQL runs on MySQL 8.0+ and MariaDB 10.6+: no `RETURNING`, no sequences, no `VALUES()`
//! in `ON DUPLICATE KEY UPDATE` (deprecated in MySQL 8). Time is always the shard's clock.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod batch;
mod carry;
mod cleaner;
mod error;
mod lease;
mod migrate;
mod patterns;
mod pool;
mod shard;
mod stranded;
mod tls;

pub use batch::{BatchGrants, MAX_BATCH};
pub use carry::{CasRow, CopyCas, MovingJob, PendingJob};
pub use cleaner::{Beat, Candidate, Deleted, Heartbeat, InstanceRow, InstanceVerdict, Scanned};
pub use error::classify;
pub use lease::{
    renew_chunks, Attempt, FenceRow, GrantRequest, HandoffOutcome, LeaseRow, ListFilter,
    ReleaseAnswer, RenewOutcome, Renewal, FLOOR_BATCH, HELD_MARK, MAX_DATA_BYTES, MAX_RENEW_BATCH,
    MAX_RENEW_BYTES,
};
pub use migrate::{MigrateReport, MIGRATIONS};
pub use patterns::{CasGiveBack, ClaimedJob, JobEnd, StateTable};
pub use pool::{SessionConn, SessionId};
pub use shard::{connect_opts, PoolStatus, Shard};

/// Re-exported so callers can run their own SQL on a shard connection.
pub use mysql_async;

#[cfg(test)]
mod testing {
    use shardlock_core::Config;
    use shardlock_testkit::Cluster;

    use crate::Shard;

    /// `n` shards of their own, migrated, and the cluster they run on.
    pub(crate) async fn migrated_shards(n: usize) -> (Cluster, Vec<Shard>) {
        let cluster = Cluster::start(n).await.unwrap();
        let config = Config::from_yaml_str(&cluster.config_yaml("")).unwrap();
        let mut shards = Vec::new();
        for (i, config) in config.shards.iter().enumerate() {
            let shard = Shard::new(config, i).unwrap();
            shard.migrate().await.unwrap();
            shards.push(shard);
        }
        (cluster, shards)
    }

    /// One shard of its own, migrated, and the cluster it runs on.
    pub(crate) async fn migrated_shard() -> (Cluster, Shard) {
        let (cluster, mut shards) = migrated_shards(1).await;
        (cluster, shards.remove(0))
    }
}
