package dev.tandem;

/** Statistics of one generation (the C ABI's {@code TandemStats}); counts are tokens. */
public final class Stats {
    /** Where a generation ran. */
    public enum Route {
        /** No verifier is configured: the draft model answered on the device. */
        LOCAL_NO_VERIFIER,
        /** The privacy router kept the prompt on the device (nothing was sent). */
        LOCAL_BY_ROUTER,
        /** Speculative decoding with the cloud verifier. */
        SPECULATIVE
    }

    /** Why a generation ended. */
    public enum StopReason {
        END_OF_TURN,
        MAX_TOKENS,
        CONTEXT_FULL,
        /** {@link TandemRuntime#cancel}, or the callback returned false. */
        CANCELLED
    }

    public final Route route;
    public final StopReason stop;
    public final long promptTokens;
    public final long generatedTokens;
    public final long verifiedTokens;
    public final long provisionalTokens;
    public final long localTokens;
    /** Speculative rounds answered by the verifier. */
    public final long rounds;
    public final long drafted;
    public final long accepted;
    /** Target forward passes the verifier ran. */
    public final long verifierPasses;
    /** Times the circuit breaker opened (the verifier became unreachable). */
    public final long breakerOpens;
    /** Provisional tokens the verifier checked when it was back, and how many differ. */
    public final long provisionalChecked;
    public final long provisionalMismatched;
    public final long draftReusedTokens;
    public final long verifierReusedTokens;
    public final long droppedMessages;
    /** Device state at the generation's start: the threads the draft ran on. */
    public final long draftThreads;
    /** The most draft tokens per round the device state allowed (0: no cap). */
    public final long kCap;
    /** accepted / drafted (0 when nothing was drafted). */
    public final double acceptanceRate;
    public final double rttMeanMs;
    public final double ttftMs;
    public final double totalMs;
    public final double tokensPerS;

    /** Number of entries of the arrays the native library fills. */
    static final int COUNTS = 19;
    static final int TIMES = 5;

    /** From the arrays the native library filled (order: tandem-jni's {@code stats_arrays}). */
    Stats(long[] c, double[] t) {
        route = Route.values()[(int) c[0]];
        stop = StopReason.values()[(int) c[1]];
        promptTokens = c[2];
        generatedTokens = c[3];
        verifiedTokens = c[4];
        provisionalTokens = c[5];
        localTokens = c[6];
        rounds = c[7];
        drafted = c[8];
        accepted = c[9];
        verifierPasses = c[10];
        breakerOpens = c[11];
        provisionalChecked = c[12];
        provisionalMismatched = c[13];
        draftReusedTokens = c[14];
        verifierReusedTokens = c[15];
        droppedMessages = c[16];
        draftThreads = c[17];
        kCap = c[18];
        acceptanceRate = t[0];
        rttMeanMs = t[1];
        ttftMs = t[2];
        totalMs = t[3];
        tokensPerS = t[4];
    }

    @Override
    public String toString() {
        return "route=" + route + " stop=" + stop + " prompt=" + promptTokens
                + " generated=" + generatedTokens + " verified=" + verifiedTokens
                + " provisional=" + provisionalTokens + " local=" + localTokens
                + " rounds=" + rounds + " drafted=" + drafted + " accepted=" + accepted
                + " passes=" + verifierPasses + " breaker_opens=" + breakerOpens
                + " draft_threads=" + draftThreads + " k_cap=" + kCap
                + String.format(" acceptance=%.3f ttft_ms=%.1f total_ms=%.1f tok_s=%.2f",
                        acceptanceRate, ttftMs, totalMs, tokensPerS);
    }
}
