//! Category lexicons: lists of terms (Chinese and English) per sensitive
//! category, matched in one Aho-Corasick pass, and the context rules that
//! decide whether a term found in the text counts.
//!
//! The built-in lists live in `router/data/lexicons/<category>.txt`, one term
//! per line, `#` for comments. ASCII terms match case-insensitively and only
//! when they stand alone: on word boundaries ("hiv" does not fire inside
//! "archive"), and not as an identifier or part of one (`calculate_tax`,
//! `self.balance`, `loan(`, `income=`); other terms (Chinese) match anywhere.
//!
//! A line is one of three kinds of term ([`TermKind`]):
//!
//! * `term`: counts wherever it stands alone, unless the next word is a
//!   software word ("loan calculator", "工资管理系统";
//!   `data/context/software_words.txt`);
//! * `~ term`: counts only with a first-person marker (`my`, `I`, `我`, …;
//!   `data/context/first_person.txt`) and no software word within
//!   [`CONTEXT_WINDOW`] bytes on the same line. For words that are as often
//!   a topic or a programming task as the writer's own affairs (`mortgage`,
//!   `工资`, `lawyer`);
//! * `! phrase`: a benign sense, mostly technical ("smart contract", "load
//!   balancer"); never counts, and hides any term it overlaps.

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

/// First-person markers, and (`!`) the request phrases that hide them.
const FIRST_PERSON: &str = include_str!("../data/context/first_person.txt");

/// Words that make a nearby term part of a programming task.
const SOFTWARE_WORDS: &str = include_str!("../data/context/software_words.txt");

/// Phrases that make a text a question about a topic in general.
const TOPIC_FRAMES: &str = include_str!("../data/context/topic_frames.txt");

/// Phrases that make a text fiction (its first person is a character).
const FICTION_FRAMES: &str = include_str!("../data/context/fiction_frames.txt");

/// How the whole text frames its category terms (issue 32: a disclosure is
/// not a topic).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame {
    /// No frame phrase: plain terms count as before.
    Open,
    /// The text asks about a topic in general ("for a study guide",
    /// "explain the", "en général", "科普"): a plain term counts only with a
    /// disclosure cue within [`CONTEXT_WINDOW`].
    Topic,
    /// The text is or quotes fiction ("short story", "in my novel",
    /// "第一人称"): no term counts.
    Fiction,
}

/// The frame of `text`: fiction wins over topic.
pub fn frame_of(text: &str) -> Frame {
    if fiction_frames().occur_in(text) {
        Frame::Fiction
    } else if topic_frames().occur_in(text) {
        Frame::Topic
    } else {
        Frame::Open
    }
}

/// How far (bytes, same line) a first-person marker or a software word may
/// be from a [`TermKind::Personal`] term: about a clause in English, a dozen
/// Han characters.
pub const CONTEXT_WINDOW: usize = 48;

/// How much further than [`CONTEXT_WINDOW`] context words are searched, so
/// that a hiding phrase ("how do I") cut by the window's edge is still seen
/// whole.
const CONTEXT_REACH_MARGIN: usize = 16;

/// How a lexicon term counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TermKind {
    /// Counts wherever it stands alone.
    Plain,
    /// Counts only near a first-person marker and away from software words
    /// (`~ term`).
    Personal,
    /// A benign sense: never counts, hides the terms it overlaps (`! phrase`).
    Benign,
}

/// One lexicon entry: the text to find and how it counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Term {
    pub text: String,
    pub kind: TermKind,
}

impl Term {
    /// A term from its lexicon spelling: `~ term` is [`TermKind::Personal`],
    /// `! phrase` is [`TermKind::Benign`], anything else [`TermKind::Plain`].
    /// `None` when nothing is left after the marker.
    pub fn parse(spelling: &str) -> Option<Term> {
        let spelling = spelling.trim();
        let (kind, text) = if let Some(rest) = spelling.strip_prefix('~') {
            (TermKind::Personal, rest.trim())
        } else if let Some(rest) = spelling.strip_prefix('!') {
            (TermKind::Benign, rest.trim())
        } else {
            (TermKind::Plain, spelling)
        };
        (!text.is_empty()).then(|| Term {
            text: text.to_string(),
            kind,
        })
    }
}

/// Terms of a lexicon file: comments and blank lines dropped.
pub fn parse_terms(file: &str) -> impl Iterator<Item = Term> + '_ {
    file.lines()
        .filter_map(|l| Term::parse(l.split('#').next().unwrap_or("")))
}

/// A compiled set of category lexicons.
pub struct Lexicon {
    ac: AhoCorasick,
    /// Category index per pattern.
    pattern_category: Vec<usize>,
    pattern_ascii: Vec<bool>,
    pattern_kind: Vec<TermKind>,
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
        entries: impl IntoIterator<Item = (&'a str, Vec<Term>)>,
    ) -> Result<Lexicon, aho_corasick::BuildError> {
        let mut categories: Vec<String> = Vec::new();
        let mut terms = Vec::new();
        let mut pattern_category = Vec::new();
        let mut pattern_ascii = Vec::new();
        let mut pattern_kind = Vec::new();
        for (cat, ts) in entries {
            let idx = match categories.iter().position(|c| c == cat) {
                Some(i) => i,
                None => {
                    categories.push(cat.to_string());
                    categories.len() - 1
                }
            };
            for t in ts {
                pattern_ascii.push(t.text.is_ascii());
                terms.push(t.text.to_ascii_lowercase());
                pattern_category.push(idx);
                pattern_kind.push(t.kind);
            }
        }
        // Standard semantics: every overlapping occurrence is reported, and
        // `standing_terms` chooses among those that stand alone. A contiguous NFA, not a DFA: with the CJK terms' byte classes the
        // DFA takes 7.6 MB, and beside the recognizers' regexes it is out of
        // cache for every text (measured: the NFA is slower alone, but the
        // whole classification is about 15 % faster with it).
        let ac = AhoCorasickBuilder::new()
            .ascii_case_insensitive(true)
            .kind(Some(aho_corasick::AhoCorasickKind::ContiguousNFA))
            .match_kind(MatchKind::Standard)
            .build(&terms)?;
        Ok(Lexicon {
            ac,
            pattern_category,
            pattern_ascii,
            pattern_kind,
            categories,
        })
    }

    /// Category names known to this lexicon.
    pub fn categories(&self) -> &[String] {
        &self.categories
    }

    /// Every term occurrence in `text` that counts under the context rules
    /// (see the module docs).
    pub fn scan(&self, text: &str) -> Vec<CategoryHit> {
        let mut hits = Vec::new();
        let terms = self.standing_terms(text);
        if terms.is_empty() {
            return hits;
        }
        let frame = frame_of(text);
        if frame == Frame::Fiction {
            return hits;
        }
        for (pattern, start, end) in terms {
            let cue =
                || nearest_in_window(text, start, end, &first_person().around(text, start, end));
            let counted: Option<Option<(usize, usize)>> = match self.pattern_kind[pattern] {
                TermKind::Benign => None,
                TermKind::Plain => {
                    if followed_by(text, end, &software_words().around(text, end, end)) {
                        None
                    } else {
                        match (frame, cue()) {
                            (Frame::Topic, None) => None,
                            (_, c) => Some(c),
                        }
                    }
                }
                TermKind::Personal => {
                    if within_window(text, start, end, &software_words().around(text, start, end)) {
                        None
                    } else {
                        cue().map(Some)
                    }
                }
            };
            if let Some(cue) = counted {
                hits.push(CategoryHit {
                    category: self.categories[self.pattern_category[pattern]].clone(),
                    start,
                    end,
                    cue,
                });
            }
        }
        hits
    }

    /// The term occurrences that stand alone (see [`stands_alone`]), as
    /// (pattern, start, end): leftmost-longest among them, so a longer term
    /// that is not a word here ("my debt" in "my debt-to-income") does not
    /// hide a shorter one that is, and a benign phrase hides every term it
    /// overlaps. Terms with the same span in several categories all stay.
    fn standing_terms(&self, text: &str) -> Vec<(usize, usize, usize)> {
        let b = text.as_bytes();
        let mut found: Vec<(usize, usize, usize)> = self
            .ac
            .find_overlapping_iter(text)
            .map(|m| (m.pattern().as_usize(), m.start(), m.end()))
            .filter(|&(p, s, e)| {
                !self.pattern_ascii[p]
                    || (stands_alone(b, s, e) && !latin_letter_touches(text, s, e))
            })
            .collect();
        let benign: Vec<(usize, usize)> = found
            .iter()
            .filter(|&&(p, _, _)| self.pattern_kind[p] == TermKind::Benign)
            .map(|&(_, s, e)| (s, e))
            .collect();
        found.retain(|&(p, s, e)| {
            self.pattern_kind[p] == TermKind::Benign
                || benign.iter().all(|&(bs, be)| e <= bs || s >= be)
        });
        // Leftmost first, then longest.
        found.sort_by(|a, b| a.1.cmp(&b.1).then(b.2.cmp(&a.2)).then(a.0.cmp(&b.0)));
        let mut kept: Vec<(usize, usize, usize)> = Vec::with_capacity(found.len());
        for t in found {
            let same_span = kept.last().is_some_and(|k| (k.1, k.2) == (t.1, t.2));
            let free = kept.last().is_none_or(|k| t.1 >= k.2);
            if same_span || free {
                kept.push(t);
            }
        }
        kept
    }
}

/// Whether an ASCII term at `start..end` stands alone: not inside a word, not
/// the head of a hyphenated compound ("church-rosser"), and not an
/// identifier or part of one (`calculate_tax`, `self.balance`, `$loan`,
/// `Account::new`, `loan(`, `income=`, `loan.rate`, `rows[`).
fn stands_alone(b: &[u8], start: usize, end: usize) -> bool {
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let before = start.checked_sub(1).and_then(|i| b.get(i)).copied();
    let before2 = start.checked_sub(2).and_then(|i| b.get(i)).copied();
    let after = b.get(end).copied();
    let after2 = end.checked_add(1).and_then(|i| b.get(i)).copied();
    let inside_word = before.is_some_and(word) || after.is_some_and(word);
    let compound_head = after == Some(b'-') && after2.is_some_and(|c| c.is_ascii_alphabetic());
    let identifier_before =
        matches!(before, Some(b'.' | b'$')) || (before == Some(b':') && before2 == Some(b':'));
    let identifier_after = matches!(after, Some(b'(' | b'[' | b'='))
        || (after == Some(b':') && after2 == Some(b':'))
        || (after == Some(b'.') && after2.is_some_and(word));
    !(inside_word || compound_head || identifier_before || identifier_after)
}

/// Whether a non-ASCII letter of an alphabetic script (Latin with accents,
/// Greek, Cyrillic, Hangul is not one: it is below U+2E80 only for Latin,
/// Greek, Cyrillic and the like) touches `start..end`: "mes" in
/// "symptômes", "ma" in "máquina" are inside words. CJK next to an ASCII
/// word is a boundary ("我的email").
fn latin_letter_touches(text: &str, start: usize, end: usize) -> bool {
    let alpha = |c: char| !c.is_ascii() && c.is_alphanumeric() && (c as u32) < 0x2E80;
    text.get(..start)
        .and_then(|h| h.chars().next_back())
        .is_some_and(alpha)
        || text
            .get(end..)
            .and_then(|t| t.chars().next())
            .is_some_and(alpha)
}

/// A list of context words (first-person markers, software words) found in
/// one pass. ASCII words match case-insensitively on word boundaries; Han
/// words anywhere. `!` lines are hiding phrases: found like the others, they
/// hide the words they contain ("help me" hides "me") and are not reported.
pub(crate) struct ContextWords {
    ac: Option<AhoCorasick>,
    words: Vec<Term>,
}

impl ContextWords {
    fn new(file: &str) -> ContextWords {
        let words: Vec<Term> = parse_terms(file).collect();
        let patterns: Vec<String> = words.iter().map(|t| t.text.to_ascii_lowercase()).collect();
        let ac = AhoCorasickBuilder::new()
            .ascii_case_insensitive(true)
            .kind(Some(aho_corasick::AhoCorasickKind::DFA))
            .match_kind(MatchKind::LeftmostLongest)
            .build(&patterns)
            .ok();
        ContextWords { ac, words }
    }

    /// Byte spans of the words in `text` that may be within
    /// [`CONTEXT_WINDOW`] of `start..end` (the search reaches a little
    /// further, so a hiding phrase across the window's edge still hides).
    fn around(&self, text: &str, start: usize, end: usize) -> Vec<(usize, usize)> {
        let reach = CONTEXT_WINDOW.saturating_add(CONTEXT_REACH_MARGIN);
        let from = start.saturating_sub(reach);
        let to = end.saturating_add(reach).min(text.len());
        self.find(text, from..to)
    }

    /// Byte spans of the words in `text[range]`, in order (word boundaries
    /// are judged on the whole text). The single letter `I` counts only in
    /// upper case (a lower-case `i` is a loop index).
    fn find(&self, text: &str, range: std::ops::Range<usize>) -> Vec<(usize, usize)> {
        self.matches(text, range).collect()
    }

    /// Whether any of the words is in `text`: the first of what
    /// [`Self::find`] finds over the whole text (the scan stops there).
    fn occur_in(&self, text: &str) -> bool {
        self.matches(text, 0..text.len()).next().is_some()
    }

    /// The words of [`Self::find`], found as the caller takes them.
    fn matches<'t>(
        &'t self,
        text: &'t str,
        range: std::ops::Range<usize>,
    ) -> impl Iterator<Item = (usize, usize)> + 't {
        let ac = self
            .ac
            .as_ref()
            .filter(|_| range.start <= range.end && range.end <= text.len());
        let b = text.as_bytes();
        let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b'\'';
        ac.into_iter()
            .flat_map(move |ac| ac.find_iter(aho_corasick::Input::new(text).range(range.clone())))
            .filter(move |m| {
                let w = &self.words[m.pattern().as_usize()];
                let alone = !w.text.is_ascii()
                    || (!m
                        .start()
                        .checked_sub(1)
                        .and_then(|i| b.get(i))
                        .is_some_and(|&c| word(c))
                        && !b.get(m.end()).is_some_and(|&c| word(c))
                        && !latin_letter_touches(text, m.start(), m.end()));
                let case_ok = w.text != "I" || b.get(m.start()) == Some(&b'I');
                w.kind != TermKind::Benign && alone && case_ok
            })
            .map(|m| (m.start(), m.end()))
    }
}

fn first_person() -> &'static ContextWords {
    static WORDS: OnceLock<ContextWords> = OnceLock::new();
    WORDS.get_or_init(|| ContextWords::new(FIRST_PERSON))
}

fn software_words() -> &'static ContextWords {
    static WORDS: OnceLock<ContextWords> = OnceLock::new();
    WORDS.get_or_init(|| ContextWords::new(SOFTWARE_WORDS))
}

fn topic_frames() -> &'static ContextWords {
    static WORDS: OnceLock<ContextWords> = OnceLock::new();
    WORDS.get_or_init(|| ContextWords::new(TOPIC_FRAMES))
}

fn fiction_frames() -> &'static ContextWords {
    static WORDS: OnceLock<ContextWords> = OnceLock::new();
    WORDS.get_or_init(|| ContextWords::new(FICTION_FRAMES))
}

/// Whether one of `spans` is within [`CONTEXT_WINDOW`] bytes of
/// `start..end` with no line break in between. A span inside the term
/// itself does not count ("class" in "class action").
fn within_window(text: &str, start: usize, end: usize, spans: &[(usize, usize)]) -> bool {
    nearest_in_window(text, start, end, spans).is_some()
}

/// The nearest of `spans` within [`CONTEXT_WINDOW`] bytes of `start..end`
/// on the same line (see [`within_window`]).
fn nearest_in_window(
    text: &str,
    start: usize,
    end: usize,
    spans: &[(usize, usize)],
) -> Option<(usize, usize)> {
    spans
        .iter()
        .filter_map(|&(s, e)| {
            let (from, to) = if e <= start {
                (e, start)
            } else if s >= end {
                (end, s)
            } else {
                return None;
            };
            let gap = to.saturating_sub(from);
            (gap <= CONTEXT_WINDOW && text.get(from..to).is_some_and(|g| !g.contains('\n')))
                .then_some((gap, (s, e)))
        })
        .min_by_key(|&(gap, _)| gap)
        .map(|(_, span)| span)
}

/// Whether one of `spans` starts right after `end` (nothing or one space in
/// between), as "calculator" in "loan calculator" or "计算器" in "房贷计算器".
fn followed_by(text: &str, end: usize, spans: &[(usize, usize)]) -> bool {
    spans.iter().any(|&(s, _)| {
        s == end || (s == end.saturating_add(1) && text.as_bytes().get(end) == Some(&b' '))
    })
}

/// An English street line (`350 W 42nd St`, `221B Baker Street`).
const EN_STREET_LINE: &str = r"\b[0-9]{1,5}[A-Za-z]?\s+(?:[NSEW]\.?\s+)?(?:[A-Z0-9][A-Za-z0-9'.-]*\s+){1,3}(?:St|Street|Ave|Avenue|Rd|Road|Blvd|Boulevard|Ln|Lane|Way|Ct|Court|Pl|Place|Terrace|Crescent|Hwy|Highway)\b";

/// Postal addresses found by their structure rather than by a term: a
/// Chinese address down to the street number or the building
/// (`北京市朝阳区建国路88号`, `…路15号…B栋1702`), or an English street line
/// (`350 W 42nd St`, `221B Baker Street`). Tagged `location`.
pub fn address_hits(text: &str) -> Vec<CategoryHit> {
    let (zh, en, en_ascii) = address_regexes();
    let mut out = intl_address_hits(text);
    let (zh_gate, en_gate) = address_gates(text);
    if let Some(zh) = zh.as_ref().filter(|_| zh_gate) {
        out.extend(zh.find_iter(text).map(|m| CategoryHit {
            category: "location".to_string(),
            start: m.start(),
            end: m.end(),
            cue: None,
        }));
    }
    let may_match_en = || en_ascii.as_ref().is_none_or(|r| r.is_match(text));
    if let Some(en) = en.as_ref().filter(|_| en_gate && may_match_en()) {
        out.extend(en.find_iter(text).map(|m| CategoryHit {
            category: "location".to_string(),
            start: m.start(),
            end: m.end(),
            cue: None,
        }));
    }
    out
}

/// The Chinese address regex, the English street line, and the English
/// street line with ASCII word boundaries (see [`address_hits`]).
fn address_regexes() -> &'static (Option<Regex>, Option<Regex>, Option<Regex>) {
    static RES: OnceLock<(Option<Regex>, Option<Regex>, Option<Regex>)> = OnceLock::new();
    RES.get_or_init(|| {
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
            Regex::new(EN_STREET_LINE).ok(),
            // The same with ASCII word boundaries: it matches wherever the
            // Unicode one does (a Unicode boundary next to the digit or the
            // street word's last letter is an ASCII one), stays in the lazy
            // DFA on non-ASCII text, and so tells cheaply whether the
            // Unicode one must run.
            Regex::new(&EN_STREET_LINE.replace(r"\b", r"(?-u:\b)")).ok(),
        )
    })
}

/// One (gate words, regex, digits) per country for [`intl_address_hits`]:
/// a regex runs only when one of its gate words is in the text (one
/// Aho-Corasick pass decides all five) and the text has a run of that many
/// ASCII digits (every match of the regex holds one: the DE, FR and ES
/// postcodes).
const INTL_FORMS: [(&[&str], &str, usize); 5] = [
    (
        &[
            "straße", "strasse", "weg ", "allee", "platz", "gasse", "damm",
        ],
        r"\p{Lu}[\p{L}-]{0,30}(?:straße|strasse|weg|allee|platz|gasse|ring|damm|ufer)\s+[0-9]{1,4}\s?[a-z]?,?\s+[0-9]{5}\s+\p{Lu}\p{L}+",
        5,
    ),
    (
        &[
            "rue ",
            "avenue ",
            "boulevard ",
            "chemin ",
            "allée ",
            "impasse ",
            "quai ",
        ],
        r"(?-u:\b)[0-9]{1,4}(?:\s?(?:bis|ter))?,?\s+(?i:rue|avenue|boulevard|bd|place|chemin|allée|impasse|quai|route)\s+[^\n,]{2,40},\s*[0-9]{5}\s+\p{Lu}",
        5,
    ),
    (
        &[
            "calle ", "avenida ", "avda", "plaza ", "paseo ", "carrer ", "camino ", "c/",
        ],
        r"(?:Calle|C/|Avenida|Avda\.?|Plaza|Paseo|Carrer|Camino)\s+[^\n,]{2,40},?\s*[0-9]{1,4}[^\n]{0,20}?(?-u:\b)[0-9]{5}(?-u:\b)",
        5,
    ),
    (
        &["東京都", "北海道", "京都府", "大阪府", "県"],
        r"(?:東京都|北海道|京都府|大阪府|\p{Han}{2,3}県)\p{Han}{1,6}?[市区町村郡]\p{Han}{0,8}?[0-9０-９]{1,4}(?:[-－ー]|丁目)[0-9０-９]{1,4}(?:[-－ー番][0-9０-９]{1,4})?",
        0,
    ),
    (
        &["특별시", "광역시", "도 ", "시 "],
        r"\p{Hangul}{2,6}(?:특별시|광역시|시|도)\s*\p{Hangul}{1,5}(?:구|군|시)\s*\p{Hangul}{1,12}(?:로|길)\s*[0-9]{1,4}",
        1,
    ),
];

/// Street addresses in the formats of Germany, France, Spain, the UK,
/// Japan and Korea: street + number + postcode (DE `Lindenstraße 12, 50674
/// Köln`, FR `14 rue des Lilas, 69003 Lyon`, ES `Calle de Alcalá 45, 3º B,
/// 28014 Madrid`, UK `… , Leeds LS6 2AB`), prefecture + city + block numbers
/// (JP `東京都世田谷区桜新町2-15-8`), city + district + road + number (KR
/// `서울특별시 강남구 테헤란로 152`). Gated by one substring pass.
fn intl_address_hits(text: &str) -> Vec<CategoryHit> {
    type Compiled = (AhoCorasick, Vec<usize>, Vec<Regex>);
    static RE: OnceLock<Option<Compiled>> = OnceLock::new();
    let Some((gate, owner, res)) = RE
        .get_or_init(|| {
            let mut words = Vec::new();
            let mut owner = Vec::new();
            for (i, (ws, _, _)) in INTL_FORMS.iter().enumerate() {
                for w in *ws {
                    words.push(*w);
                    owner.push(i);
                }
            }
            let gate = AhoCorasickBuilder::new()
                .ascii_case_insensitive(true)
                .build(&words)
                .ok()?;
            let res = INTL_FORMS
                .iter()
                .map(|(_, re, _)| Regex::new(re).ok())
                .collect::<Option<Vec<_>>>()?;
            Some((gate, owner, res))
        })
        .as_ref()
    else {
        return Vec::new();
    };
    let mut run = [false; INTL_FORMS.len()];
    for m in gate.find_iter(text) {
        if let Some(slot) = owner
            .get(m.pattern().as_usize())
            .and_then(|&i| run.get_mut(i))
        {
            *slot = true;
        }
    }
    if run.iter().any(|&r| r) {
        let digits = longest_digit_run(text);
        for (r, (_, _, need)) in run.iter_mut().zip(INTL_FORMS) {
            *r &= digits >= need;
        }
    }
    let mut out = Vec::new();
    for (re, _) in res.iter().zip(run).filter(|(_, r)| *r) {
        out.extend(re.find_iter(text).map(|m| CategoryHit {
            category: "location".to_string(),
            start: m.start(),
            end: m.end(),
            cue: None,
        }));
    }
    out
}

/// The most ASCII digits in a row in `text`.
fn longest_digit_run(text: &str) -> usize {
    let (mut longest, mut run) = (0, 0);
    for b in text.bytes() {
        run = if b.is_ascii_digit() { run + 1 } else { 0 };
        longest = longest.max(run);
    }
    longest
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
                .map(|(c, f)| (*c, parse_terms(f).collect())),
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
    fn term_spellings() {
        let t = |s: &str| Term::parse(s).map(|t| (t.text, t.kind));
        assert_eq!(t("mortgage"), Some(("mortgage".into(), TermKind::Plain)));
        assert_eq!(t("~ 工资"), Some(("工资".into(), TermKind::Personal)));
        assert_eq!(
            t("!load balancer"),
            Some(("load balancer".into(), TermKind::Benign))
        );
        assert_eq!(t("  ~  "), None);
        assert_eq!(t(""), None);
    }

    #[test]
    fn identifiers_do_not_stand_alone() {
        let alone = |text: &str, term: &str| {
            let start = text.find(term).unwrap();
            stands_alone(text.as_bytes(), start, start + term.len())
        };
        assert!(alone("my loan is late", "loan"));
        assert!(alone("my loan.", "loan"));
        assert!(!alone("calculate_tax", "tax"));
        assert!(!alone("self.loan", "loan"));
        assert!(!alone("$loan", "loan"));
        assert!(!alone("Account::loan", "loan"));
        assert!(!alone("loan(x)", "loan"));
        assert!(!alone("loan=1", "loan"));
        assert!(!alone("loan[0]", "loan"));
        assert!(!alone("loan.rate", "loan"));
        assert!(!alone("loan::new", "loan"));
        assert!(!alone("loan-officer", "loan"));
    }

    #[test]
    fn context_windows() {
        let text = "my notes: the mortgage";
        let term = text.find("mortgage").unwrap();
        let end = term + "mortgage".len();
        assert!(within_window(text, term, end, &[(0, 2)]));
        let far = format!("my{}mortgage", " ".repeat(CONTEXT_WINDOW + 1));
        let term = far.find("mortgage").unwrap();
        assert!(!within_window(&far, term, term + 8, &[(0, 2)]));
        let other_line = "my\nmortgage";
        assert!(!within_window(other_line, 3, 11, &[(0, 2)]));
        // A word inside the term is not near it.
        assert!(!within_window("class action", 0, 12, &[(0, 5)]));
        assert!(followed_by("loan calculator", 4, &[(5, 15)]));
        assert!(followed_by("房贷计算器", 6, &[(6, 15)]));
        assert!(!followed_by("loan  calculator", 4, &[(6, 16)]));
    }

    #[test]
    fn first_person_markers() {
        let found = |text: &str| -> Vec<String> {
            first_person()
                .find(text, 0..text.len())
                .into_iter()
                .map(|(s, e)| text[s..e].to_string())
                .collect()
        };
        assert_eq!(found("I think my loan"), ["I", "my"]);
        assert!(found("for i in items").is_empty());
        assert!(found("help me with this, tell me how").is_empty());
        assert!(found("How do I do it").is_empty());
        assert!(found("myth and enemy").is_empty());
        assert_eq!(found("帮我看看我的账单"), ["我"]);
        assert!(found("我们公司").is_empty());
        assert_eq!(found("我们家"), ["我们家"]);
    }

    /// The cheap conditions that skip the address regexes hold wherever a
    /// regex matches: the English street line with ASCII boundaries matches
    /// wherever the Unicode one does, and every match of a foreign form holds
    /// its run of digits. On every corpus and blind case and on street lines
    /// next to non-ASCII letters, tabs and line breaks.
    #[test]
    fn address_preconditions_hold_wherever_a_regex_matches() {
        let mut texts = crate::test_texts::case_lines();
        for before in ["", "é", "x ", "\n", "住址："] {
            for after in ["", "é", ".", "\tok", "ß", "号"] {
                for line in [
                    "350 W 42nd St",
                    "221B Baker Street",
                    "12\tMain\tRoad",
                    "9 Elm\nLane",
                ] {
                    texts.push(format!("{before}{line}{after}"));
                }
            }
        }
        let (_, en, en_ascii) = address_regexes();
        let (Some(en), Some(en_ascii)) = (en, en_ascii) else {
            panic!("the English street regexes do not compile");
        };
        let mut english = 0;
        for t in &texts {
            if en.is_match(t) {
                assert!(en_ascii.is_match(t), "{t:?}");
                english += 1;
            }
        }
        assert!(english >= 40, "{english} English street lines");
        for (_, re, digits) in INTL_FORMS {
            let re = Regex::new(re).unwrap_or_else(|e| panic!("{e}"));
            let mut found = 0;
            for t in &texts {
                for m in re.find_iter(t) {
                    assert!(longest_digit_run(m.as_str()) >= digits, "{:?}", m.as_str());
                    found += 1;
                }
            }
            assert!(found > 0, "{re}: no match to check");
        }
    }

    #[test]
    fn addresses_in_other_countries() {
        for (text, addr) in [
            (
                "wohne in der Lindenstraße 12, 50674 Köln.",
                "Lindenstraße 12, 50674 Köln",
            ),
            (
                "j'habite au 14 rue des Lilas, 69003 Lyon",
                "14 rue des Lilas, 69003 L",
            ),
            (
                "vivo en Calle de Alcalá 45, 3º B, 28014 Madrid",
                "Calle de Alcalá 45, 3º B, 28014",
            ),
            (
                "住所は東京都世田谷区桜新町2-15-8です",
                "東京都世田谷区桜新町2-15-8",
            ),
            (
                "서울특별시 강남구 테헤란로 152에 살아요",
                "서울특별시 강남구 테헤란로 152",
            ),
        ] {
            let hits = address_hits(text);
            assert!(
                hits.iter().any(|h| &text[h.start..h.end] == addr),
                "{text}: {:?}",
                hits.iter()
                    .map(|h| &text[h.start..h.end])
                    .collect::<Vec<_>>()
            );
        }
        assert!(address_hits("Rue de Rivoli is long; the rue has 3 parts").is_empty());
        assert!(address_hits("東京都の人口は1400万人").is_empty());
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
