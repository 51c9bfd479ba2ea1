//! `exp` of many f32 values at once, with the bits of `f32::exp` (the
//! platform libm's `expf`) for every input.
//!
//! The transformer calls `exp` for every attention score and every SiLU
//! input: a 128-row forward of the 1.5B makes ~40 million calls, ~7 % of its
//! time through glibc's scalar `expf`. Here, on x86-64 with AVX2 and FMA,
//! four values at a time follow glibc's own algorithm step for step (the
//! ARM optimized-routines `expf` that glibc has shipped since 2.28, as its
//! FMA variant `__expf_fma` computes it: the fused operations where that
//! build fuses them, the same 32-entry table, the same constants), so each
//! result is the same f32.
//!
//! Whether this really is the machine's `expf` is checked once per process
//! against `f32::exp` on values spread over its whole range and on the
//! edges of its table ([`simd_agrees`]); a libm that computes differently
//! (another C library, another glibc algorithm) keeps the scalar calls.
//! Inputs outside glibc's fast path (|x| ≥ 88, NaN, infinities) always take
//! `f32::exp`. Elsewhere (aarch64, x86 without AVX2/FMA) every value takes
//! `f32::exp`.

/// `x = x.exp()` for every element, bit for bit as `f32::exp`.
pub fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if x86::usable() {
        // SAFETY: AVX2 and FMA are available (`usable`).
        unsafe { x86::exp_in_place(xs) };
        return;
    }
    for x in xs {
        *x = x.exp();
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `tab[i] = bits(2^(i/32)) − (i << 47)`: glibc's `__exp2f_data.tab`.
    const TAB: [u64; 32] = [
        0x3ff0000000000000,
        0x3fefd9b0d3158574,
        0x3fefb5586cf9890f,
        0x3fef9301d0125b51,
        0x3fef72b83c7d517b,
        0x3fef54873168b9aa,
        0x3fef387a6e756238,
        0x3fef1e9df51fdee1,
        0x3fef06fe0a31b715,
        0x3feef1a7373aa9cb,
        0x3feedea64c123422,
        0x3feece086061892d,
        0x3feebfdad5362a27,
        0x3feeb42b569d4f82,
        0x3feeab07dd485429,
        0x3feea47eb03a5585,
        0x3feea09e667f3bcd,
        0x3fee9f75e8ec5f74,
        0x3feea11473eb0187,
        0x3feea589994cce13,
        0x3feeace5422aa0db,
        0x3feeb737b0cdc5e5,
        0x3feec49182a3f090,
        0x3feed503b23e255d,
        0x3feee89f995ad3ad,
        0x3feeff76f2fb5e47,
        0x3fef199bdd85529c,
        0x3fef3720dcef9069,
        0x3fef5818dcfba487,
        0x3fef7c97337b9b5f,
        0x3fefa4afa2a490da,
        0x3fefd0765b6e4540,
    ];
    /// 32 / ln 2.
    const INVLN2_SCALED: u64 = 0x40471547652b82fe;
    /// 0x1.8p52: adding it rounds to an integer (ties to even).
    const SHIFT: u64 = 0x4338000000000000;
    /// The polynomial for 2^(r/32), r in [-1/2, 1/2].
    const C: [u64; 3] = [0x3ebc6af84b912394, 0x3f2ebfce50fac4f3, 0x3f962e42ff0c52d6];
    /// `bits(x) >> 20 & 0x7ff` above this: |x| ≥ 88, NaN or infinite.
    const TOP12_88: i32 = 0x42a;

    /// AVX2 and FMA, and this module agrees with `f32::exp` (once per
    /// process).
    pub(super) fn usable() -> bool {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                // SAFETY: AVX2 and FMA are available (checked just above).
                && unsafe { super::simd_agrees(|v| exp_in_place(v)) }
        })
    }

    /// Four values (as doubles) through glibc's fast path; the caller
    /// replaces the lanes outside it.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp4(x: __m128) -> __m128 {
        let xd = _mm256_cvtps_pd(x);
        let invln2 = _mm256_set1_pd(f64::from_bits(INVLN2_SCALED));
        let shift = _mm256_set1_pd(f64::from_bits(SHIFT));
        // kd + SHIFT = round(x·32/ln2) in the low bits of a double.
        let kds = _mm256_fmadd_pd(invln2, xd, shift);
        let ki = _mm256_castpd_si256(kds);
        let kd = _mm256_sub_pd(kds, shift);
        let r = _mm256_fmsub_pd(invln2, xd, kd);
        // s = 2^(k/32): table entry k mod 32, plus k in the exponent.
        let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        // SAFETY: idx < 32 indexes TAB.
        let t = unsafe { _mm256_i64gather_epi64::<8>(TAB.as_ptr().cast(), idx) };
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
        let c = C.map(|c| _mm256_set1_pd(f64::from_bits(c)));
        let z = _mm256_fmadd_pd(c[0], r, c[1]);
        let r2 = _mm256_mul_pd(r, r);
        let y = _mm256_fmadd_pd(c[2], r, _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(z, r2, y);
        _mm256_cvtpd_ps(_mm256_mul_pd(y, s))
    }

    /// [`super::exp_in_place`] four values at a time.
    ///
    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_in_place(xs: &mut [f32]) {
        let mut quads = xs.chunks_exact_mut(4);
        for q in &mut quads {
            // SAFETY: four floats.
            let x = unsafe { _mm_loadu_ps(q.as_ptr()) };
            let top = _mm_and_si128(
                _mm_srli_epi32::<20>(_mm_castps_si128(x)),
                _mm_set1_epi32(0x7ff),
            );
            let slow = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(
                top,
                _mm_set1_epi32(TOP12_88),
            )));
            // SAFETY: four floats.
            unsafe { _mm_storeu_ps(q.as_mut_ptr(), exp4(x)) };
            if slow != 0 {
                for (i, v) in q.iter_mut().enumerate() {
                    if slow & (1 << i) != 0 {
                        // The lane's input: `exp4` overwrote it.
                        // SAFETY: reading back lane i of `x`.
                        let xi = unsafe { std::mem::transmute::<__m128, [f32; 4]>(x) }[i];
                        *v = xi.exp();
                    }
                }
            }
        }
        for v in quads.into_remainder() {
            *v = v.exp();
        }
    }
}

/// Whether `simd` (an in-place exp) gives `f32::exp`'s bits on values
/// spread over the whole f32 range (every 65,537th bit pattern), on every
/// table position around zero and on the edges of the fast path.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn simd_agrees(simd: impl Fn(&mut [f32])) -> bool {
    let mut xs: Vec<f32> = (0..u32::MAX / 65_537)
        .map(|i| f32::from_bits(i.wrapping_mul(65_537)))
        .collect();
    // Every k = round(x·32/ln2) from -160·32 to 130·32 at its centre and
    // both rounding edges.
    let step = std::f32::consts::LN_2 / 32.0;
    for k in -5_120..4_160 {
        let c = k as f32 * step;
        xs.extend([c, c + 0.5 * step, c - 0.5 * step]);
    }
    xs.extend([
        88.0,
        -88.0,
        88.72,
        -103.97,
        -103.28,
        f32::MIN_POSITIVE,
        -0.0,
    ]);
    let mut got = xs.clone();
    simd(&mut got);
    xs.iter()
        .zip(&got)
        .all(|(x, y)| x.exp().to_bits() == y.to_bits())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gives_the_bits_of_f32_exp() {
        // Every 251st f32 bit pattern (17 million values), any length.
        let mut xs: Vec<f32> = (0..u32::MAX / 251)
            .map(|i| f32::from_bits(i.wrapping_mul(251)))
            .collect();
        xs.truncate(xs.len() - 3);
        let mut got = xs.clone();
        exp_in_place(&mut got);
        for (x, y) in xs.iter().zip(&got) {
            assert_eq!(x.exp().to_bits(), y.to_bits(), "exp({x:e})");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_simd_path_is_taken_where_it_agrees() {
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && cfg!(target_env = "gnu")
        {
            assert!(x86::usable(), "glibc's expf and this module disagree");
        }
    }
}
