//! ServiceAccounts as local token verification and the TokenReview cache
//! need them: the UID and the deletion state of each one. A bound token
//! names its ServiceAccount's UID; the API server refuses the token once
//! that account is gone, recreated (new UID) or deleting past the leeway,
//! and so must local verification and a cached review.
//!
//! Fed by a metadata-only watch (object metadata, no secrets travel; the
//! index keeps names, UIDs and deletion timestamps), so it stays small: one entry per
//! ServiceAccount, and clusters have far fewer of those than pods. The
//! update function ([`AccountState::apply`]) is pure and table-tested.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::ServiceAccount;
use kube::{Api, Client};

use super::listwatch::{KubeSource, Timing};
use super::{IndexEvent, Indexed, Shared};

/// A ServiceAccount as the index keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeanAccount {
    pub namespace: Box<str>,
    pub name: Box<str>,
    pub uid: Box<str>,
    /// `metadata.deletionTimestamp`, Unix seconds.
    pub deletion_timestamp: Option<i64>,
}

/// One indexed ServiceAccount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccountRef<'a> {
    pub uid: &'a str,
    pub deletion_timestamp: Option<i64>,
}

#[derive(Debug, Clone)]
struct Entry {
    uid: Box<str>,
    deletion_timestamp: Option<i64>,
}

/// The index contents; [`Indexed::apply`] is the only mutator.
#[derive(Debug, Clone, Default)]
pub struct AccountState {
    /// namespace -> name -> entry (two levels, so a lookup allocates nothing).
    by_ns: HashMap<Box<str>, HashMap<Box<str>, Entry>>,
    len: usize,
    synced: bool,
}

impl AccountState {
    fn upsert(&mut self, a: LeanAccount) {
        let entry = Entry {
            uid: a.uid,
            deletion_timestamp: a.deletion_timestamp,
        };
        if self
            .by_ns
            .entry(a.namespace)
            .or_default()
            .insert(a.name, entry)
            .is_none()
        {
            self.len += 1;
        }
    }

    fn remove(&mut self, namespace: &str, name: &str) {
        let Some(names) = self.by_ns.get_mut(namespace) else {
            return;
        };
        if names.remove(name).is_some() {
            self.len -= 1;
        }
        if names.is_empty() {
            self.by_ns.remove(namespace);
        }
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<AccountRef<'_>> {
        let e = self.by_ns.get(namespace)?.get(name)?;
        Some(AccountRef {
            uid: &e.uid,
            deletion_timestamp: e.deletion_timestamp,
        })
    }
}

impl Indexed for AccountState {
    type Item = LeanAccount;

    /// A synced state holding exactly `accounts` (a completed list).
    fn from_list(accounts: Vec<LeanAccount>) -> Self {
        let mut s = Self::default();
        for a in accounts {
            s.upsert(a);
        }
        s.synced = true;
        s
    }

    /// Applies one change. Lists are built whole by [`AccountIndex`]
    /// ([`Indexed::from_list`]), so list markers change nothing here.
    fn apply(&mut self, event: IndexEvent<LeanAccount>) {
        match event {
            IndexEvent::Init | IndexEvent::InitDone => {}
            IndexEvent::InitApply(a) | IndexEvent::Apply(a) => self.upsert(a),
            IndexEvent::Delete(a) => self.remove(&a.namespace, &a.name),
        }
    }

    fn synced(&self) -> bool {
        self.synced
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// The shared, concurrently readable ServiceAccount index of one cluster.
pub type AccountIndex = Shared<AccountState>;

fn lean(m: kube::core::PartialObjectMeta<ServiceAccount>) -> LeanAccount {
    let meta = m.metadata;
    LeanAccount {
        namespace: meta.namespace.unwrap_or_default().into_boxed_str(),
        name: meta.name.unwrap_or_default().into_boxed_str(),
        uid: meta.uid.unwrap_or_default().into_boxed_str(),
        deletion_timestamp: meta.deletion_timestamp.map(|t| t.0.as_second()),
    }
}

/// Watches the metadata of all ServiceAccounts forever, with freshness
/// bounded by evidence ([`super::listwatch`]); the index keeps its last
/// state (and says how stale it is) while the API server is unreachable.
pub async fn run(client: Client, index: Arc<AccountIndex>, timing: Timing) {
    // Metadata only (the API's PartialObjectMetadata lists and watches): a
    // ServiceAccount's secrets and image pull secrets never travel.
    let source = KubeSource {
        api: Api::<kube::core::PartialObjectMeta<ServiceAccount>>::all(client),
        fields: None,
    };
    super::listwatch::run(source, &index, "service account", lean, timing).await
}

/// A synced account state from `(namespace, name, uid, deletion)` rows.
#[cfg(test)]
pub(crate) fn state_of(rows: &[(&str, &str, &str, Option<i64>)]) -> AccountState {
    AccountState::from_list(
        rows.iter()
            .map(|(ns, name, uid, del)| LeanAccount {
                namespace: Box::from(*ns),
                name: Box::from(*name),
                uid: Box::from(*uid),
                deletion_timestamp: *del,
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(name: &str, uid: &str, del: Option<i64>) -> LeanAccount {
        LeanAccount {
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
            deletion_timestamp: del,
        }
    }

    /// (events, synced, len, uid of ns/x)
    #[test]
    fn events_table() {
        type Case = (
            Vec<IndexEvent<LeanAccount>>,
            bool,
            usize,
            Option<&'static str>,
        );
        let cases: Vec<Case> = vec![
            (vec![], false, 0, None),
            (
                vec![IndexEvent::Apply(a("x", "u1", None))],
                false,
                1,
                Some("u1"),
            ),
            (
                vec![IndexEvent::Init, IndexEvent::InitApply(a("x", "u1", None))],
                false,
                0,
                None,
            ),
            (
                vec![
                    IndexEvent::Init,
                    IndexEvent::InitApply(a("x", "u1", None)),
                    IndexEvent::InitDone,
                ],
                true,
                1,
                Some("u1"),
            ),
            // Deleted and recreated: the new UID replaces the old.
            (
                vec![
                    IndexEvent::Init,
                    IndexEvent::InitApply(a("x", "u1", None)),
                    IndexEvent::InitDone,
                    IndexEvent::Delete(a("x", "u1", None)),
                    IndexEvent::Apply(a("x", "u2", None)),
                ],
                true,
                1,
                Some("u2"),
            ),
            // A relist that no longer has it drops it.
            (
                vec![
                    IndexEvent::Apply(a("x", "u1", None)),
                    IndexEvent::Init,
                    IndexEvent::InitApply(a("y", "u3", None)),
                    IndexEvent::InitDone,
                ],
                true,
                1,
                None,
            ),
            (
                vec![
                    IndexEvent::Apply(a("x", "u1", None)),
                    IndexEvent::Delete(a("x", "u1", None)),
                ],
                false,
                0,
                None,
            ),
        ];
        for (i, (events, synced, len, uid)) in cases.into_iter().enumerate() {
            let shared = AccountIndex::new();
            for e in events {
                shared.apply(e);
            }
            assert_eq!(shared.is_synced(), synced, "case {i} shared");
            assert_eq!(shared.len() as usize, len, "case {i} shared");
            assert_eq!(
                shared.read(|s| s.get("ns", "x").map(|r| r.uid.to_string())),
                uid.map(str::to_string),
                "case {i} shared"
            );
        }
    }

    #[test]
    fn keeps_the_deletion_timestamp() {
        let mut s = AccountState::default();
        s.apply(IndexEvent::Apply(a("x", "u1", Some(42))));
        assert_eq!(s.get("ns", "x").unwrap().deletion_timestamp, Some(42));
        s.apply(IndexEvent::Apply(a("x", "u1", None)));
        assert_eq!(s.get("ns", "x").unwrap().deletion_timestamp, None);
    }
}
