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
    let (zt_uid, zt_token) = k.pod_token(&zt_ns, ZT_SA, "ztunnel-a", node).await;
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

/// Pod `app-0` (service account `app`) on node-a in a fresh namespace; the
/// ztunnel on node-a is allowed its identity. Returns (namespace, identity).
async fn app_allowed_on_node_a(k: &Kte, srv: &Server, zt_token: &str) -> (String, String) {
    let ns = k.namespace("app").await;
    k.service_account(&ns, "app").await;
    workload(k, &ns, "app", "app-0", "node-a").await;
    let n = ns.clone();
    srv.wait_index("app-0", move |s| s.get(&n, "app-0").is_some())
        .await;
    let id = spiffe(&ns, "app");
    srv.call(zt_token, &id, Some(&id), Some("Kubernetes"))
        .await
        .unwrap();
    (ns, id)
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
        reasons.contains(&reason.as_str()),
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
    let rec = srv.audit.requests().last().cloned().unwrap();
    assert!(rec.impersonated && rec.authn_method.as_deref() == Some("token-review"));
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
    let (ns, id) = app_allowed_on_node_a(&k, &srv, &zt_token).await;

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
    let (_, id) = app_allowed_on_node_a(&k, &srv, &zt_token).await;

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

    // Expired (beyond the API server's leeway): dropped by the pre-check, never reviewed.
    let expired = k.expired_token(&ns, "app").await;
    let r = srv.call(&expired, &id, None, None).await;
    assert_denied(r, &srv, Code::Unauthenticated, &["token_expired"]);
    assert!(
        srv.audit
            .requests()
            .last()
            .unwrap()
            .detail
            .as_deref()
            .unwrap()
            .contains("expired"),
        "{:?}",
        srv.audit.requests().last()
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
    assert_denied(r, &srv, Code::Unauthenticated, &["token_malformed"]);

    let good = k.token(&ns, "app", Some(("app-0", &uid)), "istio-ca").await;
    let r = srv
        .call(&good, &id, None, Some("some-remote-cluster"))
        .await;
    assert_denied(r, &srv, Code::Unauthenticated, &["token_unknown_cluster"]);
    // No token response ever leaks the reason.
    for r in srv.audit.requests() {
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
    let rec = srv.audit.requests().last().cloned().unwrap();
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
    let (_, token) = k.pod_token(&zt_ns, ZT_SA, "ztunnel-a", "node-a").await;
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

/// Runs the real `meshca serve` binary at trace log level against the test
/// cluster, drives token, impersonation and mTLS requests (good and bad),
/// then scans every byte it wrote (stdout audit stream, stderr logs) for the
/// bearer tokens, the kubeconfig credential and the CA private key.
#[tokio::test]
async fn no_secret_appears_in_any_log_line_or_audit_record() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let k = kte().await;
    let zt_ns = k.namespace("zt").await;
    let (_, zt_token) = k.pod_token(&zt_ns, ZT_SA, "ztunnel-a", "node-a").await;
    let ns = k.namespace("app").await;
    k.service_account(&ns, "app").await;
    let app_uid = workload(&k, &ns, "app", "app-0", "node-a").await;
    let app_token = k
        .token(&ns, "app", Some(("app-0", &app_uid)), "istio-ca")
        .await;
    let wrong_aud = k
        .token(&ns, "app", Some(("app-0", &app_uid)), "not-istio")
        .await;
    let pki = TestPki::new(KeyType::EcdsaP256);

    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_meshca"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--serving-names",
            "localhost",
        ])
        .arg("--ca-dir")
        .arg(pki.path())
        .arg("--kubeconfig")
        .arg(k.meshca_kubeconfig())
        .args(["--trusted-node-accounts", &format!("{zt_ns}/{ZT_SA}")])
        .env("RUST_LOG", "trace")
        .env("LOG_FORMAT", "json")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let collected = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let (addr_tx, addr_rx) = tokio::sync::oneshot::channel::<String>();
    let mut addr_tx = Some(addr_tx);
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let c1 = collected.clone();
    let err_task = tokio::spawn(async move {
        while let Ok(Some(line)) = stderr.next_line().await {
            if let Some(rest) = line.strip_prefix("listening on ") {
                if let Some(tx) = addr_tx.take() {
                    let _ = tx.send(rest.split(' ').next().unwrap_or_default().to_string());
                }
            }
            c1.lock().unwrap().push_str(&line);
            c1.lock().unwrap().push('\n');
        }
    });
    let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
    let audit_lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let a1 = audit_lines.clone();
    let out_task = tokio::spawn(async move {
        while let Ok(Some(line)) = stdout.next_line().await {
            a1.lock().unwrap().push(line);
        }
    });
    let addr: std::net::SocketAddr =
        tokio::time::timeout(std::time::Duration::from_secs(30), addr_rx)
            .await
            .unwrap()
            .unwrap()
            .parse()
            .unwrap();

    let call = |token: String, id: String, imp: Option<String>| {
        let root = pki.ca.root_cert.clone();
        async move {
            let mut c = meshca::testing::client(addr, &root, None).await.unwrap();
            let key = rcgen::KeyPair::generate().unwrap();
            let meta: Vec<(&str, prost_types::Value)> = imp
                .map(|i| ("ImpersonatedIdentity", meshca::testing::string_value(&i)))
                .into_iter()
                .collect();
            let mut req = tonic::Request::new(meshca::testing::request(
                meshca::testing::csr_for(&key, &id),
                0,
                &meta,
            ));
            req.metadata_mut()
                .insert("authorization", format!("Bearer {token}").parse().unwrap());
            req.metadata_mut()
                .insert("clusterid", "Kubernetes".parse().unwrap());
            c.create_certificate(req).await.map(|_| ())
        }
    };
    let app_id = spiffe(&ns, "app");
    // The index syncs asynchronously after start; retry the first allow briefly.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while call(zt_token.clone(), app_id.clone(), Some(app_id.clone()))
        .await
        .is_err()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "impersonation never allowed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    call(app_token.clone(), app_id.clone(), None).await.unwrap();
    call(wrong_aud.clone(), app_id.clone(), None)
        .await
        .unwrap_err();
    let far = spiffe(&ns, "far");
    call(zt_token.clone(), far.clone(), Some(far))
        .await
        .unwrap_err();
    call(app_token.clone(), spiffe(&ns, "other"), None)
        .await
        .unwrap_err();

    // Clean shutdown writes the final checkpoint.
    let pid = child.id().unwrap();
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(20), child.wait())
        .await
        .unwrap()
        .unwrap();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), err_task).await;
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), out_task).await;

    let logs = collected.lock().unwrap().clone();
    let audit = audit_lines.lock().unwrap().join("\n");
    assert!(
        logs.len() > 10_000,
        "trace logging produced output ({} bytes)",
        logs.len()
    );
    assert!(
        audit
            .lines()
            .filter(|l| l.contains("\"type\":\"audit\""))
            .count()
            >= 5,
        "{audit}"
    );
    let kubeconfig = std::fs::read_to_string(k.meshca_kubeconfig()).unwrap();
    let kube_token = kubeconfig
        .lines()
        .find_map(|l| l.trim().strip_prefix("token: "))
        .unwrap()
        .trim()
        .to_string();
    let mut secrets: Vec<(String, String)> = vec![("kubeconfig token".into(), kube_token)];
    for (name, t) in [
        ("ztunnel token", &zt_token),
        ("app token", &app_token),
        ("wrong-audience token", &wrong_aud),
    ] {
        secrets.push((name.into(), t.clone()));
        // The signature alone is the secret part of a JWT.
        secrets.push((
            format!("{name} signature"),
            t.rsplit('.').next().unwrap().to_string(),
        ));
    }
    for (i, line) in pki
        .ca
        .ca_key
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .enumerate()
    {
        secrets.push((format!("CA key line {i}"), line.to_string()));
    }
    for (name, secret) in &secrets {
        assert!(secret.len() >= 16, "{name} is a meaningful needle");
        assert!(
            !logs.contains(secret.as_str()),
            "{name} leaked into the logs"
        );
        assert!(
            !audit.contains(secret.as_str()),
            "{name} leaked into the audit stream"
        );
    }
    // The stdout stream is a complete, verifiable chain ending in a checkpoint.
    let lines: Vec<(String, String)> = audit
        .lines()
        .enumerate()
        .map(|(i, l)| (format!("stdout:{}", i + 1), l.to_string()))
        .collect();
    let report = meshca::audit::verify::verify_lines(&lines, None).unwrap();
    assert_eq!(report.unsigned_tail, 0, "shutdown checkpoint written");
    assert_eq!(
        report.records,
        audit
            .lines()
            .filter(|l| l.contains("\"type\":\"audit\""))
            .count() as u64
    );
}

#[tokio::test]
async fn mtls_node_proxy_impersonates_by_source_ip_only_when_enabled() {
    use meshca::ca::CaBundle;
    let k = kte().await;
    let zt_ns = k.namespace("zt").await;
    k.service_account(&zt_ns, ZT_SA).await;
    k.pod(&zt_ns, "ztunnel-a", ZT_SA, "node-a").await;
    // No kubelet runs, so give the ztunnel pod the address the test client
    // connects from, as the kubelet would report its pod IP.
    k.set_pod_ip(&zt_ns, "ztunnel-a", "127.0.0.1").await;
    let ns = k.namespace("app").await;
    k.service_account(&ns, "app").await;
    k.service_account(&ns, "far").await;
    workload(&k, &ns, "app", "app-0", "node-a").await;
    workload(&k, &ns, "far", "far-0", "node-b").await;
    let app = spiffe(&ns, "app");
    let far = spiffe(&ns, "far");
    let zt_id = spiffe(&zt_ns, ZT_SA);

    for enabled in [false, true] {
        let pki = TestPki::new(KeyType::EcdsaP256);
        let bundle = CaBundle::load_dir(pki.path(), time::OffsetDateTime::now_utc()).unwrap();
        let (cert, key) = meshca::testing::client_identity(
            &bundle,
            &zt_id,
            &meshca::testing::validity_hours(-1, 1),
        );
        let mut cfg =
            common::kube_config(&pki, k.meshca_kubeconfig(), &[format!("{zt_ns}/{ZT_SA}")]);
        cfg.mtls_impersonation = enabled;
        let srv = start(cfg, pki).await;
        let (zn, n) = (zt_ns.clone(), ns.clone());
        srv.wait_index("pods with IPs", move |s| {
            s.get(&zn, "ztunnel-a")
                .is_some_and(|p| !p.pod_ips.is_empty())
                && s.get(&n, "far-0").is_some()
        })
        .await;
        let mut c =
            meshca::testing::client(srv.app.addr, &srv.pki.ca.root_cert, Some((&cert, &key)))
                .await
                .unwrap();
        let ask = |id: &str| {
            let key = rcgen::KeyPair::generate().unwrap();
            let meta = [("ImpersonatedIdentity", meshca::testing::string_value(id))];
            let mut req = tonic::Request::new(meshca::testing::request(
                meshca::testing::csr_for(&key, id),
                0,
                &meta,
            ));
            req.metadata_mut()
                .insert("clusterid", "Kubernetes".parse().unwrap());
            req
        };
        let r = c.create_certificate(ask(&app)).await;
        if enabled {
            let chain = r.unwrap().into_inner().cert_chain;
            assert_eq!(leaf_uri(&chain[0]), app);
            let rec = srv.audit.requests().last().cloned().unwrap();
            assert_eq!(rec.authn_method.as_deref(), Some("mtls"));
            assert_eq!(rec.node.as_deref(), Some("node-a"));
            let r = c.create_certificate(ask(&far)).await;
            assert_eq!(r.unwrap_err().code(), Code::Unauthenticated);
            assert_eq!(srv.last_reason(), "impersonation_no_pod_on_node");
        } else {
            assert_eq!(r.unwrap_err().code(), Code::Unauthenticated);
            assert_eq!(srv.last_reason(), "impersonation_no_pod_binding");
        }
    }
}

#[tokio::test]
async fn serve_with_root_publishing_writes_the_root_configmap() {
    use k8s_openapi::api::core::v1::ConfigMap;
    let k = kte().await;
    let label = common::unique("pub");
    let selected = k.namespace("sel").await;
    let other = k.namespace("unsel").await;
    k.label_namespace(&selected, "meshca-test", &label).await;
    let pki = TestPki::new(KeyType::EcdsaP256);
    // The admin identity stands in for the chart's publisher RBAC (tests/rootpub.rs
    // runs the publisher with exactly those rules).
    let mut cfg = common::kube_config(&pki, k.dir.join("admin.kubeconfig"), &[]);
    cfg.root_publisher = Some(meshca::rootpub::RootPublisherSettings {
        configmap_name: "istio-ca-root-cert".into(),
        namespace_selector: Some(format!("meshca-test={label}")),
        resync: std::time::Duration::from_secs(600),
    });
    let srv = start(cfg, pki).await;
    let cms = kube::Api::<ConfigMap>::namespaced(k.admin.clone(), &selected);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let cm = loop {
        if let Some(cm) = cms.get_opt("istio-ca-root-cert").await.unwrap() {
            break cm;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "ConfigMap never published"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(cm.data.unwrap()["root-cert.pem"], srv.pki.ca.root_cert);
    let unselected = kube::Api::<ConfigMap>::namespaced(k.admin.clone(), &other);
    assert!(unselected
        .get_opt("istio-ca-root-cert")
        .await
        .unwrap()
        .is_none());
}
