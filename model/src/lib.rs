//! `tandem-model`: the model core that both the device and the verifier run.
//!
//! - [`gguf`]: memory-maps a GGUF file and hands out typed views of its tensors
//!   (weights are never copied or expanded; RSS stays near the file size).
//! - [`quant`]: quantized matrix × (1..16 rows) kernels. Every output element is
//!   computed by the same code path whatever the number of rows, so results are
//!   bit-identical between a one-token decode and a block verify.
//! - [`tokenizer`]: the tokenizers llama.cpp builds from GGUF metadata (GPT-2
//!   byte-level BPE with the pre-tokenizer `tokenizer.ggml.pre` names, and
//!   SentencePiece), special and end-of-generation tokens, the GGUF's own chat
//!   template (minijinja), a UTF-8-safe streaming decoder.
//! - [`arch`]: the supported model families (`qwen2`, `qwen3`, `llama`,
//!   `gemma3`) and their hyper-parameters: where they differ, as data.
//! - [`pair`]: whether a draft and a target can pair, and why not.
//! - [`transformer`]: the transformer of every family ([`transformer::Model`]):
//!   `embed`, `forward_layers(range, hidden)`, `head`, and `forward_batch` (many sequences' rows in one forward, each attending only
//!   to its own KV, logits only for the rows that ask; `forward_batch_in` with a caller's
//!   `ForwardScratch` reuses every per-forward buffer); KV in a
//!   [`kv_cache::KvCache`] (preallocated, `truncate(len)`; f32, or INT8 for a draft:
//!   [`kv_cache::KvPrecision`]) or in pages of a shared
//!   byte-sized pool ([`kv_pages`]), both behind [`kv_cache::KvStore`].
//! - [`sampling`]: greedy / temperature / top-k / top-p / repetition penalty, and
//!   the keyed draw that makes a seeded token a function of its position.
//! - [`verify`]: speculative verification math (the longest prefix equal to the
//!   target's own tokens, greedy or seeded), pure functions.
//! - [`proposer`]: what proposes a round's tokens: the draft model, prompt lookup
//!   (an n-gram index of the history), or a per-round choice between them.
//! - [`engine`]: the one speculative generation core: a round (propose, verify
//!   through a [`engine::BlockVerifier`], roll back, emit, count), the one emit
//!   rule, the one draft step, and the generation's settings and statistics.
//! - [`speculative`]: local (single-process) generation loops: draft-only,
//!   target-only, and speculative (the core against the local target).
//! - [`forward_threads`]: which rayon pool (how many threads) a forward called
//!   on this thread uses (the device runs its draft on fewer when hot).
//! - `testing` (cargo feature `testing`, off by default): tiny random-weight
//!   models of every family as GGUF, for tests here and in the crates above;
//!   not in the library an app or a phone links.

pub mod arch;
mod attention;
pub mod engine;
pub mod error;
mod expf;
pub mod forward_threads;
mod gelu;
pub mod gguf;
pub mod kv_cache;
pub mod kv_pages;
pub mod logprobs;
pub mod pair;
pub mod penalties;
pub mod proposer;
pub mod quant;
pub mod sampling;
pub mod speculative;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tokenizer;
pub mod transformer;
pub mod vecops;
pub mod verify;

pub use error::{ModelError, Result};
