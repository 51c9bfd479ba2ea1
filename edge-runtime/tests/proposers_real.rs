//! The real Qwen pair through a loopback verifier: with the `lookup` and
//! `auto` proposers, greedy output is token for token the target's own
//! greedy output, on a few prompts of both prompt sets (`prompts/default.jsonl`
//! and `prompts/editing.jsonl`; 2 prompts each, 24 tokens: CI time); and
//! under a JSON schema (structured output, docs/grammar.md), with the
//! draft and auto proposers, the target's own greedy output under the schema. The models are
//! required (a missing model fails with instructions).

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;
use tandem_edge::{EdgeConfig, EdgeRuntime, TokenStatus};
use tandem_fetch::ModelRole;
use tandem_model::proposer::ProposerKind;
use tandem_model::speculative::{generate_single, GenerateConfig};
use tandem_model::testing::target_greedy_mismatch;
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::{LoadOptions, Model};

const TOKEN: &str = "proposers-real-token-0123456789";
const MAX: usize = 24;
const PER_SET: usize = 2;

fn model_file(role: ModelRole) -> PathBuf {
    let p = tandem_fetch::model_path(role);
    assert!(
        p.exists(),
        "real model {} is missing: run `cargo run --release -p tandem -- models fetch` \
         (or set TANDEM_MODELS_DIR); this test needs the real models",
        p.display()
    );
    p
}

fn prompts(set: &str) -> Vec<String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../prompts/{set}"));
    std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(PER_SET)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["prompt"].as_str().unwrap().to_string()
        })
        .collect()
}

#[test]
fn lookup_and_auto_over_the_network_give_the_target_s_greedy_output_on_both_sets() {
    let (draft_p, target_p) = (model_file(ModelRole::Draft), model_file(ModelRole::Target));
    let opts = LoadOptions::with_max_seq_len(2048);
    let draft = Arc::new(Model::load(&draft_p, opts.clone()).unwrap());
    let target = Model::load(&target_p, opts).unwrap();
    let tok = Tokenizer::from_gguf(draft.gguf()).unwrap();
    let fp = tok.fingerprint();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nmodel_path = {target_p:?}\n\
         tokenizer_fingerprint = \"{fp}\"\nmax_seq_len = 4096\ninsecure_loopback = true\n\
         [[devices]]\nid = \"dev\"\ntoken = \"{TOKEN}\"\n"
    );
    let vcfg: tandem_verifier::VerifierConfig = toml::from_str(&text).unwrap();
    let v = rt.block_on(tandem_verifier::start(vcfg)).unwrap();
    let cfg = EdgeConfig {
        verifier_url: Some(format!("http://{}", v.grpc_addr)),
        token: Some(TOKEN.into()),
        ..EdgeConfig::default()
    };
    let mut edge = EdgeRuntime::builder(draft, cfg).build().unwrap();

    let mut lookup_rounds = [0u64; 2];
    for (set_i, set) in ["default.jsonl", "editing.jsonl"].into_iter().enumerate() {
        for (i, text) in prompts(set).iter().enumerate() {
            let prompt = tok.encode_chat(&[ChatMessage::user(text)], true).unwrap();
            let base = GenerateConfig {
                k: 4,
                max_tokens: MAX,
                stop_tokens: Vec::new(),
                ..GenerateConfig::default()
            };
            // The first proposer's output is checked against the target
            // teacher-forced (a block forward per 16 tokens, not a decode of
            // its own: CI time); the second must equal it.
            let mut first: Option<Vec<u32>> = None;
            for proposer in [ProposerKind::Lookup, ProposerKind::Auto] {
                let cfg = GenerateConfig {
                    proposer,
                    ..base.clone()
                };
                let g = edge.generate(&prompt, &cfg, &mut |_| true).unwrap();
                match &first {
                    None => {
                        let mismatch =
                            target_greedy_mismatch(&target, &prompt, &g.tokens, g.stop, MAX, &[])
                                .unwrap();
                        assert_eq!(mismatch, None, "{set} prompt {i}, {proposer}");
                        first = Some(g.tokens.clone());
                    }
                    Some(want) => assert_eq!(&g.tokens, want, "{set} prompt {i}, {proposer}"),
                }
                assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
                lookup_rounds[set_i] += g.stats.proposers.lookup.rounds;
                eprintln!(
                    "{set} #{i} {proposer}: rounds {} ({:?}), passes/token {:.2}",
                    g.stats.rounds, g.stats.proposers, g.stats.verifier_passes_per_token
                );
            }
        }
    }
    // Editing prompts carry the text to change: lookup finds it.
    assert!(lookup_rounds[1] > 0, "{lookup_rounds:?}");

    // Structured output: a schema (the other schema of cli/tests/generate.rs
    // runs there, locally; CI time), the draft and auto proposers, the
    // target's own greedy output under the schema (24 tokens: a start of the
    // answer).
    let vocab = tandem_grammar::GrammarVocab::new(&tok).unwrap();
    {
        let question = "Write the configuration of a web server as JSON.";
        let schema = serde_json::json!({"type": "object", "properties": {
            "host": {"type": "string"}, "port": {"type": "integer"},
            "tls": {"type": "boolean"}},
            "required": ["host", "port", "tls"], "additionalProperties": false});
        let prompt = tok
            .encode_chat(&[ChatMessage::user(question)], true)
            .unwrap();
        let g =
            tandem_grammar::Grammar::new(&vocab, tandem_grammar::GrammarSpec::JsonSchema(schema))
                .unwrap()
                .into_config();
        let base = GenerateConfig {
            k: 4,
            max_tokens: MAX,
            stop_tokens: tok.chat_stop_tokens(),
            grammar: Some(g),
            ..GenerateConfig::default()
        };
        let want = generate_single(&target, &prompt, &base, &mut |_| true)
            .unwrap()
            .tokens;
        assert!(tok.decode(&want, true).unwrap().starts_with('{'));
        // (Lookup alone is run locally on the real pair by
        // cli/tests/generate.rs, and over the network on the tiny models.)
        for proposer in [ProposerKind::Draft, ProposerKind::Auto] {
            let cfg = GenerateConfig {
                proposer,
                ..base.clone()
            };
            let g = edge.generate(&prompt, &cfg, &mut |_| true).unwrap();
            assert_eq!(g.tokens, want, "{question}: {proposer}");
            assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
            eprintln!(
                "schema, {question:?} {proposer}: acceptance {:.2}, rounds {}",
                g.stats.gen.acceptance_rate, g.stats.rounds
            );
        }
    }
    rt.block_on(v.shutdown()).unwrap();
}
