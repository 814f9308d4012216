//! The other MySQL lock patterns teams use, routed by key over the same shards, through the
//! same breakers and with the same errors as lease locks:
//!
//! - [`LockRouter::lock_in_transaction`]: `SELECT ... FOR UPDATE` on a row of
//!   `shardlock_txlock` inside a transaction on a dedicated connection; your own SQL runs in that
//!   transaction ([`TxLockGuard::conn`]); commit, rollback or a dead connection releases it.
//! - [`LockRouter::cas_acquire`] / [`LockRouter::cas_release`]: compare-and-set on a version.
//! - [`LockRouter::transition`]: a state-machine claim on a row of *your* table, one
//!   conditional `UPDATE` judged by affected rows ([`StateMachine`]).
//! - [`LockRouter::claim_job`] and friends: claim the next due job of a queue in
//!   `shardlock_job`, with a lease after which a crashed worker's job is claimed again.

mod cas;
mod job;
mod state_machine;
mod tx_lock;

use std::sync::Arc;

use mysql_async::Conn;
use shardlock_core::{Error, LockKey, Result};
use shardlock_mysql::SessionConn;

use crate::shard::ShardState;
use crate::LockRouter;

pub use cas::CasGuard;
pub use job::{Job, JobKeeper};
pub use state_machine::StateMachine;
pub use tx_lock::TxLockGuard;

/// A connection to a key's shard for your own SQL (setting up a state machine's table next to
/// it, say), from [`LockRouter::shard_connection`]. Closed when dropped, never pooled again: a
/// statement of yours interrupted on it must not reach the next user.
#[derive(Debug)]
pub struct ShardConnection(Discard);

impl ShardConnection {
    /// The connection.
    pub fn raw(&mut self) -> &mut Conn {
        self.0 .0.as_mut().expect("open until dropped").raw()
    }
}

/// Closes a connection instead of pooling it, unless taken out first.
#[derive(Debug)]
struct Discard(Option<SessionConn>);

impl Drop for Discard {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            conn.discard();
        }
    }
}

impl LockRouter {
    /// The shard state of `key` in the topology in force.
    pub(crate) fn state_for(&self, key: &LockKey) -> Arc<ShardState> {
        self.inner.topology.load().locate(key).clone()
    }

    /// Where rows of `key` may be: its shard, then (while a reload's move is in progress) the
    /// shards it lived on before.
    fn placements(&self, key: &LockKey) -> Vec<Arc<ShardState>> {
        let topology = self.inner.topology.load_full();
        let mut shards = vec![topology.locate(key).clone()];
        shards.extend(topology.previous_locations(key));
        shards
    }

    /// A connection to the shard of `key`, for setting up a state machine's table next to it.
    /// It does not go through the shard's breaker (an operator's path), and it is closed when
    /// dropped.
    pub async fn shard_connection(&self, key: &str) -> Result<ShardConnection> {
        let key = LockKey::new(key)?;
        let shard = self.state_for(&key);
        let conn = shard
            .unguarded()
            .connection()
            .await
            .map_err(|e| e.into_error(shard.name()))?;
        Ok(ShardConnection(Discard(Some(conn))))
    }
}

/// The bytes a CAS owner or a job's claimer (`<worker>@<this router's claim>`) may take: their
/// columns' width, `VARBINARY(191)`.
const MAX_NAME_BYTES: usize = 191;

/// `Ok` when the argument `name` (`len` bytes), written as `written` bytes with what this
/// router adds to it, fits a column of `most`; else the error naming it, before any statement
/// (the server would refuse it as data too long, which reads as the shard failing).
fn check_fits(name: &'static str, len: usize, written: usize, most: usize) -> Result<()> {
    if written <= most {
        return Ok(());
    }
    let room = most.saturating_sub(written - len);
    Err(Error::InvalidArgument {
        name,
        reason: format!("{len} bytes; at most {room} fit in the column it is written to"),
    })
}

/// Whether a call that failed with `e` may have acted on its shard: anything but a shard
/// unreached where no try can have landed.
pub(super) fn may_have_acted(e: &Error) -> bool {
    match e {
        Error::Unavailable { source, .. } => source.maybe_applied,
        _ => true,
    }
}
