//! Read/write locks: many readers or one writer per name, across every process.
//!
//! Built from leases. A reader holds one of the name's reader slots (buckets `0..readers` of
//! the name); a writer first takes the name's writer intent (its bucket `u32::MAX`), which
//! turns new readers away, then every reader slot in order, waiting for the readers inside to
//! leave. So a writer excludes every reader and every other writer, readers share, and a
//! waiting writer is not starved by a stream of readers. Every part is a lease: renewed, ended
//! by its ttl if its holder dies, reported lost.
//!
//! Writers go first: while writers follow each other without a gap (several tasks of one
//! process writing in turn, handed the intent in memory), readers wait, and may time out.
//! Readers have no fence. A writer paused past its lease (stopped, swapped out) whose write
//! lands later can land while readers hold the lock: [`WriteGuard::fence`] orders writers
//! against writers only. Guard data that readers must see unchanged with a version the
//! writer's fenced write moves on, and check it after reading.

use futures_util::future::select_all;
use shardlock_core::{Backoff, LockKey, Result};
use tokio::time::Instant;

use crate::semaphore::{check_slots, slots_timeout, take_a_slot, take_every_part};
use crate::state::instant_after;
use crate::{AcquireOptions, LockGuard, LockRouter};

/// The bucket of a name that is its writer intent.
const WRITER_INTENT: u32 = u32::MAX;

/// A read/write lock made by [`LockRouter::rw_lock`]. Cheap to clone; every process that uses
/// the name must give the same reader count (a writer takes only the slots it counts, so one
/// counting fewer can write while a reader holds a slot above its count). Each call's options
/// scope the slots as they scope any key (a namespace's `key-prefix`): reads and writes under
/// two such namespaces are of two locks.
#[derive(Debug, Clone)]
pub struct RwLock {
    router: LockRouter,
    name: String,
    readers: u32,
}

/// A read hold: one reader slot.
#[derive(Debug)]
#[must_use = "dropping the read guard releases it at once"]
pub struct ReadGuard {
    slot: LockGuard,
}

/// A write hold: the writer intent and every reader slot.
#[derive(Debug)]
#[must_use = "dropping the write guard releases it at once"]
pub struct WriteGuard {
    /// Before `intent`: dropped, the slots go first, as `release` frees them (freed first, the
    /// intent let the next writer in to wait for slots still held).
    slots: Vec<LockGuard>,
    intent: LockGuard,
}

impl ReadGuard {
    /// Whether the read hold is surely still this process's.
    pub fn is_held(&self) -> bool {
        self.slot.is_held()
    }

    /// Completes when the read hold is lost. Cancel-safe.
    pub async fn lost(&self) {
        self.slot.lost().await
    }

    /// Releases the read hold. Errors as for [`LockGuard::release`].
    pub async fn release(self) -> Result<()> {
        self.slot.release().await
    }
}

impl WriteGuard {
    /// The fence of this write hold (the writer intent's grant): larger than every earlier
    /// writer's of the name.
    pub fn fence(&self) -> u64 {
        self.intent.fence()
    }

    /// Whether every lease of the write hold is surely still this process's.
    pub fn is_held(&self) -> bool {
        self.intent.is_held() && self.slots.iter().all(LockGuard::is_held)
    }

    /// Completes when any lease of the write hold is lost: stop writing. Cancel-safe.
    pub async fn lost(&self) {
        let all = std::iter::once(&self.intent)
            .chain(&self.slots)
            .map(|g| Box::pin(g.lost()));
        select_all(all).await;
    }

    /// Releases the write hold: the reader slots first, then the intent. Returns the first
    /// error, after releasing everything.
    pub async fn release(self) -> Result<()> {
        let mut first = Ok(());
        for guard in self.slots.into_iter().chain(std::iter::once(self.intent)) {
            if let Err(e) = guard.release().await {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

impl LockRouter {
    /// The read/write lock `name`, letting up to `readers` readers (1 to 1024) in at once;
    /// a writer takes `readers + 1` leases, so keep it near the readers you expect. Its slots
    /// are the buckets of the key `name` (as a semaphore's permits are): a semaphore, an
    /// rw-lock and bucketed acquires of one name share rows; give each its own name.
    pub fn rw_lock(&self, name: &str, readers: u32) -> Result<RwLock> {
        check_slots(name, readers, "readers")?;
        Ok(RwLock {
            router: self.clone(),
            name: name.to_owned(),
            readers,
        })
    }
}

impl RwLock {
    /// Takes a read hold, waiting up to the wait of `opts` while a writer holds or waits for
    /// the lock (or every reader slot is taken). [`crate::Error::Timeout`] if not in time; errors and
    /// cancellation as for [`LockRouter::acquire`].
    pub async fn read(&self, opts: AcquireOptions) -> Result<ReadGuard> {
        let ns = self.router.namespace_of(&opts)?;
        let started = Instant::now();
        let deadline = instant_after(opts.wait.unwrap_or(ns.wait));
        let mut backoff = Backoff::new(ns.backoff_base, ns.backoff_cap);
        let intent = self.part(WRITER_INTENT)?;
        loop {
            // A writer holds or waits: let it go first. (Only for the writer's turn: exclusion
            // rests on the slots, so an intent that cannot be read is taken as absent.)
            let writer = match self.router.is_held(&intent, &opts).await {
                Ok(writer) => writer,
                Err(e) if e.is_unavailable() => false,
                Err(e) => return Err(e),
            };
            if !writer {
                // No slot's shard could be reached: an error, as for an unavailable key.
                if let Some(slot) =
                    take_a_slot(&self.router, &self.name, self.readers, &opts).await?
                {
                    return Ok(ReadGuard { slot });
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(slots_timeout(&self.router, &self.name, &opts, started));
            }
            tokio::time::sleep(backoff.next_delay().min(deadline - now)).await;
        }
    }

    /// Takes the write hold: the writer intent, then every reader slot in order, all within
    /// the wait of `opts`, handed out only if every part is still held once the last is
    /// taken (one may have ended meanwhile: a short ttl, a pause; then all are given back and
    /// taken again within the wait). On failure what was taken is given back. Errors and cancellation as
    /// for [`LockRouter::acquire_all_buckets`]. There is no upgrade: a task that holds a read
    /// hold of this lock waits here for its own slot until the wait runs out (new readers are
    /// turned away meanwhile, the writer's intent held); release it first.
    pub async fn write(&self, opts: AcquireOptions) -> Result<WriteGuard> {
        // Only leases on the shards count: an in-process lock (the `local` policy) would
        // exclude nobody elsewhere.
        let parts = std::iter::once(WRITER_INTENT)
            .chain(0..self.readers)
            .map(|part| self.part(part))
            .collect::<Result<Vec<_>>>()?;
        let mut taken = take_every_part(&self.router, &self.name, &parts, &opts, true).await?;
        let slots = taken.split_off(1);
        let intent = taken.pop().expect("the intent is the first part");
        Ok(WriteGuard { intent, slots })
    }

    fn part(&self, bucket: u32) -> Result<LockKey> {
        LockKey::bucket(&self.name, bucket)
    }
}
