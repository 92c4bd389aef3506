//! The wiring's aggregate of every metric family: one registry, istiod's
//! `citadel_server_*` counters, and each domain's own metrics value,
//! registered by the domain's `register` in the order the exposition has
//! always had. Domains take only their own value; the audit writer and the
//! use case report request outcomes through `outcome::OutcomeObserver`,
//! which this aggregate implements. istiod's exporter drops the `_total`
//! suffix from counters; prometheus-client always appends it
//! (OpenMetrics), so the citadel block is written by hand in the Prometheus
//! text format and meshca's own families come from the prometheus-client
//! registry.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::admission::metrics::AdmissionMetrics;
use crate::audit::metrics::AuditMetrics;
use crate::authn::metrics::{TokenPathMetrics, TokenReviewMetrics};
use crate::ca::metrics::CaMetrics;
use crate::cluster::metrics::ClusterMetrics;
pub use crate::metrics::Snapshot;
use crate::metrics::{
    Citadel, Decision, DecisionLabels, ErrorClass, LatencyLabels, NodeRefusalMetrics, Register,
};
use crate::outcome::{Outcome, OutcomeObserver};
use crate::podcert::metrics::PodCertMetrics;
use crate::revocation::metrics::KillSwitchMetrics;
use crate::rotation::metrics::RotationMetrics;
use crate::transport::metrics::TransportMetrics;

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
    /// TokenReview round trips, budget and caches.
    pub token_reviews: Arc<TokenReviewMetrics>,
    /// CA material reloads.
    pub ca: Arc<CaMetrics>,
    /// The audit writer's failures and sheds, and the anchor writer.
    pub audit: Arc<AuditMetrics>,
    /// Transport limits and rejected handshakes.
    pub transport: Arc<TransportMetrics>,
    /// Admission in front of signing: sheds by reason, slots in use,
    /// waiters, and the sizing of the queue and of each connection's share.
    pub admission: Arc<AdmissionMetrics>,
    /// Denylist and revocation: the kill switch.
    pub kill_switch: Arc<KillSwitchMetrics>,
    /// Token verification by path (local or TokenReview) and the issuer keys.
    pub token_paths: Arc<TokenPathMetrics>,
    /// Requests by cluster and the remote cluster registry.
    pub clusters: Arc<ClusterMetrics>,
    /// Phased CA rotation.
    pub rotation: Arc<RotationMetrics>,
    /// The PodCertificateRequest signer's decisions and status writes.
    pub pod_certificates: Arc<PodCertMetrics>,
    /// Security refusals of callers on a known node, by node.
    pub node_refusals: NodeRefusalMetrics,
    registry: Registry,
}

impl OutcomeObserver for Metrics {
    fn outcome(&self, o: Outcome) {
        self.record(o.decision, o.reason, o.class, o.seconds);
    }

    fn audit_write_error(&self) {
        self.audit.audit_write_errors.inc();
    }

    fn audit_shed(&self, reason: &'static str) {
        self.audit.shed(reason);
    }

    fn node_refusal(&self, reason: &'static str, node: &str) {
        self.node_refusals.count(reason, node);
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let decisions =
            registry.metric("meshca_decisions", "CreateCertificate decisions by reason");
        let request_duration: Family<LatencyLabels, Histogram> = registry.metric_with(
            "meshca_request_duration_seconds",
            "CreateCertificate latency",
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.0001, 2.0, 16))),
        );
        let token_reviews = Arc::new(TokenReviewMetrics::register(&mut registry));
        let ca = Arc::new(CaMetrics::register(&mut registry));
        let audit = Arc::new(AuditMetrics::register(&mut registry));
        let (transport, admission) =
            TransportMetrics::register(&mut registry, AdmissionMetrics::register);
        let (transport, admission) = (Arc::new(transport), Arc::new(admission));
        let node_refusals = NodeRefusalMetrics::register(&mut registry);
        let kill_switch = Arc::new(KillSwitchMetrics::register(&mut registry));
        let token_paths = Arc::new(TokenPathMetrics::register(&mut registry));
        let clusters = Arc::new(ClusterMetrics::register(&mut registry));
        let rotation = Arc::new(RotationMetrics::register(&mut registry));
        let pod_certificates = Arc::new(PodCertMetrics::register(&mut registry));
        Self {
            clusters,
            rotation,
            pod_certificates,
            node_refusals,
            admission,
            kill_switch,
            token_paths,
            transport,
            citadel: Citadel::default(),
            decisions,
            request_duration,
            token_reviews,
            ca,
            audit,
            registry,
        }
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
        // istiod's counters, then its sign-error family (one label per class).
        for (name, help, v) in [
            (
                "citadel_server_csr_count",
                "The number of CSRs received by Citadel server.",
                &c.csr_count,
            ),
            (
                "citadel_server_authentication_failure_count",
                "The number of authentication failures.",
                &c.authentication_failure_count,
            ),
            (
                "citadel_server_success_cert_issuance_count",
                "The number of certificates issuances that have succeeded.",
                &c.success_cert_issuance_count,
            ),
            (
                "citadel_server_csr_parsing_err_count",
                "The number of errors occurred when parsing the CSR.",
                &c.csr_parsing_err_count,
            ),
            (
                "citadel_server_id_extraction_err_count",
                "The number of errors occurred when extracting the ID from CSR.",
                &c.id_extraction_err_count,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
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
            let _ = writeln!(out, "# HELP meshca_pod_index_disconnected_seconds How long the pod index has gone without evidence that its watch is current, once the watch failed or fell silent (0 while it follows the API server).\n# TYPE meshca_pod_index_disconnected_seconds gauge\nmeshca_pod_index_disconnected_seconds {disconnected}");
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
        self.audit.render_anchor(&mut out, now_unix);
        if let Some(ready) = snap.ready {
            gauge(
                &mut out,
                "meshca_ready",
                "1 while /readyz answers ready (CA loaded and unexpired, revocations loaded, indexes synced), else 0.",
                i64::from(ready),
            );
        }
        if let Some((hits, misses)) = snap.token_cache {
            let _ = writeln!(out, "# HELP meshca_token_cache_requests_total TokenReview cache lookups.\n# TYPE meshca_token_cache_requests_total counter\nmeshca_token_cache_requests_total{{result=\"hit\"}} {hits}\nmeshca_token_cache_requests_total{{result=\"miss\"}} {misses}");
            let ratio = if hits + misses == 0 {
                0.0
            } else {
                hits as f64 / (hits + misses) as f64
            };
            let _ = writeln!(out, "# HELP meshca_token_cache_hit_ratio Share of token lookups served from the cache.\n# TYPE meshca_token_cache_hit_ratio gauge\nmeshca_token_cache_hit_ratio {ratio}");
        }
        crate::metrics::process::render(
            &mut out,
            snap.process.as_ref(),
            env!("CARGO_PKG_VERSION"),
            env!("MESHCA_BUILD_COMMIT"),
        );
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

impl crate::http::Exposition for Metrics {
    fn render(&self, snap: &Snapshot, now_unix: i64) -> String {
        Metrics::render(self, snap, now_unix)
    }
}

impl Metrics {
    /// The values the use case reports to.
    pub fn issue_metrics(self: &Arc<Self>) -> crate::issue::IssueMetrics {
        crate::issue::IssueMetrics {
            outcomes: self.clone(),
            clusters: self.clusters.clone(),
            kill_switch: self.kill_switch.clone(),
        }
    }
}

/// A shared handle.
pub type SharedMetrics = Arc<Metrics>;

/// Asserts that each of `lines` is a whole line of the exposition `text`.
#[cfg(test)]
fn assert_lines(text: &str, lines: &[&str]) {
    for line in lines {
        assert!(
            text.lines().any(|l| l == *line),
            "missing {line:?} in\n{text}"
        );
    }
}

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
        assert_lines(
            &text,
            &[
                "citadel_server_csr_count 4",
                "citadel_server_authentication_failure_count 1",
                "citadel_server_csr_sign_err_count{error=\"CSR_ERROR\"} 1",
                "citadel_server_csr_sign_err_count{error=\"TTL_ERROR\"} 1",
                "citadel_server_success_cert_issuance_count 1",
                "citadel_server_csr_parsing_err_count 1",
                "citadel_server_root_cert_expiry_timestamp 2000",
                "citadel_server_root_cert_expiry_seconds 1000",
                "meshca_decisions_total{decision=\"deny\",reason=\"ttl_too_long\"} 1",
            ],
        );
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
        assert_lines(
            &text,
            &[
                "meshca_cluster_requests_total{cluster=\"east\",decision=\"allow\"} 1",
                "meshca_cluster_requests_total{cluster=\"unknown\",decision=\"deny\"} 2",
                "meshca_clusters{cluster=\"primary\"} 1",
            ],
        );
        assert!(!text.contains("attacker-chosen"));
        assert!(
            !text.contains("meshca_clusters{cluster=\"east\"}"),
            "removed cluster still exported"
        );
    }
}

#[cfg(test)]
mod ops_tests {
    use super::*;
    use crate::metrics::{MAX_NODE_LABELS, OVERFLOW_NODE};
    use std::time::Duration;

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
        m.audit.enable_anchor(Duration::from_secs(60));
        m.audit.anchor_pending(at(100));
        m.audit.anchor_written(Some("audit_anchor_write_failed"));
        let text = m.render(&Snapshot::default(), 400);
        assert_lines(
            &text,
            &[
                "meshca_audit_anchor_interval_seconds 60",
                "meshca_audit_anchor_pending_seconds 300",
                "meshca_audit_anchor_writes_total{result=\"written\"} 0",
                "meshca_audit_anchor_writes_total{result=\"audit_anchor_write_failed\"} 1",
                "meshca_audit_anchor_writes_total{result=\"audit_anchor_conflict\"} 0",
            ],
        );
        m.audit.anchor_written(None);
        m.audit.anchor_pending(None);
        m.audit.anchor_coalesced(3);
        let text = m.render(&Snapshot::default(), 500);
        assert_lines(
            &text,
            &[
                "meshca_audit_anchor_pending_seconds 0",
                "meshca_audit_anchor_writes_total{result=\"written\"} 1",
                "meshca_audit_anchor_coalesced_total 3",
            ],
        );
    }
}
