//! Per-call options for acquiring a lock.

use std::time::Duration;

/// How to acquire one lock. Anything not set comes from the namespace's policy.
///
/// ```
/// use std::time::Duration;
/// let opts = shardlock::AcquireOptions::new()
///     .namespace("stock")
///     .ttl(Duration::from_secs(10))
///     .wait(Duration::from_secs(2));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AcquireOptions {
    pub(crate) namespace: Option<String>,
    pub(crate) ttl: Option<Duration>,
    pub(crate) wait: Option<Duration>,
}

impl AcquireOptions {
    /// Options that take everything from the `default` namespace.
    pub fn new() -> Self {
        Self::default()
    }

    /// The namespace whose policy applies (`default` if not set).
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// The lease length, overriding the namespace's `ttl`.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// How long `acquire` may wait for the lock; zero tries once.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }
}
