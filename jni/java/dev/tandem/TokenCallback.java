package dev.tandem;

/**
 * Receives each text piece of a generation, on the thread that called
 * {@link TandemRuntime#generate}. A piece is the text of one or more tokens
 * (a UTF-8 character can span tokens); its status is the weakest of them.
 *
 * <p>Return {@code true} to continue, {@code false} to stop (stop reason
 * {@link Stats.StopReason#CANCELLED}). An exception thrown here stops the
 * generation and propagates out of {@code generate}. The callback may call
 * {@link TandemRuntime#cancel} and {@link TandemRuntime#stats}, not
 * {@code generate} or {@code close} on the same runtime.
 */
@FunctionalInterface
public interface TokenCallback {
    boolean onToken(String text, TokenStatus status);
}
