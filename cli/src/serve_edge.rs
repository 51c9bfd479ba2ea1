//! `tandem serve-edge`: the local OpenAI-compatible HTTP server
//! (`tandem_edge_http::openai`) around the device runtime: the draft model here,
//! the target behind `--verifier` (or nothing: every answer local), the
//! privacy router in front, the admin API under `/admin` when an admin token
//! is given. Prints `serving http://ADDR model=ID` as its first stdout line,
//! then serves until Ctrl-C (which cancels what runs) or SIGTERM (which lets
//! the admitted requests finish first; a second signal cancels them).
//! Reference: docs/api.md.

use crate::generate_args::RemoteArgs;
use anyhow::{Context, Result};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use tandem_cli_common::models::resolve_model;
use tandem_edge::context_policy::ContextPolicy;
use tandem_edge::{assemble, AssemblyConfig};
use tandem_edge_http::admin::AdminConfig;
use tandem_edge_http::openai::{self, ServeConfig};
use tandem_fetch::ModelRole;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Address to serve on (port 0: any free port; the first stdout line
    /// says which). Non-loopback needs --allow-non-loopback.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Serve on a non-loopback address (the /v1 API has no authentication
    /// unless --api-key-env is given).
    #[arg(long)]
    pub allow_non_loopback: bool,
    /// A `Host` name to answer to besides 127.0.0.1, localhost and [::1]
    /// (repeatable; e.g. the LAN name with --allow-non-loopback). Other Hosts
    /// get 403 (DNS rebinding).
    #[arg(long = "allow-host", value_name = "NAME")]
    pub allow_hosts: Vec<String>,
    /// A browser origin (`https://app.example:8443`) allowed to call the API
    /// besides loopback origins, with CORS (repeatable). Requests from any
    /// other Origin get 403.
    #[arg(long = "allow-origin", value_name = "ORIGIN")]
    pub allow_origins: Vec<String>,
    /// Environment variable holding an API key (>= 16 chars) every /v1
    /// request must send as `Authorization: Bearer <key>` (OpenAI clients'
    /// `api_key`).
    #[arg(long)]
    pub api_key_env: Option<String>,
    /// The model id clients name in their requests.
    #[arg(long, default_value = "tandem")]
    pub model_name: String,
    /// Requests that may wait while every slot generates; one more gets 429
    /// (with Retry-After).
    #[arg(long, visible_alias = "queue", default_value_t = 8)]
    pub queue_depth: usize,
    /// Generations that may run at once (slots). Each has its own draft KV
    /// and verifier session; the draft weights are shared.
    #[arg(long, default_value_t = 2)]
    pub parallel: usize,
    /// Largest max_tokens a request may ask for.
    #[arg(long, default_value_t = 4096)]
    pub max_tokens_limit: usize,
    /// max_tokens of a request that gives none.
    #[arg(long, default_value_t = 256)]
    pub default_max_tokens: usize,
    /// Draft block length (1..=16).
    #[arg(long, default_value_t = 4)]
    pub k: usize,
    /// KV cache capacity in tokens (prompt + output).
    #[arg(long, default_value_t = 4096)]
    pub max_seq_len: usize,
    /// The draft model: a GGUF path, a built-in name, or the name of one of
    /// yours in the models directory (`tandem models list`) [default: the
    /// built-in draft].
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// With `--split`: the target model whose first layers the device runs,
    /// as `--draft-model` [default: the built-in target]. It must be the
    /// verifier's model.
    #[arg(long)]
    pub target_model: Option<PathBuf>,
    /// What a conversation that outgrows --max-seq-len gets: `refuse` (400
    /// context_length_exceeded, naming the limit) or `drop_oldest` (the oldest
    /// messages after the system prompt are dropped; the reply's
    /// tandem.stats.dropped_messages says how many). Default: the edge
    /// config's `[conversations] context_policy` (refuse).
    #[arg(long, value_name = "refuse|drop_oldest")]
    pub context_policy: Option<ContextPolicy>,
    /// Environment variable holding the admin bearer token (>= 16 chars);
    /// enables /admin/v1/... (policy, explain, route and serve stats) and the
    /// --policy file hot reload. Without it /admin answers 403.
    #[arg(long)]
    pub admin_token_env: Option<String>,
    /// Refuse unknown request fields with a 400 naming them (OpenAI's
    /// behaviour). Without it they are ignored, as vLLM and llama.cpp do, and
    /// named in the `x-tandem-ignored-fields` response header. Fields Tandem
    /// knows but does not implement (`tools`, `logprobs`, …) are a 400 either
    /// way.
    #[arg(long)]
    pub strict_api: bool,
    /// How often the --policy file is re-read for hot reload (ms).
    #[arg(long, default_value_t = 500)]
    pub policy_poll_ms: u64,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

pub fn run(args: Args) -> Result<()> {
    // Fail before loading any model.
    anyhow::ensure!(
        args.listen.ip().is_loopback() || args.allow_non_loopback,
        "--listen {} is not a loopback address; add --allow-non-loopback to expose the /v1 API (and --api-key-env: it has no authentication without one)",
        args.listen
    );
    let mut cfg = args.remote.edge_config(args.k)?;
    if let Some(p) = args.context_policy {
        cfg.conversations.context_policy = p;
    }
    let admin_token = secret_from_env(
        "--admin-token-env",
        "admin token",
        args.admin_token_env.as_deref(),
    )?;
    let api_key = secret_from_env("--api-key-env", "API key", args.api_key_env.as_deref())?;
    let split = cfg.split.is_some();
    anyhow::ensure!(
        split || args.target_model.is_none(),
        "--target-model is for --split (the device runs the target's first layers); \
         without it the verifier holds the target"
    );
    let draft = resolve_model(ModelRole::Draft, args.draft_model.as_ref())?;
    // --split: the device runs the target's first layers itself (as in
    // `generate --verifier --split`).
    let split_target = split
        .then(|| resolve_model(ModelRole::Target, args.target_model.as_ref()))
        .transpose()?;
    // The --parallel slots are the runtime's siblings (`openai::start`):
    // one draft in memory.
    let device = assemble(AssemblyConfig {
        draft: draft.into(),
        split_target,
        max_seq_len: args.max_seq_len,
        policy: args.remote.policy.clone(),
        privacy_router: !args.remote.no_privacy_router,
        edge: cfg,
    })?;
    let (routed, routed_rt) = (device.routes, device.routed);
    let serve = ServeConfig {
        listen: args.listen,
        allow_non_loopback: args.allow_non_loopback,
        allowed_hosts: args.allow_hosts.clone(),
        allowed_origins: args.allow_origins.clone(),
        api_key,
        model_id: args.model_name.clone(),
        queue_depth: args.queue_depth,
        parallel: args.parallel,
        max_tokens_limit: args.max_tokens_limit,
        default_max_tokens: args.default_max_tokens,
        routed,
        strict_api: args.strict_api,
        admin: admin_token.map(|token| AdminConfig {
            token,
            policy_file: args.remote.policy.clone(),
            poll_interval_ms: args.policy_poll_ms,
            ..AdminConfig::default()
        }),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let server = openai::start(routed_rt, serve).await?;
        {
            let mut out = std::io::stdout().lock();
            writeln!(
                out,
                "serving http://{} model={}",
                server.addr, args.model_name
            )?;
            out.flush()?;
        }
        eprintln!(
            "tandem serve-edge: OpenAI-compatible API on http://{}/v1 ({} generation slots; {}; {}); \
             Ctrl-C stops, SIGTERM drains",
            server.addr,
            args.parallel,
            if routed {
                "privacy router on"
            } else {
                "no privacy routing"
            },
            if args.admin_token_env.is_some() {
                "admin API under /admin"
            } else {
                "admin API off"
            }
        );
        let mut term = terminate_signal()?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => server.shutdown().await,
            _ = term.recv() => {
                eprintln!(
                    "tandem serve-edge: SIGTERM: no new connections; finishing the admitted \
                     requests (a second signal cancels them)"
                );
                server
                    .drain(async {
                        tokio::select! {
                            _ = tokio::signal::ctrl_c() => {}
                            _ = term.recv() => {}
                        }
                    })
                    .await;
                eprintln!("tandem serve-edge: drained");
            }
        }
        anyhow::Ok(())
    })
}

/// SIGTERM (what service managers and Kubernetes send to stop a server).
#[cfg(unix)]
fn terminate_signal() -> Result<tokio::signal::unix::Signal> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("listening for SIGTERM")
}

/// No SIGTERM off Unix: a signal that never comes.
#[cfg(not(unix))]
fn terminate_signal() -> Result<NeverSignal> {
    Ok(NeverSignal)
}

#[cfg(not(unix))]
struct NeverSignal;

#[cfg(not(unix))]
impl NeverSignal {
    async fn recv(&mut self) -> Option<()> {
        std::future::pending().await
    }
}

/// The secret in the environment variable `var` names (trimmed; at least 16
/// characters), when `flag` was given.
fn secret_from_env(flag: &str, what: &str, var: Option<&str>) -> Result<Option<String>> {
    let Some(var) = var else {
        return Ok(None);
    };
    let t = std::env::var(var).with_context(|| format!("{flag}: environment variable {var}"))?;
    let t = t.trim().to_string();
    anyhow::ensure!(
        t.chars().count() >= 16,
        "the {what} in {var} must be at least 16 characters"
    );
    Ok(Some(t))
}
