//! Metric families of the CA material: reloads of the custody directory,
//! issuing CA roll-overs and rotation's adoptions.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::metrics::labels::ResultLabels;
use crate::metrics::Register;

#[derive(Debug, Default)]
pub struct CaMetrics {
    pub ca_reloads: Family<ResultLabels, Counter>,
}

impl CaMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        Self {
            ca_reloads: registry.metric(
                "meshca_ca_reloads",
                "CA material reload attempts that found a change",
            ),
        }
    }
}
