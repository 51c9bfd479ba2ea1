//! Per-run metrics, the summary, and the outputs: runs.jsonl, summary.csv, SVG
//! plots (plotters, SVG backend only: text is written as SVG <text>, no fonts are
//! read) and report.md.

use super::config::{LabConfig, Mode};
use super::device::DeviceResult;
use super::Planned;
use anyhow::{Context, Result};
use plotters::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use tandem_cli_common::compare::first_difference;
use tandem_cli_common::host::cpu_name;
use tandem_model::proposer::{ProposerKind, ProposerStat, ProposerStats};

/// Everything recorded about one run (one line of runs.jsonl).
#[derive(Clone, Debug, Serialize)]
pub struct RunRecord {
    pub run: usize,
    pub mode: String,
    pub profile: String,
    pub prompt_id: String,
    pub tags: Vec<String>,
    pub rep: usize,
    pub error: Option<String>,
    pub generated: usize,
    pub verified: usize,
    pub provisional: usize,
    pub ttft_ms: f64,
    pub total_ms: f64,
    pub tokens_per_s: f64,
    pub verified_per_s: f64,
    pub provisional_per_s: f64,
    pub itt_p50_ms: f64,
    pub itt_p95_ms: f64,
    pub acceptance: f64,
    pub mean_accepted_len: f64,
    pub mean_k: f64,
    /// Per draft position i (1-based at index i-1): rounds that reached it, and
    /// accepted it (conditional acceptance = accepted / reached).
    pub pos_reached: Vec<u64>,
    pub pos_accepted: Vec<u64>,
    pub rounds: usize,
    pub drafted: u64,
    pub accepted: u64,
    /// Rounds, drafted and accepted tokens per proposer (`auto` modes: what
    /// it chose).
    pub proposers: ProposerStats,
    pub verifier_passes: u64,
    pub passes_per_token: f64,
    pub bytes_up_per_token: f64,
    pub bytes_down_per_token: f64,
    pub rtt_mean_ms: f64,
    pub pipelined_drafts_used: usize,
    /// Provisional tokens the verifier checked after an outage, and those that
    /// differ from the target's choice.
    pub provisional_checked: usize,
    pub provisional_mismatched: usize,
    /// Verify/open failures, breaker openings, and session opens started in the
    /// background (the device drafting alone meanwhile).
    pub failures: u64,
    pub breaker_opens: u64,
    pub background_opens: u64,
    /// Greedy: output equals target-only output (None: not applicable).
    pub matches_target: Option<bool>,
    pub first_difference: Option<usize>,
    pub stop: String,
    pub tokens: Vec<u32>,
    /// Per token: verified, provisional or local.
    pub statuses: Vec<tandem_edge::TokenStatus>,
    pub text: String,
    /// Every verify round: k, accepted, RTT, drafting time on the critical path,
    /// drafts reused from pipelining.
    pub round_log: Vec<tandem_edge::adaptive::RoundRecord>,
    /// Milliseconds from the start of the generation to each token.
    pub token_ms: Vec<f64>,
    #[serde(skip)]
    itts: Vec<f64>,
    #[serde(skip)]
    ttfts: Vec<f64>,
}

pub struct Meta {
    pub origin: String,
    pub started: String,
    pub wall_s: f64,
    pub load_before: String,
    pub load_after: String,
    pub config: String,
    pub prompts: usize,
    /// The prompt set's name ([`LabConfig::prompt_set_name`]).
    pub prompt_set: String,
}

/// The `q` percentile of a sample (nearest rank, [`tandem_stats::percentile`]);
/// 0 for an empty one. Sorts `v`.
pub fn pct(v: &mut [f64], q: f64) -> f64 {
    tandem_stats::percentile_in_place(v, q).unwrap_or(0.0)
}

fn record(i: usize, p: &Planned, r: &DeviceResult) -> RunRecord {
    let s = &r.stats;
    let secs = s.total_ms / 1000.0;
    let per_s = |n: usize| if secs > 0.0 { n as f64 / secs } else { 0.0 };
    let mut itts: Vec<f64> = r.token_ms.windows(2).map(|w| w[1] - w[0]).collect();
    let itt_all = itts.clone();
    let (mut reached, mut acc) = (vec![0u64; 16], vec![0u64; 16]);
    let mut ksum = 0usize;
    let mut krounds = 0usize;
    let mut reused = 0usize;
    for rd in &r.rounds {
        if rd.k == 0 {
            continue;
        }
        ksum += rd.k;
        krounds += 1;
        reused += rd.reused;
        for pos in 0..rd.k.min(rd.accepted + 1).min(16) {
            reached[pos] += 1;
            if pos < rd.accepted {
                acc[pos] += 1;
            }
        }
    }
    let gen = s.generated_tokens.max(1) as f64;
    RunRecord {
        run: i,
        mode: p.mode.name(),
        profile: p.profile.clone(),
        prompt_id: p.prompt.id.clone(),
        tags: p.prompt.tags.clone(),
        rep: p.rep,
        error: r.error.clone(),
        generated: s.generated_tokens,
        verified: s.verified_tokens,
        provisional: s.provisional_tokens,
        ttft_ms: s.ttft_ms,
        total_ms: s.total_ms,
        tokens_per_s: per_s(s.generated_tokens),
        verified_per_s: per_s(s.verified_tokens),
        provisional_per_s: per_s(s.provisional_tokens),
        itt_p50_ms: pct(&mut itts, 0.5),
        itt_p95_ms: pct(&mut itts, 0.95),
        acceptance: s.acceptance_rate,
        mean_accepted_len: s.mean_accepted_len,
        mean_k: if krounds > 0 {
            ksum as f64 / krounds as f64
        } else {
            0.0
        },
        pos_reached: reached,
        pos_accepted: acc,
        rounds: r.rounds.len(),
        drafted: s.drafted,
        accepted: s.accepted,
        proposers: s.proposers,
        verifier_passes: s.verifier_passes,
        passes_per_token: s.verifier_passes as f64 / gen,
        bytes_up_per_token: s.bytes_sent as f64 / gen,
        bytes_down_per_token: s.bytes_received as f64 / gen,
        rtt_mean_ms: s.rtt_mean_ms,
        pipelined_drafts_used: reused,
        provisional_checked: r.provisional.checked_tokens,
        provisional_mismatched: r.provisional.mismatched_tokens,
        failures: s.failures,
        breaker_opens: s.breaker_opens,
        background_opens: s.background_opens,
        matches_target: None,
        first_difference: None,
        stop: r.stop.clone(),
        tokens: r.tokens.clone(),
        statuses: r.statuses.clone(),
        text: r.text.clone(),
        round_log: r.rounds.clone(),
        token_ms: r.token_ms.clone(),
        itts: itt_all,
        ttfts: vec![s.ttft_ms],
    }
}

/// The identity check: greedy runs against target-only output of the same prompt
/// (first profile, same repetition). Runs with provisional tokens must match up to
/// the first provisional token the verifier reported as different, or the first
/// one it never checked (the generation ended before the verifier was back).
fn check_identity(cfg: &LabConfig, recs: &mut [RunRecord], results: &[DeviceResult]) {
    if cfg.temperature != 0.0 {
        return;
    }
    let Some(ref_profile) = cfg.profiles.first() else {
        return;
    };
    let reference: BTreeMap<(String, usize), Vec<u32>> = recs
        .iter()
        .filter(|r| r.mode == "target-only" && &r.profile == ref_profile && r.error.is_none())
        .map(|r| ((r.prompt_id.clone(), r.rep), r.tokens.clone()))
        .collect();
    for (r, res) in recs.iter_mut().zip(results) {
        if r.mode == "draft-only" {
            continue;
        }
        let Some(want) = reference.get(&(r.prompt_id.clone(), r.rep)) else {
            r.matches_target = Some(false);
            continue;
        };
        if r.error.is_some() {
            r.matches_target = Some(false);
            continue;
        }
        let d = first_difference(&r.tokens, want);
        r.first_difference = d;
        let unchecked = res
            .provisional
            .spans
            .iter()
            .filter(|s| !s.checked)
            .map(|s| s.start)
            .min();
        let free_from = match (res.provisional.first_mismatch, unchecked) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        r.matches_target = Some(match (d, free_from) {
            (None, _) => true,
            // After a provisional token the target would not have chosen, the
            // output legitimately follows the streamed token.
            (Some(d), Some(m)) => d >= m,
            (Some(_), None) => false,
        });
    }
}

/// Aggregate of one (mode, profile) cell.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Cell {
    pub mode: String,
    pub profile: String,
    pub runs: usize,
    pub errors: usize,
    pub tokens: usize,
    pub tokens_per_s: f64,
    pub verified_per_s: f64,
    pub provisional_per_s: f64,
    pub ttft_ms: f64,
    pub itt_p50_ms: f64,
    pub itt_p95_ms: f64,
    pub acceptance: f64,
    pub mean_accepted_len: f64,
    pub mean_k: f64,
    pub passes_per_token: f64,
    pub bytes_up_per_token: f64,
    pub bytes_down_per_token: f64,
    pub rtt_mean_ms: f64,
    /// "yes" (every greedy run matches), "NO", or "n/a".
    pub matches_target: String,
    pub pos_reached: Vec<u64>,
    pub pos_accepted: Vec<u64>,
    /// Provisional tokens / all tokens, and of those the share the verifier
    /// disagreed with (gated modes, outages).
    pub provisional_share: f64,
    pub provisional_wrong_share: f64,
    /// Per proposer over the cell's runs.
    pub proposers: ProposerStats,
}

fn summarize(recs: &[RunRecord]) -> Vec<Cell> {
    let mut keys: Vec<(String, String)> = Vec::new();
    for r in recs {
        let k = (r.mode.clone(), r.profile.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.into_iter()
        .map(|(mode, profile)| {
            let rs: Vec<&RunRecord> = recs
                .iter()
                .filter(|r| r.mode == mode && r.profile == profile)
                .collect();
            let ok: Vec<&&RunRecord> = rs.iter().filter(|r| r.error.is_none()).collect();
            let sum = |f: &dyn Fn(&RunRecord) -> f64| ok.iter().map(|r| f(r)).sum::<f64>();
            let secs = sum(&|r| r.total_ms) / 1000.0;
            let tokens = sum(&|r| r.generated as f64);
            let per = |n: f64| if secs > 0.0 { n / secs } else { 0.0 };
            let mut itts: Vec<f64> = ok.iter().flat_map(|r| r.itts.iter().copied()).collect();
            let mut ttfts: Vec<f64> = ok.iter().flat_map(|r| r.ttfts.iter().copied()).collect();
            let drafted = sum(&|r| r.drafted as f64);
            let rounds_k: f64 = sum(&|r| {
                if r.mean_k > 0.0 {
                    r.drafted as f64 / r.mean_k
                } else {
                    0.0
                }
            });
            let mut reached = vec![0u64; 16];
            let mut acc = vec![0u64; 16];
            for r in &ok {
                for i in 0..16 {
                    reached[i] += r.pos_reached[i];
                    acc[i] += r.pos_accepted[i];
                }
            }
            let checks: Vec<bool> = rs.iter().filter_map(|r| r.matches_target).collect();
            let matches = if checks.is_empty() {
                "n/a".to_string()
            } else if checks.iter().all(|&b| b) {
                "yes".to_string()
            } else {
                "NO".to_string()
            };
            let tk = tokens.max(1.0);
            Cell {
                runs: rs.len(),
                errors: rs.len() - ok.len(),
                tokens: tokens as usize,
                tokens_per_s: per(tokens),
                verified_per_s: per(sum(&|r| r.verified as f64)),
                provisional_per_s: per(sum(&|r| r.provisional as f64)),
                ttft_ms: pct(&mut ttfts, 0.5),
                itt_p50_ms: pct(&mut itts, 0.5),
                itt_p95_ms: pct(&mut itts, 0.95),
                acceptance: if drafted > 0.0 {
                    sum(&|r| r.accepted as f64) / drafted
                } else {
                    0.0
                },
                mean_accepted_len: if rounds_k > 0.0 {
                    sum(&|r| r.accepted as f64) / rounds_k
                } else {
                    0.0
                },
                mean_k: if rounds_k > 0.0 {
                    drafted / rounds_k
                } else {
                    0.0
                },
                passes_per_token: sum(&|r| r.verifier_passes as f64) / tk,
                provisional_share: sum(&|r| r.provisional as f64) / tk,
                provisional_wrong_share: sum(&|r| r.provisional_mismatched as f64)
                    / sum(&|r| r.provisional as f64).max(1.0),
                bytes_up_per_token: sum(&|r| r.bytes_up_per_token * r.generated as f64) / tk,
                bytes_down_per_token: sum(&|r| r.bytes_down_per_token * r.generated as f64) / tk,
                rtt_mean_ms: if ok.is_empty() {
                    0.0
                } else {
                    sum(&|r| r.rtt_mean_ms) / ok.len() as f64
                },
                matches_target: matches,
                proposers: ok.iter().fold(ProposerStats::default(), |mut a, r| {
                    a.add(&r.proposers);
                    a
                }),
                pos_reached: reached,
                pos_accepted: acc,
                mode,
                profile,
            }
        })
        .collect()
}

const CSV_HEADER: [&str; 24] = [
    "mode",
    "profile",
    "runs",
    "errors",
    "tokens",
    "tokens_per_s",
    "verified_per_s",
    "provisional_per_s",
    "ttft_p50_ms",
    "itt_p50_ms",
    "itt_p95_ms",
    "acceptance",
    "mean_accepted_len",
    "mean_k",
    "verifier_passes_per_token",
    "bytes_up_per_token",
    "bytes_down_per_token",
    "rtt_mean_ms",
    "matches_target",
    "draft_rounds",
    "lookup_rounds",
    "none_rounds",
    "draft_acceptance",
    "lookup_acceptance",
];

/// summary.csv: one row per cell, written by the `csv` crate (a profile's name is
/// the user's and may hold a comma or a quote: such fields are quoted).
fn csv(cells: &[Cell]) -> Result<String> {
    let mut w = csv::Writer::from_writer(Vec::new());
    w.write_record(CSV_HEADER)?;
    for c in cells {
        w.write_record([
            c.mode.clone(),
            c.profile.clone(),
            c.runs.to_string(),
            c.errors.to_string(),
            c.tokens.to_string(),
            format!("{:.3}", c.tokens_per_s),
            format!("{:.3}", c.verified_per_s),
            format!("{:.3}", c.provisional_per_s),
            format!("{:.1}", c.ttft_ms),
            format!("{:.1}", c.itt_p50_ms),
            format!("{:.1}", c.itt_p95_ms),
            format!("{:.4}", c.acceptance),
            format!("{:.3}", c.mean_accepted_len),
            format!("{:.2}", c.mean_k),
            format!("{:.4}", c.passes_per_token),
            format!("{:.1}", c.bytes_up_per_token),
            format!("{:.1}", c.bytes_down_per_token),
            format!("{:.1}", c.rtt_mean_ms),
            c.matches_target.clone(),
            c.proposers.draft.rounds.to_string(),
            c.proposers.lookup.rounds.to_string(),
            c.proposers.none_rounds.to_string(),
            format!("{:.4}", acceptance_of(&c.proposers.draft)),
            format!("{:.4}", acceptance_of(&c.proposers.lookup)),
        ])?;
    }
    let bytes = w.into_inner().context("writing summary.csv")?;
    String::from_utf8(bytes).context("summary.csv is not UTF-8")
}

/// Accepted / drafted tokens of one proposer (0 when it drafted nothing).
fn acceptance_of(p: &ProposerStat) -> f64 {
    p.accepted as f64 / p.drafted.max(1) as f64
}

fn markdown_table(cells: &[Cell]) -> String {
    let mut s = String::from(
        "| mode | profile | runs | tok/s | verified tok/s | provisional tok/s | TTFT p50 ms | ITT p50 / p95 ms | acceptance | mean accepted | mean k | verifier passes / token | bytes up / down per token | = target-only |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
    );
    for c in cells {
        let spec = c.mean_k > 0.0;
        let dash = |v: String| if spec { v } else { "-".into() };
        let _ = writeln!(
            s,
            "| {} | {} | {}{} | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} / {:.0} | {} | {} | {} | {:.2} | {:.0} / {:.0} | {} |",
            c.mode,
            c.profile,
            c.runs,
            if c.errors > 0 {
                format!(" ({} failed)", c.errors)
            } else {
                String::new()
            },
            c.tokens_per_s,
            c.verified_per_s,
            c.provisional_per_s,
            c.ttft_ms,
            c.itt_p50_ms,
            c.itt_p95_ms,
            dash(format!("{:.0}%", c.acceptance * 100.0)),
            dash(format!("{:.2}", c.mean_accepted_len)),
            dash(format!("{:.1}", c.mean_k)),
            c.passes_per_token,
            c.bytes_up_per_token,
            c.bytes_down_per_token,
            if c.matches_target == "NO" {
                "**NO**".to_string()
            } else {
                c.matches_target.clone()
            }
        );
    }
    s
}

/// speculative / target-only and speculative / draft-only tokens/s per profile.
fn ratios(cells: &[Cell], profiles: &[String]) -> String {
    let draft = cells
        .iter()
        .find(|c| c.mode == "draft-only")
        .map(|c| c.tokens_per_s);
    let mut s = String::from(
        "| mode | profile | tok/s | / target-only | / draft-only |\n| --- | --- | ---: | ---: | ---: |\n",
    );
    for p in profiles {
        let target = cells
            .iter()
            .find(|c| c.mode == "target-only" && &c.profile == p)
            .map(|c| c.tokens_per_s);
        for c in cells.iter().filter(|c| &c.profile == p && c.mean_k > 0.0) {
            let _ = writeln!(
                s,
                "| {} | {} | {:.2} | {} | {} |",
                c.mode,
                p,
                c.tokens_per_s,
                ratio(c.tokens_per_s, target),
                ratio(c.tokens_per_s, draft)
            );
        }
    }
    s
}

/// Per profile: adaptive (and adaptive-pipeline) against the best fixed spec-kN,
/// and each pipeline-kN against spec-kN.
fn comparisons(cells: &[Cell], profiles: &[String]) -> String {
    let mut s = String::from(
        "| profile | mode | tok/s | compared with | its tok/s | ratio |\n| --- | --- | ---: | --- | ---: | ---: |\n",
    );
    let mut rows = 0;
    for p in profiles {
        let here: Vec<&Cell> = cells.iter().filter(|c| &c.profile == p).collect();
        let best_fixed = here
            .iter()
            .filter(|c| c.mode.starts_with("spec-k"))
            .max_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s));
        for c in &here {
            let other = if c.mode.starts_with("adaptive") {
                best_fixed.copied()
            } else if let Some(k) = c.mode.strip_prefix("pipeline-k") {
                here.iter()
                    .find(|o| o.mode == format!("spec-k{k}"))
                    .copied()
            } else {
                None
            };
            if let Some(o) = other {
                if o.tokens_per_s > 0.0 {
                    rows += 1;
                    let _ = writeln!(
                        s,
                        "| {p} | {} | {:.2} | {} | {:.2} | {:.2} |",
                        c.mode,
                        c.tokens_per_s,
                        o.mode,
                        o.tokens_per_s,
                        c.tokens_per_s / o.tokens_per_s
                    );
                }
            }
        }
    }
    if rows == 0 {
        return "(no adaptive or pipeline modes next to fixed-k ones in this matrix)\n".into();
    }
    s
}

/// Proposers: each `lookup-kN` / `auto-kN` cell next to `spec-kN` (the draft
/// model) on the same profile: user-visible tok/s, verifier passes and bytes
/// up per token, and which proposer drafted the rounds with what acceptance.
fn proposers(cells: &[Cell], profiles: &[String]) -> Option<String> {
    let mut s = String::from(
        "| profile | mode | tok/s | vs spec-kN tok/s | verifier passes / token | vs spec-kN passes | bytes up / token | vs spec-kN bytes up | draft rounds (acceptance) | lookup rounds (acceptance) | rounds without proposal |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let share = |p: &ProposerStat| {
        if p.rounds == 0 {
            "0".to_string()
        } else {
            format!("{} ({:.0}%)", p.rounds, 100.0 * acceptance_of(p))
        }
    };
    let mut rows = 0;
    let mut others = false;
    for p in profiles {
        for c in cells.iter().filter(|c| &c.profile == p) {
            let Ok(Mode::Spec {
                k,
                adaptive: false,
                pipeline: false,
                proposer,
            }) = Mode::parse(&c.mode)
            else {
                continue;
            };
            others |= proposer != ProposerKind::Draft;
            let draft = spec_cell(cells, p, k);
            rows += 1;
            let _ = writeln!(
                s,
                "| {p} | {} | {:.2} | {} | {:.2} | {} | {:.0} | {} | {} | {} | {} |",
                c.mode,
                c.tokens_per_s,
                ratio(c.tokens_per_s, draft.map(|o| o.tokens_per_s)),
                c.passes_per_token,
                ratio(c.passes_per_token, draft.map(|o| o.passes_per_token)),
                c.bytes_up_per_token,
                ratio(c.bytes_up_per_token, draft.map(|o| o.bytes_up_per_token)),
                share(&c.proposers.draft),
                share(&c.proposers.lookup),
                c.proposers.none_rounds,
            );
        }
    }
    (rows > 0 && others).then_some(s)
}

/// `a / b` to two decimals, or "-" without a positive baseline.
fn ratio(a: f64, b: Option<f64>) -> String {
    match b {
        Some(b) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    }
}

/// The `spec-kN` cell (the draft model, fixed `k`) on `profile`: the
/// baseline of the proposer and gating tables.
fn spec_cell<'a>(cells: &'a [Cell], profile: &str, k: usize) -> Option<&'a Cell> {
    let name = Mode::Spec {
        k,
        adaptive: false,
        pipeline: false,
        proposer: ProposerKind::Draft,
    }
    .name();
    cells
        .iter()
        .find(|o| o.profile == profile && o.mode == name)
}

/// Uncertainty-gated verification: each `gated-kN-T` cell next to `spec-kN` on
/// the same profile (round trips and uplink saved vs shown tokens that were wrong).
fn gating(cells: &[Cell], profiles: &[String]) -> Option<String> {
    let mut s = String::from(
        "| profile | mode | tok/s | verifier passes / token | bytes up / token | provisional | provisional wrong | vs spec-kN tok/s | vs spec-kN passes |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let mut rows = 0;
    for p in profiles {
        for c in cells.iter().filter(|c| &c.profile == p) {
            let Ok(Mode::Gated { k, .. }) = Mode::parse(&c.mode) else {
                continue;
            };
            let plain = spec_cell(cells, p, k);
            rows += 1;
            let _ = writeln!(
                s,
                "| {p} | {} | {:.2} | {:.2} | {:.0} | {:.0}% | {:.1}% | {} | {} |",
                c.mode,
                c.tokens_per_s,
                c.passes_per_token,
                c.bytes_up_per_token,
                c.provisional_share * 100.0,
                c.provisional_wrong_share * 100.0,
                ratio(c.tokens_per_s, plain.map(|o| o.tokens_per_s)),
                ratio(c.passes_per_token, plain.map(|o| o.passes_per_token)),
            );
        }
    }
    (rows > 0).then_some(s)
}

type Series = Vec<(String, Vec<f64>)>;

pub fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("plotting: {e:?}")
}

/// Grouped bars: one group per category, one bar per series.
fn bar_chart(
    path: &Path,
    title: &str,
    y_desc: &str,
    cats: &[String],
    series: &Series,
) -> Result<()> {
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let ymax = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.25;
    let n = cats.len().max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..n as f64, 0f64..ymax)
        .map_err(plot_err)?;
    let names = cats.to_vec();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&|x| {
            let f = x - 0.5;
            let i = f.round();
            if (f - i).abs() < 0.01 && i >= 0.0 && (i as usize) < names.len() {
                names[i as usize].clone()
            } else {
                String::new()
            }
        })
        .y_desc(y_desc)
        .draw()
        .map_err(plot_err)?;
    let m = series.len().max(1) as f64;
    let w = 0.8 / m;
    for (si, (name, vals)) in series.iter().enumerate() {
        let color = Palette99::pick(si).to_rgba();
        chart
            .draw_series(vals.iter().enumerate().filter(|(_, v)| v.is_finite()).map(
                move |(ci, v)| {
                    let x0 = ci as f64 + 0.1 + si as f64 * w;
                    Rectangle::new([(x0, 0.0), (x0 + w * 0.9, *v)], color.filled())
                },
            ))
            .map_err(plot_err)?
            .label(name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(())
}

/// Lines with points in an SVG file of its own; x on a log10 scale when `log_x`.
fn line_chart(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_x: bool,
) -> Result<()> {
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    draw_line_chart(&root, title, x_desc, y_desc, series, log_x)?;
    root.present().map_err(plot_err)?;
    Ok(())
}

/// Lines with points drawn on `root` (a whole SVG or one panel of it); x on a
/// log10 scale when `log_x`. The caller presents the root.
pub fn draw_line_chart(
    root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_x: bool,
) -> Result<()> {
    root.fill(&WHITE).map_err(plot_err)?;
    let tx = |x: f64| if log_x { x.max(1e-3).log10() } else { x };
    let pts = series.iter().flat_map(|(_, v)| v.iter().copied());
    let (mut x0, mut x1, mut y1) = (f64::MAX, f64::MIN, 0.0f64);
    for (x, y) in pts {
        x0 = x0.min(tx(x));
        x1 = x1.max(tx(x));
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1) = (0.0, 1.0);
    }
    if (x1 - x0).abs() < 1e-9 {
        x1 = x0 + 1.0;
    }
    let pad = (x1 - x0) * 0.05;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((x0 - pad)..(x1 + pad), 0f64..(y1.max(1e-9) * 1.25))
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&|x| {
            if log_x {
                let v = 10f64.powf(*x);
                if v >= 10.0 || (v - v.round()).abs() < 0.005 {
                    format!("{v:.0}")
                } else {
                    format!("{v:.2}")
                }
            } else {
                format!("{x:.0}")
            }
        })
        .draw()
        .map_err(plot_err)?;
    for (si, (name, v)) in series.iter().enumerate() {
        let color = Palette99::pick(si).to_rgba();
        let data: Vec<(f64, f64)> = v.iter().map(|&(x, y)| (tx(x), y)).collect();
        chart
            .draw_series(LineSeries::new(data.clone(), color.stroke_width(2)))
            .map_err(plot_err)?
            .label(name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 14, y)], color.stroke_width(2))
            });
        chart
            .draw_series(data.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(plot_err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.85))
        .draw()
        .map_err(plot_err)?;
    Ok(())
}

fn nominal_rtt(profile: &str) -> Option<f64> {
    tandem_netsim::PROFILES
        .iter()
        .find(|p| p.name == profile)
        .map(|p| p.rtt_ms)
}

fn plots(out: &Path, cfg: &LabConfig, cells: &[Cell]) -> Result<Vec<(&'static str, &'static str)>> {
    let mut modes: Vec<String> = Vec::new();
    for c in cells {
        if !modes.contains(&c.mode) {
            modes.push(c.mode.clone());
        }
    }
    let mut profiles: Vec<String> = cfg.profiles.clone();
    for c in cells {
        if c.profile != "device" && !profiles.contains(&c.profile) {
            profiles.push(c.profile.clone());
        }
    }
    let get = |m: &str, p: &str, f: &dyn Fn(&Cell) -> f64| -> f64 {
        cells
            .iter()
            .find(|c| c.mode == m && (c.profile == p || (c.mode == "draft-only")))
            .map(f)
            .unwrap_or(f64::NAN)
    };
    // 1. tokens/s by profile and mode (draft-only is the same bar everywhere).
    let series: Series = modes
        .iter()
        .map(|m| {
            (
                m.clone(),
                profiles
                    .iter()
                    .map(|p| get(m, p, &|c| c.tokens_per_s))
                    .collect(),
            )
        })
        .collect();
    bar_chart(
        &out.join("tokens_per_s.svg"),
        "User-visible tokens/s by network profile and mode",
        "tokens/s",
        &profiles,
        &series,
    )?;
    // 2. tokens/s vs nominal RTT (named profiles only).
    let mut rtt_series = Vec::new();
    for m in &modes {
        let mut v: Vec<(f64, f64)> = cfg
            .profiles
            .iter()
            .filter_map(|p| Some((nominal_rtt(p)?, get(m, p, &|c| c.tokens_per_s))))
            .filter(|(_, y)| y.is_finite())
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        rtt_series.push((m.clone(), v));
    }
    line_chart(
        &out.join("tokens_per_s_vs_rtt.svg"),
        "Tokens/s vs the profile's round-trip time",
        "nominal RTT (ms, log scale)",
        "tokens/s",
        &rtt_series,
        true,
    )?;
    // 3. acceptance by draft position (speculative modes, over all profiles).
    let mut acc_series = Vec::new();
    for m in &modes {
        let (mut r, mut a) = (vec![0u64; 16], vec![0u64; 16]);
        for c in cells.iter().filter(|c| &c.mode == m) {
            for i in 0..16 {
                r[i] += c.pos_reached[i];
                a[i] += c.pos_accepted[i];
            }
        }
        let v: Vec<(f64, f64)> = (0..16)
            .filter(|&i| r[i] >= 3)
            .map(|i| ((i + 1) as f64, a[i] as f64 / r[i] as f64))
            .collect();
        if !v.is_empty() {
            acc_series.push((m.clone(), v));
        }
    }
    line_chart(
        &out.join("acceptance_by_position.svg"),
        "Acceptance by draft position (given all earlier positions accepted)",
        "draft position",
        "P(accepted | reached)",
        &acc_series,
        false,
    )?;
    // 4. verifier passes per generated token.
    let net_modes: Vec<&String> = modes.iter().filter(|m| *m != "draft-only").collect();
    let series: Series = net_modes
        .iter()
        .map(|m| {
            (
                (*m).clone(),
                profiles
                    .iter()
                    .map(|p| get(m, p, &|c| c.passes_per_token))
                    .collect(),
            )
        })
        .collect();
    bar_chart(
        &out.join("verifier_passes_per_token.svg"),
        "Target forward passes per generated token (cloud compute)",
        "passes / token",
        &profiles,
        &series,
    )?;
    Ok(vec![
        ("tokens_per_s.svg", "tokens/s by profile and mode"),
        ("tokens_per_s_vs_rtt.svg", "tokens/s vs RTT"),
        ("acceptance_by_position.svg", "acceptance by draft position"),
        ("verifier_passes_per_token.svg", "verifier passes per token"),
    ])
}

fn machine() -> String {
    let cpu = cpu_name().unwrap_or_else(|| "?".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    format!("{cores} cores, {cpu}")
}

fn git_commit() -> String {
    let run = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    match run(&["rev-parse", "--short", "HEAD"]) {
        Some(c) => {
            let dirty = run(&["status", "--porcelain", "--untracked-files=no"])
                .map(|s| !s.is_empty())
                .unwrap_or(false);
            format!(
                "{c}{}",
                if dirty {
                    " (+ uncommitted changes)"
                } else {
                    ""
                }
            )
        }
        None => "? (not a git checkout)".into(),
    }
}

fn model_line(role: tandem_fetch::ModelRole, explicit: Option<&std::path::PathBuf>) -> String {
    let p = explicit
        .cloned()
        .unwrap_or_else(|| tandem_fetch::model_path(role));
    let size = std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
    format!("{} ({size} B)", p.display())
}

/// Writes every output; returns the number of greedy runs that differ from
/// target-only output.
pub fn write_all(
    out: &Path,
    cfg: &LabConfig,
    planned: &[Planned],
    results: &[DeviceResult],
    meta: &Meta,
) -> Result<usize> {
    let mut recs: Vec<RunRecord> = planned
        .iter()
        .zip(results)
        .enumerate()
        .map(|(i, (p, r))| record(i, p, r))
        .collect();
    check_identity(cfg, &mut recs, results);
    let mut jsonl = String::new();
    for r in &recs {
        jsonl.push_str(&serde_json::to_string(r)?);
        jsonl.push('\n');
    }
    std::fs::write(out.join("runs.jsonl"), jsonl).context("writing runs.jsonl")?;
    let cells = summarize(&recs);
    std::fs::write(out.join("summary.csv"), csv(&cells)?).context("writing summary.csv")?;
    let figs = plots(out, cfg, &cells)?;
    let bad: Vec<&RunRecord> = recs
        .iter()
        .filter(|r| r.matches_target == Some(false))
        .collect();
    let errors = recs.iter().filter(|r| r.error.is_some()).count();
    let mut md = String::from("# Tandem lab report\n\n");
    if !bad.is_empty() {
        let _ = writeln!(
            md,
            "> **WARNING: {} greedy run(s) do NOT equal target-only output.** This breaks Tandem's invariant; runs:\n",
            bad.len()
        );
        for r in &bad {
            let _ = writeln!(
                md,
                "> - run {} {} / {} / prompt {} rep {}: first difference at token {:?}{}",
                r.run,
                r.mode,
                r.profile,
                r.prompt_id,
                r.rep,
                r.first_difference,
                r.error
                    .as_ref()
                    .map(|e| format!(" (error: {e})"))
                    .unwrap_or_default()
            );
        }
        md.push('\n');
    }
    let _ = writeln!(
        md,
        "- started {} UTC, wall time {:.0} s, {} runs ({} failed), {} prompts × {} repetition(s)",
        meta.started,
        meta.wall_s,
        recs.len(),
        errors,
        meta.prompts,
        cfg.repetitions
    );
    let _ = writeln!(md, "- matrix: {}", meta.origin);
    let _ = writeln!(md, "- prompt set: {}", meta.prompt_set);
    let _ = writeln!(md, "- machine: {}", machine());
    let _ = writeln!(
        md,
        "- load average before: {}; after: {} (other work on the machine depresses every number)",
        meta.load_before, meta.load_after
    );
    let _ = writeln!(md, "- commit: {}", git_commit());
    let _ = writeln!(
        md,
        "- draft (device): {}",
        model_line(tandem_fetch::ModelRole::Draft, cfg.draft_model.as_ref())
    );
    let _ = writeln!(
        md,
        "- target (verifier): {}",
        model_line(tandem_fetch::ModelRole::Target, cfg.target_model.as_ref())
    );
    let _ = writeln!(
        md,
        "- pinning: device `taskset -c {}`, verifier and netsim `taskset -c {}`, RAYON_NUM_THREADS={}; sampling: {}",
        cfg.device_cores,
        cfg.verifier_cores,
        cfg.threads,
        if cfg.temperature == 0.0 {
            "greedy".to_string()
        } else {
            format!("temperature {}", cfg.temperature)
        }
    );
    md.push_str("\n## Summary\n\ntok/s = all generated tokens / all generation time of the cell (prefill and TTFT included, model load excluded). How to read every column: docs/lab.md.\n\n");
    md.push_str(&markdown_table(&cells));
    md.push_str("\n## Ratios (tokens/s)\n\n");
    md.push_str(&ratios(&cells, &cfg.profiles));
    md.push_str("\n## Plots\n\n");
    for (f, cap) in figs {
        let _ = writeln!(md, "### {cap}\n\n![{cap}]({f})\n");
    }
    md.push_str("\n## Adaptive k vs the best fixed k, pipelining vs plain (tokens/s)\n\n");
    md.push_str(&comparisons(&cells, &cfg.profiles));
    md.push('\n');
    if let Some(t) = proposers(&cells, &cfg.profiles) {
        md.push_str("## Proposers (lookup-kN and auto-kN vs spec-kN, the draft model)\n\n");
        md.push_str(&t);
        md.push('\n');
    }
    if let Some(g) = gating(&cells, &cfg.profiles) {
        md.push_str("## Uncertainty-gated verification (gated-kN-T vs spec-kN)\n\n");
        md.push_str(&g);
        md.push('\n');
    }
    let mut adaptive = String::new();
    for c in cells.iter().filter(|c| c.mode.starts_with("adaptive")) {
        let _ = writeln!(
            adaptive,
            "- {} / {}: mean k {:.2}, acceptance {:.0}%",
            c.mode,
            c.profile,
            c.mean_k,
            c.acceptance * 100.0
        );
    }
    if !adaptive.is_empty() {
        md.push_str("## Adaptive k: the chosen block lengths\n\n");
        md.push_str(&adaptive);
        md.push('\n');
    }
    md.push_str("## Settings\n\n```toml\n");
    md.push_str(&meta.config);
    md.push_str("```\n\nRaw data: runs.jsonl (one line per run), summary.csv (one line per mode × profile), logs/ (child processes).\n");
    std::fs::write(out.join("report.md"), md).context("writing report.md")?;
    Ok(bad.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_quotes_a_profile_name_with_a_comma() {
        let cells = [
            Cell {
                mode: "spec-k4".into(),
                profile: "wifi, \"good\" day".into(),
                runs: 2,
                matches_target: "yes".into(),
                ..Cell::default()
            },
            Cell {
                mode: "target-only".into(),
                profile: "lte".into(),
                runs: 1,
                matches_target: "n/a".into(),
                ..Cell::default()
            },
        ];
        let text = csv(&cells).expect("csv");
        let mut lines = text.lines();
        assert_eq!(lines.next(), Some(CSV_HEADER.join(",").as_str()));
        let row = lines.next().expect("a first row");
        assert!(
            row.starts_with("spec-k4,\"wifi, \"\"good\"\" day\",2,0,0,0.000,"),
            "{row}"
        );
        assert!(lines
            .next()
            .expect("a second row")
            .starts_with("target-only,lte,1,"));
        assert_eq!(lines.next(), None);
        // Read back, the name is whole and every row has every column.
        let mut r = csv::Reader::from_reader(text.as_bytes());
        let rows: Vec<csv::StringRecord> = r.records().collect::<Result<_, _>>().expect("rows");
        assert_eq!(rows.len(), 2);
        assert_eq!(&rows[0][1], "wifi, \"good\" day");
        assert!(rows.iter().all(|r| r.len() == CSV_HEADER.len()));
        assert_eq!(&rows[0][18], "yes");
    }
}
