//! The flags of `tandem generate`: [`Args`], with the device-side flags of a remote
//! generation flattened into it ([`RemoteArgs`], also `tandem serve-edge`'s). A
//! leaf module: `generate.rs` and `remote.rs` both read these, and neither
//! imports the other's types.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use tandem_edge::device_layers::SplitLayer;
use tandem_edge::EdgeConfig;
use tandem_model::kv_cache::KvPrecision;
use tandem_model::proposer::ProposerKind;
use tandem_model::speculative::{GenerateConfig, Mode};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// draft = the device model alone, target = the big model alone,
    /// speculative = draft proposes, target verifies.
    #[arg(long, value_enum, default_value = "speculative")]
    pub mode: ModeArg,
    /// The user prompt; read from stdin when absent.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Optional system prompt (default: the model's own).
    #[arg(long)]
    pub system: Option<String>,
    /// Use the prompt as raw text, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Draft block length (1..=16).
    #[arg(long, default_value_t = 4)]
    pub k: usize,
    /// What proposes each block: the draft model, prompt lookup (no model:
    /// continues text that already occurred), or auto (per round, whichever
    /// promises more tokens per second). Speculative mode, locally and with
    /// --verifier.
    #[arg(long, default_value = "draft")]
    pub proposer: ProposerKind,
    /// How the draft model's KV cache stores keys and values: f16 (half the
    /// memory of f32, and what llama.cpp keeps), f32, or int8 (a quarter;
    /// the draft's own answers drift from the model's). It can change
    /// acceptance, never the speculative output. Speculative and draft
    /// modes; the target's cache is always f32.
    #[arg(long, default_value_t = GenerateConfig::default().draft_kv)]
    pub draft_kv: KvPrecision,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// 0 = greedy (output identical to the target's own greedy output); > 0 =
    /// sampled (output identical to the target's own for --seed).
    /// Negative values parse so that they get the sampler's clear error.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// OpenAI's presence penalty, in [-2, 2] (0: off): subtracted once from
    /// the logit of every token the completion already holds. The draft, the
    /// target and the verifier apply it alike, so speculative output stays
    /// the target's own under the same penalty.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty, in [-2, 2] (0: off): subtracted once per
    /// occurrence of a token in the completion.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Added to named tokens' logits: `ID=BIAS` pairs, comma-separated
    /// (OpenAI's `logit_bias`: each bias in [-100, 100]; -100 bans the token).
    #[arg(long, value_delimiter = ',', value_parser = parse_bias_pair, allow_hyphen_values = true)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed of the sampled draws: the token at each position is a function of
    /// the seed, the position and the distribution, so a seed reproduces the
    /// output in every mode.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// KV cache capacity in tokens (prompt + output).
    #[arg(long, default_value_t = 4096)]
    pub max_seq_len: usize,
    /// Print one JSON object (text, tokens, stats) instead of streaming.
    #[arg(long)]
    pub json: bool,
    /// Structured output: the answer is JSON valid against the JSON schema
    /// in FILE (every mode; the draft's proposals and the target's choice
    /// are masked alike, so greedy output is the target's own under the
    /// schema). See docs/grammar.md.
    #[arg(long, value_name = "FILE", group = "format")]
    pub json_schema: Option<PathBuf>,
    /// Structured output: the answer follows the Lark grammar in FILE
    /// (llguidance's dialect).
    #[arg(long, value_name = "FILE", group = "format")]
    pub grammar: Option<PathBuf>,
    /// Structured output: the whole answer matches this regular expression.
    #[arg(long, value_name = "REGEX", group = "format")]
    pub regex: Option<String>,
    /// The draft model: a GGUF path, a built-in name, or the name of one of
    /// yours in the models directory (`tandem models list`) [default: the
    /// built-in draft].
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// The target model, as `--draft-model` [default: the built-in target].
    #[arg(long)]
    pub target_model: Option<PathBuf>,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

/// One `--logit-bias` pair, `ID=BIAS` (the range is `LogitBias::new`'s).
fn parse_bias_pair(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}` is not TOKEN_ID=BIAS"))?;
    let id = id
        .trim()
        .parse::<u32>()
        .map_err(|_| format!("`{id}` in `{s}` is not a token id"))?;
    let bias = bias
        .trim()
        .parse::<f32>()
        .map_err(|_| format!("`{bias}` in `{s}` is not a number"))?;
    Ok((id, bias))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeArg {
    Draft,
    Target,
    Speculative,
}

impl Args {
    /// The structured output the flags ask for (--json-schema, --grammar,
    /// --regex), read and parsed; compiled against the tokenizer by
    /// [`output_grammar`].
    pub fn grammar_spec(&self) -> Result<Option<tandem_grammar::GrammarSpec>> {
        use tandem_grammar::GrammarSpec;
        let read = |p: &Path| {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
        };
        Ok(if let Some(p) = &self.json_schema {
            let text = read(p)?;
            let v = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", p.display()))?;
            Some(GrammarSpec::JsonSchema(v))
        } else if let Some(p) = &self.grammar {
            Some(GrammarSpec::Lark(read(p)?))
        } else {
            self.regex.clone().map(GrammarSpec::Regex)
        })
    }
}

/// `spec` compiled against `tok` (a grammar that does not compile is an
/// error naming llguidance's reason).
pub fn output_grammar(
    tok: &tandem_model::tokenizer::Tokenizer,
    spec: Option<tandem_grammar::GrammarSpec>,
) -> Result<Option<std::sync::Arc<dyn tandem_model::engine::OutputGrammar>>> {
    let Some(spec) = spec else {
        return Ok(None);
    };
    let vocab = tandem_grammar::GrammarVocab::new(tok)
        .context("building the grammar vocabulary of the tokenizer")?;
    let g = tandem_grammar::Grammar::new(&vocab, spec).context("the structured output format")?;
    Ok(Some(g.into_config()))
}

impl ModeArg {
    pub fn mode(self) -> Mode {
        match self {
            Self::Draft => Mode::Draft,
            Self::Target => Mode::Target,
            Self::Speculative => Mode::Speculative,
        }
    }
}

/// The device-side flags of `tandem generate` (flattened into its `Args`).
#[derive(clap::Args, Debug, Default)]
pub struct RemoteArgs {
    /// Verify remotely: the verifier's gRPC URL (`https://host:port`, or
    /// `http://127.0.0.1:port` on loopback). Overrides `verifier_url` of
    /// --edge-config.
    #[arg(long)]
    pub verifier: Option<String>,
    /// Edge config (TOML, `EdgeConfig`; see docs/edge.md): TLS files, token,
    /// deadlines, breaker. The flags below override its fields.
    #[arg(long)]
    pub edge_config: Option<PathBuf>,
    /// File holding this device's bearer token (surrounding whitespace ignored).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// PEM of the CA that signed the verifier's certificate (needed for https).
    #[arg(long)]
    pub ca_cert: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS; goes with --client-key.
    #[arg(long)]
    pub client_cert: Option<PathBuf>,
    /// Client private key (PEM) for mutual TLS.
    #[arg(long)]
    pub client_key: Option<PathBuf>,
    /// Name to check the verifier's certificate against (default: the URL's host).
    #[arg(long)]
    pub tls_domain: Option<String>,
    /// Privacy policy (TOML; docs/privacy.md): the router decides before any
    /// verifier session; a `local` prompt is answered by the draft alone and
    /// nothing is sent. Without it the built-in default policy decides.
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// Send the prompt to the verifier without asking the privacy router
    /// (e.g. for benchmarks on known-clean prompts). Off by default.
    #[arg(long, conflicts_with = "policy")]
    pub no_privacy_router: bool,
    /// Split execution: this process also loads the target and runs its layers
    /// [0, S) on every verify block, sending hidden states; the verifier runs
    /// [S, N). `auto` picks S with the shard planner (needs --split-profile).
    /// Overrides `[split] layer` of --edge-config. See docs/shard-planner.md.
    #[arg(long, value_name = "S|auto")]
    pub split: Option<String>,
    /// With --split: keep the head on the device too (U-shape; no token id is sent).
    #[arg(long)]
    pub pin_head: bool,
    /// With --split: send hidden states as f16 (half the bytes, LOSSY: the output
    /// may differ from the target's).
    #[arg(long)]
    pub hidden_f16: bool,
    /// With --split: this device's `tandem profile --model target` JSON (for
    /// `auto`, and for the predicted round time in the stats).
    #[arg(long)]
    pub split_profile: Option<PathBuf>,
}

impl RemoteArgs {
    /// True when this generation goes through the edge runtime.
    pub fn wanted(&self) -> bool {
        self.verifier.is_some()
            || self.edge_config.is_some()
            || self.policy.is_some()
            || self.split.is_some()
    }

    /// The edge config: the file (or defaults) with the flags applied, validated.
    pub fn edge_config(&self, k: usize) -> Result<EdgeConfig> {
        let mut cfg = match &self.edge_config {
            Some(p) => EdgeConfig::from_file(p)?,
            None => EdgeConfig::default(),
        };
        if let Some(u) = &self.verifier {
            cfg.verifier_url = Some(u.clone());
        }
        if let Some(p) = &self.ca_cert {
            cfg.ca_cert_pem = Some(p.clone());
        }
        if let Some(p) = &self.client_cert {
            cfg.client_cert_pem = Some(p.clone());
        }
        if let Some(p) = &self.client_key {
            cfg.client_key_pem = Some(p.clone());
        }
        if let Some(d) = &self.tls_domain {
            cfg.tls_domain = Some(d.clone());
        }
        if let Some(p) = &self.token_file {
            cfg.token = Some(read_token(p)?);
        }
        cfg.k = k;
        if let Some(s) = &self.split {
            let mut sc = cfg.split.take().unwrap_or_default();
            sc.layer =
                if s == "auto" {
                    SplitLayer::Named(s.clone())
                } else {
                    SplitLayer::Fixed(s.parse().with_context(|| {
                        format!("--split takes a layer number or auto, not {s:?}")
                    })?)
                };
            cfg.split = Some(sc);
        }
        let split_flags = self.pin_head || self.hidden_f16 || self.split_profile.is_some();
        match cfg.split.as_mut() {
            Some(sc) => {
                sc.pin_head |= self.pin_head;
                sc.hidden_f16 |= self.hidden_f16;
                if let Some(p) = &self.split_profile {
                    sc.profile = Some(p.clone());
                }
            }
            None => anyhow::ensure!(
                !split_flags,
                "--pin-head, --hidden-f16 and --split-profile go with --split"
            ),
        }
        anyhow::ensure!(
            cfg.split.is_none() || cfg.verifier_url.is_some(),
            "split execution needs a verifier: give --verifier URL"
        );
        cfg.validate()?;
        Ok(cfg)
    }
}

fn read_token(p: &Path) -> Result<String> {
    let t = std::fs::read_to_string(p)
        .with_context(|| format!("reading the token file {}", p.display()))?;
    let t = t.trim();
    anyhow::ensure!(!t.is_empty(), "the token file {} is empty", p.display());
    Ok(t.to_owned())
}
