//! tandem-router: decides, per request, whether any of it may leave the device.
//!
//! Three parts, in the order a request meets them:
//!
//! 1. **Recognizers** find sensitive spans (`EMAIL`, `PHONE`, `CN_RESIDENT_ID`,
//!    `BANK_CARD`, `IBAN`, `US_SSN`, `PASSPORT`, `IP_ADDRESS`, `MAC_ADDRESS`,
//!    `SECRET`, `PERSON_NAME`, plus custom ones from the policy). Each has a
//!    score, a checksum where one exists, and context words (Chinese and
//!    English) that raise the score; words marking test data or code constants
//!    lower it, because code is this product's normal input.
//! 2. **Lexicons** (`data/lexicons/*.txt`) tag categories: health, finance,
//!    legal, religion, sexual, location, minors.
//! 3. The operator's **policy** (TOML, see [`policy`]) turns entities,
//!    categories and the live [`RouteContext`] into a [`Decision`]: `local` or
//!    `speculative`, with the rule that fired and the evidence (kinds, byte
//!    offsets, scores) but never the text itself.
//!
//! A runtime holds a [`Router`] (hot-swappable policy: an invalid reload is
//! refused and the old policy keeps serving) and one [`Conversation`] per chat
//! (a conversation routed local for its content stays local).
//!
//! ```
//! use tandem_router::{Action, RouteContext, Router};
//! let router = Router::with_default_policy();
//! let d = router.decide("我的身份证号是11010519491231002X", &RouteContext::default());
//! assert_eq!(d.action, Action::Local);
//! assert_eq!(d.entities[0].kind.as_str(), "CN_RESIDENT_ID");
//! assert!(!d.to_string().contains("11010519491231002X"));
//! ```

pub mod classify;
mod formats;
pub mod lexicon;
pub mod policy;
mod recognizers;
mod router;
pub mod second_opinion;
#[cfg(test)]
mod test_texts;
mod types;
pub mod validate;

pub use classify::Classification;
pub use policy::{Policy, PolicyError, Rule, DEFAULT_POLICY_TOML};
pub use recognizers::Validator;
pub use router::{Conversation, RouteStats, Router};
pub use second_opinion::{KeptWork, Opinion, OpinionError, OpinionMode, SecondOpinion, Unsure};
pub use types::{Action, CategoryHit, Decision, EntityHit, EntityKind, RouteContext};
