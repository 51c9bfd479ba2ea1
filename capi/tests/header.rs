//! The checked-in C header is what cbindgen generates from the current
//! source: regenerate it and compare, so it cannot go stale.
//! `TANDEM_UPDATE_HEADER=1 cargo test -p tandem-capi --test header` rewrites it.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::PathBuf;

#[test]
fn checked_in_header_matches_cbindgen_output() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).unwrap();
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(&dir)
        .with_config(config)
        .generate()
        .unwrap()
        .write(&mut generated);
    let generated = String::from_utf8(generated).unwrap();
    let path = dir.join("include/tandem.h");
    if std::env::var_os("TANDEM_UPDATE_HEADER").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "capi/include/tandem.h is stale: run `TANDEM_UPDATE_HEADER=1 cargo test -p tandem-capi --test header`\n--- generated ---\n{generated}"
    );
    // The header declares every entry point.
    for f in [
        "tandem_runtime_new",
        "tandem_runtime_free",
        "tandem_generate",
        "tandem_generate_with",
        "tandem_sampling_default",
        "tandem_conversation_send_with",
        "tandem_conversation_new",
        "tandem_conversation_send",
        "tandem_conversation_free",
        "tandem_cancel",
        "tandem_runtime_stats",
        "tandem_runtime_last_json",
        "tandem_string_free",
        "tandem_status_name",
        "tandem_version",
    ] {
        assert!(generated.contains(&format!("{f}(")), "{f} missing");
    }
}
