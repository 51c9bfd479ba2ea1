//! UTF-8-safe streaming decoder: token ids in, text chunks out, never a
//! split character.

use super::types::Tokenizer;

/// Turns a stream of token ids into text chunks without ever splitting a
/// UTF-8 character (a byte-level token can end in the middle of one). The
/// concatenation of all chunks, plus [`StreamDecoder::flush`], equals
/// [`Tokenizer::decode`] of all the ids.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    tokenizer: Tokenizer,
    skip_special: bool,
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new(tokenizer: &Tokenizer, skip_special: bool) -> Self {
        Self {
            tokenizer: tokenizer.clone(),
            skip_special,
            pending: Vec::new(),
        }
    }

    /// Add one token; returns the text it completes, if any. An id outside
    /// the vocabulary yields U+FFFD (the model never produces one; use
    /// [`Tokenizer::decode`] to get an error instead).
    pub fn push(&mut self, id: u32) -> Option<String> {
        match self.tokenizer.piece_for_decode(id, self.skip_special) {
            Ok(piece) => self.pending.extend_from_slice(piece),
            Err(_) => {
                tracing::warn!(id, "stream decoder: token id out of range");
                // Flush what is pending first so the mark lands in order.
                let mut s = self.take_lossy();
                s.push(char::REPLACEMENT_CHARACTER);
                return Some(s);
            }
        }
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix is valid UTF-8 by construction.
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // Incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            break;
                        }
                        // Invalid bytes: same replacement as from_utf8_lossy.
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + len);
                        }
                    }
                }
            }
        }
        (!out.is_empty()).then_some(out)
    }

    fn take_lossy(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }

    /// End of stream: whatever is pending (an incomplete character becomes
    /// U+FFFD).
    pub fn flush(&mut self) -> Option<String> {
        let s = self.take_lossy();
        (!s.is_empty()).then_some(s)
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }
}
