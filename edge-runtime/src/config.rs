//! [`EdgeConfig`]: everything the device needs to reach the verifier and to decide
//! when to give up on it. Loadable from TOML; every field has a default, so an empty
//! file (or `EdgeConfig::default()`) means "no verifier: generate locally".

use crate::error::EdgeError;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Device-side configuration (documented field by field in `docs/edge.md`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EdgeConfig {
    /// Verifier gRPC URL (`https://host:port`, or `http://127.0.0.1:port` on
    /// loopback). `None`: every generation is local.
    pub verifier_url: Option<String>,
    /// PEM of the CA that signed the verifier's certificate (required for https).
    pub ca_cert_pem: Option<PathBuf>,
    /// Client certificate + key (PEM) for mutual TLS.
    pub client_cert_pem: Option<PathBuf>,
    pub client_key_pem: Option<PathBuf>,
    /// Name to check the server certificate against (default: the URL's host).
    pub tls_domain: Option<String>,
    /// Bearer token sent as `authorization: Bearer <token>`.
    pub token: Option<String>,
    /// Environment variable holding the token (used when `token` is unset).
    pub token_env: Option<String>,
    /// Target model id the device expects the verifier to serve.
    pub model_id: String,
    /// Tokenizer fingerprint override (default: computed from the draft GGUF).
    pub tokenizer_fingerprint: Option<String>,
    /// Draft block length used by callers that do not pass their own (1..=16).
    pub k: usize,
    /// What proposes the blocks, for callers that do not pass their own
    /// (`tandem serve-edge`, the C ABI): `draft` (the draft model), `lookup`
    /// (prompt lookup, no model) or `auto` (per round, whichever promises more
    /// tokens per second; the default). Applies to plain rounds; pipelined and
    /// gated rounds draft with the model (docs/edge.md "Proposers").
    pub proposer: tandem_model::proposer::ProposerKind,
    /// TCP + TLS connect timeout.
    pub connect_timeout_ms: u64,
    /// Deadline for `Opened` / `Resumed` (the verifier prefills the context).
    pub open_timeout_ms: u64,
    /// Per-verify deadline before any RTT was measured.
    pub deadline_initial_ms: u64,
    /// Per-verify deadline = clamp(p95(RTT) × `deadline_factor`, floor, max).
    pub deadline_floor_ms: u64,
    pub deadline_factor: f64,
    pub deadline_max_ms: u64,
    /// Backoff before retry i (i ≥ 1): min(base × 2^(i-1), max).
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    /// Consecutive failures (timeouts, broken streams, refused connects) that open
    /// the circuit breaker.
    pub breaker_failures: u32,
    /// Interval of the background health probe while the breaker is open.
    pub probe_interval_ms: u64,
    /// Timeout of one health probe.
    pub probe_timeout_ms: u64,
    /// Adaptive k, pipelined drafting, target streaming (`[speculation]`; see
    /// `crate::adaptive::SpeculationConfig`).
    pub speculation: crate::adaptive::SpeculationConfig,
    /// Split execution (`[split]`; see `crate::split` and docs/shard-planner.md):
    /// the device runs target layers `[0, s)`. Needs the target model on the
    /// device (`EdgeRuntimeBuilder::split_target`; a `[split]` without it is refused).
    pub split: Option<crate::device_layers::SplitConfig>,
    /// Uncertainty-gated verification (`[gate]`; see [`GateConfig`]).
    pub gate: GateConfig,
    /// Multi-turn state kept between generations (`[conversations]`; see
    /// `crate::conversation`).
    pub conversations: crate::conversation::ConversationConfig,
    /// Run a short warm-up forward of the draft when the runtime is built
    /// (pages the weights in, starts the thread pool), so the first request
    /// does not pay for it (`EdgeRuntime::warmup_ms`).
    pub warmup: bool,
}

/// Uncertainty-gated verification (`[gate]`, greedy only; docs/edge.md "Gated
/// verification"): a drafted block whose every token the draft is confident
/// about (top-1 probability ≥ `confidence`) is shown at once as provisional and
/// not sent; it is verified together with the next block that is sent. A
/// provisional token the verifier disagrees with is reported (a
/// `ProvisionalChecked` event with its position), as after an outage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GateConfig {
    /// Minimum top-1 probability of every token of a block to skip its round
    /// trip, in (0, 1]; 0 = off (every block is verified before it is shown).
    pub confidence: f64,
    /// At most this many gated tokens wait for verification; a block that
    /// would exceed it is sent (with them). 1..=15.
    pub max_span: usize,
}

impl Default for GateConfig {
    fn default() -> Self {
        Self {
            confidence: 0.0,
            max_span: 8,
        }
    }
}

impl GateConfig {
    pub fn enabled(&self) -> bool {
        self.confidence > 0.0
    }

    pub fn validate(&self) -> Result<(), String> {
        if !(self.confidence.is_finite() && (0.0..=1.0).contains(&self.confidence)) {
            return Err(format!(
                "gate.confidence must be in [0, 1] (0 = off), got {}",
                self.confidence
            ));
        }
        if self.max_span == 0 || self.max_span > 15 {
            return Err(format!(
                "gate.max_span must be in 1..=15, got {}",
                self.max_span
            ));
        }
        Ok(())
    }
}

impl Default for EdgeConfig {
    fn default() -> Self {
        Self {
            verifier_url: None,
            ca_cert_pem: None,
            client_cert_pem: None,
            client_key_pem: None,
            tls_domain: None,
            token: None,
            token_env: None,
            model_id: "qwen2.5-coder-1.5b-instruct-q4_k_m".into(),
            tokenizer_fingerprint: None,
            k: 4,
            proposer: tandem_model::proposer::ProposerKind::Auto,
            connect_timeout_ms: 2_000,
            open_timeout_ms: 30_000,
            deadline_initial_ms: 5_000,
            deadline_floor_ms: 250,
            deadline_factor: 3.0,
            deadline_max_ms: 30_000,
            backoff_base_ms: 50,
            backoff_max_ms: 2_000,
            breaker_failures: 3,
            probe_interval_ms: 1_000,
            probe_timeout_ms: 1_000,
            speculation: Default::default(),
            split: None,
            gate: GateConfig::default(),
            conversations: Default::default(),
            warmup: false,
        }
    }
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

impl EdgeConfig {
    /// Parses a TOML file and validates it.
    pub fn from_file(path: &Path) -> Result<Self, EdgeError> {
        let text = std::fs::read_to_string(path).map_err(|source| EdgeError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml(&text)
    }

    /// Parses TOML text and validates it.
    pub fn from_toml(text: &str) -> Result<Self, EdgeError> {
        let cfg: Self = toml::from_str(text).map_err(|e| EdgeError::Config(e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks ranges and combinations; the error names the field.
    pub fn validate(&self) -> Result<(), EdgeError> {
        let bad = |m: String| Err(EdgeError::Config(m));
        if self.k == 0 || self.k > 16 {
            return bad(format!("k must be in 1..=16, got {}", self.k));
        }
        if let Some(url) = &self.verifier_url {
            let https = url.starts_with("https://");
            if !https && !url.starts_with("http://") {
                return bad(format!(
                    "verifier_url must start with http:// or https://, got {url:?}"
                ));
            }
            if https && self.ca_cert_pem.is_none() {
                return bad("verifier_url is https but ca_cert_pem is not set".into());
            }
            if !https && (self.ca_cert_pem.is_some() || self.client_cert_pem.is_some()) {
                return bad("TLS files are set but verifier_url is plain http".into());
            }
            if !https {
                // The bearer token and the token ids would cross the network
                // in clear text; the verifier refuses plain text off loopback
                // for the same reason.
                match crate::loopback::url_host(url) {
                    Some(h) if crate::loopback::is_loopback_host(&h) => {}
                    host => {
                        return bad(format!(
                            "verifier_url {url:?} is plain http:// to {}, which is not a loopback \
                             address: the bearer token and token ids would travel in clear text; \
                             use https:// with ca_cert_pem (plain http:// is only allowed to \
                             127.0.0.1, [::1] or localhost)",
                            host.as_deref().unwrap_or("an unparseable host")
                        ))
                    }
                }
            }
        }
        if self.client_cert_pem.is_some() != self.client_key_pem.is_some() {
            return bad("client_cert_pem and client_key_pem go together".into());
        }
        if !(self.deadline_factor.is_finite() && self.deadline_factor >= 1.0) {
            return bad(format!(
                "deadline_factor must be >= 1, got {}",
                self.deadline_factor
            ));
        }
        if self.deadline_floor_ms == 0 || self.deadline_floor_ms > self.deadline_max_ms {
            return bad("need 0 < deadline_floor_ms <= deadline_max_ms".into());
        }
        self.speculation.validate().map_err(EdgeError::Config)?;
        self.gate.validate().map_err(EdgeError::Config)?;
        self.conversations.validate().map_err(EdgeError::Config)?;
        let sp = &self.speculation;
        if self.gate.enabled() && (sp.adaptive_k || sp.pipeline || sp.target_stream) {
            return bad(
                "gate.confidence cannot be combined with speculation.adaptive_k, pipeline or target_stream"
                    .into(),
            );
        }
        if let Some(sp) = &self.split {
            sp.validate()?;
        }
        if self.breaker_failures == 0 {
            return bad("breaker_failures must be at least 1".into());
        }
        if self.probe_interval_ms == 0 || self.connect_timeout_ms == 0 || self.open_timeout_ms == 0
        {
            return bad("timeouts and the probe interval must be > 0".into());
        }
        Ok(())
    }

    /// The bearer token: `token`, else the variable named by `token_env`.
    pub fn bearer_token(&self) -> Result<Option<String>, EdgeError> {
        if let Some(t) = &self.token {
            return Ok(Some(t.clone()));
        }
        match &self.token_env {
            Some(var) => std::env::var(var)
                .map(Some)
                .map_err(|_| EdgeError::Config(format!("token_env: variable {var} is not set"))),
            None => Ok(None),
        }
    }

    pub(crate) fn connect_timeout(&self) -> Duration {
        ms(self.connect_timeout_ms)
    }
    pub(crate) fn open_timeout(&self) -> Duration {
        ms(self.open_timeout_ms)
    }
    pub(crate) fn probe_interval(&self) -> Duration {
        ms(self.probe_interval_ms)
    }
    pub(crate) fn probe_timeout(&self) -> Duration {
        ms(self.probe_timeout_ms)
    }

    /// Backoff before the `attempt`-th retry (1-based).
    pub fn backoff(&self, attempt: u32) -> Duration {
        let shift = attempt.saturating_sub(1).min(20);
        ms(self
            .backoff_base_ms
            .saturating_mul(1u64 << shift)
            .min(self.backoff_max_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_toml_is_the_default_and_local() {
        let c = EdgeConfig::from_toml("").unwrap();
        assert_eq!(c, EdgeConfig::default());
        assert!(c.verifier_url.is_none());
    }

    #[test]
    fn toml_fields_load_and_are_checked() {
        let c = EdgeConfig::from_toml(
            "verifier_url = \"https://v.example:7443\"\nca_cert_pem = \"/etc/ca.pem\"\nk = 8\nbreaker_failures = 5\n",
        )
        .unwrap();
        assert_eq!(c.k, 8);
        assert_eq!(c.breaker_failures, 5);
        let e = EdgeConfig::from_toml("verifier_url = \"https://v:1\"\n").unwrap_err();
        assert!(e.to_string().contains("ca_cert_pem"), "{e}");
        let e = EdgeConfig::from_toml("k = 17\n").unwrap_err();
        assert!(e.to_string().contains("k must be"), "{e}");
        let e = EdgeConfig::from_toml("nonsense = 1\n").unwrap_err();
        assert!(e.to_string().contains("nonsense"), "{e}");
    }

    #[test]
    fn plain_http_is_refused_off_loopback() {
        for ok in [
            "http://127.0.0.1:7443",
            "http://localhost:7443",
            "http://[::1]:7443",
        ] {
            let c = EdgeConfig::from_toml(&format!("verifier_url = \"{ok}\"\n"));
            assert!(c.is_ok(), "{ok}: {c:?}");
        }
        for bad in [
            "http://10.0.0.5:7443",
            "http://verifier.example:7443",
            "http://127.0.0.1@evil.example:7443",
            "http://0.0.0.0:7443",
        ] {
            let e = EdgeConfig::from_toml(&format!("verifier_url = \"{bad}\"\n")).unwrap_err();
            let m = e.to_string();
            assert!(
                m.contains("verifier_url")
                    && m.contains("not a loopback")
                    && m.contains("https://"),
                "{bad}: {m}"
            );
        }
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let c = EdgeConfig {
            backoff_base_ms: 10,
            backoff_max_ms: 70,
            ..EdgeConfig::default()
        };
        let v: Vec<u64> = (1..=5).map(|i| c.backoff(i).as_millis() as u64).collect();
        assert_eq!(v, vec![10, 20, 40, 70, 70]);
    }
}
