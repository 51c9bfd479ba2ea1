//! Operator policy: TOML in, a validated, compiled [`Policy`] out.
//!
//! ```toml
//! version = 1
//! default = "speculative"        # action when no rule fires
//! min_score = 0.5                # entity threshold unless overridden
//!
//! [thresholds]                   # per-entity thresholds
//! PERSON_NAME = 0.8
//!
//! [allow]                        # never flag these values
//! values = ["4111 1111 1111 1111"]
//! patterns = ['@corp\.example$']
//!
//! [keywords]                     # extra lexicon terms; new names are new categories
//! health = ["long covid"]
//! internal = ["project bluebird"]
//! finance = ["~ stipend", "! stipend api"]  # ~: needs "my"/"I"/"我" near; !: a benign sense
//!
//! [[recognizers]]                # custom entity types
//! name = "EMPLOYEE_ID"
//! pattern = 'EMP-[0-9]{6}'
//! score = 0.8
//! validator = "luhn"             # optional: luhn | mod97 | cn-id
//! context = ["employee", "工号"]
//! context_required = false
//!
//! [[rules]]                      # first match wins
//! name = "secrets"
//! action = "local"
//! entities = ["SECRET"]          # any of; "*" = any entity
//! categories = ["health"]        # any of; "*" = any category
//! min_score = 0.7                # optional, on top of the thresholds
//! rtt_ms_above = 800.0           # network: known RTT above this
//! rtt_ms_below = 50.0
//! breaker_open = true
//! battery_below = 15             # device: known battery % below this
//! thermal_at_least = 2           # 0 nominal, 1 fair, 2 serious, 3 critical
//! charging = false
//! power_save = true
//! user_opt_out = true
//! ```
//!
//! All conditions of a rule must hold; list conditions hold when any listed
//! item is present. Errors name the line, column and field.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use regex::Regex;
use serde::Deserialize;
use toml::Spanned;

use crate::classify::{compact_value, resolve_overlaps, Classification, Classifier};
use crate::lexicon::{parse_terms, Lexicon, Term, BUILTIN_CATEGORIES};
use crate::recognizers::{self, Check, Pattern, Validator, WordSet};
use crate::types::{Action, CategoryHit, Decision, EntityHit, EntityKind, RouteContext};

/// A policy that could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The file is not valid TOML, or a field has the wrong type or name.
    #[error("line {line}, column {column}{}: {message}{}", field_suffix(field), snippet_suffix(*line, snippet))]
    Parse {
        line: usize,
        column: usize,
        field: Option<String>,
        message: String,
        snippet: String,
    },
    /// The TOML is well-formed but a value is not acceptable.
    #[error("line {line}, column {column}, field `{field}`: {message}{}", snippet_suffix(*line, snippet))]
    Invalid {
        line: usize,
        column: usize,
        field: String,
        message: String,
        snippet: String,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {inner}")]
    InFile {
        path: PathBuf,
        inner: Box<PolicyError>,
    },
}

fn field_suffix(f: &Option<String>) -> String {
    f.as_ref()
        .map(|f| format!(", field `{f}`"))
        .unwrap_or_default()
}

fn snippet_suffix(line: usize, s: &str) -> String {
    if s.is_empty() {
        String::new()
    } else {
        format!("\n  {line} | {s}")
    }
}

impl PolicyError {
    /// The 1-based line the error points at, if it has one.
    pub fn line(&self) -> Option<usize> {
        match self {
            PolicyError::Parse { line, .. } | PolicyError::Invalid { line, .. } => Some(*line),
            PolicyError::InFile { inner, .. } => inner.line(),
            PolicyError::Io { .. } => None,
        }
    }

    /// The field the error is about, if known.
    pub fn field(&self) -> Option<&str> {
        match self {
            PolicyError::Parse { field, .. } => field.as_deref(),
            PolicyError::Invalid { field, .. } => Some(field),
            PolicyError::InFile { inner, .. } => inner.field(),
            PolicyError::Io { .. } => None,
        }
    }
}

/// 1-based line and column of a byte offset, and that line's text.
fn locate(src: &str, offset: usize) -> (usize, usize, String) {
    let offset = offset.min(src.len());
    let before = &src[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    let text = src[line_start..].lines().next().unwrap_or("").trim_end();
    (line, column, text.to_string())
}

/// The key assigned on a line like `  foo = ...`, if any.
fn key_of_line(line: &str) -> Option<String> {
    let (k, _) = line.split_once('=')?;
    let k = k.trim().trim_matches('"');
    (!k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)))
    .then(|| k.to_string())
}

struct Ctx<'a> {
    src: &'a str,
}

impl Ctx<'_> {
    fn err(
        &self,
        span: Range<usize>,
        field: impl Into<String>,
        msg: impl Into<String>,
    ) -> PolicyError {
        let (line, column, snippet) = locate(self.src, span.start);
        PolicyError::Invalid {
            line,
            column,
            field: field.into(),
            message: msg.into(),
            snippet,
        }
    }

    fn score(&self, v: &Spanned<f64>, field: impl Into<String>) -> Result<f32, PolicyError> {
        let x = *v.get_ref();
        if !(0.0..=1.0).contains(&x) {
            return Err(self.err(v.span(), field, format!("score {x} is outside 0.0..=1.0")));
        }
        Ok(x as f32)
    }
}

// ---- raw TOML shape ---------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    version: Option<Spanned<i64>>,
    default: Action,
    min_score: Option<Spanned<f64>>,
    #[serde(default)]
    thresholds: BTreeMap<Spanned<String>, Spanned<f64>>,
    #[serde(default)]
    allow: RawAllow,
    #[serde(default)]
    keywords: BTreeMap<Spanned<String>, Vec<Spanned<String>>>,
    #[serde(default)]
    recognizers: Vec<RawRecognizer>,
    #[serde(default)]
    rules: Vec<RawRule>,
    #[serde(default)]
    second_opinion: RawSecondOpinion,
}

/// `[second_opinion]`: when the device's model is asked
/// ([`crate::second_opinion`]).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawSecondOpinion {
    #[serde(default)]
    mode: crate::second_opinion::OpinionMode,
    band_low: Option<Spanned<f64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAllow {
    #[serde(default)]
    values: Vec<String>,
    #[serde(default)]
    patterns: Vec<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRecognizer {
    name: Spanned<String>,
    pattern: Spanned<String>,
    score: Option<Spanned<f64>>,
    validator: Option<Spanned<String>>,
    #[serde(default)]
    context: Vec<String>,
    #[serde(default)]
    context_required: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: Spanned<String>,
    action: Action,
    entities: Option<Vec<Spanned<String>>>,
    categories: Option<Vec<Spanned<String>>>,
    min_score: Option<Spanned<f64>>,
    rtt_ms_above: Option<f64>,
    rtt_ms_below: Option<f64>,
    breaker_open: Option<bool>,
    battery_below: Option<u8>,
    thermal_at_least: Option<u8>,
    charging: Option<bool>,
    power_save: Option<bool>,
    user_opt_out: Option<bool>,
}

// ---- compiled -----------------------------------------------------------------

/// One ordered policy rule, compiled.
#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    pub name: String,
    pub action: Action,
    /// `None`: no entity condition. `Some(None)`: any entity (`"*"`).
    pub entities: Option<Option<Vec<EntityKind>>>,
    /// `None`: no category condition. `Some(None)`: any category (`"*"`).
    pub categories: Option<Option<Vec<String>>>,
    pub min_score: Option<f32>,
    pub rtt_ms_above: Option<f64>,
    pub rtt_ms_below: Option<f64>,
    pub breaker_open: Option<bool>,
    pub battery_below: Option<u8>,
    pub thermal_at_least: Option<u8>,
    pub charging: Option<bool>,
    pub power_save: Option<bool>,
    pub user_opt_out: Option<bool>,
}

impl Rule {
    /// Whether the rule looks at the text (entities or categories).
    pub fn is_content_rule(&self) -> bool {
        self.entities.is_some() || self.categories.is_some()
    }

    fn matches(&self, entities: &[EntityHit], categories: &[String], ctx: &RouteContext) -> bool {
        if let Some(sel) = &self.entities {
            let min = self.min_score.unwrap_or(0.0);
            let hit = entities.iter().any(|e| {
                e.score >= min && sel.as_ref().is_none_or(|kinds| kinds.contains(&e.kind))
            });
            if !hit {
                return false;
            }
        }
        if let Some(sel) = &self.categories {
            let hit = match sel {
                None => !categories.is_empty(),
                Some(cs) => categories.iter().any(|c| cs.contains(c)),
            };
            if !hit {
                return false;
            }
        }
        let rtt_ok = |f: fn(f64, f64) -> bool, lim: Option<f64>| match lim {
            None => true,
            Some(l) => ctx.rtt_ms.is_some_and(|r| f(r, l)),
        };
        rtt_ok(|r, l| r > l, self.rtt_ms_above)
            && rtt_ok(|r, l| r < l, self.rtt_ms_below)
            && self.breaker_open.is_none_or(|b| b == ctx.breaker_open)
            && self
                .battery_below
                .is_none_or(|l| ctx.battery_pct.is_some_and(|b| b < l))
            && self
                .thermal_at_least
                .is_none_or(|l| ctx.thermal_level.is_some_and(|t| t >= l))
            && self.charging.is_none_or(|b| b == ctx.charging)
            && self.power_save.is_none_or(|b| b == ctx.power_save)
            && self.user_opt_out.is_none_or(|b| b == ctx.user_opt_out)
    }
}

/// A validated policy with its compiled classifier. Immutable; swap whole
/// policies through [`crate::Router`].
pub struct Policy {
    default: Action,
    min_score: f32,
    thresholds: HashMap<EntityKind, f32>,
    rules: Vec<Rule>,
    classifier: Classifier,
    /// When the device's model is asked (`[second_opinion]`).
    opinion_mode: crate::second_opinion::OpinionMode,
    /// Entity scores from here up to the threshold are "unsure".
    opinion_band_low: f32,
    /// The TOML this policy was compiled from (served by the edge admin API).
    source: String,
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("default", &self.default)
            .field("min_score", &self.min_score)
            .field(
                "rules",
                &self.rules.iter().map(|r| &r.name).collect::<Vec<_>>(),
            )
            .field("classifier", &self.classifier)
            .finish()
    }
}

/// The conservative policy used when the operator supplies none.
pub const DEFAULT_POLICY_TOML: &str = include_str!("../data/default_policy.toml");

impl Policy {
    /// Parse and validate a policy from TOML text.
    pub fn from_toml_str(src: &str) -> Result<Policy, PolicyError> {
        let raw: RawPolicy = toml::from_str(src).map_err(|e| {
            let (line, column, snippet) = locate(src, e.span().map_or(0, |s| s.start));
            PolicyError::Parse {
                line,
                column,
                field: key_of_line(&snippet),
                message: e.message().trim().to_string(),
                snippet,
            }
        })?;
        compile(src, raw)
    }

    /// Read, parse and validate a policy file. Errors carry the path.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Policy, PolicyError> {
        let path = path.as_ref();
        let src = std::fs::read_to_string(path).map_err(|source| PolicyError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Policy::from_toml_str(&src).map_err(|e| PolicyError::InFile {
            path: path.to_path_buf(),
            inner: Box::new(e),
        })
    }

    /// The built-in default policy ([`DEFAULT_POLICY_TOML`]).
    pub fn builtin_default() -> Policy {
        // The default is a constant checked by a unit test.
        #[allow(clippy::expect_used)]
        Policy::from_toml_str(DEFAULT_POLICY_TOML).expect("built-in default policy is valid")
    }

    /// The TOML text this policy was compiled from, as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    pub fn default_action(&self) -> Action {
        self.default
    }

    /// Category names this policy knows (built-in plus keyword-defined).
    pub fn categories(&self) -> &[String] {
        self.classifier.lexicon.categories()
    }

    /// When this policy asks the device's model (`[second_opinion] mode`).
    pub fn second_opinion_mode(&self) -> crate::second_opinion::OpinionMode {
        self.opinion_mode
    }

    /// The low end of the unsure band (`[second_opinion] band_low`, default 0.3).
    pub fn second_opinion_band_low(&self) -> f32 {
        self.opinion_band_low
    }

    /// The threshold an entity kind must reach to count.
    pub fn threshold(&self, kind: &EntityKind) -> f32 {
        self.thresholds.get(kind).copied().unwrap_or(self.min_score)
    }

    /// Every candidate and lexicon hit, before thresholds (for diagnostics).
    pub fn classify_raw(&self, text: &str) -> Classification {
        self.classifier.classify(text)
    }

    /// The category terms a negation ("I don't have diabetes") or a
    /// hypothetical frame ("if someone is arrested") set aside, or was seen
    /// near and did not set aside, with the marker and the reason: what
    /// `tandem route explain` shows (see [`crate::lexicon::FrameNote`]).
    pub fn frame_notes(&self, text: &str) -> Vec<crate::lexicon::TermNote> {
        self.classifier.lexicon.scan_explained(text).1
    }

    /// [`Self::frame_notes`] as the explains serve them (offsets only; see
    /// [`crate::lexicon::FrameReport`]).
    pub fn frame_reports(&self, text: &str) -> Vec<crate::lexicon::FrameReport> {
        self.frame_notes(text).iter().map(Into::into).collect()
    }

    /// Entities at or above their thresholds (overlaps resolved, sorted by
    /// offset) and the lexicon hits.
    pub fn classify(&self, text: &str) -> (Vec<EntityHit>, Vec<CategoryHit>) {
        let raw = self.classifier.classify(text);
        let kept: Vec<EntityHit> = raw
            .entities
            .into_iter()
            .filter(|e| e.score >= self.threshold(&e.kind))
            .collect();
        (resolve_overlaps(kept), raw.categories)
    }

    /// Classify `text` and apply the rules in order.
    pub fn decide(&self, text: &str, ctx: &RouteContext) -> Decision {
        let (entities, cat_hits) = self.classify(text);
        let mut categories: Vec<String> = cat_hits.into_iter().map(|c| c.category).collect();
        categories.sort();
        categories.dedup();
        let fired = self
            .rules
            .iter()
            .find(|r| r.matches(&entities, &categories, ctx));
        let (action, rule, content_based) = match fired {
            Some(r) => (r.action, r.name.clone(), r.is_content_rule()),
            None => (self.default, "default".to_string(), false),
        };
        Decision {
            action,
            rule,
            entities,
            categories,
            content_based,
        }
    }
}

fn is_upper_snake(s: &str) -> bool {
    !s.is_empty()
        && s.starts_with(|c: char| c.is_ascii_uppercase())
        && s.chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

fn compile(src: &str, raw: RawPolicy) -> Result<Policy, PolicyError> {
    let cx = Ctx { src };
    if let Some(v) = &raw.version {
        if *v.get_ref() != 1 {
            return Err(cx.err(
                v.span(),
                "version",
                format!(
                    "unsupported version {}; this build reads version 1",
                    v.get_ref()
                ),
            ));
        }
    }
    let min_score = match &raw.min_score {
        Some(v) => cx.score(v, "min_score")?,
        None => 0.5,
    };

    // Custom recognizers first: rules and thresholds may name them.
    let mut patterns = recognizers::builtin();
    let mut custom_names: Vec<String> = Vec::new();
    for (i, r) in raw.recognizers.iter().enumerate() {
        let field = |f: &str| format!("recognizers[{i}].{f}");
        let name = r.name.get_ref();
        if !is_upper_snake(name) {
            return Err(cx.err(
                r.name.span(),
                field("name"),
                format!("recognizer name {name:?} must be UPPER_SNAKE_CASE"),
            ));
        }
        if EntityKind::builtin(name).is_some() || custom_names.contains(name) {
            return Err(cx.err(
                r.name.span(),
                field("name"),
                format!("recognizer name {name:?} is already defined"),
            ));
        }
        let regex = Regex::new(r.pattern.get_ref()).map_err(|e| {
            cx.err(
                r.pattern.span(),
                field("pattern"),
                format!("invalid regular expression: {e}"),
            )
        })?;
        let validator = match &r.validator {
            None => None,
            Some(v) => Some(Validator::parse(v.get_ref()).ok_or_else(|| {
                cx.err(
                    v.span(),
                    field("validator"),
                    format!(
                        "unknown validator {:?}; expected one of \"luhn\", \"mod97\", \"cn-id\"",
                        v.get_ref()
                    ),
                )
            })?),
        };
        let score = match &r.score {
            Some(s) => cx.score(s, field("score"))?,
            None => 0.8,
        };
        if r.context_required && r.context.is_empty() {
            return Err(cx.err(
                r.name.span(),
                field("context_required"),
                "context_required = true needs a non-empty `context` list",
            ));
        }
        patterns.push(Pattern {
            kind: EntityKind::Custom(name.clone()),
            regex,
            group: 0,
            bounded: false,
            check: Check::Custom { validator, score },
            context: WordSet::new(&r.context),
            boost: 0.3,
            context_required: r.context_required,
            penalize_negative: false,
            needs: (0, 0),
            window: None,
        });
        custom_names.push(name.clone());
    }
    let kind_of = |name: &str| -> Option<EntityKind> {
        EntityKind::builtin(name).or_else(|| {
            custom_names
                .iter()
                .any(|c| c == name)
                .then(|| EntityKind::Custom(name.to_string()))
        })
    };
    let known_kinds = || {
        EntityKind::BUILTIN
            .iter()
            .map(|k| k.as_str().to_string())
            .chain(custom_names.iter().cloned())
            .collect::<Vec<_>>()
            .join(", ")
    };

    let mut thresholds = HashMap::new();
    for (k, v) in &raw.thresholds {
        let kind = kind_of(k.get_ref()).ok_or_else(|| {
            cx.err(
                k.span(),
                format!("thresholds.{}", k.get_ref()),
                format!(
                    "unknown entity type {:?}; known: {}",
                    k.get_ref(),
                    known_kinds()
                ),
            )
        })?;
        thresholds.insert(kind, cx.score(v, format!("thresholds.{}", k.get_ref()))?);
    }

    // Lexicon: built-in files plus policy keywords.
    let mut lex: Vec<(String, Vec<Term>)> = BUILTIN_CATEGORIES
        .iter()
        .map(|(c, f)| (c.to_string(), parse_terms(f).collect()))
        .collect();
    for (cat, terms) in &raw.keywords {
        let name = cat.get_ref();
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return Err(cx.err(
                cat.span(),
                format!("keywords.{name}"),
                "category names are lower_snake_case",
            ));
        }
        let mut ts = Vec::new();
        for t in terms {
            let Some(term) = Term::parse(t.get_ref()) else {
                return Err(cx.err(t.span(), format!("keywords.{name}"), "empty keyword"));
            };
            ts.push(term);
        }
        match lex.iter_mut().find(|(c, _)| c == name) {
            Some((_, existing)) => existing.extend(ts),
            None => lex.push((name.clone(), ts)),
        }
    }
    let lexicon = Lexicon::new(lex.iter().map(|(c, t)| (c.as_str(), t.clone())))
        .map_err(|e| cx.err(0..0, "keywords", format!("cannot build lexicon: {e}")))?;
    let known_categories: HashSet<&str> = lex.iter().map(|(c, _)| c.as_str()).collect();

    let mut allow_patterns = Vec::new();
    for (i, p) in raw.allow.patterns.iter().enumerate() {
        allow_patterns.push(Regex::new(p.get_ref()).map_err(|e| {
            cx.err(
                p.span(),
                format!("allow.patterns[{i}]"),
                format!("invalid regular expression: {e}"),
            )
        })?);
    }
    let allow_values = raw
        .allow
        .values
        .iter()
        .map(|v| compact_value(v))
        .chain(crate::classify::published_examples())
        .filter(|v| !v.is_empty())
        .collect();

    let mut rules = Vec::new();
    let mut seen = HashSet::new();
    for (i, r) in raw.rules.iter().enumerate() {
        let field = |f: &str| format!("rules[{i}].{f}");
        let name = r.name.get_ref();
        if name.is_empty() || name == "default" || name.starts_with("sticky:") {
            return Err(cx.err(
                r.name.span(),
                field("name"),
                format!("rule name {name:?} is reserved or empty"),
            ));
        }
        if !seen.insert(name.clone()) {
            return Err(cx.err(
                r.name.span(),
                field("name"),
                format!("duplicate rule name {name:?}"),
            ));
        }
        let entities = match &r.entities {
            None => None,
            Some(list) if list.iter().any(|e| e.get_ref() == "*") => Some(None),
            Some(list) => {
                let mut kinds = Vec::new();
                for e in list {
                    kinds.push(kind_of(e.get_ref()).ok_or_else(|| {
                        cx.err(
                            e.span(),
                            field("entities"),
                            format!(
                                "unknown entity type {:?}; known: {}",
                                e.get_ref(),
                                known_kinds()
                            ),
                        )
                    })?);
                }
                Some(Some(kinds))
            }
        };
        let categories = match &r.categories {
            None => None,
            Some(list) if list.iter().any(|c| c.get_ref() == "*") => Some(None),
            Some(list) => {
                let mut cs = Vec::new();
                for c in list {
                    if !known_categories.contains(c.get_ref().as_str()) {
                        let mut known: Vec<&str> = known_categories.iter().copied().collect();
                        known.sort_unstable();
                        return Err(cx.err(
                            c.span(),
                            field("categories"),
                            format!(
                                "unknown category {:?}; known: {}",
                                c.get_ref(),
                                known.join(", ")
                            ),
                        ));
                    }
                    cs.push(c.get_ref().clone());
                }
                Some(Some(cs))
            }
        };
        let min_score = match &r.min_score {
            Some(s) => Some(cx.score(s, field("min_score"))?),
            None => None,
        };
        if let Some(list) = &r.entities {
            if list.is_empty() {
                return Err(cx.err(
                    r.name.span(),
                    field("entities"),
                    "empty list never matches; remove it or add entity types",
                ));
            }
        }
        if let Some(list) = &r.categories {
            if list.is_empty() {
                return Err(cx.err(
                    r.name.span(),
                    field("categories"),
                    "empty list never matches; remove it or add categories",
                ));
            }
        }
        if let Some(t) = r.thermal_at_least {
            if t > 3 {
                return Err(cx.err(
                    r.name.span(),
                    field("thermal_at_least"),
                    format!("thermal levels are 0 (nominal) ..= 3 (critical), got {t}"),
                ));
            }
        }
        if let Some(b) = r.battery_below {
            if b > 101 {
                return Err(cx.err(
                    r.name.span(),
                    field("battery_below"),
                    format!("battery is a percentage (0..=100), got {b}"),
                ));
            }
        }
        let device_condition = r.battery_below.is_some()
            || r.thermal_at_least.is_some()
            || r.charging.is_some()
            || r.power_save.is_some();
        let content_condition = r.entities.is_some() || r.categories.is_some();
        if device_condition && !content_condition && r.action == Action::Speculative {
            // First match wins: such a rule before a local content rule would
            // send sensitive text out whenever the device is hot or low.
            if let Some(later) = raw.rules[i + 1..].iter().find(|l| {
                l.action == Action::Local && (l.entities.is_some() || l.categories.is_some())
            }) {
                return Err(cx.err(
                    r.name.span(),
                    field("action"),
                    format!(
                        "a speculative rule on device state must come after every local content \
                         rule (here before {:?}): sensitive prompts never leave the device, \
                         whatever its state",
                        later.name.get_ref()
                    ),
                ));
            }
        }
        rules.push(Rule {
            name: name.clone(),
            action: r.action,
            entities,
            categories,
            min_score,
            rtt_ms_above: r.rtt_ms_above,
            rtt_ms_below: r.rtt_ms_below,
            breaker_open: r.breaker_open,
            battery_below: r.battery_below,
            thermal_at_least: r.thermal_at_least,
            charging: r.charging,
            power_save: r.power_save,
            user_opt_out: r.user_opt_out,
        });
    }

    let opinion_band_low = match &raw.second_opinion.band_low {
        Some(v) => cx.score(v, "second_opinion.band_low")?,
        None => 0.3,
    };
    Ok(Policy {
        opinion_mode: raw.second_opinion.mode,
        opinion_band_low,
        source: src.to_string(),
        default: raw.default,
        min_score,
        thresholds,
        rules,
        classifier: Classifier {
            patterns,
            lexicon,
            allow_values,
            allow_patterns,
        },
    })
}
