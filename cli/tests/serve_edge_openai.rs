//! `tandem serve-edge` as a user runs it, judged by the official `openai`
//! Python client (PyPI, pinned in tests/openai/requirements.txt): the built
//! binary serves the real draft model with a loopback `tandem serve-verifier`
//! child behind it serving the real *target*, so a temperature-0 chat answer
//! must be, token for token, `tandem generate --mode target`'s greedy output
//! (issue 8: temperature 0 = greedy = bit-exact target output), with every
//! token `verified` (non-streaming and streamed). tests/openai/test_client.py
//! runs chat, streaming with include_usage, a streamed stop list, usage
//! numbers, completions and
//! four error cases (404 model, max_tokens 0, n = 2, a 3 MB body → 413 in
//! OpenAI's shape) through the client; this test adds what the client
//! cannot see: the privacy route of an ID-number prompt, the admin API
//! behind its token, a two-turn conversation (turn 2 = the target's greedy
//! output for the whole history, with turn 1's state reused on the device and
//! on the verifier) and the context policy (refuse / drop_oldest).
//!
//! The Python comes from `TANDEM_OPENAI_PYTHON` (exported by .ci/run), else
//! `~/.cache/tandem/venv/bin/python`, which the test creates with the pinned
//! client (tests/openai/requirements.txt) when it cannot import `openai`; if
//! that fails too, the test fails and says how to create it.
#![allow(clippy::unwrap_used)]

mod common;

use common::{first_stdout_line, start_verifier, tandem, VerifierSpec};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use tandem_model::logprobs::{chosen_logprobs, TokenLogprobs};
use tandem_model::speculative::{generate_single, GenerateConfig};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::{LoadOptions, Model};

const TOKEN: &str = "serve-edge-token-0123456789";
const ADMIN: &str = "serve-edge-admin-0123456789";
const API_KEY: &str = "sk-serve-edge-0123456789";
const PROMPT: &str = "Write a Rust function that returns the larger of two i32 values.";

fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("TANDEM_OPENAI_PYTHON") {
        let p = PathBuf::from(p);
        assert!(
            p.exists(),
            "TANDEM_OPENAI_PYTHON={} does not exist",
            p.display()
        );
        return p;
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let venv = home.join(".cache/tandem/venv");
    let py = venv.join("bin/python");
    let has_openai = |py: &PathBuf| {
        std::process::Command::new(py)
            .args(["-c", "import openai"])
            .status()
            .is_ok_and(|s| s.success())
    };
    if !has_openai(&py) {
        // The README's `cargo test --workspace` on a machine where .ci/run
        // has not prepared the venv: create it with the pinned client.
        let req =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/openai/requirements.txt");
        eprintln!("creating {} with {}", venv.display(), req.display());
        let ok = std::process::Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .is_ok_and(|s| s.success())
            && std::process::Command::new(venv.join("bin/pip"))
                .args(["install", "-q", "-r"])
                .arg(&req)
                .status()
                .is_ok_and(|s| s.success());
        assert!(
            ok && has_openai(&py),
            "no Python with the openai client: set TANDEM_OPENAI_PYTHON, or run \
             `python3 -m venv ~/.cache/tandem/venv && ~/.cache/tandem/venv/bin/pip install -r tests/openai/requirements.txt` \
             (needs python3-venv; .ci/run does this)"
        );
    }
    py
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One HTTP/1.1 request with `Connection: close`; (status, body).
fn http(addr: &str, method: &str, path: &str, auth: Option<&str>, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(t) = auth {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    (
        head.split(' ').nth(1).unwrap().parse().unwrap(),
        rest.to_string(),
    )
}

/// A request written out in full (a browser's, say); (status, body).
fn http_raw(addr: &str, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    (
        head.split(' ').nth(1).unwrap().parse().unwrap(),
        rest.to_string(),
    )
}

/// Starts `tandem serve-edge --listen 127.0.0.1:0 EXTRA…` (admin token in
/// `TANDEM_TEST_ADMIN`, API key in `TANDEM_TEST_API_KEY`); (server, addr,
/// first stdout line).
fn serve_edge(extra: &[&str]) -> (Server, String, String) {
    let mut child = tandem()
        .args(["serve-edge", "--listen", "127.0.0.1:0"])
        .args(extra)
        .env("TANDEM_TEST_ADMIN", ADMIN)
        .env("TANDEM_TEST_API_KEY", API_KEY)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let line = first_stdout_line(&mut child);
    let server = Server(child);
    let addr = line
        .strip_prefix("serving http://")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    (server, addr, line)
}

#[test]
fn the_openai_python_client_accepts_serve_edge() {
    let t0 = std::time::Instant::now();
    let py = python();
    let dir = tempfile::tempdir().unwrap();
    let v = start_verifier(
        dir.path(),
        &VerifierSpec {
            listen: "127.0.0.1:0".into(),
            model: "target",
            token: TOKEN,
            extra_top: "insecure_loopback = true",
            limits: "",
        },
    );
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let verifier_url = format!("http://{}", v.grpc);
    // The draft proposer (the default is auto): the conversation checks below
    // need turn 1 to have run the draft over the prompt (auto runs it lazily,
    // and a turn lookup serves leaves no draft KV to reuse).
    let edge_config = dir.path().join("edge.toml");
    std::fs::write(&edge_config, "proposer = \"draft\"\n").unwrap();
    let (server, addr, line) = serve_edge(&[
        "--admin-token-env",
        "TANDEM_TEST_ADMIN",
        "--api-key-env",
        "TANDEM_TEST_API_KEY",
        "--verifier",
        &verifier_url,
        "--token-file",
        token_file.to_str().unwrap(),
        "--edge-config",
        edge_config.to_str().unwrap(),
    ]);
    assert!(line.trim_end().ends_with("model=tandem"), "{line:?}");

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/openai/test_client.py");
    let out = std::process::Command::new(&py)
        .arg(&script)
        .arg(format!("http://{addr}/v1"))
        .args(["tandem", PROMPT, API_KEY])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openai client test failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    eprintln!("openai client report: {report}");
    for key in ["token_status", "stream_token_status"] {
        let status = report[key].as_array().unwrap();
        assert!(
            !status.is_empty() && status.iter().all(|s| s == "verified"),
            "{key}: {report}"
        );
    }
    for key in ["route", "stream_route"] {
        assert_eq!(
            report[key]["decision"]["action"], "speculative",
            "{key}: {report}"
        );
    }

    // Greedy through the verifier = the target's own greedy output, run
    // target-only by `tandem generate` (same prompt, same 16 tokens).
    let own = tandem()
        .args([
            "generate",
            "--mode",
            "target",
            "--prompt",
            PROMPT,
            "--max-tokens",
            "16",
            "--json",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        own.status.success(),
        "{}",
        String::from_utf8_lossy(&own.stderr)
    );
    let own: serde_json::Value = serde_json::from_slice(&own.stdout).unwrap();
    assert_eq!(
        report["token_ids"], own["tokens"],
        "served token ids differ from the target's own greedy ids"
    );
    assert_eq!(
        report["content"], own["text"],
        "served text differs from the target's own"
    );
    assert_eq!(
        report["usage"][0], own["stats"]["prompt_tokens"],
        "{report}"
    );
    let finish = if own["stop"] == "max_tokens" {
        "length"
    } else {
        "stop"
    };
    assert_eq!(report["finish_reason"], finish, "{report} vs {own}");

    // Turn 2 of the conversation: the target's own greedy output for the
    // whole history, with turn 1's state reused on both sides.
    let turn2 = &report["turn2"];
    let history: Vec<ChatMessage> = turn2["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let content = m["content"].as_str().unwrap();
            match m["role"].as_str().unwrap() {
                "user" => ChatMessage::user(content),
                _ => ChatMessage::assistant(content),
            }
        })
        .collect();
    let (tok, target) = real_target();
    let want = target_greedy(&tok, &target, &tok.encode_chat(&history, true).unwrap(), 16);
    assert_eq!(
        turn2["token_ids"],
        serde_json::json!(want),
        "turn 2 differs from the target's own greedy output: {turn2}"
    );
    // Fill in the middle (`suffix`): the target's own greedy middle for the
    // Qwen FIM prompt.
    let fim = &report["fim"];
    let fim_prompt = tok
        .encode_fim(
            fim["prefix"].as_str().unwrap(),
            fim["suffix"].as_str().unwrap(),
        )
        .unwrap();
    let want_fim = target_greedy(&tok, &target, &fim_prompt, 8);
    assert_eq!(fim["token_ids"], serde_json::json!(want_fim), "FIM: {fim}");
    assert!(
        fim["token_status"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s == "verified"),
        "{fim}"
    );
    // logprobs (the official client's typed objects): the target's own
    // numbers for the verified tokens, with the penalties off.
    let lp = &report["logprobs"];
    let ids: Vec<u32> = serde_json::from_value(lp["token_ids"].clone()).unwrap();
    let prompt = tok.encode_chat(&[ChatMessage::user(PROMPT)], true).unwrap();
    let want = target_logprobs(&target, &prompt, &ids, 3);
    for (i, w) in want.iter().enumerate() {
        assert_eq!(
            lp["logprob"][i].as_f64().unwrap() as f32,
            w.logprob,
            "token {i}: {lp}"
        );
        for (j, (_, top)) in w.top.iter().enumerate() {
            assert_eq!(
                lp["top"][i][j].as_f64().unwrap() as f32,
                *top,
                "token {i}: {lp}"
            );
        }
        assert_eq!(lp["from"][i], "target", "{lp}");
    }
    let st = &turn2["stats"];
    assert!(st["draft_reused_tokens"].as_u64().unwrap() > 10, "{st}");
    assert!(st["verifier_reused_tokens"].as_u64().unwrap() > 10, "{st}");
    assert_eq!(st["continued_session"], true, "{st}");

    // The router keeps a prompt with a (synthetic) resident ID on the device.
    let body = serde_json::json!({"model": "tandem", "max_tokens": 4,
        "messages": [{"role": "user", "content": "my id is 11010519491231002X, remember it"}]});
    let (code, body) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        Some(API_KEY),
        &body.to_string(),
    );
    assert_eq!(code, 200, "{body}");
    let j: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(j["tandem"]["route"]["decision"]["action"], "local", "{j}");

    // What a web page can send is refused before anything is generated or
    // sent to the verifier: a cross-site text/plain POST (no CORS preflight)
    // and a DNS-rebinding Host (evil.example re-pointed at 127.0.0.1).
    let chat = serde_json::json!({"model": "tandem", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello"}]})
    .to_string();
    let port = addr.rsplit(':').next().unwrap();
    for (request, code) in [
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nOrigin: http://evil.example\r\n\
                 Content-Type: text/plain\r\nAuthorization: Bearer {API_KEY}\r\n\
                 Connection: close\r\nContent-Length: {}\r\n\r\n{chat}",
                chat.len()
            ),
            "origin_not_allowed",
        ),
        (
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: evil.example:{port}\r\n\
                 Content-Type: application/json\r\nAuthorization: Bearer {API_KEY}\r\n\
                 Connection: close\r\nContent-Length: {}\r\n\r\n{chat}",
                chat.len()
            ),
            "host_not_allowed",
        ),
    ] {
        let (status, body) = http_raw(&addr, &request);
        assert_eq!(status, 403, "{body}");
        let e: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(e["error"]["code"], code, "{e}");
    }
    assert!(j["tandem"]["token_status"]
        .as_array()
        .unwrap()
        .iter()
        .all(|s| s == "local"));

    // Admin API: token required; serve stats count the requests above
    // (chat, stream, stream with stop, turn 2, completion, FIM, the two
    // parallel ones, the logprobs chat, the local chat).
    let (code, _) = http(&addr, "GET", "/admin/v1/serve/stats", None, "");
    assert_eq!(code, 401);
    let (code, body) = http(&addr, "GET", "/admin/v1/serve/stats", Some(ADMIN), "");
    assert_eq!(code, 200, "{body}");
    let stats: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(stats["completed"], 10, "{stats}");
    assert_eq!(stats["parallel"], 2, "{stats}");
    let (code, body) = http(&addr, "GET", "/admin/v1/route/stats", Some(ADMIN), "");
    assert_eq!(code, 200, "{body}");
    let r: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (r["local"].as_u64(), r["speculative"].as_u64()),
        (Some(1), Some(9)),
        "{r}"
    );
    // A path axum cannot decode is refused in OpenAI's shape too.
    let (code, body) = http(&addr, "GET", "/v1/models/%FF", Some(API_KEY), "");
    assert_eq!(code, 400, "{body}");
    let e: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    tools_round_trip(&py, &addr, &tok, &target);
    format_round_trip(&py, &addr, &tok, &target);
    sigterm_drains(server, &addr);

    // --split 14: the device runs the target's layers [0, 14) itself and
    // ships hidden states (f32: exact); still the target's greedy tokens.
    let (split_server, split_addr, _) = serve_edge(&[
        "--verifier",
        &verifier_url,
        "--token-file",
        token_file.to_str().unwrap(),
        "--split",
        "14",
    ]);
    let body = serde_json::json!({"model": "tandem", "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": PROMPT}]});
    let (code, body) = http(
        &split_addr,
        "POST",
        "/v1/chat/completions",
        None,
        &body.to_string(),
    );
    assert_eq!(code, 200, "{body}");
    let j: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(j["tandem"]["token_ids"], own["tokens"], "split: {j}");
    assert!(
        j["tandem"]["token_status"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s == "verified"),
        "{j}"
    );
    assert_eq!(j["tandem"]["stats"]["split"]["layer"], 14, "{j}");
    drop(split_server);
    eprintln!("serve_edge_openai: {:.1} s", t0.elapsed().as_secs_f64());
}

/// SIGTERM while a streamed chat runs: the stream still ends with every
/// token and `[DONE]`, then the server exits 0 saying it drained.
fn sigterm_drains(mut server: Server, addr: &str) {
    let body = serde_json::json!({"model": "tandem", "max_tokens": 4, "temperature": 0,
        "stream": true, "messages": [{"role": "user", "content": PROMPT}]})
    .to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nAuthorization: Bearer {API_KEY}\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    // The first event (the route) is sent once the generation started.
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended before it started");
        seen.extend_from_slice(&buf[..n]);
    }
    let pid = server.0.id().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    s.read_to_end(&mut seen).unwrap();
    let text = String::from_utf8_lossy(&seen);
    assert!(text.contains("data: [DONE]"), "{text}");
    let ids: usize = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| v["tandem"]["token_ids"].as_array().map(Vec::len))
        .sum();
    assert!(ids > 0, "{text}");
    let status = server.0.wait().unwrap();
    assert!(status.success(), "serve-edge after SIGTERM: {status}");
}

/// The real target model and its tokenizer.
fn real_target() -> (Tokenizer, Model) {
    let path = tandem_fetch::model_path(tandem_fetch::ModelRole::Target);
    let model = Model::load(path, LoadOptions::with_max_seq_len(1024)).unwrap();
    let tok = Tokenizer::from_gguf(model.gguf()).unwrap();
    (tok, model)
}

/// Tools through the official client (tests/openai/test_tools.py): a
/// declared tool called by name (non-streamed) and by the model's own choice
/// (`auto`, streamed), then answered with a `tool` message; the named call
/// and the final answer are the target's own greedy output for the prompts
/// the chat template renders, the unforced call its own greedy output under
/// the lazy grammar of `auto`.
fn tools_round_trip(py: &PathBuf, addr: &str, tok: &Tokenizer, target: &Model) {
    let t0 = std::time::Instant::now();
    // serve-edge renders prompts with the device's tokenizer, the draft's:
    // its GGUF's chat template is not the target's byte for byte (the
    // target's writes the tool-call example with doubled braces, `{{"name":
    // …}}`: two more tokens), so the references render with the draft's.
    let draft_path = tandem_fetch::model_path(tandem_fetch::ModelRole::Draft);
    let draft_tok =
        Tokenizer::from_gguf(&tandem_model::gguf::GgufFile::open(&draft_path).unwrap()).unwrap();
    assert_eq!(draft_tok.fingerprint(), tok.fingerprint());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/openai/test_tools.py");
    let out = std::process::Command::new(py)
        .arg(&script)
        .arg(format!("http://{addr}/v1"))
        .args(["tandem", API_KEY])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openai tools test failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    eprintln!(
        "openai tools report ({:.1} s): {report}",
        t0.elapsed().as_secs_f64()
    );
    let tools = report["tools"].as_array().unwrap().clone();
    let (call, fin) = (&report["call"], &report["final"]);
    for r in [call, fin] {
        assert!(
            r["token_status"]
                .as_array()
                .unwrap()
                .iter()
                .all(|s| s == "verified"),
            "{r}"
        );
    }
    // The forced call: the target continues the call's opening; the server
    // stops once the call is closed (one call was asked for), so its tokens
    // are the start of the target's run.
    let question = ChatMessage::user(report["question"].as_str().unwrap());
    let mut prompt = draft_tok
        .encode_chat_with_tools(std::slice::from_ref(&question), &tools, true)
        .unwrap();
    prompt.extend(
        tok.encode(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ",
            false,
        )
        .unwrap(),
    );
    let served: Vec<u32> = serde_json::from_value(call["token_ids"].clone()).unwrap();
    // Its arguments follow the function's parameter schema (the grammar
    // serve-edge gives a forced call).
    let forced = serde_json::json!({"tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    let forced = tandem_edge_http::openai::tools::parse_tools(forced.as_object().unwrap())
        .unwrap()
        .unwrap();
    let spec = tandem_edge_http::openai::format::forced_call(
        tandem_edge_http::openai::tools::CallFormat::Hermes,
        &forced,
    )
    .unwrap()
    .spec;
    let want = target_greedy_as(tok, target, &prompt, served.len(), Some(spec));
    assert_eq!(
        served, want,
        "the call differs from the target's own: {call}"
    );
    // The unforced (`auto`) call: the target's own greedy output under the
    // lazy grammar serve-edge gives `auto` (free until the call starts; the
    // 1.5B target writes it as bare JSON, which triggers it at its start).
    let auto = &report["auto"];
    let auto_ids: Vec<u32> = serde_json::from_value(auto["token_ids"].clone()).unwrap();
    let text = tok.decode(&auto_ids, false).unwrap();
    assert!(
        text.trim_start().starts_with("{\"name\": \"get_weather\"") || text.contains("<tool_call>"),
        "the auto call is not one the lazy grammar triggers on: {text:?}"
    );
    let lazy = serde_json::json!({"tools": tools});
    let lazy = tandem_edge_http::openai::tools::parse_tools(lazy.as_object().unwrap())
        .unwrap()
        .unwrap();
    let lazy = tandem_edge_http::openai::format::lazy_call(
        tandem_edge_http::openai::tools::CallFormat::Hermes,
        &lazy,
    )
    .unwrap()
    .spec;
    let plain = draft_tok
        .encode_chat_with_tools(std::slice::from_ref(&question), &tools, true)
        .unwrap();
    let want = target_greedy_as(tok, target, &plain, auto_ids.len(), Some(lazy));
    assert_eq!(
        auto_ids, want,
        "the auto call differs from the target's own under the lazy grammar: {auto}"
    );
    // The final answer: the target's greedy output for the whole exchange.
    let mut assistant = ChatMessage::assistant("");
    assistant
        .tool_calls
        .push(tandem_model::tokenizer::ToolCall {
            id: call["id"].as_str().unwrap().into(),
            name: call["name"].as_str().unwrap().into(),
            arguments: serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap(),
        });
    let history = [
        question,
        assistant,
        ChatMessage::tool(
            call["id"].as_str().unwrap(),
            report["result"].as_str().unwrap(),
        ),
    ];
    // Asked with `tool_choice: "none"`: the tools are not offered.
    let prompt = draft_tok.encode_chat(&history, true).unwrap();
    let want = target_greedy(tok, target, &prompt, 10);
    assert_eq!(
        fin["token_ids"],
        serde_json::json!(want),
        "the final answer differs from the target's own: {fin}"
    );
}

/// Structured output through the official client (tests/openai/test_format.py):
/// a strict JSON schema, JSON mode streamed, the client's Pydantic `parse`,
/// and a schema that does not compile (400); the schema's answer is the
/// target's own greedy output under the schema, every token verified.
fn format_round_trip(py: &PathBuf, addr: &str, tok: &Tokenizer, target: &Model) {
    let t0 = std::time::Instant::now();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/openai/test_format.py");
    let out = std::process::Command::new(py)
        .arg(&script)
        .arg(format!("http://{addr}/v1"))
        .args(["tandem", API_KEY])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openai format test failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    eprintln!(
        "openai format report ({:.1} s): {report}",
        t0.elapsed().as_secs_f64()
    );
    assert!(
        report["token_status"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s == "verified"),
        "{report}"
    );
    let prompt = tok
        .encode_chat(
            &[ChatMessage::user(report["question"].as_str().unwrap())],
            true,
        )
        .unwrap();
    let spec = tandem_grammar::GrammarSpec::JsonSchema(report["schema"].clone());
    let n = report["max_tokens"].as_u64().unwrap() as usize;
    let want = target_greedy_as(tok, target, &prompt, n, Some(spec));
    assert_eq!(
        report["token_ids"],
        serde_json::json!(want),
        "the answer differs from the target's own under the schema: {report}"
    );
}

/// The real target's greedy token ids for `ids` (at most `n`), stopping at
/// an end-of-generation token.
fn target_greedy(tok: &Tokenizer, model: &Model, ids: &[u32], n: usize) -> Vec<u32> {
    target_greedy_as(tok, model, ids, n, None)
}

/// [`target_greedy`] under `spec` (structured output).
fn target_greedy_as(
    tok: &Tokenizer,
    model: &Model,
    ids: &[u32],
    n: usize,
    spec: Option<tandem_grammar::GrammarSpec>,
) -> Vec<u32> {
    let grammar = spec.map(|s| {
        let vocab = tandem_grammar::GrammarVocab::new(tok).unwrap();
        tandem_grammar::Grammar::new(&vocab, s)
            .unwrap()
            .into_config()
    });
    let cfg = GenerateConfig {
        max_tokens: n,
        stop_tokens: tok.chat_stop_tokens(),
        grammar,
        ..GenerateConfig::default()
    };
    generate_single(model, ids, &cfg, &mut |_| true)
        .unwrap()
        .tokens
}

/// The real target's logprobs (greedy, no penalties) of `ids` after
/// `prompt`, with `top` alternatives.
fn target_logprobs(model: &Model, prompt: &[u32], ids: &[u32], top: usize) -> Vec<TokenLogprobs> {
    let params = tandem_model::sampling::SamplingParams::default().for_prompt(prompt.len());
    let mut cache = model.new_cache();
    let mut logits = model.forward_last(prompt, 0, &mut cache).unwrap();
    let mut hist = prompt.to_vec();
    let mut out = Vec::new();
    for &t in ids {
        out.push(chosen_logprobs(&params, &logits, &hist, t, top));
        hist.push(t);
        logits = model.forward(&[t], cache.len(), &mut cache).unwrap();
    }
    out
}

#[test]
fn serve_edge_applies_the_context_policy_and_says_so() {
    // No verifier: the draft answers (what matters here is the prompt).
    let long = "Explain what a hash map is, in detail, with examples. ".repeat(6);
    let mut messages = vec![serde_json::json!({"role": "system", "content": "Be brief."})];
    for i in 0..6 {
        messages.push(serde_json::json!({"role": "user", "content": format!("{i}: {long}")}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("Answer {i}.")}));
    }
    messages.push(serde_json::json!({"role": "user", "content": "And in one word?"}));
    let body = serde_json::json!({"model": "tandem", "max_tokens": 4, "temperature": 0,
        "messages": messages})
    .to_string();
    // refuse (the default): 400 context_length_exceeded, naming the limit.
    let (server, addr, _) = serve_edge(&["--max-seq-len", "256"]);
    let (code, text) = http(&addr, "POST", "/v1/chat/completions", None, &body);
    assert_eq!(code, 400, "{text}");
    let e: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(e["error"]["code"], "context_length_exceeded", "{e}");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("256") && msg.contains("refuse"), "{msg}");
    drop(server);
    // drop_oldest: answered, and the reply says how many messages went.
    let (server, addr, _) =
        serve_edge(&["--max-seq-len", "256", "--context-policy", "drop_oldest"]);
    let (code, text) = http(&addr, "POST", "/v1/chat/completions", None, &body);
    assert_eq!(code, 200, "{text}");
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    let dropped = j["tandem"]["stats"]["dropped_messages"].as_u64().unwrap();
    assert!((1..=12).contains(&dropped), "{j}");
    assert!(j["usage"]["prompt_tokens"].as_u64().unwrap() < 256, "{j}");
    drop(server);
}

#[test]
fn serve_edge_refuses_bad_flags_before_loading_a_model() {
    let out = tandem()
        .args(["serve-edge", "--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a loopback address"));
    let out = tandem()
        .args([
            "serve-edge",
            "--listen",
            "127.0.0.1:0",
            "--admin-token-env",
            "TANDEM_TEST_SHORT",
        ])
        .env("TANDEM_TEST_SHORT", "short")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("at least 16 characters"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = tandem()
        .args([
            "serve-edge",
            "--listen",
            "127.0.0.1:0",
            "--api-key-env",
            "TANDEM_TEST_SHORT",
        ])
        .env("TANDEM_TEST_SHORT", "short")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("API key") && err.contains("at least 16 characters"),
        "{err}"
    );
}

#[test]
fn serve_edge_refuses_an_origin_that_is_not_one() {
    let _ = refuses_to_start(
        &["--listen", "127.0.0.1:0", "--allow-origin", "app.example"],
        "allowed_origins",
    );
}

/// `serve-edge` with the given extra args must exit with an error that
/// contains `want`, print no address line, and not panic (the device runtime
/// used to be dropped inside the async context on these paths); its stderr.
fn refuses_to_start(extra: &[&str], want: &str) -> String {
    let out = tandem()
        .arg("serve-edge")
        .args(extra)
        .stdout(Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(out.stdout.is_empty(), "{out:?}");
    assert!(err.contains(want), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    err.into_owned()
}

#[test]
fn serve_edge_refuses_a_zero_queue_depth() {
    // Every request would get 429 (the queue counts a request until the
    // worker takes it), so the server refuses to start.
    let _ = refuses_to_start(
        &["--listen", "127.0.0.1:0", "--queue-depth", "0"],
        "queue_depth must be at least 1",
    );
}

#[test]
fn serve_edge_reports_a_port_in_use() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let err = refuses_to_start(&["--listen", &addr], &format!("binding {addr}: "));
    // The OS reason once, not twice (it was in the message and the chain).
    assert_eq!(err.matches("os error").count(), 1, "{err}");
}
