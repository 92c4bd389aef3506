//! PKCS#10 parsing, signature verification and the CSR content policy.
//!
//! Only the CSR's public key (and, for istiod's dual-use rule, whether it has
//! a subject CN) ever reaches the issued certificate; requested extensions,
//! CA flags and key usages are read only to be judged.

use aws_lc_rs::signature::{self, UnparsedPublicKey, VerificationAlgorithm};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateSigningRequestDer;
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::prelude::FromDer;
use x509_parser::public_key::PublicKey;

use crate::identity::SpiffeId;
use crate::primitives::sha256;

/// Largest CSR (PEM text) accepted; real ones are under 2 KiB.
pub const MAX_CSR_BYTES: usize = 64 * 1024;
const MIN_RSA_BITS: usize = 2048;
const MAX_RSA_BITS: usize = 8192;

/// Why a CSR was refused. Each variant has a stable [`CsrError::reason`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CsrError {
    #[error("certificate signing request is {0} bytes, over the {MAX_CSR_BYTES} byte limit")]
    TooLarge(usize),
    #[error("certificate signing request is not properly encoded")]
    NotPem,
    #[error("failed to parse X.509 certificate signing request")]
    Malformed,
    #[error("certificate signing request signature is invalid")]
    BadSignature,
    #[error("unsupported CSR signature algorithm {0}")]
    UnsupportedSignatureAlgorithm(String),
    #[error("unsupported CSR public key type {0}")]
    UnsupportedKeyType(String),
    #[error("RSA key of {0} bits is outside the allowed 2048-8192 bits")]
    RsaKeySize(usize),
    #[error("CSR requests a CA certificate")]
    RequestsCa,
    #[error("CSR subject alternative name {0:?} is not an identity the caller is authorized for")]
    SanNotAuthorized(String),
}

impl CsrError {
    /// Stable reason code for audit records and metric labels.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::TooLarge(_) => "csr_too_large",
            Self::NotPem => "csr_not_pem",
            Self::Malformed => "csr_malformed",
            Self::BadSignature => "csr_bad_signature",
            Self::UnsupportedSignatureAlgorithm(_) => "csr_unsupported_signature_algorithm",
            Self::UnsupportedKeyType(_) => "csr_unsupported_key_type",
            Self::RsaKeySize(_) => "csr_rsa_key_size",
            Self::RequestsCa => "csr_requests_ca",
            Self::SanNotAuthorized(_) => "csr_san_not_authorized",
        }
    }
}

/// Public key types a leaf may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    EcdsaP256,
    EcdsaP384,
    Rsa(usize),
    Ed25519,
}

impl KeyKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::EcdsaP256 => "ecdsa-p256",
            Self::EcdsaP384 => "ecdsa-p384",
            Self::Rsa(_) => "rsa",
            Self::Ed25519 => "ed25519",
        }
    }
}

/// A CSR whose signature has been verified.
#[derive(Debug, Clone)]
pub struct VerifiedCsr {
    /// DER SubjectPublicKeyInfo, copied into the leaf.
    pub spki_der: Vec<u8>,
    pub key: KeyKind,
    /// Every SAN in the CSR's extension request, rendered as text
    /// (URIs verbatim, other kinds prefixed with their type).
    pub sans: Vec<San>,
    /// istiod's dual-use rule: a CN in the CSR subject gets the identity as CN.
    pub has_common_name: bool,
    pub requests_ca: bool,
    /// SHA-256 of the CSR DER, for audit records (never the CSR itself).
    pub sha256: [u8; 32],
}

/// A subject alternative name requested in a CSR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum San {
    Uri(String),
    Other(String),
}

/// How much of the CSR's content is checked against the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CsrPolicy {
    /// CSR SANs must be a subset of the caller's authorized identity, and the
    /// CSR must not ask to be a CA.
    #[default]
    Strict,
    /// istiod's behaviour: the CSR's SANs and extensions are ignored.
    Istiod,
}

/// Decodes the PEM, parses the PKCS#10 structure and verifies its self-signature.
pub fn parse_and_verify(pem: &str) -> Result<VerifiedCsr, CsrError> {
    if pem.len() > MAX_CSR_BYTES {
        return Err(CsrError::TooLarge(pem.len()));
    }
    let der = CertificateSigningRequestDer::from_pem_slice(pem.as_bytes())
        .map_err(|_| CsrError::NotPem)?;
    let der = der.as_ref();
    let (rest, csr) = X509CertificationRequest::from_der(der).map_err(|_| CsrError::Malformed)?;
    if !rest.is_empty() {
        return Err(CsrError::Malformed);
    }
    let info = &csr.certification_request_info;
    let spki = &info.subject_pki;
    let key = key_kind(spki)?;
    let alg = verification_alg(key, &csr.signature_algorithm.algorithm.to_id_string())?;
    UnparsedPublicKey::new(alg, spki.subject_public_key.data.as_ref())
        .verify(info.raw, csr.signature_value.data.as_ref())
        .map_err(|_| CsrError::BadSignature)?;

    let mut sans = Vec::new();
    let mut requests_ca = false;
    if let Some(exts) = csr.requested_extensions() {
        for ext in exts {
            match ext {
                ParsedExtension::SubjectAlternativeName(san) => {
                    sans.extend(san.general_names.iter().map(san_text))
                }
                ParsedExtension::BasicConstraints(bc) => requests_ca |= bc.ca,
                _ => {}
            }
        }
    }
    let has_common_name = info
        .subject
        .iter_common_name()
        .any(|cn| cn.as_str().map(|s| !s.is_empty()).unwrap_or(true));
    Ok(VerifiedCsr {
        spki_der: spki.raw.to_vec(),
        key,
        sans,
        has_common_name,
        requests_ca,
        sha256: sha256(der),
    })
}

/// Checks the CSR content against the one identity the caller may receive.
pub fn check_policy(
    csr: &VerifiedCsr,
    authorized: &SpiffeId,
    policy: CsrPolicy,
) -> Result<(), CsrError> {
    if policy == CsrPolicy::Istiod {
        return Ok(());
    }
    if csr.requests_ca {
        return Err(CsrError::RequestsCa);
    }
    let want = authorized.to_string();
    for san in &csr.sans {
        match san {
            San::Uri(uri) if *uri == want => {}
            San::Uri(other) | San::Other(other) => {
                return Err(CsrError::SanNotAuthorized(other.clone()))
            }
        }
    }
    Ok(())
}

/// The kind of a public key; `Err` describes an unsupported or malformed one.
pub(crate) fn spki_kind(
    spki: &x509_parser::x509::SubjectPublicKeyInfo<'_>,
) -> Result<KeyKind, String> {
    match spki.algorithm.algorithm.to_id_string().as_str() {
        "1.2.840.10045.2.1" => {
            let curve = spki
                .algorithm
                .parameters
                .as_ref()
                .and_then(|p| p.as_oid().ok())
                .map(|o| o.to_id_string())
                .unwrap_or_default();
            match curve.as_str() {
                "1.2.840.10045.3.1.7" => Ok(KeyKind::EcdsaP256),
                "1.3.132.0.34" => Ok(KeyKind::EcdsaP384),
                other => Err(format!("ec curve {other}")),
            }
        }
        "1.2.840.113549.1.1.1" => match spki.parsed() {
            Ok(PublicKey::RSA(rsa)) => Ok(KeyKind::Rsa(rsa.key_size())),
            _ => Err("malformed RSA public key".into()),
        },
        "1.3.101.112" => Ok(KeyKind::Ed25519),
        other => Err(other.to_string()),
    }
}

pub(crate) fn key_kind(
    spki: &x509_parser::x509::SubjectPublicKeyInfo<'_>,
) -> Result<KeyKind, CsrError> {
    match spki_kind(spki).map_err(CsrError::UnsupportedKeyType)? {
        KeyKind::Rsa(bits) if !(MIN_RSA_BITS..=MAX_RSA_BITS).contains(&bits) => {
            Err(CsrError::RsaKeySize(bits))
        }
        kind => Ok(kind),
    }
}

fn verification_alg(
    key: KeyKind,
    sig_oid: &str,
) -> Result<&'static dyn VerificationAlgorithm, CsrError> {
    let alg: &'static dyn VerificationAlgorithm = match (key, sig_oid) {
        (KeyKind::EcdsaP256, "1.2.840.10045.4.3.2") => &signature::ECDSA_P256_SHA256_ASN1,
        (KeyKind::EcdsaP256, "1.2.840.10045.4.3.3") => &signature::ECDSA_P256_SHA384_ASN1,
        (KeyKind::EcdsaP384, "1.2.840.10045.4.3.2") => &signature::ECDSA_P384_SHA256_ASN1,
        (KeyKind::EcdsaP384, "1.2.840.10045.4.3.3") => &signature::ECDSA_P384_SHA384_ASN1,
        (KeyKind::Rsa(_), "1.2.840.113549.1.1.11") => &signature::RSA_PKCS1_2048_8192_SHA256,
        (KeyKind::Rsa(_), "1.2.840.113549.1.1.12") => &signature::RSA_PKCS1_2048_8192_SHA384,
        (KeyKind::Rsa(_), "1.2.840.113549.1.1.13") => &signature::RSA_PKCS1_2048_8192_SHA512,
        (KeyKind::Ed25519, "1.3.101.112") => &signature::ED25519,
        (_, other) => return Err(CsrError::UnsupportedSignatureAlgorithm(other.to_string())),
    };
    Ok(alg)
}

fn san_text(name: &GeneralName<'_>) -> San {
    match name {
        GeneralName::URI(uri) => San::Uri((*uri).to_string()),
        GeneralName::DNSName(dns) => San::Other(format!("DNS:{dns}")),
        GeneralName::RFC822Name(email) => San::Other(format!("email:{email}")),
        GeneralName::IPAddress(ip) => San::Other(format!("IP:{}", hex::encode(ip))),
        other => San::Other(format!("{other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::csr_pem;
    use rcgen::{KeyPair, SanType};
    use test_case::test_case;

    fn id() -> SpiffeId {
        "spiffe://cluster.local/ns/default/sa/app".parse().unwrap()
    }

    #[test_case(&rcgen::PKCS_ECDSA_P256_SHA256, KeyKind::EcdsaP256 ; "p256")]
    #[test_case(&rcgen::PKCS_ECDSA_P384_SHA384, KeyKind::EcdsaP384 ; "p384")]
    #[test_case(&rcgen::PKCS_ED25519, KeyKind::Ed25519 ; "ed25519")]
    fn accepts_supported_keys(alg: &'static rcgen::SignatureAlgorithm, want: KeyKind) {
        let key = KeyPair::generate_for(alg).unwrap();
        let csr = parse_and_verify(&csr_pem(
            &key,
            &[SanType::URI(id().to_string().try_into().unwrap())],
            false,
        ))
        .unwrap();
        assert_eq!(csr.key, want);
        check_policy(&csr, &id(), CsrPolicy::Strict).unwrap();
    }

    #[test]
    fn p521_is_unsupported() {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P521_SHA512).unwrap();
        let err = parse_and_verify(&csr_pem(&key, &[], false)).unwrap_err();
        assert_eq!(err.reason(), "csr_unsupported_key_type");
    }

    #[test]
    fn dns_san_is_refused_in_strict_mode_only() {
        let key = KeyPair::generate().unwrap();
        let csr = parse_and_verify(&csr_pem(
            &key,
            &[SanType::DnsName("evil.example".try_into().unwrap())],
            false,
        ))
        .unwrap();
        assert_eq!(
            check_policy(&csr, &id(), CsrPolicy::Strict),
            Err(CsrError::SanNotAuthorized("DNS:evil.example".into()))
        );
        check_policy(&csr, &id(), CsrPolicy::Istiod).unwrap();
    }

    #[test]
    fn other_identity_is_refused() {
        let key = KeyPair::generate().unwrap();
        let other = "spiffe://cluster.local/ns/default/sa/other";
        let csr = parse_and_verify(&csr_pem(
            &key,
            &[SanType::URI(other.try_into().unwrap())],
            false,
        ))
        .unwrap();
        assert_eq!(
            check_policy(&csr, &id(), CsrPolicy::Strict),
            Err(CsrError::SanNotAuthorized(other.into()))
        );
    }

    #[test]
    fn ca_request_is_refused() {
        let key = KeyPair::generate().unwrap();
        let csr = parse_and_verify(&csr_pem(&key, &[], true)).unwrap();
        assert!(csr.requests_ca);
        assert_eq!(
            check_policy(&csr, &id(), CsrPolicy::Strict),
            Err(CsrError::RequestsCa)
        );
    }

    #[test]
    fn tampered_signature_is_refused() {
        let key = KeyPair::generate().unwrap();
        let pem = csr_pem(&key, &[], false);
        let mut der = CertificateSigningRequestDer::from_pem_slice(pem.as_bytes())
            .unwrap()
            .as_ref()
            .to_vec();
        let n = der.len();
        der[n - 5] ^= 0x01;
        let pem = crate::testing::pem_encode("CERTIFICATE REQUEST", &der);
        assert!(matches!(
            parse_and_verify(&pem),
            Err(CsrError::BadSignature | CsrError::Malformed)
        ));
    }

    #[test_case("", CsrError::NotPem ; "empty")]
    #[test_case("not a pem", CsrError::NotPem ; "garbage")]
    #[test_case("-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n", CsrError::Malformed ; "bad der")]
    fn rejects_bad_encoding(pem: &str, want: CsrError) {
        assert_eq!(parse_and_verify(pem).unwrap_err(), want);
    }

    #[test]
    fn rejects_oversized() {
        let pem = "A".repeat(MAX_CSR_BYTES + 1);
        assert_eq!(
            parse_and_verify(&pem).unwrap_err(),
            CsrError::TooLarge(MAX_CSR_BYTES + 1)
        );
    }
}
