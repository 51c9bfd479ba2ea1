//! The tokenizer against llama.cpp's own vocabulary tests
//! (`models/ggml-vocab-*.gguf` with their `.inp` / `.out` files from the
//! llama.cpp source tree: `test-tokenizer-0`, add_special and parse_special
//! off). The vocabulary files are not in this repository (8 MB for
//! llama-bpe); point `TANDEM_LLAMA_VOCAB_DIR` at a llama.cpp `models/`
//! directory (llama-cpp-python's sdist has one in `vendor/llama.cpp/models`)
//! and run with `--ignored`.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use tandem_model::gguf::GgufFile;
use tandem_model::tokenizer::Tokenizer;

fn check(name: &str) {
    let dir = PathBuf::from(
        std::env::var_os("TANDEM_LLAMA_VOCAB_DIR")
            .expect("set TANDEM_LLAMA_VOCAB_DIR to llama.cpp's models/ directory"),
    );
    let gguf = dir.join(format!("ggml-vocab-{name}.gguf"));
    let tok = Tokenizer::from_gguf(&GgufFile::open(&gguf).unwrap()).unwrap();
    let inp = std::fs::read_to_string(gguf.with_extension("gguf.inp")).unwrap();
    let out = std::fs::read_to_string(gguf.with_extension("gguf.out")).unwrap();
    let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let expected: Vec<Vec<u32>> = out
        .lines()
        .map(|l| l.split_whitespace().map(|x| x.parse().unwrap()).collect())
        .collect();
    let mut failures = Vec::new();
    for (text, want) in texts.iter().zip(&expected) {
        let got = tok.encode(text, false).unwrap();
        if &got != want {
            failures.push(format!(
                "{text:?}\n  llama.cpp {want:?}\n  tandem    {got:?}"
            ));
        }
    }
    assert!(expected.len() >= 30, "{} cases", expected.len());
    assert!(
        failures.is_empty(),
        "{name}: {} of {} differ\n{}",
        failures.len(),
        expected.len(),
        failures.join("\n")
    );
}

#[test]
#[ignore = "needs TANDEM_LLAMA_VOCAB_DIR (llama.cpp's models/)"]
fn llama_spm() {
    check("llama-spm");
}

#[test]
#[ignore = "needs TANDEM_LLAMA_VOCAB_DIR (llama.cpp's models/)"]
fn phi_3_spm() {
    check("phi-3");
}

#[test]
#[ignore = "needs TANDEM_LLAMA_VOCAB_DIR (llama.cpp's models/)"]
fn llama_bpe() {
    check("llama-bpe");
}

#[test]
#[ignore = "needs TANDEM_LLAMA_VOCAB_DIR (llama.cpp's models/)"]
fn gpt_2() {
    check("gpt-2");
}

#[test]
#[ignore = "needs TANDEM_LLAMA_VOCAB_DIR (llama.cpp's models/)"]
fn qwen2() {
    check("qwen2");
}

#[test]
#[ignore = "needs TANDEM_LLAMA_VOCAB_DIR (llama.cpp's models/)"]
fn starcoder_smollm_family() {
    check("starcoder");
}

#[test]
#[ignore = "needs TANDEM_LLAMA_VOCAB_DIR (llama.cpp's models/)"]
fn mpt_gpt2_family() {
    check("mpt");
}
