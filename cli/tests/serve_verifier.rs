//! `tandem serve-verifier`: the built binary with a tiny target model.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use common::first_stdout_line;
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};

fn config(dir: &std::path::Path, extra: &str) -> std::path::PathBuf {
    let model = dir.join("target.gguf");
    write_tiny_qwen2(&model, &TinyConfig::default()).unwrap();
    let p = dir.join("verifier.toml");
    std::fs::write(
        &p,
        format!(
            "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nmodel_path = \"{}\"\nmax_seq_len = 512\n{extra}\n\n[[devices]]\nid = \"a\"\ntoken = \"device-a-token-0123456789\"\n\n[limits]\nmax_prompt_tokens = 256\n",
            model.display()
        ),
    )
    .unwrap();
    p
}

#[test]
fn serves_health_and_metrics_then_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "insecure_loopback = true");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["serve-verifier", "--config"])
        .arg(&cfg)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let line = first_stdout_line(&mut child);
    assert!(line.starts_with("serving grpc=127.0.0.1:"), "{line}");
    let admin = line.trim().rsplit("admin=").next().unwrap().to_string();
    let mut s = std::net::TcpStream::connect(&admin).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(body.contains("tandem_verifier_sessions 0"), "{body}");
    let st = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{:?}", out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("verifier stopped"));
}

#[test]
fn refuses_to_start_without_tls_or_loopback_opt_in() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "");
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["serve-verifier", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("TLS is not configured"), "{err}");
}
