//! `tandem lab`: latency experiments. Runs a matrix of modes (draft-only,
//! target-only streaming, speculative with fixed/adaptive k, pipelined drafting)
//! × netsim profiles (and timelines with outages) × prompts × repetitions, with
//! the device and the verifier as separate processes pinned to separate cores,
//! and writes runs.jsonl, summary.csv, SVG plots and report.md (docs/lab.md).
//!
//! Processes: `tandem serve-verifier` (verifier cores), one `tandem netsim` per
//! profile (verifier cores; a fresh one per run for timelines), and per mode one
//! long-lived `tandem lab device` (device cores) that loads the draft once and
//! runs the jobs it reads on stdin.
//!
//! A command crate of the `tandem` binary (its `lab` feature): `Args` is the
//! subcommand's clap struct, `run` its body, and errors are `anyhow::Error`
//! because the binary only prints them. The processes it starts are the
//! running binary itself (`std::env::current_exe`).

mod config;
mod device;
pub mod report;

use anyhow::{bail, Context, Result};
use config::{LabConfig, Mode, Prompt};
use device::{DeviceResult, Job};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tandem_cli_common::models::{resolve_model, resolve_pair};
use tandem_fetch::ModelRole;

#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    /// Experiment matrix (TOML; fields in docs/lab.md). Default: the built-in
    /// lab/default.toml.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The small built-in matrix (lab/quick.toml): a few minutes.
    #[arg(long, conflicts_with = "config")]
    pub quick: bool,
    /// Output directory (created).
    #[arg(long, default_value = "lab-out")]
    pub out: PathBuf,
    /// Print the matrix (runs per mode and profile) and exit.
    #[arg(long)]
    pub dry_run: bool,
    /// The device's draft model for every run, over the config's
    /// `draft_model`: a GGUF path, a built-in name (`draft`, `smollm2`, ...;
    /// fetched on first use) or one of yours (`tandem models list`).
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// The verifier's target model, over the config's `target_model` (same
    /// forms). The pair is checked before any run starts.
    #[arg(long)]
    pub target_model: Option<PathBuf>,
    #[command(subcommand)]
    pub cmd: Option<LabCmd>,
}

#[derive(clap::Subcommand, Debug)]
pub enum LabCmd {
    /// The device side (started by `tandem lab`; jobs on stdin, results on stdout).
    #[command(hide = true)]
    Device(device::DeviceArgs),
}

const TOKEN: &str = "tandem-lab-device-token-0123456789";

/// One planned run.
#[derive(Clone, Debug)]
pub struct Planned {
    pub mode: Mode,
    /// Profile name, timeline name, or "device" (draft-only).
    pub profile: String,
    /// Some for timelines: the timeline text.
    pub timeline: Option<String>,
    pub prompt: Prompt,
    pub rep: usize,
}

fn plan(cfg: &LabConfig, prompts: &[Prompt]) -> Vec<Planned> {
    let mut v = Vec::new();
    let mut push = |mode: Mode, profile: &str, timeline: Option<&String>| {
        for rep in 0..cfg.repetitions {
            for p in prompts {
                v.push(Planned {
                    mode,
                    profile: profile.to_owned(),
                    timeline: timeline.cloned(),
                    prompt: p.clone(),
                    rep,
                });
            }
        }
    };
    // target-only first: it is the reference of the identity check.
    let mut modes = cfg.modes();
    modes.sort_by_key(|m| *m != Mode::TargetOnly);
    for m in modes {
        if m == Mode::DraftOnly {
            push(m, "device", None);
            continue;
        }
        for p in &cfg.profiles {
            push(m, p, None);
        }
    }
    for m in cfg.timeline_modes() {
        for (name, t) in &cfg.timelines {
            push(m, name, Some(t));
        }
    }
    v
}

/// The order runs execute in: one prompt (and repetition) at a time, every mode
/// and profile of it back to back (target-only first, as planned). The
/// machine's load drifts over a long matrix; run mode after mode and a mode
/// run in a busy quarter of an hour looks slower than it is. Interleaved, each
/// comparison between modes is between runs minutes apart at most.
fn execution_order(planned: &[Planned]) -> Vec<usize> {
    let mut prompts: Vec<&str> = Vec::new();
    for p in planned {
        if !prompts.contains(&p.prompt.id.as_str()) {
            prompts.push(&p.prompt.id);
        }
    }
    let mut order: Vec<usize> = (0..planned.len()).collect();
    // Stable: within one (repetition, prompt) the plan order stays.
    order.sort_by_key(|&i| {
        let p = &planned[i];
        let prompt = prompts.iter().position(|id| *id == p.prompt.id);
        (p.rep, prompt)
    });
    order
}

pub fn run(args: Args) -> Result<()> {
    if let Some(LabCmd::Device(d)) = args.cmd {
        return device::run(d);
    }
    let (mut cfg, origin) = match (&args.config, args.quick) {
        (Some(p), _) => (LabConfig::from_file(p)?, p.display().to_string()),
        (None, true) => (
            LabConfig::from_toml(config::QUICK_TOML, "lab/quick.toml")?,
            "lab/quick.toml (built in)".into(),
        ),
        (None, false) => (
            LabConfig::from_toml(config::DEFAULT_TOML, "lab/default.toml")?,
            "lab/default.toml (built in)".into(),
        ),
    };
    let prompts = cfg.load_prompts()?;
    let planned = plan(&cfg, &prompts);
    if args.dry_run {
        let mut counts: std::collections::BTreeMap<(String, String), usize> = Default::default();
        for p in &planned {
            *counts
                .entry((p.mode.name(), p.profile.clone()))
                .or_default() += 1;
        }
        for ((m, p), n) in counts {
            println!("{m}\t{p}\t{n} runs");
        }
        println!("prompt set\t{}", cfg.prompt_set_name());
        println!("total\t{} runs, {} prompts", planned.len(), prompts.len());
        return Ok(());
    }
    // Models first (fetched on first use), and whether they pair, before
    // any process starts; the children get the resolved files.
    if let Some(d) = &args.draft_model {
        cfg.draft_model = Some(d.clone());
    }
    if let Some(t) = &args.target_model {
        cfg.target_model = Some(t.clone());
    }
    if planned.iter().any(|p| p.mode != Mode::DraftOnly) {
        let pair = resolve_pair(cfg.draft_model.as_ref(), cfg.target_model.as_ref())?;
        cfg.draft_model = Some(pair.draft);
        cfg.target_model = Some(pair.target);
    } else {
        cfg.draft_model = Some(resolve_model(ModelRole::Draft, cfg.draft_model.as_ref())?);
    }
    std::fs::create_dir_all(args.out.join("logs"))
        .with_context(|| format!("creating {}", args.out.display()))?;
    let started = chrono_now();
    let t0 = Instant::now();
    let load_before = loadavg();
    let results = execute(&cfg, &planned, &args.out)?;
    let meta = report::Meta {
        origin,
        started,
        wall_s: t0.elapsed().as_secs_f64(),
        load_before,
        load_after: loadavg(),
        config: toml::to_string(&cfg).unwrap_or_default(),
        prompts: prompts.len(),
        prompt_set: cfg.prompt_set_name(),
    };
    let flagged = report::write_all(&args.out, &cfg, &planned, &results, &meta)?;
    eprintln!(
        "lab: {} runs in {:.0} s; report: {}",
        planned.len(),
        meta.wall_s,
        args.out.join("report.md").display()
    );
    if flagged > 0 {
        eprintln!(
            "lab: WARNING: {flagged} greedy run(s) differ from target-only output (see report.md)"
        );
    }
    Ok(())
}

fn chrono_now() -> String {
    let out = Command::new("date")
        .args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])
        .output();
    match out {
        Ok(o) => String::from_utf8_lossy(&o.stdout).trim().to_owned(),
        Err(_) => "?".into(),
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// A child process killed (and reaped) when dropped.
pub struct Proc {
    child: Child,
    name: String,
}

impl Proc {
    /// The child's process id (the program's own: `taskset` execs it).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `taskset` can pin a process here (it is absent in some containers).
pub fn taskset_works() -> bool {
    Command::new("taskset")
        .args(["-c", "0", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// `exe args...`, under `taskset -c cores` when pinning.
pub fn command(cores: &str, pin: bool, threads: usize, args: &[String]) -> Result<Command> {
    let exe = std::env::current_exe().context("finding the tandem binary")?;
    let mut c = if pin && !cores.is_empty() {
        let mut c = Command::new("taskset");
        c.arg("-c").arg(cores).arg(exe);
        c
    } else {
        Command::new(exe)
    };
    c.args(args)
        .env("RAYON_NUM_THREADS", threads.to_string())
        .env_remove("TANDEM_LOG");
    Ok(c)
}

/// Starts a server child and waits (≤ timeout) for its first stdout line
/// starting with `prefix`; returns the rest of that line.
pub fn start_server(
    mut cmd: Command,
    name: &str,
    prefix: &str,
    logs: &Path,
    timeout: Duration,
) -> Result<(Proc, String)> {
    let log = std::fs::File::create(logs.join(format!("{name}.log")))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let stdout = child.stdout.take().context("child stdout")?;
    let proc = Proc {
        child,
        name: name.to_owned(),
    };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stdout);
        let mut line = String::new();
        let _ = r.read_line(&mut line);
        let _ = tx.send(line);
        // Keep draining so the child never blocks on a full pipe.
        let mut sink = String::new();
        while r.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
            sink.clear();
        }
    });
    let line = rx
        .recv_timeout(timeout)
        .map_err(|_| anyhow::anyhow!("{name} did not start (see {}/{name}.log)", logs.display()))?;
    let Some(rest) = line.trim().strip_prefix(prefix) else {
        bail!(
            "{name} printed {line:?}, not {prefix:?} (see {}/{name}.log)",
            logs.display()
        );
    };
    Ok((proc, rest.trim().to_owned()))
}

fn start_netsim(
    cfg: &LabConfig,
    pin: bool,
    grpc: &str,
    how: (&str, &str),
    name: &str,
    logs: &Path,
) -> Result<(Proc, String)> {
    let args: Vec<String> = vec![
        "netsim".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--upstream".into(),
        grpc.into(),
        how.0.into(),
        how.1.into(),
    ];
    start_server(
        command(&cfg.verifier_cores, pin, 1, &args)?,
        name,
        "listening on ",
        logs,
        Duration::from_secs(30),
    )
}

/// One `tandem lab device` child.
struct Device {
    _proc: Proc,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Device {
    fn start(cfg: &LabConfig, pin: bool, mode: Mode, logs: &Path) -> Result<Self> {
        let mut args: Vec<String> = vec![
            "lab".into(),
            "device".into(),
            "--mode".into(),
            mode.name(),
            "--token".into(),
            TOKEN.into(),
            "--max-seq-len".into(),
            cfg.max_seq_len.to_string(),
            "--stream-window".into(),
            cfg.stream_window.to_string(),
            "--temperature".into(),
            cfg.temperature.to_string(),
        ];
        if let Some(p) = &cfg.draft_model {
            args.push("--draft-model".into());
            args.push(p.display().to_string());
        }
        let name = format!("device-{}", mode.name());
        let edge = logs.join(format!("edge-{}.toml", mode.name()));
        std::fs::write(&edge, cfg.edge_toml(&mode.name()))
            .with_context(|| format!("writing {}", edge.display()))?;
        args.push("--edge-config".into());
        args.push(edge.display().to_string());
        let log = std::fs::File::create(logs.join(format!("{name}.log")))?;
        let mut child = command(&cfg.device_cores, pin, cfg.threads, &args)?
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        let stdin = child.stdin.take().context("device stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("device stdout")?);
        Ok(Self {
            _proc: Proc { child, name },
            stdin,
            stdout,
        })
    }

    fn run(&mut self, job: &Job) -> Result<DeviceResult> {
        serde_json::to_writer(&mut self.stdin, job)?;
        self.stdin.write_all(b"\n")?;
        self.stdin.flush()?;
        let mut line = String::new();
        let n = self.stdout.read_line(&mut line)?;
        if n == 0 {
            bail!(
                "the device process ({}) exited; see its log",
                self._proc.name
            );
        }
        serde_json::from_str(&line).context("parsing a device result")
    }
}

fn execute(cfg: &LabConfig, planned: &[Planned], out: &Path) -> Result<Vec<DeviceResult>> {
    let logs = out.join("logs");
    let pin = taskset_works();
    if !pin {
        eprintln!("lab: taskset is not available: processes are NOT pinned");
    }
    let needs_net = planned.iter().any(|p| p.mode != Mode::DraftOnly);
    // The verifier (target model) and one proxy per profile.
    let mut _verifier = None;
    let mut grpc = String::new();
    let mut proxies: std::collections::HashMap<String, (Proc, String)> = Default::default();
    if needs_net {
        let vt = logs.join("verifier.toml");
        let model = cfg
            .target_model
            .as_ref()
            .map(|p| format!("model_path = {:?}\n", p.display().to_string()))
            .unwrap_or_default();
        std::fs::write(
            &vt,
            format!(
                "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\ninsecure_loopback = true\n\
                 {model}[[devices]]\nid = \"lab\"\ntoken = \"{TOKEN}\"\n"
            ),
        )?;
        let args = vec![
            "serve-verifier".to_string(),
            "--config".into(),
            vt.display().to_string(),
        ];
        let (p, rest) = start_server(
            command(&cfg.verifier_cores, pin, cfg.threads, &args)?,
            "verifier",
            "serving ",
            &logs,
            Duration::from_secs(300),
        )?;
        grpc = rest
            .split_whitespace()
            .find_map(|w| w.strip_prefix("grpc="))
            .context("verifier address")?
            .to_owned();
        _verifier = Some(p);
        for prof in &cfg.profiles {
            let (p, addr) = start_netsim(
                cfg,
                pin,
                &grpc,
                ("--profile", prof),
                &format!("netsim-{prof}"),
                &logs,
            )?;
            proxies.insert(prof.clone(), (p, addr));
        }
    }
    let bar = indicatif::ProgressBar::new(planned.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/{len} runs, ETA {eta} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let started = Instant::now();
    let mut results: Vec<Option<DeviceResult>> = vec![None; planned.len()];
    // One device process per mode, all alive for the whole run; warmed up first.
    let mut devices: Vec<(Mode, Device)> = Vec::new();
    for mode in planned.iter().map(|p| p.mode) {
        if devices.iter().any(|(m, _)| *m == mode) {
            continue;
        }
        bar.set_message(format!("{} (loading)", mode.name()));
        let mut dev = Device::start(cfg, pin, mode, &logs)?;
        if cfg.warmup_tokens > 0 {
            let url = cfg
                .profiles
                .first()
                .and_then(|p| proxies.get(p))
                .map(|(_, a)| format!("http://{a}"));
            let warm = Job {
                job: usize::MAX,
                prompt: "Say hello.".into(),
                max_tokens: cfg.warmup_tokens,
                url: if mode == Mode::DraftOnly { None } else { url },
            };
            dev.run(&warm)?;
        }
        devices.push((mode, dev));
    }
    for i in execution_order(planned) {
        let p = &planned[i];
        let mode = p.mode;
        let Some((_, dev)) = devices.iter_mut().find(|(m, _)| *m == mode) else {
            anyhow::bail!("no device for {}", mode.name());
        };
        bar.set_message(format!("{} / {}", mode.name(), p.profile));
        let mut fresh = None;
        let url = if mode == Mode::DraftOnly {
            None
        } else if let Some(t) = &p.timeline {
            let (proc, addr) = start_netsim(
                cfg,
                pin,
                &grpc,
                ("--timeline", t),
                &format!("netsim-{}", p.profile),
                &logs,
            )?;
            fresh = Some(proc);
            Some(format!("http://{addr}"))
        } else {
            let (_, addr) = proxies
                .get(&p.profile)
                .with_context(|| format!("no proxy for {}", p.profile))?;
            Some(format!("http://{addr}"))
        };
        let job = Job {
            job: i,
            prompt: p.prompt.prompt.clone(),
            max_tokens: p.prompt.max_tokens,
            url,
        };
        let r = dev.run(&job)?;
        drop(fresh);
        if let Some(e) = &r.error {
            bar.println(format!(
                "run {i} ({} / {} / {}): error: {e}",
                mode.name(),
                p.profile,
                p.prompt.id
            ));
        }
        bar.inc(1);
        if !tty {
            // No terminal (CI, a log file): one line per run instead of the bar.
            let done = bar.position() as f64;
            let el = started.elapsed().as_secs_f64();
            eprintln!(
                "lab: {}/{} {} / {} / {}: {} tokens in {:.0} ms{} (elapsed {:.0} s, ETA {:.0} s)",
                done,
                planned.len(),
                mode.name(),
                p.profile,
                p.prompt.id,
                r.tokens.len(),
                r.stats.total_ms,
                if r.error.is_some() { ", FAILED" } else { "" },
                el,
                el / done * (planned.len() as f64 - done)
            );
        }
        results[i] = Some(r);
    }
    bar.finish_with_message("done");
    Ok(results
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            r.unwrap_or_else(|| DeviceResult {
                job: i,
                error: Some("not run".into()),
                ..DeviceResult::default()
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_execute_prompt_by_prompt_with_target_only_first() {
        let cfg = LabConfig::from_toml(config::DEFAULT_TOML, "default").unwrap();
        let prompts = cfg.load_prompts().unwrap();
        let planned = plan(&cfg, &prompts);
        let order = execution_order(&planned);
        let mut seen = order.clone();
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..planned.len()).collect::<Vec<_>>(),
            "a permutation"
        );
        // Consecutive runs share a prompt until every run of it is done.
        let mut done: Vec<&str> = Vec::new();
        for w in order.windows(2) {
            let (a, b) = (&planned[w[0]], &planned[w[1]]);
            if a.prompt.id != b.prompt.id || a.rep != b.rep {
                assert!(!done.contains(&b.prompt.id.as_str()) || b.rep != a.rep);
                done.push(&a.prompt.id);
            }
        }
        // Within a prompt, target-only on a profile comes before any other
        // mode on that profile (the identity reference).
        for (n, &i) in order.iter().enumerate() {
            let p = &planned[i];
            if p.mode == Mode::TargetOnly || p.timeline.is_some() || p.mode == Mode::DraftOnly {
                continue;
            }
            let reference = order[..n].iter().any(|&j| {
                let q = &planned[j];
                q.mode == Mode::TargetOnly && q.profile == p.profile && q.prompt.id == p.prompt.id
            });
            assert!(
                reference,
                "{} / {} / {}",
                p.mode.name(),
                p.profile,
                p.prompt.id
            );
        }
        // Modes alternate: the first runs are all of one prompt, across modes.
        let first: std::collections::HashSet<_> = order[..modes_per_prompt(&planned)]
            .iter()
            .map(|&i| planned[i].mode.name())
            .collect();
        assert!(first.len() >= 3, "{first:?}");
    }

    fn modes_per_prompt(planned: &[Planned]) -> usize {
        let id = &planned[0].prompt.id;
        planned
            .iter()
            .filter(|p| &p.prompt.id == id && p.rep == 0)
            .count()
    }
}
