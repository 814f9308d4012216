//! Two routers configured with one instance id (a copy-pasted config, an old incarnation
//! still running): the second one is refused at start, in this process or another, and the
//! owners of two starts under one id never collide.

mod common;

use std::time::Duration;

use shardlock::{AcquireOptions, Error, LockRouter};
use shardlock_testkit::{report, Worker};

const TWIN: &str = "instance:\n  id: twin\n";

#[tokio::test(flavor = "multi_thread")]
async fn two_routers_with_one_instance_id_never_share_an_owner() {
    let (cluster, _router, _) = common::start(2, "").await;
    let yaml = cluster.config_yaml(TWIN);
    let a = LockRouter::from_yaml_str(&yaml).await.unwrap();
    // Another router of this same process is refused the id while `a` lives: the registry
    // keeps one row per id, so neither would see the other's topology in a reload.
    let refused = LockRouter::from_yaml_str(&yaml).await.unwrap_err();
    assert!(
        matches!(
            refused,
            Error::InvalidArgument {
                name: "instance.id",
                ..
            }
        ) && refused
            .to_string()
            .contains("another router of this process"),
        "{refused}"
    );
    let once = || AcquireOptions::new().wait(Duration::ZERO);
    let held = a.acquire("k", once()).await.unwrap();
    assert_ne!(held.owner(), "twin:1");
    assert!(held.owner().starts_with("twin:"), "{}", held.owner());

    // A process on another pid with the same id is refused while `a` heartbeats.
    let registered = common::eventually(Duration::from_secs(10), || async {
        a.instances().await.iter().all(|(_, rows)| {
            rows.as_ref()
                .is_ok_and(|r| r.iter().any(|i| i.instance_id == "twin"))
        })
    })
    .await;
    assert!(registered, "a registered");
    let mut twin = Worker::spawn("worker", "twin", &[(common::CONFIG_ENV, yaml.clone())]).unwrap();
    let said = twin.expect("refused ").await.unwrap();
    assert!(
        said.contains("instance.id") && said.contains("`twin` is live in the registry"),
        "{said}"
    );

    // Shut down, `a` gives the id back; the next router of this process under it is a new
    // start whose owners never look like `a`'s, and whose fences go on rising.
    let (owner, fence) = (held.owner().to_owned(), held.fence());
    a.shutdown().await.unwrap();
    let b = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let next = b.try_acquire("k", once()).await.unwrap().expect("free");
    assert!(
        next.owner().starts_with("twin:") && next.owner() != owner,
        "{}",
        next.owner()
    );
    assert!(next.fence() > fence);
    next.release().await.unwrap();
}

async fn twin_worker() {
    let yaml = std::env::var(common::CONFIG_ENV).unwrap();
    match LockRouter::from_yaml_str(&yaml).await {
        Ok(_) => report!("started"),
        Err(e) => report!("refused {e}"),
    }
}

crate::worker_entry! { "twin" => twin_worker() }
