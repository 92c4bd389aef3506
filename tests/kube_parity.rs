//! Trust parity on the real API server: every case runs through a `review`
//! server (TokenReview, the reference), a `local` server and a
//! `local-then-review` server, and all three must reach the same verdict.
//! The cases are the ways a bound token is voided in Kubernetes: its
//! ServiceAccount deleted and recreated, or deleting (held by a finalizer)
//! before and after the API server's one-minute leeway; its pod deleting the
//! same way, deleted, or recreated under the same name; and the claims an
//! API server refuses (expired, issued in the future, wrong audience).
//! The table this prints is in docs/SECURITY.md.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use common::{kte, spiffe, start, Kte, Server};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::Api;
use meshca::authn::local::TokenVerificationMode;
use meshca::ca::generate::KeyType;
use meshca::podindex::accounts::AccountIndex;
use meshca::testing::TestPki;
use serde_json::json;

const FINALIZER: &str = "meshca.test/hold";

fn now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

fn kid_of(token: &str) -> String {
    let h = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token.split('.').next().unwrap())
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&h).unwrap();
    v["kid"].as_str().unwrap().to_string()
}

async fn server(mode: TokenVerificationMode, k: &Kte, cache: Duration) -> Server {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let mut cfg = common::kube_config(&pki, k.meshca_kubeconfig(), &[]);
    // The pod index runs in every mode (as with the chart's defaults), so a
    // review server can check its cached successes against it.
    cfg.kill_switch.renewal_pod_check = true;
    let kube = cfg.kube.as_mut().unwrap();
    kube.token_cache_ttl = cache;
    kube.token_verification.mode = mode;
    let srv = start(cfg, pki).await;
    if mode.uses_local() {
        let keys = srv.app.issuer_keys.clone().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while keys.current().is_none() {
            assert!(Instant::now() < deadline, "issuer keys never loaded");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    srv
}

fn accounts(srv: &Server) -> Arc<AccountIndex> {
    accounts_of(srv).expect("the ServiceAccount index runs beside the pod index")
}

fn accounts_of(srv: &Server) -> Option<Arc<AccountIndex>> {
    srv.app.clusters.as_ref().unwrap().local().accounts.clone()
}

/// Waits until the ServiceAccount index satisfies `f`.
async fn wait_accounts(
    srv: &Server,
    what: &str,
    f: impl Fn(&meshca::podindex::accounts::AccountState) -> bool,
) {
    let a = accounts(srv);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(a.is_synced() && a.read(&f)) {
        assert!(
            Instant::now() < deadline,
            "account index never showed: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn service_account(k: &Kte, ns: &str, name: &str, held: bool) -> String {
    let mut meta = json!({"name": name});
    if held {
        meta["finalizers"] = json!([FINALIZER]);
    }
    let sa: ServiceAccount = serde_json::from_value(json!({ "metadata": meta })).unwrap();
    Api::<ServiceAccount>::namespaced(k.admin.clone(), ns)
        .create(&PostParams::default(), &sa)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap()
}

/// Deletes with no grace: a finalizer keeps the object, with
/// `deletionTimestamp` = now. Returns that timestamp.
async fn delete_now<K>(api: &Api<K>, name: &str) -> i64
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    api.delete(name, &dp).await.unwrap();
    let obj = api.get(name).await.unwrap();
    obj.meta()
        .deletion_timestamp
        .as_ref()
        .expect("held by its finalizer")
        .0
        .as_second()
}

async fn release<K>(api: &Api<K>, name: &str)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let patch = json!({"metadata": {"finalizers": null}});
    let _ = api
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await;
}

struct Servers {
    review: Server,
    local: Server,
    both: Server,
}

/// (allowed, reason) of one request as `id`.
async fn verdict(srv: &Server, token: &str, id: &str) -> (bool, String) {
    let ok = srv.call(token, id, None, None).await.is_ok();
    (ok, srv.last_reason())
}

struct Row {
    case: &'static str,
    want: bool,
    review: (bool, String),
    local: (bool, String),
    both: (bool, String),
}

/// Runs one case through the three servers. TokenReview is the reference:
/// it is asked again (up to 20 s) while the API server's own caches settle.
async fn run(s: &Servers, case: &'static str, token: &str, id: &str, want: bool) -> Row {
    let mut review = verdict(&s.review, token, id).await;
    let settle = Instant::now() + Duration::from_secs(20);
    while review.0 != want && Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(250)).await;
        review = verdict(&s.review, token, id).await;
    }
    Row {
        case,
        want,
        local: verdict(&s.local, token, id).await,
        both: verdict(&s.both, token, id).await,
        review,
    }
}

fn table(rows: &[Row]) -> String {
    let v = |b: bool| if b { "allow" } else { "refuse" };
    let mut out =
        String::from("| case | review | local | local-then-review |\n|---|---|---|---|\n");
    for r in rows {
        out.push_str(&format!(
            "| {} | {} (`{}`) | {} (`{}`) | {} (`{}`) |\n",
            r.case,
            v(r.review.0),
            r.review.1,
            v(r.local.0),
            r.local.1,
            v(r.both.0),
            r.both.1
        ));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_verification_refuses_what_tokenreview_refuses() {
    let k = kte().await;
    let s = Servers {
        review: server(TokenVerificationMode::Review, &k, Duration::ZERO).await,
        local: server(TokenVerificationMode::Local, &k, Duration::ZERO).await,
        both: server(TokenVerificationMode::LocalThenReview, &k, Duration::ZERO).await,
    };
    // A review server with a long success cache: a cached review must not
    // outlive what a new review would refuse (ten minutes, so no entry
    // expires on its own while the test waits out the leeway).
    let cached = server(TokenVerificationMode::Review, &k, Duration::from_secs(600)).await;
    assert!(
        cached.app.pod_index.is_some(),
        "the cache is checked against the pod index"
    );
    let ns = k.namespace("parity").await;
    let pods = Api::<Pod>::namespaced(k.admin.clone(), &ns);
    let sas = Api::<ServiceAccount>::namespaced(k.admin.clone(), &ns);
    let app = spiffe(&ns, "app");

    // Objects and tokens, all minted before anything changes.
    service_account(&k, &ns, "app", false).await;
    let live = k.pod(&ns, "live", "app", "node-a").await;
    let good = k.token(&ns, "app", Some(("live", &live)), "istio-ca").await;
    let kid = kid_of(&good);
    let sa_uid = k.service_account_uid(&ns, "app").await;
    let n = now();
    let expired = k.signed_token_with_kid(
        Some(&kid),
        &ns,
        "app",
        &sa_uid,
        Some(("live", &live)),
        n - 7200,
        n - 3600,
    );
    // Valid from now on (nbf), but issued (iat) an hour from now.
    let future = {
        let mut c = serde_json::from_slice::<serde_json::Value>(
            &base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(good.split('.').nth(1).unwrap())
                .unwrap(),
        )
        .unwrap();
        c["nbf"] = json!(n - 10);
        c["iat"] = json!(n + 3600);
        k.sign_claims(&json!({"alg": "RS256", "kid": kid}), &c)
    };
    let wrong_aud = k
        .token(&ns, "app", Some(("live", &live)), "other-audience")
        .await;
    // Deleted and recreated ServiceAccount (its pod stays).
    service_account(&k, &ns, "recreated-sa", false).await;
    let p = k
        .pod(&ns, "of-recreated-sa", "recreated-sa", "node-a")
        .await;
    let recreated_sa = k
        .token(
            &ns,
            "recreated-sa",
            Some(("of-recreated-sa", &p)),
            "istio-ca",
        )
        .await;
    // A ServiceAccount deleting, held by a finalizer.
    service_account(&k, &ns, "held-sa", true).await;
    let p = k.pod(&ns, "of-held-sa", "held-sa", "node-a").await;
    let held_sa = k
        .token(&ns, "held-sa", Some(("of-held-sa", &p)), "istio-ca")
        .await;
    // A pod deleting, held by a finalizer.
    let p = k
        .pod_with_finalizers(&ns, "held", "app", "node-a", &[FINALIZER])
        .await;
    let held = k.token(&ns, "app", Some(("held", &p)), "istio-ca").await;
    // A deleted pod, and a pod recreated under the same name.
    let p = k.pod(&ns, "deleted", "app", "node-a").await;
    let deleted = k.token(&ns, "app", Some(("deleted", &p)), "istio-ca").await;
    let p = k.pod(&ns, "recreated", "app", "node-a").await;
    let recreated = k
        .token(&ns, "app", Some(("recreated", &p)), "istio-ca")
        .await;

    // The cached reviewer learns the held pod's token while it is live, and
    // the tokens of the ServiceAccounts about to be recreated and deleted.
    let held_sa_id = spiffe(&ns, "held-sa");
    let recreated_sa_id = spiffe(&ns, "recreated-sa");
    cached.call(&held, &app, None, None).await.unwrap();
    cached
        .call(&recreated_sa, &recreated_sa_id, None, None)
        .await
        .unwrap();
    cached
        .call(&held_sa, &held_sa_id, None, None)
        .await
        .unwrap();

    // The changes.
    let sa_deleted_at = delete_now(&sas, "held-sa").await;
    let pod_deleted_at = delete_now(&pods, "held").await;
    sas.delete("recreated-sa", &DeleteParams::default())
        .await
        .unwrap();
    let new_sa_uid = service_account(&k, &ns, "recreated-sa", false).await;
    k.delete_pod(&ns, "deleted").await;
    k.delete_pod(&ns, "recreated").await;
    let new_pod_uid = k.pod(&ns, "recreated", "app", "node-a").await;

    // The local servers' indexes show every change before they are asked.
    for srv in [&s.local, &s.both] {
        let (n1, u) = (ns.clone(), new_pod_uid.clone());
        srv.wait_index("pod changes", move |st| {
            st.get(&n1, "deleted").is_none()
                && st.get(&n1, "recreated").is_some_and(|p| *p.uid == *u)
                && st
                    .get(&n1, "held")
                    .is_some_and(|p| p.deletion_timestamp.is_some())
        })
        .await;
        let (n1, u) = (ns.clone(), new_sa_uid.clone());
        wait_accounts(srv, "account changes", move |st| {
            st.get(&n1, "recreated-sa").is_some_and(|a| a.uid == u)
                && st
                    .get(&n1, "held-sa")
                    .is_some_and(|a| a.deletion_timestamp.is_some())
        })
        .await;
    }
    {
        let n1 = ns.clone();
        cached
            .wait_index("held pod deleting", move |st| {
                st.get(&n1, "held")
                    .is_some_and(|p| p.deletion_timestamp.is_some())
            })
            .await;
    }
    // The review server checks its cached successes against a
    // ServiceAccount index too (asserted at the end, so that without one the
    // verdicts below show what goes wrong).
    let cached_has_accounts = accounts_of(&cached).is_some();
    if cached_has_accounts {
        let (n1, u) = (ns.clone(), new_sa_uid.clone());
        wait_accounts(&cached, "account changes", move |st| {
            st.get(&n1, "recreated-sa").is_some_and(|a| a.uid == u)
                && st
                    .get(&n1, "held-sa")
                    .is_some_and(|a| a.deletion_timestamp.is_some())
        })
        .await;
    }
    let mut rows = vec![
        run(&s, "good token (control)", &good, &app, true).await,
        run(
            &s,
            "ServiceAccount deleted and recreated",
            &recreated_sa,
            &recreated_sa_id,
            false,
        )
        .await,
        run(
            &s,
            "ServiceAccount deleting (finalizer), within the leeway",
            &held_sa,
            &held_sa_id,
            true,
        )
        .await,
        run(
            &s,
            "pod deleting (finalizer), within the leeway",
            &held,
            &app,
            true,
        )
        .await,
        run(&s, "pod deleted", &deleted, &app, false).await,
        run(
            &s,
            "pod recreated with the same name",
            &recreated,
            &app,
            false,
        )
        .await,
        run(&s, "expired token", &expired, &app, false).await,
        run(&s, "issued in the future", &future, &app, false).await,
        run(&s, "wrong audience", &wrong_aud, &app, false).await,
    ];
    let cached_before = verdict(&cached, &held, &app).await;
    let cached_sa_before = verdict(&cached, &held_sa, &held_sa_id).await;
    // The recreated ServiceAccount's cached success: the API server's own
    // token cache may still say authenticated for 10 s after the change.
    let mut cached_recreated = verdict(&cached, &recreated_sa, &recreated_sa_id).await;
    let settle = Instant::now() + Duration::from_secs(20);
    while cached_recreated.0 && Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(250)).await;
        cached_recreated = verdict(&cached, &recreated_sa, &recreated_sa_id).await;
    }

    // Past the leeway: the API server's rule is deletionTimestamp < now - 60 s.
    let due = sa_deleted_at.max(pod_deleted_at) + 61;
    while now() <= due {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    rows.push(
        run(
            &s,
            "ServiceAccount deleting (finalizer), past the leeway",
            &held_sa,
            &held_sa_id,
            false,
        )
        .await,
    );
    rows.push(
        run(
            &s,
            "pod deleting (finalizer), past the leeway",
            &held,
            &app,
            false,
        )
        .await,
    );
    let reviewer = cached.app.token_reviewer.clone().unwrap();
    let misses = reviewer.misses.load(std::sync::atomic::Ordering::SeqCst);
    let cached_after = verdict(&cached, &held, &app).await;
    let reviewed = reviewer.misses.load(std::sync::atomic::Ordering::SeqCst) - misses;
    let cached_sa_after = verdict(&cached, &held_sa, &held_sa_id).await;

    release(&pods, "held").await;
    release(&sas, "held-sa").await;
    let printed = table(&rows);
    eprintln!("{printed}");
    let cell = |(ok, reason): &(bool, String)| {
        format!("{} (`{reason}`)", if *ok { "allow" } else { "refuse" })
    };
    eprintln!(
        "| case | cached TokenReview success (review server, 10 min cache) |\n|---|---|\n\
         | pod deleting (finalizer), within the leeway | {} |\n\
         | pod deleting (finalizer), past the leeway | {} |\n\
         | ServiceAccount deleting (finalizer), within the leeway | {} |\n\
         | ServiceAccount deleting (finalizer), past the leeway | {} |\n\
         | ServiceAccount deleted and recreated | {} |",
        cell(&cached_before),
        cell(&cached_after),
        cell(&cached_sa_before),
        cell(&cached_sa_after),
        cell(&cached_recreated)
    );
    for r in &rows {
        assert_eq!(r.review.0, r.want, "review, {}: {:?}", r.case, r.review);
        assert_eq!(r.local.0, r.review.0, "local, {}: {:?}", r.case, r.local);
        assert_eq!(
            r.both.0, r.review.0,
            "local-then-review, {}: {:?}",
            r.case, r.both
        );
    }
    // Refusals that local verification decides name their own reason.
    let local_reason = |case: &str| {
        rows.iter()
            .find(|r| r.case == case)
            .map(|r| r.local.1.clone())
            .unwrap()
    };
    assert_eq!(
        local_reason("ServiceAccount deleted and recreated"),
        "token_local_sa_uid_mismatch"
    );
    assert_eq!(
        local_reason("ServiceAccount deleting (finalizer), past the leeway"),
        "token_local_sa_deleted"
    );
    assert_eq!(
        local_reason("pod deleting (finalizer), past the leeway"),
        "token_local_pod_deleted"
    );
    assert_eq!(
        local_reason("issued in the future"),
        "token_local_issued_in_future"
    );
    assert_eq!(local_reason("expired token"), "token_local_expired");
    assert!(
        cached_before.0,
        "cached review within the leeway: {cached_before:?}"
    );
    assert!(
        !cached_after.0,
        "a cached review past the leeway: {cached_after:?}"
    );
    assert_eq!(
        reviewed, 1,
        "the cached success was dropped and the token reviewed again"
    );
    assert!(
        cached_sa_before.0,
        "cached review, ServiceAccount within the leeway: {cached_sa_before:?}"
    );
    assert!(
        !cached_sa_after.0,
        "a cached review, ServiceAccount past the leeway: {cached_sa_after:?}"
    );
    assert!(
        !cached_recreated.0,
        "a cached review of a recreated ServiceAccount: {cached_recreated:?}"
    );
    assert!(
        cached_has_accounts,
        "the review server runs the ServiceAccount index"
    );
}

/// A leaked ServiceAccount signing key: with the chart's default
/// `local-then-review`, a ztunnel's pod-bound token that was just issued a
/// certificate (verified locally, no TokenReview) is refused on its next
/// request seconds after its `kid` is denylisted, the record names
/// `denylist_token_key`, and the audit file verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denylisted_signing_key_refuses_locally_verified_tokens_within_seconds() {
    use meshca::config::AuditSinkKind;
    let k = kte().await;
    let ns = k.namespace("leak").await;
    let (_, token) = k.pod_token(&ns, "ztunnel", "ztunnel-a", "node-a").await;
    let kid = kid_of(&token);
    let id = spiffe(&ns, "ztunnel");
    let dir = tempfile::tempdir().unwrap();
    let deny = dir.path().join("denylist");
    std::fs::write(&deny, "").unwrap();
    let audit = dir.path().join("audit.log");
    let pki = TestPki::new(KeyType::EcdsaP256);
    let mut cfg = common::kube_config(&pki, k.meshca_kubeconfig(), &[]);
    cfg.kube.as_mut().unwrap().token_verification.mode = TokenVerificationMode::LocalThenReview;
    cfg.audit.sink = AuditSinkKind::File;
    cfg.audit.file = audit.clone();
    cfg.kill_switch.denylist = meshca::denylist::DenylistSettings {
        file: Some(deny.clone()),
        poll: Duration::from_millis(200),
        configmap: None,
    };
    let app = meshca::app::App::start(&cfg, Default::default())
        .await
        .unwrap();
    let call = || async {
        let mut c = meshca::testing::client(app.addr, &pki.ca.root_cert, None)
            .await
            .unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut req = tonic::Request::new(meshca::testing::request(
            meshca::testing::csr_for(&key, &id),
            0,
            &[],
        ));
        req.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        c.create_certificate(req).await
    };
    // Issued, verified locally (the index and keys may take a moment at start).
    let deadline = Instant::now() + Duration::from_secs(30);
    while call().await.is_err() {
        assert!(
            Instant::now() < deadline,
            "never issued before the denylist"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let listed = Instant::now();
    std::fs::write(&deny, format!("token-key {kid}\n")).unwrap();
    let refused = loop {
        match call().await {
            Err(status) => break status,
            Ok(_) => {
                assert!(
                    listed.elapsed() < Duration::from_secs(10),
                    "still issued 10 s after the kid was denylisted"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let took = listed.elapsed();
    eprintln!("denylisted kid refused {took:?} after the file changed: {refused:?}");
    app.shutdown().await.unwrap();
    let lines = meshca::audit::verify::read_lines(&[&audit]).unwrap();
    let report = meshca::audit::verify::verify_lines(&lines, None).expect("the audit log verifies");
    assert_eq!(report.unsigned_tail, 0, "shutdown checkpoint written");
    let records: Vec<serde_json::Value> = lines
        .iter()
        .filter_map(|(_, l)| serde_json::from_slice::<serde_json::Value>(l).ok())
        .filter(|v| v["type"] == "audit" && v["caller_identity"] == json!(id))
        .collect();
    let issued = records
        .iter()
        .find(|r| r["decision"] == "allow")
        .expect("an issued record");
    assert_eq!(issued["token_verified_by"], "local");
    let denied = records.last().unwrap();
    assert_eq!(denied["decision"], "deny", "{denied}");
    assert_eq!(denied["reason"], "denylist_token_key", "{denied}");
    assert_eq!(denied["token_verified_by"], "local", "{denied}");
}
