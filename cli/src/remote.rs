//! `tandem generate --verifier URL`: speculative decoding with the draft model in
//! this process (the device) and the target behind a remote `tandem serve-verifier`,
//! through `tandem-edge`. Streams text as it comes (provisional tokens dimmed on a
//! terminal), or prints one JSON object with a per-token `status` array; ends with
//! the edge statistics. JSON schema: docs/cli.md; usage: docs/edge.md.

use crate::generate_args::Args;
use anyhow::{Context, Result};
use serde::Serialize;
use std::io::{IsTerminal, Write};
use tandem_cli_common::models::{peak_rss_bytes, prompt_tokens, resolve_model};
use tandem_edge::{
    assemble, AssemblyConfig, EdgeError, EdgeEvent, EdgeStats, ProvisionalReport, RoutedDecision,
    Routing, TokenStatus, Turn,
};
use tandem_fetch::ModelRole;
use tandem_model::sampling::SamplingParams;
use tandem_model::speculative::{GenerateConfig, StopReason};
use tandem_model::tokenizer::ChatMessage;

/// `--json` output of a remote generation (schema in docs/cli.md).
#[derive(Serialize)]
pub struct RemoteJson {
    /// Always "remote".
    pub mode: &'static str,
    /// The verifier URL, or null when the edge config names none (all `local`).
    pub verifier: Option<String>,
    pub text: String,
    pub tokens: Vec<u32>,
    /// One entry per token: "verified", "provisional" or "local".
    pub status: Vec<TokenStatus>,
    pub stop: StopReason,
    pub k: usize,
    /// What proposed the blocks (`--proposer`); per-proposer counts in
    /// `stats.proposers`.
    pub proposer: tandem_model::proposer::ProposerKind,
    pub sampling: SamplingParams,
    pub load_ms: f64,
    pub peak_rss_bytes: Option<u64>,
    pub session_id: Option<String>,
    pub stats: EdgeStats,
    pub provisional: ProvisionalReport,
    /// The privacy router's decision (rule, entity spans; no text); absent with
    /// --no-privacy-router or without a verifier URL.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route: Option<RoutedDecision>,
}

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

/// Runs one generation through the edge runtime. `gen` carries k and sampling
/// (already validated); the stop tokens are added here.
pub fn run(
    args: &Args,
    prompt: &str,
    gen: GenerateConfig,
    spec: Option<tandem_grammar::GrammarSpec>,
) -> Result<()> {
    let mut cfg = args.remote.edge_config(gen.k)?;
    // One generation per process: nothing to keep for a next turn (and no
    // kept session left on the verifier until its idle TTL).
    cfg.conversations.enabled = false;
    anyhow::ensure!(
        args.remote.policy.is_none() || cfg.verifier_url.is_some(),
        "--policy decides what may go to a verifier: give --verifier URL (or verifier_url in --edge-config)"
    );
    let draft = resolve_model(ModelRole::Draft, args.draft_model.as_ref())?;
    // With [split] the device runs the target's first layers itself.
    let split_target = cfg
        .split
        .is_some()
        .then(|| resolve_model(ModelRole::Target, args.target_model.as_ref()))
        .transpose()?;
    let url = cfg.verifier_url.clone();
    // Privacy by default: whenever a verifier could be contacted, the router
    // (the given policy, else the built-in one) decides first.
    let device = assemble(AssemblyConfig {
        draft: draft.into(),
        split_target,
        max_seq_len: args.max_seq_len,
        policy: args.remote.policy.clone(),
        privacy_router: !args.remote.no_privacy_router,
        edge: cfg,
    })?;
    let (load_ms, routed, tok) = (device.draft_load_ms, device.routes, device.tokenizer);
    let ids = prompt_tokens(&tok, prompt, args.system.as_deref(), args.raw)?;
    let gen = GenerateConfig {
        max_tokens: args.max_tokens,
        stop_tokens: device.stop_tokens,
        grammar: crate::generate_args::output_grammar(&tok, spec)?,
        ..gen
    };
    let mut edge = device.routed;
    let mut messages: Vec<ChatMessage> = args.system.iter().map(ChatMessage::system).collect();
    messages.push(ChatMessage::user(prompt));

    let stdout = std::io::stdout();
    let tty = stdout.is_terminal();
    let mut out = stdout.lock();
    let stream = !args.json;
    let mut dec = tok.stream_decoder(true);
    let mut dimmed = false;
    let mut warned = false;
    let mut write_err: Option<std::io::Error> = None;
    let mut on_event = |ev: &EdgeEvent| -> bool {
        match ev {
            EdgeEvent::Token { id, status, .. } => {
                if *status == TokenStatus::Provisional && !warned {
                    warned = true;
                    if stream {
                        let _ = out.flush();
                    }
                    eprintln!(
                        "\nwarning: the verifier is unreachable; continuing with the draft model alone (provisional tokens{})",
                        if stream && tty { ", dimmed" } else { "" }
                    );
                }
                if !stream {
                    return true;
                }
                let Some(piece) = dec.push(*id) else {
                    return true;
                };
                let want_dim = tty && *status == TokenStatus::Provisional;
                let mut s = String::new();
                if want_dim != dimmed {
                    s.push_str(if want_dim { DIM } else { RESET });
                    dimmed = want_dim;
                }
                s.push_str(&piece);
                if let Err(e) = out.write_all(s.as_bytes()).and_then(|_| out.flush()) {
                    write_err = Some(e);
                    return false; // e.g. the reader of a pipe went away
                }
            }
            EdgeEvent::ProvisionalChecked(c) => {
                if stream {
                    let _ = out.flush();
                }
                if !c.checked {
                    eprintln!(
                        "\nnote: the verifier is back; provisional tokens {}..{} were not checked (sampled mode)",
                        c.start, c.end
                    );
                } else if c.mismatches.is_empty() {
                    eprintln!(
                        "\nnote: the verifier is back; provisional tokens {}..{} match the target's",
                        c.start, c.end
                    );
                } else {
                    eprintln!(
                        "\nwarning: the verifier is back; {} of provisional tokens {}..{} differ from the target's (first at {})",
                        c.mismatches.len(),
                        c.start,
                        c.end,
                        c.mismatches[0]
                    );
                }
            }
        }
        true
    };
    let turn = Turn {
        routing: if routed {
            Routing::Router
        } else {
            Routing::Speculative
        },
        state: routed.then_some("cli"),
        ..Turn::new("cli", &messages, &ids, &gen)
    };
    let (route, g) = match edge.turn(turn, &mut |_| true, &mut on_event) {
        Ok(Some(t)) => (t.route, t.generation),
        Ok(None) => anyhow::bail!("the generation did not start"),
        Err(e) => {
            if stream && dimmed {
                let _ = out.write_all(RESET.as_bytes());
            }
            return Err(explain(e));
        }
    };
    if let Some(e) = write_err {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return Ok(());
        }
        return Err(e).context("writing to stdout");
    }
    if stream {
        let mut tail = dec.flush().unwrap_or_default();
        if dimmed {
            tail.push_str(RESET);
        }
        writeln!(out, "{tail}")?;
        drop(out);
        if let Some(r) = &route {
            eprintln!("--- route: {}", r.decision);
        }
        eprint!(
            "{}",
            human_stats(
                url.as_deref(),
                &g.stats,
                &g.provisional,
                gen.k,
                g.stop,
                load_ms
            )
        );
    } else {
        let j = RemoteJson {
            mode: "remote",
            verifier: url,
            text: tok.decode(&g.tokens, true)?,
            tokens: g.tokens.clone(),
            status: g.statuses.clone(),
            stop: g.stop,
            k: gen.k,
            proposer: gen.proposer,
            sampling: gen.sampling,
            load_ms,
            peak_rss_bytes: peak_rss_bytes(),
            session_id: g.session_id.clone(),
            stats: g.stats.clone(),
            provisional: g.provisional.clone(),
            route,
        };
        serde_json::to_writer_pretty(&mut out, &j)?;
        writeln!(out)?;
    }
    Ok(())
}

/// Adds what the user should do to the errors a user can fix.
fn explain(e: EdgeError) -> anyhow::Error {
    let hint = match &e {
        EdgeError::Refused { reason, .. } => match reason.as_str() {
            "UNAUTHENTICATED" => {
                Some("check the bearer token (--token-file, or token/token_env in --edge-config)")
            }
            "FINGERPRINT_MISMATCH" | "MODEL_MISMATCH" => {
                Some("the verifier serves another model pair than this draft")
            }
            "PROMPT_TOO_LONG" => Some("the prompt is longer than the verifier accepts"),
            _ => None,
        },
        EdgeError::Tls(_) => {
            Some("check --ca-cert (the CA that signed the verifier's certificate) and --tls-domain")
        }
        _ => None,
    };
    match hint {
        Some(h) => anyhow::Error::new(e).context(h.to_string()),
        None => anyhow::Error::new(e),
    }
}

/// The statistics block printed (stderr) after a streamed remote generation.
pub fn human_stats(
    url: Option<&str>,
    s: &EdgeStats,
    p: &ProvisionalReport,
    k: usize,
    stop: StopReason,
    load_ms: f64,
) -> String {
    let mut o = String::new();
    o.push_str(&format!(
        "--- remote ({}): {} prompt tokens, {} generated ({stop:?}); draft load {load_ms:.0} ms\n",
        url.unwrap_or("no verifier: local"),
        s.prompt_tokens,
        s.generated_tokens
    ));
    o.push_str(&format!(
        "    tokens: {} verified, {} provisional, {} local\n",
        s.verified_tokens, s.provisional_tokens, s.local_tokens
    ));
    o.push_str(&format!(
        "    TTFT {:.0} ms, {:.1} tok/s, total {:.0} ms\n",
        s.ttft_ms, s.tokens_per_s, s.total_ms
    ));
    o.push_str(&format!(
        "    k={k} rounds {}, acceptance {:.1}%, mean accepted length {:.2}, verifier passes {} ({:.2} per token)\n",
        s.rounds,
        s.acceptance_rate * 100.0,
        s.mean_accepted_len,
        s.verifier_passes,
        s.verifier_passes_per_token
    ));
    let by = &s.proposers;
    if by.lookup.rounds > 0 || by.none_rounds > 0 {
        o.push_str(&format!(
            "    by proposer: draft {} rounds ({}/{} accepted), lookup {} rounds ({}/{} accepted), no proposal {} rounds\n",
            by.draft.rounds,
            by.draft.accepted,
            by.draft.drafted,
            by.lookup.rounds,
            by.lookup.accepted,
            by.lookup.drafted,
            by.none_rounds
        ));
    }
    o.push_str(&format!(
        "    RTT mean {:.1} ms, p95 {:.1} ms; bytes sent {}, received {}\n",
        s.rtt_mean_ms, s.rtt_p95_ms, s.bytes_sent, s.bytes_received
    ));
    if s.opens > 1 || s.resends > 0 || s.failures > 0 || s.breaker_opens > 0 {
        o.push_str(&format!(
            "    sessions opened {}, resends {}, timeouts {}, failures {}, breaker opens {}\n",
            s.opens, s.resends, s.timeouts, s.failures, s.breaker_opens
        ));
    }
    if let Some(sp) = &s.split {
        let mean = if sp.round_ms.is_empty() {
            0.0
        } else {
            sp.round_ms.iter().sum::<f64>() / sp.round_ms.len() as f64
        };
        o.push_str(&format!(
            "    split: device runs layers [0, {}) of {}{}, hidden {}{}; round {:.1} ms mean{}\n",
            sp.layer,
            sp.n_layer,
            if sp.pin_head { " + head (U-shape)" } else { "" },
            sp.hidden_format,
            if sp.lossy { " (LOSSY)" } else { "" },
            mean,
            sp.predicted_round_ms
                .map(|p| format!(", predicted {p:.1} ms"))
                .unwrap_or_default()
        ));
    }
    if p.provisional_tokens > 0 {
        o.push_str(&format!(
            "    provisional: {} tokens, {} checked, {} differ from the target's{}\n",
            p.provisional_tokens,
            p.checked_tokens,
            p.mismatched_tokens,
            p.first_mismatch
                .map(|i| format!(" (first at {i})"))
                .unwrap_or_default()
        ));
    }
    o
}
