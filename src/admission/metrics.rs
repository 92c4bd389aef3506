//! Metric families of admission: sheds by reason, slots in use, waiters,
//! and the sizing of the queue and of each connection's share.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{AdmissionObserver, ShedReason};
use crate::metrics::labels::RefusalLabels;
use crate::metrics::Register;

#[derive(Debug, Default)]
pub struct AdmissionMetrics {
    pub shed: Family<RefusalLabels, Counter>,
    pub running: Gauge,
    pub queued: Gauge,
    /// The sized bound of the queue (`decide::size`).
    pub sized_queue: Gauge,
    /// The sized share of streams in progress per connection.
    pub streams_per_connection: Gauge,
    /// Mean wall time of one signing job (CSR verify + sign).
    pub service_seconds: Gauge<f64, AtomicU64>,
    /// Signing jobs run to their end.
    pub jobs: Counter,
    /// Of those, the ones run on the caller's own worker.
    pub inline_jobs: Counter,
}

impl AdmissionMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        Self {
            shed: registry.reasons(
                "meshca_admission_shed",
                "Requests shed by admission before any signing work, by reason",
                ShedReason::ALL.iter().map(ShedReason::reason),
            ),
            running: registry.metric(
                "meshca_admission_running",
                "CSR verifications and signatures running",
            ),
            queued: registry.metric(
                "meshca_admission_queued",
                "Requests waiting for a signing slot",
            ),
            sized_queue: registry.metric(
                "meshca_admission_sized_queue",
                "Requests the admission queue holds at most now: what the signing threads can answer within the callers' typical deadline",
            ),
            streams_per_connection: registry.metric(
                "meshca_admission_streams_per_connection",
                "Streams in progress one connection may have now (its share of the sized queue); more are refused before their message is read",
            ),
            service_seconds: registry.metric(
                "meshca_admission_service_seconds",
                "Mean wall time of one signing job (CSR verify and sign) on a signing thread",
            ),
            jobs: registry.metric(
                "meshca_admission_jobs",
                "Signing jobs (CSR verify and sign) run to their end, whether or not their caller still waited",
            ),
            inline_jobs: registry.metric(
                "meshca_admission_inline_jobs",
                "Signing jobs run on the request's own worker, not handed to a signing thread (--admission-sign-inline, below overload)",
            ),
        }
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

    fn job_done(&self, inline: bool) {
        self.jobs.inc();
        if inline {
            self.inline_jobs.inc();
        }
    }

    fn sizing(&self, queued: usize, per_connection: usize, service: Option<Duration>) {
        self.sized_queue.set(queued as i64);
        self.streams_per_connection.set(per_connection as i64);
        if let Some(t) = service {
            self.service_seconds.set(t.as_secs_f64());
        }
    }
}
