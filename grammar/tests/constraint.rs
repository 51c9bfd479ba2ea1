//! Grammar constraints over the real Qwen2.5 tokenizer (the draft GGUF's):
//! the draft's greedy output under a JSON schema is valid JSON of that schema
//! and ends with a stop token; masks are deterministic and survive rollback; a
//! refused token or grammar changes nothing.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::time::Instant;
use tandem_fetch::ModelRole;
use tandem_grammar::{Constraint, GrammarError, GrammarSpec, GrammarVocab, MAX_GRAMMAR_BYTES};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::{LoadOptions, Model};

fn draft() -> (Model, Tokenizer) {
    let p = tandem_fetch::model_path(ModelRole::Draft);
    assert!(
        p.exists(),
        "real model {} is missing: run `cargo run --release -p tandem -- models fetch`",
        p.display()
    );
    let model = Model::load(&p, LoadOptions::with_max_seq_len(512)).unwrap();
    let tok = Tokenizer::from_gguf(model.gguf()).unwrap();
    (model, tok)
}

fn person_schema() -> GrammarSpec {
    GrammarSpec::JsonSchema(serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3}
        },
        "required": ["name", "age", "languages"],
        "additionalProperties": false
    }))
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn the_drafts_greedy_output_under_a_schema_is_valid_json_of_it_and_stops() {
    let (model, tok) = draft();
    let t0 = Instant::now();
    let vocab = GrammarVocab::new(&tok).unwrap();
    let vocab_ms = t0.elapsed().as_secs_f64() * 1000.0;
    let spec = person_schema();
    let t1 = Instant::now();
    let mut c = Constraint::new(&vocab, &spec).unwrap();
    let compile_ms = t1.elapsed().as_secs_f64() * 1000.0;

    let prompt = tok
        .encode_chat(
            &[ChatMessage::user(
                "Describe Ada Lovelace as a JSON object with her name, age at death and languages she wrote in.",
            )],
            true,
        )
        .unwrap();
    let mut cache = model.new_cache();
    let mut logits = model.forward_last(&prompt, 0, &mut cache).unwrap();
    let stops = tok.chat_stop_tokens();
    let mut out = Vec::new();
    let mut mask_s = 0.0;
    let mut unconstrained_differs = 0;
    let stopped = loop {
        let tm = Instant::now();
        let mask = c.mask().unwrap();
        mask_s += tm.elapsed().as_secs_f64();
        let free = argmax(&logits);
        mask.apply(&mut logits);
        let t = argmax(&logits);
        if t != free {
            unconstrained_differs += 1;
        }
        c.accept(t).unwrap();
        if stops.contains(&t) {
            break true;
        }
        out.push(t);
        if out.len() >= 96 {
            break false;
        }
        let pos = cache.len();
        logits = model.forward(&[t], pos, &mut cache).unwrap();
    };
    let text = tok.decode(&out, true).unwrap();
    eprintln!(
        "vocabulary {vocab_ms:.1} ms, compile {compile_ms:.1} ms, mask {:.0} µs/token over {} tokens \
         ({unconstrained_differs} positions where the mask changed the greedy choice): {text}",
        mask_s * 1e6 / (out.len() + 1) as f64,
        out.len() + 1
    );
    assert!(stopped, "no stop after {} tokens: {text}", out.len());
    assert!(c.is_complete());
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let o = v.as_object().unwrap();
    assert_eq!(o.len(), 3, "{text}");
    assert!(o["name"].is_string(), "{text}");
    assert!(o["age"].is_i64(), "{text}");
    let langs = o["languages"].as_array().unwrap();
    assert!(
        langs.len() <= 3 && langs.iter().all(|l| l.is_string()),
        "{text}"
    );
}

#[test]
fn masks_are_deterministic_and_rollback_restores_them() {
    let (_, tok) = draft();
    let vocab = GrammarVocab::new(&tok).unwrap();
    let spec = person_schema();
    let text = tok.encode(r#"{"name": "Ada", "age": 36"#, false).unwrap();
    let mut a = Constraint::new(&vocab, &spec).unwrap();
    let mut b = Constraint::new(&vocab, &spec).unwrap();
    let mut masks = Vec::new();
    for &t in &text {
        let m = a.mask().unwrap();
        let n = b.mask().unwrap();
        assert_eq!(m.count(), n.count());
        assert!(m.allows(t), "token {t} not allowed");
        masks.push(m.count());
        a.accept(t).unwrap();
        b.accept(t).unwrap();
    }
    // Take back the last 4, then walk them again: the same masks.
    a.rollback(4).unwrap();
    assert_eq!(a.accepted(), text.len() - 4);
    for (i, &t) in text[text.len() - 4..].iter().enumerate() {
        assert_eq!(a.mask().unwrap().count(), masks[text.len() - 4 + i]);
        a.accept(t).unwrap();
    }
    assert!(a.rollback(text.len() + 1).is_err());
    // Not complete yet: no stop allowed; "}" after the languages would be.
    let stops = tok.chat_stop_tokens();
    let m = a.mask().unwrap();
    assert!(stops.iter().all(|&s| !m.allows(s)));
}

#[test]
fn a_refused_token_or_grammar_changes_nothing() {
    let (_, tok) = draft();
    let vocab = GrammarVocab::new(&tok).unwrap();
    let mut c = Constraint::new(&vocab, &GrammarSpec::JsonObject).unwrap();
    let before = c.mask().unwrap().count();
    // A JSON object cannot start with "x", nor with a stop or a padding id.
    let x = tok.encode("x", false).unwrap()[0];
    for t in [
        x,
        tok.chat_stop_tokens()[0],
        u32::try_from(tok.vocab_size()).unwrap() - 1,
    ] {
        match c.accept(t) {
            Err(GrammarError::Refused { token }) => assert_eq!(token, t),
            other => panic!("token {t}: {other:?}"),
        }
    }
    assert_eq!(c.accepted(), 0);
    assert_eq!(c.mask().unwrap().count(), before);
    let open = tok.encode("{", false).unwrap()[0];
    c.accept(open).unwrap();

    for (kind, text, want) in [
        ("lark", "start: (", "invalid grammar"),
        ("json_schema", "{not json", "not JSON"),
        (
            "json_schema",
            r#"{"type": "no-such-type"}"#,
            "invalid grammar",
        ),
        ("regex", "a(", "invalid grammar"),
        ("gbnf", "root ::= \"a\"", "unknown grammar kind"),
    ] {
        let err = GrammarSpec::from_wire(kind, text)
            .and_then(|s| Constraint::new(&vocab, &s))
            .unwrap_err();
        assert!(err.to_string().contains(want), "{kind} {text:?}: {err}");
    }
    let huge = "a".repeat(MAX_GRAMMAR_BYTES + 1);
    assert!(matches!(
        GrammarSpec::from_wire("regex", &huge),
        Err(GrammarError::TooLarge { .. })
    ));
    // The wire form round-trips.
    for s in [
        GrammarSpec::JsonObject,
        person_schema(),
        GrammarSpec::Regex("[0-9]+".into()),
    ] {
        let (k, t) = s.to_wire();
        assert_eq!(GrammarSpec::from_wire(k, &t).unwrap(), s);
    }
}

/// The mask's cost per token on each side, on the draft's greedy output
/// under the person schema (docs/grammar.md, "Measured"): the device's
/// (`Guide` through the engine's `OutputConstraint`: follow the context one
/// token on, compute the mask, apply it to a 151k-row logits vector, what
/// every draft step under a grammar adds) and the verifier's (`Guide::verdict`
/// over blocks of 4 against `verdict_from_logits` on the same rows). Run with
/// `--ignored --nocapture`.
#[test]
#[ignore]
fn mask_cost_per_token_on_the_device_and_the_verifier() {
    use tandem_grammar::{Grammar, Guide};
    use tandem_model::engine::OutputGrammar;
    use tandem_model::sampling::SamplingParams;
    let (model, tok) = draft();
    let vocab = GrammarVocab::new(&tok).unwrap();
    let spec = person_schema();
    let prompt = tok
        .encode_chat(
            &[ChatMessage::user(
                "Describe Ada Lovelace as a JSON object with her name, age at death and languages she wrote in.",
            )],
            true,
        )
        .unwrap();
    let g = Grammar::new(&vocab, spec.clone()).unwrap();
    let cfg = tandem_model::speculative::GenerateConfig {
        max_tokens: 96,
        stop_tokens: tok.chat_stop_tokens(),
        grammar: Some(g.clone().into_config()),
        ..Default::default()
    };
    let out = tandem_model::speculative::generate_single(&model, &prompt, &cfg, &mut |_| true)
        .unwrap()
        .tokens;
    let mut all = prompt.clone();
    all.extend_from_slice(&out);
    let mut cache = model.new_cache();
    let logits = model.forward(&all, 0, &mut cache).unwrap();
    let v = model.config().vocab;
    let row = |i: usize| &logits[(prompt.len() - 1 + i) * v..(prompt.len() + i) * v];
    // The device: one draft step's mask at every output position.
    let mut c = g.constraint(prompt.len()).unwrap();
    let t = Instant::now();
    for i in 0..out.len() {
        let mut l = row(i).to_vec();
        c.mask(&all[..prompt.len() + i], &mut l).unwrap();
    }
    let device_us = t.elapsed().as_secs_f64() * 1e6 / out.len() as f64;
    // The verifier: blocks of 4 (each the output's next 4 tokens: all
    // accepted), masked against plain verdicts on the same rows.
    let params = SamplingParams::default();
    let mut guide = Guide::new(&vocab, &spec, prompt.len()).unwrap();
    let (mut masked_s, mut plain_s, mut committed) = (0.0, 0.0, 0);
    let mut i = 0;
    while i + 5 <= out.len() {
        let ctx = &all[..prompt.len() + i];
        let block = &out[i..i + 4];
        let rows = &logits[(prompt.len() - 1 + i) * v..(prompt.len() + i + 4) * v];
        let t = Instant::now();
        let (vd, _) = guide.verdict(&params, ctx, block, rows).unwrap();
        masked_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let pv = tandem_model::verify::verdict_from_logits(&params, ctx, block, rows).unwrap();
        plain_s += t.elapsed().as_secs_f64();
        assert_eq!(vd.accepted, 4, "the output is the masked greedy one");
        let _ = pv;
        committed += 5;
        i += 5;
    }
    let verifier_us = (masked_s - plain_s) * 1e6 / committed as f64;
    eprintln!(
        "mask cost per token over {} tokens: device {device_us:.0} µs (sync + mask + apply), \
         verifier {verifier_us:.0} µs (masked verdict less the plain one; masked {:.0} µs, plain \
         {:.0} µs per token)",
        out.len(),
        masked_s * 1e6 / committed as f64,
        plain_s * 1e6 / committed as f64,
    );
}

/// What a lazy grammar (serve-edge's `tool_choice: "auto"`) costs per token
/// on the device over the real tokenizer: before its trigger (following the
/// output, no mask) and after it (the call's masks), over a free sentence
/// followed by a Hermes call (docs/grammar.md, "Lazy grammars"). Run with
/// `--ignored --nocapture`.
#[test]
#[ignore]
fn lazy_mask_cost_before_and_after_the_trigger() {
    use tandem_grammar::{Grammar, Trigger};
    use tandem_model::engine::OutputGrammar;
    let (_model, tok) = draft();
    let vocab = GrammarVocab::new(&tok).unwrap();
    let call = tandem_grammar::json_options(serde_json::json!({"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": "get_weather"},
                       "arguments": {"type": "object", "properties": {"city": {"type": "string"}},
                                     "required": ["city"]}},
        "required": ["name", "arguments"], "additionalProperties": false}]}));
    let lark = format!(
        "start: tagged | call\ntagged: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {call}\n"
    );
    let spec = GrammarSpec::Lazy {
        triggers: vec![
            Trigger {
                word: "<tool_call>".into(),
                at_start: false,
            },
            Trigger {
                word: "{\"name\": \"get_weather\"".into(),
                at_start: true,
            },
        ],
        lark,
    };
    let t = Instant::now();
    let g = Grammar::new(&vocab, spec).unwrap();
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    let prompt = tok.encode("x", false).unwrap();
    let free = tok
        .encode(
            "Sure, let me check the current weather in Paris for you before we plan the trip. ",
            false,
        )
        .unwrap();
    let tagged = tok
        .encode(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            false,
        )
        .unwrap();
    let mut all = prompt.clone();
    all.extend_from_slice(&free);
    all.extend_from_slice(&tagged);
    let v = tok.vocab_size();
    let mut c = g.constraint(prompt.len()).unwrap();
    let mut l = vec![0.0f32; v];
    let mut per = |from: usize, to: usize| {
        let t = Instant::now();
        for i in from..to {
            l.fill(0.0);
            c.mask(&all[..i], &mut l).unwrap();
        }
        t.elapsed().as_secs_f64() * 1e6 / (to - from) as f64
    };
    let p = prompt.len();
    let before = per(p, p + free.len() + 1);
    let after = per(p + free.len() + 1, all.len() + 1);
    eprintln!(
        "lazy grammar: compile {compile_ms:.1} ms; per token (refilling the logits vector \
         included) before the trigger {before:.0} µs ({} free tokens), after it {after:.0} µs \
         ({} call tokens)",
        free.len() + 1,
        tagged.len()
    );
}
