//! `dev.tandem.TandemRuntime` (and `Conversation`) as an app uses them: the Java sources
//! (`jni/java/`) and the check program `tests/java/TandemRuntimeCheck.java`
//! compiled with `javac`, run on this machine's JVM (`java -Xcheck:jni`)
//! against the `libtandem_jni` cdylib cargo built next to this test, on the
//! real draft model:
//!
//! * local mode: the streamed pieces (text and status) equal, piece for
//!   piece, what the C ABI streams for the same config and prompt, and the
//!   text is the draft's own greedy output, every piece `LOCAL`;
//! * against a loopback verifier (in-process `tandem_verifier::start`, real
//!   1.5B target): the same comparison with the C ABI, the text is the
//!   target's own greedy output (the invariant), every piece `VERIFIED`;
//! * the life cycle: a C ABI error as `TandemException` with its status and
//!   message, cancel from another thread (exact stop point) and `BUSY`
//!   meanwhile, a callback's exception propagating, `close` from the
//!   callback refused, `close` during a generation (cancels and waits), use
//!   after close an `IllegalStateException`, a second close harmless;
//! * a conversation: two turns stream what the C ABI's conversation streams,
//!   piece for piece, and the second reuses the first's draft KV; send or
//!   close from its own callback, use after close and after the runtime's
//!   close are `IllegalStateException`s; per-call sampling: invalid is
//!   `INVALID_ARGUMENT` and leaves the history empty, seeded reproduces.
//!
//! The Java program's output is printed (run with `--nocapture` to see it).
//! Generations are at most 12 tokens (64 where they are cancelled early). The
//! tests take a lock (one model run at a time on 2 cores).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use tandem_capi::{TandemRuntime, TandemStats, TandemStatus, TandemTokenStatus};
use tandem_model::kv_cache::KvPrecision;
use tandem_model::speculative::{generate_single_with, GenerateConfig};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::{LoadOptions, Model};

const N: usize = 12;
const PROMPT: &str = "Write a Python function that adds two numbers.";

fn serial() -> MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    M.lock().unwrap_or_else(|p| p.into_inner())
}

fn draft_path() -> PathBuf {
    tandem_fetch::model_path(tandem_fetch::ModelRole::Draft)
}

/// `libtandem_jni.so` as this test run built it (`target/<profile>/deps`,
/// next to this test binary; the copy one level up only `cargo build`
/// refreshes).
fn native_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let name = format!(
        "{}tandem_jni{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    for d in [deps, deps.parent().unwrap()] {
        if d.join(&name).exists() {
            return d.join(&name);
        }
    }
    panic!("{name} not found next to {}", exe.display());
}

/// The Java class and the check program, compiled once per test process.
fn classes() -> &'static Path {
    static C: OnceLock<PathBuf> = OnceLock::new();
    C.get_or_init(|| {
        let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("java-classes");
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir_all(&out).unwrap();
        let mut sources: Vec<PathBuf> = std::fs::read_dir(crate_dir.join("java/dev/tandem"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "java"))
            .collect();
        sources.sort();
        sources.push(crate_dir.join("tests/java/TandemRuntimeCheck.java"));
        let o = Command::new("javac")
            .args(["-Xlint:all", "-Werror", "--release", "17", "-d"])
            .arg(&out)
            .args(&sources)
            .output()
            .unwrap_or_else(|e| panic!("running javac (install a JDK: .ci/run does): {e}"));
        assert!(
            o.status.success(),
            "javac failed:\n{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        out
    })
}

/// Runs the check program; returns its stdout (printed) after checking the
/// exit status and that `-Xcheck:jni` found nothing to complain about.
fn java(args: &[&str]) -> String {
    let t0 = Instant::now();
    let o = Command::new("java")
        .arg("-Xcheck:jni")
        .arg(format!(
            "-Ddev.tandem.library={}",
            native_library().display()
        ))
        .arg("-cp")
        .arg(classes())
        .arg("TandemRuntimeCheck")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running java: {e}"));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    println!(
        "$ java -Xcheck:jni -Ddev.tandem.library=.../libtandem_jni.so TandemRuntimeCheck {} ({:.1} s)\n{out}",
        args.iter()
            .map(|a| format!("{a:?}"))
            .collect::<Vec<_>>()
            .join(" "),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        o.status.success(),
        "java failed: {:?}\n{out}\n{err}",
        o.status
    );
    assert!(
        !err.contains("WARNING in native method") && !err.contains("FATAL ERROR"),
        "-Xcheck:jni complained:\n{err}"
    );
    out
}

fn line<'a>(out: &'a str, prefix: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line in\n{out}"))
}

/// The `piece STATUS HEX` lines: (status name, text).
fn java_pieces(out: &str) -> Vec<(String, String)> {
    prefixed_pieces(out, "piece ")
}

/// The `PREFIX STATUS HEX` lines: (status name, text).
fn prefixed_pieces(out: &str, prefix: &str) -> Vec<(String, String)> {
    out.lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .map(|l| {
            let (status, hex) = l.split_once(' ').unwrap_or((l, ""));
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            (status.to_string(), String::from_utf8(bytes).unwrap())
        })
        .collect()
}

fn status_name(s: TandemTokenStatus) -> &'static str {
    match s {
        TandemTokenStatus::Verified => "VERIFIED",
        TandemTokenStatus::Local => "LOCAL",
        TandemTokenStatus::Provisional => "PROVISIONAL",
    }
}

unsafe extern "C" fn collect(
    piece: *const c_char,
    len: usize,
    status: TandemTokenStatus,
    user: *mut c_void,
) -> bool {
    // SAFETY: user is the Vec passed below; the piece is `len` valid bytes.
    unsafe {
        let v = &mut *(user as *mut Vec<(String, String)>);
        let bytes = std::slice::from_raw_parts(piece as *const u8, len);
        v.push((
            status_name(status).to_string(),
            String::from_utf8(bytes.to_vec()).unwrap(),
        ));
    }
    true
}

/// A C ABI runtime of `config` (in this process, through the same
/// `extern "C"` functions the JNI glue calls); the caller frees it.
fn c_runtime(config: &Path) -> *mut TandemRuntime {
    let config = CString::new(config.to_str().unwrap()).unwrap();
    let mut rt: *mut TandemRuntime = std::ptr::null_mut();
    let mut err: *mut c_char = std::ptr::null_mut();
    // SAFETY: a valid string and out-pointers; the message is read only on
    // failure, when the library set it.
    unsafe {
        let s =
            tandem_capi::tandem_runtime_new(config.as_ptr(), std::ptr::null(), &mut rt, &mut err);
        assert_eq!(s, TandemStatus::Ok, "{:?}", CStr::from_ptr(err));
    }
    rt
}

/// What the C ABI streams for the same config and prompt (in this process,
/// through the same `extern "C"` functions the JNI glue calls).
fn c_abi_pieces(config: &Path, prompt: &str, max_tokens: u32) -> (Vec<(String, String)>, u64) {
    let prompt = CString::new(prompt).unwrap();
    let rt = c_runtime(config);
    let mut err: *mut c_char = std::ptr::null_mut();
    let mut pieces: Vec<(String, String)> = Vec::new();
    // SAFETY: a live runtime, valid strings and out-pointers; the callback
    // gets the Vec.
    unsafe {
        let mut stats = std::mem::MaybeUninit::<TandemStats>::uninit();
        let s = tandem_capi::tandem_generate(
            rt,
            prompt.as_ptr(),
            max_tokens,
            Some(collect),
            &mut pieces as *mut _ as *mut c_void,
            stats.as_mut_ptr(),
            &mut err,
        );
        assert_eq!(s, TandemStatus::Ok);
        let generated = stats.assume_init().generated_tokens;
        tandem_capi::tandem_runtime_free(rt);
        (pieces, generated)
    }
}

/// What the C ABI streams for a conversation of `messages` (one turn each)
/// on `config`: the pieces per turn, and each turn's draft_reused_tokens.
fn c_abi_conversation(
    config: &Path,
    messages: &[&str],
    max_tokens: u32,
) -> Vec<(Vec<(String, String)>, u64)> {
    let rt = c_runtime(config);
    let mut err: *mut c_char = std::ptr::null_mut();
    let mut turns = Vec::new();
    // SAFETY: a live runtime, valid strings and out-pointers; the callback
    // gets the Vec; the conversation is freed before its runtime.
    unsafe {
        let mut c = std::ptr::null_mut();
        let s = tandem_capi::tandem_conversation_new(rt, &mut c, &mut err);
        assert_eq!(s, TandemStatus::Ok);
        for m in messages {
            let m = CString::new(*m).unwrap();
            let mut pieces: Vec<(String, String)> = Vec::new();
            let mut stats = std::mem::MaybeUninit::<TandemStats>::uninit();
            let s = tandem_capi::tandem_conversation_send(
                rt,
                c,
                m.as_ptr(),
                max_tokens,
                Some(collect),
                &mut pieces as *mut _ as *mut c_void,
                stats.as_mut_ptr(),
                &mut err,
            );
            assert_eq!(s, TandemStatus::Ok);
            turns.push((pieces, stats.assume_init().draft_reused_tokens));
        }
        tandem_capi::tandem_conversation_free(rt, c);
        tandem_capi::tandem_runtime_free(rt);
    }
    turns
}

/// Greedy output of `model` alone for the chat prompt, decoded.
fn greedy_text(model: &Model, prompt: &str, n: usize, kv: KvPrecision) -> String {
    let tok = Tokenizer::from_gguf(model.gguf()).unwrap();
    let ids = tok.encode_chat(&[ChatMessage::user(prompt)], true).unwrap();
    let cfg = GenerateConfig {
        max_tokens: n,
        stop_tokens: tok.chat_stop_tokens(),
        ..GenerateConfig::default()
    };
    let g = generate_single_with(model, kv, &ids, &cfg, &mut |_| true).unwrap();
    tok.decode(&g.tokens, true).unwrap()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn local_config(dir: &Path) -> PathBuf {
    write(
        dir,
        "local.toml",
        &format!("draft_model = {:?}\nmax_seq_len = 512\n", draft_path()),
    )
}

/// Java's pieces = the C ABI's (text and status, piece for piece), all with
/// `status`; returns the text.
fn same_as_c_abi(out: &str, config: &Path, status: &str) -> String {
    let java = java_pieces(out);
    let (c, generated) = c_abi_pieces(config, PROMPT, N as u32);
    assert_eq!(generated, N as u64);
    assert_eq!(java, c, "Java's pieces must be the C ABI's");
    assert!(java.iter().all(|(s, _)| s == status), "{java:?}");
    java.iter().map(|(_, t)| t.as_str()).collect()
}

#[test]
fn local_mode_streams_what_the_c_abi_streams_the_drafts_greedy_output() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let config = local_config(dir.path());
    let out = java(&[
        "generate",
        config.to_str().unwrap(),
        "-",
        PROMPT,
        &N.to_string(),
    ]);
    assert_eq!(line(&out, "version "), env!("CARGO_PKG_VERSION"));
    let text = same_as_c_abi(&out, &config, "LOCAL");
    let draft = Model::load(draft_path(), LoadOptions::with_max_seq_len(512)).unwrap();
    let kv = GenerateConfig::default().draft_kv;
    assert_eq!(text, greedy_text(&draft, PROMPT, N, kv));
    let stats = line(&out, "stats ");
    assert!(
        stats.starts_with("route=LOCAL_NO_VERIFIER stop=MAX_TOKENS prompt=")
            && stats.contains(&format!(
                "generated={N} verified=0 provisional=0 local={N} "
            )),
        "{stats}"
    );
    // stats() after the generation = what generate returned (but timings).
    let again = line(&out, "stats_again ");
    assert_eq!(again, stats);
    assert!(line(&out, "json ").contains("\"route\":\"local_no_verifier\""));
    assert!(out.lines().any(|l| l == "closed"), "{out}");
}

#[test]
fn against_a_loopback_verifier_pieces_are_verified_and_the_targets_own_output() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let token = "jni-test-device-token-0123456789";
    let vcfg: tandem_verifier::VerifierConfig = toml::from_str(&format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nmodel_path = {:?}\n\
         max_seq_len = 512\ninsecure_loopback = true\n[[devices]]\nid = \"app\"\ntoken = \"{token}\"\n[limits]\nmax_prompt_tokens = 400\n",
        tandem_fetch::model_path(tandem_fetch::ModelRole::Target)
    ))
    .unwrap();
    let v = rt.block_on(tandem_verifier::start(vcfg)).unwrap();
    // The models directory the app passes: the config names the draft by
    // file name only.
    let draft = draft_path();
    let config = write(
        dir.path(),
        "remote.toml",
        &format!(
            "draft_model = {:?}\nmax_seq_len = 512\n[edge]\nverifier_url = \"http://127.0.0.1:{}\"\n\
             token = \"{token}\"\nk = 4\n",
            draft.to_str().unwrap(),
            v.grpc_addr.port()
        ),
    );
    let out = java(&[
        "generate",
        config.to_str().unwrap(),
        "-",
        PROMPT,
        &N.to_string(),
    ]);
    let text = same_as_c_abi(&out, &config, "VERIFIED");
    assert_eq!(
        text,
        greedy_text(&v.state.model, PROMPT, N, KvPrecision::F32),
        "verified output must be the target's own"
    );
    let stats = line(&out, "stats ");
    assert!(
        stats.starts_with("route=SPECULATIVE stop=MAX_TOKENS")
            && stats.contains(&format!("generated={N} verified={N} provisional=0 local=0")),
        "{stats}"
    );
    assert!(line(&out, "json ").contains("\"route\":\"speculative\""));

    // The models directory argument: a config naming the draft by its
    // built-in name (`draft`), resolved in the directory the app passes.
    let by_name = write(
        dir.path(),
        "by-name.toml",
        &format!(
            "draft_model = \"draft\"\nmax_seq_len = 512\n[edge]\nverifier_url = \"http://127.0.0.1:{}\"\n\
             token = \"{token}\"\nk = 4\n",
            v.grpc_addr.port()
        ),
    );
    let models_dir = draft.parent().unwrap().to_str().unwrap();
    let out = java(&[
        "generate",
        by_name.to_str().unwrap(),
        models_dir,
        PROMPT,
        "4",
    ]);
    let four: String = java_pieces(&out).into_iter().map(|(_, t)| t).collect();
    assert!(
        text.starts_with(&four) && !four.is_empty(),
        "{four:?} vs {text:?}"
    );
    rt.block_on(v.shutdown()).unwrap();
}

#[test]
fn errors_cancel_busy_callback_exceptions_and_close() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let config = local_config(dir.path());
    let out = java(&["lifecycle", config.to_str().unwrap(), PROMPT]);
    // A C ABI error: its status and its message, naming the file.
    let e = line(&out, "missing_config ");
    assert!(
        e.starts_with("TandemException IO: reading the config") && e.contains(".missing"),
        "{e}"
    );
    assert_eq!(
        line(&out, "stats_before "),
        "TandemException NO_GENERATION: no generation has finished on this runtime yet"
    );
    assert_eq!(
        line(&out, "empty_prompt "),
        "TandemException INVALID_ARGUMENT: prompt is empty"
    );
    assert_eq!(
        line(&out, "negative_max "),
        "IllegalArgumentException: maxTokens must be >= 0, got -1"
    );
    // Cancel from another thread: the callback waited at its 3rd piece, so
    // the runtime stopped right after it; a second generate meanwhile: BUSY.
    assert!(
        line(&out, "busy ").starts_with("TandemException BUSY: "),
        "{out}"
    );
    let c = line(&out, "cancel ");
    assert!(
        c.starts_with("stop=CANCELLED generated=3 pieces=3")
            || c.starts_with("stop=CANCELLED generated=4 pieces=3"),
        "{c}"
    );
    assert!(c.ends_with("statuses=[LOCAL, LOCAL, LOCAL]"), "{c}");
    // The earlier cancel (and one while nothing ran) does not reach it.
    assert_eq!(line(&out, "second "), "stop=MAX_TOKENS generated=4");
    // setDeviceState reaches the runtime as the C ABI's does (capi's
    // c_program test: the same state, the same adjustments).
    assert_eq!(line(&out, "device_hot "), "threads=1 k_cap=1 generated=4");
    let bad = line(&out, "device_bad_battery ");
    assert!(
        bad.starts_with("TandemException INVALID_ARGUMENT: ") && bad.contains("101"),
        "{bad}"
    );
    assert_eq!(
        line(&out, "device_null "),
        "NullPointerException: state is null"
    );
    assert_eq!(
        line(&out, "device_null_thermal "),
        "NullPointerException: thermal is null (use ThermalState.UNKNOWN)"
    );
    assert_eq!(line(&out, "device_after_refusals "), "threads=1 k_cap=1");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(
        line(&out, "device_unknown "),
        format!("threads={cores} k_cap=0")
    );
    assert_eq!(
        line(&out, "callback_throws "),
        "IllegalStateException: the app's callback failed"
    );
    let a = line(&out, "after_throw ");
    assert!(
        a == "stop=CANCELLED generated=2" || a == "stop=CANCELLED generated=3",
        "{a}"
    );
    assert_eq!(
        line(&out, "close_in_callback "),
        "IllegalStateException: TandemRuntime.close() called from inside this runtime's callback"
    );
    assert_eq!(line(&out, "closed_after_callback "), "false");
    assert_eq!(line(&out, "close_during "), "stop=CANCELLED closed=true");
    for call in ["generate", "cancel", "stats"] {
        assert_eq!(
            line(&out, &format!("after_close_{call} ")),
            "IllegalStateException: TandemRuntime is closed"
        );
    }
    assert_eq!(line(&out, "close_twice "), "no exception");
}

#[test]
fn a_conversation_streams_what_the_c_abis_conversation_streams_and_reuses_turn_one() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let config = local_config(dir.path());
    let second = "Now make it subtract.";
    let out = java(&[
        "conversation",
        config.to_str().unwrap(),
        PROMPT,
        second,
        &N.to_string(),
    ]);
    let c = c_abi_conversation(&config, &[PROMPT, second], N as u32);
    for (i, (pieces, c_reused)) in c.iter().enumerate() {
        let turn = i + 1;
        let java = prefixed_pieces(&out, &format!("turn{turn} piece "));
        assert_eq!(
            &java, pieces,
            "turn {turn}: Java's pieces must be the C ABI's"
        );
        assert!(java.iter().all(|(s, _)| s == "LOCAL"), "{java:?}");
        let stats = line(&out, &format!("turn{turn} stats "));
        assert!(stats.contains(&format!("generated={N} ")), "{stats}");
        assert!(
            stats.contains(&format!("draft_reused={c_reused} ")),
            "turn {turn}: {stats} (C: {c_reused})"
        );
    }
    assert!(
        line(&out, "bad_sampling ")
            .starts_with("TandemException INVALID_ARGUMENT: sampling: top_p"),
        "{out}"
    );
    assert_eq!(line(&out, "seeded_a "), line(&out, "seeded_b "));
    // Structured output through Sampling.withResponseFormat.
    assert!(
        ["yes", "no"].contains(&line(&out, "format_regex ")),
        "{out}"
    );
    assert!(
        line(&out, "bad_format ")
            .starts_with("TandemException INVALID_ARGUMENT: response_format: invalid grammar"),
        "{out}"
    );
    // Turn 2 continues turn 1's draft KV: it reuses at least turn 1's prompt.
    assert!(c[1].1 > 0, "turn 2 reused nothing");
    assert_eq!(
        line(&out, "send_in_callback "),
        "IllegalStateException: Conversation.send() called from inside this conversation's callback"
    );
    assert_eq!(
        line(&out, "close_in_callback "),
        "IllegalStateException: Conversation.close() called from inside this conversation's callback"
    );
    assert_eq!(line(&out, "closed "), "true");
    assert_eq!(
        line(&out, "send_after_close "),
        "IllegalStateException: Conversation is closed"
    );
    assert!(
        line(&out, "empty_message ")
            .starts_with("TandemException INVALID_ARGUMENT: message is empty"),
        "{out}"
    );
    assert_eq!(
        line(&out, "send_after_runtime_close "),
        "IllegalStateException: TandemRuntime is closed"
    );
    assert!(out.lines().any(|l| l == "done"), "{out}");
}
