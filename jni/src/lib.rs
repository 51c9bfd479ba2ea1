//! `tandem-jni`: the native side of the Java/Kotlin class
//! `dev.tandem.TandemRuntime` (`jni/java/dev/tandem/`), for Android apps and
//! desktop JVMs.
//!
//! It is glue only: every native method calls the C ABI's `extern "C"`
//! functions (`tandem-capi`, `docs/capi.md`) and translates between JNI and
//! C. One `libtandem_jni.so` per Android ABI (built by cargo-ndk) carries the
//! whole device library, so the app ships a single native file; the C ABI's
//! `tandem_*` symbols are exported from it too. Why Rust and the `jni` crate
//! rather than a C file over `jni.h`: `docs/mobile.md`.
//!
//! Rules the glue keeps:
//! * A C ABI error becomes a `dev.tandem.TandemException` carrying the C
//!   status code and the C ABI's message.
//! * The per-piece callback calls the Java `Sink.piece(String, int)` on the
//!   thread that called `generate`; a Java exception thrown there stops the
//!   generation (the callback returns false) and stays pending, so it
//!   propagates out of `generate` unchanged.
//! * Nothing unwinds into the JVM: every entry point and the callback run
//!   inside `catch_unwind`; a panic becomes a `TandemException` (`PANIC`).
//! * Handles: the Java class owns the `TandemRuntime *` as a `long`, guards
//!   it with a read-write lock and never passes one it has closed, so
//!   use after close is a Java `IllegalStateException`, never a native call.

use std::ffi::{c_char, c_void, CStr, CString};
use std::mem::MaybeUninit;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use jni::objects::{
    JClass, JDoubleArray, JFloatArray, JLongArray, JObject, JString, JThrowable, JValue,
};
use jni::refs::Reference as _;
use jni::strings::JNIString;
use jni::sys::{jboolean, jint, jlong, jstring};
use jni::{jni_sig, jni_str, Env, EnvUnowned, Outcome};
use tandem_capi::{
    tandem_cancel, tandem_conversation_free, tandem_conversation_new,
    tandem_conversation_send_with, tandem_generate_with, tandem_runtime_free,
    tandem_runtime_last_json, tandem_runtime_new, tandem_runtime_set_device_state,
    tandem_runtime_stats, tandem_status_name, tandem_string_free, tandem_version,
    TandemConversation, TandemDeviceState, TandemRuntime, TandemSampling, TandemStats,
    TandemStatus, TandemTokenStatus,
};

/// The lengths of the arrays `dev.tandem.Stats` reads (its `COUNTS`, `TIMES`).
const COUNTS: usize = 19;
const TIMES: usize = 5;

/// A Java exception is pending: return to the JVM at once.
struct Thrown;

/// Throws `dev.tandem.TandemException(code, message)`.
fn throw_tandem(env: &mut Env, status: TandemStatus, message: &str) -> Thrown {
    let built = env.new_string(message).and_then(|m| {
        env.new_object(
            jni_str!("dev/tandem/TandemException"),
            jni_sig!("(ILjava/lang/String;)V"),
            &[JValue::Int(status as jint), JValue::Object(&m)],
        )
        .and_then(|e| env.cast_local::<JThrowable>(e))
    });
    match built {
        Ok(e) => {
            // If even throwing fails, a JNI exception is pending already.
            let _ = env.throw(e);
        }
        Err(_) => {
            // The failed call left its own exception (e.g. NoClassDefFoundError)
            // pending; if it did not, say what happened.
            if !env.exception_check() {
                let _ = env.throw_new(
                    jni_str!("java/lang/IllegalStateException"),
                    JNIString::from(message),
                );
            }
        }
    }
    Thrown
}

/// Throws a Java exception of class `class` (e.g. IllegalArgumentException).
fn throw_java(env: &mut Env, class: &jni::strings::JNIStr, message: &str) -> Thrown {
    let _ = env.throw_new(class, JNIString::from(message));
    Thrown
}

/// Takes a string the C ABI returned through `char **` (freeing it).
fn take_c_string(s: *mut c_char) -> Option<String> {
    if s.is_null() {
        return None;
    }
    // SAFETY: the C ABI returned a NUL-terminated string it allocated; it is
    // read once and freed with the C ABI's own free function.
    unsafe {
        let text = CStr::from_ptr(s).to_string_lossy().into_owned();
        tandem_string_free(s);
        Some(text)
    }
}

/// The C ABI's name of a status code (`"IO"`, ...).
fn status_name(status: TandemStatus) -> String {
    // SAFETY: tandem_status_name returns a static NUL-terminated string.
    unsafe { CStr::from_ptr(tandem_status_name(status as i32)) }
        .to_string_lossy()
        .into_owned()
}

/// A non-OK status becomes a `TandemException` with the C ABI's message.
fn check(env: &mut Env, status: TandemStatus, error_message: *mut c_char) -> Result<(), Thrown> {
    let message = take_c_string(error_message);
    if status == TandemStatus::Ok {
        return Ok(());
    }
    let message = message.unwrap_or_else(|| status_name(status));
    Err(throw_tandem(env, status, &message))
}

/// A Java string as a C string (`IllegalArgumentException` if it holds NUL,
/// which C would silently cut at).
fn c_string(env: &mut Env, s: &JString, what: &str) -> Result<CString, Thrown> {
    if s.is_null() {
        return Err(throw_java(
            env,
            jni_str!("java/lang/NullPointerException"),
            &format!("{what} is null"),
        ));
    }
    let text: String = match s.try_to_string(env) {
        Ok(t) => t,
        Err(_) => return Err(Thrown), // the JVM's exception is pending
    };
    CString::new(text).map_err(|_| {
        throw_java(
            env,
            jni_str!("java/lang/IllegalArgumentException"),
            &format!("{what} contains a NUL character"),
        )
    })
}

/// The runtime behind a handle the Java class passed (never 0: it checks).
fn runtime(handle: jlong) -> *const TandemRuntime {
    handle as usize as *const TandemRuntime
}

/// Runs `f` with the native method's environment; a panic becomes a
/// `TandemException` (`PANIC`) and `fallback`, as does a Java exception `f`
/// left pending (`Thrown`).
fn guard<'l, T>(
    env: &mut EnvUnowned<'l>,
    fallback: T,
    f: impl FnOnce(&mut Env<'l>) -> Result<T, Thrown>,
) -> T {
    // Not `with_env`'s own catch: a panic is reported as the C ABI reports one.
    let outcome = env
        .with_env_no_catch(|env| -> jni::errors::Result<Option<T>> {
            Ok(match catch_unwind(AssertUnwindSafe(|| f(env))) {
                Ok(Ok(v)) => Some(v),
                Ok(Err(Thrown)) => None,
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown panic".into());
                    throw_tandem(
                        env,
                        TandemStatus::Panic,
                        &format!("tandem-jni panicked: {what}"),
                    );
                    None
                }
            })
        })
        .into_outcome();
    match outcome {
        Outcome::Ok(Some(v)) => v,
        _ => fallback,
    }
}

/// `TandemStats` as the two arrays `dev.tandem.Stats(long[], double[])` reads.
fn stats_arrays(s: &TandemStats) -> ([jlong; COUNTS], [f64; TIMES]) {
    let n = |v: u64| jlong::try_from(v).unwrap_or(jlong::MAX);
    (
        [
            jlong::from(s.route as i32),
            jlong::from(s.stop as i32),
            n(s.prompt_tokens),
            n(s.generated_tokens),
            n(s.verified_tokens),
            n(s.provisional_tokens),
            n(s.local_tokens),
            n(s.rounds),
            n(s.drafted),
            n(s.accepted),
            n(s.verifier_passes),
            n(s.breaker_opens),
            n(s.provisional_checked),
            n(s.provisional_mismatched),
            n(s.draft_reused_tokens),
            n(s.verifier_reused_tokens),
            n(s.dropped_messages),
            jlong::from(s.draft_threads),
            jlong::from(s.k_cap),
        ],
        [
            s.acceptance_rate,
            s.rtt_mean_ms,
            s.ttft_ms,
            s.total_ms,
            s.tokens_per_s,
        ],
    )
}

/// Copies `stats` into the Java arrays.
fn write_stats(
    env: &mut Env,
    stats: &TandemStats,
    counts: &JLongArray,
    times: &JDoubleArray,
) -> Result<(), Thrown> {
    let (c, t) = stats_arrays(stats);
    counts
        .set_region(env, 0, &c)
        .and_then(|()| times.set_region(env, 0, &t))
        .map_err(|_| Thrown) // ArrayIndexOutOfBoundsException is pending
}

/// What the C callback needs to reach the Java sink.
struct PieceSink<'a, 'l> {
    env: &'a mut Env<'l>,
    sink: &'a JObject<'l>,
    /// The Java side threw (or a JNI call failed): stop, leave it pending.
    failed: bool,
}

/// The C ABI's `TandemTokenCallback`: one piece to `Sink.piece(String, int)`.
unsafe extern "C" fn on_piece(
    piece: *const c_char,
    piece_len: usize,
    status: TandemTokenStatus,
    user_data: *mut c_void,
) -> bool {
    // SAFETY: user_data is the PieceSink that nativeGenerate passed with this
    // callback, alive for the whole tandem_generate call, which calls back on
    // the same thread (so the Env is valid here).
    let sink = unsafe { &mut *(user_data as *mut PieceSink<'_, '_>) };
    if sink.failed {
        return false;
    }
    // SAFETY: the C ABI passes `piece_len` valid bytes, valid during the call.
    let bytes = unsafe { std::slice::from_raw_parts(piece as *const u8, piece_len) };
    let go_on = catch_unwind(AssertUnwindSafe(|| {
        let text = String::from_utf8_lossy(bytes);
        let jtext = sink.env.new_string(&*text).ok()?;
        let r = sink.env.call_method(
            sink.sink,
            jni_str!("piece"),
            jni_sig!("(Ljava/lang/String;I)Z"),
            &[JValue::Object(&jtext), JValue::Int(status as jint)],
        );
        // One local reference per piece: free it, a long generation would
        // otherwise fill the JVM's local reference table.
        sink.env.delete_local_ref(jtext);
        r.and_then(|v| v.z()).ok()
    }));
    match go_on {
        Ok(Some(b)) => b,
        // A Java exception is pending (thrown by the callback, or by JNI).
        Ok(None) | Err(_) => {
            sink.failed = true;
            false
        }
    }
}

/// `TandemRuntime.nativeNew(String configPath, String modelsDir)`.
#[no_mangle]
pub extern "system" fn Java_dev_tandem_TandemRuntime_nativeNew<'l>(
    mut env: EnvUnowned<'l>,
    _class: JClass<'l>,
    config_path: JString<'l>,
    models_dir: JString<'l>,
) -> jlong {
    guard(&mut env, 0, |env| {
        let config = c_string(env, &config_path, "configPath")?;
        let models = if models_dir.is_null() {
            None
        } else {
            Some(c_string(env, &models_dir, "modelsDir")?)
        };
        let mut rt: *mut TandemRuntime = ptr::null_mut();
        let mut err: *mut c_char = ptr::null_mut();
        // SAFETY: NUL-terminated strings alive for the call, valid out-pointers.
        let status = unsafe {
            tandem_runtime_new(
                config.as_ptr(),
                models.as_ref().map_or(ptr::null(), |m| m.as_ptr()),
                &mut rt,
                &mut err,
            )
        };
        check(env, status, err)?;
        Ok(rt as usize as jlong)
    })
}

/// `maxTokens` as the C ABI's `u32` (`IllegalArgumentException` below 0).
fn max_tokens_arg(env: &mut Env, max_tokens: jint) -> Result<u32, Thrown> {
    u32::try_from(max_tokens).map_err(|_| {
        throw_java(
            env,
            jni_str!("java/lang/IllegalArgumentException"),
            &format!("maxTokens must be >= 0, got {max_tokens}"),
        )
    })
}

/// The sampling arrays `dev.tandem.Sampling` passes (`floats()`: temperature,
/// top_p, repetition, presence, frequency; `longs()`: top_k, seed), or None
/// when both are null (the config's); its `responseFormat` is `format` (the
/// C string must outlive the call).
fn sampling_arg(
    env: &mut Env,
    floats: &JFloatArray,
    longs: &JLongArray,
    format: &Option<CString>,
) -> Result<Option<TandemSampling>, Thrown> {
    if floats.is_null() || longs.is_null() {
        return Ok(None);
    }
    let mut f = [0f32; 5];
    let mut l = [0i64; 2];
    floats
        .get_region(env, 0, &mut f)
        .and_then(|()| longs.get_region(env, 0, &mut l))
        .map_err(|_| Thrown)?; // ArrayIndexOutOfBoundsException is pending
    let top_k = u32::try_from(l[0]).map_err(|_| {
        throw_java(
            env,
            jni_str!("java/lang/IllegalArgumentException"),
            &format!("topK must be in 0..=2^32-1, got {}", l[0]),
        )
    })?;
    Ok(Some(TandemSampling {
        temperature: f[0],
        top_k,
        top_p: f[1],
        repetition_penalty: f[2],
        presence_penalty: f[3],
        frequency_penalty: f[4],
        seed: l[1] as u64, // Java's long carries the unsigned seed's bits
        response_format: format.as_ref().map_or(ptr::null(), |f| f.as_ptr()),
    }))
}

/// A `*const TandemSampling` for the C ABI (NULL: the config's).
fn sampling_ptr(s: &Option<TandemSampling>) -> *const TandemSampling {
    s.as_ref()
        .map_or(ptr::null(), |s| s as *const TandemSampling)
}

/// Runs one streamed C ABI call, `call(callback, user_data, stats_out,
/// error_message)` (`tandem_generate`, `tandem_conversation_send`), with
/// `sink` (may be null) receiving the pieces, then writes the statistics
/// into `counts`/`times`. A callback's Java exception propagates unchanged.
fn streamed<'l>(
    env: &mut Env<'l>,
    sink: &JObject<'l>,
    counts: &JLongArray<'l>,
    times: &JDoubleArray<'l>,
    call: impl FnOnce(
        tandem_capi::TandemTokenCallback,
        *mut c_void,
        *mut TandemStats,
        *mut *mut c_char,
    ) -> TandemStatus,
) -> Result<(), Thrown> {
    let mut stats = MaybeUninit::<TandemStats>::uninit();
    let mut err: *mut c_char = ptr::null_mut();
    let has_sink = !sink.is_null();
    let mut piece_sink = PieceSink {
        env: &mut *env,
        sink,
        failed: false,
    };
    let callback = if has_sink {
        Some(on_piece as unsafe extern "C" fn(_, _, _, _) -> bool)
    } else {
        None
    };
    let status = call(
        callback,
        &mut piece_sink as *mut PieceSink<'_, '_> as *mut c_void,
        stats.as_mut_ptr(),
        &mut err,
    );
    if piece_sink.failed {
        // The callback's exception propagates; the generation stopped.
        let _ = take_c_string(err);
        return Err(Thrown);
    }
    check(env, status, err)?;
    // SAFETY: on OK the C ABI wrote the whole struct.
    let stats = unsafe { stats.assume_init() };
    write_stats(env, &stats, counts, times)
}

/// `Sampling.responseFormat` (null: none).
fn format_arg(env: &mut Env, s: &JString) -> Result<Option<CString>, Thrown> {
    if s.is_null() {
        return Ok(None);
    }
    c_string(env, s, "responseFormat").map(Some)
}

/// `TandemRuntime.nativeGenerate(long, String, int, float[], long[], String,
/// Sink, long[], double[])`.
#[no_mangle]
#[allow(clippy::too_many_arguments)] // the Java method's parameters
pub extern "system" fn Java_dev_tandem_TandemRuntime_nativeGenerate<'l>(
    mut env: EnvUnowned<'l>,
    _class: JClass<'l>,
    handle: jlong,
    prompt: JString<'l>,
    max_tokens: jint,
    sampling_floats: JFloatArray<'l>,
    sampling_longs: JLongArray<'l>,
    response_format: JString<'l>,
    sink: JObject<'l>,
    counts: JLongArray<'l>,
    times: JDoubleArray<'l>,
) {
    guard(&mut env, (), |env| {
        let prompt = c_string(env, &prompt, "prompt")?;
        let max_tokens = max_tokens_arg(env, max_tokens)?;
        let format = format_arg(env, &response_format)?;
        let sampling = sampling_arg(env, &sampling_floats, &sampling_longs, &format)?;
        streamed(env, &sink, &counts, &times, |cb, user, stats, err| {
            // SAFETY: the handle is a live runtime (the Java class checks),
            // the strings and out-pointers are valid for the call, and user
            // is the PieceSink that on_piece expects.
            unsafe {
                tandem_generate_with(
                    runtime(handle),
                    prompt.as_ptr(),
                    max_tokens,
                    sampling_ptr(&sampling),
                    cb,
                    user,
                    stats,
                    err,
                )
            }
        })
    })
}

/// `TandemRuntime.nativeConversationNew(long)`: a `TandemConversation *`.
#[no_mangle]
pub extern "system" fn Java_dev_tandem_TandemRuntime_nativeConversationNew<'l>(
    mut env: EnvUnowned<'l>,
    _class: JClass<'l>,
    handle: jlong,
) -> jlong {
    guard(&mut env, 0, |env| {
        let mut c: *mut TandemConversation = ptr::null_mut();
        let mut err: *mut c_char = ptr::null_mut();
        // SAFETY: a live runtime (the Java class checks), valid out-pointers.
        let status = unsafe { tandem_conversation_new(runtime(handle), &mut c, &mut err) };
        check(env, status, err)?;
        Ok(c as usize as jlong)
    })
}

/// `TandemRuntime.nativeConversationSend(long, long, String, int, float[],
/// long[], String, Sink, long[], double[])`.
#[no_mangle]
#[allow(clippy::too_many_arguments)] // the Java method's parameters
pub extern "system" fn Java_dev_tandem_TandemRuntime_nativeConversationSend<'l>(
    mut env: EnvUnowned<'l>,
    _class: JClass<'l>,
    handle: jlong,
    conversation: jlong,
    message: JString<'l>,
    max_tokens: jint,
    sampling_floats: JFloatArray<'l>,
    sampling_longs: JLongArray<'l>,
    response_format: JString<'l>,
    sink: JObject<'l>,
    counts: JLongArray<'l>,
    times: JDoubleArray<'l>,
) {
    guard(&mut env, (), |env| {
        let message = c_string(env, &message, "message")?;
        let max_tokens = max_tokens_arg(env, max_tokens)?;
        let format = format_arg(env, &response_format)?;
        let sampling = sampling_arg(env, &sampling_floats, &sampling_longs, &format)?;
        let conversation = conversation as usize as *mut TandemConversation;
        streamed(env, &sink, &counts, &times, |cb, user, stats, err| {
            // SAFETY: a live runtime and one of its live conversations (the
            // Java classes check both), valid strings and out-pointers, and
            // user is the PieceSink that on_piece expects.
            unsafe {
                tandem_conversation_send_with(
                    runtime(handle),
                    conversation,
                    message.as_ptr(),
                    max_tokens,
                    sampling_ptr(&sampling),
                    cb,
                    user,
                    stats,
                    err,
                )
            }
        })
    })
}

/// `TandemRuntime.nativeConversationFree(long, long)`: `handle` 0 when the
/// runtime is closed already (only the conversation's memory goes then).
#[no_mangle]
pub extern "system" fn Java_dev_tandem_TandemRuntime_nativeConversationFree<'l>(
    mut env: EnvUnowned<'l>,
    _class: JClass<'l>,
    handle: jlong,
    conversation: jlong,
) {
    guard(&mut env, (), |_env| {
        // SAFETY: NULL or a live runtime; a live conversation of it, freed
        // once (the Java class forgets the handle).
        unsafe {
            tandem_conversation_free(
                runtime(handle),
                conversation as usize as *mut TandemConversation,
            )
        };
        Ok(())
    })
}

/// `TandemRuntime.nativeCancel(long)`.
#[no_mangle]
pub extern "system" fn Java_dev_tandem_TandemRuntime_nativeCancel<'l>(
    mut env: EnvUnowned<'l>,
    _class: JClass<'l>,
    handle: jlong,
) {
    guard(&mut env, (), |env| {
        // SAFETY: a live runtime (the Java class checks).
        let status = unsafe { tandem_cancel(runtime(handle)) };
        check(env, status, ptr::null_mut())
    })
}

/// `TandemRuntime.nativeStats(long, long[], double[])`.
#[no_mangle]
pub extern "system" fn Java_dev_tandem_TandemRuntime_nativeStats<'l>(
    mut env: EnvUnowned<'l>,
    _class: JClass<'l>,
    handle: jlong,
    counts: JLongArray<'l>,
    times: JDoubleArray<'l>,
) {
    guard(&mut env, (), |env| {
        let mut stats = MaybeUninit::<TandemStats>::uninit();
        // SAFETY: a live runtime, a valid out-pointer.
        let status = unsafe { tandem_runtime_stats(runtime(handle), stats.as_mut_ptr()) };
        if status == TandemStatus::NoGeneration {
            return Err(throw_tandem(
                env,
                status,
                "no generation has finished on this runtime yet",
            ));
        }
        check(env, status, ptr::null_mut())?;
        // SAFETY: on OK the C ABI wrote the whole struct.
        let stats = unsafe { stats.assume_init() };
        write_stats(env, &stats, &counts, &times)
    })
}

/// `TandemRuntime.nativeSetDeviceState(long, int, int, boolean, boolean, boolean)`.
#[no_mangle]
pub extern "system" fn Java_dev_tandem_TandemRuntime_nativeSetDeviceState<'l>(
    mut env: EnvUnowned<'l>,
    _class: JClass<'l>,
    handle: jlong,
    thermal: jint,
    battery_pct: jint,
    charging: jboolean,
    power_save: jboolean,
    user_opt_out: jboolean,
) {
    guard(&mut env, (), |env| {
        let state = TandemDeviceState {
            thermal,
            battery_pct,
            charging,
            power_save,
            user_opt_out,
        };
        let mut err: *mut c_char = ptr::null_mut();
        // SAFETY: a live runtime (the Java class checks), a valid state and
        // out-pointer.
        let status = unsafe { tandem_runtime_set_device_state(runtime(handle), &state, &mut err) };
        check(env, status, err)
    })
}

/// `TandemRuntime.nativeLastJson(long)`.
#[no_mangle]
pub extern "system" fn Java_dev_tandem_TandemRuntime_nativeLastJson<'l>(
    mut env: EnvUnowned<'l>,
    _class: JClass<'l>,
    handle: jlong,
) -> jstring {
    guard(&mut env, ptr::null_mut(), |env| {
        let mut json: *mut c_char = ptr::null_mut();
        let mut err: *mut c_char = ptr::null_mut();
        // SAFETY: a live runtime, valid out-pointers.
        let status = unsafe { tandem_runtime_last_json(runtime(handle), &mut json, &mut err) };
        check(env, status, err)?;
        let json = take_c_string(json).unwrap_or_default();
        match env.new_string(json) {
            Ok(s) => Ok(s.into_raw()),
            Err(_) => Err(Thrown),
        }
    })
}

/// `TandemRuntime.nativeFree(long)`.
#[no_mangle]
pub extern "system" fn Java_dev_tandem_TandemRuntime_nativeFree<'l>(
    mut env: EnvUnowned<'l>,
    _class: JClass<'l>,
    handle: jlong,
) {
    guard(&mut env, (), |_| {
        // SAFETY: the Java class calls this once, under its write lock (no
        // other call on the runtime is running), then forgets the handle.
        unsafe { tandem_runtime_free(runtime(handle) as *mut TandemRuntime) };
        Ok(())
    })
}

/// `TandemRuntime.nativeVersion()`.
#[no_mangle]
pub extern "system" fn Java_dev_tandem_TandemRuntime_nativeVersion<'l>(
    mut env: EnvUnowned<'l>,
    _class: JClass<'l>,
) -> jstring {
    guard(&mut env, ptr::null_mut(), |env| {
        // SAFETY: a static NUL-terminated string.
        let v = unsafe { CStr::from_ptr(tandem_version()) }.to_string_lossy();
        match env.new_string(&*v) {
            Ok(s) => Ok(s.into_raw()),
            Err(_) => Err(Thrown),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_capi::{TandemRoute, TandemStopReason};

    fn zero_stats() -> TandemStats {
        TandemStats {
            route: TandemRoute::Speculative,
            stop: TandemStopReason::Cancelled,
            prompt_tokens: 0,
            generated_tokens: 0,
            verified_tokens: 0,
            provisional_tokens: 0,
            local_tokens: 0,
            rounds: 0,
            drafted: 0,
            accepted: 0,
            acceptance_rate: 0.0,
            verifier_passes: 0,
            breaker_opens: 0,
            provisional_checked: 0,
            provisional_mismatched: 0,
            rtt_mean_ms: 0.0,
            ttft_ms: 0.0,
            total_ms: 0.0,
            tokens_per_s: 0.0,
            draft_reused_tokens: 0,
            verifier_reused_tokens: 0,
            dropped_messages: 0,
            draft_threads: 0,
            k_cap: 0,
        }
    }

    #[test]
    fn stats_arrays_keep_the_order_the_java_class_reads() {
        let s = TandemStats {
            prompt_tokens: 2,
            generated_tokens: 3,
            dropped_messages: 16,
            acceptance_rate: 0.5,
            tokens_per_s: 9.0,
            ..zero_stats()
        };
        let (c, t) = stats_arrays(&s);
        assert_eq!((c[0], c[1]), (2, 3), "route, stop codes");
        assert_eq!((c[2], c[3], c[16]), (2, 3, 16));
        let device = TandemStats {
            draft_threads: 2,
            k_cap: 1,
            ..zero_stats()
        };
        assert_eq!(
            (stats_arrays(&device).0[17], stats_arrays(&device).0[18]),
            (2, 1)
        );
        assert_eq!((t[0], t[4]), (0.5, 9.0));
        // Counts past i64 saturate instead of wrapping negative.
        let big = TandemStats {
            rounds: u64::MAX,
            ..zero_stats()
        };
        assert_eq!(stats_arrays(&big).0[7], jlong::MAX);
    }
}
