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
//!
//! A term's disclosure cue is the nearest first-person or relative marker
//! within [`CONTEXT_WINDOW`] bytes on its line, or else the cue of the
//! header of a list that holds it ("My conditions: diabetes, asthma, …",
//! "my diagnoses:" over bullet lines; [`list_header_cue`]), unless the
//! header names questions ("My questions:", "我的疑问：";
//! `data/context/question_headers.txt`): then its items are read as a
//! topic, and a term there counts only with a cue of its own. Korean "제"
//! and "내" (my) count only as words of their own ("제 빚", not "문제").
//!
//! A term that would count is then read in its sentence (issue 32, "tense
//! and negation"; docs/privacy.md "Negation and hypotheticals" and
//! "Clauses, lists and tense"):
//!
//! * in a hypothetical, a future conditional or a generic conditional ("if
//!   someone is arrested", "suppose my father were diagnosed", "假如我得了癌症",
//!   "if I ever get sued", "将来もし認知症になったら", Spanish "si" with an
//!   imperfect subjunctive: "si me declarara en quiebra";
//!   `data/context/hypotheticals.txt`) it counts only with a disclosure cue
//!   of its own in the clause, not the supposition's subject, or when the
//!   clause tells of the past ("as a child", "去年", a year). The frame
//!   covers the conditional clause only: it ends at a clause break or at a
//!   word that ends it ("then", "的话", "たら"), and its subject is no cue
//!   for the main clause;
//! * in the main clause of a supposition or a generic conditional ("If I
//!   had cancer, would my insurer pay for chemotherapy?", "如果有人酒驾被抓了，
//!   会被判刑吗？"; [`Consequent`]): when the clause asks or is in the
//!   conditional mood and the conditional clause holds a term (of the same
//!   category, for a supposition), it counts only with a cue of its own
//!   there; for a supposition, not the possessive of an institution ("my
//!   insurer", "我的保险") nor a cue bound to the mood ("would my wife",
//!   "I'd"); the term's own possessive ("my chemotherapy", "my sister's
//!   diabetes") and the past still count;
//! * denied ("I don't have diabetes", "我没有抑郁症", "借金はありません";
//!   `data/context/negations.txt`) it is set aside in health, finance and
//!   legal ([`NEGATION_CLEARS`]) unless it is a status term (HIV,
//!   pregnancy) or a contrast or change word follows
//!   (`data/context/negation_limits.txt`).
//!
//! [`Lexicon::scan_explained`] says which terms these frames touched.

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
        self.scan_explained(text).0
    }

    /// [`Self::scan`], and a note for every term that a negation or a
    /// hypothetical frame set aside, or was seen near and did not set aside
    /// (see [`FrameNote`]): what `tandem route explain` shows.
    pub fn scan_explained(&self, text: &str) -> (Vec<CategoryHit>, Vec<TermNote>) {
        let mut hits = Vec::new();
        let mut notes = Vec::new();
        let terms = self.standing_terms(text);
        if terms.is_empty() {
            return (hits, notes);
        }
        let frame = frame_of(text);
        if frame == Frame::Fiction {
            return (hits, notes);
        }
        // Each term's hypothetical frame, as `consequent_of` needs it.
        let mut frames: Vec<Option<Option<Hypothetical>>> = vec![None; terms.len()];
        for (idx, &(pattern, start, end)) in terms.iter().enumerate() {
            let kind = self.pattern_kind[pattern];
            let suppressed = match kind {
                TermKind::Benign => true,
                TermKind::Plain => followed_by(text, end, &software_words().around(text, end, end)),
                TermKind::Personal => {
                    within_window(text, start, end, &software_words().around(text, start, end))
                }
            };
            if suppressed {
                continue;
            }
            let cues = first_person().around(text, start, end);
            let (cue, question_header) = disclosure_cue(text, start, end, &cues);
            let category = &self.categories[self.pattern_category[pattern]];
            let note = |cue, frame| TermNote {
                category: category.clone(),
                start,
                end,
                cue,
                frame,
            };
            // The items of a list whose header names questions are read as
            // a topic: a term there counts only with a cue of its own, in
            // its window or inside it ("my mortgage"): "我想问的问题：\n2.
            // 离婚要请律师吗？" asks about divorce.
            let own_inside = || cues.iter().any(|&(s, e)| s >= start && e <= end);
            let counted: Option<Option<(usize, usize)>> = match (kind, frame, cue) {
                (TermKind::Personal, _, None) | (_, Frame::Topic, None) => None,
                (_, _, None) if question_header.is_some() && !own_inside() => None,
                (_, _, c) => Some(c),
            };
            let Some(mut cue) = counted else {
                // A list header that names questions lends its items no
                // cue ("My questions:\n- How does a mortgage work?"), and
                // its items are questions, not disclosures.
                if let Some((header_cue, word)) = question_header {
                    notes.push(note(Some(header_cue), FrameNote::QuestionHeader { word }));
                }
                continue;
            };
            // A hypothetical, a future conditional or a generic
            // conditional: the term counts only with a cue of its own in
            // the clause, or when the clause tells of the past.
            let own_frame = hypothetical_of(text, start, end, &cues);
            frames[idx] = Some(own_frame);
            if let Some(h) = own_frame {
                let own: Vec<(usize, usize)> = cues
                    .iter()
                    .copied()
                    .filter(|&(s, e)| {
                        s >= h.clause_start
                            && e <= h.scope_end
                            && (Some((s, e)) != h.subject || possessive_of(text, (s, e), start))
                    })
                    .filter(|&(s, e)| !(s >= h.marker.0 && e <= h.marker.1))
                    .collect();
                let kept = match nearest_in_window(text, start, end, &own) {
                    Some(c) => {
                        cue = Some(c);
                        Some(HypotheticalKept::OwnCue)
                    }
                    None => h.past.then_some(HypotheticalKept::Past),
                };
                let (marker, generic) = (h.marker, h.generic);
                match kept {
                    Some(why) => notes.push(note(
                        cue,
                        FrameNote::HypotheticalKept {
                            marker,
                            generic,
                            why,
                        },
                    )),
                    None => {
                        notes.push(note(cue, FrameNote::Hypothetical { marker, generic }));
                        continue;
                    }
                }
            } else if let Some(c) = self.consequent_of(text, &terms, idx, &mut frames) {
                // The main clause of a supposition or a generic
                // conditional: the term counts only with a cue of its own
                // there (for a supposition, not an institution's
                // possessive nor bound to the mood), or when the clause
                // tells of the past (a supposition only).
                let generic = c.frame.generic;
                let in_clause = cues
                    .iter()
                    .copied()
                    .filter(|&(s, e)| s >= c.clause.0 && e <= c.clause.1);
                let (mut accepted, mut refused) = (Vec::new(), Vec::new());
                for x in in_clause {
                    match (!generic)
                        .then(|| consequent_cue_refusal(text, x, start))
                        .flatten()
                    {
                        Some(why) => refused.push((x, why)),
                        None => accepted.push(x),
                    }
                }
                let (marker, supposed) = (c.frame.marker, c.supposed);
                // A cue inside the term is its own ("my lawyer").
                let inside = cues.iter().copied().find(|&(s, e)| s >= start && e <= end);
                let kept = match inside.or_else(|| nearest_in_window(text, start, end, &accepted)) {
                    Some(own) => {
                        cue = Some(own);
                        Some(HypotheticalKept::MainClauseCue)
                    }
                    None => (!generic && tells_past(text, c.clause.0, c.clause.1))
                        .then_some(HypotheticalKept::Past),
                };
                match kept {
                    Some(why) => notes.push(note(
                        cue,
                        FrameNote::ConsequentKept {
                            marker,
                            generic,
                            supposed,
                            why,
                        },
                    )),
                    None => {
                        let spans: Vec<(usize, usize)> = refused.iter().map(|r| r.0).collect();
                        let nearest = nearest_in_window(text, start, end, &spans);
                        let why = refused
                            .iter()
                            .find(|r| Some(r.0) == nearest)
                            .map_or(ConsequentAside::NoCue, |r| r.1);
                        notes.push(note(
                            nearest,
                            FrameNote::Consequent {
                                marker,
                                generic,
                                supposed,
                                why,
                            },
                        ));
                        continue;
                    }
                }
            }
            // A denial: set aside only in the categories where a denial
            // says nothing, and not for a status term or a partial denial.
            if let Some(marker) = negation_marker(text, start, end) {
                let kept = if !NEGATION_CLEARS.contains(&category.as_str()) {
                    Some(NegationKept::Category)
                } else if is_status_term(&text[start..end]) {
                    Some(NegationKept::Status)
                } else if negation_limited(text, end.max(marker.1)) {
                    Some(NegationKept::Limited)
                } else {
                    None
                };
                match kept {
                    Some(why) => notes.push(note(cue, FrameNote::NegationKept { marker, why })),
                    None => {
                        notes.push(note(cue, FrameNote::Negated { marker }));
                        continue;
                    }
                }
            }
            hits.push(CategoryHit {
                category: category.clone(),
                start,
                end,
                cue,
            });
        }
        (hits, notes)
    }

    /// The main clause of a supposition or a generic conditional that holds
    /// `terms[idx]`, if any (see [`Consequent`]): the nearest earlier term
    /// of the sentence in a hypothetical frame (`frames` caches each term's
    /// frame) whose conditional clause ends right before the term's clause,
    /// not in the past, of the same category unless the frame is generic,
    /// and a main clause that asks or supposes.
    fn consequent_of(
        &self,
        text: &str,
        terms: &[(usize, usize, usize)],
        idx: usize,
        frames: &mut [Option<Option<Hypothetical>>],
    ) -> Option<Consequent> {
        let (pattern, start, end) = *terms.get(idx)?;
        let from = sentence_start(text, start);
        // No clause break and no word ending a clause before the term: no
        // earlier clause in its sentence.
        if !text[from..start].contains(is_clause_break)
            && hypotheticals()
                .ends
                .matches(text, from..start)
                .next()
                .is_none()
        {
            return None;
        }
        for j in (0..idx).rev() {
            let (pj, sj, ej) = terms[j];
            if sj < from {
                break;
            }
            if self.pattern_kind[pj] == TermKind::Benign || ej > start {
                continue;
            }
            let frame = *frames.get_mut(j)?.get_or_insert_with(|| {
                hypothetical_of(text, sj, ej, &first_person().around(text, sj, ej))
            });
            let Some(h) = frame else {
                continue;
            };
            // A supposition that tells of the past is a fact: its main
            // clause is read as before.
            if h.past {
                return None;
            }
            if h.scope_end > start {
                continue;
            }
            if !h.generic && self.pattern_category[pj] != self.pattern_category[pattern] {
                continue;
            }
            return consequent_clause(text, start, end, h).map(|clause| Consequent {
                frame: h,
                supposed: Some((sj, ej)),
                clause,
            });
        }
        // A generic conditional without a term ("If someone steals a bike,
        // can they go to jail?").
        let words = hypotheticals();
        let found: Vec<(usize, usize, usize)> =
            words.phrases.matches_with_word(text, from..start).collect();
        found
            .into_iter()
            .rev()
            .filter(|&(w, _, _)| {
                words
                    .info
                    .get(w)
                    .is_some_and(|i| i.kind == PhraseKind::Generic)
            })
            .filter_map(|m| frame_of_phrase(text, from, m, &[]))
            .find(|h| h.scope_end <= start)
            .and_then(|h| {
                consequent_clause(text, start, end, h).map(|clause| Consequent {
                    frame: h,
                    supposed: None,
                    clause,
                })
            })
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
        self.matches_with_word(text, range).map(|(_, s, e)| (s, e))
    }

    /// [`Self::matches`] with the index of the word found (into `words`).
    fn matches_with_word<'t>(
        &'t self,
        text: &'t str,
        range: std::ops::Range<usize>,
    ) -> impl Iterator<Item = (usize, usize, usize)> + 't {
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
                let syllable_ok =
                    !is_one_hangul_syllable(&w.text) || hangul_word_alone(text, m.start(), m.end());
                w.kind != TermKind::Benign && alone && case_ok && syllable_ok
            })
            .map(|m| (m.pattern().as_usize(), m.start(), m.end()))
    }
}

/// Whether `word` is one Hangul syllable ("제", "내").
fn is_one_hangul_syllable(word: &str) -> bool {
    let mut chars = word.chars();
    matches!((chars.next(), chars.next()), (Some(c), None) if is_hangul_syllable(c))
}

fn is_hangul_syllable(c: char) -> bool {
    ('\u{AC00}'..='\u{D7A3}').contains(&c)
}

/// Whether the one-syllable word at `start..end` is a word of its own: no
/// Hangul syllable right before it, a space after it and no digit after
/// that ("제 빚" is "my debt"; "문제", "제품" are other words, "제 3조" an
/// ordinal).
fn hangul_word_alone(text: &str, start: usize, end: usize) -> bool {
    let before_ok = text
        .get(..start)
        .and_then(|h| h.chars().next_back())
        .is_none_or(|c| !is_hangul_syllable(c));
    let after = text.get(end..).unwrap_or("");
    let rest = after.trim_start();
    before_ok
        && after.starts_with(char::is_whitespace)
        && !rest.starts_with(|c: char| c.is_ascii_digit())
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

/// The built-in categories in which a denial is not a disclosure: "I don't
/// have diabetes", "no tengo deudas", "I was never arrested". In the others
/// a denial still discusses the person ("I'm not gay", "I'm no longer a
/// Muslim", "I don't live at …", "my son isn't in kindergarten"), and
/// operator-defined categories are the operator's. Entities (IDs, cards,
/// e-mails) are never affected: they are recognizers, not categories.
pub const NEGATION_CLEARS: [&str; 3] = ["health", "finance", "legal"];

/// How far (bytes) before a term a negation marker, and after it a
/// postposed one (`借金はありません`), is looked for.
const NEGATION_REACH: usize = 48;

/// How far (bytes) before a term a hypothetical phrase is looked for, and
/// after a denied term a contrast word.
const FRAME_REACH: usize = 160;

/// At least the length in bytes of the longest phrase of
/// `hypotheticals.txt` (checked by a test).
const HYPOTHETICAL_PHRASE_MAX: usize = 32;

/// Words that may stand between a negation marker and the term it denies
/// (at most [`NEGATION_MAX_FILLERS`] of them): "I don't have *any* debt",
/// "never *been diagnosed with* diabetes", "nunca *he sido* detenido",
/// "从来没有*被*逮捕过". Anything else (a verb, a cue, a comma) ends the
/// denial's reach: "I'm not able to pay my mortgage" denies nothing.
const NEGATION_FILLERS: &[&str] = &[
    "any",
    "a",
    "an",
    "ever",
    "been",
    "diagnosed",
    "with",
    "really",
    "actually",
    "he",
    "ha",
    "han",
    "sido",
    "tenido",
    "me",
    "ido",
    "de",
    "d'",
    "un",
    "une",
    "eu",
    "été",
    "任何",
    "过",
    "得过",
    "患过",
    "被",
    "得",
    "患",
];

/// See [`NEGATION_FILLERS`].
const NEGATION_MAX_FILLERS: usize = 3;

/// Negation markers (`data/context/negations.txt`): plain lines before the
/// term, `~` lines after it, `!` phrases that deny nothing.
const NEGATIONS: &str = include_str!("../data/context/negations.txt");

/// What keeps a denial counting (`data/context/negation_limits.txt`):
/// contrast and change words after the term, `~` status terms.
const NEGATION_LIMITS: &str = include_str!("../data/context/negation_limits.txt");

/// Hypothetical and generic-conditional phrases
/// (`data/context/hypotheticals.txt`).
const HYPOTHETICALS: &str = include_str!("../data/context/hypotheticals.txt");

/// A term that a negation or a hypothetical frame set aside, or that was
/// seen in one and still counts, and why: `tandem route explain` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TermNote {
    pub category: String,
    /// The term's byte span.
    pub start: usize,
    pub end: usize,
    /// The disclosure cue it counted with (or would have), if any.
    pub cue: Option<(usize, usize)>,
    pub frame: FrameNote,
}

impl TermNote {
    /// Whether the term still counts.
    pub fn counted(&self) -> bool {
        matches!(
            self.frame,
            FrameNote::NegationKept { .. }
                | FrameNote::HypotheticalKept { .. }
                | FrameNote::ConsequentKept { .. }
        )
    }
}

/// A [`TermNote`] as the explains serve it (`tandem route explain --json`
/// `frames`, the edge admin API's `POST /v1/route/explain` `frames`):
/// byte offsets only, never the text.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FrameReport {
    pub category: String,
    /// The term's byte span.
    pub start: usize,
    pub end: usize,
    /// The disclosure cue it counted with (or would have), if any.
    pub cue: Option<(usize, usize)>,
    /// `negated`, `negation_kept`, `hypothetical`, `hypothetical_kept`,
    /// `consequent`, `consequent_kept`, `question_header`.
    pub frame: &'static str,
    /// The marker's bytes: the phrase ("don't have", "if someone", "假如")
    /// or a conditional ending ("になったら"); for `question_header`, the
    /// header's word ("questions", "疑问").
    pub marker: (usize, usize),
    /// Consequents: the term of the conditional clause the supposition is
    /// about.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub supposed: Option<(usize, usize)>,
    /// Why a consequent's term was set aside.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aside_because: Option<&'static str>,
    /// Hypotheticals: a conditional about nobody in particular.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generic: Option<bool>,
    /// Whether the term still counts.
    pub counted: bool,
    /// Why a term a frame touched still counts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept_because: Option<&'static str>,
}

impl From<&TermNote> for FrameReport {
    fn from(n: &TermNote) -> FrameReport {
        let (mut supposed, mut aside_because) = (None, None);
        let (frame, marker, generic, kept_because) = match n.frame {
            FrameNote::Negated { marker } => ("negated", marker, None, None),
            FrameNote::NegationKept { marker, why } => {
                ("negation_kept", marker, None, Some(why.reason()))
            }
            FrameNote::Hypothetical { marker, generic } => {
                ("hypothetical", marker, Some(generic), None)
            }
            FrameNote::HypotheticalKept {
                marker,
                generic,
                why,
            } => (
                "hypothetical_kept",
                marker,
                Some(generic),
                Some(why.reason()),
            ),
            FrameNote::Consequent {
                marker,
                generic,
                supposed: term,
                why,
            } => {
                supposed = term;
                aside_because = Some(why.reason());
                ("consequent", marker, Some(generic), None)
            }
            FrameNote::ConsequentKept {
                marker,
                generic,
                supposed: term,
                why,
            } => {
                supposed = term;
                ("consequent_kept", marker, Some(generic), Some(why.reason()))
            }
            FrameNote::QuestionHeader { word } => ("question_header", word, None, None),
        };
        FrameReport {
            category: n.category.clone(),
            start: n.start,
            end: n.end,
            cue: n.cue,
            frame,
            marker,
            supposed,
            aside_because,
            generic,
            counted: n.counted(),
            kept_because,
        }
    }
}

/// The negation or hypothetical frame a term was read in (spans are the
/// marker phrase's bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameNote {
    /// Denied ("I don't have diabetes", "借金はありません"): set aside.
    Negated { marker: (usize, usize) },
    /// Denied, and counted all the same (see [`NegationKept`]).
    NegationKept {
        marker: (usize, usize),
        why: NegationKept,
    },
    /// In a hypothetical ("if I had cancer, would …", "suppose my father
    /// were diagnosed"), a future conditional ("if I ever get arrested",
    /// "将来もし認知症になったら") or, `generic`, a conditional about nobody in
    /// particular ("if someone is arrested"), with no cue of its own in the
    /// clause and no past: set aside. The frame covers its conditional
    /// clause only, up to its clause break or a word that ends it ("then",
    /// "的话", "たら").
    Hypothetical {
        marker: (usize, usize),
        generic: bool,
    },
    /// In a hypothetical, and counted all the same (see
    /// [`HypotheticalKept`]).
    HypotheticalKept {
        marker: (usize, usize),
        generic: bool,
        why: HypotheticalKept,
    },
    /// In the main clause of a supposition ("If I had cancer, would my
    /// insurer pay for chemotherapy?") or of a generic conditional ("如果有人
    /// 酒驾被抓了，会被判刑吗？") whose conditional clause holds `supposed`,
    /// with no cue there that counts (see [`ConsequentAside`]; the note's
    /// cue is the refused one): set aside.
    Consequent {
        marker: (usize, usize),
        generic: bool,
        supposed: Option<(usize, usize)>,
        why: ConsequentAside,
    },
    /// In such a main clause, and counted all the same: a cue of its own
    /// there ([`HypotheticalKept::MainClauseCue`]) or the past.
    ConsequentKept {
        marker: (usize, usize),
        generic: bool,
        supposed: Option<(usize, usize)>,
        why: HypotheticalKept,
    },
    /// A list item that would have counted by its header's cue (the
    /// note's cue), or as a plain term on its own, but the header names
    /// questions (`word`: "My questions:", "Mis preguntas:", "我的疑问："):
    /// the items are read as a topic, and a term counts only with a cue of
    /// its own. Not counted.
    QuestionHeader { word: (usize, usize) },
}

/// Why a term in a hypothetical frame still counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HypotheticalKept {
    /// A cue in the clause that is not the supposition's subject ("if
    /// someone finds *my* HIV results"), or the subject as the term's own
    /// possessive ("si algún día *mi* depresión vuelve").
    OwnCue,
    /// The clause tells of the past ("If I had cancer *as a child*, would
    /// …", "in 2015"): a statement of fact in a hypothetical's shape.
    Past,
    /// In a supposition's or a generic conditional's main clause: a cue
    /// there that is not an institution's possessive nor bound to the mood
    /// ("would it matter that *my* mother has leukemia", "*我*妈的高血压",
    /// "my chemotherapy").
    MainClauseCue,
}

impl HypotheticalKept {
    /// A short reason for `tandem route explain`.
    pub fn reason(self) -> &'static str {
        match self {
            HypotheticalKept::OwnCue => {
                "a cue in the clause is not the supposition's subject, or is the term's possessive"
            }
            HypotheticalKept::Past => "the clause tells of the past: a statement of fact",
            HypotheticalKept::MainClauseCue => {
                "a cue in the main clause is neither an institution's possessive nor bound to the mood"
            }
        }
    }
}

/// Why a denied term still counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NegationKept {
    /// Not one of [`NEGATION_CLEARS`]: a denial still discusses it.
    Category,
    /// A status term: its denial is itself a status (HIV, pregnancy).
    Status,
    /// A contrast or a change follows in the sentence ("but", "anymore",
    /// "yet", "了", "けど").
    Limited,
}

impl NegationKept {
    /// A short reason for `tandem route explain`.
    pub fn reason(self) -> &'static str {
        match self {
            NegationKept::Category => "a denial still discusses this category",
            NegationKept::Status => "the denial of this condition is itself a status",
            NegationKept::Limited => "a contrast or a change of state follows",
        }
    }
}

fn negations() -> &'static ContextWords {
    static WORDS: OnceLock<ContextWords> = OnceLock::new();
    WORDS.get_or_init(|| ContextWords::new(NEGATIONS))
}

fn negation_limits() -> &'static ContextWords {
    static WORDS: OnceLock<ContextWords> = OnceLock::new();
    WORDS.get_or_init(|| {
        let plain: String = NEGATION_LIMITS
            .lines()
            .filter(|l| !l.trim_start().starts_with('~'))
            .map(|l| format!("{l}\n"))
            .collect();
        ContextWords::new(&plain)
    })
}

fn status_terms() -> &'static [String] {
    static TERMS: OnceLock<Vec<String>> = OnceLock::new();
    TERMS.get_or_init(|| {
        parse_terms(NEGATION_LIMITS)
            .filter(|t| t.kind == TermKind::Personal)
            .map(|t| t.text.to_lowercase())
            .collect()
    })
}

/// Whether `term` (its text) is one whose denial is itself a status.
fn is_status_term(term: &str) -> bool {
    let t = term.to_lowercase();
    status_terms().iter().any(|s| t.contains(s.as_str()))
}

/// Bytes that end a sentence: a contrast word or a hypothetical reaches no
/// further.
fn is_sentence_break(c: char) -> bool {
    matches!(c, '.' | '?' | '!' | ';' | '\n' | '。' | '？' | '！' | '；')
}

/// Bytes that end a clause: a hypothetical's scope.
fn is_clause_break(c: char) -> bool {
    is_sentence_break(c) || matches!(c, ',' | ':' | '，' | '、' | '：')
}

/// The largest char boundary of `text` at or below `i`.
fn floor_char(text: &str, i: usize) -> usize {
    let mut i = i.min(text.len());
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// The marker that denies the term at `start..end`, if any: a plain marker
/// of `negations.txt` ending right before it (fillers allowed), or a `~`
/// marker right after it.
fn negation_marker(text: &str, start: usize, end: usize) -> Option<(usize, usize)> {
    let words = negations();
    let from = floor_char(text, start.saturating_sub(NEGATION_REACH));
    let before = words
        .matches_with_word(text, from..start)
        .filter(|&(w, _, e)| words.words[w].kind == TermKind::Plain && e <= start)
        .filter(|&(_, _, e)| text.get(e..start).is_some_and(only_fillers))
        .last()
        .map(|(_, s, e)| (s, e));
    if before.is_some() {
        return before;
    }
    let to = floor_char(text, end.saturating_add(NEGATION_REACH));
    // Every postposed marker is Japanese or Korean.
    if text.as_bytes().get(end..to).is_none_or(<[u8]>::is_ascii) {
        return None;
    }
    words
        .matches_with_word(text, end..to)
        .take(1)
        .filter(|&(w, s, _)| {
            words.words[w].kind == TermKind::Personal
                && text.get(end..s).is_some_and(|g| g.trim().is_empty())
        })
        .map(|(_, s, e)| (s, e))
        .next()
}

/// Whether `gap` holds nothing but up to [`NEGATION_MAX_FILLERS`] filler
/// words (spaces between them; Han fillers may touch).
fn only_fillers(gap: &str) -> bool {
    let mut rest = gap.trim();
    for _ in 0..NEGATION_MAX_FILLERS {
        if rest.is_empty() {
            return true;
        }
        let next = NEGATION_FILLERS.iter().find_map(|f| {
            let head = rest.get(..f.len())?;
            if !head.eq_ignore_ascii_case(f) {
                return None;
            }
            let tail = &rest[f.len()..];
            // An ASCII filler is a whole word.
            let whole = !f.is_ascii()
                || f.ends_with('\'')
                || tail.is_empty()
                || tail.starts_with(char::is_whitespace);
            whole.then_some(tail)
        });
        match next {
            Some(tail) => rest = tail.trim_start(),
            None => return false,
        }
    }
    rest.is_empty()
}

/// Whether a contrast or change word (`negation_limits.txt`) follows `from`
/// in the same sentence.
fn negation_limited(text: &str, from: usize) -> bool {
    let to = floor_char(text, from.saturating_add(FRAME_REACH));
    let end = text
        .get(from..to)
        .and_then(|t| t.find(is_sentence_break))
        .map_or(to, |i| from + i);
    // A sentence that ends in 了 tells a change of state ("我没有抑郁症了":
    // no longer); 了 elsewhere is a word's part (了解).
    let sentence = text.get(from..end).unwrap_or("");
    sentence.trim_end().ends_with('了')
        || negation_limits().matches(text, from..end).next().is_some()
}

/// A hypothetical frame whose clause holds a term.
#[derive(Clone, Copy)]
struct Hypothetical {
    /// The phrase ("if someone", "假如"), or for a frame made by a
    /// conditional ending after the term ("になったら", "걸리면"), the ending.
    marker: (usize, usize),
    /// A conditional about nobody in particular ("if someone").
    generic: bool,
    /// Where the frame's clause starts: the phrase, or for an ending the
    /// clause's first byte.
    clause_start: usize,
    /// Where the frame's clause ends: the next clause break, or the end of
    /// a word that ends a conditional clause ("then", "的话", "たら").
    scope_end: usize,
    /// The cue that is the supposition's own subject ("suppose *my*",
    /// "假如*我*", "*제가* … 걸리면"), if any.
    subject: Option<(usize, usize)>,
    /// A past-time marker in the clause ("as a child", "last year", "去年",
    /// a year): a fact about the past in a hypothetical's shape ("If I had
    /// cancer as a child, would I …"). Never set for generic frames.
    past: bool,
}

/// How a phrase of `hypotheticals.txt` frames its clause.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PhraseKind {
    /// About nobody in particular ("if someone"), anywhere in the sentence.
    Generic,
    /// A supposition ("suppose", "if I had … would"), opening its clause.
    Counterfactual,
    /// A plain conditional ("if I", "si", "wenn ich", "如果"), opening its
    /// clause: a frame only when its clause holds an eventuality marker
    /// ("ever", "one day", "algún día", "irgendwann", "以后"): a future
    /// conditional. "If I have diabetes, can I …" stays a statement.
    Conditional,
}

/// One phrase of `hypotheticals.txt`: its kind and its mood words (a
/// counterfactual needs one later in the sentence, or an eventuality
/// marker in its clause; none listed: none needed), and for a conditional
/// the verb endings that make it a supposition (see [`subjunctive_after`]).
struct PhraseInfo {
    kind: PhraseKind,
    moods: Vec<String>,
    /// `-ending` (a supposition by itself) or `~-ending` (`true`: only with
    /// a mood word, a mood ending or a question mark later in the
    /// sentence), lower case.
    endings: Vec<(String, bool)>,
}

/// The word lists of `hypotheticals.txt`.
struct HypotheticalWords {
    /// `generic:`, `counterfactual:` and `conditional:` phrases.
    phrases: ContextWords,
    /// Per phrase (same index).
    info: Vec<PhraseInfo>,
    /// `end:` words that end a conditional clause without punctuation
    /// ("then", "entonces", "的话", "たら", "다면"); `~` ones are also
    /// conditional endings that frame their clause by themselves
    /// ("になったら", "걸리면": if … becomes, if … catches).
    ends: ContextWords,
    /// `eventual:` markers of a future eventuality ("ever", "one day",
    /// "get diagnosed", "algún día", "irgendwann", "un jour", "以后",
    /// "将来", "나중에").
    eventual: ContextWords,
    /// `past:` markers of a past time ("last year", "as a child", "el año
    /// pasado", "letztes Jahr", "l'an dernier", "去年", "昨年", "작년").
    past: ContextWords,
    /// `mood:` words that make a main clause a supposition's consequent
    /// ("would", "würde", "会", "ますか"); see [`Consequent`].
    moods: ContextWords,
    /// `mood: -ending` lines: word endings of the conditional ("ría",
    /// "rait"), lower case.
    mood_endings: Vec<String>,
    /// `institution:` nouns whose possessive in a consequent is no cue
    /// ("my insurer", "meine Krankenkasse", "我的保险").
    institutions: ContextWords,
}

/// The lists of `hypotheticals.txt` (see [`HypotheticalWords`]).
fn hypotheticals() -> &'static HypotheticalWords {
    static WORDS: OnceLock<HypotheticalWords> = OnceLock::new();
    WORDS.get_or_init(|| {
        let (mut phrases, mut ends, mut eventual, mut past) =
            (String::new(), String::new(), String::new(), String::new());
        let (mut moods, mut institutions) = (String::new(), String::new());
        let mut mood_endings = Vec::new();
        let mut info = Vec::new();
        for line in HYPOTHETICALS.lines() {
            let line = line.split('#').next().unwrap_or("").trim();
            let Some((label, rest)) = line.split_once(':') else {
                continue;
            };
            let list = match label {
                "end" => &mut ends,
                "eventual" => &mut eventual,
                "past" => &mut past,
                "institution" => &mut institutions,
                "mood" => match rest.trim().strip_prefix('-') {
                    Some(ending) => {
                        mood_endings.push(ending.trim().to_lowercase());
                        continue;
                    }
                    None => &mut moods,
                },
                _ => {
                    let kind = match label {
                        "generic" => PhraseKind::Generic,
                        "counterfactual" => PhraseKind::Counterfactual,
                        "conditional" => PhraseKind::Conditional,
                        _ => continue,
                    };
                    let (phrase, moods) = rest.split_once('|').unwrap_or((rest, ""));
                    let phrase = phrase.trim();
                    if phrase.is_empty() {
                        continue;
                    }
                    phrases.push_str(phrase);
                    phrases.push('\n');
                    let (mut words, mut endings) = (Vec::new(), Vec::new());
                    for m in moods.split(',').map(|m| m.trim().to_lowercase()) {
                        if let Some(e) = m.strip_prefix("~-") {
                            endings.push((e.to_string(), true));
                        } else if let Some(e) = m.strip_prefix('-') {
                            endings.push((e.to_string(), false));
                        } else if !m.is_empty() {
                            words.push(m);
                        }
                    }
                    info.push(PhraseInfo {
                        kind,
                        moods: words,
                        endings,
                    });
                    continue;
                }
            };
            list.push_str(rest.trim());
            list.push('\n');
        }
        HypotheticalWords {
            phrases: ContextWords::new(&phrases),
            info,
            ends: ContextWords::new(&ends),
            eventual: ContextWords::new(&eventual),
            past: ContextWords::new(&past),
            moods: ContextWords::new(&moods),
            mood_endings,
            institutions: ContextWords::new(&institutions),
        }
    })
}

/// The first byte after the last sentence break before `start`, at most
/// [`FRAME_REACH`] bytes back.
fn sentence_start(text: &str, start: usize) -> usize {
    let reach = floor_char(text, start.saturating_sub(FRAME_REACH));
    after_last_break(text, reach, start, is_sentence_break)
}

/// The first byte after the last clause break in `text[from..to]` (`from`
/// when there is none).
fn clause_start(text: &str, from: usize, to: usize) -> usize {
    after_last_break(text, from, to, is_clause_break)
}

/// The first byte after the last character of `text[from..to]` that
/// `is_break` accepts (`from` when there is none).
fn after_last_break(text: &str, from: usize, to: usize, is_break: fn(char) -> bool) -> usize {
    text.get(from..to)
        .and_then(|t| t.rfind(is_break))
        .map_or(from, |i| {
            from + i + text[from + i..].chars().next().map_or(1, char::len_utf8)
        })
}

/// Where the clause running from `from` ends: at its next clause break,
/// or at the end of a word that ends a conditional clause without
/// punctuation ("then", "的话", "たら", "다면"; `end:` lines), whichever
/// comes first, at most [`FRAME_REACH`] bytes on. Also the span of that
/// word when it is a conditional ending that frames its clause by itself
/// (`~`: "になったら", "걸리면").
fn clause_end(text: &str, from: usize) -> (usize, Option<(usize, usize)>) {
    let to = floor_char(text, from.saturating_add(FRAME_REACH));
    let brk = text
        .get(from..to)
        .and_then(|t| t.find(is_clause_break))
        .map_or(to, |i| from + i);
    let ends = &hypotheticals().ends;
    match ends.matches_with_word(text, from..brk).next() {
        Some((w, s, e)) => (
            e,
            (ends.words[w].kind == TermKind::Personal).then_some((s, e)),
        ),
        None => (brk, None),
    }
}

/// Whether `text[from..to]` tells of the past: a `past:` marker, or a year
/// (1900–2099, a number of four digits alone).
fn tells_past(text: &str, from: usize, to: usize) -> bool {
    if hypotheticals()
        .past
        .matches(text, from..to)
        .next()
        .is_some()
    {
        return true;
    }
    let b = text.as_bytes();
    let digit = |i: usize| b.get(i).is_some_and(u8::is_ascii_digit);
    (from..to.saturating_sub(3)).any(|i| {
        matches!(b.get(i..i + 2), Some(b"19" | b"20"))
            && digit(i + 2)
            && digit(i + 3)
            && !(i > 0 && digit(i - 1))
            && !digit(i + 4)
    })
}

/// Whether `text[from..to]` holds only what may stand between a
/// supposition and its subject: spaces, commas, a connective ("if",
/// "that", "que", "dass", "もし", "만약", "혹시") and eventuality markers
/// ("Si algún día me …", "将来もし私が …", "나중에 제가 …").
fn only_connectives(text: &str, from: usize, to: usize) -> bool {
    const CONNECTIVES: [&str; 7] = ["if", "that", "que", "dass", "もし", "만약", "혹시"];
    let mut pos = from;
    let mut rest = String::new();
    for (s, e) in hypotheticals().eventual.matches(text, from..to) {
        rest.push_str(text.get(pos..s).unwrap_or(""));
        rest.push(' ');
        pos = e;
    }
    rest.push_str(text.get(pos..to).unwrap_or(""));
    rest.split(|c: char| c.is_whitespace() || matches!(c, ',' | '，' | '、'))
        .all(|w| w.is_empty() || CONNECTIVES.contains(&w.to_lowercase().as_str()))
}

/// The cue that is the subject of a supposition whose phrase (or, for an
/// ending, whose clause's start) is `marker`: a cue inside the phrase ("if
/// *I* had"), or the first one after it with only connectives in between
/// (see [`only_connectives`]).
fn subject_of(
    text: &str,
    marker: (usize, usize),
    cues: &[(usize, usize)],
) -> Option<(usize, usize)> {
    cues.iter().copied().find(|&(cs, ce)| {
        (cs >= marker.0 && ce <= marker.1)
            || (cs >= marker.1 && only_connectives(text, marker.1, cs))
    })
}

/// Whether `cue` stands right before the term starting at `start` as its
/// possessive ("my depression", "mi depresión", "我的抑郁症", "私の借金",
/// "제 빚"), or as the possessive of the person whose term it is ("my
/// sister's lupus", "我妈的高血压", "私の母の糖尿病"): then the term is the
/// writer's or a real person's, even as a supposition's subject ("Si
/// algún día mi depresión vuelve", "如果以后我的抑郁症复发") or in its main
/// clause.
fn possessive_of(text: &str, cue: (usize, usize), start: usize) -> bool {
    const POSSESSIVES: [&str; 20] = [
        "my", "our", "mi", "mis", "nuestro", "nuestra", "mein", "meine", "meinem", "meinen",
        "meiner", "meines", "unser", "unsere", "mon", "ma", "mes", "notre", "제", "내",
    ];
    let (Some(word), Some(gap)) = (text.get(cue.0..cue.1), text.get(cue.1..start)) else {
        return false;
    };
    let word = word.to_lowercase();
    let possessive = POSSESSIVES.contains(&word.as_str());
    // "my sister's": one word with 's between the possessive and the term.
    let genitive = |g: &str| {
        let g = g.trim();
        !g.contains(char::is_whitespace)
            && g.len() > 2
            && (g.ends_with("'s") || g.ends_with("’s"))
            && g.chars().next().is_some_and(char::is_alphabetic)
    };
    // "妈的", "の母の": at most three characters ending in 的 or の.
    let cjk_genitive = |g: &str| {
        (g.ends_with('的') || g.ends_with('の'))
            && g.chars().count() <= 4
            && !g.contains(|c: char| c.is_whitespace() || is_clause_break(c) || c.is_ascii())
    };
    (possessive && !gap.is_empty() && gap.trim().is_empty())
        || (possessive && gap.starts_with(char::is_whitespace) && genitive(gap))
        || cjk_genitive(gap)
}

/// The frame a phrase of `hypotheticals.txt` found at `s..e` (phrase `w`)
/// in the sentence starting at `from` makes, if its conditions hold: a
/// counterfactual or a conditional opens its clause (only eventuality
/// markers before it); a counterfactual with mood words finds one later in
/// the sentence or an eventuality marker in its clause; a conditional
/// finds an eventuality marker in its clause.
fn frame_of_phrase(
    text: &str,
    from: usize,
    (w, s, e): (usize, usize, usize),
    cues: &[(usize, usize)],
) -> Option<Hypothetical> {
    let words = hypotheticals();
    let info = words.info.get(w)?;
    // The clause: after the phrase (and a comma right after it) to its end.
    let after = e + text[e..]
        .find(|c: char| !(c.is_whitespace() || matches!(c, ',' | '，' | '、')))
        .unwrap_or(text.len() - e);
    let (scope_end, _) = clause_end(text, after);
    let generic = info.kind == PhraseKind::Generic;
    if !generic {
        let opened = clause_start(text, from, s);
        if !only_connectives(text, opened, s) {
            return None;
        }
        let eventual = || {
            words
                .eventual
                .matches(text, opened..scope_end)
                .next()
                .is_some()
        };
        let holds = match info.kind {
            PhraseKind::Conditional => eventual() || subjunctive_after(text, e, info),
            _ if info.moods.is_empty() => true,
            _ => {
                let to = floor_char(text, e.saturating_add(FRAME_REACH));
                let sentence = &text[e..to];
                let sentence =
                    &sentence[..sentence.find(is_sentence_break).unwrap_or(sentence.len())];
                let lower = sentence.to_lowercase();
                info.moods.iter().any(|m| lower.contains(m.as_str())) || eventual()
            }
        };
        if !holds {
            return None;
        }
    }
    Some(Hypothetical {
        marker: (s, e),
        generic,
        clause_start: s,
        scope_end,
        subject: (!generic).then(|| subject_of(text, (s, e), cues)).flatten(),
        past: !generic && tells_past(text, clause_start(text, from, s), scope_end),
    })
}

/// Words that may stand between a conditional's phrase and the verb whose
/// ending [`subjunctive_after`] reads: Spanish clitics, subject pronouns
/// and "no" ("si *me* declarara", "si *yo no* tuviese", "si *se lo*
/// dijera").
const SUBJUNCTIVE_SKIP: [&str; 23] = [
    "me", "te", "se", "nos", "os", "le", "les", "lo", "la", "los", "las", "yo", "tú", "tu", "él",
    "ella", "usted", "nosotros", "nosotras", "ellos", "ellas", "ustedes", "no",
];

/// Whether the first word after a conditional's phrase ending at `e`
/// (past [`SUBJUNCTIVE_SKIP`] words) ends in one of the phrase's verb
/// endings (`hypotheticals.txt`: the Spanish imperfect subjunctive, "si me
/// *declarara*", "si *tuviese*", "si *diera*"), with a letter before the
/// ending; an ending that is also a present-tense form ("declara", "pase")
/// needs two letters before it ("para" is no verb) and holds only with a
/// mood word or ending, or a question mark, later in the sentence.
fn subjunctive_after(text: &str, e: usize, info: &PhraseInfo) -> bool {
    if info.endings.is_empty() {
        return false;
    }
    let to = floor_char(text, e.saturating_add(FRAME_REACH));
    let Some(rest) = text.get(e..to) else {
        return false;
    };
    let sentence = &rest[..rest.find(is_sentence_break).unwrap_or(rest.len())];
    let mut words = sentence
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .skip_while(|w| SUBJUNCTIVE_SKIP.contains(&w.as_str()));
    let Some(verb) = words.next() else {
        return false;
    };
    let letters = verb.chars().count();
    let Some(&(_, needs_mood)) = info
        .endings
        .iter()
        .filter(|&(ending, needs_mood)| {
            verb.ends_with(ending.as_str())
                && letters > ending.chars().count() + usize::from(*needs_mood)
        })
        .max_by_key(|(ending, _)| ending.len())
    else {
        return false;
    };
    if !needs_mood {
        return true;
    }
    let mood_words = &hypotheticals().moods;
    let rest_start = e + sentence.len();
    sentence.contains(['?', '¿'])
        || text
            .get(rest_start..)
            .is_some_and(|t| t.starts_with(['?', '？']))
        || mood_words.matches(text, e..rest_start).next().is_some()
        || words.any(|w| has_mood_ending(&w))
}

/// The hypothetical frame of the term at `start..end`, if it is in one:
/// the last phrase of `hypotheticals.txt` before it in its sentence whose
/// clause holds it (see [`frame_of_phrase`]), or else a conditional ending
/// right after it in its clause ("認知症になったら", "치매에 걸리면"). `cues` are
/// the disclosure cues near the term (to find the supposition's subject).
fn hypothetical_of(
    text: &str,
    start: usize,
    end: usize,
    cues: &[(usize, usize)],
) -> Option<Hypothetical> {
    let from = sentence_start(text, start);
    // Only a phrase in the term's clause, or one right before the comma
    // that opens it ("Hypothetically, …", "Angenommen, …"), can hold it:
    // search from a phrase's length before the last clause break.
    let search_from = text[from..start].rfind(is_clause_break).map_or(from, |i| {
        floor_char(text, (from + i).saturating_sub(HYPOTHETICAL_PHRASE_MAX)).max(from)
    });
    let words = hypotheticals();
    let found: Vec<(usize, usize, usize)> = words
        .phrases
        .matches_with_word(text, search_from..start)
        .collect();
    let framed = found
        .into_iter()
        .rev()
        .filter_map(|m| frame_of_phrase(text, from, m, cues))
        .find(|h| start < h.scope_end);
    framed.or_else(|| conditional_ending(text, from, start, end, cues))
}

/// The frame of a conditional ending after the term at `start..end` in
/// its clause ("将来もし認知症*になったら*", "제가 치매에 *걸리면*"); every such
/// ending is Japanese or Korean, so an ASCII rest of the clause is skipped.
fn conditional_ending(
    text: &str,
    from: usize,
    start: usize,
    end: usize,
    cues: &[(usize, usize)],
) -> Option<Hypothetical> {
    let to = floor_char(text, end.saturating_add(FRAME_REACH));
    if text.as_bytes().get(end..to).is_none_or(<[u8]>::is_ascii) {
        return None;
    }
    let (scope_end, ending) = clause_end(text, end);
    let marker = ending?;
    let opened = clause_start(text, from, start);
    Some(Hypothetical {
        marker,
        generic: false,
        clause_start: opened,
        scope_end,
        subject: subject_of(text, (opened, opened), cues),
        past: tells_past(text, opened, scope_end),
    })
}

/// Whether `cue`, before the term starting at `start`, is the subject of a
/// supposition whose clause ended before the term ("假设*我*被起诉了，需要请律师吗":
/// the supposition's subject is no disclosure cue for the main clause).
fn subject_of_an_earlier_clause(
    text: &str,
    start: usize,
    cue: (usize, usize),
    cues: &[(usize, usize)],
) -> bool {
    // Only a cue whose clause ends before the term.
    if cue.1 > start || clause_end(text, cue.1).0 > start {
        return false;
    }
    let from = sentence_start(text, cue.0);
    let words = hypotheticals();
    let found: Vec<(usize, usize, usize)> = words
        .phrases
        .matches_with_word(text, from..start)
        .filter(|&(_, s, _)| s <= cue.0)
        .collect();
    found
        .into_iter()
        .rev()
        .filter_map(|m| frame_of_phrase(text, from, m, cues))
        .any(|h| {
            h.scope_end <= start
                && ((cue.0 >= h.marker.0 && cue.1 <= h.marker.1) || h.subject == Some(cue))
        })
}

/// The main clause of a supposition or a generic conditional, holding a
/// term (issue 32: "If I had cancer, would my insurer pay for
/// chemotherapy?", "如果有人酒驾被抓了，会被判刑吗？"): the clause right after
/// the frame's conditional clause, when it asks or is in the conditional
/// mood (see [`asks_or_supposes`]) and the conditional clause holds a
/// term (`supposed`) of the same category (a supposition) or of any
/// category (a generic conditional). See `hypotheticals.txt`.
#[derive(Clone, Copy)]
struct Consequent {
    frame: Hypothetical,
    /// The term of the conditional clause (none for a generic conditional
    /// without one: "If someone steals a bike, can they go to jail?").
    supposed: Option<(usize, usize)>,
    /// The main clause's bytes: from the end of the conditional clause (and
    /// the comma after it) to its next clause break.
    clause: (usize, usize),
}

/// The bytes of the main clause after frame `h` that holds the term at
/// `start..end`, if it is one (see [`Consequent`]): the term's clause
/// follows the conditional clause (past its comma, no other clause break
/// before the term), and it asks or supposes.
fn consequent_clause(
    text: &str,
    start: usize,
    end: usize,
    h: Hypothetical,
) -> Option<(usize, usize)> {
    let rest = text.get(h.scope_end..start)?;
    let trimmed = rest.trim_start();
    let trimmed = trimmed
        .strip_prefix([',', '，', '、'])
        .unwrap_or(trimmed)
        .trim_start();
    if trimmed.contains(is_clause_break) {
        return None;
    }
    let clause_from = start - trimmed.len();
    let to = floor_char(text, end.saturating_add(FRAME_REACH));
    let clause_to = text[end..to].find(is_clause_break).map_or(to, |i| end + i);
    asks_or_supposes(text, clause_from, clause_to).then_some((clause_from, clause_to))
}

/// Whether the clause `text[from..to]` asks (`?`, `？` or `¿`) or holds a
/// `mood:` word or ending: a consequent ("would my insurer pay", "会被判刑吗",
/// "¿mi seguro pagaría", "逮捕されますか").
fn asks_or_supposes(text: &str, from: usize, to: usize) -> bool {
    let Some(clause) = text.get(from..to) else {
        return false;
    };
    let words = hypotheticals();
    text.get(to..).is_some_and(|t| t.starts_with(['?', '？']))
        || clause.contains(['¿', '?', '？'])
        || words.moods.matches(text, from..to).next().is_some()
        || clause
            .split(|c: char| !c.is_alphanumeric())
            .any(|w| has_mood_ending(&w.to_lowercase()))
}

/// Whether `word` (lower case) ends in a `mood: -ending` of
/// `hypotheticals.txt` and is more than that ending ("pagaría", "paierait").
fn has_mood_ending(word: &str) -> bool {
    hypotheticals()
        .mood_endings
        .iter()
        .any(|e| word.len() > e.len() + 1 && word.ends_with(e.as_str()))
}

/// Why a cue in a supposition's main clause is no disclosure cue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConsequentAside {
    /// The main clause has no cue near the term.
    NoCue,
    /// The cue is the possessive of an institution ("my insurer", "meine
    /// Krankenkasse", "我的保险"): the writer's dealings with it, in the
    /// supposed world.
    Institution,
    /// The cue is bound to the mood ("would my wife", "I'd", "will I",
    /// "me cubriría", "我会"): the supposition's subject in its consequence.
    Mood,
}

impl ConsequentAside {
    /// A short reason for `tandem route explain`.
    pub fn reason(self) -> &'static str {
        match self {
            ConsequentAside::NoCue => "no cue of its own in the main clause",
            ConsequentAside::Institution => {
                "its cue is an institution's possessive, in the supposed world"
            }
            ConsequentAside::Mood => {
                "its cue is bound to the conditional mood, in the supposed world"
            }
        }
    }
}

/// Why `cue`, in a supposition's main clause, is no disclosure cue for the
/// term starting at `start`, if it is none: the term's own possessive (or
/// a person's: "my sister's lupus") always counts; the possessive of an
/// `institution:` word and a cue next to a `mood:` word do not.
fn consequent_cue_refusal(
    text: &str,
    cue: (usize, usize),
    start: usize,
) -> Option<ConsequentAside> {
    if possessive_of(text, cue, start) {
        return None;
    }
    let words = hypotheticals();
    // The word after the cue (a particle 的/の/의 skipped), and before it.
    let after = text.get(cue.1..).unwrap_or("");
    let after_trim = after.trim_start();
    let next = cue.1 + (after.len() - after_trim.len());
    let noun = ["的", "の", "의"]
        .iter()
        .find_map(|p| after_trim.strip_prefix(p).map(|_| next + p.len()))
        .unwrap_or(next);
    let starts_at = |list: &ContextWords, at: usize| {
        let to = floor_char(text, at.saturating_add(40));
        list.matches(text, at..to)
            .next()
            .is_some_and(|(s, _)| s == at)
    };
    if starts_at(&words.institutions, noun) {
        return Some(ConsequentAside::Institution);
    }
    let cue_word = text.get(cue.0..cue.1).unwrap_or("").to_lowercase();
    let next_word = after_trim
        .split(|c: char| c.is_whitespace() || (c.is_ascii_punctuation() && c != '\''))
        .next()
        .unwrap_or("")
        .to_lowercase();
    let before = text.get(..cue.0).unwrap_or("").trim_end();
    let before_from = floor_char(text, before.len().saturating_sub(24));
    let mood_before = words
        .moods
        .matches(text, before_from..before.len())
        .last()
        .is_some_and(|(_, e)| e == before.len());
    let bound = matches!(cue_word.as_str(), "i'd" | "i’d" | "i'll" | "i’ll")
        || starts_at(&words.moods, next)
        || has_mood_ending(&next_word)
        || mood_before;
    bound.then_some(ConsequentAside::Mood)
}

/// The disclosure cue of the term at `start..end`: the nearest of `cues`
/// in [`CONTEXT_WINDOW`] that is not the subject of a supposition whose
/// clause ended before the term (see [`subject_of_an_earlier_clause`]), or
/// else the cue of the header of a list that holds the term (see
/// [`list_header_cue`]). Also, when the term has no cue of its own and
/// the header of its list names questions, (the header's cue, the word):
/// the cue it did not lend.
#[allow(clippy::type_complexity)]
fn disclosure_cue(
    text: &str,
    start: usize,
    end: usize,
    cues: &[(usize, usize)],
) -> (
    Option<(usize, usize)>,
    Option<((usize, usize), (usize, usize))>,
) {
    let mut cue = nearest_in_window(text, start, end, cues);
    if let Some(c) = cue.filter(|&c| subject_of_an_earlier_clause(text, start, c, cues)) {
        let rest: Vec<(usize, usize)> = cues.iter().copied().filter(|&x| x != c).collect();
        cue = nearest_in_window(text, start, end, &rest);
    }
    if let Some(c) = cue {
        // A cue in an inline header that names questions ("My homework
        // questions: what is a mortgage …") is no closer to the items for
        // being near.
        let inline = c.1 <= start
            && text
                .get(c.1..start)
                .is_some_and(|g| g.contains([':', '：']) && !g.contains('\n'));
        if !inline {
            return (cue, None);
        }
        return match list_header_cue(text, start) {
            Some(HeaderCue::Questions { word, header, .. })
                if c.0 >= header.0 && c.1 <= header.1 =>
            {
                let rest: Vec<(usize, usize)> = cues
                    .iter()
                    .copied()
                    .filter(|&(s, e)| !(s >= header.0 && e <= header.1))
                    .collect();
                match nearest_in_window(text, start, end, &rest) {
                    Some(other) => (Some(other), None),
                    None => (None, Some((c, word))),
                }
            }
            _ => (cue, None),
        };
    }
    match list_header_cue(text, start) {
        Some(HeaderCue::Cue(c)) => (Some(c), None),
        Some(HeaderCue::Questions { cue, word, .. }) => (None, Some((cue, word))),
        None => (None, None),
    }
}

/// The cue a list header lends its items (see [`list_header_cue`]).
enum HeaderCue {
    Cue((usize, usize)),
    /// The header names questions or schoolwork (`word`; "My questions:",
    /// "Mis preguntas:", "我的疑问：", `question_headers.txt`): the
    /// questions are the writer's, what they ask about is not, so the
    /// header's `cue` is not lent.
    Questions {
        cue: (usize, usize),
        word: (usize, usize),
        /// The header's bytes.
        header: (usize, usize),
    },
}

/// Words that make a list header a header of questions
/// (`data/context/question_headers.txt`).
const QUESTION_HEADERS: &str = include_str!("../data/context/question_headers.txt");

fn question_headers() -> &'static ContextWords {
    static WORDS: OnceLock<ContextWords> = OnceLock::new();
    WORDS.get_or_init(|| ContextWords::new(QUESTION_HEADERS))
}

/// How many lines above a list item its header is looked for.
const LIST_MAX_LINES: usize = 40;

/// How far (bytes) back a list's line start or header is looked for.
const LIST_REACH: usize = 400;

/// Whether `line` is a list item: it starts (after spaces) with a bullet
/// (`-`, `*`, `+`, `•`, `·`, `・`, `–`) or a number and `.`, `)` or `、`.
fn is_list_item(line: &str) -> bool {
    let t = line.trim_start();
    if t.starts_with(['-', '*', '+', '•', '·', '・', '–']) {
        return true;
    }
    let digits = t.len() - t.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    digits > 0 && digits <= 3 && t[digits..].starts_with(['.', ')', '、'])
}

/// The start of the line that holds byte `i - 1` (the line `i` ends or is
/// in), if it is within [`LIST_REACH`] bytes: after the last `\n` before
/// `i`, or the text's start.
fn line_start_before(text: &str, i: usize) -> Option<usize> {
    let from = floor_char(text, i.saturating_sub(LIST_REACH));
    match text.get(from..i)?.rfind('\n') {
        Some(n) => Some(from + n + 1),
        None => (from == 0).then_some(0),
    }
}

/// The disclosure cue of the header of a list that holds the term at
/// `start`, if any: every item of "My conditions: diabetes, asthma,
/// depression" or of "my diagnoses:" followed by bullet lines ("- asthma")
/// is about the writer, however far from "My" it is. The list is
/// * bulleted: the term's line is a list item (see [`is_list_item`]), and
///   the header is the first line above the run of items, ending in a
///   colon (`:`, `：`); or
/// * inline: the term follows a colon on its line with no sentence break
///   in between, and the header is the text from the sentence's start to
///   the colon.
///
/// The header's last cue counts, unless the header names questions
/// ([`HeaderCue::Questions`]).
fn list_header_cue(text: &str, start: usize) -> Option<HeaderCue> {
    let line_start = line_start_before(text, start)
        .unwrap_or_else(|| floor_char(text, start.saturating_sub(LIST_REACH)));
    let header = if is_list_item(&text[line_start..start]) {
        // Walk up over the items to the header line.
        let mut end = line_start;
        let mut header = None;
        for _ in 0..LIST_MAX_LINES {
            let prev_end = end.checked_sub(1)?;
            let prev_start = line_start_before(text, prev_end)?;
            let line = &text[prev_start..prev_end];
            if !is_list_item(line) {
                header = line
                    .trim_end()
                    .ends_with([':', '：'])
                    .then_some((prev_start, prev_end));
                break;
            }
            end = prev_start;
        }
        header?
    } else {
        let line = &text[line_start..start];
        let colon = line.rfind([':', '：'])?;
        if line[colon..].contains(is_sentence_break) {
            return None;
        }
        let colon = line_start + colon;
        (
            after_last_break(text, line_start, colon, is_sentence_break),
            colon,
        )
    };
    let cue = first_person()
        .find(text, header.0..header.1)
        .last()
        .copied()?;
    Some(
        match question_headers().matches(text, header.0..header.1).next() {
            Some(word) => HeaderCue::Questions { cue, word, header },
            None => HeaderCue::Cue(cue),
        },
    )
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

    /// The category names of the hits, sorted and deduplicated.
    fn cats(lx: &Lexicon, text: &str) -> Vec<String> {
        let mut c: Vec<String> = lx.scan(text).into_iter().map(|h| h.category).collect();
        c.sort();
        c.dedup();
        c
    }

    /// `text` still fires `cat` (with the categories and the frame notes
    /// in the failure message).
    fn assert_fires(lx: &Lexicon, text: &str, cat: &str) {
        assert!(
            cats(lx, text).iter().any(|c| c == cat),
            "{text}: {:?} {:?}",
            cats(lx, text),
            notes(lx, text)
        );
    }

    /// (term, marker, frame kind) of each note, as text.
    fn notes(lx: &Lexicon, text: &str) -> Vec<(String, String, &'static str)> {
        lx.scan_explained(text)
            .1
            .into_iter()
            .map(|n| {
                let (marker, kind) = match n.frame {
                    FrameNote::Negated { marker } => (marker, "negated"),
                    FrameNote::NegationKept { marker, .. } => (marker, "negation-kept"),
                    FrameNote::Hypothetical { marker, .. } => (marker, "hypothetical"),
                    FrameNote::HypotheticalKept { marker, .. } => (marker, "hypothetical-kept"),
                    FrameNote::Consequent { marker, .. } => (marker, "consequent"),
                    FrameNote::ConsequentKept { marker, .. } => (marker, "consequent-kept"),
                    FrameNote::QuestionHeader { word } => (word, "question-header"),
                };
                (
                    text[n.start..n.end].to_string(),
                    text[marker.0..marker.1].to_string(),
                    kind,
                )
            })
            .collect()
    }

    #[test]
    fn denials_in_health_finance_and_legal_are_set_aside() {
        let lx = builtin();
        for text in [
            "I don't have diabetes.",
            "I was never arrested.",
            "I have never been diagnosed with depression.",
            "I'm not in debt.",
            "no tengo deudas",
            "Nunca he sido detenido.",
            "ich habe keine Schulden",
            "je n'ai pas de dettes",
            "我没有抑郁症",
            "我从来没有被逮捕过",
            "借金はありません",
            "逮捕されたことはありません",
            "저는 우울증이 없어요",
        ] {
            assert!(cats(&lx, text).is_empty(), "{text}: {:?}", cats(&lx, text));
            assert!(
                notes(&lx, text).iter().all(|n| n.2 == "negated"),
                "{text}: {:?}",
                notes(&lx, text)
            );
            assert!(!notes(&lx, text).is_empty(), "{text}: no note");
        }
        assert_eq!(
            notes(&lx, "I don't have diabetes."),
            [("diabetes".into(), "don't have".into(), "negated")]
        );
        assert_eq!(
            notes(&lx, "借金はありません"),
            [("借金".into(), "はありません".into(), "negated")]
        );
    }

    #[test]
    fn denials_that_still_count() {
        let lx = builtin();
        for (text, cat) in [
            // Other categories: a denial still discusses them.
            ("I'm not gay.", "sexual"),
            ("I'm not a Christian.", "religion"),
            // Status terms.
            ("I don't have HIV.", "health"),
            ("I'm not pregnant.", "health"),
            ("我没有怀孕", "health"),
            // A contrast or a change of state after the term.
            ("I don't have diabetes, but my mother does.", "health"),
            ("I'm not in debt anymore.", "finance"),
            ("我没有抑郁症了", "health"),
            ("借金はありませんが、", "finance"),
            // Phrases that deny nothing.
            ("I'm not sure if my HIV test came back.", "health"),
            ("I no longer take sertraline.", "health"),
            ("ya no tengo cáncer", "health"),
            ("我还没确诊抑郁症", "health"),
            ("癌ではないかと心配です", "health"),
            // The marker does not reach the term.
            ("I'm not able to pay my mortgage.", "finance"),
            ("I never told my boss about my arrest.", "legal"),
            ("我没有钱还房贷", "finance"),
            ("No, I have diabetes.", "health"),
        ] {
            assert_fires(&lx, text, cat);
        }
        assert_eq!(
            notes(&lx, "I'm not gay."),
            [("gay".into(), "I'm not".into(), "negation-kept")]
        );
    }

    #[test]
    fn hypotheticals_are_topics() {
        let lx = builtin();
        for text in [
            "If I had cancer, would insurance pay for it?",
            "What happens if someone is arrested?",
            "Suppose my father were diagnosed with Alzheimer's.",
            "Hypothetically, if my father were diagnosed with cancer",
            "Si alguien es detenido",
            "Supongamos que tuviera cáncer",
            "Angenommen, ich hätte Krebs",
            "Si quelqu'un a des dettes",
            "假如我得了癌症，保险能赔多少",
            "如果有人被逮捕，家属能做什么",
            "仮に私が癌になったら",
            "誰かが逮捕されたら",
            "만약 제가 암 진단을 받는다면",
        ] {
            assert!(cats(&lx, text).is_empty(), "{text}: {:?}", cats(&lx, text));
            assert!(
                notes(&lx, text).iter().all(|n| n.2 == "hypothetical"),
                "{text}: {:?}",
                notes(&lx, text)
            );
        }
        assert_eq!(
            notes(&lx, "What happens if someone is arrested?"),
            [("arrested".into(), "if someone".into(), "hypothetical")]
        );
    }

    #[test]
    fn statements_of_fact_and_own_cues_in_a_hypothetical_still_count() {
        let lx = builtin();
        for (text, cat) in [
            (
                "My father was diagnosed with Alzheimer's last year.",
                "health",
            ),
            ("If I had surgery last month, can I fly?", "health"),
            ("What happens if someone finds out about my HIV?", "health"),
            ("I suppose my diabetes is getting worse.", "health"),
            (
                "If I had cancer, would insurance pay? I have leukemia.",
                "health",
            ),
            ("假如我爸知道我欠了网贷", "finance"),
            ("要是我得了癌症怎么办", "health"),
            ("もし癌だったらどうしよう", "health"),
        ] {
            assert_fires(&lx, text, cat);
        }
        assert_eq!(
            notes(&lx, "What happens if someone finds out about my HIV?"),
            [("HIV".into(), "if someone".into(), "hypothetical-kept")]
        );
    }

    /// The categories of `text` that a frame note says were set aside.
    fn set_aside(lx: &Lexicon, text: &str) -> Vec<&'static str> {
        notes(lx, text)
            .into_iter()
            .filter(|n| n.2 == "hypothetical")
            .map(|n| n.2)
            .collect()
    }

    #[test]
    fn a_hypothetical_covers_its_conditional_clause_only() {
        let lx = builtin();
        // The clause ends at a word as well as at a comma: a cue in the
        // main clause is not the conditional's own.
        for text in [
            "Imagine if I had cancer then my wife would have to sell the house",
            "Si tuviera cáncer entonces mi esposa tendría que vender la casa",
            "Wenn ich Krebs hätte dann müsste meine Frau das Haus verkaufen",
            "Si j'avais un cancer alors ma femme devrait vendre la maison",
            "假如我有癌症的话我老婆要卖房子",
            "仮に私が癌になったら母が悲しむ",
            "만약 제가 우울증에 걸린다면 아내가 집을 팔아야 하나요",
            // The supposition's subject is no cue for the main clause.
            "假设我被公司起诉了，需要请律师吗",
            "Suppose I were sued, would a lawyer be expensive?",
        ] {
            assert!(cats(&lx, text).is_empty(), "{text}: {:?}", cats(&lx, text));
            assert!(
                !set_aside(&lx, text).is_empty(),
                "{text}: {:?}",
                notes(&lx, text)
            );
        }
        // A disclosure in the main clause counts.
        for (text, cat) in [
            ("If you ask, I have cancer.", "health"),
            ("假如你问的话，我有乙肝", "health"),
            ("Suppose I were sued, then my lawyer would call.", "legal"),
        ] {
            assert_fires(&lx, text, cat);
        }
    }

    #[test]
    fn future_conditionals_are_hypotheticals() {
        let lx = builtin();
        for (text, cat) in [
            (
                "If I ever get sued by a client, does my insurance cover it?",
                "legal",
            ),
            (
                "If I develop diabetes later, will I lose my licence?",
                "health",
            ),
            (
                "Si algún día tengo deudas, ¿me pueden embargar la casa?",
                "finance",
            ),
            (
                "Wenn ich irgendwann Schulden habe, was passiert mit dem Haus?",
                "finance",
            ),
            (
                "Si jamais j'ai des dettes, la banque peut-elle saisir ma maison ?",
                "finance",
            ),
            ("如果将来我欠了网贷，会影响孩子吗", "finance"),
            ("いつか私が逮捕されたら家族に連絡が行きますか", "legal"),
            ("언젠가 제가 체포되면 가족에게 연락이 가나요", "legal"),
        ] {
            assert!(
                !cats(&lx, text).iter().any(|c| c == cat),
                "{text}: {:?} {:?}",
                cats(&lx, text),
                notes(&lx, text)
            );
            assert!(
                !set_aside(&lx, text).is_empty(),
                "{text}: {:?}",
                notes(&lx, text)
            );
        }
        // No eventuality, or not a clause's opening conditional: a
        // statement; a plan in the future is a fact; the term's own
        // possessive as the subject: the writer's.
        for (text, cat) in [
            (
                "Si algún día mi depresión vuelve, ¿puedo pedir la baja?",
                "health",
            ),
            ("如果以后我的抑郁症复发了怎么办", "health"),
            ("If I have diabetes, can I eat mangoes?", "health"),
            ("I wonder if I will ever beat this cancer.", "health"),
            ("I will start chemotherapy next week.", "health"),
            ("下周我要开始化疗了。", "health"),
            ("要是我得了癌症怎么办", "health"),
            ("もし癌だったらどうしよう", "health"),
        ] {
            assert_fires(&lx, text, cat);
        }
    }

    #[test]
    fn past_statements_in_a_hypothetical_shape_count() {
        let lx = builtin();
        for (text, cat) in [
            (
                "If I had leukemia as a kid, would insurers still cover me?",
                "health",
            ),
            (
                "Suppose I was arrested in 2015, would it still show up?",
                "legal",
            ),
            ("假如我去年被起诉过，现在还能考公务员吗", "legal"),
            // Again, a relapse: it happened before.
            ("If I ever get arrested again, will I lose my job?", "legal"),
            (
                "Si algún día tengo cáncer otra vez, ¿me cubre el seguro?",
                "health",
            ),
            ("如果以后抑郁症又复发了，能请病假吗", "health"),
        ] {
            assert_fires(&lx, text, cat);
            let kept: Vec<_> = lx
                .scan_explained(text)
                .1
                .into_iter()
                .filter(|n| {
                    matches!(
                        n.frame,
                        FrameNote::HypotheticalKept {
                            why: HypotheticalKept::Past,
                            ..
                        }
                    )
                })
                .collect();
            assert!(!kept.is_empty(), "{text}: {:?}", notes(&lx, text));
        }
        // A generic conditional stays about nobody.
        assert!(cats(&lx, "What if someone was arrested last year?").is_empty());
    }

    #[test]
    fn years_and_past_markers() {
        let past = |t: &str| tells_past(t, 0, t.len());
        assert!(past("in 2015"));
        assert!(past("as a child"));
        assert!(past("去年"));
        assert!(!past("port 20155"));
        assert!(!past("v12019"));
        assert!(!past("next week"));
    }

    #[test]
    fn past_disclosures_fire_in_every_language() {
        let lx = builtin();
        for (text, cat) in [
            ("I was diagnosed with lupus in 2021.", "health"),
            ("Mi padre fue arrestado el martes.", "legal"),
            ("Mein Vater wurde verhaftet.", "legal"),
            ("Bei mir wurde Diabetes diagnostiziert.", "health"),
            ("Mon père a été arrêté mardi.", "legal"),
            ("J'ai fait faillite.", "finance"),
            ("我去年被诊断出糖尿病。", "health"),
            ("我爸上周被抓了。", "legal"),
            ("私は去年破産しました。", "finance"),
            ("夫が有罪判決を受けました。", "legal"),
            ("저는 작년에 파산했어요.", "finance"),
            ("남편이 유죄 판결을 받았어요.", "legal"),
        ] {
            assert_fires(&lx, text, cat);
        }
    }

    /// The cue of each hit of `cat` in `text`, as text (`-` for none).
    fn cues(lx: &Lexicon, text: &str, cat: &str) -> Vec<(String, String)> {
        lx.scan(text)
            .into_iter()
            .filter(|h| h.category == cat)
            .map(|h| {
                let cue = h.cue.map_or("-", |(s, e)| &text[s..e]);
                (text[h.start..h.end].to_string(), cue.to_string())
            })
            .collect()
    }

    #[test]
    fn lists_carry_their_header_cue() {
        let lx = builtin();
        let pair = |a: &str, b: &str| (a.to_string(), b.to_string());
        assert_eq!(
            cues(
                &lx,
                "My debts:\n- mortgage\n- car loan\n- student loan",
                "finance"
            ),
            [
                pair("My debts", "-"),
                pair("mortgage", "My"),
                pair("car loan", "My"),
                pair("student loan", "My")
            ]
        );
        // Inline, further than the context window from "My".
        let inline = "My monthly outgoings: rent, groceries, phone, gym, streaming, the car loan and the mortgage";
        assert!(inline.find("mortgage").unwrap() > CONTEXT_WINDOW + 2);
        assert_eq!(
            cues(&lx, inline, "finance"),
            [pair("car loan", "My"), pair("mortgage", "My")]
        );
        // A topic frame: the items count by the header's cue.
        assert_eq!(
            cues(
                &lx,
                "Explain the difference between these for my own records. My diagnoses:\n- asthma\n- depression",
                "health"
            ),
            [pair("asthma", "My"), pair("depression", "My")]
        );
        assert_eq!(
            cues(&lx, "我的负债情况：\n- 房贷\n- 车贷", "finance"),
            [pair("负债", "我"), pair("房贷", "我"), pair("车贷", "我")]
        );
        assert_eq!(
            cues(
                &lx,
                "Meine Schulden:\n1. Kredit fürs Auto\n2. Dispo",
                "finance"
            ),
            [pair("Schulden", "Meine"), pair("Kredit", "Meine")]
        );
        // No cue in the header, no colon, or the list has ended.
        for text in [
            "Loan types:\n- mortgage\n- car loan",
            "My notes.\n- mortgage\n- car loan",
        ] {
            assert!(cats(&lx, text).is_empty(), "{text}: {:?}", cats(&lx, text));
        }
        assert_eq!(
            cues(
                &lx,
                "My debts:\n- car loan\nUnrelated: what is a mortgage?",
                "finance"
            ),
            [pair("My debts", "-"), pair("car loan", "My")]
        );
    }

    /// (term, cue, frame kind, reason) of each consequent or question
    /// header note, as text.
    fn main_clause_notes(lx: &Lexicon, text: &str) -> Vec<(String, String, &'static str)> {
        lx.scan_explained(text)
            .1
            .into_iter()
            .filter_map(|n| {
                let kind = match n.frame {
                    FrameNote::Consequent { why, .. } => why.reason(),
                    FrameNote::ConsequentKept { why, .. } => why.reason(),
                    FrameNote::QuestionHeader { .. } => "question header",
                    _ => return None,
                };
                let cue = n.cue.map_or("-", |(s, e)| &text[s..e]);
                Some((text[n.start..n.end].to_string(), cue.to_string(), kind))
            })
            .collect()
    }

    #[test]
    fn a_suppositions_main_clause_is_in_the_supposition() {
        let lx = builtin();
        let inst = ConsequentAside::Institution.reason();
        let mood = ConsequentAside::Mood.reason();
        let none = ConsequentAside::NoCue.reason();
        let own = HypotheticalKept::MainClauseCue.reason();
        let t = |a: &str, b: &str, c| (a.to_string(), b.to_string(), c);
        for (text, want) in [
            (
                "If I had cancer, would my insurer pay for chemotherapy?",
                t("chemotherapy", "my", inst),
            ),
            (
                "Si tuviera cáncer, ¿me cubriría el seguro la quimioterapia?",
                t("quimioterapia", "me", mood),
            ),
            (
                "Wenn ich Krebs hätte, würde meine Versicherung die Chemo zahlen?",
                t("Chemo", "meine", inst),
            ),
            (
                "Si j'avais un cancer, est-ce que mon assurance paierait la chimio ?",
                t("chimio", "mon", inst),
            ),
            (
                "假如我得了癌症，我的保险能报销化疗吗？",
                t("化疗", "我", inst),
            ),
            (
                "If I had cancer, would my wife get depression?",
                t("depression", "my", mood),
            ),
            (
                "If I ever get diagnosed with cancer, will I need chemotherapy?",
                t("chemotherapy", "I", mood),
            ),
            // A generic conditional's main clause, with or without a term
            // in the condition.
            ("如果有人酒驾被抓了，会被判刑吗？", t("被判", "-", none)),
            (
                "If someone defaults on a payday loan, can they be sued?",
                t("sued", "-", none),
            ),
        ] {
            assert!(cats(&lx, text).is_empty(), "{text}: {:?}", cats(&lx, text));
            assert_eq!(main_clause_notes(&lx, text), [want], "{text}");
        }
        for (text, cat, want) in [
            (
                "If I had cancer, would it matter that my mother has leukemia?",
                "health",
                t("leukemia", "my", own),
            ),
            (
                "If I had cancer, would my sister's diabetes make her a bad donor?",
                "health",
                t("diabetes", "my", own),
            ),
            (
                "If I had cancer, would my chemotherapy be covered?",
                "health",
                t("chemotherapy", "my", own),
            ),
            (
                "假如我得了癌症，我妈的高血压会不会加重？",
                "health",
                t("高血压", "我", own),
            ),
            (
                "If I had cancer, would my insurer still pay for the chemotherapy I had last year?",
                "health",
                t("chemotherapy", "I", own),
            ),
            (
                "If I had cancer, would my insurer cover chemotherapy again like last year?",
                "health",
                t("chemotherapy", "my", HypotheticalKept::Past.reason()),
            ),
            (
                "如果有人欠钱不还，我老公会被起诉吗？",
                "legal",
                t("被起诉", "老公", own),
            ),
        ] {
            assert_fires(&lx, text, cat);
            assert_eq!(main_clause_notes(&lx, text), [want], "{text}");
        }
        // Not a consequent: another category, a statement, a later clause.
        for (text, cat) in [
            (
                "If I ever get sued, will they find out I have depression?",
                "health",
            ),
            (
                "If I ever get arrested, my brother already has a criminal record.",
                "legal",
            ),
            (
                "If I had cancer, would it hurt, and is my chemo schedule too tight?",
                "health",
            ),
        ] {
            assert_fires(&lx, text, cat);
            assert!(main_clause_notes(&lx, text).is_empty(), "{text}");
        }
    }

    #[test]
    fn one_syllable_korean_markers_stand_alone() {
        let lx = builtin();
        assert_eq!(
            cues(&lx, "제 빚은 3천만 원이에요", "finance"),
            [("빚".to_string(), "제".to_string())]
        );
        assert_eq!(
            cues(&lx, "내 대출이 너무 많아요", "finance"),
            [("대출".to_string(), "내".to_string())]
        );
        for text in [
            "대출 금리 문제 좀 설명해 주세요",
            "제품 대출 조건을 비교해 주세요",
            "제 3조 대출 한도에 대해 설명해 주세요",
            "국내 대출 금리를 알려 주세요",
        ] {
            assert!(cats(&lx, text).is_empty(), "{text}: {:?}", cats(&lx, text));
        }
    }

    #[test]
    fn headers_that_name_questions_lend_no_cue() {
        let lx = builtin();
        for text in [
            "My questions:\n- How does a mortgage work?\n- What does a lawyer charge?",
            "My homework questions: what is a mortgage and how is a student loan repaid?",
            "Meine Fragen:\n- Wie funktioniert ein Kredit?",
            "我的疑问：\n- 房贷是怎么计算的？",
            "제 질문:\n- 대출 금리는 어떻게 정해지나요?",
        ] {
            assert!(cats(&lx, text).is_empty(), "{text}: {:?}", cats(&lx, text));
            let notes = main_clause_notes(&lx, text);
            assert!(
                !notes.is_empty() && notes.iter().all(|n| n.2 == "question header"),
                "{text}: {notes:?}"
            );
        }
        // The header of the writer's affairs, and an item's own cue.
        assert_eq!(
            cues(&lx, "My money worries:\n- the mortgage", "finance"),
            [("mortgage".to_string(), "My".to_string())]
        );
        assert_eq!(
            cues(
                &lx,
                "My questions:\n- can I deduct my mortgage interest?",
                "finance"
            ),
            [("my mortgage".to_string(), "-".to_string())]
        );
    }

    #[test]
    fn hypothetical_phrases_fit_the_search_window() {
        let words = &hypotheticals().phrases;
        assert!(words.words.len() > 50);
        for w in &words.words {
            assert!(w.text.len() <= HYPOTHETICAL_PHRASE_MAX, "{}", w.text);
        }
    }

    #[test]
    fn negation_fillers() {
        assert!(only_fillers(""));
        assert!(only_fillers(" any "));
        assert!(only_fillers(" been diagnosed with "));
        assert!(only_fillers("被"));
        assert!(!only_fillers(" able to pay my "));
        assert!(!only_fillers(" anywhere "));
        assert!(!only_fillers(", I have "));
        assert!(!only_fillers(" a a a a "));
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

    #[test]
    fn spanish_imperfect_subjunctive_after_si_is_a_supposition() {
        let lx = builtin();
        // "si" + an imperfect subjunctive (-ara/-iera/-ase/-iese, every
        // person), past clitics and pronouns: a supposition; its subject is
        // no cue, and a consequent that asks is read in the supposition.
        for text in [
            "Si me diagnosticaran cáncer, ¿el seguro pagaría la quimioterapia?",
            "Si yo tuviese depresión, ¿podría seguir trabajando?",
            "Si me hospitalizasen por depresión, ¿quién pagaría?",
            "Si me diera un infarto, ¿quién cuidaría de mi perro?",
            "Si nos declaráramos en quiebra, ¿perderíamos la casa?",
            "Si yo tuviera esquizofrenia, ¿me lo dirían?",
        ] {
            assert!(
                cats(&lx, text).is_empty(),
                "{text}: {:?} {:?}",
                cats(&lx, text),
                notes(&lx, text)
            );
        }
        assert_eq!(
            set_aside(&lx, "Si me diagnosticaran cáncer, ¿el seguro pagaría?"),
            ["hypothetical"]
        );
        // Statements: the present indicative, an ambiguous -ara form
        // ("declara" of declarar) with no mood and no question, a word that
        // only ends like one ("para"), and English (no endings there).
        for (text, cat) in [
            (
                "Si me declaro en quiebra, ¿qué pasa con mi hipoteca?",
                "finance",
            ),
            (
                "Si me declara en quiebra el juez, pierdo la casa.",
                "finance",
            ),
            (
                "Si para el lunes no pago mi hipoteca, me quedo sin casa.",
                "finance",
            ),
            ("Si tengo cáncer, ¿puedo donar sangre?", "health"),
            (
                "If I erase my medical records, would anyone know?",
                "health",
            ),
        ] {
            assert_fires(&lx, text, cat);
        }
        let info = |phrase: &str| {
            let words = hypotheticals();
            let w = words.phrases.words.iter().position(|t| t.text == phrase);
            w.and_then(|w| words.info.get(w))
        };
        let si = info("si").expect("si");
        assert!(subjunctive_after("si me declarara en quiebra?", 2, si));
        assert!(!subjunctive_after("si me declarara en quiebra", 2, si));
        assert!(subjunctive_after("si tuviésemos", 2, si));
        assert!(subjunctive_after("si diera", 2, si));
        assert!(!subjunctive_after("si para", 2, si));
        assert!(!subjunctive_after("si tengo", 2, si));
        let if_i = info("if I").expect("if I");
        assert!(!subjunctive_after("if I lease a car, would", 4, if_i));
    }

    #[test]
    fn question_header_items_need_a_cue_of_their_own() {
        let lx = builtin();
        // The items of a header that names questions are questions about a
        // topic: a plain term there counts only with a cue of its own.
        for text in [
            "我想请教几个问题：\n- 离婚需要多久？\n- 判刑和缓刑有什么区别？",
            "My questions:\n- Is a DUI a felony?\n- How long does probation last?",
            "My questions: how long does probation last?",
        ] {
            assert!(cats(&lx, text).is_empty(), "{text}: {:?}", cats(&lx, text));
            let notes = main_clause_notes(&lx, text);
            assert!(
                !notes.is_empty() && notes.iter().all(|n| n.2 == "question header"),
                "{text}: {notes:?}"
            );
        }
        for (text, cat) in [
            ("我想请教几个问题：\n- 我离婚了，房贷怎么办？", "legal"),
            (
                "My questions:\n- I was arrested last week, what now?",
                "legal",
            ),
            // A header that names no questions: its items count as before.
            ("我的情况：\n- 离婚\n- 判刑", "legal"),
            ("Notes:\n- probation", "legal"),
        ] {
            assert_fires(&lx, text, cat);
        }
    }

    #[test]
    fn chronic_conditions_are_health_terms() {
        let lx = builtin();
        for text in [
            "My sister has lupus and gets flare-ups",
            "I was diagnosed with celiac disease",
            "My husband has COPD",
            "Mi madre tiene fibromialgia",
            "Mein Vater hat Multiple Sklerose",
            "Ma femme a la sclérose en plaques",
            "母がクローン病です",
            "제 아버지가 파킨슨병이에요",
            "我妈有类风湿",
        ] {
            assert_fires(&lx, text, "health");
        }
        for text in [
            "Canis lupus familiaris is the domestic dog",
            "Explain the difference between Crohn's and colitis for a biology class",
        ] {
            assert!(cats(&lx, text).is_empty(), "{text}: {:?}", cats(&lx, text));
        }
    }
}
