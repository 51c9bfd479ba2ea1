//! `tandem bench --soak DURATION`: the device metrics of continuous inference.
//!
//! One process loads the draft model the way an app does (an
//! `EdgeRuntime` without a verifier: local mode; `--warmup` turns on the
//! warm-up forward at load) and generates back to back for DURATION, the
//! prompts of the prompt set in turn, `--soak-tokens` tokens each (no stop
//! token, so every generation does the same work; the conversation cache is
//! off, so every prompt is prefilled). Reported:
//!
//! * load time, warm-up time, and the first generation's first-token latency
//!   (cold without `--warmup`);
//! * per window (`--soak-window`, default one minute): generations, mean and
//!   worst first-token latency, decode tok/s (tokens after the first / time
//!   after the first token, summed over the generations that ended in it);
//! * the decay: (first window − last window) / first window of decode tok/s.
//!   Over 30 % after 10 minutes means the scheduling or heat handling is wrong.
//!
//! A device state can be injected (`--soak-thermal`, `--soak-battery`): the
//! runtime then applies its adjustments (`tandem_edge::device`) as on a hot
//! or drained phone. A machine here does not heat up like a phone, so the
//! decay measured here is the scheduler's and the machine's sharing, not
//! throttling.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;
use tandem_edge::{assemble, AssemblyConfig, DeviceState, EdgeConfig, Routing, ThermalState, Turn};
use tandem_model::speculative::GenerateConfig;
use tandem_model::tokenizer::ChatMessage;

use super::worker::PromptCase;

/// What `--soak` runs with (from `tandem bench`'s flags).
pub struct SoakPlan {
    pub duration: Duration,
    pub window: Duration,
    pub tokens: usize,
    pub warmup: bool,
    pub draft: PathBuf,
    /// Draft threads (the default pool: all logical CPUs).
    pub threads: Option<usize>,
    pub prompts: Vec<PromptCase>,
    pub device: DeviceState,
    pub json: bool,
}

/// One generation of the soak.
#[derive(Clone, Debug, Serialize)]
struct GenerationRecord {
    /// Seconds since the soak started, at the end of the generation.
    end_s: f64,
    ttft_ms: f64,
    tokens: usize,
    /// Time after the first token (s).
    decode_s: f64,
    draft_threads: usize,
}

/// One window of the report.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct WindowRow {
    pub index: usize,
    pub generations: usize,
    pub ttft_mean_ms: f64,
    pub ttft_max_ms: f64,
    pub decode_tok_s: f64,
}

#[derive(Clone, Debug, Serialize)]
struct SoakReport {
    cpu: String,
    load_before: Vec<f64>,
    load_after: Vec<f64>,
    draft: String,
    duration_s: f64,
    window_s: f64,
    tokens_per_generation: usize,
    warmup: bool,
    load_ms: f64,
    warmup_ms: Option<f64>,
    first_ttft_ms: f64,
    device: DeviceState,
    draft_threads: usize,
    windows: Vec<WindowRow>,
    /// (first − last) / first window's decode tok/s; `None` with < 2 windows.
    decay: Option<f64>,
    generations: Vec<GenerationRecord>,
}

pub fn parse_thermal(text: &str) -> Result<ThermalState, String> {
    match text {
        "nominal" => Ok(ThermalState::Nominal),
        "fair" => Ok(ThermalState::Fair),
        "serious" => Ok(ThermalState::Serious),
        "critical" => Ok(ThermalState::Critical),
        _ => Err(format!(
            "unknown thermal state {text:?} (nominal, fair, serious, critical)"
        )),
    }
}

/// Groups generations by the window they ended in; those that ended after
/// the last full window (the soak stops at the first generation end past
/// DURATION) count in that last full window.
fn windows(records: &[GenerationRecord], window_s: f64, duration_s: f64) -> Vec<WindowRow> {
    let full = ((duration_s / window_s).floor() as usize).max(1);
    let mut sums = vec![(0usize, 0.0f64, 0.0f64, 0usize, 0.0f64); full];
    for r in records {
        let i = ((r.end_s / window_s).floor() as usize).min(full - 1);
        let s = &mut sums[i];
        s.0 += 1;
        s.1 += r.ttft_ms;
        s.2 = s.2.max(r.ttft_ms);
        s.3 += r.tokens.saturating_sub(1);
        s.4 += r.decode_s;
    }
    sums.iter()
        .enumerate()
        .filter(|(_, s)| s.0 > 0)
        .map(|(index, s)| WindowRow {
            index,
            generations: s.0,
            ttft_mean_ms: s.1 / s.0 as f64,
            ttft_max_ms: s.2,
            decode_tok_s: if s.4 > 0.0 { s.3 as f64 / s.4 } else { 0.0 },
        })
        .collect()
}

/// (first − last) / first of the windows' decode tok/s.
pub fn decay(rows: &[WindowRow]) -> Option<f64> {
    let (first, last) = (rows.first()?, rows.last()?);
    (rows.len() >= 2 && first.decode_tok_s > 0.0)
        .then(|| (first.decode_tok_s - last.decode_tok_s) / first.decode_tok_s)
}

pub fn run(plan: SoakPlan) -> Result<()> {
    anyhow::ensure!(!plan.duration.is_zero(), "--soak must be positive");
    anyhow::ensure!(!plan.window.is_zero(), "--soak-window must be positive");
    anyhow::ensure!(plan.tokens >= 2, "--soak-tokens must be at least 2");
    anyhow::ensure!(!plan.prompts.is_empty(), "the prompt set is empty");
    plan.device
        .validate()
        .map_err(|e| anyhow::anyhow!("--soak-battery: {e}"))?;
    let load_before = super::loadavg();
    // The draft's forwards run on a pool of --threads threads (this thread's
    // forward pool; the device state may shrink it further).
    let _threads = match plan.threads {
        Some(n) => {
            anyhow::ensure!(n >= 1, "--threads must be at least 1");
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .context("building the draft's thread pool")?;
            Some(tandem_model::forward_threads::use_pool(Arc::new(pool)))
        }
        None => None,
    };
    let t_load = Instant::now();
    let mut cfg = EdgeConfig {
        warmup: plan.warmup,
        ..EdgeConfig::default()
    };
    // Every generation prefills its prompt (no reuse between repeats).
    cfg.conversations.enabled = false;
    let device = assemble(AssemblyConfig {
        edge: cfg,
        ..AssemblyConfig::new(plan.draft.clone())
    })
    .context("building the device runtime")?;
    let (mut edge, tok) = (device.routed, device.tokenizer);
    let load_ms = t_load.elapsed().as_secs_f64() * 1000.0;
    edge.set_device_state(plan.device.clone())
        .context("--soak-thermal / --soak-battery")?;
    let prompts: Vec<Vec<u32>> = plan
        .prompts
        .iter()
        .map(|p| tok.encode_chat(&[ChatMessage::user(&p.prompt)], true))
        .collect::<Result<_, _>>()
        .context("tokenizing the prompts")?;
    let gen = GenerateConfig {
        max_tokens: plan.tokens,
        ..GenerateConfig::default()
    };
    if !plan.json {
        eprintln!(
            "device soak: {} of back-to-back generations ({} tokens each), draft {}",
            fmt_duration(plan.duration),
            plan.tokens,
            plan.draft.display()
        );
    }
    let start = Instant::now();
    let mut records = Vec::new();
    let mut i = 0usize;
    while start.elapsed() < plan.duration {
        let prompt = &prompts[i % prompts.len()];
        i = i.wrapping_add(1);
        let turn = Turn {
            routing: Routing::Local,
            state: None,
            ..Turn::new("", &[], prompt, &gen)
        };
        let g = edge
            .turn(turn, &mut |_| true, &mut |_| true)
            .context("a soak generation")?
            .context("a soak generation did not start")?
            .generation;
        let s = &g.stats;
        records.push(GenerationRecord {
            end_s: start.elapsed().as_secs_f64(),
            ttft_ms: s.ttft_ms,
            tokens: s.generated_tokens,
            decode_s: ((s.total_ms - s.ttft_ms) / 1000.0).max(0.0),
            draft_threads: s.device.as_ref().map_or(0, |d| d.draft_threads),
        });
    }
    let duration_s = start.elapsed().as_secs_f64();
    let window_s = plan.window.as_secs_f64();
    let rows = windows(&records, window_s, duration_s);
    let report = SoakReport {
        cpu: super::cpu_model(),
        load_before,
        load_after: super::loadavg(),
        draft: plan.draft.display().to_string(),
        duration_s,
        window_s,
        tokens_per_generation: plan.tokens,
        warmup: plan.warmup,
        load_ms,
        warmup_ms: edge.runtime().warmup_ms(),
        first_ttft_ms: records.first().map_or(0.0, |r| r.ttft_ms),
        device: plan.device.clone(),
        draft_threads: records.first().map_or(0, |r| r.draft_threads),
        decay: decay(&rows),
        windows: rows,
        generations: records,
    };
    if plan.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", table(&report));
    }
    Ok(())
}

fn fmt_duration(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 60.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{s:.1} s")
    }
}

fn table(r: &SoakReport) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "device soak, local mode, {} tokens per generation, draft threads {}, warm-up {}",
        r.tokens_per_generation,
        r.draft_threads,
        if r.warmup { "on" } else { "off" }
    );
    let _ = writeln!(
        out,
        "cpu: {}; load average before {:?}, after {:?}",
        r.cpu, r.load_before, r.load_after
    );
    let _ = writeln!(
        out,
        "load {:.0} ms, warm-up {}, first generation's first-token latency {:.0} ms\n",
        r.load_ms,
        r.warmup_ms
            .map_or("off".to_string(), |w| format!("{w:.0} ms")),
        r.first_ttft_ms
    );
    let unit = if (r.window_s - 60.0).abs() < 1e-9 {
        "minute".to_string()
    } else {
        format!("window ({:.0} s)", r.window_s)
    };
    let _ = writeln!(
        out,
        "| {unit} | generations | first-token ms, mean | first-token ms, max | decode tok/s |"
    );
    let _ = writeln!(out, "| ---: | ---: | ---: | ---: | ---: |");
    for w in &r.windows {
        let _ = writeln!(
            out,
            "| {} | {} | {:.0} | {:.0} | {:.2} |",
            w.index + 1,
            w.generations,
            w.ttft_mean_ms,
            w.ttft_max_ms,
            w.decode_tok_s
        );
    }
    match r.decay {
        Some(d) => {
            let _ = writeln!(
                out,
                "\ndecay (first - last) / first {unit}: {:.1} %",
                d * 100.0
            );
        }
        None => {
            let _ = writeln!(out, "\ndecay: needs at least two {unit}s");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(end_s: f64, tokens: usize, decode_s: f64) -> GenerationRecord {
        GenerationRecord {
            end_s,
            ttft_ms: 100.0,
            tokens,
            decode_s,
            draft_threads: 2,
        }
    }

    #[test]
    fn windows_and_decay() {
        // Window 1: 2 generations of 11 tokens in 1 s decode each -> 10 tok/s;
        // window 2: one of 11 tokens in 2 s -> 5 tok/s; a tail past the last
        // full window joins it.
        let r = vec![
            rec(10.0, 11, 1.0),
            rec(50.0, 11, 1.0),
            rec(100.0, 11, 2.0),
            rec(121.0, 11, 2.0),
        ];
        let rows = windows(&r, 60.0, 121.0);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].generations, 2);
        assert!((rows[0].decode_tok_s - 10.0).abs() < 1e-9);
        assert_eq!(rows[1].generations, 2);
        assert!((rows[1].decode_tok_s - 5.0).abs() < 1e-9);
        assert!((decay(&rows).unwrap() - 0.5).abs() < 1e-9);
        assert_eq!(decay(&rows[..1]), None);
        assert!(parse_thermal("hot").is_err());
        assert_eq!(parse_thermal("serious"), Ok(ThermalState::Serious));
    }
}
