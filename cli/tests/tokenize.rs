//! `tandem tokenize` as a user runs it: the built binary, stdin in, stdout out.
//! Needs the real models (`tandem models fetch`); fails loudly without them.

#![allow(clippy::unwrap_used)] // tests may unwrap (helpers included)

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_tandem");

fn draft_path() -> PathBuf {
    let p = tandem_fetch::model_path(tandem_fetch::ModelRole::Draft);
    assert!(
        p.exists(),
        "model file {} is missing: run `tandem models fetch` (or set TANDEM_MODELS_DIR)",
        p.display()
    );
    p
}

fn run(args: &[&str], stdin: &[u8]) -> Output {
    run_env(args, stdin, &[])
}

fn run_env(args: &[&str], stdin: &[u8], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.arg("tokenize")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    {
        let mut pipe = child.stdin.take().unwrap();
        // The binary may exit before reading (e.g. model missing).
        let _ = pipe.write_all(stdin);
    }
    child.wait_with_output().unwrap()
}

fn ok_stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}, stderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn failed_with(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, stdout: {:?}",
        out.stdout
    );
    assert!(
        stderr.contains(needle),
        "stderr does not mention {needle:?}: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[derive(serde::Deserialize)]
struct Fixture {
    text: String,
    ids: Vec<u32>,
}

fn fixtures() -> Vec<Fixture> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../model/tests/fixtures/qwen2_tokenize.jsonl"
    );
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn fixtures_round_trip_through_the_binary() {
    draft_path();
    let fixtures = fixtures();
    assert!(fixtures.len() >= 15);
    for f in fixtures {
        let out = run(&["--model", "draft", "--special"], f.text.as_bytes());
        let stdout = ok_stdout(&out);
        assert!(stdout.ends_with('\n'));
        let ids: Vec<u32> = serde_json::from_str(&stdout).unwrap();
        assert_eq!(ids, f.ids, "{:?}", f.text);

        let json = serde_json::to_string(&f.ids).unwrap();
        let out = run(&["--decode", "--special"], json.as_bytes());
        assert_eq!(ok_stdout(&out), f.text);
    }
}

#[test]
fn special_flag_controls_control_tokens() {
    draft_path();
    let text = "<|im_start|>user\nhi<|im_end|>";
    let with: Vec<u32> =
        serde_json::from_str(&ok_stdout(&run(&["--special"], text.as_bytes()))).unwrap();
    assert_eq!(with.first(), Some(&151_644));
    assert_eq!(with.last(), Some(&151_645));
    let without: Vec<u32> = serde_json::from_str(&ok_stdout(&run(&[], text.as_bytes()))).unwrap();
    assert!(
        !without.contains(&151_644) && !without.contains(&151_645),
        "{without:?}"
    );
    // Plain text decodes back either way.
    let json = serde_json::to_string(&without).unwrap();
    assert_eq!(ok_stdout(&run(&["--decode"], json.as_bytes())), text);
    // Decoding real control tokens: omitted unless --special.
    let json = serde_json::to_string(&with).unwrap();
    assert_eq!(ok_stdout(&run(&["--decode"], json.as_bytes())), "user\nhi");
    assert_eq!(
        ok_stdout(&run(&["--decode", "--special"], json.as_bytes())),
        text
    );
}

#[test]
fn stdin_is_taken_exactly_and_target_and_model_path_agree() {
    let path = draft_path();
    // `echo` adds a newline: it is part of the text, not stripped.
    let a: Vec<u32> = serde_json::from_str(&ok_stdout(&run(&[], b"Hello, world!\n"))).unwrap();
    let bare: Vec<u32> = serde_json::from_str(&ok_stdout(&run(&[], b"Hello, world!"))).unwrap();
    assert_eq!(bare, vec![9707, 11, 1879, 0]);
    assert_ne!(a, bare);
    let json = serde_json::to_string(&a).unwrap();
    assert_eq!(
        ok_stdout(&run(&["--decode"], json.as_bytes())),
        "Hello, world!\n"
    );
    let b: Vec<u32> =
        serde_json::from_str(&ok_stdout(&run(&["--model", "target"], b"Hello, world!\n"))).unwrap();
    assert_eq!(a, b);
    let path = path.to_str().unwrap();
    let c: Vec<u32> = serde_json::from_str(&ok_stdout(&run(
        &["--model-path", path],
        b"Hello, world!\n",
    )))
    .unwrap();
    assert_eq!(a, c);
    assert_eq!(ok_stdout(&run(&[], b"")), "[]\n");
    assert_eq!(ok_stdout(&run(&["--decode"], b" [ ] ")), "");
}

#[test]
fn bad_decode_input_is_a_clear_error() {
    draft_path();
    failed_with(&run(&["--decode"], b"hello"), "JSON array");
    failed_with(&run(&["--decode"], b"{\"ids\": [1]}"), "not a JSON array");
    failed_with(
        &run(&["--decode"], b"[1, -2]"),
        "element 1 (-2) is not a token id",
    );
    failed_with(&run(&["--decode"], b"[1.5]"), "is not a token id");
    failed_with(&run(&["--decode"], b"[\"9707\"]"), "is not a token id");
    failed_with(&run(&["--decode"], b"[9707, 151936]"), "out of range");
    failed_with(&run(&["--decode"], b"[4294967296]"), "is not a token id");
    failed_with(&run(&[], &[0xff, 0xfe, b'a']), "not valid UTF-8");
}

#[test]
fn missing_model_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.gguf");
    failed_with(
        &run(&["--model-path", missing.to_str().unwrap()], b"hi"),
        "not found",
    );
    let empty = dir.path().to_str().unwrap();
    let out = run_env(
        &["--model", "target"],
        b"hi",
        &[("TANDEM_MODELS_DIR", empty)],
    );
    failed_with(&out, "tandem models fetch");
    failed_with(&out, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");

    // A file that is not a GGUF.
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"definitely not gguf").unwrap();
    failed_with(
        &run(&["--model-path", junk.to_str().unwrap()], b"hi"),
        "GGUF",
    );
}
