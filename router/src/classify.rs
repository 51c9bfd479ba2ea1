//! The classifier: runs every recognizer and the category lexicon over a text
//! and applies the allow-list. Thresholds and overlap resolution belong to the
//! policy (see [`crate::Policy::classify`]), because they are operator choices.

use std::collections::HashSet;
use std::sync::OnceLock;

use regex::Regex;

use crate::lexicon::Lexicon;
use crate::recognizers::{floor_boundary, DigitStats, Pattern, WordSet};
use crate::types::{CategoryHit, EntityHit, EntityKind};

/// Bytes between a phone number and a postal address for the two to count
/// as one contact record.
const ADDRESS_NEAR: usize = 24;

/// Raw classifier output: every candidate with its score, and every lexicon hit.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Classification {
    pub entities: Vec<EntityHit>,
    pub categories: Vec<CategoryHit>,
}

/// Recognizers + lexicon + allow-list, compiled once per policy.
pub struct Classifier {
    pub(crate) patterns: Vec<Pattern>,
    pub(crate) lexicon: Lexicon,
    /// Allowed values, compacted to upper-case ASCII alphanumerics.
    pub(crate) allow_values: HashSet<String>,
    pub(crate) allow_patterns: Vec<Regex>,
}

impl std::fmt::Debug for Classifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Classifier")
            .field("recognizers", &self.patterns.len())
            .field("lexicon", &self.lexicon)
            .field("allow_values", &self.allow_values.len())
            .field("allow_patterns", &self.allow_patterns.len())
            .finish()
    }
}

/// Well-known published example values (standard and specification
/// examples, vendors' test values; `data/published_examples.txt`, one value
/// and its source per line): allowed under every policy.
const PUBLISHED_EXAMPLES: &str = include_str!("../data/published_examples.txt");

/// The published example values allowed wherever they appear, compacted
/// like the policy's allow-list.
pub(crate) fn published_examples() -> impl Iterator<Item = String> {
    published(false)
}

/// Published values (`~` lines) allowed only when the text marks them as
/// examples.
fn published_marked_examples() -> &'static HashSet<String> {
    static SET: OnceLock<HashSet<String>> = OnceLock::new();
    SET.get_or_init(|| published(true).collect())
}

fn published(marked: bool) -> impl Iterator<Item = String> {
    PUBLISHED_EXAMPLES
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|v| !v.is_empty())
        .filter_map(move |v| match v.strip_prefix('~') {
            Some(rest) if marked => Some(rest.trim()),
            None if !marked => Some(v),
            _ => None,
        })
        .map(compact_value)
}

/// Words that mark a value as an example from a standard, a tutorial or
/// documentation.
const EXAMPLE_MARKERS: &[&str] = &[
    "example",
    "examples",
    "sample",
    "tutorial",
    "tutorials",
    "docs",
    "documentation",
    "registry",
    "standard",
    "specification",
    "test",
    "ejemplo",
    "tutoriales",
    "documentación",
    "beispiel",
    "beispiel-iban",
    "doku",
    "dokumentation",
    "exemple",
    "d'exemple",
    "示例",
    "例子",
    "样例",
    "测试",
    "サンプル",
    "例",
    "예시",
    "예제",
];

/// Bytes around a `~` published value searched for an example marker.
const EXAMPLE_MARKER_WINDOW: usize = 64;

/// Normal form for allow-list comparison: separators and case do not matter.
pub(crate) fn compact_value(s: &str) -> String {
    s.chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_uppercase())
        .collect::<String>()
        + &s.chars().filter(|c| !c.is_ascii()).collect::<String>()
}

impl Classifier {
    /// Run all recognizers and the lexicon over `text`.
    pub fn classify(&self, text: &str) -> Classification {
        let mut raw = Vec::new();
        let stats = DigitStats::of(text);
        for p in self.patterns.iter().filter(|p| p.may_match(&stats)) {
            p.scan_with(text, &stats, &mut raw);
        }
        let mut categories = self.lexicon.scan(text);
        let addresses = crate::lexicon::address_hits(text);
        let entities = raw
            .into_iter()
            .filter(|(_, s, e, _)| !self.allowed(&text[*s..*e]) && !marked_example(text, *s, *e))
            .map(|(kind, start, end, score)| {
                // A phone number right next to a postal address is a contact
                // record (a shipping label), whatever the words around it.
                let score = if kind == EntityKind::Phone
                    && addresses
                        .iter()
                        .any(|a| a.start < end + ADDRESS_NEAR && start < a.end + ADDRESS_NEAR)
                {
                    ((score + 0.3).min(1.0) * 100.0).round() / 100.0
                } else {
                    score
                };
                EntityHit {
                    kind,
                    start,
                    end,
                    score,
                }
            })
            .collect();
        categories.extend(addresses);
        categories.sort_by_key(|h| (h.start, h.end));
        Classification {
            entities,
            categories,
        }
    }

    fn allowed(&self, value: &str) -> bool {
        (!self.allow_values.is_empty() && self.allow_values.contains(&compact_value(value)))
            || self.allow_patterns.iter().any(|r| r.is_match(value))
    }
}

/// A `~` published example value with an example marker near it.
fn marked_example(text: &str, start: usize, end: usize) -> bool {
    static MARKERS: OnceLock<WordSet> = OnceLock::new();
    if !published_marked_examples().contains(&compact_value(&text[start..end])) {
        return false;
    }
    let markers = MARKERS.get_or_init(|| WordSet::new(EXAMPLE_MARKERS));
    let from = floor_boundary(text, start.saturating_sub(EXAMPLE_MARKER_WINDOW));
    let to = floor_boundary(text, end.saturating_add(EXAMPLE_MARKER_WINDOW));
    markers.any_in(&text[from..start]) || markers.any_in(&text[end..to])
}

/// Keep the best of overlapping hits: highest score first, then the longer
/// span. Returns hits sorted by start offset.
pub(crate) fn resolve_overlaps(mut hits: Vec<EntityHit>) -> Vec<EntityHit> {
    hits.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then((b.end - b.start).cmp(&(a.end - a.start)))
            .then(a.start.cmp(&b.start))
    });
    let mut kept: Vec<EntityHit> = Vec::with_capacity(hits.len());
    for h in hits {
        if kept.iter().all(|k| h.end <= k.start || h.start >= k.end) {
            kept.push(h);
        }
    }
    kept.sort_by_key(|h| (h.start, h.end));
    kept
}
