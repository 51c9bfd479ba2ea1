//! `tandem demo` as a user runs it (the README's first command), on the real
//! models, shortened to 32 tokens per request: the four parts appear with
//! sane numbers (the generation and editing cases equal the target alone and
//! print their speed ratio), the ID number of part 3 is never printed (stdout
//! or logs), and the outage of part 4 falls back to provisional tokens and
//! recovers.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::process::Command;
use std::time::Instant;

const ID: &str = "11010519491231002X";

/// The number right before `word` in `line` ("48 verified" -> 48).
fn num_before(line: &str, word: &str) -> u64 {
    let words: Vec<&str> = line.split_whitespace().collect();
    let i = words
        .iter()
        .position(|w| w.trim_end_matches([',', ';', '(', ')']) == word)
        .unwrap_or_else(|| panic!("no {word:?} in {line:?}"));
    words[i - 1]
        .trim_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .unwrap_or_else(|_| panic!("no number before {word:?} in {line:?}"))
}

/// The first line of the demo's own output (not of generated text, which is
/// printed after `   | `) that contains `needle`.
fn line_with<'a>(out: &'a str, needle: &str) -> &'a str {
    out.lines()
        .filter(|l| !l.starts_with("   | "))
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("no line with {needle:?} in:\n{out}"))
}

#[test]
fn demo_shows_speculative_privacy_and_outage_with_sane_numbers() {
    let t0 = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        // One run of each side for the speeds (default 3, the median):
        // the speeds' figures are not this test's subject (CI time).
        .args(["demo", "--max-tokens", "32", "--speed-runs", "1"])
        .env("TANDEM_LOG", "info") // the logs must not carry the ID either
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    for part in ["[1/4]", "[2/4]", "[3/4]", "[4/4]", "== summary =="] {
        assert!(stdout.contains(part), "{part} missing:\n{stdout}");
    }

    // 1. speculative: every token verified, the target's own output.
    let l = line_with(&stdout, "tokens: ");
    let (n, v) = (num_before(l, "tokens:"), num_before(l, "verified"));
    assert!(n > 0 && n <= 32, "{l}");
    assert_eq!(v, n, "all verified: {l}");
    assert!(num_before(l, "rounds") >= 1, "{l}");
    let acc = num_before(l, "drafted");
    assert!(num_before(l, "of") <= acc && acc > 0, "{l}");
    assert!(
        stdout.contains("identical to the target model's own greedy output: yes"),
        "{stdout}"
    );
    // Both speculative cases print their speed beside the target alone's.
    let speeds: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("   speed: ") && l.contains("x (wall time"))
        .collect();
    assert_eq!(speeds.len(), 2, "{stdout}");
    assert!(
        speeds.iter().all(|l| l.contains("one run each")),
        "{stdout}"
    );
    assert_eq!(
        stdout
            .matches("identical to the target model's own greedy output: yes")
            .count(),
        2,
        "both cases equal the target's own output:\n{stdout}"
    );
    // 2. editing: auto proposes the copied code by prompt lookup.
    let edit = line_with(&stdout, "proposer auto:");
    let lookup_rounds: u64 = edit
        .split(" by prompt lookup")
        .next()
        .and_then(|s| s.rsplit(", ").next())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("{edit}"));
    assert!(lookup_rounds >= 1, "no lookup round: {edit}");
    let draft = line_with(&stdout, "proposer draft:");
    assert!(num_before(draft, "rounds") >= 1, "{draft}");
    let passes = line_with(&stdout, "target passes");
    let per_token: f64 = passes
        .split(" per token")
        .next()
        .and_then(|s| s.rsplit('(').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{passes}"));
    assert!(
        per_token > 0.0 && per_token < 1.0,
        "fewer target passes than tokens: {passes}"
    );

    // 2. privacy: local, with rule and entity type; nothing sent; ID never shown.
    let d = line_with(&stdout, "decision: ");
    assert!(d.contains("decision: local by rule"), "{d}");
    assert!(d.contains("CN_RESIDENT_ID"), "{d}");
    assert!(
        stdout.contains("bytes sent to the verifier: 0, new connections: 0"),
        "{stdout}"
    );
    assert!(stdout.contains("[CN_RESIDENT_ID]"), "masked prompt shown");
    assert!(!stdout.contains(ID), "the ID is printed:\n{stdout}");
    assert!(!stderr.contains(ID), "the ID is logged:\n{stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "ANSI escapes in logs to a pipe:\n{stderr:?}"
    );
    assert!(
        stderr.contains("routed"),
        "the decision is logged (without text): {stderr}"
    );

    // 3. outage: provisional tokens, all checked, then verified again.
    let l = line_with(&stdout, "(during the outage)");
    let prov = num_before(l, "provisional");
    assert!(prov >= 1, "{l}");
    assert!(num_before(l, "verified") >= 1, "verified before: {l}");
    let after = l
        .rsplit("then ")
        .next()
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap();
    assert!(after >= 1, "recovered: {l}");
    let c = line_with(&stdout, "provisional check:");
    assert!(
        c.contains(&format!("all {prov} provisional tokens checked"))
            || c.contains(&format!("of {prov} provisional tokens checked")),
        "{c}"
    );
    assert!(stdout.contains("[link down]") && stdout.contains("[link up]"));
    assert!(stdout.contains("verifier back: provisional tokens"));
    eprintln!(
        "tandem demo --max-tokens 32: {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

/// The demo takes any pair the user names (`--draft-model`/`--target-model`:
/// paths or names): SmolLM2-135M Q4_1 drafting for its own F16 copy (written
/// here, 64 padding rows added, as a bigger target's table may have), with
/// all four parts and the target's own output. A pair that cannot pair is
/// refused before anything starts, with the reason.
#[test]
fn demo_runs_on_a_pair_the_user_names_and_refuses_one_that_cannot_pair() {
    let models = std::env::var_os("TANDEM_MODELS_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/tandem/models")
        });
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("smollm2-f16.gguf");
    tandem_model::testing::write_dequantized(
        &models.join("SmolLM2-135M-Instruct.Q4_1.gguf"),
        &target,
        candle_core::quantized::GgmlDType::F16,
        64,
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["demo", "--max-tokens", "24", "--speed-runs", "1"])
        .args(["--draft-model", "smollm2"])
        .arg("--target-model")
        .arg(&target)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    // The models are named by their GGUF's general.name ("Smollm2 135M ...").
    assert!(
        stdout
            .to_lowercase()
            .contains("a draft model on this device (smollm2"),
        "{stdout}"
    );
    for part in ["[1/4]", "[2/4]", "[3/4]", "[4/4]", "== summary =="] {
        assert!(stdout.contains(part), "{part} missing:\n{stdout}");
    }
    assert!(
        stdout.contains("identical to the target model's own greedy output: yes"),
        "{stdout}"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["demo", "--draft-model", "gemma", "--target-model", "draft"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success());
    assert!(
        stderr.contains("cannot pair") && stderr.contains("vocabularies differ"),
        "{stderr}"
    );
    assert!(!stderr.contains("[1/4]"), "refused before the demo starts");
}
