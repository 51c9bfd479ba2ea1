//! AVX-512 (F/BW/VL) + VNNI kernels (x86-64, detected at run time).
//!
//! Same integer sums and the same lane-wise float combination as the AVX2 and
//! scalar paths (see `combine`): K-quant super-blocks are processed 64 bytes
//! at a time and the two 256-bit halves of the i32 accumulator are added (an
//! exact integer step) before the shared 8-lane float step. Q4_0/Q5_0/Q8_0
//! blocks use `vpdpbusd` (sum of 4 u8·i8 products, no 16-bit saturation) on
//! 256-bit vectors.

use std::arch::x86_64::*;

use super::act::Act;
use super::blocks::{cast, f16_le, q4k_scales_mins, BlockQ4K, BlockQ6K, QK, QK_K};
use super::combine::{self, GROUP};
use super::x86_avx2::{
    hsum_8x8, q4k_float, q4k_mins16, q6k_float, q6k_scale_vectors, reduce8, unpack_block,
    unpack_q4k_values, unpack_q6k_values, A32,
};
use super::{QuantFormat, RowFn, TILE};

pub(super) fn row_fn(f: QuantFormat) -> Option<RowFn> {
    match f {
        QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q8_0 => Some(row_group),
        QuantFormat::Q4K => Some(row_q4k),
        QuantFormat::Q6K => Some(row_q6k),
        QuantFormat::F32 | QuantFormat::F16 => None,
    }
}

/// Two 256-bit halves into one 512-bit vector.
#[inline]
#[target_feature(enable = "avx512f")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// Lanes 0..8 + lanes 8..16 (exact integer fold to the shared 8-lane layout).
#[inline]
#[target_feature(enable = "avx512f")]
fn fold(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn row_group(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    let nb = act.nb;
    let mut acc = [[0f32; GROUP]; TILE];
    let (qs, ds) = (act.qs.as_ptr(), act.d.as_ptr());
    let cols = act.cols;
    for g in 0..nb.div_ceil(GROUP) {
        let nbg = GROUP.min(nb - g * GROUP);
        let mut w = [_mm256_setzero_si256(); GROUP];
        let mut dw = [0f32; GROUP];
        for k in 0..nbg {
            (w[k], dw[k]) = unpack_block(format, wrow, g * GROUP + k);
        }
        let aw: [__m256i; GROUP] = std::array::from_fn(|k| _mm256_abs_epi8(w[k]));
        for (t, acc) in acc.iter_mut().enumerate().take(tn) {
            let r = t0 + t;
            let mut v = [_mm256_setzero_si256(); GROUP];
            let mut dx = [0f32; GROUP];
            // SAFETY: blocks g·8 + k < nb of row r < m: inside qs (m·cols) and d (m·nb).
            unsafe {
                let xq = qs.add(r * cols + g * GROUP * QK);
                for k in 0..nbg {
                    let x = _mm256_loadu_si256(xq.add(k * QK).cast());
                    v[k] = _mm256_dpbusd_epi32(
                        _mm256_setzero_si256(),
                        aw[k],
                        _mm256_sign_epi8(x, w[k]),
                    );
                    dx[k] = *ds.add(r * nb + g * GROUP + k);
                }
            }
            let mut isum = [0i32; GROUP];
            // SAFETY: 8 i32 into [i32; 8].
            unsafe { _mm256_storeu_si256(isum.as_mut_ptr().cast(), hsum_8x8(&v)) };
            combine::combine_group(acc, &dw, &dx, &isum);
        }
    }
    for t in 0..tn {
        res[t] = combine::reduce8(&acc[t]);
    }
}

#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn row_q4k(
    _: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    let mut acc = [_mm256_setzero_ps(); TILE];
    let mut q = A32([0u8; QK_K]);
    let (qs, bsums, ds) = (act.qs.as_ptr(), act.bsums.as_ptr(), act.d.as_ptr());
    let (cols, nb) = (act.cols, act.nb);
    for (sb, b) in cast::<BlockQ4K>(wrow).iter().enumerate() {
        unpack_q4k_values(b, &mut q);
        // SAFETY: 4 aligned 64-byte loads from the 256-byte, 64-aligned buffer.
        let wv: [__m512i; 4] =
            std::array::from_fn(|k| unsafe { _mm512_load_si512(q.0.as_ptr().add(64 * k).cast()) });
        let (sc, mn) = q4k_scales_mins(&b.scales);
        let scv: [__m512i; 4] = std::array::from_fn(|k| {
            join(
                _mm256_set1_epi16(sc[2 * k] as i16),
                _mm256_set1_epi16(sc[2 * k + 1] as i16),
            )
        });
        let mnv = q4k_mins16(mn);
        let (d, dmin) = (f16_le(b.d), f16_le(b.dmin));
        for (t, acc) in acc.iter_mut().enumerate().take(tn) {
            let r = t0 + t;
            // SAFETY: row r < m, super-block sb < nb: reads inside the activation buffers.
            unsafe {
                let xq = qs.add(r * cols + sb * QK_K);
                let mut s = _mm512_setzero_si512();
                for k in 0..4 {
                    let x = _mm512_loadu_si512(xq.add(64 * k).cast());
                    s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(wv[k], x), scv[k]);
                }
                let bsv = _mm256_loadu_si256(bsums.add((r * nb + sb) * 16).cast());
                let mm = _mm256_madd_epi16(bsv, mnv);
                let dx = *ds.add(r * nb + sb);
                *acc = q4k_float(*acc, d * dx, dmin * dx, fold(s), mm);
            }
        }
    }
    for t in 0..tn {
        res[t] = reduce8(acc[t]);
    }
}

#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn row_q6k(
    _: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    let mut acc = [_mm256_setzero_ps(); TILE];
    let mut q = A32([0u8; QK_K]);
    let (qs, bsums, ds) = (act.qs.as_ptr(), act.bsums.as_ptr(), act.d.as_ptr());
    let (cols, nb) = (act.cols, act.nb);
    for (sb, b) in cast::<BlockQ6K>(wrow).iter().enumerate() {
        unpack_q6k_values(b, &mut q);
        // SAFETY: 4 aligned 64-byte loads from the 256-byte, 64-aligned buffer.
        let wv: [__m512i; 4] =
            std::array::from_fn(|k| unsafe { _mm512_load_si512(q.0.as_ptr().add(64 * k).cast()) });
        let (scv8, sc16) = q6k_scale_vectors(&b.scales);
        let scv: [__m512i; 4] = std::array::from_fn(|k| join(scv8[2 * k], scv8[2 * k + 1]));
        let d = f16_le(b.d);
        for (t, acc) in acc.iter_mut().enumerate().take(tn) {
            let r = t0 + t;
            // SAFETY: as in `row_q4k`.
            unsafe {
                let xq = qs.add(r * cols + sb * QK_K);
                let mut s = _mm512_setzero_si512();
                for k in 0..4 {
                    let x = _mm512_loadu_si512(xq.add(64 * k).cast());
                    s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(wv[k], x), scv[k]);
                }
                let bsv = _mm256_loadu_si256(bsums.add((r * nb + sb) * 16).cast());
                let corr = _mm256_madd_epi16(bsv, sc16);
                let s = _mm256_sub_epi32(fold(s), _mm256_slli_epi32::<5>(corr));
                let dx = *ds.add(r * nb + sb);
                *acc = q6k_float(*acc, d * dx, s);
            }
        }
    }
    for t in 0..tn {
        res[t] = reduce8(acc[t]);
    }
}
