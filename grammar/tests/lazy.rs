//! Lazy grammars (contract 8 of `tandem_grammar`): free output until a
//! trigger word, then the grammar from that word on. Over the tiny test
//! tokenizer (byte-level BPE, letter-pair merges): activation by a word
//! spelled over several tokens, at the start or anywhere, not by a token that
//! carries text the grammar refuses; rollback to before the trigger frees the
//! output again; the verifier's verdict (`Guide::verdict`) and the engine's
//! (`engine::masked_verdict` through `OutputConstraint`) agree across the
//! activation; the wire form round-trips and malformed ones are refused.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use tandem_grammar::{GrammarError, GrammarSpec, GrammarVocab, Guide, Trigger};
use tandem_model::engine::OutputConstraint;
use tandem_model::gguf::GgufFile;
use tandem_model::sampling::SamplingParams;
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::tokenizer::Tokenizer;

fn tokenizer() -> Tokenizer {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny.gguf");
    let cfg = TinyConfig {
        tokenizer: true,
        ..TinyConfig::default()
    };
    write_tiny_qwen2(&p, &cfg).unwrap();
    Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap()
}

fn lazy(word: &str, at_start: bool, lark: &str) -> GrammarSpec {
    GrammarSpec::Lazy {
        triggers: vec![Trigger {
            word: word.into(),
            at_start,
        }],
        lark: lark.into(),
    }
}

fn id(tok: &Tokenizer, s: &str) -> u32 {
    let ids = tok.encode(s, false).unwrap();
    assert_eq!(ids.len(), 1, "{s:?} is {ids:?}");
    ids[0]
}

#[test]
fn free_until_the_trigger_word_then_the_grammar_and_free_again_after_a_rollback() {
    let tok = tokenizer();
    let vocab = GrammarVocab::new(&tok).unwrap();
    let spec = lazy("<go>", false, "start: \"<go>\" /[0-9]{1,3}/ \"!\"\n");
    let enc = |s: &str| tok.encode(s, false).unwrap();
    let prompt = enc("ab cd");
    let out = |s: &str| [prompt.clone(), enc(s)].concat();
    let mut g = Guide::new(&vocab, &spec, prompt.len()).unwrap();
    // Free text, and a word not yet complete: nothing masked.
    let partial = out(" ef <go");
    assert!(enc(" ef <go>").len() >= 3, "the word spans tokens");
    assert!(g.mask_after(&partial).unwrap().is_none());
    assert!(!g.is_active());
    // The token that completes the word activates the grammar.
    let on = out(" ef <go>");
    let m = g.mask_after(&on).unwrap().unwrap();
    assert!(g.is_active());
    assert!(m.allows(id(&tok, "7")));
    assert!(!m.allows(id(&tok, "a")) && !m.allows(id(&tok, "!")));
    let stop = tok.chat_stop_tokens()[0];
    assert!(!m.allows(stop), "the grammar is not complete");
    // What the grammar refuses after the word is refused, and nothing moves.
    match g.sync(&out(" ef <go>x")) {
        Err(GrammarError::RefusedAt { index, .. }) => assert_eq!(index, on.len() - prompt.len()),
        other => panic!("{other:?}"),
    }
    assert_eq!(g.held(), &on[prompt.len()..]);
    // Complete: only the stops.
    let done = out(" ef <go>42!");
    let m = g.mask_after(&done).unwrap().unwrap();
    assert!(m.allows(stop) && !m.allows(id(&tok, "1")));
    // Back to before the word: free again; forward again: active again.
    assert!(g.mask_after(&partial).unwrap().is_none());
    assert!(!g.is_active());
    assert!(g.mask_after(&on).unwrap().is_some());
    // The output is what counts, not the prompt: a word in the prompt
    // does not trigger.
    let mut p2 = Guide::new(&vocab, &spec, 0).unwrap();
    let in_prompt = enc("x <go>");
    let mut g2 = Guide::new(&vocab, &spec, in_prompt.len()).unwrap();
    assert!(g2
        .mask_after(&[in_prompt.clone(), enc("7")].concat())
        .unwrap()
        .is_none());
    assert!(p2.mask_after(&in_prompt).unwrap().is_some());
}

#[test]
fn a_token_carrying_text_the_grammar_refuses_does_not_trigger() {
    let tok = tokenizer();
    let vocab = GrammarVocab::new(&tok).unwrap();
    // `ab` is one token: in "<ab" it completes "<a" and carries "b".
    let spec = lazy("<a", false, "start: \"<a\" \"!\"\n");
    let ab = id(&tok, "ab");
    let lt = id(&tok, "<");
    let mut g = Guide::new(&vocab, &spec, 0).unwrap();
    assert!(g.mask_after(&[lt, ab]).unwrap().is_none(), "not activated");
    // Spelled so that the grammar can hold it, it activates.
    let a = id(&tok, "a");
    let m = g.mask_after(&[lt, a]).unwrap().unwrap();
    assert!(m.allows(id(&tok, "!")) && !m.allows(id(&tok, "b")));
    // A later occurrence still can.
    assert!(g.mask_after(&[lt, ab, lt, a]).unwrap().is_some());
}

#[test]
fn a_start_trigger_holds_only_at_the_start_after_whitespace() {
    let tok = tokenizer();
    let vocab = GrammarVocab::new(&tok).unwrap();
    let spec = lazy("{\"x", true, "start: \"{\\\"x\\\": \" /[0-9]/ \"}\"\n");
    let enc = |s: &str| tok.encode(s, false).unwrap();
    let mut g = Guide::new(&vocab, &spec, 0).unwrap();
    let m = g.mask_after(&enc("  \n{\"x")).unwrap().unwrap();
    assert!(m.allows(id(&tok, "\"")) && !m.allows(id(&tok, "y")));
    assert!(g.mask_after(&enc("ab {\"x")).unwrap().is_none());
    assert!(g.sync(&enc(" {\"x\": 5}")).is_ok());
    assert!(g.sync(&enc(" {\"x\": 55}")).is_err());
}

#[test]
fn the_verifiers_verdict_and_the_engines_agree_across_the_activation() {
    let tok = tokenizer();
    let vocab = GrammarVocab::new(&tok).unwrap();
    let spec = lazy("<go>", false, "start: \"<go>\" /[0-9]{1,3}/ \"!\"\n");
    let ctx = tok.encode("ab ", false).unwrap();
    let block = tok.encode("<go>1", false).unwrap();
    let k = block.len();
    let v = vocab.vocab_size();
    let bang = id(&tok, "!");
    let letter = id(&tok, "a");
    // Each row's favourite is the block's token; the last row's is a
    // letter (which the grammar refuses there), then `!`.
    let mut logits = vec![0.0f32; (k + 1) * v];
    for (i, row) in logits.chunks_mut(v).enumerate() {
        for (t, l) in row.iter_mut().enumerate() {
            *l = (t % 7) as f32 * 0.01;
        }
        match block.get(i) {
            Some(&d) => row[d as usize] = 10.0,
            None => {
                row[letter as usize] = 10.0;
                row[bang as usize] = 9.0;
            }
        }
    }
    let params = SamplingParams::default();
    let free = tandem_model::verify::verdict_from_logits(&params, &ctx, &block, &logits).unwrap();
    assert_eq!((free.accepted, free.next_token), (k, letter));
    let mut g = Guide::new(&vocab, &spec, ctx.len()).unwrap();
    let (verdict, masked) = g.verdict(&params, &ctx, &block, &logits).unwrap();
    assert_eq!((verdict.accepted, verdict.next_token), (k, bang));
    // Rows before the trigger are left as they were.
    assert_eq!(masked[..v], logits[..v]);
    assert_eq!(masked[k * v + letter as usize], f32::NEG_INFINITY);
    let mut e = Guide::new(&vocab, &spec, ctx.len()).unwrap();
    let engine = tandem_model::engine::masked_verdict(
        &params,
        &ctx,
        &block,
        &logits,
        &mut e as &mut dyn OutputConstraint,
    )
    .unwrap();
    assert_eq!(engine, verdict);
}

#[test]
fn the_wire_form_round_trips_and_malformed_ones_are_refused() {
    let spec = GrammarSpec::Lazy {
        triggers: vec![
            Trigger {
                word: "<tool_call>".into(),
                at_start: false,
            },
            Trigger {
                word: "{\"name\": \"f\"".into(),
                at_start: true,
            },
        ],
        lark: "start: \"x\"".into(),
    };
    let (kind, text) = spec.to_wire();
    assert_eq!(kind, "lazy");
    assert_eq!(GrammarSpec::from_wire(kind, &text).unwrap(), spec);
    for bad in [
        "not json",
        "{}",
        r#"{"triggers": [], "lark": "start: \"x\""}"#,
        r#"{"triggers": [{"word": ""}], "lark": "start: \"x\""}"#,
        r#"{"triggers": [{"word": "a", "at_start": 1}], "lark": "start: \"x\""}"#,
        r#"{"triggers": [{"word": "a"}]}"#,
    ] {
        assert!(
            matches!(
                GrammarSpec::from_wire("lazy", bad),
                Err(GrammarError::Invalid(_))
            ),
            "{bad}"
        );
    }
    let tok = tokenizer();
    let vocab = GrammarVocab::new(&tok).unwrap();
    // The grammar after the trigger is compiled up front.
    assert!(Guide::new(&vocab, &lazy("a", false, "start: ("), 0).is_err());
    assert!(matches!(
        tandem_grammar::Grammar::new(&vocab, lazy("a", false, "start: (")),
        Err(GrammarError::Invalid(_))
    ));
}
