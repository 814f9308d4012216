//! Acquiring a key, in phases: wait for the router to join its fleet (the gate), enter the
//! key's queue (one poller per key in this process; the others wait in memory and may be handed
//! the lease), then poll — take the key on its previous shards if it moved, then on its shard,
//! or fall back per the namespace's failure policy — and hold what was granted. Telemetry
//! wraps the phases ([`LockRouter::acquire_inner`]) rather than being interleaved with them.
//! One statement that may grant runs so that it always completes, whatever the caller does:
//! see [`attempt`].

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use shardlock_core::config::{check_ttl, FailurePolicy, NamespaceConfig, DEFAULT_NAMESPACE};
use shardlock_core::{Backoff, BreakerState, Error, LockKey, Result};
use shardlock_mysql::ReleaseAnswer;
use tokio::time::Instant;

use crate::clock::Moment;
use crate::guard::{Hold, LockGuard, LockMode, LOCAL_FENCE_BIT};
use crate::options::AcquireOptions;
use crate::queue::{Delivery, Entry, Turn, Want};
use crate::router::LockRouter;
use crate::router::{unknown_namespace, LAPSED};
use crate::shard::ShardState;
use crate::shard::{Grant, LeaseState};
use crate::state::instant_after;
use crate::topology::Topology;

mod attempt;

use attempt::Tried;

impl LockRouter {
    /// [`LockRouter::acquire_inner`], with a timeout turned into [`Error::Timeout`].
    pub(crate) async fn acquire_key(
        &self,
        key: LockKey,
        opts: &AcquireOptions,
        wait: Option<Duration>,
    ) -> Result<LockGuard> {
        let started = Instant::now();
        let key = self.scope(key, opts)?;
        match self.acquire_scoped(&key, opts, wait).await? {
            Some(guard) => Ok(guard),
            None => {
                self.inner
                    .shared
                    .stats
                    .timeouts
                    .fetch_add(1, Ordering::Relaxed);
                // Labelled only now: a label is a hash and a formatted string, a tenth of
                // what an in-memory hand-off costs.
                Err(Error::Timeout {
                    key_label: self.inner.shared.telemetry.key_label(&key),
                    waited: started.elapsed(),
                })
            }
        }
    }

    /// `key` in the scope of the namespace of `opts`: its keys are other locks than the same
    /// keys elsewhere when it has a `key-prefix`.
    /// On the path of every acquire: the namespace is looked at, not copied.
    pub(crate) fn scope(&self, key: LockKey, opts: &AcquireOptions) -> Result<LockKey> {
        let topology = self.inner.topology.load();
        let name = opts.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE);
        match topology.config.namespace(name) {
            Some(ns) => Ok(match &ns.key_prefix {
                Some(prefix) => key.scoped(prefix),
                None => key,
            }),
            None => Err(unknown_namespace(name)),
        }
    }

    /// Whether a live lease holds `key` (in the scope of the namespace of `opts`) on its shard:
    /// a read, through the shard's breaker.
    pub(crate) async fn is_held(&self, key: &LockKey, opts: &AcquireOptions) -> Result<bool> {
        let key = self.scope(key.clone(), opts)?;
        let topology = self.inner.topology.load_full();
        let shard = topology.locate(&key);
        shard
            .call(|b| b.inspect(key.stored()))
            .await
            .map(|row| row.is_some_and(|row| row.is_held()))
            .map_err(|e| e.into_error(shard.name()))
    }

    /// Acquires `key`, waiting `wait` (the namespace's when `None`); `Ok(None)` on timeout.
    /// Traced as a `shardlock.acquire` span and measured (see [`crate::telemetry`]).
    pub(crate) async fn acquire_inner(
        &self,
        key: LockKey,
        opts: &AcquireOptions,
        wait: Option<Duration>,
    ) -> Result<Option<LockGuard>> {
        let key = self.scope(key, opts)?;
        self.acquire_scoped(&key, opts, wait).await
    }

    /// [`LockRouter::acquire_inner`] of a key already in its namespace's scope.
    async fn acquire_scoped(
        &self,
        key: &LockKey,
        opts: &AcquireOptions,
        wait: Option<Duration>,
    ) -> Result<Option<LockGuard>> {
        let mut wait = wait;
        // Read before the gate: a lapse counted from here on makes a grant suspect.
        let mut lapses = self.lapses();
        // Closes the gate if the heartbeat lapsed.
        self.inner.notice_lapse();
        let gate = &self.inner.gate;
        // A lapse from being cut off from every shard leaves in-process locks to a namespace
        // that falls back on them. A grant from a shard that passed the closed gate this way
        // is given back below, even if the router has joined again by the time it comes (a
        // reload may have moved the key meanwhile).
        let through_closed_gate = gate.is_lapsed()
            && !gate.is_replaced()
            && self
                .namespace_of(opts)
                .is_ok_and(|ns| ns.on_shard_failure == FailurePolicy::Local);
        if gate.is_closed() && !through_closed_gate {
            // Waiting to join the fleet counts against the caller's wait.
            let budget = match wait {
                Some(w) => w,
                None => opts.wait.unwrap_or(self.namespace_of(opts)?.wait),
            };
            let started = Instant::now();
            // (A replaced router's gate never opens: it answers at once.)
            let opened = gate.opened_or_replaced();
            let _ = tokio::time::timeout_at(instant_after(budget), opened).await;
            lapses = self.joined(key)?;
            wait = Some(budget.saturating_sub(started.elapsed()));
        }
        let granted = self.acquire_joined(key, opts, wait).await?;
        let from_shard = granted
            .as_ref()
            .is_some_and(|guard| guard.mode() != LockMode::LocalFallback);
        let joined = match self.still_joined(key, lapses) {
            Ok(()) if through_closed_gate => Err(self.not_granting(key, LAPSED.to_owned())),
            joined => joined,
        };
        // Nor an in-process lock once another start took this process's id over (a waiter
        // that passed the gate before): it would never be re-acquired on its shard.
        let replaced = granted.is_some() && !from_shard && self.inner.gate.is_replaced();
        if let (true, Err(lapsed)) = (from_shard || replaced, joined) {
            // Never handed out: the caller sees the lapse instead.
            match granted {
                Some(guard) if from_shard => guard.give_back_unseen().await,
                Some(guard) => guard.refuse_local(),
                None => {}
            }
            return Err(lapsed);
        }
        Ok(granted)
    }

    /// [`LockRouter::acquire_inner`] once this router has joined its fleet.
    async fn acquire_joined(
        &self,
        key: &LockKey,
        opts: &AcquireOptions,
        wait: Option<Duration>,
    ) -> Result<Option<LockGuard>> {
        use tracing::Instrument;
        let started = Instant::now();
        let telemetry = &self.inner.shared.telemetry;
        let namespace = opts.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE);
        // Attributes are shardlock's own, under `shardlock.` (OpenTelemetry's convention).
        let span = tracing::info_span!(
            "shardlock.acquire",
            shardlock.namespace = namespace,
            shardlock.shard = tracing::field::Empty,
            shardlock.bucket = key.bucket_number(),
            shardlock.key = tracing::field::Empty,
            shardlock.attempts = tracing::field::Empty,
            shardlock.wait_ms = tracing::field::Empty,
            shardlock.outcome = tracing::field::Empty,
            shardlock.mode = tracing::field::Empty,
        );
        if !span.is_disabled() {
            span.record("shardlock.key", telemetry.key_label(key));
        }
        let mut progress = Progress::default();
        let result = self
            .acquire_steps(key, opts, wait, &mut progress)
            .instrument(span.clone())
            .await;
        let took = started.elapsed();
        let (outcome, mode) = match &result {
            Ok(Some(guard)) if guard.mode() == LockMode::LocalFallback => ("granted", "local"),
            Ok(Some(_)) => ("granted", "remote"),
            Ok(None) => ("timeout", "remote"),
            Err(Error::Unavailable { .. }) => ("unavailable", "remote"),
            Err(_) => ("error", "remote"),
        };
        let shard = progress
            .shard
            .as_ref()
            .map_or_else(|| opentelemetry::StringValue::from(""), |s| s.label.clone());
        if !span.is_disabled() {
            // A waiter handed the lock by its holder links to the holder's hold.
            if let Ok(Some(after)) = result
                .as_ref()
                .map(|g| g.as_ref().and_then(LockGuard::handed_from))
            {
                span.follows_from(after);
            }
            span.record("shardlock.shard", shard.as_str());
            span.record("shardlock.attempts", progress.attempts);
            span.record("shardlock.wait_ms", took.as_secs_f64() * 1000.0);
            span.record("shardlock.outcome", outcome);
            span.record("shardlock.mode", mode);
        }
        let attrs = crate::telemetry::AcquireAttrs {
            namespace: progress
                .namespace
                .take()
                .unwrap_or_else(|| opentelemetry::StringValue::from(namespace.to_owned())),
            shard,
            outcome,
            mode,
        };
        let bound = progress.shard.as_ref().map(|s| &s.acquires);
        telemetry.acquired(key, attrs, took, progress.waited(), bound);
        result
    }

    /// The steps of [`LockRouter::acquire_inner`]; `progress` says how far they got.
    async fn acquire_steps(
        &self,
        key: &LockKey,
        opts: &AcquireOptions,
        wait: Option<Duration>,
        progress: &mut Progress,
    ) -> Result<Option<LockGuard>> {
        if self.inner.shared.is_closed() {
            return Err(Error::Shutdown);
        }
        // One snapshot of the topology for the namespace, the key's shard and the clock's
        // drift: each load and name lookup is on the path of every in-memory hand-off.
        let topology = self.inner.topology.load();
        let name = opts.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE);
        let ns = topology
            .config
            .namespace(name)
            .cloned()
            .ok_or_else(|| unknown_namespace(name))?;
        let ttl = opts.ttl.unwrap_or(ns.ttl);
        check_ttl(ttl).map_err(|reason| Error::InvalidArgument {
            name: "ttl",
            reason,
        })?;
        if let Some(at_least) = opts.at_least {
            check_ttl(at_least).map_err(|reason| Error::InvalidArgument {
                name: "lock_at_least",
                reason,
            })?;
        }
        let deadline = instant_after(wait.or(opts.wait).unwrap_or(ns.wait));
        // A grant of a valid request may follow: its placement is recorded for the fleet.
        if !self.inner.placement.granting(&self.inner.beat_now) {
            return Err(crate::router::operator_tool());
        }
        let shard = topology.locate(key);
        progress.shard = Some(shard.clone());
        progress.namespace = Some(topology.namespace_label(name));
        // `fail-fast` answers at once while the key's shard breaker is open, before waiting in
        // the key's queue behind this process's other callers (a holder whose release waits
        // for the failing shard, say): the shard would refuse it anyway.
        if ns.on_shard_failure == FailurePolicy::FailFast
            && shard.breaker_state() == BreakerState::Open
        {
            return Err(shard.rejected().into_error(shard.name()));
        }
        let drift_ppm = topology.config.instance.clock_drift_ppm();
        drop(topology);

        // One poller per key in this process: the others wait in memory, and may be handed the
        // lease directly by the holder when it releases.
        // A hold that outlasts its release, or a leadership, is never handed over in memory:
        // no fences are set aside for it.
        let handoffs = opts.handoffs && opts.at_least.is_none();
        let want = Want {
            ttl,
            renew_every: ns.renew_interval_for(ttl),
            handoff_max_count: if handoffs { ns.handoff_max_count } else { 0 },
            handoff_max_time: if handoffs {
                ns.handoff_max_time
            } else {
                Duration::ZERO
            },
            drift_ppm,
            // Set per poll, from the shards the grant is made on.
            clock_skew: Duration::ZERO,
            keep_alive: opts.keep_alive,
            at_least: opts.at_least,
            handoffs,
        };
        let turn = match self.enter_queue(key, want, deadline, &ns, progress).await? {
            Entered::Turn(turn) => turn,
            Entered::Answered(answer) => return Ok(answer),
        };
        // Boxed: polling the shard is the large part of an acquire's future, and a caller
        // handed the lease in memory never gets there, yet every acquire's future would be
        // that large, and copied whole each time it moves (a tenth of an in-memory hand-off).
        Box::pin(self.poll(key, want, turn, deadline, (name, &ns), progress)).await
    }

    /// Phase 1: the key's queue in this process. The first comes out with the key's turn (it
    /// polls the shard); the others wait in memory, and may be handed the lease by the holder
    /// when it releases, or get the turn after it.
    async fn enter_queue(
        &self,
        key: &LockKey,
        want: Want,
        deadline: Instant,
        ns: &NamespaceConfig,
        progress: &mut Progress,
    ) -> Result<Entered> {
        Ok(match self.inner.queues.enter(key.stored(), want) {
            Entry::Turn(turn) => Entered::Turn(turn),
            Entry::Queued(mut waiter) => {
                progress.queued = true;
                match tokio::time::timeout_at(deadline, waiter.wait()).await {
                    Err(_) => Entered::Answered(None),
                    Ok(None) => return Err(Error::Shutdown),
                    Ok(Some(Delivery::Granted(handed))) => match handed.downcast::<LockGuard>() {
                        Ok(guard) => Entered::Answered(Some(*guard)),
                        // Only guard.rs hands over, and what it hands is a guard.
                        Err(_) => unreachable!("a key queue hands over lock guards only"),
                    },
                    Ok(Some(Delivery::Turn { turn, yield_first })) => {
                        if yield_first {
                            // The key was released for another process. Its poller sees that our
                            // holds are short and polls every base step, so two base steps give it
                            // the key; longer would leave the key idle when it has nobody waiting.
                            let now = Instant::now();
                            tokio::time::sleep(
                                (ns.backoff_base * 2).min(deadline.saturating_duration_since(now)),
                            )
                            .await;
                        }
                        Entered::Turn(turn)
                    }
                }
            }
        })
    }

    /// Phase 2, with the key's turn: poll until granted or the wait ends. Each poll reads the
    /// placement again (a reload may move the key), takes a moved key on its previous shards
    /// first, then on its shard (or falls back per the namespace's failure policy), and holds
    /// what was granted.
    async fn poll(
        &self,
        key: &LockKey,
        want: Want,
        mut turn: Turn,
        deadline: Instant,
        (name, ns): (&str, &NamespaceConfig),
        progress: &mut Progress,
    ) -> Result<Option<LockGuard>> {
        let mut backoff = Backoff::new(ns.backoff_base, ns.backoff_cap);
        // Set once a grant was given back after a reload: the acquire polls once more under
        // the new placement, even past its wait.
        let mut polled_after_a_reload = false;
        loop {
            if self.inner.shared.is_closed() {
                return Err(Error::Shutdown);
            }
            // Replaced while it polled: it grants nothing again, said at once.
            if self.inner.gate.is_replaced() {
                let why = self.inner.gate.why().unwrap_or_default();
                return Err(self.not_granting(key, why));
            }
            // Placement is read again on every poll: a reload meanwhile moves the key.
            let topology = self.inner.topology.load_full();
            let shard = topology.locate(key).clone();
            let previous = topology.previous_locations(key);
            progress.shard = Some(shard.clone());
            // A key that moved in a recent reload is also taken on the shards it lived on
            // before, in name order, each fence above the previous one; no hand-offs for it.
            // (As raised by a reload since, which the lease is placed by.)
            let clock_skew = previous
                .iter()
                .map(|old| old.leases_skew())
                .fold(shard.leases_skew(), Duration::max);
            // Galera shards end leases locally this much early.
            if want.too_short_for(clock_skew) {
                return Err(Error::InvalidArgument {
                    name: "ttl",
                    reason: format!(
                        "must be above {:?} for key {}: its Galera shard ends leases {clock_skew:?} \
                         early (2 × node-clock-skew), and a lease must last locally past its \
                         first renewal (a third of it) by instance.clock-drift too",
                        clock_skew * 2,
                        self.inner.shared.telemetry.key_label(key)
                    ),
                });
            }
            let want = if previous.is_empty() {
                Want { clock_skew, ..want }
            } else {
                Want {
                    handoff_max_count: 0,
                    handoff_max_time: Duration::ZERO,
                    clock_skew,
                    ..want
                }
            };
            // One owner for the grant's rows on every shard, so that a row where the key lived
            // and the row where it lives now are recognisably the same lease.
            let (_, owner) = self.inner.shared.next_owner();
            let mut companions = CompanionGrants {
                grants: Vec::new(),
                key: key.stored().to_vec(),
                ttl: want.ttl,
            };
            let mut held_for = None;
            let mut floor = 0;
            for old in &previous {
                progress.attempts += 1;
                // Boxed, as the other rare paths of a poll (a key a reload moved, a traced
                // waiter's link): the poll's future, allocated at every acquire that polls,
                // would be as large as its largest path.
                match Box::pin(self.try_grant(old, key, &owner, want, floor, deadline)).await? {
                    Tried::Granted(grant) => {
                        floor = grant.fence;
                        companions.grants.push((old.clone(), grant));
                    }
                    Tried::Busy(held) => {
                        held_for = held;
                        break;
                    }
                }
            }
            if companions.grants.len() == previous.len() {
                progress.attempts += 1;
                let tried = match self
                    .try_grant(&shard, key, &owner, want, floor, deadline)
                    .await
                {
                    Ok(tried) => tried,
                    // A moved key, or a failure that is not the shard's: nothing to fall back on.
                    Err(e) if !previous.is_empty() || !e.is_unavailable() => return Err(e),
                    // The policy as of this poll: a reload that turned `local` off (or removed
                    // the namespace) stops the fallback of acquires under way too, one that
                    // waited in memory behind an in-process holder among them.
                    Err(e) => match topology
                        .config
                        .namespace(name)
                        .map_or(FailurePolicy::FailFast, |ns| ns.on_shard_failure)
                    {
                        FailurePolicy::Local if shard.breaker_state() == BreakerState::Open => {
                            return Ok(Some(self.hold_local(&shard, key, want, turn, &topology)));
                        }
                        // Not open yet, or half-open (its probes under way, the shard likely
                        // back, where another process may hold the key): try again within the
                        // wait; the breaker opens soon if the shard keeps failing.
                        FailurePolicy::Local if Instant::now() < deadline => Tried::Busy(None),
                        _ => return Err(e),
                    },
                };
                if let Tried::Busy(held) = tried {
                    held_for = held;
                    // A traced waiter links, once, to the trace of whoever holds the key.
                    if !progress.linked && crate::telemetry::tracing_current() {
                        progress.linked = true;
                        let trace = Box::pin(shard.call(|b| b.holder_trace(key.stored())));
                        if let Ok(Some(parent)) = trace.await {
                            crate::telemetry::link_current_to(&parent);
                        }
                    }
                }
                if let Tried::Granted(grant) = tried {
                    if self.placed_elsewhere_since(&topology, key) {
                        // Given back before the next poll, which would find its own rows
                        // taken (a try without waiting polls once more): what could not be,
                        // or was not yet when the caller went away, as `companions` drops.
                        companions.grants.push((shard, grant));
                        let mut i = companions.grants.len();
                        while i > 0 {
                            i -= 1;
                            let (at, owner) = {
                                let (at, grant) = &companions.grants[i];
                                (at.clone(), grant.owner.clone())
                            };
                            if companions.grants[i].1.lost_try {
                                // Released whenever it appears, for as long as it could last.
                                let (at, grant) = companions.grants.remove(i);
                                at.watch_lost_try(
                                    key.stored().to_vec(),
                                    grant.owner,
                                    want.ttl,
                                    None,
                                );
                                continue;
                            }
                            // On the router's runtime: a lone release holds its lane's
                            // place while it runs, which a caller's runtime no longer
                            // driven would keep from every later release of the shard.
                            let release = {
                                let (at, key) = (at.clone(), key.stored().to_vec());
                                let shared = at.shared.clone();
                                shared.spawn(async move { at.release(&key, &owner).await })
                            };
                            let released = match release {
                                Some(task) => task.await,
                                None => continue,
                            };
                            if let Ok(Ok(ReleaseAnswer::Released)) = released {
                                companions.grants.remove(i);
                            }
                        }
                        if Instant::now() >= deadline && polled_after_a_reload {
                            return Ok(None);
                        }
                        polled_after_a_reload = true;
                        continue;
                    }
                    let taken = Taken {
                        shard,
                        grant,
                        companions,
                    };
                    match self.hold_grant(key, taken, want, turn, &topology).await? {
                        Held::Guard(guard) => return Ok(Some(guard)),
                        // A previous shard's row ran out, or was taken or freed, since its
                        // grant (a slow shard asked after it, a force-release): the key is
                        // busy there, and this poll's rows are given back. Polled again
                        // within the wait.
                        Held::Busy(back) => {
                            turn = back;
                            let now = Instant::now();
                            if now >= deadline {
                                return Ok(None);
                            }
                            tokio::time::sleep(backoff.next_delay().min(deadline - now)).await;
                            continue;
                        }
                    }
                }
            }
            // Whatever was taken on earlier shards is released as `companions` drops.
            drop(companions);
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            // A key held only briefly is likely to be free again soon (a hot key changing hands):
            // poll again after the base step rather than backing off further.
            if held_for.is_some_and(|ms| u128::from(ms) < ns.backoff_cap.as_millis()) {
                backoff.reset();
            }
            tokio::time::sleep(backoff.next_delay().min(deadline - now)).await;
        }
    }

    /// Phase 3: holds the key `shard` granted. A moved key's rows on its previous shards
    /// (`companions`) get this grant's fence too (a process still placing the key there must
    /// be granted a larger one) and become part of the lease, renewed and released with it;
    /// if any of that fails, every row of the grant is given back as `companions` drops: a
    /// row that ran out or was taken since hands the key's turn back ([`Held::Busy`]).
    async fn hold_grant(
        &self,
        key: &LockKey,
        taken: Taken,
        want: Want,
        turn: Turn,
        topology: &Topology,
    ) -> Result<Held> {
        let Taken {
            shard,
            grant,
            mut companions,
        } = taken;
        let shard = &shard;
        let moved = !companions.grants.is_empty();
        let fence = grant.fence;
        // Given back if the caller goes away while the previous shards' fences are raised
        // (below), like those shards' rows: nothing between here and the guard may leave it.
        let (grant, mut own) = if moved {
            let own = CompanionGrants {
                grants: vec![(shard.clone(), grant)],
                key: companions.key.clone(),
                ttl: companions.ttl,
            };
            (None, Some(own))
        } else {
            (Some(grant), None)
        };
        // The previous shards' rows get this grant's fence too: a process still
        // placing the key there must be granted a larger one.
        let mut failed = None;
        for (old, companion) in &companions.grants {
            // Boxed: rare (a key a reload moved), and the poll's future would be as large.
            let raised =
                Box::pin(old.call_row(|b| b.raise_fence(key.stored(), &companion.owner, fence)));
            let raised = raised.await;
            if !matches!(raised, Ok(true)) {
                failed = Some((old.name().to_owned(), raised));
                break;
            }
        }
        if let Some((name, raised)) = failed {
            // Every row of this grant is given back as `companions` and `own` drop.
            return match raised {
                Err(e) => Err(e.into_error(&name)),
                Ok(_) => Ok(Held::Busy(turn)),
            };
        }
        // Each grant was answered in time, but one may have run out since, while the shards
        // after it were asked: its row may be free there, or another's.
        let mut granted = companions
            .grants
            .iter()
            .chain(own.iter().flat_map(|o| &o.grants));
        if granted.any(|(at, grant)| at.ran_out(&want, grant.sent)) {
            return Ok(Held::Busy(turn));
        }
        if moved {
            self.inner
                .shared
                .stats
                .moved_grants
                .fetch_add(1, Ordering::Relaxed);
        }
        let grant = match own.as_mut() {
            Some(own) => own.grants.pop().expect("kept there when the key moved").1,
            None => grant.expect("kept here when the key did not move"),
        };
        let guard = self.hold(shard, key, grant, want, Some(turn), topology);
        let lease = &guard.hold().lease;
        while let Some((old, grant)) = companions.grants.pop() {
            let companion = Arc::new(
                LeaseState::new(key.clone(), grant, want, Duration::ZERO, None).belonging_to(lease),
            );
            old.insert(companion.clone());
            if !lease.adopt(old.clone(), companion.clone()) {
                // Lost already (the guard reports it): this row and the rest are
                // given back as `companions` drops.
                old.remove(companion.id);
                companions.grants.push((
                    old,
                    Grant {
                        id: companion.id,
                        owner: companion.owner.clone(),
                        fence: 0,
                        reserve: 0,
                        sent: Moment::now(),
                        lost_try: companion.lost_try_may_land.load(Ordering::Acquire),
                    },
                ));
                break;
            }
        }
        Ok(Held::Guard(guard))
    }

    /// An in-process grant while `shard`'s breaker is open (`local` policy). The caller holds
    /// the key's turn, so no other task of this process holds the key; the keeper re-acquires
    /// it on the shard when the shard is back.
    fn hold_local(
        &self,
        shard: &Arc<ShardState>,
        key: &LockKey,
        want: Want,
        turn: Turn,
        topology: &Topology,
    ) -> LockGuard {
        let shared = &self.inner.shared;
        shared.stats.grants.fetch_add(1, Ordering::Relaxed);
        shared.stats.local_grants.fetch_add(1, Ordering::Relaxed);
        let (id, owner) = shared.next_owner();
        // Grant numbers rise in this process, and shard fences never have the top bit.
        let fence = LOCAL_FENCE_BIT | id;
        tracing::debug!(shard = shard.name(), key = shared.telemetry.key_label(key), "shardlock granted a key in process: its shard is unavailable (exclusion inside this process only)");
        let grant = Grant {
            id,
            owner,
            fence,
            reserve: 0,
            sent: Moment::now(),
            lost_try: false,
        };
        let lease =
            Arc::new(LeaseState::local(key.clone(), grant, want, turn).placed_at(topology.epoch));
        shard.insert_local(lease.clone());
        LockGuard::new(Hold::new(lease, shard.clone(), fence))
    }

    /// The guard of a fresh grant made under `topology`: its lease is registered with the
    /// shard's keeper (and follows its key if a reload came meanwhile).
    fn hold(
        &self,
        shard: &Arc<ShardState>,
        key: &LockKey,
        grant: Grant,
        want: Want,
        turn: Option<Turn>,
        topology: &Topology,
    ) -> LockGuard {
        self.inner
            .shared
            .stats
            .grants
            .fetch_add(1, Ordering::Relaxed);
        let fence = grant.fence;
        let lease = Arc::new(
            LeaseState::new(key.clone(), grant, want, want.handoff_max_time, turn)
                .placed_at(topology.epoch),
        );
        shard.insert(lease.clone());
        LockGuard::new(Hold::new(lease, shard.clone(), fence))
    }
}

/// How far an acquire got, for its span and metrics.
#[derive(Debug, Default)]
struct Progress {
    shard: Option<Arc<ShardState>>,
    namespace: Option<opentelemetry::StringValue>,
    attempts: u32,
    /// Waited in memory behind another task of this process.
    queued: bool,
    /// Linked to the trace of the key's holder in another process.
    linked: bool,
}

impl Progress {
    /// Whether the caller waited for the key (queued, or polled the shard more than once).
    fn waited(&self) -> bool {
        self.queued || self.attempts > 1
    }
}

/// How a caller came out of the key's queue in this process.
enum Entered {
    /// With the key's turn: it polls the shard.
    Turn(Turn),
    /// With its answer already: handed the lease in memory, or the wait ended.
    Answered(Option<LockGuard>),
}

/// What came of holding a poll's grant (`hold_grant`).
enum Held {
    /// The key is the caller's.
    Guard(LockGuard),
    /// A row on a previous shard was no longer surely this grant's once the others were
    /// taken (it ran out meanwhile, or was taken or freed): the key is busy. The key's turn
    /// comes back for the next poll.
    Busy(Turn),
}

/// What a poll took: the grant on the key's shard, and those on its previous shards (a moved
/// key), which become the lease's companion rows.
#[derive(Debug)]
struct Taken {
    shard: Arc<ShardState>,
    grant: Grant,
    companions: CompanionGrants,
}

/// Grants of a moved key not yet part of a guard: those on its previous shards while its new
/// shard is still to be tried, and the new shard's own while the previous shards' fences are
/// raised (`hold_grant`). Released in the background if the acquire does not end in a guard,
/// retried until the shard answers (or the row can have ended), as a failed release is.
#[derive(Debug)]
struct CompanionGrants {
    grants: Vec<(Arc<ShardState>, Grant)>,
    /// The key, as stored.
    key: Vec<u8>,
    /// The lease's ttl: how long a row left behind would block the key.
    ttl: Duration,
}

impl Drop for CompanionGrants {
    fn drop(&mut self) {
        for (shard, grant) in self.grants.drain(..) {
            match grant.lost_try {
                // A try before it may still land and take the row again.
                true => shard.watch_lost_try(self.key.clone(), grant.owner, self.ttl, None),
                false => shard.release_later(self.key.clone(), grant.owner, self.ttl),
            }
        }
    }
}
