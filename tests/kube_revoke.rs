//! Issue 16 against the real kube-apiserver: no identity outlives its pod.
//! Bounded mTLS renewal (deleted pod, TTL cap, connection closed at
//! client-certificate expiry, no resumption, stale index), the hot denylist
//! under load, and a revoked serial in a CRL checked by openssl and
//! published as `istio-ca-crl`.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{kte, spiffe, start, Server};
use meshca::ca::generate::KeyType;
use meshca::ca::{CaBundle, Validity};
use meshca::testing::TestPki;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

/// A client certificate for `id` from the server's CA, valid until `secs` from now.
fn client_cert(srv_pki: &TestPki, id: &str, secs: i64) -> (String, String) {
    let bundle = CaBundle::load_dir(srv_pki.path(), OffsetDateTime::now_utc()).unwrap();
    let now = OffsetDateTime::now_utc();
    let v = Validity {
        not_before: now - time::Duration::minutes(5),
        not_after: now + time::Duration::seconds(secs),
        clamped: false,
    };
    meshca::testing::client_identity(&bundle, id, &v)
}

/// One mTLS CreateCertificate for `id` asking for `ttl_secs`.
async fn renew(
    srv: &Server,
    cert: &(String, String),
    id: &str,
    ttl_secs: i64,
) -> Result<Vec<String>, tonic::Status> {
    let mut c = meshca::testing::client(
        srv.app.addr,
        &srv.pki.ca.root_cert,
        Some((&cert.0, &cert.1)),
    )
    .await
    .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let key = rcgen::KeyPair::generate().unwrap();
    let req = meshca::testing::request(meshca::testing::csr_for(&key, id), ttl_secs, &[]);
    c.create_certificate(req)
        .await
        .map(|r| r.into_inner().cert_chain)
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
        v["metadata"] = serde_json::json!({"name": "meshca-denylist", "namespace": ns});
        let r: Role = serde_json::from_value(v).unwrap();
        kube::Api::<Role>::namespaced(k.admin.clone(), ns)
            .create(&PostParams::default(), &r)
            .await
            .unwrap();
        let binding = RoleBinding {
            metadata: kube::api::ObjectMeta {
                name: Some("meshca-denylist".into()),
                ..Default::default()
            },
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "Role".into(),
                name: "meshca-denylist".into(),
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
    use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
    let k = kte().await;
    let label = common::unique("crl");
    let selected = k.namespace("crl").await;
    let patch = serde_json::json!({"metadata": {"labels": {"meshca-crl": label}}});
    kube::Api::<Namespace>::all(k.admin.clone())
        .patch(
            &selected,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
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
            file: store.clone(),
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
    let client_serial = {
        let der = CertificateDer::from_pem_slice(cert.0.as_bytes()).unwrap();
        let (_, c) = x509_parser::parse_x509_certificate(&der).unwrap();
        meshca::ca::serial_hex(c.raw_serial())
    };

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
        if code == 200 {
            let der =
                rustls_pki_types::CertificateRevocationListDer::from_pem_slice(body.as_bytes())
                    .unwrap();
            let (_, crl) = x509_parser::parse_x509_crl(&der).unwrap();
            let n = crl.iter_revoked_certificates().count();
            if n == 2 {
                break body;
            }
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
