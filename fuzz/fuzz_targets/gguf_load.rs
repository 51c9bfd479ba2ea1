//! GGUF open + model load + tokenizer build + one decode step on arbitrary
//! bytes. Invariant: a malformed file is an `Err`, never a panic, an abort or
//! an allocation the file does not back. Seeds: tiny generated models
//! (`cargo run -p tandem-model --example fuzz_seeds`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;
use tandem_model::gguf::GgufFile;
use tandem_model::transformer::{LoadOptions, Model};
use tandem_model::tokenizer::Tokenizer;

/// One scratch file per fuzzing process (the loader maps a path).
static SCRATCH: OnceLock<PathBuf> = OnceLock::new();

fn scratch() -> &'static PathBuf {
    SCRATCH.get_or_init(|| {
        let dir = PathBuf::from("/dev/shm");
        let dir = if dir.is_dir() {
            dir
        } else {
            std::env::temp_dir()
        };
        // libFuzzer ends a timed run with exit(): remove the file then, or
        // every run leaves one in /dev/shm (memory, on CI).
        // SAFETY: registers a plain function; it runs once, at exit.
        unsafe {
            libc::atexit(remove_scratch);
        }
        dir.join(format!("tandem-fuzz-gguf-{}.gguf", std::process::id()))
    })
}

extern "C" fn remove_scratch() {
    if let Some(p) = SCRATCH.get() {
        let _ = std::fs::remove_file(p);
    }
}

fuzz_target!(|data: &[u8]| {
    let path = scratch();
    if std::fs::write(path, data).is_err() {
        return;
    }
    let Ok(gguf) = GgufFile::open(path) else {
        return;
    };
    let tok = Tokenizer::from_gguf(&gguf).ok();
    for repack in [false, true] {
        let Ok(gguf) = GgufFile::open(path) else {
            return;
        };
        let opts = LoadOptions {
            max_seq_len: 8,
            repack,
            tiles: repack,
        };
        let Ok(model) = Model::from_gguf(gguf, opts) else {
            return;
        };
        if let Some(tok) = &tok {
            assert_eq!(tok.vocab_size(), model.config().vocab);
        }
        // One token through every layer and the head.
        let mut cache = model.new_cache();
        if let Ok(mut hidden) = model.embed(&[0]) {
            let layers = 0..model.config().n_layer;
            if model
                .forward_layers(layers, &mut hidden, 0, &mut cache)
                .is_ok()
            {
                let _ = model.head(&hidden);
            }
        }
    }
});
