//! The public key of a PodCertificateRequest: from `stubPKCS10Request`
//! (1.36+ kubelets) or `pkixPublicKey` (1.35 `v1beta1`). The API server has
//! verified possession already; the CSR's self-signature is checked again
//! anyway because the CSR path does it for free, and the key types are the
//! ones CreateCertificate accepts.

use x509_parser::prelude::FromDer;

use super::decide::KeyFacts;
use crate::ca::csr::{self, CsrError};

/// The key type name the API uses, for a key meshca cannot sign.
fn api_name(detail: &str) -> String {
    match detail {
        "ec curve 1.3.132.0.35" => "ECDSAP521".into(),
        other => other.into(),
    }
}

/// Extracts the key: the stub CSR wins when both are present (1.36 allows
/// only one of them; a v1 object has no `pkixPublicKey`).
pub fn public_key(stub_csr_der: Option<&[u8]>, pkix_der: Option<&[u8]>) -> KeyFacts {
    match (
        stub_csr_der.filter(|d| !d.is_empty()),
        pkix_der.filter(|d| !d.is_empty()),
    ) {
        (Some(der), _) => from_csr(der),
        (None, Some(der)) => from_spki(der),
        (None, None) => KeyFacts::Malformed("no stubPKCS10Request and no pkixPublicKey".into()),
    }
}

fn from_csr(der: &[u8]) -> KeyFacts {
    let text = crate::primitives::pem_encode("CERTIFICATE REQUEST", der);
    match csr::parse_and_verify(&text) {
        Ok(c) => KeyFacts::Supported {
            spki_der: c.spki_der,
            kind: c.key,
        },
        Err(CsrError::UnsupportedKeyType(t)) => KeyFacts::Unsupported(api_name(&t)),
        Err(CsrError::RsaKeySize(bits)) => KeyFacts::Unsupported(format!("RSA{bits}")),
        Err(e) => KeyFacts::Malformed(format!("stubPKCS10Request: {e}")),
    }
}

fn from_spki(der: &[u8]) -> KeyFacts {
    let spki = match x509_parser::x509::SubjectPublicKeyInfo::from_der(der) {
        Ok(([], s)) => s,
        _ => return KeyFacts::Malformed("pkixPublicKey is not a DER SubjectPublicKeyInfo".into()),
    };
    match csr::key_kind(&spki) {
        Ok(kind) => KeyFacts::Supported {
            spki_der: der.to_vec(),
            kind,
        },
        Err(CsrError::UnsupportedKeyType(t)) => KeyFacts::Unsupported(api_name(&t)),
        Err(CsrError::RsaKeySize(bits)) => KeyFacts::Unsupported(format!("RSA{bits}")),
        Err(e) => KeyFacts::Malformed(format!("pkixPublicKey: {e}")),
    }
}

/// A DER CSR for `key`, as a kubelet sends it (empty subject).
#[cfg(test)]
fn csr_der(key: &rcgen::KeyPair) -> Vec<u8> {
    use rustls_pki_types::pem::PemObject;
    let params = rcgen::CertificateParams::default();
    let pem = params.serialize_request(key).unwrap().pem().unwrap();
    rustls_pki_types::CertificateSigningRequestDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .as_ref()
        .to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::csr::KeyKind;
    use test_case::test_case;

    fn kind(f: &KeyFacts) -> String {
        match f {
            KeyFacts::Supported { kind, .. } => format!("{kind:?}"),
            KeyFacts::Unsupported(t) => format!("unsupported:{t}"),
            KeyFacts::Malformed(_) => "malformed".into(),
        }
    }

    #[test_case(&rcgen::PKCS_ECDSA_P256_SHA256, "EcdsaP256" ; "p256")]
    #[test_case(&rcgen::PKCS_ECDSA_P384_SHA384, "EcdsaP384" ; "p384")]
    #[test_case(&rcgen::PKCS_ED25519, "Ed25519" ; "ed25519")]
    #[test_case(&rcgen::PKCS_ECDSA_P521_SHA512, "unsupported:ECDSAP521" ; "p521")]
    fn both_key_fields(alg: &'static rcgen::SignatureAlgorithm, want: &str) {
        let key = rcgen::KeyPair::generate_for(alg).unwrap();
        let spki = rcgen::PublicKeyData::subject_public_key_info(&key);
        let from_stub = public_key(Some(&csr_der(&key)), None);
        let from_pkix = public_key(None, Some(&spki));
        assert_eq!(kind(&from_stub), want);
        assert_eq!(kind(&from_pkix), want);
        if let KeyFacts::Supported { spki_der, .. } = &from_stub {
            assert_eq!(spki_der, &spki, "the leaf gets exactly the requested key");
        }
    }

    #[test]
    fn the_stub_csr_wins_and_garbage_is_malformed() {
        let a = rcgen::KeyPair::generate().unwrap();
        let b = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        let f = public_key(
            Some(&csr_der(&a)),
            Some(&rcgen::PublicKeyData::subject_public_key_info(&b)),
        );
        assert!(matches!(
            f,
            KeyFacts::Supported {
                kind: KeyKind::EcdsaP256,
                ..
            }
        ));
        assert_eq!(kind(&public_key(None, None)), "malformed");
        assert_eq!(kind(&public_key(Some(b"junk"), None)), "malformed");
        assert_eq!(kind(&public_key(None, Some(b"junk"))), "malformed");
        let mut bad_sig = csr_der(&a);
        let n = bad_sig.len();
        bad_sig[n - 2] ^= 0xff;
        assert_eq!(kind(&public_key(Some(&bad_sig), None)), "malformed");
    }
}
