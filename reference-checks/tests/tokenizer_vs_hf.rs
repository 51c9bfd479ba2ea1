//! Differential test: our tokenizer against Hugging Face `tokenizers` built by
//! candle's `TokenizerFromGguf` from the same GGUF — an independent BPE and
//! added-token implementation. On NFC text without special-token strings the
//! two must agree id for id (candle adds an NFC normalizer, like Qwen's
//! tokenizer.json; llama.cpp and we do not normalise, so only NFC input is a
//! fair comparison).

#![allow(clippy::unwrap_used)]

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use tandem_model::gguf::GgufFile;
use tandem_model::tokenizer::Tokenizer;

fn corpus() -> Vec<String> {
    let mut texts: Vec<String> = [
        "Hello, world!",
        "fn main() {\n    println!(\"héllo wörld\");\n}\n",
        "端侧大模型推理需要平衡精度、内存和功耗。我们在手机上运行草稿模型。",
        "日本語のテキストとカタカナ、ひらがな。한국어 문장도 있습니다.",
        "Привет, мир! Ελληνικά κείμενα. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया",
        "Emoji 😀🚀🧑‍💻👨‍👩‍👧 flags 🇨🇳🇺🇸 math ∑∫√≈≠ ≤≥ ∞",
        "   \t\n\n  \r\n trailing spaces    \n\n\n\n    ",
        "It's we'LL THEY'RE you'Ve I'M she'D don'T",
        "0x1F 1e-9 3.14159 -42 1,000,000 ١٢٣ ④ Ⅻ",
        "a\u{a0}b\u{2003}c\u{3000}d\u{200b}e\u{feff}f",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "SELECT * FROM t WHERE x = 'a@b.com' AND y <> 3; -- comment",
        "https://example.com/path?query=1&b=2#frag <a href=\"x\">link</a>",
        "$$\\frac{a}{b} + \\sqrt{x^2}$$ `code` **bold** _it_",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // Real-world text: the model crate's own sources and docs.
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../model/src");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    files.sort();
    for f in files {
        texts.push(std::fs::read_to_string(f).unwrap());
    }
    texts
}

#[test]
fn agrees_with_hf_tokenizers_on_nfc_text() {
    let path = tandem_fetch::model_path(tandem_fetch::ModelRole::Draft);
    assert!(
        path.exists(),
        "model file {} is missing: run `tandem models fetch`",
        path.display()
    );
    let ours = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let content = Content::read(&mut std::fs::File::open(&path).unwrap()).unwrap();
    let hf = tokenizers::Tokenizer::from_gguf(&content).unwrap();

    let mut total = 0;
    let mut bytes = 0;
    let (mut ours_t, mut hf_t) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
    for text in corpus() {
        // Special-token strings are handled differently by design (HF always
        // splits them; we only with parse_special), so defuse them.
        let text = text.replace("<|", "< |").replace("[PAD", "[ PAD");
        let t0 = std::time::Instant::now();
        let a = ours.encode(&text, false).unwrap();
        let t1 = std::time::Instant::now();
        let b = hf.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        ours_t += t1 - t0;
        hf_t += t1.elapsed();
        bytes += text.len();
        if a != b {
            let first = a
                .iter()
                .zip(&b)
                .position(|(x, y)| x != y)
                .unwrap_or(a.len().min(b.len()));
            let lo = first.saturating_sub(3);
            panic!(
                "mismatch at token {first} in text starting {:?}\n ours {:?} = {:?}\n hf   {:?} = {:?}",
                &text.chars().take(60).collect::<String>(),
                &a[lo..(first + 3).min(a.len())],
                ours.decode(&a[lo..(first + 3).min(a.len())], false).unwrap(),
                &b[lo..(first + 3).min(b.len())],
                hf.decode(&b[lo..(first + 3).min(b.len())], false).unwrap(),
            );
        }
        assert_eq!(ours.decode(&a, false).unwrap(), text);
        assert_eq!(hf.decode(&b, false).unwrap(), text);
        total += a.len();
    }
    eprintln!(
        "compared {total} tokens ({bytes} bytes); encode time: ours {:.1} ms, HF {:.1} ms",
        ours_t.as_secs_f64() * 1e3,
        hf_t.as_secs_f64() * 1e3
    );
    assert!(total > 5_000, "corpus too small: {total} tokens");
}
