//! `shardlock demo`: a flash sale. Buyer processes sell limited stock of several SKUs, each
//! purchase a read-modify-write under the SKU's shardlock lock; the summary proves nothing was
//! oversold and shows what the locks did.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use rand::seq::IndexedRandom;
use serde::{Deserialize, Serialize};
use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::{Conn, Pool, TxOpts, Value};
use shardlock::{AcquireOptions, Error, LockRouter};
use tokio::io::AsyncReadExt;

use crate::{dev, AnyError, ConfigSource};

#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// SKUs on sale.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1000))]
    skus: u32,
    /// Units of stock per SKU.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    stock: u32,
    /// Buyer processes.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=16))]
    processes: u32,
    /// Concurrent buyers in each process.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=512))]
    buyers: u32,
    /// Internal: run as one buyer process.
    #[arg(long, hide = true)]
    worker: bool,
}

/// What one buyer process reports to the parent (one JSON line on stdout).
#[derive(Debug, Default, Serialize, Deserialize)]
struct WorkerReport {
    orders: u64,
    grants: u64,
    timeouts: u64,
    acquire_statements: u64,
    handoffs: u64,
    local_handoffs: u64,
    wait_us_total: u64,
    wait_us_max: u64,
}

const NAMESPACE: &str = "stock";

fn sku_key(i: u32) -> String {
    format!("sku:{i}")
}

pub(crate) async fn run(source: &ConfigSource, args: DemoArgs) -> Result<(), AnyError> {
    if args.worker {
        return buyer_process(source, &args).await;
    }
    if source.is_local_default() {
        dev::ensure_up().await?;
    }
    let router = source.router().await?;
    router.migrate().await?;
    let shards = shard_pools(source);
    setup_tables(&router, &shards, &args).await?;

    let total = u64::from(args.skus) * u64::from(args.stock);
    println!(
        "Flash sale: {} SKUs x {} units, {} processes x {} buyers, {} shards",
        args.skus,
        args.stock,
        args.processes,
        args.buyers,
        shards.len()
    );
    let started = Instant::now();
    let mut children = Vec::new();
    for _ in 0..args.processes {
        let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
        cmd.args(source.child_args())
            .args([
                "demo",
                "--worker",
                "--skus",
                &args.skus.to_string(),
                "--buyers",
                &args.buyers.to_string(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        children.push(cmd.spawn()?);
    }
    let bar = ProgressBar::new(total).with_style(
        ProgressStyle::with_template(
            "{spinner} selling [{bar:40}] {pos}/{len} units {per_sec} {elapsed}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let mut reports = Vec::new();
    let mut outputs: Vec<_> = children
        .iter_mut()
        .map(|c| c.stdout.take().expect("piped"))
        .collect();
    let waits = children
        .into_iter()
        .map(|mut c| tokio::spawn(async move { c.wait().await }));
    let waits: Vec<_> = waits.collect();
    while !waits.iter().all(|w| w.is_finished()) {
        bar.set_position(count_orders(&shards).await?);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bar.set_position(count_orders(&shards).await?);
    bar.finish();
    let elapsed = started.elapsed();
    for (wait, out) in waits.into_iter().zip(outputs.iter_mut()) {
        let status = wait.await??;
        let mut text = String::new();
        out.read_to_string(&mut text).await?;
        if !status.success() {
            return Err(format!("a buyer process failed ({status})").into());
        }
        let line = text
            .lines()
            .last()
            .ok_or("a buyer process printed no report")?;
        reports.push(serde_json::from_str::<WorkerReport>(line)?);
    }
    summarize(&router, &shards, &args, &reports, elapsed).await
}

/// A pool per shard for the demo's own tables (which live next to the locks).
fn shard_pools(source: &ConfigSource) -> Vec<(String, Pool)> {
    source
        .config
        .shards
        .iter()
        .map(|s| (s.name.clone(), Pool::new(s.url.as_str())))
        .collect()
}

fn pool_of<'a>(shards: &'a [(String, Pool)], name: &str) -> &'a Pool {
    &shards
        .iter()
        .find(|(n, _)| n == name)
        .expect("shard of the config")
        .1
}

async fn setup_tables(
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

async fn count_orders(shards: &[(String, Pool)]) -> Result<u64, AnyError> {
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

/// One buyer process: `buyers` tasks buying random SKUs until every SKU is sold out.
async fn buyer_process(source: &ConfigSource, args: &DemoArgs) -> Result<(), AnyError> {
    let router = source.router().await?;
    // An edited config file is picked up on SIGHUP (`kill -HUP <pid>`), without stopping the sale.
    let _reloads = match &source.path {
        Some(path) => Some(router.reload_on_sighup(path)?),
        None => None,
    };
    let shards = shard_pools(source);
    let opts = match router.config().namespace(NAMESPACE) {
        Some(_) => AcquireOptions::new().namespace(NAMESPACE),
        None => AcquireOptions::new(),
    };
    let mut tasks = Vec::new();
    for buyer in 0..args.buyers {
        let (router, shards, opts, skus) =
            (router.clone(), shards.clone(), opts.clone(), args.skus);
        tasks.push(tokio::spawn(async move {
            buyer_task(&router, &shards, opts, skus, buyer).await
        }));
    }
    let mut report = WorkerReport::default();
    for t in tasks {
        let r = t.await??;
        report.orders += r.orders;
        report.timeouts += r.timeouts;
        report.grants += r.grants;
        report.wait_us_total += r.wait_us_total;
        report.wait_us_max = report.wait_us_max.max(r.wait_us_max);
    }
    let stats = router.stats();
    report.acquire_statements = stats.acquire_statements;
    report.handoffs = stats.handoffs;
    report.local_handoffs = stats.local_handoffs;
    router.shutdown().await?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

async fn buyer_task(
    router: &LockRouter,
    shards: &[(String, Pool)],
    opts: AcquireOptions,
    skus: u32,
    buyer: u32,
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
            Err(e) => return Err(e.into()),
        };
        let waited = asked.elapsed().as_micros() as u64;
        report.grants += 1;
        report.wait_us_total += waited;
        report.wait_us_max = report.wait_us_max.max(waited);

        // The purchase: read the stock, write it back minus one. Without the lock two buyers
        // would read the same value and oversell.
        let mut conn: Conn = pool_of(shards, guard.shard()).get_conn().await?;
        let mut tx = conn.start_transaction(TxOpts::default()).await?;
        let stock: i32 = tx
            .exec_first("SELECT stock FROM demo_stock WHERE sku = ?", (&key,))
            .await?
            .unwrap_or(0);
        if stock <= 0 {
            tx.rollback().await?;
            open.retain(|&s| s != sku);
        } else {
            shardlock::fenced_exec(
                &mut tx,
                "UPDATE demo_stock SET stock = :stock, fence = :fence WHERE sku = :sku AND fence < :fence",
                [("stock", Value::from(stock - 1)), ("sku", Value::from(&key))],
                guard.fence(),
            )
            .await?;
            tx.exec_drop(
                "INSERT INTO demo_orders (sku, buyer, fence) VALUES (?, ?, ?)",
                (&key, &me, guard.fence()),
            )
            .await?;
            tx.commit().await?;
            report.orders += 1;
        }
        drop(conn);
        guard.release().await?;
    }
    Ok(report)
}

/// A random SKU still on sale (the RNG is not kept across awaits: it is not `Send`).
fn pick(open: &[u32]) -> Option<u32> {
    open.choose(&mut rand::rng()).copied()
}

async fn summarize(
    router: &LockRouter,
    shards: &[(String, Pool)],
    args: &DemoArgs,
    reports: &[WorkerReport],
    elapsed: Duration,
) -> Result<(), AnyError> {
    println!();
    println!(
        "{:<10} {:<8} {:>7} {:>6} {:>6}  FENCES",
        "SKU", "SHARD", "STOCK", "SOLD", "LEFT"
    );
    let mut problems = Vec::new();
    let (mut sold_total, mut initial_total) = (0i64, 0i64);
    for i in 0..args.skus {
        let key = sku_key(i);
        let shard = router.shard_for(&key)?;
        let mut c = pool_of(shards, &shard).get_conn().await?;
        let (initial, left): (i64, i64) = c
            .exec_first(
                "SELECT initial, stock FROM demo_stock WHERE sku = ?",
                (&key,),
            )
            .await?
            .ok_or("stock row vanished")?;
        let fences: Vec<u64> = c
            .exec(
                "SELECT fence FROM demo_orders WHERE sku = ? ORDER BY id",
                (&key,),
            )
            .await?;
        let sold = fences.len() as i64;
        let rising = fences.windows(2).all(|w| w[0] < w[1]);
        println!(
            "{:<10} {:<8} {:>7} {:>6} {:>6}  {}",
            key,
            shard,
            initial,
            sold,
            left,
            if rising { "rising" } else { "OUT OF ORDER" }
        );
        if sold > initial || left < 0 || sold + left != initial {
            problems.push(format!(
                "{key}: {initial} in stock, {sold} orders, {left} left"
            ));
        }
        if !rising {
            problems.push(format!(
                "{key}: fences of its orders do not rise in commit order"
            ));
        }
        sold_total += sold;
        initial_total += initial;
    }
    let mut totals = WorkerReport::default();
    for r in reports {
        totals.grants += r.grants;
        totals.timeouts += r.timeouts;
        totals.acquire_statements += r.acquire_statements;
        totals.handoffs += r.handoffs;
        totals.local_handoffs += r.local_handoffs;
        totals.wait_us_total += r.wait_us_total;
        totals.wait_us_max = totals.wait_us_max.max(r.wait_us_max);
    }
    println!();
    if problems.is_empty() {
        println!(
            "Result: {sold_total} of {initial_total} units sold, one order each; nothing oversold; \
             fences rose per SKU in commit order."
        );
    } else {
        println!("Result: PROBLEMS FOUND");
        for p in &problems {
            println!("  {p}");
        }
    }
    let grants = totals.grants.max(1);
    println!(
        "Locks:  {} grants in {:.1} s ({:.0}/s), {} of them handed over in memory and {} by the release statement, \
         {} timeouts,\n        {} acquire statements ({:.2} per grant), wait mean {:.1} ms, max {:.1} ms",
        totals.grants,
        elapsed.as_secs_f64(),
        totals.grants as f64 / elapsed.as_secs_f64(),
        totals.local_handoffs,
        totals.handoffs,
        totals.timeouts,
        totals.acquire_statements,
        totals.acquire_statements as f64 / grants as f64,
        totals.wait_us_total as f64 / grants as f64 / 1000.0,
        totals.wait_us_max as f64 / 1000.0,
    );
    let placement: HashMap<String, usize> = (0..args.skus).fold(HashMap::new(), |mut m, i| {
        *m.entry(router.shard_for(&sku_key(i)).unwrap_or_default())
            .or_default() += 1;
        m
    });
    let mut placement: Vec<_> = placement.into_iter().collect();
    placement.sort();
    println!(
        "Shards: {}",
        placement
            .iter()
            .map(|(s, n)| format!("{s} holds {n} SKUs"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if problems.is_empty() {
        Ok(())
    } else {
        Err("the flash sale oversold or reordered writes".into())
    }
}
