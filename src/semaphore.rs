//! Semaphores: up to N holders of one name across every process, each permit a lease.
//!
//! A semaphore's permits are slot rows: the buckets `0..permits` of its name (see
//! [`LockRouter::acquire_bucket`]), each a lease of its own on its own shard. A permit is
//! whichever slot is free, so at most `permits` are held at once, each with its own fence,
//! renewal and lost signal, and a crashed holder's permit returns when its lease ends.

use std::time::Duration;

use shardlock_core::config::MAX_BUCKETS;
use shardlock_core::{Backoff, Error, LockKey, Result};
use tokio::time::Instant;

use crate::state::instant_after;
use crate::{AcquireOptions, LockGuard, LockMode, LockRouter};

/// A semaphore of `permits` permits named `name`, made by [`LockRouter::semaphore`]. Cheap to
/// clone; every process that uses the name must give the same number of permits (one that
/// gives more lets more holders in). Each call's options scope the slots as they scope any key
/// (a namespace's `key-prefix`): calls under two such namespaces use two semaphores.
#[derive(Debug, Clone)]
pub struct Semaphore {
    router: LockRouter,
    name: String,
    permits: u32,
}

/// One permit of a [`Semaphore`]: a lease on one of its slots. Release it with
/// [`Permit::release`]; dropping it releases in the background.
#[derive(Debug)]
#[must_use = "dropping the permit releases it at once"]
pub struct Permit {
    guard: LockGuard,
}

impl Permit {
    /// Which slot (0-based, below the permit count) this permit holds.
    pub fn slot(&self) -> u32 {
        self.guard.bucket().expect("a permit is a slot lease")
    }

    /// The fencing token of this grant of the slot: larger than every earlier one of the slot.
    pub fn fence(&self) -> u64 {
        self.guard.fence()
    }

    /// The lease behind the permit: `is_held`, `lost`, `extend`, fenced writes.
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }

    /// Gives the permit back. Errors as for [`LockGuard::release`].
    pub async fn release(self) -> Result<()> {
        self.guard.release().await
    }
}

impl LockRouter {
    /// The semaphore `name` with `permits` permits (1 to 1024). Its permits are the buckets of
    /// the key `name`: a semaphore, an rw-lock and bucketed acquires of one name share rows;
    /// give each its own name. A waiter tries every permit held by another process once per
    /// backoff step (a statement each at least, as any acquire: more for a key a reload moved,
    /// or with its holder's trace recorded): many waiters on many permits cost their shards
    /// that many statements.
    pub fn semaphore(&self, name: &str, permits: u32) -> Result<Semaphore> {
        check_slots(name, permits, "permits")?;
        Ok(Semaphore {
            router: self.clone(),
            name: name.to_owned(),
            permits,
        })
    }
}

impl Semaphore {
    /// The number of permits.
    pub fn permits(&self) -> u32 {
        self.permits
    }

    /// Takes a permit, waiting up to the wait of `opts` (its namespace's if not set): every
    /// slot is tried once per round, from a random one on, with the namespace's backoff
    /// between rounds. [`Error::Timeout`] if none came free in time. Errors and cancellation
    /// as for [`LockRouter::acquire`].
    pub async fn acquire(&self, opts: AcquireOptions) -> Result<Permit> {
        let ns = self.router.namespace_of(&opts)?;
        let started = Instant::now();
        let deadline = instant_after(opts.wait.unwrap_or(ns.wait));
        let mut backoff = Backoff::new(ns.backoff_base, ns.backoff_cap);
        loop {
            if let Some(permit) = self.try_round(&opts).await? {
                return Ok(permit);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(slots_timeout(&self.router, &self.name, &opts, started));
            }
            tokio::time::sleep(backoff.next_delay().min(deadline - now)).await;
        }
    }

    /// Tries every slot once: `Ok(None)` when all are held.
    pub async fn try_acquire(&self, opts: AcquireOptions) -> Result<Option<Permit>> {
        self.try_round(&opts).await
    }

    async fn try_round(&self, opts: &AcquireOptions) -> Result<Option<Permit>> {
        let guard = take_a_slot(&self.router, &self.name, self.permits, opts).await?;
        Ok(guard.map(|guard| Permit { guard }))
    }
}

/// The timeout of a wait for a slot of `name`, counted as an acquire's and naming the lock as
/// its spans do.
pub(crate) fn slots_timeout(
    router: &LockRouter,
    name: &str,
    opts: &AcquireOptions,
    started: Instant,
) -> Error {
    let shared = &router.inner.shared;
    shared
        .stats
        .timeouts
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // The name was checked when the semaphore was made; its scope is gone only if a reload
    // removed its namespace meanwhile, and then it is labelled unscoped.
    let key_label = match LockKey::new(name) {
        Ok(key) => match router.scope(key.clone(), opts) {
            Ok(scoped) => shared.telemetry.key_label(&scoped),
            Err(_) => shared.telemetry.key_label(&key),
        },
        Err(_) => LockKey::name_label_hash(name),
    };
    Error::Timeout {
        key_label,
        waited: started.elapsed(),
    }
}

/// Checks a name of slot rows and how many it has (`field`: what the caller calls them).
pub(crate) fn check_slots(name: &str, count: u32, field: &'static str) -> Result<()> {
    LockKey::new(name)?;
    if count == 0 || count > MAX_BUCKETS {
        return Err(Error::InvalidArgument {
            name: field,
            reason: format!("must be between 1 and {MAX_BUCKETS}, got {count}"),
        });
    }
    Ok(())
}

/// One try of every slot `0..count` of `name`, from a random one on. A slot whose shard
/// cannot be reached is passed over (another may be free); when none could be reached, the
/// last such error is the answer.
pub(crate) async fn take_a_slot(
    router: &LockRouter,
    name: &str,
    count: u32,
    opts: &AcquireOptions,
) -> Result<Option<LockGuard>> {
    let first = rand::random::<u32>() % count;
    let mut unavailable = None;
    let mut reached = false;
    for offset in 0..count {
        let slot = LockKey::bucket(name, (first + offset) % count)?;
        match remote_slot(router, slot, opts).await {
            Ok(Some(guard)) => return Ok(Some(guard)),
            Ok(None) => reached = true,
            Err(e) if e.is_unavailable() => unavailable = Some(e),
            Err(e) => return Err(e),
        }
    }
    match unavailable {
        Some(e) if !reached => Err(e),
        _ => Ok(None),
    }
}

/// Tries a slot once, through its shard only: an in-process lock of a slot (the `local`
/// failure policy while its shard is down) counts nowhere else, so it would let more holders
/// in than the slots allow; it is given back and the slot answers as unavailable.
pub(crate) async fn remote_slot(
    router: &LockRouter,
    slot: LockKey,
    opts: &AcquireOptions,
) -> Result<Option<LockGuard>> {
    match router
        .acquire_inner(slot, opts, Some(Duration::ZERO))
        .await?
    {
        Some(guard) if guard.mode() != crate::LockMode::Remote => {
            let shard = guard.shard().to_owned();
            guard.refuse_local();
            Err(local_refused(shard))
        }
        other => Ok(other),
    }
}

/// Why an in-process grant is refused where only shard grants count.
pub(crate) fn local_refused(shard: String) -> Error {
    Error::Unavailable {
        shard,
        source: shardlock_core::BackendError::new(
            shardlock_core::BackendErrorKind::BreakerOpen,
            None,
            "only a lease on the shard counts here, and the shard's breaker is open",
        ),
    }
}

/// Takes every key of `parts` (a write hold's intent and reader slots, every bucket of a key),
/// in the order given, all within the wait of `opts`; with `remote_only`, a part granted in
/// process (the `local` failure policy) is refused, as it would exclude nobody elsewhere.
/// `name` labels a timeout.
///
/// Handed out only if every part is still held once the last is taken: one taken early may
/// have ended while the later ones were waited for (its ttl ran out under `lock_at_most`, its
/// renewals were cut off or paused), and another may hold its key now. Then every part is
/// given back and all are sought again, until the wait runs out. Parts never handed out (an
/// error, a caller that gave up) are given back as grants their caller never saw: no minimum
/// hold (`lock_at_least`) is kept for a hold that never ran.
pub(crate) async fn take_every_part(
    router: &LockRouter,
    name: &str,
    parts: &[LockKey],
    opts: &AcquireOptions,
    remote_only: bool,
) -> Result<Vec<LockGuard>> {
    let ns = router.namespace_of(opts)?;
    let started = Instant::now();
    let deadline = instant_after(opts.wait.unwrap_or(ns.wait));
    let mut backoff = Backoff::new(ns.backoff_base, ns.backoff_cap);
    loop {
        let mut taken = Unseen(Vec::with_capacity(parts.len()));
        for part in parts {
            let left = deadline.saturating_duration_since(Instant::now());
            let guard = router.acquire_key(part.clone(), opts, Some(left)).await?;
            let local = guard.mode() != LockMode::Remote;
            let shard = guard.shard().to_owned();
            taken.0.push(guard);
            if remote_only && local {
                return Err(local_refused(shard));
            }
        }
        if taken.0.iter().all(LockGuard::is_held) {
            return Ok(std::mem::take(&mut taken.0));
        }
        // Waited for within the wait only: past it, they are given back in the background.
        if Instant::now() < deadline {
            let _ = tokio::time::timeout_at(deadline, taken.give_back()).await;
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(slots_timeout(router, name, opts, started));
        }
        tokio::time::sleep(backoff.next_delay().min(deadline - now)).await;
    }
}

/// Parts of a hold not (yet) handed out: given back, when dropped, as grants their caller
/// never saw.
struct Unseen(Vec<LockGuard>);

impl Unseen {
    /// Gives every part back, and waits for their releases.
    async fn give_back(mut self) {
        let releases: Vec<_> = self.0.drain(..).filter_map(give_back).collect();
        for release in releases {
            let _ = release.await;
        }
    }
}

impl Drop for Unseen {
    fn drop(&mut self) {
        for guard in self.0.drain(..) {
            drop(give_back(guard));
        }
    }
}

/// Gives back a part never handed out: its release's task, if it has one.
fn give_back(guard: LockGuard) -> Option<tokio::task::JoinHandle<Result<()>>> {
    match guard.mode() {
        LockMode::LocalFallback => {
            guard.refuse_local();
            None
        }
        LockMode::Remote => guard.give_back_unseen_later(),
    }
}
