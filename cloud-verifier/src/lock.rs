//! Locking a mutex whose holder may have panicked: the verifier's shared
//! structures (store, buckets, metrics) stay consistent between statements, so
//! a poisoned lock is taken over rather than spreading the panic.

use std::sync::{Mutex, MutexGuard};

/// `m.lock()`, recovering the guard from a poisoned mutex.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}
