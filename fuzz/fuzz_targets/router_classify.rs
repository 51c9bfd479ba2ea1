//! Router classification with the built-in policy. Invariants: no panic on
//! any text; every entity and category span lies within the text, on char
//! boundaries, with start < end.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use tandem_router::{Policy, RouteContext};

fn policy() -> &'static Policy {
    static POLICY: OnceLock<Policy> = OnceLock::new();
    POLICY.get_or_init(Policy::builtin_default)
}

fn check_span(text: &str, what: &str, start: usize, end: usize) {
    assert!(
        start < end && end <= text.len(),
        "{what} span {start}..{end} outside a text of {} bytes",
        text.len()
    );
    assert!(
        text.is_char_boundary(start) && text.is_char_boundary(end),
        "{what} span {start}..{end} is not on char boundaries"
    );
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let p = policy();
    let raw = p.classify_raw(&text);
    for e in &raw.entities {
        check_span(&text, e.kind.as_str(), e.start, e.end);
    }
    for c in &raw.categories {
        check_span(&text, &c.category, c.start, c.end);
    }
    let d = p.decide(&text, &RouteContext::default());
    for e in &d.entities {
        check_span(&text, e.kind.as_str(), e.start, e.end);
    }
});
