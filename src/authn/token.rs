//! Token callers: `authorization: Bearer <jwt>` checked with a Kubernetes
//! TokenReview, with a bounded cache of successful reviews.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use kube::api::PostParams;
use kube::{Api, Client};

use super::{AuthnError, AuthnMethod, Caller, KubernetesInfo, TokenAuthenticator};
use crate::ca::csr::sha256;
use crate::identity::{SpiffeId, TrustDomain};
use crate::podindex::PodIndex;

const SA_GROUP: &str = "system:serviceaccounts";
const EXTRA_POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const EXTRA_POD_UID: &str = "authentication.kubernetes.io/pod-uid";
const EXTRA_NODE_NAME: &str = "authentication.kubernetes.io/node-name";
/// Upper bound on cached reviews; beyond it new results are simply not cached.
const MAX_CACHE_ENTRIES: usize = 100_000;

fn denied(detail: impl Into<String>, reason: &'static str) -> AuthnError {
    AuthnError::Token(detail.into(), reason)
}

/// Turns a TokenReview status into a caller (istiod's getTokenReviewResult,
/// plus an audience check and a strict username shape).
pub fn interpret_review(
    status: &TokenReviewStatus,
    audiences: &[String],
    trust_domain: &TrustDomain,
) -> Result<Caller, AuthnError> {
    let error = status.error.clone().unwrap_or_default();
    if status.authenticated != Some(true) {
        let detail = if error.is_empty() {
            "the token is not authenticated".to_string()
        } else {
            error
        };
        return Err(denied(detail, "token_not_authenticated"));
    }
    if !error.is_empty() {
        return Err(denied(
            format!("the service account authentication returns an error: {error}"),
            "token_review_error",
        ));
    }
    if let Some(got) = &status.audiences {
        if !got.iter().any(|a| audiences.contains(a)) {
            return Err(denied(
                format!("token audiences {got:?} do not include {audiences:?}"),
                "token_audience_mismatch",
            ));
        }
    }
    let user = status
        .user
        .as_ref()
        .ok_or_else(|| denied("no user in the review", "token_not_service_account"))?;
    if !user
        .groups
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|g| g == SA_GROUP)
    {
        return Err(denied(
            "the token is not a service account",
            "token_not_service_account",
        ));
    }
    let username = user.username.clone().unwrap_or_default();
    let (ns, sa) = match username.split(':').collect::<Vec<_>>().as_slice() {
        ["system", "serviceaccount", ns, sa] => (ns.to_string(), sa.to_string()),
        _ => {
            return Err(denied(
                format!("invalid username field {username:?} in the token review result"),
                "token_invalid_username",
            ))
        }
    };
    let identity = SpiffeId::new(trust_domain.clone(), &ns, &sa).map_err(|e| {
        denied(
            format!("service account {ns}/{sa}: {e}"),
            "token_invalid_username",
        )
    })?;
    let extra = |key: &str| -> Option<String> { user.extra.as_ref()?.get(key)?.first().cloned() };
    Ok(Caller {
        method: AuthnMethod::TokenReview,
        identity,
        kube: Some(KubernetesInfo {
            pod_namespace: ns,
            pod_name: extra(EXTRA_POD_NAME).unwrap_or_default(),
            pod_uid: extra(EXTRA_POD_UID).unwrap_or_default(),
            service_account: sa,
            node_name: extra(EXTRA_NODE_NAME),
        }),
    })
}

/// The `exp` claim of a JWT, read without verification: used only to make a
/// cache entry expire no later than the token itself.
pub fn token_expiry_unverified(token: &str) -> Option<i64> {
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    claims.get("exp")?.as_i64()
}

/// How long a successful review of `token` may be reused at `now` (unix
/// seconds): the configured TTL, cut to the token's own `exp`; `None` when
/// the token has already expired.
pub fn cache_ttl(token: &str, configured: Duration, now: i64) -> Option<Duration> {
    let Some(exp) = token_expiry_unverified(token) else {
        return Some(configured);
    };
    // `exp` is attacker-chosen JSON: any i64, so no plain subtraction.
    let left = exp.saturating_sub(now);
    if left <= 0 {
        return None;
    }
    Some(configured.min(Duration::from_secs(left as u64)))
}

#[derive(Debug, Clone)]
struct CacheEntry {
    caller: Caller,
    expires: Instant,
}

/// Settings of the TokenReview authenticator.
#[derive(Debug, Clone)]
pub struct TokenReviewSettings {
    pub audiences: Vec<String>,
    pub trust_domain: TrustDomain,
    /// `CLUSTER_ID`; a `clusterid` header naming another cluster is refused.
    pub cluster_id: String,
    /// Longest a successful review is reused (0 disables the cache).
    pub cache_ttl: Duration,
    pub timeout: Duration,
}

/// TokenReview against the cluster's API server.
pub struct KubeTokenAuthenticator {
    client: Client,
    settings: TokenReviewSettings,
    cache: Mutex<HashMap<[u8; 32], CacheEntry>>,
    /// When present, cached callers whose pod left the index are re-reviewed.
    index: Option<Arc<PodIndex>>,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl std::fmt::Debug for KubeTokenAuthenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeTokenAuthenticator")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl KubeTokenAuthenticator {
    pub fn new(
        client: Client,
        settings: TokenReviewSettings,
        index: Option<Arc<PodIndex>>,
    ) -> Self {
        Self {
            client,
            settings,
            cache: Mutex::new(HashMap::new()),
            index,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            metrics: None,
        }
    }

    /// Records TokenReview latency and errors.
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn cached(&self, key: &[u8; 32]) -> Option<Caller> {
        let mut cache = self.cache.lock().ok()?;
        let entry = cache.get(key)?;
        let live = entry.expires > Instant::now() && self.pod_still_present(&entry.caller);
        if live {
            Some(entry.caller.clone())
        } else {
            cache.remove(key);
            None
        }
    }

    /// A cached review is dropped once its bound pod is gone from (or
    /// replaced in) a synced index.
    fn pod_still_present(&self, caller: &Caller) -> bool {
        let (Some(index), Some(k)) = (&self.index, &caller.kube) else {
            return true;
        };
        if k.pod_name.is_empty() || !index.is_synced() {
            return true;
        }
        index.read(|s| {
            s.get(&k.pod_namespace, &k.pod_name)
                .is_some_and(|p| *p.uid == *k.pod_uid)
        })
    }

    fn store(&self, key: [u8; 32], token: &str, caller: &Caller) {
        if self.settings.cache_ttl.is_zero() {
            return;
        }
        let Some(ttl) = cache_ttl(
            token,
            self.settings.cache_ttl,
            time::OffsetDateTime::now_utc().unix_timestamp(),
        ) else {
            return;
        };
        let Ok(mut cache) = self.cache.lock() else {
            return;
        };
        if cache.len() >= MAX_CACHE_ENTRIES {
            let now = Instant::now();
            cache.retain(|_, e| e.expires > now);
            if cache.len() >= MAX_CACHE_ENTRIES {
                return;
            }
        }
        cache.insert(
            key,
            CacheEntry {
                caller: caller.clone(),
                expires: Instant::now() + ttl,
            },
        );
    }

    async fn review(&self, token: &str) -> Result<Caller, AuthnError> {
        let api: Api<TokenReview> = Api::all(self.client.clone());
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: Some(self.settings.audiences.clone()),
            },
            ..Default::default()
        };
        let started = Instant::now();
        let result = tokio::time::timeout(
            self.settings.timeout,
            api.create(&PostParams::default(), &review),
        )
        .await;
        if let Some(m) = &self.metrics {
            m.tokenreview_duration
                .observe(started.elapsed().as_secs_f64());
            if !matches!(result, Ok(Ok(_))) {
                m.tokenreview_errors.inc();
            }
        }
        let review = match result {
            Err(_) => {
                return Err(AuthnError::Unavailable(format!(
                    "TokenReview timed out after {:?}",
                    self.settings.timeout
                )))
            }
            // Any API failure (network, 5xx, RBAC) is retryable for the client and never an allow.
            Ok(Err(e)) => return Err(AuthnError::Unavailable(format!("TokenReview failed: {e}"))),
            Ok(Ok(r)) => r,
        };
        let status = review.status.unwrap_or_default();
        interpret_review(
            &status,
            &self.settings.audiences,
            &self.settings.trust_domain,
        )
    }
}

#[tonic::async_trait]
impl TokenAuthenticator for KubeTokenAuthenticator {
    async fn authenticate(
        &self,
        token: &str,
        cluster_id: Option<&str>,
    ) -> Result<Caller, AuthnError> {
        match cluster_id {
            None | Some("") => {}
            Some(c) if c == self.settings.cluster_id => {}
            Some(c) => {
                return Err(denied(
                    format!("client claims to be in cluster {c:?}, but we only know about local cluster {:?}", self.settings.cluster_id),
                    "token_unknown_cluster",
                ))
            }
        }
        let key = sha256(token.as_bytes());
        if let Some(caller) = self.cached(&key) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(caller);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let caller = self.review(token).await?;
        self.store(key, token, &caller);
        Ok(caller)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::authentication::v1::UserInfo;
    use std::collections::BTreeMap;
    use test_case::test_case;

    fn status(
        authenticated: bool,
        error: Option<&str>,
        username: &str,
        groups: &[&str],
        extra: &[(&str, &str)],
    ) -> TokenReviewStatus {
        TokenReviewStatus {
            authenticated: Some(authenticated),
            error: error.map(str::to_string),
            audiences: Some(vec!["istio-ca".into()]),
            user: Some(UserInfo {
                username: Some(username.into()),
                groups: Some(groups.iter().map(|g| g.to_string()).collect()),
                extra: Some(
                    extra
                        .iter()
                        .map(|(k, v)| (k.to_string(), vec![v.to_string()]))
                        .collect::<BTreeMap<_, _>>(),
                ),
                uid: None,
            }),
        }
    }

    const USER: &str = "system:serviceaccount:default:example-pod-sa";
    const GROUPS: &[&str] = &[
        "system:serviceaccounts",
        "system:serviceaccounts:default",
        "system:authenticated",
    ];

    // istiod's k8sauthn_test.go cases, plus meshca's.
    #[test_case(status(true, Some("authentication error"), USER, GROUPS, &[]), "token_review_error" ; "review error")]
    #[test_case(status(false, None, USER, GROUPS, &[]), "token_not_authenticated" ; "not authenticated")]
    #[test_case(status(false, Some("service account token has been invalidated"), USER, GROUPS, &[]), "token_not_authenticated" ; "invalidated")]
    #[test_case(status(true, None, USER, &["system:serviceaccounts:default"], &[]), "token_not_service_account" ; "not a service account")]
    #[test_case(status(true, None, "system:serviceaccount:example-pod-sa", GROUPS, &[]), "token_invalid_username" ; "three part username")]
    #[test_case(status(true, None, "user:serviceaccount:default:sa", GROUPS, &[]), "token_invalid_username" ; "wrong prefix")]
    #[test_case(status(true, None, "system:serviceaccount:default:bad,sa", GROUPS, &[]), "token_invalid_username" ; "comma in sa")]
    fn rejects(s: TokenReviewStatus, reason: &str) {
        let e = interpret_review(
            &s,
            &["istio-ca".into()],
            &TrustDomain::new("example.com").unwrap(),
        )
        .unwrap_err();
        assert_eq!(e.reason(), reason, "{e}");
    }

    #[test]
    fn audience_must_match() {
        let s = status(true, None, USER, GROUPS, &[]);
        let e = interpret_review(
            &s,
            &["other".into()],
            &TrustDomain::new("example.com").unwrap(),
        )
        .unwrap_err();
        assert_eq!(e.reason(), "token_audience_mismatch");
    }

    #[test]
    fn pod_token_carries_pod_and_node() {
        let s = status(
            true,
            None,
            USER,
            GROUPS,
            &[
                (EXTRA_POD_NAME, "some-pod"),
                (EXTRA_POD_UID, "12345"),
                (EXTRA_NODE_NAME, "node-1"),
            ],
        );
        let c = interpret_review(
            &s,
            &["istio-ca".into()],
            &TrustDomain::new("example.com").unwrap(),
        )
        .unwrap();
        assert_eq!(
            c.identity.to_string(),
            "spiffe://example.com/ns/default/sa/example-pod-sa"
        );
        let k = c.kube.unwrap();
        assert_eq!(
            (
                k.pod_name.as_str(),
                k.pod_uid.as_str(),
                k.node_name.as_deref()
            ),
            ("some-pod", "12345", Some("node-1"))
        );
    }

    #[test]
    fn plain_token_has_empty_pod_fields() {
        let c = interpret_review(
            &status(true, None, USER, GROUPS, &[]),
            &["istio-ca".into()],
            &TrustDomain::new("example.com").unwrap(),
        )
        .unwrap();
        let k = c.kube.unwrap();
        assert!(k.pod_name.is_empty() && k.pod_uid.is_empty() && k.node_name.is_none());
    }

    #[test]
    fn reads_exp_without_verifying() {
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(br#"{"exp":1700000000,"sub":"x"}"#);
        assert_eq!(
            token_expiry_unverified(&format!("e30.{payload}.sig")),
            Some(1_700_000_000)
        );
        assert_eq!(token_expiry_unverified("not-a-jwt"), None);
    }

    fn jwt_with_exp(exp: i64) -> String {
        let payload =
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!(r#"{{"exp":{exp}}}"#));
        format!("e30.{payload}.sig")
    }

    // Found by the property test token_expiry_any_exp: `exp - now`
    // overflowed (a panic in debug builds) for an `exp` near i64::MIN.
    #[test_case(i64::MIN, None ; "far past")]
    #[test_case(1_699_999_999, None ; "expired")]
    #[test_case(1_700_000_004, Some(4) ; "expires before the cache ttl")]
    #[test_case(i64::MAX, Some(10) ; "far future")]
    fn cache_ttl_follows_exp_without_overflow(exp: i64, want: Option<u64>) {
        let got = cache_ttl(&jwt_with_exp(exp), Duration::from_secs(10), 1_700_000_000);
        assert_eq!(got, want.map(Duration::from_secs));
    }
}
