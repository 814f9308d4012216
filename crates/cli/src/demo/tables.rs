//! The demo's own tables, one set per shard beside the locks: stock per SKU and the orders
//! that sold it.

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::Pool;
use shardlock::LockRouter;

use super::{sku_key, DemoArgs};
use crate::{AnyError, ConfigSource};

/// A pool per shard for the demo's own tables (which live next to the locks).
/// Each reached as shardlock reaches it (credentials beside the URL, TLS).
pub(super) fn shard_pools(source: &ConfigSource) -> shardlock::Result<Vec<(String, Pool)>> {
    let shards = source.config.shards.iter().enumerate();
    shards
        .map(|(i, s)| Ok((s.name.clone(), Pool::new(shardlock::connect_opts(s, i)?))))
        .collect()
}

pub(super) fn pool_of<'a>(shards: &'a [(String, Pool)], name: &str) -> &'a Pool {
    &shards
        .iter()
        .find(|(n, _)| n == name)
        .expect("shard of the config")
        .1
}

pub(super) async fn setup_tables(
    router: &LockRouter,
    shards: &[(String, Pool)],
    args: &DemoArgs,
) -> Result<(), AnyError> {
    for (_, pool) in shards {
        let mut c = pool.get_conn().await?;
        c.query_drop("DROP TABLE IF EXISTS demo_stock, demo_orders")
            .await?;
        c.query_drop(
            "CREATE TABLE demo_stock (sku VARCHAR(32) PRIMARY KEY, initial INT NOT NULL, \
             stock INT NOT NULL, fence BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB",
        )
        .await?;
        c.query_drop(
            "CREATE TABLE demo_orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, sku VARCHAR(32) NOT NULL, \
             buyer VARCHAR(64) NOT NULL, fence BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB",
        )
        .await?;
    }
    for i in 0..args.skus {
        let key = sku_key(i);
        let mut c = pool_of(shards, &router.shard_for(&key)?).get_conn().await?;
        c.exec_drop(
            "INSERT INTO demo_stock VALUES (?, ?, ?, 0)",
            (&key, args.stock, args.stock),
        )
        .await?;
    }
    Ok(())
}

pub(super) async fn count_orders(shards: &[(String, Pool)]) -> Result<u64, AnyError> {
    let mut n = 0;
    for (_, pool) in shards {
        let mut c = pool.get_conn().await?;
        n += c
            .query_first::<u64, _>("SELECT COUNT(*) FROM demo_orders")
            .await?
            .unwrap_or(0);
    }
    Ok(n)
}
