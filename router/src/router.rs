//! [`Router`]: the live, swappable policy plus decision statistics, and
//! [`Conversation`]: per-conversation stickiness.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use serde::Serialize;

use crate::policy::{Policy, PolicyError};
use crate::types::{Action, Decision, RouteContext};

/// Decision counts by rule and action, for `GET /v1/route/stats`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RouteStats {
    pub total: u64,
    pub local: u64,
    pub speculative: u64,
    /// rule name -> action -> count
    pub by_rule: BTreeMap<String, BTreeMap<String, u64>>,
    /// Policy generation: 1 for the first policy, +1 per successful reload.
    pub generation: u64,
}

/// The router a runtime holds: one current [`Policy`], replaced atomically by
/// `reload_*` only after the new one validated. Readers clone an `Arc` and
/// never block a reload for longer than that clone.
#[derive(Debug)]
pub struct Router {
    current: RwLock<Arc<Policy>>,
    generation: AtomicU64,
    stats: Mutex<RouteStats>,
}

impl Router {
    pub fn new(policy: Policy) -> Router {
        Router {
            current: RwLock::new(Arc::new(policy)),
            generation: AtomicU64::new(1),
            stats: Mutex::new(RouteStats::default()),
        }
    }

    pub fn from_toml_str(src: &str) -> Result<Router, PolicyError> {
        Ok(Router::new(Policy::from_toml_str(src)?))
    }

    pub fn from_file(path: impl AsRef<Path>) -> Result<Router, PolicyError> {
        Ok(Router::new(Policy::from_file(path)?))
    }

    /// A router with the built-in default policy.
    pub fn with_default_policy() -> Router {
        Router::new(Policy::builtin_default())
    }

    /// The policy serving right now.
    pub fn policy(&self) -> Arc<Policy> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Number of policies this router has served (starts at 1).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Validate `src` and, only if it is valid, make it the current policy.
    /// On error the old policy keeps serving. Returns the new generation.
    pub fn reload_from_str(&self, src: &str) -> Result<u64, PolicyError> {
        let next = Policy::from_toml_str(src)?;
        Ok(self.replace(next))
    }

    /// As [`Router::reload_from_str`], reading a file.
    pub fn reload_from_file(&self, path: impl AsRef<Path>) -> Result<u64, PolicyError> {
        let next = Policy::from_file(path)?;
        Ok(self.replace(next))
    }

    /// Make an already validated policy the current one (for a caller that
    /// must persist it between validating and serving it, as the admin API's
    /// `PUT` does). Returns the new generation.
    pub fn replace(&self, next: Policy) -> u64 {
        let mut cur = self.current.write().unwrap_or_else(PoisonError::into_inner);
        *cur = Arc::new(next);
        self.generation.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Decide one text with the current policy and count the decision.
    pub fn decide(&self, text: &str, ctx: &RouteContext) -> Decision {
        let d = self.policy().decide(text, ctx);
        self.record(&d);
        d
    }

    /// Decide the last message of a conversation given all its messages
    /// (oldest first), as a stateless API receives them: if any earlier
    /// message was routed local for its content, the answer is local.
    /// Entity offsets refer to the last message.
    pub fn decide_messages(&self, messages: &[&str], ctx: &RouteContext) -> Option<Decision> {
        let policy = self.policy();
        let mut conv = Conversation::new();
        let mut last = None;
        for m in messages {
            last = Some(conv.decide_with(&policy, m, ctx));
        }
        if let Some(d) = &last {
            self.record(d);
        }
        last
    }

    /// Count a decision taken outside [`Router::decide`] (e.g. by a caller
    /// that replays a conversation with [`Conversation::decide_with`]).
    pub fn record(&self, d: &Decision) {
        let mut s = self.stats.lock().unwrap_or_else(PoisonError::into_inner);
        s.total += 1;
        match d.action {
            Action::Local => s.local += 1,
            Action::Speculative => s.speculative += 1,
        }
        *s.by_rule
            .entry(d.rule.clone())
            .or_default()
            .entry(d.action.as_str().to_string())
            .or_default() += 1;
    }

    /// A snapshot of the decision counters.
    pub fn stats(&self) -> RouteStats {
        let mut s = self
            .stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        s.generation = self.generation();
        s
    }
}

/// Stickiness state of one conversation: once a turn is routed local because
/// of its content, every later turn of that conversation is local too (the
/// history it carries is sensitive). Local decisions caused only by the
/// network or device state do not stick.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Conversation {
    pinned_by: Option<String>,
}

impl Conversation {
    pub fn new() -> Conversation {
        Conversation::default()
    }

    /// The rule that pinned this conversation local, if any.
    pub fn pinned_by(&self) -> Option<&str> {
        self.pinned_by.as_deref()
    }

    pub fn is_pinned_local(&self) -> bool {
        self.pinned_by.is_some()
    }

    /// Decide the next turn through `router` (counted in its stats).
    pub fn decide_turn(&mut self, router: &Router, turn: &str, ctx: &RouteContext) -> Decision {
        let d = self.decide_with(&router.policy(), turn, ctx);
        router.record(&d);
        d
    }

    /// Decide the next turn with an explicit policy (not counted).
    pub fn decide_with(&mut self, policy: &Policy, turn: &str, ctx: &RouteContext) -> Decision {
        self.decide_with_opinion(policy, turn, ctx, None)
    }

    /// [`Conversation::decide_with`], asking `opinion` (the device's model)
    /// when the policy's rules are unsure about the turn
    /// ([`Policy::decide_with_opinion`]). A turn the opinion kept local pins
    /// the conversation like any content rule.
    pub fn decide_with_opinion(
        &mut self,
        policy: &Policy,
        turn: &str,
        ctx: &RouteContext,
        opinion: Option<&dyn crate::SecondOpinion>,
    ) -> Decision {
        // A pinned conversation is local whatever the model would say.
        let d = match opinion.filter(|_| self.pinned_by.is_none()) {
            Some(o) => policy.decide_with_opinion(turn, ctx, o).0,
            None => policy.decide(turn, ctx),
        };
        self.pin(d)
    }

    /// Applies and updates the pin: a pinned conversation stays local.
    fn pin(&mut self, mut d: Decision) -> Decision {
        match &self.pinned_by {
            Some(rule) => {
                d.action = Action::Local;
                d.rule = format!("sticky:{rule}");
                d.content_based = true;
            }
            None => {
                if d.action == Action::Local && d.content_based {
                    self.pinned_by = Some(d.rule.clone());
                }
            }
        }
        d
    }
}
