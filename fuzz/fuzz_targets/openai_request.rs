//! The local OpenAI server's request parser (`/v1/chat/completions` and
//! `/v1/completions` bodies). Invariants: any body is a request or an
//! `ApiError`, never a panic; an accepted request respects the limits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_edge_http::openai::request::{parse_chat, parse_completion, Limits, MAX_CHOICES};

fuzz_target!(|data: &[u8]| {
    for strict in [false, true] {
        let lim = Limits {
            model_id: "tandem",
            max_tokens_limit: 4096,
            default_max_tokens: 256,
            strict,
            vocab: 151_936,
        };
        for parse in [parse_chat, parse_completion] {
            if let Ok(req) = parse(data, &lim) {
                assert!(req.max_tokens <= lim.max_tokens_limit, "{req:?}");
                assert!((1..=MAX_CHOICES).contains(&req.n), "{req:?}");
                assert!(!strict || req.ignored.is_empty(), "{req:?}");
            }
        }
    }
});
