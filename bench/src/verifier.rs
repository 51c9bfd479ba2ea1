//! `tandem bench verifier`: the verifier's capacity. N simulated devices (one
//! session each) against one `tandem serve-verifier` child on loopback, for
//! each mode (speculative k = 4, speculative with a mixed k schedule,
//! cloud-only streaming) with the verifier's batching on and off, N over
//! `--devices`. The devices replay draft blocks recorded once from the real
//! draft model (cached under ~/.cache/tandem/bench), so they cost almost no
//! CPU and the verifier is what is measured; every verdict is checked against
//! the recorded one. Method and columns: docs/benchmarks.md; JSON schema:
//! docs/cli.md.

mod replay;
pub(super) mod report;
pub(super) mod trace;

use super::worker::PromptCase;
use super::{cpu_model, load_prompt_set, loadavg, model_file, progress, utc_now, BenchModel};
use anyhow::{bail, Context, Result};
use report::{Cell, ModelInfo, Report, Settings, Snapshot, TraceInfo};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tandem_fetch::{ModelRole, ModelSpec};
use tandem_lab as lab;
use trace::{Schedule, SessionTrace, TraceFile, TraceKey};

/// Block length of the fixed-k speculative mode.
const K: usize = 4;
/// The mixed mode's per-round block lengths (cycled): every k in 1..=8, in
/// an order that alternates short and long blocks as an adaptive k does.
const MIXED_KS: [usize; 8] = [3, 6, 1, 8, 4, 2, 7, 5];
/// Bearer token of the one device identity all simulated devices share.
pub(super) const TOKEN: &str = "tandem-bench-verifier-token-0123456789";
/// `127.0.0.1:0`: the verifier picks its port.
pub(super) const ANY_LOOPBACK_PORT: std::net::SocketAddr = std::net::SocketAddr::V4(
    std::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 0),
);

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Speculative, k = 4 every round.
    SpecK4,
    /// Speculative, k cycling over 1..8 (adaptive-like).
    SpecMixed,
    /// Cloud-only streaming: k = 0, one row per session per step.
    CloudOnly,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::SpecK4 => "spec-k4",
            Self::SpecMixed => "spec-mixed",
            Self::CloudOnly => "cloud-only",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Batching {
    /// `[batching] enabled = true` (the scheduler packs sessions' rows).
    On,
    /// `[batching] enabled = false`: one message per forward (the old path).
    Off,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Print one JSON object (schema in docs/cli.md) instead of the table.
    #[arg(long)]
    json: bool,
    /// Short run: N = 1,2, 1 prompt cut to its last 16 tokens, 8 tokens per
    /// session (about a minute).
    #[arg(long)]
    quick: bool,
    /// Simulated device counts, comma-separated (default 1,2,4,8,16,32; --quick 1,2).
    #[arg(long, value_delimiter = ',')]
    devices: Vec<usize>,
    /// Modes, comma-separated.
    #[arg(long, value_delimiter = ',', default_values = ["spec-k4", "spec-mixed", "cloud-only"])]
    modes: Vec<Mode>,
    /// Verifier batching settings to compare side by side, comma-separated.
    #[arg(long, value_delimiter = ',', default_values = ["on", "off"])]
    batching: Vec<Batching>,
    /// Tokens each session generates (the trace length; default 24, --quick 8).
    #[arg(long)]
    tokens: Option<usize>,
    /// First prompts of the prompt set to replay; device i plays prompt i mod
    /// this (default 4, --quick 1).
    #[arg(long)]
    prompt_count: Option<usize>,
    /// Replay only the last this many tokens of each chat-formatted prompt
    /// (shorter prefills; default: the whole prompt, --quick 16).
    #[arg(long)]
    prompt_tail: Option<usize>,
    /// Prompt set (JSON lines); default: the built-in prompts/default.jsonl.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// CPUs the verifier is pinned to (a `taskset -c` list; default: all).
    #[arg(long)]
    verifier_cores: Option<String>,
    /// Verifier threads (RAYON_NUM_THREADS; default: the number of verifier CPUs).
    #[arg(long)]
    threads: Option<usize>,
    /// Directory for the generated verifier configs and their logs.
    #[arg(long, default_value = "target/bench-verifier")]
    out: PathBuf,
    /// The SVG plot (default: <out>/capacity.svg).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Record the draft trace again even when a cached one matches.
    #[arg(long)]
    rerecord: bool,
}

/// Effective settings after defaults and `--quick`.
struct Resolved {
    devices: Vec<usize>,
    modes: Vec<Mode>,
    batching: Vec<bool>,
    tokens: usize,
    prompt_tail: Option<usize>,
    prompts: Vec<PromptCase>,
    cores: String,
    threads: usize,
    pin: bool,
    plot: PathBuf,
}

fn dedup<T: PartialEq + Copy>(v: &[T]) -> Vec<T> {
    let mut out = Vec::new();
    for x in v {
        if !out.contains(x) {
            out.push(*x);
        }
    }
    out
}

/// The number of CPUs in a `taskset -c` list ("0-3,6").
fn cpus_in(list: &str) -> Result<usize> {
    let mut n = 0;
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse()?, b.trim().parse()?);
                anyhow::ensure!(b >= a, "CPU range {part} runs backwards");
                b - a + 1
            }
            None => {
                part.parse::<usize>()?;
                1
            }
        };
    }
    anyhow::ensure!(n > 0, "the CPU list {list:?} is empty");
    Ok(n)
}

impl Args {
    fn resolve(&self) -> Result<Resolved> {
        let devices = if self.devices.is_empty() {
            if self.quick {
                vec![1, 2]
            } else {
                vec![1, 2, 4, 8, 16, 32]
            }
        } else {
            dedup(&self.devices)
        };
        anyhow::ensure!(
            devices.iter().all(|&n| (1..=256).contains(&n)),
            "--devices must be in 1..=256"
        );
        anyhow::ensure!(!self.modes.is_empty(), "--modes is empty");
        anyhow::ensure!(!self.batching.is_empty(), "--batching is empty");
        let tokens = self.tokens.unwrap_or(if self.quick { 8 } else { 24 });
        anyhow::ensure!((1..=1024).contains(&tokens), "--tokens must be in 1..=1024");
        let prompt_tail = self.prompt_tail.or(self.quick.then_some(16));
        anyhow::ensure!(
            prompt_tail.is_none_or(|n| n >= 1),
            "--prompt-tail must be at least 1"
        );
        let count = self.prompt_count.unwrap_or(if self.quick { 1 } else { 4 });
        anyhow::ensure!(count >= 1, "--prompt-count must be at least 1");
        let prompts = load_prompt_set(self.prompts.as_deref(), count)?;
        let all = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cores = self
            .verifier_cores
            .clone()
            .unwrap_or_else(|| format!("0-{}", all - 1));
        let ncores = cpus_in(&cores).with_context(|| format!("--verifier-cores {cores:?}"))?;
        let threads = self.threads.unwrap_or(ncores);
        anyhow::ensure!(threads >= 1, "--threads must be at least 1");
        Ok(Resolved {
            devices,
            modes: dedup(&self.modes),
            batching: dedup(&self.batching)
                .into_iter()
                .map(|b| b == Batching::On)
                .collect(),
            tokens,
            prompt_tail,
            prompts,
            cores,
            threads,
            pin: lab::taskset_works(),
            plot: self
                .plot
                .clone()
                .unwrap_or_else(|| self.out.join("capacity.svg")),
        })
    }
}

/// The trace for this run's prompts and token count: from the cache, else
/// recorded with the real models and stored.
fn trace(args: &Args, res: &Resolved) -> Result<(TraceFile, PathBuf, bool)> {
    let schedules = vec![
        Schedule {
            name: Mode::SpecK4.name().into(),
            ks: vec![K],
        },
        Schedule {
            name: Mode::SpecMixed.name().into(),
            ks: MIXED_KS.to_vec(),
        },
    ];
    let key = TraceKey::new(
        &ModelSpec::for_role(ModelRole::Draft).sha256,
        &ModelSpec::for_role(ModelRole::Target).sha256,
        &res.prompts,
        &schedules,
        res.tokens,
        res.prompt_tail,
    );
    let path = key.file_in(&trace::cache_dir())?;
    if !args.rerecord {
        if let Some(t) = trace::load_cached(&path, &key) {
            return Ok((t, path, true));
        }
    }
    progress(&format!(
        "recording draft blocks: {} prompts x {} schedules, {} tokens each (once; cached in {}) ...",
        res.prompts.len(),
        schedules.len(),
        res.tokens,
        path.display()
    ));
    let draft = model_file(BenchModel::Draft, None)?;
    let target = model_file(BenchModel::Target, None)?;
    let t = trace::record(&draft, &target, &res.prompts, key)?;
    trace::store(&path, &t)?;
    Ok((t, path, false))
}

/// utime + stime of `/proc/<pid>/stat` in seconds.
fn cpu_seconds(pid: &str, ticks: f64) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / ticks)
}

/// Clock ticks per second of /proc/<pid>/stat (`getconf CLK_TCK`, else 100).
fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// `GET /metrics` on the verifier's admin address (plain HTTP/1.1).
pub(super) fn metrics(admin: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(admin).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_owned())
}

fn snapshot(pid: u32, admin: &str, ticks: f64) -> Snapshot {
    let pid = pid.to_string();
    Snapshot {
        verifier_cpu_s: cpu_seconds(&pid, ticks),
        client_cpu_s: cpu_seconds("self", ticks),
        metrics: metrics(admin),
        peak_rss: tandem_cli_common::models::proc_status_bytes(&pid, "VmHWM:"),
    }
}

/// The verifier's config for one cell (and for `tandem bench soak`), gRPC on
/// `listen` (port 0: any). All simulated devices share one identity, so the
/// per-identity quotas and prefill rates are lifted: they would otherwise
/// treat N devices as one flooding device.
pub(super) fn verifier_toml(
    model: &Path,
    max_seq_len: usize,
    devices: usize,
    batching: bool,
    listen: std::net::SocketAddr,
) -> String {
    let model_id = tandem_edge::EdgeConfig::default().model_id;
    format!(
        "listen = \"{listen}\"\nadmin_listen = \"127.0.0.1:0\"\ninsecure_loopback = true\n\
         model_path = {model:?}\nmodel_id = {model_id:?}\nmax_seq_len = {max_seq_len}\n\n\
         [limits]\nmax_sessions = {sessions}\nmax_prompt_tokens = {prompt}\n\
         rate_per_sec = 1000000.0\nrate_burst = 1000000.0\nidle_ttl_secs = 3600\n\
         max_sessions_per_identity = {sessions}\nprefill_tokens_per_sec = 1000000000.0\n\
         prefill_burst_tokens = 1000000000.0\nmax_inflight_prefill_tokens = 16777216\n\
         max_inflight_prefill_tokens_per_identity = 16777216\n\
         max_connections = {conns}\nmax_connections_per_peer = {conns}\n\
         max_streams_per_identity = {conns}\nmax_inflight_opens_per_identity = {sessions}\n\n\
         [batching]\nenabled = {batching}\n\n\
         [[devices]]\nid = \"bench\"\ntoken = \"{TOKEN}\"\n",
        model = model.display().to_string(),
        sessions = devices.max(64),
        // Every simulated device is one identity on one loopback address:
        // room for each one's streams and re-opens (the per-peer and
        // per-identity caps are for separate devices).
        conns = devices.saturating_mul(4).max(1024),
        prompt = max_seq_len - tandem_verifier::config::MAX_BLOCK_CAP - 1,
    )
}

/// A `tandem serve-verifier --config toml` child (stderr in `<out>/<name>.log`)
/// on `cpus` = (a `taskset -c` list, pin or not, threads), once it has printed
/// its serving line; returns it with its gRPC and admin addresses.
pub(super) fn start_verifier(
    toml: &Path,
    name: &str,
    out: &Path,
    cpus: (&str, bool, usize),
) -> Result<(lab::Proc, String, String)> {
    let args = vec![
        "serve-verifier".to_string(),
        "--config".into(),
        toml.display().to_string(),
    ];
    let (cores, pin, threads) = cpus;
    let (proc, line) = lab::start_server(
        lab::command(cores, pin, threads, &args)?,
        name,
        "serving ",
        out,
        Duration::from_secs(300),
    )?;
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .map(str::to_owned)
            .with_context(|| format!("no {key} in the verifier's line {line:?}"))
    };
    let (grpc, admin) = (field("grpc=")?, field("admin=")?);
    Ok((proc, grpc, admin))
}

/// Everything a configuration needs, shared by all of them.
struct Ctx<'a> {
    res: &'a Resolved,
    out: &'a Path,
    model: &'a Path,
    fingerprint: String,
    max_seq_len: usize,
    ticks: f64,
    rt: tokio::runtime::Runtime,
}

/// One configuration: a fresh verifier, N devices, the figures.
fn run_cell(
    ctx: &Ctx<'_>,
    mode: Mode,
    batching: bool,
    sessions: &[Arc<SessionTrace>],
    n: usize,
) -> Result<Cell> {
    let name = format!(
        "verifier-{}-{}-n{n}",
        mode.name(),
        if batching { "on" } else { "off" }
    );
    let toml = ctx.out.join(format!("{name}.toml"));
    std::fs::write(
        &toml,
        verifier_toml(ctx.model, ctx.max_seq_len, n, batching, ANY_LOOPBACK_PORT),
    )
    .with_context(|| format!("writing {}", toml.display()))?;
    let t = Instant::now();
    let (proc, grpc, admin) = start_verifier(
        &toml,
        &name,
        ctx.out,
        (&ctx.res.cores, ctx.res.pin, ctx.res.threads),
    )?;
    let up = t.elapsed().as_secs_f64();
    let target = replay::Target {
        url: format!("http://{grpc}"),
        token: TOKEN.into(),
        model_id: tandem_edge::EdgeConfig::default().model_id,
        fingerprint: ctx.fingerprint.clone(),
    };
    let devices: Vec<Arc<SessionTrace>> = (0..n)
        .map(|i| sessions[i % sessions.len()].clone())
        .collect();
    // Every device replays as many rounds as the shortest trace of the mode
    // has, whatever N: the window holds N sessions busy to its end.
    let rounds = sessions.iter().map(|s| s.rounds.len()).min().unwrap_or(0);
    let (pid, ticks) = (proc.pid(), ctx.ticks);
    let run = ctx
        .rt
        .block_on(replay::run(&target, devices, rounds, move || {
            snapshot(pid, &admin, ticks)
        }))?;
    drop(proc);
    let cell = Cell::from_run(mode.name(), batching, &run);
    progress(&format!(
        "  {:.1} s: verifier up in {:.1} s, opens {:.1} s, window {:.1} s ({} rounds per device)",
        t.elapsed().as_secs_f64(),
        up,
        cell.open_ms.max / 1000.0,
        cell.window_s,
        rounds
    ));
    Ok(cell)
}

pub fn run(args: Args) -> Result<()> {
    let t0 = Instant::now();
    let res = args.resolve()?;
    let loadavg_before = loadavg();
    let date_utc = utc_now();
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    if !res.pin {
        progress("taskset is not available: the verifier is NOT pinned");
    }
    let (trace, trace_path, reused) = trace(&args, &res)?;
    let model = model_file(BenchModel::Target, None)?;
    let target_bytes = std::fs::metadata(&model)
        .with_context(|| format!("reading {}", model.display()))?
        .len();
    let arcs = |name: &str| -> Result<Vec<Arc<SessionTrace>>> {
        let s = trace
            .sessions(name)
            .with_context(|| format!("the trace has no {name} schedule"))?;
        Ok(s.iter().cloned().map(Arc::new).collect())
    };
    let k4 = arcs(Mode::SpecK4.name())?;
    let mixed = arcs(Mode::SpecMixed.name())?;
    let cloud: Vec<Arc<SessionTrace>> = k4
        .iter()
        .map(|s| Arc::new(s.streaming(res.tokens)))
        .collect();
    let longest = [&k4, &mixed, &cloud]
        .iter()
        .flat_map(|v| v.iter())
        .map(|s| s.context_after().last().copied().unwrap_or(0) as usize)
        .max()
        .unwrap_or(0);
    // Room for the longest context plus a full block, in 64-token steps.
    let max_seq_len = (longest + tandem_verifier::config::MAX_BLOCK_CAP + 1).div_ceil(64) * 64;
    let ctx = Ctx {
        res: &res,
        out: &args.out,
        model: &model,
        fingerprint: trace.tokenizer_fingerprint.clone(),
        max_seq_len,
        ticks: clock_ticks(),
        rt: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the async runtime")?,
    };
    let total = res.devices.len() * res.modes.len() * res.batching.len();
    let mut cells = Vec::with_capacity(total);
    // Per N, every mode and batching setting back to back: a machine whose
    // load drifts during the run biases no comparison much.
    for &n in &res.devices {
        for &mode in &res.modes {
            let sessions = match mode {
                Mode::SpecK4 => &k4,
                Mode::SpecMixed => &mixed,
                Mode::CloudOnly => &cloud,
            };
            for &batching in &res.batching {
                progress(&format!(
                    "{}/{total}: {} batching {} N = {n} ...",
                    cells.len() + 1,
                    mode.name(),
                    if batching { "on" } else { "off" }
                ));
                let cell = run_cell(&ctx, mode, batching, sessions, n)
                    .unwrap_or_else(|e| Cell::failed(mode.name(), batching, n, format!("{e:#}")));
                if let Some(e) = &cell.error {
                    progress(&format!("FAILED: {e}"));
                }
                cells.push(cell);
            }
        }
    }
    if let Some(dir) = res.plot.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    report::plot(&res.plot, &cells)?;
    progress(&format!("plot: {}", res.plot.display()));
    let verdicts_checked = cells.iter().map(|c| c.verdicts_checked).sum();
    let verdict_mismatches = cells.iter().map(|c| c.verdict_mismatches).sum();
    let report = Report {
        schema_version: report::SCHEMA_VERSION,
        tandem_version: env!("CARGO_PKG_VERSION").into(),
        date_utc,
        wall_s: t0.elapsed().as_secs_f64(),
        machine: super::report::Machine {
            cpu: cpu_model(),
            logical_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            loadavg_before,
            loadavg_after: loadavg(),
        },
        settings: Settings {
            devices: res.devices.clone(),
            modes: res.modes.iter().map(|m| m.name().to_owned()).collect(),
            batching: res.batching.clone(),
            prompt_ids: res.prompts.iter().map(|p| p.id.clone()).collect(),
            tokens: res.tokens,
            prompt_tail: res.prompt_tail,
            k: K,
            mixed_ks: MIXED_KS.to_vec(),
            threads: res.threads,
            verifier_cores: res.cores.clone(),
            pinned: res.pin,
            quick: args.quick,
        },
        model: ModelInfo {
            target_path: model.display().to_string(),
            target_bytes,
            target_sha256: trace.key.target_sha256.clone(),
            draft_sha256: trace.key.draft_sha256.clone(),
        },
        trace: TraceInfo {
            path: trace_path.display().to_string(),
            reused,
            record_seconds: trace.record_seconds,
            rounds: trace
                .recorded
                .iter()
                .map(|r| {
                    let n = r.sessions.iter().map(|s| s.rounds.len()).sum();
                    (r.schedule.name.clone(), n)
                })
                .collect(),
        },
        ratios: report::ratios(&cells, target_bytes),
        ok: cells.iter().all(|c| c.ok),
        cells,
        verdicts_checked,
        verdict_mismatches,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report::render(&report));
    }
    if report.verdict_mismatches > 0 {
        bail!(
            "VERDICT MISMATCH: {} verdict(s) differ from the recorded greedy verdicts",
            report.verdict_mismatches
        );
    }
    if !report.ok {
        bail!(
            "some configurations failed (see above; verifier logs in {})",
            args.out.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_count_cpus() {
        assert_eq!(cpus_in("0-1").unwrap(), 2);
        assert_eq!(cpus_in("0,2-4").unwrap(), 4);
        assert!(cpus_in("").is_err());
        assert!(cpus_in("3-1").is_err());
        assert!(cpus_in("x").is_err());
    }

    #[test]
    fn the_generated_verifier_config_is_valid() {
        for batching in [true, false] {
            let text = verifier_toml(Path::new("/m.gguf"), 192, 32, batching, ANY_LOOPBACK_PORT);
            let cfg: tandem_verifier::VerifierConfig = toml::from_str(&text).unwrap();
            cfg.validate().unwrap();
            assert_eq!(cfg.batching.enabled, batching);
            assert_eq!(cfg.max_seq_len, 192);
            assert!(cfg.insecure_loopback);
        }
    }

    #[test]
    fn proc_stat_cpu_of_this_process() {
        assert!(cpu_seconds("self", clock_ticks()).is_some_and(|s| s >= 0.0));
    }
}
