package dev.tandem;

/**
 * An error reported by the C ABI: its status code and its message (for
 * example {@code IO} with the missing file's path, {@code CONFIG} naming the
 * field, {@code BUSY} for a second concurrent generation).
 */
public final class TandemException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    /** The C ABI's {@code TandemStatus} codes other than {@code OK}. */
    public enum Status {
        INVALID_ARGUMENT(1),
        IO(2),
        CONFIG(3),
        MODEL(4),
        TLS(5),
        REFUSED(6),
        PROTOCOL(7),
        BUSY(8),
        NO_GENERATION(9),
        INTERNAL(10),
        PANIC(11),
        CONTEXT_TOO_LONG(12);

        /** The C ABI's code. */
        public final int code;

        Status(int code) {
            this.code = code;
        }

        static Status fromCode(int code) {
            for (Status s : values()) {
                if (s.code == code) {
                    return s;
                }
            }
            return INTERNAL;
        }
    }

    private final Status status;

    /** Called by the native library. */
    TandemException(int code, String message) {
        super(message);
        this.status = Status.fromCode(code);
    }

    /** "TandemException IO: reading the config ...": the status, then the C ABI's message. */
    @Override
    public String toString() {
        return "TandemException " + status + ": " + getMessage();
    }

    /** The C ABI's status. */
    public Status status() {
        return status;
    }
}
