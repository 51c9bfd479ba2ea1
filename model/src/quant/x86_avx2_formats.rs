//! AVX2 kernels of the offset formats Q4_1/Q5_1 and of BF16 weights (the
//! K-quants Q3_K/Q5_K share the Q6_K/Q4_K kernels of `x86_avx2`).
//!
//! Same integer sums and the same float steps as the scalar reference:
//! - Q4_1/Q5_1: the unsigned values `q` need no sign trick (`maddubs(q, x)`
//!   directly); per block and row the 8 exact lanes `s` of 4 products, then
//!   [`combine::group_min_block`] lane for lane: `acc += dwdx·s + mw·xs`,
//!   block `b` into accumulator set `b % 4`, reduced by
//!   [`combine::reduce_group`];
//! - BF16: the portable 16-lane f32 dot of `scalar::row_float` (separate
//!   multiply and add per lane, [`combine::reduce16`]), the weights widened
//!   exactly by a shift.

use std::arch::x86_64::*;

use super::act::Act;
use super::blocks::{cast, BlockQ4_1, BlockQ5_1, QK};
use super::combine::{self, GROUP_SETS};
use super::x86_avx2::{bytes_from_bits_32, f16c, reduce_group, MAX_R_GROUP};
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
    passes!(MAX_R_GROUP, min_rows, format, wrow, act, t0, tn, res; 1; 2)
}

/// Block `b` of a Q4_1/Q5_1 row: unsigned values (0..16 or 0..32), scale and
/// offset.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn unpack_min(format: QuantFormat, wrow: &[u8], b: usize) -> (__m256i, f32, f32) {
    let lo4 = _mm256_set1_epi8(0xF);
    if format == QuantFormat::Q4_1 {
        let blk = &cast::<BlockQ4_1>(wrow)[b];
        // SAFETY: 16 bytes read from a 16-byte array.
        let q = unsafe { _mm_loadu_si128(blk.qs.as_ptr().cast()) };
        let v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), lo4);
        (v, f16c(blk.d), f16c(blk.m))
    } else {
        let blk = &cast::<BlockQ5_1>(wrow)[b];
        // SAFETY: 16 bytes read from a 16-byte array.
        let q = unsafe { _mm_loadu_si128(blk.qs.as_ptr().cast()) };
        let v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), lo4);
        let hb = _mm256_and_si256(
            bytes_from_bits_32(u32::from_le_bytes(blk.qh)),
            _mm256_set1_epi8(0x10),
        );
        (_mm256_or_si256(v, hb), f16c(blk.d), f16c(blk.m))
    }
}

/// Block `b` (accumulator set `S`) × rows `t0..t0 + R`.
///
/// # Safety
/// Rows `t0..t0 + R` exist in `act` (Q8_1) and block `b < act.nb`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn min_block<const R: usize, const S: usize>(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    b: usize,
    acc: &mut [[__m256; GROUP_SETS]; R],
) {
    let (nb, cols) = (act.nb, act.cols);
    let (qs, ds, xs4) = (act.qs.as_ptr(), act.d.as_ptr(), act.xs4.as_ptr());
    let (u, dw, mw) = unpack_min(format, wrow, b);
    let mwv = _mm256_set1_ps(mw);
    let ones = _mm256_set1_epi16(1);
    for (r, acc) in acc.iter_mut().enumerate() {
        let row = t0 + r;
        // SAFETY: row < m and b < nb: reads inside qs (m·cols), d (m·nb)
        // and xs4 (m·cols/4).
        unsafe {
            let x = _mm256_loadu_si256(qs.add(row * cols + b * QK).cast());
            let s = _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones);
            let dwdx = _mm256_set1_ps(dw * *ds.add(row * nb + b));
            let xs = _mm256_loadu_ps(xs4.add((row * nb + b) * 8));
            let term = _mm256_add_ps(
                _mm256_mul_ps(dwdx, _mm256_cvtepi32_ps(s)),
                _mm256_mul_ps(mwv, xs),
            );
            acc[S] = _mm256_add_ps(acc[S], term);
        }
    }
}

/// Q4_1/Q5_1 weight row × activation rows `t0..t0 + R`, four blocks per
/// step (constant accumulator indices), as `x86_avx2::group_rows`.
///
/// # Safety
/// CPU features; rows `t0..t0 + R` exist in `act`; `res.len() >= R`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn min_rows<const R: usize>(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    let nb = act.nb;
    let mut acc = [[_mm256_setzero_ps(); GROUP_SETS]; R];
    let bsz = format.block_bytes();
    let mut b = 0;
    // SAFETY (all calls): the blocks named are < nb; the caller's contract.
    unsafe {
        while b + GROUP_SETS <= nb {
            prefetch_ahead::<3>(wrow.as_ptr().wrapping_add(b * bsz));
            min_block::<R, 0>(format, wrow, act, t0, b, &mut acc);
            min_block::<R, 1>(format, wrow, act, t0, b + 1, &mut acc);
            min_block::<R, 2>(format, wrow, act, t0, b + 2, &mut acc);
            min_block::<R, 3>(format, wrow, act, t0, b + 3, &mut acc);
            b += GROUP_SETS;
        }
        if b < nb {
            min_block::<R, 0>(format, wrow, act, t0, b, &mut acc);
        }
        if b + 1 < nb {
            min_block::<R, 1>(format, wrow, act, t0, b + 1, &mut acc);
        }
        if b + 2 < nb {
            min_block::<R, 2>(format, wrow, act, t0, b + 2, &mut acc);
        }
    }
    for r in 0..R {
        res[r] = reduce_group(&acc[r]);
    }
}

/// BF16 weight row × a tile of `tn` f32 rows, in passes of up to
/// [`MAX_R_FLOAT`] rows.
///
/// # Safety
/// AVX2; rows `t0..t0 + tn` exist in `act`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn row_bf16(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    passes!(MAX_R_FLOAT, bf16_rows, format, wrow, act, t0, tn, res; 1 2 3; 4)
}

/// 8 bf16 at `p` widened to f32 (exact: a 16-bit shift).
///
/// # Safety
/// 16 readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn widen8(p: *const u8) -> __m256 {
    // SAFETY: the caller's contract.
    let h = unsafe { _mm_loadu_si128(p.cast()) };
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
}

/// BF16 weight row × f32 rows `t0..t0 + R`: lanes 0..8 and 8..16 of each
/// 16-element chunk in two accumulators (`scalar::row_float`'s lanes), the
/// last partial chunk lane by lane as the scalar code does, then
/// [`combine::reduce16`].
///
/// # Safety
/// CPU features; rows `t0..t0 + R` exist in `act`; `res.len() >= R`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn bf16_rows<const R: usize>(
    _: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    let cols = act.cols;
    let full = cols / combine::F_LANES;
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let wp = wrow.as_ptr();
    for c in 0..full {
        let e = c * combine::F_LANES;
        prefetch_ahead::<1>(wp.wrapping_add(2 * e));
        // SAFETY: elements e..e + 16 ≤ cols of the row (2 bytes each).
        let (w0, w1) = unsafe { (widen8(wp.add(2 * e)), widen8(wp.add(2 * e + 16))) };
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
            a[k] += super::scalar::widen(QuantFormat::BF16, w) * x;
        }
        res[r] = combine::reduce16(&a);
    }
}
