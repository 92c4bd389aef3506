//! The audit log: exactly one record per CreateCertificate call, on every
//! path. A guard collects the record during the request and hands it to the
//! sink once; the chained sink ([`chain`]) hash-links records and signs
//! periodic checkpoints so deletions, edits and reordering are detectable
//! ([`verify`]).

pub mod bounded;
pub mod chain;
pub mod verify;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::metrics::{ErrorClass, Metrics};

/// Allow or deny.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Decision {
    Allow,
    Deny,
}

/// What a security team reads about one request. Never holds a token, a key
/// or a CSR (only its SHA-256).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AuditRecord {
    #[serde(with = "time::serde::rfc3339")]
    pub time: OffsetDateTime,
    pub request_id: String,
    pub peer: Option<String>,
    pub authn_method: Option<String>,
    pub caller_identity: Option<String>,
    pub caller_pod: Option<String>,
    pub caller_pod_uid: Option<String>,
    pub node: Option<String>,
    pub requested_identity: Option<String>,
    pub impersonated: bool,
    pub decision: Decision,
    pub reason: String,
    pub detail: Option<String>,
    pub evidence: Option<String>,
    pub serial: Option<String>,
    pub spki_sha256: Option<String>,
    pub csr_sha256: Option<String>,
    /// Every SAN of the parsed CSR (URIs verbatim, other kinds prefixed),
    /// bounded; absent when no CSR was parsed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csr_sans: Option<Vec<String>>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub not_before: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub not_after: Option<OffsetDateTime>,
    pub issuer_key_id: Option<String>,
    /// Granted TTL, renewal-jitter band, drawn lifetime and backdate of the issued leaf.
    #[serde(default)]
    pub lifetime: Option<crate::ca::ttl::LifetimeChoice>,
    pub latency_ms: f64,
    /// Set by the sink when the full record exceeded the line cap and this
    /// reduced form was written instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reduced: Option<Reduced>,
    /// Token callers: which path verified the caller, `local` or `review`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_verified_by: Option<String>,
    /// Why local verification handed the token to TokenReview (a reason code).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_local_fallback: Option<String>,
}

/// What a reduced record stands for.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Reduced {
    /// Size of the full line that was refused.
    pub line_bytes: u64,
    /// SHA-256 of the full line (never written).
    pub line_sha256: String,
    /// The cap in force (`MESHCA_AUDIT_MAX_LINE_BYTES`).
    pub max_line_bytes: u64,
}

impl AuditRecord {
    /// A record with only the required fields set; everything else is filled
    /// in as the request goes.
    pub fn new(
        time: OffsetDateTime,
        request_id: String,
        decision: Decision,
        reason: String,
    ) -> Self {
        Self {
            time,
            request_id,
            peer: None,
            authn_method: None,
            caller_identity: None,
            caller_pod: None,
            caller_pod_uid: None,
            node: None,
            requested_identity: None,
            impersonated: false,
            decision,
            reason,
            detail: None,
            evidence: None,
            serial: None,
            spki_sha256: None,
            csr_sha256: None,
            csr_sans: None,
            not_before: None,
            not_after: None,
            issuer_key_id: None,
            lifetime: None,
            latency_ms: 0.0,
            reduced: None,
            token_verified_by: None,
            token_local_fallback: None,
        }
    }

    /// Bounds every string a caller can influence (see [`bounded`]). Applied
    /// once, when the record is finalized, so no path can skip it.
    pub fn bound(&mut self) {
        use bounded::{bound_opt, bound_sans, bound_string, FIELD_MAX};
        bound_string(&mut self.request_id, FIELD_MAX);
        bound_string(&mut self.reason, FIELD_MAX);
        for f in [
            &mut self.peer,
            &mut self.authn_method,
            &mut self.caller_identity,
            &mut self.caller_pod,
            &mut self.caller_pod_uid,
            &mut self.node,
            &mut self.requested_identity,
            &mut self.detail,
            &mut self.evidence,
            &mut self.serial,
            &mut self.spki_sha256,
            &mut self.csr_sha256,
            &mut self.issuer_key_id,
        ] {
            bound_opt(f, FIELD_MAX);
        }
        if let Some(sans) = &mut self.csr_sans {
            bound_sans(sans);
        }
    }
}

/// The audit sink could not persist a record.
#[derive(Debug, thiserror::Error)]
#[error("audit record not written: {0}")]
pub struct AuditError(pub String);

/// Where records go. `emit` must either persist the record or fail.
pub trait AuditSink: Send + Sync + std::fmt::Debug {
    fn emit(&self, record: &AuditRecord) -> Result<(), AuditError>;
}

/// Keeps records in memory (tests).
#[derive(Debug, Default)]
pub struct MemorySink(pub std::sync::Mutex<Vec<AuditRecord>>);

impl MemorySink {
    pub fn records(&self) -> Vec<AuditRecord> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

impl AuditSink for MemorySink {
    fn emit(&self, record: &AuditRecord) -> Result<(), AuditError> {
        self.0
            .lock()
            .map_err(|_| AuditError("poisoned".into()))?
            .push(record.clone());
        Ok(())
    }
}

/// Collects a record during a request and emits it exactly once: through
/// [`AuditGuard::finish`], or on drop for early returns and cancellation.
/// Until a decision is recorded the outcome is a deny (`request_abandoned`).
#[derive(Debug)]
pub struct AuditGuard {
    record: AuditRecord,
    reason: &'static str,
    class: Option<ErrorClass>,
    started: Instant,
    sink: Arc<dyn AuditSink>,
    metrics: Option<Arc<Metrics>>,
    done: bool,
}

impl AuditGuard {
    pub fn new(
        sink: Arc<dyn AuditSink>,
        metrics: Option<Arc<Metrics>>,
        peer: Option<SocketAddr>,
    ) -> Self {
        let mut id = [0u8; 8];
        let _ = aws_lc_rs::rand::fill(&mut id);
        Self {
            record: AuditRecord {
                peer: peer.map(|p| p.to_string()),
                ..AuditRecord::new(
                    OffsetDateTime::now_utc(),
                    hex::encode(id),
                    Decision::Deny,
                    "request_abandoned".into(),
                )
            },
            reason: "request_abandoned",
            class: None,
            started: Instant::now(),
            sink,
            metrics,
            done: false,
        }
    }

    pub fn record(&mut self) -> &mut AuditRecord {
        &mut self.record
    }

    pub fn request_id(&self) -> &str {
        &self.record.request_id
    }

    pub fn deny(&mut self, reason: &'static str, class: Option<ErrorClass>, detail: String) {
        self.record.decision = Decision::Deny;
        self.record.reason = reason.into();
        self.record.detail = Some(detail);
        self.reason = reason;
        self.class = class;
    }

    pub fn allow(&mut self) {
        self.record.decision = Decision::Allow;
        self.record.reason = "issued".into();
        self.record.detail = None;
        self.reason = "issued";
        self.class = None;
    }

    /// Emits the record now; an error means the record was not persisted.
    pub fn finish(mut self) -> Result<(), AuditError> {
        self.emit()
    }

    fn emit(&mut self) -> Result<(), AuditError> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        let elapsed = self.started.elapsed().as_secs_f64();
        self.record.latency_ms = elapsed * 1000.0;
        self.record.bound();
        if let Some(m) = &self.metrics {
            m.record(self.record.decision, self.reason, self.class, elapsed);
        }
        let result = self.sink.emit(&self.record);
        if let (Err(e), Some(m)) = (&result, &self.metrics) {
            m.audit_write_errors.inc();
            tracing::error!(error = %e, request_id = %self.record.request_id, "audit record lost");
        }
        result
    }
}

impl Drop for AuditGuard {
    fn drop(&mut self) {
        let _ = self.emit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_request_is_recorded_once_as_abandoned() {
        let sink = Arc::new(MemorySink::default());
        let metrics = Arc::new(Metrics::new());
        {
            let mut g = AuditGuard::new(sink.clone(), Some(metrics.clone()), None);
            g.record().caller_identity = Some("spiffe://cluster.local/ns/a/sa/b".into());
            // Cancelled before any decision: the guard goes out of scope.
        }
        let records = sink.records();
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].decision, Decision::Deny);
        assert_eq!(records[0].reason, "request_abandoned");
        assert_eq!(
            metrics
                .citadel
                .csr_count
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
    }

    #[test]
    fn finish_then_drop_emits_once() {
        let sink = Arc::new(MemorySink::default());
        let mut g = AuditGuard::new(sink.clone(), None, None);
        g.allow();
        g.finish().unwrap();
        assert_eq!(sink.records().len(), 1);
        assert_eq!(sink.records()[0].reason, "issued");
    }

    #[test]
    fn oversized_caller_input_is_bounded_when_the_record_is_emitted() {
        let sink = Arc::new(MemorySink::default());
        let mut g = AuditGuard::new(sink.clone(), None, None);
        let huge = "\u{1}".repeat(1_000_000);
        g.record().requested_identity = Some(huge.clone());
        g.record().csr_sans = Some(vec![huge.clone(); 100]);
        g.deny("x", None, format!("bad identity {huge}"));
        drop(g);
        let r = &sink.records()[0];
        let line = serde_json::to_string(r).unwrap();
        assert!(line.len() < 16 * 1024, "{}", line.len());
        let id = r.requested_identity.as_deref().unwrap();
        assert!(id.contains("1000000 bytes, sha256:"), "{id}");
        assert_eq!(r.csr_sans.as_ref().unwrap().len(), bounded::MAX_SANS);
    }

    #[derive(Debug)]
    struct Broken;
    impl AuditSink for Broken {
        fn emit(&self, _: &AuditRecord) -> Result<(), AuditError> {
            Err(AuditError("disk full".into()))
        }
    }

    #[test]
    fn a_lost_record_is_reported_to_the_caller() {
        let metrics = Arc::new(Metrics::new());
        let mut g = AuditGuard::new(Arc::new(Broken), Some(metrics.clone()), None);
        g.allow();
        assert!(g.finish().is_err(), "issuance must fail closed");
        assert_eq!(metrics.audit_write_errors.get(), 1);
    }
}
