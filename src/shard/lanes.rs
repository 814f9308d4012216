//! The shard's dispatcher: acquires and releases that arrive while the shard's statements of
//! their kind are in flight wait in a lane and go together, as one batch, when a runner frees
//! up (group commit, without a timer).
//!
//! A lane lets a few runners work at once (`pool.batches-in-flight`): a request that finds
//! fewer running starts one, which sends it at once — a lone caller pays one round trip and
//! nothing more. Requests that arrive while all runners are busy queue, and the next runner
//! to finish takes every one of them (up to [`MAX_BATCH`] keys) into one statement. So
//! batches grow exactly when the shard is busy, which is when its per-statement cost is what
//! limits throughput.
//! When the queue grows deep all the same ([`DEEP_QUEUE`] requests), one more runner starts
//! for it, up to [`Runners::most`], and the shard is given more statements to work on at once,
//! so that its cores do not wait between round trips; such an extra runner ends as soon as
//! the queue is short again.
//!
//! Each request's caller waits on its own answer. Runners are tasks of their own: a caller
//! that gives up (its wait ended, its future was dropped) leaves its request to be answered
//! to nobody, and the acquire path behind it gives a grant it no longer wants back, as it does
//! for a single statement (see `acquire/attempt.rs`).

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardlock_core::{BackendError, BackendErrorKind};
use shardlock_mysql::{Attempt, BatchGrants, GrantRequest, ReleaseAnswer, MAX_BATCH};
use tokio::sync::oneshot;

use super::{acquire_timing, ShardState};
use crate::sync::LockExt;

/// Where a caller waits for its request's answer.
pub(crate) type Answer<O> = oneshot::Receiver<Result<O, BackendError>>;

/// A request in a lane, with where its answer goes.
#[derive(Debug)]
pub(super) struct Waiting<R, O> {
    pub(super) request: R,
    pub(super) answer: oneshot::Sender<Result<O, BackendError>>,
}

/// Requests of one kind waiting for a statement, and how many runners send them.
#[derive(Debug)]
pub(super) struct Lane<R, O> {
    state: Mutex<LaneState<R, O>>,
}

#[derive(Debug)]
struct LaneState<R, O> {
    queue: VecDeque<Waiting<R, O>>,
    running: usize,
}

impl<R, O> Default for Lane<R, O> {
    fn default() -> Self {
        Self {
            state: Mutex::new(LaneState {
                queue: VecDeque::new(),
                running: 0,
            }),
        }
    }
}

/// Requests waiting that make a lane's queue deep: a push that makes the queue this long
/// starts one more runner (see [`Runners`]). While more than the steady runners run, a runner
/// that finds fewer waiting ends, so the extra ones only ever take a batch from a deep queue.
pub(super) const DEEP_QUEUE: usize = 8;

/// How many runners a lane may have at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Runners {
    /// At any time: `pool.batches-in-flight`.
    pub(super) steady: usize,
    /// While [`DEEP_QUEUE`] requests or more wait: up to twice `steady`, the extra runners of
    /// both lanes taking at most half of what the steady ones leave of the pool (none while
    /// that is under 4), so that renewals, give-backs and callers' own statements still find
    /// connections.
    pub(super) most: usize,
}

impl Runners {
    /// The runners of a shard with `batches_in_flight` (at least 1) and a pool of `pool_size`.
    pub(super) fn new(batches_in_flight: usize, pool_size: usize) -> Self {
        let steady = batches_in_flight.max(1);
        let spare = pool_size.saturating_sub(2 * steady);
        Self {
            steady,
            most: steady + steady.min(spare / 4),
        }
    }
}

impl<R, O> Lane<R, O> {
    /// Queues `request`; returns the receiver of its answer, and whether the caller must start
    /// a runner (the new one is counted already): when fewer than `runners.steady` run, or
    /// when the queue is now [`DEEP_QUEUE`] long and fewer than `runners.most` run.
    pub(super) fn push(&self, request: R, runners: Runners) -> (Answer<O>, bool) {
        let (answer, rx) = oneshot::channel();
        let mut state = self.state.locked();
        state.queue.push_back(Waiting { request, answer });
        let deep = state.queue.len() >= DEEP_QUEUE && state.running < runners.most;
        let start = state.running < runners.steady || deep;
        if start {
            state.running += 1;
        }
        (rx, start)
    }

    /// Counts the caller in as a runner of its own request when nothing waits and fewer than
    /// `runners.steady` run: a lone request is then sent by its caller, without a task hop.
    /// The caller must call [`Lane::leave`] when done (whether to start a runner for what
    /// queued meanwhile is its answer).
    pub(super) fn enter_alone(&self, runners: Runners) -> bool {
        let mut state = self.state.locked();
        let alone = state.queue.is_empty() && state.running < runners.steady;
        if alone {
            state.running += 1;
        }
        alone
    }

    /// Ends a lone request's run (see [`Lane::enter_alone`]); `true` when requests queued
    /// meanwhile and the caller must start a runner for them (already counted).
    pub(super) fn leave(&self) -> bool {
        let mut state = self.state.locked();
        if state.queue.is_empty() {
            state.running -= 1;
            false
        } else {
            true
        }
    }

    /// The next batch for a runner: the waiting requests in arrival order, up to
    /// [`MAX_BATCH`], one per key (a later request for a key already in the batch waits for
    /// the next one); with `skip_gone`, requests whose caller has gone are dropped unsent.
    /// `None` when nothing is left to send, or when more than `runners.steady` run and fewer
    /// than [`DEEP_QUEUE`] wait (the steady runners take those): the runner then ends,
    /// counted out under the same lock that [`Lane::push`] counts under, so no request is
    /// left without a runner.
    pub(super) fn next_batch(
        &self,
        key: impl Fn(&R) -> &[u8],
        skip_gone: bool,
        runners: Runners,
    ) -> Option<Vec<Waiting<R, O>>> {
        let mut state = self.state.locked();
        if state.running > runners.steady && state.queue.len() < DEEP_QUEUE {
            state.running -= 1;
            return None;
        }
        let mut batch = Vec::new();
        let mut later = VecDeque::new();
        let mut keys = HashSet::new();
        while let Some(waiting) = state.queue.pop_front() {
            if skip_gone && waiting.answer.is_closed() {
                continue;
            }
            if batch.len() < MAX_BATCH && keys.insert(key(&waiting.request).to_vec()) {
                batch.push(waiting);
            } else {
                later.push_back(waiting);
            }
        }
        // Requests stay behind only beside a batch: an empty one means an empty queue.
        state.queue = later;
        if batch.is_empty() {
            state.running -= 1;
            return None;
        }
        Some(batch)
    }

    /// Counts out a runner that ended without [`Lane::next_batch`] doing it: it panicked, or
    /// its task was cancelled (or never ran) with its runtime. Else the count would stay taken
    /// and, once every slot leaked, requests would queue with nobody to send them. When it was
    /// the last runner, the requests still queued have nobody to send them either: they are
    /// returned, to be answered.
    fn count_out(&self) -> VecDeque<Waiting<R, O>> {
        let mut state = self.state.locked();
        state.running = state.running.saturating_sub(1);
        if state.running == 0 {
            std::mem::take(&mut state.queue)
        } else {
            VecDeque::new()
        }
    }

    /// Requests waiting now (not counting those in a runner's batch).
    pub(super) fn waiting(&self) -> usize {
        self.state.locked().queue.len()
    }

    /// Runners sending now (a lone request sent by its caller counts as one).
    pub(super) fn running(&self) -> usize {
        self.state.locked().running
    }
}

impl Running<AcquireRequest, Attempt> {
    /// A runner of the acquire lane, in its place: sends what waits, a batch at a time, until
    /// nothing does.
    pub(super) async fn send_acquires(mut self) {
        let shard = self.state.clone();
        // Callers that went away before their request was sent: nothing is sent for them.
        while let Some(batch) =
            shard
                .acquire_lane
                .next_batch(|(r, _)| &r.key, true, shard.runners())
        {
            // A key found locked by another transaction lately is sent apart, on a task of its
            // own: its statement waits out the server's lock wait again, and in a batch it
            // would hold up every key beside it (and the lane's runner) that long.
            // (At most an eighth of the pool at once; past that, in the batch as before.)
            let mut batched = Vec::with_capacity(batch.len());
            for waiting in batch {
                let permit = match shard.found_locked(&waiting.request.0.key) {
                    true => shard.apart.clone().try_acquire_owned().ok(),
                    false => None,
                };
                let Some(sending) = permit else {
                    batched.push(waiting);
                    continue;
                };
                let alone = shard.clone();
                shard.shared.spawn(async move {
                    alone.send_acquire_batch(vec![waiting]).await;
                    drop(sending);
                });
            }
            let batch = batched;
            if !batch.is_empty() {
                shard.send_acquire_batch(batch).await;
            }
        }
        self.counted = false;
    }
}

impl ShardState {
    /// Whether releases are sent alone now (see [`Running::send_releases`]).
    fn releases_alone(&self) -> bool {
        let mut until = self.releases_alone_until.locked();
        match *until {
            Some(t) if t > std::time::Instant::now() => true,
            Some(_) => {
                *until = None;
                false
            }
            None => false,
        }
    }

    /// Notes that an acquire of `key` found its row locked by another transaction past the
    /// server's lock wait: its acquires are sent apart for two statement timeouts (then in a
    /// batch again, and noted again if the row is still locked).
    fn note_locked(&self, key: &[u8]) {
        let now = std::time::Instant::now();
        let mut locked = self.locked_keys.locked();
        locked.retain(|_, until| *until > now);
        locked.insert(key.to_vec(), now + self.statement_timeout() * 2);
        self.any_locked.store(true, Ordering::Release);
    }

    /// Whether `key` was found locked lately (see [`ShardState::note_locked`]).
    fn found_locked(&self, key: &[u8]) -> bool {
        if !self.any_locked.load(Ordering::Acquire) {
            return false;
        }
        let now = std::time::Instant::now();
        let mut locked = self.locked_keys.locked();
        locked.retain(|_, until| *until > now);
        if locked.is_empty() {
            self.any_locked.store(false, Ordering::Release);
        }
        locked.contains_key(key)
    }

    /// Sends `batch` (one statement for one request, else a batch) and answers each caller.
    async fn send_acquire_batch(self: &Arc<Self>, batch: Vec<Waiting<AcquireRequest, Attempt>>) {
        let shard = self;
        let (requests, answers): (Vec<_>, Vec<_>) =
            batch.into_iter().map(|w| (w.request, w.answer)).unzip();
        let (requests, orphans): (Vec<GrantRequest>, Vec<bool>) = requests.into_iter().unzip();
        let stats = &shard.shared.stats;
        let result = if let [request] = requests.as_slice() {
            let told = shard.backend.acquire_telling_lost_try(request);
            let result =
                shard.call_timed(told, |r| acquire_timing(r, |(a, _)| *a == Attempt::Locked));
            // (Never sent again below: that takes a batch.)
            result.await.map(|(attempt, after_lost_try)| BatchGrants {
                attempts: vec![attempt],
                statements: 1,
                after_lost_try,
            })
        } else {
            let result = shard.call_timed(shard.backend.acquire_batch(&requests), |r| {
                acquire_timing(r, |b| b.attempts.contains(&Attempt::Locked))
            });
            stats.acquire_batches.fetch_add(1, Ordering::Relaxed);
            let keys = requests.len() as u64;
            stats.batched_acquires.fetch_add(keys, Ordering::Relaxed);
            result.await
        };
        let sent = match &result {
            Ok(grants) => grants.statements,
            Err(e) if e.kind == BackendErrorKind::BreakerOpen => 0,
            // The write at least (a failed read-back would make it two; which one
            // failed is not told apart here).
            Err(_) => 1,
        };
        stats.acquire_statements.fetch_add(sent, Ordering::Relaxed);
        let after_lost_try = matches!(&result, Ok(grants) if grants.after_lost_try);
        let result = result.map(|grants| grants.attempts);
        // A failure after a batch's write committed (its read-back's) says so too: a call
        // that failed before it wrote (no connection, the pool's wait, the breaker, a
        // deadlock) left nothing.
        let wrote = requests.len() > 1;
        let unknown = matches!(&result, Err(e) if e.maybe_applied);
        let outcomes = outcome_each(result, requests.len(), unknown);
        let each = requests.into_iter().zip(orphans).zip(answers);
        // A row locked by another transaction past the server's lock wait undoes the whole
        // batch, and the server does not say which key waited: every key is sent again on
        // its own, so that the free ones are granted (not answered busy) and only the
        // locked key's caller waits on. Not after a try whose reply was lost: that try may
        // have written, or still write, and a key's own answer would not say so.
        let undone = wrote && !after_lost_try;
        if undone && outcomes.iter().all(|o| matches!(o, Ok(Attempt::Locked))) {
            let each = each.map(|(request, answer)| Waiting { request, answer });
            // Boxed, as the other rare paths: a runner's future is allocated and copied at
            // every start, and would be as large as its largest path.
            Box::pin(shard.acquire_each(each.collect())).await;
            return;
        }
        for (((request, orphan), answer), outcome) in each.zip(outcomes) {
            if matches!(outcome, Ok(Attempt::Locked)) {
                shard.note_locked(&request.key);
            }
            shard.answer_acquire(request, orphan, answer, outcome, unknown, after_lost_try);
        }
    }
}

impl ShardState {
    /// Answers an acquire's caller with `outcome`. A grant nobody took (its caller gave up), or
    /// an outcome that is unknown, or answered after a try that may have written (a lost
    /// reply: `after_lost_try`), is given back, owner-checked, for a caller that may go away.
    /// A lock wait that ran out after no such try wrote nothing, and is not given back (the
    /// give-back would wait behind the same lock, holding a connection, at every poll).
    fn answer_acquire(
        self: &Arc<Self>,
        request: GrantRequest,
        orphan: bool,
        answer: oneshot::Sender<Result<Attempt, BackendError>>,
        outcome: Result<Attempt, BackendError>,
        unknown: bool,
        after_lost_try: bool,
    ) {
        let locked = match outcome {
            Ok(Attempt::Locked) => after_lost_try,
            Ok(Attempt::Held { after_lost_try, .. }) => after_lost_try,
            _ => false,
        };
        let untaken = match answer.send(outcome) {
            Err(Ok(Attempt::Granted { after_lost_try, .. })) => Some(after_lost_try),
            _ => None,
        };
        let ttl = Duration::from_millis(u64::from(request.ttl_ms));
        if orphan && untaken == Some(true) {
            // A try before it may still land and take the row again.
            self.watch_lost_try(request.key, request.owner, ttl, None);
        } else if orphan && (untaken.is_some() || unknown || locked) {
            self.give_back(request.key, request.owner, ttl);
        }
    }

    /// Sends each release of a batch that a lock wait undid alone, two at a time (see
    /// [`ShardState::acquire_each`]), and answers each caller as soon as its own statement has.
    async fn release_each(
        self: &Arc<Self>,
        releases: Vec<(
            ReleaseRequest,
            oneshot::Sender<Result<ReleaseAnswer, BackendError>>,
        )>,
    ) {
        let queue = Mutex::new(releases.into_iter());
        let sender = || async {
            loop {
                let Some(((key, owner), answer)) = queue.locked().next() else {
                    return;
                };
                let _ = answer.send(self.call_row(|b| b.release(&key, &owner)).await);
            }
        };
        tokio::join!(sender(), sender());
    }

    /// Sends each request of a batch that a lock wait undid as a single acquire, two at a time
    /// (a key still locked by another transaction holds one connection for the server's lock
    /// wait while the other serves the rest), and answers each caller as soon as its own
    /// statement has: skipped if it went away meanwhile.
    async fn acquire_each(self: &Arc<Self>, requests: Vec<Waiting<AcquireRequest, Attempt>>) {
        let queue = Mutex::new(requests.into_iter());
        let sender = || async {
            loop {
                let Some(Waiting {
                    request: (request, orphan),
                    answer,
                }) = queue.locked().next()
                else {
                    return;
                };
                if orphan && answer.is_closed() {
                    // Its caller went away, so it is not asked again; but a try of the batch
                    // before the one undone may have written its row (its read-back refused
                    // after the write, and retried): released, owner-checked (nothing if it was
                    // not written). No try of it is still on its way (its reply was not lost),
                    // so the shard's first answer ends it.
                    let ttl = Duration::from_millis(u64::from(request.ttl_ms));
                    self.release_later(request.key, request.owner, ttl);
                    continue;
                }
                let outcome = self
                    .call_timed(self.backend.acquire(&request), |r| {
                        acquire_timing(r, |a| *a == Attempt::Locked)
                    })
                    .await;
                if !matches!(&outcome, Err(e) if e.kind == BackendErrorKind::BreakerOpen) {
                    (self.shared.stats.acquire_statements).fetch_add(1, Ordering::Relaxed);
                }
                // Any failure leaves the grant unknown, for the same reason, whatever this
                // statement's own error says: so its caller is told (a move's follow counts
                // such a row as its lease's), and a caller that may go away has it given back,
                // owner-checked (nothing if unwritten).
                let outcome = outcome.map_err(|mut e| {
                    e.maybe_applied = true;
                    e
                });
                let unknown = outcome.is_err();
                if matches!(outcome, Ok(Attempt::Locked)) {
                    self.note_locked(&request.key);
                }
                // A try of the batch before the one undone may have written its row.
                self.answer_acquire(request, orphan, answer, outcome, unknown, true);
            }
        };
        tokio::join!(sender(), sender());
    }
}

impl Running<ReleaseRequest, ReleaseAnswer> {
    /// A runner of the release lane (see [`Running::send_acquires`]).
    pub(super) async fn send_releases(mut self) {
        let shard = self.state.clone();
        // A release is sent even when its caller went away: the row must be freed.
        while let Some(batch) =
            shard
                .release_lane
                .next_batch(|(key, _)| key, false, shard.runners())
        {
            let (leases, answers): (Vec<_>, Vec<_>) =
                batch.into_iter().map(|w| (w.request, w.answer)).unzip();
            // Alone for a while after a batch was undone by a locked row (see below): a
            // batch's update may wait on rows it does not change, each alone only on its own.
            if leases.len() > 1 && shard.releases_alone() {
                Box::pin(shard.release_each(leases.into_iter().zip(answers).collect())).await;
                continue;
            }
            let result = if let [(key, owner)] = leases.as_slice() {
                let result = shard.call_row_waited(|b| b.release(key, owner)).await;
                result.map(|released| vec![released])
            } else {
                let stats = &shard.shared.stats;
                stats.release_batches.fetch_add(1, Ordering::Relaxed);
                let keys = leases.len() as u64;
                stats.batched_releases.fetch_add(keys, Ordering::Relaxed);
                shard.call_row_waited(|b| b.release_batch(&leases)).await
            };
            // A row locked by another transaction past the server's lock wait undid the whole
            // batch (nothing was done), and the server does not say which: each is sent again
            // alone, so that only that row's release is answered so, and so are the next
            // batches' for two statement timeouts.
            let undone = matches!(&result, Err(e) if leases.len() > 1
                && e.kind == BackendErrorKind::LockWaitTimeout
                && !e.maybe_applied);
            if undone {
                *shard.releases_alone_until.locked() =
                    Some(std::time::Instant::now() + shard.statement_timeout() * 2);
                Box::pin(shard.release_each(leases.into_iter().zip(answers).collect())).await;
                continue;
            }
            answer_each(answers, result.map_err(crate::shard::lock_wait_told));
        }
        self.counted = false;
    }
}

/// What the acquire lane carries: a grant request, and whether its caller may go away.
pub(super) type AcquireRequest = (GrantRequest, bool);
/// What the release lane carries: a key and its owner.
pub(super) type ReleaseRequest = (Vec<u8>, String);

/// A runner's place in its lane, taken when the runner is decided on and given back if it
/// ends any other way than by finding nothing left to send (see [`Lane::count_out`]): it
/// panicked, its task was cancelled, or its runtime shut down before it ever ran (it is
/// created before the task, so that a task dropped unpolled still gives it back). The
/// requests then left queued with no runner are answered that they were not sent.
pub(super) struct Running<R, O> {
    state: Arc<ShardState>,
    lane: fn(&ShardState) -> &Lane<R, O>,
    /// Cleared once `next_batch` counted the runner out.
    counted: bool,
}

impl ShardState {
    /// A place among the acquire lane's runners, counted already.
    pub(super) fn acquire_runner(self: &Arc<Self>) -> Running<AcquireRequest, Attempt> {
        Running {
            state: self.clone(),
            lane: |s| &s.acquire_lane,
            counted: true,
        }
    }

    /// A place among the release lane's runners, counted already.
    pub(super) fn release_runner(self: &Arc<Self>) -> Running<ReleaseRequest, ReleaseAnswer> {
        Running {
            state: self.clone(),
            lane: |s| &s.release_lane,
            counted: true,
        }
    }
}

impl<R, O> Drop for Running<R, O> {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        for orphan in (self.lane)(&self.state).count_out() {
            let _ = orphan.answer.send(Err(not_sent()));
        }
    }
}

/// Counts a lone release out of its lane when it ends (or is dropped), and starts a runner
/// for what queued behind it.
pub(super) struct LeaveLane<'a>(pub(super) &'a Arc<ShardState>);

impl Drop for LeaveLane<'_> {
    fn drop(&mut self) {
        if self.0.release_lane.leave() {
            let running = self.0.release_runner();
            // Without a runtime nothing runs any more: the place is given back, and the
            // requests queued are answered, as they are by a task that never runs.
            drop(self.0.shared.spawn(running.send_releases()));
        }
    }
}

/// Sends a batch's outcome to each caller: its own answer, or a copy of the batch's error. A
/// caller that gave up is not there to take it; its release was sent all the same.
fn answer_each<O>(
    answers: Vec<tokio::sync::oneshot::Sender<Result<O, BackendError>>>,
    result: Result<Vec<O>, BackendError>,
) {
    let maybe_applied = matches!(&result, Err(e) if e.maybe_applied);
    let outcomes = outcome_each(result, answers.len(), maybe_applied);
    for (answer, outcome) in answers.into_iter().zip(outcomes) {
        let _ = answer.send(outcome);
    }
}

/// A batch's outcome per request: its own answer, or for each a copy of the batch's error —
/// its kind and code (what each caller decides on), the message as its source, and whether
/// the batch may have applied.
fn outcome_each<O>(
    result: Result<Vec<O>, BackendError>,
    requests: usize,
    maybe_applied: bool,
) -> Vec<Result<O, BackendError>> {
    match result {
        Ok(outcomes) => outcomes.into_iter().map(Ok).collect(),
        Err(e) => (0..requests)
            .map(|_| {
                // Each caller's copy keeps the whole cause as its text (the driver's error
                // cannot be cloned): the kind and code stay fields, the rest is the source.
                let cause = shardlock_core::Report(&*e.source).to_string();
                let mut copy = BackendError::new(e.kind, e.code, cause);
                copy.maybe_applied = maybe_applied;
                Err(copy)
            })
            .collect(),
    }
}

/// The text of [`not_sent`], by which [`is_not_sent`] knows it.
const NOT_SENT: &str =
    "the shard's dispatcher ended (its runtime shut down?) before sending this; nothing was sent";

/// What a caller reads when its request was left queued by a lane's last runner, which ended
/// without sending it (its task was cancelled with its runtime, say): nothing was sent. A
/// caller whose own runtime still runs asks again ([`is_not_sent`]).
fn not_sent() -> BackendError {
    BackendError::new(BackendErrorKind::Other, None, NOT_SENT)
}

/// Whether `e` is [`not_sent`]'s answer: the request can be queued again as it is.
pub(crate) fn is_not_sent(e: &BackendError) -> bool {
    e.kind == BackendErrorKind::Other
        && e.code.is_none()
        && !e.maybe_applied
        && e.source.to_string() == NOT_SENT
}

/// What a caller reads when its lane's runner ended without answering (its task was cancelled
/// with the runtime): the statement may have been sent.
pub(super) fn no_answer() -> BackendError {
    let mut e = BackendError::new(
        BackendErrorKind::Other,
        None,
        "the shard's dispatcher ended before it answered",
    );
    e.maybe_applied = true;
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_runners_take_at_most_half_of_what_the_steady_ones_leave_of_the_pool() {
        let runners = |batches, pool| {
            let r = Runners::new(batches, pool);
            (r.steady, r.most)
        };
        // The default: a pool of 16, two batches in flight.
        assert_eq!(runners(2, 16), (2, 4));
        assert_eq!(runners(4, 32), (4, 8));
        assert_eq!(runners(2, 8), (2, 3));
        // No extra runner where the steady ones take the pool already...
        assert_eq!(runners(2, 4), (2, 2));
        assert_eq!(runners(8, 16), (8, 8));
        assert_eq!(runners(1, 4), (1, 1));
        // ...and the bound holds for every size the config allows (1 ..= pool per kind).
        for pool in 1..=64 {
            for batches in 1..=pool {
                let r = Runners::new(batches, pool);
                assert!(r.steady == batches && r.most <= 2 * batches);
                let extras = 2 * (r.most - r.steady);
                assert!(
                    extras <= pool.saturating_sub(2 * batches) / 2,
                    "{batches} of {pool}"
                );
            }
        }
    }

    #[test]
    fn a_deep_queue_starts_extra_runners_which_end_once_it_is_short() {
        fn key(request: &(Vec<u8>, ())) -> &[u8] {
            &request.0
        }
        let lane: Lane<(Vec<u8>, ()), ()> = Lane::default();
        let runners = Runners::new(2, 16);
        let mut answers = Vec::new();
        let mut started = Vec::new();
        for request in 0..20 {
            let (answer, start) = lane.push((vec![request], ()), runners);
            answers.push(answer);
            started.push(start);
        }
        // The two steady runners start with the first two requests; the next ones wait until
        // DEEP_QUEUE of them are queued, and then start the extra runners, up to `most`.
        let starts: Vec<usize> = (0..20).filter(|&i| started[i]).collect();
        assert_eq!(starts, vec![0, 1, DEEP_QUEUE - 1, DEEP_QUEUE]);
        assert_eq!(lane.running(), runners.most);
        // The first runner to look takes the whole queue (the others find less than a deep
        // one). A short queue starts nobody, and the extra runners end at their next look,
        // leaving it to a steady one.
        assert_eq!(lane.next_batch(key, false, runners).unwrap().len(), 20);
        let (_answer, start) = lane.push((vec![99], ()), runners);
        assert!(!start);
        for _ in runners.steady..runners.most {
            assert!(lane.next_batch(key, false, runners).is_none());
        }
        assert_eq!(lane.running(), runners.steady);
        assert_eq!(lane.next_batch(key, false, runners).unwrap().len(), 1);
        // A runner that finds nothing left ends, counted out under the lane's lock.
        for _ in 0..runners.steady {
            assert!(lane.next_batch(key, false, runners).is_none());
        }
        assert_eq!(lane.running(), 0);
    }
}
