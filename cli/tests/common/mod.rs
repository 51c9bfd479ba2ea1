//! Helpers shared by the CLI tests that run `tandem serve-verifier` children:
//! the built binary, model paths, a verifier process (killed on drop) and
//! per-token statuses from `generate --json`.
#![allow(dead_code)] // each test file uses a different subset
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

pub mod deploy;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

pub fn tandem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
}

/// `tandem generate ARGS --json`, which must succeed; its JSON document.
pub fn generate_json(args: &[&str]) -> serde_json::Value {
    let out = tandem()
        .arg("generate")
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tandem generate {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Path of a fetched model (`tandem models path draft|target`).
pub fn model_path(role: &str) -> PathBuf {
    let out = tandem().args(["models", "path", role]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// A `tandem serve-verifier` child; SIGKILLed on drop.
pub struct Verifier {
    pub child: Child,
    pub grpc: String,
    pub admin: String,
}

impl Drop for Verifier {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What goes into a test verifier's config file.
pub struct VerifierSpec<'a> {
    /// `host:port` to listen on (`127.0.0.1:0` for any free port).
    pub listen: String,
    /// `draft` or `target`: the model the verifier serves as its target.
    pub model: &'a str,
    /// The one device's bearer token.
    pub token: &'a str,
    /// Extra top-level TOML lines (e.g. `insecure_loopback = true`, `[tls]` …).
    pub extra_top: &'a str,
    /// Extra lines in `[limits]`.
    pub limits: &'a str,
}

/// Writes the config into `dir`, starts the verifier and waits for its
/// `serving grpc=… admin=…` line.
pub fn start_verifier(dir: &Path, spec: &VerifierSpec) -> Verifier {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let cfg = dir.join(format!("verifier-{nanos}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "listen = \"{}\"\nadmin_listen = \"127.0.0.1:0\"\nmodel_path = {:?}\n\
             max_seq_len = 1024\n{}\n\n[[devices]]\nid = \"dev\"\ntoken = \"{}\"\n\n\
             [limits]\nmax_prompt_tokens = 1000\n{}\n",
            spec.listen,
            model_path(spec.model),
            spec.extra_top,
            spec.token,
            spec.limits
        ),
    )
    .unwrap();
    let mut child = tandem()
        .args(["serve-verifier", "--config"])
        .arg(&cfg)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let line = first_stdout_line(&mut child);
    assert!(
        line.starts_with("serving grpc="),
        "verifier did not start: {line:?}"
    );
    let mut parts = line.split_whitespace().skip(1);
    let grpc = parts.next().unwrap()["grpc=".len()..].to_string();
    let admin = parts.next().unwrap()["admin=".len()..].to_string();
    Verifier { child, grpc, admin }
}

/// The first line a child prints on its (piped) stdout: the address line that
/// `serve-verifier` and `netsim` print once they listen.
pub fn first_stdout_line(child: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    line
}

/// The per-token `status` array of a `generate --json` object.
pub fn statuses(j: &serde_json::Value) -> Vec<String> {
    j["status"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}
