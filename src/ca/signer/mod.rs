//! The signing-key boundary. Whatever holds a CA key (a PEM file, process
//! memory, a PKCS#11 token; a cloud KMS would be one more module here) takes
//! the to-be-signed bytes of a certificate and returns the signature, and
//! says which algorithm and public key it signs with. Certificate building
//! stays in rcgen; [`SignerKey`] plugs a signer into it as a remote key.

use std::sync::Arc;

pub mod file;
pub mod memory;
pub mod pkcs11;
pub mod uri;

/// The key types a CA key may have (what Istio's `cacerts` accept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyAlgorithm {
    EcdsaP256,
    EcdsaP384,
    /// RSA with PKCS#1 v1.5 and SHA-256 signatures.
    Rsa,
}

impl KeyAlgorithm {
    pub fn rcgen(self) -> &'static rcgen::SignatureAlgorithm {
        match self {
            Self::EcdsaP256 => &rcgen::PKCS_ECDSA_P256_SHA256,
            Self::EcdsaP384 => &rcgen::PKCS_ECDSA_P384_SHA384,
            Self::Rsa => &rcgen::PKCS_RSA_SHA256,
        }
    }

    /// The name audit records and logs use (as `CaBundle::key_algorithm`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::EcdsaP256 => "ecdsa-p256",
            Self::EcdsaP384 => "ecdsa-p384",
            Self::Rsa => "rsa",
        }
    }

    /// Size of one ECDSA coordinate (r or s) in bytes.
    pub(crate) fn ec_field_len(self) -> Option<usize> {
        match self {
            Self::EcdsaP256 => Some(32),
            Self::EcdsaP384 => Some(48),
            Self::Rsa => None,
        }
    }
}

/// Why a signer could not be set up or could not sign. Startup errors name
/// what is wrong (token, key, PIN, module) so an operator can fix it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SignerError {
    #[error("CA key file {path} is readable by others or by a group this process is not in (mode {mode:o}); make it owner-only (chmod 600), or 0440 with the pod's fsGroup on the Secret volume, or set MESHCA_SIGNER_ALLOW_SHARED_KEY_FILE=true")]
    KeyFileMode { path: String, mode: u32 },
    #[error("CA key file: {0}")]
    KeyFile(String),
    #[error("unsupported CA key: {0}")]
    Unsupported(String),
    #[error("signer URI: {0}")]
    Uri(String),
    #[error("PKCS#11 PIN: {0}")]
    Pin(String),
    #[error("PKCS#11 module {path}: {detail}")]
    Module { path: String, detail: String },
    #[error("PKCS#11 token {wanted} not found; tokens present: [{}]", .present.join(", "))]
    TokenNotFound {
        wanted: String,
        present: Vec<String>,
    },
    #[error("PKCS#11 login to token {0} failed: the PIN is incorrect")]
    PinIncorrect(String),
    #[error("PKCS#11 token {0}: the user PIN is locked")]
    PinLocked(String),
    #[error("PKCS#11 token {token}: no private key with {what}")]
    KeyNotFound { token: String, what: String },
    #[error("PKCS#11 token {token}: {count} private keys match {what}; give a more specific object or id")]
    KeyAmbiguous {
        token: String,
        what: String,
        count: usize,
    },
    #[error("PKCS#11 token {token}: no public key object for {what} (needed to check it matches the certificate)")]
    PublicKeyNotFound { token: String, what: String },
    #[error("signing key unavailable: {0}")]
    Unavailable(String),
    #[error("no PKCS#11 session free within {0:?}")]
    Busy(std::time::Duration),
    #[error("PKCS#11: {0}")]
    Device(String),
    #[error("signing failed: {0}")]
    Crypto(String),
    /// A directory names a token key (`ca-key.uri`) while the key is a file.
    #[error("{0} names a key in a token, but MESHCA_SIGNER is file; remove it, or set MESHCA_SIGNER to the token's pkcs11: URI")]
    KeyUriWithoutToken(String),
    /// A staged generation for a token-held key does not say which key.
    #[error("the staged generation in {0} names no key in the token: add ca-key.uri (e.g. pkcs11:object=<label>; `meshca init --pkcs11` writes it), since the key MESHCA_SIGNER names signs the current generation")]
    NextKeyUnnamed(String),
}

impl SignerError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::KeyFileMode { .. } => "signer_key_file_mode",
            Self::KeyFile(_) => "signer_key_file",
            Self::Unsupported(_) => "signer_unsupported_key",
            Self::Uri(_) => "signer_uri",
            Self::Pin(_) => "signer_pin_source",
            Self::Module { .. } => "signer_module",
            Self::TokenNotFound { .. } => "signer_token_not_found",
            Self::PinIncorrect(_) => "signer_pin_incorrect",
            Self::PinLocked(_) => "signer_pin_locked",
            Self::KeyNotFound { .. } => "signer_key_not_found",
            Self::KeyAmbiguous { .. } => "signer_key_ambiguous",
            Self::PublicKeyNotFound { .. } => "signer_public_key_not_found",
            Self::Unavailable(_) => "signer_unavailable",
            Self::Busy(_) => "signer_busy",
            Self::Device(_) => "signer_device",
            Self::Crypto(_) => "signer_crypto",
            Self::KeyUriWithoutToken(_) => "signer_key_uri_without_token",
            Self::NextKeyUnnamed(_) => "signer_next_key_unnamed",
        }
    }
}

/// A CA signing key, wherever it lives.
pub trait Signer: Send + Sync + std::fmt::Debug {
    fn algorithm(&self) -> KeyAlgorithm;
    /// The subjectPublicKey bits: the uncompressed EC point, or the
    /// PKCS#1 RSAPublicKey DER.
    fn public_key(&self) -> &[u8];
    /// Signs `tbs` with the algorithm's hash; the signature is encoded as
    /// X.509 wants it (DER ECDSA-Sig-Value, or the PKCS#1 v1.5 block).
    fn sign(&self, tbs: &[u8]) -> Result<Vec<u8>, SignerError>;
    /// Which backend: `file`, `memory`, `pkcs11`.
    fn kind(&self) -> &'static str;
    /// Where the key is, for logs (never secret).
    fn describe(&self) -> String;
}

std::thread_local! {
    // rcgen's remote-key error carries no detail; the adapter leaves the
    // signer's own error here for the caller on the same thread.
    static LAST_ERROR: std::cell::RefCell<Option<SignerError>> = const { std::cell::RefCell::new(None) };
}

/// The error the last failed [`SignerKey`] signature on this thread left.
pub fn take_last_error() -> SignerError {
    LAST_ERROR
        .with(|e| e.borrow_mut().take())
        .unwrap_or_else(|| SignerError::Crypto("remote key failed".into()))
}

/// A [`Signer`] as rcgen's remote signing key.
#[derive(Debug, Clone)]
pub struct SignerKey(pub Arc<dyn Signer>);

impl SignerKey {
    pub fn signer(&self) -> &Arc<dyn Signer> {
        &self.0
    }
}

impl rcgen::PublicKeyData for SignerKey {
    fn der_bytes(&self) -> &[u8] {
        self.0.public_key()
    }
    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        self.0.algorithm().rcgen()
    }
}

impl rcgen::SigningKey for SignerKey {
    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
        self.0.sign(msg).map_err(|e| {
            LAST_ERROR.with(|slot| *slot.borrow_mut() = Some(e));
            rcgen::Error::RemoteKeyError
        })
    }
}

/// Maps an rcgen error from signing with a [`SignerKey`] to the signer's own
/// error when that is what failed.
pub fn signer_error(e: &rcgen::Error) -> Option<SignerError> {
    matches!(e, rcgen::Error::RemoteKeyError).then(take_last_error)
}

/// DER `ECDSA-Sig-Value` from the fixed-size `r || s` a PKCS#11 token returns.
pub fn ecdsa_raw_to_der(raw: &[u8], field_len: usize) -> Result<Vec<u8>, SignerError> {
    if raw.len() != 2 * field_len {
        return Err(SignerError::Crypto(format!(
            "ECDSA signature of {} bytes, expected {}",
            raw.len(),
            2 * field_len
        )));
    }
    let int = |v: &[u8]| {
        let v = &v[v.iter().position(|b| *b != 0).unwrap_or(v.len() - 1)..];
        let mut out = vec![0x02];
        let pad = v[0] & 0x80 != 0;
        out.push((v.len() + usize::from(pad)) as u8);
        if pad {
            out.push(0);
        }
        out.extend_from_slice(v);
        out
    };
    let (r, s) = raw.split_at(field_len);
    let body = [int(r), int(s)].concat();
    // At most 2 * (48 + 3) = 102 bytes (P-384): the short length form.
    let mut out = vec![0x30, body.len() as u8];
    out.extend_from_slice(&body);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test_case(0x01, "3044", "0220" ; "plain")]
    #[test_case(0x80, "3046", "022100" ; "high bit padded")]
    fn ecdsa_raw_to_der_encodes_integers(byte: u8, seq: &str, int: &str) {
        let der = hex::encode(ecdsa_raw_to_der(&[byte; 64], 32).unwrap());
        let half = format!("{int}{}", hex::encode([byte; 32]));
        assert_eq!(der, format!("{seq}{half}{half}"));
    }

    #[test]
    fn ecdsa_raw_to_der_strips_leading_zeros_and_keeps_zero() {
        let mut raw = vec![0u8; 64];
        raw[31] = 5;
        raw[63] = 0x7f;
        assert_eq!(
            hex::encode(ecdsa_raw_to_der(&raw, 32).unwrap()),
            "300602010502017f"
        );
        assert_eq!(
            hex::encode(ecdsa_raw_to_der(&[0u8; 64], 32).unwrap()),
            "3006020100020100"
        );
        assert!(ecdsa_raw_to_der(&[1u8; 63], 32).is_err());
    }

    #[test]
    fn p384_signature_of_maximum_size() {
        let der = ecdsa_raw_to_der(&[0xffu8; 96], 48).unwrap();
        assert_eq!(&der[..5], &[0x30, 102, 0x02, 49, 0x00]);
        assert_eq!(der.len(), 104);
    }
}
