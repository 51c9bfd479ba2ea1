//! `tandem generate --verifier URL --policy P.toml` as a user runs it (real
//! draft model): a prompt the policy routes local is answered by the draft
//! alone and the verifier address never sees a connection; a clean prompt goes
//! to the network; a broken policy fails before any model loads.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Output};

const ID: &str = "11010519491231002X";

fn tandem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
}

fn policy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/policy.example.toml")
}

fn generate(url: &str, policy: &std::path::Path, prompt: &str, json: bool) -> Output {
    let mut c = tandem();
    c.args([
        "generate",
        "--verifier",
        url,
        "--max-tokens",
        "8",
        "--prompt",
        prompt,
    ])
    .arg("--policy")
    .arg(policy);
    if json {
        c.arg("--json");
    }
    c.output().unwrap()
}

#[test]
fn a_sensitive_prompt_is_answered_locally_without_touching_the_verifier() {
    // Something listens at the verifier address, so a connection would be seen.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let prompt = format!("我的身份证号是{ID}，帮我写个请假条");
    let out = generate(&url, &policy(), &prompt, true);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let j: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(j["route"]["decision"]["action"], "local");
    assert_eq!(j["route"]["decision"]["rule"], "identifiers");
    let e = &j["route"]["decision"]["entities"][0];
    assert_eq!(e["type"], "CN_RESIDENT_ID");
    let (s, end) = (
        e["start"].as_u64().unwrap() as usize,
        e["end"].as_u64().unwrap() as usize,
    );
    assert_eq!(&prompt[s..end], ID);
    let status = j["status"].as_array().unwrap();
    assert!(
        !status.is_empty() && status.iter().all(|s| s == "local"),
        "{status:?}"
    );
    assert_eq!(j["stats"]["bytes_sent"], 0);
    assert_eq!(j["session_id"], serde_json::Value::Null);
    // Streamed: the decision is printed without the text.
    let out = generate(&url, &policy(), &prompt, false);
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("--- route: local (rule identifiers) entities [CN_RESIDENT_ID@"),
        "{stderr}"
    );
    assert!(!stderr.contains(ID));
    // Not one connection reached the verifier address.
    assert_eq!(
        listener.accept().map(|_| ()).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock
    );
}

#[test]
fn a_clean_prompt_goes_to_the_verifier_and_a_broken_policy_is_refused() {
    // Control: nothing listens, so the speculative path falls back to
    // provisional tokens (it did try the network).
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let out = generate(
        &format!("http://{dead}"),
        &policy(),
        "Write a Rust function that reverses a string.",
        true,
    );
    assert!(out.status.success(), "{out:?}");
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["route"]["decision"]["action"], "speculative");
    assert_eq!(j["route"]["decision"]["rule"], "default");
    let status = j["status"].as_array().unwrap();
    assert!(status.iter().all(|s| s == "provisional"), "{status:?}");

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "version = 1\ndefault = \"speculative\"\n[[rules]]\nname = \"x\"\naction = \"local\"\nentities = [\"CN_ID\"]\n",
    )
    .unwrap();
    let out = generate(&format!("http://{dead}"), &bad, "hello", true);
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("line 6") && stderr.contains("rules[0].entities"),
        "{stderr}"
    );
    // --policy without a verifier is an error, not silently ignored.
    let out = tandem()
        .args(["generate", "--prompt", "hello", "--policy"])
        .arg(policy())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8(out.stderr)
        .unwrap()
        .contains("--policy decides"));
}

#[test]
fn without_policy_the_built_in_one_decides_and_opting_out_is_explicit() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let prompt = format!("我的身份证号是{ID}，帮我写个请假条");
    let run = |extra: &[&str]| {
        let out = tandem()
            .args(["generate", "--json", "--verifier", &url])
            .args(["--max-tokens", "4", "--prompt", &prompt])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    // No --policy: the built-in default policy still keeps an ID number local.
    let j = run(&[]);
    assert_eq!(j["route"]["decision"]["action"], "local", "{j}");
    assert_eq!(j["stats"]["bytes_sent"], 0);
    assert_eq!(
        listener.accept().map(|_| ()).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock,
        "the built-in policy let a connection through"
    );
    // --no-privacy-router: the router is not asked, the device does connect
    // (the connection is accepted and dropped, so the edge gives up fast).
    listener.set_nonblocking(false).unwrap();
    let acceptor = std::thread::spawn(move || listener.accept().is_ok());
    let j = run(&["--no-privacy-router"]);
    assert_eq!(j["route"], serde_json::Value::Null, "{j}");
    assert!(
        acceptor.join().unwrap(),
        "--no-privacy-router should have tried the verifier"
    );
    // The opt-out and a policy contradict each other.
    let out = tandem()
        .args(["generate", "--verifier", &url, "--prompt", "x"])
        .args(["--no-privacy-router", "--policy"])
        .arg(policy())
        .output()
        .unwrap();
    assert!(!out.status.success());
}
