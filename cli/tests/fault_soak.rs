//! The fault soak's short version (issue 19, item 8): `tandem bench soak` with
//! 8 device sessions for 35 s against one verifier through netsim (jitter,
//! loss, two resets, one outage) with one verifier SIGKILL and restart, on the
//! real models. Asserts the invariants from `--json`, never a timing: every
//! generation completed, every verified token the target's greedy choice given
//! what was streamed before it, nothing streamed twice or lost, provisional
//! reports exact, no panic. The 10-minute, 32-session run is recorded in
//! docs/verifier.md ("Fault soak").
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use serde_json::Value;
use std::process::Command;

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("`{key}` is not an unsigned integer in {v}"))
}

#[test]
fn thirty_five_seconds_of_faults_keep_every_invariant() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "bench",
            "soak",
            "--json",
            "--sessions",
            "8",
            "--duration",
            "35s",
            "--outages",
            "1",
            "--outage-length",
            "6s",
            "--resets",
            "2",
            "--kills",
            "1",
            "--prompt-count",
            "4",
            "--max-tokens",
            "12",
            "--rss-every",
            "5s",
            "--out",
        ])
        .arg(out_dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let r: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no JSON report ({e}); stderr:\n{stderr}"));
    assert!(
        out.status.success() && r["ok"] == true,
        "the soak failed: {}\nstderr:\n{stderr}",
        r["failures"]
    );
    assert_eq!(r["schema_version"], 3);

    // The faults were applied: one outage, two resets, one kill and restart.
    let faults = &r["faults"];
    assert_eq!(faults["outages"].as_array().unwrap().len(), 1, "{faults}");
    assert_eq!(
        faults["resets_at_s"].as_array().unwrap().len(),
        2,
        "{faults}"
    );
    assert_eq!(faults["kills"].as_array().unwrap().len(), 1, "{faults}");

    // Every generation started was completed and checked.
    let g = &r["generations"];
    assert!(u(g, "started") >= 8, "every device starts one: {g}");
    assert_eq!(u(g, "completed"), u(g, "started"), "{g}");
    for key in ["failed", "cancelled", "check_errors"] {
        assert_eq!(u(g, key), 0, "{key}: {g}");
    }
    let t = &r["tokens"];
    assert_eq!(u(t, "verified") + u(t, "provisional"), u(t, "total"), "{t}");
    assert!(u(t, "verified") > 0, "{t}");

    // The invariants, each 0.
    let inv = &r["invariants"];
    for key in [
        "incomplete_generations",
        "verified_differing",
        "duplicated_or_lost",
        "misreported_provisional",
        "unreported_provisional",
        "panics_verifier",
        "panics_edge",
        "device_errors",
        "hung_devices",
    ] {
        assert_eq!(u(inv, key), 0, "{key}: {inv}");
    }
    assert!(!stderr.contains("panicked"), "a panic on stderr:\n{stderr}");

    // RSS was sampled for both verifier processes and for the devices (35 s
    // is too short to judge a trend; the 10-minute run does).
    let rss = &r["rss"];
    assert_eq!(rss["verifier"].as_array().unwrap().len(), 2, "{rss}");
    for series in rss["verifier"].as_array().unwrap() {
        assert!(u(series, "max_bytes") > 0, "{series}");
        // Judged on anonymous memory: the GGUF's file-backed pages are
        // reported apart.
        let measure = series["measure"].as_str().unwrap();
        assert!(measure.starts_with("RssAnon"), "{series}");
    }
    let files = rss["verifier_file_max_bytes"].as_array().unwrap();
    assert_eq!(files.len(), 2, "{rss}");
    assert!(files.iter().all(|f| f.as_u64().unwrap() > 0), "{rss}");
    assert_eq!(
        rss["edge"]["measure"], "RssAnon - kept conversations",
        "{rss}"
    );
    assert!(u(&rss["edge"], "max_bytes") > 0, "{rss}");

    // The per-generation log is there, one line per generation.
    let log = std::fs::read_to_string(out_dir.path().join("soak-generations.jsonl")).unwrap();
    assert_eq!(log.lines().count() as u64, u(g, "started"));
}
