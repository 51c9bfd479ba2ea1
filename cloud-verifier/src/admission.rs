//! Admission control per identity: a token bucket for messages, a token
//! bucket for prefilled tokens (an Open is charged per token it makes the
//! verifier compute, not per message), and the budget of prompt tokens being
//! prefilled at once (globally, waiting for room up to a deadline; and per
//! identity, refused beyond its share). With the scheduler's round-robin of
//! prefill chunks between identities, this bounds how long one identity's
//! flood of long Opens can delay another's.

use crate::error::Refusal;
use crate::lock::lock;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tandem_proto::v1::Reason;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The admission limits (from `[limits]`).
#[derive(Debug, Clone, Copy)]
pub struct AdmissionLimits {
    pub rate_per_sec: f64,
    pub rate_burst: f64,
    pub prefill_tokens_per_sec: f64,
    pub prefill_burst_tokens: f64,
    pub max_inflight_prefill_tokens: usize,
    pub max_inflight_prefill_tokens_per_identity: usize,
    pub prefill_wait: Duration,
}

/// A token bucket: `tokens` as of `at`.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    /// Takes `cost` after refilling at `rate` up to `burst`; false (and
    /// nothing taken) when there is not enough.
    fn take(&mut self, cost: f64, rate: f64, burst: f64, now: Instant) -> bool {
        let refill = now.saturating_duration_since(self.at).as_secs_f64() * rate;
        self.tokens = (self.tokens + refill).min(burst);
        self.at = now;
        if self.tokens < cost {
            return false;
        }
        self.tokens -= cost;
        true
    }
}

#[derive(Default)]
struct PerIdentity {
    messages: Option<Bucket>,
    prefill: Option<Bucket>,
    inflight_prefill: usize,
}

/// Shared admission state of a verifier.
pub struct Admission {
    limits: AdmissionLimits,
    identities: Mutex<HashMap<String, PerIdentity>>,
    inflight: Arc<Semaphore>,
}

impl Admission {
    pub fn new(limits: AdmissionLimits) -> Arc<Self> {
        let permits = limits
            .max_inflight_prefill_tokens
            .min(Semaphore::MAX_PERMITS);
        Arc::new(Self {
            limits,
            identities: Mutex::new(HashMap::new()),
            inflight: Arc::new(Semaphore::new(permits)),
        })
    }

    /// Prompt tokens held in the in-flight prefill budgets: the per-identity
    /// shares plus the global permits taken. 0 whenever no prefill runs (a
    /// larger value with nothing running is a leaked [`PrefillPermit`]).
    pub fn prefill_tokens_in_flight(&self) -> usize {
        let shares: usize = lock(&self.identities)
            .values()
            .map(|e| e.inflight_prefill)
            .fold(0, usize::saturating_add);
        let permits = self
            .limits
            .max_inflight_prefill_tokens
            .min(Semaphore::MAX_PERMITS);
        shares.saturating_add(permits.saturating_sub(self.inflight.available_permits()))
    }

    /// One message from `identity`.
    pub fn message(&self, identity: &str) -> Result<(), Refusal> {
        let l = &self.limits;
        let now = Instant::now();
        let mut m = lock(&self.identities);
        let e = m.entry(identity.to_owned()).or_default();
        let b = e.messages.get_or_insert(Bucket {
            tokens: l.rate_burst,
            at: now,
        });
        if b.take(1.0, l.rate_per_sec, l.rate_burst, now) {
            return Ok(());
        }
        Err(Refusal::new(
            Reason::RateLimited,
            format!(
                "more than {} messages/s (burst {}) from this identity",
                l.rate_per_sec, l.rate_burst
            ),
        ))
    }

    /// Admits a prefill of `tokens` for `identity`: charges its prefill
    /// bucket, takes its share of the in-flight budget, then waits (up to
    /// `prefill_wait`) for room in the global budget. The permit gives the
    /// budget back when dropped.
    pub async fn prefill(
        self: &Arc<Self>,
        identity: &str,
        tokens: usize,
    ) -> Result<PrefillPermit, Refusal> {
        let l = self.limits;
        if tokens == 0 {
            return Ok(PrefillPermit {
                admission: self.clone(),
                identity: identity.to_owned(),
                tokens: 0,
                spent: false,
                _global: None,
            });
        }
        {
            let now = Instant::now();
            let mut m = lock(&self.identities);
            let e = m.entry(identity.to_owned()).or_default();
            let share = e.inflight_prefill.saturating_add(tokens);
            if share > l.max_inflight_prefill_tokens_per_identity {
                return Err(Refusal::new(
                    Reason::QuotaExceeded,
                    format!(
                        "this identity already has {} prompt tokens being prefilled; {} more \
                         would pass its limit of {}",
                        e.inflight_prefill, tokens, l.max_inflight_prefill_tokens_per_identity
                    ),
                ));
            }
            let b = e.prefill.get_or_insert(Bucket {
                tokens: l.prefill_burst_tokens,
                at: now,
            });
            if !b.take(
                tokens as f64,
                l.prefill_tokens_per_sec,
                l.prefill_burst_tokens,
                now,
            ) {
                return Err(Refusal::new(
                    Reason::RateLimited,
                    format!(
                        "{tokens} prompt tokens to prefill pass this identity's rate of {} \
                         tokens/s (burst {})",
                        l.prefill_tokens_per_sec, l.prefill_burst_tokens
                    ),
                ));
            }
            e.inflight_prefill = share;
        }
        // From here the share is taken (and the rate charged): the permit
        // gives the share back on any exit, and the charge too unless the
        // prefill ran ([`PrefillPermit::spent`]).
        let mut permit = PrefillPermit {
            admission: self.clone(),
            identity: identity.to_owned(),
            tokens,
            spent: false,
            _global: None,
        };
        let n = u32::try_from(tokens.min(l.max_inflight_prefill_tokens)).unwrap_or(u32::MAX);
        match tokio::time::timeout(l.prefill_wait, self.inflight.clone().acquire_many_owned(n))
            .await
        {
            Ok(Ok(p)) => {
                permit._global = Some(p);
                Ok(permit)
            }
            Ok(Err(_)) => Err(Refusal::new(Reason::ShuttingDown, "prefill budget closed")),
            Err(_) => Err(Refusal::new(
                Reason::QuotaExceeded,
                format!(
                    "no room in the verifier's prefill budget ({} tokens) within {} s",
                    l.max_inflight_prefill_tokens,
                    l.prefill_wait.as_secs()
                ),
            )),
        }
    }
}

/// A prefill's admission: its share of the in-flight budgets, given back on
/// drop; its charge on the identity's prefill rate is refunded on drop too
/// unless [`PrefillPermit::spent`] said the prefill ran (a refused Open or
/// Resume costs the identity nothing).
pub struct PrefillPermit {
    admission: Arc<Admission>,
    identity: String,
    tokens: usize,
    spent: bool,
    _global: Option<OwnedSemaphorePermit>,
}

impl PrefillPermit {
    /// The prefill ran: its charge stays.
    pub fn spent(&mut self) {
        self.spent = true;
    }
}

impl Drop for PrefillPermit {
    fn drop(&mut self) {
        if self.tokens == 0 {
            return;
        }
        let l = self.admission.limits;
        let mut m = lock(&self.admission.identities);
        if let Some(e) = m.get_mut(&self.identity) {
            e.inflight_prefill = e.inflight_prefill.saturating_sub(self.tokens);
            if !self.spent {
                if let Some(b) = e.prefill.as_mut() {
                    b.tokens = (b.tokens + self.tokens as f64).min(l.prefill_burst_tokens);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> AdmissionLimits {
        AdmissionLimits {
            rate_per_sec: 1.0,
            rate_burst: 2.0,
            prefill_tokens_per_sec: 10.0,
            prefill_burst_tokens: 100.0,
            max_inflight_prefill_tokens: 120,
            max_inflight_prefill_tokens_per_identity: 80,
            prefill_wait: Duration::from_millis(50),
        }
    }

    #[test]
    fn messages_are_limited_per_identity() {
        let a = Admission::new(limits());
        assert!(a.message("x").is_ok());
        assert!(a.message("x").is_ok());
        assert_eq!(a.message("x").unwrap_err().reason, Reason::RateLimited);
        assert!(
            a.message("y").is_ok(),
            "another identity has its own bucket"
        );
    }

    #[tokio::test]
    async fn prefill_is_charged_per_token_and_shares_are_bounded() {
        let a = Admission::new(limits());
        let p1 = a.prefill("x", 60).await.unwrap();
        // x's share is 80: 60 in flight + 30 is refused without waiting.
        let e = a.prefill("x", 30).await.err().unwrap();
        assert_eq!(e.reason, Reason::QuotaExceeded);
        // y fits the global budget beside x (60 + 50 <= 120) ...
        let p2 = a.prefill("y", 50).await.unwrap();
        // ... and z waits for room, which does not come in time.
        let e = a.prefill("z", 20).await.err().unwrap();
        assert_eq!(e.reason, Reason::QuotaExceeded);
        drop(p1);
        drop(p2);
        // p1 never ran its prefill: x's charge came back, and the refused
        // asks cost nothing. A spent one stays charged: x's bucket then holds
        // 100 - 60 = 40 tokens (plus a little refill).
        let mut p = a.prefill("x", 60).await.unwrap();
        p.spent();
        drop(p);
        let e = a.prefill("x", 80).await.err().unwrap();
        assert_eq!(e.reason, Reason::RateLimited);
        assert!(a.prefill("x", 30).await.is_ok());
    }

    #[tokio::test]
    async fn a_refused_prefill_is_refunded() {
        let a = Admission::new(limits());
        // Twice the burst in refused prefills: none of them costs anything.
        for _ in 0..4 {
            let hold = a.prefill("y", 70).await.unwrap();
            // z's 60 is charged, then times out waiting for the global budget.
            let e = a.prefill("z", 60).await.err().unwrap();
            assert_eq!(e.reason, Reason::QuotaExceeded);
            drop(hold);
        }
        // z's bucket is still (almost) full: a burst-sized prefill passes.
        let mut p = a.prefill("z", 80).await.unwrap();
        p.spent();
    }
}
