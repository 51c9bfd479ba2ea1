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
use super::blocks::{cast, f16_le, q4k_scales_mins, BlockQ4K, BlockQ6K, QK_K};
use super::combine::GROUP;
use super::x86_avx2::{
    q4k_float, q4k_mins16, q6k_float, q6k_scale_vectors, reduce8, unpack_block, unpack_q4k_values,
    unpack_q6k_values, A32,
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

/// 8×8 transpose of 32-bit lanes: `c[k]` lane b = `r[b]` lane k.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose8(r: &[__m256i; 8]) -> [__m256i; 8] {
    let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
    let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
    let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    let t4 = _mm256_unpacklo_epi32(r[4], r[5]);
    let t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    let t6 = _mm256_unpacklo_epi32(r[6], r[7]);
    let t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    let u0 = _mm256_unpacklo_epi64(t0, t2);
    let u1 = _mm256_unpackhi_epi64(t0, t2);
    let u2 = _mm256_unpacklo_epi64(t1, t3);
    let u3 = _mm256_unpackhi_epi64(t1, t3);
    let u4 = _mm256_unpacklo_epi64(t4, t6);
    let u5 = _mm256_unpackhi_epi64(t4, t6);
    let u6 = _mm256_unpacklo_epi64(t5, t7);
    let u7 = _mm256_unpackhi_epi64(t5, t7);
    [
        _mm256_permute2x128_si256::<0x20>(u0, u4),
        _mm256_permute2x128_si256::<0x20>(u1, u5),
        _mm256_permute2x128_si256::<0x20>(u2, u6),
        _mm256_permute2x128_si256::<0x20>(u3, u7),
        _mm256_permute2x128_si256::<0x31>(u0, u4),
        _mm256_permute2x128_si256::<0x31>(u1, u5),
        _mm256_permute2x128_si256::<0x31>(u2, u6),
        _mm256_permute2x128_si256::<0x31>(u3, u7),
    ]
}

/// Q4_0/Q5_0/Q8_0 row against the interleaved activations (`Act::interleave`):
/// the 8 blocks of a group are unpacked, offset to unsigned (`w + 128`) and
/// transposed so that 32-bit lane b of every chunk belongs to block b; then
/// `vpdpbusd` over the 8 chunks yields all 8 block sums at once, and
/// `isum_b = Σ (w+128)·x − 128 Σ x` (exact).
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
    let ng = act.ng;
    let mut acc = [_mm256_setzero_ps(); TILE];
    let (qsi, xsum, dpad) = (act.qsi.as_ptr(), act.xsum.as_ptr(), act.dpad.as_ptr());
    let bias = _mm256_set1_epi8(-128);
    for g in 0..ng {
        let nbg = GROUP.min(nb - g * GROUP);
        let mut w = [bias; GROUP];
        let mut dw = [0f32; GROUP];
        for k in 0..nbg {
            let (v, d) = unpack_block(format, wrow, g * GROUP + k);
            w[k] = _mm256_xor_si256(v, bias);
            dw[k] = d;
        }
        let c = transpose8(&w);
        let wz: [__m512i; 4] = std::array::from_fn(|k| join(c[2 * k], c[2 * k + 1]));
        // SAFETY: 8 f32 from an [f32; 8].
        let dwv = unsafe { _mm256_loadu_ps(dw.as_ptr()) };
        for (t, acc) in acc.iter_mut().enumerate().take(tn) {
            let r = t0 + t;
            // SAFETY: row r < m, group g < ng: inside qsi (m·ng·256), xsum and
            // dpad (m·ng·8).
            unsafe {
                let xq = qsi.add((r * ng + g) * 256);
                let mut s = _mm512_setzero_si512();
                for (k, wz) in wz.iter().enumerate() {
                    s = _mm512_dpbusd_epi32(s, *wz, _mm512_loadu_si512(xq.add(64 * k).cast()));
                }
                let xs = _mm256_loadu_si256(xsum.add((r * ng + g) * 8).cast());
                let isum = _mm256_sub_epi32(fold(s), _mm256_slli_epi32::<7>(xs));
                let dx = _mm256_loadu_ps(dpad.add((r * ng + g) * 8));
                // combine::combine_group, lane-wise: acc += (dw·dx)·isum
                let p = _mm256_mul_ps(_mm256_mul_ps(dwv, dx), _mm256_cvtepi32_ps(isum));
                *acc = _mm256_add_ps(*acc, p);
            }
        }
    }
    for t in 0..tn {
        res[t] = reduce8(acc[t]);
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
