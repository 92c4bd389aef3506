//! meshca as a PodCertificateRequest signer against the real kube-apiserver
//! 1.37 (Node authorizer + NodeRestriction on, as scripts/kube-testenv runs
//! it). The tests act as kubelets: client certificates from the test
//! cluster's CA with CN=system:node:<name>, O=system:nodes, for pods whose
//! spec mounts a podCertificate volume for meshca's signer.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine;
use common::{kte, unique, Kte};
use k8s_openapi::api::certificates::v1::ClusterTrustBundle;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::Client;
use meshca::audit::{query, verify};
use meshca::ca::generate::KeyType;
use meshca::config::AuditSinkKind;
use meshca::podcert::PodCertSettings;
use meshca::testing::TestPki;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use serde_json::json;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use x509_parser::extensions::{GeneralName, ParsedExtension};

const SA: &str = "web";

fn pcr_resource() -> ApiResource {
    let gvk = GroupVersionKind::gvk("certificates.k8s.io", "v1", "PodCertificateRequest");
    ApiResource::from_gvk_with_plural(&gvk, "podcertificaterequests")
}

/// A client authenticated by a client certificate from the test cluster's
/// CA (`--client-ca-file`): CN is the user, each O a group.
async fn cert_client(k: &Kte, user: &str, groups: &[&str]) -> Client {
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
        .push(rcgen::DnType::CommonName, user);
    for g in groups {
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, *g);
    }
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::from_secs(3600);
    params.not_after = now + Duration::from_secs(86_400);
    let cert = params.signed_by(&key, &issuer).unwrap();
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let server = std::env::var("KTE_API_URL").unwrap_or_else(|_| {
        let conf = std::fs::read_to_string(k.dir.join("kte.conf")).unwrap();
        let port = conf
            .lines()
            .find_map(|l| l.strip_prefix("API_PORT="))
            .unwrap()
            .to_string();
        format!("https://127.0.0.1:{port}")
    });
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: kte\n  cluster:\n    server: {server}\n    certificate-authority-data: {}\nusers:\n- name: u\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\ncontexts:\n- name: u\n  context: {{cluster: kte, user: u}}\ncurrent-context: u\n",
        b64(&ca_pem),
        b64(&cert.pem()),
        b64(&key.serialize_pem()),
    );
    let path = k.dir.join(format!("{}.kubeconfig", unique("cert")));
    std::fs::write(&path, kubeconfig).unwrap();
    let client = common::client(&path).await;
    let _ = std::fs::remove_file(&path);
    client
}

async fn node_client(k: &Kte, node: &str) -> Client {
    cert_client(k, &format!("system:node:{node}"), &["system:nodes"]).await
}

/// Creates a Node object (no kubelet runs); returns its UID.
async fn node(k: &Kte, name: &str) -> String {
    let n: Node = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    Api::<Node>::all(k.admin.clone())
        .create(&PostParams::default(), &n)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap()
}

/// A pod on `node` running as `sa`, mounting meshca's pod certificate and
/// the signer's trust bundle; returns its UID.
async fn pod(k: &Kte, ns: &str, name: &str, sa: &str, node: &str, signer: &str) -> String {
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "nodeName": node, "serviceAccountName": sa, "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "app", "image": "example.invalid/app:0",
                "volumeMounts": [{"name": "mesh-identity", "mountPath": "/var/run/mesh", "readOnly": true}]}],
            "volumes": [{"name": "mesh-identity", "projected": {"sources": [
                {"podCertificate": {"signerName": signer, "keyType": "ECDSAP256",
                    "credentialBundlePath": "credential-bundle.pem"}},
                {"clusterTrustBundle": {"signerName": signer, "labelSelector": {}, "path": "roots.pem"}}
            ]}}]
        }
    }))
    .unwrap();
    Api::<Pod>::namespaced(k.admin.clone(), ns)
        .create(&PostParams::default(), &p)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap()
}

/// The RBAC a signer needs, exactly what the chart grants
/// (tests/fixtures/rbac-pod-certificate-signer.yaml with `signer` in place
/// of meshca.test/spiffe), for the static-token user `meshca`.
async fn grant_signer(k: &Kte, signer: &str) {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/rbac-pod-certificate-signer.yaml"
    ))
    .unwrap()
    .replace("meshca.test/spiffe", signer)
    .replace("meshca.test:spiffe", &signer.replace('/', ":"));
    let mut role: ClusterRole = serde_yaml_ng::from_str(&text).unwrap();
    role.metadata.name = Some(unique("podcert-signer"));
    bind(k, role, "meshca").await;
}

async fn bind(k: &Kte, role: ClusterRole, user: &str) {
    let name = role.metadata.name.clone().unwrap();
    Api::<ClusterRole>::all(k.admin.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(k.admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
}

/// Retries `f` while the API server answers with an error that is not a
/// 403: NodeRestriction and the authorizers read through informers.
async fn settle<T, F, Fut>(what: &str, mut f: F) -> Result<T, kube::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match f().await {
            Err(kube::Error::Api(e)) if e.code != 403 && Instant::now() < deadline => {
                tracing::debug!(what, error = %e.message, "retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            r => return r,
        }
    }
}

/// What a kubelet puts into a request.
#[derive(Clone)]
struct Ask<'a> {
    ns: &'a str,
    pod: &'a str,
    pod_uid: &'a str,
    sa: &'a str,
    sa_uid: &'a str,
    node: &'a str,
    node_uid: &'a str,
    signer: &'a str,
    key: &'a rcgen::KeyPair,
    max_expiration: Option<i64>,
    annotations: BTreeMap<String, String>,
}

/// The kubelet's empty stub CSR for `key`.
fn stub_csr(key: &rcgen::KeyPair) -> Vec<u8> {
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.serialize_request(key).unwrap().der().to_vec()
}

async fn create_pcr(client: &Client, a: &Ask<'_>) -> Result<DynamicObject, kube::Error> {
    let name = unique(&format!("{}-pcr", a.pod));
    let mut spec = json!({
        "signerName": a.signer, "podName": a.pod, "podUID": a.pod_uid,
        "serviceAccountName": a.sa, "serviceAccountUID": a.sa_uid,
        "nodeName": a.node, "nodeUID": a.node_uid,
        "stubPKCS10Request": base64::engine::general_purpose::STANDARD.encode(stub_csr(a.key)),
    });
    if let Some(m) = a.max_expiration {
        spec["maxExpirationSeconds"] = json!(m);
    }
    if !a.annotations.is_empty() {
        spec["unverifiedUserAnnotations"] = json!(a.annotations);
    }
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "certificates.k8s.io/v1", "kind": "PodCertificateRequest",
        "metadata": {"name": name, "namespace": a.ns}, "spec": spec
    }))
    .unwrap();
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), a.ns, &pcr_resource());
    let pp = PostParams::default();
    settle("create pcr", || api.create(&pp, &obj)).await
}

/// Waits for the terminal condition; returns (type, reason, status).
async fn terminal(admin: &Client, ns: &str, name: &str) -> (String, String, serde_json::Value) {
    let api: Api<DynamicObject> = Api::namespaced_with(admin.clone(), ns, &pcr_resource());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let o = api.get(name).await.unwrap();
        if let Some(c) = o.data["status"]["conditions"]
            .as_array()
            .and_then(|c| c.first())
        {
            return (
                c["type"].as_str().unwrap().to_string(),
                c["reason"].as_str().unwrap_or_default().to_string(),
                o.data["status"].clone(),
            );
        }
        assert!(Instant::now() < deadline, "{ns}/{name} never decided");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

struct Fixture {
    k: Kte,
    signer: String,
    ns: String,
    sa_uid: String,
    nodes: Vec<(String, String)>,
    pki: TestPki,
    audit: PathBuf,
    _dir: tempfile::TempDir,
    cfg: meshca::config::Config,
    app: meshca::app::App,
}

async fn fixture(nodes: usize) -> Fixture {
    let k = kte().await;
    let signer = format!("{}.meshca.test/spiffe", unique("podcert"));
    grant_signer(&k, &signer).await;
    let ns = k.namespace("podcert").await;
    k.service_account(&ns, SA).await;
    let sa_uid = k.service_account_uid(&ns, SA).await;
    let mut node_list = Vec::new();
    for _ in 0..nodes {
        let n = unique("node");
        let uid = node(&k, &n).await;
        node_list.push((n, uid));
    }
    // meshca starts only once its RBAC is in force (the authorizer reads
    // through an informer), so its watch does not begin with a backoff.
    let meshca = common::client(&k.meshca_kubeconfig()).await;
    let api: Api<DynamicObject> = Api::all_with(meshca, &pcr_resource());
    let deadline = Instant::now() + Duration::from_secs(20);
    while api.list(&Default::default()).await.is_err() {
        assert!(Instant::now() < deadline, "signer RBAC never took effect");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pki = TestPki::new(KeyType::EcdsaP256);
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.log");
    let mut cfg = common::kube_config(&pki, k.meshca_kubeconfig(), &[]);
    cfg.audit.sink = AuditSinkKind::File;
    cfg.audit.file = audit.clone();
    cfg.pod_certificates = Some(PodCertSettings {
        signer_name: signer.clone(),
        lifetime: Duration::from_secs(24 * 3600),
        refresh_band: meshca::ca::ttl::JitterBand::new(50, 75).unwrap(),
        pod_wait: Duration::from_secs(3),
        workers: std::env::var("MESHCA_PODCERT_WORKERS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(32),
        trust_bundle: true,
        trust_bundle_resync: Duration::from_secs(600),
    });
    let app = meshca::app::App::start(&cfg, Default::default())
        .await
        .unwrap();
    Fixture {
        k,
        signer,
        ns,
        sa_uid,
        nodes: node_list,
        pki,
        audit,
        _dir: dir,
        cfg,
        app,
    }
}

fn pem_certs(text: &str) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_slice_iter(text.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap()
}

fn time_of(v: &serde_json::Value) -> OffsetDateTime {
    OffsetDateTime::parse(v.as_str().unwrap(), &Rfc3339).unwrap()
}

/// `openssl verify` of the chain against the root, as an independent verifier.
fn openssl_verify(dir: &Path, root_pem: &str, chain: &[CertificateDer<'static>]) {
    let enc = |d: &CertificateDer<'_>| {
        let b64 = base64::engine::general_purpose::STANDARD.encode(d.as_ref());
        let body: Vec<_> = b64
            .as_bytes()
            .chunks(64)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect();
        format!(
            "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
            body.join("\n")
        )
    };
    std::fs::write(dir.join("root.pem"), root_pem).unwrap();
    std::fs::write(dir.join("leaf.pem"), enc(&chain[0])).unwrap();
    let inter: String = chain[1..].iter().map(enc).collect();
    std::fs::write(dir.join("untrusted.pem"), inter).unwrap();
    let out = std::process::Command::new("openssl")
        .current_dir(dir)
        .args([
            "verify",
            "-CAfile",
            "root.pem",
            "-untrusted",
            "untrusted.pem",
            "-purpose",
            "sslclient",
            "leaf.pem",
        ])
        .output()
        .expect("openssl is installed");
    assert!(
        out.status.success(),
        "openssl verify: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelets_get_svids_and_every_refusal_has_its_reason() {
    let f = fixture(2).await;
    let k = &f.k;
    let (node_a, uid_a) = f.nodes[0].clone();
    let (node_b, uid_b) = f.nodes[1].clone();
    let pod_uid = pod(k, &f.ns, "web-0", SA, &node_a, &f.signer).await;
    let kubelet_a = node_client(k, &node_a).await;
    let kubelet_b = node_client(k, &node_b).await;
    let key = rcgen::KeyPair::generate().unwrap();
    let base = Ask {
        ns: &f.ns,
        pod: "web-0",
        pod_uid: &pod_uid,
        sa: SA,
        sa_uid: &f.sa_uid,
        node: &node_a,
        node_uid: &uid_a,
        signer: &f.signer,
        key: &key,
        max_expiration: Some(7200),
        annotations: BTreeMap::new(),
    };
    let on_b = Ask {
        node: &node_b,
        node_uid: &uid_b,
        ..base.clone()
    };
    let mut decided = Vec::new();

    // Good path: the kubelet of the pod's node asks; Issued.
    let created = create_pcr(&kubelet_a, &base).await.unwrap();
    let name = created.metadata.name.clone().unwrap();
    let (cond, _, status) = terminal(&k.admin, &f.ns, &name).await;
    assert_eq!(cond, "Issued", "{status}");
    decided.push(created.metadata.uid.clone().unwrap());
    let chain = pem_certs(status["certificateChain"].as_str().unwrap());
    assert!(chain.len() >= 2, "leaf then intermediates");
    let roots = pem_certs(&f.pki.ca.root_cert);
    assert!(
        chain.iter().all(|c| !roots.contains(c)),
        "no root in the chain"
    );
    let dir = tempfile::tempdir().unwrap();
    openssl_verify(dir.path(), &f.pki.ca.root_cert, &chain);
    let (_, leaf) = x509_parser::parse_x509_certificate(&chain[0]).unwrap();
    assert!(leaf.subject().as_raw().len() <= 2, "empty subject");
    let mut uris = Vec::new();
    let (mut ku, mut eku, mut ca_false, mut san_critical) = (false, false, false, false);
    for ext in leaf.extensions() {
        match ext.parsed_extension() {
            ParsedExtension::SubjectAlternativeName(san) => {
                san_critical = ext.critical;
                for n in &san.general_names {
                    match n {
                        GeneralName::URI(u) => uris.push(u.to_string()),
                        other => panic!("unexpected SAN {other:?}"),
                    }
                }
            }
            ParsedExtension::KeyUsage(k) => ku = k.digital_signature() && !k.key_cert_sign(),
            ParsedExtension::ExtendedKeyUsage(e) => eku = e.server_auth && e.client_auth,
            ParsedExtension::BasicConstraints(bc) => ca_false = !bc.ca && ext.critical,
            _ => {}
        }
    }
    assert_eq!(
        uris,
        vec![format!("spiffe://cluster.local/ns/{}/sa/{SA}", f.ns)]
    );
    assert!(
        san_critical && ku && eku && ca_false,
        "leaf profile: san_critical={san_critical} ku={ku} eku={eku} ca_false={ca_false}"
    );
    assert_eq!(
        leaf.public_key().raw,
        &rcgen::PublicKeyData::subject_public_key_info(&key)[..],
        "issued to the requested key"
    );
    let (nb, na, refresh) = (
        time_of(&status["notBefore"]),
        time_of(&status["notAfter"]),
        time_of(&status["beginRefreshAt"]),
    );
    assert_eq!(leaf.validity().not_before.to_datetime(), nb);
    assert_eq!(leaf.validity().not_after.to_datetime(), na);
    assert_eq!(
        (na - nb).whole_seconds(),
        7200,
        "cut to maxExpirationSeconds"
    );
    assert!((nb - OffsetDateTime::now_utc()).whole_seconds().abs() < 300);
    assert!(refresh >= nb + Duration::from_secs(600) && refresh <= na - Duration::from_secs(600));

    // Another node asking for that pod: refused by the API server itself.
    let other = create_pcr(&kubelet_b, &on_b).await;
    match other {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 403, "{e:?}"),
        r => panic!("node {node_b} got a PCR for a pod on {node_a}: {r:?}"),
    }
    // ... also when it names the pod's node instead of its own.
    match create_pcr(&kubelet_b, &base).await {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 403, "{e:?}"),
        r => panic!("node {node_b} created a PCR naming {node_a}: {r:?}"),
    }

    // An admin (not restricted by NodeRestriction) asks for the pod on the
    // wrong node, or with the wrong service account: meshca denies.
    k.service_account(&f.ns, "admin").await;
    let admin_sa_uid = k.service_account_uid(&f.ns, "admin").await;
    let wrong_node = on_b.clone();
    let wrong_sa = Ask {
        sa: "admin",
        sa_uid: &admin_sa_uid,
        ..base.clone()
    };
    for (a, want) in [
        (wrong_node, "MeshcaPodNotOnNode"),
        (wrong_sa, "MeshcaServiceAccountMismatch"),
    ] {
        let o = create_pcr(&k.admin, &a).await.unwrap();
        let (cond, reason, status) =
            terminal(&k.admin, &f.ns, o.metadata.name.as_ref().unwrap()).await;
        assert_eq!(
            (cond.as_str(), reason.as_str()),
            ("Denied", want),
            "{status}"
        );
        assert!(status.get("certificateChain").is_none());
        decided.push(o.metadata.uid.unwrap());
    }

    // The kubelet itself, with a key type meshca does not sign, and with an
    // annotation meshca does not know: the API's own reasons.
    let p521 = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P521_SHA512).unwrap();
    let bad_key = Ask {
        key: &p521,
        ..base.clone()
    };
    let mut annotated = base.clone();
    annotated.annotations.insert(
        "meshca.test/spiffe-path".into(),
        "/ns/kube-system/sa/admin".into(),
    );
    for (a, want) in [
        (bad_key, "UnsupportedKeyType"),
        (annotated, "InvalidUnverifiedUserAnnotations"),
    ] {
        let o = create_pcr(&kubelet_a, &a).await.unwrap();
        let (cond, reason, status) =
            terminal(&k.admin, &f.ns, o.metadata.name.as_ref().unwrap()).await;
        assert_eq!(
            (cond.as_str(), reason.as_str()),
            ("Denied", want),
            "{status}"
        );
        if want == "UnsupportedKeyType" {
            let msg = status["conditions"][0]["message"].as_str().unwrap();
            assert!(msg.contains("ECDSAP256"), "a suggested key type: {msg}");
        }
        decided.push(o.metadata.uid.unwrap());
    }

    // The ClusterTrustBundle carries the root, linked to the signer.
    let ctb_name = meshca::podcert::trust_bundle_name(&f.signer);
    let api = Api::<ClusterTrustBundle>::all(k.admin.clone());
    let deadline = Instant::now() + Duration::from_secs(20);
    let ctb = loop {
        if let Some(c) = api.get_opt(&ctb_name).await.unwrap() {
            break c;
        }
        assert!(
            Instant::now() < deadline,
            "no ClusterTrustBundle {ctb_name}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(ctb.spec.signer_name.as_deref(), Some(f.signer.as_str()));
    assert_eq!(pem_certs(&ctb.spec.trust_bundle), roots);

    // The audit log verifies and holds exactly one record per decided PCR.
    let audit = f.audit.clone();
    f.app.shutdown().await.unwrap();
    let lines = verify::read_lines(&[&audit]).unwrap();
    let report = verify::verify_lines(&lines, None).unwrap();
    let (records, unreadable) = query::query(&lines, &query::Query::default());
    assert!(unreadable.is_empty());
    assert_eq!(report.records, records.len() as u64);
    let pcr_records: Vec<_> = records
        .iter()
        .filter(|r| r.authn_method.as_deref() == Some(meshca::podcert::AUTHN_METHOD))
        .collect();
    let mut uids: Vec<_> = pcr_records
        .iter()
        .map(|r| r.pod_certificate_request_uid.clone().unwrap())
        .collect();
    uids.sort();
    decided.sort();
    assert_eq!(uids, decided, "one record per PCR");
    let reasons: Vec<_> = pcr_records.iter().map(|r| r.reason.as_str()).collect();
    assert_eq!(
        reasons,
        [
            "issued",
            "podcert_pod_not_on_node",
            "podcert_service_account_mismatch",
            "podcert_unsupported_key_type",
            "podcert_invalid_user_annotations"
        ]
    );
    let issued = pcr_records[0];
    assert!(issued.serial.is_some() && issued.not_after == Some(na));
    assert_eq!(
        issued.caller_pod.as_deref(),
        Some(format!("{}/web-0", f.ns).as_str())
    );
    assert_eq!(issued.node.as_deref(), Some(node_a.as_str()));
    assert!(issued
        .pod_certificate_request
        .as_deref()
        .unwrap()
        .starts_with(&format!("{}/web-0-pcr", f.ns)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_update_needs_sign_on_the_signer() {
    let k = kte().await;
    let signer = format!("{}.meshca.test/spiffe", unique("nosign"));
    let ns = k.namespace("podcert-rbac").await;
    k.service_account(&ns, SA).await;
    let sa_uid = k.service_account_uid(&ns, SA).await;
    let n = unique("node");
    let node_uid = node(&k, &n).await;
    let pod_uid = pod(&k, &ns, "web-0", SA, &n, &signer).await;
    let key = rcgen::KeyPair::generate().unwrap();
    let kubelet = node_client(&k, &n).await;
    let a = Ask {
        ns: &ns,
        pod: "web-0",
        pod_uid: &pod_uid,
        sa: SA,
        sa_uid: &sa_uid,
        node: &n,
        node_uid: &node_uid,
        signer: &signer,
        key: &key,
        max_expiration: None,
        annotations: BTreeMap::new(),
    };
    let created = create_pcr(&kubelet, &a).await.unwrap();
    let name = created.metadata.name.clone().unwrap();

    // Two users with the same PCR rights; only the second may `sign`.
    let users = [unique("no-sign"), unique("signer")];
    for (i, user) in users.iter().enumerate() {
        let mut rules = vec![
            json!({"apiGroups": ["certificates.k8s.io"], "resources": ["podcertificaterequests"], "verbs": ["get", "list", "watch"]}),
            json!({"apiGroups": ["certificates.k8s.io"], "resources": ["podcertificaterequests/status"], "verbs": ["update"]}),
        ];
        if i == 1 {
            rules.push(json!({"apiGroups": ["certificates.k8s.io"], "resources": ["signers"], "resourceNames": [signer], "verbs": ["sign"]}));
        }
        let role: ClusterRole =
            serde_json::from_value(json!({"metadata": {"name": user}, "rules": rules})).unwrap();
        bind(&k, role, user).await;
    }
    let deny = json!({"conditions": [{"type": "Denied", "status": "True", "reason": "Test",
        "message": "rbac test", "lastTransitionTime": OffsetDateTime::now_utc().replace_nanosecond(0).unwrap().format(&Rfc3339).unwrap()}]});
    let mut results = Vec::new();
    for user in &users {
        let c = cert_client(&k, user, &[]).await;
        let api: Api<DynamicObject> = Api::namespaced_with(c, &ns, &pcr_resource());
        // Wait until the user's PCR rights are in force (reads work), then
        // try the write once.
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut o = loop {
            match api.get(&name).await {
                Ok(o) => break o,
                Err(e) => assert!(Instant::now() < deadline, "{user} cannot read PCRs: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        o.data["status"] = deny.clone();
        let r = api.replace_status(&name, &PostParams::default(), &o).await;
        results.push(r);
    }
    match &results[0] {
        // The status strategy's check is a field error: 422 Invalid with a
        // FieldValueForbidden cause on spec.signerName.
        Err(kube::Error::Api(e)) => {
            assert_eq!(e.code, 422, "{e:?}");
            let causes = e
                .details
                .as_ref()
                .map(|d| d.causes.clone())
                .unwrap_or_default();
            assert!(
                causes.iter().any(|c| c.reason == "FieldValueForbidden"
                    && c.field == "spec.signerName"
                    && c.message.contains("not permitted to \"sign\"")),
                "{e:?}"
            );
        }
        r => panic!("a user without `sign` updated the status: {r:?}"),
    }
    assert!(
        results[1].is_ok(),
        "with `sign` the same update works: {:?}",
        results[1]
    );
}

/// A pod held by a finalizer and deleted: within the API server's
/// one-minute leeway its kubelet still gets a certificate (its tokens still
/// vouch), past it the request is denied (`MeshcaPodDeleted`), as a token
/// bound to that pod is refused then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleting_past_the_leeway_gets_no_certificate() {
    const HOLD: &str = "meshca.test/hold";
    let f = fixture(1).await;
    let k = &f.k;
    let (node_a, uid_a) = f.nodes[0].clone();
    let pods = Api::<Pod>::namespaced(k.admin.clone(), &f.ns);
    pod(k, &f.ns, "held", SA, &node_a, &f.signer).await;
    let patch = json!({"metadata": {"finalizers": [HOLD]}});
    let held = pods
        .patch(
            "held",
            &Default::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
    let pod_uid = held.metadata.uid.clone().unwrap();
    let dp = kube::api::DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    pods.delete("held", &dp).await.unwrap();
    let deleted_at = pods
        .get("held")
        .await
        .unwrap()
        .metadata
        .deletion_timestamp
        .expect("held by its finalizer")
        .0
        .as_second();
    let now = || OffsetDateTime::now_utc().unix_timestamp();
    let kubelet = node_client(k, &node_a).await;
    let key = rcgen::KeyPair::generate().unwrap();
    let ask = Ask {
        ns: &f.ns,
        pod: "held",
        pod_uid: &pod_uid,
        sa: SA,
        sa_uid: &f.sa_uid,
        node: &node_a,
        node_uid: &uid_a,
        signer: &f.signer,
        key: &key,
        max_expiration: None,
        annotations: BTreeMap::new(),
    };
    let decide = || async {
        let o = create_pcr(&kubelet, &ask).await.unwrap();
        let (cond, reason, status) =
            terminal(&k.admin, &f.ns, o.metadata.name.as_ref().unwrap()).await;
        (cond, reason, status)
    };
    let within = decide().await;
    let asked_within = now() - deleted_at;
    // Past the leeway: the API server's rule is deletionTimestamp < now - 60 s.
    while now() <= deleted_at + 61 {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let past = decide().await;
    let patch = json!({"metadata": {"finalizers": null}});
    let _ = pods
        .patch(
            "held",
            &Default::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await;
    eprintln!(
        "deleting {asked_within}s: {} {}; past the leeway: {} {}",
        within.0, within.1, past.0, past.1
    );
    assert!(
        asked_within < 60,
        "the first request came within the leeway"
    );
    assert_eq!(within.0, "Issued", "within the leeway: {}", within.2);
    assert_eq!(
        (past.0.as_str(), past.1.as_str()),
        ("Denied", "MeshcaPodDeleted"),
        "past the leeway: {}",
        past.2
    );
    assert!(past.2.get("certificateChain").is_none());
    let audit = f.audit.clone();
    f.app.shutdown().await.unwrap();
    let lines = verify::read_lines(&[&audit]).unwrap();
    verify::verify_lines(&lines, None).unwrap();
    let (records, _) = query::query(&lines, &query::Query::default());
    let reasons: Vec<_> = records
        .iter()
        .filter(|r| r.authn_method.as_deref() == Some(meshca::podcert::AUTHN_METHOD))
        .map(|r| r.reason.as_str())
        .collect();
    assert_eq!(reasons, ["issued", "podcert_pod_deleted"]);
}

/// Two replicas watch the same requests: each request is signed once, by
/// the replica that claimed it, and the two audit logs together hold
/// exactly one record per request (before the claim, both replicas signed
/// and recorded an issuance, and the loser's serial was never delivered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_sign_each_request_once() {
    const N: usize = 24;
    let f = fixture(1).await;
    let k = &f.k;
    let (n, nuid) = f.nodes[0].clone();
    let dir2 = tempfile::tempdir().unwrap();
    let audit2 = dir2.path().join("audit.log");
    let mut cfg2 = f.cfg.clone();
    cfg2.audit.file = audit2.clone();
    let app2 = meshca::app::App::start(&cfg2, Default::default())
        .await
        .unwrap();
    let kubelet = node_client(k, &n).await;
    let key = rcgen::KeyPair::generate().unwrap();
    let mut pods = Vec::new();
    for i in 0..N {
        let name = format!("web-{i}");
        let uid = pod(k, &f.ns, &name, SA, &n, &f.signer).await;
        pods.push((name, uid));
    }
    // Both replicas' indexes know every pod before the first request, so
    // both are ready to decide each one at once: the race is real.
    let deadline = Instant::now() + Duration::from_secs(30);
    for app in [&f.app, &app2] {
        let index = app.pod_index.clone().unwrap();
        while index.read(|s| {
            pods.iter()
                .filter(|(p, _)| s.get(&f.ns, p).is_some())
                .count()
        }) < N
        {
            assert!(
                Instant::now() < deadline,
                "pod index never showed every pod"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let mut created = Vec::new();
    for (pod_name, pod_uid) in &pods {
        let ask = Ask {
            ns: &f.ns,
            pod: pod_name,
            pod_uid,
            sa: SA,
            sa_uid: &f.sa_uid,
            node: &n,
            node_uid: &nuid,
            signer: &f.signer,
            key: &key,
            max_expiration: None,
            annotations: BTreeMap::new(),
        };
        created.push(create_pcr(&kubelet, &ask).await.unwrap());
    }
    let mut delivered = BTreeMap::new();
    for o in &created {
        let name = o.metadata.name.clone().unwrap();
        let (cond, _, status) = terminal(&k.admin, &f.ns, &name).await;
        assert_eq!(cond, "Issued", "{status}");
        let chain = pem_certs(status["certificateChain"].as_str().unwrap());
        let (_, leaf) = x509_parser::parse_x509_certificate(&chain[0]).unwrap();
        delivered.insert(
            o.metadata.uid.clone().unwrap(),
            leaf.raw_serial_as_string().replace(':', ""),
        );
    }
    let claims = |app: &meshca::app::App| {
        app.metrics
            .pod_certificates
            .claims
            .get_or_create(&meshca::podcert::controller::ClaimLabels { result: "ours" })
            .get()
    };
    let (won1, won2) = (claims(&f.app), claims(&app2));
    let held1 = f
        .app
        .metrics
        .pod_certificates
        .claims
        .get_or_create(&meshca::podcert::controller::ClaimLabels {
            result: "held_elsewhere",
        })
        .get();
    f.app.shutdown().await.unwrap();
    app2.shutdown().await.unwrap();

    // One issuance record per request across both logs, for the serial the
    // kubelet received; each log verifies.
    let mut issued: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for path in [&f.audit, &audit2] {
        let lines = verify::read_lines(&[path]).unwrap();
        verify::verify_lines(&lines, None).unwrap();
        let (records, unreadable) = query::query(&lines, &query::Query::default());
        assert!(unreadable.is_empty());
        for r in records
            .iter()
            .filter(|r| r.authn_method.as_deref() == Some(meshca::podcert::AUTHN_METHOD))
        {
            assert_eq!(r.reason, "issued", "{r:?}");
            issued
                .entry(r.pod_certificate_request_uid.clone().unwrap())
                .or_default()
                .push(r.serial.clone().unwrap().to_ascii_lowercase());
        }
    }
    let twice: Vec<_> = issued.iter().filter(|(_, s)| s.len() > 1).collect();
    println!(
        "two replicas, {N} PCRs: claims won {won1} + {won2}, replica 1 found {held1} held by the other; {} PCRs recorded as issued more than once",
        twice.len()
    );
    assert!(twice.is_empty(), "signed by both replicas: {twice:?}");
    assert_eq!(issued.len(), N, "one record per request");
    for (uid, serial) in &delivered {
        assert_eq!(
            issued.get(uid).map(|s| s[0].trim_start_matches('0')),
            Some(serial.to_ascii_lowercase().trim_start_matches('0')),
            "the recorded serial is the delivered one"
        );
    }
    assert_eq!(won1 + won2, N as u64, "one claim won per request");
}

/// A claim left by a replica that died lapses: the request is decided once
/// the claim is 30 s old. A claim dated in the future holds nobody off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replicas_claim_lapses_and_a_future_one_is_ignored() {
    let f = fixture(1).await;
    let k = &f.k;
    let (n, nuid) = f.nodes[0].clone();
    let kubelet = node_client(k, &n).await;
    let key = rcgen::KeyPair::generate().unwrap();
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let mut started = Vec::new();
    // (pod, claim annotation, earliest and latest decision after creation)
    let cases = [
        ("dead", format!("meshca-0-dead@{}", now - 25), 3.0, 20.0),
        ("future", format!("squatter-0-0@{}", now + 3600), 0.0, 4.0),
    ];
    for (pod_name, claim, _, _) in &cases {
        let pod_uid = pod(k, &f.ns, pod_name, SA, &n, &f.signer).await;
        let index = f.app.pod_index.clone().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while index.read(|s| s.get(&f.ns, pod_name).is_none()) {
            assert!(
                Instant::now() < deadline,
                "pod index never showed {pod_name}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "certificates.k8s.io/v1", "kind": "PodCertificateRequest",
            "metadata": {"name": unique(&format!("{pod_name}-pcr")), "namespace": f.ns,
                "annotations": {"meshca.io/decider": claim}},
            "spec": {
                "signerName": f.signer, "podName": pod_name, "podUID": pod_uid,
                "serviceAccountName": SA, "serviceAccountUID": f.sa_uid,
                "nodeName": n, "nodeUID": nuid,
                "stubPKCS10Request": base64::engine::general_purpose::STANDARD.encode(stub_csr(&key)),
            }
        }))
        .unwrap();
        let api: Api<DynamicObject> = Api::namespaced_with(kubelet.clone(), &f.ns, &pcr_resource());
        let pp = PostParams::default();
        let created = settle("create pcr", || api.create(&pp, &obj))
            .await
            .unwrap();
        started.push((created.metadata.name.unwrap(), Instant::now()));
    }
    // Both polled together: each one's decision time is its own.
    let api: Api<DynamicObject> = Api::namespaced_with(k.admin.clone(), &f.ns, &pcr_resource());
    let mut decided: Vec<Option<(f64, DynamicObject)>> = vec![None, None];
    let deadline = Instant::now() + Duration::from_secs(40);
    while decided.iter().any(Option::is_none) {
        for (i, (name, t0)) in started.iter().enumerate() {
            if decided[i].is_none() {
                let o = api.get(name).await.unwrap();
                if o.data["status"]["conditions"][0]["type"].is_string() {
                    decided[i] = Some((t0.elapsed().as_secs_f64(), o));
                }
            }
        }
        assert!(Instant::now() < deadline, "never decided: {decided:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (d, (pod_name, _, earliest, latest)) in decided.into_iter().zip(&cases) {
        let (took, o) = d.unwrap();
        println!("claim {pod_name}: decided {took:.1} s after creation");
        assert_eq!(
            o.data["status"]["conditions"][0]["type"], "Issued",
            "{pod_name}"
        );
        assert!(
            (*earliest..*latest).contains(&took),
            "{pod_name}: decided after {took:.1} s, expected between {earliest} and {latest}"
        );
        let claim = o.metadata.annotations.unwrap_or_default()["meshca.io/decider"].clone();
        assert!(
            !claim.starts_with("meshca-0-dead@") && !claim.starts_with("squatter-0-0@"),
            "{pod_name}: the deciding replica wrote its own claim: {claim}"
        );
    }
}

/// `apiserver_request_total` by (resource, subresource, verb), from the API
/// server's /metrics.
async fn request_counts(admin: &Client) -> BTreeMap<(String, String, String), f64> {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = admin.request_text(req).await.unwrap();
    let mut out = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let Some((labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let get = |k: &str| {
            labels
                .split(&format!("{k}=\""))
                .nth(1)
                .and_then(|r| r.split('"').next())
                .unwrap_or_default()
                .to_string()
        };
        *out.entry((get("resource"), get("subresource"), get("verb")))
            .or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
    }
    out
}

/// The burst benchmark of docs/BENCHMARKS.md: N PodCertificateRequests from
/// M kubelets at once, all must be Issued; prints PCR/s, create-to-Issued
/// percentiles and API server requests per PCR. Not a CI test (minutes):
/// `cargo test --release --test kube_podcert -- --ignored --nocapture burst`
/// with MESHCA_PODCERT_BURST (default 1000), MESHCA_PODCERT_NODES (20) and
/// MESHCA_PODCERT_WORKERS (meshca's MESHCA_POD_CERTIFICATE_WORKERS, 32).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run by hand, see docs/BENCHMARKS.md"]
async fn burst() {
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (total, nodes) = (
        env("MESHCA_PODCERT_BURST", 1000),
        env("MESHCA_PODCERT_NODES", 20),
    );
    let f = fixture(nodes).await;
    let k = &f.k;
    let mut pods = Vec::new();
    for i in 0..total {
        let (n, nuid) = &f.nodes[i % nodes];
        let name = format!("web-{i}");
        let uid = pod(k, &f.ns, &name, SA, n, &f.signer).await;
        pods.push((name, uid, n.clone(), nuid.clone()));
    }
    let index = f.app.pod_index.clone().unwrap();
    let ns = f.ns.clone();
    let deadline = Instant::now() + Duration::from_secs(120);
    while index.read(|s| {
        (0..total)
            .filter(|i| s.get(&ns, &format!("web-{i}")).is_some())
            .count()
    }) < total
    {
        assert!(
            Instant::now() < deadline,
            "pod index never showed every pod"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut kubelets = BTreeMap::new();
    for (n, _) in &f.nodes {
        kubelets.insert(n.clone(), node_client(k, n).await);
    }
    // One watch sees every decision (no polling per PCR).
    let issued = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::<String, Instant>::new()));
    let watcher = {
        use futures::StreamExt;
        let api: Api<DynamicObject> = Api::namespaced_with(k.admin.clone(), &f.ns, &pcr_resource());
        let issued = issued.clone();
        tokio::spawn(async move {
            let cfg = kube::runtime::watcher::Config::default();
            let mut s = kube::runtime::watcher::watcher(api, cfg).boxed();
            while let Some(Ok(ev)) = s.next().await {
                if let kube::runtime::watcher::Event::Apply(o)
                | kube::runtime::watcher::Event::InitApply(o) = ev
                {
                    let t = o.data["status"]["conditions"][0]["type"]
                        .as_str()
                        .map(str::to_string);
                    if let Some(t) = t {
                        assert_eq!(t, "Issued", "{:?}", o.data["status"]);
                        issued
                            .lock()
                            .unwrap()
                            .entry(o.metadata.name.unwrap())
                            .or_insert_with(Instant::now);
                    }
                }
            }
        })
    };
    let before = request_counts(&k.admin).await;
    let started = Instant::now();
    let key = rcgen::KeyPair::generate().unwrap();
    let csr = base64::engine::general_purpose::STANDARD.encode(stub_csr(&key));
    let mut tasks = Vec::new();
    for (node, client) in &kubelets {
        let mine: Vec<_> = pods.iter().filter(|p| &p.2 == node).cloned().collect();
        let (client, ns, signer, sa_uid, csr) = (
            client.clone(),
            f.ns.clone(),
            f.signer.clone(),
            f.sa_uid.clone(),
            csr.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let api: Api<DynamicObject> = Api::namespaced_with(client, &ns, &pcr_resource());
            let mut created = Vec::new();
            for (pod, uid, n, nuid) in mine {
                let obj: DynamicObject = serde_json::from_value(json!({
                    "apiVersion": "certificates.k8s.io/v1", "kind": "PodCertificateRequest",
                    "metadata": {"name": format!("{pod}-pcr"), "namespace": ns},
                    "spec": {"signerName": signer, "podName": pod, "podUID": uid,
                        "serviceAccountName": SA, "serviceAccountUID": sa_uid,
                        "nodeName": n, "nodeUID": nuid, "stubPKCS10Request": csr}
                }))
                .unwrap();
                let t0 = Instant::now();
                api.create(&PostParams::default(), &obj).await.unwrap();
                created.push((format!("{pod}-pcr"), t0));
            }
            created
        }));
    }
    let mut created = Vec::new();
    for t in tasks {
        created.extend(t.await.unwrap());
    }
    // The reference in the same run: how fast the kubelets could create.
    let creates_took = started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(300);
    while issued.lock().unwrap().len() < total {
        assert!(
            Instant::now() < deadline,
            "only {} of {total} issued",
            issued.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = started.elapsed();
    let after = request_counts(&k.admin).await;
    watcher.abort();
    let done = issued.lock().unwrap().clone();
    let mut lat: Vec<f64> = created
        .iter()
        .map(|(n, t0)| done[n].duration_since(*t0).as_secs_f64() * 1000.0)
        .collect();
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        lat[((lat.len() as f64 * p).ceil() as usize)
            .saturating_sub(1)
            .min(lat.len() - 1)]
    };
    let mut calls = 0.0;
    let mut by_kind = Vec::new();
    for (key, v) in &after {
        let d = v - before.get(key).copied().unwrap_or(0.0);
        if d > 0.0 {
            calls += d;
            by_kind.push(format!("{}/{} {}: {d}", key.0, key.1, key.2));
        }
    }
    println!(
        "podcert burst: {total} PCRs from {nodes} kubelets, all Issued in {:.2}s = {:.0} PCR/s; \
         create->Issued p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; API server requests {calls} = {:.2} per PCR",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64(),
        pct(0.50),
        pct(0.99),
        lat[lat.len() - 1],
        calls / total as f64
    );
    println!(
        "  reference: the {nodes} kubelets created all {total} in {:.2}s = {:.0} creates/s; Issued rate / create rate = {:.2}",
        creates_took.as_secs_f64(),
        total as f64 / creates_took.as_secs_f64(),
        creates_took.as_secs_f64() / elapsed.as_secs_f64()
    );
    println!("  by resource/subresource verb (whole API server, this test included): {by_kind:?}");
    let m = &f.app.metrics.pod_certificates;
    println!(
        "  meshca status writes ok: {}",
        m.status_writes
            .get_or_create(&meshca::podcert::controller::WriteLabels { result: "ok" })
            .get()
    );
}
