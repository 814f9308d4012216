//! TLS to shards, against a MariaDB that refuses plaintext (`require_secure_transport`) and
//! serves a certificate made at test time for `localhost` only: each MySQL ssl mode does what
//! its name says (verify-ca: the chain, any name; verify-identity: the chain and the name), a
//! client certificate reaches a user that requires one, and every refusal
//! names the shard and says why.

use shardlock::{AcquireOptions, Error, LockRouter};
use shardlock_testkit::{Cluster, TestCerts, DATABASE};

/// One shard serving TLS with `certs`, set up by `setup`, then refusing plaintext connections.
async fn tls_shard(certs: &TestCerts, setup: &[String]) -> Cluster {
    use shardlock::mysql_async::prelude::Queryable;
    let cluster = Cluster::start_with_args(1, &certs.server_args())
        .await
        .unwrap();
    let mut conn = cluster.shard(0).connect().await.unwrap();
    for statement in setup {
        conn.query_drop(statement).await.unwrap();
    }
    conn.query_drop("SET GLOBAL require_secure_transport = ON")
        .await
        .unwrap();
    conn.disconnect().await.unwrap();
    cluster
}

/// A config for the shard, reached at `host`, with `tls` as its `tls:` section.
fn config(cluster: &Cluster, host: &str, user: &str, tls: &str) -> String {
    let port = cluster.shard(0).port();
    format!(
        "shards:\n  - name: s1\n    url: mysql://{user}@{host}:{port}/{DATABASE}\n    \
         pool:\n      create-timeout: 5s\n    tls:\n{tls}\
         cleaner:\n  registry: static\n"
    )
}

fn tls(mode: &str, ca: Option<&std::path::Path>) -> String {
    let mut section = format!("      mode: {mode}\n");
    if let Some(ca) = ca {
        section.push_str(&format!("      ca-file: {}\n", ca.display()));
    }
    section
}

/// Migrates and takes a lock through `yaml`'s shard.
async fn lock_through(yaml: &str) -> shardlock::Result<()> {
    let router = LockRouter::from_yaml_str(yaml).await?;
    router.migrate().await?;
    let guard = router.acquire("tls:1", AcquireOptions::new()).await?;
    guard.release().await?;
    router.shutdown().await
}

/// The refusal of `yaml`'s shard, naming `s1`, as one line: `Unavailable` for a connection
/// that failed (TLS), `Backend` for a server that answered no (a login refused). Asked twice,
/// through an operator's call (migrate) and through a lock (acquire, whose statements go in
/// batches): both say why.
async fn refusal(yaml: &str) -> String {
    let router = LockRouter::from_yaml_str(yaml).await.unwrap();
    let migrate = router.migrate().await.unwrap_err();
    let acquire = router
        .try_acquire("tls:refused", AcquireOptions::new())
        .await
        .unwrap_err();
    let mut said = Vec::new();
    for err in [migrate, acquire] {
        let text = err.report().to_string();
        assert!(
            matches!(&err, Error::Unavailable { shard, .. } | Error::Backend { shard, .. } if shard == "s1"),
            "{text}"
        );
        assert!(text.contains("shard `s1`"), "{text}");
        said.push(text);
    }
    // The cause, past its kind, is the same both ways.
    let cause = |text: &str| text.rsplit(": ").next().unwrap_or_default().to_owned();
    assert_eq!(cause(&said[0]), cause(&said[1]), "{said:?}");
    said.remove(1)
}

#[tokio::test(flavor = "multi_thread")]
async fn each_ssl_mode_connects_or_refuses_as_its_name_says() {
    let certs = TestCerts::generate().unwrap();
    let cluster = tls_shard(&certs, &[]).await;
    let ca = certs.ca();

    // verify-identity: the CA signed it and it is issued for `localhost`.
    let verified = config(
        &cluster,
        "localhost",
        "root",
        &tls("verify-identity", Some(&ca)),
    );
    lock_through(&verified).await.unwrap();
    // ... reached as 127.0.0.1, with the name it is issued for.
    let named = format!(
        "{}      server-name: localhost\n",
        tls("verify-identity", Some(&ca))
    );
    lock_through(&config(&cluster, "127.0.0.1", "root", &named))
        .await
        .unwrap();
    // required checks no certificate.
    lock_through(&config(
        &cluster,
        "127.0.0.1",
        "root",
        &tls("required", None),
    ))
    .await
    .unwrap();
    // verify-ca checks the chain, not the name: the certificate for `localhost` is fine at
    // 127.0.0.1 (where verify-identity refuses it, below), and at `localhost`.
    for host in ["127.0.0.1", "localhost"] {
        lock_through(&config(
            &cluster,
            host,
            "root",
            &tls("verify-ca", Some(&ca)),
        ))
        .await
        .unwrap_or_else(|e| panic!("verify-ca at {host}: {}", e.report()));
    }
    // ... and a CA that did not sign it is refused.
    let said = refusal(&config(
        &cluster,
        "127.0.0.1",
        "root",
        &tls("verify-ca", Some(&certs.other_ca())),
    ))
    .await;
    assert!(said.contains("certificate"), "verify-ca, wrong CA: {said}");

    // A CA that did not sign the server's certificate.
    let other = tls("verify-identity", Some(&certs.other_ca()));
    let said = refusal(&config(&cluster, "localhost", "root", &other)).await;
    assert!(said.contains("certificate"), "wrong CA: {said}");
    // A certificate for `localhost`, reached as 127.0.0.1.
    let mismatch = tls("verify-identity", Some(&ca));
    let said = refusal(&config(&cluster, "127.0.0.1", "root", &mismatch)).await;
    assert!(said.contains("certificate"), "host name mismatch: {said}");
    assert_ne!(
        said,
        refusal(&config(&cluster, "localhost", "root", &other)).await
    );
    // Plaintext, which the server refuses (MariaDB answers "access denied" to the very login
    // that `required` above was let in with).
    let said = refusal(&config(
        &cluster,
        "127.0.0.1",
        "root",
        &tls("disabled", None),
    ))
    .await;
    assert!(said.contains("MySQL error 1045"), "plaintext: {said}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_certificate_reaches_a_user_that_requires_one() {
    let certs = TestCerts::generate().unwrap();
    let setup = [
        "CREATE USER 'x509'@'%' REQUIRE X509".to_owned(),
        format!("GRANT ALL ON {DATABASE}.* TO 'x509'@'%'"),
    ];
    let cluster = tls_shard(&certs, &setup).await;
    let (cert, key) = certs.client();
    let with_cert = format!(
        "{}      cert-file: {}\n      key-file: {}\n",
        tls("required", None),
        cert.display(),
        key.display()
    );
    lock_through(&config(&cluster, "127.0.0.1", "x509", &with_cert))
        .await
        .unwrap();
    let said = refusal(&config(
        &cluster,
        "127.0.0.1",
        "x509",
        &tls("required", None),
    ))
    .await;
    assert!(
        said.contains("Access denied"),
        "without the certificate: {said}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn preferred_falls_back_to_plaintext_where_required_refuses() {
    // A shard that offers no TLS at all.
    let cluster = Cluster::start(1).await.unwrap();
    lock_through(&config(
        &cluster,
        "127.0.0.1",
        "root",
        &tls("preferred", None),
    ))
    .await
    .unwrap();
    let said = refusal(&config(
        &cluster,
        "127.0.0.1",
        "root",
        &tls("required", None),
    ))
    .await;
    assert!(said.contains("SSL") || said.contains("TLS"), "{said}");
}
