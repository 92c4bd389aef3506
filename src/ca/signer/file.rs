//! The CA key as a PEM file (Istio's `ca-key.pem` or `tls.key`): checked
//! to be owner-only, decoded into buffers that are zeroed after use, and
//! held as an in-memory aws-lc key.

use std::path::Path;

use rustls_pki_types::pem::SectionKind;
use zeroize::Zeroizing;

use super::memory::MemorySigner;
use super::{KeyAlgorithm, SignerError};

/// Refuses a key file that others may read, or whose group may read it
/// when that group is not one of this process's own (a Secret volume with
/// `defaultMode: 0440` and the pod's `fsGroup` is fine). Symlinks, such as a
/// Secret volume's `..data` link, are followed.
pub fn check_mode(path: &Path, allow_shared: bool) -> Result<(), SignerError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let meta = std::fs::metadata(path)
            .map_err(|e| SignerError::KeyFile(format!("{}: {e}", path.display())))?;
        let mode = meta.permissions().mode() & 0o777;
        if !allow_shared && shared(mode, own_groups().contains(&meta.gid())) {
            return Err(SignerError::KeyFileMode {
                path: path.display().to_string(),
                mode,
            });
        }
    }
    Ok(())
}

/// Whether a key file with `mode` is readable beyond this process: by
/// others, or by a group the process is not in.
pub fn shared(mode: u32, group_is_ours: bool) -> bool {
    mode & 0o004 != 0 || (mode & 0o040 != 0 && !group_is_ours)
}

/// This process's group ids (Linux: /proc/self/status; elsewhere none, so
/// any group-readable key file is refused).
fn own_groups() -> Vec<u32> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .filter_map(|l| l.strip_prefix("Gid:").or_else(|| l.strip_prefix("Groups:")))
        .flat_map(|rest| rest.split_whitespace().filter_map(|g| g.parse().ok()))
        .collect()
}

/// Loads the first private key in `pem` for `algorithm`. Every decoded copy
/// of the key is zeroed before this returns.
pub fn from_pem(
    pem: &str,
    algorithm: KeyAlgorithm,
    source: &str,
) -> Result<MemorySigner, SignerError> {
    let mut rd = pem.as_bytes();
    loop {
        let section = rustls_pki_types::pem::from_buf(&mut rd)
            .map_err(|e| SignerError::KeyFile(format!("bad PEM ({e})")))?;
        let Some((kind, der)) = section else {
            return Err(SignerError::KeyFile("no private key PEM block".into()));
        };
        let der = Zeroizing::new(der);
        let pkcs1 = match kind {
            SectionKind::PrivateKey | SectionKind::EcPrivateKey => false,
            SectionKind::RsaPrivateKey => true,
            _ => continue,
        };
        return MemorySigner::from_der(&der, pkcs1, algorithm, "file", source.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::signer::Signer;
    use test_case::test_case;

    #[test_case(0o600, false, false)]
    #[test_case(0o400, false, false)]
    #[test_case(0o700, false, false)]
    #[test_case(0o640, true, false ; "group read, our group")]
    #[test_case(0o440, true, false ; "secret volume with fsGroup")]
    #[test_case(0o640, false, true ; "group read, foreign group")]
    #[test_case(0o604, true, true ; "others read")]
    #[test_case(0o644, true, true)]
    fn shared_modes(mode: u32, ours: bool, want: bool) {
        assert_eq!(shared(mode, ours), want);
    }

    #[cfg(unix)]
    #[test]
    fn a_world_readable_key_file_is_refused_unless_allowed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ca-key.pem");
        std::fs::write(&p, "x").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = check_mode(&p, false).unwrap_err();
        assert_eq!(err.reason(), "signer_key_file_mode");
        assert!(err.to_string().contains("644"), "{err}");
        check_mode(&p, true).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        check_mode(&p, false).unwrap();
    }

    #[test_case(crate::ca::generate::KeyType::EcdsaP256, KeyAlgorithm::EcdsaP256)]
    #[test_case(crate::ca::generate::KeyType::EcdsaP384, KeyAlgorithm::EcdsaP384)]
    #[test_case(crate::ca::generate::KeyType::Rsa2048, KeyAlgorithm::Rsa)]
    fn pem_keys_load_and_match_their_public_key(
        kt: crate::ca::generate::KeyType,
        alg: KeyAlgorithm,
    ) {
        let key = kt.generate().unwrap();
        let s = from_pem(&key.serialize_pem(), alg, "test").unwrap();
        assert_eq!(s.public_key(), rcgen::PublicKeyData::der_bytes(&key));
        assert!(!s.sign(b"tbs").unwrap().is_empty());
        // The same key as the wrong type is refused, not misused.
        let other = if alg == KeyAlgorithm::Rsa {
            KeyAlgorithm::EcdsaP256
        } else {
            KeyAlgorithm::Rsa
        };
        assert_eq!(
            from_pem(&key.serialize_pem(), other, "test")
                .unwrap_err()
                .reason(),
            "signer_key_file"
        );
    }

    #[test]
    fn pem_without_a_key_is_an_error() {
        let err = from_pem(
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            KeyAlgorithm::EcdsaP256,
            "t",
        )
        .unwrap_err();
        assert_eq!(err.reason(), "signer_key_file");
        assert!(from_pem("", KeyAlgorithm::EcdsaP256, "t").is_err());
    }
}
