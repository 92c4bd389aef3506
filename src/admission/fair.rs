//! Who waits ahead of whom: start-time fair queueing over callers, as plain
//! data (no locks, no async) so that it can be simulated in tests.
//!
//! Each request gets a start tag: the later of the queue's virtual time and
//! the caller's last finish tag (each request costs one unit). Turns are
//! taken in tag order and, when the queue is full, the caller holding the
//! largest tag is the one shed. The caller's last finish tag stays in a
//! bounded table after its requests leave the queue, so a caller arriving
//! ten times as often as the others is pushed ten times as far into the
//! virtual future and keeps about its fair share of the slots, even when it
//! never holds more than one queue place at a time (round-robin over the
//! callers present in the queue could not see that).
//!
//! A tag is a turn of the caller, not a particular request: when a caller's
//! turn comes, the caller's own policy picks which of its waiting requests
//! goes (the oldest, or under overload the newest: [`Pick`]). So one
//! caller's backlog never delays another caller, and within a backlogged
//! caller new work goes first, while its oldest requests (the ones most
//! likely to be answered too late) are the ones left to expire or shed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

/// Callers remembered at most; beyond, callers the virtual clock has caught
/// up with are forgotten first (forgetting them changes nothing), then new
/// callers are simply not remembered (they start at the virtual time).
pub const MAX_CALLERS: usize = 65_536;

/// Turns looked at per caller when looking for a fresh request: bounds the
/// work of one pick when callers hold many turns each.
const SCAN_TURNS_PER_CALLER: usize = 16;

/// A turn: (start tag, arrival number). Unique and ordered.
pub type Place = (u64, u64);

/// Which of a caller's waiting requests takes its turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    Oldest,
    Newest,
}

/// A waiting request, to take it out of the queue (cancelled, timed out).
#[derive(Debug, Clone)]
pub struct Entry {
    key: Arc<str>,
    id: u64,
}

/// One caller's turns (ascending) and requests (by arrival); as many of each.
#[derive(Debug)]
struct Waiting<T> {
    turns: VecDeque<Place>,
    items: BTreeMap<u64, T>,
}

/// The fair queue's bookkeeping, generic over what waits.
#[derive(Debug)]
pub struct FairTable<T> {
    /// Start tag of the most recently started request (monotone).
    virtual_now: u64,
    /// Each remembered caller's finish tag.
    finish: HashMap<Arc<str>, u64>,
    /// Every waiting turn, and whose it is.
    turns: BTreeMap<Place, Arc<str>>,
    /// Callers with requests waiting.
    waiting: HashMap<Arc<str>, Waiting<T>>,
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
            turns: BTreeMap::new(),
            waiting: HashMap::new(),
            next_id: 0,
            max_callers: max_callers.max(1),
        }
    }

    pub fn len(&self) -> usize {
        self.turns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.turns.is_empty()
    }

    pub fn callers_remembered(&self) -> usize {
        self.finish.len()
    }

    /// Callers with at least one request waiting.
    pub fn callers_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether a caller other than `key` has a request waiting.
    pub fn others_waiting(&self, key: &str) -> bool {
        match self.waiting.len() {
            0 => false,
            1 => !self.waiting.contains_key(key),
            _ => true,
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
        self.turns.last_key_value().map(|(p, _)| p.0)
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

    /// Gives back the unit of a turn that was charged at `tag` but never
    /// ran (shed, expired, cancelled), when it is the caller's last.
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

    /// Queues a request of `key`: one more turn at its tag.
    pub fn push(&mut self, key: Arc<str>, item: T) -> Entry {
        let tag = self.tag(&key);
        self.charge(&key, tag);
        self.next_id += 1;
        let id = self.next_id;
        let place = (tag, id);
        self.turns.insert(place, key.clone());
        let w = self.waiting.entry(key.clone()).or_insert_with(|| Waiting {
            turns: VecDeque::new(),
            items: BTreeMap::new(),
        });
        w.turns.push_back(place);
        w.items.insert(id, item);
        Entry { key, id }
    }

    /// Takes away the last turn of `key` (refunded) after one of its
    /// requests left without running; forgets the caller once it has none.
    fn drop_turn(&mut self, key: &Arc<str>) {
        let Some(w) = self.waiting.get_mut(key) else {
            return;
        };
        let last = w.turns.pop_back();
        if w.items.is_empty() {
            self.waiting.remove(key);
        }
        if let Some(place) = last {
            self.turns.remove(&place);
            self.refund(key, place.0);
        }
    }

    /// Sheds for a newcomer with a smaller tag: the caller holding the
    /// largest tag loses its last turn and its oldest request (the one most
    /// likely to be answered too late).
    pub fn pop_last(&mut self) -> Option<(Arc<str>, T)> {
        let key = self.turns.last_key_value()?.1.clone();
        let item = self.waiting.get_mut(&key)?.items.pop_first()?.1;
        self.drop_turn(&key);
        Some((key, item))
    }

    /// The next turn in tag order: its caller's request picked by `pick`
    /// (given the caller's oldest waiting request) for which `live` holds.
    /// Requests met on the way for which `live` fails are dropped with
    /// their turns refunded. Advances the virtual time.
    pub fn pop_next(
        &mut self,
        live: impl FnMut(&T) -> bool,
        pick: impl FnMut(&T) -> Pick,
    ) -> Option<T> {
        self.pop_next_into(live, pick, |_| true, 1, false, &mut Vec::new())
    }

    /// [`Self::pop_next`], handing the requests met on the way for which
    /// `serve` fails to `passed` (in the order met) instead of dropping them.
    /// Among the first `scan` callers in turn order, the first whose pick is
    /// `fresh` goes ahead of earlier ones whose pick is not (a backlogged
    /// caller's stale requests wait while another caller has a fresh one;
    /// the passed-over caller keeps its turns). If no pick is fresh, the
    /// first turn goes, unless `require_fresh`: then nothing is taken.
    pub fn pop_next_into(
        &mut self,
        mut serve: impl FnMut(&T) -> bool,
        mut pick: impl FnMut(&T) -> Pick,
        mut fresh: impl FnMut(&T) -> bool,
        scan: usize,
        require_fresh: bool,
        passed: &mut Vec<T>,
    ) -> Option<T> {
        loop {
            let place = match self.fresh_turn(&mut pick, &mut fresh, scan) {
                Some(p) => p,
                None if require_fresh => return None,
                None => *self.turns.first_key_value()?.0,
            };
            let key = self.turns.remove(&place)?;
            let Some(w) = self.waiting.get_mut(&key) else {
                continue;
            };
            w.turns.pop_front();
            let Some((_, oldest)) = w.items.first_key_value() else {
                self.waiting.remove(&key);
                continue;
            };
            let item = match pick(oldest) {
                Pick::Oldest => w.items.pop_first(),
                Pick::Newest => w.items.pop_last(),
            }
            .map(|(_, item)| item);
            let Some(item) = item else { continue };
            if serve(&item) {
                if w.items.is_empty() {
                    self.waiting.remove(&key);
                }
                self.virtual_now = self.virtual_now.max(place.0);
                return Some(item);
            }
            // Not served: the turn goes back and the caller's last is refunded.
            w.turns.push_front(place);
            self.turns.insert(place, key.clone());
            self.drop_turn(&key);
            passed.push(item);
        }
    }

    /// The first turn (each caller's first, in tag order, among the first
    /// `scan` callers) whose pick is `fresh`.
    fn fresh_turn(
        &self,
        pick: &mut impl FnMut(&T) -> Pick,
        fresh: &mut impl FnMut(&T) -> bool,
        scan: usize,
    ) -> Option<Place> {
        let mut seen: Vec<&Arc<str>> = Vec::new();
        for (place, key) in self
            .turns
            .iter()
            .take(scan.saturating_mul(SCAN_TURNS_PER_CALLER))
        {
            if seen.len() >= scan {
                break;
            }
            if seen.contains(&key) {
                continue;
            }
            seen.push(key);
            let Some(w) = self.waiting.get(key) else {
                continue;
            };
            let Some((_, oldest)) = w.items.first_key_value() else {
                continue;
            };
            let candidate = match pick(oldest) {
                Pick::Oldest => Some(oldest),
                Pick::Newest => w.items.last_key_value().map(|(_, t)| t),
            };
            if candidate.is_some_and(&mut *fresh) {
                return Some(*place);
            }
        }
        None
    }

    /// A request gave up: leaves the queue, its caller's last turn refunded.
    pub fn remove(&mut self, entry: &Entry) -> Option<T> {
        let item = self.waiting.get_mut(&entry.key)?.items.remove(&entry.id)?;
        self.drop_turn(&entry.key);
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
                let Some(c) = t.pop_next(|_| true, |_| Pick::Oldest) else {
                    break;
                };
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
        assert_eq!(t.remove(&pa), Some(1));
        assert!(t.others_waiting("a"), "a's second request and b wait");
        // a's remaining request holds a's first turn (its last was refunded):
        // b arrived later at the same tag and is furthest ahead.
        let last = t.pop_last().map(|(k, _)| k);
        assert_eq!(last.as_deref(), Some("b"));
        assert!(!t.others_waiting("a") && t.others_waiting("b"));
        assert_eq!(t.pop_next(|_| true, |_| Pick::Oldest), Some(2));
        assert!(
            !t.others_waiting("a") && !t.others_waiting("b"),
            "empty again"
        );
        t.push(a.clone(), 4);
        t.push(b.clone(), 5);
        assert_eq!(
            t.pop_next(|_| false, |_| Pick::Oldest),
            None,
            "dead waiters leave too"
        );
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
            t.pop_next(|_| true, |_| Pick::Oldest);
        }
        assert!(t.is_empty());
        // "a" was served three times: a newcomer goes before it.
        assert!(t.tag("a") > t.tag("b"));
        // Refunds: a request that never ran costs nothing.
        let before = t.tag("a");
        let p = t.push(a.clone(), ());
        assert_eq!(t.tag("a"), before + 1);
        t.remove(&p);
        assert_eq!(t.tag("a"), before);
        // Bounded: beyond 4 callers new ones are not remembered, and callers
        // the virtual time caught up with are forgotten first.
        for i in 0..10 {
            t.push(Arc::from(format!("k{i}")), ());
        }
        assert!(t.callers_remembered() <= 4);
        while t.pop_next(|_| true, |_| Pick::Oldest).is_some() {}
        t.push(Arc::from("late"), ());
        assert!(t.callers_remembered() <= 4);
    }

    #[test]
    fn expired_waiters_are_skipped_and_refunded() {
        let mut t: FairTable<bool> = FairTable::default();
        let a: Arc<str> = Arc::from("a");
        t.push(a.clone(), false);
        t.push(Arc::from("b"), true);
        assert_eq!(t.pop_next(|live| *live, |_| Pick::Oldest), Some(true));
        assert_eq!(t.tag("a"), t.tag("zzz"), "a's expired request was refunded");
    }

    #[test]
    fn a_turn_serves_the_callers_newest_or_oldest_request() {
        let mut t: FairTable<u32> = FairTable::default();
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        for i in 1..=3 {
            t.push(a.clone(), i);
        }
        t.push(b.clone(), 10);
        // a's first turn (tag 0) comes first; the pick chooses among a's requests.
        assert_eq!(t.pop_next(|_| true, |_| Pick::Newest), Some(3));
        // b's turn (tag 0) comes before a's second (tag 1), whatever a has waiting.
        assert_eq!(t.pop_next(|_| true, |_| Pick::Newest), Some(10));
        assert_eq!(t.pop_next(|_| true, |_| Pick::Oldest), Some(1));
        assert_eq!(t.len(), 1);
        assert!(!t.others_waiting("a"));
        assert_eq!(t.pop_next(|_| true, |_| Pick::Newest), Some(2));
        assert!(t.is_empty() && t.callers_waiting() == 0);
    }

    #[test]
    fn pick_sees_the_oldest_request() {
        let mut t: FairTable<u32> = FairTable::default();
        let a: Arc<str> = "a".into();
        t.push(a.clone(), 7);
        t.push(a.clone(), 8);
        let mut seen = None;
        t.pop_next(
            |_| true,
            |oldest| {
                seen = Some(*oldest);
                Pick::Newest
            },
        );
        assert_eq!(seen, Some(7));
    }

    #[test]
    fn a_dead_newest_request_is_dropped_and_the_turn_kept() {
        let mut t: FairTable<(u32, bool)> = FairTable::default();
        let a: Arc<str> = "a".into();
        t.push(a.clone(), (1, true));
        t.push(a.clone(), (2, false));
        t.push(Arc::from("b"), (9, true));
        // a's newest is dead: dropped, a's last turn refunded, and a's first
        // turn serves its next pick.
        let got = t.pop_next(|x| x.1, |_| Pick::Newest).map(|x| x.0);
        assert_eq!(got, Some(1));
        assert_eq!(t.len(), 1);
        assert_eq!(t.pop_next(|x| x.1, |_| Pick::Newest).map(|x| x.0), Some(9));
        assert!(t.is_empty());
        assert_eq!(t.tag("a"), t.tag("zzz") + 1, "a was charged once, at tag 0");
    }

    #[test]
    fn the_greediest_caller_loses_its_oldest_request() {
        let mut t: FairTable<u32> = FairTable::default();
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        for i in 1..=3 {
            t.push(a.clone(), i);
        }
        t.push(b.clone(), 10);
        let (k, v) = t.pop_last().unwrap();
        assert_eq!((&*k, v), ("a", 1));
        assert_eq!(t.len(), 3);
        // a's remaining requests are 2 and 3, its turns tags 0 and 1.
        assert_eq!(t.pop_next(|_| true, |_| Pick::Oldest), Some(2));
    }

    #[test]
    fn removing_a_request_keeps_turns_and_requests_matched() {
        let mut t: FairTable<u32> = FairTable::default();
        let a: Arc<str> = "a".into();
        let e1 = t.push(a.clone(), 1);
        let e2 = t.push(a.clone(), 2);
        assert_eq!(t.remove(&e2), Some(2));
        assert_eq!(t.remove(&e2), None, "already gone");
        assert_eq!(t.len(), 1);
        assert_eq!(t.pop_next(|_| true, |_| Pick::Newest), Some(1));
        assert_eq!(t.remove(&e1), None, "served");
        assert!(t.is_empty() && t.callers_waiting() == 0);
    }

    #[test]
    fn a_fresh_pick_goes_ahead_of_stale_turns_which_are_kept() {
        // Items are (name, fresh).
        let mut t: FairTable<(&str, bool)> = FairTable::default();
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        t.push(a.clone(), ("a1", false));
        t.push(b.clone(), ("b1", true));
        let fresh = |x: &(&str, bool)| x.1;
        let mut passed = Vec::new();
        let got = t.pop_next_into(|_| true, |_| Pick::Newest, fresh, 8, true, &mut passed);
        assert_eq!(got.map(|x| x.0), Some("b1"));
        // Only stale work is left: nothing is taken when fresh is required.
        let got = t.pop_next_into(|_| true, |_| Pick::Newest, fresh, 8, true, &mut passed);
        assert!(got.is_none() && passed.is_empty());
        assert_eq!(t.len(), 1);
        // a kept its turn: a new request of b (charged after b's first)
        // comes after a's stale one once fresh is no longer required.
        t.push(b.clone(), ("b2", false));
        let got = t.pop_next_into(|_| true, |_| Pick::Newest, fresh, 8, false, &mut passed);
        assert_eq!(got.map(|x| x.0), Some("a1"));
        let got = t.pop_next_into(|_| true, |_| Pick::Newest, fresh, 8, false, &mut passed);
        assert_eq!(got.map(|x| x.0), Some("b2"));
    }

    #[test]
    fn the_fresh_scan_is_bounded() {
        let mut t: FairTable<bool> = FairTable::default();
        for i in 0..5 {
            t.push(Arc::from(format!("stale{i}")), false);
        }
        t.push(Arc::from("late"), true);
        let mut passed = Vec::new();
        // Looking at 3 callers does not reach the fresh one.
        assert!(t
            .pop_next_into(|_| true, |_| Pick::Newest, |x| *x, 3, true, &mut passed)
            .is_none());
        assert_eq!(
            t.pop_next_into(|_| true, |_| Pick::Newest, |x| *x, 6, true, &mut passed),
            Some(true)
        );
    }
}
