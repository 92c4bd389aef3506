//! Refusals that could not get a record of their own, folded into bounded
//! aggregate records so that every refused caller is still named in the
//! chain. Two sources feed it:
//!
//! - the audit writer, when its queue is full and a record cannot be queued
//!   (a flood of cheap refusals must not hide a probe among them);
//! - the transport's request gate and connection limits, whose refusals
//!   happen before any request record exists.
//!
//! Keys are (reason, subject): the caller's identity when it is known, else
//! its source address. At most `max_keys` keys are kept; beyond them the
//! counts go to one key per reason with the subject `overflow`, so memory is
//! bounded and no refusal is uncounted. Each key becomes one `deny` record
//! with `count` and the first and last time it was seen.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;

use time::OffsetDateTime;

use super::{Aggregate, AuditRecord, AuditSink, Decision};

/// Subject of the key where sources over the cap are counted.
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
    /// Anything over the key cap.
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

/// Why refusals were folded rather than written one by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// The audit writer's queue was full.
    AuditQueueFull,
    /// Refused by the transport before a request record existed.
    Transport,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AuditQueueFull => "audit_queue_full",
            Self::Transport => "transport",
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

/// The folded refusals of one interval (plain data; table-tested).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Folded {
    pub tallies: HashMap<Key, Tally>,
}

impl Folded {
    /// Counts one refusal at `at`; a new key beyond `max_keys` is counted
    /// under its reason's overflow key instead.
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
        let key = if self.tallies.contains_key(&key) || self.tallies.len() < max_keys {
            key
        } else {
            (key.0, key.1, Subject::Overflow)
        };
        match self.tallies.get_mut(&key) {
            Some(existing) => existing.merge(&t),
            None => {
                self.tallies.insert(key, t);
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.tallies.is_empty()
    }

    pub fn total(&self) -> u64 {
        self.tallies.values().map(|t| t.count).sum()
    }

    /// One `deny` record per key, in a stable order (overflow keys last),
    /// stamped `now`.
    pub fn records(&self, now: OffsetDateTime) -> Vec<AuditRecord> {
        let mut keys: Vec<(&Key, &Tally)> = self.tallies.iter().collect();
        keys.sort_by(|a, b| {
            let over = |k: &Key| k.2 == Subject::Overflow;
            (over(a.0), a.0).cmp(&(over(b.0), b.0))
        });
        keys.into_iter()
            .map(|((source, reason, subject), t)| {
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
            })
            .collect()
    }
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

    /// Puts back what could not be written (kept for the next drain).
    pub fn restore(&self, back: Folded) {
        let mut f = self.lock();
        for (k, t) in back.tallies {
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
        let mut kept = Folded::default();
        let mut keys: Vec<(Key, Tally)> = folded.tallies.into_iter().collect();
        keys.sort_by(|a, b| a.0.cmp(&b.0));
        for (key, tally) in keys {
            let one = Folded {
                tallies: HashMap::from([(key.clone(), tally)]),
            };
            for mut r in one.records(now) {
                r.bound();
                if sink.emit(&r).is_err() {
                    kept.add_tally(key.clone(), tally, usize::MAX);
                }
            }
        }
        if !kept.is_empty() {
            self.restore(kept);
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

    #[test]
    fn counts_first_and_last_per_key_and_overflow_per_reason() {
        let mut f = Folded::default();
        // (key, time): two subjects fit under a cap of 2; the third spills.
        let events = [
            (key("denylist_node", id("a")), 5),
            (key("denylist_node", id("a")), 1),
            (key("denylist_node", id("b")), 3),
            (key("denylist_node", id("c")), 4),
            (key("denylist_pod", id("d")), 9),
            (key("denylist_node", id("a")), 7),
        ];
        for (k, t) in events {
            f.add(k, at(t), 2);
        }
        let tally = |k: Key| {
            f.tallies
                .get(&k)
                .copied()
                .map(|t| (t.count, t.first, t.last))
        };
        assert_eq!(
            tally(key("denylist_node", id("a"))),
            Some((3, at(1), at(7)))
        );
        assert_eq!(
            tally(key("denylist_node", id("b"))),
            Some((1, at(3), at(3)))
        );
        assert_eq!(tally(key("denylist_node", id("c"))), None);
        assert_eq!(
            tally(key("denylist_node", Subject::Overflow)),
            Some((1, at(4), at(4)))
        );
        assert_eq!(
            tally(key("denylist_pod", Subject::Overflow)),
            Some((1, at(9), at(9)))
        );
        assert_eq!(f.total(), 6, "nothing uncounted");
        let records = f.records(at(10));
        assert_eq!(records.len(), 4);
        assert!(records.iter().all(|r| r.decision == Decision::Deny));
        let sum: u64 = records.iter().map(|r| r.count.unwrap()).sum();
        assert_eq!(sum, 6);
        // Overflow keys come last and name no caller.
        assert_eq!(records[3].peer.as_deref(), Some(OVERFLOW));
        assert_eq!(records[0].caller_identity.as_deref(), Some("a"));
        let agg = records[0].aggregate.clone().unwrap();
        assert_eq!(
            (agg.source.as_str(), agg.first, agg.last),
            ("audit_queue_full", at(1), at(7))
        );
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
    fn an_issued_record_that_was_not_queued_is_a_queue_full_refusal() {
        let agg = Aggregator::new(8);
        let mut r = AuditRecord::new(at(0), "x".into(), Decision::Allow, "issued".into());
        r.caller_identity = Some("spiffe://td/ns/a/sa/b".into());
        agg.fold_record(&r);
        let f = agg.take();
        assert_eq!(
            f.tallies.keys().next().map(|k| &*k.1),
            Some("audit_queue_full")
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
