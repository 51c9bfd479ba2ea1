//! A link that goes **silent** (connections accepted, every byte dropped, nothing
//! refused) in the middle of a generation, then comes back: the device must keep
//! producing tokens (provisional) while it is silent — it used to stall in a
//! re-Open that waited for `open_timeout_ms` (30 s) — and, once the link is back,
//! reconnect, check the provisional span and continue verified. Tiny random
//! models, a real in-process verifier behind the switchable proxy of
//! `tests/common`.

#![allow(clippy::unwrap_used)]

mod common;
use common::{
    greedy_predictions, io_runtime, load, outage_edge_config, predictions, start_switchable_proxy,
    start_tiny_verifier, target_greedy, target_own, tiny_models,
};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tandem_edge::adaptive::SpeculationConfig;
use tandem_edge::{BreakerState, EdgeConfig, EdgeEvent, EdgeGeneration, EdgeRuntime, TokenStatus};
use tandem_model::proposer::ProposerKind;
use tandem_model::sampling::SamplingParams;
use tandem_model::speculative::GenerateConfig;

const TOKEN: &str = "outage-test-token-0123456789";
const PROMPT: &[u32] = &[5, 17, 42, 99, 3, 250, 7];
const MAX: usize = 200;
/// The link goes silent when this output index is emitted...
const SILENT_AT: usize = 6;
/// ...for this long.
const SILENCE: Duration = Duration::from_millis(1000);

struct Outcome {
    g: EdgeGeneration,
    /// Per output token: was the link silent when it was emitted?
    while_silent: Vec<bool>,
    checked_events: usize,
    breaker: BreakerState,
}

/// One generation through the proxy; the link goes silent at token `SILENT_AT`
/// for `SILENCE`. The edge config keeps the default `open_timeout_ms` (30 s),
/// the budget the old re-open waited for.
fn generate_through_outage(
    draft: &Path,
    target: &Path,
    spec: SpeculationConfig,
    proposer: ProposerKind,
    sampling: SamplingParams,
) -> Outcome {
    let vrt = io_runtime();
    let v = start_tiny_verifier(&vrt, target, TOKEN);
    let (addr, silent) = start_switchable_proxy(&vrt, v.grpc_addr, Duration::from_millis(2));
    let cfg = EdgeConfig {
        speculation: spec,
        ..outage_edge_config(addr, TOKEN)
    };
    assert_eq!(cfg.open_timeout_ms, 30_000);
    let mut edge = EdgeRuntime::builder(load(draft), cfg).build().unwrap();
    let gen = GenerateConfig {
        k: 4,
        max_tokens: MAX,
        // f32 draft KV: a draft that is the target is then a perfect draft,
        // and provisional tokens are `greedy_predictions(draft)`.
        draft_kv: tandem_model::kv_cache::KvPrecision::F32,
        proposer,
        sampling,
        ..GenerateConfig::default()
    };
    let mut while_silent = Vec::new();
    let mut checked_events = 0;
    let mut restorer = None;
    let g = edge
        .generate(PROMPT, &gen, &mut |e| {
            match e {
                EdgeEvent::Token { index, status, .. } => {
                    while_silent.push(silent.load(Ordering::SeqCst));
                    if *index == SILENT_AT && restorer.is_none() {
                        silent.store(true, Ordering::SeqCst);
                        let s: Arc<AtomicBool> = silent.clone();
                        restorer = Some(std::thread::spawn(move || {
                            std::thread::sleep(SILENCE);
                            s.store(false, Ordering::SeqCst);
                        }));
                    }
                    if *status == TokenStatus::Provisional {
                        // A device slower than the tiny model, so the generation
                        // outlasts the outage.
                        std::thread::sleep(Duration::from_millis(8));
                    }
                }
                EdgeEvent::ProvisionalChecked(_) => checked_events += 1,
            }
            true
        })
        .unwrap();
    restorer.unwrap().join().unwrap();
    let breaker = edge.breaker_state();
    vrt.block_on(v.shutdown()).unwrap();
    Outcome {
        g,
        while_silent,
        checked_events,
        breaker,
    }
}

/// What every outage run must show: verified, then provisional tokens that were
/// emitted while the link was silent, then verified again; the span checked.
fn check_common(o: &Outcome) -> (usize, usize) {
    let g = &o.g;
    assert_eq!(g.tokens.len(), MAX, "output complete");
    let st = &g.statuses;
    let first = st
        .iter()
        .position(|s| *s == TokenStatus::Provisional)
        .expect("no provisional token");
    let last = st
        .iter()
        .rposition(|s| *s == TokenStatus::Provisional)
        .unwrap();
    assert!(first > SILENT_AT, "tokens before the outage were verified");
    assert!(st[..first].iter().all(|s| *s == TokenStatus::Verified));
    // The point: tokens kept flowing while the verifier was unreachable.
    let during = (0..MAX)
        .filter(|&i| o.while_silent[i] && st[i] == TokenStatus::Provisional)
        .count();
    assert!(
        during >= 5,
        "only {during} provisional tokens while the link was silent: the device stalled ({st:?})"
    );
    assert!(
        st[first..=last]
            .iter()
            .all(|s| *s == TokenStatus::Provisional),
        "one provisional span"
    );
    assert!(last + 1 < MAX, "speculative again after the outage");
    assert!(st[last + 1..].iter().all(|s| *s == TokenStatus::Verified));
    let r = &g.provisional;
    assert_eq!(r.provisional_tokens, last + 1 - first);
    assert_eq!(r.checked_tokens, r.provisional_tokens, "all checked");
    assert_eq!(r.spans.len(), 1);
    assert!(r.spans[0].checked);
    assert_eq!((r.spans[0].start, r.spans[0].end), (first, last + 1));
    assert_eq!(o.checked_events, 1);
    let s = &g.stats;
    assert!(s.timeouts >= 1 && s.failures >= 1, "{s:?}");
    assert!(s.background_opens >= 1, "{s:?}");
    assert!(s.opens >= 2 && s.check_rounds >= 1, "{s:?}");
    assert_eq!(o.breaker, BreakerState::Closed);
    (first, last)
}

#[test]
fn silent_link_keeps_tokens_flowing_as_provisional_then_checks_them() {
    let dir = tempfile::tempdir().unwrap();
    let (target_p, draft_p) = tiny_models(dir.path());
    let (target, draft) = (load(&target_p), load(&draft_p));
    let t = std::time::Instant::now();
    // Greedy, then sampled (keyed draws: the span is checked the same way)
    // with adaptive k and pipelined drafting.
    let sampled = SamplingParams {
        temperature: 0.8,
        seed: 11,
        ..SamplingParams::default()
    };
    for (spec, sampling) in [
        (SpeculationConfig::default(), SamplingParams::default()),
        (
            SpeculationConfig {
                adaptive_k: true,
                pipeline: true,
                ..SpeculationConfig::default()
            },
            sampled,
        ),
    ] {
        let target_only = target_own(&target, PROMPT, MAX, sampling);
        let o = generate_through_outage(
            &draft_p,
            &target_p,
            spec.clone(),
            ProposerKind::Draft,
            sampling,
        );
        let (first, last) = check_common(&o);
        let g = &o.g;
        // Verified tokens are the target's choice given the streamed prefix,
        // provisional ones the draft's; mismatches are reported exactly.
        let t_pred = predictions(&target, PROMPT, &g.tokens, &sampling);
        let d_pred = predictions(&draft, PROMPT, &g.tokens, &sampling);
        let mut mismatches = Vec::new();
        for i in 0..MAX {
            if i < first || i > last {
                assert_eq!(g.tokens[i], t_pred[i], "verified token {i} ({spec:?})");
            } else {
                assert_eq!(g.tokens[i], d_pred[i], "provisional token {i}");
                if t_pred[i] != g.tokens[i] {
                    mismatches.push(i);
                }
            }
        }
        assert_eq!(g.provisional.spans[0].mismatches, mismatches);
        assert_eq!(g.provisional.first_mismatch, mismatches.first().copied());
        assert_eq!(g.tokens[..first], target_only[..first]);
    }
    eprintln!(
        "two outage runs (random draft): {:.1} s",
        t.elapsed().as_secs_f64()
    );
}

#[test]
fn silent_link_with_a_perfect_draft_gives_exactly_the_target_output() {
    // Draft = target: every provisional token is the target's, so after the
    // check the whole output is the target-only output, nothing mismatched.
    let dir = tempfile::tempdir().unwrap();
    let (target_p, _) = tiny_models(dir.path());
    let target = load(&target_p);
    let t = std::time::Instant::now();
    let o = generate_through_outage(
        &target_p,
        &target_p,
        SpeculationConfig::default(),
        ProposerKind::Draft,
        SamplingParams::default(),
    );
    check_common(&o);
    let want = target_greedy(&target, PROMPT, MAX);
    assert_eq!(o.g.tokens, want);
    assert_eq!(o.g.provisional.mismatched_tokens, 0);
    assert_eq!(o.g.provisional.first_mismatch, None);
    eprintln!(
        "outage run (perfect draft): {:.1} s",
        t.elapsed().as_secs_f64()
    );
}

#[test]
fn silent_link_with_lookup_proposals_keeps_the_same_guarantees() {
    // Lookup rounds leave the draft behind the context; drafting alone must
    // catch it up, and the span is checked as with the draft proposer.
    let dir = tempfile::tempdir().unwrap();
    let (target_p, draft_p) = tiny_models(dir.path());
    let (target, draft) = (load(&target_p), load(&draft_p));
    let target_only = target_greedy(&target, PROMPT, MAX);
    let o = generate_through_outage(
        &draft_p,
        &target_p,
        SpeculationConfig::default(),
        ProposerKind::Lookup,
        SamplingParams::default(),
    );
    let (first, last) = check_common(&o);
    let g = &o.g;
    let t_pred = greedy_predictions(&target, PROMPT, &g.tokens);
    let d_pred = greedy_predictions(&draft, PROMPT, &g.tokens);
    let mut mismatches = Vec::new();
    for i in 0..MAX {
        if i < first || i > last {
            assert_eq!(g.tokens[i], t_pred[i], "verified token {i}");
        } else {
            assert_eq!(g.tokens[i], d_pred[i], "provisional token {i}");
            if t_pred[i] != g.tokens[i] {
                mismatches.push(i);
            }
        }
    }
    assert_eq!(g.provisional.spans[0].mismatches, mismatches);
    assert_eq!(g.tokens[..first], target_only[..first]);
    let p = &g.stats.proposers;
    assert_eq!(p.draft.rounds, 0, "{p:?}");
    assert_eq!(p.lookup.rounds + p.none_rounds, g.stats.rounds, "{p:?}");
}
