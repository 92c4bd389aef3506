//! SPIFFE workload identities (`spiffe://<trust domain>/ns/<ns>/sa/<sa>`).

use std::fmt;
use std::str::FromStr;

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
}
