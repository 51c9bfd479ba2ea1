//! AVX2 kernels of the offset formats Q4_1/Q5_1 and of F16/BF16 weights (the
//! K-quants Q3_K/Q5_K share the Q6_K/Q4_K kernels of `x86_avx2`).
//!
//! Same integer sums and the same float steps as the scalar reference:
//! - Q4_1/Q5_1: the unsigned values `q` need no sign trick (`maddubs(q, x)`
//!   directly); per block and row 8 exact lanes of 4 products, reduced per
//!   8 blocks by a `hadd` tree to one exact `s` per block (lane j = block
//!   `b + j`), then [`combine::min_block_step`] for the 8 blocks as lanes
//!   (`acc += (dw·dx)·s + mw·xs`, block `b` in lane `b % 16` of two 8-lane
//!   accumulators), reduced by [`combine::reduce16`];
//! - F16/BF16: the portable 16-lane f32 dot of `scalar::row_float`
//!   (separate multiply and add per lane, [`combine::reduce16`]), the
//!   weights widened exactly (F16C's `vcvtph2ps`; a shift for BF16).

use std::arch::x86_64::*;

use super::act::Act;
use super::blocks::{cast, BlockQ4_1, BlockQ5_1, QK};
use super::combine;
use super::x86_avx2::{bytes_from_bits_32, MAX_R_GROUP};
use super::{prefetch_ahead, QuantFormat, TILE};

/// Rows per pass of the BF16 kernel (two 8-lane accumulators each).
const MAX_R_FLOAT: usize = 4;

/// Q4_1/Q5_1 weight row × a tile of `tn` rows (Q8_1), in passes of up to
/// [`MAX_R_GROUP`] rows with register accumulators (the weight row stays in
/// L1 for the later passes).
///
/// # Safety
/// AVX2 and F16C; rows `t0..t0 + tn` exist in `act`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn row_group_min(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    if format == QuantFormat::Q4_1 {
        passes!(MAX_R_GROUP, min_rows_q4_1, format, wrow, act, t0, tn, res; 1; 2)
    } else {
        passes!(MAX_R_GROUP, min_rows_q5_1, format, wrow, act, t0, tn, res; 1; 2)
    }
}

/// [`min_rows`] for Q4_1.
///
/// # Safety
/// As [`min_rows`].
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn min_rows_q4_1<const R: usize>(
    _: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    // SAFETY: the caller's contract.
    unsafe { min_rows::<R, false>(wrow, act, t0, res) }
}

/// [`min_rows`] for Q5_1.
///
/// # Safety
/// As [`min_rows`].
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn min_rows_q5_1<const R: usize>(
    _: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    // SAFETY: the caller's contract.
    unsafe { min_rows::<R, true>(wrow, act, t0, res) }
}

/// Block `b` of a Q4_1 row (or Q5_1 if `FIVE`): unsigned values (0..16 or
/// 0..32), element order.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn unpack_min<const FIVE: bool>(wrow: &[u8], b: usize) -> __m256i {
    let lo4 = _mm256_set1_epi8(0xF);
    if !FIVE {
        let blk = &cast::<BlockQ4_1>(wrow)[b];
        // SAFETY: 16 bytes read from a 16-byte array.
        let q = unsafe { _mm_loadu_si128(blk.qs.as_ptr().cast()) };
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), lo4)
    } else {
        let blk = &cast::<BlockQ5_1>(wrow)[b];
        // SAFETY: 16 bytes read from a 16-byte array.
        let q = unsafe { _mm_loadu_si128(blk.qs.as_ptr().cast()) };
        let v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), lo4);
        let hb = _mm256_and_si256(
            bytes_from_bits_32(u32::from_le_bytes(blk.qh)),
            _mm256_set1_epi8(0x10),
        );
        _mm256_or_si256(v, hb)
    }
}

/// The 16 exact i16 lanes (2 products each) of block `b` × rows
/// `t0..t0 + R`; zeros unless `present` (then not read).
///
/// # Safety
/// Rows `t0..t0 + R` exist in `act`; if `present`, block `b < act.nb`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn block_lanes<const R: usize, const FIVE: bool>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    b: usize,
    present: bool,
) -> [__m256i; R] {
    if !present {
        return [_mm256_setzero_si256(); R];
    }
    let u = unpack_min::<FIVE>(wrow, b);
    std::array::from_fn(|r| {
        // SAFETY: row t0 + r < m, block b < nb: 32 bytes inside the row.
        let x =
            unsafe { _mm256_loadu_si256(act.qs.as_ptr().add((t0 + r) * act.cols + b * QK).cast()) };
        // u ≤ 31, |x| ≤ 127: a pair sums to at most 7874 (no saturation).
        _mm256_maddubs_epi16(u, x)
    })
}

/// Blocks `b..b + 4` × rows: per row and 128-bit half h, lane i = the sum
/// of half h of block `b + i`'s lanes (exact); blocks from `b + n` on are
/// zeros.
///
/// # Safety
/// Rows `t0..t0 + R` exist in `act`; blocks `b..b + min(n, 4)` exist.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn quad_lanes<const R: usize, const FIVE: bool>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    b: usize,
    n: usize,
) -> [__m256i; R] {
    // SAFETY: the caller's contract.
    unsafe {
        // Two blocks' i16 lanes summed in pairs (≤ 2 · 7874, exact), then
        // to i32 (per 128-bit half: 2 lanes of each block), then one i32
        // `hadd` of two such pairs: per half, lane i = block b + i.
        let ones = _mm256_set1_epi16(1);
        let pair = |a: __m256i, c: __m256i| _mm256_madd_epi16(_mm256_hadd_epi16(a, c), ones);
        let v0 = block_lanes::<R, FIVE>(wrow, act, t0, b, n > 0);
        let v1 = block_lanes::<R, FIVE>(wrow, act, t0, b + 1, n > 1);
        let h01: [__m256i; R] = std::array::from_fn(|r| pair(v0[r], v1[r]));
        let v2 = block_lanes::<R, FIVE>(wrow, act, t0, b + 2, n > 2);
        let v3 = block_lanes::<R, FIVE>(wrow, act, t0, b + 3, n > 3);
        std::array::from_fn(|r| _mm256_hadd_epi32(h01[r], pair(v2[r], v3[r])))
    }
}

/// The scales and offsets `(dw, mw)` of blocks `b..b + n` (n ≤ 8; the
/// other lanes zeros), f16 → f32 with F16C (exact, as the scalar path). A
/// Q4_1/Q5_1 block of `bsz` bytes starts with `d` then `m`.
///
/// # Safety
/// Blocks `b..b + n` exist in `wrow`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn block_scales(wrow: &[u8], bsz: usize, b: usize, n: usize) -> (__m256, __m256) {
    let head = |i: usize| -> i32 {
        if i < n {
            // SAFETY: block b + i exists: its first 4 bytes are d, m.
            unsafe {
                wrow.as_ptr()
                    .add((b + i) * bsz)
                    .cast::<i32>()
                    .read_unaligned()
            }
        } else {
            0
        }
    };
    let g = _mm256_setr_epi32(
        head(0),
        head(1),
        head(2),
        head(3),
        head(4),
        head(5),
        head(6),
        head(7),
    );
    // Per 128-bit half: [d d d d m m m m] as u16 (packus of values ≤ 0xFFFF
    // is exact), then the d words of both halves side by side.
    let dm = _mm256_packus_epi32(
        _mm256_and_si256(g, _mm256_set1_epi32(0xFFFF)),
        _mm256_srli_epi32::<16>(g),
    );
    let dm = _mm256_permute4x64_epi64::<0b11_01_10_00>(dm);
    (
        _mm256_cvtph_ps(_mm256_castsi256_si128(dm)),
        _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(dm)),
    )
}

/// Blocks `b..end` (≤ 8; `FULL`: exactly 8) × rows `t0..t0 + R`: the exact
/// sum of every block and row (lane j = block `b + j`), then
/// [`combine::min_block_step`] for the blocks as lanes into `acc` (lanes
/// past `end` add +0.0, all their factors being zero, which leaves them
/// unchanged: an accumulator that starts at +0.0 never becomes −0.0).
///
/// # Safety
/// Rows `t0..t0 + R` exist in `act`; `end` ≤ `act.nb`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn min_octet<const R: usize, const FIVE: bool, const FULL: bool>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    b: usize,
    end: usize,
    acc: &mut [__m256; R],
) {
    let nb = act.nb;
    let n = if FULL { 8 } else { end - b };
    // SAFETY (all calls): blocks b..b + n exist; the caller's contract.
    unsafe {
        let lo = quad_lanes::<R, FIVE>(wrow, act, t0, b, n);
        let hi = quad_lanes::<R, FIVE>(wrow, act, t0, b + 4, n.saturating_sub(4));
        let (dw, mw) = block_scales(wrow, min_block_bytes::<FIVE>(), b, n);
        for (r, acc) in acc.iter_mut().enumerate() {
            let at = (t0 + r) * nb + b;
            let (dx, xs) = if FULL {
                (
                    _mm256_loadu_ps(act.d.as_ptr().add(at)),
                    _mm256_loadu_ps(act.xs.as_ptr().add(at)),
                )
            } else {
                // Lanes of blocks b..end (the others load as zeros).
                let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let k = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lane);
                (
                    _mm256_maskload_ps(act.d.as_ptr().add(at), k),
                    _mm256_maskload_ps(act.xs.as_ptr().add(at), k),
                )
            };
            // [blocks 0..4 low halves | 4..8 low halves] + high halves.
            let s = _mm256_add_epi32(
                _mm256_permute2x128_si256::<0x20>(lo[r], hi[r]),
                _mm256_permute2x128_si256::<0x31>(lo[r], hi[r]),
            );
            let p = _mm256_add_ps(
                _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(s)),
                _mm256_mul_ps(mw, xs),
            );
            *acc = _mm256_add_ps(*acc, p);
        }
    }
}

/// Bytes of a Q4_1 (Q5_1 if `FIVE`) block.
const fn min_block_bytes<const FIVE: bool>() -> usize {
    if FIVE {
        std::mem::size_of::<BlockQ5_1>()
    } else {
        std::mem::size_of::<BlockQ4_1>()
    }
}

/// Q4_1 (Q5_1 if `FIVE`) weight row × activation rows `t0..t0 + R`: per 8
/// blocks [`min_octet`]; block `b` in lane `b % 16` of the row's 16-lane
/// accumulator (`lo` lanes 0..8, `hi` lanes 8..16), then
/// [`combine::reduce16`].
///
/// # Safety
/// CPU features; rows `t0..t0 + R` exist in `act`; `res.len() >= R`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn min_rows<const R: usize, const FIVE: bool>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    let nb = act.nb;
    let mut lo = [_mm256_setzero_ps(); R];
    let mut hi = [_mm256_setzero_ps(); R];
    let bsz = min_block_bytes::<FIVE>();
    let mut b = 0;
    // SAFETY (all calls): block ranges inside `nb`; the caller's contract.
    unsafe {
        while b + combine::MIN_LANES <= nb {
            prefetch_ahead::<3>(wrow.as_ptr().wrapping_add(b * bsz));
            min_octet::<R, FIVE, true>(wrow, act, t0, b, 0, &mut lo);
            prefetch_ahead::<3>(wrow.as_ptr().wrapping_add((b + 8) * bsz));
            min_octet::<R, FIVE, true>(wrow, act, t0, b + 8, 0, &mut hi);
            b += combine::MIN_LANES;
        }
        if b < nb {
            min_octet::<R, FIVE, false>(wrow, act, t0, b, nb.min(b + 8), &mut lo);
        }
        if b + 8 < nb {
            min_octet::<R, FIVE, false>(wrow, act, t0, b + 8, nb, &mut hi);
        }
    }
    for r in 0..R {
        let mut a = [0f32; combine::MIN_LANES];
        // SAFETY: 2 × 8 floats into [f32; 16].
        unsafe {
            _mm256_storeu_ps(a.as_mut_ptr(), lo[r]);
            _mm256_storeu_ps(a.as_mut_ptr().add(8), hi[r]);
        }
        res[r] = combine::reduce16(&a);
    }
}

/// F16 or BF16 weight row × a tile of `tn` f32 rows, in passes of up to
/// [`MAX_R_FLOAT`] rows.
///
/// # Safety
/// AVX2 and F16C; rows `t0..t0 + tn` exist in `act`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn row_half(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    passes!(MAX_R_FLOAT, half_rows, format, wrow, act, t0, tn, res; 1 2 3; 4)
}

/// 8 half-precision values at `p` widened to f32, exactly: F16 by F16C's
/// `vcvtph2ps` (every f16, subnormals included, is an f32), BF16 by a
/// 16-bit shift.
///
/// # Safety
/// AVX2 and F16C; 16 readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen8(f16: bool, p: *const u8) -> __m256 {
    // SAFETY: the caller's contract.
    let h = unsafe { _mm_loadu_si128(p.cast()) };
    if f16 {
        _mm256_cvtph_ps(h)
    } else {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}

/// F16 or BF16 weight row × f32 rows `t0..t0 + R`: lanes 0..8 and 8..16 of
/// each 16-element chunk in two accumulators (`scalar::row_float`'s lanes),
/// the last partial chunk lane by lane as the scalar code does, then
/// [`combine::reduce16`].
///
/// # Safety
/// CPU features; rows `t0..t0 + R` exist in `act`; `res.len() >= R`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn half_rows<const R: usize>(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    let cols = act.cols;
    let full = cols / combine::F_LANES;
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let wp = wrow.as_ptr();
    let f16 = format == QuantFormat::F16;
    for c in 0..full {
        let e = c * combine::F_LANES;
        prefetch_ahead::<1>(wp.wrapping_add(2 * e));
        // SAFETY: elements e..e + 16 ≤ cols of the row (2 bytes each).
        let (w0, w1) = unsafe { (widen8(f16, wp.add(2 * e)), widen8(f16, wp.add(2 * e + 16))) };
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: row t0 + r < m: 16 floats inside its cols.
            unsafe {
                let xp = act.x.as_ptr().add((t0 + r) * cols + e);
                acc[0] = _mm256_add_ps(acc[0], _mm256_mul_ps(w0, _mm256_loadu_ps(xp)));
                acc[1] = _mm256_add_ps(acc[1], _mm256_mul_ps(w1, _mm256_loadu_ps(xp.add(8))));
            }
        }
    }
    let e = full * combine::F_LANES;
    for (r, acc) in acc.iter().enumerate() {
        let mut a = [0f32; combine::F_LANES];
        // SAFETY: 2 × 8 floats into [f32; 16].
        unsafe {
            _mm256_storeu_ps(a.as_mut_ptr(), acc[0]);
            _mm256_storeu_ps(a.as_mut_ptr().add(8), acc[1]);
        }
        let x = &act.row_x(t0 + r)[e..];
        for (k, (w, x)) in wrow[2 * e..].chunks_exact(2).zip(x).enumerate() {
            a[k] += super::scalar::widen(format, w) * x;
        }
        res[r] = combine::reduce16(&a);
    }
}
