//! Real models of every family against llama.cpp: greedy generations
//! recorded with llama-cpp-python (`scripts/llama_reference.py greedy`, the
//! command is in each fixture's `made_by`) from the same prompt ids, compared
//! token for token with Tandem's (f32 KV, as the target runs; the draft
//! also with its default KV precision, f16).
//!
//! Two engines whose arithmetic differs (llama.cpp keeps an f16 KV cache and
//! sums in other orders) can split a near-tie. So where the tokens first
//! differ, the test requires the tie to be visible: llama.cpp's own top-2
//! logit margin at that step must be below [`TIE_MARGIN`]. Anything else (a
//! wrong RoPE, norm, window or scale) moves the logits by whole units and
//! diverges at a large margin. The agreement per model is printed
//! (`cargo test -p tandem-model --test families_real -- --nocapture`) and
//! recorded in docs/models.md.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::builtin_file;

use std::path::PathBuf;
use tandem_model::kv_cache::KvPrecision;
use tandem_model::sampling::argmax;
use tandem_model::speculative::GenerateConfig;
use tandem_model::transformer::{LoadOptions, Model};

/// llama.cpp's top1 − top2 logit gap below which a split is a near-tie.
/// Measured splits (docs/models.md, "Fidelity to llama.cpp"): at most 0.33
/// (Gemma 3 270M, whose 262k-token head makes near-ties common), 0.28 and
/// 0.09 for the Qwen2.5 1.5B target (issue 28). A wrong RoPE, norm, window or
/// scale diverges at margins of whole logits, usually at the first token.
const TIE_MARGIN: f32 = 0.5;

#[derive(serde::Deserialize)]
struct Record {
    prompt: String,
    prompt_ids: Vec<u32>,
    generated: Vec<u32>,
    margin: Vec<f32>,
}

fn fixture(name: &str) -> Vec<Record> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("greedy_{name}.jsonl"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Greedy tokens from `prompt` with a KV cache at `kv`, with our own top-2
/// gap at each step.
fn greedy(m: &Model, kv: KvPrecision, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut cache = m.new_cache_with(kv);
    let mut logits = m.forward_last(prompt, 0, &mut cache).unwrap();
    let (mut out, mut gaps) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let t = argmax(&logits);
        let top = logits[t as usize];
        let second = logits
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != t as usize)
            .fold(f32::MIN, |m, (_, &x)| m.max(x));
        out.push(t);
        gaps.push(top - second);
        let pos = prompt.len() + out.len() - 1;
        logits = m.forward_last(&[t], pos, &mut cache).unwrap();
    }
    (out, gaps)
}

/// Compare every fixture prompt of `name` with the model at `path` (f32 KV);
/// returns each prompt's length and first differing step (`None`: all equal).
fn agree_with_llama_cpp(name: &str, path: PathBuf) -> Vec<(usize, Option<usize>)> {
    agree_with_llama_cpp_at(name, path, KvPrecision::F32)
}

fn agree_with_llama_cpp_at(
    name: &str,
    path: PathBuf,
    kv: KvPrecision,
) -> Vec<(usize, Option<usize>)> {
    let records = fixture(name);
    assert!(!records.is_empty(), "{name}: empty fixture");
    let max = records
        .iter()
        .map(|r| r.prompt_ids.len() + r.generated.len())
        .max()
        .unwrap();
    let m = Model::load(&path, LoadOptions::with_max_seq_len(max + 1)).unwrap();
    let mut out = Vec::new();
    for r in &records {
        let (ours, gaps) = greedy(&m, kv, &r.prompt_ids, r.generated.len());
        let first = ours.iter().zip(&r.generated).position(|(a, b)| a != b);
        out.push((r.prompt_ids.len(), first));
        match first {
            None => {}
            Some(i) => {
                eprintln!(
                    "{name}: {:?}: first difference at step {i}: ours {} theirs {}, \
                     llama.cpp margin {:.3}, ours {:.3}",
                    r.prompt.chars().take(40).collect::<String>(),
                    ours[i],
                    r.generated[i],
                    r.margin[i],
                    gaps[i]
                );
                assert!(
                    r.margin[i] < TIE_MARGIN,
                    "{name}: {:?} diverges from llama.cpp at step {i} where llama.cpp's \
                     top-2 margin is {} (not a near-tie)",
                    r.prompt,
                    r.margin[i]
                );
            }
        }
    }
    let equal = out.iter().filter(|(_, f)| f.is_none()).count();
    eprintln!(
        "{name} ({kv} KV): {equal} of {} prompts equal to llama.cpp",
        records.len()
    );
    out
}

#[test]
fn gemma3_270m_greedy_agrees_with_llama_cpp() {
    // The seventh prompt is 1,502 tokens, past the 512-position sliding
    // window: it must agree in full (its smallest llama.cpp margin is 6.07).
    let results = agree_with_llama_cpp("gemma3", builtin_file("gemma"));
    let long: Vec<_> = results.iter().filter(|(len, _)| *len > 512).collect();
    assert_eq!(long.len(), 1, "the fixture has one prompt past the window");
    assert_eq!(long[0].1, None, "the long prompt diverges from llama.cpp");
}

#[test]
fn smollm2_135m_greedy_agrees_with_llama_cpp() {
    agree_with_llama_cpp("smollm2", builtin_file("smollm2"));
}

/// Both models of the pair in f32 KV (the target's), and the draft with its
/// default KV precision too: the draft's own answers (draft mode, local and
/// offline tokens) must be the model's, as faithful to llama.cpp as with f32
/// KV. (Per-head INT8, the old default, agreed on 1 of the 6 prompts against
/// f32's 4: docs/model-core.md, "Draft KV fidelity".)
#[test]
fn qwen2_pair_greedy_agrees_with_llama_cpp() {
    agree_with_llama_cpp("qwen2_target", builtin_file("target"));
    let equal = |kv| {
        agree_with_llama_cpp_at("qwen2_draft", builtin_file("draft"), kv)
            .iter()
            .filter(|(_, f)| f.is_none())
            .count()
    };
    let kv = GenerateConfig::default().draft_kv;
    let (with_f32, with_default) = (equal(KvPrecision::F32), equal(kv));
    assert!(
        with_default >= with_f32,
        "the draft with {kv} KV agrees with llama.cpp on {with_default} prompts, \
         with f32 on {with_f32}"
    );
}
