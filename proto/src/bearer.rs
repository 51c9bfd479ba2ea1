//! The bearer-token convention both ends use: a device sends
//! `authorization: Bearer <token>` (gRPC metadata, or the HTTP header on the
//! edge's and verifier's HTTP APIs), and the receiver compares it with the
//! tokens it knows.
//!
//! The comparison hashes both sides with SHA-256 and compares the digests in
//! constant time (`subtle`), so its time depends neither on where the first
//! differing byte is nor on either token's length (comparing the raw bytes
//! with `ct_eq` returns early on a length mismatch, which leaks the length).

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The token of an `authorization` value `Bearer <token>` (surrounding blanks
/// trimmed), if it is one.
pub fn token(authorization: &str) -> Option<&str> {
    authorization.strip_prefix("Bearer ").map(str::trim)
}

/// An expected token, kept as its SHA-256 digest.
#[derive(Clone)]
pub struct TokenDigest([u8; 32]);

impl TokenDigest {
    pub fn of(token: &str) -> Self {
        Self(Sha256::digest(token.as_bytes()).into())
    }

    /// Whether `presented` is the token, in time independent of both
    /// contents and lengths.
    pub fn matches(&self, presented: &str) -> bool {
        let h: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        bool::from(h.ct_eq(&self.0))
    }
}

impl std::fmt::Debug for TokenDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenDigest(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_tokens_match_and_others_do_not() {
        let want = TokenDigest::of("admin-token-0123456789");
        assert!(want.matches("admin-token-0123456789"));
        assert!(!want.matches("admin-token-012345678"));
        assert!(!want.matches("admin-token-01234567890"));
        assert!(!want.matches(""));
        assert!(!want.matches("Admin-token-0123456789"));
    }

    #[test]
    fn the_bearer_scheme_is_read_and_trimmed() {
        assert_eq!(token("Bearer  abc \t"), Some("abc"));
        assert_eq!(token("bearer abc"), None);
        assert_eq!(token("abc"), None);
        assert_eq!(token("Basic abc"), None);
    }
}
