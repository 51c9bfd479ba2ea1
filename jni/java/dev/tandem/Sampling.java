package dev.tandem;

/**
 * The sampling of one call ({@link TandemRuntime#generate(String, int, Sampling,
 * TokenCallback)}, {@link Conversation#send(String, int, Sampling, TokenCallback)}),
 * in place of the config's {@code [sampling]}: the C ABI's
 * {@code TandemSampling} ({@code docs/capi.md}). Immutable; start from
 * {@link #GREEDY} and change what you need:
 *
 * <pre>{@code
 * Sampling s = Sampling.GREEDY.withTemperature(0.8f).withTopP(0.95f).withSeed(42);
 * }</pre>
 *
 * Invalid values (a negative temperature, a penalty outside [-2, 2], ...) are
 * refused by the call with {@link TandemException} {@code INVALID_ARGUMENT}
 * naming the field, before anything runs.
 */
public final class Sampling {
    /** Greedy, no penalties: the defaults. */
    public static final Sampling GREEDY = new Sampling(0f, 0, 1f, 1f, 0f, 0f, 0L, null);

    /** 0: greedy; else the softmax temperature. */
    public final float temperature;
    /** The most likely tokens kept (0: all). */
    public final int topK;
    /** Nucleus probability (1: off). */
    public final float topP;
    /** llama.cpp's repeat penalty (1: off). */
    public final float repetitionPenalty;
    /** OpenAI's presence and frequency penalties, each in [-2, 2]. */
    public final float presencePenalty;
    public final float frequencyPenalty;
    /** The same seed, prompt and settings give the same tokens (an unsigned 64-bit value). */
    public final long seed;
    /**
     * Structured output: an OpenAI {@code response_format} object as JSON text
     * ({@code {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}},
     * {@code {"type": "json_object"}}, or {@code {"type": "grammar", "syntax":
     * "lark"|"regex", "definition": ...}}); null: none. Every token then
     * follows it; one that does not parse or compile is refused before
     * anything runs.
     */
    public final String responseFormat;

    private Sampling(float temperature, int topK, float topP, float repetitionPenalty,
            float presencePenalty, float frequencyPenalty, long seed, String responseFormat) {
        this.temperature = temperature;
        this.topK = topK;
        this.topP = topP;
        this.repetitionPenalty = repetitionPenalty;
        this.presencePenalty = presencePenalty;
        this.frequencyPenalty = frequencyPenalty;
        this.seed = seed;
        this.responseFormat = responseFormat;
    }

    public Sampling withTemperature(float v) {
        return new Sampling(v, topK, topP, repetitionPenalty, presencePenalty, frequencyPenalty, seed, responseFormat);
    }

    public Sampling withTopK(int v) {
        if (v < 0) {
            throw new IllegalArgumentException("topK must be >= 0, got " + v);
        }
        return new Sampling(temperature, v, topP, repetitionPenalty, presencePenalty, frequencyPenalty, seed, responseFormat);
    }

    public Sampling withTopP(float v) {
        return new Sampling(temperature, topK, v, repetitionPenalty, presencePenalty, frequencyPenalty, seed, responseFormat);
    }

    public Sampling withRepetitionPenalty(float v) {
        return new Sampling(temperature, topK, topP, v, presencePenalty, frequencyPenalty, seed, responseFormat);
    }

    public Sampling withPresencePenalty(float v) {
        return new Sampling(temperature, topK, topP, repetitionPenalty, v, frequencyPenalty, seed, responseFormat);
    }

    public Sampling withFrequencyPenalty(float v) {
        return new Sampling(temperature, topK, topP, repetitionPenalty, presencePenalty, v, seed, responseFormat);
    }

    public Sampling withSeed(long v) {
        return new Sampling(temperature, topK, topP, repetitionPenalty, presencePenalty, frequencyPenalty, v, responseFormat);
    }

    /** This sampling with the response format {@code json} (null: none). */
    public Sampling withResponseFormat(String json) {
        return new Sampling(temperature, topK, topP, repetitionPenalty, presencePenalty,
                frequencyPenalty, seed, json);
    }

    /** The float fields in the order the native library reads them. */
    float[] floats() {
        return new float[] {temperature, topP, repetitionPenalty, presencePenalty, frequencyPenalty};
    }

    /** The integer fields in the order the native library reads them. */
    long[] longs() {
        return new long[] {topK, seed};
    }

    @Override
    public String toString() {
        return "temperature=" + temperature + " top_k=" + topK + " top_p=" + topP
                + " repetition_penalty=" + repetitionPenalty + " presence_penalty=" + presencePenalty
                + " frequency_penalty=" + frequencyPenalty + " seed=" + Long.toUnsignedString(seed)
                + (responseFormat == null ? "" : " response_format=" + responseFormat);
    }
}
