//! Tokenizer encode/decode. Invariants: `decode(encode(s)) == s` for every
//! valid UTF-8 `s` (with and without parsing control tokens); any id sequence
//! decodes without a panic (out-of-range ids are an `Err`); the streaming
//! decoder's chunks plus its flush equal `decode` of the same ids.
//!
//! The tokenizer is the real one when `TANDEM_FUZZ_TOKENIZER` names a GGUF
//! (CI points it at the draft model), else the tiny test vocabulary.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use tandem_model::gguf::GgufFile;
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::tokenizer::Tokenizer;

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let (path, scratch) = match std::env::var_os("TANDEM_FUZZ_TOKENIZER") {
            Some(p) => (p.into(), false),
            None => {
                let p = std::env::temp_dir()
                    .join(format!("tandem-fuzz-tok-{}.gguf", std::process::id()));
                let cfg = TinyConfig {
                    n_layer: 1,
                    tokenizer: true,
                    ..TinyConfig::draft_like()
                };
                write_tiny_qwen2(&p, &cfg).expect("writing the tiny tokenizer");
                (p, true)
            }
        };
        let gguf = GgufFile::open(&path).expect("opening the tokenizer GGUF");
        let tok = Tokenizer::from_gguf(&gguf).expect("building the tokenizer");
        if scratch {
            // The tokenizer owns its tables: leave nothing in /tmp.
            let _ = std::fs::remove_file(&path);
        }
        tok
    })
}

fn stream_decode(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> String {
    let mut dec = tok.stream_decoder(skip_special);
    let mut out: String = ids.iter().filter_map(|&id| dec.push(id)).collect();
    out.extend(dec.flush());
    out
}

fuzz_target!(|data: &[u8]| {
    let tok = tokenizer();
    if let Ok(s) = std::str::from_utf8(data) {
        for parse_special in [false, true] {
            let ids = tok.encode(s, parse_special).expect("encode");
            let back = tok.decode(&ids, false).expect("decode of encoded ids");
            assert_eq!(back, s, "round trip (parse_special {parse_special})");
            assert_eq!(stream_decode(tok, &ids, false), s, "stream round trip");
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
});
