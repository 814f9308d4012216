//! The per-shard circuit breaker, as a state machine with no I/O and no clock of its own:
//! every call passes `now`, so tests drive time by hand.
//!
//! Closed → Open when, over a sliding window, the failure rate passes its threshold (once the
//! window holds a minimum number of calls) or N calls in a row failed; slow calls count as
//! failures. Open → HalfOpen after a cool-down that doubles (up to a cap) each time probes fail.
//! HalfOpen admits a bounded number of probes: enough successes close it, any failure opens
//! it again. Only infrastructure failures are recorded as failures by the caller — a busy lock
//! is a success for the breaker.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The sliding window is kept as this many slots: memory and time per call stay constant at
/// any call rate, and the window's far edge is exact to a tenth of its length, which is as
/// much as a failure-rate threshold needs.
const WINDOW_SLOTS: u64 = 10;

/// Breaker thresholds (YAML section `breaker`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
#[non_exhaustive]
pub struct BreakerConfig {
    /// Open when at least this share of the calls in the window failed (0.0-1.0).
    pub failure_rate: f64,
    /// The sliding window the rate is taken over.
    #[serde(with = "humantime_serde")]
    pub window: Duration,
    /// The rate counts only once the window holds this many calls.
    pub min_calls: u32,
    /// Open after this many failures in a row, whatever the rate.
    pub consecutive_failures: u32,
    /// A call slower than this counts as a failure.
    #[serde(with = "humantime_serde")]
    pub slow_call: Duration,
    /// First cool-down before probing an open shard.
    #[serde(with = "humantime_serde")]
    pub cooldown: Duration,
    /// Longest cool-down (it doubles each time probing fails).
    #[serde(with = "humantime_serde")]
    pub max_cooldown: Duration,
    /// Probes admitted at once while half-open; this many successes close the breaker.
    pub probes: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            // Half the calls failing is an outage, not noise.
            failure_rate: 0.5,
            window: Duration::from_secs(10),
            // Fewer calls than this say little about a rate.
            min_calls: 20,
            // A dead shard fails every call: open after a handful, even at low traffic.
            consecutive_failures: 5,
            // A lock statement is a primary-key write; a second means the shard is in trouble.
            slow_call: Duration::from_secs(1),
            // A restarted or failed-over shard is often back within seconds: probe soon.
            cooldown: Duration::from_secs(1),
            // A shard down for long still gets a probe every 30 s, so recovery is noticed
            // within that, while a dead shard costs each process two probes a minute.
            max_cooldown: Duration::from_secs(30),
            // One lucky answer does not close it, and few callers are exposed to a shard
            // that is still sick.
            probes: 3,
        }
    }
}

/// Where a breaker is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum BreakerState {
    /// Calls go through.
    Closed,
    /// Calls are refused until the cool-down ends.
    Open,
    /// A few probes go through; their outcome decides.
    HalfOpen,
}

impl BreakerState {
    /// Its name as `status` prints it.
    pub fn name(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half-open",
        }
    }

    /// Its value in the `shardlock.breaker.state` gauge: 0 closed, 1 half-open, 2 open (the
    /// higher, the worse).
    pub fn gauge(self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen => 1,
            BreakerState::Open => 2,
        }
    }

    /// The state a gauge value stands for.
    pub fn from_gauge(value: i64) -> Option<Self> {
        match value {
            0 => Some(BreakerState::Closed),
            1 => Some(BreakerState::HalfOpen),
            2 => Some(BreakerState::Open),
            _ => None,
        }
    }
}

/// How a call went, as far as the breaker is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// Answered (a busy lock included).
    Success,
    /// An infrastructure failure: connect error, timeout, server gone, read-only, ...
    Failure,
}

/// What [`Breaker::admit`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Go ahead; report with this ticket.
    Call(CallTicket),
    /// Go ahead as one of the half-open probes; report with this ticket, or hand it to
    /// [`Breaker::abandon_probe`] if the call never completes.
    Probe(ProbeTicket),
    /// Refused: the breaker is open (or all probe slots are taken).
    Rejected,
}

impl Admission {
    /// The ticket to report the admitted call with; `None` when it was refused.
    pub fn ticket(self) -> Option<Ticket> {
        match self {
            Admission::Call(ticket) => Some(Ticket::Call(ticket)),
            Admission::Probe(ticket) => Some(Ticket::Probe(ticket)),
            Admission::Rejected => None,
        }
    }
}

/// How a call was admitted, for [`Breaker::record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ticket {
    /// While closed.
    Call(CallTicket),
    /// As a half-open probe.
    Probe(ProbeTicket),
}

/// Which closed spell a call was admitted in. A call that completes in a later one (the
/// breaker opened, and closed again, while it was on its way: a statement that waits out its
/// timeout) says how the shard was before, and is not counted in the new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallTicket(u64);

/// Which half-open spell a probe was admitted in. A probe that completes after its spell
/// ended (a failed probe beside it reopened the breaker, and the next spell began) is not
/// counted in the new one: neither its slot, which the new spell never gave it, nor its
/// outcome, which says how the shard was before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeTicket(u64);

/// A transition, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    /// From this state.
    pub from: BreakerState,
    /// To this state.
    pub to: BreakerState,
}

/// One shard's breaker.
///
/// A plain value with no I/O, kept behind a lock by whoever holds the shard (the facade's
/// shard handle). Every admitted call must be answered by exactly one [`Breaker::record`] or,
/// for a probe, [`Breaker::abandon_probe`]: a probe slot never given back stays taken, and
/// once all are, the half-open breaker rejects every call from then on.
#[derive(Debug, Clone)]
pub struct Breaker {
    config: BreakerConfig,
    state: BreakerState,
    /// Calls in the window, counted per tenth of it (constant memory and time per call,
    /// whatever the rate): (slot number, calls, failures), oldest first.
    calls: VecDeque<(u64, u32, u32)>,
    /// Slot 0 starts here (the first call recorded).
    epoch: Option<Instant>,
    /// Failures in a row while closed; any success resets it.
    consecutive: u32,
    /// When the current cool-down ends. `state` stays `Open` past it until the next
    /// [`Breaker::admit`] moves it, so that [`Breaker::state`] can read half-open through
    /// `&self` (for status and gauges) without changing anything.
    open_until: Option<Instant>,
    /// The cool-down of the current (or next) open spell: doubled by each failed probe,
    /// back to the configured one when the breaker closes or trips from closed.
    cooldown: Duration,
    /// Probes of this half-open spell admitted and not yet reported.
    probes_in_flight: u32,
    /// Successful probes of this half-open spell; `config.probes` of them close it.
    probe_successes: u32,
    /// Half-open spells begun so far: the current one's number, on its probes' tickets.
    spell: u64,
    /// Closed spells begun so far (the first when built): the current one's number, on its
    /// calls' tickets.
    closings: u64,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(config: BreakerConfig) -> Self {
        let cooldown = config.cooldown;
        Self {
            config,
            state: BreakerState::Closed,
            calls: VecDeque::new(),
            epoch: None,
            consecutive: 0,
            open_until: None,
            cooldown,
            probes_in_flight: 0,
            probe_successes: 0,
            spell: 0,
            closings: 0,
        }
    }

    /// Takes new thresholds (a reload); the state, window and cool-down in force stay.
    pub fn reconfigure(&mut self, config: BreakerConfig) {
        self.config = config;
    }

    /// The thresholds in force.
    pub fn config(&self) -> &BreakerConfig {
        &self.config
    }

    /// The state at `now` (an open breaker whose cool-down ended reads as half-open).
    pub fn state(&self, now: Instant) -> BreakerState {
        match (self.state, self.open_until) {
            (BreakerState::Open, Some(until)) if now >= until => BreakerState::HalfOpen,
            (state, _) => state,
        }
    }

    /// Whether a call may go to the shard now. The only place an open breaker whose cool-down
    /// ended becomes half-open, so the transition is reported once, to the caller that made
    /// it happen.
    pub fn admit(&mut self, now: Instant) -> (Admission, Option<Transition>) {
        let transition = self.settle(now);
        let admission = match self.state {
            BreakerState::Closed => Admission::Call(CallTicket(self.closings)),
            BreakerState::Open => Admission::Rejected,
            BreakerState::HalfOpen if self.probes_in_flight < self.config.probes => {
                self.probes_in_flight += 1;
                Admission::Probe(ProbeTicket(self.spell))
            }
            BreakerState::HalfOpen => Admission::Rejected,
        };
        (admission, transition)
    }

    /// [`Breaker::admit`] for a call that waits for a lock on purpose, for as long as the lock
    /// is held elsewhere (a transaction lock's wait for its row): while half-open it goes
    /// ahead without taking a probe's slot, and its outcome is not counted (its ticket is of
    /// the closed spell that ended). As a probe it kept the slot for its whole wait, refusing
    /// the calls that would have closed the breaker, and then closed it by a lock wait's
    /// timeout, which tells nothing of the shard.
    pub fn admit_waiting(&mut self, now: Instant) -> (Admission, Option<Transition>) {
        let transition = self.settle(now);
        let admission = match self.state {
            BreakerState::Closed | BreakerState::HalfOpen => {
                Admission::Call(CallTicket(self.closings))
            }
            BreakerState::Open => Admission::Rejected,
        };
        (admission, transition)
    }

    /// Reports how an admitted call went and how long it took.
    ///
    /// A slow success counts as a failure: a shard answering in seconds holds callers' waits
    /// and pooled connections as surely as a dead one. Callers pass `took` as zero for calls
    /// that wait for a row lock on purpose, whose duration says nothing about the shard.
    pub fn record(
        &mut self,
        now: Instant,
        outcome: CallOutcome,
        took: Duration,
        ticket: Ticket,
    ) -> Option<Transition> {
        let failed = outcome == CallOutcome::Failure || took >= self.config.slow_call;
        let call = match ticket {
            Ticket::Call(call) => call,
            Ticket::Probe(probe) => return self.record_probe(now, probe, failed),
        };
        if self.state != BreakerState::Closed || call.0 != self.closings {
            // Admitted before the breaker opened: in this spell's open or half-open state, or
            // in a closed spell that ended since.
            return None;
        }
        let slot = self.slot(now);
        match self.calls.back_mut() {
            Some((last, calls, failures)) if *last == slot => {
                *calls += 1;
                *failures += u32::from(failed);
            }
            _ => self.calls.push_back((slot, 1, u32::from(failed))),
        }
        while self
            .calls
            .front()
            .is_some_and(|(first, _, _)| first + WINDOW_SLOTS <= slot)
        {
            self.calls.pop_front();
        }
        self.consecutive = if failed { self.consecutive + 1 } else { 0 };
        let (total, failures) = self
            .calls
            .iter()
            .fold((0, 0), |(t, f), (_, calls, failed)| (t + calls, f + failed));
        let rate_tripped = total >= self.config.min_calls.max(1)
            && f64::from(failures) >= self.config.failure_rate * f64::from(total);
        // `max(1)`: validation rejects zero, but a breaker built in code could carry it, and a
        // minimum of zero calls would make an empty window "100% failed" on its first success.
        if rate_tripped || self.consecutive >= self.config.consecutive_failures.max(1) {
            // A trip from closed is a new outage: it starts from the short cool-down, not
            // from where the last outage's failed probes left it.
            self.cooldown = self.config.cooldown;
            return self.open(now);
        }
        None
    }

    /// [`Breaker::record`] of a half-open probe.
    fn record_probe(
        &mut self,
        now: Instant,
        ticket: ProbeTicket,
        failed: bool,
    ) -> Option<Transition> {
        if ticket.0 != self.spell {
            return None; // a late probe of an earlier half-open spell
        }
        self.probes_in_flight = self.probes_in_flight.saturating_sub(1);
        if self.state != BreakerState::HalfOpen {
            return None; // its spell ended: the breaker reopened or closed meanwhile
        }
        if failed {
            self.cooldown = (self.cooldown * 2).min(self.config.max_cooldown);
            self.open(now)
        } else {
            self.probe_successes += 1;
            (self.probe_successes >= self.config.probes).then(|| self.close())
        }
    }

    /// Gives back a probe slot whose call was dropped before it completed (if its spell is
    /// still the current one: a new spell's slots were never its).
    pub fn abandon_probe(&mut self, ticket: ProbeTicket) {
        if ticket.0 == self.spell {
            self.probes_in_flight = self.probes_in_flight.saturating_sub(1);
        }
    }

    /// Moves an open breaker whose cool-down ended to half-open.
    fn settle(&mut self, now: Instant) -> Option<Transition> {
        if self.state == BreakerState::Open && self.state(now) == BreakerState::HalfOpen {
            self.state = BreakerState::HalfOpen;
            self.spell += 1;
            self.probe_successes = 0;
            self.probes_in_flight = 0;
            return Some(Transition {
                from: BreakerState::Open,
                to: BreakerState::HalfOpen,
            });
        }
        None
    }

    /// The window is emptied on every transition (here and in [`Breaker::close`]): the
    /// failures that opened it must not count again against the shard once it is back.
    fn open(&mut self, now: Instant) -> Option<Transition> {
        let from = self.state;
        self.state = BreakerState::Open;
        self.open_until = Some(now + self.cooldown);
        self.calls.clear();
        self.consecutive = 0;
        Some(Transition {
            from,
            to: BreakerState::Open,
        })
    }

    fn close(&mut self) -> Transition {
        self.state = BreakerState::Closed;
        self.closings += 1;
        self.open_until = None;
        self.cooldown = self.config.cooldown;
        self.calls.clear();
        self.consecutive = 0;
        Transition {
            from: BreakerState::HalfOpen,
            to: BreakerState::Closed,
        }
    }

    /// The window slot of `now`: slots are a tenth of the window long, so the window is the
    /// current slot and the nine before it.
    fn slot(&mut self, now: Instant) -> u64 {
        let epoch = *self.epoch.get_or_insert(now);
        let slot_len = (self.config.window / WINDOW_SLOTS as u32).max(Duration::from_millis(1));
        (now.saturating_duration_since(epoch).as_nanos() / slot_len.as_nanos()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAST: Duration = Duration::from_millis(2);

    fn breaker() -> (Breaker, Instant) {
        (Breaker::new(BreakerConfig::default()), Instant::now())
    }

    fn probe_ticket(admission: Admission) -> ProbeTicket {
        match admission {
            Admission::Probe(ticket) => ticket,
            other => panic!("admitted as {other:?}, not as a probe"),
        }
    }

    fn call_ticket(admission: Admission) -> Ticket {
        match admission {
            Admission::Call(ticket) => Ticket::Call(ticket),
            other => panic!("admitted as {other:?}, not as a call"),
        }
    }

    fn call(b: &mut Breaker, now: Instant, outcome: CallOutcome) -> Option<Transition> {
        let ticket = call_ticket(b.admit(now).0);
        b.record(now, outcome, FAST, ticket)
    }

    #[test]
    fn consecutive_failures_open_it_and_calls_are_refused() {
        let (mut b, t) = breaker();
        for _ in 0..4 {
            assert_eq!(call(&mut b, t, CallOutcome::Failure), None);
        }
        let opened = call(&mut b, t, CallOutcome::Failure);
        assert_eq!(
            opened,
            Some(Transition {
                from: BreakerState::Closed,
                to: BreakerState::Open
            })
        );
        assert_eq!(b.admit(t).0, Admission::Rejected);
        assert_eq!(b.state(t), BreakerState::Open);
    }

    #[test]
    fn a_success_resets_the_run_of_failures() {
        let (mut b, t) = breaker();
        for outcome in [CallOutcome::Failure; 4]
            .into_iter()
            .chain([CallOutcome::Success])
            .chain([CallOutcome::Failure; 4])
        {
            assert_eq!(call(&mut b, t, outcome), None);
        }
        assert_eq!(
            b.state(t),
            BreakerState::Closed,
            "never five failures in a row, and 9 calls are below the minimum"
        );
    }

    #[test]
    fn the_failure_rate_counts_once_the_window_holds_the_minimum_of_calls() {
        let (mut b, t) = breaker();
        // Alternating, never two failures in a row: 9 failures in the first 19 calls.
        for i in 0..19 {
            let outcome = if i % 2 == 0 {
                CallOutcome::Success
            } else {
                CallOutcome::Failure
            };
            assert_eq!(call(&mut b, t, outcome), None, "call {i}");
        }
        // The 20th call makes 10 of 20: a rate of 50% opens it.
        assert!(call(&mut b, t, CallOutcome::Failure).is_some());
    }

    #[test]
    fn old_calls_leave_the_window() {
        let (mut b, t) = breaker();
        // 13 failures in 16 calls, never five in a row: below the minimum of calls.
        for i in 0..16 {
            let outcome = if i % 5 == 4 {
                CallOutcome::Success
            } else {
                CallOutcome::Failure
            };
            assert_eq!(call(&mut b, t, outcome), None, "call {i}");
        }
        // Eleven seconds later those have left the window: four successes make 4 calls, not
        // 20 calls with 13 failures.
        let later = t + Duration::from_secs(11);
        for _ in 0..4 {
            assert_eq!(call(&mut b, later, CallOutcome::Success), None);
        }
        assert_eq!(b.state(later), BreakerState::Closed);
    }

    #[test]
    fn gauge_values_name_their_state() {
        for state in [
            BreakerState::Closed,
            BreakerState::HalfOpen,
            BreakerState::Open,
        ] {
            assert_eq!(BreakerState::from_gauge(state.gauge()), Some(state));
        }
        assert_eq!(BreakerState::from_gauge(7), None);
        assert_eq!(BreakerState::HalfOpen.name(), "half-open");
    }

    #[test]
    fn slow_calls_count_as_failures() {
        let (mut b, t) = breaker();
        for _ in 0..5 {
            let ticket = call_ticket(b.admit(t).0);
            b.record(t, CallOutcome::Success, Duration::from_secs(2), ticket);
        }
        assert_eq!(b.state(t), BreakerState::Open);
    }

    #[test]
    fn cooldown_then_bounded_probes_close_it() {
        let (mut b, t) = breaker();
        for _ in 0..5 {
            call(&mut b, t, CallOutcome::Failure);
        }
        assert_eq!(
            b.admit(t + Duration::from_millis(999)).0,
            Admission::Rejected
        );
        let t1 = t + Duration::from_secs(1);
        assert_eq!(b.state(t1), BreakerState::HalfOpen);
        let (first, moved) = b.admit(t1);
        let ticket = probe_ticket(first);
        assert_eq!(
            moved,
            Some(Transition {
                from: BreakerState::Open,
                to: BreakerState::HalfOpen
            })
        );
        probe_ticket(b.admit(t1).0);
        probe_ticket(b.admit(t1).0);
        assert_eq!(b.admit(t1).0, Admission::Rejected, "only 3 probes at once");
        b.abandon_probe(ticket); // a probe whose future was dropped gives its slot back
        let ticket = probe_ticket(b.admit(t1).0);
        assert_eq!(
            b.record(t1, CallOutcome::Success, FAST, Ticket::Probe(ticket)),
            None
        );
        assert_eq!(
            b.record(t1, CallOutcome::Success, FAST, Ticket::Probe(ticket)),
            None
        );
        let closed = b.record(t1, CallOutcome::Success, FAST, Ticket::Probe(ticket));
        assert_eq!(
            closed,
            Some(Transition {
                from: BreakerState::HalfOpen,
                to: BreakerState::Closed
            })
        );
        call_ticket(b.admit(t1).0);
    }

    /// A probe still out when its spell ended (another probe failed and the breaker reopened)
    /// takes nothing from the next spell when it completes: neither a slot (more probes than
    /// configured would reach a shard just back) nor a success toward closing it.
    #[test]
    fn a_probe_of_an_earlier_half_open_spell_counts_in_no_later_one() {
        let (mut b, t) = breaker();
        for _ in 0..5 {
            call(&mut b, t, CallOutcome::Failure);
        }
        let t1 = t + Duration::from_secs(1);
        let (slow, dropped) = (probe_ticket(b.admit(t1).0), probe_ticket(b.admit(t1).0));
        let failing = probe_ticket(b.admit(t1).0);
        b.record(t1, CallOutcome::Failure, FAST, Ticket::Probe(failing));
        let t2 = t1 + Duration::from_secs(2);
        let tickets: Vec<ProbeTicket> = (0..3).map(|_| probe_ticket(b.admit(t2).0)).collect();
        assert_eq!(b.admit(t2).0, Admission::Rejected);
        // The first spell's other probes end now: one completes, one is dropped.
        assert_eq!(
            b.record(t2, CallOutcome::Success, FAST, Ticket::Probe(slow)),
            None
        );
        b.abandon_probe(dropped);
        assert_eq!(b.admit(t2).0, Admission::Rejected, "only 3 probes at once");
        // A probe of this spell dropped gives its slot back.
        b.abandon_probe(tickets[0]);
        let last = probe_ticket(b.admit(t2).0);
        // Three successes of this spell close it; the first spell's did not count.
        for ticket in [tickets[1], tickets[2]] {
            assert_eq!(
                b.record(t2, CallOutcome::Success, FAST, Ticket::Probe(ticket)),
                None
            );
        }
        assert_eq!(b.state(t2), BreakerState::HalfOpen);
        let closed = b.record(t2, CallOutcome::Success, FAST, Ticket::Probe(last));
        assert_eq!(closed.map(|t| t.to), Some(BreakerState::Closed));
    }

    /// A call that waits for a lock goes ahead while half-open without taking a probe's slot,
    /// and its outcome, even a failure, changes nothing; while open it is refused.
    #[test]
    fn a_lock_wait_takes_no_probe_slot_and_is_not_counted() {
        let (mut b, t) = breaker();
        for _ in 0..5 {
            call(&mut b, t, CallOutcome::Failure);
        }
        assert_eq!(b.admit_waiting(t).0, Admission::Rejected);
        let t1 = t + Duration::from_secs(1);
        let (waiting, still) = (
            call_ticket(b.admit_waiting(t1).0),
            call_ticket(b.admit_waiting(t1).0),
        );
        assert_eq!(b.state(t1), BreakerState::HalfOpen);
        let probes: Vec<ProbeTicket> = (0..3).map(|_| probe_ticket(b.admit(t1).0)).collect();
        assert_eq!(b.record(t1, CallOutcome::Failure, FAST, waiting), None);
        assert_eq!(b.state(t1), BreakerState::HalfOpen);
        let mut closed = None;
        for probe in probes {
            closed = b.record(t1, CallOutcome::Success, FAST, Ticket::Probe(probe));
        }
        assert_eq!(closed.map(|t| t.to), Some(BreakerState::Closed));
        // One still waiting when the breaker closed is not counted in the closed spell: four
        // failures and it make no five in a row.
        for _ in 0..4 {
            call(&mut b, t1, CallOutcome::Failure);
        }
        assert_eq!(b.record(t1, CallOutcome::Failure, FAST, still), None);
        assert_eq!(b.state(t1), BreakerState::Closed);
    }

    #[test]
    fn a_failed_probe_reopens_with_a_doubled_cooldown_up_to_the_cap() {
        let (mut b, t) = breaker();
        for _ in 0..5 {
            call(&mut b, t, CallOutcome::Failure);
        }
        let mut now = t;
        let mut expected = Duration::from_secs(1);
        for _ in 0..8 {
            now += expected;
            let ticket = probe_ticket(b.admit(now).0);
            let reopened = b.record(now, CallOutcome::Failure, FAST, Ticket::Probe(ticket));
            assert_eq!(
                reopened,
                Some(Transition {
                    from: BreakerState::HalfOpen,
                    to: BreakerState::Open
                })
            );
            expected = (expected * 2).min(Duration::from_secs(30));
            assert_eq!(
                b.admit(now + expected - Duration::from_millis(1)).0,
                Admission::Rejected
            );
        }
        assert_eq!(expected, Duration::from_secs(30), "capped");
    }

    #[test]
    fn outcomes_of_calls_admitted_before_a_transition_do_not_count() {
        let (mut b, t) = breaker();
        let in_flight = call_ticket(b.admit(t).0); // while the breaker opens
        for _ in 0..5 {
            call(&mut b, t, CallOutcome::Failure);
        }
        assert_eq!(b.record(t, CallOutcome::Success, FAST, in_flight), None);
        assert_eq!(b.state(t), BreakerState::Open);
    }

    /// Nor once the breaker closed again: a call admitted before it opened that fails after
    /// it closed (a statement that waited out its timeout through the whole outage) says how
    /// the shard was before, and opens nothing.
    #[test]
    fn a_call_admitted_before_an_outage_that_fails_after_it_does_not_count() {
        let config = BreakerConfig {
            consecutive_failures: 1,
            ..BreakerConfig::default()
        };
        let (mut b, t) = (Breaker::new(config), Instant::now());
        let in_flight = call_ticket(b.admit(t).0);
        call(&mut b, t, CallOutcome::Failure);
        assert_eq!(b.state(t), BreakerState::Open);
        let t1 = t + Duration::from_secs(1);
        for _ in 0..3 {
            let probe = probe_ticket(b.admit(t1).0);
            b.record(t1, CallOutcome::Success, FAST, Ticket::Probe(probe));
        }
        assert_eq!(b.state(t1), BreakerState::Closed);
        assert_eq!(b.record(t1, CallOutcome::Failure, FAST, in_flight), None);
        assert_eq!(b.state(t1), BreakerState::Closed);
        // A call of the new spell does count.
        assert!(call(&mut b, t1, CallOutcome::Failure).is_some());
    }

    #[test]
    fn the_window_takes_constant_space_at_any_call_rate() {
        let (mut b, t0) = breaker();
        // 200,000 calls over 30 s: one every 150 µs.
        for i in 0..200_000u64 {
            let now = t0 + Duration::from_micros(150 * i);
            call(&mut b, now, CallOutcome::Success);
            assert!(b.calls.len() <= WINDOW_SLOTS as usize + 1);
        }
        let total: u32 = b.calls.iter().map(|(_, calls, _)| calls).sum();
        // The last 10 s, to within one slot.
        assert!((60_000..=67_000).contains(&total), "{total}");
    }
}
