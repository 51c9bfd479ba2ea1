//! `tandem bench soak`: the fault soak (issue 19, item 8). N device sessions
//! generate at once for a while against one `tandem serve-verifier` child,
//! through an in-process netsim proxy whose timeline adds jitter and loss,
//! resets every connection now and then and goes offline (outages), while the
//! coordinator SIGKILLs the verifier and restarts it on the same port.
//!
//! The devices are threads of this process, each with its own
//! `tandem_edge::EdgeRuntime` on the shared real draft model, generating
//! greedily over a small prompt set in a loop (`device.rs`). Afterwards every
//! generation is checked against the real target in this process
//! (`check.rs`): verified tokens are the target's greedy choice given what was
//! streamed before them, provisional tokens are reported exactly, nothing was
//! streamed twice or lost. The verifier's and this process's RSS are sampled
//! all along (`report.rs` judges the trend); the verifier's logs and this
//! process's panic hook count panics. The command exits non-zero when any
//! invariant fails. Method and the recorded run: docs/verifier.md ("Fault
//! soak"); JSON schema: docs/cli.md.

mod check;
mod device;
mod report;

use super::verifier::report::gauge;
use super::verifier::trace::encode_prompts;
use super::verifier::{metrics, start_verifier, verifier_toml, ANY_LOOPBACK_PORT, TOKEN};
use super::worker::PromptCase;
use super::{cpu_model, load_prompt_set, loadavg, model_file, progress, utc_now, BenchModel};
use anyhow::{bail, Context, Result};
use check::{GenerationCheck, TargetOracle};
use device::{Record, Shared};
use report::{Kill, Report, RssSample, Window};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tandem_cli_common::link_overrides::LinkOverrides;
use tandem_cli_common::models::proc_status_bytes_of;
use tandem_edge::EdgeConfig;
use tandem_lab as lab;
use tandem_model::speculative::GenerateConfig;
use tandem_model::tokenizer::Tokenizer;
use tandem_model::transformer::{LoadOptions, Model};
use tandem_netsim::{Proxy, Step, Timeline};

/// Jitter and loss on every profile of the timeline unless given.
const DEFAULT_JITTER_MS: f64 = 5.0;
const DEFAULT_LOSS: f64 = 0.01;
/// How often the coordinator looks at the clock.
const TICK: Duration = Duration::from_millis(200);
/// After `--drain-timeout` the running generations are cancelled; devices
/// still running this long after that are reported as hung.
const CANCEL_GRACE: Duration = Duration::from_secs(60);
/// Attempts to restart the verifier on its port after a kill.
const RESTART_ATTEMPTS: usize = 5;

fn duration_arg(text: &str) -> Result<Duration, String> {
    tandem_netsim::parse_duration(text)
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Print one JSON object (schema in docs/cli.md) instead of the table.
    #[arg(long)]
    json: bool,
    /// Device sessions generating at once (a thread and an edge runtime each).
    #[arg(long, default_value_t = 32)]
    sessions: usize,
    /// How long devices start new generations (`10m`, `60s`); the running
    /// ones then finish.
    #[arg(long, default_value = "10m", value_parser = duration_arg)]
    duration: Duration,
    /// The netsim timeline (`tandem netsim --timeline` syntax, e.g. "wifi 30s,
    /// offline 10s, reset, wifi"). Default: `--profile` with `--outages`
    /// outages and `--resets` resets spread over the duration.
    #[arg(long, conflicts_with_all = ["outages", "outage_length", "resets"])]
    timeline: Option<String>,
    /// The link's profile outside outages (default timeline).
    #[arg(long, default_value = "wifi")]
    profile: String,
    /// Outages (netsim `offline`) in the default timeline.
    #[arg(long, default_value_t = 2)]
    outages: usize,
    /// Length of each outage.
    #[arg(long, default_value = "20s", value_parser = duration_arg)]
    outage_length: Duration,
    /// Instants that reset every connection, in the default timeline.
    #[arg(long, default_value_t = 4)]
    resets: usize,
    /// Verifier SIGKILLs (each followed by a restart on the same port), placed
    /// between the outages.
    #[arg(long, default_value_t = 1)]
    kills: usize,
    /// Explicit kill times instead of `--kills` (comma-separated, e.g. "5m").
    #[arg(long, value_delimiter = ',', value_parser = duration_arg, conflicts_with = "kills")]
    kill_verifier_at: Vec<Duration>,
    #[command(flatten)]
    link: LinkOverrides,
    /// Seed of netsim's jitter, loss and reset draws.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Tokens per generation (few: the devices draft on this machine's cores).
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Draft block length.
    #[arg(long, default_value_t = 4)]
    k: usize,
    /// Each device's conversation cache budget (`conversations.budget_mib`),
    /// MiB. Small by default so that the caches reach their bound within the
    /// warm-up: the RSS judgement looks for growth that has none (at the
    /// product's 64 MiB, 32 devices' caches would fill for hours).
    #[arg(long, default_value_t = 2)]
    conversation_budget_mib: u64,
    /// First prompts of the prompt set the devices cycle over.
    #[arg(long, default_value_t = 8)]
    prompt_count: usize,
    /// Only the last this many tokens of each chat-formatted prompt (short
    /// prefills; 0: the whole prompt).
    #[arg(long, default_value_t = 24)]
    prompt_tail: usize,
    /// Prompt set (JSON lines); default: the built-in prompts/default.jsonl.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// RSS sampling interval.
    #[arg(long, default_value = "10s", value_parser = duration_arg)]
    rss_every: Duration,
    /// How long the running generations may take to finish after the
    /// duration before they are cancelled (a cancelled generation fails the
    /// soak).
    #[arg(long, default_value = "5m", value_parser = duration_arg)]
    drain_timeout: Duration,
    /// Verifier threads (RAYON_NUM_THREADS; default: all logical CPUs).
    #[arg(long)]
    threads: Option<usize>,
    /// Directory for the verifier's configs and logs.
    #[arg(long, default_value = "target/bench-soak")]
    out: PathBuf,
}

/// The faults of one run: the netsim timeline and the verifier kills.
struct FaultPlan {
    timeline: Timeline,
    kills: Vec<Duration>,
}

/// Where `n` events go in `0..duration`: evenly, at (i + 1) / (n + 1).
fn even_slots(duration: Duration, n: usize) -> Vec<Duration> {
    (0..n)
        .map(|i| duration.mul_f64((i + 1) as f64 / (n + 1) as f64))
        .collect()
}

/// The default timeline text and kill times: outages and kills share evenly
/// spaced slots, alternating outage, kill, outage, ... (kills between
/// outages); resets at the middles of `resets` equal parts of the duration.
fn default_faults(
    duration: Duration,
    profile: &str,
    outages: usize,
    outage_length: Duration,
    resets: usize,
    kills: usize,
) -> (String, Vec<Duration>) {
    let slots = even_slots(duration, outages.saturating_add(kills));
    let (mut outage_starts, mut kill_times) = (Vec::new(), Vec::new());
    for (i, at) in slots.into_iter().enumerate() {
        let kill_turn = i % 2 == 1 || outage_starts.len() == outages;
        if kill_turn && kill_times.len() < kills {
            kill_times.push(at);
        } else {
            outage_starts.push(at);
        }
    }
    // Boundaries in time order: (at, what) with what = reset, offline, back.
    let mut events: Vec<(Duration, &str)> = Vec::new();
    for i in 0..resets {
        events.push((duration.mul_f64((i as f64 + 0.5) / resets as f64), "reset"));
    }
    for &at in &outage_starts {
        events.push((at, "offline"));
        events.push((at.saturating_add(outage_length), "back"));
    }
    events.sort_by_key(|e| e.0);
    let mut parts = Vec::new();
    let (mut now, mut current) = (Duration::ZERO, profile);
    for (at, what) in events {
        if at > now {
            parts.push(format!("{current} {}ms", (at - now).as_millis()));
            now = at;
        }
        match what {
            "reset" => parts.push("reset".to_string()),
            "offline" => current = "offline",
            _ => current = profile,
        }
    }
    // An outage still open at the end would be closed by the profile anyway.
    parts.push(profile.to_string());
    (parts.join(", "), kill_times)
}

/// The outage windows and reset instants of a timeline, seconds from its start.
fn fault_windows(timeline: &Timeline) -> (Vec<Window>, Vec<f64>) {
    let (mut outages, mut resets) = (Vec::new(), Vec::new());
    let mut t = Duration::ZERO;
    for s in timeline.segments() {
        match &s.step {
            Step::Reset => resets.push(t.as_secs_f64()),
            Step::Conditions(c) if c.up.blackhole || c.down.blackhole => outages.push(Window {
                start_s: t.as_secs_f64(),
                end_s: s.duration.map(|d| t.saturating_add(d).as_secs_f64()),
            }),
            Step::Conditions(_) => {}
        }
        t = t.saturating_add(s.duration.unwrap_or_default());
    }
    (outages, resets)
}

/// Effective settings after defaults.
struct Resolved {
    prompts: Vec<PromptCase>,
    prompt_tail: Option<usize>,
    link: LinkOverrides,
    faults: FaultPlan,
    threads: usize,
}

impl Args {
    fn resolve(&self) -> Result<Resolved> {
        anyhow::ensure!(
            (1..=256).contains(&self.sessions),
            "--sessions must be in 1..=256"
        );
        anyhow::ensure!(!self.duration.is_zero(), "--duration must be positive");
        anyhow::ensure!(
            (1..=1024).contains(&self.max_tokens),
            "--max-tokens must be in 1..=1024"
        );
        anyhow::ensure!(
            (1..=tandem_model::speculative::MAX_K).contains(&self.k),
            "--k must be in 1..={}",
            tandem_model::speculative::MAX_K
        );
        anyhow::ensure!(
            self.rss_every >= Duration::from_secs(1),
            "--rss-every must be at least 1s"
        );
        anyhow::ensure!(self.prompt_count >= 1, "--prompt-count must be at least 1");
        let prompts = load_prompt_set(self.prompts.as_deref(), self.prompt_count)?;
        let mut link = self.link.clone();
        link.jitter_ms.get_or_insert(DEFAULT_JITTER_MS);
        link.loss.get_or_insert(DEFAULT_LOSS);
        let (text, default_kills) = default_faults(
            self.duration,
            &self.profile,
            self.outages,
            self.outage_length,
            self.resets,
            self.kills,
        );
        let text = self.timeline.clone().unwrap_or(text);
        let timeline = Timeline::parse(&text)
            .with_context(|| format!("the soak's timeline {text:?}"))?
            .map_conditions(link.apply()?);
        timeline.validate()?;
        let kills = if self.kill_verifier_at.is_empty() {
            default_kills
        } else {
            let mut k = self.kill_verifier_at.clone();
            k.sort();
            k
        };
        anyhow::ensure!(
            kills.iter().all(|&k| k < self.duration),
            "every kill must fall within --duration"
        );
        let threads = self
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        anyhow::ensure!(threads >= 1, "--threads must be at least 1");
        Ok(Resolved {
            prompts,
            prompt_tail: (self.prompt_tail > 0).then_some(self.prompt_tail),
            link,
            faults: FaultPlan { timeline, kills },
            threads,
        })
    }
}

/// Counts the panics of this process (the default hook still prints them).
fn count_panics() -> Arc<AtomicUsize> {
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        seen.fetch_add(1, Ordering::SeqCst);
        previous(info);
    }));
    count
}

/// Lines of the verifier logs in `out` (every incarnation) that report a panic.
fn panics_in_logs(logs: &[PathBuf]) -> Result<usize> {
    let mut n = 0;
    for log in logs {
        let text =
            std::fs::read_to_string(log).with_context(|| format!("reading {}", log.display()))?;
        n += text.lines().filter(|l| l.contains("panicked")).count();
    }
    Ok(n)
}

/// One JSON line per generation (`<out>/soak-generations.jsonl`): who, when,
/// how it went (counts and statuses, never text), and the check's verdict.
fn write_generations(
    path: &Path,
    records: &[Record],
    checks: &[Result<GenerationCheck, String>],
) -> Result<()> {
    use std::io::Write as _;
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    for (r, c) in records.iter().zip(checks) {
        let line = serde_json::json!({
            "device": r.device,
            "prompt": r.prompt,
            "started_s": r.started_s,
            "ended_s": r.ended_s,
            "outcome": match &r.outcome {
                Ok(f) => serde_json::json!({
                    "tokens": f.tokens.len(),
                    "statuses": f.statuses.iter().map(|s| match s {
                        tandem_edge::TokenStatus::Verified => 'v',
                        tandem_edge::TokenStatus::Provisional => 'p',
                        tandem_edge::TokenStatus::Local => 'l',
                    }).collect::<String>(),
                    "stop": format!("{:?}", f.stop),
                    "spans": f.provisional.spans,
                    "stats": f.stats,
                    "stream_faults": f.stream_faults,
                }),
                Err(e) => serde_json::json!({ "error": e }),
            },
            "check": match c {
                Ok(c) => serde_json::json!({
                    "verified_differing": c.verified_differing,
                    "misreported": c.misreported,
                    "unreported_provisional": c.unreported_provisional,
                    "equals_target_only": c.equals_target_only,
                    "departed": c.departed,
                }),
                Err(e) => serde_json::json!({ "error": e }),
            },
        });
        writeln!(w, "{line}").with_context(|| format!("writing {}", path.display()))?;
    }
    w.flush()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The running verifier and how to start it again.
struct Verifier {
    proc: Option<lab::Proc>,
    admin: Option<String>,
    /// The gRPC address, the same for every incarnation.
    grpc: SocketAddr,
    /// The config for restarts (the first run's port).
    restart_toml: PathBuf,
    out: PathBuf,
    threads: usize,
    incarnation: usize,
    logs: Vec<PathBuf>,
}

impl Verifier {
    fn cpus(&self) -> (String, bool, usize) {
        let all = std::thread::available_parallelism().map_or(1, |n| n.get());
        (format!("0-{}", all.saturating_sub(1)), false, self.threads)
    }

    fn start(out: &Path, toml_text: &dyn Fn(SocketAddr) -> String, threads: usize) -> Result<Self> {
        let first = out.join("soak-verifier.toml");
        std::fs::write(&first, toml_text(ANY_LOOPBACK_PORT))
            .with_context(|| format!("writing {}", first.display()))?;
        let mut v = Self {
            proc: None,
            admin: None,
            grpc: ANY_LOOPBACK_PORT,
            restart_toml: out.join("soak-verifier-restart.toml"),
            out: out.to_path_buf(),
            threads,
            incarnation: 0,
            logs: Vec::new(),
        };
        v.launch(&first)?;
        std::fs::write(&v.restart_toml, toml_text(v.grpc))
            .with_context(|| format!("writing {}", v.restart_toml.display()))?;
        Ok(v)
    }

    fn launch(&mut self, toml: &Path) -> Result<()> {
        self.incarnation += 1;
        let name = format!("soak-verifier-{}", self.incarnation);
        self.logs.push(self.out.join(format!("{name}.log")));
        let (cores, pin, threads) = self.cpus();
        let (proc, grpc, admin) = start_verifier(toml, &name, &self.out, (&cores, pin, threads))?;
        self.grpc = grpc
            .parse()
            .with_context(|| format!("the verifier's gRPC address {grpc:?}"))?;
        self.proc = Some(proc);
        self.admin = Some(admin);
        Ok(())
    }

    /// SIGKILL (no drain, no goodbye to the devices) and wait for the exit.
    fn kill(&mut self) {
        // Dropping the child kills it with SIGKILL and reaps it.
        self.proc = None;
        self.admin = None;
    }

    /// Starts the verifier again on the same port.
    fn restart(&mut self) -> Result<()> {
        let toml = self.restart_toml.clone();
        let mut last = None;
        for _ in 0..RESTART_ATTEMPTS {
            match self.launch(&toml) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    progress(&format!("verifier restart failed ({e:#}); retrying"));
                    last = Some(e);
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no restart attempt")))
    }

    fn pid(&self) -> Option<u32> {
        self.proc.as_ref().map(lab::Proc::pid)
    }
}

/// One RSS sample of the verifier and of this process (the devices).
fn sample(at_s: f64, v: &Verifier, devices: &Shared) -> RssSample {
    let pid = v.pid();
    let text = v.admin.as_deref().and_then(metrics);
    let metric = |name: &str| text.as_deref().and_then(|m| gauge(m, name));
    let edge_heap = tandem_verifier::heap::heap_stats();
    let status = |pid: &str| proc_status_bytes_of(pid, ["VmRSS:", "RssAnon:", "RssFile:"]);
    let [verifier_rss, verifier_anon, verifier_file] =
        pid.map_or([None; 3], |p| status(&p.to_string()));
    let [edge_rss, edge_anon, _] = status("self");
    RssSample {
        at_s,
        verifier_incarnation: v.incarnation,
        verifier_pid: pid,
        verifier_rss_bytes: verifier_rss,
        verifier_rss_anon_bytes: verifier_anon,
        verifier_rss_file_bytes: verifier_file,
        edge_rss_bytes: edge_rss,
        edge_rss_anon_bytes: edge_anon,
        edge_heap_in_use_bytes: edge_heap.map(|h| h.in_use),
        edge_heap_free_bytes: edge_heap.map(|h| h.free_held),
        edge_conversation_bytes: Some(devices.kept_conversation_bytes()),
        verifier_sessions: metric("tandem_verifier_sessions"),
        kv_pages_used: metric("tandem_verifier_kv_pages_used"),
        kv_pages_in_store: metric("tandem_verifier_session_bytes")
            .zip(metric("tandem_verifier_kv_page_bytes"))
            .filter(|&(_, page)| page > 0.0)
            .map(|(bytes, page)| bytes / page),
        kv_pages_allocated: metric("tandem_verifier_kv_pages_allocated"),
        kv_pool_bytes: metric("tandem_verifier_kv_pages_allocated")
            .zip(metric("tandem_verifier_kv_page_bytes"))
            .map(|(pages, page)| (pages * page) as u64),
        sessions_opened: metric("tandem_verifier_sessions_opened_total"),
        heap_in_use_bytes: metric("tandem_verifier_heap_in_use_bytes").map(|b| b as u64),
        heap_free_bytes: metric("tandem_verifier_heap_free_bytes").map(|b| b as u64),
    }
}

pub fn run(args: Args) -> Result<()> {
    let t0 = Instant::now();
    let panics = count_panics();
    let res = args.resolve()?;
    let loadavg_before = loadavg();
    let date_utc = utc_now();
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;

    // Models and prompts.
    let draft_path = model_file(BenchModel::Draft, None)?;
    let target_path = model_file(BenchModel::Target, None)?;
    let gguf = tandem_model::gguf::GgufFile::open(&draft_path)
        .with_context(|| format!("opening {}", draft_path.display()))?;
    let tok = Tokenizer::from_gguf(&gguf).context("building the tokenizer")?;
    drop(gguf);
    let prompts = encode_prompts(&tok, &res.prompts, res.prompt_tail)?;
    let stop_tokens = tok.chat_stop_tokens();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    // Room for a whole generation plus a full block, in 64-token steps.
    let max_seq_len = longest
        .saturating_add(args.max_tokens)
        .saturating_add(tandem_verifier::config::MAX_BLOCK_CAP + 1)
        .div_ceil(64)
        .saturating_mul(64);
    let draft = Arc::new(
        Model::load(&draft_path, LoadOptions::with_max_seq_len(max_seq_len))
            .with_context(|| format!("loading {}", draft_path.display()))?,
    );

    // The verifier, and netsim in front of it.
    progress(&format!(
        "starting the verifier (logs in {})",
        args.out.display()
    ));
    let toml_text =
        |listen: SocketAddr| verifier_toml(&target_path, max_seq_len, args.sessions, true, listen);
    let mut verifier = Verifier::start(&args.out, &toml_text, res.threads)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("soak-netsim")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let proxy = rt.block_on(Proxy::start_seeded(
        "127.0.0.1:0".parse()?,
        verifier.grpc,
        res.faults.timeline.initial().clone(),
        args.seed,
    ))?;

    // The devices.
    let records = Arc::new(Mutex::new(Vec::<Record>::new()));
    let started = Arc::new(AtomicUsize::new(0));
    let clock = Instant::now();
    let shared = Arc::new(Shared {
        draft: draft.clone(),
        edge: EdgeConfig {
            verifier_url: Some(format!("http://{}", proxy.local_addr())),
            token: Some(TOKEN.into()),
            tokenizer_fingerprint: Some(tok.fingerprint()),
            k: args.k,
            conversations: tandem_edge::ConversationConfig {
                budget_mib: args.conversation_budget_mib,
                ..Default::default()
            },
            ..EdgeConfig::default()
        },
        gen: GenerateConfig {
            max_tokens: args.max_tokens,
            k: args.k,
            stop_tokens: stop_tokens.clone(),
            ..GenerateConfig::default()
        },
        prompts: Arc::new(prompts.clone()),
        clock,
        stop: Arc::new(AtomicBool::new(false)),
        cancel: Arc::new(AtomicBool::new(false)),
        records: records.clone(),
        started: started.clone(),
        conversation_bytes: Arc::new((0..args.sessions).map(|_| AtomicU64::new(0)).collect()),
    });
    proxy.set_timeline(res.faults.timeline.clone());
    progress(&format!(
        "{} sessions for {:.0} s; timeline \"{}\"; kills at {:?}",
        args.sessions,
        args.duration.as_secs_f64(),
        res.faults.timeline,
        res.faults.kills
    ));
    let mut devices = Vec::with_capacity(args.sessions);
    for i in 0..args.sessions {
        let shared = shared.clone();
        devices.push(
            std::thread::Builder::new()
                .name(format!("soak-device-{i}"))
                .spawn(move || device::run(i, &shared))
                .context("starting a device thread")?,
        );
    }

    // The coordinator: kills, restarts, samples, until the duration is over
    // and the devices have finished.
    let mut samples = vec![sample(0.0, &verifier, &shared)];
    let mut next_sample = args.rss_every;
    let mut pending_kills = res.faults.kills.clone().into_iter().peekable();
    let mut kills = Vec::new();
    let mut stopping_at: Option<Instant> = None;
    let mut hung = 0;
    loop {
        std::thread::sleep(TICK);
        let now = clock.elapsed();
        if let Some(&at) = pending_kills.peek() {
            if now >= at {
                pending_kills.next();
                progress(&format!("{:.1} s: SIGKILL the verifier", now.as_secs_f64()));
                verifier.kill();
                let killed = clock.elapsed();
                verifier.restart()?;
                let back = clock.elapsed();
                progress(&format!(
                    "{:.1} s: the verifier serves again ({:.1} s after the kill)",
                    back.as_secs_f64(),
                    (back - killed).as_secs_f64()
                ));
                kills.push(Kill {
                    at_s: killed.as_secs_f64(),
                    serving_again_s: back.as_secs_f64(),
                });
            }
        }
        if now >= next_sample {
            samples.push(sample(now.as_secs_f64(), &verifier, &shared));
            next_sample = next_sample.saturating_add(args.rss_every);
        }
        if now >= args.duration && stopping_at.is_none() {
            shared.stop.store(true, Ordering::SeqCst);
            stopping_at = Some(Instant::now());
            progress(&format!(
                "{:.1} s: no new generations; waiting for the running ones",
                now.as_secs_f64()
            ));
        }
        if let Some(since) = stopping_at {
            let running = devices.iter().filter(|d| !d.is_finished()).count();
            if running == 0 {
                break;
            }
            if since.elapsed() >= args.drain_timeout && !shared.cancel.load(Ordering::SeqCst) {
                progress(&format!("{running} device(s) still running: cancelling"));
                shared.cancel.store(true, Ordering::SeqCst);
            }
            if since.elapsed() >= args.drain_timeout.saturating_add(CANCEL_GRACE) {
                hung = running;
                progress(&format!("{hung} device(s) hung"));
                break;
            }
        }
    }
    let soak_s = clock.elapsed().as_secs_f64();
    if samples.last().is_none_or(|s| soak_s - s.at_s >= 1.0) {
        samples.push(sample(soak_s, &verifier, &shared));
    }
    let mut device_errors = Vec::new();
    for d in devices {
        if d.is_finished() {
            match d.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => device_errors.push(e),
                Err(_) => device_errors.push("a device thread panicked".into()),
            }
        }
    }
    let proxy_stats = proxy.stats();
    rt.block_on(proxy.shutdown());
    verifier.kill();
    let verifier_panics = panics_in_logs(&verifier.logs)?;
    let records = std::mem::take(&mut *records.lock().unwrap_or_else(|p| p.into_inner()));
    let started = started.load(Ordering::SeqCst);
    drop(draft);
    drop(shared);

    // The check against the target.
    progress(&format!(
        "{} generations; checking them against the target ...",
        records.len()
    ));
    let oracle = TargetOracle::new(&target_path, &prompts, args.max_tokens, &stop_tokens)?;
    let checks: Vec<Result<GenerationCheck, String>> = records
        .iter()
        .map(|r| match &r.outcome {
            Ok(f) => oracle.check(r.prompt, f).map_err(|e| format!("{e:#}")),
            Err(e) => Err(e.clone()),
        })
        .collect();

    let log = args.out.join("soak-generations.jsonl");
    write_generations(&log, &records, &checks)?;
    progress(&format!("every generation: {}", log.display()));
    let (outages, resets) = fault_windows(&res.faults.timeline);
    let report = Report::build(report::Inputs {
        date_utc,
        wall_s: t0.elapsed().as_secs_f64(),
        soak_s,
        machine: super::report::Machine {
            cpu: cpu_model(),
            logical_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            loadavg_before,
            loadavg_after: loadavg(),
        },
        settings: report::Settings {
            sessions: args.sessions,
            duration_s: args.duration.as_secs_f64(),
            max_tokens: args.max_tokens,
            k: args.k,
            conversation_budget_mib: args.conversation_budget_mib,
            prompt_ids: res.prompts.iter().map(|p| p.id.clone()).collect(),
            prompt_tail: res.prompt_tail,
            timeline: res.faults.timeline.to_string(),
            jitter_ms: res.link.jitter_ms,
            loss: res.link.loss,
            seed: args.seed,
            rss_every_s: args.rss_every.as_secs_f64(),
            drain_timeout_s: args.drain_timeout.as_secs_f64(),
            verifier_threads: res.threads,
        },
        outages,
        resets,
        kills,
        proxy: proxy_stats,
        records: &records,
        checks: &checks,
        started,
        hung_devices: hung,
        device_errors,
        samples,
        panics_verifier: verifier_panics,
        panics_edge: panics.load(Ordering::SeqCst),
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report::render(&report));
    }
    if !report.ok {
        bail!(
            "the soak failed: {} (verifier logs in {})",
            report.failed_invariants().join("; "),
            args.out.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn the_default_faults_alternate_outages_and_kills() {
        let (text, kills) = default_faults(secs(600), "wifi", 2, secs(20), 4, 1);
        assert_eq!(kills, vec![secs(300)]);
        assert_eq!(
            text,
            "wifi 75000ms, reset, wifi 75000ms, offline 20000ms, wifi 55000ms, reset, \
             wifi 150000ms, reset, wifi 75000ms, offline 20000ms, wifi 55000ms, reset, wifi"
        );
        let timeline = Timeline::parse(&text).unwrap();
        let (outages, resets) = fault_windows(&timeline);
        assert_eq!(
            outages,
            vec![
                Window {
                    start_s: 150.0,
                    end_s: Some(170.0)
                },
                Window {
                    start_s: 450.0,
                    end_s: Some(470.0)
                }
            ]
        );
        assert_eq!(resets, vec![75.0, 225.0, 375.0, 525.0]);
    }

    #[test]
    fn one_outage_then_one_kill() {
        let (text, kills) = default_faults(secs(60), "lan", 1, secs(8), 2, 1);
        assert_eq!(kills, vec![secs(40)]);
        let (outages, resets) = fault_windows(&Timeline::parse(&text).unwrap());
        assert_eq!(
            outages,
            vec![Window {
                start_s: 20.0,
                end_s: Some(28.0)
            }]
        );
        assert_eq!(resets, vec![15.0, 45.0]);
        // Only kills, only outages, nothing.
        assert_eq!(
            default_faults(secs(60), "lan", 0, secs(8), 0, 2).1,
            vec![secs(20), secs(40)]
        );
        assert!(default_faults(secs(60), "lan", 3, secs(8), 0, 0)
            .1
            .is_empty());
        assert_eq!(default_faults(secs(60), "lan", 0, secs(8), 0, 0).0, "lan");
    }

    #[test]
    fn a_reset_at_an_outage_start_comes_first() {
        let (text, _) = default_faults(secs(40), "wifi", 1, secs(20), 1, 0);
        assert_eq!(text, "wifi 20000ms, reset, offline 20000ms, wifi");
    }
}
