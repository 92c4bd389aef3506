//! The CreateCertificate use case: authenticate, authorize, check the CSR,
//! sign, and audit. Knows nothing about gRPC.

use std::sync::Arc;

use time::OffsetDateTime;

use crate::audit::{AuditError, AuditGuard, AuditSink};
use crate::authn::{self, AuthnError, Credentials, TokenAuthenticator};
use crate::authz::{ImpersonationError, NodeAuthorizer};
use crate::ca::{csr, ttl, CaStore, CsrError, CsrPolicy, SignError, TtlError, TtlPolicy};
use crate::metrics::{ErrorClass, Metrics};

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
    #[error("metadata has {count} keys, over the limit of {max}")]
    MetadataTooManyKeys { count: usize, max: usize },
    #[error("a metadata key is {len} bytes, over the limit of {max}")]
    MetadataKeyTooLarge { len: usize, max: usize },
    #[error("a metadata value is {len} bytes, over the limit of {max}")]
    MetadataValueTooLarge { len: usize, max: usize },
    #[error("metadata ImpersonatedIdentity is {len} bytes, over the limit of {max}")]
    ImpersonatedIdentityTooLarge { len: usize, max: usize },
}

impl RequestError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::MetadataWrongType(_) => "metadata_wrong_type",
            Self::MetadataTooManyKeys { .. } => "metadata_too_many_keys",
            Self::MetadataKeyTooLarge { .. } => "metadata_key_too_large",
            Self::MetadataValueTooLarge { .. } => "metadata_value_too_large",
            Self::ImpersonatedIdentityTooLarge { .. } => "impersonated_identity_too_large",
        }
    }
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
    /// Fail closed: a certificate is never returned without its audit record.
    #[error("{0}")]
    Audit(#[from] AuditError),
}

impl IssueError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Unauthenticated(e) => e.reason(),
            Self::Impersonation(e) => e.reason(),
            Self::Request(e) => e.reason(),
            Self::Csr(e) => e.reason(),
            Self::Ttl(e) => e.reason(),
            Self::Sign(e) => e.reason(),
            Self::Audit(_) => "audit_write_failed",
        }
    }

    /// How istiod's metrics count this failure.
    pub fn class(&self) -> ErrorClass {
        match self {
            Self::Unauthenticated(_) | Self::Impersonation(_) => ErrorClass::Authentication,
            Self::Request(_) => ErrorClass::Csr { parsing: false },
            Self::Csr(e) => ErrorClass::Csr {
                parsing: matches!(
                    e,
                    CsrError::NotPem | CsrError::Malformed | CsrError::TooLarge(_)
                ),
            },
            Self::Ttl(TtlError::TooLong { .. }) => ErrorClass::Ttl,
            Self::Ttl(TtlError::SignerExpired(_)) | Self::Sign(_) | Self::Audit(_) => {
                ErrorClass::CertGen
            }
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
    pub metrics: Option<Arc<Metrics>>,
}

impl CertificateIssuer {
    /// Handles one request; emits exactly one audit record whatever happens.
    pub async fn issue(
        &self,
        creds: &Credentials,
        req: Result<IssueRequest, RequestError>,
    ) -> Result<Vec<String>, IssueError> {
        let mut audit = AuditGuard::new(self.audit.clone(), self.metrics.clone(), creds.peer_addr);
        let result = self.issue_inner(creds, req, &mut audit).await;
        match &result {
            Ok(_) => audit.allow(),
            Err(e) => {
                let detail = e.to_string();
                // The message may echo caller input: the log line is bounded like the record.
                let shown =
                    crate::audit::bounded::bounded(&detail, crate::audit::bounded::FIELD_MAX);
                tracing::warn!(request_id = audit.request_id(), reason = e.reason(), error = %shown, "certificate request denied");
                audit.deny(e.reason(), Some(e.class()), detail);
            }
        }
        match (audit.finish(), result) {
            (Err(e), Ok(_)) => Err(IssueError::Audit(e)),
            (_, result) => result,
        }
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
            r.authn_method = Some(caller.method.as_str().to_string());
            r.token_verified_by = caller.method.token_verified_by().map(str::to_string);
            r.token_local_fallback = caller.method.local_fallback().map(str::to_string);
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
        {
            // What was asked for, before the policy judges it (bounded when
            // the record is finalized).
            let r = audit.record();
            r.csr_sha256 = Some(hex::encode(csr.sha256));
            r.csr_sans = Some(
                csr.sans
                    .iter()
                    .map(|s| match s {
                        csr::San::Uri(u) | csr::San::Other(u) => u.clone(),
                    })
                    .collect(),
            );
        }
        csr::check_policy(&csr, &identity, self.csr_policy)?;

        // One snapshot for the whole signing step: a reload cannot mix material.
        let bundle = self.ca.snapshot();
        let ttl::Grant { validity, choice } = ttl::grant(
            OffsetDateTime::now_utc(),
            req.validity_secs,
            &self.ttl,
            bundle.signing_not_after(),
            ttl::random_draw(),
        )?;
        let leaf = bundle.sign_leaf(&csr.spki_der, &identity, csr.has_common_name, &validity)?;
        let r = audit.record();
        r.lifetime = Some(choice);
        r.serial = Some(leaf.serial_hex.clone());
        r.spki_sha256 = Some(hex::encode(csr::sha256(&csr.spki_der)));
        r.not_before = Some(leaf.not_before);
        r.not_after = Some(leaf.not_after);
        r.issuer_key_id = Some(bundle.key_id().to_string());
        Ok(bundle.response_chain(&leaf.pem))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::{Decision, MemorySink};
    use crate::authn::Caller;
    use crate::authz::Evidence;
    use crate::ca::generate::KeyType;
    use crate::identity::{IdentityError, SpiffeId};
    use crate::testing::{client_identity, csr_for, validity_hours, TestPki};
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::CertificateDer;

    /// Credentials of a connection that presented `chain` (already verified).
    fn mtls_creds(chain: &str) -> Credentials {
        let peer_chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(chain.as_bytes())
                .collect::<Result<_, _>>()
                .unwrap();
        Credentials {
            peer_chain: Some(peer_chain.into()),
            ..Default::default()
        }
    }

    /// Denies every impersonation with a fixed error.
    #[derive(Debug)]
    struct Fixed(ImpersonationError);

    impl NodeAuthorizer for Fixed {
        fn authorize(
            &self,
            _: &Caller,
            _: &str,
            _: &Credentials,
        ) -> Result<(SpiffeId, Evidence), ImpersonationError> {
            Err(self.0.clone())
        }
    }

    fn every_denial() -> Vec<ImpersonationError> {
        use ImpersonationError::*;
        vec![
            NotConfigured,
            NoPodBinding("mtls"),
            CallerNotTrusted("a/b".into()),
            InvalidIdentity("x".into(), IdentityError::WrongShape),
            ForeignTrustDomain("evil".into()),
            UnknownCluster("remote".into()),
            IndexNotReady,
            CallerPodNotFound("a/b".into()),
            CallerPodUidMismatch("1".into(), "2".into()),
            CallerServiceAccountMismatch("a".into(), "b".into()),
            CallerPodTerminal("a/b".into()),
            CallerPodAmbiguous("10.0.0.1".into()),
            CallerPodUnscheduled("a/b".into()),
            NoPodOnNode("a/b".into(), "n".into()),
        ]
    }

    #[tokio::test]
    async fn every_impersonation_denial_gives_exactly_one_audit_record_with_its_reason() {
        let pki = TestPki::new(KeyType::EcdsaP256);
        let ca = Arc::new(crate::ca::CaStore::from_dir(pki.path(), false).unwrap());
        let (chain, _) = client_identity(
            &ca.snapshot(),
            "spiffe://cluster.local/ns/istio-system/sa/ztunnel",
            &validity_hours(-1, 1),
        );
        let creds = mtls_creds(&chain);
        let requested = "spiffe://cluster.local/ns/app/sa/app";
        let csr = csr_for(&rcgen::KeyPair::generate().unwrap(), requested);
        let mut reasons = std::collections::BTreeSet::new();
        for denial in every_denial() {
            let sink = Arc::new(MemorySink::default());
            let metrics = Arc::new(Metrics::new());
            let issuer = CertificateIssuer {
                ca: ca.clone(),
                ttl: TtlPolicy::default(),
                csr_policy: CsrPolicy::Strict,
                tokens: None,
                node_authz: Some(Arc::new(Fixed(denial.clone()))),
                audit: sink.clone(),
                metrics: Some(metrics.clone()),
            };
            let req = IssueRequest {
                csr: csr.clone(),
                validity_secs: 0,
                impersonate: Some(requested.into()),
            };
            let err = issuer.issue(&creds, Ok(req)).await.unwrap_err();
            let records = sink.records();
            assert_eq!(records.len(), 1, "{denial:?}");
            assert_eq!(records[0].reason, denial.reason());
            assert_eq!(records[0].decision, Decision::Deny);
            assert!(records[0].impersonated);
            assert_eq!(records[0].requested_identity.as_deref(), Some(requested));
            assert_eq!(err.reason(), denial.reason());
            assert_eq!(
                metrics
                    .citadel
                    .authentication_failure_count
                    .load(std::sync::atomic::Ordering::Relaxed),
                1
            );
            reasons.insert(denial.reason());
        }
        assert_eq!(reasons.len(), every_denial().len(), "reasons are distinct");
    }

    #[tokio::test]
    async fn a_refused_san_is_recorded_and_found_by_identity_query() {
        let pki = TestPki::new(KeyType::EcdsaP256);
        let ca = Arc::new(crate::ca::CaStore::from_dir(pki.path(), false).unwrap());
        let me = "spiffe://cluster.local/ns/app/sa/app";
        let (chain, _) = client_identity(&ca.snapshot(), me, &validity_hours(-1, 1));
        let sink = Arc::new(MemorySink::default());
        let issuer = CertificateIssuer {
            ca,
            ttl: TtlPolicy::default(),
            csr_policy: CsrPolicy::Strict,
            tokens: None,
            node_authz: None,
            audit: sink.clone(),
            metrics: None,
        };
        let other = "spiffe://cluster.local/ns/x/sa/y";
        let req = IssueRequest {
            csr: csr_for(&rcgen::KeyPair::generate().unwrap(), other),
            validity_secs: 0,
            impersonate: None,
        };
        let err = issuer
            .issue(&mtls_creds(&chain), Ok(req))
            .await
            .unwrap_err();
        assert_eq!(err.reason(), "csr_san_not_authorized");
        let r = &sink.records()[0];
        assert_eq!(r.csr_sans.as_deref(), Some(&[other.to_string()][..]));
        let q = |id: &str| crate::audit::verify::Query {
            identity: Some(id.into()),
            ..Default::default()
        };
        assert!(q(other).matches(r), "who asked for {other}? this record");
        assert!(q(me).matches(r), "the caller still matches");
        assert!(!q("spiffe://cluster.local/ns/z/sa/z").matches(r));
    }

    #[derive(Debug)]
    struct FullDisk;

    impl AuditSink for FullDisk {
        fn emit(&self, _: &crate::audit::AuditRecord) -> Result<(), crate::audit::AuditError> {
            Err(crate::audit::AuditError("no space left on device".into()))
        }
    }

    #[tokio::test]
    async fn no_certificate_without_its_audit_record() {
        let pki = TestPki::new(KeyType::EcdsaP256);
        let ca = Arc::new(crate::ca::CaStore::from_dir(pki.path(), false).unwrap());
        let id = "spiffe://cluster.local/ns/app/sa/app";
        let (chain, _) = client_identity(&ca.snapshot(), id, &validity_hours(-1, 1));
        let creds = mtls_creds(&chain);
        let issuer = CertificateIssuer {
            ca,
            ttl: TtlPolicy::default(),
            csr_policy: CsrPolicy::Strict,
            tokens: None,
            node_authz: None,
            audit: Arc::new(FullDisk),
            metrics: None,
        };
        let req = IssueRequest {
            csr: csr_for(&rcgen::KeyPair::generate().unwrap(), id),
            validity_secs: 0,
            impersonate: None,
        };
        let err = issuer.issue(&creds, Ok(req)).await.unwrap_err();
        assert_eq!(err.reason(), "audit_write_failed");
        assert_eq!(tonic::Status::from(err).code(), tonic::Code::Internal);
    }
}
