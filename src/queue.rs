//! The in-process queue per key: only one task of this process polls the shard for a key;
//! the others wait here, in memory, in FIFO order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

/// One async mutex per key that somebody in this process holds or waits for. Entries are
/// removed as soon as nobody uses them, so memory is bounded by the keys in use.
#[derive(Debug, Default)]
pub(crate) struct KeyQueues {
    map: Mutex<HashMap<Vec<u8>, Arc<AsyncMutex<()>>>>,
}

/// A place in a key's queue; holding its turn means "this task is the key's poller or holder".
#[derive(Debug)]
pub(crate) struct Turn {
    queues: Arc<KeyQueues>,
    key: Vec<u8>,
    mutex: Option<Arc<AsyncMutex<()>>>,
    guard: Option<OwnedMutexGuard<()>>,
}

impl KeyQueues {
    /// Joins the queue of `key`; call [`Turn::wait`] to wait for its turn.
    pub(crate) fn join(self: &Arc<Self>, key: &[u8]) -> Turn {
        let mutex = self
            .map
            .lock()
            .unwrap()
            .entry(key.to_vec())
            .or_default()
            .clone();
        Turn {
            queues: self.clone(),
            key: key.to_vec(),
            mutex: Some(mutex),
            guard: None,
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.lock().unwrap().len()
    }
}

impl Turn {
    /// Waits until every task ahead in the queue has left it. Cancel-safe: dropping the future
    /// (or the `Turn`) just leaves the queue.
    pub(crate) async fn wait(&mut self) {
        let mutex = self.mutex.clone().expect("turn is live");
        self.guard = Some(mutex.lock_owned().await);
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.guard.take();
        let mut map = self.queues.map.lock().unwrap();
        drop(self.mutex.take());
        if map
            .get(&self.key)
            .is_some_and(|m| Arc::strong_count(m) == 1)
        {
            map.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn one_turn_at_a_time_and_entries_are_dropped() {
        let q = Arc::new(KeyQueues::default());
        let mut a = q.join(b"k");
        a.wait().await;
        let mut b = q.join(b"k");
        assert!(tokio::time::timeout(Duration::from_millis(10), b.wait())
            .await
            .is_err());
        drop(a);
        b.wait().await;
        let mut c = q.join(b"k");
        // A cancelled waiter leaves no trace.
        assert!(tokio::time::timeout(Duration::from_millis(10), c.wait())
            .await
            .is_err());
        drop(c);
        drop(b);
        assert_eq!(q.len(), 0);
    }
}
