//! `tandem generate --verifier URL` as a user runs it: the built binary against a
//! real `tandem serve-verifier` child process on 127.0.0.1. To stay fast the
//! verifier serves the real *draft* GGUF as its target (same tokenizer, so the
//! fingerprint check is the real one); greedy output must then equal the draft
//! model's own greedy output. The real 0.5B/1.5B pair is in `edge_e2e_real.rs`.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::{start_verifier, statuses, tandem, Verifier, VerifierSpec};

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};

const TOKEN: &str = "edge-cli-token-0123456789";
const PROMPT: &str = "Write a Rust function that returns the larger of two i32 values.";

fn verifier(dir: &Path, extra_top: &str, limits: &str) -> Verifier {
    let spec = VerifierSpec {
        listen: "127.0.0.1:0".into(),
        model: "draft",
        token: TOKEN,
        extra_top,
        limits,
    };
    start_verifier(dir, &spec)
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

fn token_file(dir: &Path, token: &str) -> PathBuf {
    let p = dir.join(format!("token-{}", rand_suffix()));
    std::fs::write(&p, format!("{token}\n")).unwrap();
    p
}

fn generate(args: &[&str], extra: &[&std::ffi::OsStr]) -> Output {
    tandem()
        .arg("generate")
        .args(args)
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn json_of(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "generate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Greedy output of the draft model alone (= the verifier's target here).
fn draft_only(max_tokens: &str) -> serde_json::Value {
    json_of(&generate(
        &[
            "--mode",
            "draft",
            "--prompt",
            PROMPT,
            "--max-tokens",
            max_tokens,
            "--json",
        ],
        &[],
    ))
}

#[test]
fn json_has_per_token_status_and_edge_stats_and_equals_target_only() {
    let dir = tempfile::tempdir().unwrap();
    let v = verifier(dir.path(), "insecure_loopback = true", "");
    // Token via an edge config file; URL via the flag.
    let edge = dir.path().join("edge.toml");
    std::fs::write(
        &edge,
        format!("token = \"{TOKEN}\"\nbreaker_failures = 5\n"),
    )
    .unwrap();
    let url = format!("http://{}", v.grpc);
    let out = generate(
        &[
            "--verifier",
            &url,
            "--prompt",
            PROMPT,
            "--max-tokens",
            "16",
            "--k",
            "3",
            "--json",
        ],
        &["--edge-config".as_ref(), edge.as_os_str()],
    );
    let j = json_of(&out);
    let want = draft_only("16");
    assert_eq!(j["tokens"], want["tokens"]);
    assert_eq!(j["text"], want["text"]);
    assert_eq!(j["mode"], "remote");
    assert_eq!(j["verifier"], url.as_str());
    assert_eq!(j["k"], 3);
    assert_eq!(j["stop"], "max_tokens");
    assert_eq!(statuses(&j), vec!["verified".to_string(); 16]);
    let s = &j["stats"];
    assert_eq!(s["generated_tokens"], 16);
    assert_eq!(s["verified_tokens"], 16);
    assert_eq!(s["provisional_tokens"], 0);
    let rounds = s["rounds"].as_u64().unwrap();
    assert!((4..=16).contains(&rounds), "{s}");
    // One prefill + one pass per round; ≤ 1 per token with k = 3.
    assert_eq!(s["verifier_passes"].as_u64().unwrap(), rounds + 1);
    let ppt = s["verifier_passes_per_token"].as_f64().unwrap();
    assert!((ppt - (rounds + 1) as f64 / 16.0).abs() < 1e-9, "{s}");
    let acc = s["acceptance_rate"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&acc));
    assert!(s["bytes_sent"].as_u64().unwrap() > 0 && s["bytes_received"].as_u64().unwrap() > 0);
    assert!(s["rtt_mean_ms"].as_f64().unwrap() > 0.0);
    assert!(j["session_id"].as_str().is_some_and(|x| !x.is_empty()));
    assert_eq!(j["provisional"]["provisional_tokens"], 0);
}

#[test]
fn proposer_auto_and_lookup_with_a_verifier_give_the_target_s_output() {
    let dir = tempfile::tempdir().unwrap();
    let v = verifier(dir.path(), "insecure_loopback = true", "");
    let tf = token_file(dir.path(), TOKEN);
    let url = format!("http://{}", v.grpc);
    let want = draft_only("16");
    for proposer in ["auto", "lookup"] {
        let out = generate(
            &[
                "--verifier",
                &url,
                "--proposer",
                proposer,
                "--prompt",
                PROMPT,
                "--max-tokens",
                "16",
                "--json",
            ],
            &["--token-file".as_ref(), tf.as_os_str()],
        );
        let j = json_of(&out);
        assert_eq!(j["tokens"], want["tokens"], "{proposer}");
        assert_eq!(j["proposer"], proposer);
        assert_eq!(statuses(&j), vec!["verified".to_string(); 16]);
        let s = &j["stats"];
        let p = &s["proposers"];
        let rounds = |k: &str| p[k]["rounds"].as_u64().unwrap();
        assert_eq!(
            rounds("draft") + rounds("lookup") + p["none_rounds"].as_u64().unwrap(),
            s["rounds"].as_u64().unwrap(),
            "{proposer}: {s}"
        );
        if proposer == "lookup" {
            assert_eq!(rounds("draft"), 0, "{s}");
        }
    }
}

#[test]
fn streams_plain_text_to_a_pipe_and_prints_edge_stats() {
    let dir = tempfile::tempdir().unwrap();
    let v = verifier(dir.path(), "insecure_loopback = true", "");
    let tok = token_file(dir.path(), TOKEN);
    let url = format!("http://{}", v.grpc);
    let out = generate(
        &["--verifier", &url, "--prompt", PROMPT, "--max-tokens", "12"],
        &["--token-file".as_ref(), tok.as_os_str()],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout.clone()).unwrap();
    let want = draft_only("12");
    assert_eq!(text, format!("{}\n", want["text"].as_str().unwrap()));
    assert!(!text.contains('\x1b'), "no ANSI codes on a pipe: {text:?}");
    let err = stderr(&out);
    assert!(
        err.contains("tokens: 12 verified, 0 provisional, 0 local"),
        "{err}"
    );
    assert!(err.contains("verifier passes"), "{err}");
    assert!(err.contains("RTT mean"), "{err}");
}

#[test]
fn unreachable_verifier_falls_back_to_provisional_draft_output_with_a_warning() {
    // A port nobody listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let dir = tempfile::tempdir().unwrap();
    let edge = dir.path().join("edge.toml");
    std::fs::write(
        &edge,
        format!("token = \"{TOKEN}\"\nconnect_timeout_ms = 300\nbackoff_base_ms = 5\n"),
    )
    .unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let out = generate(
        &[
            "--verifier",
            &url,
            "--prompt",
            PROMPT,
            "--max-tokens",
            "8",
            "--json",
        ],
        &["--edge-config".as_ref(), edge.as_os_str()],
    );
    let j = json_of(&out);
    assert_eq!(statuses(&j), vec!["provisional".to_string(); 8]);
    assert_eq!(j["tokens"], draft_only("8")["tokens"]);
    assert_eq!(j["stats"]["breaker_opens"], 1);
    assert_eq!(j["provisional"]["provisional_tokens"], 8);
    assert_eq!(j["provisional"]["checked_tokens"], 0);
    let err = stderr(&out);
    assert!(
        err.contains("warning: the verifier is unreachable"),
        "{err}"
    );
}

#[test]
fn bad_input_fails_clearly_and_the_verifier_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let v = verifier(dir.path(), "insecure_loopback = true", "");
    let url = format!("http://{}", v.grpc);
    let good = token_file(dir.path(), TOKEN);
    let bad = token_file(dir.path(), "not-the-device-token-42");
    let base = [
        "--verifier",
        url.as_str(),
        "--prompt",
        PROMPT,
        "--max-tokens",
        "4",
    ];

    let out = generate(&base, &["--token-file".as_ref(), bad.as_os_str()]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("UNAUTHENTICATED") && err.contains("bearer token"),
        "{err}"
    );

    let out = generate(&base, &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("missing bearer token"),
        "{}",
        stderr(&out)
    );

    for k in ["0", "17"] {
        let out = generate(
            &[&base[..], &["--k", k]].concat(),
            &["--token-file".as_ref(), good.as_os_str()],
        );
        assert!(!out.status.success());
        assert!(
            stderr(&out).contains("out of range (1..=16)"),
            "k={k}: {}",
            stderr(&out)
        );
    }

    let out = generate(&[&base[..], &["--mode", "target"]].concat(), &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--mode speculative"),
        "{}",
        stderr(&out)
    );

    let empty = token_file(dir.path(), "");
    let out = generate(&base, &["--token-file".as_ref(), empty.as_os_str()]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("is empty"), "{}", stderr(&out));

    let https = format!("https://{}", v.grpc);
    let out = generate(&["--verifier", &https, "--prompt", PROMPT], &[]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("ca_cert_pem"), "{}", stderr(&out));

    // After all that, a good request still works.
    let out = generate(
        &[&base[..], &["--json"]].concat(),
        &["--token-file".as_ref(), good.as_os_str()],
    );
    assert_eq!(json_of(&out)["stats"]["verified_tokens"], 4);
}

#[test]
fn oversized_prompt_is_refused_and_others_are_still_served() {
    let dir = tempfile::tempdir().unwrap();
    let v = verifier(dir.path(), "insecure_loopback = true", "");
    // max_prompt_tokens = 1000 at the verifier; the draft's own KV holds 4096.
    let long = "word ".repeat(1200);
    let tok = token_file(dir.path(), TOKEN);
    let url = format!("http://{}", v.grpc);
    let out = generate(
        &["--verifier", &url, "--prompt", &long, "--max-tokens", "4"],
        &["--token-file".as_ref(), tok.as_os_str()],
    );
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("PROMPT_TOO_LONG") && err.contains("longer than the verifier accepts"),
        "{err}"
    );
    let out = generate(
        &[
            "--verifier",
            &url,
            "--prompt",
            PROMPT,
            "--max-tokens",
            "4",
            "--json",
        ],
        &["--token-file".as_ref(), tok.as_os_str()],
    );
    assert_eq!(json_of(&out)["stats"]["verified_tokens"], 4);
}

struct TlsFiles {
    cert: PathBuf,
    key: PathBuf,
    expired_cert: PathBuf,
    expired_key: PathBuf,
    other_ca: PathBuf,
}

fn tls_files(dir: &Path) -> TlsFiles {
    let names = vec!["localhost".to_string()];
    let good = rcgen::generate_simple_self_signed(names.clone()).unwrap();
    let other = rcgen::generate_simple_self_signed(names.clone()).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(names).unwrap();
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2021, 1, 1);
    let expired = params.self_signed(&key).unwrap();
    let w = |name: &str, pem: String| {
        let p = dir.join(name);
        std::fs::write(&p, pem).unwrap();
        p
    };
    TlsFiles {
        cert: w("cert.pem", good.cert.pem()),
        key: w("key.pem", good.signing_key.serialize_pem()),
        expired_cert: w("expired.pem", expired.pem()),
        expired_key: w("expired-key.pem", key.serialize_pem()),
        other_ca: w("other.pem", other.cert.pem()),
    }
}

#[test]
fn tls_works_with_the_right_ca_and_fails_clearly_on_untrusted_or_expired_certs() {
    let dir = tempfile::tempdir().unwrap();
    let t = tls_files(dir.path());
    let tok = token_file(dir.path(), TOKEN);
    let tls = |cert: &Path, key: &Path| format!("[tls]\ncert_pem = {cert:?}\nkey_pem = {key:?}");
    let run = |v: &Verifier, ca: &Path| {
        let url = format!("https://localhost:{}", v.grpc.rsplit(':').next().unwrap());
        generate(
            &[
                "--verifier",
                &url,
                "--prompt",
                PROMPT,
                "--max-tokens",
                "4",
                "--json",
            ],
            &[
                "--token-file".as_ref(),
                tok.as_os_str(),
                "--ca-cert".as_ref(),
                ca.as_os_str(),
            ],
        )
    };
    let v = verifier(dir.path(), &tls(&t.cert, &t.key), "");
    let j = json_of(&run(&v, &t.cert));
    assert_eq!(statuses(&j), vec!["verified".to_string(); 4]);
    // A CA that did not sign the verifier's certificate.
    let out = run(&v, &t.other_ca);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("TLS with the verifier failed") && err.contains("--ca-cert"),
        "{err}"
    );
    drop(v);
    // The verifier's certificate expired (trusted CA = the cert itself).
    let v = verifier(dir.path(), &tls(&t.expired_cert, &t.expired_key), "");
    let out = run(&v, &t.expired_cert);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("TLS with the verifier failed"), "{err}");
    assert!(err.to_lowercase().contains("expired"), "{err}");
}

#[test]
fn edge_config_without_a_verifier_generates_locally() {
    let dir = tempfile::tempdir().unwrap();
    let edge = dir.path().join("edge.toml");
    std::fs::write(&edge, "k = 4\n").unwrap();
    let out = generate(
        &["--prompt", PROMPT, "--max-tokens", "6", "--json"],
        &["--edge-config".as_ref(), edge.as_os_str()],
    );
    let j = json_of(&out);
    assert_eq!(j["verifier"], serde_json::Value::Null);
    assert_eq!(statuses(&j), vec!["local".to_string(); 6]);
    assert_eq!(j["tokens"], draft_only("6")["tokens"]);
    assert_eq!(j["stats"]["local_tokens"], 6);
    assert_eq!(j["stats"]["verifier_passes"], 0);
}

#[test]
fn plain_http_to_a_non_loopback_verifier_is_refused_before_anything_is_sent() {
    // The bearer token and the token ids would cross the network in clear
    // text. Refused from the flag and from the config file alike, before a
    // model is loaded or a connection is made; the error names the field.
    let dir = tempfile::tempdir().unwrap();
    let edge = dir.path().join("edge.toml");
    std::fs::write(&edge, "verifier_url = \"http://192.0.2.7:7443\"\n").unwrap();
    for (args, extra) in [
        (
            vec![
                "--verifier",
                "http://verifier.example:7443",
                "--prompt",
                "hi",
            ],
            vec![],
        ),
        (
            vec!["--prompt", "hi"],
            vec!["--edge-config".as_ref(), edge.as_os_str()],
        ),
    ] {
        let out = generate(&args, &extra);
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        let err = stderr(&out);
        assert!(
            err.contains("verifier_url") && err.contains("not a loopback address"),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// A CA, a server certificate for `localhost` and two client certificates, all
/// signed by the CA (PEM files in `dir`): (ca, server cert, server key, client
/// cert, client key, another client's cert, its key). The client certificate
/// is issued to `dev` (the test verifier's device id), the other to `intruder`.
fn mtls_files(dir: &Path) -> [PathBuf; 7] {
    use rcgen::{
        BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
        KeyUsagePurpose,
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::from_params(&ca_params, &ca_key);
    let server_key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
    let client_cert = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec![name.to_string()]).unwrap();
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        (params.signed_by(&key, &issuer).unwrap(), key)
    };
    let (client, client_key) = client_cert("dev");
    let (other, other_key) = client_cert("intruder");
    let w = |name: &str, pem: String| {
        let p = dir.join(name);
        std::fs::write(&p, pem).unwrap();
        p
    };
    [
        w("ca.pem", ca.pem()),
        w("server.pem", server.pem()),
        w("server-key.pem", server_key.serialize_pem()),
        w("client.pem", client.pem()),
        w("client-key.pem", client_key.serialize_pem()),
        w("other.pem", other.pem()),
        w("other-key.pem", other_key.serialize_pem()),
    ]
}

#[test]
fn mutual_tls_needs_the_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let [ca, cert, key, client, client_key, ..] = mtls_files(dir.path());
    let tok = token_file(dir.path(), TOKEN);
    let v = verifier(
        dir.path(),
        &format!("[tls]\ncert_pem = {cert:?}\nkey_pem = {key:?}\nclient_ca_pem = {ca:?}"),
        "",
    );
    let url = format!("https://localhost:{}", v.grpc.rsplit(':').next().unwrap());
    let base = [
        "--verifier",
        &url,
        "--prompt",
        PROMPT,
        "--max-tokens",
        "4",
        "--json",
    ];
    let mut with_tls: Vec<&std::ffi::OsStr> = vec![
        "--token-file".as_ref(),
        tok.as_os_str(),
        "--ca-cert".as_ref(),
        ca.as_os_str(),
    ];
    let out = generate(&base, &with_tls);
    assert!(
        !out.status.success(),
        "no client certificate must not pass; stdout: {} stderr: {}",
        String::from_utf8_lossy(&out.stdout),
        stderr(&out)
    );
    let err = stderr(&out);
    assert!(err.contains("TLS"), "{err}");
    with_tls.extend([
        "--client-cert".as_ref(),
        client.as_os_str(),
        "--client-key".as_ref(),
        client_key.as_os_str(),
    ]);
    let j = json_of(&generate(&base, &with_tls));
    assert_eq!(statuses(&j), vec!["verified".to_string(); 4]);
}

#[test]
fn a_bound_client_identity_refuses_another_devices_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let [ca, cert, key, client, client_key, other, other_key] = mtls_files(dir.path());
    let tok = token_file(dir.path(), TOKEN);
    let v = verifier(
        dir.path(),
        &format!(
            "[tls]\ncert_pem = {cert:?}\nkey_pem = {key:?}\nclient_ca_pem = {ca:?}\n\
             bind_client_identity = true"
        ),
        "",
    );
    let url = format!("https://localhost:{}", v.grpc.rsplit(':').next().unwrap());
    let base = [
        "--verifier",
        &url,
        "--prompt",
        PROMPT,
        "--max-tokens",
        "3",
        "--json",
    ];
    let with_cert = |cert: &Path, key: &Path| -> Vec<std::ffi::OsString> {
        vec![
            "--token-file".into(),
            tok.clone().into(),
            "--ca-cert".into(),
            ca.clone().into(),
            "--client-cert".into(),
            cert.into(),
            "--client-key".into(),
            key.into(),
        ]
    };
    let run = |extra: &[std::ffi::OsString]| {
        let extra: Vec<&std::ffi::OsStr> = extra.iter().map(|s| s.as_os_str()).collect();
        generate(&base, &extra)
    };
    // The device's own certificate (issued to `dev`) with its token: served.
    let j = json_of(&run(&with_cert(&client, &client_key)));
    assert_eq!(statuses(&j), vec!["verified".to_string(); 3]);
    // Another device's certificate, valid under the same CA, carrying dev's
    // token: refused, and the error says why.
    let out = run(&with_cert(&other, &other_key));
    assert!(
        !out.status.success(),
        "a certificate issued to another device must not pass: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let err = stderr(&out);
    assert!(
        err.contains("UNAUTHENTICATED") && err.contains("not issued to \"dev\""),
        "{err}"
    );
}
