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
use crate::podindex::accounts::AccountIndex;
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
    /// The reviewed ServiceAccount's UID (the review's `user.uid`).
    account_uid: Option<String>,
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
    /// A cached success is trusted only while the pod and ServiceAccount
    /// indexes follow the API server: past this disconnection the token is
    /// reviewed again.
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

/// One review's answer: the outcome, the caller or refusal, and the
/// reviewed ServiceAccount's UID.
struct Reviewed {
    outcome: Outcome,
    result: Result<Caller, AuthnError>,
    account_uid: Option<String>,
}

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
    /// When present, cached callers whose ServiceAccount left the index (or
    /// was recreated, or deleted past the leeway) are re-reviewed.
    accounts: OnceLock<Arc<AccountIndex>>,
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
                accounts: OnceLock::new(),
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

    /// Checks cached successes against the ServiceAccount index too.
    pub fn with_accounts(self, accounts: Arc<AccountIndex>) -> Self {
        let _ = self.core.accounts.set(accounts);
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
        let live = entry.expires > Instant::now()
            && self.pod_still_present(&entry.caller)
            && self.account_still_present(entry);
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

    /// A cached review is dropped once its ServiceAccount is gone from a
    /// synced index, has another UID than the reviewed one (recreated), or
    /// is deleted by the API server's rule, and whenever the index has lost
    /// its watch for longer than allowed.
    fn account_still_present(&self, entry: &CacheEntry) -> bool {
        let (Some(accounts), Some(k)) = (self.accounts.get(), &entry.caller.kube) else {
            return true;
        };
        if !accounts.is_synced() {
            return true;
        }
        if crate::renewal::stale(
            accounts.disconnected_for(),
            self.settings.max_index_staleness,
        )
        .is_some()
        {
            return false;
        }
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        accounts.read(|s| {
            s.get(&k.pod_namespace, &k.service_account)
                .is_some_and(|a| {
                    entry.account_uid.as_deref().is_none_or(|u| u == a.uid)
                        && !crate::podindex::deleted_by(a.deletion_timestamp, now)
                })
        })
    }

    fn remember(&self, key: [u8; 32], token: &str, reviewed: &Reviewed) {
        let result = &reviewed.result;
        let action = cache_action(
            reviewed.outcome,
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
                            account_uid: reviewed.account_uid.clone(),
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
    async fn review(&self, token: &str) -> Reviewed {
        let unanswered = |result| Reviewed {
            outcome: Outcome::NotAnswered,
            result,
            account_uid: None,
        };
        let limits = self.settings.limits;
        let reserved = lock(&self.bucket).reserve(Instant::now(), limits.max_wait);
        let waited = match reserved {
            Ok(wait) => wait,
            Err(retry) => return unanswered(Err(self.refuse(REASON_BUDGET, retry))),
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
                return unanswered(Err(self.refuse(REASON_INFLIGHT, limits.max_wait)));
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
        let mut account_uid = None;
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
                Ok(caller) => {
                    // A ServiceAccount's user UID is the account's UID.
                    account_uid = status.user.as_ref().and_then(|u| u.uid.clone());
                    (Outcome::Authenticated, Ok(caller))
                }
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
        Reviewed {
            outcome,
            result,
            account_uid,
        }
    }

    /// The review task of one flight: review, remember, then release the
    /// flight (after the cache is filled, so no later caller starts another).
    async fn fly(
        self: Arc<Self>,
        key: [u8; 32],
        token: String,
        tx: watch::Sender<Option<Result<Caller, AuthnError>>>,
    ) {
        let reviewed = self.review(&token).await;
        self.remember(key, &token, &reviewed);
        lock(&self.inflight).remove(&key);
        tx.send_replace(Some(reviewed.result));
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
mod tests;
