//! One hot key, 64 tasks hammering it for 10 s from eight router instances: no deadlock or
//! lock wait timeout reaches a caller, and the server reports how many deadlocks it saw.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use shardlock::{AcquireOptions, LockRouter};

const TASKS: usize = 64;
const INSTANCES: usize = 8;
const RUN: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread")]
async fn sixty_four_tasks_on_one_key_see_no_deadlocks() {
    let (cluster, _router, yaml) = common::start(1, "").await;
    let mut routers = Vec::new();
    for _ in 0..INSTANCES {
        routers.push(LockRouter::from_yaml_str(&yaml).await.unwrap());
    }
    let deadlocks_before = cluster
        .shard(0)
        .global_status("Innodb_deadlocks")
        .await
        .unwrap();
    let grants = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicU64::new(0));
    let stop = tokio::time::Instant::now() + RUN;
    let tasks: Vec<_> = (0..TASKS)
        .map(|i| {
            let router = routers[i % INSTANCES].clone();
            let (grants, inside) = (grants.clone(), inside.clone());
            tokio::spawn(async move {
                let mut errors = Vec::new();
                while tokio::time::Instant::now() < stop {
                    match router
                        .acquire(
                            "sku:hot",
                            AcquireOptions::new().wait(Duration::from_secs(30)),
                        )
                        .await
                    {
                        Ok(g) => {
                            assert_eq!(
                                inside.fetch_add(1, Ordering::SeqCst),
                                0,
                                "two holders at once"
                            );
                            grants.fetch_add(1, Ordering::Relaxed);
                            inside.fetch_sub(1, Ordering::SeqCst);
                            g.release().await.unwrap();
                        }
                        Err(e) => errors.push(e.to_string()),
                    }
                }
                errors
            })
        })
        .collect();
    let mut errors = Vec::new();
    for t in tasks {
        errors.extend(t.await.unwrap());
    }
    let deadlocks = cluster
        .shard(0)
        .global_status("Innodb_deadlocks")
        .await
        .unwrap()
        - deadlocks_before;
    let grants = grants.load(Ordering::Relaxed);
    eprintln!("{grants} grants in {RUN:?}; InnoDB deadlocks counted by the server: {deadlocks}");
    assert!(
        errors.is_empty(),
        "callers saw errors: {:?}",
        &errors[..errors.len().min(5)]
    );
    assert!(
        grants > TASKS as u64,
        "every task got the key at least once: {grants}"
    );
    assert_eq!(deadlocks, 0, "the lease statements provoke no deadlocks");
}
