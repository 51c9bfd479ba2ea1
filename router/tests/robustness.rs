//! Property tests: any text, however odd, classifies without panicking and
//! yields well-formed spans (inside the text, on char boundaries, sorted,
//! non-overlapping, scores in [0, 1]).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::sync::OnceLock;

use proptest::prelude::*;
use tandem_router::{Policy, RouteContext};

/// Pieces that exercise every recognizer's edges when glued together.
fn piece() -> impl Strategy<Value = String> {
    prop_oneof![
        "[0-9]{1,20}",
        "[0-9 \\-.()+/:]{1,12}",
        "[A-Za-z]{1,8}",
        "[a-f0-9:]{1,16}",
        Just("身份证".to_string()),
        Just("卡号".to_string()),
        Just("我叫".to_string()),
        Just("姓名：".to_string()),
        Just("密码是".to_string()),
        Just("password=".to_string()),
        Just("my name is ".to_string()),
        Just("card ".to_string()),
        Just("@".to_string()),
        Just("-----BEGIN PRIVATE KEY-----".to_string()),
        Just("-----END".to_string()),
        Just("eyJ".to_string()),
        Just("://".to_string()),
        Just("X".to_string()),
        Just("#".to_string()),
        Just(" at ".to_string()),
        Just("[at]".to_string()),
        Just(".co.com".to_string()),
        Just("\u{fffd}".to_string()),
        "[\\u{4e00}-\\u{9fa5}]{1,4}",
        "\\PC{1,6}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]
    #[test]
    fn spans_are_well_formed(parts in prop::collection::vec(piece(), 0..24)) {
        let text: String = parts.concat();
        static POLICY: OnceLock<Policy> = OnceLock::new();
        let policy = POLICY.get_or_init(Policy::builtin_default);
        let d = policy.decide(&text, &RouteContext::default());
        let mut last_end = 0;
        for e in &d.entities {
            prop_assert!(e.start < e.end && e.end <= text.len());
            prop_assert!(text.is_char_boundary(e.start) && text.is_char_boundary(e.end));
            prop_assert!(e.start >= last_end, "overlap or unsorted: {d}");
            prop_assert!((0.0..=1.0).contains(&e.score));
            last_end = e.end;
        }
        let raw = policy.classify_raw(&text);
        for e in &raw.entities {
            prop_assert!(text.is_char_boundary(e.start) && text.is_char_boundary(e.end));
        }
        for c in &raw.categories {
            prop_assert!(text.is_char_boundary(c.start) && text.is_char_boundary(c.end));
        }
    }
}

/// The obfuscated-address check looked 40 bytes past a `#` form for an `@`
/// and sliced there without rounding to a char boundary (a fuzz find: the
/// lossy-decoded input below panicked in `check_obfuscated_email`).
#[test]
fn a_hash_address_followed_by_multibyte_text_classifies() {
    let policy = Policy::builtin_default();
    let text = "def \u{fffd}.local add(013100, MACb  # teonsample.co.com\u{fffd}b2\u{fffd}456";
    for pad in 0..4 {
        let t = format!("{}{text}{}", "x".repeat(pad), "\u{fffd}".repeat(20));
        let d = policy.decide(&t, &RouteContext::default());
        for e in &d.entities {
            assert!(t.is_char_boundary(e.start) && t.is_char_boundary(e.end));
        }
    }
    let lossy = String::from_utf8_lossy(include_bytes!(
        "../../fuzz/seeds/router_classify/crash-hash-email-boundary.bin"
    ));
    policy.decide(&lossy, &RouteContext::default());
}
