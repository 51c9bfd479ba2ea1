//! What happens when a conversation outgrows the context (docs/edge.md
//! "Conversations"): the configured [`ContextPolicy`] applies, and nothing is
//! ever truncated silently.
//!
//! * `refuse` (the default): a conversation whose prompt leaves no room for a
//!   single reply token within the limit is refused with an error that names
//!   the limit and the prompt's size.
//! * `drop_oldest`: the fewest oldest messages after the leading system
//!   messages are dropped so that the prompt leaves room for the reply
//!   (`min(max_tokens, limit / 4)` tokens); the last message is never dropped.
//!   How many were dropped is returned so that the caller reports it
//!   (serve-edge: `tandem.dropped_messages`; the C ABI: the stats). The count
//!   is found by bisection (a chat template renders each message as its own
//!   segment, so the prompt shrinks with every message dropped): about
//!   log2(n) renders of the history instead of one per dropped message, which
//!   made 60,000 tiny messages a quadratic wedge. A caller's `cancelled` is
//!   asked between renders.
//!
//! Both sides agree on what was dropped by construction: the device sends the
//! verifier the tokens of the prompt it rendered after dropping, so the
//! verifier's context is exactly the device's (and the greedy output is the
//! target's own output for that truncated conversation).

use serde::{Deserialize, Serialize};
use tandem_model::tokenizer::{ChatMessage, Role, Tokenizer};

/// `conversations.context_policy`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContextPolicy {
    #[default]
    Refuse,
    DropOldest,
}

impl std::fmt::Display for ContextPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Refuse => "refuse",
            Self::DropOldest => "drop_oldest",
        })
    }
}

impl std::str::FromStr for ContextPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "refuse" => Ok(Self::Refuse),
            "drop_oldest" => Ok(Self::DropOldest),
            other => Err(format!(
                "unknown context policy {other:?}: expected refuse or drop_oldest"
            )),
        }
    }
}

/// Why a conversation cannot be rendered within the limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContextError {
    #[error(
        "the conversation is {prompt_tokens} tokens and leaves no room for a reply within the \
         context limit of {limit} tokens (context_policy = {policy}{hint})"
    )]
    TooLong {
        prompt_tokens: usize,
        limit: usize,
        policy: ContextPolicy,
        hint: &'static str,
    },
    #[error("the chat template failed: {0}")]
    Template(String),
    /// The caller's `cancelled` said so (the client went away).
    #[error("cancelled while fitting the conversation into the context")]
    Cancelled,
}

/// A conversation rendered within the limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fitted {
    pub prompt: Vec<u32>,
    /// Messages dropped from the start (after the system messages).
    pub dropped_messages: usize,
}

/// How many messages at the start of `messages` are system messages.
fn leading_system(messages: &[ChatMessage]) -> usize {
    messages
        .iter()
        .take_while(|m| m.role == Role::System)
        .count()
}

/// Removes the `n` oldest messages after the leading system messages (what
/// `drop_oldest` dropped, as [`Fitted::dropped_messages`] counts it): a
/// caller that keeps the history applies the policy's drop with it.
pub fn drop_oldest(messages: &mut Vec<ChatMessage>, n: usize) {
    let system = leading_system(messages);
    let end = system.saturating_add(n).min(messages.len());
    messages.drain(system..end);
}

/// Renders `messages` (with the assistant turn opened) so that the prompt fits
/// `limit` tokens with room for a reply of up to `max_tokens`, under `policy`
/// (see the module doc).
pub fn fit_messages(
    tok: &Tokenizer,
    messages: &[ChatMessage],
    limit: usize,
    max_tokens: usize,
    policy: ContextPolicy,
) -> Result<Fitted, ContextError> {
    fit_messages_cancellable(tok, messages, limit, max_tokens, policy, &|| false)
}

/// [`fit_messages`], asking `cancelled` before each render of the history
/// ([`ContextError::Cancelled`] when it says true).
pub fn fit_messages_cancellable(
    tok: &Tokenizer,
    messages: &[ChatMessage],
    limit: usize,
    max_tokens: usize,
    policy: ContextPolicy,
    cancelled: &dyn Fn() -> bool,
) -> Result<Fitted, ContextError> {
    fit_chat_cancellable(tok, messages, &[], limit, max_tokens, policy, cancelled)
}

/// [`fit_messages_cancellable`] with `tools` given to the chat template
/// ([`Tokenizer::encode_chat_with_tools`]): they are rendered with every
/// attempt and never dropped.
pub fn fit_chat_cancellable(
    tok: &Tokenizer,
    messages: &[ChatMessage],
    tools: &[serde_json::Value],
    limit: usize,
    max_tokens: usize,
    policy: ContextPolicy,
    cancelled: &dyn Fn() -> bool,
) -> Result<Fitted, ContextError> {
    let render = |m: &[ChatMessage]| {
        if cancelled() {
            return Err(ContextError::Cancelled);
        }
        tok.encode_chat_with_tools(m, tools, true)
            .map_err(|e| ContextError::Template(e.to_string()))
    };
    let prompt = render(messages)?;
    let too_long = |n: usize, hint: &'static str| ContextError::TooLong {
        prompt_tokens: n,
        limit,
        policy,
        hint,
    };
    match policy {
        ContextPolicy::Refuse => {
            if prompt.len() >= limit {
                return Err(too_long(
                    prompt.len(),
                    "; drop_oldest would drop the oldest turns instead",
                ));
            }
            Ok(Fitted {
                prompt,
                dropped_messages: 0,
            })
        }
        ContextPolicy::DropOldest => {
            let room = max_tokens.clamp(1, (limit / 4).max(1));
            let fits = |n: usize| n.saturating_add(room) <= limit;
            if fits(prompt.len()) {
                return Ok(Fitted {
                    prompt,
                    dropped_messages: 0,
                });
            }
            // The messages `drop_oldest(messages, d)` keeps.
            let system = leading_system(messages);
            let droppable = messages.len().saturating_sub(system + 1);
            let kept = |d: usize| -> Vec<ChatMessage> {
                let mut k = Vec::with_capacity(messages.len() - d);
                k.extend_from_slice(&messages[..system]);
                k.extend_from_slice(&messages[system + d..]);
                k
            };
            // The prompt with everything droppable dropped: if that does not
            // fit, nothing does.
            let last = render(&kept(droppable))?;
            if !fits(last.len()) {
                return Err(too_long(
                    last.len(),
                    "; even the system messages and the last message alone do not fit",
                ));
            }
            // Bisection for the fewest drops that fit: `lo` does not fit
            // (0 did not), `hi` fits, with its prompt.
            let (mut lo, mut hi, mut best) = (0usize, droppable, last);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                let p = render(&kept(mid))?;
                if fits(p.len()) {
                    hi = mid;
                    best = p;
                } else {
                    lo = mid;
                }
            }
            Ok(Fitted {
                prompt: best,
                dropped_messages: hi,
            })
        }
    }
}
