//! Split execution (device runs target layers [0, s), the in-process verifier on
//! 127.0.0.1 runs [s, N)) on tiny random models: greedy and sampled output equal
//! the unsplit target's for every s including 0 and N, with and without the head
//! pinned on the device (U-shape); f16 runs and reports itself lossy; `auto` picks
//! a split from a profile and still matches. Structured output with split
//! execution (both kinds): `tests/grammar.rs`.

#![allow(clippy::unwrap_used)]
mod common;
use common::load;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use tandem_edge::device_layers::{SplitConfig, SplitLayer};
use tandem_edge::{EdgeConfig, EdgeRuntime, TokenStatus};
use tandem_model::sampling::SamplingParams;
use tandem_model::speculative::{generate_single, GenerateConfig};
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::transformer::Model;
use tandem_verifier::RunningVerifier;

const TOKEN: &str = "split-test-token-0123456789";
const FP: &str = "tiny-split-fingerprint";
const PROMPT: &[u32] = &[5, 17, 42, 99, 3, 250, 7];
const N_LAYER: usize = 4;

fn io_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

fn start_verifier(rt: &tokio::runtime::Runtime, target: &Path) -> RunningVerifier {
    let listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let text = format!(
        "listen = \"{listen}\"\nadmin_listen = \"127.0.0.1:0\"\nmodel_path = {target:?}\n\
         tokenizer_fingerprint = \"{FP}\"\nmax_seq_len = 4096\ninsecure_loopback = true\n\
         [[devices]]\nid = \"dev\"\ntoken = \"{TOKEN}\"\n"
    );
    let cfg: tandem_verifier::VerifierConfig = toml::from_str(&text).unwrap();
    rt.block_on(tandem_verifier::start(cfg)).unwrap()
}

fn edge(url: &str, split: SplitConfig, draft: Arc<Model>, target: Arc<Model>) -> EdgeRuntime {
    let cfg = EdgeConfig {
        verifier_url: Some(url.into()),
        token: Some(TOKEN.into()),
        tokenizer_fingerprint: Some(FP.into()),
        k: 4,
        split: Some(split),
        ..EdgeConfig::default()
    };
    EdgeRuntime::builder(draft, cfg)
        .split_target(target)
        .build()
        .unwrap()
}

fn gen_cfg(sampling: SamplingParams) -> GenerateConfig {
    GenerateConfig {
        k: 4,
        max_tokens: 24,
        sampling,
        ..GenerateConfig::default()
    }
}

struct Setup {
    _dir: tempfile::TempDir,
    draft: Arc<Model>,
    target: Arc<Model>,
    target_path: std::path::PathBuf,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("target.gguf");
    let d = dir.path().join("draft.gguf");
    write_tiny_qwen2(
        &t,
        &TinyConfig {
            n_layer: N_LAYER,
            ..TinyConfig::default()
        },
    )
    .unwrap();
    write_tiny_qwen2(&d, &TinyConfig::draft_like()).unwrap();
    Setup {
        draft: load(&d),
        target: load(&t),
        target_path: t,
        _dir: dir,
    }
}

/// The target's own greedy output for `PROMPT` (what every greedy split run
/// must reproduce).
fn target_greedy(m: &Setup) -> Vec<u32> {
    generate_single(
        &m.target,
        PROMPT,
        &gen_cfg(SamplingParams::default()),
        &mut |_| true,
    )
    .unwrap()
    .tokens
}

fn fixed(s: usize, pin_head: bool) -> SplitConfig {
    SplitConfig {
        layer: SplitLayer::Fixed(s),
        pin_head,
        ..SplitConfig::default()
    }
}

#[test]
fn greedy_split_equals_the_target_for_every_split_point_with_and_without_pinned_head() {
    let m = setup();
    let expected = target_greedy(&m);
    assert_eq!(expected.len(), 24);
    let rt = io_runtime();
    let v = start_verifier(&rt, &m.target_path);
    let url = format!("http://{}", v.grpc_addr);
    for pin_head in [false, true] {
        for s in 0..=N_LAYER {
            let mut e = edge(&url, fixed(s, pin_head), m.draft.clone(), m.target.clone());
            let g = e
                .generate(PROMPT, &gen_cfg(SamplingParams::default()), &mut |_| true)
                .unwrap();
            assert_eq!(g.tokens, expected, "s = {s}, pin_head = {pin_head}");
            assert!(g.statuses.iter().all(|st| *st == TokenStatus::Verified));
            let r = g.stats.split.as_ref().unwrap();
            assert_eq!((r.layer, r.n_layer, r.pin_head), (s, N_LAYER, pin_head));
            assert_eq!((r.hidden_format.as_str(), r.lossy), ("f32", false));
            assert_eq!(r.round_ms.len() as u64, g.stats.rounds);
            assert!(g.stats.rounds > 0);
            // A verifier pass per open and per round the verifier ran: an
            // all-local round runs none (they were once counted as passes).
            assert_eq!(
                g.stats.verifier_passes,
                g.stats.opens + g.stats.rounds - r.local_rounds,
                "s = {s}, pin_head = {pin_head}"
            );
            if pin_head && s == N_LAYER {
                // All on the device: no round goes to the verifier.
                assert_eq!(r.local_rounds, g.stats.rounds);
            } else {
                // Hidden states went up: at least one f32 row of d_model per round.
                assert_eq!(r.local_rounds, 0);
                assert!(g.stats.bytes_sent > g.stats.rounds * 256 * 4);
            }
        }
    }
}

#[test]
fn sampled_split_equals_unsplit_sampled_output_for_the_same_seed() {
    let m = setup();
    let sampling = SamplingParams {
        temperature: 0.9,
        top_k: 40,
        seed: 7,
        ..SamplingParams::default()
    };
    let rt = io_runtime();
    let v = start_verifier(&rt, &m.target_path);
    let url = format!("http://{}", v.grpc_addr);
    // Unsplit reference through the same verifier.
    let cfg = EdgeConfig {
        verifier_url: Some(url.clone()),
        token: Some(TOKEN.into()),
        tokenizer_fingerprint: Some(FP.into()),
        k: 4,
        ..EdgeConfig::default()
    };
    let mut plain = EdgeRuntime::builder(m.draft.clone(), cfg).build().unwrap();
    let expected = plain
        .generate(PROMPT, &gen_cfg(sampling), &mut |_| true)
        .unwrap()
        .tokens;
    for (s, pin_head) in [(0, false), (2, true), (N_LAYER, true)] {
        let mut e = edge(&url, fixed(s, pin_head), m.draft.clone(), m.target.clone());
        let g = e
            .generate(PROMPT, &gen_cfg(sampling), &mut |_| true)
            .unwrap();
        assert_eq!(g.tokens, expected, "s = {s}, pin_head = {pin_head}");
    }
}

#[test]
fn f16_hidden_states_run_and_report_lossy() {
    let m = setup();
    let rt = io_runtime();
    let v = start_verifier(&rt, &m.target_path);
    let url = format!("http://{}", v.grpc_addr);
    let mut sent = Vec::new();
    for f16 in [false, true] {
        let cfg = SplitConfig {
            hidden_f16: f16,
            ..fixed(2, true)
        };
        let mut e = edge(&url, cfg, m.draft.clone(), m.target.clone());
        let g = e
            .generate(PROMPT, &gen_cfg(SamplingParams::default()), &mut |_| true)
            .unwrap();
        assert_eq!(g.tokens.len(), 24);
        let r = g.stats.split.unwrap();
        assert_eq!(r.lossy, f16);
        assert_eq!(r.hidden_format, if f16 { "f16" } else { "f32" });
        sent.push((g.stats.bytes_sent, g.stats.gen.rounds));
    }
    // f16 sends about half the bytes per round.
    let per_round = |(b, r): (u64, u64)| b as f64 / r as f64;
    assert!(per_round(sent[1]) < 0.6 * per_round(sent[0]), "{sent:?}");
}

#[test]
fn auto_picks_a_split_from_the_profile_and_matches_the_target() {
    let m = setup();
    let expected = target_greedy(&m);
    // A synthetic profile: the server is 10x faster, so on loopback auto offloads
    // every block (s = 0) when the head is on the server.
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("p.json");
    write_profile(&profile);
    let rt = io_runtime();
    let v = start_verifier(&rt, &m.target_path);
    let url = format!("http://{}", v.grpc_addr);
    let cfg = SplitConfig {
        layer: SplitLayer::Named("auto".into()),
        profile: Some(profile),
        server_speed: 10.0,
        ..SplitConfig::default()
    };
    let mut e = edge(&url, cfg, m.draft.clone(), m.target.clone());
    let g = e
        .generate(PROMPT, &gen_cfg(SamplingParams::default()), &mut |_| true)
        .unwrap();
    assert_eq!(g.tokens, expected);
    let r = g.stats.split.unwrap();
    assert!(r.auto);
    assert_eq!(r.layer, 0);
    let predicted = r.predicted_round_ms.unwrap();
    assert!(predicted > 0.0 && predicted.is_finite());
}

#[test]
fn a_measured_server_profile_and_round_overhead_drive_auto_and_the_prediction() {
    let m = setup();
    let expected = target_greedy(&m);
    // The server's own profile says it is 10x *slower* per layer than the
    // device (as a loaded server core can be): auto keeps every block on the
    // device; the prediction charges the server's measured head time and the
    // round overhead.
    let dir = tempfile::tempdir().unwrap();
    let (device, server) = (dir.path().join("d.json"), dir.path().join("s.json"));
    write_profile_scaled(&device, 1.0);
    write_profile_scaled(&server, 10.0);
    let rt = io_runtime();
    let v = start_verifier(&rt, &m.target_path);
    let url = format!("http://{}", v.grpc_addr);
    let cfg = SplitConfig {
        layer: SplitLayer::Named("auto".into()),
        profile: Some(device.clone()),
        server_profile: Some(server.clone()),
        round_overhead_ms: 20.0,
        ..SplitConfig::default()
    };
    let mut e = edge(&url, cfg, m.draft.clone(), m.target.clone());
    let g = e
        .generate(PROMPT, &gen_cfg(SamplingParams::default()), &mut |_| true)
        .unwrap();
    assert_eq!(g.tokens, expected);
    let r = g.stats.split.unwrap();
    assert_eq!(r.layer, N_LAYER, "{r:?}");
    assert!(
        (r.predicted_device_ms.unwrap() - 40.0).abs() < 1e-6,
        "{r:?}"
    );
    assert!(
        (r.predicted_server_ms.unwrap() - 100.0).abs() < 1e-6,
        "{r:?}"
    );
    // 1 ms assumed RTT + 20 ms overhead + at most 5 x 1024 B up and 5 x 4 B down
    // at 1 Gbit/s (the last round's block may be shorter).
    let bytes_ms = r.predicted_network_ms.unwrap() - 21.0;
    assert!(
        bytes_ms > 0.0 && bytes_ms <= 5.0 * 1028.0 * 8.0 / 1e6 + 1e-9,
        "{r:?}"
    );
    // A server profile needs the device's own.
    let cfg = SplitConfig {
        server_profile: Some(server),
        ..fixed(2, false)
    };
    let cfg = EdgeConfig {
        verifier_url: Some(url),
        token: Some(TOKEN.into()),
        tokenizer_fingerprint: Some(FP.into()),
        k: 4,
        split: Some(cfg),
        ..EdgeConfig::default()
    };
    let err = EdgeRuntime::builder(m.draft.clone(), cfg)
        .split_target(m.target.clone())
        .build()
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("server_profile needs profile"), "{err}");
}

/// Tiny-model profile: 4 blocks and the head at 10 ms each (block of 5).
fn write_profile(path: &Path) {
    write_profile_scaled(path, 1.0)
}

/// As [`write_profile`], every compute time multiplied by `f`.
fn write_profile_scaled(path: &Path, f: f64) {
    let mut layers = vec![serde_json::json!({"name": "embedding", "kind": "embedding",
        "weight_bytes": 1000, "kv_bytes_per_token": 0, "activation_bytes_per_token": 1024,
        "compute_seconds": {"5": 0.0}})];
    for i in 0..N_LAYER {
        layers.push(
            serde_json::json!({"name": format!("blk.{i}"), "kind": "block",
            "weight_bytes": 1000, "kv_bytes_per_token": 0, "activation_bytes_per_token": 1024,
            "compute_seconds": {"5": 0.01 * f}}),
        );
    }
    layers.push(
        serde_json::json!({"name": "head", "kind": "head", "weight_bytes": 1000,
        "kv_bytes_per_token": 0, "activation_bytes_per_token": 4, "compute_seconds": {"5": 0.01 * f}}),
    );
    let p = serde_json::json!({"schema": "tandem.profile.v1", "model": "tiny",
        "context_tokens": 16, "block_sizes": [5], "layers": layers});
    std::fs::write(path, p.to_string()).unwrap();
}

#[test]
fn auto_u_shape_starts_all_local_on_a_slow_link_and_moves_to_the_server_when_the_rtt_drops() {
    let m = setup();
    let gen = GenerateConfig {
        max_tokens: 64,
        ..gen_cfg(SamplingParams::default())
    };
    let expected = generate_single(&m.target, PROMPT, &gen, &mut |_| true)
        .unwrap()
        .tokens;
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("p.json");
    write_profile(&profile);
    let rt = io_runtime();
    let v = start_verifier(&rt, &m.target_path);
    let url = format!("http://{}", v.grpc_addr);
    // U-shape, 10x server: all-local costs 50 ms a round, s = 0 costs 14 ms + one
    // RTT. Assumed RTT 60 ms: all-local. The probe rounds (1 in 8) measure ~1 ms
    // on loopback; the smoothed estimate falls below ~36 ms and auto moves to s = 0.
    let cfg = SplitConfig {
        layer: SplitLayer::Named("auto".into()),
        pin_head: true,
        profile: Some(profile),
        server_speed: 10.0,
        initial_rtt_ms: 60.0,
        replan_threshold: 0.1,
        replan_min_ms: 1.0,
        ..SplitConfig::default()
    };
    let mut e = edge(&url, cfg, m.draft.clone(), m.target.clone());
    let g = e.generate(PROMPT, &gen, &mut |_| true).unwrap();
    assert_eq!(g.tokens, expected);
    let r = g.stats.split.unwrap();
    assert_eq!(r.replans, 1, "{r:?}");
    assert_eq!(r.layer, 0, "{r:?}");
    assert!(r.local_rounds >= 8, "{r:?}");
    assert!(g.stats.gen.rounds > r.local_rounds + 2, "{r:?}");
    assert!(g.stats.opens >= 2, "re-planning opens a new session");
    assert!(r.rtt_estimate_ms.unwrap() < 36.0, "{r:?}");
}
