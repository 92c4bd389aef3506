//! Refusals that get no full record of their own, folded into bounded
//! aggregate records so that every refused caller is still counted in the
//! chain. Three sources feed it:
//!
//! - the audit writer, when its queue is full and a record cannot be queued
//!   (a flood of cheap refusals must not hide a probe among them);
//! - the transport's request gate and connection limits, whose refusals
//!   happen before any request record exists;
//! - the audit writer, for refusals of unauthenticated callers past
//!   `--audit-unauthenticated-rate`: whoever can open a connection must not
//!   decide how much the log grows (and so how soon rotation deletes it).
//!
//! Keys are (source, reason, subject): the caller's identity when it is
//! known, else its source address. At most `max_keys` keys are named; when a
//! new caller comes and the table is full, the key ranked lowest gives up
//! its name and its count moves to one key per (source, reason) with the
//! subject `overflow`. Ranks follow the Space-Saving scheme (a newcomer
//! ranks just above the key it replaced), so a caller that makes more than
//! 1/`max_keys` of an interval's refusals keeps its name however many
//! sources an attacker sprays; junk sources replace each other. The counts
//! written are exact: a named key counts every refusal since it took its
//! place, `overflow` every other, and nothing is counted twice. Each key
//! becomes one `deny` record with `count` and the first and last time.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Mutex;

use time::OffsetDateTime;

use super::{Aggregate, AuditRecord, AuditSink, Decision};

/// Subject of the key where callers without a name are counted.
pub const OVERFLOW: &str = "overflow";

/// Default of `--audit-aggregate-max-keys`.
pub const DEFAULT_MAX_KEYS: usize = 1024;

/// Who a folded refusal is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Subject {
    /// An authenticated caller (its SPIFFE identity).
    Identity(Box<str>),
    /// A source address, when no identity was established.
    Peer(IpAddr),
    /// Callers without a named key.
    Overflow,
}

impl Subject {
    /// The subject of a record: its caller identity, else its peer's address.
    pub fn of(record: &AuditRecord) -> Self {
        if let Some(id) = record.caller_identity.as_deref().filter(|i| !i.is_empty()) {
            return Self::Identity(id.into());
        }
        record
            .peer
            .as_deref()
            .and_then(|p| {
                p.parse::<std::net::SocketAddr>()
                    .map(|s| s.ip())
                    .or_else(|_| p.parse::<IpAddr>())
                    .ok()
            })
            .map_or(Self::Overflow, Self::Peer)
    }
}

/// A request refused before any identity was established: what
/// `--audit-unauthenticated-rate` folds past its rate. Events (no peer),
/// certificates (allow), aggregates and pod certificate decisions are not.
pub fn unauthenticated_refusal(r: &AuditRecord) -> bool {
    r.decision == Decision::Deny
        && r.caller_identity.as_deref().is_none_or(str::is_empty)
        && r.peer.is_some()
        && r.aggregate.is_none()
        && r.count.is_none()
        && r.issued_kind.is_none()
        && r.pod_certificate_request.is_none()
}

/// Why refusals were folded rather than written one by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// The audit writer's queue was full.
    AuditQueueFull,
    /// Refused by the transport before a request record existed.
    Transport,
    /// An unauthenticated caller's refusal past `--audit-unauthenticated-rate`.
    Unauthenticated,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AuditQueueFull => "audit_queue_full",
            Self::Transport => "transport",
            Self::Unauthenticated => "unauthenticated",
        }
    }
}

/// What one key stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    pub count: u64,
    pub first: OffsetDateTime,
    pub last: OffsetDateTime,
}

impl Tally {
    fn merge(&mut self, other: &Tally) {
        self.count = self.count.saturating_add(other.count);
        self.first = self.first.min(other.first);
        self.last = self.last.max(other.last);
    }
}

/// `(source, reason, subject)`.
pub type Key = (Source, Box<str>, Subject);

/// A named key: its exact tally, and its rank for eviction.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Named {
    tally: Tally,
    /// Space-Saving's estimate: the exact count plus the rank of the key it
    /// replaced. Only orders eviction; never written.
    rank: u64,
    /// When it was last counted (ties in rank: the stalest goes first).
    touched: u64,
}

/// The folded refusals of one interval (plain data; table-tested).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Folded {
    named: HashMap<Key, Named>,
    /// `(rank, touched, key)` of every named key: the first is evicted first.
    order: BTreeSet<(u64, u64, Key)>,
    /// Refusals of callers without a named key, per (source, reason).
    overflow: HashMap<(Source, Box<str>), Tally>,
    clock: u64,
}

impl Folded {
    /// Counts one refusal at `at`; a new key when `max_keys` are named takes
    /// the place of the lowest-ranked one (see the module doc).
    pub fn add(&mut self, key: Key, at: OffsetDateTime, max_keys: usize) {
        self.add_tally(
            key,
            Tally {
                count: 1,
                first: at,
                last: at,
            },
            max_keys,
        );
    }

    fn add_tally(&mut self, key: Key, t: Tally, max_keys: usize) {
        self.clock += 1;
        let touched = self.clock;
        if key.2 == Subject::Overflow {
            return self.overflow_add((key.0, key.1), t);
        }
        if let Some(n) = self.named.get_mut(&key) {
            self.order.remove(&(n.rank, n.touched, key.clone()));
            n.tally.merge(&t);
            n.rank = n.rank.saturating_add(t.count);
            n.touched = touched;
            self.order.insert((n.rank, touched, key));
            return;
        }
        let mut base = 0;
        if self.named.len() >= max_keys.max(1) {
            // Full: the lowest-ranked key gives up its name.
            let Some((rank, _, evicted)) = self.order.pop_first() else {
                return self.overflow_add((key.0, key.1), t);
            };
            if let Some(gone) = self.named.remove(&evicted) {
                self.overflow_add((evicted.0, evicted.1), gone.tally);
            }
            base = rank;
        }
        let rank = base.saturating_add(t.count);
        self.order.insert((rank, touched, key.clone()));
        self.named.insert(
            key,
            Named {
                tally: t,
                rank,
                touched,
            },
        );
    }

    fn overflow_add(&mut self, key: (Source, Box<str>), t: Tally) {
        match self.overflow.get_mut(&key) {
            Some(existing) => existing.merge(&t),
            None => {
                self.overflow.insert(key, t);
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.named.is_empty() && self.overflow.is_empty()
    }

    pub fn total(&self) -> u64 {
        self.entries().iter().map(|(_, t)| t.count).sum()
    }

    /// The tally of `key` (an `Overflow` subject: its reason's overflow).
    pub fn get(&self, key: &Key) -> Option<Tally> {
        match key.2 {
            Subject::Overflow => self.overflow.get(&(key.0, key.1.clone())).copied(),
            _ => self.named.get(key).map(|n| n.tally),
        }
    }

    /// Every key and its tally, named keys first, in a stable order.
    pub fn entries(&self) -> Vec<(Key, Tally)> {
        let mut v: Vec<(Key, Tally)> = self
            .named
            .iter()
            .map(|(k, n)| (k.clone(), n.tally))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        let mut over: Vec<(Key, Tally)> = self
            .overflow
            .iter()
            .map(|((s, r), t)| ((*s, r.clone(), Subject::Overflow), *t))
            .collect();
        over.sort_by(|a, b| a.0.cmp(&b.0));
        v.extend(over);
        v
    }

    /// One `deny` record per key, in a stable order (overflow keys last),
    /// stamped `now`.
    pub fn records(&self, now: OffsetDateTime) -> Vec<AuditRecord> {
        self.entries()
            .iter()
            .map(|(key, t)| record(key, t, now))
            .collect()
    }
}

/// The aggregate record of one key.
pub fn record(key: &Key, t: &Tally, now: OffsetDateTime) -> AuditRecord {
    let (source, reason, subject) = key;
    let rfc = |t: OffsetDateTime| {
        t.format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default()
    };
    let mut r = AuditRecord {
        detail: Some(format!(
            "{} refusal(s) folded ({}) from {} to {}",
            t.count,
            source.as_str(),
            rfc(t.first),
            rfc(t.last)
        )),
        count: Some(t.count),
        aggregate: Some(Aggregate {
            source: source.as_str().into(),
            first: t.first,
            last: t.last,
        }),
        ..AuditRecord::new(now, super::random_id(), Decision::Deny, reason.to_string())
    };
    match subject {
        Subject::Identity(id) => r.caller_identity = Some(id.to_string()),
        Subject::Peer(ip) => r.peer = Some(ip.to_string()),
        Subject::Overflow => r.peer = Some(OVERFLOW.into()),
    }
    r
}

/// The shared table refusals are folded into; drained into the chain by the
/// audit writer (or, without one, flushed to the sink by a periodic task).
#[derive(Debug)]
pub struct Aggregator {
    max_keys: usize,
    folded: Mutex<Folded>,
}

impl Aggregator {
    pub fn new(max_keys: usize) -> Self {
        Self {
            max_keys: max_keys.max(1),
            folded: Mutex::new(Folded::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Folded> {
        crate::primitives::lock(&self.folded)
    }

    /// Folds a record that could not be queued. An issued record that the
    /// writer could not take became a refusal (`audit_queue_full`): no
    /// certificate left for it.
    pub fn fold_record(&self, record: &AuditRecord) {
        let reason = match record.decision {
            Decision::Allow => "audit_queue_full",
            Decision::Deny => record.reason.as_str(),
        };
        let key = (
            Source::AuditQueueFull,
            Box::from(reason),
            Subject::of(record),
        );
        self.lock().add(key, record.time, self.max_keys);
    }

    /// Folds an unauthenticated caller's refusal (see
    /// [`unauthenticated_refusal`]) that gets no full record.
    pub fn fold_unauthenticated(&self, record: &AuditRecord) {
        let key = (
            Source::Unauthenticated,
            Box::from(record.reason.as_str()),
            Subject::of(record),
        );
        self.lock().add(key, record.time, self.max_keys);
    }

    /// Folds a transport refusal from `ip`.
    pub fn fold_transport(&self, ip: IpAddr, reason: &'static str) {
        let key = (Source::Transport, Box::from(reason), Subject::Peer(ip));
        self.lock()
            .add(key, OffsetDateTime::now_utc(), self.max_keys);
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Takes everything folded so far.
    pub fn take(&self) -> Folded {
        std::mem::take(&mut *self.lock())
    }

    /// Puts back a key whose record could not be written (written with the
    /// next drain).
    pub fn restore_one(&self, key: Key, tally: Tally) {
        self.lock().add_tally(key, tally, self.max_keys);
    }

    /// Puts back what could not be written (kept for the next drain).
    pub fn restore(&self, back: Folded) {
        let mut f = self.lock();
        for (k, t) in back.entries() {
            f.add_tally(k, t, self.max_keys);
        }
    }

    /// Writes one record per key through `sink`; a key whose record the sink
    /// refuses is kept for the next flush.
    pub fn flush(&self, sink: &dyn AuditSink) {
        let folded = self.take();
        if folded.is_empty() {
            return;
        }
        let now = OffsetDateTime::now_utc();
        for (key, tally) in folded.entries() {
            let mut r = record(&key, &tally, now);
            r.bound();
            if sink.emit(&r).is_err() {
                self.restore_one(key, tally);
            }
        }
    }

    /// Flushes every `interval` (when no audit writer drains the table).
    pub async fn run(
        self: std::sync::Arc<Self>,
        sink: std::sync::Arc<dyn AuditSink>,
        interval: std::time::Duration,
    ) {
        every(interval, || self.flush(sink.as_ref())).await
    }
}

/// Calls `f` every `interval` (the first time one interval from now),
/// forever; a late tick is not made up for.
pub async fn every(interval: std::time::Duration, mut f: impl FnMut()) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        f();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_700_000_000 + s).unwrap()
    }

    fn key(reason: &str, subject: Subject) -> Key {
        (Source::AuditQueueFull, reason.into(), subject)
    }

    fn id(s: &str) -> Subject {
        Subject::Identity(s.into())
    }

    fn peer(i: u32) -> Subject {
        Subject::Peer(IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + i)))
    }

    #[test]
    fn a_new_caller_takes_the_place_of_the_lowest_ranked_and_totals_stay_exact() {
        let mut f = Folded::default();
        // (key, time) under a cap of 2 named keys.
        let events = [
            (key("denylist_node", id("a")), 5),
            (key("denylist_node", id("a")), 1),
            (key("denylist_node", id("b")), 3),
            // Full: c replaces b (rank 1, below a's 2); b's count moves to
            // its reason's overflow, c ranks just above it.
            (key("denylist_node", id("c")), 4),
            // Another reason: a and c both rank 2; a was counted last at
            // event 2, c at event 4, so a is the staler and gives way.
            (key("denylist_pod", id("d")), 9),
            (key("denylist_node", Subject::Overflow), 6),
        ];
        for (k, t) in events {
            f.add(k, at(t), 2);
        }
        let tally = |k: Key| f.get(&k).map(|t| (t.count, t.first, t.last));
        assert_eq!(tally(key("denylist_node", id("a"))), None);
        assert_eq!(tally(key("denylist_node", id("b"))), None);
        assert_eq!(
            tally(key("denylist_node", id("c"))),
            Some((1, at(4), at(4)))
        );
        assert_eq!(tally(key("denylist_pod", id("d"))), Some((1, at(9), at(9))));
        // a (2) and b (1) lost their names, plus one counted as overflow.
        assert_eq!(
            tally(key("denylist_node", Subject::Overflow)),
            Some((4, at(1), at(6)))
        );
        assert_eq!(tally(key("denylist_pod", Subject::Overflow)), None);
        assert_eq!(f.total(), 6, "nothing uncounted, nothing counted twice");
        let records = f.records(at(10));
        assert_eq!(records.len(), 3);
        assert!(records.iter().all(|r| r.decision == Decision::Deny));
        let sum: u64 = records.iter().map(|r| r.count.unwrap()).sum();
        assert_eq!(sum, 6);
        // Overflow keys come last and name no caller.
        assert_eq!(records[2].peer.as_deref(), Some(OVERFLOW));
        assert_eq!(records[2].caller_identity, None);
        assert_eq!(records[0].caller_identity.as_deref(), Some("c"));
        let agg = records[2].aggregate.clone().unwrap();
        assert_eq!(
            (agg.source.as_str(), agg.first, agg.last),
            ("audit_queue_full", at(1), at(6))
        );
    }

    /// An attacker sprays refusals from thousands of source addresses to
    /// fill the table before a heavy caller shows up: the heavy caller still
    /// gets its name and its exact count, junk sources replace each other,
    /// and the totals per reason stay exact.
    #[test]
    fn a_heavy_caller_keeps_its_name_among_sprayed_sources() {
        const CAP: usize = 8;
        let mut f = Folded::default();
        let heavy = key("authn_no_credentials", peer(1_000_000));
        let mut junk = 0u32;
        let mut spray = |f: &mut Folded, n: u32| {
            for _ in 0..n {
                junk += 1;
                f.add(key("authn_no_credentials", peer(junk)), at(0), CAP);
            }
        };
        spray(&mut f, 100);
        // One heavy refusal for every two sprayed sources.
        for _ in 0..3000 {
            f.add(heavy.clone(), at(1), CAP);
            spray(&mut f, 2);
        }
        spray(&mut f, 100);
        assert_eq!(f.total(), 100 + 3000 * 3 + 100, "exact totals");
        assert_eq!(f.get(&heavy).map(|t| t.count), Some(3000), "named, exactly");
        let named = f
            .entries()
            .iter()
            .filter(|(k, _)| k.2 != Subject::Overflow)
            .count();
        assert_eq!(named, CAP);
        let over = f
            .get(&key("authn_no_credentials", Subject::Overflow))
            .unwrap()
            .count;
        assert_eq!(over, 100 + 3000 * 2 + 100 - (CAP as u64 - 1));
    }

    #[test]
    fn subject_is_the_identity_else_the_source_address() {
        let mut r = AuditRecord::new(at(0), "x".into(), Decision::Deny, "r".into());
        assert_eq!(Subject::of(&r), Subject::Overflow);
        r.peer = Some("10.1.2.3:4567".into());
        assert_eq!(Subject::of(&r), Subject::Peer("10.1.2.3".parse().unwrap()));
        r.peer = Some("[fd00::1]:80".into());
        assert_eq!(Subject::of(&r), Subject::Peer("fd00::1".parse().unwrap()));
        r.caller_identity = Some("spiffe://td/ns/a/sa/b".into());
        assert_eq!(Subject::of(&r), id("spiffe://td/ns/a/sa/b"));
    }

    #[test]
    fn only_requests_refused_before_an_identity_are_unauthenticated_refusals() {
        let base = || {
            let mut r = AuditRecord::new(at(0), "x".into(), Decision::Deny, "r".into());
            r.peer = Some("10.0.0.1:5000".into());
            r
        };
        type Edit = fn(&mut AuditRecord);
        let cases: [(&str, Edit, bool); 8] = [
            ("refused, no identity", |_| {}, true),
            (
                "empty identity",
                |r| r.caller_identity = Some(String::new()),
                true,
            ),
            (
                "authenticated",
                |r| r.caller_identity = Some("spiffe://td/ns/a/sa/b".into()),
                false,
            ),
            ("issued", |r| r.decision = Decision::Allow, false),
            ("an event (no peer)", |r| r.peer = None, false),
            ("an aggregate", |r| r.count = Some(3), false),
            (
                "a certificate meshca issued itself",
                |r| r.issued_kind = Some("serving".into()),
                false,
            ),
            (
                "a pod certificate decision",
                |r| r.pod_certificate_request = Some("ns/x".into()),
                false,
            ),
        ];
        for (what, edit, want) in cases {
            let mut r = base();
            edit(&mut r);
            assert_eq!(unauthenticated_refusal(&r), want, "{what}");
        }
    }

    #[test]
    fn an_issued_record_that_was_not_queued_is_a_queue_full_refusal() {
        let agg = Aggregator::new(8);
        let mut r = AuditRecord::new(at(0), "x".into(), Decision::Allow, "issued".into());
        r.caller_identity = Some("spiffe://td/ns/a/sa/b".into());
        agg.fold_record(&r);
        let f = agg.take();
        assert_eq!(
            f.entries().first().map(|(k, _)| k.1.to_string()),
            Some("audit_queue_full".into())
        );
        assert!(agg.is_empty());
    }

    /// A sink that refuses what it is given keeps nothing from being lost:
    /// the counts come back for the next flush.
    #[test]
    fn a_refused_flush_keeps_the_counts() {
        #[derive(Debug)]
        struct Refuse;
        impl AuditSink for Refuse {
            fn emit(&self, _: &AuditRecord) -> Result<(), super::super::AuditError> {
                Err(super::super::AuditError("full".into()))
            }
        }
        let agg = Aggregator::new(8);
        for _ in 0..3 {
            agg.fold_transport("10.0.0.1".parse().unwrap(), "message_too_large");
        }
        agg.flush(&Refuse);
        assert_eq!(agg.take().total(), 3);
        let mem = crate::audit::MemorySink::default();
        for _ in 0..2 {
            agg.fold_transport("10.0.0.2".parse().unwrap(), "request_timeout");
        }
        agg.flush(&mem);
        let recs = mem.records();
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0].count, Some(2));
        assert_eq!(recs[0].reason, "request_timeout");
        assert_eq!(recs[0].peer.as_deref(), Some("10.0.0.2"));
        assert!(agg.is_empty());
    }
}
