//! Guarding your own writes with fencing tokens.
//!
//! A lease can end while its holder still works (a long GC pause, a frozen VM): then a second
//! holder starts. Fences make the first holder's late writes harmless: every grant's fence is
//! larger than the last, the protected row stores the fence of its latest writer, and a write
//! only applies `WHERE fence < :fence`.
//!
//! Run against the local dev shards:
//!
//! ```sh
//! cargo run -p shardlock-cli --features dev-tools -- dev up
//! cargo run --example fenced_write
//! ```
//!
//! or against your own config with `SHARDLOCK_CONFIG=path/to/shardlock.yaml`.

use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::{Conn, Value};
use shardlock::{AcquireOptions, Error, LockRouter};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = std::env::var("SHARDLOCK_CONFIG").unwrap_or_else(|_| "config/local.yaml".into());
    let router = LockRouter::from_yaml_file(&config).await?;
    router.migrate().await?;

    // The protected data: an account row with a fence column, here on the first shard.
    let mut app = Conn::from_url(router.config().shards[0].url.as_str()).await?;
    app.query_drop(
        "CREATE TABLE IF NOT EXISTS example_account \
         (id INT PRIMARY KEY, balance BIGINT NOT NULL, fence BIGINT UNSIGNED NOT NULL)",
    )
    .await?;
    app.query_drop("INSERT IGNORE INTO example_account VALUES (7, 100, 0)")
        .await?;

    let update = "UPDATE example_account SET balance = balance - :amount, fence = :fence \
                  WHERE id = :id AND fence < :fence";
    let opts = AcquireOptions::new().ttl(Duration::from_secs(5));

    // An old holder's fence, kept after its lease ended.
    let old = router.acquire("account:7", opts.clone()).await?;
    let stale_fence = old.fence();
    old.release().await?;

    // The current holder writes with its (larger) fence.
    let current = router.acquire("account:7", opts).await?;
    let params = [("amount", Value::from(10)), ("id", Value::from(7))];
    shardlock::fenced_exec(&mut app, update, params.clone(), current.fence()).await?;
    println!("holder with fence {} debited 10", current.fence());

    // The old holder wakes up and tries to write: rejected, nothing changes.
    match shardlock::fenced_exec(&mut app, update, params, stale_fence).await {
        Err(Error::FenceRejected { fence }) => println!("late write with fence {fence} rejected"),
        other => return Err(format!("expected a rejected write, got {other:?}").into()),
    }
    current.release().await?;
    let balance: Option<i64> = app
        .query_first("SELECT balance FROM example_account WHERE id = 7")
        .await?;
    println!("balance now {}", balance.unwrap_or_default());
    router.shutdown().await?;
    Ok(())
}
