//! GPT-2 byte-level BPE (`tokenizer.ggml.model = gpt2`), as llama.cpp's
//! `llm_tokenizer_bpe_session`: each pre-token starts as its UTF-8 bytes (one
//! byte-level token per byte) and the adjacent pair with the lowest merge rank
//! (leftmost on ties) is merged until no pair has a merge.

use super::pre::{PreTokenizer, PreType};
use super::vocab::{err, string_array, FxMap};
use crate::gguf::GgufFile;
use crate::Result;
use rayon::prelude::*;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// GPT-2's reversible byte <-> printable-char table: printable Latin-1 bytes
/// map to themselves, the rest to U+0100.. in byte order.
pub(crate) fn byte_level_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        let cp = if printable {
            b as u32
        } else {
            let cp = next;
            next += 1;
            cp
        };
        *slot = char::from_u32(cp).unwrap_or('\0');
    }
    table
}

/// The byte-level char -> byte table (all byte-level chars are below U+0144).
pub(crate) fn char_to_byte_table() -> [Option<u8>; 0x144] {
    let mut t = [None::<u8>; 0x144];
    for (b, c) in byte_level_chars().iter().enumerate() {
        if let Some(slot) = t.get_mut(*c as usize) {
            *slot = Some(b as u8);
        }
    }
    t
}

/// The bytes a byte-level token text stands for, or `None` when a character
/// is outside the byte-level alphabet.
pub(crate) fn byte_level_decode(text: &str, table: &[Option<u8>; 0x144]) -> Option<Vec<u8>> {
    text.chars()
        .map(|c| table.get(c as usize).copied().flatten())
        .collect()
}

/// Marks a byte without a token (never a merge operand).
const NO_TOKEN: u32 = u32::MAX;

pub(crate) struct Bpe {
    /// Id of the one-byte token for each byte value.
    byte_to_id: [u32; 256],
    /// `(left, right) -> (rank, merged)`.
    merges: FxMap<(u32, u32), (u32, u32)>,
    pre: PreTokenizer,
    ignore_merges: bool,
    chars: [char; 256],
}

impl Bpe {
    pub(crate) fn from_gguf<'g>(
        gguf: &'g GgufFile,
        pre: PreType,
        token_to_id: &FxMap<String, u32>,
    ) -> Result<(Self, Vec<&'g str>)> {
        let chars = byte_level_chars();
        // A byte without a token is dropped, as llama.cpp drops it: StarCoder
        // has none for 0xC0, 0xC1, 0xF5.. (never in UTF-8), SmolLM2 none for
        // some ASCII control characters either.
        let mut byte_to_id = [NO_TOKEN; 256];
        for (b, c) in chars.iter().enumerate() {
            if let Some(&id) = token_to_id.get(c.encode_utf8(&mut [0; 4]) as &str) {
                byte_to_id[b] = id;
            }
        }
        let merge_texts = string_array(gguf, "tokenizer.ggml.merges")?;
        // Resolving the merge strings to ids is read-only: do it in parallel,
        // then insert in rank order.
        let resolved = merge_texts
            .par_iter()
            .enumerate()
            .map_init(String::new, |joined, (rank, m)| {
                // As llama.cpp: split at the first space after the first byte.
                let pos = m
                    .bytes()
                    .skip(1)
                    .position(|b| b == b' ')
                    .map(|p| p + 1)
                    .ok_or_else(|| err(format!("merge {rank} `{m}` has no space")))?;
                let (a, b) = (&m[..pos], &m[pos + 1..]);
                let lookup = |t: &str| {
                    token_to_id.get(t).copied().ok_or_else(|| {
                        err(format!(
                            "merge {rank} `{m}`: `{t}` is not in the vocabulary"
                        ))
                    })
                };
                joined.clear();
                joined.push_str(a);
                joined.push_str(b);
                Ok(((lookup(a)?, lookup(b)?), lookup(joined)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut merges = FxMap::with_capacity_and_hasher(resolved.len(), Default::default());
        for (rank, (pair, merged)) in resolved.into_iter().enumerate() {
            // Like llama.cpp, the first (lowest-rank) occurrence of a pair wins.
            merges.entry(pair).or_insert((rank as u32, merged));
        }
        Ok((
            Self {
                byte_to_id,
                merges,
                pre: PreTokenizer::new(pre)?,
                ignore_merges: pre.ignore_merges(),
                chars,
            },
            merge_texts,
        ))
    }

    /// Pre-tokenize and BPE-encode text that contains no special tokens.
    pub(crate) fn encode(
        &self,
        text: &str,
        token_to_id: &FxMap<String, u32>,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let mut word = String::new();
        for piece in self.pre.split(text)? {
            if self.ignore_merges {
                word.clear();
                word.extend(piece.bytes().map(|b| self.chars[b as usize]));
                if let Some(&id) = token_to_id.get(word.as_str()) {
                    out.push(id);
                    continue;
                }
            }
            self.bpe_word(piece.as_bytes(), out);
        }
        Ok(())
    }

    /// BPE over one pre-token: merge the lowest-rank adjacent pair (leftmost on
    /// ties) until no pair has a merge. O(n log n) with a heap of candidates.
    fn bpe_word(&self, bytes: &[u8], out: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        struct Sym {
            id: u32,
            prev: usize,
            next: usize,
            alive: bool,
        }
        let merges = &self.merges;
        match bytes.len() {
            0 => return,
            1 => {
                let id = self.byte_to_id[bytes[0] as usize];
                if id != NO_TOKEN {
                    out.push(id);
                }
                return;
            }
            _ => {}
        }
        let mut syms: Vec<Sym> = bytes
            .iter()
            .enumerate()
            .map(|(i, &b)| Sym {
                id: self.byte_to_id[b as usize],
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == bytes.len() { NONE } else { i + 1 },
                alive: true,
            })
            .collect();
        // (rank, left index, right index)
        let mut heap: BinaryHeap<Reverse<(u32, usize, usize)>> = BinaryHeap::new();
        for i in 0..syms.len() - 1 {
            if let Some(&(rank, _)) = merges.get(&(syms[i].id, syms[i + 1].id)) {
                heap.push(Reverse((rank, i, i + 1)));
            }
        }
        while let Some(Reverse((rank, l, r))) = heap.pop() {
            if !syms[l].alive || !syms[r].alive || syms[l].next != r {
                continue;
            }
            let Some(&(cur_rank, merged)) = merges.get(&(syms[l].id, syms[r].id)) else {
                continue;
            };
            if cur_rank != rank {
                continue;
            }
            syms[l].id = merged;
            syms[r].alive = false;
            let after = syms[r].next;
            syms[l].next = after;
            if after != NONE {
                syms[after].prev = l;
            }
            let before = syms[l].prev;
            if before != NONE {
                if let Some(&(rk, _)) = merges.get(&(syms[before].id, merged)) {
                    heap.push(Reverse((rk, before, l)));
                }
            }
            if after != NONE {
                if let Some(&(rk, _)) = merges.get(&(merged, syms[after].id)) {
                    heap.push(Reverse((rk, l, after)));
                }
            }
        }
        let mut i = 0;
        while i != NONE {
            if syms[i].id != NO_TOKEN {
                out.push(syms[i].id);
            }
            i = syms[i].next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection() {
        let t = byte_level_chars();
        let mut seen = std::collections::HashSet::new();
        for c in t {
            assert!(c != '\0');
            assert!(seen.insert(c));
        }
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        let back = char_to_byte_table();
        assert_eq!(byte_level_decode("Ġworld", &back).unwrap(), b" world");
        assert_eq!(byte_level_decode("▁", &back), None);
    }
}
