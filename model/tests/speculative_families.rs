//! The invariant on a real, non-trivial pair of every new family: the
//! published quantized file as the draft, and as the target the same model
//! written back in a float format (`testing::write_dequantized`, the Rust
//! twin of `scripts/gguf_dequant.py`). Greedy local speculative decoding
//! equals the target's own greedy output token for token, for several block
//! lengths and both proposers.
//!
//! - SmolLM2-135M-Instruct (llama, Q4_1) drafting for its F16 copy whose
//!   embedding has 64 padding rows more (49,216 vs 49,152 rows, like Qwen2.5
//!   0.5B vs 7B): a padded target pairs with its draft, and no padding id is
//!   ever proposed, accepted or emitted.
//! - Gemma 3 270M (gemma3, Q4_K_M mix) drafting for its BF16 copy, with a
//!   prompt past the 512-position sliding window.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::builtin_file;

use candle_core::quantized::GgmlDType;
use tandem_model::proposer::ProposerKind;
use tandem_model::speculative::{generate_single, generate_speculative, GenerateConfig};
use tandem_model::testing::write_dequantized;
use tandem_model::tokenizer::Tokenizer;
use tandem_model::transformer::{LoadOptions, Model};

fn check_pair(name: &str, to: GgmlDType, pad_rows: usize, prompts: &[String], max_tokens: usize) {
    let draft_path = builtin_file(name);
    let dir = tempfile::tempdir().unwrap();
    let target_path = dir.path().join("target.gguf");
    write_dequantized(&draft_path, &target_path, to, pad_rows).unwrap();
    let opts = || LoadOptions::with_max_seq_len(2048);
    let draft = Model::load(&draft_path, opts()).unwrap();
    let target = Model::load(&target_path, opts()).unwrap();
    let (dc, tc) = (draft.config(), target.config());
    assert_eq!(tc.embd_rows, dc.embd_rows + pad_rows, "{name}: padded rows");
    assert_eq!(tc.vocab, dc.vocab, "{name}: one vocabulary");
    let dt = Tokenizer::from_gguf(draft.gguf()).unwrap();
    let tt = Tokenizer::from_gguf(target.gguf()).unwrap();
    tandem_model::pair::check_pair(dc, Some(&dt), tc, Some(&tt)).unwrap();
    let mut runs = 0;
    for (i, p) in prompts.iter().enumerate() {
        let ids = dt.encode_prompt(p).unwrap();
        let base = GenerateConfig {
            max_tokens,
            stop_tokens: dt.chat_stop_tokens(),
            ..GenerateConfig::default()
        };
        let reference = generate_single(&target, &ids, &base, &mut |_| true).unwrap();
        assert!(
            reference.tokens.iter().all(|&t| (t as usize) < dc.vocab),
            "{name}: the target emitted a padding id"
        );
        for (k, proposer) in [
            ([1, 4, 8][i % 3], ProposerKind::Draft),
            (4, ProposerKind::Lookup),
        ] {
            let cfg = GenerateConfig {
                k,
                proposer,
                ..base.clone()
            };
            let g = generate_speculative(&draft, &target, &ids, &cfg, &mut |_| true).unwrap();
            assert_eq!(
                g.tokens, reference.tokens,
                "{name} prompt {i} k={k} {proposer:?}: speculative differs from the target alone"
            );
            runs += 1;
        }
    }
    eprintln!("{name}: {runs} speculative runs equal to the {to:?} target's own greedy output");
}

#[test]
fn smollm2_q4_1_drafts_for_its_padded_f16_copy() {
    let prompts = [
        "def quicksort(items):\n",
        "The three primary colors are",
        "fn main() {\n    let v = vec![1, 2, 3];\n",
    ]
    .map(String::from);
    check_pair("smollm2", GgmlDType::F16, 64, &prompts, 24);
}

#[test]
fn gemma3_270m_drafts_for_its_bf16_copy_past_the_sliding_window() {
    // ~700 tokens of varied code: local layers drop the start of it.
    let long: String = (0..40)
        .map(|i| format!("def step_{i}(x):\n    return x * {} + {}\n\n", i + 2, i * 7))
        .collect();
    let prompts = [
        "The capital of France is".to_string(),
        "import numpy as np\n\ndef mean(xs):\n".to_string(),
        long,
    ];
    check_pair("gemma", GgmlDType::BF16, 0, &prompts, 20);
}
