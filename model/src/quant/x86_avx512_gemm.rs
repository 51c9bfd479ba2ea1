//! The AVX-512 VNNI large-m ("GEMM") path: Q4_0/Q5_0/Q8_0 and Q4_1/Q5_1
//! weights × many activation rows (a prefill), docs/model-core.md "GEMM
//! path".
//!
//! The row kernels of `x86_avx512` / `x86_avx512_formats` take activation
//! rows in tiles of [`super::TILE`], in passes of a few rows per weight row,
//! and unpack every weight block again for every pass: at m = 128 the whole
//! matrix is unpacked 16 times, and each weight row streams all activation
//! rows of the tile from L2. Here a panel of [`NR`] weight rows is unpacked
//! to bytes **once** (into a small buffer that stays in L1) and then
//! multiplied with **every** activation row of the call, [`MR`] rows at a
//! time with `MR × NR` register accumulators.
//!
//! Only the integer work is arranged differently; every float operation is
//! the row kernels' own, in the same order, so the results are bit for bit
//! those of the scalar reference (the contract of `super`). Every format
//! here has the whole-block contract (one exact `s` per block, then
//! `combine::block_step` or `combine::min_block_step` into lane `b % 16`):
//! weights and activations are regrouped so that a group of 16 blocks is 8
//! vectors whose lane i holds four values of block i; 8 `vpdpbusd` into one
//! accumulator leave lane i = the exact sum of block i, with no reduction
//! tree (Q4_0/Q5_0/Q8_0: of the unsigned weights `w + off`, corrected by
//! the activation's `−off·Σ32 x`). A last, partial group of `n` blocks
//! uses `G` = the next power of two ≥ n (at least 2) lanes per vector (`G
//! / 2` vectors; lane i holds values of block `i % G`), folded to G lanes
//! at the end (exact integer adds). The float step is the row kernel's
//! (`x86_avx512_formats::block_step16`), for the group's blocks as lanes.
//!
//! Panels: Q4_1/Q5_1 blocks (20 and 24 bytes, whole 32-bit words) are
//! regrouped straight from the weights by permutes; Q4_0/Q5_0/Q8_0 blocks
//! (18, 22, 34 bytes) are unpacked to unsigned bytes in element order
//! first (`x86_avx512_formats::unsigned_pair`) and then regrouped as the
//! activations are.

use std::arch::x86_64::*;

use super::act::Act;
use super::blocks::{BlockQ4_1, BlockQ5_1, QK};
use super::combine;
use super::types::{Isa, OutPtr, QMatrix, QuantFormat};
use super::x86_avx512_formats::{block_scales, block_step16, has_offset, unsigned_pair};

/// Activation rows per micro-kernel step.
const MR: usize = 2;
/// Weight rows per panel (unpacked once, used for every activation row).
const NR: usize = 4;

/// Blocks per full group of the regrouped layout (= `combine::BLOCK_LANES`).
const GB: usize = combine::BLOCK_LANES;
/// Bytes of one full group of one row in the regrouped layout.
const GROUP_BYTES: usize = GB * QK;

/// Whether this path has a kernel for `format`.
pub(super) fn handles(format: QuantFormat) -> bool {
    matches!(
        format,
        QuantFormat::Q4_0
            | QuantFormat::Q5_0
            | QuantFormat::Q8_0
            | QuantFormat::Q4_1
            | QuantFormat::Q5_1
    )
}

/// The regrouped layout of a row of `nb` blocks.
#[derive(Clone, Copy, Debug)]
pub(super) struct Groups {
    /// full groups of [`GB`] blocks
    full: usize,
    /// blocks of the last, partial group (0: none)
    tail: usize,
    /// lanes per vector of the partial group: a power of two ≥ `tail`, ≥ 2
    tg: usize,
    /// bytes per row
    pub(super) stride: usize,
}

impl Groups {
    pub(super) fn new(nb: usize) -> Self {
        let (full, tail) = (nb / GB, nb % GB);
        let tg = if tail == 0 {
            0
        } else {
            tail.next_power_of_two().max(2)
        };
        Self {
            full,
            tail,
            tg,
            stride: full * GROUP_BYTES + tg / 2 * 64,
        }
    }

    fn count(&self) -> usize {
        self.full + usize::from(self.tail > 0)
    }

    /// Blocks and lanes per vector of group `gi`.
    fn group(&self, gi: usize) -> (usize, usize) {
        if gi < self.full {
            (GB, GB)
        } else {
            (self.tail, self.tg)
        }
    }
}

/// The 32-bit words, counted from the group's first block in element
/// order, that vector `v` of a group of `gsize` lanes per vector takes:
/// lane L holds word `(L / gsize)·(gsize / 2) + v` of block `L % gsize`.
#[inline]
#[target_feature(enable = "avx512f")]
fn gather_index(gsize: usize, v: usize) -> __m512i {
    let mut a = [0i32; 16];
    for (l, a) in a.iter_mut().enumerate() {
        *a = ((l % gsize) * 8 + (l / gsize) * (gsize / 2) + v) as i32;
    }
    // SAFETY: 64 bytes from a [i32; 16].
    unsafe { _mm512_loadu_si512(a.as_ptr().cast()) }
}

/// Regroup one row of `g.nb` blocks of 32 bytes (`src`, element order)
/// into `dst` (`g.stride` bytes). Blocks past the row read as zeros.
///
/// # Safety
/// `src` holds `32·g.nb` readable bytes, `dst` `g.stride` writable ones.
#[inline]
#[target_feature(enable = "avx2,avx512f")]
unsafe fn regroup_row(g: &Groups, src: *const u8, dst: *mut u8) {
    for gi in 0..g.count() {
        let (n, gsize) = g.group(gi);
        let k = lane_mask(n, gsize);
        for v in 0..gsize / 2 {
            // SAFETY: the masked lanes read words of existing blocks.
            unsafe {
                let x = _mm512_mask_i32gather_epi32::<4>(
                    _mm512_setzero_si512(),
                    k,
                    gather_index(gsize, v),
                    src.add(gi * GROUP_BYTES).cast(),
                );
                _mm512_storeu_si512(dst.add(gi * GROUP_BYTES + 64 * v).cast(), x);
            }
        }
    }
}

/// `act.qs` (Q8_0 or Q8_1) regrouped into [`Act::qt`]'s layout.
pub(super) fn regroup_act(act: &Act) -> Vec<i8> {
    let g = Groups::new(act.nb);
    let mut out = vec![0i8; act.m * g.stride];
    for (t, row) in out.chunks_exact_mut(g.stride).enumerate() {
        // SAFETY: AVX-512 F is available (this path runs only on AVX-512
        // VNNI); the row holds 32·nb values, `row` `stride` bytes.
        unsafe { regroup_row(&g, act.row_qs(t).as_ptr().cast(), row.as_mut_ptr().cast()) };
    }
    out
}

/// Whether the path runs for `format` on `isa` with `m` rows.
pub(super) fn applies(isa: Isa, format: QuantFormat, m: usize) -> bool {
    matches!(isa, Isa::Avx512Vnni | Isa::Amx)
        && handles(format)
        && m >= super::common::gemm_min_rows(format)
}

/// Output columns (weight rows) `j0..j1` of `w` × every row of `act` into
/// `out` (`m × w.rows`).
///
/// # Safety
/// AVX-512 F/BW/VL + VNNI, AVX2, F16C available; `w` validated, `act`
/// built for `w.format` (Q8_0 with `prepare_unsigned`, or Q8_1), with
/// [`Act::qt`] from [`regroup_act`]; `j0 ≤ j1 ≤ w.rows`; no other task
/// writes these columns.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn run(w: &QMatrix, act: &Act, j0: usize, j1: usize, out: OutPtr) {
    // SAFETY: the caller's contract.
    unsafe {
        match w.format {
            QuantFormat::Q4_1 => block_run(w, act, j0, j1, out, min_panel::<false>),
            QuantFormat::Q5_1 => block_run(w, act, j0, j1, out, min_panel::<true>),
            _ => block_run(w, act, j0, j1, out, signed_panel),
        }
    }
}

/// [`combine::reduce16`] of the 16 lanes, vectorized in the same order:
/// `h[k] = a[k] + a[k + 8]`, then `((h0 + h4) + (h2 + h6)) + ((h1 + h5) +
/// (h3 + h7))` (`combine::reduce8`).
#[inline]
#[target_feature(enable = "avx2,avx512f")]
fn reduce16(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let h = _mm256_add_ps(lo, hi);
    // [h0 + h4, h1 + h5, h2 + h6, h3 + h7]
    let a = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
    // [a0 + a2, a1 + a3, ..]
    let b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    _mm_cvtss_f32(_mm_add_ss(b, _mm_shuffle_ps::<1>(b, b)))
}

/// Write `res[r][c]` to `out[(t0 + r) * rows + j + c]` for r < `mr`, c < `nr`.
///
/// # Safety
/// Those elements are inside `out` and this task's.
#[inline(always)]
unsafe fn store<const A: usize, const B: usize>(
    res: &[[f32; B]; A],
    mr: usize,
    nr: usize,
    out: OutPtr,
    rows: usize,
    t0: usize,
    j: usize,
) {
    for (r, res) in res.iter().enumerate().take(mr) {
        for (c, &v) in res.iter().enumerate().take(nr) {
            // SAFETY: the caller's contract.
            unsafe { *out.get().add((t0 + r) * rows + j + c) = v };
        }
    }
}

/// A panel of up to [`NR`] weight rows, unpacked.
struct BlockPanel {
    /// `NR × stride` unsigned values in the regrouped layout
    q: Vec<u8>,
    /// per row and group: 16 scales, then 16 offsets (zeros past the row,
    /// and for the signed formats)
    dm: Vec<f32>,
    /// [`signed_panel`]'s unsigned values of one row in element order
    /// (`64 × pairs` bytes; empty for Q4_1/Q5_1)
    bytes: Vec<u8>,
}

/// Unpacks weight rows `j..j + nr` of `w` into a panel (the rows from
/// `nr` on are left as they were): [`min_panel`] or [`signed_panel`].
type PanelFn = unsafe fn(&QMatrix, &Groups, &[[__m512i; 4]], usize, usize, &mut BlockPanel);

/// Per-lane word indices and shifts that build vector `v` of a group of
/// `gsize` lanes per vector straight from Q4_1/Q5_1 blocks (`FIVE`): lane
/// L takes word `d = (L / gsize)·(gsize / 2) + v` of block `i = L % gsize`,
/// i.e. the low (d < 4) or high nibbles of `qs` word `d % 4` and, for
/// Q5_1, bits `4d..4d + 4` of `qh`. Returns (indices of the `qs` words in
/// the group's 32-bit words, nibble shifts, indices of the `qh` words, qh
/// shifts).
#[inline]
#[target_feature(enable = "avx512f")]
fn lane_index<const FIVE: bool>(gsize: usize, v: usize) -> [__m512i; 4] {
    let (bsz, qoff) = (min_block_bytes::<FIVE>(), if FIVE { 8 } else { 4 });
    let mut a = [[0i32; 16]; 4];
    for l in 0..16 {
        let (i, d) = (l % gsize, (l / gsize) * (gsize / 2) + v);
        a[0][l] = ((i * bsz + qoff) / 4 + d % 4) as i32;
        a[1][l] = if d < 4 { 0 } else { 4 };
        a[2][l] = ((i * bsz + 4) / 4) as i32;
        a[3][l] = 4 * d as i32;
    }
    // SAFETY: 64 bytes from each [i32; 16].
    a.map(|a| unsafe { _mm512_loadu_si512(a.as_ptr().cast()) })
}

/// Bytes of a Q4_1 (Q5_1 if `FIVE`) block.
const fn min_block_bytes<const FIVE: bool>() -> usize {
    if FIVE {
        std::mem::size_of::<BlockQ5_1>()
    } else {
        std::mem::size_of::<BlockQ4_1>()
    }
}

/// Lane l = 32-bit word `idx[l]` of `src` (words 0..96; lanes outside `k`:
/// zero), for words below `32·pairs` (two vectors per pair): a permute per
/// pair of vectors instead of a gather (far slower on AMD's Zen 4).
#[inline]
#[target_feature(enable = "avx512f")]
fn select(src: &[__m512i; 6], pairs: usize, idx: __m512i, k: __mmask16) -> __m512i {
    let hi = _mm512_srli_epi32::<5>(idx);
    let mut out = _mm512_setzero_si512();
    for p in 0..pairs {
        let t = _mm512_permutex2var_epi32(src[2 * p], idx, src[2 * p + 1]);
        let m = _mm512_mask_cmpeq_epi32_mask(k, hi, _mm512_set1_epi32(p as i32));
        out = _mm512_mask_mov_epi32(out, m, t);
    }
    out
}

/// The lanes of a group of `gsize` lanes per vector whose block is one of
/// the group's `n`.
fn lane_mask(n: usize, gsize: usize) -> __mmask16 {
    (0..16).filter(|l| l % gsize < n).fold(0, |k, l| k | 1 << l)
}

/// Unpack weight rows `j..j + nr` into `p` with permutes of the blocks
/// (`idx`: [`lane_index`] of a full group's 8 vectors, then of the partial
/// group's). Rows from `nr` on are left as they were.
///
/// # Safety
/// The CPU features; rows `j..j + nr` exist in `w` (Q4_1, or Q5_1 if
/// `FIVE`, `g.nb` blocks per row).
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn min_panel<const FIVE: bool>(
    w: &QMatrix,
    g: &Groups,
    idx: &[[__m512i; 4]],
    j: usize,
    nr: usize,
    p: &mut BlockPanel,
) {
    let bsz = min_block_bytes::<FIVE>();
    let ng = g.count();
    let lo4 = _mm512_set1_epi8(0x0F);
    let block_words = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(bsz as i32 / 4),
    );
    for c in 0..nr {
        let wrow = w.row_data(j + c).as_ptr();
        for gi in 0..ng {
            let (n, gsize) = g.group(gi);
            let k = lane_mask(n, gsize);
            let first = if gi < g.full { 0 } else { GB / 2 };
            // SAFETY: the masked loads read the group's n blocks of this
            // row only; the stores are inside the panel (NR rows of
            // `stride`, ng groups of 2·16 floats).
            unsafe {
                let base = wrow.add(gi * GB * bsz);
                let bytes = n * bsz;
                let src: [__m512i; 6] = std::array::from_fn(|r| {
                    let left = bytes.saturating_sub(64 * r).min(64);
                    let kb: __mmask64 = if left == 64 {
                        u64::MAX
                    } else {
                        (1u64 << left) - 1
                    };
                    _mm512_maskz_loadu_epi8(kb, base.add(64 * r).cast())
                });
                let pairs = bytes.div_ceil(128);
                for v in 0..gsize / 2 {
                    let [qo, sh, ho, hs] = idx[first + v];
                    let q = select(&src, pairs, qo, k);
                    let mut u = _mm512_and_si512(_mm512_srlv_epi32(q, sh), lo4);
                    if FIVE {
                        let h = select(&src, pairs, ho, k);
                        let bits =
                            _mm512_and_si512(_mm512_srlv_epi32(h, hs), _mm512_set1_epi32(0xF));
                        // bit b of the 4 → bit 4 of byte b
                        let spread = _mm512_and_si512(
                            _mm512_mullo_epi32(bits, _mm512_set1_epi32(0x0020_4081)),
                            _mm512_set1_epi32(0x0101_0101),
                        );
                        u = _mm512_or_si512(u, _mm512_slli_epi32::<4>(spread));
                    }
                    let o = c * g.stride + gi * GROUP_BYTES + 64 * v;
                    _mm512_storeu_si512(p.q.as_mut_ptr().add(o).cast(), u);
                }
                // A block starts with d then m: one word, one lane each.
                let kb: __mmask16 = (u32::MAX >> (32 - n)) as u16;
                let dm = select(&src, pairs, block_words, kb);
                let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
                let m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dm)));
                let o = (c * ng + gi) * 2 * GB;
                _mm512_storeu_ps(p.dm.as_mut_ptr().add(o), d);
                _mm512_storeu_ps(p.dm.as_mut_ptr().add(o + GB), m);
            }
        }
    }
}

/// Unpack Q4_0/Q5_0/Q8_0 weight rows `j..j + nr` into `p`: per row, the
/// unsigned values of [`unsigned_pair`] in element order, regrouped as the
/// activations are ([`regroup_row`]), and the block scales of
/// [`block_scales`] (offsets: zeros). Rows from `nr` on are left as they
/// were. (`_idx`: [`PanelFn`]'s, used by [`min_panel`] only.)
///
/// # Safety
/// The CPU features; rows `j..j + nr` exist in `w` (`g`'s blocks per row).
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn signed_panel(
    w: &QMatrix,
    g: &Groups,
    _idx: &[[__m512i; 4]],
    j: usize,
    nr: usize,
    p: &mut BlockPanel,
) {
    let nb = g.full * GB + g.tail;
    let np = nb.div_ceil(2);
    debug_assert_eq!(p.bytes.len(), 64 * np, "BlockPanel::bytes not sized");
    let ng = g.count();
    for c in 0..nr {
        let wrow = w.row_data(j + c);
        for q in 0..np {
            let u = unsigned_pair(w.format, wrow, 2 * q, 2 * q + 1 < nb);
            // SAFETY: 64 bytes into pair q's place in `bytes`.
            unsafe { _mm512_storeu_si512(p.bytes.as_mut_ptr().add(64 * q).cast(), u) };
        }
        // SAFETY: `bytes` holds 32·nb values; the panel row `stride` bytes.
        unsafe { regroup_row(g, p.bytes.as_ptr(), p.q.as_mut_ptr().add(c * g.stride)) };
        for gi in 0..ng {
            let (n, _) = g.group(gi);
            let k: __mmask16 = (u32::MAX >> (32 - n)) as u16;
            // SAFETY: the group's n blocks exist; the store is inside the
            // panel (NR rows of ng groups of 2·16 floats).
            unsafe {
                let (d, m) = block_scales(w.format, wrow, gi * GB, k);
                let o = (c * ng + gi) * 2 * GB;
                _mm512_storeu_ps(p.dm.as_mut_ptr().add(o), d);
                _mm512_storeu_ps(p.dm.as_mut_ptr().add(o + GB), m);
            }
        }
    }
}

/// Columns `j0..j1`, panel by panel (`panel` unpacks them).
///
/// # Safety
/// As [`run`]; `panel` fits `w.format`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block_run(w: &QMatrix, act: &Act, j0: usize, j1: usize, out: OutPtr, panel: PanelFn) {
    let g = Groups::new(act.nb);
    debug_assert_eq!(act.qt.len(), act.m * g.stride, "Act::qt not built");
    let five = w.format == QuantFormat::Q5_1;
    let index = |gsize, v| {
        if five {
            lane_index::<true>(gsize, v)
        } else {
            lane_index::<false>(gsize, v)
        }
    };
    let mut idx: Vec<[__m512i; 4]> = Vec::new();
    if has_offset(w.format) {
        idx.extend((0..GB / 2).map(|v| index(GB, v)));
        if g.tail > 0 {
            idx.extend((0..g.tg / 2).map(|v| index(g.tg, v)));
        }
    }
    let mut p = BlockPanel {
        q: vec![0; NR * g.stride],
        dm: vec![0.0; NR * g.count() * 2 * GB],
        bytes: if has_offset(w.format) {
            Vec::new()
        } else {
            vec![0; 64 * act.nb.div_ceil(2)]
        },
    };
    let mut j = j0;
    while j < j1 {
        let nr = NR.min(j1 - j);
        // SAFETY: the CPU features (the caller); rows j..j + nr exist.
        unsafe { panel(w, &g, &idx, j, nr, &mut p) };
        let mut t = 0;
        while t < act.m {
            let mr = MR.min(act.m - t);
            let mut res = [[0f32; NR]; MR];
            // SAFETY: rows t..t + mr < m; the panel has NR rows.
            unsafe {
                match mr {
                    1 => block_tile::<1>(w.format, act, &g, t, &p, &mut res),
                    _ => block_tile::<MR>(w.format, act, &g, t, &p, &mut res),
                }
                store(&res, mr, nr, out, w.rows, t, j);
            }
            t += mr;
        }
        j += nr;
    }
}

/// Fold the `16 / gsize` segments of `gsize` lanes into lanes `0..gsize`
/// (exact integer adds; the other lanes are left unspecified).
#[inline]
#[target_feature(enable = "avx512f")]
fn fold_lanes(mut s: __m512i, gsize: usize) -> __m512i {
    let mut seg = 16;
    while seg > gsize {
        seg /= 2;
        let idx = _mm512_add_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(seg as i32),
        );
        let hi = _mm512_permutexvar_epi32(_mm512_and_si512(idx, _mm512_set1_epi32(15)), s);
        s = _mm512_add_epi32(s, hi);
    }
    s
}

/// Activation rows `t0..t0 + R` × the panel's [`NR`] rows.
///
/// # Safety
/// Rows `t0..t0 + R` exist in `act`, whose [`Act::qt`] is built (and
/// `corr`, for a signed `format`).
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block_tile<const R: usize>(
    format: QuantFormat,
    act: &Act,
    g: &Groups,
    t0: usize,
    p: &BlockPanel,
    res: &mut [[f32; NR]; MR],
) {
    let mut acc = [[_mm512_setzero_ps(); NR]; R];
    // SAFETY (all calls): groups < g.count(); the caller's contract.
    unsafe {
        for gi in 0..g.full {
            let s = group_sums::<R, { GB / 2 }>(act, g, t0, p, gi);
            panel_step::<R>(format, act, g, t0, p, gi, GB, &s, &mut acc);
        }
        if g.tail > 0 {
            let gi = g.full;
            let s = match g.tg {
                2 => fold_all::<R>(group_sums::<R, 1>(act, g, t0, p, gi), 2),
                4 => fold_all::<R>(group_sums::<R, 2>(act, g, t0, p, gi), 4),
                8 => fold_all::<R>(group_sums::<R, 4>(act, g, t0, p, gi), 8),
                _ => group_sums::<R, { GB / 2 }>(act, g, t0, p, gi),
            };
            panel_step::<R>(format, act, g, t0, p, gi, g.tail, &s, &mut acc);
        }
    }
    for r in 0..R {
        for c in 0..NR {
            res[r][c] = reduce16(acc[r][c]);
        }
    }
}

/// [`fold_lanes`] of every sum (plain loops: `array::map` is no
/// `target_feature` function, so its closures passed every vector through
/// memory and took a third of Gemma's prefill).
#[inline]
#[target_feature(enable = "avx512f")]
fn fold_all<const R: usize>(mut s: [[__m512i; NR]; R], gsize: usize) -> [[__m512i; NR]; R] {
    for row in s.iter_mut() {
        for v in row.iter_mut() {
            *v = fold_lanes(*v, gsize);
        }
    }
    s
}

/// The `V` vectors of group `gi` × rows `t0..t0 + R` × the panel's rows:
/// per pair one accumulator of exact lanes.
///
/// # Safety
/// As [`block_tile`]; `gi < g.count()`, `V` its vectors.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn group_sums<const R: usize, const V: usize>(
    act: &Act,
    g: &Groups,
    t0: usize,
    p: &BlockPanel,
    gi: usize,
) -> [[__m512i; NR]; R] {
    let (xq, wq) = (act.qt.as_ptr(), p.q.as_ptr());
    let base = gi * GROUP_BYTES;
    let mut s = [[_mm512_setzero_si512(); NR]; R];
    for v in 0..V {
        let o = base + 64 * v;
        // SAFETY: the vectors read are inside each row's `stride` bytes.
        let (x, wv): ([__m512i; R], [__m512i; NR]) = unsafe {
            (
                std::array::from_fn(|r| _mm512_loadu_si512(xq.add((t0 + r) * g.stride + o).cast())),
                std::array::from_fn(|c| _mm512_loadu_si512(wq.add(c * g.stride + o).cast())),
            )
        };
        for r in 0..R {
            for c in 0..NR {
                s[r][c] = _mm512_dpbusd_epi32(s[r][c], wv[c], x[r]);
            }
        }
    }
    s
}

/// The row kernel's float step ([`block_step16`]) for group `gi` (its
/// first `n` blocks as lanes 0..n) of every row and panel row.
///
/// # Safety
/// As [`block_tile`]; `gi < g.count()` has `n` blocks.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn panel_step<const R: usize>(
    format: QuantFormat,
    act: &Act,
    g: &Groups,
    t0: usize,
    p: &BlockPanel,
    gi: usize,
    n: usize,
    s: &[[__m512i; NR]; R],
    acc: &mut [[__m512; NR]; R],
) {
    let ng = g.count();
    let k: __mmask16 = (u32::MAX >> (32 - n)) as u16;
    let dmp = p.dm.as_ptr();
    // SAFETY: the panel holds ng groups of 2·16 floats per row.
    let dm: [(__m512, __m512); NR] = std::array::from_fn(|c| unsafe {
        let o = (c * ng + gi) * 2 * GB;
        (
            _mm512_loadu_ps(dmp.add(o)),
            _mm512_loadu_ps(dmp.add(o + GB)),
        )
    });
    for r in 0..R {
        for c in 0..NR {
            // SAFETY: blocks gi·16 + j (j < n) of row t0 + r exist.
            acc[r][c] =
                unsafe { block_step16(format, act, t0 + r, gi * GB, k, s[r][c], dm[c], acc[r][c]) };
        }
    }
}
