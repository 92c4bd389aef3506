//! Certificate authority: key material, CSR policy, validity rules, signing.

pub mod bundle;
pub mod chain;
pub mod constraints;
pub mod csr;
pub mod custody;
pub mod generate;
pub mod issuing;
pub mod metrics;
pub mod own;
pub mod serial;
pub mod signer;
pub mod store;
pub mod ttl;

pub use bundle::{CaBundle, IssuedLeaf, MaterialError, SignError};
pub use csr::{CsrError, CsrPolicy, VerifiedCsr};
pub use store::CaStore;
pub use ttl::{TtlError, TtlPolicy, Validity};

use time::OffsetDateTime;
use x509_parser::prelude::X509Certificate;

use crate::audit::{AuditRecord, Decision};

/// A certificate meshca mints for itself rather than for a caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MintedKind {
    /// The gRPC port's serving certificate.
    Serving,
    /// A two-tier issuing CA.
    IssuingCa,
    /// Dev mode's client certificate.
    DevClient,
}

/// The `allow` audit record of a certificate `issuer` signed for meshca
/// itself: the certificate's serial, key hash and validity as `cert` states
/// them (left out when it is `None`, a certificate that did not parse), its
/// PEM, and the issuer's key id and signer. Callers add what only they
/// know (names, identity), and bound the record.
pub fn minted_record(
    kind: MintedKind,
    now: OffsetDateTime,
    issuer: &CaBundle,
    cert: Option<&X509Certificate<'_>>,
    pem: String,
) -> AuditRecord {
    let (reason, issued_kind) = match kind {
        MintedKind::Serving => ("serving_cert_issued", "serving"),
        MintedKind::IssuingCa => ("issuing_ca_issued", "issuing_ca"),
        MintedKind::DevClient => ("dev_client_issued", "dev_client"),
    };
    let mut r = AuditRecord::new(
        now,
        crate::audit::random_id(),
        Decision::Allow,
        reason.into(),
    );
    if let Some(c) = cert {
        r.serial = Some(serial_hex(c.raw_serial()));
        r.spki_sha256 = Some(hex::encode(crate::primitives::sha256(c.public_key().raw)));
        r.not_before = Some(c.validity().not_before.to_datetime());
        r.not_after = Some(c.validity().not_after.to_datetime());
    }
    r.issuer_key_id = Some(issuer.key_id().to_string());
    r.issued_kind = Some(issued_kind.into());
    r.signer = Some(issuer.signer().kind().into());
    r.certificate = Some(pem);
    r
}

/// A serial number as Go's `big.Int.Text(16)` prints it (what istioctl and
/// ztunnel show): lower-case hex without leading zeros.
pub fn serial_hex(bytes: &[u8]) -> String {
    let s = hex::encode(bytes);
    match s.trim_start_matches('0') {
        "" => "0".into(),
        t => t.into(),
    }
}
