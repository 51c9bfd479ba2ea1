//! The leak test through the C ABI (issue 32, item 6): every prompt of the
//! blind set (`router/tests/blind`) that the privacy router keeps local,
//! generated with `tandem_generate` as a C host calls it, sends zero bytes
//! to the verifier.
//!
//! The verifier URL points at a recording listener (the method of
//! `edge-runtime/tests/privacy_leak.rs`, without the real verifier behind
//! it: every connection and every byte the device sends is counted, none is
//! answered). A tiny random draft with the test tokenizer
//! (`tandem_model::testing`) stands in for the real one: what is checked is
//! where the bytes go, not what the model says. Control: a benign prompt is
//! routed `speculative` and the listener does see its connection and bytes,
//! so the counter can fail.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::ffi::{c_char, CStr, CString};
use std::io::Read;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tandem_capi::*;
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

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// (id, text) of every blind-set case.
fn blind_cases() -> Vec<(String, String)> {
    let s = std::fs::read_to_string(repo().join("router/tests/blind/blind_v2.jsonl")).unwrap();
    s.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["id"].as_str().unwrap().to_string(),
                v["text"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn take_message(err: *mut c_char) -> String {
    if err.is_null() {
        return String::new();
    }
    // SAFETY: a message from the library, freed once.
    let m = unsafe { CStr::from_ptr(err) }
        .to_string_lossy()
        .into_owned();
    unsafe { tandem_string_free(err) };
    m
}

fn runtime(config: &Path) -> *mut TandemRuntime {
    let path = CString::new(config.to_str().unwrap()).unwrap();
    let mut rt: *mut TandemRuntime = ptr::null_mut();
    let mut err: *mut c_char = ptr::null_mut();
    // SAFETY: valid pointers as the header asks.
    let st = unsafe { tandem_runtime_new(path.as_ptr(), ptr::null(), &mut rt, &mut err) };
    assert_eq!(st, TandemStatus::Ok, "{}", take_message(err));
    rt
}

/// One `tandem_generate` of `prompt`; the `route` of its last JSON.
fn generate(rt: *const TandemRuntime, prompt: &str) -> String {
    let p = CString::new(prompt).unwrap();
    let mut err: *mut c_char = ptr::null_mut();
    // SAFETY: valid pointers; no callback.
    let st = unsafe {
        tandem_generate(
            rt,
            p.as_ptr(),
            1,
            None,
            ptr::null_mut(),
            ptr::null_mut(),
            &mut err,
        )
    };
    assert_eq!(st, TandemStatus::Ok, "{}", take_message(err));
    let mut json: *mut c_char = ptr::null_mut();
    let mut err: *mut c_char = ptr::null_mut();
    // SAFETY: valid pointers.
    let st = unsafe { tandem_runtime_last_json(rt, &mut json, &mut err) };
    assert_eq!(st, TandemStatus::Ok, "{}", take_message(err));
    let v: serde_json::Value = serde_json::from_str(&take_message(json)).unwrap();
    v["route"].as_str().unwrap().to_string()
}

#[test]
fn every_blind_case_routed_local_sends_nothing_through_the_c_abi() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TinyConfig {
        tokenizer: true,
        ..TinyConfig::draft_like()
    };
    write_tiny_qwen2(&dir.path().join("draft.gguf"), &cfg).unwrap();
    let policy_path = repo().join("config/policy.example.toml");
    let (addr, counts) = recorder();
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        format!(
            "draft_model = \"draft.gguf\"\nmax_seq_len = 1024\nmax_tokens = 1\n\
             privacy_router = true\npolicy = {policy_path:?}\n\n[edge]\n\
             verifier_url = \"http://{addr}\"\ntoken = \"leak-test-token-0123456789\"\n\
             connect_timeout_ms = 300\nopen_timeout_ms = 300\n"
        ),
    )
    .unwrap();
    let rt = runtime(&config);
    let policy = Policy::from_file(&policy_path).unwrap();
    let ctx = RouteContext::default();
    // The cases the router keeps local, each generated through the C ABI.
    let local: Vec<(String, String)> = blind_cases()
        .into_iter()
        .filter(|(_, t)| policy.decide(t, &ctx).action == Action::Local)
        .collect();
    assert!(local.len() > 200, "{} local cases", local.len());
    for (id, text) in &local {
        let before = counts.now();
        assert_eq!(generate(rt, text), "local_by_router", "{id}");
        assert_eq!(counts.now(), before, "{id}: sent to the verifier");
    }
    assert_eq!(counts.now(), (0, 0), "something reached the verifier");
    // Control: a benign prompt goes to the verifier, and the listener sees it.
    let route = generate(rt, "Write a Rust function that reverses a string");
    assert_eq!(route, "speculative");
    let (conns, bytes) = counts.now();
    assert!(
        conns > 0 && bytes > 0,
        "the recorder saw nothing: {conns} {bytes}"
    );
    // SAFETY: from tandem_runtime_new, freed once, no generation running.
    unsafe { tandem_runtime_free(rt) };
    println!(
        "C ABI: {} blind cases routed local, 0 bytes sent; control sent {bytes} bytes",
        local.len()
    );
}
