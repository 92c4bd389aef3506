//! Revocation: a store of revoked serials, a CRL signed by each CA whose
//! leaves may still be valid (the signing CA, and with two-tier issuing
//! every unexpired issuing CA it replaced), and the request-path check that
//! refuses a revoked client certificate.
//!
//! **Where revocations are kept** ([`store`]): in a ConfigMap every
//! replica reads (`MESHCA_REVOCATION_CONFIGMAP`, the chart's default), or
//! in a file (`MESHCA_REVOCATION_FILE`, for `serve --dev` and runs without
//! a cluster); both may be set, and the union is in force. `meshca revoke`
//! appends; the server only reads, every `MESHCA_REVOCATION_POLL`.
//!
//! **Append-only** ([`ledger`]): each replica keeps every entry it has
//! read. A source that goes missing, becomes unreadable or loses entries
//! lifts nothing; each such change is audited once as a decision of its
//! own (`revocation_source_missing`, `revocation_source_unreadable`,
//! `revocation_removal_refused`). Only an explicit un-revocation
//! (`meshca revoke --undo`, an `unrevoke` entry) lifts a revocation, and is
//! audited (`unrevoked`). The server is the only writer of the audit log,
//! so it records each entry it has not seen before (`revoked`); at startup
//! one `revocation_list_loaded` record per source names how many entries it
//! held. Until every source has been read once, mTLS callers are refused
//! (`revocations_not_loaded`, retryable) and `/readyz` says so.
//!
//! **One CRL** ([`publish`]): the CRL lists every serial in force whose
//! certificate has not expired yet (an expired certificate needs no CRL
//! entry, RFC 5280 3.3), is re-signed when the set or the CA changes and at
//! half of its validity, and is served on the admin port (`/ca-crl.pem`) and
//! published as the `istio-ca-crl` ConfigMap (`ca-crl.pem`). Replicas share
//! that ConfigMap: a replica replaces the published CRL only with one
//! numbered higher that lists every serial it lists (unless it knows the
//! serial was un-revoked or expired), so the published CRL number only
//! grows and no serial leaves it because a replica lags.

pub mod ledger;
pub mod lineage;
pub mod metrics;
pub mod publish;
pub mod store;

pub use store::{append_store, read_store};

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rcgen::{CertificateRevocationListParams, KeyIdMethod, RevocationReason, RevokedCertParams};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use self::metrics::KillSwitchMetrics;
use crate::audit::{AuditRecord, AuditSink, Decision};
use crate::ca::{CaBundle, CaStore};

/// Istio's CRL ConfigMap (ztunnel >= 1.29 reads it) and its data key.
pub const CRL_CONFIGMAP: &str = "istio-ca-crl";
pub const CRL_KEY: &str = "ca-crl.pem";

/// One revoked certificate, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revocation {
    /// As the audit log writes serials ([`crate::ca::serial_hex`]).
    pub serial: String,
    /// RFC 5280 reason, kebab-case (see [`REASONS`]).
    pub reason: String,
    #[serde(with = "time::serde::rfc3339")]
    pub revoked_at: OffsetDateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The certificate's expiry: after it the serial leaves the CRL.
    #[serde(
        default,
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub not_after: Option<OffsetDateTime>,
    /// Who ran `meshca revoke` (free text, e.g. an incident id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// `unrevoke`: lifts every earlier revocation of the serial (`meshca
    /// revoke --undo`). Absent: a revocation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
}

/// The `action` of an un-revocation entry.
pub const UNREVOKE: &str = "unrevoke";

impl Revocation {
    pub fn is_unrevoke(&self) -> bool {
        self.action.as_deref() == Some(UNREVOKE)
    }
}

/// Accepted `--reason` values and their RFC 5280 codes.
pub const REASONS: [(&str, RevocationReason); 7] = [
    ("unspecified", RevocationReason::Unspecified),
    ("key-compromise", RevocationReason::KeyCompromise),
    ("ca-compromise", RevocationReason::CaCompromise),
    ("affiliation-changed", RevocationReason::AffiliationChanged),
    ("superseded", RevocationReason::Superseded),
    (
        "cessation-of-operation",
        RevocationReason::CessationOfOperation,
    ),
    ("privilege-withdrawn", RevocationReason::PrivilegeWithdrawn),
];

/// Why revocation work failed.
#[derive(Debug, thiserror::Error)]
pub enum RevocationError {
    #[error("unknown revocation reason {0:?}")]
    UnknownReason(String),
    #[error("serial {0:?} is not hex")]
    BadSerial(String),
    #[error("revocation store {path}: {detail}")]
    Store { path: String, detail: String },
    #[error("signing the CRL: {0}")]
    Sign(String),
}

impl RevocationError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::UnknownReason(_) => "revocation_unknown_reason",
            Self::BadSerial(_) => "revocation_bad_serial",
            Self::Store { .. } => "revocation_store_failed",
            Self::Sign(_) => "crl_sign_failed",
        }
    }
}

pub fn parse_reason(s: &str) -> Result<RevocationReason, RevocationError> {
    REASONS
        .iter()
        .find(|(n, _)| *n == s)
        .map(|(_, r)| *r)
        .ok_or_else(|| RevocationError::UnknownReason(s.to_string()))
}

/// A serial as the audit log writes it, from user input (`0x`, colons,
/// upper case and leading zeros accepted).
pub fn normalize_serial(s: &str) -> Result<String, RevocationError> {
    let t = crate::primitives::serial_hex_digits(s)
        .ok_or_else(|| RevocationError::BadSerial(s.to_string()))?;
    let even = if t.len() % 2 == 1 { format!("0{t}") } else { t };
    let bytes = hex::decode(&even).map_err(|_| RevocationError::BadSerial(s.to_string()))?;
    Ok(crate::ca::serial_hex(&bytes))
}

/// The entries a CRL signed at `now` lists: one per serial (the earliest
/// revocation wins), certificates not yet expired, ordered by serial.
pub fn crl_entries(store: &[Revocation], now: OffsetDateTime) -> Vec<Revocation> {
    let mut by_serial: BTreeMap<&str, &Revocation> = BTreeMap::new();
    for r in store {
        if r.not_after.is_some_and(|t| t < now) {
            continue;
        }
        by_serial
            .entry(&r.serial)
            .and_modify(|cur| {
                if r.revoked_at < cur.revoked_at {
                    *cur = r;
                }
            })
            .or_insert(r);
    }
    by_serial.into_values().cloned().collect()
}

/// Signs a CRL over `entries` with the bundle's issuing intermediate.
pub fn sign_crl(
    bundle: &CaBundle,
    entries: &[Revocation],
    now: OffsetDateTime,
    validity: Duration,
) -> Result<String, RevocationError> {
    sign_crl_with(
        bundle.issuer(),
        bundle.signing_not_after(),
        entries,
        now,
        validity,
        u64::try_from(now.unix_timestamp()).unwrap_or(0),
    )
}

/// One CRL per CA whose leaves may still be valid, concatenated (the
/// `ca-crl.pem` layout istiod also reads: one CRL per signing
/// certificate): the store's current signer, then each replaced one kept
/// for it (two-tier issuing CAs until they expire). X.509 relying parties
/// pick the CRL whose issuer is the leaf's. Every CRL lists every entry:
/// serials are random, so another issuer's serial matches nothing.
pub fn sign_crls(
    ca: &CaStore,
    entries: &[Revocation],
    now: OffsetDateTime,
    validity: Duration,
    crl_number: u64,
) -> Result<String, RevocationError> {
    let (current, retired) = ca.crl_issuers();
    let mut pem = sign_crl_with(
        current.issuer(),
        current.signing_not_after(),
        entries,
        now,
        validity,
        crl_number,
    )?;
    for r in retired {
        pem.push_str(&sign_crl_with(
            &r.issuer,
            r.not_after,
            entries,
            now,
            validity,
            crl_number,
        )?);
    }
    Ok(pem)
}

/// The number of the next CRL: seconds since the epoch (they grow across
/// restarts), and always above the last one signed here and the highest
/// one published by any replica.
pub fn next_crl_number(now: OffsetDateTime, last: u64, published: u64) -> u64 {
    u64::try_from(now.unix_timestamp())
        .unwrap_or(0)
        .max(last.saturating_add(1))
        .max(published.saturating_add(1))
}

/// Signs a CRL over `entries` with `issuer`, whose certificate ends at `not_after`.
pub fn sign_crl_with(
    issuer: &rcgen::Issuer<'_, crate::ca::signer::SignerKey>,
    not_after: OffsetDateTime,
    entries: &[Revocation],
    now: OffsetDateTime,
    validity: Duration,
    crl_number: u64,
) -> Result<String, RevocationError> {
    let revoked_certs = entries
        .iter()
        .map(|r| {
            let serial = hex::decode(if r.serial.len() % 2 == 1 {
                format!("0{}", r.serial)
            } else {
                r.serial.clone()
            })
            .map_err(|_| RevocationError::BadSerial(r.serial.clone()))?;
            Ok(RevokedCertParams {
                serial_number: serial.into(),
                revocation_time: r.revoked_at,
                reason_code: Some(parse_reason(&r.reason)?),
                invalidity_date: None,
            })
        })
        .collect::<Result<Vec<_>, RevocationError>>()?;
    let next = now + validity;
    let number = crl_number.to_be_bytes();
    let params = CertificateRevocationListParams {
        this_update: now - time::Duration::minutes(2),
        next_update: next.min(not_after.max(now + time::Duration::minutes(1))),
        crl_number: number.to_vec().into(),
        issuing_distribution_point: None,
        revoked_certs,
        key_identifier_method: KeyIdMethod::Sha256,
    };
    let crl = params
        .signed_by(issuer)
        .map_err(|e| RevocationError::Sign(e.to_string()))?;
    crl.pem().map_err(|e| RevocationError::Sign(e.to_string()))
}

/// What `meshca revoke` was asked to revoke.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Normalized serials.
    Serials(Vec<String>),
    /// Every certificate issued for this identity.
    Identity(String),
    /// Every certificate issued through, or to a caller on, this node.
    Node(String),
}

/// The revocations for `target`, from the audit log's `issued` records:
/// certificates still valid at `now` (an expired one needs no revocation),
/// one entry per serial. A serial given explicitly but absent from the log
/// is still revoked (the log may have been rotated away), without details.
/// Identities are compared as written; see [`select_in`].
pub fn select(
    records: &[crate::audit::AuditRecord],
    target: &Target,
    reason: &str,
    by: Option<&str>,
    now: OffsetDateTime,
) -> Vec<Revocation> {
    select_in(records, target, reason, by, now, None)
}

/// [`select`], with identities compared in canonical form (`trust_domains`:
/// an alias trust domain is the mesh one, as authorization treats it).
///
/// Every certificate issued to the holder of a selected one is selected
/// too, transitively: an mTLS record names the certificate its caller
/// presented (`presented_serial`), so a leaf issued on a node leads to each
/// renewal of it, wherever the renewal came from. A descendant whose own
/// record names no node carries its ancestor's.
pub fn select_in(
    records: &[crate::audit::AuditRecord],
    target: &Target,
    reason: &str,
    by: Option<&str>,
    now: OffsetDateTime,
    trust_domains: Option<&crate::identity::TrustDomains>,
) -> Vec<Revocation> {
    let canon = |s: &str| match trust_domains {
        Some(tds) => tds.canonical_str(s),
        None => s.to_string(),
    };
    let wanted_identity = match target {
        Target::Identity(id) => Some(canon(id)),
        _ => None,
    };
    let lineage = crate::audit::query::Lineage::new(records);
    let roots: Vec<&str> = match target {
        Target::Serials(s) => s.iter().map(String::as_str).collect(),
        _ => records
            .iter()
            .filter(|r| r.decision == Decision::Allow && r.reason == "issued")
            .filter(|r| match target {
                Target::Serials(_) => false,
                Target::Identity(_) => {
                    r.requested_identity.as_deref().map(canon) == wanted_identity
                }
                Target::Node(n) => r.node.as_deref() == Some(n.as_str()),
            })
            .filter_map(|r| r.serial.as_deref())
            .collect(),
    };
    let mut out: BTreeMap<String, Revocation> = BTreeMap::new();
    for d in lineage.descendants(roots) {
        let Some(r) = d.record else { continue };
        if r.not_after.is_some_and(|t| t <= now) {
            continue;
        }
        out.entry(d.serial.to_string()).or_insert(Revocation {
            serial: d.serial.to_string(),
            reason: reason.to_string(),
            revoked_at: now,
            identity: r.requested_identity.clone(),
            node: d.node.map(str::to_string),
            not_after: r.not_after,
            by: by.map(str::to_string),
            action: None,
        });
    }
    if let Target::Serials(serials) = target {
        for s in serials {
            if lineage.issued(s).is_some() {
                continue;
            }
            out.entry(s.clone()).or_insert(Revocation {
                serial: s.clone(),
                reason: reason.to_string(),
                revoked_at: now,
                identity: None,
                node: None,
                not_after: None,
                by: by.map(str::to_string),
                action: None,
            });
        }
    }
    out.into_values().collect()
}

/// What the request path and the publishers read.
#[derive(Debug, Default)]
pub struct LiveRevocations {
    /// The serials in force and their lineages ([`lineage`]).
    serials: ArcSwap<lineage::RevokedSet>,
    crl: ArcSwap<String>,
    /// Every source has been read once.
    loaded: std::sync::atomic::AtomicBool,
    /// What the follower's ledger knows, for the CRL publisher.
    view: ArcSwap<publish::LedgerView>,
    /// What the CRL publisher saw published, for the follower.
    published: std::sync::Mutex<Published>,
}

/// Fed back from the published `istio-ca-crl` documents.
#[derive(Debug, Default)]
struct Published {
    number: u64,
    unknown: Vec<Revocation>,
    resign: bool,
}

impl LiveRevocations {
    pub fn new() -> Self {
        Self::default()
    }

    /// A set of revoked serials without a store (benches, tests).
    pub fn with_serials(serials: impl IntoIterator<Item = String>) -> Self {
        let live = Self::default();
        live.serials.store(Arc::new(serials.into_iter().collect()));
        live.set_loaded();
        live
    }

    pub fn is_revoked(&self, serial_hex: &str) -> bool {
        let s = self.serials.load();
        !s.is_empty() && s.contains(serial_hex)
    }

    pub fn any(&self) -> bool {
        !self.serials.load().is_empty()
    }

    /// The serials in force in `entries`, before the follower's first read
    /// (a file store read at startup).
    pub fn seed(&self, entries: &[Revocation]) {
        let mut l = ledger::Ledger::new();
        l.apply(
            ledger::StoreSource::File,
            ledger::SourceRead::Entries(entries.to_vec()),
            OffsetDateTime::now_utc(),
        );
        self.serials.store(Arc::new(
            l.in_force().into_iter().map(|r| r.serial).collect(),
        ));
        self.set_loaded();
    }

    /// Every source has been read once: a client certificate can be checked.
    pub fn is_loaded(&self) -> bool {
        self.loaded.load(std::sync::atomic::Ordering::Acquire)
    }

    fn set_loaded(&self) {
        self.loaded
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// The current CRL PEM (empty until the first one is signed).
    pub fn crl_pem(&self) -> Arc<String> {
        self.crl.load_full()
    }

    /// What the ledger knows (for merging with the published CRL).
    pub fn view(&self) -> Arc<publish::LedgerView> {
        self.view.load_full()
    }

    /// The publisher's findings in one published document.
    pub fn observe_published(&self, number: Option<u128>, unknown: Vec<Revocation>, resign: bool) {
        let mut p = self.published.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = number {
            p.number = p.number.max(u64::try_from(n).unwrap_or(u64::MAX));
        }
        for r in unknown {
            if !p.unknown.iter().any(|u| u.serial == r.serial) {
                p.unknown.push(r);
            }
        }
        p.resign |= resign;
    }

    /// Takes what the publisher found: the highest published number,
    /// serials to adopt, and whether to sign again.
    fn take_published(&self) -> (u64, Vec<Revocation>, bool) {
        let mut p = self.published.lock().unwrap_or_else(|e| e.into_inner());
        (
            p.number,
            std::mem::take(&mut p.unknown),
            std::mem::take(&mut p.resign),
        )
    }
}

/// Revocation settings, parsed once from flags.
#[derive(Debug, Clone)]
pub struct RevocationSettings {
    /// `MESHCA_REVOCATION_FILE`.
    pub file: Option<PathBuf>,
    /// `MESHCA_REVOCATION_CONFIGMAP` (`namespace/name`): shared by every replica.
    pub configmap: Option<(String, String)>,
    /// `MESHCA_REVOCATION_POLL`.
    pub poll: Duration,
    /// `MESHCA_CRL_VALIDITY`: nextUpdate - thisUpdate; re-signed at half.
    pub crl_validity: Duration,
    /// Publish `istio-ca-crl` (`MESHCA_PUBLISH_CRL`), with the root publisher's selector.
    pub publish: Option<crate::rootpub::RootPublisherSettings>,
}

impl RevocationSettings {
    /// Settings reading only `file` (tests, no cluster).
    pub fn file(file: PathBuf, poll: Duration) -> Self {
        Self {
            file: Some(file),
            configmap: None,
            poll,
            crl_validity: Duration::from_secs(3600),
            publish: None,
        }
    }
}

/// The audit record of one ledger event.
fn event_record(e: &ledger::LedgerEvent, now: OffsetDateTime) -> AuditRecord {
    use ledger::LedgerEvent as E;
    let decision = match e {
        E::Loaded { .. } | E::Unrevoked(_) => Decision::Allow,
        _ => Decision::Deny,
    };
    let mut rec = AuditRecord::new(now, crate::audit::random_id(), decision, e.reason().into());
    let entry = match e {
        E::Revoked(r) | E::Unrevoked(r) | E::Adopted(r) | E::RemovalRefused { entry: r, .. } => {
            Some(r)
        }
        _ => None,
    };
    if let Some(r) = entry {
        rec.serial = Some(r.serial.clone());
        rec.requested_identity = r.identity.clone();
        rec.node = r.node.clone();
        rec.not_after = r.not_after;
        rec.revocation_reason = Some(r.reason.clone());
    }
    let by = |r: &Revocation| {
        r.by.as_deref()
            .map(|b| format!(" by {b}"))
            .unwrap_or_default()
    };
    rec.detail = Some(match e {
        E::Loaded { source, entries } => {
            format!("{entries} revocation entr(ies) in the {} store", source.as_str())
        }
        E::Revoked(r) | E::Adopted(r) => {
            format!("revoked at {} ({}){}", r.revoked_at, r.reason, by(r))
        }
        E::Unrevoked(r) => format!("un-revoked at {}{}", r.revoked_at, by(r)),
        E::RemovalRefused { source, entry } => format!(
            "the {} store no longer holds the entry revoked at {}; it stays in force (lift a revocation with `meshca revoke --undo`)",
            source.as_str(),
            entry.revoked_at
        ),
        E::SourceMissing(source) => format!(
            "the {} store is gone; every revocation stays in force",
            source.as_str()
        ),
        E::SourceUnreadable(source, why) => format!(
            "the {} store cannot be read ({why}); every revocation stays in force",
            source.as_str()
        ),
    });
    rec.bound();
    rec
}

/// Reads each configured source once.
async fn read_sources(
    settings: &RevocationSettings,
    client: Option<&kube::Client>,
) -> Vec<(ledger::StoreSource, ledger::SourceRead)> {
    let mut reads = Vec::new();
    if let Some(file) = &settings.file {
        reads.push((ledger::StoreSource::File, store::read_file(file)));
    }
    if let Some((ns, name)) = &settings.configmap {
        let read = match client {
            Some(c) => store::read_configmap(c, ns, name).await,
            None => ledger::SourceRead::Unreadable("no Kubernetes client".into()),
        };
        reads.push((ledger::StoreSource::ConfigMap, read));
    }
    reads
}

/// Follows the stores: keeps the revoked set and the CRL current, audits
/// every change of the ledger, and feeds `crl_tx` (the ConfigMap
/// publisher) on every new CRL.
pub async fn follow(
    settings: RevocationSettings,
    ca: Arc<CaStore>,
    live: Arc<LiveRevocations>,
    audit: Arc<dyn AuditSink>,
    metrics: Option<Arc<KillSwitchMetrics>>,
    crl_tx: tokio::sync::watch::Sender<String>,
    client: Option<kube::Client>,
) {
    if let Some(m) = &metrics {
        crate::metrics::pre_create(&m.revocation_events, ledger::REASONS);
    }
    let mut generations = ca.subscribe();
    let mut ledger = ledger::Ledger::new();
    let mut last_set: Option<Vec<Revocation>> = None;
    let mut signed_at: Option<std::time::Instant> = None;
    let mut last_number = 0u64;
    loop {
        let now = OffsetDateTime::now_utc();
        let mut events = Vec::new();
        for (source, read) in read_sources(&settings, client.as_ref()).await {
            events.extend(ledger.apply(source, read, now));
        }
        let (published, unknown, resign) = live.take_published();
        events.extend(ledger.adopt(unknown));
        for e in &events {
            match e {
                ledger::LedgerEvent::SourceUnreadable(source, why) => {
                    tracing::warn!(source = source.as_str(), error = %why, reason = e.reason(), "revocation store unreadable; keeping every revocation in force");
                }
                ledger::LedgerEvent::RemovalRefused { .. }
                | ledger::LedgerEvent::SourceMissing(_)
                | ledger::LedgerEvent::Adopted(_) => {
                    tracing::warn!(
                        reason = e.reason(),
                        "revocation store changed; nothing lifted"
                    );
                }
                _ => {}
            }
            if let Err(err) = audit.emit(&event_record(e, now)) {
                tracing::error!(error = %err, reason = e.reason(), "revocation audit record lost");
            }
            if let Some(m) = &metrics {
                m.revocation_events
                    .get_or_create(&crate::metrics::ReasonLabels {
                        reason: e.reason().into(),
                    })
                    .inc();
            }
        }
        let all_loaded = settings.file.is_none() || ledger.loaded(ledger::StoreSource::File);
        let all_loaded = all_loaded
            && (settings.configmap.is_none() || ledger.loaded(ledger::StoreSource::ConfigMap));
        let in_force = ledger.in_force();
        live.serials.store(Arc::new(
            in_force.iter().map(|r| r.serial.clone()).collect(),
        ));
        let mut view = publish::LedgerView {
            lifted: ledger.lifted(now),
            ..Default::default()
        };
        for r in ledger.in_force() {
            view.known.insert(r.serial);
        }
        view.known.extend(view.lifted.iter().cloned());
        live.view.store(Arc::new(view));
        if all_loaded && !live.is_loaded() {
            live.set_loaded();
        }
        let ca_changed = generations.has_changed().unwrap_or(false);
        if ca_changed {
            generations.borrow_and_update();
        }
        let stale = signed_at.is_none_or(|t| t.elapsed() >= settings.crl_validity / 2);
        let changed = last_set.as_ref() != Some(&in_force);
        if all_loaded && (changed || ca_changed || stale || resign) {
            let entries = crl_entries(&in_force, now);
            let number = next_crl_number(now, last_number, published);
            match sign_crls(&ca, &entries, now, settings.crl_validity, number) {
                Ok(pem) => {
                    last_number = number;
                    live.crl.store(Arc::new(pem.clone()));
                    crl_tx.send_replace(pem);
                    signed_at = Some(std::time::Instant::now());
                    last_set = Some(in_force);
                    if let Some(m) = &metrics {
                        m.crl_signed
                            .get_or_create(&crate::metrics::ResultLabels {
                                result: "ok".into(),
                            })
                            .inc();
                        m.revoked_serials.set(entries.len() as i64);
                    }
                    tracing::info!(serials = entries.len(), crl_number = number, "CRL signed");
                }
                Err(e) => {
                    tracing::error!(reason = e.reason(), error = %e, "CRL not signed; keeping the previous one");
                    if let Some(m) = &metrics {
                        m.crl_signed
                            .get_or_create(&crate::metrics::ResultLabels {
                                result: "error".into(),
                            })
                            .inc();
                    }
                }
            }
        }
        tokio::time::sleep(settings.poll).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use test_case::test_case;
    use time::macros::datetime;

    fn rev(serial: &str, at: OffsetDateTime, not_after: Option<OffsetDateTime>) -> Revocation {
        Revocation {
            serial: serial.into(),
            reason: "key-compromise".into(),
            revoked_at: at,
            identity: None,
            node: None,
            not_after,
            by: None,
            action: None,
        }
    }

    #[test_case("0x00AB:CD", Ok("abcd") ; "prefix colons case and leading zero")]
    #[test_case("abc", Ok("abc") ; "odd length")]
    #[test_case("0", Ok("0") ; "zero")]
    #[test_case("xyz", Err(()) ; "not hex")]
    #[test_case("", Err(()) ; "empty")]
    fn serials(input: &str, want: Result<&str, ()>) {
        assert_eq!(
            normalize_serial(input).map_err(|_| ()),
            want.map(String::from)
        );
    }

    #[test]
    fn crl_lists_each_unexpired_serial_once_earliest_revocation_first() {
        let now = datetime!(2026-06-01 00:00 UTC);
        let store = vec![
            rev("aa", datetime!(2026-05-02 00:00 UTC), None),
            rev("aa", datetime!(2026-05-01 00:00 UTC), None),
            rev(
                "bb",
                datetime!(2026-05-01 00:00 UTC),
                Some(datetime!(2026-05-30 00:00 UTC)),
            ),
            rev(
                "cc",
                datetime!(2026-05-01 00:00 UTC),
                Some(datetime!(2026-06-02 00:00 UTC)),
            ),
        ];
        let got = crl_entries(&store, now);
        let serials: Vec<_> = got.iter().map(|r| r.serial.as_str()).collect();
        assert_eq!(serials, ["aa", "cc"], "bb expired");
        assert_eq!(got[0].revoked_at, datetime!(2026-05-01 00:00 UTC));
    }

    #[test]
    fn select_finds_live_issued_serials_by_identity_node_or_serial() {
        use crate::audit::AuditRecord;
        let now = datetime!(2026-06-01 00:00 UTC);
        let rec =
            |serial: &str, id: &str, node: Option<&str>, reason: &str, exp: OffsetDateTime| {
                let mut r = AuditRecord::new(now, "x".into(), Decision::Allow, reason.into());
                if reason != "issued" {
                    r.decision = Decision::Deny;
                }
                r.serial = Some(serial.into());
                r.requested_identity = Some(id.into());
                r.node = node.map(str::to_string);
                r.not_after = Some(exp);
                r
            };
        let later = datetime!(2026-06-02 00:00 UTC);
        let log = vec![
            rec("a1", "spiffe://td/ns/a/sa/a", Some("n1"), "issued", later),
            rec("a1", "spiffe://td/ns/a/sa/a", Some("n1"), "issued", later),
            rec("a2", "spiffe://td/ns/a/sa/a", None, "issued", later),
            rec(
                "a3",
                "spiffe://td/ns/a/sa/a",
                None,
                "issued",
                datetime!(2026-05-01 00:00 UTC),
            ),
            rec("b1", "spiffe://td/ns/b/sa/b", Some("n1"), "issued", later),
            rec(
                "c1",
                "spiffe://td/ns/c/sa/c",
                Some("n2"),
                "ttl_too_long",
                later,
            ),
        ];
        let serials = |t: Target| -> Vec<String> {
            select(&log, &t, "key-compromise", Some("ir-1"), now)
                .into_iter()
                .map(|r| r.serial)
                .collect()
        };
        assert_eq!(
            serials(Target::Identity("spiffe://td/ns/a/sa/a".into())),
            ["a1", "a2"]
        );
        assert_eq!(serials(Target::Node("n1".into())), ["a1", "b1"]);
        assert!(
            serials(Target::Node("n2".into())).is_empty(),
            "denied records carry no certificate"
        );
        assert_eq!(
            serials(Target::Serials(vec!["b1".into(), "ff".into()])),
            ["b1", "ff"]
        );
        let r = select(
            &log,
            &Target::Serials(vec!["b1".into()]),
            "superseded",
            None,
            now,
        );
        assert_eq!(
            r[0].node.as_deref(),
            Some("n1"),
            "details come from the log"
        );
        assert_eq!(r[0].reason, "superseded");
    }

    /// The store may be deleted, emptied, cut short or rewritten without an
    /// entry: none of those lifts a revocation (only an explicit un-revoke
    /// does), and each is audited.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_missing_emptied_or_shrunk_store_lifts_nothing() {
        let pki = crate::testing::TestPki::new(crate::ca::generate::KeyType::EcdsaP256);
        let ca = Arc::new(CaStore::from_dir(pki.path(), false).unwrap());
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("revoked.jsonl");
        let now = OffsetDateTime::now_utc();
        let later = Some(now + time::Duration::hours(1));
        append_store(&file, &[rev("aa", now, later), rev("bb", now, later)]).unwrap();
        let live = Arc::new(LiveRevocations::new());
        let audit = Arc::new(crate::audit::MemorySink::default());
        let (tx, _rx) = tokio::sync::watch::channel(String::new());
        let task = tokio::spawn(follow(
            RevocationSettings::file(file.clone(), Duration::from_millis(20)),
            ca,
            live.clone(),
            audit.clone(),
            None,
            tx,
            None,
        ));
        let wait = |what: &str| {
            let live = live.clone();
            let what = what.to_string();
            async move {
                let deadline = std::time::Instant::now() + Duration::from_secs(5);
                while !(live.is_revoked("aa") && live.is_revoked("bb")) {
                    assert!(std::time::Instant::now() < deadline, "{what}: never loaded");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        wait("start").await;
        let shrunk = serde_json::to_string(&rev("aa", now, later)).unwrap() + "\n";
        for (what, change) in [
            ("deleted", None),
            ("emptied", Some(String::new())),
            ("cut short", Some("{\"serial\":".to_string())),
            ("shrunk", Some(shrunk)),
        ] {
            match change {
                None => std::fs::remove_file(&file).unwrap(),
                Some(text) => std::fs::write(&file, text).unwrap(),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(
                live.is_revoked("aa") && live.is_revoked("bb"),
                "{what}: a revocation was lifted"
            );
        }
        task.abort();
    }

    /// Lineage: each mTLS record names the certificate presented, so a
    /// selection reaches every renewal of a selected leaf, transitively,
    /// carrying the node forward; identities match through aliases.
    #[test]
    fn select_follows_renewals_and_matches_identities_through_aliases() {
        use crate::audit::AuditRecord;
        use crate::identity::{TrustDomain, TrustDomains};
        let now = datetime!(2026-06-01 00:00 UTC);
        let later = datetime!(2026-06-02 00:00 UTC);
        let issued = |serial: &str, id: &str, node: Option<&str>, parent: Option<&str>| {
            let mut r = AuditRecord::new(now, "x".into(), Decision::Allow, "issued".into());
            r.serial = Some(serial.into());
            r.requested_identity = Some(id.into());
            r.node = node.map(str::to_string);
            r.presented_serial = parent.map(str::to_string);
            r.not_after = Some(later);
            r
        };
        let app = "spiffe://cluster.local/ns/a/sa/app";
        let alias_app = "spiffe://alias.local/ns/a/sa/app";
        let zt = "spiffe://cluster.local/ns/istio-system/sa/ztunnel";
        let mut expired = issued("e1", app, None, Some("w2"));
        expired.not_after = Some(datetime!(2026-05-01 00:00 UTC));
        let mut refused = issued("x1", app, None, Some("w1"));
        refused.decision = Decision::Deny;
        refused.reason = "renewal_no_live_pod".into();
        let log = vec![
            // ztunnel on n1 gets w1 for app; w1 renewed twice (w2, w3); w2
            // also renewed into e1, expired, which was renewed into w4.
            issued("w1", app, Some("n1"), None),
            issued("w2", app, None, Some("w1")),
            issued("w3", app, None, Some("w2")),
            expired,
            issued("w4", app, None, Some("e1")),
            refused,
            // An alias-spelled leaf on another node, renewed once.
            issued("a1", alias_app, Some("n2"), None),
            issued("a2", alias_app, None, Some("a1")),
            // A renewal of a leaf the log no longer has (rotated away).
            issued("r2", zt, None, Some("gone")),
            issued("z1", zt, Some("n2"), None),
        ];
        let tds = TrustDomains::new(
            TrustDomain::new("cluster.local").unwrap(),
            vec![TrustDomain::new("alias.local").unwrap()],
        );
        let run = |t: Target, aliases: bool| -> Vec<(String, Option<String>)> {
            select_in(
                &log,
                &t,
                "key-compromise",
                None,
                now,
                aliases.then_some(&tds),
            )
            .into_iter()
            .map(|r| (r.serial, r.node))
            .collect()
        };
        let n1 = Some("n1".to_string());
        let n2 = Some("n2".to_string());
        type Want<'a> = Vec<(&'a str, Option<String>)>;
        let cases: Vec<(Target, bool, Want<'_>)> = vec![
            (
                Target::Node("n1".into()),
                true,
                vec![
                    ("w1", n1.clone()),
                    ("w2", n1.clone()),
                    ("w3", n1.clone()),
                    ("w4", n1.clone()),
                ],
            ),
            (
                Target::Serials(vec!["w2".into()]),
                true,
                vec![("w2", n1.clone()), ("w3", n1.clone()), ("w4", n1.clone())],
            ),
            (
                Target::Serials(vec!["gone".into()]),
                true,
                vec![("gone", None), ("r2", None)],
            ),
            (
                Target::Node("n2".into()),
                true,
                vec![("a1", n2.clone()), ("a2", n2.clone()), ("z1", n2.clone())],
            ),
            (
                Target::Identity(app.into()),
                true,
                vec![
                    ("a1", n2.clone()),
                    ("a2", n2.clone()),
                    ("w1", n1.clone()),
                    ("w2", n1.clone()),
                    ("w3", n1.clone()),
                    ("w4", n1.clone()),
                ],
            ),
            (
                Target::Identity(alias_app.into()),
                false,
                vec![("a1", n2.clone()), ("a2", n2.clone())],
            ),
            (Target::Node("n3".into()), true, vec![]),
        ];
        for (target, aliases, want) in cases {
            let want: Vec<(String, Option<String>)> =
                want.into_iter().map(|(s, n)| (s.to_string(), n)).collect();
            assert_eq!(run(target.clone(), aliases), want, "{target:?}");
        }
    }

    /// Until the store has been read once, a client certificate cannot be
    /// checked against it: mTLS callers are refused, retryably.
    #[tokio::test]
    async fn mtls_callers_wait_for_the_first_read_of_the_store() {
        use crate::issue::{CertificateIssuer, IssueRequest};
        let pki = crate::testing::TestPki::new(crate::ca::generate::KeyType::EcdsaP256);
        let ca = Arc::new(CaStore::from_dir(pki.path(), false).unwrap());
        let id = "spiffe://cluster.local/ns/a/sa/b";
        let (chain, _) = crate::testing::client_identity(
            &ca.snapshot(),
            id,
            &crate::testing::validity_hours(-1, 1),
        );
        let peer_chain: Vec<rustls_pki_types::CertificateDer<'static>> =
            rustls_pki_types::pem::PemObject::pem_slice_iter(chain.as_bytes())
                .collect::<Result<_, _>>()
                .unwrap();
        let creds = crate::authn::Credentials {
            peer_chain: Some(peer_chain.into()),
            ..Default::default()
        };
        let live = Arc::new(LiveRevocations::new());
        let issuer = CertificateIssuer {
            ca,
            ttl: Default::default(),
            csr_policy: Default::default(),
            tokens: None,
            node_authz: None,
            audit: Arc::new(crate::audit::MemorySink::default()),
            metrics: None,
            admission: None,
            guards: crate::issue::IssueGuards {
                revocations: Some(live.clone()),
                ..Default::default()
            },
        };
        let req = || IssueRequest {
            csr: crate::testing::csr_for(&rcgen::KeyPair::generate().unwrap(), id),
            validity_secs: 0,
            impersonate: None,
        };
        let e = issuer.issue(&creds, Ok(req())).await.unwrap_err();
        assert_eq!(e.reason(), "revocations_not_loaded");
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::Unavailable);
        live.seed(&[]);
        issuer.issue(&creds, Ok(req())).await.unwrap();
    }

    #[test]
    fn every_reason_parses_and_unknown_is_refused() {
        for (name, _) in REASONS {
            parse_reason(name).unwrap();
        }
        assert_eq!(
            parse_reason("keyCompromise").unwrap_err().reason(),
            "revocation_unknown_reason"
        );
    }

    #[test]
    fn signed_crl_verifies_with_the_intermediate_and_lists_the_serial() {
        use x509_parser::prelude::FromDer;
        let pki = crate::testing::TestPki::new(crate::ca::generate::KeyType::EcdsaP256);
        let bundle = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
        let now = OffsetDateTime::now_utc();
        let pem = sign_crl(
            &bundle,
            &[rev("0123ab", now, None)],
            now,
            Duration::from_secs(3600),
        )
        .unwrap();
        let der = rustls_pki_types::pem::PemObject::from_pem_slice(pem.as_bytes())
            .map(|d: rustls_pki_types::CertificateRevocationListDer<'_>| d.to_vec())
            .unwrap();
        let (_, crl) =
            x509_parser::revocation_list::CertificateRevocationList::from_der(&der).unwrap();
        let (_, issuer) =
            x509_parser::certificate::X509Certificate::from_der(bundle.signing_cert()).unwrap();
        crl.verify_signature(issuer.public_key())
            .expect("signed by the intermediate");
        let serials: Vec<String> = crl
            .iter_revoked_certificates()
            .map(|r| crate::ca::serial_hex(r.raw_serial()))
            .collect();
        assert_eq!(serials, ["123ab"]);
    }

    /// A leaf signed by the leaf-signing CA of `store` now: its PEM and serial.
    fn leaf(store: &CaStore) -> (String, String) {
        let l = crate::testing::leaf(
            &store.snapshot(),
            "spiffe://cluster.local/ns/a/sa/b",
            OffsetDateTime::now_utc(),
        );
        (l.pem, l.serial_hex)
    }

    /// `openssl verify -crl_check` of `leaf` (checks the CRL of the leaf's
    /// own issuer, which must be present).
    fn openssl_crl_check(
        dir: &Path,
        leaf: &str,
        chain: &[String],
        root: &str,
        crl: &str,
    ) -> String {
        std::fs::write(dir.join("leaf.pem"), leaf).unwrap();
        std::fs::write(dir.join("inter.pem"), chain.concat()).unwrap();
        std::fs::write(dir.join("root.pem"), root).unwrap();
        std::fs::write(dir.join("crl.pem"), crl).unwrap();
        let out = std::process::Command::new("openssl")
            .current_dir(dir)
            .args(["verify", "-crl_check", "-CAfile", "root.pem"])
            .args(["-untrusted", "inter.pem", "-CRLfile", "crl.pem", "leaf.pem"])
            .output()
            .expect("openssl is installed");
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// Two-tier issuing rolls over; leaves of the previous issuing CA stay
    /// valid, so the published CRLs cover them too: one CRL per live
    /// issuing CA. openssl accepts the unrevoked leaf of each and rejects
    /// the revoked one of each (with a CRL signed only by the current
    /// issuing CA it finds no CRL for the previous one's leaves).
    #[tokio::test(flavor = "multi_thread")]
    async fn crls_cover_every_live_issuing_ca() {
        let pki = crate::testing::TestPki::new(crate::ca::generate::KeyType::EcdsaP256);
        let now = OffsetDateTime::now_utc();
        let custody = Arc::new(CaStore::new(
            CaBundle::load_dir(pki.path(), now).unwrap(),
            None,
            false,
        ));
        let audit = Arc::new(crate::audit::MemorySink::default());
        let tt =
            crate::ca::issuing::TwoTier::start(custody, Duration::from_secs(3600), audit, None)
                .await
                .unwrap();
        let store = tt.store();
        // The CA certificates between leaf and root: issuing CA, intermediate, root.
        let chain_of = |s: &CaStore| -> Vec<String> {
            s.snapshot()
                .intermediates()
                .iter()
                .map(|c| crate::primitives::pem_encode("CERTIFICATE", c))
                .collect()
        };
        let (old_revoked, old_serial) = leaf(&store);
        let (old_ok, _) = leaf(&store);
        let old_chain = chain_of(&store);
        assert!(tt.roll(false).unwrap());
        let (new_revoked, new_serial) = leaf(&store);
        let (new_ok, _) = leaf(&store);
        let new_chain = chain_of(&store);
        assert_ne!(old_chain[0], new_chain[0], "a new issuing CA");
        let entries = [rev(&old_serial, now, None), rev(&new_serial, now, None)];
        let crls = sign_crls(&store, &entries, now, Duration::from_secs(3600), 7).unwrap();
        assert_eq!(crls.matches("BEGIN X509 CRL").count(), 2);
        let dir = tempfile::tempdir().unwrap();
        let root = &pki.ca.root_cert;
        for (leaf, chain, revoked) in [
            (&old_ok, &old_chain, false),
            (&old_revoked, &old_chain, true),
            (&new_ok, &new_chain, false),
            (&new_revoked, &new_chain, true),
        ] {
            let out = openssl_crl_check(dir.path(), leaf, chain, root, &crls);
            if revoked {
                assert!(out.contains("certificate revoked"), "{out}");
            } else {
                assert!(out.contains("leaf.pem: OK"), "{out}");
            }
        }
        // Only the current issuing CA's CRL: the previous one's leaves
        // cannot be checked at all.
        let only_current =
            sign_crl(&store.snapshot(), &entries, now, Duration::from_secs(3600)).unwrap();
        let out = openssl_crl_check(dir.path(), &old_ok, &old_chain, root, &only_current);
        assert!(out.contains("unable to get certificate CRL"), "{out}");
    }
}
