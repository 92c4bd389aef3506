//! Checkpoint keys: the private key that signs checkpoints and the public
//! keys that verify them (old keys included after a rotation).

use aws_lc_rs::signature::{self, EcdsaKeyPair, Ed25519KeyPair, KeyPair, UnparsedPublicKey};
use base64::Engine;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{PrivateKeyDer, SubjectPublicKeyInfoDer};

use super::format::Checkpoint;
use super::AuditError;
use crate::primitives::{pem_encode, sha256};

/// The key that signs checkpoints: ECDSA P-256 or Ed25519, PKCS#8 PEM.
#[derive(Debug)]
pub enum CheckpointKey {
    EcdsaP256(EcdsaKeyPair),
    Ed25519(Ed25519KeyPair),
}

impl CheckpointKey {
    pub fn from_pem(pem: &[u8]) -> Result<Self, AuditError> {
        let der =
            match PrivateKeyDer::from_pem_slice(pem) {
                Ok(PrivateKeyDer::Pkcs8(k)) => k,
                // What Helm's genPrivateKey "ecdsa" writes (the chart's default key).
                Ok(PrivateKeyDer::Sec1(k)) => {
                    return EcdsaKeyPair::from_private_key_der(
                        &signature::ECDSA_P256_SHA256_ASN1_SIGNING,
                        k.secret_sec1_der(),
                    )
                    .map(Self::EcdsaP256)
                    .map_err(|_| AuditError("checkpoint key: EC key is not P-256".into()))
                }
                Ok(_) => return Err(AuditError(
                    "checkpoint key must be PKCS#8 (BEGIN PRIVATE KEY) or a P-256 EC PRIVATE KEY"
                        .into(),
                )),
                Err(e) => return Err(AuditError(format!("checkpoint key: {e}"))),
            };
        if let Ok(k) = EcdsaKeyPair::from_pkcs8(
            &signature::ECDSA_P256_SHA256_ASN1_SIGNING,
            der.secret_pkcs8_der(),
        ) {
            return Ok(Self::EcdsaP256(k));
        }
        Ed25519KeyPair::from_pkcs8(der.secret_pkcs8_der())
            .map(Self::Ed25519)
            .map_err(|_| AuditError("checkpoint key must be ECDSA P-256 or Ed25519".into()))
    }

    /// Generates a new ECDSA P-256 key as PKCS#8 PEM (`meshca audit keygen`).
    pub fn generate_pem() -> Result<String, AuditError> {
        let doc = EcdsaKeyPair::generate_pkcs8(
            &signature::ECDSA_P256_SHA256_ASN1_SIGNING,
            &aws_lc_rs::rand::SystemRandom::new(),
        )
        .map_err(|_| AuditError("key generation failed".into()))?;
        Ok(pem_encode("PRIVATE KEY", doc.as_ref()))
    }

    pub fn alg(&self) -> &'static str {
        match self {
            Self::EcdsaP256(_) => "ecdsa-p256-sha256",
            Self::Ed25519(_) => "ed25519",
        }
    }

    /// The public key as a verifier holds it.
    pub fn verify_key(&self) -> VerifyKey {
        match self {
            Self::EcdsaP256(k) => VerifyKey {
                alg: "ecdsa-p256-sha256",
                public: k.public_key().as_ref().to_vec(),
            },
            Self::Ed25519(k) => VerifyKey {
                alg: "ed25519",
                public: k.public_key().as_ref().to_vec(),
            },
        }
    }

    pub(crate) fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, AuditError> {
        match self {
            Self::EcdsaP256(k) => k
                .sign(&aws_lc_rs::rand::SystemRandom::new(), msg)
                .map(|s| s.as_ref().to_vec())
                .map_err(|_| AuditError("checkpoint signing failed".into())),
            Self::Ed25519(k) => Ok(k.sign(msg).as_ref().to_vec()),
        }
    }
}

/// A public key that verifies checkpoint signatures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyKey {
    pub alg: &'static str,
    /// Raw public key (uncompressed EC point or Ed25519 bytes).
    pub public: Vec<u8>,
}

impl VerifyKey {
    /// Reads a `PUBLIC KEY` (SPKI) PEM, or the private key PEM itself.
    pub fn from_pem(pem: &[u8]) -> Result<Self, AuditError> {
        if let Ok(spki) = SubjectPublicKeyInfoDer::from_pem_slice(pem) {
            use x509_parser::prelude::FromDer;
            let (_, parsed) = x509_parser::x509::SubjectPublicKeyInfo::from_der(spki.as_ref())
                .map_err(|_| AuditError("malformed public key".into()))?;
            let alg = match parsed.algorithm.algorithm.to_id_string().as_str() {
                "1.2.840.10045.2.1" => "ecdsa-p256-sha256",
                "1.3.101.112" => "ed25519",
                other => {
                    return Err(AuditError(format!(
                        "unsupported public key algorithm {other}"
                    )))
                }
            };
            return Ok(Self {
                alg,
                public: parsed.subject_public_key.data.to_vec(),
            });
        }
        Ok(CheckpointKey::from_pem(pem)?.verify_key())
    }

    /// Short id written into checkpoints.
    pub fn key_id(&self) -> String {
        hex::encode(&sha256(&self.public)[..8])
    }

    /// `PUBLIC KEY` PEM.
    pub fn to_pem(&self) -> String {
        let spki = match self.alg {
            "ed25519" => [
                &[
                    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
                ][..],
                &self.public,
            ]
            .concat(),
            _ => [
                &[
                    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01,
                    0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
                ][..],
                &self.public,
            ]
            .concat(),
        };
        pem_encode("PUBLIC KEY", &spki)
    }

    pub fn verify(&self, msg: &[u8], sig: &[u8]) -> bool {
        let alg: &dyn signature::VerificationAlgorithm = match self.alg {
            "ed25519" => &signature::ED25519,
            _ => &signature::ECDSA_P256_SHA256_ASN1,
        };
        UnparsedPublicKey::new(alg, &self.public)
            .verify(msg, sig)
            .is_ok()
    }
}

/// Checks one checkpoint's signature against the key its `key_id` names:
/// `Ok(false)` when no keys are given (signatures not checked).
pub(crate) fn check_signature(cp: &Checkpoint, keys: &[VerifyKey]) -> Result<bool, String> {
    if keys.is_empty() {
        return Ok(false);
    }
    let ids = || {
        keys.iter()
            .map(VerifyKey::key_id)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some(k) = keys
        .iter()
        .find(|k| cp.key_id.as_deref() == Some(k.key_id().as_str()))
    else {
        return Err(format!(
            "checkpoint names alg {} key {}, which is not among the given keys ({})",
            cp.alg,
            cp.key_id.as_deref().unwrap_or("(none)"),
            ids()
        ));
    };
    // v1 checkpoints do not sign `alg` and `key_id`: bind them to the key.
    if cp.alg != k.alg {
        return Err(format!(
            "checkpoint names alg {} for key {}, which is a {} key",
            cp.alg,
            k.key_id(),
            k.alg
        ));
    }
    let Some(sig) = &cp.sig else {
        return Err("checkpoint is not signed but a key was given".into());
    };
    let sig = base64::engine::general_purpose::STANDARD
        .decode(sig)
        .map_err(|_| "checkpoint signature is not base64".to_string())?;
    if !k.verify(&cp.message(), &sig) {
        return Err(format!(
            "checkpoint signature does not verify with key {} (the key it names)",
            k.key_id()
        ));
    }
    Ok(true)
}
