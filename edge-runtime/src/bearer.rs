//! Bearer tokens on the edge's HTTP APIs (the admin token of [`crate::admin`],
//! the optional API key of [`crate::openai`]): reading `Authorization:
//! Bearer <token>` and comparing it with the expected token.
//!
//! The comparison hashes both sides with SHA-256 and compares the digests in
//! constant time (`subtle`), so its time depends neither on where the first
//! differing byte is nor on either token's length (comparing the raw bytes
//! with `ct_eq` returns early on a length mismatch, which leaks the length).

use axum::http::{header, HeaderMap};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The token of `Authorization: Bearer <token>` (surrounding blanks trimmed),
/// if the request carries one.
pub fn presented(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// True when `presented` equals `expected`, in time independent of both
/// contents and lengths.
pub fn matches(presented: &str, expected: &str) -> bool {
    let a: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
    let b: [u8; 32] = Sha256::digest(expected.as_bytes()).into();
    bool::from(a.ct_eq(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_tokens_match_and_others_do_not() {
        assert!(matches("admin-token-0123456789", "admin-token-0123456789"));
        assert!(!matches("admin-token-012345678", "admin-token-0123456789"));
        assert!(!matches(
            "admin-token-01234567890",
            "admin-token-0123456789"
        ));
        assert!(!matches("", "admin-token-0123456789"));
        assert!(!matches("Admin-token-0123456789", "admin-token-0123456789"));
    }

    #[test]
    fn the_bearer_scheme_is_read_and_trimmed() {
        let mut h = HeaderMap::new();
        assert_eq!(presented(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer  abc ".parse().unwrap());
        assert_eq!(presented(&h), Some("abc"));
        h.insert(header::AUTHORIZATION, "Basic abc".parse().unwrap());
        assert_eq!(presented(&h), None);
    }
}
