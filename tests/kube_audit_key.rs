//! The audit checkpoint key made once in the cluster, never in a Helm
//! render: meshca, with the chart's Role (tests/fixtures/rbac-audit-checkpoint-key.yaml:
//! get on the key Secret, create on Secrets), creates the Secret with a new
//! key when it does not exist and reads it back otherwise. Replicas starting
//! at once end up with one key (a create that loses reads the winner's); an
//! existing Secret, the old chart's SEC1 key included, is taken as it is and
//! never replaced, and one holding no usable key stops meshca from starting.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::ByteString;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::Api;
use meshca::audit::keys::CheckpointKey;
use meshca::audit::keysecret::{self, KeyOrigin};
use serde_json::json;

/// The Secret name the fixture's `get` is limited to.
const NAME: &str = "meshca-audit-checkpoint-key";
const RBAC: &str = "tests/fixtures/rbac-audit-checkpoint-key.yaml";

async fn ns_with_role(k: &common::Kte) -> String {
    let ns = k.namespace("audit-key").await;
    k.meshca_role(&ns, RBAC).await;
    ns
}

fn key_id(pem: &[u8]) -> String {
    CheckpointKey::from_pem(pem).unwrap().verify_key().key_id()
}

async fn stored_pem(k: &common::Kte, ns: &str) -> Vec<u8> {
    let s = Api::<Secret>::namespaced(k.admin.clone(), ns)
        .get(NAME)
        .await
        .unwrap();
    assert_eq!(
        s.immutable,
        Some(true),
        "meshca creates the Secret immutable"
    );
    s.data.unwrap()[keysecret::DATA_KEY].0.clone()
}

#[track_caller]
fn assert_forbidden<T: std::fmt::Debug>(what: &str, r: Result<T, kube::Error>) {
    match r {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => panic!("{what}: expected 403 Forbidden, got {other:?}"),
    }
}

/// Many replicas at once, as the pod's own user: one creates the Secret,
/// every other one takes that key (read first, or after losing the create).
/// Repeated in fresh namespaces until a create has lost the race at least
/// once, so the conflict path itself is what is checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_starting_at_once_take_one_key() {
    const REPLICAS: usize = 8;
    let k = common::kte().await;
    let pod = common::client(&k.meshca_kubeconfig()).await;
    let mut lost_races = 0;
    let mut rounds = 0;
    while lost_races == 0 {
        rounds += 1;
        assert!(
            rounds <= 20,
            "no create lost the race in 20 rounds of {REPLICAS}"
        );
        let ns = ns_with_role(&k).await;
        let start = Arc::new(tokio::sync::Barrier::new(REPLICAS));
        let mut tasks = Vec::new();
        for _ in 0..REPLICAS {
            let (pod, ns, start) = (pod.clone(), ns.clone(), start.clone());
            tasks.push(tokio::spawn(async move {
                start.wait().await;
                keysecret::ensure(&pod, &ns, NAME).await.unwrap()
            }));
        }
        let mut results = Vec::new();
        for t in tasks {
            results.push(t.await.unwrap());
        }
        let stored = stored_pem(&k, &ns).await;
        let created = results
            .iter()
            .filter(|(_, o)| *o == KeyOrigin::Created)
            .count();
        assert_eq!(
            created, 1,
            "exactly one replica creates the key: {results:?}"
        );
        for (pem, _) in &results {
            assert_eq!(
                key_id(pem),
                key_id(&stored),
                "every replica holds the stored key"
            );
        }
        lost_races += results
            .iter()
            .filter(|(_, o)| *o == KeyOrigin::CreatedByAnother)
            .count();
    }
    eprintln!(
        "{lost_races} create(s) lost the race and read the winner's key, in {rounds} round(s)"
    );

    // What the Role does not allow the pod: replacing, listing or removing
    // the key (nor reading another Secret).
    let ns = ns_with_role(&k).await;
    keysecret::ensure(&pod, &ns, NAME).await.unwrap();
    let api = Api::<Secret>::namespaced(pod.clone(), &ns);
    assert_forbidden(
        "patch",
        api.patch(
            NAME,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
        )
        .await,
    );
    assert_forbidden("delete", api.delete(NAME, &Default::default()).await);
    assert_forbidden("list", api.list(&ListParams::default()).await);
    assert_forbidden("get another", api.get("cacerts").await);
}

/// A Secret that exists is taken as it is: the previous chart's key (the
/// SEC1 `EC PRIVATE KEY` of Helm's genPrivateKey, here from openssl) keeps
/// signing after an upgrade. One without a usable key is an error, and the
/// Secret is left alone.
#[tokio::test]
async fn an_existing_secret_is_never_replaced() {
    let k = common::kte().await;
    let pod = common::client(&k.meshca_kubeconfig()).await;
    let ns = ns_with_role(&k).await;
    let sec1 = std::process::Command::new("openssl")
        .args(["ecparam", "-name", "prime256v1", "-genkey", "-noout"])
        .output()
        .unwrap();
    assert!(sec1.status.success());
    assert!(String::from_utf8_lossy(&sec1.stdout).contains("BEGIN EC PRIVATE KEY"));
    let admin = Api::<Secret>::namespaced(k.admin.clone(), &ns);
    let secret = |data: &[u8]| Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(NAME.into()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            keysecret::DATA_KEY.to_string(),
            ByteString(data.to_vec()),
        )])),
        ..Default::default()
    };
    admin
        .create(&PostParams::default(), &secret(&sec1.stdout))
        .await
        .unwrap();
    let (pem, origin) = keysecret::ensure(&pod, &ns, NAME).await.unwrap();
    assert_eq!(origin, KeyOrigin::Existing);
    assert_eq!(pem, sec1.stdout);

    let ns = ns_with_role(&k).await;
    let admin = Api::<Secret>::namespaced(k.admin.clone(), &ns);
    admin
        .create(&PostParams::default(), &secret(b"not a key"))
        .await
        .unwrap();
    let e = keysecret::ensure(&pod, &ns, NAME).await.unwrap_err();
    assert_eq!(e.reason(), "audit_key_secret_invalid", "{e}");
    let kept = admin.get(NAME).await.unwrap();
    assert_eq!(kept.data.unwrap()[keysecret::DATA_KEY].0, b"not a key");
}

/// Two meshca processes started at once with MESHCA_AUDIT_CHECKPOINT_KEY_SECRET
/// (as the chart sets it) sign their checkpoints with the same key, the one
/// in the Secret; a third start, later, too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_meshca_replicas_sign_with_the_key_in_the_secret() {
    let k = common::kte().await;
    let ns = ns_with_role(&k).await;
    let dir = tempfile::tempdir().unwrap();
    let secret = format!("{ns}/{NAME}");
    let spawn = |i: usize| {
        let data = dir.path().join(format!("data{i}"));
        let out = std::fs::File::create(dir.path().join(format!("audit{i}.log"))).unwrap();
        let mut cmd =
            meshca::testing::serve_dev_command(env!("CARGO_BIN_EXE_meshca").as_ref(), &data);
        cmd.args(["--audit-sink", "stdout", "--kubeconfig"])
            .arg(k.meshca_kubeconfig())
            .args(["--mtls-renewal-pod-check", "false"])
            .env("POD_NAME", format!("meshca-{i}"))
            .env("MESHCA_AUDIT_CHECKPOINT_KEY_SECRET", &secret)
            .stdout(out);
        meshca::testing::spawn_listening(cmd)
    };
    let (a, b) = tokio::join!(spawn(0), spawn(1));
    for (child, _, _) in [a, b] {
        let status = meshca::testing::terminate(child, Duration::from_secs(20)).await;
        assert!(status.success(), "{status}");
    }
    let (c, _, _) = spawn(2).await;
    assert!(meshca::testing::terminate(c, Duration::from_secs(20))
        .await
        .success());
    let want = key_id(&stored_pem(&k, &ns).await);
    for i in 0..3 {
        let ids = checkpoint_key_ids(&dir.path().join(format!("audit{i}.log")));
        assert!(
            ids.len() >= 2,
            "replica {i}: start and shutdown checkpoints: {ids:?}"
        );
        assert!(
            ids.iter().all(|id| *id == want),
            "replica {i} signed with {ids:?}, the Secret holds {want}"
        );
    }
}

/// The key_id of every checkpoint line of an audit log.
fn checkpoint_key_ids(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["type"] == "checkpoint")
        .map(|v| v["key_id"].as_str().unwrap_or("unsigned").to_string())
        .collect()
}

/// RBAC's create on Secrets cannot be limited by name; the chart's admission
/// policy (tests/fixtures/vap-audit-checkpoint-key.yaml) keeps it to the key
/// Secret: not a ServiceAccount token Secret (which the token controller
/// would fill with another ServiceAccount's token), not one labelled as an
/// Istio remote secret, not another name. meshca's own create still works.
#[tokio::test]
async fn meshca_may_create_only_its_key_secret() {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let k = common::kte().await;
    let pod = common::client(&k.meshca_kubeconfig()).await;
    let ns = ns_with_role(&k).await;
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vap-audit-checkpoint-key.yaml"),
    )
    .unwrap()
    .replace("system:serviceaccount:istio-system:meshca", "meshca")
    .replace("istio-system", &ns);
    let mut docs = text.split("\n---\n");
    let policy: ValidatingAdmissionPolicy = serde_yaml_ng::from_str(docs.next().unwrap()).unwrap();
    let binding: ValidatingAdmissionPolicyBinding =
        serde_yaml_ng::from_str(docs.next().unwrap()).unwrap();
    let name = policy.metadata.name.clone().unwrap();
    Api::<ValidatingAdmissionPolicy>::all(k.admin.clone())
        .create(&PostParams::default(), &policy)
        .await
        .unwrap();
    Api::<ValidatingAdmissionPolicyBinding>::all(k.admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let api = Api::<Secret>::namespaced(pod.clone(), &ns);
    let create = |name: &str, type_: &str, labels: serde_json::Value| {
        let mut s = json!({
            "metadata": {"name": name, "labels": labels},
            "type": type_,
            "data": {"x": "eQ=="}
        });
        if type_ == "kubernetes.io/service-account-token" {
            s["metadata"]["annotations"] = json!({"kubernetes.io/service-account.name": "default"});
        }
        let s: Secret = serde_json::from_value(s).unwrap();
        let api = api.clone();
        async move {
            match api.create(&PostParams::default(), &s).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) => Err(format!("{} {}", e.code, e.message)),
                Err(e) => panic!("{e}"),
            }
        }
    };
    // The policy takes effect asynchronously: until a stray create is refused.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut n = 0;
    let refusal = loop {
        n += 1;
        if let Err(e) = create(&format!("stray-{n}"), "Opaque", json!({})).await {
            break e;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the policy never took effect"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        refusal.contains("may create only its audit checkpoint key"),
        "{refusal}"
    );
    // At the key's own name: not a token Secret, not an Istio remote secret.
    let token = create(NAME, "kubernetes.io/service-account-token", json!({})).await;
    let token = token.unwrap_err();
    assert!(token.contains("may create only"), "{token}");
    let remote = create(NAME, "Opaque", json!({"istio/multiCluster": "true"})).await;
    let remote = remote.unwrap_err();
    assert!(remote.contains("may create only"), "{remote}");
    // meshca's own Secret passes.
    let (_, origin) = keysecret::ensure(&pod, &ns, NAME).await.unwrap();
    assert_eq!(origin, KeyOrigin::Created);
    Api::<ValidatingAdmissionPolicyBinding>::all(k.admin.clone())
        .delete(&name, &Default::default())
        .await
        .unwrap();
    Api::<ValidatingAdmissionPolicy>::all(k.admin.clone())
        .delete(&name, &Default::default())
        .await
        .unwrap();
}
