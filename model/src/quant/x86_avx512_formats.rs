//! AVX-512 VNNI kernels of the offset formats Q4_1/Q5_1 and of BF16 weights
//! (the K-quants Q3_K/Q5_K share the Q6_K/Q4_K kernels of `x86_avx512`).
//!
//! Same integer sums and float steps as the scalar reference:
//! - Q4_1/Q5_1: two blocks per vector as `x86_avx512`'s Q4_0/Q5_0 kernels,
//!   but the weights are unsigned already, so `vpdpbusd` from zero gives the
//!   exact lanes `s`; then [`super::combine::group_min_block`] lane for
//!   lane: `acc += (dw·dx)·s + mw·xs` (block `b` of the pair in accumulator
//!   set `b % 4`);
//! - BF16: `scalar::row_float`'s 16 lanes in one vector, separate multiply
//!   and add, [`combine::reduce16`].

use std::arch::x86_64::*;

use super::act::Act;
use super::blocks::{cast, BlockQ4_1, BlockQ5_1, QK};
use super::combine;
use super::x86_avx2::reduce8;
use super::x86_avx512::{nibbles, scales, MAX_R};
use super::{prefetch_ahead, QuantFormat, TILE};

/// Q4_1/Q5_1 weight row × a tile of `tn` rows (Q8_1 with `Act::d8`), in
/// passes of up to [`MAX_R`] rows.
///
/// # Safety
/// AVX-512 F/BW/VL + VNNI, AVX2, F16C; rows `t0..t0 + tn` exist in `act`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn row_group_min(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    passes!(MAX_R, min_rows, format, wrow, act, t0, tn, res; 1 2 3 4 5 6 7; 8)
}

/// Unsigned values of blocks `b` and `b + 1` (the second only if `TWO`,
/// else zeros), their scales `[dw_b ×8, dw_b+1 ×8]` and offsets
/// `[mw_b ×8, mw_b+1 ×8]`.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl")]
fn unpack_min_pair<const TWO: bool>(
    format: QuantFormat,
    wrow: &[u8],
    b: usize,
) -> (__m512i, __m512, __m512) {
    if format == QuantFormat::Q4_1 {
        let blk = cast::<BlockQ4_1>(wrow);
        let (a, c) = (&blk[b], TWO.then(|| &blk[b + 1]));
        (
            nibbles(&a.qs, c.map(|c| &c.qs)),
            scales(a.d, c.map(|c| c.d)),
            scales(a.m, c.map(|c| c.m)),
        )
    } else {
        let blk = cast::<BlockQ5_1>(wrow);
        let (a, c) = (&blk[b], TWO.then(|| &blk[b + 1]));
        let v = nibbles(&a.qs, c.map(|c| &c.qs));
        let hbits = u32::from_le_bytes(a.qh) as u64
            | (c.map_or(0, |c| u32::from_le_bytes(c.qh)) as u64) << 32;
        let v = _mm512_mask_add_epi8(v, hbits, v, _mm512_set1_epi8(16));
        (v, scales(a.d, c.map(|c| c.d)), scales(a.m, c.map(|c| c.m)))
    }
}

/// Blocks `b`, `b + 1` (if `TWO`) × rows `t0..t0 + R` into `acc` (sets 0 | 1
/// or sets 2 | 3 of each row).
///
/// # Safety
/// Rows and blocks inside `act` / `wrow`, `Act::d8` built.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn min_pair<const R: usize, const TWO: bool>(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    b: usize,
    acc: &mut [__m512; R],
) {
    let (nb, cols) = (act.nb, act.cols);
    let (u, dw, mw) = unpack_min_pair::<TWO>(format, wrow, b);
    let (qs, d8, xs4) = (act.qs.as_ptr(), act.d8.as_ptr(), act.xs4.as_ptr());
    for (r, acc) in acc.iter_mut().enumerate() {
        let row = t0 + r;
        // SAFETY: row < m, blocks b (and b + 1) < nb: reads inside qs
        // (m·cols), d8 and xs4 (m·nb·8 each).
        unsafe {
            let xp = qs.add(row * cols + b * QK);
            let dp = d8.add((row * nb + b) * 8);
            let sp = xs4.add((row * nb + b) * 8);
            let (x, dx, xs) = if TWO {
                (
                    _mm512_loadu_si512(xp.cast()),
                    _mm512_loadu_ps(dp),
                    _mm512_loadu_ps(sp),
                )
            } else {
                (
                    _mm512_zextsi256_si512(_mm256_loadu_si256(xp.cast())),
                    _mm512_zextps256_ps512(_mm256_loadu_ps(dp)),
                    _mm512_zextps256_ps512(_mm256_loadu_ps(sp)),
                )
            };
            let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
            let p = _mm512_add_ps(
                _mm512_mul_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(s)),
                _mm512_mul_ps(mw, xs),
            );
            *acc = _mm512_add_ps(*acc, p);
        }
    }
}

/// Q4_1/Q5_1 weight row × activation rows `t0..t0 + R`: blocks in pairs,
/// pairs alternating between the two accumulators of each row (as
/// `x86_avx512::group_rows`).
///
/// # Safety
/// CPU features as enabled; rows `t0..t0 + R` exist in `act` (Q8_1 with
/// `Act::d8`) and `wrow` has `act.nb` blocks.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn min_rows<const R: usize>(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    let nb = act.nb;
    // a0: sets 0 | 1 (low | high 8 lanes), a1: sets 2 | 3.
    let mut a0 = [_mm512_setzero_ps(); R];
    let mut a1 = [_mm512_setzero_ps(); R];
    let mut b = 0;
    let bsz = format.block_bytes();
    // SAFETY (all calls): the blocks named are < nb; the caller's contract.
    unsafe {
        while b + 4 <= nb {
            prefetch_ahead::<2>(wrow.as_ptr().wrapping_add(b * bsz));
            min_pair::<R, true>(format, wrow, act, t0, b, &mut a0);
            min_pair::<R, true>(format, wrow, act, t0, b + 2, &mut a1);
            b += 4;
        }
        match nb - b {
            1 => min_pair::<R, false>(format, wrow, act, t0, b, &mut a0),
            2 => min_pair::<R, true>(format, wrow, act, t0, b, &mut a0),
            3 => {
                min_pair::<R, true>(format, wrow, act, t0, b, &mut a0);
                min_pair::<R, false>(format, wrow, act, t0, b + 2, &mut a1);
            }
            _ => {}
        }
    }
    for r in 0..R {
        // combine::reduce_group: (set0 + set2) + (set1 + set3), then reduce8.
        let v = _mm512_add_ps(a0[r], a1[r]);
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        res[r] = reduce8(_mm256_add_ps(lo, hi));
    }
}

/// BF16 weight row × a tile of `tn` f32 rows, in passes of up to [`MAX_R`]
/// rows (one 16-lane accumulator each).
///
/// # Safety
/// AVX-512 F/BW; rows `t0..t0 + tn` exist in `act`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn row_bf16(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    passes!(MAX_R, bf16_rows, format, wrow, act, t0, tn, res; 1 2 3 4 5 6 7; 8)
}

/// BF16 weight row × f32 rows `t0..t0 + R`: `scalar::row_float`'s 16 lanes,
/// the last partial chunk lane by lane, then [`combine::reduce16`].
///
/// # Safety
/// CPU features; rows `t0..t0 + R` exist in `act`; `res.len() >= R`.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn bf16_rows<const R: usize>(
    _: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    let cols = act.cols;
    let full = cols / combine::F_LANES;
    let mut acc = [_mm512_setzero_ps(); R];
    let wp = wrow.as_ptr();
    for c in 0..full {
        let e = c * combine::F_LANES;
        prefetch_ahead::<1>(wp.wrapping_add(2 * e));
        // SAFETY: elements e..e + 16 ≤ cols of the row (2 bytes each);
        // bf16 → f32 is a 16-bit shift (exact).
        let w = unsafe {
            let h = _mm256_loadu_si256(wp.add(2 * e).cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        };
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: row t0 + r < m: 16 floats inside its cols.
            let x = unsafe { _mm512_loadu_ps(act.x.as_ptr().add((t0 + r) * cols + e)) };
            *acc = _mm512_add_ps(*acc, _mm512_mul_ps(w, x));
        }
    }
    let e = full * combine::F_LANES;
    for (r, acc) in acc.iter().enumerate() {
        let mut a = [0f32; combine::F_LANES];
        // SAFETY: 16 floats into [f32; 16].
        unsafe { _mm512_storeu_ps(a.as_mut_ptr(), *acc) };
        let x = &act.row_x(t0 + r)[e..];
        for (k, (w, x)) in wrow[2 * e..].chunks_exact(2).zip(x).enumerate() {
            a[k] += super::scalar::widen(QuantFormat::BF16, w) * x;
        }
        res[r] = combine::reduce16(&a);
    }
}
