//! AVX-512 (F/BW/VL) + VNNI kernels (x86-64, detected at run time).
//!
//! Same integer sums and the same float steps as the AVX2 and scalar paths
//! (see `combine`). Weights are unpacked in registers only (a
//! broadcast load and a per-half variable shift put the low and high nibbles of
//! 32 bytes side by side in element order; no store and reload, which would
//! stall store forwarding), and up to [`MAX_R`] activation rows are processed
//! per pass with their accumulators in registers; longer tiles take several
//! passes over the weight row, which is then in L1.
//!
//! - Q4_K/Q6_K: 64 weights per vector, `maddubs` + `vpdpwssd` with the
//!   sub-block scales; per super-block the i32 lanes of all rows of the pass
//!   are reduced at once (a `hadd` tree: lane r = row r's exact sum), then
//!   the shared float step (`combine::q4k_step` / `q6k_step`) runs for the
//!   rows as the lanes of one vector.
//! - Q4_0/Q5_0/Q8_0 (and Q4_1/Q5_1): whole blocks, in
//!   `x86_avx512_formats`.

use std::arch::x86_64::*;

use super::act::Act;
use super::blocks::{cast, f16_le, q4k_scales_mins, BlockQ3K, BlockQ6K, QK_K};
use super::combine;
use super::common::prefetch_ahead;
use super::types::{QuantFormat, RowFn, TILE};
use super::x86_avx2::{hsum2, k36_head, k36_scales, k45, q4k_mins16};

/// Activation rows per pass over a weight row.
const MAX_R: usize = 8;

pub(super) fn row_fn(f: QuantFormat) -> Option<RowFn> {
    match f {
        QuantFormat::Q4_0
        | QuantFormat::Q5_0
        | QuantFormat::Q8_0
        | QuantFormat::Q4_1
        | QuantFormat::Q5_1 => Some(super::x86_avx512_formats::row_block),
        QuantFormat::Q4K => Some(row_q4k),
        QuantFormat::Q5K => Some(row_q5k),
        QuantFormat::Q6K => Some(row_q6k),
        QuantFormat::Q3K => Some(row_q3k),
        QuantFormat::F16 | QuantFormat::BF16 => Some(super::x86_avx512_formats::row_half),
        // The AVX2 kernel (no AVX-512 one: repacking is only chosen on AVX2).
        QuantFormat::Q5_0x4 => None,
        QuantFormat::F32 => None,
    }
}

/// Lanes 0..8 + lanes 8..16 (exact integer fold to the shared 8-lane layout).
#[inline]
#[target_feature(enable = "avx512f")]
fn fold(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// 32 i16 lanes: `a` in the low 16, `b` in the high 16.
#[inline]
#[target_feature(enable = "avx512f")]
fn halves16(a: i16, b: i16) -> __m512i {
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_set1_epi16(a)),
        _mm256_set1_epi16(b),
    )
}

/// 32 i16 lanes: lane i = `base + i / per`.
#[inline]
#[target_feature(enable = "avx512f")]
fn index16(base: i16, per: usize) -> __m512i {
    let mut a = [0i16; 32];
    for (i, v) in a.iter_mut().enumerate() {
        *v = base + (i / per) as i16;
    }
    // SAFETY: 64 bytes from a [i16; 32].
    unsafe { _mm512_loadu_si512(a.as_ptr().cast()) }
}

/// 32 bytes at `p`, in both halves of a 512-bit vector.
///
/// # Safety
/// 32 readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn broadcast32(p: *const u8) -> __m512i {
    // SAFETY: caller.
    _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(p.cast()) })
}

#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn row_q4k(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    passes!(MAX_R, q4k_rows, format, wrow, act, t0, tn, res; 1 2 3 4 5 6 7; 8)
}

#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn row_q5k(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    passes!(MAX_R, q5k_rows, format, wrow, act, t0, tn, res; 1 2 3 4 5 6 7; 8)
}

#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn row_q3k(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    passes!(MAX_R, q3k_rows, format, wrow, act, t0, tn, res; 1 2 3 4 5 6 7; 8)
}

#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn row_q6k(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    passes!(MAX_R, q6k_rows, format, wrow, act, t0, tn, res; 1 2 3 4 5 6 7; 8)
}

/// Lane r = Σ of the 8 i32 lanes of `v[r]`, for r < `R` ≤ 8 (exact; lanes
/// from `R` on are unspecified).
#[inline]
#[target_feature(enable = "avx2")]
fn hsum_rows<const R: usize>(v: &[__m256i; R]) -> __m256i {
    let z = _mm256_setzero_si256();
    let g = |i: usize| if i < R { v[i] } else { z };
    let a = _mm256_hadd_epi32(_mm256_hadd_epi32(g(0), g(1)), _mm256_hadd_epi32(g(2), g(3)));
    if R <= 4 {
        // [v0..v3 low-half sums | v0..v3 high-half sums]
        let s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256::<1>(a));
        return _mm256_zextsi128_si256(s);
    }
    let b = _mm256_hadd_epi32(_mm256_hadd_epi32(g(4), g(5)), _mm256_hadd_epi32(g(6), g(7)));
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(a, b),
        _mm256_permute2x128_si256::<0x31>(a, b),
    )
}

/// The activation scales of rows `t0..t0 + R` for super-block `sb`
/// (zeros beyond `R`).
///
/// # Safety
/// Rows `t0..t0 + R` and super-block `sb` exist in `act` (Q8_K).
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512vl")]
unsafe fn row_scales<const R: usize>(act: &Act, t0: usize, sb: usize) -> __m256 {
    // SAFETY: `dt` holds m floats per super-block; the mask reads rows t0..t0+R only.
    unsafe { _mm256_maskz_loadu_ps(u8::MAX >> (8 - R), act.dt.as_ptr().add(sb * act.m + t0)) }
}

/// Store the first `R` lanes of `acc` into `res`.
#[inline]
#[target_feature(enable = "avx2")]
fn store_rows<const R: usize>(acc: __m256, res: &mut [f32]) {
    let mut a = [0f32; 8];
    // SAFETY: 8 f32 into [f32; 8].
    unsafe { _mm256_storeu_ps(a.as_mut_ptr(), acc) };
    res[..R].copy_from_slice(&a[..R]);
}

/// Q4_K weight row × activation rows `t0..t0 + R` (Q8_K): per super-block
/// the exact pair (S, M) of every row, reduced across the rows at once, then
/// [`super::combine::q4k_step`] vectorized over the rows.
///
/// # Safety
/// As [`group_rows`] (Q8_K activations).
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4k_rows<const R: usize>(
    f: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    // SAFETY: the caller's contract.
    unsafe { k45_rows::<R, false>(f, wrow, act, t0, res) }
}

/// [`q4k_rows`] for Q5_K weights (the fifth bits added with a byte mask).
///
/// # Safety
/// As [`q4k_rows`].
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q5k_rows<const R: usize>(
    f: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    // SAFETY: the caller's contract.
    unsafe { k45_rows::<R, true>(f, wrow, act, t0, res) }
}

/// 64 bytes: `a` in the low 32, `b` in the high 32.
#[inline]
#[target_feature(enable = "avx512f")]
fn halves8(a: u8, b: u8) -> __m512i {
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_set1_epi8(a as i8)),
        _mm256_set1_epi8(b as i8),
    )
}

/// [`q4k_rows`] (`FIVE`: Q5_K, else Q4_K).
///
/// # Safety
/// As [`q4k_rows`].
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k45_rows<const R: usize, const FIVE: bool>(
    _: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    let mut acc = _mm256_setzero_ps();
    let mut acc1 = 0f32;
    let (qs, bsums, ds) = (act.qs.as_ptr(), act.bsums.as_ptr(), act.d.as_ptr());
    let (cols, nb) = (act.cols, act.nb);
    let sh = halves16(0, 4);
    let lo4 = _mm512_set1_epi8(0xF);
    let idx: [__m512i; 4] = std::array::from_fn(|k| index16(2 * k as i16, 16));
    // Q5_K: vector c takes bit 2c of qh (low half) and 2c + 1 (high half).
    let sel: [__m512i; 4] = std::array::from_fn(|c| halves8(1 << (2 * c), 1 << (2 * c + 1)));
    let b16 = _mm512_set1_epi8(16);
    for sb in 0..nb {
        let b = k45::<FIVE>(wrow, sb);
        prefetch_ahead::<3>(b.qs.as_ptr());
        // Vector c: elements 64c..64c+64 (sub-blocks 2c and 2c+1).
        let wv: [__m512i; 4] = std::array::from_fn(|c| {
            // SAFETY: 32 bytes at 32c inside the 128-byte `qs`.
            let z = unsafe { broadcast32(b.qs.as_ptr().add(32 * c)) };
            let v = _mm512_and_si512(_mm512_srlv_epi16(z, sh), lo4);
            match b.qh {
                None => v,
                Some(qh) => {
                    // SAFETY: the 32 bytes of qh.
                    let h = unsafe { broadcast32(qh.as_ptr()) };
                    _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(h, sel[c]), v, b16)
                }
            }
        });
        let (sc, mn) = q4k_scales_mins(b.scales);
        // SAFETY: 8 bytes from a [u8; 8].
        let sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(unsafe {
            _mm_loadl_epi64(sc.as_ptr().cast())
        }));
        let scv: [__m512i; 4] = std::array::from_fn(|k| _mm512_permutexvar_epi16(idx[k], sc16));
        let mnv = q4k_mins16(mn);
        let (d, dmin) = (f16_le(b.d), f16_le(b.dmin));
        let mut sv = [_mm256_setzero_si256(); R];
        let mut mv = [_mm256_setzero_si256(); R];
        for r in 0..R {
            let row = t0 + r;
            // SAFETY: row < m, super-block sb < nb: reads inside the activation buffers.
            unsafe {
                let xq = qs.add(row * cols + sb * QK_K);
                let mut s = _mm512_setzero_si512();
                for k in 0..4 {
                    let x = _mm512_loadu_si512(xq.add(64 * k).cast());
                    s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(wv[k], x), scv[k]);
                }
                let bsv = _mm256_loadu_si256(bsums.add((row * nb + sb) * 16).cast());
                sv[r] = fold(s);
                mv[r] = _mm256_madd_epi16(bsv, mnv);
            }
        }
        if R == 1 {
            let (s, mm) = hsum2(sv[0], mv[0]);
            // SAFETY: row t0 < m, sb < nb.
            let dx = unsafe { *ds.add(t0 * nb + sb) };
            acc1 = combine::q4k_step(acc1, d * dx, dmin * dx, s, mm);
        } else {
            let (s, mm) = (hsum_rows(&sv), hsum_rows(&mv));
            // SAFETY: the caller's contract.
            let dx = unsafe { row_scales::<R>(act, t0, sb) };
            let dd = _mm256_mul_ps(_mm256_set1_ps(d), dx);
            let dm = _mm256_mul_ps(_mm256_set1_ps(dmin), dx);
            let p = _mm256_sub_ps(
                _mm256_mul_ps(dd, _mm256_cvtepi32_ps(s)),
                _mm256_mul_ps(dm, _mm256_cvtepi32_ps(mm)),
            );
            acc = _mm256_add_ps(acc, p);
        }
    }
    if R == 1 {
        res[0] = acc1;
    } else {
        store_rows::<R>(acc, res);
    }
}

/// Q6_K weight row × activation rows `t0..t0 + R` (Q8_K), as [`q4k_rows`]
/// with [`super::combine::q6k_step`].
///
/// # Safety
/// As [`q4k_rows`].
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6k_rows<const R: usize>(
    f: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    // SAFETY: the caller's contract.
    unsafe { k36_rows::<R, false>(f, wrow, act, t0, res) }
}

/// [`q6k_rows`] for Q3_K weights: values `q + 4` in 0..8, offset
/// `4 · Σ_g sc_g · bsum_g`.
///
/// # Safety
/// As [`q4k_rows`].
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q3k_rows<const R: usize>(
    f: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    // SAFETY: the caller's contract.
    unsafe { k36_rows::<R, true>(f, wrow, act, t0, res) }
}

/// The 4 vectors of a Q3_K super-block (elements 64k..64k+64) as `q + 4`:
/// vector k is chunks (h, j) = (k / 2, 2(k % 2)) and (k / 2, 2(k % 2) + 1)
/// of [`BlockQ3K`]: bits 2j..2j+2 of qs[32h..], plus 4 where bit 4h + j of
/// hmask is set.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw")]
fn q3k_vectors(b: &BlockQ3K) -> [__m512i; 4] {
    let m3 = _mm512_set1_epi8(3);
    let four = _mm512_set1_epi8(4);
    // SAFETY: the 32-byte hmask.
    let hm = unsafe { broadcast32(b.hmask.as_ptr()) };
    std::array::from_fn(|k| {
        let (h, j) = (k / 2, 2 * (k % 2));
        // SAFETY: 32 bytes at 32h (h < 2) inside the 64-byte `qs`.
        let z = unsafe { broadcast32(b.qs.as_ptr().add(32 * h)) };
        let sh = halves16(2 * j as i16, 2 * j as i16 + 2);
        let v = _mm512_and_si512(_mm512_srlv_epi16(z, sh), m3);
        let sel = halves8(1 << (4 * h + j), 1 << (4 * h + j + 1));
        _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(hm, sel), v, four)
    })
}

/// [`q6k_rows`] (`THREE`: Q3_K, else Q6_K).
///
/// # Safety
/// As [`q4k_rows`].
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k36_rows<const R: usize, const THREE: bool>(
    _: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    let mut acc = _mm256_setzero_ps();
    let mut acc1 = 0f32;
    // R == 1: the exact sums of an unstepped super-block and its `d·dx`.
    let mut pending: Option<(__m256i, f32)> = None;
    let (qs, bsums, ds) = (act.qs.as_ptr(), act.bsums.as_ptr(), act.d.as_ptr());
    let (cols, nb) = (act.cols, act.nb);
    let lo4 = _mm512_set1_epi8(0xF);
    let m30 = _mm512_set1_epi8(0x30);
    // High bits to bit 4..6: element groups 0, 1, 2, 3 of a 128-element half
    // take qh bits 0-1 (<< 4), 2-3 (<< 2), 4-5 (as is), 6-7 (>> 2).
    let shl = halves16(4, 2);
    let shr = halves16(0, 2);
    let idx: [__m512i; 4] = std::array::from_fn(|k| index16(4 * k as i16, 8));
    for sb in 0..nb {
        let (d, pf) = k36_head::<THREE>(wrow, sb);
        prefetch_ahead::<4>(pf);
        let wv = if THREE {
            q3k_vectors(&cast::<BlockQ3K>(wrow)[sb])
        } else {
            let b = &cast::<BlockQ6K>(wrow)[sb];
            let mut wv = [_mm512_setzero_si512(); 4];
            for h in 0..2 {
                // SAFETY: 64 bytes at 64h inside the 128-byte `ql`; 32 bytes at
                // 32h inside the 64-byte `qh`.
                let (l, q) = unsafe {
                    (
                        _mm512_loadu_si512(b.ql.as_ptr().add(64 * h).cast()),
                        broadcast32(b.qh.as_ptr().add(32 * h)),
                    )
                };
                wv[2 * h] = _mm512_or_si512(
                    _mm512_and_si512(l, lo4),
                    _mm512_and_si512(_mm512_sllv_epi16(q, shl), m30),
                );
                wv[2 * h + 1] = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(l), lo4),
                    _mm512_and_si512(_mm512_srlv_epi16(q, shr), m30),
                );
            }
            wv
        };
        let sc16 = _mm256_cvtepi8_epi16(k36_scales::<THREE>(wrow, sb));
        let scz = _mm512_castsi256_si512(sc16);
        let scv: [__m512i; 4] = std::array::from_fn(|k| _mm512_permutexvar_epi16(idx[k], scz));
        let d = f16_le(d);
        let mut sv = [_mm256_setzero_si256(); R];
        for r in 0..R {
            let row = t0 + r;
            // SAFETY: as in `q4k_rows`.
            unsafe {
                let xq = qs.add(row * cols + sb * QK_K);
                let mut s = _mm512_setzero_si512();
                for k in 0..4 {
                    let x = _mm512_loadu_si512(xq.add(64 * k).cast());
                    s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(wv[k], x), scv[k]);
                }
                let bsv = _mm256_loadu_si256(bsums.add((row * nb + sb) * 16).cast());
                let corr = _mm256_madd_epi16(bsv, sc16);
                // Q3_K: − 4·corr (values q + 4); Q6_K: − 32·corr (q in 0..64).
                let corr = if THREE {
                    _mm256_slli_epi32::<2>(corr)
                } else {
                    _mm256_slli_epi32::<5>(corr)
                };
                sv[r] = _mm256_sub_epi32(fold(s), corr);
            }
        }
        if R == 1 {
            // SAFETY: row t0 < m, sb < nb.
            let dd = d * unsafe { *ds.add(t0 * nb + sb) };
            // Super-blocks in pairs: one horizontal sum for both exact
            // sums, then the two float steps in super-block order.
            match pending.take() {
                None if sb + 1 < nb => pending = Some((sv[0], dd)),
                None => acc1 = combine::q6k_step(acc1, dd, hsum2(sv[0], sv[0]).0),
                Some((prev, prev_dd)) => {
                    let (s_prev, s) = hsum2(prev, sv[0]);
                    acc1 = combine::q6k_step(acc1, prev_dd, s_prev);
                    acc1 = combine::q6k_step(acc1, dd, s);
                }
            }
        } else {
            let s = hsum_rows(&sv);
            // SAFETY: the caller's contract.
            let dx = unsafe { row_scales::<R>(act, t0, sb) };
            let dd = _mm256_mul_ps(_mm256_set1_ps(d), dx);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(s)));
        }
    }
    if R == 1 {
        res[0] = acc1;
    } else {
        store_rows::<R>(acc, res);
    }
}
