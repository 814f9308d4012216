//! Job claims on rows of `shardlock_job`, with a lease after which a crashed worker's job is
//! claimed again.

use std::sync::{Arc, Weak};
use std::time::Duration;

use shardlock_core::{Backoff, LockKey, Result};
use shardlock_mysql::{ClaimedJob, JobEnd};

use super::may_have_acted;
use crate::shard::ShardState;
use crate::LockRouter;

/// A job claimed by [`LockRouter::claim_job`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    /// The job's id (unique on its queue's shard).
    pub id: u64,
    /// The queue.
    pub queue: String,
    /// What [`LockRouter::enqueue_job`] stored.
    pub payload: Vec<u8>,
    /// Claims of it before this one that were not completed (lease ran out).
    pub retry_count: u32,
    /// The claim token written in the row (the worker's name and a claim number).
    pub claim: String,
    /// The shard it was claimed on (its queue may move in a reload before it is finished).
    home: JobHome,
}

/// The shard a job was claimed on; equal for any two jobs (only the public fields count).
#[derive(Clone)]
struct JobHome(Weak<ShardState>);

impl PartialEq for JobHome {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for JobHome {}

impl std::fmt::Debug for JobHome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.upgrade() {
            Some(s) => f.write_str(s.name()),
            None => f.write_str("(gone)"),
        }
    }
}

impl LockRouter {
    /// Adds a job to `queue` (its jobs live on the shard of key `queue`), due after `delay`;
    /// a claim that is not completed within its lease is followed by up to `max_retries`
    /// more. Returns the job's id.
    ///
    /// A retry after a lost reply finds the job its lost try enqueued. An error with
    /// `maybe_applied` set (that retry failed too) may still have enqueued it, as may a
    /// cancellation: the `INSERT` may have reached the shard and committed, the job queued with
    /// its id never returned. The request id is per call, so calling again enqueues a second
    /// copy: make the job idempotent, or look for it before enqueuing it again.
    pub async fn enqueue_job(
        &self,
        queue: &str,
        payload: &[u8],
        delay: Duration,
        max_retries: u32,
    ) -> Result<u64> {
        let key = LockKey::new(queue)?;
        self.check_joined(&key)?;
        let shard = self.state_for(&key);
        // A request id in `origin` (unique): a retry after a lost reply finds the job the
        // first try enqueued and answers its id, instead of enqueuing it twice.
        let request = format!("enqueue:{}", self.inner.shared.next_owner().1);
        shard
            .run(|b| b.enqueue_job(queue, payload, delay, max_retries, &request))
            .await
    }

    /// Claims the next due job of `queue` for `worker`, for `lease`: first a claimed job
    /// whose lease ran out (its retry count goes up) while retries are left, else the ready
    /// job due first. One READ COMMITTED transaction: `SELECT ... FOR UPDATE SKIP LOCKED`
    /// (MySQL 8, MariaDB 10.6+) locks just the chosen row, so claimers never wait on each
    /// other, then an `UPDATE` by primary key. `None` when nothing is due. Deadlocks are
    /// retried inside. A retry after a lost reply answers the job its lost try claimed, its
    /// lease renewed for the whole `lease` from then (it may have run out meanwhile), unless
    /// another claim took the job since. While a reload's move is in progress, the shards the
    /// queue lived on are tried too; one that could not be reached, where nothing can have
    /// been claimed, is passed over, and its error is the answer only when no shard had a job.
    ///
    /// An error with `maybe_applied` set: a try of this call may have claimed a job, and its
    /// retries (through failures to reach the shard, for some seconds) did not find out; such
    /// a job is claimed again once `lease` runs out, as after a cancellation.
    ///
    /// Cancellation: a claim that committed is never returned; the job is claimed again when
    /// `lease` runs out (that counts as a retry). One not yet committed keeps the job's row locked,
    /// skipped by claimers, until its connection is discarded at the pool's next checkout of it.
    pub async fn claim_job(
        &self,
        queue: &str,
        worker: &str,
        lease: Duration,
    ) -> Result<Option<Job>> {
        let key = LockKey::new(queue)?;
        self.check_joined(&key)?;
        let (_, claim_no) = self.inner.shared.next_owner();
        let claim = format!("{worker}@{claim_no}");
        // While a reload's move is in progress, the shards the queue lived on before first,
        // then its shard: the move carries their jobs over (written there, then deleted here),
        // so a job carried between two of these reads is found by the later one. (The other
        // order misses it: the queue's shard read before it arrived, the old one after it
        // left.)
        // A shard that cannot be reached, where no try can have claimed anything, is passed
        // over: a queue moved off a shard that is down is claimed from where it is now. Its
        // error is the answer only if no other shard had a job.
        let mut shards = self.placements(&key);
        shards.rotate_left(1);
        let mut unreached = None;
        for shard in shards {
            let claimed = match claim_on(&shard, queue, &claim, lease).await {
                Err(e) if !may_have_acted(&e) => {
                    unreached.get_or_insert(e);
                    continue;
                }
                claimed => claimed?,
            };
            if let Some(ClaimedJob {
                id,
                payload,
                retry_count,
            }) = claimed
            {
                return Ok(Some(Job {
                    id,
                    queue: queue.to_owned(),
                    payload,
                    retry_count,
                    claim,
                    home: JobHome(Arc::downgrade(&shard)),
                }));
            }
        }
        unreached.map_or(Ok(None), Err)
    }

    /// Marks `job` done, if its claim still holds (`false` when the lease ran out: the job
    /// may have been claimed again).
    ///
    /// Cancellation: the `UPDATE` may have reached the shard and committed; if not, the claim holds
    /// until its lease runs out and the job is then claimed again. Calling again is safe but
    /// answers `false` once the first call took effect.
    pub async fn complete_job(&self, job: &Job) -> Result<bool> {
        self.finish_job(job, JobEnd::Done).await
    }

    /// Marks `job` failed for good, if its claim still holds.
    ///
    /// Cancellation: as for [`LockRouter::complete_job`].
    pub async fn fail_job(&self, job: &Job) -> Result<bool> {
        self.finish_job(job, JobEnd::Failed).await
    }

    /// Gives `job` back unfinished, if its claim still holds (`false` when the lease ran
    /// out: the job may have been claimed again): it is ready for the next claim at once, and
    /// this claim does not count as a retry. What a worker that stops before finishing (a
    /// shutdown) should do with the jobs it holds; a claim left to run out is counted as a
    /// retry, and with none left fails the job for good.
    ///
    /// Cancellation: as for [`LockRouter::complete_job`].
    pub async fn release_job(&self, job: &Job) -> Result<bool> {
        self.finish_job(job, JobEnd::Released).await
    }

    async fn finish_job(&self, job: &Job, end: JobEnd) -> Result<bool> {
        // On the shard it was claimed on, even if its queue moved since.
        let shard = match job.home.0.upgrade() {
            Some(home) => home,
            None => self.state_for(&LockKey::new(&job.queue)?),
        };
        shard.run(|b| b.finish_job(job.id, &job.claim, end)).await
    }
}

/// [`LockRouter::claim_job`] on one shard.
async fn claim_on(
    shard: &ShardState,
    queue: &str,
    claim: &str,
    lease: Duration,
) -> Result<Option<ClaimedJob>> {
    let mut tries = 0;
    // After a try that may have claimed a job (its reply lost), the next one first looks for
    // the job claimed under this claim token: a claim is never made twice.
    let mut look_first = false;
    // From then on, failures to reach the shard are tried through too, backing off: given up,
    // that claim would be nobody's until its lease ran out (then claimed again, counted as a
    // retry of the job; with none left, failed without having run).
    let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(500));
    loop {
        let attempt = shard
            .call_waiting(|b| b.claim_job(queue, claim, lease, look_first))
            .await;
        match attempt {
            Err(e)
                if (e.kind.is_retryable()
                    || e.maybe_applied
                    || (look_first && e.kind.is_infrastructure()))
                    && tries < 20 =>
            {
                tries += 1;
                look_first |= e.maybe_applied;
                let pause = if look_first && e.kind.is_infrastructure() {
                    backoff.next_delay()
                } else {
                    let jitter = rand::random::<u64>() % (2 * tries);
                    Duration::from_millis(1 + jitter)
                };
                tokio::time::sleep(pause).await;
            }
            Err(mut e) => {
                // Whether or not this try was sent: an earlier one may have claimed a job.
                e.maybe_applied |= look_first;
                return Err(e.into_error(shard.name()));
            }
            Ok(claimed) => return Ok(claimed),
        }
    }
}
