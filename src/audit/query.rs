//! `meshca audit query`: the audit records of a log that match filters,
//! and the lineage of certificates renewed over mTLS (which node a renewed
//! certificate's key was first issued on).

use std::collections::{HashMap, HashSet, VecDeque};

use time::OffsetDateTime;

use super::bounded::{bounded, FIELD_MAX, SAN_MAX};
use super::format::{parse_line, Parsed};
use super::{AuditRecord, Decision};

/// Filters for `meshca audit query`; every set field must match.
#[derive(Debug, Clone, Default)]
pub struct Query {
    /// Matches the requested identity, the caller identity or a CSR SAN.
    pub identity: Option<String>,
    /// Matches the record's node, and (through [`query`]) every record of a
    /// caller presenting a certificate descended from one issued on the node.
    pub node: Option<String>,
    /// Matches the caller identity or the caller pod (`ns/name`).
    pub caller: Option<String>,
    pub decision: Option<Decision>,
    pub reason: Option<String>,
    /// A serial in [`serial_key`] form: matches the record that issued it
    /// and every record of a caller presenting it.
    pub serial: Option<String>,
    pub since: Option<OffsetDateTime>,
    pub until: Option<OffsetDateTime>,
    /// Compare identities in canonical form (alias trust domains resolved
    /// to the mesh one), as authorization does.
    pub trust_domains: Option<crate::identity::TrustDomains>,
}

impl Query {
    /// Whether `r` matches, its node compared as written.
    pub fn matches(&self, r: &AuditRecord) -> bool {
        self.matches_in(r, None)
    }

    /// Whether `r` matches; with `lineage`, a record whose presented
    /// certificate is in it matches the node too.
    fn matches_in(&self, r: &AuditRecord, lineage: Option<&HashSet<String>>) -> bool {
        let eq = |want: &Option<String>, got: &Option<String>| {
            want.as_ref()
                .is_none_or(|w| got.as_deref() == Some(w.as_str()))
        };
        let canon = |s: &str| match &self.trust_domains {
            Some(tds) => tds.canonical_str(s),
            None => s.to_string(),
        };
        self.identity.as_ref().is_none_or(|i| {
            // Records hold bounded values; bounding the query the same way
            // (deterministic) lets an oversized value match by its hash.
            let field = bounded(i, FIELD_MAX);
            let san = bounded(i, SAN_MAX);
            let (field, san) = (canon(&field), canon(&san));
            r.requested_identity.as_deref().map(canon) == Some(field.clone())
                || r.caller_identity.as_deref().map(canon) == Some(field)
                || r.csr_sans.iter().flatten().any(|s| canon(s) == san)
        }) && (eq(&self.node, &r.node)
            || lineage.is_some_and(|l| {
                r.presented_serial.as_ref().is_some_and(|s| l.contains(s))
                    || r.serial.as_ref().is_some_and(|s| {
                        l.contains(s) && r.decision == Decision::Allow && r.reason == "issued"
                    })
            }))
            && self.caller.as_ref().is_none_or(|c| {
                r.caller_identity.as_deref() == Some(c) || r.caller_pod.as_deref() == Some(c)
            })
            && self.decision.is_none_or(|d| d == r.decision)
            && eq(&self.reason, &Some(r.reason.clone()))
            && self.serial.as_ref().is_none_or(|want| {
                [&r.serial, &r.presented_serial]
                    .into_iter()
                    .flatten()
                    .any(|s| serial_key(s).is_ok_and(|k| &k == want))
            })
            && self.since.is_none_or(|t| r.time >= t)
            && self.until.is_none_or(|t| r.time <= t)
    }
}

/// A serial as compared by `--serial`: hex digits only, lower case, without
/// leading zeros, so `0x00AB:CD`, `ab:cd` and the records' own spelling meet.
pub fn serial_key(s: &str) -> Result<String, String> {
    let hex = crate::primitives::serial_hex_digits(s)
        .ok_or_else(|| format!("{s:?} is not a hexadecimal serial"))?;
    let trimmed = hex.trim_start_matches('0');
    Ok(if trimmed.is_empty() { "0" } else { trimmed }.to_string())
}

/// Certificates issued to the holders of other certificates: each mTLS
/// record names the certificate presented (`presented_serial`), so a leaf
/// leads to its renewals, theirs to their own, and so on.
#[derive(Debug, Default)]
pub struct Lineage<'a> {
    /// Serial -> its issuance record.
    issued: HashMap<&'a str, &'a AuditRecord>,
    /// Presented serial -> serials issued to its holder.
    children: HashMap<&'a str, Vec<&'a str>>,
}

/// One certificate reached by [`Lineage::descendants`].
#[derive(Debug, Clone, PartialEq)]
pub struct Descendant<'a> {
    pub serial: &'a str,
    /// Its issuance record, when the log has it.
    pub record: Option<&'a AuditRecord>,
    /// Its own node, else the nearest ancestor's: where the key it was
    /// renewed from was issued.
    pub node: Option<&'a str>,
    /// Its own cluster, else the nearest ancestor's.
    pub cluster_id: Option<&'a str>,
}

impl<'a> Lineage<'a> {
    /// The lineage of the `issued` records among `records`.
    pub fn new(records: &'a [AuditRecord]) -> Self {
        let mut l = Self::default();
        for r in records {
            let Some(serial) = r.serial.as_deref() else {
                continue;
            };
            if r.decision != Decision::Allow || r.reason != "issued" {
                continue;
            }
            l.issued.entry(serial).or_insert(r);
            if let Some(parent) = r.presented_serial.as_deref() {
                l.children.entry(parent).or_default().push(serial);
            }
        }
        l
    }

    /// The issuance record of `serial`.
    pub fn issued(&self, serial: &str) -> Option<&'a AuditRecord> {
        self.issued.get(serial).copied()
    }

    /// `roots` and every certificate descended from them, each once, in
    /// breadth-first order; a certificate whose own record names no node
    /// (or cluster) carries its nearest ancestor's (an mTLS renewal's
    /// record names none).
    pub fn descendants<'r>(&self, roots: impl IntoIterator<Item = &'r str>) -> Vec<Descendant<'a>> {
        let mut out: Vec<Descendant<'a>> = Vec::new();
        let mut seen: HashSet<String> = HashSet::new();
        let mut queue: VecDeque<String> = roots.into_iter().map(str::to_string).collect();
        while let Some(serial) = queue.pop_front() {
            if !seen.insert(serial.clone()) {
                continue;
            }
            let record = self.issued.get(serial.as_str()).copied();
            let key: &'a str = match (
                record.and_then(|r| r.serial.as_deref()),
                self.children.get_key_value(serial.as_str()),
            ) {
                (Some(k), _) => k,
                // Not issued in this log (rotated away, or an outside
                // serial): it may still have children here.
                (None, Some((k, _))) => k,
                (None, None) => continue,
            };
            if let Some(r) = record {
                out.push(Descendant {
                    serial: key,
                    record: Some(r),
                    node: self.inherited(r, |r| r.node.as_deref()),
                    cluster_id: self.inherited(r, |r| r.cluster_id.as_deref()),
                });
            }
            for child in self.children.get(key).into_iter().flatten() {
                queue.push_back(child.to_string());
            }
        }
        out
    }

    /// `field` of `r`, else of the certificate its caller presented, and so
    /// on up the chain (bounded: a log cannot make it loop).
    fn inherited(
        &self,
        mut r: &'a AuditRecord,
        field: impl Fn(&'a AuditRecord) -> Option<&'a str>,
    ) -> Option<&'a str> {
        for _ in 0..=self.issued.len() {
            if let Some(v) = field(r) {
                return Some(v);
            }
            r = self.issued(r.presented_serial.as_deref()?)?;
        }
        None
    }
}

/// The audit records among `lines` that match `q` (checkpoints skipped),
/// and the locations of lines that could not be read as records (damaged
/// lines a recovery names, or tampering: `audit verify` tells which).
/// With `q.node`, certificates renewed over mTLS from one issued on that
/// node count as the node's: their issuance records and every record of a
/// caller presenting them match.
pub fn query<L: AsRef<[u8]>>(lines: &[(String, L)], q: &Query) -> (Vec<AuditRecord>, Vec<String>) {
    let mut all = Vec::new();
    let mut unreadable = Vec::new();
    for (location, line) in lines {
        match parse_line(line.as_ref()) {
            Ok(Parsed::Audit { record, .. }) => all.push(*record),
            Ok(_) => {}
            Err(_) => unreadable.push(location.clone()),
        }
    }
    let lineage = q.node.as_ref().map(|n| {
        let l = Lineage::new(&all);
        let roots: Vec<&str> = all
            .iter()
            .filter(|r| r.node.as_deref() == Some(n.as_str()))
            .filter(|r| r.decision == Decision::Allow && r.reason == "issued")
            .filter_map(|r| r.serial.as_deref())
            .collect();
        l.descendants(roots)
            .into_iter()
            .map(|d| d.serial.to_string())
            .collect::<HashSet<String>>()
    });
    let out = all
        .into_iter()
        .filter(|r| q.matches_in(r, lineage.as_ref()))
        .collect();
    (out, unreadable)
}

/// A fixed-width table of records.
pub fn table(records: &[AuditRecord]) -> String {
    let header = [
        "TIME",
        "DECISION",
        "REASON",
        "CALLER",
        "REQUESTED",
        "CSR SANS",
        "NODE",
        "SERIAL",
    ];
    let rows = records.iter().map(|r| {
        vec![
            r.time
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
            match r.decision {
                Decision::Allow => "allow".into(),
                Decision::Deny => "deny".into(),
            },
            r.reason.clone(),
            r.caller_identity
                .clone()
                .or_else(|| r.peer.clone())
                .unwrap_or_else(|| "-".into()),
            r.requested_identity.clone().unwrap_or_else(|| "-".into()),
            r.csr_sans
                .as_ref()
                .filter(|s| !s.is_empty())
                .map(|s| s.join(","))
                .unwrap_or_else(|| "-".into()),
            r.node.clone().unwrap_or_else(|| "-".into()),
            r.serial.clone().unwrap_or_else(|| "-".into()),
        ]
    });
    crate::table::render_table(&header, rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_oversized_identity_is_found_by_its_raw_value() {
        let huge = format!("spiffe://cluster.local/ns/{}", "\u{1}".repeat(100_000));
        let mut r: AuditRecord = serde_json::from_str(
            r#"{"time":"2026-01-01T00:00:00Z","request_id":"r","peer":null,"authn_method":null,
            "caller_identity":null,"caller_pod":null,"caller_pod_uid":null,"node":null,
            "requested_identity":null,"impersonated":true,"decision":"deny","reason":"x",
            "detail":null,"evidence":null,"serial":null,"spki_sha256":null,"csr_sha256":null,
            "not_before":null,"not_after":null,"issuer_key_id":null,"latency_ms":1.0}"#,
        )
        .unwrap();
        r.requested_identity = Some(huge.clone());
        r.csr_sans = Some(vec!["spiffe://a/b".into(), huge.clone()]);
        r.bound();
        let q = |id: &str| Query {
            identity: Some(id.into()),
            ..Default::default()
        };
        assert!(q(&huge).matches(&r));
        assert!(q("spiffe://a/b").matches(&r));
        assert!(!q(&format!("{huge}x")).matches(&r));
        r.requested_identity = None;
        assert!(q(&huge).matches(&r), "through the bounded SAN");
    }

    fn record(serial: Option<&str>, presented: Option<&str>) -> AuditRecord {
        AuditRecord {
            serial: serial.map(str::to_string),
            presented_serial: presented.map(str::to_string),
            ..AuditRecord::new(
                OffsetDateTime::UNIX_EPOCH,
                "r".into(),
                Decision::Allow,
                "issued".into(),
            )
        }
    }

    #[test_case::test_case("0a1b", Some("a1b") ; "leading zero")]
    #[test_case::test_case("0x0A:1B", Some("a1b") ; "openssl spelling")]
    #[test_case::test_case("00", Some("0") ; "zero")]
    #[test_case::test_case("xyz", None ; "not hex")]
    #[test_case::test_case("", None ; "empty")]
    fn serial_keys(input: &str, want: Option<&str>) {
        assert_eq!(serial_key(input).ok().as_deref(), want);
    }

    #[test]
    fn serial_matches_the_issuance_and_the_presenters() {
        let q = Query {
            serial: Some(serial_key("0x0A:1B").unwrap()),
            ..Default::default()
        };
        assert!(q.matches(&record(Some("0a1b"), None)), "issued it");
        assert!(q.matches(&record(Some("ff"), Some("0a1b"))), "presented it");
        assert!(!q.matches(&record(Some("ff"), Some("a1c"))));
        assert!(!q.matches(&record(None, None)));
    }
}
