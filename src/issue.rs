//! The CreateCertificate use case: authenticate, authorize, check the CSR,
//! sign, and audit. Knows nothing about gRPC.

use std::sync::Arc;
use std::time::{Duration, Instant};

use time::OffsetDateTime;

use crate::admission::{Admission, Shed, ShedReason};
use crate::audit::{AuditError, AuditGuard, AuditRefusal, AuditSink};
use crate::authn::{self, AuthnError, Credentials, TokenAuthenticator};
use crate::authz::{ImpersonationError, NodeAuthorizer};
use crate::ca::{csr, ttl, CaStore, CsrError, CsrPolicy, SignError, TtlError, TtlPolicy};
use crate::cluster::metrics::ClusterMetrics;
use crate::metrics::ErrorClass;
use crate::outcome::OutcomeObserver;
use crate::revocation::metrics::KillSwitchMetrics;

mod guards;
mod lineage;

pub use guards::IssueGuards;

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
    /// The audit writer could not take the record now (reason code): the
    /// request is shed, nothing was issued.
    #[error("audit writer busy ({0})")]
    AuditShed(&'static str),
    /// Shed by admission before any signing work; retryable.
    #[error("{0}")]
    Shed(#[from] Shed),
    /// Bounded mTLS renewal refused (no live pod, stale or unsynced index).
    #[error("renewal denied: {0}")]
    Renewal(#[from] crate::renewal::RenewalError),
    /// The kill switch matched.
    #[error("denied: {0}")]
    Denied(#[from] crate::denylist::DenyHit),
    /// The client certificate's serial is revoked.
    #[error("client certificate serial {0} is revoked")]
    Revoked(String),
    /// The client certificate belongs to a revoked lineage: it descends
    /// from a revoked serial, or a revoked serial descends from the same
    /// leaf issued on a token ([`crate::revocation::lineage`]).
    #[error("client certificate serial {serial} belongs to revoked lineage {lineage}")]
    LineageRevoked { serial: String, lineage: String },
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
            Self::AuditShed(r) => r,
            Self::Shed(e) => e.reason.reason(),
            Self::Renewal(e) => e.reason(),
            Self::Denied(e) => e.reason(),
            Self::Revoked(_) => "mtls_cert_revoked",
            Self::LineageRevoked { .. } => "mtls_lineage_revoked",
        }
    }

    /// How istiod's metrics count this failure (a shed request is in no
    /// istiod error class: istiod has no admission).
    pub fn class(&self) -> Option<ErrorClass> {
        Some(match self {
            Self::Shed(_) | Self::AuditShed(_) => return None,
            Self::Unauthenticated(_) | Self::Impersonation(_) => ErrorClass::Authentication,
            Self::Renewal(_) | Self::Denied(_) | Self::Revoked(_) | Self::LineageRevoked { .. } => {
                ErrorClass::Authentication
            }
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
        })
    }
}

/// What the use case reports to: each request's outcome (istiod's
/// counters, latency, audit sheds, node refusals), the caller's cluster,
/// and denylist hits.
#[derive(Debug, Clone)]
pub struct IssueMetrics {
    pub outcomes: Arc<dyn OutcomeObserver>,
    pub clusters: Arc<ClusterMetrics>,
    pub kill_switch: Arc<KillSwitchMetrics>,
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
    pub metrics: Option<IssueMetrics>,
    /// Admission in front of signing; `None` admits everything at once.
    pub admission: Option<Arc<Admission>>,
    /// Bounded renewal, denylist and revocation checks: the kill switch
    /// for a stolen node or leaked key.
    pub guards: IssueGuards,
}

/// When a request arrived and how long its caller waits (`grpc-timeout`).
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub arrived: Instant,
    pub timeout: Option<Duration>,
}

impl Timing {
    /// Arrived now, no deadline.
    pub fn now() -> Self {
        Self {
            arrived: Instant::now(),
            timeout: None,
        }
    }
}

impl CertificateIssuer {
    /// Handles one request; emits exactly one audit record whatever happens.
    pub async fn issue(
        &self,
        creds: &Credentials,
        req: Result<IssueRequest, RequestError>,
    ) -> Result<Vec<String>, IssueError> {
        self.issue_within(creds, req, Timing::now()).await
    }

    /// [`Self::issue`] for a caller that waits as long as `timing` says:
    /// no signing starts once that is too late.
    pub async fn issue_within(
        &self,
        creds: &Credentials,
        req: Result<IssueRequest, RequestError>,
        timing: Timing,
    ) -> Result<Vec<String>, IssueError> {
        let mut audit = AuditGuard::new(
            self.audit.clone(),
            self.metrics.as_ref().map(|m| m.outcomes.clone()),
            creds.peer_addr,
        );
        // The claimed cluster until authentication names the verified one.
        audit.record().cluster_id = creds.cluster_id.clone();
        let result = self.issue_inner(creds, req, timing, &mut audit).await;
        let cluster = self.metrics.as_ref().map(|m| {
            let r = audit.record();
            if r.cluster_id.as_deref().is_none_or(str::is_empty) {
                r.cluster_id = m.clusters.local().or(r.cluster_id.take());
            }
            (m.clone(), r.cluster_id.clone())
        });
        match &result {
            Ok(_) => audit.allow(),
            // A shed is counted by reason in metrics and audited below; a
            // log line each would cost more than the shed itself in a storm.
            Err(IssueError::Shed(shed)) => {
                audit.deny(shed.reason.reason(), None, shed.to_string());
            }
            Err(e) => {
                let detail = e.to_string();
                // The message may echo caller input: the log line is bounded like the record.
                let shown =
                    crate::audit::bounded::bounded(&detail, crate::audit::bounded::FIELD_MAX);
                tracing::warn!(request_id = audit.request_id(), reason = e.reason(), error = %shown, "certificate request denied");
                audit.deny(e.reason(), e.class(), detail);
            }
        }
        let result = match result {
            // The certificate leaves only once its record is acknowledged.
            Ok(chain) => match audit.finish_acked().await {
                Err(AuditRefusal::Write(e)) => Err(IssueError::Audit(e)),
                Err(AuditRefusal::Shed(r)) => Err(IssueError::AuditShed(r)),
                Ok(()) => Ok(chain),
            },
            // A shed's record is handed to the writer without waiting for
            // its acknowledgement (nothing leaves that it would vouch for,
            // and a storm of sheds must not wait on the writer).
            Err(e @ IssueError::Shed(_)) => {
                let _ = audit.finish();
                Err(e)
            }
            // Other refusals are answered once their record is written, as
            // before (callers and tests may read the log right after).
            Err(e) => {
                let _ = audit.finish_acked().await;
                Err(e)
            }
        };
        if let Some((m, cluster)) = cluster {
            let decision = match &result {
                Ok(_) => crate::audit::Decision::Allow,
                Err(_) => crate::audit::Decision::Deny,
            };
            m.clusters.count(cluster.as_deref(), decision);
        }
        result
    }

    async fn issue_inner(
        &self,
        creds: &Credentials,
        req: Result<IssueRequest, RequestError>,
        timing: Timing,
        audit: &mut AuditGuard,
    ) -> Result<Vec<String>, IssueError> {
        let admission = self.admission.as_deref();
        if let Some(a) = admission {
            // Cheap: no CSR parse, no TokenReview.
            let f = authn::familiarity(creds, self.tokens.as_deref());
            a.pre_auth(creds.peer_addr.map(|p| p.ip()), f)?;
        }
        let binding = self.guards.mtls_binding(creds, audit.record());
        let caller = authn::authenticate(creds, self.tokens.as_deref()).await?;
        let mtls_cluster = binding.transpose()?;
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
                if k.cluster_id.is_some() {
                    r.cluster_id = k.cluster_id.clone();
                }
            }
        }
        let signer = self.guards.token_signer(creds, &caller).await;
        let result = self
            .guards
            .deny_check(creds, &caller, signer.as_ref(), None, None);
        if let (Err(IssueError::Denied(hit)), Some(m)) = (&result, &self.metrics) {
            m.kill_switch
                .denylist_hits
                .get_or_create(&crate::metrics::ReasonLabels {
                    reason: hit.reason().into(),
                })
                .inc();
        }
        result?;
        if caller.method == authn::AuthnMethod::Mtls {
            self.guards.revocation_check(creds)?;
            let origin = self.guards.origin_node_check(creds);
            if let (Err(IssueError::Denied(hit)), Some(m)) = (&origin, &self.metrics) {
                m.kill_switch
                    .denylist_hits
                    .get_or_create(&crate::metrics::ReasonLabels {
                        reason: hit.reason().into(),
                    })
                    .inc();
            }
            origin?;
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
                // Cold start: wait (bounded) for the pod index's first list
                // rather than refuse every node proxy that arrives before it.
                if let Some((index, within)) = authz.unsynced_index(creds) {
                    index.wait_synced(within).await;
                }
                let (id, evidence) = authz.authorize(&caller, requested, creds)?;
                let r = audit.record();
                r.node = Some(evidence.node.clone());
                r.evidence = Some(evidence.pod.clone());
                id
            }
        };
        audit.record().requested_identity = Some(identity.to_string());
        // Second pass with what authorization found (requested identity, node).
        let node = audit.record().node.clone();
        let result = self.guards.deny_check(
            creds,
            &caller,
            signer.as_ref(),
            Some(&identity),
            node.as_deref(),
        );
        if let (Err(IssueError::Denied(hit)), Some(m)) = (&result, &self.metrics) {
            m.kill_switch
                .denylist_hits
                .get_or_create(&crate::metrics::ReasonLabels {
                    reason: hit.reason().into(),
                })
                .inc();
        }
        result?;
        // Bounded mTLS renewal: a certificate alone no longer renews itself
        // forever, and never for longer than the renewal cap.
        let mut validity_secs = req.validity_secs;
        if caller.method == authn::AuthnMethod::Mtls {
            let mut check = Vec::new();
            if req.impersonate.is_none() {
                if let Some(g) = &self.guards.renewal {
                    // Cold start: the same bounded wait for the index's first list.
                    if let Some((index, within)) = g.unsynced_index() {
                        index.wait_synced(within).await;
                    }
                    check.push(g.check_in(&identity, mtls_cluster.as_deref())?.as_str());
                }
            }
            if let Some(g) = &self.guards.renewal {
                let (secs, capped) =
                    crate::renewal::capped_ttl(validity_secs, &self.ttl, g.policy.max_ttl);
                validity_secs = secs;
                if capped {
                    check.push("capped");
                }
            }
            if !check.is_empty() {
                audit.record().renewal_check = Some(check.join(","));
            }
        }

        // Admission: the identity cap, then a fair turn on a signing thread
        // for the CPU-heavy work.
        let admitting = admission.map(|a| (a, crate::admission::decide::caller_key(&caller)));
        let ticket = match &admitting {
            Some((a, _)) => Some(a.take_identity(&identity)?),
            None => None,
        };

        // One snapshot for the whole signing step: a reload cannot mix material.
        let bundle = self.ca.snapshot();
        let gate = SignGate {
            deadline: admission
                .and(timing.timeout)
                .and_then(|t| timing.arrived.checked_add(t)),
        };
        let issued_for = mtls_cluster
            .as_deref()
            .or(caller.kube.as_ref().and_then(|k| k.cluster_id.as_deref()));
        // Over mTLS the new leaf continues its caller's lineage.
        let parent = match (caller.method, creds.leaf()) {
            (authn::AuthnMethod::Mtls, Some(Ok(l))) => Some(l.serial_hex.clone()),
            _ => None,
        };
        let node = audit.record().node.clone();
        let job = SignJob {
            mark: self
                .guards
                .leaf_mark(issued_for, parent.as_deref(), node.as_deref())?,
            csr_pem: req.csr,
            validity_secs,
            identity,
            csr_policy: self.csr_policy,
            ttl: self.ttl,
            bundle: bundle.clone(),
            gate,
        };
        // With admission, the job runs on one of its signing threads at the
        // caller's fair turn (admission::queue): the async workers stay free
        // to read, classify and shed the next requests. A caller that
        // cancels while its job waits leaves the queue unsigned; once the
        // job runs it finishes, and a certificate its caller no longer waits
        // for is audited `request_abandoned`.
        let mut out = match &admitting {
            Some((a, key)) => {
                let start_by = a.start_by(timing.arrived, timing.timeout);
                a.run(key, timing.arrived, start_by, move || job.run())
                    .await?
            }
            None => job.run(),
        };
        if let (Some(a), Err(IssueError::Shed(s))) = (admission, &out.result) {
            // Withheld right before signing: counted with its pushback.
            out.result = Err(a.shed_now(s.reason).into());
        }
        {
            // What was asked for, before the policy judges it (bounded when
            // the record is finalized).
            let r = audit.record();
            r.csr_sha256 = out.csr_sha256;
            r.csr_sans = out.csr_sans;
        }
        let signed = out.result?;
        // Durable before the leaf leaves (rotation gates read it); rare
        // small write, so it stays on this task.
        self.ca.record_issued(signed.not_after)?;
        let r = audit.record();
        r.lifetime = Some(signed.choice);
        r.serial = Some(signed.serial_hex);
        r.spki_sha256 = Some(signed.spki_sha256);
        r.not_before = Some(signed.not_before);
        r.not_after = Some(signed.not_after);
        r.issuer_key_id = Some(bundle.key_id().to_string());
        r.signer = Some(bundle.signer().kind().to_string());
        if let Some(a) = admission {
            // Signing overran the caller's deadline despite the margin: the
            // certificate is withheld and recorded as a deny, so no allow is
            // audited for a caller that has given up.
            if let Some(timeout) = timing.timeout {
                if timing.arrived.elapsed() >= timeout {
                    return Err(a
                        .shed_now(crate::admission::ShedReason::DeadlineExceeded)
                        .into());
                }
            }
        }
        if let Some(t) = ticket {
            t.commit();
        }
        Ok(signed.chain)
    }
}

/// The last check before a signature: a caller past its deadline (it gave
/// up while its CSR was verified) gets nothing signed.
#[derive(Debug, Clone)]
struct SignGate {
    /// Arrival + `grpc-timeout` (admission only).
    deadline: Option<Instant>,
}

impl SignGate {
    fn check(&self, now: Instant) -> Result<(), ShedReason> {
        match self.deadline.is_some_and(|d| now >= d) {
            true => Err(ShedReason::DeadlineBeforeSign),
            false => Ok(()),
        }
    }
}

/// The CPU-heavy step: CSR parse and verify, policy, lifetime, signature.
struct SignJob {
    csr_pem: String,
    validity_secs: i64,
    identity: crate::identity::SpiffeId,
    csr_policy: CsrPolicy,
    ttl: TtlPolicy,
    bundle: Arc<crate::ca::CaBundle>,
    gate: SignGate,
    /// The serial's cluster and lineage mark.
    mark: crate::ca::serial::LeafMark,
}

/// What the signing step learned for the audit record, and its result.
struct SignOutcome {
    csr_sha256: Option<String>,
    csr_sans: Option<Vec<String>>,
    result: Result<Signed, IssueError>,
}

struct Signed {
    choice: ttl::LifetimeChoice,
    serial_hex: String,
    spki_sha256: String,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
    chain: Vec<String>,
}

impl SignJob {
    fn run(self) -> SignOutcome {
        let csr = match csr::parse_and_verify(&self.csr_pem) {
            Ok(c) => c,
            Err(e) => {
                return SignOutcome {
                    csr_sha256: None,
                    csr_sans: None,
                    result: Err(e.into()),
                }
            }
        };
        let csr_sha256 = Some(hex::encode(csr.sha256));
        let csr_sans = Some(
            csr.sans
                .iter()
                .map(|s| match s {
                    csr::San::Uri(u) | csr::San::Other(u) => u.clone(),
                })
                .collect(),
        );
        SignOutcome {
            csr_sha256,
            csr_sans,
            result: self.sign(&csr),
        }
    }

    fn sign(&self, csr: &csr::VerifiedCsr) -> Result<Signed, IssueError> {
        csr::check_policy(csr, &self.identity, self.csr_policy)?;
        self.gate.check(Instant::now()).map_err(|reason| Shed {
            reason,
            retry_after: Duration::ZERO,
        })?;
        let ttl::Grant { validity, choice } = ttl::grant(
            OffsetDateTime::now_utc(),
            self.validity_secs,
            &self.ttl,
            self.bundle.leaf_not_after_limit(),
            ttl::random_draw(),
        )?;
        let leaf = self.bundle.sign_leaf_for(
            &csr.spki_der,
            &self.identity,
            csr.has_common_name,
            &validity,
            Some(self.mark),
        )?;
        Ok(Signed {
            choice,
            spki_sha256: hex::encode(crate::primitives::sha256(&csr.spki_der)),
            not_before: leaf.not_before,
            not_after: leaf.not_after,
            chain: self.bundle.response_chain(&leaf.pem),
            serial_hex: leaf.serial_hex,
        })
    }
}

#[cfg(test)]
mod token_key_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::{Decision, MemorySink};
    use crate::authn::Caller;
    use crate::authz::Evidence;
    use crate::ca::generate::KeyType;
    use crate::identity::{IdentityError, SpiffeId};
    use crate::testing::{client_identity, csr_for, mtls_credentials, validity_hours, TestPki};

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
            CallerPodDeleted("a/b".into()),
            CallerPodAmbiguous("10.0.0.1".into()),
            CallerPodUnscheduled("a/b".into()),
            NoPodOnNode("a/b".into(), "n".into()),
            IndexStale("disconnected".into()),
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
        let creds = mtls_credentials(&chain);
        let requested = "spiffe://cluster.local/ns/app/sa/app";
        let csr = csr_for(&rcgen::KeyPair::generate().unwrap(), requested);
        let mut reasons = std::collections::BTreeSet::new();
        for denial in every_denial() {
            let sink = Arc::new(MemorySink::default());
            let metrics = Arc::new(crate::telemetry::Metrics::new());
            let issuer = CertificateIssuer {
                ca: ca.clone(),
                ttl: TtlPolicy::default(),
                csr_policy: CsrPolicy::Strict,
                tokens: None,
                node_authz: Some(Arc::new(Fixed(denial.clone()))),
                audit: sink.clone(),
                metrics: Some(metrics.issue_metrics()),
                admission: None,
                guards: Default::default(),
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
            admission: None,
            guards: Default::default(),
        };
        let other = "spiffe://cluster.local/ns/x/sa/y";
        let req = IssueRequest {
            csr: csr_for(&rcgen::KeyPair::generate().unwrap(), other),
            validity_secs: 0,
            impersonate: None,
        };
        let err = issuer
            .issue(&mtls_credentials(&chain), Ok(req))
            .await
            .unwrap_err();
        assert_eq!(err.reason(), "csr_san_not_authorized");
        let r = &sink.records()[0];
        assert_eq!(r.csr_sans.as_deref(), Some(&[other.to_string()][..]));
        // A refusal names the certificate presented, as an issuance does.
        let presented =
            crate::authn::mtls::leaf_of(&mtls_credentials(&chain).peer_chain.unwrap()[0], None)
                .unwrap()
                .serial_hex;
        assert_eq!(r.presented_serial.as_deref(), Some(presented.as_str()));
        let q = |id: &str| crate::audit::query::Query {
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

    /// A token authenticator that accepts any token as this caller.
    #[derive(Debug)]
    struct TokenAs(Caller);

    #[tonic::async_trait]
    impl crate::authn::TokenAuthenticator for TokenAs {
        async fn authenticate(
            &self,
            _: &str,
            _: Option<&str>,
        ) -> Result<Caller, crate::authn::AuthnError> {
            Ok(self.0.clone())
        }
    }

    /// A token caller verified through `method`, bound to pod `ns/pod`
    /// (uid `uid`) of service account `ns/sa` on `node`.
    fn token_caller(
        method: crate::authn::AuthnMethod,
        (ns, sa): (&str, &str),
        (pod, uid): (&str, &str),
        node: &str,
    ) -> Caller {
        Caller {
            method,
            identity: format!("spiffe://cluster.local/ns/{ns}/sa/{sa}")
                .parse()
                .unwrap(),
            kube: Some(crate::authn::KubernetesInfo {
                pod_namespace: ns.into(),
                pod_name: pod.into(),
                pod_uid: uid.into(),
                service_account: sa.into(),
                node_name: Some(node.into()),
                cluster_id: None,
            }),
        }
    }

    /// A node proxy authenticated by token, bound to pod ztunnel-a on zt-node.
    fn ztunnel_token() -> TokenAs {
        TokenAs(token_caller(
            crate::authn::AuthnMethod::TokenReview,
            ("istio-system", "ztunnel"),
            ("ztunnel-a", "zt-uid"),
            "zt-node",
        ))
    }

    /// A caller authenticated by token through `method`, bound to pod
    /// app/app-0 (uid u1) on node n1.
    fn app_token(method: crate::authn::AuthnMethod) -> TokenAs {
        TokenAs(token_caller(method, ("app", "app"), ("app-0", "u1"), "n1"))
    }

    /// Every denylist entry kind against every authentication method: each
    /// entry that can name something about the caller refuses it, whichever
    /// path verified the caller. A certificate names no pod, node or token,
    /// so only identity and service account entries reach an mTLS caller
    /// (its certificate's serial is revoked with `meshca revoke`).
    #[tokio::test]
    async fn every_denylist_kind_applies_to_every_authentication_method() {
        use crate::authn::AuthnMethod;
        let pki = TestPki::new(KeyType::EcdsaP256);
        let ca = Arc::new(crate::ca::CaStore::from_dir(pki.path(), false).unwrap());
        let me = "spiffe://cluster.local/ns/app/sa/app";
        let (chain, _) = client_identity(&ca.snapshot(), me, &validity_hours(-1, 1));
        // A JWT-shaped token whose header names kid K1 (the fake verifies anything).
        let token = "eyJhbGciOiJSUzI1NiIsImtpZCI6IksxIn0.e30.c2ln";
        assert_eq!(crate::denylist::token_key_id(token).as_deref(), Some("K1"));
        let entries = [
            (
                "identity spiffe://cluster.local/ns/app/sa/app",
                "denylist_identity",
            ),
            ("node n1", "denylist_node"),
            ("pod app/app-0", "denylist_pod"),
            ("pod-uid u1", "denylist_pod"),
            ("serviceaccount app/app", "denylist_service_account"),
            ("token-key K1", "denylist_token_key"),
        ];
        assert_eq!(entries.len(), crate::denylist::KINDS.len());
        let token_methods = [
            AuthnMethod::TokenReview,
            AuthnMethod::TokenLocal,
            AuthnMethod::TokenReviewAfterLocal("token_local_pod_not_indexed"),
        ];
        let mtls_applies = ["denylist_identity", "denylist_service_account"];
        let mut checked = 0;
        for (entry, reason) in entries {
            let list = Arc::new(crate::denylist::LiveDenylist::new());
            list.set(
                crate::denylist::Source::File,
                crate::denylist::Denylist::parse(entry).unwrap(),
            );
            let issuer =
                |tokens: Option<Arc<dyn crate::authn::TokenAuthenticator>>| CertificateIssuer {
                    ca: ca.clone(),
                    ttl: TtlPolicy::default(),
                    csr_policy: CsrPolicy::Strict,
                    tokens,
                    node_authz: None,
                    audit: Arc::new(MemorySink::default()),
                    metrics: None,
                    admission: None,
                    guards: IssueGuards {
                        denylist: Some(list.clone()),
                        ..Default::default()
                    },
                };
            let req = || IssueRequest {
                csr: csr_for(&rcgen::KeyPair::generate().unwrap(), me),
                validity_secs: 0,
                impersonate: None,
            };
            let run = |i: CertificateIssuer, creds: Credentials| async move {
                i.issue(&creds, Ok(req()))
                    .await
                    .map(|_| ())
                    .map_err(|e| e.reason())
            };
            for m in token_methods {
                let creds = Credentials {
                    bearer: Some(token.into()),
                    ..Default::default()
                };
                let got = run(issuer(Some(Arc::new(app_token(m)))), creds).await;
                assert_eq!(got, Err(reason), "{entry} x {m:?}");
                checked += 1;
            }
            let got = run(issuer(None), mtls_credentials(&chain)).await;
            let want = if mtls_applies.contains(&reason) {
                Err(reason)
            } else {
                Ok(())
            };
            assert_eq!(got, want, "{entry} x mtls");
            // A token beside the certificate is still checked for its key.
            let mut both = mtls_credentials(&chain);
            both.bearer = Some(token.into());
            let got = run(issuer(None), both).await;
            let want = if mtls_applies.contains(&reason) || reason == "denylist_token_key" {
                Err(reason)
            } else {
                Ok(())
            };
            assert_eq!(got, want, "{entry} x mtls with a token");
            checked += 2;
        }
        assert_eq!(checked, 6 * 5);
    }

    /// Cold start: a node proxy asking before the pod index's first list
    /// waits for it (MESHCA_POD_INDEX_SYNC_WAIT) and is served, instead of
    /// `impersonation_index_not_ready` (retried by ztunnel only after ~1 s,
    /// doubling). With the wait at 0 the old refusal stands.
    #[tokio::test]
    async fn impersonation_before_the_first_index_sync_waits_for_it() {
        use crate::podindex::{pod, IndexEvent, Phase, PodIndex};
        let pki = TestPki::new(KeyType::EcdsaP256);
        let ca = Arc::new(crate::ca::CaStore::from_dir(pki.path(), false).unwrap());
        let requested = "spiffe://cluster.local/ns/app/sa/app";
        let csr = csr_for(&rcgen::KeyPair::generate().unwrap(), requested);
        let creds = Credentials {
            bearer: Some("token".into()),
            cluster_id: Some("Kubernetes".into()),
            ..Default::default()
        };
        for (wait_ms, want) in [(5_000, Ok(())), (0, Err("impersonation_index_not_ready"))] {
            let index = Arc::new(PodIndex::new());
            let authz = crate::authz::KubeNodeAuthorizer {
                policy: crate::authz::NodePolicy {
                    trusted: crate::config::parse_service_accounts("istio-system/ztunnel")
                        .unwrap()
                        .into_iter()
                        .collect(),
                    trust_domains: vec![crate::identity::TrustDomain::new("cluster.local").unwrap()],
                    cluster_id: "Kubernetes".into(),
                    mtls_impersonation: false,
                },
                index: index.clone(),
                max_index_staleness: Duration::from_secs(60),
                sync_wait: Duration::from_millis(wait_ms),
            };
            let sink = Arc::new(MemorySink::default());
            let issuer = CertificateIssuer {
                ca: ca.clone(),
                ttl: TtlPolicy::default(),
                csr_policy: CsrPolicy::Strict,
                tokens: Some(Arc::new(ztunnel_token())),
                node_authz: Some(Arc::new(authz)),
                audit: sink.clone(),
                metrics: None,
                admission: None,
                guards: Default::default(),
            };
            // The first list lands 100 ms after the request.
            let lister = {
                let index = index.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    index.apply(IndexEvent::Init);
                    for p in [
                        pod(
                            "istio-system",
                            "ztunnel-a",
                            "zt-uid",
                            Some("zt-node"),
                            "ztunnel",
                            Phase::Running,
                        ),
                        pod("app", "app-1", "a1", Some("zt-node"), "app", Phase::Running),
                    ] {
                        index.apply(IndexEvent::InitApply(p));
                    }
                    index.apply(IndexEvent::InitDone);
                })
            };
            let req = IssueRequest {
                csr: csr.clone(),
                validity_secs: 0,
                impersonate: Some(requested.into()),
            };
            let got = issuer
                .issue(&creds, Ok(req))
                .await
                .map(|_| ())
                .map_err(|e| e.reason());
            assert_eq!(got, want, "wait {wait_ms} ms");
            lister.await.unwrap();
            assert_eq!(sink.records().len(), 1);
        }
    }

    #[tokio::test]
    async fn no_certificate_without_its_audit_record() {
        let pki = TestPki::new(KeyType::EcdsaP256);
        let ca = Arc::new(crate::ca::CaStore::from_dir(pki.path(), false).unwrap());
        let id = "spiffe://cluster.local/ns/app/sa/app";
        let (chain, _) = client_identity(&ca.snapshot(), id, &validity_hours(-1, 1));
        let creds = mtls_credentials(&chain);
        let issuer = CertificateIssuer {
            ca,
            ttl: TtlPolicy::default(),
            csr_policy: CsrPolicy::Strict,
            tokens: None,
            node_authz: None,
            audit: Arc::new(FullDisk),
            metrics: None,
            admission: None,
            guards: Default::default(),
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

    /// The last check before a signature, on a real CSR and CA: a caller
    /// past its deadline gets nothing signed, with its reason.
    #[test]
    fn nothing_is_signed_past_the_deadline() {
        let pki = TestPki::new(KeyType::EcdsaP256);
        let ca = crate::ca::CaStore::from_dir(pki.path(), false).unwrap();
        let id = "spiffe://cluster.local/ns/app/sa/app";
        let csr = csr_for(&rcgen::KeyPair::generate().unwrap(), id);
        let now = Instant::now();
        let later = now.checked_add(Duration::from_secs(60));
        let cases: [(Option<Instant>, Option<ShedReason>); 3] = [
            (None, None),
            (later, None),
            (Some(now), Some(ShedReason::DeadlineBeforeSign)),
        ];
        for (deadline, want) in cases {
            let out = SignJob {
                csr_pem: csr.clone(),
                validity_secs: 0,
                identity: id.parse().unwrap(),
                csr_policy: CsrPolicy::Strict,
                ttl: TtlPolicy::default(),
                bundle: ca.snapshot(),
                gate: SignGate { deadline },
                mark: crate::ca::serial::LeafMark::Cluster(crate::ca::serial::ClusterTag::of("c")),
            }
            .run();
            // The CSR was verified in every case (the check comes after).
            assert!(out.csr_sha256.is_some());
            match (out.result, want) {
                (Ok(signed), None) => assert!(signed.chain.len() >= 2, "leaf and roots"),
                (Err(IssueError::Shed(s)), Some(reason)) => assert_eq!(s.reason, reason),
                (other, want) => panic!("{deadline:?}: {:?}, want {want:?}", other.err()),
            }
        }
    }
}
