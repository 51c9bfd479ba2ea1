//! Sampled mode on the real pair: how often the verifier accepts a drafted token
//! under keyed draws, against the rejection rule keyed draws replaced.
//!
//! `cargo run --release -p tandem-model --example sampled_acceptance -- [--prompts lab/prompts.jsonl] [--n 8] [--tokens 96] [--seeds 3] [--temperature 0.7] [--top-p 0.8] [--top-k 20]`
//!
//! For each prompt and seed:
//! 1. the target's own sampled output (keyed draws, `sampling::next_token`);
//! 2. both models teacher-forced over prompt + that output, one forward each;
//! 3. at every output position, with `p` and `q` the target's and the draft's
//!    distributions under the same parameters: the **rejection rule** accepts a
//!    token drawn from `q` with probability `1 - tv(p, q)`; **keyed draws** accept
//!    when the draft's keyed draw equals the target's (the output token). Greedy
//!    agreement (argmax = argmax) is printed for reference.
//!
//! Up to a block's first rejection the teacher-forced context is what a drafting
//! device sees, so these are the per-position acceptance rates a round starts
//! from. Threads: `RAYON_NUM_THREADS`.

use tandem_fetch::{model_path, ModelRole};
use tandem_model::sampling::{
    argmax, distribution, keyed_token, next_token, Distribution, SamplingParams,
};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::{LoadOptions, Model};

/// Total variation distance of two sparse distributions (both sorted by token).
fn total_variation(p: &Distribution, q: &Distribution) -> f64 {
    let (a, b) = (p.entries(), q.entries());
    let (mut i, mut j, mut sum) = (0, 0, 0.0f64);
    while i < a.len() || j < b.len() {
        let ta = a.get(i).map_or(u32::MAX, |e| e.0);
        let tb = b.get(j).map_or(u32::MAX, |e| e.0);
        if ta == tb {
            sum += (f64::from(a[i].1) - f64::from(b[j].1)).abs();
            i += 1;
            j += 1;
        } else if ta < tb {
            sum += f64::from(a[i].1);
            i += 1;
        } else {
            sum += f64::from(b[j].1);
            j += 1;
        }
    }
    sum / 2.0
}

/// Expected tokens per round of `k` drafts at per-position acceptance `a`
/// (independent positions): 1 + a + ... + a^k.
fn tokens_per_round(a: f64, k: i32) -> f64 {
    (0..=k).map(|i| a.powi(i)).sum()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|p| args.get(p + 1))
            .cloned()
    };
    let parse = |flag: &str, default: f64| -> Result<f64, String> {
        arg(flag).map_or(Ok(default), |v| {
            v.parse()
                .map_err(|_| format!("{flag} needs a number, got {v}"))
        })
    };
    let prompts_path = arg("--prompts").unwrap_or_else(|| "lab/prompts.jsonl".into());
    let n = parse("--n", 8.0)? as usize;
    let tokens = parse("--tokens", 96.0)? as usize;
    let seeds = parse("--seeds", 3.0)? as u64;
    let base = SamplingParams {
        temperature: parse("--temperature", 0.7)? as f32,
        top_p: parse("--top-p", 0.8)? as f32,
        top_k: parse("--top-k", 20.0)? as usize,
        ..SamplingParams::default()
    };
    base.validate()?;
    if base.is_greedy() {
        return Err("--temperature must be > 0 (this measures sampled mode)".into());
    }

    let opts = || LoadOptions::with_max_seq_len(2048);
    let draft = Model::load(model_path(ModelRole::Draft), opts())?;
    let target = Model::load(model_path(ModelRole::Target), opts())?;
    let tok = Tokenizer::from_gguf(target.gguf())?;
    let stops = tok.chat_stop_tokens();
    let vocab = target.config().vocab;

    let text = std::fs::read_to_string(&prompts_path)
        .map_err(|e| format!("reading {prompts_path}: {e}"))?;
    let (mut positions, mut rejection, mut keyed, mut greedy) = (0usize, 0.0f64, 0usize, 0usize);
    for line in text.lines().filter(|l| !l.trim().is_empty()).take(n) {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let id = v["id"].as_str().unwrap_or("?").to_string();
        let prompt = v["prompt"]
            .as_str()
            .ok_or("prompt line without \"prompt\"")?;
        let ids = tok.encode_chat(&[ChatMessage::user(prompt)], true)?;
        for seed in 0..seeds {
            let params = SamplingParams { seed, ..base };
            // 1. The target's own sampled output.
            let mut cache = target.new_cache();
            let mut logits = target.forward_last(&ids, 0, &mut cache)?;
            let mut all = ids.clone();
            while all.len() - ids.len() < tokens {
                let t = next_token(&params, &logits, &all);
                if stops.contains(&t) {
                    break;
                }
                all.push(t);
                logits = target.forward_last(&[t], cache.len(), &mut cache)?;
            }
            let out = all.len() - ids.len();
            if out == 0 {
                continue;
            }
            // 2. Both teacher-forced: row ids.len() - 1 + i predicts out[i].
            let fed = &all[..all.len() - 1];
            let tl = target.forward(fed, 0, &mut target.new_cache())?;
            let dl = draft.forward(fed, 0, &mut draft.new_cache())?;
            let (mut rej, mut key, mut gr) = (0.0, 0, 0);
            for i in 0..out {
                let row = ids.len() - 1 + i;
                let (tr, dr) = (
                    &tl[row * vocab..(row + 1) * vocab],
                    &dl[row * vocab..(row + 1) * vocab],
                );
                let hist = &all[..=row];
                let (p, q) = (
                    distribution(&params, tr, hist),
                    distribution(&params, dr, hist),
                );
                rej += 1.0 - total_variation(&p, &q);
                if keyed_token(&q, seed, hist.len()) == all[row + 1] {
                    key += 1;
                }
                if argmax(tr) == argmax(dr) {
                    gr += 1;
                }
            }
            eprintln!(
                "{id} seed {seed}: {out} tokens; accepted per position: rejection rule {:.3}, keyed {:.3}, greedy agreement {:.3}",
                rej / out as f64,
                key as f64 / out as f64,
                gr as f64 / out as f64
            );
            positions += out;
            rejection += rej;
            keyed += key;
            greedy += gr;
        }
    }
    let per = |x: f64| x / positions.max(1) as f64;
    let (a_rej, a_key) = (per(rejection), per(keyed as f64));
    println!(
        "{positions} positions, temperature {} top-p {} top-k {}: per-position acceptance rejection rule {a_rej:.3}, keyed draws {a_key:.3} ({:+.1} %); greedy agreement {:.3}",
        base.temperature,
        base.top_p,
        base.top_k,
        100.0 * (a_key / a_rej - 1.0),
        per(greedy as f64),
    );
    println!(
        "tokens per round of k = 4 (independent positions): rejection rule {:.2}, keyed draws {:.2}",
        tokens_per_round(a_rej, 4),
        tokens_per_round(a_key, 4)
    );
    Ok(())
}
