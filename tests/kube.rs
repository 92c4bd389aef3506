//! Token callers, the pod index and node authorization against a real
//! kube-apiserver + etcd (started by scripts/kube-testenv), with real
//! pod-bound tokens minted by the TokenRequest API.
#![allow(clippy::unwrap_used)]

mod common;

use common::{kte, leaf_uri, spiffe, start, Kte, Server};
use meshca::ca::generate::KeyType;
use meshca::testing::TestPki;
use tonic::Code;

const ZT_SA: &str = "ztunnel";

/// A ztunnel pod on `node` in a fresh namespace, a meshca trusting it, and its token.
struct Setup {
    k: Kte,
    srv: Server,
    zt_ns: String,
    zt_token: String,
    zt_uid: String,
}

async fn setup(node: &str) -> Setup {
    let k = kte().await;
    let zt_ns = k.namespace("zt").await;
    k.service_account(&zt_ns, ZT_SA).await;
    let zt_uid = k.pod(&zt_ns, "ztunnel-a", ZT_SA, node).await;
    let zt_token = k
        .token(&zt_ns, ZT_SA, Some(("ztunnel-a", &zt_uid)), "istio-ca")
        .await;
    let pki = TestPki::new(KeyType::EcdsaP256);
    let cfg = common::kube_config(&pki, k.meshca_kubeconfig(), &[format!("{zt_ns}/{ZT_SA}")]);
    let srv = start(cfg, pki).await;
    let (ns, uid) = (zt_ns.clone(), zt_uid.clone());
    srv.wait_index("ztunnel pod", move |s| {
        s.get(&ns, "ztunnel-a").is_some_and(|p| *p.uid == *uid)
    })
    .await;
    Setup {
        k,
        srv,
        zt_ns,
        zt_token,
        zt_uid,
    }
}

/// A workload namespace with service account `sa` and pod `name` on `node`.
async fn workload(k: &Kte, ns: &str, sa: &str, name: &str, node: &str) -> String {
    k.pod(ns, name, sa, node).await
}

fn assert_denied(
    r: Result<Vec<String>, tonic::Status>,
    srv: &Server,
    code: Code,
    reasons: &[&str],
) {
    let s = r.expect_err("request must be denied");
    assert_eq!(s.code(), code, "{s:?}");
    let reason = srv.last_reason();
    assert!(
        reasons.contains(&reason),
        "reason {reason}, expected one of {reasons:?}"
    );
}

#[tokio::test]
async fn ztunnel_impersonates_only_workloads_on_its_node() {
    let Setup {
        k, srv, zt_token, ..
    } = setup("node-a").await;
    let ns = k.namespace("app").await;
    k.service_account(&ns, "app").await;
    k.service_account(&ns, "far").await;
    workload(&k, &ns, "app", "app-0", "node-a").await;
    workload(&k, &ns, "far", "far-0", "node-b").await;
    let n = ns.clone();
    srv.wait_index("workloads", move |s| {
        s.get(&n, "app-0").is_some() && s.get(&n, "far-0").is_some()
    })
    .await;

    let app_id = spiffe(&ns, "app");
    let chain = srv
        .call(&zt_token, &app_id, Some(&app_id), Some("Kubernetes"))
        .await
        .unwrap();
    assert_eq!(
        leaf_uri(&chain[0]),
        app_id,
        "issued for the impersonated identity"
    );
    let rec = srv.audit.records().last().cloned().unwrap();
    assert!(rec.impersonated && rec.authn_method == Some("token-review"));
    assert_eq!(rec.node.as_deref(), Some("node-a"));
    assert!(
        rec.evidence
            .as_deref()
            .unwrap()
            .starts_with(&format!("{ns}/app-0")),
        "{rec:?}"
    );

    let far_id = spiffe(&ns, "far");
    let r = srv
        .call(&zt_token, &far_id, Some(&far_id), Some("Kubernetes"))
        .await;
    assert_denied(
        r,
        &srv,
        Code::Unauthenticated,
        &["impersonation_no_pod_on_node"],
    );

    // Without the clusterid header istiod never impersonates; neither do we.
    let r = srv.call(&zt_token, &app_id, Some(&app_id), None).await;
    assert_denied(
        r,
        &srv,
        Code::Unauthenticated,
        &["impersonation_unknown_cluster"],
    );
}

#[tokio::test]
async fn deleted_workload_pod_stops_authorizing_once_the_watch_delivers_it() {
    let Setup {
        k, srv, zt_token, ..
    } = setup("node-a").await;
    let ns = k.namespace("app").await;
    k.service_account(&ns, "app").await;
    workload(&k, &ns, "app", "app-0", "node-a").await;
    let n = ns.clone();
    srv.wait_index("app-0", move |s| s.get(&n, "app-0").is_some())
        .await;
    let id = spiffe(&ns, "app");
    srv.call(&zt_token, &id, Some(&id), Some("Kubernetes"))
        .await
        .unwrap();

    k.delete_pod(&ns, "app-0").await;
    let n = ns.clone();
    srv.wait_index("app-0 deleted", move |s| s.get(&n, "app-0").is_none())
        .await;
    let r = srv
        .call(&zt_token, &id, Some(&id), Some("Kubernetes"))
        .await;
    assert_denied(
        r,
        &srv,
        Code::Unauthenticated,
        &["impersonation_no_pod_on_node"],
    );
}

#[tokio::test]
async fn recreated_caller_pod_with_same_name_is_denied() {
    let Setup {
        k,
        srv,
        zt_ns,
        zt_token,
        zt_uid,
    } = setup("node-a").await;
    let ns = k.namespace("app").await;
    k.service_account(&ns, "app").await;
    workload(&k, &ns, "app", "app-0", "node-a").await;
    let n = ns.clone();
    srv.wait_index("app-0", move |s| s.get(&n, "app-0").is_some())
        .await;
    let id = spiffe(&ns, "app");
    srv.call(&zt_token, &id, Some(&id), Some("Kubernetes"))
        .await
        .unwrap();

    k.delete_pod(&zt_ns, "ztunnel-a").await;
    let new_uid = k.pod(&zt_ns, "ztunnel-a", ZT_SA, "node-a").await;
    assert_ne!(new_uid, zt_uid);
    let (zn, nu) = (zt_ns.clone(), new_uid.clone());
    srv.wait_index("recreated ztunnel", move |s| {
        s.get(&zn, "ztunnel-a").is_some_and(|p| *p.uid == *nu)
    })
    .await;
    // The old token names the old UID: denied either by our node authorizer
    // (UID mismatch, while the API server's 10 s success cache still accepts
    // the token) or by the TokenReview itself once that cache has expired.
    let r = srv
        .call(&zt_token, &id, Some(&id), Some("Kubernetes"))
        .await;
    assert_denied(
        r,
        &srv,
        Code::Unauthenticated,
        &[
            "impersonation_caller_pod_uid_mismatch",
            "token_not_authenticated",
        ],
    );
    // A token for the new pod works again.
    let fresh = k
        .token(&zt_ns, ZT_SA, Some(("ztunnel-a", &new_uid)), "istio-ca")
        .await;
    srv.call(&fresh, &id, Some(&id), Some("Kubernetes"))
        .await
        .unwrap();
}

#[tokio::test]
async fn untrusted_caller_foreign_domain_malformed_identity_and_succeeded_pods_are_denied() {
    let Setup {
        k, srv, zt_token, ..
    } = setup("node-a").await;
    let ns = k.namespace("app").await;
    k.service_account(&ns, "app").await;
    k.service_account(&ns, "done").await;
    let app_uid = workload(&k, &ns, "app", "app-0", "node-a").await;
    workload(&k, &ns, "done", "done-0", "node-a").await;
    k.set_phase(&ns, "done-0", "Succeeded").await;
    let n = ns.clone();
    srv.wait_index("pods", move |s| {
        s.get(&n, "app-0").is_some()
            && s.get(&n, "done-0")
                .is_some_and(|p| p.phase == meshca::podindex::Phase::Succeeded)
    })
    .await;
    let id = spiffe(&ns, "app");

    // An application pod's own token on the same node is not a node proxy.
    let app_token = k
        .token(&ns, "app", Some(("app-0", &app_uid)), "istio-ca")
        .await;
    let r = srv
        .call(&app_token, &id, Some(&id), Some("Kubernetes"))
        .await;
    assert_denied(
        r,
        &srv,
        Code::Unauthenticated,
        &["impersonation_caller_not_trusted"],
    );

    let foreign = format!("spiffe://evil.example/ns/{ns}/sa/app");
    let r = srv
        .call(&zt_token, &foreign, Some(&foreign), Some("Kubernetes"))
        .await;
    assert_denied(
        r,
        &srv,
        Code::Unauthenticated,
        &["impersonation_foreign_trust_domain"],
    );

    for bad in [
        "not-a-spiffe-id",
        "spiffe://cluster.local/ns/x",
        "spiffe://cluster.local/ns/a,b/sa/c",
    ] {
        let r = srv
            .call(&zt_token, &id, Some(bad), Some("Kubernetes"))
            .await;
        assert_denied(
            r,
            &srv,
            Code::Unauthenticated,
            &["impersonation_invalid_identity"],
        );
    }

    let done = spiffe(&ns, "done");
    let r = srv
        .call(&zt_token, &done, Some(&done), Some("Kubernetes"))
        .await;
    assert_denied(
        r,
        &srv,
        Code::Unauthenticated,
        &["impersonation_no_pod_on_node"],
    );

    // The same ztunnel is fine for the running pod.
    srv.call(&zt_token, &id, Some(&id), Some("Kubernetes"))
        .await
        .unwrap();
}

#[tokio::test]
async fn bad_tokens_are_unauthenticated() {
    let Setup { k, srv, .. } = setup("node-a").await;
    let ns = k.namespace("app").await;
    k.service_account(&ns, "app").await;
    let uid = workload(&k, &ns, "app", "app-0", "node-a").await;
    let id = spiffe(&ns, "app");

    let wrong_aud = k
        .token(&ns, "app", Some(("app-0", &uid)), "some-other-audience")
        .await;
    let r = srv.call(&wrong_aud, &id, None, None).await;
    assert_denied(r, &srv, Code::Unauthenticated, &["token_not_authenticated"]);

    let expired = k.expired_token(&ns, "app").await;
    let r = srv.call(&expired, &id, None, None).await;
    assert_denied(r, &srv, Code::Unauthenticated, &["token_not_authenticated"]);
    assert!(
        srv.audit
            .records()
            .last()
            .unwrap()
            .detail
            .as_deref()
            .unwrap()
            .contains("expired"),
        "{:?}",
        srv.audit.records().last()
    );

    // Minted for a pod that is then deleted, never reviewed before: invalid.
    let doomed_uid = workload(&k, &ns, "app", "doomed", "node-a").await;
    let doomed = k
        .token(&ns, "app", Some(("doomed", &doomed_uid)), "istio-ca")
        .await;
    k.delete_pod(&ns, "doomed").await;
    let r = srv.call(&doomed, &id, None, None).await;
    assert_denied(r, &srv, Code::Unauthenticated, &["token_not_authenticated"]);

    let r = srv.call("not.a.jwt", &id, None, None).await;
    assert_denied(r, &srv, Code::Unauthenticated, &["token_not_authenticated"]);

    let good = k.token(&ns, "app", Some(("app-0", &uid)), "istio-ca").await;
    let r = srv
        .call(&good, &id, None, Some("some-remote-cluster"))
        .await;
    assert_denied(r, &srv, Code::Unauthenticated, &["token_unknown_cluster"]);
    // No token response ever leaks the reason.
    for r in srv.audit.records() {
        assert!(!r.detail.clone().unwrap_or_default().contains(&good));
    }
}

#[tokio::test]
async fn sidecar_token_gets_exactly_its_own_identity_and_reviews_are_cached() {
    let Setup { k, srv, .. } = setup("node-a").await;
    let ns = k.namespace("app").await;
    k.service_account(&ns, "app").await;
    let uid = workload(&k, &ns, "app", "app-0", "node-a").await;
    let token = k.token(&ns, "app", Some(("app-0", &uid)), "istio-ca").await;
    let id = spiffe(&ns, "app");

    let chain = srv
        .call(&token, &id, None, Some("Kubernetes"))
        .await
        .unwrap();
    assert_eq!(leaf_uri(&chain[0]), id);
    let rec = srv.audit.records().last().cloned().unwrap();
    assert_eq!(
        rec.caller_pod.as_deref(),
        Some(format!("{ns}/app-0").as_str())
    );
    assert_eq!(rec.caller_pod_uid.as_deref(), Some(uid.as_str()));
    assert_eq!(
        rec.node.as_deref(),
        Some("node-a"),
        "node from the token's node-name extra"
    );

    let other = spiffe(&ns, "admin");
    let r = srv.call(&token, &other, None, None).await;
    assert_denied(r, &srv, Code::InvalidArgument, &["csr_san_not_authorized"]);

    let reviewer = srv.app.token_reviewer.as_ref().unwrap();
    let (h0, m0) = (
        reviewer.hits.load(std::sync::atomic::Ordering::Relaxed),
        reviewer.misses.load(std::sync::atomic::Ordering::Relaxed),
    );
    srv.call(&token, &id, None, None).await.unwrap();
    assert_eq!(
        reviewer.hits.load(std::sync::atomic::Ordering::Relaxed),
        h0 + 1,
        "warm cache hit"
    );
    assert_eq!(
        reviewer.misses.load(std::sync::atomic::Ordering::Relaxed),
        m0
    );

    // The bound pod disappears: the cached review is dropped and the token re-reviewed.
    k.delete_pod(&ns, "app-0").await;
    let n = ns.clone();
    srv.wait_index("app-0 deleted", move |s| s.get(&n, "app-0").is_none())
        .await;
    let _ = srv.call(&token, &id, None, None).await;
    assert_eq!(
        reviewer.misses.load(std::sync::atomic::Ordering::Relaxed),
        m0 + 1,
        "evicted entry re-reviewed"
    );
}

#[tokio::test]
async fn impersonation_before_the_index_syncs_is_unavailable_and_not_ready() {
    let k = kte().await;
    let zt_ns = k.namespace("zt").await;
    k.service_account(&zt_ns, ZT_SA).await;
    let uid = k.pod(&zt_ns, "ztunnel-a", ZT_SA, "node-a").await;
    let token = k
        .token(&zt_ns, ZT_SA, Some(("ztunnel-a", &uid)), "istio-ca")
        .await;
    // This identity may review tokens but not list pods: the index never syncs.
    let kubeconfig = k.kubeconfig_without_pod_access().await;
    let pki = TestPki::new(KeyType::EcdsaP256);
    let srv = start(
        common::kube_config(&pki, kubeconfig, &[format!("{zt_ns}/{ZT_SA}")]),
        pki,
    )
    .await;

    assert_eq!(srv.readyz().await, 503);
    let id = spiffe("any", "app");
    let r = srv.call(&token, &id, Some(&id), Some("Kubernetes")).await;
    assert_denied(
        r,
        &srv,
        Code::Unavailable,
        &["impersonation_index_not_ready"],
    );
    // Its own identity needs no index.
    let own = spiffe(&zt_ns, ZT_SA);
    srv.call(&token, &own, None, None).await.unwrap();
}

#[tokio::test]
async fn least_privilege_kubeconfig_cannot_do_more() {
    let k = kte().await;
    let meshca = common::client(&k.meshca_kubeconfig()).await;
    let ns = k.namespace("rbac").await;
    use k8s_openapi::api::core::v1::{Pod, Secret};
    kube::Api::<Pod>::all(meshca.clone())
        .list(&Default::default())
        .await
        .expect("may list pods");
    let err = kube::Api::<Secret>::namespaced(meshca.clone(), &ns)
        .list(&Default::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 403),
        "{err:?}"
    );
    k.service_account(&ns, "app").await;
    let uid = k.pod(&ns, "p", "app", "node-a").await;
    let _ = uid;
    let err = kube::Api::<Pod>::namespaced(meshca, &ns)
        .delete("p", &Default::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref s) if s.code == 403),
        "{err:?}"
    );
}
