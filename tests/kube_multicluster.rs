//! Multi-cluster against two real kube-apiservers with distinct
//! ServiceAccount issuers: meshca runs in the primary (`KTE_DIR`) and
//! learns the remote one (`KTE_REMOTE_DIR`) from an Istio remote secret in
//! its namespace, watched with exactly the chart's Role
//! (tests/fixtures/rbac-remote-secrets.yaml).
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::{kte, kte_remote, leaf_uri, spiffe, start, Ask, Kte, Server};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::{DeleteParams, PostParams};
use kube::Api;
use meshca::authn::local::TokenVerificationMode;
use meshca::ca::generate::KeyType;
use meshca::cluster::kubeconfig::KubeconfigPolicy;
use meshca::cluster::secrets::RemoteSecrets;
use meshca::testing::TestPki;
use tonic::Code;

const REMOTE: &str = "remote";
const LOCAL: &str = "Kubernetes";

/// Log lines of this test binary (the refused-kubeconfig test reads them).
fn logs() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        let _ = tracing_subscriber::fmt()
            .with_env_filter("meshca=info")
            .with_ansi(false)
            .with_writer(move || LogWriter(sink.clone()))
            .try_init();
        buf
    })
}

struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Both clusters, a meshca in the primary watching `secrets_ns`, and in the
/// remote cluster a ztunnel on node-r with its token, `app-0` on node-r and
/// `far-0` on node-x.
struct Mc {
    a: Kte,
    b: Kte,
    srv: Server,
    secrets_ns: String,
    zt_token: String,
    /// The remote ztunnel's namespace (its service account is trusted).
    zt_ns: String,
    app_id: String,
    far_id: String,
    far_ns: String,
}

async fn secrets_namespace(a: &Kte) -> String {
    let ns = a.namespace("mc").await;
    a.meshca_role(&ns, "tests/fixtures/rbac-remote-secrets.yaml")
        .await;
    ns
}

/// Creates or replaces the remote secret `name` with `data` (cluster id -> kubeconfig).
async fn put_secret(a: &Kte, ns: &str, name: &str, data: &[(&str, Vec<u8>)]) {
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([(
                "istio/multiCluster".to_string(),
                "true".to_string(),
            )])),
            ..Default::default()
        },
        data: Some(
            data.iter()
                .map(|(k, v)| (k.to_string(), ByteString(v.clone())))
                .collect(),
        ),
        ..Default::default()
    };
    let api = Api::<Secret>::namespaced(a.admin.clone(), ns);
    match api.get_opt(name).await.unwrap() {
        Some(old) => {
            let mut s = secret;
            s.metadata.resource_version = old.metadata.resource_version;
            api.replace(name, &PostParams::default(), &s).await.unwrap();
        }
        None => {
            api.create(&PostParams::default(), &secret).await.unwrap();
        }
    }
}

fn kubeconfig_of(k: &Kte) -> Vec<u8> {
    std::fs::read(k.meshca_kubeconfig()).unwrap()
}

async fn setup(mode: TokenVerificationMode) -> Mc {
    setup_with(mode, |_| {}).await
}

async fn setup_with(
    mode: TokenVerificationMode,
    edit: impl FnOnce(&mut meshca::config::Config),
) -> Mc {
    let _ = logs();
    let (a, b) = (kte().await, kte_remote().await);
    assert_ne!(a.issuer, b.issuer, "the two clusters need distinct issuers");
    let zt_ns = b.namespace("zt").await;
    let (_, zt_token) = b.pod_token(&zt_ns, "ztunnel", "ztunnel-r", "node-r").await;
    let app_ns = b.namespace("app").await;
    b.service_account(&app_ns, "app").await;
    b.service_account(&app_ns, "far").await;
    b.pod(&app_ns, "app-0", "app", "node-r").await;
    b.pod(&app_ns, "far-0", "far", "node-x").await;

    let secrets_ns = secrets_namespace(&a).await;
    put_secret(
        &a,
        &secrets_ns,
        "istio-remote-secret-remote",
        &[(REMOTE, kubeconfig_of(&b))],
    )
    .await;

    let pki = TestPki::new(KeyType::EcdsaP256);
    let mut cfg = common::kube_config(&pki, a.meshca_kubeconfig(), &[format!("{zt_ns}/ztunnel")]);
    cfg.kube.as_mut().unwrap().token_verification.mode = mode;
    cfg.multicluster.remote_secrets = Some(RemoteSecrets {
        namespace: secrets_ns.clone(),
        policy: KubeconfigPolicy::default(),
        max_clusters: 8,
        sync_timeout: Duration::from_secs(5),
    });
    edit(&mut cfg);
    let srv = start(cfg, pki).await;
    let ns = app_ns.clone();
    wait_remote(&srv, "remote pods", move |s| {
        s.get(&ns, "app-0").is_some() && s.get(&ns, "far-0").is_some()
    })
    .await;
    Mc {
        a,
        b,
        srv,
        secrets_ns,
        zt_token,
        zt_ns,
        app_id: spiffe(&app_ns, "app"),
        far_id: spiffe(&app_ns, "far"),
        far_ns: app_ns,
    }
}

/// Waits until the remote cluster is registered, synced and its index shows `f`.
async fn wait_remote(srv: &Server, what: &str, f: impl Fn(&meshca::podindex::IndexState) -> bool) {
    let registry = srv.app.clusters.clone().expect("cluster registry");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(c) = registry.get(REMOTE) {
            let index = c.index.as_ref().expect("remote pod index");
            if index.is_synced() && index.read(&f) {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "remote cluster never showed: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn denied(r: Result<Vec<String>, tonic::Status>, srv: &Server, code: Code, reason: &str) {
    let s = r.expect_err("request must be denied");
    assert_eq!(s.code(), code, "{s:?}");
    assert_eq!(srv.last_reason(), reason);
}

fn last_cluster(srv: &Server) -> Option<String> {
    srv.audit.records().last().unwrap().cluster_id.clone()
}

async fn metrics(srv: &Server) -> String {
    meshca::testing::http_get(srv.app.admin_addr, "/metrics")
        .await
        .1
}

#[tokio::test]
async fn remote_ztunnel_impersonates_only_on_its_node_in_its_cluster() {
    let Mc {
        a,
        srv,
        zt_token,
        app_id,
        far_id,
        far_ns,
        ..
    } = setup(TokenVerificationMode::Review).await;

    // On its node, in its cluster: allowed, and the record names the cluster.
    let chain = srv
        .call(&zt_token, &app_id, Some(&app_id), Some(REMOTE))
        .await
        .unwrap();
    assert_eq!(leaf_uri(&chain[0]), app_id);
    let rec = srv.audit.records().last().cloned().unwrap();
    assert_eq!(rec.cluster_id.as_deref(), Some(REMOTE));
    assert_eq!(rec.node.as_deref(), Some("node-r"));

    // Wrong node: far-0 runs on node-x.
    let r = srv
        .call(&zt_token, &far_id, Some(&far_id), Some(REMOTE))
        .await;
    denied(
        r,
        &srv,
        Code::Unauthenticated,
        "impersonation_no_pod_on_node",
    );

    // A pod of that identity on node-r in the *primary* cluster does not
    // count: impersonation never crosses clusters.
    let ns: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": far_ns}})).unwrap();
    Api::<k8s_openapi::api::core::v1::Namespace>::all(a.admin.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    a.service_account(&far_ns, "far").await;
    a.pod(&far_ns, "far-a", "far", "node-r").await;
    let local_index = srv.app.pod_index.clone().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !local_index.read(|s| s.get(&far_ns, "far-a").is_some()) {
        assert!(
            Instant::now() < deadline,
            "primary index never showed far-a"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = srv
        .call(&zt_token, &far_id, Some(&far_id), Some(REMOTE))
        .await;
    denied(
        r,
        &srv,
        Code::Unauthenticated,
        "impersonation_no_pod_on_node",
    );

    // Wrong cluster: the primary's API server does not know the remote token.
    let r = srv
        .call(&zt_token, &app_id, Some(&app_id), Some(LOCAL))
        .await;
    denied(r, &srv, Code::Unauthenticated, "token_not_authenticated");
    assert_eq!(last_cluster(&srv).as_deref(), Some(LOCAL));
    // An unregistered cluster: its own reason, and the label stays bounded.
    let r = srv
        .call(&zt_token, &app_id, Some(&app_id), Some("nowhere"))
        .await;
    denied(r, &srv, Code::Unauthenticated, "token_unknown_cluster");
    assert_eq!(last_cluster(&srv).as_deref(), Some("nowhere"));

    let m = metrics(&srv).await;
    for line in [
        "meshca_cluster_requests_total{cluster=\"remote\",decision=\"allow\"} 1",
        "meshca_cluster_requests_total{cluster=\"remote\",decision=\"deny\"} 2",
        "meshca_cluster_requests_total{cluster=\"unknown\",decision=\"deny\"} 1",
        "meshca_clusters{cluster=\"remote\"} 1",
        "meshca_cluster_synced{cluster=\"remote\"} 1",
        "meshca_cluster_synced{cluster=\"Kubernetes\"} 1",
    ] {
        assert!(m.lines().any(|l| l == line), "missing {line:?} in\n{m}");
    }
    assert!(!m.contains("nowhere"));
}

#[tokio::test]
async fn local_verification_takes_the_cluster_from_the_token() {
    let Mc {
        srv,
        zt_token,
        app_id,
        ..
    } = setup(TokenVerificationMode::Local).await;
    // The remote issuer's keys are fetched through the remote API server.
    let registry = srv.app.clusters.clone().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while registry
        .get(REMOTE)
        .and_then(|c| c.keys.as_ref().and_then(|k| k.current()))
        .is_none()
    {
        assert!(
            Instant::now() < deadline,
            "remote issuer keys never fetched"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    srv.call(&zt_token, &app_id, Some(&app_id), Some(REMOTE))
        .await
        .unwrap();
    let rec = srv.audit.records().last().cloned().unwrap();
    assert_eq!(rec.token_verified_by.as_deref(), Some("local"));
    assert_eq!(rec.cluster_id.as_deref(), Some(REMOTE));
    let ztunnel_id = rec.caller_identity.clone().unwrap();

    // istiod would send this token to the cluster the header names; here the
    // header must agree with the cluster whose keys verified the token.
    for header in [LOCAL, "nowhere"] {
        let r = srv
            .call(&zt_token, &app_id, Some(&app_id), Some(header))
            .await;
        denied(r, &srv, Code::Unauthenticated, "token_cluster_mismatch");
    }
    // Without a header the caller is still attributed to its cluster...
    srv.call(&zt_token, &ztunnel_id, None, None).await.unwrap();
    assert_eq!(last_cluster(&srv).as_deref(), Some(REMOTE));
    // ...but, as in istiod, impersonation needs the header.
    let r = srv.call(&zt_token, &app_id, Some(&app_id), None).await;
    denied(
        r,
        &srv,
        Code::Unauthenticated,
        "impersonation_unknown_cluster",
    );
}

#[tokio::test]
async fn rotating_and_removing_the_secret_take_effect_at_runtime() {
    let Mc {
        a,
        b,
        srv,
        secrets_ns,
        zt_token,
        app_id,
        ..
    } = setup(TokenVerificationMode::Review).await;
    srv.call(&zt_token, &app_id, Some(&app_id), Some(REMOTE))
        .await
        .unwrap();

    // Rotate to credentials that cannot list pods: the cluster's index never
    // syncs, so its impersonations are retryable, not silently denied.
    let no_pods = std::fs::read(b.kubeconfig_without_pod_access().await).unwrap();
    put_secret(
        &a,
        &secrets_ns,
        "istio-remote-secret-remote",
        &[(REMOTE, no_pods)],
    )
    .await;
    let (served, r) = poll(&srv, &zt_token, &app_id, |r| r.is_err()).await;
    denied(r, &srv, Code::Unavailable, "impersonation_index_not_ready");
    let m = metrics(&srv).await;
    let want = "meshca_cluster_synced{cluster=\"remote\"} 0";
    assert!(m.lines().any(|l| l == want), "missing {want:?} in\n{m}");
    // Until then the current entry kept serving (the pending swap waits up
    // to the 5 s sync timeout for the new one).
    assert!(served >= Duration::from_secs(4), "swapped after {served:?}");
    // And back.
    put_secret(
        &a,
        &secrets_ns,
        "istio-remote-secret-remote",
        &[(REMOTE, kubeconfig_of(&b))],
    )
    .await;
    poll(&srv, &zt_token, &app_id, |r| r.is_ok())
        .await
        .1
        .unwrap();

    // Removing the secret revokes the cluster's authorization.
    let t0 = Instant::now();
    Api::<Secret>::namespaced(a.admin.clone(), &secrets_ns)
        .delete("istio-remote-secret-remote", &DeleteParams::default())
        .await
        .unwrap();
    let (elapsed, r) = poll(&srv, &zt_token, &app_id, |r| r.is_err()).await;
    eprintln!(
        "remote secret deleted -> first refusal after {elapsed:?} (from the delete call: {:?})",
        t0.elapsed()
    );
    denied(r, &srv, Code::Unauthenticated, "token_unknown_cluster");
    assert!(srv.app.clusters.as_ref().unwrap().get(REMOTE).is_none());
    assert!(
        elapsed < Duration::from_secs(10),
        "revocation took {elapsed:?}"
    );
}

/// Calls every 20 ms until `done` holds (at most 30 s); the elapsed time and that result.
async fn poll(
    srv: &Server,
    token: &str,
    id: &str,
    done: impl Fn(&Result<Vec<String>, tonic::Status>) -> bool,
) -> (Duration, Result<Vec<String>, tonic::Status>) {
    let t0 = Instant::now();
    loop {
        let r = srv.call(token, id, Some(id), Some(REMOTE)).await;
        if done(&r) {
            return (t0.elapsed(), r);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no change after 30 s: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn an_exec_plugin_kubeconfig_is_refused_and_the_other_clusters_keep_working() {
    let Mc {
        a,
        b,
        srv,
        secrets_ns,
        zt_token,
        app_id,
        ..
    } = setup(TokenVerificationMode::Review).await;
    let marker = b.dir.join(format!("exec-ran-{}", common::unique("m")));
    let mut evil: serde_yaml_ng::Value = serde_yaml_ng::from_slice(&kubeconfig_of(&b)).unwrap();
    evil["users"][0]["user"] = serde_yaml_ng::to_value(serde_json::json!({
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": "/bin/sh",
            "args": ["-c", format!("touch {}", marker.display())],
            "interactiveMode": "Never",
        }
    }))
    .unwrap();
    put_secret(
        &a,
        &secrets_ns,
        "istio-remote-secret-evil",
        &[(
            "evil",
            serde_yaml_ng::to_string(&evil).unwrap().into_bytes(),
        )],
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let needle = "remote kubeconfig refused";
    let line = loop {
        let text = String::from_utf8_lossy(&logs().lock().unwrap()).to_string();
        if let Some(l) = text
            .lines()
            .find(|l| l.contains(needle) && l.contains("evil"))
        {
            break l.to_string();
        }
        assert!(
            Instant::now() < deadline,
            "no refusal logged for the exec kubeconfig"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("log line: {line}");
    assert!(
        line.contains("remote_kubeconfig_exec") && line.contains("/bin/sh"),
        "{line}"
    );
    assert!(srv.app.clusters.as_ref().unwrap().get("evil").is_none());
    assert!(!marker.exists(), "the exec plugin ran");
    let m = metrics(&srv).await;
    let want = "meshca_remote_kubeconfig_refused_total{reason=\"remote_kubeconfig_exec\"} 1";
    assert!(m.lines().any(|l| l == want), "missing {want:?} in\n{m}");

    // The remote cluster and the primary keep working.
    srv.call(&zt_token, &app_id, Some(&app_id), Some(REMOTE))
        .await
        .unwrap();
    let r = srv
        .call(&zt_token, &app_id, Some(&app_id), Some("evil"))
        .await;
    denied(r, &srv, Code::Unauthenticated, "token_unknown_cluster");
    let ns = a.namespace("local").await;
    a.service_account(&ns, "app").await;
    let uid = a.pod(&ns, "app-0", "app", "node-a").await;
    let token = a.token(&ns, "app", Some(("app-0", &uid)), "istio-ca").await;
    let id = spiffe(&ns, "app");
    srv.wait_index("local app-0", |s| s.get(&ns, "app-0").is_some())
        .await;
    srv.call(&token, &id, None, None).await.unwrap();
    assert_eq!(last_cluster(&srv).as_deref(), Some(LOCAL));
}

/// One mTLS CreateCertificate for `id` with a client certificate for it.
async fn renew(srv: &Server, id: &str) -> Result<Vec<String>, tonic::Status> {
    let cert = common::client_cert(&srv.pki, id, 3600);
    mtls_call(srv, &cert, id, None, None).await
}

/// Bounded renewal looks for a live pod in the cluster the certificate was
/// issued for: app-0 runs only in the remote cluster, so a certificate the
/// remote ztunnel got for app renews, and one of the primary cluster (no
/// cluster mark) does not, though the identity is the same.
#[tokio::test]
async fn bounded_mtls_renewal_counts_live_pods_in_the_certificates_cluster() {
    let Mc {
        srv,
        zt_token,
        app_id,
        far_ns,
        ..
    } = setup_with(TokenVerificationMode::Review, |cfg| {
        cfg.kill_switch.renewal_pod_check = true;
    })
    .await;
    let remote_cert = issued_by_token(&srv, &zt_token, &app_id, Some(&app_id), REMOTE).await;
    mtls_call(&srv, &remote_cert, &app_id, None, None)
        .await
        .unwrap();
    let rec = srv.audit.records().last().cloned().unwrap();
    assert_eq!(rec.renewal_check.as_deref(), Some("pod_live"));
    assert_eq!(rec.cluster_id.as_deref(), Some(REMOTE));
    // The same identity from a primary-cluster certificate: no live pod there.
    let e = renew(&srv, &app_id).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert_eq!(srv.last_reason(), "renewal_no_live_pod");
    assert_eq!(last_cluster(&srv).as_deref(), Some(LOCAL));
    // An identity with no pod in any cluster does not.
    let ghost = spiffe(&far_ns, "ghost");
    let e = renew(&srv, &ghost).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert_eq!(srv.last_reason(), "renewal_no_live_pod");
}

/// An mTLS CreateCertificate presenting `cert` for a CSR of `id`, optionally
/// impersonating, with an optional `clusterid` header.
async fn mtls_call(
    srv: &Server,
    cert: &(String, String),
    id: &str,
    impersonate: Option<&str>,
    cluster: Option<&str>,
) -> Result<Vec<String>, tonic::Status> {
    let ask = Ask {
        cert: Some(cert),
        impersonate,
        cluster,
        ..Default::default()
    };
    srv.ask(id, ask).await.0
}

/// A certificate the server issued for `id` to a token caller of cluster
/// `cluster` (optionally impersonating), with its key: what that caller holds.
async fn issued_by_token(
    srv: &Server,
    token: &str,
    id: &str,
    impersonate: Option<&str>,
    cluster: &str,
) -> (String, String) {
    let ask = Ask {
        token: Some(token),
        impersonate,
        cluster: Some(cluster),
        ..Default::default()
    };
    let (chain, k) = srv.ask(id, ask).await;
    let chain = chain.unwrap();
    (chain[..chain.len() - 1].concat(), k.serialize_pem())
}

/// An mTLS caller may not pick the cluster whose pod index authorizes it.
/// Pod networks of two clusters often overlap: here the remote cluster's
/// ztunnel has the caller's address. A ztunnel certificate of the primary
/// cluster, sent with `clusterid: remote`, must not impersonate the remote
/// cluster's workloads; a certificate the remote cluster's ztunnel got
/// with its own token may, and only with its own cluster in the header.
/// The record names the certificate's cluster, never the header's.
#[tokio::test]
async fn mtls_callers_are_bound_to_the_cluster_their_certificate_was_issued_for() {
    let Mc {
        b,
        srv,
        zt_token,
        zt_ns,
        app_id,
        ..
    } = setup_with(TokenVerificationMode::Review, |cfg| {
        cfg.mtls_impersonation = true;
    })
    .await;
    // The remote ztunnel's pod runs at the caller's address (overlapping pod networks).
    b.set_pod_ip(&zt_ns, "ztunnel-r", "127.0.0.1").await;
    let ns = zt_ns.clone();
    wait_remote(&srv, "ztunnel-r at 127.0.0.1", move |s| {
        s.with_ip("127.0.0.1".parse().unwrap())
            .any(|p| *p.namespace == *ns)
    })
    .await;
    let zt_id = spiffe(&zt_ns, "ztunnel");

    // A primary-cluster ztunnel certificate (no cluster mark: the local
    // cluster, as every certificate issued before the mark existed).
    let bundle =
        meshca::ca::CaBundle::load_dir(srv.pki.path(), time::OffsetDateTime::now_utc()).unwrap();
    let local_cert =
        meshca::testing::client_identity(&bundle, &zt_id, &meshca::testing::validity_hours(-1, 1));
    let r = mtls_call(&srv, &local_cert, &app_id, Some(&app_id), Some(REMOTE)).await;
    denied(r, &srv, Code::Unauthenticated, "mtls_cluster_mismatch");
    assert_eq!(
        last_cluster(&srv).as_deref(),
        Some(LOCAL),
        "the verified cluster"
    );

    // The remote ztunnel's own certificate, issued through its token.
    let remote_cert = issued_by_token(&srv, &zt_token, &zt_id, None, REMOTE).await;
    assert_eq!(last_cluster(&srv).as_deref(), Some(REMOTE));
    let chain = mtls_call(&srv, &remote_cert, &app_id, Some(&app_id), Some(REMOTE))
        .await
        .unwrap();
    assert_eq!(leaf_uri(&chain[0]), app_id);
    let rec = srv.audit.records().last().cloned().unwrap();
    assert_eq!(rec.cluster_id.as_deref(), Some(REMOTE));
    assert_eq!(rec.node.as_deref(), Some("node-r"));
    let r = mtls_call(&srv, &remote_cert, &app_id, Some(&app_id), Some(LOCAL)).await;
    denied(r, &srv, Code::Unauthenticated, "mtls_cluster_mismatch");
    assert_eq!(last_cluster(&srv).as_deref(), Some(REMOTE));
    let m = metrics(&srv).await;
    assert!(
        m.lines()
            .any(|l| l
                == "meshca_decisions_total{decision=\"deny\",reason=\"mtls_cluster_mismatch\"} 2"),
        "{m}"
    );
}

/// A remote cluster's leaked signing key: the remote ztunnel's token
/// claims re-signed with the remote API server's key and no `kid` are
/// accepted by that cluster's TokenReview; once the remote key's `kid` is
/// denylisted they are refused (`denylist_token_key`), found by their
/// signature among the remote issuer's keys. The primary cluster's callers,
/// whose signer is the primary's own key, keep getting certificates.
#[tokio::test]
async fn a_remote_clusters_denylisted_key_is_found_without_a_kid() {
    use base64::Engine;
    let dir = tempfile::tempdir().unwrap();
    let deny = dir.path().join("denylist");
    std::fs::write(&deny, "").unwrap();
    let path = deny.clone();
    let Mc {
        a,
        b,
        srv,
        zt_token,
        zt_ns,
        ..
    } = setup_with(TokenVerificationMode::Review, move |cfg| {
        cfg.kill_switch.denylist = meshca::denylist::DenylistSettings {
            file: Some(path),
            poll: Duration::from_millis(200),
            configmap: None,
        };
    })
    .await;
    let segment = |i: usize| -> serde_json::Value {
        let b = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(zt_token.split('.').nth(i).unwrap())
            .unwrap();
        serde_json::from_slice(&b).unwrap()
    };
    let remote_kid = segment(0)["kid"].as_str().unwrap().to_string();
    let kidless = b.sign_claims(&serde_json::json!({"alg": "RS256"}), &segment(1));
    let zt_id = spiffe(&zt_ns, "ztunnel");
    let local_ns = a.namespace("primary").await;
    let (_, local_token) = a.pod_token(&local_ns, "app", "app-0", "node-a").await;
    let local_id = spiffe(&local_ns, "app");
    // The remote issuer's keys are fetched (in review mode too).
    let registry = srv.app.clusters.clone().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while registry
        .get(REMOTE)
        .and_then(|c| c.keys.clone())
        .and_then(|k| k.current())
        .is_none()
    {
        assert!(Instant::now() < deadline, "remote keys never loaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    srv.call(&kidless, &zt_id, None, Some(REMOTE))
        .await
        .expect("the remote TokenReview accepts a kid-less token");
    std::fs::write(&deny, format!("token-key {remote_kid}\n")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while srv
        .call(&zt_token, &zt_id, None, Some(REMOTE))
        .await
        .is_ok()
    {
        assert!(Instant::now() < deadline, "the entry never took effect");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = srv.call(&kidless, &zt_id, None, Some(REMOTE)).await;
    denied(r, &srv, Code::Unauthenticated, "denylist_token_key");
    assert_eq!(last_cluster(&srv).as_deref(), Some(REMOTE));
    srv.call(&local_token, &local_id, None, None)
        .await
        .expect("a primary-cluster caller is not affected");
}
