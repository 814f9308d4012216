//! Capped exponential backoff with jitter for waiting on a busy lock.

use std::time::Duration;

use rand::Rng;

/// Exponential backoff, capped, with "equal jitter": each delay is drawn uniformly from
/// `[d/2, d]` where `d = min(cap, base * 2^attempt)`. Half the delay is kept so that waiters do
/// not hammer the shard; the random half spreads them apart.
#[derive(Debug, Clone)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    /// A backoff starting at `base` and never exceeding `cap`. A `cap` below `base` is raised
    /// to it: configuration rejects that pair, but the other callers (the move and give-back
    /// loops, the bench) pass constants, and a cap under the first step would only shorten it.
    pub fn new(base: Duration, cap: Duration) -> Self {
        Self {
            base,
            cap: cap.max(base),
            attempt: 0,
        }
    }

    /// The next delay.
    pub fn next_delay(&mut self) -> Duration {
        // The exponent stops at 20: `1u32 << 32` would overflow, and 2^20 times any base worth
        // using is far past any cap. `saturating_mul` keeps a huge base from panicking.
        let exp = self.base.saturating_mul(1u32 << self.attempt.min(20));
        let d = exp.min(self.cap);
        self.attempt = self.attempt.saturating_add(1);
        let half = d / 2;
        half + rand::rng().random_range(Duration::ZERO..=d - half)
    }

    /// Starts again from `base`. A waiter calls it when the shard says the current holder got
    /// the key only moments ago: a hot key changing hands is often free again soon, and a
    /// delay grown while earlier holders kept it long would sleep through that release.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_stays_within_cap() {
        let mut b = Backoff::new(Duration::from_millis(2), Duration::from_millis(50));
        let delays: Vec<_> = (0..12).map(|_| b.next_delay()).collect();
        assert!(delays[0] >= Duration::from_millis(1) && delays[0] <= Duration::from_millis(2));
        assert!(delays.iter().all(|d| *d <= Duration::from_millis(50)));
        assert!(delays[11] >= Duration::from_millis(25), "{delays:?}");
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(2));
    }
}
