//! `tandem generate`: one generation in this process (draft-only, target-only or
//! local speculative decoding), streamed to stdout, with statistics. With
//! `--verifier URL` (or `--edge-config`) the target is remote: see `remote.rs`.

use crate::generate_args::Args;
use anyhow::{Context, Result};
use serde::Serialize;
use std::io::{Read, Write};
use tandem_cli_common::models::{load_model, peak_rss_bytes, prompt_tokens, tokenizer_of};
use tandem_fetch::ModelRole;
use tandem_model::kv_cache::KvPrecision;
use tandem_model::penalties::LogitBias;
use tandem_model::proposer::ProposerKind;
use tandem_model::sampling::SamplingParams;
use tandem_model::speculative::{
    generate_single, generate_single_with, generate_speculative, GenStats, GenerateConfig,
    Generation, Mode, StopReason,
};

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
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        logit_bias: LogitBias::new(args.logit_bias.iter().copied()).context("--logit-bias")?,
        ..SamplingParams::default()
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
    // Read (not compiled: that needs the tokenizer) before any model loads.
    let spec = args.grammar_spec()?;
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
        return crate::remote::run(&args, &prompt, cfg_probe, spec);
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
        grammar: crate::generate_args::output_grammar(&tok, spec)?,
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
