//! Metric families of CA rotation.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::labels::ReasonLabels;
use crate::metrics::register_reasons;

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
        let m = Self::default();
        registry.register(
            "meshca_rotation_phase",
            "CA rotation phase: 0 idle, 1 trust, 2 switched, 3 retired",
            m.phase.clone(),
        );
        registry.register(
            "meshca_rotation_gate_remaining_seconds",
            "Seconds until the current phase's gate opens (-1: not a matter of time)",
            m.gate_remaining_seconds.clone(),
        );
        registry.register(
            "meshca_rotation_trusted_roots",
            "Roots in the published trust bundle",
            m.trusted_roots.clone(),
        );
        registry.register(
            "meshca_rotation_issued_max_not_after_seconds",
            "Durable upper bound of every issued leaf's not_after (unix seconds)",
            m.issued_max_not_after.clone(),
        );
        registry.register(
            "meshca_rotation_transitions",
            "CA rotation phase changes, by target phase and whether forced",
            m.transitions.clone(),
        );
        register_reasons(
            registry,
            "meshca_rotation_blocked",
            "Rotation evaluations that could not proceed, by reason",
            &m.blocked,
            super::phase::BLOCKED_REASONS,
        );
        m
    }
}
