//! Shared helpers for the integration tests that run against the real
//! kube-apiserver started by `scripts/kube-testenv up` (see scripts/test).
#![allow(dead_code, clippy::unwrap_used)]

pub mod attack;
pub mod flood;

use std::path::PathBuf;
use std::time::Duration;

use base64::Engine;
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Container, Namespace, Pod, PodSpec, ServiceAccount};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use meshca::app::{App, Deps};
use meshca::audit::MemorySink;
use meshca::config::{Config, KubeSettings};
use meshca::testing::{self, TestPki};
use rcgen::KeyPair;
use serde_json::json;

/// The running test cluster, from `scripts/kube-testenv up`'s env file.
pub struct Kte {
    pub dir: PathBuf,
    pub admin: Client,
    /// The instance's ServiceAccount issuer (`KTE_ISSUER` in its env file).
    pub issuer: String,
}

/// Connects to the test cluster. A missing cluster is a failure, not a skip.
pub async fn kte() -> Kte {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let dir = std::env::var_os("KTE_DIR").map(PathBuf::from).unwrap_or_else(|| {
        panic!("KTE_DIR is not set: these tests need the real kube-apiserver. Run ./scripts/test, or `scripts/kube-testenv up DIR && source DIR/env`")
    });
    kte_at(dir).await
}

/// The second test cluster (`KTE_REMOTE_DIR`, started by scripts/test with
/// its own issuer): the remote cluster of the multi-cluster tests. Missing
/// is a failure, not a skip.
pub async fn kte_remote() -> Kte {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let dir = std::env::var_os("KTE_REMOTE_DIR").map(PathBuf::from).unwrap_or_else(|| {
        panic!("KTE_REMOTE_DIR is not set: the multi-cluster tests need a second kube-apiserver with its own issuer. Run ./scripts/test, or `KTE_ISSUER=https://remote.kte.invalid scripts/kube-testenv up DIR` and export KTE_REMOTE_DIR=DIR")
    });
    kte_at(dir).await
}

async fn kte_at(dir: PathBuf) -> Kte {
    let admin = client(&dir.join("admin.kubeconfig")).await;
    let env = std::fs::read_to_string(dir.join("env")).unwrap_or_default();
    let issuer = env
        .lines()
        .find_map(|l| l.strip_prefix("export KTE_ISSUER="))
        .map(|v| v.trim_matches(|c| c == '\'' || c == '"').to_string())
        .unwrap_or_else(|| "https://kubernetes.default.svc.cluster.local".into());
    Kte { dir, admin, issuer }
}

pub async fn client(kubeconfig: &std::path::Path) -> Client {
    meshca::app::kube_client(Some(kubeconfig)).await.unwrap()
}

/// A unique lower-case name.
pub fn unique(prefix: &str) -> String {
    let mut b = [0u8; 4];
    aws_lc_rs::rand::fill(&mut b).unwrap();
    format!("{prefix}-{}", hex::encode(b))
}

impl Kte {
    pub fn meshca_kubeconfig(&self) -> PathBuf {
        self.dir.join("meshca.kubeconfig")
    }

    pub async fn namespace(&self, prefix: &str) -> String {
        let name = unique(prefix);
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
        Api::<Namespace>::all(self.admin.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap();
        name
    }

    pub async fn service_account(&self, ns: &str, name: &str) {
        let sa: ServiceAccount =
            serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
        Api::<ServiceAccount>::namespaced(self.admin.clone(), ns)
            .create(&PostParams::default(), &sa)
            .await
            .unwrap();
    }

    /// Creates a pod bound to `node` (no scheduler runs); returns its UID.
    pub async fn pod(&self, ns: &str, name: &str, sa: &str, node: &str) -> String {
        self.pod_with_finalizers(ns, name, sa, node, &[]).await
    }

    /// [`Self::pod`] held by `finalizers` once deleted (it keeps a
    /// `deletionTimestamp` until they are removed).
    pub async fn pod_with_finalizers(
        &self,
        ns: &str,
        name: &str,
        sa: &str,
        node: &str,
        finalizers: &[&str],
    ) -> String {
        let pod = Pod {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                finalizers: Some(finalizers.iter().map(|f| f.to_string()).collect())
                    .filter(|f: &Vec<String>| !f.is_empty()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                service_account_name: Some(sa.into()),
                automount_service_account_token: Some(false),
                termination_grace_period_seconds: Some(0),
                containers: vec![Container {
                    name: "app".into(),
                    image: Some("example.invalid/app:0".into()),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let created = Api::<Pod>::namespaced(self.admin.clone(), ns)
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
        created.metadata.uid.unwrap()
    }

    /// Service account `sa` in `ns`, its pod `pod` on `node`, and a token
    /// for `istio-ca` bound to that pod: (pod UID, token).
    pub async fn pod_token(&self, ns: &str, sa: &str, pod: &str, node: &str) -> (String, String) {
        self.service_account(ns, sa).await;
        let uid = self.pod(ns, pod, sa, node).await;
        let token = self.token(ns, sa, Some((pod, &uid)), "istio-ca").await;
        (uid, token)
    }

    /// Sets the label `key=value` on namespace `ns`.
    pub async fn label_namespace(&self, ns: &str, key: &str, value: &str) {
        let patch = json!({"metadata": {"labels": {key: value}}});
        Api::<Namespace>::all(self.admin.clone())
            .patch(ns, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }

    /// The chart's Role from fixture `rel` (tests/chart.rs checks the chart
    /// renders exactly it) in `ns`, bound to the test user `meshca`.
    pub async fn meshca_role(&self, ns: &str, rel: &str) {
        let fixture =
            std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel))
                .unwrap();
        let role: Role = serde_yaml_ng::from_str(&fixture).unwrap();
        Api::<Role>::namespaced(self.admin.clone(), ns)
            .create(&PostParams::default(), &role)
            .await
            .unwrap();
        let name = role.metadata.name.unwrap();
        let rb: RoleBinding = serde_json::from_value(json!({
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "meshca"}]
        }))
        .unwrap();
        Api::<RoleBinding>::namespaced(self.admin.clone(), ns)
            .create(&PostParams::default(), &rb)
            .await
            .unwrap();
    }

    pub async fn delete_pod(&self, ns: &str, name: &str) {
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        };
        Api::<Pod>::namespaced(self.admin.clone(), ns)
            .delete(name, &dp)
            .await
            .unwrap();
    }

    pub async fn set_phase(&self, ns: &str, name: &str, phase: &str) {
        let patch = json!({"status": {"phase": phase}});
        Api::<Pod>::namespaced(self.admin.clone(), ns)
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }

    /// Reports `ip` as the pod's IP (what the kubelet would do).
    pub async fn set_pod_ip(&self, ns: &str, name: &str, ip: &str) {
        let patch = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}});
        Api::<Pod>::namespaced(self.admin.clone(), ns)
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }

    /// Mints a pod-bound ServiceAccount token with the TokenRequest API.
    pub async fn token(
        &self,
        ns: &str,
        sa: &str,
        pod: Option<(&str, &str)>,
        audience: &str,
    ) -> String {
        let tr = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: Some(vec![audience.into()]),
                expiration_seconds: Some(3600),
                bound_object_ref: pod.map(|(name, uid)| BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: Some(name.into()),
                    uid: Some(uid.into()),
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let api = Api::<ServiceAccount>::namespaced(self.admin.clone(), ns);
        let out: TokenRequest = api
            .create_subresource("token", sa, &PostParams::default(), &tr)
            .await
            .unwrap();
        out.status.unwrap().token.unwrap()
    }

    /// A token for `ns/sa` signed with the cluster's real ServiceAccount key
    /// but already expired (TokenRequest refuses lifetimes under 10 minutes).
    pub async fn expired_token(&self, ns: &str, sa: &str) -> String {
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        let sa_uid = self.service_account_uid(ns, sa).await;
        self.signed_token(ns, sa, &sa_uid, None, now - 7200, now - 3600)
    }

    pub async fn service_account_uid(&self, ns: &str, sa: &str) -> String {
        Api::<ServiceAccount>::namespaced(self.admin.clone(), ns)
            .get(sa)
            .await
            .unwrap()
            .metadata
            .uid
            .unwrap()
    }

    /// A ServiceAccount token (optionally bound to pod `(name, uid)`) signed
    /// locally with the cluster's real ServiceAccount key, with the claims the
    /// TokenRequest API writes (minus the node binding): thousands of distinct
    /// valid tokens without thousands of TokenRequests to a loaded API server.
    pub fn signed_token(
        &self,
        ns: &str,
        sa: &str,
        sa_uid: &str,
        pod: Option<(&str, &str)>,
        iat: i64,
        exp: i64,
    ) -> String {
        self.signed_token_with_kid(None, ns, sa, sa_uid, pod, iat, exp)
    }

    /// [`Self::signed_token`] with a `kid` header, as the API server writes
    /// (local verification looks the key up by it).
    #[allow(clippy::too_many_arguments)]
    pub fn signed_token_with_kid(
        &self,
        kid: Option<&str>,
        ns: &str,
        sa: &str,
        sa_uid: &str,
        pod: Option<(&str, &str)>,
        iat: i64,
        exp: i64,
    ) -> String {
        let mut header = json!({"alg": "RS256", "typ": "JWT"});
        if let Some(kid) = kid {
            header["kid"] = json!(kid);
        }
        let mut jti = [0u8; 16];
        aws_lc_rs::rand::fill(&mut jti).unwrap();
        let mut k8s = json!({"namespace": ns, "serviceaccount": {"name": sa, "uid": sa_uid}});
        if let Some((name, uid)) = pod {
            k8s["pod"] = json!({"name": name, "uid": uid});
        }
        self.sign_claims(
            &header,
            &json!({
                "iss": "https://kubernetes.default.svc.cluster.local",
                "aud": ["istio-ca"],
                "sub": format!("system:serviceaccount:{ns}:{sa}"),
                "jti": hex::encode(jti),
                "iat": iat, "nbf": iat, "exp": exp,
                "kubernetes.io": k8s,
            }),
        )
    }

    /// `header` and `claims` signed (RS256) with the cluster's real
    /// ServiceAccount key.
    pub fn sign_claims(&self, header: &serde_json::Value, claims: &serde_json::Value) -> String {
        let key_pem = std::fs::read(self.dir.join("pki/sa.key")).unwrap();
        use rustls_pki_types::pem::PemObject;
        let key_der = rustls_pki_types::PrivateKeyDer::from_pem_slice(&key_pem).unwrap();
        let key = match &key_der {
            rustls_pki_types::PrivateKeyDer::Pkcs8(k) => {
                aws_lc_rs::rsa::KeyPair::from_pkcs8(k.secret_pkcs8_der()).unwrap()
            }
            other => aws_lc_rs::rsa::KeyPair::from_der(other.secret_der()).unwrap(),
        };
        let b64 = |v: &serde_json::Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(serde_json::to_vec(v).unwrap())
        };
        let signing_input = format!("{}.{}", b64(header), b64(claims));
        let mut sig = vec![0u8; key.public_modulus_len()];
        key.sign(
            &aws_lc_rs::signature::RSA_PKCS1_SHA256,
            &aws_lc_rs::rand::SystemRandom::new(),
            signing_input.as_bytes(),
            &mut sig,
        )
        .unwrap();
        format!(
            "{signing_input}.{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(sig)
        )
    }

    /// A kubeconfig for a ServiceAccount that may create TokenReviews but not
    /// list pods: with it meshca authenticates callers but its pod index can
    /// never sync.
    pub async fn kubeconfig_without_pod_access(&self) -> PathBuf {
        let ns = self.namespace("noindex").await;
        self.service_account(&ns, "ca").await;
        let role = ClusterRole {
            metadata: kube::api::ObjectMeta {
                name: Some(ns.clone()),
                ..Default::default()
            },
            rules: Some(vec![PolicyRule {
                api_groups: Some(vec!["authentication.k8s.io".into()]),
                resources: Some(vec!["tokenreviews".into()]),
                verbs: vec!["create".into()],
                ..Default::default()
            }]),
            ..Default::default()
        };
        Api::<ClusterRole>::all(self.admin.clone())
            .create(&PostParams::default(), &role)
            .await
            .unwrap();
        let binding = ClusterRoleBinding {
            metadata: kube::api::ObjectMeta {
                name: Some(ns.clone()),
                ..Default::default()
            },
            role_ref: RoleRef {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "ClusterRole".into(),
                name: ns.clone(),
            },
            subjects: Some(vec![Subject {
                kind: "ServiceAccount".into(),
                name: "ca".into(),
                namespace: Some(ns.clone()),
                ..Default::default()
            }]),
        };
        Api::<ClusterRoleBinding>::all(self.admin.clone())
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
        let token = self.token(&ns, "ca", None, &self.issuer.clone()).await;
        let mut kc: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&std::fs::read_to_string(self.meshca_kubeconfig()).unwrap())
                .unwrap();
        kc["users"][0]["user"] = serde_yaml_ng::to_value(json!({"token": token})).unwrap();
        let path = self.dir.join(format!("{ns}.kubeconfig"));
        std::fs::write(&path, serde_yaml_ng::to_string(&kc).unwrap()).unwrap();
        path
    }
}

/// A meshca server wired to the test cluster with the least-privilege
/// `meshca` kubeconfig.
pub struct Server {
    pub app: App,
    pub audit: std::sync::Arc<MemorySink>,
    pub pki: TestPki,
}

pub fn kube_config(pki: &TestPki, kubeconfig: PathBuf, trusted: &[String]) -> Config {
    let mut cfg = testing::test_config(pki.path_buf());
    cfg.kube = Some(KubeSettings {
        kubeconfig: Some(kubeconfig),
        token_cache_ttl: Duration::from_secs(60),
        tokenreview_timeout: Duration::from_secs(3),
        review_limits: Default::default(),
        token_verification: Default::default(),
        pod_index_sync_wait: Duration::from_secs(3),
    });
    cfg.trusted_node_accounts = meshca::config::parse_service_accounts(&trusted.join(",")).unwrap();
    cfg
}

pub async fn start(cfg: Config, pki: TestPki) -> Server {
    let (app, audit) = testing::start_server(&cfg, Deps::default()).await;
    Server { app, audit, pki }
}

impl Server {
    /// Waits until the pod index satisfies `f` (the watch is asynchronous).
    pub async fn wait_index(&self, what: &str, f: impl Fn(&meshca::podindex::IndexState) -> bool) {
        let index = self.app.pod_index.as_ref().expect("pod index enabled");
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !(index.is_synced() && index.read(&f)) {
            assert!(
                std::time::Instant::now() < deadline,
                "pod index never showed: {what}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Calls CreateCertificate with a bearer token; every call must produce
    /// exactly one audit record.
    pub async fn call(
        &self,
        token: &str,
        csr_identity: &str,
        impersonate: Option<&str>,
        cluster: Option<&str>,
    ) -> Result<Vec<String>, tonic::Status> {
        let before = self.audit.records().len();
        let result = self
            .call_unchecked(token, csr_identity, impersonate, cluster)
            .await;
        let after = self.audit.records().len();
        assert_eq!(
            after,
            before + 1,
            "exactly one audit record per request: {result:?}"
        );
        result
    }

    async fn call_unchecked(
        &self,
        token: &str,
        csr_identity: &str,
        impersonate: Option<&str>,
        cluster: Option<&str>,
    ) -> Result<Vec<String>, tonic::Status> {
        let ask = Ask {
            token: Some(token),
            impersonate,
            cluster,
            ..Default::default()
        };
        self.ask(csr_identity, ask).await.0
    }

    /// Sends `ask` for a CSR of `csr_identity` (see [`Ask::send`]); not
    /// counted like [`Self::call`].
    pub async fn ask(
        &self,
        csr_identity: &str,
        ask: Ask<'_>,
    ) -> (Result<Vec<String>, tonic::Status>, KeyPair) {
        ask.send(self.app.addr, &self.pki.ca.root_cert, csr_identity)
            .await
    }

    pub fn last_reason(&self) -> String {
        self.audit
            .records()
            .last()
            .expect("an audit record")
            .reason
            .clone()
    }

    pub async fn readyz(&self) -> u16 {
        let url = format!("http://{}/readyz", self.app.admin_addr);
        let out = tokio::process::Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", &url])
            .output()
            .await
            .unwrap();
        String::from_utf8_lossy(&out.stdout).parse().unwrap_or(0)
    }
}

/// How a test's CreateCertificate authenticates and what it asks for
/// besides the CSR: a bearer token and/or a client certificate (chain
/// without the root, key), impersonation, a `clusterid` header, a TTL.
#[derive(Debug, Default, Clone, Copy)]
pub struct Ask<'a> {
    pub token: Option<&'a str>,
    pub cert: Option<&'a (String, String)>,
    pub impersonate: Option<&'a str>,
    pub cluster: Option<&'a str>,
    pub ttl: i64,
}

impl Ask<'_> {
    /// Sends it to the server at `addr` (trusting `root`) with a CSR of
    /// `csr_identity` for a fresh key: the chain or the status (Unavailable
    /// when no connection is made), and the CSR's key.
    pub async fn send(
        self,
        addr: std::net::SocketAddr,
        root: &str,
        csr_identity: &str,
    ) -> (Result<Vec<String>, tonic::Status>, KeyPair) {
        let key = KeyPair::generate().unwrap();
        let chain = async {
            let mut c = testing::client(addr, root, self.cert.map(|(c, k)| (&c[..], &k[..])))
                .await
                .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
            let meta: Vec<(&str, prost_types::Value)> = self
                .impersonate
                .map(|i| ("ImpersonatedIdentity", testing::string_value(i)))
                .into_iter()
                .collect();
            let mut req = tonic::Request::new(testing::request(
                testing::csr_for(&key, csr_identity),
                self.ttl,
                &meta,
            ));
            if let Some(token) = self.token {
                req.metadata_mut()
                    .insert("authorization", format!("Bearer {token}").parse().unwrap());
            }
            if let Some(c) = self.cluster {
                req.metadata_mut().insert("clusterid", c.parse().unwrap());
            }
            c.create_certificate(req)
                .await
                .map(|r| r.into_inner().cert_chain)
        }
        .await;
        (chain, key)
    }
}

/// A client certificate for `id` from the CA of `pki`, valid from five
/// minutes ago until `secs` from now: (chain without the root, key).
pub fn client_cert(pki: &TestPki, id: &str, secs: i64) -> (String, String) {
    let now = time::OffsetDateTime::now_utc();
    let bundle = meshca::ca::CaBundle::load_dir(pki.path(), now).unwrap();
    let v = meshca::ca::Validity {
        not_before: now - time::Duration::minutes(5),
        not_after: now + time::Duration::seconds(secs),
        clamped: false,
    };
    testing::client_identity(&bundle, id, &v)
}

/// The SPIFFE id of a Kubernetes service account in the test trust domain.
pub fn spiffe(ns: &str, sa: &str) -> String {
    format!("spiffe://cluster.local/ns/{ns}/sa/{sa}")
}

/// The URI SAN of a PEM leaf.
pub fn leaf_uri(pem: &str) -> String {
    use rustls_pki_types::pem::PemObject;
    let der = rustls_pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
    let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
    let san = cert.subject_alternative_name().unwrap().unwrap();
    match &san.value.general_names[..] {
        [x509_parser::extensions::GeneralName::URI(u)] => u.to_string(),
        other => panic!("unexpected SANs {other:?}"),
    }
}

/// Runs `scripts/kube-testenv CMD DIR` (e.g. `stop-apiserver` for an
/// outage) and fails the test if it fails.
pub fn kte_script(cmd: &str, dir: &std::path::Path) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/kube-testenv");
    let out = std::process::Command::new(script)
        .arg(cmd)
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kube-testenv {cmd} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
