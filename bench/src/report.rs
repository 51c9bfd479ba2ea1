//! The figures `tandem bench` produces: what a worker process prints, what the
//! parent assembles, and the ratios between engines. The JSON schema is
//! documented in docs/cli.md ("tandem bench --json").

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tandem_model::kv_cache::KvPrecision;
use tandem_model::proposer::{ProposerKind, ProposerStats};

/// Version of the `--json` document; bump when a field changes meaning.
pub const SCHEMA_VERSION: u32 = 2;

/// Cost of one forward over `k` tokens at a context of `context` tokens.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VerifyPoint {
    pub k: usize,
    /// Median wall time of the forward, milliseconds.
    pub ms: f64,
    /// `ms / ms(k = 1)`.
    pub cost_ratio: f64,
}

/// What one (model, engine) worker measured. The llama.cpp script prints the
/// same object.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Measured {
    /// Engine build, e.g. the ISA Tandem's kernels dispatched to, or the
    /// llama-cpp-python version.
    pub version: String,
    pub threads: usize,
    pub load_ms: f64,
    pub prefill_tokens: usize,
    /// Prompt tokens / median prefill time.
    pub prefill_tok_s: f64,
    pub decode_tokens: usize,
    /// Median over repeats of (greedy tokens decoded one at a time / time).
    pub decode_tok_s: f64,
    /// Context length at which the verify forwards run.
    pub verify_context: usize,
    pub verify: Vec<VerifyPoint>,
    /// Tandem only: the same forwards with the head over the last position
    /// only — the work candle's forward does (verification needs every
    /// position's logits, so `verify` is the figure that matters for Tandem;
    /// this one makes the kernels comparable with candle's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub verify_last_only: Vec<VerifyPoint>,
    /// Resident memory right after loading, bytes.
    pub rss_after_load_bytes: u64,
    /// Peak resident memory of the worker process (VmHWM), bytes.
    pub peak_rss_bytes: u64,
}

/// Outcome of one engine on one model.
#[derive(Clone, Debug, Serialize)]
pub struct EngineRun {
    /// `tandem`, `candle` or `llama-cpp`.
    pub engine: String,
    /// `ok`, `not installed` or `failed`.
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub figures: Option<Measured>,
    /// `peak_rss_bytes / gguf_bytes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rss_over_gguf: Option<f64>,
}

impl EngineRun {
    pub fn ok(&self) -> Option<&Measured> {
        self.figures.as_ref().filter(|_| self.status == STATUS_OK)
    }
}

pub const STATUS_OK: &str = "ok";
pub const STATUS_NOT_INSTALLED: &str = "not installed";
pub const STATUS_FAILED: &str = "failed";

/// `tandem` figure divided by another engine's figure.
#[derive(Clone, Debug, Serialize)]
pub struct Ratios {
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    pub load_ms: f64,
    pub peak_rss_bytes: f64,
    /// Per k: tandem's cost_ratio / the other engine's cost_ratio.
    pub verify_cost_ratio: Vec<KRatio>,
    /// Per k: tandem's forward time / the other engine's (below 1: Tandem's
    /// block verify, every position's logits, takes less time).
    pub verify_ms_ratio: Vec<KRatio>,
    /// Per k: tandem's last-position-only forward time / the other engine's
    /// forward time (the same work as candle's forward); empty when Tandem
    /// did not measure it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub verify_last_only_ms_ratio: Vec<KRatio>,
}

#[derive(Clone, Debug, Serialize)]
pub struct KRatio {
    pub k: usize,
    pub ratio: f64,
}

impl Ratios {
    pub fn of(ours: &Measured, theirs: &Measured) -> Self {
        let per_k = |a: &[VerifyPoint], f: fn(&VerifyPoint) -> f64| -> Vec<KRatio> {
            a.iter()
                .filter_map(|a| {
                    let b = theirs.verify.iter().find(|b| b.k == a.k)?;
                    Some(KRatio {
                        k: a.k,
                        ratio: f(a) / f(b),
                    })
                })
                .collect()
        };
        Self {
            prefill_tok_s: ours.prefill_tok_s / theirs.prefill_tok_s,
            decode_tok_s: ours.decode_tok_s / theirs.decode_tok_s,
            load_ms: ours.load_ms / theirs.load_ms,
            peak_rss_bytes: ours.peak_rss_bytes as f64 / theirs.peak_rss_bytes as f64,
            verify_cost_ratio: per_k(&ours.verify, |v| v.cost_ratio),
            verify_ms_ratio: per_k(&ours.verify, |v| v.ms),
            verify_last_only_ms_ratio: per_k(&ours.verify_last_only, |v| v.ms),
        }
    }

    /// The ratios of interleaved rounds (`pairs[i]` = both engines' figures
    /// of round i): each figure is the median of its per-round ratios, so a
    /// machine that speeds up or slows down between rounds biases neither
    /// engine. One pair gives [`Ratios::of`].
    pub fn median_of(pairs: &[(&Measured, &Measured)]) -> Self {
        let rs: Vec<Ratios> = pairs.iter().map(|(a, b)| Ratios::of(a, b)).collect();
        let med = |f: fn(&Ratios) -> f64| median(&rs.iter().map(f).collect::<Vec<_>>());
        let per_k = |f: fn(&Ratios) -> &Vec<KRatio>| -> Vec<KRatio> {
            let Some(first) = rs.first() else {
                return Vec::new();
            };
            f(first)
                .iter()
                .map(|kr| {
                    let xs: Vec<f64> = rs
                        .iter()
                        .filter_map(|r| f(r).iter().find(|x| x.k == kr.k).map(|x| x.ratio))
                        .collect();
                    KRatio {
                        k: kr.k,
                        ratio: median(&xs),
                    }
                })
                .collect()
        };
        Self {
            prefill_tok_s: med(|r| r.prefill_tok_s),
            decode_tok_s: med(|r| r.decode_tok_s),
            load_ms: med(|r| r.load_ms),
            peak_rss_bytes: med(|r| r.peak_rss_bytes),
            verify_cost_ratio: per_k(|r| &r.verify_cost_ratio),
            verify_ms_ratio: per_k(|r| &r.verify_ms_ratio),
            verify_last_only_ms_ratio: per_k(|r| &r.verify_last_only_ms_ratio),
        }
    }
}

impl Measured {
    /// One engine's figures over interleaved rounds: medians of the times and
    /// rates (per k for the verify points), the largest memory figures.
    /// Identity fields come from the first round. `None` for no rounds.
    pub fn median_of(rounds: &[Measured]) -> Option<Measured> {
        let first = rounds.first()?;
        let med = |f: fn(&Measured) -> f64| median(&rounds.iter().map(f).collect::<Vec<_>>());
        let points = |f: fn(&Measured) -> &Vec<VerifyPoint>| -> Vec<VerifyPoint> {
            f(first)
                .iter()
                .map(|p| {
                    let at = |g: fn(&VerifyPoint) -> f64| {
                        let xs: Vec<f64> = rounds
                            .iter()
                            .filter_map(|m| f(m).iter().find(|q| q.k == p.k).map(g))
                            .collect();
                        median(&xs)
                    };
                    VerifyPoint {
                        k: p.k,
                        ms: at(|q| q.ms),
                        cost_ratio: at(|q| q.cost_ratio),
                    }
                })
                .collect()
        };
        Some(Measured {
            load_ms: med(|m| m.load_ms),
            prefill_tok_s: med(|m| m.prefill_tok_s),
            decode_tok_s: med(|m| m.decode_tok_s),
            verify: points(|m| &m.verify),
            verify_last_only: points(|m| &m.verify_last_only),
            rss_after_load_bytes: rounds.iter().map(|m| m.rss_after_load_bytes).max()?,
            peak_rss_bytes: rounds.iter().map(|m| m.peak_rss_bytes).max()?,
            ..first.clone()
        })
    }
}

/// All engines on one model.
#[derive(Clone, Debug, Serialize)]
pub struct ModelReport {
    /// `draft` or `target`.
    pub model: String,
    pub path: String,
    pub gguf_bytes: u64,
    pub engines: Vec<EngineRun>,
    /// Keyed `tandem/candle`, `tandem/llama-cpp`; present when both ran.
    pub ratios: BTreeMap<String, Ratios>,
}

/// One prompt of the local speculative run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SpecPrompt {
    pub id: String,
    pub kind: String,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
    pub target_tokens: usize,
    pub target_ms: f64,
    pub speculative_tokens: usize,
    pub speculative_ms: f64,
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// Rounds, drafted and accepted tokens per proposer.
    pub by_proposer: ProposerStats,
    pub identical: bool,
    /// First index where the two token sequences differ.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_difference: Option<usize>,
}

/// Throughput of one mode over all prompts.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Throughput {
    pub tokens: usize,
    pub seconds: f64,
    /// tokens / seconds (prefill included: end-to-end generation time).
    pub tok_s: f64,
}

/// Greedy target-only vs speculative decoding, draft and target in one process.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SpecReport {
    /// The prompt set (`--prompts`: `default`, `editing` or the file given).
    #[serde(default)]
    pub prompt_set: String,
    /// The kernel ISA the model core dispatched to (`avx512vnni`, `avx2`, …).
    #[serde(default)]
    pub isa: String,
    /// What proposed the blocks (`--proposers`; one report per proposer and
    /// draft KV precision).
    pub proposer: ProposerKind,
    /// How the draft's KV cache stored keys and values (`--draft-kv`).
    #[serde(default)]
    pub draft_kv: KvPrecision,
    /// Bytes of the draft's K+V per cached token at that precision.
    #[serde(default)]
    pub draft_kv_bytes_per_token: usize,
    pub k: usize,
    pub threads: usize,
    pub prompts: usize,
    pub target_only: Throughput,
    pub speculative: Throughput,
    /// speculative.tok_s / target_only.tok_s.
    pub speedup: f64,
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// accepted / drafted.
    pub acceptance_rate: f64,
    /// accepted / rounds.
    pub mean_accepted_len: f64,
    /// Rounds, drafted and accepted tokens per proposer, over all prompts.
    pub by_proposer: ProposerStats,
    /// Every prompt's speculative tokens equal its target-only tokens.
    pub identical: bool,
    pub mismatches: Vec<String>,
    pub per_prompt: Vec<SpecPrompt>,
    pub peak_rss_bytes: u64,
}

/// The machine the run happened on.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub cpu: String,
    pub logical_cpus: usize,
    /// 1-, 5- and 15-minute load averages before and after the run.
    pub loadavg_before: Vec<f64>,
    pub loadavg_after: Vec<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    pub threads: usize,
    pub repeats: usize,
    /// Interleaved rounds of every engine (`--rounds`); figures are medians
    /// over rounds, ratios medians of per-round ratios.
    pub rounds: usize,
    pub quick: bool,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    pub verify_ks: Vec<usize>,
    pub spec_prompts: usize,
    pub spec_k: usize,
    pub spec_proposers: Vec<ProposerKind>,
    pub spec_draft_kv: Vec<KvPrecision>,
    pub spec_max_tokens_cap: Option<usize>,
}

/// The whole `--json` document.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub schema_version: u32,
    pub tandem_version: String,
    pub date_utc: String,
    pub machine: Machine,
    pub settings: Settings,
    pub models: Vec<ModelReport>,
    /// One report per proposer; empty when not run (`--spec-prompts 0`, or
    /// tandem not among the engines).
    pub speculative: Vec<SpecReport>,
    /// Speculative-run failure, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative_error: Option<String>,
    /// No worker failed and the speculative output matched.
    pub ok: bool,
}

/// Median of a sample ([`tandem_stats::median`]: the mean of the middle two for
/// even sizes); NaN for an empty one.
pub fn median(xs: &[f64]) -> f64 {
    tandem_stats::median(xs).unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_odd_even_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    fn m(prefill: f64, decode: f64, rss: u64, costs: &[(usize, f64)]) -> Measured {
        Measured {
            version: String::new(),
            threads: 2,
            load_ms: 10.0,
            prefill_tokens: 128,
            prefill_tok_s: prefill,
            decode_tokens: 32,
            decode_tok_s: decode,
            verify_context: 128,
            verify_last_only: Vec::new(),
            verify: costs
                .iter()
                .map(|&(k, c)| VerifyPoint {
                    k,
                    ms: c,
                    cost_ratio: c,
                })
                .collect(),
            rss_after_load_bytes: rss,
            peak_rss_bytes: rss,
        }
    }

    #[test]
    fn ratios_divide_ours_by_theirs_and_match_k() {
        let a = m(200.0, 40.0, 100, &[(1, 1.0), (5, 1.5), (9, 2.0)]);
        let b = m(100.0, 20.0, 400, &[(1, 1.0), (5, 3.0)]);
        let r = Ratios::of(&a, &b);
        assert_eq!(r.prefill_tok_s, 2.0);
        assert_eq!(r.decode_tok_s, 2.0);
        assert_eq!(r.peak_rss_bytes, 0.25);
        assert_eq!(r.verify_cost_ratio.len(), 2, "k = 9 has no counterpart");
        assert_eq!(r.verify_cost_ratio[1].k, 5);
        assert_eq!(r.verify_cost_ratio[1].ratio, 0.5);
        assert_eq!(r.verify_ms_ratio[1].ratio, 0.5);
        assert!(
            r.verify_last_only_ms_ratio.is_empty(),
            "a measured nothing last-only"
        );
    }

    #[test]
    fn rounds_take_medians_and_ratios_pair_each_round() {
        // The machine slows down by 2× in round 2 and 4× in round 3, for both
        // engines alike: ours is always 2× faster at decode and k = 5.
        let ours: Vec<Measured> = [1.0, 2.0, 4.0]
            .iter()
            .map(|&slow| {
                m(
                    100.0 / slow,
                    40.0 / slow,
                    100,
                    &[(1, slow), (5, 1.5 * slow)],
                )
            })
            .collect();
        let theirs: Vec<Measured> = [1.0, 2.0, 4.0]
            .iter()
            .map(|&slow| {
                m(
                    50.0 / slow,
                    20.0 / slow,
                    300 + slow as u64,
                    &[(1, slow), (5, 3.0 * slow)],
                )
            })
            .collect();
        let pairs: Vec<(&Measured, &Measured)> = ours.iter().zip(&theirs).collect();
        let r = Ratios::median_of(&pairs);
        assert_eq!(r.decode_tok_s, 2.0);
        assert_eq!(r.prefill_tok_s, 2.0);
        assert_eq!(r.verify_ms_ratio[1].k, 5);
        assert_eq!(r.verify_ms_ratio[1].ratio, 0.5);
        let med = Measured::median_of(&theirs).unwrap();
        assert_eq!(med.decode_tok_s, 10.0, "median of 20, 10, 5");
        assert_eq!(med.verify[1].ms, 6.0, "median of 3, 6, 12");
        assert_eq!(med.peak_rss_bytes, 304, "memory: the largest round");
        assert!(Measured::median_of(&[]).is_none());
        // A single round is the plain ratio.
        let one = Ratios::median_of(&pairs[..1]);
        assert_eq!(
            one.decode_tok_s,
            Ratios::of(&ours[0], &theirs[0]).decode_tok_s
        );
    }
}
