//! Two-tier issuing. The custody key (a token, or the key file) signs a
//! short-lived issuing CA whose key exists only in this process's memory,
//! and that key signs leaves and the serving certificate. The custody key
//! then signs once per issuing CA instead of once per leaf, so an HSM or
//! KMS rate limit does not cap issuance; a memory compromise exposes a key
//! that dies within one issuing-CA lifetime.
//!
//! A new issuing CA is made at half-life (and at once when the custody
//! material reloads). The previous one stays valid until its own end, so
//! leaves it signed keep verifying; requests in flight finish on the
//! snapshot they started with. Every issuing-CA certificate is an audit
//! record, written before the certificate is used.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use time::OffsetDateTime;
use tokio::time::Instant;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::bundle::{BundleFiles, CaBundle, MaterialError};
use super::signer::memory::MemorySigner;
use super::signer::{KeyAlgorithm, Signer, SignerError, SignerKey};
use super::store::CaStore;
use crate::audit::{AuditRecord, AuditSink};

/// Issuing CAs are backdated by this much, as leaves are (clock skew).
const BACKDATE: time::Duration = time::Duration::minutes(5);
/// Retry delays after a failed rollover (HSM down): the current issuing CA
/// keeps serving meanwhile.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);

/// Why an issuing CA could not be made.
#[derive(Debug, thiserror::Error)]
pub enum IssuingError {
    #[error("the signing certificate allows no CA below it (pathLenConstraint 0); two-tier issuing needs path length 1 or more (re-issue it, e.g. with `meshca init`, or set MESHCA_ISSUING_CA=off)")]
    PathLength,
    #[error("signing the issuing CA: {0}")]
    Signer(SignerError),
    #[error("issuing CA certificate: {0}")]
    Generation(String),
    #[error("issuing CA does not verify: {0}")]
    Material(#[from] MaterialError),
    #[error("issuing CA audit record not written: {0}")]
    Audit(String),
}

impl IssuingError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::PathLength => "issuing_ca_path_length",
            Self::Signer(e) => e.reason(),
            Self::Generation(_) => "issuing_ca_generation",
            Self::Material(e) => e.reason(),
            Self::Audit(_) => "issuing_ca_audit_failed",
        }
    }
}

/// A new issuing CA: the bundle leaves are signed with, and its audit record.
pub struct Minted {
    pub bundle: CaBundle,
    pub record: AuditRecord,
}

/// Makes an issuing CA under `custody`, valid for `ttl` (never past the
/// custody certificate), with a fresh in-memory ECDSA P-256 key.
pub fn mint(
    custody: &CaBundle,
    ttl: Duration,
    now: OffsetDateTime,
) -> Result<Minted, IssuingError> {
    let (_, parent) = X509Certificate::from_der(custody.signing_cert())
        .map_err(|e| IssuingError::Generation(e.to_string()))?;
    if let Ok(Some(bc)) = parent.basic_constraints() {
        if bc.value.path_len_constraint == Some(0) {
            return Err(IssuingError::PathLength);
        }
    }
    let org = parent
        .subject()
        .iter_organization()
        .next()
        .and_then(|o| o.as_str().ok())
        .unwrap_or("meshca")
        .to_string();
    let key: Arc<dyn Signer> =
        Arc::new(MemorySigner::generate(KeyAlgorithm::EcdsaP256).map_err(IssuingError::Signer)?);
    let not_after = (now + ttl).min(custody.signing_not_after());
    let gen = |e: rcgen::Error| IssuingError::Generation(e.to_string());
    let mut params = super::generate::ca_params(
        "meshca issuing CA",
        &org,
        now - BACKDATE,
        not_after,
        Some(0),
    )
    .map_err(gen)?;
    params.use_authority_key_identifier_extension = true;
    let cert = params
        .signed_by(&SignerKey(key.clone()), custody.issuer())
        .map_err(|e| match super::signer::signer_error(&e) {
            Some(s) => IssuingError::Signer(s),
            None => gen(e),
        })?;
    let pem = cert.pem();
    // [issuing CA, custody chain...]: the root bundle is the response's last element.
    let mut chain = custody.response_chain(&pem);
    chain.pop();
    let files = BundleFiles {
        signing_cert: pem.clone(),
        signing_key: String::new(),
        cert_chain: chain.concat(),
        root_bundle: custody.root_bundle().to_string(),
        source: format!("issuing CA under {}", custody.source()),
    };
    let bundle = CaBundle::from_files_with(files, Some(key.clone()), now)?;
    let (_, issued) = X509Certificate::from_der(bundle.signing_cert())
        .map_err(|e| IssuingError::Generation(e.to_string()))?;
    let mut r = super::minted_record(
        super::MintedKind::IssuingCa,
        now,
        custody,
        Some(&issued),
        pem,
    );
    r.detail = Some(format!(
        "issuing CA key {} signed by {}",
        bundle.key_id(),
        custody.signer().describe()
    ));
    Ok(Minted { bundle, record: r })
}

/// Writes `record` and waits for the writer to acknowledge it.
pub async fn audit_acked(audit: &dyn AuditSink, record: AuditRecord) -> Result<(), String> {
    match audit.submit(Box::new(record)) {
        Ok(crate::audit::Ack::Written) => Ok(()),
        Ok(crate::audit::Ack::Pending(rx)) => match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("audit writer stopped".into()),
        },
        Err(e) => Err(e.to_string()),
    }
}

/// [`audit_acked`] for a blocking thread (a rollover the rotation drives).
pub fn audit_acked_blocking(audit: &dyn AuditSink, record: AuditRecord) -> Result<(), String> {
    match audit.submit(Box::new(record)) {
        Ok(crate::audit::Ack::Written) => Ok(()),
        Ok(crate::audit::Ack::Pending(rx)) => match rx.blocking_recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("audit writer stopped".into()),
        },
        Err(e) => Err(e.to_string()),
    }
}

/// The running two-tier issuer: follows the custody store, and keeps the
/// store leaves are signed from (the issuing CA) current.
pub struct TwoTier {
    custody: Arc<CaStore>,
    issuing: Arc<CaStore>,
    ttl: Duration,
    audit: Arc<dyn AuditSink>,
    /// When the current issuing CA reaches half-life.
    due: Mutex<Instant>,
    /// Fingerprint of the custody bundle the current issuing CA was minted
    /// under. Held for a whole rollover (mint, audit, swap), so two never
    /// interleave: the issuing CA swapped in is always minted under the
    /// custody bundle current at the swap.
    minted_under: Mutex<[u8; 32]>,
    /// Issuing snapshots replaced so far that requests may still hold (a
    /// rotation waits for their leaves before reading its mark).
    replaced: Mutex<Vec<Weak<CaBundle>>>,
    metrics: Option<Arc<super::metrics::CaMetrics>>,
}

impl std::fmt::Debug for TwoTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TwoTier")
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

fn half_life(b: &CaBundle, now: OffsetDateTime) -> Instant {
    let left = (b.signing_not_after() - now).max(time::Duration::ZERO);
    Instant::now() + Duration::try_from(left / 2).unwrap_or_default()
}

fn poisoned() -> IssuingError {
    IssuingError::Generation("issuing CA lock poisoned".into())
}

impl TwoTier {
    /// Makes and audits the first issuing CA; fails startup if it cannot.
    pub async fn start(
        custody: Arc<CaStore>,
        ttl: Duration,
        audit: Arc<dyn AuditSink>,
        metrics: Option<Arc<super::metrics::CaMetrics>>,
    ) -> Result<Arc<Self>, IssuingError> {
        let now = OffsetDateTime::now_utc();
        let snapshot = custody.snapshot();
        let under = snapshot.fingerprint();
        let minted = tokio::task::spawn_blocking(move || mint(&snapshot, ttl, now))
            .await
            .map_err(|e| IssuingError::Generation(e.to_string()))??;
        audit_acked(audit.as_ref(), minted.record)
            .await
            .map_err(IssuingError::Audit)?;
        let due = half_life(&minted.bundle, now);
        tracing::info!(key_id = minted.bundle.key_id(), not_after = %minted.bundle.signing_not_after(), "issuing CA made");
        let issuing = Arc::new(CaStore::new(minted.bundle, None, true));
        // A replaced issuing CA's leaves stay valid until it expires: it
        // keeps signing their CRL (revocation::sign_crls).
        issuing.retain_retired_issuers();
        Ok(Arc::new(Self {
            custody,
            issuing,
            ttl,
            audit,
            due: Mutex::new(due),
            minted_under: Mutex::new(under),
            replaced: Mutex::new(Vec::new()),
            metrics,
        }))
    }

    /// The store leaves, the serving certificate and CRLs are signed from.
    pub fn store(&self) -> Arc<CaStore> {
        self.issuing.clone()
    }

    /// The store of the custody material the issuing CAs are minted under.
    pub fn custody(&self) -> &Arc<CaStore> {
        &self.custody
    }

    /// Mints under `custody` and writes the audit record, waiting for it
    /// (blocking): the certificate is used only once it is recorded.
    fn mint_audited(
        &self,
        custody: &CaBundle,
        now: OffsetDateTime,
    ) -> Result<CaBundle, IssuingError> {
        let minted = mint(custody, self.ttl, now)?;
        audit_acked_blocking(self.audit.as_ref(), minted.record).map_err(IssuingError::Audit)?;
        Ok(minted.bundle)
    }

    fn swap_issuing(&self, minted: CaBundle, now: OffsetDateTime) {
        if let Ok(mut due) = self.due.lock() {
            *due = half_life(&minted, now);
        }
        let old = self.issuing.snapshot();
        self.issuing.swap(minted);
        if let Ok(mut r) = self.replaced.lock() {
            r.retain(|w| w.strong_count() > 0);
            r.push(Arc::downgrade(&old));
        }
    }

    /// A new issuing CA under the current custody bundle (blocking). With
    /// `only_if_stale`, nothing when the current one already is under it
    /// (the rotation re-minted it together with its custody swap).
    pub(crate) fn roll(&self, only_if_stale: bool) -> Result<bool, IssuingError> {
        let mut under = self.minted_under.lock().map_err(|_| poisoned())?;
        let custody = self.custody.snapshot();
        if only_if_stale && *under == custody.fingerprint() {
            return Ok(false);
        }
        let now = OffsetDateTime::now_utc();
        let minted = self.mint_audited(&custody, now)?;
        *under = custody.fingerprint();
        self.swap_issuing(minted, now);
        Ok(true)
    }

    /// Installs a new custody bundle (a rotation phase, including one that
    /// only changes the roots) together with an issuing CA minted under it:
    /// once this returns no leaf is signed by an issuing CA of the previous
    /// custody bundle, and responses carry the new bundle's chain and roots.
    /// Blocking (mint, audit acknowledgement); nothing changes when the
    /// issuing CA cannot be made. Returns the replaced issuing snapshots
    /// requests may still hold.
    pub fn install_custody(&self, bundle: CaBundle) -> Result<Vec<Arc<CaBundle>>, IssuingError> {
        let mut under = self.minted_under.lock().map_err(|_| poisoned())?;
        let now = OffsetDateTime::now_utc();
        let minted = self.mint_audited(&bundle, now)?;
        *under = bundle.fingerprint();
        self.custody.swap(bundle);
        self.swap_issuing(minted, now);
        self.count("rolled");
        Ok(self
            .replaced
            .lock()
            .map(|r| r.iter().filter_map(Weak::upgrade).collect())
            .unwrap_or_default())
    }

    fn count(&self, result: &str) {
        if let Some(m) = &self.metrics {
            m.ca_reloads
                .get_or_create(&crate::metrics::ResultLabels {
                    result: format!("issuing_ca_{result}"),
                })
                .inc();
        }
    }

    /// Rolls over at half-life and on every custody reload (unless the
    /// rotation already did), retrying with backoff while the custody key
    /// cannot sign. Runs until dropped.
    pub async fn run(self: Arc<Self>) {
        let mut custody_changes = self.custody.subscribe();
        let mut retry = RETRY_MIN;
        loop {
            let due = self
                .due
                .lock()
                .map(|d| *d)
                .unwrap_or_else(|_| Instant::now());
            let only_if_stale = tokio::select! {
                changed = custody_changes.changed() => if changed.is_err() { return } else { true },
                _ = tokio::time::sleep_until(due) => false,
            };
            let me = self.clone();
            let result = tokio::task::spawn_blocking(move || me.roll(only_if_stale))
                .await
                .unwrap_or_else(|e| Err(IssuingError::Generation(e.to_string())));
            match result {
                Ok(rolled) => {
                    retry = RETRY_MIN;
                    if rolled {
                        self.count("rolled");
                    }
                }
                Err(e) => {
                    let left =
                        self.issuing.snapshot().signing_not_after() - OffsetDateTime::now_utc();
                    tracing::error!(reason = e.reason(), error = %e, current_left = %left, "could not make the next issuing CA; the current one keeps signing until it expires");
                    self.count(e.reason());
                    if let Ok(mut due) = self.due.lock() {
                        *due = Instant::now() + retry;
                    }
                    retry = (retry * 2).min(RETRY_MAX);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::generate::{generate, InitOptions};

    fn custody(now: OffsetDateTime) -> CaBundle {
        let ca = generate(&InitOptions::default(), now).unwrap();
        CaBundle::from_files(BundleFiles::generated(&ca, "test"), now).unwrap()
    }

    #[test]
    fn an_issuing_ca_signs_leaves_that_chain_through_it_to_the_root() {
        let now = OffsetDateTime::now_utc();
        let c = custody(now);
        let m = mint(&c, Duration::from_secs(3600), now).unwrap();
        let b = &m.bundle;
        assert_eq!(b.signer().kind(), "memory");
        assert_ne!(b.key_id(), c.key_id());
        assert_eq!(b.roots(), c.roots());
        assert!(b.signing_not_after() <= now + time::Duration::hours(1));
        let leaf = crate::testing::leaf(b, "spiffe://cluster.local/ns/a/sa/b", now);
        // Verified with the custody bundle's roots and the response chain's intermediates.
        let chain = b.response_chain(&leaf.pem);
        // The custody chain (intermediate, root) plus the issuing CA.
        assert_eq!(chain.len(), c.response_chain(&leaf.pem).len() + 1);
        assert_eq!(
            chain.len(),
            5,
            "leaf, issuing CA, intermediate, root, root bundle"
        );
        b.verify_leaf(&leaf.der, now).unwrap();
        let r = &m.record;
        assert_eq!(r.reason, "issuing_ca_issued");
        assert_eq!(r.issued_kind.as_deref(), Some("issuing_ca"));
        assert_eq!(r.issuer_key_id.as_deref(), Some(c.key_id()));
        assert_eq!(r.signer.as_deref(), Some("file"));
        assert_eq!(r.certificate.as_deref(), Some(chain[1].as_str()));
    }

    #[test]
    fn an_issuing_ca_never_outlives_the_custody_certificate() {
        let now = OffsetDateTime::now_utc();
        let c = custody(now);
        let m = mint(&c, crate::ca::custody::MAX_ISSUING_TTL * 1000, now).unwrap();
        assert_eq!(m.bundle.signing_not_after(), c.signing_not_after());
    }

    #[test]
    fn a_path_length_zero_intermediate_is_refused_with_a_reason() {
        let now = OffsetDateTime::now_utc();
        // An issuing CA is itself pathlen 0: nothing may be minted under it.
        let c = custody(now);
        let first = mint(&c, Duration::from_secs(3600), now).unwrap();
        let err = mint(&first.bundle, Duration::from_secs(3600), now)
            .err()
            .unwrap();
        assert_eq!(err.reason(), "issuing_ca_path_length");
    }
}
