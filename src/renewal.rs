//! Bounded mTLS renewal: a client certificate alone no longer renews its
//! identity forever. Decisions are plain functions over plain data
//! ([`check`], [`capped_ttl`], [`index_current`]); [`RenewalGuard`] only
//! reads the live pod index into an [`IndexView`].
//!
//! - With the pod index on, an mTLS caller renewing its own identity needs a
//!   live (non-terminal) pod running as that service account.
//! - While the index's watch has been disconnected longer than
//!   `max_index_staleness`, the index cannot vouch for anything: renewals and
//!   source-IP impersonation are refused (retryable).
//! - With the index off there is nothing to check; the renewal is allowed and
//!   the record says so (`renewal_check: "index_off"`).
//! - Every leaf issued to an mTLS caller lives at most `max_ttl` (capped, not
//!   refused: a renewal asking for 90 days gets the cap; only a request over
//!   `MAX_WORKLOAD_CERT_TTL` is still refused, as istiod does).

use std::sync::Arc;
use std::time::Duration;

use crate::identity::SpiffeId;
use crate::podindex::PodIndex;

/// Renewal limits, parsed once from flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenewalPolicy {
    /// Longest leaf issued to an mTLS-authenticated caller
    /// (`MESHCA_MTLS_RENEWAL_MAX_TTL`, default = `DEFAULT_WORKLOAD_CERT_TTL`).
    pub max_ttl: Duration,
    /// How long the pod watch may be disconnected before the index is stale
    /// (`MESHCA_POD_INDEX_MAX_STALENESS`).
    pub max_index_staleness: Duration,
}

impl Default for RenewalPolicy {
    fn default() -> Self {
        Self {
            max_ttl: Duration::from_secs(24 * 3600),
            max_index_staleness: Duration::from_secs(60),
        }
    }
}

/// What the pod index can say about one identity at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexView {
    /// No pod index runs (Kubernetes off, or the pod check turned off).
    Off,
    /// The first list has not completed.
    NotSynced,
    Synced {
        /// How long the watch has been disconnected, if it is.
        disconnected_for: Option<Duration>,
        /// A non-terminal pod runs as the identity's service account.
        live_pod: bool,
    },
}

/// What allowed a renewal (written to the audit record).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenewalBasis {
    /// The index is current and a live pod runs as the identity.
    PodLive,
    /// No index: nothing could be checked.
    IndexOff,
}

impl RenewalBasis {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PodLive => "pod_live",
            Self::IndexOff => "index_off",
        }
    }
}

/// Why a renewal was refused; one reason code per index mode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenewalError {
    #[error("no live pod runs as {0}")]
    NoLivePod(String),
    #[error("pod index disconnected for {}s (max {}s)", .for_.as_secs(), .max.as_secs())]
    IndexStale { for_: Duration, max: Duration },
    #[error("pod index has not completed its first sync")]
    IndexNotReady,
}

impl RenewalError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NoLivePod(_) => "renewal_no_live_pod",
            Self::IndexStale { .. } => "renewal_index_stale",
            Self::IndexNotReady => "renewal_index_not_ready",
        }
    }

    /// The index may recover: the client should retry.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::IndexStale { .. } | Self::IndexNotReady)
    }
}

/// Is the index too stale to vouch for anything?
pub fn stale(disconnected_for: Option<Duration>, max: Duration) -> Option<RenewalError> {
    match disconnected_for {
        Some(d) if d > max => Some(RenewalError::IndexStale { for_: d, max }),
        _ => None,
    }
}

/// May an mTLS caller renew `identity`?
pub fn check(
    view: IndexView,
    identity: &str,
    policy: &RenewalPolicy,
) -> Result<RenewalBasis, RenewalError> {
    match view {
        IndexView::Off => Ok(RenewalBasis::IndexOff),
        IndexView::NotSynced => Err(RenewalError::IndexNotReady),
        IndexView::Synced {
            disconnected_for,
            live_pod,
        } => {
            if let Some(e) = stale(disconnected_for, policy.max_index_staleness) {
                return Err(e);
            }
            if live_pod {
                Ok(RenewalBasis::PodLive)
            } else {
                Err(RenewalError::NoLivePod(identity.to_string()))
            }
        }
    }
}

/// The TTL (seconds, as on the wire) to grant an mTLS caller that asked for
/// `requested_secs` (<= 0 means the default): never more than `cap`.
/// A request above the policy's `max` is left alone so it is refused exactly
/// as istiod refuses it (`ttl_too_long`); anything up to `max` is cut.
/// Returns the TTL and whether it was cut.
pub fn capped_ttl(requested_secs: i64, ttl: &crate::ca::TtlPolicy, cap: Duration) -> (i64, bool) {
    let secs = |d: Duration| i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
    let cap = secs(cap).max(1);
    let asked = if requested_secs <= 0 {
        secs(ttl.default)
    } else {
        requested_secs
    };
    if asked > cap && asked <= secs(ttl.max) {
        (cap, true)
    } else {
        (requested_secs, false)
    }
}

/// May the index vouch for a node right now (a node proxy located by its
/// source IP, a pod of the requested identity on the caller's node)? Only
/// while it follows the API server: a stale index may still show pods long
/// gone from the node (and their addresses reused).
pub fn index_current(
    disconnected_for: Option<Duration>,
    max: Duration,
) -> Result<(), RenewalError> {
    match stale(disconnected_for, max) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The pod indexes of the clusters of the cluster registry, for a renewal
/// bound to the cluster its certificate was issued for.
pub trait LivePods: Send + Sync + std::fmt::Debug {
    /// What cluster `cluster`'s pod index says about
    /// `namespace/service_account`; `None` when no such cluster (or no pod
    /// index for it) is registered.
    fn view_in(&self, cluster: &str, namespace: &str, service_account: &str) -> Option<IndexView>;
}

impl IndexView {
    /// What `index` (none: no pod index runs) says about one service account.
    pub fn of(index: Option<&PodIndex>, namespace: &str, service_account: &str) -> Self {
        match index {
            None => IndexView::Off,
            Some(i) if !i.is_synced() => IndexView::NotSynced,
            Some(i) => IndexView::Synced {
                disconnected_for: i.disconnected_for(),
                live_pod: i.read(|s| {
                    s.has_live_pod(
                        namespace,
                        service_account,
                        time::OffsetDateTime::now_utc().unix_timestamp(),
                    )
                }),
            },
        }
    }
}

/// Reads the live index for [`check`].
#[derive(Debug, Clone)]
pub struct RenewalGuard {
    pub policy: RenewalPolicy,
    pub index: Option<Arc<PodIndex>>,
    /// Every registered cluster's index, the local one included (Kubernetes
    /// on); a renewal is judged by the index of its certificate's cluster.
    pub remote: Option<Arc<dyn LivePods>>,
    /// `MESHCA_POD_INDEX_SYNC_WAIT`: how long a renewal waits for the index's first list.
    pub sync_wait: std::time::Duration,
}

impl RenewalGuard {
    /// The index `check` reads, while it has not finished its first list.
    pub fn unsynced_index(&self) -> Option<(Arc<PodIndex>, std::time::Duration)> {
        self.index
            .as_ref()
            .filter(|i| !i.is_synced())
            .map(|i| (i.clone(), self.sync_wait))
    }

    /// What the local index says about `id`.
    pub fn view(&self, id: &SpiffeId) -> IndexView {
        IndexView::of(self.index.as_deref(), id.namespace(), id.service_account())
    }

    /// May an mTLS caller renew `id`? Judged by the local index.
    pub fn check(&self, id: &SpiffeId) -> Result<RenewalBasis, RenewalError> {
        check(self.view(id), &id.to_string(), &self.policy)
    }

    /// May an mTLS caller whose certificate was issued for `cluster` renew
    /// `id`? Only a live pod in that cluster counts: the same service
    /// account running in another cluster does not keep a leaf of this one
    /// alive. Without a cluster registry (or without a cluster), the local
    /// index decides.
    pub fn check_in(
        &self,
        id: &SpiffeId,
        cluster: Option<&str>,
    ) -> Result<RenewalBasis, RenewalError> {
        let view = match (cluster, &self.remote) {
            (Some(c), Some(r)) => r
                .view_in(c, id.namespace(), id.service_account())
                .ok_or_else(|| {
                    RenewalError::NoLivePod(format!("{id} (cluster {c:?} has no pod index)"))
                })?,
            _ => self.view(id),
        };
        check(view, &id.to_string(), &self.policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    const S: fn(u64) -> Duration = Duration::from_secs;

    fn policy() -> RenewalPolicy {
        RenewalPolicy {
            max_ttl: S(3600),
            max_index_staleness: S(30),
        }
    }

    fn synced(disconnected: Option<u64>, live_pod: bool) -> IndexView {
        IndexView::Synced {
            disconnected_for: disconnected.map(S),
            live_pod,
        }
    }

    #[test_case(IndexView::Off, Ok("index_off") ; "index off allows and says so")]
    #[test_case(IndexView::NotSynced, Err("renewal_index_not_ready") ; "not synced")]
    #[test_case(synced(None, true), Ok("pod_live") ; "live pod")]
    #[test_case(synced(None, false), Err("renewal_no_live_pod") ; "pod deleted or terminal")]
    #[test_case(synced(Some(30), true), Ok("pod_live") ; "disconnected at the bound")]
    #[test_case(synced(Some(31), true), Err("renewal_index_stale") ; "stale beats a live pod")]
    #[test_case(synced(Some(31), false), Err("renewal_index_stale") ; "stale and no pod")]
    fn renewal(view: IndexView, want: Result<&str, &str>) {
        let got = check(view, "spiffe://td/ns/a/sa/b", &policy())
            .map(RenewalBasis::as_str)
            .map_err(|e| e.reason());
        assert_eq!(got, want);
    }

    #[test_case(0, 86400, 3600, (3600, true) ; "default above the cap is cut")]
    #[test_case(0, 1800, 3600, (0, false) ; "default below the cap stays the default")]
    #[test_case(90 * 86400, 86400, 3600, (3600, true) ; "the max is cut")]
    #[test_case(600, 86400, 3600, (600, false) ; "short request kept")]
    #[test_case(3600, 86400, 3600, (3600, false) ; "exactly the cap")]
    #[test_case(-5, 86400, 3600, (3600, true) ; "negative means default")]
    #[test_case(90 * 86400 + 1, 86400, 3600, (90 * 86400 + 1, false) ; "above the max is left to be refused")]
    #[test_case(i64::MAX, 86400, 3600, (i64::MAX, false) ; "huge request left to be refused")]
    fn cap(requested: i64, default: u64, cap: u64, want: (i64, bool)) {
        let ttl = crate::ca::TtlPolicy {
            default: S(default),
            max: S(90 * 86400),
            jitter: None,
        };
        assert_eq!(capped_ttl(requested, &ttl, S(cap)), want);
    }

    /// What the registry says for each cluster.
    #[derive(Debug)]
    struct Clusters(Vec<(&'static str, IndexView)>);

    impl LivePods for Clusters {
        fn view_in(&self, cluster: &str, _: &str, _: &str) -> Option<IndexView> {
            self.0.iter().find(|(c, _)| *c == cluster).map(|(_, v)| *v)
        }
    }

    /// A renewal is judged by the index of its certificate's cluster only.
    #[test_case(None, true, Err("renewal_index_not_ready") ; "no cluster: the local index")]
    #[test_case(Some("east"), true, Ok("pod_live") ; "east's index")]
    #[test_case(Some("west"), true, Err("renewal_no_live_pod") ; "west has no pod")]
    #[test_case(Some("gone"), true, Err("renewal_no_live_pod") ; "unregistered cluster")]
    #[test_case(Some("east"), false, Err("renewal_index_not_ready") ; "no registry: the local index")]
    fn renewal_in_the_certificates_cluster(
        cluster: Option<&str>,
        registry: bool,
        want: Result<&str, &str>,
    ) {
        let g = RenewalGuard {
            policy: policy(),
            // The local index has not listed yet.
            index: Some(Arc::new(PodIndex::new())),
            remote: registry.then(|| {
                Arc::new(Clusters(vec![
                    ("east", synced(None, true)),
                    ("west", synced(None, false)),
                ])) as Arc<dyn LivePods>
            }),
            sync_wait: Duration::ZERO,
        };
        let id: SpiffeId = "spiffe://td/ns/a/sa/b".parse().unwrap();
        let got = g
            .check_in(&id, cluster)
            .map(RenewalBasis::as_str)
            .map_err(|e| e.reason());
        assert_eq!(got, want);
    }

    #[test_case(None, true ; "connected")]
    #[test_case(Some(10), true ; "briefly disconnected")]
    #[test_case(Some(31), false ; "stale")]
    fn source_ip(disconnected: Option<u64>, ok: bool) {
        let r = index_current(disconnected.map(S), S(30));
        assert_eq!(r.is_ok(), ok);
        if let Err(e) = r {
            assert_eq!(e.reason(), "renewal_index_stale");
            assert!(e.is_unavailable());
        }
    }
}
