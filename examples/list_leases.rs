//! Two teams' namespaces with key scopes on the same shards, data stored with a lease, and
//! the list of what is held, as `shardlock list --held` shows it.
//!
//! ```sh
//! cargo run -p shardlock-cli --features dev-tools -- dev up
//! cargo run --example list_leases
//! ```

use shardlock::config::NamespaceConfig;
use shardlock::{AcquireOptions, Config, ListOptions, LockRouter};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::var("SHARDLOCK_CONFIG").unwrap_or_else(|_| "config/local.yaml".into());
    let mut config = Config::from_yaml_file(&path)?;
    // As `namespaces.billing.key-prefix: billing/` (and `refunds/`) in the YAML.
    for team in ["billing", "refunds"] {
        let mut scope = NamespaceConfig::default();
        scope.key_prefix = Some(format!("{team}/"));
        config.namespaces.insert(team.into(), scope);
    }
    let router = LockRouter::new(config).await?;
    router.migrate().await?;

    // One key, two teams: two locks.
    let billing = router
        .acquire("order:1001", AcquireOptions::new().namespace("billing"))
        .await?;
    let refunds = router
        .acquire("order:1001", AcquireOptions::new().namespace("refunds"))
        .await?;
    billing.set_data(b"charging card ending 4242").await?;
    refunds.set_data(b"refund requested by ops-7").await?;

    let listing = router.list(ListOptions::new().held_only()).await?;
    for lease in listing
        .leases
        .iter()
        .filter(|l| l.key.ends_with("order:1001"))
    {
        println!(
            "{:<22} on {}: {} ({})",
            lease.key,
            lease.shard,
            lease.row.owner.as_deref().unwrap_or("-"),
            String::from_utf8_lossy(lease.row.data.as_deref().unwrap_or_default()),
        );
    }
    let scoped = router.list(ListOptions::new().namespace("billing")).await?;
    assert!(scoped.leases.iter().all(|l| l.key.starts_with("billing/")));
    billing.release().await?;
    refunds.release().await?;
    router.shutdown().await?;
    Ok(())
}
