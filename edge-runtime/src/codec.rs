//! How a verify block goes on the wire: [`BlockCodec`]. The round loop
//! (`crate::runtime`) drafts a block, asks the codec to encode it, exchanges
//! it (or lets the codec answer on the device) and asks the codec to decode
//! the verdict. [`TokenCodec`] sends token ids (the default); split execution
//! (`crate::device_layers::SplitExec`) sends the hidden states of the device's layers
//! and, with a pinned head, computes the verdict itself. The loop has no
//! split branches: what differs lives behind this trait.

use crate::error::EdgeError;
use crate::split_report::SplitReport;
use tandem_model::sampling::SamplingParams;
use tandem_proto::v1::{self as pb, server_message::Msg as ServerMsg};

/// The wire form of a session's opens, blocks and verdicts.
pub(crate) trait BlockCodec {
    /// The session carries token ids only (no device-side layer state): it can
    /// continue a kept session, be re-opened in the background over
    /// provisional tokens, have those checked, gate and pipeline blocks.
    fn tokens_only(&self) -> bool;

    /// The device's vocabulary: every token id the verifier sends is below it.
    fn vocab(&self) -> u32;

    /// Completes an Open of the context `ctx`.
    fn open(&mut self, ctx: &[u32], open: pb::Open) -> Result<pb::Open, EdgeError>;

    /// Checks the verifier's Opened.
    fn check_opened(&self, opened: &pb::Opened) -> Result<(), EdgeError>;

    /// Completes the Draft of a block drafted after the context `ctx`.
    fn encode(&mut self, ctx: &[u32], draft: pb::Draft) -> Result<pb::Draft, EdgeError>;

    /// The answer to the block just encoded when the device computes it alone
    /// (no exchange); `None`: exchange it.
    fn answer_locally(&mut self, round: u64, ctx_len: usize) -> Option<pb::Verdict>;

    /// The verdict of round `round` (a block of `k` drafted after `ctx`) from
    /// the answer.
    fn decode(
        &mut self,
        answer: ServerMsg,
        round: u64,
        k: usize,
        ctx: &[u32],
        sampling: &SamplingParams,
    ) -> Result<pb::Verdict, EdgeError>;

    /// After a verdict of `accepted` of `k` (drafted at context `ctx_before`;
    /// `exchange_ms`: None when answered locally). True when the codec
    /// changed its wire form and the session must be re-opened.
    fn accepted(
        &mut self,
        ctx_before: usize,
        accepted: usize,
        exchange_ms: Option<f64>,
        k: usize,
    ) -> bool;

    /// Undo a block whose verdict never came (the context has `ctx_len` tokens).
    fn rollback(&mut self, ctx_len: usize);

    /// What the generation reports about the codec (`EdgeStats::split`).
    fn report(&self) -> Option<SplitReport>;
}

/// Token ids up, verdicts down. `vocab`: the device's draft vocabulary;
/// every token the verifier sends must be below it.
pub(crate) struct TokenCodec {
    pub vocab: u32,
}

impl BlockCodec for TokenCodec {
    fn tokens_only(&self) -> bool {
        true
    }

    fn vocab(&self) -> u32 {
        self.vocab
    }

    fn open(&mut self, _ctx: &[u32], open: pb::Open) -> Result<pb::Open, EdgeError> {
        Ok(open)
    }

    fn check_opened(&self, opened: &pb::Opened) -> Result<(), EdgeError> {
        check_vocab(opened, self.vocab)
    }

    fn encode(&mut self, _ctx: &[u32], draft: pb::Draft) -> Result<pb::Draft, EdgeError> {
        Ok(draft)
    }

    fn answer_locally(&mut self, _round: u64, _ctx_len: usize) -> Option<pb::Verdict> {
        None
    }

    fn decode(
        &mut self,
        answer: ServerMsg,
        round: u64,
        k: usize,
        ctx: &[u32],
        _sampling: &SamplingParams,
    ) -> Result<pb::Verdict, EdgeError> {
        check_verdict(answer, round, k, ctx.len(), self.vocab)
    }

    fn accepted(&mut self, _: usize, _: usize, _: Option<f64>, _: usize) -> bool {
        false
    }

    fn rollback(&mut self, _ctx_len: usize) {}

    fn report(&self) -> Option<SplitReport> {
        None
    }
}

/// The Opened's vocabulary against the device's (`vocab`): the verifier's
/// target must speak the same token ids as the device's model, or its tokens
/// could not be drafted after.
pub(crate) fn check_vocab(opened: &pb::Opened, vocab: u32) -> Result<(), EdgeError> {
    if opened.vocab_size != vocab {
        return Err(EdgeError::Protocol(format!(
            "the verifier's target has a vocabulary of {} tokens; the device's model has {vocab}",
            opened.vocab_size
        )));
    }
    Ok(())
}

/// The verdict of round `round` for a block of `k` tokens drafted after a
/// context of `ctx_before` tokens, checked against what was asked: the round,
/// `accepted <= k`, `context_len = ctx_before + accepted + 1`,
/// `next_token < vocab`, and no hidden states (those come only in U-shape
/// split sessions, which check their verdicts in `crate::split`).
pub(crate) fn check_verdict(
    answer: ServerMsg,
    round: u64,
    k: usize,
    ctx_before: usize,
    vocab: u32,
) -> Result<pb::Verdict, EdgeError> {
    let ServerMsg::Verdict(v) = answer else {
        return Err(EdgeError::Protocol("expected a Verdict".into()));
    };
    let n = v.accepted as usize;
    let fits = n <= k
        && ctx_before
            .checked_add(n)
            .and_then(|c| c.checked_add(1))
            .is_some_and(|c| v.context_len == c as u64);
    if v.round != round || !fits {
        return Err(EdgeError::Protocol(format!(
            "verdict (round {}, accepted {n}, context {}) does not fit round {round} with k = {k} at context {ctx_before}",
            v.round, v.context_len
        )));
    }
    if v.next_token >= vocab {
        return Err(EdgeError::Protocol(format!(
            "verdict next_token {} is outside the vocabulary (0..{vocab})",
            v.next_token
        )));
    }
    if v.hidden.is_some() {
        return Err(EdgeError::Protocol(
            "verdict carries hidden states outside a U-shape split session".into(),
        ));
    }
    Ok(v)
}
