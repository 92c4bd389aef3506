//! What the revocation tests read back: the serials `meshca revoke` prints
//! and those a published CRL lists. Shared by tests/revoke_cli.rs (no
//! Kubernetes) and tests/kube_revoke.rs.
#![allow(dead_code, clippy::unwrap_used)]

use rustls_pki_types::pem::PemObject;

/// The serials a successful `meshca revoke` printed (the first column of
/// each line), sorted.
#[track_caller]
pub fn printed_serials(out: &std::process::Output) -> Vec<String> {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut serials: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split('\t').next().unwrap().to_string())
        .collect();
    serials.sort();
    serials
}

/// The CRL number (0 without one) and the serials, in order, of the CRL in `pem`.
pub fn crl(pem: &str) -> (u128, Vec<String>) {
    let der =
        rustls_pki_types::CertificateRevocationListDer::from_pem_slice(pem.as_bytes()).unwrap();
    let (_, crl) = x509_parser::parse_x509_crl(&der).unwrap();
    let number = crl
        .crl_number()
        .map(|n| {
            n.to_bytes_be()
                .iter()
                .fold(0u128, |a, b| (a << 8) | u128::from(*b))
        })
        .unwrap_or(0);
    let serials = crl
        .iter_revoked_certificates()
        .map(|r| meshca::ca::serial_hex(r.raw_serial()))
        .collect();
    (number, serials)
}

/// The JSON records `meshca audit query -o json` printed.
pub fn json_lines(out: &std::process::Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}
