//! `tandem generate`: one generation in this process (draft-only, target-only or
//! local speculative decoding), streamed to stdout, with statistics. With
//! `--verifier URL` (or `--edge-config`) the target is remote: see `remote.rs`.

use anyhow::{Context, Result};
use serde::Serialize;
use std::io::{Read, Write};
use std::path::PathBuf;
use tandem_cli_common::models::{load_model, peak_rss_bytes, prompt_tokens, tokenizer_of};
use tandem_fetch::ModelRole;
use tandem_model::kv_cache::KvPrecision;
use tandem_model::proposer::ProposerKind;
use tandem_model::sampling::SamplingParams;
use tandem_model::speculative::{
    generate_single, generate_single_with, generate_speculative, GenStats, GenerateConfig,
    Generation, Mode, StopReason,
};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// draft = the device model alone, target = the big model alone,
    /// speculative = draft proposes, target verifies.
    #[arg(long, value_enum, default_value = "speculative")]
    pub mode: ModeArg,
    /// The user prompt; read from stdin when absent.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Optional system prompt (default: the model's own).
    #[arg(long)]
    pub system: Option<String>,
    /// Use the prompt as raw text, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Draft block length (1..=16).
    #[arg(long, default_value_t = 4)]
    pub k: usize,
    /// What proposes each block: the draft model, prompt lookup (no model:
    /// continues text that already occurred), or auto (per round, whichever
    /// promises more tokens per second). Speculative mode, locally and with
    /// --verifier.
    #[arg(long, default_value = "draft")]
    pub proposer: ProposerKind,
    /// How the draft model's KV cache stores keys and values: f16 (half the
    /// memory of f32, and what llama.cpp keeps), f32, or int8 (a quarter;
    /// the draft's own answers drift from the model's). It can change
    /// acceptance, never the speculative output. Speculative and draft
    /// modes; the target's cache is always f32.
    #[arg(long, default_value_t = GenerateConfig::default().draft_kv)]
    pub draft_kv: KvPrecision,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// 0 = greedy (output identical to the target's own greedy output); > 0 =
    /// sampled (output identical to the target's own for --seed).
    /// Negative values parse so that they get the sampler's clear error.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Seed of the sampled draws: the token at each position is a function of
    /// the seed, the position and the distribution, so a seed reproduces the
    /// output in every mode.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// KV cache capacity in tokens (prompt + output).
    #[arg(long, default_value_t = 4096)]
    pub max_seq_len: usize,
    /// Print one JSON object (text, tokens, stats) instead of streaming.
    #[arg(long)]
    pub json: bool,
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    #[arg(long)]
    pub target_model: Option<PathBuf>,
    #[command(flatten)]
    pub remote: crate::remote::RemoteArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeArg {
    Draft,
    Target,
    Speculative,
}

impl ModeArg {
    pub fn mode(self) -> Mode {
        match self {
            Self::Draft => Mode::Draft,
            Self::Target => Mode::Target,
            Self::Speculative => Mode::Speculative,
        }
    }
}

/// `--json` output (schema in docs/cli.md).
#[derive(Serialize)]
pub struct JsonOutput {
    pub mode: Mode,
    pub text: String,
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    pub k: Option<usize>,
    pub proposer: Option<ProposerKind>,
    /// The draft's KV precision (speculative and draft modes).
    pub draft_kv: Option<KvPrecision>,
    pub sampling: SamplingParams,
    pub load_ms: f64,
    pub peak_rss_bytes: Option<u64>,
    pub stats: GenStats,
}

pub fn run(args: Args) -> Result<()> {
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
    };
    let cfg_probe = GenerateConfig {
        k: args.k,
        proposer: args.proposer,
        draft_kv: args.draft_kv,
        sampling,
        ..GenerateConfig::default()
    };
    cfg_probe.validate()?; // bad flags fail before any model loads
    let prompt = match &args.prompt {
        Some(p) => p.clone(),
        None => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading the prompt from stdin")?;
            s
        }
    };
    anyhow::ensure!(!prompt.trim().is_empty(), "the prompt is empty");
    let mode = args.mode.mode();
    if args.remote.wanted() {
        anyhow::ensure!(
            mode == Mode::Speculative,
            "--verifier/--edge-config need --mode speculative (the draft runs here, the target at the verifier)"
        );
        anyhow::ensure!(
            args.target_model.is_none(),
            "--target-model is not used with --verifier (the verifier loads the target)"
        );
        return crate::remote::run(&args, &prompt, cfg_probe);
    }
    let need_draft = mode != Mode::Target;
    let need_target = mode != Mode::Draft;
    let draft = need_draft
        .then(|| {
            load_model(
                ModelRole::Draft,
                args.draft_model.as_ref(),
                args.max_seq_len,
            )
        })
        .transpose()?;
    let target = need_target
        .then(|| {
            load_model(
                ModelRole::Target,
                args.target_model.as_ref(),
                args.max_seq_len,
            )
        })
        .transpose()?;
    let load_ms =
        draft.as_ref().map_or(0.0, |l| l.load_ms) + target.as_ref().map_or(0.0, |l| l.load_ms);
    let any = draft.as_ref().or(target.as_ref()).map(|l| &l.model);
    let any = any.context("no model loaded")?;
    let tok = tokenizer_of(any)?;
    let ids = prompt_tokens(&tok, &prompt, args.system.as_deref(), args.raw)?;
    let cfg = GenerateConfig {
        max_tokens: args.max_tokens,
        stop_tokens: tok.chat_stop_tokens(),
        ..cfg_probe
    };

    let mut dec = tok.stream_decoder(true);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let stream = !args.json;
    let mut write_err: Option<std::io::Error> = None;
    let mut on_token = |t: u32| -> bool {
        if stream {
            if let Some(piece) = dec.push(t) {
                if let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
                    write_err = Some(e);
                    return false; // e.g. the reader of a pipe went away
                }
            }
        }
        true
    };
    let g: Generation = match (mode, &draft, &target) {
        (Mode::Draft, Some(d), _) => {
            generate_single_with(&d.model, cfg.draft_kv, &ids, &cfg, &mut on_token)?
        }
        (Mode::Target, _, Some(t)) => generate_single(&t.model, &ids, &cfg, &mut on_token)?,
        (Mode::Speculative, Some(d), Some(t)) => {
            generate_speculative(&d.model, &t.model, &ids, &cfg, &mut on_token)?
        }
        _ => anyhow::bail!("internal error: models for {mode:?} not loaded"),
    };
    if let Some(e) = write_err {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return Ok(());
        }
        return Err(e).context("writing to stdout");
    }
    if stream {
        if let Some(rest) = dec.flush() {
            out.write_all(rest.as_bytes())?;
        }
        writeln!(out)?;
        drop(out);
        eprint!("{}", human_stats(mode, &g, &cfg, load_ms));
    } else {
        let j = JsonOutput {
            mode,
            text: tok.decode(&g.tokens, true)?,
            tokens: g.tokens.clone(),
            stop: g.stop,
            k: (mode == Mode::Speculative).then_some(cfg.k),
            proposer: (mode == Mode::Speculative).then_some(cfg.proposer),
            draft_kv: (mode != Mode::Target).then_some(cfg.draft_kv),
            sampling: cfg.sampling,
            load_ms,
            peak_rss_bytes: peak_rss_bytes(),
            stats: g.stats,
        };
        serde_json::to_writer_pretty(&mut out, &j)?;
        writeln!(out)?;
    }
    Ok(())
}

/// The statistics block printed after a streamed generation.
pub fn human_stats(mode: Mode, g: &Generation, cfg: &GenerateConfig, load_ms: f64) -> String {
    let s = &g.stats;
    let mut o = String::new();
    o.push_str(&format!(
        "--- {mode:?}: {} prompt tokens, {} generated ({:?}); load {:.0} ms\n",
        s.prompt_tokens, s.generated_tokens, g.stop, load_ms
    ));
    o.push_str(&format!(
        "    TTFT {:.0} ms, {:.1} tok/s overall, {:.1} tok/s decode, total {:.0} ms\n",
        s.ttft_ms, s.tokens_per_s, s.decode_tokens_per_s, s.total_ms
    ));
    if mode == Mode::Speculative {
        o.push_str(&format!(
            "    proposer {} k={} draft KV {}, rounds {}, acceptance {:.1}%, mean accepted length {:.2}, target forwards {} ({:.2} per token)\n",
            cfg.proposer,
            cfg.k,
            cfg.draft_kv,
            s.rounds,
            s.acceptance_rate * 100.0,
            s.mean_accepted_len,
            s.target_forwards,
            s.target_forwards as f64 / s.generated_tokens.max(1) as f64
        ));
        let per: Vec<String> = s
            .per_position
            .iter()
            .map(|p| {
                if p.attempted == 0 {
                    "-".to_string()
                } else {
                    format!("{:.0}%", 100.0 * p.accepted as f64 / p.attempted as f64)
                }
            })
            .collect();
        o.push_str(&format!(
            "    per-position acceptance: [{}]\n",
            per.join(" ")
        ));
        let p = &s.proposers;
        let line = |name: &str, st: &tandem_model::proposer::ProposerStat| {
            format!(
                "{name} {} rounds {}/{} accepted",
                st.rounds, st.accepted, st.drafted
            )
        };
        o.push_str(&format!(
            "    by proposer: {}, {}, no proposal {} rounds\n",
            line("draft", &p.draft),
            line("lookup", &p.lookup),
            p.none_rounds
        ));
    }
    o
}
