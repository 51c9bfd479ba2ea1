//! Every supported tokenizer against llama.cpp (llama-cpp-python 0.3.36,
//! fixtures made by `scripts/llama_reference.py`, commands in its header):
//! for each real model, every fixture string tokenized with control tokens
//! parsed (`ids`), as plain text (`ids_nospecial`) and as a prompt with the
//! model's BOS (`ids_bos`), ids equal; and every chat fixture (the GGUF's
//! template rendered by jinja2 as Hugging Face does) rendered to the same
//! string and the same ids; and the raw prompts of the greedy fixtures
//! (`prompt_ids`, BOS as the model says) equal `encode_prompt`.
//!
//! Models: the Qwen2.5 draft (gpt2, pre `qwen2`), SmolLM2-135M (gpt2, pre
//! `smollm`), Gemma 3 270M (SentencePiece). Needs them fetched
//! (`tandem models fetch --model draft|smollm2|gemma`); fails loudly without.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use tandem_model::gguf::GgufFile;
use tandem_model::tokenizer::{ChatMessage, Role, Tokenizer, TokenizerModel, ToolCall};

fn fixture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn model_file(file: &str) -> PathBuf {
    let p = tandem_fetch::models_dir().join(file);
    assert!(
        p.exists(),
        "model file {} is missing: run `tandem models fetch` for it (or set TANDEM_MODELS_DIR)",
        p.display()
    );
    p
}

fn load(file: &str) -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(model_file(file)).unwrap()).unwrap()
}

fn lines(name: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(fixture_path(name))
        .unwrap_or_else(|e| panic!("fixture {name}: {e}"));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Compare every string of `tokenize_<name>.jsonl`; returns the count.
fn check_tokenize(tok: &Tokenizer, name: &str) -> usize {
    let fx = lines(&format!("tokenize_{name}.jsonl"));
    let mut failures = Vec::new();
    for f in &fx {
        let text = f["text"].as_str().unwrap();
        let mut cases = vec![
            ("ids", tok.encode(text, true).unwrap()),
            ("ids_nospecial", tok.encode(text, false).unwrap()),
        ];
        let mut with_bos = Vec::new();
        if tok.add_bos() {
            with_bos.push(tok.bos_id().unwrap());
        }
        with_bos.extend(tok.encode(text, true).unwrap());
        cases.push(("ids_bos", with_bos));
        for (key, got) in cases {
            let want = ids(&f[key]);
            if got != want {
                failures.push(format!(
                    "{name} {key} {text:?}\n  llama.cpp {want:?}\n  tandem    {got:?}"
                ));
            }
        }
        // The raw-prompt path is the plain-text one with BOS.
        let mut prompt = Vec::new();
        if tok.add_bos() {
            prompt.push(tok.bos_id().unwrap());
        }
        prompt.extend(ids(&f["ids_nospecial"]));
        assert_eq!(tok.encode_prompt(text).unwrap(), prompt, "{text:?}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    fx.len()
}

/// The raw prompts of `greedy_<name>.jsonl` (llama.cpp's
/// `tokenize(prompt, add_bos = true, special = false)`) equal
/// `encode_prompt`; returns the count.
fn check_prompts(tok: &Tokenizer, name: &str) -> usize {
    let fx = lines(&format!("greedy_{name}.jsonl"));
    for f in &fx {
        let prompt = f["prompt"].as_str().unwrap();
        assert_eq!(
            tok.encode_prompt(prompt).unwrap(),
            ids(&f["prompt_ids"]),
            "{prompt:?}"
        );
    }
    fx.len()
}

fn role(s: &str) -> Role {
    s.parse().unwrap()
}

/// Compare every conversation of `chat_<name>.jsonl`; returns the count.
fn check_chat(tok: &Tokenizer, name: &str) -> usize {
    let fx = lines(&format!("chat_{name}.jsonl"));
    let mut checked = 0;
    for f in &fx {
        if f.get("no_chat_template").is_some() {
            assert!(tok.chat_template().is_none());
            let e = tok
                .encode_chat(&[ChatMessage::user("hi")], true)
                .unwrap_err();
            assert!(
                matches!(e, tandem_model::ModelError::NoChatTemplate),
                "{e:?}"
            );
            continue;
        }
        let tools: Vec<serde_json::Value> = f["tools"].as_array().cloned().unwrap_or_default();
        let msgs: Vec<ChatMessage> = f["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let mut msg = ChatMessage::new(
                    role(m["role"].as_str().unwrap()),
                    m["content"].as_str().unwrap(),
                );
                for c in m["tool_calls"].as_array().into_iter().flatten() {
                    msg.tool_calls.push(ToolCall {
                        id: c["id"].as_str().unwrap_or("").into(),
                        name: c["function"]["name"].as_str().unwrap().into(),
                        arguments: c["function"]["arguments"].clone(),
                    });
                }
                msg
            })
            .collect();
        let gen = f["add_generation_prompt"].as_bool().unwrap();
        let rendered = f["rendered"].as_str().unwrap();
        assert_eq!(
            tok.apply_chat_template_with_tools(&msgs, &tools, gen)
                .unwrap(),
            rendered,
            "{}",
            f["name"]
        );
        let mut want = ids(&f["ids"]);
        if tok.add_bos() && want.first() != tok.bos_id().as_ref() {
            want.insert(0, tok.bos_id().unwrap());
        }
        assert_eq!(
            tok.encode_chat_with_tools(&msgs, &tools, gen).unwrap(),
            want,
            "{}",
            f["name"]
        );
        checked += 1;
    }
    checked
}

#[test]
fn qwen2_equals_llama_cpp() {
    let tok = load("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert_eq!(
        (tok.model(), tok.pre_name()),
        (TokenizerModel::Gpt2, "qwen2")
    );
    assert!(check_tokenize(&tok, "qwen2") >= 50);
    // All 7, the tool call and tool response with `tools` included.
    assert_eq!(check_chat(&tok, "qwen2"), 7);
    assert!(check_prompts(&tok, "qwen2_draft") >= 5);
}

#[test]
fn smollm2_equals_llama_cpp() {
    let tok = load("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert_eq!(
        (tok.model(), tok.pre_name()),
        (TokenizerModel::Gpt2, "smollm")
    );
    assert!(check_tokenize(&tok, "smollm2") >= 50);
    assert_eq!(check_chat(&tok, "smollm2"), 7);
    assert!(check_prompts(&tok, "smollm2") >= 5);
}

#[test]
fn gemma3_equals_llama_cpp() {
    let tok = load("gemma-3-270m-q4_k_m.gguf");
    assert_eq!(tok.model(), TokenizerModel::Llama);
    assert!(tok.add_bos());
    assert!(check_tokenize(&tok, "gemma3") >= 50);
    check_chat(&tok, "gemma3");
    assert!(check_prompts(&tok, "gemma3") >= 5);
}
