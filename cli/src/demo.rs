//! `tandem demo`: the README's first command. Fetches the models on first use
//! (progress bar), then runs one local speculative generation next to the
//! target alone on an embedded prompt, and prints both with their statistics.
//!
//! The networked demo (verifier over TLS, privacy routing, an outage) grows
//! from this as those parts land.

use crate::common::{load_model, prompt_tokens, tokenizer_of};
use crate::generate::human_stats;
use anyhow::Result;
use std::io::Write;
use tandem_fetch::ModelRole;
use tandem_model::speculative::{generate_single, generate_speculative, GenerateConfig, Mode};

const DEMO_PROMPT: &str =
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.";

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The prompt to use instead of the embedded one.
    #[arg(long)]
    pub prompt: Option<String>,
    #[arg(long, default_value_t = 4)]
    pub k: usize,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
}

pub fn run(args: Args) -> Result<()> {
    let prompt = args.prompt.as_deref().unwrap_or(DEMO_PROMPT);
    eprintln!("tandem demo: draft Qwen2.5-Coder-0.5B (device) + target Qwen2.5-Coder-1.5B (verifier), in one process");
    let draft = load_model(ModelRole::Draft, None, 2048)?;
    let target = load_model(ModelRole::Target, None, 2048)?;
    let tok = tokenizer_of(&draft.model)?;
    let ids = prompt_tokens(&tok, prompt, None, false)?;
    let cfg = GenerateConfig {
        k: args.k,
        max_tokens: args.max_tokens,
        stop_tokens: vec![tok.im_end_id(), tok.endoftext_id()],
        ..GenerateConfig::default()
    };
    println!("prompt: {prompt}\n");
    println!(
        "== speculative (draft proposes k={} tokens, target verifies each block in one pass) ==",
        cfg.k
    );
    let mut dec = tok.stream_decoder(true);
    let mut out = std::io::stdout();
    let spec = generate_speculative(&draft.model, &target.model, &ids, &cfg, &mut |t| {
        if let Some(p) = dec.push(t) {
            let _ = out.write_all(p.as_bytes());
            let _ = out.flush();
        }
        true
    })?;
    if let Some(rest) = dec.flush() {
        print!("{rest}");
    }
    println!();
    print!(
        "{}",
        human_stats(
            Mode::Speculative,
            &spec,
            &cfg,
            draft.load_ms + target.load_ms
        )
    );
    println!("\n== target alone (the reference) ==");
    let reference = generate_single(&target.model, &ids, &cfg, &mut |_| true)?;
    print!(
        "{}",
        human_stats(Mode::Target, &reference, &cfg, target.load_ms)
    );
    let same = reference.tokens == spec.tokens;
    println!(
        "\nspeculative output identical to the target's own greedy output: {}",
        if same { "yes" } else { "NO" }
    );
    println!(
        "speed-up over the target alone: {:.2}x ({:.1} vs {:.1} tok/s)",
        spec.stats.tokens_per_s / reference.stats.tokens_per_s.max(1e-9),
        spec.stats.tokens_per_s,
        reference.stats.tokens_per_s
    );
    anyhow::ensure!(
        same,
        "speculative output differs from the target's greedy output"
    );
    Ok(())
}
