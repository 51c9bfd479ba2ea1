//! `Open`: a new session (prefilled through the scheduler, its pages reserved
//! first), a resumed one (`resume_session_id`: the KV the verifier still
//! holds is reused), the next turn of a conversation (`continuation`: a kept
//! session continued with only the new tokens, once its prefix is proven), or
//! a split session.

use super::resume::resync;
use super::{prefilled, settle, wire_u64, Bound};
use crate::error::Refusal;
use crate::metrics::ContinuationOutcome;
use crate::scheduler::Work;
use crate::session::{SessionState, SplitSpec};
use crate::split_session;
use crate::state::{store_refusal, VerifierState};
use crate::store::{CheckedOut, StoreError};
use std::sync::Arc;
use tandem_model::logprobs::MAX_TOP_LOGPROBS;
use tandem_model::penalties::{LogitBias, MAX_LOGIT_BIAS};
use tandem_model::sampling::SamplingParams;
use tandem_proto::v1::{Continuation, Open, Opened, Reason};

/// The session's sampling from its wire form: zero values read as their
/// defaults, every value range-checked (BAD_REQUEST), logit-bias tokens below
/// the target's `vocab` (TOKEN_OUT_OF_VOCAB).
fn sampling_from_wire(
    p: Option<tandem_proto::v1::SamplingParams>,
    vocab: usize,
) -> Result<SamplingParams, Refusal> {
    let p = p.unwrap_or_default();
    let bad =
        |e: tandem_model::ModelError| Refusal::new(Reason::BadRequest, format!("sampling: {e}"));
    if p.logit_bias.len() > MAX_LOGIT_BIAS {
        return Err(Refusal::new(
            Reason::BadRequest,
            format!(
                "sampling: logit_bias has {} entries, at most {MAX_LOGIT_BIAS}",
                p.logit_bias.len()
            ),
        ));
    }
    let logit_bias = LogitBias::new(p.logit_bias.iter().map(|b| (b.token, b.bias))).map_err(bad)?;
    if let Some(t) = logit_bias.max_token().filter(|&t| t as usize >= vocab) {
        return Err(Refusal::new(
            Reason::TokenOutOfVocab,
            format!("sampling: logit_bias names token {t}; the vocabulary has {vocab}"),
        ));
    }
    let s = SamplingParams {
        temperature: p.temperature,
        top_k: usize::try_from(p.top_k).unwrap_or(usize::MAX),
        top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
        repetition_penalty: if p.repetition_penalty == 0.0 {
            1.0
        } else {
            p.repetition_penalty
        },
        seed: p.seed,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        logit_bias,
        completion_start: usize::try_from(p.completion_start).unwrap_or(usize::MAX),
    };
    s.validate().map_err(bad)?;
    Ok(s)
}

/// What an Open asks of its session's verdicts: the sampling, the logprobs
/// (`Open.top_logprobs`) and the grammar (`Open.grammar`, compiled once the
/// context is known: [`compile_grammar`]).
struct Asked {
    sampling: SamplingParams,
    top_logprobs: Option<usize>,
    grammar: Option<tandem_proto::v1::Grammar>,
    /// `grammar` compiled for the session's context ([`grammar_for`]).
    constraint: Option<tandem_grammar::Guide>,
}

/// `Open.grammar`: split sessions with the head here mask their verdicts
/// like any other; U-shape sessions (`pin_head`) are refused: the device
/// makes their verdicts, under its own constraint.
fn grammar_from_wire(o: &Open) -> Result<Option<tandem_proto::v1::Grammar>, Refusal> {
    match &o.grammar {
        Some(_) if o.split.as_ref().is_some_and(|s| s.pin_head) => Err(Refusal::new(
            Reason::BadRequest,
            "grammar: a U-shape split session (pin_head) makes no verdicts here: \
             the device applies the grammar to its own",
        )),
        g => Ok(g.clone()),
    }
}

/// Compiles the grammar `g` for a session of context `ctx` and replays the
/// output already in it (`ctx[output_start..]`). Everything here is checked
/// before the session does any work: a refusal leaves nothing behind.
async fn compile_grammar(
    s: &VerifierState,
    g: &tandem_proto::v1::Grammar,
    ctx: &[u32],
) -> Result<tandem_grammar::Guide, Refusal> {
    let bad = |m: String| Refusal::new(Reason::BadRequest, format!("grammar: {m}"));
    let start = usize::try_from(g.output_start)
        .ok()
        .filter(|&n| n <= ctx.len())
        .ok_or_else(|| {
            bad(format!(
                "output_start {} is past the context's {} tokens",
                g.output_start,
                ctx.len()
            ))
        })?;
    let spec =
        tandem_grammar::GrammarSpec::from_wire(&g.kind, &g.text).map_err(|e| bad(e.to_string()))?;
    let vocab = s.grammar_vocab().await?;
    let mut c = tandem_grammar::Guide::new(&vocab, &spec, start).map_err(|e| bad(e.to_string()))?;
    c.sync(ctx).map_err(|e| match e {
        tandem_grammar::GrammarError::RefusedAt { index, token } => bad(format!(
            "output token {index} (context position {}): token {token} is not allowed by the grammar here",
            start + index
        )),
        e => bad(e.to_string()),
    })?;
    Ok(c)
}

/// [`compile_grammar`] when the Open asks for one.
async fn grammar_for(
    s: &VerifierState,
    asked: &Asked,
    ctx: &[u32],
) -> Result<Option<tandem_grammar::Guide>, Refusal> {
    match &asked.grammar {
        Some(g) => compile_grammar(s, g, ctx).await.map(Some),
        None => Ok(None),
    }
}

/// `Open.top_logprobs`: absent is none; else at most
/// [`MAX_TOP_LOGPROBS`] alternatives (BAD_REQUEST beyond). Split sessions
/// with the head here get them like any other (the verdict's rows are the
/// head's logits); U-shape sessions (`pin_head`) are refused: the device
/// runs the head and decides, so it computes its own logprobs and sends
/// none.
fn top_logprobs_from_wire(o: &Open) -> Result<Option<usize>, Refusal> {
    match o.top_logprobs {
        None => Ok(None),
        Some(_) if o.split.as_ref().is_some_and(|s| s.pin_head) => Err(Refusal::new(
            Reason::BadRequest,
            "top_logprobs: a U-shape split session (pin_head) makes no verdicts here: \
             the device computes the logprobs from its own head",
        )),
        Some(n) if n as usize <= MAX_TOP_LOGPROBS => Ok(Some(n as usize)),
        Some(n) => Err(Refusal::new(
            Reason::BadRequest,
            format!("top_logprobs: at most {MAX_TOP_LOGPROBS} alternatives, got {n}"),
        )),
    }
}

fn new_session_id() -> Arc<str> {
    Arc::from(format!("{:032x}", rand::random::<u128>()))
}

fn opened(s: &VerifierState, id: &str, resumed: bool, context_len: usize, reused: usize) -> Opened {
    let cfg = s.model.config();
    Opened {
        session_id: id.to_owned(),
        resumed,
        model_id: s.model_id.clone(),
        vocab_size: u32::try_from(cfg.vocab).unwrap_or(u32::MAX),
        max_block: u32::try_from(s.limits.max_block).unwrap_or(u32::MAX),
        max_prompt_tokens: u32::try_from(s.limits.max_prompt_tokens).unwrap_or(u32::MAX),
        context_len: wire_u64(context_len),
        n_layer: u32::try_from(cfg.n_layer).unwrap_or(u32::MAX),
        d_model: u32::try_from(cfg.d_model).unwrap_or(u32::MAX),
        reused_tokens: wire_u64(reused),
        features: vec![
            tandem_proto::FEATURE_PENALTIES.to_owned(),
            tandem_proto::FEATURE_LOGPROBS.to_owned(),
            tandem_proto::FEATURE_GRAMMAR.to_owned(),
        ],
    }
}

/// Answers an Open; Opens with a continuation are counted by outcome.
pub async fn open(s: &VerifierState, who: &Arc<str>, o: Open) -> Result<(Bound, Opened), Refusal> {
    let continuing = o.continuation.is_some();
    let r = open_checked(s, who, o).await;
    if continuing {
        s.metrics.continuation(match &r {
            Ok(_) => ContinuationOutcome::Continued,
            Err(e) if e.reason == Reason::ContextNotHeld => ContinuationOutcome::NotHeld,
            Err(_) => ContinuationOutcome::Refused,
        });
    }
    r
}

async fn open_checked(
    s: &VerifierState,
    who: &Arc<str>,
    mut o: Open,
) -> Result<(Bound, Opened), Refusal> {
    if o.model_id != s.model_id {
        return Err(Refusal::new(
            Reason::ModelMismatch,
            format!(
                "this verifier serves {:?}, not {:?}",
                s.model_id, o.model_id
            ),
        ));
    }
    if o.tokenizer_fingerprint != s.fingerprint {
        return Err(Refusal::new(
            Reason::FingerprintMismatch,
            "the device's tokenizer fingerprint differs from the target's",
        ));
    }
    if let Some(c) = o.continuation.take() {
        if o.split.is_some() {
            return Err(Refusal::new(
                Reason::BadRequest,
                "a continuation is not for split sessions: open with the whole context's hidden states",
            ));
        }
        let asked = Asked {
            sampling: sampling_from_wire(o.sampling.take(), s.model.config().vocab)?,
            top_logprobs: top_logprobs_from_wire(&o)?,
            grammar: grammar_from_wire(&o)?,
            constraint: None,
        };
        return open_continued(s, who, c, o.prompt_tokens, asked, o.first_round).await;
    }
    let split = o
        .split
        .as_ref()
        .map(|w| SplitSpec::from_wire(w, s.model.config().n_layer))
        .transpose()?;
    if !split.is_some_and(|sp| sp.pin_head) {
        // (U-shape sessions send no token ids; their length is in prompt_hidden.)
        s.check_context(&o.prompt_tokens)?;
    }
    let asked = Asked {
        sampling: sampling_from_wire(o.sampling.take(), s.model.config().vocab)?,
        top_logprobs: top_logprobs_from_wire(&o)?,
        grammar: grammar_from_wire(&o)?,
        constraint: None,
    };
    if let Some(spec) = split {
        return open_split(s, who, o, spec, asked).await;
    }
    let ctx = o.prompt_tokens;
    let mut asked = asked;
    asked.constraint = grammar_for(s, &asked, &ctx).await?;
    if let Some(rid) = &o.resume_session_id {
        let rid: Arc<str> = Arc::from(rid.as_str());
        match CheckedOut::take_over(&s.store, &rid, who) {
            Ok(g) if g.split.is_none() => {
                let epoch = g.epoch();
                let (lent, st) = g.lend();
                let (st, res) = resync(s, who, &rid, st, &ctx).await;
                let (mut g, reused) = settle(lent, st, res)?;
                g.sampling = asked.sampling;
                g.top_logprobs = asked.top_logprobs;
                g.grammar = asked.constraint.take();
                g.next_round = o.first_round;
                drop(g); // checked in
                tracing::info!(session = %rid, reused, "session resumed");
                let b = Bound {
                    id: rid.clone(),
                    epoch,
                };
                return Ok((b, opened(s, &rid, true, ctx.len(), reused)));
            }
            // A split session is not continued by a plain Open: it is checked
            // back in (the guard dropped) and a new one is made.
            Ok(_split) => {}
            Err(StoreError::Forbidden) => return Err(store_refusal(StoreError::Forbidden)),
            Err(_) => {} // lost or busy: recompute under a new id
        }
    }
    // (check_context: at least one token.)
    let tokens = ctx[..ctx.len() - 1].to_vec();
    open_new(
        s,
        who,
        ctx,
        asked,
        o.first_round,
        None,
        Work::Prefill { tokens },
    )
    .await
}

/// The next turn of a conversation: continues the kept session `c.session_id`
/// with the context `held[..c.prefix_len] ++ new` once the digest proves the
/// verifier holds that prefix. Anything it cannot prove (unknown, evicted,
/// busy or split session, a prefix length or digest that differs) is
/// `CONTEXT_NOT_HELD` and leaves the session as it was; the device then opens
/// with the whole context.
async fn open_continued(
    s: &VerifierState,
    who: &Arc<str>,
    c: Continuation,
    new: Vec<u32>,
    asked: Asked,
    first_round: u64,
) -> Result<(Bound, Opened), Refusal> {
    if new.is_empty() {
        return Err(Refusal::new(
            Reason::BadRequest,
            "a continuation sends at least one token after the prefix (the device's last)",
        ));
    }
    let not_held = |why: String| Refusal::new(Reason::ContextNotHeld, why);
    let sid: Arc<str> = Arc::from(c.session_id.as_str());
    // Every refusal below drops the guard: the session goes back as it was.
    let g = match CheckedOut::take_over(&s.store, &sid, who) {
        Ok(g) => g,
        Err(StoreError::Forbidden) => return Err(store_refusal(StoreError::Forbidden)),
        Err(e) => {
            return Err(not_held(format!(
                "the session to continue is not held ({e}): open with the whole context"
            )))
        }
    };
    if g.split.is_some() {
        return Err(not_held(
            "split sessions are not continued: open with the whole context".into(),
        ));
    }
    let held = g.context.len();
    let Some(prefix) = usize::try_from(c.prefix_len)
        .ok()
        .filter(|n| (1..=held).contains(n))
    else {
        return Err(not_held(format!(
            "prefix_len = {} but the session holds a context of {held} tokens \
             (1 <= prefix_len <= {held}): open with the whole context",
            c.prefix_len
        )));
    };
    // (Not a secret: a plain comparison of all 32 bytes; any other length differs.)
    let digest = tandem_proto::context_digest(&g.context[..prefix]);
    if c.prefix_sha256.as_slice() != digest.as_slice() {
        let why = if c.prefix_sha256.len() == digest.len() {
            format!("the digest of the first {prefix} context tokens differs from the one held")
        } else {
            format!("prefix_sha256 has {} bytes, not 32", c.prefix_sha256.len())
        };
        return Err(not_held(format!("{why}: open with the whole context")));
    }
    let mut ctx = Vec::with_capacity(prefix.saturating_add(new.len()));
    ctx.extend_from_slice(&g.context[..prefix]);
    ctx.extend_from_slice(&new);
    s.check_context(&ctx)?;
    let mut asked = asked;
    asked.constraint = grammar_for(s, &asked, &ctx).await?;
    let epoch = g.epoch();
    let (lent, st) = g.lend();
    let (st, res) = resync(s, who, &sid, st, &ctx).await;
    let (mut g, reused) = settle(lent, st, res)?;
    // A new turn is a new generation with its own sampling (a seeded token is
    // keyed by its position, as in a fresh session of the whole context).
    g.sampling = asked.sampling;
    g.top_logprobs = asked.top_logprobs;
    g.grammar = asked.constraint;
    g.next_round = first_round;
    drop(g); // checked in
    tracing::info!(session = %sid, reused, context_len = ctx.len(), "session continued");
    let o = opened(s, &sid, true, ctx.len(), reused);
    Ok((Bound { id: sid, epoch }, o))
}

/// A new session of `context`: admits its prefill, reserves its pages, runs
/// `prefill` on the scheduler, puts it into the store and answers `Opened`.
async fn open_new(
    s: &VerifierState,
    who: &Arc<str>,
    context: Vec<u32>,
    asked: Asked,
    first_round: u64,
    split: Option<SplitSpec>,
    prefill: Work,
) -> Result<(Bound, Opened), Refusal> {
    let id = new_session_id();
    let mut kv = s.new_kv();
    let context_len = context.len();
    let mut permit = s
        .admission
        .prefill(who, context_len.saturating_sub(1))
        .await?;
    let reserved = s.reserve_open(&mut kv, s.room_for(context_len), who)?;
    let mut st = SessionState::new(kv, context, asked.sampling, first_round);
    st.top_logprobs = asked.top_logprobs;
    st.grammar = asked.constraint;
    st.split = split;
    let (st, out) = s.run(who, &id, st, prefill).await;
    permit.spent();
    drop(permit);
    let st = prefilled(st, out)?;
    let epoch = s
        .store()
        .insert(id.to_string(), who.to_string(), st)
        .map_err(store_refusal);
    // Stored (counted there now) or refused (its pages went back).
    drop(reserved);
    let epoch = epoch?;
    s.metrics.session_opened();
    let layer = split.map(|sp| sp.layer);
    tracing::info!(session = %id, context_len, split = ?layer, "session opened");
    let o = opened(s, &id, false, context_len, 0);
    Ok((Bound { id, epoch }, o))
}

/// Opens a split session (always a fresh one: the device re-sends the hidden
/// states of its whole context, so a resume id is ignored).
async fn open_split(
    s: &VerifierState,
    who: &Arc<str>,
    o: Open,
    spec: SplitSpec,
    asked: Asked,
) -> Result<(Bound, Opened), Refusal> {
    let context = split_session::open_context(
        spec,
        o.prompt_tokens,
        o.prompt_hidden.as_ref(),
        s.limits.max_prompt_tokens,
    )?;
    let hidden =
        split_session::prefill_hidden(&s.model, spec, context.len(), o.prompt_hidden.as_ref())?;
    let prefill = Work::SplitPrefill {
        layer: spec.layer,
        hidden,
    };
    // (Head here: the context is token ids, which the grammar replays.)
    let mut asked = asked;
    asked.constraint = grammar_for(s, &asked, &context).await?;
    open_new(s, who, context, asked, o.first_round, Some(spec), prefill).await
}
