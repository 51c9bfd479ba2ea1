//! Local speculative decoding on tiny random models: greedy output equals the
//! target's own greedy output for every k and every proposer, and argument
//! errors are clear.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::time::Duration;
use tandem_model::engine::TargetVerifier;
use tandem_model::kv_cache::KvPrecision;
use tandem_model::proposer::ProposerKind;
use tandem_model::sampling::SamplingParams;
use tandem_model::speculative::{
    generate_single, generate_single_with, generate_speculative, GenerateConfig, StopReason,
};
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::transformer::{LoadOptions, Model};

fn pair(dir: &std::path::Path, cap: usize) -> (Model, Model) {
    let t = dir.join("target.gguf");
    let d = dir.join("draft.gguf");
    write_tiny_qwen2(&t, &TinyConfig::default()).unwrap();
    // The draft: the same weights with one layer fewer agrees often but not always.
    write_tiny_qwen2(
        &d,
        &TinyConfig {
            n_layer: 1,
            ..TinyConfig::default()
        },
    )
    .unwrap();
    let o = LoadOptions::with_max_seq_len(cap);
    (
        Model::load(&d, o.clone()).unwrap(),
        Model::load(&t, o).unwrap(),
    )
}

/// The local target as the core's verifier, holding `prompt` but its last
/// token (as a round expects).
fn prefilled_verifier<'m>(
    target: &'m Model,
    prompt: &[u32],
    cfg: &GenerateConfig,
) -> TargetVerifier<'m> {
    let mut verifier = TargetVerifier::new(target, cfg.sampling);
    verifier.prefill(&prompt[..prompt.len() - 1]).unwrap();
    verifier
}

#[test]
fn greedy_speculative_equals_target_for_every_k() {
    let dir = tempfile::tempdir().unwrap();
    let (draft, target) = pair(dir.path(), 256);
    let mut total_accepted = 0;
    let mut total_rejected = 0;
    for (pi, prompt) in [vec![1u32, 2, 3], vec![100, 7, 42, 42, 9], vec![5]]
        .iter()
        .enumerate()
    {
        let cfg = GenerateConfig {
            max_tokens: 60,
            ..GenerateConfig::default()
        };
        let reference = generate_single(&target, prompt, &cfg, &mut |_| true).unwrap();
        assert_eq!(reference.tokens.len(), 60);
        for k in [1, 2, 3, 4, 8, 16] {
            let cfg = GenerateConfig {
                k,
                max_tokens: 60,
                ..GenerateConfig::default()
            };
            let mut streamed = Vec::new();
            let g = generate_speculative(&draft, &target, prompt, &cfg, &mut |t| {
                streamed.push(t);
                true
            })
            .unwrap();
            assert_eq!(g.tokens, reference.tokens, "prompt {pi} k={k}");
            assert_eq!(streamed, g.tokens, "streamed tokens equal the result");
            assert_eq!(g.stop, StopReason::MaxTokens);
            total_accepted += g.stats.accepted;
            total_rejected += g.stats.drafted - g.stats.accepted;
            assert!(g.stats.target_forwards <= 1 + g.stats.rounds);
        }
    }
    // The test is only meaningful if both paths (accept and reject) ran.
    assert!(
        total_accepted > 0 && total_rejected > 0,
        "{total_accepted} / {total_rejected}"
    );
}

#[test]
fn greedy_output_is_the_targets_for_every_proposer_and_k() {
    let dir = tempfile::tempdir().unwrap();
    let (draft, target) = pair(dir.path(), 256);
    // Prompts with repeated n-grams (lookup has something to find) and without.
    let prompts = [
        vec![10u32, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11],
        vec![100, 7, 42, 42, 9],
        (0..40).map(|i| (i % 7) as u32 + 3).collect::<Vec<_>>(),
    ];
    let (mut lookup_rounds, mut lookup_accepted, mut auto_lookup, mut plain) = (0, 0, 0, 0);
    for (pi, prompt) in prompts.iter().enumerate() {
        let base = GenerateConfig {
            max_tokens: 48,
            ..GenerateConfig::default()
        };
        let reference = generate_single(&target, prompt, &base, &mut |_| true).unwrap();
        for proposer in ProposerKind::ALL {
            for k in [1, 3, 4, 16] {
                let cfg = GenerateConfig {
                    k,
                    proposer,
                    ..base.clone()
                };
                let mut streamed = Vec::new();
                let g = generate_speculative(&draft, &target, prompt, &cfg, &mut |t| {
                    streamed.push(t);
                    true
                })
                .unwrap();
                let what = format!("prompt {pi} {proposer} k={k}");
                assert_eq!(g.tokens, reference.tokens, "{what}");
                assert_eq!(streamed, g.tokens, "{what}");
                let p = g.stats.proposers;
                assert_eq!(
                    p.draft.rounds + p.lookup.rounds + p.none_rounds,
                    g.stats.rounds,
                    "{what}"
                );
                assert_eq!(p.draft.accepted + p.lookup.accepted, g.stats.accepted);
                match proposer {
                    ProposerKind::Draft => assert_eq!(p.draft.rounds, g.stats.rounds),
                    ProposerKind::Lookup => {
                        assert_eq!(
                            g.stats.draft_forwards, 0,
                            "{what}: lookup never runs the draft"
                        );
                        assert_eq!(p.draft.rounds, 0);
                        lookup_rounds += p.lookup.rounds;
                        lookup_accepted += p.lookup.accepted;
                        plain += p.none_rounds;
                    }
                    ProposerKind::Auto => auto_lookup += p.lookup.rounds,
                }
            }
        }
    }
    // Lookup proposed, was right at least once, and found nothing at times.
    assert!(lookup_rounds > 0 && lookup_accepted > 0 && plain > 0);
    assert!(auto_lookup > 0, "auto never chose lookup");
}

/// The draft's KV precision (f32, f16, INT8) changes what it proposes, never
/// the output: every k gives the target's own greedy tokens, through accepted
/// and rejected blocks (so through each cache's rollback).
#[test]
fn greedy_output_is_the_targets_at_every_draft_kv_precision() {
    let dir = tempfile::tempdir().unwrap();
    let (draft, target) = pair(dir.path(), 256);
    let n = KvPrecision::ALL.len();
    let (mut accepted, mut rejected) = (vec![0u64; n], vec![0u64; n]);
    for (pi, prompt) in [vec![1u32, 2, 3], vec![100, 7, 42, 42, 9], vec![5]]
        .iter()
        .enumerate()
    {
        let base = GenerateConfig {
            max_tokens: 60,
            ..GenerateConfig::default()
        };
        let reference = generate_single(&target, prompt, &base, &mut |_| true).unwrap();
        for k in [1, 4, 8] {
            for (i, draft_kv) in KvPrecision::ALL.into_iter().enumerate() {
                let cfg = GenerateConfig {
                    k,
                    draft_kv,
                    ..base.clone()
                };
                let g = generate_speculative(&draft, &target, prompt, &cfg, &mut |_| true).unwrap();
                assert_eq!(g.tokens, reference.tokens, "prompt {pi} k={k} {draft_kv}");
                assert!(g.stats.draft_forwards > 0);
                accepted[i] += g.stats.accepted;
                rejected[i] += g.stats.drafted - g.stats.accepted;
            }
        }
    }
    eprintln!(
        "{:?}: accepted {accepted:?}, rejected {rejected:?}",
        KvPrecision::ALL
    );
    for (i, kv) in KvPrecision::ALL.into_iter().enumerate() {
        assert!(
            accepted[i] > 0 && rejected[i] > 0,
            "{kv}: both paths must run: {accepted:?} / {rejected:?}"
        );
    }
    // Draft-only generation takes the precision too (it is the draft's own
    // output, so INT8 may differ from f32; it must run to the end).
    let cfg = GenerateConfig {
        max_tokens: 20,
        ..GenerateConfig::default()
    };
    let d =
        generate_single_with(&draft, KvPrecision::Int8, &[1, 2, 3], &cfg, &mut |_| true).unwrap();
    assert_eq!(d.tokens.len(), 20);
}

#[test]
fn stop_tokens_and_cancellation() {
    let dir = tempfile::tempdir().unwrap();
    let (draft, target) = pair(dir.path(), 256);
    let base = GenerateConfig {
        max_tokens: 40,
        ..GenerateConfig::default()
    };
    let reference = generate_single(&target, &[1, 2, 3], &base, &mut |_| true).unwrap();
    let stop_at = reference.tokens[10];
    let first = reference.tokens.iter().position(|&t| t == stop_at).unwrap();
    let cfg = GenerateConfig {
        stop_tokens: vec![stop_at],
        ..base.clone()
    };
    for k in [1, 4, 16] {
        let cfg = GenerateConfig { k, ..cfg.clone() };
        let g = generate_speculative(&draft, &target, &[1, 2, 3], &cfg, &mut |_| true).unwrap();
        assert_eq!(g.tokens, reference.tokens[..first], "k={k}");
        assert_eq!(g.stop, StopReason::Stop);
    }
    let mut n = 0;
    let g = generate_speculative(&draft, &target, &[1, 2, 3], &base, &mut |_| {
        n += 1;
        n < 5
    })
    .unwrap();
    assert_eq!(g.stop, StopReason::Cancelled);
    assert_eq!(g.tokens, reference.tokens[..5]);
}

#[test]
fn context_full_ends_cleanly_and_matches_target() {
    let dir = tempfile::tempdir().unwrap();
    let (draft, target) = pair(dir.path(), 32);
    let cfg = GenerateConfig {
        max_tokens: 1000,
        k: 8,
        ..GenerateConfig::default()
    };
    let r = generate_single(&target, &[1, 2, 3, 4], &cfg, &mut |_| true).unwrap();
    let g = generate_speculative(&draft, &target, &[1, 2, 3, 4], &cfg, &mut |_| true).unwrap();
    assert_eq!(r.stop, StopReason::ContextFull);
    assert_eq!(g.stop, StopReason::ContextFull);
    assert_eq!(g.tokens, r.tokens);
}

#[test]
fn sampled_speculative_is_the_targets_own_seeded_output() {
    // Whatever proposes and however long the blocks, a seeded sampled generation
    // is the target's own with that seed (keyed draws, tandem_model::verify).
    let dir = tempfile::tempdir().unwrap();
    let (draft, target) = pair(dir.path(), 256);
    let sampling = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        top_k: 40,
        repetition_penalty: 1.1,
        seed: 7,
        ..SamplingParams::default()
    };
    let cfg = GenerateConfig {
        max_tokens: 40,
        sampling,
        ..GenerateConfig::default()
    };
    let prompt = [3, 1, 4, 1, 5];
    let alone = generate_single(&target, &prompt, &cfg, &mut |_| true).unwrap();
    assert_eq!(alone.tokens.len(), 40);
    let mut drafted_accepted = 0;
    for proposer in [
        ProposerKind::Draft,
        ProposerKind::Lookup,
        ProposerKind::Auto,
    ] {
        for k in [1, 3, 8] {
            let c = GenerateConfig {
                k,
                proposer,
                ..cfg.clone()
            };
            let g = generate_speculative(&draft, &target, &prompt, &c, &mut |_| true).unwrap();
            assert_eq!(g.tokens, alone.tokens, "{proposer:?} k={k}");
            if proposer == ProposerKind::Draft {
                drafted_accepted += g.stats.accepted;
            }
        }
    }
    assert!(drafted_accepted > 0, "the draft never matched a keyed draw");
    let other = GenerateConfig {
        sampling: SamplingParams {
            seed: 8,
            ..sampling
        },
        ..cfg.clone()
    };
    let c = generate_single(&target, &prompt, &other, &mut |_| true).unwrap();
    assert_ne!(alone.tokens, c.tokens, "another seed, another sample");
}

#[test]
fn bad_arguments_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (draft, target) = pair(dir.path(), 16);
    for k in [0, 17] {
        let cfg = GenerateConfig {
            k,
            ..GenerateConfig::default()
        };
        let e = generate_speculative(&draft, &target, &[1], &cfg, &mut |_| true).unwrap_err();
        assert!(e.to_string().contains("k = "), "{e}");
    }
    let cfg = GenerateConfig::default();
    assert!(generate_speculative(&draft, &target, &[], &cfg, &mut |_| true).is_err());
    let long: Vec<u32> = (0..16).collect();
    let e = generate_speculative(&draft, &target, &long, &cfg, &mut |_| true).unwrap_err();
    assert!(e.to_string().contains("capacity"), "{e}");
    let bad = GenerateConfig {
        sampling: SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        },
        ..GenerateConfig::default()
    };
    assert!(generate_single(&target, &[1], &bad, &mut |_| true).is_err());
}

/// The generation core's rounds against the target as a remote verifier
/// holds it (the prompt but its last token; no first token from a prefill:
/// the first round drafts after the prompt), block lengths cycling (0: no
/// proposal, the target's next token alone, as the edge's cloud-streamed
/// rounds): the output is the target's greedy output (what `tandem bench
/// verifier`'s trace records), and each round's verdict is consistent with
/// its block.
#[test]
fn the_core_rounds_against_the_target_give_its_greedy_output() {
    use tandem_model::engine::SpecEngine;
    let dir = tempfile::tempdir().unwrap();
    let (draft, target) = pair(dir.path(), 256);
    let prompt = [100u32, 7, 42, 42, 9];
    let cfg = GenerateConfig {
        max_tokens: 40,
        ..GenerateConfig::default()
    };
    let reference = generate_single(&target, &prompt, &cfg, &mut |_| true).unwrap();
    let mut verifier = prefilled_verifier(&target, &prompt, &cfg);
    let mut streamed = Vec::new();
    let mut on_token = |t| {
        streamed.push(t);
        true
    };
    let mut engine =
        SpecEngine::new(&draft, &prompt, &cfg, verifier.capacity(), &mut on_token).unwrap();
    let ks = [3, 1, 0, 5];
    let (mut rounds, mut none_rounds) = (0, 0);
    while engine.stop().is_none() {
        let k = ks[rounds % ks.len()];
        let r = engine.round(k, &mut verifier).unwrap().unwrap();
        assert!(r.accepted <= r.block.len() && r.block.len() <= k);
        if k == 0 {
            assert_eq!(r.source, tandem_model::proposer::Source::Nothing);
            assert!(r.draft_forwards.is_empty());
            none_rounds += 1;
        }
        rounds += 1;
    }
    let g = engine.finish();
    assert_eq!(g.tokens, reference.tokens);
    assert_eq!(streamed, g.tokens);
    assert_eq!(g.stop, StopReason::MaxTokens);
    assert_eq!(g.stats.rounds, rounds as u64);
    assert_eq!(g.stats.target_forwards, rounds as u64);
    assert_eq!(g.stats.proposers.none_rounds, none_rounds);
    assert!(none_rounds > 0);
    assert!(g.stats.drafted >= g.stats.accepted);
}

/// Pipelined drafting on the core's halves: a block continues the tokens
/// the last round kept ahead (`propose_continuing`), the draft drafts past
/// the block while the verify would be in flight (`draft_ahead`), and
/// `settle` keeps them only when the whole block is accepted and the
/// verifier's token is the draft's guess. Whatever is kept, the output is
/// the target's greedy output.
#[test]
fn pipelined_rounds_on_the_core_keep_a_right_guess_and_give_the_targets_output() {
    use tandem_model::engine::{
        self, BlockVerifier, DraftAsk, DraftModel, ProposeAsk, RoundOutput, RoundState,
    };
    use tandem_model::logprobs::TokenLogprobs;
    use tandem_model::proposer::{AutoChooser, NgramIndex};
    use tandem_model::speculative::GenStats;
    struct Out(Vec<u32>);
    impl RoundOutput for Out {
        fn context(&self) -> &[u32] {
            &self.0
        }
        fn emit_verified(&mut self, t: u32, _: Option<TokenLogprobs>) -> bool {
            self.0.push(t);
            true
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let (draft, target) = pair(dir.path(), 256);
    let prompt = [100u32, 7, 42, 42, 9];
    let cfg = GenerateConfig {
        max_tokens: 48,
        ..GenerateConfig::default()
    };
    let reference = generate_single(&target, &prompt, &cfg, &mut |_| true).unwrap();
    assert_eq!(reference.stop, StopReason::MaxTokens);
    let mut verifier = prefilled_verifier(&target, &prompt, &cfg);
    let mut dm = DraftModel::new(&draft, cfg.draft_kv);
    let (mut index, mut chooser, mut stats) = (
        NgramIndex::new(),
        AutoChooser::default(),
        GenStats::default(),
    );
    let mut out = Out(prompt.to_vec());
    let (mut ahead, mut kept, mut reused_rounds, mut round) = (Vec::new(), 0, 0, 0);
    while out.0.len() < prompt.len() + cfg.max_tokens {
        let mut st = RoundState {
            cfg: &cfg,
            draft: &mut dm,
            index: &mut index,
            chooser: &mut chooser,
            stats: &mut stats,
        };
        let k = [3, 2, 4][round % 3];
        let carried: Vec<u32> = ahead.clone();
        let ask = ProposeAsk {
            proposer: ProposerKind::Draft,
            k,
            room_out: 64,
            draft: DraftAsk::default(),
        };
        let mut p = engine::propose_continuing(&mut st, &out.0, ask, ahead).unwrap();
        let reused = carried.len().min(k);
        assert_eq!((p.block.len(), p.reused), (k, reused));
        assert_eq!(p.block[..reused], carried[..reused]);
        assert_eq!(p.ahead, carried[reused..]);
        if reused > 0 {
            reused_rounds += 1;
        }
        for _ in 0..[0, 1, 2, 5][round % 4] {
            engine::draft_ahead(&mut st, &out.0, &mut p).unwrap();
        }
        let v = verifier.verify(&out.0, &p.block).unwrap();
        let guess = p.ahead.first().copied();
        let full = v.accepted == p.block.len();
        let done = engine::settle(&mut st, p, v, Duration::ZERO, &mut out).unwrap();
        if full && guess == Some(done.next_token) {
            kept += 1;
            // The draft holds the context and the kept tokens but the last.
            assert_eq!(dm.cache.len() + 1, out.0.len() + done.ahead.len());
        } else {
            assert!(done.ahead.is_empty());
            assert!(dm.cache.len() < out.0.len());
        }
        ahead = done.ahead;
        round += 1;
    }
    assert_eq!(
        out.0[prompt.len()..][..cfg.max_tokens],
        reference.tokens[..]
    );
    assert!(
        kept > 0 && reused_rounds > 0,
        "{kept} kept, {reused_rounds} reused"
    );
    // Only the draft model continues a block.
    let mut st = RoundState {
        cfg: &cfg,
        draft: &mut dm,
        index: &mut index,
        chooser: &mut chooser,
        stats: &mut stats,
    };
    let ask = ProposeAsk {
        proposer: ProposerKind::Lookup,
        k: 3,
        room_out: 8,
        draft: DraftAsk::default(),
    };
    let e = engine::propose_continuing(&mut st, &out.0, ask, vec![1]).unwrap_err();
    assert!(e.to_string().contains("draft model"), "{e}");
}

/// A verifier that claims more accepted tokens than the block had is an
/// error, and nothing of its answer is emitted.
#[test]
fn the_core_refuses_a_verdict_past_the_block() {
    use tandem_model::engine::{BlockVerdict, BlockVerifier, SpecEngine, VerifyError};
    struct Liar;
    impl BlockVerifier for Liar {
        type Broken = std::convert::Infallible;
        type Refusal = std::convert::Infallible;
        fn verify(
            &mut self,
            _ctx: &[u32],
            block: &[u32],
        ) -> Result<BlockVerdict, VerifyError<Self::Broken, Self::Refusal>> {
            Ok(BlockVerdict {
                accepted: block.len() + 1,
                next_token: 1,
                logprobs: None,
            })
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let (draft, _) = pair(dir.path(), 64);
    let mut emitted = 0;
    let mut on_token = |_| {
        emitted += 1;
        true
    };
    let mut engine = SpecEngine::new(
        &draft,
        &[1, 2, 3],
        &GenerateConfig::default(),
        64,
        &mut on_token,
    )
    .unwrap();
    assert!(engine.round(4, &mut Liar).is_err());
    assert!(engine.output().is_empty());
    drop(engine);
    assert_eq!(emitted, 0);
}

/// A verifier whose exchange breaks every other block (no verdict: the
/// block is lost, `VerifyError::Broken`) and which refuses once: the
/// engine rolls the draft back to the context and emits nothing for those
/// blocks, and the rounds that follow still give the target's greedy
/// output, as a remote verifier's re-opened session would.
#[test]
fn the_core_survives_broken_exchanges_and_reports_refusals() {
    use tandem_model::engine::{BlockVerdict, BlockVerifier, SpecEngine, VerifyError};
    struct Flaky<'m> {
        target: TargetVerifier<'m>,
        calls: usize,
    }
    impl BlockVerifier for Flaky<'_> {
        type Broken = String;
        type Refusal = String;
        fn verify(
            &mut self,
            ctx: &[u32],
            block: &[u32],
        ) -> Result<BlockVerdict, VerifyError<String, String>> {
            self.calls += 1;
            match self.calls {
                3 => Err(VerifyError::Refused("no".into())),
                c if c % 2 == 0 => Err(VerifyError::Broken("stream reset".into())),
                _ => self
                    .target
                    .verify(ctx, block)
                    .map_err(|e| VerifyError::Model(e.into())),
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let (draft, target) = pair(dir.path(), 256);
    let prompt = [100u32, 7, 42, 42, 9];
    let cfg = GenerateConfig {
        max_tokens: 30,
        ..GenerateConfig::default()
    };
    let reference = generate_single(&target, &prompt, &cfg, &mut |_| true).unwrap();
    let mut verifier = Flaky {
        target: prefilled_verifier(&target, &prompt, &cfg),
        calls: 0,
    };
    let mut on_token = |_| true;
    let mut engine = SpecEngine::new(
        &draft,
        &prompt,
        &cfg,
        verifier.target.capacity(),
        &mut on_token,
    )
    .unwrap();
    let (mut broken, mut refused) = (0, 0);
    while engine.stop().is_none() {
        let before = engine.output().len();
        match engine.round(4, &mut verifier) {
            Ok(_) => {}
            Err(VerifyError::Broken(_)) => {
                broken += 1;
                assert_eq!(engine.output().len(), before);
            }
            Err(VerifyError::Refused(r)) => {
                refused += 1;
                assert_eq!(r, "no");
                assert_eq!(engine.output().len(), before);
            }
            Err(VerifyError::Model(e)) => panic!("{e}"),
        }
    }
    assert!(broken > 0);
    assert_eq!(refused, 1);
    assert_eq!(engine.finish().tokens, reference.tokens);
}

/// `testing::target_greedy_mismatch` (the teacher-forced check the real-pair
/// tests use instead of a target-only decode) accepts the target's own greedy
/// output, ended by `max_tokens` or by a stop token, and refuses a wrong
/// token, a stop token emitted, and an output ended too early or for the
/// wrong reason.
#[test]
fn the_teacher_forced_check_accepts_the_targets_output_and_nothing_else() {
    use tandem_model::testing::target_greedy_mismatch;
    let dir = tempfile::tempdir().unwrap();
    let (_, target) = pair(dir.path(), 256);
    let prompt = [
        100u32, 7, 42, 42, 9, 3, 5, 8, 13, 21, 34, 55, 89, 1, 2, 3, 4,
    ];
    let cfg = GenerateConfig {
        max_tokens: 40,
        ..GenerateConfig::default()
    };
    let r = generate_single(&target, &prompt, &cfg, &mut |_| true).unwrap();
    assert_eq!((r.tokens.len(), r.stop), (40, StopReason::MaxTokens));
    let check = |tokens: &[u32], stop, stops: &[u32]| {
        target_greedy_mismatch(&target, &prompt, tokens, stop, 40, stops).unwrap()
    };
    assert_eq!(check(&r.tokens, StopReason::MaxTokens, &[]), None);
    for i in [0, 17, 39] {
        let mut wrong = r.tokens.clone();
        wrong[i] = (wrong[i] + 1) % 384; // TinyConfig::default().vocab
        assert!(
            check(&wrong, StopReason::MaxTokens, &[]).is_some(),
            "token {i}"
        );
    }
    assert!(check(&r.tokens[..39], StopReason::MaxTokens, &[]).is_some());
    assert!(check(&r.tokens, StopReason::Stop, &[]).is_some());
    // With the target's 11th choice as a stop token: its first 10 tokens,
    // ended by Stop, are its output; emitting the stop token is not.
    let stop_at = r.tokens[10];
    let n = r.tokens.iter().position(|&t| t == stop_at).unwrap();
    let stops = [stop_at];
    let (out, next) = (&r.tokens[..n], &r.tokens[..=n]);
    assert_eq!(check(out, StopReason::Stop, &stops), None);
    assert!(check(next, StopReason::Stop, &stops).is_some());
    assert!(check(out, StopReason::MaxTokens, &stops).is_some());
}
