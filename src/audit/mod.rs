//! The audit log: exactly one record per CreateCertificate call, on every
//! path. A guard collects the record during the request and hands it to the
//! sink once; the chained sink ([`chain`]) hash-links records and signs
//! periodic checkpoints ([`keys`]) so deletions, edits and reordering are
//! detectable ([`verify`]). Writer and verifier share the line format
//! ([`format`](mod@format)); [`query`] reads records back.

pub mod aggregate;
pub mod anchor;
pub mod bounded;
pub mod chain;
pub mod format;
pub mod keys;
pub mod keysecret;
pub mod metrics;
pub mod query;
pub mod settings;
pub mod verify;
pub mod writer;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

pub use crate::outcome::Decision;
use crate::outcome::{ErrorClass, Outcome, OutcomeObserver};

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
    pub lifetime: Option<crate::lifetime::LifetimeChoice>,
    pub latency_ms: f64,
    /// Set by the sink when the full record exceeded the line cap and this
    /// reduced form was written instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reduced: Option<Reduced>,
    /// RFC 5280 reason of a revocation record (`meshca revoke`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revocation_reason: Option<String>,
    /// How an mTLS renewal was allowed (`pod_live`, `index_off`), and
    /// whether its TTL was cut to the renewal cap (`capped`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renewal_check: Option<String>,
    /// Token callers: which path verified the caller, `local` or `review`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_verified_by: Option<String>,
    /// Why local verification handed the token to TokenReview (a reason code).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_local_fallback: Option<String>,
    /// Aggregated records (rejected TLS handshakes): how many events of this
    /// source and reason the record stands for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    /// The cluster the request is attributed to: the one whose API server
    /// or issuer keys verified the caller's token, else the `clusterid`
    /// header as sent, else this CA's `CLUSTER_ID`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_id: Option<String>,
    /// CA rotation records: the phase change (`trust->switched`) or the
    /// phase a forced step did not apply to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotation_step: Option<String>,
    /// Who forced a rotation step, and why (`meshca rotate force`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotation_forced: Option<String>,
    /// Certificates meshca issues to itself: `issuing_ca` (two-tier issuing)
    /// or `serving` (the gRPC TLS certificate). Absent for workload leaves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issued_kind: Option<String>,
    /// Where the key that signed this certificate is held: `file`,
    /// `memory` (a two-tier issuing CA) or `pkcs11`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signer: Option<String>,
    /// The issued certificate (PEM), on `issued_kind` records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub certificate: Option<String>,
    /// Pod certificate decisions: the PodCertificateRequest `namespace/name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_certificate_request: Option<String>,
    /// Pod certificate decisions: the PodCertificateRequest's UID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_certificate_request_uid: Option<String>,
    /// mTLS callers: the serial of the client certificate presented (as
    /// `serial` writes serials), on every record of the request, allowed or
    /// not. Links a renewal to the certificate it renewed, so offline tools
    /// follow a leaf to every certificate issued to its holder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presented_serial: Option<String>,
    /// Aggregate records: refusals folded into this one record (how many is
    /// `count`), where and when (see [`aggregate`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregate: Option<Aggregate>,
}

/// Marks an aggregate record: where its refusals were folded and when the
/// first and last of them happened.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Aggregate {
    /// `audit_queue_full` or `transport`.
    pub source: String,
    #[serde(with = "time::serde::rfc3339")]
    pub first: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    pub last: OffsetDateTime,
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
            revocation_reason: None,
            renewal_check: None,
            token_verified_by: None,
            token_local_fallback: None,
            count: None,
            cluster_id: None,
            rotation_step: None,
            rotation_forced: None,
            issued_kind: None,
            signer: None,
            certificate: None,
            pod_certificate_request: None,
            pod_certificate_request_uid: None,
            presented_serial: None,
            aggregate: None,
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
            &mut self.revocation_reason,
            &mut self.renewal_check,
            &mut self.cluster_id,
            &mut self.pod_certificate_request,
            &mut self.pod_certificate_request_uid,
            &mut self.presented_serial,
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

/// A request refused because its record could not be taken or written: no
/// certificate leaves for it.
#[derive(Debug, thiserror::Error)]
pub enum AuditRefusal {
    /// The writer could not take the record now (its queue is full, or it
    /// stopped): the request is shed, with this reason code.
    #[error("audit writer cannot take the record ({0})")]
    Shed(&'static str),
    #[error(transparent)]
    Write(#[from] AuditError),
}

impl AuditRefusal {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Shed(r) => r,
            Self::Write(_) => "audit_write_failed",
        }
    }
}

/// How a submitted record is acknowledged.
#[derive(Debug)]
pub enum Ack {
    /// Already written.
    Written,
    /// Written (and made as durable as the fsync policy says) when this
    /// resolves to `Ok`.
    Pending(tokio::sync::oneshot::Receiver<Result<(), AuditError>>),
}

/// Where records go. `emit` must either persist the record or fail.
pub trait AuditSink: Send + Sync + std::fmt::Debug {
    /// Hands over a record nobody waits for (a refused or abandoned request).
    fn emit(&self, record: &AuditRecord) -> Result<(), AuditError>;

    /// Hands over a record whose request waits for the acknowledgement
    /// before answering. Never blocks: a sink that cannot take the record now
    /// refuses it. By default the record is emitted in place. Takes the
    /// record whole so a queueing sink keeps it without a copy.
    fn submit(&self, record: Box<AuditRecord>) -> Result<Ack, AuditRefusal> {
        self.emit(&record)?;
        Ok(Ack::Written)
    }
}

/// Drops every record: the reference for measuring the audit log's cost
/// (`--audit-sink null`, refused without `--audit-null-for-benchmarks`).
#[derive(Debug, Default)]
pub struct NullSink;

impl AuditSink for NullSink {
    fn emit(&self, _: &AuditRecord) -> Result<(), AuditError> {
        Ok(())
    }
}

/// Keeps records in memory (tests).
#[derive(Debug, Default)]
pub struct MemorySink(pub std::sync::Mutex<Vec<AuditRecord>>);

impl MemorySink {
    pub fn records(&self) -> Vec<AuditRecord> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// The records of requests: without those of certificates meshca issued
    /// itself (serving certificates, issuing CAs).
    pub fn requests(&self) -> Vec<AuditRecord> {
        let mut v = self.records();
        v.retain(|r| r.issued_kind.is_none());
        v
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
    metrics: Option<Arc<dyn OutcomeObserver>>,
    done: bool,
}

/// A random id for a record no request carries (events, certificates meshca
/// issues itself) and for a request that sent none.
pub fn random_id() -> String {
    let mut id = [0u8; 8];
    let _ = aws_lc_rs::rand::fill(&mut id);
    hex::encode(id)
}

impl AuditGuard {
    /// `metrics`: pass `Some(metrics)` (an `Arc<telemetry::Metrics>` coerces).
    pub fn new(
        sink: Arc<dyn AuditSink>,
        metrics: Option<Arc<dyn OutcomeObserver>>,
        peer: Option<SocketAddr>,
    ) -> Self {
        Self {
            record: AuditRecord {
                peer: peer.map(|p| p.to_string()),
                ..AuditRecord::new(
                    OffsetDateTime::now_utc(),
                    random_id(),
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
    /// Nobody waits for the writer's acknowledgement: for refusals only
    /// (an issued certificate goes through [`Self::finish_acked`]).
    pub fn finish(mut self) -> Result<(), AuditError> {
        self.emit()
    }

    /// Hands the record to the sink and waits until it is written (and as
    /// durable as the fsync policy promises). The certificate may leave only
    /// on `Ok`. Waiting never blocks a runtime thread.
    pub async fn finish_acked(mut self) -> Result<(), AuditRefusal> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        let elapsed = self.seal();
        // The record moves to the sink (no copy of its ~20 strings per
        // request); what `observe` reads afterwards stays behind.
        let decision = self.record.decision;
        // A refusal's node is counted after the record has gone to the sink.
        let node = match decision {
            Decision::Deny => self.record.node.clone(),
            Decision::Allow => None,
        };
        let record = std::mem::replace(
            &mut self.record,
            AuditRecord::new(
                OffsetDateTime::UNIX_EPOCH,
                String::new(),
                decision,
                String::new(),
            ),
        );
        self.record.request_id.clone_from(&record.request_id);
        self.record.node = node;
        let result = match self.sink.submit(Box::new(record)) {
            Ok(Ack::Written) => Ok(()),
            Ok(Ack::Pending(rx)) => match rx.await {
                Ok(r) => r.map_err(AuditRefusal::from),
                Err(_) => Err(AuditRefusal::Shed("audit_writer_stopped")),
            },
            Err(e) => Err(e),
        };
        self.observe(elapsed, result.as_ref().err());
        result
    }

    /// Final touches before the record leaves: latency and bounds.
    fn seal(&mut self) -> f64 {
        let elapsed = self.started.elapsed().as_secs_f64();
        self.record.latency_ms = elapsed * 1000.0;
        self.record.bound();
        elapsed
    }

    /// Counts the request; one whose record was refused counts as the
    /// refusal it became (the log has no record of it to say otherwise).
    fn observe(&self, elapsed: f64, refused: Option<&AuditRefusal>) {
        let Some(m) = &self.metrics else {
            if let Some(e) = refused {
                tracing::error!(error = %e, request_id = %self.record.request_id, "audit record not written");
            }
            return;
        };
        match refused {
            None => {
                m.outcome(Outcome {
                    decision: self.record.decision,
                    reason: self.reason,
                    class: self.class,
                    seconds: elapsed,
                });
                if let (Decision::Deny, Some(node)) = (self.record.decision, &self.record.node) {
                    m.node_refusal(self.reason, node);
                }
            }
            Some(e) => {
                match e {
                    AuditRefusal::Shed(r) => m.audit_shed(r),
                    AuditRefusal::Write(_) => m.audit_write_error(),
                }
                tracing::error!(error = %e, request_id = %self.record.request_id, "audit record not written");
                m.outcome(Outcome {
                    decision: Decision::Deny,
                    reason: e.reason(),
                    class: Some(ErrorClass::CertGen),
                    seconds: elapsed,
                });
            }
        }
    }

    fn emit(&mut self) -> Result<(), AuditError> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        let elapsed = self.seal();
        let result = self.sink.emit(&self.record);
        let refused = result
            .as_ref()
            .err()
            .map(|e| AuditRefusal::Write(AuditError(e.0.clone())));
        self.observe(elapsed, refused.as_ref());
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
    use crate::telemetry::Metrics;

    #[test]
    fn a_dropped_request_is_recorded_once_as_abandoned() {
        let sink = Arc::new(MemorySink::default());
        let metrics = Arc::new(Metrics::new());
        {
            let mut g = AuditGuard::new(
                sink.clone(),
                Some(metrics.clone() as Arc<dyn OutcomeObserver>),
                None,
            );
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
        let mut g = AuditGuard::new(
            Arc::new(Broken),
            Some(metrics.clone() as Arc<dyn OutcomeObserver>),
            None,
        );
        g.allow();
        assert!(g.finish().is_err(), "issuance must fail closed");
        assert_eq!(metrics.audit.audit_write_errors.get(), 1);
    }
}
