//! `tandem route classify|explain|check`, run as the built binary.

#![allow(clippy::unwrap_used)] // test helpers; a panic is a test failure

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

fn example_policy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/policy.example.toml")
}

fn tandem(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .env_remove("NO_COLOR")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The binary may exit before reading its input (a bad policy is rejected
    // first), so a broken pipe here is expected, not a failure.
    if let Err(e) = child.stdin.take().unwrap().write_all(stdin.as_bytes()) {
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
    }
    child.wait_with_output().unwrap()
}

/// `tandem route explain [flags] --policy <example> text`, which must
/// succeed.
fn explain_with(flags: &[&str], text: &str) -> Output {
    let policy = example_policy();
    let mut args = vec!["route", "explain"];
    args.extend_from_slice(flags);
    args.extend(["--policy", policy.to_str().unwrap(), text]);
    let o = tandem(&args, "");
    assert!(o.status.success(), "{}", stderr(&o));
    o
}

/// [`explain_with`] without flags: its stdout.
fn explain(text: &str) -> String {
    stdout(&explain_with(&[], text))
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).unwrap()
}

fn json_lines(o: &Output) -> Vec<Value> {
    stdout(o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn classify_writes_one_json_line_per_input_with_byte_offsets() {
    let policy = example_policy();
    let text = "我的身份证号是11010519491231002X，邮箱 li.na@gmail.com";
    let input = format!(
        "{}\n{}\n\n{}\n",
        serde_json::json!({"id": "zh", "text": text}),
        serde_json::json!({"id": 7, "text": "fn main() { println!(\"hi\"); }"}),
        serde_json::json!({"id": "health", "text": "I was diagnosed with diabetes"}),
    );
    let o = tandem(
        &["route", "classify", "--policy", policy.to_str().unwrap()],
        &input,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = json_lines(&o);
    assert_eq!(lines.len(), 3);

    let zh = &lines[0];
    assert_eq!(zh["id"], "zh");
    assert_eq!(zh["decision"], "local");
    assert_eq!(zh["rule"], "identifiers");
    let ents = zh["entities"].as_array().unwrap();
    assert_eq!(ents.len(), 2);
    let spans: Vec<(&str, &str)> = ents
        .iter()
        .map(|e| {
            let (s, t) = (
                e["start"].as_u64().unwrap() as usize,
                e["end"].as_u64().unwrap() as usize,
            );
            (e["type"].as_str().unwrap(), &text[s..t])
        })
        .collect();
    assert_eq!(
        spans,
        vec![
            ("CN_RESIDENT_ID", "11010519491231002X"),
            ("EMAIL", "li.na@gmail.com")
        ]
    );
    assert!(ents[0]["score"].as_f64().unwrap() > 0.9);

    assert_eq!(lines[1]["id"], 7);
    assert_eq!(lines[1]["decision"], "speculative");
    assert_eq!(lines[1]["rule"], "default");
    assert_eq!(lines[1]["entities"].as_array().unwrap().len(), 0);

    assert_eq!(lines[2]["decision"], "local");
    assert_eq!(lines[2]["categories"], serde_json::json!(["health"]));
}

#[test]
fn classify_output_never_contains_the_sensitive_text_outside_ids() {
    let o = tandem(
        &["route", "classify"],
        "{\"id\":1,\"text\":\"card 4539 1488 0343 6467 and password = \\\"q8Zr!x2LwP0v#Kd9\\\"\"}\n",
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(!out.contains("4539"), "{out}");
    assert!(!out.contains("q8Zr"), "{out}");
    assert_eq!(json_lines(&o)[0]["decision"], "local");
}

#[test]
fn a_pem_private_key_header_alone_keeps_the_prompt_local() {
    // Issue 19: a short, elided or malformed body used to be routed to the
    // cloud; the header alone now decides, with the built-in policy and the
    // example one.
    let texts = [
        "-----BEGIN PRIVATE KEY-----\n...\n-----END PRIVATE KEY-----",
        "why does this fail? -----BEGIN RSA PRIVATE KEY-----\nMIIE",
        "-----BEGIN OPENSSH PRIVATE KEY-----",
    ];
    let input: String = texts
        .iter()
        .enumerate()
        .map(|(i, t)| format!("{}\n", serde_json::json!({"id": i, "text": t})))
        .collect();
    let example = example_policy();
    for args in [
        vec!["route", "classify"],
        vec!["route", "classify", "--policy", example.to_str().unwrap()],
    ] {
        let o = tandem(&args, &input);
        assert!(o.status.success(), "{}", stderr(&o));
        let lines = json_lines(&o);
        assert_eq!(lines.len(), texts.len());
        for (l, t) in lines.iter().zip(texts) {
            assert_eq!(l["decision"], "local", "{args:?} {t:?}: {l}");
            let e = &l["entities"][0];
            assert_eq!(e["type"], "SECRET", "{l}");
            let start = e["start"].as_u64().unwrap() as usize;
            assert!(t[start..].starts_with("-----BEGIN "), "{l}");
        }
    }
}

#[test]
fn classify_conversation_field_makes_decisions_sticky() {
    let input = [
        r#"{"id":"1","conversation":"c","text":"my ssn is 536-22-1234"}"#,
        r#"{"id":"2","conversation":"c","text":"write a haiku"}"#,
        r#"{"id":"3","conversation":"d","text":"write a haiku"}"#,
        r#"{"id":"4","text":"write a haiku"}"#,
    ]
    .join("\n");
    let policy = example_policy();
    let o = tandem(
        &["route", "classify", "--policy", policy.to_str().unwrap()],
        &input,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let l = json_lines(&o);
    let rules: Vec<&str> = l.iter().map(|v| v["rule"].as_str().unwrap()).collect();
    assert_eq!(
        rules,
        vec!["identifiers", "sticky:identifiers", "default", "default"]
    );
    assert_eq!(l[1]["decision"], "local");
}

#[test]
fn classify_context_flags_reach_the_policy() {
    let policy = example_policy();
    let p = policy.to_str().unwrap();
    let line = "{\"id\":1,\"text\":\"sort a list\"}\n";
    let rule = |extra: &[&str]| {
        let mut args = vec!["route", "classify", "--policy", p];
        args.extend_from_slice(extra);
        let o = tandem(&args, line);
        assert!(o.status.success(), "{}", stderr(&o));
        json_lines(&o)[0]["rule"].as_str().unwrap().to_string()
    };
    assert_eq!(rule(&[]), "default");
    assert_eq!(rule(&["--breaker-open"]), "verifier-down");
    assert_eq!(rule(&["--rtt-ms", "2500"]), "slow-network");
    assert_eq!(rule(&["--opt-out"]), "user-opt-out");
    assert_eq!(rule(&["--battery", "5"]), "low-battery");
}

#[test]
fn classify_reports_bad_lines_and_exits_nonzero() {
    let o = tandem(
        &["route", "classify"],
        "{\"id\":1,\"text\":\"ok\"}\nnot json\n{\"id\":3}\n{\"id\":4,\"text\":\"fine\"}\n",
    );
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("line 2"), "{err}");
    assert!(err.contains("line 3"), "{err}");
    // Good lines are still answered, in order.
    let ids: Vec<Value> = json_lines(&o).iter().map(|v| v["id"].clone()).collect();
    assert_eq!(ids, vec![Value::from(1), Value::from(4)]);
}

#[test]
fn explain_highlights_spans_without_colour_when_piped() {
    let policy = example_policy();
    let o = tandem(
        &[
            "route",
            "explain",
            "--policy",
            policy.to_str().unwrap(),
            "我叫张伟，最近确诊糖尿病，card 4539 1488 0343 6467",
        ],
        "",
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("decision:   local (rule: identifiers)"),
        "{out}"
    );
    assert!(out.contains("categories: health"), "{out}");
    assert!(out.contains("[[PERSON_NAME: 张伟]]"), "{out}");
    assert!(out.contains("[[BANK_CARD: 4539 1488 0343 6467]]"), "{out}");
    assert!(out.contains("{{health: 糖尿病}}"), "{out}");
    assert!(out.contains("BANK_CARD       bytes"), "{out}");
    assert!(
        !out.contains('\x1b'),
        "no escape codes when not a TTY: {out:?}"
    );
}

#[test]
fn explain_shows_the_disclosure_cue_and_the_topic_frame() {
    let policy = example_policy();
    let p = policy.to_str().unwrap();
    let o = tandem(
        &[
            "route",
            "explain",
            "--policy",
            p,
            "Mi padre tiene cáncer de páncreas",
        ],
        "",
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("decision:   local"), "{out}");
    assert!(out.contains("term \"cáncer\""), "{out}");
    assert!(out.contains("cue \"Mi\""), "{out}");
    // The same term asked about in general: a topic, not a disclosure.
    let o = tandem(
        &[
            "route",
            "explain",
            "--policy",
            p,
            "Explain how cáncer cells divide, for a biology class",
        ],
        "",
    );
    let out = stdout(&o);
    assert!(out.contains("decision:   speculative"), "{out}");
    assert!(out.contains("frame:      topic"), "{out}");
}

#[test]
fn explain_shows_negation_and_hypothetical_frames() {
    // A denial in health: set aside, and explain says by what.
    let out = explain("I don't have diabetes. What is a normal fasting glucose level?");
    assert!(out.contains("decision:   speculative"), "{out}");
    assert!(out.contains("frames:"), "{out}");
    assert!(
        out.contains("term \"diabetes\" (bytes 13..21) set aside: denied by \"don't have\""),
        "{out}"
    );
    // A denial that still counts, and why.
    let out = explain("I'm not gay, but my coworkers keep asking");
    assert!(out.contains("decision:   local"), "{out}");
    assert!(out.contains("denied by \"I'm not\""), "{out}");
    assert!(
        out.contains("kept: a denial still discusses this category"),
        "{out}"
    );
    // A generic conditional, and the same with a cue of its own.
    let out = explain("What happens if someone is arrested for a DUI?");
    assert!(out.contains("decision:   speculative"), "{out}");
    assert!(
        out.contains("set aside: generic conditional \"if someone\""),
        "{out}"
    );
    let out = explain("假如我得了癌症，保险能赔多少？");
    assert!(out.contains("decision:   speculative"), "{out}");
    assert!(out.contains("set aside: hypothetical \"假如\""), "{out}");
    assert!(
        out.contains("its cue \"我\" (bytes 6..9) is the supposition's subject"),
        "{out}"
    );
    let out = explain("What happens if someone finds out about my HIV?");
    assert!(out.contains("decision:   local"), "{out}");
    assert!(out.contains("cue \"my\""), "{out}");
    assert!(out.contains("is not its subject"), "{out}");
    // JSON: offsets only.
    let o = explain_with(&["--json"], "I was never arrested.");
    let v = &json_lines(&o)[0];
    assert_eq!(v["decision"], "speculative");
    assert_eq!(v["frames"][0]["frame"], "negated");
    assert_eq!(v["frames"][0]["category"], "legal");
    assert_eq!(v["frames"][0]["marker"][0], 2);
    assert_eq!(v["frames"][0]["counted"], false);
    assert!(!stdout(&o).contains("arrested"), "{}", stdout(&o));
}

/// The frames block for the clause scope, a past statement in a
/// hypothetical's shape, and a list item's cue (docs/privacy.md "Clauses,
/// lists and tense").
#[test]
fn explain_shows_clause_scope_past_and_list_cues() {
    // The supposition's subject is no cue for the main clause's "律师".
    let out = explain("假设我被公司起诉了，需要请律师吗？");
    assert!(out.contains("decision:   speculative"), "{out}");
    assert!(out.contains("set aside: hypothetical \"假设\""), "{out}");
    // A past statement in a hypothetical's shape counts, and says why.
    let out = explain("If I had leukemia as a kid, would insurers still cover me?");
    assert!(out.contains("decision:   local"), "{out}");
    assert!(
        out.contains("kept: the clause tells of the past: a statement of fact"),
        "{out}"
    );
    // A list item takes its header's cue.
    let out = explain("My debts:\n- mortgage\n- car loan");
    assert!(out.contains("decision:   local"), "{out}");
    assert!(
        out.contains("term \"car loan\" (bytes 23..31), cue \"My\" (bytes 0..2)"),
        "{out}"
    );
    let o = explain_with(
        &["--json"],
        "If I had leukemia as a kid, would insurers still cover me?",
    );
    let v = &json_lines(&o)[0];
    assert_eq!(v["frames"][0]["frame"], "hypothetical_kept");
    assert_eq!(
        v["frames"][0]["kept_because"],
        "the clause tells of the past: a statement of fact"
    );
}

/// The frames block for a supposition's and a generic conditional's main
/// clause, Korean "제" as a cue, and a list header that names questions
/// (docs/privacy.md "Main clauses, Korean 제, question headers").
#[test]
fn explain_shows_main_clauses_korean_cues_and_question_headers() {
    let text = "If I had cancer, would my insurer pay for chemotherapy?";
    let out = explain(text);
    assert!(out.contains("decision:   speculative"), "{out}");
    assert!(
        out.contains(
            "term \"chemotherapy\" (bytes 42..54) set aside: main clause of hypothetical \"If I had\" (bytes 0..8) about \"cancer\" (bytes 9..15) (cue \"my\" (bytes 23..25)): its cue is an institution's possessive"
        ),
        "{out}"
    );
    let v = &json_lines(&explain_with(&["--json"], text))[0];
    let f = v["frames"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["frame"] == "consequent")
        .unwrap();
    assert_eq!(f["supposed"], serde_json::json!([9, 15]));
    assert_eq!(f["cue"], serde_json::json!([23, 25]));
    assert_eq!(f["counted"], false);
    // A real person's condition in the main clause counts, and says why.
    let out = explain("If I had cancer, would it matter that my mother has leukemia?");
    assert!(out.contains("decision:   local"), "{out}");
    assert!(
        out.contains("term \"leukemia\" (bytes 52..60), cue \"my\" (bytes 38..40)"),
        "{out}"
    );
    assert!(
        out.contains("counted: main clause of hypothetical \"If I had\""),
        "{out}"
    );
    // A generic conditional's main clause.
    let out = explain("如果有人酒驾被抓了，会被判刑吗？");
    assert!(out.contains("decision:   speculative"), "{out}");
    assert!(
        out.contains("set aside: main clause of generic conditional \"如果有人\""),
        "{out}"
    );
    // Korean "제" (my) is a cue of its own.
    let out = explain("제 빚은 3천만 원이에요");
    assert!(out.contains("decision:   local"), "{out}");
    assert!(
        out.contains("term \"빚\" (bytes 4..7), cue \"제\" (bytes 0..3)"),
        "{out}"
    );
    // A header that names questions lends its items no cue.
    let out = explain("My questions:\n- How does a mortgage work?");
    assert!(out.contains("decision:   speculative"), "{out}");
    assert!(
        out.contains(
            "term \"mortgage\" (bytes 27..35) not counted: its list header names questions (\"questions\" (bytes 3..12)), so the header's cue \"My\" (bytes 0..2) is not the items'"
        ),
        "{out}"
    );
}

#[test]
fn explain_colour_always_and_stdin_and_json() {
    let o = tandem(
        &["route", "explain", "--color", "always", "-"],
        "my password is hunter22",
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("\x1b[1;31mhunter22\x1b[0m"), "{out:?}");

    let o = tandem(&["route", "explain", "--json", "SSN 536-22-1234"], "");
    assert!(o.status.success(), "{}", stderr(&o));
    let v = &json_lines(&o)[0];
    assert_eq!(v["decision"], "local");
    assert_eq!(v["entities"][0]["type"], "US_SSN");
    assert_eq!(v["entities"][0]["start"], 4);
    assert_eq!(v["entities"][0]["end"], 15);
}

#[test]
fn check_accepts_the_example_policy() {
    let policy = example_policy();
    let o = tandem(&["route", "check", policy.to_str().unwrap()], "");
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.starts_with("ok: "), "{out}");
    assert!(out.contains("8 rule(s)"), "{out}");
}

#[test]
fn check_rejects_a_bad_policy_naming_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "default = \"speculative\"\n\n[[rules]]\nname = \"ids\"\naction = \"local\"\nentities = [\"CN_ID\"]\n",
    )
    .unwrap();
    let o = tandem(&["route", "check", bad.to_str().unwrap()], "");
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("bad.toml"), "{err}");
    assert!(err.contains("line 6"), "{err}");
    assert!(err.contains("rules[0].entities"), "{err}");
    assert!(err.contains("CN_ID"), "{err}");

    std::fs::write(&bad, "default = \"speculative\"\nmin_score = \"high\"\n").unwrap();
    let o = tandem(&["route", "check", bad.to_str().unwrap()], "");
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("line 2") && err.contains("min_score"), "{err}");

    let o = tandem(&["route", "check", "/nonexistent/policy.toml"], "");
    assert!(!o.status.success());
    assert!(stderr(&o).contains("/nonexistent/policy.toml"));
}

#[test]
fn classify_with_a_bad_policy_fails_before_reading_input() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("p.toml");
    std::fs::write(&bad, "default = \"cloud\"\n").unwrap();
    let o = tandem(
        &["route", "classify", "--policy", bad.to_str().unwrap()],
        "{\"id\":1,\"text\":\"x\"}\n",
    );
    assert!(!o.status.success());
    assert!(stdout(&o).is_empty());
    assert!(stderr(&o).contains("line 1"), "{}", stderr(&o));
}

/// A policy that asks the second opinion, written next to a tiny random
/// draft (with its tokenizer) in a temporary directory.
fn opinion_fixture(mode: &str) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(example_policy()).unwrap();
    let policy = dir.path().join("policy.toml");
    std::fs::write(
        &policy,
        src.replace("mode = \"off\"", &format!("mode = \"{mode}\"")),
    )
    .unwrap();
    let model = dir.path().join("draft.gguf");
    let cfg = tandem_model::testing::TinyConfig {
        tokenizer: true,
        ..tandem_model::testing::TinyConfig::draft_like()
    };
    tandem_model::testing::write_tiny_qwen2(&model, &cfg).unwrap();
    (dir, policy, model)
}

// A health term with no disclosure cue: the example policy keeps it local
// on the word alone, so the rules are unsure.
const NO_CUE: &str = "metformin dosing";

#[test]
fn explain_asks_the_draft_when_the_rules_are_unsure_and_shows_its_answer() {
    let (_dir, policy, model) = opinion_fixture("categories");
    let (p, m) = (policy.to_str().unwrap(), model.to_str().unwrap());
    let o = tandem(
        &[
            "route",
            "explain",
            "--policy",
            p,
            "--opinion-model",
            m,
            "--json",
            NO_CUE,
        ],
        "",
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v = &json_lines(&o)[0];
    let so = &v["second_opinion"];
    assert_eq!(so["mode"], "categories");
    assert_eq!(so["unsure"], "category without a cue: health");
    assert_eq!(so["asked"], true);
    assert_eq!(so["rules_decision"], "local");
    // The tiny model's answer is arbitrary but decides consistently: benign
    // lets it run speculative under the rule "second-opinion", sensitive
    // keeps the rules' decision.
    match so["answer"].as_str().unwrap() {
        "benign" => assert_eq!(
            (&v["decision"], &v["rule"]),
            (&"speculative".into(), &"second-opinion".into())
        ),
        "sensitive" => assert_eq!(v["decision"], "local"),
        other => panic!("answer {other}"),
    }
    assert!(so["margin"].as_f64().is_some() && so["ms"].as_f64().is_some());
    assert!(!stdout(&o).contains("metformin"), "the text in the JSON");
    // The human report says the same.
    let o = tandem(
        &[
            "route",
            "explain",
            "--policy",
            p,
            "--opinion-model",
            m,
            "--color",
            "never",
            NO_CUE,
        ],
        "",
    );
    let s = stdout(&o);
    assert!(
        s.contains("second opinion: asked (category without a cue: health)"),
        "{s}"
    );
    assert!(s.contains("answer "), "{s}");
}

#[test]
fn explain_says_when_the_second_opinion_is_not_asked() {
    let (_dir, policy, model) = opinion_fixture("on");
    let (p, m) = (policy.to_str().unwrap(), model.to_str().unwrap());
    // Sure: an ID with its checksum.
    let o = tandem(
        &[
            "route",
            "explain",
            "--policy",
            p,
            "--opinion-model",
            m,
            "--json",
            "我的身份证号是11010519491231002X",
        ],
        "",
    );
    let v = &json_lines(&o)[0];
    assert_eq!(v["second_opinion"]["asked"], false);
    assert_eq!(v["second_opinion"]["unsure"], Value::Null);
    // Unsure but no model given: says it would ask.
    let o = tandem(
        &[
            "route", "explain", "--policy", p, "--color", "never", NO_CUE,
        ],
        "",
    );
    let s = stdout(&o);
    assert!(
        s.contains("second opinion: would be asked (category without a cue: health)"),
        "{s}"
    );
    // The example policy as shipped: off.
    let ex = example_policy();
    let o = tandem(
        &[
            "route",
            "explain",
            "--policy",
            ex.to_str().unwrap(),
            "--color",
            "never",
            NO_CUE,
        ],
        "",
    );
    assert!(stdout(&o).contains("second opinion: off"), "{}", stdout(&o));
}
