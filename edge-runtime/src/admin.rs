//! The edge admin HTTP API (axum) and the policy file hot reload.
//!
//! Local and bearer-token protected: binds 127.0.0.1 by default and refuses a
//! non-loopback address unless [`AdminConfig::allow_non_loopback`] is set;
//! every request needs `Authorization: Bearer <token>` (401 otherwise).
//!
//! | method and path | body | answer |
//! | --- | --- | --- |
//! | `GET /v1/policy` | – | `{generation, sha256, source, file}`: the TOML serving now |
//! | `PUT /v1/policy` | policy TOML | validate, then swap atomically: `{generation, sha256}`; invalid: 400 `{error, line, field}` and the old policy keeps serving |
//! | `POST /v1/route/explain` | `{"text": .., "context": {..}?}` | the decision (action, rule, entities with byte spans and scores, categories, category term spans); not counted in stats |
//! | `GET /v1/route/stats` | – | decisions by action and by rule, policy generation, reload counters |
//!
//! **Hot reload**: with [`AdminConfig::policy_file`] set, a task reads the
//! file every `poll_interval_ms` and, when its sha256 differs from the content
//! last seen, validates it and swaps it in; an invalid file is logged and
//! counted, and the old policy keeps serving. The first content seen is the
//! serving policy's own, so a file that differs at start is loaded at once.
//! A `PUT` does not write the file; the file wins again on its next change.
//! Reading the whole (small) file each poll avoids relying on mtime
//! granularity and needs no file-watching dependency.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tandem_router::{CategoryHit, Decision, PolicyError, RouteContext, RouteStats, Router};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Configuration of the admin API (section `[admin]` of the app's config).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// Address to bind; loopback unless `allow_non_loopback`.
    pub listen: SocketAddr,
    /// Bearer token every request must carry. Required, at least 16 chars.
    pub token: String,
    /// Policy file to hot-reload, if any.
    pub policy_file: Option<PathBuf>,
    /// How often the policy file is read (ms).
    pub poll_interval_ms: u64,
    pub allow_non_loopback: bool,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 7881)),
            token: String::new(),
            policy_file: None,
            poll_interval_ms: 500,
            allow_non_loopback: false,
        }
    }
}

/// Why the admin API could not start.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("admin config: {0}")]
    Config(String),
    #[error("binding the admin API to {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Policy reloads seen by the admin API and the file watcher.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReloadCounters {
    /// `PUT /v1/policy` accepted / refused.
    pub api_ok: u64,
    pub api_rejected: u64,
    /// Policy file changes swapped in / refused.
    pub file_ok: u64,
    pub file_rejected: u64,
    /// The last refusal (line, field, message; policy text only, never a prompt).
    pub last_error: Option<String>,
}

/// `GET /v1/route/stats`.
#[derive(Clone, Debug, Serialize)]
pub struct StatsResponse {
    #[serde(flatten)]
    pub decisions: RouteStats,
    pub reloads: ReloadCounters,
}

/// `GET /v1/policy`.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyResponse {
    pub generation: u64,
    pub sha256: String,
    pub source: String,
    pub file: Option<PathBuf>,
}

/// `POST /v1/route/explain` request.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExplainRequest {
    pub text: String,
    #[serde(default)]
    pub context: ContextJson,
}

/// A [`RouteContext`] in JSON (every field optional).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ContextJson {
    pub rtt_ms: Option<f64>,
    pub breaker_open: bool,
    pub battery_pct: Option<u8>,
    pub thermal_level: Option<u8>,
    pub user_opt_out: bool,
}

impl From<ContextJson> for RouteContext {
    fn from(c: ContextJson) -> Self {
        RouteContext {
            rtt_ms: c.rtt_ms,
            breaker_open: c.breaker_open,
            battery_pct: c.battery_pct,
            thermal_level: c.thermal_level,
            user_opt_out: c.user_opt_out,
        }
    }
}

/// `POST /v1/route/explain` answer: the decision plus where the category
/// terms are (byte spans), never the text.
#[derive(Clone, Debug, Serialize)]
pub struct ExplainResponse {
    #[serde(flatten)]
    pub decision: Decision,
    pub category_hits: Vec<CategoryHit>,
    pub policy_generation: u64,
}

/// A refusal, as JSON.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorResponse {
    pub error: String,
    pub line: Option<usize>,
    pub field: Option<String>,
}

struct AdminState {
    router: Arc<Router>,
    token: String,
    policy_file: Option<PathBuf>,
    reloads: Mutex<ReloadCounters>,
}

impl AdminState {
    fn reloads(&self) -> std::sync::MutexGuard<'_, ReloadCounters> {
        self.reloads.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// sha256 (hex) of a policy's TOML text.
pub fn policy_sha256(source: &str) -> String {
    Sha256::digest(source.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A running admin API (and file watcher). Dropping it without
/// [`RunningAdmin::shutdown`] aborts both tasks.
pub struct RunningAdmin {
    /// The bound address (useful with port 0).
    pub addr: SocketAddr,
    state: Arc<AdminState>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
    watcher: Option<JoinHandle<()>>,
}

impl RunningAdmin {
    pub fn reload_counters(&self) -> ReloadCounters {
        self.state.reloads().clone()
    }

    /// Stop serving (in-flight requests finish) and stop watching the file.
    pub async fn shutdown(mut self) {
        if let Some(w) = self.watcher.take() {
            w.abort();
        }
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(h) = self.server.take() {
            let _ = h.await;
        }
    }
}

impl Drop for RunningAdmin {
    fn drop(&mut self) {
        for h in [self.watcher.take(), self.server.take()]
            .into_iter()
            .flatten()
        {
            h.abort();
        }
    }
}

/// Bind and serve the admin API for `router` (call inside a tokio runtime).
pub async fn start(router: Arc<Router>, cfg: AdminConfig) -> Result<RunningAdmin, AdminError> {
    if cfg.token.chars().count() < 16 {
        return Err(AdminError::Config(
            "token is required and must be at least 16 characters".into(),
        ));
    }
    if !cfg.listen.ip().is_loopback() && !cfg.allow_non_loopback {
        return Err(AdminError::Config(format!(
            "listen {} is not a loopback address; set allow_non_loopback to expose the admin API",
            cfg.listen
        )));
    }
    if cfg.poll_interval_ms == 0 {
        return Err(AdminError::Config("poll_interval_ms must be > 0".into()));
    }
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| AdminError::Bind {
            addr: cfg.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| AdminError::Bind {
        addr: cfg.listen,
        source,
    })?;
    let state = Arc::new(AdminState {
        router,
        token: cfg.token.clone(),
        policy_file: cfg.policy_file.clone(),
        reloads: Mutex::new(ReloadCounters::default()),
    });
    let app = app(state.clone());
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let r = axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "edge admin API stopped");
        }
    });
    let watcher = cfg.policy_file.clone().map(|path| {
        let every = Duration::from_millis(cfg.poll_interval_ms);
        tokio::spawn(watch(state.clone(), path, every))
    });
    tracing::info!(%addr, hot_reload = watcher.is_some(), "edge admin API listening");
    Ok(RunningAdmin {
        addr,
        state,
        stop: Some(stop),
        server: Some(server),
        watcher,
    })
}

/// The admin API as routes to mount inside another axum server (e.g. under
/// `/admin` in [`crate::openai`]), with the same bearer-token check and, when
/// `cfg.policy_file` is set, the hot-reload watcher. `cfg.listen` and
/// `allow_non_loopback` are the host server's business and not used here.
/// Call inside a tokio runtime.
pub fn mount(router: Arc<Router>, cfg: &AdminConfig) -> Result<MountedAdmin, AdminError> {
    if cfg.token.chars().count() < 16 {
        return Err(AdminError::Config(
            "token is required and must be at least 16 characters".into(),
        ));
    }
    if cfg.poll_interval_ms == 0 {
        return Err(AdminError::Config("poll_interval_ms must be > 0".into()));
    }
    let state = Arc::new(AdminState {
        router,
        token: cfg.token.clone(),
        policy_file: cfg.policy_file.clone(),
        reloads: Mutex::new(ReloadCounters::default()),
    });
    let watcher = cfg.policy_file.clone().map(|path| {
        let every = Duration::from_millis(cfg.poll_interval_ms);
        tokio::spawn(watch(state.clone(), path, every))
    });
    Ok(MountedAdmin {
        routes: app(state.clone()),
        state,
        watcher,
    })
}

/// Admin routes from [`mount`]; dropping it stops the file watcher.
pub struct MountedAdmin {
    pub routes: axum::Router,
    state: Arc<AdminState>,
    watcher: Option<JoinHandle<()>>,
}

impl MountedAdmin {
    pub fn reload_counters(&self) -> ReloadCounters {
        self.state.reloads().clone()
    }
}

impl Drop for MountedAdmin {
    fn drop(&mut self) {
        if let Some(w) = self.watcher.take() {
            w.abort();
        }
    }
}

fn app(state: Arc<AdminState>) -> axum::Router {
    axum::Router::new()
        .route("/v1/policy", get(get_policy).put(put_policy))
        .route("/v1/route/explain", post(explain))
        .route("/v1/route/stats", get(stats))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .with_state(state)
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    let body = ErrorResponse {
        error: msg.into(),
        line: None,
        field: None,
    };
    (status, Json(body)).into_response()
}

/// The admin API's bearer-token check (constant-time comparison): the 401
/// answer when `req` does not carry `token` (or no token is set), `None` when
/// it does. Shared with the OpenAI server, which mounts these routes.
pub(crate) fn unauthorized(req: &Request<Body>, token: Option<&str>) -> Option<Response> {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let ok = match (token, presented) {
        (Some(t), Some(p)) => bool::from(p.as_bytes().ct_eq(t.as_bytes())),
        _ => false,
    };
    if ok {
        return None;
    }
    let mut r = error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    Some(r)
}

async fn auth(State(s): State<Arc<AdminState>>, req: Request<Body>, next: Next) -> Response {
    match unauthorized(&req, Some(&s.token)) {
        Some(r) => r,
        None => next.run(req).await,
    }
}

async fn get_policy(State(s): State<Arc<AdminState>>) -> Json<PolicyResponse> {
    let policy = s.router.policy();
    Json(PolicyResponse {
        generation: s.router.generation(),
        sha256: policy_sha256(policy.source()),
        source: policy.source().to_string(),
        file: s.policy_file.clone(),
    })
}

fn refusal(e: &PolicyError) -> Response {
    let body = ErrorResponse {
        error: e.to_string(),
        line: e.line(),
        field: e.field().map(str::to_string),
    };
    (StatusCode::BAD_REQUEST, Json(body)).into_response()
}

async fn put_policy(State(s): State<Arc<AdminState>>, body: String) -> Response {
    match s.router.reload_from_str(&body) {
        Ok(generation) => {
            s.reloads().api_ok += 1;
            let sha256 = policy_sha256(&body);
            tracing::info!(generation, %sha256, "policy replaced through the admin API");
            Json(serde_json::json!({ "generation": generation, "sha256": sha256 })).into_response()
        }
        Err(e) => {
            {
                let mut r = s.reloads();
                r.api_rejected += 1;
                r.last_error = Some(e.to_string());
            }
            tracing::warn!(error = %e, "policy refused by the admin API; the old one keeps serving");
            refusal(&e)
        }
    }
}

async fn explain(
    State(s): State<Arc<AdminState>>,
    body: Result<Json<ExplainRequest>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let req = match body {
        Ok(Json(r)) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let policy = s.router.policy();
    let generation = s.router.generation();
    let decision = policy.decide(&req.text, &req.context.into());
    let (_, category_hits) = policy.classify(&req.text);
    Json(ExplainResponse {
        decision,
        category_hits,
        policy_generation: generation,
    })
    .into_response()
}

async fn stats(State(s): State<Arc<AdminState>>) -> Json<StatsResponse> {
    Json(StatsResponse {
        decisions: s.router.stats(),
        reloads: s.reloads().clone(),
    })
}

/// The hot-reload loop: read, hash, validate and swap on change.
async fn watch(state: Arc<AdminState>, path: PathBuf, every: Duration) {
    let mut seen = policy_sha256(state.router.policy().source());
    let mut unreadable = false;
    loop {
        let p = path.clone();
        let read = tokio::task::spawn_blocking(move || std::fs::read_to_string(p))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        let text = match read {
            Ok(t) => {
                unreadable = false;
                t
            }
            Err(e) => {
                // Editors replace files by rename; a missing file is transient.
                if !unreadable {
                    tracing::warn!(path = %path.display(), error = %e, "policy file unreadable; the current policy keeps serving");
                    unreadable = true;
                }
                tokio::time::sleep(every).await;
                continue;
            }
        };
        let sha = policy_sha256(&text);
        if sha != seen {
            seen = sha.clone();
            match state.router.reload_from_str(&text) {
                Ok(generation) => {
                    state.reloads().file_ok += 1;
                    tracing::info!(path = %path.display(), generation, sha256 = %sha, "policy file reloaded");
                }
                Err(e) => {
                    {
                        let mut r = state.reloads();
                        r.file_rejected += 1;
                        r.last_error = Some(format!("{}: {e}", path.display()));
                    }
                    tracing::warn!(path = %path.display(), error = %e, "policy file refused; the old policy keeps serving");
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}
