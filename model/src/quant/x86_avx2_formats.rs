//! AVX2 kernels of the whole-block formats (Q4_0/Q5_0/Q5_0x4/Q8_0 and the
//! offset formats Q4_1/Q5_1) and of F16/BF16 weights (the K-quants
//! Q3_K/Q5_K share the Q6_K/Q4_K kernels of `x86_avx2`).
//!
//! Same integer sums and the same float steps as the scalar reference:
//! - Q4_0/Q5_0/Q5_0x4/Q8_0/Q4_1/Q5_1: per block and row 16 exact i16 lanes
//!   of 2 products (`maddubs` of unsigned values: Q4_1/Q5_1 as stored,
//!   Q4_0/Q5_0/Q5_0x4 as `w + off`; Q8_0 with the sign trick), reduced per
//!   8 blocks by a `hadd` tree to one exact sum per block (lane j = block
//!   `b + j`; the unsigned-offset formats then add the activation's
//!   `−off·Σ32 x`, giving `s = Σ w·x`), then [`combine::block_step`]
//!   (`acc += (dw·dx)·s`) or [`combine::min_block_step`] (`acc += (dw·dx)·s
//!   + mw·xs`) for the 8 blocks as lanes (block `b` in lane `b % 16` of two
//!   8-lane accumulators), reduced by [`combine::reduce16`];
//! - F16/BF16: the portable 16-lane f32 dot of `scalar::row_float`
//!   (separate multiply and add per lane, [`combine::reduce16`]), the
//!   weights widened exactly (F16C's `vcvtph2ps`; a shift for BF16).

use std::arch::x86_64::*;

use super::act::Act;
use super::blocks::{cast, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_0x4, BlockQ5_1, BlockQ8_0, QK};
use super::combine;
use super::common::prefetch_ahead;
use super::types::{QuantFormat, TILE, WHOLE_BLOCK};

/// Activation rows per pass of the whole-block kernel ([`row_block`]; each
/// row holds a 16-lane accumulator and a partial reduction tree in
/// registers).
const MAX_R_GROUP: usize = 2;
/// Rows per pass of the BF16 kernel (two 8-lane accumulators each).
const MAX_R_FLOAT: usize = 4;

/// Q4_0/Q5_0/Q5_0x4/Q8_0 (Q8_0 activations; with `Act::prepare_unsigned`
/// but for Q8_0) or Q4_1/Q5_1 (Q8_1) weight row × a tile of `tn` rows, in
/// passes of up to [`MAX_R_GROUP`] rows with register accumulators (the
/// weight row stays in L1 for the later passes).
///
/// # Safety
/// AVX2 and F16C; rows `t0..t0 + tn` exist in `act`.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn row_block(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    passes!(MAX_R_GROUP, block_rows, format, wrow, act, t0, tn, res; 1; 2)
}

/// [`block_rows_of`] for `format`.
///
/// # Safety
/// As [`block_rows_of`].
#[inline]
#[target_feature(enable = "avx2,f16c")]
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

/// Nibbles of 16 bytes, low ones then high ones (elements 0..32 of a
/// Q4_0/Q4_1/Q5_0/Q5_1 block), as bytes 0..16.
#[inline]
#[target_feature(enable = "avx2")]
fn nibbles(qs: &[u8; 16]) -> __m256i {
    // SAFETY: 16 bytes read from a 16-byte array.
    let q = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16::<4>(q), q),
        _mm256_set1_epi8(0xF),
    )
}

/// `v` with the fifth bits of a Q5_0/Q5_1 block (`qh`) or'ed in as 16.
#[inline]
#[target_feature(enable = "avx2")]
fn with_fifth_bits(v: __m256i, qh: [u8; 4]) -> __m256i {
    let hb = _mm256_and_si256(
        bytes_from_bits_32(u32::from_le_bytes(qh)),
        _mm256_set1_epi8(0x10),
    );
    _mm256_or_si256(v, hb)
}

/// The values of blocks `b..b + 4` (the first `n`; the others: zeros)
/// as the first operand of `maddubs`: unsigned bytes (Q4_1/Q5_1 as stored,
/// Q4_0/Q5_0/Q5_0x4 as `w + off`, `off` = 8, 16), or for Q8_0 the signed
/// values themselves ([`block_lanes`] takes their magnitudes). For
/// Q5_0x4, `b` is a multiple of 4 (a group).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn quad_values(format: QuantFormat, wrow: &[u8], b: usize, n: usize) -> [__m256i; 4] {
    if format == QuantFormat::Q5_0x4 {
        if n == 0 {
            return [_mm256_setzero_si256(); 4];
        }
        return q5x4_values(&cast::<BlockQ5_0x4>(wrow)[b / 4]);
    }
    // Plain loops, not `array::from_fn` closures: a closure is no
    // `target_feature` function, did not inline, and sent every vector
    // through memory (AVX2 whole-block rows at 0.2 of Q4_K's speed).
    let mut v = [_mm256_setzero_si256(); 4];
    for (i, v) in v.iter_mut().enumerate().take(n.min(4)) {
        let b = b + i;
        *v = match format {
            QuantFormat::Q4_0 => nibbles(&cast::<BlockQ4_0>(wrow)[b].qs),
            QuantFormat::Q4_1 => nibbles(&cast::<BlockQ4_1>(wrow)[b].qs),
            QuantFormat::Q5_0 => {
                let blk = &cast::<BlockQ5_0>(wrow)[b];
                with_fifth_bits(nibbles(&blk.qs), blk.qh)
            }
            QuantFormat::Q5_1 => {
                let blk = &cast::<BlockQ5_1>(wrow)[b];
                with_fifth_bits(nibbles(&blk.qs), blk.qh)
            }
            // SAFETY: 32 bytes read from a 32-byte array.
            _ => unsafe { _mm256_loadu_si256(cast::<BlockQ8_0>(wrow)[b].qs.as_ptr().cast()) },
        };
    }
    v
}

/// The four blocks of a Q5_0x4 group as unsigned bytes `w + 16` in 0..32
/// (element order): per block one mask (or shift and mask) of the nibbles
/// and one shift and mask of the fifth bits, instead of
/// [`bytes_from_bits_32`].
#[inline]
#[target_feature(enable = "avx2")]
fn q5x4_values(g: &BlockQ5_0x4) -> [__m256i; 4] {
    // SAFETY: reads within the 88-byte group (qh: 16 bytes, qs: 64).
    let (qh, q01, q23) = unsafe {
        (
            _mm_loadu_si128(g.qh.as_ptr().cast()),
            _mm256_loadu_si256(g.qs.as_ptr().cast()),
            _mm256_loadu_si256(g.qs.as_ptr().add(32).cast()),
        )
    };
    // Byte j of `hv`: the fifth bits of element j of blocks 0..4 in bits 0..4
    // (bytes 16..32 from the high nibbles of `qh`; bits 4..8 are not used).
    let hv = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(qh), _mm_srli_epi16::<4>(qh));
    // Block i: its nibbles, or'ed with bit i of `hv` shifted up to bit 4
    // (16-bit shifts: bit 4 of each byte comes from the same byte).
    [
        q5_value(q01, _mm256_slli_epi16::<4>(hv)),
        q5_value(_mm256_srli_epi16::<4>(q01), _mm256_slli_epi16::<3>(hv)),
        q5_value(q23, _mm256_slli_epi16::<2>(hv)),
        q5_value(_mm256_srli_epi16::<4>(q23), _mm256_slli_epi16::<1>(hv)),
    ]
}

/// `(nibbles & 0xF) | (fifth & 0x10)` byte by byte: a Q5_0 value in 0..32.
#[inline]
#[target_feature(enable = "avx2")]
fn q5_value(nibbles: __m256i, fifth: __m256i) -> __m256i {
    _mm256_or_si256(
        _mm256_and_si256(nibbles, _mm256_set1_epi8(0xF)),
        _mm256_and_si256(fifth, _mm256_set1_epi8(0x10)),
    )
}

/// The 16 exact i16 lanes (2 products each) of one block (`v`, from
/// [`quad_values`]) × the activation values at `xp`: `maddubs(v, x)`, for
/// Q8_0 `maddubs(|v|, sign(x, v))`.
///
/// # Safety
/// 32 readable bytes at `xp`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn block_lanes(format: QuantFormat, v: __m256i, xp: *const i8) -> __m256i {
    // SAFETY: the caller's contract.
    let x = unsafe { _mm256_loadu_si256(xp.cast()) };
    if format == QuantFormat::Q8_0 {
        // |v| ≤ 128, |x| ≤ 127: a pair sums to at most 32512.
        _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(x, v))
    } else {
        // v ≤ 31, |x| ≤ 127: a pair sums to at most 7874.
        _mm256_maddubs_epi16(v, x)
    }
}

/// Blocks `b..b + 4` of a `WHOLE_BLOCK[F]` row (a const format, so that
/// every `match` on it folds) × rows: per row and 128-bit half h, lane i = the sum
/// of half h of block `b + i`'s lanes (exact; the sums of `(w + off)·x`
/// for the unsigned-offset formats); blocks from `b + n` on are zeros.
///
/// # Safety
/// Rows `t0..t0 + R` exist in `act`; blocks `b..b + min(n, 4)` exist.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn quad_lanes<const R: usize, const F: usize>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    b: usize,
    n: usize,
) -> [__m256i; R] {
    let format = WHOLE_BLOCK[F];
    let n = n.min(4);
    let v = quad_values(format, wrow, b, n);
    let z = _mm256_setzero_si256();
    let mut out = [z; R];
    for (r, out) in out.iter_mut().enumerate() {
        let xp = act.qs.as_ptr().wrapping_add((t0 + r) * act.cols + b * QK);
        let mut l = [z; 4];
        for (i, l) in l.iter_mut().enumerate().take(n) {
            // SAFETY: blocks b + i < b + n exist in row t0 + r < m: 32
            // bytes inside its values.
            *l = unsafe { block_lanes(format, v[i], xp.wrapping_add(i * QK)) };
        }
        // Then one i32 `hadd` of two such pairs: per half, lane i = block b + i.
        *out = _mm256_hadd_epi32(
            pair_lanes(format, l[0], l[1]),
            pair_lanes(format, l[2], l[3]),
        );
    }
    out
}

/// Two blocks' i16 lanes (from [`block_lanes`]) to i32, per 128-bit half
/// 2 lanes of each block: summed in pairs first where that is exact (≤ 2 ·
/// 7874), else (Q8_0) widened first.
#[inline]
#[target_feature(enable = "avx2")]
fn pair_lanes(format: QuantFormat, a: __m256i, c: __m256i) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    if format == QuantFormat::Q8_0 {
        _mm256_hadd_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(c, ones))
    } else {
        _mm256_madd_epi16(_mm256_hadd_epi16(a, c), ones)
    }
}

/// The f16 scale of block `b` (bits 0..16) and, for Q4_1/Q5_1, its offset
/// (bits 16..32) as one word. Every block but Q5_0x4's starts with them;
/// a Q5_0x4 group starts with its four scales.
///
/// # Safety
/// Block `b` exists in `wrow`.
#[inline]
unsafe fn scale_word(format: QuantFormat, wrow: &[u8], b: usize) -> i32 {
    let at = if format == QuantFormat::Q5_0x4 {
        (b / 4) * format.block_bytes() + 2 * (b % 4)
    } else {
        b * format.block_bytes()
    };
    // SAFETY: 4 bytes of the block (or group), which has at least 18.
    unsafe { wrow.as_ptr().add(at).cast::<i32>().read_unaligned() }
}

/// The scales and offsets `(dw, mw)` of blocks `b..b + n` (n ≤ 8; the
/// other lanes, and `mw` of a signed format: zeros), f16 → f32 with F16C
/// (exact, as the scalar path).
///
/// # Safety
/// Blocks `b..b + n` exist in `wrow`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn block_scales(format: QuantFormat, wrow: &[u8], b: usize, n: usize) -> (__m256, __m256) {
    // SAFETY: blocks b + i < b + n exist.
    let head = |i: usize| {
        if i < n {
            unsafe { scale_word(format, wrow, b + i) }
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
    let d = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    if matches!(format, QuantFormat::Q4_1 | QuantFormat::Q5_1) {
        (d, _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(dm)))
    } else {
        (d, _mm256_setzero_ps())
    }
}

/// Blocks `b..end` (≤ 8; `FULL`: exactly 8) of format `WHOLE_BLOCK[F]` ×
/// rows `t0..t0 + R`: the exact sum of every block and row (lane j =
/// block `b + j`; for the unsigned-offset formats corrected by the
/// activation's `−off·Σ32 x`), then [`combine::block_step`] (`acc +=
/// (dw·dx)·s`) or [`combine::min_block_step`] (`acc += (dw·dx)·s + mw·xs`)
/// for the blocks as lanes into `acc` (lanes past `end` add +0.0, all
/// their factors being zero, which leaves them unchanged: an accumulator
/// that starts at +0.0 never becomes −0.0).
///
/// # Safety
/// Rows `t0..t0 + R` exist in `act`; `end` ≤ `act.nb`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn block_octet<const R: usize, const F: usize, const FULL: bool>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    b: usize,
    end: usize,
    acc: &mut [__m256; R],
) {
    let format = WHOLE_BLOCK[F];
    let nb = act.nb;
    let n = if FULL { 8 } else { end - b };
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let k = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lane);
    // Lanes of blocks b..end (the others load as zeros).
    let load_ps = |p: *const f32| {
        // SAFETY: the caller's contract; the mask reads blocks b..end only.
        unsafe {
            if FULL {
                _mm256_loadu_ps(p)
            } else {
                _mm256_maskload_ps(p, k)
            }
        }
    };
    // SAFETY (all calls): blocks b..b + n exist; the caller's contract.
    unsafe {
        let lo = quad_lanes::<R, F>(wrow, act, t0, b, n);
        let hi = quad_lanes::<R, F>(wrow, act, t0, b + 4, n.saturating_sub(4));
        let (dw, mw) = block_scales(format, wrow, b, n);
        for (r, acc) in acc.iter_mut().enumerate() {
            let at = (t0 + r) * nb + b;
            let dx = load_ps(act.d.as_ptr().add(at));
            // [blocks 0..4 low halves | 4..8 low halves] + high halves.
            let s = _mm256_add_epi32(
                _mm256_permute2x128_si256::<0x20>(lo[r], hi[r]),
                _mm256_permute2x128_si256::<0x31>(lo[r], hi[r]),
            );
            let p = match format {
                QuantFormat::Q4_1 | QuantFormat::Q5_1 => _mm256_add_ps(
                    _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(s)),
                    _mm256_mul_ps(mw, load_ps(act.xs.as_ptr().add(at))),
                ),
                QuantFormat::Q8_0 => _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(s)),
                _ => {
                    // Σ (w + off)·x − off·Σ x = Σ w·x, exact.
                    let c = _mm256_castps_si256(load_ps(act.corr.as_ptr().add(at).cast()));
                    let s = _mm256_add_epi32(s, c);
                    _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(s))
                }
            };
            *acc = _mm256_add_ps(*acc, p);
        }
    }
}

/// Weight row of format `WHOLE_BLOCK[F]` × activation rows `t0..t0 + R`:
/// per 8 blocks [`block_octet`]; block `b` in lane `b % 16` of the row's
/// 16-lane accumulator (`lo` lanes 0..8, `hi` lanes 8..16), then
/// [`combine::reduce16`].
///
/// # Safety
/// CPU features; rows `t0..t0 + R` exist in `act`; `res.len() >= R`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn block_rows_of<const R: usize, const F: usize>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    res: &mut [f32],
) {
    let format = WHOLE_BLOCK[F];
    let nb = act.nb;
    let mut lo = [_mm256_setzero_ps(); R];
    let mut hi = [_mm256_setzero_ps(); R];
    // Bytes of 8 blocks (a Q5_0x4 group holds 4).
    let octet = 8 * format.block_bytes() / (format.block_elems() / QK);
    let mut b = 0;
    // SAFETY (all calls): block ranges inside `nb`; the caller's contract.
    unsafe {
        while b + combine::BLOCK_LANES <= nb {
            let at = wrow.as_ptr().wrapping_add(b / 8 * octet);
            prefetch_ahead::<3>(at);
            if octet > 192 {
                prefetch_ahead::<2>(at.wrapping_add(192));
            }
            block_octet::<R, F, true>(wrow, act, t0, b, 0, &mut lo);
            prefetch_ahead::<3>(at.wrapping_add(octet));
            if octet > 192 {
                prefetch_ahead::<2>(at.wrapping_add(octet + 192));
            }
            block_octet::<R, F, true>(wrow, act, t0, b + 8, 0, &mut hi);
            b += combine::BLOCK_LANES;
        }
        if b < nb {
            block_octet::<R, F, false>(wrow, act, t0, b, nb.min(b + 8), &mut lo);
        }
        if b + 8 < nb {
            block_octet::<R, F, false>(wrow, act, t0, b + 8, nb, &mut hi);
        }
    }
    for r in 0..R {
        let mut a = [0f32; combine::BLOCK_LANES];
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
