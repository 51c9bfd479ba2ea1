//! The edge admin HTTP API against a real server on 127.0.0.1: auth, each
//! endpoint, a refused policy leaving the old one serving, hot reload of the
//! policy file (good, bad, good again), the decision counters and the device
//! state (`/v1/device`).

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tandem_edge::{DeviceState, SharedDeviceState, ThermalState};
use tandem_edge_http::admin::{self, policy_sha256, AdminConfig, AdminError, RunningAdmin};
use tandem_router::{Conversation, RouteContext, Router, DEFAULT_POLICY_TOML};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "admin-test-token-0123456789";
const ID_TEXT: &str = "我叫张伟，身份证11010519491231002X，最近确诊糖尿病";

/// One HTTP/1.1 request (`Connection: close`); returns status, lower-cased
/// headers and body.
async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    auth: Option<&str>,
    body: Option<&str>,
) -> (u16, Vec<(String, String)>, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(a) = auth {
        req.push_str(&format!("Authorization: {a}\r\n"));
    }
    let body = body.unwrap_or("");
    if method != "GET" {
        let ct = if body.trim_start().starts_with('{') {
            "application/json"
        } else {
            "application/toml"
        };
        req.push_str(&format!(
            "Content-Type: {ct}\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8(raw).unwrap();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap();
            (k.trim().to_ascii_lowercase(), v.trim().to_string())
        })
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    (status, headers, body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n").unwrap();
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            return out;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
}

const BEARER: &str = "Bearer admin-test-token-0123456789";

async fn get_json(addr: SocketAddr, path: &str) -> Value {
    let (st, _, body) = http(addr, "GET", path, Some(BEARER), None).await;
    assert_eq!(st, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

async fn start(router: Arc<Router>, policy_file: Option<&Path>) -> RunningAdmin {
    admin::start(
        router,
        SharedDeviceState::default(),
        AdminConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            token: TOKEN.into(),
            policy_file: policy_file.map(Path::to_path_buf),
            poll_interval_ms: 50,
            ..AdminConfig::default()
        },
    )
    .await
    .unwrap()
}

/// Wait (bounded) until `cond` holds for the JSON at `path`.
async fn wait_for(addr: SocketAddr, path: &str, cond: impl Fn(&Value) -> bool) -> Value {
    for _ in 0..200 {
        let v = get_json(addr, path).await;
        if cond(&v) {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "condition on {path} never held: {}",
        get_json(addr, path).await
    );
}

/// Replace a file the way editors do (write aside, then rename).
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test]
async fn every_endpoint_needs_the_bearer_token() {
    let a = start(Arc::new(Router::with_default_policy()), None).await;
    let explain = r#"{"text": "hello"}"#;
    let endpoints = [
        ("GET", "/v1/policy", None),
        ("PUT", "/v1/policy", Some(DEFAULT_POLICY_TOML)),
        ("POST", "/v1/route/explain", Some(explain)),
        ("GET", "/v1/route/stats", None),
        ("GET", "/v1/device", None),
        ("PUT", "/v1/device", Some(r#"{"thermal": "fair"}"#)),
    ];
    for (method, path, body) in endpoints {
        for auth in [
            None,
            Some("Bearer wrong-token-0123456789xx"),
            Some("Bearer "),
            Some("Basic YWRtaW46YWRtaW4="),
            Some(TOKEN), // no scheme
        ] {
            let (st, headers, resp) = http(a.addr, method, path, auth, body).await;
            assert_eq!(st, 401, "{method} {path} with {auth:?}: {resp}");
            assert!(headers
                .iter()
                .any(|(k, v)| k == "www-authenticate" && v == "Bearer"));
            assert!(resp.contains("bearer token"));
        }
        let (st, _, resp) = http(a.addr, method, path, Some(BEARER), body).await;
        assert_eq!(st, 200, "{method} {path}: {resp}");
    }
    // Refused requests changed nothing: one PUT went through.
    let stats = get_json(a.addr, "/v1/route/stats").await;
    assert_eq!(stats["reloads"]["api_ok"], 1);
    assert_eq!(stats["generation"], 2);
    a.shutdown().await;
}

#[tokio::test]
async fn get_policy_serves_the_current_toml_with_generation_and_hash() {
    let a = start(Arc::new(Router::with_default_policy()), None).await;
    let p = get_json(a.addr, "/v1/policy").await;
    assert_eq!(p["source"], DEFAULT_POLICY_TOML);
    assert_eq!(p["generation"], 1);
    assert_eq!(p["sha256"], policy_sha256(DEFAULT_POLICY_TOML));
    assert_eq!(p["sha256"].as_str().unwrap().len(), 64);
    assert_eq!(p["file"], Value::Null);
    a.shutdown().await;
}

const CUSTOM: &str = r#"version = 1
default = "speculative"

[[recognizers]]
name = "TICKET"
pattern = 'TCK-[0-9]{5}'
score = 0.9

[[rules]]
name = "tickets"
action = "local"
entities = ["TICKET"]
"#;

// Line 6 names an unknown entity type.
const BAD_FIELD: &str = r#"version = 1
default = "speculative"

[[rules]]
name = "ids"
entities = ["CN_ID"]
action = "local"
"#;

#[tokio::test]
async fn put_policy_swaps_a_valid_one_and_refuses_an_invalid_one() {
    let router = Arc::new(Router::with_default_policy());
    let a = start(router.clone(), None).await;
    let explain = |text: &str| json!({ "text": text }).to_string();
    // Before: the default policy flags the ID, not the ticket.
    let (_, _, b) = http(
        a.addr,
        "POST",
        "/v1/route/explain",
        Some(BEARER),
        Some(&explain("ticket TCK-12345")),
    )
    .await;
    assert_eq!(
        serde_json::from_str::<Value>(&b).unwrap()["action"],
        "speculative"
    );

    // Invalid field: 400 naming line and field; the old policy keeps serving.
    let (st, _, body) = http(a.addr, "PUT", "/v1/policy", Some(BEARER), Some(BAD_FIELD)).await;
    assert_eq!(st, 400, "{body}");
    let e: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(e["line"], 6);
    assert_eq!(e["field"], "rules[0].entities");
    assert!(e["error"].as_str().unwrap().contains("CN_ID"));
    // Invalid TOML: 400 with its line.
    let broken = "version = 1\ndefault = \"speculative\"\n[[rules]\nname = \"x\"\n";
    let (st, _, body) = http(a.addr, "PUT", "/v1/policy", Some(BEARER), Some(broken)).await;
    assert_eq!(st, 400, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["line"], 3);
    let p = get_json(a.addr, "/v1/policy").await;
    assert_eq!(p["source"], DEFAULT_POLICY_TOML);
    assert_eq!(p["generation"], 1);
    let d = router.decide(ID_TEXT, &RouteContext::default());
    assert_eq!(d.rule, "sensitive-entities", "old policy still decides");

    // Valid: swapped, new generation and hash; decisions follow at once.
    let (st, _, body) = http(a.addr, "PUT", "/v1/policy", Some(BEARER), Some(CUSTOM)).await;
    assert_eq!(st, 200, "{body}");
    let ok: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(ok["generation"], 2);
    assert_eq!(ok["sha256"], policy_sha256(CUSTOM));
    let p = get_json(a.addr, "/v1/policy").await;
    assert_eq!(
        (p["source"].as_str().unwrap(), &p["generation"]),
        (CUSTOM, &json!(2))
    );
    let (_, _, b) = http(
        a.addr,
        "POST",
        "/v1/route/explain",
        Some(BEARER),
        Some(&explain("ticket TCK-12345")),
    )
    .await;
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(
        (&v["action"], &v["rule"]),
        (&json!("local"), &json!("tickets"))
    );
    assert_eq!(v["policy_generation"], 2);
    assert_eq!(
        router.decide(ID_TEXT, &RouteContext::default()).rule,
        "default"
    );

    let r = get_json(a.addr, "/v1/route/stats").await["reloads"].clone();
    assert_eq!((&r["api_ok"], &r["api_rejected"]), (&json!(1), &json!(2)));
    assert!(r["last_error"].as_str().unwrap().contains("line 3"));
    a.shutdown().await;
}

#[tokio::test]
async fn explain_shows_rule_spans_scores_and_categories_but_not_the_text() {
    let router = Arc::new(Router::with_default_policy());
    let a = start(router.clone(), None).await;
    let req = json!({ "text": ID_TEXT }).to_string();
    let (st, _, body) = http(
        a.addr,
        "POST",
        "/v1/route/explain",
        Some(BEARER),
        Some(&req),
    )
    .await;
    assert_eq!(st, 200, "{body}");
    println!("POST /v1/route/explain {req}\n{body}");
    for secret in ["11010519491231002X", "张伟", "糖尿病"] {
        assert!(!body.contains(secret), "explain echoed {secret}");
    }
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["action"], "local");
    assert_eq!(v["rule"], "sensitive-entities");
    let ents = v["entities"].as_array().unwrap();
    let id = ents.iter().find(|e| e["type"] == "CN_RESIDENT_ID").unwrap();
    let (s, e) = (
        id["start"].as_u64().unwrap() as usize,
        id["end"].as_u64().unwrap() as usize,
    );
    assert_eq!(&ID_TEXT[s..e], "11010519491231002X");
    assert!(id["score"].as_f64().unwrap() >= 0.5);
    let name = ents.iter().find(|e| e["type"] == "PERSON_NAME").unwrap();
    let (s, e) = (
        name["start"].as_u64().unwrap() as usize,
        name["end"].as_u64().unwrap() as usize,
    );
    assert_eq!(&ID_TEXT[s..e], "张伟");
    assert_eq!(v["categories"], json!(["health"]));
    let hits = v["category_hits"].as_array().unwrap();
    assert!(hits.iter().any(|h| {
        let (s, e) = (
            h["start"].as_u64().unwrap() as usize,
            h["end"].as_u64().unwrap() as usize,
        );
        h["category"] == "health" && &ID_TEXT[s..e] == "糖尿病"
    }));
    // The live context can be supplied.
    let req = json!({ "text": "sort a list", "context": { "user_opt_out": true } }).to_string();
    let (_, _, body) = http(
        a.addr,
        "POST",
        "/v1/route/explain",
        Some(BEARER),
        Some(&req),
    )
    .await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (&v["action"], &v["rule"]),
        (&json!("local"), &json!("user-opt-out"))
    );
    // Malformed requests: 400.
    for bad in [r#"{"txt": "x"}"#, "{not json", r#"{"text": 5}"#] {
        let (st, _, body) =
            http(a.addr, "POST", "/v1/route/explain", Some(BEARER), Some(bad)).await;
        assert_eq!(st, 400, "{bad}: {body}");
    }
    // Explaining is diagnostic: not counted as a decision.
    assert_eq!(get_json(a.addr, "/v1/route/stats").await["total"], 0);
    a.shutdown().await;
}

/// The explain's `frames` are those of `tandem route explain --json`
/// (`Policy::frame_reports`, the one conversion both serve): a denial set
/// aside, a hypothetical kept because its clause tells of the past, and
/// none at all; offsets only, never the text.
#[tokio::test]
async fn explain_shows_the_frames_of_route_explain() {
    let router = Arc::new(Router::with_default_policy());
    let a = start(router.clone(), None).await;
    let explain = |text: &'static str| {
        let addr = a.addr;
        async move {
            let req = json!({ "text": text }).to_string();
            let (st, _, body) =
                http(addr, "POST", "/v1/route/explain", Some(BEARER), Some(&req)).await;
            assert_eq!(st, 200, "{body}");
            body
        }
    };
    let denial = "I don't have diabetes. What is a normal fasting glucose level?";
    let past = "If I had leukemia as a kid, would insurers still cover me?";
    for (text, action, frame, counted) in [
        (denial, "speculative", "negated", false),
        (past, "local", "hypothetical_kept", true),
    ] {
        let body = explain(text).await;
        println!("POST /v1/route/explain {text:?}\n{body}");
        for word in ["diabetes", "leukemia", "don't have", "If I had"] {
            assert!(!body.contains(word), "explain echoed {word}");
        }
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["action"], action, "{body}");
        let want = serde_json::to_value(router.policy().frame_reports(text)).unwrap();
        assert_eq!(v["frames"], want);
        let f = &v["frames"][0];
        assert_eq!(f["frame"], frame, "{body}");
        assert_eq!(f["counted"], counted, "{body}");
        let span = |k: &str| {
            let s = f[k][0].as_u64().unwrap() as usize;
            let e = f[k][1].as_u64().unwrap() as usize;
            &text[s..e]
        };
        let term =
            &text[f["start"].as_u64().unwrap() as usize..f["end"].as_u64().unwrap() as usize];
        match frame {
            "negated" => {
                assert_eq!((term, span("marker")), ("diabetes", "don't have"));
            }
            _ => {
                assert_eq!((term, span("marker")), ("leukemia", "If I had"));
                assert_eq!(
                    f["kept_because"],
                    "the clause tells of the past: a statement of fact"
                );
            }
        }
    }
    let v: Value = serde_json::from_str(&explain("sort a list").await).unwrap();
    assert_eq!(v["frames"], json!([]));
    a.shutdown().await;
}

#[tokio::test]
async fn stats_count_decisions_by_rule_and_action() {
    let router = Arc::new(Router::with_default_policy());
    let a = start(router.clone(), None).await;
    let idle = RouteContext::default();
    router.decide("reverse a linked list in Rust", &idle);
    router.decide("write a quicksort", &idle);
    let mut conv = Conversation::new();
    conv.decide_turn(&router, ID_TEXT, &idle);
    conv.decide_turn(&router, "thanks, and a haiku?", &idle);
    router.decide(
        "anything",
        &RouteContext {
            user_opt_out: true,
            ..idle
        },
    );
    let s = get_json(a.addr, "/v1/route/stats").await;
    println!("GET /v1/route/stats\n{s}");
    assert_eq!(
        (&s["total"], &s["local"], &s["speculative"]),
        (&json!(5), &json!(3), &json!(2))
    );
    assert_eq!(s["by_rule"]["default"]["speculative"], 2);
    assert_eq!(s["by_rule"]["sensitive-entities"]["local"], 1);
    assert_eq!(s["by_rule"]["sticky:sensitive-entities"]["local"], 1);
    assert_eq!(s["by_rule"]["user-opt-out"]["local"], 1);
    assert_eq!(s["generation"], 1);
    let body = s.to_string();
    assert!(!body.contains("11010519491231002X") && !body.contains("haiku"));
    a.shutdown().await;
}

#[tokio::test]
async fn policy_file_is_hot_reloaded_and_a_bad_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.toml");
    std::fs::write(&file, DEFAULT_POLICY_TOML).unwrap();
    let router = Arc::new(Router::from_file(&file).unwrap());
    let a = start(router.clone(), Some(&file)).await;
    assert_eq!(
        get_json(a.addr, "/v1/policy").await["file"],
        file.to_str().unwrap()
    );

    // A valid change is swapped in.
    replace(&file, CUSTOM);
    let p = wait_for(a.addr, "/v1/policy", |p| p["generation"] == 2).await;
    assert_eq!(p["source"], CUSTOM);
    assert_eq!(
        router.decide("TCK-00042", &RouteContext::default()).rule,
        "tickets"
    );

    // An invalid one is refused; the last good policy keeps serving.
    replace(&file, BAD_FIELD);
    let s = wait_for(a.addr, "/v1/route/stats", |s| {
        s["reloads"]["file_rejected"] == 1
    })
    .await;
    let err = s["reloads"]["last_error"].as_str().unwrap().to_string();
    assert!(
        err.contains("line 6") && err.contains("rules[0].entities"),
        "{err}"
    );
    let p = get_json(a.addr, "/v1/policy").await;
    assert_eq!(
        (p["source"].as_str().unwrap(), &p["generation"]),
        (CUSTOM, &json!(2))
    );
    assert_eq!(
        router.decide("TCK-00042", &RouteContext::default()).rule,
        "tickets"
    );

    // A missing file (mid-rename) changes nothing; fixed again, it is loaded.
    std::fs::remove_file(&file).unwrap();
    replace(&file, DEFAULT_POLICY_TOML);
    let p = wait_for(a.addr, "/v1/policy", |p| p["generation"] == 3).await;
    assert_eq!(p["source"], DEFAULT_POLICY_TOML);
    let r = a.reload_counters();
    assert_eq!((r.file_ok, r.file_rejected, r.api_ok), (2, 1, 0));
    a.shutdown().await;
}

#[tokio::test]
async fn a_put_is_written_to_the_policy_file_before_it_serves() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.toml");
    std::fs::write(&file, DEFAULT_POLICY_TOML).unwrap();
    let router = Arc::new(Router::from_file(&file).unwrap());
    let a = start(router.clone(), Some(&file)).await;
    let (st, _, body) = http(a.addr, "PUT", "/v1/policy", Some(BEARER), Some(CUSTOM)).await;
    assert_eq!(st, 200, "{body}");
    // On disk by the time the PUT is answered (a restart serves it).
    assert_eq!(std::fs::read_to_string(&file).unwrap(), CUSTOM);
    let p = get_json(a.addr, "/v1/policy").await;
    assert_eq!(
        (p["source"].as_str(), &p["generation"]),
        (Some(CUSTOM), &json!(2))
    );
    // A refused PUT leaves the file alone.
    let (st, _, _) = http(a.addr, "PUT", "/v1/policy", Some(BEARER), Some(BAD_FIELD)).await;
    assert_eq!(st, 400);
    assert_eq!(std::fs::read_to_string(&file).unwrap(), CUSTOM);
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "temporary files left: {names:?}");
    let r = a.reload_counters();
    assert_eq!((r.api_ok, r.api_rejected, r.file_ok), (1, 1, 0));
    assert_eq!(router.generation(), 2);
    a.shutdown().await;

    // A file that cannot be written: 500, and the old policy keeps serving.
    let router = Arc::new(Router::with_default_policy());
    let gone = dir.path().join("no-such-dir").join("policy.toml");
    let a = start(router.clone(), Some(&gone)).await;
    let (st, _, body) = http(a.addr, "PUT", "/v1/policy", Some(BEARER), Some(CUSTOM)).await;
    assert_eq!(st, 500, "{body}");
    assert!(body.contains("writing the policy file"), "{body}");
    assert_eq!(router.policy().source(), DEFAULT_POLICY_TOML);
    assert_eq!(router.generation(), 1);
    a.shutdown().await;
}

#[tokio::test]
async fn a_file_that_differs_from_the_serving_policy_at_start_is_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.toml");
    std::fs::write(&file, CUSTOM).unwrap();
    let a = start(Arc::new(Router::with_default_policy()), Some(&file)).await;
    let p = wait_for(a.addr, "/v1/policy", |p| p["generation"] == 2).await;
    assert_eq!(p["source"], CUSTOM);
    a.shutdown().await;
}

#[tokio::test]
async fn start_refuses_a_short_token_and_a_public_address() {
    let router = Arc::new(Router::with_default_policy());
    let short = AdminConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        token: "short".into(),
        ..AdminConfig::default()
    };
    assert!(matches!(
        admin::start(router.clone(), SharedDeviceState::default(), short).await,
        Err(AdminError::Config(m)) if m.contains("token")
    ));
    let public = AdminConfig {
        listen: "0.0.0.0:0".parse().unwrap(),
        token: TOKEN.into(),
        ..AdminConfig::default()
    };
    assert!(matches!(
        admin::start(router.clone(), SharedDeviceState::default(), public).await,
        Err(AdminError::Config(m)) if m.contains("loopback")
    ));
    // The default binds loopback.
    assert!(AdminConfig::default().listen.ip().is_loopback());
    let cfg: AdminConfig = toml::from_str(&format!(
        "listen = \"127.0.0.1:0\"\ntoken = \"{TOKEN}\"\npoll_interval_ms = 100\n"
    ))
    .unwrap();
    let a = admin::start(router, SharedDeviceState::default(), cfg)
        .await
        .unwrap();
    assert!(a.addr.ip().is_loopback() && a.addr.port() != 0);
    a.shutdown().await;
}

#[tokio::test]
async fn put_device_sets_the_state_the_runtime_reads_and_get_shows_the_adjustments() {
    // The handle a runtime would read at the start of each generation
    // (`EdgeRuntime::device_handle`; serve-edge mounts it under /admin).
    let device = SharedDeviceState::default();
    let a = admin::start(
        Arc::new(Router::with_default_policy()),
        device.clone(),
        AdminConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            token: TOKEN.into(),
            ..AdminConfig::default()
        },
    )
    .await
    .unwrap();
    let idle = get_json(a.addr, "/v1/device").await;
    println!("GET /v1/device\n{idle}");
    assert_eq!(idle["state"]["thermal"], Value::Null);
    assert_eq!(idle["adjustments"]["k_cap"], Value::Null);
    assert_eq!(
        idle["adjustments"]["draft_threads"],
        idle["adjustments"]["base_threads"]
    );

    let hot = r#"{"thermal": "critical", "battery_pct": 15, "charging": false}"#;
    let (st, _, body) = http(a.addr, "PUT", "/v1/device", Some(BEARER), Some(hot)).await;
    assert_eq!(st, 200, "{body}");
    let put: Value = serde_json::from_str(&body).unwrap();
    println!("PUT /v1/device {hot}\n{put}");
    assert_eq!(put["state"]["thermal"], "critical");
    assert_eq!(put["adjustments"]["draft_threads"], 1);
    assert_eq!(put["adjustments"]["k_cap"], 2);
    assert_eq!(
        put["adjustments"]["reasons"],
        json!(["thermal critical", "battery 15% < 20%"])
    );
    // The runtime's handle sees it.
    assert_eq!(
        device.get(),
        DeviceState {
            thermal: Some(ThermalState::Critical),
            battery_pct: Some(15),
            ..DeviceState::default()
        }
    );
    assert_eq!(get_json(a.addr, "/v1/device").await, put);

    // Refused: a state out of range, an unknown thermal name, an unknown
    // field, not JSON. The state stays.
    for bad in [
        r#"{"battery_pct": 101}"#,
        r#"{"thermal": "hot"}"#,
        r#"{"temperature": 80}"#,
        "thermal = 1",
    ] {
        let (st, _, body) = http(a.addr, "PUT", "/v1/device", Some(BEARER), Some(bad)).await;
        assert_eq!(st, 400, "{bad}: {body}");
        let e: Value = serde_json::from_str(&body).unwrap();
        assert!(e["error"].as_str().unwrap().contains("device state"), "{e}");
    }
    assert_eq!(device.get().thermal, Some(ThermalState::Critical));
    // Set from the app's side: the API shows it.
    device.set(DeviceState::default()).unwrap();
    assert_eq!(
        get_json(a.addr, "/v1/device").await["adjustments"]["k_cap"],
        Value::Null
    );
    a.shutdown().await;
}
