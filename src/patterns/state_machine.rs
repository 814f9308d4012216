//! State-machine claims: one conditional `UPDATE` on a row of the caller's table.

use shardlock_core::{Error, LockKey, Result};
use shardlock_mysql::StateTable;

use crate::LockRouter;

/// A state machine over a row of the caller's table: which column identifies the row, which
/// holds its state, and which transitions are allowed. Names are checked when declared (they
/// are the only parts of the statement that are not bound parameters).
#[derive(Debug, Clone)]
pub struct StateMachine {
    table: StateTable,
    transitions: Vec<(String, String)>,
}

impl StateMachine {
    /// A machine on `table` (rows found by `id_column`, state in `state_column`).
    pub fn new(table: &str, id_column: &str, state_column: &str) -> Result<Self> {
        Ok(Self {
            table: StateTable::new(table, id_column, state_column)?,
            transitions: Vec::new(),
        })
    }

    /// Allows `from` → `to`.
    pub fn allow(mut self, from: &str, to: &str) -> Self {
        self.transitions.push((from.to_owned(), to.to_owned()));
        self
    }
}

impl LockRouter {
    /// Moves row `id` of the machine's table (on the shard of key `id`, or while a reload's
    /// move is in progress on a shard it lived on before) from `from` to `to` in one
    /// conditional `UPDATE`; `true` when this call made the transition, `false` when
    /// the row was not in `from` (someone else moved it first, or it is done). Transitions the
    /// machine does not allow, and self-transitions, are refused before touching the shard;
    /// one between states the state column's collation takes for one (`locked` and `LOCKED`
    /// in a case-insensitive column, a trailing space) answers `false` to every caller.
    ///
    /// During a move the row found on the key's shard answers, in whatever state: a copy
    /// left on a shard the key lived on before is tried only when the key's shard has no row.
    /// That narrows, but cannot close, the time in which a row on both shards is won on each
    /// (a copy inserted between the two reads; a process that has not reloaded yet tries only
    /// the old shard). Move a row so: first transition it where it is into a state that no
    /// transition leaves (say `moved`), then insert it on the new shard, then delete the old.
    ///
    /// If the connection breaks after the statement may have reached the shard, the call is
    /// not retried (a retry could not tell its own transition from another's): the error
    /// says the outcome is unknown. The row's state cannot tell either: a row in `to` may be
    /// another caller's transition. If a transition must be known as the caller's, make `to`
    /// name the caller (a state per worker), or claim the work with
    /// [`LockRouter::claim_job`], whose retry learns what its lost try did.
    ///
    /// Cancellation: the `UPDATE` may have reached the shard and committed: the row may be in `to`
    /// without this call saying so, and a new call then answers `false` (as above, the row's
    /// state does not tell whose transition it was).
    pub async fn transition(
        &self,
        machine: &StateMachine,
        id: &str,
        from: &str,
        to: &str,
    ) -> Result<bool> {
        if from == to {
            return Err(Error::InvalidArgument {
                name: "transition",
                reason: format!(
                    "{from} -> {to} changes nothing, so it cannot tell a winner from a loser"
                ),
            });
        }
        if !machine
            .transitions
            .iter()
            .any(|(f, t)| f == from && t == to)
        {
            return Err(Error::InvalidArgument {
                name: "transition",
                reason: format!("{from} -> {to} is not allowed on {}", machine.table.name()),
            });
        }
        let key = LockKey::new(id)?;
        self.check_joined(&key)?;
        // The row lives on the key's shard; while a move is in progress it may still be on
        // a shard the key lived on before (the application moves its rows with its keys).
        let placements = self.placements(&key);
        for (i, shard) in placements.iter().enumerate() {
            // Not retried once it may have reached the server: a retry could not tell our own
            // transition from someone else's (the error then says the outcome is unknown).
            let moved = shard
                .run(|b| b.transition(&machine.table, id, from, to))
                .await?;
            if moved {
                return Ok(true);
            }
            // Where the row is, its state answers: a copy the application left on a shard the
            // key lived on before (copied, not yet deleted) may still be in `from` there, and
            // a second caller would win that one too. (Nothing was transitioned when this read
            // fails, whatever its error says of the read.)
            let older_left = i + 1 < placements.len();
            let here = older_left
                && shard
                    .run(|b| b.state_row_exists(&machine.table, id))
                    .await
                    .map_err(|e| match e {
                        Error::Unavailable { shard, mut source } => {
                            source.maybe_applied = false;
                            Error::Unavailable { shard, source }
                        }
                        other => other,
                    })?;
            if here {
                // Inserted since the `UPDATE` above, perhaps: asked once more where it is.
                return shard
                    .run(|b| b.transition(&machine.table, id, from, to))
                    .await;
            }
        }
        Ok(false)
    }
}
