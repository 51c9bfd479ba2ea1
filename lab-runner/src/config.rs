//! The experiment matrix (`--config F.toml`, or the built-in `lab/default.toml` /
//! `lab/quick.toml`) and the prompt set (`lab/prompts.jsonl`, built in).

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tandem_model::proposer::ProposerKind;

pub const DEFAULT_TOML: &str = include_str!("../../lab/default.toml");
pub const QUICK_TOML: &str = include_str!("../../lab/quick.toml");
pub const PROMPTS_JSONL: &str = include_str!("../../lab/prompts.jsonl");
/// The shared prompt sets of `tandem bench`, by the names `prompts` takes.
const BUILT_IN_SETS: [(&str, &str, &str); 2] = [
    (
        "default",
        "prompts/default.jsonl",
        include_str!("../../prompts/default.jsonl"),
    ),
    (
        "editing",
        "prompts/editing.jsonl",
        include_str!("../../prompts/editing.jsonl"),
    ),
];

/// The built-in set `prompts` names, if it names one: (file, text).
fn built_in_set(prompts: &Path) -> Option<(&'static str, &'static str)> {
    let name = prompts.to_str()?;
    BUILT_IN_SETS
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, file, text)| (*file, *text))
}

/// One lab run's settings (every field documented in docs/lab.md).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LabConfig {
    /// Prompt set: `default` or `editing` (the built-in prompts/default.jsonl,
    /// prompts/editing.jsonl), else a file (JSONL: id, prompt, max_tokens,
    /// tags) relative to the config file. None: the built-in lab/prompts.jsonl.
    pub prompts: Option<PathBuf>,
    /// Use only the prompts with these ids (empty: all, then `prompt_limit`).
    pub prompt_ids: Vec<String>,
    /// At most this many prompts (0: all).
    pub prompt_limit: usize,
    /// Cap on each prompt's max_tokens (0: the prompt's own).
    pub max_tokens_cap: usize,
    pub repetitions: usize,
    /// `draft-only`, `target-only`, `spec-kN`, `adaptive`, `pipeline-kN`,
    /// `adaptive-pipeline`.
    pub modes: Vec<String>,
    /// netsim profile names (`tandem netsim --list`).
    pub profiles: Vec<String>,
    /// Named netsim timelines; a fresh proxy per run, so each run sees the whole
    /// timeline from its start.
    pub timelines: BTreeMap<String, String>,
    /// Modes run under the timelines.
    pub timeline_modes: Vec<String>,
    /// `taskset -c` core lists; empty string = no pinning.
    pub device_cores: String,
    pub verifier_cores: String,
    /// RAYON_NUM_THREADS of every child process.
    pub threads: usize,
    /// 0 = greedy (and the identity check against target-only).
    pub temperature: f32,
    /// Tokens generated once per device process before measuring (0: none).
    pub warmup_tokens: usize,
    /// Window of in-flight k = 0 requests of target-only streaming.
    pub stream_window: usize,
    pub max_seq_len: usize,
    pub draft_model: Option<PathBuf>,
    pub target_model: Option<PathBuf>,
    /// The device's `EdgeConfig` for every run (`[edge]`, the edge config file's
    /// fields: deadlines, breaker, open timeout, `[edge.speculation]` limits, ...).
    /// The lab sets the link (URL, token, fingerprint), k and the mode's
    /// speculation switches itself.
    pub edge: toml::Table,
    /// Per-mode additions to `edge` (`[edge_by_mode."spec-k4"]`), merged over it.
    pub edge_by_mode: BTreeMap<String, toml::Table>,
}

impl Default for LabConfig {
    fn default() -> Self {
        Self {
            prompts: None,
            prompt_ids: Vec::new(),
            prompt_limit: 0,
            max_tokens_cap: 0,
            repetitions: 1,
            modes: vec!["draft-only".into(), "target-only".into(), "spec-k4".into()],
            profiles: vec!["lan".into()],
            timelines: BTreeMap::new(),
            timeline_modes: Vec::new(),
            device_cores: "0".into(),
            verifier_cores: "1".into(),
            threads: 1,
            temperature: 0.0,
            warmup_tokens: 0,
            stream_window: 4,
            max_seq_len: 2048,
            draft_model: None,
            target_model: None,
            edge: toml::Table::new(),
            edge_by_mode: BTreeMap::new(),
        }
    }
}

/// `[edge]` fields the lab sets itself (per mode and per run).
const LAB_OWNED_EDGE_FIELDS: &[&str] = &[
    "verifier_url",
    "token",
    "token_env",
    "tokenizer_fingerprint",
    "ca_cert_pem",
    "client_cert_pem",
    "client_key_pem",
    "tls_domain",
    "k",
    "proposer",
    "split",
];
/// `[edge.gate]` fields the mode sets (`gated-kN-T`).
const LAB_OWNED_GATE_FIELDS: &[&str] = &["confidence"];
const LAB_OWNED_SPECULATION_FIELDS: &[&str] = &[
    "adaptive_k",
    "pipeline",
    "target_stream",
    "stream_window",
    "record_rounds",
];

/// `over` merged into `base`: tables recursively, everything else replaced.
fn merge(base: &mut toml::Table, over: &toml::Table) {
    for (k, v) in over {
        match (base.get_mut(k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            _ => {
                base.insert(k.clone(), v.clone());
            }
        }
    }
}

/// The fixed-k speculative modes' name prefixes, by proposer (`spec-kN`,
/// `lookup-kN`, `auto-kN`).
const SPEC_PREFIXES: [(&str, ProposerKind); 3] = [
    ("spec-k", ProposerKind::Draft),
    ("lookup-k", ProposerKind::Lookup),
    ("auto-k", ProposerKind::Auto),
];

/// What the device does in one mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The draft alone on the device (no network).
    DraftOnly,
    /// The verifier's target generates; k = 0 requests stream its tokens.
    TargetOnly,
    /// Speculative rounds of (up to) k proposed by `proposer`: `spec-kN` the
    /// draft model, `lookup-kN` prompt lookup, `auto-kN` auto's choice per
    /// round (adaptive and pipelined modes draft with the model).
    Spec {
        k: usize,
        adaptive: bool,
        pipeline: bool,
        proposer: ProposerKind,
    },
    /// Speculative with fixed k and uncertainty-gated verification at
    /// confidence `permille / 1000` (`gated-kN-T`, e.g. `gated-k4-0.95`).
    Gated { k: usize, permille: u16 },
}

impl Mode {
    pub fn parse(s: &str) -> Result<Self> {
        let k_of = |rest: &str| -> Result<usize> {
            let k: usize = rest
                .parse()
                .with_context(|| format!("mode {s:?}: k is not a number"))?;
            anyhow::ensure!((1..=16).contains(&k), "mode {s:?}: k must be in 1..=16");
            Ok(k)
        };
        Ok(match s {
            "draft-only" => Self::DraftOnly,
            "target-only" => Self::TargetOnly,
            "adaptive" => Self::Spec {
                k: 4,
                adaptive: true,
                pipeline: false,
                proposer: ProposerKind::Draft,
            },
            "adaptive-pipeline" => Self::Spec {
                k: 4,
                adaptive: true,
                pipeline: true,
                proposer: ProposerKind::Draft,
            },
            _ => {
                let proposed = SPEC_PREFIXES
                    .into_iter()
                    .find_map(|(prefix, p)| s.strip_prefix(prefix).map(|r| (r, p)));
                if let Some((r, proposer)) = proposed {
                    Self::Spec {
                        k: k_of(r)?,
                        adaptive: false,
                        pipeline: false,
                        proposer,
                    }
                } else if let Some(r) = s.strip_prefix("pipeline-k") {
                    Self::Spec {
                        k: k_of(r)?,
                        adaptive: false,
                        pipeline: true,
                        proposer: ProposerKind::Draft,
                    }
                } else if let Some(r) = s.strip_prefix("gated-k") {
                    let (k, t) = r.split_once('-').with_context(|| {
                        format!("mode {s:?}: gated-kN-T needs a confidence T, e.g. gated-k4-0.95")
                    })?;
                    let tau: f64 = t
                        .parse()
                        .with_context(|| format!("mode {s:?}: confidence {t:?} is not a number"))?;
                    anyhow::ensure!(
                        tau > 0.0 && tau <= 1.0,
                        "mode {s:?}: confidence must be in (0, 1]"
                    );
                    let permille = (tau * 1000.0).round();
                    anyhow::ensure!(
                        (permille / 1000.0 - tau).abs() < 1e-9,
                        "mode {s:?}: confidence has more than 3 decimals"
                    );
                    Self::Gated {
                        k: k_of(k)?,
                        permille: permille as u16,
                    }
                } else {
                    bail!("unknown mode {s:?} (draft-only, target-only, spec-kN, lookup-kN, auto-kN, adaptive, pipeline-kN, adaptive-pipeline, gated-kN-T)")
                }
            }
        })
    }

    pub fn name(&self) -> String {
        match *self {
            Self::DraftOnly => "draft-only".into(),
            Self::TargetOnly => "target-only".into(),
            Self::Spec {
                k,
                adaptive,
                pipeline,
                proposer,
            } => match (adaptive, pipeline) {
                (true, false) => "adaptive".into(),
                (true, true) => "adaptive-pipeline".into(),
                (false, false) => {
                    let prefix = SPEC_PREFIXES
                        .iter()
                        .find(|(_, p)| *p == proposer)
                        .map_or("spec-k", |(prefix, _)| prefix);
                    format!("{prefix}{k}")
                }
                (false, true) => format!("pipeline-k{k}"),
            },
            Self::Gated { k, permille } => format!("gated-k{k}-{}", f64::from(permille) / 1000.0),
        }
    }

    /// What proposes the mode's speculative rounds (the draft model unless
    /// the mode says otherwise).
    pub fn proposer(&self) -> ProposerKind {
        match *self {
            Self::Spec { proposer, .. } => proposer,
            _ => ProposerKind::Draft,
        }
    }

    /// The gate confidence of a gated mode.
    pub fn gate_confidence(&self) -> Option<f64> {
        match *self {
            Self::Gated { permille, .. } => Some(f64::from(permille) / 1000.0),
            _ => None,
        }
    }
}

/// One prompt of the set.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Prompt {
    pub id: String,
    pub prompt: String,
    pub max_tokens: usize,
    #[serde(default)]
    pub tags: Vec<String>,
}

pub fn parse_prompts(text: &str, origin: &str) -> Result<Vec<Prompt>> {
    let mut v = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let p: Prompt = serde_json::from_str(line)
            .with_context(|| format!("{origin} line {}: not a prompt object", i + 1))?;
        anyhow::ensure!(
            !p.prompt.trim().is_empty() && p.max_tokens > 0,
            "{origin} line {}: empty prompt or max_tokens = 0",
            i + 1
        );
        v.push(p);
    }
    let mut ids: Vec<&str> = v.iter().map(|p| p.id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    anyhow::ensure!(ids.len() == v.len(), "{origin}: prompt ids repeat");
    Ok(v)
}

impl LabConfig {
    pub fn from_toml(text: &str, origin: &str) -> Result<Self> {
        let c: Self = toml::from_str(text).with_context(|| format!("parsing {origin}"))?;
        c.validate()?;
        Ok(c)
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut c = Self::from_toml(&text, &path.display().to_string())?;
        if let (Some(p), Some(dir)) = (&c.prompts, path.parent()) {
            if p.is_relative() && built_in_set(p).is_none() {
                c.prompts = Some(dir.join(p));
            }
        }
        Ok(c)
    }

    /// The `[edge]` table of `mode` (with its `edge_by_mode` additions), as
    /// edge config TOML text.
    pub fn edge_toml(&self, mode: &str) -> String {
        let mut t = self.edge.clone();
        if let Some(o) = self.edge_by_mode.get(mode) {
            merge(&mut t, o);
        }
        toml::to_string(&t).unwrap_or_default()
    }

    fn validate_edge(&self) -> Result<()> {
        for (name, t) in std::iter::once(("edge".to_string(), &self.edge)).chain(
            self.edge_by_mode
                .iter()
                .map(|(m, t)| (format!("edge_by_mode.{m:?}"), t)),
        ) {
            for f in LAB_OWNED_EDGE_FIELDS {
                anyhow::ensure!(
                    !t.contains_key(*f),
                    "[{name}] {f}: the lab sets it (per mode and run)"
                );
            }
            if let Some(toml::Value::Table(g)) = t.get("gate") {
                for f in LAB_OWNED_GATE_FIELDS {
                    anyhow::ensure!(
                        !g.contains_key(*f),
                        "[{name}.gate] {f}: the mode sets it (gated-kN-T)"
                    );
                }
            }
            if let Some(toml::Value::Table(sp)) = t.get("speculation") {
                for f in LAB_OWNED_SPECULATION_FIELDS {
                    anyhow::ensure!(
                        !sp.contains_key(*f),
                        "[{name}.speculation] {f}: the mode sets it (see modes)"
                    );
                }
            }
        }
        for m in self.edge_by_mode.keys() {
            anyhow::ensure!(
                self.modes.contains(m) || self.timeline_modes.contains(m),
                "edge_by_mode.{m:?}: not a mode of this matrix"
            );
        }
        for m in self.modes.iter().chain(&self.timeline_modes) {
            tandem_edge::EdgeConfig::from_toml(&self.edge_toml(m))
                .map_err(|e| anyhow::anyhow!("[edge] for mode {m}: {e}"))?;
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<()> {
        anyhow::ensure!(self.repetitions >= 1, "repetitions must be at least 1");
        anyhow::ensure!(!self.modes.is_empty(), "modes is empty");
        anyhow::ensure!(self.threads >= 1, "threads must be at least 1");
        anyhow::ensure!(
            (1..=8).contains(&self.stream_window),
            "stream_window must be in 1..=8"
        );
        for m in self.modes.iter().chain(&self.timeline_modes) {
            Mode::parse(m)?;
        }
        for p in &self.profiles {
            tandem_netsim::NetConfig::profile(p).with_context(|| format!("profile {p:?}"))?;
        }
        for (name, t) in &self.timelines {
            tandem_netsim::Timeline::parse(t).with_context(|| format!("timeline {name:?}"))?;
        }
        self.validate_edge()?;
        let needs_net = self
            .modes
            .iter()
            .any(|m| !matches!(Mode::parse(m), Ok(Mode::DraftOnly)));
        anyhow::ensure!(
            !needs_net || !self.profiles.is_empty(),
            "modes other than draft-only need at least one profile"
        );
        if self.temperature == 0.0 {
            anyhow::ensure!(
                self.modes.iter().any(|m| m == "target-only"),
                "greedy runs are checked against target-only output: add \"target-only\" to modes"
            );
            anyhow::ensure!(
                self.timelines.is_empty() || !self.profiles.is_empty(),
                "timelines need a profile for the target-only reference"
            );
        }
        Ok(())
    }

    pub fn modes(&self) -> Vec<Mode> {
        self.modes
            .iter()
            .filter_map(|m| Mode::parse(m).ok())
            .collect()
    }

    pub fn timeline_modes(&self) -> Vec<Mode> {
        self.timeline_modes
            .iter()
            .filter_map(|m| Mode::parse(m).ok())
            .collect()
    }

    /// Which prompt set this run uses, as the report names it.
    pub fn prompt_set_name(&self) -> String {
        match &self.prompts {
            None => "lab (lab/prompts.jsonl, built in)".into(),
            Some(p) => match built_in_set(p) {
                Some((file, _)) => format!("{} ({file}, built in)", p.display()),
                None => p.display().to_string(),
            },
        }
    }

    /// The prompts of this run (file or built-in, filtered, capped).
    pub fn load_prompts(&self) -> Result<Vec<Prompt>> {
        let built_in = self.prompts.as_deref().and_then(built_in_set);
        let mut v = match (&self.prompts, built_in) {
            (_, Some((file, text))) => parse_prompts(text, file)?,
            (Some(p), None) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading {}", p.display()))?;
                parse_prompts(&text, &p.display().to_string())?
            }
            (None, None) => parse_prompts(PROMPTS_JSONL, "lab/prompts.jsonl")?,
        };
        if !self.prompt_ids.is_empty() {
            for id in &self.prompt_ids {
                anyhow::ensure!(v.iter().any(|p| &p.id == id), "no prompt with id {id:?}");
            }
            v.retain(|p| self.prompt_ids.contains(&p.id));
        }
        if self.prompt_limit > 0 {
            v.truncate(self.prompt_limit);
        }
        if self.max_tokens_cap > 0 {
            for p in &mut v {
                p.max_tokens = p.max_tokens.min(self.max_tokens_cap);
            }
        }
        anyhow::ensure!(!v.is_empty(), "no prompts selected");
        Ok(v)
    }
}
