//! netsim's timeline parser (`"wifi 5s, offline 10s, fast-4g"`). Invariants:
//! any text parses or is an error, never a panic; an accepted timeline prints
//! as text that parses again to the same segments (durations at millisecond
//! precision); querying it at any instant, up to `Duration::MAX`, does not
//! panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::time::Duration;
use tandem_netsim::{Step, Timeline};

fn names(t: &Timeline) -> Vec<String> {
    t.segments()
        .iter()
        .map(|s| match &s.step {
            Step::Conditions(c) => c.name.clone(),
            Step::Reset => "reset".into(),
        })
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(t) = Timeline::parse(src) else {
        return;
    };
    let printed = t.to_string();
    let again = Timeline::parse(&printed)
        .unwrap_or_else(|e| panic!("`{src}` printed as `{printed}`, which does not parse: {e}"));
    assert_eq!(names(&t), names(&again));
    for at in [
        Duration::ZERO,
        Duration::from_millis(1500),
        Duration::from_secs(u64::MAX / 2),
        Duration::MAX,
    ] {
        let _ = t.config_at(at);
    }
    let _ = t.reset_times();
});
