//! The sample statistics Tandem computes in more than one place, written once: the
//! percentile (nearest rank) behind the edge runtime's RTT deadlines and the
//! lab's, bench's and profile's reports, and the median.
//!
//! It has no dependencies: `tandem-edge`, which goes to phones, uses it.
//!
//! [`prometheus`]: the Prometheus text exposition (histogram, scalar lines,
//! label escaping) of the verifier's and serve-edge's `/metrics`.
//!
//! **Percentile definition: nearest rank.** The `q` percentile of `n` values is
//! the ⌈q·n⌉-th smallest (1-based, at least the first): always a value of the
//! sample, never interpolated. p95 of 1..=64 is the 61st value.
//!
//! **Median:** the middle value, or the mean of the middle two for an even count
//! (so it is not `percentile(xs, 0.5)` for an even count, which is the lower
//! middle value).

/// The nearest-rank `q` percentile of `xs` (`q` in (0, 1]; a `q` at or below 0
/// gives the smallest value, above 1 the largest): the ⌈q·n⌉-th smallest value.
/// None for an empty sample. NaNs sort above every number (`f64::total_cmp`).
pub fn percentile(xs: &[f64], q: f64) -> Option<f64> {
    let mut v = xs.to_vec();
    percentile_in_place(&mut v, q)
}

/// [`percentile`] that sorts `v` in place instead of copying it.
pub fn percentile_in_place(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// The median of `xs`: the middle value, or the mean of the middle two for an even
/// count. None for an empty sample.
pub fn median(xs: &[f64]) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

pub mod prometheus;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_nearest_rank() {
        assert_eq!(percentile(&[], 0.95), None);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.5), Some(2.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 1.0), Some(3.0));
        // ceil(0.95 × 64) = 61.
        let v: Vec<f64> = (1..=64).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.95), Some(61.0));
        // An even count's p50 is the lower middle value.
        assert_eq!(percentile(&[4.0, 1.0, 2.0, 3.0], 0.5), Some(2.0));
        assert_eq!(percentile(&[4.0, 1.0], 0.0), Some(1.0));
        assert_eq!(percentile(&[4.0, 1.0], 7.0), Some(4.0));
    }

    #[test]
    fn percentile_in_place_sorts() {
        let mut v = vec![3.0, 1.0, 2.0];
        assert_eq!(percentile_in_place(&mut v, 1.0), Some(3.0));
        assert_eq!(v, [1.0, 2.0, 3.0]);
    }

    #[test]
    fn median_odd_even_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }
}
