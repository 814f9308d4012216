//! The in-process queue per key: only one task of this process polls the shard for a key;
//! the others wait here, in memory, in FIFO order. When the holder releases, the next waiter
//! either gets the lease handed over (one statement that moves the row to it) or its turn to
//! poll.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::clock::Moment;
use tokio::sync::oneshot;

use crate::sync::LockExt;

/// What a waiter asks for, so that a hand-off can grant exactly that.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Want {
    pub(crate) ttl: Duration,
    pub(crate) renew_every: Duration,
    /// Fences to reserve for in-memory hand-offs after a shard grant.
    pub(crate) handoff_max_count: u32,
    /// How long in-memory hand-offs may follow a shard grant.
    pub(crate) handoff_max_time: Duration,
    /// How much faster than ours the shard's clock may run, in parts per million
    /// (`instance.clock-drift`): the local end of a lease comes that much earlier.
    pub(crate) drift_ppm: u32,
    /// How far apart the clocks of the servers that may decide the lease's expiry can be (a
    /// Galera shard's nodes: [`crate::shard::ShardState::clock_skew`]); the local end of a
    /// lease comes that much earlier.
    pub(crate) clock_skew: Duration,
    /// Renewed in the background while held; `false`: the lease ends at its ttl unless the
    /// holder extends it ([`crate::AcquireOptions::keep_alive`]).
    pub(crate) keep_alive: bool,
    /// The row stays taken at least this long after the grant, even if released earlier
    /// ([`crate::AcquireOptions::lock_at_least`]).
    pub(crate) at_least: Option<Duration>,
    /// Whether a waiter takes a grant handed over in memory (not a leadership: its term must
    /// be a shard grant's fence).
    pub(crate) handoffs: bool,
}

impl Want {
    /// Whether a lease granted for `self` may be handed over in memory to a waiter that wants
    /// `other`: the same ttl, both renewed (a lease without keep-alive ends where its first
    /// holder's extensions put it, no term of a later holder's), neither kept after its
    /// release, and a waiter that takes hand-offs, in memory at all (`handoff-max-count: 0`
    /// of its namespace: every grant through the shard).
    pub(crate) fn same_terms(&self, other: &Want) -> bool {
        self.ttl == other.ttl
            && self.keep_alive
            && other.keep_alive
            && self.at_least.is_none()
            && other.at_least.is_none()
            && other.handoffs
            && other.handoff_max_count > 0
    }

    pub(crate) fn ttl_ms(&self) -> u32 {
        u32::try_from(self.ttl.as_millis()).unwrap_or(u32::MAX)
    }

    /// The local end of a lease granted (or renewed) by a statement sent at `sent`: strictly
    /// before the shard can give the key to anyone else. The shard stores the ttl in whole
    /// milliseconds and `NOW(3)` truncates its clock to the millisecond (so the row may end up
    /// to 1 ms early by its own clock), the shard's clock may run faster than ours by up
    /// to `drift_ppm`, and another node of the shard may answer with a clock up to
    /// `clock_skew` ahead of the one that granted it.
    pub(crate) fn lease_end(&self, sent: Moment) -> Moment {
        self.end_of(sent, self.ttl, self.drift_ppm)
    }

    /// [`Want::lease_end`] of a statement for `ttl`, by a shard clock that may run up to
    /// `drift_ppm` faster than ours.
    pub(crate) fn end_of(&self, sent: Moment, ttl: Duration, drift_ppm: u32) -> Moment {
        Self::end_by(sent, ttl, drift_ppm, self.clock_skew)
    }

    /// [`Want::end_of`] with a node clock skew of `clock_skew` (a reload may raise it for a
    /// lease held: [`crate::shard::LeaseState::allow_skew`]).
    pub(crate) fn end_by(
        sent: Moment,
        ttl: Duration,
        drift_ppm: u32,
        clock_skew: Duration,
    ) -> Moment {
        let ms = u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX);
        let on_shard =
            Duration::from_millis(u64::from(ms)).saturating_sub(Duration::from_millis(1));
        let ours = on_shard.mul_f64(1.0 - f64::from(drift_ppm) / 1e6);
        sent + ours.saturating_sub(clock_skew)
    }

    /// A local moment surely past the end of a row kept taken `at_least` after a grant that
    /// came before `now`: the opposite bound of [`Want::end_by`] (the shard's clock may run
    /// slower than ours by up to `drift_ppm`, another node's clock may lag by `clock_skew`).
    pub(crate) fn kept_by(
        now: Moment,
        at_least: Duration,
        drift_ppm: u32,
        clock_skew: Duration,
    ) -> Moment {
        // A clock slower by `d` takes `at_least / (1 - d)` of ours to count `at_least` (the
        // config keeps `d` at most a half).
        let drift = (f64::from(drift_ppm) / 1e6).min(0.5);
        let ours = at_least.div_f64(1.0 - drift);
        now + ours + clock_skew + Duration::from_millis(1)
    }

    /// Whether a lease of these terms is too short for a shard whose nodes' clocks may be
    /// `clock_skew` apart (a Galera shard): it must outlast twice that, and its first renewal
    /// (a third of it) must come before its local end, the clock drift allowed too. (The
    /// config checks its namespaces' ttls; this, a ttl passed with a call.)
    pub(crate) fn too_short_for(&self, clock_skew: Duration) -> bool {
        let now = Moment::now();
        let lasts =
            Self::end_by(now, self.ttl, self.drift_ppm, clock_skew).saturating_duration_since(now);
        !clock_skew.is_zero() && (self.ttl <= clock_skew * 2 || lasts <= self.ttl / 3)
    }
}

/// What a waiter receives.
#[derive(Debug)]
pub(crate) enum Delivery {
    /// Its turn to poll the shard. `yield_first`: the key was just released because another
    /// process wants it, so give that process a moment before polling.
    Turn { turn: Turn, yield_first: bool },
    /// The lease itself, moved to this waiter by the releasing holder: its guard. The queue
    /// carries it without knowing the guard type (the guards sit above the queue); a guard
    /// that is never delivered is dropped, and its drop releases the lease.
    Granted(Box<dyn Any + Send>),
}

/// One queue per key that somebody in this process holds or waits for. An entry exists
/// exactly while the key is busy here, so memory is bounded by the keys in use.
#[derive(Debug, Default)]
pub(crate) struct KeyQueues {
    map: Mutex<HashMap<Arc<[u8]>, Queue>>,
    next_id: AtomicU64,
}

/// A busy key's waiters, and one shared copy of the key's bytes, which its turn and waiters
/// hold too: entering a busy key's queue copies no key (and hashes it once).
#[derive(Debug)]
struct Queue {
    key: Arc<[u8]>,
    waiters: VecDeque<Slot>,
}

#[derive(Debug)]
struct Slot {
    id: u64,
    tx: oneshot::Sender<Delivery>,
    want: Want,
}

/// The result of entering a key's queue.
#[derive(Debug)]
pub(crate) enum Entry {
    /// Nobody here was busy with the key: this task polls.
    Turn(Turn),
    /// Someone is: wait for a [`Delivery`].
    Queued(Waiter),
}

impl KeyQueues {
    pub(crate) fn enter(self: &Arc<Self>, key: &[u8], want: Want) -> Entry {
        let mut map = self.map.locked();
        // Looked up by the borrowed key: the map's `entry` would take an owned one.
        match map.get_mut(key) {
            None => {
                let key: Arc<[u8]> = Arc::from(key);
                let waiters = VecDeque::new();
                map.insert(
                    key.clone(),
                    Queue {
                        key: key.clone(),
                        waiters,
                    },
                );
                Entry::Turn(Turn {
                    queues: self.clone(),
                    key,
                    live: true,
                })
            }
            Some(queue) => {
                let (tx, rx) = oneshot::channel();
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                queue.waiters.push_back(Slot { id, tx, want });
                Entry::Queued(Waiter {
                    queues: self.clone(),
                    key: queue.key.clone(),
                    id,
                    rx,
                    done: false,
                })
            }
        }
    }

    /// Gives the key's turn to the next live waiter, or marks the key idle.
    fn pass_on(self: &Arc<Self>, key: &Arc<[u8]>, yield_first: bool) {
        loop {
            let slot = {
                let mut map = self.map.locked();
                let Some(queue) = map.get_mut(&**key) else {
                    return;
                };
                match queue.waiters.pop_front() {
                    Some(slot) => slot,
                    None => {
                        map.remove(&**key);
                        return;
                    }
                }
            };
            let turn = Turn {
                queues: self.clone(),
                key: key.clone(),
                live: true,
            };
            match slot.tx.send(Delivery::Turn { turn, yield_first }) {
                Ok(()) => return,
                // That waiter gave up meanwhile: try the next one.
                Err(Delivery::Turn { mut turn, .. }) => turn.live = false,
                Err(Delivery::Granted(_)) => unreachable!("a turn was sent"),
            }
        }
    }

    /// Tasks waiting in some key's queue now.
    pub(crate) fn waiting(&self) -> usize {
        self.map.locked().values().map(|q| q.waiters.len()).sum()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.locked().len()
    }
}

/// This task's turn on a key: while it lives, no other task of this process polls the shard
/// for the key. Dropping it passes the turn to the next waiter.
#[derive(Debug)]
pub(crate) struct Turn {
    queues: Arc<KeyQueues>,
    key: Arc<[u8]>,
    live: bool,
}

impl Turn {
    /// Takes the next waiter that still waits, so that the holder can hand it the lease or
    /// this turn. The key stays busy meanwhile.
    pub(crate) fn next_waiter(&self) -> Option<NextWaiter> {
        let mut map = self.queues.map.locked();
        let queue = map.get_mut(&*self.key)?;
        while let Some(slot) = queue.waiters.pop_front() {
            if !slot.tx.is_closed() {
                return Some(NextWaiter {
                    tx: slot.tx,
                    want: slot.want,
                });
            }
        }
        None
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if self.live {
            self.queues.pass_on(&self.key, false);
        }
    }
}

/// A waiter taken off the queue by [`Turn::next_waiter`]: give it the lease or the turn.
#[derive(Debug)]
pub(crate) struct NextWaiter {
    tx: oneshot::Sender<Delivery>,
    pub(crate) want: Want,
}

impl NextWaiter {
    /// Hands the waiter a lease (whose lease state carries the turn).
    pub(crate) fn grant(self, guard: impl Any + Send) {
        // If it gave up meanwhile, the guard comes back and dropping it releases the lease.
        drop(self.tx.send(Delivery::Granted(Box::new(guard))));
    }

    /// Gives the waiter the turn to poll.
    pub(crate) fn turn(self, turn: Turn, yield_first: bool) {
        // If it gave up meanwhile, the turn comes back and dropping it passes it on.
        drop(self.tx.send(Delivery::Turn { turn, yield_first }));
    }
}

/// A task waiting in a key's queue.
#[derive(Debug)]
pub(crate) struct Waiter {
    queues: Arc<KeyQueues>,
    key: Arc<[u8]>,
    id: u64,
    rx: oneshot::Receiver<Delivery>,
    done: bool,
}

impl Waiter {
    /// Waits for the lease or a turn. Cancel-safe: dropping the future (or the `Waiter`)
    /// leaves the queue, and anything already sent to it is released or passed on.
    pub(crate) async fn wait(&mut self) -> Option<Delivery> {
        let handoff = (&mut self.rx).await.ok();
        self.done = true;
        handoff
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Never a panic in drop: a map poisoned by another task's panic is still consistent
        // (every change to it is one insert or removal).
        let mut map = self.queues.map.locked();
        if let Some(queue) = map.get_mut(&*self.key) {
            queue.waiters.retain(|s| s.id != self.id);
        }
        drop(map);
        self.rx.close();
        // Sent before we left: dropping it passes the turn on or releases the lease.
        drop(self.rx.try_recv());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want() -> Want {
        Want {
            ttl: Duration::from_secs(1),
            renew_every: Duration::from_millis(300),
            handoff_max_count: 8,
            handoff_max_time: Duration::from_millis(20),
            drift_ppm: 10_000,
            clock_skew: Duration::ZERO,
            keep_alive: true,
            at_least: None,
            handoffs: true,
        }
    }

    /// The local end allows for the ms truncation, the drift and, on a replicated shard,
    /// the nodes' clock skew.
    #[test]
    fn a_lease_ends_locally_before_any_server_may_end_it() {
        let sent = Moment::now();
        // 1 s less 1 ms, less 1%.
        assert_eq!(
            want().lease_end(sent),
            sent + Duration::from_micros(989_010)
        );
        let skewed = Want {
            clock_skew: Duration::from_millis(500),
            ..want()
        };
        assert_eq!(
            skewed.lease_end(sent),
            sent + Duration::from_micros(489_010)
        );
    }

    /// A row kept taken `at_least` by a shard clock that runs slower than ours by the drift
    /// allowed lasts `at_least / (1 - drift)` of ours: its local end is past that (and the
    /// millisecond of truncation).
    #[test]
    fn a_kept_row_ends_locally_after_a_slow_shard_clock_ends_it() {
        let now = Moment::now();
        let hour = Duration::from_secs(3600);
        // 1% slower: 3600 s / 0.99 = 3636.36 s, more than 3600 s × 1.01 = 3636 s.
        let w = want();
        let past = Want::kept_by(now, hour, w.drift_ppm, w.clock_skew);
        assert!(past > now + hour.div_f64(0.99), "{:?}", past - now);
    }

    fn turn_of(e: Entry) -> Turn {
        match e {
            Entry::Turn(t) => t,
            Entry::Queued(_) => panic!("expected a turn"),
        }
    }

    fn waiter_of(e: Entry) -> Waiter {
        match e {
            Entry::Queued(w) => w,
            Entry::Turn(_) => panic!("expected to wait"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn turns_pass_in_fifo_order_and_cancelled_waiters_are_skipped() {
        let q = Arc::new(KeyQueues::default());
        let first = turn_of(q.enter(b"k", want()));
        let mut second = waiter_of(q.enter(b"k", want()));
        let third = waiter_of(q.enter(b"k", want()));
        let mut fourth = waiter_of(q.enter(b"k", want()));
        drop(third); // gives up while waiting
        assert!(
            tokio::time::timeout(Duration::from_millis(10), second.wait())
                .await
                .is_err()
        );
        drop(first);
        let Some(Delivery::Turn {
            turn: t2,
            yield_first: false,
        }) = second.wait().await
        else {
            panic!()
        };
        let handover = t2.next_waiter().expect("fourth waits");
        handover.turn(t2, true);
        let Some(Delivery::Turn {
            turn: t4,
            yield_first: true,
        }) = fourth.wait().await
        else {
            panic!()
        };
        drop(t4);
        assert_eq!(q.len(), 0, "idle keys leave no entry");
    }

    #[tokio::test(start_paused = true)]
    async fn a_turn_sent_to_a_waiter_that_just_left_is_passed_on() {
        let q = Arc::new(KeyQueues::default());
        let first = turn_of(q.enter(b"k", want()));
        let second = waiter_of(q.enter(b"k", want()));
        let mut third = waiter_of(q.enter(b"k", want()));
        let handover = first.next_waiter().expect("second waits");
        handover.turn(first, false); // delivered to `second`...
        drop(second); // ...which is dropped before reading it
        let Some(Delivery::Turn { turn, .. }) = third.wait().await else {
            panic!()
        };
        drop(turn);
        assert_eq!(q.len(), 0);
    }
}
