//! `tandem route`: the privacy router for operators.
//!
//! * `classify` reads JSON lines `{"id": ..., "text": "..."}` on stdin and
//!   writes one JSON line per input: `{"id", "decision", "rule", "entities":
//!   [{"type", "start", "end", "score"}], "categories"}`; `start`/`end` are
//!   UTF-8 byte offsets into `text`. An optional `"conversation"` field groups
//!   lines into conversations (oldest first), so stickiness applies.
//! * `explain` shows one decision for a human, with the spans highlighted in
//!   the text (colour on a terminal, `[[TYPE: ...]]` brackets otherwise).
//! * `check` validates a policy file and exits non-zero with the error.
//!
//! The work is done by `tandem-router`; this module parses arguments and
//! formats results. Output never goes to logs: `tracing` here records counts
//! only, never text.

use std::collections::HashMap;
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{bail, Context};
use serde::Serialize;
use serde_json::Value;
use tandem_router::{Conversation, Decision, EntityHit, Policy, RouteContext};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: RouteCommand,
}

#[derive(clap::Subcommand)]
enum RouteCommand {
    /// Classify JSON lines {"id","text"} from stdin; one JSON decision per line on stdout.
    Classify(ClassifyArgs),
    /// Explain the decision for one text (argument, or stdin when absent or "-").
    Explain(ExplainArgs),
    /// Validate a policy file; exits non-zero and names line and field on error.
    Check(CheckArgs),
}

/// Live state to decide under (defaults: idle network, no device limits).
#[derive(clap::Args, Clone)]
struct ContextArgs {
    /// Round-trip time estimate to the verifier, in milliseconds.
    #[arg(long)]
    rtt_ms: Option<f64>,
    /// Pretend the verifier circuit breaker is open.
    #[arg(long)]
    breaker_open: bool,
    /// Battery charge in percent.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=100))]
    battery: Option<u8>,
    /// Thermal throttling level (0 = nominal, 1 = fair, 2 = serious, 3 = critical).
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    thermal: Option<u8>,
    /// The device is charging.
    #[arg(long)]
    charging: bool,
    /// The OS's power-save mode is on.
    #[arg(long)]
    power_save: bool,
    /// The user opted out of sending anything off the device.
    #[arg(long)]
    opt_out: bool,
}

impl ContextArgs {
    fn to_context(&self) -> RouteContext {
        RouteContext {
            rtt_ms: self.rtt_ms,
            breaker_open: self.breaker_open,
            battery_pct: self.battery,
            thermal_level: self.thermal,
            charging: self.charging,
            power_save: self.power_save,
            user_opt_out: self.opt_out,
        }
    }
}

#[derive(clap::Args)]
struct ClassifyArgs {
    /// Policy file [default: the built-in policy: everything sensitive stays local].
    #[arg(long)]
    policy: Option<PathBuf>,
    #[command(flatten)]
    context: ContextArgs,
}

#[derive(clap::Args)]
struct ExplainArgs {
    /// Policy file [default: the built-in policy].
    #[arg(long)]
    policy: Option<PathBuf>,
    /// Print the same JSON object `classify` prints instead of the report.
    #[arg(long)]
    json: bool,
    /// Colour the highlighted spans.
    #[arg(long, value_enum, default_value_t = ColorChoice::Auto)]
    color: ColorChoice,
    #[command(flatten)]
    context: ContextArgs,
    /// The text to explain; read from stdin when absent or "-".
    text: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ColorChoice {
    /// Colour when stdout is a terminal and NO_COLOR is unset.
    Auto,
    Always,
    Never,
}

#[derive(clap::Args)]
struct CheckArgs {
    /// The policy file to validate.
    policy: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        RouteCommand::Classify(a) => classify(a),
        RouteCommand::Explain(a) => explain(a),
        RouteCommand::Check(a) => check(a),
    }
}

fn load_policy(path: &Option<PathBuf>) -> anyhow::Result<Policy> {
    match path {
        Some(p) => Ok(Policy::from_file(p)?),
        None => Ok(Policy::builtin_default()),
    }
}

/// One output line of `classify` (and `explain --json`).
#[derive(Serialize)]
struct Output<'a> {
    id: &'a Value,
    decision: &'static str,
    rule: &'a str,
    entities: &'a [EntityHit],
    categories: &'a [String],
}

fn output<'a>(id: &'a Value, d: &'a Decision) -> Output<'a> {
    Output {
        id,
        decision: d.action.as_str(),
        rule: &d.rule,
        entities: &d.entities,
        categories: &d.categories,
    }
}

fn classify(args: ClassifyArgs) -> anyhow::Result<()> {
    let policy = load_policy(&args.policy)?;
    let ctx = args.context.to_context();
    let mut conversations: HashMap<String, Conversation> = HashMap::new();
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let (mut ok, mut bad) = (0u64, 0u64);
    for (n, line) in stdin.lock().lines().enumerate() {
        let line = line.context("reading stdin")?;
        if line.trim().is_empty() {
            continue;
        }
        let input: Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("line {}: not JSON: {e}", n + 1);
                bad += 1;
                continue;
            }
        };
        let Some(text) = input.get("text").and_then(Value::as_str) else {
            eprintln!("line {}: missing string field \"text\"", n + 1);
            bad += 1;
            continue;
        };
        let id = input.get("id").unwrap_or(&Value::Null);
        let decision = match input.get("conversation") {
            Some(Value::Null) | None => policy.decide(text, &ctx),
            Some(c) => {
                let key = match c {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                conversations
                    .entry(key)
                    .or_default()
                    .decide_with(&policy, text, &ctx)
            }
        };
        serde_json::to_writer(&mut out, &output(id, &decision))?;
        out.write_all(b"\n")?;
        out.flush()?;
        ok += 1;
    }
    tracing::debug!(ok, bad, "route classify finished");
    if bad > 0 {
        bail!("{bad} input line(s) could not be classified (see above); {ok} classified");
    }
    Ok(())
}

/// A span to mark in the explained text.
struct Mark {
    start: usize,
    end: usize,
    label: String,
    entity: bool,
}

fn explain(args: ExplainArgs) -> anyhow::Result<()> {
    let policy = load_policy(&args.policy)?;
    let text = match args.text.as_deref() {
        None | Some("-") => {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
                .context("reading stdin")?;
            s
        }
        Some(t) => t.to_string(),
    };
    let ctx = args.context.to_context();
    let decision = policy.decide(&text, &ctx);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if args.json {
        serde_json::to_writer(&mut out, &output(&Value::Null, &decision))?;
        out.write_all(b"\n")?;
        return Ok(());
    }
    let color = match args.color {
        ColorChoice::Always => true,
        ColorChoice::Never => false,
        ColorChoice::Auto => stdout.is_terminal() && std::env::var_os("NO_COLOR").is_none(),
    };
    let (_, cat_hits) = policy.classify(&text);
    let mut marks: Vec<Mark> = decision
        .entities
        .iter()
        .map(|e| Mark {
            start: e.start,
            end: e.end,
            label: e.kind.to_string(),
            entity: true,
        })
        .chain(cat_hits.iter().map(|c| Mark {
            start: c.start,
            end: c.end,
            label: c.category.clone(),
            entity: false,
        }))
        .collect();
    marks.sort_by_key(|m| (m.start, std::cmp::Reverse(m.end)));

    let (bold, red, yellow, dim, reset) = if color {
        ("\x1b[1m", "\x1b[1;31m", "\x1b[33m", "\x1b[2m", "\x1b[0m")
    } else {
        ("", "", "", "", "")
    };
    writeln!(
        out,
        "decision:   {bold}{}{reset} (rule: {})",
        decision.action, decision.rule
    )?;
    writeln!(
        out,
        "categories: {}",
        if decision.categories.is_empty() {
            "-".to_string()
        } else {
            decision.categories.join(", ")
        }
    )?;
    // Why each category counted: the term, and the disclosure cue near it
    // ("my", "我爸", "mi", "母が") when the term needed one.
    for c in &cat_hits {
        let term = &text[c.start..c.end];
        match c.cue {
            Some((s, e)) => writeln!(
                out,
                "  {:<10} term {term:?} (bytes {}..{}), cue {:?} (bytes {s}..{e})",
                c.category,
                c.start,
                c.end,
                text.get(s..e).unwrap_or("")
            )?,
            None => writeln!(
                out,
                "  {:<10} term {term:?} (bytes {}..{}), no cue needed",
                c.category, c.start, c.end
            )?,
        }
    }
    match tandem_router::lexicon::frame_of(&text) {
        tandem_router::lexicon::Frame::Open => {}
        tandem_router::lexicon::Frame::Topic => writeln!(
            out,
            "frame:      topic (a general question: a term counts only with a disclosure cue)"
        )?,
        tandem_router::lexicon::Frame::Fiction => writeln!(
            out,
            "frame:      fiction (its first person is a character: no term counts)"
        )?,
    }
    if decision.entities.is_empty() {
        writeln!(out, "entities:   -")?;
    } else {
        writeln!(out, "entities:")?;
        for e in &decision.entities {
            writeln!(
                out,
                "  {:<15} bytes {:>4}..{:<4} score {:.2}",
                e.kind.as_str(),
                e.start,
                e.end,
                e.score
            )?;
        }
    }
    writeln!(out, "text:")?;
    let mut rendered = String::with_capacity(text.len() + marks.len() * 16);
    let mut pos = 0;
    for m in &marks {
        if m.start < pos {
            continue; // overlaps a span already marked
        }
        rendered.push_str(&text[pos..m.start]);
        let span = &text[m.start..m.end];
        if color {
            let c = if m.entity { red } else { yellow };
            rendered.push_str(&format!("{c}{span}{reset}{dim}⟨{}⟩{reset}", m.label));
        } else if m.entity {
            rendered.push_str(&format!("[[{}: {span}]]", m.label));
        } else {
            rendered.push_str(&format!("{{{{{}: {span}}}}}", m.label));
        }
        pos = m.end;
    }
    rendered.push_str(&text[pos..]);
    for line in rendered.lines() {
        writeln!(out, "  {line}")?;
    }
    Ok(())
}

fn check(args: CheckArgs) -> anyhow::Result<()> {
    let policy = Policy::from_file(&args.policy)?;
    let rules: Vec<String> = policy
        .rules()
        .iter()
        .map(|r| format!("{}→{}", r.name, r.action))
        .collect();
    println!(
        "ok: {}: {} rule(s) [{}], default {}",
        args.policy.display(),
        rules.len(),
        rules.join(", "),
        policy.default_action()
    );
    Ok(())
}
