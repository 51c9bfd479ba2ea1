//! `tandem bench conversation`: one multi-turn conversation through
//! serve-edge (the OpenAI-compatible server, in this process) and a loopback
//! verifier (real target, in this process), run twice side by side: with the
//! conversation caches off (every turn prefills its whole history on the
//! device and on the verifier) and on (the device keeps the draft KV, the
//! verifier keeps the session; docs/edge.md "Conversations"). A chat client
//! sends the whole `messages` array every turn, as chat apps do.
//!
//! Per turn it reports the prompt size, TTFT (the runtime's, from the
//! request's start to its first token: device prefill, verifier open and
//! first verify), the tokens prefilled on the device and on the verifier, and
//! the bytes up and down; then the growth of TTFT from turn 1 to turn 6 and to
//! the last turn. Every turn's reply must be identical with the caches on and
//! off and (unless `--no-target-check`) equal the target's own greedy output
//! for the whole history, computed here target-only.

use super::{cpu_model, loadavg, progress, utc_now};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use tandem_cli_common::models::{resolve_model, tokenizer_of};
use tandem_edge::{assemble, AssemblyConfig, EdgeConfig};
use tandem_edge_http::openai::{self, ServeConfig};
use tandem_fetch::ModelRole;
use tandem_model::proposer::ProposerKind;
use tandem_model::speculative::{generate_single, GenerateConfig};
use tandem_model::tokenizer::ChatMessage;

/// The built-in conversation (10 user turns; code and prose; English and
/// Chinese).
const DEFAULT_SCRIPT: &str = include_str!("../../prompts/conversation.jsonl");
const TOKEN: &str = "tandem-bench-conversation-token-0123456789";
/// Context capacity on both sides.
const MAX_SEQ_LEN: usize = 4096;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The conversation: JSON lines `{"role": "system"|"user", "content": …}`
    /// (system lines first); default: the built-in prompts/conversation.jsonl.
    #[arg(long)]
    script: Option<PathBuf>,
    /// Reply tokens per turn (greedy).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Run only the first N user turns.
    #[arg(long)]
    turns: Option<usize>,
    /// Draft block length.
    #[arg(long, default_value_t = 4)]
    k: usize,
    /// The device's proposer (as `tandem serve-edge --proposer`).
    #[arg(long, default_value = "auto")]
    proposer: ProposerKind,
    /// Skip the target-only greedy check of every turn.
    #[arg(long)]
    no_target_check: bool,
    /// A user's pause between an answer and the next turn, in ms (the caches-on
    /// run; serve-edge's idle catch-up runs the reply through the draft then).
    #[arg(long, default_value_t = 0)]
    think_ms: u64,
    /// Turn serve-edge's idle catch-up off (`[conversations] catch_up = false`).
    #[arg(long)]
    no_catch_up: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// One turn of one run.
#[derive(Debug, Clone, Serialize)]
struct TurnRun {
    prompt_tokens: u64,
    ttft_ms: f64,
    total_ms: f64,
    draft_prefill_tokens: u64,
    /// Reused draft rows the idle catch-up computed before this turn.
    draft_caught_up_tokens: u64,
    verifier_prefill_tokens: u64,
    bytes_up: u64,
    bytes_down: u64,
    continued_session: bool,
    token_ids: Vec<u32>,
    #[serde(skip)]
    text: String,
}

#[derive(Debug, Serialize)]
struct Turn {
    turn: usize,
    off: TurnRun,
    on: TurnRun,
    /// A fresh request of this turn's user message alone (the system lines
    /// and that message: about the tokens the caches-on turn prefills), on
    /// the caches-off server.
    fresh: TurnRun,
    /// TTFT with the caches on over the fresh request's.
    on_over_fresh: f64,
    /// The reply is the same with the caches on and off.
    identical: bool,
    /// The reply equals the target's own greedy output (None: not checked).
    target_greedy: Option<bool>,
}

#[derive(Debug, Serialize)]
struct Report {
    schema: u32,
    utc: String,
    cpu: String,
    loadavg_before: Vec<f64>,
    loadavg_after: Vec<f64>,
    max_tokens: usize,
    proposer: &'static str,
    k: usize,
    think_ms: u64,
    catch_up: bool,
    turns: Vec<Turn>,
    /// TTFT of turn 6 and of the last turn over turn 1's, caches off and on.
    ttft_growth_turn6_off: Option<f64>,
    ttft_growth_turn6_on: Option<f64>,
    ttft_growth_last_off: f64,
    ttft_growth_last_on: f64,
    /// The largest `on_over_fresh` after turn 1 (target ≤ 1.3).
    worst_on_over_fresh: f64,
    all_identical: bool,
}

fn parse_script(text: &str) -> Result<(Vec<ChatMessage>, Vec<String>)> {
    let (mut system, mut users) = (Vec::new(), Vec::new());
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("script line {}", i + 1))?;
        let content = v["content"]
            .as_str()
            .with_context(|| format!("script line {}: no \"content\" string", i + 1))?;
        match v["role"].as_str() {
            Some("system") if users.is_empty() => system.push(ChatMessage::system(content)),
            Some("user") => users.push(content.to_string()),
            other => bail!(
                "script line {}: role {other:?} (expected system lines first, then user)",
                i + 1
            ),
        }
    }
    anyhow::ensure!(!users.is_empty(), "the script has no user turn");
    Ok((system, users))
}

/// POSTs `body` to serve-edge and returns the JSON answer (HTTP/1.1,
/// `Connection: close`, non-streaming: the `tandem` extension has the stats).
fn post(addr: SocketAddr, body: &str) -> Result<serde_json::Value> {
    let mut s = TcpStream::connect(addr).context("connecting to serve-edge")?;
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Connection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, payload) = text
        .split_once("\r\n\r\n")
        .context("serve-edge answered without a body")?;
    anyhow::ensure!(
        head.starts_with("HTTP/1.1 200"),
        "serve-edge answered {}: {payload}",
        head.lines().next().unwrap_or("")
    );
    serde_json::from_str(payload).context("parsing serve-edge's answer")
}

fn turn_run(j: &serde_json::Value, total_ms: f64) -> Result<TurnRun> {
    let st = &j["tandem"]["stats"];
    let u = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    let token_ids = j["tandem"]["token_ids"]
        .as_array()
        .context("no tandem.token_ids")?
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .unwrap_or(u32::MAX)
        })
        .collect();
    Ok(TurnRun {
        prompt_tokens: u(&j["usage"]["prompt_tokens"]),
        ttft_ms: st["ttft_ms"].as_f64().unwrap_or(0.0),
        total_ms,
        draft_prefill_tokens: u(&st["draft_prefill_tokens"]),
        draft_caught_up_tokens: u(&st["draft_caught_up_tokens"]),
        verifier_prefill_tokens: u(&st["verifier_prefill_tokens"]),
        bytes_up: u(&st["bytes_sent"]),
        bytes_down: u(&st["bytes_received"]),
        continued_session: st["continued_session"].as_bool().unwrap_or(false),
        token_ids,
        text: j["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("")
            .to_string(),
    })
}

/// One pass over the conversation with the caches `on` or off; with them
/// off, each turn is followed by a fresh request of its user message alone
/// (the second list).
fn run_once(
    io: &tokio::runtime::Runtime,
    verifier: SocketAddr,
    args: &Args,
    system: &[ChatMessage],
    users: &[String],
    on: bool,
) -> Result<(Vec<TurnRun>, Vec<TurnRun>)> {
    let draft = resolve_model(ModelRole::Draft, None)?;
    let mut cfg = EdgeConfig {
        verifier_url: Some(format!("http://{verifier}")),
        token: Some(TOKEN.into()),
        k: args.k,
        proposer: args.proposer,
        open_timeout_ms: 120_000,
        deadline_max_ms: 60_000,
        ..EdgeConfig::default()
    };
    cfg.conversations.enabled = on;
    cfg.conversations.catch_up = !args.no_catch_up;
    let routed = assemble(AssemblyConfig {
        max_seq_len: MAX_SEQ_LEN,
        edge: cfg,
        ..AssemblyConfig::new(draft)
    })?
    .routed;
    let serve = ServeConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        max_tokens_limit: args.max_tokens,
        routed: false,
        ..ServeConfig::default()
    };
    let server = io.block_on(openai::start(routed, serve))?;
    let mut history: Vec<serde_json::Value> = system
        .iter()
        .map(|m| serde_json::json!({"role": "system", "content": m.content}))
        .collect();
    let (mut out, mut fresh) = (Vec::new(), Vec::new());
    for (i, u) in users.iter().enumerate() {
        if on && i > 0 && args.think_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(args.think_ms));
        }
        history.push(serde_json::json!({"role": "user", "content": u}));
        let body = serde_json::json!({"model": "tandem", "messages": history,
            "max_tokens": args.max_tokens, "temperature": 0})
        .to_string();
        let t = std::time::Instant::now();
        let j = post(server.addr, &body)?;
        let run = turn_run(&j, t.elapsed().as_secs_f64() * 1000.0)?;
        progress(&format!(
            "caches {}: turn {} of {}, {} prompt tokens, TTFT {:.0} ms",
            if on { "on" } else { "off" },
            i + 1,
            users.len(),
            run.prompt_tokens,
            run.ttft_ms
        ));
        history.push(serde_json::json!({"role": "assistant", "content": run.text}));
        out.push(run);
        if !on {
            let alone: Vec<serde_json::Value> = history[..system.len()]
                .iter()
                .cloned()
                .chain([serde_json::json!({"role": "user", "content": u})])
                .collect();
            let body = serde_json::json!({"model": "tandem", "messages": alone,
                "max_tokens": args.max_tokens, "temperature": 0})
            .to_string();
            let t = std::time::Instant::now();
            let j = post(server.addr, &body)?;
            fresh.push(turn_run(&j, t.elapsed().as_secs_f64() * 1000.0)?);
        }
    }
    io.block_on(server.shutdown());
    Ok((out, fresh))
}

pub fn run(args: Args) -> Result<()> {
    let text = match &args.script {
        Some(p) => std::fs::read_to_string(p)
            .with_context(|| format!("reading the script {}", p.display()))?,
        None => DEFAULT_SCRIPT.to_string(),
    };
    let (system, mut users) = parse_script(&text)?;
    if let Some(n) = args.turns {
        users.truncate(n.max(1));
    }
    let loadavg_before = loadavg();
    let target_path = resolve_model(ModelRole::Target, None)?;
    resolve_model(ModelRole::Draft, None)?;
    let io = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let vcfg: tandem_verifier::VerifierConfig = serde_json::from_value(serde_json::json!({
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "model_path": target_path,
        "max_seq_len": MAX_SEQ_LEN,
        "insecure_loopback": true,
        "devices": [{ "id": "bench", "token": TOKEN }],
        "limits": { "max_prompt_tokens": MAX_SEQ_LEN - 64 },
    }))
    .context("building the verifier config")?;
    let verifier = io
        .block_on(tandem_verifier::start(vcfg))
        .context("starting the verifier")?;
    let (off, fresh) = run_once(&io, verifier.grpc_addr, &args, &system, &users, false)?;
    let (on, _) = run_once(&io, verifier.grpc_addr, &args, &system, &users, true)?;

    // The target's own greedy output for each turn's whole history (the
    // history of the caches-on run; identical replies make it the same).
    let model = verifier.state.model.clone();
    let tok = tokenizer_of(&model)?;
    let mut history = system.clone();
    let mut turns = Vec::new();
    for (i, ((off, on), fresh)) in off.into_iter().zip(on).zip(fresh).enumerate() {
        history.push(ChatMessage::user(users[i].clone()));
        let target_greedy = if args.no_target_check {
            None
        } else {
            progress(&format!("target-only check: turn {}", i + 1));
            let ids = tok.encode_chat(&history, true)?;
            let cfg = GenerateConfig {
                max_tokens: args.max_tokens,
                stop_tokens: tok.chat_stop_tokens(),
                ..GenerateConfig::default()
            };
            let g = generate_single(&model, &ids, &cfg, &mut |_| true)?;
            Some(g.tokens == on.token_ids)
        };
        history.push(ChatMessage::assistant(on.text.clone()));
        turns.push(Turn {
            turn: i + 1,
            identical: off.token_ids == on.token_ids,
            target_greedy,
            on_over_fresh: if fresh.ttft_ms > 0.0 {
                on.ttft_ms / fresh.ttft_ms
            } else {
                0.0
            },
            off,
            on,
            fresh,
        });
    }
    io.block_on(verifier.shutdown()).ok();

    let growth = |t: &Turn, on: bool| {
        let first = &turns[0];
        let (a, b) = if on {
            (t.on.ttft_ms, first.on.ttft_ms)
        } else {
            (t.off.ttft_ms, first.off.ttft_ms)
        };
        if b > 0.0 {
            a / b
        } else {
            0.0
        }
    };
    let last = turns.last().context("no turn ran")?;
    let report = Report {
        schema: 3,
        utc: utc_now(),
        cpu: cpu_model(),
        loadavg_before,
        loadavg_after: loadavg(),
        max_tokens: args.max_tokens,
        proposer: args.proposer.name(),
        k: args.k,
        think_ms: args.think_ms,
        catch_up: !args.no_catch_up,
        ttft_growth_turn6_off: turns.get(5).map(|t| growth(t, false)),
        ttft_growth_turn6_on: turns.get(5).map(|t| growth(t, true)),
        ttft_growth_last_off: growth(last, false),
        ttft_growth_last_on: growth(last, true),
        worst_on_over_fresh: turns
            .iter()
            .skip(1)
            .map(|t| t.on_over_fresh)
            .fold(0.0, f64::max),
        all_identical: turns
            .iter()
            .all(|t| t.identical && t.target_greedy != Some(false)),
        turns,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", table(&report));
    }
    anyhow::ensure!(
        report.all_identical,
        "a turn's reply differs between the caches on and off or from the target's greedy output"
    );
    Ok(())
}

fn table(r: &Report) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "conversation through serve-edge + loopback verifier, greedy, {} proposer, k = {}, {} reply tokens per turn\n\
         idle catch-up {}, {} ms between turns (caches on)\n\
         cpu: {}; load average before {:?}, after {:?}\n",
        r.proposer, r.k, r.max_tokens, if r.catch_up { "on" } else { "off" }, r.think_ms,
        r.cpu, r.loadavg_before, r.loadavg_after
    );
    let _ = writeln!(
        s,
        "turn  prompt  TTFT ms off/on      fresh: prompt  TTFT  on/fresh  device prefill off/on (caught up)  verifier prefill off/on  bytes up off/on     bytes down off/on  same  target"
    );
    for t in &r.turns {
        let _ = writeln!(
            s,
            "{:>4}  {:>6}  {:>8.0} / {:<8.0}  {:>13} {:>5.0}  {:>7.2}x  {:>8} / {:<8} ({:>4})      {:>8} / {:<8}        {:>8} / {:<8}  {:>7} / {:<7}  {:>4}  {}",
            t.turn,
            t.on.prompt_tokens,
            t.off.ttft_ms,
            t.on.ttft_ms,
            t.fresh.prompt_tokens,
            t.fresh.ttft_ms,
            t.on_over_fresh,
            t.off.draft_prefill_tokens,
            t.on.draft_prefill_tokens,
            t.on.draft_caught_up_tokens,
            t.off.verifier_prefill_tokens,
            t.on.verifier_prefill_tokens,
            t.off.bytes_up,
            t.on.bytes_up,
            t.off.bytes_down,
            t.on.bytes_down,
            if t.identical { "yes" } else { "NO" },
            match t.target_greedy {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "-",
            }
        );
    }
    let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}x"));
    let mut growth = format!(
        "TTFT growth over turn 1: turn 6 off {} on {}",
        f(r.ttft_growth_turn6_off),
        f(r.ttft_growth_turn6_on)
    );
    if r.turns.len() != 6 {
        let _ = write!(
            growth,
            "; turn {} off {:.2}x on {:.2}x",
            r.turns.len(),
            r.ttft_growth_last_off,
            r.ttft_growth_last_on
        );
    }
    let _ = writeln!(s, "\n{growth}");
    let _ = writeln!(
        s,
        "TTFT with the caches on over a fresh request of the turn's message alone: at most {:.2}x after turn 1",
        r.worst_on_over_fresh
    );
    s
}
