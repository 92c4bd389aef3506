//! A lean, Kubernetes-backed index of pods: only what node authorization
//! needs, looked up by (node, namespace, service account), by (namespace, name)
//! and by pod IP. The update function is pure and table-tested; the watcher
//! feeding it lives in [`watch`].
//!
//! Memory layout (about 120 bytes per pod, see docs/BENCHMARKS.md): pods live
//! in a slab of fixed 40-byte records; namespaces, nodes and service accounts
//! are refcounted and interned to `u32` ids; pod names are packed into one
//! string arena; UIDs are kept as 16 bytes when they are canonical UUIDs (as
//! the API server makes them). The name index stores only a keyed 64-bit hash
//! and a slot number, the node index `(namespace, service account, slot)`
//! triples per node, and the IP index one slot per address. Anything unusual
//! (a non-UUID UID, more than one IPv4 address, IPv6) goes to a side table.

use std::collections::hash_map::{Entry, RandomState};
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::Arc;

pub mod accounts;
pub mod listwatch;
mod shared;
mod store;
pub mod watch;

pub use shared::{Indexed, Shared, WatchHealth};
pub use store::Uid;
use store::{parse_uuid, ByHash, Interner};

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

/// A pod as decoded from a watch event (everything else is dropped at decode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeanPod {
    pub namespace: Arc<str>,
    pub name: Box<str>,
    pub uid: Box<str>,
    pub node: Option<Arc<str>>,
    pub service_account: Arc<str>,
    pub phase: Phase,
    pub pod_ips: Vec<IpAddr>,
    /// `metadata.deletionTimestamp`, in Unix seconds: the pod is being
    /// deleted (a graceful deletion's deadline, or a finalizer holds it).
    pub deletion_timestamp: Option<i64>,
}

/// How long after its `deletionTimestamp` an object still vouches for a
/// bound token: the API server's own rule (it refuses a token whose pod or
/// service account was deleted before now minus its JWT leeway, one minute).
pub const DELETION_LEEWAY_SECS: i64 = 60;

/// Whether an object with this `deletionTimestamp` counts as gone at
/// `now_unix`, as the API server's token validator decides it.
pub fn deleted_by(deletion_timestamp: Option<i64>, now_unix: i64) -> bool {
    deletion_timestamp.is_some_and(|d| d < now_unix.saturating_sub(DELETION_LEEWAY_SECS))
}

impl LeanPod {
    pub fn key(&self) -> PodKey {
        (self.namespace.clone(), self.name.clone())
    }
}

/// `(namespace, name)`.
pub type PodKey = (Arc<str>, Box<str>);

/// One watch event, in kube-runtime's vocabulary, over lean objects (pods
/// unless said otherwise).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexEvent<T = LeanPod> {
    /// A (re)list starts; buffer until `InitDone`.
    Init,
    InitApply(T),
    /// The list is complete: it replaces the index (objects absent from it are gone).
    InitDone,
    Apply(T),
    Delete(T),
}

/// A read-only view of one indexed pod.
#[derive(Debug, Clone, Copy)]
pub struct PodRef<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub uid: Uid<'a>,
    pub node: Option<&'a str>,
    pub service_account: &'a str,
    pub phase: Phase,
    /// The pod's IPs (as decoded, duplicates removed).
    pub pod_ips: PodIps<'a>,
    /// `metadata.deletionTimestamp` (Unix seconds), while the pod is deleting.
    pub deletion_timestamp: Option<i64>,
}

/// The IPs of an indexed pod: the first IPv4 address inline, any others in
/// the side table.
#[derive(Debug, Clone, Copy)]
pub struct PodIps<'a> {
    ip4: Option<[u8; 4]>,
    others: &'a [IpAddr],
}

impl<'a> PodIps<'a> {
    pub fn iter(&self) -> impl Iterator<Item = IpAddr> + 'a {
        self.ip4
            .map(IpAddr::from)
            .into_iter()
            .chain(self.others.iter().copied())
    }
    pub fn len(&self) -> usize {
        usize::from(self.ip4.is_some()) + self.others.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn contains(&self, ip: &IpAddr) -> bool {
        self.iter().any(|i| i == *ip)
    }
}

impl PodRef<'_> {
    /// The pod's IPs (as decoded, duplicates removed).
    pub fn pod_ips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.pod_ips.iter()
    }

    /// Back to the event form.
    pub fn to_lean(&self) -> LeanPod {
        LeanPod {
            namespace: Arc::from(self.namespace),
            name: Box::from(self.name),
            uid: Box::from(&*self.uid),
            node: self.node.map(Arc::from),
            service_account: Arc::from(self.service_account),
            phase: self.phase,
            pod_ips: self.pod_ips().collect(),
            deletion_timestamp: self.deletion_timestamp,
        }
    }

    /// Gone for token validation at `now_unix` (see [`deleted_by`]).
    pub fn deleted_by(&self, now_unix: i64) -> bool {
        deleted_by(self.deletion_timestamp, now_unix)
    }
}

const NONE: u32 = u32::MAX;
const F_LIVE: u8 = 1;
const F_IP4: u8 = 2;
const F_EXTRA: u8 = 4;

/// One slab slot: 40 bytes.
#[derive(Debug, Clone, Copy)]
struct PodRecord {
    name_off: u32,
    ns: u32,
    sa: u32,
    node: u32,
    uid: [u8; 16],
    ip4: [u8; 4],
    name_len: u8,
    phase: Phase,
    flags: u8,
}

const EMPTY: PodRecord = PodRecord {
    name_off: 0,
    ns: NONE,
    sa: NONE,
    node: NONE,
    uid: [0; 16],
    ip4: [0; 4],
    name_len: 0,
    phase: Phase::Pending,
    flags: 0,
};

/// What does not fit a record: rare in real clusters.
#[derive(Debug, Clone, Default)]
struct Extra {
    uid: Option<Box<str>>,
    name: Option<Box<str>>,
    ips: Box<[IpAddr]>,
}

/// `(namespace, service account, slot)` of a pod on a node.
#[derive(Debug, Clone, Copy)]
struct NodeEntry {
    ns: u32,
    sa: u32,
    slot: u32,
}

/// The index contents. Plain data; [`IndexState::apply`] is the only mutator.
#[derive(Debug, Clone, Default)]
pub struct IndexState {
    pods: Vec<PodRecord>,
    free: Vec<u32>,
    len: usize,
    /// Every live pod's name, packed; `garbage` bytes belong to deleted pods.
    names: String,
    garbage: usize,
    strings: Interner,
    hasher: RandomState,
    /// Keyed hash of (namespace id, name) -> slot.
    by_name: ByHash,
    /// Pods whose hash collides with another pod's (practically never used).
    name_collisions: HashMap<(u32, Box<str>), u32>,
    by_node: HashMap<u32, Vec<NodeEntry>>,
    by_ip4: HashMap<[u8; 4], u32>,
    by_ip6: HashMap<[u8; 16], u32>,
    /// Addresses owned by more than one pod (host-network pods).
    ip_shared: HashMap<IpAddr, Vec<u32>>,
    extra: HashMap<u32, Extra>,
    /// `deletionTimestamp` of the pods being deleted, by slot: rare (a pod
    /// is normally gone seconds later), so kept beside the records.
    deleting: HashMap<u32, i64>,
    /// Non-terminal pods per (namespace, service account): answers "does any
    /// live pod still run as this identity?" (mTLS renewal) in O(1).
    live_by_sa: HashMap<(u32, u32), u32>,
    relist: Option<Vec<LeanPod>>,
    synced: bool,
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
                *self = Self::from_list(pods);
            }
            IndexEvent::Apply(pod) => self.upsert(pod),
            IndexEvent::Delete(pod) => {
                if let Some(ns) = self.strings.lookup(&pod.namespace) {
                    if let Some(slot) = self.find(ns, &pod.name) {
                        self.remove_slot(slot);
                    }
                }
            }
        }
    }

    /// A synced index holding exactly `pods` (a completed list).
    pub fn from_list(pods: Vec<LeanPod>) -> Self {
        let mut s = Self::default();
        s.pods.reserve_exact(pods.len());
        s.by_name.reserve(pods.len());
        let name_bytes: usize = pods.iter().map(|p| p.name.len()).sum();
        s.names.reserve_exact(name_bytes);
        for pod in pods {
            s.upsert(pod);
        }
        s.synced = true;
        s
    }

    fn name_hash(&self, ns: u32, name: &str) -> u64 {
        #[cfg(test)]
        if tests::COLLIDE.with(|c| c.get()) {
            return 42;
        }
        self.hasher.hash_one((ns, name))
    }

    fn name_of(&self, slot: u32) -> &str {
        let r = &self.pods[slot as usize];
        if r.flags & F_EXTRA != 0 {
            if let Some(n) = self.extra.get(&slot).and_then(|e| e.name.as_deref()) {
                return n;
            }
        }
        let start = r.name_off as usize;
        self.names
            .get(start..start + r.name_len as usize)
            .unwrap_or("")
    }

    fn find(&self, ns: u32, name: &str) -> Option<u32> {
        let slot = *self.by_name.get(&self.name_hash(ns, name))?;
        let r = &self.pods[slot as usize];
        if r.ns == ns && self.name_of(slot) == name {
            return Some(slot);
        }
        self.name_collisions.get(&(ns, Box::from(name))).copied()
    }

    fn upsert(&mut self, pod: LeanPod) {
        let existing = self
            .strings
            .lookup(&pod.namespace)
            .and_then(|ns| self.find(ns, &pod.name));
        // A pod that turned Failed leaves the index (istiod's field selector).
        if pod.phase == Phase::Failed {
            if let Some(slot) = existing {
                self.remove_slot(slot);
            }
            return;
        }
        match existing {
            // Same (namespace, name): reuse the slot, its name and its name-index entry.
            Some(slot) => {
                if !self.update_in_place(slot, &pod) {
                    self.unlink(slot);
                    self.fill(slot, &pod);
                }
            }
            None => {
                let slot = match self.free.pop() {
                    Some(s) => s,
                    None => {
                        self.pods.push(EMPTY);
                        (self.pods.len() - 1) as u32
                    }
                };
                let ns = self.strings.acquire(&pod.namespace);
                let mut rec = EMPTY;
                rec.ns = ns;
                if pod.name.len() <= u8::MAX as usize {
                    rec.name_off = self.names.len() as u32;
                    rec.name_len = pod.name.len() as u8;
                    self.names.push_str(&pod.name);
                } else {
                    rec.flags |= F_EXTRA;
                    self.extra.entry(slot).or_default().name = Some(pod.name.clone());
                }
                self.pods[slot as usize] = rec;
                let h = self.name_hash(ns, &pod.name);
                match self.by_name.entry(h) {
                    Entry::Vacant(v) => {
                        v.insert(slot);
                    }
                    Entry::Occupied(_) => {
                        self.name_collisions.insert((ns, pod.name.clone()), slot);
                    }
                }
                self.len += 1;
                self.fill(slot, &pod);
            }
        }
    }

    /// The common watch event: a status change of a pod whose node, service
    /// account, IPs and UID representation are unchanged. Updates the record
    /// without touching the indexes; false when the slow path is needed.
    fn update_in_place(&mut self, slot: u32, pod: &LeanPod) -> bool {
        let r = self.pods[slot as usize];
        if r.flags & F_EXTRA != 0 || pod.pod_ips.len() > 1 {
            return false;
        }
        let Some(uid) = parse_uuid(&pod.uid) else {
            return false;
        };
        let ip4 = match pod.pod_ips.first() {
            None => None,
            Some(IpAddr::V4(a)) => Some(a.octets()),
            Some(IpAddr::V6(_)) => return false,
        };
        let stored_ip4 = (r.flags & F_IP4 != 0).then_some(r.ip4);
        let node = match pod.node.as_deref() {
            None => NONE,
            Some(n) => match self.strings.lookup(n) {
                Some(id) => id,
                None => return false,
            },
        };
        let same = ip4 == stored_ip4
            && node == r.node
            && self.strings.lookup(&pod.service_account) == Some(r.sa);
        if same {
            let (ns, sa, was) = (r.ns, r.sa, r.phase);
            let rec = &mut self.pods[slot as usize];
            rec.uid = uid;
            rec.phase = pod.phase;
            self.set_deleting(slot, pod.deletion_timestamp);
            match (was.is_terminal(), pod.phase.is_terminal()) {
                (false, true) => self.count_live(ns, sa, false),
                (true, false) => self.count_live(ns, sa, true),
                _ => {}
            }
        }
        same
    }

    /// Writes everything but namespace and name into `slot` and links it into
    /// the node and IP indexes.
    fn fill(&mut self, slot: u32, pod: &LeanPod) {
        let sa = self.strings.acquire(&pod.service_account);
        let node = pod
            .node
            .as_deref()
            .map_or(NONE, |n| self.strings.acquire(n));
        let mut ips = pod.pod_ips.clone();
        ips.sort_unstable();
        ips.dedup();
        let ip4 = ips.iter().position(|ip| ip.is_ipv4());
        let r = &mut self.pods[slot as usize];
        r.sa = sa;
        r.node = node;
        r.phase = pod.phase;
        r.flags = (r.flags & F_EXTRA) | F_LIVE;
        let ns = r.ns;
        let uuid = parse_uuid(&pod.uid);
        r.uid = uuid.unwrap_or([0; 16]);
        if let Some(IpAddr::V4(v4)) = ip4.map(|i| ips[i]) {
            r.ip4 = v4.octets();
            r.flags |= F_IP4;
        }
        let extra_ips: Box<[IpAddr]> = ips
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(*i) != ip4)
            .map(|(_, ip)| *ip)
            .collect();
        let needs_extra = uuid.is_none() || !extra_ips.is_empty();
        let long_name = self.extra.get(&slot).is_some_and(|e| e.name.is_some());
        if needs_extra || long_name {
            let e = self.extra.entry(slot).or_default();
            e.uid = uuid.is_none().then(|| pod.uid.clone());
            e.ips = extra_ips;
            self.pods[slot as usize].flags |= F_EXTRA;
        } else {
            self.extra.remove(&slot);
            self.pods[slot as usize].flags &= !F_EXTRA;
        }
        self.set_deleting(slot, pod.deletion_timestamp);
        if !pod.phase.is_terminal() {
            self.count_live(ns, sa, true);
        }
        if node != NONE && !pod.service_account.is_empty() {
            self.by_node
                .entry(node)
                .or_default()
                .push(NodeEntry { ns, sa, slot });
        }
        for ip in ips {
            self.link_ip(ip, slot);
        }
    }

    fn set_deleting(&mut self, slot: u32, deletion_timestamp: Option<i64>) {
        match deletion_timestamp {
            Some(t) => {
                self.deleting.insert(slot, t);
            }
            None => {
                self.deleting.remove(&slot);
            }
        }
    }

    /// Keeps [`Self::live_by_sa`] in step with a pod entering (`up`) or
    /// leaving the non-terminal set.
    fn count_live(&mut self, ns: u32, sa: u32, up: bool) {
        if up {
            *self.live_by_sa.entry((ns, sa)).or_default() += 1;
        } else if let Entry::Occupied(mut e) = self.live_by_sa.entry((ns, sa)) {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
    }

    /// Undoes [`Self::fill`]: drops the slot from the node and IP indexes and
    /// releases its service account and node.
    fn unlink(&mut self, slot: u32) {
        let r = self.pods[slot as usize];
        if r.flags & F_LIVE != 0 && !r.phase.is_terminal() {
            self.count_live(r.ns, r.sa, false);
        }
        if r.node != NONE {
            if let Some(v) = self.by_node.get_mut(&r.node) {
                if let Some(i) = v.iter().position(|e| e.slot == slot) {
                    v.swap_remove(i);
                }
                if v.is_empty() {
                    self.by_node.remove(&r.node);
                }
            }
            self.strings.release(r.node);
        }
        self.strings.release(r.sa);
        let extra_ips = self
            .extra
            .get(&slot)
            .map(|e| e.ips.to_vec())
            .unwrap_or_default();
        if r.flags & F_IP4 != 0 {
            self.unlink_ip(IpAddr::from(r.ip4), slot);
        }
        for ip in extra_ips {
            self.unlink_ip(ip, slot);
        }
    }

    fn remove_slot(&mut self, slot: u32) {
        self.unlink(slot);
        let r = self.pods[slot as usize];
        let name: Box<str> = Box::from(self.name_of(slot));
        let h = self.name_hash(r.ns, &name);
        if self.by_name.get(&h) == Some(&slot) {
            self.by_name.remove(&h);
            // Promote a colliding pod with the same hash, if any.
            let promote = self
                .name_collisions
                .iter()
                .find(|((ns, n), _)| self.name_hash(*ns, n) == h)
                .map(|(k, &s)| (k.clone(), s));
            if let Some((k, s)) = promote {
                self.name_collisions.remove(&k);
                self.by_name.insert(h, s);
            }
        } else {
            self.name_collisions.remove(&(r.ns, name));
        }
        self.strings.release(r.ns);
        if r.flags & F_EXTRA == 0 || self.extra.get(&slot).is_none_or(|e| e.name.is_none()) {
            self.garbage += r.name_len as usize;
        }
        self.extra.remove(&slot);
        self.deleting.remove(&slot);
        self.pods[slot as usize] = EMPTY;
        self.free.push(slot);
        self.len -= 1;
        self.maybe_compact();
    }

    /// Rewrites the name arena once more than half of it is garbage.
    fn maybe_compact(&mut self) {
        if self.garbage < 4096 || self.garbage * 2 < self.names.len() {
            return;
        }
        let mut names = String::with_capacity(self.names.len() - self.garbage);
        for r in self.pods.iter_mut() {
            if r.flags & F_LIVE == 0 || r.name_len == 0 {
                continue;
            }
            let start = r.name_off as usize;
            let name = self
                .names
                .get(start..start + r.name_len as usize)
                .unwrap_or("");
            r.name_off = names.len() as u32;
            names.push_str(name);
        }
        self.names = names;
        self.garbage = 0;
        // Drop emptied tail slots so the slab shrinks after mass deletions.
        while self.pods.last().is_some_and(|r| r.flags & F_LIVE == 0) {
            self.pods.pop();
        }
        let len = self.pods.len() as u32;
        self.free.retain(|&s| s < len);
        if self.pods.capacity() > 2 * self.pods.len() + 64 {
            self.pods.shrink_to_fit();
            self.free.shrink_to_fit();
        }
    }

    fn link_ip(&mut self, ip: IpAddr, slot: u32) {
        if let Some(v) = self.ip_shared.get_mut(&ip) {
            v.push(slot);
            return;
        }
        let previous = match ip {
            IpAddr::V4(a) => match self.by_ip4.entry(a.octets()) {
                Entry::Vacant(v) => {
                    v.insert(slot);
                    None
                }
                Entry::Occupied(o) => Some(o.remove()),
            },
            IpAddr::V6(a) => match self.by_ip6.entry(a.octets()) {
                Entry::Vacant(v) => {
                    v.insert(slot);
                    None
                }
                Entry::Occupied(o) => Some(o.remove()),
            },
        };
        if let Some(other) = previous {
            self.ip_shared.insert(ip, vec![other, slot]);
        }
    }

    fn unlink_ip(&mut self, ip: IpAddr, slot: u32) {
        if let Some(v) = self.ip_shared.get_mut(&ip) {
            if let Some(i) = v.iter().position(|&s| s == slot) {
                v.swap_remove(i);
            }
            if v.len() <= 1 {
                let rest = v.first().copied();
                self.ip_shared.remove(&ip);
                if let Some(last) = rest {
                    match ip {
                        IpAddr::V4(a) => self.by_ip4.insert(a.octets(), last),
                        IpAddr::V6(a) => self.by_ip6.insert(a.octets(), last),
                    };
                }
            }
            return;
        }
        match ip {
            IpAddr::V4(a) => {
                if self.by_ip4.get(&a.octets()) == Some(&slot) {
                    self.by_ip4.remove(&a.octets());
                }
            }
            IpAddr::V6(a) => {
                if self.by_ip6.get(&a.octets()) == Some(&slot) {
                    self.by_ip6.remove(&a.octets());
                }
            }
        }
    }

    fn view(&self, slot: u32) -> PodRef<'_> {
        let r = &self.pods[slot as usize];
        let extra = if r.flags & F_EXTRA != 0 {
            self.extra.get(&slot)
        } else {
            None
        };
        let uid = match extra.and_then(|e| e.uid.as_deref()) {
            Some(text) => Uid::text(text),
            None => Uid::packed(&r.uid),
        };
        PodRef {
            namespace: self.strings.get(r.ns),
            name: self.name_of(slot),
            uid,
            node: (r.node != NONE).then(|| self.strings.get(r.node)),
            service_account: self.strings.get(r.sa),
            phase: r.phase,
            pod_ips: PodIps {
                ip4: (r.flags & F_IP4 != 0).then_some(r.ip4),
                others: extra.map_or(&[], |e| &e.ips),
            },
            deletion_timestamp: self.deleting.get(&slot).copied(),
        }
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

    pub fn get(&self, namespace: &str, name: &str) -> Option<PodRef<'_>> {
        let ns = self.strings.lookup(namespace)?;
        self.find(ns, name).map(|slot| self.view(slot))
    }

    /// Non-terminal pods of `namespace/service_account` on `node`, leaving
    /// out those deleted by `now_unix` (see [`deleted_by`]).
    pub fn on_node<'a>(
        &'a self,
        node: &str,
        namespace: &str,
        service_account: &str,
        now_unix: i64,
    ) -> impl Iterator<Item = PodRef<'a>> + 'a {
        let ids = self.strings.lookup(node).and_then(|node| {
            Some((
                self.by_node.get(&node)?,
                self.strings.lookup(namespace)?,
                self.strings.lookup(service_account)?,
            ))
        });
        ids.into_iter()
            .flat_map(|(entries, ns, sa)| {
                entries
                    .iter()
                    .filter(move |e| e.ns == ns && e.sa == sa)
                    .map(|e| e.slot)
            })
            .filter(|&slot| !self.pods[slot as usize].phase.is_terminal())
            .filter(move |&slot| !deleted_by(self.deleting.get(&slot).copied(), now_unix))
            .map(|slot| self.view(slot))
    }

    /// Whether any non-terminal pod runs as `namespace/service_account`,
    /// not counting pods deleted by `now_unix` (see [`deleted_by`]).
    pub fn has_live_pod(&self, namespace: &str, service_account: &str, now_unix: i64) -> bool {
        let (Some(ns), Some(sa)) = (
            self.strings.lookup(namespace),
            self.strings.lookup(service_account),
        ) else {
            return false;
        };
        let live = self.live_by_sa.get(&(ns, sa)).copied().unwrap_or(0);
        if live == 0 {
            return false;
        }
        // Deleting pods are few; those past the leeway no longer count.
        let gone = self
            .deleting
            .iter()
            .filter(|(_, &t)| deleted_by(Some(t), now_unix))
            .filter(|(&slot, _)| {
                let r = &self.pods[slot as usize];
                r.ns == ns && r.sa == sa && !r.phase.is_terminal()
            })
            .count();
        live as usize > gone
    }

    /// Pods that have `ip` as one of their pod IPs.
    pub fn with_ip<'a>(&'a self, ip: IpAddr) -> impl Iterator<Item = PodRef<'a>> + 'a {
        let single = match ip {
            IpAddr::V4(a) => self.by_ip4.get(&a.octets()),
            IpAddr::V6(a) => self.by_ip6.get(&a.octets()),
        };
        single
            .into_iter()
            .copied()
            .chain(self.ip_shared.get(&ip).into_iter().flatten().copied())
            .map(|slot| self.view(slot))
    }

    /// Approximate heap bytes per structure, from capacities (for benchmarks;
    /// the counting allocator in benches/podindex_scale.rs is authoritative).
    #[doc(hidden)]
    pub fn heap_breakdown(&self) -> Vec<(&'static str, usize)> {
        fn table<K, V>(m: &HashMap<K, V, impl BuildHasher>) -> usize {
            // hashbrown: buckets = next power of two of capacity * 8 / 7, one control byte each.
            let buckets = if m.capacity() == 0 {
                0
            } else {
                (m.capacity() * 8 / 7).next_power_of_two()
            };
            buckets * (std::mem::size_of::<(K, V)>() + 1)
        }
        vec![
            (
                "pods",
                self.pods.capacity() * std::mem::size_of::<PodRecord>(),
            ),
            ("names", self.names.capacity()),
            ("by_name", table(&self.by_name)),
            (
                "by_node",
                table(&self.by_node)
                    + self
                        .by_node
                        .values()
                        .map(|v| v.capacity() * std::mem::size_of::<NodeEntry>())
                        .sum::<usize>(),
            ),
            ("by_ip4", table(&self.by_ip4)),
            ("by_ip6", table(&self.by_ip6)),
            ("ip_shared", table(&self.ip_shared)),
            ("extra", table(&self.extra)),
            ("deleting", table(&self.deleting)),
            ("live_by_sa", table(&self.live_by_sa)),
            (
                "strings",
                table(&self.strings.ids) + self.strings.strs.capacity() * 24,
            ),
        ]
    }

    /// Every indexed pod, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = PodRef<'_>> + '_ {
        (0..self.pods.len() as u32)
            .filter(|&s| self.pods[s as usize].flags & F_LIVE != 0)
            .map(|s| self.view(s))
    }
}

/// The shared, concurrently readable pod index.
pub type PodIndex = Shared<IndexState>;

impl Indexed for IndexState {
    type Item = LeanPod;
    fn from_list(items: Vec<LeanPod>) -> Self {
        IndexState::from_list(items)
    }
    fn apply(&mut self, event: IndexEvent) {
        IndexState::apply(self, event)
    }
    fn synced(&self) -> bool {
        IndexState::synced(self)
    }
    fn len(&self) -> usize {
        IndexState::len(self)
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
        deletion_timestamp: None,
    }
}

#[cfg(test)]
mod tests;
