//! Audit heads anchored in the real kube-apiserver: each checkpoint lands in
//! the release's anchor ConfigMap under the replica's name (RBAC names only
//! that object) and as an Event; a stdout run continues its chain from the
//! anchored head; `meshca audit verify --anchors` cross-checks a log against
//! the cluster, and fails on a cut log or an edited anchor.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Event};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::Api;
use serde_json::json;

const CM: &str = "meshca-audit-anchors";

/// The chart's anchor RBAC, for the test user `meshca`: get and patch of
/// the one anchor ConfigMap, and Events.
async fn anchor_rbac(k: &common::Kte, ns: &str) {
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "meshca-audit-anchor"},
        "rules": [
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [CM], "verbs": ["get", "patch"]},
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}
        ]
    }))
    .unwrap();
    Api::<Role>::namespaced(k.admin.clone(), ns)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let rb: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "meshca-audit-anchor"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "meshca-audit-anchor"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "meshca"}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(k.admin.clone(), ns)
        .create(&PostParams::default(), &rb)
        .await
        .unwrap();
    // The chart creates the ConfigMap empty; meshca only patches its key.
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": CM}})).unwrap();
    Api::<ConfigMap>::namespaced(k.admin.clone(), ns)
        .create(&PostParams::default(), &cm)
        .await
        .unwrap();
}

/// One run of `meshca serve --dev` on stdout with anchoring on, writing its
/// stdout to `out`: issues one certificate, then stops with SIGTERM.
async fn run_once(k: &common::Kte, ns: &str, data: &Path, key: &Path, out: &Path) {
    let stdout = std::fs::File::create(out).unwrap();
    let mut cmd = meshca::testing::serve_dev_command(env!("CARGO_BIN_EXE_meshca").as_ref(), data);
    cmd.args([
        "--audit-sink",
        "stdout",
        "--audit-anchor",
        "true",
        "--audit-anchor-namespace",
        ns,
    ])
    .arg("--kubeconfig")
    .arg(k.meshca_kubeconfig())
    // The dev client renews an identity no pod runs as; this test is
    // about anchors, not bounded renewal (tests/kube_revoke.rs).
    .args(["--mtls-renewal-pod-check", "false"])
    .env("POD_NAME", "meshca-0")
    .env("MESHCA_AUDIT_CHECKPOINT_KEY", key)
    .stdout(stdout);
    let (mut child, addr, _) = meshca::testing::spawn_listening(cmd).await;
    let read = |f: &str| std::fs::read_to_string(data.join("dev-client").join(f)).unwrap();
    let mut c = meshca::testing::client(
        addr,
        &read("root-cert.pem"),
        Some((&read("cert-chain.pem"), &read("key.pem"))),
    )
    .await
    .unwrap();
    let csr_key = rcgen::KeyPair::generate().unwrap();
    c.create_certificate(meshca::testing::request(
        meshca::testing::csr_for(&csr_key, "spiffe://cluster.local/ns/default/sa/default"),
        0,
        &[],
    ))
    .await
    .unwrap();
    drop(c);
    let pid = child.id().unwrap();
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status}");
}

async fn anchor_line(k: &common::Kte, ns: &str) -> String {
    let cm = Api::<ConfigMap>::namespaced(k.admin.clone(), ns)
        .get(CM)
        .await
        .unwrap();
    cm.data.unwrap()["meshca-0"].clone()
}

fn meshca(args: &[&str]) -> (i32, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_meshca"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdout_runs_link_through_the_anchor_and_verify_against_the_cluster() {
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor").await;
    anchor_rbac(&k, &ns).await;
    let dir = tempfile::tempdir().unwrap();
    let (data, key) = (dir.path().join("data"), dir.path().join("checkpoint.pem"));
    std::fs::write(
        &key,
        meshca::audit::chain::CheckpointKey::generate_pem().unwrap(),
    )
    .unwrap();
    let (run1, run2, both) = (
        dir.path().join("run1.log"),
        dir.path().join("run2.log"),
        dir.path().join("both.log"),
    );

    run_once(&k, &ns, &data, &key, &run1).await;
    let first_anchor = anchor_line(&k, &ns).await;
    assert!(
        first_anchor.contains("\"reason\":\"shutdown\""),
        "{first_anchor}"
    );
    assert_eq!(
        first_anchor,
        std::fs::read_to_string(&run1)
            .unwrap()
            .lines()
            .last()
            .unwrap(),
        "the anchor holds the run's last line, the shutdown checkpoint"
    );

    // The second run (same replica, new process) continues from the anchor.
    run_once(&k, &ns, &data, &key, &run2).await;
    let start: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(&run2)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(start["reason"], "start");
    assert_eq!(start["previous"]["from"], "anchor");
    assert_eq!(
        start["previous"]["hash"].as_str().unwrap(),
        meshca::audit::chain::line_hash(&first_anchor)
    );

    // Each checkpoint is also an Event.
    let events = Api::<Event>::namespaced(k.admin.clone(), &ns)
        .list(&ListParams::default())
        .await
        .unwrap();
    let checkpoints = events
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("AuditCheckpoint"))
        .count();
    assert!(
        checkpoints >= 4,
        "start and shutdown of two runs: {checkpoints}"
    );

    // The concatenated stdout logs are one chain, and agree with the cluster.
    let whole = std::fs::read_to_string(&run1).unwrap() + &std::fs::read_to_string(&run2).unwrap();
    std::fs::write(&both, &whole).unwrap();
    let admin = k.dir.join("admin.kubeconfig");
    let verify = |log: &Path| {
        meshca(&[
            "audit",
            "verify",
            "--strict",
            "--key",
            key.to_str().unwrap(),
            "--anchors",
            "--kubeconfig",
            admin.to_str().unwrap(),
            "--anchor-namespace",
            &ns,
            log.to_str().unwrap(),
        ])
    };
    let (code, out) = verify(&both);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("1 chain start(s)") && out.contains("matches"),
        "{out}"
    );
    // The public key meshca published beside the heads verifies them too.
    let (code, out) = meshca(&[
        "audit",
        "verify",
        "--strict",
        "--anchors",
        "--keys-from-anchors",
        "--kubeconfig",
        admin.to_str().unwrap(),
        "--anchor-namespace",
        &ns,
        both.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("signature-verified") && !out.contains("(0 signature-verified)"),
        "{out}"
    );
    assert!(!out.contains("no --key given"), "{out}");

    // The whole last run removed: the log alone ends cleanly, the anchor
    // shows the cut.
    std::fs::write(&both, std::fs::read_to_string(&run1).unwrap()).unwrap();
    let (code, out) = verify(&both);
    assert_ne!(code, 0);
    assert!(out.contains("the log was cut after it"), "{out}");

    // An edited anchor fails its signature.
    std::fs::write(&both, &whole).unwrap();
    let edited = anchor_line(&k, &ns)
        .await
        .replace("\"reason\":\"shutdown\"", "\"reason\":\"periodic\"");
    Api::<ConfigMap>::namespaced(k.admin.clone(), &ns)
        .patch(
            CM,
            &PatchParams::default(),
            &Patch::Merge(&json!({"data": {"meshca-0": edited}})),
        )
        .await
        .unwrap();
    let (code, out) = verify(&both);
    assert_ne!(code, 0);
    assert!(out.contains("signature does not verify"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anchor_rbac_allows_only_the_anchor_configmap() {
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor-rbac").await;
    anchor_rbac(&k, &ns).await;
    let other: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "someone-elses"}})).unwrap();
    Api::<ConfigMap>::namespaced(k.admin.clone(), &ns)
        .create(&PostParams::default(), &other)
        .await
        .unwrap();
    let meshca = common::client(&k.meshca_kubeconfig()).await;
    let api = Api::<ConfigMap>::namespaced(meshca, &ns);
    let patch = Patch::Merge(json!({"data": {"meshca-0": "x"}}));
    api.patch(CM, &PatchParams::default(), &patch)
        .await
        .unwrap();
    let e = api
        .patch("someone-elses", &PatchParams::default(), &patch)
        .await
        .unwrap_err();
    assert!(matches!(&e, kube::Error::Api(s) if s.code == 403), "{e}");
    let e = api.list(&ListParams::default()).await.unwrap_err();
    assert!(matches!(&e, kube::Error::Api(s) if s.code == 403), "{e}");
}

/// Two anchored stdout runs of replica meshca-0: the whole log, run 1's
/// lines alone (the log with the last run removed), and run 1's shutdown
/// checkpoint (an older genuine anchor).
struct TwoRuns {
    _dir: tempfile::TempDir,
    key: std::path::PathBuf,
    whole: std::path::PathBuf,
    cut: std::path::PathBuf,
    run1_shutdown: String,
}

async fn two_runs(k: &common::Kte, ns: &str) -> TwoRuns {
    let dir = tempfile::tempdir().unwrap();
    let (data, key) = (dir.path().join("data"), dir.path().join("checkpoint.pem"));
    std::fs::write(
        &key,
        meshca::audit::chain::CheckpointKey::generate_pem().unwrap(),
    )
    .unwrap();
    let (run1, run2) = (dir.path().join("run1.log"), dir.path().join("run2.log"));
    run_once(k, ns, &data, &key, &run1).await;
    run_once(k, ns, &data, &key, &run2).await;
    let (r1, r2) = (
        std::fs::read_to_string(&run1).unwrap(),
        std::fs::read_to_string(&run2).unwrap(),
    );
    let (whole, cut) = (dir.path().join("whole.log"), dir.path().join("cut.log"));
    std::fs::write(&whole, format!("{r1}{r2}")).unwrap();
    std::fs::write(&cut, &r1).unwrap();
    TwoRuns {
        run1_shutdown: r1.lines().last().unwrap().to_string(),
        _dir: dir,
        key,
        whole,
        cut,
    }
}

/// `meshca audit verify --strict --key K --anchors` of `log` against the cluster.
fn verify_against(k: &common::Kte, ns: &str, t: &TwoRuns, log: &Path) -> (i32, String) {
    let admin = k.dir.join("admin.kubeconfig");
    meshca(&[
        "audit",
        "verify",
        "--strict",
        "--key",
        t.key.to_str().unwrap(),
        "--anchors",
        "--kubeconfig",
        admin.to_str().unwrap(),
        "--anchor-namespace",
        ns,
        log.to_str().unwrap(),
    ])
}

/// Whoever holds the pod removes the last run from the log and sets the
/// replica's anchor back to an older genuine checkpoint (run 1's shutdown),
/// with the pod's own credentials: verify must still see the cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_rolling_its_anchor_back_is_detected() {
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor-rollback").await;
    anchor_rbac(&k, &ns).await;
    let t = two_runs(&k, &ns).await;
    let (code, out) = verify_against(&k, &ns, &t, &t.whole);
    assert_eq!(code, 0, "{out}");

    let pod = common::client(&k.meshca_kubeconfig()).await;
    let rolled = Api::<ConfigMap>::namespaced(pod, &ns)
        .patch(
            CM,
            &PatchParams::default(),
            &Patch::Merge(&json!({"data": {"meshca-0": t.run1_shutdown}})),
        )
        .await;
    println!("pod's patch of its anchor: {:?}", rolled.map(|_| ()));

    let (code, out) = verify_against(&k, &ns, &t, &t.cut);
    assert_ne!(code, 0, "a rolled-back anchor hid the cut: {out}");
}

/// Whoever holds the pod removes the last run from the log and deletes the
/// replica's anchor with the pod's own credentials: verify must fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleting_its_anchor_is_detected() {
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor-delete").await;
    anchor_rbac(&k, &ns).await;
    let t = two_runs(&k, &ns).await;

    let pod = common::client(&k.meshca_kubeconfig()).await;
    let deleted = Api::<ConfigMap>::namespaced(pod, &ns)
        .patch(
            CM,
            &PatchParams::default(),
            &Patch::Merge(&json!({"data": {"meshca-0": null}})),
        )
        .await;
    println!("pod's delete of its anchor: {:?}", deleted.map(|_| ()));

    let (code, out) = verify_against(&k, &ns, &t, &t.cut);
    assert_ne!(code, 0, "a deleted anchor hid the cut: {out}");
}

/// A namespace admin deletes the anchor ConfigMap, and the chart (helm
/// upgrade) creates it again empty: a log of a replica that has no anchor
/// must fail under --anchors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_anchor_configmap_is_detected() {
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor-cm").await;
    anchor_rbac(&k, &ns).await;
    let t = two_runs(&k, &ns).await;

    let api = Api::<ConfigMap>::namespaced(k.admin.clone(), &ns);
    api.delete(CM, &Default::default()).await.unwrap();
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": CM}})).unwrap();
    api.create(&PostParams::default(), &cm).await.unwrap();

    let (code, out) = verify_against(&k, &ns, &t, &t.cut);
    assert_ne!(code, 0, "a deleted anchor ConfigMap hid the cut: {out}");
}
