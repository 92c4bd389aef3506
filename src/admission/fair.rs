//! Who waits ahead of whom: start-time fair queueing over callers, as plain
//! data (no locks, no async) so that it can be simulated in tests.
//!
//! Each request gets a start tag: the later of the queue's virtual time and
//! the caller's last finish tag (each request costs one unit). Waiters are
//! served in tag order and, when the queue is full, the waiter with the
//! largest tag is the one shed. The caller's last finish tag stays in a
//! bounded table after its requests leave the queue, so a caller arriving
//! ten times as often as the others is pushed ten times as far into the
//! virtual future and keeps about its fair share of the slots, even when it
//! never holds more than one queue place at a time (round-robin over the
//! callers present in the queue could not see that).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Callers remembered at most; beyond, callers the virtual clock has caught
/// up with are forgotten first (forgetting them changes nothing), then new
/// callers are simply not remembered (they start at the virtual time).
pub const MAX_CALLERS: usize = 65_536;

/// A waiter's place: (start tag, arrival number). Unique and ordered.
pub type Place = (u64, u64);

/// The fair queue's bookkeeping, generic over what waits.
#[derive(Debug)]
pub struct FairTable<T> {
    /// Start tag of the most recently started request (monotone).
    virtual_now: u64,
    /// Each remembered caller's finish tag.
    finish: HashMap<Arc<str>, u64>,
    waiting: BTreeMap<Place, (Arc<str>, T)>,
    /// Waiters per caller in `waiting` (a caller leaves when it has none).
    waiting_callers: HashMap<Arc<str>, usize>,
    next_id: u64,
    max_callers: usize,
}

impl<T> Default for FairTable<T> {
    fn default() -> Self {
        Self::with_max_callers(MAX_CALLERS)
    }
}

impl<T> FairTable<T> {
    pub fn with_max_callers(max_callers: usize) -> Self {
        Self {
            virtual_now: 0,
            finish: HashMap::new(),
            waiting: BTreeMap::new(),
            waiting_callers: HashMap::new(),
            next_id: 0,
            max_callers: max_callers.max(1),
        }
    }

    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    pub fn callers_remembered(&self) -> usize {
        self.finish.len()
    }

    /// Whether a caller other than `key` has a request waiting.
    pub fn others_waiting(&self, key: &str) -> bool {
        match self.waiting_callers.len() {
            0 => false,
            1 => !self.waiting_callers.contains_key(key),
            _ => true,
        }
    }

    fn enter(&mut self, key: &Arc<str>) {
        *self.waiting_callers.entry(key.clone()).or_default() += 1;
    }

    fn leave(&mut self, key: &str) {
        if let Some(n) = self.waiting_callers.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                self.waiting_callers.remove(key);
            }
        }
    }

    /// The start tag a new request of `key` would get.
    pub fn tag(&self, key: &str) -> u64 {
        self.finish
            .get(key)
            .map_or(self.virtual_now, |&f| f.max(self.virtual_now))
    }

    /// The largest start tag waiting (the first to be shed).
    pub fn last_tag(&self) -> Option<u64> {
        self.waiting.last_key_value().map(|(p, _)| p.0)
    }

    /// Charges one unit to `key` from `tag` on.
    fn charge(&mut self, key: &Arc<str>, tag: u64) {
        if let Some(f) = self.finish.get_mut(key) {
            *f = tag + 1;
            return;
        }
        if self.finish.len() >= self.max_callers {
            let now = self.virtual_now;
            self.finish.retain(|_, f| *f > now);
        }
        if self.finish.len() < self.max_callers {
            self.finish.insert(key.clone(), tag + 1);
        }
    }

    /// Gives back the unit of a request that was charged at `tag` but
    /// never ran (shed, expired, cancelled), when it is the caller's last.
    fn refund(&mut self, key: &str, tag: u64) {
        if let Some(f) = self.finish.get_mut(key) {
            if *f == tag + 1 {
                *f = tag;
            }
        }
    }

    /// A request of `key` starts at once (nobody waits).
    pub fn start_now(&mut self, key: &Arc<str>) {
        let tag = self.tag(key);
        self.virtual_now = self.virtual_now.max(tag);
        self.charge(key, tag);
    }

    /// Queues a request of `key` at its tag; returns its place.
    pub fn push(&mut self, key: Arc<str>, item: T) -> Place {
        let tag = self.tag(&key);
        self.charge(&key, tag);
        self.next_id += 1;
        let place = (tag, self.next_id);
        self.enter(&key);
        self.waiting.insert(place, (key, item));
        place
    }

    /// Removes the waiter with the largest tag (to make room for a request
    /// with a smaller one).
    pub fn pop_last(&mut self) -> Option<(Arc<str>, T)> {
        let (place, (key, item)) = self.waiting.pop_last()?;
        self.leave(&key);
        self.refund(&key, place.0);
        Some((key, item))
    }

    /// The next waiter in tag order for which `live` holds; the others met
    /// on the way are dropped (and refunded). Advances the virtual time.
    pub fn pop_next(&mut self, mut live: impl FnMut(&T) -> bool) -> Option<T> {
        while let Some((place, (key, item))) = self.waiting.pop_first() {
            self.leave(&key);
            if live(&item) {
                self.virtual_now = self.virtual_now.max(place.0);
                return Some(item);
            }
            self.refund(&key, place.0);
        }
        None
    }

    /// A waiter gave up: leaves the queue and is refunded.
    pub fn remove(&mut self, place: Place) -> Option<T> {
        let (key, item) = self.waiting.remove(&place)?;
        self.leave(&key);
        self.refund(&key, place.0);
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::decide::{admit, Admit, QueueState};

    /// A discrete-time model of the signing slots: every tick the running
    /// requests finish, freed slots go to waiters in tag order, then each
    /// caller's arrivals for the tick are admitted with [`admit`]. Returns
    /// each caller's served count.
    fn simulate(
        period: &[u64],
        inflight_cap: &[usize],
        max_running: usize,
        max_queued: usize,
        ticks: u64,
    ) -> Vec<usize> {
        let n = period.len();
        let keys: Vec<Arc<str>> = (0..n).map(|i| Arc::from(format!("c{i}"))).collect();
        let mut t: FairTable<usize> = FairTable::default();
        let mut served = vec![0; n];
        let mut inflight = vec![0usize; n];
        let mut running: Vec<usize> = Vec::new();
        for tick in 0..ticks {
            for c in running.drain(..) {
                inflight[c] -= 1;
            }
            while running.len() < max_running {
                let Some(c) = t.pop_next(|_| true) else { break };
                running.push(c);
                served[c] += 1;
            }
            for c in 0..n {
                // Phases spread the callers over the period.
                if !(tick + c as u64).is_multiple_of(period[c]) || inflight[c] >= inflight_cap[c] {
                    continue;
                }
                let s = QueueState {
                    running: running.len(),
                    max_running,
                    queued: t.len(),
                    max_queued,
                    tag: t.tag(&keys[c]),
                    last_tag: t.last_tag(),
                };
                match admit(&s) {
                    Admit::Run => {
                        t.start_now(&keys[c]);
                        running.push(c);
                        served[c] += 1;
                        inflight[c] += 1;
                    }
                    Admit::Enqueue => {
                        t.push(keys[c].clone(), c);
                        inflight[c] += 1;
                    }
                    Admit::EnqueueEvicting => {
                        if let Some((_, v)) = t.pop_last() {
                            inflight[v] -= 1;
                        }
                        t.push(keys[c].clone(), c);
                        inflight[c] += 1;
                    }
                    Admit::Shed(_) => {}
                }
            }
        }
        served
    }

    fn shares(served: &[usize]) -> Vec<f64> {
        let fair = served.iter().sum::<usize>() as f64 / served.len() as f64;
        served.iter().map(|&s| s as f64 / fair).collect()
    }

    #[test]
    fn others_waiting_follows_every_way_out_of_the_queue() {
        let mut t: FairTable<u32> = FairTable::default();
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        assert!(!t.others_waiting("a"), "empty");
        let pa = t.push(a.clone(), 1);
        t.push(a.clone(), 2);
        assert!(!t.others_waiting("a"), "only a waits");
        assert!(t.others_waiting("b"));
        t.push(b.clone(), 3);
        assert!(t.others_waiting("a") && t.others_waiting("b"));
        assert_eq!(t.remove(pa), Some(1));
        assert!(t.others_waiting("a"), "a's second request and b wait");
        // a's second request was charged after its first: it is furthest ahead.
        let last = t.pop_last().map(|(k, _)| k);
        assert_eq!(last.as_deref(), Some("a"));
        assert!(t.others_waiting("a") && !t.others_waiting("b"));
        assert_eq!(t.pop_next(|_| true), Some(3));
        assert!(
            !t.others_waiting("a") && !t.others_waiting("b"),
            "empty again"
        );
        t.push(a.clone(), 4);
        t.push(b.clone(), 5);
        assert_eq!(t.pop_next(|_| false), None, "dead waiters leave too");
        assert!(!t.others_waiting("c"));
    }
    #[test]
    fn a_greedy_caller_at_ten_times_gets_about_its_fair_share() {
        // One slot serving one request per tick; normal callers each offer one
        // request every `p` ticks (over their fair share), one greedy caller
        // offers one every tick (10-25x a normal one) with 10x their
        // in-flight cap: 3x capacity in all. Each caller usually holds at
        // most one of the queue places.
        for (normals, p, max_queued) in [(20, 10, 16), (50, 25, 16), (20, 10, 128)] {
            let mut period = vec![1u64];
            period.extend(std::iter::repeat_n(p, normals));
            let mut cap = vec![80usize];
            cap.extend(std::iter::repeat_n(8, normals));
            let served = simulate(&period, &cap, 1, max_queued, 20_000);
            let s = shares(&served);
            assert!(s[0] <= 1.25, "greedy {:.2}x: {s:?}", s[0]);
            for (i, share) in s.iter().enumerate().skip(1) {
                assert!(*share >= 0.9, "caller {i} got {share:.2}: {s:?}");
            }
        }
    }

    #[test]
    fn light_callers_get_all_they_ask() {
        // 10 light callers at one request per 50 ticks (about a fifth of their
        // fair share) next to a greedy caller that alone offers capacity.
        let mut period = vec![1u64];
        period.extend(std::iter::repeat_n(50, 10));
        let mut cap = vec![80usize];
        cap.extend(std::iter::repeat_n(8, 10));
        let ticks = 20_000;
        let served = simulate(&period, &cap, 1, 16, ticks);
        for (i, &s) in served.iter().enumerate().skip(1) {
            let asked = ticks / 50;
            assert!(s as u64 >= asked * 9 / 10, "caller {i}: {s} of {asked}");
        }
        // The greedy caller takes the rest: the slot is never idle for it.
        assert!(served[0] as u64 > ticks * 8 / 10, "{served:?}");
    }

    #[test]
    fn memory_survives_leaving_the_queue_and_stays_bounded() {
        let mut t: FairTable<()> = FairTable::with_max_callers(4);
        let a: Arc<str> = Arc::from("a");
        for _ in 0..3 {
            t.push(a.clone(), ());
            t.pop_next(|_| true);
        }
        assert!(t.is_empty());
        // "a" was served three times: a newcomer goes before it.
        assert!(t.tag("a") > t.tag("b"));
        // Refunds: a request that never ran costs nothing.
        let before = t.tag("a");
        let p = t.push(a.clone(), ());
        assert_eq!(t.tag("a"), before + 1);
        t.remove(p);
        assert_eq!(t.tag("a"), before);
        // Bounded: beyond 4 callers new ones are not remembered, and callers
        // the virtual time caught up with are forgotten first.
        for i in 0..10 {
            t.push(Arc::from(format!("k{i}")), ());
        }
        assert!(t.callers_remembered() <= 4);
        while t.pop_next(|_| true).is_some() {}
        t.push(Arc::from("late"), ());
        assert!(t.callers_remembered() <= 4);
    }

    #[test]
    fn expired_waiters_are_skipped_and_refunded() {
        let mut t: FairTable<bool> = FairTable::default();
        let a: Arc<str> = Arc::from("a");
        t.push(a.clone(), false);
        t.push(Arc::from("b"), true);
        assert_eq!(t.pop_next(|live| *live), Some(true));
        assert_eq!(t.tag("a"), t.tag("zzz"), "a's expired request was refunded");
    }
}
