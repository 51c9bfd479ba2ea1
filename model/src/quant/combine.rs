//! The floating-point half of every quantized dot product, shared by all
//! instruction-set paths.
//!
//! SIMD and AMX kernels only compute *integer* block sums (exact, so their
//! order does not matter); every float operation that turns those sums into
//! the result is done here, in one fixed order, with separate multiplies and adds (Rust never
//! contracts `a * b + c` into an FMA). This is what makes results identical
//! across ISAs, thread counts and batch sizes.

/// Lanes of the whole-block accumulator (Q4_0/Q5_0/Q5_0x4/Q8_0 and
/// Q4_1/Q5_1): block `b` of a row is stepped by [`block_step`] (or
/// [`min_block_step`]) into lane `b % BLOCK_LANES`, and the lanes are summed
/// by [`reduce16`] at the end.
pub const BLOCK_LANES: usize = 16;
const _: () = assert!(BLOCK_LANES == F_LANES, "reduce16 sums the block lanes");

/// One block of 32 of a signed format (Q4_0/Q5_0/Q5_0x4/Q8_0 × Q8_0): `s =
/// Σ_{k<32} q_k·x_k` (one exact integer for the whole block, q signed as
/// stored: Q4_0 −8..8, Q5_0 −16..16, Q8_0 an i8), `dwdx = dw·dx` (one f32
/// product). Returns `acc + dwdx·(s as f32)`: a multiply, then an add.
///
/// The unit is the whole block, as for [`min_block_step`]: a kernel may form
/// `s` in any order (unsigned weights `q + off` and a correction `−off·Σx`,
/// SIMD lanes reduced by a transposition tree, AMX tiles, NEON `addv`,
/// scalar) and steps 16 consecutive blocks as the lanes of one vector
/// (lane `b % 16`).
///
/// i32 bound: |s| ≤ 32·128·127 = 520,192 < 2^24, exact as f32.
#[inline(always)]
pub fn block_step(acc: f32, dwdx: f32, s: i32) -> f32 {
    acc + dwdx * s as f32
}

/// One block of 32 of an offset format (Q4_1/Q5_1 × Q8_1): `s = Σ_{k<32}
/// q_k·x_k` (one exact integer for the whole block, q unsigned), `dwdx =
/// dw·dx`, `mw` the block's offset and `xs = dx·Σ_{k<32} x_k` (the
/// activation's [`super::act::Act::xs`]). Returns `acc + ((dwdx·s) +
/// mw·xs)`.
///
/// The unit is the whole block, as for [`block_step`].
///
/// i32 bound: |s| ≤ 32·31·127 = 125,984 (Q5_1 values ≤ 31, |x| ≤ 127),
/// exact as f32.
#[inline(always)]
pub fn min_block_step(acc: f32, dwdx: f32, s: i32, mw: f32, xs: f32) -> f32 {
    acc + (dwdx * s as f32 + mw * xs)
}

/// Sum of 8 lanes in a fixed tree order.
#[inline(always)]
pub fn reduce8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Q4_K × Q8_K super-block step (one activation row, one weight row):
/// `s = Σ_c sc_c · Σ_{k<32} q[32c+k]·x[32c+k]` over the 8 sub-blocks and
/// `mm = Σ_c m_c · (bsum16[2c] + bsum16[2c+1])`, both exact integers (every
/// path computes the same integers, in any order); `dd = d·dx`,
/// `dm = dmin·dx`. Returns `acc + (dd·s − dm·mm)`; super-blocks are stepped
/// in order from `acc = 0`.
///
/// i32 bounds: |Σ_k q·x| ≤ 32·15·128 = 61,440; × sc ≤ 63, 8 sub-blocks:
/// |s| ≤ 30,965,760. |mm| ≤ 8·63·32·128 = 2,064,384. (`s as f32` may round
/// above 2^24, identically on every path.)
///
/// Q5_K takes the same step with q in 0..32: |Σ_k q·x| ≤ 32·31·128 =
/// 126,976, |s| ≤ 63,995,904 < 2^31.
#[inline(always)]
pub fn q4k_step(acc: f32, dd: f32, dm: f32, s: i32, mm: i32) -> f32 {
    acc + (dd * s as f32 - dm * mm as f32)
}

/// Q6_K × Q8_K super-block step: `s = Σ_g sc_g · Σ_{k<16} (q[16g+k] − 32)·x[16g+k]`
/// over the 16 groups (exact integer), `dd = d·dx`. Returns `acc + dd·s`.
///
/// i32 bounds: |Σ_k (q−32)·x| ≤ 16·32·128 = 65,536; × |sc| ≤ 128, 16 groups:
/// |s| ≤ 134,217,728 < 2^31.
///
/// Q3_K takes the same step with its signed scales `sc_g − 32` and values
/// q in −4..4: |s| ≤ 16 · (16·4·128) · 32 = 4,194,304.
#[inline(always)]
pub fn q6k_step(acc: f32, dd: f32, s: i32) -> f32 {
    acc + dd * s as f32
}

/// Lanes of the f32 dot product used for F32/F16/BF16 weights.
pub const F_LANES: usize = 16;

/// Sum of 16 lanes in a fixed order (the F32/F16/BF16 dot and the
/// whole-block accumulator of Q4_0/Q5_0/Q5_0x4/Q8_0/Q4_1/Q5_1).
#[inline(always)]
pub fn reduce16(a: &[f32; F_LANES]) -> f32 {
    let mut h = [0f32; 8];
    for k in 0..8 {
        h[k] = a[k] + a[k + 8];
    }
    reduce8(&h)
}
