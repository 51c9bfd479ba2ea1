//! Comparing two generations' outputs.

/// The first position where `a` and `b` differ; where one is a prefix of the
/// other, the shorter one's length. None when they are equal.
pub fn first_difference<T: PartialEq>(a: &[T], b: &[T]) -> Option<usize> {
    let n = a.len().min(b.len());
    (0..n)
        .find(|&i| a[i] != b[i])
        .or((a.len() != b.len()).then_some(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_difference_finds_divergence_and_length_mismatch() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 9, 3]), Some(1));
        assert_eq!(first_difference(&[1, 2], &[1, 2, 3]), Some(2));
        assert_eq!(first_difference::<u32>(&[], &[]), None);
    }
}
