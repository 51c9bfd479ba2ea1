//! Tests only: `tandem-model` checked against independent implementations of
//! the same files, which it must agree with.
//!
//! - `tests/families_vs_candle.rs`: every architecture's forward against
//!   candle-transformers' quantized models, on tiny random-weight GGUFs.
//! - `tests/real_vs_candle.rs`: greedy decoding of the real Qwen2.5-Coder pair
//!   against candle-transformers' `quantized_qwen2`.
//! - `tests/tokenizer_vs_hf.rs`: the tokenizer against Hugging Face
//!   `tokenizers`, built by candle from the same GGUF.
//!
//! Why a crate of its own: CI cross-compiles `tandem-model`'s kernel tests for
//! aarch64 (`.ci/aarch64-tests`), where these references are not run, and
//! cargo builds every dev-dependency of a package for any of its tests.
//! candle-transformers (with candle-nn) was about a fifth of that build (139
//! of 640 unit-seconds, 2026-12-07; docs/ci.md); `tandem-model`'s own
//! dev-dependencies stay small.
