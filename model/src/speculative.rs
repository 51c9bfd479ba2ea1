//! Generation loops in one process: draft-only, target-only, and speculative
//! decoding with a proposer ([`crate::proposer`]: the draft model, prompt
//! lookup, or a per-round choice) offering blocks of up to `k` tokens and the
//! target verifying each block in one forward pass. The speculative rounds
//! are the generation core's ([`crate::engine`]); the settings, statistics
//! and result types live there too and are re-exported here.
//!
//! The speculative output is token for token the target's own output with the
//! same sampling parameters: in greedy mode its greedy output, in sampled mode
//! its output with the same seed. The verifier compares against the target's
//! token at each position ([`crate::sampling::next_token`]), and the target's
//! logits for a position do not depend on the block they were computed in (see
//! [`crate::qwen2`]).

use crate::engine::{check_prompt, choose, DraftModel, Emitter, SpecEngine, TargetVerifier};
use crate::kv_cache::KvPrecision;
use crate::transformer::Model;
use crate::{ModelError, Result};
use serde::{Deserialize, Serialize};
use std::time::Instant;

pub use crate::engine::{GenStats, GenerateConfig, Generation, OnToken, PositionStat, StopReason};
pub use crate::verify::MAX_K;

/// Which model(s) generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Draft,
    Target,
    Speculative,
}

/// Plain autoregressive generation with one model (f32 KV cache).
pub fn generate_single(
    model: &Model,
    prompt: &[u32],
    cfg: &GenerateConfig,
    on_token: &mut OnToken<'_>,
) -> Result<Generation> {
    generate_single_with(model, KvPrecision::F32, prompt, cfg, on_token)
}

/// [`generate_single`] with the model's KV cache at `kv` (draft-only
/// generation with [`GenerateConfig::draft_kv`]). Under a grammar
/// ([`GenerateConfig::grammar`]) each token is the model's choice among the
/// tokens it allows: target-only, the reference output of structured output.
pub fn generate_single_with(
    model: &Model,
    kv: KvPrecision,
    prompt: &[u32],
    cfg: &GenerateConfig,
    on_token: &mut OnToken<'_>,
) -> Result<Generation> {
    cfg.validate()?;
    let cfg = &cfg.for_prompt(prompt.len());
    let mut cache = model.new_cache_with(kv);
    check_prompt(prompt, cache.capacity())?;
    let start = Instant::now();
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..GenStats::default()
    };
    let mut ctx = prompt.to_vec();
    let mut em = Emitter::new(prompt.len(), cfg.max_tokens, cache.capacity());
    let mut guide = DraftModel::guide_for(cfg, prompt.len())?;
    let mut logits = model.forward_last(prompt, 0, &mut cache)?;
    stats.target_forwards += 1;
    while em.stop.is_none() {
        let t = choose(&cfg.sampling, &mut logits, &ctx, guide.as_deref_mut())?;
        if !em.emit(&cfg.stop_tokens, &mut ctx, t, |_| on_token(t)) {
            break;
        }
        let pos = cache.len();
        logits = model.forward(&[t], pos, &mut cache)?;
        stats.target_forwards += 1;
    }
    let tokens = ctx[prompt.len()..].to_vec();
    stats.generated_tokens = tokens.len();
    stats.finish(start, em.first);
    Ok(Generation {
        tokens,
        stop: em.stop.unwrap_or(StopReason::MaxTokens),
        stats,
    })
}

/// Speculative decoding with a draft and a target model in this process:
/// the core's rounds ([`SpecEngine::round`]) against the local target
/// ([`TargetVerifier`]); `cfg.proposer` chooses what proposes each block
/// (with [`ProposerKind::Lookup`](crate::proposer::ProposerKind::Lookup) the
/// draft model is never run).
pub fn generate_speculative(
    draft: &Model,
    target: &Model,
    prompt: &[u32],
    cfg: &GenerateConfig,
    on_token: &mut OnToken<'_>,
) -> Result<Generation> {
    cfg.validate()?;
    let cfg = &cfg.for_prompt(prompt.len());
    crate::pair::check_vocab(draft.config(), target.config()).map_err(|e| {
        ModelError::InvalidArgument(format!("the draft cannot pair with the target: {e}"))
    })?;
    let mut target = TargetVerifier::new(target, cfg.sampling)
        .with_guide(DraftModel::guide_for(cfg, prompt.len())?);
    let mut engine = SpecEngine::new(draft, prompt, cfg, target.capacity(), on_token)?;
    // The target's first token comes from its prefill.
    let logits = target.prefill(prompt)?;
    engine.stats_mut().target_forwards += 1;
    let first = target.choose(prompt, logits)?;
    engine.emit_verified(first);
    while engine.stop().is_none() {
        engine.round(cfg.k, &mut target)?;
    }
    Ok(engine.finish())
}
