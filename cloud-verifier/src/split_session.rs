//! Split sessions: the device runs the embedding and target layers `[0, s)` and
//! sends hidden states; this verifier runs layers `[s, N)` and either the head and
//! the verdict (head here) or nothing more (U-shape: it returns the final hidden
//! states and the device decides). The wire rules are in the `.proto` file comment.
//!
//! The verifier still maps the whole target GGUF (weights of layers `[0, s)` are
//! mapped but never touched, so they cost address space, not RSS), and a split
//! session's KV pages hold all N layers with only `[s, N)` written. A split
//! session's prefill is chunked like any prefill: its hidden rows join the
//! scheduler's shared forward at layer s, a chunk per iteration, beside other
//! sessions' verify rows (so a long split Open does not stall them). A split
//! round (at most `max_block + 1` rows, possibly with its own head or hidden
//! output) runs alone.

use crate::error::Refusal;
use crate::session::{SessionState, SplitSpec};
use tandem_model::transformer::Model;
use tandem_model::verify::Verdict;
use tandem_proto::hidden;
use tandem_proto::v1::{HiddenFormat, HiddenStates, Reason};

fn bad(m: impl Into<String>) -> Refusal {
    Refusal::new(Reason::BadRequest, m)
}

fn internal(e: tandem_model::ModelError) -> Refusal {
    Refusal::new(Reason::InternalError, e.to_string())
}

fn decode(
    model: &Model,
    h: Option<&HiddenStates>,
    rows: usize,
    format: HiddenFormat,
) -> Result<Vec<f32>, Refusal> {
    let empty = HiddenStates::default();
    hidden::decode(h.unwrap_or(&empty), rows, model.config().d_model, format)
        .map_err(|e| bad(format!("hidden: {e}")))
}

/// Runs layers `[s, N)` over `h` at `start_pos` (nothing when s = N).
fn run_suffix(
    model: &Model,
    spec: &SplitSpec,
    st: &mut SessionState,
    h: &mut [f32],
    start_pos: usize,
) -> Result<(), Refusal> {
    let n_layer = model.config().n_layer;
    if spec.layer < n_layer && !h.is_empty() {
        model
            .forward_layers(spec.layer..n_layer, h, start_pos, &mut st.kv)
            .map_err(internal)?;
    }
    Ok(())
}

/// The context of a new split session from an Open (checked, no model work):
/// `prompt_tokens` must already be checked (head-here sessions) or empty
/// (U-shape). `max_context` bounds the context length.
pub fn open_context(
    spec: SplitSpec,
    prompt_tokens: Vec<u32>,
    prompt_hidden: Option<&HiddenStates>,
    max_context: usize,
) -> Result<Vec<u32>, Refusal> {
    let rows = prompt_hidden.map_or(0, |h| h.rows as usize);
    if spec.pin_head {
        if !prompt_tokens.is_empty() {
            return Err(bad(
                "U-shape split sessions send no token ids: prompt_tokens must be empty",
            ));
        }
        if rows >= max_context {
            return Err(Refusal::new(
                Reason::PromptTooLong,
                format!(
                    "context of {} tokens exceeds max_prompt_tokens = {max_context}",
                    rows.saturating_add(1)
                ),
            ));
        }
        Ok(vec![0; rows + 1])
    } else {
        if rows.checked_add(1) != Some(prompt_tokens.len()) {
            return Err(bad(format!(
                "prompt_hidden has {rows} rows; a context of {} tokens needs {}",
                prompt_tokens.len(),
                prompt_tokens.len().saturating_sub(1)
            )));
        }
        Ok(prompt_tokens)
    }
}

/// A new split session's prefill rows: the prompt's hidden states, checked
/// (`context_len - 1` rows in the session's format) and decoded to f32, for
/// the scheduler to run layers `[s, N)` over in chunks beside other sessions'
/// rows (`crate::scheduler::Work::SplitPrefill`; nothing runs at s = N).
pub fn prefill_hidden(
    model: &Model,
    spec: SplitSpec,
    context_len: usize,
    prompt_hidden: Option<&HiddenStates>,
) -> Result<Vec<f32>, Refusal> {
    let rows = context_len.saturating_sub(1);
    decode(model, prompt_hidden, rows, spec.format)
}

/// What a split round answers.
#[derive(Debug)]
pub enum SplitAnswer {
    /// Head here: the usual verdict.
    Verdict(Verdict),
    /// U-shape: final hidden states of the block's rows; the device decides.
    Hidden(HiddenStates),
}

/// One split verify round. `draft` is the Draft's tokens (already checked
/// against the vocabulary), `hidden` its rows.
///
/// Logs the round's compute here (decode, layers `[s, N)`, head + verdict or
/// encode) at debug level on target `tandem_verifier::split`, so the cost
/// model's server term can be checked against the server's own clock
/// (`scripts/split_table.sh` reads it).
pub fn split_round(
    model: &Model,
    st: &mut SessionState,
    draft: &[u32],
    hidden: Option<&HiddenStates>,
    start_pos: usize,
) -> Result<SplitAnswer, Refusal> {
    let t = std::time::Instant::now();
    let r = split_round_inner(model, st, draft, hidden, start_pos);
    if let (Ok(_), Some(spec)) = (&r, st.split) {
        tracing::debug!(
            target: "tandem_verifier::split",
            layer = spec.layer,
            pin_head = spec.pin_head,
            rows = hidden.map_or(0, |h| h.rows),
            server_ms = t.elapsed().as_secs_f64() * 1e3,
            "split round computed"
        );
    }
    r
}

fn split_round_inner(
    model: &Model,
    st: &mut SessionState,
    draft: &[u32],
    hidden: Option<&HiddenStates>,
    start_pos: usize,
) -> Result<SplitAnswer, Refusal> {
    let Some(spec) = st.split else {
        return Err(Refusal::new(Reason::InternalError, "not a split session"));
    };
    let cached = st.context.len().saturating_sub(1);
    let full = |n: usize| {
        Refusal::new(
            Reason::ContextFull,
            format!(
                "context of {n} positions would exceed the KV capacity of {} tokens",
                st.kv.reserved_tokens()
            ),
        )
    };
    if spec.pin_head {
        if !draft.is_empty() {
            return Err(bad(
                "U-shape split sessions send no token ids: tokens must be empty",
            ));
        }
        let rows = hidden.map_or(0, |h| h.rows as usize);
        if rows == 0 {
            return Err(bad("a U-shape Draft needs at least one hidden row"));
        }
        // At s = N no KV is held here: an all-local device skips rounds, so any
        // start_pos is consistent.
        if start_pos > cached && spec.layer < model.config().n_layer {
            return Err(bad(format!(
                "start_pos {start_pos} is beyond the {cached} positions this session holds"
            )));
        }
        let end = start_pos
            .checked_add(rows)
            .ok_or_else(|| bad("start_pos overflows"))?;
        // At s = N nothing runs here (no KV); the context is still bounded.
        let held_here = spec.layer < model.config().n_layer;
        if (held_here && end > st.kv.reserved_tokens()) || end > st.kv.max_tokens() {
            return Err(full(end));
        }
        let mut h = decode(model, hidden, rows, spec.format)?;
        st.kv.truncate(start_pos);
        run_suffix(model, &spec, st, &mut h, start_pos)?;
        st.context.resize(start_pos + rows + 1, 0);
        return Ok(SplitAnswer::Hidden(hidden::encode(&h, rows, spec.format)));
    }
    let k = draft.len();
    if start_pos != cached {
        return Err(bad(format!(
            "start_pos {start_pos} differs from the {cached} positions this session holds"
        )));
    }
    if cached + k + 1 > st.kv.reserved_tokens() {
        return Err(full(cached + k + 1));
    }
    let mut h = decode(model, hidden, k + 1, spec.format)?;
    run_suffix(model, &spec, st, &mut h, cached)?;
    let logits = model.head(&h);
    st.verify_block(cached, draft, &logits)
        .map(SplitAnswer::Verdict)
}
