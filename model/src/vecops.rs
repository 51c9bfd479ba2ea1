//! Float vector operations of the transformer outside the matmuls (attention
//! scores, attention-weighted sums of values, RMSNorm sums), with a fixed
//! association order so every path gives the same bits.
//!
//! The portable code is the reference. On x86-64 with AVX the same arithmetic
//! runs 8 lanes per instruction: a multiply then an add, each rounded, exactly
//! the lane operations of the portable loop (Rust never contracts `a * b + c`
//! into an FMA), so results are bit-identical — tested below on odd lengths.
//! Before this, the portable loops were compiled for baseline x86-64 (SSE2,
//! 4 lanes) and attention was ~10 % of a 17-token forward of the 1.5B on AVX2.

/// `Σ a[i]·b[i]` with 8 partial sums (element i goes to sum i mod 8), then the
/// fixed tree `((s0+s4)+(s1+s5)) + ((s2+s6)+(s3+s7))`, then the tail in order.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX is available (checked just above).
        return unsafe { x86::dot(a, b) };
    }
    dot_portable(a, b)
}

/// `y[i] += w·x[i]` (a multiply, then an add, per element).
pub fn axpy(y: &mut [f32], w: f32, x: &[f32]) {
    debug_assert_eq!(y.len(), x.len());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX is available (checked just above).
        return unsafe { x86::axpy(y, w, x) };
    }
    axpy_portable(y, w, x)
}

/// [`dot`] of `a` with four vectors at once (attention scores over four
/// keys): result `i` has the bits of `dot(a, b[i])` (the same lanes in the
/// same order); the four independent sums only hide each other's add
/// latency. Every `b[i]` has `a`'s length.
pub fn dot4(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    debug_assert!(b.iter().all(|b| b.len() == a.len()));
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX is available (checked just above).
        return unsafe { x86::dot4(a, b) };
    }
    b.map(|b| dot_portable(a, b))
}

/// `axpy(y, w[i], x[i])` for `i` = 0..4 in that order, with the bits of
/// the four calls (per element: multiply, add, in order of `i`), `y` read
/// and written once. Every `x[i]` has `y`'s length.
pub fn axpy4(y: &mut [f32], w: [f32; 4], x: [&[f32]; 4]) {
    debug_assert!(x.iter().all(|x| x.len() == y.len()));
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX is available (checked just above).
        return unsafe { x86::axpy4(y, w, x) };
    }
    for (w, x) in w.into_iter().zip(x) {
        axpy_portable(y, w, x);
    }
}

fn reduce8(acc: &[f32; 8]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// The reference [`dot`].
pub fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0f32; 8];
    let chunks = n / 8;
    for c in 0..chunks {
        for j in 0..8 {
            acc[j] += a[c * 8 + j] * b[c * 8 + j];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..n {
        tail += a[i] * b[i];
    }
    reduce8(&acc) + tail
}

/// The reference [`axpy`].
pub fn axpy_portable(y: &mut [f32], w: f32, x: &[f32]) {
    for (o, v) in y.iter_mut().zip(x) {
        *o += w * v;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX must be available.
    #[target_feature(enable = "avx")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let chunks = n / 8;
        let mut acc = _mm256_setzero_ps();
        for c in 0..chunks {
            // SAFETY: 8 floats at 8c < n in both slices.
            unsafe {
                let x = _mm256_loadu_ps(a.as_ptr().add(8 * c));
                let y = _mm256_loadu_ps(b.as_ptr().add(8 * c));
                acc = _mm256_add_ps(acc, _mm256_mul_ps(x, y));
            }
        }
        let mut tail = 0f32;
        for i in chunks * 8..n {
            tail += a[i] * b[i];
        }
        // reduce8's tree: the halves' sums, then neighbours, then the pairs.
        let h = halves_sum(acc);
        let p = _mm_hadd_ps(h, h);
        _mm_cvtss_f32(_mm_hadd_ps(p, p)) + tail
    }

    /// [`super::reduce8`] of four accumulators at once, lane for lane the
    /// same tree: the halves' sums `a_j = l_j + l_{j+4}`, then `a0 + a1`
    /// and `a2 + a3`, then their sum (`hadd` adds neighbours, and a float
    /// addition gives the same bits in either order).
    #[target_feature(enable = "avx")]
    #[inline]
    fn reduce8x4(acc: [__m256; 4]) -> __m128 {
        let [h0, h1, h2, h3] = [
            halves_sum(acc[0]),
            halves_sum(acc[1]),
            halves_sum(acc[2]),
            halves_sum(acc[3]),
        ];
        _mm_hadd_ps(_mm_hadd_ps(h0, h1), _mm_hadd_ps(h2, h3))
    }

    /// `[l0 + l4, l1 + l5, l2 + l6, l3 + l7]` of `v = [l0, …, l7]`: the
    /// first level of [`super::reduce8`]'s tree.
    #[target_feature(enable = "avx")]
    #[inline]
    fn halves_sum(v: __m256) -> __m128 {
        _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v))
    }

    /// [`super::dot4`]: four [`dot`]s, the chunk loop shared.
    ///
    /// # Safety
    /// AVX must be available.
    #[target_feature(enable = "avx")]
    pub unsafe fn dot4(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
        let n = b.iter().fold(a.len(), |n, b| n.min(b.len()));
        let chunks = n / 8;
        let mut acc = [_mm256_setzero_ps(); 4];
        for c in 0..chunks {
            // SAFETY: 8 floats at 8c < n in every slice.
            unsafe {
                let x = _mm256_loadu_ps(a.as_ptr().add(8 * c));
                for (acc, b) in acc.iter_mut().zip(b) {
                    let y = _mm256_loadu_ps(b.as_ptr().add(8 * c));
                    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(x, y));
                }
            }
        }
        // (Plain loops, no closures: a closure is not compiled with this
        // function's target features, docs/model-core.md.)
        let mut tails = [0f32; 4];
        for (tail, b) in tails.iter_mut().zip(b) {
            for j in chunks * 8..n {
                *tail += a[j] * b[j];
            }
        }
        let mut out = [0f32; 4];
        // SAFETY: 4 floats each, from and into [f32; 4]s.
        unsafe {
            let r = _mm_add_ps(reduce8x4(acc), _mm_loadu_ps(tails.as_ptr()));
            _mm_storeu_ps(out.as_mut_ptr(), r);
        }
        out
    }

    /// [`super::axpy4`]: per chunk of `y`, the four products added in order.
    ///
    /// # Safety
    /// AVX must be available.
    #[target_feature(enable = "avx")]
    pub unsafe fn axpy4(y: &mut [f32], w: [f32; 4], x: [&[f32]; 4]) {
        let n = x.iter().fold(y.len(), |n, x| n.min(x.len()));
        let chunks = n / 8;
        let wv = [
            _mm256_set1_ps(w[0]),
            _mm256_set1_ps(w[1]),
            _mm256_set1_ps(w[2]),
            _mm256_set1_ps(w[3]),
        ];
        for c in 0..chunks {
            // SAFETY: 8 floats at 8c < n in every slice.
            unsafe {
                let p = y.as_mut_ptr().add(8 * c);
                let mut acc = _mm256_loadu_ps(p);
                for (wv, x) in wv.iter().zip(x) {
                    let v = _mm256_loadu_ps(x.as_ptr().add(8 * c));
                    acc = _mm256_add_ps(acc, _mm256_mul_ps(*wv, v));
                }
                _mm256_storeu_ps(p, acc);
            }
        }
        for j in chunks * 8..n {
            for (w, x) in w.iter().zip(x) {
                y[j] += w * x[j];
            }
        }
    }

    /// # Safety
    /// AVX must be available.
    #[target_feature(enable = "avx")]
    pub unsafe fn axpy(y: &mut [f32], w: f32, x: &[f32]) {
        let n = y.len().min(x.len());
        let chunks = n / 8;
        let wv = _mm256_set1_ps(w);
        for c in 0..chunks {
            // SAFETY: 8 floats at 8c < n in both slices.
            unsafe {
                let p = y.as_mut_ptr().add(8 * c);
                let v = _mm256_loadu_ps(x.as_ptr().add(8 * c));
                _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), _mm256_mul_ps(wv, v)));
            }
        }
        for i in chunks * 8..n {
            y[i] += w * x[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                // Wide exponent range so rounding differences would show.
                (s as f32 / u32::MAX as f32 - 0.5) * 2f32.powi((s % 24) as i32 - 12)
            })
            .collect()
    }

    #[test]
    fn every_path_gives_the_portable_bits() {
        for n in [0, 1, 7, 8, 9, 63, 64, 65, 127, 128, 129, 896] {
            let (a, b) = (data(n, 1 + n as u32), data(n, 1000 + n as u32));
            assert_eq!(
                dot(&a, &b).to_bits(),
                dot_portable(&a, &b).to_bits(),
                "dot n={n}"
            );
            let mut y1 = data(n, 7 + n as u32);
            let mut y2 = y1.clone();
            axpy(&mut y1, 0.37, &a);
            axpy_portable(&mut y2, 0.37, &a);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&y1), bits(&y2), "axpy n={n}");
            // Four at once: the bits of four single calls.
            let bs: Vec<Vec<f32>> = (0..4).map(|i| data(n, 50 + 9 * i + n as u32)).collect();
            let b4 = [&bs[0][..], &bs[1][..], &bs[2][..], &bs[3][..]];
            let d4 = dot4(&a, b4);
            for (i, b) in b4.iter().enumerate() {
                assert_eq!(
                    d4[i].to_bits(),
                    dot_portable(&a, b).to_bits(),
                    "dot4 n={n} i={i}"
                );
            }
            let ws = [0.37, -1.5e-3, 2.25, -0.71];
            let mut y4 = data(n, 11 + n as u32);
            let mut y1 = y4.clone();
            axpy4(&mut y4, ws, b4);
            for (w, b) in ws.iter().zip(b4) {
                axpy_portable(&mut y1, *w, b);
            }
            assert_eq!(bits(&y4), bits(&y1), "axpy4 n={n}");
        }
    }

    #[test]
    fn dot_is_the_dot_product() {
        let a: Vec<f32> = (0..19).map(|i| i as f32).collect();
        let b = vec![2f32; 19];
        assert_eq!(dot(&a, &b), 342.0);
        assert_eq!(dot_portable(&a, &b), 342.0);
    }
}
