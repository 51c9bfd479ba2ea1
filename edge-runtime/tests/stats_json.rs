//! The JSON of `EdgeStats` (what `tandem generate --json`, serve-edge's
//! `tandem` object, the C ABI and the lab/bench reports carry) stays byte
//! for byte what it was: every key, in its order, with its value.

// Tests may unwrap (helpers outside #[test] functions included).
#![allow(clippy::unwrap_used)]
use serde_json::Value;
use tandem_edge::EdgeStats;

/// Sets every number of `v` to a distinct value (floats get a fraction) and
/// every bool to true.
fn distinct(v: &mut Value, n: &mut u64) {
    match v {
        Value::Number(x) => {
            *n += 1;
            *v = if x.is_f64() {
                Value::from(*n as f64 + 0.5)
            } else {
                Value::from(*n)
            };
        }
        Value::Bool(b) => *b = true,
        // In key order, whatever order the map keeps (serde_json's
        // `preserve_order`, which llguidance turns on in workspace builds,
        // keeps insertion order).
        Value::Object(m) => {
            let mut keys: Vec<String> = m.keys().cloned().collect();
            keys.sort();
            for k in keys {
                if let Some(x) = m.get_mut(&k) {
                    distinct(x, n);
                }
            }
        }
        _ => {}
    }
}

const GOLDEN: &str = include_str!("stats_json.golden");

#[test]
fn edge_stats_json_is_unchanged() {
    let mut v = serde_json::to_value(EdgeStats::default()).unwrap();
    distinct(&mut v, &mut 0);
    let stats: EdgeStats = serde_json::from_value(v).unwrap();
    let json = serde_json::to_string(&stats).unwrap();
    if std::env::var_os("TANDEM_WRITE_GOLDEN").is_some() {
        std::fs::write("tests/stats_json.golden", &json).unwrap();
    }
    assert_eq!(json, GOLDEN.trim_end());
    // The defaults: the same keys (those skipped when empty stay skipped).
    let keys = |j: &str| -> Vec<String> {
        let v: Value = serde_json::from_str(j).unwrap();
        v.as_object().unwrap().keys().cloned().collect()
    };
    let json = serde_json::to_string(&EdgeStats::default()).unwrap();
    assert_eq!(keys(&json), keys(GOLDEN));
}
