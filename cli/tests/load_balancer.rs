//! Scale-out end to end, all real processes: three `tandem serve-verifier`
//! replicas (real 1.5B target, plain text on loopback) behind a real nginx
//! running the shipped deploy/nginx/tandem-verifier.conf (upstreams and listen
//! address filled in, TLS lines dropped: see `common::deploy::render_nginx_site`),
//! and eight concurrent `tandem generate --verifier http://<nginx>` devices
//! (real 0.5B draft, greedy).
//!
//! Phase 1: the replica holding the most sessions is SIGKILLed mid-run. Phase 2:
//! the replica holding sessions among the two left gets SIGTERM (drain). Both
//! times every device must finish with exactly the target's own greedy output
//! (`tandem generate --mode target`), every token verified (none provisional:
//! the device re-opens at once through nginx, which passes the stream to a live
//! replica), and the moved generations must show the resume path (a second
//! open) and, in nginx's access log, one affinity key served by two replicas.
//!
//! Fails when nginx is missing (CI installs it: .ci/run).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::deploy::{exposed_metric_names, grafana_metric_names, start_nginx, Nginx};
use common::{first_stdout_line, model_path, statuses, tandem, Verifier};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "lb-e2e-token-0123456789abcdef";
const PROMPTS: [&str; 3] = [
    "Write a Rust function that adds two numbers.",
    "Write a Python function that reverses a string.",
    "Write a C function that returns the larger of two ints.",
];
const MAX_TOKENS: usize = 12;
const DEVICES: usize = 8;

fn log(t0: Instant, what: &str) {
    eprintln!("[load_balancer {:6.1}s] {what}", t0.elapsed().as_secs_f64());
}

/// A replica: `tandem serve-verifier` with the real target, one rayon thread
/// (2 cores for 3 replicas, nginx and 8 devices).
fn replica(dir: &Path, i: usize) -> Verifier {
    let cfg = dir.join(format!("replica-{i}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nmodel_path = {:?}\n\
             max_seq_len = 1024\ninsecure_loopback = true\n\n[[devices]]\nid = \"dev\"\n\
             token = \"{TOKEN}\"\n\n[limits]\nmax_prompt_tokens = 1000\n",
            model_path("target")
        ),
    )
    .unwrap();
    let mut child = tandem()
        .args(["serve-verifier", "--config"])
        .arg(&cfg)
        .env("RAYON_NUM_THREADS", "1")
        .env("TANDEM_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::from(
            std::fs::File::create(dir.join(format!("replica-{i}.log"))).unwrap(),
        ))
        .spawn()
        .unwrap();
    let line = first_stdout_line(&mut child);
    assert!(line.starts_with("serving grpc="), "replica {i}: {line:?}");
    let mut parts = line.split_whitespace().skip(1);
    let grpc = parts.next().unwrap()["grpc=".len()..].to_string();
    let admin = parts.next().unwrap()["admin=".len()..].to_string();
    Verifier { child, grpc, admin }
}

/// GET `path` on the admin port: (status, body), None when nothing listens.
fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    Some((status, body.to_string()))
}

/// One unlabelled sample from a replica's `/metrics` (None: not reachable).
fn metric(admin: &str, name: &str) -> Option<f64> {
    let (_, body) = http_get(admin, "/metrics")?;
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
}

fn ids(j: &serde_json::Value) -> Vec<u64> {
    j["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// The target's own greedy tokens for each prompt (one process per prompt).
fn target_only() -> Vec<Vec<u64>> {
    let kids: Vec<Child> = PROMPTS
        .iter()
        .map(|p| {
            tandem()
                .args(["generate", "--mode", "target", "--json", "--prompt", p])
                .args(["--max-tokens", &MAX_TOKENS.to_string()])
                .env("RAYON_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    kids.into_iter()
        .map(|k| {
            let out = k.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            ids(&serde_json::from_slice(&out.stdout).unwrap())
        })
        .collect()
}

/// Edge config: the test is about re-homing, not about a loaded machine's
/// timeouts, so deadlines are generous (a timeout would make the device draft
/// alone, which is the outage path tested in edge_e2e_real).
fn edge_config(dir: &Path) -> PathBuf {
    let p = dir.join("edge.toml");
    std::fs::write(
        &p,
        format!(
            "token = \"{TOKEN}\"\nconnect_timeout_ms = 2000\nopen_timeout_ms = 120000\n\
             deadline_initial_ms = 60000\ndeadline_floor_ms = 30000\ndeadline_max_ms = 120000\n\
             backoff_base_ms = 20\n"
        ),
    )
    .unwrap();
    p
}

fn spawn_device(nginx: &str, edge_cfg: &Path, prompt: &str) -> Child {
    tandem()
        .args([
            "generate",
            "--json",
            "--verifier",
            &format!("http://{nginx}"),
        ])
        .arg("--edge-config")
        .arg(edge_cfg)
        .args(["--prompt", prompt, "--max-tokens", &MAX_TOKENS.to_string()])
        .args(["--k", "4", "--no-privacy-router"])
        .env("RAYON_NUM_THREADS", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn emitted(r: &Verifier) -> f64 {
    metric(&r.admin, "tandem_verifier_emitted_tokens_total").unwrap_or(0.0)
}

/// Waits until one of `replicas` holds sessions and has answered verdicts
/// since `baseline` (its emitted-token counters before the phase); that
/// replica's index (the one with most sessions) and its session count.
fn busy_replica(
    replicas: &[Verifier],
    baseline: &[f64],
    devices: &mut [Child],
    t0: Instant,
) -> (usize, f64) {
    let start = Instant::now();
    loop {
        let mut best: Option<(usize, f64)> = None;
        for (i, r) in replicas.iter().enumerate() {
            let sessions = metric(&r.admin, "tandem_verifier_sessions").unwrap_or(0.0);
            let fresh = emitted(r) > baseline[i];
            if sessions >= 1.0 && fresh && best.is_none_or(|(_, s)| sessions > s) {
                best = Some((i, sessions));
            }
        }
        if let Some(b) = best {
            log(
                t0,
                &format!("replica {} holds {} sessions mid-run", b.0, b.1),
            );
            return b;
        }
        for d in devices.iter_mut() {
            assert!(
                d.try_wait().unwrap().is_none(),
                "a device finished before any replica was seen mid-run"
            );
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "no verdict in 300 s"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

struct Done {
    json: serde_json::Value,
    stderr: String,
}

fn finish(devices: Vec<Child>) -> Vec<Done> {
    devices
        .into_iter()
        .map(|d| {
            let out = d.wait_with_output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(out.status.success(), "device failed: {stderr}");
            Done {
                json: serde_json::from_slice(&out.stdout).unwrap(),
                stderr,
            }
        })
        .collect()
}

/// Every device's output is the target's own for its prompt, all verified,
/// each token once; returns how many devices re-opened their session.
fn check_outputs(done: &[Done], want: &[Vec<u64>]) -> usize {
    let mut moved = 0;
    for (i, d) in done.iter().enumerate() {
        let j = &d.json;
        let got = ids(j);
        let st = statuses(j);
        let w = &want[i % PROMPTS.len()];
        assert_eq!(
            &got, w,
            "device {i}: output differs from target-only\n{}\nstats: {}",
            d.stderr, j["stats"]
        );
        assert_eq!(st.len(), got.len(), "one status per token");
        assert!(
            st.iter().all(|s| s == "verified"),
            "device {i}: not all verified: {st:?}\n{}\nstats: {}",
            d.stderr,
            j["stats"]
        );
        let stats = &j["stats"];
        assert_eq!(stats["generated_tokens"].as_u64(), Some(got.len() as u64));
        assert_eq!(stats["provisional_tokens"].as_u64(), Some(0));
        if stats["opens"].as_u64().unwrap() >= 2 {
            moved += 1;
            eprintln!(
                "  device {i}: opens {} immediate_reopens {} failures {} resends {}",
                stats["opens"], stats["immediate_reopens"], stats["failures"], stats["resends"]
            );
        }
    }
    moved
}

/// nginx access log lines per affinity key: the upstream address that served
/// each stream (the last one nginx tried).
fn streams_by_key(nginx: &Nginx) -> BTreeMap<String, Vec<String>> {
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in nginx.access_log().lines() {
        let Some(key) = line
            .strip_prefix("key=")
            .and_then(|r| r.split_whitespace().next())
        else {
            continue;
        };
        let Some(ups) = line
            .split("upstream=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
        else {
            continue;
        };
        by_key
            .entry(key.to_string())
            .or_default()
            .push(ups.to_string());
    }
    by_key
}

fn is_key(k: &str) -> bool {
    k.len() == 32 && k.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Checks nginx's view of one phase: `keys` new affinity keys (one per
/// device), each generation on one replica, except those on `moved_from`,
/// which were served by it and then by another replica. Returns how many
/// generations moved.
fn check_affinity(
    before: &BTreeSet<String>,
    nginx: &Nginx,
    moved_from: &str,
) -> (usize, BTreeSet<String>) {
    let by_key = streams_by_key(nginx);
    let keys: BTreeSet<String> = by_key.keys().cloned().collect();
    let new: Vec<&String> = keys.difference(before).collect();
    assert_eq!(
        new.len(),
        DEVICES,
        "one key per generation: {by_key:?}\n{}",
        nginx.access_log()
    );
    let mut moved = 0;
    for k in new {
        assert!(is_key(k), "128-bit hex key: {k:?}");
        let streams = &by_key[k];
        let last_hop = |u: &String| u.rsplit(", ").next().unwrap_or("").to_string();
        let served: BTreeSet<String> = streams.iter().map(last_hop).collect();
        if streams.iter().any(|u| u.contains(moved_from)) && served.len() > 1 {
            moved += 1;
            eprintln!("  key {k}: streams via nginx {streams:?}");
            assert!(
                !last_hop(streams.last().unwrap()).contains(moved_from),
                "ended on another replica: {streams:?}"
            );
        } else {
            assert_eq!(served.len(), 1, "key {k} spread over replicas: {streams:?}");
        }
    }
    (moved, keys)
}

#[test]
fn replicas_behind_nginx_survive_a_kill_and_a_drain_with_identical_output() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let want = target_only();
    log(t0, "target-only references done");

    let mut replicas: Vec<Verifier> = (0..3).map(|i| replica(dir.path(), i)).collect();
    log(t0, "3 replicas serving");
    for r in &replicas {
        assert_eq!(http_get(&r.admin, "/readyz").map(|x| x.0), Some(200));
    }
    // The dashboard reads only metrics the verifier exports.
    let (_, text) = http_get(&replicas[0].admin, "/metrics").unwrap();
    let exposed = exposed_metric_names(&text);
    for m in grafana_metric_names() {
        assert!(
            exposed.contains(&m),
            "the dashboard reads {m}, which /metrics does not export"
        );
    }

    let ng_dir = dir.path().join("nginx");
    std::fs::create_dir_all(&ng_dir).unwrap();
    let ups: Vec<String> = replicas.iter().map(|r| r.grpc.clone()).collect();
    let nginx = start_nginx(&ng_dir, &ups);
    log(t0, &format!("nginx on {}", nginx.addr));
    let edge_cfg = edge_config(dir.path());

    // Phase 1: SIGKILL the busiest replica mid-run.
    let baseline: Vec<f64> = replicas.iter().map(emitted).collect();
    let mut devices: Vec<Child> = (0..DEVICES)
        .map(|i| spawn_device(&nginx.addr, &edge_cfg, PROMPTS[i % PROMPTS.len()]))
        .collect();
    let (victim, held) = busy_replica(&replicas, &baseline, &mut devices, t0);
    let dead = replicas.remove(victim);
    let dead_addr = dead.grpc.clone();
    drop(dead); // SIGKILL + wait
    log(
        t0,
        &format!("SIGKILLed replica {victim} ({dead_addr}) holding {held} sessions"),
    );
    let done = finish(devices);
    log(t0, "phase 1: all devices done");
    let moved = check_outputs(&done, &want);
    let reopened: u64 = done
        .iter()
        .map(|d| d.json["stats"]["immediate_reopens"].as_u64().unwrap())
        .sum();
    let (moved_nginx, keys1) = check_affinity(&BTreeSet::new(), &nginx, &dead_addr);
    log(
        t0,
        &format!(
            "phase 1: {moved} devices re-opened ({reopened} at once), nginx moved {moved_nginx}"
        ),
    );
    assert!(moved >= 1 && moved_nginx >= 1, "no generation moved");
    assert!(reopened >= 1, "the broken streams were re-opened at once");
    for d in &done {
        let s = &d.json["stats"];
        if s["opens"].as_u64().unwrap() >= 2 {
            // The resume path: a re-open with the whole context, no failure.
            assert!(s["immediate_reopens"].as_u64().unwrap() >= 1, "{s}");
            assert_eq!(s["background_opens"].as_u64(), Some(0), "{s}");
        }
    }

    // Phase 2: SIGTERM a replica that holds sessions; it drains.
    let baseline: Vec<f64> = replicas.iter().map(emitted).collect();
    let mut devices: Vec<Child> = (0..DEVICES)
        .map(|i| spawn_device(&nginx.addr, &edge_cfg, PROMPTS[(i + 1) % PROMPTS.len()]))
        .collect();
    let (victim, held) = busy_replica(&replicas, &baseline, &mut devices, t0);
    let mut draining = replicas.remove(victim);
    let admin = draining.admin.clone();
    assert_eq!(
        http_get(&admin, "/readyz"),
        Some((200, "ready\n".to_string())),
        "ready before SIGTERM"
    );
    // An idle HTTP/2 connection that never answers the server's GOAWAY ping
    // (a slow peer): the graceful shutdown waits for it, so the drain lasts
    // until the test closes it and the draining state can be observed without
    // racing a clock (an undisturbed drain here takes a few ms).
    let mut hold = TcpStream::connect(&draining.grpc).unwrap();
    hold.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let ok = Command::new("kill")
        .args(["-TERM", &draining.child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let drained_addr = draining.grpc.clone();
    log(
        t0,
        &format!("SIGTERM to replica ({drained_addr}) holding {held} sessions"),
    );
    // Unready at once, and new gRPC connections refused (nginx passes them on).
    let start = Instant::now();
    loop {
        match http_get(&admin, "/readyz") {
            Some((503, body)) if body.contains("draining") => break,
            Some((200, _)) => {}
            other => panic!("/readyz while draining: {other:?}"),
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "still ready 30 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    while TcpStream::connect(&drained_addr).is_ok() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the gRPC listener is still open while draining"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    log(t0, "draining: /readyz 503, gRPC listener closed");
    assert!(
        draining.child.try_wait().unwrap().is_none(),
        "still draining"
    );
    assert_eq!(
        http_get(&admin, "/readyz").map(|x| x.0),
        Some(503),
        "unready for the whole drain"
    );
    drop(hold);
    let status = loop {
        if let Some(st) = draining.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the draining replica did not exit in 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    log(t0, &format!("drained replica exited: {status}"));
    assert!(status.success(), "drain ends with exit code 0: {status}");
    let done = finish(devices);
    log(t0, "phase 2: all devices done");
    let moved = check_outputs(&done, &want_shifted(&want));
    let (moved_nginx, _) = check_affinity(&keys1, &nginx, &drained_addr);
    log(
        t0,
        &format!("phase 2: {moved} devices re-opened, nginx moved {moved_nginx}"),
    );
    assert!(moved >= 1 && moved_nginx >= 1, "no generation moved");
    for d in &done {
        let s = &d.json["stats"];
        if s["opens"].as_u64().unwrap() >= 2 {
            // Told to move: the stream ended with SHUTTING_DOWN (a busy
            // failure, then a foreground re-open), never drafting alone.
            assert!(s["failures"].as_u64().unwrap() >= 1, "{s}");
            assert_eq!(s["background_opens"].as_u64(), Some(0), "{s}");
        }
    }
    let log_text = std::fs::read_to_string(dir.path().join(format!(
        "replica-{}.log",
        replica_index(dir.path(), &drained_addr)
    )))
    .unwrap_or_default();
    assert!(
        log_text.contains("shutting down"),
        "the drained replica logged its shutdown:\n{log_text}"
    );
    drop(draining);
    drop(nginx);
    log(t0, "done");
}

/// Phase 2 runs the prompts shifted by one.
fn want_shifted(want: &[Vec<u64>]) -> Vec<Vec<u64>> {
    (0..PROMPTS.len())
        .map(|i| want[(i + 1) % PROMPTS.len()].clone())
        .collect()
}

/// Which replica-<i>.log belongs to the replica serving gRPC on `addr`.
fn replica_index(dir: &Path, addr: &str) -> usize {
    (0..3)
        .find(|i| {
            std::fs::read_to_string(dir.join(format!("replica-{i}.log")))
                .is_ok_and(|t| t.contains(addr))
        })
        .unwrap_or(usize::MAX)
}
