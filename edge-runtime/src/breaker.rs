//! The circuit breaker and the RTT tracker that sets per-verify deadlines.
//!
//! Breaker: `Closed` (verify normally) → `Open` after `threshold` consecutive
//! failures (the device drafts alone) → `HalfOpen` when the background health probe
//! sees the verifier serving (the next request is a trial) → `Closed` on success,
//! back to `Open` on failure.

use std::collections::VecDeque;
use std::time::Duration;
use tandem_stats::percentile_in_place;

/// State of a [`CircuitBreaker`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

/// Counts consecutive failures and decides whether the verifier may be used.
#[derive(Clone, Debug)]
pub struct CircuitBreaker {
    state: BreakerState,
    consecutive_failures: u32,
    threshold: u32,
    opens: u64,
}

impl CircuitBreaker {
    pub fn new(threshold: u32) -> Self {
        Self {
            state: BreakerState::Closed,
            consecutive_failures: 0,
            threshold: threshold.max(1),
            opens: 0,
        }
    }

    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// Consecutive failures since the last success.
    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures
    }

    /// How many times the breaker has opened.
    pub fn opens(&self) -> u64 {
        self.opens
    }

    /// May a request go to the verifier now?
    pub fn allows_request(&self) -> bool {
        self.state != BreakerState::Open
    }

    pub fn on_success(&mut self) {
        self.state = BreakerState::Closed;
        self.consecutive_failures = 0;
    }

    /// Records a failure; returns true when this failure opened the breaker.
    pub fn on_failure(&mut self) -> bool {
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        let open = match self.state {
            BreakerState::HalfOpen => true,
            BreakerState::Closed => self.consecutive_failures >= self.threshold,
            BreakerState::Open => false,
        };
        if open {
            self.state = BreakerState::Open;
            self.opens += 1;
        }
        open
    }

    /// The health probe saw the verifier serving.
    pub fn probe_succeeded(&mut self) {
        if self.state == BreakerState::Open {
            self.state = BreakerState::HalfOpen;
        }
    }
}

/// The last RTT samples of verify round trips, each with the work it carried:
/// the number of positions the verifier's forward covered. Deadlines scale with
/// that work, so a 16-token check of provisional text after an outage is not
/// held to a deadline measured on 5-token verifies (it was, and a healthy
/// verifier was declared dead again and again: docs/edge.md "Deadlines").
#[derive(Clone, Debug, Default)]
pub struct RttTracker {
    samples: VecDeque<RttSample>,
}

#[derive(Clone, Copy, Debug)]
struct RttSample {
    ms: f64,
    positions: usize,
}

/// How many recent samples the tracker keeps.
pub const RTT_WINDOW: usize = 64;

impl RttTracker {
    /// One round trip whose verifier forward covered `positions` tokens.
    pub fn record(&mut self, rtt: Duration, positions: usize) {
        if self.samples.len() == RTT_WINDOW {
            self.samples.pop_front();
        }
        self.samples.push_back(RttSample {
            ms: rtt.as_secs_f64() * 1000.0,
            positions: positions.max(1),
        });
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    pub fn mean_ms(&self) -> Option<f64> {
        if self.samples.is_empty() {
            return None;
        }
        Some(self.samples.iter().map(|s| s.ms).sum::<f64>() / self.samples.len() as f64)
    }

    /// 95th percentile (nearest rank: [`tandem_stats::percentile`]) of the round
    /// trips as measured.
    pub fn p95_ms(&self) -> Option<f64> {
        let mut ms: Vec<f64> = self.samples.iter().map(|s| s.ms).collect();
        percentile_in_place(&mut ms, 0.95)
    }

    /// Deadline of the next exchange, whose verifier forward covers `positions`
    /// tokens: `initial` with no samples, else clamp(p95 × factor, floor, max)
    /// where each sample that carried fewer positions is first scaled up in
    /// proportion (network time too: errs long, never short).
    pub fn deadline(
        &self,
        positions: usize,
        initial: Duration,
        floor: Duration,
        factor: f64,
        max: Duration,
    ) -> Duration {
        let want = positions.max(1) as f64;
        let mut scaled: Vec<f64> = self
            .samples
            .iter()
            .map(|s| s.ms * (want / s.positions as f64).max(1.0))
            .collect();
        match percentile_in_place(&mut scaled, 0.95) {
            None => initial,
            Some(p95) => Duration::from_secs_f64(p95 * factor / 1000.0).clamp(floor, max),
        }
    }
}

/// The measured cost of opening a session: the time from the response headers to
/// `Opened` (the verifier's prefill plus about a round trip) per context token,
/// over the last few opens. Sets the deadline of a re-open, so that it scales
/// with the context instead of waiting for the whole `open_timeout_ms`.
#[derive(Clone, Debug, Default)]
pub struct OpenCost {
    ms_per_token: VecDeque<f64>,
}

/// How many recent opens [`OpenCost`] keeps.
pub const OPEN_COST_WINDOW: usize = 8;

impl OpenCost {
    /// One open of `context_len` tokens whose `Opened` came `after_headers` after
    /// the response headers.
    pub fn record(&mut self, context_len: usize, after_headers: Duration) {
        if context_len == 0 {
            return;
        }
        if self.ms_per_token.len() == OPEN_COST_WINDOW {
            self.ms_per_token.pop_front();
        }
        self.ms_per_token
            .push_back(after_headers.as_secs_f64() * 1000.0 / context_len as f64);
    }

    /// Expected headers-to-`Opened` time for a context of `context_len` tokens:
    /// the dearest recent open per token, times the context (a fixed part of the
    /// prefill is scaled too: errs long). None before any open was measured.
    pub fn estimate(&self, context_len: usize) -> Option<Duration> {
        let worst = self.ms_per_token.iter().copied().reduce(f64::max)?;
        Some(Duration::from_secs_f64(
            worst * context_len.max(1) as f64 / 1000.0,
        ))
    }
}

/// Locks a shared breaker. A panic while holding this lock cannot leave the
/// breaker inconsistent (every method completes its update), so a poisoned
/// lock is taken as it is.
pub(crate) fn lock(
    b: &std::sync::Mutex<CircuitBreaker>,
) -> std::sync::MutexGuard<'_, CircuitBreaker> {
    b.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breaker_opens_after_threshold_and_recovers_through_half_open() {
        let mut b = CircuitBreaker::new(3);
        assert!(!b.on_failure());
        assert!(!b.on_failure());
        assert!(b.allows_request());
        assert!(b.on_failure());
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.allows_request());
        b.probe_succeeded();
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(b.allows_request());
        // A failed trial re-opens at once.
        assert!(b.on_failure());
        assert_eq!(b.opens(), 2);
        b.probe_succeeded();
        b.on_success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(b.consecutive_failures(), 0);
    }

    #[test]
    fn success_resets_the_failure_count() {
        let mut b = CircuitBreaker::new(2);
        b.on_failure();
        b.on_success();
        assert!(!b.on_failure());
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn deadline_follows_p95_within_bounds() {
        let mut t = RttTracker::default();
        let (init, floor, max) = (
            Duration::from_millis(5000),
            Duration::from_millis(100),
            Duration::from_millis(2000),
        );
        assert_eq!(t.deadline(5, init, floor, 3.0, max), init);
        for i in 1..=100u64 {
            t.record(Duration::from_millis(i), 5);
        }
        // Window keeps 37..=100 (64 samples); nearest rank ceil(0.95 × 64) = 61 -> 97.
        assert_eq!(t.len(), RTT_WINDOW);
        assert_eq!(t.p95_ms(), Some(97.0));
        assert_eq!(
            t.deadline(5, init, floor, 3.0, max),
            Duration::from_millis(291)
        );
        // Less work than measured: not shortened.
        assert_eq!(
            t.deadline(1, init, floor, 3.0, max),
            Duration::from_millis(291)
        );
        assert_eq!(t.deadline(5, init, floor, 100.0, max), max);
        let mut small = RttTracker::default();
        small.record(Duration::from_millis(1), 5);
        assert_eq!(small.deadline(5, init, floor, 3.0, max), floor);
    }

    #[test]
    fn deadline_scales_with_the_positions_an_exchange_carries() {
        let (init, floor, max) = (
            Duration::from_millis(5000),
            Duration::from_millis(100),
            Duration::from_millis(20_000),
        );
        let ms = |ms: u64| Duration::from_millis(ms);
        let tracker = |rtt_ms: u64, positions: usize| {
            let mut t = RttTracker::default();
            for _ in 0..10 {
                t.record(ms(rtt_ms), positions);
            }
            t
        };
        // A 17-position check: each 5-position sample scaled by 17/5.
        let t = tracker(200, 5);
        assert_eq!(t.deadline(17, init, floor, 3.0, max), ms(2040));
        // Samples that already carried 17 positions are taken as they are.
        let t = tracker(300, 17);
        assert_eq!(t.deadline(17, init, floor, 3.0, max), ms(900));
        assert_eq!(t.deadline(5, init, floor, 3.0, max), ms(900));
        // The cap still holds.
        assert_eq!(t.deadline(500, init, floor, 3.0, max), max);
    }

    #[test]
    fn open_cost_scales_the_dearest_recent_open_with_the_context() {
        let mut c = OpenCost::default();
        assert_eq!(c.estimate(100), None);
        c.record(50, Duration::from_millis(1000)); // 20 ms per token
        c.record(100, Duration::from_millis(1000)); // 10 ms per token
        assert_eq!(c.estimate(200), Some(Duration::from_millis(4000)));
        // Only the last OPEN_COST_WINDOW opens count.
        for _ in 0..OPEN_COST_WINDOW {
            c.record(100, Duration::from_millis(500));
        }
        assert_eq!(c.estimate(200), Some(Duration::from_millis(1000)));
        c.record(0, Duration::from_secs(9));
        assert_eq!(c.estimate(200), Some(Duration::from_millis(1000)));
    }
}
