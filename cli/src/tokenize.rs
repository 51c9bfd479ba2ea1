//! `tandem tokenize`: the model's tokenizer as a user can check it.
//!
//! Encode: text on stdin (taken exactly, including any trailing newline) ->
//! a JSON array of token ids on stdout. Decode (`--decode`): a JSON array of
//! ids on stdin -> the text on stdout, written exactly (no newline added).

use anyhow::{bail, Context};
use std::io::{Read, Write};
use std::path::PathBuf;
use tandem_model::gguf::GgufFile;
use tandem_model::tokenizer::Tokenizer;

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum ModelChoice {
    /// The device's draft model (Qwen2.5-Coder-0.5B-Instruct).
    Draft,
    /// The cloud's target model (Qwen2.5-Coder-1.5B-Instruct).
    Target,
}

#[derive(clap::Args)]
pub struct Args {
    /// Whose tokenizer (both models currently share one).
    #[arg(long, value_enum, default_value = "draft")]
    model: ModelChoice,
    /// Use this GGUF file instead of the fetched model.
    #[arg(long, value_name = "PATH")]
    model_path: Option<PathBuf>,
    /// Read a JSON array of token ids and print the text.
    #[arg(long)]
    decode: bool,
    /// Control tokens: when encoding, `<|im_start|>` etc. in the text become
    /// their ids (otherwise they are plain text); when decoding, they are
    /// printed (otherwise omitted).
    #[arg(long)]
    special: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let path = match &args.model_path {
        Some(p) => p.clone(),
        None => tandem_fetch::model_path(match args.model {
            ModelChoice::Draft => tandem_fetch::ModelRole::Draft,
            ModelChoice::Target => tandem_fetch::ModelRole::Target,
        }),
    };

    // Model first: a missing model is reported before waiting on stdin.
    let t0 = std::time::Instant::now();
    let gguf = GgufFile::open(&path)?;
    let tokenizer = Tokenizer::from_gguf(&gguf)
        .with_context(|| format!("cannot build the tokenizer of {}", path.display()))?;
    tracing::debug!(
        elapsed_ms = t0.elapsed().as_secs_f64() * 1e3,
        vocab = tokenizer.vocab_size(),
        "tokenizer loaded"
    );

    let mut input = Vec::new();
    std::io::stdin()
        .read_to_end(&mut input)
        .context("cannot read stdin")?;
    let input = String::from_utf8(input).context("stdin is not valid UTF-8")?;
    let mut out = std::io::stdout().lock();
    if args.decode {
        let ids = parse_ids(&input)?;
        let text = tokenizer.decode(&ids, !args.special)?;
        out.write_all(text.as_bytes())?;
    } else {
        let ids = tokenizer.encode(&input, args.special)?;
        serde_json::to_writer(&mut out, &ids)?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(())
}

/// A JSON array of non-negative integer ids that fit in u32.
fn parse_ids(input: &str) -> anyhow::Result<Vec<u32>> {
    const HINT: &str = "expected a JSON array of token ids, e.g. [9707, 11, 1879]";
    let value: serde_json::Value =
        serde_json::from_str(input).with_context(|| format!("stdin is not JSON ({HINT})"))?;
    let serde_json::Value::Array(items) = value else {
        bail!("stdin is not a JSON array ({HINT})");
    };
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .with_context(|| format!("element {i} ({v}) is not a token id ({HINT})"))
        })
        .collect()
}
