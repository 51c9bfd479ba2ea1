//! Models the user brought: GGUF files in the models directory that are not
//! built-in ones (copied or symlinked there), named by their file stem, and
//! the one rule that turns what a user typed into a model file
//! ([`resolve_name`]): a path, a built-in name, or one of theirs.
//! [`resolve_in_dir`] is the same rule confined to one directory, for the
//! device libraries, which never look anywhere else and never fetch.

use crate::{FetchError, ModelSpec};
use std::path::{Path, PathBuf};

/// A GGUF in the models directory that is not a built-in model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserModel {
    /// The file stem (`my-llama.Q4_K_M` for `my-llama.Q4_K_M.gguf`): what
    /// `--draft-model` and friends accept besides a path.
    pub name: String,
    pub path: PathBuf,
    /// Bytes (of the target, for a symlink).
    pub size: u64,
}

/// Every `*.gguf` in `dir` that is not a built-in model's file nor a
/// fetch's temporary file, sorted by name. A missing directory has none.
pub fn user_models(dir: &Path) -> Result<Vec<UserModel>, FetchError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(FetchError::io("list", dir, e)),
    };
    let builtin: Vec<String> = ModelSpec::builtin()
        .into_iter()
        .map(|s| s.file_name)
        .collect();
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| FetchError::io("list", dir, e))?;
        let path = entry.path();
        let Some(file_name) = path.file_name().and_then(|n| n.to_str()) else {
            continue; // not UTF-8: cannot be named on a command line portably
        };
        let Some(name) = file_name.strip_suffix(".gguf") else {
            continue;
        };
        if name.is_empty() || name.starts_with('.') || builtin.iter().any(|b| b == file_name) {
            continue;
        }
        // Follows symlinks; a dangling link or a directory is not a model.
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if !meta.is_file() {
            continue;
        }
        out.push(UserModel {
            name: name.to_string(),
            path,
            size: meta.len(),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// What a model argument names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelRef {
    /// An existing file (a path the user typed, or one of [`user_models`]).
    File(PathBuf),
    /// A built-in model (it may not be fetched yet).
    Builtin(ModelSpec),
}

/// Why a model argument names nothing.
#[derive(Debug, thiserror::Error)]
#[error(
    "`{given}` is neither a file nor a model name (built-in: {builtin}; yours in {dir}: {yours}). \
     Give a GGUF path, or copy or symlink the file into {dir} and use its name"
)]
pub struct UnknownModel {
    pub given: String,
    pub builtin: String,
    pub yours: String,
    pub dir: String,
}

/// Resolves a model argument: an existing path first, then a built-in name
/// (`draft`, `target`, `gemma`, `smollm2`), then the name of one of the
/// user's files in `dir`.
pub fn resolve_name(given: &str, dir: &Path) -> Result<ModelRef, ResolveError> {
    let p = PathBuf::from(given);
    if p.is_file() {
        return Ok(ModelRef::File(p));
    }
    if let Some(spec) = ModelSpec::by_name(given) {
        return Ok(ModelRef::Builtin(spec));
    }
    let users = user_models(dir)?;
    if let Some(u) = users.iter().find(|u| u.name == given) {
        return Ok(ModelRef::File(u.path.clone()));
    }
    Err(ResolveError::Unknown(unknown(given, dir)?))
}

/// Resolves a model entry of a device config (C ABI, JNI) inside `dir`
/// only: a path relative to `dir` (or absolute) that is a file; else a
/// built-in name (`draft`, `target`, `gemma`, `smollm2`) whose file is in
/// `dir`; else the name of one of the user's files in `dir`. Nothing is
/// fetched: a built-in model that is not in `dir` is an error saying so.
pub fn resolve_in_dir(given: &str, dir: &Path) -> Result<PathBuf, ResolveError> {
    let as_path = dir.join(given);
    if as_path.is_file() {
        return Ok(as_path);
    }
    if let Some(spec) = ModelSpec::by_name(given) {
        let p = dir.join(&spec.file_name);
        if p.is_file() {
            return Ok(p);
        }
        return Err(ResolveError::BuiltinAbsent {
            name: spec.name,
            file: spec.file_name,
            dir: dir.display().to_string(),
        });
    }
    match user_models(dir)?.into_iter().find(|u| u.name == given) {
        Some(u) => Ok(u.path),
        None => Err(unknown(given, dir)?.into()),
    }
}

fn unknown(given: &str, dir: &Path) -> Result<UnknownModel, FetchError> {
    let names = |v: Vec<String>| {
        if v.is_empty() {
            "none".to_string()
        } else {
            v.join(", ")
        }
    };
    Ok(UnknownModel {
        given: given.to_string(),
        builtin: names(ModelSpec::builtin().into_iter().map(|s| s.name).collect()),
        yours: names(user_models(dir)?.into_iter().map(|u| u.name).collect()),
        dir: dir.display().to_string(),
    })
}

/// Why [`resolve_name`] or [`resolve_in_dir`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error(transparent)]
    Unknown(#[from] UnknownModel),
    #[error(transparent)]
    Fetch(#[from] FetchError),
    /// [`resolve_in_dir`]: a built-in name whose file is not in the directory.
    #[error(
        "`{name}` is a built-in model, but its file {file} is not in {dir}: fetch it \
         (`tandem models fetch --model {name}`) and copy it there, or give a path"
    )]
    BuiltinAbsent {
        name: String,
        file: String,
        dir: String,
    },
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn user_models_are_the_other_ggufs_and_resolve_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("mine.Q4_0.gguf"), b"GGUF....").unwrap();
        std::fs::write(d.join(ModelSpec::draft().file_name), b"x").unwrap();
        std::fs::write(d.join("notes.txt"), b"x").unwrap();
        std::fs::write(d.join(".hidden.gguf"), b"x").unwrap();
        std::fs::create_dir(d.join("dir.gguf")).unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(d.join("nowhere"), d.join("dangling.gguf")).unwrap();
        let users = user_models(d).unwrap();
        assert_eq!(users.len(), 1, "{users:?}");
        assert_eq!(users[0].name, "mine.Q4_0");
        assert_eq!(users[0].size, 8);

        let r = resolve_name("mine.Q4_0", d).unwrap();
        assert_eq!(r, ModelRef::File(d.join("mine.Q4_0.gguf")));
        assert!(
            matches!(resolve_name("gemma", d).unwrap(), ModelRef::Builtin(s) if s.name == "gemma")
        );
        let p = d.join("notes.txt");
        assert_eq!(
            resolve_name(p.to_str().unwrap(), d).unwrap(),
            ModelRef::File(p)
        );
        let err = resolve_name("nope", d).unwrap_err().to_string();
        assert!(
            err.contains("`nope`") && err.contains("mine.Q4_0") && err.contains("smollm2"),
            "{err}"
        );
        assert!(user_models(&d.join("missing")).unwrap().is_empty());
    }

    #[test]
    fn resolve_in_dir_looks_only_in_the_directory_and_never_fetches() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir(d.join("sub")).unwrap();
        std::fs::write(d.join("sub/a.gguf"), b"x").unwrap();
        std::fs::write(d.join("mine.gguf"), b"x").unwrap();
        std::fs::write(d.join(ModelSpec::smollm2().file_name), b"x").unwrap();
        assert_eq!(
            resolve_in_dir("sub/a.gguf", d).unwrap(),
            d.join("sub/a.gguf")
        );
        let abs = d.join("mine.gguf");
        assert_eq!(resolve_in_dir(abs.to_str().unwrap(), d).unwrap(), abs);
        assert_eq!(resolve_in_dir("mine", d).unwrap(), abs);
        assert_eq!(
            resolve_in_dir("smollm2", d).unwrap(),
            d.join(ModelSpec::smollm2().file_name)
        );
        // A built-in that is not there: said so, nothing fetched.
        let err = resolve_in_dir("gemma", d).unwrap_err().to_string();
        assert!(
            err.contains("built-in") && err.contains("tandem models fetch --model gemma"),
            "{err}"
        );
        assert!(!d.join(ModelSpec::gemma().file_name).exists());
        // A file in the working directory is not in `d`.
        let err = resolve_in_dir("Cargo.toml", d).unwrap_err().to_string();
        assert!(
            err.contains("`Cargo.toml`") && err.contains("mine"),
            "{err}"
        );
    }
}
