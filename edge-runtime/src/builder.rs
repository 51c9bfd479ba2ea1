//! [`EdgeRuntime::builder`]: a runtime around models already loaded. A
//! device is assembled from its files by [`crate::assemble`], which loads
//! them and calls this; tests and fixtures that hold loaded models call it
//! directly.
//!
//! ```ignore
//! // The runtime alone (no privacy router):
//! let edge = EdgeRuntime::builder(draft, cfg).build()?;
//! // Split execution, with the privacy router in front:
//! let routed = EdgeRuntime::builder(draft, cfg)
//!     .split_target(target)
//!     .router(router, tokenizer)
//!     .build()?;
//! ```
//!
//! `build` checks the config ([`EdgeConfig::validate`]) and refuses a `[split]`
//! without a split target (and a split target without `[split]`), so split
//! execution is never silently off.

use std::sync::Arc;

use tandem_model::tokenizer::Tokenizer;
use tandem_model::transformer::Model;
use tandem_router::Router;

use crate::config::EdgeConfig;
use crate::error::EdgeError;
use crate::privacy::RoutedRuntime;
use crate::runtime::EdgeRuntime;
use crate::second_opinion::DraftOpinion;

/// What [`EdgeRuntime::builder`] returns; [`Self::build`] makes the runtime.
pub struct EdgeRuntimeBuilder {
    draft: Arc<Model>,
    cfg: EdgeConfig,
    split_target: Option<Arc<Model>>,
}

/// An [`EdgeRuntimeBuilder`] with the privacy router in front;
/// [`Self::build`] makes the [`RoutedRuntime`].
pub struct RoutedRuntimeBuilder {
    edge: EdgeRuntimeBuilder,
    router: Arc<Router>,
    tokenizer: Tokenizer,
}

impl EdgeRuntime {
    /// Starts assembling a runtime around a loaded draft model and its config.
    pub fn builder(draft: Arc<Model>, cfg: EdgeConfig) -> EdgeRuntimeBuilder {
        EdgeRuntimeBuilder {
            draft,
            cfg,
            split_target: None,
        }
    }
}

impl EdgeRuntimeBuilder {
    /// The target model whose first layers the device runs (the config's
    /// `[split]`; required by it).
    pub fn split_target(mut self, target: Arc<Model>) -> Self {
        self.split_target = Some(target);
        self
    }

    /// Runs a short warm-up forward of the draft in `build` (the config's
    /// `warmup`; see [`EdgeRuntime::warmup_ms`]).
    pub fn warmup(mut self, on: bool) -> Self {
        self.cfg.warmup = on;
        self
    }

    /// Puts the privacy router in front of the runtime: `tokenizer` must be
    /// the draft's (the chat template comes from it); `router` may be shared
    /// with an admin API that swaps its policy.
    pub fn router(self, router: Arc<Router>, tokenizer: Tokenizer) -> RoutedRuntimeBuilder {
        RoutedRuntimeBuilder {
            edge: self,
            router,
            tokenizer,
        }
    }

    /// The runtime. Fails on an invalid config, a `[split]` without a split
    /// target (or a split target without `[split]`), or a verifier URL that
    /// cannot be set up.
    pub fn build(self) -> Result<EdgeRuntime, EdgeError> {
        EdgeRuntime::new(self.draft, self.cfg, self.split_target)
    }
}

impl RoutedRuntimeBuilder {
    /// The routed runtime (the errors of [`EdgeRuntimeBuilder::build`]).
    /// The draft is installed as the router's second opinion
    /// ([`crate::DraftOpinion`]; asked only when the policy's
    /// `[second_opinion]` mode is on), unless its tokenizer cannot tell yes
    /// from no.
    pub fn build(self) -> Result<RoutedRuntime, EdgeError> {
        let opinion = DraftOpinion::new(self.edge.draft.clone(), self.tokenizer.clone());
        let mut routed = RoutedRuntime::new(self.edge.build()?, self.router, self.tokenizer);
        match opinion {
            Ok(o) => routed.set_second_opinion(Some(Arc::new(o))),
            Err(e) => {
                tracing::warn!(error = %e, "no second opinion: the router's rules alone decide")
            }
        }
        Ok(routed)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::device_layers::{SplitConfig, SplitLayer};
    use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
    use tandem_model::transformer::LoadOptions;

    fn tiny() -> (tempfile::TempDir, Arc<Model>, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tiny.gguf");
        let cfg = TinyConfig {
            tokenizer: true,
            ..TinyConfig::default()
        };
        write_tiny_qwen2(&p, &cfg).unwrap();
        let m = Model::load(&p, LoadOptions::with_max_seq_len(64)).unwrap();
        let tok = Tokenizer::from_gguf(m.gguf()).unwrap();
        (dir, Arc::new(m), tok)
    }

    fn with_split() -> EdgeConfig {
        EdgeConfig {
            split: Some(SplitConfig {
                layer: SplitLayer::Fixed(1),
                ..SplitConfig::default()
            }),
            ..EdgeConfig::default()
        }
    }

    #[test]
    fn a_split_config_without_a_split_target_is_refused_naming_the_field() {
        let (_d, m, tok) = tiny();
        let err = EdgeRuntime::builder(m.clone(), with_split())
            .build()
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("[split]") && err.contains("split_target"),
            "{err}"
        );
        let routed = EdgeRuntime::builder(m.clone(), with_split())
            .router(Arc::new(Router::with_default_policy()), tok)
            .build();
        assert!(routed.is_err());
        let err = EdgeRuntime::builder(m.clone(), EdgeConfig::default())
            .split_target(m.clone())
            .build()
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("no [split]"), "{err}");
    }

    #[test]
    fn a_split_config_with_its_target_builds_and_reports_the_split() {
        let (_d, m, _tok) = tiny();
        let rt = EdgeRuntime::builder(m.clone(), with_split())
            .split_target(m)
            .build()
            .unwrap();
        assert!(rt.config().split.is_some());
    }
}
