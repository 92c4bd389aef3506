//! Local verification of projected ServiceAccount tokens against the real
//! kube-apiserver: on a table of real and forged tokens it accepts exactly
//! what TokenReview accepts; each fallback to TokenReview; a deleted pod's
//! token is refused once the index shows the deletion (the lag is measured
//! and printed).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use base64::Engine;
use common::{kte, spiffe, start, Kte, Server};
use meshca::authn::local::TokenVerificationMode;
use meshca::ca::generate::KeyType;
use meshca::testing::TestPki;
use serde_json::{json, Value};
use tonic::Code;

/// Accepted by the API server, absent from its OIDC discovery (scripts/kube-testenv).
const SECOND_ISSUER: &str = "https://legacy-issuer.kte.invalid";

fn b64(v: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v)
}

fn unb64(s: &str) -> Vec<u8> {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(s)
        .unwrap()
}

fn now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

/// An RSA key that signs test tokens (PKCS#8 DER).
struct RsaKey(aws_lc_rs::rsa::KeyPair);

impl RsaKey {
    /// The cluster's real ServiceAccount signing key.
    fn cluster(k: &Kte) -> Self {
        use rustls_pki_types::pem::PemObject;
        let pem = std::fs::read(k.dir.join("pki/sa.key")).unwrap();
        let der = rustls_pki_types::PrivateKeyDer::from_pem_slice(&pem).unwrap();
        Self(match &der {
            rustls_pki_types::PrivateKeyDer::Pkcs8(k) => {
                aws_lc_rs::rsa::KeyPair::from_pkcs8(k.secret_pkcs8_der()).unwrap()
            }
            other => aws_lc_rs::rsa::KeyPair::from_der(other.secret_der()).unwrap(),
        })
    }

    /// A key nobody trusts.
    fn stranger() -> Self {
        Self(aws_lc_rs::rsa::KeyPair::generate(aws_lc_rs::rsa::KeySize::Rsa2048).unwrap())
    }

    fn sign(&self, header: &Value, claims: &Value) -> String {
        let input = format!(
            "{}.{}",
            b64(&serde_json::to_vec(header).unwrap()),
            b64(&serde_json::to_vec(claims).unwrap())
        );
        let mut sig = vec![0u8; self.0.public_modulus_len()];
        self.0
            .sign(
                &aws_lc_rs::signature::RSA_PKCS1_SHA256,
                &aws_lc_rs::rand::SystemRandom::new(),
                input.as_bytes(),
                &mut sig,
            )
            .unwrap();
        format!("{input}.{}", b64(&sig))
    }
}

fn header_of(token: &str) -> Value {
    serde_json::from_slice(&unb64(token.split('.').next().unwrap())).unwrap()
}

fn claims_of(token: &str) -> Value {
    serde_json::from_slice(&unb64(token.split('.').nth(1).unwrap())).unwrap()
}

/// A meshca in `mode`, without the TokenReview success cache (so a review
/// server always asks the API server), with an index when `mode` is local.
async fn server(_k: &Kte, mode: TokenVerificationMode, kubeconfig: std::path::PathBuf) -> Server {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let mut cfg = common::kube_config(&pki, kubeconfig, &[]);
    let kube = cfg.kube.as_mut().unwrap();
    kube.token_cache_ttl = Duration::ZERO;
    kube.token_verification.mode = mode;
    start(cfg, pki).await
}

/// Waits until the server's issuer keys are loaded.
async fn keys_loaded(srv: &Server) {
    let keys = srv.app.issuer_keys.as_ref().expect("local verification on");
    let deadline = Instant::now() + Duration::from_secs(30);
    while keys.current().is_none() {
        assert!(
            Instant::now() < deadline,
            "issuer keys never loaded: {:?}",
            keys.last_error()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// (allowed, reason, token_verified_by, token_local_fallback) of one request as the token's own identity.
async fn verdict(
    srv: &Server,
    token: &str,
    id: &str,
) -> (bool, String, Option<String>, Option<String>) {
    let r = srv.call(token, id, None, None).await;
    let rec = srv.audit.requests().last().cloned().unwrap();
    (
        r.is_ok(),
        format!("{} {}", rec.reason, rec.detail.unwrap_or_default()),
        rec.token_verified_by.clone(),
        rec.token_local_fallback.clone(),
    )
}

struct Three {
    review: Server,
    local: Server,
    both: Server,
}

async fn three(k: &Kte) -> Three {
    let review = server(k, TokenVerificationMode::Review, k.meshca_kubeconfig()).await;
    let local = server(k, TokenVerificationMode::Local, k.meshca_kubeconfig()).await;
    let both = server(
        k,
        TokenVerificationMode::LocalThenReview,
        k.meshca_kubeconfig(),
    )
    .await;
    keys_loaded(&local).await;
    keys_loaded(&both).await;
    Three {
        review,
        local,
        both,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_verification_accepts_exactly_what_tokenreview_accepts() {
    let k = kte().await;
    let t = three(&k).await;
    let ns = k.namespace("tok").await;
    k.service_account(&ns, "app").await;
    let id = spiffe(&ns, "app");
    let uid = k.pod(&ns, "live", "app", "node-a").await;
    let good = k.token(&ns, "app", Some(("live", &uid)), "istio-ca").await;
    let kid = header_of(&good)["kid"].as_str().unwrap().to_string();
    let base = claims_of(&good);
    let cluster = RsaKey::cluster(&k);
    let stranger = RsaKey::stranger();
    let rs256 = |kid: &str| json!({"alg": "RS256", "kid": kid});
    let with = |f: &dyn Fn(&mut Value)| {
        let mut c = base.clone();
        f(&mut c);
        c
    };

    let wrong_aud = k
        .token(&ns, "app", Some(("live", &uid)), "other-audience")
        .await;
    let expired = cluster.sign(
        &rs256(&kid),
        &with(&|c: &mut Value| {
            let n = now();
            c["iat"] = json!(n - 7200);
            c["nbf"] = json!(n - 7200);
            c["exp"] = json!(n - 3600);
        }),
    );
    let not_yet = cluster.sign(
        &rs256(&kid),
        &with(&|c: &mut Value| {
            let n = now();
            c["iat"] = json!(n + 3600);
            c["nbf"] = json!(n + 3600);
            c["exp"] = json!(n + 7200);
        }),
    );
    // Deleted and recreated pods: their tokens are never presented before the change.
    let del_uid = k.pod(&ns, "deleted", "app", "node-a").await;
    let deleted = k
        .token(&ns, "app", Some(("deleted", &del_uid)), "istio-ca")
        .await;
    let rec_uid = k.pod(&ns, "recreated", "app", "node-a").await;
    let recreated = k
        .token(&ns, "app", Some(("recreated", &rec_uid)), "istio-ca")
        .await;
    k.delete_pod(&ns, "deleted").await;
    k.delete_pod(&ns, "recreated").await;
    let new_uid = k.pod(&ns, "recreated", "app", "node-a").await;
    let foreign = stranger.sign(
        &rs256("foreign-kid"),
        &with(&|c: &mut Value| c["iss"] = json!("https://issuer.example.invalid")),
    );
    let tampered = {
        let parts: Vec<&str> = good.split('.').collect();
        let c =
            with(&|c: &mut Value| c["kubernetes.io"]["serviceaccount"]["name"] = json!("other"));
        format!(
            "{}.{}.{}",
            parts[0],
            b64(&serde_json::to_vec(&c).unwrap()),
            parts[2]
        )
    };
    let alg_none = format!(
        "{}.{}.",
        b64(&serde_json::to_vec(&json!({"alg": "none", "kid": kid})).unwrap()),
        good.split('.').nth(1).unwrap()
    );
    let hs256 = {
        let header = b64(&serde_json::to_vec(&json!({"alg": "HS256", "kid": kid})).unwrap());
        let input = format!("{header}.{}", good.split('.').nth(1).unwrap());
        let public = std::fs::read(k.dir.join("pki/sa.pub")).unwrap();
        let key = aws_lc_rs::hmac::Key::new(aws_lc_rs::hmac::HMAC_SHA256, &public);
        let tag = aws_lc_rs::hmac::sign(&key, input.as_bytes());
        format!("{input}.{}", b64(tag.as_ref()))
    };
    let unknown_kid = stranger.sign(&rs256("unknown-kid"), &base);

    // Every server's view must reflect the deletion and the recreation.
    for srv in [&t.local, &t.both] {
        let (n, u) = (ns.clone(), new_uid.clone());
        srv.wait_index("deleted and recreated", move |s| {
            s.get(&n, "deleted").is_none() && s.get(&n, "recreated").is_some_and(|p| *p.uid == *u)
        })
        .await;
    }

    let table: Vec<(&str, &str, bool)> = vec![
        ("good", &good, true),
        ("wrong audience", &wrong_aud, false),
        ("expired", &expired, false),
        ("not yet valid", &not_yet, false),
        ("deleted pod", &deleted, false),
        ("recreated pod", &recreated, false),
        ("foreign issuer", &foreign, false),
        ("tampered signature", &tampered, false),
        ("alg none", &alg_none, false),
        ("HS256 with the public key", &hs256, false),
        ("unknown kid", &unknown_kid, false),
    ];
    let mut report = Vec::new();
    for (name, token, want) in table {
        // The API server's informers may lag the deletion by a moment: let
        // TokenReview settle first (it is the reference).
        let mut review = verdict(&t.review, token, &id).await;
        let settle = Instant::now() + Duration::from_secs(20);
        while review.0 != want && Instant::now() < settle {
            tokio::time::sleep(Duration::from_millis(200)).await;
            review = verdict(&t.review, token, &id).await;
        }
        let local = verdict(&t.local, token, &id).await;
        let both = verdict(&t.both, token, &id).await;
        report.push(format!(
            "{name:28} review={:5} {:32} local={:5} {:32} local-then-review={:5} {} {:?}",
            review.0, review.1, local.0, local.1, both.0, both.1, both.3
        ));
        assert_eq!(review.0, want, "TokenReview on {name}: {review:?}");
        assert_eq!(local.0, want, "local on {name}: {local:?}");
        assert_eq!(both.0, want, "local-then-review on {name}: {both:?}");
        if want {
            assert_eq!(review.2.as_deref(), Some("review"));
            assert_eq!(local.2.as_deref(), Some("local"));
            assert_eq!(both.2.as_deref(), Some("local"), "no review needed");
        } else {
            // What local verification could not decide went to TokenReview, which refused it.
            let code = local.1.split(' ').next().unwrap();
            let undecided = [
                "token_local_unknown_issuer",
                "token_local_unknown_kid",
                "token_local_pod_not_indexed",
                "token_local_pod_uid_mismatch",
            ];
            assert_eq!(
                both.1
                    .contains(&format!("after local verification: {code})")),
                undecided.contains(&code),
                "{name}: {both:?}"
            );
            assert!(
                local.1.starts_with("token_local_") || local.1.starts_with("authn_"),
                "{name}: local refusal names its reason: {local:?}"
            );
        }
    }
    eprintln!("{}", report.join("\n"));
    let reviews: u64 = ["authenticated", "rejected", "error"]
        .iter()
        .map(|r| {
            t.local
                .app
                .metrics
                .token_reviews
                .tokenreviews
                .get_or_create(&meshca::metrics::ResultLabels {
                    result: r.to_string(),
                })
                .get()
        })
        .sum();
    assert_eq!(reviews, 0, "local mode sends no TokenReview");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_local_verification_cannot_decide_goes_to_tokenreview() {
    let k = kte().await;
    let t = three(&k).await;
    let ns = k.namespace("fb").await;
    k.service_account(&ns, "app").await;
    let id = spiffe(&ns, "app");
    let uid = k.pod(&ns, "p0", "app", "node-a").await;
    let good = k.token(&ns, "app", Some(("p0", &uid)), "istio-ca").await;
    let kid = header_of(&good)["kid"].as_str().unwrap().to_string();
    let cluster = RsaKey::cluster(&k);
    // Valid for the API server, outside what local verification knows.
    let second_issuer = cluster.sign(&json!({"alg": "RS256", "kid": kid}), &{
        let mut c = claims_of(&good);
        c["iss"] = json!(SECOND_ISSUER);
        c
    });
    // The API server tries every key for a token without a kid (and none for an unknown kid).
    let no_kid = cluster.sign(&json!({"alg": "RS256"}), &claims_of(&good));
    // An unknown kid under the real key: the API server has no key by that id.
    let rotated = cluster.sign(
        &json!({"alg": "RS256", "kid": "rotated-out"}),
        &claims_of(&good),
    );
    // A Failed pod still exists for TokenReview, but leaves the pod index.
    let failed_uid = k.pod(&ns, "failed", "app", "node-a").await;
    let failed = k
        .token(&ns, "app", Some(("failed", &failed_uid)), "istio-ca")
        .await;
    k.set_phase(&ns, "failed", "Failed").await;
    let n = ns.clone();
    for srv in [&t.local, &t.both] {
        let n = n.clone();
        srv.wait_index("p0 in, failed out", move |s| {
            s.get(&n, "p0").is_some() && s.get(&n, "failed").is_none()
        })
        .await;
    }
    let keys = t.both.app.issuer_keys.clone().unwrap();
    let fetched_before = keys.stats.ok.load(std::sync::atomic::Ordering::SeqCst);
    for (token, reason) in [
        (&second_issuer, "token_local_unknown_issuer"),
        (&failed, "token_local_pod_not_indexed"),
    ] {
        // The API server's informers may lag the new pods by a moment.
        let mut review = verdict(&t.review, token, &id).await;
        let settle = Instant::now() + Duration::from_secs(20);
        while !review.0 && Instant::now() < settle {
            tokio::time::sleep(Duration::from_millis(200)).await;
            review = verdict(&t.review, token, &id).await;
        }
        assert!(review.0, "TokenReview accepts it: {review:?}");
        let both = verdict(&t.both, token, &id).await;
        assert!(both.0, "{reason}: {both:?}");
        assert_eq!(both.2.as_deref(), Some("review"));
        assert_eq!(both.3.as_deref(), Some(reason));
        let local = verdict(&t.local, token, &id).await;
        assert!(!local.0, "local alone refuses {reason}");
        assert!(local.1.starts_with(reason), "{local:?}");
    }
    // Without a kid, local verification tries each key as the API server
    // does: decided locally in both local modes, no TokenReview.
    for srv in [&t.local, &t.both] {
        let v = verdict(srv, &no_kid, &id).await;
        assert!(v.0, "{v:?}");
        assert_eq!(v.2.as_deref(), Some("local"), "{v:?}");
    }
    // Unknown kids do not turn into key fetches beyond the minimum interval (30 s).
    for _ in 0..5 {
        verdict(&t.both, &rotated, &id).await;
    }
    assert_eq!(
        keys.stats.ok.load(std::sync::atomic::Ordering::SeqCst),
        fetched_before,
        "no fetch within the minimum interval"
    );
    assert!(keys.stats.skipped.load(std::sync::atomic::Ordering::SeqCst) >= 5);

    // An index that never syncs (no permission to list pods): TokenReview decides.
    let noindex = k.kubeconfig_without_pod_access().await;
    let both = server(&k, TokenVerificationMode::LocalThenReview, noindex.clone()).await;
    keys_loaded(&both).await;
    let v = verdict(&both, &good, &id).await;
    assert!(v.0, "{v:?}");
    assert_eq!(v.3.as_deref(), Some("token_local_index_not_synced"));
    let local = server(&k, TokenVerificationMode::Local, noindex).await;
    keys_loaded(&local).await;
    let r = local.call(&good, &id, None, None).await;
    assert_eq!(r.unwrap_err().code(), Code::Unavailable, "retryable");
    assert_eq!(local.last_reason(), "token_local_index_not_synced");
    // A fallback whose review refuses: an unknown kid under the real key
    // (the API server has no key by that id either).
    let v = verdict(&t.both, &rotated, &id).await;
    assert!(!v.0, "{v:?}");
    assert!(!verdict(&t.review, &rotated, &id).await.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pods_token_is_refused_once_the_index_shows_the_deletion() {
    let k = kte().await;
    let srv = server(&k, TokenVerificationMode::Local, k.meshca_kubeconfig()).await;
    keys_loaded(&srv).await;
    let ns = k.namespace("lag").await;
    k.service_account(&ns, "app").await;
    let id = spiffe(&ns, "app");
    let index = srv.app.pod_index.clone().unwrap();
    let mut lags = Vec::new();
    let mut refusals = Vec::new();
    for i in 0..5 {
        let name = format!("p{i}");
        let uid = k.pod(&ns, &name, "app", "node-a").await;
        let token = k.token(&ns, "app", Some((&name, &uid)), "istio-ca").await;
        let (n, p) = (ns.clone(), name.clone());
        srv.wait_index("pod", move |s| s.get(&n, &p).is_some())
            .await;
        srv.call(&token, &id, None, None).await.unwrap();
        // Watch the index closely while the delete goes through.
        let (idx, n, p) = (index.clone(), ns.clone(), name.clone());
        let watcher = tokio::spawn(async move {
            let t0 = Instant::now();
            while idx.read(|s| s.get(&n, &p).is_some()) {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "index never dropped the pod"
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Instant::now()
        });
        let t0 = Instant::now();
        k.delete_pod(&ns, &name).await;
        let deleted_at = Instant::now();
        let gone_at = watcher.await.unwrap();
        // The first request after the index shows the deletion is refused.
        let r = srv.call(&token, &id, None, None).await;
        assert_eq!(r.unwrap_err().code(), Code::Unauthenticated);
        assert_eq!(srv.last_reason(), "token_local_pod_not_indexed");
        lags.push(gone_at.saturating_duration_since(deleted_at));
        refusals.push(Instant::now().saturating_duration_since(t0));
    }
    lags.sort();
    eprintln!(
        "index lag after the DELETE returned: {lags:?}; delete call to refusal: {refusals:?}"
    );
}
