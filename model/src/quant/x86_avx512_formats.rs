//! AVX-512 VNNI kernels of the whole-block formats (Q4_0/Q5_0/Q8_0 and the
//! offset formats Q4_1/Q5_1) and of F16/BF16 weights (the K-quants
//! Q3_K/Q5_K share the Q6_K/Q4_K kernels of `x86_avx512`).
//!
//! Same integer sums and float steps as the scalar reference:
//! - Q4_0/Q5_0/Q8_0/Q4_1/Q5_1: two blocks per vector as unsigned bytes
//!   (Q4_1/Q5_1 as stored; the signed formats as `w + off`, `off` = 8, 16,
//!   128), so `vpdpbusd` from zero gives 8 exact lanes per block; per 16
//!   blocks a transposition tree reduces them to one exact sum per block
//!   (lane j = block `b + j`; the signed formats then add the activation's
//!   `−off·Σ32 x`, giving `s = Σ w·x`), and the shared float step runs for
//!   the 16 blocks as the lanes of one vector: [`combine::block_step`]
//!   `acc += (dw·dx)·s` or [`combine::min_block_step`] `acc += (dw·dx)·s +
//!   mw·xs`, with `dw` (and `mw`) of the 16 blocks from one gather (every
//!   block starts with `d`; Q4_1/Q5_1 then `m`);
//! - F16/BF16: `scalar::row_float`'s 16 lanes in one vector (weights
//!   widened exactly), separate multiply and add, [`combine::reduce16`].

use std::arch::x86_64::*;

use super::act::Act;
use super::blocks::{cast, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, QK};
use super::combine;
use super::common::prefetch_ahead;
use super::types::{QuantFormat, TILE, WHOLE_BLOCK};

/// Activation rows per pass of the whole-block kernel (each row keeps a
/// partial reduction tree of 16 blocks in registers).
const MAX_R_BLOCK: usize = 8;
/// Activation rows per pass of the F16/BF16 kernel (one 16-lane accumulator
/// each; as many as the K-quant kernels of `x86_avx512` take).
const MAX_R_HALF: usize = 8;

/// Whether `format` is an offset format (`d·q + m`: Q4_1/Q5_1, stepped by
/// [`combine::min_block_step`]) rather than a signed one (stepped by
/// [`combine::block_step`]).
pub(super) fn has_offset(format: QuantFormat) -> bool {
    matches!(format, QuantFormat::Q4_1 | QuantFormat::Q5_1)
}

/// Q4_0/Q5_0/Q8_0 (Q8_0 activations with `Act::prepare_unsigned`) or
/// Q4_1/Q5_1 (Q8_1) weight row × a tile of `tn` rows, in passes of up to
/// [`MAX_R_BLOCK`] rows.
///
/// # Safety
/// AVX-512 F/BW/VL + VNNI, AVX2, F16C; rows `t0..t0 + tn` exist in `act`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn row_block(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    // One activation row (a decode step) runs the AVX2 kernel: its float
    // step per 8 blocks with the scales from eight loads beat this
    // kernel's per-16-block step with a gather on real weights streamed
    // from memory (AMD Zen 4, 1 thread: SmolLM2's Q4_1 FFN 2.52 → 1.88
    // ms, the Qwen draft's Q8_0 head 13.7 → 8.9 ms; docs/model-core.md
    // "One row on AVX-512"). Same bits: the contract's order on every path.
    if tn == 1 {
        // SAFETY: AVX-512 VNNI is only chosen where AVX2 and F16C are
        // available (`Isa::is_available`); the activation rows are the
        // caller's, prepared alike for both kernels (`act_key`: the AVX2
        // Q8_0 kernel reads the signed values and ignores `corr`).
        return unsafe { super::x86_avx2_formats::row_block(format, wrow, act, t0, tn, res) };
    }
    passes!(MAX_R_BLOCK, block_rows, format, wrow, act, t0, tn, res; 1 2 3 4 5 6 7; 8)
}

/// [`block_rows_of`] for `format`.
///
/// # Safety
/// As [`block_rows_of`].
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block_rows<const R: usize>(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    // SAFETY: the caller's contract.
    unsafe { whole_block!(format, block_rows_of::<R>(wrow, act, t0, res)) }
}

/// Low nibbles of 16 bytes then their high nibbles (elements 0..32 of a
/// Q4_0/Q5_0 block), for block `a` in the low half and `b` (or zeros) in the
/// high half.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw")]
fn nibbles(qa: &[u8; 16], qb: Option<&[u8; 16]>) -> __m512i {
    // Per 128-bit lane: shift 0 (low nibbles), 4 (high nibbles), 0, 4.
    let h = _mm256_set_m128i(_mm_set1_epi16(4), _mm_set1_epi16(0));
    let sh = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(h), h);
    // SAFETY: 16 bytes from each 16-byte array.
    let ya = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(qa.as_ptr().cast())) };
    let z = match qb {
        Some(qb) => {
            // SAFETY: as above.
            let yb = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(qb.as_ptr().cast())) };
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ya), yb)
        }
        None => _mm512_zextsi256_si512(ya),
    };
    _mm512_and_si512(_mm512_srlv_epi16(z, sh), _mm512_set1_epi8(0xF))
}

/// Values of blocks `b` and `b + 1` of a Q4_0/Q5_0/Q8_0/Q4_1/Q5_1 row (the
/// second only if `two`, else zeros) as unsigned bytes, element order:
/// Q4_1/Q5_1 as stored, the signed formats offset by 8, 16, 128 (`w +
/// off`, the offset `act_key` gives `Act::prepare_unsigned`).
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl")]
pub(super) fn unsigned_pair(format: QuantFormat, wrow: &[u8], b: usize, two: bool) -> __m512i {
    match format {
        QuantFormat::Q4_0 => {
            let blk = cast::<BlockQ4_0>(wrow);
            nibbles(&blk[b].qs, two.then(|| &blk[b + 1].qs))
        }
        QuantFormat::Q4_1 => {
            let blk = cast::<BlockQ4_1>(wrow);
            nibbles(&blk[b].qs, two.then(|| &blk[b + 1].qs))
        }
        QuantFormat::Q5_0 => {
            let blk = cast::<BlockQ5_0>(wrow);
            let (a, c) = (&blk[b], two.then(|| &blk[b + 1]));
            with_fifth_bits(nibbles(&a.qs, c.map(|c| &c.qs)), a.qh, c.map(|c| c.qh))
        }
        QuantFormat::Q5_1 => {
            let blk = cast::<BlockQ5_1>(wrow);
            let (a, c) = (&blk[b], two.then(|| &blk[b + 1]));
            with_fifth_bits(nibbles(&a.qs, c.map(|c| &c.qs)), a.qh, c.map(|c| c.qh))
        }
        QuantFormat::Q8_0 => {
            let blk = cast::<BlockQ8_0>(wrow);
            // SAFETY: 32 bytes from each 32-byte array.
            let ya = unsafe { _mm256_loadu_si256(blk[b].qs.as_ptr().cast()) };
            let bias = _mm256_set1_epi8(-128);
            // w + 128 as unsigned bytes (an absent second block: zeros).
            let za = _mm512_zextsi256_si512(_mm256_xor_si256(ya, bias));
            if two {
                // SAFETY: as above.
                let yb = unsafe { _mm256_loadu_si256(blk[b + 1].qs.as_ptr().cast()) };
                _mm512_inserti64x4::<1>(za, _mm256_xor_si256(yb, bias))
            } else {
                za
            }
        }
        _ => unreachable!("unsigned_pair called for {format:?}"),
    }
}

/// The nibbles `v` of two 5-bit blocks with their fifth bits (`qh` of the
/// first block, and of the second if present) added as 16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn with_fifth_bits(v: __m512i, qa: [u8; 4], qb: Option<[u8; 4]>) -> __m512i {
    let hbits = u32::from_le_bytes(qa) as u64 | (qb.map_or(0, u32::from_le_bytes) as u64) << 32;
    _mm512_mask_add_epi8(v, hbits, v, _mm512_set1_epi8(16))
}

/// The exact lanes of blocks `b`, `b + 1` of a `WHOLE_BLOCK[F]` row ×
/// rows `t0..t0 + R` (a const format, so that [`unsigned_pair`]'s `match`
/// folds and it inlines: with a run-time format it did not, and the
/// vectors went through memory): per row,
/// lanes 0..8 of block `b` (4 products each) and lanes 8..16 of `b + 1`,
/// with the unsigned values of [`unsigned_pair`] (for the signed formats,
/// sums of `(w + off)·x`). Only the first `n` (≤ 2) blocks are read; the
/// others are zeros.
///
/// # Safety
/// Rows `t0..t0 + R` exist in `act`; blocks `b..b + min(n, 2)` exist.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn pair_lanes<const R: usize, const F: usize>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    b: usize,
    n: usize,
) -> [__m512i; R] {
    let z = _mm512_setzero_si512();
    if n == 0 {
        return [z; R];
    }
    let two = n > 1;
    let u = unsigned_pair(WHOLE_BLOCK[F], wrow, b, two);
    let cols = act.cols;
    std::array::from_fn(|r| {
        // SAFETY: row t0 + r < m and block b (and b + 1 if `two`) < nb:
        // the 64 (32) bytes read are inside the row's values.
        let x = unsafe {
            let xp = act.qs.as_ptr().add((t0 + r) * cols + b * QK);
            if two {
                _mm512_loadu_si512(xp.cast())
            } else {
                _mm512_zextsi256_si512(_mm256_loadu_si256(xp.cast()))
            }
        };
        _mm512_dpbusd_epi32(z, u, x)
    })
}

/// First level of the block reduction: per 128-bit quarter,
/// `[a0+a2, b0+b2, a1+a3, b1+b3]` (exact).
#[inline]
#[target_feature(enable = "avx512f")]
fn fold32(a: __m512i, b: __m512i) -> __m512i {
    _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
}

/// Second level: per 128-bit quarter, `[Σa, Σb, Σc, Σd]` of that quarter
/// of the four vectors folded into `ab` and `cd` by [`fold32`] (exact).
#[inline]
#[target_feature(enable = "avx512f")]
fn fold64(ab: __m512i, cd: __m512i) -> __m512i {
    _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd))
}

/// Blocks `b..b + 8` (4 pairs; only the first `n` read, the others zeros)
/// × rows: per row, quarter q of the result holds, in lane i, the sum of
/// quarter q of pair i's lanes.
///
/// # Safety
/// Rows `t0..t0 + R` exist in `act`; blocks `b..b + min(n, 8)` exist.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn quad_lanes<const R: usize, const F: usize>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    b: usize,
    n: usize,
) -> [__m512i; R] {
    let left = |i: usize| n.saturating_sub(2 * i).min(2);
    // SAFETY: the caller's contract.
    unsafe {
        let p0 = pair_lanes::<R, F>(wrow, act, t0, b, left(0));
        let p1 = pair_lanes::<R, F>(wrow, act, t0, b + 2, left(1));
        let f01: [__m512i; R] = std::array::from_fn(|r| fold32(p0[r], p1[r]));
        let p2 = pair_lanes::<R, F>(wrow, act, t0, b + 4, left(2));
        let p3 = pair_lanes::<R, F>(wrow, act, t0, b + 6, left(3));
        std::array::from_fn(|r| fold64(f01[r], fold32(p2[r], p3[r])))
    }
}

/// The 16 per-block sums of blocks `b..b + 16` of a row from the two
/// [`quad_lanes`] of blocks `b..b + 8` and `b + 8..b + 16`: lane j = the
/// exact `s` of block `b + j`.
#[inline]
#[target_feature(enable = "avx512f")]
fn block_sums(lo: __m512i, hi: __m512i) -> __m512i {
    // Quarters [lo.0 + lo.1, lo.2 + lo.3, hi.0 + hi.1, hi.2 + hi.3]: blocks
    // 0 2 4 6 | 1 3 5 7 | 8 10 12 14 | 9 11 13 15.
    let s = _mm512_add_epi32(
        _mm512_shuffle_i32x4::<0b10_00_10_00>(lo, hi),
        _mm512_shuffle_i32x4::<0b11_01_11_01>(lo, hi),
    );
    let order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    _mm512_permutexvar_epi32(order, s)
}

/// The scales and offsets `(dw, mw)` of the blocks `b + j` for the lanes j
/// of `k` (the other lanes, and `mw` of a signed format: zeros), f16 → f32
/// with F16C (exact, as the scalar path). Every block of these formats
/// starts with `d` (Q4_1/Q5_1: then `m`), 4 bytes that one gather lane
/// reads.
///
/// # Safety
/// The blocks of the lanes of `k` exist in `wrow`.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn block_scales(
    format: QuantFormat,
    wrow: &[u8],
    b: usize,
    k: __mmask16,
) -> (__m512, __m512) {
    let bsz = format.block_bytes() as i32;
    let offs = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(bsz),
    );
    // SAFETY: the lanes of `k` read 4 bytes at the start of their block
    // (every block is at least 18 bytes).
    let g = unsafe {
        _mm512_mask_i32gather_epi32::<1>(
            _mm512_setzero_si512(),
            k,
            offs,
            wrow.as_ptr().add(b * bsz as usize).cast(),
        )
    };
    let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    let m = if has_offset(format) {
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(g)))
    } else {
        _mm512_setzero_ps()
    };
    (d, m)
}

/// The float step of blocks `b..b + 16` (lanes of `k`) of row `row`, from
/// their exact sums `s` (for a signed format, of the unsigned weights: the
/// activation's [`Act::corr`] is added first) and the weights' `(dw, mw)`:
/// [`combine::block_step`] or [`combine::min_block_step`] for the blocks
/// as the lanes of one vector (lanes outside `k` unchanged).
///
/// # Safety
/// Blocks `b + j` of row `row` exist in `act` for the lanes j of `k`;
/// `act.corr` is built (signed formats) or `act.xs` (offset formats).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn block_step16(
    format: QuantFormat,
    act: &Act,
    row: usize,
    b: usize,
    k: __mmask16,
    s: __m512i,
    (dw, mw): (__m512, __m512),
    acc: __m512,
) -> __m512 {
    let at = row * act.nb + b;
    // SAFETY: the masked loads read blocks b + j of the row for j in `k`.
    unsafe {
        let dx = _mm512_maskz_loadu_ps(k, act.d.as_ptr().add(at));
        let p = if has_offset(format) {
            let xs = _mm512_maskz_loadu_ps(k, act.xs.as_ptr().add(at));
            let s = _mm512_cvtepi32_ps(s);
            _mm512_add_ps(
                _mm512_mul_ps(_mm512_mul_ps(dw, dx), s),
                _mm512_mul_ps(mw, xs),
            )
        } else {
            // Σ (w + off)·x − off·Σ x = Σ w·x, exact.
            let c = _mm512_maskz_loadu_epi32(k, act.corr.as_ptr().add(at));
            let s = _mm512_cvtepi32_ps(_mm512_add_epi32(s, c));
            _mm512_mul_ps(_mm512_mul_ps(dw, dx), s)
        };
        _mm512_mask_add_ps(acc, k, acc, p)
    }
}

/// Blocks `b..b + n` (n ≤ 16; `FULL`: 16) × rows `t0..t0 + R`: the exact
/// sum of every block and row (one vector per row, lane j = block `b + j`),
/// then [`block_step16`].
///
/// # Safety
/// Rows `t0..t0 + R` exist in `act`; blocks `b..b + n` exist.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block_group<const R: usize, const F: usize, const FULL: bool>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    b: usize,
    n: usize,
    acc: &mut [__m512; R],
) {
    let format = WHOLE_BLOCK[F];
    let n = if FULL { combine::BLOCK_LANES } else { n };
    let k: __mmask16 = (u32::MAX >> (32 - n)) as u16;
    // SAFETY (all calls): blocks b..b + n exist; the caller's contract.
    unsafe {
        let lo = quad_lanes::<R, F>(wrow, act, t0, b, n);
        let hi = quad_lanes::<R, F>(wrow, act, t0, b + 8, n.saturating_sub(8));
        let scales = block_scales(format, wrow, b, k);
        for (r, acc) in acc.iter_mut().enumerate() {
            let s = block_sums(lo[r], hi[r]);
            *acc = block_step16(format, act, t0 + r, b, k, s, scales, *acc);
        }
    }
}

/// Weight row of format `WHOLE_BLOCK[F]` × activation rows `t0..t0 + R`:
/// per 16 blocks [`block_group`] (block `b` in lane `b % 16`), then
/// [`combine::reduce16`].
///
/// # Safety
/// CPU features as enabled; rows `t0..t0 + R` exist in `act` (Q8_0 with
/// `Act::prepare_unsigned`, or Q8_1) and `wrow` has `act.nb` blocks.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block_rows_of<const R: usize, const F: usize>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    let nb = act.nb;
    let mut acc = [_mm512_setzero_ps(); R];
    let bsz = WHOLE_BLOCK[F].block_bytes();
    let mut b = 0;
    // SAFETY (all calls): blocks inside `nb`; the caller's contract.
    unsafe {
        while b + combine::BLOCK_LANES <= nb {
            prefetch_ahead::<6>(wrow.as_ptr().wrapping_add(b * bsz));
            if combine::BLOCK_LANES * bsz > 384 {
                // Q8_0: 16 blocks are 544 bytes.
                prefetch_ahead::<3>(wrow.as_ptr().wrapping_add(b * bsz + 384));
            }
            block_group::<R, F, true>(wrow, act, t0, b, 0, &mut acc);
            b += combine::BLOCK_LANES;
        }
        if b < nb {
            block_group::<R, F, false>(wrow, act, t0, b, nb - b, &mut acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let mut a = [0f32; combine::BLOCK_LANES];
        // SAFETY: 16 floats into [f32; 16].
        unsafe { _mm512_storeu_ps(a.as_mut_ptr(), *acc) };
        res[r] = combine::reduce16(&a);
    }
}

/// F16 or BF16 weight row × a tile of `tn` f32 rows, in passes of up to
/// [`MAX_R_HALF`] rows (one 16-lane accumulator each).
///
/// # Safety
/// AVX-512 F/BW; rows `t0..t0 + tn` exist in `act`.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn row_half(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    passes!(MAX_R_HALF, half_rows, format, wrow, act, t0, tn, res; 1 2 3 4 5 6 7; 8)
}

/// F16 or BF16 weight row × f32 rows `t0..t0 + R`: `scalar::row_float`'s
/// 16 lanes, the last partial chunk lane by lane, then
/// [`combine::reduce16`].
///
/// # Safety
/// CPU features; rows `t0..t0 + R` exist in `act`; `res.len() >= R`.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn half_rows<const R: usize>(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    let cols = act.cols;
    let full = cols / combine::F_LANES;
    let mut acc = [_mm512_setzero_ps(); R];
    let wp = wrow.as_ptr();
    let f16 = format == QuantFormat::F16;
    for c in 0..full {
        let e = c * combine::F_LANES;
        prefetch_ahead::<1>(wp.wrapping_add(2 * e));
        // SAFETY: elements e..e + 16 ≤ cols of the row (2 bytes each).
        // Both widenings are exact: f16 → f32 by `vcvtph2ps`, bf16 → f32 a
        // 16-bit shift.
        let w = unsafe {
            let h = _mm256_loadu_si256(wp.add(2 * e).cast());
            if f16 {
                _mm512_cvtph_ps(h)
            } else {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
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
            a[k] += super::scalar::widen(format, w) * x;
        }
        res[r] = combine::reduce16(&a);
    }
}
