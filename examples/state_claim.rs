//! A state-machine claim on your own table: each transition is one conditional `UPDATE`
//! judged by affected rows, so of many concurrent claimers exactly one wins, and a claim can
//! be rolled back. Choose it when the thing claimed is already a row with a state (a coupon, a
//! seat, an order).
//!
//! ```sh
//! cargo run -p shardlock-cli --features dev-tools -- dev up
//! cargo run --example state_claim
//! ```

use shardlock::mysql_async::prelude::Queryable;
use shardlock::patterns::StateMachine;
use shardlock::LockRouter;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = std::env::var("SHARDLOCK_CONFIG").unwrap_or_else(|_| "config/local.yaml".into());
    let router = LockRouter::from_yaml_file(&config).await?;
    let code = "WELCOME-10";
    // The coupon row lives on the shard of its code.
    let mut conn = router.shard_connection(code).await?;
    conn.raw()
        .query_drop("CREATE TABLE IF NOT EXISTS coupon (code VARCHAR(64) PRIMARY KEY, state VARCHAR(16) NOT NULL)")
        .await?;
    conn.raw()
        .exec_drop("REPLACE INTO coupon VALUES (?, 'available')", (code,))
        .await?;
    drop(conn);

    let coupons = StateMachine::new("coupon", "code", "state")?
        .allow("disabled", "available")
        .allow("available", "locked")
        .allow("locked", "used")
        .allow("locked", "available");
    assert!(
        router
            .transition(&coupons, code, "available", "locked")
            .await?
    );
    assert!(
        !router
            .transition(&coupons, code, "available", "locked")
            .await?,
        "already claimed"
    );
    // The payment failed: give it back, then claim and use it.
    router
        .transition(&coupons, code, "locked", "available")
        .await?;
    router
        .transition(&coupons, code, "available", "locked")
        .await?;
    router.transition(&coupons, code, "locked", "used").await?;
    println!("coupon {code} used once");
    router.shutdown().await?;
    Ok(())
}
