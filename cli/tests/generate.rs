//! `tandem generate` as a user runs it: the real models, greedy speculative
//! output equal to target-only output, JSON schema, and clear errors.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::{generate_json, tandem};

#[test]
fn speculative_json_equals_target_json() {
    let prompt = "Write a Rust function that returns the larger of two i32 values.";
    let t = generate_json(&["--mode", "target", "--prompt", prompt, "--max-tokens", "24"]);
    // The draft's KV cache in f32 (default f16, reported by the `auto` run
    // below): the precision changes acceptance, never the output.
    let s = generate_json(&[
        "--mode",
        "speculative",
        "--k",
        "5",
        "--draft-kv",
        "f32",
        "--prompt",
        prompt,
        "--max-tokens",
        "24",
    ]);
    assert_eq!(t["tokens"], s["tokens"]);
    assert_eq!(t["text"], s["text"]);
    assert_eq!(s["tokens"].as_array().unwrap().len(), 24);
    let st = &s["stats"];
    assert!(st["rounds"].as_u64().unwrap() >= 1);
    let acc = st["acceptance_rate"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&acc));
    assert_eq!(st["per_position"].as_array().unwrap().len(), 5);
    assert!(st["ttft_ms"].as_f64().unwrap() > 0.0);
    assert!(st["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(s["mode"], "speculative");
    assert_eq!(s["k"], 5);
    assert_eq!(s["proposer"], "draft");
    assert_eq!(s["draft_kv"], "f32");
    assert!(s["stats"]["draft_forwards"].as_u64().unwrap() > 0);
    assert_eq!(t["draft_kv"], serde_json::Value::Null, "no draft ran");
    // Prompt lookup and the per-round choice give the same tokens.
    for proposer in ["lookup", "auto"] {
        let p = generate_json(&[
            "--proposer",
            proposer,
            "--k",
            "5",
            "--prompt",
            prompt,
            "--max-tokens",
            "24",
        ]);
        assert_eq!(t["tokens"], p["tokens"], "--proposer {proposer}");
        assert_eq!(p["proposer"], proposer);
        assert_eq!(p["draft_kv"], "f16", "the default draft KV precision");
        let by = &p["stats"]["proposers"];
        let rounds = |who: &str| by[who]["rounds"].as_u64().unwrap();
        assert_eq!(
            rounds("draft") + rounds("lookup") + by["none_rounds"].as_u64().unwrap(),
            p["stats"]["rounds"].as_u64().unwrap(),
            "{p}"
        );
        if proposer == "lookup" {
            assert_eq!(rounds("draft"), 0);
            assert_eq!(p["stats"]["draft_forwards"], 0);
        }
    }
    // Draft-only is a different model: it must at least produce text.
    let d = generate_json(&["--mode", "draft", "--prompt", prompt, "--max-tokens", "8"]);
    assert_eq!(d["tokens"].as_array().unwrap().len(), 8);
}

#[test]
fn streaming_prints_text_then_stats() {
    let out = tandem()
        .args([
            "generate",
            "--mode",
            "speculative",
            "--max-tokens",
            "12",
            "--prompt",
            "Say hello in Chinese.",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!String::from_utf8_lossy(&out.stdout).trim().is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("acceptance") && err.contains("TTFT"), "{err}");
}

/// OpenAI's penalties and a logit bias change the target's greedy output,
/// and the speculative output under them is still the target's own (the
/// draft, the local loop and the verifier apply them alike).
#[test]
fn penalties_and_logit_bias_keep_speculative_output_the_targets() {
    let base = [
        "--raw",
        "--prompt",
        "fn main() {\n    let a = 1;\n    let b = 1;\n    let c = 1;\n",
        "--max-tokens",
        "24",
    ];
    let plain = generate_json(&[&["--mode", "target"], &base[..]].concat());
    // Ban the plain output's first token and make repeats costly.
    let first = plain["tokens"][0].as_u64().unwrap().to_string();
    let ban = format!("{first}=-100");
    let knobs = [
        "--frequency-penalty",
        "1.5",
        "--presence-penalty",
        "0.5",
        "--logit-bias",
        &ban,
    ];
    let t = generate_json(&[&["--mode", "target"], &base[..], &knobs[..]].concat());
    let s = generate_json(
        &[
            &["--mode", "speculative", "--k", "4"],
            &base[..],
            &knobs[..],
        ]
        .concat(),
    );
    assert_ne!(t["tokens"], plain["tokens"], "the knobs changed nothing");
    assert_ne!(
        t["tokens"][0], plain["tokens"][0],
        "the banned token came first"
    );
    assert_eq!(
        t["tokens"], s["tokens"],
        "speculative != target under penalties"
    );
    assert_eq!(s["sampling"]["frequency_penalty"], 1.5, "{}", s["sampling"]);
}

fn expect_error(args: &[&str], needle: &str) {
    let out = tandem().arg("generate").args(args).output().unwrap();
    assert!(!out.status.success(), "{args:?} should fail");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(needle),
        "{args:?}: stderr lacks {needle:?}: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_input_gets_clear_errors() {
    expect_error(&["--k", "0", "--prompt", "x"], "k = 0");
    expect_error(&["--k", "17", "--prompt", "x"], "k = 17");
    expect_error(&["--temperature", "-1", "--prompt", "x"], "temperature");
    expect_error(&["--prompt", "   "], "empty");
    expect_error(
        &["--presence-penalty", "3", "--prompt", "x"],
        "presence_penalty",
    );
    expect_error(
        &["--logit-bias", "17", "--prompt", "x"],
        "`17` is not TOKEN_ID=BIAS",
    );
    expect_error(
        &["--logit-bias", "17=-101", "--prompt", "x"],
        "--logit-bias",
    );
    expect_error(
        &["--proposer", "ngram", "--prompt", "x"],
        "unknown proposer",
    );
    expect_error(
        &["--draft-kv", "q4", "--prompt", "x"],
        "unknown KV precision",
    );
    expect_error(
        &[
            "--verifier",
            "https://127.0.0.1:9",
            "--proposer",
            "magic",
            "--prompt",
            "x",
        ],
        "expected draft, lookup or auto",
    );
    expect_error(
        &["--draft-model", "/nonexistent/x.gguf", "--prompt", "x"],
        "does not exist",
    );
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"GGUF but not really").unwrap();
    expect_error(
        &[
            "--mode",
            "draft",
            "--draft-model",
            junk.to_str().unwrap(),
            "--prompt",
            "x",
        ],
        "not a valid GGUF",
    );
    let long = "word ".repeat(100);
    expect_error(
        &["--mode", "draft", "--max-seq-len", "32", "--prompt", &long],
        "capacity",
    );
}

#[test]
fn structured_output_is_the_targets_own_under_the_schema_locally() {
    // The real pair on one schema: target-only and speculative (the draft
    // proposer) give the same tokens, and the text is valid JSON of it.
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("schema.json");
    std::fs::write(
        &schema,
        r#"{"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer"}, "langs": {"type": "array", "items": {"enum": ["rust", "c", "go"]}, "maxItems": 3}},
            "required": ["name", "age", "langs"], "additionalProperties": false}"#,
    )
    .unwrap();
    let schema = schema.to_str().unwrap();
    let prompt = "Describe a programmer as JSON.";
    let common = [
        "--json-schema",
        schema,
        "--prompt",
        prompt,
        "--max-tokens",
        "48",
    ];
    let t = generate_json(&[&["--mode", "target"], &common[..]].concat());
    let v: serde_json::Value =
        serde_json::from_str(t["text"].as_str().unwrap()).unwrap_or_else(|e| panic!("{e}: {t}"));
    assert!(v["name"].is_string() && v["age"].is_i64(), "{v}");
    let langs = v["langs"].as_array().unwrap();
    assert!(langs
        .iter()
        .all(|l| ["rust", "c", "go"].contains(&l.as_str().unwrap())));
    assert_eq!(v.as_object().unwrap().len(), 3, "{v}");
    assert_eq!(t["stop"], "stop", "{t}");
    // (auto, which also proposes by lookup, runs under a schema over the
    // network in edge-runtime/tests/proposers_real.rs, and lookup alone on
    // the tiny models in edge-runtime/tests/grammar.rs: CI time.)
    let s = generate_json(&[&["--proposer", "draft", "--k", "4"], &common[..]].concat());
    assert_eq!(s["tokens"], t["tokens"], "--proposer draft: {s}");
    // A regex and a Lark grammar (the draft alone: a few tokens).
    let lark = dir.path().join("answer.lark");
    std::fs::write(&lark, "start: (\"yes\" | \"no\") \".\"\n").unwrap();
    for flags in [
        ["--regex", "(yes|no)"],
        ["--grammar", lark.to_str().unwrap()],
    ] {
        let d = generate_json(
            &[
                &flags[..],
                &[
                    "--mode",
                    "draft",
                    "--prompt",
                    "Is water wet?",
                    "--max-tokens",
                    "8",
                ],
            ]
            .concat(),
        );
        let text = d["text"].as_str().unwrap();
        let ok: &[&str] = if flags[0] == "--regex" {
            &["yes", "no"]
        } else {
            &["yes.", "no."]
        };
        assert!(ok.contains(&text), "{flags:?}: {d}");
        assert_eq!(d["stop"], "stop", "{d}");
    }
    // A schema llguidance cannot compile is refused before any token.
    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        r##"{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}"##,
    )
    .unwrap();
    expect_error(
        &["--json-schema", bad.to_str().unwrap(), "--prompt", "x"],
        "invalid grammar",
    );
    expect_error(
        &["--regex", "a", "--grammar", "g.lark", "--prompt", "x"],
        "cannot be used with",
    );
}
