//! `tandem demo`: the README's first command, the product in one run.
//!
//! Fetches the models on first use (progress bar), then, all in this process
//! and on loopback:
//!
//! * starts the cloud verifier (`tandem_verifier::start`, real 1.5B target)
//!   with TLS from a freshly generated self-signed certificate (rcgen) and a
//!   random device token;
//! * puts a `tandem-netsim` proxy (profile `--profile`, default `lan`)
//!   between the device and the verifier, so an outage can be injected;
//! * starts the edge runtime (draft 0.5B, TLS to the verifier through the
//!   proxy) behind the privacy router (built-in policy);
//!
//! and runs four requests:
//!
//! 1. a speculative generation (greedy, the draft model proposes) with
//!    acceptance statistics, checked token for token against the target
//!    model's own greedy output, with both speeds and their ratio;
//! 2. the same for an edit of code the prompt carries, with the `auto`
//!    proposer (prompt lookup or the draft model per round);
//! 3. a prompt with a synthetic ID number: the router keeps it on the device
//!    and says why (rule, entity type, span); the proxy shows no byte sent;
//! 4. an outage in the middle of a generation: after a few verified tokens
//!    the proxy's timeline goes `offline` (blackhole); the edge falls back to
//!    provisional tokens; after a few of those the link is back, the verifier
//!    checks the provisional tokens and generation continues verified (this
//!    part ends 8 verified tokens after the link is back, whatever
//!    `--max-tokens` says: a re-open on a busy machine can take longer than
//!    the draft needs for the rest of a short budget).
//!
//! Ends with a short summary. Exit code 1 when a part did not show what it
//! should (e.g. the speculative output differs from the target's).

use anyhow::{Context, Result};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tandem_cli_common::inspect::ModelInfo;
use tandem_cli_common::models::{prompt_tokens, resolve_pair, ResolvedPair};
use tandem_edge::{assemble, AssemblyConfig, EdgeConfig, EdgeEvent, RoutedRuntime, TokenStatus};
use tandem_model::proposer::ProposerKind;
use tandem_model::speculative::{generate_single, GenerateConfig};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_netsim::{NetConfig, Proxy, ProxyHandle, Timeline};
use tandem_router::Action;

/// The editing case: code to change, carried by the prompt (the answer is
/// mostly a copy of it, which prompt lookup proposes for free).
const EDIT_PROMPT: &str = "Rename the variable `total` to `sum_of_squares` in this Python function and give back the whole function:

def compute(values):
    total = 0
    for v in values:
        total += v * v
    return total";
const DEMO_PROMPT: &str =
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.";
/// A synthetic (checksum-valid, not a real person's) resident ID number.
const PRIVATE_PROMPT: &str =
    "My ID card number is 11010519491231002X. Write a short note asking my manager for a day off.";
const OUTAGE_PROMPT: &str =
    "Write a Rust function that counts the words in a string, with a doc comment and a unit test.";
/// Verified tokens before the outage starts.
const OUTAGE_AFTER_VERIFIED: usize = 8;
/// Provisional tokens before the link comes back.
const OUTAGE_PROVISIONAL: usize = 8;
/// The outage part ends this many verified tokens after the link is back (its
/// token budget is raised so that a slow re-open, e.g. a verifier prefilling on
/// a busy machine while a fast draft keeps going, cannot use it all up first).
const OUTAGE_RECOVERED: usize = 8;
/// Token budget of the outage part (it normally stops much earlier).
const OUTAGE_MAX_TOKENS: usize = 256;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The prompt of the speculative request (1) instead of the embedded one.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Draft block length.
    #[arg(long, default_value_t = 4)]
    pub k: usize,
    /// Tokens per request (at least 24: the outage needs room).
    #[arg(long, default_value_t = 48)]
    pub max_tokens: usize,
    /// Network profile between device and verifier (`tandem netsim --list`).
    #[arg(long, default_value = "lan")]
    pub profile: String,
    /// The device's draft model: a GGUF path, a built-in name, or the name
    /// of one of yours in the models directory (`tandem models list`)
    /// [default: the built-in draft, Qwen2.5-Coder-0.5B].
    #[arg(long = "draft-model", visible_alias = "draft")]
    pub draft_model: Option<PathBuf>,
    /// The verifier's target model, as `--draft-model` [default: the built-in
    /// target, Qwen2.5-Coder-1.5B]. It must pair with the draft (`tandem
    /// models check-pair`).
    #[arg(long = "target-model", visible_alias = "target")]
    pub target_model: Option<PathBuf>,
    /// Runs of each side behind a speculative case's speeds (the median is
    /// shown: one run's time on a shared 2-core machine moves by ±10 %);
    /// 1 for a quicker demo.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=9))]
    pub speed_runs: u32,
}

/// What the summary reports per part.
#[derive(Default)]
struct Summary {
    spec: Option<String>,
    edit: Option<String>,
    private: Option<String>,
    outage: Option<String>,
    problems: Vec<String>,
}

pub fn run(args: Args) -> Result<()> {
    anyhow::ensure!(
        (1..=16).contains(&args.k),
        "--k must be in 1..=16, got {}",
        args.k
    );
    anyhow::ensure!(
        (24..=512).contains(&args.max_tokens),
        "--max-tokens must be in 24..=512 (the outage part needs room), got {}",
        args.max_tokens
    );
    let net = NetConfig::profile(&args.profile)?;

    // Models first (fetched with a progress bar on first use), and whether
    // they pair, before anything starts.
    let ResolvedPair {
        draft: draft_path,
        draft_info,
        target: target_path,
        target_info,
    } = resolve_pair(args.draft_model.as_ref(), args.target_model.as_ref())?;
    println!(
        "tandem demo: a draft model on this device ({}) proposes tokens,",
        model_label(&draft_info)
    );
    println!(
        "a verifier in the cloud ({}) checks them; here both run on loopback.\n",
        model_label(&target_info)
    );
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let (cert, key) = self_signed_cert(dir.path())?;
    let token = device_token();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("tandem-demo-net")
        .enable_all()
        .build()
        .context("starting the async runtime")?;

    let t = Instant::now();
    let vcfg: tandem_verifier::VerifierConfig = serde_json::from_value(serde_json::json!({
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "model_path": target_path,
        "max_seq_len": 2048,
        "tls": { "cert_pem": cert, "key_pem": key },
        "devices": [{ "id": "demo-device", "token": token }],
        "limits": { "max_prompt_tokens": 1536 },
    }))
    .context("building the verifier config")?;
    let verifier = rt
        .block_on(tandem_verifier::start(vcfg))
        .context("starting the verifier")?;
    let proxy = rt
        .block_on(Proxy::start(
            "127.0.0.1:0".parse()?,
            verifier.grpc_addr,
            net.clone(),
        ))
        .context("starting the netsim proxy")?;
    println!(
        "verifier  https://{} (TLS, self-signed certificate for \"localhost\" made just now; target loaded in {:.1} s)",
        verifier.grpc_addr,
        t.elapsed().as_secs_f64()
    );
    println!(
        "network   netsim proxy {} -> verifier, profile {}",
        proxy.local_addr(),
        args.profile
    );
    let edge_cfg = EdgeConfig {
        verifier_url: Some(format!("https://127.0.0.1:{}", proxy.local_addr().port())),
        ca_cert_pem: Some(cert.clone()),
        tls_domain: Some("localhost".into()),
        token: Some(token.clone()),
        k: args.k,
        // Give up on a silent verifier within seconds; probe often to come back.
        breaker_failures: 1,
        connect_timeout_ms: 1_000,
        open_timeout_ms: 20_000,
        deadline_floor_ms: 1_000,
        // ... but not so fast that a loaded machine's slow verify looks like one.
        deadline_max_ms: 6_000,
        backoff_base_ms: 20,
        probe_interval_ms: 100,
        probe_timeout_ms: 500,
        ..EdgeConfig::default()
    };
    let device = assemble(AssemblyConfig {
        edge: edge_cfg,
        ..AssemblyConfig::new(draft_path)
    })?;
    let (mut edge, tok) = (device.routed, device.tokenizer);
    println!(
        "device    draft loaded in {:.1} s, privacy router with the built-in policy, k={}\n",
        device.draft_load_ms / 1000.0,
        args.k
    );

    let gen = GenerateConfig {
        k: args.k,
        max_tokens: args.max_tokens,
        stop_tokens: device.stop_tokens,
        ..GenerateConfig::default()
    };
    let mut summary = Summary::default();
    let prompt = args.prompt.as_deref().unwrap_or(DEMO_PROMPT);
    let generation = Case {
        heading: format!("[1/4] speculative generation (greedy): the draft proposes blocks of k={}, the verifier checks each block in one target pass", gen.k),
        name: "generation",
        session: "demo-1",
        prompt,
        proposer: ProposerKind::Draft,
    };
    let editing = Case {
        heading: format!("[2/4] editing code the prompt carries: proposer auto picks prompt lookup (the continuation is a copy of prompt text, no draft forward) or the draft model per round, k up to {}", gen.k),
        name: "editing",
        session: "demo-edit",
        prompt: EDIT_PROMPT,
        proposer: ProposerKind::Auto,
    };
    let runs = args.speed_runs;
    let res = speculative_case(
        &mut edge,
        &tok,
        &verifier,
        &generation,
        &gen,
        runs,
        &mut summary,
    )
    .and_then(|line| {
        summary.spec = Some(line);
        speculative_case(
            &mut edge,
            &tok,
            &verifier,
            &editing,
            &gen,
            runs,
            &mut summary,
        )
    })
    .and_then(|line| {
        summary.edit = Some(line);
        private_part(&mut edge, &tok, &proxy, &gen, &mut summary)
    })
    .and_then(|()| outage_part(&mut edge, &tok, &proxy, &args.profile, &gen, &mut summary));
    drop(edge);
    rt.block_on(proxy.shutdown());
    let _ = rt.block_on(verifier.shutdown());
    res?;

    println!("== summary ==");
    for (n, s) in [
        &summary.spec,
        &summary.edit,
        &summary.private,
        &summary.outage,
    ]
    .into_iter()
    .enumerate()
    {
        if let Some(s) = s {
            println!("{}. {s}", n + 1);
        }
    }
    if !summary.problems.is_empty() {
        for p in &summary.problems {
            eprintln!("problem: {p}");
        }
        anyhow::bail!("the demo did not show everything it should (see above)");
    }
    Ok(())
}

/// A self-signed certificate for `localhost` (PEM files in `dir`).
fn self_signed_cert(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])
        .context("generating a self-signed certificate")?;
    let cert = dir.join("verifier-cert.pem");
    let key = dir.join("verifier-key.pem");
    std::fs::write(&cert, ck.cert.pem())?;
    std::fs::write(&key, ck.signing_key.serialize_pem())?;
    Ok((cert, key))
}

/// A per-run bearer token (loopback only; not a secret worth more).
fn device_token() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("demo-{:x}-{:x}", nanos, std::process::id())
}

/// Streams decoded text to stdout, provisional pieces dimmed on a terminal.
struct Printer {
    dec: tandem_model::tokenizer::StreamDecoder,
    tty: bool,
    dimmed: bool,
}

impl Printer {
    fn new(tok: &Tokenizer) -> Self {
        print!("   | ");
        Self {
            dec: tok.stream_decoder(true),
            tty: std::io::stdout().is_terminal(),
            dimmed: false,
        }
    }

    fn push(&mut self, id: u32, status: TokenStatus) {
        let Some(piece) = self.dec.push(id) else {
            return;
        };
        let dim = self.tty && status == TokenStatus::Provisional;
        let mut s = String::new();
        if dim != self.dimmed {
            s.push_str(if dim { "\x1b[2m" } else { "\x1b[0m" });
            self.dimmed = dim;
        }
        s.push_str(&piece.replace('\n', "\n   | "));
        let mut out = std::io::stdout();
        let _ = out.write_all(s.as_bytes());
        let _ = out.flush();
    }

    /// A note in the text stream (dimmed on a terminal), e.g. the link going down.
    fn note(&mut self, text: &str) {
        let s = if self.tty {
            format!("\x1b[2m[{text}]\x1b[0m")
        } else {
            format!("[{text}]")
        };
        self.dimmed = false;
        let mut out = std::io::stdout();
        let _ = out.write_all(s.as_bytes());
        let _ = out.flush();
    }

    fn finish(mut self) {
        let mut s = self
            .dec
            .flush()
            .unwrap_or_default()
            .replace('\n', "\n   | ");
        if self.dimmed {
            s.push_str("\x1b[0m");
        }
        println!("{s}");
    }
}

fn pct(x: f64) -> String {
    format!("{:.0}%", x * 100.0)
}

/// One speculative case of the demo: generating new code, or editing code the
/// prompt carries.
struct Case<'a> {
    /// "[1/4] ..." and the summary's name for it.
    heading: String,
    name: &'static str,
    session: &'static str,
    prompt: &'a str,
    proposer: ProposerKind,
}

/// A speculative case, checked token for token against the target alone on
/// the same prompt, with both speeds (wall time of the whole call, prefill
/// included, in this process; medians of `speed_runs` runs each,
/// alternating: `Args::speed_runs`) and their ratio. Returns the summary line.
fn speculative_case(
    edge: &mut RoutedRuntime,
    tok: &Tokenizer,
    verifier: &tandem_verifier::RunningVerifier,
    case: &Case<'_>,
    gen: &GenerateConfig,
    speed_runs: u32,
    summary: &mut Summary,
) -> Result<String> {
    println!("{}", case.heading);
    let shown: String = case.prompt.lines().next().unwrap_or_default().into();
    let more = if case.prompt.lines().count() > 1 {
        format!(" (+ {} lines of code)", case.prompt.lines().count() - 1)
    } else {
        String::new()
    };
    println!("   prompt: {shown}{more}");
    let gen = GenerateConfig {
        proposer: case.proposer,
        ..gen.clone()
    };
    let messages = [ChatMessage::user(case.prompt)];
    let mut p = Printer::new(tok);
    let t = Instant::now();
    let g = edge.chat(case.session, &messages, &gen, &mut |ev| {
        if let EdgeEvent::Token { id, status, .. } = ev {
            p.push(*id, *status);
        }
        true
    })?;
    let spec_s = t.elapsed().as_secs_f64();
    p.finish();
    let s = &g.generation.stats;
    println!("   router: {} (nothing sensitive found)", g.route.decision);
    println!(
        "   {} tokens: {} verified, {} provisional; {} rounds, acceptance {} ({} of {} drafted), mean accepted {:.2}/round",
        s.generated_tokens,
        s.verified_tokens,
        s.provisional_tokens,
        s.rounds,
        pct(s.acceptance_rate),
        s.accepted,
        s.drafted,
        s.mean_accepted_len
    );
    let by = &s.proposers;
    println!(
        "   proposer {}: {} rounds drafted by the draft model, {} by prompt lookup, {} without a proposal",
        case.proposer, by.draft.rounds, by.lookup.rounds, by.none_rounds
    );
    println!(
        "   target passes {} ({:.2} per token, vs 1 per token for the target alone); RTT mean {:.0} ms",
        s.verifier_passes, s.verifier_passes_per_token, s.rtt_mean_ms
    );
    // The invariant, checked: the target alone, greedy, on the same prompt.
    let ids = prompt_tokens(tok, case.prompt, None, false)?;
    print!("   checking: the target model alone on the same prompt ...\r");
    let _ = std::io::stdout().flush();
    let t = Instant::now();
    let reference = generate_single(&verifier.state.model, &ids, &gen, &mut |_| true)?;
    let target_s = t.elapsed().as_secs_f64();
    let out = &g.generation.tokens;
    let same = &reference.tokens == out;
    println!(
        "   identical to the target model's own greedy output: {} ({} tokens compared)",
        if same { "yes" } else { "NO" },
        reference.tokens.len().max(out.len()),
    );
    // More runs of each, alternating (a fresh session each, so no run
    // reuses another's cache): the speeds are the medians.
    let (mut spec_times, mut target_times) = (vec![spec_s], vec![target_s]);
    for run in 1..speed_runs {
        let t = Instant::now();
        edge.chat(
            &format!("{}-run{run}", case.session),
            &messages,
            &gen,
            &mut |_| true,
        )?;
        spec_times.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        generate_single(&verifier.state.model, &ids, &gen, &mut |_| true)?;
        target_times.push(t.elapsed().as_secs_f64());
    }
    let median = |v: &[f64]| tandem_stats::median(v).unwrap_or(0.0);
    let per_s = |n: usize, secs: f64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
    let spec_tps = per_s(out.len(), median(&spec_times));
    let target_tps = per_s(reference.tokens.len(), median(&target_times));
    let ratio = if target_tps > 0.0 {
        spec_tps / target_tps
    } else {
        0.0
    };
    let runs = if speed_runs == 1 {
        "one run each".to_string()
    } else {
        format!("median of {speed_runs} runs each")
    };
    println!(
        "   speed: {spec_tps:.2} tok/s speculative vs {target_tps:.2} tok/s for the target alone: {ratio:.2}x (wall time of each whole call, prefill included, same prompt and machine; {runs})\n"
    );
    if !same && s.provisional_tokens == 0 {
        summary.problems.push(format!(
            "{}: speculative output differs from the target's greedy output",
            case.name
        ));
    }
    Ok(format!(
        "{}: {} tokens, {} verified, acceptance {}, {:.2} target passes/token, {ratio:.2}x the target alone; = target's own greedy output: {}",
        case.name,
        s.generated_tokens,
        s.verified_tokens,
        pct(s.acceptance_rate),
        s.verifier_passes_per_token,
        if same { "yes" } else { "no" }
    ))
}

/// The prompt with every entity span the router found replaced by its type.
fn masked(prompt: &str, d: &tandem_router::Decision) -> String {
    let mut out = String::new();
    let mut at = 0;
    for e in &d.entities {
        if e.start < at || e.end > prompt.len() {
            continue;
        }
        if let (Some(before), true) = (prompt.get(at..e.start), prompt.is_char_boundary(e.end)) {
            out.push_str(before);
            out.push_str(&format!("[{}]", e.kind.as_str()));
            at = e.end;
        }
    }
    out.push_str(prompt.get(at..).unwrap_or_default());
    out
}

fn private_part(
    edge: &mut RoutedRuntime,
    tok: &Tokenizer,
    proxy: &ProxyHandle,
    gen: &GenerateConfig,
    summary: &mut Summary,
) -> Result<()> {
    println!("[3/4] a prompt with a (synthetic) ID number: the privacy router decides before anything is sent");
    let messages = [ChatMessage::user(PRIVATE_PROMPT)];
    let before = proxy.stats();
    let mut p = Printer::new(tok);
    let g = edge.chat("demo-2", &messages, gen, &mut |ev| {
        if let EdgeEvent::Token { id, status, .. } = ev {
            p.push(*id, *status);
        }
        true
    })?;
    p.finish();
    let after = proxy.stats();
    let d = &g.route.decision;
    println!(
        "   prompt (as the router saw it): {}",
        masked(PRIVATE_PROMPT, d)
    );
    let entities: Vec<String> = d
        .entities
        .iter()
        .map(|e| {
            format!(
                "{} at bytes {}..{} (score {:.2})",
                e.kind.as_str(),
                e.start,
                e.end,
                e.score
            )
        })
        .collect();
    let why = if entities.is_empty() {
        "no entity".to_string()
    } else {
        entities.join(", ")
    };
    println!("   decision: {} by rule \"{}\": {why}", d.action, d.rule);
    let sent = (after.bytes_up - before.bytes_up) + (after.connections - before.connections);
    let s = &g.generation.stats;
    println!(
        "   answered by the draft alone: {} tokens, all local ({} local); bytes sent to the verifier: {}, new connections: {}\n",
        s.generated_tokens,
        s.local_tokens,
        after.bytes_up - before.bytes_up,
        after.connections - before.connections
    );
    if d.action != Action::Local || s.local_tokens != s.generated_tokens || sent != 0 {
        summary
            .problems
            .push("the ID-number prompt was not kept on the device".into());
    }
    let kinds: Vec<&str> = d.entities.iter().map(|e| e.kind.as_str()).collect();
    summary.private = Some(format!(
        "privacy: kept on the device by rule \"{}\" ({}), {} local tokens, 0 bytes sent: {}",
        d.rule,
        if kinds.is_empty() {
            "-".to_string()
        } else {
            kinds.join(", ")
        },
        s.local_tokens,
        if sent == 0 { "yes" } else { "NO" }
    ));
    Ok(())
}

fn outage_part(
    edge: &mut RoutedRuntime,
    tok: &Tokenizer,
    proxy: &ProxyHandle,
    profile: &str,
    gen: &GenerateConfig,
    summary: &mut Summary,
) -> Result<()> {
    println!(
        "[4/4] an outage in the middle of a generation: after {OUTAGE_AFTER_VERIFIED} verified tokens the netsim timeline goes offline (blackhole), back after {OUTAGE_PROVISIONAL} provisional tokens"
    );
    println!("   prompt: {OUTAGE_PROMPT}");
    // Blackhole (connections accepted, nothing forwarded) until cut short.
    let offline = Timeline::parse(&format!("offline 600s, {profile}"))?;
    let back = Timeline::parse(profile)?;
    let messages = [ChatMessage::user(OUTAGE_PROMPT)];
    let mut p = Printer::new(tok);
    let (mut verified, mut provisional) = (0usize, 0usize);
    let mut down_at: Option<Instant> = None;
    let mut detected: Option<Duration> = None;
    let mut up_at: Option<Instant> = None;
    let mut recovered: Option<Duration> = None;
    let mut verified_since_up = 0usize;
    let gen = GenerateConfig {
        max_tokens: gen.max_tokens.max(OUTAGE_MAX_TOKENS),
        ..gen.clone()
    };
    let g = edge.chat("demo-3", &messages, &gen, &mut |ev| {
        match ev {
            EdgeEvent::Token { id, status, .. } => {
                p.push(*id, *status);
                match status {
                    TokenStatus::Verified => {
                        verified += 1;
                        if up_at.is_some() && recovered.is_none() {
                            recovered = up_at.map(|t| t.elapsed());
                        }
                        if up_at.is_some() {
                            verified_since_up += 1;
                            if verified_since_up >= OUTAGE_RECOVERED {
                                return false;
                            }
                        }
                        if verified == OUTAGE_AFTER_VERIFIED && down_at.is_none() {
                            proxy.set_timeline(offline.clone());
                            down_at = Some(Instant::now());
                            p.note("link down");
                        }
                    }
                    TokenStatus::Provisional => {
                        provisional += 1;
                        if detected.is_none() {
                            detected = down_at.map(|t| t.elapsed());
                        }
                        if provisional == OUTAGE_PROVISIONAL && up_at.is_none() {
                            proxy.set_timeline(back.clone());
                            up_at = Some(Instant::now());
                            p.note("link up");
                        }
                    }
                    TokenStatus::Local => {}
                }
            }
            EdgeEvent::ProvisionalChecked(c) => p.note(&format!(
                "verifier back: provisional tokens {}..{} checked, {} differ",
                c.start,
                c.end,
                c.mismatches.len()
            )),
        }
        true
    })?;
    p.finish();
    // Whatever happened, leave the link up.
    proxy.set_timeline(back);
    let s = &g.generation.stats;
    let r = &g.generation.provisional;
    let statuses = &g.generation.statuses;
    let last_prov = statuses
        .iter()
        .rposition(|s| *s == TokenStatus::Provisional);
    let verified_after = last_prov.map_or(0, |i| {
        statuses[i + 1..]
            .iter()
            .filter(|s| **s == TokenStatus::Verified)
            .count()
    });
    let ms =
        |d: Option<Duration>| d.map_or("-".to_string(), |d| format!("{:.1} s", d.as_secs_f64()));
    println!(
        "   tokens: {} verified, {} provisional (during the outage), then {} verified again",
        s.verified_tokens, s.provisional_tokens, verified_after
    );
    println!(
        "   outage noticed after {} (verify deadline), link back -> verified again after {}; breaker opened {}x, sessions opened {}",
        ms(detected),
        ms(recovered),
        s.breaker_opens,
        s.opens
    );
    let check = if r.provisional_tokens == 0 {
        "no provisional token".to_string()
    } else if r.mismatched_tokens == 0 && r.checked_tokens == r.provisional_tokens {
        format!(
            "all {} provisional tokens checked by the verifier: each is what the target would have chosen",
            r.checked_tokens
        )
    } else {
        format!(
            "{} of {} provisional tokens checked, {} differ from the target's choice{}",
            r.checked_tokens,
            r.provisional_tokens,
            r.mismatched_tokens,
            r.first_mismatch
                .map(|i| format!(" (first at token {i})"))
                .unwrap_or_default()
        )
    };
    println!("   provisional check: {check}\n");
    if down_at.is_none() {
        summary.problems.push(format!(
            "the generation ended before {OUTAGE_AFTER_VERIFIED} verified tokens; no outage was injected"
        ));
    } else if r.provisional_tokens == 0 {
        summary
            .problems
            .push("no provisional token during the outage".into());
    } else if verified_after == 0 {
        summary
            .problems
            .push("the generation did not return to verified tokens after the outage".into());
    }
    summary.outage = Some(format!(
        "outage: {} provisional tokens while offline, {} checked, {} differ; recovered: {} verified tokens after it",
        r.provisional_tokens, r.checked_tokens, r.mismatched_tokens, verified_after
    ));
    Ok(())
}

/// How the demo names a model: the GGUF's `general.name` (e.g.
/// "Qwen2.5 Coder 0.5B Instruct"), else its file name, with the architecture.
fn model_label(info: &ModelInfo) -> String {
    let name = info.name.clone().unwrap_or_else(|| {
        info.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    });
    format!("{name}, {}", info.architecture)
}
