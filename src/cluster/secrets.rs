//! Istio's remote secrets: Secrets labelled `istio/multiCluster: "true"` in
//! meshca's namespace, one kubeconfig per data key, the key being the
//! cluster id. The watcher keeps the registry equal to what the Secrets say:
//! a cluster is added, rebuilt when its kubeconfig changes, and removed (its
//! authorization with it) when its key or Secret goes. Which cluster comes
//! from which Secret, and what changes, is decided by plain functions
//! ([`desired`], [`diff`]) over plain data.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};

use super::kubeconfig::{self, KubeconfigPolicy};
use super::{ClusterFactory, ClusterRegistry, Origin};

/// The label istiod selects remote secrets by.
pub const LABEL: &str = "istio/multiCluster";

/// Settings of the remote secret watcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteSecrets {
    /// Namespace watched (meshca's own).
    pub namespace: String,
    pub policy: KubeconfigPolicy,
    /// Most remote clusters registered at once.
    pub max_clusters: usize,
    /// A rotated cluster's old entry keeps serving until the new one's pod
    /// index syncs, at most this long (then the new one serves, unsynced).
    pub sync_timeout: std::time::Duration,
}

/// Secret name -> (cluster id -> kubeconfig bytes).
pub type SecretData = BTreeMap<String, BTreeMap<String, Vec<u8>>>;

/// Where a cluster's kubeconfig comes from, and which bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    pub secret: String,
    pub sha256: [u8; 32],
}

/// A key the registry leaves out, with why (logged once per change).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Skipped {
    pub secret: String,
    pub cluster: String,
    pub why: String,
}

/// Which cluster each key becomes. A cluster id names one cluster: the local
/// id is never taken from a Secret (istiod does the same), and an id in
/// several Secrets stays with the one that registered it first (then the
/// first by name). Beyond `max`, new clusters are left out.
pub fn desired(
    local: &str,
    secrets: &SecretData,
    current: &BTreeMap<String, Wanted>,
    max: usize,
) -> (BTreeMap<String, Wanted>, BTreeSet<Skipped>) {
    let mut owners: BTreeMap<&str, &str> = BTreeMap::new();
    let mut skipped = BTreeSet::new();
    // Keep current owners that still hold their key.
    for (id, w) in current {
        if secrets
            .get(&w.secret)
            .is_some_and(|d| d.contains_key(id.as_str()))
        {
            owners.insert(id, &w.secret);
        }
    }
    for (secret, data) in secrets {
        for id in data.keys() {
            let skip = |why: String| Skipped {
                secret: secret.clone(),
                cluster: id.clone(),
                why,
            };
            if id == local {
                skipped.insert(skip(
                    "the local cluster id is never taken from a Secret".into(),
                ));
                continue;
            }
            match owners.get(id.as_str()) {
                Some(owner) if *owner == secret.as_str() => {}
                Some(owner) => {
                    skipped.insert(skip(format!("already registered from Secret {owner:?}")));
                }
                None if owners.len() >= max => {
                    skipped.insert(skip(format!("over MESHCA_REMOTE_CLUSTERS_MAX ({max})")));
                }
                None => {
                    owners.insert(id, secret);
                }
            }
        }
    }
    let wanted = owners
        .into_iter()
        .filter_map(|(id, secret)| {
            let bytes = secrets.get(secret)?.get(id)?;
            Some((
                id.to_string(),
                Wanted {
                    secret: secret.to_string(),
                    sha256: crate::primitives::sha256(bytes),
                },
            ))
        })
        .collect();
    (wanted, skipped)
}

/// One change to the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Add(String),
    /// Other kubeconfig bytes (rotation) or another owning Secret.
    Replace(String),
    Remove(String),
}

/// What turns `current` into `desired`.
pub fn diff(current: &BTreeMap<String, Wanted>, desired: &BTreeMap<String, Wanted>) -> Vec<Change> {
    let mut out = Vec::new();
    for id in current.keys() {
        if !desired.contains_key(id) {
            out.push(Change::Remove(id.clone()));
        }
    }
    for (id, w) in desired {
        match current.get(id) {
            None => out.push(Change::Add(id.clone())),
            Some(c) if c != w => out.push(Change::Replace(id.clone())),
            Some(_) => {}
        }
    }
    out
}

fn data_of(s: &Secret) -> BTreeMap<String, Vec<u8>> {
    s.data
        .as_ref()
        .map(|d| d.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect())
        .unwrap_or_default()
}

/// A rotated cluster waiting for its pod index before it replaces the old one.
struct Pending {
    cluster: Option<super::Cluster>,
    sha256: [u8; 32],
    waiter: tokio::task::JoinHandle<()>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.waiter.abort();
    }
}

/// The watcher's own state: the Secrets seen and what was registered from them.
struct Reconciler {
    registry: Arc<ClusterRegistry>,
    factory: Arc<ClusterFactory>,
    settings: RemoteSecrets,
    secrets: SecretData,
    relist: Option<SecretData>,
    /// What the registry holds (or refused) per cluster id.
    applied: BTreeMap<String, Wanted>,
    skipped: BTreeSet<Skipped>,
    /// Rotations in progress, by cluster id; dropped (and their watches
    /// stopped) by any later change to that id.
    pending: BTreeMap<String, Pending>,
    synced_tx: tokio::sync::mpsc::UnboundedSender<(String, [u8; 32])>,
}

impl Reconciler {
    async fn reconcile(&mut self) {
        let (want, skipped) = desired(
            self.registry.local_id(),
            &self.secrets,
            &self.applied,
            self.settings.max_clusters,
        );
        for s in skipped.difference(&self.skipped) {
            tracing::warn!(secret = %s.secret, cluster = %s.cluster, why = %s.why, "remote secret key ignored");
        }
        self.skipped = skipped;
        for change in diff(&self.applied, &want) {
            let (Change::Remove(id) | Change::Add(id) | Change::Replace(id)) = &change;
            self.pending.remove(id);
            match change {
                Change::Remove(id) => {
                    self.applied.remove(&id);
                    if self.registry.remove(&id) {
                        tracing::info!(cluster = %id, "remote cluster removed: its authorization is revoked");
                    }
                }
                Change::Add(id) | Change::Replace(id) => {
                    let Some(w) = want.get(&id).cloned() else {
                        continue;
                    };
                    let bytes = self
                        .secrets
                        .get(&w.secret)
                        .and_then(|d| d.get(&id))
                        .cloned()
                        .unwrap_or_default();
                    self.add(&id, &w, &bytes).await;
                    self.applied.insert(id, w);
                }
            }
        }
        self.registry.publish_metrics();
    }

    /// Builds and registers one cluster; a refused kubeconfig leaves the
    /// cluster out (and drops the one it replaces: the Secret no longer
    /// holds its credentials).
    async fn add(&mut self, id: &str, want: &Wanted, bytes: &[u8]) {
        let secret = want.secret.as_str();
        let built = match kubeconfig::sanitize(bytes, &self.settings.policy) {
            Ok(kc) => client_for(kc).await,
            Err(e) => Err(e),
        };
        match built {
            Ok(client) => {
                let cluster = self.factory.build_remote(
                    id,
                    client,
                    Origin::Secret(format!("{}/{secret}", self.settings.namespace)),
                );
                // A rotation keeps the old entry serving until the new one
                // has synced (istiod's pending swap), within the timeout.
                if let (Some(_), Some(index)) = (self.registry.get(id), cluster.index.clone()) {
                    let (tx, key, sha, timeout) = (
                        self.synced_tx.clone(),
                        id.to_string(),
                        want.sha256,
                        self.settings.sync_timeout,
                    );
                    let waiter = tokio::spawn(async move {
                        let synced = tokio::time::timeout(timeout, async {
                            while !index.is_synced() {
                                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                            }
                        })
                        .await;
                        if synced.is_err() {
                            tracing::warn!(cluster = %key, ?timeout, "rotated remote cluster not synced in time: it replaces the old one unsynced (impersonation Unavailable until it syncs)");
                        }
                        let _ = tx.send((key, sha));
                    });
                    tracing::info!(cluster = %id, secret = %secret, "remote cluster kubeconfig rotated: the current entry serves until the new one syncs");
                    self.pending.insert(
                        id.to_string(),
                        Pending {
                            cluster: Some(cluster),
                            sha256: want.sha256,
                            waiter,
                        },
                    );
                    return;
                }
                let replaced = self.registry.insert(cluster);
                tracing::info!(cluster = %id, secret = %secret, replaced, "remote cluster registered from remote secret");
            }
            Err(e) => {
                self.registry.remove(id);
                self.registry.kubeconfig_refused(e.reason());
                tracing::error!(cluster = %id, secret = %secret, reason = e.reason(), error = %e, "remote kubeconfig refused: cluster not registered (the other clusters are unaffected)");
            }
        }
    }

    /// A rotation's new entry synced (or timed out): it replaces the old one,
    /// unless something changed that id since.
    fn swap(&mut self, id: &str, sha256: [u8; 32]) {
        if self.pending.get(id).is_some_and(|p| p.sha256 == sha256) {
            if let Some(cluster) = self.pending.remove(id).and_then(|mut p| p.cluster.take()) {
                self.registry.insert(cluster);
                tracing::info!(cluster = %id, "rotated remote cluster now serves");
            }
        }
    }

    async fn apply(&mut self, e: Event<Secret>) {
        let name = |s: &Secret| s.metadata.name.clone().unwrap_or_default();
        match e {
            Event::Init => self.relist = Some(SecretData::new()),
            Event::InitApply(s) => {
                if let Some(buf) = &mut self.relist {
                    buf.insert(name(&s), data_of(&s));
                }
            }
            Event::InitDone => {
                self.secrets = self.relist.take().unwrap_or_default();
                self.reconcile().await;
                self.registry.mark_secrets_listed();
            }
            Event::Apply(s) => {
                self.secrets.insert(name(&s), data_of(&s));
                self.reconcile().await;
            }
            Event::Delete(s) => {
                self.secrets.remove(&name(&s));
                self.reconcile().await;
            }
        }
    }
}

/// A client for a sanitized kubeconfig.
async fn client_for(kc: kube::config::Kubeconfig) -> Result<Client, kubeconfig::KubeconfigError> {
    let invalid = |e: String| kubeconfig::KubeconfigError::Invalid(e);
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .map_err(|e| invalid(e.to_string()))?;
    Client::try_from(config).map_err(|e| invalid(e.to_string()))
}

/// Watches the remote secrets forever, re-listing after errors with
/// kube-runtime's backoff. While the watch is down the registry keeps its
/// clusters (a Secret deleted meanwhile is acted on at the relist).
pub async fn run(
    client: Client,
    settings: RemoteSecrets,
    registry: Arc<ClusterRegistry>,
    factory: Arc<ClusterFactory>,
) {
    let api: Api<Secret> = Api::namespaced(client, &settings.namespace);
    let config = watcher::Config::default().labels(&format!("{LABEL}=true"));
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    let (synced_tx, mut synced_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut r = Reconciler {
        registry,
        factory,
        settings,
        secrets: SecretData::new(),
        relist: None,
        applied: BTreeMap::new(),
        skipped: BTreeSet::new(),
        pending: BTreeMap::new(),
        synced_tx,
    };
    // One task applies both secret events and finished rotations, so a
    // rotation can never land after a later change to the same cluster.
    loop {
        tokio::select! {
            event = stream.next() => match event {
                Some(Ok(e)) => r.apply(e).await,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, namespace = %r.settings.namespace, "remote secret watch error; retrying with backoff")
                }
                None => return,
            },
            Some((id, sha)) = synced_rx.recv() => r.swap(&id, sha),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn secrets(list: &[(&str, &[(&str, &str)])]) -> SecretData {
        list.iter()
            .map(|(s, keys)| {
                (
                    s.to_string(),
                    keys.iter()
                        .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
                        .collect(),
                )
            })
            .collect()
    }

    fn owners(w: &BTreeMap<String, Wanted>) -> Vec<(String, String)> {
        w.iter()
            .map(|(k, v)| (k.clone(), v.secret.clone()))
            .collect()
    }

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    // (secrets, previously registered (id, secret), max, wanted (id, secret), skipped ids)
    #[test_case(&[("s1", &[("east", "k1"), ("west", "k2")])], &[], 10, &[("east", "s1"), ("west", "s1")], &[] ; "one secret two clusters")]
    #[test_case(&[("s1", &[("Kubernetes", "k1"), ("east", "k2")])], &[], 10, &[("east", "s1")], &["Kubernetes"] ; "local id is never taken")]
    #[test_case(&[("a", &[("east", "k1")]), ("b", &[("east", "k2")])], &[], 10, &[("east", "a")], &["east"] ; "duplicate id first secret by name wins")]
    #[test_case(&[("a", &[("east", "k1")]), ("b", &[("east", "k2")])], &[("east", "b")], 10, &[("east", "b")], &["east"] ; "duplicate id stays with its owner")]
    #[test_case(&[("b", &[("east", "k2")])], &[("east", "a")], 10, &[("east", "b")], &[] ; "owner gone another secret takes over")]
    #[test_case(&[("s", &[("a", "1"), ("b", "2"), ("c", "3")])], &[("c", "s")], 2, &[("a", "s"), ("c", "s")], &["b"] ; "over the cap registered clusters stay")]
    #[test_case(&[], &[("east", "s1")], 10, &[], &[] ; "secret deleted")]
    fn desired_table(
        data: &[(&str, &[(&str, &str)])],
        current: &[(&str, &str)],
        max: usize,
        want: &[(&str, &str)],
        skipped: &[&str],
    ) {
        let current: BTreeMap<String, Wanted> = current
            .iter()
            .map(|(id, s)| {
                (
                    id.to_string(),
                    Wanted {
                        secret: s.to_string(),
                        sha256: [0; 32],
                    },
                )
            })
            .collect();
        let (got, skip) = desired("Kubernetes", &secrets(data), &current, max);
        assert_eq!(owners(&got), pairs(want));
        let ids: Vec<&str> = skip.iter().map(|s| s.cluster.as_str()).collect();
        assert_eq!(ids, skipped);
    }

    #[test]
    fn diff_adds_rotates_and_removes() {
        let w = |s: &str, b: &str| Wanted {
            secret: s.into(),
            sha256: crate::primitives::sha256(b.as_bytes()),
        };
        let current: BTreeMap<String, Wanted> = [
            ("same".to_string(), w("s", "1")),
            ("rotated".to_string(), w("s", "1")),
            ("moved".to_string(), w("s", "1")),
            ("gone".to_string(), w("s", "1")),
        ]
        .into();
        let next: BTreeMap<String, Wanted> = [
            ("same".to_string(), w("s", "1")),
            ("rotated".to_string(), w("s", "2")),
            ("moved".to_string(), w("t", "1")),
            ("new".to_string(), w("s", "1")),
        ]
        .into();
        assert_eq!(
            diff(&current, &next),
            vec![
                Change::Remove("gone".into()),
                Change::Replace("moved".into()),
                Change::Add("new".into()),
                Change::Replace("rotated".into()),
            ]
        );
        assert!(diff(&next, &next).is_empty());
    }
}
