//! The floating-point half of every quantized dot product, shared by all
//! instruction-set paths.
//!
//! SIMD kernels only compute *integer* block sums (exact, so their order does
//! not matter); every float operation that turns those sums into the result is
//! done here, in one fixed order, with separate multiplies and adds (Rust never
//! contracts `a * b + c` into an FMA). This is what makes results identical
//! across ISAs, thread counts and batch sizes.

/// Blocks of 32 per group in the Q4_0/Q5_0/Q8_0 kernels: group `g` covers
/// blocks `8g..8g+8` of a row, block `8g + k` is accumulated into lane `k`.
pub const GROUP: usize = 8;

/// `acc[k] += (dw[k] * dx[k]) * isum[k]` for the 8 blocks of one group
/// (missing blocks past the row end have `dw = dx = isum = 0`, adding `+0.0`).
#[inline(always)]
pub fn combine_group(
    acc: &mut [f32; GROUP],
    dw: &[f32; GROUP],
    dx: &[f32; GROUP],
    isum: &[i32; GROUP],
) {
    for k in 0..GROUP {
        acc[k] += (dw[k] * dx[k]) * isum[k] as f32;
    }
}

/// Sum of 8 lanes in a fixed tree order.
#[inline(always)]
pub fn reduce8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Contribution of one Q4_K × Q8_K super-block:
/// `sumi = Σ_j sc_j Σ q·x`, `summins = Σ_j m_j Σ x` (integers, exact).
#[inline(always)]
pub fn q4k_block(d: f32, dmin: f32, dx: f32, sumi: i32, summins: i32) -> f32 {
    (d * dx) * sumi as f32 - (dmin * dx) * summins as f32
}

/// Contribution of one Q6_K × Q8_K super-block: `sumi = Σ_j sc_j Σ (q-32)·x`.
#[inline(always)]
pub fn q6k_block(d: f32, dx: f32, sumi: i32) -> f32 {
    (d * dx) * sumi as f32
}

/// Lanes of the f32 dot product used for F32/F16 weights.
pub const F_LANES: usize = 16;

/// Sum of 16 lanes in a fixed order.
#[inline(always)]
pub fn reduce16(a: &[f32; F_LANES]) -> f32 {
    let mut h = [0f32; 8];
    for k in 0..8 {
        h[k] = a[k] + a[k + 8];
    }
    reduce8(&h)
}
