//! The serving side of TLS: a serving certificate issued by meshca's own CA,
//! and a client verifier over the current roots, both rebuilt on CA reload.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rcgen::{
    CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::ServerConfig;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use time::OffsetDateTime;

use crate::authn::mtls::SpiffeClientVerifier;
use crate::ca::{CaBundle, CaStore};
use crate::identity::TrustDomain;

/// Lifetime of the serving certificate; it is re-issued at half-life.
const SERVING_TTL: Duration = Duration::from_secs(24 * 3600);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("issuing the serving certificate: {0}")]
    Issue(#[from] rcgen::Error),
    #[error("building the TLS config: {0}")]
    Rustls(#[from] rustls::Error),
    /// Fail closed: no serving certificate is used without its audit record.
    #[error("serving certificate audit record not written: {0}")]
    Audit(String),
}

/// The current server TLS config; each new connection takes the latest.
pub struct ServingTls {
    config: ArcSwap<ServerConfig>,
    names: Vec<String>,
    trust_domains: Vec<TrustDomain>,
    /// Where each serving certificate is recorded.
    audit: Option<Arc<dyn crate::audit::AuditSink>>,
}

impl std::fmt::Debug for ServingTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingTls")
            .field("names", &self.names)
            .finish_non_exhaustive()
    }
}

impl ServingTls {
    pub fn new(
        bundle: &CaBundle,
        names: Vec<String>,
        trust_domains: Vec<TrustDomain>,
    ) -> Result<Self, TlsError> {
        Self::new_audited(bundle, names, trust_domains, None)
    }

    /// [`Self::new`], writing every serving certificate to `audit`.
    pub fn new_audited(
        bundle: &CaBundle,
        names: Vec<String>,
        trust_domains: Vec<TrustDomain>,
        audit: Option<Arc<dyn crate::audit::AuditSink>>,
    ) -> Result<Self, TlsError> {
        let config = build(bundle, &names, &trust_domains, audit.as_deref())?;
        Ok(Self {
            config: ArcSwap::from_pointee(config),
            names,
            trust_domains,
            audit,
        })
    }

    pub fn current(&self) -> Arc<ServerConfig> {
        self.config.load_full()
    }

    pub fn rebuild(&self, bundle: &CaBundle) -> Result<(), TlsError> {
        self.config.store(Arc::new(build(
            bundle,
            &self.names,
            &self.trust_domains,
            self.audit.as_deref(),
        )?));
        Ok(())
    }

    /// Rebuilds on every CA swap and re-issues the serving cert at half-life.
    pub async fn follow(self: Arc<Self>, store: Arc<CaStore>) {
        let mut generations = store.subscribe();
        loop {
            tokio::select! {
                changed = generations.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(SERVING_TTL / 2) => {}
            }
            if let Err(e) = self.rebuild(&store.snapshot()) {
                tracing::error!(error = %e, "could not rebuild the serving TLS config; keeping the previous one");
            }
        }
    }
}

fn build(
    bundle: &CaBundle,
    names: &[String],
    tds: &[TrustDomain],
    audit: Option<&dyn crate::audit::AuditSink>,
) -> Result<ServerConfig, TlsError> {
    let (chain, key) = serving_cert(bundle, names)?;
    if let Some(audit) = audit {
        audit
            .emit(&serving_record(bundle, names, &chain[0]))
            .map_err(|e| TlsError::Audit(e.to_string()))?;
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let verifier = SpiffeClientVerifier::for_bundle(bundle, tds.to_vec(), provider.clone())?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_client_cert_verifier(Arc::new(verifier))
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    // No session resumption (TLS 1.2 session ids or TLS 1.3 tickets): a
    // resumed session brings back the peer chain verified at the first
    // handshake, so it could outlive the client certificate or a revocation.
    // Every connection is a full handshake with a fresh verification; CA
    // clients keep long-lived connections, so the cost is one handshake per
    // connection.
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    config.ticketer = Arc::new(NoTickets);
    Ok(config)
}

/// A ticketer that never issues tickets (rustls' default is the same, but
/// the choice must not depend on a default).
#[derive(Debug)]
struct NoTickets;

impl rustls::server::ProducesTickets for NoTickets {
    fn enabled(&self) -> bool {
        false
    }
    fn lifetime(&self) -> u32 {
        0
    }
    fn encrypt(&self, _: &[u8]) -> Option<Vec<u8>> {
        None
    }
    fn decrypt(&self, _: &[u8]) -> Option<Vec<u8>> {
        None
    }
}

/// Issues a serving certificate for `names` (DNS names or IP addresses).
pub fn serving_cert(
    bundle: &CaBundle,
    names: &[String],
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), rcgen::Error> {
    let key = KeyPair::generate()?;
    let now = OffsetDateTime::now_utc();
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, "meshca");
    params.subject_alt_names = names
        .iter()
        .map(|n| match n.parse::<IpAddr>() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => n.clone().try_into().map(SanType::DnsName),
        })
        .collect::<Result<_, _>>()?;
    params.not_before = now - time::Duration::minutes(2);
    params.not_after = (now + SERVING_TTL).min(bundle.leaf_not_after_limit());
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    let cert = params.signed_by(&key, bundle.issuer())?;
    let mut chain = vec![cert.der().clone()];
    chain.extend(bundle.intermediates().iter().cloned());
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    Ok((chain, key))
}

/// The audit record of a serving certificate.
pub fn serving_record(
    bundle: &CaBundle,
    names: &[String],
    cert: &CertificateDer<'_>,
) -> crate::audit::AuditRecord {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let parsed = X509Certificate::from_der(cert).ok();
    let mut r = crate::ca::minted_record(
        crate::ca::MintedKind::Serving,
        OffsetDateTime::now_utc(),
        bundle,
        parsed.as_ref().map(|(_, c)| c),
        crate::primitives::pem_encode("CERTIFICATE", cert),
    );
    r.detail = Some(format!("serving names {}", names.join(",")));
    r.bound();
    r
}
