//! Metric families of admission: sheds by reason, slots in use, waiters.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{AdmissionObserver, ShedReason};
use crate::metrics::labels::RefusalLabels;
use crate::metrics::register_reasons;

#[derive(Debug, Default)]
pub struct AdmissionMetrics {
    pub shed: Family<RefusalLabels, Counter>,
    pub running: Gauge,
    pub queued: Gauge,
}

impl AdmissionMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        register_reasons(
            registry,
            "meshca_admission_shed",
            "Requests shed by admission before any signing work, by reason",
            &m.shed,
            ShedReason::ALL.iter().map(ShedReason::reason),
        );
        registry.register(
            "meshca_admission_running",
            "CSR verifications and signatures running",
            m.running.clone(),
        );
        registry.register(
            "meshca_admission_queued",
            "Requests waiting for a signing slot",
            m.queued.clone(),
        );
        m
    }
}

impl AdmissionObserver for AdmissionMetrics {
    fn shed(&self, reason: ShedReason) {
        self.shed
            .get_or_create(&RefusalLabels {
                reason: reason.reason(),
            })
            .inc();
    }

    fn occupancy(&self, running: usize, queued: usize) {
        self.running.set(running as i64);
        self.queued.set(queued as i64);
    }
}
