//! Certificate authority: key material, CSR policy, validity rules, signing.

pub mod bundle;
pub mod chain;
pub mod csr;
pub mod generate;
pub mod store;
pub mod ttl;

pub use bundle::{CaBundle, IssuedLeaf, MaterialError, SignError};
pub use csr::{CsrError, CsrPolicy, VerifiedCsr};
pub use store::CaStore;
pub use ttl::{TtlError, TtlPolicy, Validity};
