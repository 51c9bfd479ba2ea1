//! OpenAI's `logprobs` answer shapes from the runtime's per-token logprobs
//! (`tandem_edge::EdgeEvent::Token::logprobs`): chat's
//! `{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}` and
//! the legacy completions' `{tokens, token_logprobs, top_logprobs,
//! text_offset}`, whole or one streamed piece at a time.

use serde_json::{json, Map, Value};
use tandem_edge::TokenStatus;
use tandem_model::logprobs::TokenLogprobs;
use tandem_model::tokenizer::Tokenizer;

/// What OpenAI reports for an impossible token (JSON has no `-inf`).
const IMPOSSIBLE: f64 = -9999.0;

/// One token's logprobs, as they came with the tokens of a delta.
pub type TokenLps = Option<Box<TokenLogprobs>>;

/// A logprob as JSON: finite, `IMPOSSIBLE` for `-inf` or NaN.
fn logprob_value(lp: f32) -> f64 {
    if lp.is_finite() {
        f64::from(lp)
    } else {
        IMPOSSIBLE
    }
}

/// A token's bytes (its piece) and their text (lossy for a piece that is
/// part of a UTF-8 character).
fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tok.id_to_piece(id).unwrap_or_default().to_vec();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Which model's distribution a token's logprobs come from: the target's
/// for a verified token, the draft's for a provisional or local one (the
/// `tandem.logprobs_from` extension).
pub fn source(status: TokenStatus) -> &'static str {
    match status {
        TokenStatus::Verified => "target",
        TokenStatus::Provisional | TokenStatus::Local => "draft",
    }
}

/// Chat's `logprobs.content` entries of `ids` (each with its logprobs).
pub fn chat_content(tok: &Tokenizer, ids: &[u32], lps: &[TokenLps]) -> Vec<Value> {
    ids.iter()
        .zip(lps)
        .map(|(&id, lp)| {
            let (token, bytes) = token_text(tok, id);
            let top: Vec<Value> = lp
                .iter()
                .flat_map(|l| l.top.iter())
                .map(|&(t, v)| {
                    let (token, bytes) = token_text(tok, t);
                    json!({"token": token, "logprob": logprob_value(v), "bytes": bytes})
                })
                .collect();
            let logprob = lp.as_ref().map(|l| logprob_value(l.logprob));
            json!({"token": token, "logprob": logprob, "bytes": bytes, "top_logprobs": top})
        })
        .collect()
}

/// Chat's `logprobs` object of a whole answer or a streamed delta.
pub fn chat(tok: &Tokenizer, ids: &[u32], lps: &[TokenLps]) -> Value {
    json!({"content": chat_content(tok, ids, lps), "refusal": null})
}

/// A token as the legacy completions name it: its text, or, for a piece
/// that is not valid UTF-8 on its own (part of a character), OpenAI's
/// `bytes:\xNN...` form.
fn legacy_token(tok: &Tokenizer, id: u32) -> String {
    let bytes = tok.id_to_piece(id).unwrap_or_default();
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_string(),
        Err(_) => {
            let mut s = String::from("bytes:");
            for b in bytes {
                s.push_str(&format!("\\x{b:02x}"));
            }
            s
        }
    }
}

/// Characters of the text `bytes` decode to, up to the last complete one.
fn chars_before(bytes: &[u8]) -> usize {
    let valid = match std::str::from_utf8(bytes) {
        Ok(s) => s,
        Err(e) => std::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap_or_default(),
    };
    valid.chars().count()
}

/// The legacy completions' `logprobs` object of `ids`; `before` holds the
/// completion's bytes before them (extended by theirs): `text_offset` is the
/// characters of the completion text before each token's first byte.
pub fn completion(tok: &Tokenizer, ids: &[u32], lps: &[TokenLps], before: &mut Vec<u8>) -> Value {
    let (mut tokens, mut token_logprobs, mut top_logprobs, mut text_offset) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (&id, lp) in ids.iter().zip(lps) {
        text_offset.push(chars_before(before));
        before.extend_from_slice(tok.id_to_piece(id).unwrap_or_default());
        tokens.push(legacy_token(tok, id));
        token_logprobs.push(lp.as_ref().map(|l| logprob_value(l.logprob)));
        let mut top = Map::new();
        for &(t, v) in lp.iter().flat_map(|l| l.top.iter()) {
            top.insert(legacy_token(tok, t), json!(logprob_value(v)));
        }
        top_logprobs.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs,
           "top_logprobs": top_logprobs, "text_offset": text_offset})
}
