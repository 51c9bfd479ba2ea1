package dev.tandem;

/** Where one streamed text piece came from (the C ABI's {@code TandemTokenStatus}). */
public enum TokenStatus {
    /** Checked by the cloud verifier: in greedy mode the target model's own output. */
    VERIFIED(0),
    /** Generated on the device alone: no verifier configured, or the privacy router kept the prompt. */
    LOCAL(1),
    /** Drafted on the device alone while the verifier was unreachable (checked when it is back). */
    PROVISIONAL(2);

    /** The C ABI's code. */
    public final int code;

    TokenStatus(int code) {
        this.code = code;
    }

    static TokenStatus fromCode(int code) {
        for (TokenStatus s : values()) {
            if (s.code == code) {
                return s;
            }
        }
        throw new IllegalStateException("unknown token status code " + code);
    }
}
