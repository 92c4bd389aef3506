//! Shared vocabulary of a request's outcome: what the audit log records and
//! the metrics count. Both depend on this module and on nothing of each
//! other (the audit guard reports outcomes through [`OutcomeObserver`],
//! which the wiring's `telemetry::Metrics` implements).

use serde::{Deserialize, Serialize};

/// Allow or deny.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Decision {
    Allow,
    Deny,
}

/// How a failed request counts in istiod's metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// `citadel_server_authentication_failure_count`.
    Authentication,
    /// `citadel_server_csr_sign_err_count{error="CSR_ERROR"}` (parsing errors also count in csr_parsing_err_count).
    Csr { parsing: bool },
    /// `error="TTL_ERROR"`.
    Ttl,
    /// `error="CERT_GEN_ERROR"`.
    CertGen,
    /// `error="CA_NOT_READY"`.
    CaNotReady,
}

/// One finished request, as the metrics count it.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    pub decision: Decision,
    /// The decision's reason code (`issued` for a certificate issued).
    pub reason: &'static str,
    /// How a refusal counts in istiod's metrics (none when allowed).
    pub class: Option<ErrorClass>,
    /// From the request's start to its audit record sealed.
    pub seconds: f64,
}

/// Who counts finished requests and audit-log trouble.
pub trait OutcomeObserver: Send + Sync + std::fmt::Debug {
    /// One finished request (called exactly once per request).
    fn outcome(&self, outcome: Outcome);
    /// A record could not be written.
    fn audit_write_error(&self);
    /// A request was turned away because the audit writer could not take its
    /// record in time (`reason` is the refusal's reason code).
    fn audit_shed(&self, _reason: &'static str) {}
    /// A refused request whose caller's node is known from verified data
    /// (the token's pod binding, or the pod index).
    fn node_refusal(&self, _reason: &'static str, _node: &str) {}
}
