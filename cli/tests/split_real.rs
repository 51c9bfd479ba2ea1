//! Split execution with the real pair and real processes: a `tandem serve-verifier`
//! child (1.5B target) and `tandem generate --verifier --split S` (this process
//! also loads the target and runs its layers [0, S)). Greedy output must equal
//! the target's own (`tandem generate --mode target`) for S = 0, 14 and 28 (= N),
//! and for the U-shape (--pin-head) at S = 14 and 28 (all-local: no round goes to
//! the verifier). Short: 24 tokens per generation.
#![allow(clippy::unwrap_used)]

mod common;

use common::{start_verifier, statuses, tandem, VerifierSpec};

const TOKEN: &str = "split-real-token-0123456789";
const PROMPT: &str = "Write a Rust function that returns the larger of two i32 values.";
const MAX_TOKENS: &str = "24";

fn json_of(out: std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn split_output_equals_the_target_for_s_0_14_28_and_the_u_shape_at_14_28() {
    let dir = tempfile::tempdir().unwrap();
    let expected = json_of(
        tandem()
            .args(["generate", "--mode", "target", "--json", "--prompt", PROMPT])
            .args(["--max-tokens", MAX_TOKENS])
            .output()
            .unwrap(),
    )["tokens"]
        .clone();
    assert_eq!(expected.as_array().unwrap().len(), 24);
    let v = start_verifier(
        dir.path(),
        &VerifierSpec {
            listen: "127.0.0.1:0".into(),
            model: "target",
            token: TOKEN,
            extra_top: "insecure_loopback = true",
            limits: "",
        },
    );
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    for (s, pin_head) in [(0, false), (14, false), (28, false), (14, true), (28, true)] {
        let mut cmd = tandem();
        cmd.args(["generate", "--json", "--no-privacy-router", "--k", "4"])
            .args(["--verifier", &format!("http://{}", v.grpc)])
            .arg("--token-file")
            .arg(&token_file)
            .args(["--split", &s.to_string()])
            .args(["--prompt", PROMPT, "--max-tokens", MAX_TOKENS]);
        if pin_head {
            cmd.arg("--pin-head");
        }
        let j = json_of(cmd.output().unwrap());
        assert_eq!(j["tokens"], expected, "s = {s}, pin_head = {pin_head}");
        assert!(statuses(&j).iter().all(|st| st == "verified"), "{j}");
        let sp = &j["stats"]["split"];
        assert_eq!(sp["layer"], s);
        assert_eq!(sp["n_layer"], 28);
        assert_eq!(sp["pin_head"], pin_head);
        assert_eq!(sp["lossy"], false);
        assert_eq!(
            sp["round_ms"].as_array().unwrap().len() as u64,
            j["stats"]["rounds"].as_u64().unwrap()
        );
        let local = if pin_head && s == 28 {
            j["stats"]["rounds"].clone()
        } else {
            0.into()
        };
        assert_eq!(sp["local_rounds"], local);
    }
    // f16 is an explicit lossy option: it runs and says so.
    let j = json_of(
        tandem()
            .args(["generate", "--json", "--no-privacy-router", "--k", "4"])
            .args(["--verifier", &format!("http://{}", v.grpc)])
            .arg("--token-file")
            .arg(&token_file)
            .args(["--split", "14", "--hidden-f16"])
            .args(["--prompt", PROMPT, "--max-tokens", "8"])
            .output()
            .unwrap(),
    );
    assert_eq!(j["stats"]["split"]["lossy"], true);
    assert_eq!(j["stats"]["split"]["hidden_format"], "f16");
    assert_eq!(j["tokens"].as_array().unwrap().len(), 8);
}

#[test]
fn split_flags_are_checked() {
    let o = tandem()
        .args([
            "generate",
            "--split",
            "half",
            "--verifier",
            "http://127.0.0.1:9",
        ])
        .args(["--prompt", "x"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--split takes"));
    let o = tandem()
        .args([
            "generate",
            "--split",
            "auto",
            "--verifier",
            "http://127.0.0.1:9",
        ])
        .args(["--prompt", "x"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("profile"));
}
