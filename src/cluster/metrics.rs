//! Metric families of the cluster registry.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use crate::metrics::labels::RefusalLabels;
use crate::metrics::Register;
use crate::outcome::Decision;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClusterDecisionLabels {
    /// A registered cluster id, or `unknown`.
    pub cluster: String,
    pub decision: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClusterLabels {
    pub cluster: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IndexLabels {
    pub cluster: String,
    /// `pod` or `service_account`.
    pub index: &'static str,
}

/// The indexes a cluster may run, by their `index` label.
pub const INDEXES: [&str; 2] = ["pod", "service_account"];

/// The cluster registry's families. The `cluster` label only ever takes a
/// registered cluster id (or `unknown`): a caller cannot grow it.
#[derive(Debug, Default)]
pub struct ClusterMetrics {
    /// (local id, registered ids).
    names: std::sync::RwLock<(String, std::collections::BTreeSet<String>)>,
    pub requests: Family<ClusterDecisionLabels, Counter>,
    pub registered: Family<ClusterLabels, Gauge>,
    /// 1 once the cluster's pod index has synced (set at scrape time).
    pub synced: Family<ClusterLabels, Gauge>,
    /// Seconds since the last evidence that an index is current (set at
    /// scrape time).
    pub freshness_age: Family<IndexLabels, Gauge<f64, AtomicU64>>,
    pub kubeconfig_refused: Family<RefusalLabels, Counter>,
}

/// The label of requests whose cluster is not registered.
pub const UNKNOWN_CLUSTER: &str = "unknown";

impl ClusterMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        Self {
            names: Default::default(),
            requests: registry.metric(
                "meshca_cluster_requests",
                "CreateCertificate decisions by the caller's cluster (registered ids, else unknown)",
            ),
            registered: registry.metric(
                "meshca_clusters",
                "Clusters in the registry (1 per registered id)",
            ),
            synced: registry.metric(
                "meshca_cluster_synced",
                "1 once a registered cluster's pod index (and ServiceAccount index, where it runs) has synced (its impersonations get Unavailable until then)",
            ),
            freshness_age: registry.metric(
                "meshca_index_freshness_age_seconds",
                "Seconds since the last evidence that a cluster's pod or ServiceAccount index is current (a completed list, a watch the API server accepted, an event, a bookmark); past the pod index staleness bound it vouches for nothing",
            ),
            kubeconfig_refused: registry.reasons(
                "meshca_remote_kubeconfig_refused",
                "Remote secret kubeconfigs refused, by reason",
                super::kubeconfig::KubeconfigError::REASONS.iter().copied(),
            ),
        }
    }

    /// Sets the registered ids (called on every registry change).
    pub fn set_clusters(&self, local: &str, ids: &[String]) {
        let mut names = self.names.write().unwrap_or_else(|p| p.into_inner());
        let next: std::collections::BTreeSet<String> = ids.iter().cloned().collect();
        for gone in names.1.difference(&next) {
            let label = ClusterLabels {
                cluster: gone.clone(),
            };
            self.registered.remove(&label);
            self.synced.remove(&label);
            for index in INDEXES {
                self.freshness_age.remove(&IndexLabels {
                    cluster: gone.clone(),
                    index,
                });
            }
        }
        for id in &next {
            self.registered
                .get_or_create(&ClusterLabels {
                    cluster: id.clone(),
                })
                .set(1);
        }
        *names = (local.to_string(), next);
    }

    /// Sets a registered cluster's sync state.
    pub fn set_synced(&self, id: &str, synced: bool) {
        let known = self
            .names
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .contains(id);
        if known {
            self.synced
                .get_or_create(&ClusterLabels {
                    cluster: id.to_string(),
                })
                .set(i64::from(synced));
        }
    }

    /// Sets a registered cluster's index freshness (`None`: the index does
    /// not run, or has had no evidence yet).
    pub fn set_freshness(&self, id: &str, index: &'static str, age: Option<std::time::Duration>) {
        let known = self
            .names
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .contains(id);
        let label = IndexLabels {
            cluster: id.to_string(),
            index,
        };
        match age {
            Some(age) if known => {
                self.freshness_age
                    .get_or_create(&label)
                    .set(age.as_secs_f64());
            }
            _ => {
                self.freshness_age.remove(&label);
            }
        }
    }

    /// The local cluster id, once a registry exists.
    pub fn local(&self) -> Option<String> {
        let names = self.names.read().unwrap_or_else(|p| p.into_inner());
        Some(names.0.clone()).filter(|l| !l.is_empty())
    }

    /// `id` when registered, else `unknown`.
    pub fn label(&self, id: Option<&str>) -> String {
        let names = self.names.read().unwrap_or_else(|p| p.into_inner());
        match id {
            Some(id) if names.1.contains(id) => id.to_string(),
            _ => UNKNOWN_CLUSTER.to_string(),
        }
    }

    /// Counts one finished request.
    pub fn count(&self, cluster: Option<&str>, decision: Decision) {
        let decision = match decision {
            Decision::Allow => "allow",
            Decision::Deny => "deny",
        };
        self.requests
            .get_or_create(&ClusterDecisionLabels {
                cluster: self.label(cluster),
                decision,
            })
            .inc();
    }

    pub fn kubeconfig_refused(&self, reason: &'static str) {
        self.kubeconfig_refused
            .get_or_create(&RefusalLabels { reason })
            .inc();
    }
}
