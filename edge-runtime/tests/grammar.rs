//! Structured output across the network (docs/grammar.md): under a grammar
//! (`GenerateConfig::grammar`) the output equals the target's own output under
//! the same grammar (greedy, and keyed draws in sampled mode) for every k and
//! proposer, locally (`generate_speculative`) and through a real in-process
//! verifier (batching on) with every kind of round; sessions with and without
//! grammars share the verifier's forwards; provisional tokens from an outage
//! are the draft's own masked choices and are checked like any others; with no
//! verifier the draft's own constraint masks every token. Tiny random models
//! with a tokenizer.

#![allow(clippy::unwrap_used)]

mod common;
use common::{
    io_runtime, load, outage_edge_config, start_switchable_proxy, start_tiny_verifier, tiny_edge,
    FP,
};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tandem_edge::adaptive::SpeculationConfig;
use tandem_edge::config::GateConfig;
use tandem_edge::{EdgeConfig, EdgeEvent, EdgeRuntime, TokenStatus};
use tandem_grammar::{Grammar, GrammarSpec, GrammarVocab, Guide, Trigger};
use tandem_model::engine::{choose, OutputGrammar};
use tandem_model::kv_cache::KvPrecision;
use tandem_model::proposer::ProposerKind;
use tandem_model::sampling::SamplingParams;
use tandem_model::speculative::{
    generate_single, generate_single_with, generate_speculative, GenerateConfig,
};
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::tokenizer::Tokenizer;
use tandem_model::transformer::Model;

const TOKEN: &str = "grammar-edge-test-token-0123456789";
const MAX: usize = 40;
const SCHEMA: &str = r#"{"type": "object", "properties": {"ab": {"type": "string"}, "n": {"type": "integer"}}, "required": ["ab", "n"]}"#;
/// Never complete within `MAX` tokens (at most 2 characters a token), so
/// stops are never allowed: long outputs of a few letters, where lookup finds
/// matches.
const LETTERS: &str = "[a-e ]{400,}";

struct Pair {
    _dir: tempfile::TempDir,
    target_p: PathBuf,
    draft_p: PathBuf,
    target: Arc<Model>,
    draft: Arc<Model>,
    tok: Tokenizer,
    vocab: GrammarVocab,
}

fn pair() -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let target_p = dir.path().join("target.gguf");
    let draft_p = dir.path().join("draft.gguf");
    let with_tok = |c: TinyConfig| TinyConfig {
        tokenizer: true,
        ..c
    };
    write_tiny_qwen2(&target_p, &with_tok(TinyConfig::default())).unwrap();
    write_tiny_qwen2(&draft_p, &with_tok(TinyConfig::draft_like())).unwrap();
    let (target, draft) = (load(&target_p), load(&draft_p));
    let tok = Tokenizer::from_gguf(target.gguf()).unwrap();
    let vocab = GrammarVocab::new(&tok).unwrap();
    Pair {
        _dir: dir,
        target_p,
        draft_p,
        target,
        draft,
        tok,
        vocab,
    }
}

impl Pair {
    fn grammar(&self, spec: GrammarSpec) -> Arc<dyn OutputGrammar> {
        Grammar::new(&self.vocab, spec).unwrap().into_config()
    }

    /// A prompt of repeated letters (lookup matches from the first round).
    fn prompt(&self) -> Vec<u32> {
        self.tok.encode("ab cd ea ab cd ea ab cd", false).unwrap()
    }

    fn cfg(
        &self,
        k: usize,
        proposer: ProposerKind,
        grammar: Option<Arc<dyn OutputGrammar>>,
        sampling: SamplingParams,
    ) -> GenerateConfig {
        GenerateConfig {
            k,
            max_tokens: MAX,
            sampling,
            stop_tokens: self.tok.chat_stop_tokens(),
            proposer,
            grammar,
            ..GenerateConfig::default()
        }
    }

    /// The target alone under the config's grammar: the reference.
    fn target_own(&self, prompt: &[u32], cfg: &GenerateConfig) -> Vec<u32> {
        generate_single(&self.target, prompt, cfg, &mut |_| true)
            .unwrap()
            .tokens
    }
}

/// `out` is an output the grammar allows (a fresh constraint follows it).
fn obeys(g: &dyn OutputGrammar, prompt: &[u32], out: &[u32]) {
    let mut c = g.constraint(prompt.len()).unwrap();
    let n = c.allowed_prefix(prompt, out).unwrap();
    assert_eq!(n, out.len(), "output token {n} is refused: {out:?}");
}

fn specs() -> Vec<GrammarSpec> {
    vec![
        GrammarSpec::JsonSchema(serde_json::from_str(SCHEMA).unwrap()),
        GrammarSpec::Regex(LETTERS.into()),
    ]
}

#[test]
fn greedy_under_a_grammar_is_the_targets_masked_greedy_for_every_k_proposer_and_round_kind() {
    let p = pair();
    let t0 = Instant::now();
    let prompt = p.prompt();
    let rt = io_runtime();
    let v = start_tiny_verifier(&rt, &p.target_p, TOKEN);
    let url = format!("http://{}", v.grpc_addr);
    let mut edge = tiny_edge(&p.draft_p, &url, TOKEN, |_| {});
    let greedy = SamplingParams::default();
    for spec in specs() {
        let g = p.grammar(spec.clone());
        let want = p.target_own(
            &prompt,
            &p.cfg(1, ProposerKind::Draft, Some(g.clone()), greedy),
        );
        let free = p.target_own(&prompt, &p.cfg(1, ProposerKind::Draft, None, greedy));
        assert_ne!(want, free, "{spec:?}: the grammar changes the output");
        assert!(!want.is_empty());
        obeys(&*g, &prompt, &want);
        for proposer in ProposerKind::ALL {
            for k in [1, 2, 4, 7] {
                let cfg = p.cfg(k, proposer, Some(g.clone()), greedy);
                let local = generate_speculative(&p.draft, &p.target, &prompt, &cfg, &mut |_| true)
                    .unwrap();
                assert_eq!(local.tokens, want, "local {proposer} k={k} {spec:?}");
                let e = edge.generate(&prompt, &cfg, &mut |_| true).unwrap();
                assert_eq!(e.tokens, want, "edge {proposer} k={k} {spec:?}");
                assert!(e.statuses.iter().all(|s| *s == TokenStatus::Verified));
                if proposer == ProposerKind::Lookup && spec == GrammarSpec::Regex(LETTERS.into()) {
                    assert!(
                        e.stats.proposers.lookup.rounds > 0,
                        "{:?}",
                        e.stats.proposers
                    );
                }
            }
        }
        // The other kinds of round: pipelined drafting with adaptive k, and
        // target streaming.
        for spec_cfg in [
            SpeculationConfig {
                adaptive_k: true,
                pipeline: true,
                ..SpeculationConfig::default()
            },
            SpeculationConfig {
                target_stream: true,
                ..SpeculationConfig::default()
            },
        ] {
            let mut e2 = tiny_edge(&p.draft_p, &url, TOKEN, |c| {
                c.speculation = spec_cfg.clone()
            });
            let cfg = p.cfg(4, ProposerKind::Draft, Some(g.clone()), greedy);
            let e = e2.generate(&prompt, &cfg, &mut |_| true).unwrap();
            assert_eq!(e.tokens, want, "{spec_cfg:?} {spec:?}");
        }
        // Gated rounds with a perfect draft (the target itself, f32 KV):
        // gated tokens are shown provisional, then confirmed.
        let mut gated = tiny_edge(&p.target_p, &url, TOKEN, |c| {
            c.gate = GateConfig {
                confidence: 0.01,
                max_span: 8,
            }
        });
        let cfg = GenerateConfig {
            draft_kv: KvPrecision::F32,
            ..p.cfg(3, ProposerKind::Draft, Some(g.clone()), greedy)
        };
        let e = gated.generate(&prompt, &cfg, &mut |_| true).unwrap();
        assert_eq!(e.tokens, want, "gated {spec:?}");
        assert!(e.stats.gated_rounds > 0);
        assert_eq!(e.provisional.mismatched_tokens, 0);
    }
    rt.block_on(v.shutdown()).unwrap();
    eprintln!(
        "greedy identity under grammars: {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn sampled_under_a_grammar_is_the_targets_own_keyed_draws() {
    let p = pair();
    let prompt = p.prompt();
    let rt = io_runtime();
    let v = start_tiny_verifier(&rt, &p.target_p, TOKEN);
    let url = format!("http://{}", v.grpc_addr);
    let mut edge = tiny_edge(&p.draft_p, &url, TOKEN, |_| {});
    let sampled = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 7,
        ..SamplingParams::default()
    };
    for spec in specs() {
        let g = p.grammar(spec.clone());
        let want = p.target_own(
            &prompt,
            &p.cfg(1, ProposerKind::Draft, Some(g.clone()), sampled),
        );
        obeys(&*g, &prompt, &want);
        for proposer in ProposerKind::ALL {
            let cfg = p.cfg(4, proposer, Some(g.clone()), sampled);
            let local =
                generate_speculative(&p.draft, &p.target, &prompt, &cfg, &mut |_| true).unwrap();
            assert_eq!(local.tokens, want, "local {proposer} {spec:?}");
            let e = edge.generate(&prompt, &cfg, &mut |_| true).unwrap();
            assert_eq!(e.tokens, want, "edge {proposer} {spec:?}");
        }
    }
    rt.block_on(v.shutdown()).unwrap();
}

#[test]
fn constrained_and_free_sessions_batched_together_each_get_their_own_output() {
    let p = Arc::new(pair());
    let prompt = p.prompt();
    let rt = io_runtime();
    let v = start_tiny_verifier(&rt, &p.target_p, TOKEN);
    let url = format!("http://{}", v.grpc_addr);
    let greedy = SamplingParams::default();
    let grammars: Vec<Option<Arc<dyn OutputGrammar>>> = specs()
        .into_iter()
        .map(|s| Some(p.grammar(s)))
        .chain([None])
        .collect();
    let threads: Vec<_> = grammars
        .into_iter()
        .enumerate()
        .map(|(i, g)| {
            let (p, url, prompt) = (p.clone(), url.clone(), prompt.clone());
            std::thread::spawn(move || {
                let cfg = p.cfg(2 + i, ProposerKind::Draft, g, greedy);
                let want = p.target_own(&prompt, &cfg);
                let mut edge = tiny_edge(&p.draft_p, &url, TOKEN, |_| {});
                for _ in 0..3 {
                    let e = edge.generate(&prompt, &cfg, &mut |_| true).unwrap();
                    assert_eq!(e.tokens, want, "session {i}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    rt.block_on(v.shutdown()).unwrap();
}

/// `model`'s choice under `g` for every output position of `prompt + out`.
fn masked_predictions(
    model: &Model,
    g: &dyn OutputGrammar,
    prompt: &[u32],
    out: &[u32],
) -> Vec<u32> {
    let mut all = prompt.to_vec();
    all.extend_from_slice(out);
    let mut cache = model.new_cache();
    let logits = model.forward(&all, 0, &mut cache).unwrap();
    let v = model.config().vocab;
    let mut c = g.constraint(prompt.len()).unwrap();
    (0..out.len())
        .map(|i| {
            let row = prompt.len() - 1 + i;
            let mut l = logits[row * v..(row + 1) * v].to_vec();
            choose(
                &SamplingParams::default(),
                &mut l,
                &all[..=row],
                Some(&mut *c),
            )
            .unwrap()
        })
        .collect()
}

/// One generation through a link that goes silent at output token 6 for a
/// second: (tokens, statuses, provisional report).
fn through_outage(
    draft: &Path,
    target: &Path,
    cfg: &GenerateConfig,
    prompt: &[u32],
) -> tandem_edge::EdgeGeneration {
    let vrt = io_runtime();
    let v = start_tiny_verifier(&vrt, target, TOKEN);
    let (addr, silent) = start_switchable_proxy(&vrt, v.grpc_addr, Duration::from_millis(2));
    let ecfg = outage_edge_config(addr, TOKEN);
    let mut edge = EdgeRuntime::builder(load(draft), ecfg).build().unwrap();
    let mut restorer = None;
    let g = edge
        .generate(prompt, cfg, &mut |e| {
            if let EdgeEvent::Token { index, status, .. } = e {
                if *index == 6 && restorer.is_none() {
                    silent.store(true, Ordering::SeqCst);
                    let s: Arc<AtomicBool> = silent.clone();
                    restorer = Some(std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_millis(1000));
                        s.store(false, Ordering::SeqCst);
                    }));
                }
                if *status == TokenStatus::Provisional {
                    std::thread::sleep(Duration::from_millis(8));
                }
            }
            true
        })
        .unwrap();
    restorer.unwrap().join().unwrap();
    vrt.block_on(v.shutdown()).unwrap();
    g
}

#[test]
fn provisional_tokens_obey_the_grammar_and_are_checked_after_an_outage() {
    let p = pair();
    let prompt = p.prompt();
    let g = p.grammar(GrammarSpec::Regex(LETTERS.into()));
    let max = 160;
    let cfg = GenerateConfig {
        max_tokens: max,
        // f32 draft KV: provisional tokens are exactly the draft's masked
        // predictions.
        draft_kv: KvPrecision::F32,
        ..p.cfg(
            4,
            ProposerKind::Draft,
            Some(g.clone()),
            SamplingParams::default(),
        )
    };
    let want = p.target_own(&prompt, &cfg);
    // A random draft: provisional tokens are its own masked choices, the
    // verified ones the target's masked choice after what was shown.
    let e = through_outage(&p.draft_p, &p.target_p, &cfg, &prompt);
    assert_eq!(e.tokens.len(), max);
    obeys(&*g, &prompt, &e.tokens);
    let first = e
        .statuses
        .iter()
        .position(|s| *s == TokenStatus::Provisional)
        .expect("provisional tokens");
    let last = e
        .statuses
        .iter()
        .rposition(|s| *s == TokenStatus::Provisional)
        .unwrap();
    assert!(last + 1 < max, "verified again after the outage");
    let t_pred = masked_predictions(&p.target, &*g, &prompt, &e.tokens);
    let d_pred = masked_predictions(&p.draft, &*g, &prompt, &e.tokens);
    let mut mismatches = Vec::new();
    for i in 0..max {
        if (first..=last).contains(&i) {
            assert_eq!(e.tokens[i], d_pred[i], "provisional token {i}");
            if t_pred[i] != e.tokens[i] {
                mismatches.push(i);
            }
        } else {
            assert_eq!(e.tokens[i], t_pred[i], "verified token {i}");
        }
    }
    assert_eq!(e.tokens[..first], want[..first]);
    let r = &e.provisional;
    assert_eq!(r.checked_tokens, r.provisional_tokens, "all checked: {r:?}");
    let reported: Vec<usize> = r.spans.iter().flat_map(|s| s.mismatches.clone()).collect();
    assert_eq!(reported, mismatches);
    // A perfect draft (the target, f32 KV): the whole output, provisional
    // tokens included, is the target's own under the grammar.
    let e = through_outage(&p.target_p, &p.target_p, &cfg, &prompt);
    assert!(e.statuses.contains(&TokenStatus::Provisional));
    assert_eq!(e.tokens, want);
    assert_eq!(e.provisional.mismatched_tokens, 0);
}

#[test]
fn without_a_verifier_the_drafts_own_constraint_masks_every_token() {
    let p = pair();
    let prompt = p.prompt();
    let mut edge = EdgeRuntime::builder(p.draft.clone(), EdgeConfig::default())
        .build()
        .unwrap();
    for spec in specs() {
        let g = p.grammar(spec.clone());
        let cfg = p.cfg(
            4,
            ProposerKind::Draft,
            Some(g.clone()),
            SamplingParams::default(),
        );
        let want = generate_single_with(&p.draft, cfg.draft_kv, &prompt, &cfg, &mut |_| true)
            .unwrap()
            .tokens;
        obeys(&*g, &prompt, &want);
        let e = edge.generate(&prompt, &cfg, &mut |_| true).unwrap();
        assert_eq!(e.tokens, want, "{spec:?}");
        assert!(e.statuses.iter().all(|s| *s == TokenStatus::Local));
    }
    // The guide follows any context (what the verifier's sessions rely on
    // after a Resume): refused tokens leave it as it was.
    let mut guide = Guide::new(&p.vocab, &GrammarSpec::Regex("[a-c]+".into()), 1).unwrap();
    let a = p.tok.encode("abcab", false).unwrap();
    let mut ctx = vec![0u32];
    ctx.extend_from_slice(&a);
    guide.sync(&ctx).unwrap();
    let x = p.tok.encode("x", false).unwrap();
    let mut bad = ctx[..2].to_vec();
    bad.extend_from_slice(&x);
    assert!(guide.sync(&bad).is_err());
    assert_eq!(guide.held(), &a[..]);
    guide.sync(&ctx[..2]).unwrap();
    assert_eq!(guide.held(), &a[..1]);
    // Stops (a lookup proposal ending the answer) are tested and taken back
    // like any token: allowed once the grammar accepts, then only stops.
    guide.sync(&ctx).unwrap();
    let stop = p.tok.chat_stop_tokens()[0];
    let n = tandem_model::engine::OutputConstraint::allowed_prefix(
        &mut guide,
        &ctx,
        &[stop, stop, a[0]],
    )
    .unwrap();
    assert_eq!(n, 2);
    assert_eq!(guide.held(), &a[..]);
    let mut more = ctx.clone();
    more.push(a[0]);
    guide.sync(&more).unwrap();
    let mut ended = ctx.clone();
    ended.push(stop);
    guide.sync(&ended).unwrap();
    guide.sync(&more).unwrap();
    assert_eq!(guide.held().len(), a.len() + 1);
}

/// A lazy grammar whose trigger word the target's free output writes (the
/// text of two of its whole tokens), then a run of letters.
fn lazy_spec(p: &Pair, free: &[u32]) -> GrammarSpec {
    let word = (3..free.len() - 1)
        .find_map(|i| {
            let bytes: Vec<u8> = free[i..i + 2]
                .iter()
                .flat_map(|&t| p.tok.id_to_piece(t).unwrap().to_vec())
                .collect();
            String::from_utf8(bytes).ok().filter(|w| {
                w.bytes().any(|b| b != b' ')
                    && w.bytes().all(|b| b.is_ascii_alphanumeric() || b == b' ')
            })
        })
        .expect("two printable tokens in the free output");
    GrammarSpec::Lazy {
        triggers: vec![Trigger {
            word: word.clone(),
            at_start: false,
        }],
        lark: format!(
            "start: {} /[a-e ]{{400,}}/\n",
            serde_json::Value::String(word)
        ),
    }
}

/// An edge whose device runs the target's first layer (`pin_head`: and
/// its head: U-shape) against the verifier at `url`.
fn split_edge(p: &Pair, url: &str, pin_head: bool) -> EdgeRuntime {
    use tandem_edge::device_layers::{SplitConfig, SplitLayer};
    let cfg = EdgeConfig {
        verifier_url: Some(url.into()),
        token: Some(TOKEN.into()),
        tokenizer_fingerprint: Some(FP.into()),
        connect_timeout_ms: 2000,
        split: Some(SplitConfig {
            layer: SplitLayer::Fixed(1),
            pin_head,
            ..SplitConfig::default()
        }),
        ..EdgeConfig::default()
    };
    EdgeRuntime::builder(p.draft.clone(), cfg)
        .split_target(p.target.clone())
        .build()
        .unwrap()
}

#[test]
fn a_lazy_grammar_and_split_execution_keep_the_targets_own_output() {
    let p = pair();
    let t0 = Instant::now();
    let prompt = p.prompt();
    let greedy = SamplingParams::default();
    let free = p.target_own(&prompt, &p.cfg(1, ProposerKind::Draft, None, greedy));
    let lazy = lazy_spec(&p, &free);
    let g = p.grammar(lazy.clone());
    let want = p.target_own(
        &prompt,
        &p.cfg(1, ProposerKind::Draft, Some(g.clone()), greedy),
    );
    assert_ne!(want, free, "the trigger activates the grammar");
    let same = want.iter().zip(&free).take_while(|(a, b)| a == b).count();
    assert!(same >= 2, "free until the trigger word: {same}");
    obeys(&*g, &prompt, &want);
    let rt = io_runtime();
    let v = start_tiny_verifier(&rt, &p.target_p, TOKEN);
    let url = format!("http://{}", v.grpc_addr);
    let mut edge = tiny_edge(&p.draft_p, &url, TOKEN, |_| {});
    for proposer in ProposerKind::ALL {
        for k in [1, 3, 4] {
            let cfg = p.cfg(k, proposer, Some(g.clone()), greedy);
            let local =
                generate_speculative(&p.draft, &p.target, &prompt, &cfg, &mut |_| true).unwrap();
            assert_eq!(local.tokens, want, "local {proposer} k={k}");
            let e = edge.generate(&prompt, &cfg, &mut |_| true).unwrap();
            assert_eq!(e.tokens, want, "edge {proposer} k={k}");
            assert!(e.statuses.iter().all(|s| *s == TokenStatus::Verified));
        }
    }
    // Split execution, with the head on the verifier (which masks its
    // verdicts) and U-shape (the device masks its own), under every kind
    // of grammar.
    let mut all = specs();
    all.push(lazy);
    for spec in all {
        let g = p.grammar(spec.clone());
        let cfg1 = p.cfg(1, ProposerKind::Draft, Some(g.clone()), greedy);
        let want = p.target_own(&prompt, &cfg1);
        for pin_head in [false, true] {
            let mut e = split_edge(&p, &url, pin_head);
            for k in [1, 4] {
                let cfg = p.cfg(k, ProposerKind::Draft, Some(g.clone()), greedy);
                let out = e.generate(&prompt, &cfg, &mut |_| true).unwrap();
                assert_eq!(out.tokens, want, "split pin_head={pin_head} k={k} {spec:?}");
                assert!(out.statuses.iter().all(|s| *s == TokenStatus::Verified));
                assert_eq!(out.stats.split.as_ref().map(|s| s.layer), Some(1));
            }
        }
    }
    rt.block_on(v.shutdown()).unwrap();
    eprintln!(
        "lazy grammar and split identity: {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}
