//! ServiceAccounts as local token verification needs them: the UID and the
//! deletion state of each one. A bound token names its ServiceAccount's UID;
//! the API server refuses the token once that account is gone, recreated
//! (new UID) or deleting past the leeway, and so must local verification.
//!
//! Fed by a metadata-only watch (names, UIDs and deletion timestamps; no
//! secrets or annotations travel), so it stays small: one entry per
//! ServiceAccount, and clusters have far fewer of those than pods. The
//! update function ([`AccountState::apply`]) is pure and table-tested.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};

use super::WatchHealth;

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

/// The index contents; [`AccountState::apply`] is the only mutator.
#[derive(Debug, Clone, Default)]
pub struct AccountState {
    /// namespace -> name -> entry (two levels, so a lookup allocates nothing).
    by_ns: HashMap<Box<str>, HashMap<Box<str>, Entry>>,
    len: usize,
    relist: Option<Vec<LeanAccount>>,
    synced: bool,
}

impl AccountState {
    /// Applies one watch event (kube-runtime's vocabulary).
    pub fn apply(&mut self, event: Event<LeanAccount>) {
        match event {
            Event::Init => self.relist = Some(Vec::new()),
            Event::InitApply(a) => match &mut self.relist {
                Some(buf) => buf.push(a),
                None => self.upsert(a),
            },
            Event::InitDone => {
                let accounts = self.relist.take().unwrap_or_default();
                *self = Self::from_list(accounts);
            }
            Event::Apply(a) => self.upsert(a),
            Event::Delete(a) => self.remove(&a.namespace, &a.name),
        }
    }

    /// A synced state holding exactly `accounts` (a completed list).
    pub fn from_list(accounts: Vec<LeanAccount>) -> Self {
        let mut s = Self::default();
        for a in accounts {
            s.upsert(a);
        }
        s.synced = true;
        s
    }

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

    pub fn synced(&self) -> bool {
        self.synced
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The shared, concurrently readable ServiceAccount index of one cluster.
#[derive(Debug, Default)]
pub struct AccountIndex {
    state: RwLock<AccountState>,
    /// A (re)list in progress, built without the lock readers take.
    relist: Mutex<Option<Vec<LeanAccount>>>,
    synced: AtomicBool,
    synced_notify: tokio::sync::Notify,
    size: AtomicU64,
    health: WatchHealth,
}

impl AccountIndex {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn apply(&self, event: Event<LeanAccount>) {
        let event = match event {
            Event::Init => {
                *lock(&self.relist) = Some(Vec::new());
                None
            }
            Event::InitApply(a) => match lock(&self.relist).as_mut() {
                Some(buf) => {
                    buf.push(a);
                    None
                }
                None => Some(Event::InitApply(a)),
            },
            Event::InitDone => {
                let accounts = lock(&self.relist).take().unwrap_or_default();
                let fresh = AccountState::from_list(accounts);
                let old = std::mem::replace(&mut *self.write(), fresh);
                drop(old);
                None
            }
            other => Some(other),
        };
        let (synced, len) = {
            let mut s = self.write();
            if let Some(e) = event {
                s.apply(e);
            }
            (s.synced(), s.len())
        };
        self.synced.store(synced, Ordering::Release);
        if synced {
            self.synced_notify.notify_waiters();
        }
        self.size.store(len as u64, Ordering::Relaxed);
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, AccountState> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }

    /// True once the first full list has been applied.
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// Waits at most `within` for the first full list; returns whether synced.
    pub async fn wait_synced(&self, within: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.synced_notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_synced() {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.is_synced();
            }
        }
    }

    pub fn len(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn health(&self) -> &WatchHealth {
        &self.health
    }

    /// Runs `f` over a consistent view of the index.
    pub fn read<R>(&self, f: impl FnOnce(&AccountState) -> R) -> R {
        match self.state.read() {
            Ok(s) => f(&s),
            Err(poisoned) => f(&poisoned.into_inner()),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn lean(m: kube::core::PartialObjectMeta<ServiceAccount>) -> LeanAccount {
    let meta = m.metadata;
    LeanAccount {
        namespace: meta.namespace.unwrap_or_default().into_boxed_str(),
        name: meta.name.unwrap_or_default().into_boxed_str(),
        uid: meta.uid.unwrap_or_default().into_boxed_str(),
        deletion_timestamp: meta.deletion_timestamp.map(|t| t.0.as_second()),
    }
}

/// Watches the metadata of all ServiceAccounts forever, re-listing after
/// errors with kube-runtime's backoff; the index keeps its last state (and
/// says how stale it is) while the API server is unreachable.
pub async fn run(client: Client, index: Arc<AccountIndex>) {
    // Metadata only: a ServiceAccount's secrets and annotations never travel.
    let api: Api<kube::core::PartialObjectMeta<ServiceAccount>> = Api::all(client);
    let mut stream = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    while let Some(event) = stream.next().await {
        match event {
            Ok(e) => {
                let done = matches!(e, Event::InitDone);
                if !matches!(e, Event::Init | Event::InitApply(_)) {
                    index.health.mark_connected();
                }
                index.apply(match e {
                    Event::Init => Event::Init,
                    Event::InitApply(m) => Event::InitApply(lean(m)),
                    Event::InitDone => Event::InitDone,
                    Event::Apply(m) => Event::Apply(lean(m)),
                    Event::Delete(m) => Event::Delete(lean(m)),
                });
                if done {
                    tracing::info!(
                        service_accounts = index.len(),
                        "service account index synced"
                    );
                }
            }
            Err(e) => {
                index.health.mark_disconnected();
                tracing::warn!(error = %e, "service account watch error; retrying with backoff");
            }
        }
    }
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
        type Case = (Vec<Event<LeanAccount>>, bool, usize, Option<&'static str>);
        let cases: Vec<Case> = vec![
            (vec![], false, 0, None),
            (vec![Event::Apply(a("x", "u1", None))], false, 1, Some("u1")),
            (
                vec![Event::Init, Event::InitApply(a("x", "u1", None))],
                false,
                0,
                None,
            ),
            (
                vec![
                    Event::Init,
                    Event::InitApply(a("x", "u1", None)),
                    Event::InitDone,
                ],
                true,
                1,
                Some("u1"),
            ),
            // Deleted and recreated: the new UID replaces the old.
            (
                vec![
                    Event::Init,
                    Event::InitApply(a("x", "u1", None)),
                    Event::InitDone,
                    Event::Delete(a("x", "u1", None)),
                    Event::Apply(a("x", "u2", None)),
                ],
                true,
                1,
                Some("u2"),
            ),
            // A relist that no longer has it drops it.
            (
                vec![
                    Event::Apply(a("x", "u1", None)),
                    Event::Init,
                    Event::InitApply(a("y", "u3", None)),
                    Event::InitDone,
                ],
                true,
                1,
                None,
            ),
            (
                vec![
                    Event::Apply(a("x", "u1", None)),
                    Event::Delete(a("x", "u1", None)),
                ],
                false,
                0,
                None,
            ),
        ];
        for (i, (events, synced, len, uid)) in cases.into_iter().enumerate() {
            let mut s = AccountState::default();
            let shared = AccountIndex::new();
            for e in events {
                s.apply(e.clone());
                shared.apply(e);
            }
            assert_eq!(s.synced(), synced, "case {i}");
            assert_eq!(s.len(), len, "case {i}");
            assert_eq!(s.get("ns", "x").map(|r| r.uid), uid, "case {i}");
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
        s.apply(Event::Apply(a("x", "u1", Some(42))));
        assert_eq!(s.get("ns", "x").unwrap().deletion_timestamp, Some(42));
        s.apply(Event::Apply(a("x", "u1", None)));
        assert_eq!(s.get("ns", "x").unwrap().deletion_timestamp, None);
    }
}
