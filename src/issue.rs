//! The CreateCertificate use case: authenticate, authorize, check the CSR,
//! sign, and audit. Knows nothing about gRPC.

use std::sync::Arc;

use time::OffsetDateTime;

use crate::audit::{AuditGuard, AuditSink};
use crate::authn::{self, AuthnError, Credentials, TokenAuthenticator};
use crate::authz::{ImpersonationError, NodeAuthorizer};
use crate::ca::{csr, ttl, CaStore, CsrError, CsrPolicy, SignError, TtlError, TtlPolicy};

/// A decoded request.
#[derive(Debug, Clone, Default)]
pub struct IssueRequest {
    pub csr: String,
    pub validity_secs: i64,
    /// `metadata["ImpersonatedIdentity"]`, when a non-empty string.
    pub impersonate: Option<String>,
}

/// A request the server could not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("metadata key {0} must be a string")]
    MetadataWrongType(&'static str),
}

/// Every way a request can fail, each with a stable reason code.
#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    #[error("authentication failed: {0}")]
    Unauthenticated(#[from] AuthnError),
    #[error("impersonation denied: {0}")]
    Impersonation(#[from] ImpersonationError),
    #[error("{0}")]
    Request(#[from] RequestError),
    #[error("{0}")]
    Csr(#[from] CsrError),
    #[error("{0}")]
    Ttl(#[from] TtlError),
    #[error("{0}")]
    Sign(#[from] SignError),
}

impl IssueError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Unauthenticated(e) => e.reason(),
            Self::Impersonation(e) => e.reason(),
            Self::Request(RequestError::MetadataWrongType(_)) => "metadata_wrong_type",
            Self::Csr(e) => e.reason(),
            Self::Ttl(e) => e.reason(),
            Self::Sign(e) => e.reason(),
        }
    }
}

/// The wiring of one CA server.
#[derive(Debug, Clone)]
pub struct CertificateIssuer {
    pub ca: Arc<CaStore>,
    pub ttl: TtlPolicy,
    pub csr_policy: CsrPolicy,
    pub tokens: Option<Arc<dyn TokenAuthenticator>>,
    pub node_authz: Option<Arc<dyn NodeAuthorizer>>,
    pub audit: Arc<dyn AuditSink>,
}

impl CertificateIssuer {
    /// Handles one request; emits exactly one audit record whatever happens.
    pub async fn issue(
        &self,
        creds: &Credentials,
        req: Result<IssueRequest, RequestError>,
    ) -> Result<Vec<String>, IssueError> {
        let mut audit = AuditGuard::new(self.audit.clone(), creds.peer_addr);
        let result = self.issue_inner(creds, req, &mut audit).await;
        match &result {
            Ok(_) => audit.allow(),
            Err(e) => {
                tracing::warn!(request_id = audit.request_id(), reason = e.reason(), error = %e, "certificate request denied");
                audit.deny(e.reason(), e.to_string());
            }
        }
        result
    }

    async fn issue_inner(
        &self,
        creds: &Credentials,
        req: Result<IssueRequest, RequestError>,
        audit: &mut AuditGuard,
    ) -> Result<Vec<String>, IssueError> {
        let caller = authn::authenticate(creds, self.tokens.as_deref()).await?;
        {
            let r = audit.record();
            r.authn_method = Some(caller.method.as_str());
            r.caller_identity = Some(caller.identity.to_string());
            if let Some(k) = &caller.kube {
                r.caller_pod = Some(format!("{}/{}", k.pod_namespace, k.pod_name));
                r.caller_pod_uid = Some(k.pod_uid.clone());
                r.node = k.node_name.clone();
            }
        }
        let req = req?;
        let identity = match &req.impersonate {
            None => caller.identity.clone(),
            Some(requested) => {
                let r = audit.record();
                r.impersonated = true;
                r.requested_identity = Some(requested.clone());
                let authz = self
                    .node_authz
                    .as_ref()
                    .ok_or(ImpersonationError::NotConfigured)?;
                let (id, evidence) = authz.authorize(&caller, requested, creds)?;
                let r = audit.record();
                r.node = Some(evidence.node.clone());
                r.evidence = Some(evidence.pod.clone());
                id
            }
        };
        audit.record().requested_identity = Some(identity.to_string());

        let csr = csr::parse_and_verify(&req.csr)?;
        audit.record().csr_sha256 = Some(hex::encode(csr.sha256));
        csr::check_policy(&csr, &identity, self.csr_policy)?;

        // One snapshot for the whole signing step: a reload cannot mix material.
        let bundle = self.ca.snapshot();
        let validity = ttl::validity(
            OffsetDateTime::now_utc(),
            req.validity_secs,
            &self.ttl,
            bundle.signing_not_after(),
        )?;
        let leaf = bundle.sign_leaf(&csr.spki_der, &identity, csr.has_common_name, &validity)?;
        let r = audit.record();
        r.serial = Some(leaf.serial_hex.clone());
        r.spki_sha256 = Some(hex::encode(csr::sha256(&csr.spki_der)));
        r.not_before = Some(leaf.not_before);
        r.not_after = Some(leaf.not_after);
        r.issuer_key_id = Some(bundle.key_id().to_string());
        Ok(bundle.response_chain(&leaf.pem))
    }
}
