//! Job claims on rows of `shardlock_job`, with a lease after which a crashed worker's job is
//! claimed again.

use std::sync::{Arc, Weak};
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, IsolationLevel, TxOpts};
use shardlock_core::{LockKey, Result};

use crate::keeper::ShardState;
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
            Some(s) => f.write_str(s.shard.name()),
            None => f.write_str("(gone)"),
        }
    }
}

impl LockRouter {
    /// Adds a job to `queue` (its jobs live on the shard of key `queue`), due after `delay`;
    /// a claim that is not completed within its lease is followed by up to `max_retries`
    /// more. Returns the job's id.
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
        let (queue, payload) = (queue.to_owned(), payload.to_vec());
        // A request id in `origin` (unique): a retry after a lost reply finds the job the
        // first try enqueued and answers its id, instead of enqueuing it twice.
        let request = format!("enqueue:{}", self.inner.shared.next_owner().1);
        shard
            .run(|c| {
                let (queue, payload, request) = (queue.clone(), payload.clone(), request.clone());
                Box::pin(async move {
                    c.exec_drop(
                        "INSERT INTO shardlock_job \
                         (queue, payload, status, due_at, retry_count, max_retries, origin) \
                         VALUES (?, ?, 'ready', NOW(3) + INTERVAL ? MICROSECOND, 0, ?, ?) \
                         ON DUPLICATE KEY UPDATE id = LAST_INSERT_ID(id)",
                        (
                            &queue,
                            &payload,
                            delay.as_micros() as u64,
                            max_retries,
                            &request,
                        ),
                    )
                    .await?;
                    Ok(c.last_insert_id().unwrap_or(0))
                })
            })
            .await
    }

    /// Claims the next due job of `queue` for `worker`, for `lease`: first a claimed job
    /// whose lease ran out (its retry count goes up) while retries are left, else the ready
    /// job due first. One READ COMMITTED transaction: `SELECT ... FOR UPDATE SKIP LOCKED`
    /// (MySQL 8, MariaDB 10.6+) locks just the chosen row, so claimers never wait on each
    /// other, then an `UPDATE` by primary key. `None` when nothing is due. Deadlocks are
    /// retried inside.
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
        // The queue's shard first, then (while a reload's move is in progress) the shards it
        // lived on before, whose jobs are carried over once the move is over.
        let topology = self.inner.topology.load_full();
        let mut shards = vec![topology.locate(&key).clone()];
        shards.extend(topology.previous_locations(&key));
        drop(topology);
        for shard in shards {
            if let Some((id, payload, retry_count)) = claim_on(&shard, queue, &claim, lease).await?
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
        Ok(None)
    }

    /// Marks `job` done, if its claim still holds (`false` when the lease ran out: the job
    /// may have been claimed again).
    pub async fn complete_job(&self, job: &Job) -> Result<bool> {
        self.finish_job(job, "done").await
    }

    /// Marks `job` failed for good, if its claim still holds.
    pub async fn fail_job(&self, job: &Job) -> Result<bool> {
        self.finish_job(job, "failed").await
    }

    async fn finish_job(&self, job: &Job, status: &'static str) -> Result<bool> {
        // On the shard it was claimed on, even if its queue moved since.
        let shard = match job.home.0.upgrade() {
            Some(home) => home,
            None => self.state_for(&LockKey::new(&job.queue)?),
        };
        let (claim, id) = (job.claim.clone(), job.id);
        shard
            .run(|c| {
                let claim = claim.clone();
                Box::pin(async move {
                    c.exec_drop(
                        "UPDATE shardlock_job SET status = ?, lease_until = NULL \
                         WHERE id = ? AND status = 'claimed' AND locked_by = ? \
                         AND lease_until > NOW(3)",
                        (status, id, &claim),
                    )
                    .await?;
                    Ok(c.affected_rows() == 1)
                })
            })
            .await
    }
}

/// [`LockRouter::claim_job`] on one shard: the claimed job's id, payload and retry count.
async fn claim_on(
    shard: &ShardState,
    queue: &str,
    claim: &str,
    lease: Duration,
) -> Result<Option<(u64, Vec<u8>, u32)>> {
    let mut tries = 0;
    // After a try that may have claimed a job (its reply lost), the next one first looks for
    // the job claimed under this claim token: a claim is never made twice.
    let mut look_first = false;
    loop {
        let attempt = shard
            .call_waiting(
                shard
                    .shard
                    .with_conn_once(shard.shard.statement_timeout(), |c| {
                        let (queue, claim) = (queue.to_owned(), claim.to_owned());
                        Box::pin(async move {
                            if look_first {
                                if let Some(mine) = claimed_by(c, &queue, &claim).await? {
                                    return Ok(Some(mine));
                                }
                            }
                            claim_in(c, &queue, &claim, lease).await
                        })
                    }),
            )
            .await;
        match attempt {
            Err(e) if (e.kind.is_retryable() || e.maybe_applied) && tries < 20 => {
                tries += 1;
                look_first |= e.maybe_applied;
                let jitter = rand::random::<u64>() % (2 * tries);
                tokio::time::sleep(Duration::from_millis(1 + jitter)).await;
            }
            other => return other.map_err(|e| e.into_error(shard.shard.name())),
        }
    }
}

/// The job of `queue` claimed under `claim`, if any (by an earlier try whose reply was lost).
async fn claimed_by(
    c: &mut Conn,
    queue: &str,
    claim: &str,
) -> mysql_async::Result<Option<(u64, Vec<u8>, u32)>> {
    c.exec_first(
        "SELECT id, payload, retry_count FROM shardlock_job \
         WHERE queue = ? AND status = 'claimed' AND locked_by = ? LIMIT 1",
        (queue, claim),
    )
    .await
}

/// The claim transaction of [`LockRouter::claim_job`] on one connection.
async fn claim_in(
    c: &mut Conn,
    queue: &str,
    claim: &str,
    lease: Duration,
) -> mysql_async::Result<Option<(u64, Vec<u8>, u32)>> {
    let mut opts = TxOpts::default();
    opts.with_isolation_level(IsolationLevel::ReadCommitted);
    let mut tx = c.start_transaction(opts).await?;
    // Abandoned claims with no retries left are failed for good, not left claimed for ever.
    // (READ COMMITTED: only the rows that match are locked, and claimers never lock those.)
    tx.exec_drop(
        "UPDATE shardlock_job SET status = 'failed', lease_until = NULL \
         WHERE queue = ? AND status = 'claimed' AND lease_until <= NOW(3) \
         AND retry_count >= max_retries LIMIT 100",
        (queue,),
    )
    .await?;
    // An abandoned claim first (a crashed worker's job), else the ready job due first.
    let mut row: Option<(u64, Vec<u8>, u32)> = tx
        .exec_first(
            "SELECT id, payload, retry_count + 1 FROM shardlock_job \
             WHERE queue = ? AND status = 'claimed' AND lease_until <= NOW(3) \
             AND retry_count < max_retries LIMIT 1 FOR UPDATE SKIP LOCKED",
            (queue,),
        )
        .await?;
    if row.is_none() {
        row = tx
            .exec_first(
                "SELECT id, payload, retry_count FROM shardlock_job \
                 WHERE queue = ? AND status = 'ready' AND due_at <= NOW(3) \
                 ORDER BY due_at LIMIT 1 FOR UPDATE SKIP LOCKED",
                (queue,),
            )
            .await?;
    }
    let Some((id, payload, retry_count)) = row else {
        tx.commit().await?; // keeps the jobs failed above
        return Ok(None);
    };
    tx.exec_drop(
        "UPDATE shardlock_job SET status = 'claimed', locked_by = ?, locked_at = NOW(3), \
         lease_until = NOW(3) + INTERVAL ? MICROSECOND, retry_count = ? WHERE id = ?",
        (claim, lease.as_micros() as u64, retry_count, id),
    )
    .await?;
    tx.commit().await?;
    Ok(Some((id, payload, retry_count)))
}
