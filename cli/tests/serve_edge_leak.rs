//! The leak test through `tandem serve-edge` (issue 32, item 6): every
//! prompt of the blind set (`router/tests/blind`) that the privacy router
//! keeps local, sent as an OpenAI chat request to the built binary, sends
//! zero bytes to the verifier.
//!
//! `--verifier` points at a recording listener (the method of
//! `edge-runtime/tests/privacy_leak.rs`, without the real verifier behind
//! it: every connection and byte the server sends is counted, none is
//! answered). A tiny random draft with the test tokenizer
//! (`tandem_model::testing`) stands in for the real one: what is checked is
//! where the bytes go. Each response's `tandem.route` must say local, and
//! the counts must not move; a benign control request goes `speculative`
//! and the listener does see bytes, so the counter can fail.
#![allow(clippy::unwrap_used)]

mod common;

use common::{first_stdout_line, tandem};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_router::{Action, Policy, RouteContext};

/// Connections accepted and bytes received by the recording listener.
#[derive(Default)]
struct Counts {
    connections: AtomicUsize,
    bytes: AtomicUsize,
}

impl Counts {
    fn now(&self) -> (usize, usize) {
        (
            self.connections.load(Ordering::SeqCst),
            self.bytes.load(Ordering::SeqCst),
        )
    }
}

/// A listener on loopback that records what it is sent and never answers.
fn recorder() -> (SocketAddr, Arc<Counts>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let counts = Arc::new(Counts::default());
    let c = counts.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            c.connections.fetch_add(1, Ordering::SeqCst);
            let c = c.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    c.bytes.fetch_add(n, Ordering::SeqCst);
                }
            });
        }
    });
    (addr, counts)
}

/// The server child; killed on drop.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// One non-streamed chat request; the response's JSON.
fn chat(addr: &str, text: &str) -> serde_json::Value {
    let body = serde_json::json!({
        "model": "tandem",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": text}],
    })
    .to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}\n{rest}");
    serde_json::from_str(rest).unwrap()
}

#[test]
fn every_blind_case_routed_local_sends_nothing_through_serve_edge() {
    let dir = tempfile::tempdir().unwrap();
    let draft = dir.path().join("draft.gguf");
    let cfg = TinyConfig {
        tokenizer: true,
        ..TinyConfig::draft_like()
    };
    write_tiny_qwen2(&draft, &cfg).unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "leak-test-token-0123456789").unwrap();
    let edge = dir.path().join("edge.toml");
    std::fs::write(&edge, "connect_timeout_ms = 300\nopen_timeout_ms = 300\n").unwrap();
    let policy_path = repo().join("config/policy.example.toml");
    let (verifier, counts) = recorder();
    let mut child = tandem()
        .args([
            "serve-edge",
            "--listen",
            "127.0.0.1:0",
            "--max-seq-len",
            "1024",
        ])
        .arg("--draft-model")
        .arg(&draft)
        .arg("--verifier")
        .arg(format!("http://{verifier}"))
        .arg("--token-file")
        .arg(&token)
        .arg("--edge-config")
        .arg(&edge)
        .arg("--policy")
        .arg(&policy_path)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let line = first_stdout_line(&mut child);
    let _server = Server(child);
    let addr = line
        .strip_prefix("serving http://")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();

    let policy = Policy::from_file(&policy_path).unwrap();
    let ctx = RouteContext::default();
    let cases = std::fs::read_to_string(repo().join("router/tests/blind/blind_v2.jsonl")).unwrap();
    let mut local = 0;
    let start = counts.now();
    for line in cases.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let (id, text) = (v["id"].as_str().unwrap(), v["text"].as_str().unwrap());
        if policy.decide(text, &ctx).action != Action::Local {
            continue;
        }
        let before = counts.now();
        let j = chat(&addr, text);
        assert_eq!(
            j["tandem"]["route"]["decision"]["action"], "local",
            "{id}: {j}"
        );
        assert_eq!(counts.now(), before, "{id}: sent to the verifier");
        local += 1;
    }
    assert!(local > 200, "{local} local cases");
    assert_eq!(counts.now(), start, "something reached the verifier");
    // Control: a benign prompt goes to the verifier, and the listener sees it.
    let j = chat(&addr, "Write a Rust function that reverses a string");
    assert_eq!(
        j["tandem"]["route"]["decision"]["action"], "speculative",
        "{j}"
    );
    let (conns, bytes) = counts.now();
    assert!(
        conns > start.0 && bytes > start.1,
        "the recorder saw nothing"
    );
    println!(
        "serve-edge: {local} blind cases routed local, 0 bytes sent; control sent {bytes} bytes"
    );
}
