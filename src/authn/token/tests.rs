//! Table tests of the review interpretation, the pre-check and the cache
//! policy, and the authenticator over a fake API server.

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
/// The UID the fake API server reports for `USER`'s ServiceAccount.
const SA_UID: &str = "sa-uid-1";
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
    let payload =
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(br#"{"exp":1700000000,"sub":"x"}"#);
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
            let mut st = status(true, None, USER, GROUPS, &[]);
            if let Some(u) = st.user.as_mut() {
                u.uid = Some(SA_UID.into());
            }
            return Ok(st);
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
    let a =
        KubeTokenAuthenticator::with_backend(fake, settings, None).with_metrics(metrics.clone());
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

/// (the ServiceAccount index: synced, and `(uid, deleted seconds ago)`
/// of default/example-pod-sa; whether the cached success is used)
#[test_case(true, Some(("sa-uid-1", None)), true ; "same account")]
#[test_case(true, Some(("sa-uid-2", None)), false ; "recreated with a new uid")]
#[test_case(true, None, false ; "deleted")]
#[test_case(true, Some(("sa-uid-1", Some(30))), true ; "deleting within the leeway")]
#[test_case(true, Some(("sa-uid-1", Some(61))), false ; "deleting past the leeway")]
#[test_case(false, None, true ; "index not synced decides nothing")]
#[tokio::test]
async fn a_cached_success_follows_its_service_account(
    synced: bool,
    account: Option<(&str, Option<i64>)>,
    cached: bool,
) {
    use crate::podindex::accounts::LeanAccount;
    use crate::podindex::IndexEvent;
    let fake = Arc::new(Fake::default());
    let (a, _) = authenticator(fake.clone(), ReviewLimits::default());
    let accounts = Arc::new(AccountIndex::new());
    let a = a.with_accounts(accounts.clone());
    let token = live("good-sa");
    let row = |uid: &str, del: Option<i64>| LeanAccount {
        namespace: "default".into(),
        name: "example-pod-sa".into(),
        uid: uid.into(),
        deletion_timestamp: del,
    };
    accounts.apply(IndexEvent::Init);
    accounts.apply(IndexEvent::InitApply(row(SA_UID, None)));
    accounts.apply(IndexEvent::InitDone);
    a.authenticate(&token, None).await.unwrap();
    assert_eq!(calls(&fake), 1);
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let changed: Vec<LeanAccount> = account
        .map(|(uid, ago)| row(uid, ago.map(|a| now - a)))
        .into_iter()
        .collect();
    if synced {
        accounts.apply(IndexEvent::Init);
        for r in changed {
            accounts.apply(IndexEvent::InitApply(r));
        }
        accounts.apply(IndexEvent::InitDone);
    } else {
        // A fresh index that has not listed yet.
        let fresh = Arc::new(AccountIndex::new());
        let (b, _) = authenticator(fake.clone(), ReviewLimits::default());
        let b = b.with_accounts(fresh);
        b.authenticate(&token, None).await.unwrap();
        let before = calls(&fake);
        b.authenticate(&token, None).await.unwrap();
        assert_eq!(calls(&fake) == before, cached);
        return;
    }
    a.authenticate(&token, None).await.unwrap();
    assert_eq!(calls(&fake) == 1, cached, "reviews: {}", calls(&fake));
}
