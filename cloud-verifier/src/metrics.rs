//! Prometheus text exposition of the verifier's counters (hand-written, no registry).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds (seconds) of the verify latency histogram buckets.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Upper bounds of the rows-per-forward histogram buckets.
const ROW_BUCKETS: [f64; 9] = [1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 48.0, 64.0];
/// Upper bounds (seconds) of the queue-wait histogram buckets.
const WAIT_BUCKETS: [f64; 10] = [0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0];

/// A Prometheus histogram with fixed buckets.
#[derive(Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        for (c, b) in self.counts.iter_mut().zip(self.bounds) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, o: &mut String, name: &str, help: &str) {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(o, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(
            o,
            "{name}_bucket{{le=\"+Inf\"}} {c}\n{name}_sum {}\n{name}_count {c}",
            self.sum,
            c = self.count
        );
    }
}

/// What the store and the KV pool say at render time.
#[derive(Debug, Default, Clone)]
pub struct Gauges {
    pub sessions: usize,
    pub bytes: u64,
    pub evictions: u64,
    pub pages_used: usize,
    pub pages_free: usize,
    pub page_bytes: usize,
    /// Sessions per identity (identities are the configured devices).
    pub per_identity: Vec<(String, usize)>,
}

struct Inner {
    batch_rows: Histogram,
    queue_wait: Histogram,
    prefill_tokens: u64,
    forwards: u64,
    latency_counts: [u64; BUCKETS.len()],
    latency_sum: f64,
    latency_count: u64,
    drafted: u64,
    accepted: u64,
    emitted: u64,
    sessions_opened: u64,
    errors: BTreeMap<&'static str, u64>,
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            batch_rows: Histogram::new(&ROW_BUCKETS),
            queue_wait: Histogram::new(&WAIT_BUCKETS),
            prefill_tokens: 0,
            forwards: 0,
            latency_counts: [0; BUCKETS.len()],
            latency_sum: 0.0,
            latency_count: 0,
            drafted: 0,
            accepted: 0,
            emitted: 0,
            sessions_opened: 0,
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

    /// Counts a refusal by its reason name.
    pub fn error(&self, reason: &'static str) {
        self.with(|m| *m.errors.entry(reason).or_default() += 1);
    }

    /// The exposition text; the gauges come from the store and the KV pool.
    pub fn render(&self, g: &Gauges) -> String {
        let (sessions, bytes, evictions) = (g.sessions, g.bytes, g.evictions);
        self.with(|m| {
            let mut o = String::new();
            m.batch_rows.render(&mut o, "tandem_verifier_batch_rows", "Rows (tokens) per forward of the scheduler.");
            m.queue_wait.render(&mut o, "tandem_verifier_queue_wait_seconds", "Time a job waited in the scheduler's queue for its first rows.");
            let _ = writeln!(o, "# HELP tandem_verifier_forwards_total Forwards run by the scheduler.\n# TYPE tandem_verifier_forwards_total counter\ntandem_verifier_forwards_total {}", m.forwards);
            let _ = writeln!(o, "# HELP tandem_verifier_prefill_tokens_total Prompt rows prefilled.\n# TYPE tandem_verifier_prefill_tokens_total counter\ntandem_verifier_prefill_tokens_total {}", m.prefill_tokens);
            let _ = writeln!(o, "# HELP tandem_verifier_kv_pages_used KV pages held by sessions.\n# TYPE tandem_verifier_kv_pages_used gauge\ntandem_verifier_kv_pages_used {}", g.pages_used);
            let _ = writeln!(o, "# HELP tandem_verifier_kv_pages_free KV pages left in the pool.\n# TYPE tandem_verifier_kv_pages_free gauge\ntandem_verifier_kv_pages_free {}", g.pages_free);
            let _ = writeln!(o, "# HELP tandem_verifier_kv_page_bytes Bytes of one KV page.\n# TYPE tandem_verifier_kv_page_bytes gauge\ntandem_verifier_kv_page_bytes {}", g.page_bytes);
            let _ = writeln!(o, "# HELP tandem_verifier_identity_sessions Sessions held per device identity.\n# TYPE tandem_verifier_identity_sessions gauge");
            for (id, n) in &g.per_identity {
                let _ = writeln!(o, "tandem_verifier_identity_sessions{{identity=\"{}\"}} {n}", label_value(id));
            }
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

/// A Prometheus label value: backslash, quote and newline escaped.
fn label_value(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
