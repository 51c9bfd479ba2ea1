//! Shared helpers of the real-model tests. The models are required: a missing
//! model is a test failure with instructions, never a skip (CI fetches them).
#![allow(dead_code)]
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::PathBuf;
use tandem_fetch::ModelRole;
use tandem_model::gguf::GgufFile;
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::{LoadOptions, Model};

pub fn model_file(role: ModelRole) -> PathBuf {
    let p = tandem_fetch::model_path(role);
    assert!(
        p.exists(),
        "real model {} is missing: run `cargo run --release -p tandem -- models fetch` \
         (or set TANDEM_MODELS_DIR); these tests need the real models",
        p.display()
    );
    p
}

/// A built-in model's file by its short name (`gemma`, `smollm2`, …), required
/// like [`model_file`].
pub fn builtin_file(name: &str) -> PathBuf {
    let spec = tandem_fetch::ModelSpec::by_name(name).unwrap();
    let p = spec.path_in(&tandem_fetch::models_dir());
    assert!(
        p.exists(),
        "real model {} is missing: run `cargo run --release -p tandem -- models fetch` \
         (or set TANDEM_MODELS_DIR); these tests need the real models",
        p.display()
    );
    p
}

pub fn load(role: ModelRole, max_seq_len: usize) -> Model {
    Model::load(model_file(role), LoadOptions::with_max_seq_len(max_seq_len)).expect("load model")
}

pub fn tokenizer() -> Tokenizer {
    let g = GgufFile::open(model_file(ModelRole::Draft)).expect("open gguf");
    Tokenizer::from_gguf(&g).expect("tokenizer")
}

pub struct Prompt {
    pub id: String,
    pub text: String,
    pub max_tokens: usize,
}

/// The shared prompt set (`prompts/default.jsonl`).
pub fn prompts() -> Vec<Prompt> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../prompts/default.jsonl");
    std::fs::read_to_string(&path)
        .expect("prompt set")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("prompt json");
            Prompt {
                id: v["id"].as_str().unwrap().to_string(),
                text: v["prompt"].as_str().unwrap().to_string(),
                max_tokens: v["max_tokens"].as_u64().unwrap() as usize,
            }
        })
        .collect()
}

pub fn chat_tokens(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode_chat(&[ChatMessage::user(text)], true)
        .expect("encode")
}

/// Asserts that `g` is the target's own greedy output of `prompt`, checked
/// teacher-forced (`tandem_model::testing::target_greedy_mismatch`: a block
/// forward per 16 tokens instead of a decode of its own; CI time).
pub fn assert_target_greedy(
    target: &Model,
    prompt: &[u32],
    g: &tandem_model::speculative::Generation,
    max_tokens: usize,
    stop_tokens: &[u32],
    what: &str,
) {
    let mismatch = tandem_model::testing::target_greedy_mismatch(
        target,
        prompt,
        &g.tokens,
        g.stop,
        max_tokens,
        stop_tokens,
    )
    .unwrap();
    assert_eq!(mismatch, None, "{what}");
}
