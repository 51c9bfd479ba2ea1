//! The device's own state (thermal, battery, power save) and what the runtime
//! does about it.
//!
//! The app reports a [`DeviceState`] whenever the platform tells it something
//! changed (Android `PowerManager.getCurrentThermalStatus()` / battery
//! broadcasts, iOS `ProcessInfo.thermalState` / `UIDevice.batteryLevel`),
//! through [`crate::EdgeRuntime::set_device_state`] or a [`SharedDeviceState`]
//! handle (any thread, also while a generation runs), the C ABI
//! (`tandem_runtime_set_device_state`) or `PUT /admin/device` of
//! `tandem serve-edge`.
//!
//! [`adjustments`] is a pure function from the state (and the number of
//! threads the draft would use otherwise) to what the runtime changes:
//!
//! | input | draft threads | k cap (drafts per round) |
//! | --- | --- | --- |
//! | thermal unknown / `nominal` | all (`base`) | – |
//! | thermal `fair` | ⌈3·base/4⌉ | – |
//! | thermal `serious` | ⌈base/2⌉ | 4 |
//! | thermal `critical` | 1 | 2 |
//! | `power_save` | – | 2 |
//! | battery < 20 %, not charging | – | 2 |
//! | battery < 10 %, not charging | 1 | 1 |
//!
//! Every row that holds applies; the smallest value wins. "–" leaves it
//! alone. Charging turns the battery rows off. Fewer threads make the draft
//! slower and cooler; a smaller k means fewer draft forwards per verified
//! token (more of the tokens come from the verifier: k = 1 is the most
//! verifier-heavy mode the speculative loop has). Neither changes a verified
//! token: greedy output stays the target's whatever the state.
//!
//! **When it applies.** The runtime reads the state once, at the start of a
//! generation, and keeps those adjustments for the whole generation (stats
//! report them: `EdgeStats::device`); a state set during a generation takes
//! effect with the next one, never in the middle of a forward.
//!
//! **Routing.** The state also goes into the privacy router's live context
//! (`thermal_level` 0–3, `battery_pct`, `charging`, `power_save`), so the
//! operator's policy can route on it (e.g. `thermal_at_least = 2` →
//! `speculative`: offload non-sensitive requests to the verifier when the
//! device is hot; content rules still keep sensitive ones on the device;
//! docs/privacy.md).
//!
//! Platform scales ([`ThermalState::from_android_status`],
//! [`ThermalState::from_ios_state`]):
//!
//! | [`ThermalState`] | Android `THERMAL_STATUS_*` | iOS `ProcessInfo.ThermalState` |
//! | --- | --- | --- |
//! | `nominal` (0) | `NONE` (0) | `.nominal` (0) |
//! | `fair` (1) | `LIGHT` (1) | `.fair` (1) |
//! | `serious` (2) | `MODERATE` (2) | `.serious` (2) |
//! | `critical` (3) | `SEVERE`, `CRITICAL`, `EMERGENCY`, `SHUTDOWN` (3–6) | `.critical` (3) |

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::error::EdgeError;

/// How hot the device is, on the iOS scale (Android's is folded onto it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ThermalState {
    Nominal,
    Fair,
    Serious,
    Critical,
}

impl ThermalState {
    /// 0 (nominal) ..= 3 (critical): the router's `thermal_level`.
    pub fn level(self) -> u8 {
        match self {
            Self::Nominal => 0,
            Self::Fair => 1,
            Self::Serious => 2,
            Self::Critical => 3,
        }
    }

    /// The state of a router `thermal_level` (0..=3).
    pub fn from_level(level: u8) -> Option<Self> {
        match level {
            0 => Some(Self::Nominal),
            1 => Some(Self::Fair),
            2 => Some(Self::Serious),
            3 => Some(Self::Critical),
            _ => None,
        }
    }

    /// Android `PowerManager.THERMAL_STATUS_*` (0 = NONE ..= 6 = SHUTDOWN).
    pub fn from_android_status(status: i32) -> Option<Self> {
        match status {
            0 => Some(Self::Nominal),
            1 => Some(Self::Fair),
            2 => Some(Self::Serious),
            3..=6 => Some(Self::Critical),
            _ => None,
        }
    }

    /// iOS `ProcessInfo.ThermalState` raw value (0 = nominal ..= 3 = critical).
    pub fn from_ios_state(state: i32) -> Option<Self> {
        u8::try_from(state).ok().and_then(Self::from_level)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Nominal => "nominal",
            Self::Fair => "fair",
            Self::Serious => "serious",
            Self::Critical => "critical",
        }
    }
}

/// What the app reports about the device. Everything is optional: an app
/// that reports nothing gets the defaults (no adjustment).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeviceState {
    /// Thermal state, if known.
    pub thermal: Option<ThermalState>,
    /// Battery charge in percent (0..=100), if known.
    pub battery_pct: Option<u8>,
    /// Plugged in and charging (the battery rows of the policy do not apply).
    pub charging: bool,
    /// The OS's power-save / low-power mode is on.
    pub power_save: bool,
    /// The user asked that nothing leave the device (a router input).
    pub user_opt_out: bool,
}

impl DeviceState {
    /// Refuses a battery level above 100 %.
    pub fn validate(&self) -> Result<(), EdgeError> {
        match self.battery_pct {
            Some(p) if p > 100 => Err(EdgeError::Config(format!(
                "device state: battery_pct must be in 0..=100, got {p}"
            ))),
            _ => Ok(()),
        }
    }

    /// The router's `thermal_level` (0 = nominal ..= 3 = critical).
    pub fn thermal_level(&self) -> Option<u8> {
        self.thermal.map(ThermalState::level)
    }
}

/// Battery below this (percent, not charging): k ≤ [`LOW_BATTERY_K_CAP`].
pub const LOW_BATTERY_PCT: u8 = 20;
/// Battery below this (percent, not charging): one draft thread, k = 1.
pub const CRITICAL_BATTERY_PCT: u8 = 10;
/// k cap on low battery and in power-save mode.
pub const LOW_BATTERY_K_CAP: usize = 2;
/// k cap when the device is `serious`ly hot.
pub const SERIOUS_K_CAP: usize = 4;
/// k cap when the device is `critical`ly hot.
pub const CRITICAL_K_CAP: usize = 2;

/// What the runtime changes for a device state ([`adjustments`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceAdjustments {
    /// Threads the draft's forwards use (1..=base).
    pub draft_threads: usize,
    /// The threads it would use without adjustments.
    pub base_threads: usize,
    /// Most draft tokens per round (`None`: the caller's k).
    pub k_cap: Option<usize>,
    /// Which rows of the policy table held, e.g. `thermal serious`,
    /// `battery 8% < 10%`, `power save`.
    pub reasons: Vec<String>,
}

/// The policy of the module docs' table: pure, no clock, no I/O.
/// `base_threads` (at least 1) is what the draft uses without adjustments.
pub fn adjustments(state: &DeviceState, base_threads: usize) -> DeviceAdjustments {
    let base = base_threads.max(1);
    let mut threads = base;
    let mut k_cap: Option<usize> = None;
    let mut reasons = Vec::new();
    let mut cap_k = |cap: usize| k_cap = Some(k_cap.map_or(cap, |c| c.min(cap)));
    match state.thermal {
        None | Some(ThermalState::Nominal) => {}
        Some(ThermalState::Fair) => {
            threads = threads.min((3 * base).div_ceil(4));
            reasons.push("thermal fair".to_string());
        }
        Some(ThermalState::Serious) => {
            threads = threads.min(base.div_ceil(2));
            cap_k(SERIOUS_K_CAP);
            reasons.push("thermal serious".to_string());
        }
        Some(ThermalState::Critical) => {
            threads = 1;
            cap_k(CRITICAL_K_CAP);
            reasons.push("thermal critical".to_string());
        }
    }
    if state.power_save {
        cap_k(LOW_BATTERY_K_CAP);
        reasons.push("power save".to_string());
    }
    if let (Some(pct), false) = (state.battery_pct, state.charging) {
        if pct < CRITICAL_BATTERY_PCT {
            threads = 1;
            cap_k(1);
            reasons.push(format!("battery {pct}% < {CRITICAL_BATTERY_PCT}%"));
        } else if pct < LOW_BATTERY_PCT {
            cap_k(LOW_BATTERY_K_CAP);
            reasons.push(format!("battery {pct}% < {LOW_BATTERY_PCT}%"));
        }
    }
    DeviceAdjustments {
        draft_threads: threads.max(1),
        base_threads: base,
        k_cap,
        reasons,
    }
}

/// A device state shared between the app's threads and the runtime: set it
/// from any thread at any time; the runtime reads it at the start of each
/// generation. Cloning shares the same state.
#[derive(Clone, Debug, Default)]
pub struct SharedDeviceState {
    inner: Arc<Mutex<DeviceState>>,
}

impl SharedDeviceState {
    /// Replaces the state (validated first: a bad one changes nothing).
    pub fn set(&self, state: DeviceState) -> Result<(), EdgeError> {
        state.validate()?;
        *self.lock() = state;
        Ok(())
    }

    pub fn get(&self) -> DeviceState {
        self.lock().clone()
    }

    /// The adjustments a generation started now (on a thread without its own
    /// forward pool) would run with.
    pub fn adjustments(&self) -> DeviceAdjustments {
        adjustments(&self.get(), tandem_model::forward_threads::current())
    }

    fn lock(&self) -> MutexGuard<'_, DeviceState> {
        // Only whole states are written: a poisoned lock holds a valid one.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The thread pools the draft runs on when it may use fewer threads than
/// the default pool has (made once per size, kept).
#[derive(Default)]
pub(crate) struct DraftPools {
    pools: HashMap<usize, Arc<rayon::ThreadPool>>,
}

impl DraftPools {
    /// A pool of `threads` threads, or `None` when the default pool (of
    /// `base` threads) is meant.
    pub(crate) fn get(
        &mut self,
        threads: usize,
        base: usize,
    ) -> Result<Option<Arc<rayon::ThreadPool>>, EdgeError> {
        if threads >= base {
            return Ok(None);
        }
        if let Some(p) = self.pools.get(&threads) {
            return Ok(Some(p.clone()));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("tandem-draft-{threads}-{i}"))
            .build()
            .map_err(|e| EdgeError::Runtime(format!("draft thread pool: {e}")))?;
        let pool = Arc::new(pool);
        self.pools.insert(threads, pool.clone());
        Ok(Some(pool))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn state(thermal: Option<ThermalState>, battery: Option<u8>) -> DeviceState {
        DeviceState {
            thermal,
            battery_pct: battery,
            ..DeviceState::default()
        }
    }

    #[test]
    fn the_policy_table_row_by_row() {
        use ThermalState::*;
        // (state, base threads) -> (draft threads, k cap)
        let rows: Vec<(DeviceState, usize, usize, Option<usize>)> = vec![
            (DeviceState::default(), 8, 8, None),
            (state(Some(Nominal), Some(100)), 8, 8, None),
            (state(Some(Fair), None), 8, 6, None),
            (state(Some(Fair), None), 2, 2, None),
            (state(Some(Serious), None), 8, 4, Some(4)),
            (state(Some(Serious), None), 2, 1, Some(4)),
            (state(Some(Serious), None), 1, 1, Some(4)),
            (state(Some(Critical), None), 8, 1, Some(2)),
            (state(None, Some(20)), 8, 8, None),
            (state(None, Some(19)), 8, 8, Some(2)),
            (state(None, Some(10)), 8, 8, Some(2)),
            (state(None, Some(9)), 8, 1, Some(1)),
            (state(None, Some(0)), 8, 1, Some(1)),
            (
                DeviceState {
                    power_save: true,
                    ..DeviceState::default()
                },
                8,
                8,
                Some(2),
            ),
            // Charging turns the battery rows off.
            (
                DeviceState {
                    battery_pct: Some(5),
                    charging: true,
                    ..DeviceState::default()
                },
                8,
                8,
                None,
            ),
            // The smallest value wins.
            (
                DeviceState {
                    thermal: Some(Serious),
                    battery_pct: Some(15),
                    ..DeviceState::default()
                },
                8,
                4,
                Some(2),
            ),
            (state(Some(Fair), Some(5)), 8, 1, Some(1)),
            // A base of 0 counts as 1.
            (DeviceState::default(), 0, 1, None),
        ];
        for (s, base, threads, k) in rows {
            let a = adjustments(&s, base);
            assert_eq!(
                (a.draft_threads, a.k_cap),
                (threads, k),
                "{s:?} base {base}: {a:?}"
            );
            assert_eq!(a.base_threads, base.max(1));
        }
        let a = adjustments(&state(Some(Serious), Some(15)), 8);
        assert_eq!(a.reasons, vec!["thermal serious", "battery 15% < 20%"]);
        assert!(adjustments(&state(Some(Nominal), Some(80)), 8)
            .reasons
            .is_empty());
    }

    #[test]
    fn platform_scales_map_onto_the_four_states() {
        use ThermalState::*;
        let android: Vec<_> = (-1..=7).map(ThermalState::from_android_status).collect();
        assert_eq!(
            android,
            vec![
                None,
                Some(Nominal),
                Some(Fair),
                Some(Serious),
                Some(Critical),
                Some(Critical),
                Some(Critical),
                Some(Critical),
                None
            ]
        );
        let ios: Vec<_> = (-1..=4).map(ThermalState::from_ios_state).collect();
        assert_eq!(
            ios,
            vec![
                None,
                Some(Nominal),
                Some(Fair),
                Some(Serious),
                Some(Critical),
                None
            ]
        );
        for l in 0..4u8 {
            assert_eq!(ThermalState::from_level(l).unwrap().level(), l);
        }
    }

    #[test]
    fn a_bad_battery_level_is_refused_and_changes_nothing() {
        let shared = SharedDeviceState::default();
        shared
            .set(state(Some(ThermalState::Fair), Some(50)))
            .unwrap();
        let err = shared.set(state(None, Some(101))).unwrap_err().to_string();
        assert!(err.contains("battery_pct") && err.contains("101"), "{err}");
        assert_eq!(shared.get(), state(Some(ThermalState::Fair), Some(50)));
        // Another handle to the same state (another thread) sees a set.
        let other = shared.clone();
        std::thread::spawn(move || {
            other
                .set(state(Some(ThermalState::Critical), None))
                .unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(shared.get().thermal, Some(ThermalState::Critical));
    }

    #[test]
    fn json_uses_the_lowercase_state_names() {
        let s: DeviceState =
            serde_json::from_str(r#"{"thermal":"serious","battery_pct":40,"charging":true}"#)
                .unwrap();
        assert_eq!(s.thermal, Some(ThermalState::Serious));
        assert!(serde_json::from_str::<DeviceState>(r#"{"thermal":"hot"}"#).is_err());
        assert!(serde_json::from_str::<DeviceState>(r#"{"temperature":3}"#).is_err());
    }
}
