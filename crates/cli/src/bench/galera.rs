//! The `galera` scenario: the uncontended cycle through a shard served by a three-node
//! Galera cluster that the bench starts on this machine (the testkit's), against the same
//! cycle on the bench's single-server shard, in the same run: what synchronous replication
//! costs a lock.

use shardlock::LockRouter;
use shardlock_testkit::GaleraCluster;

use super::harness::{bench_config, Round};
use super::report::Measurement;
use super::uncontended;
use crate::{AnyError, ConfigSource};

/// A local three-node Galera shard and a router over it; the cluster stops on drop.
pub(super) struct GaleraShard {
    cluster: GaleraCluster,
    router: LockRouter,
}

impl GaleraShard {
    /// Starts the cluster (a few seconds) and a migrated router whose one shard it is, with
    /// the bench config's namespaces and instance.
    pub(super) async fn start(source: &ConfigSource) -> Result<Self, AnyError> {
        let cluster = GaleraCluster::start(3).await?;
        let galera = shardlock::Config::from_yaml_str(&cluster.config_yaml("g", ""))?;
        let mut config = bench_config(source, "galera");
        config.shards = galera.shards;
        let router = LockRouter::new(config).await?;
        router.migrate().await?;
        Ok(Self { cluster, router })
    }

    /// One round of the uncontended cycle through the Galera shard, its statements counted
    /// on the node every write goes through (g1).
    pub(super) async fn cycle(&self, round: Round<'_>) -> Result<Measurement, AnyError> {
        let writes = || self.cluster.node(0).row_writes();
        let before = writes().await?;
        let mut m = uncontended::shardlock(&self.router, round).await?;
        m.name = "shardlock acquire+release, distinct keys, 3-node Galera shard".into();
        m.statements_per_op = (writes().await? - before) as f64 / m.ops.max(1) as f64;
        uncontended::sweep(&self.router, round).await?;
        Ok(m)
    }

    pub(super) async fn stop(self) -> Result<(), AnyError> {
        self.router.shutdown().await?;
        Ok(())
    }
}
