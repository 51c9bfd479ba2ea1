//! Proposers over the network (`GenerateConfig::proposer`: draft, lookup,
//! auto) on tiny random models through a real in-process verifier: greedy
//! output is the target's own for every proposer, plain and split (token ids,
//! hidden states, and the all-local U-shape); sampled lookup proposals (point
//! masses) are accepted by the verifier's rule. Outages with lookup are in
//! `tests/outage.rs`; the real models in `tests/proposers_real.rs`.

#![allow(clippy::unwrap_used)]

mod common;
use common::{
    io_runtime, load, start_delay_proxy, start_tiny_verifier, target_greedy, target_own, tiny_edge,
    tiny_models,
};
use tandem_edge::device_layers::{SplitConfig, SplitLayer};
use tandem_edge::TokenStatus;
use tandem_model::proposer::ProposerKind;
use tandem_model::sampling::SamplingParams;
use tandem_model::speculative::GenerateConfig;

const TOKEN: &str = "proposer-test-token-0123456789";
/// Repeats itself, so that lookup finds matches from the first round.
const PROMPT: &[u32] = &[5, 17, 42, 99, 3, 250, 7, 5, 17, 42, 99, 3, 250, 7, 5, 17];
const MAX: usize = 40;

fn gen(proposer: ProposerKind) -> GenerateConfig {
    GenerateConfig {
        k: 4,
        max_tokens: MAX,
        proposer,
        ..GenerateConfig::default()
    }
}

#[test]
fn greedy_output_is_the_target_s_for_every_proposer() {
    let dir = tempfile::tempdir().unwrap();
    let (target_p, draft_p) = tiny_models(dir.path());
    let want = target_greedy(&load(&target_p), PROMPT, MAX);
    let rt = io_runtime();
    let v = start_tiny_verifier(&rt, &target_p, TOKEN);
    let url = format!("http://{}", v.grpc_addr);
    let mut edge = tiny_edge(&draft_p, &url, TOKEN, |_| {});
    for proposer in ProposerKind::ALL {
        // Twice: auto's second generation starts from what the first learnt.
        for _ in 0..2 {
            let g = edge
                .generate(PROMPT, &gen(proposer), &mut |_| true)
                .unwrap();
            assert_eq!(g.tokens, want, "{proposer}");
            assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
            let p = &g.stats.proposers;
            assert_eq!(
                p.draft.rounds + p.lookup.rounds + p.none_rounds,
                g.stats.rounds,
                "{proposer}: {p:?}"
            );
            assert_eq!(p.draft.drafted + p.lookup.drafted, g.stats.drafted);
            assert_eq!(p.draft.accepted + p.lookup.accepted, g.stats.accepted);
            match proposer {
                ProposerKind::Draft => assert_eq!(p.draft.rounds, g.stats.rounds),
                ProposerKind::Lookup => {
                    assert_eq!(p.draft.rounds, 0);
                    assert!(p.lookup.rounds > 0, "the prompt repeats: {p:?}");
                    // The draft model never ran a block (only nothing at all).
                    assert_eq!(g.stats.draft_forwards, 0);
                }
                ProposerKind::Auto => {}
            }
        }
    }
    rt.block_on(v.shutdown()).unwrap();
}

#[test]
fn sampled_output_is_the_targets_own_for_every_proposer() {
    let dir = tempfile::tempdir().unwrap();
    let (target_p, draft_p) = tiny_models(dir.path());
    let target = load(&target_p);
    let rt = io_runtime();
    let v = start_tiny_verifier(&rt, &target_p, TOKEN);
    let url = format!("http://{}", v.grpc_addr);
    let mut edge = tiny_edge(&draft_p, &url, TOKEN, |_| {});
    let sampling = SamplingParams {
        temperature: 0.8,
        seed: 7,
        ..SamplingParams::default()
    };
    let want = target_own(&target, PROMPT, MAX, sampling);
    for proposer in ProposerKind::ALL {
        let cfg = GenerateConfig {
            sampling,
            ..gen(proposer)
        };
        let g = edge.generate(PROMPT, &cfg, &mut |_| true).unwrap();
        assert_eq!(g.tokens, want, "{proposer}");
        assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
    }
    rt.block_on(v.shutdown()).unwrap();
}

#[test]
fn split_sessions_take_lookup_and_auto_proposals() {
    let dir = tempfile::tempdir().unwrap();
    let (target_p, draft_p) = tiny_models(dir.path());
    let target = load(&target_p);
    let n_layer = target.config().n_layer;
    let want = target_greedy(&target, PROMPT, MAX);
    let rt = io_runtime();
    let v = start_tiny_verifier(&rt, &target_p, TOKEN);
    let url = format!("http://{}", v.grpc_addr);
    for (s, pin_head) in [(1, false), (1, true), (n_layer, true)] {
        let cfg = tandem_edge::EdgeConfig {
            verifier_url: Some(url.clone()),
            token: Some(TOKEN.into()),
            tokenizer_fingerprint: Some(common::FP.into()),
            k: 4,
            split: Some(SplitConfig {
                layer: SplitLayer::Fixed(s),
                pin_head,
                ..SplitConfig::default()
            }),
            ..tandem_edge::EdgeConfig::default()
        };
        for proposer in [ProposerKind::Lookup, ProposerKind::Auto] {
            // One runtime per generation: the split report counts per runtime.
            let mut edge = tandem_edge::EdgeRuntime::builder(load(&draft_p), cfg.clone())
                .split_target(target.clone())
                .build()
                .unwrap();
            let g = edge
                .generate(PROMPT, &gen(proposer), &mut |_| true)
                .unwrap();
            assert_eq!(g.tokens, want, "s = {s}, pin_head = {pin_head}, {proposer}");
            let r = g.stats.split.as_ref().unwrap();
            assert_eq!(
                g.stats.verifier_passes,
                g.stats.opens + g.stats.rounds - r.local_rounds
            );
        }
    }
    rt.block_on(v.shutdown()).unwrap();
}

#[test]
fn over_a_slow_link_auto_drafts_with_the_model_when_lookup_has_nothing() {
    // A 40 ms round trip against a tiny draft forward (well under a
    // millisecond): a draft round costs about what a plain step costs and
    // yields more, so auto must choose it where lookup has no match. Before
    // the runtime timed the draft, auto priced an unmeasured draft token at
    // 0.45 of a *round trip* and never chose it over a network.
    const DISTINCT: &[u32] = &[5, 17, 42, 99, 3, 250, 7, 11, 13, 19, 23, 29];
    const N: usize = 16;
    let dir = tempfile::tempdir().unwrap();
    let (target_p, draft_p) = tiny_models(dir.path());
    let want = target_greedy(&load(&target_p), DISTINCT, N);
    let rt = io_runtime();
    let v = start_tiny_verifier(&rt, &target_p, TOKEN);
    let proxy = start_delay_proxy(&rt, v.grpc_addr, std::time::Duration::from_millis(20));
    let mut edge = tiny_edge(&draft_p, &format!("http://{proxy}"), TOKEN, |_| {});
    let g = edge
        .generate(
            DISTINCT,
            &GenerateConfig {
                max_tokens: N,
                ..gen(ProposerKind::Auto)
            },
            &mut |_| true,
        )
        .unwrap();
    assert_eq!(g.tokens, want);
    let p = &g.stats.proposers;
    assert!(p.draft.rounds > 0, "auto never drafted: {p:?}");
    rt.block_on(v.shutdown()).unwrap();
}
