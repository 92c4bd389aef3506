//! One audit record per CreateCertificate call, emitted by a guard on drop so
//! that early returns and cancelled requests are recorded too.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use time::OffsetDateTime;

/// Allow or deny.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Decision {
    Allow,
    Deny,
}

/// What a security team reads about one request. Never holds a token, a key
/// or a CSR (only its SHA-256).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct AuditRecord {
    #[serde(with = "time::serde::rfc3339")]
    pub time: OffsetDateTime,
    pub request_id: String,
    pub peer: Option<String>,
    pub authn_method: Option<&'static str>,
    pub caller_identity: Option<String>,
    pub caller_pod: Option<String>,
    pub caller_pod_uid: Option<String>,
    pub node: Option<String>,
    pub requested_identity: Option<String>,
    pub impersonated: bool,
    pub decision: Decision,
    pub reason: &'static str,
    pub detail: Option<String>,
    pub evidence: Option<String>,
    pub serial: Option<String>,
    pub spki_sha256: Option<String>,
    pub csr_sha256: Option<String>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub not_before: Option<OffsetDateTime>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub not_after: Option<OffsetDateTime>,
    pub issuer_key_id: Option<String>,
    pub latency_ms: f64,
}

/// Where records go.
pub trait AuditSink: Send + Sync + std::fmt::Debug {
    fn emit(&self, record: &AuditRecord);
}

/// Writes each record as one JSON line through `tracing` target `audit`.
#[derive(Debug, Default)]
pub struct TracingSink;

impl AuditSink for TracingSink {
    fn emit(&self, record: &AuditRecord) {
        match serde_json::to_string(record) {
            Ok(line) => tracing::info!(target: "audit", record = %line, "certificate request"),
            Err(e) => tracing::error!(target: "audit", error = %e, "audit record not serializable"),
        }
    }
}

/// Keeps records in memory (tests and the `certs` tooling).
#[derive(Debug, Default)]
pub struct MemorySink(pub std::sync::Mutex<Vec<AuditRecord>>);

impl MemorySink {
    pub fn records(&self) -> Vec<AuditRecord> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

impl AuditSink for MemorySink {
    fn emit(&self, record: &AuditRecord) {
        if let Ok(mut v) = self.0.lock() {
            v.push(record.clone());
        }
    }
}

/// Collects a record during a request and emits it exactly once when dropped.
/// Until a decision is recorded the outcome is a deny (`request_abandoned`).
#[derive(Debug)]
pub struct AuditGuard {
    record: AuditRecord,
    started: Instant,
    sink: Arc<dyn AuditSink>,
}

impl AuditGuard {
    pub fn new(sink: Arc<dyn AuditSink>, peer: Option<SocketAddr>) -> Self {
        let mut id = [0u8; 8];
        let _ = aws_lc_rs::rand::fill(&mut id);
        Self {
            record: AuditRecord {
                time: OffsetDateTime::now_utc(),
                request_id: hex::encode(id),
                peer: peer.map(|p| p.to_string()),
                authn_method: None,
                caller_identity: None,
                caller_pod: None,
                caller_pod_uid: None,
                node: None,
                requested_identity: None,
                impersonated: false,
                decision: Decision::Deny,
                reason: "request_abandoned",
                detail: None,
                evidence: None,
                serial: None,
                spki_sha256: None,
                csr_sha256: None,
                not_before: None,
                not_after: None,
                issuer_key_id: None,
                latency_ms: 0.0,
            },
            started: Instant::now(),
            sink,
        }
    }

    pub fn record(&mut self) -> &mut AuditRecord {
        &mut self.record
    }

    pub fn request_id(&self) -> &str {
        &self.record.request_id
    }

    pub fn deny(&mut self, reason: &'static str, detail: String) {
        self.record.decision = Decision::Deny;
        self.record.reason = reason;
        self.record.detail = Some(detail);
    }

    pub fn allow(&mut self) {
        self.record.decision = Decision::Allow;
        self.record.reason = "issued";
        self.record.detail = None;
    }
}

impl Drop for AuditGuard {
    fn drop(&mut self) {
        self.record.latency_ms = self.started.elapsed().as_secs_f64() * 1000.0;
        self.sink.emit(&self.record);
    }
}
