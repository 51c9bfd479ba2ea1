//! AVX2 kernels (x86-64, detected at run time).
//!
//! Only the integer block sums are computed with SIMD; they are exact, so
//! their summation order is free. The float combination calls the same
//! `combine` functions as the scalar reference, which keeps results bit-identical.
//! `_mm256_maddubs_epi16` saturates at ±32767: every use below multiplies an
//! unsigned weight ≤ 128 (|Q8_0| incl. -128, Q4 ≤ 15, Q6 ≤ 63) by an activation
//! in [-127, 127], so a pair sums to at most 2 · 128 · 127 = 32512.

use std::arch::x86_64::*;

use super::act::Act;
use super::blocks::{
    cast, f16_le, q4k_scales_mins, BlockQ4K, BlockQ4_0, BlockQ5_0, BlockQ6K, BlockQ8_0, QK, QK_K,
};
use super::combine::{self, GROUP_SETS};
use super::{prefetch_ahead, QuantFormat, RowFn, TILE};

pub(super) fn row_fn(f: QuantFormat) -> Option<RowFn> {
    match f {
        QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q8_0 => Some(row_group),
        QuantFormat::Q4K => Some(row_q4k),
        QuantFormat::Q6K => Some(row_q6k),
        QuantFormat::F32 | QuantFormat::F16 => None,
    }
}

#[repr(C, align(64))]
pub(super) struct A32<const N: usize>(pub [u8; N]);

/// Expand 32 bits to 32 bytes: 0xFF where the bit is set.
#[inline]
#[target_feature(enable = "avx2")]
fn bytes_from_bits_32(bits: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0x0000000000000000,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// Unpack one Q4_0/Q5_0/Q8_0 block to 32 signed bytes.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn unpack_block(format: QuantFormat, wrow: &[u8], b: usize) -> (__m256i, f32) {
    let lo4 = _mm256_set1_epi8(0xF);
    match format {
        QuantFormat::Q4_0 => {
            let blk = &cast::<BlockQ4_0>(wrow)[b];
            // SAFETY: 16 bytes read from a 16-byte array.
            let q = unsafe { _mm_loadu_si128(blk.qs.as_ptr().cast()) };
            let v = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
            let v = _mm256_sub_epi8(_mm256_and_si256(v, lo4), _mm256_set1_epi8(8));
            (v, f16_le(blk.d))
        }
        QuantFormat::Q5_0 => {
            let blk = &cast::<BlockQ5_0>(wrow)[b];
            // SAFETY: 16 bytes read from a 16-byte array.
            let q = unsafe { _mm_loadu_si128(blk.qs.as_ptr().cast()) };
            let v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(q), q), lo4);
            let hb = _mm256_and_si256(
                bytes_from_bits_32(u32::from_le_bytes(blk.qh)),
                _mm256_set1_epi8(0x10),
            );
            let v = _mm256_sub_epi8(_mm256_or_si256(v, hb), _mm256_set1_epi8(16));
            (v, f16_le(blk.d))
        }
        QuantFormat::Q8_0 => {
            let blk = &cast::<BlockQ8_0>(wrow)[b];
            // SAFETY: 32 bytes read from a 32-byte array.
            let v = unsafe { _mm256_loadu_si256(blk.qs.as_ptr().cast()) };
            (v, f16_le(blk.d))
        }
        _ => unreachable!(),
    }
}

/// Q4_0/Q5_0/Q8_0 row (lane-wise, see [`combine::group_block`]): each block is
/// unpacked once (signed values and their magnitudes) and used for every
/// activation row of the tile; `maddubs(|w|, sign(x, w))` then `madd` with ones
/// gives the 8 exact sums of 4 products.
#[target_feature(enable = "avx2,f16c")]
unsafe fn row_group(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    let (nb, cols) = (act.nb, act.cols);
    let mut acc = [[_mm256_setzero_ps(); GROUP_SETS]; TILE];
    let ones = _mm256_set1_epi16(1);
    let (qs, ds) = (act.qs.as_ptr(), act.d.as_ptr());
    let bsz = format.block_bytes();
    for b in 0..nb {
        prefetch_ahead::<1>(wrow.as_ptr().wrapping_add(b * bsz));
        let (v, dw) = unpack_block(format, wrow, b);
        let av = _mm256_abs_epi8(v);
        for (t, acc) in acc.iter_mut().enumerate().take(tn) {
            let r = t0 + t;
            // SAFETY: row r < m and block b < nb: reads inside qs (m·cols) and d (m·nb).
            unsafe {
                let x = _mm256_loadu_si256(qs.add(r * cols + b * QK).cast());
                let s = _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(x, v)), ones);
                let dwdx = _mm256_set1_ps(dw * *ds.add(r * nb + b));
                let a = &mut acc[b % GROUP_SETS];
                *a = _mm256_add_ps(*a, _mm256_mul_ps(dwdx, _mm256_cvtepi32_ps(s)));
            }
        }
    }
    for t in 0..tn {
        res[t] = reduce_group(&acc[t]);
    }
}

/// [`combine::reduce_group`] of four 8-lane accumulator sets.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn reduce_group(a: &[__m256; GROUP_SETS]) -> f32 {
    reduce8(_mm256_add_ps(
        _mm256_add_ps(a[0], a[2]),
        _mm256_add_ps(a[1], a[3]),
    ))
}

/// Unpack a Q4_K super-block's 256 nibbles into bytes (element order).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn unpack_q4k_values(b: &BlockQ4K, q: &mut A32<QK_K>) {
    let lo4 = _mm256_set1_epi8(0xF);
    for c in 0..4 {
        // SAFETY: 32 bytes at 32c within the 128-byte `qs`; stores within 256 bytes.
        unsafe {
            let v = _mm256_loadu_si256(b.qs.as_ptr().add(32 * c).cast());
            _mm256_store_si256(
                q.0.as_mut_ptr().add(64 * c).cast(),
                _mm256_and_si256(v, lo4),
            );
            _mm256_store_si256(
                q.0.as_mut_ptr().add(64 * c + 32).cast(),
                _mm256_and_si256(_mm256_srli_epi16::<4>(v), lo4),
            );
        }
    }
}

/// `(Σ a, Σ b)` over the 8 i32 lanes of each (exact; order free).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn hsum2(a: __m256i, b: __m256i) -> (i32, i32) {
    // [a01, a23, b01, b23 | a45, a67, b45, b67]
    let h = _mm256_hadd_epi32(a, b);
    let x = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
    // [Σa, Σb, Σa, Σb]
    let y = _mm_hadd_epi32(x, x);
    (_mm_cvtsi128_si32(y), _mm_extract_epi32::<1>(y))
}

/// Fixed-order sum of the 8 lanes ([`combine::reduce8`]).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn reduce8(v: __m256) -> f32 {
    let mut a = [0f32; 8];
    // SAFETY: 8 f32 into [f32; 8].
    unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
    combine::reduce8(&a)
}

/// The Q4_K mins duplicated per 16-element half: `[m0, m0, m1, m1, …]` as i16.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q4k_mins16(mn: [u8; 8]) -> __m256i {
    // SAFETY: 8 bytes from a [u8; 8].
    let m = unsafe { _mm_loadl_epi64(mn.as_ptr().cast()) };
    _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m))
}

/// Q4_K row × Q8_K activation rows ([`combine::q4k_step`] per super-block).
#[target_feature(enable = "avx2,f16c")]
unsafe fn row_q4k(
    _: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    let mut acc = [0f32; TILE];
    let mut q = A32([0u8; QK_K]);
    let (qs, bsums, ds) = (act.qs.as_ptr(), act.bsums.as_ptr(), act.d.as_ptr());
    let (cols, nb) = (act.cols, act.nb);
    for (sb, b) in cast::<BlockQ4K>(wrow).iter().enumerate() {
        prefetch_ahead::<3>(b.qs.as_ptr());
        unpack_q4k_values(b, &mut q);
        let (sc, mn) = q4k_scales_mins(&b.scales);
        let scv: [__m256i; 8] = std::array::from_fn(|j| _mm256_set1_epi16(sc[j] as i16));
        let mnv = q4k_mins16(mn);
        let (d, dmin) = (f16_le(b.d), f16_le(b.dmin));
        for (t, acc) in acc.iter_mut().enumerate().take(tn) {
            let r = t0 + t;
            // SAFETY: row r < m, super-block sb < nb: all reads are inside the
            // activation buffers (qs: m·cols, bsums: m·cols/16, d: m·nb).
            unsafe {
                let xq = qs.add(r * cols + sb * QK_K);
                let mut s = _mm256_setzero_si256();
                for (j, scv) in scv.iter().enumerate() {
                    let x = _mm256_loadu_si256(xq.add(32 * j).cast());
                    let w = _mm256_load_si256(q.0.as_ptr().add(32 * j).cast());
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), *scv));
                }
                let bsv = _mm256_loadu_si256(bsums.add((r * nb + sb) * 16).cast());
                let (s, mm) = hsum2(s, _mm256_madd_epi16(bsv, mnv));
                let dx = *ds.add(r * nb + sb);
                *acc = combine::q4k_step(*acc, d * dx, dmin * dx, s, mm);
            }
        }
    }
    res[..tn].copy_from_slice(&acc[..tn]);
}

/// Unpack a Q6_K super-block's 6-bit values (0..64) into bytes (element order).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn unpack_q6k_values(b: &BlockQ6K, q: &mut A32<QK_K>) {
    let lo4 = _mm256_set1_epi8(0xF);
    let m2 = _mm256_set1_epi8(0x03);
    let m30 = _mm256_set1_epi8(0x30);
    for h in 0..2 {
        // SAFETY: reads within ql (128 B) and qh (64 B); stores within 256 bytes.
        unsafe {
            let ql0 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * h).cast());
            let ql1 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * h + 32).cast());
            let qh = _mm256_loadu_si256(b.qh.as_ptr().add(32 * h).cast());
            let e0 = _mm256_or_si256(
                _mm256_and_si256(ql0, lo4),
                _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m2)),
            );
            let e1 = _mm256_or_si256(
                _mm256_and_si256(ql1, lo4),
                _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m30),
            );
            let e2 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), lo4),
                _mm256_and_si256(qh, m30),
            );
            let e3 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), lo4),
                _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m30),
            );
            let o = q.0.as_mut_ptr().add(128 * h);
            _mm256_store_si256(o.cast(), e0);
            _mm256_store_si256(o.add(32).cast(), e1);
            _mm256_store_si256(o.add(64).cast(), e2);
            _mm256_store_si256(o.add(96).cast(), e3);
        }
    }
}

/// The Q6_K scales of chunk c (32 elements): `[sc_2c ×8, sc_2c+1 ×8]` as i16.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q6k_scale_vectors(sc: &[i8; 16]) -> ([__m256i; 8], __m256i) {
    let scv = std::array::from_fn(|c| {
        _mm256_set_m128i(
            _mm_set1_epi16(sc[2 * c + 1] as i16),
            _mm_set1_epi16(sc[2 * c] as i16),
        )
    });
    // SAFETY: 16 bytes from a [i8; 16].
    let sc16 = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(sc.as_ptr().cast()) });
    (scv, sc16)
}

/// Q6_K row × Q8_K activation rows ([`combine::q6k_step`] per super-block).
#[target_feature(enable = "avx2,f16c")]
unsafe fn row_q6k(
    _: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    let mut acc = [0f32; TILE];
    let mut q = A32([0u8; QK_K]);
    let (qs, bsums, ds) = (act.qs.as_ptr(), act.bsums.as_ptr(), act.d.as_ptr());
    let (cols, nb) = (act.cols, act.nb);
    for (sb, b) in cast::<BlockQ6K>(wrow).iter().enumerate() {
        prefetch_ahead::<4>(b.ql.as_ptr());
        unpack_q6k_values(b, &mut q);
        let (scv, sc16) = q6k_scale_vectors(&b.scales);
        let d = f16_le(b.d);
        for (t, acc) in acc.iter_mut().enumerate().take(tn) {
            let r = t0 + t;
            // SAFETY: as in `row_q4k`.
            unsafe {
                let xq = qs.add(r * cols + sb * QK_K);
                let mut s = _mm256_setzero_si256();
                for (c, scv) in scv.iter().enumerate() {
                    let x = _mm256_loadu_si256(xq.add(32 * c).cast());
                    let w = _mm256_load_si256(q.0.as_ptr().add(32 * c).cast());
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), *scv));
                }
                let bsv = _mm256_loadu_si256(bsums.add((r * nb + sb) * 16).cast());
                let corr = _mm256_madd_epi16(bsv, sc16);
                let s = _mm256_sub_epi32(s, _mm256_slli_epi32::<5>(corr));
                let (s, _) = hsum2(s, s);
                let dx = *ds.add(r * nb + sb);
                *acc = combine::q6k_step(*acc, d * dx, s);
            }
        }
    }
    res[..tn].copy_from_slice(&acc[..tn]);
}
