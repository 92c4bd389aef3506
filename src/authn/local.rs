//! Local verification of projected ServiceAccount tokens: the signature
//! against the cluster issuer's keys ([`super::jwks`]), the claims, and the
//! bound pod against the live pod index. That is what a TokenReview checks,
//! without the round trip; the index's lag is the only window in which a
//! deleted pod's token still passes (measured in docs/BENCHMARKS.md).
//!
//! Whatever local verification cannot decide (an unknown issuer or `kid`, a
//! pod the index does not show, an index not yet synced) goes to TokenReview
//! in `local-then-review` mode and is refused in `local` mode. The decisions
//! are plain functions ([`verify_token`], [`bind`]) tested by tables;
//! [`LocalVerifier`] is one per (cluster, issuer), so a verifier per remote
//! cluster is just another instance.

use std::sync::Arc;
use std::time::Instant;

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::Validation;

use super::jwks::{key_set_age, IssuerKeys, KeySet, KeySetAge};
use super::{AuthnError, AuthnMethod, Caller, KubernetesInfo, TokenAuthenticator};
use crate::identity::{SpiffeId, TrustDomain};
use crate::podindex::accounts::{AccountIndex, AccountState};
use crate::podindex::{IndexState, PodIndex};

/// Leeway on `exp` and `nbf`: the API server's own (go-jose's default of one
/// minute), so local verification accepts no token a review would refuse for time.
pub const CLOCK_SKEW_SECS: u64 = 60;

pub use super::args::TokenVerificationMode;

/// Why local verification refused a token or could not decide.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LocalError {
    #[error("not a JWT: {0}")]
    Malformed(String),
    #[error("signing algorithm {0} is not the one the key allows")]
    AlgorithmNotAllowed(String),
    #[error("issuer {0:?} is not this cluster's")]
    UnknownIssuer(String),
    #[error("no issuer key with kid {0:?}")]
    UnknownKey(String),
    #[error("the issuer's keys have not been fetched yet")]
    KeysUnavailable,
    /// The last good key set is older than `MESHCA_JWKS_MAX_AGE` (every
    /// fetch since failed): a key the issuer removed may still be in it.
    #[error("the issuer's keys were fetched {age_secs}s ago, over the maximum age of {max_secs}s")]
    KeysStale { age_secs: u64, max_secs: u64 },
    #[error("signature does not verify")]
    BadSignature,
    #[error("the token has expired")]
    Expired,
    #[error("the token is not valid yet")]
    NotYetValid,
    #[error("the token was issued in the future")]
    IssuedInFuture,
    #[error("token audiences do not include {0:?}")]
    AudienceMismatch(Vec<String>),
    #[error("claims: {0}")]
    InvalidClaims(String),
    #[error("the token is not bound to a pod")]
    NotPodBound,
    #[error("the token is not bound to a pod, and a pod binding is required")]
    PodBindingRequired,
    #[error("pod or service account index has not completed its first sync")]
    IndexNotSynced,
    #[error("{0}")]
    IndexStale(String),
    #[error("service account {0} is not in the index")]
    ServiceAccountNotIndexed(String),
    #[error("service account {account} has UID {indexed}, the token names {token}")]
    ServiceAccountUidMismatch {
        account: String,
        indexed: String,
        token: String,
    },
    #[error("service account {0} has been deleted")]
    ServiceAccountDeleted(String),
    #[error("pod {0} has been deleted")]
    PodDeleted(String),
    #[error("pod {0} is not in the index")]
    PodNotIndexed(String),
    #[error("pod {pod} has UID {indexed}, the token names {token}")]
    PodUidMismatch {
        pod: String,
        indexed: String,
        token: String,
    },
    #[error("pod {pod} runs as {indexed}, the token names {token}")]
    ServiceAccountMismatch {
        pod: String,
        indexed: String,
        token: String,
    },
    #[error("pod {pod} is on node {indexed}, the token names {token}")]
    NodeMismatch {
        pod: String,
        indexed: String,
        token: String,
    },
    #[error("pod {0} has no node in the index, the token names one")]
    NodeNotIndexed(String),
    #[error("client claims to be in cluster {0:?}, this verifier is for {1:?}")]
    UnknownCluster(String, String),
}

impl LocalError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Malformed(_) => "token_local_malformed",
            Self::AlgorithmNotAllowed(_) => "token_local_alg_not_allowed",
            Self::UnknownIssuer(_) => "token_local_unknown_issuer",
            Self::UnknownKey(_) => "token_local_unknown_kid",
            Self::KeysUnavailable => "token_local_keys_unavailable",
            Self::KeysStale { .. } => "token_local_keys_stale",
            Self::BadSignature => "token_local_bad_signature",
            Self::Expired => "token_local_expired",
            Self::NotYetValid => "token_local_not_yet_valid",
            Self::IssuedInFuture => "token_local_issued_in_future",
            Self::AudienceMismatch(_) => "token_local_audience_mismatch",
            Self::InvalidClaims(_) => "token_local_invalid_claims",
            Self::NotPodBound => "token_local_not_pod_bound",
            Self::PodBindingRequired => "token_pod_binding_required",
            Self::IndexNotSynced => "token_local_index_not_synced",
            Self::IndexStale(_) => "token_local_index_stale",
            Self::ServiceAccountNotIndexed(_) => "token_local_sa_not_indexed",
            Self::ServiceAccountUidMismatch { .. } => "token_local_sa_uid_mismatch",
            Self::ServiceAccountDeleted(_) => "token_local_sa_deleted",
            Self::PodDeleted(_) => "token_local_pod_deleted",
            Self::PodNotIndexed(_) => "token_local_pod_not_indexed",
            Self::PodUidMismatch { .. } => "token_local_pod_uid_mismatch",
            Self::ServiceAccountMismatch { .. } => "token_local_sa_mismatch",
            Self::NodeMismatch { .. } => "token_local_node_mismatch",
            Self::NodeNotIndexed(_) => "token_local_node_not_indexed",
            Self::UnknownCluster(..) => "token_unknown_cluster",
        }
    }

    /// TokenReview may still decide: local verification lacks a key, an
    /// issuer, or an up-to-date view of the pod or service account (an index
    /// may lag a create or a recreation, or have lost its watch).
    /// Everything else is a verdict a review would share: the signature or
    /// the claims are wrong under a key the API server itself published, or
    /// the index shows what the API server refuses (a deletion timestamp is
    /// never taken back).
    pub fn falls_back(&self) -> bool {
        matches!(
            self,
            Self::UnknownIssuer(_)
                | Self::UnknownKey(_)
                | Self::KeysUnavailable
                | Self::KeysStale { .. }
                | Self::NotPodBound
                | Self::IndexNotSynced
                | Self::IndexStale(_)
                | Self::ServiceAccountNotIndexed(_)
                | Self::ServiceAccountUidMismatch { .. }
                | Self::PodNotIndexed(_)
                | Self::PodUidMismatch { .. }
                | Self::NodeNotIndexed(_)
        )
    }

    /// With no review to fall back to, the client should retry later.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::KeysUnavailable
                | Self::KeysStale { .. }
                | Self::IndexNotSynced
                | Self::IndexStale(_)
        )
    }
}

/// `kubernetes.io` claims of a projected token.
#[derive(Debug, Clone, serde::Deserialize)]
struct KubeClaims {
    namespace: String,
    serviceaccount: ObjectRef,
    pod: Option<ObjectRef>,
    node: Option<ObjectRef>,
}

#[derive(Debug, Clone, serde::Deserialize)]
struct ObjectRef {
    name: String,
    /// The API server leaves a node's UID out when it could not read the Node.
    #[serde(default)]
    uid: String,
}

#[derive(Debug, serde::Deserialize)]
struct Claims {
    sub: String,
    iat: Option<i64>,
    #[serde(rename = "kubernetes.io")]
    kube: Option<KubeClaims>,
}

#[derive(Debug, serde::Deserialize)]
struct Peek {
    iss: Option<serde_json::Value>,
}

/// What a verified token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub namespace: String,
    pub service_account: String,
    pub service_account_uid: String,
    /// `(name, uid)`.
    pub pod: Option<(String, String)>,
    /// `(name, uid)`; the uid may be empty (see [`ObjectRef`]).
    pub node: Option<(String, String)>,
}

fn raw_alg(token: &str) -> Option<String> {
    use base64::Engine;
    let header = token.split('.').next()?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(header.trim_end_matches('='))
        .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    v.get("alg")?.as_str().map(str::to_string)
}

/// Verifies a token's signature and claims against `issuer`'s `keys`.
/// Only the algorithm the key allows is accepted: `none`, and `HS256` keyed
/// with the public key, are refused before any signature check.
pub fn verify_token(
    token: &str,
    issuer: &str,
    keys: &KeySet,
    audiences: &[String],
) -> Result<Verified, LocalError> {
    let header = jsonwebtoken::decode_header(token).map_err(|e| match raw_alg(token) {
        Some(alg) if matches!(e.kind(), ErrorKind::Json(_)) => LocalError::AlgorithmNotAllowed(alg),
        _ => LocalError::Malformed(e.to_string()),
    })?;
    let peek: Peek = jsonwebtoken::dangerous::insecure_decode_claims(token)
        .map_err(|e| LocalError::Malformed(e.to_string()))?;
    match peek.iss {
        Some(serde_json::Value::String(iss)) if iss == issuer => {}
        Some(serde_json::Value::String(iss)) => return Err(LocalError::UnknownIssuer(iss)),
        other => return Err(LocalError::UnknownIssuer(format!("{other:?}"))),
    }
    let mut v = Validation::new(header.alg);
    v.leeway = CLOCK_SKEW_SECS;
    v.validate_nbf = true;
    v.set_audience(audiences);
    v.set_issuer(&[issuer]);
    v.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
    let decode = |key: &super::jwks::VerifyKey| {
        jsonwebtoken::decode::<Claims>(token, &key.key, &v).map_err(|e| match e.kind() {
            ErrorKind::InvalidSignature => LocalError::BadSignature,
            ErrorKind::ExpiredSignature => LocalError::Expired,
            ErrorKind::ImmatureSignature => LocalError::NotYetValid,
            ErrorKind::InvalidAudience => LocalError::AudienceMismatch(audiences.to_vec()),
            ErrorKind::InvalidIssuer => LocalError::UnknownIssuer(String::new()),
            ErrorKind::InvalidAlgorithm => {
                LocalError::AlgorithmNotAllowed(format!("{:?}", header.alg))
            }
            ErrorKind::MissingRequiredClaim(c) => LocalError::InvalidClaims(format!("no {c}")),
            ErrorKind::InvalidClaimFormat(c) => LocalError::InvalidClaims(format!("bad {c}")),
            ErrorKind::Json(j) => LocalError::InvalidClaims(j.to_string()),
            _ => LocalError::Malformed(e.to_string()),
        })
    };
    let data = match header.kid.as_deref().filter(|k| !k.is_empty()) {
        Some(kid) => {
            let key = keys
                .get(kid)
                .ok_or_else(|| LocalError::UnknownKey(kid.to_string()))?;
            if header.alg != key.alg {
                return Err(LocalError::AlgorithmNotAllowed(format!("{:?}", header.alg)));
            }
            decode(key)?
        }
        // No `kid`: the API server tries each of its keys, and so does this
        // (those of the header's algorithm, in `kid` order). The signature
        // is checked before the claims, so any other error than a bad
        // signature means this key signed it.
        None => {
            let mut candidates: Vec<(&String, &super::jwks::VerifyKey)> = keys
                .keys
                .iter()
                .filter(|(_, k)| k.alg == header.alg)
                .collect();
            if candidates.is_empty() {
                return Err(LocalError::AlgorithmNotAllowed(format!("{:?}", header.alg)));
            }
            candidates.sort_by(|a, b| a.0.cmp(b.0));
            let mut found = None;
            for (_, key) in candidates {
                match decode(key) {
                    Err(LocalError::BadSignature) => continue,
                    other => {
                        found = Some(other?);
                        break;
                    }
                }
            }
            // None of the keys known here: the issuer may have a newer one.
            found.ok_or_else(|| LocalError::UnknownKey(String::new()))?
        }
    };
    let claims = data.claims;
    // The API server's validator refuses a token issued more than its leeway
    // in the future (jsonwebtoken checks exp and nbf, not iat).
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    if claims
        .iat
        .is_some_and(|iat| iat > now.saturating_add(CLOCK_SKEW_SECS as i64))
    {
        return Err(LocalError::IssuedInFuture);
    }
    let k = claims
        .kube
        .ok_or_else(|| LocalError::InvalidClaims("no kubernetes.io claims".into()))?;
    let want_sub = format!(
        "system:serviceaccount:{}:{}",
        k.namespace, k.serviceaccount.name
    );
    if claims.sub != want_sub {
        return Err(LocalError::InvalidClaims(format!(
            "sub {:?} does not name {want_sub:?}",
            claims.sub
        )));
    }
    if k.namespace.is_empty() || k.serviceaccount.name.is_empty() {
        return Err(LocalError::InvalidClaims(
            "empty namespace or serviceaccount".into(),
        ));
    }
    if k.serviceaccount.uid.is_empty() {
        return Err(LocalError::InvalidClaims("no serviceaccount uid".into()));
    }
    let pod = match k.pod {
        Some(p) if p.name.is_empty() || p.uid.is_empty() => {
            return Err(LocalError::InvalidClaims("pod without name or uid".into()))
        }
        Some(p) => Some((p.name, p.uid)),
        None => None,
    };
    let node = match k.node {
        Some(n) if n.name.is_empty() => {
            return Err(LocalError::InvalidClaims("node without name".into()))
        }
        Some(n) => Some((n.name, n.uid)),
        None => None,
    };
    Ok(Verified {
        namespace: k.namespace,
        service_account: k.serviceaccount.name,
        service_account_uid: k.serviceaccount.uid,
        pod,
        node,
    })
}

/// Whether the indexes can vouch for anything: both have completed their
/// first list, and neither watch has been disconnected longer than
/// `max_staleness` (a deleted pod or account would still be in them).
pub fn indexes_ready(
    pods_synced: bool,
    accounts_synced: bool,
    pods_disconnected_for: Option<std::time::Duration>,
    accounts_disconnected_for: Option<std::time::Duration>,
    max_staleness: std::time::Duration,
) -> Result<(), LocalError> {
    if !pods_synced || !accounts_synced {
        return Err(LocalError::IndexNotSynced);
    }
    for (what, d) in [
        ("pod", pods_disconnected_for),
        ("service account", accounts_disconnected_for),
    ] {
        if let Some(d) = d.filter(|d| *d > max_staleness) {
            return Err(LocalError::IndexStale(format!(
                "{what} watch disconnected for {}s (max {}s)",
                d.as_secs(),
                max_staleness.as_secs()
            )));
        }
    }
    Ok(())
}

/// What the API server checks of a bound token's objects, against the
/// indexes: the ServiceAccount exists with the token's UID and is not
/// deleted; the pod exists with the token's UID and is not deleted (both by
/// `now_unix`, with the API server's leeway, see
/// [`crate::podindex::deleted_by`]). Then, stricter than a review: the pod
/// runs as the token's service account, on the token's node when it names one.
pub fn bind(
    v: &Verified,
    require_pod_binding: bool,
    now_unix: i64,
    pods: &IndexState,
    accounts: &AccountState,
) -> Result<(), LocalError> {
    let Some((pod_name, pod_uid)) = &v.pod else {
        return Err(if require_pod_binding {
            LocalError::PodBindingRequired
        } else {
            LocalError::NotPodBound
        });
    };
    let sa_ref = format!("{}/{}", v.namespace, v.service_account);
    let sa = accounts
        .get(&v.namespace, &v.service_account)
        .ok_or_else(|| LocalError::ServiceAccountNotIndexed(sa_ref.clone()))?;
    if sa.uid != v.service_account_uid {
        return Err(LocalError::ServiceAccountUidMismatch {
            account: sa_ref,
            indexed: sa.uid.to_string(),
            token: v.service_account_uid.clone(),
        });
    }
    if crate::podindex::deleted_by(sa.deletion_timestamp, now_unix) {
        return Err(LocalError::ServiceAccountDeleted(sa_ref));
    }
    let pod_ref = format!("{}/{pod_name}", v.namespace);
    let pod = pods
        .get(&v.namespace, pod_name)
        .ok_or_else(|| LocalError::PodNotIndexed(pod_ref.clone()))?;
    if *pod.uid != **pod_uid {
        return Err(LocalError::PodUidMismatch {
            pod: pod_ref,
            indexed: pod.uid.to_string(),
            token: pod_uid.clone(),
        });
    }
    if pod.deleted_by(now_unix) {
        return Err(LocalError::PodDeleted(pod_ref));
    }
    if *pod.service_account != *v.service_account {
        return Err(LocalError::ServiceAccountMismatch {
            pod: pod_ref,
            indexed: pod.service_account.to_string(),
            token: v.service_account.clone(),
        });
    }
    if let Some((node, _)) = &v.node {
        match pod.node {
            None => return Err(LocalError::NodeNotIndexed(pod_ref)),
            Some(n) if n != node.as_str() => {
                return Err(LocalError::NodeMismatch {
                    pod: pod_ref,
                    indexed: n.to_string(),
                    token: node.clone(),
                })
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Local verification for one cluster: its issuer keys and its pod index.
#[derive(Debug)]
pub struct LocalVerifier {
    pub cluster_id: String,
    pub keys: Arc<IssuerKeys>,
    pub index: Arc<PodIndex>,
    pub accounts: Arc<AccountIndex>,
    pub audiences: Vec<String>,
    pub trust_domain: TrustDomain,
    pub require_pod_binding: bool,
    /// `MESHCA_POD_INDEX_SYNC_WAIT`: how long a token waits for the indexes' first lists.
    pub sync_wait: std::time::Duration,
    /// `MESHCA_POD_INDEX_MAX_STALENESS`: past it a disconnected watch's
    /// index decides nothing (TokenReview does, or the caller retries).
    pub max_index_staleness: std::time::Duration,
}

impl LocalVerifier {
    /// Verifies `token` for a caller that named `cluster_id` (none: this one).
    pub async fn verify(
        &self,
        token: &str,
        cluster_id: Option<&str>,
    ) -> Result<Caller, LocalError> {
        match cluster_id {
            None | Some("") => {}
            Some(c) if c == self.cluster_id => {}
            Some(c) => {
                return Err(LocalError::UnknownCluster(
                    c.into(),
                    self.cluster_id.clone(),
                ))
            }
        }
        let verified = match self.verify_signed(token) {
            // An unknown kid may be a rotated key: fetch (paced) and try once
            // more. No keys yet means the first fetch is running: `refresh`
            // waits for it, and its result decides (not the pacing). A set
            // past its maximum age gets the same one (paced) fetch.
            Err(
                LocalError::UnknownKey(_)
                | LocalError::KeysUnavailable
                | LocalError::KeysStale { .. },
            ) => {
                self.keys.refresh().await;
                self.verify_signed(token)
            }
            other => other,
        }?;
        if verified.pod.is_none() {
            // Unbound: nothing in the indexes can decide it.
            return Err(if self.require_pod_binding {
                LocalError::PodBindingRequired
            } else {
                LocalError::NotPodBound
            });
        }
        // Both first lists are awaited together, within one sync wait.
        if !self.index.is_synced() || !self.accounts.is_synced() {
            tokio::join!(
                self.index.wait_synced(self.sync_wait),
                self.accounts.wait_synced(self.sync_wait)
            );
        }
        indexes_ready(
            self.index.is_synced(),
            self.accounts.is_synced(),
            self.index.disconnected_for(),
            self.accounts.disconnected_for(),
            self.max_index_staleness,
        )?;
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        self.index.read(|pods| {
            self.accounts
                .read(|accounts| bind(&verified, self.require_pod_binding, now, pods, accounts))
        })?;
        let identity = SpiffeId::new(
            self.trust_domain.clone(),
            &verified.namespace,
            &verified.service_account,
        )
        .map_err(|e| LocalError::InvalidClaims(format!("service account: {e}")))?;
        let (pod_name, pod_uid) = verified.pod.unwrap_or_default();
        Ok(Caller {
            method: AuthnMethod::TokenLocal,
            identity,
            kube: Some(KubernetesInfo {
                pod_namespace: verified.namespace,
                pod_name,
                pod_uid,
                service_account: verified.service_account,
                node_name: verified.node.map(|n| n.0),
                cluster_id: None,
            }),
        })
    }

    fn verify_signed(&self, token: &str) -> Result<Verified, LocalError> {
        let snap = self.keys.current().ok_or(LocalError::KeysUnavailable)?;
        let max_age = self.keys.policy().max_age;
        if let KeySetAge::Stale { age } = key_set_age(snap.fetched, Instant::now(), max_age) {
            return Err(LocalError::KeysStale {
                age_secs: age.as_secs(),
                max_secs: max_age.as_secs(),
            });
        }
        verify_token(token, &snap.issuer, &snap.keys, &self.audiences)
    }
}

/// The token authenticator in every mode: TokenReview, local, or local with
/// TokenReview for what local verification cannot decide. Also enforces
/// `MESHCA_TOKEN_REQUIRE_POD_BINDING` on reviewed tokens.
#[derive(Debug)]
pub struct TokenVerifier {
    pub mode: TokenVerificationMode,
    pub local: Option<Arc<LocalVerifier>>,
    pub review: Option<Arc<dyn TokenAuthenticator>>,
    pub require_pod_binding: bool,
    pub metrics: Option<Arc<super::metrics::TokenPathMetrics>>,
}

impl TokenVerifier {
    fn count(&self, path: &'static str, result: &'static str) {
        if let Some(m) = &self.metrics {
            m.verifications
                .get_or_create(&super::metrics::TokenPathLabels { path, result })
                .inc();
        }
    }

    fn local_outcome(&self, reason: &'static str) {
        if let Some(m) = &self.metrics {
            m.local_outcomes
                .get_or_create(&crate::metrics::RefusalLabels { reason })
                .inc();
        }
    }

    async fn review(
        &self,
        token: &str,
        cluster_id: Option<&str>,
        after: Option<&'static str>,
    ) -> Result<Caller, AuthnError> {
        let Some(review) = &self.review else {
            return Err(AuthnError::TokenAuthnDisabled);
        };
        let note = |detail: String, fallback: &str| {
            format!("{detail} (TokenReview after local verification: {fallback})")
        };
        let result = match (review.authenticate(token, cluster_id).await, after) {
            // A refusal after a fallback says so in its detail (the reason stays the review's).
            (Err(AuthnError::Token(detail, reason)), Some(fallback)) => {
                Err(AuthnError::Token(note(detail, fallback), reason))
            }
            (Err(AuthnError::Unavailable(detail)), Some(fallback)) => {
                Err(AuthnError::Unavailable(note(detail, fallback)))
            }
            (other, _) => other,
        };
        let result = result.and_then(|mut c| {
            let unbound = c.kube.as_ref().is_none_or(|k| k.pod_name.is_empty());
            if self.require_pod_binding && unbound {
                return Err(AuthnError::Local(LocalError::PodBindingRequired));
            }
            if let Some(reason) = after {
                c.method = AuthnMethod::TokenReviewAfterLocal(reason);
            }
            Ok(c)
        });
        self.count(
            "review",
            match &result {
                Ok(_) => "allowed",
                Err(e) if e.is_retryable() => "unavailable",
                Err(_) => "refused",
            },
        );
        result
    }
}

#[tonic::async_trait]
impl TokenAuthenticator for TokenVerifier {
    async fn authenticate(
        &self,
        token: &str,
        cluster_id: Option<&str>,
    ) -> Result<Caller, AuthnError> {
        let local = match (&self.local, self.mode) {
            (Some(l), TokenVerificationMode::Local | TokenVerificationMode::LocalThenReview) => l,
            _ => return self.review(token, cluster_id, None).await,
        };
        match local.verify(token, cluster_id).await {
            Ok(caller) => {
                self.count("local", "allowed");
                Ok(caller)
            }
            Err(e) if e.falls_back() && self.mode == TokenVerificationMode::LocalThenReview => {
                self.local_outcome(e.reason());
                self.count("local", "fell_back");
                tracing::debug!(reason = e.reason(), error = %e, "local token verification undecided: TokenReview");
                self.review(token, cluster_id, Some(e.reason())).await
            }
            Err(e) => {
                self.local_outcome(e.reason());
                self.count(
                    "local",
                    if e.is_retryable() {
                        "unavailable"
                    } else {
                        "refused"
                    },
                );
                Err(AuthnError::Local(e))
            }
        }
    }

    /// The review path's cache decides familiarity for admission (a warm
    /// caller stays known whatever the mode); local verification keeps no
    /// cache, so without one every token costs a verification.
    fn cached_verdict(&self, token: &str) -> Option<bool> {
        self.review.as_ref().and_then(|r| r.cached_verdict(token))
    }
}

/// Wiring for one cluster: the token authenticator of `verification`'s mode
/// over `reviewer` (audiences, trust domain, cluster id and index staleness
/// as `review`'s), and the issuer keys to keep fresh (their `run` loop is
/// the caller's to spawn). The keys are kept in every mode: local
/// verification (which also reads the cluster's pod and ServiceAccount
/// `indexes`) checks tokens against them, and the denylist's `token-key`
/// entries need to know which key signed a token whatever the mode.
pub fn build(
    client: &kube::Client,
    verification: super::args::TokenVerification,
    review: &super::token::TokenReviewSettings,
    sync_wait: std::time::Duration,
    indexes: Option<(Arc<PodIndex>, Arc<AccountIndex>)>,
    reviewer: Arc<dyn TokenAuthenticator>,
    metrics: Arc<super::metrics::TokenPathMetrics>,
) -> (Arc<TokenVerifier>, Arc<IssuerKeys>) {
    let mode = verification.mode;
    let keys = Arc::new(
        IssuerKeys::new(
            Arc::new(super::jwks::KubeKeySource(client.clone())),
            verification.refresh,
        )
        .with_metrics(metrics.clone()),
    );
    let local = match (mode.uses_local(), indexes) {
        (true, Some((index, accounts))) => Some(Arc::new(LocalVerifier {
            cluster_id: review.cluster_id.clone(),
            keys: keys.clone(),
            index,
            accounts,
            audiences: review.audiences.clone(),
            trust_domain: review.trust_domain.clone(),
            require_pod_binding: verification.require_pod_binding,
            sync_wait,
            max_index_staleness: review.max_index_staleness,
        })),
        _ => None,
    };
    let verifier = TokenVerifier {
        mode,
        local,
        review: (mode != TokenVerificationMode::Local).then_some(reviewer),
        require_pod_binding: verification.require_pod_binding,
        metrics: Some(metrics),
    };
    (Arc::new(verifier), keys)
}

#[cfg(test)]
mod tests;
