//! End to end with the real model pair and real processes: `tandem serve-verifier`
//! (Qwen2.5-Coder-1.5B target), `tandem netsim` / the in-process netsim proxy, and
//! `tandem generate --verifier` (0.5B draft). Greedy output must be the target's
//! own output (`tandem generate --mode target`) except at provisional positions.
//! Short on purpose (≤ 64 tokens per generation); the tests of this file run one
//! at a time (a lock) so three 1.5B verifiers do not share two cores. The outage
//! tests do not race a clock: they end the outage only after the edge has said it
//! went provisional, so they hold however fast or slow the machine is.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::{
    first_stdout_line, generate_json, start_verifier, statuses, tandem, Verifier, VerifierSpec,
};

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

const TOKEN: &str = "edge-e2e-token-0123456789";
const PROMPTS: [&str; 2] = [
    "Write a Rust function that returns the larger of two i32 values.",
    "Write a Python function that reverses a list in place.",
];

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Target-only outputs of `N` tokens by prompt.
type Cache = Mutex<HashMap<String, Vec<u64>>>;

/// The target's own greedy tokens, the first `max_tokens` (≤ `N`) of one
/// `N`-token run per prompt: a greedy output is a prefix of every longer
/// one (the emit rule), so one target process per prompt serves every test
/// (CI time).
fn target_only(prompt: &str, max_tokens: usize) -> Vec<u64> {
    assert!(max_tokens <= N, "target_only serves up to N = {N} tokens");
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let mut c = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let all = c.entry(prompt.to_string()).or_insert_with(|| {
        let n = N.to_string();
        ids(&generate_json(&[
            "--mode",
            "target",
            "--prompt",
            prompt,
            "--max-tokens",
            &n,
        ]))
    });
    all[..max_tokens.min(all.len())].to_vec()
}

fn ids(j: &serde_json::Value) -> Vec<u64> {
    j["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// A `tandem serve-verifier` child with the real 1.5B target on `port` (0: any).
fn verifier(dir: &Path, port: u16, limits: &str) -> Verifier {
    let spec = VerifierSpec {
        listen: format!("127.0.0.1:{port}"),
        model: "target",
        token: TOKEN,
        extra_top: "insecure_loopback = true",
        limits,
    };
    start_verifier(dir, &spec)
}

/// One counter from the verifier's Prometheus `/metrics`.
fn metric(admin: &str, name: &str) -> f64 {
    let Ok(mut s) = TcpStream::connect(admin) else {
        return 0.0;
    };
    let req = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    if s.write_all(req.as_bytes()).is_err() {
        return 0.0;
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Waits until the edge holds verified tokens: the verifier has received its
/// second verify, which the edge sends only after applying the first verdict.
/// (Counting the verifier's emitted tokens raced: a verdict sent but still in
/// the proxy when the test blackholed it left nothing verified at the edge.)
fn wait_for_first_verdict(admin: &str, edge: &mut Child) {
    let start = Instant::now();
    while metric(admin, "tandem_verifier_verify_seconds_count") < 2.0 {
        assert!(
            edge.try_wait().unwrap().is_none(),
            "the edge ended before the first verdict"
        );
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no verdict in 120 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `tandem netsim` child; killed on drop.
struct Netsim {
    child: Child,
    addr: String,
}

impl Drop for Netsim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn netsim(upstream: &str, profile: &str) -> Netsim {
    let mut child = tandem()
        .args(["netsim", "--listen", "127.0.0.1:0", "--upstream", upstream])
        .args(["--profile", profile])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let line = first_stdout_line(&mut child);
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("netsim did not start: {line:?}"))
        .to_string();
    Netsim { child, addr }
}

/// Edge config for the outage tests: give up on the verifier fast (one failure
/// opens the breaker; a verify deadline of at most 1.5 s), probe often.
fn edge_config(dir: &Path) -> PathBuf {
    let p = dir.join("edge.toml");
    std::fs::write(
        &p,
        format!(
            "token = \"{TOKEN}\"\nbreaker_failures = 1\nconnect_timeout_ms = 500\n\
             backoff_base_ms = 20\nprobe_interval_ms = 100\nprobe_timeout_ms = 500\n\
             deadline_floor_ms = 500\ndeadline_max_ms = 5000\n"
        ),
    )
    .unwrap();
    p
}

fn spawn_edge(addr: &str, edge_cfg: &Path, prompt: &str, max_tokens: usize, k: usize) -> Child {
    tandem()
        .args([
            "generate",
            "--json",
            "--verifier",
            &format!("http://{addr}"),
        ])
        .arg("--edge-config")
        .arg(edge_cfg)
        .args(["--prompt", prompt, "--max-tokens", &max_tokens.to_string()])
        .args(["--k", &k.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn finish(edge: Child) -> (serde_json::Value, String) {
    let out = edge.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "edge failed: {err}");
    (serde_json::from_slice(&out.stdout).unwrap(), err)
}

/// An edge child whose stderr is read line by line as it arrives, so a test can
/// act on what the edge reports (e.g. "the verifier is unreachable").
struct Watched {
    child: Child,
    lines: mpsc::Receiver<String>,
    all: std::thread::JoinHandle<String>,
}

fn watch(mut child: Child) -> Watched {
    let err = child.stderr.take().unwrap();
    let (tx, lines) = mpsc::channel();
    let all = std::thread::spawn(move || {
        let mut acc = String::new();
        for line in BufReader::new(err).lines() {
            let Ok(line) = line else { break };
            acc.push_str(&line);
            acc.push('\n');
            let _ = tx.send(line);
        }
        acc
    });
    Watched { child, lines, all }
}

impl Watched {
    /// Freezes (`SIGSTOP`) or thaws (`SIGCONT`) the edge process, so a test can
    /// do slow work (restart a verifier) without the draft finishing meanwhile.
    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(sig)
            .arg(self.child.id().to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} failed");
    }

    /// Blocks until the edge prints a stderr line containing `needle`.
    fn wait_for_line(&self, needle: &str) {
        let start = Instant::now();
        loop {
            match self.lines.recv_timeout(Duration::from_secs(1)) {
                Ok(l) if l.contains(needle) => return,
                Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("the edge ended without printing {needle:?}")
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "no {needle:?} from the edge in 120 s"
            );
        }
    }

    fn finish(self) -> (serde_json::Value, String) {
        let out = self.child.wait_with_output().unwrap();
        let err = self.all.join().unwrap();
        assert!(out.status.success(), "edge failed: {err}");
        (serde_json::from_slice(&out.stdout).unwrap(), err)
    }
}

#[test]
fn greedy_output_through_lan_and_fast_4g_equals_target_only() {
    let _g = serial();
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let v = verifier(dir.path(), 0, "");
    let cfg = dir.path().join("edge.toml");
    std::fs::write(&cfg, format!("token = \"{TOKEN}\"\n")).unwrap();
    for profile in ["lan", "fast-4g"] {
        let n = netsim(&v.grpc, profile);
        for prompt in PROMPTS {
            let (j, err) = finish(spawn_edge(&n.addr, &cfg, prompt, 24, 4));
            assert_eq!(ids(&j), target_only(prompt, 24), "{profile}: {prompt}");
            assert_eq!(statuses(&j), vec!["verified".to_string(); 24], "{err}");
            let s = &j["stats"];
            assert_eq!(s["failures"], 0, "{profile}: {s}");
            assert!(s["rtt_mean_ms"].as_f64().unwrap() > 0.0);
            if profile == "fast-4g" {
                // ~165 ms RTT on this profile: every verify crosses it.
                assert!(s["rtt_mean_ms"].as_f64().unwrap() >= 150.0, "{s}");
            }
        }
    }
    eprintln!("lan + fast-4g: {:.1} s", t0.elapsed().as_secs_f64());
}

/// Tokens generated in the outage tests: enough that the draft cannot finish
/// alone before the health probe (every 100 ms) brings the verifier back.
const N: usize = 64;

/// Checks an output with an outage in the middle: verified before it, provisional
/// during, verified again after; the verified prefix is the target's; when the
/// verifier's check found no difference the whole output is the target's.
fn check_outage_output(j: &serde_json::Value, want: &[u64], max_tokens: usize, err: &str) {
    let got = ids(j);
    let st = statuses(j);
    assert_eq!(got.len(), max_tokens, "{err}");
    assert_eq!(st.len(), max_tokens);
    let first_prov = st.iter().position(|s| s == "provisional");
    let last_prov = st.iter().rposition(|s| s == "provisional");
    let (Some(first), Some(last)) = (first_prov, last_prov) else {
        panic!("no provisional token: {st:?}\n{err}");
    };
    assert!(
        first > 0,
        "nothing verified before the outage: {st:?}\n{err}"
    );
    assert!(
        last + 1 < max_tokens,
        "never resumed speculative: {st:?}\n{err}"
    );
    assert!(
        st[last + 1..].iter().all(|s| s == "verified"),
        "{st:?}\n{err}"
    );
    assert_eq!(got[..first], want[..first], "verified prefix differs");
    let p = &j["provisional"];
    let prov = st.iter().filter(|s| *s == "provisional").count() as u64;
    assert_eq!(p["provisional_tokens"].as_u64().unwrap(), prov);
    assert_eq!(
        p["checked_tokens"].as_u64().unwrap(),
        prov,
        "greedy: all checked: {p}"
    );
    match p["first_mismatch"].as_u64() {
        None => assert_eq!(
            got, want,
            "no mismatch reported, so the output is the target's"
        ),
        Some(m) => {
            let m = m as usize;
            assert!(
                st[m] == "provisional",
                "a mismatch is at a provisional position"
            );
            assert_eq!(got[..m], want[..m]);
            assert_ne!(got[m], want[m]);
        }
    }
    assert!(
        j["stats"]["opens"].as_u64().unwrap() >= 2,
        "resumed: {}",
        j["stats"]
    );
    assert!(j["stats"]["breaker_opens"].as_u64().unwrap() >= 1);
}

#[test]
fn verifier_killed_mid_generation_and_restarted_resumes_speculative() {
    let _g = serial();
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut v = verifier(dir.path(), port, "");
    let cfg = edge_config(dir.path());
    let prompt = PROMPTS[0];
    let want = target_only(prompt, N);
    let mut edge = spawn_edge(&v.grpc, &cfg, prompt, N, 4);
    wait_for_first_verdict(&v.admin, &mut edge);
    let edge = watch(edge);
    v.child.kill().unwrap(); // SIGKILL: no goodbye to the device
    v.child.wait().unwrap();
    // Restart only once the edge has gone provisional, so the outage is seen.
    // The edge is frozen while the verifier reloads the target: the draft alone
    // runs ~20 tok/s here and would otherwise finish all N tokens first on a
    // loaded CI machine (it did, once the AVX2 kernels made the draft faster).
    edge.wait_for_line("the verifier is unreachable");
    edge.signal("-STOP");
    let v2 = verifier(dir.path(), port, "");
    edge.signal("-CONT");
    let (j, err) = edge.finish();
    check_outage_output(&j, &want, N, &err);
    assert!(
        err.contains("warning: the verifier is unreachable"),
        "{err}"
    );
    assert!(err.contains("the verifier is back"), "{err}");
    drop(v2);
    eprintln!("kill -9 + restart: {:.1} s", t0.elapsed().as_secs_f64());
}

#[test]
fn outage_window_from_a_netsim_timeline_then_speculative_again() {
    let _g = serial();
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let v = verifier(dir.path(), 0, "");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let upstream = v.grpc.parse().unwrap();
    let proxy = rt
        .block_on(tandem_netsim::Proxy::start(
            "127.0.0.1:0".parse().unwrap(),
            upstream,
            tandem_netsim::NetConfig::profile("lan").unwrap(),
        ))
        .unwrap();
    let cfg = edge_config(dir.path());
    let prompt = PROMPTS[1];
    let want = target_only(prompt, N);
    let mut edge = spawn_edge(&proxy.local_addr().to_string(), &cfg, prompt, N, 4);
    wait_for_first_verdict(&v.admin, &mut edge);
    let edge = watch(edge);
    // Blackhole (connections accepted, nothing forwarded) until the edge has
    // given up on the verifier and gone provisional; then lan again.
    proxy.set_timeline(tandem_netsim::Timeline::parse("offline 600s, lan").unwrap());
    edge.wait_for_line("the verifier is unreachable");
    proxy.set_timeline(tandem_netsim::Timeline::parse("lan").unwrap());
    let (j, err) = edge.finish();
    check_outage_output(&j, &want, N, &err);
    rt.block_on(proxy.shutdown());
    eprintln!("outage window: {:.1} s", t0.elapsed().as_secs_f64());
}
