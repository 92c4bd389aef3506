//! Metrics: istiod's `citadel_server_*` names exactly as istiod exports them,
//! plus meshca's own. istiod's exporter drops the `_total` suffix from
//! counters; prometheus-client always appends it (OpenMetrics), so the
//! citadel block is written by hand in the Prometheus text format and
//! meshca's own families (which follow the `_total` convention) come from
//! the prometheus-client registry.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

pub mod labels;

pub use crate::authn::metrics::{TokenPathLabels, TokenPathMetrics};
pub use crate::cluster::metrics::{
    ClusterDecisionLabels, ClusterLabels, ClusterMetrics, UNKNOWN_CLUSTER,
};
use crate::outcome::OutcomeObserver;
pub use crate::outcome::{Decision, ErrorClass};
pub use crate::revocation::metrics::KillSwitchMetrics;
pub use labels::{
    DecisionLabels, LatencyLabels, ReasonLabels, RefusalLabels, ResultLabels, SourceResultLabels,
};

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

/// Everything meshca counts. Cheap to clone via `Arc`.
#[derive(Debug)]
pub struct Metrics {
    pub citadel: Citadel,
    pub decisions: Family<DecisionLabels, Counter>,
    /// `meshca_request_duration_seconds{decision}`: one observation per
    /// CreateCertificate request, made by its audit guard when the record is
    /// sealed ([`Self::record`]). `decision="allow"` is a certificate issued
    /// (reason `issued`); `decision="deny"` is every refusal, sheds included,
    /// and also an issued certificate whose audit record was refused (it is
    /// withheld). The PodCertificateRequest signer does not observe it.
    ///
    /// The clock starts when `CertificateIssuer::issue_within` begins: after
    /// the request gate's slot (`grpc::RequestGateLayer`, where `Arrival` is
    /// stamped) and after tonic has read and decoded the message, but before
    /// the pre-auth check, authentication and the admission queue, so the
    /// wait for an admission slot is included. It stops when the audit
    /// record is sealed, before it is handed to the audit writer: the wait
    /// for the writer's acknowledgement (the fsync policy) and writing the
    /// response are not included.
    pub request_duration: Family<LatencyLabels, Histogram>,
    pub tokenreview_duration: Histogram,
    pub tokenreview_errors: Counter,
    /// TokenReviews sent, by result (`authenticated`, `rejected`, `error`).
    pub tokenreviews: Family<ResultLabels, Counter>,
    pub tokenreview_coalesced: Counter,
    pub tokenreview_negative_cache_hits: Counter,
    pub tokenreview_precheck_rejected: Family<ReasonLabels, Counter>,
    pub tokenreview_refused: Family<ReasonLabels, Counter>,
    pub tokenreview_inflight: Gauge,
    pub ca_reloads: Family<ResultLabels, Counter>,
    pub audit_write_errors: Counter,
    /// Requests refused because the audit writer could not take their record.
    pub audit_shed: Family<RefusalLabels, Counter>,
    /// Attempts at writing an audit anchor: `written`, or the error's reason.
    pub audit_anchor_writes: Family<ResultLabels, Counter>,
    /// Periodic checkpoints a newer one replaced before they were anchored.
    pub audit_anchor_coalesced: Counter,
    /// Connections and requests turned away by a transport limit.
    pub transport_refusals: Family<RefusalLabels, Counter>,
    pub open_connections: Gauge,
    pub pending_handshakes: Gauge,
    /// Admission in front of signing: sheds by reason, slots in use,
    /// waiters, and the sizing of the queue and of each connection's share.
    pub admission: Arc<crate::admission::metrics::AdmissionMetrics>,
    /// Denylist and revocation: the kill switch.
    pub kill_switch: KillSwitchMetrics,
    /// Token verification by path (local or TokenReview) and the issuer keys.
    pub token_paths: TokenPathMetrics,
    /// Requests by cluster and the remote cluster registry.
    pub clusters: ClusterMetrics,
    /// Phased CA rotation.
    pub rotation: crate::rotation::metrics::RotationMetrics,
    /// The PodCertificateRequest signer's decisions and status writes.
    pub pod_certificates: crate::podcert::metrics::PodCertMetrics,
    /// Security refusals of callers on a known node, by node.
    pub node_refusals: NodeRefusalMetrics,
    /// Rejected TLS handshakes by reason, and those the audit table could
    /// only count under `overflow`.
    pub handshake_rejects: Family<RefusalLabels, Counter>,
    pub handshake_rejects_overflow: Counter,
    /// Checkpoints anchored in Kubernetes (rendered only when anchoring is on).
    pub anchor: AnchorStats,
    registry: Registry,
}

impl OutcomeObserver for Metrics {
    fn outcome(
        &self,
        decision: Decision,
        reason: &'static str,
        class: Option<ErrorClass>,
        seconds: f64,
    ) {
        self.record(decision, reason, class, seconds);
    }

    fn audit_write_error(&self) {
        self.audit_write_errors.inc();
    }

    fn audit_shed(&self, reason: &'static str) {
        self.audit_shed
            .get_or_create(&RefusalLabels { reason })
            .inc();
    }

    fn node_refusal(&self, reason: &'static str, node: &str) {
        self.node_refusals.count(reason, node);
    }
}

impl crate::audit::anchor::AnchorMetrics for Metrics {
    fn anchor_written(&self, failed: Option<&'static str>) {
        self.audit_anchor_writes
            .get_or_create(&ResultLabels {
                result: failed.unwrap_or("written").into(),
            })
            .inc();
    }

    fn anchor_coalesced(&self, n: u64) {
        self.audit_anchor_coalesced.inc_by(n);
    }

    fn anchor_pending(&self, since: Option<std::time::SystemTime>) {
        let unix = since.map_or(0, |t| {
            t.duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_secs().max(1))
        });
        self.anchor.uncovered_since.store(unix, Ordering::Relaxed);
    }
}

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
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "meshca_decisions",
            "CreateCertificate decisions by reason",
            decisions.clone(),
        );
        let request_duration = Family::<LatencyLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0001, 2.0, 16))
        });
        registry.register(
            "meshca_request_duration_seconds",
            "CreateCertificate latency",
            request_duration.clone(),
        );
        let tokenreview_duration = Histogram::new(exponential_buckets(0.0005, 2.0, 14));
        registry.register(
            "meshca_tokenreview_duration_seconds",
            "TokenReview round trip to the API server",
            tokenreview_duration.clone(),
        );
        let tokenreview_errors = Counter::default();
        registry.register(
            "meshca_tokenreview_errors",
            "TokenReviews that could not be made (timeout, API error)",
            tokenreview_errors.clone(),
        );
        let tokenreviews = Family::<ResultLabels, Counter>::default();
        registry.register(
            "meshca_tokenreviews",
            "TokenReviews sent to the API server, by result (authenticated, rejected, error)",
            tokenreviews.clone(),
        );
        let tokenreview_coalesced = Counter::default();
        registry.register(
            "meshca_tokenreview_coalesced",
            "Requests that joined a TokenReview already in flight for the same token",
            tokenreview_coalesced.clone(),
        );
        let tokenreview_negative_cache_hits = Counter::default();
        registry.register(
            "meshca_tokenreview_negative_cache_hits",
            "Requests refused from the cache of tokens the API server rejected",
            tokenreview_negative_cache_hits.clone(),
        );
        let tokenreview_precheck_rejected = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "meshca_tokenreview_precheck_rejected",
            "Tokens dropped by the pre-check (not a JWT, expired) before any review",
            tokenreview_precheck_rejected.clone(),
        );
        let tokenreview_refused = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "meshca_tokenreview_refused",
            "Requests refused by the TokenReview budget, by reason",
            tokenreview_refused.clone(),
        );
        for r in [
            crate::authn::metrics::REASON_BUDGET,
            crate::authn::metrics::REASON_INFLIGHT,
        ] {
            let _ = tokenreview_refused.get_or_create(&ReasonLabels { reason: r.into() });
        }
        let tokenreview_inflight = Gauge::default();
        registry.register(
            "meshca_tokenreview_inflight",
            "TokenReviews outstanding at the API server",
            tokenreview_inflight.clone(),
        );
        let ca_reloads = Family::<ResultLabels, Counter>::default();
        registry.register(
            "meshca_ca_reloads",
            "CA material reload attempts that found a change",
            ca_reloads.clone(),
        );
        let audit_write_errors = Counter::default();
        registry.register(
            "meshca_audit_write_errors",
            "Audit records that could not be written",
            audit_write_errors.clone(),
        );
        let audit_shed = Family::<RefusalLabels, Counter>::default();
        registry.register(
            "meshca_audit_shed",
            "Requests refused because the audit writer could not take their record, by reason",
            audit_shed.clone(),
        );
        for r in crate::audit::writer::SHED_REASONS {
            let _ = audit_shed.get_or_create(&RefusalLabels { reason: r });
        }
        let audit_anchor_writes = Family::<ResultLabels, Counter>::default();
        registry.register(
            "meshca_audit_anchor_writes",
            "Attempts at writing an audit checkpoint anchor, by result (written, or the failure's reason)",
            audit_anchor_writes.clone(),
        );
        let audit_anchor_coalesced = Counter::default();
        registry.register(
            "meshca_audit_anchor_coalesced",
            "Periodic audit checkpoints not anchored because a newer one replaced them within the anchor interval",
            audit_anchor_coalesced.clone(),
        );
        let transport_refusals = Family::<RefusalLabels, Counter>::default();
        registry.register(
            "meshca_transport_refusals",
            "Connections and requests refused by a transport limit, by reason",
            transport_refusals.clone(),
        );
        // Every reason is exported from the start, so a rate() sees the first refusal.
        for r in crate::transport::limits::Refusal::ALL {
            let _ = transport_refusals.get_or_create(&RefusalLabels { reason: r.reason() });
        }
        let open_connections = Gauge::default();
        registry.register(
            "meshca_open_connections",
            "Admitted gRPC connections (handshaking or established)",
            open_connections.clone(),
        );
        let pending_handshakes = Gauge::default();
        registry.register(
            "meshca_pending_tls_handshakes",
            "TLS handshakes in progress on the gRPC port",
            pending_handshakes.clone(),
        );
        let admission = Arc::new(crate::admission::metrics::AdmissionMetrics::register(
            &mut registry,
        ));
        let handshake_rejects = Family::<RefusalLabels, Counter>::default();
        registry.register(
            "meshca_tls_handshake_rejects",
            "TLS handshakes on the gRPC port that failed or timed out, by reason (each is in an aggregated audit record)",
            handshake_rejects.clone(),
        );
        for r in crate::transport::rejects::KNOWN_REASONS {
            let _ = handshake_rejects.get_or_create(&RefusalLabels { reason: r });
        }
        let handshake_rejects_overflow = Counter::default();
        registry.register(
            "meshca_tls_handshake_rejects_overflow",
            "Rejected handshakes the audit log could only count under the peer `overflow` (the per-interval source table was full)",
            handshake_rejects_overflow.clone(),
        );
        let node_refusals = NodeRefusalMetrics::register(&mut registry);
        let kill_switch = KillSwitchMetrics::register(&mut registry);
        let token_paths = TokenPathMetrics::register(&mut registry);
        let clusters = ClusterMetrics::register(&mut registry);
        let rotation = crate::rotation::metrics::RotationMetrics::register(&mut registry);
        let pod_certificates = crate::podcert::metrics::PodCertMetrics::register(&mut registry);
        Self {
            clusters,
            rotation,
            pod_certificates,
            node_refusals,
            handshake_rejects,
            handshake_rejects_overflow,
            anchor: AnchorStats::default(),
            admission,
            kill_switch,
            token_paths,
            transport_refusals,
            open_connections,
            pending_handshakes,
            citadel: Citadel::default(),
            decisions,
            request_duration,
            tokenreview_duration,
            tokenreview_errors,
            tokenreviews,
            tokenreview_coalesced,
            tokenreview_negative_cache_hits,
            tokenreview_precheck_rejected,
            tokenreview_refused,
            tokenreview_inflight,
            ca_reloads,
            audit_write_errors,
            audit_shed,
            audit_anchor_writes,
            audit_anchor_coalesced,
            registry,
        }
    }

    /// Counts one denylist reload attempt.
    pub fn denylist_reload(&self, source: &'static str, result: &'static str) {
        self.kill_switch
            .denylist_reloads
            .get_or_create(&SourceResultLabels { source, result })
            .inc();
    }

    /// Counts a connection or request refused by a transport limit.
    pub fn refused(&self, r: crate::transport::limits::Refusal) {
        self.transport_refusals
            .get_or_create(&RefusalLabels { reason: r.reason() })
            .inc();
    }

    /// Records one finished request (called exactly once per request, by the audit guard).
    pub fn record(
        &self,
        decision: Decision,
        reason: &'static str,
        class: Option<ErrorClass>,
        seconds: f64,
    ) {
        let c = &self.citadel;
        c.csr_count.fetch_add(1, Ordering::Relaxed);
        match class {
            None => {}
            Some(ErrorClass::Authentication) => {
                c.authentication_failure_count
                    .fetch_add(1, Ordering::Relaxed);
            }
            Some(ErrorClass::Csr { parsing }) => {
                c.sign_err_csr.fetch_add(1, Ordering::Relaxed);
                if parsing {
                    c.csr_parsing_err_count.fetch_add(1, Ordering::Relaxed);
                }
            }
            Some(ErrorClass::Ttl) => {
                c.sign_err_ttl.fetch_add(1, Ordering::Relaxed);
            }
            Some(ErrorClass::CertGen) => {
                c.sign_err_cert_gen.fetch_add(1, Ordering::Relaxed);
            }
            Some(ErrorClass::CaNotReady) => {
                c.sign_err_ca_not_ready.fetch_add(1, Ordering::Relaxed);
            }
        }
        let label = match decision {
            Decision::Allow => {
                c.success_cert_issuance_count
                    .fetch_add(1, Ordering::Relaxed);
                "allow"
            }
            Decision::Deny => "deny",
        };
        self.decisions
            .get_or_create(&DecisionLabels {
                decision: label,
                reason: reason.to_string(),
            })
            .inc();
        self.request_duration
            .get_or_create(&LatencyLabels { decision: label })
            .observe(seconds);
    }

    /// Renders the Prometheus text exposition.
    pub fn render(&self, snap: &Snapshot, now_unix: i64) -> String {
        let mut out = String::new();
        let c = &self.citadel;
        let counter = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        };
        counter(
            &mut out,
            "citadel_server_csr_count",
            "The number of CSRs received by Citadel server.",
            &c.csr_count,
        );
        counter(
            &mut out,
            "citadel_server_authentication_failure_count",
            "The number of authentication failures.",
            &c.authentication_failure_count,
        );
        let _ = writeln!(out, "# HELP citadel_server_csr_sign_err_count The number of errors occurred when signing the CSR.\n# TYPE citadel_server_csr_sign_err_count counter");
        for (label, v) in [
            ("CA_NOT_READY", &c.sign_err_ca_not_ready),
            ("CSR_ERROR", &c.sign_err_csr),
            ("TTL_ERROR", &c.sign_err_ttl),
            ("CERT_GEN_ERROR", &c.sign_err_cert_gen),
        ] {
            let _ = writeln!(
                out,
                "citadel_server_csr_sign_err_count{{error=\"{label}\"}} {}",
                v.load(Ordering::Relaxed)
            );
        }
        counter(
            &mut out,
            "citadel_server_success_cert_issuance_count",
            "The number of certificates issuances that have succeeded.",
            &c.success_cert_issuance_count,
        );
        counter(
            &mut out,
            "citadel_server_csr_parsing_err_count",
            "The number of errors occurred when parsing the CSR.",
            &c.csr_parsing_err_count,
        );
        counter(
            &mut out,
            "citadel_server_id_extraction_err_count",
            "The number of errors occurred when extracting the ID from CSR.",
            &c.id_extraction_err_count,
        );
        let gauge = |out: &mut String, name: &str, help: &str, v: i64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        if let Some(t) = snap.root_not_after {
            gauge(&mut out, "citadel_server_root_cert_expiry_timestamp", "The unix timestamp, in seconds, when Citadel root cert will expire. A negative time indicates the cert is expired.", t);
            gauge(&mut out, "citadel_server_root_cert_expiry_seconds", "The time remaining, in seconds, before the root cert will expire. A negative value indicates the cert is expired.", t - now_unix);
        }
        if let Some(t) = snap.chain_not_after {
            gauge(&mut out, "citadel_server_cert_chain_expiry_timestamp", "The unix timestamp, in seconds, when Citadel cert chain will expire. A negative time indicates the cert is expired.", t);
            gauge(&mut out, "citadel_server_cert_chain_expiry_seconds", "The time remaining, in seconds, before the cert chain will expire. A negative value indicates the cert is expired.", t - now_unix);
        }
        if let Some(t) = snap.signing_not_after {
            gauge(
                &mut out,
                "meshca_signing_cert_expiry_timestamp_seconds",
                "NotAfter of the intermediate that signs leaves.",
                t,
            );
        }
        if let Some(t) = snap.ca_not_after {
            gauge(
                &mut out,
                "meshca_ca_cert_expiry_timestamp_seconds",
                "NotAfter of the CA certificate from ROOT_CA_DIR whose key is in custody (the one operators rotate; with two-tier issuing it signs the issuing CAs).",
                t,
            );
        }
        if let Some(t) = snap.root_not_after {
            gauge(
                &mut out,
                "meshca_root_cert_expiry_timestamp_seconds",
                "NotAfter of the root meshca's chain ends in.",
                t,
            );
        }
        if let Some((pods, synced, events)) = snap.pod_index {
            gauge(
                &mut out,
                "meshca_pod_index_pods",
                "Pods in the node-authorization index.",
                pods as i64,
            );
            gauge(
                &mut out,
                "meshca_pod_index_synced",
                "1 once the pod index completed its first list.",
                i64::from(synced),
            );
            let _ = writeln!(out, "# HELP meshca_pod_index_events_total Watch events applied to the pod index.\n# TYPE meshca_pod_index_events_total counter\nmeshca_pod_index_events_total {events}");
        }
        if let Some((disconnected, bound)) = snap.pod_index_watch {
            let _ = writeln!(out, "# HELP meshca_pod_index_disconnected_seconds How long the pod watch has been disconnected (0 while connected).\n# TYPE meshca_pod_index_disconnected_seconds gauge\nmeshca_pod_index_disconnected_seconds {disconnected}");
            let _ = writeln!(out, "# HELP meshca_pod_index_max_staleness_seconds Disconnected longer than this, the index is stale and refuses what depends on it (MESHCA_POD_INDEX_MAX_STALENESS).\n# TYPE meshca_pod_index_max_staleness_seconds gauge\nmeshca_pod_index_max_staleness_seconds {bound}");
        }
        if let Some((this_update, next_update)) = snap.crl {
            gauge(
                &mut out,
                "meshca_crl_this_update_timestamp_seconds",
                "thisUpdate of the CRL in force for the current signer (re-signed at half its validity).",
                this_update,
            );
            gauge(
                &mut out,
                "meshca_crl_next_update_timestamp_seconds",
                "nextUpdate of the CRL in force for the current signer: relying parties reject it after this.",
                next_update,
            );
        }
        self.anchor.render(&mut out, now_unix);
        if let Some((hits, misses)) = snap.token_cache {
            let _ = writeln!(out, "# HELP meshca_token_cache_requests_total TokenReview cache lookups.\n# TYPE meshca_token_cache_requests_total counter\nmeshca_token_cache_requests_total{{result=\"hit\"}} {hits}\nmeshca_token_cache_requests_total{{result=\"miss\"}} {misses}");
            let ratio = if hits + misses == 0 {
                0.0
            } else {
                hits as f64 / (hits + misses) as f64
            };
            let _ = writeln!(out, "# HELP meshca_token_cache_hit_ratio Share of token lookups served from the cache.\n# TYPE meshca_token_cache_hit_ratio gauge\nmeshca_token_cache_hit_ratio {ratio}");
        }
        let mut registry_text = String::new();
        if prometheus_client::encoding::text::encode(&mut registry_text, &self.registry).is_ok() {
            // OpenMetrics' terminator is not part of the 0.0.4 text format.
            out.push_str(
                registry_text
                    .trim_end()
                    .trim_end_matches("# EOF")
                    .trim_end(),
            );
            out.push('\n');
        }
        out
    }
}

/// A shared handle.
pub type SharedMetrics = Arc<Metrics>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn citadel_names_have_no_total_suffix_and_count() {
        let m = Metrics::new();
        m.record(Decision::Allow, "issued", None, 0.001);
        m.record(
            Decision::Deny,
            "authn_no_credentials",
            Some(ErrorClass::Authentication),
            0.001,
        );
        m.record(
            Decision::Deny,
            "csr_malformed",
            Some(ErrorClass::Csr { parsing: true }),
            0.001,
        );
        m.record(Decision::Deny, "ttl_too_long", Some(ErrorClass::Ttl), 0.001);
        let text = m.render(
            &Snapshot {
                root_not_after: Some(2000),
                ..Default::default()
            },
            1000,
        );
        for line in [
            "citadel_server_csr_count 4",
            "citadel_server_authentication_failure_count 1",
            "citadel_server_csr_sign_err_count{error=\"CSR_ERROR\"} 1",
            "citadel_server_csr_sign_err_count{error=\"TTL_ERROR\"} 1",
            "citadel_server_success_cert_issuance_count 1",
            "citadel_server_csr_parsing_err_count 1",
            "citadel_server_root_cert_expiry_timestamp 2000",
            "citadel_server_root_cert_expiry_seconds 1000",
            "meshca_decisions_total{decision=\"deny\",reason=\"ttl_too_long\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(!text.contains("citadel_server_csr_count_total"));
        assert!(!text.contains("# EOF"));
    }
}

#[cfg(test)]
mod cluster_tests {
    use super::*;

    #[test]
    fn cluster_label_is_bounded_by_the_registry() {
        let m = Metrics::new();
        m.clusters
            .set_clusters("primary", &["primary".into(), "east".into()]);
        m.clusters.count(Some("east"), Decision::Allow);
        m.clusters.count(Some("attacker-chosen-1"), Decision::Deny);
        m.clusters.count(Some("attacker-chosen-2"), Decision::Deny);
        m.clusters.set_clusters("primary", &["primary".into()]);
        let text = m.render(&Snapshot::default(), 0);
        for line in [
            "meshca_cluster_requests_total{cluster=\"east\",decision=\"allow\"} 1",
            "meshca_cluster_requests_total{cluster=\"unknown\",decision=\"deny\"} 2",
            "meshca_clusters{cluster=\"primary\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(!text.contains("attacker-chosen"));
        assert!(
            !text.contains("meshca_clusters{cluster=\"east\"}"),
            "removed cluster still exported"
        );
    }
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
    fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "meshca_node_refusals",
            "Security refusals (impersonation, denylist, revoked certificate, identity cap, CSR for another identity) of callers whose node is known, by node and reason",
            m.refusals.clone(),
        );
        m
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

/// The anchor writer's state, exported at scrape time once anchoring is on
/// ([`Metrics::enable_anchor`]). Its write and coalesce counters are
/// registry families beside the other audit metrics.
#[derive(Debug, Default)]
pub struct AnchorStats {
    /// `--audit-anchor-interval` in milliseconds (0: anchoring is off).
    interval_ms: AtomicU64,
    /// Unix seconds when the oldest checkpoint that no written anchor
    /// covers was handed to the anchor writer (0: every one is covered).
    uncovered_since: AtomicU64,
}

impl AnchorStats {
    fn render(&self, out: &mut String, now_unix: i64) {
        let interval_ms = self.interval_ms.load(Ordering::Relaxed);
        if interval_ms == 0 {
            return;
        }
        let interval = interval_ms as f64 / 1000.0;
        let _ = writeln!(out, "# HELP meshca_audit_anchor_interval_seconds At most one periodic checkpoint is anchored this often (MESHCA_AUDIT_ANCHOR_INTERVAL): a checkpoint may wait this long to be anchored.\n# TYPE meshca_audit_anchor_interval_seconds gauge\nmeshca_audit_anchor_interval_seconds {interval}");
        let since = self.uncovered_since.load(Ordering::Relaxed);
        let pending = if since == 0 {
            0
        } else {
            (now_unix - i64::try_from(since).unwrap_or(now_unix)).max(0)
        };
        let _ = writeln!(out, "# HELP meshca_audit_anchor_pending_seconds How long the oldest audit checkpoint that no written anchor covers has waited (0: all are anchored); up to meshca_audit_anchor_interval_seconds is normal.\n# TYPE meshca_audit_anchor_pending_seconds gauge\nmeshca_audit_anchor_pending_seconds {pending}");
    }
}

impl Metrics {
    /// Anchoring is on: export its gauges, and every write result from zero
    /// so that a rate sees the first failure.
    pub fn enable_anchor(&self, interval: Duration) {
        for result in crate::audit::anchor::WRITE_RESULTS {
            let _ = self.audit_anchor_writes.get_or_create(&ResultLabels {
                result: result.into(),
            });
        }
        let ms = u64::try_from(interval.as_millis()).unwrap_or(u64::MAX);
        self.anchor.interval_ms.store(ms.max(1), Ordering::Relaxed);
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

    #[test]
    fn node_label_is_bounded() {
        let m = Metrics::new();
        for i in 0..MAX_NODE_LABELS + 3 {
            m.node_refusals
                .count("impersonation_no_pod_on_node", &format!("node-{i}"));
        }
        m.node_refusals
            .count("impersonation_no_pod_on_node", "node-0");
        m.node_refusals.count("admission_queue_full", "node-0");
        let text = m.render(&Snapshot::default(), 0);
        let line = |node: &str| {
            format!("meshca_node_refusals_total{{node=\"{node}\",reason=\"impersonation_no_pod_on_node\"}} ")
        };
        assert!(
            text.contains(&format!("{}2", line("node-0"))),
            "{text:.2000}"
        );
        assert!(text.contains(&format!("{}3", line(OVERFLOW_NODE))));
        assert!(!text.contains(&format!("node=\"node-{MAX_NODE_LABELS}\"")));
        assert!(!text.contains("admission_queue_full\"}} 1\nmeshca_node"));
    }

    #[test]
    fn anchor_metrics_appear_with_anchoring_and_pending_counts_from_the_oldest_uncovered() {
        use crate::audit::anchor::AnchorMetrics;
        let at = |secs| Some(std::time::UNIX_EPOCH + Duration::from_secs(secs));
        let m = Metrics::new();
        let off = m.render(&Snapshot::default(), 100);
        assert!(!off.contains("meshca_audit_anchor_pending_seconds"));
        assert!(!off.contains("meshca_audit_anchor_writes_total{"));
        m.enable_anchor(Duration::from_secs(60));
        m.anchor_pending(at(100));
        m.anchor_written(Some("audit_anchor_write_failed"));
        let text = m.render(&Snapshot::default(), 400);
        for line in [
            "meshca_audit_anchor_interval_seconds 60",
            "meshca_audit_anchor_pending_seconds 300",
            "meshca_audit_anchor_writes_total{result=\"written\"} 0",
            "meshca_audit_anchor_writes_total{result=\"audit_anchor_write_failed\"} 1",
            "meshca_audit_anchor_writes_total{result=\"audit_anchor_conflict\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        m.anchor_written(None);
        m.anchor_pending(None);
        m.anchor_coalesced(3);
        let text = m.render(&Snapshot::default(), 500);
        for line in [
            "meshca_audit_anchor_pending_seconds 0",
            "meshca_audit_anchor_writes_total{result=\"written\"} 1",
            "meshca_audit_anchor_coalesced_total 3",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }
}
