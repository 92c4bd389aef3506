//! Helpers shared by unit and integration tests: throwaway PKI, CSRs, clients.

use std::path::{Path, PathBuf};

use base64::Engine;
use rcgen::{CertificateParams, CustomExtension, DistinguishedName, KeyPair, SanType};
use time::OffsetDateTime;

use crate::ca::generate::{self, InitOptions, KeyType};

/// PEM-encodes DER with 64-column lines.
pub fn pem_encode(label: &str, der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// A CSR signed by `key` with the given SANs, optionally asking for CA:true.
pub fn csr_pem(key: &KeyPair, sans: &[SanType], ca: bool) -> String {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.subject_alt_names = sans.to_vec();
    if ca {
        // basicConstraints CA:TRUE requested through the extension request.
        let mut bc = CustomExtension::from_oid_content(&[2, 5, 29, 19], vec![0x30, 0x03, 0x01, 0x01, 0xff]);
        bc.set_criticality(true);
        params.custom_extensions.push(bc);
    }
    params.serialize_request(key).expect("csr").pem().expect("pem")
}

/// A CSR for a SPIFFE id, as ztunnel and istio-agent send.
pub fn csr_for(key: &KeyPair, id: &str) -> String {
    csr_pem(key, &[SanType::URI(id.to_string().try_into().expect("uri"))], false)
}

/// A CA directory in the cacerts layout, generated now.
#[derive(Debug)]
pub struct TestPki {
    pub dir: tempfile::TempDir,
    pub ca: generate::GeneratedCa,
}

impl TestPki {
    pub fn new(key_type: KeyType) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = generate::generate(&InitOptions { key_type, ..Default::default() }, OffsetDateTime::now_utc()).expect("generate");
        generate::write_cacerts(dir.path(), &ca, false).expect("write");
        Self { dir, ca }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn path_buf(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
}
