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
    /// Skip the second act (a shard killed mid-sale and restarted; local dev shards only).
    #[arg(long)]
    no_failure: bool,
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
    /// Acquires answered `Unavailable` (the SKU's shard was down), and the slowest of them.
    unavailable: u64,
    unavailable_us_max: u64,
    /// Purchases whose own transaction failed (the shard went down mid-purchase).
    failed_purchases: u64,
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
    summarize(&router, &shards, &args, &reports, elapsed).await?;
    if args.no_failure {
        return Ok(());
    }
    if !source.is_local_default() {
        println!(
            "\n(Act 2, a shard killed mid-sale, runs on the local dev shards only: omit --config.)"
        );
        return Ok(());
    }
    failure_act(source, &shards, &args).await
}

/// The namespace of the demo's recommendation-cache refills (`local` policy).
const RECS: &str = "recommendations";

/// Act 2: more stock, buyers and cache refills in this process, and the shard holding the
/// most SKUs killed a second in and restarted two seconds later.
async fn failure_act(
    source: &ConfigSource,
    shards: &[(String, Pool)],
    args: &DemoArgs,
) -> Result<(), AnyError> {
    let router = source.router().await?;
    let restock = args.stock;
    for (_, pool) in shards {
        pool.get_conn()
            .await?
            .exec_drop(
                "UPDATE demo_stock SET initial = initial + ?, stock = stock + ?",
                (restock, restock),
            )
            .await?;
    }
    let victim = busiest_shard(&router, args.skus)?;
    let victim_index = source
        .config
        .shards
        .iter()
        .position(|s| s.name == victim)
        .ok_or("victim shard not configured")?;
    println!(
        "\nAct 2: {restock} more units per SKU; {} buyers and 8 cache refillers in this process; \
         shard {victim} is killed 0.3 s in and restarted 2 s later.",
        args.buyers
    );
    let started = Instant::now();
    let opts = AcquireOptions::new().namespace(NAMESPACE);
    let buyers: Vec<_> = (0..args.buyers)
        .map(|b| {
            let (router, shards, opts, skus) =
                (router.clone(), shards.to_vec(), opts.clone(), args.skus);
            // Buyers pause 5 ms between purchases so that the sale outlasts the outage.
            let think = Duration::from_millis(5);
            tokio::spawn(async move { buyer_task(&router, &shards, opts, skus, b, think).await })
        })
        .collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let refills: Vec<_> = (0..8)
        .map(|r| {
            let (router, stop) = (router.clone(), stop.clone());
            tokio::spawn(async move { refill_task(&router, &stop, r).await })
        })
        .collect();
    let timeline = {
        let (router, stop, victim) = (router.clone(), stop.clone(), victim.clone());
        tokio::spawn(async move {
            let mut seen = vec![(Duration::ZERO, router.breaker_state(&victim))];
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let state = router.breaker_state(&victim);
                if seen.last().map(|(_, s)| *s) != Some(state) {
                    seen.push((started.elapsed(), state));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            seen
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    dev::cluster().kill(victim_index)?;
    let killed_at = started.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    dev::cluster().up().await?;
    let restarted_at = started.elapsed();
    let mut reports = Vec::new();
    for b in buyers {
        reports.push(b.await??);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut refilled = RefillReport::default();
    for r in refills {
        let r = r.await?;
        refilled.remote += r.remote;
        refilled.local += r.local;
    }
    let timeline = timeline.await?;
    let elapsed = started.elapsed();
    let stats = router.stats();
    if let Some(first) = reports.first_mut() {
        first.acquire_statements = stats.acquire_statements;
        first.handoffs = stats.handoffs;
        first.local_handoffs = stats.local_handoffs;
    }
    summarize(&router, shards, args, &reports, elapsed).await?;
    let unavailable: u64 = reports.iter().map(|r| r.unavailable).sum();
    let slowest = reports
        .iter()
        .map(|r| r.unavailable_us_max)
        .max()
        .unwrap_or(0);
    let failed: u64 = reports.iter().map(|r| r.failed_purchases).sum();
    println!(
        "Fault:  {victim} killed at {:.1} s, restarted at {:.1} s. Its breaker here: {}",
        killed_at.as_secs_f64(),
        restarted_at.as_secs_f64(),
        timeline
            .iter()
            .map(|(at, state)| format!(
                "{} at {:.2} s",
                state.map_or("-", shardlock::BreakerState::name),
                at.as_secs_f64()
            ))
            .collect::<Vec<_>>()
            .join(" -> ")
    );
    println!(
        "stock ({NAMESPACE}, fail-fast): {unavailable} acquires answered Unavailable (slowest \
         {:.1} ms) and were retried later; {failed} purchases in flight when the shard died were \
         rolled back; nothing oversold (above).",
        slowest as f64 / 1000.0
    );
    println!(
        "{RECS} (local): {} refills under shard leases, {} under in-process locks while \
         {victim} was down; {} re-acquired on the shard, {} conflicts.",
        refilled.remote, refilled.local, stats.reconciled, stats.reconcile_conflicts
    );
    router.shutdown().await?;
    Ok(())
}

/// The shard that holds the most SKUs.
fn busiest_shard(router: &LockRouter, skus: u32) -> Result<String, AnyError> {
    let mut count: HashMap<String, u32> = HashMap::new();
    for i in 0..skus {
        *count.entry(router.shard_for(&sku_key(i))?).or_default() += 1;
    }
    Ok(count
        .into_iter()
        .max_by_key(|(name, n)| (*n, std::cmp::Reverse(name.clone())))
        .map(|(name, _)| name)
        .ok_or("no SKUs")?)
}

#[derive(Debug, Default)]
struct RefillReport {
    remote: u64,
    local: u64,
}

/// Refills recommendation caches (`recs:<n>`) under the `local`-policy lock until stopped.
async fn refill_task(
    router: &LockRouter,
    stop: &std::sync::atomic::AtomicBool,
    r: u32,
) -> RefillReport {
    let mut report = RefillReport::default();
    let opts = AcquireOptions::new().namespace(RECS);
    let mut i = r;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        i = i.wrapping_add(7);
        match router
            .acquire(&format!("recs:{}", i % 32), opts.clone())
            .await
        {
            Ok(guard) => {
                if guard.mode() == shardlock::LockMode::LocalFallback {
                    report.local += 1;
                } else {
                    report.remote += 1;
                }
                tokio::time::sleep(Duration::from_millis(2)).await; // the refill
                let _ = guard.release().await;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    report
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
            buyer_task(&router, &shards, opts, skus, buyer, Duration::ZERO).await
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
