//! Writes the GGUF seed corpus of the `gguf_load` fuzz target (docs/fuzzing.md):
//! tiny models small enough for the fuzzer to mutate quickly, covering the
//! formats the loader reads (Q5_0 / Q8_0 with a tokenizer, Q4_0 / F16 / F32
//! without one).
//!
//! `cargo run -p tandem-model --example fuzz_seeds -- fuzz/seeds/gguf_load`

use candle_core::quantized::GgmlDType;
use std::path::PathBuf;
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
        ),
        (
            "seed-q4_0-f16-f32.gguf",
            TinyConfig {
                n_layer: 2,
                matrix_format: GgmlDType::Q4_0,
                embd_format: GgmlDType::F16,
                output_format: GgmlDType::F32,
                ..small
            },
        ),
    ];
    for (name, cfg) in seeds {
        let path = dir.join(name);
        write_tiny_qwen2(&path, &cfg)?;
        println!(
            "{} ({} bytes)",
            path.display(),
            std::fs::metadata(&path)?.len()
        );
    }
    Ok(())
}
