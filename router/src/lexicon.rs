//! Category lexicons: lists of terms (Chinese and English) per sensitive
//! category, matched in one Aho-Corasick pass.
//!
//! The built-in lists live in `router/data/lexicons/<category>.txt`, one term
//! per line, `#` for comments. ASCII terms match case-insensitively and only on
//! word boundaries ("hiv" does not fire inside "archive"); other terms (Chinese)
//! match anywhere.

use std::sync::OnceLock;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use regex::Regex;

use crate::types::CategoryHit;

/// The built-in categories and their term files.
pub const BUILTIN_CATEGORIES: [(&str, &str); 7] = [
    ("health", include_str!("../data/lexicons/health.txt")),
    ("finance", include_str!("../data/lexicons/finance.txt")),
    ("legal", include_str!("../data/lexicons/legal.txt")),
    ("religion", include_str!("../data/lexicons/religion.txt")),
    ("sexual", include_str!("../data/lexicons/sexual.txt")),
    ("location", include_str!("../data/lexicons/location.txt")),
    ("minors", include_str!("../data/lexicons/minors.txt")),
];

/// Terms of a lexicon file: trimmed, comments and blank lines dropped.
pub fn parse_terms(file: &str) -> impl Iterator<Item = &str> {
    file.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
}

/// A compiled set of category lexicons.
pub struct Lexicon {
    ac: AhoCorasick,
    /// Category index per pattern.
    pattern_category: Vec<usize>,
    pattern_ascii: Vec<bool>,
    categories: Vec<String>,
}

impl std::fmt::Debug for Lexicon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lexicon")
            .field("categories", &self.categories)
            .field("terms", &self.pattern_category.len())
            .finish()
    }
}

impl Lexicon {
    /// Build from (category, terms) pairs. Terms are lower-cased for ASCII.
    pub fn new<'a>(
        entries: impl IntoIterator<Item = (&'a str, Vec<String>)>,
    ) -> Result<Lexicon, aho_corasick::BuildError> {
        let mut categories: Vec<String> = Vec::new();
        let mut terms = Vec::new();
        let mut pattern_category = Vec::new();
        let mut pattern_ascii = Vec::new();
        for (cat, ts) in entries {
            let idx = match categories.iter().position(|c| c == cat) {
                Some(i) => i,
                None => {
                    categories.push(cat.to_string());
                    categories.len() - 1
                }
            };
            for t in ts {
                pattern_ascii.push(t.is_ascii());
                terms.push(t.to_ascii_lowercase());
                pattern_category.push(idx);
            }
        }
        let ac = AhoCorasickBuilder::new()
            .ascii_case_insensitive(true)
            .kind(Some(aho_corasick::AhoCorasickKind::DFA))
            .match_kind(MatchKind::LeftmostLongest)
            .build(&terms)?;
        Ok(Lexicon {
            ac,
            pattern_category,
            pattern_ascii,
            categories,
        })
    }

    /// Category names known to this lexicon.
    pub fn categories(&self) -> &[String] {
        &self.categories
    }

    /// Every term occurrence in `text`.
    pub fn scan(&self, text: &str) -> Vec<CategoryHit> {
        let b = text.as_bytes();
        let word = |c: u8| c.is_ascii_alphanumeric();
        self.ac
            .find_iter(text)
            .filter(|m| {
                let p = m.pattern().as_usize();
                // An ASCII term must stand alone: not inside a word, and not
                // the head of a hyphenated compound ("church-rosser").
                !self.pattern_ascii[p]
                    || ((m.start() == 0 || !word(b[m.start() - 1]))
                        && (m.end() >= b.len() || !word(b[m.end()]))
                        && !(b.get(m.end()) == Some(&b'-')
                            && b.get(m.end() + 1).is_some_and(u8::is_ascii_alphabetic)))
            })
            .map(|m| CategoryHit {
                category: self.categories[self.pattern_category[m.pattern().as_usize()]].clone(),
                start: m.start(),
                end: m.end(),
            })
            .collect()
    }
}

/// Postal addresses found by their structure rather than by a term: a
/// Chinese address down to the street number or the building
/// (`北京市朝阳区建国路88号`, `…路15号…B栋1702`), or an English street line
/// (`350 W 42nd St`, `221B Baker Street`). Tagged `location`.
pub fn address_hits(text: &str) -> Vec<CategoryHit> {
    static RES: OnceLock<(Option<Regex>, Option<Regex>)> = OnceLock::new();
    let (zh, en) = RES.get_or_init(|| {
        (
            Regex::new(concat!(
                // district level, then a street with a number
                r"\p{Han}{1,7}(?:区|县|旗|镇|乡)\p{Han}{0,16}?(?:路|街|大道|大街|巷|弄|胡同)[0-9０-９]{1,5}(?:号|弄|巷)",
                // a street with a number, then a building / unit / room
                r"|(?:路|街|大道|大街|巷|弄)[0-9０-９]{1,5}号[^\n]{0,24}?[0-9A-Za-z一二三四五六七八九十]{1,4}(?:栋|幢|座|单元|号楼|室)",
                // city and district, then a residential complex
                r"|\p{Han}{1,7}(?:省|市)\p{Han}{1,7}(?:区|县)\p{Han}{1,12}?(?:小区|花园|公寓|新村|家园)",
            ))
            .ok(),
            Regex::new(
                r"\b[0-9]{1,5}[A-Za-z]?\s+(?:[NSEW]\.?\s+)?(?:[A-Z0-9][A-Za-z0-9'.-]*\s+){1,3}(?:St|Street|Ave|Avenue|Rd|Road|Blvd|Boulevard|Ln|Lane|Way|Ct|Court|Pl|Place|Terrace|Crescent|Hwy|Highway)\b",
            )
            .ok(),
        )
    });
    let mut out = Vec::new();
    let (zh_gate, en_gate) = address_gates(text);
    if let Some(zh) = zh.as_ref().filter(|_| zh_gate) {
        out.extend(zh.find_iter(text).map(|m| CategoryHit {
            category: "location".to_string(),
            start: m.start(),
            end: m.end(),
        }));
    }
    if let Some(en) = en.as_ref().filter(|_| en_gate) {
        out.extend(en.find_iter(text).map(|m| CategoryHit {
            category: "location".to_string(),
            start: m.start(),
            end: m.end(),
        }));
    }
    out
}

/// Cheap necessary conditions for [`address_hits`], found in one pass:
/// every Chinese form needs a number followed by 号/弄/巷 or a residential
/// complex word; every English form a capitalised street word.
fn address_gates(text: &str) -> (bool, bool) {
    static GATE: OnceLock<Option<(AhoCorasick, usize)>> = OnceLock::new();
    let Some((ac, n_zh)) = GATE
        .get_or_init(|| {
            let mut zh: Vec<String> = Vec::new();
            for d in ('0'..='9').chain('０'..='９') {
                for unit in ['号', '弄', '巷'] {
                    zh.push(format!("{d}{unit}"));
                }
            }
            zh.extend(["小区", "花园", "公寓", "新村", "家园"].map(String::from));
            let en = [
                " St",
                " Street",
                " Ave",
                " Rd",
                " Road",
                " Blvd",
                " Boulevard",
                " Ln",
                " Lane",
                " Way",
                " Ct",
                " Court",
                " Pl",
                " Terrace",
                " Crescent",
                " Hwy",
                " Highway",
            ];
            let n_zh = zh.len();
            let all: Vec<String> = zh.into_iter().chain(en.map(String::from)).collect();
            AhoCorasick::new(&all).ok().map(|ac| (ac, n_zh))
        })
        .as_ref()
    else {
        return (true, true);
    };
    let (mut zh, mut en) = (false, false);
    for m in ac.find_iter(text) {
        if m.pattern().as_usize() < *n_zh {
            zh = true;
        } else {
            en = true;
        }
        if zh && en {
            break;
        }
    }
    (zh, en)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builtin() -> Lexicon {
        Lexicon::new(
            BUILTIN_CATEGORIES
                .iter()
                .map(|(c, f)| (*c, parse_terms(f).map(String::from).collect())),
        )
        .unwrap()
    }

    #[test]
    fn every_builtin_file_has_terms() {
        for (cat, file) in BUILTIN_CATEGORIES {
            assert!(parse_terms(file).count() >= 15, "{cat} lexicon too small");
        }
    }

    #[test]
    fn ascii_terms_need_word_boundaries() {
        let lx = builtin();
        assert!(lx.scan("tar the archive directory").is_empty());
        let hits = lx.scan("I was diagnosed with HIV last year");
        assert!(hits.iter().all(|h| h.category == "health"));
        assert_eq!(hits.len(), 2);
    }

    #[test]
    fn chinese_terms_match_inside_text() {
        let lx = builtin();
        let hits = lx.scan("我最近被确诊为糖尿病，想问问饮食");
        assert!(hits.iter().any(|h| h.category == "health"));
        let hits = lx.scan("我儿子在读幼儿园");
        assert!(hits.iter().all(|h| h.category == "minors"));
        assert!(!hits.is_empty());
    }
}
