//! The decision over one PodCertificateRequest: plain data in, `Issue`,
//! `Deny` or `Wait` out. No I/O, no clock, no randomness (all passed in), so
//! every rule is table-tested.

use std::collections::BTreeMap;
use std::time::Duration;

use time::OffsetDateTime;

use crate::ca::csr::KeyKind;
use crate::ca::ttl::JitterBand;
use crate::denylist::{DenyHit, Denylist, Subject};
use crate::identity::{SpiffeId, TrustDomain};
use crate::podindex::Phase;

/// The API server's floor on a pod certificate's lifetime.
pub const MIN_LIFETIME: Duration = Duration::from_secs(3600);
/// The API's default `maxExpirationSeconds`.
pub const DEFAULT_MAX_EXPIRATION_SECS: i64 = 86_400;
/// `notBefore` lies this far before issuance (the API accepts ±5 min).
pub const BACKDATE: Duration = Duration::from_secs(120);
/// `beginRefreshAt` must lie at least this far inside the validity window.
pub const REFRESH_MARGIN: Duration = Duration::from_secs(600);
/// The key type named in an `UnsupportedKeyType` denial.
pub const SUGGESTED_KEY_TYPE: &str = "ECDSAP256";

/// The public key of a request, as extracted by [`super::key::public_key`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyFacts {
    Supported {
        spki_der: Vec<u8>,
        kind: KeyKind,
    },
    /// A key the leaf profile does not take (the text says which).
    Unsupported(String),
    /// No key, or one that does not parse (the API server should have refused it).
    Malformed(String),
}

/// The verified fields of a PodCertificateRequest.
#[derive(Debug, Clone)]
pub struct PcrFacts {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub pod_name: String,
    pub pod_uid: String,
    pub service_account: String,
    pub node_name: String,
    pub max_expiration_seconds: Option<i64>,
    pub key: KeyFacts,
    /// Only the keys matter: meshca recognises none.
    pub unverified_user_annotations: BTreeMap<String, String>,
    /// Time since `metadata.creationTimestamp`.
    pub age: Duration,
}

/// The pod the request names, as the pod index sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodFacts {
    pub uid: String,
    pub node: Option<String>,
    pub service_account: String,
    pub phase: Phase,
    /// Deleting for longer than the API server's leeway
    /// ([`crate::podindex::deleted_by`]): its tokens no longer vouch, and
    /// neither does it here.
    pub deleted: bool,
}

/// What the pod index can say right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexView {
    NotSynced,
    /// The watch has been disconnected this long (over the staleness limit).
    Stale(Duration),
    Synced(Option<PodFacts>),
}

/// Configuration of the signer's decisions.
#[derive(Debug, Clone)]
pub struct Policy {
    pub trust_domain: TrustDomain,
    /// Wanted lifetime, cut to `maxExpirationSeconds` and never under 1 h.
    pub lifetime: Duration,
    /// Where `beginRefreshAt` is drawn, in percent of the lifetime.
    pub refresh_band: JitterBand,
    /// How long a pod missing from the index (or with another UID) is
    /// waited for before the request is denied: informer lag.
    pub pod_wait: Duration,
}

/// A refusal: permanent for the pod's volume (the kubelet does not retry).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DenyReason {
    #[error("key type {0} is not supported; use {SUGGESTED_KEY_TYPE} (meshca also signs ECDSAP384, ED25519, RSA3072 and RSA4096)")]
    UnsupportedKeyType(String),
    #[error("unverifiedUserAnnotations keys are not recognised by this signer: {}", .0.join(", "))]
    InvalidUnverifiedUserAnnotations(Vec<String>),
    #[error("namespace or service account cannot form a SPIFFE identity")]
    InvalidIdentity,
    #[error("{0}")]
    Denylisted(DenyHit),
    #[error("pod {0} is not in meshca's pod index")]
    PodNotFound(String),
    #[error("pod {pod} has UID {indexed}, the request names {requested}")]
    PodUidMismatch {
        pod: String,
        indexed: String,
        requested: String,
    },
    #[error("pod {pod} runs on node {indexed:?}, the request names node {requested}")]
    PodNotOnNode {
        pod: String,
        indexed: Option<String>,
        requested: String,
    },
    #[error("pod {pod} runs as service account {indexed}, the request names {requested}")]
    ServiceAccountMismatch {
        pod: String,
        indexed: String,
        requested: String,
    },
    #[error("pod {0} has terminated")]
    PodTerminated(String),
    #[error("pod {0} has been deleting for longer than the API server's one-minute leeway")]
    PodDeleted(String),
}

impl DenyReason {
    /// Stable reason code: audit record and metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::UnsupportedKeyType(_) => "podcert_unsupported_key_type",
            Self::InvalidUnverifiedUserAnnotations(_) => "podcert_invalid_user_annotations",
            Self::InvalidIdentity => "podcert_invalid_identity",
            Self::Denylisted(h) => h.reason(),
            Self::PodNotFound(_) => "podcert_pod_not_found",
            Self::PodUidMismatch { .. } => "podcert_pod_uid_mismatch",
            Self::PodNotOnNode { .. } => "podcert_pod_not_on_node",
            Self::ServiceAccountMismatch { .. } => "podcert_service_account_mismatch",
            Self::PodTerminated(_) => "podcert_pod_terminated",
            Self::PodDeleted(_) => "podcert_pod_deleted",
        }
    }

    /// The `Denied` condition's reason: the API's own where it defines one.
    pub fn condition_reason(&self) -> &'static str {
        match self {
            Self::UnsupportedKeyType(_) => "UnsupportedKeyType",
            Self::InvalidUnverifiedUserAnnotations(_) => "InvalidUnverifiedUserAnnotations",
            Self::InvalidIdentity => "MeshcaInvalidIdentity",
            Self::Denylisted(_) => "MeshcaDenylisted",
            Self::PodNotFound(_) => "MeshcaPodNotFound",
            Self::PodUidMismatch { .. } => "MeshcaPodUIDMismatch",
            Self::PodNotOnNode { .. } => "MeshcaPodNotOnNode",
            Self::ServiceAccountMismatch { .. } => "MeshcaServiceAccountMismatch",
            Self::PodTerminated(_) => "MeshcaPodTerminated",
            Self::PodDeleted(_) => "MeshcaPodDeleted",
        }
    }
}

/// Why no decision is taken yet (no record, no status; checked again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitReason {
    IndexNotSynced,
    IndexStale,
    /// The pod is missing or has another UID, within `pod_wait`.
    PodNotIndexedYet,
}

/// What to do with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Issue {
        identity: SpiffeId,
        spki_der: Vec<u8>,
        lifetime: Duration,
    },
    Deny(DenyReason),
    Wait(WaitReason),
    /// The request cannot be served for a reason of meshca's own (the API
    /// server accepted a key meshca cannot read): `Failed`.
    Fail(FailReason),
}

/// `Failed`: meshca could not serve a valid request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FailReason {
    #[error("public key cannot be read: {0}")]
    MalformedKey(String),
    #[error("the signing certificate expires at {0}, too soon for a 1h pod certificate")]
    SignerExpiring(OffsetDateTime),
    #[error("signing failed: {0}")]
    Signing(String),
    /// The rotation's write-ahead issuance mark could not be made durable:
    /// the certificate is withheld, as for CreateCertificate.
    #[error("recording the issued certificate's expiry failed: {0}")]
    IssuanceRecord(String),
}

impl FailReason {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::MalformedKey(_) => "podcert_malformed_key",
            Self::SignerExpiring(_) => "podcert_signer_expiring",
            Self::Signing(_) => "podcert_sign_failed",
            Self::IssuanceRecord(_) => "podcert_issuance_record_failed",
        }
    }

    pub fn condition_reason(&self) -> &'static str {
        match self {
            Self::MalformedKey(_) => "MeshcaMalformedPublicKey",
            Self::SignerExpiring(_) => "MeshcaSignerExpiring",
            Self::Signing(_) => "MeshcaSigningFailed",
            Self::IssuanceRecord(_) => "MeshcaIssuanceRecordFailed",
        }
    }
}

/// Decides one request. Order: the API's own denials (key type,
/// annotations), the identity, the kill switch, then the pod index.
pub fn decide(pcr: &PcrFacts, index: &IndexView, denylist: &Denylist, policy: &Policy) -> Decision {
    let spki_der = match &pcr.key {
        KeyFacts::Supported { spki_der, .. } => spki_der.clone(),
        KeyFacts::Unsupported(t) => {
            return Decision::Deny(DenyReason::UnsupportedKeyType(t.clone()))
        }
        KeyFacts::Malformed(e) => return Decision::Fail(FailReason::MalformedKey(e.clone())),
    };
    // No annotation may change the identity, and meshca knows none that
    // would not: any key is refused, as the API asks of unknown keys.
    if !pcr.unverified_user_annotations.is_empty() {
        return Decision::Deny(DenyReason::InvalidUnverifiedUserAnnotations(
            pcr.unverified_user_annotations.keys().cloned().collect(),
        ));
    }
    let Ok(identity) = SpiffeId::new(
        policy.trust_domain.clone(),
        &pcr.namespace,
        &pcr.service_account,
    ) else {
        return Decision::Deny(DenyReason::InvalidIdentity);
    };
    let pod = format!("{}/{}", pcr.namespace, pcr.pod_name);
    let sa = format!("{}/{}", pcr.namespace, pcr.service_account);
    let subject = Subject {
        requested_identity: Some(&identity),
        nodes: [Some(&pcr.node_name), None],
        caller_pod: Some(&pod),
        caller_pod_uid: Some(&pcr.pod_uid),
        caller_service_account: Some(&sa),
        ..Default::default()
    };
    if let Err(hit) = crate::denylist::check(denylist, &subject) {
        return Decision::Deny(DenyReason::Denylisted(hit));
    }
    let found = match index {
        IndexView::NotSynced => return Decision::Wait(WaitReason::IndexNotSynced),
        IndexView::Stale(_) => return Decision::Wait(WaitReason::IndexStale),
        IndexView::Synced(found) => found,
    };
    let lagging = pcr.age < policy.pod_wait;
    let Some(p) = found else {
        return if lagging {
            Decision::Wait(WaitReason::PodNotIndexedYet)
        } else {
            Decision::Deny(DenyReason::PodNotFound(pod))
        };
    };
    if p.uid != pcr.pod_uid {
        return if lagging {
            Decision::Wait(WaitReason::PodNotIndexedYet)
        } else {
            Decision::Deny(DenyReason::PodUidMismatch {
                pod,
                indexed: p.uid.clone(),
                requested: pcr.pod_uid.clone(),
            })
        };
    }
    // As the API server decides a bound token: the UID first, then deletion.
    if p.deleted {
        return Decision::Deny(DenyReason::PodDeleted(pod));
    }
    if p.node.as_deref() != Some(pcr.node_name.as_str()) {
        return Decision::Deny(DenyReason::PodNotOnNode {
            pod,
            indexed: p.node.clone(),
            requested: pcr.node_name.clone(),
        });
    }
    if p.service_account != pcr.service_account {
        return Decision::Deny(DenyReason::ServiceAccountMismatch {
            pod,
            indexed: p.service_account.clone(),
            requested: pcr.service_account.clone(),
        });
    }
    if p.phase.is_terminal() {
        return Decision::Deny(DenyReason::PodTerminated(pod));
    }
    Decision::Issue {
        identity,
        spki_der,
        lifetime: lifetime(policy.lifetime, pcr.max_expiration_seconds),
    }
}

/// The configured lifetime within `[1h, maxExpirationSeconds]`.
pub fn lifetime(wanted: Duration, max_expiration_seconds: Option<i64>) -> Duration {
    let max = max_expiration_seconds.unwrap_or(DEFAULT_MAX_EXPIRATION_SECS);
    let max = Duration::from_secs(u64::try_from(max).unwrap_or(0)).max(MIN_LIFETIME);
    wanted.clamp(MIN_LIFETIME, max)
}

/// The status timestamps of an issued certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Times {
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
    pub begin_refresh_at: OffsetDateTime,
}

/// Timestamps for a certificate living `lifetime` issued at `now`, in whole
/// seconds (the status and the leaf must agree exactly). `notAfter` is cut
/// to the signer's expiry; under 1 h left is `SignerExpiring`.
/// `beginRefreshAt` is drawn by `draw` from `band` of the lifetime, so pods
/// started together renew apart, and kept 10 min inside the window.
pub fn times(
    now: OffsetDateTime,
    lifetime: Duration,
    signer_not_after: OffsetDateTime,
    band: JitterBand,
    draw: u64,
) -> Result<Times, FailReason> {
    let now = now.replace_nanosecond(0).unwrap_or(now);
    let not_before = now - BACKDATE;
    let signer_cut = signer_not_after
        .replace_nanosecond(0)
        .unwrap_or(signer_not_after);
    let not_after = (not_before + lifetime).min(signer_cut);
    let span = (not_after - not_before).whole_seconds();
    if span < MIN_LIFETIME.as_secs() as i64 {
        return Err(FailReason::SignerExpiring(signer_not_after));
    }
    let span = span as u64;
    let offset = crate::ca::ttl::jittered_lifetime(span, Some(band), draw);
    let margin = REFRESH_MARGIN.as_secs();
    let offset = offset.clamp(margin, span - margin);
    Ok(Times {
        not_before,
        not_after,
        begin_refresh_at: not_before + Duration::from_secs(offset),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;
    use time::macros::datetime;

    const NODE: &str = "node-a";

    fn policy() -> Policy {
        Policy {
            trust_domain: TrustDomain::new("cluster.local").unwrap(),
            lifetime: Duration::from_secs(24 * 3600),
            refresh_band: JitterBand::new(50, 75).unwrap(),
            pod_wait: Duration::from_secs(30),
        }
    }

    fn pcr() -> PcrFacts {
        PcrFacts {
            namespace: "app".into(),
            name: "pcr-1".into(),
            uid: "pcr-uid".into(),
            pod_name: "web-0".into(),
            pod_uid: "pod-uid".into(),
            service_account: "web".into(),
            node_name: NODE.into(),
            max_expiration_seconds: None,
            key: KeyFacts::Supported {
                spki_der: vec![1, 2, 3],
                kind: KeyKind::EcdsaP256,
            },
            unverified_user_annotations: BTreeMap::new(),
            age: Duration::from_secs(1),
        }
    }

    fn pod() -> PodFacts {
        PodFacts {
            uid: "pod-uid".into(),
            node: Some(NODE.into()),
            service_account: "web".into(),
            phase: Phase::Running,
            deleted: false,
        }
    }

    fn synced(p: Option<PodFacts>) -> IndexView {
        IndexView::Synced(p)
    }

    fn reason(d: &Decision) -> String {
        match d {
            Decision::Issue { .. } => "issue".into(),
            Decision::Deny(r) => r.reason().into(),
            Decision::Fail(f) => f.reason().into(),
            Decision::Wait(w) => format!("wait:{w:?}"),
        }
    }

    type Edit = fn(&mut PcrFacts, &mut IndexView, &mut Denylist);

    #[test_case(|_, _, _| {}, "issue" ; "matching pod issues")]
    #[test_case(|p, _, _| p.key = KeyFacts::Unsupported("ECDSAP521".into()), "podcert_unsupported_key_type" ; "p521 key")]
    #[test_case(|p, _, _| p.key = KeyFacts::Malformed("junk".into()), "podcert_malformed_key" ; "malformed key fails")]
    #[test_case(|p, _, _| { p.unverified_user_annotations.insert("spiffe/path-overriding".into(), "/x".into()); }, "podcert_invalid_user_annotations" ; "any annotation key")]
    #[test_case(|p, _, _| p.service_account = "a,b".into(), "podcert_invalid_identity" ; "sa that is no spiffe segment")]
    #[test_case(|_, _, d| *d = Denylist::parse("node node-a").unwrap(), "denylist_node" ; "denylisted node")]
    #[test_case(|_, _, d| *d = Denylist::parse("identity spiffe://cluster.local/ns/app/sa/web").unwrap(), "denylist_identity" ; "denylisted identity")]
    #[test_case(|_, _, d| *d = Denylist::parse("pod app/web-0").unwrap(), "denylist_pod" ; "denylisted pod")]
    #[test_case(|_, _, d| *d = Denylist::parse("pod-uid pod-uid").unwrap(), "denylist_pod" ; "denylisted pod uid")]
    #[test_case(|_, _, d| *d = Denylist::parse("serviceaccount app/web").unwrap(), "denylist_service_account" ; "denylisted sa")]
    #[test_case(|_, i, d| { *i = IndexView::NotSynced; *d = Denylist::parse("node node-a").unwrap(); }, "denylist_node" ; "kill switch needs no index")]
    #[test_case(|_, i, _| *i = IndexView::NotSynced, "wait:IndexNotSynced" ; "index not synced waits")]
    #[test_case(|_, i, _| *i = IndexView::Stale(Duration::from_secs(90)), "wait:IndexStale" ; "stale index waits")]
    #[test_case(|_, i, _| *i = synced(None), "wait:PodNotIndexedYet" ; "young request for unknown pod waits")]
    #[test_case(|p, i, _| { p.age = Duration::from_secs(31); *i = synced(None); }, "podcert_pod_not_found" ; "old request for unknown pod is denied")]
    #[test_case(|p, _, _| p.pod_uid = "other".into(), "wait:PodNotIndexedYet" ; "young uid mismatch waits")]
    #[test_case(|p, _, _| { p.pod_uid = "other".into(); p.age = Duration::from_secs(60); }, "podcert_pod_uid_mismatch" ; "old uid mismatch is denied")]
    #[test_case(|p, _, _| p.node_name = "node-b".into(), "podcert_pod_not_on_node" ; "pod on another node")]
    #[test_case(|_, i, _| *i = synced(Some(PodFacts { node: None, ..pod() })), "podcert_pod_not_on_node" ; "unscheduled pod")]
    #[test_case(|p, _, _| p.service_account = "admin".into(), "podcert_service_account_mismatch" ; "wrong service account")]
    #[test_case(|_, i, _| *i = synced(Some(PodFacts { phase: Phase::Succeeded, ..pod() })), "podcert_pod_terminated" ; "terminated pod")]
    #[test_case(|_, i, _| *i = synced(Some(PodFacts { deleted: true, ..pod() })), "podcert_pod_deleted" ; "pod deleting past the leeway")]
    #[test_case(|p, i, _| { p.pod_uid = "other".into(); *i = synced(Some(PodFacts { deleted: true, ..pod() })); }, "wait:PodNotIndexedYet" ; "uid checked before deletion")]
    fn decisions(edit: Edit, want: &str) {
        let (mut p, mut i, mut d) = (pcr(), synced(Some(pod())), Denylist::default());
        edit(&mut p, &mut i, &mut d);
        assert_eq!(reason(&decide(&p, &i, &d, &policy())), want);
    }

    #[test]
    fn the_identity_comes_from_the_namespace_and_service_account_only() {
        let d = decide(
            &pcr(),
            &synced(Some(pod())),
            &Denylist::default(),
            &policy(),
        );
        let Decision::Issue {
            identity,
            spki_der,
            lifetime,
        } = d
        else {
            panic!("{d:?}")
        };
        assert_eq!(identity.to_string(), "spiffe://cluster.local/ns/app/sa/web");
        assert_eq!(spki_der, vec![1, 2, 3]);
        assert_eq!(lifetime, Duration::from_secs(24 * 3600));
    }

    #[test]
    fn denials_carry_the_api_reasons_and_a_suggested_key_type() {
        let r = DenyReason::UnsupportedKeyType("ECDSAP521".into());
        assert_eq!(r.condition_reason(), "UnsupportedKeyType");
        assert!(r.to_string().contains("use ECDSAP256"), "{r}");
        let r = DenyReason::InvalidUnverifiedUserAnnotations(vec!["a.io/b".into()]);
        assert_eq!(r.condition_reason(), "InvalidUnverifiedUserAnnotations");
    }

    #[test]
    fn condition_reasons_are_camel_case() {
        let all = [
            DenyReason::UnsupportedKeyType(String::new()).condition_reason(),
            DenyReason::InvalidUnverifiedUserAnnotations(vec![]).condition_reason(),
            DenyReason::InvalidIdentity.condition_reason(),
            DenyReason::Denylisted(DenyHit::Node(String::new())).condition_reason(),
            DenyReason::PodNotFound(String::new()).condition_reason(),
            DenyReason::PodDeleted(String::new()).condition_reason(),
            FailReason::Signing(String::new()).condition_reason(),
            FailReason::IssuanceRecord(String::new()).condition_reason(),
            FailReason::MalformedKey(String::new()).condition_reason(),
            FailReason::SignerExpiring(OffsetDateTime::UNIX_EPOCH).condition_reason(),
        ];
        for r in all {
            assert!(r.chars().next().unwrap().is_ascii_uppercase(), "{r}");
            assert!(r.chars().all(|c| c.is_ascii_alphanumeric()), "{r}");
        }
    }

    #[test_case(24 * 3600, None, 24 * 3600 ; "default max keeps 24h")]
    #[test_case(24 * 3600, Some(3600), 3600 ; "cut to max expiration")]
    #[test_case(24 * 3600, Some(7200), 7200 ; "cut to two hours")]
    #[test_case(600, Some(86_400), 3600 ; "never under one hour")]
    #[test_case(100 * 86_400, Some(7_862_400), 7_862_400 ; "cut to 91 days")]
    #[test_case(24 * 3600, Some(-5), 3600 ; "nonsense max still one hour")]
    fn lifetimes(wanted: u64, max: Option<i64>, want: u64) {
        assert_eq!(
            lifetime(Duration::from_secs(wanted), max),
            Duration::from_secs(want)
        );
    }

    const NOW: OffsetDateTime = datetime!(2026-09-01 12:00:00.750 UTC);
    const FAR: OffsetDateTime = datetime!(2036-01-01 0:00 UTC);

    #[test_case(3600, 0 ; "one hour, lowest draw")]
    #[test_case(3600, u64::MAX ; "one hour, highest draw")]
    #[test_case(86_400, 12_345 ; "a day")]
    #[test_case(7_862_400, 99 ; "91 days")]
    fn times_satisfy_the_api_rules(lifetime: u64, draw: u64) {
        let band = JitterBand::new(50, 75).unwrap();
        let t = times(NOW, Duration::from_secs(lifetime), FAR, band, draw).unwrap();
        assert_eq!(t.not_before.nanosecond(), 0, "whole seconds");
        let skew = (t.not_before - NOW).whole_seconds().abs();
        assert!(skew <= 300, "notBefore within ±5 min: {skew}");
        assert_eq!(
            (t.not_after - t.not_before).whole_seconds(),
            lifetime as i64
        );
        assert!(t.begin_refresh_at >= t.not_before + REFRESH_MARGIN);
        assert!(t.begin_refresh_at <= t.not_after - REFRESH_MARGIN);
        let off = (t.begin_refresh_at - t.not_before).whole_seconds() as u64;
        assert!(off >= lifetime / 2 && off <= lifetime * 3 / 4 + 1, "{off}");
    }

    #[test]
    fn refresh_points_are_spread() {
        let band = JitterBand::new(50, 75).unwrap();
        let points: std::collections::BTreeSet<_> = (0..50u64)
            .map(|d| {
                times(NOW, Duration::from_secs(86_400), FAR, band, d * 7919)
                    .unwrap()
                    .begin_refresh_at
            })
            .collect();
        assert!(points.len() > 40, "{}", points.len());
    }

    #[test]
    fn a_signer_expiring_soon_cuts_or_fails() {
        let band = JitterBand::new(50, 75).unwrap();
        let soon = NOW + Duration::from_secs(5 * 3600);
        let t = times(NOW, Duration::from_secs(86_400), soon, band, 1).unwrap();
        assert_eq!(t.not_after, soon.replace_nanosecond(0).unwrap());
        let too_soon = NOW + Duration::from_secs(1800);
        let e = times(NOW, Duration::from_secs(86_400), too_soon, band, 1).unwrap_err();
        assert_eq!(e.reason(), "podcert_signer_expiring");
    }
}
