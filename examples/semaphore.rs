//! A semaphore and a read/write lock across processes (routers here): at most 3 exports run
//! at once over 10 workers; a catalog is read by many and rewritten by one at a time.
//!
//! ```sh
//! cargo run -p shardlock-cli --features dev-tools -- dev up
//! cargo run --example semaphore
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use shardlock::{AcquireOptions, LockRouter};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let config = std::env::var("SHARDLOCK_CONFIG").unwrap_or_else(|_| "config/local.yaml".into());
    let router = LockRouter::from_yaml_file(&config).await?;
    router.migrate().await?;

    // Ten export workers, three permits: never more than three exports at once.
    let exports = router.semaphore("exports", 3)?;
    let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut workers = Vec::new();
    for _ in 0..10 {
        let (exports, running, most) = (exports.clone(), running.clone(), most.clone());
        workers.push(tokio::spawn(async move {
            let opts = AcquireOptions::new().wait(Duration::from_secs(30));
            let permit = exports.acquire(opts).await?;
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await; // the export
            running.fetch_sub(1, Ordering::SeqCst);
            permit.release().await
        }));
    }
    for worker in workers {
        worker.await??;
    }
    println!("exports at once: at most {}", most.load(Ordering::SeqCst));
    assert!(most.load(Ordering::SeqCst) <= 3);

    // Readers share the catalog; a writer waits for them and has it alone.
    let catalog = router.rw_lock("catalog", 4)?;
    let first = catalog.read(AcquireOptions::new()).await?;
    let second = catalog.read(AcquireOptions::new()).await?;
    println!(
        "two readers at once: {}",
        first.is_held() && second.is_held()
    );
    let writer = {
        let catalog = catalog.clone();
        tokio::spawn(async move { catalog.write(AcquireOptions::new()).await })
    };
    first.release().await?;
    second.release().await?;
    let write = writer.await??;
    println!("writer in after the readers left, fence {}", write.fence());
    write.release().await?;
    router.shutdown().await?;
    Ok(())
}
