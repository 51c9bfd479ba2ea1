//! Policy loading (good and broken files), rule semantics, hot reload,
//! conversation stickiness and the no-text-in-decisions guarantee.

#![allow(clippy::unwrap_used)] // test helpers; a panic is a test failure

use std::path::PathBuf;
use std::sync::Arc;

use tandem_router::{Action, Conversation, Policy, PolicyError, RouteContext, Router};

fn example_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/policy.example.toml")
}

fn idle() -> RouteContext {
    RouteContext::default()
}

const MINIMAL: &str = r#"
default = "speculative"

[[rules]]
name = "ids"
action = "local"
entities = ["CN_RESIDENT_ID"]
"#;

#[test]
fn shipped_policies_load() {
    let p = Policy::from_file(example_path()).unwrap();
    assert!(p.rules().len() >= 5);
    assert!(p.categories().iter().any(|c| c == "internal"));
    let d = Policy::builtin_default();
    assert_eq!(d.default_action(), Action::Speculative);
}

fn err(src: &str) -> PolicyError {
    match Policy::from_toml_str(src) {
        Ok(_) => panic!("policy should have been rejected:\n{src}"),
        Err(e) => e,
    }
}

#[test]
fn syntax_error_names_the_line() {
    let e = err("default = \"speculative\"\n\n[[rules]\nname = \"x\"\n");
    assert_eq!(e.line(), Some(3), "{e}");
    assert!(e.to_string().starts_with("line 3"), "{e}");
}

#[test]
fn unknown_field_names_line_and_field() {
    let src = "default = \"speculative\"\n[[rules]]\nname = \"x\"\nacton = \"local\"\n";
    let e = err(src);
    assert_eq!(e.line(), Some(4), "{e}");
    let s = e.to_string();
    assert!(s.contains("acton"), "{s}");
}

#[test]
fn wrong_type_names_line_and_field() {
    let e = err("default = \"speculative\"\nmin_score = \"high\"\n");
    assert_eq!(e.line(), Some(2), "{e}");
    assert_eq!(e.field(), Some("min_score"), "{e}");
}

#[test]
fn bad_action_value() {
    let e = err("default = \"cloud\"\n");
    assert_eq!(e.line(), Some(1), "{e}");
    assert!(e.to_string().contains("local"), "{e}");
}

#[test]
fn unknown_entity_names_rule_field_and_line() {
    let src = "default = \"speculative\"\n\n[[rules]]\nname = \"a\"\naction = \"local\"\nentities = [\"EMAIL\", \"BANKCARD\"]\n";
    let e = err(src);
    assert_eq!(e.line(), Some(6), "{e}");
    assert_eq!(e.field(), Some("rules[0].entities"));
    assert!(e.to_string().contains("BANKCARD"), "{e}");
    assert!(
        e.to_string().contains("BANK_CARD"),
        "lists known kinds: {e}"
    );
}

#[test]
fn semantic_errors_are_located() {
    let cases: &[(&str, usize, &str)] = &[
        ("default = \"local\"\nmin_score = 1.5\n", 2, "min_score"),
        ("default = \"local\"\n[thresholds]\nEMAIL = 0.5\nNOPE = 0.5\n", 4, "thresholds.NOPE"),
        ("default = \"local\"\n[thresholds]\nEMAIL = -0.1\n", 3, "thresholds.EMAIL"),
        (
            "default = \"local\"\n[[recognizers]]\nname = \"EMP\"\npattern = 'EMP-(\\d+'\n",
            4,
            "recognizers[0].pattern",
        ),
        (
            "default = \"local\"\n[[recognizers]]\nname = \"EMP\"\npattern = 'x'\nvalidator = \"crc\"\n",
            5,
            "recognizers[0].validator",
        ),
        (
            "default = \"local\"\n[[recognizers]]\nname = \"EMAIL\"\npattern = 'x'\n",
            3,
            "recognizers[0].name",
        ),
        (
            "default = \"local\"\n[[recognizers]]\nname = \"emp_id\"\npattern = 'x'\n",
            3,
            "recognizers[0].name",
        ),
        (
            "default = \"local\"\n[[rules]]\nname = \"a\"\naction = \"local\"\n[[rules]]\nname = \"a\"\naction = \"local\"\n",
            6,
            "rules[1].name",
        ),
        (
            "default = \"local\"\n[[rules]]\nname = \"a\"\naction = \"local\"\ncategories = [\"helth\"]\n",
            5,
            "rules[0].categories",
        ),
        (
            "default = \"local\"\n[allow]\npatterns = ['ok', '(']\n",
            3,
            "allow.patterns[1]",
        ),
        ("version = 2\ndefault = \"local\"\n", 1, "version"),
    ];
    for (src, line, field) in cases {
        let e = err(src);
        assert_eq!(e.line(), Some(*line), "{src}\n=> {e}");
        assert_eq!(e.field(), Some(*field), "{src}\n=> {e}");
    }
}

#[test]
fn file_errors_carry_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.toml");
    std::fs::write(&p, "default = 3\n").unwrap();
    let e = Policy::from_file(&p).unwrap_err();
    assert!(e.to_string().contains("bad.toml"), "{e}");
    assert_eq!(e.line(), Some(1));
    let e = Policy::from_file(dir.path().join("missing.toml")).unwrap_err();
    assert!(e.to_string().contains("missing.toml"), "{e}");
}

#[test]
fn first_matching_rule_wins_and_default_applies() {
    let p = Policy::from_toml_str(
        r#"
default = "speculative"
[[rules]]
name = "cards-first"
action = "local"
entities = ["BANK_CARD"]
[[rules]]
name = "anything"
action = "local"
entities = ["*"]
"#,
    )
    .unwrap();
    let d = p.decide("card 4539 1488 0343 6467 mail a.b@gmail.com", &idle());
    assert_eq!((d.action, d.rule.as_str()), (Action::Local, "cards-first"));
    let d = p.decide("mail a.b@gmail.com", &idle());
    assert_eq!(d.rule, "anything");
    let d = p.decide("fn main() {}", &idle());
    assert_eq!(
        (d.action, d.rule.as_str()),
        (Action::Speculative, "default")
    );
}

#[test]
fn network_and_device_conditions() {
    let p = Policy::from_file(example_path()).unwrap();
    let text = "write a quicksort in rust";
    let d = p.decide(text, &idle());
    assert_eq!(d.action, Action::Speculative);
    let down = RouteContext {
        breaker_open: true,
        ..idle()
    };
    assert_eq!(p.decide(text, &down).rule, "verifier-down");
    let slow = RouteContext {
        rtt_ms: Some(2000.0),
        ..idle()
    };
    assert_eq!(p.decide(text, &slow).rule, "slow-network");
    let fast = RouteContext {
        rtt_ms: Some(20.0),
        ..idle()
    };
    assert_eq!(p.decide(text, &fast).rule, "default");
    let opt_out = RouteContext {
        user_opt_out: true,
        ..idle()
    };
    assert_eq!(p.decide(text, &opt_out).rule, "user-opt-out");
    let low = RouteContext {
        battery_pct: Some(5),
        ..idle()
    };
    assert_eq!(p.decide(text, &low).rule, "low-battery");
    let hot = Policy::from_toml_str(
        "default = \"speculative\"\n[[rules]]\nname = \"hot\"\naction = \"local\"\nthermal_at_least = 2\n",
    )
    .unwrap();
    let t = |lvl| RouteContext {
        thermal_level: lvl,
        ..idle()
    };
    assert_eq!(hot.decide(text, &t(Some(3))).rule, "hot");
    assert_eq!(hot.decide(text, &t(Some(1))).rule, "default");
    assert_eq!(hot.decide(text, &t(None)).rule, "default");
}

#[test]
fn thresholds_and_rule_min_score() {
    // The bare CN mobile scores 0.4 without context: below 0.5, above 0.3.
    let text = "x = 13912345678";
    let strict = Policy::from_toml_str(MINIMAL).unwrap();
    assert!(strict.decide(text, &idle()).entities.is_empty());
    let loose = Policy::from_toml_str(
        "default = \"speculative\"\n[thresholds]\nPHONE = 0.3\n[[rules]]\nname = \"p\"\naction = \"local\"\nentities = [\"PHONE\"]\n",
    )
    .unwrap();
    assert_eq!(loose.decide(text, &idle()).rule, "p");
    let rule_min = Policy::from_toml_str(
        "default = \"speculative\"\n[thresholds]\nPHONE = 0.3\n[[rules]]\nname = \"p\"\naction = \"local\"\nentities = [\"PHONE\"]\nmin_score = 0.9\n",
    )
    .unwrap();
    assert_eq!(rule_min.decide(text, &idle()).rule, "default");
}

#[test]
fn allow_list_values_and_patterns() {
    let src = r#"
default = "speculative"
[allow]
values = ["4539-1488-0343-6467"]
patterns = ['@corp\.cn$']
[[rules]]
name = "any"
action = "local"
entities = ["*"]
"#;
    let p = Policy::from_toml_str(src).unwrap();
    assert_eq!(
        p.decide("card 4539 1488 0343 6467", &idle()).rule,
        "default"
    );
    assert_eq!(p.decide("mail li.na@corp.cn", &idle()).rule, "default");
    assert_eq!(p.decide("mail li.na@gmail.com", &idle()).rule, "any");
}

#[test]
fn keywords_extend_and_create_categories() {
    let src = r#"
default = "speculative"
[keywords]
health = ["long covid"]
internal = ["project bluebird", "蓝鸟计划"]
[[rules]]
name = "internal"
action = "local"
categories = ["internal"]
[[rules]]
name = "health"
action = "local"
categories = ["health"]
"#;
    let p = Policy::from_toml_str(src).unwrap();
    assert_eq!(
        p.decide("status of Project Bluebird?", &idle()).rule,
        "internal"
    );
    assert_eq!(p.decide("蓝鸟计划进展", &idle()).rule, "internal");
    assert_eq!(p.decide("I still have long covid", &idle()).rule, "health");
    assert_eq!(p.decide("a blue bird", &idle()).rule, "default");
}

#[test]
fn keywords_take_the_personal_and_benign_markers() {
    let src = r#"
default = "speculative"
[keywords]
internal = ["~ bluebird", "! bluebird sdk", "蓝鸟计划"]
[[rules]]
name = "internal"
action = "local"
categories = ["internal"]
"#;
    let p = Policy::from_toml_str(src).unwrap();
    // `~`: only with a first-person marker near it.
    assert_eq!(p.decide("my bluebird numbers", &idle()).rule, "internal");
    assert_eq!(p.decide("what is bluebird?", &idle()).rule, "default");
    // `!`: a benign sense that hides the term.
    assert_eq!(p.decide("my bluebird sdk upgrade", &idle()).rule, "default");
    assert_eq!(p.decide("蓝鸟计划进展", &idle()).rule, "internal");
    let err = Policy::from_toml_str("default = \"speculative\"\n[keywords]\ninternal = [\"~ \"]\n")
        .unwrap_err();
    assert!(err.to_string().contains("empty keyword"), "{err}");
}

#[test]
fn custom_recognizer_with_validator_and_context() {
    let src = r#"
default = "speculative"
[[recognizers]]
name = "LOYALTY_CARD"
pattern = 'LC[0-9]{11}'
score = 0.4
validator = "luhn"
context = ["loyalty", "会员"]
[[recognizers]]
name = "BADGE"
pattern = 'B-[0-9]{4}'
score = 0.6
context = ["badge"]
context_required = true
[[rules]]
name = "custom"
action = "local"
entities = ["LOYALTY_CARD", "BADGE"]
"#;
    let p = Policy::from_toml_str(src).unwrap();
    // LC + 11 digits: 79927398713 is Luhn-valid, 79927398710 is not.
    let d = p.decide("loyalty LC79927398713", &idle());
    assert_eq!(d.rule, "custom");
    assert_eq!(d.entities[0].kind.as_str(), "LOYALTY_CARD");
    assert!((d.entities[0].score - 0.7).abs() < 1e-6);
    assert_eq!(p.decide("LC79927398713", &idle()).rule, "default"); // 0.4 < 0.5
    assert_eq!(p.decide("loyalty LC79927398710", &idle()).rule, "default"); // Luhn fails
    assert_eq!(p.decide("badge B-1234", &idle()).rule, "custom");
    assert_eq!(p.decide("room B-1234", &idle()).rule, "default");
}

#[test]
fn decisions_never_contain_the_text() {
    let router = Router::from_file(example_path()).unwrap();
    let secrets = [
        "11010519491231002X",
        "4539 1488 0343 6467",
        "q8Zr!x2LwP0v#Kd9",
        "张伟",
        "wangxiaoming88@163.com",
    ];
    let text = format!(
        "我叫{}，身份证{}，card {}，邮箱 {}，password = \"{}\"",
        secrets[3], secrets[0], secrets[1], secrets[4], secrets[2]
    );
    let d = router.decide(&text, &idle());
    assert_eq!(d.action, Action::Local);
    assert_eq!(d.entities.len(), 5, "{d}");
    let shown = [
        format!("{d}"),
        format!("{d:?}"),
        serde_json_like(&d),
        format!("{:?}", router.policy()),
        format!("{:?}", router.stats()),
    ];
    for s in &shown {
        for secret in secrets {
            assert!(!s.contains(secret), "{secret} leaked into {s}");
        }
    }
}

fn serde_json_like(d: &tandem_router::Decision) -> String {
    serde_json::to_string(d).unwrap()
}

#[test]
fn reload_swaps_only_valid_policies() {
    let router = Router::from_toml_str(MINIMAL).unwrap();
    let text = "mail li.na@gmail.com";
    assert_eq!(router.decide(text, &idle()).rule, "default");
    assert_eq!(router.generation(), 1);

    let before = router.policy();
    let e = router.reload_from_str("default = \"local\"\n[[rules]]\nname = 1\n");
    assert!(e.is_err());
    assert_eq!(router.generation(), 1);
    assert!(
        Arc::ptr_eq(&before, &router.policy()),
        "old policy keeps serving"
    );
    assert_eq!(router.decide(text, &idle()).rule, "default");

    let g = router
        .reload_from_str("default = \"speculative\"\n[[rules]]\nname = \"mail\"\naction = \"local\"\nentities = [\"EMAIL\"]\n")
        .unwrap();
    assert_eq!(g, 2);
    assert_eq!(router.decide(text, &idle()).rule, "mail");

    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("p.toml");
    std::fs::write(&f, "default = \"local\"\n").unwrap();
    assert_eq!(router.reload_from_file(&f).unwrap(), 3);
    assert_eq!(router.decide("hello", &idle()).action, Action::Local);
    std::fs::write(&f, "default = \"nowhere\"\n").unwrap();
    assert!(router.reload_from_file(&f).is_err());
    assert_eq!(router.generation(), 3);
    assert_eq!(router.decide("hello", &idle()).action, Action::Local);
}

#[test]
fn readers_see_a_whole_policy_during_reloads() {
    let a = "default = \"local\"\n";
    let b = "default = \"speculative\"\n";
    let router = Arc::new(Router::from_toml_str(a).unwrap());
    let reader = {
        let r = Arc::clone(&router);
        std::thread::spawn(move || {
            let mut seen = [0u32; 2];
            for _ in 0..2000 {
                match r.decide("hi", &RouteContext::default()).action {
                    Action::Local => seen[0] += 1,
                    Action::Speculative => seen[1] += 1,
                }
            }
            seen
        })
    };
    for i in 0..200 {
        router
            .reload_from_str(if i % 2 == 0 { b } else { a })
            .unwrap();
        assert!(router.reload_from_str("default = 7").is_err());
    }
    let seen = reader.join().unwrap();
    assert_eq!(seen[0] + seen[1], 2000);
    assert_eq!(router.generation(), 201);
    assert_eq!(router.stats().total, 2000);
}

#[test]
fn conversation_sticks_after_content_local() {
    let router = Router::from_file(example_path()).unwrap();
    let mut conv = Conversation::new();
    let d1 = conv.decide_turn(&router, "how do I reverse a list in python?", &idle());
    assert_eq!(d1.action, Action::Speculative);
    let d2 = conv.decide_turn(&router, "我最近被确诊为糖尿病", &idle());
    assert_eq!(
        (d2.action, d2.rule.as_str()),
        (Action::Local, "sensitive-topics")
    );
    let d3 = conv.decide_turn(&router, "now sort it descending", &idle());
    assert_eq!(d3.action, Action::Local);
    assert_eq!(d3.rule, "sticky:sensitive-topics");
    assert_eq!(conv.pinned_by(), Some("sensitive-topics"));
}

#[test]
fn network_local_does_not_stick() {
    let router = Router::from_file(example_path()).unwrap();
    let mut conv = Conversation::new();
    let down = RouteContext {
        breaker_open: true,
        ..idle()
    };
    assert_eq!(
        conv.decide_turn(&router, "hello", &down).rule,
        "verifier-down"
    );
    assert!(!conv.is_pinned_local());
    assert_eq!(
        conv.decide_turn(&router, "hello again", &idle()).action,
        Action::Speculative
    );
}

#[test]
fn stateless_history_stays_local_when_sensitive_turn_came_first() {
    let router = Router::from_file(example_path()).unwrap();
    let msgs = [
        "my ssn is 536-22-1234, file my taxes",
        "ok",
        "and now a haiku",
    ];
    let d = router.decide_messages(&msgs, &idle()).unwrap();
    assert_eq!(d.action, Action::Local);
    assert_eq!(d.rule, "sticky:identifiers");
    let d = router
        .decide_messages(&["a haiku", "about autumn"], &idle())
        .unwrap();
    assert_eq!(d.action, Action::Speculative);
    assert!(router.decide_messages(&[], &idle()).is_none());
}

#[test]
fn stats_count_by_rule_and_action() {
    let router = Router::from_file(example_path()).unwrap();
    router.decide("hello", &idle());
    router.decide("hello", &idle());
    router.decide("SSN 536-22-1234", &idle());
    let s = router.stats();
    assert_eq!((s.total, s.local, s.speculative), (3, 1, 2));
    assert_eq!(s.by_rule["default"]["speculative"], 2);
    assert_eq!(s.by_rule["identifiers"]["local"], 1);
}
