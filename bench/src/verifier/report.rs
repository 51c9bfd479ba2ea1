//! The figures of `tandem bench verifier`: per configuration (mode, batching,
//! N) from what the devices saw and the verifier's /proc and /metrics, the
//! ratios against issue 17's targets, the table, and the SVG plot. The JSON
//! schema is documented in docs/cli.md ("tandem bench verifier --json").

use super::replay::{CellRun, DeviceRun};
use crate::report::Machine;
use anyhow::Result;
use plotters::prelude::*;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;
use tandem_lab::report::{draw_line_chart, pct, plot_err};

/// Version of the `--json` document; bump when a field changes meaning.
pub const SCHEMA_VERSION: u32 = 1;

/// The verifier's histogram of rows per forward (the batching scheduler's).
pub const BATCH_ROWS_METRIC: &str = "tandem_verifier_batch_rows";
/// The verifier's gauge of KV bytes held by sessions.
pub const SESSION_BYTES_METRIC: &str = "tandem_verifier_session_bytes";

/// What the coordinator reads from the verifier (and itself) at both ends of
/// the window.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// utime + stime of the verifier process, seconds.
    pub verifier_cpu_s: Option<f64>,
    /// utime + stime of this process (the simulated devices), seconds.
    pub client_cpu_s: Option<f64>,
    /// The verifier's /metrics text.
    pub metrics: Option<String>,
    /// VmHWM of the verifier process, bytes.
    pub peak_rss: Option<u64>,
}

/// Distribution summary of a sample.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Quantiles {
    pub p50: f64,
    pub p95: f64,
    pub min: f64,
    pub max: f64,
    pub mean: f64,
    pub count: usize,
}

impl Quantiles {
    pub fn of(xs: &[f64]) -> Self {
        let mut v = xs.to_vec();
        let n = v.len();
        Self {
            p50: pct(&mut v, 0.5),
            p95: pct(&mut v, 0.95),
            min: v.first().copied().unwrap_or(0.0),
            max: v.last().copied().unwrap_or(0.0),
            mean: if n > 0 {
                v.iter().sum::<f64>() / n as f64
            } else {
                0.0
            },
            count: n,
        }
    }
}

/// One histogram bucket: forwards whose row count is in (previous le, le].
#[derive(Clone, Debug, Serialize)]
pub struct Bucket {
    pub le: String,
    pub count: u64,
}

/// Rows per forward during the window (deltas of the verifier's histogram).
#[derive(Clone, Debug, Serialize)]
pub struct BatchRows {
    pub forwards: u64,
    pub rows: f64,
    pub mean: f64,
    /// Upper bound of the bucket holding the median / 95th percentile forward.
    pub p50_le: Option<String>,
    pub p95_le: Option<String>,
    pub buckets: Vec<Bucket>,
}

/// One configuration: mode × batching × N devices, with a fresh verifier.
#[derive(Clone, Debug, Serialize)]
pub struct Cell {
    pub mode: String,
    pub batching: bool,
    pub devices: usize,
    /// Every device opened and replayed without error or mismatch.
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// From the window start to the last device's last verdict, seconds.
    pub window_s: f64,
    /// Verdicts received in the window, and the tokens they emitted.
    pub rounds: usize,
    pub tokens: u64,
    /// tokens / window_s.
    pub aggregate_tok_s: f64,
    /// Per device: its tokens / (window start -> its last verdict).
    pub session_tok_s: Quantiles,
    /// Client-measured Draft sent -> Verdict received, in the window.
    pub verify_ms: Quantiles,
    /// Open sent -> Opened received (prefill; before the window).
    pub open_ms: Quantiles,
    /// Absent when the verifier exports no `tandem_verifier_batch_rows`.
    pub batch_rows: Option<BatchRows>,
    pub verifier_cpu_s: Option<f64>,
    pub cpu_s_per_token: Option<f64>,
    pub client_cpu_s: Option<f64>,
    pub peak_rss_bytes: Option<u64>,
    /// `tandem_verifier_session_bytes` at the window end (None: not exported).
    pub kv_bytes: Option<u64>,
    pub verdicts_checked: usize,
    pub verdict_mismatches: usize,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mismatches: Vec<String>,
}

fn delta(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(b? - a?)
}

impl Cell {
    /// A configuration that could not run at all (the verifier did not start).
    pub fn failed(mode: &str, batching: bool, devices: usize, error: String) -> Self {
        Self::from_devices(mode, batching, devices, &[], 0.0, Some(error))
    }

    /// `runs`: per device its run, tokens in the window, rounds in the
    /// window and its own tokens/s.
    fn from_devices(
        mode: &str,
        batching: bool,
        devices: usize,
        runs: &[(&DeviceRun, u64, usize, f64)],
        window_s: f64,
        error: Option<String>,
    ) -> Self {
        let tokens: u64 = runs.iter().map(|r| r.1).sum();
        let rounds: usize = runs.iter().map(|r| r.2).sum();
        let opens: Vec<f64> = runs
            .iter()
            .filter_map(|r| r.0.open)
            .map(|d| d.as_secs_f64() * 1000.0)
            .collect();
        let mismatches: Vec<String> = runs.iter().filter_map(|r| r.0.mismatch.clone()).collect();
        let errors: Vec<String> = runs.iter().filter_map(|r| r.0.error.clone()).collect();
        let error = error.or_else(|| {
            (!errors.is_empty()).then(|| {
                format!(
                    "{} of {devices} device(s) failed, first: {}",
                    errors.len(),
                    errors[0]
                )
            })
        });
        Self {
            mode: mode.to_owned(),
            batching,
            devices,
            ok: error.is_none() && mismatches.is_empty(),
            error,
            window_s,
            rounds,
            tokens,
            aggregate_tok_s: if window_s > 0.0 {
                tokens as f64 / window_s
            } else {
                0.0
            },
            session_tok_s: Quantiles::of(&runs.iter().map(|r| r.3).collect::<Vec<_>>()),
            verify_ms: Quantiles::default(),
            open_ms: Quantiles::of(&opens),
            batch_rows: None,
            verifier_cpu_s: None,
            cpu_s_per_token: None,
            client_cpu_s: None,
            peak_rss_bytes: None,
            kv_bytes: None,
            verdicts_checked: runs.iter().map(|r| r.0.checked).sum(),
            verdict_mismatches: mismatches.len(),
            mismatches,
        }
    }

    /// The figures of one configuration's run.
    pub fn from_run(mode: &str, batching: bool, run: &CellRun<Snapshot>) -> Self {
        let end = run.end.max(run.start);
        let window_s = (end - run.start).as_secs_f64();
        let runs: Vec<(&DeviceRun, u64, usize, f64)> = run
            .devices
            .iter()
            .map(|d| {
                let n = d.samples.iter().filter(|s| s.at <= end).count();
                let t: u64 = d.samples[..n].iter().map(|s| u64::from(s.tokens)).sum();
                let own = d.samples[..n]
                    .last()
                    .map_or(0.0, |s| (s.at - run.start).as_secs_f64());
                let rate = if own > 0.0 { t as f64 / own } else { 0.0 };
                (d, t, n, rate)
            })
            .collect();
        let mut c = Self::from_devices(mode, batching, run.devices.len(), &runs, window_s, None);
        let lat: Vec<f64> = runs
            .iter()
            .flat_map(|(d, _, n, _)| d.samples[..*n].iter())
            .map(|s| s.latency.as_secs_f64() * 1000.0)
            .collect();
        c.verify_ms = Quantiles::of(&lat);
        let (b, a) = (&run.before, &run.after);
        c.verifier_cpu_s = delta(b.verifier_cpu_s, a.verifier_cpu_s);
        c.client_cpu_s = delta(b.client_cpu_s, a.client_cpu_s);
        c.cpu_s_per_token = c
            .verifier_cpu_s
            .filter(|_| c.tokens > 0)
            .map(|s| s / c.tokens as f64);
        c.peak_rss_bytes = a.peak_rss;
        if let Some(m) = &a.metrics {
            c.kv_bytes = gauge(m, SESSION_BYTES_METRIC).map(|v| v as u64);
            c.batch_rows = batch_rows(b.metrics.as_deref().unwrap_or(""), m);
        }
        c
    }

    pub fn label(&self) -> String {
        format!(
            "{} {}",
            self.mode,
            if self.batching {
                "batched"
            } else {
                "unbatched"
            }
        )
    }
}

/// The value of an unlabelled Prometheus sample `name`.
pub fn gauge(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}

/// A Prometheus histogram: (le, cumulative count) per bucket, sum, count.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(String, u64)>,
    pub sum: f64,
    pub count: u64,
}

/// Parses histogram `name` (None when the text has no `<name>_count`).
pub fn histogram(text: &str, name: &str) -> Option<Histogram> {
    let bucket = format!("{name}_bucket{{");
    let mut h = Histogram {
        count: gauge(text, &format!("{name}_count"))? as u64,
        sum: gauge(text, &format!("{name}_sum")).unwrap_or(0.0),
        buckets: Vec::new(),
    };
    for l in text.lines() {
        let Some(rest) = l.strip_prefix(&bucket) else {
            continue;
        };
        let Some((labels, value)) = rest.split_once('}') else {
            continue;
        };
        let le = labels
            .split(',')
            .find_map(|kv| kv.trim().strip_prefix("le="))
            .map(|v| v.trim_matches('"').to_owned());
        if let (Some(le), Ok(v)) = (le, value.trim().parse::<f64>()) {
            h.buckets.push((le, v as u64));
        }
    }
    Some(h)
}

/// The window's rows-per-forward distribution: `after` minus `before`.
fn batch_rows(before: &str, after: &str) -> Option<BatchRows> {
    let a = histogram(after, BATCH_ROWS_METRIC)?;
    let b = histogram(before, BATCH_ROWS_METRIC).unwrap_or_default();
    let cum_before = |le: &str| {
        b.buckets
            .iter()
            .find(|(x, _)| x == le)
            .map_or(0, |(_, c)| *c)
    };
    let cumulative: Vec<(String, u64)> = a
        .buckets
        .iter()
        .map(|(le, c)| (le.clone(), c.saturating_sub(cum_before(le))))
        .collect();
    let forwards = a.count.saturating_sub(b.count);
    let rows = a.sum - b.sum;
    let at = |q: f64| {
        let need = (q * forwards as f64).ceil().max(1.0) as u64;
        cumulative
            .iter()
            .find(|(_, c)| *c >= need)
            .map(|(le, _)| le.clone())
    };
    let mut prev = 0;
    let buckets = cumulative
        .iter()
        .map(|(le, c)| {
            let count = c.saturating_sub(prev);
            prev = *c;
            Bucket {
                le: le.clone(),
                count,
            }
        })
        .collect();
    Some(BatchRows {
        forwards,
        rows,
        mean: if forwards > 0 {
            rows / forwards as f64
        } else {
            0.0
        },
        p50_le: (forwards > 0).then(|| at(0.5)).flatten(),
        p95_le: (forwards > 0).then(|| at(0.95)).flatten(),
        buckets,
    })
}

/// One of the targets, computed from the cells of this run.
#[derive(Clone, Debug, Serialize)]
pub struct Ratio {
    pub name: String,
    /// What is divided by what.
    pub what: String,
    /// The N the ratio was taken at (the named N when measured, else the
    /// largest measured N; see docs/benchmarks.md).
    pub devices: Option<usize>,
    pub value: Option<f64>,
    /// The target, e.g. ">= 2.0" (empty when the issue sets none).
    pub target: String,
    pub met: Option<bool>,
    /// Why the value is missing, or the figures behind it.
    pub note: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    pub devices: Vec<usize>,
    pub modes: Vec<String>,
    pub batching: Vec<bool>,
    pub prompt_ids: Vec<String>,
    pub tokens: usize,
    /// Each prompt cut to its last this many tokens (null: whole prompts).
    pub prompt_tail: Option<usize>,
    pub k: usize,
    pub mixed_ks: Vec<usize>,
    pub threads: usize,
    pub verifier_cores: String,
    pub pinned: bool,
    pub quick: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct ModelInfo {
    pub target_path: String,
    pub target_bytes: u64,
    pub target_sha256: String,
    pub draft_sha256: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct TraceInfo {
    pub path: String,
    /// Read from the cache (false: recorded by this run).
    pub reused: bool,
    pub record_seconds: f64,
    /// Recorded rounds per schedule (all prompts).
    pub rounds: Vec<(String, usize)>,
}

/// The whole `--json` document.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub schema_version: u32,
    pub tandem_version: String,
    pub date_utc: String,
    pub wall_s: f64,
    pub machine: Machine,
    pub settings: Settings,
    pub model: ModelInfo,
    pub trace: TraceInfo,
    pub cells: Vec<Cell>,
    pub ratios: Vec<Ratio>,
    pub verdicts_checked: usize,
    pub verdict_mismatches: usize,
    pub ok: bool,
}

fn find<'a>(cells: &'a [Cell], mode: &str, batching: bool, n: usize) -> Option<&'a Cell> {
    cells
        .iter()
        .find(|c| c.mode == mode && c.batching == batching && c.devices == n && c.ok)
}

/// `want` when measured, else the largest measured N (0 when none).
fn n_near(cells: &[Cell], want: usize) -> usize {
    if cells.iter().any(|c| c.devices == want) {
        return want;
    }
    cells.iter().map(|c| c.devices).max().unwrap_or(0)
}

fn ratio(
    name: &str,
    what: &str,
    n: usize,
    parts: Option<(f64, f64)>,
    target: Option<(bool, f64)>,
    note: String,
) -> Ratio {
    let value = parts.filter(|(_, b)| *b > 0.0).map(|(a, b)| a / b);
    Ratio {
        name: name.into(),
        what: what.into(),
        devices: (n > 0).then_some(n),
        value,
        target: target.map_or(String::new(), |(at_least, t)| {
            format!("{} {t}", if at_least { ">=" } else { "<=" })
        }),
        met: target.and_then(|(at_least, t)| value.map(|v| if at_least { v >= t } else { v <= t })),
        note,
    }
}

const SPEC: &str = "spec-k4";
const CLOUD: &str = "cloud-only";

/// The four comparisons of issue 17 item 5, from the cells that exist.
pub fn ratios(cells: &[Cell], weights_bytes: u64) -> Vec<Ratio> {
    let n8 = n_near(cells, 8);
    let n32 = n_near(cells, 32);
    let missing = |what: &str| format!("not measured: {what}");
    let mut out = Vec::new();
    let (on, off) = (find(cells, SPEC, true, n8), find(cells, SPEC, false, n8));
    out.push(ratio(
        "batched_speedup",
        "spec-k4 aggregate tok/s, batched / unbatched",
        n8,
        on.zip(off)
            .map(|(a, b)| (a.aggregate_tok_s, b.aggregate_tok_s)),
        Some((true, 2.0)),
        match on.zip(off) {
            Some((a, b)) => format!("{:.2} / {:.2} tok/s", a.aggregate_tok_s, b.aggregate_tok_s),
            None => missing(&format!("spec-k4 batched and unbatched at N = {n8}")),
        },
    ));
    let (hi, lo) = (find(cells, SPEC, true, n8), find(cells, SPEC, true, 1));
    out.push(ratio(
        "p95_latency_growth",
        "spec-k4 batched p95 verify latency, N / N = 1",
        n8,
        hi.zip(lo).map(|(a, b)| (a.verify_ms.p95, b.verify_ms.p95)),
        Some((false, 2.5)),
        match hi.zip(lo) {
            Some((a, b)) => format!("{:.0} / {:.0} ms", a.verify_ms.p95, b.verify_ms.p95),
            None => missing(&format!("spec-k4 batched at N = 1 and N = {n8}")),
        },
    ));
    // RSS: the largest peak among the batched cells at N32 (all modes).
    let big = cells
        .iter()
        .filter(|c| c.devices == n32 && c.batching && c.ok && c.peak_rss_bytes.is_some())
        .max_by_key(|c| c.peak_rss_bytes);
    let budget = big.and_then(|c| {
        let kv = c.kv_bytes?;
        Some((c, kv, (weights_bytes + kv) as f64 * 1.15))
    });
    out.push(ratio(
        "rss_budget",
        "verifier peak RSS / ((weights + KV used) x 1.15), batched, largest of the modes",
        n32,
        budget.and_then(|(c, _, b)| Some((c.peak_rss_bytes? as f64, b))),
        Some((false, 1.0)),
        match (big, budget) {
            (Some(_), Some((c, kv, b))) => format!(
                "{}: peak {:.0} MB, weights {:.0} MB + KV {:.1} MB (+15 % = {:.0} MB)",
                c.mode,
                mb(c.peak_rss_bytes.unwrap_or(0)),
                mb(weights_bytes),
                mb(kv),
                b / MB
            ),
            (Some(c), None) => format!(
                "peak {:.0} MB; KV bytes n/a (the verifier exports no {SESSION_BYTES_METRIC})",
                mb(c.peak_rss_bytes.unwrap_or(0))
            ),
            _ => missing(&format!("a batched cell at N = {n32}")),
        },
    ));
    let (s, c) = (find(cells, SPEC, true, n8), find(cells, CLOUD, true, n8));
    out.push(ratio(
        "cpu_per_token_spec_vs_cloud",
        "verifier CPU-seconds per generated token, spec-k4 / cloud-only, batched",
        n8,
        s.zip(c)
            .and_then(|(a, b)| Some((a.cpu_s_per_token?, b.cpu_s_per_token?))),
        None,
        match s.zip(c) {
            Some((a, b)) => format!(
                "{} / {} CPU-s per token",
                opt(a.cpu_s_per_token, 4),
                opt(b.cpu_s_per_token, 4)
            ),
            None => missing(&format!("spec-k4 and cloud-only batched at N = {n8}")),
        },
    ));
    out
}

const MB: f64 = 1024.0 * 1024.0;

fn mb(b: u64) -> f64 {
    b as f64 / MB
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.digits$}"))
}

fn rows_text(b: &Option<BatchRows>) -> String {
    match b {
        None => "n/a".into(),
        Some(b) if b.forwards == 0 => "0 fwd".into(),
        Some(b) => format!(
            "{:.1} ({}/{})",
            b.mean,
            b.p50_le.as_deref().unwrap_or("?"),
            b.p95_le.as_deref().unwrap_or("?")
        ),
    }
}

/// The human-readable report (stdout).
pub fn render(r: &Report) -> String {
    let mut o = String::new();
    let s = &r.settings;
    let _ = writeln!(
        o,
        "tandem bench verifier {}: one verifier, N simulated devices replaying recorded drafts \
         ({} prompts{}, {} tokens per session; spec-k4: k = {}, spec-mixed: k cycles {:?})",
        r.date_utc,
        s.prompt_ids.len(),
        s.prompt_tail
            .map_or(String::new(), |n| format!(" cut to their last {n} tokens")),
        s.tokens,
        s.k,
        s.mixed_ks
    );
    let _ = writeln!(
        o,
        "target: {} ({:.0} MB); verifier {} CPUs {} with {} threads; trace {} ({})",
        r.model.target_path,
        mb(r.model.target_bytes),
        if s.pinned {
            "pinned (taskset) to"
        } else {
            "NOT pinned (no taskset), meant for"
        },
        s.verifier_cores,
        s.threads,
        r.trace.path,
        if r.trace.reused {
            "reused".to_string()
        } else {
            format!("recorded in {:.0} s", r.trace.record_seconds)
        }
    );
    let _ = writeln!(
        o,
        "cpu: {} ({} logical), load average before {:?} after {:?}; wall {:.0} s\n",
        r.machine.cpu,
        r.machine.logical_cpus,
        r.machine.loadavg_before,
        r.machine.loadavg_after,
        r.wall_s
    );
    let _ = writeln!(
        o,
        "{:<10} {:<5} {:>3} {:>7} {:>13} {:>15} {:>15} {:>16} {:>9} {:>7} {:>6} {:>8}",
        "mode",
        "batch",
        "N",
        "tok/s",
        "sess p50/p95",
        "verify p50/p95",
        "open p50/p95",
        "rows/fwd (p50/95)",
        "CPU-s/tok",
        "RSS MB",
        "KV MB",
        "verdicts"
    );
    for c in &r.cells {
        let verdicts = if c.verdict_mismatches > 0 {
            format!("{} MISMATCH", c.verdict_mismatches)
        } else {
            format!("{} ok", c.verdicts_checked)
        };
        let _ = writeln!(
            o,
            "{:<10} {:<5} {:>3} {:>7.2} {:>13} {:>15} {:>15} {:>16} {:>9} {:>7} {:>6} {:>8}",
            c.mode,
            if c.batching { "on" } else { "off" },
            c.devices,
            c.aggregate_tok_s,
            format!("{:.2}/{:.2}", c.session_tok_s.p50, c.session_tok_s.p95),
            format!("{:.0}/{:.0} ms", c.verify_ms.p50, c.verify_ms.p95),
            format!("{:.0}/{:.0} ms", c.open_ms.p50, c.open_ms.p95),
            rows_text(&c.batch_rows),
            opt(c.cpu_s_per_token, 3),
            c.peak_rss_bytes
                .map_or("n/a".into(), |b| format!("{:.0}", mb(b))),
            c.kv_bytes.map_or("n/a".into(), |b| format!("{:.1}", mb(b))),
            verdicts
        );
        if let Some(e) = &c.error {
            let _ = writeln!(o, "    FAILED: {e}");
        }
        for m in &c.mismatches {
            let _ = writeln!(o, "    !!! VERDICT MISMATCH: {m}");
        }
    }
    let _ = writeln!(
        o,
        "\ntok/s: generated tokens of all sessions / window; sess: per session; verify: Draft \
         sent -> Verdict received at the device; open: Open -> Opened (prefill, before the \
         window); rows/fwd: mean rows per target forward in the window (histogram buckets \
         holding the median and p95 forward; n/a: the verifier exports no {BATCH_ROWS_METRIC}); \
         CPU-s/tok: verifier utime+stime in the window / tokens; RSS: verifier VmHWM; KV: \
         {SESSION_BYTES_METRIC} at the window end."
    );
    let sum = |f: fn(&Cell) -> Option<f64>| r.cells.iter().filter_map(f).sum::<f64>();
    let _ = writeln!(
        o,
        "\nthe simulated devices (this process) used {:.2} CPU-s in all windows, the verifiers {:.1} CPU-s",
        sum(|c| c.client_cpu_s),
        sum(|c| c.verifier_cpu_s)
    );
    let _ = writeln!(o, "\nratios (issue 17 item 5 targets):");
    for q in &r.ratios {
        let n = q.devices.map_or("-".into(), |n| format!("N={n}"));
        let verdict = match q.met {
            Some(true) => "met",
            Some(false) => "NOT met",
            None => "",
        };
        let _ = writeln!(
            o,
            "  {:<28} {:>6} {:>7}  target {:<7} {:<7} {} ({})",
            q.name,
            n,
            opt(q.value, 2),
            if q.target.is_empty() { "-" } else { &q.target },
            verdict,
            q.what,
            q.note
        );
    }
    if r.verdict_mismatches > 0 {
        let _ = writeln!(
            o,
            "\n!!! {} VERDICT MISMATCH(ES): the verifier's answers differ from the recorded greedy \
             verdicts (see above) !!!",
            r.verdict_mismatches
        );
    } else {
        let _ = writeln!(
            o,
            "\nall {} replayed verdicts equal the recorded ones",
            r.verdicts_checked
        );
    }
    o
}

/// Throughput (top) and p95 verify latency (bottom) vs N, one line per mode
/// and batching setting.
pub fn plot(path: &Path, cells: &[Cell]) -> Result<()> {
    let mut labels: Vec<String> = Vec::new();
    for c in cells {
        if !labels.contains(&c.label()) {
            labels.push(c.label());
        }
    }
    let series = |f: fn(&Cell) -> f64| -> Vec<(String, Vec<(f64, f64)>)> {
        labels
            .iter()
            .map(|l| {
                let pts = cells
                    .iter()
                    .filter(|c| c.label() == *l && c.ok)
                    .map(|c| (c.devices as f64, f(c)))
                    .collect();
                (l.clone(), pts)
            })
            .collect()
    };
    let root = SVGBackend::new(path, (960, 1000)).into_drawing_area();
    let (top, bottom) = root.split_vertically(500);
    draw_line_chart(
        &top,
        "Verifier capacity: aggregate generated tokens/s",
        "simulated devices N (log scale)",
        "tokens/s",
        &series(|c| c.aggregate_tok_s),
        true,
    )?;
    draw_line_chart(
        &bottom,
        "p95 verify latency at the device (Draft -> Verdict)",
        "simulated devices N (log scale)",
        "ms",
        &series(|c| c.verify_ms.p95),
        true,
    )?;
    root.present().map_err(plot_err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = "# TYPE tandem_verifier_batch_rows histogram\n\
        tandem_verifier_batch_rows_bucket{le=\"1\"} 2\n\
        tandem_verifier_batch_rows_bucket{le=\"8\"} 4\n\
        tandem_verifier_batch_rows_bucket{le=\"+Inf\"} 4\n\
        tandem_verifier_batch_rows_sum 12\n\
        tandem_verifier_batch_rows_count 4\n\
        tandem_verifier_session_bytes 100\n";
    const AFTER: &str = "tandem_verifier_batch_rows_bucket{le=\"1\"} 3\n\
        tandem_verifier_batch_rows_bucket{le=\"8\"} 5\n\
        tandem_verifier_batch_rows_bucket{le=\"+Inf\"} 14\n\
        tandem_verifier_batch_rows_sum 212\n\
        tandem_verifier_batch_rows_count 14\n\
        tandem_verifier_session_bytes 4096\n";

    #[test]
    fn gauges_and_histograms_parse_and_subtract() {
        assert_eq!(gauge(AFTER, SESSION_BYTES_METRIC), Some(4096.0));
        assert_eq!(gauge(AFTER, "tandem_verifier_session"), None);
        let h = histogram(AFTER, BATCH_ROWS_METRIC).unwrap();
        assert_eq!(h.count, 14);
        assert_eq!(h.buckets.len(), 3);
        let b = batch_rows(BEFORE, AFTER).unwrap();
        assert_eq!(b.forwards, 10);
        assert_eq!(b.rows, 200.0);
        assert_eq!(b.mean, 20.0);
        let counts: Vec<u64> = b.buckets.iter().map(|x| x.count).collect();
        assert_eq!(counts, vec![1, 0, 9]);
        assert_eq!(b.p50_le.as_deref(), Some("+Inf"));
        assert!(batch_rows("", "tandem_verifier_sessions 1\n").is_none());
    }

    fn cell(mode: &str, batching: bool, n: usize, tok_s: f64, p95: f64) -> Cell {
        let mut c = Cell::failed(mode, batching, n, String::new());
        c.ok = true;
        c.error = None;
        c.aggregate_tok_s = tok_s;
        c.verify_ms.p95 = p95;
        c.cpu_s_per_token = Some(tok_s / 100.0);
        c.peak_rss_bytes = Some(1150);
        c.kv_bytes = Some(100);
        c
    }

    #[test]
    fn ratios_use_the_named_n_or_the_largest_measured() {
        let cells = vec![
            cell(SPEC, true, 1, 10.0, 100.0),
            cell(SPEC, false, 1, 10.0, 100.0),
            cell(SPEC, true, 2, 30.0, 200.0),
            cell(SPEC, false, 2, 10.0, 400.0),
            cell(CLOUD, true, 2, 15.0, 80.0),
        ];
        let r = ratios(&cells, 900);
        assert_eq!(r.len(), 4);
        assert_eq!(r[0].devices, Some(2));
        assert_eq!(r[0].value, Some(3.0));
        assert_eq!(r[0].met, Some(true));
        assert_eq!(r[1].value, Some(2.0));
        assert_eq!(r[1].met, Some(true));
        // 1150 / ((900 + 100) * 1.15) = 1.0
        assert!((r[2].value.unwrap() - 1.0).abs() < 1e-9, "{:?}", r[2]);
        assert_eq!(r[3].value, Some(2.0));
        assert_eq!(r[3].met, None);
        let none = ratios(&cells[..1], 900);
        assert_eq!(none[0].value, None);
        assert!(none[0].note.contains("not measured"), "{}", none[0].note);
    }
}
