//! The router's policy TOML parser. Invariant: any text is a policy or a
//! `PolicyError` (whose message renders), never a panic; an accepted policy
//! decides on sample text without a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_router::{Policy, RouteContext};

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    match Policy::from_toml_str(src) {
        Ok(policy) => {
            let text = "call 13800138000 or mail a.b@example.com; 我的身份证号是11010519491231002X";
            let _ = policy.decide(text, &RouteContext::default());
            let _ = policy.decide(src, &RouteContext::default());
        }
        Err(e) => {
            let _ = e.to_string();
            let _ = (e.line(), e.field());
        }
    }
});
