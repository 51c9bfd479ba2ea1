//! `POST /tokenize` and `POST /detokenize` in llama.cpp's server shapes, with
//! the served (draft) model's tokenizer, which is the target's:
//!
//! * `/tokenize` `{"content": string, "add_special": bool = false,
//!   "parse_special": bool = true, "with_pieces": bool = false}` →
//!   `{"tokens": [id, …]}`, or with `with_pieces` `{"tokens": [{"id", "piece"}, …]}`
//!   (`piece` a string, or its bytes as an array of numbers when they are not
//!   UTF-8 on their own);
//! * `/detokenize` `{"tokens": [id, …]}` → `{"content": string}` (special
//!   tokens rendered as their text); an id outside the vocabulary is a 400
//!   naming `tokens[i]`.
//!
//! Other fields are ignored. The handlers (in the parent) run these off
//! the async threads.

use serde_json::{json, Map, Value};
use tandem_model::tokenizer::Tokenizer;

use super::error::ApiError;

/// The body as a JSON object, or the 400 saying why not.
fn object_of(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::invalid(
            "the request body must be a JSON object",
            None,
        )),
        Err(e) => Err(ApiError::invalid(
            format!("We could not parse the JSON body of your request: {e}"),
            None,
        )),
    }
}

/// A boolean field, `default` when absent or null.
fn flag(o: &Map<String, Value>, k: &str, default: bool) -> Result<bool, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(
            format!("`{k}` must be a boolean"),
            Some(k),
        )),
    }
}

/// The `/tokenize` answer for `body`.
pub(super) fn tokenize_body(tok: &Tokenizer, body: &[u8]) -> Result<Value, ApiError> {
    let o = object_of(body)?;
    let content = match o.get("content") {
        Some(Value::String(s)) => s,
        _ => {
            return Err(ApiError::invalid(
                "`content` must be a string",
                Some("content"),
            ))
        }
    };
    let add_special = flag(&o, "add_special", false)?;
    let parse_special = flag(&o, "parse_special", true)?;
    let with_pieces = flag(&o, "with_pieces", false)?;
    let mut ids = Vec::new();
    if let (true, true, Some(bos)) = (add_special, tok.add_bos(), tok.bos_id()) {
        ids.push(bos);
    }
    ids.extend(
        tok.encode(content, parse_special)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("content")))?,
    );
    let tokens: Vec<Value> = if with_pieces {
        ids.iter()
            .map(|&id| {
                let bytes = tok.id_to_piece(id).unwrap_or_default();
                let piece = match std::str::from_utf8(bytes) {
                    Ok(s) => json!(s),
                    Err(_) => json!(bytes),
                };
                json!({"id": id, "piece": piece})
            })
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(json!({ "tokens": tokens }))
}

/// The `/detokenize` answer for `body`.
pub(super) fn detokenize_body(tok: &Tokenizer, body: &[u8]) -> Result<Value, ApiError> {
    let o = object_of(body)?;
    let Some(Value::Array(arr)) = o.get("tokens") else {
        return Err(ApiError::invalid(
            "`tokens` must be an array of token ids",
            Some("tokens"),
        ));
    };
    let vocab = tok.vocab_size();
    let mut ids = Vec::with_capacity(arr.len());
    for (i, v) in arr.iter().enumerate() {
        match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(id) if (id as usize) < vocab => ids.push(id),
            _ => {
                return Err(ApiError::invalid(
                    format!("`tokens[{i}]` is not a token id of this model (0..{vocab})"),
                    Some(&format!("tokens[{i}]")),
                ))
            }
        }
    }
    let content = tok
        .decode(&ids, false)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("tokens")))?;
    Ok(json!({ "content": content }))
}
