//! Layer profiles: what each layer of a model costs on one machine.
//!
//! The JSON schema (`tandem.profile.v1`) is documented in
//! `docs/shard-planner.md`; `config/profile.example.json` is an example. A
//! measuring tool fills it by building [`ModelProfile`] directly: one
//! [`LayerProfile`] per layer in execution order (embedding, each transformer
//! block, head), each with the medians it measured per block size.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::PlanError;

/// What part of the model a layer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    /// Token embedding lookup; always first, always on the device.
    Embedding,
    /// One transformer block.
    Block,
    /// Final norm + output projection; always last.
    Head,
}

/// One layer's costs on the measured machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerProfile {
    /// Name shown in plans (`embedding`, `blk.0`, ..., `head`).
    pub name: String,
    /// Which part of the model this is.
    pub kind: LayerKind,
    /// Bytes of weights the node must hold to run this layer.
    pub weight_bytes: u64,
    /// KV-cache bytes per token of context (0 for embedding and head).
    pub kv_bytes_per_token: u64,
    /// Bytes per token of this layer's output, which cross the network when
    /// the next layer runs elsewhere. For the head: the bytes per token of the
    /// result returned to the device when the head is not on the device.
    pub activation_bytes_per_token: u64,
    /// Seconds to run this layer on a block of `k` tokens at the profile's
    /// context length, keyed by `k` (JSON object keys are strings: `"1"`).
    pub compute_seconds: BTreeMap<u32, f64>,
}

/// A model's per-layer costs, measured on one machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelProfile {
    /// Must be [`ModelProfile::SCHEMA`].
    pub schema: String,
    /// Which model (e.g. the GGUF file stem).
    pub model: String,
    /// `false` for hand-written or example numbers.
    #[serde(default)]
    pub measured: bool,
    /// Free text: how, where, caveats.
    #[serde(default)]
    pub note: String,
    /// Where it was measured (CPU model, etc.).
    #[serde(default)]
    pub machine: String,
    /// Threads used while measuring.
    #[serde(default)]
    pub threads: Option<u32>,
    /// Context length (tokens already in the KV cache) at which the compute
    /// times were measured; also the default KV budget for planning.
    pub context_tokens: u64,
    /// The block sizes `k` every layer has a compute time for.
    pub block_sizes: Vec<u32>,
    /// Layers in execution order: one embedding, blocks, one head.
    pub layers: Vec<LayerProfile>,
}

fn invalid<T>(m: String) -> Result<T, PlanError> {
    Err(PlanError::InvalidProfile(m))
}

impl ModelProfile {
    /// The schema tag this crate reads and writes.
    pub const SCHEMA: &'static str = "tandem.profile.v1";

    /// Reads and validates a profile from a JSON file.
    pub fn load(path: &Path) -> Result<Self, PlanError> {
        let text = std::fs::read_to_string(path).map_err(|source| PlanError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&text, path)
    }

    /// Parses and validates a profile; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &Path) -> Result<Self, PlanError> {
        let p: ModelProfile = serde_json::from_str(text).map_err(|e| PlanError::Parse {
            path: origin.to_path_buf(),
            message: e.to_string(),
        })?;
        p.validate()?;
        Ok(p)
    }

    /// Checks the structure (embedding, blocks, head), unique names, and
    /// that every layer has a finite, non-negative time for every block size.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.schema != Self::SCHEMA {
            return invalid(format!(
                "schema is '{}', expected '{}'",
                self.schema,
                Self::SCHEMA
            ));
        }
        if self.context_tokens == 0 {
            return invalid("context_tokens must be at least 1".into());
        }
        if self.block_sizes.is_empty() {
            return invalid("block_sizes is empty".into());
        }
        let sizes: BTreeSet<u32> = self.block_sizes.iter().copied().collect();
        if sizes.len() != self.block_sizes.len() || sizes.contains(&0) {
            return invalid(format!(
                "block_sizes must be distinct and positive, got {:?}",
                self.block_sizes
            ));
        }
        let n = self.layers.len();
        if n < 2 {
            return invalid(format!("{n} layers; need at least an embedding and a head"));
        }
        let mut names = BTreeSet::new();
        for (i, l) in self.layers.iter().enumerate() {
            let expected = if i == 0 {
                LayerKind::Embedding
            } else if i == n - 1 {
                LayerKind::Head
            } else {
                LayerKind::Block
            };
            if l.kind != expected {
                return invalid(format!(
                    "layer {i} '{}' is {:?}; layers must be one embedding, then blocks, then one head",
                    l.name, l.kind
                ));
            }
            if l.name.is_empty() || !names.insert(l.name.as_str()) {
                return invalid(format!("layer {i}: name '{}' is empty or repeated", l.name));
            }
            let keys: BTreeSet<u32> = l.compute_seconds.keys().copied().collect();
            if keys != sizes {
                return invalid(format!(
                    "layer '{}' has compute times for block sizes {:?}, expected {:?}",
                    l.name, keys, sizes
                ));
            }
            if let Some((k, s)) = l
                .compute_seconds
                .iter()
                .find(|(_, s)| !s.is_finite() || **s < 0.0)
            {
                return invalid(format!(
                    "layer '{}': compute time for block {k} is {s}",
                    l.name
                ));
            }
        }
        Ok(())
    }

    /// Seconds per layer for a block of `block_tokens` tokens.
    pub fn compute_for_block(&self, block_tokens: u32) -> Result<Vec<f64>, PlanError> {
        self.layers
            .iter()
            .map(|l| {
                l.compute_seconds.get(&block_tokens).copied().ok_or_else(|| {
                    PlanError::InvalidProfile(format!(
                        "profile '{}' has no compute times for block size {block_tokens} (it has {:?})",
                        self.model, self.block_sizes
                    ))
                })
            })
            .collect()
    }

    /// Total weight bytes.
    pub fn total_weight_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.weight_bytes).sum()
    }

    /// Whether `other` describes the same layers (names and kinds), so that
    /// its compute times can stand in for this profile's.
    pub fn same_layers(&self, other: &ModelProfile) -> bool {
        self.layers.len() == other.layers.len()
            && self
                .layers
                .iter()
                .zip(&other.layers)
                .all(|(a, b)| a.name == b.name && a.kind == b.kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(name: &str, kind: LayerKind) -> LayerProfile {
        LayerProfile {
            name: name.into(),
            kind,
            weight_bytes: 100,
            kv_bytes_per_token: 2,
            activation_bytes_per_token: 8,
            compute_seconds: [(1, 0.001), (4, 0.002)].into_iter().collect(),
        }
    }

    fn profile() -> ModelProfile {
        ModelProfile {
            schema: ModelProfile::SCHEMA.into(),
            model: "tiny".into(),
            measured: false,
            note: String::new(),
            machine: String::new(),
            threads: None,
            context_tokens: 16,
            block_sizes: vec![1, 4],
            layers: vec![
                layer("embedding", LayerKind::Embedding),
                layer("blk.0", LayerKind::Block),
                layer("head", LayerKind::Head),
            ],
        }
    }

    #[test]
    fn json_round_trip_and_block_lookup() {
        let p = profile();
        let text = serde_json::to_string(&p).unwrap();
        assert!(
            text.contains("\"compute_seconds\":{\"1\":0.001,\"4\":0.002}"),
            "{text}"
        );
        let back = ModelProfile::from_json(&text, Path::new("x.json")).unwrap();
        assert_eq!(back, p);
        assert_eq!(back.compute_for_block(4).unwrap(), vec![0.002; 3]);
        let e = back.compute_for_block(8).unwrap_err().to_string();
        assert!(e.contains("block size 8"), "{e}");
    }

    #[test]
    fn validation_names_the_problem() {
        let mut p = profile();
        p.layers.swap(0, 1);
        assert!(p
            .validate()
            .unwrap_err()
            .to_string()
            .contains("one embedding"));
        let mut p = profile();
        p.layers[1].compute_seconds.remove(&4);
        assert!(p.validate().unwrap_err().to_string().contains("'blk.0'"));
        let mut p = profile();
        p.layers[2].compute_seconds.insert(1, f64::NAN);
        assert!(p.validate().unwrap_err().to_string().contains("'head'"));
        let mut p = profile();
        p.layers[1].name = "head".into();
        assert!(p.validate().unwrap_err().to_string().contains("repeated"));
        let mut p = profile();
        p.schema = "v0".into();
        assert!(p.validate().unwrap_err().to_string().contains("schema"));
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let mut v = serde_json::to_value(profile()).unwrap();
        v["layers"][0]["weigth_bytes"] = 3.into();
        let e = ModelProfile::from_json(&v.to_string(), Path::new("p.json")).unwrap_err();
        assert!(e.to_string().contains("weigth_bytes"), "{e}");
    }
}
