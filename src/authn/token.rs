//! Token callers: `authorization: Bearer <jwt>` checked with a Kubernetes
//! TokenReview.
//!
//! The API server is protected from meshca's callers: a cheap pre-check drops
//! tokens that cannot be service-account JWTs or have expired (a filter, never
//! an allow), successful reviews are cached, rejections are cached briefly
//! (never a timeout or transport error), concurrent requests with the same
//! uncached token share one review (singleflight), and reviews are paced by a
//! token bucket and capped in flight. A request refused by the budget gets a
//! retryable error with its own reason code.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::Engine;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::sync::{watch, Semaphore};

use super::{AuthnError, AuthnMethod, Caller, KubernetesInfo, TokenAuthenticator};
use crate::identity::{SpiffeId, TrustDomain};
use crate::podindex::PodIndex;
use crate::primitives::{lock, sha256};
use crate::ratelimit::TokenBucket;

const SA_GROUP: &str = "system:serviceaccounts";
const EXTRA_POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const EXTRA_POD_UID: &str = "authentication.kubernetes.io/pod-uid";
const EXTRA_NODE_NAME: &str = "authentication.kubernetes.io/node-name";
/// Upper bound on cached reviews; beyond it new results are simply not cached.
const MAX_CACHE_ENTRIES: usize = 100_000;
/// The API server accepts a token up to a minute past `exp` (go-jose's
/// default leeway); the pre-check allows another minute of clock skew.
pub const PRECHECK_EXPIRY_LEEWAY_SECS: i64 = 120;

/// Reason codes of this module's refusals (audit records and metrics).
pub const REASON_MALFORMED: &str = "token_malformed";
pub const REASON_EXPIRED: &str = "token_expired";
pub use super::metrics::{REASON_BUDGET, REASON_INFLIGHT};

/// base64url as go-jose decodes JWS segments: trailing `=` trimmed (see
/// [`b64_segment`]), trailing bits ignored.
const B64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::URL_SAFE,
    GeneralPurposeConfig::new()
        .with_decode_padding_mode(DecodePaddingMode::Indifferent)
        .with_decode_allow_trailing_bits(true),
);

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
            cluster_id: None,
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

fn b64_segment(segment: &str) -> Option<Vec<u8>> {
    B64.decode(segment.trim_end_matches('=')).ok()
}

fn json_segment(segment: &str) -> Option<serde_json::Map<String, serde_json::Value>> {
    serde_json::from_slice(&b64_segment(segment)?).ok()
}

/// The cheap pre-check before any review: drops tokens that cannot be a
/// ServiceAccount JWT (three base64url parts, a JSON header naming a signing
/// algorithm, JSON claims, a signature) or whose `exp` has passed (beyond the
/// API server's leeway plus clock skew). Nothing is verified here: passing
/// means only "worth a TokenReview", never an allow.
pub fn precheck(token: &str, now_unix: i64) -> Result<(), AuthnError> {
    let malformed = |why: &str| denied(format!("not a JWT: {why}"), REASON_MALFORMED);
    let mut parts = token.split('.');
    let (Some(header), Some(claims), Some(signature), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(malformed("expected three dot-separated parts"));
    };
    let header = json_segment(header).ok_or_else(|| malformed("header is not base64url JSON"))?;
    match header.get("alg").and_then(serde_json::Value::as_str) {
        None | Some("") => return Err(malformed("no signing algorithm")),
        Some(alg) if alg.eq_ignore_ascii_case("none") => return Err(malformed("unsigned")),
        Some(_) => {}
    }
    let claims = json_segment(claims).ok_or_else(|| malformed("claims are not base64url JSON"))?;
    if b64_segment(signature).is_none_or(|s| s.is_empty()) {
        return Err(malformed("signature is not base64url"));
    }
    // Legacy Secret-based tokens carry no `exp`: they pass.
    if let Some(exp) = claims.get("exp") {
        let exp = exp
            .as_f64()
            .ok_or_else(|| malformed("exp is not a number"))?;
        if exp + (PRECHECK_EXPIRY_LEEWAY_SECS as f64) < now_unix as f64 {
            return Err(denied(
                format!("the token expired at unix time {exp}, now is {now_unix}"),
                REASON_EXPIRED,
            ));
        }
    }
    Ok(())
}

/// How a review ended, for the cache policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The API server authenticated the token as a usable caller.
    Authenticated,
    /// The API server answered and the answer is a refusal.
    Rejected,
    /// No answer: transport error, timeout, refused by meshca's own budget.
    NotAnswered,
}

/// What to remember about a review.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheAction {
    Positive(Duration),
    Negative(Duration),
    Nothing,
}

/// Cache policy: successes for `positive_ttl` but never past the token's own
/// `exp`; the API server's refusals for `negative_ttl`; never an error that
/// carries no answer (a timeout must not lock a valid caller out).
pub fn cache_action(
    outcome: Outcome,
    token_exp: Option<i64>,
    now_unix: i64,
    positive_ttl: Duration,
    negative_ttl: Duration,
) -> CacheAction {
    match outcome {
        Outcome::Authenticated => {
            let mut ttl = positive_ttl;
            if let Some(exp) = token_exp {
                let left = exp.saturating_sub(now_unix);
                if left <= 0 {
                    return CacheAction::Nothing;
                }
                ttl = ttl.min(Duration::from_secs(left as u64));
            }
            if ttl.is_zero() {
                CacheAction::Nothing
            } else {
                CacheAction::Positive(ttl)
            }
        }
        Outcome::Rejected if !negative_ttl.is_zero() => CacheAction::Negative(negative_ttl),
        Outcome::Rejected | Outcome::NotAnswered => CacheAction::Nothing,
    }
}

/// Limits that protect the API server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReviewLimits {
    /// Sustained TokenReviews per second.
    pub qps: u32,
    /// TokenReviews allowed at once after a quiet period.
    pub burst: u32,
    /// TokenReviews outstanding at the API server at once.
    pub max_inflight: u32,
    /// Longest a request waits for the budget before it is refused.
    pub max_wait: Duration,
    /// How long a token the API server rejected is refused without a review (0 disables).
    pub negative_ttl: Duration,
    /// Most rejected tokens remembered at once.
    pub negative_max_entries: usize,
}

impl Default for ReviewLimits {
    fn default() -> Self {
        Self {
            qps: 100,
            burst: 100,
            max_inflight: 32,
            max_wait: Duration::from_secs(1),
            negative_ttl: Duration::from_secs(10),
            negative_max_entries: 10_000,
        }
    }
}

#[derive(Debug, Clone)]
struct CacheEntry {
    caller: Caller,
    expires: Instant,
}

#[derive(Debug, Clone)]
struct Rejection {
    error: AuthnError,
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
    pub limits: ReviewLimits,
    /// A cached success is trusted only while the pod index follows the
    /// API server: past this disconnection the token is reviewed again.
    pub max_index_staleness: Duration,
}

/// Where TokenReviews go: the API server in production, a fake in unit tests.
#[tonic::async_trait]
pub trait ReviewBackend: Send + Sync + std::fmt::Debug {
    /// Posts one TokenReview; `Err` means no answer (transport, API error).
    async fn review(&self, token: &str, audiences: &[String]) -> Result<TokenReviewStatus, String>;
}

/// TokenReview through a kube client.
#[derive(Clone)]
pub struct KubeReviewBackend(pub Client);

impl std::fmt::Debug for KubeReviewBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KubeReviewBackend")
    }
}

#[tonic::async_trait]
impl ReviewBackend for KubeReviewBackend {
    async fn review(&self, token: &str, audiences: &[String]) -> Result<TokenReviewStatus, String> {
        let api: Api<TokenReview> = Api::all(self.0.clone());
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_string(),
                audiences: Some(audiences.to_vec()),
            },
            ..Default::default()
        };
        api.create(&PostParams::default(), &review)
            .await
            .map(|r| r.status.unwrap_or_default())
            .map_err(|e| e.to_string())
    }
}

type Flight = watch::Receiver<Option<Result<Caller, AuthnError>>>;

/// State shared with the review tasks (which outlive a cancelled caller, so
/// their answer still lands in the cache and reaches coalesced waiters).
struct Core {
    backend: Arc<dyn ReviewBackend>,
    settings: TokenReviewSettings,
    cache: Mutex<HashMap<[u8; 32], CacheEntry>>,
    rejected: Mutex<HashMap<[u8; 32], Rejection>>,
    inflight: Mutex<HashMap<[u8; 32], Flight>>,
    bucket: Mutex<TokenBucket>,
    slots: Semaphore,
    /// When present, cached callers whose pod left the index are re-reviewed.
    index: Option<Arc<PodIndex>>,
    metrics: OnceLock<Arc<super::metrics::TokenReviewMetrics>>,
}

/// TokenReview against the cluster's API server.
pub struct KubeTokenAuthenticator {
    core: Arc<Core>,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
}

impl std::fmt::Debug for KubeTokenAuthenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeTokenAuthenticator")
            .field("settings", &self.core.settings)
            .finish_non_exhaustive()
    }
}

impl KubeTokenAuthenticator {
    pub fn new(
        client: Client,
        settings: TokenReviewSettings,
        index: Option<Arc<PodIndex>>,
    ) -> Self {
        Self::with_backend(Arc::new(KubeReviewBackend(client)), settings, index)
    }

    /// An authenticator posting its reviews to `backend`.
    pub fn with_backend(
        backend: Arc<dyn ReviewBackend>,
        settings: TokenReviewSettings,
        index: Option<Arc<PodIndex>>,
    ) -> Self {
        let l = settings.limits;
        Self {
            core: Arc::new(Core {
                backend,
                cache: Mutex::new(HashMap::new()),
                rejected: Mutex::new(HashMap::new()),
                inflight: Mutex::new(HashMap::new()),
                bucket: Mutex::new(TokenBucket::new(l.qps, l.burst, Instant::now())),
                slots: Semaphore::new(l.max_inflight.max(1) as usize),
                index,
                metrics: OnceLock::new(),
                settings,
            }),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// Records TokenReview latency, errors and the API-server protection counters.
    pub fn with_metrics(self, metrics: Arc<super::metrics::TokenReviewMetrics>) -> Self {
        let _ = self.core.metrics.set(metrics);
        self
    }
}

impl Core {
    fn metrics(&self) -> Option<&super::metrics::TokenReviewMetrics> {
        self.metrics.get().map(Arc::as_ref)
    }

    fn cached(&self, key: &[u8; 32]) -> Option<Caller> {
        let mut cache = lock(&self.cache);
        let entry = cache.get(key)?;
        let live = entry.expires > Instant::now() && self.pod_still_present(&entry.caller);
        if live {
            Some(entry.caller.clone())
        } else {
            cache.remove(key);
            None
        }
    }

    fn rejection(&self, key: &[u8; 32]) -> Option<AuthnError> {
        let mut rejected = lock(&self.rejected);
        let entry = rejected.get(key)?;
        if entry.expires > Instant::now() {
            Some(entry.error.clone())
        } else {
            rejected.remove(key);
            None
        }
    }

    /// A cached review is dropped once its bound pod is gone from (or
    /// replaced in) a synced index, or deleted by the API server's rule
    /// (what a new review would refuse), and whenever the index has lost
    /// its watch for longer than allowed (it could not show the pod gone).
    fn pod_still_present(&self, caller: &Caller) -> bool {
        let (Some(index), Some(k)) = (&self.index, &caller.kube) else {
            return true;
        };
        if k.pod_name.is_empty() || !index.is_synced() {
            return true;
        }
        if crate::renewal::stale(index.disconnected_for(), self.settings.max_index_staleness)
            .is_some()
        {
            return false;
        }
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        index.read(|s| {
            s.get(&k.pod_namespace, &k.pod_name)
                .is_some_and(|p| *p.uid == *k.pod_uid && !p.deleted_by(now))
        })
    }

    fn remember(
        &self,
        key: [u8; 32],
        token: &str,
        outcome: Outcome,
        result: &Result<Caller, AuthnError>,
    ) {
        let action = cache_action(
            outcome,
            token_expiry_unverified(token),
            time::OffsetDateTime::now_utc().unix_timestamp(),
            self.settings.cache_ttl,
            self.settings.limits.negative_ttl,
        );
        let now = Instant::now();
        match (action, result) {
            (CacheAction::Positive(ttl), Ok(caller)) => {
                let mut cache = lock(&self.cache);
                if bounded(&mut cache, MAX_CACHE_ENTRIES, |e| e.expires > now) {
                    cache.insert(
                        key,
                        CacheEntry {
                            caller: caller.clone(),
                            expires: now + ttl,
                        },
                    );
                }
            }
            (CacheAction::Negative(ttl), Err(error)) => {
                let mut rejected = lock(&self.rejected);
                let max = self.settings.limits.negative_max_entries;
                if bounded(&mut rejected, max, |e| e.expires > now) {
                    rejected.insert(
                        key,
                        Rejection {
                            error: error.clone(),
                            expires: now + ttl,
                        },
                    );
                }
            }
            _ => {}
        }
    }

    /// Refusal by the budget: retryable, with its own reason.
    fn refuse(&self, reason: &'static str, retry_after: Duration) -> AuthnError {
        if let Some(m) = self.metrics() {
            m.tokenreview_refused
                .get_or_create(&crate::metrics::ReasonLabels {
                    reason: reason.to_string(),
                })
                .inc();
        }
        AuthnError::Overloaded {
            reason,
            detail: format!("TokenReview budget exhausted ({reason}), retry in {retry_after:?}"),
            retry_after,
        }
    }

    /// One review under the rate budget and the in-flight cap.
    async fn review(&self, token: &str) -> (Outcome, Result<Caller, AuthnError>) {
        let limits = self.settings.limits;
        let reserved = lock(&self.bucket).reserve(Instant::now(), limits.max_wait);
        let waited = match reserved {
            Ok(wait) => wait,
            Err(retry) => return (Outcome::NotAnswered, Err(self.refuse(REASON_BUDGET, retry))),
        };
        if !waited.is_zero() {
            tokio::time::sleep(waited).await;
        }
        let remaining = limits.max_wait.saturating_sub(waited);
        let _slot = match tokio::time::timeout(remaining, self.slots.acquire()).await {
            Ok(Ok(permit)) => permit,
            // The semaphore is never closed; both mean "no slot in time".
            Ok(Err(_)) | Err(_) => {
                lock(&self.bucket).refund();
                return (
                    Outcome::NotAnswered,
                    Err(self.refuse(REASON_INFLIGHT, limits.max_wait)),
                );
            }
        };
        let started = Instant::now();
        if let Some(m) = self.metrics() {
            m.tokenreview_inflight.inc();
        }
        let result = tokio::time::timeout(
            self.settings.timeout,
            self.backend.review(token, &self.settings.audiences),
        )
        .await;
        let (outcome, result) = match result {
            Err(_) => (
                Outcome::NotAnswered,
                Err(AuthnError::Unavailable(format!(
                    "TokenReview timed out after {:?}",
                    self.settings.timeout
                ))),
            ),
            // Any API failure (network, 5xx, RBAC) is retryable for the client and never an allow.
            Ok(Err(e)) => (
                Outcome::NotAnswered,
                Err(AuthnError::Unavailable(format!("TokenReview failed: {e}"))),
            ),
            Ok(Ok(status)) => match interpret_review(
                &status,
                &self.settings.audiences,
                &self.settings.trust_domain,
            ) {
                Ok(caller) => (Outcome::Authenticated, Ok(caller)),
                Err(e) => (Outcome::Rejected, Err(e)),
            },
        };
        if let Some(m) = self.metrics() {
            m.tokenreview_inflight.dec();
            m.tokenreview_duration
                .observe(started.elapsed().as_secs_f64());
            let label = match outcome {
                Outcome::Authenticated => "authenticated",
                Outcome::Rejected => "rejected",
                Outcome::NotAnswered => {
                    m.tokenreview_errors.inc();
                    "error"
                }
            };
            m.tokenreviews
                .get_or_create(&crate::metrics::ResultLabels {
                    result: label.to_string(),
                })
                .inc();
        }
        (outcome, result)
    }

    /// The review task of one flight: review, remember, then release the
    /// flight (after the cache is filled, so no later caller starts another).
    async fn fly(
        self: Arc<Self>,
        key: [u8; 32],
        token: String,
        tx: watch::Sender<Option<Result<Caller, AuthnError>>>,
    ) {
        let (outcome, result) = self.review(&token).await;
        self.remember(key, &token, outcome, &result);
        lock(&self.inflight).remove(&key);
        tx.send_replace(Some(result));
    }
}

/// Makes room for one more entry in `map`, dropping dead entries when full;
/// `false` when it stays full (the new entry is then not cached).
fn bounded<V>(map: &mut HashMap<[u8; 32], V>, max: usize, live: impl Fn(&V) -> bool) -> bool {
    if map.len() >= max {
        map.retain(|_, v| live(v));
    }
    map.len() < max
}

#[tonic::async_trait]
impl TokenAuthenticator for KubeTokenAuthenticator {
    fn cached_verdict(&self, token: &str) -> Option<bool> {
        let key = sha256(token.as_bytes());
        if self.core.cached(&key).is_some() {
            return Some(true);
        }
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        if self.core.rejection(&key).is_some() || precheck(token, now).is_err() {
            return Some(false);
        }
        None
    }

    async fn authenticate(
        &self,
        token: &str,
        cluster_id: Option<&str>,
    ) -> Result<Caller, AuthnError> {
        let core = &self.core;
        match cluster_id {
            None | Some("") => {}
            Some(c) if c == core.settings.cluster_id => {}
            Some(c) => {
                return Err(denied(
                    format!("client claims to be in cluster {c:?}, but we only know about local cluster {:?}", core.settings.cluster_id),
                    "token_unknown_cluster",
                ))
            }
        }
        let key = sha256(token.as_bytes());
        if let Some(caller) = core.cached(&key) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(caller);
        }
        // Only tokens not already cached are pre-checked: a cached success
        // passed the pre-check when it was reviewed and never outlives `exp`,
        // so warm callers skip the base64 and JSON parsing.
        if let Err(e) = precheck(token, time::OffsetDateTime::now_utc().unix_timestamp()) {
            if let Some(m) = core.metrics() {
                m.tokenreview_precheck_rejected
                    .get_or_create(&crate::metrics::ReasonLabels {
                        reason: e.reason().to_string(),
                    })
                    .inc();
            }
            return Err(e);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let negative_hit = |e: AuthnError| {
            if let Some(m) = core.metrics() {
                m.tokenreview_negative_cache_hits.inc();
            }
            e
        };
        if let Some(e) = core.rejection(&key) {
            return Err(negative_hit(e));
        }
        let mut flight = {
            let mut inflight = lock(&core.inflight);
            match inflight.get(&key) {
                Some(rx) => {
                    if let Some(m) = core.metrics() {
                        m.tokenreview_coalesced.inc();
                    }
                    rx.clone()
                }
                None => {
                    // A flight may have landed between the lookups above and this lock.
                    if let Some(caller) = core.cached(&key) {
                        return Ok(caller);
                    }
                    if let Some(e) = core.rejection(&key) {
                        return Err(negative_hit(e));
                    }
                    let (tx, rx) = watch::channel(None);
                    inflight.insert(key, rx.clone());
                    tokio::spawn(core.clone().fly(key, token.to_string(), tx));
                    rx
                }
            }
        };
        let answer = flight.wait_for(Option::is_some).await;
        match answer.as_deref() {
            Ok(Some(result)) => result.clone(),
            _ => Err(AuthnError::Unavailable(
                "the TokenReview task ended without an answer".into(),
            )),
        }
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

    fn b64(v: &serde_json::Value) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(serde_json::to_vec(v).unwrap())
    }

    /// A JWT-shaped token (never verified by anything in these tests).
    fn jwt(sub: &str, exp: Option<i64>) -> String {
        let mut claims = serde_json::json!({"sub": sub, "aud": ["istio-ca"]});
        if let Some(exp) = exp {
            claims["exp"] = exp.into();
        }
        format!(
            "{}.{}.c2lnbmF0dXJl",
            b64(&serde_json::json!({"alg": "RS256", "kid": "k"})),
            b64(&claims)
        )
    }

    const NOW_UNIX: i64 = 1_800_000_000;

    #[test_case("", Some(REASON_MALFORMED) ; "empty")]
    #[test_case("garbage", Some(REASON_MALFORMED) ; "one part")]
    #[test_case("not.a.jwt", Some(REASON_MALFORMED) ; "three parts not base64 json")]
    #[test_case("a.b.c.d.e", Some(REASON_MALFORMED) ; "five parts jwe")]
    #[test_case("abcdef.0123456789abcdef", Some(REASON_MALFORMED) ; "bootstrap token")]
    #[test_case(&format!("{}.{}.sig", b64(&serde_json::json!({"alg": "none"})), b64(&serde_json::json!({}))), Some(REASON_MALFORMED) ; "unsigned")]
    #[test_case(&format!("{}.{}.sig", b64(&serde_json::json!({"typ": "JWT"})), b64(&serde_json::json!({}))), Some(REASON_MALFORMED) ; "no alg")]
    #[test_case(&format!("{}.{}.", b64(&serde_json::json!({"alg": "RS256"})), b64(&serde_json::json!({}))), Some(REASON_MALFORMED) ; "empty signature")]
    #[test_case(&format!("{}.{}.s!g", b64(&serde_json::json!({"alg": "RS256"})), b64(&serde_json::json!({}))), Some(REASON_MALFORMED) ; "signature not base64url")]
    #[test_case(&format!("{}.{}.sig", b64(&serde_json::json!({"alg": "RS256"})), b64(&serde_json::json!([1]))), Some(REASON_MALFORMED) ; "claims not an object")]
    #[test_case(&format!("{}.{}.sig", b64(&serde_json::json!({"alg": "RS256"})), b64(&serde_json::json!({"exp": "soon"}))), Some(REASON_MALFORMED) ; "exp not a number")]
    #[test_case(&jwt("x", Some(NOW_UNIX - 3600)), Some(REASON_EXPIRED) ; "expired an hour ago")]
    #[test_case(&jwt("x", Some(NOW_UNIX - PRECHECK_EXPIRY_LEEWAY_SECS - 1)), Some(REASON_EXPIRED) ; "just past the leeway")]
    #[test_case(&jwt("x", Some(NOW_UNIX - PRECHECK_EXPIRY_LEEWAY_SECS)), None ; "within the leeway is reviewed")]
    #[test_case(&jwt("x", Some(NOW_UNIX + 3600)), None ; "live")]
    #[test_case(&jwt("x", None), None ; "legacy token without exp")]
    #[test_case(&format!("{}=.{}.c2lnbmF0dXJl", b64(&serde_json::json!({"alg": "RS256"})), b64(&serde_json::json!({"exp": NOW_UNIX as f64 + 0.5}))), None ; "padding and float exp")]
    fn precheck_is_only_a_filter(token: &str, want: Option<&str>) {
        assert_eq!(precheck(token, NOW_UNIX).err().map(|e| e.reason()), want);
    }

    const MIN: Duration = Duration::from_secs(60);
    const TEN: Duration = Duration::from_secs(10);

    #[test_case(Outcome::Authenticated, None, CacheAction::Positive(MIN) ; "success without exp")]
    #[test_case(Outcome::Authenticated, Some(NOW_UNIX + 30), CacheAction::Positive(Duration::from_secs(30)) ; "success never past exp")]
    #[test_case(Outcome::Authenticated, Some(NOW_UNIX), CacheAction::Nothing ; "success at exp")]
    #[test_case(Outcome::Authenticated, Some(i64::MIN), CacheAction::Nothing ; "exp at i64 min does not overflow")]
    #[test_case(Outcome::Authenticated, Some(i64::MAX), CacheAction::Positive(MIN) ; "exp at i64 max keeps the configured ttl")]
    #[test_case(Outcome::Rejected, None, CacheAction::Negative(TEN) ; "rejection")]
    #[test_case(Outcome::Rejected, Some(NOW_UNIX + 3600), CacheAction::Negative(TEN) ; "rejection of live token")]
    #[test_case(Outcome::NotAnswered, None, CacheAction::Nothing ; "timeout or transport error")]
    fn cache_policy(outcome: Outcome, exp: Option<i64>, want: CacheAction) {
        assert_eq!(cache_action(outcome, exp, NOW_UNIX, MIN, TEN), want);
    }

    #[test_case(Outcome::Authenticated ; "positive off")]
    #[test_case(Outcome::Rejected ; "negative off")]
    fn zero_ttls_disable_caching(outcome: Outcome) {
        let got = cache_action(outcome, None, NOW_UNIX, Duration::ZERO, Duration::ZERO);
        assert_eq!(got, CacheAction::Nothing);
    }

    /// A fake API server: `good*` subjects authenticate, `transport*` get no
    /// answer, `slow*` answer after a long time, anything else is rejected.
    #[derive(Debug, Default)]
    struct Fake {
        calls: AtomicU64,
        delay: Duration,
    }

    #[tonic::async_trait]
    impl ReviewBackend for Fake {
        async fn review(&self, token: &str, _: &[String]) -> Result<TokenReviewStatus, String> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let payload = token.split('.').nth(1).unwrap();
            let claims: serde_json::Value =
                serde_json::from_slice(&B64.decode(payload).unwrap()).unwrap();
            let sub = claims["sub"].as_str().unwrap().to_string();
            tokio::time::sleep(self.delay).await;
            if sub.starts_with("slow") {
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            if sub.starts_with("transport") {
                return Err("connection refused".into());
            }
            if sub.starts_with("good") {
                return Ok(status(true, None, USER, GROUPS, &[]));
            }
            Ok(status(
                false,
                Some("invalid bearer token"),
                USER,
                GROUPS,
                &[],
            ))
        }
    }

    fn authenticator(
        fake: Arc<Fake>,
        limits: ReviewLimits,
    ) -> (
        KubeTokenAuthenticator,
        Arc<crate::authn::metrics::TokenReviewMetrics>,
    ) {
        let metrics = Arc::new(crate::authn::metrics::TokenReviewMetrics::register(
            &mut prometheus_client::registry::Registry::default(),
        ));
        let settings = TokenReviewSettings {
            audiences: vec!["istio-ca".into()],
            trust_domain: TrustDomain::new("cluster.local").unwrap(),
            cluster_id: "Kubernetes".into(),
            cache_ttl: Duration::from_secs(60),
            timeout: Duration::from_millis(300),
            limits,
            max_index_staleness: Duration::from_secs(60),
        };
        let a = KubeTokenAuthenticator::with_backend(fake, settings, None)
            .with_metrics(metrics.clone());
        (a, metrics)
    }

    fn live(sub: &str) -> String {
        jwt(
            sub,
            Some(time::OffsetDateTime::now_utc().unix_timestamp() + 3600),
        )
    }

    fn calls(f: &Fake) -> u64 {
        f.calls.load(Ordering::SeqCst)
    }

    async fn all<'a>(
        a: &'a KubeTokenAuthenticator,
        tokens: impl IntoIterator<Item = &'a String>,
    ) -> Vec<Result<Caller, AuthnError>> {
        futures::future::join_all(tokens.into_iter().map(|t| a.authenticate(t, None))).await
    }

    #[tokio::test]
    async fn concurrent_requests_with_one_uncached_token_share_one_review() {
        let fake = Arc::new(Fake {
            delay: Duration::from_millis(100),
            ..Default::default()
        });
        let (a, m) = authenticator(fake.clone(), ReviewLimits::default());
        let token = live("good-1");
        let results = all(&a, &vec![token.clone(); 50]).await;
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        assert_eq!(calls(&fake), 1);
        assert_eq!(m.tokenreview_coalesced.get(), 49);
        a.authenticate(&token, None).await.unwrap();
        assert_eq!((calls(&fake), a.hits.load(Ordering::Relaxed)), (1, 1));
    }

    #[tokio::test]
    async fn a_rejected_token_is_refused_without_a_review_until_the_negative_ttl() {
        let fake = Arc::new(Fake::default());
        let limits = ReviewLimits {
            negative_ttl: Duration::from_millis(300),
            ..Default::default()
        };
        let (a, m) = authenticator(fake.clone(), limits);
        let garbage = live("garbage");
        for _ in 0..5 {
            let e = a.authenticate(&garbage, None).await.unwrap_err();
            assert_eq!(e.reason(), "token_not_authenticated");
            assert!(!e.is_retryable());
        }
        assert_eq!(calls(&fake), 1, "rejected once, then cached");
        assert_eq!(m.tokenreview_negative_cache_hits.get(), 4);
        tokio::time::sleep(Duration::from_millis(350)).await;
        a.authenticate(&garbage, None).await.unwrap_err();
        assert_eq!(calls(&fake), 2, "the negative entry expires");
    }

    #[tokio::test]
    async fn timeouts_and_transport_errors_are_never_cached_negatively() {
        let fake = Arc::new(Fake::default());
        let (a, m) = authenticator(fake.clone(), ReviewLimits::default());
        for sub in ["transport-1", "slow-1"] {
            let token = live(sub);
            for _ in 0..2 {
                let e = a.authenticate(&token, None).await.unwrap_err();
                assert_eq!(e.reason(), "authn_tokenreview_unavailable");
                assert!(e.is_retryable());
            }
        }
        assert_eq!(calls(&fake), 4, "every attempt reaches the API server");
        assert_eq!(m.tokenreview_negative_cache_hits.get(), 0);
        assert_eq!(m.tokenreview_errors.get(), 4);
    }

    #[tokio::test]
    async fn the_precheck_drops_garbage_before_any_review() {
        let fake = Arc::new(Fake::default());
        let (a, m) = authenticator(fake.clone(), ReviewLimits::default());
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        let expired = jwt("good-expired", Some(now - 3600));
        for (token, reason) in [
            ("not-a-jwt", REASON_MALFORMED),
            ("a.b.c", REASON_MALFORMED),
            (expired.as_str(), REASON_EXPIRED),
        ] {
            let e = a.authenticate(token, None).await.unwrap_err();
            assert_eq!(e.reason(), reason);
        }
        assert_eq!(calls(&fake), 0);
        let count = |reason: &str| {
            m.tokenreview_precheck_rejected
                .get_or_create(&crate::metrics::ReasonLabels {
                    reason: reason.into(),
                })
                .get()
        };
        assert_eq!((count(REASON_MALFORMED), count(REASON_EXPIRED)), (2, 1));
    }

    #[tokio::test]
    async fn the_rate_budget_refuses_beyond_the_burst_with_a_retryable_reason() {
        let fake = Arc::new(Fake::default());
        let limits = ReviewLimits {
            qps: 1,
            burst: 5,
            max_wait: Duration::ZERO,
            ..Default::default()
        };
        let (a, m) = authenticator(fake.clone(), limits);
        let tokens: Vec<String> = (0..20).map(|i| live(&format!("good-{i}"))).collect();
        let results = all(&a, &tokens).await;
        assert_eq!(calls(&fake), 5);
        let refused: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        assert_eq!(refused.len(), 15);
        for e in refused {
            assert_eq!(e.reason(), REASON_BUDGET);
            assert!(e.is_retryable());
            assert!(
                matches!(e, AuthnError::Overloaded { retry_after, .. } if *retry_after > Duration::ZERO)
            );
        }
        let refused = m
            .tokenreview_refused
            .get_or_create(&crate::metrics::ReasonLabels {
                reason: REASON_BUDGET.into(),
            })
            .get();
        assert_eq!(refused, 15);
    }

    #[tokio::test]
    async fn within_max_wait_requests_are_paced_not_refused() {
        let fake = Arc::new(Fake::default());
        let limits = ReviewLimits {
            qps: 20,
            burst: 1,
            max_wait: Duration::from_secs(2),
            ..Default::default()
        };
        let (a, _) = authenticator(fake.clone(), limits);
        let tokens: Vec<String> = (0..10).map(|i| live(&format!("good-{i}"))).collect();
        let started = Instant::now();
        let results = all(&a, &tokens).await;
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        // 1 at once, then 9 more at 20/s.
        assert!(
            started.elapsed() >= Duration::from_millis(440),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(calls(&fake), 10);
    }

    #[tokio::test]
    async fn the_inflight_cap_refuses_when_the_api_server_is_slow() {
        let fake = Arc::new(Fake {
            delay: Duration::from_millis(250),
            ..Default::default()
        });
        let limits = ReviewLimits {
            max_inflight: 2,
            max_wait: Duration::from_millis(50),
            // Next to no refill during the test: the refunds are what is left.
            qps: 1,
            burst: 20,
            ..Default::default()
        };
        let (a, m) = authenticator(fake.clone(), limits);
        let tokens: Vec<String> = (0..5).map(|i| live(&format!("good-{i}"))).collect();
        let results = all(&a, &tokens).await;
        assert_eq!(calls(&fake), 2);
        let reasons: Vec<_> = results
            .iter()
            .filter_map(|r| r.as_ref().err().map(AuthnError::reason))
            .collect();
        assert_eq!(reasons, vec![REASON_INFLIGHT; 3]);
        assert_eq!(m.tokenreview_inflight.get(), 0, "gauge returns to zero");
        // The refused requests gave their rate slots back.
        let mut bucket = lock(&a.core.bucket).clone();
        for _ in 0..(limits.burst - 2) {
            assert_eq!(
                bucket.reserve(Instant::now(), Duration::ZERO),
                Ok(Duration::ZERO)
            );
        }
    }

    #[tokio::test]
    async fn a_cancelled_caller_still_fills_the_cache() {
        let fake = Arc::new(Fake {
            delay: Duration::from_millis(100),
            ..Default::default()
        });
        let (a, _) = authenticator(fake.clone(), ReviewLimits::default());
        let token = live("good-cancel");
        let gave_up =
            tokio::time::timeout(Duration::from_millis(10), a.authenticate(&token, None)).await;
        assert!(gave_up.is_err());
        tokio::time::sleep(Duration::from_millis(200)).await;
        a.authenticate(&token, None).await.unwrap();
        assert_eq!(calls(&fake), 1);
        assert_eq!(a.hits.load(Ordering::Relaxed), 1);
    }
}
