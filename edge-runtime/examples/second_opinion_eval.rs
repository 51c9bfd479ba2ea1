//! The draft model as the router's second opinion, measured on the blind set
//! (issue 32, item 4):
//!
//! ```text
//! cargo run --release -p tandem-edge --example second_opinion_eval -- \
//!     "$(cargo run -q -p tandem -- models path draft)" [--mode on|categories] [--every N] [--limit N] [--set FILE.jsonl]
//! ```
//!
//! The model costs seconds per request on a busy phone-class CPU, so
//! `--every N` judges only every Nth case for the model-alone figures; the
//! combined figures always cover every case (the model is needed only where
//! the rules are unsure, and it is asked on all of those).
//!
//! For every case of `router/tests/blind/blind_v2.jsonl` (or `--set`): the
//! rules' decision (`config/policy.example.toml` with `[second_opinion]
//! mode` set to `--mode`, default `on`), whether the rules are unsure
//! (`Policy::unsure`), and the draft's judgement ([`DraftOpinion`], timed).
//! Prints
//!   * the model alone: its answer as the decision on every case (accuracy,
//!     precision, recall of "sensitive"), and at other logit thresholds;
//!   * the rules alone and the rules with the model asked when unsure
//!     (`Policy::decide_with_opinion`);
//!   * the cost: ms per judged request (mean, median, p90) and prompt tokens,
//!     the fraction of requests the policy asks about;
//!   * what a local generation could reuse: the share of the generation
//!     prompt's tokens that the classification prompt already prefilled.
//!
//! A case is sensitive when its expected decision is `local`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tandem_edge::conversation::common_prefix;
use tandem_edge::{DraftOpinion, Judgement};
use tandem_model::gguf::GgufFile;
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::{LoadOptions, Model};
use tandem_router::{Action, Opinion, OpinionError, Policy, RouteContext, SecondOpinion};

struct Case {
    text: String,
    sensitive: bool,
}

/// Precision / recall of "sensitive" (positive = kept local).
#[derive(Default)]
struct Counts {
    tp: u32,
    fp: u32,
    tn: u32,
    fn_: u32,
}

impl Counts {
    fn add(&mut self, sensitive: bool, local: bool) {
        match (sensitive, local) {
            (true, true) => self.tp += 1,
            (false, true) => self.fp += 1,
            (false, false) => self.tn += 1,
            (true, false) => self.fn_ += 1,
        }
    }

    fn line(&self, name: &str) -> String {
        let r = |a: u32, b: u32| {
            if a + b == 0 {
                0.0
            } else {
                f64::from(a) / f64::from(a + b)
            }
        };
        let all = self.tp + self.fp + self.tn + self.fn_;
        format!(
            "{name:<34} accuracy {:.3}  precision {:.3}  recall {:.3}  (TP {} FP {} TN {} FN {})",
            r(self.tp + self.tn, all - self.tp - self.tn),
            r(self.tp, self.fp),
            r(self.tp, self.fn_),
            self.tp,
            self.fp,
            self.tn,
            self.fn_
        )
    }
}

/// The judgement already computed for the text being decided.
struct Known(Opinion);

impl SecondOpinion for Known {
    fn judge(&self, _text: &str) -> Result<Opinion, OpinionError> {
        Ok(self.0)
    }
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn load(path: &PathBuf) -> Result<Vec<Case>, Box<dyn std::error::Error>> {
    let mut out = Vec::new();
    for line in std::fs::read_to_string(path)?.lines() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)?;
        out.push(Case {
            text: v["text"].as_str().ok_or("case without text")?.to_string(),
            sensitive: v["decision"].as_str() == Some("local"),
        });
    }
    Ok(out)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model_path = args.next().ok_or(
        "usage: second_opinion_eval MODEL.gguf [--mode on|categories] [--limit N] [--set FILE]",
    )?;
    let (mut mode, mut limit, mut every) = ("on".to_string(), usize::MAX, 1usize);
    let mut set = repo().join("router/tests/blind/blind_v2.jsonl");
    while let Some(a) = args.next() {
        let v = args.next().ok_or(format!("{a} needs a value"))?;
        match a.as_str() {
            "--mode" => mode = v,
            "--limit" => limit = v.parse()?,
            "--every" => every = v.parse::<usize>()?.max(1),
            "--set" => set = PathBuf::from(v),
            _ => return Err(format!("unknown flag {a}").into()),
        }
    }
    let src = std::fs::read_to_string(repo().join("config/policy.example.toml"))?;
    let policy =
        Policy::from_toml_str(&src.replace("mode = \"off\"", &format!("mode = \"{mode}\"")))?;
    let tok = Tokenizer::from_gguf(&GgufFile::open(&model_path)?)?;
    let model = Arc::new(Model::load(
        &model_path,
        LoadOptions::with_max_seq_len(2048),
    )?);
    let opinion = DraftOpinion::new(model, tok.clone())?;
    let cases: Vec<Case> = load(&set)?.into_iter().take(limit).collect();
    // Warm-up (first-touch of the weights is not a request's cost).
    opinion.judge_detailed("warm-up")?;

    let ctx = RouteContext::default();
    let (mut alone, mut rules, mut combined) =
        (Counts::default(), Counts::default(), Counts::default());
    let (mut ms_all, mut ms_asked) = (Vec::new(), Vec::new());
    let (mut tokens, mut asked, mut reuse_num, mut reuse_den) = (0usize, 0usize, 0usize, 0usize);
    let mut judgements: Vec<(bool, Judgement)> = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        let d = policy.decide(&c.text, &ctx);
        rules.add(c.sensitive, d.action == Action::Local);
        let unsure = policy.unsure(&c.text, &d).is_some();
        let sampled = i % every == 0;
        if !unsure && !sampled {
            combined.add(c.sensitive, d.action == Action::Local);
            continue;
        }
        let t = Instant::now();
        let j = opinion.judge_detailed(&c.text)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        ms_all.push(ms);
        tokens += j.prompt_tokens;
        if sampled {
            judgements.push((c.sensitive, j));
            alone.add(c.sensitive, j.opinion == Opinion::Sensitive);
        }
        if unsure {
            asked += 1;
            ms_asked.push(ms);
        }
        let (dc, _) = policy.decide_with_opinion(&c.text, &ctx, &Known(j.opinion));
        combined.add(c.sensitive, dc.action == Action::Local);
        let judge_prompt = opinion.prompt(&c.text)?;
        let gen_prompt = tok.encode_chat(&[ChatMessage::user(c.text.clone())], true)?;
        reuse_num += common_prefix(&judge_prompt, &gen_prompt);
        reuse_den += gen_prompt.len();
        if (i + 1) % 50 == 0 {
            eprintln!("{} / {} cases", i + 1, cases.len());
        }
    }
    let n = cases.len().max(1);
    println!("set: {} ({} cases); policy: config/policy.example.toml with [second_opinion] mode = \"{mode}\"", set.display(), cases.len());
    println!("model: {model_path}");
    println!(
        "model alone on every {every}th case ({} cases):",
        judgements.len()
    );
    println!("{}", alone.line("model alone (threshold 0)"));
    for th in [-4.0f32, -2.0, -1.0, 1.0, 2.0, 4.0] {
        let mut c = Counts::default();
        for (s, j) in &judgements {
            c.add(*s, j.margin > th);
        }
        println!("{}", c.line(&format!("model alone (threshold {th:+})")));
    }
    println!("{}", rules.line("rules alone"));
    println!("{}", combined.line("rules + model when unsure"));
    ms_all.sort_by(f64::total_cmp);
    ms_asked.sort_by(f64::total_cmp);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    println!(
        "asked: {asked} of {} requests ({:.1} %)",
        cases.len(),
        100.0 * asked as f64 / n as f64
    );
    println!(
        "cost per judged request ({} judged): mean {:.0} ms, median {:.0} ms, p90 {:.0} ms; {:.0} prompt tokens on average",
        ms_all.len(),
        mean(&ms_all),
        percentile(&ms_all, 0.5),
        percentile(&ms_all, 0.9),
        tokens as f64 / ms_all.len().max(1) as f64
    );
    println!(
        "cost on the requests the policy asks about: mean {:.0} ms; per request overall: {:.1} ms",
        mean(&ms_asked),
        ms_asked.iter().sum::<f64>() / n as f64
    );
    println!(
        "KV a local generation could reuse: {:.1} % of its prompt tokens",
        100.0 * reuse_num as f64 / reuse_den.max(1) as f64
    );
    Ok(())
}
