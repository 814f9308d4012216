//! Job claims on rows of `shardlock_job`, with a lease after which a crashed worker's job is
//! claimed again.

use std::sync::{Arc, Weak};
use std::time::Duration;

use shardlock_core::{Backoff, LockKey, Result};
use shardlock_mysql::{ClaimedJob, JobEnd};
use tokio::sync::watch;
use tracing::Instrument;

use super::{check_fits, may_have_acted, MAX_NAME_BYTES};
use crate::clock::Moment;
use crate::queue::Want;
use crate::shard::ShardState;
use crate::LockRouter;

/// A job claimed by [`LockRouter::claim_job`].
///
/// Its claim lasts the lease it was claimed for, on the shard's clock: a worker that runs
/// longer (or is paused) may find the job claimed again by another worker. Watch
/// [`Job::is_held`], [`Job::held_until`] or [`Job::lost`], and move the lease on with
/// [`LockRouter::extend_job`] while the work goes on. Clones share the claim's end.
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
    /// Until when the claim is surely this worker's.
    end: ClaimEnd,
}

impl Job {
    /// False once the claim may have run out: its local deadline (from before the claim, or
    /// the latest extend that answered `true`, was sent, its lease less the clock drift allowed
    /// and a Galera shard's node skew, those a reload raised since included) passed; or the
    /// job was completed, failed or given back (through any clone; or a call to do so may have
    /// done it: its answer was lost, or it was cancelled), or an extend answered that the
    /// claim no longer held, after which it stays false. Another worker may then claim the
    /// job (once its lease ran out on the shard). A deadline passed while extends failed to
    /// reach the shard comes back with an extend that reaches it and answers `true`: the shard
    /// found the claim still this worker's.
    pub fn is_held(&self) -> bool {
        self.claim_end().is_some_and(|end| Moment::now() < end)
    }

    /// Until when the claim is surely this worker's (see [`Job::is_held`]); past once it
    /// ended. An instant of the runtime's clock, which stands still while the host is
    /// suspended: the claim's end comes earlier by any suspend from now on (and
    /// [`Job::is_held`] counts it).
    pub fn held_until(&self) -> tokio::time::Instant {
        match self.claim_end() {
            Some(end) => end.timer(),
            None => tokio::time::Instant::now(),
        }
    }

    /// Completes when [`Job::is_held`] turns false: at the claim's local deadline unless an
    /// extend moved it on meanwhile, or when the job is ended through a clone. Cancel-safe;
    /// completes at once for a claim that ended already. What to `select!` the work against,
    /// to stop it before another worker may take the job. (It looks at the deadline again at
    /// least every second, so a reload that raises the clock drift or node skew allowed, or a
    /// suspend of the host, is noticed that soon.)
    pub async fn lost(&self) {
        let mut moved = self.end.0.subscribe();
        loop {
            moved.borrow_and_update();
            let Some(end) = self.claim_end() else {
                return;
            };
            if Moment::now() >= end {
                return;
            }
            tokio::select! {
                _ = tokio::time::sleep_until(end.checked_timer()) => {}
                _ = moved.changed() => {}
            }
        }
    }

    /// The claim's local end, by the clock drift and node skew allowed now if they were raised
    /// since; `None` once it ended.
    fn claim_end(&self) -> Option<Moment> {
        let term = self.end.term()?;
        let (drift_ppm, skew) = match self.home.0.upgrade() {
            Some(shard) => (shard.shared.drift_ppm(), shard.leases_skew()),
            None => (0, Duration::ZERO),
        };
        Some(term.end(drift_ppm, skew))
    }
}

/// Keeps a job's claim extended while it lives: [`LockRouter::keep_job`]. Dropping it stops the
/// extends (the claim then lasts until the end of the latest one).
#[derive(Debug)]
#[must_use = "dropping the keeper stops extending the claim at once"]
pub struct JobKeeper(tokio::task::JoinHandle<()>);

impl Drop for JobKeeper {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A claim's lease as a statement wrote it: sent at `sent` for `lease` (the statement ran after
/// that), under the clock drift and node skew allowed then.
#[derive(Debug, Clone, Copy)]
struct Term {
    sent: Moment,
    lease: Duration,
    drift_ppm: u32,
    skew: Duration,
}

impl Term {
    /// Its local end, allowing at least `drift_ppm` and `skew`: before the shard can let
    /// another worker claim the job, whichever of its nodes is asked.
    fn end(&self, drift_ppm: u32, skew: Duration) -> Moment {
        Want::end_by(
            self.sent,
            self.lease,
            self.drift_ppm.max(drift_ppm),
            self.skew.max(skew),
        )
    }
}

/// The term a job's claim surely lasts, `None` once it ended (for good); shared by the job's
/// clones. Equal for any two jobs (only the public fields count).
#[derive(Clone)]
struct ClaimEnd(Arc<watch::Sender<Option<Term>>>);

impl ClaimEnd {
    fn new(term: Term) -> Self {
        Self(Arc::new(watch::Sender::new(Some(term))))
    }

    fn term(&self) -> Option<Term> {
        *self.0.borrow()
    }

    /// The claim surely lasts `term` too (an extend's answer): moved on, never back. Not once
    /// it ended: the answer of an extend sent before the job was finished, arriving after, must
    /// not make a job finished (and perhaps claimed by another worker since) held again.
    fn last_until(&self, term: Term) {
        self.0.send_if_modified(|now| match now {
            Some(now) => {
                let (drift_ppm, skew) =
                    (now.drift_ppm.max(term.drift_ppm), now.skew.max(term.skew));
                let later = term.end(drift_ppm, skew) > now.end(drift_ppm, skew);
                if later {
                    *now = term;
                }
                later
            }
            None => false,
        });
    }

    fn ended(&self) {
        self.0.send_replace(None);
    }
}

/// Ends the claim when dropped, unless emptied first.
struct EndsOnDrop<'a>(Option<&'a ClaimEnd>);

impl Drop for EndsOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(end) = self.0 {
            end.ended();
        }
    }
}

impl PartialEq for ClaimEnd {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for ClaimEnd {}

impl std::fmt::Debug for ClaimEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.term().map(|t| t.end(0, Duration::ZERO)) {
            Some(end) if Moment::now() < end => write!(f, "held for {:?}", end - Moment::now()),
            Some(_) => f.write_str("ran out"),
            None => f.write_str("ended"),
        }
    }
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

/// The widths of `shardlock_job`'s `queue` (`VARBINARY(255)`) and `payload` (`BLOB`).
const MAX_QUEUE_BYTES: usize = 255;
const MAX_PAYLOAD_BYTES: usize = 65_535;

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
    ///
    /// A job that lands on its queue's shard after a reload placed the queue elsewhere (its
    /// statement held up across the reload) is carried there before the call answers (or
    /// after, on the router's runtime, if the call is dropped), as the move carries the queue's
    /// other jobs. If that fails, the error says so and names the job (`maybe_applied`): it is
    /// enqueued, and is claimed by nobody until a later move from that shard carries it.
    ///
    /// `queue` takes at most 255 bytes and `payload` 65,535 (their columns' widths;
    /// [`shardlock_core::Error::InvalidArgument`] otherwise).
    pub async fn enqueue_job(
        &self,
        queue: &str,
        payload: &[u8],
        delay: Duration,
        max_retries: u32,
    ) -> Result<u64> {
        let key = LockKey::new(queue)?;
        check_fits("queue", queue.len(), queue.len(), MAX_QUEUE_BYTES)?;
        check_fits("payload", payload.len(), payload.len(), MAX_PAYLOAD_BYTES)?;
        self.check_joined(&key)?;
        // On a task of its own: a call dropped while its job lands where a reload placed the
        // queue no more must still carry it (see `enqueue_placed`).
        let (router, queue, payload) = (self.clone(), queue.to_owned(), payload.to_vec());
        let enqueue = self.inner.shared.spawn(async move {
            (router.enqueue_placed(&key, &queue, &payload, delay, max_retries)).await
        });
        crate::router::completed(enqueue)
            .await
            .unwrap_or(Err(shardlock_core::Error::Shutdown))
    }

    /// [`LockRouter::enqueue_job`] of `queue` (as `key`), checked.
    async fn enqueue_placed(
        &self,
        key: &LockKey,
        queue: &str,
        payload: &[u8],
        delay: Duration,
        max_retries: u32,
    ) -> Result<u64> {
        let topology = self.inner.topology.load_full();
        let shard = topology.locate(key).clone();
        // Its pool stays open until the job is where its queue lives: a shard a reload removed
        // closes once nothing needs it.
        let _settling = crate::shard::Settling::new(&shard);
        // A request id in `origin` (unique): a retry after a lost reply finds the job the
        // first try enqueued and answers its id, instead of enqueuing it twice.
        let request = format!("enqueue:{}", self.inner.shared.next_owner().1);
        let insert = || shard.run(|b| b.enqueue_job(queue, payload, delay, max_retries, &request));
        let id = match insert().await {
            Ok(id) => id,
            // Perhaps enqueued where the queue lives no more: asked once more, by its request
            // id, to carry it if it is there.
            Err(e) if may_have_acted(&e) && self.placement_changed_since(&topology, key) => {
                insert().await.map_err(|_| e)?
            }
            Err(e) => return Err(e),
        };
        // Enqueued where a reload since placed the queue no more: the move's carry may have
        // scanned that shard before the job landed (a statement held up, a pause), and no
        // claim of the queue would look there once the move is over. Carried now.
        if self.placement_changed_since(&topology, key) {
            crate::moves::carry_job(&self.inner, &shard, key, id)
                .await
                .map_err(|e| {
                    let done = format!(
                        "job {id} was enqueued on shard {} where a reload placed its queue no \
                         more (it is there: enqueuing it again makes a copy), carrying it to \
                         where its queue lives now",
                        shard.name()
                    );
                    crate::shard::done_before(e, done)
                })?;
        }
        Ok(id)
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
    /// Cancellation: the claim runs on a task of its own; a job it claimed after its caller went
    /// away is given back in the background ([`LockRouter::release_job`]: claimable at once,
    /// not counted as a retry). Given back only once its shard answers: until then, as when
    /// that fails, it is claimed again when `lease` runs out (counted as a retry).
    ///
    /// The claim lasts `lease` on the shard's clock: see [`Job::is_held`] and
    /// [`LockRouter::extend_job`] for work that may take longer.
    ///
    /// The claim is written as `<worker>@<instance id>:<start nonce>:<n>` in 191 bytes, so
    /// `worker` takes at most 191 bytes less that suffix
    /// ([`shardlock_core::Error::InvalidArgument`] otherwise).
    pub async fn claim_job(
        &self,
        queue: &str,
        worker: &str,
        lease: Duration,
    ) -> Result<Option<Job>> {
        let key = LockKey::new(queue)?;
        check_fits("queue", queue.len(), queue.len(), MAX_QUEUE_BYTES)?;
        self.check_joined(&key)?;
        let (n, claim_no) = self.inner.shared.next_owner();
        let claim = format!("{worker}@{claim_no}");
        // Judged with the longest claim number: a name that fits now fits for good.
        let longest = claim.len() - n.to_string().len() + u64::MAX.to_string().len();
        check_fits("worker", worker.len(), longest, MAX_NAME_BYTES)?;
        // While a reload's move is in progress, the shards the queue lived on before first,
        // then its shard: the move carries their jobs over (written there, then deleted here),
        // so a job carried between two of these reads is found by the later one. (The other
        // order misses it: the queue's shard read before it arrived, the old one after it
        // left.)
        // A shard that cannot be reached, where no try can have claimed anything, is passed
        // over: a queue moved off a shard that is down is claimed from where it is now. Its
        // error is the answer only if no other shard had a job.
        //
        // On a task of its own: a claim that commits after its caller went away (a worker's
        // shutdown branch of a `select!`, a timeout) was nobody's until its lease ran out, and
        // then counted as a retry of the job, which failed for good with none left, never run.
        let (router, queue) = (self.clone(), queue.to_owned());
        let claiming = self.inner.shared.spawn(async move {
            let claimed = router.claim_placed(&key, &queue, claim, lease).await;
            UnseenClaim {
                claimed: Some(claimed),
                router,
            }
        });
        crate::router::completed(claiming)
            .await
            .map_or(Err(shardlock_core::Error::Shutdown), |mut unseen| {
                unseen.take()
            })
    }

    /// [`LockRouter::claim_job`] of `queue` (as `key`) under `claim`, checked.
    async fn claim_placed(
        &self,
        key: &LockKey,
        queue: &str,
        claim: String,
        lease: Duration,
    ) -> Result<Option<Job>> {
        let mut shards = self.placements(key);
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
            if let Some((
                ClaimedJob {
                    id,
                    payload,
                    retry_count,
                },
                sent,
            )) = claimed
            {
                return Ok(Some(Job {
                    id,
                    queue: queue.to_owned(),
                    payload,
                    retry_count,
                    claim,
                    end: ClaimEnd::new(self.claim_term(&shard, sent, lease)),
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

    /// Moves the lease of `job`'s claim to at least `lease` from now (by the shard's clock;
    /// never earlier), if the claim still holds: its token is still in the job's row and its
    /// lease has not run out on the shard. Whether it did: `false` when the claim ran out (the
    /// job may have been claimed again: stop working on it) or the job was ended. On `true`,
    /// [`Job::held_until`] moves on to match; on `false` the claim is ended for every clone
    /// of `job`.
    ///
    /// A try whose reply was lost is sent again, and answers the same unless the lease ran
    /// out meanwhile. An error (the shard could not be reached, or the job's row stayed locked
    /// by another session for the server's lock wait) leaves [`Job::held_until`] where it was;
    /// the lease may or may not have moved.
    pub async fn extend_job(&self, job: &Job, lease: Duration) -> Result<bool> {
        let shard = self.job_home(job)?;
        let sent = Moment::now();
        let extended = shard
            .call_row(|b| b.extend_job(job.id, &job.claim, lease))
            .await
            .map_err(|e| e.into_error(shard.name()))?;
        match extended {
            true => job.end.last_until(self.claim_term(&shard, sent, lease)),
            false => job.end.ended(),
        }
        Ok(extended)
    }

    /// Keeps `job`'s claim extended by `lease` in the background, a third of `lease` apart
    /// (the first within half of what is left of the claim; sooner after a failed try), until
    /// the keeper is dropped, the job is ended, an extend answers that the claim no longer
    /// holds, or the router shuts down; [`Job::held_until`] moves with each extend. A claim
    /// whose extends fail (the shard out of reach) still ends at its deadline: [`Job::lost`]
    /// completes then, and the work must stop. Extends go on trying after that (one that
    /// reaches the shard while the claim still holds there makes it held again).
    ///
    /// `lease` must be at least 3 ms, so that its extends are apart (it is then at least 1 ms).
    pub fn keep_job(&self, job: &Job, lease: Duration) -> Result<JobKeeper> {
        if lease < Duration::from_millis(3) {
            return Err(shardlock_core::Error::InvalidArgument {
                name: "lease",
                reason: format!("must be at least 3ms to be kept (was {lease:?})"),
            });
        }
        let router = Arc::downgrade(&self.inner);
        let job = job.clone();
        let task = tokio::spawn(async move {
            let every = lease / 3;
            let mut backoff = Backoff::new(Duration::from_millis(10).min(every), every);
            // Before half of what is left of the claim (kept with a longer lease than it was
            // claimed or last extended for, a third of `lease` could come after its end).
            let next = |job: &Job| {
                let left = job
                    .held_until()
                    .saturating_duration_since(tokio::time::Instant::now());
                every.min(left / 2)
            };
            let mut pause = next(&job);
            loop {
                // Ended through a clone (completed, failed, given back): nothing to keep.
                let mut ended = job.end.0.subscribe();
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = ended.wait_for(Option::is_none) => return,
                }
                // The router gone or shut down: its extends could only fail from now on.
                let Some(inner) = router.upgrade().filter(|i| !i.shared.is_closed()) else {
                    return;
                };
                match (LockRouter { inner }).extend_job(&job, lease).await {
                    Ok(true) => {
                        backoff.reset();
                        pause = next(&job);
                    }
                    Ok(false) => return,
                    Err(e) => {
                        tracing::warn!(queue = %job.queue, job = job.id, error = %shardlock_core::Report(&e), "shardlock could not extend a job's claim; trying again");
                        pause = backoff.next_delay();
                    }
                }
            }
        });
        Ok(JobKeeper(task))
    }

    async fn finish_job(&self, job: &Job, end: JobEnd) -> Result<bool> {
        let shard = self.job_home(job)?;
        // Ended either way once answered: by this call, or before it. Ended too when the call
        // may have acted unanswered (its reply lost, or the call cancelled): the job may be
        // ready, or claimed by another worker, already. Only an error that surely did nothing
        // leaves the claim as it was.
        let mut ends = EndsOnDrop(Some(&job.end));
        let finished = shard.run(|b| b.finish_job(job.id, &job.claim, end)).await;
        if finished.as_ref().is_err_and(|e| !may_have_acted(e)) {
            ends.0 = None;
        }
        finished
    }

    /// The shard `job` was claimed on, even if its queue moved since (its row moves only once
    /// its claim ended).
    fn job_home(&self, job: &Job) -> Result<Arc<ShardState>> {
        match job.home.0.upgrade() {
            Some(home) => Ok(home),
            None => Ok(self.state_for(&LockKey::new(&job.queue)?)),
        }
    }

    /// The term of a claim's lease of `lease` written on `shard` by a statement sent after
    /// `sent`.
    fn claim_term(&self, shard: &ShardState, sent: Moment, lease: Duration) -> Term {
        Term {
            sent,
            lease,
            drift_ppm: self.inner.shared.drift_ppm(),
            skew: shard.leases_skew(),
        }
    }
}

/// A claim of [`LockRouter::claim_job`] on its way to its caller: given back in the background
/// ([`LockRouter::release_job`]) if the caller went away before it got it.
struct UnseenClaim {
    claimed: Option<Result<Option<Job>>>,
    router: LockRouter,
}

impl UnseenClaim {
    /// What the claim came to, for its caller.
    fn take(&mut self) -> Result<Option<Job>> {
        self.claimed.take().expect("taken once")
    }
}

impl Drop for UnseenClaim {
    fn drop(&mut self) {
        let Some(Ok(Some(job))) = self.claimed.take() else {
            return;
        };
        let router = self.router.clone();
        let Some(runtime) = router.inner.shared.runtime() else {
            tracing::warn!(queue = job.queue, id = job.id, "shardlock could not give back a job claimed after its caller went away: no runtime left; it is claimed again once its lease runs out");
            return;
        };
        let give_back = async move {
            if let Err(e) = router.release_job(&job).await {
                tracing::warn!(queue = job.queue, id = job.id, error = %shardlock_core::Report(&e), "shardlock could not give back a job claimed after its caller went away; it is claimed again once its lease runs out");
            }
        };
        runtime.spawn(give_back.in_current_span());
    }
}

/// [`LockRouter::claim_job`] on one shard: the job claimed, with the moment the try that
/// answered was sent (its statements wrote the claim's lease, or renewed it, after that).
async fn claim_on(
    shard: &ShardState,
    queue: &str,
    claim: &str,
    lease: Duration,
) -> Result<Option<(ClaimedJob, Moment)>> {
    let mut tries = 0;
    // After a try that may have claimed a job (its reply lost), the next one first looks for
    // the job claimed under this claim token: a claim is never made twice.
    let mut look_first = false;
    // From then on, failures to reach the shard are tried through too, backing off: given up,
    // that claim would be nobody's until its lease ran out (then claimed again, counted as a
    // retry of the job; with none left, failed without having run).
    let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(500));
    loop {
        let sent = Moment::now();
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
            Ok(claimed) => return Ok(claimed.map(|job| (job, sent))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn term(from_now: Duration, lease: Duration) -> Term {
        Term {
            sent: Moment::now() + from_now,
            lease,
            drift_ppm: 0,
            skew: Duration::ZERO,
        }
    }

    /// An extend's answer that arrives after the job was ended (completed, given back) leaves
    /// it ended: the job may be another worker's by then.
    #[test]
    fn an_extend_answered_after_the_job_ended_does_not_revive_it() {
        let end = ClaimEnd::new(term(Duration::ZERO, Duration::from_secs(10)));
        end.ended();
        end.last_until(term(Duration::from_secs(1), Duration::from_secs(60)));
        assert!(end.term().is_none(), "an ended claim was held again");
    }

    /// Extends move the end on, never back.
    #[test]
    fn an_end_moves_on_and_never_back() {
        let end = ClaimEnd::new(term(Duration::ZERO, Duration::from_secs(10)));
        let at = |end: &ClaimEnd| end.term().unwrap().end(0, Duration::ZERO);
        let first = at(&end);
        end.last_until(term(Duration::from_secs(1), Duration::from_secs(2)));
        assert_eq!(at(&end), first, "a shorter extend moved the end back");
        end.last_until(term(Duration::from_secs(1), Duration::from_secs(60)));
        assert!(at(&end) > first + Duration::from_secs(40));
    }
}
