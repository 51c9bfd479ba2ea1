//! The device's own model as a second opinion (issue 32, item 4): the
//! interface the edge runtime plugs its draft model into, and when the
//! router asks it.
//!
//! The rules stay first. The opinion is asked only when they are unsure:
//!
//! * **an entity in the band**: a candidate scored at or above the policy's
//!   `second_opinion.band_low` but under its threshold (a bare mobile number,
//!   a Luhn-valid number without a card word), and the rules routed the text
//!   `speculative`. A `Sensitive` answer routes it local.
//! * **a category without a cue**: the rules routed the text local only
//!   because of category terms that counted on the word alone (a plain term
//!   with no first-person or relative cue near it: "metformin side effects
//!   table"). A `Benign` answer lets it run speculative.
//!
//! The policy turns it `off`, `on` (both cases) or `categories` (the second
//! case only). The opinion runs on the device ([`SecondOpinion`] gets the
//! text and must not send it anywhere): nothing leaves the device before the
//! decision. An error from the model keeps the text local.
//!
//! The model side (the constrained classification prompt on the draft model,
//! its one-token answer from a fixed set, reusing the prompt's KV for a local
//! generation through [`SecondOpinion::judge_keeping`]) lives with the edge
//! runtime; see docs/privacy.md "Second opinion".

use crate::policy::Policy;
use crate::types::{Action, Decision, RouteContext};

/// What the device's model says about a text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opinion {
    /// The text discloses something about a real person, or carries an
    /// identifier or a secret: keep it on the device.
    Sensitive,
    /// Nothing personal: it may use the verifier.
    Benign,
}

/// What a judgement computed that a generation of the same text on the
/// device may reuse (the edge runtime's draft model: the classification
/// prompt's tokens and KV). Opaque to the router: the caller that asked for
/// it knows its type.
pub type KeptWork = Box<dyn std::any::Any + Send>;

/// A model that classifies a text on the device. Implementations must not
/// send the text off the device.
pub trait SecondOpinion: Send + Sync {
    /// Judge `text`. An error keeps the text local.
    fn judge(&self, text: &str) -> Result<Opinion, OpinionError>;

    /// As [`Self::judge`], handing back what the judgement computed when a
    /// later generation on the device could reuse it (`None`: nothing, e.g.
    /// an answer remembered from before). The default keeps nothing.
    fn judge_keeping(&self, text: &str) -> Result<(Opinion, Option<KeptWork>), OpinionError> {
        Ok((self.judge(text)?, None))
    }
}

/// The on-device model could not answer.
#[derive(Debug, thiserror::Error)]
#[error("second opinion unavailable: {0}")]
pub struct OpinionError(pub String);

/// When the policy asks the second opinion.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OpinionMode {
    /// Never (the default): the rules alone decide.
    #[default]
    Off,
    /// For an entity in the band and for a category without a cue.
    On,
    /// Only for a category without a cue.
    Categories,
}

/// Why the rules were unsure, when they were.
#[derive(Clone, Debug, PartialEq)]
pub enum Unsure {
    /// An entity candidate scored in `[band_low, threshold)`.
    EntityInBand { kind: String, score: f32 },
    /// The local decision rests only on category terms without a cue.
    CategoryWithoutCue { categories: Vec<String> },
}

/// Rule name of a decision the second opinion changed.
pub const SECOND_OPINION_RULE: &str = "second-opinion";

impl Policy {
    /// Why the rules are unsure about `text` (given their decision `d`),
    /// under this policy's second-opinion mode; `None` when they are sure
    /// or the mode is off.
    pub fn unsure(&self, text: &str, d: &Decision) -> Option<Unsure> {
        let mode = self.second_opinion_mode();
        if mode == OpinionMode::Off {
            return None;
        }
        if d.action == Action::Local && d.content_based && d.entities.is_empty() {
            let (_, hits) = self.classify(text);
            if !hits.is_empty() && hits.iter().all(|h| h.cue.is_none()) {
                let mut categories: Vec<String> = hits.into_iter().map(|h| h.category).collect();
                categories.sort();
                categories.dedup();
                return Some(Unsure::CategoryWithoutCue { categories });
            }
        }
        if mode == OpinionMode::On && d.action == Action::Speculative && d.rule == "default" {
            let low = self.second_opinion_band_low();
            let raw = self.classify_raw(text);
            if let Some(e) = raw
                .entities
                .iter()
                .filter(|e| e.score >= low && e.score < self.threshold(&e.kind))
                .max_by(|a, b| a.score.total_cmp(&b.score))
            {
                return Some(Unsure::EntityInBand {
                    kind: e.kind.as_str().to_string(),
                    score: e.score,
                });
            }
        }
        None
    }

    /// [`Policy::decide`], then the second opinion when the rules are
    /// unsure (see the module docs). Returns the decision and why the
    /// opinion was asked, if it was.
    pub fn decide_with_opinion(
        &self,
        text: &str,
        ctx: &RouteContext,
        opinion: &dyn SecondOpinion,
    ) -> (Decision, Option<Unsure>) {
        let mut d = self.decide(text, ctx);
        let Some(why) = self.unsure(text, &d) else {
            return (d, None);
        };
        let answer = opinion.judge(text);
        match (&why, answer) {
            (Unsure::EntityInBand { .. }, Ok(Opinion::Sensitive) | Err(_)) => {
                d.action = Action::Local;
                d.rule = SECOND_OPINION_RULE.to_string();
                d.content_based = true;
            }
            (Unsure::CategoryWithoutCue { .. }, Ok(Opinion::Benign)) => {
                d.action = Action::Speculative;
                d.rule = SECOND_OPINION_RULE.to_string();
                d.content_based = false;
            }
            _ => {}
        }
        (d, Some(why))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    struct Fixed(Result<Opinion, ()>, AtomicUsize);

    impl SecondOpinion for Fixed {
        fn judge(&self, _text: &str) -> Result<Opinion, OpinionError> {
            self.1.fetch_add(1, Ordering::SeqCst);
            self.0.map_err(|()| OpinionError("model not loaded".into()))
        }
    }

    fn policy(mode: &str) -> Policy {
        Policy::from_toml_str(&format!(
            r#"
version = 1
default = "speculative"
[second_opinion]
mode = "{mode}"
band_low = 0.3
[[rules]]
name = "sensitive"
action = "local"
entities = ["*"]
[[rules]]
name = "topics"
action = "local"
categories = ["*"]
"#
        ))
        .unwrap()
    }

    fn ask(p: &Policy, text: &str, o: Result<Opinion, ()>) -> (Decision, Option<Unsure>, usize) {
        let f = Fixed(o, AtomicUsize::new(0));
        let (d, why) = p.decide_with_opinion(text, &RouteContext::default(), &f);
        (d, why, f.1.load(Ordering::SeqCst))
    }

    // A bare CN mobile number scores 0.4: under the 0.5 threshold, in the band.
    const BAND: &str = "13812345678";
    // A plain health term with no cue, and the same with one.
    const NO_CUE: &str = "metformin dosing";
    const CUE: &str = "my metformin dosing";

    #[test]
    fn sure_texts_never_ask() {
        let p = policy("on");
        for text in ["write a quicksort in Rust", CUE, "SSN 536-22-1234"] {
            let (_, why, calls) = ask(&p, text, Ok(Opinion::Benign));
            assert_eq!((why, calls), (None, 0), "{text}");
        }
    }

    #[test]
    fn an_entity_in_the_band_goes_local_on_a_sensitive_answer_or_an_error() {
        let p = policy("on");
        let (d, why, calls) = ask(&p, BAND, Ok(Opinion::Sensitive));
        assert!(matches!(why, Some(Unsure::EntityInBand { .. })));
        assert_eq!(calls, 1);
        assert_eq!(
            (d.action, d.rule.as_str()),
            (Action::Local, SECOND_OPINION_RULE)
        );
        let (d, _, _) = ask(&p, BAND, Err(()));
        assert_eq!(d.action, Action::Local);
        let (d, _, _) = ask(&p, BAND, Ok(Opinion::Benign));
        assert_eq!(
            (d.action, d.rule.as_str()),
            (Action::Speculative, "default")
        );
    }

    #[test]
    fn a_category_without_a_cue_runs_speculative_on_a_benign_answer() {
        let p = policy("categories");
        let (d, why, _) = ask(&p, NO_CUE, Ok(Opinion::Benign));
        assert!(matches!(why, Some(Unsure::CategoryWithoutCue { .. })));
        assert_eq!(d.action, Action::Speculative);
        assert!(!d.content_based);
        let (d, _, _) = ask(&p, NO_CUE, Ok(Opinion::Sensitive));
        assert_eq!((d.action, d.rule.as_str()), (Action::Local, "topics"));
        // A model error keeps it local.
        let (d, _, _) = ask(&p, NO_CUE, Err(()));
        assert_eq!(d.action, Action::Local);
        // "categories" mode does not ask about entities.
        let (_, why, calls) = ask(&p, BAND, Ok(Opinion::Sensitive));
        assert_eq!((why, calls), (None, 0));
    }

    #[test]
    fn a_conversation_kept_local_by_the_opinion_stays_local_without_asking_again() {
        let p = policy("on");
        let f = Fixed(Ok(Opinion::Sensitive), AtomicUsize::new(0));
        let mut conv = crate::Conversation::new();
        let ctx = RouteContext::default();
        let d = conv.decide_with_opinion(&p, BAND, &ctx, Some(&f));
        assert_eq!(
            (d.action, d.rule.as_str()),
            (Action::Local, SECOND_OPINION_RULE)
        );
        assert_eq!(conv.pinned_by(), Some(SECOND_OPINION_RULE));
        let d = conv.decide_with_opinion(&p, BAND, &ctx, Some(&f));
        assert_eq!(d.rule, format!("sticky:{SECOND_OPINION_RULE}"));
        assert_eq!(f.1.load(Ordering::SeqCst), 1, "asked again though pinned");
        // Without an opinion the rules alone decide (the band is under the threshold).
        let mut fresh = crate::Conversation::new();
        assert_eq!(
            fresh.decide_with_opinion(&p, BAND, &ctx, None).action,
            Action::Speculative
        );
    }

    #[test]
    fn off_never_asks() {
        let p = policy("off");
        for text in [BAND, NO_CUE] {
            let (_, why, calls) = ask(&p, text, Ok(Opinion::Sensitive));
            assert_eq!((why, calls), (None, 0));
        }
    }
}
