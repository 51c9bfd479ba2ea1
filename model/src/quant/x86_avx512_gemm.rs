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
//! those of the scalar reference (the contract of `super`):
//! - Q4_0/Q5_0/Q8_0 (lane-wise contract): the panel holds each block pair as
//!   the row kernel's registers would (unsigned `w + off`, scales
//!   `[dw_b ×8, dw_b+1 ×8]`), the same `vpdpbusd` from the activations'
//!   `−off·Σ4 x` gives the same 8 exact lanes per block, and pair `p` steps
//!   accumulator `p % 2` (sets 0 | 1 or 2 | 3) exactly as `group_pair`;
//!   the end is `group_rows`' reduction.
//! - Q4_1/Q5_1 (whole-block contract: one exact `s` per block, then
//!   `combine::min_block_step` into lane `b % 16`): weights and activations
//!   are regrouped so that a group of 16 blocks is 8 vectors whose lane i
//!   holds four values of block i; 8 `vpdpbusd` into one accumulator leave
//!   lane i = the exact `s` of block i, with no reduction tree. A last,
//!   partial group of `n` blocks uses `G` = the next power of two ≥ n
//!   (at least 2) lanes per vector (`G / 2` vectors; lane i holds values
//!   of block `i % G`), folded to G lanes at the end (exact integer adds).
//!   The float step is `min_group`'s, for the group's blocks as lanes.

use std::arch::x86_64::*;

use super::act::Act;
use super::blocks::{BlockQ4_1, BlockQ5_1, QK};
use super::combine;
use super::x86_avx512::unpack_pair;
use super::{OutPtr, QMatrix, QuantFormat};

/// Activation rows per micro-kernel step (Q4_1/Q5_1).
const MR: usize = 2;
/// Weight rows per panel (unpacked once, used for every activation row).
const NR: usize = 4;
/// Activation rows per step of the Q4_0/Q5_0/Q8_0 kernel (two accumulators
/// per row and weight row).
const MR_LANE: usize = 2;
/// Weight rows per panel of the Q4_0/Q5_0/Q8_0 kernel.
const NL: usize = 4;

/// Blocks per full group of the Q4_1/Q5_1 layout (= `combine::MIN_LANES`).
const GB: usize = combine::MIN_LANES;
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

/// The regrouped layout of a row of `nb` blocks (Q4_1/Q5_1).
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

/// `act.qs` (Q8_1) regrouped into [`Act::qt`]'s layout.
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
pub(super) fn applies(isa: super::Isa, format: QuantFormat, m: usize) -> bool {
    matches!(isa, super::Isa::Avx512Vnni | super::Isa::Amx)
        && handles(format)
        && m >= super::gemm_min_rows(format)
}

/// Output columns (weight rows) `j0..j1` of `w` × every row of `act` into
/// `out` (`m × w.rows`).
///
/// # Safety
/// AVX-512 F/BW/VL + VNNI, AVX2, F16C available; `w` validated, `act`
/// built for `w.format` (Q8_0 with `prepare_unsigned`, or Q8_1 with
/// [`Act::qt`] from [`regroup_act`]); `j0 ≤ j1 ≤ w.rows`; no other task
/// writes these columns.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn run(w: &QMatrix, act: &Act, j0: usize, j1: usize, out: OutPtr) {
    // SAFETY: the caller's contract.
    unsafe {
        match w.format {
            QuantFormat::Q4_1 => min_run::<false>(w, act, j0, j1, out),
            QuantFormat::Q5_1 => min_run::<true>(w, act, j0, j1, out),
            _ => lane_run(w, act, j0, j1, out),
        }
    }
}

/// [`combine::reduce16`] of the 16 lanes, vectorized in the same order:
/// `h[k] = a[k] + a[k + 8]`, then `((h0 + h4) + (h2 + h6)) + ((h1 + h5) +
/// (h3 + h7))` (`combine::reduce8`). (`group_rows`' end, `(set0 + set2) +
/// (set1 + set3)` lane-wise then `reduce8`, is this same sum of `a0 + a1`.)
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

// ---------------------------------------------------------------- Q4_1/Q5_1

/// A panel of up to [`NR`] Q4_1/Q5_1 weight rows, unpacked.
struct MinPanel {
    /// `NR × stride` unsigned values in the regrouped layout
    q: Vec<u8>,
    /// per row and group: 16 scales, then 16 offsets (zeros past the row)
    dm: Vec<f32>,
}

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
    p: &mut MinPanel,
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

/// Q4_1 (Q5_1 if `FIVE`) columns `j0..j1`, panel by panel.
///
/// # Safety
/// As [`run`].
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn min_run<const FIVE: bool>(w: &QMatrix, act: &Act, j0: usize, j1: usize, out: OutPtr) {
    let g = Groups::new(act.nb);
    debug_assert_eq!(act.qt.len(), act.m * g.stride, "Act::qt not built");
    let mut idx: Vec<[__m512i; 4]> = (0..GB / 2).map(|v| lane_index::<FIVE>(GB, v)).collect();
    if g.tail > 0 {
        idx.extend((0..g.tg / 2).map(|v| lane_index::<FIVE>(g.tg, v)));
    }
    let mut p = MinPanel {
        q: vec![0; NR * g.stride],
        dm: vec![0.0; NR * g.count() * 2 * GB],
    };
    let mut j = j0;
    while j < j1 {
        let nr = NR.min(j1 - j);
        // SAFETY: the CPU features (the caller).
        unsafe { min_panel::<FIVE>(w, &g, &idx, j, nr, &mut p) };
        let mut t = 0;
        while t < act.m {
            let mr = MR.min(act.m - t);
            let mut res = [[0f32; NR]; MR];
            // SAFETY: rows t..t + mr < m; the panel has NR rows.
            unsafe {
                match mr {
                    1 => min_tile::<1>(act, &g, t, &p, &mut res),
                    2 => min_tile::<2>(act, &g, t, &p, &mut res),
                    3 => min_tile::<3>(act, &g, t, &p, &mut res),
                    _ => min_tile::<MR>(act, &g, t, &p, &mut res),
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
/// Rows `t0..t0 + R` exist in `act`, whose [`Act::qt`] is built.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn min_tile<const R: usize>(
    act: &Act,
    g: &Groups,
    t0: usize,
    p: &MinPanel,
    res: &mut [[f32; NR]; MR],
) {
    let mut acc = [[_mm512_setzero_ps(); NR]; R];
    // SAFETY (all calls): groups < g.count(); the caller's contract.
    unsafe {
        for gi in 0..g.full {
            let s = group_sums::<R, { GB / 2 }>(act, g, t0, p, gi);
            min_step::<R>(act, g, t0, p, gi, GB, &s, &mut acc);
        }
        if g.tail > 0 {
            let gi = g.full;
            let s = match g.tg {
                2 => fold_all::<R>(group_sums::<R, 1>(act, g, t0, p, gi), 2),
                4 => fold_all::<R>(group_sums::<R, 2>(act, g, t0, p, gi), 4),
                8 => fold_all::<R>(group_sums::<R, 4>(act, g, t0, p, gi), 8),
                _ => group_sums::<R, { GB / 2 }>(act, g, t0, p, gi),
            };
            min_step::<R>(act, g, t0, p, gi, g.tail, &s, &mut acc);
        }
    }
    for r in 0..R {
        for c in 0..NR {
            res[r][c] = reduce16(acc[r][c]);
        }
    }
}

/// [`fold_lanes`] of every sum.
#[inline]
#[target_feature(enable = "avx512f")]
fn fold_all<const R: usize>(s: [[__m512i; NR]; R], gsize: usize) -> [[__m512i; NR]; R] {
    s.map(|row| row.map(|v| fold_lanes(v, gsize)))
}

/// The `V` vectors of group `gi` × rows `t0..t0 + R` × the panel's rows:
/// per pair one accumulator of exact lanes.
///
/// # Safety
/// As [`min_tile`]; `gi < g.count()`, `V` its vectors.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn group_sums<const R: usize, const V: usize>(
    act: &Act,
    g: &Groups,
    t0: usize,
    p: &MinPanel,
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

/// `min_group`'s float step for group `gi` (its first `n` blocks as lanes
/// 0..n): `acc += (dw·dx)·s + mw·xs`.
///
/// # Safety
/// As [`min_tile`]; `gi < g.count()` has `n` blocks.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn min_step<const R: usize>(
    act: &Act,
    g: &Groups,
    t0: usize,
    p: &MinPanel,
    gi: usize,
    n: usize,
    s: &[[__m512i; NR]; R],
    acc: &mut [[__m512; NR]; R],
) {
    let ng = g.count();
    let k: __mmask16 = (u32::MAX >> (32 - n)) as u16;
    let b = gi * GB;
    let dmp = p.dm.as_ptr();
    // SAFETY: the panel holds ng groups of 2·16 floats per row.
    let (dw, mw): ([__m512; NR], [__m512; NR]) = unsafe {
        (
            std::array::from_fn(|c| _mm512_loadu_ps(dmp.add((c * ng + gi) * 2 * GB))),
            std::array::from_fn(|c| _mm512_loadu_ps(dmp.add((c * ng + gi) * 2 * GB + GB))),
        )
    };
    for r in 0..R {
        let at = (t0 + r) * act.nb + b;
        // SAFETY: blocks b..b + n of row t0 + r (the mask reads no more).
        let (dx, xs) = unsafe {
            (
                _mm512_maskz_loadu_ps(k, act.d.as_ptr().add(at)),
                _mm512_maskz_loadu_ps(k, act.xs.as_ptr().add(at)),
            )
        };
        for c in 0..NR {
            let sf = _mm512_cvtepi32_ps(s[r][c]);
            let pv = _mm512_add_ps(
                _mm512_mul_ps(_mm512_mul_ps(dw[c], dx), sf),
                _mm512_mul_ps(mw[c], xs),
            );
            acc[r][c] = _mm512_mask_add_ps(acc[r][c], k, acc[r][c], pv);
        }
    }
}

// ------------------------------------------------------------ Q4_0/Q5_0/Q8_0

/// A panel of up to [`NL`] Q4_0/Q5_0/Q8_0 weight rows: per row and block
/// pair, the unsigned values (64 bytes) and `[dw_b ×8, dw_b+1 ×8]`, as
/// `x86_avx512::unpack_pair` gives them (a lone last block: zeros in the
/// high half).
struct LanePanel {
    u: Vec<__m512i>,
    dw: Vec<__m512>,
}

/// Columns `j0..j1` of a Q4_0/Q5_0/Q8_0 matrix, panel by panel.
///
/// # Safety
/// As [`run`].
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn lane_run(w: &QMatrix, act: &Act, j0: usize, j1: usize, out: OutPtr) {
    let nb = act.nb;
    let np = nb.div_ceil(2);
    let mut p = LanePanel {
        u: vec![_mm512_setzero_si512(); NL * np],
        dw: vec![_mm512_setzero_ps(); NL * np],
    };
    let mut j = j0;
    while j < j1 {
        let nr = NL.min(j1 - j);
        for c in 0..NL {
            for q in 0..np {
                let (u, dw) = if c >= nr {
                    (_mm512_setzero_si512(), _mm512_setzero_ps())
                } else if 2 * q + 1 < nb {
                    unpack_pair::<true>(w.format, w.row_data(j + c), 2 * q)
                } else {
                    unpack_pair::<false>(w.format, w.row_data(j + c), 2 * q)
                };
                p.u[c * np + q] = u;
                p.dw[c * np + q] = dw;
            }
        }
        let mut t = 0;
        while t < act.m {
            let mr = MR_LANE.min(act.m - t);
            let mut res = [[0f32; NL]; MR_LANE];
            // SAFETY: rows t..t + mr < m; the panel has NL rows.
            unsafe {
                match mr {
                    1 => lane_tile::<1>(act, t, &p, &mut res),
                    2 => lane_tile::<2>(act, t, &p, &mut res),
                    _ => lane_tile::<MR_LANE>(act, t, &p, &mut res),
                }
                store(&res, mr, nr, out, w.rows, t, j);
            }
            t += mr;
        }
        j += nr;
    }
}

/// Activation rows `t0..t0 + R` × the panel's [`NL`] rows: `group_rows`
/// for each pair, with the weights from the panel.
///
/// # Safety
/// Rows `t0..t0 + R` exist in `act` (Q8_0, `prepare_unsigned` done).
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn lane_tile<const R: usize>(
    act: &Act,
    t0: usize,
    p: &LanePanel,
    res: &mut [[f32; NL]; MR_LANE],
) {
    let np = act.nb.div_ceil(2);
    let mut a0 = [[_mm512_setzero_ps(); NL]; R];
    let mut a1 = [[_mm512_setzero_ps(); NL]; R];
    let mut q = 0;
    // SAFETY (all calls): pairs q < np; the caller's contract.
    unsafe {
        while q + 2 <= np {
            lane_pair::<R>(act, t0, p, q, &mut a0);
            lane_pair::<R>(act, t0, p, q + 1, &mut a1);
            q += 2;
        }
        if q < np {
            lane_pair::<R>(act, t0, p, q, &mut a0);
        }
    }
    for r in 0..R {
        for c in 0..NL {
            // combine::reduce_group: (set0 + set2) + (set1 + set3), then reduce8.
            res[r][c] = reduce16(_mm512_add_ps(a0[r][c], a1[r][c]));
        }
    }
}

/// Pair `q` (blocks 2q, 2q + 1) × rows `t0..t0 + R` × the panel's rows
/// into `acc` (`group_pair`).
///
/// # Safety
/// As [`lane_tile`]; `q < nb.div_ceil(2)`.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn lane_pair<const R: usize>(
    act: &Act,
    t0: usize,
    p: &LanePanel,
    q: usize,
    acc: &mut [[__m512; NL]; R],
) {
    let (nb, cols) = (act.nb, act.cols);
    let np = nb.div_ceil(2);
    let (qs, d8, corr) = (act.qs.as_ptr(), act.d8.as_ptr(), act.corr4.as_ptr());
    let b = 2 * q;
    // The lone last block: the high halves are zeros (masked loads).
    let k: __mmask16 = if b + 1 < nb { 0xFFFF } else { 0x00FF };
    let kb: __mmask64 = if b + 1 < nb {
        u64::MAX
    } else {
        u32::MAX as u64
    };
    let mut x = [_mm512_setzero_si512(); R];
    let mut dx = [_mm512_setzero_ps(); R];
    let mut cr = [_mm512_setzero_si512(); R];
    for r in 0..R {
        let row = t0 + r;
        // SAFETY: blocks b (and b + 1 when it exists) of row `row`; the
        // masks read no further.
        unsafe {
            x[r] = _mm512_maskz_loadu_epi8(kb, qs.add(row * cols + b * QK).cast());
            dx[r] = _mm512_maskz_loadu_ps(k, d8.add((row * nb + b) * 8));
            cr[r] = _mm512_maskz_loadu_epi32(k, corr.add((row * cols + b * QK) / 4).cast());
        }
    }
    for c in 0..NL {
        let (u, dw) = (p.u[c * np + q], p.dw[c * np + q]);
        for r in 0..R {
            // Σ4 u·x − off·Σ4 x = Σ4 w·x (group_pair)
            let s = _mm512_dpbusd_epi32(cr[r], u, x[r]);
            let pv = _mm512_mul_ps(_mm512_mul_ps(dw, dx[r]), _mm512_cvtepi32_ps(s));
            acc[r][c] = _mm512_add_ps(acc[r][c], pv);
        }
    }
}
