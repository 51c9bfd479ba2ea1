//! `tandem lab device` (hidden): the device side of the lab. Loads the draft once,
//! then reads one job per stdin line and answers one result per stdout line, so
//! a mode's many runs share one model load. Runs pinned to the device core(s).

use super::config::Mode;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use tandem_cli_common::models::{load_model, prompt_tokens, tokenizer_of};
use tandem_edge::adaptive::{RoundRecord, SpeculationConfig};
use tandem_edge::{
    assemble, AssemblyConfig, EdgeConfig, EdgeEvent, EdgeStats, ProvisionalReport, RoutedRuntime,
    RoutedTurn, Routing, TokenStatus, Turn,
};
use tandem_fetch::ModelRole;
use tandem_model::sampling::SamplingParams;
use tandem_model::speculative::GenerateConfig;

#[derive(clap::Args, Debug)]
pub struct DeviceArgs {
    /// The lab mode (draft-only, target-only, spec-kN, adaptive, pipeline-kN,
    /// adaptive-pipeline).
    #[arg(long)]
    pub mode: String,
    /// Bearer token for the verifier.
    #[arg(long, default_value = "")]
    pub token: String,
    #[arg(long, default_value_t = 2048)]
    pub max_seq_len: usize,
    #[arg(long, default_value_t = 4)]
    pub stream_window: usize,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// The device's edge config (the lab's `[edge]` table); the link, k and the
    /// mode's speculation switches are set by the lab over it.
    #[arg(long)]
    pub edge_config: Option<PathBuf>,
}

/// One generation to run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Job {
    pub job: usize,
    pub prompt: String,
    pub max_tokens: usize,
    /// Verifier URL (through a netsim proxy); None for draft-only.
    pub url: Option<String>,
}

/// What the device measured.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DeviceResult {
    pub job: usize,
    pub error: Option<String>,
    pub text: String,
    pub tokens: Vec<u32>,
    pub statuses: Vec<TokenStatus>,
    /// Milliseconds from the start of the generation call to each token.
    pub token_ms: Vec<f64>,
    pub stop: String,
    pub stats: EdgeStats,
    pub rounds: Vec<RoundRecord>,
    pub provisional: ProvisionalReport,
    pub load_ms: f64,
}

fn speculation(mode: Mode, window: usize, base: &SpeculationConfig) -> SpeculationConfig {
    let mut s = SpeculationConfig {
        record_rounds: true,
        stream_window: window,
        adaptive_k: false,
        pipeline: false,
        target_stream: false,
        ..base.clone()
    };
    match mode {
        Mode::DraftOnly => {}
        Mode::TargetOnly => s.target_stream = true,
        Mode::Spec {
            adaptive, pipeline, ..
        } => {
            s.adaptive_k = adaptive;
            s.pipeline = pipeline;
        }
        Mode::Gated { .. } => {}
    }
    s
}

pub fn run(args: DeviceArgs) -> Result<()> {
    let mode = Mode::parse(&args.mode)?;
    let draft = load_model(
        ModelRole::Draft,
        args.draft_model.as_ref(),
        args.max_seq_len,
    )?;
    let load_ms = draft.load_ms;
    let tok = tokenizer_of(&draft.model)?;
    let fingerprint = tok.fingerprint();
    let model = Arc::new(draft.model);
    let k = match mode {
        Mode::Spec { k, .. } | Mode::Gated { k, .. } => k,
        _ => 4,
    };
    let base = match &args.edge_config {
        Some(p) => EdgeConfig::from_file(p)?,
        None => EdgeConfig::default(),
    };
    let mut runtimes: HashMap<Option<String>, RoutedRuntime> = HashMap::new();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    for line in stdin.lock().lines() {
        let line = line.context("reading a job")?;
        if line.trim().is_empty() {
            continue;
        }
        let job: Job = serde_json::from_str(&line).context("parsing a job")?;
        let rt = match runtimes.entry(job.url.clone()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let cfg = EdgeConfig {
                    verifier_url: job.url.clone(),
                    token: (!args.token.is_empty()).then(|| args.token.clone()),
                    tokenizer_fingerprint: Some(fingerprint.clone()),
                    k,
                    speculation: speculation(mode, args.stream_window, &base.speculation),
                    gate: tandem_edge::config::GateConfig {
                        confidence: mode.gate_confidence().unwrap_or(0.0),
                        ..base.gate.clone()
                    },
                    // Each job is its own generation: a repeated prompt must
                    // not find the previous run's kept state.
                    conversations: tandem_edge::ConversationConfig {
                        enabled: false,
                        ..base.conversations.clone()
                    },
                    ..base.clone()
                };
                // One draft load for every link: the runtimes share it. The
                // lab measures speculation, not routing: no router.
                let device = assemble(AssemblyConfig {
                    privacy_router: false,
                    edge: cfg,
                    ..AssemblyConfig::new(model.clone())
                })?;
                e.insert(device.routed)
            }
        };
        let gen = GenerateConfig {
            max_tokens: job.max_tokens,
            k,
            proposer: mode.proposer(),
            sampling: SamplingParams {
                temperature: args.temperature,
                ..SamplingParams::default()
            },
            stop_tokens: tok.chat_stop_tokens(),
            ..GenerateConfig::default()
        };
        let ids = prompt_tokens(&tok, &job.prompt, None, false)?;
        let mut token_ms = Vec::new();
        let start = Instant::now();
        let mut on_event = |ev: &EdgeEvent| {
            if let EdgeEvent::Token { .. } = ev {
                token_ms.push(start.elapsed().as_secs_f64() * 1000.0);
            }
            true
        };
        let turn = Turn {
            routing: match mode {
                Mode::DraftOnly => Routing::Local,
                _ => Routing::Speculative,
            },
            state: None,
            ..Turn::new("", &[], &ids, &gen)
        };
        let res = rt.turn(turn, &mut |_| true, &mut on_event);
        let result = match res {
            Ok(Some(RoutedTurn { generation: g, .. })) => DeviceResult {
                job: job.job,
                error: None,
                text: tok.decode(&g.tokens, true).unwrap_or_default(),
                tokens: g.tokens,
                statuses: g.statuses,
                token_ms,
                stop: format!("{:?}", g.stop),
                stats: g.stats,
                rounds: rt.runtime().last_rounds().to_vec(),
                provisional: g.provisional,
                load_ms,
            },
            Ok(None) => anyhow::bail!("the generation did not start"),
            Err(e) => DeviceResult {
                job: job.job,
                error: Some(e.to_string()),
                load_ms,
                ..DeviceResult::default()
            },
        };
        serde_json::to_writer(&mut out, &result)?;
        writeln!(out)?;
        out.flush()?;
    }
    Ok(())
}
