//! SPIFFE workload identities (`spiffe://<trust domain>/ns/<ns>/sa/<sa>`).

use std::fmt;
use std::str::FromStr;

use crate::flags::{err, list, ConfigError};

/// Why a string is not a workload SPIFFE id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("identity does not start with spiffe://")]
    MissingScheme,
    #[error("identity is not of the form spiffe://<td>/ns/<ns>/sa/<sa>")]
    WrongShape,
    #[error("identity has an empty or invalid segment")]
    InvalidSegment,
    #[error("trust domain is empty or invalid")]
    InvalidTrustDomain,
}

impl IdentityError {
    /// Stable reason code for audit records and metric labels.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::MissingScheme => "identity_missing_scheme",
            Self::WrongShape => "identity_wrong_shape",
            Self::InvalidSegment => "identity_invalid_segment",
            Self::InvalidTrustDomain => "identity_invalid_trust_domain",
        }
    }
}

/// A SPIFFE trust domain, lower-cased; istiod replaces `@` with `.`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TrustDomain(String);

impl TrustDomain {
    /// Parses a configured trust domain the way istiod sanitises mesh config
    /// (`@` becomes `.`, case folded).
    pub fn new(s: &str) -> Result<Self, IdentityError> {
        Self::strict(&s.replace('@', ".").to_ascii_lowercase())
    }

    /// Parses a trust domain as written in a SPIFFE id: lower case only, so the
    /// issued SAN is byte-identical to the requested string.
    pub fn strict(td: &str) -> Result<Self, IdentityError> {
        let valid = !td.is_empty()
            && td.len() <= 255
            && td.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_')
            });
        if valid {
            Ok(Self(td.to_string()))
        } else {
            Err(IdentityError::InvalidTrustDomain)
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TrustDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A Kubernetes workload identity in SPIFFE form.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpiffeId {
    trust_domain: TrustDomain,
    namespace: String,
    service_account: String,
}

impl SpiffeId {
    pub fn new(
        trust_domain: TrustDomain,
        namespace: &str,
        service_account: &str,
    ) -> Result<Self, IdentityError> {
        if !valid_segment(namespace) || !valid_segment(service_account) {
            return Err(IdentityError::InvalidSegment);
        }
        Ok(Self {
            trust_domain,
            namespace: namespace.to_string(),
            service_account: service_account.to_string(),
        })
    }

    pub fn trust_domain(&self) -> &TrustDomain {
        &self.trust_domain
    }
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
    pub fn service_account(&self) -> &str {
        &self.service_account
    }
}

// Stricter than istiod's ParseIdentity (which accepts empty segments and any
// characters): segments must be non-empty and made of path-safe characters, so
// a requested identity can never smuggle a comma (istiod splits SANs on commas)
// or a slash into the issued certificate.
fn valid_segment(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
}

impl FromStr for SpiffeId {
    type Err = IdentityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let rest = s
            .strip_prefix("spiffe://")
            .ok_or(IdentityError::MissingScheme)?;
        let parts: Vec<&str> = rest.split('/').collect();
        match parts.as_slice() {
            [td, "ns", ns, "sa", sa] => Self::new(TrustDomain::strict(td)?, ns, sa),
            _ => Err(IdentityError::WrongShape),
        }
    }
}

impl fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}

/// The mesh trust domain and its aliases (`TRUST_DOMAIN`,
/// `TRUST_DOMAIN_ALIASES`). Authorization accepts an identity in any of
/// them as the same workload, so every place that matches identities (the
/// denylist, `meshca revoke`, `meshca audit query`) compares them in the
/// canonical form: the trust domain resolved to the mesh one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustDomains {
    pub mesh: TrustDomain,
    pub aliases: Vec<TrustDomain>,
}

impl TrustDomains {
    pub fn new(mesh: TrustDomain, aliases: Vec<TrustDomain>) -> Self {
        Self { mesh, aliases }
    }

    /// Only the mesh trust domain: nothing is an alias.
    pub fn mesh_only(mesh: TrustDomain) -> Self {
        Self::new(mesh, Vec::new())
    }

    /// `id` with an alias trust domain replaced by the mesh trust domain;
    /// any other trust domain is left as it is (it names another mesh).
    pub fn canonical(&self, id: &SpiffeId) -> SpiffeId {
        if self.aliases.contains(id.trust_domain()) && *id.trust_domain() != self.mesh {
            SpiffeId {
                trust_domain: self.mesh.clone(),
                ..id.clone()
            }
        } else {
            id.clone()
        }
    }

    /// [`Self::canonical`] of a string that parses as a workload identity;
    /// anything else is returned unchanged (compared as written).
    pub fn canonical_str(&self, s: &str) -> String {
        match s.parse::<SpiffeId>() {
            Ok(id) => self.canonical(&id).to_string(),
            Err(_) => s.to_string(),
        }
    }
}

/// The trust domains of the offline tools (`meshca revoke`, `meshca audit
/// query`), from the same flags and environment as `serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct TrustDomainArgs {
    /// Mesh trust domain.
    #[arg(long, env = "TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,
    /// Trust domains that name the same workloads as the mesh one (comma-separated).
    #[arg(long, env = "TRUST_DOMAIN_ALIASES", default_value = "")]
    pub trust_domain_aliases: String,
}

impl TrustDomainArgs {
    pub fn parse(&self) -> Result<TrustDomains, ConfigError> {
        let mesh = TrustDomain::new(&self.trust_domain)
            .map_err(|e| err("TRUST_DOMAIN", &self.trust_domain, e.to_string()))?;
        let aliases = list(&self.trust_domain_aliases)
            .map(|s| TrustDomain::new(s).map_err(|e| err("TRUST_DOMAIN_ALIASES", s, e.to_string())))
            .collect::<Result<_, _>>()?;
        Ok(TrustDomains::new(mesh, aliases))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test_case("spiffe://cluster.local/ns/default/sa/app" ; "plain")]
    #[test_case("spiffe://example.com/ns/istio-system/sa/ztunnel" ; "other domain")]
    fn round_trips(s: &str) {
        let id: SpiffeId = s.parse().unwrap();
        assert_eq!(id.to_string(), s);
    }

    #[test_case("cluster.local/ns/a/sa/b", IdentityError::MissingScheme ; "no scheme")]
    #[test_case("spiffe://cluster.local/ns/a/sa", IdentityError::WrongShape ; "too short")]
    #[test_case("spiffe://cluster.local/ns/a/sa/b/c", IdentityError::WrongShape ; "too long")]
    #[test_case("spiffe://cluster.local/namespace/a/sa/b", IdentityError::WrongShape ; "wrong ns key")]
    #[test_case("spiffe://cluster.local/ns//sa/b", IdentityError::InvalidSegment ; "empty ns")]
    #[test_case("spiffe://cluster.local/ns/a/sa/", IdentityError::InvalidSegment ; "empty sa")]
    #[test_case("spiffe://a,b/ns/x/sa/y", IdentityError::InvalidTrustDomain ; "comma in td")]
    #[test_case("spiffe:///ns/x/sa/y", IdentityError::InvalidTrustDomain ; "empty td")]
    #[test_case("spiffe://td/ns/x y/sa/y", IdentityError::InvalidSegment ; "space")]
    #[test_case("spiffe://Cluster.Local/ns/x/sa/y", IdentityError::InvalidTrustDomain ; "upper case td")]
    fn rejects(s: &str, want: IdentityError) {
        assert_eq!(s.parse::<SpiffeId>().unwrap_err(), want);
    }

    #[test]
    fn trust_domain_sanitised_like_istiod() {
        assert_eq!(TrustDomain::new("Foo@Bar").unwrap().as_str(), "foo.bar");
    }

    #[test_case("spiffe://cluster.local/ns/a/sa/b", "spiffe://cluster.local/ns/a/sa/b" ; "mesh")]
    #[test_case("spiffe://alias.local/ns/a/sa/b", "spiffe://cluster.local/ns/a/sa/b" ; "alias")]
    #[test_case("spiffe://old.example/ns/a/sa/b", "spiffe://cluster.local/ns/a/sa/b" ; "second alias")]
    #[test_case("spiffe://other.mesh/ns/a/sa/b", "spiffe://other.mesh/ns/a/sa/b" ; "foreign stays")]
    #[test_case("spiffe://alias.local/ns/a", "spiffe://alias.local/ns/a" ; "not an identity stays")]
    fn canonical_identities(input: &str, want: &str) {
        let tds = TrustDomains::new(
            TrustDomain::new("cluster.local").unwrap(),
            vec![
                TrustDomain::new("alias.local").unwrap(),
                TrustDomain::new("old.example").unwrap(),
            ],
        );
        assert_eq!(tds.canonical_str(input), want);
        let none = TrustDomains::mesh_only(TrustDomain::new("cluster.local").unwrap());
        assert_eq!(none.canonical_str(input), input, "no aliases: unchanged");
    }
}
