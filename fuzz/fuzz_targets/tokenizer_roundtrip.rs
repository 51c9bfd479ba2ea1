//! Tokenizer encode/decode, for both vocabulary models (byte-level BPE and
//! SentencePiece). Invariants: `decode(encode(s)) == s` for every valid UTF-8
//! `s` (with and without parsing control tokens; SentencePiece decodes a
//! literal `▁` as a space; with its
//! `add_space_prefix`, `" " + s` for text without special-token text);
//! any id sequence decodes without a panic (out-of-range ids are an `Err`);
//! the streaming decoder's chunks plus its flush equal `decode` of the same
//! ids.
//!
//! The BPE tokenizer is the real one when `TANDEM_FUZZ_TOKENIZER` names a GGUF
//! (CI points it at the draft model), else the tiny test vocabulary; the
//! SentencePiece one is the real one when `TANDEM_FUZZ_SPM_TOKENIZER` names a
//! GGUF (Gemma 3), else a tiny vocabulary written here (256 byte-fallback
//! tokens, a few scored pieces, control and user-defined tokens).
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tandem_model::gguf::GgufFile;
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::tokenizer::Tokenizer;

fn load(path: &Path, scratch: bool) -> Tokenizer {
    let gguf = GgufFile::open(path).expect("opening the tokenizer GGUF");
    let tok = Tokenizer::from_gguf(&gguf).expect("building the tokenizer");
    if scratch {
        // The tokenizer owns its tables: leave nothing in /tmp.
        let _ = std::fs::remove_file(path);
    }
    tok
}

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tandem-fuzz-{name}-{}.gguf", std::process::id()))
}

fn bpe() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| match std::env::var_os("TANDEM_FUZZ_TOKENIZER") {
        Some(p) => load(Path::new(&p), false),
        None => {
            let p = scratch("tok");
            let cfg = TinyConfig {
                n_layer: 1,
                tokenizer: true,
                ..TinyConfig::draft_like()
            };
            write_tiny_qwen2(&p, &cfg).expect("writing the tiny tokenizer");
            load(&p, true)
        }
    })
}

fn spm() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| match std::env::var_os("TANDEM_FUZZ_SPM_TOKENIZER") {
        Some(p) => load(Path::new(&p), false),
        None => {
            let p = scratch("spm");
            write_tiny_spm(&p).expect("writing the tiny SentencePiece vocabulary");
            load(&p, true)
        }
    })
}

/// A metadata-only GGUF (v3) with a SentencePiece vocabulary.
fn write_tiny_spm(path: &Path) -> std::io::Result<()> {
    fn s(out: &mut Vec<u8>, v: &str) {
        out.extend((v.len() as u64).to_le_bytes());
        out.extend(v.as_bytes());
    }
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2i32, 3, 3];
    let mut scores = vec![0f32; 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    let pieces = [
        "▁", "a", "b", "e", "é", "▁a", "ab", "▁ab", "ba", "aa", "日", "本", "日本", "▁▁", "\n",
    ];
    for (i, p) in pieces.iter().enumerate() {
        tokens.push(p.to_string());
        types.push(1);
        scores.push(-(i as f32) / 4.0);
    }
    for (t, ty) in [("<start_of_turn>", 3), ("<end_of_turn>", 3), ("<mask>", 4)] {
        tokens.push(t.into());
        types.push(ty);
        scores.push(0.0);
    }
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.extend(5u64.to_le_bytes());
    s(&mut out, "tokenizer.ggml.model");
    out.extend(8u32.to_le_bytes());
    s(&mut out, "llama");
    s(&mut out, "tokenizer.ggml.add_space_prefix");
    out.extend(7u32.to_le_bytes());
    out.push(0);
    s(&mut out, "tokenizer.ggml.tokens");
    out.extend(9u32.to_le_bytes());
    out.extend(8u32.to_le_bytes());
    out.extend((tokens.len() as u64).to_le_bytes());
    for t in &tokens {
        s(&mut out, t);
    }
    s(&mut out, "tokenizer.ggml.token_type");
    out.extend(9u32.to_le_bytes());
    out.extend(5u32.to_le_bytes());
    out.extend((types.len() as u64).to_le_bytes());
    for t in &types {
        out.extend(t.to_le_bytes());
    }
    s(&mut out, "tokenizer.ggml.scores");
    out.extend(9u32.to_le_bytes());
    out.extend(6u32.to_le_bytes());
    out.extend((scores.len() as u64).to_le_bytes());
    for x in &scores {
        out.extend(x.to_le_bytes());
    }
    while out.len() % 32 != 0 {
        out.push(0);
    }
    std::fs::File::create(path)?.write_all(&out)
}

fn stream_decode(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> String {
    let mut dec = tok.stream_decoder(skip_special);
    let mut out: String = ids.iter().filter_map(|&id| dec.push(id)).collect();
    out.extend(dec.flush());
    out
}

fn check(tok: &Tokenizer, data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        // SentencePiece writes spaces as U+2581, so a literal one in the text
        // decodes as a space (as in llama.cpp).
        let s_owned;
        let s = if tok.model() == tandem_model::tokenizer::TokenizerModel::Llama {
            s_owned = text.replace('\u{2581}', " ");
            s_owned.as_str()
        } else {
            text
        };
        let prefixed = format!(" {s}");
        // With a space prefix, text with special-token text gets more
        // spaces (after each one); only the plain case has an exact form.
        let plain_text = !tok.add_space_prefix()
            || (!text.is_empty()
                && tok.encode(text, true).ok() == tok.encode(text, false).ok()
                && tok.encode(text, false).is_ok_and(|ids| {
                    ids.iter().all(|&i| {
                        matches!(
                            tok.token_kind(i),
                            Some(tandem_model::tokenizer::TokenKind::Normal)
                                | Some(tandem_model::tokenizer::TokenKind::Byte)
                        )
                    })
                }));
        for parse_special in [false, true] {
            let ids = tok.encode(text, parse_special).expect("encode");
            let back = tok.decode(&ids, false).expect("decode of encoded ids");
            if !tok.add_space_prefix() {
                assert_eq!(back, s, "round trip (parse_special {parse_special})");
            } else if plain_text {
                assert_eq!(back, prefixed, "round trip with the space prefix");
            }
            assert_eq!(stream_decode(tok, &ids, false), back, "stream round trip");
        }
    }
    // The bytes as ids, mostly inside the vocabulary (a few beyond it).
    let span = tok.vocab_size() as u32 + 8;
    let ids: Vec<u32> = data
        .chunks(2)
        .map(|c| u32::from(u16::from_le_bytes([c[0], *c.get(1).unwrap_or(&0)])) % span)
        .collect();
    for skip_special in [false, true] {
        match tok.decode(&ids, skip_special) {
            Ok(text) => assert_eq!(stream_decode(tok, &ids, skip_special), text),
            Err(_) => assert!(ids.iter().any(|&id| id as usize >= tok.vocab_size())),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    check(bpe(), data);
    check(spm(), data);
});
