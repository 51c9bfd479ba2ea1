//! `tandem lab` through the built binary: the quick matrix on a real pair
//! of another family than the built-in Qwen one (what CI runs: SmolLM2-135M
//! Q4_1 drafting for its padded BF16 copy, named on the command line), plus
//! the matrix/config checks that need no model.

#![allow(clippy::unwrap_used)]
use std::process::Command;

fn tandem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
}

#[test]
fn quick_lab_on_a_llama_pair_writes_report_csv_plots_and_greedy_runs_equal_target_only() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("lab");
    // The target: SmolLM2 written back as BF16 (F16 has no SIMD kernel: a
    // slower lab) with 64 padding rows (a
    // non-trivial pair whose embedding tables differ, as Qwen2.5 0.5B/7B).
    let draft = tandem_fetch::models_dir().join(tandem_fetch::ModelSpec::smollm2().file_name);
    let target = dir.path().join("smollm2-bf16-padded.gguf");
    tandem_model::testing::write_dequantized(
        &draft,
        &target,
        candle_core::quantized::GgmlDType::BF16,
        64,
    )
    .unwrap();
    let t = std::time::Instant::now();
    let o = tandem()
        .args([
            "lab",
            "--quick",
            "--draft-model",
            "smollm2",
            "--target-model",
        ])
        .arg(&target)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "tandem lab --quick failed: {stderr}");
    eprintln!("tandem lab --quick: {:.0} s", t.elapsed().as_secs_f64());

    // summary.csv: one row per (mode, profile); every greedy row = target-only.
    let csv = std::fs::read_to_string(out.join("summary.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let (mode, profile, runs, errors, matches, tps) = (
        col("mode"),
        col("profile"),
        col("runs"),
        col("errors"),
        col("matches_target"),
        col("tokens_per_s"),
    );
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    let modes = [
        "target-only",
        "spec-k4",
        "auto-k4",
        "adaptive",
        "pipeline-k4",
        "gated-k4-0.9",
    ];
    for m in modes {
        for p in ["lan", "fast-4g"] {
            let r = rows
                .iter()
                .find(|r| r[mode] == m && r[profile] == p)
                .unwrap_or_else(|| panic!("no row {m} / {p} in\n{csv}"));
            assert_eq!(r[runs], "2", "{csv}");
            assert_eq!(r[errors], "0", "{csv}");
            assert_eq!(
                r[matches], "yes",
                "greedy identity broken: {m} / {p}\n{csv}"
            );
            assert!(r[tps].parse::<f64>().unwrap() > 0.0, "{csv}");
        }
    }
    let draft = rows.iter().find(|r| r[mode] == "draft-only").unwrap();
    assert_eq!(draft[matches], "n/a");
    assert_eq!(rows.len(), 13, "{csv}");

    // runs.jsonl: one line per run with the per-run measurements.
    let runs_text = std::fs::read_to_string(out.join("runs.jsonl")).unwrap();
    let recs: Vec<serde_json::Value> = runs_text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 26);
    for r in &recs {
        assert!(r["error"].is_null(), "{r}");
        assert!(r["generated"].as_u64().unwrap() > 0, "{r}");
        assert!(r["ttft_ms"].as_f64().unwrap() > 0.0);
        if r["mode"] == "spec-k4" {
            assert!(!r["round_log"].as_array().unwrap().is_empty());
            assert!(r["passes_per_token"].as_f64().unwrap() < 1.0, "{r}");
            // spec-kN is the draft model's, whatever the edge default proposer.
            assert!(
                r["proposers"]["draft"]["rounds"].as_u64().unwrap() > 0,
                "{r}"
            );
            assert_eq!(r["proposers"]["lookup"]["rounds"], 0, "{r}");
            assert_eq!(r["proposers"]["none_rounds"], 0, "{r}");
        }
        if r["mode"] == "auto-k4" {
            let p = &r["proposers"];
            let chosen = ["draft", "lookup"]
                .iter()
                .map(|s| p[s]["rounds"].as_u64().unwrap())
                .sum::<u64>()
                + p["none_rounds"].as_u64().unwrap();
            assert!(chosen > 0, "auto recorded no round: {r}");
        }
    }

    // Plots and the report that embeds them.
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        report.contains("- prompt set: lab (lab/prompts.jsonl, built in)"),
        "{report}"
    );
    for svg in [
        "tokens_per_s.svg",
        "tokens_per_s_vs_rtt.svg",
        "acceptance_by_position.svg",
        "verifier_passes_per_token.svg",
    ] {
        let s = std::fs::read_to_string(out.join(svg)).unwrap();
        assert!(s.contains("<svg") && s.contains("</svg>"), "{svg}");
        assert!(report.contains(&format!("]({svg})")), "{svg} not embedded");
    }
    let bars = std::fs::read_to_string(out.join("tokens_per_s.svg")).unwrap();
    assert!(
        bars.contains("fast-4g") && bars.contains("spec-k4"),
        "labels missing"
    );
    assert!(!report.contains("WARNING"), "{report}");
    for needle in [
        "machine:",
        "commit:",
        "draft (device):",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "target (verifier):",
        "smollm2-bf16-padded.gguf",
        "| / target-only |",
        "## Uncertainty-gated verification",
        "| lan | gated-k4-0.9 |",
        "## Proposers (lookup-kN and auto-kN vs spec-kN, the draft model)",
        "| fast-4g | auto-k4 |",
        "```toml",
    ] {
        assert!(report.contains(needle), "report lacks {needle:?}");
    }
}

#[test]
fn dry_run_prints_the_matrix_and_bad_configs_are_refused() {
    let o = tandem()
        .args(["lab", "--quick", "--dry-run"])
        .output()
        .unwrap();
    assert!(o.status.success());
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(s.contains("total\t26 runs, 2 prompts"), "{s}");
    assert!(s.contains("auto-k4\tlan\t2 runs"), "{s}");
    assert!(
        s.contains("prompt set\tlab (lab/prompts.jsonl, built in)"),
        "{s}"
    );
    assert!(s.contains("pipeline-k4\tfast-4g\t2 runs"), "{s}");

    // The shared sets by name: the editing set (its long prompts, no tags).
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("editing.toml");
    std::fs::write(
        &cfg,
        "prompts = \"editing\"\nprompt_limit = 3\nmodes = [\"target-only\", \"spec-k4\"]\nprofiles = [\"lan\"]\n",
    )
    .unwrap();
    let o = tandem()
        .args(["lab", "--dry-run", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        s.contains("prompt set\tediting (prompts/editing.jsonl, built in)"),
        "{s}"
    );
    assert!(s.contains("total\t6 runs, 3 prompts"), "{s}");

    // The default matrix: every shipped prompt id exists, the outage timeline parses.
    let o = tandem().args(["lab", "--dry-run"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("spec-k4\toutage"));

    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "modes = [\"spec-k99\"]\nprofiles = [\"lan\"]\n",
            "k must be in 1..=16",
        ),
        ("modes = [\"warp\"]\n", "unknown mode"),
        ("modes = [\"gated-k4\"]\n", "needs a confidence"),
        ("modes = [\"gated-k4-1.5\"]\n", "confidence must be in"),
        (
            "modes = [\"target-only\", \"gated-k4-0.9\"]\n[edge.gate]\nconfidence = 0.5\n",
            "the mode sets it (gated-kN-T)",
        ),
        (
            "modes = [\"target-only\"]\nprofiles = [\"moon\"]\n",
            "profile",
        ),
        (
            "modes = [\"target-only\", \"spec-k4\"]\nprofiles = [\"lan\"]\n[edge]\nproposer = \"lookup\"\n",
            "proposer: the lab sets it",
        ),
        ("modes = [\"lookup-k0\"]\n", "k must be in 1..=16"),
        (
            "modes = [\"spec-k4\"]\nprofiles = [\"lan\"]\n",
            "add \"target-only\"",
        ),
        (
            "modes = [\"target-only\"]\nprofiles = [\"lan\"]\nprompt_ids = [\"nope\"]\n",
            "no prompt with id",
        ),
        ("bogus = 1\n", "bogus"),
        (
            "modes = [\"target-only\"]\n[edge]\nverifier_url = \"http://x:1\"\n",
            "the lab sets it",
        ),
        (
            "modes = [\"target-only\"]\n[edge]\nopen_timeout_ms = 0\n",
            "timeouts",
        ),
        (
            "modes = [\"target-only\"]\n[edge]\nwarp_speed = 9\n",
            "warp_speed",
        ),
        (
            "modes = [\"target-only\"]\n[edge.speculation]\npipeline = true\n",
            "the mode sets it",
        ),
        (
            "modes = [\"target-only\"]\n[edge_by_mode.adaptive]\nk = 2\n",
            "the lab sets it",
        ),
        (
            "modes = [\"target-only\"]\n[edge_by_mode.adaptive]\nbreaker_failures = 2\n",
            "not a mode of this matrix",
        ),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let p = dir.path().join(format!("c{i}.toml"));
        std::fs::write(&p, text).unwrap();
        let o = tandem()
            .args(["lab", "--dry-run", "--config"])
            .arg(&p)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{text} was accepted");
        assert!(err.contains(want), "{text}: {err}");
    }
}

#[test]
fn shipped_prompt_set_has_30_plus_prompts_of_every_kind() {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../lab/prompts.jsonl"))
            .unwrap();
    let v: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(v.len() >= 30);
    for tag in ["code", "prose", "en", "zh", "short", "long"] {
        let n = v
            .iter()
            .filter(|p| p["tags"].as_array().unwrap().iter().any(|t| t == tag))
            .count();
        assert!(n >= 5, "only {n} prompts tagged {tag}");
    }
}

/// `[edge]` reaches the device process of every mode, `[edge_by_mode]` only its
/// mode: a model id the verifier does not serve is refused for spec-k4 only.
#[test]
fn edge_table_is_applied_to_the_device_per_mode() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("edge.toml");
    std::fs::write(
        &cfg,
        "prompt_ids = [\"code-rust-fizzbuzz\"]\nmax_tokens_cap = 4\n\
         modes = [\"target-only\", \"spec-k4\"]\nprofiles = [\"lan\"]\n\
         [edge]\nopen_timeout_ms = 60000\nbreaker_failures = 5\n\
         [edge.speculation]\nk_max = 8\n\
         [edge_by_mode.\"spec-k4\"]\nmodel_id = \"no-such-model\"\n",
    )
    .unwrap();
    let out = dir.path().join("lab");
    let t = std::time::Instant::now();
    let o = tandem()
        .args(["lab", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    eprintln!("tandem lab with [edge]: {:.0} s", t.elapsed().as_secs_f64());
    let recs: Vec<serde_json::Value> = std::fs::read_to_string(out.join("runs.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 2);
    for r in &recs {
        if r["mode"] == "spec-k4" {
            let e = r["error"].as_str().unwrap_or_default();
            assert!(e.contains("MODEL_MISMATCH"), "{r}");
        } else {
            assert!(r["error"].is_null(), "{r}");
            assert_eq!(r["generated"].as_u64().unwrap(), 4, "{r}");
        }
    }
    let written = std::fs::read_to_string(out.join("logs/edge-spec-k4.toml")).unwrap();
    assert!(written.contains("open_timeout_ms = 60000") && written.contains("k_max = 8"));
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(report.contains("no-such-model"), "settings recorded");
}
