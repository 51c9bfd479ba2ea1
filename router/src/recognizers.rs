//! Built-in recognizers: a regular expression finds candidates, a check
//! validates them (checksums, ranges, code heuristics) and gives a base score,
//! and context words near the span raise it. Words that mark test data or code
//! constants ("test", "example", "version", ...) lower it.
//!
//! Scores are calibrated against a default threshold of 0.5: numbers that only
//! pass a weak check (Luhn, SSN ranges, a bare mobile number) start below it and
//! need context; formats that are unmistakable (PEM keys, provider tokens, a
//! mod-97-valid IBAN, a fully valid 18-digit resident ID) start above it.

use std::sync::OnceLock;

use aho_corasick::AhoCorasick;
use regex::Regex;

use crate::types::EntityKind;
use crate::validate;

/// A candidate after its check: span (possibly narrowed) and base score.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scored {
    pub start: usize,
    pub end: usize,
    pub score: f32,
}

pub(crate) type CheckFn = fn(&str, usize, usize) -> Option<Scored>;

/// How a candidate is validated and scored.
pub(crate) enum Check {
    Builtin(CheckFn),
    Custom {
        validator: Option<Validator>,
        score: f32,
    },
}

/// Validators available to custom recognizers in a policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Validator {
    Luhn,
    Mod97,
    CnId,
}

impl Validator {
    pub fn parse(name: &str) -> Option<Validator> {
        match name {
            "luhn" => Some(Validator::Luhn),
            "mod97" => Some(Validator::Mod97),
            "cn-id" => Some(Validator::CnId),
            _ => None,
        }
    }

    pub fn check(self, s: &str) -> bool {
        match self {
            Validator::Luhn => validate::luhn(s),
            Validator::Mod97 => validate::mod97(s),
            Validator::CnId => validate::cn_id_any(s),
        }
    }
}

/// One regular expression and how to turn its matches into scored hits.
pub(crate) struct Pattern {
    pub kind: EntityKind,
    pub regex: Regex,
    /// Capture group that is the sensitive span (0 = whole match).
    pub group: usize,
    /// The span must not touch ASCII letters/digits on either side.
    pub bounded: bool,
    pub check: Check,
    /// Lower-case context words; any one within the window adds `boost`.
    pub context: WordSet,
    pub boost: f32,
    /// Without a context word the candidate is dropped.
    pub context_required: bool,
    /// Subtract `NEGATIVE_PENALTY` when a test/code word is near.
    pub penalize_negative: bool,
    /// Cheap necessary condition checked before running the regex: the text
    /// must hold a run of at least `.0` consecutive digits, and a run of
    /// digits and separators (` -.()+/`) with at least `.1` digits.
    pub needs: (usize, usize),
    /// When set, every match of `regex` holds at least `.0` digits of one
    /// digit group (digits and separators, as in `needs`) and is at most
    /// `.1` bytes long: the regex then runs only over the windows of
    /// `.1` bytes around such groups ([`Pattern::windowed`]), with the whole
    /// text as context, and finds exactly the matches a scan of the whole
    /// text finds.
    pub window: Option<(usize, usize)>,
}

/// Digit statistics of a text, computed in one pass, used to skip numeric
/// recognizers on texts that cannot contain their entities, and to run the
/// others only around the digit groups that can.
#[derive(Clone, Debug, Default)]
pub(crate) struct DigitStats {
    max_run: usize,
    max_group: usize,
    /// Digit groups (digits and separators) with at least
    /// [`MIN_WINDOW_DIGITS`] digits: first digit, end of the last digit,
    /// digit count.
    groups: Vec<(usize, usize, usize)>,
}

/// The fewest digits a windowed pattern asks of a group.
const MIN_WINDOW_DIGITS: usize = 3;

impl DigitStats {
    pub fn of(text: &str) -> DigitStats {
        let (mut run, mut group) = (0, 0);
        let (mut first, mut last) = (0, 0);
        let mut st = DigitStats::default();
        for (i, &b) in text.as_bytes().iter().enumerate() {
            if b.is_ascii_digit() {
                if group == 0 {
                    first = i;
                }
                last = i + 1;
                run += 1;
                group += 1;
                st.max_run = st.max_run.max(run);
                st.max_group = st.max_group.max(group);
            } else {
                run = 0;
                if group > 0 && !matches!(b, b' ' | b'-' | b'.' | b'(' | b')' | b'+' | b'/') {
                    st.close_group(first, last, group);
                    group = 0;
                }
            }
        }
        if group > 0 {
            st.close_group(first, last, group);
        }
        st
    }

    fn close_group(&mut self, first: usize, last: usize, digits: usize) {
        if digits >= MIN_WINDOW_DIGITS {
            self.groups.push((first, last, digits));
        }
    }

    /// The byte ranges of `text` within `reach` bytes of a group with at
    /// least `digits` digits, merged where they overlap, on char boundaries.
    fn windows(&self, text: &str, digits: usize, reach: usize) -> Vec<(usize, usize)> {
        let mut out: Vec<(usize, usize)> = Vec::new();
        for &(s, e, n) in &self.groups {
            if n < digits {
                continue;
            }
            let a = floor_boundary(text, s.saturating_sub(reach));
            let b = ceil_boundary(text, e.saturating_add(reach));
            match out.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => out.push((a, b)),
            }
        }
        out
    }
}

/// Bytes searched for context words before a span and after it.
const WINDOW_BEFORE: usize = 64;
const WINDOW_AFTER: usize = 24;
const WINDOW_AFTER_CHARS: usize = 16;
const NEGATIVE_PENALTY: f32 = 0.4;

/// Words near a number that say it is test data or a code constant.
const NEGATIVE_WORDS: &[&str] = &[
    "test",
    "tests",
    "testing",
    "example",
    "sample",
    "dummy",
    "fake",
    "mock",
    "fixture",
    "placeholder",
    "version",
    "timestamp",
    "uuid",
    "hash",
    "sha",
    "sha1",
    "sha256",
    "checksum",
    "crc",
    "port",
    "seed",
    "nonce",
    "offset",
    "epoch",
    "build",
    "测试",
    "示例",
    "样例",
    "版本",
    "时间戳",
    "假的",
    // A number shown as the sample of a format, a mask or a pattern.
    "regex",
    "regexp",
    "e.g.",
    "mask",
    "masks",
    "masked",
    "faker",
    "docs",
    "documentation",
    "例子",
    "比如",
    "正则",
    "打码",
    "脱敏",
    "beispiel",
    "maskiert",
    "handbuch",
    "ejemplo",
    "enmascare",
    "exemple",
    "例えば",
    "サンプル",
    "正規表現",
    "テスト",
    "예시",
    "예제",
    "정규식",
    "테스트",
];

pub(crate) const PHONE_CONTEXT: &[&str] = &[
    "phone",
    "tel",
    "telephone",
    "mobile",
    "cell",
    "call",
    "contact",
    "whatsapp",
    "wechat",
    "sms",
    "text me",
    "reach me",
    "打给我",
    "电话",
    "手机",
    "联系",
    "致电",
    "号码",
    "微信",
    "座机",
    "拨打",
    // A delivery or contact record: the number is someone's.
    "shipping",
    "ship to",
    "deliver to",
    "delivery",
    "recipient",
    "收货",
    "收件",
    "快递",
    "配送",
    "寄到",
    "寄给",
    // Spanish, German, French, Japanese, Korean.
    "teléfono",
    "telefono",
    "móvil",
    "movil",
    "fijo",
    "llámame",
    "llamar",
    "telefon",
    "handy",
    "mobil",
    "festnetz",
    "ruf mich",
    "anrufen",
    "téléphone",
    "tél",
    "fixe",
    "portable",
    "appelle-moi",
    "電話",
    "携帯",
    "連絡",
    "전화",
    "휴대폰",
    "핸드폰",
    "연락",
];
const CN_ID_CONTEXT: &[&str] = &[
    "身份证",
    "证件号",
    "公民身份",
    "身份号码",
    "id card",
    "identity",
    "id number",
    "id no",
    "resident id",
    "citizen id",
    "national id",
    "身份",
];
const CARD_CONTEXT: &[&str] = &[
    "card",
    "credit",
    "debit",
    "visa",
    "mastercard",
    "amex",
    "unionpay",
    "pan",
    "卡号",
    "银行卡",
    "信用卡",
    "借记卡",
    "储蓄卡",
    "银联",
    "刷卡",
    "账号",
    "tarjeta",
    "karte",
    "kreditkarte",
    "carte",
    "カード",
    "카드",
];
const IBAN_CONTEXT: &[&str] = &[
    "iban", "account", "bank", "transfer", "账户", "转账", "汇款",
];
const SSN_CONTEXT: &[&str] = &[
    "ssn",
    "social security",
    "social-security",
    "taxpayer",
    "tin",
    "社会安全号",
    "社安号",
];
const PASSPORT_CONTEXT: &[&str] = &[
    "passport",
    "travel document",
    "护照",
    "护照号",
    "通行证",
    "pasaporte",
    "reisepass",
    "reisepassnummer",
    "passnummer",
    "passeport",
    "パスポート",
    "旅券",
    "여권",
    "여권번호",
];
const IP_CONTEXT: &[&str] = &[
    "ip",
    "ip address",
    "ipv4",
    "ipv6",
    "my address",
    "home",
    "router",
    "ip地址",
    "地址",
    "家里",
    "我的ip",
    // A machine someone logs into or runs: its public address is theirs.
    "ssh",
    "sftp",
    "scp",
    "rdp",
    "vps",
    "my server",
    "public ip",
    "wan ip",
    "external ip",
    "服务器",
    "公网",
    "主机",
];
const MAC_CONTEXT: &[&str] = &[
    "mac",
    "mac address",
    "bssid",
    "hardware address",
    "网卡",
    "物理地址",
    "mac地址",
];

/// A set of context words matched in one Aho-Corasick pass, ASCII
/// case-insensitively. ASCII words must stand alone (no letter or digit on
/// either side); CJK words match anywhere.
pub(crate) struct WordSet {
    ac: Option<AhoCorasick>,
    ascii: Vec<bool>,
}

impl WordSet {
    pub fn new<S: AsRef<str>>(words: &[S]) -> WordSet {
        let words: Vec<&str> = words
            .iter()
            .map(AsRef::as_ref)
            .filter(|w| !w.is_empty())
            .collect();
        let ac = if words.is_empty() {
            None
        } else {
            AhoCorasick::builder()
                .ascii_case_insensitive(true)
                .build(&words)
                .ok()
        };
        WordSet {
            ascii: words.iter().map(|w| w.is_ascii()).collect(),
            ac,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.ac.is_none()
    }

    /// Whether any word occurs in `hay` as a whole word.
    pub fn any_in(&self, hay: &str) -> bool {
        let Some(ac) = &self.ac else { return false };
        let b = hay.as_bytes();
        ac.find_overlapping_iter(hay).any(|m| {
            !self.ascii[m.pattern().as_usize()]
                || ((m.start() == 0 || !is_word_byte(b[m.start() - 1]))
                    && (m.end() >= b.len() || !is_word_byte(b[m.end()])))
        })
    }
}

fn negative_words() -> &'static WordSet {
    static SET: OnceLock<WordSet> = OnceLock::new();
    SET.get_or_init(|| WordSet::new(NEGATIVE_WORDS))
}

fn is_word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric()
}

/// Largest char boundary <= i.
pub(crate) fn floor_boundary(s: &str, mut i: usize) -> usize {
    if i >= s.len() {
        return s.len();
    }
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Smallest char boundary >= i.
fn ceil_boundary(s: &str, mut i: usize) -> usize {
    if i >= s.len() {
        return s.len();
    }
    while !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

/// The text before and after a span, within the context window.
fn around(text: &str, start: usize, end: usize) -> (&str, &str) {
    let a = floor_boundary(text, start.saturating_sub(WINDOW_BEFORE));
    // At least WINDOW_AFTER_CHARS characters after: 24 bytes are only 8
    // Han or Hangul characters.
    let by_chars = text[end..]
        .char_indices()
        .nth(WINDOW_AFTER_CHARS)
        .map_or(text.len(), |(i, _)| end + i);
    let b = ceil_boundary(text, (end + WINDOW_AFTER).max(by_chars));
    (&text[a..start], &text[end..b])
}

/// Neither neighbour of `[start, end)` is an ASCII letter or digit, and the
/// span is not the middle of a decimal number (`3.14159...`).
fn bounded(text: &str, start: usize, end: usize) -> bool {
    let b = text.as_bytes();
    if start > 0 {
        let p = b[start - 1];
        if is_word_byte(p) || p == b'_' {
            return false;
        }
        if p == b'.' && start >= 2 && b[start - 2].is_ascii_digit() {
            return false;
        }
    }
    if end < b.len() {
        let n = b[end];
        if is_word_byte(n) || n == b'_' {
            return false;
        }
        if n == b'.' && end + 1 < b.len() && b[end + 1].is_ascii_digit() {
            return false;
        }
    }
    true
}

/// The span sits inside a long token of hex digits and dashes that contains a
/// hex letter: a UUID, a hash, a GUID. Numbers in there are not entities.
fn inside_hex_blob(text: &str, start: usize, end: usize) -> bool {
    let b = text.as_bytes();
    let hexish = |c: u8| c.is_ascii_hexdigit() || c == b'-';
    let mut a = start;
    while a > 0 && hexish(b[a - 1]) {
        a -= 1;
    }
    let mut z = end;
    while z < b.len() && hexish(b[z]) {
        z += 1;
    }
    (a < start || z > end) && z - a >= 20 && b[a..z].iter().any(|c| c.is_ascii_alphabetic())
}

impl Pattern {
    pub(crate) fn needs(mut self, run: usize, group: usize) -> Pattern {
        self.needs = (run, group);
        self
    }

    /// Run the regex only around digit groups of at least `digits` digits
    /// (see [`Pattern::window`]). The caller states that every match of the
    /// regex holds that many digits of one group; the reach is the regex's
    /// longest match. A regex without a bounded longest match, or whose
    /// matches may be empty, stays a whole-text scan.
    pub(crate) fn windowed(mut self, digits: usize) -> Pattern {
        let props = regex_syntax::parse(self.regex.as_str())
            .ok()
            .map(|h| h.properties().clone());
        self.window = props
            .filter(|p| p.minimum_len().is_some_and(|n| n > 0))
            .and_then(|p| p.maximum_len())
            .map(|reach| (digits.max(MIN_WINDOW_DIGITS), reach));
        self
    }

    /// Whether the text's digit statistics allow a match at all.
    pub fn may_match(&self, st: &DigitStats) -> bool {
        st.max_run >= self.needs.0 && st.max_group >= self.needs.1
    }

    /// Scan `text` (whose digit statistics are `stats`), pushing every hit
    /// with its final score (unthresholded): the whole text, or only the
    /// windows around its digit groups for a windowed pattern.
    pub fn scan_with(
        &self,
        text: &str,
        stats: &DigitStats,
        out: &mut Vec<(EntityKind, usize, usize, f32)>,
    ) {
        let Some((digits, reach)) = self.window else {
            return self.scan(text, out);
        };
        for (a, b) in stats.windows(text, digits, reach) {
            // The window's end is the haystack's end; look-behind sees the
            // text before `a` (find_at), and no windowed regex looks ahead
            // past its match.
            let hay = &text[..b];
            let mut at = a;
            while at < b {
                let span = if self.group == 0 {
                    self.regex
                        .find_at(hay, at)
                        .map(|m| (m.start(), m.end(), m.end()))
                } else {
                    self.regex.captures_at(hay, at).and_then(|c| {
                        let whole = c.get(0)?;
                        Some(match c.get(self.group) {
                            Some(m) => (m.start(), m.end(), whole.end()),
                            None => (whole.end(), whole.end(), whole.end()),
                        })
                    })
                };
                let Some((s, e, next)) = span else { break };
                if s < e {
                    self.consider(text, s, e, out);
                }
                at = next;
            }
        }
    }

    /// Scan `text`, pushing every hit with its final score (unthresholded).
    pub fn scan(&self, text: &str, out: &mut Vec<(EntityKind, usize, usize, f32)>) {
        // Capture groups cost a second, slower search per match: only ask for
        // them when the span is a group.
        if self.group == 0 {
            for m in self.regex.find_iter(text) {
                self.consider(text, m.start(), m.end(), out);
            }
        } else {
            for caps in self.regex.captures_iter(text) {
                if let Some(m) = caps.get(self.group) {
                    self.consider(text, m.start(), m.end(), out);
                }
            }
        }
    }

    fn consider(
        &self,
        text: &str,
        s: usize,
        e: usize,
        out: &mut Vec<(EntityKind, usize, usize, f32)>,
    ) {
        {
            if self.bounded && (!bounded(text, s, e) || inside_hex_blob(text, s, e)) {
                return;
            }
            let scored = match &self.check {
                Check::Builtin(f) => f(text, s, e),
                Check::Custom { validator, score } => match validator {
                    Some(v) if !v.check(&text[s..e]) => None,
                    _ => Some(Scored {
                        start: s,
                        end: e,
                        score: *score,
                    }),
                },
            };
            let Some(sc) = scored else { return };
            let mut score = sc.score;
            if !self.context.is_empty() || self.penalize_negative {
                let (before, after) = around(text, sc.start, sc.end);
                let has_ctx = self.context.any_in(before) || self.context.any_in(after);
                if self.context_required && !has_ctx {
                    return;
                }
                if has_ctx {
                    score += self.boost;
                }
                let neg = negative_words();
                if self.penalize_negative && (neg.any_in(before) || neg.any_in(after)) {
                    score -= NEGATIVE_PENALTY;
                }
            }
            // Two decimals: scores are coarse by nature, and this keeps
            // float noise (0.95000005) out of JSON and logs.
            let score = (score.clamp(0.0, 1.0) * 100.0).round() / 100.0;
            out.push((self.kind.clone(), sc.start, sc.end, score));
        }
    }
}

pub(crate) fn sc(start: usize, end: usize, score: f32) -> Option<Scored> {
    Some(Scored { start, end, score })
}

// ---- checks -------------------------------------------------------------

fn check_email(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = &text[s..e];
    let at = m.find('@')?;
    let (local, domain) = (&m[..at], m[at + 1..].to_ascii_lowercase());
    if text.as_bytes().get(s.wrapping_sub(1)) == Some(&b'@') {
        return None;
    }
    // `scheme://user:password@host`: the userinfo of a URL, not a mailbox.
    let head = &text[floor_boundary(text, s.saturating_sub(80))..s];
    if let Some(i) = head.rfind("://") {
        if !head[i..].contains(char::is_whitespace) {
            return None;
        }
    }
    // scp-style git remotes: git@github.com:owner/repo
    if local == "git" && text.as_bytes().get(e) == Some(&b':') {
        return sc(s, e, 0.1);
    }
    let reserved = ["example.com", "example.org", "example.net", "localhost"];
    let reserved_tld = [".example", ".test", ".invalid", ".local", ".localhost"];
    if reserved
        .iter()
        .any(|r| domain == *r || domain.ends_with(&format!(".{r}")))
        || reserved_tld.iter().any(|t| domain.ends_with(t))
    {
        return sc(s, e, 0.2);
    }
    sc(s, e, 0.85)
}

fn check_cn_mobile(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = &text[s..e];
    let prefixed = m.starts_with('+') || m.starts_with("0086");
    let separated = m.contains([' ', '-']);
    let mut score = if prefixed {
        0.7
    } else if separated {
        0.55
    } else {
        0.4
    };
    // `王建国 13700001111`: a name followed by the number is a contact record
    // (shipping labels, address books), not a constant in code.
    if name_before(text, s).is_some() {
        score += 0.3;
    }
    sc(s, e, score)
}

/// Separators allowed between a name and the phone number after it.
fn is_record_sep(c: char) -> bool {
    matches!(c, ' ' | '\t' | ',' | '，' | ':' | '：' | '、' | '/')
}

/// A Chinese name of 2–4 Han characters that ends right before `at` (after
/// optional separators) and stands alone: not preceded by another Han
/// character, starting with a common surname, free of particles. Returns its
/// span.
fn name_before(text: &str, at: usize) -> Option<(usize, usize)> {
    let head = &text[..at];
    let end = head.trim_end_matches(is_record_sep).len();
    let mut start = end;
    let mut n = 0;
    for (i, c) in head[..end].char_indices().rev() {
        if !is_han(c) {
            break;
        }
        n += 1;
        start = i;
        if n > 4 {
            return None;
        }
    }
    if n < 2 {
        return None;
    }
    let name = &text[start..end];
    if name.chars().skip(1).any(|c| CN_NAME_STOP.contains(c)) {
        return None;
    }
    let surname = CN_COMPOUND_SURNAMES.iter().any(|p| name.starts_with(p))
        || name.chars().next().is_some_and(|c| CN_SURNAMES.contains(c));
    surname.then_some((start, end))
}

fn is_han(c: char) -> bool {
    ('\u{4e00}'..='\u{9fff}').contains(&c) || ('\u{3400}'..='\u{4dbf}').contains(&c)
}

/// `王建国 13700001111`: the match is the CN mobile number; the hit is the
/// name right before it.
fn check_cn_name_before_phone(text: &str, s: usize, _e: usize) -> Option<Scored> {
    let (ns, ne) = name_before(text, s)?;
    sc(ns, ne, 0.7)
}

fn digit_count(s: &str) -> usize {
    s.bytes().filter(u8::is_ascii_digit).count()
}

fn check_cn_landline(_t: &str, s: usize, e: usize) -> Option<Scored> {
    sc(s, e, 0.5)
}

fn check_intl_phone(text: &str, s: usize, e: usize) -> Option<Scored> {
    let n = digit_count(&text[s..e]);
    let next_is_digit = text.as_bytes().get(e).is_some_and(u8::is_ascii_digit);
    if !(8..=15).contains(&n) || next_is_digit {
        return None;
    }
    if fictional_nanp(&text[s..e]) {
        return sc(s, e, 0.1);
    }
    sc(s, e, 0.6)
}

/// A North American number in 555-0100..555-0199, the range NANPA reserves
/// for fiction and examples (<https://nationalnanpa.com/>, "555 line
/// numbers"): `(202) 555-0143`, `+1 202-555-0143`.
fn fictional_nanp(m: &str) -> bool {
    let d: Vec<u8> = m.bytes().filter(u8::is_ascii_digit).collect();
    let d = match d.len() {
        11 if d[0] == b'1' => &d[1..],
        10 => &d[..],
        _ => return false,
    };
    &d[3..6] == b"555" && &d[6..8] == b"01"
}

fn check_us_phone(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = &text[s..e];
    if fictional_nanp(m) {
        return sc(s, e, 0.1);
    }
    let score = if m.contains('(') {
        0.55
    } else if m.contains('-') {
        0.4
    } else {
        0.3
    };
    sc(s, e, score)
}

fn check_uk_phone(text: &str, s: usize, e: usize) -> Option<Scored> {
    let n = digit_count(&text[s..e]);
    if !(10..=11).contains(&n) {
        return None;
    }
    sc(s, e, 0.4)
}

fn check_cn_id18(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = &text[s..e];
    // Grouped (`440305 19850722 161X`): one kind of separator.
    if m.contains(' ') && m.contains('-') {
        return None;
    }
    validate::cn_resident_id(m).then_some(Scored {
        start: s,
        end: e,
        score: 0.6,
    })
}

fn check_cn_id15(text: &str, s: usize, e: usize) -> Option<Scored> {
    validate::cn_resident_id_legacy(&text[s..e]).then_some(Scored {
        start: s,
        end: e,
        score: 0.3,
    })
}

fn check_card(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = &text[s..e];
    let groups: Vec<usize> = m.split([' ', '-', '.']).map(str::len).collect();
    if groups.len() > 1 {
        // Separators must be consistent and group like a real card.
        let kinds = [' ', '-', '.'].iter().filter(|&&c| m.contains(c)).count();
        if kinds > 1 {
            return None;
        }
        let four_blocks = groups[..groups.len() - 1].iter().all(|&g| g == 4);
        let amex_like = groups.len() == 3 && groups[0] == 4 && groups[1] == 6;
        if !four_blocks && !amex_like {
            return None;
        }
    }
    if !validate::plausible_card_iin(m) || !validate::luhn(m) {
        return None;
    }
    sc(s, e, 0.35)
}

fn check_iban(text: &str, s: usize, _e: usize) -> Option<Scored> {
    // The regex may run past the IBAN into following groups: cut the match at
    // the country's length, then validate.
    let b = text.as_bytes();
    let country = [b[s], b[s + 1]];
    let want = validate::iban_length(&country)?;
    let mut n = 0;
    let mut end = s;
    for (i, c) in text[s..].char_indices() {
        if c.is_ascii_alphanumeric() {
            n += 1;
            if n == want {
                end = s + i + 1;
                break;
            }
        } else if c != ' ' {
            return None;
        }
    }
    if n != want || !bounded(text, s, end) {
        return None;
    }
    validate::iban_mod97(&text[s..end]).then_some(Scored {
        start: s,
        end,
        score: 0.85,
    })
}

fn check_ssn(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = &text[s..e];
    if !validate::us_ssn(m) {
        return None;
    }
    let score = if m.contains('-') {
        0.45
    } else if m.contains(' ') {
        0.3
    } else {
        0.1
    };
    sc(s, e, score)
}

fn check_passport(text: &str, s: usize, e: usize) -> Option<Scored> {
    // The German form (`C4J7PLM21`) is letters and digits: at least two
    // digits, so that a capitalised word is not a passport.
    if text[s..e].bytes().filter(u8::is_ascii_digit).count() < 2 {
        return None;
    }
    sc(s, e, 0.15)
}

fn check_ipv4(text: &str, s: usize, e: usize) -> Option<Scored> {
    let b = text.as_bytes();
    // `v1.2.3.4`, `1.2.3.4.5`: versions, not addresses.
    if s > 0 && matches!(b[s - 1], b'v' | b'V' | b'.') {
        return None;
    }
    if e < b.len() && b[e] == b'.' && b.get(e + 1).is_some_and(u8::is_ascii_digit) {
        return None;
    }
    let ip: std::net::Ipv4Addr = text[s..e].parse().ok()?;
    let o = ip.octets();
    let well_known = [
        [8, 8, 8, 8],
        [8, 8, 4, 4],
        [1, 1, 1, 1],
        [1, 0, 0, 1],
        [114, 114, 114, 114],
        [223, 5, 5, 5],
    ];
    let doc_net = matches!(o, [192, 0, 2, _] | [198, 51, 100, _] | [203, 0, 113, _]);
    let score = if ip.is_private()
        || ip.is_loopback()
        || ip.is_link_local()
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || doc_net
        || well_known.contains(&o)
    {
        0.15
    } else {
        0.45
    };
    sc(s, e, score)
}

fn check_ipv6(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = &text[s..e];
    if m.bytes().filter(|&c| c == b':').count() < 2 || !m.bytes().any(|c| c.is_ascii_digit()) {
        return None;
    }
    let ip: std::net::Ipv6Addr = m.parse().ok()?;
    if ip.is_loopback() || ip.is_unspecified() {
        return sc(s, e, 0.1);
    }
    let first = ip.segments()[0];
    let global = (0x2000..0x4000).contains(&first) && first != 0x2001 || {
        // 2001:db8::/32 is documentation; other 2001: prefixes are global.
        first == 0x2001 && ip.segments()[1] != 0x0db8
    };
    sc(s, e, if global { 0.45 } else { 0.15 })
}

fn check_mac(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = text[s..e].to_ascii_lowercase();
    if m.contains(':') && m.contains('-') {
        return None;
    }
    let hex: String = m.chars().filter(char::is_ascii_hexdigit).collect();
    if hex.chars().all(|c| c == '0') || hex.chars().all(|c| c == 'f') || hex.starts_with("01005e") {
        return sc(s, e, 0.05);
    }
    // Locally administered addresses (bit 1 of the first octet: VMs, Docker,
    // randomised Wi-Fi MACs) do not identify hardware on their own.
    let first = u8::from_str_radix(&hex[..2], 16).unwrap_or(0);
    sc(s, e, if first & 0x02 != 0 { 0.3 } else { 0.5 })
}

/// A PEM private-key block, found by its header. The header alone is enough
/// (issue 19): a short, elided or malformed body is no proof that no key
/// follows (the rest may come in the next message, or be pasted broken), and
/// a prompt that even shows the header of a private key belongs on the
/// device. The span runs to the matching `-----END ...-----`, else to the
/// end of the text.
fn check_pem(text: &str, s: usize, e: usize) -> Option<Scored> {
    let rest = &text[e..];
    let end = match rest.find("-----END") {
        Some(i) => {
            let after = &rest[i + 8..];
            e + after.find("-----").map(|j| i + 8 + j + 5).unwrap_or(i + 8)
        }
        None => text.len(),
    };
    sc(s, end, 0.99)
}

fn low_entropy_placeholder(v: &str) -> bool {
    let l = v.to_ascii_lowercase();
    l.contains("example")
        || l.contains("xxxx")
        || l.contains("your")
        || validate::shannon_entropy(v) < 2.5
}

fn check_token(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = &text[s..e];
    sc(
        s,
        e,
        if low_entropy_placeholder(m) {
            0.2
        } else {
            0.95
        },
    )
}

fn check_aws(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = &text[s..e];
    sc(s, e, if m.ends_with("EXAMPLE") { 0.2 } else { 0.9 })
}

fn check_jwt(text: &str, s: usize, e: usize) -> Option<Scored> {
    let m = &text[s..e];
    let header = m.split('.').next().unwrap_or("");
    let ok =
        validate::base64url_decode(header).is_some_and(|h| h.windows(5).any(|w| w == b"\"alg\""));
    sc(s, e, if ok { 0.9 } else { 0.5 })
}

const PLACEHOLDERS: &[&str] = &[
    "null",
    "none",
    "nil",
    "true",
    "false",
    "undefined",
    "changeme",
    "change_me",
    "password",
    "secret",
    "redacted",
    "required",
    "optional",
    "string",
    "str",
    "your_password",
    "your_api_key",
    "todo",
    "tbd",
    "empty",
    "hidden",
    "masked",
];

/// `password = "..."`, `api_key: ...`, `密码是...`: group 2 is the value.
fn check_assignment(text: &str, s: usize, e: usize) -> Option<Scored> {
    let mut e = e;
    while e > s {
        let c = text[..e].chars().next_back()?;
        if matches!(
            c,
            '.' | '。' | ')' | ']' | '}' | '，' | '！' | '!' | '?' | '？'
        ) {
            e -= c.len_utf8();
        } else {
            break;
        }
    }
    let v = &text[s..e];
    if v.chars().count() < 4 {
        return None;
    }
    let b = text.as_bytes();
    let quoted = s > 0 && matches!(b[s - 1], b'"' | b'\'' | b'`');
    if let Some(&n) = b.get(e) {
        if matches!(n, b'(' | b'<' | b'[' | b'.' | b'{') && !quoted {
            return None; // a call or a path: code, not a value
        }
    }
    let lower = v.to_lowercase();
    if PLACEHOLDERS.contains(&lower.as_str())
        || lower.starts_with('$')
        || lower.starts_with('%')
        || lower.starts_with('<')
        || lower.starts_with("os.")
        || lower.starts_with("env")
        || lower.starts_with("process.")
        || lower.contains("xxxx")
        || lower.contains("****")
        || lower.contains("your")
        || lower.contains("example")
        || lower.contains("placeholder")
        || lower.contains("redacted")
        || v.contains(".*")
        || v.chars().all(|c| c == v.chars().next().unwrap_or(' '))
    {
        return None;
    }
    let ident = v
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    let has_digit = v.chars().any(|c| c.is_ascii_digit());
    // `POSTGRES_PASSWORD=mysecretpassword` (shell, .env, `docker -e`,
    // compose files): an environment variable's value is a literal; shell
    // references start with `$`, which is excluded above. An all-caps value
    // (`API_KEY=DEFAULT_KEY`) still reads as a constant's name.
    let env_literal = env_style_key(text, s) && v.chars().any(|c| c.is_ascii_lowercase());
    if !quoted && ident && !has_digit && !env_literal {
        return None; // `password = user_password`: a variable, not a literal
    }
    // The key word decides how much a low-entropy value counts.
    let head = &text[floor_boundary(text, s.saturating_sub(48))..s].to_lowercase();
    let generic_token = ![
        "pass",
        "pwd",
        "secret",
        "key",
        "密码",
        "口令",
        "密钥",
        "credential",
        "clave",
        "contrase",
        "mdp",
        "パスワード",
        "비밀번호",
    ]
    .iter()
    .any(|k| head.contains(k));
    let h = validate::shannon_entropy(v);
    let n = v.chars().count();
    let score = if h >= 3.5 && n >= 12 {
        0.9
    } else if generic_token {
        if h >= 3.0 && n >= 16 {
            0.7
        } else {
            return None;
        }
    } else if n >= 6 {
        0.6
    } else {
        0.4
    };
    sc(s, e, score)
}

/// The key before an assignment's value at `s` is an environment-variable
/// name (`DB_PASSWORD=`, `MYSQL_ROOT_PASSWORD: `): upper case with an
/// underscore, followed by `=` (no spaces) or `: `.
fn env_style_key(text: &str, s: usize) -> bool {
    let head = &text[floor_boundary(text, s.saturating_sub(64))..s];
    let head = head.trim_end_matches(['"', '\'']);
    let (head, sep_ok) = if let Some(h) = head.strip_suffix('=') {
        (h, true)
    } else if let Some(h) = head.trim_end_matches(' ').strip_suffix(':') {
        (h, true)
    } else {
        (head, false)
    };
    if !sep_ok {
        return false;
    }
    let key_start = head
        .char_indices()
        .rev()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '_'))
        .map_or(0, |(i, c)| i + c.len_utf8());
    let key = &head[key_start..];
    key.contains('_')
        && key.bytes().any(|c| c.is_ascii_uppercase())
        && !key.bytes().any(|c| c.is_ascii_lowercase())
}

/// A literal password given positionally or as a flag (auth tuples,
/// `curl -u user:pw`, `mysql -pPW`, `--password PW`): the value is the
/// evidence, scored by entropy; references and placeholders are not.
fn check_password_literal(text: &str, s: usize, e: usize) -> Option<Scored> {
    let v = &text[s..e];
    let l = v.to_lowercase();
    if v.chars().count() < 4
        || PLACEHOLDERS.contains(&l.as_str())
        || l.starts_with(['$', '%', '<', '{'])
        || l.contains("xxx")
        || l.contains("***")
        || l.contains("your")
        || l.contains("example")
        || v.chars().all(|c| c == v.chars().next().unwrap_or(' '))
    {
        return None;
    }
    let h = validate::shannon_entropy(v);
    let n = v.chars().count();
    let score = if h >= 3.5 && n >= 12 {
        0.9
    } else if n >= 6 {
        0.75
    } else {
        0.5
    };
    sc(s, e, score)
}

/// `curl -u user:pw`: the flag must stand alone (`-u` not inside `--run`).
fn check_user_flag_password(text: &str, s: usize, e: usize) -> Option<Scored> {
    let head = &text[floor_boundary(text, s.saturating_sub(200))..s];
    let flag = head.rfind("-u").max(head.rfind("--user"))?;
    let flag = if head[..flag].ends_with('-') {
        flag - 1
    } else {
        flag
    };
    if flag > 0 && !head[..flag].ends_with(char::is_whitespace) {
        return None;
    }
    check_password_literal(text, s, e)
}

fn check_url_password(text: &str, s: usize, e: usize) -> Option<Scored> {
    let v = &text[s..e];
    let l = v.to_lowercase();
    if l.starts_with('$')
        || l.starts_with('{')
        || l.starts_with('<')
        || PLACEHOLDERS.contains(&l.as_str())
        || l == "pass"
        || l.contains("xxx")
    {
        return None;
    }
    sc(s, e, 0.85)
}

const CN_SURNAMES: &str = "王李张刘陈杨黄赵吴周徐孙马朱胡郭何高林罗郑梁谢宋唐许韩冯邓曹彭曾肖田董袁潘于蒋蔡余杜叶程苏魏吕丁任沈姚卢姜崔钟谭陆汪范金石廖贾夏韦付傅方白邹孟熊秦邱江尹薛闫段雷侯龙史陶黎贺顾毛郝龚邵万钱严覃武戴莫孔向汤常温康施文牛樊葛邢安齐易乔伍庞颜倪庄聂章鲁岳翟殷詹申欧耿关兰焦俞左柳甘祝包宁尚符舒阮柯纪梅童凌毕单季裴霍涂成苗谷盛曲翁冉骆蓝路游辛靳管柴蒙鲍华喻祁蒲房滕屈饶解牟艾尤阳时穆农司卓古吉缪简车项连芦麦褚娄窦戚岑景党宫费卜冷晏席卫米柏宗瞿桂全佟应臧闵苟邬边卞姬师和仇栾隋商刁沙荣巫寇桑郎甄丛仲虞敖巩明佘池查麻苑迟邝";
const CN_COMPOUND_SURNAMES: &[&str] = &[
    "欧阳", "司马", "诸葛", "上官", "东方", "慕容", "皇甫", "令狐", "司徒", "夏侯",
];
/// Characters that end a name: particles, verbs and pronouns that follow it.
const CN_NAME_STOP: &str = "的是在了和与我你他她它们今明昨去来到从说请叫吧呢吗啊，。、；：！？ 为有在想要会就也都很今年岁住做";

fn check_cn_name(text: &str, s: usize, e: usize) -> Option<Scored> {
    let cand = &text[s..e];
    let mut end = s;
    for (n, (i, c)) in cand.char_indices().enumerate() {
        if n >= 2 && CN_NAME_STOP.contains(c) {
            break;
        }
        if n >= 4 {
            break;
        }
        end = s + i + c.len_utf8();
    }
    let name = &text[s..end];
    if name.chars().count() < 2 {
        return None;
    }
    let surname = CN_COMPOUND_SURNAMES.iter().any(|p| name.starts_with(p))
        || name.chars().next().is_some_and(|c| CN_SURNAMES.contains(c));
    // "我叫" also means "I ordered/called" (我叫外卖): without a surname,
    // only the explicit form labels ("姓名：") count.
    let head = &text[floor_boundary(text, s.saturating_sub(16))..s];
    let explicit = head.contains('：') || head.contains(':') || head.contains("名字");
    let score = match (surname, explicit) {
        (true, _) => 0.85,
        (false, true) => 0.65,
        (false, false) => 0.4,
    };
    sc(s, end, score)
}

const EN_NAME_STOP: &[&str] = &[
    "String", "Option", "Vec", "Self", "None", "True", "False", "Null", "Some", "Str", "Optional",
    "Type", "Text", "Value", "Name", "Field", "Unknown", "User", "Admin", "Test", "Any", "List",
    "Dict", "Int", "Integer", "Bool", "Boolean", "Default", "Required", "The", "This", "Not",
    "Claude", "Python", "Rust", "Java", "Bob", "Alice",
];

/// Capitalised words that follow "I'm" without being a name.
const EN_IM_STOP: &[&str] = &[
    "New",
    "Not",
    "Sure",
    "Also",
    "Just",
    "So",
    "Still",
    "Stuck",
    "Happy",
    "Sorry",
    "Back",
    "Here",
    "On",
    "In",
    "At",
    "From",
    "With",
    "Using",
    "Trying",
    "Working",
    "Running",
    "Getting",
    "Going",
    "Building",
    "Writing",
    "Looking",
    "Seeing",
    "Done",
    "Fine",
    "Ok",
    "Okay",
    "Good",
    "Glad",
    "Confused",
    "Currently",
    "Really",
    "Very",
    "A",
    "An",
    "Your",
    "Chinese",
    "English",
    "American",
    "British",
    "Indian",
    "German",
    "French",
    "Japanese",
    "Korean",
    "Canadian",
];

fn check_en_name(text: &str, s: usize, e: usize) -> Option<Scored> {
    let name = &text[s..e];
    let first = name.split([' ', '-']).next().unwrap_or("");
    if EN_NAME_STOP.contains(&first) {
        return None;
    }
    let b = text.as_bytes();
    if s > 0 && matches!(b[s - 1], b'"' | b'\'' | b'`') {
        return None; // `name = "Widget"`: a literal in code
    }
    if b.get(e).is_some_and(|&c| {
        matches!(c, b'<' | b'(' | b'[' | b':' | b'.')
            && b.get(e + 1).is_some_and(|c| !c.is_ascii_whitespace())
    }) {
        return None;
    }
    let head = text[floor_boundary(text, s.saturating_sub(24))..s].to_lowercase();
    let strong = head.contains("my name") || head.contains("called") || head.contains("full name");
    let words = name.split(' ').count();
    // "I'm Priya and …", "I am Daniel Okafor,": an introduction when the
    // words are not an adjective/verb and the name ends the phrase.
    let h = head.trim_end();
    let intro = h.ends_with("i'm") || h.ends_with("i’m") || h.ends_with("i am");
    let score = if strong {
        0.85
    } else if intro {
        if EN_IM_STOP.contains(&first) || first.ends_with("ing") || first.ends_with("ed") {
            return None;
        }
        let rest = &text[e..];
        let ends_phrase = rest.is_empty()
            || rest.starts_with([',', '.', '!', ';', ')'])
            || rest.starts_with(" and ")
            || rest.starts_with(" from ");
        match (words >= 2, ends_phrase) {
            (true, true) => 0.8,
            (false, true) | (true, false) => 0.6,
            (false, false) => 0.3,
        }
    } else if head.contains("call me") {
        0.6
    } else if words >= 2 {
        0.7
    } else {
        0.4
    };
    sc(s, e, score)
}

// ---- the table ------------------------------------------------------------

pub(crate) fn pat(
    kind: EntityKind,
    re: &str,
    check: CheckFn,
    context: &[&str],
    boost: f32,
) -> Pattern {
    Pattern {
        kind,
        // The patterns are constants covered by tests; a typo is a programming error.
        #[allow(clippy::expect_used)]
        regex: Regex::new(re).expect("built-in recognizer regex"),
        group: 0,
        bounded: true,
        check: Check::Builtin(check),
        context: WordSet::new(context),
        boost,
        context_required: false,
        penalize_negative: true,
        needs: (0, 0),
        window: None,
    }
}

/// All built-in recognizers.
pub(crate) fn builtin() -> Vec<Pattern> {
    use EntityKind::*;
    let mut v = vec![
        Pattern {
            penalize_negative: false,
            ..pat(
                Email,
                r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}",
                check_email,
                &[],
                0.0,
            )
        },
        pat(
            Phone,
            r"(?:\+86[ -]?|0086[ -]?)?1[3-9][0-9](?:[ -]?[0-9]{4}){2}",
            check_cn_mobile,
            PHONE_CONTEXT,
            0.45,
        )
        .needs(0, 11)
        .windowed(11),
        pat(
            Phone,
            r"(?:\(0[1-9][0-9]{1,2}\)|0[1-9][0-9]{1,2}-)[0-9]{7,8}",
            check_cn_landline,
            PHONE_CONTEXT,
            0.4,
        )
        .needs(0, 9)
        .windowed(10),
        Pattern {
            bounded: false,
            group: 1,
            ..pat(
                Phone,
                r"(?:^|[^\w)\]+])(\+[1-9][0-9]{0,3}(?:[ .-]?\(?[0-9]{1,4}\)?){2,6})",
                check_intl_phone,
                PHONE_CONTEXT,
                0.3,
            )
        }
        .needs(0, 8)
        .windowed(3),
        pat(
            Phone,
            r"(?:\+?1[ .-]?)?(?:\([2-9][0-9]{2}\) ?|[2-9][0-9]{2}[.-])[2-9][0-9]{2}[.-][0-9]{4}",
            check_us_phone,
            PHONE_CONTEXT,
            0.45,
        )
        .needs(0, 10)
        .windowed(10),
        pat(
            Phone,
            r"0(?:7[0-9]{3} ?[0-9]{6}|[1-9][0-9]{1,3} [0-9]{3,4} [0-9]{3,4})",
            check_uk_phone,
            PHONE_CONTEXT,
            0.45,
        )
        .needs(0, 10)
        .windowed(9),
        pat(
            CnResidentId,
            r"[1-9][0-9]{16}[0-9Xx]|[1-9][0-9]{2}(?:[ -]?[0-9]){14}[ -]?[0-9Xx]",
            check_cn_id18,
            CN_ID_CONTEXT,
            0.35,
        )
        .needs(0, 17)
        .windowed(17),
        pat(
            CnResidentId,
            r"[1-9][0-9]{14}",
            check_cn_id15,
            CN_ID_CONTEXT,
            0.45,
        )
        .needs(15, 0)
        .windowed(15),
        pat(
            BankCard,
            r"[0-9](?:[ .-]?[0-9]){12,18}",
            check_card,
            CARD_CONTEXT,
            0.45,
        )
        .needs(0, 13)
        .windowed(13),
        Pattern {
            bounded: false,
            penalize_negative: false,
            ..pat(
                Iban,
                r"[A-Z]{2}[0-9]{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?",
                check_iban,
                IBAN_CONTEXT,
                0.1,
            )
        },
        pat(
            UsSsn,
            r"[0-9]{3}-[0-9]{2}-[0-9]{4}|[0-9]{3} [0-9]{2} [0-9]{4}|[0-9]{9}",
            check_ssn,
            SSN_CONTEXT,
            0.45,
        )
        .needs(0, 9)
        .windowed(9),
        Pattern {
            context_required: true,
            ..pat(
                Passport,
                r"[A-Z]{1,3}[0-9]{6,8}|[0-9]{9}",
                check_passport,
                PASSPORT_CONTEXT,
                0.6,
            )
        }
        .needs(6, 0)
        .windowed(6),
        // German passports: nine letters and digits (`C4J7PLM21`).
        Pattern {
            context_required: true,
            ..pat(
                Passport,
                r"[CFGHJKLMNPRTVWXYZ][CFGHJKLMNPRTVWXYZ0-9]{8}",
                check_passport,
                PASSPORT_CONTEXT,
                0.6,
            )
        },
        pat(
            IpAddress,
            r"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])",
            check_ipv4,
            IP_CONTEXT,
            0.3,
        )
        .needs(0, 4)
        .windowed(4),
        pat(
            IpAddress,
            r"(?:[0-9A-Fa-f]{1,4}|:):[0-9A-Fa-f:]{2,38}",
            check_ipv6,
            IP_CONTEXT,
            0.3,
        ),
        pat(
            MacAddress,
            r"[0-9A-Fa-f]{2}(?:[:-][0-9A-Fa-f]{2}){5}",
            check_mac,
            MAC_CONTEXT,
            0.3,
        ),
    ];
    let secret = |re: &str, check: CheckFn| Pattern {
        penalize_negative: false,
        ..pat(Secret, re, check, &[], 0.0)
    };
    v.push(Pattern {
        bounded: false,
        ..secret(
            r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----",
            check_pem,
        )
    });
    v.push(secret(
        r"(?:AKIA|ASIA|AIDA|AROA|AGPA|AIPA|ANPA|ANVA|ABIA|ACCA)[A-Z0-9]{16}",
        check_aws,
    ));
    v.push(secret(
        r"(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{82}|glpat-[A-Za-z0-9_-]{20}|xox[abprs]-[A-Za-z0-9-]{10,72}|sk_live_[0-9A-Za-z]{24,}|AIza[0-9A-Za-z_-]{35}|sk-(?:proj-)?[A-Za-z0-9_-]{32,}",
        check_token,
    ));
    v.push(Pattern {
        bounded: false,
        ..secret(
            r"https://hooks\.slack\.com/services/T[A-Z0-9]{6,}/B[A-Z0-9]{6,}/[A-Za-z0-9]{20,}",
            check_token,
        )
    });
    v.push(secret(
        r"eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{16,}",
        check_jwt,
    ));
    v.push(
        Pattern {
        group: 1,
        bounded: false,
        ..secret(
            r#"(?i)(?:[a-z0-9_.-]*(?:password|passwd|passphrase|pwd|secret|api[_-]?key|apikey|access[_-]?key|access[_-]?token|auth[_-]?token|private[_-]?key|client[_-]?secret|token|credentials?|passwort|kennwort|contrase(?:n|ñ)a|mot_de_passe|motdepasse)[a-z0-9_.-]*|[a-z0-9_.-]*pass(?-u:\b)|(?-u:\b)clave|(?-u:\b)mdp|密码|口令|密钥|令牌|パスワード|비밀번호)["']?\]?\s*(?:=|:|：|=>|是|为|\s+is\s+)\s*["'`]?([^\s"'`,;<>(){}\[\]]{4,})"#,
            check_assignment,
        )
    });
    v.push(Pattern {
        group: 1,
        bounded: false,
        ..secret(
            r"[a-z][a-z0-9+.-]*://[^\s:/@]+:([^\s:/@]{3,})@",
            check_url_password,
        )
    });
    // (user, password) pairs: `auth=('svc', 'pw')`, `HTTPBasicAuth("u", "pw")`,
    // `BasicAuth::new("u", Some("pw"))`-like calls, `credentials: ["u", "pw"]`.
    v.push(
        Pattern {
        group: 1,
        bounded: false,
        ..secret(
            r#"(?i)\b(?:auth|basic_?auth|http_?auth|httpbasicauth|httpdigestauth|digestauth|credentials?|creds|login)\s*(?:=|:|\(|::new\(|\.new\()\s*[(\[]?\s*["'][^"'\n]{1,64}["']\s*,\s*(?:some\()?["']([^"'\n]{4,128})["']"#,
            check_password_literal,
        )
    });
    // Passwords on a command line: `curl -u user:pw`, `mysql -pPW`,
    // `sshpass -p PW`, `--password PW` / `--password=PW`.
    v.push(Pattern {
        group: 1,
        bounded: false,
        ..secret(
            r#"(?:-u|--user)\s+["']?[^\s:"'$]+:([^\s"']{4,})"#,
            check_user_flag_password,
        )
    });
    v.push(Pattern {
        group: 1,
        bounded: false,
        ..secret(
            r#"\b(?:mysql|mysqldump|mysqladmin|mariadb)\b[^\n|;&]*?\s-p([^\s"'-][^\s"']{3,})"#,
            check_password_literal,
        )
    });
    v.push(
        Pattern {
        group: 1,
        bounded: false,
        ..secret(
            r#"(?i)(?:\bsshpass\s+-p|--(?:password|passwd|pass|db-password|admin-password))\s+["']?([^\s"'-][^\s"']{3,})"#,
            check_password_literal,
        )
    });
    v.push(Pattern {
        group: 1,
        bounded: false,
        penalize_negative: false,
        ..pat(
            PersonName,
            r"(?:我叫|我的名字是|我的名字叫|我名叫|本人叫|本人姓名[:：]?|姓名[:：]|名字[:：]|联系人[:：]|患者[:：]|收件人[:：]|户主[:：])\s*(\p{Han}{2,6})",
            check_cn_name,
            &[],
            0.0,
        )
    });
    // A contact record: a name directly followed by a CN mobile number (the
    // regex finds the number, the check returns the name before it).
    v.push(
        Pattern {
            penalize_negative: false,
            ..pat(
                PersonName,
                r"(?:\+86[ -]?|0086[ -]?)?1[3-9][0-9](?:[ -]?[0-9]{4}){2}",
                check_cn_name_before_phone,
                &[],
                0.0,
            )
        }
        .needs(0, 11)
        .windowed(11),
    );
    v.push(
        Pattern {
        group: 1,
        bounded: false,
        penalize_negative: false,
        ..pat(
            PersonName,
            r#"\b(?:(?i:my name is|my name's|i am called|i'm called|call me|full name\s*[:=]?|patient(?: name)?\s*[:=]|name\s*[:=])\s*["'`]?|(?:I'm|I am|I’m) )([A-Z][a-z]+(?:[ -][A-Z][a-z]+){0,2})"#,
            check_en_name,
            &[],
            0.0,
        )
    });
    v.extend(crate::formats::patterns());
    v
}

#[cfg(test)]
mod window_tests {
    use super::*;

    type Hits = Vec<(EntityKind, usize, usize, f32)>;

    fn both(p: &Pattern, text: &str) -> (Hits, Hits) {
        let (mut whole, mut windowed) = (Vec::new(), Vec::new());
        p.scan(text, &mut whole);
        p.scan_with(text, &DigitStats::of(text), &mut windowed);
        (whole, windowed)
    }

    /// Texts the windows must not change: every case of the corpora, this
    /// crate's sources, and digit groups of every shape beside letters,
    /// separators and multi-byte characters.
    fn texts() -> Vec<String> {
        let mut out = crate::test_texts::case_lines();
        out.push(include_str!("recognizers.rs").to_string());
        out.push(include_str!("formats.rs").to_string());
        // Pseudo-random mixes (a fixed LCG: the test is deterministic).
        let pieces = [
            "0", "1", "2", "7", "9", "13", "86", "+", "(", ")", " ", "-", ".", "/", "A", "X", "Z",
            "ab", "电话", "é", "\n", ":", "#", "+86 ", "2A", "_", "号",
        ];
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        for _ in 0..4000 {
            let mut t = String::new();
            for _ in 0..40 {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                t.push_str(pieces[(x >> 33) as usize % pieces.len()]);
            }
            out.push(t);
        }
        out
    }

    #[test]
    fn windowed_scans_find_exactly_what_whole_text_scans_find() {
        let texts = texts();
        let patterns = builtin();
        let windowed: Vec<&Pattern> = patterns.iter().filter(|p| p.window.is_some()).collect();
        assert!(windowed.len() >= 20, "{} windowed", windowed.len());
        let mut hits = 0;
        for p in windowed {
            for t in &texts {
                let (whole, win) = both(p, t);
                assert_eq!(whole, win, "{} on {t:?}", p.regex.as_str());
                hits += whole.len();
            }
        }
        assert!(hits > 500, "{hits} hits compared");
    }
}
