//! A version compare-and-set lock: acquire sets an owner where the version is still the one
//! read, release clears it where the take that set it (its token, in the guard) still owns
//! it. No lease, no renewal: choose
//! it for rare, short critical sections where a crashed holder may be cleared by hand (or by
//! `shardlock release --force` on a lease lock instead, which you should prefer otherwise).
//!
//! ```sh
//! cargo run -p shardlock-cli --features dev-tools -- dev up
//! cargo run --example cas_lock
//! ```

use shardlock::LockRouter;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = std::env::var("SHARDLOCK_CONFIG").unwrap_or_else(|_| "config/local.yaml".into());
    let router = LockRouter::from_yaml_file(&config).await?;
    router.migrate().await?;
    let guard = router
        .cas_acquire("report:monthly", "example")
        .await?
        .ok_or("someone else holds it")?;
    println!("holding report:monthly at version {}", guard.version);
    assert!(router
        .cas_acquire("report:monthly", "other")
        .await?
        .is_none());
    assert!(router.cas_release(guard).await?);
    router.shutdown().await?;
    Ok(())
}
