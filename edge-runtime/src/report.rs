//! What a generation reports: where each token came from ([`TokenStatus`]),
//! the events while it runs ([`EdgeEvent`]), the verifier's judgement of
//! provisional spans ([`ProvisionalCheck`], [`ProvisionalReport`]), its
//! statistics ([`EdgeStats`]: the core's `GenStats` and what the network
//! adds) and its result ([`EdgeGeneration`]). Plain data
//! in a leaf module: the runtime and the round loop's modules all name these
//! types without importing their parent (`crate::runtime` re-exports them).

use serde::{Deserialize, Serialize};
use tandem_model::logprobs::TokenLogprobs;
use tandem_model::speculative::{GenStats, StopReason};

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

/// Statistics of one generation: the generation core's ([`GenStats`]:
/// tokens, rounds, drafted and accepted tokens, draft forwards, times,
/// proposers) and what the network, provisional tokens and conversations
/// add. Its fields read through to `gen`'s (`stats.rounds`). The JSON is
/// one flat object in the key order it always had (`EdgeStatsJson`), without
/// the core's `decode_tokens_per_s`, `per_position` and `target_forwards`
/// (the edge counts verifier passes instead).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(from = "EdgeStatsJson", into = "EdgeStatsJson")]
pub struct EdgeStats {
    /// What every generation loop counts (rounds: those answered by a
    /// verdict; proposers: rounds of the draft-only kinds count as draft rounds).
    pub gen: GenStats,
    pub verified_tokens: usize,
    pub provisional_tokens: usize,
    pub local_tokens: usize,
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
    /// Sessions opened (the first one plus every resume).
    pub opens: u64,
    /// Opens started in the background after a failure (the device drafted
    /// alone, provisional, while they were in flight).
    pub background_opens: u64,
    /// Draft backlog rows prefilled while the verifier prefilled an open
    /// (the two prefills overlapped; docs/edge.md "Conversations").
    pub draft_rows_beside_open: u64,
    /// Streams that broke after they had worked, or opens refused as
    /// unavailable while nothing had failed, that were re-opened at once, in
    /// the foreground, before the device drafted alone (a load balancer re-homes
    /// such a re-open to another verifier replica; docs/edge.md).
    pub immediate_reopens: u64,
    /// Drafted blocks shown as provisional without a round trip (`[gate]`),
    /// and their tokens.
    pub gated_rounds: u64,
    pub gated_tokens: u64,
    /// SESSION_EVICTED / SESSION_UNKNOWN answers that made the device resend.
    pub resends: u64,
    pub timeouts: u64,
    pub failures: u64,
    pub breaker_opens: u64,
    /// Prompt tokens whose draft KV came from the conversation cache, and the
    /// prompt tokens the draft prefilled (the rest).
    pub draft_reused_tokens: usize,
    pub draft_prefill_tokens: usize,
    /// Of `draft_reused_tokens`, the rows the idle catch-up between turns
    /// computed (`EdgeRuntime::catch_up`: the earlier turn's reply that
    /// prompt lookup served without the draft).
    pub draft_caught_up_tokens: usize,
    /// Context positions the verifier reused from a kept or resumed session,
    /// and the positions it prefilled, summed over this generation's opens.
    pub verifier_reused_tokens: u64,
    pub verifier_prefill_tokens: u64,
    /// The verifier session was continued from an earlier turn (only the new
    /// tokens went up).
    pub continued_session: bool,
    /// Messages the context policy dropped from the start of the conversation
    /// (`drop_oldest`; set by the chat front ends, 0 otherwise).
    pub dropped_messages: usize,
    /// Split execution (when configured): s, format, per-round times, prediction.
    pub split: Option<crate::device_layers::SplitReport>,
    /// What the device state changed for this generation (draft threads, k
    /// cap; read once at its start: `crate::device`).
    pub device: Option<crate::device::DeviceAdjustments>,
}

impl std::ops::Deref for EdgeStats {
    type Target = GenStats;
    fn deref(&self) -> &GenStats {
        &self.gen
    }
}

impl std::ops::DerefMut for EdgeStats {
    fn deref_mut(&mut self) -> &mut GenStats {
        &mut self.gen
    }
}

/// The JSON form of [`EdgeStats`]: every key in its order (docs/cli.md);
/// the fields are documented there.
#[derive(Serialize, Deserialize)]
struct EdgeStatsJson {
    prompt_tokens: usize,
    generated_tokens: usize,
    verified_tokens: usize,
    provisional_tokens: usize,
    local_tokens: usize,
    rounds: u64,
    drafted: u64,
    accepted: u64,
    acceptance_rate: f64,
    mean_accepted_len: f64,
    check_rounds: u64,
    rtt_mean_ms: f64,
    rtt_p95_ms: f64,
    bytes_sent: u64,
    bytes_received: u64,
    verifier_passes: u64,
    verifier_passes_per_token: f64,
    draft_forwards: u64,
    opens: u64,
    #[serde(default)]
    background_opens: u64,
    #[serde(default)]
    draft_rows_beside_open: u64,
    #[serde(default)]
    immediate_reopens: u64,
    #[serde(default)]
    gated_rounds: u64,
    #[serde(default)]
    gated_tokens: u64,
    resends: u64,
    timeouts: u64,
    failures: u64,
    breaker_opens: u64,
    #[serde(default)]
    draft_reused_tokens: usize,
    #[serde(default)]
    draft_prefill_tokens: usize,
    #[serde(default)]
    draft_caught_up_tokens: usize,
    #[serde(default)]
    verifier_reused_tokens: u64,
    #[serde(default)]
    verifier_prefill_tokens: u64,
    #[serde(default)]
    continued_session: bool,
    #[serde(default)]
    dropped_messages: usize,
    ttft_ms: f64,
    total_ms: f64,
    tokens_per_s: f64,
    #[serde(default)]
    proposers: tandem_model::proposer::ProposerStats,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    split: Option<crate::device_layers::SplitReport>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    device: Option<crate::device::DeviceAdjustments>,
}

impl From<EdgeStatsJson> for EdgeStats {
    fn from(j: EdgeStatsJson) -> Self {
        let EdgeStatsJson {
            prompt_tokens,
            generated_tokens,
            verified_tokens,
            provisional_tokens,
            local_tokens,
            rounds,
            drafted,
            accepted,
            acceptance_rate,
            mean_accepted_len,
            check_rounds,
            rtt_mean_ms,
            rtt_p95_ms,
            bytes_sent,
            bytes_received,
            verifier_passes,
            verifier_passes_per_token,
            draft_forwards,
            opens,
            background_opens,
            draft_rows_beside_open,
            immediate_reopens,
            gated_rounds,
            gated_tokens,
            resends,
            timeouts,
            failures,
            breaker_opens,
            draft_reused_tokens,
            draft_prefill_tokens,
            draft_caught_up_tokens,
            verifier_reused_tokens,
            verifier_prefill_tokens,
            continued_session,
            dropped_messages,
            ttft_ms,
            total_ms,
            tokens_per_s,
            proposers,
            split,
            device,
        } = j;
        EdgeStats {
            gen: GenStats {
                prompt_tokens,
                generated_tokens,
                rounds,
                drafted,
                accepted,
                acceptance_rate,
                mean_accepted_len,
                draft_forwards,
                ttft_ms,
                total_ms,
                tokens_per_s,
                proposers,
                ..GenStats::default()
            },
            verified_tokens,
            provisional_tokens,
            local_tokens,
            check_rounds,
            rtt_mean_ms,
            rtt_p95_ms,
            bytes_sent,
            bytes_received,
            verifier_passes,
            verifier_passes_per_token,
            opens,
            background_opens,
            draft_rows_beside_open,
            immediate_reopens,
            gated_rounds,
            gated_tokens,
            resends,
            timeouts,
            failures,
            breaker_opens,
            draft_reused_tokens,
            draft_prefill_tokens,
            draft_caught_up_tokens,
            verifier_reused_tokens,
            verifier_prefill_tokens,
            continued_session,
            dropped_messages,
            split,
            device,
        }
    }
}

impl From<EdgeStats> for EdgeStatsJson {
    fn from(s: EdgeStats) -> Self {
        let EdgeStats {
            gen:
                GenStats {
                    prompt_tokens,
                    generated_tokens,
                    rounds,
                    drafted,
                    accepted,
                    acceptance_rate,
                    mean_accepted_len,
                    draft_forwards,
                    ttft_ms,
                    total_ms,
                    tokens_per_s,
                    proposers,
                    decode_tokens_per_s: _,
                    per_position: _,
                    target_forwards: _,
                },
            verified_tokens,
            provisional_tokens,
            local_tokens,
            check_rounds,
            rtt_mean_ms,
            rtt_p95_ms,
            bytes_sent,
            bytes_received,
            verifier_passes,
            verifier_passes_per_token,
            opens,
            background_opens,
            draft_rows_beside_open,
            immediate_reopens,
            gated_rounds,
            gated_tokens,
            resends,
            timeouts,
            failures,
            breaker_opens,
            draft_reused_tokens,
            draft_prefill_tokens,
            draft_caught_up_tokens,
            verifier_reused_tokens,
            verifier_prefill_tokens,
            continued_session,
            dropped_messages,
            split,
            device,
        } = s;
        EdgeStatsJson {
            prompt_tokens,
            generated_tokens,
            verified_tokens,
            provisional_tokens,
            local_tokens,
            rounds,
            drafted,
            accepted,
            acceptance_rate,
            mean_accepted_len,
            check_rounds,
            rtt_mean_ms,
            rtt_p95_ms,
            bytes_sent,
            bytes_received,
            verifier_passes,
            verifier_passes_per_token,
            draft_forwards,
            opens,
            background_opens,
            draft_rows_beside_open,
            immediate_reopens,
            gated_rounds,
            gated_tokens,
            resends,
            timeouts,
            failures,
            breaker_opens,
            draft_reused_tokens,
            draft_prefill_tokens,
            draft_caught_up_tokens,
            verifier_reused_tokens,
            verifier_prefill_tokens,
            continued_session,
            dropped_messages,
            ttft_ms,
            total_ms,
            tokens_per_s,
            proposers,
            split,
            device,
        }
    }
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
