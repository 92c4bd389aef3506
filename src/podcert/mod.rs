//! The PodCertificateRequest signer (Kubernetes 1.35+ `v1beta1`, GA `v1` in
//! 1.37): the kubelet makes a key for a pod and asks a named signer; meshca,
//! when `--pod-certificate-signer` names it, answers with the same SPIFFE
//! X509-SVID CreateCertificate issues, from the same CA, checked against the
//! same pod index and kill switch, in the same audit log.
//!
//! [`decide`] is the pure decision, [`key`] reads the requested key,
//! [`claim`] makes one replica the decider of a request, and
//! [`controller`] watches the requests and writes their status. The trust
//! bundle is published by [`crate::ctb`].

pub mod args;
pub mod claim;
pub mod controller;
pub mod decide;
pub mod key;
pub mod metrics;

pub use crate::ctb::{parse_signer_name, trust_bundle_name, SignerNameError, TRUST_BUNDLE_SUFFIX};
pub use args::PodCertArgs;

use std::time::Duration;

use crate::ca::ttl::JitterBand;

/// The audit record's `authn_method` for pod certificate decisions: the
/// API server authenticated the requester (a kubelet, under NodeRestriction).
pub const AUTHN_METHOD: &str = "pod-certificate-request";

/// The signer's settings, parsed once from flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodCertSettings {
    /// The domain-prefixed signer name meshca answers for.
    pub signer_name: String,
    /// Wanted certificate lifetime (cut to the request's maxExpirationSeconds, at least 1 h).
    pub lifetime: Duration,
    /// `beginRefreshAt` is drawn from this band of the lifetime.
    pub refresh_band: JitterBand,
    /// How long a request for a pod the index does not know is waited for.
    pub pod_wait: Duration,
    /// Requests signed and written concurrently.
    pub workers: usize,
    /// Publish the root bundle as a signer-linked ClusterTrustBundle.
    pub trust_bundle: bool,
    /// Full re-check period of the ClusterTrustBundle.
    pub trust_bundle_resync: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test_case("meshca.io/spiffe", true ; "plain")]
    #[test_case("meshca.example.com/mesh/spiffe", true ; "nested path")]
    #[test_case("spiffe", false ; "no domain")]
    #[test_case("meshca/spiffe", false ; "unqualified domain")]
    #[test_case("kubernetes.io/kube-apiserver-client-pod", false ; "reserved")]
    #[test_case("x.kubernetes.io/a", false ; "reserved subdomain")]
    #[test_case("meshca.io/", false ; "empty path")]
    #[test_case("meshca.io/a//b", false ; "empty segment")]
    #[test_case("meshca.io/a/../b", false ; "dot dot")]
    #[test_case("Meshca.io/a", false ; "upper case domain")]
    #[test_case("meshca.io/a b", false ; "space")]
    fn signer_names(name: &str, ok: bool) {
        assert_eq!(parse_signer_name(name).is_ok(), ok, "{name}");
    }

    #[test]
    fn trust_bundle_names_carry_the_signer() {
        assert_eq!(
            trust_bundle_name("meshca.io/spiffe"),
            "meshca.io:spiffe:root-cert"
        );
        assert_eq!(
            trust_bundle_name("meshca.example.com/mesh/spiffe"),
            "meshca.example.com:mesh:spiffe:root-cert"
        );
    }
}
