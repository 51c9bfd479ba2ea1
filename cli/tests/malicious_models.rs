//! Malformed and hostile model files, loaded the way a user loads a model:
//! `tandem generate --mode draft --draft-model FILE` in a child process, so
//! a panic (exit 101) or an abort (a signal) fails the test instead of taking
//! the test binary down. Every case must end in a clean `error: …` (exit 1)
//! that names what is wrong. docs/fuzzing.md lists the cases.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use candle_core::quantized::gguf_file::Value;
use common::tandem;
use std::path::{Path, PathBuf};
use tandem_model::testing::{tiny_tokenizer_metadata, write_tiny_qwen2, TinyConfig};

/// The draft-like tiny model (Q5_0 matrices, block size 32) with its
/// tokenizer, plus `extra` metadata.
fn tiny_model(dir: &Path, name: &str, extra: Vec<(String, Value)>) -> PathBuf {
    let path = dir.join(name);
    let cfg = TinyConfig {
        tokenizer: true,
        extra_metadata: extra,
        ..TinyConfig::draft_like()
    };
    write_tiny_qwen2(&path, &cfg).unwrap();
    path
}

/// Byte position just after the length-prefixed string `s` in a GGUF v3
/// header (a metadata key or a tensor name).
fn after_string(bytes: &[u8], s: &str) -> usize {
    let mut needle = (s.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(s.as_bytes());
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle.as_slice())
        .unwrap_or_else(|| panic!("`{s}` not found in the header"));
    at + needle.len()
}

/// Positions of a tensor directory entry's dims, type and offset fields.
struct TensorInfoAt {
    dims: Vec<usize>,
    dtype: usize,
    offset: usize,
}

fn tensor_info_at(bytes: &[u8], name: &str) -> TensorInfoAt {
    let at = after_string(bytes, name);
    let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let dims: Vec<usize> = (0..n_dims).map(|i| at + 4 + 8 * i).collect();
    let dtype = at + 4 + 8 * n_dims;
    TensorInfoAt {
        dims,
        dtype,
        offset: dtype + 4,
    }
}

fn put_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Rewrite `path` with `mutate` applied to its bytes.
fn mutate(path: &Path, mutate: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).unwrap();
    mutate(&mut bytes);
    std::fs::write(path, bytes).unwrap();
}

fn generate(model: &Path) -> std::process::Output {
    tandem()
        .args(["generate", "--mode", "draft", "--raw", "--prompt", "hi"])
        .args(["--max-tokens", "2", "--max-seq-len", "64", "--draft-model"])
        .arg(model)
        .output()
        .unwrap()
}

/// The load fails cleanly: exit code 1 (not a panic's 101, not a signal)
/// with an error naming `expected`.
fn assert_refused(model: &Path, expected: &[&str]) {
    let out = generate(model);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}: expected a clean error, got {:?}\n{stderr}",
        model.display(),
        out.status
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("error:"), "{stderr}");
    for e in expected {
        assert!(stderr.contains(e), "expected `{e}` in:\n{stderr}");
    }
}

#[test]
fn the_unmodified_tiny_model_generates() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), "ok.gguf", Vec::new());
    let out = generate(&model);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn alignment_zero_or_not_a_power_of_two_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (name, v) in [
        ("zero.gguf", Value::U32(0)),
        ("odd.gguf", Value::U32(24)),
        ("negative.gguf", Value::I32(-32)),
        ("float.gguf", Value::F32(32.0)),
    ] {
        let model = tiny_model(dir.path(), name, vec![("general.alignment".into(), v)]);
        assert_refused(&model, &["general.alignment"]);
    }
}

#[test]
fn dims_whose_size_overflows_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &[u64], &str); 3] = [
        // Q5_0, 44 bytes a row: 2^56 rows fit in 64 bits but not in the file.
        (
            "token_embd.weight",
            &[64, 1 << 56],
            "past the end of the file",
        ),
        // The element count wraps (to 0).
        (
            "token_embd.weight",
            &[1 << 32, 1 << 32],
            "overflow the element count",
        ),
        // F32, 4 bytes an element: 2^62 elements are 2^64 bytes, which wrap to 0.
        ("output_norm.weight", &[1 << 62], "overflow the byte size"),
    ];
    for (i, (tensor, dims, expected)) in cases.into_iter().enumerate() {
        let model = tiny_model(dir.path(), &format!("dims{i}.gguf"), Vec::new());
        mutate(&model, |b| {
            let at = tensor_info_at(b, tensor);
            assert_eq!(at.dims.len(), dims.len());
            for (pos, d) in at.dims.iter().zip(dims) {
                put_u64(b, *pos, *d);
            }
        });
        assert_refused(&model, &[tensor, expected]);
    }
}

#[test]
fn tensor_offsets_past_the_end_or_wrapping_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), "wrap.gguf", Vec::new());
    // Added to the data start, 2^64 - 32 wraps back into the header.
    mutate(&model, |b| {
        let at = tensor_info_at(b, "output.weight");
        put_u64(b, at.offset, u64::MAX - 31);
    });
    assert_refused(&model, &["output.weight", "offset"]);

    let model = tiny_model(dir.path(), "past.gguf", Vec::new());
    mutate(&model, |b| {
        let len = b.len() as u64;
        let at = tensor_info_at(b, "output.weight");
        put_u64(b, at.offset, len);
    });
    assert_refused(&model, &["output.weight", "past the end of the file"]);
}

#[test]
fn truncated_tensor_data_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), "short.gguf", Vec::new());
    mutate(&model, |b| {
        let keep = b.len() - 1000;
        b.truncate(keep);
    });
    assert_refused(&model, &["truncated"]);
}

#[test]
fn block_count_beyond_the_cap_or_the_tensors_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // u32::MAX layers once sized a 1.9 TB allocation (an abort).
    let huge = tiny_model(
        dir.path(),
        "huge.gguf",
        vec![("qwen2.block_count".into(), Value::U32(u32::MAX))],
    );
    assert_refused(&huge, &["qwen2.block_count", "4294967295"]);
    // Under the cap but more layers than the file holds (it has 2).
    let more = tiny_model(
        dir.path(),
        "more.gguf",
        vec![("qwen2.block_count".into(), Value::U32(3))],
    );
    assert_refused(&more, &["qwen2.block_count", "tensors for 2 layers"]);
    // A 64-bit count is not truncated to 32 bits (2^32 + 2 is not 2).
    let wide = tiny_model(
        dir.path(),
        "wide.gguf",
        vec![("qwen2.block_count".into(), Value::U64((1 << 32) + 2))],
    );
    assert_refused(&wide, &["qwen2.block_count", "4294967298"]);
}

#[test]
fn a_vocabulary_that_does_not_match_the_embedding_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let vocab = TinyConfig::default().vocab;
    // A self-consistent tokenizer, one token short of the 384 embedding rows.
    let short = tiny_tokenizer_metadata(vocab - 1).unwrap();
    let model = tiny_model(dir.path(), "vocab.gguf", short);
    assert_refused(
        &model,
        &[
            "`tokenizer.ggml.tokens` has 383 tokens",
            "`token_embd.weight` has 384 rows",
        ],
    );
}

#[test]
fn a_huge_array_length_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), "array.gguf", Vec::new());
    mutate(&model, |b| {
        // key, then u32 value type (array), u32 element type, u64 length.
        let at = after_string(b, "tokenizer.ggml.tokens") + 8;
        put_u64(b, at, 1 << 40);
    });
    assert_refused(&model, &["array", "1099511627776"]);
}

#[test]
fn an_unknown_tensor_type_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), "dtype.gguf", Vec::new());
    mutate(&model, |b| {
        let at = tensor_info_at(b, "output_norm.weight");
        b[at.dtype..at.dtype + 4].copy_from_slice(&99u32.to_le_bytes());
    });
    assert_refused(&model, &["not a valid GGUF file", "99"]);
}
