//! Uncertainty-gated rounds (`[gate]`, [`crate::config::GateConfig`]; greedy
//! only).
//!
//! Each round drafts a block as usual and notes the draft's top-1 probability of
//! every token. When all of them reach `gate.confidence` (and the gated span
//! stays within `gate.max_span` and within one verify block with the next
//! block), the block is shown at once as **provisional** and nothing is sent.
//! The next block that is not gated goes out together with the waiting span, as
//! one `Draft` from the start of the span: the verifier (whose context still
//! ends where the span starts) checks span and block in one forward pass.
//!
//! - Verdict accepts the whole span: a `ProvisionalChecked` event with no
//!   mismatches, then the block's accepted drafts and the verifier's token as
//!   verified, exactly as in a plain round.
//! - Verdict stops inside the span: the shown token there differs from the
//!   target's. It stays shown (streamed text is final) and is reported as a
//!   mismatch; the block is dropped, the verifier's session is moved to the
//!   shown context (`Resume`), and the rest of the span is checked as after an
//!   outage. What follows is the target's greedy output given the shown text.
//!
//! A span still waiting when the generation ends is verified in one last pass
//! (`super::drive`). The trade-off (round trips saved against shown tokens
//! that turn out wrong) is measured in docs/lab.md, "Uncertainty-gated
//! verification".

use super::connection::{draft_positions, Step};
use super::generation::Generation;
use super::round::{ms, note_verdict_logprobs, Apply, RoundOutcome, Rounds};
use crate::error::EdgeError;
use crate::report::TokenStatus;
use std::time::Instant;
use tandem_model::proposer::Source;
use tandem_model::speculative::StopReason;
use tandem_proto::v1::{self as pb, client_message::Msg as ClientMsg};

/// One gated round; `None` when nothing is left to commit (the block was
/// shown gated, a span was checked, or the exchange failed).
pub(super) fn round(
    r: &mut Rounds<'_>,
    run: &mut Generation<'_, '_>,
) -> Result<Option<RoundOutcome>, EdgeError> {
    if run.check.is_none() {
        run.gated = false;
    } else if !run.gated {
        // A provisional span from an outage: checked on its own first.
        r.check_provisional(run)?;
        return Ok(None);
    }
    let room_out = run.gen.max_tokens.saturating_sub(run.out_len());
    // The gated span waiting for verification is out[p..].
    let p = match &run.check {
        Some(c) => c.next,
        None => run.out_len(),
    };
    let g = run.out_len() - p;
    let limit = r.limit(run, g);
    if limit == 0 {
        if g > 0 {
            r.check_provisional(run)?;
        } else {
            run.stop = Some(StopReason::ContextFull);
        }
        return Ok(None);
    }
    // Fixed k (adaptive k is not combined with gating: refused by the config).
    let k = r.block_len(run, limit);
    let ctx_before = run.ctx.len();
    let mut hist = run.ctx.clone();
    let mut block = Vec::with_capacity(k);
    let mut conf = 1.0f32;
    let t0 = Instant::now();
    for _ in 0..k {
        let d = run.draft_next(&hist)?;
        conf = conf.min(run.conf);
        hist.push(d);
        block.push(d);
    }
    let draft_ms = ms(t0.elapsed());
    let gate = &r.conn.cfg.gate;
    let gated = f64::from(conf) >= gate.confidence
        && g + k <= gate.max_span
        && g + 2 * k <= r.conn.max_block
        && room_out > k;
    if gated {
        Rounds::start_gated_span(run);
        run.stats.gated_rounds += 1;
        run.stats.gated_tokens += k as u64;
        // The draft holds ctx + block[..k-1] with pending = [block[k-1]]:
        // after these, ctx = its cache + pending again.
        for &x in &block {
            if !run.emit(x, TokenStatus::Provisional) {
                break;
            }
        }
        return Ok(None);
    }
    let mut tokens = run.out()[p..].to_vec();
    tokens.extend_from_slice(&block);
    let total = tokens.len();
    let round = r.conn.round;
    let msg = ClientMsg::Draft(pb::Draft {
        round,
        tokens: tokens.clone(),
        ..pb::Draft::default()
    });
    let (answer, rtt) = match r.conn.exchange(msg, draft_positions(total)) {
        Ok(a) => a,
        Err(e) => {
            r.lost_block(run, e)?;
            return Ok(None);
        }
    };
    let span_start = &run.ctx[..run.prompt_len + p];
    let v = r
        .conn
        .codec
        .decode(answer, round, total, span_start, &run.gen.sampling)?;
    let span_start = span_start.len();
    note_verdict_logprobs(run, span_start, &tokens, &v)?;
    let n = v.accepted as usize;
    let outcome = RoundOutcome {
        ctx_before,
        drafted: block,
        k,
        accepted: n.saturating_sub(g),
        next_token: v.next_token,
        rtt: Some(rtt),
        positions: draft_positions(total),
        draft_ms,
        reused: 0,
        source: Source::Draft,
        lookup_match: None,
        apply: if n >= g { Apply::Commit } else { Apply::Nobody },
    };
    if n < g {
        // The shown token out[p + n] is not the target's: report it, drop
        // the block, follow the shown text, check the rest of the span.
        r.commit(run, outcome);
        run.rollback_unverified();
        if let Some(c) = run.check.as_mut() {
            c.mismatches.push(p + n);
            c.next = p + n + 1;
        }
        if let Step::Lost = r.resume_shown(run, run.prompt_len + p + n + 1)? {
            return Ok(None);
        }
        r.check_provisional(run)?;
        return Ok(None);
    }
    if let Some(c) = run.check.take() {
        run.complete_check(c, true);
    }
    run.gated = false;
    Ok(Some(outcome))
}
