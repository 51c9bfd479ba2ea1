//! A per-sequence key/value cache with preallocated capacity and rollback.
//!
//! Layout per layer, by [`KvPrecision`]:
//! - `F32` (always the target's): `[capacity, n_kv_head, head_dim]` f32 for
//!   K and for V.
//! - `F16` (the draft's default): the same layout in IEEE half precision,
//!   rounded to nearest-even on write (the same on every ISA) and widened
//!   exactly on read. It is what llama.cpp keeps by default, so the draft's
//!   own answers (local and offline tokens) stay the model's: on the fixture
//!   prompts it agrees with llama.cpp as often as f32 does
//!   (docs/model-core.md, "Draft KV fidelity"). Half of f32's memory.
//! - `Int8` (an opt-in for the draft, memory over fidelity): the same layout in `i8`, plus one f32
//!   scale per (position, kv head) row, `[capacity, n_kv_head]`: symmetric
//!   quantization, `x ≈ q · scale` with `scale = max|x| / 127` over the row's
//!   `head_dim` values, so a value is off by at most `scale / 2`. Attention
//!   widens a row back to f32 when it reads it. 3.8x less memory than f32 for
//!   `head_dim` 64 (`64 + 4` bytes per row instead of `256`).
//!
//! Buffers are allocated zeroed up front (`vec![0; n]` maps lazily, so
//! untouched capacity costs address space, not RSS) and never reallocated.
//! Each layer keeps its own length so that a caller running only a layer
//! range (split execution) still gets consistency checks.
//!
//! The draft's numerics only decide which tokens it proposes; the target
//! verifies every one, so an INT8 draft cache can change acceptance, never
//! the output.

use crate::{ModelError, Result};
use half::f16;
use serde::{Deserialize, Serialize};

/// How a [`KvCache`] stores keys and values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvPrecision {
    /// 4 bytes per value; bit-for-bit what attention computed.
    #[default]
    F32,
    /// 2 bytes per value (IEEE half, round to nearest even).
    F16,
    /// 1 byte per value plus a 4-byte scale per (position, kv head).
    Int8,
}

impl KvPrecision {
    pub const ALL: [KvPrecision; 3] = [Self::F32, Self::F16, Self::Int8];

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Int8 => "int8",
        }
    }

    /// Bytes of K+V per cached token for a model of `n_layers` layers of
    /// `n_kv_head` heads of `head_dim` values (saturating).
    pub fn bytes_per_token(self, n_layers: usize, n_kv_head: usize, head_dim: usize) -> usize {
        let row = n_kv_head.saturating_mul(head_dim);
        let (values, scales) = self.row_buffer_bytes(row, n_kv_head);
        values
            .saturating_add(scales)
            .saturating_mul(2)
            .saturating_mul(n_layers)
    }

    /// Bytes one position of `row` values (`n_kv_head` heads) takes in
    /// each of a layer's K (or V) buffers: its values, and its scales (INT8:
    /// 4 bytes per kv head; 0 otherwise, the precisions without a scale
    /// buffer).
    fn row_buffer_bytes(self, row: usize, n_kv_head: usize) -> (usize, usize) {
        match self {
            Self::F32 => (row.saturating_mul(4), 0),
            Self::F16 => (row.saturating_mul(2), 0),
            Self::Int8 => (row, n_kv_head.saturating_mul(4)),
        }
    }
}

/// Bytes of a memory page: what a lazily mapped buffer becomes resident by.
pub(crate) const MEMORY_PAGE_BYTES: usize = 4096;

impl std::fmt::Display for KvPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvPrecision {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                ModelError::InvalidArgument(format!(
                    "unknown KV precision {s:?} (expected f32, f16 or int8)"
                ))
            })
    }
}

/// One position's K or V row as a [`KvStore`] holds it
/// (`n_kv_head * head_dim` values).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvRow<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    /// Value `i` of head `h` is `q[h * head_dim + i] as f32 * scales[h]`.
    Int8 {
        q: &'a [i8],
        scales: &'a [f32],
    },
}

impl KvRow<'_> {
    /// The row as f32 (`out.len()` = the row's length).
    pub fn dequantize_into(&self, out: &mut [f32]) {
        match *self {
            KvRow::F32(r) => out.copy_from_slice(r),
            KvRow::F16(r) => {
                for (o, h) in out.iter_mut().zip(r) {
                    *o = h.to_f32();
                }
            }
            KvRow::Int8 { q, scales } => {
                let hd = q.len().checked_div(scales.len()).unwrap_or(0).max(1);
                for ((o, q), s) in out.chunks_mut(hd).zip(q.chunks(hd)).zip(scales) {
                    for (o, &q) in o.iter_mut().zip(q) {
                        *o = f32::from(q) * s;
                    }
                }
            }
        }
    }
}

/// Symmetric INT8 quantization of one head's values: writes `q` and returns
/// the scale (`max|x| / 127`; 0 for an all-zero row).
pub(crate) fn quantize_head(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let inv = 127.0 / amax;
    for (o, &v) in q.iter_mut().zip(x) {
        // |v · inv| ≤ 127 up to rounding; `as` saturates (and maps NaN to 0).
        *o = (v * inv).round() as i8;
    }
    amax / 127.0
}

/// `out = x as f32`, element by element (resized to `x.len()`).
pub(crate) fn widen_i8(x: &[i8], out: &mut Vec<f32>) {
    out.clear();
    out.extend(x.iter().map(|&v| f32::from(v)));
}

/// `out = x as f32`, element by element (exact; resized to `x.len()`).
pub(crate) fn widen_f16(x: &[f16], out: &mut Vec<f32>) {
    out.clear();
    out.extend(x.iter().map(|v| v.to_f32()));
}

/// One layer's K or V in INT8: `q` `[capacity, row]`, `scales`
/// `[capacity, n_kv_head]`.
#[derive(Clone, Debug)]
struct Int8Rows {
    q: Vec<i8>,
    scales: Vec<f32>,
}

impl Int8Rows {
    fn new(capacity: usize, row: usize, heads: usize) -> Self {
        Self {
            q: vec![0i8; capacity.saturating_mul(row)],
            scales: vec![0f32; capacity.saturating_mul(heads)],
        }
    }

    /// Quantizes rows `x` (`[n, row]`) into positions `start..start + n`.
    fn write(&mut self, start: usize, x: &[f32], row: usize, heads: usize) {
        let hd = row.checked_div(heads).unwrap_or(0);
        if hd == 0 {
            return;
        }
        for (i, xr) in x.chunks_exact(row).enumerate() {
            let t = start + i;
            let qr = &mut self.q[t * row..(t + 1) * row];
            let sr = &mut self.scales[t * heads..(t + 1) * heads];
            for ((xh, qh), s) in xr.chunks_exact(hd).zip(qr.chunks_exact_mut(hd)).zip(sr) {
                *s = quantize_head(xh, qh);
            }
        }
    }

    fn row(&self, t: usize, row: usize, heads: usize) -> KvRow<'_> {
        KvRow::Int8 {
            q: &self.q[t * row..(t + 1) * row],
            scales: &self.scales[t * heads..(t + 1) * heads],
        }
    }
}

#[derive(Clone, Debug)]
enum Layers {
    F32 { k: Vec<Vec<f32>>, v: Vec<Vec<f32>> },
    F16 { k: Vec<Vec<f16>>, v: Vec<Vec<f16>> },
    Int8 { k: Vec<Int8Rows>, v: Vec<Int8Rows> },
}

#[derive(Clone, Debug)]
pub struct KvCache {
    capacity: usize,
    row: usize,
    heads: usize,
    layers: Layers,
    lens: Vec<usize>,
}

impl KvCache {
    /// An f32 cache for `n_layers` layers of `n_kv_head * head_dim` floats per
    /// token.
    pub fn new(n_layers: usize, n_kv_head: usize, head_dim: usize, capacity: usize) -> Self {
        Self::with_precision(n_layers, n_kv_head, head_dim, capacity, KvPrecision::F32)
    }

    /// A cache storing K and V at `precision`.
    pub fn with_precision(
        n_layers: usize,
        n_kv_head: usize,
        head_dim: usize,
        capacity: usize,
        precision: KvPrecision,
    ) -> Self {
        let row = n_kv_head.saturating_mul(head_dim);
        let floats = capacity.saturating_mul(row);
        let layers = match precision {
            KvPrecision::F32 => Layers::F32 {
                k: (0..n_layers).map(|_| vec![0f32; floats]).collect(),
                v: (0..n_layers).map(|_| vec![0f32; floats]).collect(),
            },
            KvPrecision::F16 => Layers::F16 {
                k: (0..n_layers).map(|_| vec![f16::ZERO; floats]).collect(),
                v: (0..n_layers).map(|_| vec![f16::ZERO; floats]).collect(),
            },
            KvPrecision::Int8 => Layers::Int8 {
                k: (0..n_layers)
                    .map(|_| Int8Rows::new(capacity, row, n_kv_head))
                    .collect(),
                v: (0..n_layers)
                    .map(|_| Int8Rows::new(capacity, row, n_kv_head))
                    .collect(),
            },
        };
        Self {
            capacity,
            row,
            heads: n_kv_head,
            layers,
            lens: vec![0; n_layers],
        }
    }

    pub fn precision(&self) -> KvPrecision {
        match self.layers {
            Layers::F32 { .. } => KvPrecision::F32,
            Layers::F16 { .. } => KvPrecision::F16,
            Layers::Int8 { .. } => KvPrecision::Int8,
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

    /// Bytes of K+V per cached token (all layers) at this cache's precision
    /// (INT8: the values and their scales).
    pub fn bytes_per_token(&self) -> usize {
        let head_dim = self.row.checked_div(self.heads).unwrap_or(0);
        self.precision()
            .bytes_per_token(self.lens.len(), self.heads, head_dim)
    }

    /// Resident bytes of this cache once `positions` positions are written:
    /// each of its buffers (per layer K and V; at INT8 their values and their
    /// scales) rounded up to whole 4 KiB pages. The buffers are allocated
    /// zeroed for the whole capacity and mapped lazily, so what a cache
    /// occupies is the pages written, not `positions · bytes_per_token()`:
    /// for a short context the rounding is as large as the data (a
    /// conversation cache's budget counts this, issue 31 item 4).
    pub fn resident_bytes(&self, positions: usize) -> u64 {
        let page = MEMORY_PAGE_BYTES as u64;
        let positions = positions.min(self.capacity) as u64;
        let buffer = |bytes_per_position: usize| {
            positions
                .saturating_mul(bytes_per_position as u64)
                .div_ceil(page)
                .saturating_mul(page)
        };
        let (values, scales) = self.precision().row_buffer_bytes(self.row, self.heads);
        buffer(values)
            .saturating_add(buffer(scales))
            .saturating_mul(2)
            .saturating_mul(self.lens.len() as u64)
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
/// either layout (for f32 rows; an INT8 row is widened first).
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
    /// The key row of position `t` of `layer` (`n_kv_head * head_dim` values).
    fn key(&self, layer: usize, t: usize) -> KvRow<'_>;
    /// The value row of position `t` of `layer`.
    fn value(&self, layer: usize, t: usize) -> KvRow<'_>;
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
        let (row, heads) = (self.row, self.heads);
        let n = k.len().checked_div(row).unwrap_or(0);
        match &mut self.layers {
            Layers::F32 { k: kc, v: vc } => {
                let range = start_pos * row..(start_pos + n) * row;
                kc[layer][range.clone()].copy_from_slice(k);
                vc[layer][range].copy_from_slice(v);
            }
            Layers::F16 { k: kc, v: vc } => {
                let range = start_pos * row..(start_pos + n) * row;
                for (o, &x) in kc[layer][range.clone()].iter_mut().zip(k) {
                    *o = f16::from_f32(x);
                }
                for (o, &x) in vc[layer][range].iter_mut().zip(v) {
                    *o = f16::from_f32(x);
                }
            }
            Layers::Int8 { k: kc, v: vc } => {
                kc[layer].write(start_pos, k, row, heads);
                vc[layer].write(start_pos, v, row, heads);
            }
        }
        self.lens[layer] = start_pos + n;
    }

    #[inline]
    fn key(&self, layer: usize, t: usize) -> KvRow<'_> {
        match &self.layers {
            Layers::F32 { k, .. } => KvRow::F32(&k[layer][t * self.row..(t + 1) * self.row]),
            Layers::F16 { k, .. } => KvRow::F16(&k[layer][t * self.row..(t + 1) * self.row]),
            Layers::Int8 { k, .. } => k[layer].row(t, self.row, self.heads),
        }
    }

    #[inline]
    fn value(&self, layer: usize, t: usize) -> KvRow<'_> {
        match &self.layers {
            Layers::F32 { v, .. } => KvRow::F32(&v[layer][t * self.row..(t + 1) * self.row]),
            Layers::F16 { v, .. } => KvRow::F16(&v[layer][t * self.row..(t + 1) * self.row]),
            Layers::Int8 { v, .. } => v[layer].row(t, self.row, self.heads),
        }
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
