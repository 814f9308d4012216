//! Server sessions that may still run a statement sent before their connection broke: the
//! statement can sit in a kernel's buffers, or a network's, and reach the server after the
//! client gave up and retried (or gave its effect back) on another connection. A retry that
//! found its own row is followed by a release; the late statement would then grant the key
//! again, to an owner nobody holds. So a shard lists such sessions, and its next statement
//! first ends them and waits until they are gone.
//!
//! Only sessions told apart by a [`SessionId`] are listed: a plain shard's, each holding its
//! own lock, so that a thread id that names another client's session after a restart is
//! never ended.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mysql_async::prelude::Queryable;

use crate::pool::{SessionId, ShardConn};

/// The server's "unknown thread id": the session has ended already.
pub(crate) const ER_NO_SUCH_THREAD: u16 = 1094;

/// Stranded sessions kept at least (twice the pool's size when that is more): beyond that the
/// oldest are let go. Every pooled connection broken with a statement on the wire, twice over,
/// is a shard that has not answered anything since, stranded statements included.
pub(crate) const MOST_STRANDED: usize = 64;

/// How long a session stays listed when no connection to its server comes to look it up (the
/// shard's address moved to another server: a failover). A statement still in transit is
/// retransmitted for about a quarter of an hour at most (Linux's `tcp_retries2` default).
const LISTED_AT_MOST: Duration = Duration::from_secs(20 * 60);

/// How long a listed session holds up the shard's statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// Until it is gone: a lease statement, whose late arrival could grant a key after the
    /// retry or give-back meant to settle it. Ending is quick: the statement is short.
    UntilGone,
    /// Only until it is told to end: a session of the caller's own (a transaction lock's, the
    /// caller's SQL), whose statement touches no lease row, and whose rollback may take
    /// minutes that no lease statement should wait out.
    Killed,
}

/// One listed session.
#[derive(Debug, Clone, Copy)]
struct Entry {
    session: SessionId,
    ending: Ending,
    listed: Instant,
    /// When a `KILL` of it was first answered.
    killed: Option<Instant>,
}

/// The sessions a shard lists as stranded. Shared with the shard that replaces it in a
/// reload, whose pool reaches the same server.
#[derive(Debug, Default)]
pub(crate) struct StrandedSessions {
    list: Mutex<Vec<Entry>>,
    /// How many are listed: read by every statement, the list locked only when not 0.
    count: AtomicUsize,
}

/// A shard's list, with what listing needs: the shard's name and how many it keeps. A
/// connection lent for a session carries a clone (see [`crate::pool::SessionConn`]), to list
/// its own session.
#[derive(Debug, Clone)]
pub(crate) struct Lister {
    pub(crate) sessions: Arc<StrandedSessions>,
    shard: Arc<str>,
    /// At most this many listed (see [`StrandedSessions::strand`]).
    most: usize,
}

impl Lister {
    pub(crate) fn new(shard: &str, most: usize) -> Self {
        Self {
            sessions: Default::default(),
            shard: shard.into(),
            most,
        }
    }

    /// Lists `session`.
    pub(crate) fn strand(&self, session: SessionId, ending: Ending) {
        self.sessions
            .strand(&self.shard, session, ending, self.most);
    }
}

impl StrandedSessions {
    /// Whether any session is listed.
    pub(crate) fn any(&self) -> bool {
        self.count() > 0
    }

    /// How many sessions are listed.
    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Lists `session`, keeping at most `most`: beyond that the oldest is let go, with a
    /// warning, one listed [`Ending::Killed`] first; a session to be killed never pushes out
    /// one to be waited for.
    pub(crate) fn strand(&self, shard: &str, session: SessionId, ending: Ending, most: usize) {
        let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        if !list.iter().any(|e| e.session == session) {
            if list.len() >= most {
                // One only to be told to end goes first, the new one if need be: letting it go
                // may leave a row locked for longer, never a key granted late.
                let oldest = list.iter().position(|e| e.ending == Ending::Killed);
                tracing::warn!(shard, listed = list.len(), "shardlock let go of the oldest session whose statement may still reach the server");
                match (oldest, ending) {
                    (Some(oldest), _) => drop(list.remove(oldest)),
                    (None, Ending::UntilGone) => drop(list.remove(0)),
                    (None, Ending::Killed) => return,
                }
            }
            list.push(Entry {
                session,
                ending,
                listed: Instant::now(),
                killed: None,
            });
        }
        self.count.store(list.len(), Ordering::Relaxed);
    }

    /// Ends, from `conn`, every listed session of its server and waits until each listed
    /// [`Ending::UntilGone`] is gone, so that a statement still on its way to one never runs
    /// after this returns: not after a retry that found its own row, nor after the release
    /// that gave its effect back. A session listed [`Ending::Killed`] is forgotten once told
    /// to end.
    ///
    /// A session is ended only while the server says it holds its own lock. Sessions of
    /// another server stay listed for a connection to theirs, for [`LISTED_AT_MOST`]. Let go
    /// with a warning, since waiting on would fail every later statement of the shard: a
    /// session the server refuses to end (a user that may not) or to look up, and one still
    /// there `killed_for` after it was ended. When the connection fails, every session stays
    /// listed and the error is the try's.
    pub(crate) async fn end(
        &self,
        shard: &str,
        conn: &mut ShardConn,
        killed_for: Duration,
    ) -> mysql_async::Result<()> {
        // A connection whose session could not be told apart cannot look any up either.
        let Some(here) = conn.session().map(|s| s.server) else {
            return Ok(());
        };
        // Every try that finds sessions listed ends them itself, each listed until one try
        // has seen it gone: a try that ran while another try's `KILL` was still on the wire,
        // or its victim still finishing, could be overtaken by the very statement it follows.
        let mut pause = Duration::from_millis(1);
        loop {
            let now = Instant::now();
            let (stale, listed): (Vec<Entry>, Vec<Entry>) = self
                .list
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .partition(|e| {
                    now - e.listed > LISTED_AT_MOST
                        || e.killed.is_some_and(|at| now - at > killed_for)
                });
            if !stale.is_empty() {
                tracing::warn!(shard, sessions = stale.len(), "shardlock let go of sessions whose statements may still reach the server: not looked up, or not gone after being ended");
                self.forget(stale.iter().map(|e| e.session));
            }
            let there: Vec<Entry> = listed
                .into_iter()
                .filter(|e| e.session.server == here)
                .collect();
            if there.is_empty() {
                return Ok(());
            }
            let holders: Vec<String> = there
                .iter()
                .map(|e| format!("IS_USED_LOCK('{}')", e.session.lock_name()))
                .collect();
            let probe = format!("SELECT {}", holders.join(", "));
            let row: Option<mysql_async::Row> = match conn
                .run(|c| c.query_first(probe.as_str()))
                .await
            {
                Err(mysql_async::Error::Server(e)) => {
                    tracing::warn!(shard, error = %e, "shardlock could not look up sessions whose statements may still reach the server");
                    self.forget(there.iter().map(|e| e.session));
                    return Ok(());
                }
                answer => answer?,
            };
            let holder = |i: usize| {
                row.as_ref()
                    .and_then(|r| r.get_opt::<Option<u64>, _>(i))
                    .and_then(Result::ok)
                    .flatten()
            };
            let (alive, gone): (Vec<_>, Vec<_>) = there
                .iter()
                .enumerate()
                .partition(|&(i, e)| holder(i) == Some(u64::from(e.session.thread)));
            self.forget(gone.into_iter().map(|(_, e)| e.session));
            if alive.is_empty() {
                return Ok(());
            }
            let wait = alive.iter().any(|(_, e)| e.ending == Ending::UntilGone);
            for (_, entry) in alive.into_iter().filter(|(_, e)| e.killed.is_none()) {
                let thread = entry.session.thread;
                match conn
                    .run(|c| c.query_drop(format!("KILL CONNECTION {thread}")))
                    .await
                {
                    // Gone since the look-up: seen so by the next one.
                    Err(mysql_async::Error::Server(e)) if e.code == ER_NO_SUCH_THREAD => {}
                    Err(mysql_async::Error::Server(e)) => {
                        tracing::warn!(shard, thread, error = %e, "shardlock could not end a session whose statement may still reach the server");
                        self.forget([entry.session]);
                        continue;
                    }
                    Err(e) => return Err(e),
                    Ok(()) if entry.ending == Ending::Killed => {
                        self.forget([entry.session]);
                        continue;
                    }
                    Ok(()) => {}
                }
                self.killed(entry.session);
            }
            if !wait {
                return Ok(());
            }
            // A session ends a moment after it is told to: its statement, if one is running,
            // rolled back or committed first.
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Takes `sessions` off the list.
    fn forget(&self, sessions: impl IntoIterator<Item = SessionId>) {
        let sessions: Vec<SessionId> = sessions.into_iter().collect();
        let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        list.retain(|e| !sessions.contains(&e.session));
        self.count.store(list.len(), Ordering::Relaxed);
    }

    /// A `KILL` of `session` was answered.
    fn killed(&self, session: SessionId) {
        let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = list.iter_mut().find(|e| e.session == session) {
            entry.killed.get_or_insert_with(Instant::now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full list lets go of a session only to be told to end before any lease statement's,
    /// whose late arrival could grant a key.
    #[test]
    fn a_full_list_lets_go_of_a_session_only_to_be_told_to_end_first() {
        let list = StrandedSessions::default();
        let kept = |list: &StrandedSessions| -> Vec<u32> {
            let listed = list.list.lock().unwrap();
            listed.iter().map(|e| e.session.thread).collect()
        };
        list.strand("s", SessionId::of_thread(1), Ending::UntilGone, 2);
        list.strand("s", SessionId::of_thread(2), Ending::Killed, 2);
        list.strand("s", SessionId::of_thread(3), Ending::UntilGone, 2);
        assert_eq!(
            kept(&list),
            [1, 3],
            "the session only to be told to end goes"
        );
        list.strand("s", SessionId::of_thread(4), Ending::UntilGone, 2);
        assert_eq!(kept(&list), [3, 4], "then the oldest");
        list.strand("s", SessionId::of_thread(5), Ending::Killed, 2);
        assert_eq!(kept(&list), [3, 4], "never one to be waited for");
        assert_eq!(list.count(), 2);
    }
}
