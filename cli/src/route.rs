//! `tandem route`: the privacy router for operators.
//!
//! * `classify` reads JSON lines `{"id": ..., "text": "..."}` on stdin and
//!   writes one JSON line per input: `{"id", "decision", "rule", "entities":
//!   [{"type", "start", "end", "score"}], "categories"}`; `start`/`end` are
//!   UTF-8 byte offsets into `text`. An optional `"conversation"` field groups
//!   lines into conversations (oldest first), so stickiness applies.
//! * `explain` shows one decision for a human, with the spans highlighted in
//!   the text (colour on a terminal, `[[TYPE: ...]]` brackets otherwise).
//!   With `--opinion-model DRAFT.gguf` it also asks the device's model when
//!   the policy's `[second_opinion]` says the rules are unsure, and shows
//!   why it was asked, its answer and what it changed.
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
use tandem_router::lexicon::FrameReport;
use tandem_router::{
    Conversation, Decision, EntityHit, Opinion, OpinionError, OpinionMode, Policy, RouteContext,
    SecondOpinion, Unsure,
};

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
    /// The draft model (GGUF with its tokenizer) to ask as the second
    /// opinion when the policy's rules are unsure
    /// (e.g. "$(tandem models path draft)").
    #[arg(long, value_name = "GGUF")]
    opinion_model: Option<PathBuf>,
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
    /// `explain` only: the second opinion.
    #[serde(skip_serializing_if = "Option::is_none")]
    second_opinion: Option<&'a OpinionReport>,
    /// `explain` only: terms a negation or a hypothetical frame set aside
    /// or was seen near (offsets only, no text; the admin API's explain
    /// serves the same).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    frames: Vec<FrameReport>,
}

/// One line of `explain` for a term a negation or a hypothetical frame set
/// aside or was seen near: the term, the marker, the frame, the cue.
fn frame_line(text: &str, n: &tandem_router::lexicon::TermNote) -> String {
    use tandem_router::lexicon::{FrameNote, HypotheticalKept};
    let span =
        |(s, e): (usize, usize)| format!("{:?} (bytes {s}..{e})", text.get(s..e).unwrap_or(""));
    let term = span((n.start, n.end));
    let cue = n
        .cue
        .map_or_else(|| "no cue".to_string(), |c| format!("cue {}", span(c)));
    let kind = |generic: bool| {
        if generic {
            "generic conditional"
        } else {
            "hypothetical"
        }
    };
    let what = match n.frame {
        FrameNote::Negated { marker } => {
            format!(
                "set aside: denied by {} ({cue}); a denial is not a disclosure",
                span(marker)
            )
        }
        FrameNote::NegationKept { marker, why } => format!(
            "counted: denied by {} ({cue}), kept: {}",
            span(marker),
            why.reason()
        ),
        FrameNote::Hypothetical { marker, generic } => match n.cue {
            Some(_) => format!(
                "set aside: {} {}, its {cue} is the supposition's subject or outside the clause",
                kind(generic),
                span(marker)
            ),
            None => format!(
                "set aside: {} {}, no cue of its own in the clause",
                kind(generic),
                span(marker)
            ),
        },
        FrameNote::HypotheticalKept {
            marker,
            generic,
            why: HypotheticalKept::OwnCue,
        } => format!(
            "counted: {} {}, but {cue} in the clause is not its subject",
            kind(generic),
            span(marker)
        ),
        FrameNote::HypotheticalKept {
            marker,
            generic,
            why,
        } => format!(
            "counted: {} {} ({cue}), kept: {}",
            kind(generic),
            span(marker),
            why.reason()
        ),
        FrameNote::Consequent {
            marker,
            generic,
            supposed,
            why,
        } => format!(
            "set aside: main clause of {} {}{} ({cue}): {}",
            kind(generic),
            span(marker),
            supposed.map_or_else(String::new, |t| format!(" about {}", span(t))),
            why.reason()
        ),
        FrameNote::ConsequentKept {
            marker,
            generic,
            supposed,
            why,
        } => format!(
            "counted: main clause of {} {}{} ({cue}), kept: {}",
            kind(generic),
            span(marker),
            supposed.map_or_else(String::new, |t| format!(" about {}", span(t))),
            why.reason()
        ),
        FrameNote::QuestionHeader { word } => format!(
            "not counted: its list header names questions ({}), so the header's {cue} is not the items'",
            span(word)
        ),
    };
    format!("  {:<10} term {term} {what}", n.category)
}

fn output<'a>(id: &'a Value, d: &'a Decision) -> Output<'a> {
    Output {
        id,
        decision: d.action.as_str(),
        rule: &d.rule,
        entities: &d.entities,
        categories: &d.categories,
        second_opinion: None,
        frames: Vec::new(),
    }
}

/// What `explain` says about the second opinion. Holds no text.
#[derive(Serialize)]
struct OpinionReport {
    /// The policy's `[second_opinion] mode`.
    mode: &'static str,
    /// Why the rules were unsure (`None`: they were sure, or the mode is off).
    unsure: Option<String>,
    /// Whether the model was asked (unsure and a model given).
    asked: bool,
    /// `sensitive`, `benign`, or `error: …`.
    answer: Option<String>,
    /// Best `yes` logit minus best `no` logit.
    margin: Option<f32>,
    prompt_tokens: Option<usize>,
    ms: Option<f64>,
    /// The rules' own decision, before the opinion.
    rules_decision: &'static str,
}

/// The draft's judgement, already made, handed to the policy.
struct Judged(Result<Opinion, String>);

impl SecondOpinion for Judged {
    fn judge(&self, _text: &str) -> Result<Opinion, OpinionError> {
        self.0.clone().map_err(OpinionError)
    }
}

fn mode_name(m: OpinionMode) -> &'static str {
    match m {
        OpinionMode::Off => "off",
        OpinionMode::On => "on",
        OpinionMode::Categories => "categories",
    }
}

fn unsure_text(u: &Unsure) -> String {
    match u {
        Unsure::EntityInBand { kind, score } => {
            format!("entity in the band: {kind} {score:.2}")
        }
        Unsure::CategoryWithoutCue { categories } => {
            format!("category without a cue: {}", categories.join(", "))
        }
    }
}

fn load_opinion(path: &std::path::Path) -> anyhow::Result<tandem_edge::DraftOpinion> {
    let gguf = tandem_model::gguf::GgufFile::open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let tok = tandem_model::tokenizer::Tokenizer::from_gguf(&gguf)?;
    let model = tandem_model::transformer::Model::from_gguf(
        gguf,
        tandem_model::transformer::LoadOptions::with_max_seq_len(2048),
    )?;
    Ok(tandem_edge::DraftOpinion::new(
        std::sync::Arc::new(model),
        tok,
    )?)
}

/// Decide `text`, asking the model when the rules are unsure and one is
/// given.
fn decide_explained(
    policy: &Policy,
    text: &str,
    ctx: &RouteContext,
    model: Option<&tandem_edge::DraftOpinion>,
) -> (Decision, OpinionReport) {
    let rules = policy.decide(text, ctx);
    let unsure = policy.unsure(text, &rules);
    let mut report = OpinionReport {
        mode: mode_name(policy.second_opinion_mode()),
        unsure: unsure.as_ref().map(unsure_text),
        asked: false,
        answer: None,
        margin: None,
        prompt_tokens: None,
        ms: None,
        rules_decision: rules.action.as_str(),
    };
    let (Some(_), Some(model)) = (&unsure, model) else {
        return (rules, report);
    };
    let started = std::time::Instant::now();
    let judged = model.judge_detailed(text);
    report.asked = true;
    report.ms = Some(started.elapsed().as_secs_f64() * 1e3);
    let answer = match &judged {
        Ok(j) => {
            report.margin = Some(j.margin);
            report.prompt_tokens = Some(j.prompt_tokens);
            Ok(j.opinion)
        }
        Err(e) => Err(e.0.clone()),
    };
    report.answer = Some(match &answer {
        Ok(Opinion::Sensitive) => "sensitive".to_string(),
        Ok(Opinion::Benign) => "benign".to_string(),
        Err(e) => format!("error: {e}"),
    });
    let (d, _) = policy.decide_with_opinion(text, ctx, &Judged(answer));
    (d, report)
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
    let model = args
        .opinion_model
        .as_deref()
        .map(load_opinion)
        .transpose()?;
    let (decision, opinion) = decide_explained(&policy, &text, &ctx, model.as_ref());
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let frame_notes = policy.frame_notes(&text);
    if args.json {
        let o = Output {
            second_opinion: Some(&opinion),
            frames: frame_notes.iter().map(FrameReport::from).collect(),
            ..output(&Value::Null, &decision)
        };
        serde_json::to_writer(&mut out, &o)?;
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
    // Negation and hypothetical frames: the term, the marker, the frame and
    // the cue, whether it changed the decision or not.
    if !frame_notes.is_empty() {
        writeln!(out, "frames:")?;
        for n in &frame_notes {
            writeln!(out, "{}", frame_line(&text, n))?;
        }
    }
    write_opinion(&mut out, &opinion, &decision)?;
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

/// The second opinion's line(s) of `explain`.
fn write_opinion(out: &mut impl Write, r: &OpinionReport, d: &Decision) -> std::io::Result<()> {
    match (&r.unsure, r.asked) {
        _ if r.mode == "off" => writeln!(out, "second opinion: off ([second_opinion] mode)"),
        (None, _) => writeln!(
            out,
            "second opinion: not asked (mode {}: the rules are sure)",
            r.mode
        ),
        (Some(why), false) => writeln!(
            out,
            "second opinion: would be asked ({why}); give --opinion-model to ask the draft"
        ),
        (Some(why), true) => {
            writeln!(out, "second opinion: asked ({why})")?;
            writeln!(
                out,
                "  answer {} (yes-no logit margin {}, {} prompt tokens, {:.0} ms on this device)",
                r.answer.as_deref().unwrap_or("-"),
                r.margin.map_or("-".to_string(), |m| format!("{m:+.2}")),
                r.prompt_tokens.map_or("-".to_string(), |n| n.to_string()),
                r.ms.unwrap_or(0.0)
            )?;
            if d.action.as_str() == r.rules_decision {
                writeln!(out, "  the rules' decision stands: {}", d.action)
            } else {
                writeln!(
                    out,
                    "  changed the rules' {} to {} (rule {})",
                    r.rules_decision, d.action, d.rule
                )
            }
        }
    }
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
