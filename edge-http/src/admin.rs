//! The edge admin HTTP API (axum) and the policy file hot reload.
//!
//! Local and bearer-token protected: binds 127.0.0.1 by default and refuses a
//! non-loopback address unless [`AdminConfig::allow_non_loopback`] is set;
//! every request needs `Authorization: Bearer <token>` (401 otherwise).
//!
//! | method and path | body | answer |
//! | --- | --- | --- |
//! | `GET /v1/policy` | – | `{generation, sha256, source, file}`: the TOML serving now |
//! | `PUT /v1/policy` | policy TOML | validate, write the policy file durably (when one is configured), then swap atomically: `{generation, sha256}`; invalid: 400 `{error, line, field}`, unwritable file: 500; either way the old policy keeps serving |
//! | `POST /v1/route/explain` | `{"text": .., "context": {..}?}` | the decision (action, rule, entities with byte spans and scores, categories, category term spans with their cues, and the negation and hypothetical `frames` of `tandem route explain --json`); not counted in stats |
//! | `GET /v1/route/stats` | – | decisions by action and by rule, policy generation, reload counters |
//! | `GET /v1/device` | – | `{state, adjustments}`: the device state the app reported and what a generation started now runs with (draft threads, k cap, reasons; `tandem_edge::device`) |
//! | `PUT /v1/device` | `{"thermal": "nominal"\|"fair"\|"serious"\|"critical", "battery_pct": 0..=100, "charging", "power_save", "user_opt_out"}` (every field optional) | replaces the state (from the next generation on; the router's context at once), answers as `GET`; invalid: 400 `{error}` and the old state stays |
//!
//! **Durable `PUT`**: with [`AdminConfig::policy_file`] set, a `PUT` that
//! validates is first written to the file ([`write_durably`]: a temporary
//! file in the same directory, fsync, rename over the file, fsync the
//! directory) and only then served, so a restart serves what was last
//! acknowledged and a crash at any point leaves the file holding either the
//! old or the new policy, complete. Without a policy file a `PUT` lives in
//! memory only.
//!
//! **Hot reload**: with a policy file, a task reads it every
//! `poll_interval_ms`; when its sha256 differs from the serving policy's, it
//! validates and swaps it in, but only once two consecutive reads returned
//! the same bytes. A file being rewritten in place (`echo ... >
//! policy.toml`) can be read truncated, and a truncated policy may still
//! parse (fewer rules: weaker); the second read keeps such a snapshot out.
//! (A changed inode is no proof of a complete file: a file deleted and
//! created anew is written in place too, so a rename is not trusted alone.)
//! A change therefore takes effect one to two poll intervals after it is
//! written. An invalid file is logged and counted once,
//! and the old policy keeps serving. A file that differs from the serving
//! policy at start is loaded after its second read too. Reading the whole
//! (small) file each poll avoids relying on mtime granularity and needs no
//! file-watching dependency. `PUT` and the watcher take one lock, so a `PUT`'s
//! own write is never loaded a second time by the watcher.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
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
use tandem_edge::device::{DeviceAdjustments, DeviceState, SharedDeviceState};
use tandem_router::lexicon::FrameReport;
use tandem_router::{CategoryHit, Decision, Policy, PolicyError, RouteContext, RouteStats, Router};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::bearer;

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
    pub charging: bool,
    pub power_save: bool,
    pub user_opt_out: bool,
}

impl From<ContextJson> for RouteContext {
    fn from(c: ContextJson) -> Self {
        RouteContext {
            rtt_ms: c.rtt_ms,
            breaker_open: c.breaker_open,
            battery_pct: c.battery_pct,
            thermal_level: c.thermal_level,
            charging: c.charging,
            power_save: c.power_save,
            user_opt_out: c.user_opt_out,
        }
    }
}

/// `POST /v1/route/explain` answer: the decision plus where the category
/// terms are (byte spans) and which terms a negation or a hypothetical
/// frame set aside or kept (the `frames` of `tandem route explain --json`),
/// never the text.
#[derive(Clone, Debug, Serialize)]
pub struct ExplainResponse {
    #[serde(flatten)]
    pub decision: Decision,
    pub category_hits: Vec<CategoryHit>,
    pub frames: Vec<FrameReport>,
    pub policy_generation: u64,
}

/// `GET` / `PUT /v1/device` answer.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceResponse {
    pub state: DeviceState,
    pub adjustments: DeviceAdjustments,
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
    device: SharedDeviceState,
    token: String,
    policy_file: Option<PathBuf>,
    reloads: Mutex<ReloadCounters>,
    /// Held by a `PUT` from validation to swap and by the watcher from its
    /// comparison to its swap.
    policy_lock: tokio::sync::Mutex<()>,
}

impl AdminState {
    fn new(router: Arc<Router>, device: SharedDeviceState, cfg: &AdminConfig) -> Arc<Self> {
        if let Some(p) = &cfg.policy_file {
            remove_stale_temp_files(p);
        }
        Arc::new(AdminState {
            router,
            device,
            token: cfg.token.clone(),
            policy_file: cfg.policy_file.clone(),
            reloads: Mutex::new(ReloadCounters::default()),
            policy_lock: tokio::sync::Mutex::new(()),
        })
    }

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

/// Bind and serve the admin API for `router` and the device state `device`
/// (a runtime's [`tandem_edge::EdgeRuntime::device_handle`]); call inside a
/// tokio runtime.
pub async fn start(
    router: Arc<Router>,
    device: SharedDeviceState,
    cfg: AdminConfig,
) -> Result<RunningAdmin, AdminError> {
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
    let state = AdminState::new(router, device, &cfg);
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
pub fn mount(
    router: Arc<Router>,
    device: SharedDeviceState,
    cfg: &AdminConfig,
) -> Result<MountedAdmin, AdminError> {
    if cfg.token.chars().count() < 16 {
        return Err(AdminError::Config(
            "token is required and must be at least 16 characters".into(),
        ));
    }
    if cfg.poll_interval_ms == 0 {
        return Err(AdminError::Config("poll_interval_ms must be > 0".into()));
    }
    let state = AdminState::new(router, device, cfg);
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
        .route("/v1/device", get(get_device).put(put_device))
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

/// The admin API's bearer-token check ([`bearer::matches`]: constant time,
/// length included): the 401
/// answer when `req` does not carry `token` (or no token is set), `None` when
/// it does. Shared with the OpenAI server, which mounts these routes.
pub(crate) fn unauthorized(req: &Request<Body>, token: Option<&str>) -> Option<Response> {
    let ok = match (token, bearer::presented(req.headers())) {
        (Some(t), Some(p)) => bearer::matches(p, t),
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

fn device_response(device: &SharedDeviceState) -> Json<DeviceResponse> {
    Json(DeviceResponse {
        state: device.get(),
        adjustments: device.adjustments(),
    })
}

async fn get_device(State(s): State<Arc<AdminState>>) -> Json<DeviceResponse> {
    device_response(&s.device)
}

async fn put_device(State(s): State<Arc<AdminState>>, body: String) -> Response {
    let state: DeviceState = match serde_json::from_str(&body) {
        Ok(d) => d,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("device state: {e}")),
    };
    if let Err(e) = s.device.set(state) {
        return error(StatusCode::BAD_REQUEST, e.to_string());
    }
    let answer = device_response(&s.device);
    tracing::info!(
        thermal = ?answer.state.thermal,
        battery_pct = ?answer.state.battery_pct,
        threads = answer.adjustments.draft_threads,
        k_cap = ?answer.adjustments.k_cap,
        "device state set through the admin API"
    );
    answer.into_response()
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
    let _serialised = s.policy_lock.lock().await;
    let policy = match Policy::from_toml_str(&body) {
        Ok(p) => p,
        Err(e) => {
            {
                let mut r = s.reloads();
                r.api_rejected += 1;
                r.last_error = Some(e.to_string());
            }
            tracing::warn!(error = %e, "policy refused by the admin API; the old one keeps serving");
            return refusal(&e);
        }
    };
    if let Some(path) = s.policy_file.clone() {
        let bytes = body.clone().into_bytes();
        let written = tokio::task::spawn_blocking(move || write_durably(&path, &bytes))
            .await
            .unwrap_or_else(|e| {
                Err(DurableWriteError::NotWritten(std::io::Error::other(
                    e.to_string(),
                )))
            });
        let file = s.policy_file.as_deref().unwrap_or(Path::new("")).display();
        match written {
            Ok(()) => {}
            Err(DurableWriteError::NotWritten(e)) => {
                let msg =
                    format!("writing the policy file {file}: {e}; the old policy keeps serving");
                {
                    let mut r = s.reloads();
                    r.api_rejected += 1;
                    r.last_error = Some(msg.clone());
                }
                tracing::error!(error = %msg, "policy PUT not persisted");
                return error(StatusCode::INTERNAL_SERVER_ERROR, msg);
            }
            Err(DurableWriteError::NotSynced(e)) => {
                // The new file is in place (and the file watcher would load
                // it): it serves, but the write may not survive a power cut.
                let generation = s.router.replace(policy);
                let msg = format!(
                    "the new policy is in the file {file} and serves (generation {generation}), \
                     but syncing its directory failed: {e}; a power cut could bring the old \
                     file back"
                );
                {
                    let mut r = s.reloads();
                    r.api_ok += 1;
                    r.last_error = Some(msg.clone());
                }
                tracing::error!(error = %msg, "policy PUT applied, directory not synced");
                return error(StatusCode::INTERNAL_SERVER_ERROR, msg);
            }
        }
    }
    let generation = s.router.replace(policy);
    s.reloads().api_ok += 1;
    let sha256 = policy_sha256(&body);
    tracing::info!(generation, %sha256, persisted = s.policy_file.is_some(), "policy replaced through the admin API");
    Json(serde_json::json!({ "generation": generation, "sha256": sha256 })).into_response()
}

/// Prefix of [`write_durably`]'s temporary files next to `path`; the name
/// goes on with the writing process's id, a `-` and a random suffix.
fn temp_prefix(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!(".{name}.tandem-tmp-")
}

/// 64 unpredictable bits for a temporary file's name (std's per-process
/// random hash keys, mixed with the clock).
fn random_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.write_u128(nanos);
    h.finish()
}

/// The file a write to `path` must replace: `path`'s target when it is a
/// symbolic link (so the link stays a link), else `path`.
fn write_target(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Why [`write_durably`] failed, and so what is on disk.
#[derive(Debug, thiserror::Error)]
pub enum DurableWriteError {
    /// Nothing was replaced: the old content is in place.
    #[error("{0}")]
    NotWritten(std::io::Error),
    /// The new content is in place (renamed over the file), but the
    /// directory's fsync failed: a power cut could still bring the old back.
    #[error("the new file is in place, but syncing its directory failed: {0}")]
    NotSynced(std::io::Error),
}

/// Replaces `path`'s content with `bytes` so that a crash at any point leaves
/// either the old or the new content, complete: write a temporary file in the
/// same directory (a rename is atomic only within one file system; its name
/// carries the process id and a random suffix, and it is created with
/// `O_EXCL`, so nothing at a guessed name, a symbolic link included, is
/// followed or truncated), fsync it, give it the old file's permissions,
/// rename it over `path`, fsync the directory (so the rename itself survives
/// a power cut).
pub fn write_durably(path: &Path, bytes: &[u8]) -> Result<(), DurableWriteError> {
    let target = write_target(path);
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = dir.join(format!(
        "{}{}-{:016x}",
        temp_prefix(&target),
        std::process::id(),
        random_suffix()
    ));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        if let Ok(meta) = std::fs::metadata(&target) {
            std::fs::set_permissions(&tmp, meta.permissions())?;
        }
        std::fs::rename(&tmp, &target)
    })();
    if let Err(e) = written {
        // Only a file this call created (create_new failed otherwise).
        if e.kind() != std::io::ErrorKind::AlreadyExists {
            let _ = std::fs::remove_file(&tmp);
        }
        return Err(DurableWriteError::NotWritten(e));
    }
    std::fs::File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(DurableWriteError::NotSynced)
}

/// Whether process `pid` still runs (Linux: `/proc`; elsewhere only this
/// process is known to run, so only its own leftovers are removed).
fn process_runs(pid: u32) -> bool {
    if pid == std::process::id() {
        return false;
    }
    if cfg!(target_os = "linux") {
        Path::new("/proc").join(pid.to_string()).exists()
    } else {
        true
    }
}

/// Removes temporary files a killed [`write_durably`] left next to `path`
/// (they are never read: the rename had not happened): those of this
/// process's id (an earlier process that had it) and of processes that no
/// longer run. A running process's file (another server writing the same
/// policy file) is left alone.
fn remove_stale_temp_files(path: &Path) {
    let target = write_target(path);
    let (Some(dir), prefix) = (target.parent(), temp_prefix(&target)) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(&prefix) else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| !process_runs(p)) {
            let _ = std::fs::remove_file(e.path());
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
        frames: policy.frame_reports(&req.text),
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

/// What the hot-reload watcher remembers between polls.
#[derive(Debug, Default)]
struct Watcher {
    /// sha256 of the previous successful read.
    previous: Option<String>,
    /// sha256 of the last content refused (not re-validated, not re-counted).
    refused: Option<String>,
    /// The file was unreadable at the previous poll (logged once).
    unreadable: bool,
}

impl Watcher {
    /// One poll with the file's content `read` (module docs): swap it in once
    /// two consecutive reads agree and it differs from the serving policy.
    /// Call with `state.policy_lock` held. Returns the new generation if the
    /// policy was swapped.
    fn poll(
        &mut self,
        state: &AdminState,
        path: &Path,
        read: std::io::Result<String>,
    ) -> Option<u64> {
        let text = match read {
            Ok(t) => {
                self.unreadable = false;
                t
            }
            Err(e) => {
                // Editors replace files by rename; a missing file is transient.
                if !self.unreadable {
                    tracing::warn!(path = %path.display(), error = %e, "policy file unreadable; the current policy keeps serving");
                    self.unreadable = true;
                }
                self.previous = None;
                return None;
            }
        };
        let sha = policy_sha256(&text);
        let settled = self.previous.as_deref() == Some(sha.as_str());
        self.previous = Some(sha.clone());
        let serving = policy_sha256(state.router.policy().source());
        if sha == serving || self.refused.as_deref() == Some(sha.as_str()) || !settled {
            return None;
        }
        match state.router.reload_from_str(&text) {
            Ok(generation) => {
                self.refused = None;
                state.reloads().file_ok += 1;
                tracing::info!(path = %path.display(), generation, sha256 = %sha, "policy file reloaded");
                Some(generation)
            }
            Err(e) => {
                self.refused = Some(sha);
                {
                    let mut r = state.reloads();
                    r.file_rejected += 1;
                    r.last_error = Some(format!("{}: {e}", path.display()));
                }
                tracing::warn!(path = %path.display(), error = %e, "policy file refused; the old policy keeps serving");
                None
            }
        }
    }
}

/// The hot-reload loop: read the file every `every` and [`Watcher::poll`].
async fn watch(state: Arc<AdminState>, path: PathBuf, every: Duration) {
    let mut watcher = Watcher::default();
    loop {
        let p = path.clone();
        let read = tokio::task::spawn_blocking(move || std::fs::read_to_string(p))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        {
            let _serialised = state.policy_lock.lock().await;
            watcher.poll(&state, &path, read);
        }
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_router::DEFAULT_POLICY_TOML;

    const TICKETS: &str = "version = 1\ndefault = \"speculative\"\n\n[[recognizers]]\nname = \"TICKET\"\npattern = 'TCK-[0-9]{5}'\nscore = 0.9\n\n[[rules]]\nname = \"tickets\"\naction = \"local\"\nentities = [\"TICKET\"]\n";

    fn state() -> Arc<AdminState> {
        let router = Arc::new(Router::with_default_policy());
        AdminState::new(
            router,
            SharedDeviceState::default(),
            &AdminConfig::default(),
        )
    }

    #[test]
    fn a_file_read_half_written_once_is_never_loaded() {
        // A prefix of the policy that still parses: the same file with its
        // last rule missing is a weaker policy.
        let cut = TICKETS.find("[[rules]]").unwrap();
        let prefix = &TICKETS[..cut];
        assert!(Policy::from_toml_str(prefix).is_ok());
        let s = state();
        let path = Path::new("policy.toml");
        let mut w = Watcher::default();
        let serving = DEFAULT_POLICY_TOML.to_string();
        assert_eq!(w.poll(&s, path, Ok(serving.clone())), None);
        // Caught mid-write: the prefix, then the whole file.
        assert_eq!(w.poll(&s, path, Ok(prefix.into())), None);
        assert_eq!(w.poll(&s, path, Ok(TICKETS.into())), None);
        assert_eq!(s.router.policy().source(), DEFAULT_POLICY_TOML);
        // The whole file read twice: loaded.
        assert_eq!(w.poll(&s, path, Ok(TICKETS.into())), Some(2));
        assert_eq!(s.router.policy().source(), TICKETS);
        assert_eq!(s.reloads().file_ok, 1);
        // Unchanged: nothing more.
        assert_eq!(w.poll(&s, path, Ok(TICKETS.into())), None);
        // An unreadable poll in between forgets the previous read.
        assert_eq!(w.poll(&s, path, Ok(serving.clone())), None);
        assert_eq!(w.poll(&s, path, Err(std::io::Error::other("gone"))), None);
        assert_eq!(w.poll(&s, path, Ok(serving.clone())), None);
        assert_eq!(w.poll(&s, path, Ok(serving)), Some(3));
    }

    #[test]
    fn an_invalid_file_is_refused_once() {
        let s = state();
        let path = Path::new("policy.toml");
        let mut w = Watcher::default();
        let bad = "version = 1\ndefault = \"nowhere\"\n".to_string();
        for _ in 0..4 {
            assert_eq!(w.poll(&s, path, Ok(bad.clone())), None);
        }
        let r = s.reloads().clone();
        assert_eq!((r.file_ok, r.file_rejected), (0, 1));
        assert_eq!(s.router.generation(), 1);
    }

    #[test]
    fn a_durable_write_replaces_the_file_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("policy.toml");
        std::fs::write(&file, "old").unwrap();
        let link = dir.path().join("link.toml");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        write_durably(&link, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "new");
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        // A leftover of a killed write is removed at the next start: one of
        // this process's id, one of a process that is gone; a running
        // process's file (another server writing the same file) stays.
        let own = dir
            .path()
            .join(format!(".policy.toml.tandem-tmp-{}-0", std::process::id()));
        let gone = dir
            .path()
            .join(format!(".policy.toml.tandem-tmp-{}-1", u32::MAX));
        let running = dir.path().join(".policy.toml.tandem-tmp-1-2");
        for f in [&own, &gone, &running] {
            std::fs::write(f, "half").unwrap();
        }
        remove_stale_temp_files(&file);
        assert!(!own.exists() && !gone.exists());
        assert!(running.exists(), "pid 1 runs: its temporary file must stay");
        assert!(write_durably(&dir.path().join("no/such/dir/p.toml"), b"x").is_err());
    }

    #[test]
    fn a_durable_write_never_follows_a_planted_temporary_name() {
        // Temporary names are random, and created with O_EXCL: a symbolic
        // link at the old predictable name is neither followed nor
        // truncated.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("policy.toml");
        std::fs::write(&file, "old").unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let planted = dir
            .path()
            .join(format!(".policy.toml.tandem-tmp-{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        write_durably(&file, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "new");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        // Two writes never share a temporary name.
        assert_ne!(random_suffix(), random_suffix());
    }
}
