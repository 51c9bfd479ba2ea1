//! The model core on the real Qwen2.5-Coder pair: batch invariance bit for bit,
//! and a cross-check against candle-transformers' `quantized_qwen2`.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_qwen2::ModelWeights;
use common::*;
use tandem_fetch::ModelRole;
use tandem_model::sampling::argmax;
use tandem_model::transformer::{LoadOptions, Model};

const ROLES: [ModelRole; 2] = [ModelRole::Draft, ModelRole::Target];

fn prompt_64(tok: &tandem_model::tokenizer::Tokenizer) -> Vec<u32> {
    let text = "fn main() {\n    let xs: Vec<u64> = (1..=20).map(|x| x * x).collect();\n    \
                println!(\"sum = {}\", xs.iter().sum::<u64>());\n}\n// 这段代码计算平方和。 \
                Explain it, then rewrite it with a for loop and add error handling for overflow.";
    let ids = tok.encode(text, false).unwrap();
    assert!(ids.len() >= 64, "prompt has {} tokens", ids.len());
    ids[..64].to_vec()
}

fn logits_in_blocks(m: &Model, toks: &[u32], block: usize) -> Vec<f32> {
    let mut cache = m.new_cache();
    let mut out = Vec::with_capacity(toks.len() * m.config().vocab);
    let mut pos = 0;
    for chunk in toks.chunks(block) {
        out.extend(m.forward(chunk, pos, &mut cache).unwrap());
        pos += chunk.len();
    }
    out
}

#[test]
fn real_logits_are_bit_identical_across_block_sizes() {
    let tok = tokenizer();
    let toks = prompt_64(&tok);
    for role in ROLES {
        let m = load(role, 256);
        let one = logits_in_blocks(&m, &toks, 1);
        for block in [3, 5, 8, 16] {
            let b = logits_in_blocks(&m, &toks, block);
            let diff = one
                .iter()
                .zip(&b)
                .position(|(x, y)| x.to_bits() != y.to_bits());
            assert_eq!(
                diff, None,
                "{role:?}: block {block} differs at element {diff:?}"
            );
        }
    }
}

/// The draft's Q5_0 matrices regrouped at load time (the default on AVX2)
/// give the logits of the mapped GGUF layout, bit for bit, token by token and
/// in blocks.
#[test]
fn regrouped_q5_0_matrices_give_the_mapped_logits_bit_for_bit() {
    let tok = tokenizer();
    let toks = prompt_64(&tok);
    let path = model_file(ModelRole::Draft);
    let opts = |repack| LoadOptions {
        repack,
        ..LoadOptions::with_max_seq_len(128)
    };
    let mapped = Model::load(&path, opts(false)).unwrap();
    let packed = Model::load(&path, opts(true)).unwrap();
    assert_eq!(mapped.regrouped(), (0, 0));
    let (n, bytes) = packed.regrouped();
    // 24 layers: attn_q/k/output and ffn_gate/up are Q5_0, attn_v sometimes.
    assert!(n >= 24 * 5, "only {n} matrices regrouped");
    eprintln!(
        "draft: {n} matrices regrouped, {:.1} MB",
        bytes as f64 / 1e6
    );
    for block in [1, 8] {
        let a = logits_in_blocks(&mapped, &toks, block);
        let b = logits_in_blocks(&packed, &toks, block);
        let diff = a
            .iter()
            .zip(&b)
            .position(|(x, y)| x.to_bits() != y.to_bits());
        assert_eq!(diff, None, "block {block}: first differing logit");
    }
}

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

/// Prompts and greedy steps per model of the candle comparison: 2 × 40 (it
/// was 5 × 64, then 3 × 40; candle's step-by-step decode of the 1.5B made
/// this the slowest test in CI, and 80 steps per model still catch a
/// systematic divergence).
const PROMPTS: usize = 2;
const STEPS: usize = 40;

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
        // Measured on this machine kind (2026-11-29, 5 prompts × 64 steps):
        // 3/320 (draft) and 4/320 (target), every one a near-tie; 3 × 40
        // (2026-12-06) 0/120 and 1/120. The bound (3 in 80 steps, under 4 %)
        // catches a systematic divergence (a real bug flips far more tokens
        // than that).
        assert!(
            total_disagree <= 3,
            "{role:?}: {total_disagree} greedy disagreements in {steps} steps"
        );
    }
}

/// The real target in mixed-session batches of 24, 40 and 64 rows (the sizes
/// the verifier's scheduler produces: verify blocks of several sessions and
/// prefill chunks, each session at its own position over paged KV): every
/// session's logits equal its forward alone on a contiguous cache, bit for bit.
#[test]
fn real_target_mixed_session_batches_of_24_40_64_rows_match_each_session_alone() {
    use tandem_model::kv_pages::{KvPool, PagedKv};
    use tandem_model::transformer::{BatchSeq, Logits};
    let tok = tokenizer();
    let toks = prompt_64(&tok);
    let m = load(ModelRole::Target, 256);
    let c = m.config();
    let pool = KvPool::new(c.n_layer, c.n_kv_head, c.head_dim, 1 << 30);
    // (prefix length, rows in the batch) per session; rows sum to 24, 40, 64.
    let mixes: [&[(usize, usize)]; 3] = [
        &[(3, 5), (10, 5), (0, 9), (7, 5)],
        &[(2, 17), (9, 5), (20, 1), (5, 8), (12, 9)],
        &[(1, 17), (6, 17), (4, 5), (15, 9), (0, 16)],
    ];
    for mix in mixes {
        let rows: usize = mix.iter().map(|&(_, n)| n).sum();
        let seqs: Vec<(&[u32], &[u32])> = mix
            .iter()
            .enumerate()
            .map(|(i, &(p, n))| {
                let s = &toks[i..];
                (&s[..p], &s[p..p + n])
            })
            .collect();
        let mut kvs: Vec<PagedKv> = seqs
            .iter()
            .map(|(p, r)| {
                let mut kv = PagedKv::new(pool.clone(), 256);
                kv.reserve(p.len() + r.len()).unwrap();
                if !p.is_empty() {
                    m.forward_last(p, 0, &mut kv).unwrap();
                }
                kv
            })
            .collect();
        let mut batch: Vec<BatchSeq<'_, PagedKv>> = seqs
            .iter()
            .zip(kvs.iter_mut())
            .map(|((p, r), kv)| BatchSeq {
                tokens: r,
                start_pos: p.len(),
                cache: kv,
                logits: Logits::All,
            })
            .collect();
        let got = m.forward_batch(&mut batch).unwrap();
        for (i, ((p, r), g)) in seqs.iter().zip(&got).enumerate() {
            let mut alone = m.new_cache();
            if !p.is_empty() {
                m.forward_last(p, 0, &mut alone).unwrap();
            }
            let want = m.forward(r, p.len(), &mut alone).unwrap();
            let diff = want
                .iter()
                .zip(g)
                .position(|(x, y)| x.to_bits() != y.to_bits());
            assert_eq!(
                diff, None,
                "{rows}-row batch: session {i} differs at element {diff:?}"
            );
        }
    }
}
