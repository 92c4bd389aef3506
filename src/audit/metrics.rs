//! Metric families of the audit log: records that could not be written,
//! requests shed because the writer could not take their record, and the
//! anchor writer's state. The writer and the anchor report through
//! `outcome::OutcomeObserver` and [`AnchorMetrics`]; this value counts.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::anchor::{AnchorMetrics, WRITE_RESULTS};
use super::writer::SHED_REASONS;
use crate::metrics::labels::{RefusalLabels, ResultLabels};
use crate::metrics::Register;

#[derive(Debug, Default)]
pub struct AuditMetrics {
    pub audit_write_errors: Counter,
    /// Requests refused because the audit writer could not take their record.
    pub audit_shed: Family<RefusalLabels, Counter>,
    /// Attempts at writing an audit anchor: `written`, or the error's reason.
    pub audit_anchor_writes: Family<ResultLabels, Counter>,
    /// Periodic checkpoints a newer one replaced before they were anchored.
    pub audit_anchor_coalesced: Counter,
    /// Refusals of unauthenticated callers folded into aggregate records
    /// past `--audit-unauthenticated-rate`.
    pub audit_unauthenticated_folded: Counter,
    /// Audit files kept past `--audit-max-files` for their issuance records.
    pub audit_files_retained: Gauge,
    /// Objects labelled as this replica's anchors not taken as its head
    /// (unsigned, signed by another key, or not at their own name).
    pub audit_anchor_heads_rejected: Counter,
    /// Checkpoints anchored in Kubernetes (rendered only when anchoring is on).
    anchor: AnchorStats,
}

impl AuditMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        Self {
            audit_write_errors: registry.metric(
                "meshca_audit_write_errors",
                "Audit records that could not be written",
            ),
            audit_shed: registry.reasons(
                "meshca_audit_shed",
                "Requests refused because the audit writer could not take their record, by reason",
                SHED_REASONS,
            ),
            audit_anchor_writes: registry.metric(
                "meshca_audit_anchor_writes",
                "Attempts at writing an audit checkpoint anchor, by result (written, or the failure's reason)",
            ),
            audit_anchor_coalesced: registry.metric(
                "meshca_audit_anchor_coalesced",
                "Periodic audit checkpoints not anchored because a newer one replaced them within the anchor interval",
            ),
            audit_unauthenticated_folded: registry.metric(
                "meshca_audit_unauthenticated_folded",
                "Refusals of callers without an identity folded into aggregate audit records past MESHCA_AUDIT_UNAUTHENTICATED_RATE (each still counted in an aggregate's count)",
            ),
            audit_files_retained: registry.metric(
                "meshca_audit_files_retained",
                "Audit files kept past MESHCA_AUDIT_MAX_FILES because they hold issuance records younger than MESHCA_AUDIT_RETAIN_ISSUED (the volume must hold them)",
            ),
            audit_anchor_heads_rejected: registry.metric(
                "meshca_audit_anchor_heads_rejected",
                "Objects labelled as this replica's audit anchors that a starting stdout run did not take as its head: unsigned, not signed with its checkpoint key, or not at the name its checkpoint gives",
            ),
            anchor: AnchorStats::default(),
        }
    }

    /// Counts one request shed because the writer could not take its record.
    pub fn shed(&self, reason: &'static str) {
        self.audit_shed
            .get_or_create(&RefusalLabels { reason })
            .inc();
    }

    /// Anchoring is on: export its gauges, and every write result from zero
    /// so that a rate sees the first failure.
    pub fn enable_anchor(&self, interval: Duration) {
        for result in WRITE_RESULTS {
            let _ = self.audit_anchor_writes.get_or_create(&ResultLabels {
                result: result.into(),
            });
        }
        let ms = u64::try_from(interval.as_millis()).unwrap_or(u64::MAX);
        self.anchor.interval_ms.store(ms.max(1), Ordering::Relaxed);
    }

    /// The anchor gauges, read at scrape time (nothing while anchoring is off).
    pub fn render_anchor(&self, out: &mut String, now_unix: i64) {
        self.anchor.render(out, now_unix);
    }
}

impl AnchorMetrics for AuditMetrics {
    fn anchor_written(&self, failed: Option<&'static str>) {
        self.audit_anchor_writes
            .get_or_create(&ResultLabels {
                result: failed.unwrap_or("written").into(),
            })
            .inc();
    }

    fn anchor_coalesced(&self, n: u64) {
        self.audit_anchor_coalesced.inc_by(n);
    }

    fn anchor_pending(&self, since: Option<std::time::SystemTime>) {
        let unix = since.map_or(0, |t| {
            t.duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_secs().max(1))
        });
        self.anchor.uncovered_since.store(unix, Ordering::Relaxed);
    }
}

/// The anchor writer's state, exported at scrape time once anchoring is on
/// ([`AuditMetrics::enable_anchor`]). Its write and coalesce counters are
/// registry families beside the other audit metrics.
#[derive(Debug, Default)]
pub struct AnchorStats {
    /// `--audit-anchor-interval` in milliseconds (0: anchoring is off).
    interval_ms: AtomicU64,
    /// Unix seconds when the oldest checkpoint that no written anchor
    /// covers was handed to the anchor writer (0: every one is covered).
    uncovered_since: AtomicU64,
}

impl AnchorStats {
    fn render(&self, out: &mut String, now_unix: i64) {
        let interval_ms = self.interval_ms.load(Ordering::Relaxed);
        if interval_ms == 0 {
            return;
        }
        let interval = interval_ms as f64 / 1000.0;
        let _ = writeln!(out, "# HELP meshca_audit_anchor_interval_seconds At most one periodic checkpoint is anchored this often (MESHCA_AUDIT_ANCHOR_INTERVAL): a checkpoint may wait this long to be anchored.\n# TYPE meshca_audit_anchor_interval_seconds gauge\nmeshca_audit_anchor_interval_seconds {interval}");
        let since = self.uncovered_since.load(Ordering::Relaxed);
        let pending = if since == 0 {
            0
        } else {
            (now_unix - i64::try_from(since).unwrap_or(now_unix)).max(0)
        };
        let _ = writeln!(out, "# HELP meshca_audit_anchor_pending_seconds How long the oldest audit checkpoint that no written anchor covers has waited (0: all are anchored); up to meshca_audit_anchor_interval_seconds is normal.\n# TYPE meshca_audit_anchor_pending_seconds gauge\nmeshca_audit_anchor_pending_seconds {pending}");
    }
}
