//! Activation rows quantized once per `matmul` call, the way llama.cpp does:
//! Q8_0 (blocks of 32, for Q4_0/Q5_0/Q8_0 weights) or Q8_K (blocks of 256 with
//! 16-element sums, for Q4_K/Q6_K weights).
//!
//! Quantization is plain scalar code shared by every instruction-set path, so
//! the quantized activations (and hence the integer dot products) are the same
//! whichever kernel consumes them.

use super::blocks::{QK, QK_K};

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
    /// Q8_0, built on request by [`Act::interleave`]: per row, groups of 8
    /// blocks (zero-padded); inside a group, 32-byte chunk k holds bytes
    /// 4k..4k+4 of blocks 0..8 in turn, so 32-bit lane b of chunk k belongs
    /// to block b. `m * ng * 256` bytes.
    pub qsi: Vec<i8>,
    /// Q8_0 interleaved: Σ q of each block, `m * ng * 8` (zero-padded).
    pub xsum: Vec<i32>,
    /// Q8_0 interleaved: block scales, `m * ng * 8` (zero-padded).
    pub dpad: Vec<f32>,
    /// Q8_0 interleaved: groups of 8 blocks per row.
    pub ng: usize,
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
            cols,
            nb,
            x,
            qs: Vec::new(),
            d: Vec::new(),
            bsums: Vec::new(),
            qsi: Vec::new(),
            xsum: Vec::new(),
            dpad: Vec::new(),
            ng: 0,
        };
        match kind {
            ActKind::F32 => {}
            ActKind::Q8_0 => {
                a.qs = vec![0; m * cols];
                a.d = vec![0.0; m * cols / QK];
                for ((x, q), d) in x
                    .chunks_exact(QK)
                    .zip(a.qs.chunks_exact_mut(QK))
                    .zip(a.d.iter_mut())
                {
                    *d = quantize_q8_0(x, q);
                }
            }
            ActKind::Q8K => {
                a.qs = vec![0; m * cols];
                a.d = vec![0.0; m * cols / QK_K];
                a.bsums = vec![0; m * cols / 16];
                for (((x, q), d), s) in x
                    .chunks_exact(QK_K)
                    .zip(a.qs.chunks_exact_mut(QK_K))
                    .zip(a.d.iter_mut())
                    .zip(a.bsums.chunks_exact_mut(QK_K / 16))
                {
                    *d = quantize_q8k(x, q, s);
                }
            }
        }
        a
    }

    /// Build the interleaved copy of Q8_0 rows (a permutation of the same
    /// quantized values, for kernels whose 32-bit lanes follow blocks).
    pub fn interleave(&mut self, m: usize) {
        let (nb, cols) = (self.nb, self.cols);
        let ng = nb.div_ceil(8);
        self.ng = ng;
        self.qsi = vec![0; m * ng * 256];
        self.xsum = vec![0; m * ng * 8];
        self.dpad = vec![0.0; m * ng * 8];
        for r in 0..m {
            for b in 0..nb {
                let (g, k) = (b / 8, b % 8);
                let src = &self.qs[r * cols + b * QK..][..QK];
                let dst = &mut self.qsi[(r * ng + g) * 256..][..256];
                for (c, four) in src.chunks_exact(4).enumerate() {
                    dst[c * 32 + k * 4..c * 32 + k * 4 + 4].copy_from_slice(four);
                }
                self.xsum[r * ng * 8 + b] = src.iter().map(|&v| v as i32).sum();
                self.dpad[r * ng * 8 + b] = self.d[r * nb + b];
            }
        }
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

/// One Q8_0 block: scale `amax / 127`, values `round(x / d)`. Returns `d`.
fn quantize_q8_0(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in q.iter_mut().zip(x) {
        // `as` saturates (and maps NaN to 0); |v * id| <= 127 for finite input.
        *q = (v * id).round() as i8;
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
        *q = (iscale * v).round().clamp(-128.0, 127.0) as i8;
    }
    for (s, q) in sums.iter_mut().zip(q.chunks_exact(16)) {
        *s = q.iter().map(|&v| v as i16).sum();
    }
    1.0 / iscale
}
