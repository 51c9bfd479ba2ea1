//! The opens this device has sent and the verifier has not answered yet:
//! what one generation's open waits behind when other generations of the same
//! device open at the same time (`tandem serve-edge --parallel`: sibling
//! runtimes share one [`OpenLoad`]).
//!
//! Why it matters: an open's `Opened` deadline is estimated from this
//! runtime's own earlier opens ([`crate::breaker::OpenCost`]). A verifier
//! prefills opens one after the other, or joins them in one forward, so a
//! 6-token completion opened just after a 44-token chat is answered when the
//! chat's prefill is done. Judged by its own 6 tokens it looked like a dead
//! verifier, and the completion started provisional. So when an open's own
//! deadline passes while other opens of this device are still waiting, it
//! waits until the latest of *their* deadlines plus its own allowance
//! ([`OpenTicket::extended`]): the device's own load is never taken for an
//! outage. A verifier that is really silent is still caught: the response
//! headers have their own deadline, every open keeps its own bound, and
//! `open_timeout_ms` bounds the whole open.
//!
//! The same rule covers the device's own work beside an open
//! ([`PrefillHold`]): a generation sends its Open first and then prefills the
//! draft's backlog while the verifier prefills the context, so the two
//! prefills overlap instead of adding up. Until the device is done it is not
//! waiting for `Opened`, so a deadline that passes meanwhile is no outage;
//! once it is done, the open's allowance counts from then.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The deadlines of the opens now waiting, shared by a runtime and its
/// siblings.
#[derive(Debug, Default)]
pub struct OpenLoad {
    waiting: Mutex<Waiting>,
}

#[derive(Debug, Default)]
struct Waiting {
    next_id: u64,
    /// (ticket id, the instant that open is allowed to wait until).
    deadlines: Vec<(u64, Instant)>,
}

impl OpenLoad {
    /// Registers an open allowed to wait until `deadline`; the ticket takes it
    /// off again when dropped (answered, failed or abandoned).
    pub fn begin(self: &Arc<Self>, deadline: Instant) -> OpenTicket {
        let mut w = self.lock();
        let id = w.next_id;
        w.next_id = w.next_id.wrapping_add(1);
        w.deadlines.push((id, deadline));
        OpenTicket {
            load: Arc::clone(self),
            id,
        }
    }

    /// Opens waiting now (for tests and metrics).
    pub fn waiting(&self) -> usize {
        self.lock().deadlines.len()
    }

    /// The list is complete after every operation, so a poisoned lock is
    /// taken as it is.
    fn lock(&self) -> MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One open's registration in an [`OpenLoad`].
#[derive(Debug)]
pub struct OpenTicket {
    load: Arc<OpenLoad>,
    id: u64,
}

impl OpenTicket {
    /// This open's own deadline moved (its headers came). An extension is
    /// never recorded here: two opens waiting on a verifier that went silent
    /// after the headers would otherwise extend each other up to
    /// `open_timeout_ms`.
    pub fn set_deadline(&self, deadline: Instant) {
        let mut w = self.load.lock();
        if let Some(e) = w.deadlines.iter_mut().find(|(id, _)| *id == self.id) {
            e.1 = deadline;
        }
    }

    /// This open's own deadline `until` has passed at `now`: how long it may
    /// wait instead. While other opens of the device are waiting, the
    /// verifier may be prefilling them before or beside this one: until the
    /// latest of their deadlines, plus `own` (this open's own allowance).
    /// None: nothing else waits, the deadline stands.
    pub fn extended(&self, until: Instant, own: Duration) -> Option<Instant> {
        let w = self.load.lock();
        let latest = w
            .deadlines
            .iter()
            .filter(|(id, _)| *id != self.id)
            .map(|(_, d)| *d)
            .max()?;
        let extended = latest.checked_add(own)?;
        (extended > until).then_some(extended)
    }
}

/// The device's own prefill running beside an open (see the module doc):
/// [`PrefillHold::release`] when it is done. Shared by the generation and
/// the open's task.
#[derive(Debug, Default)]
pub struct PrefillHold {
    /// When the device's prefill ended; `None` while it runs.
    released: Mutex<Option<Instant>>,
}

impl PrefillHold {
    /// The device's prefill is done (or abandoned): from now on it waits.
    pub fn release(&self) {
        let mut r = self.released.lock().unwrap_or_else(|p| p.into_inner());
        r.get_or_insert_with(Instant::now);
    }

    /// A later deadline for an open whose deadline `until` (with allowance
    /// `own`) has passed: while the device still prefills, `own` from now
    /// (asked again then); after, `own` from the release when that is later
    /// than `until`. `None`: the device has been waiting for the whole
    /// allowance, so the deadline stands.
    pub fn extended(&self, until: Instant, own: Duration) -> Option<Instant> {
        let released = *self.released.lock().unwrap_or_else(|p| p.into_inner());
        let from = released.unwrap_or_else(Instant::now);
        let extended = from.checked_add(own)?;
        (extended > until).then_some(extended)
    }
}

impl Drop for OpenTicket {
    fn drop(&mut self) {
        let mut w = self.load.lock();
        w.deadlines.retain(|(id, _)| *id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_counts_from_the_end_of_the_devices_own_prefill() {
        let hold = PrefillHold::default();
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        // Still prefilling: a passed deadline moves to its allowance from now.
        let e = hold.extended(t0, ms(300)).unwrap();
        assert!(e >= t0 + ms(300));
        hold.release();
        let released = *hold.released.lock().unwrap();
        let r = released.unwrap();
        // Released: the allowance counts from the release, once.
        assert_eq!(hold.extended(t0, ms(300)), Some(r + ms(300)));
        assert_eq!(hold.extended(r + ms(300), ms(300)), None);
        // A second release does not move it.
        hold.release();
        assert_eq!(*hold.released.lock().unwrap(), released);
    }

    #[test]
    fn an_open_waits_for_the_others_waiting_and_never_for_itself() {
        let load = Arc::new(OpenLoad::default());
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let long = load.begin(t0 + ms(2000));
        let short = load.begin(t0 + ms(250));
        assert_eq!(load.waiting(), 2);
        // The short one's deadline passes while the long one waits.
        assert_eq!(short.extended(t0 + ms(250), ms(250)), Some(t0 + ms(2250)));
        // The long one's own deadline is later than the short one's: no
        // extension from it.
        assert_eq!(long.extended(t0 + ms(2000), ms(1000)), None);
        // The long one's headers came: its deadline moved earlier.
        long.set_deadline(t0 + ms(900));
        assert_eq!(short.extended(t0 + ms(250), ms(250)), Some(t0 + ms(1150)));
        // Extended once, the same deadline is not extended again.
        assert_eq!(short.extended(t0 + ms(1150), ms(250)), None);
        // Extensions are not recorded as deadlines, so two waiting opens do
        // not extend each other in turn: the long one, past its own 900 ms,
        // waits for the short one's own 250 ms deadline (already past) + its
        // allowance, which is earlier: it times out.
        assert_eq!(long.extended(t0 + ms(900), ms(500)), None);
        drop(long);
        assert_eq!(load.waiting(), 1);
        assert_eq!(
            short.extended(t0 + ms(1150), ms(250)),
            None,
            "nothing else waits"
        );
        drop(short);
        assert_eq!(load.waiting(), 0);
    }
}
