//! What a GGUF file is and whether Tandem runs it (`tandem models info`), and
//! whether two files pair as draft and target (`tandem models check-pair`).
//!
//! The header is read with candle's GGUF reader, which accepts any tensor
//! type, so a file Tandem cannot run is still described (its architecture,
//! formats, tokenizer), and the reason it cannot run is the model core's own
//! error: the unsupported architecture, tokenizer or tensor format, named
//! beside what is supported.

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tandem_model::arch::ModelConfig;
use tandem_model::gguf::GgufFile;
use tandem_model::pair::{PairError, PairReport};
use tandem_model::tokenizer::Tokenizer;

/// One GGUF file, described.
pub struct ModelInfo {
    pub path: PathBuf,
    /// `general.name`, when the file has one.
    pub name: Option<String>,
    /// `general.architecture`.
    pub architecture: String,
    /// Tensor count per GGML type name (`Q4_K`, `F32`, …).
    pub formats: BTreeMap<String, usize>,
    pub tokenizer_model: Option<String>,
    pub tokenizer_pre: Option<String>,
    pub has_chat_template: bool,
    /// The model core's view: its configuration, or why it cannot run the file.
    pub config: std::result::Result<ModelConfig, String>,
    /// The tokenizer, or why it cannot be built.
    pub tokenizer: std::result::Result<Tokenizer, String>,
}

fn meta_string(c: &Content, key: &str) -> Option<String> {
    match c.metadata.get(key) {
        Some(Value::String(s)) => Some(s.clone()),
        _ => None,
    }
}

/// Describe the GGUF at `path`.
pub fn inspect(path: &Path) -> Result<ModelInfo> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let content = Content::read(&mut f)
        .map_err(|e| anyhow::anyhow!("{} is not a readable GGUF file: {e}", path.display()))?;
    let mut formats = BTreeMap::new();
    for info in content.tensor_infos.values() {
        *formats.entry(format!("{:?}", info.ggml_dtype)).or_insert(0) += 1;
    }
    let (config, tokenizer) = match GgufFile::open(path) {
        Ok(g) => (
            ModelConfig::from_gguf(&g).map_err(|e| e.to_string()),
            Tokenizer::from_gguf(&g).map_err(|e| e.to_string()),
        ),
        Err(e) => (Err(e.to_string()), Err(e.to_string())),
    };
    Ok(ModelInfo {
        path: path.to_path_buf(),
        name: meta_string(&content, "general.name"),
        architecture: meta_string(&content, "general.architecture").unwrap_or_default(),
        formats,
        tokenizer_model: meta_string(&content, "tokenizer.ggml.model"),
        tokenizer_pre: meta_string(&content, "tokenizer.ggml.pre"),
        has_chat_template: content.metadata.contains_key("tokenizer.chat_template"),
        config,
        tokenizer,
    })
}

impl ModelInfo {
    /// Whether Tandem runs the file (its model and its tokenizer load).
    pub fn runnable(&self) -> std::result::Result<(), String> {
        self.config.as_ref().map_err(Clone::clone)?;
        self.tokenizer.as_ref().map_err(Clone::clone)?;
        Ok(())
    }

    fn formats_text(&self) -> String {
        let list: Vec<String> = self
            .formats
            .iter()
            .map(|(k, n)| format!("{k}×{n}"))
            .collect();
        list.join(" ")
    }

    /// `path: arch, layers, vocabulary` in one line.
    pub fn one_line(&self) -> String {
        let shape = match &self.config {
            Ok(c) => format!(
                "{} layers, d_model {}, vocabulary {} ({} embedding rows)",
                c.n_layer, c.d_model, c.vocab, c.embd_rows
            ),
            Err(e) => format!("cannot run: {e}"),
        };
        format!("{} ({}, {shape})", self.path.display(), self.architecture)
    }

    /// A multi-line human report.
    pub fn report(&self) -> String {
        let mut s = format!("{}\n", self.path.display());
        if let Some(n) = &self.name {
            s += &format!("  name:          {n}\n");
        }
        s += &format!("  architecture:  {}\n", self.architecture);
        match &self.config {
            Ok(c) => {
                s += &format!(
                    "  shape:         {} layers, d_model {}, {} heads ({} KV) of {}, FFN {}\n",
                    c.n_layer, c.d_model, c.n_head, c.n_kv_head, c.head_dim, c.d_ff
                );
                s += &format!(
                    "  vocabulary:    {} tokens ({} embedding rows)\n",
                    c.vocab, c.embd_rows
                );
                if let Some(w) = &c.sliding_window {
                    s += &format!(
                        "  attention:     sliding window {} on 5 of every {} layers\n",
                        w.window, w.pattern
                    );
                }
            }
            Err(e) => s += &format!("  model:         cannot run: {e}\n"),
        }
        s += &format!("  tensors:       {}\n", self.formats_text());
        s += &format!(
            "  tokenizer:     {} (pre-tokenizer {}){}\n",
            self.tokenizer_model.as_deref().unwrap_or("none"),
            self.tokenizer_pre.as_deref().unwrap_or("none"),
            match &self.tokenizer {
                Ok(_) => String::new(),
                Err(e) => format!(": cannot build: {e}"),
            }
        );
        s += &format!(
            "  chat template: {}\n",
            if self.has_chat_template {
                "yes (the GGUF's own)"
            } else {
                "none (plain completion only)"
            }
        );
        s += &format!(
            "  runs:          {}",
            match self.runnable() {
                Ok(()) => "yes".to_string(),
                Err(e) => format!("no: {e}"),
            }
        );
        s
    }

    /// The JSON form of [`ModelInfo::report`].
    pub fn summary(&self) -> serde_json::Value {
        let cfg = self.config.as_ref().ok();
        serde_json::json!({
            "path": self.path,
            "name": self.name,
            "architecture": self.architecture,
            "n_layer": cfg.map(|c| c.n_layer),
            "d_model": cfg.map(|c| c.d_model),
            "vocab": cfg.map(|c| c.vocab),
            "embd_rows": cfg.map(|c| c.embd_rows),
            "formats": self.formats,
            "tokenizer_model": self.tokenizer_model,
            "tokenizer_pre": self.tokenizer_pre,
            "chat_template": self.has_chat_template,
            "runs": self.runnable().is_ok(),
            "reason": self.runnable().err(),
        })
    }
}

/// Whether `draft` and `target` pair ([`tandem_model::pair::check_pair`]);
/// a file Tandem cannot run does not pair, with its reason.
pub fn check_pair(
    draft: &ModelInfo,
    target: &ModelInfo,
) -> std::result::Result<PairReport, PairError> {
    let cannot = |who: &'static str, e: &String| PairError::Unrunnable {
        who,
        reason: e.clone(),
    };
    let d = draft.config.as_ref().map_err(|e| cannot("draft", e))?;
    let t = target.config.as_ref().map_err(|e| cannot("target", e))?;
    tandem_model::pair::check_pair(
        d,
        draft.tokenizer.as_ref().ok(),
        t,
        target.tokenizer.as_ref().ok(),
    )
}
