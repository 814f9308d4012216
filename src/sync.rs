//! Mutexes that a panic elsewhere cannot turn into a panic here. Every `std` mutex of the
//! facade guards plain data (maps of leases and waiters, breaker state, lists) whose every
//! change is one insert, removal or assignment, so the data is consistent even after a task
//! panicked while holding the lock; and many are taken in `Drop`, where a second panic aborts
//! the process. So a poisoned lock is used as it is.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// [`Mutex::lock`] that ignores poisoning (see the module docs).
pub(crate) trait LockExt<T> {
    /// Locks, whether or not a holder panicked before.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T> LockExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
