//! The measurements themselves. Each runs in its own child process (the parent
//! re-executes `tandem bench --worker ...`), so that peak RSS belongs to one
//! model under one engine.

use super::report::{median, Measured, SpecPrompt, SpecReport, Throughput, VerifyPoint};
use anyhow::{Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::{
    quantized_gemma3, quantized_llama, quantized_qwen2, quantized_qwen3,
};
use serde::Deserialize;
use std::path::Path;
use std::time::Instant;
use tandem_cli_common::compare::first_difference;
use tandem_model::kv_cache::KvPrecision;
use tandem_model::proposer::{ProposerKind, ProposerStats};
use tandem_model::sampling::{argmax, SamplingParams};
use tandem_model::speculative::{generate_single, generate_speculative, GenerateConfig};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::{LoadOptions, Model};

/// What a micro-benchmark worker does.
#[derive(Clone, Debug)]
pub struct MicroPlan {
    /// The ~128-token prompt (prefill) whose end is the verify context.
    pub prompt: Vec<u32>,
    pub decode_tokens: usize,
    pub ks: Vec<usize>,
    /// Timed repeats (one untimed warm-up runs first).
    pub repeats: usize,
    pub threads: usize,
}

impl MicroPlan {
    fn capacity(&self) -> usize {
        let k_max = self.ks.iter().copied().max().unwrap_or(1);
        self.prompt.len() + self.decode_tokens.max(k_max) + 8
    }

    /// Tokens fed to the verify forwards (their content does not change the cost).
    fn verify_tokens(&self) -> Vec<u32> {
        let k_max = self.ks.iter().copied().max().unwrap_or(1);
        self.prompt.iter().copied().cycle().take(k_max).collect()
    }
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// A line of /proc/self/status in bytes (Linux); 0 elsewhere.
fn status_bytes(key: &str) -> u64 {
    tandem_cli_common::models::proc_status_bytes("self", key).unwrap_or(0)
}

pub fn rss_now() -> u64 {
    status_bytes("VmRSS:")
}

pub fn peak_rss() -> u64 {
    status_bytes("VmHWM:")
}

/// Assemble the figures from raw timings.
/// Median time per k and its ratio to k = 1 (the first entry).
fn verify_points(ks: &[usize], ms: &[Vec<f64>]) -> Vec<VerifyPoint> {
    let one = ms.first().map_or(f64::NAN, |xs| median(xs));
    ks.iter()
        .zip(ms)
        .map(|(&k, xs)| {
            let ms = median(xs);
            VerifyPoint {
                k,
                ms,
                cost_ratio: ms / one,
            }
        })
        .collect()
}

fn figures(
    plan: &MicroPlan,
    version: String,
    load_ms: f64,
    rss_after_load_bytes: u64,
    prefill_ms: &[f64],
    decode_ms: &[f64],
    verify_ms: &[Vec<f64>],
) -> Measured {
    let p = median(prefill_ms);
    let rates: Vec<f64> = decode_ms
        .iter()
        .map(|ms| plan.decode_tokens as f64 / (ms / 1000.0))
        .collect();
    let verify = verify_points(&plan.ks, verify_ms);
    Measured {
        version,
        threads: plan.threads,
        load_ms,
        prefill_tokens: plan.prompt.len(),
        prefill_tok_s: plan.prompt.len() as f64 / (p / 1000.0),
        decode_tokens: plan.decode_tokens,
        decode_tok_s: median(&rates),
        verify_context: plan.prompt.len(),
        verify,
        verify_last_only: Vec::new(),
        rss_after_load_bytes,
        peak_rss_bytes: peak_rss(),
    }
}

/// Tandem's own model core. Verify forwards return logits for every position,
/// as the verifier needs them.
pub fn micro_tandem(path: &Path, plan: &MicroPlan) -> Result<Measured> {
    anyhow::ensure!(
        plan.ks.first() == Some(&1),
        "the verify curve starts at k = 1"
    );
    let t = Instant::now();
    let model = Model::load(path, LoadOptions::with_max_seq_len(plan.capacity()))
        .with_context(|| format!("loading {}", path.display()))?;
    let load_ms = ms_since(t);
    let rss_load = rss_now();
    let n = plan.prompt.len();
    let mut cache = model.new_cache();
    let (mut prefill_ms, mut decode_ms) = (Vec::new(), Vec::new());
    for r in 0..=plan.repeats {
        cache.truncate(0);
        let t = Instant::now();
        let logits = model.forward_last(&plan.prompt, 0, &mut cache)?;
        let p = ms_since(t);
        let mut tok = argmax(&logits);
        let t = Instant::now();
        for _ in 0..plan.decode_tokens {
            let pos = cache.len();
            tok = argmax(&model.forward(&[tok], pos, &mut cache)?);
        }
        let d = ms_since(t);
        if r > 0 {
            prefill_ms.push(p);
            decode_ms.push(d);
        }
    }
    let vt = plan.verify_tokens();
    let mut verify_ms = vec![Vec::new(); plan.ks.len()];
    let mut last_ms = vec![Vec::new(); plan.ks.len()];
    let vocab = model.config().vocab;
    for r in 0..=plan.repeats {
        for (i, &k) in plan.ks.iter().enumerate() {
            // All positions' logits (what verification needs), then the
            // last position's only (candle's work), alternating.
            for (all, out) in [(true, &mut verify_ms[i]), (false, &mut last_ms[i])] {
                cache.truncate(n);
                let t = Instant::now();
                let logits = if all {
                    model.forward(&vt[..k], n, &mut cache)?
                } else {
                    model.forward_last(&vt[..k], n, &mut cache)?
                };
                let ms = ms_since(t);
                let want = if all { k * vocab } else { vocab };
                anyhow::ensure!(logits.len() == want, "short logits");
                if r > 0 {
                    out.push(ms);
                }
            }
        }
    }
    let version = format!(
        "tandem {} ({})",
        env!("CARGO_PKG_VERSION"),
        tandem_model::quant::Isa::selected().name()
    );
    let mut m = figures(
        plan,
        version,
        load_ms,
        rss_load,
        &prefill_ms,
        &decode_ms,
        &verify_ms,
    );
    m.verify_last_only = verify_points(&plan.ks, &last_ms);
    Ok(m)
}

/// candle-transformers' quantized model of the GGUF's architecture (each
/// returns the last position's logits).
enum Candle {
    Qwen2(quantized_qwen2::ModelWeights),
    Qwen3(quantized_qwen3::ModelWeights),
    Llama(quantized_llama::ModelWeights),
    Gemma3(quantized_gemma3::ModelWeights),
}

impl Candle {
    /// Loads `path` with the module its `general.architecture` names; returns
    /// the model and the module's name.
    fn load(path: &Path) -> Result<(Self, &'static str)> {
        let mut f =
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let ct = gguf_file::Content::read(&mut f).context("reading GGUF metadata")?;
        let arch = ct
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        let dev = &Device::Cpu;
        let loaded = match arch.as_str() {
            "qwen2" => (
                Self::Qwen2(quantized_qwen2::ModelWeights::from_gguf(ct, &mut f, dev)?),
                "quantized_qwen2",
            ),
            "qwen3" => (
                Self::Qwen3(quantized_qwen3::ModelWeights::from_gguf(ct, &mut f, dev)?),
                "quantized_qwen3",
            ),
            "llama" => (
                Self::Llama(quantized_llama::ModelWeights::from_gguf(ct, &mut f, dev)?),
                "quantized_llama",
            ),
            "gemma3" => (
                Self::Gemma3(quantized_gemma3::ModelWeights::from_gguf(ct, &mut f, dev)?),
                "quantized_gemma3",
            ),
            other => anyhow::bail!(
                "candle-transformers has no quantized model for architecture {other:?} here \
                 (qwen2, qwen3, llama, gemma3)"
            ),
        };
        Ok(loaded)
    }

    /// Whether a forward of several tokens after a cached prefix works (a
    /// verify block). candle-transformers 0.11.1's quantized_gemma3 fails
    /// there ("dtype mismatch in cat, lhs: F32, rhs: U32": its mask joins an
    /// f32 prefix to a u32 causal part), so its curve has k = 1 only.
    fn verifies_blocks(&self) -> bool {
        !matches!(self, Self::Gemma3(_))
    }

    /// Forgets the context. (quantized_gemma3 has no such call: its forward
    /// at position 0 starts a new cache, which every prefill here is.)
    fn clear(&mut self) {
        match self {
            Self::Qwen2(w) => w.clear_kv_cache(),
            Self::Qwen3(w) => w.clear_kv_cache(),
            Self::Llama(w) => w.clear_kv_cache(),
            Self::Gemma3(_) => {}
        }
    }

    /// Logits of the last position of `toks` placed at `pos`.
    fn step(&mut self, toks: &[u32], pos: usize) -> Result<Vec<f32>> {
        let x = Tensor::new(toks, &Device::Cpu)?.unsqueeze(0)?;
        let l = match self {
            Self::Qwen2(w) => w.forward(&x, pos)?,
            Self::Qwen3(w) => w.forward(&x, pos)?,
            Self::Llama(w) => w.forward(&x, pos)?,
            Self::Gemma3(w) => w.forward(&x, pos)?,
        };
        Ok(l.squeeze(0)?.to_vec1::<f32>()?)
    }
}

/// candle-transformers' quantized model of the file's architecture
/// (`quantized_qwen2`, `_qwen3`, `_llama`, `_gemma3`). Its forward returns the
/// last position's logits only, and its KV cache cannot be truncated, so a context
/// is rebuilt by a clear and a prefill. A prefill is so slow on this engine
/// (minutes under load) that each repeat prefills once: the timed prefill, then
/// the verify forwards k = 1, 2, 3, ... one after the other (contexts 128 up to
/// 128 + 1 + 2 + 3 + 5 + 9 = 148: "about 128", attention being a few percent of
/// a forward at these lengths), then the greedy decode.
pub fn micro_candle(path: &Path, plan: &MicroPlan) -> Result<Measured> {
    anyhow::ensure!(
        plan.ks.first() == Some(&1),
        "the verify curve starts at k = 1"
    );
    let t = Instant::now();
    let (mut m, module) = Candle::load(path).context("loading with candle")?;
    let load_ms = ms_since(t);
    let rss_load = rss_now();
    let vt = plan.verify_tokens();
    let ks = if m.verifies_blocks() {
        plan.ks.clone()
    } else {
        vec![1]
    };
    let (mut prefill_ms, mut decode_ms) = (Vec::new(), Vec::new());
    let mut verify_ms = vec![Vec::new(); ks.len()];
    for r in 0..=plan.repeats {
        m.clear();
        let t = Instant::now();
        m.step(&plan.prompt, 0)?;
        let p = ms_since(t);
        let mut pos = plan.prompt.len();
        let mut logits = Vec::new();
        for (i, &k) in ks.iter().enumerate() {
            let t = Instant::now();
            logits = m.step(&vt[..k], pos)?;
            let ms = ms_since(t);
            pos += k;
            if r > 0 {
                verify_ms[i].push(ms);
            }
        }
        let mut tok = argmax(&logits);
        let t = Instant::now();
        for i in 0..plan.decode_tokens {
            tok = argmax(&m.step(&[tok], pos + i)?);
        }
        let d = ms_since(t);
        if r > 0 {
            prefill_ms.push(p);
            decode_ms.push(d);
        }
    }
    let version = if m.verifies_blocks() {
        format!("candle-transformers 0.11 {module}")
    } else {
        format!("candle-transformers 0.11 {module} (verify k = 1 only: its block forward fails)")
    };
    let plan = MicroPlan { ks, ..plan.clone() };
    Ok(figures(
        &plan,
        version,
        load_ms,
        rss_load,
        &prefill_ms,
        &decode_ms,
        &verify_ms,
    ))
}

/// One line of the prompt set (prompts/default.jsonl).
#[derive(Clone, Debug, Deserialize)]
pub struct PromptCase {
    pub id: String,
    #[serde(default)]
    pub kind: String,
    pub prompt: String,
    pub max_tokens: usize,
    /// Fill in the middle: `prompt` is the prefix, this the suffix, and the
    /// case is encoded in the model's FIM format (no chat template).
    #[serde(default)]
    pub suffix: Option<String>,
}

impl PromptCase {
    /// The case's prompt tokens: the chat template over one user message,
    /// or the FIM prompt when the case has a suffix.
    pub fn encode(&self, tok: &Tokenizer) -> tandem_model::Result<Vec<u32>> {
        match &self.suffix {
            Some(s) => tok.encode_fim(&self.prompt, s),
            None => tok.encode_chat(&[ChatMessage::user(self.prompt.as_str())], true),
        }
    }
}

pub fn parse_prompts(text: &str) -> Result<Vec<PromptCase>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).with_context(|| format!("prompt set line {}", i + 1)))
        .collect()
}

/// What the speculative worker does.
#[derive(Clone, Debug)]
pub struct SpecPlan {
    /// The prompt set's name (`--prompts`), carried into each report.
    pub prompt_set: String,
    pub prompts: Vec<PromptCase>,
    pub k: usize,
    /// One speculative run per proposer and draft KV precision, after each
    /// prompt's target-only run.
    pub proposers: Vec<ProposerKind>,
    pub draft_kvs: Vec<KvPrecision>,
    /// Cap on each prompt's max_tokens (`--quick`).
    pub max_tokens_cap: Option<usize>,
    pub threads: usize,
}

/// Greedy target-only, then speculative decoding with each proposer at each
/// draft KV precision, on each prompt in turn, so that drifting machine load
/// hits every mode alike. One report per (proposer, precision), proposer
/// major.
pub fn speculative(
    draft_path: &Path,
    target_path: &Path,
    plan: &SpecPlan,
) -> Result<Vec<SpecReport>> {
    let opts = || LoadOptions::with_max_seq_len(2048);
    let draft = Model::load(draft_path, opts())
        .with_context(|| format!("loading {}", draft_path.display()))?;
    let target = Model::load(target_path, opts())
        .with_context(|| format!("loading {}", target_path.display()))?;
    let tok = Tokenizer::from_gguf(target.gguf()).context("building the tokenizer")?;
    let stop_tokens = tok.chat_stop_tokens();
    let cfg_for =
        |max_tokens: usize, proposer: ProposerKind, draft_kv: KvPrecision| GenerateConfig {
            max_tokens: plan
                .max_tokens_cap
                .map_or(max_tokens, |c| max_tokens.min(c)),
            k: plan.k,
            sampling: SamplingParams::greedy(),
            stop_tokens: stop_tokens.clone(),
            proposer,
            draft_kv,
            top_logprobs: None,
            grammar: None,
        };
    let runs: Vec<(ProposerKind, KvPrecision)> = plan
        .proposers
        .iter()
        .flat_map(|&p| plan.draft_kvs.iter().map(move |&kv| (p, kv)))
        .collect();
    let encoded: Vec<Vec<u32>> = plan
        .prompts
        .iter()
        .map(|p| p.encode(&tok))
        .collect::<std::result::Result<_, _>>()
        .context("tokenizing the prompt set")?;
    // Warm-up: touch both models' weights once.
    if let Some(ids) = encoded.first() {
        let cfg = cfg_for(4, ProposerKind::Draft, KvPrecision::F32);
        generate_single(&target, ids, &cfg, &mut |_| true)?;
        generate_speculative(&draft, &target, ids, &cfg, &mut |_| true)?;
    }
    let mut per_run: Vec<Vec<SpecPrompt>> = vec![Vec::new(); runs.len()];
    for (case, ids) in plan.prompts.iter().zip(&encoded) {
        let base = cfg_for(case.max_tokens, ProposerKind::Draft, KvPrecision::F32);
        let a = generate_single(&target, ids, &base, &mut |_| true)
            .with_context(|| format!("target-only generation on prompt {}", case.id))?;
        for (&(proposer, kv), out) in runs.iter().zip(&mut per_run) {
            let cfg = cfg_for(case.max_tokens, proposer, kv);
            let b = generate_speculative(&draft, &target, ids, &cfg, &mut |_| true).with_context(
                || {
                    format!(
                        "speculative generation ({proposer}, {kv} draft KV) on prompt {}",
                        case.id
                    )
                },
            )?;
            let diff = first_difference(&a.tokens, &b.tokens);
            out.push(SpecPrompt {
                id: case.id.clone(),
                kind: case.kind.clone(),
                prompt_tokens: ids.len(),
                max_tokens: cfg.max_tokens,
                target_tokens: a.tokens.len(),
                target_ms: a.stats.total_ms,
                speculative_tokens: b.tokens.len(),
                speculative_ms: b.stats.total_ms,
                rounds: b.stats.rounds,
                drafted: b.stats.drafted,
                accepted: b.stats.accepted,
                by_proposer: b.stats.proposers,
                identical: diff.is_none(),
                first_difference: diff,
            });
        }
    }
    let draft_cfg = draft.config();
    Ok(runs
        .iter()
        .zip(per_run)
        .map(|(&(p, kv), prompts)| {
            let kv_bytes = draft_cfg.kv_bytes_per_token_with(kv);
            summarize(plan, p, (kv, kv_bytes), prompts)
        })
        .collect())
}

fn throughput(tokens: usize, ms: f64) -> Throughput {
    let seconds = ms / 1000.0;
    Throughput {
        tokens,
        seconds,
        tok_s: if seconds > 0.0 {
            tokens as f64 / seconds
        } else {
            0.0
        },
    }
}

/// One report from a run's prompts; `draft_kv` is its draft KV precision and
/// that precision's bytes per token.
fn summarize(
    plan: &SpecPlan,
    proposer: ProposerKind,
    draft_kv: (KvPrecision, usize),
    per_prompt: Vec<SpecPrompt>,
) -> SpecReport {
    let sum_t: usize = per_prompt.iter().map(|p| p.target_tokens).sum();
    let sum_s: usize = per_prompt.iter().map(|p| p.speculative_tokens).sum();
    let ms_t: f64 = per_prompt.iter().map(|p| p.target_ms).sum();
    let ms_s: f64 = per_prompt.iter().map(|p| p.speculative_ms).sum();
    let rounds: u64 = per_prompt.iter().map(|p| p.rounds).sum();
    let drafted: u64 = per_prompt.iter().map(|p| p.drafted).sum();
    let accepted: u64 = per_prompt.iter().map(|p| p.accepted).sum();
    let mut by_proposer = ProposerStats::default();
    for p in &per_prompt {
        by_proposer.add(&p.by_proposer);
    }
    let target_only = throughput(sum_t, ms_t);
    let speculative = throughput(sum_s, ms_s);
    let mismatches: Vec<String> = per_prompt
        .iter()
        .filter(|p| !p.identical)
        .map(|p| p.id.clone())
        .collect();
    SpecReport {
        prompt_set: plan.prompt_set.clone(),
        isa: tandem_model::quant::Isa::selected().name().into(),
        proposer,
        draft_kv: draft_kv.0,
        draft_kv_bytes_per_token: draft_kv.1,
        k: plan.k,
        threads: plan.threads,
        prompts: per_prompt.len(),
        speedup: speculative.tok_s / target_only.tok_s,
        target_only,
        speculative,
        rounds,
        drafted,
        accepted,
        acceptance_rate: if drafted > 0 {
            accepted as f64 / drafted as f64
        } else {
            0.0
        },
        mean_accepted_len: if rounds > 0 {
            accepted as f64 / rounds as f64
        } else {
            0.0
        },
        by_proposer,
        identical: mismatches.is_empty(),
        mismatches,
        per_prompt,
        peak_rss_bytes: peak_rss(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_set_parses_and_reports_bad_lines() {
        let ok =
            parse_prompts("{\"id\":\"a\",\"kind\":\"x\",\"prompt\":\"hi\",\"max_tokens\":8}\n\n")
                .unwrap();
        assert_eq!(ok.len(), 1);
        assert_eq!(ok[0].max_tokens, 8);
        let err = parse_prompts("{\"id\":\"a\"}\n").unwrap_err();
        assert!(format!("{err:#}").contains("line 1"), "{err:#}");
    }

    #[test]
    fn the_shipped_prompt_set_parses() {
        let p = parse_prompts(super::super::DEFAULT_PROMPTS).unwrap();
        assert!(
            p.len() >= 10,
            "the bench needs at least 10 prompts, has {}",
            p.len()
        );
        // The editing set (issue 21): at least 40 prompts, English and Chinese,
        // each carrying the code or text to change.
        let edit = parse_prompts(include_str!("../../prompts/editing.jsonl")).unwrap();
        assert!(edit.len() >= 40, "{}", edit.len());
        for kind in ["edit-en", "edit-zh"] {
            assert!(edit.iter().any(|c| c.kind == kind), "no {kind} prompt");
        }
        assert!(edit
            .iter()
            .all(|c| c.prompt.len() > 400 && c.max_tokens > 0));
        let mut ids: Vec<&str> = edit.iter().map(|c| c.id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), edit.len(), "prompt ids are unique");
    }

    fn prompt(id: &str, tt: usize, tms: f64, st: usize, sms: f64, identical: bool) -> SpecPrompt {
        SpecPrompt {
            id: id.into(),
            kind: String::new(),
            prompt_tokens: 10,
            max_tokens: 64,
            target_tokens: tt,
            target_ms: tms,
            speculative_tokens: st,
            speculative_ms: sms,
            rounds: 4,
            drafted: 16,
            accepted: 8,
            by_proposer: ProposerStats {
                lookup: tandem_model::proposer::ProposerStat {
                    rounds: 3,
                    drafted: 12,
                    accepted: 6,
                },
                none_rounds: 1,
                ..ProposerStats::default()
            },
            identical,
            first_difference: if identical { None } else { Some(0) },
        }
    }

    #[test]
    fn summary_pools_tokens_and_time_and_lists_mismatches() {
        let plan = SpecPlan {
            prompt_set: "editing".into(),
            prompts: Vec::new(),
            k: 4,
            proposers: vec![ProposerKind::Lookup],
            draft_kvs: vec![KvPrecision::Int8],
            max_tokens_cap: None,
            threads: 2,
        };
        let r = summarize(
            &plan,
            ProposerKind::Lookup,
            (KvPrecision::Int8, 6528),
            vec![
                prompt("a", 10, 1000.0, 10, 500.0, true),
                prompt("b", 30, 1000.0, 30, 1500.0, false),
            ],
        );
        assert_eq!(r.target_only.tokens, 40);
        assert_eq!(r.target_only.tok_s, 20.0);
        assert_eq!(r.speculative.tok_s, 20.0);
        assert_eq!(r.prompt_set, "editing");
        assert_eq!(r.speedup, 1.0);
        assert_eq!(r.acceptance_rate, 0.5);
        assert_eq!(r.mean_accepted_len, 2.0);
        assert!(!r.identical);
        assert_eq!(r.mismatches, vec!["b".to_string()]);
        assert_eq!(r.proposer, ProposerKind::Lookup);
        assert_eq!(
            (r.draft_kv, r.draft_kv_bytes_per_token),
            (KvPrecision::Int8, 6528)
        );
        assert_eq!(r.by_proposer.lookup.rounds, 6);
        assert_eq!(r.by_proposer.lookup.accepted, 12);
        assert_eq!(r.by_proposer.none_rounds, 2);
    }
}
