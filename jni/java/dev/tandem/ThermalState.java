package dev.tandem;

/**
 * The device's thermal state, as the platform reports it (Android's
 * {@code PowerManager.THERMAL_STATUS_*} folded to four levels, iOS's
 * {@code ProcessInfo.ThermalState}); the C ABI's {@code TandemThermalState}.
 */
public enum ThermalState {
    /** Not known (the runtime does not throttle for heat). */
    UNKNOWN(-1),
    NOMINAL(0),
    FAIR(1),
    SERIOUS(2),
    CRITICAL(3);

    /** The C ABI's value. */
    final int code;

    ThermalState(int code) {
        this.code = code;
    }
}
