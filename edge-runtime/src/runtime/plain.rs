//! The plain round: propose a block of up to k (fixed, or the chooser's with
//! adaptive k) with the generation's proposer (the draft model, prompt lookup,
//! or `auto`'s choice; `tandem_model::proposer`), encode it with the session's codec, exchange it (or let the codec answer
//! on the device: an all-local split round) and decode the verdict.

use super::connection::draft_positions;
use super::generation::Generation;
use super::round::{note_verdict_logprobs, RoundOutcome, Rounds};
use crate::error::EdgeError;
use tandem_model::proposer::{plan_round, ProposerKind, Source};
use tandem_model::speculative::StopReason;
use tandem_proto::v1::{
    self as pb, client_message::Msg as ClientMsg, server_message::Msg as ServerMsg,
};

/// One plain round; `None` when it ended without a verdict (the failure is
/// handled) or the context is full.
pub(super) fn round(
    r: &mut Rounds<'_>,
    run: &mut Generation<'_, '_>,
) -> Result<Option<RoundOutcome>, EdgeError> {
    let limit = r.limit(run, 0);
    if limit == 0 {
        run.stop = Some(StopReason::ContextFull);
        return Ok(None);
    }
    let k_max = r.block_len(run, limit);
    let ctx_before = run.ctx.len();
    // What proposes the block (tandem_model::proposer, as in the local loop).
    if run.gen.proposer != ProposerKind::Draft {
        run.lookup.extend(&run.ctx);
    }
    let backlog = run.pending.len();
    let plan = plan_round(
        run.gen.proposer,
        &run.lookup,
        &run.ctx,
        k_max,
        run.gen.max_tokens.saturating_sub(run.out_len()),
        &r.spec.auto,
        || backlog,
    );
    let k = plan.len;
    let (block, draft_ms) = match plan.source {
        Source::Draft => {
            let mut block = Vec::with_capacity(k);
            let draft_ms = r.draft_block(run, &mut block, k)?;
            (block, draft_ms)
        }
        // The draft model does not run (it catches up when it is needed).
        // Under a grammar, cut at the first token it refuses.
        Source::Lookup => {
            let mut block = plan.lookup;
            let n = run.draft.allowed(&run.ctx, &block)?;
            block.truncate(n);
            (block, 0.0)
        }
        // No proposal: the verifier's next token (k = 0).
        Source::Nothing => (Vec::new(), 0.0),
    };
    let round = r.conn.round;
    let draft = pb::Draft {
        round,
        tokens: block.clone(),
        ..pb::Draft::default()
    };
    let draft = r.conn.codec.encode(&run.ctx, draft)?;
    let (answer, rtt) = match r.conn.codec.answer_locally(round, ctx_before) {
        Some(v) => (ServerMsg::Verdict(v), None),
        None => match r.conn.exchange(ClientMsg::Draft(draft), draft_positions(k)) {
            Ok((a, rtt)) => (a, Some(rtt)),
            Err(e) => {
                r.lost_block(run, e)?;
                return Ok(None);
            }
        },
    };
    let v = r
        .conn
        .codec
        .decode(answer, round, k, &run.ctx, &run.gen.sampling)?;
    if rtt.is_some() {
        // (A block the device answered itself, an all-local split round,
        // has no target logprobs.)
        note_verdict_logprobs(run, ctx_before, &block, &v)?;
    }
    let accepted = v.accepted as usize;
    let exchange_ms = rtt.map(|t| t.as_secs_f64() * 1e3);
    if r.conn.codec.accepted(ctx_before, accepted, exchange_ms, k) {
        // The codec changed its wire form (split `auto` chose another s): the
        // next round opens a new session.
        r.conn.close_for_reopen();
    }
    Ok(Some(RoundOutcome {
        ctx_before,
        drafted: block,
        k,
        accepted,
        next_token: v.next_token,
        rtt,
        positions: draft_positions(k),
        draft_ms,
        reused: 0,
        source: plan.source,
        lookup_match: plan.lookup_match,
        apply: true,
    }))
}
