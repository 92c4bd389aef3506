//! mTLS callers: the client-certificate verifier used in the handshake and
//! identity extraction from a verified certificate.

use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme,
};
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::identity::{IdentityError, SpiffeId, TrustDomain};

/// Why a client certificate is not an acceptable workload identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MtlsError {
    #[error("certificate does not parse")]
    Malformed,
    #[error("certificate has {0} URI SANs; exactly one SPIFFE URI is required")]
    UriSanCount(usize),
    #[error("URI SAN is not a SPIFFE workload id: {0}")]
    NotSpiffe(IdentityError),
    #[error("trust domain {0} is not the mesh trust domain")]
    ForeignTrustDomain(String),
    /// Checked per request: a connection may outlive the handshake's check.
    #[error("client certificate expired at unix time {0}")]
    Expired(i64),
    /// A URI name constraint on the signing path does not permit it.
    #[error("identity {0} is outside the URI name constraints of the signing path")]
    OutsideNameConstraints(String),
}

impl MtlsError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Malformed => "mtls_malformed_cert",
            Self::UriSanCount(_) => "mtls_uri_san_count",
            Self::NotSpiffe(_) => "mtls_not_spiffe",
            Self::ForeignTrustDomain(_) => "mtls_foreign_trust_domain",
            Self::Expired(_) => "mtls_cert_expired",
            Self::OutsideNameConstraints(_) => "mtls_outside_name_constraints",
        }
    }
}

/// What a request needs from its client certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leaf {
    pub identity: SpiffeId,
    /// `notAfter`, unix seconds.
    pub not_after: i64,
    /// Serial number as the audit log writes it ([`crate::ca::serial_hex`]).
    pub serial_hex: String,
}

/// [`identity_of`] plus the certificate's expiry and serial, from one parse.
pub fn leaf_of(
    cert: &CertificateDer<'_>,
    trust_domains: Option<&[TrustDomain]>,
) -> Result<Leaf, MtlsError> {
    let (_, parsed) = X509Certificate::from_der(cert).map_err(|_| MtlsError::Malformed)?;
    Ok(Leaf {
        identity: identity_of_parsed(&parsed, trust_domains)?,
        not_after: parsed.validity().not_after.timestamp(),
        serial_hex: crate::ca::serial_hex(parsed.raw_serial()),
    })
}

/// The SPIFFE identity of a client certificate: exactly one URI SAN, a
/// workload id, and (if `trust_domains` is given) in one of those domains.
pub fn identity_of(
    cert: &CertificateDer<'_>,
    trust_domains: Option<&[TrustDomain]>,
) -> Result<SpiffeId, MtlsError> {
    let (_, parsed) = X509Certificate::from_der(cert).map_err(|_| MtlsError::Malformed)?;
    identity_of_parsed(&parsed, trust_domains)
}

fn identity_of_parsed(
    parsed: &X509Certificate<'_>,
    trust_domains: Option<&[TrustDomain]>,
) -> Result<SpiffeId, MtlsError> {
    let uris: Vec<&str> = match parsed.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                GeneralName::URI(u) => Some(*u),
                _ => None,
            })
            .collect(),
        Ok(None) => Vec::new(),
        Err(_) => return Err(MtlsError::Malformed),
    };
    let [uri] = uris.as_slice() else {
        return Err(MtlsError::UriSanCount(uris.len()));
    };
    let id: SpiffeId = uri.parse().map_err(MtlsError::NotSpiffe)?;
    if let Some(tds) = trust_domains {
        if !tds.contains(id.trust_domain()) {
            return Err(MtlsError::ForeignTrustDomain(id.trust_domain().to_string()));
        }
    }
    Ok(id)
}

/// "Verify if given": a client may connect without a certificate (token
/// callers), but a presented certificate must chain to the mesh roots and be
/// a SPIFFE identity of the mesh trust domain, or the handshake fails.
#[derive(Debug)]
pub struct SpiffeClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    trust_domains: Vec<TrustDomain>,
    /// Checked here: webpki rejects every URI SAN under a URI constraint.
    uri_constraints: Vec<crate::ca::constraints::UriConstraints>,
}

impl SpiffeClientVerifier {
    pub fn new(
        roots: &[CertificateDer<'static>],
        trust_domains: Vec<TrustDomain>,
        provider: Arc<rustls::crypto::CryptoProvider>,
    ) -> Result<Self, rustls::Error> {
        let mut store = RootCertStore::empty();
        for root in roots {
            store.add(root.clone())?;
        }
        Self::from_store(store, trust_domains, Vec::new(), provider)
    }

    /// The verifier for callers holding `bundle`'s leaves. When its signing
    /// path carries URI name constraints, webpki (which cannot evaluate
    /// them) would refuse every caller: the signing certificate, verified
    /// at load to chain to a root, then also serves as an anchor without
    /// constraints, and the constraints are enforced here instead.
    pub fn for_bundle(
        bundle: &crate::ca::CaBundle,
        trust_domains: Vec<TrustDomain>,
        provider: Arc<rustls::crypto::CryptoProvider>,
    ) -> Result<Self, rustls::Error> {
        let mut store = RootCertStore::empty();
        for root in bundle.roots() {
            store.add(root.clone())?;
        }
        let constraints = bundle.uri_constraints().to_vec();
        if !constraints.is_empty() {
            let mut anchor = webpki::anchor_from_trusted_cert(bundle.signing_cert())
                .map_err(|e| rustls::Error::General(format!("signing certificate: {e:?}")))?
                .to_owned();
            anchor.name_constraints = None;
            store.roots.push(anchor);
        }
        Self::from_store(store, trust_domains, constraints, provider)
    }

    fn from_store(
        store: RootCertStore,
        trust_domains: Vec<TrustDomain>,
        uri_constraints: Vec<crate::ca::constraints::UriConstraints>,
        provider: Arc<rustls::crypto::CryptoProvider>,
    ) -> Result<Self, rustls::Error> {
        let inner = WebPkiClientVerifier::builder_with_provider(Arc::new(store), provider)
            .allow_unauthenticated()
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        Ok(Self {
            inner,
            trust_domains,
            uri_constraints,
        })
    }
}

impl ClientCertVerifier for SpiffeClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        identity_of(end_entity, Some(&self.trust_domains))
            .and_then(|id| {
                let uri = id.to_string();
                match self.uri_constraints.iter().all(|c| c.allows(&uri)) {
                    true => Ok(id),
                    false => Err(MtlsError::OutsideNameConstraints(uri)),
                }
            })
            .map_err(|e| {
                tracing::warn!(reason = e.reason(), error = %e, "rejected client certificate");
                // Carried in the error so the transport can audit the precise reason.
                rustls::Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(
                    Arc::new(e),
                )))
            })?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}
