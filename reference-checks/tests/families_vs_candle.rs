//! Every family's forward against candle-transformers' quantized reference
//! (`quantized_qwen2`, `quantized_qwen3`, `quantized_llama`,
//! `quantized_gemma3`) on tiny random-weight GGUFs the test writes: the same
//! file through two independent implementations gives the same logits within
//! a float tolerance. A wrong RoPE pairing, a missing norm, a wrong
//! activation or embedding scale moves the logits by far more. Fast; no
//! model files needed.
//!
//! One exception: candle-transformers 0.11's `quantized_gemma3` gates its FFN
//! with SiLU, where Gemma 3 (Hugging Face's `gelu_pytorch_tanh`, llama.cpp's
//! `LLM_FFN_GELU`) uses GELU. For Gemma 3 the test therefore zeroes every
//! `ffn_down` in the file, so the FFN adds nothing on either side and
//! everything else is compared (embedding scale, q/k norms, post-norms,
//! local and global RoPE, tied output). The GELU itself is checked against
//! llama.cpp on the real Gemma 3 270M (`families_real.rs`).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use tandem_model::arch::Arch;
use tandem_model::testing::{write_tiny_model, TinyConfig};
use tandem_model::transformer::{LoadOptions, Model};

/// The last position's logits from candle-transformers for `arch`.
fn candle_last_logits(path: &std::path::Path, arch: Arch, tokens: &[u32]) -> Vec<f32> {
    use candle_transformers::models as m;
    let dev = Device::Cpu;
    let mut file = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let input = Tensor::new(tokens, &dev).unwrap().unsqueeze(0).unwrap();
    let out = match arch {
        Arch::Qwen2 => m::quantized_qwen2::ModelWeights::from_gguf(content, &mut file, &dev)
            .unwrap()
            .forward(&input, 0),
        Arch::Qwen3 => m::quantized_qwen3::ModelWeights::from_gguf(content, &mut file, &dev)
            .unwrap()
            .forward(&input, 0),
        Arch::Llama => m::quantized_llama::ModelWeights::from_gguf(content, &mut file, &dev)
            .unwrap()
            .forward(&input, 0),
        Arch::Gemma3 => m::quantized_gemma3::ModelWeights::from_gguf(content, &mut file, &dev)
            .unwrap()
            .forward(&input, 0),
    }
    .unwrap();
    out.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// Overwrite the bytes of the tensors `which` selects with zeros (every
/// format's all-zero block is zero: its scales are 0).
fn zero_tensors(path: &std::path::Path, which: impl Fn(&str) -> bool) {
    let spans: Vec<(usize, usize)> = {
        let g = tandem_model::gguf::GgufFile::open(path).unwrap();
        g.tensors
            .iter()
            .filter(|(name, _)| which(name))
            .map(|(_, e)| (e.offset, e.len))
            .collect()
    };
    assert!(!spans.is_empty());
    let mut bytes = std::fs::read(path).unwrap();
    for (offset, len) in spans {
        bytes[offset..offset + len].fill(0);
    }
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn every_family_matches_candle_transformers() {
    for arch in Arch::ALL {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        let cfg = TinyConfig::for_arch(arch);
        write_tiny_model(&path, &cfg).unwrap();
        if arch == Arch::Gemma3 {
            zero_tensors(&path, |name| name.ends_with("ffn_down.weight"));
        }
        let ours = Model::load(&path, LoadOptions::with_max_seq_len(64)).unwrap();
        // Shorter than Gemma's tiny window (8): candle's sliding-window mask
        // keeps one position more than llama.cpp's, and none when decoding.
        let tokens: Vec<u32> = (0..7).map(|i| (i * 53 + 11) % cfg.vocab as u32).collect();
        let mut cache = ours.new_cache();
        let a = ours.forward_last(&tokens, 0, &mut cache).unwrap();
        let b = candle_last_logits(&path, arch, &tokens);
        assert_eq!(a.len(), b.len(), "{arch}: logits width");
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        // Both quantize activations to 8 bits per block and sum in other
        // orders; through a few tiny layers that stays within a few percent
        // of the largest logit.
        assert!(
            diff <= 0.03 * scale,
            "{arch}: max |ours - candle| = {diff} for logits up to {scale}"
        );
        let argmax = |v: &[f32]| {
            v.iter().enumerate().fold(
                (0, f32::MIN),
                |(bi, bv), (i, &x)| if x > bv { (i, x) } else { (bi, bv) },
            )
        };
        let ((ia, _), (ib, _)) = (argmax(&a), argmax(&b));
        let gap = a[ia] - a[ib];
        assert!(
            ia == ib || gap < 2.0 * diff,
            "{arch}: argmax {ia} vs {ib}, gap {gap}"
        );
        eprintln!("{arch}: max diff {diff:.5} of {scale:.3}");
    }
}
