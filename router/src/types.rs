//! The router's vocabulary: entity kinds, hits, actions, decisions and the
//! live context a decision is taken in. None of these types holds the text
//! they were derived from, so they are safe to log.

use std::fmt;

use serde::{Serialize, Serializer};

/// What kind of sensitive entity a span is.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EntityKind {
    Email,
    Phone,
    CnResidentId,
    BankCard,
    Iban,
    UsSsn,
    Passport,
    IpAddress,
    MacAddress,
    Secret,
    PersonName,
    /// A national identity or tax number other than the Chinese resident ID
    /// (Spanish DNI/NIE, French NIR, German Steuer-ID, Japanese My Number,
    /// Korean RRN).
    NationalId,
    /// A recognizer defined in the operator's policy (its name, upper snake case).
    Custom(String),
}

impl EntityKind {
    /// Every built-in kind, in a stable order.
    pub const BUILTIN: [EntityKind; 12] = [
        EntityKind::Email,
        EntityKind::Phone,
        EntityKind::CnResidentId,
        EntityKind::BankCard,
        EntityKind::Iban,
        EntityKind::UsSsn,
        EntityKind::Passport,
        EntityKind::IpAddress,
        EntityKind::MacAddress,
        EntityKind::Secret,
        EntityKind::PersonName,
        EntityKind::NationalId,
    ];

    /// The name used in policies and JSON output, e.g. `BANK_CARD`.
    pub fn as_str(&self) -> &str {
        match self {
            EntityKind::Email => "EMAIL",
            EntityKind::Phone => "PHONE",
            EntityKind::CnResidentId => "CN_RESIDENT_ID",
            EntityKind::BankCard => "BANK_CARD",
            EntityKind::Iban => "IBAN",
            EntityKind::UsSsn => "US_SSN",
            EntityKind::Passport => "PASSPORT",
            EntityKind::IpAddress => "IP_ADDRESS",
            EntityKind::MacAddress => "MAC_ADDRESS",
            EntityKind::Secret => "SECRET",
            EntityKind::PersonName => "PERSON_NAME",
            EntityKind::NationalId => "NATIONAL_ID",
            EntityKind::Custom(name) => name,
        }
    }

    /// The built-in kind with this name, if any.
    pub fn builtin(name: &str) -> Option<EntityKind> {
        EntityKind::BUILTIN.into_iter().find(|k| k.as_str() == name)
    }
}

impl fmt::Display for EntityKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for EntityKind {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// One sensitive span: its kind, UTF-8 byte offsets into the classified text,
/// and a confidence score in `[0, 1]`. Never the text itself.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EntityHit {
    #[serde(rename = "type")]
    pub kind: EntityKind,
    pub start: usize,
    pub end: usize,
    pub score: f32,
}

/// One lexicon term found in the text: its category and byte span, and the
/// byte span of the disclosure cue that made it count (a first-person or
/// relative marker near it: "my", "我爸", "mi", "母が"), when there was one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CategoryHit {
    pub category: String,
    pub start: usize,
    pub end: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cue: Option<(usize, usize)>,
}

/// Where a request may run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Nothing leaves the device: the draft model answers alone.
    Local,
    /// Draft here, verify in the cloud.
    Speculative,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Local => "local",
            Action::Speculative => "speculative",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Live state a decision depends on besides the text.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouteContext {
    /// Current round-trip estimate to the verifier, if known.
    pub rtt_ms: Option<f64>,
    /// The verifier circuit breaker is open (verifier unreachable).
    pub breaker_open: bool,
    /// Battery charge in percent, if the device reports it.
    pub battery_pct: Option<u8>,
    /// Thermal throttling level (0 = nominal, 1 = fair, 2 = serious, 3 =
    /// critical: `tandem_edge::device::ThermalState`), if the device reports it.
    pub thermal_level: Option<u8>,
    /// The device is charging.
    pub charging: bool,
    /// The OS's power-save / low-power mode is on.
    pub power_save: bool,
    /// The user asked that nothing leave the device.
    pub user_opt_out: bool,
}

/// The router's answer for one request: the action, the rule that chose it,
/// and the evidence (entity kinds, spans, scores; category names).
///
/// `Debug` and `Display` show only kinds, offsets and scores, so a decision can
/// be logged as is.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    pub action: Action,
    /// Name of the policy rule that fired, `default` when none did, or
    /// `sticky:<rule>` when an earlier turn pinned the conversation local.
    pub rule: String,
    /// Entities at or above their threshold, sorted by start offset.
    pub entities: Vec<EntityHit>,
    /// Categories whose lexicon matched, sorted and deduplicated.
    pub categories: Vec<String>,
    /// True when the rule that fired looked at content (entities or categories),
    /// which is what makes a local decision sticky for a conversation.
    #[serde(skip)]
    pub content_based: bool,
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (rule {})", self.action, self.rule)?;
        if !self.entities.is_empty() {
            f.write_str(" entities [")?;
            for (i, e) in self.entities.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{}@{}..{}:{:.2}", e.kind, e.start, e.end, e.score)?;
            }
            f.write_str("]")?;
        }
        if !self.categories.is_empty() {
            write!(f, " categories [{}]", self.categories.join(", "))?;
        }
        Ok(())
    }
}
