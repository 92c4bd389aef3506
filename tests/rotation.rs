//! Phased CA rotation against the real kube-apiserver
//! (scripts/kube-testenv), under continuous load, with short TTLs so a
//! whole root rotation runs in well under a minute.
//!
//! Load workers renew over mTLS with the leaf and the trust (last
//! `cert_chain` element) of their previous response, as ztunnel does; not
//! one request may fail. At every phase change a client holding a leaf and
//! trust from before the change and one from after it complete a real
//! rustls mTLS handshake over 127.0.0.1 in both directions. The
//! `istio-ca-root-cert` ConfigMap must carry the phase's roots, and Istio's
//! own Go CA client (MESHCA_ISTIO_CACLIENT) obtains and verifies
//! certificates with a pod-bound token and then over mTLS at each phase.
#![allow(clippy::unwrap_used)]

mod common;
#[path = "common/rotation_check.rs"]
mod rotation_check;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::certificates::v1::ClusterTrustBundle;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Patch, PatchParams};
use kube::Api;
use meshca::ca::generate::{self, GeneratedCa, InitOptions};
use meshca::ca::TtlPolicy;
use meshca::config::KubeSettings;
use meshca::rotation::phase::{Phase, Step};
use meshca::rotation::RotationSettings;
use meshca::testing;
use rcgen::KeyPair;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use serde_json::json;
use time::OffsetDateTime;

const TTL: Duration = Duration::from_secs(6);
const CM: &str = "istio-ca-root-cert";

/// A workload's credentials: its chain (leaf first, no root), key, and the
/// trust bundle it received with them.
#[derive(Clone, Debug)]
struct Holder {
    id: String,
    chain: String,
    key: String,
    trust: String,
    not_after: i64,
}

fn pem_certs(pem: &str) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap()
}

fn not_after(chain: &str) -> i64 {
    let der = &pem_certs(chain)[0];
    let (_, c) = x509_parser::parse_x509_certificate(der).unwrap();
    c.validity().not_after.timestamp()
}

fn der_set(pem: &str) -> std::collections::BTreeSet<Vec<u8>> {
    pem_certs(pem).into_iter().map(|c| c.to_vec()).collect()
}

/// One CreateCertificate over mTLS with `h`'s credentials, verifying the
/// server with `h`'s trust; the response becomes the new holder.
async fn renew(addr: std::net::SocketAddr, h: &Holder) -> Result<Holder, String> {
    renew_with(addr, h, true).await
}

/// [`renew`]; `verify_response` off for URI-constrained chains, which
/// webpki cannot verify (it rejects every URI SAN under a URI constraint).
async fn renew_with(
    addr: std::net::SocketAddr,
    h: &Holder,
    verify_response: bool,
) -> Result<Holder, String> {
    let key = KeyPair::generate().unwrap();
    let csr = testing::csr_for(&key, &h.id);
    let mut client = testing::client(addr, &h.trust, Some((&h.chain, &h.key)))
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let resp = client
        .create_certificate(testing::request(csr, 0, &[]))
        .await
        .map_err(|e| format!("{}: {}", e.code(), e.message()))?
        .into_inner();
    let n = resp.cert_chain.len();
    if n < 2 {
        return Err(format!("chain of {n} elements"));
    }
    let chain = resp.cert_chain[..n - 1].concat();
    // One generation per response: the leaf verifies through the response's
    // own chain to the response's own roots.
    let trust = &resp.cert_chain[n - 1];
    let certs = pem_certs(&chain);
    let anchors: Vec<_> = pem_certs(trust)
        .iter()
        .map(|r| webpki::anchor_from_trusted_cert(r).unwrap().to_owned())
        .collect();
    let verified = webpki::EndEntityCert::try_from(&certs[0])
        .unwrap()
        .verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            &certs[1..],
            UnixTime::now(),
            webpki::KeyUsage::client_auth(),
            None,
            None,
        )
        .map(|_| ())
        .map_err(|e| format!("response chain does not verify to its own roots: {e:?}"));
    if verify_response {
        verified?;
    }
    Ok(Holder {
        id: h.id.clone(),
        not_after: not_after(&chain),
        chain,
        key: key.serialize_pem(),
        trust: resp.cert_chain[n - 1].clone(),
    })
}

/// Verifies a peer's SPIFFE leaf against the holder's trust (webpki), as a
/// mesh client does: the URI SAN, not a DNS name, is the identity.
#[derive(Debug)]
struct SpiffeServerVerifier {
    roots: Vec<CertificateDer<'static>>,
    want: String,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl rustls::client::danger::ServerCertVerifier for SpiffeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        now: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let anchors: Vec<_> = self
            .roots
            .iter()
            .map(|r| webpki::anchor_from_trusted_cert(r).unwrap())
            .collect();
        let ee = webpki::EndEntityCert::try_from(end_entity)
            .map_err(|e| rustls::Error::General(format!("{e:?}")))?;
        ee.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            intermediates,
            now,
            webpki::KeyUsage::server_auth(),
            None,
            None,
        )
        .map_err(|e| rustls::Error::General(format!("peer chain: {e:?}")))?;
        let uri = common::leaf_uri(&meshca::primitives::pem_encode("CERTIFICATE", end_entity));
        if uri != self.want {
            return Err(rustls::Error::General(format!(
                "peer is {uri}, want {}",
                self.want
            )));
        }
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            m,
            c,
            d,
            &self.provider.signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            m,
            c,
            d,
            &self.provider.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A real mTLS handshake over 127.0.0.1: `server` serves with its leaf and
/// verifies the client with its own trust; `client` likewise.
async fn handshake(server: &Holder, client: &Holder) -> Result<(), String> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for r in pem_certs(&server.trust) {
        roots.add(r).unwrap();
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let scfg = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            pem_certs(&server.chain),
            PrivateKeyDer::from_pem_slice(server.key.as_bytes()).unwrap(),
        )
        .unwrap();
    let ccfg = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(SpiffeServerVerifier {
            roots: pem_certs(&client.trust),
            want: server.id.clone(),
            provider: provider.clone(),
        }))
        .with_client_auth_cert(
            pem_certs(&client.chain),
            PrivateKeyDer::from_pem_slice(client.key.as_bytes()).unwrap(),
        )
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(scfg));
    let srv = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        let (tcp, _) = listener.accept().await.unwrap();
        let mut tls = acceptor
            .accept(tcp)
            .await
            .map_err(|e| format!("server side: {e}"))?;
        tls.write_all(b"ok").await.map_err(|e| e.to_string())?;
        tls.shutdown().await.map_err(|e| e.to_string())
    });
    let connector = tokio_rustls::TlsConnector::from(Arc::new(ccfg));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let client_side = async {
        use tokio::io::AsyncReadExt;
        let mut tls = connector
            .connect(ServerName::try_from("workload").unwrap(), tcp)
            .await
            .map_err(|e| format!("client side: {e}"))?;
        let mut buf = [0u8; 2];
        tls.read_exact(&mut buf)
            .await
            .map_err(|e| format!("client read: {e}"))?;
        Ok::<_, String>(())
    };
    let c = client_side.await;
    let s = srv.await.unwrap();
    c.and(s)
}

/// Both directions, with the roots each had.
async fn handshakes_both_ways(before: &Holder, after: &Holder, when: &str) {
    handshake(before, after)
        .await
        .unwrap_or_else(|e| panic!("{when}: before serves, after connects: {e}"));
    handshake(after, before)
        .await
        .unwrap_or_else(|e| panic!("{when}: after serves, before connects: {e}"));
}

fn rotation_status(ca_dir: &Path, settings: &RotationSettings) -> meshca::rotation::Report {
    meshca::rotation::status(ca_dir, settings, OffsetDateTime::now_utc()).unwrap()
}

async fn wait_phase(ca_dir: &Path, settings: &RotationSettings, phase: Phase, within: Duration) {
    let deadline = std::time::Instant::now() + within;
    loop {
        let st = rotation_status(ca_dir, settings);
        if st.phase == phase {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "phase {phase:?} not reached within {within:?}; status:\n{st}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_configmap(k: &common::Kte, ns: &str, roots: &str, when: &str) {
    let want = der_set(roots);
    let api = Api::<ConfigMap>::namespaced(k.admin.clone(), ns);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let got = api
            .get_opt(CM)
            .await
            .unwrap()
            .and_then(|cm| cm.data?.get("root-cert.pem").cloned());
        if got.as_deref().map(der_set).as_ref() == Some(&want) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{when}: {ns}/{CM} holds {} root(s), want {}",
            got.as_deref().map(|g| der_set(g).len()).unwrap_or(0),
            want.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the ClusterTrustBundle `name` holds exactly `roots` (as a
/// set) and is linked to `signer`.
async fn wait_ctb(k: &common::Kte, name: &str, signer: &str, roots: &str, when: &str) {
    let want = der_set(roots);
    let api = Api::<ClusterTrustBundle>::all(k.admin.clone());
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let got = api.get_opt(name).await.unwrap();
        let set = got.as_ref().map(|c| der_set(&c.spec.trust_bundle));
        if set.as_ref() == Some(&want) {
            let ctb = got.unwrap();
            assert_eq!(ctb.spec.signer_name.as_deref(), Some(signer), "{when}");
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{when}: ClusterTrustBundle {name} holds {} root(s), want {}",
            set.map(|s| s.len()).unwrap_or(0),
            want.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Continuous load: `n` workers renewing back to back over mTLS.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicUsize>,
    failures: Arc<Mutex<Vec<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(addr: std::net::SocketAddr, seeds: Vec<Holder>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicUsize::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let tasks = seeds
            .into_iter()
            .map(|mut h| {
                let (stop, ok, failures) = (stop.clone(), ok.clone(), failures.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        match renew(addr, &h).await {
                            Ok(next) => {
                                h = next;
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => failures.lock().unwrap().push(e),
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                })
            })
            .collect();
        Self {
            stop,
            ok,
            failures,
            tasks,
        }
    }

    async fn stop(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        let f = self.failures.lock().unwrap().clone();
        (self.ok.load(Ordering::Relaxed), f)
    }
}

/// A workload renewing back to back, keeping every credential it got.
struct Probe {
    stop: Arc<AtomicBool>,
    history: Arc<Mutex<Vec<(std::time::Instant, Holder)>>>,
    failures: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Probe {
    fn start(addr: std::net::SocketAddr, seed: Holder) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let history = Arc::new(Mutex::new(Vec::new()));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let (s, h, f) = (stop.clone(), history.clone(), failures.clone());
        let task = tokio::spawn(async move {
            let mut cur = seed;
            while !s.load(Ordering::Relaxed) {
                match renew(addr, &cur).await {
                    Ok(next) => {
                        h.lock()
                            .unwrap()
                            .push((std::time::Instant::now(), next.clone()));
                        cur = next;
                    }
                    Err(e) => f.lock().unwrap().push(e),
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        });
        Self {
            stop,
            history,
            failures,
            task,
        }
    }

    /// The last credentials obtained before `t` that match `f`.
    fn latest_before(&self, t: std::time::Instant, f: impl Fn(&Holder) -> bool) -> Holder {
        self.history
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find(|(at, h)| *at < t && f(h))
            .map(|(_, h)| h.clone())
            .expect("a matching holder from before the phase change")
    }

    /// Waits for credentials matching `f`.
    async fn latest(&self, what: &str, f: impl Fn(&Holder) -> bool) -> Holder {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(h) = self
                .history
                .lock()
                .unwrap()
                .iter()
                .rev()
                .find(|(_, h)| f(h))
            {
                return h.1.clone();
            }
            assert!(std::time::Instant::now() < deadline, "no {what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits for credentials obtained after `t`.
    async fn latest_after(&self, t: std::time::Instant) -> Holder {
        loop {
            if let Some(h) = self
                .history
                .lock()
                .unwrap()
                .iter()
                .rev()
                .find(|(at, _)| *at > t)
            {
                return h.1.clone();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn stop(self) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        let f = self.failures.lock().unwrap().clone();
        f
    }
}

/// Istio's Go CA client: first a pod-bound token, then mTLS renewals with
/// what it got, each time verifying the chain with Istio's own checks
/// against the trust it holds.
struct IstioClient {
    bin: PathBuf,
    dir: tempfile::TempDir,
    token_file: PathBuf,
    id: String,
}

impl IstioClient {
    async fn run(
        &self,
        addr: std::net::SocketAddr,
        mtls: bool,
    ) -> Result<serde_json::Value, String> {
        let d = self.dir.path();
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.args(["--addr", &format!("localhost:{}", addr.port())])
            .arg("--root")
            .arg(d.join("root-cert.pem"))
            .args(["--ttl", "5s", "--ec", "--timeout", "30s", "--out"])
            .arg(d);
        if mtls {
            cmd.arg("--cert")
                .arg(d.join("cert-chain.pem"))
                .arg("--key")
                .arg(d.join("key.pem"));
        } else {
            cmd.arg("--token-file")
                .arg(&self.token_file)
                .args(["--identity", &self.id]);
        }
        let out = cmd.output().await.unwrap();
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let ok = v["verified"] == true && v["identity"] == self.id.as_str() && v["token"] == !mtls;
        if ok {
            Ok(v)
        } else {
            Err(format!("unexpected result {v}"))
        }
    }
}

/// When a renewal by Istio's client started, and its result.
type AgentRun = (std::time::Instant, Result<serde_json::Value, String>);

/// Istio's client as an agent: renews over mTLS at about half its 5s
/// lifetime with what it holds, for the whole rotation.
struct IstioAgent {
    stop: Arc<AtomicBool>,
    runs: Arc<Mutex<Vec<AgentRun>>>,
    task: tokio::task::JoinHandle<()>,
}

impl IstioAgent {
    fn start(client: IstioClient, addr: std::net::SocketAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let runs = Arc::new(Mutex::new(Vec::new()));
        let (s, r) = (stop.clone(), runs.clone());
        let task = tokio::spawn(async move {
            while !s.load(Ordering::Relaxed) {
                let started = std::time::Instant::now();
                let res = client.run(addr, true).await;
                r.lock().unwrap().push((started, res));
                tokio::time::sleep(Duration::from_millis(1500)).await;
            }
        });
        Self { stop, runs, task }
    }

    /// Waits for a successful renewal that started after `since`.
    async fn renewed_since(&self, since: std::time::Instant, when: &str) -> serde_json::Value {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(v) = self
                .runs
                .lock()
                .unwrap()
                .iter()
                .find(|(t, r)| *t >= since && r.is_ok())
                .map(|(_, r)| r.clone().unwrap())
            {
                return v;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{when}: no renewal by Istio's client"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn stop(self) -> Vec<String> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        let runs = self.runs.lock().unwrap();
        assert!(
            runs.len() >= 5,
            "Istio's client renewed {} times",
            runs.len()
        );
        runs.iter().filter_map(|(_, r)| r.clone().err()).collect()
    }
}

fn caclient() -> PathBuf {
    let p = std::env::var_os("MESHCA_ISTIO_CACLIENT")
        .map(PathBuf::from)
        .expect("MESHCA_ISTIO_CACLIENT is not set: export MESHCA_ISTIO_CACLIENT=$(scripts/istio-caclient)");
    assert!(
        p.is_file(),
        "MESHCA_ISTIO_CACLIENT={} is not a file",
        p.display()
    );
    p
}

/// A new intermediate under `ca`'s root (same-root rotation).
fn same_root_generation(ca: &GeneratedCa) -> GeneratedCa {
    testing::new_intermediate(ca, OffsetDateTime::now_utc() - time::Duration::minutes(1))
}

fn stage(dir: &Path, ca: &GeneratedCa) {
    let tmp = dir.with_extension("staging");
    let _ = std::fs::remove_dir_all(&tmp);
    generate::write_cacerts(&tmp, ca, true).unwrap();
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&tmp, dir).unwrap();
}

/// The whole thing: root rotation, then an intermediate rotation under
/// the new root, under load, against the real API server.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn root_and_intermediate_rotation_under_load_with_zero_failed_requests() {
    let bin = caclient();
    let k = common::kte().await;
    let tmp = tempfile::tempdir().unwrap();
    let (ca_dir, next_dir) = (tmp.path().join("cacerts"), tmp.path().join("next"));
    let now = OffsetDateTime::now_utc() - time::Duration::minutes(1);
    let gen1 = generate::generate(&InitOptions::default(), now).unwrap();
    let gen2 = generate::generate(&InitOptions::default(), now).unwrap();
    assert_ne!(gen1.root_cert, gen2.root_cert);
    generate::write_cacerts(&ca_dir, &gen1, false).unwrap();

    // Namespace the publisher writes to, selected by a label only it has.
    let tag = common::unique("rot");
    let ns = k.namespace("rotation").await;
    Api::<k8s_openapi::api::core::v1::Namespace>::all(k.admin.clone())
        .patch(
            &ns,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"meshca-rotation": tag}}})),
        )
        .await
        .unwrap();
    k.service_account(&ns, "app").await;
    let uid = k.pod(&ns, "app-0", "app", "node-a").await;
    let token = k.token(&ns, "app", Some(("app-0", &uid)), "istio-ca").await;

    let settings = RotationSettings {
        next_dir: next_dir.clone(),
        state_file: tmp.path().join("state/rotation.json"),
        mark_slack: Duration::from_secs(1),
    };
    let mut cfg = testing::test_config(ca_dir.clone());
    cfg.ttl = TtlPolicy {
        default: TTL,
        max: TTL,
        jitter: None,
    };
    cfg.reload_poll = Duration::from_millis(200);
    cfg.serving_names.push("istiod.istio-system.svc".into());
    cfg.kube = Some(KubeSettings {
        // The admin identity stands in for the chart's publisher RBAC
        // (tests/rootpub.rs runs the publisher with exactly those rules).
        kubeconfig: Some(k.dir.join("admin.kubeconfig")),
        token_cache_ttl: Duration::from_secs(60),
        tokenreview_timeout: Duration::from_secs(3),
        review_limits: Default::default(),
        token_verification: Default::default(),
        pod_index_sync_wait: Duration::from_secs(3),
    });
    cfg.root_publisher = Some(meshca::rootpub::RootPublisherSettings {
        configmap_name: CM.into(),
        namespace_selector: Some(format!("meshca-rotation={tag}")),
        resync: Duration::from_secs(600),
    });
    // The ClusterTrustBundle next to the ConfigMap, on a signer of its own
    // (Istio's layout: <signer with / as :>:root-cert).
    let ctb_signer = format!("{tag}.meshca.test/istiod-ca");
    let ctb = meshca::ctb::CtbSettings {
        name: meshca::podcert::trust_bundle_name(&ctb_signer),
        signer_name: ctb_signer.clone(),
        resync: Duration::from_secs(600),
    };
    cfg.cluster_trust_bundle = Some(ctb.clone());
    cfg.rotation = Some(settings.clone());
    let (app, audit) = testing::start_server(&cfg, Default::default()).await;
    let addr = app.addr;

    // Seeds: workload identities bootstrapped from generation 1.
    let bootstrap = |id: &str| {
        let b = meshca::ca::CaBundle::load_dir(&ca_dir, OffsetDateTime::now_utc()).unwrap();
        let (chain, key) = testing::client_identity(&b, id, &testing::validity_hours(0, 1));
        Holder {
            id: id.into(),
            not_after: not_after(&chain),
            chain,
            key,
            trust: gen1.root_cert.clone(),
        }
    };
    let seeds: Vec<Holder> = (0..4)
        .map(|i| bootstrap(&format!("spiffe://cluster.local/ns/load/sa/w{i}")))
        .collect();
    let probe_seed = bootstrap("spiffe://cluster.local/ns/app/sa/probe");
    let load = Load::start(addr, seeds);

    // Istio's client: pod-bound token first (trust from the ConfigMap), then mTLS.
    let istio = IstioClient {
        bin,
        dir: tempfile::tempdir().unwrap(),
        token_file: tmp.path().join("istio-token"),
        id: common::spiffe(&ns, "app"),
    };
    std::fs::write(&istio.token_file, format!("{token}\n")).unwrap();
    wait_configmap(&k, &ns, &gen1.root_cert, "idle").await;
    wait_ctb(&k, &ctb.name, &ctb_signer, &gen1.root_cert, "idle").await;
    std::fs::write(istio.dir.path().join("root-cert.pem"), &gen1.root_cert).unwrap();
    istio
        .run(addr, false)
        .await
        .expect("idle: Istio's client with a pod-bound token");
    istio
        .run(addr, true)
        .await
        .expect("idle: Istio's client renewing over mTLS");
    let agent = IstioAgent::start(istio, addr);

    // A probe workload renewing every 300 ms; at each phase change its last
    // credentials from before the change meet fresh ones from after it.
    let probe = Probe::start(addr, probe_seed);
    let issuer_is =
        |h: &Holder, ca: &GeneratedCa| pem_certs(&h.chain)[1] == pem_certs(&ca.ca_cert)[0];
    let union = format!("{}{}", gen1.root_cert, gen2.root_cert);
    let p0 = probe
        .latest("idle holder", |h| {
            der_set(&h.trust) == der_set(&gen1.root_cert)
        })
        .await;

    // Trust: stage generation 2.
    stage(&next_dir, &gen2);
    wait_phase(&ca_dir, &settings, Phase::Trust, Duration::from_secs(10)).await;
    let trust_seen = std::time::Instant::now();
    let before = probe.latest_before(trust_seen, |h| {
        der_set(&h.trust) == der_set(&gen1.root_cert)
    });
    let after = probe
        .latest("trust holder", |h| der_set(&h.trust) == der_set(&union))
        .await;
    assert_eq!(
        pem_certs(&after.trust).len(),
        2,
        "trust: both roots in the last element"
    );
    assert!(issuer_is(&after, &gen1), "trust: generation 1 still signs");
    handshakes_both_ways(&before, &after, "idle -> trust").await;
    wait_configmap(&k, &ns, &union, "trust").await;
    wait_ctb(&k, &ctb.name, &ctb_signer, &union, "trust").await;
    let v = agent.renewed_since(trust_seen, "trust").await;
    assert_eq!(
        der_set(v["rootCert"].as_str().unwrap()),
        der_set(&union),
        "trust: {v}"
    );

    // Switched: only once every leaf issued before trust has expired.
    wait_phase(&ca_dir, &settings, Phase::Switched, Duration::from_secs(30)).await;
    let switch_seen = std::time::Instant::now();
    let st = rotation_status(&ca_dir, &settings);
    let switched_at = st.progress.switched_at.unwrap();
    assert!(
        switched_at >= p0.not_after,
        "switched at {switched_at} while a pre-trust leaf was valid until {}",
        p0.not_after
    );
    assert!(
        switched_at >= st.progress.pre_trust_max_not_after.unwrap(),
        "the gate is the recorded mark"
    );
    let before = probe.latest_before(switch_seen, |h| issuer_is(h, &gen1));
    let after = probe
        .latest("switched holder", |h| issuer_is(h, &gen2))
        .await;
    assert_eq!(der_set(&after.trust), der_set(&union));
    handshakes_both_ways(&before, &after, "trust -> switched").await;
    wait_configmap(&k, &ns, &union, "switched").await;
    wait_ctb(&k, &ctb.name, &ctb_signer, &union, "switched").await;
    agent.renewed_since(switch_seen, "switched").await;

    // Retired: once the last leaf signed by generation 1 has expired.
    wait_phase(&ca_dir, &settings, Phase::Retired, Duration::from_secs(30)).await;
    let retire_seen = std::time::Instant::now();
    let st = rotation_status(&ca_dir, &settings);
    let retired_at = st.progress.retired_at.unwrap();
    let last_old = probe.latest_before(retire_seen, |h| issuer_is(h, &gen1));
    assert!(
        retired_at >= last_old.not_after,
        "retired while a leaf of generation 1 was valid"
    );
    let before = probe.latest_before(retire_seen, |h| {
        der_set(&h.trust) == der_set(&union) && issuer_is(h, &gen2)
    });
    let after = probe
        .latest("retired holder", |h| {
            der_set(&h.trust) == der_set(&gen2.root_cert)
        })
        .await;
    handshakes_both_ways(&before, &after, "switched -> retired").await;
    wait_configmap(&k, &ns, &gen2.root_cert, "retired").await;
    wait_ctb(&k, &ctb.name, &ctb_signer, &gen2.root_cert, "retired").await;
    let v = agent.renewed_since(retire_seen, "retired").await;
    assert_eq!(
        der_set(v["rootCert"].as_str().unwrap()),
        der_set(&gen2.root_cert),
        "retired: {v}"
    );

    // Promote: generation 2 into the CA directory, nothing staged.
    stage(&ca_dir, &gen2);
    std::fs::remove_dir_all(&next_dir).unwrap();
    wait_phase(&ca_dir, &settings, Phase::Idle, Duration::from_secs(10)).await;
    let idle_seen = std::time::Instant::now();
    let before = probe.latest_before(idle_seen, |_| true);
    let after = probe.latest_after(idle_seen).await;
    handshakes_both_ways(&before, &after, "retired -> idle").await;

    // New intermediate, same root: no gate has anything to wait for.
    let gen3 = same_root_generation(&gen2);
    stage(&next_dir, &gen3);
    wait_phase(&ca_dir, &settings, Phase::Retired, Duration::from_secs(10)).await;
    let intermediate_seen = std::time::Instant::now();
    let before = probe.latest_before(intermediate_seen, |h| issuer_is(h, &gen2));
    let after = probe
        .latest("new intermediate holder", |h| issuer_is(h, &gen3))
        .await;
    assert_eq!(der_set(&after.trust), der_set(&gen2.root_cert));
    handshakes_both_ways(&before, &after, "intermediate rotation").await;
    wait_configmap(&k, &ns, &gen2.root_cert, "intermediate rotation").await;
    wait_ctb(
        &k,
        &ctb.name,
        &ctb_signer,
        &gen2.root_cert,
        "intermediate rotation",
    )
    .await;
    agent
        .renewed_since(intermediate_seen, "intermediate rotation")
        .await;
    let agent_failures = agent.stop().await;
    assert!(
        agent_failures.is_empty(),
        "Istio's client failed: {agent_failures:?}"
    );
    let probe_failures = probe.stop().await;
    assert!(
        probe_failures.is_empty(),
        "probe renewals failed: {probe_failures:?}"
    );

    let (ok, failures) = load.stop().await;
    assert!(
        failures.is_empty(),
        "{} failed requests, first: {:?}",
        failures.len(),
        failures.first()
    );
    assert!(ok > 50, "the load ran ({ok} renewals)");
    eprintln!("rotation under load: {ok} renewals, 0 failed");

    // Every phase change is in the audit log.
    let steps: Vec<String> = audit
        .records()
        .iter()
        .filter_map(|r| r.rotation_step.clone())
        .collect();
    for want in [
        "idle->trust",
        "trust->switched",
        "switched->retired",
        "retired->idle",
    ] {
        assert!(
            steps.iter().any(|s| s == want),
            "no audit record for {want}: {steps:?}"
        );
    }
    app.shutdown().await.unwrap();
}

/// An operator forces the switch before its gate opens: the server takes
/// the step at its next poll and the audit log names who and why; a force
/// that fits no phase is refused in the audit log.
#[tokio::test]
async fn forced_switch_is_applied_and_audited() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca_dir, next_dir) = (tmp.path().join("cacerts"), tmp.path().join("next"));
    let now = OffsetDateTime::now_utc() - time::Duration::minutes(1);
    let gen1 = generate::generate(&InitOptions::default(), now).unwrap();
    let gen2 = generate::generate(&InitOptions::default(), now).unwrap();
    generate::write_cacerts(&ca_dir, &gen1, false).unwrap();
    let settings = RotationSettings {
        next_dir: next_dir.clone(),
        state_file: tmp.path().join("rotation.json"),
        mark_slack: Duration::from_secs(1),
    };
    let mut cfg = testing::test_config(ca_dir.clone());
    cfg.reload_poll = Duration::from_millis(100);
    cfg.rotation = Some(settings.clone());
    let (app, audit) = testing::start_server(&cfg, Default::default()).await;
    meshca::rotation::request_force(&settings, Step::Retire, "too early", "tester").unwrap();
    stage(&next_dir, &gen2);
    wait_phase(&ca_dir, &settings, Phase::Trust, Duration::from_secs(10)).await;
    // The default 24h TTL keeps the gate closed for a day.
    let st = rotation_status(&ca_dir, &settings);
    assert!(st.waiting.unwrap().until.unwrap() > OffsetDateTime::now_utc().unix_timestamp() + 3600);
    meshca::rotation::request_force(&settings, Step::Switch, "incident 42", "tester").unwrap();
    wait_phase(&ca_dir, &settings, Phase::Switched, Duration::from_secs(10)).await;
    assert_eq!(app.ca.snapshot().key_id(), {
        let b = meshca::ca::CaBundle::load_dir(&next_dir, OffsetDateTime::now_utc()).unwrap();
        b.key_id().to_string()
    });
    let (_, metrics) = testing::http_get(app.admin_addr, "/metrics").await;
    assert!(metrics.contains("meshca_rotation_phase 2"), "{metrics}");
    assert!(
        metrics.contains("meshca_rotation_trusted_roots 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("meshca_ca_reloads_total{result=\"swapped\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("meshca_rotation_transitions_total{to=\"switched\",forced=\"true\"} 1"),
        "{metrics}"
    );
    // The operator's view, from the state on disk.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshca"))
        .args(["rotate", "status", "--ca-dir"])
        .arg(&ca_dir)
        .arg("--rotation-next-dir")
        .arg(&next_dir)
        .arg("--rotation-state")
        .arg(&settings.state_file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("phase: switched"), "{text}");
    assert!(
        text.contains("waiting for: leaves signed by the old CA to expire"),
        "{text}"
    );
    assert!(text.contains("ETA"), "{text}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshca"))
        .args(["rotate", "plan", "--ca-dir"])
        .arg(&ca_dir)
        .arg("--rotation-next-dir")
        .arg(&next_dir)
        .arg("--rotation-state")
        .arg(&settings.state_file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("retire: at"), "{text}");
    assert!(text.contains("promote:"), "{text}");
    let recs = audit.records();
    let forced = recs
        .iter()
        .find(|r| r.rotation_step.as_deref() == Some("trust->switched"))
        .expect("switch audited");
    assert_eq!(
        forced.rotation_forced.as_deref(),
        Some("tester (incident 42)")
    );
    assert_eq!(forced.reason, "ca_rotation_switch");
    let ignored = recs
        .iter()
        .find(|r| r.reason == "ca_rotation_force_ignored")
        .expect("the early retire is refused in the audit log");
    assert!(ignored
        .rotation_forced
        .as_deref()
        .unwrap()
        .contains("too early"));
    app.shutdown().await.unwrap();
}

/// A URI-name-constrained intermediate (RFC 5280 host form) as the CA:
/// it loads, and its leaves renew over mTLS (webpki alone refuses every
/// URI SAN under a URI constraint); a caller outside the constraint is
/// refused at the handshake, and meshca will not issue outside it.
#[tokio::test]
async fn name_constrained_intermediate_serves_mtls_renewal_and_confines_identities() {
    use rcgen::{CustomExtension, Issuer};
    let now = OffsetDateTime::now_utc() - time::Duration::minutes(1);
    let root_key = KeyPair::generate().unwrap();
    let root_p =
        generate::ca_params("root", "o", now, now + time::Duration::days(10), None).unwrap();
    let root = root_p.self_signed(&root_key).unwrap();
    let root_iss = Issuer::new(root_p, root_key);
    let key = KeyPair::generate().unwrap();
    let mut p = generate::ca_params(
        "constrained",
        "o",
        now,
        now + time::Duration::days(5),
        Some(0),
    )
    .unwrap();
    p.use_authority_key_identifier_extension = true;
    let host = b"cluster.local";
    // NameConstraints { permittedSubtrees [0] { GeneralSubtree { uniformResourceIdentifier [6] } } }
    let name = [&[0x86, host.len() as u8][..], host].concat();
    let subtree = [&[0x30, name.len() as u8][..], &name].concat();
    let permitted = [&[0xa0, subtree.len() as u8][..], &subtree].concat();
    let nc = [&[0x30, permitted.len() as u8][..], &permitted].concat();
    let mut ext = CustomExtension::from_oid_content(&[2, 5, 29, 30], nc);
    ext.set_criticality(true);
    p.custom_extensions = vec![ext];
    let ca = p.signed_by(&key, &root_iss).unwrap();
    let gen = GeneratedCa {
        root_cert: root.pem(),
        root_key: root_iss.key().serialize_pem(),
        ca_cert: ca.pem(),
        ca_key: key.serialize_pem(),
    };
    let tmp = tempfile::tempdir().unwrap();
    let ca_dir = tmp.path().join("cacerts");
    generate::write_cacerts(&ca_dir, &gen, false).unwrap();
    let mut cfg = testing::test_config(ca_dir.clone());
    cfg.trust_domain_aliases = vec![meshca::identity::TrustDomain::new("other.domain").unwrap()];
    let (app, audit) = testing::start_server(&cfg, Default::default()).await;
    let bundle = app.ca.snapshot();
    assert_eq!(bundle.uri_constraints().len(), 1);

    let inside = "spiffe://cluster.local/ns/a/sa/b";
    let (chain, key_pem) =
        testing::client_identity(&bundle, inside, &testing::validity_hours(0, 1));
    let seed = Holder {
        id: inside.into(),
        not_after: not_after(&chain),
        chain,
        key: key_pem,
        trust: gen.root_cert.clone(),
    };
    let renewed = renew_with(app.addr, &seed, false)
        .await
        .expect("renewal over mTLS under a URI-constrained intermediate");
    renew_with(app.addr, &renewed, false)
        .await
        .expect("and again with what it got");

    // A leaf the signing key made for an identity the constraint excludes
    // (meshca itself refuses to issue it): the handshake refuses it.
    let outside = "spiffe://other.domain/ns/a/sa/b";
    let err = bundle
        .client_identity(&outside.parse().unwrap(), &testing::validity_hours(0, 1))
        .unwrap_err();
    assert_eq!(err.reason(), "sign_outside_name_constraints");
    let k = KeyPair::generate().unwrap();
    let mut lp = rcgen::CertificateParams::default();
    lp.subject_alt_names = vec![rcgen::SanType::URI(outside.try_into().unwrap())];
    lp.is_ca = rcgen::IsCa::ExplicitNoCa;
    lp.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    lp.use_authority_key_identifier_extension = true;
    let leaf = testing::sign_custom(&bundle, &lp, &k);
    let forged = Holder {
        id: outside.into(),
        not_after: 0,
        chain: format!("{leaf}{}", gen.ca_cert),
        key: k.serialize_pem(),
        trust: gen.root_cert.clone(),
    };
    renew_with(app.addr, &forged, false).await.unwrap_err();
    // Rejected handshakes are audited aggregated, flushed at shutdown.
    app.shutdown().await.unwrap();
    let reasons: Vec<String> = audit.records().iter().map(|r| r.reason.clone()).collect();
    assert!(
        reasons
            .iter()
            .any(|r| r == "tls_handshake_rejected:mtls_outside_name_constraints"),
        "{reasons:?}"
    );
}

/// The standalone ClusterTrustBundle publisher holding exactly the chart's
/// rules (tests/fixtures/rbac-cluster-trust-bundle.yaml, on a signer of its
/// own) creates and updates its bundle; the same identity may not link a
/// bundle to another signer (no `attest`) nor read another bundle.
#[tokio::test]
async fn cluster_trust_bundle_publisher_runs_with_exactly_the_fixture_rules() {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    use kube::api::PostParams;
    let k = common::kte().await;
    let signer = format!("{}.meshca.test/istiod-ca", common::unique("ctb"));
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/rbac-cluster-trust-bundle.yaml"
    ))
    .unwrap()
    .replace("istio.io/istiod-ca", &signer)
    .replace("istio.io:istiod-ca", &signer.replace('/', ":"));
    let mut role: ClusterRole = serde_yaml_ng::from_str(&text).unwrap();
    let role_name = common::unique("ctb-publisher");
    role.metadata.name = Some(role_name.clone());
    Api::<ClusterRole>::all(k.admin.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": role_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "meshca"}]
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(k.admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let meshca = common::client(&k.meshca_kubeconfig()).await;
    let api = Api::<ClusterTrustBundle>::all(meshca.clone());
    let name = meshca::podcert::trust_bundle_name(&signer);
    // The RBAC authorizer reads bindings through an informer.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while api.get_opt(&name).await.is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "fixture RBAC never took effect"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let now = OffsetDateTime::now_utc();
    let gen1 = generate::generate(&InitOptions::default(), now).unwrap();
    let gen2 = generate::generate(&InitOptions::default(), now).unwrap();
    let (tx, rx) = tokio::sync::watch::channel(vec![gen1.root_cert.clone()]);
    let settings = meshca::ctb::CtbSettings {
        name: name.clone(),
        signer_name: signer.clone(),
        resync: Duration::from_secs(600),
    };
    let task = tokio::spawn(meshca::ctb::run(meshca.clone(), settings, rx));
    wait_ctb(&k, &name, &signer, &gen1.root_cert, "created").await;
    tx.send(vec![gen1.root_cert.clone(), gen2.root_cert.clone()])
        .unwrap();
    let union = format!("{}{}", gen1.root_cert, gen2.root_cert);
    wait_ctb(&k, &name, &signer, &union, "old + new").await;
    tx.send(vec![gen2.root_cert.clone()]).unwrap();
    wait_ctb(&k, &name, &signer, &gen2.root_cert, "new").await;
    task.abort();

    // Least privilege, as the API server enforces it.
    let other = format!("{}.meshca.test/other", common::unique("ctb"));
    let obj: ClusterTrustBundle = serde_json::from_value(json!({
        "metadata": {"name": meshca::podcert::trust_bundle_name(&other)},
        "spec": {
            "signerName": other,
            "trustBundle": meshca::ctb::trust_bundle(std::slice::from_ref(&gen1.root_cert)).unwrap(),
        }
    }))
    .unwrap();
    match api.create(&PostParams::default(), &obj).await {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 403, "another signer: {e:?}"),
        other => panic!("a bundle for an unattested signer: {other:?}"),
    }
    let sibling = format!("{}:other", signer.replace('/', ":"));
    match api.get(&sibling).await {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 403, "another name: {e:?}"),
        other => panic!("read a bundle outside resourceNames: {other:?}"),
    }
}

/// A root rotation with two-tier issuing (MESHCA_ISSUING_CA=on, file
/// signer) under load, against the real API server: the rotation swaps
/// the custody material and every swap re-mints the issuing CA under it,
/// including the trust phase, which only changes the roots. Not one
/// renewal fails; each response verifies to its own roots (webpki, and
/// openssl per issuing CA); each issuing CA is signed by the intermediate
/// of its phase's generation and audited before use; the ConfigMap follows
/// the phases; and the gates wait for the leaves the issuing CAs signed
/// (the issuance mark is kept on the issuing store). Issuing CAs of 8 s
/// also roll over at half-life while the rotation runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn root_rotation_with_two_tier_issuing_under_load() {
    use rotation_check::{check, Gen, Ident, Workers};
    let k = common::kte().await;
    let tmp = tempfile::tempdir().unwrap();
    let (ca_dir, next_dir) = (tmp.path().join("cacerts"), tmp.path().join("next"));
    let now = OffsetDateTime::now_utc() - time::Duration::minutes(1);
    let gen1 = generate::generate(&InitOptions::default(), now).unwrap();
    let gen2 = generate::generate(&InitOptions::default(), now).unwrap();
    generate::write_cacerts(&ca_dir, &gen1, false).unwrap();
    let tag = common::unique("rot2t");
    let ns = k.namespace("rotation-two-tier").await;
    Api::<k8s_openapi::api::core::v1::Namespace>::all(k.admin.clone())
        .patch(
            &ns,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"meshca-rotation": tag}}})),
        )
        .await
        .unwrap();
    let settings = RotationSettings {
        next_dir: next_dir.clone(),
        state_file: tmp.path().join("state/rotation.json"),
        mark_slack: Duration::from_secs(1),
    };
    let mut cfg = testing::test_config(ca_dir.clone());
    cfg.ttl = TtlPolicy {
        default: TTL,
        max: TTL,
        jitter: None,
    };
    cfg.reload_poll = Duration::from_millis(200);
    cfg.custody.issuing_ttl = Some(Duration::from_secs(8));
    cfg.kube = Some(KubeSettings {
        kubeconfig: Some(k.dir.join("admin.kubeconfig")),
        token_cache_ttl: Duration::from_secs(60),
        tokenreview_timeout: Duration::from_secs(3),
        review_limits: Default::default(),
        token_verification: Default::default(),
        pod_index_sync_wait: Duration::from_secs(3),
    });
    cfg.root_publisher = Some(meshca::rootpub::RootPublisherSettings {
        configmap_name: CM.into(),
        namespace_selector: Some(format!("meshca-rotation={tag}")),
        resync: Duration::from_secs(600),
    });
    cfg.rotation = Some(settings.clone());
    let (app, audit) = testing::start_server(&cfg, Default::default()).await;
    assert_eq!(
        app.ca.snapshot().signer().kind(),
        "memory",
        "two-tier is on"
    );

    let seeds: Vec<Ident> = (0..4)
        .map(|i| {
            let id = format!("spiffe://cluster.local/ns/load/sa/w{i}");
            let b = meshca::ca::CaBundle::load_dir(&ca_dir, OffsetDateTime::now_utc()).unwrap();
            let (chain, key) = testing::client_identity(&b, &id, &testing::validity_hours(0, 1));
            Ident {
                id,
                chain,
                key,
                trust: gen1.root_cert.clone(),
            }
        })
        .collect();
    let load = Workers::start(app.addr, seeds);
    wait_configmap(&k, &ns, &gen1.root_cert, "idle").await;
    load.seen_after(std::time::Instant::now(), "idle").await;

    stage(&next_dir, &gen2);
    let mut observed = Vec::new();
    let union = format!("{}{}", gen1.root_cert, gen2.root_cert);
    wait_phase(&ca_dir, &settings, Phase::Trust, Duration::from_secs(10)).await;
    observed.push((Phase::Trust, std::time::Instant::now()));
    wait_configmap(&k, &ns, &union, "trust").await;
    wait_phase(&ca_dir, &settings, Phase::Switched, Duration::from_secs(30)).await;
    observed.push((Phase::Switched, std::time::Instant::now()));
    wait_configmap(&k, &ns, &union, "switched").await;
    wait_phase(&ca_dir, &settings, Phase::Retired, Duration::from_secs(30)).await;
    observed.push((Phase::Retired, std::time::Instant::now()));
    wait_configmap(&k, &ns, &gen2.root_cert, "retired").await;
    load.seen_after(std::time::Instant::now(), "retired").await;
    let progress = rotation_status(&ca_dir, &settings).progress;

    // Promote: the rotation closes and the issuing CA stays under generation 2.
    stage(&ca_dir, &gen2);
    std::fs::remove_dir_all(&next_dir).unwrap();
    wait_phase(&ca_dir, &settings, Phase::Idle, Duration::from_secs(10)).await;
    load.seen_after(std::time::Instant::now(), "promoted").await;

    let (seen, failures) = load.stop().await;
    assert!(
        failures.is_empty(),
        "{} failed renewals, first: {:?}",
        failures.len(),
        failures.first()
    );
    let old = Gen {
        root: gen1.root_cert.clone(),
        intermediate: gen1.ca_cert.clone(),
    };
    let new = Gen {
        root: gen2.root_cert.clone(),
        intermediate: gen2.ca_cert.clone(),
    };
    let sum = check(&seen, &old, &new, true, &observed, &progress);
    // Every issuing CA that signed was audited before use, by the custody
    // key of its phase's generation.
    let key_of = |g: &GeneratedCa| {
        meshca::ca::CaBundle::from_files(
            meshca::ca::bundle::BundleFiles {
                signing_cert: g.ca_cert.clone(),
                signing_key: g.ca_key.clone(),
                cert_chain: g.cert_chain(),
                root_bundle: g.root_cert.clone(),
                source: "test".into(),
            },
            OffsetDateTime::now_utc(),
        )
        .unwrap()
        .key_id()
        .to_string()
    };
    let records = audit.records();
    for (phase, cert) in &sum.issuing {
        let rec = records
            .iter()
            .find(|r| r.certificate.as_deref() == Some(cert.as_str()))
            .unwrap_or_else(|| panic!("{phase:?}: issuing CA used without its audit record"));
        assert_eq!(rec.reason, "issuing_ca_issued");
        let want = if *phase <= Phase::Trust {
            key_of(&gen1)
        } else {
            key_of(&gen2)
        };
        assert_eq!(
            rec.issuer_key_id.as_deref(),
            Some(want.as_str()),
            "{phase:?}"
        );
    }
    eprintln!(
        "two-tier root rotation under load: {} responses, 0 failed; per phase {:?}; issuing CAs per phase {:?}; {} openssl verifications",
        sum.responses, sum.per_phase, sum.signers_per_phase, sum.openssl_runs
    );
    app.shutdown().await.unwrap();
}
