//! Prometheus text exposition of the verifier's counters (hand-written, no registry).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds (seconds) of the verify latency histogram buckets.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

#[derive(Default)]
struct Inner {
    latency_counts: [u64; BUCKETS.len()],
    latency_sum: f64,
    latency_count: u64,
    drafted: u64,
    accepted: u64,
    emitted: u64,
    sessions_opened: u64,
    errors: BTreeMap<&'static str, u64>,
}

/// The verifier's metrics.
#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let mut g = match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        f(&mut g)
    }

    /// Records one verify: its latency, the block size and accepted count.
    pub fn verify(&self, latency: Duration, k: usize, accepted: usize) {
        let s = latency.as_secs_f64();
        self.with(|m| {
            for (i, b) in BUCKETS.iter().enumerate() {
                if s <= *b {
                    m.latency_counts[i] += 1;
                }
            }
            m.latency_sum += s;
            m.latency_count += 1;
            m.drafted += k as u64;
            m.accepted += accepted as u64;
            m.emitted += accepted as u64 + 1;
        });
    }

    pub fn session_opened(&self) {
        self.with(|m| m.sessions_opened += 1);
    }

    /// Counts a refusal by its reason name.
    pub fn error(&self, reason: &'static str) {
        self.with(|m| *m.errors.entry(reason).or_default() += 1);
    }

    /// The exposition text; `sessions`, `bytes` and `evictions` come from the store.
    pub fn render(&self, sessions: usize, bytes: u64, evictions: u64) -> String {
        self.with(|m| {
            let mut o = String::new();
            let mut w = |s: String| o.push_str(&s);
            w(format!("# HELP tandem_verifier_sessions Sessions held in the store.\n# TYPE tandem_verifier_sessions gauge\ntandem_verifier_sessions {sessions}\n"));
            w(format!("# HELP tandem_verifier_session_bytes Bytes of KV cache held by sessions.\n# TYPE tandem_verifier_session_bytes gauge\ntandem_verifier_session_bytes {bytes}\n"));
            w(format!("# HELP tandem_verifier_sessions_opened_total Sessions opened.\n# TYPE tandem_verifier_sessions_opened_total counter\ntandem_verifier_sessions_opened_total {}\n", m.sessions_opened));
            w(format!("# HELP tandem_verifier_evictions_total Sessions evicted (budget, cap or TTL).\n# TYPE tandem_verifier_evictions_total counter\ntandem_verifier_evictions_total {evictions}\n"));
            w("# HELP tandem_verifier_verify_seconds Verify latency (forward pass + verdict).\n# TYPE tandem_verifier_verify_seconds histogram\n".into());
            for (i, b) in BUCKETS.iter().enumerate() {
                w(format!(
                    "tandem_verifier_verify_seconds_bucket{{le=\"{b}\"}} {}\n",
                    m.latency_counts[i]
                ));
            }
            w(format!(
                "tandem_verifier_verify_seconds_bucket{{le=\"+Inf\"}} {c}\ntandem_verifier_verify_seconds_sum {}\ntandem_verifier_verify_seconds_count {c}\n",
                m.latency_sum,
                c = m.latency_count
            ));
            w(format!("# HELP tandem_verifier_drafted_tokens_total Draft tokens received.\n# TYPE tandem_verifier_drafted_tokens_total counter\ntandem_verifier_drafted_tokens_total {}\n", m.drafted));
            w(format!("# HELP tandem_verifier_accepted_tokens_total Draft tokens accepted.\n# TYPE tandem_verifier_accepted_tokens_total counter\ntandem_verifier_accepted_tokens_total {}\n", m.accepted));
            w(format!("# HELP tandem_verifier_emitted_tokens_total Tokens emitted (accepted + next token).\n# TYPE tandem_verifier_emitted_tokens_total counter\ntandem_verifier_emitted_tokens_total {}\n", m.emitted));
            let rate = if m.drafted == 0 {
                0.0
            } else {
                m.accepted as f64 / m.drafted as f64
            };
            w(format!("# HELP tandem_verifier_acceptance_rate Accepted / drafted tokens since start.\n# TYPE tandem_verifier_acceptance_rate gauge\ntandem_verifier_acceptance_rate {rate}\n"));
            w("# HELP tandem_verifier_errors_total Refusals by reason.\n# TYPE tandem_verifier_errors_total counter\n".into());
            for (r, n) in &m.errors {
                let _ = writeln!(o, "tandem_verifier_errors_total{{reason=\"{r}\"}} {n}");
            }
            o
        })
    }
}
