//! Errors of the model core.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model file not found: {0} (run `tandem models fetch`)")]
    NotFound(PathBuf),
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a valid GGUF file {path}: {reason}")]
    BadGguf { path: PathBuf, reason: String },
    #[error("unsupported model architecture `{0}` (supported: qwen2, qwen3, llama, gemma3)")]
    UnsupportedArchitecture(String),
    #[error("missing GGUF metadata key `{0}`")]
    MissingMetadata(String),
    #[error("missing tensor `{0}` in GGUF file")]
    MissingTensor(String),
    #[error("tensor `{name}`: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("unsupported model feature: {0}")]
    Unsupported(String),
    #[error("unsupported weight format {0}")]
    UnsupportedFormat(String),
    #[error("sequence too long: {needed} tokens exceed the KV cache capacity of {capacity}")]
    SequenceTooLong { needed: usize, capacity: usize },
    #[error("token id {id} out of range (vocabulary has {vocab} tokens)")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("the model has no chat template (`tokenizer.chat_template`): use a raw prompt, or give a Jinja chat template")]
    NoChatTemplate,
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// Structured output: a grammar that cannot be followed (a token it
    /// refuses, or no token it allows), or one that does not compile.
    #[error("grammar: {0}")]
    Grammar(String),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
