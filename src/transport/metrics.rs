//! Metric families of the transport: connection and request limits, and
//! rejected TLS handshakes.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::limits::Refusal;
use crate::metrics::labels::RefusalLabels;
use crate::metrics::Register;

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

impl TransportMetrics {
    /// Registers the limit families (every refusal reason from zero, so a
    /// rate() sees the first refusal), then what `between` registers, then
    /// the rejected-handshake families. The wiring passes admission's
    /// `register` as `between`: its families sit there in the exposition, as
    /// they always have.
    pub fn register<T>(
        registry: &mut Registry,
        between: impl FnOnce(&mut Registry) -> T,
    ) -> (Self, T) {
        let transport_refusals = registry.reasons(
            "meshca_transport_refusals",
            "Connections and requests refused by a transport limit, by reason",
            Refusal::ALL.iter().map(Refusal::reason),
        );
        let open_connections = registry.metric(
            "meshca_open_connections",
            "Admitted gRPC connections (handshaking or established)",
        );
        let pending_handshakes = registry.metric(
            "meshca_pending_tls_handshakes",
            "TLS handshakes in progress on the gRPC port",
        );
        let between = between(registry);
        let m = Self {
            transport_refusals,
            open_connections,
            pending_handshakes,
            handshake_rejects: registry.reasons(
                "meshca_tls_handshake_rejects",
                "TLS handshakes on the gRPC port that failed or timed out, by reason (each is in an aggregated audit record)",
                super::rejects::KNOWN_REASONS,
            ),
            handshake_rejects_overflow: registry.metric(
                "meshca_tls_handshake_rejects_overflow",
                "Rejected handshakes the audit log could only count under the peer `overflow` (the per-interval source table was full)",
            ),
        };
        (m, between)
    }

    /// Counts a connection or request refused by a transport limit.
    pub fn refused(&self, r: Refusal) {
        self.transport_refusals
            .get_or_create(&RefusalLabels { reason: r.reason() })
            .inc();
    }
}
