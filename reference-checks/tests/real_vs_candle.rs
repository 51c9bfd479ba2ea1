//! The model core against candle-transformers' `quantized_qwen2` on the real
//! Qwen2.5-Coder pair: greedy decoding of both implementations, fed the same
//! tokens, agrees except at near-ties.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

#[path = "../../model/tests/common/mod.rs"]
mod common;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_qwen2::ModelWeights;
use common::*;
use tandem_fetch::ModelRole;
use tandem_model::sampling::argmax;
use tandem_model::transformer::Model;

const ROLES: [ModelRole; 2] = [ModelRole::Draft, ModelRole::Target];

struct CandleModel {
    w: ModelWeights,
}

impl CandleModel {
    fn load(role: ModelRole) -> Self {
        let path = model_file(role);
        let mut f = std::fs::File::open(path).unwrap();
        let ct = gguf_file::Content::read(&mut f).unwrap();
        let w = ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap();
        Self { w }
    }
    /// Logits of the last position of `toks` at `pos`.
    fn step(&mut self, toks: &[u32], pos: usize) -> Vec<f32> {
        let x = Tensor::new(toks, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let l = self.w.forward(&x, pos).unwrap();
        l.squeeze(0).unwrap().to_vec1::<f32>().unwrap()
    }
}

/// Greedy decode with both implementations, feeding our token to both so a
/// near-tie does not derail the rest of the comparison. Returns (max abs logit
/// diff, argmax disagreements with the gap between the two candidates in our
/// logits).
fn cross_check(
    ours: &Model,
    theirs: &mut CandleModel,
    prompt: &[u32],
    n: usize,
) -> (f32, Vec<(usize, f32)>) {
    theirs.w.clear_kv_cache();
    let mut cache = ours.new_cache();
    let mut a = ours.forward_last(prompt, 0, &mut cache).unwrap();
    let mut b = theirs.step(prompt, 0);
    let mut max_diff = 0f32;
    let mut disagreements = Vec::new();
    for i in 0..n {
        for (x, y) in a.iter().zip(&b) {
            max_diff = max_diff.max((x - y).abs());
        }
        let (ta, tb) = (argmax(&a), argmax(&b));
        if ta != tb {
            disagreements.push((i, (a[ta as usize] - a[tb as usize]).abs()));
        }
        let pos = cache.len();
        a = ours.forward(&[ta], pos, &mut cache).unwrap();
        b = theirs.step(&[ta], pos);
    }
    (max_diff, disagreements)
}

/// Prompts and greedy steps per model of the candle comparison: 2 × 24 (it
/// was 5 × 64, then 3 × 40, then 2 × 40; candle's step-by-step decode of the
/// 1.5B made this one of the slowest tests in CI). A systematic divergence
/// (RoPE, attention, a kernel) moves the logits by far more than the bound
/// below at the first steps already, and 48 steps per model still bound the
/// near-tie disagreements.
const PROMPTS: usize = 2;
const STEPS: usize = 24;
/// Greedy disagreements allowed per model (every one a near-tie): measured
/// 3/320 and 4/320 (5 × 64), 0/120 and 1/120 (3 × 40); 2 in 48 steps
/// (about 4 %, the rate the bound of 3 in 80 allowed) catches a systematic
/// divergence, which flips far more tokens.
const MAX_DISAGREEMENTS: usize = 2;

#[test]
fn greedy_tokens_match_candle_transformers() {
    let tok = tokenizer();
    let prompts = prompts();
    for role in ROLES {
        let ours = load(role, 512);
        let mut theirs = CandleModel::load(role);
        let mut worst = 0f32;
        let mut total_disagree = 0;
        for p in prompts.iter().take(PROMPTS) {
            let ids = chat_tokens(&tok, &p.text);
            let (diff, dis) = cross_check(&ours, &mut theirs, &ids, STEPS);
            worst = worst.max(diff);
            // Both implementations quantize activations the same way (Q8_K /
            // Q8_0) but differ in float details: summation orders in the
            // kernels, attention and softmax, and candle computes RoPE angles in
            // f32 (we use f64). Through 24–28 layers that compounds to logit
            // differences of up to ~0.9 (measured max 0.87 on logits of order
            // 10–30). A disagreement on the greedy token is only acceptable
            // where the two candidates are that close in our own logits (a
            // near-tie, gap < 0.25), where either choice is numerically valid.
            for (step, gap) in &dis {
                assert!(
                    *gap < 0.25,
                    "{role:?} prompt {}: step {step}: argmax differs but the candidates are {gap} apart",
                    p.id
                );
            }
            total_disagree += dis.len();
            eprintln!(
                "{role:?} {}: max |Δlogit| = {diff:.4}, near-tie disagreements {}",
                p.id,
                dis.len()
            );
        }
        let steps = PROMPTS * STEPS;
        eprintln!(
            "{role:?}: worst max |Δlogit| = {worst:.4}, disagreements {total_disagree}/{steps}"
        );
        assert!(worst < 1.0, "{role:?}: logits differ by {worst}");
        assert!(
            total_disagree <= MAX_DISAGREEMENTS,
            "{role:?}: {total_disagree} greedy disagreements in {steps} steps"
        );
    }
}
