//! A key held only in process memory (aws-lc): the two-tier issuing CA's
//! key, and the key a PEM file is loaded into. aws-lc clears key memory when
//! it frees it, so dropping the signer leaves no key bytes behind.

use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{self, EcdsaKeyPair, KeyPair, RsaKeyPair};

use super::{KeyAlgorithm, Signer, SignerError};

enum Key {
    Ecdsa(EcdsaKeyPair),
    Rsa(RsaKeyPair),
}

/// An in-memory signing key.
pub struct MemorySigner {
    key: Key,
    algorithm: KeyAlgorithm,
    public: Vec<u8>,
    kind: &'static str,
    source: String,
}

impl std::fmt::Debug for MemorySigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemorySigner")
            .field("algorithm", &self.algorithm)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

fn ecdsa_alg(a: KeyAlgorithm) -> Option<&'static signature::EcdsaSigningAlgorithm> {
    match a {
        KeyAlgorithm::EcdsaP256 => Some(&signature::ECDSA_P256_SHA256_ASN1_SIGNING),
        KeyAlgorithm::EcdsaP384 => Some(&signature::ECDSA_P384_SHA384_ASN1_SIGNING),
        KeyAlgorithm::Rsa => None,
    }
}

impl MemorySigner {
    /// A fresh ECDSA key that never leaves this process.
    pub fn generate(algorithm: KeyAlgorithm) -> Result<Self, SignerError> {
        let alg = ecdsa_alg(algorithm).ok_or_else(|| {
            SignerError::Unsupported("in-memory keys are generated as ECDSA only".into())
        })?;
        let key = EcdsaKeyPair::generate(alg)
            .map_err(|_| SignerError::Crypto("ECDSA key generation".into()))?;
        Ok(Self::ecdsa(
            key,
            algorithm,
            "memory",
            "generated in memory".into(),
        ))
    }

    fn ecdsa(
        key: EcdsaKeyPair,
        algorithm: KeyAlgorithm,
        kind: &'static str,
        source: String,
    ) -> Self {
        Self {
            public: key.public_key().as_ref().to_vec(),
            key: Key::Ecdsa(key),
            algorithm,
            kind,
            source,
        }
    }

    /// Parses a private key (PKCS#8, SEC1 or PKCS#1 DER) of `algorithm`.
    /// The caller owns and clears `der`.
    pub(crate) fn from_der(
        der: &[u8],
        pkcs1: bool,
        algorithm: KeyAlgorithm,
        kind: &'static str,
        source: String,
    ) -> Result<Self, SignerError> {
        let bad = |e: aws_lc_rs::error::KeyRejected| {
            SignerError::KeyFile(format!("not a {} private key ({e})", algorithm.as_str()))
        };
        match ecdsa_alg(algorithm) {
            Some(alg) => {
                let key = EcdsaKeyPair::from_private_key_der(alg, der).map_err(bad)?;
                Ok(Self::ecdsa(key, algorithm, kind, source))
            }
            None => {
                let key = if pkcs1 {
                    RsaKeyPair::from_der(der)
                } else {
                    RsaKeyPair::from_pkcs8(der)
                }
                .map_err(bad)?;
                Ok(Self {
                    public: key.public_key().as_ref().to_vec(),
                    key: Key::Rsa(key),
                    algorithm,
                    kind,
                    source,
                })
            }
        }
    }
}

impl Signer for MemorySigner {
    fn algorithm(&self) -> KeyAlgorithm {
        self.algorithm
    }
    fn public_key(&self) -> &[u8] {
        &self.public
    }
    fn sign(&self, tbs: &[u8]) -> Result<Vec<u8>, SignerError> {
        let rng = SystemRandom::new();
        match &self.key {
            Key::Ecdsa(k) => k
                .sign(&rng, tbs)
                .map(|s| s.as_ref().to_vec())
                .map_err(|_| SignerError::Crypto("ECDSA".into())),
            Key::Rsa(k) => {
                let mut sig = vec![0; k.public_modulus_len()];
                k.sign(&signature::RSA_PKCS1_SHA256, &rng, tbs, &mut sig)
                    .map_err(|_| SignerError::Crypto("RSA".into()))?;
                Ok(sig)
            }
        }
    }
    fn kind(&self) -> &'static str {
        self.kind
    }
    fn describe(&self) -> String {
        self.source.clone()
    }
}
