package dev.tandem;

/**
 * What the app knows about the device, for {@link TandemRuntime#setDeviceState}
 * (the C ABI's {@code TandemDeviceState}; the policy table is in
 * {@code docs/capi.md}): hot means fewer draft threads, low battery or
 * power-save mode fewer draft tokens per round, and the privacy router's
 * rules see all of it. Verified output never changes.
 */
public final class DeviceState {
    public final ThermalState thermal;
    /** Battery charge in percent, 0..=100, or -1 when not known. */
    public final int batteryPct;
    /** Plugged in and charging. */
    public final boolean charging;
    /** The OS's power-save / low-power mode is on. */
    public final boolean powerSave;
    /** The user asked that nothing leave the device (a privacy-router input). */
    public final boolean userOptOut;

    /**
     * @throws NullPointerException when {@code thermal} is null (use
     *     {@link ThermalState#UNKNOWN})
     */
    public DeviceState(
            ThermalState thermal,
            int batteryPct,
            boolean charging,
            boolean powerSave,
            boolean userOptOut) {
        if (thermal == null) {
            throw new NullPointerException("thermal is null (use ThermalState.UNKNOWN)");
        }
        this.thermal = thermal;
        this.batteryPct = batteryPct;
        this.charging = charging;
        this.powerSave = powerSave;
        this.userOptOut = userOptOut;
    }

    @Override
    public String toString() {
        return "thermal=" + thermal + " battery=" + batteryPct + " charging=" + charging
                + " power_save=" + powerSave + " opt_out=" + userOptOut;
    }
}
