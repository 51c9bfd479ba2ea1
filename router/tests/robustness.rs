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
