//! [`CapiConfig`]: the TOML file `tandem_runtime_new` reads (documented field
//! by field in `docs/capi.md`). Relative model paths (`draft_model`,
//! `target_model`) are relative to the models directory the caller passes
//! (the app's download directory), else to the config file's directory; the
//! other relative paths (the policy, TLS files) are relative to the config
//! file's directory, so an app can ship the config next to its assets.

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
            ..SamplingParams::default()
        }
    }
}

/// The C ABI's runtime config.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CapiConfig {
    /// Draft model GGUF (required).
    pub draft_model: Option<PathBuf>,
    /// Target model GGUF for split execution: required with `[edge.split]`
    /// (the device runs the target's first layers), refused without it.
    pub target_model: Option<PathBuf>,
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
            target_model: None,
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

/// A model entry is a path relative to `models_dir` (or absolute), or, when
/// it is a bare name (one component, not ending in `.gguf`) that is not a
/// file there, a model name looked up in `models_dir` only
/// ([`tandem_fetch::resolve_in_dir`]: `smollm2`, `draft`, or the stem of a
/// GGUF the app put there). Nothing is fetched.
fn resolve_model(models_dir: &Path, field: &str, p: &mut Option<PathBuf>) -> Result<(), String> {
    let Some(given) = p else { return Ok(()) };
    let joined = models_dir.join(&*given);
    let bare_name = given.components().count() == 1
        && !given
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if joined.is_file() || !bare_name {
        *given = joined;
        return Ok(());
    }
    let Some(name) = given.to_str() else {
        *given = joined;
        return Ok(());
    };
    *given = tandem_fetch::resolve_in_dir(name, models_dir).map_err(|e| format!("{field}: {e}"))?;
    Ok(())
}

impl CapiConfig {
    /// Reads, parses and validates the file; relative model paths are made
    /// relative to `models_dir` (`None`: the file's directory), the others to
    /// the file's directory.
    pub fn from_file(path: &Path, models_dir: Option<&Path>) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::from_toml(&text, base, models_dir.unwrap_or(base)).map_err(|message| {
            ConfigError::Invalid {
                path: path.to_path_buf(),
                message,
            }
        })
    }

    /// Parses and validates TOML text; relative model paths are joined to
    /// `models_dir`, the other relative paths to `base`.
    pub fn from_toml(text: &str, base: &Path, models_dir: &Path) -> Result<Self, String> {
        let mut c: Self = toml::from_str(text).map_err(|e| e.to_string())?;
        resolve_model(models_dir, "draft_model", &mut c.draft_model)?;
        resolve_model(models_dir, "target_model", &mut c.target_model)?;
        rebase(base, &mut c.policy);
        rebase(base, &mut c.edge.ca_cert_pem);
        rebase(base, &mut c.edge.client_cert_pem);
        rebase(base, &mut c.edge.client_key_pem);
        if let Some(split) = &mut c.edge.split {
            rebase(base, &mut split.profile);
            rebase(base, &mut split.server_profile);
        }
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
        self.edge.validate().map_err(|e| format!("[edge]: {e}"))?;
        if self.draft_model.is_none() {
            return Err(
                "draft_model is required: the draft GGUF (a relative path is relative to the models directory given to tandem_runtime_new)"
                    .into(),
            );
        }
        match (&self.edge.split, &self.target_model) {
            (Some(_), None) => Err(
                "[edge.split] needs target_model: the target GGUF whose first layers the device runs"
                    .into(),
            ),
            (None, Some(_)) => Err(
                "target_model is only used for split execution: add [edge.split] or remove it"
                    .into(),
            ),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const DRAFT: &str = "draft_model = \"d.gguf\"\n";

    fn parse(text: &str) -> Result<CapiConfig, String> {
        CapiConfig::from_toml(text, Path::new("/app"), Path::new("/models"))
    }

    #[test]
    fn defaults_are_local_and_paths_are_rebased() {
        let c = parse(DRAFT).unwrap();
        assert!(c.edge.verifier_url.is_none());
        assert_eq!(c.max_tokens, 256);
        assert_eq!(c.draft_model.unwrap(), Path::new("/models/d.gguf"));
        let c = parse(
            "draft_model = \"m/d.gguf\"\ntarget_model = \"/abs/t.gguf\"\npolicy = \"p.toml\"\n\
             [edge]\nverifier_url = \"https://v:1\"\nca_cert_pem = \"ca.pem\"\n[edge.split]\nlayer = 2\n",
        )
        .unwrap();
        assert_eq!(c.draft_model.unwrap(), Path::new("/models/m/d.gguf"));
        assert_eq!(c.target_model.unwrap(), Path::new("/abs/t.gguf"));
        assert_eq!(c.policy.unwrap(), Path::new("/app/p.toml"));
        assert_eq!(c.edge.ca_cert_pem.unwrap(), Path::new("/app/ca.pem"));
    }

    #[test]
    fn bad_fields_are_named() {
        let e = parse("max_tokenz = 3\n").unwrap_err();
        assert!(e.contains("max_tokenz"), "{e}");
        let e = parse(&format!("{DRAFT}[edge]\nk = 0\n")).unwrap_err();
        assert!(e.contains("[edge]") && e.contains("k must be"), "{e}");
        let e = parse(&format!("{DRAFT}[sampling]\ntemperature = -1\n")).unwrap_err();
        assert!(e.contains("[sampling]"), "{e}");
        let e = parse("").unwrap_err();
        assert!(e.contains("draft_model is required"), "{e}");
    }

    #[test]
    fn split_and_target_model_come_together() {
        let e = parse(&format!("{DRAFT}[edge.split]\nlayer = 2\n")).unwrap_err();
        assert!(e.contains("[edge.split] needs target_model"), "{e}");
        let e = parse(&format!("{DRAFT}target_model = \"t.gguf\"\n")).unwrap_err();
        assert!(
            e.contains("target_model") && e.contains("[edge.split]"),
            "{e}"
        );
    }
}
