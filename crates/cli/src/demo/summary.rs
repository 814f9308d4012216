//! The summary both acts end with: per SKU, stock, orders and whether their fences rose; then
//! what the locks did.

use std::collections::HashMap;
use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::Pool;
use shardlock::LockRouter;

use super::buyers::WorkerReport;
use super::tables::pool_of;
use super::{sku_key, DemoArgs};
use crate::AnyError;

pub(super) async fn summarize(
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
    let totals = WorkerReport::total(reports);
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
