//! Precision / recall of the recognizers and lexicons over the labelled corpus
//! in tests/corpus/*.jsonl, with config/policy.example.toml and an idle
//! context. Prints the table (run with `--nocapture` to see it) and asserts
//! per-entity floors.
//!
//! An expected entity is found when a predicted entity of the same type
//! overlaps its span; a predicted entity with no overlapping expected one of
//! its type is a false positive.

#![allow(clippy::unwrap_used)] // test helpers; a panic is a test failure

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value;
use tandem_router::{Policy, RouteContext};

#[derive(Default, Clone, Copy)]
struct Counts {
    tp: u32,
    fp: u32,
    fn_: u32,
}

impl Counts {
    fn precision(&self) -> f64 {
        if self.tp + self.fp == 0 {
            1.0
        } else {
            f64::from(self.tp) / f64::from(self.tp + self.fp)
        }
    }
    fn recall(&self) -> f64 {
        if self.tp + self.fn_ == 0 {
            1.0
        } else {
            f64::from(self.tp) / f64::from(self.tp + self.fn_)
        }
    }
}

struct Case {
    id: String,
    text: String,
    entities: Vec<(String, usize, usize)>,
    categories: Vec<String>,
    decision: String,
}

fn load() -> Vec<Case> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        for (n, line) in std::fs::read_to_string(&f).unwrap().lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let v: Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("{}:{}: {e}", f.display(), n + 1));
            let text = v["text"].as_str().unwrap().to_string();
            let entities = v["entities"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| {
                    let value = e["value"].as_str().unwrap();
                    let start = text
                        .find(value)
                        .unwrap_or_else(|| panic!("{}: value not in text", v["id"]));
                    (
                        e["type"].as_str().unwrap().to_string(),
                        start,
                        start + value.len(),
                    )
                })
                .collect();
            out.push(Case {
                id: v["id"].as_str().unwrap().to_string(),
                text,
                entities,
                categories: v["categories"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|c| c.as_str().unwrap().to_string())
                    .collect(),
                decision: v["decision"].as_str().unwrap().to_string(),
            });
        }
    }
    out
}

fn overlaps(a: (usize, usize), b: (usize, usize)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

struct Report {
    ent: BTreeMap<String, Counts>,
    cat: BTreeMap<String, Counts>,
    all: Counts,
    decisions_ok: u32,
    cases: usize,
    positives: u32,
    negatives: u32,
    /// Negative cases (nothing sensitive expected) with no predicted entity,
    /// no predicted category and a speculative decision.
    negatives_clean: u32,
    misses: Vec<String>,
}

impl Report {
    fn accuracy(&self) -> f64 {
        f64::from(self.decisions_ok) / self.cases as f64
    }

    /// Share of the negative cases the router left alone (1.0 when there are
    /// none): the precision that matters on benign text, where a false
    /// positive keeps a prompt local for no reason.
    fn negatives_clean_rate(&self) -> f64 {
        if self.negatives == 0 {
            1.0
        } else {
            f64::from(self.negatives_clean) / f64::from(self.negatives)
        }
    }
}

fn evaluate(policy: &Policy, cases: &[&Case]) -> Report {
    let mut ent: BTreeMap<String, Counts> = BTreeMap::new();
    let mut cat: BTreeMap<String, Counts> = BTreeMap::new();
    let mut decisions_ok = 0;
    let mut misses = Vec::new();
    let (mut positives, mut negatives, mut negatives_clean) = (0, 0, 0);
    for c in cases {
        let d = policy.decide(&c.text, &RouteContext::default());
        if c.entities.is_empty() && c.categories.is_empty() {
            negatives += 1;
            if d.entities.is_empty()
                && d.categories.is_empty()
                && d.action.as_str() == "speculative"
            {
                negatives_clean += 1;
            }
        } else {
            positives += 1;
        }
        for (t, s, e) in &c.entities {
            let hit = d
                .entities
                .iter()
                .any(|p| p.kind.as_str() == t && overlaps((p.start, p.end), (*s, *e)));
            let k = ent.entry(t.clone()).or_default();
            if hit {
                k.tp += 1;
            } else {
                k.fn_ += 1;
                misses.push(format!("{}: missed {t}", c.id));
            }
        }
        for p in &d.entities {
            let expected = c
                .entities
                .iter()
                .any(|(t, s, e)| p.kind.as_str() == t && overlaps((p.start, p.end), (*s, *e)));
            if !expected {
                ent.entry(p.kind.as_str().to_string()).or_default().fp += 1;
                misses.push(format!(
                    "{}: false {} {:.2} at {}..{}",
                    c.id, p.kind, p.score, p.start, p.end
                ));
            }
        }
        let mut names: Vec<&String> = c.categories.iter().chain(d.categories.iter()).collect();
        names.sort();
        names.dedup();
        for name in names {
            let k = cat.entry(name.clone()).or_default();
            match (c.categories.contains(name), d.categories.contains(name)) {
                (true, true) => k.tp += 1,
                (false, true) => {
                    k.fp += 1;
                    misses.push(format!("{}: false category {name}", c.id));
                }
                (true, false) => {
                    k.fn_ += 1;
                    misses.push(format!("{}: missed category {name}", c.id));
                }
                (false, false) => {}
            }
        }
        if d.action.as_str() == c.decision {
            decisions_ok += 1;
        } else {
            misses.push(format!(
                "{}: decision {} (rule {}), expected {}",
                c.id, d.action, d.rule, c.decision
            ));
        }
    }

    let mut all = Counts::default();
    for c in ent.values() {
        all.tp += c.tp;
        all.fp += c.fp;
        all.fn_ += c.fn_;
    }
    Report {
        ent,
        cat,
        all,
        decisions_ok,
        cases: cases.len(),
        positives,
        negatives,
        negatives_clean,
        misses,
    }
}

fn print_report(title: &str, r: &Report) {
    println!(
        "## {title}: {} cases ({} with sensitive content, {} without)\n",
        r.cases, r.positives, r.negatives
    );
    println!("| entity | TP | FP | FN | precision | recall |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for (k, c) in &r.ent {
        println!(
            "| {k} | {} | {} | {} | {:.3} | {:.3} |",
            c.tp,
            c.fp,
            c.fn_,
            c.precision(),
            c.recall()
        );
    }
    println!(
        "| **all entities** | {} | {} | {} | {:.3} | {:.3} |",
        r.all.tp,
        r.all.fp,
        r.all.fn_,
        r.all.precision(),
        r.all.recall()
    );
    println!("\n| category | TP | FP | FN | precision | recall |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for (k, c) in &r.cat {
        println!(
            "| {k} | {} | {} | {} | {:.3} | {:.3} |",
            c.tp,
            c.fp,
            c.fn_,
            c.precision(),
            c.recall()
        );
    }
    println!(
        "\ndecision accuracy: {}/{} = {:.3}",
        r.decisions_ok,
        r.cases,
        r.accuracy()
    );
    println!(
        "negatives left alone (no entity, no category, speculative): {}/{} = {:.3}\n",
        r.negatives_clean,
        r.negatives,
        r.negatives_clean_rate()
    );
}

fn print_errors(title: &str, r: &Report) {
    println!("{title} errors:");
    for m in &r.misses {
        println!("  {m}");
    }
    println!();
}

/// Which evaluation set a case id belongs to. The id prefix is the file it
/// came from; everything that is not a holdout is the main corpus.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Set {
    Main,
    Holdout,
    Holdout2,
    Holdout3,
}

impl Set {
    fn of(id: &str) -> Set {
        if id.starts_with("holdout3-") {
            Set::Holdout3
        } else if id.starts_with("holdout2-") {
            Set::Holdout2
        } else if id.starts_with("holdout-") {
            Set::Holdout
        } else {
            Set::Main
        }
    }
}

fn select<'a>(cases: &'a [Case], sets: &[Set]) -> Vec<&'a Case> {
    cases
        .iter()
        .filter(|c| sets.contains(&Set::of(&c.id)))
        .collect()
}

#[test]
fn corpus_precision_recall() {
    let policy_path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/policy.example.toml");
    let policy = Policy::from_file(&policy_path).unwrap();
    let cases = load();
    assert!(cases.len() >= 300, "corpus has only {} cases", cases.len());
    // One table per set. The tuned set is the main corpus plus the first
    // holdout (tuned on since the recall fixes); holdout2 and holdout3 were
    // each written before the fixes they measure and are reported on their
    // own.
    let main = evaluate(&policy, &select(&cases, &[Set::Main]));
    print_report("main corpus (generated, hand-written)", &main);
    let r = evaluate(&policy, &select(&cases, &[Set::Main, Set::Holdout]));
    print_report("tuned corpus (generated, hand-written, holdout)", &r);
    let h = evaluate(&policy, &select(&cases, &[Set::Holdout]));
    print_report(
        "holdout only (written after the recognizers were frozen)",
        &h,
    );
    let h2 = evaluate(&policy, &select(&cases, &[Set::Holdout2]));
    print_report("holdout2 only (written before the recall fixes)", &h2);
    let h3 = evaluate(&policy, &select(&cases, &[Set::Holdout3]));
    print_report(
        "holdout3 only (finance/legal, written before their lexicon work)",
        &h3,
    );
    let every = evaluate(
        &policy,
        &select(
            &cases,
            &[Set::Main, Set::Holdout, Set::Holdout2, Set::Holdout3],
        ),
    );
    print_report("every set together", &every);
    print_errors("holdout2", &h2);
    print_errors("holdout3", &h3);
    // The holdouts are small (40 and 75 cases, one or two per entity type):
    // loose floors on the totals, mainly to catch false positives creeping
    // in. holdout2 was not tuned on; these floors were set before its
    // after-fix figures were known (they are the first holdout's).
    for (name, h) in [("holdout", &h), ("holdout2", &h2)] {
        assert!(
            h.all.precision() >= 0.9,
            "{name} precision {:.3}",
            h.all.precision()
        );
        assert!(
            h.all.recall() >= 0.65,
            "{name} recall {:.3}",
            h.all.recall()
        );
        assert!(h.accuracy() >= 0.85, "{name} decisions {:.3}", h.accuracy());
    }
    // holdout3 (finance and legal, written before their lexicon work). Its
    // first measurement after that work: finance recall 0.90, legal 0.95,
    // precision 1.00, every decision right, every negative left alone; the
    // lexicons before it measured 0.62 / 0.55 with 4 of 36 negatives
    // flagged. Floors set after that measurement, a little under it, so
    // removing the finance or legal terms (or their context rules) fails.
    for name in ["finance", "legal"] {
        let c = h3.cat.get(name).copied().unwrap_or_default();
        assert!(
            c.recall() >= 0.85,
            "holdout3 {name} recall {:.3}",
            c.recall()
        );
        assert!(
            c.precision() >= 0.95,
            "holdout3 {name} precision {:.3}",
            c.precision()
        );
    }
    assert!(
        h3.accuracy() >= 0.95,
        "holdout3 decisions {:.3}",
        h3.accuracy()
    );
    assert!(
        h3.negatives_clean_rate() >= 0.95,
        "holdout3 negatives left alone {:.3}",
        h3.negatives_clean_rate()
    );
    // Benign text, mostly code, across every set: at least 98% of the
    // negatives get no entity, no category and stay speculative, and the
    // finance and legal tags are right at least 95% of the time.
    assert!(
        every.negatives_clean_rate() >= 0.98,
        "negatives left alone over every set {:.3}",
        every.negatives_clean_rate()
    );
    for name in ["finance", "legal"] {
        let c = every.cat.get(name).copied().unwrap_or_default();
        assert!(
            c.precision() >= 0.95,
            "{name} precision over every set {:.3}",
            c.precision()
        );
    }
    print_errors("tuned corpus", &r);
    let (ent, cat, all, acc) = (&r.ent, &r.cat, r.all, r.accuracy());

    // Floors: set just under what the corpus measures today, so a regression
    // fails the test.
    for (k, c) in ent {
        assert!(c.precision() >= 0.95, "{k} precision {:.3}", c.precision());
        assert!(c.recall() >= 0.95, "{k} recall {:.3}", c.recall());
    }
    assert!(
        all.precision() >= 0.95,
        "overall precision {:.3}",
        all.precision()
    );
    assert!(all.recall() >= 0.99, "overall recall {:.3}", all.recall());
    for (k, c) in cat {
        assert!(
            c.precision() >= 0.8,
            "category {k} precision {:.3}",
            c.precision()
        );
        assert!(c.recall() >= 0.8, "category {k} recall {:.3}", c.recall());
    }
    assert!(acc >= 0.99, "decision accuracy {acc:.3}");
}
