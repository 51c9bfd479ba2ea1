//! Uncertainty-gated verification (issue 7, item 6): does the data support it?
//!
//! `cargo run --release -p tandem-model --example gating_curve -- [--prompts lab/prompts.jsonl] [--n 12] [--tokens 48] [--k 4]`
//!
//! A gated device would skip the round trip for a block of `k` drafts when the
//! draft is confident about every one of them (top-1 probability ≥ τ), mark the
//! block provisional, and have it verified later; a wrong provisional token is
//! then rolled back in front of the user. This measures, on the real pair, what
//! each τ would save and cost:
//!
//! 1. the target's greedy output for each prompt (what verification decides);
//! 2. the draft teacher-forced over prompt + that output in one forward: at
//!    every output position its top-1 token and probability;
//! 3. for every block start i (all positions, sliding): the block is *right*
//!    when the draft's top-1 equals the target's token at all k positions (the
//!    verifier would accept it whole), and *gated at τ* when its top-1
//!    probabilities are all ≥ τ.
//!
//! Up to the block's first wrong token the teacher-forced context is exactly
//! what a drafting device would see, so "right" and the gate decision up to
//! there are exact; after a wrong token a real device would draft from its own
//! wrong context, and the gate uses the teacher-forced probabilities instead
//! (the block is wrong either way).
//!
//! Prints, per τ: share of blocks gated (round trips saved), share of gated
//! blocks that are wrong (each a rollback of shown text), and the precision
//! the gate needs to pay. Greedy; threads: `RAYON_NUM_THREADS`.

use tandem_fetch::{model_path, ModelRole};
use tandem_model::sampling::{argmax, token_prob};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::{LoadOptions, Model};

/// The greedy token and the softmax probability the model gives it.
fn argmax_prob(logits: &[f32]) -> (u32, f32) {
    let t = argmax(logits);
    (t, token_prob(logits, t))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|p| args.get(p + 1))
            .cloned()
    };
    let num = |flag: &str, default: usize| -> Result<usize, String> {
        arg(flag).map_or(Ok(default), |v| {
            v.parse()
                .map_err(|_| format!("{flag} needs a number, got {v}"))
        })
    };
    let prompts_path = arg("--prompts").unwrap_or_else(|| "lab/prompts.jsonl".into());
    let n = num("--n", 12)?;
    let tokens = num("--tokens", 48)?;
    let k = num("--k", 4)?;
    if k == 0 {
        return Err("--k must be at least 1".into());
    }

    let opts = || LoadOptions::with_max_seq_len(2048);
    let draft = Model::load(model_path(ModelRole::Draft), opts())?;
    let target = Model::load(model_path(ModelRole::Target), opts())?;
    let tok = Tokenizer::from_gguf(target.gguf())?;
    let stops = tok.chat_stop_tokens();

    let text = std::fs::read_to_string(&prompts_path)
        .map_err(|e| format!("reading {prompts_path}: {e}"))?;
    // (draft top-1 right?, its probability) per output position, per prompt.
    let mut seqs: Vec<Vec<(bool, f32)>> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()).take(n) {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let (id, prompt) = (
            v["id"].as_str().unwrap_or("?").to_string(),
            v["prompt"]
                .as_str()
                .ok_or("prompt line without \"prompt\"")?,
        );
        let ids = tok.encode_chat(&[ChatMessage::user(prompt)], true)?;
        // 1. The target's greedy output.
        let mut cache = target.new_cache();
        let mut logits = target.forward_last(&ids, 0, &mut cache)?;
        let mut out = Vec::new();
        while out.len() < tokens {
            let (t, _) = argmax_prob(&logits);
            if stops.contains(&t) {
                break;
            }
            out.push(t);
            logits = target.forward_last(&[t], cache.len(), &mut cache)?;
        }
        // 2. The draft teacher-forced over prompt + output: the logits at
        // position ids.len() - 1 + i predict out[i].
        let mut all = ids.clone();
        all.extend_from_slice(&out);
        let mut dcache = draft.new_cache();
        let dl = draft.forward(&all[..all.len() - 1], 0, &mut dcache)?;
        let vocab = draft.config().vocab;
        let seq: Vec<(bool, f32)> = out
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let row = ids.len() - 1 + i;
                let (d, p) = argmax_prob(&dl[row * vocab..(row + 1) * vocab]);
                (d == t, p)
            })
            .collect();
        let right = seq.iter().filter(|x| x.0).count();
        eprintln!(
            "{id}: {} tokens, draft top-1 = target on {right} ({:.0} %)",
            out.len(),
            100.0 * right as f64 / out.len().max(1) as f64
        );
        seqs.push(seq);
    }

    // 3. Blocks of k, every start.
    let blocks: Vec<(bool, f32)> = seqs
        .iter()
        .flat_map(|s| {
            s.windows(k).map(|w| {
                (
                    w.iter().all(|x| x.0),
                    w.iter().map(|x| x.1).fold(f32::INFINITY, f32::min),
                )
            })
        })
        .collect();
    let total = blocks.len();
    let right_all = blocks.iter().filter(|b| b.0).count();
    println!(
        "{} prompts, {} blocks of k = {k}; blocks the verifier would accept whole: {:.1} %",
        seqs.len(),
        total,
        100.0 * right_all as f64 / total.max(1) as f64
    );
    println!("| τ (min top-1 prob) | blocks gated | gated blocks wrong (rollbacks) | right blocks gated |");
    println!("| ---: | ---: | ---: | ---: |");
    for tau in [0.5f32, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999] {
        let gated: Vec<&(bool, f32)> = blocks.iter().filter(|b| b.1 >= tau).collect();
        let wrong = gated.iter().filter(|b| !b.0).count();
        let right = gated.len() - wrong;
        println!(
            "| {tau} | {:.1} % | {:.1} % | {:.1} % |",
            100.0 * gated.len() as f64 / total.max(1) as f64,
            100.0 * wrong as f64 / gated.len().max(1) as f64,
            100.0 * right as f64 / right_all.max(1) as f64,
        );
    }
    Ok(())
}
