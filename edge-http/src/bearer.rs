//! Bearer tokens on the edge's HTTP APIs (the admin token of [`crate::admin`],
//! the optional API key of [`crate::openai`]): reading `Authorization:
//! Bearer <token>` and comparing it with the expected token, by the one
//! convention both ends share ([`tandem_proto::bearer`]: SHA-256 digests
//! compared in constant time, independent of either token's length).

use axum::http::{header, HeaderMap};
use tandem_proto::bearer::{token, TokenDigest};

/// The token of `Authorization: Bearer <token>` (surrounding blanks trimmed),
/// if the request carries one.
pub fn presented(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(token)
}

/// True when `presented` equals `expected`, in time independent of both
/// contents and lengths.
pub fn matches(presented: &str, expected: &str) -> bool {
    TokenDigest::of(expected).matches(presented)
}

#[cfg(test)]
mod tests {
    use super::*;

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
