//! Activation rows quantized once per input (`matmul`, or `matmul_shared` for
//! Q/K/V and gate/up), the way llama.cpp does:
//! Q8_0 (blocks of 32, for Q4_0/Q5_0/Q8_0 weights), Q8_1 (Q8_0 plus offset
//! terms, for Q4_1/Q5_1) or Q8_K (blocks of 256 with 16-element sums, for
//! Q3_K/Q4_K/Q5_K/Q6_K weights).
//!
//! Quantization is shared by every instruction-set path, so the quantized
//! activations (and hence the integer dot products) are the same whichever
//! kernel consumes them. It runs as AVX2 code when the CPU has AVX2 (whatever
//! `TANDEM_ISA` says) and as the scalar reference otherwise; both give the same
//! bits (test `avx2_quantizers_give_the_scalar_bits`). Rows are independent,
//! so a large input is quantized row-parallel (same bits: each row's code is
//! the same).

use super::blocks::{QK, QK_K};
use rayon::prelude::*;

/// From this many input values up, rows are quantized in parallel (a block of
/// 17 rows of the 1.5B's 8960-wide FFN input is 152k; one decode row of 1536
/// stays on the calling thread).
const PARALLEL_VALUES: usize = 16 * 1024;

/// Which activation format a weight format pairs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActKind {
    /// No quantization: f32 rows are used as they are.
    F32,
    /// Blocks of 32: `x ≈ d * q`, |q| ≤ 127.
    Q8_0,
    /// Blocks of 256: `x ≈ d * q`, |q| ≤ 127, plus sums of each 16 `q`.
    Q8K,
    /// [`ActKind::Q8_0`] plus, per block, `d · Σ32 q` as f32 ([`Act::xs`];
    /// the offset term of Q4_1/Q5_1 weights, llama.cpp's Q8_1 block sum).
    Q8_1,
}

/// `m` quantized activation rows of `cols` elements (structure of arrays).
pub struct Act<'x> {
    /// rows (read by the x86 kernels)
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub m: usize,
    pub cols: usize,
    /// blocks per row
    pub nb: usize,
    /// the f32 rows (used directly by F32/F16 weights)
    pub x: &'x [f32],
    /// `m * cols` quantized values
    pub qs: Vec<i8>,
    /// one scale per block: `m * cols / block`
    pub d: Vec<f32>,
    /// Q8K only: 16 sums of 16 values per block: `m * cols / 16`
    pub bsums: Vec<i16>,
    /// Q8_1 only: per block, `d_b · (Σ of its 32 q, as f32)` (the integer
    /// sum is exact, one rounding in the product), `m * nb`, indexed as `d`.
    pub xs: Vec<f32>,
    /// Q8K only: the block scales transposed, `dt[sb * m + t] = d[t * nb + sb]`
    /// (the scales of all rows for one super-block, side by side).
    pub dt: Vec<f32>,
    /// Q8_0, built on request by [`Act::prepare_unsigned`]: per block,
    /// `−off · Σ32 x` (`m * nb`, indexed as `d`), the correction that turns
    /// a block's sum with unsigned weights `w + off` into its sum with `w`
    /// (exact integers).
    pub corr: Vec<i32>,
    /// Q8K, built by [`Act::prepare_bsum4`] (the AVX2 Q4_K tiles): the sums
    /// of 32 values of each group of 4 rows, 32 per super-block, laid out so
    /// that one `madd` with a pair of mins gives that pair's term of M for the
    /// 4 rows: index `((g·nb + sb)·2 + h)·16 + q·8 + r·2 + k` holds the sum of
    /// 32-chunk `4h + 2q + k` of row `4g + r` (rows from `m` on: 0).
    #[cfg(target_arch = "x86_64")]
    pub bsum4: Vec<i16>,
    /// Q8_0 or Q8_1, built by the AVX-512 GEMM path (`x86_avx512_gemm`, large m):
    /// the values of each row regrouped so that one 32-bit lane holds four
    /// values of one block and a group of 16 blocks is 8 vectors of 16
    /// lanes (lane i = block i), rows `x86_avx512_gemm::Groups::stride`
    /// bytes apart. The same values, moved.
    #[cfg(target_arch = "x86_64")]
    pub qt: Vec<i8>,
}

impl<'x> Act<'x> {
    pub fn new(kind: ActKind, x: &'x [f32], m: usize, cols: usize) -> Self {
        debug_assert_eq!(x.len(), m * cols);
        let nb = match kind {
            ActKind::F32 => 0,
            ActKind::Q8_0 | ActKind::Q8_1 => cols / QK,
            ActKind::Q8K => cols / QK_K,
        };
        let mut a = Act {
            m,
            cols,
            nb,
            x,
            qs: Vec::new(),
            d: Vec::new(),
            bsums: Vec::new(),
            xs: Vec::new(),
            dt: Vec::new(),
            corr: Vec::new(),
            #[cfg(target_arch = "x86_64")]
            bsum4: Vec::new(),
            #[cfg(target_arch = "x86_64")]
            qt: Vec::new(),
        };
        // Rows per parallel task: all of them (one task, the calling thread)
        // below `PARALLEL_VALUES`.
        let min_rows = if m * cols >= PARALLEL_VALUES {
            1
        } else {
            m.max(1)
        };
        match kind {
            ActKind::F32 => {}
            ActKind::Q8_0 | ActKind::Q8_1 => {
                a.qs = vec![0; m * cols];
                a.d = vec![0.0; m * cols / QK];
                let row = |((x, q), d)| quantize_q8_0_row(x, q, d);
                let rows = x
                    .par_chunks_exact(cols)
                    .zip(a.qs.par_chunks_exact_mut(cols))
                    .zip(a.d.par_chunks_exact_mut(nb));
                rows.with_min_len(min_rows).for_each(row);
                if kind == ActKind::Q8_1 {
                    a.xs =
                        a.qs.chunks_exact(QK)
                            .zip(&a.d)
                            .map(|(c, &d)| d * c.iter().map(|&v| v as i32).sum::<i32>() as f32)
                            .collect();
                }
            }
            ActKind::Q8K => {
                a.qs = vec![0; m * cols];
                a.d = vec![0.0; m * cols / QK_K];
                a.bsums = vec![0; m * cols / 16];
                let row = |(((x, q), d), s)| quantize_q8k_row(x, q, d, s);
                let rows = x
                    .par_chunks_exact(cols)
                    .zip(a.qs.par_chunks_exact_mut(cols))
                    .zip(a.d.par_chunks_exact_mut(nb))
                    .zip(a.bsums.par_chunks_exact_mut(cols / 16));
                rows.with_min_len(min_rows).for_each(row);
                a.dt = (0..nb * m).map(|i| a.d[(i % m) * nb + i / m]).collect();
            }
        }
        a
    }

    /// Build [`Act::corr`] for kernels that multiply unsigned weights
    /// `w + off` (exact integer arithmetic).
    pub fn prepare_unsigned(&mut self, off: i32) {
        self.corr = self
            .qs
            .chunks_exact(QK)
            .map(|c| -off * c.iter().map(|&v| v as i32).sum::<i32>())
            .collect();
    }

    /// Build [`Act::bsum4`] from the 16-value sums (Q8K). Exact: a 32-value
    /// sum of values in [-128, 127] fits an i16.
    #[cfg(target_arch = "x86_64")]
    pub fn prepare_bsum4(&mut self) {
        let (m, nb) = (self.m, self.nb);
        let mut v = vec![0i16; m.div_ceil(4) * nb * 32];
        for t in 0..m {
            let (g, r) = (t / 4, t % 4);
            for sb in 0..nb {
                let bs = &self.bsums[(t * nb + sb) * 16..][..16];
                for j in 0..8 {
                    let (h, q, k) = (j / 4, (j / 2) % 2, j % 2);
                    v[((g * nb + sb) * 2 + h) * 16 + q * 8 + r * 2 + k] = bs[2 * j] + bs[2 * j + 1];
                }
            }
        }
        self.bsum4 = v;
    }

    /// Quantized values of row `t`.
    #[inline(always)]
    pub fn row_qs(&self, t: usize) -> &[i8] {
        &self.qs[t * self.cols..(t + 1) * self.cols]
    }

    /// Block scales of row `t`.
    #[inline(always)]
    pub fn row_d(&self, t: usize) -> &[f32] {
        &self.d[t * self.nb..(t + 1) * self.nb]
    }

    /// 16-element sums of row `t` (Q8K).
    #[inline(always)]
    pub fn row_bsums(&self, t: usize) -> &[i16] {
        let n = self.cols / 16;
        &self.bsums[t * n..(t + 1) * n]
    }

    /// Per-block offset terms of row `t` (Q8_1).
    #[inline(always)]
    pub fn row_xs(&self, t: usize) -> &[f32] {
        &self.xs[t * self.nb..(t + 1) * self.nb]
    }

    /// f32 values of row `t`.
    #[inline(always)]
    pub fn row_x(&self, t: usize) -> &[f32] {
        &self.x[t * self.cols..(t + 1) * self.cols]
    }
}

/// One activation row in Q8_0 blocks.
fn quantize_q8_0_row(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    for ((x, q), d) in x.chunks_exact(QK).zip(q.chunks_exact_mut(QK)).zip(d) {
        *d = quantize_q8_0(x, q);
    }
}

/// One activation row in Q8_K blocks.
fn quantize_q8k_row(x: &[f32], q: &mut [i8], d: &mut [f32], sums: &mut [i16]) {
    for (((x, q), d), s) in x
        .chunks_exact(QK_K)
        .zip(q.chunks_exact_mut(QK_K))
        .zip(d)
        .zip(sums.chunks_exact_mut(QK_K / 16))
    {
        *d = quantize_q8k(x, q, s);
    }
}

/// One Q8_0 block: scale `amax / 127`, values `round(x / d)`. Returns `d`.
/// AVX2 when the CPU has it (same bits as [`quantize_q8_0_scalar`]).
fn quantize_q8_0(x: &[f32], q: &mut [i8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: AVX2 is available.
        return unsafe { x86::quantize_q8_0(x, q) };
    }
    quantize_q8_0_scalar(x, q)
}

/// The reference of [`quantize_q8_0`].
fn quantize_q8_0_scalar(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in q.iter_mut().zip(x) {
        // `as` saturates (and maps NaN to 0); |v * id| <= 127 for finite input.
        *q = round_half_away(v * id) as i8;
    }
    d
}

/// One Q8_K block as in llama.cpp: scale `max / -127` from the value of
/// largest magnitude, values clamped to [-128, 127], and 16-element sums.
/// AVX2 when the CPU has it (same bits as [`quantize_q8k_scalar`]).
fn quantize_q8k(x: &[f32], q: &mut [i8], sums: &mut [i16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: AVX2 is available.
        return unsafe { x86::quantize_q8k(x, q, sums) };
    }
    quantize_q8k_scalar(x, q, sums)
}

/// The reference of [`quantize_q8k`].
fn quantize_q8k_scalar(x: &[f32], q: &mut [i8], sums: &mut [i16]) -> f32 {
    let mut amax = 0f32;
    let mut max = 0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        q.fill(0);
        sums.fill(0);
        return 0.0;
    }
    let iscale = -127.0 / max;
    for (q, &v) in q.iter_mut().zip(x) {
        *q = round_half_away(iscale * v).clamp(-128.0, 127.0) as i8;
    }
    block_sums(q, sums);
    1.0 / iscale
}

/// The Q8_K 16-element sums of a quantized block (both quantizers).
fn block_sums(q: &[i8], sums: &mut [i16]) {
    for (s, q) in sums.iter_mut().zip(q.chunks_exact(16)) {
        *s = q.iter().map(|&v| v as i16).sum();
    }
}

/// `v.round()` (halves away from zero) without the libm call that `round`
/// compiles to on a baseline x86-64 build: truncate, then step by one when the
/// exact remainder `v - trunc(v)` reaches a half. Equal to `v.round()` for
/// every finite `v` with `|v| < 2^31` (the quantizers stay within ±128); beyond
/// that, and for ±inf and NaN, it saturates the same way after `as i8`.
#[inline(always)]
fn round_half_away(v: f32) -> f32 {
    let t = v as i32 as f32; // trunc for |v| < 2^31 (NaN -> 0)
    let f = v - t; // exact: t and v share the same binade or t = 0
    if f >= 0.5 {
        t + 1.0
    } else if f <= -0.5 {
        t - 1.0
    } else {
        t
    }
}

/// AVX2 quantizers: the same IEEE operations as the scalar ones, lane by lane
/// and without branches (the scalar rounding's `f >= 0.5` branch is taken at
/// random: ~6 ns per value, most of it mispredictions).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx2")
    }

    /// The largest magnitude in `x`, NaN skipped, as the scalar loops find it.
    ///
    /// # Safety
    /// AVX2; `x.len()` is a multiple of 8.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn abs_max(x: &[f32]) -> f32 {
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for c in x.chunks_exact(8) {
            // SAFETY: 8 floats.
            let v = _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(c.as_ptr()) });
            // A NaN in `v` keeps `m` (MAXPS returns its second operand).
            m = _mm256_max_ps(v, m);
        }
        let mut a = [0f32; 8];
        // SAFETY: 8 floats into [f32; 8].
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), m) };
        a.iter().fold(0f32, |acc, &v| if v > acc { v } else { acc })
    }

    /// The first value of `x` whose magnitude is `amax` (which must be the
    /// non-zero [`abs_max`] of `x`): the scalar Q8_K loop's `max`.
    ///
    /// # Safety
    /// AVX2; `x.len()` is a multiple of 8.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn first_of_magnitude(x: &[f32], amax: f32) -> f32 {
        let sign = _mm256_set1_ps(-0.0);
        let target = _mm256_set1_ps(amax);
        for c in x.chunks_exact(8) {
            // SAFETY: 8 floats.
            let v = _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(c.as_ptr()) });
            let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(v, target));
            if hit != 0 {
                return c[hit.trailing_zeros() as usize];
            }
        }
        unreachable!("amax is the magnitude of one of the values")
    }

    /// `round_half_away(x · s)` clamped to [-128, 127] as i32 lanes, NaN → 0
    /// (what the scalar `as i8` gives).
    ///
    /// # Safety
    /// AVX2; 8 readable floats at `x`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn quantize8(x: *const f32, s: __m256) -> __m256i {
        // SAFETY: the caller's contract.
        let p = _mm256_mul_ps(unsafe { _mm256_loadu_ps(x) }, s);
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(p);
        let f = _mm256_sub_ps(p, t);
        let one = _mm256_set1_ps(1.0);
        let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(f, _mm256_set1_ps(0.5)), one);
        let down = _mm256_and_ps(_mm256_cmp_ps::<_CMP_LE_OQ>(f, _mm256_set1_ps(-0.5)), one);
        let r = _mm256_sub_ps(_mm256_add_ps(t, up), down);
        let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(p, p));
        let r = _mm256_min_ps(
            _mm256_max_ps(r, _mm256_set1_ps(-128.0)),
            _mm256_set1_ps(127.0),
        );
        _mm256_cvtps_epi32(r)
    }

    /// 32 values of `x` quantized with scale `s` into `q` (in order).
    ///
    /// # Safety
    /// AVX2; 32 readable floats at `x`, 32 writable bytes at `q`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn quantize32(x: *const f32, s: __m256, q: *mut i8) {
        // SAFETY: the caller's contract.
        unsafe {
            let (a, b) = (quantize8(x, s), quantize8(x.add(8), s));
            let (c, d) = (quantize8(x.add(16), s), quantize8(x.add(24), s));
            // packs work per 128-bit half; the permute restores the order.
            let v = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
            let v = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.cast(), v);
        }
    }

    /// [`super::quantize_q8_0_scalar`] with AVX2.
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_q8_0(x: &[f32], q: &mut [i8]) -> f32 {
        assert!(x.len() == 32 && q.len() == 32);
        // SAFETY: 32 values.
        let amax = unsafe { abs_max(x) };
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        // SAFETY: 32 floats in, 32 bytes out.
        unsafe { quantize32(x.as_ptr(), _mm256_set1_ps(id), q.as_mut_ptr()) };
        d
    }

    /// [`super::quantize_q8k_scalar`] with AVX2.
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_q8k(x: &[f32], q: &mut [i8], sums: &mut [i16]) -> f32 {
        assert!(x.len() == 256 && q.len() == 256 && sums.len() == 16);
        // SAFETY: 256 values.
        let amax = unsafe { abs_max(x) };
        if amax == 0.0 {
            q.fill(0);
            sums.fill(0);
            return 0.0;
        }
        // SAFETY: 256 values; amax is their non-zero largest magnitude.
        let iscale = -127.0 / unsafe { first_of_magnitude(x, amax) };
        let s = _mm256_set1_ps(iscale);
        for c in 0..8 {
            // SAFETY: chunk c < 8 of 32 values and bytes.
            unsafe { quantize32(x.as_ptr().add(32 * c), s, q.as_mut_ptr().add(32 * c)) };
        }
        // act.rs's `block_sums`, named from the crate root: scripts/check-modules
        // reads a `super::` in this inline module as act.rs's parent.
        crate::quant::act::block_sums(q, sums);
        1.0 / iscale
    }
}

#[cfg(test)]
mod tests {
    use super::round_half_away;

    #[test]
    fn round_half_away_equals_round() {
        let mut vals = vec![
            0.0f32, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, 126.5, -127.5, 127.49999,
        ];
        for b in [0.49999997f32, 0.5000001, 1.4999999, 1.5000001] {
            vals.push(b);
            vals.push(-b);
        }
        // every f32 in [-130, 130] with a step pattern that hits many binades
        let mut v = -130.0f32;
        while v < 130.0 {
            vals.push(v);
            v = f32::from_bits(v.to_bits().wrapping_add(if v < 0.0 {
                -997i32 as u32
            } else {
                997
            }));
            if v.is_nan() || v.abs() < 1e-30 {
                v = 1e-30;
            }
        }
        for x in (0..200_000).map(|i| (i as f32 - 100_000.0) / 761.0) {
            vals.push(x);
        }
        for &x in &vals {
            assert_eq!(round_half_away(x) as i8, x.round() as i8, "{x:e}");
            if x.abs() < 1e6 {
                assert_eq!(round_half_away(x), x.round(), "{x:e}");
            }
        }
        for x in [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e10,
            -1e10,
            3e9,
            -3e9,
        ] {
            assert_eq!(round_half_away(x) as i8, x.round() as i8, "{x:e}");
            assert_eq!(
                round_half_away(x).clamp(-128.0, 127.0) as i8,
                x.round().clamp(-128.0, 127.0) as i8,
                "{x:e}"
            );
        }
    }

    /// Blocks that exercise every branch of the quantizers: random values at
    /// many scales, exact halves after scaling, ties for the largest
    /// magnitude (±a), zeros, denormals, infinities and NaNs.
    #[cfg(target_arch = "x86_64")]
    fn test_blocks(n: usize) -> Vec<Vec<f32>> {
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut blocks = Vec::new();
        for i in 0..2000 {
            let scale = 10f32.powi(i % 13 - 6);
            let mut b: Vec<f32> = (0..n)
                .map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale)
                .collect();
            match i % 10 {
                // halves: values k/2 · amax/127 with amax = 127
                1 => b
                    .iter_mut()
                    .enumerate()
                    .for_each(|(j, v)| *v = (j as f32 - 64.0) * 0.5),
                2 => {
                    let j = (next() % n as u64) as usize;
                    b[j] = 3.0 * scale;
                    b[n - 1 - j] = -3.0 * scale;
                }
                3 => b.iter_mut().step_by(3).for_each(|v| *v = 0.0),
                4 => b.iter_mut().for_each(|v| *v *= 1e-38),
                5 => b[(next() % n as u64) as usize] = f32::NAN,
                6 => b[(next() % n as u64) as usize] = f32::INFINITY,
                7 => b[(next() % n as u64) as usize] = f32::NEG_INFINITY,
                8 => b.fill(0.0),
                9 => b.iter_mut().for_each(|v| *v = -0.0),
                _ => {}
            }
            blocks.push(b);
        }
        blocks
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_quantizers_give_the_scalar_bits() {
        if !super::x86::available() {
            eprintln!("no AVX2 on this CPU: nothing to compare");
            return;
        }
        for x in test_blocks(32) {
            let (mut a, mut b) = ([0i8; 32], [0i8; 32]);
            let da = super::quantize_q8_0_scalar(&x, &mut a);
            // SAFETY: AVX2 checked above.
            let db = unsafe { super::x86::quantize_q8_0(&x, &mut b) };
            assert_eq!((da.to_bits(), a), (db.to_bits(), b), "Q8_0 {x:?}");
        }
        for x in test_blocks(256) {
            let (mut a, mut b) = ([0i8; 256], [0i8; 256]);
            let (mut sa, mut sb) = ([0i16; 16], [0i16; 16]);
            let da = super::quantize_q8k_scalar(&x, &mut a, &mut sa);
            // SAFETY: AVX2 checked above.
            let db = unsafe { super::x86::quantize_q8k(&x, &mut b, &mut sb) };
            assert_eq!(
                (da.to_bits(), a.to_vec(), sa),
                (db.to_bits(), b.to_vec(), sb),
                "Q8_K {x:?}"
            );
        }
    }
}
