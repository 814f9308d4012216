//! Hot keys: the keys that made callers wait longest over a recent window, in bounded memory.
//!
//! A Space-Saving summary (Metwally et al.) of `capacity` counters per generation: a key that
//! is not counted yet takes over the smallest counter and starts from its value, so a key with
//! a large share of the total is always among the counters, and its count is overestimated by
//! at most the smallest counter. Two generations, each `window` long, are kept: the report
//! covers between one and two windows of history.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A bounded top-K summary of wait time per key.
#[derive(Debug, Clone)]
pub struct HotKeys {
    capacity: usize,
    window: Duration,
    started: Option<Instant>,
    current: HashMap<String, u64>,
    previous: HashMap<String, u64>,
}

impl HotKeys {
    /// A summary of `capacity` keys per generation, each generation `window` long.
    pub fn new(capacity: usize, window: Duration) -> Self {
        Self {
            capacity: capacity.max(1),
            window,
            started: None,
            current: HashMap::new(),
            previous: HashMap::new(),
        }
    }

    /// Adds `waited` (µs) for `key` at `now`.
    ///
    /// A new key on a full summary replaces the smallest counter and inherits its count, as
    /// Space-Saving requires: starting from zero instead would let a steady stream of new keys
    /// evict each other and the real hot key with them. Finding the smallest is a scan of all
    /// counters, fine for the few thousand telemetry keeps, not for a large `capacity`.
    pub fn record(&mut self, now: Instant, key: &str, waited_us: u64) {
        self.rotate(now);
        if let Some(count) = self.current.get_mut(key) {
            *count += waited_us;
            return;
        }
        if self.current.len() < self.capacity {
            self.current.insert(key.to_owned(), waited_us);
            return;
        }
        let (smallest, floor) = self
            .current
            .iter()
            .min_by_key(|(_, c)| **c)
            .map(|(k, c)| (k.clone(), *c))
            .expect("full, so not empty");
        self.current.remove(&smallest);
        self.current.insert(key.to_owned(), floor + waited_us);
    }

    /// The `n` keys with the most wait time over the last one to two windows, most first,
    /// with their wait in µs. Both generations are summed: the current one alone would
    /// report next to nothing just after it rotated. Ties go by key, so that two reports of
    /// the same counts list them in the same order.
    pub fn top(&mut self, now: Instant, n: usize) -> Vec<(String, u64)> {
        self.rotate(now);
        let mut merged: HashMap<&str, u64> = HashMap::new();
        for (key, count) in self.previous.iter().chain(&self.current) {
            *merged.entry(key).or_default() += count;
        }
        let mut top: Vec<(String, u64)> =
            merged.into_iter().map(|(k, c)| (k.to_owned(), c)).collect();
        top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        top.truncate(n);
        top
    }

    /// Generations start on multiples of `window` from the first record (`started + window`,
    /// not `now`), so each covers exactly one window however irregular the calls. After two
    /// idle windows both are dropped: even the previous one would be older than the report
    /// promises.
    fn rotate(&mut self, now: Instant) {
        let started = *self.started.get_or_insert(now);
        let age = now.saturating_duration_since(started);
        if age >= self.window * 2 {
            self.previous.clear();
            self.current.clear();
            self.started = Some(now);
        } else if age >= self.window {
            self.previous = std::mem::take(&mut self.current);
            self.started = Some(started + self.window);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_with_half_the_waits_is_reported_first_among_many() {
        let mut hot = HotKeys::new(16, Duration::from_secs(60));
        let t = Instant::now();
        // 10,000 waits: every other one on `hot`, the rest spread over 2,000 other keys.
        for i in 0..10_000u64 {
            let key = if i % 2 == 0 {
                "hot".to_owned()
            } else {
                format!("k{}", i % 2_000)
            };
            hot.record(t, &key, 100);
        }
        let top = hot.top(t, 3);
        assert_eq!(top[0].0, "hot");
        assert!(top[0].1 >= 500_000, "{top:?}");
        assert!(hot.current.len() <= 16, "bounded memory");
    }

    #[test]
    fn old_windows_are_forgotten() {
        let mut hot = HotKeys::new(4, Duration::from_secs(10));
        let t = Instant::now();
        hot.record(t, "old", 1_000);
        hot.record(t + Duration::from_secs(11), "new", 10);
        // One window later "old" still counts (previous generation) ...
        assert_eq!(hot.top(t + Duration::from_secs(11), 1)[0].0, "old");
        // ... two windows later it is gone.
        let top = hot.top(t + Duration::from_secs(21), 5);
        assert!(top.iter().all(|(k, _)| k != "old"), "{top:?}");
    }
}
