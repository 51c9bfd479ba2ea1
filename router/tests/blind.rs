//! The blind evaluation set of issue 32 (`tests/blind/blind_v2.jsonl`,
//! written and committed before the router changes it measures): recall and
//! precision of the routing decision (a sensitive prompt must be routed
//! local, a benign one must not), overall and per language, failure class
//! and code/prose, and per entity type and category, with
//! config/policy.example.toml and an idle context.
//!
//! Every fourth case (`"heldout": true`) was never looked at while the
//! rules were tuned; it is reported on its own and its errors are only
//! printed with `BLIND_SHOW_HELDOUT=1`. Run with `--nocapture` for the
//! tables.

#![allow(clippy::unwrap_used)] // test helpers; a panic is a test failure

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value;
use tandem_router::{Action, Policy, RouteContext};

#[derive(Default, Clone, Copy)]
struct Counts {
    tp: u32,
    fp: u32,
    fn_: u32,
}

impl Counts {
    fn precision(&self) -> f64 {
        ratio(self.tp, self.tp + self.fp)
    }
    fn recall(&self) -> f64 {
        ratio(self.tp, self.tp + self.fn_)
    }
}

fn ratio(a: u32, b: u32) -> f64 {
    if b == 0 {
        1.0
    } else {
        f64::from(a) / f64::from(b)
    }
}

struct Case {
    id: String,
    text: String,
    entities: Vec<(String, usize, usize)>,
    categories: Vec<String>,
    sensitive: bool,
    lang: String,
    cls: String,
    code: bool,
    heldout: bool,
}

fn load() -> Vec<Case> {
    load_file(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/blind/blind_v2.jsonl"))
}

/// The older evaluation sets (`tests/corpus/*.jsonl`), for the decision-level
/// no-regression check; they have no language or class labels.
fn load_old() -> Vec<Case> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    files.iter().flat_map(|f| load_file(f)).collect()
}

fn load_file(path: &std::path::Path) -> Vec<Case> {
    let src = std::fs::read_to_string(path).unwrap();
    src.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let v: Value = serde_json::from_str(line).unwrap();
            let text = v["text"].as_str().unwrap().to_string();
            let entities = v["entities"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| {
                    let value = e["value"].as_str().unwrap();
                    let start = text.find(value).unwrap();
                    (
                        e["type"].as_str().unwrap().to_string(),
                        start,
                        start + value.len(),
                    )
                })
                .collect();
            Case {
                id: v["id"].as_str().unwrap().to_string(),
                entities,
                categories: v["categories"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|c| c.as_str().unwrap().to_string())
                    .collect(),
                sensitive: v["decision"].as_str().unwrap() == "local",
                lang: v["lang"].as_str().unwrap_or("-").to_string(),
                cls: v["cls"].as_str().unwrap_or("-").to_string(),
                code: v["code"].as_bool().unwrap_or(false),
                heldout: v["heldout"].as_bool().unwrap_or(false),
                text,
            }
        })
        .collect()
}

#[derive(Default)]
struct Report {
    /// Decision level: positive = routed local.
    all: Counts,
    by_lang: BTreeMap<String, Counts>,
    by_cls: BTreeMap<String, Counts>,
    by_code: BTreeMap<String, Counts>,
    ent: BTreeMap<String, Counts>,
    cat: BTreeMap<String, Counts>,
    cases: usize,
    errors: Vec<String>,
}

fn add(c: &mut Counts, sensitive: bool, local: bool) {
    match (sensitive, local) {
        (true, true) => c.tp += 1,
        (false, true) => c.fp += 1,
        (true, false) => c.fn_ += 1,
        (false, false) => {}
    }
}

fn overlaps(a: (usize, usize), b: (usize, usize)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

fn evaluate(policy: &Policy, cases: &[&Case]) -> Report {
    let mut r = Report {
        cases: cases.len(),
        ..Report::default()
    };
    for c in cases {
        let d = policy.decide(&c.text, &RouteContext::default());
        let local = d.action == Action::Local;
        add(&mut r.all, c.sensitive, local);
        add(
            r.by_lang.entry(c.lang.clone()).or_default(),
            c.sensitive,
            local,
        );
        add(
            r.by_cls.entry(c.cls.clone()).or_default(),
            c.sensitive,
            local,
        );
        let code = if c.code { "code" } else { "prose" };
        add(
            r.by_code.entry(code.into()).or_default(),
            c.sensitive,
            local,
        );
        if c.sensitive != local {
            r.errors.push(format!(
                "{} [{} {} {}]: {} (rule {}{}) {:?}",
                c.id,
                c.lang,
                c.cls,
                code,
                if local { "false local" } else { "LEAK" },
                d.rule,
                if d.categories.is_empty() {
                    String::new()
                } else {
                    format!(", categories {}", d.categories.join("+"))
                },
                c.text.chars().take(90).collect::<String>()
            ));
        }
        for (t, s, e) in &c.entities {
            let hit = d
                .entities
                .iter()
                .any(|p| p.kind.as_str() == t && overlaps((p.start, p.end), (*s, *e)));
            let k = r.ent.entry(t.clone()).or_default();
            if hit {
                k.tp += 1;
            } else {
                k.fn_ += 1;
            }
        }
        for p in &d.entities {
            let expected = c
                .entities
                .iter()
                .any(|(t, s, e)| p.kind.as_str() == t && overlaps((p.start, p.end), (*s, *e)));
            if !expected {
                r.ent.entry(p.kind.as_str().to_string()).or_default().fp += 1;
            }
        }
        let mut names: Vec<&String> = c.categories.iter().chain(d.categories.iter()).collect();
        names.sort();
        names.dedup();
        for name in names {
            add(
                r.cat.entry(name.clone()).or_default(),
                c.categories.contains(name),
                d.categories.contains(name),
            );
        }
    }
    r
}

fn table(title: &str, rows: &BTreeMap<String, Counts>) {
    println!("| {title} | TP | FP | FN | precision | recall |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for (k, c) in rows {
        println!(
            "| {k} | {} | {} | {} | {:.2} | {:.2} |",
            c.tp,
            c.fp,
            c.fn_,
            c.precision(),
            c.recall()
        );
    }
    println!();
}

fn print_report(title: &str, r: &Report) {
    println!(
        "## {title}: {} cases; decisions: recall {:.3}, precision {:.3} (TP {} FP {} FN {})\n",
        r.cases,
        r.all.recall(),
        r.all.precision(),
        r.all.tp,
        r.all.fp,
        r.all.fn_
    );
    table("language (decision)", &r.by_lang);
    table("class (decision)", &r.by_cls);
    table("code/prose (decision)", &r.by_code);
    table("entity (span)", &r.ent);
    table("category", &r.cat);
}

#[test]
fn blind_v2_precision_recall() {
    let policy_path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/policy.example.toml");
    let policy = Policy::from_file(&policy_path).unwrap();
    let cases = load();
    assert!(
        cases.len() >= 300,
        "blind set has only {} cases",
        cases.len()
    );
    let all: Vec<&Case> = cases.iter().collect();
    let tuning: Vec<&Case> = cases.iter().filter(|c| !c.heldout).collect();
    let heldout: Vec<&Case> = cases.iter().filter(|c| c.heldout).collect();
    let r_all = evaluate(&policy, &all);
    let r_tune = evaluate(&policy, &tuning);
    let r_held = evaluate(&policy, &heldout);
    print_report("blind v2, every case", &r_all);
    print_report("blind v2, tuning part (3 of 4 cases)", &r_tune);
    print_report("blind v2, held-out part (every 4th case)", &r_held);
    println!("tuning-part errors:");
    for e in &r_tune.errors {
        println!("  {e}");
    }
    if std::env::var_os("BLIND_SHOW_HELDOUT").is_some() {
        println!("held-out errors:");
        for e in &r_held.errors {
            println!("  {e}");
        }
    }
    // Issue 32's targets on the whole set, measured 0.987 / 0.979 (the
    // router before this work: 0.470 / 0.690).
    assert!(
        r_all.all.recall() >= 0.97,
        "blind recall {:.3}",
        r_all.all.recall()
    );
    assert!(
        r_all.all.precision() >= 0.97,
        "blind precision {:.3}",
        r_all.all.precision()
    );
    // The held-out quarter, never looked at while tuning: measured recall
    // 1.000, precision 0.932 (4 false locals of 59); floors a little under.
    assert!(
        r_held.all.recall() >= 0.95,
        "held-out recall {:.3}",
        r_held.all.recall()
    );
    assert!(
        r_held.all.precision() >= 0.9,
        "held-out precision {:.3}",
        r_held.all.precision()
    );
    // Every language: the worst measured is 0.95 recall (ja), 0.95
    // precision (ko); before this work German, Spanish, Japanese and Korean
    // were at 0.21-0.27 recall.
    for (lang, c) in &r_all.by_lang {
        assert!(c.recall() >= 0.9, "{lang} recall {:.3}", c.recall());
        assert!(
            c.precision() >= 0.9,
            "{lang} precision {:.3}",
            c.precision()
        );
    }
    // Published example values are not kept local (before: 9 of 20).
    let ex = r_all.by_cls.get("example").copied().unwrap_or_default();
    assert_eq!(ex.fp, 0, "published examples kept local");
    // Topics asked about in general (before: 32 of 107 kept local).
    let topic = r_all.by_cls.get("topic").copied().unwrap_or_default();
    assert!(topic.fp <= 5, "{} general topics kept local", topic.fp);
}

/// The older sets at the decision level (a sensitive case routed local, a
/// benign one not), for the before/after table of docs/privacy.md.
#[test]
fn old_sets_decisions() {
    let policy_path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/policy.example.toml");
    let policy = Policy::from_file(&policy_path).unwrap();
    let cases = load_old();
    let all: Vec<&Case> = cases.iter().collect();
    let r = evaluate(&policy, &all);
    println!(
        "## old sets (tests/corpus): {} cases; decisions: recall {:.3}, precision {:.3} (TP {} FP {} FN {})",
        r.cases,
        r.all.recall(),
        r.all.precision(),
        r.all.tp,
        r.all.fp,
        r.all.fn_
    );
    // No regression: the same 350 / 4 / 3 as before issue 32's changes.
    assert!(
        r.all.fn_ <= 3,
        "old sets: {} sensitive cases sent",
        r.all.fn_
    );
    assert!(
        r.all.fp <= 4,
        "old sets: {} benign cases kept local",
        r.all.fp
    );
}

/// How often the second opinion would be asked on the blind set with
/// `[second_opinion] mode = "on"` and `"categories"` (the model side is not
/// built yet; this is the fraction of requests that would pay for it).
#[test]
fn second_opinion_would_be_asked_for_few_requests() {
    let src = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/policy.example.toml"),
    )
    .unwrap();
    let cases = load();
    for mode in ["on", "categories"] {
        let policy =
            Policy::from_toml_str(&src.replace("mode = \"off\"", &format!("mode = \"{mode}\"")))
                .unwrap();
        let (mut asked, mut band, mut cue) = (0u32, 0u32, 0u32);
        for c in &cases {
            let d = policy.decide(&c.text, &RouteContext::default());
            match policy.unsure(&c.text, &d) {
                Some(tandem_router::Unsure::EntityInBand { .. }) => {
                    asked += 1;
                    band += 1
                }
                Some(tandem_router::Unsure::CategoryWithoutCue { .. }) => {
                    asked += 1;
                    cue += 1
                }
                None => {}
            }
        }
        println!(
            "second opinion mode {mode}: asked for {asked} of {} blind cases ({:.1}%): {band} entity in band, {cue} category without cue",
            cases.len(),
            100.0 * f64::from(asked) / cases.len() as f64
        );
        assert!(asked as usize * 4 < cases.len(), "asked for {asked}");
    }
}
