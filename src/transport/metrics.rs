//! Metric families of the transport: connection and request limits, and
//! rejected TLS handshakes.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::limits::Refusal;
use crate::metrics::labels::RefusalLabels;
use crate::metrics::register_reasons;

#[derive(Debug, Default)]
pub struct TransportMetrics {
    /// Connections and requests turned away by a transport limit.
    pub transport_refusals: Family<RefusalLabels, Counter>,
    pub open_connections: Gauge,
    pub pending_handshakes: Gauge,
    /// Rejected TLS handshakes by reason, and those the audit table could
    /// only count under `overflow`.
    pub handshake_rejects: Family<RefusalLabels, Counter>,
    pub handshake_rejects_overflow: Counter,
}

/// Registered in two groups ([`Self::register_limits`],
/// [`Self::register_rejects`]): the wiring puts admission's families between
/// them, where the exposition has always had them.
impl TransportMetrics {
    /// The limit families, every refusal reason exported from the start
    /// so a rate() sees the first refusal.
    pub fn register_limits(&self, registry: &mut Registry) {
        register_reasons(
            registry,
            "meshca_transport_refusals",
            "Connections and requests refused by a transport limit, by reason",
            &self.transport_refusals,
            Refusal::ALL.iter().map(Refusal::reason),
        );
        registry.register(
            "meshca_open_connections",
            "Admitted gRPC connections (handshaking or established)",
            self.open_connections.clone(),
        );
        registry.register(
            "meshca_pending_tls_handshakes",
            "TLS handshakes in progress on the gRPC port",
            self.pending_handshakes.clone(),
        );
    }

    /// The rejected-handshake families.
    pub fn register_rejects(&self, registry: &mut Registry) {
        register_reasons(
            registry,
            "meshca_tls_handshake_rejects",
            "TLS handshakes on the gRPC port that failed or timed out, by reason (each is in an aggregated audit record)",
            &self.handshake_rejects,
            super::rejects::KNOWN_REASONS,
        );
        registry.register(
            "meshca_tls_handshake_rejects_overflow",
            "Rejected handshakes the audit log could only count under the peer `overflow` (the per-interval source table was full)",
            self.handshake_rejects_overflow.clone(),
        );
    }

    /// Counts a connection or request refused by a transport limit.
    pub fn refused(&self, r: Refusal) {
        self.transport_refusals
            .get_or_create(&RefusalLabels { reason: r.reason() })
            .inc();
    }
}
