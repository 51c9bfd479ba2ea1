//! The model core on the real Qwen2.5-Coder pair: batch invariance bit for bit
//! (the cross-check against candle-transformers is in
//! `reference-checks/tests/real_vs_candle.rs`).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use tandem_fetch::ModelRole;
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

/// The target with its Q4_K/Q6_K matrices also in the tile layout (the
/// default where the AMX kernels run) gives the logits of the file's layout
/// alone, bit for bit, in blocks of 2 and 16 rows (both AMX thresholds'
/// sides on an AMX machine; elsewhere the layout is held and unused).
#[test]
fn the_tile_layout_gives_the_mapped_logits_bit_for_bit() {
    let tok = tokenizer();
    let toks = &prompt_64(&tok)[..32];
    let path = model_file(ModelRole::Target);
    let opts = |tiles| LoadOptions {
        tiles,
        ..LoadOptions::with_max_seq_len(64)
    };
    let mapped = Model::load(&path, opts(false)).unwrap();
    let tiled = Model::load(&path, opts(true)).unwrap();
    assert_eq!(mapped.tile_bytes(), 0);
    assert!(tiled.tile_bytes() > 0, "no matrix in the tile layout");
    for block in [2, 16] {
        let a = logits_in_blocks(&mapped, toks, block);
        let b = logits_in_blocks(&tiled, toks, block);
        let diff = a
            .iter()
            .zip(&b)
            .position(|(x, y)| x.to_bits() != y.to_bits());
        assert_eq!(diff, None, "block {block}: first differing logit");
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
