//! The load generator against an in-process server, and its arithmetic.

use super::*;

#[test]
fn percentiles_are_nearest_rank() {
    let v: Vec<u64> = (1..=100).map(|ms| ms * 1_000_000).collect();
    assert_eq!(percentile(&v, 50.0), 50.0);
    assert_eq!(percentile(&v, 99.0), 99.0);
    assert_eq!(percentile(&v, 100.0), 100.0);
    assert_eq!(percentile(&[], 50.0), 0.0);
}

#[test]
fn proc_stat_of_self_parses() {
    assert!(proc_cpu_seconds(std::process::id()).is_some());
    assert!(thread_cpu_seconds() > 0.0);
}

fn args(ca_dir: PathBuf, target: SocketAddr, mode: Mode) -> BenchArgs {
    BenchArgs {
        target,
        server_name: "localhost".into(),
        ca_dir,
        mode,
        connections: 2,
        streams: 2,
        requests: 40,
        warmup: 4,
        rate: None,
        max_seconds: 60.0,
        key_type: KeyType::EcdsaP256,
        ceiling_seconds: 0.05,
        kubeconfig: None,
        pods: 1,
        nodes: 1,
        node_account: "istio-system/ztunnel".into(),
        cluster_id: "Kubernetes".into(),
        trust_domain: "cluster.local".into(),
        validity_seconds: 0,
        label: "meshca".into(),
        server_pid: Some(std::process::id()),
        json_out: None,
        storm_auth: storm::StormAuth::Mtls,
        storm_deadline_ms: 1000,
        storm_overload: 3.0,
        storm_greedy: 10,
        storm_seconds: 0.5,
        storm_peak_proxies: 4,
        storm_peak_streams: 2,
        storm_peak_after: true,
        storm_rounds: 1,
        storm_speed_probe_cpu: None,
        admin_target: "127.0.0.1:1".parse().unwrap(),
        storm_client: storm::ClientModel::Open,
        cold: Default::default(),
    }
}

/// A tiny storm against an in-process server: every request the clients
/// saw succeed is one the server issued, and the server's own counters
/// are read (no timing is asserted).
/// An in-process server with its audit records, and a generator's
/// arguments against it.
async fn serving(
    mode: Mode,
) -> (
    crate::testing::TestPki,
    crate::app::App,
    std::sync::Arc<crate::audit::MemorySink>,
    BenchArgs,
) {
    let pki = crate::testing::TestPki::new(KeyType::EcdsaP256);
    let cfg = crate::testing::test_config(pki.path_buf());
    let (app, audit) = crate::testing::start_server(&cfg, Default::default()).await;
    let mut a = args(pki.path_buf(), app.addr, mode);
    a.admin_target = app.admin_addr;
    (pki, app, audit, a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_smoke_run() {
    let (_pki, _app, audit, mut a) = serving(Mode::Storm).await;
    a.pods = 6;
    let r = storm::execute(&a).await.unwrap();
    assert_eq!(r.proxies, 6);
    let ok = r.outcomes.get("Ok").copied().unwrap_or(0);
    assert!(ok > 0, "{r:?}");
    // At most a response racing its client's deadline on a loaded machine.
    assert!(matches!(r.issued_not_received, Some(0..=2)), "{r:?}");
    let allows = audit
        .requests()
        .iter()
        .filter(|x| x.decision == crate::audit::Decision::Allow)
        .count();
    assert!(allows >= ok);
}

/// Idle connections: one request on each connection, and the server's
/// memory read (here the test process's own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_smoke_run() {
    let (_pki, _app, audit, mut a) = serving(Mode::IdleConnections).await;
    a.connections = 4;
    a.max_seconds = 0.1;
    a.server_pid = Some(std::process::id());
    let r = idle::measure(&a).await.expect("idle run");
    assert_eq!((r.connections, r.ok), (4, 4), "{r:?}");
    assert!(r.rss_one_kib > 0 && r.rss_idle_kib > 0, "{r:?}");
    // One request per connection, each on its own connection.
    assert_eq!(audit.requests().len(), 4);
    a.server_pid = None;
    assert!(idle::measure(&a).await.is_err(), "needs the server's pid");
}

/// A small closed-loop run and a paced run against an in-process server:
/// every request succeeds and is counted once (no timing is asserted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke_run_against_in_process_server() {
    let (_pki, _app, audit, mut a) = serving(Mode::MtlsRenewal).await;
    let r = execute(&a).await.expect("bench runs");
    assert_eq!((r.requests, r.ok), (40, 40), "{:?}", r.errors);
    assert!(r.errors.is_empty());
    assert!(r.ceiling.as_ref().is_some_and(|c| c.per_core > 0.0));
    assert!(r.p50_ms <= r.p99_ms && r.p99_ms <= r.max_ms);
    assert_eq!(audit.requests().len(), 2 + 4 + 40); // 2 connections warmed, warmup, run
    let line = serde_json::to_value(&r).expect("json");
    assert_eq!(line["mode"], "mtls-renewal");

    a.rate = Some(2000.0);
    a.ceiling_seconds = 0.0;
    let r = execute(&a).await.expect("paced run");
    assert_eq!(r.ok, 40);
    assert!(r.ceiling.is_none());
}

#[tokio::test]
async fn refuses_non_loopback_targets() {
    let a = args(
        PathBuf::from("/nonexistent"),
        "192.0.2.1:15012".parse().unwrap(),
        Mode::MtlsRenewal,
    );
    let e = execute(&a).await.unwrap_err();
    assert!(e.to_string().contains("loopback"), "{e}");
}

/// The signing threads' CPU is read from outside, summed over the threads
/// named `meshca-sign-*` only.
#[test]
fn signing_cpu_sums_the_signing_threads() {
    let pid = std::process::id();
    let (spun_tx, spun_rx) = std::sync::mpsc::channel::<()>();
    let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::Builder::new()
        .name("meshca-sign-t".into())
        .spawn(move || {
            let t0 = super::probe::thread_cpu_ns();
            let mut x = 0u64;
            while super::probe::thread_cpu_ns() - t0 < 60_000_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
            let _ = spun_tx.send(());
            let _ = end_rx.recv();
        })
        .unwrap();
    spun_rx.recv().unwrap();
    // Other tests' signing threads only add to the sum.
    let s = super::signing_cpu_seconds(pid).unwrap();
    assert!(s >= 0.055, "{s}");
    end_tx.send(()).unwrap();
    t.join().unwrap();
    // A process without signing threads (pid 1 is never meshca).
    assert_eq!(super::signing_cpu_seconds(1), None);
}
