//! A lean, Kubernetes-backed index of pods: only what node authorization
//! needs, keyed by (node, namespace, service account), by (namespace, name)
//! and by pod IP. The update function is pure and table-tested; the watcher
//! feeding it lives in [`watch`].

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

pub mod watch;

/// Pod lifecycle phase, as far as authorization cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Pending,
    Running,
    Succeeded,
    Failed,
    Unknown,
}

impl Phase {
    pub fn parse(s: Option<&str>) -> Self {
        match s {
            Some("Pending") | None => Self::Pending,
            Some("Running") => Self::Running,
            Some("Succeeded") => Self::Succeeded,
            Some("Failed") => Self::Failed,
            Some(_) => Self::Unknown,
        }
    }

    /// Terminal pods never authorize anything.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed)
    }
}

/// The fields of a pod the index keeps (everything else is dropped at decode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeanPod {
    pub namespace: Arc<str>,
    pub name: Box<str>,
    pub uid: Box<str>,
    pub node: Option<Arc<str>>,
    pub service_account: Arc<str>,
    pub phase: Phase,
    pub pod_ips: Vec<IpAddr>,
}

impl LeanPod {
    pub fn key(&self) -> PodKey {
        (self.namespace.clone(), self.name.clone())
    }
}

/// `(namespace, name)`.
pub type PodKey = (Arc<str>, Box<str>);
/// `(node, namespace, service account)`.
pub type NodeSaKey = (Arc<str>, Arc<str>, Arc<str>);

/// One watch event, in kube-runtime's vocabulary, over lean pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexEvent {
    /// A (re)list starts; buffer until `InitDone`.
    Init,
    InitApply(LeanPod),
    /// The list is complete: it replaces the index (pods absent from it are gone).
    InitDone,
    Apply(LeanPod),
    Delete(LeanPod),
}

/// The index contents. Plain data; [`IndexState::apply`] is the only mutator.
#[derive(Debug, Default, Clone)]
pub struct IndexState {
    by_name: HashMap<PodKey, LeanPod>,
    by_node_sa: HashMap<NodeSaKey, HashSet<PodKey>>,
    by_ip: HashMap<IpAddr, HashSet<PodKey>>,
    relist: Option<Vec<LeanPod>>,
    synced: bool,
    /// Interned node/namespace/service-account strings.
    interned: HashSet<Arc<str>>,
}

impl IndexState {
    /// Applies one event.
    pub fn apply(&mut self, event: IndexEvent) {
        match event {
            IndexEvent::Init => self.relist = Some(Vec::new()),
            IndexEvent::InitApply(pod) => match &mut self.relist {
                Some(buf) => buf.push(pod),
                // Defensive: an InitApply without Init still counts.
                None => self.upsert(pod),
            },
            IndexEvent::InitDone => {
                let pods = self.relist.take().unwrap_or_default();
                self.by_name.clear();
                self.by_node_sa.clear();
                self.by_ip.clear();
                for pod in pods {
                    self.upsert(pod);
                }
                self.synced = true;
            }
            IndexEvent::Apply(pod) => self.upsert(pod),
            IndexEvent::Delete(pod) => {
                self.remove(&pod.key());
            }
        }
    }

    fn intern(&mut self, s: &Arc<str>) -> Arc<str> {
        if let Some(existing) = self.interned.get(s) {
            return existing.clone();
        }
        self.interned.insert(s.clone());
        s.clone()
    }

    fn upsert(&mut self, mut pod: LeanPod) {
        let key = pod.key();
        self.remove(&key);
        // A pod that turned Failed leaves the index (istiod's field selector).
        if pod.phase == Phase::Failed {
            return;
        }
        pod.namespace = self.intern(&pod.namespace);
        pod.service_account = self.intern(&pod.service_account);
        pod.node = pod.node.as_ref().map(|n| self.intern(n));
        let key = pod.key();
        if let Some(node) = &pod.node {
            if !pod.service_account.is_empty() {
                self.by_node_sa
                    .entry((
                        node.clone(),
                        pod.namespace.clone(),
                        pod.service_account.clone(),
                    ))
                    .or_default()
                    .insert(key.clone());
            }
        }
        for ip in &pod.pod_ips {
            self.by_ip.entry(*ip).or_default().insert(key.clone());
        }
        self.by_name.insert(key, pod);
    }

    fn remove(&mut self, key: &PodKey) -> Option<LeanPod> {
        let old = self.by_name.remove(key)?;
        if let Some(node) = &old.node {
            let k = (
                node.clone(),
                old.namespace.clone(),
                old.service_account.clone(),
            );
            if let Some(set) = self.by_node_sa.get_mut(&k) {
                set.remove(key);
                if set.is_empty() {
                    self.by_node_sa.remove(&k);
                }
            }
        }
        for ip in &old.pod_ips {
            if let Some(set) = self.by_ip.get_mut(ip) {
                set.remove(key);
                if set.is_empty() {
                    self.by_ip.remove(ip);
                }
            }
        }
        Some(old)
    }

    pub fn synced(&self) -> bool {
        self.synced
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    pub fn get(&self, namespace: &str, name: &str) -> Option<&LeanPod> {
        self.by_name.get(&(Arc::from(namespace), Box::from(name)))
    }

    /// Non-terminal pods of `namespace/service_account` on `node`.
    pub fn on_node<'a>(
        &'a self,
        node: &str,
        namespace: &str,
        service_account: &str,
    ) -> impl Iterator<Item = &'a LeanPod> + 'a {
        self.by_node_sa
            .get(&(
                Arc::from(node),
                Arc::from(namespace),
                Arc::from(service_account),
            ))
            .into_iter()
            .flatten()
            .filter_map(|k| self.by_name.get(k))
            .filter(|p| !p.phase.is_terminal())
    }

    /// Pods that have `ip` as one of their pod IPs.
    pub fn with_ip<'a>(&'a self, ip: IpAddr) -> impl Iterator<Item = &'a LeanPod> + 'a {
        self.by_ip
            .get(&ip)
            .into_iter()
            .flatten()
            .filter_map(|k| self.by_name.get(k))
    }
}

/// The shared, concurrently readable index.
#[derive(Debug, Default)]
pub struct PodIndex {
    state: RwLock<IndexState>,
    // Readiness and size are mirrored in atomics so health checks and metrics
    // never take the lock the request path uses.
    synced: AtomicBool,
    size: AtomicU64,
    events: AtomicU64,
}

impl PodIndex {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn apply(&self, event: IndexEvent) {
        let (synced, len) = match self.state.write() {
            Ok(mut s) => {
                s.apply(event);
                (s.synced(), s.len())
            }
            Err(poisoned) => {
                let mut s = poisoned.into_inner();
                s.apply(event);
                (s.synced(), s.len())
            }
        };
        self.synced.store(synced, Ordering::Release);
        self.size.store(len as u64, Ordering::Relaxed);
        self.events.fetch_add(1, Ordering::Relaxed);
    }

    /// True once the first full list has been applied.
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    pub fn len(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn events_applied(&self) -> u64 {
        self.events.load(Ordering::Relaxed)
    }

    /// Runs `f` over a consistent view of the index.
    pub fn read<R>(&self, f: impl FnOnce(&IndexState) -> R) -> R {
        match self.state.read() {
            Ok(s) => f(&s),
            Err(poisoned) => f(&poisoned.into_inner()),
        }
    }
}

#[cfg(test)]
pub(crate) fn pod(
    ns: &str,
    name: &str,
    uid: &str,
    node: Option<&str>,
    sa: &str,
    phase: Phase,
) -> LeanPod {
    LeanPod {
        namespace: Arc::from(ns),
        name: Box::from(name),
        uid: Box::from(uid),
        node: node.map(Arc::from),
        service_account: Arc::from(sa),
        phase,
        pod_ips: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;
    use IndexEvent::*;

    fn a() -> LeanPod {
        pod(
            "ns-a",
            "pod-a",
            "uid-a",
            Some("node-1"),
            "sa-a",
            Phase::Running,
        )
    }
    fn b() -> LeanPod {
        pod(
            "ns-a",
            "pod-b",
            "uid-b",
            Some("node-2"),
            "sa-a",
            Phase::Running,
        )
    }

    fn names_on(s: &IndexState, node: &str) -> Vec<String> {
        let mut v: Vec<String> = s
            .on_node(node, "ns-a", "sa-a")
            .map(|p| p.name.to_string())
            .collect();
        v.sort();
        v
    }

    #[test_case(vec![Init, InitApply(a()), InitDone], true, 1, &["pod-a"] ; "initial list")]
    #[test_case(vec![Init, InitApply(a())], false, 0, &[] ; "not synced before InitDone")]
    #[test_case(vec![Init, InitDone, Apply(a())], true, 1, &["pod-a"] ; "apply after sync")]
    #[test_case(vec![Init, InitApply(a()), InitDone, Delete(a())], true, 0, &[] ; "delete")]
    #[test_case(vec![Init, InitApply(a()), InitDone, Init, InitApply(b()), InitDone], true, 1, &[] ; "relist drops vanished pod")]
    #[test_case(vec![Init, InitApply(a()), InitDone, Init, InitApply(a())], true, 1, &["pod-a"] ; "old contents kept during relist")]
    #[test_case(vec![Init, InitApply(a()), InitDone, Apply(pod("ns-a", "pod-a", "uid-a", Some("node-2"), "sa-a", Phase::Running))], true, 1, &[] ; "moved node reindexed")]
    #[test_case(vec![Init, InitApply(a()), InitDone, Apply(pod("ns-a", "pod-a", "uid-a", Some("node-1"), "sa-a", Phase::Failed))], true, 0, &[] ; "failed pod leaves")]
    #[test_case(vec![Init, InitApply(a()), InitDone, Apply(pod("ns-a", "pod-a", "uid-a", Some("node-1"), "sa-a", Phase::Succeeded))], true, 1, &[] ; "succeeded pod kept but does not authorize")]
    #[test_case(vec![Init, InitApply(pod("ns-a", "pod-a", "uid-a", None, "sa-a", Phase::Pending)), InitDone], true, 1, &[] ; "unscheduled pod not on node")]
    #[test_case(vec![Init, InitApply(a()), InitDone, Delete(pod("ns-a", "pod-x", "u", Some("node-1"), "sa-a", Phase::Running))], true, 1, &["pod-a"] ; "delete of unknown pod is harmless")]
    #[test_case(vec![Init, InitApply(a()), InitDone, Apply(pod("ns-a", "pod-a", "uid-new", Some("node-1"), "sa-a", Phase::Running))], true, 1, &["pod-a"] ; "recreated pod replaces uid")]
    fn apply_sequences(events: Vec<IndexEvent>, synced: bool, len: usize, on_node_1: &[&str]) {
        let mut s = IndexState::default();
        for e in events {
            s.apply(e);
        }
        assert_eq!(s.synced(), synced);
        assert_eq!(s.len(), len);
        assert_eq!(names_on(&s, "node-1"), on_node_1);
    }

    #[test]
    fn ip_index_follows_updates() {
        let mut s = IndexState::default();
        let mut p = a();
        p.pod_ips = vec!["10.0.0.5".parse().unwrap()];
        s.apply(Apply(p.clone()));
        assert_eq!(s.with_ip("10.0.0.5".parse().unwrap()).count(), 1);
        p.pod_ips = vec!["10.0.0.6".parse().unwrap()];
        s.apply(Apply(p.clone()));
        assert_eq!(s.with_ip("10.0.0.5".parse().unwrap()).count(), 0);
        s.apply(Delete(p));
        assert_eq!(s.with_ip("10.0.0.6".parse().unwrap()).count(), 0);
        assert!(s.by_ip.is_empty() && s.by_node_sa.is_empty());
    }

    #[test]
    fn shared_index_mirrors_readiness() {
        let idx = PodIndex::new();
        assert!(!idx.is_synced());
        idx.apply(Init);
        idx.apply(InitApply(a()));
        assert!(!idx.is_synced());
        idx.apply(InitDone);
        assert!(idx.is_synced());
        assert_eq!(idx.len(), 1);
        assert!(idx.read(|s| s.get("ns-a", "pod-a").is_some()));
    }
}
