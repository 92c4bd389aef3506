//! Against the real kube-apiserver: no identity outlives its pod.
//! Bounded mTLS renewal (deleted pod, TTL cap, connection closed at
//! client-certificate expiry, no resumption, stale index), the hot denylist
//! under load, and a revoked serial in a CRL checked by openssl and
//! published as `istio-ca-crl`.
#![allow(clippy::unwrap_used)]

mod common;
mod revoking;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{client_cert, kte, spiffe, start, Ask, Server};
use meshca::ca::generate::KeyType;
use meshca::ca::CaBundle;
use meshca::testing::TestPki;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

/// One mTLS CreateCertificate for `id` asking for `ttl_secs`.
async fn renew(
    srv: &Server,
    cert: &(String, String),
    id: &str,
    ttl_secs: i64,
) -> Result<Vec<String>, tonic::Status> {
    let ask = Ask {
        cert: Some(cert),
        ttl: ttl_secs,
        ..Default::default()
    };
    srv.ask(id, ask).await.0
}

fn not_after(pem: &str) -> OffsetDateTime {
    let der = CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
    let (_, c) = x509_parser::parse_x509_certificate(&der).unwrap();
    OffsetDateTime::from_unix_timestamp(c.validity().not_after.timestamp()).unwrap()
}

/// A namespace with service account `app` and pod `app-0` on node-a, and a
/// server (pod check on, renewal cap `cap`) that has indexed the pod.
async fn renewal_setup(
    k: &common::Kte,
    cap: Duration,
    edit: impl FnOnce(&mut meshca::config::Config),
) -> (String, String, Server) {
    let ns = k.namespace("renew").await;
    k.service_account(&ns, "app").await;
    k.pod(&ns, "app-0", "app", "node-a").await;
    let pki = TestPki::new(KeyType::EcdsaP256);
    let mut cfg = common::kube_config(&pki, k.meshca_kubeconfig(), &[]);
    cfg.kill_switch.renewal_pod_check = true;
    cfg.kill_switch.renewal.max_ttl = cap;
    edit(&mut cfg);
    let srv = start(cfg, pki).await;
    let n = ns.clone();
    srv.wait_index("app-0", move |s| {
        s.has_live_pod(&n, "app", time::OffsetDateTime::now_utc().unix_timestamp())
    })
    .await;
    let id = spiffe(&ns, "app");
    (ns, id, srv)
}

#[tokio::test]
async fn mtls_renewal_needs_a_live_pod_deleted_pod_is_denied() {
    let k = kte().await;
    let (ns, id, srv) = renewal_setup(&k, Duration::from_secs(24 * 3600), |_| {}).await;
    let cert = client_cert(&srv.pki, &id, 3600);
    renew(&srv, &cert, &id, 0).await.unwrap();
    let rec = srv.audit.requests().last().cloned().unwrap();
    assert_eq!(rec.reason, "issued");
    assert_eq!(rec.renewal_check.as_deref(), Some("pod_live"));

    // An identity with no pod at all is refused from the start.
    let ghost = spiffe(&ns, "ghost");
    let ghost_cert = client_cert(&srv.pki, &ghost, 3600);
    let e = renew(&srv, &ghost_cert, &ghost, 0).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    assert_eq!(srv.last_reason(), "renewal_no_live_pod");

    k.delete_pod(&ns, "app-0").await;
    let n = ns.clone();
    srv.wait_index("app-0 deleted", move |s| {
        !s.has_live_pod(&n, "app", time::OffsetDateTime::now_utc().unix_timestamp())
    })
    .await;
    let e = renew(&srv, &cert, &id, 0).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert_eq!(srv.last_reason(), "renewal_no_live_pod");

    // A terminal pod does not count either.
    k.pod(&ns, "app-1", "app", "node-a").await;
    let n = ns.clone();
    srv.wait_index("app-1", move |s| {
        s.has_live_pod(&n, "app", time::OffsetDateTime::now_utc().unix_timestamp())
    })
    .await;
    renew(&srv, &cert, &id, 0).await.unwrap();
    k.set_phase(&ns, "app-1", "Succeeded").await;
    let n = ns.clone();
    srv.wait_index("app-1 succeeded", move |s| {
        !s.has_live_pod(&n, "app", time::OffsetDateTime::now_utc().unix_timestamp())
    })
    .await;
    renew(&srv, &cert, &id, 0).await.unwrap_err();
    assert_eq!(srv.last_reason(), "renewal_no_live_pod");
}

#[tokio::test]
async fn over_long_mtls_renewal_is_capped() {
    let k = kte().await;
    let cap = Duration::from_secs(3600);
    let (_ns, id, srv) = renewal_setup(&k, cap, |_| {}).await;
    let cert = client_cert(&srv.pki, &id, 3600);
    for ask in [0, 90 * 24 * 3600, 7200] {
        let chain = renew(&srv, &cert, &id, ask).await.unwrap();
        let left = not_after(&chain[0]) - OffsetDateTime::now_utc();
        assert!(
            left <= time::Duration::seconds(3600),
            "asked {ask}s, got a leaf living {left}"
        );
        let rec = srv.audit.requests().last().cloned().unwrap();
        assert_eq!(rec.renewal_check.as_deref(), Some("pod_live,capped"));
        assert_eq!(rec.lifetime.unwrap().granted_secs, 3600);
    }
    // Under the cap: untouched.
    let chain = renew(&srv, &cert, &id, 600).await.unwrap();
    assert!(not_after(&chain[0]) - OffsetDateTime::now_utc() <= time::Duration::seconds(600));
    let rec = srv.audit.requests().last().cloned().unwrap();
    assert_eq!(rec.renewal_check.as_deref(), Some("pod_live"));
    // Over MAX_WORKLOAD_CERT_TTL is still refused as istiod refuses it.
    let e = renew(&srv, &cert, &id, 90 * 24 * 3600 + 1)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(srv.last_reason(), "ttl_too_long");
}

/// Counts the TLS 1.3 tickets the server hands out (the input of resumption).
#[derive(Debug)]
struct CountingStore {
    inner: rustls::client::ClientSessionMemoryCache,
    tickets: AtomicU64,
}

impl rustls::client::ClientSessionStore for CountingStore {
    fn set_kx_hint(&self, n: rustls_pki_types::ServerName<'static>, g: rustls::NamedGroup) {
        self.inner.set_kx_hint(n, g)
    }
    fn kx_hint(&self, n: &rustls_pki_types::ServerName<'_>) -> Option<rustls::NamedGroup> {
        self.inner.kx_hint(n)
    }
    fn set_tls12_session(
        &self,
        n: rustls_pki_types::ServerName<'static>,
        v: rustls::client::Tls12ClientSessionValue,
    ) {
        self.tickets.fetch_add(1, Ordering::SeqCst);
        self.inner.set_tls12_session(n, v)
    }
    fn tls12_session(
        &self,
        n: &rustls_pki_types::ServerName<'_>,
    ) -> Option<rustls::client::Tls12ClientSessionValue> {
        self.inner.tls12_session(n)
    }
    fn remove_tls12_session(&self, n: &rustls_pki_types::ServerName<'static>) {
        self.inner.remove_tls12_session(n)
    }
    fn insert_tls13_ticket(
        &self,
        n: rustls_pki_types::ServerName<'static>,
        v: rustls::client::Tls13ClientSessionValue,
    ) {
        self.tickets.fetch_add(1, Ordering::SeqCst);
        self.inner.insert_tls13_ticket(n, v)
    }
    fn take_tls13_ticket(
        &self,
        n: &rustls_pki_types::ServerName<'static>,
    ) -> Option<rustls::client::Tls13ClientSessionValue> {
        self.inner.take_tls13_ticket(n)
    }
}

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// Opens a TLS connection presenting `cert`, sends the HTTP/2 preface and
/// reads until the server closes; returns (first bytes were HTTP/2 frames,
/// when the connection ended).
async fn hold_connection(
    addr: std::net::SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> (bool, Instant) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let connector = tokio_rustls::TlsConnector::from(config);
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = match connector.connect(name, tcp).await {
        Ok(t) => t,
        Err(_) => return (false, Instant::now()),
    };
    if tls.write_all(H2_PREFACE).await.is_err() {
        return (false, Instant::now());
    }
    let mut got_frames = false;
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(30), tls.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (got_frames, Instant::now()),
            Ok(Ok(_)) => got_frames = true,
            Err(_) => panic!("connection still open 30 s later"),
        }
    }
}

#[tokio::test]
async fn connection_closes_at_client_cert_expiry_and_no_session_resumes_past_it() {
    let k = kte().await;
    let (_ns, id, srv) = renewal_setup(&k, Duration::from_secs(24 * 3600), |_| {}).await;
    let life = 6;
    let (chain_pem, key_pem) = client_cert(&srv.pki, &id, life);
    let cert_expiry = not_after(&chain_pem);
    // The request path accepts the certificate while it is valid.
    renew(&srv, &(chain_pem.clone(), key_pem.clone()), &id, 0)
        .await
        .unwrap();

    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(srv.pki.ca.root_cert.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).unwrap();
    let store = Arc::new(CountingStore {
        inner: rustls::client::ClientSessionMemoryCache::new(32),
        tickets: AtomicU64::new(0),
    });
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_client_auth_cert(chain, key)
    .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    config.resumption = rustls::client::Resumption::store(store.clone());
    let config = Arc::new(config);

    let (frames, ended) = hold_connection(srv.app.addr, config.clone()).await;
    assert!(frames, "the server spoke HTTP/2 on the connection");
    let ended_at = OffsetDateTime::now_utc() - ended.elapsed();
    let delta = ended_at - cert_expiry;
    assert!(
        delta <= time::Duration::milliseconds(1500) && delta >= time::Duration::seconds(-2),
        "connection ended {delta} from the certificate's notAfter"
    );
    assert_eq!(
        store.tickets.load(Ordering::SeqCst),
        0,
        "the server must hand out no session tickets or ids: nothing to resume"
    );

    // After expiry (notAfter is valid through its whole second) the same
    // client, same session store, gets nowhere: no resumption, and the full
    // handshake refuses the expired certificate.
    let past = cert_expiry + time::Duration::milliseconds(1100) - OffsetDateTime::now_utc();
    if let Ok(wait) = Duration::try_from(past) {
        tokio::time::sleep(wait).await;
    }
    let (frames, _) = hold_connection(srv.app.addr, config).await;
    assert!(
        !frames,
        "an expired client certificate must not reach HTTP/2"
    );
    let before = srv.audit.requests().len();
    renew(&srv, &(chain_pem, key_pem), &id, 0)
        .await
        .expect_err("an expired client certificate gets no certificate");
    assert_eq!(
        srv.audit.requests().len(),
        before,
        "refused in the handshake, before any request"
    );
}

/// A TCP proxy in front of the API server that can be cut.
struct Cut {
    addr: std::net::SocketAddr,
    stop: tokio::sync::watch::Sender<bool>,
}

async fn proxy(upstream: std::net::SocketAddr) -> Cut {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let mut rx_accept = rx.clone();
        loop {
            tokio::select! {
                _ = rx_accept.changed() => return,
                c = listener.accept() => {
                    let Ok((mut down, _)) = c else { continue };
                    let mut rx = rx.clone();
                    tokio::spawn(async move {
                        let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await else { return };
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
                            _ = rx.changed() => {}
                        }
                    });
                }
            }
        }
    });
    Cut { addr, stop }
}

#[tokio::test]
async fn stale_index_refuses_source_ip_impersonation_and_renewal() {
    let k = kte().await;
    let zt_ns = k.namespace("zt").await;
    k.service_account(&zt_ns, "ztunnel").await;
    k.pod(&zt_ns, "ztunnel-a", "ztunnel", "node-a").await;
    k.set_pod_ip(&zt_ns, "ztunnel-a", "127.0.0.1").await;
    let ns = k.namespace("app").await;
    k.service_account(&ns, "app").await;
    k.pod(&ns, "app-0", "app", "node-a").await;

    // meshca reaches the API server only through the proxy.
    let mut kc: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(k.meshca_kubeconfig()).unwrap()).unwrap();
    let server = kc["clusters"][0]["cluster"]["server"]
        .as_str()
        .unwrap()
        .to_string();
    let upstream: std::net::SocketAddr = server
        .trim_start_matches("https://")
        .trim_end_matches('/')
        .parse()
        .unwrap();
    let cut = proxy(upstream).await;
    kc["clusters"][0]["cluster"]["server"] =
        serde_yaml_ng::Value::String(format!("https://{}", cut.addr));
    let kc_path = k
        .dir
        .join(format!("{}.kubeconfig", common::unique("proxied")));
    std::fs::write(&kc_path, serde_yaml_ng::to_string(&kc).unwrap()).unwrap();

    let pki = TestPki::new(KeyType::EcdsaP256);
    let mut cfg = common::kube_config(&pki, kc_path, &[format!("{zt_ns}/ztunnel")]);
    cfg.mtls_impersonation = true;
    cfg.kill_switch.renewal_pod_check = true;
    cfg.kill_switch.renewal.max_index_staleness = Duration::from_secs(1);
    let srv = start(cfg, pki).await;
    let (zn, n) = (zt_ns.clone(), ns.clone());
    srv.wait_index("pods", move |s| {
        s.get(&zn, "ztunnel-a")
            .is_some_and(|p| !p.pod_ips.is_empty())
            && s.get(&n, "app-0").is_some()
    })
    .await;
    let zt_id = spiffe(&zt_ns, "ztunnel");
    let app = spiffe(&ns, "app");
    let zt_cert = client_cert(&srv.pki, &zt_id, 3600);
    let impersonate = |srv: &Server| {
        let (cert, key) = zt_cert.clone();
        let (addr, root, app) = (srv.app.addr, srv.pki.ca.root_cert.clone(), app.clone());
        async move {
            let mut c = meshca::testing::client(addr, &root, Some((&cert, &key)))
                .await
                .unwrap();
            let key = rcgen::KeyPair::generate().unwrap();
            let meta = [("ImpersonatedIdentity", meshca::testing::string_value(&app))];
            let mut req = tonic::Request::new(meshca::testing::request(
                meshca::testing::csr_for(&key, &app),
                0,
                &meta,
            ));
            req.metadata_mut()
                .insert("clusterid", "Kubernetes".parse().unwrap());
            c.create_certificate(req).await
        }
    };
    impersonate(&srv).await.unwrap();
    assert_eq!(
        srv.audit.requests().last().unwrap().node.as_deref(),
        Some("node-a")
    );
    renew(&srv, &zt_cert, &zt_id, 0).await.unwrap();

    cut.stop.send_replace(true);
    let index = srv.app.pod_index.clone().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while index
        .disconnected_for()
        .is_none_or(|d| d <= Duration::from_secs(1))
    {
        assert!(Instant::now() < deadline, "the watch never noticed the cut");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let e = impersonate(&srv).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert_eq!(srv.last_reason(), "impersonation_index_stale");
    let e = renew(&srv, &zt_cert, &zt_id, 0).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert_eq!(srv.last_reason(), "renewal_index_stale");
}

/// Loads the server with mTLS renewals until `stop`; counts outcomes by reason.
fn load(
    srv: &Server,
    cert: (String, String),
    id: String,
    stop: Arc<AtomicBool>,
    first_denied: Arc<std::sync::Mutex<Option<Instant>>>,
) -> Vec<tokio::task::JoinHandle<u64>> {
    (0..6)
        .map(|_| {
            let (addr, root) = (srv.app.addr, srv.pki.ca.root_cert.clone());
            let (cert, id, stop, first) =
                (cert.clone(), id.clone(), stop.clone(), first_denied.clone());
            tokio::spawn(async move {
                let mut c = meshca::testing::client(addr, &root, Some((&cert.0, &cert.1)))
                    .await
                    .unwrap();
                let key = rcgen::KeyPair::generate().unwrap();
                let csr = meshca::testing::csr_for(&key, &id);
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let r = c
                        .create_certificate(meshca::testing::request(csr.clone(), 0, &[]))
                        .await;
                    n += 1;
                    if r.is_err() {
                        first.lock().unwrap().get_or_insert_with(Instant::now);
                    }
                }
                n
            })
        })
        .collect()
}

async fn metric(srv: &Server, needle: &str) -> f64 {
    let (_, body) = meshca::testing::http_get(srv.app.admin_addr, "/metrics").await;
    body.lines()
        .find(|l| l.starts_with(needle))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// A kubeconfig for a fresh ServiceAccount holding exactly the ClusterRole
/// rules of `cluster_fixtures` and the Role rules of `role` (fixture, in that
/// namespace): meshca runs with what the chart grants, nothing more.
async fn kubeconfig_with(
    k: &common::Kte,
    cluster_fixtures: &[&str],
    role: Option<(&str, &str)>,
) -> std::path::PathBuf {
    use k8s_openapi::api::rbac::v1::{
        ClusterRole, ClusterRoleBinding, Role, RoleBinding, RoleRef, Subject,
    };
    use kube::api::PostParams;
    let sa_ns = k.namespace("rbac").await;
    k.service_account(&sa_ns, "ca").await;
    let subject = Subject {
        kind: "ServiceAccount".into(),
        name: "ca".into(),
        namespace: Some(sa_ns.clone()),
        ..Default::default()
    };
    let fixture = |rel: &str, kind: &str| -> serde_json::Value {
        let text =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/").to_string() + rel)
                .unwrap();
        let found = serde_yaml_ng::Deserializer::from_str(&text)
            .map(|d| serde_json::to_value(serde_yaml_ng::Value::deserialize(d).unwrap()).unwrap())
            .find(|v| v["kind"] == kind)
            .unwrap();
        found
    };
    for (i, rel) in cluster_fixtures.iter().enumerate() {
        let name = format!("{sa_ns}-{i}");
        let mut v = fixture(rel, "ClusterRole");
        v["metadata"] = serde_json::json!({"name": name});
        let role: ClusterRole = serde_json::from_value(v).unwrap();
        kube::Api::<ClusterRole>::all(k.admin.clone())
            .create(&PostParams::default(), &role)
            .await
            .unwrap();
        let binding = ClusterRoleBinding {
            metadata: kube::api::ObjectMeta {
                name: Some(name.clone()),
                ..Default::default()
            },
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "ClusterRole".into(),
                name,
            },
            subjects: Some(vec![subject.clone()]),
        };
        kube::Api::<ClusterRoleBinding>::all(k.admin.clone())
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
    }
    if let Some((ns, rel)) = role {
        let mut v = fixture(rel, "Role");
        let name = v["metadata"]["name"].as_str().unwrap().to_string();
        v["metadata"] = serde_json::json!({"name": name, "namespace": ns});
        let r: Role = serde_json::from_value(v).unwrap();
        kube::Api::<Role>::namespaced(k.admin.clone(), ns)
            .create(&PostParams::default(), &r)
            .await
            .unwrap();
        let binding = RoleBinding {
            metadata: kube::api::ObjectMeta {
                name: Some(name.clone()),
                ..Default::default()
            },
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "Role".into(),
                name,
            },
            subjects: Some(vec![subject.clone()]),
        };
        kube::Api::<RoleBinding>::namespaced(k.admin.clone(), ns)
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
    }
    let token = k
        .token(
            &sa_ns,
            "ca",
            None,
            "https://kubernetes.default.svc.cluster.local",
        )
        .await;
    let mut kc: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(k.meshca_kubeconfig()).unwrap()).unwrap();
    kc["users"][0]["user"] =
        serde_yaml_ng::to_value(serde_json::json!({ "token": token })).unwrap();
    let path = k.dir.join(format!("{sa_ns}.kubeconfig"));
    std::fs::write(&path, serde_yaml_ng::to_string(&kc).unwrap()).unwrap();
    path
}

const TESTENV_RBAC: &str = "scripts/kube-testenv.d/meshca-rbac.yaml";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denylist_changes_take_effect_within_seconds_under_load() {
    use k8s_openapi::api::core::v1::ConfigMap;
    let k = kte().await;
    let dir = tempfile::tempdir().unwrap();
    let deny_file = dir.path().join("denylist");
    std::fs::write(&deny_file, "# empty\n").unwrap();
    let cm_ns = k.namespace("deny").await;
    // Exactly the chart's RBAC: the test cluster's meshca rules plus the denylist Role.
    let kc = kubeconfig_with(
        &k,
        &[TESTENV_RBAC],
        Some((&cm_ns, "tests/fixtures/rbac-denylist.yaml")),
    )
    .await;
    let (ns, id, srv) = renewal_setup(&k, Duration::from_secs(24 * 3600), |cfg| {
        cfg.kube.as_mut().unwrap().kubeconfig = Some(kc);
        cfg.kill_switch.denylist = meshca::denylist::DenylistSettings {
            file: Some(deny_file.clone()),
            poll: Duration::from_millis(200),
            configmap: Some((cm_ns.clone(), "meshca-denylist".into())),
        };
    })
    .await;
    let cert = client_cert(&srv.pki, &id, 3600);

    for (how, reason) in [
        ("file", "denylist_identity"),
        ("configmap", "denylist_service_account"),
    ] {
        let stop = Arc::new(AtomicBool::new(false));
        let first = Arc::new(std::sync::Mutex::new(None));
        let before = srv.audit.requests().len();
        let loaders = load(&srv, cert.clone(), id.clone(), stop.clone(), first.clone());
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            first.lock().unwrap().is_none(),
            "{how}: nothing denied before the change"
        );
        let changed = Instant::now();
        match how {
            "file" => std::fs::write(&deny_file, format!("identity {id}\n")).unwrap(),
            _ => {
                let cm: ConfigMap = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": "meshca-denylist"},
                    "data": {"denylist": format!("serviceaccount {ns}/app\n")}
                }))
                .unwrap();
                kube::Api::<ConfigMap>::namespaced(k.admin.clone(), &cm_ns)
                    .create(&Default::default(), &cm)
                    .await
                    .unwrap();
            }
        }
        let deadline = changed + Duration::from_secs(10);
        while first.lock().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "{how}: denylist not in force 10 s later"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let took = first.lock().unwrap().unwrap() - changed;
        // Every request after the first denial is denied too.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let cutoff = srv.audit.requests().len();
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, Ordering::Relaxed);
        let mut total = 0;
        for l in loaders {
            total += l.await.unwrap();
        }
        let records = srv.audit.requests();
        let after: Vec<_> = records[cutoff..]
            .iter()
            .map(|r| r.reason.as_str())
            .collect();
        assert!(!after.is_empty(), "{how}: load continued");
        assert!(after.iter().all(|r| *r == reason), "{how}: {after:?}");
        let issued = records[before..cutoff]
            .iter()
            .filter(|r| r.reason == "issued")
            .count();
        assert!(issued > 0, "{how}: the load was served before the change");
        eprintln!(
            "{how}: denylist in force {took:?} after the change, {total} requests under load"
        );
        assert!(
            metric(
                &srv,
                &format!("meshca_denylist_hits_total{{reason=\"{reason}\"}}")
            )
            .await
                > 0.0
        );
        // Lift it again: the next request is served.
        match how {
            "file" => std::fs::write(&deny_file, "").unwrap(),
            _ => kube::Api::<ConfigMap>::namespaced(k.admin.clone(), &cm_ns)
                .delete("meshca-denylist", &Default::default())
                .await
                .map(|_| ())
                .unwrap(),
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while renew(&srv, &cert, &id, 0).await.is_err() {
            assert!(Instant::now() < deadline, "{how}: never lifted");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[tokio::test]
async fn revoked_serial_is_in_a_crl_openssl_verifies_and_in_the_configmap() {
    use k8s_openapi::api::core::v1::ConfigMap;
    let k = kte().await;
    let label = common::unique("crl");
    let selected = k.namespace("crl").await;
    k.label_namespace(&selected, "meshca-crl", &label).await;
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("revoked-serials.jsonl");
    // Exactly the chart's RBAC with CRL publishing on.
    let kc = kubeconfig_with(
        &k,
        &[TESTENV_RBAC, "tests/fixtures/rbac-crl-publisher.yaml"],
        None,
    )
    .await;
    let (_ns, id, srv) = renewal_setup(&k, Duration::from_secs(24 * 3600), |cfg| {
        cfg.kube.as_mut().unwrap().kubeconfig = Some(kc);
        cfg.kill_switch.revocation = Some(meshca::revocation::RevocationSettings {
            file: Some(store.clone()),
            configmap: None,
            poll: Duration::from_millis(200),
            crl_validity: Duration::from_secs(3600),
            publish: Some(meshca::rootpub::RootPublisherSettings {
                configmap_name: "istio-ca-crl".into(),
                namespace_selector: Some(format!("meshca-crl={label}")),
                resync: Duration::from_secs(600),
            }),
        });
    })
    .await;
    let cert = client_cert(&srv.pki, &id, 3600);
    let chain = renew(&srv, &cert, &id, 0).await.unwrap();
    let issued = srv.audit.requests().last().cloned().unwrap();
    let serial = issued.serial.clone().unwrap();
    // The client certificate's own serial: revoked, it may not renew.
    let client_serial = meshca::testing::leaf_serial(&cert.0);

    // What `meshca revoke --identity` does: find the serials in the audit log, append them.
    let now = OffsetDateTime::now_utc();
    let found = meshca::revocation::select(
        &srv.audit.requests(),
        &meshca::revocation::Target::Identity(id.clone()),
        "key-compromise",
        Some("test"),
        now,
    );
    assert_eq!(
        found.iter().map(|r| r.serial.as_str()).collect::<Vec<_>>(),
        [serial.as_str()]
    );
    meshca::revocation::append_store(&store, &found).unwrap();
    let by_serial = meshca::revocation::select(
        &[],
        &meshca::revocation::Target::Serials(vec![client_serial.clone()]),
        "key-compromise",
        Some("test"),
        now,
    );
    meshca::revocation::append_store(&store, &by_serial).unwrap();

    // Served on the admin port within a few polls.
    let deadline = Instant::now() + Duration::from_secs(15);
    let crl_pem = loop {
        let (code, body) = meshca::testing::http_get(srv.app.admin_addr, "/ca-crl.pem").await;
        if code == 200 && revoking::crl(&body).1.len() == 2 {
            break body;
        }
        assert!(Instant::now() < deadline, "CRL never listed both serials");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    // Independent verifier: openssl checks the signature with the intermediate.
    let crl_file = dir.path().join("crl.pem");
    std::fs::write(&crl_file, &crl_pem).unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &srv.pki.ca.ca_cert).unwrap();
    let out = std::process::Command::new("openssl")
        .args(["crl", "-noout", "-text", "-verify", "-in"])
        .arg(&crl_file)
        .arg("-CAfile")
        .arg(&ca_file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_uppercase();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.contains("verify OK"),
        "openssl: {err}"
    );
    assert!(
        text.contains(&serial.to_uppercase()),
        "{serial} not in\n{text}"
    );
    assert!(text.contains("KEY COMPROMISE"), "{text}");
    // A different CA must not verify it (the check can fail).
    let other = TestPki::new(KeyType::EcdsaP256);
    std::fs::write(&ca_file, &other.ca.ca_cert).unwrap();
    let out = std::process::Command::new("openssl")
        .args(["crl", "-noout", "-verify", "-in"])
        .arg(&crl_file)
        .arg("-CAfile")
        .arg(&ca_file)
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("verify OK"),
        "a foreign CA verified the CRL"
    );
    // The leaf meshca issued chains to that intermediate (same issuer).
    assert_eq!(chain[1].trim(), srv.pki.ca.ca_cert.trim());

    // Published where ztunnel reads it.
    let cms = kube::Api::<ConfigMap>::namespaced(k.admin.clone(), &selected);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let data = cms
            .get_opt("istio-ca-crl")
            .await
            .unwrap()
            .and_then(|c| c.data)
            .and_then(|mut d| d.remove("ca-crl.pem"));
        if data.as_deref() == Some(crl_pem.as_str()) {
            break;
        }
        assert!(Instant::now() < deadline, "istio-ca-crl never held the CRL");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Each revocation is an audit record of its own.
    let revoked: Vec<_> = srv
        .audit
        .requests()
        .into_iter()
        .filter(|r| r.reason == "revoked")
        .filter_map(|r| r.serial)
        .collect();
    assert!(
        revoked.contains(&serial) && revoked.contains(&client_serial),
        "{revoked:?}"
    );
    // The revoked client certificate renews no more.
    let e = renew(&srv, &cert, &id, 0).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    assert_eq!(srv.last_reason(), "mtls_cert_revoked");
}

/// The runbook's step 2 against a stolen leaf that was renewed: ztunnel on
/// node-a gets W1 for app (the record names node-a), then W1's holder
/// renews it over mTLS twice (W1 -> W2 -> W3; those records name no node).
/// `meshca revoke --node node-a` (the release CLI, over the server's own
/// chained audit file) must list all three, and `--serial W1` must follow
/// the renewals too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoke_node_follows_certificates_renewed_over_mtls() {
    let k = kte().await;
    let zt_ns = k.namespace("zt").await;
    let (_, zt_token) = k.pod_token(&zt_ns, "ztunnel", "ztunnel-a", "node-a").await;
    let ns = k.namespace("app").await;
    k.service_account(&ns, "app").await;
    k.pod(&ns, "app-0", "app", "node-a").await;
    let id = spiffe(&ns, "app");

    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.log");
    let pki = TestPki::new(KeyType::EcdsaP256);
    let mut cfg = common::kube_config(&pki, k.meshca_kubeconfig(), &[format!("{zt_ns}/ztunnel")]);
    cfg.kill_switch.renewal_pod_check = true;
    cfg.audit.sink = meshca::config::AuditSinkKind::File;
    cfg.audit.file = audit.clone();
    let app = meshca::app::App::start(&cfg, Default::default())
        .await
        .unwrap();
    let index = app.pod_index.clone().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(index.is_synced()
        && index.read(|s| s.get(&ns, "app-0").is_some() && s.get(&zt_ns, "ztunnel-a").is_some()))
    {
        assert!(Instant::now() < deadline, "pod index never showed the pods");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // W1: ztunnel impersonates app on node-a.
    let w1 = Ask {
        token: Some(&zt_token),
        impersonate: Some(&id),
        cluster: Some("Kubernetes"),
        ..Default::default()
    };
    let (w1, key1) = w1.send(app.addr, &pki.ca.root_cert, &id).await;
    let w1 = w1.unwrap();

    // W1 -> W2 -> W3 over mTLS, each presenting the previous leaf and its key.
    let mut serials = vec![meshca::testing::leaf_serial(&w1[0])];
    let (mut chain, mut key) = (w1, key1);
    for _ in 0..2 {
        let presented = (chain[..chain.len() - 1].concat(), key.serialize_pem());
        let renewal = Ask {
            cert: Some(&presented),
            ..Default::default()
        };
        let (next_chain, next) = renewal.send(app.addr, &pki.ca.root_cert, &id).await;
        chain = next_chain.unwrap();
        key = next;
        serials.push(meshca::testing::leaf_serial(&chain[0]));
    }
    app.shutdown().await.unwrap();
    let mut want = serials.clone();
    want.sort();

    let audit_s = audit.to_str().unwrap();
    let store = dir.path().join("revoked.jsonl");
    let revoke = |target: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshca"))
            .arg("revoke")
            .args(target)
            .args([
                "--reason",
                "key-compromise",
                "--dry-run",
                "--revocation-file",
            ])
            .arg(&store)
            .arg(audit_s)
            .output()
            .unwrap();
        revoking::printed_serials(&out)
    };
    assert_eq!(revoke(&["--node", "node-a"]), want, "--node node-a");
    assert_eq!(
        revoke(&["--serial", &serials[0]]),
        want,
        "--serial W1 and its renewals"
    );
    assert_eq!(
        revoke(&["--serial", &serials[1]]),
        want[..]
            .iter()
            .filter(|s| **s != serials[0])
            .cloned()
            .collect::<Vec<_>>(),
        "--serial W2: itself and W3, not its parent"
    );
    assert!(revoke(&["--node", "node-b"]).is_empty());
    // `audit query --node` shows the renewals as well.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshca"))
        .args([
            "audit", "query", "--node", "node-a", "--reason", "issued", "-o", "json", audit_s,
        ])
        .output()
        .unwrap();
    let mut issued: Vec<String> = revoking::json_lines(&out)
        .into_iter()
        .map(|v| v["serial"].as_str().unwrap().to_string())
        .collect();
    issued.sort();
    assert_eq!(issued, want, "audit query --node node-a");
}

/// The serials and number of the CRL in a published `ca-crl.pem`.
fn crl_contents(pem: &str) -> (u128, std::collections::BTreeSet<String>) {
    let (number, serials) = revoking::crl(pem);
    (number, serials.into_iter().collect())
}

/// CRL versions seen: (number, serials), in order.
type CrlHistory = Arc<std::sync::Mutex<Vec<(u128, std::collections::BTreeSet<String>)>>>;

/// Every version of `istio-ca-crl` in `ns`, as the API server's watch delivers them.
fn watch_crl(k: &common::Kte, ns: &str) -> (CrlHistory, tokio::task::JoinHandle<()>) {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::runtime::watcher::{self, Event};
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let api: kube::Api<ConfigMap> = kube::Api::namespaced(k.admin.clone(), ns);
    let config = watcher::Config::default().fields("metadata.name=istio-ca-crl");
    let s = seen.clone();
    let task = tokio::spawn(async move {
        let mut stream = watcher::watcher(api, config).boxed();
        while let Some(e) = stream.next().await {
            if let Ok(Event::Apply(cm) | Event::InitApply(cm)) = e {
                if let Some(pem) = cm.data.and_then(|mut d| d.remove("ca-crl.pem")) {
                    let v = crl_contents(&pem);
                    let mut s = s.lock().unwrap();
                    if s.last() != Some(&v) {
                        s.push(v);
                    }
                }
            }
        }
    });
    (seen, task)
}

/// Two replicas against the real API server, sharing the revocation
/// ConfigMap (with the chart's RBAC: read only) and the published
/// `istio-ca-crl`. A revocation made once (by the release CLI) is enforced
/// by both within the poll interval and survives a restart of either; the
/// store's deletion, truncation and a restart on the truncated store lift
/// nothing; only `meshca revoke --undo` does. A watch on the published CRL
/// through the whole test sees its number only grow and no serial leave it
/// but the one un-revoked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_share_revocations_and_publish_one_growing_crl() {
    use k8s_openapi::api::core::v1::ConfigMap;
    let k = kte().await;
    let ca_ns = k.namespace("meshca").await;
    let label = common::unique("crl");
    let selected = k.namespace("crl").await;
    k.label_namespace(&selected, "meshca-crl", &label).await;
    let (history, watcher) = watch_crl(&k, &selected);
    let kc = kubeconfig_with(
        &k,
        &[TESTENV_RBAC, "tests/fixtures/rbac-crl-publisher.yaml"],
        Some((&ca_ns, "tests/fixtures/rbac-revocations.yaml")),
    )
    .await;
    let poll = Duration::from_millis(300);
    let pki = TestPki::new(KeyType::EcdsaP256);
    let mut cfg = common::kube_config(&pki, kc, &[]);
    cfg.kill_switch.revocation = Some(meshca::revocation::RevocationSettings {
        file: None,
        configmap: Some((ca_ns.clone(), "meshca-revocations".into())),
        poll,
        crl_validity: Duration::from_secs(3600),
        publish: Some(meshca::rootpub::RootPublisherSettings {
            configmap_name: "istio-ca-crl".into(),
            namespace_selector: Some(format!("meshca-crl={label}")),
            resync: Duration::from_secs(2),
        }),
    });
    let start = |cfg: meshca::config::Config| async move {
        let (app, audit) = meshca::testing::start_server(&cfg, Default::default()).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        while meshca::testing::http_get(app.admin_addr, "/readyz").await.0 != 200 {
            assert!(Instant::now() < deadline, "replica never ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        (app, audit)
    };
    let mut replicas = vec![start(cfg.clone()).await, start(cfg.clone()).await];

    let bundle = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
    let ids = [
        "spiffe://cluster.local/ns/shop/sa/cart",
        "spiffe://cluster.local/ns/shop/sa/web",
    ];
    let certs: Vec<(String, String)> = ids
        .iter()
        .map(|id| {
            meshca::testing::client_identity(&bundle, id, &meshca::testing::validity_hours(-1, 2))
        })
        .collect();
    let serials: Vec<String> = certs
        .iter()
        .map(|(c, _)| meshca::testing::leaf_serial(c))
        .collect();
    // Does replica `r` accept client certificate `i` (false: refused as revoked)?
    async fn accepts(
        app: &meshca::app::App,
        audit: &meshca::audit::MemorySink,
        root: &str,
        cert: &(String, String),
        id: &str,
    ) -> bool {
        let mut c = meshca::testing::client(app.addr, root, Some((&cert.0, &cert.1)))
            .await
            .unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        // A replica that has not read the store yet refuses retryably
        // (revocations_not_loaded): that is no verdict, so ask again.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let req = meshca::testing::request(meshca::testing::csr_for(&key, id), 0, &[]);
            match c.create_certificate(req).await {
                Ok(_) => return true,
                Err(e) => {
                    let reason = audit.requests().last().unwrap().reason.clone();
                    if reason == "revocations_not_loaded" && Instant::now() < deadline {
                        assert_eq!(e.code(), tonic::Code::Unavailable);
                        tokio::time::sleep(Duration::from_millis(25)).await;
                        continue;
                    }
                    assert_eq!(reason, "mtls_cert_revoked", "{e:?}");
                    return false;
                }
            }
        }
    }
    let root = pki.ca.root_cert.clone();
    // Waits until every replica in `which` answers `want` for certificate `i`.
    macro_rules! until_all {
        ($which:expr, $i:expr, $want:expr, $what:expr) => {{
            let t0 = Instant::now();
            for r in $which {
                let (app, audit) = &replicas[r];
                let deadline = Instant::now() + Duration::from_secs(10);
                while accepts(app, audit, &root, &certs[$i], ids[$i]).await != $want {
                    assert!(Instant::now() < deadline, "{}: replica {r}", $what);
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
            }
            t0.elapsed()
        }};
    }
    let _ = until_all!([0, 1], 0, true, "both accept cart before any revocation");
    let _ = until_all!([0, 1], 1, true, "both accept web before any revocation");

    let empty_log = pki.path().join("empty-audit.log");
    std::fs::write(&empty_log, "").unwrap();
    let admin_kc = k.dir.join("admin.kubeconfig");
    let store = format!("{ca_ns}/meshca-revocations");
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshca"))
            .arg("revoke")
            .args(args)
            .args([
                "--by",
                "INC-7",
                "--revocation-configmap",
                &store,
                "--kubeconfig",
            ])
            .arg(&admin_kc)
            .env_remove("MESHCA_REVOCATION_FILE")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let log = empty_log.to_str().unwrap().to_string();

    // Revoked once, enforced by both within the poll interval.
    cli(&["--serial", &serials[0], "--reason", "key-compromise", &log]);
    let took = until_all!([0, 1], 0, false, "both refuse cart once revoked");
    eprintln!("revocation in force on both replicas {took:?} after `meshca revoke` returned (poll {poll:?})");
    assert!(took < poll * 4 + Duration::from_secs(2), "{took:?}");
    let _ = until_all!([0, 1], 1, true, "web is untouched");

    // Survives a restart of either replica.
    let (a, _) = replicas.remove(0);
    a.shutdown().await.unwrap();
    replicas.insert(0, start(cfg.clone()).await);
    {
        let (app, audit) = &replicas[0];
        assert!(
            !accepts(app, audit, &root, &certs[0], ids[0]).await,
            "refused at once after the restart"
        );
    }

    cli(&["--serial", &serials[1], "--reason", "key-compromise", &log]);
    let _ = until_all!([0, 1], 1, false, "both refuse web once revoked");

    // The store is deleted: nothing lifted, each replica audits it once.
    let cms = kube::Api::<ConfigMap>::namespaced(k.admin.clone(), &ca_ns);
    let text = cms.get("meshca-revocations").await.unwrap().data.unwrap()["revocations"].clone();
    cms.delete("meshca-revocations", &Default::default())
        .await
        .unwrap();
    tokio::time::sleep(poll * 4).await;
    for (app, audit) in &replicas {
        assert!(!accepts(app, audit, &root, &certs[0], ids[0]).await);
        assert!(!accepts(app, audit, &root, &certs[1], ids[1]).await);
        let reasons: Vec<String> = audit.records().into_iter().map(|r| r.reason).collect();
        assert_eq!(
            reasons
                .iter()
                .filter(|r| *r == "revocation_source_missing")
                .count(),
            1,
            "{reasons:?}"
        );
    }

    // Recreated without web's entry: still refused, the removal audited.
    let first_line = text.lines().next().unwrap().to_string() + "\n";
    assert!(first_line.contains(&serials[0]));
    let cm: ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "meshca-revocations"},
        "data": {"revocations": first_line}
    }))
    .unwrap();
    cms.create(&Default::default(), &cm).await.unwrap();
    tokio::time::sleep(poll * 4).await;
    for (app, audit) in &replicas {
        assert!(!accepts(app, audit, &root, &certs[1], ids[1]).await);
        let refused: Vec<Option<String>> = audit
            .records()
            .into_iter()
            .filter(|r| r.reason == "revocation_removal_refused")
            .map(|r| r.serial)
            .collect();
        assert_eq!(refused, [Some(serials[1].clone())]);
    }

    // A replica restarted on the truncated store takes web back from the
    // published CRL (which no replica ever shrank). CRL numbers are seconds
    // (bumped past the published one, so they can run ahead of the clock):
    // once the clock has passed the published number, the restarted
    // replica's first CRL (cart only) is numbered above it, and only the
    // merge keeps web published.
    let published = history.lock().unwrap().last().unwrap().0;
    while u128::try_from(OffsetDateTime::now_utc().unix_timestamp()).unwrap() <= published {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (b, _) = replicas.remove(1);
    b.shutdown().await.unwrap();
    replicas.insert(1, start(cfg.clone()).await);
    let _ = until_all!(
        [1],
        1,
        false,
        "the restarted replica adopts web from the published CRL"
    );
    assert!(replicas[1]
        .1
        .records()
        .iter()
        .any(|r| r.reason == "revocation_adopted"
            && r.serial.as_deref() == Some(serials[1].as_str())));

    // Only an explicit un-revocation lifts one, audited by both.
    let undo_at = Instant::now();
    // Versions seen from here on may drop cart.
    let undo_version = history.lock().unwrap().len();
    cli(&["--undo", "--serial", &serials[0]]);
    let _ = until_all!([0, 1], 0, true, "both accept cart once un-revoked");
    eprintln!(
        "un-revocation in force on both {:?} after the command",
        undo_at.elapsed()
    );
    let _ = until_all!([0, 1], 1, false, "web stays revoked");
    for (_, audit) in &replicas {
        let un: Vec<_> = audit
            .records()
            .into_iter()
            .filter(|r| r.reason == "unrevoked")
            .collect();
        assert_eq!(un.len(), 1);
        assert_eq!(un[0].serial.as_deref(), Some(serials[0].as_str()));
        assert!(un[0].detail.as_deref().unwrap_or("").contains("INC-7"));
    }

    // The published CRL converges on {web}, and every replica serves the same serials.
    let want: std::collections::BTreeSet<String> = [serials[1].clone()].into();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let last = history.lock().unwrap().last().cloned();
        if last.as_ref().is_some_and(|(_, s)| *s == want) {
            break;
        }
        assert!(Instant::now() < deadline, "published CRL: {last:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (app, _) in &replicas {
        let (code, pem) = meshca::testing::http_get(app.admin_addr, "/ca-crl.pem").await;
        assert_eq!(code, 200);
        assert_eq!(crl_contents(&pem).1, want);
    }
    watcher.abort();

    // Through the whole test: numbers only grew, and no serial left the
    // published CRL except cart, after its un-revocation.
    let h = history.lock().unwrap().clone();
    eprintln!("published CRL versions: {}", h.len());
    assert!(h.len() >= 4, "{h:?}");
    for (i, pair) in h.windows(2).enumerate() {
        let ((n0, s0), (n1, s1)) = (&pair[0], &pair[1]);
        assert!(n1 > n0, "CRL number went from {n0} to {n1} at version {i}");
        let lost: Vec<&String> = s0.difference(s1).collect();
        let allowed = i + 1 >= undo_version && lost.iter().all(|s| **s == serials[0]);
        assert!(lost.is_empty() || allowed, "version {i}: {s0:?} -> {s1:?}");
    }
    for (app, _) in replicas {
        app.shutdown().await.unwrap();
    }
}
