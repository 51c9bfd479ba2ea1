//! `tandem bench --soak DURATION` (the device soak) as a user runs it: a few
//! seconds on a tiny random model (with tokenizer) in windows of one second,
//! an injected hot device and the warm-up at load, bad flags refused, and the
//! verifier fault soak (`tandem bench soak`) still its own subcommand.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use serde_json::Value;
use std::path::Path;
use std::process::Command;
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};

fn tandem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
}

fn tiny(dir: &Path) -> String {
    let p = dir.join("tiny.gguf");
    let cfg = TinyConfig {
        tokenizer: true,
        ..TinyConfig::default()
    };
    write_tiny_qwen2(&p, &cfg).unwrap();
    p.display().to_string()
}

fn soak_json(draft: &str, extra: &[&str]) -> Value {
    let out = tandem()
        .args([
            "bench",
            "--soak",
            "3s",
            "--soak-window",
            "1s",
            "--soak-tokens",
            "8",
            "--soak-draft",
            draft,
            "--json",
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_short_soak_reports_windows_latency_and_decay() {
    let dir = tempfile::tempdir().unwrap();
    let draft = tiny(dir.path());
    let r = soak_json(&draft, &[]);
    let windows = r["windows"].as_array().unwrap();
    assert!(windows.len() >= 2, "{r}");
    let gens = r["generations"].as_array().unwrap();
    let counted: u64 = windows
        .iter()
        .map(|w| w["generations"].as_u64().unwrap())
        .sum();
    assert_eq!(counted as usize, gens.len());
    for g in gens {
        assert_eq!(g["tokens"], 8, "{g}");
        assert!(g["ttft_ms"].as_f64().unwrap() > 0.0);
    }
    for w in windows {
        assert!(w["decode_tok_s"].as_f64().unwrap() > 0.0, "{w}");
    }
    let first = windows[0]["decode_tok_s"].as_f64().unwrap();
    let last = windows[windows.len() - 1]["decode_tok_s"].as_f64().unwrap();
    let decay = r["decay"].as_f64().unwrap();
    assert!((decay - (first - last) / first).abs() < 1e-9, "{r}");
    assert!(r["duration_s"].as_f64().unwrap() >= 3.0);
    assert_eq!(r["warmup"], false);
    assert!(r["warmup_ms"].is_null());
    assert!(r["first_ttft_ms"].as_f64().unwrap() > 0.0);
    assert!(r["load_before"].as_array().is_some());

    // A hot device (injected), the warm-up at load, two threads asked for:
    // the draft runs on one.
    let hot = soak_json(
        &draft,
        &["--warmup", "--soak-thermal", "critical", "--threads", "2"],
    );
    assert_eq!(hot["warmup"], true);
    assert!(hot["warmup_ms"].as_f64().unwrap() > 0.0, "{hot}");
    assert_eq!(hot["device"]["thermal"], "critical");
    assert_eq!(hot["draft_threads"], 1);
    let cool = soak_json(&draft, &["--threads", "2"]);
    assert_eq!(cool["draft_threads"], 2);

    // The human table.
    let out = tandem()
        .args([
            "bench",
            "--soak",
            "2s",
            "--soak-window",
            "1s",
            "--soak-tokens",
            "4",
            "--soak-draft",
            &draft,
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("| window (1 s) | generations |"), "{text}");
    assert!(text.contains("decay (first - last) / first"), "{text}");
    assert!(text.contains("load average before"), "{text}");
}

#[test]
fn bad_soak_flags_are_refused_and_the_fault_soak_is_still_a_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let draft = tiny(dir.path());
    let err = |args: &[&str]| {
        let o = tandem().args(args).output().unwrap();
        assert!(!o.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let e = err(&["bench", "--soak", "0s", "--soak-draft", &draft]);
    assert!(e.contains("--soak must be positive"), "{e}");
    let e = err(&[
        "bench",
        "--soak",
        "1s",
        "--soak-battery",
        "101",
        "--soak-draft",
        &draft,
    ]);
    assert!(e.contains("battery_pct"), "{e}");
    let e = err(&["bench", "--soak", "1s", "--soak-thermal", "hot"]);
    assert!(e.contains("unknown thermal state"), "{e}");
    let e = err(&["bench", "--soak-tokens", "4"]);
    assert!(e.contains("--soak"), "{e}");
    let e = err(&["bench", "--soak", "1s", "--soak-draft", "/nonexistent.gguf"]);
    assert!(e.contains("nonexistent.gguf"), "{e}");
    let help = tandem().args(["bench", "soak", "--help"]).output().unwrap();
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("--sessions"));
}
