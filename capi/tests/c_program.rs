//! The C program `examples/c/tandem_example.c`, compiled with `cc` from PATH
//! (or `$CC`) against the `libtandem_capi` cdylib that cargo built next to this
//! test, run as a user would run it, on the real draft model:
//!
//! * local mode (no verifier): the text equals the draft model's own greedy
//!   output, every piece `local`;
//! * against a loopback verifier over TLS (in-process `tandem_verifier::start`,
//!   real 1.5B target, self-signed certificate): the text equals the target's own greedy output, every
//!   piece `verified`; a prompt with an ID number stays on the device (the
//!   verifier opens no session) and the JSON says which rule and entity type;
//!   with `[edge.split]` (the device also runs the target's first 14 layers;
//!   model paths are file names in the models directory the program passes)
//!   the text is still the target's own;
//! * cancel from a second thread (and BUSY for a concurrent generation);
//! * the device state from C (`tandem_runtime_set_device_state`, called from
//!   inside the callback): the next generation drafts on one thread with
//!   k capped, the text does not change, bad states are refused; the warm-up
//!   at load (`[edge] warmup = true`) runs;
//! * bad input: missing config, bad TOML, missing model (looked up in the
//!   caller's models directory), no draft_model, `[edge.split]` without
//!   target_model -> code + message, exit 2, no crash.
//!
//! Generations are at most 16 tokens. The tests take a lock (one model run at
//! a time on 2 cores).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use tandem_model::kv_cache::KvPrecision;
use tandem_model::speculative::{generate_single_with, GenerateConfig};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::{LoadOptions, Model};

const N: usize = 16;
const PROMPT: &str = "Write a Python function that adds two numbers.";
const TOKEN: &str = "capi-test-device-token-0123456789";

fn serial() -> MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    M.lock().unwrap_or_else(|p| p.into_inner())
}

fn draft_path() -> PathBuf {
    tandem_fetch::model_path(tandem_fetch::ModelRole::Draft)
}

/// The directory holding `libtandem_capi.so` (`target/<profile>`): this test
/// binary lives in `target/<profile>/deps`.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let name = format!(
        "{}tandem_capi{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    // deps/ first: `cargo test` refreshes the cdylib there (the copy one level
    // up is only updated by `cargo build`).
    for d in [deps, deps.parent().unwrap()] {
        if d.join(&name).exists() {
            return d.to_path_buf();
        }
    }
    panic!("{name} not found next to {}", exe.display());
}

/// Compiles the C file `src` against the library into `out`.
fn compile(src: &Path, out: &Path) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let lib = lib_dir();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    // DT_RPATH, not RUNPATH (--disable-new-dtags): `cargo test` puts
    // target/<profile> in LD_LIBRARY_PATH, which RUNPATH yields to, and the
    // cdylib there is only refreshed by `cargo build`; the programs must load
    // the one in deps/ that this test run built.
    let o = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg("-I")
        .arg(root.join("capi/include"))
        .arg(src)
        .arg("-o")
        .arg(out)
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,--disable-new-dtags,-rpath,{}", lib.display()))
        .args(["-ltandem_capi", "-lpthread"])
        .output()
        .unwrap_or_else(|e| panic!("running the C compiler {cc:?}: {e}"));
    assert!(
        o.status.success(),
        "cc failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Compiles the example once per test process.
fn program() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tandem_example");
        compile(&root.join("examples/c/tandem_example.c"), &out);
        out
    })
}

fn run(config: &Path, prompt: &str, max_tokens: usize, extra: &[&str]) -> Output {
    run_in(None, config, prompt, max_tokens, extra)
}

/// [`run`] with the models directory the example passes to
/// `tandem_runtime_new` (its `TANDEM_MODELS_DIR`; `None`: NULL, the config's
/// directory).
fn run_in(
    models_dir: Option<&Path>,
    config: &Path,
    prompt: &str,
    max_tokens: usize,
    extra: &[&str],
) -> Output {
    let mut c = Command::new(program());
    match models_dir {
        Some(d) => c.env("TANDEM_MODELS_DIR", d),
        None => c.env_remove("TANDEM_MODELS_DIR"),
    };
    c.arg(config)
        .arg(prompt)
        .arg(max_tokens.to_string())
        .args(extra)
        .output()
        .unwrap()
}

/// A successful run's stdout lines.
struct Report {
    text: String,
    pieces: String,
    stats: String,
    json: serde_json::Value,
    rest: String,
}

fn report(o: &Output) -> Report {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "program failed: {o:?}\n{err}");
    let line = |p: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(p))
            .unwrap_or_else(|| panic!("no {p:?} line in {out}"))
            .to_string()
    };
    let hex = line("text_hex ");
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    Report {
        text: String::from_utf8(bytes).unwrap(),
        pieces: line("pieces "),
        stats: line("stats "),
        json: serde_json::from_str(&line("json ")).unwrap(),
        rest: out,
    }
}

fn stat(stats: &str, key: &str) -> f64 {
    stats
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in {stats}"))
        .parse()
        .unwrap()
}

/// Greedy output of `model` alone for the chat prompt, decoded.
fn greedy_text(model: &Model, prompt: &str, n: usize, kv: KvPrecision) -> String {
    greedy_chat(model, &[ChatMessage::user(prompt)], n, kv)
}

/// The KV precision the device's draft runs with (the library's default).
fn draft_kv() -> KvPrecision {
    GenerateConfig::default().draft_kv
}

/// Greedy output of `model` alone for a conversation, decoded.
fn greedy_chat(model: &Model, messages: &[ChatMessage], n: usize, kv: KvPrecision) -> String {
    let tok = Tokenizer::from_gguf(model.gguf()).unwrap();
    let ids = tok.encode_chat(messages, true).unwrap();
    let cfg = GenerateConfig {
        max_tokens: n,
        stop_tokens: tok.chat_stop_tokens(),
        ..GenerateConfig::default()
    };
    let g = generate_single_with(model, kv, &ids, &cfg, &mut |_| true).unwrap();
    tok.decode(&g.tokens, true).unwrap()
}

const FOLLOW_UP: &str = "Now add type hints.";

/// The `turn I ...` lines of a `--conversation` run: (text, stats line).
fn turns(o: &Output) -> Vec<(String, String)> {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "program failed: {o:?}");
    out.lines()
        .filter_map(|l| l.strip_prefix("turn "))
        .map(|l| {
            let mut it = l.split_whitespace();
            let _i = it.next();
            assert_eq!(it.next(), Some("text_hex"), "{l}");
            let hex = it.next().unwrap_or("");
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            (
                String::from_utf8(bytes).unwrap(),
                it.collect::<Vec<_>>().join(" "),
            )
        })
        .collect()
}

/// Runs a two-turn conversation (PROMPT, then FOLLOW_UP) with `n` tokens per
/// reply and checks that turn 2 reused turn 1's draft KV and equals
/// `model`'s greedy output for the whole conversation; returns turn 2's
/// stats line.
fn two_turns(config: &Path, model: &Model, n: usize, kv: KvPrecision) -> String {
    let t = turns(&run(config, PROMPT, n, &["--conversation", FOLLOW_UP]));
    assert_eq!(t.len(), 2, "{t:?}");
    let history = [
        ChatMessage::user(PROMPT),
        ChatMessage::assistant(t[0].0.clone()),
        ChatMessage::user(FOLLOW_UP),
    ];
    assert_eq!(t[0].0, greedy_chat(model, &history[..1], n, kv));
    assert_eq!(t[1].0, greedy_chat(model, &history, n, kv), "turn 2");
    assert_eq!(stat(&t[0].1, "draft_reused"), 0.0, "{}", t[0].1);
    assert!(stat(&t[1].1, "draft_reused") > 10.0, "{}", t[1].1);
    assert_eq!(stat(&t[1].1, "dropped"), 0.0, "{}", t[1].1);
    t[1].1.clone()
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

#[test]
fn local_mode_streams_the_drafts_own_greedy_output() {
    let _g = serial();
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    // The draft named by its built-in name, found in the models directory
    // the caller passes (nothing is fetched).
    let by_name = write(
        dir.path(),
        "by-name.toml",
        "draft_model = \"draft\"\nmax_seq_len = 512\n",
    );
    let models = draft_path().parent().unwrap().to_path_buf();
    let r = report(&run_in(Some(&models), &by_name, PROMPT, N, &[]));
    let draft = Model::load(draft_path(), LoadOptions::with_max_seq_len(512)).unwrap();
    assert_eq!(r.text, greedy_text(&draft, PROMPT, N, draft_kv()));
    assert!(!r.text.is_empty());
    assert!(r.stats.contains("route=local_no_verifier"), "{}", r.stats);
    assert_eq!(stat(&r.stats, "generated"), N as f64, "{}", r.stats);
    assert_eq!(stat(&r.stats, "local"), N as f64);
    assert_eq!(stat(&r.stats, "verified"), 0.0);
    assert!(
        r.pieces.contains("verified=0 provisional=0"),
        "{}",
        r.pieces
    );
    assert!(!r.pieces.contains("local=0"), "{}", r.pieces);
    assert_eq!(r.json["route"], "local_no_verifier");
    assert_eq!(r.json["stats"]["local_tokens"], N);
    assert!(r.json.get("decision").is_none(), "{}", r.json);
    assert!(r.rest.starts_with("version 0.1.0\n"), "{}", r.rest);
    // A conversation: turn 2 prefills only what is new, and is still the
    // draft's own greedy output for the whole history.
    let s = two_turns(&local_config(dir.path()), &draft, 8, draft_kv());
    assert_eq!(stat(&s, "verifier_reused"), 0.0, "{s}");
    eprintln!("local mode: {:.1} s", t0.elapsed().as_secs_f64());
}

#[test]
fn cancel_from_another_thread_stops_the_generation() {
    let _g = serial();
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let o = run(
        &local_config(dir.path()),
        PROMPT,
        64,
        &["--cancel-after", "3"],
    );
    let r = report(&o);
    assert!(r.stats.contains("stop=cancelled"), "{}", r.stats);
    // The callback waits at its 3rd piece until the other thread cancelled;
    // the runtime stops right after that token.
    let generated = stat(&r.stats, "generated");
    assert!((3.0..=4.0).contains(&generated), "{}", r.stats);
    assert!(r.pieces.contains("local=3"), "{}", r.pieces);
    assert!(
        r.rest
            .contains("cancel busy=BUSY stats_during=NO_GENERATION"),
        "{}",
        r.rest
    );
    // The same runtime generates again, and the earlier cancel (plus one made
    // while nothing ran) does not touch it.
    assert!(
        r.rest.contains("second stop=max_tokens generated=4"),
        "{}",
        r.rest
    );
    eprintln!("cancel: {:.1} s", t0.elapsed().as_secs_f64());
}

#[test]
fn bad_input_gives_a_code_and_a_message() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let err = |o: &Output| {
        assert_eq!(o.status.code(), Some(2), "{o:?}");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let missing = dir.path().join("nope.toml");
    let e = err(&run(&missing, PROMPT, 4, &[]));
    assert!(e.contains("error IO: reading the config"), "{e}");
    assert!(e.contains("nope.toml"), "{e}");

    // A config refused with CONFIG and a message containing `names`.
    let refused = |name: &str, text: &str, names: &str| {
        let e = err(&run(&write(dir.path(), name, text), PROMPT, 4, &[]));
        assert!(e.contains("error CONFIG:") && e.contains(names), "{e}");
    };
    refused("bad.toml", "max_tokenz = 3\n", "max_tokenz");
    refused("k.toml", "[edge]\nk = 99\n", "k must be");

    let bad = write(dir.path(), "model.toml", "draft_model = \"no/such.gguf\"\n");
    let e = err(&run(&bad, PROMPT, 4, &[]));
    assert!(e.contains("error IO: draft model"), "{e}");
    assert!(e.contains("no/such.gguf"), "{e}");
    // A relative model path is looked up in the models directory the caller
    // passed, and nowhere else.
    let models = dir.path().join("models");
    let e = err(&run_in(Some(&models), &bad, PROMPT, 4, &[]));
    let want = models.join("no/such.gguf");
    assert!(
        e.contains(&format!("draft model {} does not exist", want.display())),
        "{e}"
    );

    // A built-in name whose file is not in the models directory: CONFIG,
    // saying how to get it; the library fetches nothing.
    let gemma = write(dir.path(), "gemma.toml", "draft_model = \"gemma\"\n");
    let e = err(&run_in(Some(&models), &gemma, PROMPT, 4, &[]));
    assert!(
        e.contains("error CONFIG:") && e.contains("tandem models fetch --model gemma"),
        "{e}"
    );
    // A name that is nothing: the names there are.
    let nothing = write(dir.path(), "nothing.toml", "draft_model = \"nosuch\"\n");
    let e = err(&run_in(Some(&models), &nothing, PROMPT, 4, &[]));
    assert!(
        e.contains("error CONFIG:") && e.contains("`nosuch`") && e.contains("smollm2"),
        "{e}"
    );

    // No default model: the caller names it.
    refused(
        "nodraft.toml",
        "max_seq_len = 512\n",
        "draft_model is required",
    );

    // Split execution needs the target model on the device: refused before
    // any model loads, naming the field.
    refused(
        "split.toml",
        &format!(
            "draft_model = {:?}\n[edge]\nverifier_url = \"http://127.0.0.1:1\"\n[edge.split]\nlayer = 2\n",
            draft_path()
        ),
        "[edge.split] needs target_model",
    );

    let not_gguf = write(dir.path(), "junk.gguf", "this is not a GGUF file");
    let bad = write(
        dir.path(),
        "junk.toml",
        &format!("draft_model = {not_gguf:?}\n"),
    );
    let e = err(&run(&bad, PROMPT, 4, &[]));
    assert!(e.contains("error MODEL: loading the draft model"), "{e}");

    let bad = write(
        dir.path(),
        "policy.toml",
        &format!(
            "draft_model = {:?}\npolicy = \"missing-policy.toml\"\n",
            draft_path()
        ),
    );
    let e = err(&run(&bad, PROMPT, 4, &[]));
    assert!(e.contains("error IO: privacy policy"), "{e}");
    // A policy file that is there but not a policy: CONFIG, naming the file
    // and the field.
    write(
        dir.path(),
        "broken-policy.toml",
        "default = \"speculative\"\nmin_score = \"high\"\n",
    );
    let bad = write(
        dir.path(),
        "policy2.toml",
        &format!(
            "draft_model = {:?}\npolicy = \"broken-policy.toml\"\n",
            draft_path()
        ),
    );
    let e = err(&run(&bad, PROMPT, 4, &[]));
    assert!(
        e.contains("error CONFIG: privacy policy")
            && e.contains("broken-policy.toml")
            && e.contains("min_score"),
        "{e}"
    );

    // Split execution whose target file is not there: IO, naming the role
    // and the file.
    let bad = write(
        dir.path(),
        "split-target.toml",
        &format!(
            "draft_model = {:?}\ntarget_model = \"no/target.gguf\"\n[edge]\nverifier_url = \"http://127.0.0.1:1\"\n[edge.split]\nlayer = 2\n",
            draft_path()
        ),
    );
    let e = err(&run(&bad, PROMPT, 4, &[]));
    assert!(e.contains("error IO: target model"), "{e}");
    assert!(
        e.contains("no/target.gguf") && e.contains("does not exist"),
        "{e}"
    );

    // A https verifier without a CA is refused before anything loads.
    let bad = write(
        dir.path(),
        "tls.toml",
        "[edge]\nverifier_url = \"https://127.0.0.1:1\"\n",
    );
    let e = err(&run(&bad, PROMPT, 4, &[]));
    assert!(
        e.contains("error CONFIG:") && e.contains("ca_cert_pem"),
        "{e}"
    );
}

#[test]
fn against_a_loopback_verifier_output_is_the_targets_and_id_numbers_stay_local() {
    let _g = serial();
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // TLS with a self-signed certificate for "localhost"; the app's config
    // names the CA file relative to itself.
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cert = write(dir.path(), "ca.pem", &ck.cert.pem());
    let key = write(dir.path(), "key.pem", &ck.signing_key.serialize_pem());
    let vcfg: tandem_verifier::VerifierConfig = toml::from_str(&format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nmodel_path = {:?}\n\
         max_seq_len = 512\n[tls]\ncert_pem = {cert:?}\nkey_pem = {key:?}\n[[devices]]\nid = \"app\"\ntoken = \"{TOKEN}\"\n\
         [limits]\nmax_prompt_tokens = 400\n",
        tandem_fetch::model_path(tandem_fetch::ModelRole::Target)
    ))
    .unwrap();
    let v = rt.block_on(tandem_verifier::start(vcfg)).unwrap();
    let cfg = write(
        dir.path(),
        "remote.toml",
        &format!(
            "draft_model = {:?}\nmax_seq_len = 512\n[edge]\nverifier_url = \"https://127.0.0.1:{}\"\n\
             ca_cert_pem = \"ca.pem\"\ntls_domain = \"localhost\"\ntoken = \"{TOKEN}\"\nk = 4\n",
            draft_path(),
            v.grpc_addr.port()
        ),
    );
    let r = report(&run(&cfg, PROMPT, N, &[]));
    let want = greedy_text(&v.state.model, PROMPT, N, KvPrecision::F32);
    assert_eq!(r.text, want, "verified output must be the target's own");
    assert!(r.stats.contains("route=speculative"), "{}", r.stats);
    assert_eq!(stat(&r.stats, "verified"), N as f64, "{}", r.stats);
    assert!(stat(&r.stats, "rounds") >= 1.0);
    let acc = stat(&r.stats, "acceptance");
    assert!((0.0..=1.0).contains(&acc), "{}", r.stats);
    assert!(r.pieces.contains("provisional=0 local=0"), "{}", r.pieces);
    assert_eq!(r.json["route"], "speculative");
    assert_eq!(r.json["decision"]["decision"]["action"], "speculative");
    // `[edge] proposer` is honoured (no key: `auto`); every proposer gives the
    // target's own output, and the JSON says which proposed the rounds.
    let p = &r.json["stats"]["proposers"];
    let rounds = r.json["stats"]["rounds"].as_u64().unwrap();
    let sum = |p: &serde_json::Value| {
        p["draft"]["rounds"].as_u64().unwrap()
            + p["lookup"]["rounds"].as_u64().unwrap()
            + p["none_rounds"].as_u64().unwrap()
    };
    assert_eq!(sum(p), rounds, "{p}");
    for (proposer, draft_rounds_zero) in [("draft", false), ("lookup", true)] {
        let c = write(
            dir.path(),
            &format!("{proposer}.toml"),
            &format!(
                "draft_model = {:?}\nmax_seq_len = 512\n[edge]\nverifier_url = \"https://127.0.0.1:{}\"\n\
                 ca_cert_pem = \"ca.pem\"\ntls_domain = \"localhost\"\ntoken = \"{TOKEN}\"\nk = 4\n\
                 proposer = \"{proposer}\"\n",
                draft_path(),
                v.grpc_addr.port()
            ),
        );
        let r = report(&run(&c, PROMPT, N, &[]));
        assert_eq!(
            r.text, want,
            "{proposer}: verified output must be the target's own"
        );
        let p = &r.json["stats"]["proposers"];
        let rounds = r.json["stats"]["rounds"].as_u64().unwrap();
        assert_eq!(sum(p), rounds, "{proposer}: {p}");
        if draft_rounds_zero {
            assert_eq!(p["draft"]["rounds"], 0, "{proposer}: {p}");
        } else {
            assert_eq!(p["draft"]["rounds"].as_u64().unwrap(), rounds, "{p}");
        }
    }
    // A conversation: turn 2 is the target's greedy output for the whole
    // history, and the verifier continued turn 1's session. With the draft
    // proposer, so that turn 1 ran the draft over the prompt (auto and lookup
    // run it lazily, only when they choose it: then there is less to keep).
    let draft_cfg = dir.path().join("draft.toml");
    let s = two_turns(&draft_cfg, &v.state.model, 8, KvPrecision::F32);
    assert!(stat(&s, "verifier_reused") > 10.0, "{s}");

    // Split execution: the device also loads the target and runs its first
    // 14 of 28 layers; the output is still the target's own. The model paths
    // are file names in the models directory the app passes.
    let name = |p: PathBuf| p.file_name().unwrap().to_str().unwrap().to_string();
    let target_path = tandem_fetch::model_path(tandem_fetch::ModelRole::Target);
    let split = write(
        dir.path(),
        "split.toml",
        &format!(
            "draft_model = {:?}\ntarget_model = {:?}\nmax_seq_len = 512\n[edge]\n\
             verifier_url = \"https://127.0.0.1:{}\"\nca_cert_pem = \"ca.pem\"\n\
             tls_domain = \"localhost\"\ntoken = \"{TOKEN}\"\nk = 4\n[edge.split]\nlayer = 14\n",
            name(draft_path()),
            name(target_path.clone()),
            v.grpc_addr.port()
        ),
    );
    let t_split = Instant::now();
    let r = report(&run_in(target_path.parent(), &split, PROMPT, N, &[]));
    assert_eq!(r.text, want, "split output must be the target's own");
    assert_eq!(stat(&r.stats, "verified"), N as f64, "{}", r.stats);
    let sp = &r.json["stats"]["split"];
    assert_eq!(
        (sp["layer"].as_u64(), sp["n_layer"].as_u64()),
        (Some(14), Some(28)),
        "{}",
        r.json
    );
    eprintln!("split at 14: {:.1} s", t_split.elapsed().as_secs_f64());
    let opened = |v: &tandem_verifier::RunningVerifier| -> String {
        v.state
            .render_metrics()
            .lines()
            .filter(|l| l.contains("sessions_opened") && !l.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let before = opened(&v);

    // A synthetic resident ID number: the router keeps it on the device.
    let id = "11010519491231002X";
    let prompt = format!("My ID card number is {id}, write a leave request for me.");
    let r = report(&run(&cfg, &prompt, 8, &[]));
    assert!(r.stats.contains("route=local_by_router"), "{}", r.stats);
    assert_eq!(stat(&r.stats, "verified"), 0.0);
    assert_eq!(stat(&r.stats, "passes"), 0.0);
    let d = &r.json["decision"]["decision"];
    assert_eq!(d["action"], "local", "{}", r.json);
    assert_eq!(d["entities"][0]["type"], "CN_RESIDENT_ID", "{}", r.json);
    assert!(!r.rest.contains(id), "the ID must not be echoed");
    assert_eq!(opened(&v), before, "no session for a local prompt");

    // A CA that did not sign the verifier's certificate: a TLS error with a
    // message, not provisional output.
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    write(dir.path(), "other-ca.pem", &other.cert.pem());
    let untrusted = write(
        dir.path(),
        "untrusted.toml",
        &format!(
            "draft_model = {:?}\nmax_seq_len = 512\n[edge]\nverifier_url = \"https://127.0.0.1:{}\"\n\
             ca_cert_pem = \"other-ca.pem\"\ntls_domain = \"localhost\"\ntoken = \"{TOKEN}\"\n",
            draft_path(),
            v.grpc_addr.port()
        ),
    );
    let o = run(&untrusted, PROMPT, 4, &[]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(e.contains("error TLS:"), "{e}");
    rt.block_on(v.shutdown()).unwrap();
    eprintln!("loopback verifier: {:.1} s", t0.elapsed().as_secs_f64());
}

#[test]
fn unreachable_verifier_gives_provisional_pieces_not_an_error() {
    let _g = serial();
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    // A port nobody listens on: connections are refused.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let cfg = write(
        dir.path(),
        "down.toml",
        &format!(
            "draft_model = {:?}\nmax_seq_len = 512\n[edge]\nverifier_url = \"http://127.0.0.1:{port}\"\n",
            draft_path()
        ),
    );
    // Enough tokens that the draft is still generating when the breaker's
    // threshold of refused opens is reached (they are retried in the
    // background with backoff while the device drafts alone: with 8 tokens a
    // fast draft sometimes finished first and the breaker never opened).
    let n = 24;
    let r = report(&run(&cfg, PROMPT, n, &[]));
    assert!(r.stats.contains("route=speculative"), "{}", r.stats);
    assert_eq!(stat(&r.stats, "provisional"), n as f64, "{}", r.stats);
    assert!(r.pieces.contains("verified=0") && r.pieces.contains("local=0"));
    assert!(!r.pieces.contains("provisional=0"), "{}", r.pieces);
    assert!(r.json["stats"]["breaker_opens"].as_u64().unwrap() >= 1);
    // Provisional greedy tokens are the draft's own.
    let draft = Model::load(draft_path(), LoadOptions::with_max_seq_len(512)).unwrap();
    assert_eq!(r.text, greedy_text(&draft, PROMPT, n, draft_kv()));
    eprintln!("unreachable verifier: {:.1} s", t0.elapsed().as_secs_f64());
}

/// A C program's SIGPIPE disposition after `tandem_runtime_new`: ignored when
/// it was at its default (a write to a connection the verifier dropped must
/// not kill the app), left alone when the app set its own handler.
#[test]
fn a_c_host_is_not_killed_by_sigpipe_and_its_own_handler_is_kept() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let src = write(
        dir.path(),
        "sigpipe.c",
        r#"#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include "tandem.h"

static void on_pipe(int sig) { (void)sig; }

int main(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[2], "own-handler") == 0) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_pipe;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGPIPE, &sa, NULL);
    }
    TandemRuntime *rt = NULL;
    char *err = NULL;
    if (tandem_runtime_new(argv[1], NULL, &rt, &err) != TANDEM_STATUS_OK) {
        fprintf(stderr, "runtime: %s\n", err ? err : "?");
        return 2;
    }
    struct sigaction now;
    sigaction(SIGPIPE, NULL, &now);
    if (now.sa_handler == SIG_IGN) puts("ignored");
    else if (now.sa_handler == on_pipe) puts("own handler");
    else puts("default");
    /* A SIGPIPE now would end the program only at its default action. */
    raise(SIGPIPE);
    puts("alive");
    tandem_runtime_free(rt);
    return 0;
}
"#,
    );
    let exe = dir.path().join("sigpipe");
    compile(&src, &exe);
    let config = local_config(dir.path());
    for (arg, want) in [("default", "ignored"), ("own-handler", "own handler")] {
        let o = Command::new(&exe).arg(&config).arg(arg).output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{arg}: {:?} {out} {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(out.lines().collect::<Vec<_>>(), [want, "alive"], "{arg}");
    }
}

/// The device state through the C ABI: set from inside the callback (no
/// deadlock with the running generation, which keeps what it started with),
/// the next generation reports one draft thread and k capped to 1 (critical
/// heat, battery 5 %), its text is the same, an unknown state is refused and
/// changes nothing, and "unknown" again gives all threads back.
#[test]
fn device_state_from_c_throttles_the_next_generation() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let src = write(
        dir.path(),
        "device.c",
        r#"#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tandem.h"

struct run { TandemRuntime *rt; char text[4096]; size_t len; int set_in_callback; TandemStatus set_status; };

static bool on_piece(const char *piece, size_t n, TandemTokenStatus status, void *user) {
    (void)status;
    struct run *r = user;
    if (r->len + n < sizeof r->text) { memcpy(r->text + r->len, piece, n); r->len += n; r->text[r->len] = 0; }
    if (r->set_in_callback) {
        r->set_in_callback = 0;
        TandemDeviceState hot = { TANDEM_THERMAL_STATE_CRITICAL, 5, false, false, false };
        r->set_status = tandem_runtime_set_device_state(r->rt, &hot, NULL);
    }
    return true;
}

static int generate(struct run *r, const char *prompt, TandemStats *stats) {
    char *err = NULL;
    r->len = 0; r->text[0] = 0;
    if (tandem_generate(r->rt, prompt, 6, on_piece, r, stats, &err) != TANDEM_STATUS_OK) {
        fprintf(stderr, "generate: %s\n", err ? err : "?");
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    (void)argc;
    struct run r;
    memset(&r, 0, sizeof r);
    char *err = NULL;
    if (tandem_runtime_new(argv[1], NULL, &r.rt, &err) != TANDEM_STATUS_OK) {
        fprintf(stderr, "runtime: %s\n", err ? err : "?");
        return 2;
    }
    TandemStats a, b, c;
    r.set_in_callback = 1;
    if (generate(&r, argv[2], &a)) return 2;
    char first[4096];
    strcpy(first, r.text);
    printf("set_in_callback %s\n", tandem_status_name(r.set_status));
    printf("first threads=%u k_cap=%u\n", a.draft_threads, a.k_cap);
    if (generate(&r, argv[2], &b)) return 2;
    printf("second threads=%u k_cap=%u same_text=%d\n", b.draft_threads, b.k_cap, strcmp(first, r.text) == 0);
    TandemDeviceState bad_thermal = { 7, -1, false, false, false };
    TandemStatus s1 = tandem_runtime_set_device_state(r.rt, &bad_thermal, &err);
    printf("bad_thermal %s %s\n", tandem_status_name(s1), err ? err : "");
    tandem_string_free(err); err = NULL;
    TandemDeviceState bad_battery = { TANDEM_THERMAL_STATE_NOMINAL, 101, false, false, false };
    TandemStatus s2 = tandem_runtime_set_device_state(r.rt, &bad_battery, &err);
    printf("bad_battery %s %s\n", tandem_status_name(s2), err ? err : "");
    tandem_string_free(err); err = NULL;
    printf("null %s\n", tandem_status_name(tandem_runtime_set_device_state(r.rt, NULL, NULL)));
    /* Refused states changed nothing: still throttled. */
    if (generate(&r, argv[2], &c)) return 2;
    printf("after_refusals threads=%u k_cap=%u\n", c.draft_threads, c.k_cap);
    TandemDeviceState unknown = { TANDEM_THERMAL_STATE_UNKNOWN, -1, false, false, false };
    tandem_runtime_set_device_state(r.rt, &unknown, NULL);
    if (generate(&r, argv[2], &c)) return 2;
    printf("unknown threads=%u k_cap=%u\n", c.draft_threads, c.k_cap);
    tandem_runtime_free(r.rt);
    return 0;
}
"#,
    );
    let exe = dir.path().join("device");
    compile(&src, &exe);
    let config = write(
        dir.path(),
        "device.toml",
        &format!(
            "draft_model = {:?}\nmax_seq_len = 256\n[edge]\nwarmup = true\n",
            draft_path()
        ),
    );
    let o = Command::new(&exe)
        .arg(&config)
        .arg(PROMPT)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{:?} {out} {}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    println!("{out}");
    let line = |p: &str| {
        out.lines()
            .find(|l| l.starts_with(p))
            .unwrap_or_else(|| panic!("no {p:?} in {out}"))
            .to_string()
    };
    let cores = std::thread::available_parallelism().unwrap().get();
    assert_eq!(line("set_in_callback"), "set_in_callback OK");
    assert_eq!(line("first"), format!("first threads={cores} k_cap=0"));
    assert_eq!(line("second"), "second threads=1 k_cap=1 same_text=1");
    assert!(
        line("bad_thermal").starts_with("bad_thermal INVALID_ARGUMENT thermal"),
        "{out}"
    );
    assert!(
        line("bad_battery").starts_with("bad_battery INVALID_ARGUMENT battery_pct"),
        "{out}"
    );
    assert_eq!(line("null"), "null INVALID_ARGUMENT");
    assert_eq!(line("after_refusals"), "after_refusals threads=1 k_cap=1");
    assert_eq!(line("unknown"), format!("unknown threads={cores} k_cap=0"));
}
