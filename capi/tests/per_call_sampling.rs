//! Per-call sampling through the C ABI (`tandem_generate_with`,
//! `tandem_conversation_send_with`, `tandem_sampling_default`), on the real
//! draft model in local mode: the defaults are the config-less greedy
//! output; a seeded sampled call reproduces itself and differs from greedy;
//! invalid sampling is INVALID_ARGUMENT naming the field before anything runs,
//! and a refused conversation turn leaves the history as it was.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr;

use tandem_capi::*;

const N: u32 = 8;

fn runtime(dir: &std::path::Path) -> *mut TandemRuntime {
    let config = dir.join("local.toml");
    let draft = tandem_fetch::model_path(tandem_fetch::ModelRole::Draft);
    std::fs::write(
        &config,
        format!("draft_model = {draft:?}\nmax_seq_len = 512\n"),
    )
    .unwrap();
    let config = CString::new(config.to_str().unwrap()).unwrap();
    let mut rt = ptr::null_mut();
    let mut err: *mut c_char = ptr::null_mut();
    // SAFETY: valid strings and out-pointers.
    let s = unsafe { tandem_runtime_new(config.as_ptr(), ptr::null(), &mut rt, &mut err) };
    assert_eq!(s, TandemStatus::Ok, "{}", message(err));
    rt
}

fn message(err: *mut c_char) -> String {
    if err.is_null() {
        return String::new();
    }
    // SAFETY: a string the library returned; freed once.
    unsafe {
        let m = CStr::from_ptr(err).to_string_lossy().into_owned();
        tandem_string_free(err);
        m
    }
}

unsafe extern "C" fn collect(
    piece: *const c_char,
    len: usize,
    _status: TandemTokenStatus,
    user: *mut c_void,
) -> bool {
    // SAFETY: user is the String below; the piece is `len` valid bytes.
    unsafe {
        let out = &mut *(user as *mut String);
        let bytes = std::slice::from_raw_parts(piece as *const u8, len);
        out.push_str(&String::from_utf8_lossy(bytes));
    }
    true
}

/// One generation: (status, text, the library's message).
fn generate(
    rt: *mut TandemRuntime,
    prompt: &str,
    sampling: Option<&TandemSampling>,
) -> (TandemStatus, String, String) {
    let prompt = CString::new(prompt).unwrap();
    let mut text = String::new();
    let mut err: *mut c_char = ptr::null_mut();
    // SAFETY: a live runtime, valid strings, out-pointers and callback data.
    let s = unsafe {
        tandem_generate_with(
            rt,
            prompt.as_ptr(),
            N,
            sampling.map_or(ptr::null(), |s| s as *const TandemSampling),
            Some(collect),
            &mut text as *mut String as *mut c_void,
            ptr::null_mut(),
            &mut err,
        )
    };
    (s, text, message(err))
}

fn defaults() -> TandemSampling {
    let mut s = std::mem::MaybeUninit::<TandemSampling>::uninit();
    // SAFETY: a valid out-pointer; the function writes the whole struct.
    unsafe {
        tandem_sampling_default(s.as_mut_ptr());
        s.assume_init()
    }
}

#[test]
fn per_call_sampling_is_applied_reproducible_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime(dir.path());
    let prompt = "Write a short poem about the sea.";
    let d = defaults();
    assert_eq!(d.temperature, 0.0, "the default is greedy");

    // Defaults = no sampling given = the config's (none: greedy).
    let (s, greedy, m) = generate(rt, prompt, None);
    assert_eq!(s, TandemStatus::Ok, "{m}");
    let (s, with_defaults, _) = generate(rt, prompt, Some(&d));
    assert_eq!(s, TandemStatus::Ok);
    assert_eq!(with_defaults, greedy);

    // Sampled, seeded: the same seed gives the same text, another one (most
    // likely) another; both differ from greedy.
    let hot = TandemSampling {
        temperature: 1.5,
        seed: 7,
        ..d
    };
    let (_, a, _) = generate(rt, prompt, Some(&hot));
    let (_, b, _) = generate(rt, prompt, Some(&hot));
    assert_eq!(a, b, "a seeded call reproduces itself");
    let outs: Vec<String> = (8..12)
        .map(|seed| generate(rt, prompt, Some(&TandemSampling { seed, ..hot })).1)
        .collect();
    assert!(outs.iter().any(|o| *o != a), "seeds 7..12 all gave {a:?}");
    assert!(
        std::iter::once(&a).chain(&outs).any(|o| *o != greedy),
        "temperature 1.5 always gave the greedy text"
    );

    // Invalid: refused before anything runs, naming the field.
    for (bad, field) in [
        (
            TandemSampling {
                temperature: -1.0,
                ..d
            },
            "temperature",
        ),
        (
            TandemSampling {
                presence_penalty: 3.0,
                ..d
            },
            "presence_penalty",
        ),
        (
            TandemSampling {
                frequency_penalty: f32::NAN,
                ..d
            },
            "frequency_penalty",
        ),
    ] {
        let (s, text, m) = generate(rt, prompt, Some(&bad));
        assert_eq!(s, TandemStatus::InvalidArgument, "{field}: {m}");
        assert!(m.contains(field), "{field}: {m}");
        assert!(text.is_empty());
    }

    // Structured output (`response_format`): the answer follows it; one
    // that does not parse or compile is INVALID_ARGUMENT before anything runs.
    let fmt = |json: &str| CString::new(json).unwrap();
    let yes_no = fmt(r#"{"type": "grammar", "syntax": "regex", "definition": "(yes|no)"}"#);
    let s_yn = TandemSampling {
        response_format: yes_no.as_ptr(),
        ..d
    };
    let (s, text, m) = generate(rt, prompt, Some(&s_yn));
    assert_eq!(s, TandemStatus::Ok, "{m}");
    assert!(["yes", "no"].contains(&text.as_str()), "{text:?}");
    let schema = fmt(
        r#"{"type": "json_schema", "json_schema": {"name": "ok", "strict": true, "schema":
            {"type": "object", "properties": {"ok": {"type": "boolean"}},
             "required": ["ok"], "additionalProperties": false}}}"#,
    );
    let s_schema = TandemSampling {
        response_format: schema.as_ptr(),
        ..d
    };
    let (s, text, m) = generate(rt, "Is the sea blue? Answer in JSON.", Some(&s_schema));
    assert_eq!(s, TandemStatus::Ok, "{m}");
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    assert!(v["ok"].is_boolean(), "{v}");
    for (bad, needle) in [
        (
            r#"{"type": "grammar", "syntax": "regex", "definition": "(unclosed"}"#,
            "invalid grammar",
        ),
        (r#"{"type": "json_schema"}"#, "json_schema"),
        ("not json", "not JSON"),
    ] {
        let bad = fmt(bad);
        let s_bad = TandemSampling {
            response_format: bad.as_ptr(),
            ..d
        };
        let (s, text, m) = generate(rt, prompt, Some(&s_bad));
        assert_eq!(s, TandemStatus::InvalidArgument, "{m}");
        assert!(m.contains(needle), "{needle}: {m}");
        assert!(text.is_empty());
    }

    // A conversation: a refused turn leaves the history as it was, so the
    // next turn is the same as a first turn.
    let mut c = ptr::null_mut();
    let mut err: *mut c_char = ptr::null_mut();
    // SAFETY: a live runtime, valid out-pointers.
    let s = unsafe { tandem_conversation_new(rt, &mut c, &mut err) };
    assert_eq!(s, TandemStatus::Ok);
    let msg = CString::new(prompt).unwrap();
    let send = |sampling: *const TandemSampling| {
        let mut text = String::new();
        let mut err: *mut c_char = ptr::null_mut();
        // SAFETY: a live runtime and conversation, valid pointers.
        let s = unsafe {
            tandem_conversation_send_with(
                rt,
                c,
                msg.as_ptr(),
                N,
                sampling,
                Some(collect),
                &mut text as *mut String as *mut c_void,
                ptr::null_mut(),
                &mut err,
            )
        };
        (s, text, message(err))
    };
    let bad = TandemSampling { top_p: 2.0, ..d };
    let (s, _, m) = send(&bad);
    assert_eq!(s, TandemStatus::InvalidArgument, "{m}");
    assert!(m.contains("top_p"), "{m}");
    let (s, first, m) = send(&d);
    assert_eq!(s, TandemStatus::Ok, "{m}");
    assert_eq!(
        first, greedy,
        "the refused turn left nothing in the history"
    );
    // SAFETY: the conversation and runtime are freed once, in order.
    unsafe {
        tandem_conversation_free(rt, c);
        tandem_runtime_free(rt);
    }
}
