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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcquireOptions {
    pub(crate) namespace: Option<String>,
    pub(crate) ttl: Option<Duration>,
    pub(crate) wait: Option<Duration>,
    pub(crate) keep_alive: bool,
    pub(crate) at_least: Option<Duration>,
    /// In-memory hand-offs of this grant to later callers of this process (with reserved
    /// fences): off for elections, whose terms must be the fences of shard grants.
    pub(crate) handoffs: bool,
}

impl Default for AcquireOptions {
    fn default() -> Self {
        Self {
            namespace: None,
            ttl: None,
            wait: None,
            keep_alive: true,
            at_least: None,
            handoffs: true,
        }
    }
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

    /// Whether the lease is renewed in the background while the guard lives (the default).
    /// Without keep-alive it ends at its ttl unless [`crate::LockGuard::extend`] moves its end:
    /// for a holder that must not keep the lock forever if its loop hangs. The guard reports
    /// it lost ([`crate::LockGuard::lost`]) when it ends.
    pub fn keep_alive(mut self, keep_alive: bool) -> Self {
        self.keep_alive = keep_alive;
        self
    }

    /// The key stays taken for at least `at_least` after the grant (by the shard's clock), even
    /// when the guard is released earlier: a job that runs on a schedule and finishes fast
    /// cannot be run again by an instance whose clock or schedule lags. Until then the row
    /// shows the finished holder as its owner. Leases are not handed over in memory to or
    /// from such a hold; a hold in process (`LockMode::LocalFallback`) keeps the key from the
    /// process's other callers that long. If the holder dies first, the lease ends as any other does (at its
    /// ttl, see [`AcquireOptions::lock_at_most`]).
    pub fn lock_at_least(mut self, at_least: Duration) -> Self {
        self.at_least = Some(at_least);
        self
    }

    /// The lease ends `at_most` after the grant, whatever the holder does, unless it calls
    /// [`crate::LockGuard::extend`]: a ttl of `at_most` without keep-alive.
    pub fn lock_at_most(self, at_most: Duration) -> Self {
        self.ttl(at_most).keep_alive(false)
    }
}
