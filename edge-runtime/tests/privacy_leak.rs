//! The leak test: the routed edge runtime in front of a real in-process
//! `tandem-verifier` (tiny random models) reached through a recording TCP
//! proxy. The proxy keeps every byte the device sends; the test parses the
//! HTTP/2 frames back into the gRPC `ClientMessage`s the verifier received and
//! decodes every token id with the tokenizer the device used.
//!
//! Checks: every positive case of `router/tests/corpus` and of the blind set
//! `router/tests/blind` that the router routes local opens no connection and sends no byte, and no sensitive span appears
//! in anything captured (raw UTF-8, the varint encoding of its token ids, the
//! decoded token ids); multi-turn conversations where the sensitive turn comes
//! first or later; the live context (device state, RTT, breaker) reaching the
//! decision; a policy replaced while serving deciding the next turn; and a negative
//! control (a non-sensitive prompt is found in the
//! capture, so the detectors can fail).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use prost::Message;
use tandem_edge::{DeviceState, EdgeConfig, EdgeRuntime, RoutedRuntime, ThermalState, TokenStatus};
use tandem_model::gguf::GgufFile;
use tandem_model::speculative::GenerateConfig;
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::{LoadOptions, Model};
use tandem_proto::v1::{client_message::Msg as ClientMsg, ClientMessage};
use tandem_router::{Action, Policy, RouteContext, Router};
use tandem_verifier::RunningVerifier;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "leak-test-token-0123456789";

// ---- recording proxy -------------------------------------------------------------

/// The bytes one connection carried to the verifier.
type ConnBytes = Arc<Mutex<Vec<u8>>>;

/// Every byte the device sent, per accepted connection.
#[derive(Clone, Default)]
struct Recorder {
    conns: Arc<Mutex<Vec<ConnBytes>>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Snapshot {
    connections: usize,
    /// HTTP/2 streams opened (HEADERS frames): every gRPC call has one.
    streams: usize,
    /// DATA payload bytes: every gRPC message is carried in DATA frames.
    data_bytes: usize,
}

impl Recorder {
    fn snapshot(&self) -> Snapshot {
        // A closing connection may still send control frames (GOAWAY,
        // RST_STREAM, WINDOW_UPDATE) after its generation returned; those
        // carry no content, so they are not counted.
        let all = self.streams();
        let mut s = Snapshot {
            connections: all.len(),
            streams: 0,
            data_bytes: 0,
        };
        for conn in &all {
            for f in frames(conn) {
                match f.kind {
                    0 => s.data_bytes += f.payload.len(),
                    1 => s.streams += 1,
                    _ => {}
                }
            }
        }
        s
    }

    fn bytes(&self) -> usize {
        self.streams().iter().map(Vec::len).sum()
    }

    fn streams(&self) -> Vec<Vec<u8>> {
        let c = self.conns.lock().unwrap();
        c.iter().map(|b| b.lock().unwrap().clone()).collect()
    }

    /// Every `ClientMessage` the verifier received, per connection.
    fn messages(&self) -> Vec<Vec<ClientMessage>> {
        self.streams().iter().map(|s| grpc_messages(s)).collect()
    }
}

/// Start the proxy on 127.0.0.1 in front of `upstream`.
fn start_recorder(rt: &tokio::runtime::Runtime, upstream: SocketAddr) -> (SocketAddr, Recorder) {
    let rec = Recorder::default();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let r = rec.clone();
    rt.spawn(async move {
        loop {
            let Ok((mut down, _)) = listener.accept().await else {
                return;
            };
            let buf = Arc::new(Mutex::new(Vec::new()));
            r.conns.lock().unwrap().push(buf.clone());
            tokio::spawn(async move {
                let Ok(up) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                let (mut up_r, mut up_w) = up.into_split();
                let (mut down_r, mut down_w) = down.split();
                let to_server = async {
                    let mut chunk = vec![0u8; 16 * 1024];
                    loop {
                        let n = match down_r.read(&mut chunk).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        buf.lock().unwrap().extend_from_slice(&chunk[..n]);
                        if up_w.write_all(&chunk[..n]).await.is_err() {
                            break;
                        }
                    }
                    let _ = up_w.shutdown().await;
                };
                let to_client = async {
                    let _ = tokio::io::copy(&mut up_r, &mut down_w).await;
                    let _ = down_w.shutdown().await;
                };
                tokio::join!(to_server, to_client);
            });
        }
    });
    (addr, rec)
}

/// HTTP/2 (client side, prior knowledge) -> DATA payload per stream -> gRPC
/// length-prefixed messages -> `ClientMessage`s. Stops at an incomplete frame.
fn grpc_messages(bytes: &[u8]) -> Vec<ClientMessage> {
    let mut data: BTreeMap<u32, Vec<u8>> = BTreeMap::new();
    for f in frames(bytes).into_iter().filter(|f| f.kind == 0) {
        data.entry(f.stream)
            .or_default()
            .extend_from_slice(&f.payload);
    }
    let mut out = Vec::new();
    for body in data.values() {
        let mut b = &body[..];
        while b.len() >= 5 {
            assert_eq!(b[0], 0, "compressed gRPC message");
            let n = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
            if b.len() < 5 + n {
                break;
            }
            out.push(ClientMessage::decode(&b[5..5 + n]).expect("a ClientMessage"));
            b = &b[5 + n..];
        }
    }
    out
}

/// One HTTP/2 frame (DATA payloads without their padding).
struct Frame {
    kind: u8,
    stream: u32,
    payload: Vec<u8>,
}

/// The client's HTTP/2 frames (prior knowledge). Stops at an incomplete frame.
fn frames(bytes: &[u8]) -> Vec<Frame> {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let mut rest = bytes.strip_prefix(PREFACE).unwrap_or(bytes);
    let mut out = Vec::new();
    while rest.len() >= 9 {
        let len = (usize::from(rest[0]) << 16) | (usize::from(rest[1]) << 8) | usize::from(rest[2]);
        let (kind, flags) = (rest[3], rest[4]);
        let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]) & 0x7fff_ffff;
        if rest.len() < 9 + len {
            break;
        }
        let mut payload = &rest[9..9 + len];
        if kind == 0 && flags & 0x8 != 0 {
            let pad = usize::from(payload[0]);
            payload = &payload[1..payload.len() - pad];
        }
        out.push(Frame {
            kind,
            stream,
            payload: payload.to_vec(),
        });
        rest = &rest[9 + len..];
    }
    out
}

/// Token-id sequences the messages carried (Open prompts, draft blocks,
/// resumed contexts).
fn token_sequences(msgs: &[ClientMessage]) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for m in msgs {
        match &m.msg {
            Some(ClientMsg::Open(o)) => out.push(o.prompt_tokens.clone()),
            Some(ClientMsg::Draft(d)) => out.push(d.tokens.clone()),
            Some(ClientMsg::Resume(r)) => out.push(r.context_tokens.clone()),
            _ => {}
        }
    }
    out
}

fn varints(ids: &[u32]) -> Vec<u8> {
    let mut v = Vec::new();
    for &id in ids {
        prost::encoding::encode_varint(u64::from(id), &mut v);
    }
    v
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// Where (if anywhere) `span` shows up in the capture.
struct Capture {
    raw: Vec<Vec<u8>>,
    decoded: Vec<String>,
}

impl Capture {
    fn of(rec: &Recorder, tok: &Tokenizer) -> Capture {
        let mut decoded = Vec::new();
        for conn in rec.messages() {
            let seqs = token_sequences(&conn);
            for s in &seqs {
                decoded.push(tok.decode(s, false).unwrap());
            }
            // Open prompt followed by everything drafted after it.
            let all: Vec<u32> = seqs.concat();
            decoded.push(tok.decode(&all, false).unwrap());
        }
        Capture {
            raw: rec.streams(),
            decoded,
        }
    }

    /// Every way `span` shows up: raw UTF-8, the varint run of the span's
    /// inner tokens (the first and last may merge differently inside the
    /// text), the decoded token ids.
    fn detectors(&self, tok: &Tokenizer, span: &str) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.raw.iter().any(|r| contains(r, span.as_bytes())) {
            out.push("raw UTF-8");
        }
        let ids = tok.encode(span, false).unwrap();
        if ids.len() >= 4 {
            let inner = varints(&ids[1..ids.len() - 1]);
            if self.raw.iter().any(|r| contains(r, &inner)) {
                out.push("varint token ids");
            }
        }
        if self.decoded.iter().any(|d| d.contains(span)) {
            out.push("decoded token ids");
        }
        out
    }

    fn finds(&self, tok: &Tokenizer, span: &str) -> Option<&'static str> {
        self.detectors(tok, span).first().copied()
    }
}

// ---- fixture -------------------------------------------------------------------------

struct Fixture {
    _dir: tempfile::TempDir,
    draft: Arc<Model>,
    tok: Tokenizer,
    rt: tokio::runtime::Runtime,
    verifier: Option<RunningVerifier>,
    proxy: SocketAddr,
    rec: Recorder,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(v) = self.verifier.take() {
            let _ = self.rt.block_on(v.shutdown());
        }
    }
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let (target, draft) = (
        dir.path().join("target.gguf"),
        dir.path().join("draft.gguf"),
    );
    // The target carries the tokenizer (tandem_model::testing's tiny BPE).
    let with_tokenizer = TinyConfig {
        tokenizer: true,
        ..TinyConfig::default()
    };
    write_tiny_qwen2(&target, &with_tokenizer).unwrap();
    // Both carry the tokenizer: the draft's vocabulary (tokens without the
    // padding rows) must be the target's.
    let draft_cfg = TinyConfig {
        tokenizer: true,
        ..TinyConfig::draft_like()
    };
    write_tiny_qwen2(&draft, &draft_cfg).unwrap();
    let tok = Tokenizer::from_gguf(&GgufFile::open(&target).unwrap()).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let toml_text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nmodel_path = {target:?}\n\
         tokenizer_fingerprint = \"{}\"\nmax_seq_len = 4096\ninsecure_loopback = true\n\
         [[devices]]\nid = \"dev\"\ntoken = \"{TOKEN}\"\n",
        tok.fingerprint()
    );
    let cfg: tandem_verifier::VerifierConfig = toml::from_str(&toml_text).unwrap();
    let verifier = rt.block_on(tandem_verifier::start(cfg)).unwrap();
    let (proxy, rec) = start_recorder(&rt, verifier.grpc_addr);
    Fixture {
        _dir: dir,
        draft: Arc::new(Model::load(&draft, LoadOptions::with_max_seq_len(4096)).unwrap()),
        tok,
        rt,
        verifier: Some(verifier),
        proxy,
        rec,
    }
}

impl Fixture {
    fn edge_config(&self, url: String) -> EdgeConfig {
        EdgeConfig {
            verifier_url: Some(url),
            token: Some(TOKEN.into()),
            tokenizer_fingerprint: Some(self.tok.fingerprint()),
            connect_timeout_ms: 500,
            backoff_base_ms: 5,
            backoff_max_ms: 20,
            probe_interval_ms: 20,
            probe_timeout_ms: 500,
            ..EdgeConfig::default()
        }
    }

    /// A routed runtime talking to the verifier through the recorder.
    fn routed(&self, router: &Arc<Router>) -> RoutedRuntime {
        EdgeRuntime::builder(
            self.draft.clone(),
            self.edge_config(format!("http://{}", self.proxy)),
        )
        .router(router.clone(), self.tok.clone())
        .build()
        .unwrap()
    }

    fn capture(&self) -> Capture {
        Capture::of(&self.rec, &self.tok)
    }
}

fn gen() -> GenerateConfig {
    GenerateConfig {
        k: 2,
        max_tokens: 4,
        ..GenerateConfig::default()
    }
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn example_router() -> Arc<Router> {
    Arc::new(Router::from_file(repo().join("config/policy.example.toml")).unwrap())
}

struct Case {
    id: String,
    text: String,
    /// Expected entity values, or the whole text for category-only cases.
    spans: Vec<String>,
}

/// Every positive case (expected entities or categories) of the corpus and
/// of the blind set of issue 32 (`router/tests/blind`: seven languages,
/// disclosures without lexicon words, identifiers as people type them).
fn positive_cases() -> Vec<Case> {
    let mut files: Vec<_> = ["router/tests/corpus", "router/tests/blind"]
        .iter()
        .flat_map(|d| std::fs::read_dir(repo().join(d)).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        for line in std::fs::read_to_string(&f).unwrap().lines() {
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let text = v["text"].as_str().unwrap().to_string();
            let mut spans: Vec<String> = v["entities"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["value"].as_str().unwrap().to_string())
                .collect();
            let has_categories = !v["categories"].as_array().unwrap().is_empty();
            if spans.is_empty() && has_categories {
                spans.push(text.clone());
            }
            if !spans.is_empty() {
                out.push(Case {
                    id: v["id"].as_str().unwrap().to_string(),
                    text,
                    spans,
                });
            }
        }
    }
    out
}

// ---- tests -------------------------------------------------------------------------------

#[test]
fn every_positive_corpus_case_routed_local_sends_nothing() {
    let f = fixture();
    let router = example_router();
    let policy: Arc<Policy> = router.policy();
    let cases = positive_cases();
    assert!(cases.len() >= 500, "{} positive cases", cases.len());
    assert!(
        cases.iter().filter(|c| c.id.starts_with("blind2-")).count() >= 200,
        "the blind set's positive cases are in"
    );
    let mut local_cases = Vec::new();
    let mut sent: Vec<&Case> = Vec::new();
    for c in &cases {
        // A fresh runtime per case: nothing of an earlier case is in flight.
        let mut rt = f.routed(&router);
        let before = f.rec.snapshot();
        let out = rt
            .chat(
                &c.id,
                &[ChatMessage::user(c.text.clone())],
                &gen(),
                &mut |_| true,
            )
            .unwrap();
        drop(rt);
        let after = f.rec.snapshot();
        let shown = format!(
            "{:?} {}",
            out.route,
            serde_json::to_string(&out.route).unwrap()
        );
        for s in &c.spans {
            assert!(
                !shown.contains(s.as_str()),
                "{}: the decision shows its text",
                c.id
            );
        }
        match out.route.action() {
            Action::Local => {
                assert_eq!(after, before, "{}: a local case touched the network", c.id);
                assert!(out
                    .generation
                    .statuses
                    .iter()
                    .all(|s| *s == TokenStatus::Local));
                assert_eq!(out.generation.stats.bytes_sent, 0);
                assert_eq!(out.generation.session_id, None);
                local_cases.push(c);
            }
            Action::Speculative => {
                assert!(after.connections > before.connections, "{}", c.id);
                sent.push(c);
            }
        }
    }
    // The runtime adds no leak of its own: what went out is exactly what the
    // router itself does not flag (its recall, docs/privacy.md).
    let misses: Vec<&str> = cases
        .iter()
        .filter(|c| policy.decide(&c.text, &RouteContext::default()).action != Action::Local)
        .map(|c| c.id.as_str())
        .collect();
    let sent_ids: Vec<&str> = sent.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(sent_ids, misses);
    assert!(
        sent.len() * 100 <= cases.len() * 3,
        "router missed {} of {} positive cases: {sent_ids:?}",
        sent.len(),
        cases.len()
    );
    let cap = f.capture();
    // The detectors work: every text that did go out is found in the capture.
    for c in &sent {
        assert!(
            cap.finds(&f.tok, &c.text).is_some(),
            "{}: sent but not found",
            c.id
        );
    }
    // No span of a local case anywhere in the capture (unless a sent case's
    // own text carries the same value).
    let (mut checked, mut shared) = (0, 0);
    for c in &local_cases {
        for s in &c.spans {
            if sent.iter().any(|m| m.text.contains(s.as_str())) {
                shared += 1;
                continue;
            }
            assert_eq!(cap.finds(&f.tok, s), None, "{}: span found", c.id);
            checked += 1;
        }
    }
    assert!(checked > 250, "{checked} spans checked");
    let stats = router.stats();
    assert_eq!(stats.total as usize, cases.len());
    assert_eq!(stats.local as usize, local_cases.len());
    println!(
        "positive cases: {}, local: {}, sent (router misses): {:?}; connections {}; \
         spans checked {checked}, skipped as shared with a sent text {shared}",
        cases.len(),
        local_cases.len(),
        sent_ids,
        f.rec.snapshot().connections
    );
}

const ID_TEXT: &str = "我的身份证号是11010519491231002X，帮我写个请假条";
const ID: &str = "11010519491231002X";
const BENIGN: &str = "Write a Rust function that reverses a string";
const BENIGN_2: &str = "Now add unit tests for it";

#[test]
fn sensitive_first_turn_keeps_the_conversation_local() {
    let f = fixture();
    let router = example_router();
    let mut rt = f.routed(&router);
    let t1 = vec![ChatMessage::user(ID_TEXT)];
    let a = rt.chat("c1", &t1, &gen(), &mut |_| true).unwrap();
    assert_eq!(a.route.action(), Action::Local);
    assert_eq!(a.route.decision.rule, "identifiers");
    assert_eq!(a.route.message, Some(0));
    let e = &a.route.decision.entities[0];
    assert_eq!(e.kind.as_str(), "CN_RESIDENT_ID");
    assert_eq!(&ID_TEXT[e.start..e.end], ID);
    assert_eq!(rt.pinned_by("c1").as_deref(), Some("identifiers"));
    // Turn 2 with the history: sticky, evidence from message 0.
    let reply = f.tok.decode(&a.generation.tokens, true).unwrap();
    let t2 = vec![
        ChatMessage::user(ID_TEXT),
        ChatMessage::assistant(reply),
        ChatMessage::user(BENIGN),
    ];
    let b = rt.chat("c1", &t2, &gen(), &mut |_| true).unwrap();
    assert_eq!(b.route.action(), Action::Local);
    assert_eq!(b.route.decision.rule, "sticky:identifiers");
    assert_eq!(b.route.message, Some(0));
    assert_eq!(b.route.decision.entities[0].kind.as_str(), "CN_RESIDENT_ID");
    // A stateless caller with a new id but the same history: local by replay.
    let c = rt.chat("other-id", &t2, &gen(), &mut |_| true).unwrap();
    assert_eq!(c.route.action(), Action::Local);
    // A stateful caller sending only the newest message under the same id.
    let d = rt
        .chat("c1", &[ChatMessage::user(BENIGN_2)], &gen(), &mut |_| true)
        .unwrap();
    assert_eq!(d.route.action(), Action::Local);
    assert_eq!(d.route.decision.rule, "sticky:identifiers");
    assert_eq!(d.route.message, None);
    assert!(d
        .generation
        .statuses
        .iter()
        .all(|s| *s == TokenStatus::Local));
    // Nothing at all went out.
    assert_eq!(f.rec.snapshot().connections, 0);
    assert_eq!(f.rec.bytes(), 0);
    // After forgetting, a clean history runs speculatively again (control).
    rt.forget("c1");
    let e = rt
        .chat("c1", &[ChatMessage::user(BENIGN_2)], &gen(), &mut |_| true)
        .unwrap();
    assert_eq!(e.route.action(), Action::Speculative);
    assert!(e
        .generation
        .statuses
        .iter()
        .all(|s| *s == TokenStatus::Verified));
    assert!(f.rec.snapshot().connections > 0);
    assert_eq!(f.capture().finds(&f.tok, ID), None);
    let stats = router.stats();
    assert_eq!((stats.total, stats.local, stats.speculative), (5, 4, 1));
    assert_eq!(stats.by_rule["sticky:identifiers"]["local"], 3);
}

#[test]
fn sensitive_later_turn_sends_only_the_clean_turns_before_it() {
    let f = fixture();
    let router = example_router();
    let mut rt = f.routed(&router);
    let mut history = vec![ChatMessage::user(BENIGN)];
    let a = rt.chat("c2", &history, &gen(), &mut |_| true).unwrap();
    assert_eq!(a.route.action(), Action::Speculative);
    assert_eq!(a.route.decision.rule, "default");
    let after_clean = f.rec.snapshot();
    assert!(after_clean.connections > 0 && after_clean.streams > 0 && after_clean.data_bytes > 0);
    // The clean turn did reach the verifier (the capture can see text).
    assert_eq!(
        f.capture().detectors(&f.tok, BENIGN),
        ["varint token ids", "decoded token ids"]
    );
    history.push(ChatMessage::assistant(
        f.tok.decode(&a.generation.tokens, true).unwrap(),
    ));
    history.push(ChatMessage::user(ID_TEXT));
    let b = rt.chat("c2", &history, &gen(), &mut |_| true).unwrap();
    assert_eq!(b.route.action(), Action::Local);
    assert_eq!(b.route.decision.rule, "identifiers");
    assert_eq!(b.route.message, Some(2));
    assert!(b.route.context.rtt_ms.is_some(), "RTT from the first turn");
    assert_eq!(f.rec.snapshot(), after_clean, "the sensitive turn went out");
    history.push(ChatMessage::assistant(
        f.tok.decode(&b.generation.tokens, true).unwrap(),
    ));
    history.push(ChatMessage::user(BENIGN_2));
    let c = rt.chat("c2", &history, &gen(), &mut |_| true).unwrap();
    assert_eq!(c.route.action(), Action::Local);
    assert_eq!(c.route.decision.rule, "sticky:identifiers");
    assert_eq!(c.route.message, Some(2));
    assert_eq!(f.rec.snapshot(), after_clean);
    drop(rt);
    let cap = f.capture();
    assert_eq!(cap.finds(&f.tok, ID), None);
    assert_eq!(cap.finds(&f.tok, ID_TEXT), None);
    assert_eq!(cap.finds(&f.tok, BENIGN_2), None);
}

#[test]
fn non_sensitive_prompt_reaches_the_verifier() {
    let f = fixture();
    let router = example_router();
    let mut rt = f.routed(&router);
    let text = "Explain the borrow checker error E0502 in this snippet: let r = &v; v.push(1);";
    let g = rt
        .chat("n", &[ChatMessage::user(text)], &gen(), &mut |_| true)
        .unwrap();
    assert_eq!(g.route.action(), Action::Speculative);
    assert!(g.generation.session_id.is_some());
    assert!(g
        .generation
        .statuses
        .iter()
        .all(|s| *s == TokenStatus::Verified));
    drop(rt);
    let msgs: Vec<ClientMessage> = f.rec.messages().concat();
    let Some(ClientMsg::Open(open)) = &msgs[0].msg else {
        panic!("first message is not Open");
    };
    let prompt = f.tok.encode_chat(&[ChatMessage::user(text)], true).unwrap();
    assert_eq!(open.prompt_tokens, prompt);
    // Token ids, not text, go out: both token detectors see the prompt.
    assert_eq!(
        f.capture().detectors(&f.tok, text),
        ["varint token ids", "decoded token ids"]
    );
}

#[test]
fn live_context_device_state_rtt_and_breaker_reach_the_decision() {
    let f = fixture();
    let policy = r#"
version = 1
default = "speculative"
[[rules]]
name = "ids"
action = "local"
entities = ["CN_RESIDENT_ID"]
[[rules]]
name = "offline"
action = "local"
breaker_open = true
[[rules]]
name = "battery"
action = "local"
battery_below = 20
[[rules]]
name = "hot"
action = "local"
thermal_at_least = 3
[[rules]]
name = "slow"
action = "local"
rtt_ms_above = 0.0
"#;
    let router = Arc::new(Router::from_toml_str(policy).unwrap());
    let mut rt = f.routed(&router);
    let msg = [ChatMessage::user(BENIGN)];
    rt.set_device_state(DeviceState {
        battery_pct: Some(10),
        ..DeviceState::default()
    })
    .unwrap();
    let a = rt.chat("d", &msg, &gen(), &mut |_| true).unwrap();
    assert_eq!(
        (a.route.action(), a.route.decision.rule.as_str()),
        (Action::Local, "battery")
    );
    assert_eq!(a.route.context.battery_pct, Some(10));
    assert_eq!(
        rt.pinned_by("d").as_deref(),
        None,
        "device state must not pin"
    );
    rt.set_device_state(DeviceState {
        thermal: Some(ThermalState::Critical),
        ..DeviceState::default()
    })
    .unwrap();
    let b = rt.chat("d", &msg, &gen(), &mut |_| true).unwrap();
    assert_eq!(b.route.decision.rule, "hot");
    assert_eq!(f.rec.snapshot().connections, 0);
    rt.set_device_state(DeviceState::default()).unwrap();
    // RTT unknown until the first verify: speculative, then "slow".
    let c = rt.chat("d", &msg, &gen(), &mut |_| true).unwrap();
    assert_eq!(c.route.action(), Action::Speculative);
    assert_eq!(c.route.context.rtt_ms, None);
    let d = rt.chat("d", &msg, &gen(), &mut |_| true).unwrap();
    assert_eq!(d.route.decision.rule, "slow");
    assert!(d.route.context.rtt_ms.is_some_and(|r| r > 0.0));
    assert_eq!(rt.pinned_by("d").as_deref(), None);
    drop(rt);

    // Breaker: a verifier address nobody listens on.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let mut cfg = f.edge_config(format!("http://{dead}"));
    cfg.breaker_failures = 1;
    cfg.probe_interval_ms = 60_000;
    let mut rt = EdgeRuntime::builder(f.draft.clone(), cfg)
        .router(router.clone(), f.tok.clone())
        .build()
        .unwrap();
    let e = rt.chat("e", &msg, &gen(), &mut |_| true).unwrap();
    assert_eq!(e.route.action(), Action::Speculative);
    assert!(e
        .generation
        .statuses
        .iter()
        .all(|s| *s == TokenStatus::Provisional));
    let g = rt.chat("e", &msg, &gen(), &mut |_| true).unwrap();
    assert_eq!(g.route.decision.rule, "offline");
    assert!(g.route.context.breaker_open);
    assert!(g
        .generation
        .statuses
        .iter()
        .all(|s| *s == TokenStatus::Local));

    let s = router.stats();
    let count = |rule: &str, action: &str| s.by_rule.get(rule).and_then(|m| m.get(action)).copied();
    assert_eq!(count("battery", "local"), Some(1));
    assert_eq!(count("hot", "local"), Some(1));
    assert_eq!(count("slow", "local"), Some(1));
    assert_eq!(count("offline", "local"), Some(1));
    assert_eq!(count("default", "speculative"), Some(2));
    assert_eq!((s.total, s.local, s.speculative), (6, 4, 2));
}

/// A policy swapped while the runtime serves (what the admin API's `PUT` and
/// its policy file hot reload do, `tandem-edge-http`'s `admin`; the file
/// watcher itself is tested in `edge-http/tests/admin_http.rs`) decides the
/// next turn, and that turn sends nothing.
#[test]
fn a_replaced_policy_takes_effect_on_the_next_turn() {
    let f = fixture();
    let router =
        Arc::new(Router::from_toml_str("version = 1\ndefault = \"speculative\"\n").unwrap());
    let mut rt = f.routed(&router);
    let msg = [ChatMessage::user("close ticket TCK-12345 please")];
    let a = rt.chat("t1", &msg, &gen(), &mut |_| true).unwrap();
    assert_eq!(a.route.action(), Action::Speculative);
    let sent = f.rec.snapshot();
    assert!(sent.connections > 0);
    // The operator adds a rule; the shared router swaps it in.
    let next = Policy::from_toml_str(
        "version = 1\ndefault = \"speculative\"\n[[recognizers]]\nname = \"TICKET\"\n\
         pattern = 'TCK-[0-9]{5}'\nscore = 0.9\n[[rules]]\nname = \"tickets\"\n\
         action = \"local\"\nentities = [\"TICKET\"]\n",
    )
    .unwrap();
    assert_eq!(router.replace(next), 2);
    let b = rt.chat("t2", &msg, &gen(), &mut |_| true).unwrap();
    assert_eq!(
        (b.route.action(), b.route.decision.rule.as_str()),
        (Action::Local, "tickets")
    );
    assert_eq!(b.route.policy_generation, 2);
    assert_eq!(f.rec.snapshot(), sent, "the local turn went out");
}

#[test]
fn the_pin_map_is_bounded_and_forgets_the_least_recently_routed_id() {
    // Conversation ids are client-chosen: a flood of invented ids must not
    // grow the map without bound (issue 19).
    let f = fixture();
    let router = example_router();
    let mut rt = f.routed(&router);
    rt.set_pin_capacity(2);
    let sensitive = [ChatMessage::user(ID_TEXT)];
    let clean = [ChatMessage::user(BENIGN_2)];
    for id in ["a", "b"] {
        assert_eq!(rt.route(id, &sensitive).action(), Action::Local);
    }
    // Routing "a" again makes "b" the least recently used.
    let again = rt.route("a", &clean);
    assert_eq!(again.decision.rule, "sticky:identifiers");
    assert_eq!(rt.route("c", &sensitive).action(), Action::Local);
    assert_eq!(rt.pinned_count(), 2);
    assert_eq!(rt.pinned_by("a").as_deref(), Some("identifiers"));
    assert_eq!(rt.pinned_by("b").as_deref(), None);
    assert_eq!(rt.pinned_by("c").as_deref(), Some("identifiers"));
    // Forgotten: only the newest message of "b" decides now.
    assert_eq!(rt.route("b", &clean).action(), Action::Speculative);
    for i in 0..500 {
        rt.route(&format!("flood-{i}"), &sensitive);
    }
    assert_eq!(rt.pinned_count(), 2);
    assert_eq!(rt.pinned_by("flood-499").as_deref(), Some("identifiers"));
    // A clean conversation never takes a slot.
    rt.set_pin_capacity(1);
    assert_eq!(rt.pinned_count(), 1);
    rt.route("clean", &clean);
    assert_eq!(rt.pinned_by("flood-499").as_deref(), Some("identifiers"));
    // Nothing was sent: route() opens nothing.
    assert_eq!(f.rec.snapshot().connections, 0);
}

#[test]
fn pinned_conversations_survive_a_restart_in_the_pin_file() {
    let f = fixture();
    let router = example_router();
    let dir = tempfile::tempdir().unwrap();
    let pins = dir.path().join("policy.toml.pins.json");
    {
        let mut rt = f.routed(&router);
        assert_eq!(rt.persist_pins(&pins).unwrap(), 0);
        let a = rt
            .chat("c1", &[ChatMessage::user(ID_TEXT)], &gen(), &mut |_| true)
            .unwrap();
        assert_eq!(a.route.action(), Action::Local);
        let b = rt
            .chat("c2", &[ChatMessage::user(BENIGN)], &gen(), &mut |_| true)
            .unwrap();
        assert_eq!(b.route.action(), Action::Speculative);
    }
    // "Restart": a new runtime loads the pins. c1's newest message alone is
    // clean, yet it stays local; c2 was never pinned.
    let mut rt = f.routed(&router);
    assert_eq!(rt.persist_pins(&pins).unwrap(), 1);
    assert_eq!(rt.pinned_by("c1").as_deref(), Some("identifiers"));
    let before = f.rec.snapshot().connections;
    let d = rt
        .chat("c1", &[ChatMessage::user(BENIGN_2)], &gen(), &mut |_| true)
        .unwrap();
    assert_eq!(d.route.action(), Action::Local);
    assert_eq!(d.route.decision.rule, "sticky:identifiers");
    assert_eq!(
        f.rec.snapshot().connections,
        before,
        "c1 went out after a restart"
    );
    assert_eq!(rt.pinned_by("c2").as_deref(), None);
    // Forgetting unpins it in the file too.
    rt.forget("c1");
    drop(rt);
    let mut again = f.routed(&router);
    assert_eq!(again.persist_pins(&pins).unwrap(), 0);
    // A corrupt file is refused with its name, not silently emptied.
    std::fs::write(&pins, "not json").unwrap();
    let e = again.persist_pins(&pins).err().unwrap().to_string();
    assert!(e.contains("pins.json"), "{e}");
}

/// A fixed second opinion that counts how often it is asked.
struct Fixed(tandem_router::Opinion, std::sync::atomic::AtomicUsize);

impl tandem_router::SecondOpinion for Fixed {
    fn judge(&self, _text: &str) -> Result<tandem_router::Opinion, tandem_router::OpinionError> {
        self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(self.0)
    }
}

fn example_with_opinion(mode: &str) -> Arc<Router> {
    let src = std::fs::read_to_string(repo().join("config/policy.example.toml")).unwrap();
    Arc::new(
        Router::from_toml_str(&src.replace("mode = \"off\"", &format!("mode = \"{mode}\"")))
            .unwrap(),
    )
}

/// The second opinion runs on the device before anything is sent: a bare
/// mobile number (in the unsure band) judged sensitive is answered locally
/// with zero bytes out and pins the conversation; judged benign it goes to
/// the verifier. The builder installs the draft as the opinion, so a policy
/// that turns it on is all it takes (the tiny draft's answer decides, and the
/// decision follows it).
#[test]
fn the_second_opinion_decides_on_the_device_before_anything_is_sent() {
    let f = fixture();
    let router = example_with_opinion("on");
    let band = "13812345678";
    let mut rt = f.routed(&router);
    let sens = Arc::new(Fixed(
        tandem_router::Opinion::Sensitive,
        std::sync::atomic::AtomicUsize::new(0),
    ));
    rt.set_second_opinion(Some(sens.clone()));
    let a = rt
        .chat("o1", &[ChatMessage::user(band)], &gen(), &mut |_| true)
        .unwrap();
    assert_eq!(
        (a.route.action(), a.route.decision.rule.as_str()),
        (Action::Local, "second-opinion")
    );
    assert_eq!(f.rec.snapshot().connections, 0);
    assert_eq!(rt.pinned_by("o1").as_deref(), Some("second-opinion"));
    assert_eq!(sens.1.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Judged benign: the rules' default (speculative) stands and it is sent.
    rt.set_second_opinion(Some(Arc::new(Fixed(
        tandem_router::Opinion::Benign,
        std::sync::atomic::AtomicUsize::new(0),
    ))));
    let b = rt
        .chat("o2", &[ChatMessage::user(band)], &gen(), &mut |_| true)
        .unwrap();
    assert_eq!(b.route.action(), Action::Speculative);
    assert!(f.rec.snapshot().connections > 0);
    drop(rt);
    // The builder's default opinion: the tiny draft itself.
    let mut rt = f.routed(&router);
    let before = f.rec.snapshot();
    let c = rt
        .chat(
            "o3",
            &[ChatMessage::user("metformin dosing")],
            &gen(),
            &mut |_| true,
        )
        .unwrap();
    let judged = tandem_edge::DraftOpinion::new(f.draft.clone(), f.tok.clone())
        .unwrap()
        .judge_detailed("metformin dosing")
        .unwrap();
    match judged.opinion {
        tandem_router::Opinion::Benign => {
            assert_eq!(c.route.decision.rule, "second-opinion");
            assert_eq!(c.route.action(), Action::Speculative);
        }
        tandem_router::Opinion::Sensitive => {
            assert_eq!(c.route.action(), Action::Local);
            assert_eq!(f.rec.snapshot(), before, "a local turn went out");
        }
    }
}
