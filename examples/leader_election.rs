//! Leader election: three campaigners (routers here, processes in production) for one name;
//! the leader works while `is_leader()` holds, its term fences its writes, and when it resigns
//! the next campaigner is elected with a larger term.
//!
//! ```sh
//! cargo run -p shardlock-cli --features dev-tools -- dev up
//! cargo run --example leader_election
//! ```

use std::time::Duration;

use shardlock::{AcquireOptions, LockRouter};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = std::env::var("SHARDLOCK_CONFIG").unwrap_or_else(|_| "config/local.yaml".into());
    let observer = LockRouter::from_yaml_file(&config).await?;
    observer.migrate().await?;

    let mut campaigns = Vec::new();
    for _ in 0..3 {
        let router = LockRouter::from_yaml_file(&config).await?;
        campaigns.push(tokio::spawn(async move {
            let opts = AcquireOptions::new().ttl(Duration::from_secs(5));
            let leadership = router.campaign("leader:billing", opts).await?;
            let term = leadership.term();
            println!("{} leads, term {term}", router.instance_id());
            // Lead for a moment; a leader that lost its lease would stop here.
            tokio::select! {
                _ = leadership.lost() => println!("term {term}: lost the leadership"),
                _ = tokio::time::sleep(Duration::from_millis(300)) => {}
            }
            leadership.resign().await?;
            router.shutdown().await?;
            Ok::<u64, shardlock::Error>(term)
        }));
    }
    let mut terms = Vec::new();
    for campaign in campaigns {
        terms.push(campaign.await??);
    }
    terms.sort_unstable();
    terms.dedup();
    assert_eq!(terms.len(), 3, "each leader had a term of its own");
    println!(
        "leader now: {:?}",
        observer
            .leader("leader:billing", AcquireOptions::new())
            .await?
    );
    observer.shutdown().await?;
    Ok(())
}
