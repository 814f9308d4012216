//! The shard's dispatcher: acquires and releases that arrive while the shard's statements of
//! their kind are in flight wait in a lane and go together, as one batch, when a runner frees
//! up (group commit, without a timer).
//!
//! A lane lets a few runners work at once (`in_flight`): a request that finds fewer running
//! starts one, which sends it at once — a lone caller pays one round trip and nothing more.
//! Requests that arrive while all runners are busy queue, and the next runner to finish takes
//! every one of them (up to [`MAX_BATCH`] keys) into one statement. So batches grow exactly
//! when the shard is busy, which is when its per-statement cost is what limits throughput.
//!
//! Each request's caller waits on its own answer. Runners are tasks of their own: a caller
//! that gives up (its wait ended, its future was dropped) leaves its request to be answered
//! to nobody, and the acquire path behind it gives a grant it no longer wants back, as it does
//! for a single statement (see `acquire/attempt.rs`).

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;

use shardlock_core::BackendError;
use shardlock_mysql::MAX_BATCH;
use tokio::sync::oneshot;

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

impl<R, O> Lane<R, O> {
    /// Queues `request`; returns the receiver of its answer, and whether the caller must start
    /// a runner (fewer than `limit` run; the new one is counted already).
    pub(super) fn push(&self, request: R, limit: usize) -> (Answer<O>, bool) {
        let (answer, rx) = oneshot::channel();
        let mut state = self.state.locked();
        state.queue.push_back(Waiting { request, answer });
        let start = state.running < limit.max(1);
        if start {
            state.running += 1;
        }
        (rx, start)
    }

    /// Counts the caller in as a runner of its own request when nothing waits and fewer than
    /// `limit` run: a lone request is then sent by its caller, without a task hop. The caller
    /// must call [`Lane::leave`] when done (whether to start a runner for what queued
    /// meanwhile is its answer).
    pub(super) fn enter_alone(&self, limit: usize) -> bool {
        let mut state = self.state.locked();
        let alone = state.queue.is_empty() && state.running < limit.max(1);
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
    /// the next one). `None` when nothing waits: the runner then ends, counted out under the
    /// same lock that [`Lane::push`] counts under, so no request is left without a runner.
    pub(super) fn next_batch(&self, key: impl Fn(&R) -> &[u8]) -> Option<Vec<Waiting<R, O>>> {
        let mut state = self.state.locked();
        if state.queue.is_empty() {
            state.running -= 1;
            return None;
        }
        let mut batch = Vec::new();
        let mut later = VecDeque::new();
        let mut keys = HashSet::new();
        while let Some(waiting) = state.queue.pop_front() {
            if batch.len() < MAX_BATCH && keys.insert(key(&waiting.request).to_vec()) {
                batch.push(waiting);
            } else {
                later.push_back(waiting);
            }
        }
        state.queue = later;
        Some(batch)
    }

    /// Requests waiting now (not counting those in a runner's batch).
    pub(super) fn waiting(&self) -> usize {
        self.state.locked().queue.len()
    }
}

/// A copy of a batch's error for each of its callers: same kind, code and whether the
/// statement may have applied (what each caller decides on), with the message as its source.
pub(super) fn each(error: &BackendError) -> BackendError {
    let mut copy = BackendError::new(error.kind, error.code, error.to_string());
    copy.maybe_applied = error.maybe_applied;
    copy
}
