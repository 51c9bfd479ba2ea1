//! Writes the GGUF seed corpus of the `gguf_load` fuzz target (docs/fuzzing.md):
//! tiny models small enough for the fuzzer to mutate quickly, covering every
//! tensor format the loader reads: Q5_0 / Q8_0 with a tokenizer, Q4_0 / F16 /
//! F32 without one, Q4_1 / Q5_1, and Q3_K / Q5_K matrices with BF16 norms,
//! biases and output head.
//!
//! `cargo run -p tandem-model --example fuzz_seeds -- fuzz/seeds/gguf_load`

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::Device;
use std::path::{Path, PathBuf};
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .ok_or("usage: fuzz_seeds <output directory>")?,
    );
    std::fs::create_dir_all(&dir)?;
    let small = TinyConfig {
        n_layer: 1,
        d_model: 64,
        n_head: 4,
        n_kv_head: 2,
        d_ff: 64,
        vocab: 264,
        ..TinyConfig::draft_like()
    };
    let seeds = [
        (
            "seed-q5_0-q8_0-tokenizer.gguf",
            TinyConfig {
                tokenizer: true,
                ..small.clone()
            },
            false,
        ),
        (
            "seed-q4_0-f16-f32.gguf",
            TinyConfig {
                n_layer: 2,
                matrix_format: GgmlDType::Q4_0,
                embd_format: GgmlDType::F16,
                output_format: GgmlDType::F32,
                ..small.clone()
            },
            false,
        ),
        (
            "seed-q4_1-q5_1.gguf",
            TinyConfig {
                matrix_format: GgmlDType::Q4_1,
                embd_format: GgmlDType::Q5_1,
                output_format: GgmlDType::Q4_1,
                vocab: 32,
                ..small.clone()
            },
            false,
        ),
        // K-quants need rows of 256; a small vocabulary keeps the file small.
        (
            "seed-q3_k-q5_k-bf16.gguf",
            TinyConfig {
                d_model: 256,
                d_ff: 256,
                matrix_format: GgmlDType::Q3K,
                embd_format: GgmlDType::Q5K,
                output_format: GgmlDType::Q5K,
                vocab: 16,
                ..small
            },
            true,
        ),
    ];
    for (name, cfg, bf16) in seeds {
        let path = dir.join(name);
        write_tiny_qwen2(&path, &cfg)?;
        if bf16 {
            to_bf16(&path)?;
        }
        println!(
            "{} ({} bytes)",
            path.display(),
            std::fs::metadata(&path)?.len()
        );
    }
    Ok(())
}

/// Rewrite a GGUF with its vectors (norms, biases) and output head in BF16
/// (what a BF16 file from llama.cpp's converter holds).
fn to_bf16(path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let mut f = std::fs::File::open(path)?;
    let content = gguf_file::Content::read(&mut f)?;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let info = &content.tensor_infos[name];
        let t = content.tensor(&mut f, name, &Device::Cpu)?;
        let t = if info.shape.rank() == 1 || name == "output.weight" {
            QTensor::quantize(&t.dequantize(&Device::Cpu)?, GgmlDType::BF16)?
        } else {
            t
        };
        tensors.push((name.clone(), t));
    }
    let mut meta: Vec<(&String, &gguf_file::Value)> = content.metadata.iter().collect();
    meta.sort_by(|a, b| a.0.cmp(b.0));
    let meta: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    drop(f);
    let mut out = std::fs::File::create(path)?;
    gguf_file::write(&mut out, &meta, &tensors)?;
    Ok(())
}
