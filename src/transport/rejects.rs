//! Rejected TLS handshakes in the audit log. Under attack they are the
//! common case, so they are not one record each: the transport counts them
//! per (source IP, reason) in a bounded table, and every interval one `deny`
//! record per key carries the count. Sources beyond the key cap are counted
//! per reason under `overflow`, so nothing is dropped silently.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::CertificateError;
use time::OffsetDateTime;

use crate::audit::{AuditRecord, AuditSink, Decision};
use crate::authn::mtls::MtlsError;

/// Prefix of the audit reason of every aggregated handshake record.
pub const REASON_PREFIX: &str = "tls_handshake_rejected:";

/// Where the sources over the key cap are counted.
pub const OVERFLOW_PEER: &str = "overflow";

/// Why a server-side handshake failed, as a stable reason code: the mTLS
/// verifier's own reason when it refused the certificate, else the kind of
/// certificate or protocol failure.
pub fn handshake_reason(e: &std::io::Error) -> &'static str {
    let Some(tls) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) else {
        // EOF or reset before the handshake finished.
        return "tls_handshake_aborted";
    };
    match tls {
        rustls::Error::InvalidCertificate(c) => cert_reason(c),
        rustls::Error::NoCertificatesPresented => "tls_no_certificate",
        rustls::Error::PeerIncompatible(_) => "tls_peer_incompatible",
        rustls::Error::AlertReceived(_) => "tls_alert_received",
        _ => "tls_protocol_error",
    }
}

fn cert_reason(c: &CertificateError) -> &'static str {
    match c {
        CertificateError::UnknownIssuer => "tls_unknown_ca",
        CertificateError::Expired | CertificateError::ExpiredContext { .. } => "tls_cert_expired",
        CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
            "tls_cert_not_yet_valid"
        }
        CertificateError::Revoked => "tls_cert_revoked",
        CertificateError::BadSignature => "tls_bad_signature",
        CertificateError::Other(o) => match o.0.downcast_ref::<MtlsError>() {
            Some(m) => m.reason(),
            None => "tls_bad_certificate",
        },
        _ => "tls_bad_certificate",
    }
}

/// Counts of one interval: at most `max_keys` (source, reason) keys; the
/// rest per reason under overflow.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RejectCounts {
    pub by_source: HashMap<(IpAddr, &'static str), u64>,
    pub overflow: BTreeMap<&'static str, u64>,
}

impl RejectCounts {
    /// Counts one rejection; true when it could only be counted under overflow.
    pub fn add(&mut self, ip: IpAddr, reason: &'static str, max_keys: usize) -> bool {
        self.add_n(ip, reason, 1, max_keys)
    }

    fn add_n(&mut self, ip: IpAddr, reason: &'static str, n: u64, max_keys: usize) -> bool {
        let keyed = self.by_source.contains_key(&(ip, reason)) || self.by_source.len() < max_keys;
        let slot = if keyed {
            self.by_source.entry((ip, reason)).or_default()
        } else {
            self.overflow.entry(reason).or_default()
        };
        *slot = slot.saturating_add(n);
        !keyed
    }

    pub fn is_empty(&self) -> bool {
        self.by_source.is_empty() && self.overflow.is_empty()
    }

    pub fn total(&self) -> u64 {
        self.by_source.values().chain(self.overflow.values()).sum()
    }

    /// One `deny` record per key (sorted, overflow last), stamped `now`.
    pub fn records(&self, since: OffsetDateTime, now: OffsetDateTime) -> Vec<AuditRecord> {
        let mut keys: Vec<_> = self.by_source.iter().collect();
        keys.sort();
        let per_source = keys
            .into_iter()
            .map(|((ip, reason), n)| (ip.to_string(), *reason, *n));
        let overflow = self
            .overflow
            .iter()
            .map(|(reason, n)| (OVERFLOW_PEER.to_string(), *reason, *n));
        per_source
            .chain(overflow)
            .map(|(peer, reason, n)| AuditRecord {
                peer: Some(peer),
                detail: Some(format!(
                    "{n} rejected TLS handshake(s) since {}",
                    since
                        .format(&time::format_description::well_known::Rfc3339)
                        .unwrap_or_default()
                )),
                count: Some(n),
                ..AuditRecord::new(
                    now,
                    crate::audit::random_id(),
                    Decision::Deny,
                    format!("{REASON_PREFIX}{reason}"),
                )
            })
            .collect()
    }
}

/// The shared table the transport counts into.
#[derive(Debug)]
pub struct HandshakeRejects {
    max_keys: usize,
    current: Mutex<(OffsetDateTime, RejectCounts)>,
}

impl HandshakeRejects {
    pub fn new(max_keys: usize) -> Arc<Self> {
        Arc::new(Self {
            max_keys,
            current: Mutex::new((OffsetDateTime::now_utc(), RejectCounts::default())),
        })
    }

    /// Counts one rejection; true when it went under overflow.
    pub fn add(&self, ip: IpAddr, reason: &'static str) -> bool {
        let mut c = self.current.lock().unwrap_or_else(|p| p.into_inner());
        c.1.add(ip, reason, self.max_keys)
    }

    /// Writes one record per key of the interval so far and starts a new
    /// interval. Counts the sink refuses are kept for the next flush.
    pub fn flush(&self, sink: &dyn AuditSink) {
        let now = OffsetDateTime::now_utc();
        let (since, counts) = {
            let mut c = self.current.lock().unwrap_or_else(|p| p.into_inner());
            let since = std::mem::replace(&mut c.0, now);
            (since, std::mem::take(&mut c.1))
        };
        if counts.is_empty() {
            return;
        }
        let mut kept = RejectCounts::default();
        for mut r in counts.records(since, now) {
            r.bound();
            if let Err(e) = sink.emit(&r) {
                tracing::error!(error = %e, "handshake audit record not written; kept for the next interval");
                let n = r.count.unwrap_or(0);
                let reason = reason_code(&r.reason);
                match r.peer.as_deref().and_then(|p| p.parse::<IpAddr>().ok()) {
                    Some(ip) => {
                        kept.add_n(ip, reason, n, usize::MAX);
                    }
                    None => *kept.overflow.entry(reason).or_default() += n,
                }
            }
        }
        if !kept.is_empty() {
            let mut c = self.current.lock().unwrap_or_else(|p| p.into_inner());
            c.0 = since;
            for ((ip, reason), n) in kept.by_source {
                // Re-adding may spill to overflow: the count is kept either way.
                let _ = c.1.add_n(ip, reason, n, self.max_keys);
            }
            for (reason, n) in kept.overflow {
                let e = c.1.overflow.entry(reason).or_default();
                *e = e.saturating_add(n);
            }
        }
    }

    /// Flushes every `interval` until aborted.
    pub async fn run(self: Arc<Self>, sink: Arc<dyn AuditSink>, interval: Duration) {
        crate::audit::aggregate::every(interval, || self.flush(sink.as_ref())).await
    }
}

/// The static reason code back from a record's reason (for re-counting).
fn reason_code(reason: &str) -> &'static str {
    let code = reason.strip_prefix(REASON_PREFIX).unwrap_or(reason);
    KNOWN_REASONS
        .iter()
        .find(|r| **r == code)
        .copied()
        .unwrap_or("tls_protocol_error")
}

/// Every reason code [`handshake_reason`] can return, plus the timeout.
pub const KNOWN_REASONS: [&str; 18] = [
    "tls_handshake_aborted",
    "tls_no_certificate",
    "tls_peer_incompatible",
    "tls_alert_received",
    "tls_protocol_error",
    "tls_unknown_ca",
    "tls_cert_expired",
    "tls_cert_not_yet_valid",
    "tls_cert_revoked",
    "tls_bad_signature",
    "tls_bad_certificate",
    "mtls_malformed_cert",
    "mtls_uri_san_count",
    "mtls_not_spiffe",
    "mtls_foreign_trust_domain",
    "mtls_cert_expired",
    "handshake_timeout",
    "mtls_outside_name_constraints",
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::{AuditError, MemorySink};
    use test_case::test_case;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn io(e: rustls::Error) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::InvalidData, e)
    }

    fn other(e: MtlsError) -> rustls::Error {
        rustls::Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(Arc::new(e))))
    }

    #[test_case(io(rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer)), "tls_unknown_ca" ; "foreign ca")]
    #[test_case(io(rustls::Error::InvalidCertificate(CertificateError::Expired)), "tls_cert_expired" ; "expired")]
    #[test_case(io(rustls::Error::InvalidCertificate(CertificateError::Revoked)), "tls_cert_revoked" ; "revoked")]
    #[test_case(io(other(MtlsError::ForeignTrustDomain("x".into()))), "mtls_foreign_trust_domain" ; "foreign trust domain")]
    #[test_case(io(other(MtlsError::UriSanCount(0))), "mtls_uri_san_count" ; "no spiffe uri")]
    #[test_case(io(rustls::Error::InvalidCertificate(CertificateError::BadEncoding)), "tls_bad_certificate" ; "other cert error")]
    #[test_case(io(rustls::Error::DecryptError), "tls_protocol_error" ; "protocol")]
    #[test_case(std::io::Error::from(std::io::ErrorKind::UnexpectedEof), "tls_handshake_aborted" ; "eof")]
    fn reasons(e: std::io::Error, want: &str) {
        let got = handshake_reason(&e);
        assert_eq!(got, want);
        assert!(KNOWN_REASONS.contains(&got));
    }

    #[test]
    fn counts_are_per_source_and_reason_and_capped() {
        let mut c = RejectCounts::default();
        for _ in 0..3 {
            assert!(!c.add(ip("10.0.0.1"), "tls_unknown_ca", 2));
        }
        assert!(!c.add(ip("10.0.0.1"), "mtls_not_spiffe", 2));
        // Over the cap: counted per reason under overflow (and said so), existing keys still grow.
        assert!(c.add(ip("10.0.0.2"), "tls_unknown_ca", 2));
        assert!(c.add(ip("10.0.0.3"), "tls_unknown_ca", 2));
        assert!(!c.add(ip("10.0.0.1"), "tls_unknown_ca", 2));
        assert_eq!(c.by_source.len(), 2);
        assert_eq!(c.by_source[&(ip("10.0.0.1"), "tls_unknown_ca")], 4);
        assert_eq!(c.overflow["tls_unknown_ca"], 2);
        assert_eq!(c.total(), 7);
        let now = OffsetDateTime::now_utc();
        let rs = c.records(now, now);
        let got: Vec<_> = rs
            .iter()
            .map(|r| (r.peer.clone().unwrap(), r.reason.clone(), r.count.unwrap()))
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    "10.0.0.1".into(),
                    "tls_handshake_rejected:mtls_not_spiffe".into(),
                    1
                ),
                (
                    "10.0.0.1".into(),
                    "tls_handshake_rejected:tls_unknown_ca".into(),
                    4
                ),
                (
                    "overflow".into(),
                    "tls_handshake_rejected:tls_unknown_ca".into(),
                    2
                ),
            ]
        );
        assert!(rs.iter().all(|r| r.decision == Decision::Deny));
    }

    #[test]
    fn flush_writes_once_and_starts_a_new_interval() {
        let t = HandshakeRejects::new(8);
        let sink = MemorySink::default();
        t.flush(&sink);
        assert!(sink.records().is_empty(), "nothing to say, nothing written");
        t.add(ip("::1"), "tls_unknown_ca");
        t.add(ip("::1"), "tls_unknown_ca");
        t.flush(&sink);
        t.flush(&sink);
        let rs = sink.records();
        assert_eq!(rs.len(), 1);
        assert_eq!(rs[0].count, Some(2));
        assert_eq!(rs[0].peer.as_deref(), Some("::1"));
    }

    #[derive(Debug, Default)]
    struct FailOnce(Mutex<bool>, MemorySink);
    impl AuditSink for FailOnce {
        fn emit(&self, r: &AuditRecord) -> Result<(), AuditError> {
            let mut failed = self.0.lock().unwrap();
            if !*failed {
                *failed = true;
                return Err(AuditError("queue full".into()));
            }
            self.1.emit(r)
        }
    }

    #[test]
    fn counts_the_sink_refused_are_written_at_the_next_flush() {
        let t = HandshakeRejects::new(8);
        let sink = FailOnce::default();
        for _ in 0..5 {
            t.add(ip("10.1.1.1"), "mtls_foreign_trust_domain");
        }
        t.flush(&sink);
        assert!(sink.1.records().is_empty());
        t.add(ip("10.1.1.1"), "mtls_foreign_trust_domain");
        t.flush(&sink);
        let rs = sink.1.records();
        assert_eq!(rs.len(), 1);
        assert_eq!(rs[0].count, Some(6));
        assert_eq!(
            rs[0].reason,
            "tls_handshake_rejected:mtls_foreign_trust_domain"
        );
    }
}
