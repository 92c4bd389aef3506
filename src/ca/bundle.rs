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
use super::csr::KeyKind;
use super::signer::{Signer, SignerError, SignerKey};
use super::ttl::Validity;
use crate::identity::SpiffeId;
use crate::primitives::sha256;

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
    #[error("cert-chain.pem does not start with ca-cert.pem ({0}): the chain served in every response must be the signing certificate's own")]
    ChainMismatch(String),
    #[error("signing path carries an unusable name constraint: {0}")]
    BadNameConstraint(String),
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
            Self::ChainMismatch(_) => "ca_chain_mismatch",
            Self::BadNameConstraint(_) => "ca_bad_name_constraint",
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
    /// A CA on the signing path confines identities (URI name constraints)
    /// and this one is outside: clients would reject the leaf.
    #[error("identity {identity} is outside the URI name constraints of {ca}")]
    OutsideNameConstraints { identity: String, ca: String },
    /// The issuance mark could not be made durable; the leaf is withheld.
    #[error("recording the issued leaf failed: {0}")]
    IssuanceRecord(String),
    /// The key holder (token, KMS) could not sign.
    #[error("{0}")]
    Signer(SignerError),
}

impl SignError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::PublicKey(_) => "sign_public_key",
            Self::Generation(_) => "sign_generation",
            Self::OutsideNameConstraints { .. } => "sign_outside_name_constraints",
            Self::IssuanceRecord(_) => "sign_issuance_record_failed",
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
    /// The texts of a CA generated in memory (`meshca init`'s material),
    /// from `source`.
    pub fn generated(ca: &crate::ca::generate::GeneratedCa, source: &str) -> Self {
        Self {
            signing_cert: ca.ca_cert.clone(),
            signing_key: ca.ca_key.clone(),
            cert_chain: ca.cert_chain(),
            root_bundle: ca.root_cert.clone(),
            source: source.to_string(),
        }
    }

    /// Reads either layout from `dir`. A Kubernetes Secret volume is read
    /// through its `..data` link once, so all files come from one generation.
    pub fn read_dir(dir: &Path) -> Result<Self, MaterialError> {
        Self::read_layout(dir, true)
    }

    /// Either layout without its key file, for a key held outside the
    /// directory (a PKCS#11 token); `signing_key` is then empty.
    pub fn read_dir_without_key(dir: &Path) -> Result<Self, MaterialError> {
        Self::read_layout(dir, false)
    }

    fn read_layout(dir: &Path, with_key: bool) -> Result<Self, MaterialError> {
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
        let is_key = |f: &&str| *f == "tls.key" || *f == "ca-key.pem";
        let missing = |files: &[&str]| -> Vec<String> {
            files
                .iter()
                .filter(|f| with_key || !is_key(f))
                .filter(|f| !exists(f))
                .map(|f| f.to_string())
                .collect()
        };
        let key = |f: &str| if with_key { read(f) } else { Ok(String::new()) };
        let held = if with_key { "" } else { ", key external" };
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
                signing_key: key("tls.key")?,
                cert_chain: format!("{tls}{ca}"),
                root_bundle: ca,
                source: format!("{} (kubernetes.io/tls{held})", dir.display()),
            });
        }
        let wanted = CACERTS_FILES
            .iter()
            .filter(|f| with_key || !is_key(f))
            .count();
        let m = missing(&CACERTS_FILES);
        if m.len() == wanted {
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
            signing_key: key("ca-key.pem")?,
            cert_chain: read("cert-chain.pem")?,
            root_bundle: read("root-cert.pem")?,
            source: format!("{} (cacerts{held})", dir.display()),
        })
    }

    /// The signing certificate's key id (as [`CaBundle::key_id`]) and the
    /// roots, parsed but not verified: what `meshca rotate status` needs
    /// from a directory whose key it cannot reach (a token).
    pub fn identify(&self) -> Result<(String, Vec<CertificateDer<'static>>), MaterialError> {
        let signing = certs("signing certificate", &self.signing_cert)?
            .into_iter()
            .next()
            .ok_or(MaterialError::NoCertificate {
                file: "signing certificate".into(),
            })?;
        let (_, parsed) =
            X509Certificate::from_der(&signing).map_err(|e| MaterialError::BadCertificate {
                file: "signing certificate".into(),
                detail: e.to_string(),
            })?;
        Ok((key_id_of(&parsed), certs("root bundle", &self.root_bundle)?))
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
    /// Earliest not_after on the verified path (signing cert .. root).
    leaf_not_after_limit: OffsetDateTime,
    key_id: String,
    key_algorithm: &'static str,
    chain_elements: Vec<String>,
    root_bundle: String,
    roots: Vec<CertificateDer<'static>>,
    intermediates: Vec<CertificateDer<'static>>,
    root_not_after: OffsetDateTime,
    chain_not_after: Option<OffsetDateTime>,
    /// URI name constraints of the CAs on the path.
    uri_constraints: Vec<super::constraints::UriConstraints>,
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

/// A CA certificate's key id: its subject key identifier, else the first
/// 20 bytes of the SHA-256 of its public key.
fn key_id_of(cert: &X509Certificate<'_>) -> String {
    match cert
        .extensions()
        .iter()
        .find_map(|e| match e.parsed_extension() {
            x509_parser::extensions::ParsedExtension::SubjectKeyIdentifier(ski) => Some(ski.0),
            _ => None,
        }) {
        Some(ski) => hex::encode(ski),
        None => hex::encode(&sha256(cert.public_key().raw)[..20]),
    }
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
        let key_id = key_id_of(&parsed);
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
        // The chain is served verbatim after every leaf: it must start with
        // the certificate that signs the leaves, or clients get a chain of
        // another generation (istiod does not check this; its clients then
        // fail to build a path).
        if let Some(first) = chain.first() {
            if *first != signing_cert {
                return Err(MaterialError::ChainMismatch(format!(
                    "its first certificate is {}, ca-cert.pem is {}",
                    describe(first),
                    describe(&signing_cert)
                )));
            }
        }
        let root_not_after = not_after_of(&roots[0]).unwrap_or(signing_not_after);
        let chain_not_after = chain.first().and_then(not_after_of);
        // What the response carries between leaf and root; with an empty
        // chain the signing certificate must itself be a root.
        let intermediates = if chain.is_empty() {
            vec![signing_cert.clone()]
        } else {
            chain.clone()
        };

        let mut bundle = Self {
            issuer,
            signing_cert,
            signing_not_after,
            leaf_not_after_limit: signing_not_after,
            key_id,
            key_algorithm,
            chain_elements: split_elements(&files.cert_chain),
            root_bundle: std::mem::take(&mut files.root_bundle),
            roots,
            intermediates,
            root_not_after,
            chain_not_after,
            uri_constraints: Vec::new(),
            fingerprint,
            source: std::mem::take(&mut files.source),
        };
        let path = bundle.probe(now, &chain)?;
        // Leaves end no later than any CA on their path, root included: a
        // leaf outliving a higher intermediate stops verifying before its
        // holder renews it at half-life.
        bundle.leaf_not_after_limit = path
            .iter()
            .filter_map(not_after_of)
            .fold(signing_not_after, OffsetDateTime::min);
        for ca in &path {
            if let Some(c) =
                super::constraints::uri_constraints(ca).map_err(MaterialError::BadNameConstraint)?
            {
                bundle.uri_constraints.push(c);
            }
        }
        Ok(bundle)
    }

    /// Signs a throwaway leaf and verifies it with webpki against the roots,
    /// through exactly the certificates the response carries: proves key,
    /// issuer name encoding and served chain all fit together. Returns the
    /// CA certificates of the verified path (signing cert first, root last).
    fn probe(
        &self,
        now: OffsetDateTime,
        served: &[CertificateDer<'static>],
    ) -> Result<Vec<CertificateDer<'static>>, MaterialError> {
        let key = KeyPair::generate().map_err(|e| MaterialError::BadKey(e.to_string()))?;
        let validity = Validity {
            not_before: now - time::Duration::minutes(2),
            not_after: (now + time::Duration::hours(1)).min(self.signing_not_after),
            clamped: false,
        };
        let spki =
            SubjectPublicKeyInfo::from_der(&rcgen::PublicKeyData::subject_public_key_info(&key))
                .map_err(|e| MaterialError::BadKey(e.to_string()))?;
        // No SAN: webpki fails closed on URI name constraints (see
        // ca::constraints); path, signatures, validity and usages are what
        // the probe proves, and URI constraints are checked before signing.
        let leaf = self
            .sign_leaf_spki(&spki, None, false, &validity, None)
            .map_err(|e| MaterialError::ChainInvalid(e.to_string()))?;
        self.verify_path(&leaf.der, now, served)
            .map_err(MaterialError::ChainInvalid)
    }

    /// Verifies a leaf issued by this bundle against its roots (client auth usage).
    pub fn verify_leaf(
        &self,
        leaf: &CertificateDer<'_>,
        now: OffsetDateTime,
    ) -> Result<(), String> {
        self.verify_path(leaf, now, &self.intermediates).map(|_| ())
    }

    /// Verifies `leaf` and returns the CA certificates of its path, from its
    /// issuer up to the root certificate of the anchor used.
    fn verify_path(
        &self,
        leaf: &CertificateDer<'_>,
        now: OffsetDateTime,
        intermediates: &[CertificateDer<'static>],
    ) -> Result<Vec<CertificateDer<'static>>, String> {
        let anchors: Vec<_> = self
            .roots
            .iter()
            .filter_map(|r| webpki::anchor_from_trusted_cert(r).ok())
            .collect();
        let ee = webpki::EndEntityCert::try_from(leaf).map_err(|e| format!("{e:?}"))?;
        let secs = u64::try_from(now.unix_timestamp()).unwrap_or(0);
        let path = ee
            .verify_for_usage(
                webpki::ALL_VERIFICATION_ALGS,
                &anchors,
                intermediates,
                UnixTime::since_unix_epoch(std::time::Duration::from_secs(secs)),
                webpki::KeyUsage::client_auth(),
                None,
                None,
            )
            .map_err(|e| format!("{e:?}"))?;
        let mut out: Vec<CertificateDer<'static>> = path
            .intermediate_certificates()
            .map(|c| c.der().into_owned())
            .collect();
        let anchor = path.anchor();
        if let Some(root) = self.roots.iter().find(|r| {
            webpki::anchor_from_trusted_cert(r).is_ok_and(|a| {
                a.subject == anchor.subject
                    && a.subject_public_key_info == anchor.subject_public_key_info
            })
        }) {
            out.push(root.clone());
        }
        Ok(out)
    }

    /// Signs a workload leaf for `identity` over the CSR's public key.
    pub fn sign_leaf(
        &self,
        spki_der: &[u8],
        identity: &SpiffeId,
        common_name: bool,
        validity: &Validity,
    ) -> Result<IssuedLeaf, SignError> {
        self.sign_leaf_for(spki_der, identity, common_name, validity, None)
    }

    /// [`Self::sign_leaf`] with a serial marked for the cluster and lineage
    /// the leaf is issued for ([`super::serial`]); `None` draws an unmarked
    /// serial.
    pub fn sign_leaf_for(
        &self,
        spki_der: &[u8],
        identity: &SpiffeId,
        common_name: bool,
        validity: &Validity,
        mark: Option<super::serial::LeafMark>,
    ) -> Result<IssuedLeaf, SignError> {
        self.check_name_constraints(identity)?;
        let spki = SubjectPublicKeyInfo::from_der(spki_der)
            .map_err(|e| SignError::PublicKey(e.to_string()))?;
        self.sign_leaf_spki(&spki, Some(identity), common_name, validity, mark)
    }

    /// Refuses an identity that a CA on the signing path does not permit.
    pub fn check_name_constraints(&self, identity: &SpiffeId) -> Result<(), SignError> {
        let uri = identity.to_string();
        match self.uri_constraints.iter().find(|c| !c.allows(&uri)) {
            Some(c) => Err(SignError::OutsideNameConstraints {
                identity: uri,
                ca: c.ca.clone(),
            }),
            None => Ok(()),
        }
    }

    fn sign_leaf_spki(
        &self,
        spki: &SubjectPublicKeyInfo,
        identity: Option<&SpiffeId>,
        common_name: bool,
        validity: &Validity,
        mark: Option<super::serial::LeafMark>,
    ) -> Result<IssuedLeaf, SignError> {
        let gen = |e: rcgen::Error| match super::signer::signer_error(&e) {
            Some(s) => SignError::Signer(s),
            None => SignError::Generation(e.to_string()),
        };
        let id = identity.map(|i| i.to_string()).unwrap_or_default();
        let serial = super::serial::draw(mark)?;
        let mut params = CertificateParams::default();
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        params.distinguished_name = DistinguishedName::new();
        // istiod's dual-use rule: a CN is set only when the CSR had one.
        if common_name && !id.is_empty() && id.len() <= 64 {
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
        if identity.is_some() {
            params.subject_alt_names = vec![SanType::URI(id.try_into().map_err(gen)?)];
        }
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
    /// presents (the load generator, tests). It writes no audit record, so
    /// it exists only in test and bench builds.
    #[cfg(any(test, feature = "testing"))]
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
    /// The latest not_after a leaf may have: the earliest expiry of any CA
    /// on the path up to the root.
    pub fn leaf_not_after_limit(&self) -> OffsetDateTime {
        self.leaf_not_after_limit
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
    /// The CA certificates served between leaf and root (the signing
    /// certificate first).
    pub fn intermediates(&self) -> &[CertificateDer<'static>] {
        &self.intermediates
    }
    pub fn signing_cert(&self) -> &CertificateDer<'static> {
        &self.signing_cert
    }
    /// URI name constraints of the CAs on the signing path.
    pub fn uri_constraints(&self) -> &[super::constraints::UriConstraints] {
        &self.uri_constraints
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

/// Subject and serial, to tell two certificates apart in an error.
fn describe(der: &CertificateDer<'_>) -> String {
    match X509Certificate::from_der(der) {
        Ok((_, c)) => format!("\"{}\" serial {}", c.subject(), c.raw_serial_as_string()),
        Err(_) => "an unparsable certificate".into(),
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
    use crate::ca::generate::{generate, InitOptions};
    use crate::primitives::pem_encode;

    fn files(ca: &crate::ca::generate::GeneratedCa) -> BundleFiles {
        BundleFiles::generated(ca, "test")
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
        let tampered = pem_encode("CERTIFICATE", &der);
        let mut f = files(&ca);
        f.signing_cert = tampered.clone();
        let err = CaBundle::from_files(f, now).unwrap_err();
        assert_eq!(err.reason(), "ca_chain_mismatch", "{err}");
        // The same tampered certificate in both files: the probe refuses it.
        let mut f = files(&ca);
        f.signing_cert = tampered.clone();
        f.cert_chain = format!("{tampered}{}", ca.root_cert);
        let err = CaBundle::from_files(f, now).unwrap_err();
        assert_eq!(err.reason(), "ca_chain_invalid", "{err}");
    }

    /// root -> upper -> signing, with the upper intermediate's lifetime and
    /// an optional URI name constraint on the signing intermediate.
    fn three_level(
        now: OffsetDateTime,
        upper_life: time::Duration,
        uri_constraint: Option<&str>,
    ) -> BundleFiles {
        use crate::ca::generate::ca_params;
        let day = time::Duration::days(1);
        let root_key = KeyPair::generate().unwrap();
        let root_p = ca_params("root", "o", now - day, now + day * 3650, None).unwrap();
        let root = root_p.self_signed(&root_key).unwrap();
        let root_iss = Issuer::new(root_p, root_key);
        let up_key = KeyPair::generate().unwrap();
        let mut up_p = ca_params("upper", "o", now - day, now + upper_life, Some(1)).unwrap();
        up_p.use_authority_key_identifier_extension = true;
        let up = up_p.signed_by(&up_key, &root_iss).unwrap();
        let up_iss = Issuer::new(up_p, up_key);
        let key = KeyPair::generate().unwrap();
        let mut p = ca_params("signing", "o", now - day, now + day * 365, Some(0)).unwrap();
        p.use_authority_key_identifier_extension = true;
        if let Some(host) = uri_constraint {
            // permittedSubtrees [0] { GeneralSubtree { uniformResourceIdentifier [6] host } }
            let name = [&[0x86, host.len() as u8][..], host.as_bytes()].concat();
            let subtree = [&[0x30, name.len() as u8][..], &name].concat();
            let permitted = [&[0xa0, subtree.len() as u8][..], &subtree].concat();
            let nc = [&[0x30, permitted.len() as u8][..], &permitted].concat();
            let mut ext = CustomExtension::from_oid_content(&[2, 5, 29, 30], nc);
            ext.set_criticality(true);
            p.custom_extensions = vec![ext];
        }
        let ca = p.signed_by(&key, &up_iss).unwrap();
        BundleFiles {
            signing_cert: ca.pem(),
            signing_key: key.serialize_pem(),
            cert_chain: format!("{}{}{}", ca.pem(), up.pem(), root.pem()),
            root_bundle: root.pem(),
            source: "test".into(),
        }
    }

    #[test]
    fn chain_of_another_generation_is_refused() {
        let now = OffsetDateTime::now_utc();
        let ca = generate(&InitOptions::default(), now).unwrap();
        let other = generate(&InitOptions::default(), now).unwrap();
        let mut f = files(&ca);
        // Another intermediate's chain (say the previous generation's),
        // left behind in cert-chain.pem.
        f.cert_chain = format!("{}{}", other.ca_cert, ca.root_cert);
        let err = CaBundle::from_files(f, now).unwrap_err();
        assert_eq!(err.reason(), "ca_chain_mismatch", "{err}");
        assert!(err.to_string().contains("meshca intermediate CA"), "{err}");
    }

    #[test]
    fn probe_uses_only_the_served_chain() {
        let now = OffsetDateTime::now_utc();
        let ca = generate(&InitOptions::default(), now).unwrap();
        // An intermediate with an empty cert-chain.pem: responses would be
        // [leaf, root] and no client could build a path.
        let mut f = files(&ca);
        f.cert_chain = String::new();
        let err = CaBundle::from_files(f, now).unwrap_err();
        assert_eq!(err.reason(), "ca_chain_invalid", "{err}");
        // A missing middle certificate is refused the same way.
        let mut f = three_level(now, time::Duration::days(30), None);
        let certs: Vec<_> = crate::ca::chain::split_elements(&f.cert_chain);
        f.cert_chain = format!("{}{}", certs[0], certs[2]);
        let err = CaBundle::from_files(f, now).unwrap_err();
        assert_eq!(err.reason(), "ca_chain_invalid", "{err}");
    }

    #[test]
    fn leaf_clamped_to_a_higher_intermediate() {
        let now = OffsetDateTime::now_utc();
        let f = three_level(now, time::Duration::hours(3), None);
        let b = CaBundle::from_files(f, now).unwrap();
        let upper_end = (now + time::Duration::hours(3)).unix_timestamp();
        assert!(b.signing_not_after().unix_timestamp() > upper_end);
        assert_eq!(b.leaf_not_after_limit().unix_timestamp(), upper_end);
        let grant = crate::ca::ttl::grant(
            now,
            24 * 3600,
            &crate::ca::TtlPolicy::default(),
            b.leaf_not_after_limit(),
            0,
        )
        .unwrap();
        assert_eq!(grant.validity.not_after.unix_timestamp(), upper_end);
    }

    #[test]
    fn name_constrained_intermediate_loads_and_confines_identities() {
        let now = OffsetDateTime::now_utc();
        let f = three_level(now, time::Duration::days(30), Some("cluster.local"));
        let b = CaBundle::from_files(f, now).unwrap();
        let v = Validity {
            not_before: now - time::Duration::minutes(1),
            not_after: now + time::Duration::hours(1),
            clamped: false,
        };
        let spki = rcgen::PublicKeyData::subject_public_key_info(&KeyPair::generate().unwrap());
        let inside: SpiffeId = "spiffe://cluster.local/ns/a/sa/b".parse().unwrap();
        b.sign_leaf(&spki, &inside, false, &v).unwrap();
        let outside: SpiffeId = "spiffe://other.domain/ns/a/sa/b".parse().unwrap();
        let err = b.sign_leaf(&spki, &outside, false, &v).unwrap_err();
        assert_eq!(err.reason(), "sign_outside_name_constraints", "{err}");
        assert!(err.to_string().contains("other.domain"), "{err}");
    }

    #[test]
    fn uri_constraint_written_as_a_uri_is_refused_at_load() {
        let now = OffsetDateTime::now_utc();
        let f = three_level(
            now,
            time::Duration::days(30),
            Some("spiffe://cluster.local"),
        );
        let err = CaBundle::from_files(f, now).unwrap_err();
        assert_eq!(err.reason(), "ca_bad_name_constraint", "{err}");
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
