//! How many threads a forward may use, chosen by the thread that calls it.
//!
//! A forward runs its layer loop and output head on a rayon pool: rayon's
//! global pool (all cores, or `RAYON_NUM_THREADS`) unless the calling thread
//! holds a [`ForwardPoolGuard`] from [`use_pool`], in which case that pool
//! (and its thread count) is used. The device runtime uses this to run the
//! draft on fewer threads when the phone is hot (`tandem_edge::device`),
//! from one generation to the next and never in the middle of a forward.
//!
//! Only the pool changes: the caller stays where it is (callbacks between
//! forwards still run on the caller's thread), and by the kernel contract
//! ([`crate::quant`]) a forward's result does not depend on the thread count,
//! so a smaller pool changes speed, never bits.

use std::cell::RefCell;
use std::sync::Arc;

use rayon::ThreadPool;

thread_local! {
    static POOL: RefCell<Option<Arc<ThreadPool>>> = const { RefCell::new(None) };
}

/// While alive, forwards called on this thread run on its pool; dropping it
/// restores what was there before (guards nest). Not `Send`: it belongs to
/// the thread that made it.
pub struct ForwardPoolGuard {
    previous: Option<Arc<ThreadPool>>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for ForwardPoolGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        POOL.with(|p| *p.borrow_mut() = previous);
    }
}

/// Runs this thread's forwards on `pool` until the guard is dropped.
pub fn use_pool(pool: Arc<ThreadPool>) -> ForwardPoolGuard {
    let previous = POOL.with(|p| p.borrow_mut().replace(pool));
    ForwardPoolGuard {
        previous,
        _not_send: std::marker::PhantomData,
    }
}

/// The number of threads a forward called on this thread uses now.
pub fn current() -> usize {
    POOL.with(|p| match p.borrow().as_ref() {
        Some(pool) => pool.current_num_threads(),
        None => rayon::current_num_threads(),
    })
}

/// Runs `f` inside the forward pool of this thread (the global pool when no
/// guard is set), so the kernels inside split their work over that pool.
pub(crate) fn run<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let pool = POOL.with(|p| p.borrow().clone());
    match pool {
        Some(pool) => pool.install(f),
        None => rayon::scope(|_| f()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_guard_sets_the_pool_of_this_thread_only_and_nests() {
        let global = rayon::current_num_threads();
        assert_eq!(current(), global);
        let one = Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap(),
        );
        let three = Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(3)
                .build()
                .unwrap(),
        );
        {
            let _a = use_pool(one);
            assert_eq!(current(), 1);
            // Inside the forward pool, rayon sees that pool.
            assert_eq!(run(rayon::current_num_threads), 1);
            // Another thread is not affected.
            let other = std::thread::spawn(current).join().unwrap();
            assert_eq!(other, global);
            {
                let _b = use_pool(three);
                assert_eq!(run(rayon::current_num_threads), 3);
            }
            assert_eq!(current(), 1);
        }
        assert_eq!(current(), global);
        assert_eq!(run(rayon::current_num_threads), global);
    }
}
