//! Prometheus text exposition of the verifier's counters (hand-written, no registry).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;
use tandem_stats::prometheus::{label_value, scalar, Histogram};

/// Upper bounds (seconds) of the verify latency histogram buckets.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Upper bounds of the rows-per-forward histogram buckets.
const ROW_BUCKETS: [f64; 9] = [1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 48.0, 64.0];
/// Upper bounds (seconds) of the queue-wait histogram buckets.
const WAIT_BUCKETS: [f64; 10] = [0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0];

/// What the store and the KV pool say at render time.
#[derive(Debug, Default, Clone)]
pub struct Gauges {
    pub sessions: usize,
    pub bytes: u64,
    pub evictions: u64,
    pub pages_used: usize,
    pub pages_free: usize,
    /// Page buffers allocated (held or on the pool's free list).
    pub pages_allocated: usize,
    pub page_bytes: usize,
    /// Sessions per identity (identities are the configured devices).
    pub per_identity: Vec<(String, usize)>,
}

struct Inner {
    batch_rows: Histogram,
    queue_wait: Histogram,
    prefill_tokens: u64,
    reused_tokens: u64,
    forwards: u64,
    verify_latency: Histogram,
    drafted: u64,
    accepted: u64,
    emitted: u64,
    sessions_opened: u64,
    sessions_kept: u64,
    abandoned: u64,
    /// Indexed by [`ContinuationOutcome`].
    continuations: [u64; 3],
    errors: BTreeMap<&'static str, u64>,
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            batch_rows: Histogram::new(&ROW_BUCKETS),
            queue_wait: Histogram::new(&WAIT_BUCKETS),
            prefill_tokens: 0,
            reused_tokens: 0,
            forwards: 0,
            verify_latency: Histogram::new(&BUCKETS),
            drafted: 0,
            accepted: 0,
            emitted: 0,
            sessions_opened: 0,
            sessions_kept: 0,
            abandoned: 0,
            continuations: [0; 3],
            errors: BTreeMap::new(),
        }
    }
}

/// The verifier's metrics.
#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        f(&mut crate::lock::lock(&self.inner))
    }

    /// Records one verify: its latency, the block size and accepted count.
    pub fn verify(&self, latency: Duration, k: usize, accepted: usize) {
        self.with(|m| {
            m.verify_latency.observe(latency.as_secs_f64());
            m.drafted += k as u64;
            m.accepted += accepted as u64;
            m.emitted += accepted as u64 + 1;
        });
    }

    /// Records one forward of the scheduler: its rows, of which `prefill` were
    /// prompt rows.
    pub fn batch(&self, rows: usize, prefill: usize) {
        self.with(|m| {
            m.batch_rows.observe(rows as f64);
            m.prefill_tokens = m.prefill_tokens.saturating_add(prefill as u64);
            m.forwards += 1;
        });
    }

    /// Records how long a job waited in the scheduler's queue for its first rows.
    pub fn queue_wait(&self, wait: Duration) {
        self.with(|m| m.queue_wait.observe(wait.as_secs_f64()));
    }

    pub fn session_opened(&self) {
        self.with(|m| m.sessions_opened += 1);
    }

    /// Records positions whose KV a resume or a continuation reused instead of
    /// prefilling them again.
    pub fn reused(&self, positions: usize) {
        self.with(|m| m.reused_tokens = m.reused_tokens.saturating_add(positions as u64));
    }

    /// Counts a session kept by `Close { keep: true }`.
    pub fn session_kept(&self) {
        self.with(|m| m.sessions_kept += 1);
    }

    /// Counts jobs the scheduler dropped unrun because their handler went away.
    pub fn abandoned(&self, jobs: usize) {
        self.with(|m| m.abandoned = m.abandoned.saturating_add(jobs as u64));
    }

    /// Counts an Open with a continuation by its outcome.
    pub fn continuation(&self, outcome: ContinuationOutcome) {
        self.with(|m| m.continuations[outcome as usize] += 1);
    }

    /// Counts a refusal by its reason name.
    pub fn error(&self, reason: &'static str) {
        self.with(|m| *m.errors.entry(reason).or_default() += 1);
    }

    /// The exposition text; the gauges come from the store and the KV pool.
    pub fn render(&self, g: &Gauges) -> String {
        self.with(|m| {
            let mut o = String::new();
            let o = &mut o;
            scalar(o, "tandem_verifier_sessions", "gauge", "Sessions held in the store.", g.sessions);
            scalar(o, "tandem_verifier_session_bytes", "gauge", "Bytes of KV cache held by sessions.", g.bytes);
            scalar(o, "tandem_verifier_sessions_opened_total", "counter", "Sessions opened.", m.sessions_opened);
            scalar(o, "tandem_verifier_evictions_total", "counter", "Sessions evicted (budget, cap or TTL).", g.evictions);
            scalar(o, "tandem_verifier_sessions_kept_total", "counter", "Sessions kept after Close for the next turn of a conversation.", m.sessions_kept);
            let _ = writeln!(o, "# HELP tandem_verifier_continuations_total Opens continuing a kept session, by outcome.\n# TYPE tandem_verifier_continuations_total counter");
            for (c, n) in ContinuationOutcome::ALL.iter().zip(m.continuations) {
                let _ = writeln!(o, "tandem_verifier_continuations_total{{outcome=\"{}\"}} {n}", c.label());
            }
            m.verify_latency.render(o, "tandem_verifier_verify_seconds", "Verify latency (queue wait + forward pass + verdict).");
            scalar(o, "tandem_verifier_drafted_tokens_total", "counter", "Draft tokens received.", m.drafted);
            scalar(o, "tandem_verifier_accepted_tokens_total", "counter", "Draft tokens accepted.", m.accepted);
            scalar(o, "tandem_verifier_emitted_tokens_total", "counter", "Tokens emitted (accepted + next token).", m.emitted);
            let rate = if m.drafted == 0 {
                0.0
            } else {
                m.accepted as f64 / m.drafted as f64
            };
            scalar(o, "tandem_verifier_acceptance_rate", "gauge", "Accepted / drafted tokens since start.", rate);
            let _ = writeln!(o, "# HELP tandem_verifier_errors_total Refusals by reason.\n# TYPE tandem_verifier_errors_total counter");
            for (r, n) in &m.errors {
                let _ = writeln!(o, "tandem_verifier_errors_total{{reason=\"{r}\"}} {n}");
            }
            m.batch_rows.render(o, "tandem_verifier_batch_rows", "Rows (tokens) per forward of the scheduler.");
            m.queue_wait.render(o, "tandem_verifier_queue_wait_seconds", "Time a job waited in the scheduler's queue for its first rows.");
            scalar(o, "tandem_verifier_forwards_total", "counter", "Forwards run by the scheduler.", m.forwards);
            scalar(o, "tandem_verifier_prefill_tokens_total", "counter", "Prompt rows prefilled.", m.prefill_tokens);
            scalar(o, "tandem_verifier_abandoned_jobs_total", "counter", "Jobs dropped unrun because their stream ended first (e.g. an Open the device gave up on).", m.abandoned);
            scalar(o, "tandem_verifier_reused_tokens_total", "counter", "Context positions whose KV a resume or continuation reused (not prefilled again).", m.reused_tokens);
            scalar(o, "tandem_verifier_kv_pages_used", "gauge", "KV pages held by sessions.", g.pages_used);
            scalar(o, "tandem_verifier_kv_pages_free", "gauge", "KV pages left in the pool.", g.pages_free);
            scalar(o, "tandem_verifier_kv_page_bytes", "gauge", "Bytes of one KV page.", g.page_bytes);
            scalar(o, "tandem_verifier_kv_pages_allocated", "gauge", "KV page buffers allocated (held, or free in the pool for reuse): resident KV memory in pages.", g.pages_allocated);
            if let Some(h) = crate::heap::heap_stats() {
                scalar(o, "tandem_verifier_heap_in_use_bytes", "gauge", "Bytes the allocator has handed out and not had back (glibc mallinfo2: arenas plus mapped blocks); includes the KV pool's page buffers.", h.in_use);
                scalar(o, "tandem_verifier_heap_free_bytes", "gauge", "Free bytes the allocator's arenas hold and have not returned to the system.", h.free_held);
            }
            let _ = writeln!(o, "# HELP tandem_verifier_identity_sessions Sessions held per device identity.\n# TYPE tandem_verifier_identity_sessions gauge");
            for (id, n) in &g.per_identity {
                let _ = writeln!(o, "tandem_verifier_identity_sessions{{identity=\"{}\"}} {n}", label_value(id));
            }
            std::mem::take(o)
        })
    }
}

/// How an Open with a continuation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContinuationOutcome {
    /// The kept session was continued: only the new tokens were prefilled.
    Continued = 0,
    /// `CONTEXT_NOT_HELD`: the device opens again with the whole context.
    NotHeld,
    /// Any other refusal (forbidden, too long, quota, ...).
    Refused,
}

impl ContinuationOutcome {
    const ALL: [Self; 3] = [Self::Continued, Self::NotHeld, Self::Refused];

    fn label(self) -> &'static str {
        match self {
            Self::Continued => "continued",
            Self::NotHeld => "not_held",
            Self::Refused => "refused",
        }
    }
}
