//! Leader election over the lease lock: one leader per name across every process, with a term
//! that only goes up.
//!
//! A leadership is the lease of the key `name`, taken through the shard only (an in-process
//! lock elects nobody) and never handed over in memory, so every term is the fence of a shard
//! grant, above every earlier term of the name, and the row always names the leader.

use std::time::Duration;

use shardlock_core::Result;

use crate::{AcquireOptions, LockGuard, LockMode, LockRouter};

/// How long one acquire of a campaign waits before it asks again (placement and policy are
/// read again on every poll anyway; this only bounds one call).
const CAMPAIGN_WAIT: Duration = Duration::from_secs(60);

/// How long a campaign pauses after the name's shard could not elect anyone (unreachable, or
/// only an in-process lock was granted).
const CAMPAIGN_PAUSE: Duration = Duration::from_millis(500);

/// This process leads `name` while it lives and [`Leadership::is_leader`] is true.
///
/// The leadership is a lease: renewed in the background, lost when renewals fail for longer
/// than its ttl or when it is force-released. Check [`Leadership::is_leader`] before acting as
/// leader, or race the work against [`Leadership::lost`]; guard writes with the term
/// ([`crate::fenced_exec`] with [`Leadership::guard`]) so a leader that paused past its lease
/// cannot overwrite its successor's work. Dropping it resigns.
#[derive(Debug)]
#[must_use = "dropping the leadership resigns at once"]
pub struct Leadership {
    guard: LockGuard,
}

impl Leadership {
    /// The term: the fence of this leadership's grant, larger than every earlier term of the
    /// name.
    pub fn term(&self) -> u64 {
        self.guard.fence()
    }

    /// The name led.
    pub fn name(&self) -> &str {
        self.guard.key()
    }

    /// Whether this process still surely leads (see [`LockGuard::is_held`]).
    pub fn is_leader(&self) -> bool {
        self.guard.is_held()
    }

    /// Completes when the leadership is lost. Cancel-safe.
    pub async fn lost(&self) {
        self.guard.lost().await
    }

    /// The lease behind the leadership, for fenced writes.
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }

    /// Gives the leadership up: the next campaigner is elected at its next poll. Errors as
    /// for [`LockGuard::release`].
    pub async fn resign(self) -> Result<()> {
        self.guard.release().await
    }
}

/// Who leads a name, as its row on the shard says.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leader {
    /// The leader's instance id (`instance.id`). Not who leads: a process restarted under
    /// the same id shares it with its earlier start, whose leadership may still be live.
    /// Tell leaderships apart by `owner`, or ask [`Leadership::is_leader`].
    pub instance_id: String,
    /// The owner written by the leader's grant: `<instance id>:<start nonce>:<grant seq>`.
    pub owner: String,
    /// The leader's term.
    pub term: u64,
    /// Until its lease ends unless renewed, by the shard's clock.
    pub expires_in: Duration,
}

impl LockRouter {
    /// Campaigns for the leadership of `name` until elected: the first campaigner leads, the
    /// others wait (polling as any acquire does) and the next one is elected when the leader
    /// resigns, or when its lease ends after it died or lost its shard. A lost [`Leadership`]
    /// kept alive in this process still holds the name's turn here (no second holder of a key
    /// in one process while a guard of it lives): drop it before campaigning again. `opts` gives the
    /// namespace and ttl (its `wait` is ignored: wrap the call in a timeout to bound it).
    /// While the name's shard cannot elect anyone the campaign waits for it.
    ///
    /// Returns early only with an error that waiting cannot mend: an invalid name or options,
    /// [`crate::Error::Shutdown`], or the router's refusal once another start took its instance
    /// id over (it never grants again).
    ///
    /// Cancellation: as for [`LockRouter::acquire`]; no leadership is left behind.
    pub async fn campaign(&self, name: &str, opts: AcquireOptions) -> Result<Leadership> {
        loop {
            let opts = opts.clone().wait(CAMPAIGN_WAIT);
            match self.lead(name, opts).await {
                Ok(Some(leadership)) => return Ok(leadership),
                // Not elected within the wait: ask again.
                Ok(None) => tokio::time::sleep(CAMPAIGN_PAUSE).await,
                Err(e) if e.is_unavailable() && !self.inner.gate.is_replaced() => {
                    tokio::time::sleep(CAMPAIGN_PAUSE).await
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Takes the leadership of `name` if nobody holds it: `Ok(None)` when another process (or
    /// task) leads, or when the name's shard is unavailable and only an in-process lock could
    /// be had. Errors as for [`LockRouter::try_acquire`].
    pub async fn try_lead(&self, name: &str, opts: AcquireOptions) -> Result<Option<Leadership>> {
        match self.lead(name, opts.wait(Duration::ZERO)).await {
            Err(e) if e.is_unavailable() => Ok(None),
            other => other,
        }
    }

    /// Takes the leadership of `name` through its shard: `Ok(None)` when another holds it
    /// within the wait of `opts`; an in-process lock (the `local` policy) is refused as the
    /// shard's unavailability.
    pub(crate) async fn lead(
        &self,
        name: &str,
        mut opts: AcquireOptions,
    ) -> Result<Option<Leadership>> {
        opts.handoffs = false;
        let key = shardlock_core::LockKey::new(name)?;
        let wait = opts.wait;
        let Some(guard) = self.acquire_inner(key, &opts, wait).await? else {
            return Ok(None);
        };
        if guard.mode() != LockMode::Remote {
            // Elected through the shard only: an in-process lock elects nobody.
            let shard = guard.shard().to_owned();
            guard.refuse_local();
            return Err(crate::semaphore::local_refused(shard));
        }
        Ok(Some(Leadership { guard }))
    }

    /// Who leads `name` now, if anyone, as the rows on its shards say (`opts` names the
    /// namespace campaigned in, for its key scope): where the name lives, and while a reload's
    /// move is in force where it lived before (a leader that has not reloaded holds it there).
    /// A read only: a leader whose process died is reported until its lease ends. The term is
    /// the lowest fence of the leader's rows read: its grant's while the move is in force (a
    /// leadership that followed its name to a new shard has a higher fence there), the new
    /// shard's row's once only that is read. A shard the name lived on before that does not
    /// answer is passed over.
    pub async fn leader(&self, name: &str, opts: AcquireOptions) -> Result<Option<Leader>> {
        let key = self.scope(shardlock_core::LockKey::new(name)?, &opts)?;
        let shards = {
            let topology = self.inner.topology.load();
            let mut shards = vec![topology.locate(&key).clone()];
            shards.extend(topology.previous_locations(&key));
            shards
        };
        let mut leader: Option<Leader> = None;
        for (i, shard) in shards.iter().enumerate() {
            let row = match shard.unguarded().inspect(key.stored()).await {
                Ok(row) => row,
                Err(_) if i > 0 => continue,
                Err(e) => return Err(e.into_error(shard.name())),
            };
            let Some(row) = row.filter(|row| row.is_held()) else {
                continue;
            };
            let Some(owner) = row.owner else { continue };
            let expires_in = Duration::from_millis(row.expires_in_ms.max(0) as u64);
            match &mut leader {
                // Another row of the same leadership: the lower fence is its grant's, and it
                // lasts as long as its row that ends first.
                Some(l) if l.owner == owner => {
                    l.term = l.term.min(row.fence);
                    l.expires_in = l.expires_in.min(expires_in);
                }
                Some(_) => {}
                None => {
                    // `<instance id>:<nonce>:<seq>` (instance ids have no ':').
                    let Some(instance_id) = owner.rsplitn(3, ':').nth(2).map(str::to_owned) else {
                        continue;
                    };
                    leader = Some(Leader {
                        instance_id,
                        term: row.fence,
                        expires_in,
                        owner,
                    });
                }
            }
        }
        Ok(leader)
    }
}
