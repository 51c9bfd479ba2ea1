//! Which host names mean "this machine": the one rule behind the edge's
//! loopback-only checks: plain-text `http://` to the verifier
//! ([`crate::EdgeConfig::validate`]) and the `Host` allow-list of the local
//! OpenAI server (`tandem_edge_http::openai`).
//!
//! An IP literal is loopback when [`std::net::IpAddr::is_loopback`] says so
//! (127.0.0.0/8, `::1`), the same test the verifier applies to its
//! `insecure_loopback` listen address; the only name is `localhost` (RFC 6761
//! reserves it for loopback). Anything else, including names that merely
//! resolve to 127.0.0.1 today, is not: DNS can change under a running process
//! (that is what DNS rebinding exploits).

use http::uri::{Authority, Uri};
use std::net::IpAddr;

/// True when `host` (a bare host: `127.0.0.1`, `localhost`, `::1` or `[::1]`;
/// no port) names this machine's loopback interface.
pub fn is_loopback_host(host: &str) -> bool {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    match bare.parse::<IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => bare.eq_ignore_ascii_case("localhost"),
    }
}

/// The host of `authority` (`host[:port]`, as in an HTTP `Host` header), or
/// `None` when it does not parse.
pub fn authority_host(authority: &str) -> Option<String> {
    authority
        .parse::<Authority>()
        .ok()
        .map(|a| a.host().to_string())
}

/// The host of an absolute URL (`scheme://host[:port]/...`), or `None` when it
/// does not parse or has none.
pub fn url_host(url: &str) -> Option<String> {
    url.parse::<Uri>()
        .ok()
        .and_then(|u| u.host().map(str::to_string))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_and_literals() {
        for h in [
            "127.0.0.1",
            "127.9.8.7",
            "localhost",
            "LocalHost",
            "::1",
            "[::1]",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in [
            "10.0.0.1",
            "0.0.0.0",
            "::",
            "[::]",
            "localhost.evil.example",
            "evil.example",
            "127.0.0.1.nip.io",
            "",
        ] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

    #[test]
    fn hosts_of_urls_and_authorities() {
        assert_eq!(
            url_host("http://127.0.0.1:7443").as_deref(),
            Some("127.0.0.1")
        );
        assert_eq!(url_host("http://[::1]:7443/x").as_deref(), Some("[::1]"));
        assert_eq!(
            url_host("http://user@evil.example:1").as_deref(),
            Some("evil.example")
        );
        assert_eq!(url_host("not a url"), None);
        assert_eq!(
            authority_host("localhost:8080").as_deref(),
            Some("localhost")
        );
        assert_eq!(authority_host("[::1]:8080").as_deref(), Some("[::1]"));
        assert_eq!(
            authority_host("evil.example").as_deref(),
            Some("evil.example")
        );
        assert_eq!(authority_host("a b"), None);
    }
}
