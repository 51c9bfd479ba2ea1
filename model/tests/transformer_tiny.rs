//! The transformer on tiny random models: batch invariance, rollback, layer
//! ranges and error handling. Fast; no model files needed.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use tandem_model::arch::Arch;
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::transformer::{LoadOptions, Model};
use tandem_model::ModelError;

fn tiny(cfg: &TinyConfig) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_tiny_qwen2(&path, cfg).unwrap();
    let m = Model::load(&path, LoadOptions::with_max_seq_len(128)).unwrap();
    (dir, m)
}

fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

/// Logits of every position, computing the sequence in blocks of `block`.
fn logits_in_blocks(m: &Model, toks: &[u32], block: usize) -> Vec<f32> {
    let mut cache = m.new_cache();
    let mut out = Vec::new();
    let mut pos = 0;
    for chunk in toks.chunks(block) {
        out.extend(m.forward(chunk, pos, &mut cache).unwrap());
        pos += chunk.len();
    }
    out
}

fn assert_bits_eq(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}: element {i}: {x} vs {y}");
    }
}

/// The Qwen2 target- and draft-like mixes and one tiny model of every other
/// family (Gemma 3's with local layers whose window of 8 the 40 tokens pass).
fn every_family() -> Vec<TinyConfig> {
    let mut cfgs = vec![TinyConfig::default(), TinyConfig::draft_like()];
    cfgs.extend(
        Arch::ALL
            .into_iter()
            .filter(|a| *a != Arch::Qwen2)
            .map(TinyConfig::for_arch),
    );
    cfgs
}

#[test]
fn logits_are_bit_identical_across_block_sizes() {
    for cfg in every_family() {
        let (_d, m) = tiny(&cfg);
        let toks = tokens(40, cfg.vocab);
        let one = logits_in_blocks(&m, &toks, 1);
        assert!(one.iter().all(|x| x.is_finite()));
        for block in [2, 3, 5, 8, 16, 40] {
            let b = logits_in_blocks(&m, &toks, block);
            let what = format!("{} {:?} block {block}", cfg.arch, cfg.matrix_format);
            assert_bits_eq(&one, &b, &what);
        }
    }
}

#[test]
fn logits_depend_on_context() {
    // Guard against a degenerate model that would make invariance trivial.
    let (_d, m) = tiny(&TinyConfig::default());
    let mut c1 = m.new_cache();
    let mut c2 = m.new_cache();
    let a = m.forward(&[1, 2, 3], 0, &mut c1).unwrap();
    let b = m.forward(&[9, 2, 3], 0, &mut c2).unwrap();
    let v = m.config().vocab;
    assert_ne!(
        a[2 * v..],
        b[2 * v..],
        "last position must see the first token"
    );
}

#[test]
fn truncate_rolls_back_exactly() {
    for cfg in every_family() {
        truncate_rolls_back_exactly_for(&cfg);
    }
}

fn truncate_rolls_back_exactly_for(cfg: &TinyConfig) {
    let (_d, m) = tiny(cfg);
    let v = m.config().vocab;
    let mut cache = m.new_cache();
    m.forward(&[5, 6, 7, 8], 0, &mut cache).unwrap();
    // A rejected draft: append 3 tokens, then roll back to 4.
    m.forward(&[100, 101, 102], 4, &mut cache).unwrap();
    cache.truncate(4);
    assert_eq!(cache.len(), 4);
    let after = m.forward(&[9], 4, &mut cache).unwrap();
    let mut fresh = m.new_cache();
    let all = m.forward(&[5, 6, 7, 8, 9], 0, &mut fresh).unwrap();
    assert_bits_eq(&after, &all[4 * v..], "after rollback");
}

#[test]
fn layer_ranges_compose_to_the_full_forward() {
    for arch in Arch::ALL {
        // Gemma 3's seven: local and global layers on both sides of a split.
        let (_d, m) = tiny(&TinyConfig {
            n_layer: if arch == Arch::Gemma3 { 7 } else { 3 },
            ..TinyConfig::for_arch(arch)
        });
        let n = m.config().n_layer;
        // Past Gemma's window of 8, so local layers drop positions.
        let toks = tokens(13, m.config().vocab);
        let mut c = m.new_cache();
        let full = m.forward(&toks, 0, &mut c).unwrap();
        for split in 0..=n {
            let mut c = m.new_cache();
            let mut h = m.embed(&toks).unwrap();
            m.forward_layers(0..split, &mut h, 0, &mut c).unwrap();
            m.forward_layers(split..n, &mut h, 0, &mut c).unwrap();
            assert_bits_eq(&full, &m.head(&h), &format!("{arch} split {split}"));
        }
    }
}

#[test]
fn local_layers_see_only_their_window() {
    // Two Gemma 3 layers, both local (every 6th layer is global), window 8:
    // the last position sees tokens back to 2 · (8 - 1) positions before it,
    // and nothing earlier, bit for bit.
    let cfg = TinyConfig {
        n_layer: 2,
        ..TinyConfig::for_arch(Arch::Gemma3)
    };
    let (_d, m) = tiny(&cfg);
    let v = m.config().vocab;
    let toks = tokens(30, v);
    let last = |toks: &[u32]| {
        let mut c = m.new_cache();
        m.forward_last(toks, 0, &mut c).unwrap()
    };
    let reference = last(&toks);
    let reach = 29 - 2 * 7; // the earliest position the last one sees
    for early in 0..reach {
        let mut changed = toks.clone();
        changed[early] = (changed[early] + 1) % v as u32;
        assert_bits_eq(
            &reference,
            &last(&changed),
            &format!("token {early} changed"),
        );
    }
    // A token inside the window does change the result (the test can fail).
    let mut changed = toks.clone();
    changed[reach] = (changed[reach] + 1) % v as u32;
    assert_ne!(
        reference,
        last(&changed),
        "token {reach} is inside the reach"
    );
}

#[test]
fn forward_last_matches_forward() {
    let (_d, m) = tiny(&TinyConfig::default());
    let v = m.config().vocab;
    let toks = tokens(9, v);
    let mut c1 = m.new_cache();
    let all = m.forward(&toks, 0, &mut c1).unwrap();
    let mut c2 = m.new_cache();
    let last = m.forward_last(&toks, 0, &mut c2).unwrap();
    assert_bits_eq(&all[8 * v..], &last, "last row");
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let (_d, m) = tiny(&TinyConfig::default());
    let mut c = m.new_cache();
    let v = m.config().vocab as u32;
    assert!(matches!(
        m.forward(&[v], 0, &mut c),
        Err(ModelError::TokenOutOfRange { .. })
    ));
    assert!(matches!(
        m.forward(&[], 0, &mut c),
        Err(ModelError::InvalidArgument(_))
    ));
    // Wrong start position.
    assert!(matches!(
        m.forward(&[1], 3, &mut c),
        Err(ModelError::InvalidArgument(_))
    ));
    // Longer than the cache.
    let long = tokens(129, v as usize);
    assert!(matches!(
        m.forward(&long, 0, &mut c),
        Err(ModelError::SequenceTooLong {
            needed: 129,
            capacity: 128
        })
    ));
    assert!(m
        .forward_layers(0..9, &mut vec![0.0; 256], 0, &mut c)
        .is_err());
}

#[test]
fn corrupt_and_foreign_files_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.gguf");
    assert!(matches!(
        Model::load(&missing, LoadOptions::default()),
        Err(ModelError::NotFound(_))
    ));
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"definitely not a gguf file").unwrap();
    let e = Model::load(&junk, LoadOptions::default()).unwrap_err();
    assert!(matches!(e, ModelError::BadGguf { .. }), "{e}");
    // Truncated: a valid file cut in half.
    let good = dir.path().join("good.gguf");
    write_tiny_qwen2(&good, &TinyConfig::default()).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = Model::load(&cut, LoadOptions::default()).unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");
}

#[test]
fn unknown_architecture_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.gguf");
    write_tiny_qwen2(&good, &TinyConfig::default()).unwrap();
    let mut bytes = std::fs::read(&good).unwrap();
    // Rewrite the value of general.architecture ("qwen2" -> "mamba", same length).
    let key = b"general.architecture";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap();
    let val = at + bytes[at..].windows(5).position(|w| w == b"qwen2").unwrap();
    bytes[val..val + 5].copy_from_slice(b"mamba");
    let other = dir.path().join("mamba.gguf");
    std::fs::write(&other, bytes).unwrap();
    let e = Model::load(&other, LoadOptions::default()).unwrap_err();
    assert!(
        matches!(e, ModelError::UnsupportedArchitecture(ref a) if a == "mamba"),
        "{e}"
    );
    // The refusal names what is unsupported and what is.
    let msg = e.to_string();
    assert!(
        msg.contains("mamba") && msg.contains("qwen3, llama, gemma3"),
        "{msg}"
    );
}
