//! The leaf every domain's metrics build on: istiod's `citadel_server_*`
//! counters (kept by hand, see the wiring's `telemetry::Metrics::render`),
//! the label sets the domains share, and the per-node refusal family. It
//! imports no domain: each domain defines and registers its own families
//! next to its code, and the wiring (`telemetry`) puts them on one registry.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::{Metric, Registry};

pub mod labels;
pub mod process;

pub use crate::outcome::{Decision, ErrorClass};
pub use labels::{
    DecisionLabels, LatencyLabels, ReasonLabels, RefusalLabels, ResultLabels, SourceResultLabels,
};

/// Values read at scrape time from live state (never a lock on the signing path).
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub root_not_after: Option<i64>,
    pub chain_not_after: Option<i64>,
    pub signing_not_after: Option<i64>,
    /// NotAfter of the CA certificate from `ROOT_CA_DIR` whose key is in
    /// custody: the signing certificate, or with two-tier issuing the one
    /// that signs the short-lived issuing CAs.
    pub ca_not_after: Option<i64>,
    pub pod_index: Option<(u64, bool, u64)>,
    /// The pod watch: (seconds disconnected, 0 while connected; the
    /// staleness bound `MESHCA_POD_INDEX_MAX_STALENESS` in seconds).
    pub pod_index_watch: Option<(f64, f64)>,
    pub token_cache: Option<(u64, u64)>,
    /// thisUpdate and nextUpdate (unix seconds) of the CRL in force for the
    /// current signer, once one is signed.
    pub crl: Option<(i64, i64)>,
    /// What `/readyz` answers (`meshca_ready`).
    pub ready: Option<bool>,
    /// `process_*`, read at the scrape.
    pub process: Option<process::ProcessStats>,
}

/// istiod-compatible counters.
#[derive(Debug, Default)]
pub struct Citadel {
    pub csr_count: AtomicU64,
    pub authentication_failure_count: AtomicU64,
    pub sign_err_csr: AtomicU64,
    pub sign_err_ttl: AtomicU64,
    pub sign_err_cert_gen: AtomicU64,
    pub sign_err_ca_not_ready: AtomicU64,
    pub success_cert_issuance_count: AtomicU64,
    pub csr_parsing_err_count: AtomicU64,
    pub id_extraction_err_count: AtomicU64,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeReasonLabels {
    pub node: String,
    pub reason: &'static str,
}

/// Most distinct `node` label values; further nodes are counted under
/// [`OVERFLOW_NODE`]. A node name only ever comes from verified data (the
/// API server's pod binding of the caller's token, or the pod index), so
/// this is a cluster's node count; the cap is defence in depth.
pub const MAX_NODE_LABELS: usize = 4096;

/// The `node` label once [`MAX_NODE_LABELS`] nodes have been seen.
pub const OVERFLOW_NODE: &str = "overflow";

/// Registration that hands back what it registered. prometheus-client's
/// metrics are shared handles (the registry's clone counts into the same
/// series), so a domain builds its metrics value field by field from these
/// calls: each family is registered where it is made, in the order written,
/// and a field cannot be left unregistered.
pub trait Register {
    /// Registers a new `M` under `name`.
    fn metric<M: Metric + Clone + Default>(&mut self, name: &str, help: &str) -> M {
        self.metric_with(name, help, M::default())
    }

    /// Registers `metric`, one made otherwise than by `Default` (a histogram
    /// and its buckets).
    fn metric_with<M: Metric + Clone>(&mut self, name: &str, help: &str, metric: M) -> M;

    /// Registers a counter family labelled by one reason (or result) with
    /// each of `reasons`' series at zero, so a rate() sees the first one.
    fn reasons<L>(
        &mut self,
        name: &str,
        help: &str,
        reasons: impl IntoIterator<Item = &'static str>,
    ) -> Family<L, Counter>
    where
        L: From<&'static str> + EncodeLabelSet + Clone + Hash + Eq + Debug + Send + Sync + 'static,
    {
        let family = self.metric(name, help);
        pre_create(&family, reasons);
        family
    }
}

impl Register for Registry {
    fn metric_with<M: Metric + Clone>(&mut self, name: &str, help: &str, metric: M) -> M {
        self.register(name, help, metric.clone());
        metric
    }
}

/// Creates each of `reasons`' series at zero (a family registered earlier,
/// whose reasons are known only later).
pub fn pre_create<L>(family: &Family<L, Counter>, reasons: impl IntoIterator<Item = &'static str>)
where
    L: From<&'static str> + Clone + Hash + Eq,
{
    for r in reasons {
        let _ = family.get_or_create(&L::from(r));
    }
}

/// Refusals that say something about a caller rather than about meshca's
/// health: a node proxy asking for identities it may not have, a
/// denylisted or revoked credential, an identity over its issuance cap, a
/// CSR for another identity. Retryable availability refusals (index not
/// synced or stale) are not in it.
pub fn is_security_refusal(reason: &str) -> bool {
    match reason {
        "impersonation_index_not_ready" | "impersonation_index_stale" => false,
        "admission_identity_cap" | "mtls_cert_revoked" | "csr_san_not_authorized" => true,
        r => r.starts_with("impersonation_") || r.starts_with("denylist_"),
    }
}

/// `meshca_node_refusals_total{node,reason}`: security refusals
/// ([`is_security_refusal`]) of callers whose node is known, so a security
/// team sees which node proxy asks for identities it may not have.
#[derive(Debug, Default)]
pub struct NodeRefusalMetrics {
    pub refusals: Family<NodeReasonLabels, Counter>,
    nodes: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl NodeRefusalMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        Self {
            refusals: registry.metric(
                "meshca_node_refusals",
                "Security refusals (impersonation, denylist, revoked certificate, identity cap, CSR for another identity) of callers whose node is known, by node and reason",
            ),
            nodes: Default::default(),
        }
    }

    /// Counts one refusal of a caller on `node` (ignored unless it is a security refusal).
    pub fn count(&self, reason: &'static str, node: &str) {
        if !is_security_refusal(reason) {
            return;
        }
        let node = {
            let mut nodes = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
            if nodes.contains(node) {
                node.to_string()
            } else if nodes.len() < MAX_NODE_LABELS {
                nodes.insert(node.to_string());
                node.to_string()
            } else {
                OVERFLOW_NODE.to_string()
            }
        };
        self.refusals
            .get_or_create(&NodeReasonLabels { node, reason })
            .inc();
    }
}

#[cfg(test)]
mod ops_tests {
    use super::*;

    #[test_case::test_case("impersonation_no_pod_on_node", true)]
    #[test_case::test_case("impersonation_caller_not_trusted", true)]
    #[test_case::test_case("impersonation_index_not_ready", false ; "retryable, not a signal")]
    #[test_case::test_case("impersonation_index_stale", false ; "stale, not a signal")]
    #[test_case::test_case("denylist_node", true)]
    #[test_case::test_case("mtls_cert_revoked", true)]
    #[test_case::test_case("admission_identity_cap", true)]
    #[test_case::test_case("csr_san_not_authorized", true)]
    #[test_case::test_case("admission_queue_full", false)]
    #[test_case::test_case("token_local_bad_signature", false ; "no verified node")]
    fn security_refusals(reason: &str, yes: bool) {
        assert_eq!(is_security_refusal(reason), yes);
    }
}
