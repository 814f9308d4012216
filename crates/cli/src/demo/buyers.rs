//! The buyers: tasks buying random SKUs under their locks until every SKU is sold out, in the
//! buyer processes of act 1 and in the parent itself in act 2.

use std::time::{Duration, Instant};

use rand::seq::IndexedRandom;
use serde::{Deserialize, Serialize};
use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::{Conn, Pool, TxOpts, Value};
use shardlock::{AcquireOptions, Error, LockRouter, LockStats};
use tokio::task::JoinHandle;

use super::tables::{pool_of, shard_pools};
use super::{sku_key, DemoArgs, NAMESPACE};
use crate::{AnyError, ConfigSource};

/// What one buyer process reports to the parent (one JSON line on stdout).
#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct WorkerReport {
    pub(super) orders: u64,
    pub(super) grants: u64,
    pub(super) timeouts: u64,
    pub(super) acquire_statements: u64,
    pub(super) handoffs: u64,
    pub(super) local_handoffs: u64,
    pub(super) wait_us_total: u64,
    pub(super) wait_us_max: u64,
    /// Acquires answered `Unavailable` (the SKU's shard was down), and the slowest of them.
    pub(super) unavailable: u64,
    pub(super) unavailable_us_max: u64,
    /// Purchases whose own transaction failed (the shard went down mid-purchase).
    pub(super) failed_purchases: u64,
}

impl WorkerReport {
    /// The reports of several buyers as one: counts add up, maxima are the largest.
    pub(super) fn total<'a>(reports: impl IntoIterator<Item = &'a WorkerReport>) -> Self {
        let mut total = WorkerReport::default();
        for r in reports {
            total.orders += r.orders;
            total.grants += r.grants;
            total.timeouts += r.timeouts;
            total.acquire_statements += r.acquire_statements;
            total.handoffs += r.handoffs;
            total.local_handoffs += r.local_handoffs;
            total.wait_us_total += r.wait_us_total;
            total.wait_us_max = total.wait_us_max.max(r.wait_us_max);
            total.unavailable += r.unavailable;
            total.unavailable_us_max = total.unavailable_us_max.max(r.unavailable_us_max);
            total.failed_purchases += r.failed_purchases;
        }
        total
    }

    /// Takes the router's counts: its statements and hand-offs are per router, not per
    /// buyer, so one report per router carries them.
    pub(super) fn record(&mut self, stats: &LockStats) {
        self.acquire_statements = stats.acquire_statements;
        self.handoffs = stats.handoffs;
        self.local_handoffs = stats.local_handoffs;
    }
}

/// One buyer process: `buyers` tasks buying random SKUs until every SKU is sold out.
pub(super) async fn buyer_process(source: &ConfigSource, args: &DemoArgs) -> Result<(), AnyError> {
    let router = source.router().await?;
    // An edited config file is picked up on SIGHUP (`kill -HUP <pid>`), without stopping the sale.
    let _reloads = match &source.path {
        Some(path) => Some(router.reload_on_sighup(path)?),
        None => None,
    };
    let shards = shard_pools(source)?;
    let opts = match router.config().namespace(NAMESPACE) {
        Some(_) => AcquireOptions::new().namespace(NAMESPACE),
        None => AcquireOptions::new(),
    };
    let buyers = spawn_buyers(&router, &shards, &opts, args, Duration::ZERO);
    let mut report = WorkerReport::total(&sold_out(buyers).await?);
    report.record(&router.stats());
    router.shutdown().await?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// `args.buyers` buyer tasks on `router`, each pausing `think` between purchases.
pub(super) fn spawn_buyers(
    router: &LockRouter,
    shards: &[(String, Pool)],
    opts: &AcquireOptions,
    args: &DemoArgs,
    think: Duration,
) -> Vec<JoinHandle<Result<WorkerReport, AnyError>>> {
    (0..args.buyers)
        .map(|buyer| {
            let (router, shards, opts, skus) =
                (router.clone(), shards.to_vec(), opts.clone(), args.skus);
            tokio::spawn(
                async move { buyer_task(&router, &shards, opts, skus, buyer, think).await },
            )
        })
        .collect()
}

/// Each buyer's report, once every SKU is sold out.
pub(super) async fn sold_out(
    buyers: Vec<JoinHandle<Result<WorkerReport, AnyError>>>,
) -> Result<Vec<WorkerReport>, AnyError> {
    let mut reports = Vec::new();
    for b in buyers {
        reports.push(b.await??);
    }
    Ok(reports)
}

async fn buyer_task(
    router: &LockRouter,
    shards: &[(String, Pool)],
    opts: AcquireOptions,
    skus: u32,
    buyer: u32,
    think: Duration,
) -> Result<WorkerReport, AnyError> {
    let me = format!("{}/{buyer}", router.instance_id());
    let mut open: Vec<u32> = (0..skus).collect();
    let mut report = WorkerReport::default();
    while let Some(sku) = pick(&open) {
        let key = sku_key(sku);
        let asked = Instant::now();
        let guard = match router.acquire(&key, opts.clone()).await {
            Ok(g) => g,
            Err(Error::Timeout { .. }) => {
                report.timeouts += 1;
                continue;
            }
            Err(Error::Unavailable { .. }) => {
                // fail-fast: the SKU's shard is down; try others, come back later.
                let took = asked.elapsed().as_micros() as u64;
                report.unavailable += 1;
                report.unavailable_us_max = report.unavailable_us_max.max(took);
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let waited = asked.elapsed().as_micros() as u64;
        report.grants += 1;
        report.wait_us_total += waited;
        report.wait_us_max = report.wait_us_max.max(waited);

        match purchase(pool_of(shards, guard.shard()), &key, &me, guard.fence()).await {
            Ok(true) => report.orders += 1,
            Ok(false) => open.retain(|&s| s != sku),
            // The shard died mid-purchase: the transaction is rolled back with the connection.
            Err(_) => report.failed_purchases += 1,
        }
        match guard.release().await {
            Err(Error::Unavailable { .. } | Error::LockLost { .. }) | Ok(()) => {}
            Err(e) => return Err(e.into()),
        }
        if !think.is_zero() {
            tokio::time::sleep(think).await;
        }
    }
    Ok(report)
}

/// The purchase: read the stock, write it back minus one, record the order, in one
/// transaction. Without the lock two buyers would read the same value and oversell. `false`
/// when the SKU is sold out.
async fn purchase(pool: &Pool, key: &str, me: &str, fence: u64) -> Result<bool, AnyError> {
    let mut conn: Conn = pool.get_conn().await?;
    let mut tx = conn.start_transaction(TxOpts::default()).await?;
    let stock: i32 = tx
        .exec_first("SELECT stock FROM demo_stock WHERE sku = ?", (key,))
        .await?
        .unwrap_or(0);
    if stock <= 0 {
        tx.rollback().await?;
        return Ok(false);
    }
    shardlock::fenced_exec(
        &mut tx,
        "UPDATE demo_stock SET stock = :stock, fence = :fence WHERE sku = :sku AND fence < :fence",
        [("stock", Value::from(stock - 1)), ("sku", Value::from(key))],
        fence,
    )
    .await?;
    tx.exec_drop(
        "INSERT INTO demo_orders (sku, buyer, fence) VALUES (?, ?, ?)",
        (key, me, fence),
    )
    .await?;
    tx.commit().await?;
    Ok(true)
}

/// A random SKU still on sale (the RNG is not kept across awaits: it is not `Send`).
fn pick(open: &[u32]) -> Option<u32> {
    open.choose(&mut rand::rng()).copied()
}
