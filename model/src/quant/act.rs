//! Activation rows quantized once per input (`matmul`, or `matmul_shared` for
//! Q/K/V and gate/up), the way llama.cpp does:
//! Q8_0 (blocks of 32, for Q4_0/Q5_0/Q8_0 weights) or Q8_K (blocks of 256 with
//! 16-element sums, for Q4_K/Q6_K weights).
//!
//! Quantization is plain scalar code shared by every instruction-set path, so
//! the quantized activations (and hence the integer dot products) are the same
//! whichever kernel consumes them. Rows are independent, so a large input is
//! quantized row-parallel (same bits: each row's code is the same).

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
}

/// `m` quantized activation rows of `cols` elements (structure of arrays).
pub struct Act<'x> {
    /// rows
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
    /// Q8K only: the block scales transposed, `dt[sb * m + t] = d[t * nb + sb]`
    /// (the scales of all rows for one super-block, side by side).
    pub dt: Vec<f32>,
    /// Q8_0, built on request by [`Act::prepare_unsigned`]: every block scale
    /// repeated 8 times (one per 32-bit lane of the block), `m * nb * 8`.
    pub d8: Vec<f32>,
    /// Q8_0, built by [`Act::prepare_unsigned`]: `-off · Σ x` over each 4
    /// consecutive values, `m * cols / 4` (the start value of a `vpdpbusd`
    /// of weights offset to unsigned `w + off`).
    pub corr4: Vec<i32>,
}

impl<'x> Act<'x> {
    pub fn new(kind: ActKind, x: &'x [f32], m: usize, cols: usize) -> Self {
        debug_assert_eq!(x.len(), m * cols);
        let nb = match kind {
            ActKind::F32 => 0,
            ActKind::Q8_0 => cols / QK,
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
            dt: Vec::new(),
            d8: Vec::new(),
            corr4: Vec::new(),
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
            ActKind::Q8_0 => {
                a.qs = vec![0; m * cols];
                a.d = vec![0.0; m * cols / QK];
                let row = |((x, q), d)| quantize_q8_0_row(x, q, d);
                let rows = x
                    .par_chunks_exact(cols)
                    .zip(a.qs.par_chunks_exact_mut(cols))
                    .zip(a.d.par_chunks_exact_mut(nb));
                rows.with_min_len(min_rows).for_each(row);
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

    /// Build [`Act::d8`] and [`Act::corr4`] for kernels that multiply
    /// unsigned weights `w + off` (exact integer arithmetic).
    pub fn prepare_unsigned(&mut self, off: i32) {
        self.d8 = self.d.iter().flat_map(|&d| [d; 8]).collect();
        self.corr4 = self
            .qs
            .chunks_exact(4)
            .map(|c| -off * c.iter().map(|&v| v as i32).sum::<i32>())
            .collect();
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
fn quantize_q8_0(x: &[f32], q: &mut [i8]) -> f32 {
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
fn quantize_q8k(x: &[f32], q: &mut [i8], sums: &mut [i16]) -> f32 {
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
    for (s, q) in sums.iter_mut().zip(q.chunks_exact(16)) {
        *s = q.iter().map(|&v| v as i16).sum();
    }
    1.0 / iscale
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
}
