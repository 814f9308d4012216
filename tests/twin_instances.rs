//! Two processes configured with one instance id (a copy-pasted config, an old incarnation
//! still running): their owners never collide, and the second one is refused at start.

mod common;

use std::time::Duration;

use shardlock::{AcquireOptions, LockRouter};
use shardlock_testkit::{report, Worker};

const TWIN: &str = "instance:\n  id: twin\n";

#[tokio::test(flavor = "multi_thread")]
async fn two_routers_with_one_instance_id_never_share_an_owner() {
    let (cluster, _router, _) = common::start(2, "").await;
    let yaml = cluster.config_yaml(TWIN);
    let a = LockRouter::from_yaml_str(&yaml).await.unwrap();
    // Another router of this same process may share the id (same host and pid)...
    let b = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let once = || AcquireOptions::new().wait(Duration::ZERO);
    let held = a.acquire("k", once()).await.unwrap();
    // ...and still never looks like the holder: owners carry a per-start nonce.
    assert!(b.try_acquire("k", once()).await.unwrap().is_none());
    assert_ne!(held.owner(), "twin:1");
    assert!(held.owner().starts_with("twin:"), "{}", held.owner());
    let fence = held.fence();
    held.release().await.unwrap();
    let next = b.try_acquire("k", once()).await.unwrap().expect("free");
    assert!(next.fence() > fence);
    next.release().await.unwrap();

    // A process on another pid with the same id is refused while `a` heartbeats.
    let registered = common::eventually(Duration::from_secs(10), || async {
        a.instances().await.iter().all(|(_, rows)| {
            rows.as_ref()
                .is_ok_and(|r| r.iter().any(|i| i.instance_id == "twin"))
        })
    })
    .await;
    assert!(registered, "a registered");
    let mut twin = Worker::spawn("worker", "twin", &[(common::CONFIG_ENV, yaml)]).unwrap();
    let said = twin.expect("refused ").await.unwrap();
    assert!(
        said.contains("instance.id") && said.contains("`twin` is live in the registry"),
        "{said}"
    );
}

async fn twin_worker() {
    let yaml = std::env::var(common::CONFIG_ENV).unwrap();
    match LockRouter::from_yaml_str(&yaml).await {
        Ok(_) => report!("started"),
        Err(e) => report!("refused {e}"),
    }
}

crate::worker_entry! { "twin" => twin_worker() }
