//! The lease clock: the runtime's monotonic clock plus the time the host spent suspended.
//!
//! A lease's local end is measured from before the statement that granted or renewed it was
//! sent. The runtime's clock (`CLOCK_MONOTONIC` on Linux) stands still while the host is
//! suspended, but the shard's clock does not: a lease measured by it would outlive its row by
//! the whole suspend, and its holder would go on while someone else holds the key. So local
//! lease ends, and the age of the latest heartbeat, are [`Moment`]s of this clock, which also
//! counts the suspend (on Linux `CLOCK_BOOTTIME` less `CLOCK_MONOTONIC`; elsewhere nothing).
//!
//! Timers still run on the runtime's clock: a wait toward a moment is armed with
//! [`Moment::timer`], and one armed before a suspend fires after it late by the suspend. What
//! must notice a suspend soon looks again at least every [`SUSPEND_NOTICED_WITHIN`].

use std::ops::{Add, Sub};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// The longest a wait toward a lease's end sleeps before looking at the clock again: a lease
/// that ended while the host was suspended is reported lost this soon after it wakes.
pub(crate) const SUSPEND_NOTICED_WITHIN: Duration = Duration::from_secs(1);

/// An instant of the lease clock. Ordered, and moved by durations, like an [`Instant`]; never
/// compared with one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Moment(Instant);

impl Moment {
    pub(crate) fn now() -> Self {
        Self(Instant::now() + slept())
    }

    /// The runtime instant at which this moment comes if the host is not suspended meanwhile
    /// (one already past, for a moment already past).
    pub(crate) fn timer(self) -> Instant {
        self.0.checked_sub(slept()).unwrap_or_else(Instant::now)
    }

    /// The sleep toward this moment that looks at the clock again within
    /// [`SUSPEND_NOTICED_WITHIN`].
    pub(crate) fn checked_timer(self) -> Instant {
        self.timer().min(Instant::now() + SUSPEND_NOTICED_WITHIN)
    }

    pub(crate) fn saturating_duration_since(self, earlier: Moment) -> Duration {
        self.0.saturating_duration_since(earlier.0)
    }

    /// How long ago this moment was (zero for one still to come).
    pub(crate) fn elapsed(self) -> Duration {
        Moment::now().saturating_duration_since(self)
    }
}

impl Add<Duration> for Moment {
    type Output = Moment;

    fn add(self, d: Duration) -> Moment {
        Self(self.0 + d)
    }
}

impl Sub<Moment> for Moment {
    type Output = Duration;

    /// The time from `earlier` to `self`, zero if `earlier` is later.
    fn sub(self, earlier: Moment) -> Duration {
        self.saturating_duration_since(earlier)
    }
}

/// The greatest suspend total read so far, in ns: two readings of the two clocks are not taken
/// at one instant, and the total never goes down.
static SLEPT_NS: AtomicU64 = AtomicU64::new(0);

/// Suspends the tests pretend happened (feature `fault-injection`), in ns.
#[cfg(feature = "fault-injection")]
static PRETENDED_NS: AtomicU64 = AtomicU64::new(0);

/// The time the host spent suspended since this process first asked.
fn slept() -> Duration {
    let read = host_slept();
    #[cfg(feature = "fault-injection")]
    let read = read + Duration::from_nanos(PRETENDED_NS.load(Ordering::Acquire));
    let ns = u64::try_from(read.as_nanos()).unwrap_or(u64::MAX);
    // Written only when it grows (a suspend, or a reading's jitter): read by every core on
    // every lease check, so the cache line stays shared.
    let most = SLEPT_NS.load(Ordering::Acquire);
    if ns <= most {
        return Duration::from_nanos(most);
    }
    Duration::from_nanos(SLEPT_NS.fetch_max(ns, Ordering::AcqRel).max(ns))
}

/// Counts `d` as spent suspended, as if the host had slept that long just now (tests only).
#[cfg(feature = "fault-injection")]
pub(crate) fn pretend_suspend(d: Duration) {
    let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    PRETENDED_NS.fetch_add(ns, Ordering::AcqRel);
}

#[cfg(target_os = "linux")]
fn host_slept() -> Duration {
    use nix::time::{clock_gettime, ClockId};
    use std::sync::OnceLock;

    // The boot clock is the monotonic clock plus every suspend since the machine booted.
    fn gap() -> Duration {
        let read = |clock| {
            clock_gettime(clock)
                .map(Duration::from)
                .unwrap_or(Duration::ZERO)
        };
        let boot = read(ClockId::CLOCK_BOOTTIME);
        let mono = read(ClockId::CLOCK_MONOTONIC);
        // Read in that order, a reading delayed between the two makes the gap smaller, never
        // larger: the widest of a few readings is the closest.
        boot.saturating_sub(mono)
    }
    static BASE: OnceLock<Duration> = OnceLock::new();
    let base = *BASE.get_or_init(|| (0..4).map(|_| gap()).max().unwrap_or_default());
    gap().saturating_sub(base)
}

#[cfg(not(target_os = "linux"))]
fn host_slept() -> Duration {
    Duration::ZERO
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_moment_is_armed_as_the_runtime_instant_it_comes_at() {
        let five = Duration::from_secs(5);
        let before = Instant::now();
        let now = Moment::now();
        let after = Instant::now();
        let later = now + five;
        assert_eq!(later - now, five);
        assert_eq!(now - later, Duration::ZERO);
        let timer = later.timer();
        assert!(before + five <= timer && timer <= after + five);
        assert!(later.checked_timer() <= Instant::now() + SUSPEND_NOTICED_WITHIN);
    }
}
