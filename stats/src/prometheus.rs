//! Prometheus text exposition, hand-written (no registry): the histogram and
//! the helpers the verifier's `/metrics` and serve-edge's `/metrics` render
//! with.

use std::fmt::Write;

/// A Prometheus histogram with fixed buckets (cumulative counts per upper
/// bound, plus `+Inf`, sum and count).
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram over the upper bounds `bounds` (ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one observation.
    pub fn observe(&mut self, v: f64) {
        for (c, b) in self.counts.iter_mut().zip(self.bounds) {
            if v <= *b {
                *c = c.saturating_add(1);
            }
        }
        self.sum += v;
        self.count = self.count.saturating_add(1);
    }

    /// Observations recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Appends the histogram's HELP, TYPE, bucket, sum and count lines.
    pub fn render(&self, o: &mut String, name: &str, help: &str) {
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

/// Appends one unlabelled metric: its HELP and TYPE lines and its value.
pub fn scalar(o: &mut String, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
    let _ = writeln!(
        o,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
    );
}

/// A Prometheus label value: backslash, quote and newline escaped.
pub fn label_value(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_renders_cumulative_buckets() {
        let mut h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.5, 3.0] {
            h.observe(v);
        }
        let mut o = String::new();
        h.render(&mut o, "x", "An x.");
        assert_eq!(
            o,
            "# HELP x An x.\n# TYPE x histogram\nx_bucket{le=\"1\"} 1\nx_bucket{le=\"2\"} 2\n\
             x_bucket{le=\"+Inf\"} 3\nx_sum 5\nx_count 3\n"
        );
        assert_eq!(label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
