//! Listing leases across every shard, and the data a holder stores with its lease.

use shardlock_core::{Error, LockKey, Result};
use shardlock_mysql::{LeaseRow, ListFilter, MAX_DATA_BYTES};

use crate::{LockGuard, LockRouter};

/// Most leases one [`LockRouter::list`] returns unless told otherwise.
pub const DEFAULT_LIST_LIMIT: usize = 1000;

/// Which leases [`LockRouter::list`] returns.
///
/// ```
/// let opts = shardlock::ListOptions::new().namespace("billing").prefix("order:").held_only();
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListOptions {
    prefix: String,
    namespace: Option<String>,
    held_only: bool,
    limit: usize,
}

impl Default for ListOptions {
    fn default() -> Self {
        Self {
            prefix: String::new(),
            namespace: None,
            held_only: false,
            limit: DEFAULT_LIST_LIMIT,
        }
    }
}

impl ListOptions {
    /// Every lease row (held, expired or released), up to [`DEFAULT_LIST_LIMIT`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Keys starting with `prefix` (after the namespace's `key-prefix`, if one is set).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Keys of `namespace`'s scope: those under its `key-prefix` (a namespace without one has
    /// no scope of its own: every key).
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// Live leases only.
    pub fn held_only(mut self) -> Self {
        self.held_only = true;
        self
    }

    /// At most `limit` leases, the first in key order.
    pub fn limit(mut self, limit: usize) -> Self {
        self.limit = limit;
        self
    }
}

/// One lease row found by [`LockRouter::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListedLease {
    /// The shard it is on (a key that moved in a reload may have rows on two).
    pub shard: String,
    /// The lock's key with its namespace's prefix; for a key over 255 bytes, which is stored as
    /// a digest, its label (`#` and 16 hex digits, as telemetry shows it).
    pub key: String,
    /// The bucket, for a bucket of a hot key.
    pub bucket: Option<u32>,
    /// The row: holder, fence, times, data.
    pub row: LeaseRow,
}

/// What [`LockRouter::list`] found.
#[derive(Debug)]
#[non_exhaustive]
pub struct Listing {
    /// The leases, in key order (then shard order).
    pub leases: Vec<ListedLease>,
    /// Shards that could not be read, with why: their leases are missing above.
    pub failed: Vec<(String, Error)>,
    /// Whether more leases matched than the limit let through.
    pub truncated: bool,
}

impl LockRouter {
    /// Lease rows on every shard (those a reload is moving keys away from included), in the
    /// byte order of their keys: their holders, fences, times left and data. Keys stored as
    /// digests (over 255 bytes) come last and match only the empty prefix. A read only; a shard that cannot be read is
    /// reported in [`Listing::failed`], not as an error of the whole call.
    pub async fn list(&self, opts: ListOptions) -> Result<Listing> {
        let mut prefix = match &opts.namespace {
            Some(_) => {
                let ns_opts = crate::AcquireOptions {
                    namespace: opts.namespace.clone(),
                    ..Default::default()
                };
                self.namespace_of(&ns_opts)?.key_prefix.unwrap_or_default()
            }
            None => String::new(),
        };
        prefix.push_str(&opts.prefix);
        let filter = ListFilter {
            prefix: prefix.into_bytes(),
            held_only: opts.held_only,
            // One more than asked, to tell whether there were more.
            limit: opts.limit.saturating_add(1),
        };
        let topology = self.inner.topology.load_full();
        let mut leases = Vec::new();
        let mut failed = Vec::new();
        // Not a shard that left and was drained: nothing of this process is held there.
        for shard in topology.all_shards().iter().filter(|s| !s.is_closed()) {
            match shard.unguarded().list(&filter).await {
                Ok(rows) => leases.extend(rows.into_iter().map(|(stored, row)| {
                    let (key, bucket) = LockKey::describe_stored(&stored);
                    (
                        stored,
                        ListedLease {
                            shard: shard.name().to_owned(),
                            key,
                            bucket,
                            row,
                        },
                    )
                })),
                Err(e) => failed.push((shard.name().to_owned(), e.into_error(shard.name()))),
            }
        }
        leases.sort_by(|a, b| (&a.0, &a.1.shard).cmp(&(&b.0, &b.1.shard)));
        let truncated = leases.len() > opts.limit;
        leases.truncate(opts.limit);
        Ok(Listing {
            leases: leases.into_iter().map(|(_, lease)| lease).collect(),
            failed,
            truncated,
        })
    }
}

impl LockGuard {
    /// Stores `data` (up to [`MAX_DATA_BYTES`] bytes) with the lease, replacing what was
    /// stored before: [`LockRouter::inspect`] and [`LockRouter::list`] show it while this grant
    /// holds the key (a later grant never shows it). Grants handed over in memory share the
    /// row, and so its data.
    ///
    /// Returns [`Error::LockLost`] when the lease is no longer ours, and
    /// [`Error::InvalidArgument`] for data too long or a
    /// [`crate::LockMode::LocalFallback`] guard (it has no row).
    pub async fn set_data(&self, data: &[u8]) -> Result<()> {
        if data.len() > MAX_DATA_BYTES {
            return Err(Error::InvalidArgument {
                name: "data",
                reason: format!(
                    "{} bytes; at most {MAX_DATA_BYTES} are stored with a lease",
                    data.len()
                ),
            });
        }
        let hold = self.hold();
        if hold.lease.local {
            return Err(Error::InvalidArgument {
                name: "data",
                reason: "an in-process lock (the shard is unavailable) has no row to store it in"
                    .into(),
            });
        }
        let (key, owner) = (hold.lease.key.stored(), hold.lease.owner.as_str());
        match hold.shard.call_row(|b| b.set_data(key, owner, data)).await {
            Ok(true) => Ok(()),
            Ok(false) => {
                hold.lease.mark_lost(
                    "ended or taken over before its data was stored",
                    &hold.shard.shared,
                );
                Err(self.lost_error())
            }
            Err(e) => Err(e.into_error(hold.shard.name())),
        }
    }
}
