//! Paged KV memory for many sequences: a [`KvPool`] sized in bytes hands out
//! fixed-size pages of [`PAGE_TOKENS`] positions, and each sequence's
//! [`PagedKv`] holds only the pages its context needs, so memory follows use.
//!
//! - A page holds `PAGE_TOKENS` positions of every layer, K and V:
//!   `[layer][k | v][slot][n_kv_head * head_dim]` f32, so one page's size is
//!   `PAGE_TOKENS * kv_bytes_per_token` (917,504 B for the 1.5B target).
//! - The pool is an accountant: pages are counted against its capacity when a
//!   sequence [`reserve`](PagedKv::reserve)s them and given back when it
//!   [`shrink_to`](PagedKv::shrink_to)s or is dropped. A page's buffer is
//!   allocated zeroed (large allocations map lazily and are unmapped on free),
//!   so resident memory is that of the pages held, not of a preallocated
//!   maximum.
//! - Reservation is explicit and fallible ([`KvFull`]); a forward never
//!   allocates, so a caller reserves before it schedules work and can refuse or
//!   evict first.
//! - Attention reads position `t` from page `t / PAGE_TOKENS`, slot
//!   `t % PAGE_TOKENS`, in position order: the same reduction as over a
//!   contiguous [`crate::kv_cache::KvCache`], hence the same bits.

use crate::kv_cache::{check_append_at, KvRow, KvStore};
use crate::Result;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Positions per page.
pub const PAGE_TOKENS: usize = 16;

/// The pool had no free page for a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("KV pool full: {wanted} more pages wanted, {free} of {capacity} free")]
pub struct KvFull {
    pub wanted: usize,
    pub free: usize,
    pub capacity: usize,
}

/// Counts the pages of every [`PagedKv`] made from it against a byte budget.
#[derive(Debug)]
pub struct KvPool {
    n_layers: usize,
    row: usize,
    capacity_pages: usize,
    used: AtomicUsize,
}

impl KvPool {
    /// A pool for a model with `n_layers` layers of `n_kv_head * head_dim`
    /// floats per position, holding at most `budget_bytes` of pages (at least
    /// one page).
    pub fn new(n_layers: usize, n_kv_head: usize, head_dim: usize, budget_bytes: u64) -> Arc<Self> {
        let row = n_kv_head.saturating_mul(head_dim);
        let page = page_floats(n_layers, row).saturating_mul(4).max(1);
        let capacity_pages = usize::try_from(budget_bytes / page as u64)
            .unwrap_or(usize::MAX)
            .max(1);
        Arc::new(Self {
            n_layers,
            row,
            capacity_pages,
            used: AtomicUsize::new(0),
        })
    }

    /// Bytes of one page.
    pub fn page_bytes(&self) -> usize {
        page_floats(self.n_layers, self.row) * 4
    }

    /// Bytes of K+V per position (all layers).
    pub fn bytes_per_token(&self) -> usize {
        self.page_bytes() / PAGE_TOKENS
    }

    pub fn capacity_pages(&self) -> usize {
        self.capacity_pages
    }

    /// Pages held by all sequences now.
    pub fn pages_used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    pub fn pages_free(&self) -> usize {
        self.capacity_pages.saturating_sub(self.pages_used())
    }

    /// Pages needed to hold `tokens` positions.
    pub fn pages_for(tokens: usize) -> usize {
        tokens.div_ceil(PAGE_TOKENS)
    }

    fn take(&self, n: usize) -> Result<(), KvFull> {
        let mut cur = self.used.load(Ordering::Acquire);
        loop {
            let next = match cur.checked_add(n) {
                Some(v) if v <= self.capacity_pages => v,
                _ => {
                    return Err(KvFull {
                        wanted: n,
                        free: self.capacity_pages.saturating_sub(cur),
                        capacity: self.capacity_pages,
                    })
                }
            };
            match self
                .used
                .compare_exchange(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(()),
                Err(seen) => cur = seen,
            }
        }
    }

    fn give(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }
}

fn page_floats(n_layers: usize, row: usize) -> usize {
    n_layers
        .saturating_mul(2)
        .saturating_mul(PAGE_TOKENS)
        .saturating_mul(row)
}

/// One sequence's KV in pages of a [`KvPool`]; capped at `max_tokens`
/// positions. Gives its pages back when dropped.
#[derive(Debug)]
pub struct PagedKv {
    pool: Arc<KvPool>,
    max_tokens: usize,
    pages: Vec<Box<[f32]>>,
    lens: Vec<usize>,
}

impl PagedKv {
    /// An empty sequence (no pages yet) of at most `max_tokens` positions.
    pub fn new(pool: Arc<KvPool>, max_tokens: usize) -> Self {
        let lens = vec![0; pool.n_layers];
        Self {
            pool,
            max_tokens,
            pages: Vec::new(),
            lens,
        }
    }

    /// Cached positions (the maximum over layers).
    pub fn len(&self) -> usize {
        self.lens.iter().copied().max().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sequence cap.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Positions the pages held can take.
    pub fn reserved_tokens(&self) -> usize {
        self.pages.len() * PAGE_TOKENS
    }

    pub fn pages_held(&self) -> usize {
        self.pages.len()
    }

    /// Bytes of the pages held.
    pub fn bytes_held(&self) -> u64 {
        (self.pages.len() as u64).saturating_mul(self.pool.page_bytes() as u64)
    }

    /// Makes room for `tokens` positions in all (taking pages from the pool);
    /// nothing changes when it fails.
    pub fn reserve(&mut self, tokens: usize) -> Result<(), KvFull> {
        if tokens > self.max_tokens {
            return Err(KvFull {
                wanted: KvPool::pages_for(tokens).saturating_sub(self.pages.len()),
                free: 0,
                capacity: KvPool::pages_for(self.max_tokens),
            });
        }
        let want = KvPool::pages_for(tokens).saturating_sub(self.pages.len());
        if want == 0 {
            return Ok(());
        }
        self.pool.take(want)?;
        let floats = page_floats(self.pool.n_layers, self.pool.row);
        for _ in 0..want {
            self.pages.push(vec![0f32; floats].into_boxed_slice());
        }
        Ok(())
    }

    /// Drops every position `>= len` (the pages stay reserved).
    pub fn truncate(&mut self, len: usize) {
        for l in &mut self.lens {
            *l = (*l).min(len);
        }
    }

    /// Gives back the pages not needed for `max(len, tokens)` positions.
    pub fn shrink_to(&mut self, tokens: usize) {
        let keep = KvPool::pages_for(tokens.max(self.len()));
        if keep < self.pages.len() {
            let n = self.pages.len() - keep;
            self.pages.truncate(keep);
            self.pool.give(n);
        }
    }

    #[inline]
    fn offset(&self, layer: usize, kv: usize, slot: usize) -> usize {
        ((layer * 2 + kv) * PAGE_TOKENS + slot) * self.pool.row
    }
}

impl Drop for PagedKv {
    fn drop(&mut self) {
        self.pool.give(self.pages.len());
    }
}

impl KvStore for PagedKv {
    fn n_layers(&self) -> usize {
        self.lens.len()
    }

    fn layer_len(&self, layer: usize) -> usize {
        self.lens[layer]
    }

    fn check_append(&self, layer: usize, start_pos: usize, n: usize) -> Result<()> {
        check_append_at(
            self.lens[layer],
            self.reserved_tokens().min(self.max_tokens),
            layer,
            start_pos,
            n,
        )
    }

    fn append(&mut self, layer: usize, start_pos: usize, k: &[f32], v: &[f32]) {
        let row = self.pool.row;
        for (i, (kr, vr)) in k.chunks_exact(row).zip(v.chunks_exact(row)).enumerate() {
            let t = start_pos + i;
            let (page, slot) = (t / PAGE_TOKENS, t % PAGE_TOKENS);
            let ko = self.offset(layer, 0, slot);
            let vo = self.offset(layer, 1, slot);
            let p = &mut self.pages[page];
            p[ko..ko + row].copy_from_slice(kr);
            p[vo..vo + row].copy_from_slice(vr);
        }
        self.lens[layer] = start_pos + k.len() / row;
    }

    #[inline]
    fn key(&self, layer: usize, t: usize) -> KvRow<'_> {
        let o = self.offset(layer, 0, t % PAGE_TOKENS);
        KvRow::F32(&self.pages[t / PAGE_TOKENS][o..o + self.pool.row])
    }

    #[inline]
    fn value(&self, layer: usize, t: usize) -> KvRow<'_> {
        let o = self.offset(layer, 1, t % PAGE_TOKENS);
        KvRow::F32(&self.pages[t / PAGE_TOKENS][o..o + self.pool.row])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_counted_reserved_shrunk_and_given_back() {
        let pool = KvPool::new(2, 2, 4, 10 * 2 * 2 * 16 * 8 * 4);
        assert_eq!(pool.capacity_pages(), 10);
        let mut a = PagedKv::new(pool.clone(), 1000);
        a.reserve(17).unwrap();
        assert_eq!((a.pages_held(), pool.pages_used()), (2, 2));
        a.reserve(5).unwrap();
        assert_eq!(
            pool.pages_used(),
            2,
            "reserving less than held takes nothing"
        );
        let mut b = PagedKv::new(pool.clone(), 1000);
        let e = b.reserve(16 * 9).unwrap_err();
        assert_eq!((e.wanted, e.free), (9, 8));
        assert_eq!(pool.pages_used(), 2, "a failed reservation takes nothing");
        b.reserve(16 * 8).unwrap();
        assert_eq!(pool.pages_free(), 0);
        a.shrink_to(1);
        assert_eq!((a.pages_held(), pool.pages_used()), (1, 9));
        drop(b);
        assert_eq!(pool.pages_used(), 1);
        let e = a.reserve(1001).unwrap_err();
        assert_eq!(e.free, 0, "beyond the sequence cap");
    }

    #[test]
    fn rows_land_in_their_page_and_slot() {
        let pool = KvPool::new(2, 1, 2, 1 << 20);
        let mut kv = PagedKv::new(pool, 64);
        kv.reserve(40).unwrap();
        let k: Vec<f32> = (0..40 * 2).map(|x| x as f32).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        kv.check_append(1, 0, 40).unwrap();
        kv.append(1, 0, &k, &v);
        kv.check_append(1, 40, 8).unwrap();
        assert!(
            kv.check_append(1, 40, 9).is_err(),
            "3 pages hold 48 positions"
        );
        assert!(
            kv.check_append(1, 39, 1).is_err(),
            "layer 1 holds 40 positions"
        );
        for t in [0, 15, 16, 31, 39] {
            assert_eq!(kv.key(1, t), KvRow::F32(&k[2 * t..2 * t + 2]));
            assert_eq!(kv.value(1, t), KvRow::F32(&v[2 * t..2 * t + 2]));
        }
        assert_eq!(kv.layer_len(1), 40);
        assert_eq!(kv.layer_len(0), 0);
    }
}
