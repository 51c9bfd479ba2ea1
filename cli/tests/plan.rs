//! `tandem plan` through the built binary.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .output()
        .expect("run tandem")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A profile with `blocks` identical blocks; per-layer compute `1 ms` at k=1.
fn profile_json(blocks: usize) -> String {
    let layer = |name: &str, kind: &str, weight: u64, kv: u64, act: u64| {
        serde_json::json!({
            "name": name, "kind": kind, "weight_bytes": weight,
            "kv_bytes_per_token": kv, "activation_bytes_per_token": act,
            "compute_seconds": {"1": 0.001, "4": 0.002}
        })
    };
    let mut layers = vec![layer("embedding", "embedding", 10_000_000, 0, 4096)];
    for i in 0..blocks {
        layers.push(layer(&format!("blk.{i}"), "block", 20_000_000, 1000, 4096));
    }
    layers.push(layer("head", "head", 10_000_000, 0, 8));
    serde_json::json!({
        "schema": "tandem.profile.v1", "model": "test-model", "measured": true,
        "context_tokens": 1000, "block_sizes": [1, 4], "layers": layers
    })
    .to_string()
}

/// Writes the profile and a two-node config; returns (dir, profile, nodes).
fn setup(blocks: usize, nodes_toml: &str) -> (tempfile::TempDir, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("profile.json");
    let n = dir.path().join("nodes.toml");
    std::fs::write(&p, profile_json(blocks)).unwrap();
    std::fs::write(&n, nodes_toml).unwrap();
    let s = |x: &Path| x.to_string_lossy().into_owned();
    (dir, s(&p), s(&n))
}

fn two_nodes(device_mb: f64, link: &str) -> String {
    two_nodes_speed(device_mb, 20.0, link)
}

fn two_nodes_speed(device_mb: f64, cloud_speed: f64, link: &str) -> String {
    format!(
        r#"
device = "phone"
[[node]]
name = "phone"
memory_mb = {device_mb}
[[node]]
name = "cloud"
memory_mb = 100000
speed_factor = {cloud_speed}
[[link]]
a = "phone"
b = "cloud"
{link}
"#
    )
}

fn plan_json(args: &[&str]) -> Value {
    let o = tandem(args);
    assert!(o.status.success(), "stderr: {}", stderr(&o));
    serde_json::from_str(&stdout(&o)).unwrap()
}

#[test]
fn example_configs_plan_in_text() {
    let r = repo();
    let profile = r.join("config/profile.example.json");
    let nodes = r.join("config/nodes.example.toml");
    let o = tandem(&[
        "plan",
        "--profile",
        profile.to_str().unwrap(),
        "--nodes",
        nodes.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "stderr: {}", stderr(&o));
    let text = stdout(&o);
    for needle in [
        "assignment:",
        "predicted latency per forward",
        "compute  laptop",
        "memory:",
        "not measured",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

#[test]
fn json_plan_is_consistent_and_respects_budgets() {
    // The model needs 10 + 8 x 21 + 10 = 188 MB; the phone has 75 MB.
    let (_d, p, n) = setup(8, &two_nodes(75.0, "network = \"lan\""));
    for pin in [false, true] {
        let mut args = vec!["plan", "--profile", &p, "--nodes", &n, "--json"];
        if pin {
            args.push("--pin-head");
        }
        let v = plan_json(&args);
        let plan = &v["plan"];
        let assignment: Vec<&str> = plan["assignment"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_str().unwrap())
            .collect();
        assert_eq!(assignment.len(), 10);
        assert_eq!(assignment[0], "phone", "embedding stays on the device");
        if pin {
            assert_eq!(assignment[9], "phone", "--pin-head keeps the head local");
        }
        for m in plan["memory"].as_array().unwrap() {
            assert!(m["bytes"].as_u64().unwrap() <= m["budget_bytes"].as_u64().unwrap());
        }
        let compute: f64 = plan["compute"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["seconds"].as_f64().unwrap())
            .sum();
        let transfer: f64 = plan["transfers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["seconds"].as_f64().unwrap())
            .sum();
        let latency = plan["latency_seconds"].as_f64().unwrap();
        assert!((compute + transfer - latency).abs() < 1e-9);
        assert_eq!(plan["objective_seconds"], plan["latency_seconds"]);
        // The cloud is 20x faster and the link is fast: everything the phone
        // does not have to run goes to the cloud.
        let on_phone = assignment.iter().filter(|a| **a == "phone").count();
        assert_eq!(on_phone, if pin { 2 } else { 1 });
    }
}

#[test]
fn link_overhead_is_charged_per_exchange_and_printed() {
    // Same problem with and without a measured 40 ms fixed cost per exchange on
    // the link: a plan that crosses pays it once per round trip (20 ms on each
    // of its two crossings); the text output names it.
    let plan = |link: &str| {
        let (_d, p, n) = setup(8, &two_nodes(75.0, link));
        let v = plan_json(&["plan", "--profile", &p, "--nodes", &n, "--json"]);
        let o = tandem(&["plan", "--profile", &p, "--nodes", &n]);
        assert!(o.status.success(), "stderr: {}", stderr(&o));
        (v, stdout(&o))
    };
    let (base, base_text) = plan("network = \"lan\"");
    let (with, text) = plan("network = \"lan\"\noverhead_ms = 40");
    assert_eq!(base["plan"]["assignment"], with["plan"]["assignment"]);
    let transfers = |v: &Value| -> Vec<f64> {
        v["plan"]["transfers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["seconds"].as_f64().unwrap())
            .collect()
    };
    let (t0, t1) = (transfers(&base), transfers(&with));
    assert_eq!(t0.len(), 2, "one crossing there, the result back");
    for (a, b) in t0.iter().zip(&t1) {
        assert!((b - a - 0.020).abs() < 1e-9, "{a} -> {b}");
    }
    let l0 = base["plan"]["latency_seconds"].as_f64().unwrap();
    let l1 = with["plan"]["latency_seconds"].as_f64().unwrap();
    assert!((l1 - l0 - 0.040).abs() < 1e-9, "{l0} -> {l1}");
    assert_eq!(with["link_overheads"][0]["overhead_ms"], 40.0);
    assert!(base.get("link_overheads").is_none());
    assert!(
        text.contains("phone <-> cloud: 40 ms fixed overhead per exchange"),
        "{text}"
    );
    assert!(!base_text.contains("overhead"), "{base_text}");
}

#[test]
fn throughput_objective_reports_the_bottleneck() {
    // Equal speeds, 10 equal layers, negligible transfers: the best
    // pipeline splits 5 / 5.
    let (_d, p, n) = setup(8, &two_nodes_speed(1000.0, 1.0, "network = \"lan\""));
    let v = plan_json(&[
        "plan",
        "--profile",
        &p,
        "--nodes",
        &n,
        "--objective",
        "throughput",
        "--json",
        "--block",
        "4",
    ]);
    assert_eq!(v["objective"], "throughput");
    assert_eq!(v["block_tokens"], 4);
    let plan = &v["plan"];
    assert_eq!(plan["objective_seconds"], plan["bottleneck_seconds"]);
    let on_phone = plan["assignment"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| *a == "phone")
        .count();
    assert_eq!(on_phone, 5, "{plan}");
    let bottleneck = plan["bottleneck_seconds"].as_f64().unwrap();
    assert!((bottleneck - 5.0 * 0.002).abs() < 1e-9, "{plan}");
}

#[test]
fn sweep_moves_the_split_when_the_link_degrades() {
    let (_d, p, n) = setup(8, &two_nodes(1000.0, "network = \"lan\""));
    let v = plan_json(&[
        "plan",
        "--profile",
        &p,
        "--nodes",
        &n,
        "--sweep-network",
        "--json",
    ]);
    let rows = v["sweep"].as_array().unwrap();
    let names: Vec<&str> = rows
        .iter()
        .map(|r| r["network"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "loopback",
            "lan",
            "wifi",
            "fast-4g",
            "slow-4g",
            "3g",
            "satellite"
        ]
    );
    let local = |r: &Value| {
        r["plan"]["assignment"]
            .as_array()
            .unwrap()
            .iter()
            .all(|a| a == "phone")
    };
    // 10 ms of compute locally vs 0.5 ms in the cloud: offload on loopback,
    // stay local when a crossing costs a second.
    assert!(!local(&rows[0]), "loopback should offload");
    assert!(local(&rows[5]), "3g should stay local");
    let o = tandem(&["plan", "--profile", &p, "--nodes", &n, "--sweep-network"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("network sweep") && text.contains("satellite"),
        "{text}"
    );
}

#[test]
fn infeasible_and_invalid_inputs_name_the_constraint() {
    // The embedding (10 MB) does not fit a 5 MB device.
    let (_d, p, n) = setup(2, &two_nodes(5.0, "network = \"lan\""));
    let o = tandem(&["plan", "--profile", &p, "--nodes", &n]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("infeasible") && e.contains("embedding") && e.contains("'phone'"),
        "{e}"
    );

    // --pin-head needs embedding + head (20 MB) on the device.
    let (_d, p, n) = setup(2, &two_nodes(15.0, "network = \"lan\""));
    let o = tandem(&["plan", "--profile", &p, "--nodes", &n, "--pin-head"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--pin-head"), "{}", stderr(&o));

    // Zero bandwidth.
    let zero = "rtt_ms = 1\na_to_b_mbps = 0\nb_to_a_mbps = 10";
    let (_d, p, n) = setup(2, &two_nodes(1000.0, zero));
    let o = tandem(&["plan", "--profile", &p, "--nodes", &n]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("phone <-> cloud") && e.contains("a_to_b_mbps"),
        "{e}"
    );

    // Disconnected: no link and the phone cannot hold the model.
    let toml = two_nodes(30.0, "network = \"lan\"");
    let cut = toml.split("[[link]]").next().unwrap().to_string();
    let (_d, p, n) = setup(2, &cut);
    let o = tandem(&["plan", "--profile", &p, "--nodes", &n]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("not reachable") && e.contains("cloud"), "{e}");

    // A block size the profile has no times for.
    let (_d, p, n) = setup(2, &two_nodes(1000.0, "network = \"lan\""));
    let o = tandem(&["plan", "--profile", &p, "--nodes", &n, "--block", "8"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("block size 8"), "{}", stderr(&o));
}

#[test]
fn context_flag_sizes_the_kv_cache() {
    // Each block holds 1000 B of KV per context token; all 8 blocks run on
    // the cloud, so its memory grows by 8 x 1000 B per extra token.
    let (_d, p, n) = setup(8, &two_nodes(75.0, "network = \"lan\""));
    let cloud_bytes = |ctx: &str| {
        let v = plan_json(&[
            "plan",
            "--profile",
            &p,
            "--nodes",
            &n,
            "--json",
            "--context",
            ctx,
        ]);
        assert_eq!(v["context_tokens"].as_u64().unwrap().to_string(), ctx);
        v["plan"]["memory"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["node"] == "cloud")
            .unwrap()["bytes"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(cloud_bytes("3000") - cloud_bytes("1000"), 8 * 1000 * 2000);
}
