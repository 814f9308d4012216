//! A transaction lock: `SELECT ... FOR UPDATE` on a shardlock row inside a transaction, with
//! your own SQL in that same transaction. It holds exactly as long as the transaction: commit,
//! rollback, or the connection dying (a crashed process) releases it. Choose it when the work
//! is a few statements on the key's shard and must commit together with the lock.
//!
//! ```sh
//! cargo run -p shardlock-cli --features dev-tools -- dev up
//! cargo run --example tx_lock
//! ```

use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::LockRouter;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = std::env::var("SHARDLOCK_CONFIG").unwrap_or_else(|_| "config/local.yaml".into());
    let router = LockRouter::from_yaml_file(&config).await?;
    router.migrate().await?;

    // DDL first, outside the lock: it commits implicitly, which would end the transaction
    // holding the lock (`commit` would then answer `LockLost`).
    let mut setup = router.shard_connection("invoice:2024-0042").await?;
    setup
        .raw()
        .query_drop("CREATE TABLE IF NOT EXISTS invoice_numbers (n INT PRIMARY KEY)")
        .await?;
    drop(setup);

    let mut guard = router
        .lock_in_transaction("invoice:2024-0042", Duration::from_secs(2))
        .await?;
    println!("locked on {}", guard.shard());
    let next: Option<i64> = guard
        .conn()
        .query_first("SELECT COALESCE(MAX(n), 0) + 1 FROM invoice_numbers")
        .await?;
    guard
        .conn()
        .exec_drop("INSERT INTO invoice_numbers VALUES (?)", (next,))
        .await?;
    guard.commit().await?; // the number and the lock end together
    println!("issued invoice number {}", next.unwrap_or(0));
    router.shutdown().await?;
    Ok(())
}
