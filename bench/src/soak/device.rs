//! One simulated device of the soak: a thread with its own edge runtime (the
//! real draft model, the verifier client, breaker and offline fallback of
//! `tandem-edge`), generating greedily over the prompt set in a loop until
//! the coordinator says stop. Every generation is recorded with what was
//! streamed, and the stream is checked against the final result at once
//! (indices contiguous, nothing duplicated or lost).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tandem_edge::{EdgeConfig, EdgeEvent, EdgeGeneration, EdgeRuntime, EdgeStats, TokenStatus};
use tandem_edge::{ProvisionalCheck, ProvisionalReport};
use tandem_model::speculative::{GenerateConfig, StopReason};
use tandem_model::transformer::Model;

/// A generation that returned (whatever its stop reason).
#[derive(Clone, Debug)]
pub struct Finished {
    pub tokens: Vec<u32>,
    pub statuses: Vec<TokenStatus>,
    pub stop: StopReason,
    pub provisional: ProvisionalReport,
    pub stats: EdgeStats,
    /// Differences between the streamed events and the final result
    /// (duplicated, lost or altered tokens); empty when they agree.
    pub stream_faults: Vec<String>,
    /// When each token was streamed, seconds since the soak started.
    pub token_at_s: Vec<f64>,
}

/// One generation of one device.
#[derive(Clone, Debug)]
pub struct Record {
    pub device: usize,
    /// Index into the soak's prompt set.
    pub prompt: usize,
    /// Seconds since the soak started.
    pub started_s: f64,
    pub ended_s: f64,
    /// `Err`: the runtime returned an error (the message).
    pub outcome: Result<Finished, String>,
}

/// What the coordinator shares with every device.
pub struct Shared {
    pub draft: Arc<Model>,
    pub edge: EdgeConfig,
    pub gen: GenerateConfig,
    pub prompts: Arc<Vec<Vec<u32>>>,
    /// The soak's start (record times are relative to it).
    pub clock: Instant,
    /// No new generation after this is set (the running one finishes).
    pub stop: Arc<AtomicBool>,
    /// Cancel the running generation (the drain took too long).
    pub cancel: Arc<AtomicBool>,
    /// Every device's finished generations, in the order they ended.
    pub records: Arc<Mutex<Vec<Record>>>,
    /// Generations started by all devices.
    pub started: Arc<AtomicUsize>,
    /// Per device, the draft KV bytes its runtime's conversation cache keeps
    /// (`ConversationStats::bytes`, bounded by `conversations.budget_mib`),
    /// as of its last finished generation.
    pub conversation_bytes: Arc<Vec<AtomicU64>>,
}

impl Shared {
    /// The conversation caches' bytes of every device.
    pub fn kept_conversation_bytes(&self) -> u64 {
        self.conversation_bytes
            .iter()
            .fold(0u64, |s, b| s.saturating_add(b.load(Ordering::Relaxed)))
    }
}

/// Generates until `shared.stop`, adding each generation to
/// `shared.records` as it ends; `Err` when the runtime could not be built.
pub fn run(device: usize, shared: &Shared) -> Result<(), String> {
    let mut edge = EdgeRuntime::builder(shared.draft.clone(), shared.edge.clone())
        .build()
        .map_err(|e| format!("device {device}: building the edge runtime: {e}"))?;
    let span = tracing::info_span!("soak_device", device);
    let _entered = span.enter();
    let mut generation = 0usize;
    while !shared.stop.load(Ordering::SeqCst) {
        // Device i starts at prompt i and walks the set.
        let prompt = device.wrapping_add(generation) % shared.prompts.len();
        generation = generation.wrapping_add(1);
        shared.started.fetch_add(1, Ordering::SeqCst);
        let started_s = shared.clock.elapsed().as_secs_f64();
        let mut events = Vec::new();
        let mut token_at_s = Vec::new();
        let (cancel, clock) = (&shared.cancel, shared.clock);
        let result = edge.generate(&shared.prompts[prompt], &shared.gen, &mut |e| {
            if matches!(e, EdgeEvent::Token { .. }) {
                token_at_s.push(clock.elapsed().as_secs_f64());
            }
            events.push(e.clone());
            !cancel.load(Ordering::SeqCst)
        });
        let outcome = match result {
            Ok(g) => Ok(Finished {
                stream_faults: stream_faults(&events, &g, shared.gen.max_tokens),
                tokens: g.tokens,
                statuses: g.statuses,
                stop: g.stop,
                provisional: g.provisional,
                stats: g.stats,
                token_at_s,
            }),
            Err(e) => Err(e.to_string()),
        };
        let record = Record {
            device,
            prompt,
            started_s,
            ended_s: shared.clock.elapsed().as_secs_f64(),
            outcome,
        };
        shared
            .records
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(record);
        if let Some(b) = shared.conversation_bytes.get(device) {
            b.store(edge.conversation_stats().bytes, Ordering::Relaxed);
        }
    }
    Ok(())
}

/// Where the streamed events and the final generation disagree: every token
/// must be streamed exactly once, in order (index `i` at position `i`), with
/// the final id and status; the provisional checks streamed must be the
/// report's spans; the counts and the stop reason must fit the token count.
pub fn stream_faults(events: &[EdgeEvent], g: &EdgeGeneration, max_tokens: usize) -> Vec<String> {
    let mut faults = Vec::new();
    let mut streamed = 0usize;
    let mut checks: Vec<&ProvisionalCheck> = Vec::new();
    for e in events {
        match e {
            EdgeEvent::Token {
                index, id, status, ..
            } => {
                if *index != streamed {
                    faults.push(format!(
                        "token index {index} streamed as token number {streamed} \
                         (duplicated or lost)"
                    ));
                }
                match (g.tokens.get(streamed), g.statuses.get(streamed)) {
                    (Some(t), Some(s)) if t == id && s == status => {}
                    (t, s) => faults.push(format!(
                        "streamed token {streamed} is {id} ({status:?}), the result has {t:?} ({s:?})"
                    )),
                }
                streamed += 1;
            }
            EdgeEvent::ProvisionalChecked(c) => checks.push(c),
        }
    }
    let n = g.tokens.len();
    if streamed != n {
        faults.push(format!("{streamed} tokens streamed, {n} in the result"));
    }
    if g.statuses.len() != n {
        faults.push(format!("{} statuses for {n} tokens", g.statuses.len()));
    }
    if g.stats.generated_tokens != n
        || g.stats.verified_tokens + g.stats.provisional_tokens + g.stats.local_tokens != n
    {
        faults.push(format!(
            "stats count {} generated ({} verified + {} provisional + {} local) for {n} tokens",
            g.stats.generated_tokens,
            g.stats.verified_tokens,
            g.stats.provisional_tokens,
            g.stats.local_tokens
        ));
    }
    if n > max_tokens || (g.stop == StopReason::MaxTokens && n != max_tokens) {
        faults.push(format!(
            "{n} tokens with max_tokens {max_tokens} and stop {:?}",
            g.stop
        ));
    }
    // Streamed checks are the report's spans, except a span still unchecked
    // at the end, which is only in the report.
    let reported: Vec<&ProvisionalCheck> =
        g.provisional.spans.iter().filter(|s| s.checked).collect();
    let streamed_checked: Vec<&ProvisionalCheck> =
        checks.iter().copied().filter(|s| s.checked).collect();
    if reported != streamed_checked {
        faults.push(format!(
            "checked provisional spans streamed {streamed_checked:?}, reported {reported:?}"
        ));
    }
    faults
}

#[cfg(test)]
mod tests {
    use super::*;

    fn generation(tokens: &[u32], statuses: &[TokenStatus]) -> EdgeGeneration {
        let count = |s| statuses.iter().filter(|&&x| x == s).count();
        EdgeGeneration {
            tokens: tokens.to_vec(),
            statuses: statuses.to_vec(),
            stop: StopReason::MaxTokens,
            stats: EdgeStats {
                gen: tandem_model::speculative::GenStats {
                    generated_tokens: tokens.len(),
                    ..tandem_model::speculative::GenStats::default()
                },
                verified_tokens: count(TokenStatus::Verified),
                provisional_tokens: count(TokenStatus::Provisional),
                ..EdgeStats::default()
            },
            provisional: ProvisionalReport::default(),
            session_id: None,
        }
    }

    fn token(index: usize, id: u32, status: TokenStatus) -> EdgeEvent {
        EdgeEvent::Token {
            index,
            id,
            status,
            logprobs: None,
        }
    }

    #[test]
    fn a_faithful_stream_has_no_fault() {
        use TokenStatus::{Provisional as P, Verified as V};
        let mut g = generation(&[7, 8, 9], &[V, P, V]);
        let check = ProvisionalCheck {
            start: 1,
            end: 2,
            mismatches: vec![],
            checked: true,
        };
        g.provisional.spans.push(check.clone());
        let events = [
            token(0, 7, V),
            token(1, 8, P),
            EdgeEvent::ProvisionalChecked(check),
            token(2, 9, V),
        ];
        assert!(stream_faults(&events, &g, 3).is_empty());
    }

    #[test]
    fn duplicated_lost_and_altered_tokens_are_faults() {
        use TokenStatus::Verified as V;
        let g = generation(&[7, 8, 9], &[V, V, V]);
        // Token 1 streamed twice.
        let dup = [
            token(0, 7, V),
            token(1, 8, V),
            token(1, 8, V),
            token(2, 9, V),
        ];
        assert!(!stream_faults(&dup, &g, 3).is_empty());
        // Token 2 never streamed.
        let lost = [token(0, 7, V), token(1, 8, V)];
        assert!(!stream_faults(&lost, &g, 3).is_empty());
        // Token 1 streamed with another id.
        let altered = [token(0, 7, V), token(1, 5, V), token(2, 9, V)];
        assert!(!stream_faults(&altered, &g, 3).is_empty());
        // The stop reason says max_tokens but fewer came.
        let ok = [token(0, 7, V), token(1, 8, V), token(2, 9, V)];
        assert!(!stream_faults(&ok, &g, 4).is_empty());
        assert!(stream_faults(&ok, &g, 3).is_empty());
    }

    #[test]
    fn a_checked_span_missing_from_the_stream_is_a_fault() {
        use TokenStatus::{Provisional as P, Verified as V};
        let mut g = generation(&[7, 8], &[P, V]);
        g.provisional.spans.push(ProvisionalCheck {
            start: 0,
            end: 1,
            mismatches: vec![0],
            checked: true,
        });
        let events = [token(0, 7, P), token(1, 8, V)];
        assert!(!stream_faults(&events, &g, 2).is_empty());
    }
}
