//! Adaptive k against a real in-process verifier (tiny random models): greedy
//! output equals the target's own whatever k the chooser picks, the chosen k
//! stays in range, and behind a 40 ms round trip the chooser moves to long blocks
//! with a draft that is always right (draft = target) and to k <= 3 with one that
//! is always wrong.

#![allow(clippy::unwrap_used)]

mod common;
use common::start_delay_proxy;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tandem_edge::adaptive::SpeculationConfig;
use tandem_edge::{EdgeConfig, EdgeRuntime, TokenStatus};
use tandem_model::speculative::{generate_single, GenerateConfig};
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::transformer::{LoadOptions, Model};

const TOKEN: &str = "adaptive-test-token-0123456789";
const FP: &str = "tiny-test-fingerprint";
const PROMPT: &[u32] = &[5, 17, 42, 99, 3, 250, 7];

fn load(p: &Path) -> Arc<Model> {
    Arc::new(Model::load(p, LoadOptions::with_max_seq_len(512)).unwrap())
}

fn gen_cfg(k: usize, max_tokens: usize) -> GenerateConfig {
    GenerateConfig {
        k,
        max_tokens,
        ..GenerateConfig::default()
    }
}

#[test]
fn adaptive_k_keeps_greedy_identity_and_adapts() {
    let dir = tempfile::tempdir().unwrap();
    let target_path = dir.path().join("target.gguf");
    let draft_path = dir.path().join("draft.gguf");
    write_tiny_qwen2(&target_path, &TinyConfig::default()).unwrap();
    write_tiny_qwen2(&draft_path, &TinyConfig::draft_like()).unwrap();
    let target = load(&target_path);
    let expected = generate_single(&target, PROMPT, &gen_cfg(1, 32), &mut |_| true)
        .unwrap()
        .tokens;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nmodel_path = {target_path:?}\n\
         tokenizer_fingerprint = \"{FP}\"\nmax_seq_len = 4096\ninsecure_loopback = true\n\
         [[devices]]\nid = \"dev\"\ntoken = \"{TOKEN}\"\n"
    );
    let v = rt
        .block_on(tandem_verifier::start(toml::from_str(&text).unwrap()))
        .unwrap();
    // 20 ms each way: a round trip costs far more than a tiny draft's forward,
    // as on a real link.
    let proxy = start_delay_proxy(&rt, v.grpc_addr, Duration::from_millis(20));
    let mut mean_k = Vec::new();
    for (draft, pipeline) in [
        (&target_path, false),
        (&draft_path, false),
        (&target_path, true),
        (&draft_path, true),
    ] {
        let spec = SpeculationConfig {
            adaptive_k: true,
            k_min: 1,
            k_max: 10,
            pipeline,
            ..SpeculationConfig::default()
        };
        let cfg = EdgeConfig {
            verifier_url: Some(format!("http://{proxy}")),
            token: Some(TOKEN.into()),
            tokenizer_fingerprint: Some(FP.into()),
            speculation: spec,
            ..EdgeConfig::default()
        };
        let mut e = EdgeRuntime::builder(load(draft), cfg).build().unwrap();
        let mut ks = Vec::new();
        // Several generations: the chooser's estimates carry over.
        for _ in 0..2 {
            let g = e.generate(PROMPT, &gen_cfg(4, 32), &mut |_| true).unwrap();
            assert_eq!(g.tokens, expected, "pipeline {pipeline}");
            assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
            let rounds = e.last_rounds();
            assert_eq!(rounds.len() as u64, g.stats.rounds);
            assert!(rounds.iter().all(|r| (1..=10).contains(&r.k)), "{rounds:?}");
            ks.extend(rounds.iter().map(|r| r.k));
        }
        // The last rounds of the last generation show where the chooser settled.
        let tail = &ks[ks.len().saturating_sub(4)..];
        mean_k.push(tail.iter().sum::<usize>() as f64 / tail.len() as f64);
    }
    // Always right -> long blocks; always wrong -> short ones.
    assert!(mean_k[0] > mean_k[1], "{mean_k:?}");
    assert!(mean_k[1] <= 3.0, "{mean_k:?}");
    assert!(mean_k[2] > mean_k[3], "{mean_k:?}");
}
