//! Metric families of CA rotation.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::labels::ReasonLabels;
use crate::metrics::Register;

/// Rotation metrics (registered with the server's registry).
#[derive(Debug, Clone, Default)]
pub struct RotationMetrics {
    pub phase: Gauge,
    pub gate_remaining_seconds: Gauge,
    pub trusted_roots: Gauge,
    pub issued_max_not_after: Gauge,
    pub transitions: Family<TransitionLabels, Counter>,
    pub blocked: Family<ReasonLabels, Counter>,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabels {
    pub to: &'static str,
    pub forced: &'static str,
}

impl RotationMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        Self {
            phase: registry.metric(
                "meshca_rotation_phase",
                "CA rotation phase: 0 idle, 1 trust, 2 switched, 3 retired",
            ),
            gate_remaining_seconds: registry.metric(
                "meshca_rotation_gate_remaining_seconds",
                "Seconds until the current phase's gate opens (-1: not a matter of time)",
            ),
            trusted_roots: registry.metric(
                "meshca_rotation_trusted_roots",
                "Roots in the published trust bundle",
            ),
            issued_max_not_after: registry.metric(
                "meshca_rotation_issued_max_not_after_seconds",
                "Durable upper bound of every issued leaf's not_after (unix seconds)",
            ),
            transitions: registry.metric(
                "meshca_rotation_transitions",
                "CA rotation phase changes, by target phase and whether forced",
            ),
            blocked: registry.reasons(
                "meshca_rotation_blocked",
                "Rotation evaluations that could not proceed, by reason",
                super::phase::BLOCKED_REASONS,
            ),
        }
    }
}
