//! Split execution on the device: the device also holds the target model and runs
//! its embedding and layers `[0, s)` on every verify block, sending hidden states
//! instead of leaving the whole forward to the verifier, which runs `[s, N)`
//! (wire rules: the file comment of `verifier.proto`). With `pin_head` (U-shape)
//! the verifier returns the final hidden states and the device runs the head and
//! computes the verdict, so no token id leaves the device.
//!
//! `layer = "auto"`: the device picks `s` with the shard planner's cost model
//! (`tandem_shard::two_node`) from its own profile (`tandem profile` JSON), the
//! configured bandwidth and the network RTT it measures (round time minus the
//! profile's prediction of the compute and transfer), and re-plans when that
//! estimate moves by more than `replan_threshold` ([`AutoSplit::observe`]); a new
//! `s` takes effect by opening a new session.
//!
//! Known limits: the device maps the whole target file and allocates its KV cache
//! for all N layers (only `[0, s)` is written; untouched capacity maps lazily);
//! provisional spans are not checked by the verifier in split sessions;
//! bandwidth is configured, not measured.

use crate::codec::{check_verdict, BlockCodec};
use crate::error::EdgeError;
pub use crate::split_report::SplitReport;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use tandem_model::engine::{masked_verdict, OutputConstraint};
use tandem_model::kv_cache::KvCache;
use tandem_model::sampling::SamplingParams;
use tandem_model::transformer::Model;
use tandem_model::verify::{verdict_from_logits, verdict_logprobs};
use tandem_proto::hidden;
use tandem_proto::v1::{self as pb, server_message::Msg as ServerMsg, HiddenFormat};
use tandem_shard::two_node::{best_split, evaluate_split, two_node_problem, TwoNodeLink};
use tandem_shard::ModelProfile;

/// `layer = 12` or `layer = "auto"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SplitLayer {
    Fixed(usize),
    /// Must be `"auto"`.
    Named(String),
}

impl Default for SplitLayer {
    fn default() -> Self {
        Self::Fixed(0)
    }
}

/// `[split]` of the edge config (documented in `docs/shard-planner.md`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SplitConfig {
    /// s (0..=N): the device runs the embedding and target layers `[0, s)`;
    /// or `"auto"` (needs `profile`).
    pub layer: SplitLayer,
    /// U-shape: the head and the verdict stay on the device.
    pub pin_head: bool,
    /// Send hidden states as f16: half the bytes, LOSSY (greedy output may differ
    /// from the target's). Default f32: bit-identical.
    pub hidden_f16: bool,
    /// `tandem profile --model target` JSON of this device: needed for `auto`, and
    /// when given the stats report the cost model's predicted round time.
    pub profile: Option<PathBuf>,
    /// Link bandwidth the planner assumes, Mbit/s each way.
    pub up_mbps: f64,
    pub down_mbps: f64,
    /// The same target profiled on the server (`tandem profile` run there): the
    /// cost model then uses the server's measured times instead of `profile`'s
    /// divided by `server_speed` (give one or the other).
    pub server_profile: Option<PathBuf>,
    /// Server speed relative to this device (1 = same machine type).
    pub server_speed: f64,
    /// Measured fixed cost of one exchange beyond the network RTT (gRPC framing,
    /// hidden-state encode/decode, the verifier's bookkeeping), ms; charged in
    /// the cost model to every round that crosses the link.
    pub round_overhead_ms: f64,
    /// Network RTT (ms) assumed before any round was measured; also the RTT of
    /// the link `SplitReport::predicted_round_ms` is predicted for.
    pub initial_rtt_ms: f64,
    /// Re-plan when the RTT estimate differs from the one planned with by more
    /// than this fraction (and by at least `replan_min_ms`).
    pub replan_threshold: f64,
    pub replan_min_ms: f64,
}

impl Default for SplitConfig {
    fn default() -> Self {
        Self {
            layer: SplitLayer::Fixed(0),
            pin_head: false,
            hidden_f16: false,
            profile: None,
            server_profile: None,
            up_mbps: 1000.0,
            down_mbps: 1000.0,
            server_speed: 1.0,
            round_overhead_ms: 0.0,
            initial_rtt_ms: 1.0,
            replan_threshold: 0.5,
            replan_min_ms: 5.0,
        }
    }
}

impl SplitConfig {
    /// True for `layer = "auto"`.
    pub fn is_auto(&self) -> bool {
        matches!(&self.layer, SplitLayer::Named(n) if n == "auto")
    }

    pub fn validate(&self) -> Result<(), EdgeError> {
        let bad = |m: String| Err(EdgeError::Config(format!("split: {m}")));
        if let SplitLayer::Named(n) = &self.layer {
            if n != "auto" {
                return bad(format!("layer must be a number or \"auto\", got {n:?}"));
            }
            if self.profile.is_none() {
                return bad(
                    "layer = \"auto\" needs profile (tandem profile --model target)".into(),
                );
            }
        }
        for (name, v) in [
            ("up_mbps", self.up_mbps),
            ("down_mbps", self.down_mbps),
            ("server_speed", self.server_speed),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(format!("{name} must be positive, got {v}"));
            }
        }
        if self.server_profile.is_some() && self.server_speed != 1.0 {
            return bad(
                "give server_profile (measured on the server) or server_speed, not both".into(),
            );
        }
        for (name, v) in [
            ("initial_rtt_ms", self.initial_rtt_ms),
            ("round_overhead_ms", self.round_overhead_ms),
            ("replan_threshold", self.replan_threshold),
            ("replan_min_ms", self.replan_min_ms),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(format!("{name} must be >= 0, got {v}"));
            }
        }
        Ok(())
    }

    fn format(&self) -> HiddenFormat {
        if self.hidden_f16 {
            HiddenFormat::HiddenF16
        } else {
            HiddenFormat::HiddenF32
        }
    }
}

/// All-local `auto` sessions still exchange one round in this many, to keep
/// measuring the network.
pub const LOCAL_PROBE_EVERY: u32 = 8;

impl SplitConfig {
    /// The link the cost model assumes, at `rtt_ms`.
    pub fn link(&self, rtt_ms: f64) -> TwoNodeLink {
        TwoNodeLink {
            rtt_ms,
            up_mbps: self.up_mbps,
            down_mbps: self.down_mbps,
            server_speed: self.server_speed,
            round_overhead_ms: self.round_overhead_ms,
        }
    }
}

/// The device's profile and, when calibrated, the server's (same layers).
#[derive(Clone, Debug)]
pub struct Profiles {
    pub device: ModelProfile,
    pub server: Option<ModelProfile>,
}

impl Profiles {
    /// Loads `profile` and `server_profile` of `cfg` (None without `profile`)
    /// and checks them against a target of `n_layer` blocks.
    pub fn load(cfg: &SplitConfig, n_layer: usize) -> Result<Option<Self>, EdgeError> {
        let load = |p: &PathBuf, what: &str| {
            let m = ModelProfile::load(p)
                .map_err(|e| EdgeError::Config(format!("split {what}: {e}")))?;
            if m.layers.len() != n_layer + 2 {
                return Err(EdgeError::Config(format!(
                    "split {what} {} has {} layers; the target has {n_layer} blocks (+ embedding, head)",
                    m.model,
                    m.layers.len()
                )));
            }
            Ok(m)
        };
        let Some(p) = &cfg.profile else {
            if cfg.server_profile.is_some() {
                return Err(EdgeError::Config(
                    "split: server_profile needs profile (this device's, --split-profile)".into(),
                ));
            }
            return Ok(None);
        };
        let device = load(p, "profile")?;
        let server = match &cfg.server_profile {
            Some(p) => {
                let s = load(p, "server_profile")?;
                if !device.same_layers(&s) {
                    return Err(EdgeError::Config(format!(
                        "split server_profile {} does not have profile {}'s layers",
                        s.model, device.model
                    )));
                }
                Some(s)
            }
            None => None,
        };
        Ok(Some(Self { device, server }))
    }

    /// The two-node problem for `link`.
    pub fn problem(
        &self,
        link: &TwoNodeLink,
        block_tokens: u32,
        pin_head: bool,
    ) -> Result<tandem_shard::PlanProblem, tandem_shard::PlanError> {
        two_node_problem(
            &self.device,
            self.server.as_ref(),
            link,
            block_tokens,
            pin_head,
        )
    }
}

/// `auto`: the split choice and its re-plan rule, pure (no model, no network).
#[derive(Clone, Debug)]
pub struct AutoSplit {
    profile: Profiles,
    link: TwoNodeLink,
    pin_head: bool,
    threshold: f64,
    min_ms: f64,
    /// RTT the current choice was planned with.
    planned_rtt_ms: f64,
    /// Smoothed network RTT estimate.
    estimate_ms: f64,
    layer: usize,
    replans: u32,
}

impl AutoSplit {
    pub fn new(profile: Profiles, cfg: &SplitConfig, block_tokens: u32) -> Result<Self, EdgeError> {
        let link = cfg.link(cfg.initial_rtt_ms);
        let mut a = Self {
            profile,
            link,
            pin_head: cfg.pin_head,
            threshold: cfg.replan_threshold,
            min_ms: cfg.replan_min_ms,
            planned_rtt_ms: cfg.initial_rtt_ms,
            estimate_ms: cfg.initial_rtt_ms,
            layer: 0,
            replans: 0,
        };
        a.layer = a.plan(cfg.initial_rtt_ms, block_tokens)?;
        Ok(a)
    }

    /// The best s for a network RTT of `rtt_ms`.
    pub fn plan(&self, rtt_ms: f64, block_tokens: u32) -> Result<usize, EdgeError> {
        let link = TwoNodeLink {
            rtt_ms,
            ..self.link
        };
        let p = self
            .profile
            .problem(&link, block_tokens, self.pin_head)
            .map_err(|e| EdgeError::Config(format!("split auto: {e}")))?;
        let (s, _) = best_split(&p).map_err(|e| EdgeError::Config(format!("split auto: {e}")))?;
        Ok(s)
    }

    /// The cost model's time of one round at split `s` (seconds).
    pub fn predict_s(&self, s: usize, rtt_ms: f64, block_tokens: u32) -> Option<f64> {
        predict(
            &self.profile,
            &TwoNodeLink {
                rtt_ms,
                ..self.link
            },
            self.pin_head,
            s,
            block_tokens,
        )
    }

    pub fn layer(&self) -> usize {
        self.layer
    }

    pub fn estimate_ms(&self) -> f64 {
        self.estimate_ms
    }

    pub fn replans(&self) -> u32 {
        self.replans
    }

    /// Feeds one network-RTT sample (ms). When the smoothed estimate has moved
    /// from the RTT of the current plan by more than the threshold (relative and
    /// absolute), re-plans; returns the new s when it differs.
    pub fn observe(&mut self, net_rtt_ms: f64, block_tokens: u32) -> Option<usize> {
        if !net_rtt_ms.is_finite() || net_rtt_ms < 0.0 {
            return None;
        }
        // EWMA with weight 1/4 on the new sample: one outlier cannot re-plan alone
        // unless it is very large.
        self.estimate_ms = 0.75 * self.estimate_ms + 0.25 * net_rtt_ms;
        let moved = (self.estimate_ms - self.planned_rtt_ms).abs();
        if moved <= self.min_ms || moved <= self.threshold * self.planned_rtt_ms {
            return None;
        }
        self.planned_rtt_ms = self.estimate_ms;
        let s = self.plan(self.estimate_ms, block_tokens).ok()?;
        if s == self.layer {
            return None;
        }
        self.layer = s;
        self.replans += 1;
        Some(s)
    }
}

/// The cost model's time of one round at split `s` (seconds), if the profile
/// allows it.
pub fn predict(
    profile: &Profiles,
    link: &TwoNodeLink,
    pin_head: bool,
    s: usize,
    block_tokens: u32,
) -> Option<f64> {
    let p = profile.problem(link, block_tokens, pin_head).ok()?;
    evaluate_split(&p, s).ok().map(|e| e.latency_s)
}

/// A split session's device side: the target and its KV cache for layers
/// `[0, s)`.
pub struct SplitExec {
    target: Arc<Model>,
    cfg: SplitConfig,
    layer: usize,
    format: HiddenFormat,
    cache: KvCache,
    auto: Option<AutoSplit>,
    profile: Option<Profiles>,
    /// U-shape: the block of the Draft in flight.
    pending: Vec<u32>,
    round_start: Option<Instant>,
    /// All-local rounds (U-shape at s = N): the final hidden states computed here.
    local_hidden: Option<Vec<f32>>,
    /// Rounds since the last exchange while all-local.
    local_rounds: u32,
    /// Device compute of the round in flight, seconds.
    device_s: f64,
    /// U-shape sessions asked for logprobs (the Open's `top_logprobs`, kept
    /// here instead of sent: the device runs the head, so it computes the
    /// target's logprobs of each verdict itself).
    top_logprobs: Option<usize>,
    /// U-shape sessions under a grammar: the generation's constraint, which
    /// the device's verdicts choose through (the verifier gets no grammar).
    guide: Option<Box<dyn OutputConstraint>>,
    pub report: SplitReport,
}

impl SplitExec {
    /// The target model whose first layers this device runs (shared).
    pub(crate) fn target(&self) -> Arc<Model> {
        self.target.clone()
    }

    /// Device-side split state for `target` (block size `k + 1` for `auto`).
    pub fn new(target: Arc<Model>, cfg: SplitConfig, k: usize) -> Result<Self, EdgeError> {
        cfg.validate()?;
        let n = target.config().n_layer;
        let profile = Profiles::load(&cfg, n)?;
        let auto = match (&profile, cfg.is_auto()) {
            (Some(p), true) => Some(AutoSplit::new(p.clone(), &cfg, (k + 1) as u32)?),
            _ => None,
        };
        let layer = match (&auto, &cfg.layer) {
            (Some(a), _) => a.layer(),
            (None, SplitLayer::Fixed(s)) => *s,
            (None, SplitLayer::Named(_)) => {
                return Err(EdgeError::Config("split: auto needs a profile".into()))
            }
        };
        if layer > n {
            return Err(EdgeError::Config(format!(
                "split: layer {layer} is beyond the target's {n} layers"
            )));
        }
        let format = cfg.format();
        let report = SplitReport {
            layer,
            n_layer: n,
            pin_head: cfg.pin_head,
            hidden_format: if cfg.hidden_f16 { "f16" } else { "f32" }.into(),
            lossy: cfg.hidden_f16,
            auto: auto.is_some(),
            ..SplitReport::default()
        };
        Ok(Self {
            cache: target.new_cache(),
            target,
            layer,
            format,
            auto,
            profile,
            pending: Vec::new(),
            round_start: None,
            local_hidden: None,
            local_rounds: 0,
            device_s: 0.0,
            top_logprobs: None,
            guide: None,
            report,
            cfg,
        })
    }

    pub fn layer(&self) -> usize {
        self.layer
    }

    pub fn pin_head(&self) -> bool {
        self.cfg.pin_head
    }

    fn d_model(&self) -> usize {
        self.target.config().d_model
    }

    /// Hidden states after layer s - 1 of `tokens` at `start_pos` (appending to
    /// the device's cache of layers `[0, s)`).
    fn prefix(&mut self, tokens: &[u32], start_pos: usize) -> Result<Vec<f32>, EdgeError> {
        self.cache.truncate(start_pos);
        let mut h = self.target.embed(tokens)?;
        if self.layer > 0 {
            self.target
                .forward_layers(0..self.layer, &mut h, start_pos, &mut self.cache)?;
        }
        Ok(h)
    }

    /// Fills a split Open for the context `ctx` (recomputes the device's cache).
    pub fn open_message(&mut self, ctx: &[u32], mut open: pb::Open) -> Result<pb::Open, EdgeError> {
        self.cache.clear();
        let rows = ctx.len().saturating_sub(1);
        let h = if rows > 0 {
            self.prefix(&ctx[..rows], 0)?
        } else {
            Vec::new()
        };
        open.prompt_hidden = Some(hidden::encode(&h, rows, self.format));
        open.split = Some(pb::Split {
            layer: self.layer as u32,
            pin_head: self.cfg.pin_head,
            format: self.format as i32,
        });
        if self.cfg.pin_head {
            open.prompt_tokens.clear();
            open.resume_session_id = None;
            // The verifier makes no verdicts here: the logprobs and the
            // grammar are the device's ([`Self::local_verdict`]).
            self.top_logprobs = open.top_logprobs.take().map(|n| n as usize);
            open.grammar = None;
        }
        self.report.layer = self.layer;
        Ok(open)
    }

    /// The local target's vocabulary (every token id of the session is below it).
    fn target_vocab(&self) -> u32 {
        u32::try_from(self.target.config().vocab).unwrap_or(u32::MAX)
    }

    /// Checks the verifier's Opened against the local target.
    pub fn check_opened(&self, o: &pb::Opened) -> Result<(), EdgeError> {
        crate::codec::check_vocab(o, self.target_vocab())?;
        let c = self.target.config();
        if o.n_layer as usize != c.n_layer || o.d_model as usize != c.d_model {
            return Err(EdgeError::Protocol(format!(
                "the verifier's target has {} layers x {} features; the device's split target has {} x {}",
                o.n_layer, o.d_model, c.n_layer, c.d_model
            )));
        }
        Ok(())
    }

    /// Turns a Draft of `block` after context `ctx` into a split Draft.
    pub fn draft_message(
        &mut self,
        ctx: &[u32],
        mut draft: pb::Draft,
    ) -> Result<pb::Draft, EdgeError> {
        self.round_start = Some(Instant::now());
        let Some(&last) = ctx.last() else {
            return Err(EdgeError::Protocol("empty context".into()));
        };
        let start_pos = ctx.len() - 1;
        let mut rows = Vec::with_capacity(draft.tokens.len() + 1);
        rows.push(last);
        rows.extend_from_slice(&draft.tokens);
        let t = Instant::now();
        let h = self.prefix(&rows, start_pos)?;
        self.device_s = t.elapsed().as_secs_f64();
        draft.hidden = Some(hidden::encode(&h, rows.len(), self.format));
        draft.start_pos = start_pos as u64;
        self.local_hidden = self.all_local().then_some(h);
        if self.cfg.pin_head {
            self.pending = std::mem::take(&mut draft.tokens);
        }
        Ok(draft)
    }

    /// U-shape sessions: the constraint of the generation about to run
    /// (`None`: unconstrained). Its verdicts choose among what it allows.
    pub fn set_guide(&mut self, guide: Option<Box<dyn OutputConstraint>>) {
        self.guide = guide;
    }

    /// U-shape: the verdict from the verifier's final hidden states, computed here
    /// exactly as the verifier would (head, then the prefix equal to the target's tokens).
    /// `ctx` is the context before the block.
    pub fn local_verdict(
        &mut self,
        v: &pb::Verdict,
        ctx: &[u32],
        sampling: &SamplingParams,
    ) -> Result<pb::Verdict, EdgeError> {
        let k = self.pending.len();
        let start_pos = ctx.len().saturating_sub(1);
        if v.context_len != (start_pos + k + 1) as u64 {
            return Err(EdgeError::Protocol(format!(
                "U-shape verdict holds {} positions, expected {}",
                v.context_len,
                start_pos + k + 1
            )));
        }
        let h = v
            .hidden
            .as_ref()
            .ok_or_else(|| EdgeError::Protocol("U-shape verdict without hidden states".into()))?;
        let h = hidden::decode(h, k + 1, self.d_model(), self.format)
            .map_err(|e| EdgeError::Protocol(format!("verdict hidden: {e}")))?;
        let t = Instant::now();
        let mut logits = self.target.head(&h);
        self.device_s += t.elapsed().as_secs_f64();
        let verdict = match self.guide.as_deref_mut() {
            None => verdict_from_logits(sampling, ctx, &self.pending, &logits)?,
            Some(g) => {
                let v = masked_verdict(sampling, ctx, &self.pending, &logits, g)?;
                if self.top_logprobs.is_some() {
                    // The logprobs of the distribution that chose: each
                    // emitted position's row masked as the verdict saw it.
                    let vocab = logits.len() / (self.pending.len() + 1);
                    let mut hist = ctx.to_vec();
                    for (i, t) in v.emitted(&self.pending).into_iter().enumerate() {
                        g.mask(&hist, &mut logits[i * vocab..(i + 1) * vocab])?;
                        hist.push(t);
                    }
                }
                v
            }
        };
        // The target's logprobs, from the same rows the verifier would have
        // read them from (its head is this one).
        let logprobs = match self.top_logprobs {
            Some(top) => verdict_logprobs(sampling, ctx, &self.pending, &logits, &verdict, top)?
                .into_iter()
                .map(|t| pb::TokenLogprobs {
                    logprob: t.logprob,
                    top: t
                        .top
                        .into_iter()
                        .map(|(token, logprob)| pb::TopLogprob { token, logprob })
                        .collect(),
                })
                .collect(),
            None => Vec::new(),
        };
        Ok(pb::Verdict {
            round: v.round,
            accepted: verdict.accepted as u32,
            next_token: verdict.next_token,
            context_len: (ctx.len() + verdict.accepted + 1) as u64,
            hidden: None,
            logprobs,
        })
    }

    /// After a verdict: keep the accepted prefix in the device's cache, record the
    /// round's time and let `auto` see the network. Returns true when `auto`
    /// chose a new s (the caller re-opens the session).
    pub fn accept(
        &mut self,
        ctx_before: usize,
        accepted: usize,
        exchange_ms: Option<f64>,
        k: usize,
    ) -> bool {
        self.cache.truncate(ctx_before + accepted);
        let round_ms = self
            .round_start
            .take()
            .map(|t| t.elapsed().as_secs_f64() * 1e3);
        if exchange_ms.is_none() {
            self.report.local_rounds += 1;
        }
        if let Some(ms) = round_ms {
            self.report.round_ms.push(ms);
            self.report.device_ms.push(self.device_s * 1e3);
        }
        let block = (k + 1) as u32;
        let mut replanned = false;
        let rtt_now = match (&self.profile, exchange_ms) {
            (Some(p), Some(exchange_ms)) => {
                // Network RTT = exchange time minus what the model says the server
                // computes and the link serialises (both RTT-free).
                // The per-round overhead is part of the model, not of the RTT.
                let link0 = self.cfg.link(0.0);
                let device_only = predict_device_s(p, &link0, self.cfg.pin_head, self.layer, block);
                let no_rtt = predict(p, &link0, self.cfg.pin_head, self.layer, block);
                match (no_rtt, device_only) {
                    (Some(t), Some(d)) => Some((exchange_ms - (t - d) * 1e3).max(0.0)),
                    _ => None,
                }
            }
            _ => None,
        };
        if let (Some(a), Some(rtt)) = (self.auto.as_mut(), rtt_now) {
            if let Some(s) = a.observe(rtt, block) {
                tracing::info!(
                    from = self.layer,
                    to = s,
                    rtt_ms = a.estimate_ms(),
                    "split re-planned"
                );
                self.layer = s;
                replanned = true;
            }
            self.report.replans = a.replans();
        }
        self.report.rtt_estimate_ms = self.auto.as_ref().map(|a| a.estimate_ms()).or(rtt_now);
        if let Some(p) = &self.profile {
            let link = self.cfg.link(self.cfg.initial_rtt_ms);
            let e = p
                .problem(&link, block, self.cfg.pin_head)
                .ok()
                .and_then(|prob| evaluate_split(&prob, self.report.layer).ok());
            if let Some(e) = e {
                let ms = |v: f64| Some(v * 1e3);
                self.report.predicted_round_ms = ms(e.latency_s);
                self.report.predicted_device_ms = ms(e.compute_s[tandem_shard::two_node::DEVICE]);
                self.report.predicted_server_ms = ms(e.compute_s[tandem_shard::two_node::SERVER]);
                self.report.predicted_network_ms =
                    ms(e.transfers.iter().map(|t| t.crossing_s).sum());
            }
        }
        replanned
    }

    /// U-shape at s = N: everything runs here, the verifier runs no layer.
    pub fn all_local(&self) -> bool {
        self.cfg.pin_head && self.layer == self.target.config().n_layer
    }

    /// All-local rounds skip the exchange: the answer is the final hidden
    /// states computed here (as the verifier would have returned them). With
    /// `auto`, every `LOCAL_PROBE_EVERY`-th round still goes to the verifier so
    /// that the RTT estimate keeps seeing the network. `None`: exchange.
    pub fn local_answer(&mut self, round: u64, ctx_len: usize) -> Option<pb::Verdict> {
        let h = self.local_hidden.take()?;
        self.local_rounds += 1;
        if self.auto.is_some() && self.local_rounds >= LOCAL_PROBE_EVERY {
            self.local_rounds = 0;
            return None;
        }
        let rows = h.len() / self.d_model();
        Some(pb::Verdict {
            round,
            context_len: (ctx_len - 1 + rows) as u64,
            hidden: Some(hidden::encode(&h, rows, self.format)),
            ..pb::Verdict::default()
        })
    }

    /// Undo a block whose verdict never came.
    pub fn rollback(&mut self, ctx_len: usize) {
        self.cache.truncate(ctx_len.saturating_sub(1));
        self.round_start = None;
    }
}

impl BlockCodec for SplitExec {
    fn tokens_only(&self) -> bool {
        false
    }

    fn vocab(&self) -> u32 {
        self.target_vocab()
    }

    fn open(&mut self, ctx: &[u32], open: pb::Open) -> Result<pb::Open, EdgeError> {
        self.open_message(ctx, open)
    }

    fn check_opened(&self, opened: &pb::Opened) -> Result<(), EdgeError> {
        SplitExec::check_opened(self, opened)
    }

    fn encode(&mut self, ctx: &[u32], draft: pb::Draft) -> Result<pb::Draft, EdgeError> {
        self.draft_message(ctx, draft)
    }

    fn answer_locally(&mut self, round: u64, ctx_len: usize) -> Option<pb::Verdict> {
        self.local_answer(round, ctx_len)
    }

    fn decode(
        &mut self,
        answer: ServerMsg,
        round: u64,
        k: usize,
        ctx: &[u32],
        sampling: &SamplingParams,
    ) -> Result<pb::Verdict, EdgeError> {
        if !self.pin_head() {
            return check_verdict(answer, round, k, ctx.len(), self.target_vocab());
        }
        let ServerMsg::Verdict(v) = answer else {
            return Err(EdgeError::Protocol("expected a Verdict".into()));
        };
        if v.round != round {
            return Err(EdgeError::Protocol(format!(
                "verdict for round {}, expected {round}",
                v.round
            )));
        }
        if v.accepted != 0 || v.next_token != 0 {
            // The device decides in U-shape sessions (docs/api.md, Verdict).
            return Err(EdgeError::Protocol(format!(
                "U-shape verdict with accepted {} and next_token {} (both must be 0)",
                v.accepted, v.next_token
            )));
        }
        self.local_verdict(&v, ctx, sampling)
    }

    fn accepted(
        &mut self,
        ctx_before: usize,
        accepted: usize,
        exchange_ms: Option<f64>,
        k: usize,
    ) -> bool {
        self.accept(ctx_before, accepted, exchange_ms, k)
    }

    fn rollback(&mut self, ctx_len: usize) {
        SplitExec::rollback(self, ctx_len)
    }

    fn report(&self) -> Option<SplitReport> {
        Some(self.report.clone())
    }
}

/// The device's own share of a round in the cost model (its compute), seconds.
fn predict_device_s(
    profile: &Profiles,
    link: &TwoNodeLink,
    pin_head: bool,
    s: usize,
    block_tokens: u32,
) -> Option<f64> {
    let p = profile.problem(link, block_tokens, pin_head).ok()?;
    evaluate_split(&p, s)
        .ok()
        .and_then(|e| e.compute_s.get(tandem_shard::two_node::DEVICE).copied())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tandem_shard::profile::{LayerKind, LayerProfile};

    /// 8 blocks of 10 ms (k=5 block) on the device; a 16x faster server.
    fn profile() -> ModelProfile {
        let layer = |name: String, kind, act: u64, t: f64| LayerProfile {
            name,
            kind,
            weight_bytes: 1000,
            kv_bytes_per_token: 0,
            activation_bytes_per_token: act,
            compute_seconds: [(5, t)].into_iter().collect(),
        };
        let mut layers = vec![layer("embedding".into(), LayerKind::Embedding, 6144, 0.0)];
        for i in 0..8 {
            layers.push(layer(format!("blk.{i}"), LayerKind::Block, 6144, 0.010));
        }
        layers.push(layer("head".into(), LayerKind::Head, 4, 0.020));
        ModelProfile {
            schema: ModelProfile::SCHEMA.into(),
            model: "synthetic".into(),
            measured: false,
            note: String::new(),
            machine: String::new(),
            threads: None,
            context_tokens: 64,
            block_sizes: vec![5],
            layers,
        }
    }

    fn profiles() -> Profiles {
        Profiles {
            device: profile(),
            server: None,
        }
    }

    fn cfg() -> SplitConfig {
        SplitConfig {
            layer: SplitLayer::Named("auto".into()),
            pin_head: true,
            server_speed: 16.0,
            up_mbps: 100.0,
            down_mbps: 100.0,
            initial_rtt_ms: 1.0,
            replan_threshold: 0.5,
            replan_min_ms: 5.0,
            ..SplitConfig::default()
        }
    }

    #[test]
    fn auto_offloads_on_a_fast_link_and_keeps_local_on_a_slow_one() {
        let a = AutoSplit::new(profiles(), &cfg(), 5).unwrap();
        assert_eq!(a.layer(), 0, "a 16x server 1 ms away takes every block");
        // U-shape: 80 ms of device blocks vs 5 ms on the server + 2 x 2.5 ms of
        // hidden states + one RTT: all-local wins past an RTT of ~70 ms.
        assert_eq!(a.plan(200.0, 5).unwrap(), 8);
        assert_eq!(a.plan(10.0, 5).unwrap(), 0);
    }

    #[test]
    fn replans_only_when_the_estimate_moves_beyond_the_threshold() {
        let mut a = AutoSplit::new(profiles(), &cfg(), 5).unwrap();
        // Jitter around the planned 1 ms: below replan_min_ms, never re-plans.
        for rtt in [1.0, 3.0, 0.5, 4.0, 2.0, 1.0] {
            assert_eq!(a.observe(rtt, 5), None);
        }
        // One 30 ms spike moves the EWMA by ~7 ms (> 5 ms and > 50 %): re-plans,
        // but 8 ms still favours the server, so s stays 0.
        assert_eq!(a.observe(30.0, 5), None);
        assert_eq!(a.replans(), 0);
        // The link turns into 300 ms: the estimate crosses the threshold and the
        // plan moves everything to the device.
        let mut moved = None;
        for _ in 0..10 {
            if let Some(s) = a.observe(300.0, 5) {
                moved = Some(s);
                break;
            }
        }
        assert_eq!(moved, Some(8));
        assert_eq!(a.layer(), 8);
        assert_eq!(a.replans(), 1);
        // Staying at 300 ms: no further re-plans.
        for _ in 0..20 {
            assert_eq!(a.observe(300.0, 5), None);
        }
        // Back to 1 ms: moves back to the server.
        let mut back = None;
        for _ in 0..40 {
            if let Some(s) = a.observe(1.0, 5) {
                back = Some(s);
            }
        }
        assert_eq!(back, Some(0));
        assert_eq!(a.replans(), 2);
        // Garbage samples are ignored.
        assert_eq!(a.observe(f64::NAN, 5), None);
        assert_eq!(a.observe(-1.0, 5), None);
    }

    #[test]
    fn config_errors_name_the_field() {
        let mut c = cfg();
        c.profile = None;
        assert!(c.validate().unwrap_err().to_string().contains("profile"));
        let c = SplitConfig {
            layer: SplitLayer::Named("half".into()),
            ..SplitConfig::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("\"half\""));
        let c = SplitConfig {
            up_mbps: 0.0,
            ..SplitConfig::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("up_mbps"));
        let c = SplitConfig {
            profile: Some("device.json".into()),
            server_profile: Some("server.json".into()),
            server_speed: 2.0,
            ..cfg()
        };
        assert!(c.validate().unwrap_err().to_string().contains("not both"));
        let c = SplitConfig {
            round_overhead_ms: -3.0,
            ..SplitConfig::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("round_overhead_ms"), "{e}");
    }

    #[test]
    fn a_slow_measured_server_and_the_round_overhead_move_auto_to_the_device() {
        // The server measured 2x slower than the device (instead of cfg()'s
        // nominal 16x faster): every block stays on the device even at 1 ms.
        let mut slow = profile();
        for l in &mut slow.layers {
            for t in l.compute_seconds.values_mut() {
                *t *= 2.0;
            }
        }
        let c = SplitConfig {
            server_speed: 1.0,
            ..cfg()
        };
        let calibrated = Profiles {
            device: profile(),
            server: Some(slow),
        };
        let a = AutoSplit::new(calibrated.clone(), &c, 5).unwrap();
        assert_eq!(a.layer(), 8);
        // A round overhead makes every exchanging split dearer by exactly it.
        let with = SplitConfig {
            round_overhead_ms: 40.0,
            ..c.clone()
        };
        let a0 = AutoSplit::new(calibrated.clone(), &c, 5).unwrap();
        let a40 = AutoSplit::new(calibrated, &with, 5).unwrap();
        let (p0, p40) = (
            a0.predict_s(4, 1.0, 5).unwrap(),
            a40.predict_s(4, 1.0, 5).unwrap(),
        );
        assert!((p40 - p0 - 0.040).abs() < 1e-9, "{p0} {p40}");
        // All-local (s = N, head pinned): no exchange, no overhead.
        let (l0, l40) = (
            a0.predict_s(8, 1.0, 5).unwrap(),
            a40.predict_s(8, 1.0, 5).unwrap(),
        );
        assert!((l40 - l0).abs() < 1e-12);
    }
}
