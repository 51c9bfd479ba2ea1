//! Cloud-streamed rounds (target-only streaming, `speculation.target_stream`):
//! the generation core's round (`tandem_model::engine::round`) with `k = 0`,
//! no proposal, against the verifier generating on its own
//! ([`WindowedVerifier`]): `Draft`s with k = 0 ask the verifier for its next
//! token, and `stream_window` of them are kept in flight so that the target
//! decodes back to back and the tokens stream to the device (the "cloud
//! generates and streams" baseline of `tandem lab`). The draft model only
//! catches up (runs over the streamed tokens) if the verifier becomes
//! unreachable and the device has to continue alone.
//!
//! Each streamed token is one round of the core: counted in
//! `GenStats::rounds` (nothing drafted) and in `proposers.none_rounds`, and
//! accounted by [`super::round::Rounds::commit`] like a plain round (RTT,
//! round number, verifier pass).

use super::connection::{block_verdict, draft_positions, Connection};
use super::generation::Generation;
use super::round::{Apply, RoundOutcome, Rounds};
use crate::client::NetError;
use crate::error::EdgeError;
use std::time::Duration;
use tandem_model::engine::{self, BlockVerdict, BlockVerifier, VerifyError};
use tandem_model::sampling::SamplingParams;
use tandem_model::speculative::StopReason;
use tandem_model::ModelError;
use tandem_proto::v1::{self as pb, client_message::Msg as ClientMsg};

/// The remote verifier generating on its own, as the core's
/// [`BlockVerifier`] for empty blocks: each verify tops the window of
/// requests in flight up (`Draft`s with no tokens, numbered from the
/// session's round on) and takes the oldest one's answer, the verifier's
/// next token. Like the plain rounds' verifier
/// ([`RemoteVerifier`](super::connection::RemoteVerifier)) it reports the outcome and changes
/// nothing of the generation: a verdict, a broken exchange
/// ([`VerifyError::Broken`]; the window is dropped, its answers will never
/// be read), or a refusal ([`VerifyError::Refused`]). A session that is not
/// there is a broken exchange (`NetError::Unavailable`, as
/// [`Connection::exchange`] reports it).
pub(super) struct WindowedVerifier<'c, 'a> {
    pub(super) conn: &'c mut Connection<'a>,
    pub(super) sampling: &'c SamplingParams,
    /// The generation asks for logprobs.
    pub(super) logprobs: bool,
    /// Most requests in flight (`speculation.stream_window`, at least 1).
    pub(super) window: usize,
    /// Tokens the generation may still take (its output and its context):
    /// no more requests than that are sent (at least one is).
    pub(super) room: usize,
    /// The last answer's round trip, from its request's send.
    pub(super) rtt: Option<Duration>,
}

impl WindowedVerifier<'_, '_> {
    /// The window dropped after a failure: its answers are never read.
    fn broken(&mut self, e: NetError) -> VerifyError<NetError, EdgeError> {
        self.conn.in_flight.clear();
        VerifyError::Broken(e)
    }
}

impl BlockVerifier for WindowedVerifier<'_, '_> {
    type Broken = NetError;
    type Refusal = EdgeError;

    fn verify(
        &mut self,
        ctx: &[u32],
        block: &[u32],
    ) -> Result<BlockVerdict, VerifyError<NetError, EdgeError>> {
        if !block.is_empty() {
            return Err(VerifyError::Model(ModelError::InvalidArgument(format!(
                "a streamed round proposes nothing, not {} tokens",
                block.len()
            ))));
        }
        let want = self.window.max(1).min(self.room.max(1));
        while self.conn.in_flight.len() < want {
            let conn = &mut *self.conn;
            let draft = pb::Draft {
                round: conn.round + conn.in_flight.len() as u64,
                ..pb::Draft::default()
            };
            let Some(s) = conn.stream.as_mut() else {
                return Err(self.broken(NetError::Unavailable("no session".into())));
            };
            let sent = conn
                .rt
                .block_on(s.send(ClientMsg::Draft(draft), &mut conn.counters));
            if let Err(e) = sent {
                return Err(self.broken(e));
            }
            conn.in_flight.push_back(std::time::Instant::now());
        }
        let conn = &mut *self.conn;
        let deadline = conn.deadline(draft_positions(0));
        let (Some(at), Some(s)) = (conn.in_flight.pop_front(), conn.stream.as_mut()) else {
            return Err(self.broken(NetError::Unavailable("no session".into())));
        };
        let answer = match conn
            .rt
            .block_on(s.next_answer(deadline, &mut conn.counters))
        {
            Ok(a) => a,
            Err(e) => return Err(self.broken(e)),
        };
        self.rtt = Some(at.elapsed());
        let v = conn
            .codec
            .decode(answer, conn.round, 0, ctx, self.sampling)
            .map_err(VerifyError::Refused)?;
        block_verdict(block, &v, self.logprobs).map_err(VerifyError::Refused)
    }
}

/// One streamed token: the core's round with k = 0 against the
/// [`WindowedVerifier`]; `None` when the stream failed (handled) or the
/// generation is at its end.
pub(super) fn round(
    r: &mut Rounds<'_>,
    run: &mut Generation<'_, '_>,
) -> Result<Option<RoundOutcome>, EdgeError> {
    let gen = run.gen;
    let room_out = gen.max_tokens.saturating_sub(run.out_len());
    let room = room_out.min(run.capacity.saturating_sub(run.ctx.len()));
    if room == 0 && r.conn.in_flight.is_empty() {
        run.stop.get_or_insert(if run.out_len() >= gen.max_tokens {
            StopReason::MaxTokens
        } else {
            StopReason::ContextFull
        });
        return Ok(None);
    }
    let mut verifier = WindowedVerifier {
        conn: &mut r.conn,
        sampling: &gen.sampling,
        logprobs: gen.top_logprobs.is_some(),
        window: r.spec.cfg.stream_window,
        room,
        rtt: None,
    };
    let (draft, mut sink) = run.core();
    let res = engine::round(
        draft.with(&mut r.spec.auto),
        0,
        room_out,
        &mut sink,
        &mut verifier,
    );
    let rtt = verifier.rtt;
    // (The core did not run the draft: it stays behind the context, and
    // `pending` is what it has not seen.)
    run.sync_pending();
    match res {
        Ok(_) => {}
        Err(VerifyError::Broken(e)) => {
            r.fail(run, e)?;
            return Ok(None);
        }
        Err(VerifyError::Refused(e)) => return Err(e),
        Err(VerifyError::Model(e)) => return Err(e.into()),
    }
    Ok(Some(RoundOutcome {
        k: 0,
        accepted: 0,
        rtt,
        positions: draft_positions(0),
        draft_ms: 0.0,
        reused: 0,
        apply: Apply::Core,
    }))
}
