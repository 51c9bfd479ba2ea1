//! Uncertainty-gated verification (`[gate]`) against a real in-process verifier
//! (tiny random models): gated blocks are shown as provisional without a round
//! trip and verified with the next block; every provisional token is checked,
//! every mismatch reported is a real one, and every verified token is the
//! target's greedy token given the text shown before it.

#![allow(clippy::unwrap_used)]

mod common;
use common::{
    greedy_predictions, io_runtime, load, start_tiny_verifier, target_greedy, tiny_edge,
    tiny_models,
};
use std::path::Path;
use tandem_edge::config::GateConfig;
use tandem_edge::{EdgeConfig, EdgeEvent, EdgeRuntime, TokenStatus};
use tandem_model::speculative::GenerateConfig;

const TOKEN: &str = "gate-test-token-0123456789abcdef";
const PROMPT: &[u32] = &[5, 17, 42, 99, 3, 250, 7];

fn edge(draft: &Path, url: &str, gate: GateConfig) -> EdgeRuntime {
    tiny_edge(draft, url, TOKEN, |c| c.gate = gate)
}

/// The draft's KV in f32: a draft that is the target is then a perfect draft,
/// and provisional tokens are `greedy_predictions(draft)` (INT8 KV, the
/// default, makes it an imperfect one).
fn gen_cfg(k: usize, max_tokens: usize) -> GenerateConfig {
    GenerateConfig {
        k,
        max_tokens,
        draft_kv: tandem_model::kv_cache::KvPrecision::F32,
        ..GenerateConfig::default()
    }
}

/// Gates every block it may (any probability passes).
fn always() -> GateConfig {
    GateConfig {
        confidence: 1e-30,
        max_span: 8,
    }
}

#[test]
fn gated_blocks_from_a_perfect_draft_are_all_confirmed_with_fewer_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let (target_path, _) = tiny_models(dir.path());
    let target = load(&target_path);
    let expected = target_greedy(&target, PROMPT, 40);
    let rt = io_runtime();
    let v = start_tiny_verifier(&rt, &target_path, TOKEN);
    let url = format!("http://{}", v.grpc_addr);

    let mut plain = edge(&target_path, &url, GateConfig::default());
    let p = plain
        .generate(PROMPT, &gen_cfg(4, 40), &mut |_| true)
        .unwrap();
    assert_eq!(p.tokens, expected);
    assert_eq!(p.stats.gated_rounds, 0);

    let mut gated = edge(&target_path, &url, always());
    let mut checked_events = 0;
    let g = gated
        .generate(PROMPT, &gen_cfg(4, 40), &mut |e| {
            if let EdgeEvent::ProvisionalChecked(span) = e {
                assert!(span.checked && span.mismatches.is_empty(), "{span:?}");
                checked_events += 1;
            }
            true
        })
        .unwrap();
    // Draft = target: every gated token is the target's own.
    assert_eq!(g.tokens, expected);
    assert!(g.stats.gated_rounds > 0, "{:?}", g.stats);
    let provisional = g
        .statuses
        .iter()
        .filter(|s| **s == TokenStatus::Provisional)
        .count();
    assert_eq!(provisional as u64, g.stats.gated_tokens);
    assert_eq!(g.provisional.provisional_tokens, provisional);
    assert_eq!(g.provisional.checked_tokens, provisional);
    assert_eq!(g.provisional.mismatched_tokens, 0);
    assert!(checked_events > 0);
    // A gated span never exceeds max_span.
    for s in &g.provisional.spans {
        assert!(s.end - s.start <= 8, "{s:?}");
    }
    assert!(
        g.stats.verifier_passes < p.stats.verifier_passes,
        "gated {} vs plain {} verifier passes",
        g.stats.verifier_passes,
        p.stats.verifier_passes
    );
}

#[test]
fn gated_tokens_from_a_different_draft_are_checked_and_mismatches_reported() {
    let dir = tempfile::tempdir().unwrap();
    let (target_path, draft_path) = tiny_models(dir.path());
    let target = load(&target_path);
    let rt = io_runtime();
    let v = start_tiny_verifier(&rt, &target_path, TOKEN);
    let url = format!("http://{}", v.grpc_addr);
    let mut gated = edge(&draft_path, &url, always());
    let mut mismatches_total = 0;
    for k in [1, 2, 4] {
        let g = gated
            .generate(PROMPT, &gen_cfg(k, 48), &mut |_| true)
            .unwrap();
        let pred = greedy_predictions(&target, PROMPT, &g.tokens);
        assert!(g.stats.gated_rounds > 0, "k = {k}: {:?}", g.stats);
        let mut provisional = 0;
        for (i, s) in g.statuses.iter().enumerate() {
            match s {
                // Verified: the target's greedy token given the shown text.
                TokenStatus::Verified => assert_eq!(g.tokens[i], pred[i], "k = {k}, token {i}"),
                TokenStatus::Provisional => provisional += 1,
                TokenStatus::Local => panic!("k = {k}: local token {i}"),
            }
        }
        // Every provisional token checked; the mismatches reported are exactly
        // the provisional positions where the target disagrees.
        assert_eq!(g.provisional.provisional_tokens, provisional);
        assert_eq!(g.provisional.checked_tokens, provisional, "k = {k}");
        let mut reported: Vec<usize> = g
            .provisional
            .spans
            .iter()
            .flat_map(|s| s.mismatches.iter().copied())
            .collect();
        reported.sort_unstable();
        let actual: Vec<usize> = (0..g.tokens.len())
            .filter(|&i| g.statuses[i] == TokenStatus::Provisional && g.tokens[i] != pred[i])
            .collect();
        assert_eq!(reported, actual, "k = {k}");
        mismatches_total += actual.len();
    }
    assert!(
        mismatches_total > 0,
        "a random draft was never wrong on a gated token: the test lost its teeth"
    );
}

#[test]
fn a_threshold_no_block_reaches_gates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (target_path, draft_path) = tiny_models(dir.path());
    let target = load(&target_path);
    let expected = target_greedy(&target, PROMPT, 32);
    let rt = io_runtime();
    let v = start_tiny_verifier(&rt, &target_path, TOKEN);
    let url = format!("http://{}", v.grpc_addr);
    // Tiny random models are never 100 % sure of a token.
    let strict = GateConfig {
        confidence: 1.0,
        max_span: 8,
    };
    let mut e = edge(&draft_path, &url, strict);
    let g = e.generate(PROMPT, &gen_cfg(4, 32), &mut |_| true).unwrap();
    assert_eq!(g.tokens, expected);
    assert_eq!(g.stats.gated_rounds, 0);
    assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
}

#[test]
fn gate_settings_are_validated() {
    let bad = |gate: GateConfig, pipeline: bool| {
        let mut cfg = EdgeConfig {
            gate,
            ..EdgeConfig::default()
        };
        cfg.speculation.pipeline = pipeline;
        cfg.validate().unwrap_err().to_string()
    };
    let e = bad(
        GateConfig {
            confidence: 1.5,
            max_span: 8,
        },
        false,
    );
    assert!(e.contains("gate.confidence"), "{e}");
    let e = bad(
        GateConfig {
            confidence: 0.9,
            max_span: 0,
        },
        false,
    );
    assert!(e.contains("gate.max_span"), "{e}");
    let e = bad(
        GateConfig {
            confidence: 0.9,
            max_span: 8,
        },
        true,
    );
    assert!(e.contains("pipeline"), "{e}");
    let cfg: EdgeConfig = toml::from_str("[gate]\nconfidence = 0.95\nmax_span = 12\n").unwrap();
    assert_eq!(cfg.gate.max_span, 12);
    cfg.validate().unwrap();
    assert!(toml::from_str::<EdgeConfig>("[gate]\nconfidence = 0.9\nspan = 3\n").is_err());
}

/// Gated rounds draft with the model whatever the generation's proposer
/// (the gate trusts the draft's confidence), and with logprobs asked every
/// token carries its own: the draft's for a shown (provisional) token, the
/// target's for a verified one. A span's check is reported before any
/// token after it.
#[test]
fn gated_rounds_draft_with_the_model_and_every_token_carries_logprobs() {
    let dir = tempfile::tempdir().unwrap();
    let (target_path, _) = tiny_models(dir.path());
    let target = load(&target_path);
    let expected = target_greedy(&target, PROMPT, 40);
    let rt = io_runtime();
    let v = start_tiny_verifier(&rt, &target_path, TOKEN);
    let url = format!("http://{}", v.grpc_addr);
    let mut gated = edge(&target_path, &url, always());
    let cfg = GenerateConfig {
        top_logprobs: Some(2),
        proposer: tandem_model::proposer::ProposerKind::Lookup,
        ..gen_cfg(4, 40)
    };
    let mut events = Vec::new();
    let g = gated
        .generate(PROMPT, &cfg, &mut |e| {
            events.push(e.clone());
            true
        })
        .unwrap();
    assert_eq!(g.tokens, expected);
    assert!(g.stats.gated_rounds > 0, "{:?}", g.stats);
    assert_eq!(g.stats.proposers.lookup.rounds, 0, "{:?}", g.stats);
    let mut emitted = 0;
    let mut provisional_with_logprobs = 0;
    for e in &events {
        match e {
            EdgeEvent::Token {
                id,
                status,
                logprobs,
                ..
            } => {
                let lp = logprobs.as_ref().expect("every token has logprobs");
                assert_eq!(lp.token, *id);
                assert_eq!(lp.top.len(), 2);
                if *status == TokenStatus::Provisional {
                    provisional_with_logprobs += 1;
                }
                emitted += 1;
            }
            EdgeEvent::ProvisionalChecked(span) => {
                assert!(span.checked && span.mismatches.is_empty(), "{span:?}");
                assert_eq!(span.end, emitted, "{span:?}");
            }
        }
    }
    assert_eq!(emitted, expected.len());
    // Every gated token is shown provisional with the draft's logprobs (a
    // timeout on a loaded machine may add provisional tokens of an outage).
    assert!(
        provisional_with_logprobs as u64 >= g.stats.gated_tokens,
        "{provisional_with_logprobs} provisional, {:?}",
        g.stats
    );
}
