//! Pipelined drafting and target-only streaming against a real in-process
//! verifier (tiny random models) behind a small delaying TCP proxy (so a verify
//! is in flight long enough to draft ahead): greedy and seeded sampled output
//! must equal the target's own, whether the pre-drafted tokens are used
//! (draft = target) or discarded (a different draft).

#![allow(clippy::unwrap_used)]

mod common;
use common::{io_runtime, load, start_delay_proxy, start_tiny_verifier, tiny_edge, tiny_models};
use std::path::Path;
use std::time::Duration;
use tandem_edge::adaptive::SpeculationConfig;
use tandem_edge::{EdgeRuntime, TokenStatus};
use tandem_model::sampling::SamplingParams;
use tandem_model::speculative::{generate_single, GenerateConfig, StopReason};

const TOKEN: &str = "pipeline-test-token-0123456789";
const PROMPT: &[u32] = &[5, 17, 42, 99, 3, 250, 7];

fn edge(draft: &Path, url: String, spec: SpeculationConfig) -> EdgeRuntime {
    tiny_edge(draft, &url, TOKEN, |c| c.speculation = spec)
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

#[test]
fn pipelined_greedy_and_sampled_output_equals_target_only() {
    let dir = tempfile::tempdir().unwrap();
    let (target_path, draft_path) = tiny_models(dir.path());
    let target = load(&target_path);
    let expected = generate_single(&target, PROMPT, &gen_cfg(1, 40), &mut |_| true)
        .unwrap()
        .tokens;
    let rt = io_runtime();
    let v = start_tiny_verifier(&rt, &target_path, TOKEN);
    let proxy = start_delay_proxy(&rt, v.grpc_addr, Duration::from_millis(15));
    let url = format!("http://{proxy}");
    let spec = SpeculationConfig {
        pipeline: true,
        ..SpeculationConfig::default()
    };
    // Draft = target: every block accepted and every bonus guessed, so the
    // pre-drafted tokens start the next blocks.
    let mut same = edge(&target_path, url.clone(), spec.clone());
    for k in [1, 4] {
        let g = same
            .generate(PROMPT, &gen_cfg(k, 40), &mut |_| true)
            .unwrap();
        assert_eq!(g.tokens, expected, "draft = target, k = {k}");
        assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
        assert_eq!(g.stop, StopReason::MaxTokens);
        let rounds = same.last_rounds();
        assert_eq!(rounds.len() as u64, g.stats.rounds);
        let reused: usize = rounds.iter().map(|r| r.reused).sum();
        assert!(
            reused > 0,
            "k = {k}: no pre-drafted token was used: {rounds:?}"
        );
        assert!(rounds.iter().all(|r| r.accepted == r.k));
    }
    // A different draft: rejections discard the pre-drafted continuation.
    let mut other = edge(&draft_path, url, spec);
    for k in [1, 3, 8] {
        let g = other
            .generate(PROMPT, &gen_cfg(k, 40), &mut |_| true)
            .unwrap();
        assert_eq!(g.tokens, expected, "different draft, k = {k}");
        assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
        assert!(other.last_rounds().iter().any(|r| r.accepted < r.k));
    }
    // Sampled: the draft guesses the verdict's token with its keyed draw, the
    // target's key; the output is the target's own for the seed.
    let sampled = GenerateConfig {
        sampling: SamplingParams {
            temperature: 0.8,
            seed: 3,
            ..SamplingParams::default()
        },
        ..gen_cfg(4, 40)
    };
    let expected = generate_single(&target, PROMPT, &sampled, &mut |_| true)
        .unwrap()
        .tokens;
    let g = same.generate(PROMPT, &sampled, &mut |_| true).unwrap();
    assert_eq!(g.tokens, expected, "sampled, draft = target");
    assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
    let rounds = same.last_rounds();
    assert!(
        rounds.iter().map(|r| r.reused).sum::<usize>() > 0,
        "{rounds:?}"
    );
    assert!(rounds.iter().all(|r| r.accepted == r.k));
    let g = other.generate(PROMPT, &sampled, &mut |_| true).unwrap();
    assert_eq!(g.tokens, expected, "sampled, different draft");
    assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
}

#[test]
fn target_stream_output_equals_target_only_with_requests_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let (target_path, draft_path) = tiny_models(dir.path());
    let target = load(&target_path);
    let expected = generate_single(&target, PROMPT, &gen_cfg(1, 30), &mut |_| true)
        .unwrap()
        .tokens;
    let rt = io_runtime();
    let v = start_tiny_verifier(&rt, &target_path, TOKEN);
    let proxy = start_delay_proxy(&rt, v.grpc_addr, Duration::from_millis(10));
    for window in [1, 4] {
        let spec = SpeculationConfig {
            target_stream: true,
            stream_window: window,
            ..SpeculationConfig::default()
        };
        let mut e = edge(&draft_path, format!("http://{proxy}"), spec);
        let g = e.generate(PROMPT, &gen_cfg(4, 30), &mut |_| true).unwrap();
        assert_eq!(g.tokens, expected, "window {window}");
        assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
        assert_eq!(g.stats.drafted, 0);
        assert_eq!(g.stats.draft_forwards, 0, "the draft never ran");
        assert_eq!(g.stats.rounds, 30);
        // Every streamed token is a core round with no proposal.
        assert_eq!(g.stats.proposers.none_rounds, 30);
        assert_eq!(g.stats.proposers.draft.rounds, 0);
        assert_eq!(g.stats.proposers.lookup.rounds, 0);
        // One Open prefill + one target pass per token.
        assert_eq!(g.stats.verifier_passes, 31);
        // A second generation on the same runtime (late verdicts of the first
        // stream must not leak into it).
        let g2 = e.generate(PROMPT, &gen_cfg(4, 12), &mut |_| true).unwrap();
        assert_eq!(g2.tokens, expected[..12].to_vec());
    }
}
