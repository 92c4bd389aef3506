//! Metric families of the kill switch: the denylist and revocation.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::labels::{ReasonLabels, ResultLabels, SourceResultLabels};
use crate::metrics::Register;

/// The kill switch's own families: denylist hits by reason, denylist
/// reloads by source and result, and CRLs signed.
#[derive(Debug, Default)]
pub struct KillSwitchMetrics {
    pub denylist_hits: Family<ReasonLabels, Counter>,
    pub denylist_reloads: Family<SourceResultLabels, Counter>,
    pub crl_signed: Family<ResultLabels, Counter>,
    pub revoked_serials: Gauge,
    /// Revocation decisions by reason: revocations and un-revocations
    /// applied, and changes of the store that were refused (removals,
    /// missing or unreadable sources).
    pub revocation_events: Family<ReasonLabels, Counter>,
}

impl KillSwitchMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        Self {
            denylist_hits: registry.reasons(
                "meshca_denylist_hits",
                "Requests refused by the denylist, by reason",
                [
                    "denylist_identity",
                    "denylist_node",
                    "denylist_pod",
                    "denylist_service_account",
                    "denylist_token_key",
                    "denylist_token_key_unknown_signer",
                    "denylist_origin_node",
                ],
            ),
            denylist_reloads: registry.metric(
                "meshca_denylist_reloads",
                "Denylist reload attempts, by source (file, configmap) and result",
            ),
            crl_signed: registry.metric("meshca_crl_signed", "CRLs signed, by result"),
            revoked_serials: registry
                .metric("meshca_revoked_serials", "Serials in the CRL in force"),
            revocation_events: registry.metric(
                "meshca_revocation_events",
                "Revocation store changes applied or refused, by reason",
            ),
        }
    }
}
