//! Cross-session batching on tiny random models: a sequence's logits are
//! bit-identical whatever other sequences share the forward (and whatever the
//! row count), and paged KV gives the same bits as the contiguous cache.
//! Fast; no model files needed.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use rand::{Rng, SeedableRng};
use tandem_model::arch::Arch;
use tandem_model::kv_cache::KvCache;
use tandem_model::kv_pages::{KvPool, PagedKv};
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::transformer::{BatchSeq, ForwardScratch, LoadOptions, Logits, Model};

const MAX_SEQ: usize = 256;

fn tiny(cfg: &TinyConfig) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_tiny_qwen2(&path, cfg).unwrap();
    let m = Model::load(&path, LoadOptions::with_max_seq_len(MAX_SEQ)).unwrap();
    (dir, m)
}

fn pool(m: &Model) -> std::sync::Arc<KvPool> {
    let c = m.config();
    KvPool::new(c.n_layer, c.n_kv_head, c.head_dim, 64 << 20)
}

fn assert_bits_eq(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}: element {i}: {x} vs {y}");
    }
}

/// One session of a random mix: a context already cached, then `rows` new
/// tokens in the shared forward.
struct Session {
    prefix: Vec<u32>,
    rows: Vec<u32>,
    logits: Logits,
}

fn random_mix(rng: &mut impl Rng, vocab: usize, max_rows: usize) -> Vec<Session> {
    let mut left = max_rows;
    let mut out = Vec::new();
    let want = rng.gen_range(1..=8);
    while out.len() < want && left > 0 {
        // Verify blocks (1..=17 rows), one-token steps and prefill chunks.
        let n = rng.gen_range(1..=left.min(24));
        left -= n;
        let p = rng.gen_range(0..80);
        let tok = |rng: &mut dyn rand::RngCore| rng.gen_range(0..vocab as u32);
        out.push(Session {
            prefix: (0..p).map(|_| tok(rng)).collect(),
            rows: (0..n).map(|_| tok(rng)).collect(),
            logits: match rng.gen_range(0..3) {
                0 => Logits::All,
                1 => Logits::Last,
                _ => Logits::None,
            },
        });
    }
    out
}

/// The reference: the session alone, on a contiguous cache.
fn alone(m: &Model, s: &Session) -> Vec<f32> {
    let mut c = m.new_cache();
    if !s.prefix.is_empty() {
        m.forward_last(&s.prefix, 0, &mut c).unwrap();
    }
    let all = m.forward(&s.rows, s.prefix.len(), &mut c).unwrap();
    let vocab = m.config().vocab;
    match s.logits {
        Logits::All => all,
        Logits::Last => all[all.len() - vocab..].to_vec(),
        Logits::None => Vec::new(),
    }
}

/// The batches run on one [`ForwardScratch`] kept from trial to trial, as the
/// verifier's scheduler keeps it: buffers sized by an earlier, larger batch
/// (with its stale rows) give the same bits as fresh ones.
fn check_random_mixes(cfg: &TinyConfig, trials: usize, seed: u64) {
    let (_d, m) = tiny(cfg);
    let vocab = m.config().vocab;
    let pool = pool(&m);
    let mut scratch = ForwardScratch::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for trial in 0..trials {
        let mix = random_mix(&mut rng, vocab, 64);
        // Prefixes are prefilled in one batch too (logits of none).
        let mut kvs: Vec<PagedKv> = mix
            .iter()
            .map(|s| {
                let mut kv = PagedKv::new(pool.clone(), MAX_SEQ);
                kv.reserve(s.prefix.len() + s.rows.len()).unwrap();
                kv
            })
            .collect();
        let mut prefill: Vec<BatchSeq<'_, PagedKv>> = mix
            .iter()
            .zip(kvs.iter_mut())
            .filter(|(s, _)| !s.prefix.is_empty())
            .map(|(s, kv)| BatchSeq {
                tokens: &s.prefix,
                start_pos: 0,
                cache: kv,
                logits: Logits::None,
            })
            .collect();
        if !prefill.is_empty() {
            let out = m.forward_batch(&mut prefill).unwrap();
            assert!(out.iter().all(Vec::is_empty), "no logits were asked for");
        }
        let mut batch: Vec<BatchSeq<'_, PagedKv>> = mix
            .iter()
            .zip(kvs.iter_mut())
            .map(|(s, kv)| BatchSeq {
                tokens: &s.rows,
                start_pos: s.prefix.len(),
                cache: kv,
                logits: s.logits,
            })
            .collect();
        m.forward_batch_in(&mut scratch, &mut batch, &mut [])
            .unwrap();
        assert!(
            scratch.logits(mix.len()).is_empty(),
            "past the last sequence"
        );
        let rows: usize = mix.iter().map(|s| s.rows.len()).sum();
        for (i, s) in mix.iter().enumerate() {
            let g = scratch.logits(i);
            let what = format!(
                "trial {trial}: session {i} of {} ({} rows in the batch, prefix {}, {} rows, {:?})",
                mix.len(),
                rows,
                s.prefix.len(),
                s.rows.len(),
                s.logits
            );
            assert_bits_eq(g, &alone(&m, s), &what);
        }
    }
    drop(pool);
}

#[test]
fn random_mixed_session_batches_match_each_session_alone_target_like() {
    check_random_mixes(&TinyConfig::default(), 40, 17);
}

#[test]
fn random_mixed_session_batches_match_each_session_alone_draft_like() {
    check_random_mixes(&TinyConfig::draft_like(), 25, 18);
}

#[test]
fn random_mixed_session_batches_match_each_session_alone_every_family() {
    // Gemma 3's tiny windows (8) are far shorter than the prefixes (≤ 80):
    // local layers drop positions in every mix.
    for (i, arch) in [Arch::Qwen3, Arch::Llama, Arch::Gemma3]
        .into_iter()
        .enumerate()
    {
        check_random_mixes(&TinyConfig::for_arch(arch), 8, 30 + i as u64);
    }
}

#[test]
fn paged_kv_gives_the_contiguous_caches_bits_across_page_boundaries() {
    for cfg in [TinyConfig::default(), TinyConfig::for_arch(Arch::Gemma3)] {
        paged_kv_matches_contiguous(&cfg);
    }
}

fn paged_kv_matches_contiguous(cfg: &TinyConfig) {
    let (_d, m) = tiny(cfg);
    let toks: Vec<u32> = (0..70).map(|i| (i * 31 + 5) % 384).collect();
    let pool = pool(&m);
    let mut paged = PagedKv::new(pool.clone(), MAX_SEQ);
    let mut flat: KvCache = m.new_cache();
    // Uneven steps cross the 16-position page boundaries at different offsets.
    let mut pos = 0;
    for step in [1usize, 15, 1, 16, 3, 17, 5, 12] {
        let chunk = &toks[pos..pos + step];
        paged.reserve(pos + step).unwrap();
        let a = m.forward(chunk, pos, &mut paged).unwrap();
        let b = m.forward(chunk, pos, &mut flat).unwrap();
        assert_bits_eq(&a, &b, &format!("step of {step} at {pos}"));
        pos += step;
    }
    // Rollback and shrink: the rows kept are intact, the pool gets pages back.
    paged.truncate(20);
    flat.truncate(20);
    let held = pool.pages_used();
    paged.shrink_to(20);
    assert_eq!(
        pool.pages_used(),
        held - (5 - 2),
        "70 positions in 5 pages, 20 in 2"
    );
    paged.reserve(24).unwrap();
    let a = m.forward(&toks[40..44], 20, &mut paged).unwrap();
    let b = m.forward(&toks[40..44], 20, &mut flat).unwrap();
    assert_bits_eq(&a, &b, "after rollback");
}

#[test]
fn batch_refuses_what_a_sequence_alone_would_refuse_and_changes_nothing() {
    let (_d, m) = tiny(&TinyConfig::default());
    let pool = pool(&m);
    let mut a = PagedKv::new(pool.clone(), MAX_SEQ);
    let mut b = PagedKv::new(pool.clone(), MAX_SEQ);
    a.reserve(4).unwrap();
    // b reserved nothing: its rows have no page.
    let mut batch = vec![
        BatchSeq {
            tokens: &[1, 2, 3],
            start_pos: 0,
            cache: &mut a,
            logits: Logits::All,
        },
        BatchSeq {
            tokens: &[4],
            start_pos: 0,
            cache: &mut b,
            logits: Logits::All,
        },
    ];
    assert!(m.forward_batch(&mut batch).is_err());
    assert_eq!(a.len(), 0, "nothing was written to the other sequence");
    // A token outside the vocabulary anywhere refuses the whole batch.
    b.reserve(1).unwrap();
    let mut batch = vec![
        BatchSeq {
            tokens: &[1],
            start_pos: 0,
            cache: &mut a,
            logits: Logits::All,
        },
        BatchSeq {
            tokens: &[100_000],
            start_pos: 0,
            cache: &mut b,
            logits: Logits::All,
        },
    ];
    assert!(m.forward_batch(&mut batch).is_err());
    assert_eq!((a.len(), b.len()), (0, 0));
}

/// Every K and V row of layers `layers` at positions `0..n`, as bits.
fn kv_bits(kv: &PagedKv, layers: std::ops::Range<usize>, n: usize) -> Vec<u32> {
    use tandem_model::kv_cache::{KvRow, KvStore};
    let mut out = Vec::new();
    for l in layers {
        assert_eq!(kv.layer_len(l), n, "layer {l}");
        for t in 0..n {
            for row in [kv.key(l, t), kv.value(l, t)] {
                match row {
                    KvRow::F32(x) => out.extend(x.iter().map(|v| v.to_bits())),
                    KvRow::F16(_) | KvRow::Int8 { .. } => panic!("paged KV is f32"),
                }
            }
        }
    }
    out
}

/// Issue 31 item 2: a split session's prefill chunk (hidden rows from the
/// device's layers `[0, s)`) joins the shared forward at layer s beside
/// token sessions. The token sessions' logits and the joins' KV are
/// bit-identical to each run alone, whatever the layers and the order given.
#[test]
fn hidden_rows_joining_at_their_layer_match_each_split_forward_alone() {
    use tandem_model::kv_cache::KvStore;
    use tandem_model::transformer::HiddenSeq;
    let cfg = TinyConfig {
        n_layer: 3,
        ..TinyConfig::default()
    };
    let (_d, m) = tiny(&cfg);
    let n_layer = m.config().n_layer;
    let pool = pool(&m);
    let toks: Vec<u32> = (0..60).map(|i| (i * 29 + 3) % 384).collect();
    // A join's input: the device's layers [0, s) over `toks[a..b]` at `a`.
    let device_rows = |s: usize, a: usize, b: usize| {
        let mut dev = m.new_cache();
        let mut h = m.embed(&toks[..b]).unwrap();
        m.forward_layers(0..s, &mut h, 0, &mut dev).unwrap();
        h[a * m.config().d_model..].to_vec()
    };
    // Joins at layers 2, 0, 1 and N (nothing runs), given out of order; the
    // one at layer 1 already holds 20 positions.
    let plan = [
        (2usize, 0usize, 7usize),
        (0, 0, 5),
        (1, 20, 29),
        (n_layer, 0, 4),
    ];
    let mut joined: Vec<PagedKv> = Vec::new();
    let mut alone_kv: Vec<PagedKv> = Vec::new();
    for &(s, a, b) in &plan {
        let mut x = PagedKv::new(pool.clone(), MAX_SEQ);
        let mut y = PagedKv::new(pool.clone(), MAX_SEQ);
        x.reserve(b).unwrap();
        y.reserve(b).unwrap();
        if a > 0 {
            let mut h = device_rows(s, 0, a);
            m.forward_layers(s..n_layer, &mut h, 0, &mut x).unwrap();
            let mut h = device_rows(s, 0, a);
            m.forward_layers(s..n_layer, &mut h, 0, &mut y).unwrap();
        }
        let mut h = device_rows(s, a, b);
        if s < n_layer {
            m.forward_layers(s..n_layer, &mut h, a, &mut y).unwrap();
        }
        joined.push(x);
        alone_kv.push(y);
    }
    let inputs: Vec<Vec<f32>> = plan.iter().map(|&(s, a, b)| device_rows(s, a, b)).collect();
    // Two token sessions beside them: a verify block and a prefill chunk.
    let sessions = [
        Session {
            prefix: toks[..9].to_vec(),
            rows: toks[30..35].to_vec(),
            logits: Logits::All,
        },
        Session {
            prefix: Vec::new(),
            rows: toks[40..52].to_vec(),
            logits: Logits::Last,
        },
    ];
    let mut caches: Vec<PagedKv> = sessions
        .iter()
        .map(|s| {
            let mut c = PagedKv::new(pool.clone(), MAX_SEQ);
            c.reserve(s.prefix.len() + s.rows.len()).unwrap();
            if !s.prefix.is_empty() {
                m.forward_last(&s.prefix, 0, &mut c).unwrap();
            }
            c
        })
        .collect();
    let mut seqs: Vec<BatchSeq<'_, PagedKv>> = sessions
        .iter()
        .zip(caches.iter_mut())
        .map(|(s, c)| BatchSeq {
            tokens: &s.rows,
            start_pos: s.prefix.len(),
            cache: c,
            logits: s.logits,
        })
        .collect();
    let mut joins: Vec<HiddenSeq<'_, PagedKv>> = plan
        .iter()
        .zip(joined.iter_mut())
        .zip(&inputs)
        .map(|((&(s, a, _), kv), h)| HiddenSeq {
            layer: s,
            hidden: h,
            start_pos: a,
            cache: kv,
        })
        .collect();
    let logits = m.forward_batch_joined(&mut seqs, &mut joins).unwrap();
    drop((seqs, joins));
    assert_eq!(
        logits.len(),
        sessions.len(),
        "logits are the token sessions' only"
    );
    for (i, s) in sessions.iter().enumerate() {
        assert_bits_eq(&logits[i], &alone(&m, s), &format!("token session {i}"));
    }
    for (i, &(s, _, b)) in plan.iter().enumerate() {
        if s == n_layer {
            assert_eq!(joined[i].len(), 0, "a join at N runs nothing");
            continue;
        }
        assert_eq!(
            kv_bits(&joined[i], s..n_layer, b),
            kv_bits(&alone_kv[i], s..n_layer, b),
            "join at layer {s}"
        );
        assert_eq!(joined[i].layer_len(0), if s == 0 { b } else { 0 });
    }
    // Joins alone (no token session) run too.
    let h = device_rows(1, 0, 5);
    let mut reference = PagedKv::new(pool.clone(), MAX_SEQ);
    reference.reserve(5).unwrap();
    m.forward_layers(1..n_layer, &mut h.clone(), 0, &mut reference)
        .unwrap();
    let mut x = PagedKv::new(pool.clone(), MAX_SEQ);
    x.reserve(5).unwrap();
    let mut joins = vec![HiddenSeq {
        layer: 1,
        hidden: &h,
        start_pos: 0,
        cache: &mut x,
    }];
    assert!(m
        .forward_batch_joined(&mut [], &mut joins)
        .unwrap()
        .is_empty());
    drop(joins);
    assert_eq!(
        kv_bits(&x, 1..n_layer, 5),
        kv_bits(&reference, 1..n_layer, 5)
    );
    // Nothing at all to run is refused, as by forward_batch.
    assert!(m.forward_batch_joined::<PagedKv>(&mut [], &mut []).is_err());
}
