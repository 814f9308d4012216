//! Job claims: workers claim the next due job and learn its id in the same step; a job whose
//! worker crashed is claimed again once its lease runs out, up to its retry limit. Choose it
//! for work queues kept in MySQL (emails, exports, webhooks).
//!
//! ```sh
//! cargo run -p shardlock-cli --features dev-tools -- dev up
//! cargo run --example job_queue
//! ```

use std::time::Duration;

use shardlock::LockRouter;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = std::env::var("SHARDLOCK_CONFIG").unwrap_or_else(|_| "config/local.yaml".into());
    let router = LockRouter::from_yaml_file(&config).await?;
    router.migrate().await?;
    for i in 0..5 {
        router
            .enqueue_job(
                "welcome-emails",
                format!("user {i}").as_bytes(),
                Duration::ZERO,
                3,
            )
            .await?;
    }
    let lease = Duration::from_secs(30);
    while let Some(job) = router
        .claim_job("welcome-emails", "example-worker", lease)
        .await?
    {
        println!(
            "sending to {} (job {})",
            String::from_utf8_lossy(&job.payload),
            job.id
        );
        // Work that may outlast the lease: the claim is kept extended while it runs, and the
        // work stops if the claim may have run out anyway (the shard out of reach): another
        // worker may take the job from then on.
        let keeper = router.keep_job(&job, lease)?;
        let work = tokio::time::sleep(Duration::from_millis(50)); // ... send it
        tokio::select! {
            _ = work => {
                drop(keeper);
                router.complete_job(&job).await?;
            }
            _ = job.lost() => {
                println!("job {} ran out before it was done: left to the next claim", job.id);
            }
        }
    }
    router.shutdown().await?;
    Ok(())
}
