//! AVX2 kernels (x86-64, detected at run time; the path of CPUs without
//! AVX-512, e.g. AMD Zen 3).
//!
//! Only the integer block sums are computed with SIMD; they are exact, so
//! their summation order is free. The float combination does the same IEEE
//! operations as the `combine` functions of the scalar reference, in the same
//! order (lane-wise over rows where it is vectorized), which keeps results
//! bit-identical.
//!
//! The whole-block formats (Q4_0/Q5_0/Q5_0x4/Q8_0, Q4_1/Q5_1) are in
//! `x86_avx2_formats`: passes of up to its `MAX_R_GROUP` rows with register
//! accumulators. Two shapes per K-quant format, chosen by the number of
//! activation rows `tn` of the tile (results are identical either way):
//! - short tiles (decode, and the draft's 2–3-token catch-ups; up to
//!   [`SMALL_K`] rows): accumulators in registers, each weight super-block
//!   unpacked in registers (no store and reload);
//! - longer tiles (verify blocks, prefill): each super-block is unpacked
//!   once into L1 and used for every row of the tile.
//!
//! For Q4_K/Q6_K, per super-block the exact sums of up to 4 rows are reduced
//! at once (a `hadd` tree: lane r = row r) and the float step runs for those
//! rows as the lanes of one vector.
//! `_mm256_maddubs_epi16` saturates at ±32767: every use below multiplies an
//! unsigned weight ≤ 128 (|Q8_0| incl. -128, Q4 ≤ 15, Q6 ≤ 63) by an activation
//! in [-127, 127], so a pair sums to at most 2 · 128 · 127 = 32512.

use std::arch::x86_64::*;

use super::act::{Act, ActKind};
use super::blocks::{cast, q4k_scales_mins, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, QK_K};
use super::combine;
use super::common::prefetch_ahead;
use super::types::{Isa, QuantFormat, RowFn, TILE};

/// Tiles of up to this many rows take the Q4_K/Q6_K kernels that unpack in
/// registers per pass; longer tiles unpack each super-block once into L1 for
/// all their rows ([`q4k_tile`], [`q6k_tile`]). Measured crossover on a Zen 3
/// core: re-unpacking per pass wins up to 3 rows, unpacking once from 4–5 on
/// (docs/model-core.md, "AVX2").
const SMALL_K: usize = 3;

/// Call `$f::<G>` with `G = tn.div_ceil(4)` (1..=6 for `tn <= TILE`).
const _: () = assert!(TILE <= 24 && TILE.is_multiple_of(4));
macro_rules! tile_groups {
    ($f:ident, $wrow:expr, $act:expr, $t0:expr, $tn:expr, $res:expr) => {
        match $tn.div_ceil(4) {
            1 => $f::<1>($wrow, $act, $t0, $tn, $res),
            2 => $f::<2>($wrow, $act, $t0, $tn, $res),
            3 => $f::<3>($wrow, $act, $t0, $tn, $res),
            4 => $f::<4>($wrow, $act, $t0, $tn, $res),
            5 => $f::<5>($wrow, $act, $t0, $tn, $res),
            _ => $f::<6>($wrow, $act, $t0, $tn, $res),
        }
    };
}

#[repr(C, align(64))]
struct A32<const N: usize>([u8; N]);

/// Whether `isa`'s kernels may need [`Act::bsum4`] for an input of `kind`
/// with `m` rows: the AVX2 Q4_K tiles ([`q4k_tile`], more than [`SMALL_K`]
/// rows; also on the AVX-512 paths, which fall back to AVX2 kernels for
/// formats they lack).
pub(super) fn needs_bsum4(isa: Isa, kind: ActKind, m: usize) -> bool {
    isa != Isa::Scalar && kind == ActKind::Q8K && m > SMALL_K
}

pub(super) fn row_fn(f: QuantFormat) -> Option<RowFn> {
    match f {
        QuantFormat::Q4_0
        | QuantFormat::Q5_0
        | QuantFormat::Q5_0x4
        | QuantFormat::Q8_0
        | QuantFormat::Q4_1
        | QuantFormat::Q5_1 => Some(super::x86_avx2_formats::row_block),
        QuantFormat::Q4K => Some(row_q4k),
        QuantFormat::Q5K => Some(row_q5k),
        QuantFormat::Q6K => Some(row_q6k),
        QuantFormat::Q3K => Some(row_q3k),
        QuantFormat::F16 | QuantFormat::BF16 => Some(super::x86_avx2_formats::row_half),
        QuantFormat::F32 => None,
    }
}

/// f16 (little-endian bytes) → f32 with F16C; exact, as `half`'s conversion
/// in the scalar path.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn f16c(b: [u8; 2]) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(
        _mm_cvtsi32_si128(u16::from_le_bytes(b) as i32),
    ))
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn row_q4k(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    if tn <= SMALL_K {
        passes!(SMALL_K, q4k_rows, format, wrow, act, t0, tn, res; 1 2; 3)
    } else {
        // SAFETY: the caller's contract.
        unsafe { q4k_tile(wrow, act, t0, tn, res) }
    }
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn row_q5k(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    if tn <= SMALL_K {
        passes!(SMALL_K, q5k_rows, format, wrow, act, t0, tn, res; 1 2; 3)
    } else {
        // SAFETY: the caller's contract.
        unsafe { q5k_tile(wrow, act, t0, tn, res) }
    }
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn row_q3k(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    if tn <= SMALL_K {
        passes!(SMALL_K, q3k_rows, format, wrow, act, t0, tn, res; 1 2; 3)
    } else {
        // SAFETY: the caller's contract.
        unsafe { q3k_tile(wrow, act, t0, tn, res) }
    }
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn row_q6k(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    if tn <= SMALL_K {
        passes!(SMALL_K, q6k_rows, format, wrow, act, t0, tn, res; 1 2; 3)
    } else {
        // SAFETY: the caller's contract.
        unsafe { q6k_tile(wrow, act, t0, tn, res) }
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

/// Lane r = Σ of the 8 i32 lanes of `v[r]`, for r < `R` ≤ 4 (exact; the
/// other lanes are unspecified).
#[inline]
#[target_feature(enable = "avx2")]
fn hsum_rows<const R: usize>(v: &[__m256i; R]) -> __m128i {
    let a = hsum_halves(v);
    _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256::<1>(a))
}

/// Per 128-bit half, lane r = Σ of the 4 i32 lanes of `v[r]` in that half,
/// for r < `R` ≤ 4 (exact; the other lanes are 0): the two halves add up to
/// [`hsum_rows`].
#[inline]
#[target_feature(enable = "avx2")]
fn hsum_halves<const R: usize>(v: &[__m256i; R]) -> __m256i {
    let z = _mm256_setzero_si256();
    let g = |i: usize| if i < R { v[i] } else { z };
    _mm256_hadd_epi32(_mm256_hadd_epi32(g(0), g(1)), _mm256_hadd_epi32(g(2), g(3)))
}

/// The first `out.len()` (≤ 4) lanes of `acc` into `out`.
#[inline]
#[target_feature(enable = "avx2")]
fn store_lanes(acc: __m128, out: &mut [f32]) {
    let mut a = [0f32; 4];
    // SAFETY: 4 f32 into [f32; 4].
    unsafe { _mm_storeu_ps(a.as_mut_ptr(), acc) };
    out.copy_from_slice(&a[..out.len()]);
}

/// The Q4_K mins duplicated per 16-element half: `[m0, m0, m1, m1, …]` as i16.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q4k_mins16(mn: [u8; 8]) -> __m256i {
    // SAFETY: 8 bytes from a [u8; 8].
    let m = unsafe { _mm_loadl_epi64(mn.as_ptr().cast()) };
    _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m))
}

/// The Q4_K sub-block scales as 8 i16 broadcasts (`out[j]` = `sc[j]` in every
/// lane): one widening and one in-lane `vpshufb` per scale, instead of a
/// scalar load and broadcast each.
#[inline]
#[target_feature(enable = "avx2")]
fn q4k_scale_vectors(sc: [u8; 8]) -> [__m256i; 8] {
    // SAFETY: 8 bytes from a [u8; 8].
    let v = _mm_cvtepu8_epi16(unsafe { _mm_loadl_epi64(sc.as_ptr().cast()) });
    let v = _mm256_broadcastsi128_si256(v);
    std::array::from_fn(|j| {
        let pick = (((2 * j + 1) << 8) | (2 * j)) as i16;
        _mm256_shuffle_epi8(v, _mm256_set1_epi16(pick))
    })
}

/// Q4_K weight row × activation rows `t0..t0 + R` (Q8_K): per super-block
/// the exact pair (S, M) of every row ([`combine::q4k_step`]), reduced across
/// the rows at once, then the float step for the rows as lanes:
/// `acc + ((d·dx)·S − (dmin·dx)·M)`.
///
/// # Safety
/// CPU features; rows `t0..t0 + R` exist in `act`; `res.len() >= R`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
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

/// [`q4k_rows`] for Q5_K weights.
///
/// # Safety
/// As [`q4k_rows`].
#[inline]
#[target_feature(enable = "avx2,f16c")]
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

/// [`q4k_rows`] (`FIVE`: Q5_K, else Q4_K).
///
/// # Safety
/// As [`q4k_rows`].
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn k45_rows<const R: usize, const FIVE: bool>(
    _: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    let mut acc = _mm_setzero_ps();
    let (qs, bsums) = (act.qs.as_ptr(), act.bsums.as_ptr());
    let (cols, nb) = (act.cols, act.nb);
    for sb in 0..nb {
        let b = k45::<FIVE>(wrow, sb);
        prefetch_ahead::<3>(b.qs.as_ptr());
        let (sc, mn) = q4k_scales_mins(b.scales);
        let scv = q4k_scale_vectors(sc);
        let mut sv = [_mm256_setzero_si256(); R];
        for c in 0..4 {
            let (w0, w1) = q4k_pair(&b, c);
            let (s0, s1) = (scv[2 * c], scv[2 * c + 1]);
            for (r, sv) in sv.iter_mut().enumerate() {
                // SAFETY: row t0 + r < m, super-block sb < nb: inside `qs`.
                unsafe {
                    let xq = qs.add((t0 + r) * cols + sb * QK_K + 64 * c);
                    let x0 = _mm256_loadu_si256(xq.cast());
                    let x1 = _mm256_loadu_si256(xq.add(32).cast());
                    let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), s0);
                    let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), s1);
                    *sv = _mm256_add_epi32(*sv, _mm256_add_epi32(p0, p1));
                }
            }
        }
        let mnv = q4k_mins16(mn);
        let mv: [__m256i; R] = std::array::from_fn(|r| {
            // SAFETY: 16 sums per super-block of row t0 + r < m.
            let bsv = unsafe { _mm256_loadu_si256(bsums.add(((t0 + r) * nb + sb) * 16).cast()) };
            _mm256_madd_epi16(bsv, mnv)
        });
        let (s, mm) = (hsum_rows(&sv), hsum_rows(&mv));
        // SAFETY: the caller's contract.
        let dx = unsafe { group_scales(act, sb, t0, R) };
        let dd = _mm_mul_ps(_mm_set1_ps(f16c(b.d)), dx);
        let dm = _mm_mul_ps(_mm_set1_ps(f16c(b.dmin)), dx);
        let p = _mm_sub_ps(
            _mm_mul_ps(dd, _mm_cvtepi32_ps(s)),
            _mm_mul_ps(dm, _mm_cvtepi32_ps(mm)),
        );
        acc = _mm_add_ps(acc, p);
    }
    store_lanes(acc, &mut res[..R]);
}

/// Q6_K weight row × activation rows `t0..t0 + R` (Q8_K), as [`q4k_rows`]
/// with [`combine::q6k_step`]: `acc + (d·dx)·S`, where
/// `S = Σ_g sc_g · Σ (q − 32)·x = Σ sc·q·x − 32 · Σ_g sc_g · bsum_g`.
///
/// # Safety
/// As [`q4k_rows`].
#[inline]
#[target_feature(enable = "avx2,f16c")]
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

/// [`q6k_rows`] for Q3_K weights (values `q + 4` in 0..8 and the offset
/// `4 · Σ_g sc_g · bsum_g`).
///
/// # Safety
/// As [`q4k_rows`].
#[inline]
#[target_feature(enable = "avx2,f16c")]
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

/// [`q6k_rows`] (`THREE`: Q3_K, else Q6_K).
///
/// # Safety
/// As [`q4k_rows`].
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn k36_rows<const R: usize, const THREE: bool>(
    _: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    let mut acc = _mm_setzero_ps();
    // R == 1: a scalar accumulator, and the exact sums of an unstepped
    // super-block with its `d·dx`.
    let mut acc1 = 0f32;
    let mut pending: Option<(__m256i, f32)> = None;
    let (qs, bsums) = (act.qs.as_ptr(), act.bsums.as_ptr());
    let (cols, nb) = (act.cols, act.nb);
    for sb in 0..nb {
        let (d, pf) = k36_head::<THREE>(wrow, sb);
        prefetch_ahead::<4>(pf);
        let (scv, sc16) = q6k_scale_vectors(k36_scales::<THREE>(wrow, sb));
        let mut sv = [_mm256_setzero_si256(); R];
        for h in 0..2 {
            for (i, w) in k36_half::<THREE>(wrow, sb, h).iter().enumerate() {
                let c = 4 * h + i;
                for (r, sv) in sv.iter_mut().enumerate() {
                    // SAFETY: row t0 + r < m, super-block sb < nb: inside `qs`.
                    unsafe {
                        let x =
                            _mm256_loadu_si256(qs.add((t0 + r) * cols + sb * QK_K + 32 * c).cast());
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(*w, x), scv[c]);
                        *sv = _mm256_add_epi32(*sv, p);
                    }
                }
            }
        }
        for (r, sv) in sv.iter_mut().enumerate() {
            // SAFETY: 16 sums per super-block of row t0 + r < m.
            *sv = unsafe { k36_offset::<THREE>(*sv, bsums.add(((t0 + r) * nb + sb) * 16), sc16) };
        }
        if R == 1 {
            // SAFETY: row t0 < m, sb < nb.
            let dd = f16c(d) * unsafe { *act.d.as_ptr().add(t0 * nb + sb) };
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
            let dx = unsafe { group_scales(act, sb, t0, R) };
            let dd = _mm_mul_ps(_mm_set1_ps(f16c(d)), dx);
            acc = _mm_add_ps(acc, _mm_mul_ps(dd, _mm_cvtepi32_ps(s)));
        }
    }
    if R == 1 {
        res[0] = acc1;
    } else {
        store_lanes(acc, &mut res[..R]);
    }
}
/// Sub-blocks 2c and 2c + 1 (c < 4) of a Q4_K super-block as bytes 0..16:
/// elements 64c..64c+32 are the low nibbles of qs[32c..32c+32], elements
/// 64c+32..64c+64 the high ones.
#[inline]
#[target_feature(enable = "avx2")]
fn q4k_pair(b: &K45, c: usize) -> (__m256i, __m256i) {
    let lo4 = _mm256_set1_epi8(0xF);
    // SAFETY: 32 bytes at 32c (c < 4) inside the 128-byte `qs`.
    let raw = unsafe { _mm256_loadu_si256(b.qs.as_ptr().add(32 * c).cast()) };
    let (lo, hi) = (
        _mm256_and_si256(raw, lo4),
        _mm256_and_si256(_mm256_srli_epi16::<4>(raw), lo4),
    );
    match b.qh {
        None => (lo, hi),
        Some(qh) => {
            // Q5_K: bits 2c and 2c + 1 of qh[l] are the fifth bits of
            // elements 64c + l and 64c + 32 + l. A 16-bit shift by 2c puts
            // them at bits 0 and 1 of every byte (the bits shifted in from
            // the next byte land above bit 1 and are masked off).
            // SAFETY: 32 bytes from a [u8; 32].
            let h = unsafe { _mm256_loadu_si256(qh.as_ptr().cast()) };
            let h = _mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c as i32));
            let b16 = _mm256_set1_epi8(0x10);
            (
                _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16::<4>(h), b16)),
                _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16::<3>(h), b16)),
            )
        }
    }
}

/// A Q4_K or Q5_K super-block: the same scales, mins and nibbles; Q5_K adds
/// the fifth bits `qh` ([`BlockQ5K`]).
#[derive(Clone, Copy)]
pub(super) struct K45<'a> {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: &'a [u8; 12],
    pub qs: &'a [u8; QK_K / 2],
    pub qh: Option<&'a [u8; QK_K / 8]>,
}

/// Super-block `sb` of a Q5_K (`FIVE`) or Q4_K row.
#[inline(always)]
pub(super) fn k45<const FIVE: bool>(wrow: &[u8], sb: usize) -> K45<'_> {
    if FIVE {
        let b = &cast::<BlockQ5K>(wrow)[sb];
        K45 {
            d: b.d,
            dmin: b.dmin,
            scales: &b.scales,
            qs: &b.qs,
            qh: Some(&b.qh),
        }
    } else {
        let b = &cast::<BlockQ4K>(wrow)[sb];
        K45 {
            d: b.d,
            dmin: b.dmin,
            scales: &b.scales,
            qs: &b.qs,
            qh: None,
        }
    }
}

/// The scale and a prefetch address of super-block `sb` of a Q3_K
/// (`THREE`) or Q6_K row.
#[inline(always)]
pub(super) fn k36_head<const THREE: bool>(wrow: &[u8], sb: usize) -> ([u8; 2], *const u8) {
    if THREE {
        let b = &cast::<BlockQ3K>(wrow)[sb];
        (b.d, b.hmask.as_ptr())
    } else {
        let b = &cast::<BlockQ6K>(wrow)[sb];
        (b.d, b.ql.as_ptr())
    }
}

/// The 16 signed group scales of super-block `sb` as bytes: Q6_K's loaded,
/// Q3_K's `sc − 32` built in registers ([`q3k_scales_simd`]; storing
/// them byte by byte and loading the 16 bytes back stalls store forwarding
/// once per super-block).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn k36_scales<const THREE: bool>(wrow: &[u8], sb: usize) -> __m128i {
    if THREE {
        _mm_sub_epi8(
            q3k_scales_simd(&cast::<BlockQ3K>(wrow)[sb].scales),
            _mm_set1_epi8(32),
        )
    } else {
        // SAFETY: 16 bytes from a [i8; 16].
        unsafe { _mm_loadu_si128(cast::<BlockQ6K>(wrow)[sb].scales.as_ptr().cast()) }
    }
}

/// The 16 unsigned 6-bit Q3_K scales of `q` (the bytes of
/// [`super::blocks::q3k_scale_words`]) in registers: scale j < 8 has the low nibble of
/// q[j], scale j ≥ 8 the high nibble of q[j − 8], and bits 4–5 are bits
/// 2g..2g+2 of q[8 + j % 4] for g = j / 4 (a variable shift per dword).
#[inline]
#[target_feature(enable = "avx2")]
fn q3k_scales_simd(q: &[u8; 12]) -> __m128i {
    // SAFETY: 8 bytes at the start of the 12-byte array.
    let a = unsafe { _mm_loadl_epi64(q.as_ptr().cast()) };
    let nibbles = _mm_and_si128(
        _mm_unpacklo_epi64(a, _mm_srli_epi16::<4>(a)),
        _mm_set1_epi8(0x0F),
    );
    let tmp = _mm_set1_epi32(i32::from_le_bytes([q[8], q[9], q[10], q[11]]));
    let high = _mm_and_si128(
        _mm_slli_epi32::<4>(_mm_srlv_epi32(tmp, _mm_setr_epi32(0, 2, 4, 6))),
        _mm_set1_epi8(0x30),
    );
    _mm_or_si128(nibbles, high)
}

/// Chunks 4h..4h+4 (32 values each, element order) of super-block `sb`:
/// Q6_K's values 0..64 ([`q6k_half`]) or Q3_K's `q + 4` in 0..8 ([`q3k_half`]).
#[inline]
#[target_feature(enable = "avx2")]
fn k36_half<const THREE: bool>(wrow: &[u8], sb: usize, h: usize) -> [__m256i; 4] {
    if THREE {
        q3k_half(&cast::<BlockQ3K>(wrow)[sb], h)
    } else {
        q6k_half(&cast::<BlockQ6K>(wrow)[sb], h)
    }
}

/// Chunks 4h..4h+4 (h < 2) of a Q3_K super-block as `q + 4` in 0..8: chunk
/// 4h + j is bits 2j..2j+2 of qs[32h..32h+32] plus 4 where bit 4h + j of
/// hmask[0..32] is set.
#[inline]
#[target_feature(enable = "avx2")]
fn q3k_half(b: &BlockQ3K, h: usize) -> [__m256i; 4] {
    let m3 = _mm256_set1_epi8(3);
    let four = _mm256_set1_epi8(4);
    // SAFETY: 32 bytes at 32h (h < 2) inside the 64-byte `qs`; the 32-byte hmask.
    let (q, hm) = unsafe {
        (
            _mm256_loadu_si256(b.qs.as_ptr().add(32 * h).cast()),
            _mm256_loadu_si256(b.hmask.as_ptr().cast()),
        )
    };
    let hi = |j: usize| {
        let bit = _mm256_set1_epi8((1u8 << (4 * h + j)) as i8);
        _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit), four)
    };
    [
        _mm256_or_si256(_mm256_and_si256(q, m3), hi(0)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<2>(q), m3), hi(1)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(q), m3), hi(2)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<6>(q), m3), hi(3)),
    ]
}

/// Unpack a Q4_K (Q5_K) super-block's 256 values into bytes (element order).
#[inline]
#[target_feature(enable = "avx2")]
fn unpack_q4k_values(b: &K45, q: &mut A32<QK_K>) {
    for c in 0..4 {
        let (lo, hi) = q4k_pair(b, c);
        // SAFETY: stores within the 256 bytes of `q`.
        unsafe {
            _mm256_store_si256(q.0.as_mut_ptr().add(64 * c).cast(), lo);
            _mm256_store_si256(q.0.as_mut_ptr().add(64 * c + 32).cast(), hi);
        }
    }
}

/// Chunks 4h..4h+4 (h < 2; 32 values 0..64 each, element order) of a Q6_K
/// super-block, from ql[64h..64h+64] and qh[32h..32h+32].
#[inline]
#[target_feature(enable = "avx2")]
fn q6k_half(b: &BlockQ6K, h: usize) -> [__m256i; 4] {
    let lo4 = _mm256_set1_epi8(0xF);
    let m2 = _mm256_set1_epi8(0x03);
    let m30 = _mm256_set1_epi8(0x30);
    // SAFETY: reads within ql (128 B) and qh (64 B) for h < 2.
    let (ql0, ql1, qh) = unsafe {
        (
            _mm256_loadu_si256(b.ql.as_ptr().add(64 * h).cast()),
            _mm256_loadu_si256(b.ql.as_ptr().add(64 * h + 32).cast()),
            _mm256_loadu_si256(b.qh.as_ptr().add(32 * h).cast()),
        )
    };
    [
        _mm256_or_si256(
            _mm256_and_si256(ql0, lo4),
            _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m2)),
        ),
        _mm256_or_si256(
            _mm256_and_si256(ql1, lo4),
            _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), lo4),
            _mm256_and_si256(qh, m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), lo4),
            _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m30),
        ),
    ]
}

/// Unpack a Q6_K super-block's 6-bit values (0..64) into bytes (element order).
#[inline]
#[target_feature(enable = "avx2")]
fn unpack_k36_values<const THREE: bool>(wrow: &[u8], sb: usize, q: &mut A32<QK_K>) {
    for h in 0..2 {
        for (i, e) in k36_half::<THREE>(wrow, sb, h).into_iter().enumerate() {
            // SAFETY: chunk 4h + i < 8: a store within the 256 bytes of `q`.
            unsafe { _mm256_store_si256(q.0.as_mut_ptr().add(32 * (4 * h + i)).cast(), e) };
        }
    }
}

/// `s − 32 · Σ_g sc_g · bsum_g`: turns the sums of `sc · q · x` (q in 0..64)
/// into those of `sc · (q − 32) · x` ([`combine::q6k_step`]); for Q3_K
/// (`THREE`), `s − 4 · …` for values stored as `q + 4`.
///
/// # Safety
/// 16 readable i16 sums at `bs` (one row's super-block).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn k36_offset<const THREE: bool>(s: __m256i, bs: *const i16, sc16: __m256i) -> __m256i {
    // SAFETY: the caller's contract.
    let bsv = unsafe { _mm256_loadu_si256(bs.cast()) };
    let t = _mm256_madd_epi16(bsv, sc16);
    // Q3_K: s − 4·t; Q6_K: s − 32·t.
    let t = if THREE {
        _mm256_slli_epi32::<2>(t)
    } else {
        _mm256_slli_epi32::<5>(t)
    };
    _mm256_sub_epi32(s, t)
}

/// The Q6_K scales of chunk c (32 elements): `[sc_2c ×8, sc_2c+1 ×8]` as i16,
/// and all 16 scales as i16. Each chunk's vector is one `vpermd` (the i16 pair
/// `sc_2c, sc_2c+1` into every dword) and one in-lane `vpshufb` (the low half
/// repeats the first of the pair, the high half the second), instead of two
/// scalar broadcasts and an insert.
#[inline]
#[target_feature(enable = "avx2")]
fn q6k_scale_vectors(sc: __m128i) -> ([__m256i; 8], __m256i) {
    let sc16 = _mm256_cvtepi8_epi16(sc);
    let pick = _mm256_setr_epi8(
        0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, //
        2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
    );
    let scv = std::array::from_fn(|c| {
        let pair = _mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(c as i32));
        _mm256_shuffle_epi8(pair, pick)
    });
    (scv, sc16)
}

/// `Σ_c madd(maddubs(q[32c..], x_r[32c..]), scv[c])` over the 8 chunks of a
/// super-block for `R` activation rows `x_r = xq + r·cols`: per row 8 i32
/// lanes whose sum is the exact scaled dot product. Each unpacked weight
/// chunk is loaded once for the `R` rows (a Zen 3 core is bound by its loads
/// when every product loads its own weight chunk and scale: ~1.35–1.5× slower
/// in a micro-benchmark, docs/model-core.md "AVX2").
///
/// # Safety
/// 256 readable bytes at `xq + r·cols` for r < `R`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_chunks_rows<const R: usize>(
    xq: *const i8,
    cols: usize,
    q: &A32<QK_K>,
    scv: &[__m256i; 8],
) -> [__m256i; R] {
    let mut s = [_mm256_setzero_si256(); R];
    // An opaque trip count keeps this loop a loop: fully unrolled, LLVM
    // reassociates the integer sums row by row and reloads the weight chunk
    // and its scale for every product, which is the load-bound order.
    let chunks = std::hint::black_box(QK_K / 32);
    for (c, scv) in scv.iter().enumerate().take(chunks) {
        // SAFETY: chunk c < 8 of the 256 bytes of q and of each row at xq.
        unsafe {
            let w = _mm256_load_si256(q.0.as_ptr().add(32 * c).cast());
            for (r, s) in s.iter_mut().enumerate() {
                let x = _mm256_loadu_si256(xq.add(r * cols + 32 * c).cast());
                *s = _mm256_add_epi32(*s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), *scv));
            }
        }
    }
    s
}

/// The activation scales of rows `r0..r0 + n` (n ≤ 4) for super-block `sb` as
/// SSE lanes (lanes from `n` on are 0).
///
/// # Safety
/// Those rows and `sb` exist in `act` (Q8_K).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn group_scales(act: &Act, sb: usize, r0: usize, n: usize) -> __m128 {
    if n == 4 {
        // SAFETY: rows r0..r0 + 4 exist: 4 floats inside `dt`.
        return unsafe { _mm_loadu_ps(act.dt.as_ptr().add(sb * act.m + r0)) };
    }
    let mask = _mm_cmpgt_epi32(_mm_set1_epi32(n as i32), _mm_set_epi32(3, 2, 1, 0));
    // SAFETY: `dt` holds m floats per super-block; masked lanes are not read.
    unsafe { _mm_maskload_ps(act.dt.as_ptr().add(sb * act.m + r0), mask) }
}

/// The lanes of the per-group accumulators into `res[..tn]` (group g holds
/// rows 4g..4g + 4).
#[inline]
#[target_feature(enable = "avx2")]
fn store_groups(acc: &[__m128], tn: usize, res: &mut [f32; TILE]) {
    for (g, acc) in acc.iter().enumerate().take(tn.div_ceil(4)) {
        let n = (tn - 4 * g).min(4);
        store_lanes(*acc, &mut res[4 * g..4 * g + n]);
    }
}

/// The exact Q4_K S and M of activation rows `r0..r0 + R` (lanes r and
/// 4 + r; the other lanes are unspecified) for the unpacked super-block `q`
/// (`sb` of its row): M from [`Act::bsum4`] with one `madd` per pair of
/// mins for all 4 rows (`mins4`, [`q4k_mins4`]), and S and M reduced by one
/// shared cross-half add.
///
/// # Safety
/// Rows `r0..r0 + R` and super-block `sb` exist in `act` (Q8_K, with
/// `bsum4`); `r0 % 4 == 0`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q4k_group<const R: usize>(
    act: &Act,
    r0: usize,
    sb: usize,
    q: &A32<QK_K>,
    scv: &[__m256i; 8],
    mins4: &[__m256i; 2],
) -> __m256i {
    let (cols, nb) = (act.cols, act.nb);
    debug_assert!(r0.is_multiple_of(4));
    // SAFETY: the caller's contract: the rows' super-block sb is inside qs
    // (m·cols), and group r0/4's 32 sums for sb inside bsum4.
    unsafe {
        let sv = dot_chunks_rows::<R>(act.qs.as_ptr().add(r0 * cols + sb * QK_K), cols, q, scv);
        let bs = act.bsum4.as_ptr().add((r0 / 4 * nb + sb) * 32);
        // [rows 0..4: pairs (0,1) + (4,5) | rows 0..4: pairs (2,3) + (6,7)]
        let mm = _mm256_add_epi32(
            _mm256_madd_epi16(_mm256_loadu_si256(bs.cast()), mins4[0]),
            _mm256_madd_epi16(_mm256_loadu_si256(bs.add(16).cast()), mins4[1]),
        );
        let e = hsum_halves(&sv);
        _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(e, mm),
            _mm256_permute2x128_si256::<0x31>(e, mm),
        )
    }
}

/// The mins of a Q4_K super-block as the two `madd` operands for
/// [`Act::bsum4`]: half h is `[(m_4h, m_4h+1) × 4 | (m_4h+2, m_4h+3) × 4]`
/// as i16.
#[inline]
#[target_feature(enable = "avx2")]
fn q4k_mins4(mn: [u8; 8]) -> [__m256i; 2] {
    // SAFETY: 8 bytes from a [u8; 8].
    let m = unsafe { _mm_loadl_epi64(mn.as_ptr().cast()) };
    // i32 lanes 0..4: the pairs (m0, m1), (m2, m3), (m4, m5), (m6, m7).
    let v = _mm256_castsi128_si256(_mm_cvtepu8_epi16(m));
    [
        _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)),
        _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)),
    ]
}

/// The exact Q6_K S of activation rows `r0..r0 + R` (lane r), as
/// [`q4k_group`].
///
/// # Safety
/// As [`q4k_group`].
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q6k_group<const R: usize, const THREE: bool>(
    act: &Act,
    r0: usize,
    sb: usize,
    q: &A32<QK_K>,
    scv: &[__m256i; 8],
    sc16: __m256i,
) -> __m128i {
    let (cols, nb) = (act.cols, act.nb);
    // SAFETY: as in `q4k_group`.
    unsafe {
        let mut sv = dot_chunks_rows::<R>(act.qs.as_ptr().add(r0 * cols + sb * QK_K), cols, q, scv);
        for (i, s) in sv.iter_mut().enumerate() {
            *s = k36_offset::<THREE>(*s, act.bsums.as_ptr().add(((r0 + i) * nb + sb) * 16), sc16);
        }
        hsum_rows(&sv)
    }
}

/// Q4_K weight row × a tile of `tn` rows: each super-block is unpacked once
/// into L1 and used for every row; rows go in groups of 4 whose exact (S, M)
/// are reduced at once and stepped as the lanes of one vector, as in
/// [`q4k_rows`].
///
/// # Safety
/// CPU features; rows `t0..t0 + tn` exist in `act`; `tn <= TILE`.
#[target_feature(enable = "avx2,f16c")]
unsafe fn q4k_tile(wrow: &[u8], act: &Act, t0: usize, tn: usize, res: &mut [f32; TILE]) {
    // `q4k_group` reads the 4-row sums of every group of the tile.
    assert!(
        act.bsum4.len() >= (t0 + tn).div_ceil(4) * act.nb * 32,
        "AVX2 Q4_K tile without Act::bsum4 (see needs_bsum4)"
    );
    // SAFETY: the caller's contract.
    unsafe { tile_groups!(q4k_tile_g, wrow, act, t0, tn, res) }
}

/// [`q4k_tile`] for `G` groups of rows (all of 4 rows but the last, which
/// has `tn − 4(G − 1)`): a constant group count keeps the accumulators in
/// registers.
///
/// # Safety
/// As [`q4k_tile`], with `tn.div_ceil(4) == G`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn q4k_tile_g<const G: usize>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    // SAFETY: the caller's contract.
    unsafe { k45_tile_g::<G, false>(wrow, act, t0, tn, res) }
}

/// [`q4k_tile`] for Q5_K weights.
///
/// # Safety
/// As [`q4k_tile`].
#[target_feature(enable = "avx2,f16c")]
unsafe fn q5k_tile(wrow: &[u8], act: &Act, t0: usize, tn: usize, res: &mut [f32; TILE]) {
    assert!(
        act.bsum4.len() >= (t0 + tn).div_ceil(4) * act.nb * 32,
        "AVX2 Q5_K tile without Act::bsum4 (see needs_bsum4)"
    );
    // SAFETY: the caller's contract.
    unsafe { tile_groups!(q5k_tile_g, wrow, act, t0, tn, res) }
}

/// [`q4k_tile_g`] for Q5_K weights.
///
/// # Safety
/// As [`q4k_tile_g`].
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn q5k_tile_g<const G: usize>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    // SAFETY: the caller's contract.
    unsafe { k45_tile_g::<G, true>(wrow, act, t0, tn, res) }
}

/// [`q4k_tile_g`] (`FIVE`: Q5_K, else Q4_K).
///
/// # Safety
/// As [`q4k_tile_g`].
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn k45_tile_g<const G: usize, const FIVE: bool>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    let mut acc = [_mm_setzero_ps(); G];
    let mut q = A32([0u8; QK_K]);
    let last = tn - 4 * (G - 1);
    for sb in 0..act.nb {
        let b = k45::<FIVE>(wrow, sb);
        prefetch_ahead::<3>(b.qs.as_ptr());
        unpack_q4k_values(&b, &mut q);
        let (sc, mn) = q4k_scales_mins(b.scales);
        let scv = q4k_scale_vectors(sc);
        let mins4 = q4k_mins4(mn);
        // [d × 4 | dmin × 4]
        let dd = _mm256_set_m128(_mm_set1_ps(f16c(b.dmin)), _mm_set1_ps(f16c(b.d)));
        // The exact sums of every group first, then their float steps: the
        // steps' latency chains overlap each other instead of stalling the
        // next group's products.
        let mut sms = [_mm256_setzero_si256(); G];
        for (g, sm) in sms.iter_mut().enumerate() {
            let n = if g + 1 < G { 4 } else { last };
            let r0 = t0 + 4 * g;
            // SAFETY: rows r0..r0 + n < m, super-block sb < nb; r0 % 4 == 0
            // (t0 is a multiple of TILE).
            *sm = unsafe {
                match n {
                    4 => q4k_group::<4>(act, r0, sb, &q, &scv, &mins4),
                    3 => q4k_group::<3>(act, r0, sb, &q, &scv, &mins4),
                    2 => q4k_group::<2>(act, r0, sb, &q, &scv, &mins4),
                    _ => q4k_group::<1>(act, r0, sb, &q, &scv, &mins4),
                }
            };
        }
        for (g, (acc, sm)) in acc.iter_mut().zip(sms).enumerate() {
            let n = if g + 1 < G { 4 } else { last };
            // SAFETY: rows t0 + 4g..t0 + 4g + n exist, sb < nb.
            let dx = unsafe { group_scales(act, sb, t0 + 4 * g, n) };
            // combine::q4k_step per lane: [(d·dx)·S | (dmin·dx)·M], then the
            // difference added to the accumulator.
            let p = _mm256_mul_ps(
                _mm256_mul_ps(dd, _mm256_set_m128(dx, dx)),
                _mm256_cvtepi32_ps(sm),
            );
            let p = _mm_sub_ps(_mm256_castps256_ps128(p), _mm256_extractf128_ps::<1>(p));
            *acc = _mm_add_ps(*acc, p);
        }
    }
    store_groups(&acc, tn, res);
}

/// Q6_K weight row × a tile of `tn` rows, as [`q4k_tile`] with the Q6_K
/// sums of [`q6k_rows`].
///
/// # Safety
/// As [`q4k_tile`].
#[target_feature(enable = "avx2,f16c")]
unsafe fn q6k_tile(wrow: &[u8], act: &Act, t0: usize, tn: usize, res: &mut [f32; TILE]) {
    // SAFETY: the caller's contract.
    unsafe { tile_groups!(q6k_tile_g, wrow, act, t0, tn, res) }
}

/// [`q6k_tile`] for `G` groups of rows, as [`q4k_tile_g`].
///
/// # Safety
/// As [`q4k_tile_g`].
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn q6k_tile_g<const G: usize>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    // SAFETY: the caller's contract.
    unsafe { k36_tile_g::<G, false>(wrow, act, t0, tn, res) }
}

/// [`q6k_tile`] for Q3_K weights.
///
/// # Safety
/// As [`q4k_tile`].
#[target_feature(enable = "avx2,f16c")]
unsafe fn q3k_tile(wrow: &[u8], act: &Act, t0: usize, tn: usize, res: &mut [f32; TILE]) {
    // SAFETY: the caller's contract.
    unsafe { tile_groups!(q3k_tile_g, wrow, act, t0, tn, res) }
}

/// [`q6k_tile_g`] for Q3_K weights.
///
/// # Safety
/// As [`q4k_tile_g`].
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn q3k_tile_g<const G: usize>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    // SAFETY: the caller's contract.
    unsafe { k36_tile_g::<G, true>(wrow, act, t0, tn, res) }
}

/// [`q6k_tile_g`] (`THREE`: Q3_K, else Q6_K).
///
/// # Safety
/// As [`q4k_tile_g`].
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn k36_tile_g<const G: usize, const THREE: bool>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    let mut acc = [_mm_setzero_ps(); G];
    let mut q = A32([0u8; QK_K]);
    let last = tn - 4 * (G - 1);
    for sb in 0..act.nb {
        let (d, pf) = k36_head::<THREE>(wrow, sb);
        prefetch_ahead::<4>(pf);
        unpack_k36_values::<THREE>(wrow, sb, &mut q);
        let (scv, sc16) = q6k_scale_vectors(k36_scales::<THREE>(wrow, sb));
        let d = _mm_set1_ps(f16c(d));
        // As in `q4k_tile_g`: the sums of every group, then the float steps.
        let mut ss = [_mm_setzero_si128(); G];
        for (g, s) in ss.iter_mut().enumerate() {
            let n = if g + 1 < G { 4 } else { last };
            let r0 = t0 + 4 * g;
            // SAFETY: rows r0..r0 + n < m, super-block sb < nb.
            *s = unsafe {
                match n {
                    4 => q6k_group::<4, THREE>(act, r0, sb, &q, &scv, sc16),
                    3 => q6k_group::<3, THREE>(act, r0, sb, &q, &scv, sc16),
                    2 => q6k_group::<2, THREE>(act, r0, sb, &q, &scv, sc16),
                    _ => q6k_group::<1, THREE>(act, r0, sb, &q, &scv, sc16),
                }
            };
        }
        for (g, (acc, s)) in acc.iter_mut().zip(ss).enumerate() {
            let n = if g + 1 < G { 4 } else { last };
            // SAFETY: as in `q4k_tile_g`.
            let dx = unsafe { group_scales(act, sb, t0 + 4 * g, n) };
            *acc = _mm_add_ps(*acc, _mm_mul_ps(_mm_mul_ps(d, dx), _mm_cvtepi32_ps(s)));
        }
    }
    store_groups(&acc, tn, res);
}
