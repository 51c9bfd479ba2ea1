//! The draft blocks the simulated devices replay, recorded once from the real
//! draft model against the real target (greedy), and cached on disk.
//!
//! Recording runs the protocol's round structure locally, with the generation
//! core (`tandem_model::engine`): the target's KV cache holds the prompt but
//! its last token (`last`); each round the draft proposes `k` tokens greedily,
//! one target forward over `[last, d1..dk]` judges them, and the verdict is the
//! longest prefix equal to the target's greedy tokens plus its next token. Greedy verification is deterministic and bit-exact
//! (batch invariance, docs/model-core.md), so a verifier that receives the same
//! drafts must answer the same verdicts: the replay checks every one.

use super::super::worker::PromptCase;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tandem_model::engine::{GenerateConfig, SpecEngine, TargetVerifier};
use tandem_model::kv_cache::KvPrecision;
use tandem_model::tokenizer::Tokenizer;
use tandem_model::transformer::{LoadOptions, Model};

/// Bump when the recorded content or its meaning changes (old files are then
/// never read: the version is part of the cache key).
const TRACE_VERSION: u32 = 1;

/// One verify round: what the device sends and what the verifier must answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Round {
    pub draft: Vec<u32>,
    pub accepted: u32,
    pub next_token: u32,
}

/// One generation: the prompt (Open) and its rounds (Drafts) in order.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SessionTrace {
    pub prompt_id: String,
    pub prompt: Vec<u32>,
    pub rounds: Vec<Round>,
}

impl SessionTrace {
    /// The tokens the rounds emit: the target's own greedy output.
    pub fn emitted(&self) -> Vec<u32> {
        let mut out = Vec::new();
        for r in &self.rounds {
            out.extend_from_slice(&r.draft[..(r.accepted as usize).min(r.draft.len())]);
            out.push(r.next_token);
        }
        out
    }

    /// The same generation as cloud-only streaming: one `k = 0` round per
    /// token (the verifier's next token alone), `tokens` of them at most.
    pub fn streaming(&self, tokens: usize) -> SessionTrace {
        let rounds = self
            .emitted()
            .into_iter()
            .take(tokens)
            .map(|t| Round {
                draft: Vec::new(),
                accepted: 0,
                next_token: t,
            })
            .collect();
        SessionTrace {
            prompt_id: self.prompt_id.clone(),
            prompt: self.prompt.clone(),
            rounds,
        }
    }

    /// Context length (prompt + emitted) after round `i`, as the verdict of
    /// that round must report it.
    pub fn context_after(&self) -> Vec<u64> {
        let mut len = self.prompt.len() as u64;
        self.rounds
            .iter()
            .map(|r| {
                len += u64::from(r.accepted) + 1;
                len
            })
            .collect()
    }
}

/// The per-round block lengths of one speculative mode, cycled over rounds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    pub name: String,
    pub ks: Vec<usize>,
}

/// One schedule's sessions, one per prompt.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Recorded {
    pub schedule: Schedule,
    pub sessions: Vec<SessionTrace>,
}

/// What makes a trace valid for reuse; its sha256 names the cache file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceKey {
    pub version: u32,
    pub draft_sha256: String,
    pub target_sha256: String,
    /// sha256 of the used prompts (id and text, in order).
    pub prompts_sha256: String,
    pub schedules: Vec<Schedule>,
    /// Tokens each session generates (the last round may overshoot by < k).
    pub tokens: usize,
    /// Only the last this many tokens of each chat-formatted prompt (None: all).
    pub prompt_tail: Option<usize>,
}

impl TraceKey {
    pub fn new(
        draft_sha256: &str,
        target_sha256: &str,
        prompts: &[PromptCase],
        schedules: &[Schedule],
        tokens: usize,
        prompt_tail: Option<usize>,
    ) -> Self {
        let mut h = Sha256::new();
        for p in prompts {
            h.update(p.id.as_bytes());
            h.update([0]);
            h.update(p.prompt.as_bytes());
            h.update([0]);
        }
        Self {
            version: TRACE_VERSION,
            draft_sha256: draft_sha256.to_owned(),
            target_sha256: target_sha256.to_owned(),
            prompts_sha256: hex(&h.finalize()),
            schedules: schedules.to_vec(),
            tokens,
            prompt_tail,
        }
    }

    /// `<dir>/verifier-trace-<first 16 hex digits of the key's sha256>.json`.
    pub fn file_in(&self, dir: &Path) -> Result<PathBuf> {
        let json = serde_json::to_vec(self)?;
        let digest = hex(&Sha256::digest(&json));
        Ok(dir.join(format!("verifier-trace-{}.json", &digest[..16])))
    }
}

/// The cache file's content.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TraceFile {
    pub key: TraceKey,
    /// The target tokenizer's fingerprint (what Open must carry).
    pub tokenizer_fingerprint: String,
    /// Wall time the recording took.
    pub record_seconds: f64,
    pub recorded: Vec<Recorded>,
}

impl TraceFile {
    pub fn sessions(&self, schedule: &str) -> Option<&[SessionTrace]> {
        self.recorded
            .iter()
            .find(|r| r.schedule.name == schedule)
            .map(|r| r.sessions.as_slice())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `bench` in Tandem's cache directory ([`tandem_fetch::cache_dir`]:
/// `$XDG_CACHE_HOME/tandem/bench`, else `~/.cache/tandem/bench`).
pub fn cache_dir() -> PathBuf {
    tandem_fetch::cache_dir()
        .unwrap_or_else(|| std::env::temp_dir().join(".cache").join("tandem"))
        .join("bench")
}

/// The cached trace for `key` if present and intact (a file that does not
/// parse, or holds another key, is recorded again).
pub fn load_cached(path: &Path, key: &TraceKey) -> Option<TraceFile> {
    let text = std::fs::read(path).ok()?;
    let t: TraceFile = serde_json::from_slice(&text).ok()?;
    (t.key == *key).then_some(t)
}

/// Writes the trace next to its final name, then renames it into place (a
/// concurrent or interrupted run never leaves half a file under that name).
pub fn store(path: &Path, t: &TraceFile) -> Result<()> {
    let dir = path.parent().context("trace path has no directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, serde_json::to_vec(t)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

/// Each prompt as a one-message chat (user), ready for the assistant's
/// answer; only its last `tail` tokens when given (shorter prefills).
pub fn encode_prompts(
    tok: &Tokenizer,
    prompts: &[PromptCase],
    tail: Option<usize>,
) -> Result<Vec<Vec<u32>>> {
    prompts
        .iter()
        .map(|p| {
            let ids = p.encode(tok)?;
            let from = tail.map_or(0, |n| ids.len().saturating_sub(n));
            Ok(ids[from..].to_vec())
        })
        .collect::<std::result::Result<_, tandem_model::ModelError>>()
        .context("tokenizing the prompt set")
}

/// Records every schedule on every prompt with the real models.
pub fn record(
    draft_path: &Path,
    target_path: &Path,
    prompts: &[PromptCase],
    key: TraceKey,
) -> Result<TraceFile> {
    let t = Instant::now();
    let k_max = key.schedules.iter().flat_map(|s| s.ks.iter()).max();
    let k_max = *k_max.context("no speculative schedule to record")?;
    let gguf = tandem_model::gguf::GgufFile::open(target_path)
        .with_context(|| format!("opening {}", target_path.display()))?;
    let tok = Tokenizer::from_gguf(&gguf).context("building the tokenizer")?;
    drop(gguf);
    let encoded = encode_prompts(&tok, prompts, key.prompt_tail)?;
    let longest = encoded.iter().map(Vec::len).max().unwrap_or(0);
    let capacity = longest + key.tokens + k_max + 8;
    let target = Model::load(target_path, LoadOptions::with_max_seq_len(capacity))
        .with_context(|| format!("loading {}", target_path.display()))?;
    let draft = Model::load(draft_path, LoadOptions::with_max_seq_len(capacity))
        .with_context(|| format!("loading {}", draft_path.display()))?;
    let mut recorded = Vec::new();
    for schedule in &key.schedules {
        let mut sessions = Vec::new();
        for (p, ids) in prompts.iter().zip(&encoded) {
            let rounds = record_session(&draft, &target, ids, &schedule.ks, key.tokens)
                .with_context(|| format!("recording prompt {} ({})", p.id, schedule.name))?;
            sessions.push(SessionTrace {
                prompt_id: p.id.clone(),
                prompt: ids.clone(),
                rounds,
            });
        }
        recorded.push(Recorded {
            schedule: schedule.clone(),
            sessions,
        });
    }
    check_same_output(&recorded)?;
    Ok(TraceFile {
        key,
        tokenizer_fingerprint: tok.fingerprint(),
        record_seconds: t.elapsed().as_secs_f64(),
        recorded,
    })
}

/// Every schedule emits the target's greedy output, so they must agree on
/// their common length (a cheap check of the model core's batch invariance).
fn check_same_output(recorded: &[Recorded]) -> Result<()> {
    let Some(first) = recorded.first() else {
        return Ok(());
    };
    for other in &recorded[1..] {
        for (a, b) in first.sessions.iter().zip(&other.sessions) {
            let (x, y) = (a.emitted(), b.emitted());
            let n = x.len().min(y.len());
            if x[..n] != y[..n] {
                bail!(
                    "prompt {}: schedules {} and {} emitted different greedy tokens: \
                     verification is not batch invariant",
                    a.prompt_id,
                    first.schedule.name,
                    other.schedule.name
                );
            }
        }
    }
    Ok(())
}

/// The greedy speculative rounds of one prompt (the generation core's,
/// [`SpecEngine::round`], against the local target as the verifier holds it:
/// the prompt but its last token), block lengths cycling through `ks`,
/// until at least `tokens` tokens are emitted.
fn record_session(
    draft: &Model,
    target: &Model,
    prompt: &[u32],
    ks: &[usize],
    tokens: usize,
) -> Result<Vec<Round>> {
    let Some((_, head)) = prompt.split_last() else {
        bail!("empty prompt");
    };
    anyhow::ensure!(
        !ks.is_empty() && ks.iter().all(|&k| k >= 1),
        "a schedule needs block lengths >= 1"
    );
    // Greedy, the draft model proposing from an f32 cache, no stop token,
    // no output limit (the last round may overshoot `tokens` by < k).
    let cfg = GenerateConfig {
        max_tokens: usize::MAX,
        k: 1,
        draft_kv: KvPrecision::F32,
        ..GenerateConfig::default()
    };
    let mut verifier = TargetVerifier::new(target, cfg.sampling);
    if !head.is_empty() {
        verifier.prefill(head)?;
    }
    let mut on_token = |_| true;
    let mut engine = SpecEngine::new(draft, prompt, &cfg, verifier.capacity(), &mut on_token)?;
    let mut rounds = Vec::new();
    while engine.output().len() < tokens {
        let k = ks[rounds.len() % ks.len()];
        let Some(r) = engine.round(k, &mut verifier)? else {
            bail!("the context is full after {} tokens", engine.output().len());
        };
        rounds.push(Round {
            draft: r.block,
            accepted: r.accepted as u32,
            next_token: r.next_token,
        });
    }
    Ok(rounds)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session() -> SessionTrace {
        SessionTrace {
            prompt_id: "p".into(),
            prompt: vec![1, 2, 3],
            rounds: vec![
                Round {
                    draft: vec![10, 11, 12],
                    accepted: 2,
                    next_token: 13,
                },
                Round {
                    draft: vec![20],
                    accepted: 1,
                    next_token: 21,
                },
                Round {
                    draft: vec![30, 31],
                    accepted: 0,
                    next_token: 32,
                },
            ],
        }
    }

    #[test]
    fn emitted_tokens_contexts_and_the_streaming_form() {
        let s = session();
        assert_eq!(s.emitted(), vec![10, 11, 13, 20, 21, 32]);
        assert_eq!(s.context_after(), vec![6, 8, 9]);
        let st = s.streaming(4);
        assert_eq!(st.rounds.len(), 4);
        assert!(st
            .rounds
            .iter()
            .all(|r| r.draft.is_empty() && r.accepted == 0));
        assert_eq!(st.emitted(), vec![10, 11, 13, 20]);
        assert_eq!(st.context_after(), vec![4, 5, 6, 7]);
    }

    #[test]
    fn the_cache_key_names_a_file_and_changes_with_its_inputs() {
        let prompts = vec![PromptCase {
            id: "a".into(),
            kind: String::new(),
            prompt: "hi".into(),
            max_tokens: 8,
            suffix: None,
        }];
        let sch = vec![Schedule {
            name: "k4".into(),
            ks: vec![4],
        }];
        let a = TraceKey::new("d", "t", &prompts, &sch, 16, None);
        let dir = Path::new("/x");
        let f = a.file_in(dir).unwrap();
        assert!(f.starts_with(dir));
        assert_eq!(
            f,
            TraceKey::new("d", "t", &prompts, &sch, 16, None)
                .file_in(dir)
                .unwrap()
        );
        for b in [
            TraceKey::new("d2", "t", &prompts, &sch, 16, None),
            TraceKey::new("d", "t2", &prompts, &sch, 16, None),
            TraceKey::new("d", "t", &prompts, &sch, 17, None),
            TraceKey::new("d", "t", &prompts, &sch, 16, Some(8)),
            TraceKey::new("d", "t", &[], &sch, 16, None),
        ] {
            assert_ne!(b.file_in(dir).unwrap(), f, "{b:?}");
        }
    }
}
