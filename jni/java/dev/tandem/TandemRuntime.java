package dev.tandem;

import java.util.Objects;
import java.util.concurrent.locks.ReentrantReadWriteLock;

/**
 * Tandem's device runtime for Java and Kotlin: the draft model, the verifier
 * client (deadlines, circuit breaker, provisional tokens) and the privacy
 * router, behind the C ABI ({@code docs/capi.md}) through the native library
 * {@code libtandem_jni.so} ({@code docs/mobile.md}).
 *
 * <pre>{@code
 * try (TandemRuntime rt = TandemRuntime.create(configPath, modelsDir)) {
 *     Stats s = rt.generate("Write a haiku.", 64, (text, status) -> {
 *         System.out.print(text);
 *         return true;
 *     });
 * }
 * }</pre>
 *
 * <p>Multi-turn: {@link #conversation} ({@link Conversation#send} per turn,
 * reusing what the earlier turns computed).
 *
 * <p>Threads: one {@link #generate} at a time per runtime (a concurrent one
 * throws {@link TandemException} with status {@code BUSY}); {@link #cancel},
 * {@link #stats} and {@link #lastJson} from any thread at any time;
 * {@link #close} from any thread but the callback: it cancels the running
 * generation and waits for it to return. Any call after {@code close} throws
 * {@link IllegalStateException}; a second {@code close} does nothing.
 */
public final class TandemRuntime implements AutoCloseable {
    static {
        // The system property names the library file (tests, desktop JVMs);
        // an Android app ships it as jniLibs/<abi>/libtandem_jni.so.
        String path = System.getProperty("dev.tandem.library");
        if (path != null) {
            System.load(path);
        } else {
            System.loadLibrary("tandem_jni");
        }
    }

    /** Generations and the other calls hold the read lock; close the write lock. */
    private final ReentrantReadWriteLock lock = new ReentrantReadWriteLock();
    /** The C ABI's {@code TandemRuntime *}; 0 once closed. Guarded by {@link #lock}. */
    private long handle;

    private TandemRuntime(long handle) {
        this.handle = handle;
    }

    /**
     * Loads the config (TOML, fields in {@code docs/capi.md}), the privacy
     * policy and the draft model (seconds). No connection is made yet.
     *
     * @param configPath the config file
     * @param modelsDir the directory the config's relative model paths are
     *     relative to (the app's download directory); null: the config
     *     file's directory
     * @throws TandemException {@code IO} (a missing file, named), {@code CONFIG}
     *     (the field named), {@code MODEL}, ...
     */
    public static TandemRuntime create(String configPath, String modelsDir) {
        Objects.requireNonNull(configPath, "configPath");
        return new TandemRuntime(nativeNew(configPath, modelsDir));
    }

    /**
     * Generates an answer to {@code prompt} (one user message through the
     * model's chat template), calling {@code callback} with each text piece
     * on this thread. Blocks until the generation ends (end of turn,
     * {@code maxTokens}, cancel). An unreachable verifier is not an error:
     * pieces arrive {@link TokenStatus#PROVISIONAL}.
     *
     * @param maxTokens at most this many tokens; 0: the config's {@code max_tokens}
     * @param callback may be null
     * @return this generation's statistics
     * @throws TandemException {@code BUSY} while another generation runs,
     *     {@code TLS}, {@code REFUSED}, ... with the C ABI's message
     */
    public Stats generate(String prompt, int maxTokens, TokenCallback callback) {
        return generate(prompt, maxTokens, null, callback);
    }

    /**
     * {@link #generate(String, int, TokenCallback)} with this call's sampling
     * (null: the config's {@code [sampling]}).
     *
     * @throws TandemException {@code INVALID_ARGUMENT} naming the field for
     *     invalid sampling, before anything runs
     */
    public Stats generate(String prompt, int maxTokens, Sampling sampling, TokenCallback callback) {
        Objects.requireNonNull(prompt, "prompt");
        if (maxTokens < 0) {
            throw new IllegalArgumentException("maxTokens must be >= 0, got " + maxTokens);
        }
        lock.readLock().lock();
        try {
            long h = open();
            long[] counts = new long[Stats.COUNTS];
            double[] times = new double[Stats.TIMES];
            Sink sink = callback == null ? null : new Sink(callback);
            nativeGenerate(h, prompt, maxTokens, floats(sampling), longs(sampling),
                    format(sampling), sink, counts, times);
            return new Stats(counts, times);
        } finally {
            lock.readLock().unlock();
        }
    }

    /**
     * Starts a multi-turn conversation (with the config's system prompt, if
     * any): see {@link Conversation}.
     */
    public Conversation conversation() {
        lock.readLock().lock();
        try {
            return new Conversation(this, nativeConversationNew(open()));
        } finally {
            lock.readLock().unlock();
        }
    }

    /** One turn of {@code conversation} (its handle): {@link Conversation#send}. */
    Stats sendConversation(long conversation, String message, int maxTokens,
            Sampling sampling, TokenCallback callback) {
        lock.readLock().lock();
        try {
            long h = open();
            long[] counts = new long[Stats.COUNTS];
            double[] times = new double[Stats.TIMES];
            Sink sink = callback == null ? null : new Sink(callback);
            nativeConversationSend(h, conversation, message, maxTokens, floats(sampling),
                    longs(sampling), format(sampling), sink, counts, times);
            return new Stats(counts, times);
        } finally {
            lock.readLock().unlock();
        }
    }

    /** Frees a conversation's handle (its memory only once this runtime is closed). */
    void freeConversation(long conversation) {
        lock.readLock().lock();
        try {
            nativeConversationFree(handle, conversation);
        } finally {
            lock.readLock().unlock();
        }
    }

    /**
     * Stops the generation running now (from any thread, or from the
     * callback); it returns at the next token with stop reason
     * {@code CANCELLED} and the text so far. Does nothing when none runs,
     * and never reaches a later generation.
     */
    public void cancel() {
        lock.readLock().lock();
        try {
            nativeCancel(open());
        } finally {
            lock.readLock().unlock();
        }
    }

    /**
     * Reports the device's state (call it whenever the platform reports a
     * change, from any thread, also during a generation). Generations started
     * after it run with it; one running now keeps what it started with.
     *
     * @throws NullPointerException when {@code state} is null
     * @throws TandemException {@code INVALID_ARGUMENT} (nothing changes) for a
     *     battery level outside -1..=100
     */
    public void setDeviceState(DeviceState state) {
        if (state == null) {
            throw new NullPointerException("state is null");
        }
        lock.readLock().lock();
        try {
            nativeSetDeviceState(open(), state.thermal.code, state.batteryPct, state.charging,
                    state.powerSave, state.userOptOut);
        } finally {
            lock.readLock().unlock();
        }
    }

    /**
     * The statistics of the last finished generation.
     *
     * @throws TandemException {@code NO_GENERATION} if none has finished yet
     */
    public Stats stats() {
        lock.readLock().lock();
        try {
            long[] counts = new long[Stats.COUNTS];
            double[] times = new double[Stats.TIMES];
            nativeStats(open(), counts, times);
            return new Stats(counts, times);
        } finally {
            lock.readLock().unlock();
        }
    }

    /**
     * The last finished generation as JSON: route, the privacy router's
     * decision (rule, entity types, byte spans; never the text), stop, all
     * edge statistics, the verifier's check of provisional tokens
     * ({@code docs/capi.md}).
     */
    public String lastJson() {
        lock.readLock().lock();
        try {
            return nativeLastJson(open());
        } finally {
            lock.readLock().unlock();
        }
    }

    /**
     * Frees the runtime (the draft model, the verifier connections). A
     * generation running on another thread is cancelled first and waited
     * for. A second call does nothing.
     *
     * @throws IllegalStateException when called from this runtime's callback
     */
    @Override
    public void close() {
        if (lock.getReadHoldCount() > 0) {
            throw new IllegalStateException(
                    "TandemRuntime.close() called from inside this runtime's callback");
        }
        lock.readLock().lock();
        try {
            if (handle != 0) {
                nativeCancel(handle);
            }
        } finally {
            lock.readLock().unlock();
        }
        lock.writeLock().lock();
        try {
            if (handle != 0) {
                nativeFree(handle);
                handle = 0;
            }
        } finally {
            lock.writeLock().unlock();
        }
    }

    /** Whether {@link #close} has run. */
    public boolean isClosed() {
        lock.readLock().lock();
        try {
            return handle == 0;
        } finally {
            lock.readLock().unlock();
        }
    }

    /** The native library's version ({@code "0.1.0"}). */
    public static String version() {
        return nativeVersion();
    }

    private static float[] floats(Sampling s) {
        return s == null ? null : s.floats();
    }

    private static long[] longs(Sampling s) {
        return s == null ? null : s.longs();
    }

    private static String format(Sampling s) {
        return s == null ? null : s.responseFormat;
    }

    private long open() {
        if (handle == 0) {
            throw new IllegalStateException("TandemRuntime is closed");
        }
        return handle;
    }

    /** What the native side calls per piece: the status code becomes the enum. */
    private static final class Sink {
        private final TokenCallback callback;

        Sink(TokenCallback callback) {
            this.callback = callback;
        }

        @SuppressWarnings("unused") // called from native code
        boolean piece(String text, int status) {
            return callback.onToken(text, TokenStatus.fromCode(status));
        }
    }

    private static native long nativeNew(String configPath, String modelsDir);

    private static native void nativeGenerate(long handle, String prompt, int maxTokens,
            float[] samplingFloats, long[] samplingLongs, String responseFormat, Sink sink,
            long[] counts, double[] times);

    private static native long nativeConversationNew(long handle);

    private static native void nativeConversationSend(long handle, long conversation,
            String message, int maxTokens, float[] samplingFloats, long[] samplingLongs,
            String responseFormat, Sink sink, long[] counts, double[] times);

    private static native void nativeConversationFree(long handle, long conversation);

    private static native void nativeCancel(long handle);

    private static native void nativeStats(long handle, long[] counts, double[] times);

    private static native void nativeSetDeviceState(
            long handle,
            int thermal,
            int batteryPct,
            boolean charging,
            boolean powerSave,
            boolean userOptOut);

    private static native String nativeLastJson(long handle);

    private static native void nativeFree(long handle);

    private static native String nativeVersion();
}
