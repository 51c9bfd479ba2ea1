//! The verifier's one configuration type, loaded from TOML (documented field by
//! field in `docs/verifier.md` and `config/verifier.example.toml`).

use crate::auth::DeviceCredential;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Everything `tandem serve-verifier` needs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifierConfig {
    /// gRPC listen address.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Admin HTTP (healthz/readyz/metrics) listen address.
    #[serde(default = "default_admin_listen")]
    pub admin_listen: SocketAddr,
    /// Bearer token `/metrics` requires (`/healthz` and `/readyz` stay open for
    /// probes). At most one of `metrics_token` / `metrics_token_env`; neither
    /// leaves `/metrics` open.
    #[serde(default)]
    pub metrics_token: Option<String>,
    /// Name of an environment variable holding the `/metrics` token.
    #[serde(default)]
    pub metrics_token_env: Option<String>,
    /// Serve gRPC server reflection (what `grpcurl` lists without a .proto).
    /// Off by default; when on it answers requests with a device token only.
    #[serde(default)]
    pub reflection: bool,
    /// Target model GGUF; default: the fetched target (`tandem models path target`).
    #[serde(default)]
    pub model_path: Option<PathBuf>,
    /// Model id the device must name in Open.
    #[serde(default = "default_model_id")]
    pub model_id: String,
    /// Tokenizer fingerprint devices must present; default: computed from the GGUF's
    /// tokenizer (or from the model's shape when it has no tokenizer metadata).
    #[serde(default)]
    pub tokenizer_fingerprint: Option<String>,
    /// KV cache capacity per session, in tokens.
    #[serde(default = "default_max_seq_len")]
    pub max_seq_len: usize,
    /// Allow plain-text gRPC; only accepted when `listen` is a loopback address.
    #[serde(default)]
    pub insecure_loopback: bool,
    /// TLS (required unless `insecure_loopback`).
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// Devices allowed to connect, each with its own bearer token.
    #[serde(default)]
    pub devices: Vec<DeviceConfig>,
    /// Limits.
    #[serde(default)]
    pub limits: Limits,
    /// How the scheduler packs many sessions' work into one forward.
    #[serde(default)]
    pub batching: Batching,
}

/// The scheduler's knobs (`[batching]`): one thread owns the target model and,
/// each iteration, runs one forward over rows from many sessions.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Batching {
    /// Pack several sessions' rows into one forward. `false` runs one message per
    /// forward (the old path, kept for `tandem bench verifier --no-batching`).
    pub enabled: bool,
    /// Most rows (tokens) in one forward: verify blocks, streaming steps and
    /// prefill chunks together.
    pub max_batch_rows: usize,
    /// Most prompt rows one session's prefill puts into one forward, so a long
    /// Open or resume never stalls other sessions' verifies for long.
    /// Default: [`default_prefill_chunk`] of the kernel path this process runs.
    pub prefill_chunk: usize,
    /// When the queue is empty, how long the scheduler waits after the first
    /// arrival for more work to share the forward (microseconds).
    pub gather_window_us: u64,
}

impl Default for Batching {
    fn default() -> Self {
        Self {
            enabled: true,
            max_batch_rows: 64,
            prefill_chunk: default_prefill_chunk(tandem_model::quant::Isa::selected()),
            gather_window_us: 200,
        }
    }
}

/// The default `[batching] prefill_chunk` for a kernel path, from the
/// target's measured cost per row (docs/model-core.md, "AMX, round three":
/// the cost curve per ISA). On AMX a row keeps getting cheaper up to ~64
/// rows in a forward, so 32-row chunks; on the other paths a row costs the
/// same from ~8 rows on, so 16-row chunks cost no throughput and halve the
/// wait of a verify queued behind a chunk.
pub fn default_prefill_chunk(isa: tandem_model::quant::Isa) -> usize {
    match isa {
        tandem_model::quant::Isa::Amx => 32,
        _ => 16,
    }
}

/// TLS material (PEM files).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// Server certificate chain (PEM).
    pub cert_pem: PathBuf,
    /// Server private key (PEM).
    pub key_pem: PathBuf,
    /// When set, clients must present a certificate signed by this CA (mutual TLS).
    #[serde(default)]
    pub client_ca_pem: Option<PathBuf>,
    /// Require each request's client certificate to be issued to the device
    /// its bearer token names (the device's `cert_name`, as a DNS subject
    /// alternative name). Needs `client_ca_pem`.
    #[serde(default)]
    pub bind_client_identity: bool,
}

/// One device identity.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    /// Identity name (logged, used in metrics-free audit; sessions are bound to it).
    pub id: String,
    /// Bearer token, inline. Exactly one of `token` / `token_env` must be set.
    #[serde(default)]
    pub token: Option<String>,
    /// Name of an environment variable holding the bearer token.
    #[serde(default)]
    pub token_env: Option<String>,
    /// The DNS name this device's client certificate is issued to, checked
    /// when `[tls] bind_client_identity = true` (default: `id`).
    #[serde(default)]
    pub cert_name: Option<String>,
}

/// Service limits; each refusal has its own status reason.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Most sessions held at once (idle ones are evicted LRU to make room).
    pub max_sessions: usize,
    /// Byte budget of all sessions' KV caches (LRU eviction above it).
    pub session_budget_bytes: u64,
    /// Sessions idle longer than this are evicted.
    pub idle_ttl_secs: u64,
    /// Longest context (prompt + generated) a session may hold.
    pub max_prompt_tokens: usize,
    /// Largest draft block k (at most 16).
    pub max_block: usize,
    /// Largest gRPC message accepted, in bytes.
    pub max_message_bytes: usize,
    /// Sustained messages per second per identity.
    pub rate_per_sec: f64,
    /// Burst of messages per identity above the sustained rate.
    pub rate_burst: f64,
    /// Most sessions one identity holds (its own idle sessions are evicted
    /// first to make room; then QUOTA_EXCEEDED).
    pub max_sessions_per_identity: usize,
    /// Most KV bytes one identity's sessions hold.
    pub max_bytes_per_identity: u64,
    /// Sustained prompt tokens prefilled per second per identity (Opens and
    /// resumes are charged per token they make the verifier compute).
    pub prefill_tokens_per_sec: f64,
    /// Burst of prefilled tokens per identity above the sustained rate (at
    /// least max_prompt_tokens, so any one allowed context can be sent).
    pub prefill_burst_tokens: f64,
    /// Prompt tokens being prefilled at once, over all identities; an Open
    /// beyond it waits (up to `prefill_wait_secs`) for room.
    pub max_inflight_prefill_tokens: usize,
    /// Prompt tokens one identity may have in flight at once (its share of
    /// the above); beyond it: QUOTA_EXCEEDED.
    pub max_inflight_prefill_tokens_per_identity: usize,
    /// How long an Open waits for room in the prefill budget before
    /// QUOTA_EXCEEDED.
    pub prefill_wait_secs: u64,
    /// A stream that sends nothing for this long is ended with STREAM_IDLE
    /// (its session is kept for a resume).
    pub stream_idle_secs: u64,
    /// Most open connections (TCP/TLS); more are closed at accept.
    pub max_connections: usize,
    /// Most open connections from one peer IP address; more from it are
    /// closed at accept. Behind a proxy or a NAT every device shares the
    /// proxy's address: raise it there (up to `max_connections`).
    pub max_connections_per_peer: usize,
    /// An accepted connection that sends nothing, or does not finish its TLS
    /// handshake, within this many seconds is closed.
    pub handshake_timeout_secs: u64,
    /// A connection older than this (seconds) is asked to go away (HTTP/2
    /// GOAWAY: no new streams; a device re-connects for its next one) ...
    pub max_connection_age_secs: u64,
    /// ... and closed this many seconds later if its streams have not ended
    /// (a device re-opens its session with its context).
    pub max_connection_age_grace_secs: u64,
    /// Most concurrent streams per HTTP/2 connection.
    pub max_streams_per_connection: u32,
    /// Most streams one identity has open at once (over all its
    /// connections); one more is refused with QUOTA_EXCEEDED.
    pub max_streams_per_identity: usize,
    /// Most Opens one identity has in flight (admitted, not yet answered);
    /// one more is refused with QUOTA_EXCEEDED.
    pub max_inflight_opens_per_identity: usize,
    /// HTTP/2 keepalive ping interval (seconds); a peer that does not answer
    /// within `keepalive_timeout_secs` is disconnected.
    pub keepalive_interval_secs: u64,
    pub keepalive_timeout_secs: u64,
    /// How long a drain (SIGTERM) waits for open connections to finish before
    /// closing them (a peer that never completes HTTP/2's closing handshake
    /// would otherwise keep the process alive).
    pub drain_timeout_secs: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_sessions: 64,
            session_budget_bytes: 4 << 30,
            idle_ttl_secs: 600,
            max_prompt_tokens: 3072,
            max_block: 16,
            max_message_bytes: 1 << 20,
            rate_per_sec: 200.0,
            rate_burst: 400.0,
            max_sessions_per_identity: 32,
            max_bytes_per_identity: 2 << 30,
            prefill_tokens_per_sec: 4096.0,
            prefill_burst_tokens: 12288.0,
            max_inflight_prefill_tokens: 16384,
            max_inflight_prefill_tokens_per_identity: 8192,
            prefill_wait_secs: 30,
            stream_idle_secs: 300,
            max_connections: 1024,
            max_connections_per_peer: 64,
            handshake_timeout_secs: 10,
            max_connection_age_secs: 3600,
            max_connection_age_grace_secs: 300,
            max_streams_per_connection: 64,
            max_streams_per_identity: 128,
            max_inflight_opens_per_identity: 32,
            keepalive_interval_secs: 30,
            keepalive_timeout_secs: 20,
            drain_timeout_secs: 60,
        }
    }
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 50051))
}
fn default_admin_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9464))
}
fn default_model_id() -> String {
    "qwen2.5-coder-1.5b-instruct-q4_k_m".into()
}
fn default_max_seq_len() -> usize {
    4096
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// Hard cap on the block size (the protocol's promise to devices).
pub const MAX_BLOCK_CAP: usize = 16;

/// Hard cap on `batching.max_batch_rows`.
pub const MAX_BATCH_ROWS_CAP: usize = 512;

impl VerifierConfig {
    /// Read and validate a TOML file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let cfg: Self = toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks ranges and the TLS / loopback rule.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let l = &self.limits;
        if l.max_block == 0 || l.max_block > MAX_BLOCK_CAP {
            return bad(format!(
                "limits.max_block must be in 1..={MAX_BLOCK_CAP}, got {}",
                l.max_block
            ));
        }
        // Checked sums: a huge value in the file must be refused, not wrap.
        let context_need = l
            .max_prompt_tokens
            .checked_add(l.max_block)
            .and_then(|n| n.checked_add(1));
        if l.max_prompt_tokens == 0 || context_need.is_none_or(|n| n > self.max_seq_len) {
            return bad(format!(
                "limits.max_prompt_tokens ({}) + max_block ({}) + 1 must fit max_seq_len ({})",
                l.max_prompt_tokens, l.max_block, self.max_seq_len
            ));
        }
        if l.max_sessions == 0 {
            return bad("limits.max_sessions must be at least 1".into());
        }
        if !(l.rate_per_sec > 0.0 && l.rate_burst >= 1.0) {
            return bad("limits.rate_per_sec must be > 0 and limits.rate_burst >= 1".into());
        }
        if l.max_sessions_per_identity == 0 || l.max_bytes_per_identity == 0 {
            return bad(
                "limits.max_sessions_per_identity and max_bytes_per_identity must be at least 1"
                    .into(),
            );
        }
        if !(l.prefill_tokens_per_sec > 0.0 && l.prefill_burst_tokens >= l.max_prompt_tokens as f64)
        {
            return bad(format!(
                "limits.prefill_tokens_per_sec must be > 0 and prefill_burst_tokens at least \
                 max_prompt_tokens ({})",
                l.max_prompt_tokens
            ));
        }
        if l.max_inflight_prefill_tokens_per_identity < l.max_prompt_tokens
            || l.max_inflight_prefill_tokens < l.max_inflight_prefill_tokens_per_identity
        {
            return bad(format!(
                "limits: max_prompt_tokens ({}) <= max_inflight_prefill_tokens_per_identity ({}) \
                 <= max_inflight_prefill_tokens ({}) must hold",
                l.max_prompt_tokens,
                l.max_inflight_prefill_tokens_per_identity,
                l.max_inflight_prefill_tokens
            ));
        }
        if l.stream_idle_secs == 0
            || l.max_connections == 0
            || l.max_connections_per_peer == 0
            || l.max_streams_per_identity == 0
            || l.max_inflight_opens_per_identity == 0
            || l.handshake_timeout_secs == 0
            || l.max_connection_age_secs == 0
            || l.max_connection_age_grace_secs == 0
            || l.max_streams_per_connection == 0
            || l.keepalive_interval_secs == 0
            || l.keepalive_timeout_secs == 0
            || l.drain_timeout_secs == 0
        {
            return bad(
                "limits.stream_idle_secs, max_connections, max_connections_per_peer, \
                 max_streams_per_identity, max_inflight_opens_per_identity, \
                 handshake_timeout_secs, max_connection_age_secs, \
                 max_connection_age_grace_secs, max_streams_per_connection, \
                 keepalive_interval_secs, keepalive_timeout_secs and drain_timeout_secs must be \
                 at least 1"
                    .into(),
            );
        }
        let b = &self.batching;
        if b.max_batch_rows <= l.max_block || b.max_batch_rows > MAX_BATCH_ROWS_CAP {
            return bad(format!(
                "batching.max_batch_rows must be in max_block + 1 ({})..={MAX_BATCH_ROWS_CAP}, got {}",
                l.max_block.saturating_add(1),
                b.max_batch_rows
            ));
        }
        if b.prefill_chunk == 0 || b.prefill_chunk > b.max_batch_rows {
            return bad(format!(
                "batching.prefill_chunk must be in 1..=max_batch_rows ({}), got {}",
                b.max_batch_rows, b.prefill_chunk
            ));
        }
        if b.gather_window_us > 100_000 {
            return bad(format!(
                "batching.gather_window_us must be at most 100000 (0.1 s), got {}",
                b.gather_window_us
            ));
        }
        if l.max_message_bytes < 1024 {
            return bad("limits.max_message_bytes must be at least 1024".into());
        }
        match (&self.tls, self.insecure_loopback) {
            (Some(_), true) => {
                return bad("set either [tls] or insecure_loopback = true, not both".into())
            }
            (None, false) => {
                return bad(
                    "TLS is not configured: add a [tls] section (cert_pem, key_pem), or set \
                     insecure_loopback = true to serve plain text on a loopback address"
                        .into(),
                )
            }
            (None, true) if !self.listen.ip().is_loopback() => {
                return bad(format!(
                    "insecure_loopback = true only allows a loopback listen address, got {}",
                    self.listen
                ))
            }
            _ => {}
        }
        if let Some(t) = &self.tls {
            if t.bind_client_identity && t.client_ca_pem.is_none() {
                return bad(
                    "tls.bind_client_identity = true needs tls.client_ca_pem (mutual TLS)".into(),
                );
            }
        }
        if self.metrics_token.is_some() && self.metrics_token_env.is_some() {
            return bad("set at most one of metrics_token / metrics_token_env".into());
        }
        if self.devices.is_empty() {
            return bad("no [[devices]]: at least one device token is required".into());
        }
        for d in &self.devices {
            if d.token.is_some() == d.token_env.is_some() {
                return bad(format!(
                    "device {:?}: set exactly one of token / token_env",
                    d.id
                ));
            }
        }
        Ok(())
    }

    /// Resolves every device's credentials (reading `token_env` variables).
    /// Two devices with the same id or the same token are refused: a shared
    /// token would authenticate as whichever device came last, silently.
    pub fn device_credentials(&self) -> Result<Vec<DeviceCredential>, ConfigError> {
        let creds = self
            .devices
            .iter()
            .map(|d| {
                let what = format!("device {:?}", d.id);
                let token = resolve_secret(&what, d.token.as_deref(), d.token_env.as_deref())?
                    .ok_or_else(|| ConfigError::Invalid(format!("{what}: no token")))?;
                Ok(DeviceCredential {
                    id: d.id.clone(),
                    token,
                    cert_name: d.cert_name.clone().unwrap_or_else(|| d.id.clone()),
                })
            })
            .collect::<Result<Vec<_>, ConfigError>>()?;
        for (i, a) in creds.iter().enumerate() {
            for b in &creds[..i] {
                if a.id == b.id {
                    return Err(ConfigError::Invalid(format!(
                        "two [[devices]] have the id {:?}; each device needs its own id",
                        a.id
                    )));
                }
                if a.token == b.token {
                    return Err(ConfigError::Invalid(format!(
                        "devices {:?} and {:?} have the same token; each device needs its own",
                        b.id, a.id
                    )));
                }
            }
        }
        Ok(creds)
    }

    /// The `/metrics` token, if one is configured.
    pub fn metrics_token(&self) -> Result<Option<String>, ConfigError> {
        resolve_secret(
            "metrics_token",
            self.metrics_token.as_deref(),
            self.metrics_token_env.as_deref(),
        )
    }
}

/// A secret given inline or through an environment variable: at least 16
/// characters (`what` names it in errors).
fn resolve_secret(
    what: &str,
    inline: Option<&str>,
    env: Option<&str>,
) -> Result<Option<String>, ConfigError> {
    let secret = match (inline, env) {
        (Some(t), _) => t.to_owned(),
        (None, Some(var)) => std::env::var(var).map_err(|_| {
            ConfigError::Invalid(format!("{what}: environment variable {var} is not set"))
        })?,
        (None, None) => return Ok(None),
    };
    if secret.chars().count() < 16 {
        return Err(ConfigError::Invalid(format!(
            "{what}: token must be at least 16 characters"
        )));
    }
    Ok(Some(secret))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_model::quant::Isa;

    #[test]
    fn the_default_prefill_chunk_follows_the_kernel_path() {
        assert_eq!(default_prefill_chunk(Isa::Amx), 32);
        for isa in [
            Isa::Scalar,
            Isa::Avx2,
            Isa::Avx512Vnni,
            Isa::Neon,
            Isa::NeonDotprod,
        ] {
            assert_eq!(default_prefill_chunk(isa), 16, "{isa}");
        }
        assert_eq!(
            Batching::default().prefill_chunk,
            default_prefill_chunk(Isa::selected())
        );
        // A [batching] table without the key takes the default; the key wins.
        let parsed: Batching = toml::from_str("max_batch_rows = 48").unwrap_or_default();
        assert_eq!(
            (parsed.max_batch_rows, parsed.prefill_chunk),
            (48, default_prefill_chunk(Isa::selected()))
        );
        let parsed: Batching = toml::from_str("prefill_chunk = 8").unwrap_or_default();
        assert_eq!(parsed.prefill_chunk, 8);
    }
}
