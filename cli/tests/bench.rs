//! `tandem bench` as a user runs it: the built binary on the real models.
//! The models are required (CI fetches them); a missing model fails the test.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use serde_json::Value;
use std::process::Command;

fn tandem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
}

fn f(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("`{key}` is not a number in {v}"))
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("`{key}` is not an unsigned integer in {v}"))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

#[test]
fn quick_json_run_has_sane_figures_and_identical_speculative_output() {
    let out = tandem()
        .args([
            "bench",
            "--quick",
            "--json",
            "--models",
            "draft",
            "--engines",
            "tandem",
            "--proposers",
            "draft,lookup",
            "--draft-kv",
            "f16,int8",
            // Two prompts (of --quick's three) × five generations keep this
            // test short; speculative_real.rs covers the prompt set.
            "--spec-prompts",
            "2",
            // A short prompt and three rows of the cost curve: the default
            // curve after 128 tokens is human_tables_…'s.
            "--prompt-tokens",
            "64",
            "--ks",
            "1,5,17",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();

    assert_eq!(r["schema_version"], 2);
    assert_eq!(r["ok"], true);
    assert_eq!(r["settings"]["quick"], true);
    let threads = u(&r["settings"], "threads");
    assert!(threads >= 1);
    assert_eq!(u(&r["settings"], "repeats"), 2);
    assert_eq!(u(&r["settings"], "rounds"), 1);
    let decode_tokens = u(&r["settings"], "decode_tokens");
    assert!(decode_tokens >= 32);
    assert_eq!(r["settings"]["verify_ks"], serde_json::json!([1, 5, 17]));
    assert_eq!(u(&r["settings"], "prompt_tokens"), 64);
    assert!(r["machine"]["logical_cpus"].as_u64().unwrap() >= 1);

    let models = r["models"].as_array().unwrap();
    assert_eq!(models.len(), 1);
    let m = &models[0];
    assert_eq!(m["model"], "draft");
    let gguf = u(m, "gguf_bytes");
    assert_eq!(
        gguf,
        std::fs::metadata(m["path"].as_str().unwrap())
            .unwrap()
            .len()
    );
    let engines = m["engines"].as_array().unwrap();
    assert_eq!(engines.len(), 1);
    let e = &engines[0];
    assert_eq!(e["engine"], "tandem");
    assert_eq!(e["status"], "ok", "{e}");
    assert_eq!(u(e, "threads"), threads);
    assert!(f(e, "load_ms") >= 0.0);
    assert_eq!(u(e, "prefill_tokens"), 64);
    assert!(f(e, "prefill_tok_s") > 0.0);
    assert_eq!(u(e, "decode_tokens"), decode_tokens);
    // A 0.5B model at 1 token/s or 100,000 tokens/s would be a broken clock or
    // a loop that did not run.
    let decode = f(e, "decode_tok_s");
    assert!(decode > 1.0 && decode < 100_000.0, "decode {decode} tok/s");
    assert_eq!(u(e, "verify_context"), 64);
    let verify = e["verify"].as_array().unwrap();
    let ks: Vec<u64> = verify.iter().map(|v| u(v, "k")).collect();
    assert_eq!(ks, [1, 5, 17]);
    let ms1 = f(&verify[0], "ms");
    assert!(ms1 > 0.0);
    for v in verify {
        assert!(f(v, "ms") > 0.0);
        assert!(
            close(f(v, "cost_ratio"), f(v, "ms") / ms1),
            "cost_ratio is not ms/ms(k=1): {v}"
        );
    }
    // Tandem also times the last-position-only forward (candle's work).
    let last = e["verify_last_only"].as_array().unwrap();
    let lks: Vec<u64> = last.iter().map(|v| u(v, "k")).collect();
    assert_eq!(lks, ks);
    for v in last {
        assert!(f(v, "ms") > 0.0);
    }
    let peak = u(e, "peak_rss_bytes");
    assert!(peak >= u(e, "rss_after_load_bytes") && peak > 0);
    assert!(close(f(e, "rss_over_gguf"), peak as f64 / gguf as f64));
    assert!(
        m["ratios"].as_object().unwrap().is_empty(),
        "no other engine ran, so no ratios: {}",
        m["ratios"]
    );

    assert_eq!(
        r["settings"]["spec_proposers"],
        serde_json::json!(["draft", "lookup"])
    );
    assert_eq!(
        r["settings"]["spec_draft_kv"],
        serde_json::json!(["f16", "int8"])
    );
    // One report per (proposer, draft KV precision), proposer major.
    let all = r["speculative"].as_array().unwrap();
    let names: Vec<(&str, &str)> = all
        .iter()
        .map(|s| {
            (
                s["proposer"].as_str().unwrap(),
                s["draft_kv"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        names,
        [
            ("draft", "f16"),
            ("draft", "int8"),
            ("lookup", "f16"),
            ("lookup", "int8")
        ]
    );
    for s in all {
        check_speculative_report(s);
        // The real draft: 24 layers, K and V of 2 heads × 64 values.
        let bytes = match s["draft_kv"].as_str().unwrap() {
            "f32" => 24 * 2 * 2 * 64 * 4,
            "f16" => 24 * 2 * 2 * 64 * 2,
            _ => 24 * 2 * 2 * (64 + 4),
        };
        assert_eq!(u(s, "draft_kv_bytes_per_token"), bytes, "{}", s["draft_kv"]);
        // Every report sees the same target-only runs.
        assert_eq!(s["target_only"], all[0]["target_only"]);
    }
    // The draft proposer drafts every round with the draft model, at either
    // precision; lookup never runs it (so its precision changes nothing).
    let rounds = |s: &Value, who: &str| u(&s["by_proposer"][who], "rounds");
    for draft in &all[0..2] {
        assert_eq!(rounds(draft, "draft"), u(draft, "rounds"));
    }
    let lookup = &all[2];
    assert_eq!(rounds(lookup, "draft"), 0);
    assert_eq!(
        rounds(lookup, "lookup") + u(&lookup["by_proposer"], "none_rounds"),
        u(lookup, "rounds")
    );
    assert_eq!(lookup["accepted"], all[3]["accepted"]);
}

/// One proposer's report: identical output, figures that add up.
fn check_speculative_report(s: &Value) {
    let who = s["proposer"].as_str().unwrap();
    assert_eq!(s["prompt_set"], "default", "{who}");
    assert!(!s["isa"].as_str().unwrap().is_empty(), "{who}");
    assert_eq!(u(s, "prompts"), 2);
    assert_eq!(u(s, "k"), 4);
    assert_eq!(
        s["identical"], true,
        "{who}: speculative output differs: {s}"
    );
    assert!(s["mismatches"].as_array().unwrap().is_empty());
    for mode in ["target_only", "speculative"] {
        let t = &s[mode];
        assert!(u(t, "tokens") > 0);
        assert!(f(t, "seconds") > 0.0);
        assert!(close(
            f(t, "tok_s"),
            u(t, "tokens") as f64 / f(t, "seconds")
        ));
    }
    assert!(close(
        f(s, "speedup"),
        f(&s["speculative"], "tok_s") / f(&s["target_only"], "tok_s")
    ));
    let (drafted, accepted, rounds) = (u(s, "drafted"), u(s, "accepted"), u(s, "rounds"));
    assert!(rounds > 0 && accepted <= drafted, "{who}");
    if drafted > 0 {
        assert!(close(
            f(s, "acceptance_rate"),
            accepted as f64 / drafted as f64
        ));
    }
    assert!(close(
        f(s, "mean_accepted_len"),
        accepted as f64 / rounds as f64
    ));
    assert!(f(s, "mean_accepted_len") <= 4.0);
    let b = &s["by_proposer"];
    assert_eq!(
        u(&b["draft"], "rounds") + u(&b["lookup"], "rounds") + u(b, "none_rounds"),
        rounds,
        "{who}"
    );
    assert_eq!(
        u(&b["draft"], "accepted") + u(&b["lookup"], "accepted"),
        accepted
    );
    let per = s["per_prompt"].as_array().unwrap();
    assert_eq!(per.len(), 2);
    let mut sum_tokens = 0;
    for p in per {
        assert_eq!(p["identical"], true, "{who}: {p}");
        assert_eq!(u(p, "target_tokens"), u(p, "speculative_tokens"));
        assert!(
            u(p, "target_tokens") <= 32,
            "--quick caps outputs at 32 tokens"
        );
        sum_tokens += u(p, "target_tokens");
    }
    assert_eq!(sum_tokens, u(&s["target_only"], "tokens"));
}

#[test]
fn human_tables_show_each_engine_and_the_cost_curve() {
    let out = tandem()
        .args([
            "bench",
            "--models",
            "draft",
            "--engines",
            "tandem,llama-cpp",
            "--repeats",
            "1",
            "--rounds",
            "2",
            "--decode-tokens",
            "16",
            "--spec-prompts",
            "0",
        ])
        // An interpreter that does not exist: the llama.cpp column must say
        // "not installed" and the run must still succeed.
        .env("TANDEM_PYTHON", "/nonexistent/python3")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "draft", "decode/s", "c(5)", "c(17)", "c(64)", "peak MB", "RSS/GGUF",
    ] {
        assert!(stdout.contains(needle), "missing `{needle}` in:\n{stdout}");
    }
    let tandem_row = stdout
        .lines()
        .find(|l| l.starts_with("  tandem "))
        .unwrap_or_else(|| panic!("no tandem row in:\n{stdout}"));
    // engine, load, prefill, decode, 8 cost ratios (k = 2..64), peak MB, RSS/GGUF
    assert_eq!(tandem_row.split_whitespace().count(), 14, "{tandem_row}");
    assert!(
        stdout
            .lines()
            .any(|l| l.trim_start().starts_with("llama-cpp") && l.contains("not installed")),
        "{stdout}"
    );
    assert!(!stdout.contains("speculative"), "{stdout}");
    // Two interleaved rounds: announced, and tandem measured twice while the
    // missing llama.cpp is tried once.
    assert!(stdout.contains("2 interleaved rounds"), "{stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for needle in ["draft × tandem (round 1/2)", "draft × tandem (round 2/2)"] {
        assert!(stderr.contains(needle), "missing `{needle}` in:\n{stderr}");
    }
    assert_eq!(stderr.matches("× llama-cpp").count(), 1, "{stderr}");
}

/// `--prompts default,editing`: one speculative table per prompt set, each
/// named, the editing set's long prompts included, output identical to
/// target-only in both.
#[test]
fn speculative_tables_are_per_prompt_set() {
    let out = tandem()
        .args([
            "bench",
            "--quick",
            "--models",
            "draft",
            "--engines",
            "tandem",
            "--repeats",
            "1",
            "--spec-prompts",
            "1",
            "--proposers",
            "lookup,auto",
            "--prompts",
            "default,editing",
            // The micro measurement is not this test's subject: keep it small.
            "--prompt-tokens",
            "16",
            "--ks",
            "1",
            "--decode-tokens",
            "4",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let at = |needle: &str| {
        stdout
            .find(needle)
            .unwrap_or_else(|| panic!("missing `{needle}` in:\n{stdout}"))
    };
    let general = at("local speculative decoding, prompt set default (");
    let editing = at("local speculative decoding, prompt set editing (");
    assert!(general < editing, "{stdout}");
    // Each table: its target-only row, then one row per proposer, each identical.
    for (from, to) in [(general, editing), (editing, stdout.len())] {
        let table = &stdout[from..to];
        assert_eq!(table.matches("  target only ").count(), 1, "{table}");
        for proposer in ["  lookup  proposer", "  auto    proposer"] {
            assert_eq!(table.matches(proposer).count(), 1, "{table}");
        }
        assert_eq!(
            table
                .matches("output identical to target-only on 1/1 prompts")
                .count(),
            2,
            "{table}"
        );
    }
}

#[test]
fn bad_arguments_fail_with_a_clear_message() {
    for (args, needle) in [
        (vec!["--k", "0"], "--k must be in 1..=16"),
        (vec!["--k", "17"], "--k must be in 1..=16"),
        (vec!["--repeats", "0"], "--repeats must be at least 1"),
        (vec!["--rounds", "0"], "--rounds must be at least 1"),
        (vec!["--engines", "gpu"], "invalid value 'gpu'"),
        (vec!["--ks", "2,5"], "--ks must start at 1"),
        (vec!["--ks", "1,5,5"], "--ks must be strictly increasing"),
        (vec!["--ks", "1,300"], "--ks entries must be at most 256"),
        (
            vec!["--prompt-tokens", "0"],
            "--prompt-tokens must be in 1..=2048",
        ),
        (
            vec!["--prompt-tokens", "4096"],
            "--prompt-tokens must be in 1..=2048",
        ),
        (
            vec!["--prompts", "editing,/nonexistent/set.jsonl"],
            "reading prompt set /nonexistent/set.jsonl (built in: default, editing, fim)",
        ),
    ] {
        let out = tandem().arg("bench").args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// `tandem bench verifier --quick --json`: one verifier per configuration, the
/// real target behind it, simulated devices replaying drafts recorded from the
/// real draft model (recorded on the first run, then cached). Checks the
/// document's shape and, above all, that every replayed verdict equals the
/// recorded greedy verdict, with batching on and off.
#[test]
fn verifier_quick_json_replays_every_verdict_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("capacity.svg");
    let t = std::time::Instant::now();
    let out = tandem()
        .args(["bench", "verifier", "--quick", "--json", "--out"])
        .arg(dir.path())
        .arg("--plot")
        .arg(&plot)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench verifier failed: {stderr}");
    eprintln!(
        "bench verifier --quick: {:.1} s\n{stderr}",
        t.elapsed().as_secs_f64()
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();

    assert_eq!(r["schema_version"], 1);
    assert_eq!(r["ok"], true);
    let s = &r["settings"];
    assert_eq!(s["quick"], true);
    assert_eq!(s["devices"], serde_json::json!([1, 2]));
    assert_eq!(
        s["modes"],
        serde_json::json!(["spec-k4", "spec-mixed", "cloud-only"])
    );
    assert_eq!(s["batching"], serde_json::json!([true, false]));
    assert_eq!(u(s, "k"), 4);
    assert_eq!(u(s, "prompt_tail"), 16, "--quick replays short prompts");
    let tokens = u(s, "tokens");
    let target_bytes = u(&r["model"], "target_bytes");
    assert_eq!(
        target_bytes,
        std::fs::metadata(r["model"]["target_path"].as_str().unwrap())
            .unwrap()
            .len()
    );
    assert!(std::path::Path::new(r["trace"]["path"].as_str().unwrap()).exists());

    let cells = r["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 2 * 3 * 2, "N x modes x batching");
    let mut checked = 0;
    for c in cells {
        assert_eq!(c["ok"], true, "{c}");
        assert_eq!(u(c, "verdict_mismatches"), 0, "{c}");
        // Every verdict of the window was compared with the recording.
        let rounds = u(c, "rounds");
        assert!(rounds > 0, "{c}");
        assert_eq!(u(c, "verdicts_checked"), rounds, "{c}");
        checked += rounds;
        let n = u(c, "devices");
        let toks = u(c, "tokens");
        assert!(toks >= rounds, "each verdict emits at least one token: {c}");
        if c["mode"] == "cloud-only" {
            assert_eq!(rounds, n * tokens, "one step per token: {c}");
            assert_eq!(toks, rounds, "{c}");
        } else {
            assert_eq!(rounds % n, 0, "every device plays the same rounds: {c}");
        }
        let window = f(c, "window_s");
        assert!(window > 0.0, "{c}");
        assert!(close(f(c, "aggregate_tok_s"), toks as f64 / window), "{c}");
        for q in ["session_tok_s", "verify_ms", "open_ms"] {
            let q = &c[q];
            assert!(
                f(q, "min") <= f(q, "p50") && f(q, "p50") <= f(q, "p95"),
                "{c}"
            );
            assert!(f(q, "p95") <= f(q, "max") && f(q, "min") > 0.0, "{c}");
        }
        assert_eq!(u(&c["verify_ms"], "count"), rounds);
        assert_eq!(u(&c["open_ms"], "count"), n);
        assert!(f(c, "verifier_cpu_s") > 0.0, "{c}");
        assert!(close(
            f(c, "cpu_s_per_token"),
            f(c, "verifier_cpu_s") / toks as f64
        ));
        // The verifier maps the whole target and holds the sessions' KV.
        assert!(u(c, "peak_rss_bytes") > target_bytes / 2, "{c}");
        assert!(u(c, "kv_bytes") > 0, "{c}");
        // Rows per forward: null until the verifier exports the histogram.
        if !c["batch_rows"].is_null() {
            let b = &c["batch_rows"];
            assert!(u(b, "forwards") > 0, "{c}");
            assert!(f(b, "mean") >= 1.0, "{c}");
        }
    }
    assert_eq!(u(&r, "verdicts_checked"), checked);
    assert_eq!(u(&r, "verdict_mismatches"), 0);
    let names: Vec<&str> = r["ratios"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "batched_speedup",
            "p95_latency_growth",
            "rss_budget",
            "cpu_per_token_spec_vs_cloud"
        ]
    );
    for q in r["ratios"].as_array().unwrap() {
        assert_eq!(u(q, "devices"), 2, "quick: the largest N stands in: {q}");
        assert!(f(q, "value") > 0.0, "{q}");
    }
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(
        svg.starts_with("<svg") || svg.contains("<svg"),
        "not an SVG"
    );
    assert!(svg.contains("spec-k4 batched") && svg.contains("cloud-only unbatched"));
}

/// `--draft-model`/`--target-model` put the user's files in the model rows
/// (names or paths), and the candle column loads each with candle's model of
/// its architecture: SmolLM2 (llama) and Gemma 3 side by side.
#[test]
fn user_named_models_of_other_families_are_measured_with_candles_matching_model() {
    let out = tandem()
        .args([
            "bench",
            "--quick",
            "--json",
            "--repeats",
            "1",
            "--decode-tokens",
            "8",
            // candle's forwards of 9..64 rows were two thirds of this test's
            // time; the cost curve has its own test above.
            "--ks",
            "1,5",
            // candle prefills at ~20 tokens/s here: a 32-token prompt, not 128.
            "--prompt-tokens",
            "32",
        ])
        .args(["--models", "draft,target", "--engines", "tandem,candle"])
        .args(["--draft-model", "smollm2", "--target-model", "gemma"])
        .args(["--spec-prompts", "0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let models = r["models"].as_array().unwrap();
    assert_eq!(models.len(), 2);
    for (m, file, module) in [
        (
            &models[0],
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "quantized_llama",
        ),
        (&models[1], "gemma-3-270m-q4_k_m.gguf", "quantized_gemma3"),
    ] {
        assert!(m["path"].as_str().unwrap().ends_with(file), "{m}");
        let engines = m["engines"].as_array().unwrap();
        for e in engines {
            assert_eq!(e["status"], "ok", "{e}");
            assert!(
                f(e, "decode_tok_s") > 0.0 && f(e, "prefill_tok_s") > 0.0,
                "{e}"
            );
        }
        let candle = engines.iter().find(|e| e["engine"] == "candle").unwrap();
        assert!(
            candle["version"].as_str().unwrap().contains(module),
            "{candle}"
        );
        assert!(m["ratios"]["tandem/candle"].is_object(), "{m}");
        // candle's gemma3 cannot verify blocks (k = 1 only, said in its version).
        let tandem = engines.iter().find(|e| e["engine"] == "tandem").unwrap();
        let ks: Vec<u64> = tandem["verify"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| u(v, "k"))
            .collect();
        assert_eq!(ks, [1, 5], "{tandem}");
    }
}
