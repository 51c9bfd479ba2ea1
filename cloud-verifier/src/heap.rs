//! The verifier's heap as its allocator counts it, for `/metrics`: what is
//! live (handed out and not given back) and what the allocator holds free.
//! Beside VmRSS this tells live growth from memory the allocator keeps
//! (issue 31 item 4: RSS outside the KV pool crept in the fault soak, and
//! VmRSS alone cannot say which it was).
//!
//! glibc only (`mallinfo2`, which sums every arena); elsewhere nothing is
//! reported.

/// One reading of the allocator's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeapStats {
    /// Bytes allocated and not freed: in arenas (`uordblks`) plus blocks
    /// mapped on their own (`hblkhd`).
    pub in_use: u64,
    /// Free bytes the arenas hold and have not returned to the system
    /// (`fordblks`).
    pub free_held: u64,
}

/// The allocator's counters now (`None` where they cannot be read).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn heap_stats() -> Option<HeapStats> {
    // SAFETY: `mallinfo2` takes no arguments, returns a plain struct by value
    // and only reads the allocator's state under its own locks.
    let m = unsafe { libc::mallinfo2() };
    let bytes = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    Some(HeapStats {
        in_use: bytes(m.uordblks).saturating_add(bytes(m.hblkhd)),
        free_held: bytes(m.fordblks),
    })
}

/// The allocator's counters now (`None` where they cannot be read).
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn heap_stats() -> Option<HeapStats> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_live_allocation_shows_in_the_bytes_in_use() {
        let before = heap_stats().expect("glibc reports its heap");
        // Several arena-sized blocks (below the mmap threshold) and one
        // mapped on its own.
        let small: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 16 * 1024]).collect();
        let big = vec![1u8; 8 << 20];
        let during = heap_stats().expect("glibc reports its heap");
        assert!(
            during.in_use >= before.in_use + (8 << 20),
            "{before:?} -> {during:?}"
        );
        drop((small, big));
        let after = heap_stats().expect("glibc reports its heap");
        assert!(after.in_use < during.in_use, "{during:?} -> {after:?}");
    }
}
