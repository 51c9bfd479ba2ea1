//! [`CapiConfig`]: the TOML file `tandem_runtime_new` reads (documented field
//! by field in `docs/capi.md`). Relative paths in it (the draft model, the
//! policy, TLS files) are relative to the config file's directory, so an app
//! can ship the config next to its assets.

use serde::Deserialize;
use std::path::{Path, PathBuf};
use tandem_edge::EdgeConfig;
use tandem_model::sampling::SamplingParams;

/// A config that cannot be used; the message names the file and the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading the config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// Sampling of every generation (`[sampling]`); temperature 0 = greedy, the
/// mode in which verified output is exactly the target model's.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingConfig {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        let p = SamplingParams::default();
        Self {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            repetition_penalty: p.repetition_penalty,
            seed: p.seed,
        }
    }
}

impl SamplingConfig {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
        }
    }
}

/// The C ABI's runtime config.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CapiConfig {
    /// Draft model GGUF; default: the fetched draft (`tandem models path draft`).
    pub draft_model: Option<PathBuf>,
    /// KV cache capacity of the draft, in tokens.
    pub max_seq_len: usize,
    /// Default `max_tokens` of a generation (when the call passes 0).
    pub max_tokens: usize,
    /// Optional system message before every prompt.
    pub system_prompt: Option<String>,
    /// Ask the privacy router before anything is sent (only matters with a
    /// verifier). Default true.
    pub privacy_router: bool,
    /// Privacy policy TOML (`docs/privacy.md`); default: the built-in policy.
    pub policy: Option<PathBuf>,
    pub sampling: SamplingConfig,
    /// The edge runtime (`[edge]`, every `EdgeConfig` field of `docs/edge.md`:
    /// `verifier_url`, `ca_cert_pem`, `token`, `k`, deadlines, breaker ...).
    /// No `verifier_url`: every generation is local.
    pub edge: EdgeConfig,
}

impl Default for CapiConfig {
    fn default() -> Self {
        Self {
            draft_model: None,
            max_seq_len: 2048,
            max_tokens: 256,
            system_prompt: None,
            privacy_router: true,
            policy: None,
            sampling: SamplingConfig::default(),
            edge: EdgeConfig::default(),
        }
    }
}

fn rebase(base: &Path, p: &mut Option<PathBuf>) {
    if let Some(q) = p {
        if q.is_relative() {
            *q = base.join(&*q);
        }
    }
}

impl CapiConfig {
    /// Reads, parses and validates the file; relative paths are made relative
    /// to its directory.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::from_toml(&text, base).map_err(|message| ConfigError::Invalid {
            path: path.to_path_buf(),
            message,
        })
    }

    /// Parses and validates TOML text; relative paths are joined to `base`.
    pub fn from_toml(text: &str, base: &Path) -> Result<Self, String> {
        let mut c: Self = toml::from_str(text).map_err(|e| e.to_string())?;
        rebase(base, &mut c.draft_model);
        rebase(base, &mut c.policy);
        rebase(base, &mut c.edge.ca_cert_pem);
        rebase(base, &mut c.edge.client_cert_pem);
        rebase(base, &mut c.edge.client_key_pem);
        c.validate()?;
        Ok(c)
    }

    /// Ranges and combinations; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_seq_len < 16 {
            return Err(format!(
                "max_seq_len must be >= 16, got {}",
                self.max_seq_len
            ));
        }
        if self.max_tokens == 0 {
            return Err("max_tokens must be >= 1".into());
        }
        self.sampling
            .params()
            .validate()
            .map_err(|e| format!("[sampling]: {e}"))?;
        self.edge.validate().map_err(|e| format!("[edge]: {e}"))
    }

    /// The draft GGUF to load.
    pub fn draft_model_path(&self) -> PathBuf {
        self.draft_model
            .clone()
            .unwrap_or_else(|| tandem_fetch::model_path(tandem_fetch::ModelRole::Draft))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn empty_is_local_with_defaults_and_paths_are_rebased() {
        let c = CapiConfig::from_toml("", Path::new("/app")).unwrap();
        assert!(c.edge.verifier_url.is_none());
        assert_eq!(c.max_tokens, 256);
        let c = CapiConfig::from_toml(
            "draft_model = \"m/d.gguf\"\npolicy = \"/abs/p.toml\"\n[edge]\nverifier_url = \"https://v:1\"\nca_cert_pem = \"ca.pem\"\n",
            Path::new("/app"),
        )
        .unwrap();
        assert_eq!(c.draft_model.unwrap(), Path::new("/app/m/d.gguf"));
        assert_eq!(c.policy.unwrap(), Path::new("/abs/p.toml"));
        assert_eq!(c.edge.ca_cert_pem.unwrap(), Path::new("/app/ca.pem"));
    }

    #[test]
    fn bad_fields_are_named() {
        let e = CapiConfig::from_toml("max_tokenz = 3\n", Path::new(".")).unwrap_err();
        assert!(e.contains("max_tokenz"), "{e}");
        let e = CapiConfig::from_toml("[edge]\nk = 0\n", Path::new(".")).unwrap_err();
        assert!(e.contains("[edge]") && e.contains("k must be"), "{e}");
        let e =
            CapiConfig::from_toml("[sampling]\ntemperature = -1\n", Path::new(".")).unwrap_err();
        assert!(e.contains("[sampling]"), "{e}");
    }
}
