//! [`RoutedRuntime`]: the privacy router in front of [`EdgeRuntime`].
//!
//! The app hands a whole conversation (an id and its messages) to
//! [`RoutedRuntime::chat`] (or a [`Turn`] to [`RoutedRuntime::turn`], the one
//! entry point under it: route, then generate). Before any verifier session exists, every message
//! is classified by the current policy of the shared [`Router`] in the live
//! [`RouteContext`] (breaker state and RTT estimate from the runtime, device
//! state from the app):
//!
//! * `local`: the draft model answers alone ([`EdgeRuntime::generate_local`],
//!   tokens [`TokenStatus::Local`](crate::TokenStatus::Local)); no connection
//!   is made, not one byte of the conversation leaves the device;
//! * `speculative`: the normal [`EdgeRuntime::generate`].
//!
//! When the rules are unsure the policy may ask the device's model
//! ([`crate::DraftOpinion`]); its classification prompt starts with the same
//! tokens as the generation's, so a turn decided local reuses that prompt's
//! draft KV ([`EdgeRuntime::offer_draft_kv`]); a turn decided speculative
//! drops it.
//!
//! **Stickiness.** A conversation routed local because of its content (a rule
//! with `entities`/`categories`) stays local: (1) every call replays all the
//! messages it is given through a fresh [`Conversation`], so a sensitive
//! message anywhere in the history pins the answer local even for a caller
//! that invents a new id; (2) the runtime remembers pinned conversation ids,
//! so a caller that sends only the newest message under the same id stays
//! local too. Local decisions caused only by the network or device state do
//! not pin. The remembered ids are bounded ([`DEFAULT_PIN_CAPACITY`],
//! [`RoutedRuntime::set_pin_capacity`]): the ids are client-chosen, so an
//! unbounded map would grow with every one a client invents. When it is
//! full, the least recently routed id is forgotten; a caller that still sends
//! that conversation's sensitive history is local again by (1), only a
//! caller that sends just the newest message of a forgotten conversation is
//! decided on that message alone.
//!
//! The [`RoutedDecision`] returned to the caller carries the rule, entity
//! kinds, byte spans (into the message it names) and scores, never the text;
//! it is also logged (`tracing`, target `tandem_edge::privacy`) without text.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::Serialize;
use tandem_model::speculative::GenerateConfig;
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_router::{
    Action, Conversation, Decision, Opinion, OpinionError, RouteContext, Router, SecondOpinion,
};

use crate::breaker::BreakerState;
use crate::conversation::common_prefix;
use crate::device::DeviceState;
use crate::error::EdgeError;
use crate::runtime::{EdgeEvent, EdgeGeneration, EdgeRuntime};
use crate::second_opinion::JudgedPromptKv;

/// Why a conversation went where it went. Holds no text.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RoutedDecision {
    /// The decision: action, rule (`sticky:<rule>` when an earlier message or
    /// an earlier call pinned the conversation), entities and categories.
    pub decision: Decision,
    /// Index (into the messages given) of the message the entity spans refer
    /// to: the one whose content decided, or the last message. `None` when the
    /// conversation was pinned by an earlier call whose message is not in this
    /// history.
    pub message: Option<usize>,
    /// The live context the decision was taken in.
    #[serde(serialize_with = "ser_ctx")]
    pub context: RouteContext,
    /// Generation of the policy that decided (see `RouteStats::generation`).
    pub policy_generation: u64,
}

fn ser_ctx<S: serde::Serializer>(c: &RouteContext, s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeStruct;
    let mut st = s.serialize_struct("RouteContext", 7)?;
    st.serialize_field("rtt_ms", &c.rtt_ms)?;
    st.serialize_field("breaker_open", &c.breaker_open)?;
    st.serialize_field("battery_pct", &c.battery_pct)?;
    st.serialize_field("thermal_level", &c.thermal_level)?;
    st.serialize_field("charging", &c.charging)?;
    st.serialize_field("power_save", &c.power_save)?;
    st.serialize_field("user_opt_out", &c.user_opt_out)?;
    st.end()
}

impl RoutedDecision {
    pub fn action(&self) -> Action {
        self.decision.action
    }
}

/// The result of [`RoutedRuntime::chat`].
#[derive(Clone, Debug)]
pub struct RoutedGeneration {
    pub route: RoutedDecision,
    pub generation: EdgeGeneration,
}

/// How many pinned conversation ids a [`RoutedRuntime`] remembers by default.
pub const DEFAULT_PIN_CAPACITY: usize = 10_000;

/// Conversation id -> the content rule that pinned it local, at most
/// `capacity` ids; the least recently used one is dropped first.
#[derive(Debug)]
struct PinMap {
    capacity: usize,
    /// Use counter; a `u64` does not wrap in practice (one step per route).
    tick: u64,
    by_id: HashMap<String, (String, u64)>,
    /// Last use -> id, oldest first.
    by_use: BTreeMap<u64, String>,
}

impl PinMap {
    fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            tick: 0,
            by_id: HashMap::new(),
            by_use: BTreeMap::new(),
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick = self.tick.wrapping_add(1);
        self.tick
    }

    /// The pinning rule, without counting as a use.
    fn peek(&self, id: &str) -> Option<&str> {
        self.by_id.get(id).map(|(rule, _)| rule.as_str())
    }

    /// The pinning rule, marking `id` as just used.
    fn touch(&mut self, id: &str) -> Option<String> {
        let now = self.next_tick();
        let (rule, used) = self.by_id.get_mut(id)?;
        self.by_use.remove(used);
        *used = now;
        self.by_use.insert(now, id.to_string());
        Some(rule.clone())
    }

    fn insert(&mut self, id: &str, rule: String) {
        self.remove(id);
        self.keep_at_most(self.capacity.saturating_sub(1));
        let now = self.next_tick();
        self.by_use.insert(now, id.to_string());
        self.by_id.insert(id.to_string(), (rule, now));
    }

    fn remove(&mut self, id: &str) {
        if let Some((_, used)) = self.by_id.remove(id) {
            self.by_use.remove(&used);
        }
    }

    fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        self.keep_at_most(self.capacity);
    }

    /// Forgets the least recently used ids until at most `n` remain.
    fn keep_at_most(&mut self, n: usize) {
        while self.by_id.len() > n {
            match self.by_use.pop_first() {
                Some((_, oldest)) => {
                    self.by_id.remove(&oldest);
                }
                None => break,
            }
        }
    }

    fn len(&self) -> usize {
        self.by_id.len()
    }

    /// (id, rule) pairs, least recently used first.
    fn entries(&self) -> Vec<(&str, &str)> {
        self.by_use
            .values()
            .filter_map(|id| self.by_id.get(id).map(|(r, _)| (id.as_str(), r.as_str())))
            .collect()
    }
}

/// Writes `pins` to `path` whole: a temporary file beside it (random name,
/// created new), then a rename over `path`.
fn write_pins(path: &Path, pins: &[(&str, &str)]) -> std::io::Result<()> {
    use std::hash::{BuildHasher, Hasher};
    use std::io::Write;
    let text = serde_json::to_vec(pins).map_err(std::io::Error::other)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}-{random:016x}", std::process::id()));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(&text)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// The pinned conversation ids and where they are kept across restarts
/// ([`RoutedRuntime::persist_pins`]).
#[derive(Debug)]
struct Pins {
    map: PinMap,
    file: Option<PathBuf>,
}

impl Pins {
    /// Writes the pins to the pin file, if there is one. A failure is logged:
    /// the pins still hold in memory.
    fn save(&self) {
        if let Some(path) = &self.file {
            if let Err(e) = write_pins(path, &self.map.entries()) {
                tracing::error!(path = %path.display(), error = %e, "pinned conversations not saved");
            }
        }
    }
}

/// [`EdgeRuntime`] behind the privacy router. See the module docs.
pub struct RoutedRuntime {
    runtime: EdgeRuntime,
    router: Arc<Router>,
    tokenizer: Tokenizer,
    /// The pinned ids and their file, shared with the runtime's siblings
    /// ([`RoutedRuntime::sibling`]): a conversation pinned on one is pinned
    /// on all.
    pins: Arc<Mutex<Pins>>,
    /// The device's model, asked when the policy's rules are unsure
    /// ([`RoutedRuntime::set_second_opinion`]).
    opinion: Option<Arc<dyn SecondOpinion>>,
}

impl RoutedRuntime {
    /// Made by [`crate::EdgeRuntimeBuilder::router`]: `tokenizer` must be the
    /// draft's (the chat template comes from it); `router` may be shared with
    /// an admin API that swaps its policy.
    pub(crate) fn new(runtime: EdgeRuntime, router: Arc<Router>, tokenizer: Tokenizer) -> Self {
        Self {
            runtime,
            router,
            tokenizer,
            pins: Arc::new(Mutex::new(Pins {
                map: PinMap::new(DEFAULT_PIN_CAPACITY),
                file: None,
            })),
            opinion: None,
        }
    }

    /// The second opinion asked when the policy's rules are unsure (its
    /// `[second_opinion]` mode; the builder installs the draft,
    /// [`crate::DraftOpinion`]); `None`: the rules alone decide. It runs on
    /// the device before anything is sent.
    pub fn set_second_opinion(&mut self, opinion: Option<Arc<dyn SecondOpinion>>) {
        self.opinion = opinion;
    }

    /// Keeps the pinned conversation ids in `path` (JSON, rewritten whole on
    /// every pin and unpin): the pins it holds now are loaded (so a
    /// conversation kept local before a restart stays local after it, even
    /// when its newest message alone is clean), and later changes are
    /// written. Returns how many pins were loaded. A missing file is an
    /// empty one; an unreadable one is an error (nothing is loaded).
    pub fn persist_pins(&mut self, path: &Path) -> Result<usize, EdgeError> {
        let loaded: Vec<(String, String)> = match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                EdgeError::Config(format!(
                    "pinned conversations file {}: {e} (expected a JSON array of [id, rule] pairs)",
                    path.display()
                ))
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(source) => {
                return Err(EdgeError::Read {
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        let mut pins = self.pins();
        for (id, rule) in &loaded {
            pins.map.insert(id, rule.clone());
        }
        pins.file = Some(path.to_path_buf());
        Ok(loaded.len())
    }

    /// The shared pins. A panic while holding them cannot leave the map
    /// inconsistent (its methods complete their updates): a poisoned lock
    /// is taken as it is.
    fn pins(&self) -> MutexGuard<'_, Pins> {
        self.pins.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A runtime for another generation slot beside this one
    /// ([`EdgeRuntime::sibling`]: the same draft weights, shared conversation
    /// cache and device state), sharing this one's router, pins (a
    /// conversation pinned local on one slot is pinned on every slot) and
    /// second opinion.
    pub fn sibling(&self) -> Result<Self, EdgeError> {
        Ok(Self {
            runtime: self.runtime.sibling()?,
            router: self.router.clone(),
            tokenizer: self.tokenizer.clone(),
            pins: self.pins.clone(),
            opinion: self.opinion.clone(),
        })
    }

    /// Remember at most `capacity` (at least 1) pinned conversation ids,
    /// dropping the least recently routed ones now if there are more.
    pub fn set_pin_capacity(&mut self, capacity: usize) {
        self.pins().map.set_capacity(capacity);
    }

    /// How many conversation ids are pinned local now.
    pub fn pinned_count(&self) -> usize {
        self.pins().map.len()
    }

    pub fn router(&self) -> &Arc<Router> {
        &self.router
    }

    pub fn runtime(&self) -> &EdgeRuntime {
        &self.runtime
    }

    /// Catches kept conversations' draft up while the device is idle
    /// ([`EdgeRuntime::catch_up`]; yields to a request at once).
    pub fn catch_up(&mut self, stop: &dyn Fn() -> bool) -> Result<crate::CatchUp, EdgeError> {
        self.runtime.catch_up(stop)
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Report the device state used by later decisions and generations
    /// ([`EdgeRuntime::set_device_state`]; a battery level over 100 % is
    /// refused and changes nothing).
    pub fn set_device_state(&self, device: DeviceState) -> Result<(), EdgeError> {
        self.runtime.set_device_state(device)
    }

    pub fn device_state(&self) -> DeviceState {
        self.runtime.device_state()
    }

    /// The live context a decision would be taken in now: breaker open, mean
    /// RTT of recent verifies (none before the first), device state.
    pub fn route_context(&self) -> RouteContext {
        let device = self.runtime.device_state();
        RouteContext {
            rtt_ms: self.runtime.rtt().mean_ms(),
            breaker_open: self.runtime.breaker_state() == BreakerState::Open,
            battery_pct: device.battery_pct,
            thermal_level: device.thermal_level(),
            charging: device.charging,
            power_save: device.power_save,
            user_opt_out: device.user_opt_out,
        }
    }

    /// The content rule that pinned `conversation_id` local, if any.
    pub fn pinned_by(&self, conversation_id: &str) -> Option<String> {
        self.pins().map.peek(conversation_id).map(str::to_string)
    }

    /// Drop what the runtime remembers about a conversation: its pin (a later
    /// call that still carries the sensitive history is local again anyway)
    /// and its kept state (draft KV, verifier session; see
    /// [`EdgeRuntime::generate_in`]).
    pub fn forget(&mut self, conversation_id: &str) {
        self.unpin(conversation_id);
        self.runtime.forget_conversation(conversation_id);
    }

    /// Decide where `messages` (oldest first, the newest last) may run,
    /// count the decision in the router's stats, log it without text and pin
    /// the conversation if its content made it local. Opens nothing.
    pub fn route(&mut self, conversation_id: &str, messages: &[ChatMessage]) -> RoutedDecision {
        self.route_keeping(conversation_id, messages, None).0
    }

    /// [`Self::route`]; with `prompt` (the generation's tokens), the second
    /// opinion keeps the draft KV of whichever of its judgements shares the
    /// longest prefix with `prompt`, and it is returned beside the decision.
    fn route_keeping(
        &mut self,
        conversation_id: &str,
        messages: &[ChatMessage],
        prompt: Option<&[u32]>,
    ) -> (RoutedDecision, Option<JudgedPromptKv>) {
        let keeping = match (&self.opinion, prompt) {
            (Some(opinion), Some(prompt)) => Some(KeepingOpinion {
                opinion: opinion.as_ref(),
                prompt,
                best: Mutex::new(None),
            }),
            _ => None,
        };
        let opinion: Option<&dyn SecondOpinion> = match &keeping {
            Some(k) => Some(k),
            None => self.opinion.as_deref(),
        };
        let ctx = self.route_context();
        let policy = self.router.policy();
        let policy_generation = self.router.generation();
        // Replay the history: the first content-local message pins the rest.
        let mut conv = Conversation::new();
        let mut last: Option<Decision> = None;
        let mut pin: Option<(usize, Decision)> = None;
        for (i, m) in messages.iter().enumerate() {
            let d = conv.decide_with_opinion(&policy, &m.content, &ctx, opinion);
            if pin.is_none() && conv.is_pinned_local() {
                pin = Some((i, d.clone()));
            }
            last = Some(d);
        }
        let (mut decision, mut message) = match (pin, last) {
            (Some((i, p)), Some(l)) if i + 1 < messages.len() => {
                // Sticky within this history: show the evidence that pinned it.
                let d = Decision {
                    action: Action::Local,
                    rule: l.rule,
                    entities: p.entities,
                    categories: p.categories,
                    content_based: true,
                };
                (d, Some(i))
            }
            (_, Some(l)) => (l, Some(messages.len() - 1)),
            (_, None) => (policy.decide("", &ctx), None),
        };
        // One lock over the look-up and the pin: a sibling routing the same
        // conversation at once sees the pin or makes it, never half of it.
        let mut pins = self.pins();
        if let Some(rule) = pins.map.touch(conversation_id) {
            if !(decision.action == Action::Local && decision.content_based) {
                // Pinned by an earlier call whose sensitive message this
                // history may not carry any more.
                decision = Decision {
                    action: Action::Local,
                    rule: format!("sticky:{rule}"),
                    entities: Vec::new(),
                    categories: Vec::new(),
                    content_based: true,
                };
                message = None;
            }
        } else if decision.action == Action::Local && decision.content_based {
            let rule = decision
                .rule
                .strip_prefix("sticky:")
                .unwrap_or(&decision.rule)
                .to_string();
            pins.map.insert(conversation_id, rule);
            pins.save();
        }
        drop(pins);
        self.router.record(&decision);
        tracing::info!(
            conversation = conversation_id,
            messages = messages.len(),
            action = decision.action.as_str(),
            rule = %decision.rule,
            message = ?message,
            rtt_ms = ?ctx.rtt_ms,
            breaker_open = ctx.breaker_open,
            policy_generation,
            decision = %decision,
            "routed"
        );
        let route = RoutedDecision {
            decision,
            message,
            context: ctx,
            policy_generation,
        };
        (route, keeping.and_then(KeepingOpinion::into_best))
    }

    /// Route the conversation, then answer its last message: locally with the
    /// draft alone, or speculatively with the verifier. `conversation_id` also
    /// names the conversation's kept state, so the next turn prefills only
    /// what is new ([`EdgeRuntime::generate_in`]; [`Self::forget`] drops it). The prompt is the
    /// draft tokenizer's chat template over `messages` with the assistant
    /// turn opened. `on_event` returns false to cancel.
    pub fn chat(
        &mut self,
        conversation_id: &str,
        messages: &[ChatMessage],
        gen: &GenerateConfig,
        on_event: &mut dyn FnMut(&EdgeEvent) -> bool,
    ) -> Result<RoutedGeneration, EdgeError> {
        let prompt = self.tokenizer.encode_chat(messages, true)?;
        self.generate_routed(conversation_id, messages, &prompt, gen, on_event)
    }

    /// As [`RoutedRuntime::chat`] with a prompt the caller tokenized itself
    /// (its own template, or raw text). `prompt` must be the tokens of exactly
    /// the text of `messages` plus template tokens: only what was routed may
    /// be sent.
    pub fn generate_routed(
        &mut self,
        conversation_id: &str,
        messages: &[ChatMessage],
        prompt: &[u32],
        gen: &GenerateConfig,
        on_event: &mut dyn FnMut(&EdgeEvent) -> bool,
    ) -> Result<RoutedGeneration, EdgeError> {
        let turn = Turn::new(conversation_id, messages, prompt, gen);
        match self.turn(turn, &mut |_| true, on_event)? {
            Some(RoutedTurn {
                route: Some(route),
                generation,
            }) => Ok(RoutedGeneration { route, generation }),
            // `Routing::Router` always decides, and the hook always starts.
            _ => Err(EdgeError::Runtime(
                "the routed turn ended without a decision".into(),
            )),
        }
    }

    /// The one turn entry point: decide where the turn runs ([`Turn::routing`]:
    /// the router, or a fixed place), call `on_started` with the decision
    /// (`None` when the router was not asked) once it is taken and the
    /// generation is about to begin, then generate: with the draft alone
    /// ([`EdgeRuntime::generate_local_in`]) or speculatively
    /// ([`EdgeRuntime::generate_in`]), under [`Turn::state`], with the turn's
    /// anonymous scope and cancel flag. A local generation after the router
    /// asked its second opinion starts from the opinion's draft KV of the
    /// text ([`EdgeRuntime::offer_draft_kv`]: the shared prompt prefix is not
    /// prefilled again; the tokens are those of a fresh prefill). `on_started` returns false to end
    /// the turn without generating: `Ok(None)`. `on_event` returns false to
    /// cancel. An [ephemeral](Turn::ephemeral) id's pin is dropped right after
    /// the decision and its kept state when the turn ends, however it ends.
    pub fn turn(
        &mut self,
        turn: Turn<'_>,
        on_started: &mut dyn FnMut(Option<&RoutedDecision>) -> bool,
        on_event: &mut dyn FnMut(&EdgeEvent) -> bool,
    ) -> Result<Option<RoutedTurn>, EdgeError> {
        self.runtime.set_anonymous_scope(turn.anonymous_scope);
        let (route, action, judged) = match turn.routing {
            Routing::Router => {
                let (r, judged) =
                    self.route_keeping(turn.conversation_id, turn.messages, Some(turn.prompt));
                let action = r.action();
                (Some(r), action, judged)
            }
            Routing::Local => (None, Action::Local, None),
            Routing::Speculative => (None, Action::Speculative, None),
        };
        if turn.ephemeral {
            self.unpin(turn.conversation_id);
        }
        let res = if on_started(route.as_ref()) {
            if let (Action::Local, Some(judged)) = (action, judged) {
                // The second opinion's KV of the text is the local
                // generation's prompt prefix: not prefilled again.
                let offered =
                    self.runtime
                        .offer_draft_kv(turn.state, turn.prompt, turn.gen, judged);
                tracing::debug!(
                    conversation = turn.conversation_id,
                    positions = offered,
                    "second opinion's draft KV offered to the local generation"
                );
            }
            self.runtime.set_cancel_flag(turn.cancel);
            let (state, prompt, gen) = (turn.state, turn.prompt, turn.gen);
            let res = match action {
                Action::Local => self.runtime.generate_local_in(state, prompt, gen, on_event),
                Action::Speculative => self.runtime.generate_in(state, prompt, gen, on_event),
            };
            self.runtime.set_cancel_flag(None);
            res.map(|generation| Some(RoutedTurn { route, generation }))
        } else {
            Ok(None)
        };
        if turn.ephemeral {
            self.runtime.forget_conversation(turn.conversation_id);
        }
        res
    }

    /// Drops `conversation_id`'s pin, if it has one (and saves the pins).
    fn unpin(&mut self, conversation_id: &str) {
        let mut pins = self.pins();
        if pins.map.peek(conversation_id).is_some() {
            pins.map.remove(conversation_id);
            pins.save();
        }
    }
}

/// The second opinion during one [`RoutedRuntime::turn`]: asks `opinion` to
/// keep its work ([`SecondOpinion::judge_keeping`]) and holds the draft KV
/// that shares the longest prefix with the generation's `prompt` (one at a
/// time: each is a whole context's cache).
struct KeepingOpinion<'a> {
    opinion: &'a dyn SecondOpinion,
    prompt: &'a [u32],
    /// (shared prefix with `prompt`, the KV).
    best: Mutex<Option<(usize, JudgedPromptKv)>>,
}

impl KeepingOpinion<'_> {
    fn into_best(self) -> Option<JudgedPromptKv> {
        let best = self
            .best
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        best.map(|(_, kv)| kv)
    }
}

impl SecondOpinion for KeepingOpinion<'_> {
    fn judge(&self, text: &str) -> Result<Opinion, OpinionError> {
        let (opinion, work) = self.opinion.judge_keeping(text)?;
        if let Some(kv) = work.and_then(|w| w.downcast::<JudgedPromptKv>().ok()) {
            let shared = common_prefix(&kv.tokens, self.prompt);
            let mut best = self.best.lock().unwrap_or_else(PoisonError::into_inner);
            if best.as_ref().is_none_or(|(s, _)| shared > *s) {
                *best = Some((shared, *kv));
            }
        }
        Ok(opinion)
    }
}

/// Where a [`Turn`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// The privacy router decides ([`RoutedRuntime::route`]: counted, logged
    /// without text, content-local conversations pinned).
    Router,
    /// No decision: on the device, the draft alone.
    Local,
    /// No decision: speculatively, with the verifier when one is configured
    /// (else on the device).
    Speculative,
}

/// One turn for [`RoutedRuntime::turn`].
#[derive(Clone, Debug)]
pub struct Turn<'a> {
    /// The conversation's id: what the router pins.
    pub conversation_id: &'a str,
    /// What the router reads (oldest first, the newest last). `prompt` must
    /// be the tokens of exactly their text plus template tokens: only what
    /// was routed may be sent.
    pub messages: &'a [ChatMessage],
    pub prompt: &'a [u32],
    pub gen: &'a GenerateConfig,
    pub routing: Routing,
    /// The name the turn's kept state is found and kept under
    /// ([`EdgeRuntime::generate_in`]); `None`: an anonymous request, matched
    /// to kept state by its prompt within `anonymous_scope`.
    pub state: Option<&'a str>,
    /// The id is this turn's alone (the caller named no conversation):
    /// nothing of it is remembered after the turn.
    pub ephemeral: bool,
    /// The client scope of an anonymous turn ([`EdgeRuntime::set_anonymous_scope`]).
    pub anonymous_scope: Option<String>,
    /// A flag that cancels the generation before its first token too
    /// ([`EdgeRuntime::set_cancel_flag`]); set for this turn only.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl<'a> Turn<'a> {
    /// A routed turn of the conversation `conversation_id`, its state kept
    /// under that id, in the one anonymous scope of a device app, with no
    /// cancel flag.
    pub fn new(
        conversation_id: &'a str,
        messages: &'a [ChatMessage],
        prompt: &'a [u32],
        gen: &'a GenerateConfig,
    ) -> Self {
        Self {
            conversation_id,
            messages,
            prompt,
            gen,
            routing: Routing::Router,
            state: Some(conversation_id),
            ephemeral: false,
            anonymous_scope: Some(String::new()),
            cancel: None,
        }
    }
}

/// What [`RoutedRuntime::turn`] answers: the decision (`None` when the
/// router was not asked) and the generation.
#[derive(Clone, Debug)]
pub struct RoutedTurn {
    pub route: Option<RoutedDecision>,
    pub generation: EdgeGeneration,
}
