//! CA key material: loading and verifying a bundle, and signing leaves with it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    CertificateParams, CustomExtension, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber, SubjectPublicKeyInfo,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, UnixTime};
use time::OffsetDateTime;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::chain::split_elements;
use super::csr::{sha256, KeyKind};
use super::signer::{Signer, SignerError, SignerKey};
use super::ttl::Validity;
use crate::identity::SpiffeId;

/// Istio `cacerts` file names.
pub const CACERTS_FILES: [&str; 4] = [
    "ca-cert.pem",
    "ca-key.pem",
    "cert-chain.pem",
    "root-cert.pem",
];
/// `kubernetes.io/tls` Secret file names.
pub const TLS_FILES: [&str; 3] = ["tls.crt", "tls.key", "ca.crt"];

/// Why CA material could not be loaded. Every variant names what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum MaterialError {
    #[error("no CA material in {}: expected {} or {}", .0.display(), CACERTS_FILES.join(", "), TLS_FILES.join(", "))]
    NotFound(PathBuf),
    #[error("incomplete signing CA bundle in {dir}: missing {}", .missing.join(", "))]
    Incomplete { dir: PathBuf, missing: Vec<String> },
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}: not UTF-8 PEM text")]
    NotText(String),
    #[error("{file}: no certificate found")]
    NoCertificate { file: String },
    #[error("{file}: invalid certificate: {detail}")]
    BadCertificate { file: String, detail: String },
    #[error("signing key: {0}")]
    BadKey(String),
    #[error("signing certificate is not a CA (basicConstraints CA:true and keyCertSign required)")]
    NotACa,
    #[error("signing key does not match the signing certificate")]
    KeyMismatch,
    #[error("signing certificate does not chain to the root bundle: {0}")]
    ChainInvalid(String),
    #[error("signing certificate has expired at {0}")]
    Expired(OffsetDateTime),
    #[error("root bundle changed; refusing to switch roots under running workloads (set ISTIO_MULTIROOT_MESH=true to allow adding or removing roots)")]
    RootChanged,
    /// The signing key's custody (file mode, PKCS#11 token, PIN).
    #[error(transparent)]
    Signer(#[from] SignerError),
}

impl MaterialError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotFound(_) => "ca_not_found",
            Self::Incomplete { .. } => "ca_incomplete",
            Self::Io { .. } => "ca_io",
            Self::NotText(_) => "ca_not_text",
            Self::NoCertificate { .. } => "ca_no_certificate",
            Self::BadCertificate { .. } => "ca_bad_certificate",
            Self::BadKey(_) => "ca_bad_key",
            Self::NotACa => "ca_not_a_ca",
            Self::KeyMismatch => "ca_key_mismatch",
            Self::ChainInvalid(_) => "ca_chain_invalid",
            Self::Expired(_) => "ca_expired",
            Self::RootChanged => "ca_root_changed",
            Self::Signer(e) => e.reason(),
        }
    }
}

/// Why a leaf could not be produced from a valid request.
#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error("unsupported public key: {0}")]
    PublicKey(String),
    #[error("certificate generation failed: {0}")]
    Generation(String),
    /// The key holder (token, KMS) could not sign.
    #[error("{0}")]
    Signer(SignerError),
}

impl SignError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::PublicKey(_) => "sign_public_key",
            Self::Generation(_) => "sign_generation",
            Self::Signer(e) => e.reason(),
        }
    }
}

/// The PEM texts a bundle is made from, as read from disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BundleFiles {
    pub signing_cert: String,
    pub signing_key: String,
    /// Certificates returned between the leaf and the root (raw file text).
    pub cert_chain: String,
    /// The root bundle, returned verbatim as the last element.
    pub root_bundle: String,
    /// Where they came from, for logs.
    pub source: String,
}

impl BundleFiles {
    /// Reads either layout from `dir`. A Kubernetes Secret volume is read
    /// through its `..data` link once, so all files come from one generation.
    pub fn read_dir(dir: &Path) -> Result<Self, MaterialError> {
        let base = std::fs::canonicalize(dir.join("..data")).unwrap_or_else(|_| dir.to_path_buf());
        let exists = |f: &str| base.join(f).exists();
        let read = |f: &str| -> Result<String, MaterialError> {
            let path = base.join(f);
            let bytes = std::fs::read(&path).map_err(|source| MaterialError::Io {
                path: path.clone(),
                source,
            })?;
            String::from_utf8(bytes).map_err(|_| MaterialError::NotText(f.to_string()))
        };
        let missing = |files: &[&str]| -> Vec<String> {
            files
                .iter()
                .filter(|f| !exists(f))
                .map(|f| f.to_string())
                .collect()
        };
        if exists("tls.crt") {
            let m = missing(&TLS_FILES);
            if !m.is_empty() {
                return Err(MaterialError::Incomplete {
                    dir: dir.to_path_buf(),
                    missing: m,
                });
            }
            let tls = read("tls.crt")?;
            let ca = read("ca.crt")?;
            // istiod: the chain is tls.crt followed by ca.crt.
            return Ok(Self {
                signing_cert: tls.clone(),
                signing_key: read("tls.key")?,
                cert_chain: format!("{tls}{ca}"),
                root_bundle: ca,
                source: format!("{} (kubernetes.io/tls)", dir.display()),
            });
        }
        let m = missing(&CACERTS_FILES);
        if m.len() == CACERTS_FILES.len() {
            return Err(MaterialError::NotFound(dir.to_path_buf()));
        }
        if !m.is_empty() {
            return Err(MaterialError::Incomplete {
                dir: dir.to_path_buf(),
                missing: m,
            });
        }
        Ok(Self {
            signing_cert: read("ca-cert.pem")?,
            signing_key: read("ca-key.pem")?,
            cert_chain: read("cert-chain.pem")?,
            root_bundle: read("root-cert.pem")?,
            source: format!("{} (cacerts)", dir.display()),
        })
    }

    /// SHA-256 over all four texts: equal files give equal fingerprints.
    pub fn fingerprint(&self) -> [u8; 32] {
        let mut all = Vec::new();
        for part in [
            &self.signing_cert,
            &self.signing_key,
            &self.cert_chain,
            &self.root_bundle,
        ] {
            all.extend_from_slice(&sha256(part.as_bytes()));
        }
        sha256(&all)
    }
}

// The key text is cleared when the files are dropped.
impl Drop for BundleFiles {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.signing_key);
    }
}

/// A verified, immutable CA snapshot. Requests hold an `Arc` to one for their
/// whole life, so a reload never changes material under a request.
pub struct CaBundle {
    issuer: Issuer<'static, SignerKey>,
    signing_cert: CertificateDer<'static>,
    signing_not_after: OffsetDateTime,
    key_id: String,
    key_algorithm: &'static str,
    chain_elements: Vec<String>,
    root_bundle: String,
    roots: Vec<CertificateDer<'static>>,
    intermediates: Vec<CertificateDer<'static>>,
    root_not_after: OffsetDateTime,
    chain_not_after: Option<OffsetDateTime>,
    fingerprint: [u8; 32],
    source: String,
}

impl std::fmt::Debug for CaBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaBundle")
            .field("source", &self.source)
            .field("key_id", &self.key_id)
            .field("signing_not_after", &self.signing_not_after)
            .finish_non_exhaustive()
    }
}

/// A signed leaf.
#[derive(Debug, Clone)]
pub struct IssuedLeaf {
    pub der: CertificateDer<'static>,
    pub pem: String,
    pub serial_hex: String,
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
}

impl CaBundle {
    /// Reads and verifies the bundle in `dir`.
    pub fn load_dir(dir: &Path, now: OffsetDateTime) -> Result<Self, MaterialError> {
        Self::from_files(BundleFiles::read_dir(dir)?, now)
    }

    /// Verifies `files`: every PEM parses, the key matches the signing cert,
    /// the signing cert is an unexpired CA that chains to the root bundle, and
    /// a probe leaf signed with it verifies against the roots.
    pub fn from_files(files: BundleFiles, now: OffsetDateTime) -> Result<Self, MaterialError> {
        Self::from_files_with(files, None, now)
    }

    /// [`Self::from_files`] with the key held by `signer` (a token, or the
    /// in-memory issuing key) instead of the key file text.
    pub fn from_files_with(
        mut files: BundleFiles,
        signer: Option<Arc<dyn Signer>>,
        now: OffsetDateTime,
    ) -> Result<Self, MaterialError> {
        let fingerprint = files.fingerprint();
        let signing_cert = certs("signing certificate", &files.signing_cert)?
            .into_iter()
            .next()
            .ok_or(MaterialError::NoCertificate {
                file: "signing certificate".into(),
            })?;
        let chain = certs_allow_empty("cert chain", &files.cert_chain)?;
        let roots = certs("root bundle", &files.root_bundle)?;

        let (_, parsed) = X509Certificate::from_der(&signing_cert).map_err(|e| {
            MaterialError::BadCertificate {
                file: "signing certificate".into(),
                detail: e.to_string(),
            }
        })?;
        let is_ca = parsed
            .basic_constraints()
            .ok()
            .flatten()
            .map(|bc| bc.value.ca)
            .unwrap_or(false);
        let can_sign = parsed
            .key_usage()
            .ok()
            .flatten()
            .map(|ku| ku.value.key_cert_sign())
            .unwrap_or(true);
        if !is_ca || !can_sign {
            return Err(MaterialError::NotACa);
        }
        let signing_not_after = parsed.validity().not_after.to_datetime();
        if now >= signing_not_after {
            return Err(MaterialError::Expired(signing_not_after));
        }
        // rcgen re-encodes this subject as every leaf's issuer and panics on
        // an attribute type that has no DER encoding.
        if let Some(bad) = parsed
            .subject()
            .iter_attributes()
            .map(|a| a.attr_type())
            .find(|oid| !encodable_oid(oid))
        {
            return Err(MaterialError::BadCertificate {
                file: "signing certificate".into(),
                detail: format!("subject attribute type {bad} cannot be encoded"),
            });
        }
        let spki = parsed.public_key();
        let (alg, key_algorithm) = signing_algorithm(spki)?;
        let key = match signer {
            Some(s) => SignerKey(s),
            None => SignerKey(Arc::new(
                super::signer::file::from_pem(&files.signing_key, alg, &files.source)
                    .map_err(|e| MaterialError::BadKey(e.to_string()))?,
            )),
        };
        if key.0.algorithm() != alg
            || rcgen::PublicKeyData::der_bytes(&key) != spki.subject_public_key.data.as_ref()
        {
            return Err(MaterialError::KeyMismatch);
        }
        let key_id = match parsed
            .extensions()
            .iter()
            .find_map(|e| match e.parsed_extension() {
                x509_parser::extensions::ParsedExtension::SubjectKeyIdentifier(ski) => Some(ski.0),
                _ => None,
            }) {
            Some(ski) => hex::encode(ski),
            None => hex::encode(&sha256(spki.raw)[..20]),
        };
        let issuer = Issuer::from_ca_cert_der(&signing_cert, key).map_err(|e| {
            MaterialError::BadCertificate {
                file: "signing certificate".into(),
                detail: e.to_string(),
            }
        })?;

        let not_after_of = |der: &CertificateDer<'_>| {
            X509Certificate::from_der(der)
                .ok()
                .map(|(_, c)| c.validity().not_after.to_datetime())
        };
        let root_not_after = not_after_of(&roots[0]).unwrap_or(signing_not_after);
        let chain_not_after = chain.first().and_then(not_after_of);
        let mut intermediates = vec![signing_cert.clone()];
        intermediates.extend(chain.iter().cloned());
        // The probe may chain only through the signing certificate itself:
        // another certificate for the signing key (a good copy in
        // cert-chain.pem) would otherwise vouch for a tampered ca-cert.pem.
        let probe_path: Vec<_> = intermediates
            .iter()
            .enumerate()
            .filter(|(i, c)| {
                *i == 0
                    || X509Certificate::from_der(c).map_or(true, |(_, p)| {
                        p.public_key().subject_public_key.data != spki.subject_public_key.data
                    })
            })
            .map(|(_, c)| c.clone())
            .collect();

        let bundle = Self {
            issuer,
            signing_cert,
            signing_not_after,
            key_id,
            key_algorithm,
            chain_elements: split_elements(&files.cert_chain),
            root_bundle: std::mem::take(&mut files.root_bundle),
            roots,
            intermediates,
            root_not_after,
            chain_not_after,
            fingerprint,
            source: std::mem::take(&mut files.source),
        };
        bundle.probe(now, &probe_path)?;
        Ok(bundle)
    }

    /// Signs a throwaway leaf and verifies it with webpki against the roots:
    /// proves key, issuer name encoding and chain all fit together.
    fn probe(
        &self,
        now: OffsetDateTime,
        intermediates: &[CertificateDer<'static>],
    ) -> Result<(), MaterialError> {
        let key = KeyPair::generate().map_err(|e| MaterialError::BadKey(e.to_string()))?;
        let id: SpiffeId = "spiffe://meshca.probe/ns/probe/sa/probe"
            .parse()
            .map_err(|_| MaterialError::ChainInvalid("probe identity".into()))?;
        let validity = Validity {
            not_before: now - time::Duration::minutes(2),
            not_after: (now + time::Duration::hours(1)).min(self.signing_not_after),
            clamped: false,
        };
        let spki =
            SubjectPublicKeyInfo::from_der(&rcgen::PublicKeyData::subject_public_key_info(&key))
                .map_err(|e| MaterialError::BadKey(e.to_string()))?;
        let leaf = self
            .sign_leaf_spki(&spki, &id, false, &validity)
            .map_err(|e| MaterialError::ChainInvalid(e.to_string()))?;
        self.verify_leaf_via(&leaf.der, now, intermediates)
            .map_err(MaterialError::ChainInvalid)
    }

    /// Verifies a leaf issued by this bundle against its roots (client auth usage).
    pub fn verify_leaf(
        &self,
        leaf: &CertificateDer<'_>,
        now: OffsetDateTime,
    ) -> Result<(), String> {
        self.verify_leaf_via(leaf, now, &self.intermediates)
    }

    fn verify_leaf_via(
        &self,
        leaf: &CertificateDer<'_>,
        now: OffsetDateTime,
        intermediates: &[CertificateDer<'static>],
    ) -> Result<(), String> {
        let anchors: Vec<_> = self
            .roots
            .iter()
            .filter_map(|r| webpki::anchor_from_trusted_cert(r).ok())
            .collect();
        let ee = webpki::EndEntityCert::try_from(leaf).map_err(|e| format!("{e:?}"))?;
        let secs = u64::try_from(now.unix_timestamp()).unwrap_or(0);
        ee.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            intermediates,
            UnixTime::since_unix_epoch(std::time::Duration::from_secs(secs)),
            webpki::KeyUsage::client_auth(),
            None,
            None,
        )
        .map(|_| ())
        .map_err(|e| format!("{e:?}"))
    }

    /// Signs a workload leaf for `identity` over the CSR's public key.
    pub fn sign_leaf(
        &self,
        spki_der: &[u8],
        identity: &SpiffeId,
        common_name: bool,
        validity: &Validity,
    ) -> Result<IssuedLeaf, SignError> {
        let spki = SubjectPublicKeyInfo::from_der(spki_der)
            .map_err(|e| SignError::PublicKey(e.to_string()))?;
        self.sign_leaf_spki(&spki, identity, common_name, validity)
    }

    fn sign_leaf_spki(
        &self,
        spki: &SubjectPublicKeyInfo,
        identity: &SpiffeId,
        common_name: bool,
        validity: &Validity,
    ) -> Result<IssuedLeaf, SignError> {
        let gen = |e: rcgen::Error| match super::signer::signer_error(&e) {
            Some(s) => SignError::Signer(s),
            None => SignError::Generation(e.to_string()),
        };
        let id = identity.to_string();
        let mut serial = [0u8; 16];
        aws_lc_rs::rand::fill(&mut serial).map_err(|_| SignError::Generation("rng".into()))?;
        let mut params = CertificateParams::default();
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        params.distinguished_name = DistinguishedName::new();
        // istiod's dual-use rule: a CN is set only when the CSR had one.
        if common_name && id.len() <= 64 {
            params
                .distinguished_name
                .push(DnType::CommonName, id.clone());
        }
        params.not_before = validity.not_before;
        params.not_after = validity.not_after;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.subject_alt_names = vec![SanType::URI(id.try_into().map_err(gen)?)];
        params.use_authority_key_identifier_extension = true;
        // Critical CA:FALSE written by hand: rcgen's ExplicitNoCa also adds a
        // SubjectKeyIdentifier, which istiod's leaves do not carry.
        params.is_ca = IsCa::NoCa;
        let mut bc = CustomExtension::from_oid_content(&[2, 5, 29, 19], vec![0x30, 0x00]);
        bc.set_criticality(true);
        params.custom_extensions = vec![bc];
        let cert = params.signed_by(spki, &self.issuer).map_err(gen)?;
        Ok(IssuedLeaf {
            pem: cert.pem(),
            der: cert.der().clone(),
            serial_hex: super::serial_hex(&serial),
            not_before: validity.not_before,
            not_after: validity.not_after,
        })
    }

    /// A fresh key and a leaf for `id` over `validity`: the client identity
    /// PEMs `(chain without the root bundle, PKCS#8 key)` an mTLS caller
    /// presents (dev mode, the load generator, tests).
    pub fn client_identity(
        &self,
        id: &SpiffeId,
        validity: &Validity,
    ) -> Result<(String, String), SignError> {
        let key = KeyPair::generate().map_err(|e| SignError::Generation(e.to_string()))?;
        let spki = rcgen::PublicKeyData::subject_public_key_info(&key);
        let leaf = self.sign_leaf(&spki, id, false, validity)?;
        let chain = self.response_chain(&leaf.pem);
        let without_root = chain[..chain.len().saturating_sub(1)].concat();
        Ok((without_root, key.serialize_pem()))
    }

    /// The response chain: `[leaf, each chain cert, root bundle]` (istiod §4.6).
    pub fn response_chain(&self, leaf_pem: &str) -> Vec<String> {
        let mut out = split_elements(leaf_pem);
        out.extend(self.chain_elements.iter().cloned());
        if !self.root_bundle.is_empty() {
            out.push(self.root_bundle.clone());
        }
        out
    }

    pub fn signing_not_after(&self) -> OffsetDateTime {
        self.signing_not_after
    }
    /// Hex key id of the signing certificate (its SKI), for audit records.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }
    pub fn key_algorithm(&self) -> &'static str {
        self.key_algorithm
    }
    pub fn root_bundle(&self) -> &str {
        &self.root_bundle
    }
    pub fn roots(&self) -> &[CertificateDer<'static>] {
        &self.roots
    }
    /// Signing certificate followed by the chain certificates.
    pub fn intermediates(&self) -> &[CertificateDer<'static>] {
        &self.intermediates
    }
    pub fn signing_cert(&self) -> &CertificateDer<'static> {
        &self.signing_cert
    }
    pub fn root_not_after(&self) -> OffsetDateTime {
        self.root_not_after
    }
    pub fn chain_not_after(&self) -> Option<OffsetDateTime> {
        self.chain_not_after
    }
    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }
    pub fn source(&self) -> &str {
        &self.source
    }
    pub(crate) fn issuer(&self) -> &Issuer<'static, SignerKey> {
        &self.issuer
    }
    /// Who holds the signing key.
    pub fn signer(&self) -> &Arc<dyn Signer> {
        self.issuer.key().signer()
    }
}

fn certs(file: &str, pem: &str) -> Result<Vec<CertificateDer<'static>>, MaterialError> {
    let out = certs_allow_empty(file, pem)?;
    if out.is_empty() {
        return Err(MaterialError::NoCertificate { file: file.into() });
    }
    Ok(out)
}

fn certs_allow_empty(file: &str, pem: &str) -> Result<Vec<CertificateDer<'static>>, MaterialError> {
    let out = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| MaterialError::BadCertificate {
            file: file.into(),
            detail: e.to_string(),
        })?;
    for der in &out {
        X509Certificate::from_der(der).map_err(|e| MaterialError::BadCertificate {
            file: file.into(),
            detail: e.to_string(),
        })?;
    }
    Ok(out)
}

fn signing_algorithm(
    spki: &x509_parser::x509::SubjectPublicKeyInfo<'_>,
) -> Result<(super::signer::KeyAlgorithm, &'static str), MaterialError> {
    use super::signer::KeyAlgorithm as A;
    match super::csr::spki_kind(spki)
        .map_err(|e| MaterialError::BadKey(format!("unsupported signing key: {e}")))?
    {
        KeyKind::EcdsaP256 => Ok((A::EcdsaP256, "ecdsa-p256")),
        KeyKind::EcdsaP384 => Ok((A::EcdsaP384, "ecdsa-p384")),
        KeyKind::Rsa(bits) if bits >= 2048 => Ok((A::Rsa, "rsa")),
        KeyKind::Rsa(bits) => Err(MaterialError::BadKey(format!(
            "RSA signing key of {bits} bits is below 2048"
        ))),
        KeyKind::Ed25519 => Err(MaterialError::BadKey(
            "Ed25519 signing keys are not supported (use ECDSA P-256/P-384 or RSA)".into(),
        )),
    }
}

/// Whether an OID can be written in DER (yasna's rule: at least two arcs,
/// the first below 3, the second below 40 unless the first is 2).
fn encodable_oid(oid: &x509_parser::oid_registry::Oid<'_>) -> bool {
    let Some(arcs) = oid.iter() else {
        return false;
    };
    match arcs.take(2).collect::<Vec<_>>()[..] {
        [a, b] => a < 3 && (a == 2 || b < 40) && b < u64::MAX - 80,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::generate::{generate, pem_encode, InitOptions};

    fn files(ca: &crate::ca::generate::GeneratedCa) -> BundleFiles {
        BundleFiles {
            signing_cert: ca.ca_cert.clone(),
            signing_key: ca.ca_key.clone(),
            cert_chain: ca.cert_chain(),
            root_bundle: ca.root_cert.clone(),
            source: "test".into(),
        }
    }

    // Found by the property test bundle_signing_cert_byte_change_is_refused:
    // the probe leaf used to chain through the intact copy of the signing
    // certificate in cert-chain.pem, so a ca-cert.pem whose signed bytes
    // were changed (here its serial) still loaded.
    #[test]
    fn tampered_signing_cert_is_refused_despite_a_good_copy_in_the_chain() {
        let now = OffsetDateTime::now_utc();
        let ca = generate(&InitOptions::default(), now).unwrap();
        CaBundle::from_files(files(&ca), now).unwrap();
        let mut der = CertificateDer::from_pem_slice(ca.ca_cert.as_bytes())
            .unwrap()
            .to_vec();
        let serial = X509Certificate::from_der(&der)
            .unwrap()
            .1
            .raw_serial()
            .to_vec();
        let at = der.windows(serial.len()).position(|w| w == serial).unwrap() + serial.len() - 1;
        der[at] ^= 0x01;
        let mut f = files(&ca);
        f.signing_cert = pem_encode("CERTIFICATE", &der);
        let err = CaBundle::from_files(f, now).unwrap_err();
        assert_eq!(err.reason(), "ca_chain_invalid", "{err}");
    }

    // Found by the same property test: a subject attribute type that parses
    // but has no DER encoding (first sub-identifier 0x7d, read as arcs 3.5)
    // made rcgen's encoder (yasna) panic while signing the probe leaf.
    #[test]
    fn unencodable_subject_oid_is_an_error_not_a_panic() {
        let now = OffsetDateTime::now_utc();
        let ca = generate(&InitOptions::default(), now).unwrap();
        let mut der = CertificateDer::from_pem_slice(ca.ca_cert.as_bytes())
            .unwrap()
            .to_vec();
        let cn = [0x06, 0x03, 0x55, 0x04, 0x03];
        // The second CN in the TBS is the subject's (the first is the issuer's).
        let first = der.windows(5).position(|w| w == cn).unwrap();
        let at = first + 5 + der[first + 5..].windows(5).position(|w| w == cn).unwrap();
        der[at + 2] = 0x7d;
        let mut f = files(&ca);
        f.signing_cert = pem_encode("CERTIFICATE", &der);
        let err = CaBundle::from_files(f, now).unwrap_err();
        assert_eq!(err.reason(), "ca_bad_certificate", "{err}");
    }
}
