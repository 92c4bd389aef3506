//! Tables of local verification: the claims, forged tokens, the pod
//! binding, index readiness and the issuer keys' age.

use super::*;
use crate::authn::jwks::VerifyKey;
use crate::podindex::{pod, IndexEvent, LeanPod, Phase};
use jsonwebtoken::Algorithm;
use jsonwebtoken::{DecodingKey, EncodingKey, Header};
use serde_json::json;
use test_case::test_case;

const ISS: &str = "https://kubernetes.default.svc.cluster.local";

/// A reviewer that only answers from its "cache".
#[derive(Debug)]
struct CachedOnly;

#[tonic::async_trait]
impl TokenAuthenticator for CachedOnly {
    async fn authenticate(&self, _: &str, _: Option<&str>) -> Result<Caller, AuthnError> {
        Err(AuthnError::NoCredentials)
    }
    fn cached_verdict(&self, token: &str) -> Option<bool> {
        match token {
            "warm" => Some(true),
            "garbage" => Some(false),
            _ => None,
        }
    }
}

#[test]
fn familiarity_comes_from_the_review_cache_in_every_mode() {
    for mode in [
        TokenVerificationMode::Review,
        TokenVerificationMode::Local,
        TokenVerificationMode::LocalThenReview,
    ] {
        let v = TokenVerifier {
            mode,
            local: None,
            review: Some(Arc::new(CachedOnly)),
            require_pod_binding: false,
            metrics: None,
        };
        assert_eq!(v.cached_verdict("warm"), Some(true), "{mode:?}");
        assert_eq!(v.cached_verdict("garbage"), Some(false), "{mode:?}");
        assert_eq!(v.cached_verdict("cold"), None, "{mode:?}");
        let none = TokenVerifier { review: None, ..v };
        assert_eq!(none.cached_verdict("warm"), None, "{mode:?}");
    }
}

struct Keys {
    enc: EncodingKey,
    spki: Vec<u8>,
    set: KeySet,
}

/// A fresh P-256 key as kid "k1" (EC keys are fast to make in tests).
fn keys() -> Keys {
    use aws_lc_rs::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
    let rng = aws_lc_rs::rand::SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
    let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref()).unwrap();
    let spki = pair.public_key().as_ref().to_vec();
    let mut set = KeySet::default();
    set.keys.insert(
        "k1".into(),
        VerifyKey {
            alg: Algorithm::ES256,
            key: DecodingKey::from_ec_der(&spki),
        },
    );
    Keys {
        enc: EncodingKey::from_ec_der(pkcs8.as_ref()),
        spki,
        set,
    }
}

fn now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

fn claims() -> serde_json::Value {
    let n = now();
    json!({
        "iss": ISS, "aud": ["istio-ca"], "sub": "system:serviceaccount:ns-a:sa-a",
        "iat": n, "nbf": n, "exp": n + 3600,
        "kubernetes.io": {
            "namespace": "ns-a",
            "serviceaccount": {"name": "sa-a", "uid": "sa-uid"},
            "pod": {"name": "pod-a", "uid": "pod-uid"},
            "node": {"name": "node-1", "uid": "node-uid"},
        }
    })
}

fn sign(k: &Keys, kid: Option<&str>, claims: &serde_json::Value) -> String {
    let mut h = Header::new(Algorithm::ES256);
    h.kid = kid.map(str::to_string);
    jsonwebtoken::encode(&h, claims, &k.enc).unwrap()
}

fn with(f: impl FnOnce(&mut serde_json::Value)) -> serde_json::Value {
    let mut c = claims();
    f(&mut c);
    c
}

fn b64(v: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v)
}

fn verify(k: &Keys, token: &str) -> Result<Verified, LocalError> {
    verify_token(token, ISS, &k.set, &["istio-ca".to_string()])
}

#[test]
fn a_good_token_verifies() {
    let k = keys();
    let v = verify(&k, &sign(&k, Some("k1"), &claims())).unwrap();
    assert_eq!(
        v,
        Verified {
            namespace: "ns-a".into(),
            service_account: "sa-a".into(),
            service_account_uid: "sa-uid".into(),
            pod: Some(("pod-a".into(), "pod-uid".into())),
            node: Some(("node-1".into(), "node-uid".into())),
        }
    );
}

// Each changed claim and the reason it is refused with (and whether a review may still decide).
#[test_case(with(|c| c["aud"] = json!(["other"])), "token_local_audience_mismatch", false ; "wrong audience")]
#[test_case(with(|c| c["aud"] = json!("istio-ca")), "", false ; "audience as a string")]
#[test_case(with(|c| c["exp"] = json!(now() - 3600)), "token_local_expired", false ; "expired")]
#[test_case(with(|c| c["exp"] = json!(now() - 30)), "", false ; "expired within the skew")]
#[test_case(with(|c| c["nbf"] = json!(now() + 3600)), "token_local_not_yet_valid", false ; "not yet valid")]
#[test_case(with(|c| c["nbf"] = json!(now() + 30)), "", false ; "not yet valid within the skew")]
#[test_case(with(|c| c["iss"] = json!("https://other.example")), "token_local_unknown_issuer", true ; "foreign issuer")]
#[test_case(with(|c| { c.as_object_mut().unwrap().remove("iss"); }), "token_local_unknown_issuer", true ; "no issuer")]
#[test_case(with(|c| { c.as_object_mut().unwrap().remove("exp"); }), "token_local_invalid_claims", false ; "no exp")]
#[test_case(with(|c| c["sub"] = json!("system:serviceaccount:ns-a:other")), "token_local_invalid_claims", false ; "sub disagrees with claims")]
#[test_case(with(|c| { c.as_object_mut().unwrap().remove("kubernetes.io"); }), "token_local_invalid_claims", false ; "no kubernetes claims")]
#[test_case(with(|c| c["kubernetes.io"]["serviceaccount"]["uid"] = json!("")), "token_local_invalid_claims", false ; "no sa uid")]
#[test_case(with(|c| c["kubernetes.io"]["pod"]["uid"] = json!("")), "token_local_invalid_claims", false ; "pod without uid")]
#[test_case(with(|c| { c["kubernetes.io"]["node"].as_object_mut().unwrap().remove("uid"); }), "", false ; "node without uid as for a missing Node")]
#[test_case(with(|c| c["kubernetes.io"]["node"]["name"] = json!("")), "token_local_invalid_claims", false ; "node without name")]
fn claims_table(c: serde_json::Value, reason: &str, falls_back: bool) {
    let k = keys();
    match verify(&k, &sign(&k, Some("k1"), &c)) {
        Ok(_) => assert_eq!(reason, "", "accepted"),
        Err(e) => {
            assert_eq!(e.reason(), reason, "{e}");
            assert_eq!(e.falls_back(), falls_back);
        }
    }
}

#[test]
fn forged_tokens_are_refused() {
    let k = keys();
    let good = sign(&k, Some("k1"), &claims());
    let parts: Vec<&str> = good.split('.').collect();
    let reason = |t: &str| verify(&k, t).unwrap_err().reason();
    // A changed claim under the original signature.
    let tampered_claims = b64(&serde_json::to_vec(&with(|c| {
        c["kubernetes.io"]["namespace"] = json!("ns-b");
        c["sub"] = json!("system:serviceaccount:ns-b:sa-a");
    }))
    .unwrap());
    assert_eq!(
        reason(&format!("{}.{tampered_claims}.{}", parts[0], parts[2])),
        "token_local_bad_signature"
    );
    // A flipped signature byte.
    let mut sig = parts[2].as_bytes().to_vec();
    sig[5] = if sig[5] == b'A' { b'B' } else { b'A' };
    let flipped = format!(
        "{}.{}.{}",
        parts[0],
        parts[1],
        String::from_utf8(sig).unwrap()
    );
    assert_eq!(reason(&flipped), "token_local_bad_signature");
    // alg none, no signature.
    let none = format!("{}.{}.", b64(br#"{"alg":"none","kid":"k1"}"#), parts[1]);
    assert_eq!(reason(&none), "token_local_alg_not_allowed");
    // HS256 keyed with the public key's bytes.
    let mut h = Header::new(Algorithm::HS256);
    h.kid = Some("k1".into());
    let hs =
        jsonwebtoken::encode(&h, &claims(), &EncodingKey::from_secret(&k.spki).unwrap()).unwrap();
    assert_eq!(reason(&hs), "token_local_alg_not_allowed");
    // Signed by another key under our kid.
    let stranger = keys();
    assert_eq!(
        reason(&sign(&stranger, Some("k1"), &claims())),
        "token_local_bad_signature"
    );
    // Unknown kid: a review may know the key.
    let e = verify(&k, &sign(&k, Some("rotated"), &claims())).unwrap_err();
    assert_eq!(
        (e.reason(), e.falls_back()),
        ("token_local_unknown_kid", true)
    );
    // No kid: every key is tried, as the API server does. A stranger's
    // signature verifies under none of them: a review may know the key.
    assert!(verify(&k, &sign(&k, None, &claims())).is_ok());
    let e = verify(&k, &sign(&stranger, None, &claims())).unwrap_err();
    assert_eq!(
        (e.reason(), e.falls_back()),
        ("token_local_unknown_kid", true)
    );
    // With several keys the one that signed it is found ("k0" is tried first).
    let mut two = k.set.clone();
    two.keys
        .insert("k0".into(), stranger.set.keys["k1"].clone());
    for signer in [&k, &stranger] {
        let t = sign(signer, None, &claims());
        assert!(verify_token(&t, ISS, &two, &["istio-ca".to_string()]).is_ok());
    }
    // ... and a kid-less token's claims are checked like any other's.
    let expired = with(|c| c["exp"] = json!(now() - 3600));
    assert_eq!(reason(&sign(&k, None, &expired)), "token_local_expired");
    let mut h = Header::new(Algorithm::HS256);
    h.kid = None;
    let hs =
        jsonwebtoken::encode(&h, &claims(), &EncodingKey::from_secret(&k.spki).unwrap()).unwrap();
    assert_eq!(reason(&hs), "token_local_alg_not_allowed");
    assert_eq!(reason("not-a-jwt"), "token_local_malformed");
}

fn verified(node: Option<&str>) -> Verified {
    Verified {
        namespace: "ns-a".into(),
        service_account: "sa-a".into(),
        service_account_uid: "sa-uid".into(),
        pod: Some(("pod-a".into(), "pod-uid".into())),
        node: node.map(|n| (n.to_string(), "node-uid".to_string())),
    }
}

fn index(pods: Vec<LeanPod>) -> IndexState {
    let mut s = IndexState::default();
    s.apply(IndexEvent::Init);
    for p in pods {
        s.apply(IndexEvent::InitApply(p));
    }
    s.apply(IndexEvent::InitDone);
    s
}

fn pod_a(uid: &str, sa: &str, node: Option<&str>, phase: Phase) -> LeanPod {
    pod("ns-a", "pod-a", uid, node, sa, phase)
}

const NOW: i64 = 1_000_000;

fn deleting(p: LeanPod, secs_ago: i64) -> LeanPod {
    LeanPod {
        deletion_timestamp: Some(NOW - secs_ago),
        ..p
    }
}

/// The token's service account as indexed: uid, seconds since its deletion began.
type Sa = Option<(&'static str, Option<i64>)>;
const SA: Sa = Some(("sa-uid", None));

fn accounts(sa: Sa) -> AccountState {
    let rows: Vec<(&str, &str, &str, Option<i64>)> = sa
        .into_iter()
        .map(|(uid, ago)| ("ns-a", "sa-a", uid, ago.map(|a| NOW - a)))
        .collect();
    crate::podindex::accounts::state_of(&rows)
}

// What the API server refuses (with its one-minute leeway on deletions),
// then meshca's stricter checks; and whether a review may still decide.
#[test_case(verified(Some("node-1")), SA, vec![pod_a("pod-uid", "sa-a", Some("node-1"), Phase::Running)], None ; "live pod")]
#[test_case(verified(None), SA, vec![pod_a("pod-uid", "sa-a", Some("node-1"), Phase::Running)], None ; "token without node")]
#[test_case(verified(None), SA, vec![pod_a("pod-uid", "sa-a", None, Phase::Pending)], None ; "unscheduled pod")]
#[test_case(verified(None), SA, vec![pod_a("pod-uid", "sa-a", Some("node-1"), Phase::Succeeded)], None ; "succeeded pod still exists as for a review")]
#[test_case(verified(None), SA, vec![], Some(("token_local_pod_not_indexed", true)) ; "deleted pod")]
#[test_case(verified(None), SA, vec![pod_a("pod-uid", "sa-a", Some("node-1"), Phase::Failed)], Some(("token_local_pod_not_indexed", true)) ; "failed pod left the index")]
#[test_case(verified(None), SA, vec![pod_a("new-uid", "sa-a", Some("node-1"), Phase::Running)], Some(("token_local_pod_uid_mismatch", true)) ; "recreated pod")]
#[test_case(verified(None), SA, vec![deleting(pod_a("pod-uid", "sa-a", Some("node-1"), Phase::Running), 0)], None ; "pod deleting now")]
#[test_case(verified(None), SA, vec![deleting(pod_a("pod-uid", "sa-a", Some("node-1"), Phase::Running), 60)], None ; "pod deleting for the leeway")]
#[test_case(verified(None), SA, vec![deleting(pod_a("pod-uid", "sa-a", Some("node-1"), Phase::Running), 61)], Some(("token_local_pod_deleted", false)) ; "pod deleting past the leeway")]
#[test_case(verified(None), SA, vec![deleting(pod_a("pod-uid", "sa-a", Some("node-1"), Phase::Running), -30)], None ; "graceful deletion not yet due")]
#[test_case(verified(None), None, vec![pod_a("pod-uid", "sa-a", Some("node-1"), Phase::Running)], Some(("token_local_sa_not_indexed", true)) ; "deleted service account")]
#[test_case(verified(None), Some(("new-sa-uid", None)), vec![pod_a("pod-uid", "sa-a", Some("node-1"), Phase::Running)], Some(("token_local_sa_uid_mismatch", true)) ; "recreated service account")]
#[test_case(verified(None), Some(("sa-uid", Some(60))), vec![pod_a("pod-uid", "sa-a", Some("node-1"), Phase::Running)], None ; "service account deleting for the leeway")]
#[test_case(verified(None), Some(("sa-uid", Some(61))), vec![pod_a("pod-uid", "sa-a", Some("node-1"), Phase::Running)], Some(("token_local_sa_deleted", false)) ; "service account deleting past the leeway")]
#[test_case(verified(None), Some(("new-sa-uid", Some(3600))), vec![pod_a("pod-uid", "sa-a", Some("node-1"), Phase::Running)], Some(("token_local_sa_uid_mismatch", true)) ; "uid checked before deletion as the API server does")]
#[test_case(verified(None), SA, vec![pod_a("pod-uid", "sa-b", Some("node-1"), Phase::Running)], Some(("token_local_sa_mismatch", false)) ; "other service account")]
#[test_case(verified(Some("node-2")), SA, vec![pod_a("pod-uid", "sa-a", Some("node-1"), Phase::Running)], Some(("token_local_node_mismatch", false)) ; "other node")]
#[test_case(verified(Some("node-1")), SA, vec![pod_a("pod-uid", "sa-a", None, Phase::Pending)], Some(("token_local_node_not_indexed", true)) ; "index lags the binding")]
fn binding(v: Verified, sa: Sa, pods: Vec<LeanPod>, want: Option<(&str, bool)>) {
    let got = bind(&v, false, NOW, &index(pods), &accounts(sa));
    assert_eq!(got.err().map(|e| (e.reason(), e.falls_back())), want);
}

#[test]
fn unbound_tokens_fall_back_unless_binding_is_required() {
    let mut v = verified(None);
    v.pod = None;
    let s = index(vec![]);
    let e = bind(&v, false, NOW, &s, &accounts(SA)).unwrap_err();
    assert_eq!(
        (e.reason(), e.falls_back()),
        ("token_local_not_pod_bound", true)
    );
    let e = bind(&v, true, NOW, &s, &accounts(SA)).unwrap_err();
    assert_eq!(
        (e.reason(), e.falls_back()),
        ("token_pod_binding_required", false)
    );
}

// (pods synced, accounts synced, pods disconnected s, accounts disconnected s, want)
#[test_case(true, true, None, None, None ; "current")]
#[test_case(false, true, None, None, Some("token_local_index_not_synced") ; "pods not synced")]
#[test_case(true, false, None, None, Some("token_local_index_not_synced") ; "accounts not synced")]
#[test_case(true, true, Some(30), None, None ; "pods briefly disconnected")]
#[test_case(true, true, Some(61), None, Some("token_local_index_stale") ; "pod watch down past the bound")]
#[test_case(true, true, None, Some(61), Some("token_local_index_stale") ; "account watch down past the bound")]
fn readiness(pods: bool, accts: bool, pd: Option<u64>, ad: Option<u64>, want: Option<&str>) {
    let s = std::time::Duration::from_secs;
    let got = indexes_ready(pods, accts, pd.map(s), ad.map(s), s(60));
    assert_eq!(got.as_ref().err().map(|e| e.reason()), want);
    if let Err(e) = got {
        assert!(e.falls_back() && e.is_retryable(), "{e}");
    }
}

/// A local verifier for the pod of [`claims`] over `keys`, its indexes synced.
fn local_verifier(keys: Arc<IssuerKeys>) -> LocalVerifier {
    use crate::podindex::accounts::LeanAccount;
    let index = Arc::new(PodIndex::new());
    index.apply(IndexEvent::Init);
    index.apply(IndexEvent::InitApply(pod_a(
        "pod-uid",
        "sa-a",
        Some("node-1"),
        Phase::Running,
    )));
    index.apply(IndexEvent::InitDone);
    let accounts = Arc::new(AccountIndex::new());
    accounts.apply(IndexEvent::Init);
    accounts.apply(IndexEvent::InitApply(LeanAccount {
        namespace: "ns-a".into(),
        name: "sa-a".into(),
        uid: "sa-uid".into(),
        deletion_timestamp: None,
    }));
    accounts.apply(IndexEvent::InitDone);
    LocalVerifier {
        cluster_id: "Kubernetes".into(),
        keys,
        index,
        accounts,
        audiences: vec!["istio-ca".into()],
        trust_domain: TrustDomain::new("cluster.local").unwrap(),
        require_pod_binding: false,
        sync_wait: std::time::Duration::ZERO,
        max_index_staleness: std::time::Duration::from_secs(60),
    }
}

/// Polls until `token` is refused (every 20 ms), or fails after `within`.
async fn until_refused(
    v: &LocalVerifier,
    token: &str,
    within: std::time::Duration,
    what: &str,
) -> (LocalError, std::time::Duration) {
    let start = Instant::now();
    loop {
        if let Err(e) = v.verify(token, None).await {
            return (e, start.elapsed());
        }
        assert!(
            start.elapsed() < within,
            "{what}: the token still verifies locally after {within:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A key removed from the issuer stops verifying locally within the
/// bound: at the next periodic fetch while fetches succeed, and once the
/// last good set is older than its maximum age while they fail (it was
/// kept for as long as they failed). The issuer is a fake key source:
/// the real API server's signing key cannot be removed while it runs
/// (`tests/kube_token_keys.rs` shows the maximum age on it, with its
/// fetches made to fail).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_key_stops_verifying_within_the_bound() {
    use crate::authn::jwks::test_keys::{doc, ec_key, sign as sign_by, Switch};
    use crate::authn::jwks::RefreshPolicy;
    let ms = std::time::Duration::from_millis;
    let (k1, k2) = (ec_key("k1"), ec_key("k2"));
    let src = Switch::new(ISS, doc(&[&k1, &k2]));
    let policy = RefreshPolicy {
        interval: ms(300),
        min_interval: ms(100),
        timeout: ms(1000),
        max_age: ms(600),
    };
    let keys = Arc::new(IssuerKeys::new(src.clone(), policy));
    let task = tokio::spawn(keys.clone().run());
    let v = local_verifier(keys);
    let (t1, t2) = (
        sign_by(&k1, Some("k1"), &claims()),
        sign_by(&k2, Some("k2"), &claims()),
    );
    assert!(v.verify(&t1, None).await.is_ok(), "k1 verifies at first");
    // The issuer removes k1; fetches succeed.
    src.publish(Some(doc(&[&k2])));
    let (e, took) = until_refused(&v, &t1, policy.interval * 10, "removed key").await;
    assert_eq!(
        (e.reason(), e.falls_back()),
        ("token_local_unknown_kid", true)
    );
    assert!(
        took < policy.interval * 3,
        "removed key verified {took:?} after its removal (refresh interval {:?})",
        policy.interval
    );
    assert!(v.verify(&t2, None).await.is_ok(), "k2 still verifies");
    // Now every fetch fails: the set still holding k2 ages out.
    src.publish(None);
    let (e, took_stale) = until_refused(&v, &t2, policy.max_age * 10, "failing fetches").await;
    assert_eq!(
        (e.reason(), e.falls_back(), e.is_retryable()),
        ("token_local_keys_stale", true, true),
        "{e}"
    );
    assert!(
        took_stale < policy.max_age * 2,
        "keys verified {took_stale:?} after fetches began failing (max age {:?})",
        policy.max_age
    );
    for _ in 0..5 {
        let e = v.verify(&t2, None).await.unwrap_err();
        assert_eq!(e.reason(), "token_local_keys_stale");
        tokio::time::sleep(ms(20)).await;
    }
    eprintln!(
        "removed key refused after {took:?} (interval {:?}); set refused {took_stale:?} after fetches began failing (max age {:?})",
        policy.interval, policy.max_age
    );
    // Fetches recover: the fresh set verifies again.
    src.publish(Some(doc(&[&k2])));
    let start = Instant::now();
    while v.verify(&t2, None).await.is_err() {
        assert!(start.elapsed() < policy.max_age * 10, "never recovered");
        tokio::time::sleep(ms(20)).await;
    }
    task.abort();
}

#[test]
fn only_what_a_review_may_decide_falls_back() {
    assert!(!LocalError::BadSignature.falls_back());
    assert!(!LocalError::Expired.falls_back());
    assert!(LocalError::IndexNotSynced.is_retryable());
    assert!(!LocalError::PodNotIndexed("x".into()).is_retryable());
}
