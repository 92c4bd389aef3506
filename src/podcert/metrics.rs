//! Metric families of the PodCertificateRequest signer.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::metrics::Register;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConditionLabels {
    /// `Issued`, `Denied` or `Failed`.
    pub condition: &'static str,
    /// The reason code (`issued` for Issued).
    pub reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WriteLabels {
    /// `ok`, `conflict_decided` (another writer decided first),
    /// `claim_lost` (another replica took a lapsed claim), `gone`,
    /// `forbidden`, `error`.
    pub result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClaimLabels {
    /// `ours`, `held_elsewhere` (another replica decides), `decided`,
    /// `gone`, `forbidden`, `error`.
    pub result: &'static str,
}

/// The signer's metric families.
#[derive(Debug)]
pub struct PodCertMetrics {
    pub decisions: Family<ConditionLabels, Counter>,
    pub status_writes: Family<WriteLabels, Counter>,
    pub claims: Family<ClaimLabels, Counter>,
    /// From first sight of a request to its status written.
    pub decision_seconds: Histogram,
}

impl PodCertMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        Self {
            decisions: registry.metric(
                "meshca_pod_certificate_decisions",
                "PodCertificateRequest decisions by condition (Issued, Denied, Failed) and reason",
            ),
            status_writes: registry.metric(
                "meshca_pod_certificate_status_writes",
                "PodCertificateRequest status writes by result",
            ),
            claims: registry.metric(
                "meshca_pod_certificate_claims",
                "Attempts to become the one replica that decides a PodCertificateRequest, by result",
            ),
            decision_seconds: registry.metric_with(
                "meshca_pod_certificate_decision_seconds",
                "Time from first seeing a PodCertificateRequest to its status written",
                Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            ),
        }
    }
}
