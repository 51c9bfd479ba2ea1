//! What a generation reports: where each token came from ([`TokenStatus`]),
//! the events while it runs ([`EdgeEvent`]), the verifier's judgement of
//! provisional spans ([`ProvisionalCheck`], [`ProvisionalReport`]), its
//! statistics ([`EdgeStats`]) and its result ([`EdgeGeneration`]). Plain data
//! in a leaf module: the runtime and the round loop's modules all name these
//! types without importing their parent (`crate::runtime` re-exports them).

use serde::{Deserialize, Serialize};
use tandem_model::logprobs::TokenLogprobs;
use tandem_model::speculative::StopReason;

/// Where an emitted token came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenStatus {
    /// Came through a verdict of the verifier: the target's own token (its
    /// argmax, or in sampled mode its keyed draw for the seed).
    Verified,
    /// Drafted on the device alone while the verifier was unreachable.
    Provisional,
    /// The whole request ran on the device (no verifier, or the router said so).
    Local,
}

/// The verifier's judgement of one provisional span, after it came back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProvisionalCheck {
    /// Output positions `start..end` were provisional.
    pub start: usize,
    pub end: usize,
    /// Output positions where the target (given the streamed tokens before it,
    /// and in sampled mode the seed) would have chosen a different token.
    /// Empty when the span was not checked (see `checked`).
    pub mismatches: Vec<usize>,
    /// False when the span was not checked (split sessions, or the generation
    /// ended first).
    pub checked: bool,
}

/// Summary of every provisional span of a generation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProvisionalReport {
    pub provisional_tokens: usize,
    /// Provisional tokens the verifier has checked.
    pub checked_tokens: usize,
    pub mismatched_tokens: usize,
    /// First output position that differs from what the target would have produced.
    pub first_mismatch: Option<usize>,
    pub spans: Vec<ProvisionalCheck>,
}

/// What the runtime reports while generating.
#[derive(Clone, Debug, PartialEq)]
pub enum EdgeEvent {
    /// Output token number `index` (0-based), final as emitted.
    Token {
        index: usize,
        id: u32,
        status: TokenStatus,
        /// With [`GenerateConfig::top_logprobs`](tandem_model::speculative::GenerateConfig::top_logprobs):
        /// the token's logprobs from the distribution that chose it: the
        /// target's (from the verifier) for a verified token, the draft's for
        /// a provisional or local one. `None` otherwise.
        logprobs: Option<Box<TokenLogprobs>>,
    },
    /// The verifier came back and judged a provisional span.
    ProvisionalChecked(ProvisionalCheck),
}

/// Statistics of one generation.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct EdgeStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub verified_tokens: usize,
    pub provisional_tokens: usize,
    pub local_tokens: usize,
    /// Speculative rounds answered by a verdict.
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// accepted / drafted.
    pub acceptance_rate: f64,
    /// Mean accepted draft tokens per round.
    pub mean_accepted_len: f64,
    /// Verify-only rounds over provisional spans (+ Resumes they needed).
    pub check_rounds: u64,
    /// Verify round trips of this generation.
    pub rtt_mean_ms: f64,
    pub rtt_p95_ms: f64,
    /// Encoded protobuf bytes (prost `encoded_len`) sent / received.
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Target forward passes the verifier ran for this generation: prefills
    /// (Open/Resume) + verify rounds.
    pub verifier_passes: u64,
    pub verifier_passes_per_token: f64,
    pub draft_forwards: u64,
    /// Sessions opened (the first one plus every resume).
    pub opens: u64,
    /// Opens started in the background after a failure (the device drafted
    /// alone, provisional, while they were in flight).
    #[serde(default)]
    pub background_opens: u64,
    /// Streams that broke after they had worked, or opens refused as
    /// unavailable while nothing had failed, that were re-opened at once, in
    /// the foreground, before the device drafted alone (a load balancer re-homes
    /// such a re-open to another verifier replica; docs/edge.md).
    #[serde(default)]
    pub immediate_reopens: u64,
    /// Drafted blocks shown as provisional without a round trip (`[gate]`),
    /// and their tokens.
    #[serde(default)]
    pub gated_rounds: u64,
    #[serde(default)]
    pub gated_tokens: u64,
    /// SESSION_EVICTED / SESSION_UNKNOWN answers that made the device resend.
    pub resends: u64,
    pub timeouts: u64,
    pub failures: u64,
    pub breaker_opens: u64,
    /// Prompt tokens whose draft KV came from the conversation cache, and the
    /// prompt tokens the draft prefilled (the rest).
    #[serde(default)]
    pub draft_reused_tokens: usize,
    #[serde(default)]
    pub draft_prefill_tokens: usize,
    /// Context positions the verifier reused from a kept or resumed session,
    /// and the positions it prefilled, summed over this generation's opens.
    #[serde(default)]
    pub verifier_reused_tokens: u64,
    #[serde(default)]
    pub verifier_prefill_tokens: u64,
    /// The verifier session was continued from an earlier turn (only the new
    /// tokens went up).
    #[serde(default)]
    pub continued_session: bool,
    /// Messages the context policy dropped from the start of the conversation
    /// (`drop_oldest`; set by the chat front ends, 0 otherwise).
    #[serde(default)]
    pub dropped_messages: usize,
    pub ttft_ms: f64,
    pub total_ms: f64,
    pub tokens_per_s: f64,
    /// Rounds, drafted and accepted tokens per proposer (`--proposer`; rounds
    /// of the draft-only kinds count as draft rounds).
    #[serde(default)]
    pub proposers: tandem_model::proposer::ProposerStats,
    /// Split execution (when configured): s, format, per-round times, prediction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<crate::split::SplitReport>,
    /// What the device state changed for this generation (draft threads, k
    /// cap; read once at its start: `crate::device`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<crate::device::DeviceAdjustments>,
}

/// The result of [`EdgeRuntime::generate`].
#[derive(Clone, Debug)]
pub struct EdgeGeneration {
    pub tokens: Vec<u32>,
    pub statuses: Vec<TokenStatus>,
    pub stop: StopReason,
    pub stats: EdgeStats,
    pub provisional: ProvisionalReport,
    /// The verifier's session id (last one), if any session was opened.
    pub session_id: Option<String>,
}
