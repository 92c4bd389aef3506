//! The revocations in force, as an append-only ledger over its sources.
//!
//! Every entry ever read from a source (the revocation file, the shared
//! ConfigMap) or adopted from a published CRL is kept. A source that goes
//! missing, becomes unreadable, or loses entries changes nothing in force:
//! each such change is reported once as an event of its own (the server
//! audits it). Only an explicit un-revocation entry (`meshca revoke --undo`)
//! lifts a revocation. Plain data in, events out: [`Ledger::apply`] is what
//! the tables test.

use std::collections::{BTreeMap, BTreeSet};

use time::OffsetDateTime;

use super::Revocation;

/// Where entries come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StoreSource {
    File = 0,
    ConfigMap = 1,
}

impl StoreSource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::File => "file",
            Self::ConfigMap => "configmap",
        }
    }
}

/// What one read of a source found.
#[derive(Debug, Clone, PartialEq)]
pub enum SourceRead {
    Entries(Vec<Revocation>),
    /// The file or ConfigMap does not exist.
    Missing,
    /// It exists but could not be read or parsed (a torn line, an API error).
    Unreadable(String),
}

/// What changed, for the audit log and `meshca_revocation_events_total`.
#[derive(Debug, Clone, PartialEq)]
pub enum LedgerEvent {
    /// A source's first read: how many entries it had.
    Loaded {
        source: StoreSource,
        entries: usize,
    },
    Revoked(Revocation),
    Unrevoked(Revocation),
    /// An entry no longer in its source; it stays in force.
    RemovalRefused {
        source: StoreSource,
        entry: Revocation,
    },
    /// A source that was there is gone; nothing changed in force.
    SourceMissing(StoreSource),
    /// A source could not be read; nothing changed in force.
    SourceUnreadable(StoreSource, String),
    /// A serial listed by a CRL this CA signed and published, unknown to
    /// every source (they lost it): revoked again from that CRL.
    Adopted(Revocation),
}

/// Every value of [`LedgerEvent::reason`]: the `reason` label of
/// `meshca_revocation_events_total`, exported from zero so that a rate (and
/// an alert) sees the first event.
pub const REASONS: [&str; 7] = [
    "revocation_list_loaded",
    "revoked",
    "unrevoked",
    "revocation_removal_refused",
    "revocation_source_missing",
    "revocation_source_unreadable",
    "revocation_adopted",
];

impl LedgerEvent {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Loaded { .. } => "revocation_list_loaded",
            Self::Revoked(_) => "revoked",
            Self::Unrevoked(_) => "unrevoked",
            Self::RemovalRefused { .. } => "revocation_removal_refused",
            Self::SourceMissing(_) => "revocation_source_missing",
            Self::SourceUnreadable(..) => "revocation_source_unreadable",
            Self::Adopted(_) => "revocation_adopted",
        }
    }
}

/// An entry's identity: serial, kind and time (the same entry read twice,
/// or from two sources, is one entry).
type Key = (String, bool, i128);

fn key(r: &Revocation) -> Key {
    (
        r.serial.clone(),
        r.is_unrevoke(),
        r.revoked_at.unix_timestamp_nanos(),
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Health {
    /// Never read successfully.
    #[default]
    Unread,
    Present,
    Missing,
    Unreadable,
}

/// Every entry seen, and what each source last showed.
#[derive(Debug, Default)]
pub struct Ledger {
    entries: BTreeMap<Key, Revocation>,
    /// Per source: the keys of its last good read.
    last: [Option<BTreeSet<Key>>; 2],
    health: [Health; 2],
    /// Removals already reported (once each, until the entry comes back).
    refused: BTreeSet<Key>,
}

impl Ledger {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether `source` has been read once (present or missing).
    pub fn loaded(&self, source: StoreSource) -> bool {
        self.last[source as usize].is_some()
    }

    /// Applies one read of `source` at `now`.
    pub fn apply(
        &mut self,
        source: StoreSource,
        read: SourceRead,
        now: OffsetDateTime,
    ) -> Vec<LedgerEvent> {
        let i = source as usize;
        let mut events = Vec::new();
        match read {
            SourceRead::Missing => {
                match self.health[i] {
                    // Not created yet: an empty source.
                    Health::Unread => events.push(LedgerEvent::Loaded { source, entries: 0 }),
                    Health::Present | Health::Unreadable => {
                        events.push(LedgerEvent::SourceMissing(source))
                    }
                    Health::Missing => {}
                }
                self.last[i].get_or_insert_with(BTreeSet::new);
                self.health[i] = Health::Missing;
            }
            SourceRead::Unreadable(why) => {
                if self.health[i] != Health::Unreadable {
                    events.push(LedgerEvent::SourceUnreadable(source, why));
                }
                // A source unreadable from the start has not loaded.
                if self.health[i] != Health::Unread {
                    self.health[i] = Health::Unreadable;
                }
            }
            SourceRead::Entries(list) => {
                let first = self.last[i].is_none();
                let keys: BTreeSet<Key> = list.iter().map(key).collect();
                for r in list {
                    let k = key(&r);
                    self.refused.remove(&k);
                    if self.entries.contains_key(&k) {
                        continue;
                    }
                    if !first {
                        events.push(match r.is_unrevoke() {
                            true => LedgerEvent::Unrevoked(r.clone()),
                            false => LedgerEvent::Revoked(r.clone()),
                        });
                    }
                    self.entries.insert(k, r);
                }
                if first {
                    events.push(LedgerEvent::Loaded {
                        source,
                        entries: keys.len(),
                    });
                }
                if let Some(prev) = &self.last[i] {
                    for gone in prev.difference(&keys) {
                        let Some(entry) = self.entries.get(gone) else {
                            continue;
                        };
                        // Pruning an expired certificate's entries changes nothing.
                        if entry.not_after.is_some_and(|t| t < now) {
                            continue;
                        }
                        if self.refused.insert(gone.clone()) {
                            events.push(LedgerEvent::RemovalRefused {
                                source,
                                entry: entry.clone(),
                            });
                        }
                    }
                }
                // What a source showed is remembered as the union with what
                // it lost, so a removal is reported once, not on every read.
                let mut kept = keys;
                kept.extend(self.refused.iter().cloned());
                self.last[i] = Some(kept);
                self.health[i] = Health::Present;
            }
        }
        events
    }

    /// Whether any entry (revocation or un-revocation) names `serial`.
    pub fn knows(&self, serial: &str) -> bool {
        self.entries
            .range((serial.to_string(), false, i128::MIN)..)
            .next()
            .is_some_and(|(k, _)| k.0 == serial)
    }

    /// Revocations from a CRL this CA signed, for serials no entry names:
    /// what the sources lost comes back (a serial un-revoked or merely
    /// known is left alone).
    pub fn adopt(&mut self, from_crl: Vec<Revocation>) -> Vec<LedgerEvent> {
        let mut events = Vec::new();
        for r in from_crl {
            if self.knows(&r.serial) || r.is_unrevoke() {
                continue;
            }
            events.push(LedgerEvent::Adopted(r.clone()));
            self.entries.insert(key(&r), r);
        }
        events
    }

    /// One entry per serial in force: the serial's latest entry is a
    /// revocation (a revocation and an un-revocation at the same instant:
    /// the revocation). The entry is the earliest revocation since the last
    /// un-revocation (its time goes into the CRL).
    pub fn in_force(&self) -> Vec<Revocation> {
        let mut by_serial: BTreeMap<&str, Vec<&Revocation>> = BTreeMap::new();
        for r in self.entries.values() {
            by_serial.entry(&r.serial).or_default().push(r);
        }
        let mut out = Vec::new();
        for entries in by_serial.values() {
            let lifted_at = entries
                .iter()
                .filter(|r| r.is_unrevoke())
                .map(|r| r.revoked_at)
                .max();
            let first_since = entries
                .iter()
                .filter(|r| !r.is_unrevoke())
                .filter(|r| lifted_at.is_none_or(|u| r.revoked_at >= u))
                .min_by_key(|r| r.revoked_at);
            if let Some(r) = first_since {
                out.push((*r).clone());
            }
        }
        out
    }

    /// Serials whose absence from a CRL is explained: un-revoked (latest
    /// entry), or their certificate expired before `now`.
    pub fn lifted(&self, now: OffsetDateTime) -> BTreeSet<String> {
        let in_force: BTreeSet<String> = self.in_force().into_iter().map(|r| r.serial).collect();
        self.entries
            .values()
            .filter(|r| !in_force.contains(&r.serial) || r.not_after.is_some_and(|t| t < now))
            .map(|r| r.serial.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    const NOW: OffsetDateTime = datetime!(2026-06-01 12:00 UTC);

    fn rev(serial: &str, minute: u8, unrevoke: bool) -> Revocation {
        Revocation {
            serial: serial.into(),
            reason: if unrevoke {
                "remove-from-crl"
            } else {
                "key-compromise"
            }
            .into(),
            revoked_at: datetime!(2026-06-01 11:00 UTC) + time::Duration::minutes(minute.into()),
            identity: None,
            node: None,
            not_after: Some(datetime!(2026-06-02 00:00 UTC)),
            by: None,
            action: unrevoke.then(|| super::super::UNREVOKE.to_string()),
        }
    }

    fn reasons(e: &[LedgerEvent]) -> Vec<&'static str> {
        e.iter().map(LedgerEvent::reason).collect()
    }

    #[test]
    fn reasons_lists_every_event_reason_once() {
        let r = rev("aa", 0, false);
        let every = [
            LedgerEvent::Loaded {
                source: StoreSource::File,
                entries: 0,
            },
            LedgerEvent::Revoked(r.clone()),
            LedgerEvent::Unrevoked(r.clone()),
            LedgerEvent::RemovalRefused {
                source: StoreSource::ConfigMap,
                entry: r.clone(),
            },
            LedgerEvent::SourceMissing(StoreSource::ConfigMap),
            LedgerEvent::SourceUnreadable(StoreSource::ConfigMap, "x".into()),
            LedgerEvent::Adopted(r),
        ];
        // A new variant must be added above (the match in `reason` is exhaustive).
        let got: BTreeSet<&str> = every.iter().map(LedgerEvent::reason).collect();
        assert_eq!(got.len(), every.len());
        assert_eq!(got, REASONS.into_iter().collect::<BTreeSet<_>>());
    }

    fn serials(l: &Ledger) -> Vec<String> {
        l.in_force().into_iter().map(|r| r.serial).collect()
    }

    use SourceRead::{Entries, Missing, Unreadable};
    use StoreSource::{ConfigMap, File};

    /// Each step: the read of a source, the events it gives, the serials
    /// in force after it.
    #[test]
    fn the_ledger_only_grows_and_says_what_it_refused() {
        let a = rev("aa", 0, false);
        let b = rev("bb", 1, false);
        let undo_a = rev("aa", 5, true);
        let again_a = rev("aa", 9, false);
        let mut expired = rev("ee", 2, false);
        expired.not_after = Some(datetime!(2026-06-01 00:00 UTC));
        let steps: Vec<(StoreSource, SourceRead, Vec<&str>, Vec<&str>)> = vec![
            // The ConfigMap does not exist yet: loaded, empty.
            (ConfigMap, Missing, vec!["revocation_list_loaded"], vec![]),
            (ConfigMap, Missing, vec![], vec![]),
            // Created with two entries: each audited.
            (
                ConfigMap,
                Entries(vec![a.clone(), b.clone()]),
                vec!["revoked", "revoked"],
                vec!["aa", "bb"],
            ),
            // The same read again: nothing new.
            (
                ConfigMap,
                Entries(vec![a.clone(), b.clone()]),
                vec![],
                vec!["aa", "bb"],
            ),
            // Deleted: refused once, nothing lifted.
            (
                ConfigMap,
                Missing,
                vec!["revocation_source_missing"],
                vec!["aa", "bb"],
            ),
            (ConfigMap, Missing, vec![], vec!["aa", "bb"]),
            // Recreated without bb: bb's removal is refused, once.
            (
                ConfigMap,
                Entries(vec![a.clone()]),
                vec!["revocation_removal_refused"],
                vec!["aa", "bb"],
            ),
            (
                ConfigMap,
                Entries(vec![a.clone()]),
                vec![],
                vec!["aa", "bb"],
            ),
            // Emptied: aa's removal refused too.
            (
                ConfigMap,
                Entries(vec![]),
                vec!["revocation_removal_refused"],
                vec!["aa", "bb"],
            ),
            // Unreadable (torn line, API error): once per episode.
            (
                ConfigMap,
                Unreadable("line 1".into()),
                vec!["revocation_source_unreadable"],
                vec!["aa", "bb"],
            ),
            (
                ConfigMap,
                Unreadable("line 1".into()),
                vec![],
                vec!["aa", "bb"],
            ),
            // Back with an explicit un-revocation of aa: lifted, audited.
            (
                ConfigMap,
                Entries(vec![a.clone(), b.clone(), undo_a.clone()]),
                vec!["unrevoked"],
                vec!["bb"],
            ),
            // Revoked again after the undo: in force again.
            (
                ConfigMap,
                Entries(vec![a.clone(), b.clone(), undo_a.clone(), again_a.clone()]),
                vec!["revoked"],
                vec!["aa", "bb"],
            ),
            // The file source is independent; its first read is a summary.
            (
                File,
                Entries(vec![expired.clone()]),
                vec!["revocation_list_loaded"],
                vec!["aa", "bb", "ee"],
            ),
            // Pruning an expired certificate's entry is no removal.
            (File, Entries(vec![]), vec![], vec!["aa", "bb", "ee"]),
        ];
        let mut l = Ledger::new();
        for (i, (source, read, want_events, want_serials)) in steps.into_iter().enumerate() {
            let events = l.apply(source, read, NOW);
            assert_eq!(reasons(&events), want_events, "step {i}");
            assert_eq!(serials(&l), want_serials, "step {i}");
        }
        // aa's CRL entry is its revocation after the undo.
        let aa = l.in_force().into_iter().find(|r| r.serial == "aa").unwrap();
        assert_eq!(aa.revoked_at, again_a.revoked_at);
        assert!(l.loaded(File) && l.loaded(ConfigMap));
    }

    #[test]
    fn a_source_unreadable_from_the_start_has_not_loaded() {
        let mut l = Ledger::new();
        let e = l.apply(ConfigMap, Unreadable("connection refused".into()), NOW);
        assert_eq!(reasons(&e), ["revocation_source_unreadable"]);
        assert!(!l.loaded(ConfigMap));
        let e = l.apply(ConfigMap, Entries(vec![rev("aa", 0, false)]), NOW);
        assert_eq!(reasons(&e), ["revocation_list_loaded"]);
        assert!(l.loaded(ConfigMap));
        assert_eq!(serials(&l), ["aa"]);
    }

    #[test]
    fn a_revocation_and_an_undo_at_the_same_instant_leave_it_revoked() {
        let mut l = Ledger::new();
        l.apply(
            File,
            Entries(vec![rev("aa", 3, false), rev("aa", 3, true)]),
            NOW,
        );
        assert_eq!(serials(&l), ["aa"]);
    }

    #[test]
    fn adoption_brings_back_only_serials_no_entry_names() {
        let mut l = Ledger::new();
        l.apply(
            ConfigMap,
            Entries(vec![
                rev("aa", 0, false),
                rev("aa", 5, true),
                rev("bb", 1, false),
            ]),
            NOW,
        );
        assert_eq!(serials(&l), ["bb"]);
        let e = l.adopt(vec![
            rev("aa", 0, false),
            rev("bb", 1, false),
            rev("cc", 2, false),
        ]);
        assert_eq!(reasons(&e), ["revocation_adopted"], "only cc");
        assert_eq!(serials(&l), ["bb", "cc"], "aa stays lifted");
        assert!(l.knows("cc") && !l.knows("c") && !l.knows("dd"));
        let lifted = l.lifted(NOW);
        assert!(lifted.contains("aa") && !lifted.contains("bb"));
    }
}
