//! One CRL document for every replica: how a replica's freshly signed CRLs
//! are combined with the `istio-ca-crl` document another replica (or an
//! earlier run) published.
//!
//! Per issuing CA (a CRL is matched to the CA whose certificate verifies
//! its signature), the published CRL is replaced only by one with a higher
//! CRL number that lists every serial it lists, except serials this
//! replica knows were explicitly un-revoked or whose certificates expired.
//! Otherwise the published CRL stands: a replica that has not read a new
//! revocation yet never removes it from the published document, and the
//! CRL number there only grows. What the published CRL shows is fed back:
//! its number (the next CRL is numbered above it), serials this replica
//! does not know at all (adopted: see [`super::ledger::Ledger::adopt`]),
//! and whether this replica holds serials the published CRL lacks under a
//! number it cannot beat (it signs again, numbered above). CRLs of issuers
//! this replica does not hold (another replica's two-tier issuing CA) are
//! kept until their nextUpdate.

use std::collections::{BTreeMap, BTreeSet};

use rustls_pki_types::CertificateDer;
use time::OffsetDateTime;
use x509_parser::prelude::FromDer;

use super::Revocation;

/// One parsed CRL of a document.
#[derive(Debug, Clone)]
struct Parsed {
    pem: String,
    number: u128,
    next_update: Option<i64>,
    /// Serial -> (revocation time, RFC 5280 reason name).
    revoked: BTreeMap<String, (OffsetDateTime, String)>,
    /// Index of the issuer (in the caller's list) whose key verifies it.
    issuer: Option<usize>,
    /// The issuer name (DER).
    issuer_name: Vec<u8>,
}

fn reason_name(code: Option<u8>) -> &'static str {
    use rcgen::RevocationReason as R;
    let want = match code {
        Some(1) => R::KeyCompromise,
        Some(2) => R::CaCompromise,
        Some(3) => R::AffiliationChanged,
        Some(4) => R::Superseded,
        Some(5) => R::CessationOfOperation,
        Some(9) => R::PrivilegeWithdrawn,
        _ => R::Unspecified,
    };
    super::REASONS
        .iter()
        .find(|(_, r)| *r == want)
        .map_or("unspecified", |(n, _)| n)
}

/// The CRLs of a PEM document, each matched to the issuer that signed it;
/// blocks that do not parse are dropped.
fn parse_document(pem: &str, issuers: &[CertificateDer<'_>]) -> Vec<Parsed> {
    let keys: Vec<_> = issuers
        .iter()
        .filter_map(|c| x509_parser::certificate::X509Certificate::from_der(c).ok())
        .map(|(_, c)| c)
        .collect();
    let mut out = Vec::new();
    for block in pem.split_inclusive("-----END X509 CRL-----") {
        let Some(start) = block.find("-----BEGIN X509 CRL-----") else {
            continue;
        };
        let block = &block[start..];
        let der = match rustls_pki_types::pem::PemObject::from_pem_slice(block.as_bytes()) {
            Ok(d) => {
                let d: rustls_pki_types::CertificateRevocationListDer<'_> = d;
                d
            }
            Err(_) => continue,
        };
        let Ok((_, crl)) = x509_parser::revocation_list::CertificateRevocationList::from_der(&der)
        else {
            continue;
        };
        let number = crl
            .crl_number()
            .map(|n| {
                let b = n.to_bytes_be();
                if b.len() > 16 {
                    u128::MAX
                } else {
                    b.iter().fold(0u128, |acc, x| (acc << 8) | u128::from(*x))
                }
            })
            .unwrap_or(0);
        let issuer = keys
            .iter()
            .position(|k| crl.verify_signature(k.public_key()).is_ok());
        let revoked = crl
            .iter_revoked_certificates()
            .map(|r| {
                let at = OffsetDateTime::from_unix_timestamp(r.revocation_date.timestamp())
                    .unwrap_or(OffsetDateTime::UNIX_EPOCH);
                let reason = reason_name(r.reason_code().map(|(_, c)| c.0));
                (
                    crate::ca::serial_hex(r.raw_serial()),
                    (at, reason.to_string()),
                )
            })
            .collect();
        out.push(Parsed {
            pem: block.trim_end().to_string() + "\n",
            number,
            next_update: crl.next_update().map(|t| t.timestamp()),
            revoked,
            issuer,
            issuer_name: crl.issuer().as_raw().to_vec(),
        });
    }
    out
}

/// What merging found, besides the document to write.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Merge {
    /// The document to publish; `None` keeps the published one as it is.
    pub publish: Option<String>,
    /// The highest CRL number published by one of this replica's issuers.
    pub published_number: Option<u128>,
    /// Serials in a published CRL of this replica's issuers that it does
    /// not know of at all (what its sources lost).
    pub unknown: Vec<Revocation>,
    /// This replica holds serials the published CRL lacks, and cannot beat
    /// its number: sign again above it.
    pub resign: bool,
}

/// Combines `ours` (this replica's CRLs, one per issuer it holds, signed
/// now) with the `existing` document. `issuers`: this replica's issuing
/// certificates. `explained(serial)`: this replica knows the serial was
/// un-revoked or its certificate expired. `knows(serial)`: any entry of
/// this replica names it.
pub fn merge_crls(
    existing: Option<&str>,
    ours: &str,
    issuers: &[CertificateDer<'_>],
    explained: &dyn Fn(&str) -> bool,
    knows: &dyn Fn(&str) -> bool,
    now: OffsetDateTime,
) -> Merge {
    let mut merge = Merge::default();
    let ours = parse_document(ours, issuers);
    if ours.is_empty() {
        return merge;
    }
    let theirs = existing
        .map(|e| parse_document(e, issuers))
        .unwrap_or_default();
    let mut out: Vec<String> = Vec::new();
    for mine in &ours {
        let published = theirs
            .iter()
            .filter(|t| t.issuer.is_some() && t.issuer == mine.issuer)
            .max_by_key(|t| t.number);
        let Some(p) = published else {
            out.push(mine.pem.clone());
            continue;
        };
        merge.published_number = merge.published_number.max(Some(p.number));
        for (serial, (at, reason)) in &p.revoked {
            if !knows(serial) {
                merge.unknown.push(Revocation {
                    serial: serial.clone(),
                    reason: reason.clone(),
                    revoked_at: *at,
                    identity: None,
                    node: None,
                    not_after: None,
                    by: Some("adopted from the published istio-ca-crl".into()),
                    action: None,
                });
            }
        }
        let covers = p
            .revoked
            .keys()
            .all(|s| mine.revoked.contains_key(s) || explained(s));
        if mine.number > p.number && covers {
            out.push(mine.pem.clone());
        } else {
            let differ = mine.revoked.keys().ne(p.revoked.keys());
            if mine.number <= p.number && differ {
                merge.resign = true;
            }
            out.push(p.pem.clone());
        }
    }
    // Other issuers' CRLs (another replica's two-tier issuing CA) are kept
    // while current, unless they bear the name of one of ours: relying
    // parties pick a CRL by issuer name, and ours verifies. CRLs of this
    // replica's issuers it no longer signs for are dropped.
    let mut foreign: Vec<&Parsed> = theirs
        .iter()
        .filter(|t| t.issuer.is_none())
        .filter(|t| t.next_update.is_some_and(|n| n >= now.unix_timestamp()))
        .filter(|t| !ours.iter().any(|m| m.issuer_name == t.issuer_name))
        .collect();
    foreign.sort_by(|a, b| a.pem.cmp(&b.pem));
    foreign.dedup_by(|a, b| a.pem == b.pem);
    out.extend(foreign.into_iter().map(|t| t.pem.clone()));
    let doc = out.concat();
    if existing != Some(doc.as_str()) {
        merge.publish = Some(doc);
    }
    merge
}

/// The CRL publisher's merge: what [`merge_crls`] decides, with the
/// replica's issuing certificates and revocation ledger, and what it learns
/// fed back to the follower.
pub struct CrlMerge {
    pub ca: std::sync::Arc<crate::ca::CaStore>,
    pub live: std::sync::Arc<super::LiveRevocations>,
}

impl crate::rootpub::ContentMerge for CrlMerge {
    fn merge(&self, existing: Option<&str>, ours: &str) -> Option<String> {
        if ours.trim().is_empty() {
            return None;
        }
        let (current, retired) = self.ca.crl_issuers();
        let mut issuers: Vec<CertificateDer<'static>> = vec![current.signing_cert().clone()];
        issuers.extend(retired.iter().map(|r| r.signing_cert.clone()));
        let view = self.live.view();
        let m = merge_crls(
            existing,
            ours,
            &issuers,
            &|s| view.lifted.contains(s),
            &|s| view.known.contains(s),
            OffsetDateTime::now_utc(),
        );
        self.live
            .observe_published(m.published_number, m.unknown, m.resign);
        m.publish
    }
}

/// What the publisher needs of the follower's ledger.
#[derive(Debug, Default)]
pub struct LedgerView {
    /// Serials any entry names.
    pub known: BTreeSet<String>,
    /// Serials un-revoked or whose certificate expired.
    pub lifted: BTreeSet<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::generate::{self, InitOptions};
    use crate::ca::CaBundle;

    fn bundle(org: &str) -> (tempfile::TempDir, CaBundle) {
        let dir = tempfile::tempdir().unwrap();
        let ca = generate::generate(
            &InitOptions {
                organization: org.into(),
                ..Default::default()
            },
            OffsetDateTime::now_utc(),
        )
        .unwrap();
        generate::write_cacerts(dir.path(), &ca, false).unwrap();
        let b = CaBundle::load_dir(dir.path(), OffsetDateTime::now_utc()).unwrap();
        (dir, b)
    }

    fn crl(b: &CaBundle, number: u64, serials: &[&str]) -> String {
        let now = OffsetDateTime::now_utc();
        let entries: Vec<Revocation> = serials
            .iter()
            .map(|s| Revocation {
                serial: s.to_string(),
                reason: "key-compromise".into(),
                revoked_at: now - time::Duration::minutes(1),
                identity: None,
                node: None,
                not_after: None,
                by: None,
                action: None,
            })
            .collect();
        super::super::sign_crl_with(
            b.issuer(),
            b.signing_not_after(),
            &entries,
            now,
            std::time::Duration::from_secs(3600),
            number,
        )
        .unwrap()
    }

    fn numbers_and_serials(doc: &str, issuers: &[CertificateDer<'_>]) -> Vec<(u128, Vec<String>)> {
        parse_document(doc, issuers)
            .into_iter()
            .map(|p| (p.number, p.revoked.keys().cloned().collect()))
            .collect()
    }

    /// Each row: what is published, what this replica signed, what it
    /// knows; whether it publishes, and what it learns.
    #[test]
    fn a_published_crl_is_only_replaced_by_a_newer_complete_one() {
        let (_d1, ours_ca) = bundle("cluster.local");
        let (_d2, other_same_name) = bundle("cluster.local");
        let (_d3, other_name) = bundle("elsewhere.example");
        let issuers = [ours_ca.signing_cert().clone()];
        let explained = |s: &str| s == "dd";
        let knows = |s: &str| ["aa", "bb", "dd"].contains(&s);
        struct Row<'a> {
            what: &'a str,
            existing: Option<String>,
            ours: String,
            /// The CRLs of the document written, if one is.
            want_publish: Option<Vec<(u128, Vec<&'a str>)>>,
            want_unknown: Vec<&'a str>,
            want_resign: bool,
        }
        let ours = crl(&ours_ca, 20, &["aa", "bb"]);
        let rows = vec![
            Row {
                what: "nothing published",
                existing: None,
                ours: ours.clone(),
                want_publish: Some(vec![(20, vec!["aa", "bb"])]),
                want_unknown: vec![],
                want_resign: false,
            },
            Row {
                what: "the same document",
                existing: Some(ours.clone()),
                ours: ours.clone(),
                want_publish: None,
                want_unknown: vec![],
                want_resign: false,
            },
            Row {
                what: "older, fewer serials",
                existing: Some(crl(&ours_ca, 10, &["aa"])),
                ours: ours.clone(),
                want_publish: Some(vec![(20, vec!["aa", "bb"])]),
                want_unknown: vec![],
                want_resign: false,
            },
            Row {
                what: "newer, same serials: it stands",
                existing: Some(crl(&ours_ca, 30, &["aa", "bb"])),
                ours: ours.clone(),
                want_publish: None,
                want_unknown: vec![],
                want_resign: false,
            },
            Row {
                what: "newer but lacks one of ours: stands, sign above it",
                existing: Some(crl(&ours_ca, 30, &["aa"])),
                ours: ours.clone(),
                want_publish: None,
                want_unknown: vec![],
                want_resign: true,
            },
            Row {
                what: "older with a serial we never heard of: stands, adopt it",
                existing: Some(crl(&ours_ca, 10, &["aa", "bb", "cc"])),
                ours: ours.clone(),
                want_publish: None,
                want_unknown: vec!["cc"],
                want_resign: false,
            },
            Row {
                what: "older with a serial we un-revoked: replaced",
                existing: Some(crl(&ours_ca, 10, &["aa", "bb", "dd"])),
                ours: ours.clone(),
                want_publish: Some(vec![(20, vec!["aa", "bb"])]),
                want_unknown: vec![],
                want_resign: false,
            },
            Row {
                what: "a forgery under our name with a huge number: ours replaces it",
                existing: Some(crl(&other_same_name, 1 << 40, &[])),
                ours: ours.clone(),
                want_publish: Some(vec![(20, vec!["aa", "bb"])]),
                want_unknown: vec![],
                want_resign: false,
            },
            Row {
                what: "another issuer's CRL is kept beside ours",
                existing: Some(crl(&other_name, 5, &["ee"])),
                ours: ours.clone(),
                want_publish: Some(vec![(20, vec!["aa", "bb"]), (5, vec!["ee"])]),
                want_unknown: vec![],
                want_resign: false,
            },
            Row {
                what: "garbage is replaced",
                existing: Some("not a CRL".into()),
                ours: ours.clone(),
                want_publish: Some(vec![(20, vec!["aa", "bb"])]),
                want_unknown: vec![],
                want_resign: false,
            },
            Row {
                what: "nothing signed yet: nothing written",
                existing: None,
                ours: String::new(),
                want_publish: None,
                want_unknown: vec![],
                want_resign: false,
            },
        ];
        let all_issuers = [
            ours_ca.signing_cert().clone(),
            other_same_name.signing_cert().clone(),
            other_name.signing_cert().clone(),
        ];
        for row in rows {
            let m = merge_crls(
                row.existing.as_deref(),
                &row.ours,
                &issuers,
                &explained,
                &knows,
                OffsetDateTime::now_utc(),
            );
            let published = m
                .publish
                .as_deref()
                .map(|d| numbers_and_serials(d, &all_issuers));
            let want = row.want_publish.map(|v| {
                v.into_iter()
                    .map(|(n, s)| (n, s.into_iter().map(String::from).collect::<Vec<_>>()))
                    .collect::<Vec<_>>()
            });
            assert_eq!(published, want, "{}", row.what);
            let unknown: Vec<&str> = m.unknown.iter().map(|r| r.serial.as_str()).collect();
            assert_eq!(unknown, row.want_unknown, "{}", row.what);
            assert_eq!(m.resign, row.want_resign, "{}", row.what);
        }
    }
}
