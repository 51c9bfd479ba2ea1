package dev.tandem;

import java.util.Objects;

/**
 * A multi-turn conversation on a {@link TandemRuntime} (the C ABI's
 * {@code tandem_conversation_*}, {@code docs/capi.md}): each {@link #send}
 * adds a user message and generates the reply, which joins the history. The
 * runtime reuses what earlier turns computed: the draft prefills only the new
 * tokens and the verifier continues its kept session
 * ({@link Stats#draftReusedTokens}, {@link Stats#verifierReusedTokens}). When
 * the history outgrows the context, the config's
 * {@code [edge.conversations] context_policy} applies ({@code refuse}:
 * {@code CONTEXT_TOO_LONG}; {@code drop_oldest}). On an error the history is
 * as it was.
 *
 * <pre>{@code
 * try (Conversation c = rt.conversation()) {
 *     c.send("Write a haiku.", 64, (text, status) -> true);
 *     c.send("Now one about the sea.", 64, (text, status) -> true);
 * }
 * }</pre>
 *
 * <p>Threads: one {@link #send} at a time per conversation (another thread
 * waits for it; {@link TandemRuntime#cancel} stops it), and one generation at
 * a time per runtime ({@code BUSY} otherwise). {@link #close} frees what the
 * runtime keeps for it; it waits for a running {@code send} on another
 * thread and is refused from inside this conversation's callback. Any call
 * after {@code close} throws {@link IllegalStateException}; a second
 * {@code close} does nothing. Closing the runtime first is allowed: the
 * conversation can then only be closed.
 */
public final class Conversation implements AutoCloseable {
    private final TandemRuntime runtime;
    /** The C ABI's {@code TandemConversation *}; 0 once closed. Guarded by this. */
    private long handle;
    /** A send runs on the thread holding this object's monitor. */
    private boolean sending;

    Conversation(TandemRuntime runtime, long handle) {
        this.runtime = runtime;
        this.handle = handle;
    }

    /**
     * Sends the next user message and generates the reply, calling
     * {@code callback} with each text piece on this thread.
     *
     * @param maxTokens at most this many tokens; 0: the config's {@code max_tokens}
     * @param callback may be null
     * @return this turn's statistics
     * @throws TandemException {@code BUSY}, {@code CONTEXT_TOO_LONG}, ... (the
     *     history is then as it was)
     */
    public Stats send(String message, int maxTokens, TokenCallback callback) {
        return send(message, maxTokens, null, callback);
    }

    /**
     * {@link #send(String, int, TokenCallback)} with this turn's sampling
     * (null: the config's {@code [sampling]}); invalid sampling is
     * {@code INVALID_ARGUMENT} and the history is as it was.
     */
    public synchronized Stats send(String message, int maxTokens, Sampling sampling,
            TokenCallback callback) {
        Objects.requireNonNull(message, "message");
        if (maxTokens < 0) {
            throw new IllegalArgumentException("maxTokens must be >= 0, got " + maxTokens);
        }
        if (sending) {
            throw new IllegalStateException(
                    "Conversation.send() called from inside this conversation's callback");
        }
        sending = true;
        try {
            return runtime.sendConversation(open(), message, maxTokens, sampling, callback);
        } finally {
            sending = false;
        }
    }

    /** Frees the conversation and what the runtime keeps for it. */
    @Override
    public synchronized void close() {
        if (sending) {
            throw new IllegalStateException(
                    "Conversation.close() called from inside this conversation's callback");
        }
        if (handle != 0) {
            runtime.freeConversation(handle);
            handle = 0;
        }
    }

    /** Whether {@link #close} has run. */
    public synchronized boolean isClosed() {
        return handle == 0;
    }

    private long open() {
        if (handle == 0) {
            throw new IllegalStateException("Conversation is closed");
        }
        return handle;
    }
}
