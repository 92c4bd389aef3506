//! Authorization of impersonation: may this node proxy receive that identity?
//! The Kubernetes-backed node authorizer implements [`NodeAuthorizer`].

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;

use crate::authn::{AuthnMethod, Caller, Credentials, KubernetesInfo};
use crate::flags::{err, list, ConfigError};
use crate::identity::{IdentityError, SpiffeId, TrustDomain};
use crate::podindex::{IndexState, PodIndex};

/// Why an impersonation request was refused. The client sees istiod's opaque
/// message; the reason goes to the audit log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImpersonationError {
    #[error("impersonation not allowed: CA_TRUSTED_NODE_ACCOUNTS is not configured")]
    NotConfigured,
    #[error("caller authenticated by {0} has no pod binding and cannot impersonate")]
    NoPodBinding(&'static str),
    #[error("caller {0} is not allowed to impersonate")]
    CallerNotTrusted(String),
    #[error("failed to validate impersonated identity {0:?}: {1}")]
    InvalidIdentity(String, IdentityError),
    #[error("impersonated identity trust domain {0} is not the mesh trust domain or an alias")]
    ForeignTrustDomain(String),
    #[error("no node authorizer for cluster {0:?}")]
    UnknownCluster(String),
    #[error("pod index has not completed its first sync")]
    IndexNotReady,
    #[error("pod {0} not found")]
    CallerPodNotFound(String),
    #[error("pod found, but UID does not match: {0} vs {1}")]
    CallerPodUidMismatch(String, String),
    #[error("pod found, but ServiceAccount does not match: {0} vs {1}")]
    CallerServiceAccountMismatch(String, String),
    #[error("caller pod {0} has terminated")]
    CallerPodTerminal(String),
    #[error("caller pod {0} has been deleted")]
    CallerPodDeleted(String),
    #[error("several nodes have a pod at caller address {0}")]
    CallerPodAmbiguous(String),
    #[error("caller pod {0} is not scheduled on a node")]
    CallerPodUnscheduled(String),
    #[error("no instances of {0:?} found on node {1:?}")]
    NoPodOnNode(String, String),
    /// The pod watch has been disconnected beyond its bound: the index may
    /// still show pods long gone from the node (or an IP's old owner).
    #[error("impersonation refused: {0}")]
    IndexStale(String),
    /// An mTLS caller's `clusterid` header disagrees with its certificate's
    /// cluster, or the certificate's cluster is not served (the reason code
    /// of [`crate::authn::AuthnError`] that says which).
    #[error("{1}")]
    MtlsCluster(&'static str, String),
}

impl ImpersonationError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotConfigured => "impersonation_not_configured",
            Self::NoPodBinding(_) => "impersonation_no_pod_binding",
            Self::CallerNotTrusted(_) => "impersonation_caller_not_trusted",
            Self::InvalidIdentity(..) => "impersonation_invalid_identity",
            Self::ForeignTrustDomain(_) => "impersonation_foreign_trust_domain",
            Self::UnknownCluster(_) => "impersonation_unknown_cluster",
            Self::IndexNotReady => "impersonation_index_not_ready",
            Self::CallerPodNotFound(_) => "impersonation_caller_pod_not_found",
            Self::CallerPodUidMismatch(..) => "impersonation_caller_pod_uid_mismatch",
            Self::CallerServiceAccountMismatch(..) => "impersonation_caller_sa_mismatch",
            Self::CallerPodUnscheduled(_) => "impersonation_caller_pod_unscheduled",
            Self::CallerPodTerminal(_) => "impersonation_caller_pod_terminal",
            Self::CallerPodDeleted(_) => "impersonation_caller_pod_deleted",
            Self::CallerPodAmbiguous(_) => "impersonation_caller_pod_ambiguous",
            Self::NoPodOnNode(..) => "impersonation_no_pod_on_node",
            Self::IndexStale(_) => "impersonation_index_stale",
            Self::MtlsCluster(reason, _) => reason,
        }
    }

    /// Retryable: the client should try again shortly.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::IndexNotReady | Self::IndexStale(_))
    }
}

/// What allowed an impersonation, for the audit record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evidence {
    /// The caller's node.
    pub node: String,
    /// A pod of the requested identity on that node (`ns/name uid`).
    pub pod: String,
}

/// Decides whether `caller` may receive `requested`.
pub trait NodeAuthorizer: Send + Sync + std::fmt::Debug {
    fn authorize(
        &self,
        caller: &Caller,
        requested: &str,
        creds: &Credentials,
    ) -> Result<(SpiffeId, Evidence), ImpersonationError>;

    /// The pod index `authorize` would read for `creds`, and how long to
    /// wait for it, while it has not finished its first list (a cold start).
    /// The caller awaits [`PodIndex::wait_synced`] before `authorize`.
    fn unsynced_index(&self, _creds: &Credentials) -> Option<(Arc<PodIndex>, std::time::Duration)> {
        None
    }
}

/// The static part of node authorization.
#[derive(Debug, Clone)]
pub struct NodePolicy {
    /// `CA_TRUSTED_NODE_ACCOUNTS`.
    pub trusted: HashSet<ServiceAccountRef>,
    /// Mesh trust domain first, then aliases.
    pub trust_domains: Vec<TrustDomain>,
    /// `CLUSTER_ID`: the only cluster this CA authorizes for.
    pub cluster_id: String,
    /// Let mTLS callers impersonate, locating their node by source IP.
    pub mtls_impersonation: bool,
}

/// istiod's node authorization (node_auth.go), then stricter: the requested
/// identity must be in the mesh trust domain, the caller's pod must not be
/// terminal, terminal pods never authorize, pods deleted by `now_unix` (the
/// API server's rule for bound tokens) neither call nor authorize, and an
/// unsynced index is a retryable error rather than a silent deny.
pub fn authorize_impersonation(
    policy: &NodePolicy,
    caller: &Caller,
    requested: &str,
    creds: &Credentials,
    index_synced: bool,
    index: &IndexState,
    now_unix: i64,
) -> Result<(SpiffeId, Evidence), ImpersonationError> {
    // istiod looks the cluster up exactly: no alias, no "empty means local".
    let cluster = creds.cluster_id.as_deref().unwrap_or("");
    if cluster != policy.cluster_id {
        return Err(ImpersonationError::UnknownCluster(cluster.to_string()));
    }
    let (caller_ns, caller_sa) = match (&caller.kube, caller.method) {
        (Some(k), _) => (k.pod_namespace.clone(), k.service_account.clone()),
        (None, AuthnMethod::Mtls) if policy.mtls_impersonation => (
            caller.identity.namespace().to_string(),
            caller.identity.service_account().to_string(),
        ),
        (None, method) => return Err(ImpersonationError::NoPodBinding(method.as_str())),
    };
    let caller_ref = ServiceAccountRef {
        namespace: caller_ns.clone(),
        name: caller_sa.clone(),
    };
    if !policy.trusted.contains(&caller_ref) {
        return Err(ImpersonationError::CallerNotTrusted(caller_ref.to_string()));
    }
    let id: SpiffeId = requested
        .parse()
        .map_err(|e| ImpersonationError::InvalidIdentity(requested.to_string(), e))?;
    if !policy.trust_domains.contains(id.trust_domain()) {
        return Err(ImpersonationError::ForeignTrustDomain(
            id.trust_domain().to_string(),
        ));
    }
    if !index_synced {
        return Err(ImpersonationError::IndexNotReady);
    }
    let node = match &caller.kube {
        Some(k) => caller_node_from_token(k, index, now_unix)?,
        None => caller_node_from_ip(
            &caller_ref,
            creds.peer_addr.map(|a| a.ip()),
            index,
            now_unix,
        )?,
    };
    let pod = index
        .on_node(&node, id.namespace(), id.service_account(), now_unix)
        .next()
        .ok_or_else(|| {
            ImpersonationError::NoPodOnNode(
                format!("{}/{}", id.namespace(), id.service_account()),
                node.clone(),
            )
        })?;
    let evidence = Evidence {
        node: node.clone(),
        pod: format!("{}/{} uid={}", pod.namespace, pod.name, pod.uid),
    };
    Ok((id, evidence))
}

fn caller_node_from_token(
    k: &KubernetesInfo,
    index: &IndexState,
    now_unix: i64,
) -> Result<String, ImpersonationError> {
    let pod_ref = format!("{}/{}", k.pod_namespace, k.pod_name);
    let pod = index
        .get(&k.pod_namespace, &k.pod_name)
        .ok_or_else(|| ImpersonationError::CallerPodNotFound(pod_ref.clone()))?;
    if *pod.uid != *k.pod_uid {
        return Err(ImpersonationError::CallerPodUidMismatch(
            pod.uid.to_string(),
            k.pod_uid.clone(),
        ));
    }
    if *pod.service_account != *k.service_account {
        return Err(ImpersonationError::CallerServiceAccountMismatch(
            pod.service_account.to_string(),
            k.service_account.clone(),
        ));
    }
    if pod.phase.is_terminal() {
        return Err(ImpersonationError::CallerPodTerminal(pod_ref));
    }
    if pod.deleted_by(now_unix) {
        return Err(ImpersonationError::CallerPodDeleted(pod_ref));
    }
    pod.node
        .as_ref()
        .map(|n| n.to_string())
        .ok_or(ImpersonationError::CallerPodUnscheduled(pod_ref))
}

/// mTLS callers: the caller's node is the node of the running pod that owns
/// the connection's source IP and runs as the certificate's service account.
fn caller_node_from_ip(
    sa: &ServiceAccountRef,
    ip: Option<IpAddr>,
    index: &IndexState,
    now_unix: i64,
) -> Result<String, ImpersonationError> {
    let ip = ip.ok_or_else(|| ImpersonationError::CallerPodNotFound("(no peer address)".into()))?;
    let nodes: HashSet<&str> = index
        .with_ip(ip)
        .filter(|p| {
            !p.phase.is_terminal()
                && !p.deleted_by(now_unix)
                && *p.namespace == *sa.namespace
                && *p.service_account == *sa.name
        })
        .filter_map(|p| p.node)
        .collect();
    match nodes.into_iter().collect::<Vec<_>>().as_slice() {
        [node] => Ok(node.to_string()),
        [] => Err(ImpersonationError::CallerPodNotFound(format!(
            "{sa} at {ip}"
        ))),
        _ => Err(ImpersonationError::CallerPodAmbiguous(ip.to_string())),
    }
}

/// Node authorization backed by the live pod index.
#[derive(Debug)]
pub struct KubeNodeAuthorizer {
    pub policy: NodePolicy,
    pub index: Arc<PodIndex>,
    /// Impersonation is refused (retryable) while the watch has been
    /// disconnected longer than this, whoever the caller is.
    pub max_index_staleness: std::time::Duration,
    /// `MESHCA_POD_INDEX_SYNC_WAIT`.
    pub sync_wait: std::time::Duration,
}

impl NodeAuthorizer for KubeNodeAuthorizer {
    fn authorize(
        &self,
        caller: &Caller,
        requested: &str,
        creds: &Credentials,
    ) -> Result<(SpiffeId, Evidence), ImpersonationError> {
        let synced = self.index.is_synced();
        crate::renewal::index_current(self.index.disconnected_for(), self.max_index_staleness)
            .map_err(|e| ImpersonationError::IndexStale(e.to_string()))?;
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        self.index.read(|state| {
            authorize_impersonation(&self.policy, caller, requested, creds, synced, state, now)
        })
    }

    fn unsynced_index(&self, _creds: &Credentials) -> Option<(Arc<PodIndex>, std::time::Duration)> {
        (!self.index.is_synced()).then(|| (self.index.clone(), self.sync_wait))
    }
}

/// A `namespace/serviceaccount` pair (`CA_TRUSTED_NODE_ACCOUNTS` entries).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceAccountRef {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ServiceAccountRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Parses `CA_TRUSTED_NODE_ACCOUNTS`. istiod skips malformed entries with a
/// warning; meshca refuses to start, since a typo would silently disable
/// (or mis-target) impersonation.
pub fn parse_service_accounts(s: &str) -> Result<Vec<ServiceAccountRef>, ConfigError> {
    list(s)
        .map(|entry| match entry.split_once('/') {
            Some((ns, sa)) if !ns.is_empty() && !sa.is_empty() && !sa.contains('/') => {
                Ok(ServiceAccountRef {
                    namespace: ns.to_string(),
                    name: sa.to_string(),
                })
            }
            _ => Err(err(
                "CA_TRUSTED_NODE_ACCOUNTS",
                entry,
                "expected <namespace>/<serviceaccount>",
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::podindex::{pod, IndexEvent, LeanPod, Phase};
    use test_case::test_case;

    const REQ: &str = "spiffe://cluster.local/ns/ns-a/sa/sa-a";
    const NOW: i64 = 1_000_000;

    fn ztunnel_pod() -> LeanPod {
        pod(
            "istio-system",
            "ztunnel-a",
            "12345",
            Some("zt-node"),
            "ztunnel",
            Phase::Running,
        )
    }
    fn same_node() -> LeanPod {
        pod(
            "ns-a",
            "pod-a",
            "a1",
            Some("zt-node"),
            "sa-a",
            Phase::Running,
        )
    }
    fn other_node() -> LeanPod {
        pod(
            "ns-a",
            "pod-b",
            "b1",
            Some("other-node"),
            "sa-a",
            Phase::Running,
        )
    }

    fn policy(trusted: &[&str]) -> NodePolicy {
        NodePolicy {
            trusted: crate::config::parse_service_accounts(&trusted.join(","))
                .unwrap()
                .into_iter()
                .collect(),
            trust_domains: vec![
                TrustDomain::new("cluster.local").unwrap(),
                TrustDomain::new("alias.local").unwrap(),
            ],
            cluster_id: "Kubernetes".into(),
            mtls_impersonation: false,
        }
    }

    fn token_caller(uid: &str) -> Caller {
        Caller {
            method: AuthnMethod::TokenReview,
            identity: "spiffe://cluster.local/ns/istio-system/sa/ztunnel"
                .parse()
                .unwrap(),
            kube: Some(KubernetesInfo {
                pod_namespace: "istio-system".into(),
                pod_name: "ztunnel-a".into(),
                pod_uid: uid.into(),
                service_account: "ztunnel".into(),
                node_name: Some("zt-node".into()),
                cluster_id: None,
            }),
        }
    }

    fn creds(cluster: Option<&str>) -> Credentials {
        Credentials {
            cluster_id: cluster.map(str::to_string),
            peer_addr: Some("10.0.0.9:4000".parse().unwrap()),
            ..Default::default()
        }
    }

    fn state(pods: Vec<LeanPod>) -> IndexState {
        let mut s = IndexState::default();
        s.apply(IndexEvent::Init);
        for p in pods {
            s.apply(IndexEvent::InitApply(p));
        }
        s.apply(IndexEvent::InitDone);
        s
    }

    // Upstream node_auth_test.go cases, then meshca's stricter ones.
    #[test_case(&[], vec![], REQ, "12345", Some("Kubernetes"), Some("impersonation_caller_not_trusted") ; "empty allowed identities")]
    #[test_case(&["istio-system/ztunnel"], vec![ztunnel_pod()], REQ, "12345", Some("Kubernetes"), Some("impersonation_no_pod_on_node") ; "allowed but not on node")]
    #[test_case(&["istio-system/ztunnel"], vec![ztunnel_pod(), same_node()], REQ, "12345", Some("Kubernetes"), None ; "allowed on node")]
    #[test_case(&["istio-system/ztunnel"], vec![ztunnel_pod(), other_node()], REQ, "12345", Some("Kubernetes"), Some("impersonation_no_pod_on_node") ; "allowed off node")]
    #[test_case(&["istio-system/ztunnel"], vec![ztunnel_pod(), same_node(), other_node()], REQ, "12345", Some("Kubernetes"), None ; "on and off node")]
    #[test_case(&["istio-system/ztunnel"], vec![ztunnel_pod()], "not-spiffe-idenditity", "12345", Some("Kubernetes"), Some("impersonation_invalid_identity") ; "invalid requested")]
    #[test_case(&["istio-system/ztunnel"], vec![same_node()], REQ, "12345", Some("Kubernetes"), Some("impersonation_caller_pod_not_found") ; "unknown caller")]
    #[test_case(&["istio-system/ztunnel"], vec![ztunnel_pod(), same_node()], REQ, "bogus", Some("Kubernetes"), Some("impersonation_caller_pod_uid_mismatch") ; "bad uid")]
    #[test_case(&["istio-system/ztunnel"], vec![pod("istio-system", "ztunnel-a", "12345", Some("zt-node"), "bogus", Phase::Running), same_node()], REQ, "12345", Some("Kubernetes"), Some("impersonation_caller_sa_mismatch") ; "bad account")]
    #[test_case(&["istio-system/ztunnel"], vec![ztunnel_pod(), same_node()], "spiffe://evil.domain/ns/ns-a/sa/sa-a", "12345", Some("Kubernetes"), Some("impersonation_foreign_trust_domain") ; "foreign trust domain")]
    #[test_case(&["istio-system/ztunnel"], vec![ztunnel_pod(), same_node()], "spiffe://alias.local/ns/ns-a/sa/sa-a", "12345", Some("Kubernetes"), None ; "alias trust domain")]
    #[test_case(&["istio-system/ztunnel"], vec![ztunnel_pod(), same_node()], REQ, "12345", None, Some("impersonation_unknown_cluster") ; "missing clusterid")]
    #[test_case(&["istio-system/ztunnel"], vec![ztunnel_pod(), same_node()], REQ, "12345", Some("remote"), Some("impersonation_unknown_cluster") ; "other cluster")]
    #[test_case(&["istio-system/ztunnel"], vec![ztunnel_pod(), pod("ns-a", "pod-a", "a1", Some("zt-node"), "sa-a", Phase::Succeeded)], REQ, "12345", Some("Kubernetes"), Some("impersonation_no_pod_on_node") ; "succeeded pod does not authorize")]
    #[test_case(&["istio-system/ztunnel"], vec![pod("istio-system", "ztunnel-a", "12345", Some("zt-node"), "ztunnel", Phase::Succeeded), same_node()], REQ, "12345", Some("Kubernetes"), Some("impersonation_caller_pod_terminal") ; "terminated caller")]
    #[test_case(&["istio-system/ztunnel"], vec![pod("istio-system", "ztunnel-a", "12345", None, "ztunnel", Phase::Pending), same_node()], REQ, "12345", Some("Kubernetes"), Some("impersonation_caller_pod_unscheduled") ; "unscheduled caller")]
    #[test_case(&["istio-system/ztunnel"], vec![ztunnel_pod(), pod("ns-a", "pod-a", "a1", Some("zt-node"), "sa-other", Phase::Running)], REQ, "12345", Some("Kubernetes"), Some("impersonation_no_pod_on_node") ; "other sa on node")]
    fn token_callers(
        trusted: &[&str],
        pods: Vec<LeanPod>,
        requested: &str,
        uid: &str,
        cluster: Option<&str>,
        want: Option<&str>,
    ) {
        let got = authorize_impersonation(
            &policy(trusted),
            &token_caller(uid),
            requested,
            &creds(cluster),
            true,
            &state(pods),
            NOW,
        );
        match (got, want) {
            (Ok((id, ev)), None) => {
                assert_eq!(id.to_string(), requested);
                assert_eq!(ev.node, "zt-node");
                assert!(ev.pod.starts_with("ns-a/pod-a"), "{ev:?}");
            }
            (Err(e), Some(reason)) => assert_eq!(e.reason(), reason, "{e}"),
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn unsynced_index_is_retryable() {
        let e = authorize_impersonation(
            &policy(&["istio-system/ztunnel"]),
            &token_caller("12345"),
            REQ,
            &creds(Some("Kubernetes")),
            false,
            &IndexState::default(),
            NOW,
        )
        .unwrap_err();
        assert_eq!(e, ImpersonationError::IndexNotReady);
        assert!(e.is_unavailable());
    }

    fn mtls_caller() -> Caller {
        Caller {
            method: AuthnMethod::Mtls,
            identity: "spiffe://cluster.local/ns/istio-system/sa/ztunnel"
                .parse()
                .unwrap(),
            kube: None,
        }
    }

    #[test]
    fn mtls_callers_cannot_impersonate_by_default() {
        let e = authorize_impersonation(
            &policy(&["istio-system/ztunnel"]),
            &mtls_caller(),
            REQ,
            &creds(Some("Kubernetes")),
            true,
            &state(vec![ztunnel_pod(), same_node()]),
            NOW,
        )
        .unwrap_err();
        assert_eq!(e.reason(), "impersonation_no_pod_binding");
    }

    #[test_case("10.0.0.9", "ztunnel", None ; "source ip matches ztunnel pod")]
    #[test_case("10.0.0.8", "ztunnel", Some("impersonation_caller_pod_not_found") ; "unknown source ip")]
    #[test_case("10.0.0.9", "other", Some("impersonation_caller_pod_not_found") ; "ip belongs to another sa")]
    fn mtls_impersonation_by_source_ip(pod_ip: &str, pod_sa: &str, want: Option<&str>) {
        let mut p = policy(&["istio-system/ztunnel"]);
        p.mtls_impersonation = true;
        let mut zt = pod(
            "istio-system",
            "ztunnel-a",
            "12345",
            Some("zt-node"),
            pod_sa,
            Phase::Running,
        );
        zt.pod_ips = vec![pod_ip.parse().unwrap()];
        let got = authorize_impersonation(
            &p,
            &mtls_caller(),
            REQ,
            &creds(Some("Kubernetes")),
            true,
            &state(vec![zt, same_node()]),
            NOW,
        );
        match want {
            None => assert_eq!(got.unwrap().1.node, "zt-node"),
            Some(r) => assert_eq!(got.unwrap_err().reason(), r),
        }
    }

    /// A pod whose deletion began more than the leeway ago neither calls nor
    /// authorizes (a node partitioned with its pods stuck Terminating), for
    /// token and source-IP callers alike; within the leeway it still does.
    #[test]
    fn deleted_pods_neither_call_nor_authorize() {
        let del = |p: LeanPod, secs_ago: Option<i64>| LeanPod {
            deletion_timestamp: secs_ago.map(|a| NOW - a),
            ..p
        };
        let mut zt_ip = ztunnel_pod();
        zt_ip.pod_ips = vec!["10.0.0.9".parse().unwrap()];
        let mut mtls = policy(&["istio-system/ztunnel"]);
        mtls.mtls_impersonation = true;
        // (caller deleting since, target deleting since, token caller want, mTLS caller want)
        type Case = (
            Option<i64>,
            Option<i64>,
            Option<&'static str>,
            Option<&'static str>,
        );
        let cases: [Case; 5] = [
            (None, None, None, None),
            (Some(60), Some(60), None, None),
            (
                Some(61),
                None,
                Some("impersonation_caller_pod_deleted"),
                Some("impersonation_caller_pod_not_found"),
            ),
            (
                None,
                Some(61),
                Some("impersonation_no_pod_on_node"),
                Some("impersonation_no_pod_on_node"),
            ),
            (
                Some(3600),
                Some(3600),
                Some("impersonation_caller_pod_deleted"),
                Some("impersonation_caller_pod_not_found"),
            ),
        ];
        for (caller_del, target_del, want_token, want_mtls) in cases {
            let pods = vec![del(zt_ip.clone(), caller_del), del(same_node(), target_del)];
            let token = authorize_impersonation(
                &policy(&["istio-system/ztunnel"]),
                &token_caller("12345"),
                REQ,
                &creds(Some("Kubernetes")),
                true,
                &state(pods.clone()),
                NOW,
            );
            let by_ip = authorize_impersonation(
                &mtls,
                &mtls_caller(),
                REQ,
                &creds(Some("Kubernetes")),
                true,
                &state(pods),
                NOW,
            );
            let case = format!("caller {caller_del:?} target {target_del:?}");
            assert_eq!(token.err().map(|e| e.reason()), want_token, "token: {case}");
            assert_eq!(by_ip.err().map(|e| e.reason()), want_mtls, "mtls: {case}");
        }
    }

    /// While the pod watch is down past its bound, no impersonation is
    /// authorized, whether the caller came with a token or a certificate.
    #[test]
    fn a_stale_index_refuses_every_caller() {
        let index = Arc::new(PodIndex::new());
        index.apply(IndexEvent::Init);
        let mut zt = ztunnel_pod();
        zt.pod_ips = vec!["10.0.0.9".parse().unwrap()];
        index.apply(IndexEvent::InitApply(zt));
        index.apply(IndexEvent::InitApply(same_node()));
        index.apply(IndexEvent::InitDone);
        let mut p = policy(&["istio-system/ztunnel"]);
        p.mtls_impersonation = true;
        let authz = KubeNodeAuthorizer {
            policy: p,
            index: index.clone(),
            max_index_staleness: std::time::Duration::ZERO,
            sync_wait: std::time::Duration::ZERO,
        };
        let c = creds(Some("Kubernetes"));
        assert!(authz.authorize(&token_caller("12345"), REQ, &c).is_ok());
        assert!(authz.authorize(&mtls_caller(), REQ, &c).is_ok());
        index.mark_disconnected();
        std::thread::sleep(std::time::Duration::from_millis(5));
        for caller in [token_caller("12345"), mtls_caller()] {
            let e = authz.authorize(&caller, REQ, &c).unwrap_err();
            assert_eq!(e.reason(), "impersonation_index_stale", "{caller:?}");
            assert!(e.is_unavailable());
        }
    }
}
