//! Audit anchors in the real kube-apiserver, append-only: each anchored
//! checkpoint is a new immutable ConfigMap which meshca, with the chart's
//! RBAC (tests/fixtures/rbac-audit-anchor.yaml), may create and read but
//! never change or remove. A stdout run continues its chain from its newest
//! anchor; `meshca audit verify --anchors` reads the whole history back and
//! fails on a cut log, an edited anchor, and each way whoever holds the pod
//! (or the namespace) tries to roll the anchors back or remove them.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Event};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::Api;
use meshca::audit::anchor::{self, AnchorSettings, LABEL_SET};
use serde_json::json;

const SET: &str = "meshca-audit-anchors";
const REPLICA: &str = "meshca-0";

/// The chart's anchor Role, bound to the test user `meshca`.
async fn anchor_rbac(k: &common::Kte, ns: &str) {
    k.meshca_role(ns, "tests/fixtures/rbac-audit-anchor.yaml")
        .await;
}

/// One run of `meshca serve --dev` on stdout with anchoring on, as the
/// user `meshca`, writing its stdout to `out`: issues one certificate (or
/// keeps issuing for `load`), then stops with SIGTERM. Returns the admin
/// address's /metrics text, read just before the stop.
async fn run_once(
    k: &common::Kte,
    ns: &str,
    data: &Path,
    key: &Path,
    out: &Path,
    extra: &[&str],
    load: Duration,
) -> String {
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
    .args(extra)
    .arg("--kubeconfig")
    .arg(k.meshca_kubeconfig())
    // The dev client renews an identity no pod runs as; this test is
    // about anchors, not bounded renewal (tests/kube_revoke.rs).
    .args(["--mtls-renewal-pod-check", "false"])
    .env("POD_NAME", REPLICA)
    .env("MESHCA_AUDIT_CHECKPOINT_KEY", key)
    .stdout(stdout);
    let (child, addr, admin) = meshca::testing::spawn_listening(cmd).await;
    let mut c = meshca::testing::dev_client(addr, data).await;
    let csr_key = rcgen::KeyPair::generate().unwrap();
    let csr = meshca::testing::csr_for(&csr_key, "spiffe://cluster.local/ns/default/sa/default");
    let until = Instant::now() + load;
    loop {
        c.create_certificate(meshca::testing::request(csr.clone(), 0, &[]))
            .await
            .unwrap();
        if Instant::now() >= until {
            break;
        }
    }
    drop(c);
    let metrics = std::process::Command::new("curl")
        .args(["-sf", &format!("http://{admin}/metrics")])
        .output()
        .unwrap();
    let status = meshca::testing::terminate(child, Duration::from_secs(20)).await;
    assert!(status.success(), "{status}");
    String::from_utf8_lossy(&metrics.stdout).into_owned()
}

fn by_set() -> ListParams {
    ListParams::default().labels(&format!(
        "{LABEL_SET}={SET},audit.meshca.io/kind=checkpoint"
    ))
}

/// The checkpoint anchors in the namespace, oldest first (as verify orders them).
async fn anchors(k: &common::Kte, ns: &str) -> Vec<ConfigMap> {
    let mut v = Api::<ConfigMap>::namespaced(k.admin.clone(), ns)
        .list(&by_set())
        .await
        .unwrap()
        .items;
    v.sort_by_key(|c| {
        let seq: u64 = serde_json::from_str::<serde_json::Value>(&line(c)).unwrap()["seq"]
            .as_u64()
            .unwrap();
        (c.metadata.creation_timestamp.clone().unwrap().0, seq)
    });
    v
}

fn line(cm: &ConfigMap) -> String {
    cm.data.as_ref().unwrap()[anchor::DATA_CHECKPOINT].clone()
}

fn name(cm: &ConfigMap) -> String {
    cm.metadata.name.clone().unwrap()
}

fn meshca(args: &[&str]) -> (i32, String) {
    meshca::testing::run_cli(env!("CARGO_BIN_EXE_meshca").as_ref(), args)
}

/// Two anchored stdout runs of replica meshca-0: the whole log, run 1's
/// lines alone (the log with the last run removed), and run 1's shutdown
/// checkpoint (an older genuine anchor).
struct TwoRuns {
    _dir: tempfile::TempDir,
    key: PathBuf,
    run1: PathBuf,
    run2: PathBuf,
    whole: PathBuf,
    cut: PathBuf,
    run1_shutdown: String,
}

async fn two_runs(k: &common::Kte, ns: &str) -> TwoRuns {
    let dir = tempfile::tempdir().unwrap();
    let (data, key) = (dir.path().join("data"), dir.path().join("checkpoint.pem"));
    std::fs::write(
        &key,
        meshca::audit::keys::CheckpointKey::generate_pem().unwrap(),
    )
    .unwrap();
    let (run1, run2) = (dir.path().join("run1.log"), dir.path().join("run2.log"));
    run_once(k, ns, &data, &key, &run1, &[], Duration::ZERO).await;
    run_once(k, ns, &data, &key, &run2, &[], Duration::ZERO).await;
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
        run1,
        run2,
        whole,
        cut,
    }
}

/// `meshca audit verify --strict --key K --anchors [extra]` of `log`.
fn verify_against(
    k: &common::Kte,
    ns: &str,
    key: &Path,
    log: &Path,
    extra: &[&str],
) -> (i32, String) {
    let admin = k.dir.join("admin.kubeconfig");
    let mut args = vec![
        "audit",
        "verify",
        "--strict",
        "--key",
        key.to_str().unwrap(),
        "--anchors",
        "--kubeconfig",
        admin.to_str().unwrap(),
        "--anchor-namespace",
        ns,
    ];
    args.extend_from_slice(extra);
    args.push(log.to_str().unwrap());
    meshca(&args)
}

/// The pod's own API client: the test user `meshca` with the chart's Role.
async fn pod_client(k: &common::Kte) -> kube::Client {
    common::client(&k.meshca_kubeconfig()).await
}

#[track_caller]
fn assert_forbidden<T: std::fmt::Debug>(what: &str, r: Result<T, kube::Error>) {
    match r {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => panic!("{what}: expected 403 Forbidden, got {other:?}"),
    }
}

/// An anchor object as meshca writes it, holding `line`.
fn anchor_object(ns: &str, line: &str) -> ConfigMap {
    anchor::checkpoint_object(
        &AnchorSettings {
            namespace: ns.into(),
            set: SET.into(),
            replica: REPLICA.into(),
            interval: Duration::from_secs(60),
        },
        line,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdout_runs_link_through_the_anchor_history_and_verify_against_the_cluster() {
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor").await;
    anchor_rbac(&k, &ns).await;
    let t = two_runs(&k, &ns).await;
    let (r1, r2) = (
        std::fs::read_to_string(&t.run1).unwrap(),
        std::fs::read_to_string(&t.run2).unwrap(),
    );

    // Each run anchored its start and its shutdown, each as its own
    // immutable object named after replica, run and seq.
    let all = anchors(&k, &ns).await;
    let lines: Vec<String> = all.iter().map(line).collect();
    let want: Vec<String> = [&r1, &r2]
        .iter()
        .flat_map(|r| [r.lines().next().unwrap(), r.lines().last().unwrap()])
        .map(str::to_string)
        .collect();
    assert_eq!(lines, want, "start and shutdown of both runs, in order");
    for cm in &all {
        assert_eq!(cm.immutable, Some(true), "{}", name(cm));
        let cp: serde_json::Value = serde_json::from_str(&line(cm)).unwrap();
        assert_eq!(
            name(cm),
            format!(
                "{SET}.{REPLICA}.{}.{}",
                cp["run"].as_str().unwrap(),
                cp["seq"]
            ),
        );
    }

    // The second run (same replica, new process) continues from the newest anchor.
    let start: serde_json::Value = serde_json::from_str(r2.lines().next().unwrap()).unwrap();
    assert_eq!(start["reason"], "start");
    assert_eq!(start["previous"]["from"], "anchor");
    assert_eq!(
        start["previous"]["hash"].as_str().unwrap(),
        meshca::audit::format::line_hash(&t.run1_shutdown)
    );

    // Each anchor is also an Event about its object.
    let events = Api::<Event>::namespaced(k.admin.clone(), &ns)
        .list(&ListParams::default())
        .await
        .unwrap();
    let mut about: Vec<String> = events
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("AuditCheckpoint"))
        .map(|e| e.involved_object.name.clone().unwrap())
        .collect();
    about.sort();
    let mut names: Vec<String> = all.iter().map(name).collect();
    names.sort();
    assert_eq!(about, names);

    // The concatenated stdout logs are one chain, and agree with the cluster.
    let (code, out) = verify_against(&k, &ns, &t.key, &t.whole, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("1 chain start(s)")
            && out.contains("4 anchor(s), 4 in the log, 2 run(s)")
            && out.contains("newest anchored checkpoint")
            && out.contains("matches"),
        "{out}"
    );
    // The public key meshca published beside the anchors verifies them too.
    let admin = k.dir.join("admin.kubeconfig");
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
        t.whole.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("signature-verified") && !out.contains("(0 signature-verified)"),
        "{out}"
    );
    assert!(!out.contains("no --key given"), "{out}");

    // Run 2 alone begins after run 1's anchors: accepted only with --partial.
    let (code, out) = verify_against(&k, &ns, &t.key, &t.run2, &[]);
    assert_ne!(code, 0, "{out}");
    let (code, out) = verify_against(&k, &ns, &t.key, &t.run2, &["--partial"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("2 before the log's first line"), "{out}");

    // The whole last run removed: the log alone ends cleanly, the anchors
    // show the cut.
    let (code, out) = verify_against(&k, &ns, &t.key, &t.cut, &[]);
    assert_ne!(code, 0);
    assert!(out.contains("the log was cut after it"), "{out}");

    // Anchors are immutable even for an administrator; one who deletes an
    // anchor and recreates it edited fails its signature.
    let api = Api::<ConfigMap>::namespaced(k.admin.clone(), &ns);
    let newest = all.last().unwrap();
    let edited = line(newest).replace("\"reason\":\"shutdown\"", "\"reason\":\"periodic\"");
    let e = api
        .patch(
            &name(newest),
            &PatchParams::default(),
            &Patch::Merge(&json!({"data": {anchor::DATA_CHECKPOINT: edited}})),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&e, kube::Error::Api(s) if s.code == 422 && s.message.contains("immutable")),
        "{e}"
    );
    api.delete(&name(newest), &DeleteParams::default())
        .await
        .unwrap();
    api.create(&PostParams::default(), &anchor_object(&ns, &edited))
        .await
        .unwrap();
    let (code, out) = verify_against(&k, &ns, &t.key, &t.whole, &[]);
    assert_ne!(code, 0);
    assert!(out.contains("signature does not verify"), "{out}");
}

/// With the chart's Role the pod can add anchors and read them, and gets
/// 403 Forbidden for every verb that would change or remove one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pod_can_add_anchors_but_not_change_or_remove_them() {
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor-rbac").await;
    anchor_rbac(&k, &ns).await;
    let t = two_runs(&k, &ns).await;
    let written = anchors(&k, &ns).await;
    let newest = written.last().unwrap();
    let other: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "someone-elses"}})).unwrap();
    Api::<ConfigMap>::namespaced(k.admin.clone(), &ns)
        .create(&PostParams::default(), &other)
        .await
        .unwrap();

    let api = Api::<ConfigMap>::namespaced(pod_client(&k).await, &ns);
    assert_eq!(
        api.list(&by_set()).await.unwrap().items.len(),
        written.len()
    );
    api.get(&name(newest)).await.unwrap();
    let rollback = Patch::Merge(json!({"data": {anchor::DATA_CHECKPOINT: t.run1_shutdown}}));
    assert_forbidden(
        "merge patch of an anchor",
        api.patch(&name(newest), &PatchParams::default(), &rollback)
            .await,
    );
    assert_forbidden(
        "server-side apply to an anchor",
        api.patch(
            &name(newest),
            &PatchParams::apply("attacker").force(),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "data": {}})),
        )
        .await,
    );
    let mut replaced = newest.clone();
    replaced.data = Some([(anchor::DATA_CHECKPOINT.to_string(), t.run1_shutdown.clone())].into());
    assert_forbidden(
        "update of an anchor",
        api.replace(&name(newest), &PostParams::default(), &replaced)
            .await,
    );
    let mut relabelled = newest.clone();
    relabelled.metadata.labels = None;
    assert_forbidden(
        "relabelling an anchor out of the set",
        api.replace(&name(newest), &PostParams::default(), &relabelled)
            .await,
    );
    assert_forbidden(
        "delete of an anchor",
        api.delete(&name(newest), &DeleteParams::default()).await,
    );
    assert_forbidden(
        "deletecollection of the anchors",
        api.delete_collection(&DeleteParams::default(), &by_set())
            .await,
    );
    assert_forbidden(
        "patch of another ConfigMap",
        api.patch("someone-elses", &PatchParams::default(), &rollback)
            .await,
    );
    // Nothing changed.
    assert_eq!(anchors(&k, &ns).await, written);
}

/// Whoever holds the pod removes the last run from the log and sets the
/// replica's anchor back to an older genuine checkpoint (run 1's shutdown),
/// with the pod's own credentials. It cannot change the newest anchor, so
/// it anchors the old checkpoint again as a new object: verify sees both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_rolling_its_anchor_back_is_detected() {
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor-rollback").await;
    anchor_rbac(&k, &ns).await;
    let t = two_runs(&k, &ns).await;
    let (code, out) = verify_against(&k, &ns, &t.key, &t.whole, &[]);
    assert_eq!(code, 0, "{out}");

    let api = Api::<ConfigMap>::namespaced(pod_client(&k).await, &ns);
    let newest = name(anchors(&k, &ns).await.last().unwrap());
    assert_forbidden(
        "rolling the newest anchor back",
        api.patch(
            &newest,
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {anchor::DATA_CHECKPOINT: t.run1_shutdown}})),
        )
        .await,
    );
    // At a name meshca itself could have written it under (its own name
    // with a fresh suffix); at any other name verify reports a squat.
    let mut again = anchor_object(&ns, &t.run1_shutdown);
    let own = again.metadata.name.clone().unwrap();
    again.metadata.name = Some(format!("{own}.0123456789abcdef"));
    // Stored a second later than every genuine anchor, as it would be.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    api.create(&PostParams::default(), &again).await.unwrap();

    let (code, out) = verify_against(&k, &ns, &t.key, &t.cut, &[]);
    assert_ne!(code, 0, "a rolled-back anchor hid the cut: {out}");
    assert!(
        out.contains("an older head was anchored again (a rollback)"),
        "{out}"
    );
}

/// Whoever holds the pod (and so the checkpoint key) removes the last run
/// and writes a new run continuing from run 1's shutdown, anchoring it as
/// meshca would: the anchors went backwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_continuing_from_an_older_anchor_is_detected() {
    use meshca::audit::chain::{ChainedSink, Destination, RunInfo, SinkOptions};
    use meshca::audit::keys::CheckpointKey;
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor-fork").await;
    anchor_rbac(&k, &ns).await;
    let t = two_runs(&k, &ns).await;

    let key = CheckpointKey::from_pem(&std::fs::read(&t.key).unwrap()).unwrap();
    let head = (
        serde_json::from_str::<serde_json::Value>(&t.run1_shutdown).unwrap()["seq"]
            .as_u64()
            .unwrap(),
        meshca::audit::format::line_hash(&t.run1_shutdown),
    );
    let forged = ChainedSink::open(SinkOptions {
        key: Some(key),
        run: RunInfo::new(REPLICA),
        head: Some(head),
        ..SinkOptions::new(Destination::Buffer)
    })
    .unwrap();
    forged.checkpoint("shutdown").unwrap();
    let run3 = forged.buffer_contents();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let api = Api::<ConfigMap>::namespaced(pod_client(&k).await, &ns);
    for l in run3.lines() {
        api.create(&PostParams::default(), &anchor_object(&ns, l))
            .await
            .unwrap();
    }
    let log = t.cut.with_file_name("forked.log");
    std::fs::write(&log, std::fs::read_to_string(&t.run1).unwrap() + &run3).unwrap();
    let (code, out) = verify_against(&k, &ns, &t.key, &log, &[]);
    assert_ne!(code, 0, "a forked history passed: {out}");
    assert!(out.contains("its history was rolled back"), "{out}");
}

/// Whoever holds the pod removes the last run from the log and tries to
/// delete the replica's anchors with the pod's own credentials.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleting_its_anchor_is_detected() {
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor-delete").await;
    anchor_rbac(&k, &ns).await;
    let t = two_runs(&k, &ns).await;

    let api = Api::<ConfigMap>::namespaced(pod_client(&k).await, &ns);
    for cm in anchors(&k, &ns).await {
        assert_forbidden(
            "delete",
            api.delete(&name(&cm), &DeleteParams::default()).await,
        );
    }
    assert_forbidden(
        "deletecollection",
        api.delete_collection(&DeleteParams::default(), &by_set())
            .await,
    );

    let (code, out) = verify_against(&k, &ns, &t.key, &t.cut, &[]);
    assert_ne!(code, 0, "a deleted anchor hid the cut: {out}");
    assert!(out.contains("the log was cut after it"), "{out}");
}

/// Someone with delete rights in the namespace (not the pod) removes every
/// anchor object of the replica: its log has no anchor, which fails
/// --anchors unless --partial names the replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_anchor_configmap_is_detected() {
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor-cm").await;
    anchor_rbac(&k, &ns).await;
    let t = two_runs(&k, &ns).await;

    let api = Api::<ConfigMap>::namespaced(k.admin.clone(), &ns);
    for cm in anchors(&k, &ns).await {
        api.delete(&name(&cm), &DeleteParams::default())
            .await
            .unwrap();
    }
    for log in [&t.cut, &t.whole] {
        let (code, out) = verify_against(&k, &ns, &t.key, log, &[]);
        assert_ne!(code, 0, "deleted anchors hid the cut: {out}");
        assert!(
            out.contains("replica meshca-0 has no anchor in the cluster"),
            "{out}"
        );
    }
    let (code, out) = verify_against(&k, &ns, &t.key, &t.whole, &["--partial=meshca-0"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("(accepted by --partial)"), "{out}");
}

/// Periodic anchors are limited by --audit-anchor-interval however many
/// checkpoints the writer makes; start and shutdown always go. Measures the
/// objects and bytes this puts into the API server's etcd, per replica and
/// day, and checks the whole history against the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anchors_per_replica_and_day_are_bounded_by_the_interval() {
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor-cost").await;
    anchor_rbac(&k, &ns).await;
    let dir = tempfile::tempdir().unwrap();
    let (data, key, log) = (
        dir.path().join("data"),
        dir.path().join("checkpoint.pem"),
        dir.path().join("run.log"),
    );
    std::fs::write(
        &key,
        meshca::audit::keys::CheckpointKey::generate_pem().unwrap(),
    )
    .unwrap();
    let load = Duration::from_secs(12);
    let t0 = Instant::now();
    let metrics = run_once(
        &k,
        &ns,
        &data,
        &key,
        &log,
        // A checkpoint after every record: far more than the interval lets through.
        &[
            "--audit-checkpoint-every",
            "1",
            "--audit-anchor-interval",
            "1s",
        ],
        load,
    )
    .await;
    let secs = t0.elapsed().as_secs_f64();
    let text = std::fs::read_to_string(&log).unwrap();
    let checkpoints = text
        .lines()
        .filter(|l| l.contains("\"type\":\"checkpoint\""))
        .count();
    let all = anchors(&k, &ns).await;
    let n = all.len();
    // One periodic anchor per second at most, plus start and shutdown.
    assert!(n as f64 <= secs + 3.0, "{n} anchors in {secs:.1}s");
    assert!(
        n >= 8,
        "{n} anchors in {secs:.1}s: the interval should let about one a second through"
    );
    assert!(
        checkpoints > 5 * n,
        "{checkpoints} checkpoints, {n} anchors"
    );
    let metric = |name: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .map(|v| v.parse().unwrap())
            .unwrap_or(0.0)
    };
    let written = metric("meshca_audit_anchor_writes_total{result=\"written\"}");
    let coalesced = metric("meshca_audit_anchor_coalesced_total");
    assert!(
        written >= (n - 2) as f64,
        "{written} written by the metric, {n} stored\n{metrics}"
    );
    assert!(coalesced > 0.0, "{metrics}");

    // Bytes: as etcd stores them (key + value), and as JSON from the API.
    let conf = std::fs::read_to_string(k.dir.join("kte.conf")).unwrap();
    let port = conf
        .lines()
        .find_map(|l| l.strip_prefix("ETCD_PORT="))
        .unwrap()
        .trim_matches(|c| c == '"' || c == '\'')
        .to_string();
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let etcd_bytes = |prefix: &str| -> (usize, usize) {
        let mut end = prefix.as_bytes().to_vec();
        *end.last_mut().unwrap() += 1;
        let body = json!({"key": b64(prefix), "range_end": base64::engine::general_purpose::STANDARD.encode(&end)});
        let out = std::process::Command::new("curl")
            .args([
                "-sf",
                "-X",
                "POST",
                &format!("http://127.0.0.1:{port}/v3/kv/range"),
                "-d",
                &body.to_string(),
            ])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let kvs = v["kvs"].as_array().cloned().unwrap_or_default();
        let bytes = kvs
            .iter()
            .map(|kv| {
                let d = |f: &str| {
                    base64::engine::general_purpose::STANDARD
                        .decode(kv[f].as_str().unwrap_or(""))
                        .unwrap()
                        .len()
                };
                d("key") + d("value")
            })
            .sum();
        (kvs.len(), bytes)
    };
    let (cm_objects, cm_bytes) = etcd_bytes(&format!("/registry/configmaps/{ns}/{SET}."));
    let (ev_objects, ev_bytes) = etcd_bytes(&format!("/registry/events/{ns}/"));
    let key_objects = 1;
    assert_eq!(cm_objects, n + key_objects, "anchors and the published key");
    let json_bytes: usize = all
        .iter()
        .map(|c| serde_json::to_vec(c).unwrap().len())
        .sum();
    let per = cm_bytes as f64 / cm_objects as f64;
    let per_ev = ev_bytes as f64 / ev_objects.max(1) as f64;
    let day = 86_400.0 / 60.0;
    println!(
        "anchor cost: {checkpoints} checkpoints in {secs:.1}s at --audit-anchor-interval 1s -> {n} anchors ({written} written, {coalesced} coalesced by the metrics); \
         etcd: {per:.0} bytes per anchor object (key+value, {cm_objects} objects incl. the key), {per_ev:.0} per Event ({ev_objects}); \
         API JSON {:.0} bytes per anchor. At the default 60s: at most {day:.0} periodic anchors + 2 per restart per replica and day = {:.2} MB etcd/day ({:.1} MB per 30 days), \
         and at most {:.0} live Events ({:.2} MB, they expire after --event-ttl 1h)",
        json_bytes as f64 / n as f64,
        day * per / 1e6,
        30.0 * day * per / 1e6,
        3600.0 / 60.0,
        60.0 * per_ev / 1e6,
    );

    let (code, out) = verify_against(&k, &ns, &key, &log, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!("{n} anchor(s), {n} in the log, 1 run(s)")),
        "{out}"
    );
}

/// Retention: an administrator's `meshca audit prune-anchors` removes old
/// anchors but keeps each replica's newest, so the log still verifies; the
/// pod's own credentials cannot prune.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_administrator_prunes_old_anchors_and_the_history_still_verifies() {
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor-prune").await;
    anchor_rbac(&k, &ns).await;
    let t = two_runs(&k, &ns).await;
    let before = anchors(&k, &ns).await;
    assert_eq!(before.len(), 4);
    // Creation times have one-second resolution.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let prune = |kubeconfig: &Path, extra: &[&str]| {
        let mut args = vec![
            "audit",
            "prune-anchors",
            "--older-than",
            "0s",
            "--anchor-namespace",
            &ns,
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        meshca(&args)
    };
    let admin = k.dir.join("admin.kubeconfig");

    let (code, out) = prune(&k.meshca_kubeconfig(), &[]);
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("forbidden") || out.contains("Forbidden"),
        "{out}"
    );
    let (code, out) = prune(&admin, &["--dry-run"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("3 of 4 checkpoint anchor(s) would be removed"),
        "{out}"
    );
    assert_eq!(anchors(&k, &ns).await, before);

    let (code, out) = prune(&admin, &[]);
    assert_eq!(code, 0, "{out}");
    let after = anchors(&k, &ns).await;
    assert_eq!(after, before[3..], "the newest (run 2's shutdown) stays");
    let (code, out) = verify_against(&k, &ns, &t.key, &t.whole, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("1 anchor(s), 1 in the log"), "{out}");
    // The kept anchor still shows a cut of the last run.
    let (code, out) = verify_against(&k, &ns, &t.key, &t.cut, &[]);
    assert_ne!(code, 0);
    assert!(out.contains("the log was cut after it"), "{out}");
}

/// The anchor objects of `replica` in the namespace, as the admin sees them.
async fn replica_anchors(k: &common::Kte, ns: &str, replica: &str) -> Vec<ConfigMap> {
    Api::<ConfigMap>::namespaced(k.admin.clone(), ns)
        .list(&ListParams::default().labels(&format!(
            "{LABEL_SET}={SET},{}={replica}",
            anchor::LABEL_REPLICA
        )))
        .await
        .unwrap()
        .items
}

/// A signed start checkpoint of another replica (`meshca-1`): a genuine
/// line whoever holds the namespace can read and copy.
fn other_replicas_line(key: &Path) -> String {
    use meshca::audit::chain::{ChainedSink, Destination, RunInfo, SinkOptions};
    let sink = ChainedSink::open(SinkOptions {
        key: Some(
            meshca::audit::keys::CheckpointKey::from_pem(&std::fs::read(key).unwrap()).unwrap(),
        ),
        run: RunInfo::new("meshca-1"),
        ..SinkOptions::new(Destination::Buffer)
    })
    .unwrap();
    sink.buffer_contents().lines().next().unwrap().to_string()
}

/// Whoever holds a pod of the namespace creates objects at the names of a
/// running replica's next anchors (its run id is in its start anchor, and
/// the seq only grows), each holding another replica's genuine signed
/// checkpoint. The replica still anchors its shutdown (under a fresh name,
/// counted as `audit_anchor_conflict`), and `verify --anchors` reports the
/// squatting objects instead of counting them as the other replica's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn squatted_anchor_names_neither_stop_anchoring_nor_pass_verify() {
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor-squat").await;
    anchor_rbac(&k, &ns).await;
    let dir = tempfile::tempdir().unwrap();
    let (data, key, log) = (
        dir.path().join("data"),
        dir.path().join("checkpoint.pem"),
        dir.path().join("run.log"),
    );
    std::fs::write(
        &key,
        meshca::audit::keys::CheckpointKey::generate_pem().unwrap(),
    )
    .unwrap();
    let mut cmd = meshca::testing::serve_dev_command(env!("CARGO_BIN_EXE_meshca").as_ref(), &data);
    cmd.args([
        "--audit-sink",
        "stdout",
        "--audit-anchor",
        "true",
        "--audit-anchor-namespace",
        &ns,
        "--mtls-renewal-pod-check",
        "false",
    ])
    .arg("--kubeconfig")
    .arg(k.meshca_kubeconfig())
    .env("POD_NAME", REPLICA)
    .env("MESHCA_AUDIT_CHECKPOINT_KEY", &key)
    .stdout(std::fs::File::create(&log).unwrap());
    let (child, addr, admin) = meshca::testing::spawn_listening(cmd).await;

    // The replica's start anchor names its run and seq.
    let deadline = Instant::now() + Duration::from_secs(20);
    let start = loop {
        if let Some(cm) = replica_anchors(&k, &ns, REPLICA).await.first() {
            break line(cm);
        }
        assert!(Instant::now() < deadline, "no start anchor");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let start: serde_json::Value = serde_json::from_str(&start).unwrap();
    let (run, seq) = (
        start["run"].as_str().unwrap().to_string(),
        start["seq"].as_u64().unwrap(),
    );
    // Squat the next 60 names with the pod's own credentials.
    let other = other_replicas_line(&key);
    let api = Api::<ConfigMap>::namespaced(pod_client(&k).await, &ns);
    let mut squatted = Vec::new();
    for s in seq + 1..=seq + 60 {
        let mut cm = anchor_object(&ns, &other);
        let n = anchor::checkpoint_name(SET, REPLICA, &run, s);
        cm.metadata.name = Some(n.clone());
        api.create(&PostParams::default(), &cm).await.unwrap();
        squatted.push(n);
    }

    let mut c = meshca::testing::dev_client(addr, &data).await;
    let csr_key = rcgen::KeyPair::generate().unwrap();
    let csr = meshca::testing::csr_for(&csr_key, "spiffe://cluster.local/ns/default/sa/default");
    for _ in 0..3 {
        c.create_certificate(meshca::testing::request(csr.clone(), 0, &[]))
            .await
            .unwrap();
    }
    drop(c);
    let status = meshca::testing::terminate(child, Duration::from_secs(40)).await;
    assert!(status.success(), "{status}");
    let _ = admin;

    let text = std::fs::read_to_string(&log).unwrap();
    let shutdown = text.lines().last().unwrap().to_string();
    let cp: serde_json::Value = serde_json::from_str(&shutdown).unwrap();
    assert_eq!(cp["reason"], "shutdown");
    let shutdown_name = anchor::checkpoint_name(SET, REPLICA, &run, cp["seq"].as_u64().unwrap());
    assert!(
        squatted.contains(&shutdown_name),
        "the test squatted the shutdown's own name {shutdown_name}"
    );
    // The shutdown was anchored all the same, under a fresh name.
    let holding: Vec<String> = replica_anchors(&k, &ns, REPLICA)
        .await
        .iter()
        .filter(|cm| line(cm) == shutdown)
        .map(name)
        .collect();
    assert_eq!(
        holding.len(),
        1,
        "the shutdown checkpoint is not anchored: {holding:?}"
    );
    assert!(
        holding[0].starts_with(&format!("{shutdown_name}.")),
        "{holding:?}"
    );

    // The squatting objects are reported, not counted as meshca-1's.
    let (code, out) = verify_against(&k, &ns, &key, &log, &[]);
    assert_ne!(
        code, 0,
        "squatting objects passed as another replica's anchors: {out}"
    );
    assert!(out.contains("squatting on an anchor name"), "{out}");
    // Without them the log and its anchors (the fresh name included) verify.
    let admin_api = Api::<ConfigMap>::namespaced(k.admin.clone(), &ns);
    for n in &squatted {
        admin_api.delete(n, &DeleteParams::default()).await.unwrap();
    }
    let (code, out) = verify_against(&k, &ns, &key, &log, &[]);
    assert_eq!(code, 0, "{out}");
}

/// Anyone who can create ConfigMaps in the namespace creates an unsigned
/// (`alg: none`) checkpoint at the replica's next anchor name, continuing
/// from a made-up head. The replica restarts: it does not take that object
/// as its head (it continues from its own signed shutdown anchor), says so
/// in its log and its metrics, and the genuine log still verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsigned_anchor_is_not_taken_as_the_head() {
    use meshca::audit::chain::{ChainedSink, Destination, RunInfo, SinkOptions};
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor-unsigned").await;
    anchor_rbac(&k, &ns).await;
    let dir = tempfile::tempdir().unwrap();
    let (data, key) = (dir.path().join("data"), dir.path().join("checkpoint.pem"));
    std::fs::write(
        &key,
        meshca::audit::keys::CheckpointKey::generate_pem().unwrap(),
    )
    .unwrap();
    let (run1, run2) = (dir.path().join("run1.log"), dir.path().join("run2.log"));
    run_once(&k, &ns, &data, &key, &run1, &[], Duration::ZERO).await;
    let r1 = std::fs::read_to_string(&run1).unwrap();

    // The forged head: no key, far past the replica's real head.
    let forged = ChainedSink::open(SinkOptions {
        run: RunInfo::new(REPLICA),
        head: Some((1000, "ff".repeat(32))),
        ..SinkOptions::new(Destination::Buffer)
    })
    .unwrap();
    let forged_line = forged.buffer_contents().lines().next().unwrap().to_string();
    assert!(forged_line.contains("\"alg\":\"none\""), "{forged_line}");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let forged_obj = anchor_object(&ns, &forged_line);
    Api::<ConfigMap>::namespaced(pod_client(&k).await, &ns)
        .create(&PostParams::default(), &forged_obj)
        .await
        .unwrap();

    let metrics = run_once(&k, &ns, &data, &key, &run2, &[], Duration::ZERO).await;
    let r2 = std::fs::read_to_string(&run2).unwrap();
    let start: serde_json::Value = serde_json::from_str(r2.lines().next().unwrap()).unwrap();
    assert_eq!(
        start["previous"]["hash"].as_str(),
        Some(meshca::audit::format::line_hash(r1.lines().last().unwrap()).as_str()),
        "run 2 continues from run 1's signed shutdown anchor: {start}"
    );
    // Said in the audit log, and counted.
    let said = r2
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["reason"] == "audit_anchor_head_rejected")
        .expect("an audit record of the rejected head");
    let detail = said["detail"].as_str().unwrap();
    let forged_name = forged_obj.metadata.name.clone().unwrap();
    assert!(
        detail.contains(&forged_name) && detail.contains("not signed"),
        "{detail}"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l == "meshca_audit_anchor_heads_rejected_total 1"),
        "{metrics}"
    );

    // The genuine log verifies on its own.
    let whole = dir.path().join("whole.log");
    std::fs::write(&whole, format!("{r1}{r2}")).unwrap();
    let (code, out) = meshca(&[
        "audit",
        "verify",
        "--strict",
        "--key",
        key.to_str().unwrap(),
        whole.to_str().unwrap(),
    ]);
    assert_eq!(
        code, 0,
        "the genuine log fails because of a forged anchor: {out}"
    );
    // Against the cluster the forged object is an unsigned anchor; without
    // it everything verifies.
    let (code, out) = verify_against(&k, &ns, &key, &whole, &[]);
    assert_ne!(code, 0, "{out}");
    Api::<ConfigMap>::namespaced(k.admin.clone(), &ns)
        .delete(&forged_name, &DeleteParams::default())
        .await
        .unwrap();
    let (code, out) = verify_against(&k, &ns, &key, &whole, &[]);
    assert_eq!(code, 0, "{out}");
}
