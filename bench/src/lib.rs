//! `tandem bench`: Tandem's model core side by side with candle-transformers'
//! quantized models (`quantized_qwen2`, `_llama`, `_qwen3`, `_gemma3`, by the
//! file's architecture) and (when installed) llama.cpp through
//! llama-cpp-python: load time, prefill and decode speed, the verify-cost curve and peak RSS per
//! model and engine, plus greedy local speculative decoding vs target-only.
//!
//! Each (model, engine) pair runs in a fresh child process (this binary,
//! re-executed with the hidden `--worker` flag, printing one JSON object), one
//! after the other, so that peak RSS is that pair's alone and no two
//! measurements compete for the cores.
//!
//! A command crate of the `tandem` binary (its `bench` feature): `Args` is the
//! subcommand's clap struct, `run` its body, and errors are `anyhow::Error`
//! because the binary only prints them. candle-transformers, the reference
//! engine, is a dependency of this crate only, so the product binary built
//! without the feature does not link it.

mod conversation;
mod device_soak;
mod report;
mod soak;
mod verifier;
mod worker;

use anyhow::{bail, Context, Result};
use report::{
    BenchReport, EngineRun, Machine, Measured, ModelReport, Ratios, Settings, SpecReport,
    VerifyPoint, STATUS_FAILED, STATUS_NOT_INSTALLED, STATUS_OK,
};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use tandem_fetch::{ensure_model, ModelRole, Progress};
use tandem_model::kv_cache::KvPrecision;
use tandem_model::proposer::ProposerKind;
use worker::{MicroPlan, SpecPlan};

/// The shared general prompt set, built in so the binary runs from anywhere.
pub(crate) const DEFAULT_PROMPTS: &str = include_str!("../../prompts/default.jsonl");

/// The first `count` prompts of the prompt set in the file `path` (JSON lines),
/// or of the built-in [`DEFAULT_PROMPTS`]; an error when the set has fewer
/// (`--prompt-count` of `tandem bench soak` and `tandem bench verifier`).
pub(crate) fn load_prompt_set(
    path: Option<&Path>,
    count: usize,
) -> Result<Vec<worker::PromptCase>> {
    let mut prompts = match path {
        Some(p) => worker::parse_prompts(
            &std::fs::read_to_string(p)
                .with_context(|| format!("reading prompt set {}", p.display()))?,
        )?,
        None => worker::parse_prompts(DEFAULT_PROMPTS)?,
    };
    anyhow::ensure!(
        prompts.len() >= count,
        "--prompt-count {count}: the prompt set has {} prompts",
        prompts.len()
    );
    prompts.truncate(count);
    Ok(prompts)
}
/// The editing prompt set (code or text to change, carried in the prompt).
const EDITING_PROMPTS: &str = include_str!("../../prompts/editing.jsonl");

/// The built-in fill-in-the-middle set (`--prompts fim`): five code files
/// with a hole, each line a prefix (`prompt`) and a `suffix`, encoded in the
/// model's FIM format (docs/benchmarks.md, "Fill in the middle").
const FIM_PROMPTS: &str = include_str!("../../prompts/fim.jsonl");
/// The llama.cpp measurement script, built in and run with `python3 -c`.
const LLAMA_CPP_SCRIPT: &str = include_str!("../../scripts/llama_cpp_bench.py");
/// Verify block sizes of the cost curve by default (k = 1 is the reference;
/// `--ks` chooses others). 24, 40 and 64 are the row counts the verifier's
/// batching produces (several sessions' blocks in one forward; docs/verifier.md).
const VERIFY_KS: [usize; 9] = [1, 2, 3, 5, 9, 17, 24, 40, 64];
/// The largest `--ks` entry: a verify block far beyond any draft length or
/// batch measures nothing the product runs.
const MAX_VERIFY_K: usize = 256;
/// Prompt length for prefill and the verify context, by default.
const PROMPT_TOKENS: usize = 128;
/// The largest `--prompt-tokens`.
const MAX_PROMPT_TOKENS: usize = 2048;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchModel {
    Draft,
    Target,
}

impl BenchModel {
    fn role(self) -> ModelRole {
        match self {
            Self::Draft => ModelRole::Draft,
            Self::Target => ModelRole::Target,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Self::Draft => "draft",
            Self::Target => "target",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    /// Tandem's own model core (tandem-model).
    Tandem,
    /// candle-transformers' quantized model of the file's architecture
    /// (quantized_qwen2, _qwen3, _llama, _gemma3).
    Candle,
    /// llama.cpp via llama-cpp-python (skipped when not installed).
    LlamaCpp,
}

impl Engine {
    fn name(self) -> &'static str {
        match self {
            Self::Tandem => "tandem",
            Self::Candle => "candle",
            Self::LlamaCpp => "llama-cpp",
        }
    }
}

/// What a hidden worker invocation measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkerKind {
    Micro,
    Spec,
}

#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    cmd: Option<BenchCmd>,
    /// Print one JSON object (schema in docs/cli.md) instead of tables.
    #[arg(long)]
    json: bool,
    /// Models to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_values = ["draft", "target"])]
    models: Vec<BenchModel>,
    /// Engines to compare, comma-separated.
    #[arg(long, value_delimiter = ',', default_values = ["tandem", "candle", "llama-cpp"])]
    engines: Vec<Engine>,
    /// The file the `draft` model row measures, and the draft of the
    /// speculative comparison: a GGUF path, a built-in name, or one of
    /// yours in the models directory (`tandem models list`) [default: the
    /// built-in Qwen2.5-Coder 0.5B].
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// The file of the `target` row and the target of the speculative
    /// comparison, as `--draft-model` [default: the built-in Qwen2.5-Coder
    /// 1.5B]. The two must pair (`tandem models check-pair`).
    #[arg(long)]
    target_model: Option<PathBuf>,
    /// Threads per engine (default: all logical CPUs).
    #[arg(long)]
    threads: Option<usize>,
    /// Timed repeats of each measurement, after one warm-up (default 5, --quick 2).
    #[arg(long)]
    repeats: Option<usize>,
    /// Measure every engine this many times, interleaved (tandem, candle,
    /// llama-cpp, tandem, …): figures are medians over the rounds and ratios
    /// medians of the per-round ratios, so a shared machine that speeds up or
    /// slows down during the run biases no engine.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Short run: 2 repeats, 32 decode tokens, 3 speculative prompts capped at 32 tokens.
    #[arg(long)]
    quick: bool,
    /// Prompts of the prompt set for the speculative comparison (default 10,
    /// --quick 3; 0 skips it). Runs when tandem is among the engines and always
    /// uses the draft + target pair.
    #[arg(long)]
    spec_prompts: Option<usize>,
    /// Draft block length of the speculative comparison.
    #[arg(long, default_value_t = 4)]
    k: usize,
    /// Proposers of the speculative comparison, comma-separated (each runs
    /// after the same prompt's target-only generation): draft, lookup, auto.
    #[arg(long, value_delimiter = ',', default_values = ["draft"])]
    proposers: Vec<ProposerKind>,
    /// Precisions of the draft's KV cache in the speculative comparison,
    /// comma-separated: f16 (the default, as in `tandem generate`), f32, int8.
    /// Each proposer runs once per precision, after the same prompt's
    /// target-only generation.
    #[arg(long, value_delimiter = ',', default_values = ["f16"])]
    draft_kv: Vec<KvPrecision>,
    /// Prompt sets of the speculative comparison, comma-separated, one table
    /// each: `default` (the built-in general set, prompts/default.jsonl),
    /// `editing` (the built-in editing set, prompts/editing.jsonl), `fim`
    /// (fill in the middle, prompts/fim.jsonl), or a file of JSON lines with
    /// id, kind, prompt, max_tokens and optionally suffix (a fill-in-the-middle
    /// case: the prompt is the prefix, in the model's FIM format).
    #[arg(long, value_delimiter = ',', default_values = ["default"])]
    prompts: Vec<String>,
    /// Rows per forward of the verify cost curve, comma-separated and
    /// increasing from 1 (the reference every ratio divides by), at most
    /// 256. The default's 24, 40 and 64 are the verifier's batched forwards.
    #[arg(long = "ks", value_delimiter = ',', default_values_t = VERIFY_KS)]
    verify_ks: Vec<usize>,
    /// Prompt length in tokens of the prefill measurement, which is also the
    /// context the verify blocks of the cost curve follow (at most 2048).
    #[arg(long, default_value_t = PROMPT_TOKENS)]
    prompt_tokens: usize,
    /// Python interpreter for the llama.cpp column.
    #[arg(long, env = "TANDEM_PYTHON", default_value = "python3")]
    python: String,

    /// Device soak instead of the comparison: generate with the draft (local
    /// mode) back to back for this long (e.g. 10m, 30s) and report
    /// first-token latency and decode tok/s per --soak-window, and the decay
    /// (docs/benchmarks.md, "Device soak"). `--threads` sets the draft's
    /// threads. (Not `tandem bench soak`, the verifier fault soak.)
    #[arg(long, value_parser = tandem_netsim::parse_duration)]
    soak: Option<std::time::Duration>,
    /// Window of the soak's table.
    #[arg(long, default_value = "1m", value_parser = tandem_netsim::parse_duration, requires = "soak")]
    soak_window: std::time::Duration,
    /// Tokens per soak generation (no stop token: every one does the same work).
    #[arg(long, default_value_t = 64, requires = "soak")]
    soak_tokens: usize,
    /// Draft GGUF of the soak (default: the cached Qwen2.5-Coder 0.5B).
    #[arg(long, requires = "soak")]
    soak_draft: Option<PathBuf>,
    /// Run the warm-up forward at load (EdgeConfig.warmup) before the soak.
    #[arg(long, requires = "soak")]
    warmup: bool,
    /// Inject a thermal state (nominal, fair, serious, critical) for the soak.
    #[arg(long, value_parser = device_soak::parse_thermal, requires = "soak")]
    soak_thermal: Option<tandem_edge::ThermalState>,
    /// Inject a battery level (percent, not charging) for the soak.
    #[arg(long, requires = "soak")]
    soak_battery: Option<u8>,

    /// Internal: run one measurement in this process and print its JSON.
    #[arg(long, hide = true)]
    worker: Option<WorkerKind>,
    /// Internal: the prompt token ids for a micro worker.
    #[arg(long, hide = true, value_delimiter = ',')]
    prompt_ids: Vec<u32>,
    /// Internal: greedy tokens decoded one at a time.
    #[arg(long, hide = true)]
    decode_tokens: Option<usize>,
}

#[derive(clap::Subcommand, Debug)]
pub enum BenchCmd {
    /// The verifier's capacity: N simulated devices replaying recorded drafts
    /// against one verifier, batching on and off (docs/benchmarks.md).
    Verifier(verifier::Args),
    /// A multi-turn conversation through serve-edge and a loopback verifier,
    /// the conversation caches off and on side by side (docs/edge.md).
    Conversation(conversation::Args),
    /// The fault soak: N devices for minutes against one verifier through
    /// netsim outages, resets and loss, with a verifier SIGKILL and restart;
    /// every invariant checked (docs/verifier.md, "Fault soak").
    Soak(soak::Args),
}

/// Effective settings after defaults and `--quick`.
struct Resolved {
    threads: usize,
    repeats: usize,
    decode_tokens: usize,
    spec_prompts: usize,
    spec_cap: Option<usize>,
}

impl Args {
    fn resolve(&self) -> Result<Resolved> {
        let threads = self
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        anyhow::ensure!(threads >= 1, "--threads must be at least 1");
        let repeats = self.repeats.unwrap_or(if self.quick { 2 } else { 5 });
        anyhow::ensure!(repeats >= 1, "--repeats must be at least 1");
        anyhow::ensure!(self.rounds >= 1, "--rounds must be at least 1");
        anyhow::ensure!(
            (1..=tandem_model::speculative::MAX_K).contains(&self.k),
            "--k must be in 1..={}",
            tandem_model::speculative::MAX_K
        );
        let decode_tokens = self
            .decode_tokens
            .unwrap_or(if self.quick { 32 } else { 64 });
        anyhow::ensure!(decode_tokens >= 1, "--decode-tokens must be at least 1");
        check_verify_ks(&self.verify_ks)?;
        anyhow::ensure!(
            (1..=MAX_PROMPT_TOKENS).contains(&self.prompt_tokens),
            "--prompt-tokens must be in 1..={MAX_PROMPT_TOKENS} (got {})",
            self.prompt_tokens
        );
        // A bad prompt set fails now, not after the model measurements.
        self.prompt_sets()?;
        Ok(Resolved {
            threads,
            repeats,
            decode_tokens,
            spec_prompts: self.spec_prompts.unwrap_or(if self.quick { 3 } else { 10 }),
            spec_cap: self.quick.then_some(32),
        })
    }

    /// The `--prompts` sets, each with its name (`default`, `editing`, or the
    /// file as given).
    fn prompt_sets(&self) -> Result<Vec<(String, Vec<worker::PromptCase>)>> {
        let mut sets = Vec::new();
        for name in &self.prompts {
            let cases = match name.as_str() {
                "default" => worker::parse_prompts(DEFAULT_PROMPTS)?,
                "editing" => worker::parse_prompts(EDITING_PROMPTS)?,
                "fim" => worker::parse_prompts(FIM_PROMPTS)?,
                file => {
                    let text = std::fs::read_to_string(file).with_context(|| {
                        format!("reading prompt set {file} (built in: default, editing, fim)")
                    })?;
                    worker::parse_prompts(&text)
                        .with_context(|| format!("parsing prompt set {file}"))?
                }
            };
            sets.push((name.clone(), cases));
        }
        Ok(sets)
    }
}

pub fn run(args: Args) -> Result<()> {
    match args.cmd {
        Some(BenchCmd::Verifier(a)) => return verifier::run(a),
        Some(BenchCmd::Conversation(a)) => return conversation::run(a),
        Some(BenchCmd::Soak(a)) => return soak::run(a),
        None => {}
    }
    if let Some(duration) = args.soak {
        let draft = match &args.soak_draft {
            Some(p) => p.clone(),
            None => model_file(BenchModel::Draft, args.draft_model.as_ref())?,
        };
        return device_soak::run(device_soak::SoakPlan {
            duration,
            window: args.soak_window,
            tokens: args.soak_tokens,
            warmup: args.warmup,
            draft,
            threads: args.threads,
            // The soak cycles through every prompt of the --prompts sets.
            prompts: args
                .prompt_sets()?
                .into_iter()
                .flat_map(|(_, c)| c)
                .collect(),
            device: tandem_edge::DeviceState {
                thermal: args.soak_thermal,
                battery_pct: args.soak_battery,
                ..Default::default()
            },
            json: args.json,
        });
    }
    let res = args.resolve()?;
    match args.worker {
        Some(kind) => run_worker(&args, &res, kind),
        None => run_parent(&args, &res),
    }
}

/// The file of a model row: the user's `--draft-model`/`--target-model`
/// (a path or a name), else the built-in one, fetched on first use.
pub(crate) fn model_file(m: BenchModel, chosen: Option<&PathBuf>) -> Result<PathBuf> {
    match chosen {
        Some(p) => tandem_cli_common::models::resolve_model_arg(p),
        None => ensure_model(m.role(), Progress::Auto)
            .with_context(|| format!("getting the {} model (try `tandem models fetch`)", m.name())),
    }
}

impl Args {
    /// The user's file for a model row, if they named one.
    fn chosen(&self, m: BenchModel) -> Option<&PathBuf> {
        match m {
            BenchModel::Draft => self.draft_model.as_ref(),
            BenchModel::Target => self.target_model.as_ref(),
        }
    }
}

// ---------------------------------------------------------------- worker side

fn run_worker(args: &Args, res: &Resolved, kind: WorkerKind) -> Result<()> {
    let json = match kind {
        WorkerKind::Micro => {
            let (&[model], &[engine]) = (args.models.as_slice(), args.engines.as_slice()) else {
                bail!("a micro worker takes exactly one model and one engine");
            };
            anyhow::ensure!(
                !args.prompt_ids.is_empty(),
                "a micro worker needs --prompt-ids"
            );
            let plan = MicroPlan {
                prompt: args.prompt_ids.clone(),
                decode_tokens: res.decode_tokens,
                ks: args.verify_ks.clone(),
                repeats: res.repeats,
                threads: res.threads,
            };
            let path = model_file(model, args.chosen(model))?;
            let m = match engine {
                Engine::Tandem => worker::micro_tandem(&path, &plan)?,
                Engine::Candle => worker::micro_candle(&path, &plan)?,
                Engine::LlamaCpp => bail!("llama.cpp runs in its Python script"),
            };
            serde_json::to_string(&m)?
        }
        WorkerKind::Spec => {
            let draft = model_file(BenchModel::Draft, args.chosen(BenchModel::Draft))?;
            let target = model_file(BenchModel::Target, args.chosen(BenchModel::Target))?;
            let mut reports = Vec::new();
            for (prompt_set, mut prompts) in args.prompt_sets()? {
                prompts.truncate(res.spec_prompts);
                let plan = SpecPlan {
                    prompt_set,
                    prompts,
                    k: args.k,
                    proposers: args.proposers.clone(),
                    draft_kvs: args.draft_kv.clone(),
                    max_tokens_cap: res.spec_cap,
                    threads: res.threads,
                };
                reports.extend(worker::speculative(&draft, &target, &plan)?);
            }
            serde_json::to_string(&reports)?
        }
    };
    println!("{json}");
    Ok(())
}

// ---------------------------------------------------------------- parent side

/// Run a child process to completion and parse the JSON on its last stdout line.
fn run_child<T: serde::de::DeserializeOwned>(mut cmd: Command, what: &str) -> Result<T> {
    let out = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("starting the {what} worker"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(6).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "{what} worker failed ({}): {}",
            out.status,
            tail.join(" | ")
        );
    }
    let line = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .with_context(|| format!("{what} worker printed nothing"))?;
    serde_json::from_str(line).with_context(|| format!("parsing the {what} worker's JSON"))
}

/// This binary, re-executed as a worker with the thread count in its
/// environment and the user's model files.
fn self_worker(args: &Args, res: &Resolved, kind: &str) -> Result<Command> {
    // /proc/self/exe runs this very binary even when a rebuild has replaced
    // the file on disk while the bench runs.
    let proc_exe = Path::new("/proc/self/exe");
    let exe = if proc_exe.exists() {
        proc_exe.to_path_buf()
    } else {
        std::env::current_exe().context("locating the tandem binary")?
    };
    let mut cmd = Command::new(exe);
    cmd.env("RAYON_NUM_THREADS", res.threads.to_string())
        .args(["bench", "--worker", kind])
        .args(["--threads", &res.threads.to_string()])
        .args(["--repeats", &res.repeats.to_string()])
        .args(["--decode-tokens", &res.decode_tokens.to_string()])
        .args(["--ks", &ks_csv(&args.verify_ks)]);
    if let Some(p) = &args.draft_model {
        cmd.arg("--draft-model").arg(p);
    }
    if let Some(p) = &args.target_model {
        cmd.arg("--target-model").arg(p);
    }
    Ok(cmd)
}

fn llama_cpp_installed(python: &str) -> bool {
    Command::new(python)
        .args(["-c", "import llama_cpp"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn ids_csv(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

fn ks_csv(ks: &[usize]) -> String {
    ks.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// `--ks`: starts at 1 (every cost ratio divides by it), strictly increasing,
/// at most [`MAX_VERIFY_K`].
fn check_verify_ks(ks: &[usize]) -> Result<()> {
    anyhow::ensure!(
        ks.first() == Some(&1),
        "--ks must start at 1, the reference every cost ratio divides by (got {})",
        ks_csv(ks)
    );
    anyhow::ensure!(
        ks.windows(2).all(|w| w[0] < w[1]),
        "--ks must be strictly increasing (got {})",
        ks_csv(ks)
    );
    anyhow::ensure!(
        ks.last().is_some_and(|&k| k <= MAX_VERIFY_K),
        "--ks entries must be at most {MAX_VERIFY_K} (got {})",
        ks_csv(ks)
    );
    Ok(())
}

fn measure(
    args: &Args,
    res: &Resolved,
    model: BenchModel,
    engine: Engine,
    path: &Path,
    prompt: &[u32],
    llama_ok: bool,
) -> Result<Option<Measured>> {
    let what = format!("{} × {}", model.name(), engine.name());
    let cmd = match engine {
        Engine::Tandem | Engine::Candle => {
            let mut c = self_worker(args, res, "micro")?;
            c.args(["--models", model.name(), "--engines", engine.name()])
                .args(["--prompt-ids", &ids_csv(prompt)]);
            c
        }
        Engine::LlamaCpp => {
            if !llama_ok {
                return Ok(None);
            }
            let llama = |extra: &[&str]| {
                let mut c = Command::new(&args.python);
                c.args(["-c", LLAMA_CPP_SCRIPT])
                    .arg("--model")
                    .arg(path)
                    .args(["--threads", &res.threads.to_string()])
                    .args(["--repeats", &res.repeats.to_string()])
                    .args(["--decode-tokens", &res.decode_tokens.to_string()])
                    .args(["--ks", &ks_csv(&args.verify_ks)])
                    .args(["--prompt-ids", &ids_csv(prompt)])
                    .args(extra);
                c
            };
            // Native builds on AVX-512/AMX CPUs can crash in ggml's AMX matmul
            // (seen in KVM guests): measure again without the extra buffer
            // types, and say so in the engine's version string.
            return match run_child(llama(&[]), &what) {
                Err(e) if format!("{e:#}").contains("SIGSEGV") => {
                    eprintln!("bench: {what} crashed ({e:#}); again without llama.cpp's extra buffer types (AMX, repacking)");
                    run_child(llama(&["--no-extra-bufts"]), &what).map(Some)
                }
                r => r.map(Some),
            };
        }
    };
    run_child(cmd, &what).map(Some)
}

/// The bench prompt: a fixed chat request, tokenized with the model's
/// own tokenizer, repeated as needed and cut to exactly `len` tokens
/// (`--prompt-tokens`).
fn bench_prompt(path: &Path, len: usize) -> Result<Vec<u32>> {
    use tandem_model::tokenizer::{ChatMessage, Tokenizer};
    let gguf = tandem_model::gguf::GgufFile::open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let tok = Tokenizer::from_gguf(&gguf).context("building the tokenizer")?;
    let text = "Review this Rust function and explain, step by step, how it could be made \
                faster without changing its output:\n\nfn count_words(text: &str) -> \
                std::collections::HashMap<String, usize> {\n    let mut m = \
                std::collections::HashMap::new();\n    for w in text.split_whitespace() {\n        \
                *m.entry(w.to_lowercase()).or_insert(0) += 1;\n    }\n    m\n}\n\nThen write a \
                short benchmark for it and describe what results you would expect on a \
                two-core laptop. 最后用一句中文总结。";
    // A chat model gets the prompt as a user turn; a base model (no chat
    // template, e.g. Gemma 3 270M) the plain text.
    let one = if tok.chat_template().is_some() {
        tok.encode_chat(&[ChatMessage::user(text)], true)?
    } else {
        tok.encode_prompt(text)?
    };
    anyhow::ensure!(!one.is_empty(), "the bench prompt tokenized to nothing");
    Ok(one.iter().copied().cycle().take(len).collect())
}

fn loadavg() -> Vec<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| {
            s.split_whitespace()
                .take(3)
                .filter_map(|x| x.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn cpu_model() -> String {
    tandem_cli_common::host::cpu_name().unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// `YYYY-MM-DDTHH:MM:SSZ` from the system clock.
fn utc_now() -> String {
    utc_from_secs(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    )
}

fn utc_from_secs(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Progress goes to stderr in both modes; stdout carries only the result.
fn progress(msg: &str) {
    eprintln!("bench: {msg}");
}

fn run_parent(args: &Args, res: &Resolved) -> Result<()> {
    anyhow::ensure!(!args.models.is_empty(), "--models is empty");
    anyhow::ensure!(!args.engines.is_empty(), "--engines is empty");
    let loadavg_before = loadavg();
    let date_utc = utc_now();
    let mut engines = args.engines.clone();
    engines.dedup();
    let mut models = args.models.clone();
    models.dedup();
    let llama_ok = engines.contains(&Engine::LlamaCpp) && llama_cpp_installed(&args.python);

    let mut reports = Vec::new();
    let mut all_ok = true;
    for &model in &models {
        let path = model_file(model, args.chosen(model))?;
        let gguf_bytes = std::fs::metadata(&path)
            .with_context(|| format!("reading {}", path.display()))?
            .len();
        let prompt = bench_prompt(&path, args.prompt_tokens)?;
        // Per engine: the figures of each round so far; `Ok(None)` once it
        // is known not to be installed, `Err` once a round failed (either
        // ends its rounds).
        let mut measured: Vec<(Engine, Result<Option<Vec<Measured>>>)> =
            engines.iter().map(|&e| (e, Ok(Some(Vec::new())))).collect();
        for round in 1..=args.rounds {
            for (engine, state) in measured.iter_mut() {
                if !matches!(state, Ok(Some(_))) {
                    continue;
                }
                let of = if args.rounds > 1 {
                    format!(" (round {round}/{})", args.rounds)
                } else {
                    String::new()
                };
                progress(&format!("{} × {}{of} ...", model.name(), engine.name()));
                match measure(args, res, model, *engine, &path, &prompt, llama_ok) {
                    Ok(Some(m)) => {
                        if let Ok(Some(list)) = state {
                            list.push(m);
                        }
                    }
                    Ok(None) => *state = Ok(None),
                    Err(e) => *state = Err(e),
                }
            }
        }
        let mut runs = Vec::new();
        for (engine, state) in &measured {
            let run = match state {
                Ok(Some(list)) => {
                    let m = Measured::median_of(list)
                        .context("an engine finished without a measured round")?;
                    EngineRun {
                        engine: engine.name().into(),
                        status: STATUS_OK.into(),
                        error: None,
                        rss_over_gguf: Some(m.peak_rss_bytes as f64 / gguf_bytes as f64),
                        figures: Some(m),
                    }
                }
                Ok(None) => EngineRun {
                    engine: engine.name().into(),
                    status: STATUS_NOT_INSTALLED.into(),
                    error: None,
                    figures: None,
                    rss_over_gguf: None,
                },
                Err(e) => {
                    // A broken third-party baseline is reported, not fatal.
                    all_ok &= *engine == Engine::LlamaCpp;
                    EngineRun {
                        engine: engine.name().into(),
                        status: STATUS_FAILED.into(),
                        error: Some(format!("{e:#}")),
                        figures: None,
                        rss_over_gguf: None,
                    }
                }
            };
            runs.push(run);
        }
        let mut ratios = BTreeMap::new();
        let rounds_of = |e: Engine| match measured.iter().find(|(x, _)| *x == e) {
            Some((_, Ok(Some(list)))) => Some(list),
            _ => None,
        };
        if let Some(ours) = rounds_of(Engine::Tandem) {
            for &other in engines.iter().filter(|&&e| e != Engine::Tandem) {
                if let Some(theirs) = rounds_of(other) {
                    let pairs: Vec<(&Measured, &Measured)> = ours.iter().zip(theirs).collect();
                    ratios.insert(
                        format!("tandem/{}", other.name()),
                        Ratios::median_of(&pairs),
                    );
                }
            }
        }
        reports.push(ModelReport {
            model: model.name().into(),
            path: path.display().to_string(),
            gguf_bytes,
            engines: runs,
            ratios,
        });
    }

    let (mut speculative, mut speculative_error) = (Vec::new(), None);
    if engines.contains(&Engine::Tandem) && res.spec_prompts > 0 {
        progress(&format!(
            "speculative vs target-only on {} prompts ...",
            res.spec_prompts
        ));
        let mut cmd = self_worker(args, res, "spec")?;
        let proposers: Vec<&str> = args.proposers.iter().map(|p| p.name()).collect();
        let kvs: Vec<&str> = args.draft_kv.iter().map(|p| p.name()).collect();
        cmd.args(["--spec-prompts", &res.spec_prompts.to_string()])
            .args(["--k", &args.k.to_string()])
            .args(["--proposers", &proposers.join(",")])
            .args(["--draft-kv", &kvs.join(",")]);
        if args.quick {
            cmd.arg("--quick");
        }
        cmd.arg("--prompts").arg(args.prompts.join(","));
        match run_child::<Vec<SpecReport>>(cmd, "speculative") {
            Ok(s) => {
                all_ok &= s.iter().all(|r| r.identical);
                speculative = s;
            }
            Err(e) => {
                all_ok = false;
                speculative_error = Some(format!("{e:#}"));
            }
        }
    }

    let report = BenchReport {
        schema_version: report::SCHEMA_VERSION,
        tandem_version: env!("CARGO_PKG_VERSION").into(),
        date_utc,
        machine: Machine {
            cpu: cpu_model(),
            logical_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            loadavg_before,
            loadavg_after: loadavg(),
        },
        settings: Settings {
            threads: res.threads,
            repeats: res.repeats,
            rounds: args.rounds,
            quick: args.quick,
            prompt_tokens: args.prompt_tokens,
            decode_tokens: res.decode_tokens,
            verify_ks: args.verify_ks.clone(),
            spec_prompts: res.spec_prompts,
            spec_k: args.k,
            spec_proposers: args.proposers.clone(),
            spec_draft_kv: args.draft_kv.clone(),
            spec_max_tokens_cap: res.spec_cap,
        },
        models: reports,
        speculative,
        speculative_error,
        ok: all_ok,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    for s in &report.speculative {
        if !s.identical {
            eprintln!(
                "MISMATCH: speculative output ({} proposer, {} draft KV, prompt set {}) differs from target-only output on prompt(s) {}",
                s.proposer,
                s.draft_kv,
                s.prompt_set,
                s.mismatches.join(", ")
            );
            bail!("speculative decoding changed the greedy output (MISMATCH)");
        }
    }
    if !report.ok {
        bail!("some measurements failed (see above)");
    }
    Ok(())
}

// ---------------------------------------------------------------- tables

fn mb(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The absolute times behind c(k): one row per engine, plus Tandem's
/// last-position-only forward (the work candle's forward does).
fn forward_ms_rows(o: &mut String, m: &ModelReport, ks: &[usize]) {
    let mut rows: Vec<(String, &[VerifyPoint])> = Vec::new();
    for e in &m.engines {
        if let Some(f) = e.ok() {
            rows.push((e.engine.clone(), &f.verify));
            if !f.verify_last_only.is_empty() {
                rows.push((format!("{} last-only", e.engine), &f.verify_last_only));
            }
        }
    }
    if rows.is_empty() {
        return;
    }
    let mut head = format!("  {:<16}", "forward ms");
    for k in ks {
        let _ = write!(head, " {:>7}", format!("k={k}"));
    }
    let _ = writeln!(o, "{head}");
    for (name, points) in rows {
        let mut line = format!("  {name:<16}");
        for k in ks {
            let ms = points.iter().find(|v| v.k == *k).map(|v| v.ms);
            let _ = write!(
                line,
                " {:>7}",
                ms.map_or("-".into(), |ms| format!("{ms:.1}"))
            );
        }
        let _ = writeln!(o, "{line}");
    }
    // Time ratios (below 1: Tandem's forward takes less time).
    for (name, q) in &m.ratios {
        let other = name.trim_start_matches("tandem/");
        for (label, krs) in [
            (name.clone(), &q.verify_ms_ratio),
            (format!("last-only/{other}"), &q.verify_last_only_ms_ratio),
        ] {
            if krs.is_empty() {
                continue;
            }
            let mut line = format!("  {label:<16}");
            for k in ks {
                let r = krs.iter().find(|v| v.k == *k).map(|v| v.ratio);
                let _ = write!(line, " {:>7}", r.map_or("-".into(), |r| format!("{r:.2}")));
            }
            let _ = writeln!(o, "{line}");
        }
    }
}

fn render(r: &BenchReport) -> String {
    let mut o = String::new();
    let s = &r.settings;
    let _ = writeln!(
        o,
        "tandem bench {}: {} threads, {} repeats (median, after a warm-up), prompt {} tokens, \
         decode {} tokens, verify at context {}{}",
        r.date_utc,
        s.threads,
        s.repeats,
        s.prompt_tokens,
        s.decode_tokens,
        s.prompt_tokens,
        if s.rounds > 1 {
            format!(
                "; {} interleaved rounds (medians over rounds, ratios: medians of per-round ratios)",
                s.rounds
            )
        } else {
            String::new()
        }
    );
    let _ = writeln!(
        o,
        "cpu: {} ({} logical), load average before {:?} after {:?}",
        r.machine.cpu, r.machine.logical_cpus, r.machine.loadavg_before, r.machine.loadavg_after
    );
    let ks: Vec<usize> = s.verify_ks.iter().copied().filter(|&k| k != 1).collect();
    for m in &r.models {
        let _ = writeln!(
            o,
            "\n{} ({}, {:.0} MB GGUF)",
            m.model,
            m.path,
            mb(m.gguf_bytes)
        );
        let mut head = format!(
            "  {:<10} {:>8} {:>10} {:>9}",
            "engine", "load ms", "prefill/s", "decode/s"
        );
        for k in &ks {
            let _ = write!(head, " {:>6}", format!("c({k})"));
        }
        let _ = write!(head, " {:>9} {:>8}", "peak MB", "RSS/GGUF");
        let _ = writeln!(o, "{head}");
        for e in &m.engines {
            match e.ok() {
                Some(f) => {
                    let mut line = format!(
                        "  {:<10} {:>8.0} {:>10.1} {:>9.1}",
                        e.engine, f.load_ms, f.prefill_tok_s, f.decode_tok_s
                    );
                    for k in &ks {
                        let c = f.verify.iter().find(|v| v.k == *k).map(|v| v.cost_ratio);
                        let _ = write!(line, " {:>6}", c.map_or("-".into(), |c| format!("{c:.2}")));
                    }
                    let _ = write!(
                        line,
                        " {:>9.0} {:>8.2}",
                        mb(f.peak_rss_bytes),
                        e.rss_over_gguf.unwrap_or(f64::NAN)
                    );
                    let _ = writeln!(o, "{line}");
                }
                None => {
                    let why = e
                        .error
                        .as_deref()
                        .map_or(e.status.clone(), |err| format!("{}: {err}", e.status));
                    let _ = writeln!(o, "  {:<10} {why}", e.engine);
                }
            }
        }
        for (name, q) in &m.ratios {
            let mut line = format!(
                "  {:<10} {:>8.2} {:>10.2} {:>9.2}",
                name, q.load_ms, q.prefill_tok_s, q.decode_tok_s
            );
            for k in &ks {
                let c = q
                    .verify_cost_ratio
                    .iter()
                    .find(|v| v.k == *k)
                    .map(|v| v.ratio);
                let _ = write!(line, " {:>6}", c.map_or("-".into(), |c| format!("{c:.2}")));
            }
            let _ = write!(line, " {:>9.2}", q.peak_rss_bytes);
            let _ = writeln!(o, "{line}");
        }
        forward_ms_rows(&mut o, m, &s.verify_ks);
    }
    let _ = writeln!(
        o,
        "\nc(k) = time of one forward over k tokens / over 1 token (Tandem computes logits \
         for all k positions, candle only for the last). Ratio rows: tandem ÷ other \
         (>1 is better for prefill/decode, <1 is better for load, c(k) and memory). \
         \"forward ms\" rows: the median time of those forwards; \"tandem last-only\" is \
         Tandem's forward with the head over the last position only, the same work as \
         candle's forward; below them, tandem's time ÷ the other's (<1: Tandem faster)."
    );
    let mut set_shown: Option<&str> = None;
    for sp in &r.speculative {
        // One table per prompt set: its header and target-only row first.
        if set_shown != Some(sp.prompt_set.as_str()) {
            set_shown = Some(sp.prompt_set.as_str());
            let _ = writeln!(
                o,
                "\nlocal speculative decoding, prompt set {} (greedy, k = {}, {} prompts, {} \
                 threads, {} kernels; proposers draft = the draft model, lookup = prompt \
                 lookup, auto = per round)",
                sp.prompt_set, sp.k, sp.prompts, sp.threads, sp.isa
            );
            let _ = writeln!(
                o,
                "  target only       {:>7.1} tok/s  ({} tokens in {:.1} s)",
                sp.target_only.tok_s, sp.target_only.tokens, sp.target_only.seconds
            );
        }
        let b = &sp.by_proposer;
        let _ = writeln!(
            o,
            "  {:<7} proposer, {:<4} draft KV ({} B/token) {:>7.1} tok/s  ({} tokens in {:.1} s)  \
             {:.2}× target only; acceptance {:.1} %, {:.2} accepted per round; rounds: draft {}, \
             lookup {}, none {}",
            sp.proposer.name(),
            sp.draft_kv.name(),
            sp.draft_kv_bytes_per_token,
            sp.speculative.tok_s,
            sp.speculative.tokens,
            sp.speculative.seconds,
            sp.speedup,
            sp.acceptance_rate * 100.0,
            sp.mean_accepted_len,
            b.draft.rounds,
            b.lookup.rounds,
            b.none_rounds
        );
        if sp.identical {
            let _ = writeln!(
                o,
                "          output identical to target-only on {}/{} prompts",
                sp.prompts, sp.prompts
            );
        } else {
            let _ = writeln!(
                o,
                "  !!! MISMATCH: output differs from target-only on {} of {} prompts: {} !!!",
                sp.mismatches.len(),
                sp.prompts,
                sp.mismatches.join(", ")
            );
        }
    }
    if let Some(e) = &r.speculative_error {
        let _ = writeln!(o, "\nlocal speculative decoding failed: {e}");
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates_are_civil_dates() {
        assert_eq!(utc_from_secs(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_from_secs(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_from_secs(1_798_761_599), "2026-12-31T23:59:59Z");
    }
}
