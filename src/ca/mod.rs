//! Certificate authority: key material, CSR policy, validity rules, signing.

pub mod bundle;
pub mod chain;
pub mod constraints;
pub mod csr;
pub mod custody;
pub mod generate;
pub mod issuing;
pub mod metrics;
pub mod serial;
pub mod signer;
pub mod store;
pub mod ttl;

pub use bundle::{CaBundle, IssuedLeaf, MaterialError, SignError};
pub use csr::{CsrError, CsrPolicy, VerifiedCsr};
pub use store::CaStore;
pub use ttl::{TtlError, TtlPolicy, Validity};

/// A serial number as Go's `big.Int.Text(16)` prints it (what istioctl and
/// ztunnel show): lower-case hex without leading zeros.
pub fn serial_hex(bytes: &[u8]) -> String {
    let s = hex::encode(bytes);
    match s.trim_start_matches('0') {
        "" => "0".into(),
        t => t.into(),
    }
}
