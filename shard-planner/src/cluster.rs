//! Nodes and links (TOML), and turning them plus a profile into a
//! [`PlanProblem`]. The format is documented in `docs/shard-planner.md`;
//! `config/nodes.example.toml` is an example.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::network::NetworkProfile;
use crate::problem::{LayerCost, LinkCost, NodeCost, PlanProblem};
use crate::profile::ModelProfile;
use crate::{PlanError, MAX_NODES};

/// One machine that can run layers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Unique name.
    pub name: String,
    /// Memory available for weights + KV cache, in MB (10^6 bytes).
    pub memory_mb: f64,
    /// How many times faster than the profile's machine (default 1).
    /// Exclusive with `profile`.
    #[serde(default)]
    pub speed_factor: Option<f64>,
    /// A profile measured on this node (path relative to the TOML file);
    /// its compute times are used instead of scaling the main profile.
    #[serde(default)]
    pub profile: Option<PathBuf>,
    /// The loaded `profile`, filled by [`ClusterConfig::load`].
    #[serde(skip)]
    pub measured: Option<ModelProfile>,
}

/// A bidirectional link. `a` is the client side: with a named `network`,
/// `a -> b` uses the profile's uplink and `b -> a` its downlink.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkConfig {
    /// One end (the client side for named networks).
    pub a: String,
    /// The other end.
    pub b: String,
    /// A named [`NetworkProfile`]; exclusive with the explicit numbers.
    #[serde(default)]
    pub network: Option<String>,
    /// Round-trip time in ms.
    #[serde(default)]
    pub rtt_ms: Option<f64>,
    /// `a -> b` bandwidth in Mbit/s.
    #[serde(default)]
    pub a_to_b_mbps: Option<f64>,
    /// `b -> a` bandwidth in Mbit/s.
    #[serde(default)]
    pub b_to_a_mbps: Option<f64>,
    /// Measured fixed cost of one exchange (a message there and one back) on
    /// top of the RTT, ms: serialisation, framing, the receiver's bookkeeping.
    /// Charged half per crossing, like the RTT. Allowed with `network` (it is a
    /// property of the software, not of the link). Default 0.
    #[serde(default)]
    pub overhead_ms: Option<f64>,
}

/// The link parameters after resolving a named network.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ResolvedLink {
    /// Round-trip time in ms.
    pub rtt_ms: f64,
    /// `a -> b` in Mbit/s.
    pub a_to_b_mbps: f64,
    /// `b -> a` in Mbit/s.
    pub b_to_a_mbps: f64,
    /// Fixed cost per exchange in ms (0 unless configured).
    pub overhead_ms: f64,
}

/// The nodes TOML: which node is the device, the nodes, the links.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Name of the node that holds the raw tokens and wants the result.
    pub device: String,
    /// Context length the KV cache is sized for (default: the profile's).
    #[serde(default)]
    pub context_tokens: Option<u64>,
    /// `[[node]]` tables.
    #[serde(rename = "node")]
    pub nodes: Vec<NodeConfig>,
    /// `[[link]]` tables; a pair of nodes without a link cannot exchange data.
    #[serde(rename = "link", default)]
    pub links: Vec<LinkConfig>,
}

/// Per-plan knobs that are not part of the cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanOptions {
    /// Tokens per forward (1 for decoding, k+1 for verifying k drafts).
    pub block_tokens: u32,
    /// KV budget override; `None` uses the cluster's, then the profile's.
    pub context_tokens: Option<u64>,
    /// Keep the head on the device (U-shape).
    pub pin_head: bool,
}

fn invalid<T>(m: String) -> Result<T, PlanError> {
    Err(PlanError::InvalidNodes(m))
}

impl LinkConfig {
    /// Resolves a named network or checks the explicit numbers.
    pub fn resolve(&self) -> Result<ResolvedLink, PlanError> {
        let what = format!("link {} <-> {}", self.a, self.b);
        let explicit = [self.rtt_ms, self.a_to_b_mbps, self.b_to_a_mbps];
        let r = match &self.network {
            Some(name) => {
                if explicit.iter().any(Option::is_some) {
                    return invalid(format!(
                        "{what}: give either `network` or rtt_ms/a_to_b_mbps/b_to_a_mbps, not both"
                    ));
                }
                let p = NetworkProfile::by_name(name).ok_or_else(|| {
                    PlanError::InvalidNodes(format!(
                        "{what}: unknown network '{name}' (known: {})",
                        NetworkProfile::names().join(", ")
                    ))
                })?;
                ResolvedLink {
                    rtt_ms: p.rtt_ms,
                    a_to_b_mbps: p.up_mbps,
                    b_to_a_mbps: p.down_mbps,
                    overhead_ms: 0.0,
                }
            }
            None => match explicit {
                [Some(rtt_ms), Some(a_to_b_mbps), Some(b_to_a_mbps)] => ResolvedLink {
                    rtt_ms,
                    a_to_b_mbps,
                    b_to_a_mbps,
                    overhead_ms: 0.0,
                },
                _ => {
                    return invalid(format!(
                        "{what}: needs `network = \"<name>\"` or all of rtt_ms, a_to_b_mbps, b_to_a_mbps"
                    ))
                }
            },
        };
        let r = ResolvedLink {
            overhead_ms: self.overhead_ms.unwrap_or(0.0),
            ..r
        };
        if !(r.overhead_ms.is_finite() && r.overhead_ms >= 0.0) {
            return invalid(format!(
                "{what}: overhead_ms must be >= 0, got {}",
                r.overhead_ms
            ));
        }
        for (field, v) in [
            ("a_to_b_mbps", r.a_to_b_mbps),
            ("b_to_a_mbps", r.b_to_a_mbps),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return invalid(format!(
                    "{what}: {field} must be a positive bandwidth, got {v}"
                ));
            }
        }
        if !(r.rtt_ms.is_finite() && r.rtt_ms >= 0.0) {
            return invalid(format!("{what}: rtt_ms must be >= 0, got {}", r.rtt_ms));
        }
        Ok(r)
    }
}

impl ClusterConfig {
    /// Reads, validates and loads node profiles (relative to the file).
    pub fn load(path: &Path) -> Result<Self, PlanError> {
        let text = std::fs::read_to_string(path).map_err(|source| PlanError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::from_toml(&text, path, base)
    }

    /// Parses `text`; `origin` names it in errors, node profile paths are
    /// relative to `base`.
    pub fn from_toml(text: &str, origin: &Path, base: &Path) -> Result<Self, PlanError> {
        let mut c: ClusterConfig = toml::from_str(text).map_err(|e| PlanError::Parse {
            path: origin.to_path_buf(),
            message: e.to_string(),
        })?;
        for node in &mut c.nodes {
            if let Some(rel) = &node.profile {
                node.measured = Some(ModelProfile::load(&base.join(rel))?);
            }
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks names, numbers and links; every problem is named.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.nodes.is_empty() {
            return invalid("no [[node]] entries".into());
        }
        if self.nodes.len() > MAX_NODES {
            return invalid(format!(
                "{} nodes; the exact planner handles at most {MAX_NODES}",
                self.nodes.len()
            ));
        }
        for (i, n) in self.nodes.iter().enumerate() {
            if n.name.is_empty() || self.nodes[..i].iter().any(|o| o.name == n.name) {
                return invalid(format!("node name '{}' is empty or repeated", n.name));
            }
            if !(n.memory_mb.is_finite() && n.memory_mb >= 0.0) {
                return invalid(format!(
                    "node '{}': memory_mb must be >= 0, got {}",
                    n.name, n.memory_mb
                ));
            }
            if n.speed_factor.is_some() && n.profile.is_some() {
                return invalid(format!(
                    "node '{}': give speed_factor or profile, not both",
                    n.name
                ));
            }
            if let Some(f) = n.speed_factor {
                if !(f.is_finite() && f > 0.0) {
                    return invalid(format!(
                        "node '{}': speed_factor must be positive, got {f}",
                        n.name
                    ));
                }
            }
        }
        if self.index(&self.device).is_none() {
            return invalid(format!("device '{}' is not one of the nodes", self.device));
        }
        if self.context_tokens == Some(0) {
            return invalid("context_tokens must be at least 1".into());
        }
        for (i, l) in self.links.iter().enumerate() {
            for end in [&l.a, &l.b] {
                if self.index(end).is_none() {
                    return invalid(format!(
                        "link {} <-> {}: '{end}' is not one of the nodes",
                        l.a, l.b
                    ));
                }
            }
            if l.a == l.b {
                return invalid(format!(
                    "link {} <-> {}: a node cannot link to itself",
                    l.a, l.b
                ));
            }
            let dup = self.links[..i]
                .iter()
                .any(|o| (o.a == l.a && o.b == l.b) || (o.a == l.b && o.b == l.a));
            if dup {
                return invalid(format!("link {} <-> {} is given twice", l.a, l.b));
            }
            l.resolve()?;
        }
        Ok(())
    }

    /// Index of the node called `name`.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    /// A copy in which every link touching the device uses the named network,
    /// with the device as the client side. Other links are unchanged.
    pub fn with_device_network(&self, network: &str) -> Result<Self, PlanError> {
        if NetworkProfile::by_name(network).is_none() {
            return invalid(format!(
                "unknown network '{network}' (known: {})",
                NetworkProfile::names().join(", ")
            ));
        }
        let mut c = self.clone();
        for l in &mut c.links {
            if l.a == c.device || l.b == c.device {
                if l.b == c.device {
                    std::mem::swap(&mut l.a, &mut l.b);
                }
                l.network = Some(network.to_string());
                l.rtt_ms = None;
                l.a_to_b_mbps = None;
                l.b_to_a_mbps = None;
            }
        }
        Ok(c)
    }

    /// Number of links that touch the device.
    pub fn device_links(&self) -> usize {
        self.links
            .iter()
            .filter(|l| l.a == self.device || l.b == self.device)
            .count()
    }

    /// The KV context used for memory: the option, else this config's, else
    /// the profile's.
    pub fn context_for(&self, profile: &ModelProfile, opts: &PlanOptions) -> u64 {
        opts.context_tokens
            .or(self.context_tokens)
            .unwrap_or(profile.context_tokens)
    }

    /// Builds the numeric problem: memory per layer is weights + KV for the
    /// context, cut bytes are activation bytes x block tokens, compute is the
    /// node's own profile or the main profile divided by its speed factor.
    pub fn to_problem(
        &self,
        profile: &ModelProfile,
        opts: &PlanOptions,
    ) -> Result<PlanProblem, PlanError> {
        profile.validate()?;
        self.validate()?;
        if opts.block_tokens == 0 {
            return invalid("block size must be at least 1 token".into());
        }
        let context = self.context_for(profile, opts);
        let base_compute = profile.compute_for_block(opts.block_tokens)?;
        let layers = profile
            .layers
            .iter()
            .map(|l| LayerCost {
                name: l.name.clone(),
                memory_bytes: l
                    .weight_bytes
                    .saturating_add(l.kv_bytes_per_token.saturating_mul(context)),
                cut_bytes: l.activation_bytes_per_token as f64 * f64::from(opts.block_tokens),
            })
            .collect();
        let mut nodes = Vec::with_capacity(self.nodes.len());
        for n in &self.nodes {
            let compute_s = match &n.measured {
                Some(own) => {
                    if !profile.same_layers(own) {
                        return invalid(format!(
                            "node '{}': its profile '{}' does not have the same layers as '{}'",
                            n.name, own.model, profile.model
                        ));
                    }
                    own.compute_for_block(opts.block_tokens)?
                }
                None => {
                    let f = n.speed_factor.unwrap_or(1.0);
                    base_compute.iter().map(|c| c / f).collect()
                }
            };
            nodes.push(NodeCost {
                name: n.name.clone(),
                memory_budget_bytes: (n.memory_mb * 1e6).round() as u64,
                compute_s,
            });
        }
        let m = self.nodes.len();
        let mut links = vec![vec![None; m]; m];
        for l in &self.links {
            let r = l.resolve()?;
            let (Some(a), Some(b)) = (self.index(&l.a), self.index(&l.b)) else {
                return invalid(format!("link {} <-> {}: unknown node", l.a, l.b));
            };
            // The fixed per-exchange overhead is charged like the RTT: half per crossing.
            let half = (r.rtt_ms + r.overhead_ms) / 2.0 / 1e3;
            links[a][b] = Some(LinkCost {
                one_way_latency_s: half,
                bytes_per_s: r.a_to_b_mbps * 1e6 / 8.0,
            });
            links[b][a] = Some(LinkCost {
                one_way_latency_s: half,
                bytes_per_s: r.b_to_a_mbps * 1e6 / 8.0,
            });
        }
        let device = self.index(&self.device).ok_or_else(|| {
            PlanError::InvalidNodes(format!("device '{}' is not a node", self.device))
        })?;
        Ok(PlanProblem {
            layers,
            nodes,
            links,
            device,
            pin_head: opts.pin_head,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOML: &str = r#"
device = "phone"
context_tokens = 100

[[node]]
name = "phone"
memory_mb = 1.5

[[node]]
name = "server"
memory_mb = 16000
speed_factor = 4.0

[[link]]
a = "phone"
b = "server"
network = "fast-4g"
"#;

    fn parse(text: &str) -> Result<ClusterConfig, PlanError> {
        ClusterConfig::from_toml(text, Path::new("n.toml"), Path::new("."))
    }

    #[test]
    fn named_network_uses_uplink_from_the_client() {
        let c = parse(TOML).unwrap();
        let r = c.links[0].resolve().unwrap();
        assert_eq!((r.rtt_ms, r.a_to_b_mbps, r.b_to_a_mbps), (165.0, 1.35, 8.1));
        let swept = c.with_device_network("3g").unwrap();
        assert_eq!(swept.links[0].network.as_deref(), Some("3g"));
        assert!(c.with_device_network("6g").is_err());
    }

    #[test]
    fn errors_name_the_field() {
        let zero = TOML.replace(
            "network = \"fast-4g\"",
            "rtt_ms = 10\na_to_b_mbps = 0\nb_to_a_mbps = 5",
        );
        let e = parse(&zero).unwrap_err().to_string();
        assert!(
            e.contains("phone <-> server") && e.contains("a_to_b_mbps"),
            "{e}"
        );
        let e = parse(&TOML.replace("device = \"phone\"", "device = \"tablet\"")).unwrap_err();
        assert!(e.to_string().contains("'tablet'"), "{e}");
        let e = parse(&TOML.replace("fast-4g", "5g")).unwrap_err();
        assert!(e.to_string().contains("unknown network '5g'"), "{e}");
        let e = parse(&TOML.replace("speed_factor = 4.0", "speed_factor = -1")).unwrap_err();
        assert!(e.to_string().contains("speed_factor"), "{e}");
        let e = parse(&TOML.replace("memory_mb = 1.5", "memory_mb = 1.5\nram = 3")).unwrap_err();
        assert!(e.to_string().contains("ram"), "{e}");
        let e = parse(&TOML.replace("fast-4g\"", "fast-4g\"\noverhead_ms = -2")).unwrap_err();
        assert!(e.to_string().contains("overhead_ms"), "{e}");
    }

    #[test]
    fn overhead_is_charged_half_per_crossing_and_survives_a_sweep() {
        let c = parse(&TOML.replace("fast-4g\"", "fast-4g\"\noverhead_ms = 6")).unwrap();
        let r = c.links[0].resolve().unwrap();
        assert_eq!((r.rtt_ms, r.overhead_ms), (165.0, 6.0));
        let swept = c.with_device_network("lan").unwrap();
        assert_eq!(swept.links[0].resolve().unwrap().overhead_ms, 6.0);
        let mut p = crate::profile::ModelProfile {
            schema: crate::profile::ModelProfile::SCHEMA.into(),
            model: "m".into(),
            measured: false,
            note: String::new(),
            machine: String::new(),
            threads: None,
            context_tokens: 1,
            block_sizes: vec![1],
            layers: Vec::new(),
        };
        for (name, kind) in [
            ("embedding", crate::profile::LayerKind::Embedding),
            ("blk.0", crate::profile::LayerKind::Block),
            ("head", crate::profile::LayerKind::Head),
        ] {
            p.layers.push(crate::profile::LayerProfile {
                name: name.into(),
                kind,
                weight_bytes: 1,
                kv_bytes_per_token: 0,
                activation_bytes_per_token: 4,
                compute_seconds: [(1, 0.001)].into_iter().collect(),
            });
        }
        let opts = PlanOptions {
            block_tokens: 1,
            context_tokens: None,
            pin_head: false,
        };
        let prob = c.to_problem(&p, &opts).unwrap();
        let l = prob.links[0][1].unwrap();
        assert!((l.one_way_latency_s - (0.165 + 0.006) / 2.0).abs() < 1e-12);
        let l = prob.links[1][0].unwrap();
        assert!((l.one_way_latency_s - (0.165 + 0.006) / 2.0).abs() < 1e-12);
    }
}
