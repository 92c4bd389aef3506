//! ServiceAccount signing keys on the real API server (Kubernetes 1.37).
//!
//! A leaked signing key: the claims of a real pod-bound ztunnel token are
//! re-signed with the API server's own ServiceAccount key (`pki/sa.key` of
//! kube-testenv) under a header with no `kid` and under one with a wrong
//! `kid`, and each token goes through a `review`, a `local` and a
//! `local-then-review` server, before and after `token-key KID` is written
//! to their denylist. The verdicts must agree across the modes. The review
//! server keeps its TokenReview cache on: a success it cached before the
//! entry must not outlive it.
//!
//! A removed key: the issuer keys' maximum age, with the key fetches made
//! to fail (the server's user loses `system:service-account-issuer-discovery`)
//! while the watches stay healthy: `local` refuses retryably and
//! `local-then-review` asks TokenReview, and both return to local
//! verification when the fetches work again.
//!
//! The table the first test prints is in docs/SECURITY.md.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine;
use common::{kte, spiffe, start, unique, Kte, Server};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleRef, Subject};
use kube::api::{DeleteParams, PostParams};
use kube::Api;
use meshca::authn::local::TokenVerificationMode;
use meshca::ca::generate::KeyType;
use meshca::testing::TestPki;
use serde_json::json;

const MODES: [TokenVerificationMode; 3] = [
    TokenVerificationMode::Review,
    TokenVerificationMode::Local,
    TokenVerificationMode::LocalThenReview,
];

fn b64_json(segment: &str) -> serde_json::Value {
    serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(segment)
            .unwrap(),
    )
    .unwrap()
}

/// A server in `mode` reading its denylist from `deny` (polled every
/// 200 ms), with the default TokenReview success cache (60 s), once its
/// issuer keys are loaded.
async fn server(mode: TokenVerificationMode, kubeconfig: PathBuf, deny: &Path) -> Server {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let mut cfg = common::kube_config(&pki, kubeconfig, &[]);
    cfg.kill_switch.renewal_pod_check = true;
    cfg.kube.as_mut().unwrap().token_verification.mode = mode;
    cfg.kill_switch.denylist = meshca::denylist::DenylistSettings {
        file: Some(deny.to_path_buf()),
        poll: Duration::from_millis(200),
        configmap: None,
    };
    let srv = start(cfg, pki).await;
    if let Some(keys) = srv.app.issuer_keys.clone() {
        let deadline = Instant::now() + Duration::from_secs(30);
        while keys.current().is_none() {
            assert!(Instant::now() < deadline, "issuer keys never loaded");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    srv
}

/// (allowed, reason, verified by) of one request as `id`.
async fn verdict(srv: &Server, token: &str, id: &str) -> (bool, String, String) {
    let ok = srv.call(token, id, None, None).await.is_ok();
    let r = srv.audit.records().last().cloned().unwrap();
    let by = match (r.token_verified_by, r.token_local_fallback) {
        (Some(by), Some(after)) => format!("{by} after {after}"),
        (Some(by), None) => by,
        (None, _) => String::new(),
    };
    (ok, r.reason, by)
}

struct Row {
    case: String,
    verdicts: Vec<(bool, String, String)>,
}

fn table(rows: &[Row]) -> String {
    let mut out =
        String::from("| case | review | local | local-then-review |\n|---|---|---|---|\n");
    for r in rows {
        let cells: Vec<String> = r
            .verdicts
            .iter()
            .map(|(ok, reason, by)| match (ok, reason.is_empty()) {
                (true, _) => format!("allow ({by})"),
                (false, false) => format!("refuse (`{reason}`)"),
                (false, true) => "refuse".to_string(),
            })
            .collect();
        out.push_str(&format!("| {} | {} |\n", r.case, cells.join(" | ")));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kidless_and_wrong_kid_tokens_of_a_denylisted_key_are_refused_in_every_mode() {
    let k = kte().await;
    let dir = tempfile::tempdir().unwrap();
    let deny = dir.path().join("denylist");
    std::fs::write(&deny, "").unwrap();
    let mut servers = Vec::new();
    for mode in MODES {
        servers.push(server(mode, k.meshca_kubeconfig(), &deny).await);
    }
    let ns = k.namespace("leak").await;
    let (_, real) = k.pod_token(&ns, "ztunnel", "ztunnel-a", "node-a").await;
    let id = spiffe(&ns, "ztunnel");
    let mut parts = real.split('.');
    let header = b64_json(parts.next().unwrap());
    let claims = b64_json(parts.next().unwrap());
    let kid = header["kid"].as_str().unwrap().to_string();
    assert!(
        claims["kubernetes.io"]["pod"]["uid"].is_string(),
        "a pod-bound token"
    );
    // The same claims, re-signed with the API server's own key.
    let kidless = k.sign_claims(&json!({"alg": "RS256"}), &claims);
    let wrong_kid = k.sign_claims(
        &json!({"alg": "RS256", "kid": "not-a-key-of-this-issuer"}),
        &claims,
    );
    for srv in &servers[1..] {
        let n = ns.clone();
        srv.wait_index("the ztunnel pod", move |s| s.get(&n, "ztunnel-a").is_some())
            .await;
    }
    let cases = [
        ("the API server's own token (control)", &real),
        ("no `kid`, signed by the API server's key", &kidless),
        ("a wrong `kid`, signed by the API server's key", &wrong_kid),
    ];
    let mut rows = Vec::new();
    for (case, token) in cases {
        let mut verdicts = Vec::new();
        for srv in &servers {
            verdicts.push(verdict(srv, token, &id).await);
        }
        rows.push(Row {
            case: format!("{case}, before `token-key`"),
            verdicts,
        });
    }

    // The key leaks: its kid goes on the denylist of all three servers.
    std::fs::write(&deny, format!("token-key {kid}\n")).unwrap();
    for srv in &servers {
        let deadline = Instant::now() + Duration::from_secs(10);
        while srv.call(&real, &id, None, None).await.is_ok() {
            assert!(Instant::now() < deadline, "the entry never took effect");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let reviewer = servers[0].app.token_reviewer.clone().unwrap();
    let hits = || reviewer.hits.load(std::sync::atomic::Ordering::SeqCst);
    let mut kidless_from_cache = false;
    for (case, token) in cases {
        let mut verdicts = Vec::new();
        for srv in &servers {
            let before = hits();
            verdicts.push(verdict(srv, token, &id).await);
            if std::ptr::eq(srv, &servers[0]) && token == &kidless {
                kidless_from_cache = hits() == before + 1;
            }
        }
        rows.push(Row {
            case: format!("{case}, after `token-key`"),
            verdicts,
        });
    }
    eprintln!("{}", table(&rows));

    let allowed = |r: &Row| r.verdicts.iter().map(|v| v.0).collect::<Vec<_>>();
    // Before: the API server accepts the kid-less token (it tries every key)
    // and refuses the wrong kid (no key has it); local verification agrees.
    assert_eq!(allowed(&rows[0]), [true; 3], "{}", rows[0].case);
    assert_eq!(
        allowed(&rows[1]),
        [true; 3],
        "{}: {:?}",
        rows[1].case,
        rows[1].verdicts
    );
    assert_eq!(
        allowed(&rows[2]),
        [false; 3],
        "{}: {:?}",
        rows[2].case,
        rows[2].verdicts
    );
    // After: refused in every mode; the key's own signature names it.
    for r in &rows[3..] {
        assert_eq!(allowed(r), [false; 3], "{}: {:?}", r.case, r.verdicts);
    }
    for r in &rows[3..5] {
        for (mode, v) in MODES.iter().zip(&r.verdicts) {
            assert_eq!(v.1, "denylist_token_key", "{} x {mode:?}: {v:?}", r.case);
        }
    }
    // The review server answered the kid-less token from the success it
    // cached before the entry, and refused it all the same.
    assert!(
        kidless_from_cache,
        "the kid-less token was not served from the cache"
    );
}

/// A kubeconfig for a new client-certificate user (the test cluster's CA
/// signs it) bound to the `meshca` ClusterRole and, through the returned
/// ClusterRoleBinding, to `system:service-account-issuer-discovery` (a user
/// that is no ServiceAccount reads the issuer keys only through it).
async fn user_kubeconfig(k: &Kte) -> (PathBuf, ClusterRoleBinding) {
    let user = unique("jwks-user");
    let pki = k.dir.join("pki");
    let ca_pem = std::fs::read_to_string(pki.join("ca.crt")).unwrap();
    let ca_key =
        rcgen::KeyPair::from_pem(&std::fs::read_to_string(pki.join("ca.key")).unwrap()).unwrap();
    let issuer = rcgen::Issuer::from_ca_cert_pem(&ca_pem, ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, user.as_str());
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - Duration::from_secs(3600);
    params.not_after = now + Duration::from_secs(86_400);
    let cert = params.signed_by(&key, &issuer).unwrap();
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let mut kc: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(k.meshca_kubeconfig()).unwrap()).unwrap();
    kc["users"][0]["user"] = serde_yaml_ng::to_value(json!({
        "client-certificate-data": b64(&cert.pem()),
        "client-key-data": b64(&key.serialize_pem()),
    }))
    .unwrap();
    let path = k.dir.join(format!("{user}.kubeconfig"));
    std::fs::write(&path, serde_yaml_ng::to_string(&kc).unwrap()).unwrap();
    let bind = |name: String, role: &str| ClusterRoleBinding {
        metadata: kube::api::ObjectMeta {
            name: Some(name),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: role.into(),
        },
        subjects: Some(vec![Subject {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "User".into(),
            name: user.clone(),
            ..Default::default()
        }]),
    };
    let api = Api::<ClusterRoleBinding>::all(k.admin.clone());
    api.create(&PostParams::default(), &bind(user.clone(), "meshca"))
        .await
        .unwrap();
    let discovery = bind(
        format!("{user}-discovery"),
        "system:service-account-issuer-discovery",
    );
    api.create(&PostParams::default(), &discovery)
        .await
        .unwrap();
    (path, discovery)
}

/// Polls `srv` with `token` (every 200 ms) until `done` holds for its
/// verdict, or fails after `within`; returns the verdict and how long it took.
async fn until(
    srv: &Server,
    token: &str,
    id: &str,
    within: Duration,
    what: &str,
    done: impl Fn(&(bool, String, String)) -> bool,
) -> ((bool, String, String), Duration) {
    let start = Instant::now();
    loop {
        let v = verdict(srv, token, id).await;
        if done(&v) {
            return (v, start.elapsed());
        }
        assert!(
            start.elapsed() < within,
            "{what}: still {v:?} after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn metric(srv: &Server, series: &str) -> f64 {
    let (_, body) = meshca::testing::http_get(srv.app.admin_addr, "/metrics").await;
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issuer_keys_past_their_maximum_age_verify_nothing_locally() {
    let k = kte().await;
    let (kubeconfig, discovery) = user_kubeconfig(&k).await;
    let policy = meshca::authn::jwks::RefreshPolicy {
        interval: Duration::from_secs(1),
        min_interval: Duration::from_secs(1),
        timeout: Duration::from_secs(3),
        max_age: Duration::from_secs(3),
    };
    let mut servers = Vec::new();
    for mode in [
        TokenVerificationMode::Local,
        TokenVerificationMode::LocalThenReview,
    ] {
        let pki = TestPki::new(KeyType::EcdsaP256);
        let mut cfg = common::kube_config(&pki, kubeconfig.clone(), &[]);
        let kube = cfg.kube.as_mut().unwrap();
        kube.token_verification.mode = mode;
        kube.token_verification.refresh = policy;
        let srv = start(cfg, pki).await;
        servers.push(srv);
    }
    let ns = k.namespace("keys-age").await;
    let (_, token) = k.pod_token(&ns, "ztunnel", "ztunnel-a", "node-a").await;
    let id = spiffe(&ns, "ztunnel");
    for srv in &servers {
        until(
            srv,
            &token,
            &id,
            Duration::from_secs(30),
            "verified locally at first",
            |v| v.0 && v.2 == "local",
        )
        .await;
    }
    // The fetches fail from now on; the pod and ServiceAccount watches do not.
    let api = Api::<ClusterRoleBinding>::all(k.admin.clone());
    let name = discovery.metadata.name.clone().unwrap();
    api.delete(&name, &DeleteParams::default()).await.unwrap();
    let bound = policy.max_age + policy.min_interval + Duration::from_secs(10);
    let (local, took) = until(
        &servers[0],
        &token,
        &id,
        bound,
        "local, fetches failing",
        |v| !v.0,
    )
    .await;
    assert_eq!(local.1, "token_local_keys_stale", "{local:?}");
    let (both, _) = until(
        &servers[1],
        &token,
        &id,
        bound,
        "local-then-review, fetches failing",
        |v| v.2.starts_with("review after"),
    )
    .await;
    assert_eq!(
        both,
        (
            true,
            "issued".into(),
            "review after token_local_keys_stale".into()
        )
    );
    let failed = metric(&servers[0], "meshca_jwks_fetches_total{result=\"failed\"}").await;
    let stale = metric(
        &servers[0],
        "meshca_token_local_outcomes_total{reason=\"token_local_keys_stale\"}",
    )
    .await;
    assert!(
        failed >= 1.0 && stale >= 1.0,
        "failed fetches {failed}, stale refusals {stale}"
    );
    eprintln!(
        "local refused token_local_keys_stale {took:?} after the fetches began failing (max age {:?}); {failed} failed fetches, {stale} stale refusals",
        policy.max_age
    );
    // The fetches work again: both verify locally again.
    let mut again = discovery.clone();
    again.metadata.resource_version = None;
    api.create(&PostParams::default(), &again).await.unwrap();
    for srv in &servers {
        until(
            srv,
            &token,
            &id,
            Duration::from_secs(20),
            "back to local",
            |v| v.0 && v.2 == "local",
        )
        .await;
    }
    for n in [name.as_str(), name.trim_end_matches("-discovery")] {
        api.delete(n, &DeleteParams::default()).await.unwrap();
    }
}
