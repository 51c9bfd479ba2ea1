//! Structured output on the verifier (`Open.grammar`, docs/grammar.md): every
//! verdict is the target's choice among the tokens the grammar allows, so a
//! device's output equals the target's own masked greedy output whatever it
//! drafts; the output already in a re-opened context is replayed; a bad grammar
//! is refused with BAD_REQUEST before any work, and leaves no session behind.
//! Tiny random models with a tokenizer, over a real gRPC connection.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use common::*;
use tandem_grammar::{Constraint, GrammarSpec, GrammarVocab};
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::tokenizer::Tokenizer;
use tandem_model::transformer::Model;
use tandem_proto::v1::{Grammar, Reason, Split};
use tandem_verifier::model_fingerprint;

const SCHEMA: &str =
    r#"{"type": "object", "properties": {"ab": {"type": "string"}}, "required": ["ab"]}"#;
const N: usize = 16;

fn models_with_tokenizer() -> Models {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("target.gguf");
    let draft = dir.path().join("draft.gguf");
    write_tiny_qwen2(
        &target,
        &TinyConfig {
            tokenizer: true,
            ..TinyConfig::default()
        },
    )
    .unwrap();
    write_tiny_qwen2(
        &draft,
        &TinyConfig {
            tokenizer: true,
            ..TinyConfig::draft_like()
        },
    )
    .unwrap();
    Models { dir, target, draft }
}

fn argmax(v: &[f32]) -> u32 {
    let mut b = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[b] {
            b = i;
        }
    }
    b as u32
}

/// The target alone, greedy under `spec`: up to `n` tokens (a stop ends it,
/// and is included).
fn masked_greedy(model: &Model, spec: &GrammarSpec, prompt: &[u32], n: usize) -> Vec<u32> {
    let tok = Tokenizer::from_gguf(model.gguf()).unwrap();
    let vocab = GrammarVocab::new(&tok).unwrap();
    let mut c = Constraint::new(&vocab, spec).unwrap();
    let mut cache = model.new_cache();
    let mut logits = model.forward_last(prompt, 0, &mut cache).unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        c.mask().unwrap().apply(&mut logits);
        let t = argmax(&logits);
        c.accept(t).unwrap();
        out.push(t);
        if tok.chat_stop_tokens().contains(&t) {
            break;
        }
        logits = model.forward(&[t], cache.len(), &mut cache).unwrap();
    }
    out
}

fn grammar(kind: &str, text: &str, output_start: usize) -> Grammar {
    Grammar {
        kind: kind.into(),
        text: text.into(),
        output_start: output_start as u64,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verdicts_under_a_grammar_are_the_targets_masked_greedy_choice() {
    let m = models_with_tokenizer();
    let v = start_plain(&m, "").await;
    let target = load(&m.target);
    let draft = load(&m.draft);
    let fp = model_fingerprint(&target);
    let p = prompt(9);
    let spec = GrammarSpec::from_wire("json_schema", SCHEMA).unwrap();
    let want = masked_greedy(&target, &spec, &p, N);
    assert_ne!(
        want,
        target_greedy(&target, &p, want.len()),
        "the grammar changes the output"
    );
    let mut c = client(&v).await;

    // Three devices: drafting the answer itself (all accepted), drafting
    // with the unconstrained draft model (rejections), drafting nothing.
    for drafter in ["perfect", "draft model", "none"] {
        let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
        let mut o = open_msg(&fp, &p);
        o.grammar = Some(grammar("json_schema", SCHEMA, p.len()));
        let opened = s.open(o).await.unwrap();
        assert!(opened
            .features
            .iter()
            .any(|f| f == tandem_proto::FEATURE_GRAMMAR));
        let mut ctx = p.clone();
        let mut got: Vec<u32> = Vec::new();
        let mut round = 0;
        while got.len() < want.len() {
            let k = 1 + (round as usize % 4);
            let block = match drafter {
                "perfect" => want[got.len()..].iter().take(k).copied().collect(),
                "draft model" => draft_greedy(&draft, &ctx, k),
                _ => Vec::new(),
            };
            let verdict = s.draft(round, &block).await.unwrap();
            let n = verdict.accepted as usize;
            got.extend_from_slice(&block[..n]);
            got.push(verdict.next_token);
            ctx.extend_from_slice(&block[..n]);
            ctx.push(verdict.next_token);
            round += 1;
        }
        got.truncate(want.len());
        assert_eq!(got, want, "{drafter}");
    }

    // A re-opened generation (after an outage): its output so far is replayed
    // through the grammar, and the next verdicts continue the same output.
    let half = want.len() / 2;
    let mut ctx = p.clone();
    ctx.extend_from_slice(&want[..half]);
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let mut o = open_msg(&fp, &ctx);
    o.grammar = Some(grammar("json_schema", SCHEMA, p.len()));
    s.open(o).await.unwrap();
    let verdict = s.draft(0, &[]).await.unwrap();
    assert_eq!(verdict.next_token, want[half]);

    // A Resume moves the session to another context (what a device does
    // after a provisional token the target disagreed with): the grammar
    // follows it. Back two tokens, the next verdict is the target's there.
    let back = half - 1;
    let mut ctx = p.clone();
    ctx.extend_from_slice(&want[..back]);
    let resume = |ctx: &[u32], round: u64| {
        tandem_proto::v1::client_message::Msg::Resume(tandem_proto::v1::Resume {
            context_tokens: ctx.to_vec(),
            next_round: round,
        })
    };
    match s.call(resume(&ctx, 1)).await.unwrap() {
        tandem_proto::v1::server_message::Msg::Resumed(r) => {
            assert_eq!(r.context_len, ctx.len() as u64)
        }
        m => panic!("expected Resumed, got {m:?}"),
    }
    let verdict = s.draft(1, &[]).await.unwrap();
    assert_eq!(
        verdict.next_token, want[back],
        "the grammar followed the Resume"
    );
    // A context whose output the grammar refuses is refused, before any work.
    let tok = Tokenizer::from_gguf(target.gguf()).unwrap();
    let mut bad = p.clone();
    bad.extend(tok.encode("x", false).unwrap());
    let e = s.call(resume(&bad, 2)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::BadRequest, "{e:?}");
    assert!(e.message().contains("grammar"), "{e:?}");
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_grammar_is_refused_before_any_work_and_leaves_nothing() {
    let m = models_with_tokenizer();
    let v = start_plain(&m, "").await;
    let target = load(&m.target);
    let fp = model_fingerprint(&target);
    let p = prompt(9);
    let mut c = client(&v).await;
    // An output that breaks the grammar: "x" cannot start a JSON object.
    let tok = Tokenizer::from_gguf(target.gguf()).unwrap();
    let mut broken = p.clone();
    broken.extend(tok.encode("x", false).unwrap());
    let cases: Vec<(Grammar, Vec<u32>, Option<Split>, &str)> = vec![
        (
            grammar("regex", "a(", p.len()),
            p.clone(),
            None,
            "invalid grammar",
        ),
        (
            grammar("gbnf", "root ::= \"a\"", p.len()),
            p.clone(),
            None,
            "unknown grammar kind",
        ),
        (
            grammar("json_schema", "{", p.len()),
            p.clone(),
            None,
            "not JSON",
        ),
        (
            grammar("regex", &"a".repeat(70_000), p.len()),
            p.clone(),
            None,
            "larger than",
        ),
        (
            grammar("json_object", "", p.len() + 1),
            p.clone(),
            None,
            "output_start",
        ),
        (
            grammar("json_object", "", p.len()),
            broken,
            None,
            "output token 0",
        ),
        (
            grammar("json_object", "", p.len()),
            p.clone(),
            // (Split sessions with the head here are masked like any
            // other: edge-runtime/tests/grammar.rs.)
            Some(Split {
                pin_head: true,
                ..Split::default()
            }),
            "U-shape",
        ),
    ];
    for (g, ctx, split, want) in cases {
        let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
        let mut o = open_msg(&fp, &ctx);
        o.grammar = Some(g.clone());
        o.split = split;
        let e = s.open(o).await.unwrap_err();
        assert_eq!(
            reason(&e),
            Reason::BadRequest,
            "{} {:?}: {e:?}",
            g.kind,
            want
        );
        assert!(
            e.message().contains("grammar") && e.message().contains(want),
            "{}: {:?} lacks {want:?}",
            g.kind,
            e.message()
        );
    }
    assert_eq!(v.state.store().len(), 0, "a refused Open kept a session");
    // The verifier still serves, grammar or not.
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let mut o = open_msg(&fp, &p);
    o.grammar = Some(grammar("json_object", "", p.len()));
    s.open(o).await.unwrap();
    s.draft(0, &[]).await.unwrap();
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_without_a_tokenizer_refuses_grammars_clearly() {
    let m = tiny_models(); // no tokenizer metadata
    let v = start_plain(&m, "").await;
    let target = load(&m.target);
    let fp = model_fingerprint(&target);
    let p = prompt(9);
    let mut c = client(&v).await;
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let mut o = open_msg(&fp, &p);
    o.grammar = Some(grammar("json_object", "", p.len()));
    let e = s.open(o).await.unwrap_err();
    assert_eq!(reason(&e), Reason::BadRequest, "{e:?}");
    assert!(e.message().contains("no usable tokenizer"), "{e:?}");
    v.shutdown().await.unwrap();
}
