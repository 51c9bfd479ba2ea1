//! A per-sequence key/value cache with preallocated capacity and rollback.
//!
//! Layout per layer: `[capacity, n_kv_head, head_dim]` f32 for K and for V.
//! Buffers are allocated zeroed up front (`vec![0.0; n]` maps lazily, so
//! untouched capacity costs address space, not RSS) and never reallocated.
//! Each layer keeps its own length so that a caller running only a layer
//! range (split execution) still gets consistency checks.

use crate::{ModelError, Result};

#[derive(Clone, Debug)]
pub struct KvCache {
    capacity: usize,
    row: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    lens: Vec<usize>,
}

impl KvCache {
    /// A cache for `n_layers` layers of `n_kv_head * head_dim` floats per token.
    pub fn new(n_layers: usize, n_kv_head: usize, head_dim: usize, capacity: usize) -> Self {
        let row = n_kv_head * head_dim;
        Self {
            capacity,
            row,
            k: (0..n_layers).map(|_| vec![0f32; capacity * row]).collect(),
            v: (0..n_layers).map(|_| vec![0f32; capacity * row]).collect(),
            lens: vec![0; n_layers],
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn n_layers(&self) -> usize {
        self.lens.len()
    }

    /// Number of cached positions: the maximum over layers (all layers agree
    /// unless a caller is running a layer range).
    pub fn len(&self) -> usize {
        self.lens.iter().copied().max().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn layer_len(&self, layer: usize) -> usize {
        self.lens[layer]
    }

    /// Bytes of K+V per cached token (all layers).
    pub fn bytes_per_token(&self) -> usize {
        2 * self.row * 4 * self.lens.len()
    }

    /// Drop every position `>= len` (rollback after a rejected draft).
    pub fn truncate(&mut self, len: usize) {
        for l in &mut self.lens {
            *l = (*l).min(len);
        }
    }

    pub fn clear(&mut self) {
        self.truncate(0);
    }
}

/// Where a forward pass keeps a sequence's keys and values: the contiguous
/// [`KvCache`] (device, local loops) or the verifier's paged
/// [`crate::kv_pages::PagedKv`]. Attention reads one position's row at a time
/// through [`key`](KvStore::key) / [`value`](KvStore::value) in position order,
/// so the arithmetic, and with it every bit of the result, is the same over
/// either layout.
pub trait KvStore: Send + Sync {
    /// Layers this store was made for.
    fn n_layers(&self) -> usize;
    /// Positions cached for `layer`.
    fn layer_len(&self, layer: usize) -> usize;
    /// Checks that `n` positions can be appended to `layer` at `start_pos`.
    fn check_append(&self, layer: usize, start_pos: usize, n: usize) -> Result<()>;
    /// Writes K and V rows (`[n, n_kv_head * head_dim]` each) for positions
    /// `start_pos..start_pos + n` of `layer`; [`check_append`](KvStore::check_append)
    /// passed for them.
    fn append(&mut self, layer: usize, start_pos: usize, k: &[f32], v: &[f32]);
    /// The key row of position `t` of `layer` (`n_kv_head * head_dim` floats).
    fn key(&self, layer: usize, t: usize) -> &[f32];
    /// The value row of position `t` of `layer`.
    fn value(&self, layer: usize, t: usize) -> &[f32];
}

impl KvStore for KvCache {
    fn n_layers(&self) -> usize {
        self.lens.len()
    }

    fn layer_len(&self, layer: usize) -> usize {
        self.lens[layer]
    }

    fn check_append(&self, layer: usize, start_pos: usize, n: usize) -> Result<()> {
        check_append_at(self.lens[layer], self.capacity, layer, start_pos, n)
    }

    fn append(&mut self, layer: usize, start_pos: usize, k: &[f32], v: &[f32]) {
        let n = k.len() / self.row;
        let range = start_pos * self.row..(start_pos + n) * self.row;
        self.k[layer][range.clone()].copy_from_slice(k);
        self.v[layer][range].copy_from_slice(v);
        self.lens[layer] = start_pos + n;
    }

    #[inline]
    fn key(&self, layer: usize, t: usize) -> &[f32] {
        &self.k[layer][t * self.row..(t + 1) * self.row]
    }

    #[inline]
    fn value(&self, layer: usize, t: usize) -> &[f32] {
        &self.v[layer][t * self.row..(t + 1) * self.row]
    }
}

/// The append check shared by every [`KvStore`]: the layer holds exactly
/// `start_pos` positions and `capacity` has room for `n` more.
pub(crate) fn check_append_at(
    len: usize,
    capacity: usize,
    layer: usize,
    start_pos: usize,
    n: usize,
) -> Result<()> {
    if start_pos != len {
        return Err(ModelError::InvalidArgument(format!(
            "layer {layer}: forward at position {start_pos} but the cache holds {len} positions"
        )));
    }
    match start_pos.checked_add(n) {
        Some(end) if end <= capacity => Ok(()),
        _ => Err(ModelError::SequenceTooLong {
            needed: start_pos.saturating_add(n),
            capacity,
        }),
    }
}
