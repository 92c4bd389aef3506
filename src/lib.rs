//! meshca: a certificate authority that speaks Istio's CA protocol
//! (`istio.v1.auth.IstioCertificateService/CreateCertificate`).
//!
//! Modules follow the request path: [`authn`] (who is calling), [`authz`]
//! (may a node proxy impersonate), [`ca`] (CSR policy, validity, signing),
//! [`issue`] (the use case), [`grpc`] (the wire), [`audit`] (one record per call).

pub mod admission;
pub mod app;
pub mod audit;
pub mod authn;
pub mod authz;
pub mod ca;
pub mod certs;
pub mod cluster;
pub mod config;
pub mod ctb;
pub mod denylist;
pub mod flags;
pub mod grpc;
pub mod guards;
pub mod http;
pub mod identity;
pub mod issue;
pub mod lifetime;
pub mod metrics;
pub mod outcome;
pub mod podcert;
pub mod podindex;
pub mod primitives;
pub mod proto;
pub mod ratelimit;
pub mod renewal;
pub mod revocation;
pub mod rootpub;
pub mod rotation;
pub mod table;
pub mod telemetry;
pub mod tls;
pub mod transport;

// The load generator behind the meshca-bench binary: never in the release
// `meshca` (it signs client certificates without an audit record).
#[cfg(feature = "bench")]
pub mod bench;
#[cfg(any(test, feature = "testing"))]
pub mod fuzzing;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
