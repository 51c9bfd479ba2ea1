//! Cloud-streamed rounds (target-only streaming, `speculation.target_stream`):
//! `Draft`s with k = 0 ask the verifier for its next token; `stream_window` of
//! them are kept in flight so that the target decodes back to back and the
//! tokens stream to the device (the "cloud generates and streams" baseline of
//! `tandem lab`). The draft model only catches up (runs over the streamed
//! tokens) if the verifier becomes unreachable and the device has to continue
//! alone. Each answer is one round ([`super::round::Rounds::commit`]).

use super::connection::draft_positions;
use super::generation::Generation;
use super::round::{note_verdict_logprobs, Apply, RoundOutcome, Rounds};
use crate::error::EdgeError;
use tandem_model::proposer::Source;
use tandem_model::speculative::StopReason;
use tandem_proto::v1::{self as pb, client_message::Msg as ClientMsg};

/// Tops the window of requests up and takes the next answer; `None` when the
/// stream failed (handled) or the generation is at its end.
pub(super) fn round(
    r: &mut Rounds<'_>,
    run: &mut Generation<'_, '_>,
) -> Result<Option<RoundOutcome>, EdgeError> {
    let window = r.spec.cfg.stream_window.max(1);
    let room = run
        .gen
        .max_tokens
        .saturating_sub(run.out_len())
        .min(run.capacity.saturating_sub(run.ctx.len()));
    while r.conn.in_flight.len() < window && r.conn.in_flight.len() < room {
        let draft = pb::Draft {
            round: r.conn.round + r.conn.in_flight.len() as u64,
            ..pb::Draft::default()
        };
        let Some(s) = r.conn.stream.as_mut() else {
            return Ok(None);
        };
        let res = r
            .conn
            .rt
            .block_on(s.send(ClientMsg::Draft(draft), &mut r.conn.counters));
        if let Err(e) = res {
            r.conn.in_flight.clear();
            r.fail(run, e)?;
            return Ok(None);
        }
        r.conn.in_flight.push_back(std::time::Instant::now());
    }
    let Some(at) = r.conn.in_flight.pop_front() else {
        run.stop
            .get_or_insert(if run.out_len() >= run.gen.max_tokens {
                StopReason::MaxTokens
            } else {
                StopReason::ContextFull
            });
        return Ok(None);
    };
    let deadline = r.conn.deadline(draft_positions(0));
    let Some(s) = r.conn.stream.as_mut() else {
        return Ok(None);
    };
    let answer = match r
        .conn
        .rt
        .block_on(s.next_answer(deadline, &mut r.conn.counters))
    {
        Ok(a) => a,
        Err(e) => {
            r.conn.in_flight.clear();
            r.fail(run, e)?;
            return Ok(None);
        }
    };
    let rtt = at.elapsed();
    let round = r.conn.round;
    let v = r
        .conn
        .codec
        .decode(answer, round, 0, &run.ctx, &run.gen.sampling)?;
    note_verdict_logprobs(run, run.ctx.len(), &[], &v)?;
    Ok(Some(RoundOutcome {
        ctx_before: run.ctx.len(),
        drafted: Vec::new(),
        k: 0,
        accepted: 0,
        next_token: v.next_token,
        rtt: Some(rtt),
        positions: draft_positions(0),
        draft_ms: 0.0,
        reused: 0,
        source: Source::Nothing,
        lookup_match: None,
        apply: Apply::Commit,
    }))
}
