//! The local OpenAI-compatible HTTP server (`tandem serve-edge`).
//!
//! | method and path | answer |
//! | --- | --- |
//! | `POST /v1/chat/completions` | chat completion; `stream: true` → SSE chunks, `data: [DONE]`; `stream_options.include_usage`; `tools` / `tool_choice` ([`tools`], calls parsed by `call_scan`) |
//! | `POST /v1/completions` | text completion (raw prompt, no chat template), same options; with `suffix`: fill in the middle |
//! | `POST /infill` | llama.cpp's fill-in-the-middle (`input_prefix`, `input_suffix`, `input_extra`, `prompt`); llama.cpp's answer shape (`content`, `stop`) |
//! | `GET /v1/models`, `GET /v1/models/{id}` | the one served model id |
//! | `POST /tokenize`, `POST /detokenize` | llama.cpp's shapes: `{"content"}` → `{"tokens"}`, `{"tokens"}` → `{"content"}` |
//! | `GET /metrics` | Prometheus text ([`metrics`]): requests, tokens, TTFT and tokens/s histograms, queue |
//! | `GET /health` | `{"status":"ok"}` |
//! | `/admin/v1/...` | the admin API of [`crate::admin`] (policy, explain, route stats) plus `GET /admin/v1/serve/stats`, behind a bearer token; 403 when no token is configured |
//!
//! Before any handler, [`guard`] refuses requests from a `Host` or browser
//! `Origin` the server does not answer to (403: DNS rebinding, cross-site
//! pages), `/v1` POSTs not declared `application/json` (415) and, when an
//! API key is configured, `/v1` requests without it (401).
//!
//! Errors use OpenAI's shape `{"error": {message, type, param, code}}`.
//! `temperature` 0 or absent is greedy (with a verifier: token for token the
//! target's greedy output); > 0 samples (with a verifier: token for token the
//! target's own sampled output for the `seed`). `presence_penalty`,
//! `frequency_penalty` and `logit_bias` apply on the device and the verifier
//! alike (the same function); `n` > 1 runs the choices one after the other;
//! `logprobs` come from the distribution that chose each token (the target's
//! for verified tokens, the draft's for local and provisional ones:
//! [`logprobs`]).
//! Extension fields (`tandem` in every answer and chunk) carry per-token
//! status, the routing decision (no text) and the edge statistics; the full
//! reference is `docs/api.md`.
//!
//! Generations run on `parallel` slot threads ([`worker`]) behind one
//! bounded FIFO queue (429 when full); a client that goes away cancels its
//! generation, which closes the verifier session and frees its slot.
//! [`RunningServer::drain`] (SIGTERM in `tandem serve-edge`) lets the
//! admitted requests finish before it returns.

mod call_scan;
pub mod error;
pub mod format;
mod guard;
pub mod logprobs;
pub mod metrics;
pub mod peer;
pub mod request;
mod tokenize;
pub mod tools;
pub mod worker;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, Request, State};
use axum::http::{Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::admin::{self, AdminConfig, MountedAdmin};
pub use error::{ApiError, ServeError};
pub use metrics::ServeCounters;
use request::{GenRequest, Limits};
use tandem_edge::RoutedRuntime;
use tandem_edge::{ProvisionalCheck, TokenStatus};
use worker::{Event, Job, Worker};

/// Configuration of [`start`].
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Address to bind; loopback unless `allow_non_loopback`, which needs
    /// an `api_key` (the `/v1` API has no other authentication).
    pub listen: SocketAddr,
    pub allow_non_loopback: bool,
    /// `Host` names served besides the loopback ones (`127.0.0.1`,
    /// `localhost`, `[::1]`, any port), e.g. the LAN name clients use with
    /// `allow_non_loopback`; port ignored, case-insensitive. Any other `Host`
    /// gets 403 (DNS rebinding).
    pub allowed_hosts: Vec<String>,
    /// Browser origins (`scheme://host[:port]`) allowed to call the API
    /// besides loopback ones; they get CORS headers. A request with any other
    /// `Origin` gets 403; one without `Origin` (a non-browser client) passes.
    pub allowed_origins: Vec<String>,
    /// API key every `/v1` request must carry as `Authorization: Bearer
    /// <key>` (at least 16 chars); `None`: no key.
    pub api_key: Option<String>,
    /// The model id clients must name (`GET /v1/models` lists it).
    pub model_id: String,
    /// Requests that may wait while every slot generates; one more gets
    /// 429.
    pub queue_depth: usize,
    /// Generations that may run at once (slots; each has its own draft KV
    /// and verifier session, the draft weights are shared). At least 1, at
    /// most [`MAX_PARALLEL`].
    pub parallel: usize,
    /// Largest `max_tokens` accepted (400 above).
    pub max_tokens_limit: usize,
    /// `max_tokens` when the request has none.
    pub default_max_tokens: usize,
    /// Ask the privacy router before each generation (`local` = draft only,
    /// nothing leaves the device). Off: every request goes to the verifier
    /// when one is configured.
    pub routed: bool,
    /// The admin API under `/admin` (token ≥ 16 chars, optional policy file
    /// hot reload). `None`: `/admin/...` answers 403.
    pub admin: Option<AdminConfig>,
    /// Unknown request fields are a 400 naming them (OpenAI's behaviour,
    /// `--strict-api`). Off (the default): they are ignored, as vLLM and
    /// llama.cpp do, and named in the `x-tandem-ignored-fields` header.
    pub strict_api: bool,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            allow_non_loopback: false,
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            api_key: None,
            model_id: "tandem".into(),
            queue_depth: 8,
            parallel: 2,
            max_tokens_limit: 4096,
            default_max_tokens: 256,
            routed: true,
            admin: None,
            strict_api: false,
        }
    }
}

/// Most generation slots a server may have ([`ServeConfig::parallel`]).
pub const MAX_PARALLEL: usize = 64;

struct AppState {
    cfg: ServeConfig,
    access: Arc<guard::Access>,
    worker: Worker,
    /// The draft's tokenizer (`/tokenize`, `/detokenize`, FIM checks).
    tokenizer: tandem_model::tokenizer::Tokenizer,
    /// The draft GGUF's file name (a FIM refusal names it).
    model_file: String,
    admin_token: Option<String>,
    created: u64,
    next_id: AtomicU64,
}

impl AppState {
    fn limits(&self) -> Limits<'_> {
        Limits {
            model_id: &self.cfg.model_id,
            max_tokens_limit: self.cfg.max_tokens_limit,
            default_max_tokens: self.cfg.default_max_tokens,
            strict: self.cfg.strict_api,
            vocab: self.tokenizer.vocab_size(),
        }
    }

    fn id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}{n:04x}", self.created)
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A running server. Dropping it without [`RunningServer::shutdown`] aborts
/// the server task and cancels generation.
pub struct RunningServer {
    /// The bound address (useful with port 0).
    pub addr: SocketAddr,
    state: Arc<AppState>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
    admin: Option<MountedAdmin>,
}

impl RunningServer {
    pub fn counters(&self) -> ServeCounters {
        self.state.worker.counters()
    }

    /// Policy reload counters of the mounted admin API, if any.
    pub fn reload_counters(&self) -> Option<admin::ReloadCounters> {
        self.admin.as_ref().map(MountedAdmin::reload_counters)
    }

    /// Stops accepting new connections and lets every admitted request
    /// (running or queued) finish and be answered; then stops the workers.
    /// When `abort` resolves first (a second signal), the rest is cancelled
    /// as by [`Self::shutdown`].
    pub async fn drain(mut self, abort: impl std::future::Future<Output = ()>) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(mut t) = self.task.take() {
            tokio::select! {
                _ = &mut t => {}
                _ = abort => {
                    self.state.worker.stop();
                    let _ = t.await;
                }
            }
        }
        self.state.worker.stop();
    }

    /// Stops accepting, cancels the running and queued generations, and
    /// waits for open connections to finish.
    pub async fn shutdown(mut self) {
        self.state.worker.stop();
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }

    /// Serves until `trigger` resolves, then shuts down.
    pub async fn run_until(self, trigger: impl std::future::Future<Output = ()>) {
        trigger.await;
        self.shutdown().await;
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        self.state.worker.stop();
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// Drops the runtime on a plain thread: it owns a tokio runtime, which
/// panics when dropped from async code — as it would be when [`start`]
/// fails before the worker took it (port in use, bad config).
fn drop_off_async(rt: RoutedRuntime) {
    let dropper = std::thread::Builder::new()
        .name("tandem-serve-drop".into())
        .spawn(move || drop(rt));
    if let Ok(h) = dropper {
        let _ = h.join();
    }
}

/// The runtimes of `parallel` slots: `rt` and its siblings
/// ([`RoutedRuntime::sibling`]). On an error every runtime made is dropped
/// off async code.
fn slot_runtimes(rt: RoutedRuntime, parallel: usize) -> Result<Vec<RoutedRuntime>, ServeError> {
    let mut rts = Vec::with_capacity(parallel);
    for _ in 1..parallel {
        match rt.sibling() {
            Ok(s) => rts.push(s),
            Err(e) => {
                rts.push(rt);
                for r in rts {
                    drop_off_async(r);
                }
                return Err(ServeError::Config(format!("generation slot: {e}")));
            }
        }
    }
    rts.insert(0, rt);
    Ok(rts)
}

/// Everything [`start`] checks and binds before the worker takes the runtime.
async fn prepare(
    router: Arc<tandem_router::Router>,
    device: tandem_edge::SharedDeviceState,
    cfg: &ServeConfig,
) -> Result<Prepared, ServeError> {
    if !cfg.listen.ip().is_loopback() && !cfg.allow_non_loopback {
        return Err(ServeError::Config(format!(
            "listen {} is not a loopback address; set allow_non_loopback to expose the /v1 API (and an api_key: it has no authentication without one)",
            cfg.listen
        )));
    }
    if cfg.allow_non_loopback && cfg.api_key.is_none() {
        return Err(ServeError::Config(
            "allow_non_loopback exposes the /v1 API beyond this machine: it needs an api_key \
             (--api-key-env), or the API would answer anyone who can reach the port"
                .into(),
        ));
    }
    let access = Arc::new(guard::Access::new(cfg)?);
    if cfg.model_id.is_empty() {
        return Err(ServeError::Config("model_id must not be empty".into()));
    }
    if cfg.queue_depth == 0 {
        // The worker admits a request only while fewer than `queue_depth`
        // wait (the running one included until the worker takes it): with 0
        // every request would get 429, even on an idle server.
        return Err(ServeError::Config(
            "queue_depth must be at least 1 (requests that may wait while one generates)".into(),
        ));
    }
    if cfg.parallel == 0 || cfg.parallel > MAX_PARALLEL {
        return Err(ServeError::Config(format!(
            "parallel must be in 1..={MAX_PARALLEL} (generations at once), got {}",
            cfg.parallel
        )));
    }
    if cfg.max_tokens_limit == 0 || cfg.default_max_tokens == 0 {
        return Err(ServeError::Config(
            "max_tokens_limit and default_max_tokens must be > 0".into(),
        ));
    }
    let mounted = match &cfg.admin {
        Some(a) => Some(admin::mount(router, device, a)?),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: cfg.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| ServeError::Bind {
        addr: cfg.listen,
        source,
    })?;
    Ok(Prepared {
        admin: mounted,
        listener,
        addr,
        access,
    })
}

/// What [`prepare`] checked and bound.
struct Prepared {
    admin: Option<MountedAdmin>,
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    access: Arc<guard::Access>,
}

/// Binds and serves (call inside a tokio runtime). The runtime moves to the
/// generation thread.
pub async fn start(rt: RoutedRuntime, cfg: ServeConfig) -> Result<RunningServer, ServeError> {
    let Prepared {
        admin: mounted,
        listener,
        addr,
        access,
    } = match prepare(rt.router().clone(), rt.runtime().device_handle(), &cfg).await {
        Ok(p) => p,
        Err(e) => {
            drop_off_async(rt);
            return Err(e);
        }
    };
    let mut rt = rt;
    // Conversations the privacy router pinned local stay pinned across a
    // restart: kept beside the policy file (`<policy>.pins.json`).
    if let Some(policy) = cfg.admin.as_ref().and_then(|a| a.policy_file.as_ref()) {
        let mut pins = policy.as_os_str().to_owned();
        pins.push(".pins.json");
        if let Err(e) = rt.persist_pins(std::path::Path::new(&pins)) {
            drop_off_async(rt);
            return Err(ServeError::Config(e.to_string()));
        }
    }
    let tokenizer = rt.tokenizer().clone();
    let model_file = rt.runtime().draft_file_name();
    let rts = slot_runtimes(rt, cfg.parallel)?;
    let metrics = Arc::new(metrics::ServeMetrics::default());
    let worker =
        Worker::spawn(rts, cfg.routed, cfg.queue_depth, metrics).map_err(ServeError::Worker)?;
    let state = Arc::new(AppState {
        tokenizer,
        model_file,
        admin_token: cfg.admin.as_ref().map(|a| a.token.clone()),
        cfg,
        access,
        worker,
        created: now_secs(),
        next_id: AtomicU64::new(0),
    });
    let app = app(state.clone(), mounted.as_ref().map(|m| m.routes.clone()));
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let app = app.into_make_service_with_connect_info::<peer::ClientAddrs>();
        let r = axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "OpenAI-compatible server stopped");
        }
    });
    tracing::info!(%addr, admin = mounted.is_some(), "OpenAI-compatible server listening");
    Ok(RunningServer {
        addr,
        state,
        stop: Some(stop),
        task: Some(task),
        admin: mounted,
    })
}

fn app(state: Arc<AppState>, admin_routes: Option<axum::Router>) -> axum::Router {
    let admin = match admin_routes {
        Some(routes) => {
            let own = axum::Router::new()
                .route("/v1/serve/stats", get(serve_stats))
                .layer(middleware::from_fn_with_state(state.clone(), admin_auth))
                .with_state(state.clone());
            routes.merge(own)
        }
        None => axum::Router::new().fallback(admin_disabled),
    };
    let access = state.access.clone();
    axum::Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/infill", post(infill))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/metrics", get(metrics_text))
        .route_layer(middleware::from_fn_with_state(
            access.clone(),
            guard::v1_request,
        ))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .with_state(state)
        .nest("/admin", admin)
        .layer(middleware::from_fn_with_state(
            access,
            guard::host_and_origin,
        ))
}

async fn not_found(method: Method, uri: Uri) -> Response {
    ApiError::not_found_route(method.as_str(), uri.path()).into_response()
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        ..ApiError::not_found_route(method.as_str(), uri.path())
    }
    .into_response()
}

async fn admin_disabled() -> Response {
    ApiError {
        status: StatusCode::FORBIDDEN,
        message: "the admin API is disabled: start the server with an admin token".into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("admin_disabled"),
    }
    .into_response()
}

async fn admin_auth(State(s): State<Arc<AppState>>, req: Request<Body>, next: Next) -> Response {
    match admin::unauthorized(&req, s.admin_token.as_deref()) {
        Some(r) => r,
        None => next.run(req).await,
    }
}

async fn serve_stats(State(s): State<Arc<AppState>>) -> Json<ServeCounters> {
    Json(s.worker.counters())
}

/// Runs `f` (of [`tokenize`]) on the body off the async threads and
/// answers its JSON.
async fn tokenizer_answer(
    s: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    f: fn(&tandem_model::tokenizer::Tokenizer, &[u8]) -> Result<Value, ApiError>,
) -> Response {
    let body = match body_or_error(body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let tok = s.tokenizer.clone();
    match tokio::task::spawn_blocking(move || f(&tok, &body)).await {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(_) => ApiError::server("tokenizing failed").into_response(),
    }
}

async fn tokenize(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    tokenizer_answer(s, body, tokenize::tokenize_body).await
}

async fn detokenize(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    tokenizer_answer(s, body, tokenize::detokenize_body).await
}

async fn metrics_text(State(s): State<Arc<AppState>>) -> Response {
    let text = s.worker.metrics().render(&s.worker.counters());
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

fn model_object(s: &AppState) -> Value {
    json!({"id": s.cfg.model_id, "object": "model", "created": s.created, "owned_by": "tandem"})
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&s)]}))
}

async fn model(
    State(s): State<Arc<AppState>>,
    id: Result<Path<String>, PathRejection>,
) -> Response {
    let id = match id {
        Ok(Path(id)) => id,
        Err(e) => return ApiError::rejected(e.status(), e.body_text()).into_response(),
    };
    if id == s.cfg.model_id {
        Json(model_object(&s)).into_response()
    } else {
        ApiError::model_not_found(&id).into_response()
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completion,
    /// llama.cpp's `/infill` (its answer shape: `content`, `stop`).
    Infill,
}

/// Largest request body accepted (413 `request_too_large` above, naming it).
pub const MAX_REQUEST_BYTES: usize = 2 << 20;

/// The body, or axum's refusal (413 above [`MAX_REQUEST_BYTES`], a broken
/// upload) as an OpenAI error body instead of axum's plain text.
fn body_or_error(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(
                format!("the request body is over {MAX_REQUEST_BYTES} bytes, this server's limit"),
                None,
            )
        } else {
            ApiError::rejected(e.status(), e.body_text())
        }
    })
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    Extension(scope): Extension<guard::AnonymousScope>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body_or_error(body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    match request::parse_chat(&body, &s.limits()).map(|r| with_scope(r, scope)) {
        Ok(r) => match tools_refusal(&s, &r) {
            Some(e) => e.into_response(),
            None => answer_ignoring(s, r, Endpoint::Chat).await,
        },
        Err(e) => e.into_response(),
    }
}

async fn completions(
    State(s): State<Arc<AppState>>,
    Extension(scope): Extension<guard::AnonymousScope>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body_or_error(body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    match request::parse_completion(&body, &s.limits()).map(|r| with_scope(r, scope)) {
        Ok(r) => match fim_refusal(&s, &r, "suffix") {
            Some(e) => e.into_response(),
            None => answer_ignoring(s, r, Endpoint::Completion).await,
        },
        Err(e) => e.into_response(),
    }
}

async fn infill(
    State(s): State<Arc<AppState>>,
    Extension(scope): Extension<guard::AnonymousScope>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body_or_error(body) {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    match request::parse_infill(&body, &s.limits()).map(|r| with_scope(r, scope)) {
        Ok(r) => match fim_refusal(&s, &r, "input_suffix") {
            Some(e) => e.into_response(),
            None => answer_ignoring(s, r, Endpoint::Infill).await,
        },
        Err(e) => e.into_response(),
    }
}

/// `r` from a client of `scope` (its anonymous conversation-cache scope).
fn with_scope(r: GenRequest, scope: guard::AnonymousScope) -> GenRequest {
    GenRequest {
        anonymous_scope: scope.0,
        ..r
    }
}

/// 400 `fim_unsupported` for a fill-in-the-middle request when the served
/// model has no FIM tokens, naming the model file and the tokens missing
/// (`param`: the request field that asked for it).
fn fim_refusal(s: &AppState, r: &GenRequest, param: &str) -> Option<ApiError> {
    if !r.input.is_fim() {
        return None;
    }
    let missing = s.tokenizer.fim_tokens().missing();
    (!missing.is_empty()).then(|| {
        ApiError::invalid(
            format!(
                "`{param}`: the model {} ({:?}) cannot fill in the middle: it has no {} token \
                 (tokenizer.ggml.fim_*_token_id metadata, or tokens such as <|fim_prefix|>, \
                 <|fim_suffix|>, <|fim_middle|>)",
                s.cfg.model_id,
                s.model_file,
                missing.join(", ")
            ),
            Some(param),
        )
        .with_code("fim_unsupported")
    })
}

/// 400 `tools_unsupported` when a request offers tools and the served
/// model's chat template cannot show them (it never reads `tools`: they
/// would be dropped silently) or shows a call format this server cannot
/// parse ([`tools::CallFormat`]).
fn tools_refusal(s: &AppState, r: &GenRequest) -> Option<ApiError> {
    r.tools.as_ref().filter(|t| t.parses_calls())?;
    let template = s.tokenizer.chat_template().unwrap_or("");
    let why = if !s.tokenizer.chat_template_renders_tools() {
        "its chat template does not render `tools`"
    } else if tools::CallFormat::of_template(template).is_none() {
        "its chat template's tool-call format is not one this server parses (only \
         `<tool_call>` JSON, as Qwen2.5, Qwen3 and Hermes write it, and Llama 3.x's bare \
         `{\"name\", \"parameters\"}` JSON)"
    } else {
        return None;
    };
    Some(
        ApiError::invalid(
            format!(
                "`tools`: the model {} ({:?}) cannot be offered tools: {why}; send                  `tool_choice: \"none\"` or no tools",
                s.cfg.model_id, s.model_file
            ),
            Some("tools"),
        )
        .with_code("tools_unsupported"),
    )
}

/// The response header naming the request fields the server ignored.
pub const IGNORED_FIELDS_HEADER: &str = "x-tandem-ignored-fields";

/// Longest value of [`IGNORED_FIELDS_HEADER`] (bytes, before the count of
/// names left out): a client may send any number of unknown fields.
const IGNORED_FIELDS_MAX: usize = 1024;

/// The value of [`IGNORED_FIELDS_HEADER`]: the names, comma-separated, each
/// byte outside printable ASCII (and `%`, `,`) percent-encoded so that any
/// JSON key makes a valid header; names past [`IGNORED_FIELDS_MAX`] bytes
/// are counted (`…(+N more)`), not listed.
fn ignored_fields_value(names: &[String]) -> String {
    let mut out = String::new();
    for (i, name) in names.iter().enumerate() {
        let mut enc = String::new();
        for b in name.bytes() {
            if b.is_ascii_graphic() && b != b'%' && b != b',' {
                enc.push(char::from(b));
            } else {
                enc.push_str(&format!("%{b:02X}"));
            }
        }
        if out.len().saturating_add(enc.len()) > IGNORED_FIELDS_MAX {
            out.push_str(&format!(", ...(+{} more)", names.len() - i));
            break;
        }
        if !out.is_empty() {
            out.push_str(", ");
        }
        out.push_str(&enc);
    }
    out
}

/// Runs the request and names the fields it ignored in the answer's
/// [`IGNORED_FIELDS_HEADER`] (errors and streams included).
async fn answer_ignoring(s: Arc<AppState>, mut r: GenRequest, endpoint: Endpoint) -> Response {
    let ignored = std::mem::take(&mut r.ignored);
    if !ignored.is_empty() {
        tracing::debug!(fields = ?ignored, "ignored unknown request fields");
    }
    let mut resp = generate(s, r, endpoint).await;
    if !ignored.is_empty() {
        if let Ok(v) = axum::http::HeaderValue::from_str(&ignored_fields_value(&ignored)) {
            resp.headers_mut().insert(IGNORED_FIELDS_HEADER, v);
        }
    }
    resp
}

/// Sets the job's cancel flag and gives its queue place up when the
/// request's future or stream is dropped (the client went away) — harmless
/// after the job finished.
struct CancelOnDrop(Arc<AtomicBool>, Option<Arc<worker::QueueSlot>>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
        if let Some(s) = &self.1 {
            s.release();
        }
    }
}

/// Everything the answer needs besides the text.
struct Meta {
    id: String,
    created: u64,
    model: String,
    endpoint: Endpoint,
}

impl Meta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion | Endpoint::Infill, _) => "text_completion",
        }
    }

    /// llama.cpp's `/infill` answer (whole, or a streamed piece): `content`,
    /// `stop` and, at the end, `stop_type` (`eos` for an end-of-generation
    /// token or a stop string, `limit` for max tokens), `tokens_predicted`,
    /// `tokens_evaluated`.
    fn infill(&self, content: &str, done: Option<(&str, usize, usize)>, tandem: Value) -> Value {
        let mut v = json!({"content": content, "stop": done.is_some(), "model": self.model,
                           "id": self.id, "tandem": tandem});
        if let Some((finish, prompt, completion)) = done {
            v["stop_type"] = json!(if finish == "length" { "limit" } else { "eos" });
            v["tokens_predicted"] = json!(completion);
            v["tokens_evaluated"] = json!(prompt);
        }
        v
    }

    /// A chunk of choice `index` (`delta` for chat, `text` for completions).
    fn chunk(
        &self,
        index: usize,
        text: Option<&str>,
        finish: Option<&str>,
        tandem: Value,
    ) -> Value {
        let choice = match self.endpoint {
            Endpoint::Infill => return self.infill(text.unwrap_or(""), None, tandem),
            Endpoint::Chat => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Completion => {
                json!({"index": index, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish})
            }
        };
        json!({
            "id": self.id, "object": self.object(true), "created": self.created,
            "model": self.model, "system_fingerprint": null,
            "choices": [choice], "tandem": tandem,
        })
    }
}

/// A tool call in the answer's `message.tool_calls`.
fn tool_call_json(id: &str, name: &str, arguments: &str) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

impl Meta {
    /// The two chunks that stream a tool call as OpenAI streams one: the
    /// first names it (`index`, `id`, `type`, `function.name`, empty
    /// `arguments`), the second carries the arguments.
    fn tool_call_chunks(
        &self,
        choice: usize,
        index: usize,
        id: &str,
        name: &str,
        arguments: &str,
        tandem: Value,
    ) -> [Value; 2] {
        let chunk = |call: Value, tandem: Value| {
            json!({
                "id": self.id, "object": self.object(true), "created": self.created,
                "model": self.model, "system_fingerprint": null,
                "choices": [{"index": choice, "delta": {"tool_calls": [call]}, "logprobs": null,
                             "finish_reason": null}],
                "tandem": tandem,
            })
        };
        [
            chunk(
                json!({"index": index, "id": id, "type": "function",
                       "function": {"name": name, "arguments": ""}}),
                tandem,
            ),
            chunk(
                json!({"index": index, "function": {"arguments": arguments}}),
                json!({}),
            ),
        ]
    }
}

/// Which model's distribution each token's logprobs came from
/// (`tandem.logprobs_from`).
fn logprobs_from(statuses: &[TokenStatus]) -> Value {
    json!(statuses
        .iter()
        .map(|&s| logprobs::source(s))
        .collect::<Vec<_>>())
}

/// A streamed chunk's `tandem` object: its tokens, the provisional checks
/// since the last chunk (taken), and with logprobs their sources.
fn chunk_tandem(
    ids: &[u32],
    statuses: &[TokenStatus],
    checks: &mut Vec<ProvisionalCheck>,
    want_logprobs: bool,
) -> Value {
    let mut tandem = json!({"token_ids": ids, "token_status": statuses,
           "provisional_checks": std::mem::take(checks)});
    if want_logprobs {
        tandem["logprobs_from"] = logprobs_from(statuses);
    }
    tandem
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt.saturating_add(completion)})
}

/// One choice's job, submitted and started.
struct Started {
    rx: mpsc::UnboundedReceiver<Event>,
    guard: CancelOnDrop,
    /// The router's decision, as JSON (null when the server does not route).
    route: Value,
    prompt_tokens: usize,
}

/// Submits choice `index` of `req` (its seed: [`request::choice_seed`]) and
/// waits until the job starts (or fails before its first token), so that
/// errors found then still get a proper HTTP status.
async fn start_choice(s: &AppState, req: &GenRequest, index: usize) -> Result<Started, Response> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let mut guard = CancelOnDrop(cancel.clone(), None);
    let mut req = req.clone();
    req.sampling.seed = request::choice_seed(req.sampling.seed, index);
    match s.worker.submit(Job {
        req,
        events: tx,
        cancel,
        admitted: std::time::Instant::now(),
    }) {
        Ok(slot) => guard.1 = Some(slot),
        Err(e) => return Err(e.into_response()),
    }
    match rx.recv().await {
        Some(Event::Started {
            route,
            prompt_tokens,
        }) => Ok(Started {
            rx,
            guard,
            route: serde_json::to_value(route).unwrap_or(Value::Null),
            prompt_tokens,
        }),
        Some(Event::Failed(e)) => Err(e.into_response()),
        _ => Err(ApiError::server("the generation worker stopped").into_response()),
    }
}

async fn generate(s: Arc<AppState>, req: GenRequest, endpoint: Endpoint) -> Response {
    let meta = Meta {
        id: s.id(match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion | Endpoint::Infill => "cmpl",
        }),
        created: now_secs(),
        model: s.cfg.model_id.clone(),
        endpoint,
    };
    let first = match start_choice(&s, &req, 0).await {
        Ok(st) => st,
        Err(r) => return r,
    };
    if req.stream {
        sse(s, req, meta, first)
    } else {
        collect(&s, &req, meta, first).await
    }
}

/// A finished choice of a non-streamed answer.
struct ChoiceOut {
    choice: Value,
    prompt_tokens: usize,
    completion_tokens: usize,
    tandem: Value,
}

/// Collects one choice's events; `Err`: the answer is that response (an
/// error, or llama.cpp's `/infill` shape, which has no choices).
async fn collect_choice(
    meta: &Meta,
    tok: &tandem_model::tokenizer::Tokenizer,
    want_logprobs: bool,
    index: usize,
    st: Started,
) -> Result<ChoiceOut, Response> {
    let Started {
        mut rx,
        guard: _guard,
        route,
        prompt_tokens,
    } = st;
    let (mut text, mut ids, mut statuses) = (String::new(), Vec::new(), Vec::<TokenStatus>::new());
    let mut lps: Vec<logprobs::TokenLps> = Vec::new();
    let mut checks: Vec<ProvisionalCheck> = Vec::new();
    let mut tool_calls: Vec<Value> = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Delta {
                text: t,
                ids: i,
                statuses: st,
                logprobs: l,
            } => {
                text.push_str(&t);
                ids.extend(i);
                statuses.extend(st);
                lps.extend(l);
            }
            Event::ToolCall {
                id,
                name,
                arguments,
                ids: i,
                statuses: st,
                logprobs: l,
                ..
            } => {
                tool_calls.push(tool_call_json(&id, &name, &arguments));
                ids.extend(i);
                statuses.extend(st);
                lps.extend(l);
            }
            Event::Checked(c) => checks.push(c),
            Event::Failed(e) => return Err(e.into_response()),
            Event::Started { .. } => {}
            Event::Done(d) => {
                let mut tandem = json!({
                    "token_ids": ids, "token_status": statuses, "route": route,
                    "stats": d.stats, "provisional": d.provisional,
                    "provisional_checks": checks, "session_id": d.session_id,
                    "job": d.job, "slot": d.slot, "queue_wait_ms": d.queue_wait_ms,
                });
                let lp = match meta.endpoint {
                    _ if !want_logprobs => Value::Null,
                    Endpoint::Chat => logprobs::chat(tok, &ids, &lps),
                    Endpoint::Completion | Endpoint::Infill => {
                        logprobs::completion(tok, &ids, &lps, &mut Vec::new())
                    }
                };
                if want_logprobs {
                    tandem["logprobs_from"] = logprobs_from(&statuses);
                }
                let prompt = d.prompt_tokens.max(prompt_tokens);
                let choice = match meta.endpoint {
                    Endpoint::Infill => {
                        let done = Some((d.finish_reason, prompt, d.completion_tokens));
                        return Err(Json(meta.infill(&text, done, tandem)).into_response());
                    }
                    Endpoint::Chat if !tool_calls.is_empty() => json!({"index": index,
                        "message": {"role": "assistant",
                            "content": if text.is_empty() { Value::Null } else { json!(text) },
                            "refusal": null, "tool_calls": tool_calls},
                        "logprobs": lp, "finish_reason": d.finish_reason}),
                    Endpoint::Chat => json!({"index": index,
                        "message": {"role": "assistant", "content": text, "refusal": null},
                        "logprobs": lp, "finish_reason": d.finish_reason}),
                    Endpoint::Completion => json!({"index": index, "text": text,
                        "logprobs": lp, "finish_reason": d.finish_reason}),
                };
                return Ok(ChoiceOut {
                    choice,
                    prompt_tokens: prompt,
                    completion_tokens: d.completion_tokens,
                    tandem,
                });
            }
        }
    }
    Err(ApiError::server("the generation worker stopped").into_response())
}

/// The non-streamed answer: `req.n` choices, generated one after the other.
/// Usage counts the prompt once and every choice's completion; `tandem` is
/// the choice's extension object (`n` = 1) or `{"choices": [...]}` of them.
async fn collect(s: &AppState, req: &GenRequest, meta: Meta, first: Started) -> Response {
    let mut outs = Vec::with_capacity(req.n);
    let mut next = Some(first);
    for index in 0..req.n {
        let st = match next.take() {
            Some(st) => st,
            None => match start_choice(s, req, index).await {
                Ok(st) => st,
                Err(r) => return r,
            },
        };
        match collect_choice(&meta, &s.tokenizer, req.logprobs.is_some(), index, st).await {
            Ok(o) => outs.push(o),
            Err(r) => return r,
        }
    }
    let prompt = outs.first().map_or(0, |o| o.prompt_tokens);
    let completion = outs
        .iter()
        .fold(0usize, |a, o| a.saturating_add(o.completion_tokens));
    let choices: Vec<Value> = outs.iter().map(|o| o.choice.clone()).collect();
    let tandem = match outs.as_mut_slice() {
        [one] => one.tandem.take(),
        many => json!({"choices": many.iter_mut().map(|o| o.tandem.take()).collect::<Vec<_>>()}),
    };
    let body = json!({
        "id": meta.id, "object": meta.object(false), "created": meta.created,
        "model": meta.model, "system_fingerprint": null,
        "choices": choices,
        "usage": usage(prompt, completion),
        "tandem": tandem,
    });
    Json(body).into_response()
}

/// How a streamed choice ended.
enum ChoiceEnd {
    /// Done: its prompt and completion token counts.
    Done(usize, usize),
    /// The client went away, or the error was sent: the stream ends.
    Over,
}

/// Streams one choice's chunks into `out` (its first chunk carries the role
/// and its route); the last choice's `Done` is followed by the usage chunk
/// and `[DONE]` in [`sse`].
async fn stream_choice(
    meta: &Meta,
    tok: &tandem_model::tokenizer::Tokenizer,
    req: &GenRequest,
    index: usize,
    st: Started,
    out: &mpsc::UnboundedSender<Result<SseEvent, Infallible>>,
) -> ChoiceEnd {
    let include_usage = req.include_usage;
    // The completion's bytes streamed so far (completions' text_offset).
    let mut offset = Vec::new();
    let data = |v: Value| Ok(SseEvent::default().data(v.to_string()));
    let Started {
        mut rx,
        guard: _guard,
        route,
        ..
    } = st;
    let mut first = meta.chunk(index, Some(""), None, json!({"route": route}));
    if meta.endpoint == Endpoint::Chat {
        first["choices"][0]["delta"]["role"] = json!("assistant");
    }
    if include_usage {
        first["usage"] = Value::Null;
    }
    if out.send(data(first)).is_err() {
        return ChoiceEnd::Over;
    }
    let mut checks: Vec<ProvisionalCheck> = Vec::new();
    loop {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = out.closed() => return ChoiceEnd::Over,
        };
        let msg = match ev {
            Some(Event::Delta {
                text,
                ids,
                statuses,
                logprobs: lps,
            }) => {
                let lp = match meta.endpoint {
                    _ if req.logprobs.is_none() => Value::Null,
                    Endpoint::Chat => logprobs::chat(tok, &ids, &lps),
                    Endpoint::Completion | Endpoint::Infill => {
                        logprobs::completion(tok, &ids, &lps, &mut offset)
                    }
                };
                let tandem = chunk_tandem(&ids, &statuses, &mut checks, req.logprobs.is_some());
                let mut c = meta.chunk(index, Some(&text), None, tandem);
                if !lp.is_null() {
                    if let Some(choice) = c["choices"].get_mut(0) {
                        choice["logprobs"] = lp;
                    }
                }
                if include_usage {
                    c["usage"] = Value::Null;
                }
                c
            }
            Some(Event::ToolCall {
                index: call,
                id,
                name,
                arguments,
                ids,
                statuses,
                logprobs: lps,
            }) => {
                let tandem = chunk_tandem(&ids, &statuses, &mut checks, req.logprobs.is_some());
                let [mut named, mut args] =
                    meta.tool_call_chunks(index, call, &id, &name, &arguments, tandem);
                if req.logprobs.is_some() && meta.endpoint == Endpoint::Chat {
                    args["choices"][0]["logprobs"] = logprobs::chat(tok, &ids, &lps);
                }
                if include_usage {
                    named["usage"] = Value::Null;
                    args["usage"] = Value::Null;
                }
                if out.send(data(named)).is_err() {
                    return ChoiceEnd::Over;
                }
                args
            }
            Some(Event::Checked(c)) => {
                checks.push(c);
                continue;
            }
            Some(Event::Started { .. }) => continue,
            Some(Event::Failed(e)) => {
                let _ = out.send(data(e.body()));
                return ChoiceEnd::Over;
            }
            Some(Event::Done(d)) if meta.endpoint == Endpoint::Infill => {
                // llama.cpp's stream: the last object has `stop: true`;
                // no `[DONE]`.
                let done = Some((d.finish_reason, d.prompt_tokens, d.completion_tokens));
                let tandem = json!({"stats": d.stats, "provisional": d.provisional,
                       "provisional_checks": checks, "session_id": d.session_id,
                       "job": d.job, "slot": d.slot, "queue_wait_ms": d.queue_wait_ms});
                let _ = out.send(data(meta.infill("", done, tandem)));
                return ChoiceEnd::Over;
            }
            Some(Event::Done(d)) => {
                let mut c = meta.chunk(
                    index,
                    None,
                    Some(d.finish_reason),
                    json!({"stats": d.stats, "provisional": d.provisional,
                           "provisional_checks": checks, "session_id": d.session_id,
                           "job": d.job, "slot": d.slot, "queue_wait_ms": d.queue_wait_ms}),
                );
                if include_usage {
                    c["usage"] = Value::Null;
                }
                if out.send(data(c)).is_err() {
                    return ChoiceEnd::Over;
                }
                return ChoiceEnd::Done(d.prompt_tokens, d.completion_tokens);
            }
            None => {
                let e = ApiError::server("the generation worker stopped");
                let _ = out.send(data(e.body()));
                return ChoiceEnd::Over;
            }
        };
        if out.send(data(msg)).is_err() {
            return ChoiceEnd::Over;
        }
    }
}

/// The streamed answer: `req.n` choices one after the other (each chunk
/// names its choice's `index`), then the usage chunk (when asked) and
/// `[DONE]`.
fn sse(s: Arc<AppState>, req: GenRequest, meta: Meta, first: Started) -> Response {
    let (out, out_rx) = mpsc::unbounded_channel::<Result<SseEvent, Infallible>>();
    let data = |v: Value| Ok(SseEvent::default().data(v.to_string()));
    tokio::spawn(async move {
        // Each choice's job holds its cancel guard: when the client is gone
        // the body (and `out_rx`) is dropped, this task ends and the job is
        // cancelled.
        let (mut prompt, mut completion) = (0usize, 0usize);
        let mut next = Some(first);
        for index in 0..req.n {
            let st = match next.take() {
                Some(st) => st,
                None => match start_choice(&s, &req, index).await {
                    Ok(st) => st,
                    Err(_) => {
                        let e = ApiError::server(format!(
                            "choice {index} could not start (the queue is full or the worker stopped)"
                        ));
                        let _ = out.send(data(e.body()));
                        return;
                    }
                },
            };
            match stream_choice(&meta, &s.tokenizer, &req, index, st, &out).await {
                ChoiceEnd::Done(p, c) => {
                    if index == 0 {
                        prompt = p;
                    }
                    completion = completion.saturating_add(c);
                }
                ChoiceEnd::Over => return,
            }
        }
        if req.include_usage {
            let u = json!({
                "id": meta.id, "object": meta.object(true), "created": meta.created,
                "model": meta.model, "system_fingerprint": null, "choices": [],
                "usage": usage(prompt, completion),
            });
            let _ = out.send(data(u));
        }
        let _ = out.send(Ok(SseEvent::default().data("[DONE]")));
    });
    let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(out_rx);
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}
