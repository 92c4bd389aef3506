//! URI name constraints on the signing path (RFC 5280 §4.2.1.10), the
//! standard way to confine an intermediate under a shared root to
//! `spiffe://<trust domain>/…`.
//!
//! webpki (0.103) does not implement URI constraints and fails closed: any
//! leaf with a URI SAN under a URI-constrained CA is a
//! `NameConstraintViolation`. So meshca verifies paths with webpki using a
//! probe leaf without SANs, and evaluates URI constraints here, before it
//! signs, with the rule Go's crypto/x509 and BoringSSL apply: the constraint
//! names a host; `host` matches exactly, `.domain` matches any host below it.

use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::prelude::{FromDer, X509Certificate};

/// The URI subtrees of one CA certificate.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UriConstraints {
    /// Subject of the CA, for error messages.
    pub ca: String,
    pub permitted: Vec<String>,
    pub excluded: Vec<String>,
}

impl UriConstraints {
    /// Whether `uri` satisfies this CA's constraints (no URI subtrees: yes).
    pub fn allows(&self, uri: &str) -> bool {
        let Some(host) = uri_host(uri) else {
            // A URI without an authority cannot match any host constraint.
            return self.permitted.is_empty() && self.excluded.is_empty();
        };
        if self.excluded.iter().any(|c| host_matches(&host, c)) {
            return false;
        }
        self.permitted.is_empty() || self.permitted.iter().any(|c| host_matches(&host, c))
    }
}

/// Reads the URI subtrees of `der`; `Ok(None)` when it has none. A URI
/// constraint that is not a host name (e.g. written as `spiffe://td`) is an
/// error: Go and BoringSSL reject such a certificate, so every leaf under it
/// would be refused by clients.
pub fn uri_constraints(der: &[u8]) -> Result<Option<UriConstraints>, String> {
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| e.to_string())?;
    let mut out = UriConstraints {
        ca: cert.subject().to_string(),
        ..Default::default()
    };
    for ext in cert.extensions() {
        let ParsedExtension::NameConstraints(nc) = ext.parsed_extension() else {
            continue;
        };
        for (subtrees, into) in [
            (&nc.permitted_subtrees, &mut out.permitted),
            (&nc.excluded_subtrees, &mut out.excluded),
        ] {
            for st in subtrees.iter().flatten() {
                if let GeneralName::URI(c) = st.base {
                    if !valid_host_constraint(c) {
                        return Err(format!(
                            "{}: URI constraint {c:?} must be a host name such as \"cluster.local\" or \".example.org\" (RFC 5280 4.2.1.10), not a URI",
                            out.ca
                        ));
                    }
                    into.push(c.to_ascii_lowercase());
                }
            }
        }
    }
    Ok((!out.permitted.is_empty() || !out.excluded.is_empty()).then_some(out))
}

fn valid_host_constraint(c: &str) -> bool {
    let h = c.strip_prefix('.').unwrap_or(c);
    !h.is_empty()
        && h.split('.')
            .all(|l| !l.is_empty() && l.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '-'))
}

/// The lower-cased host of `scheme://host[:port]/…`.
fn uri_host(uri: &str) -> Option<String> {
    let (_, rest) = uri.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let host = authority.rsplit('@').next()?;
    let host = host.split(':').next()?;
    (!host.is_empty()).then(|| host.to_ascii_lowercase())
}

fn host_matches(host: &str, constraint: &str) -> bool {
    match constraint.strip_prefix('.') {
        Some(domain) => host.len() > domain.len() && host.ends_with(&format!(".{domain}")),
        None => host == constraint,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn nc(permitted: &[&str], excluded: &[&str]) -> UriConstraints {
        UriConstraints {
            ca: "CN=test".into(),
            permitted: permitted.iter().map(|s| s.to_string()).collect(),
            excluded: excluded.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test_case(&["cluster.local"], &[], "spiffe://cluster.local/ns/a/sa/b", true; "exact host permitted")]
    #[test_case(&["cluster.local"], &[], "spiffe://CLUSTER.local/ns/a/sa/b", true; "host case-insensitive")]
    #[test_case(&["cluster.local"], &[], "spiffe://other.local/ns/a/sa/b", false; "other host refused")]
    #[test_case(&["cluster.local"], &[], "spiffe://a.cluster.local/ns/a/sa/b", false; "exact does not cover subdomains")]
    #[test_case(&[".cluster.local"], &[], "spiffe://a.cluster.local/ns/a/sa/b", true; "dot covers subdomains")]
    #[test_case(&[".cluster.local"], &[], "spiffe://cluster.local/ns/a/sa/b", false; "dot excludes the domain itself")]
    #[test_case(&[".local"], &[], "spiffe://evilcluster.local/x", true; "label boundary, subdomain")]
    #[test_case(&["cluster.local"], &[], "spiffe://evilcluster.local/x", false; "no suffix match without dot")]
    #[test_case(&[], &["bad.local"], "spiffe://bad.local/x", false; "excluded host")]
    #[test_case(&[], &["bad.local"], "spiffe://good.local/x", true; "not excluded")]
    #[test_case(&["a.local", "b.local"], &[], "spiffe://b.local/x", true; "any permitted matches")]
    #[test_case(&["cluster.local"], &[], "spiffe:cluster.local", false; "no authority")]
    fn allows(permitted: &[&str], excluded: &[&str], uri: &str, want: bool) {
        assert_eq!(nc(permitted, excluded).allows(uri), want);
    }

    #[test_case("cluster.local", true)]
    #[test_case(".example.org", true)]
    #[test_case("spiffe://cluster.local", false)]
    #[test_case("", false)]
    #[test_case("a..b", false)]
    fn host_constraint_shape(c: &str, ok: bool) {
        assert_eq!(valid_host_constraint(c), ok);
    }
}
