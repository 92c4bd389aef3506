//! Pod index scale: heap bytes per pod and apply rate, for synthetic pods in
//! the index alone and for pods synced from a real kube-apiserver.
//!
//! Memory is measured with a counting global allocator (stats_alloc): the net
//! heap bytes (allocated - freed, reallocations included) the index holds
//! after it has been built, with the events' own allocations freed inside the
//! measured region. That counts requested bytes; malloc's per-allocation
//! overhead is not in it, so the process RSS delta is printed next to it.
//!
//!   cargo bench --bench podindex_scale                     # 1M synthetic pods
//!   PODINDEX_SYNTHETIC=100000 cargo bench --bench podindex_scale
//!   KTE_ADMIN_KUBECONFIG=.. KTE_MESHCA_KUBECONFIG=.. PODINDEX_REAL=10000 \
//!     cargo bench --bench podindex_scale                   # + 10k pods from the API server
//!
//! Prints one JSON line per measurement (prefixed `RESULT `).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::alloc::System;
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshca::podindex::accounts::{AccountState, LeanAccount};
use meshca::podindex::{IndexEvent, IndexState, Indexed, LeanPod, Phase, PodIndex};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Net heap bytes since the region started. stats_alloc already adds a
/// reallocation's growth to `bytes_allocated` (and a shrink to
/// `bytes_deallocated`), so `bytes_reallocated` must not be added again.
fn net_bytes(region: &Region<'_, System>) -> i64 {
    let c = region.change();
    c.bytes_allocated as i64 - c.bytes_deallocated as i64
}

fn rss_bytes() -> i64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<i64>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A pod shaped like a Deployment replica: `<deploy>-<rs hash>-<suffix>`,
/// UUID uid, one IPv4 address; 200 pods per node, 10 ServiceAccounts per
/// namespace.
fn synthetic(i: usize, n: usize) -> LeanPod {
    let namespaces = (n / 1000).max(1);
    let nodes = (n / 200).max(1);
    let ns = i % namespaces;
    let deploy = (i / namespaces) % 10;
    LeanPod {
        namespace: Arc::from(format!("team-{ns}")),
        name: format!(
            "service-{deploy}-5d8c7b9f6{}-{:05x}",
            deploy % 10,
            i % 0xfffff
        )
        .into_boxed_str(),
        uid: format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            i as u32,
            (i >> 3) & 0xffff,
            i & 0xfff,
            (i >> 5) & 0xfff,
            i * 7919
        )
        .into_boxed_str(),
        node: Some(Arc::from(format!("node-{:05}", i % nodes))),
        service_account: Arc::from(format!("service-{deploy}")),
        phase: Phase::Running,
        pod_ips: vec![std::net::IpAddr::from([
            10,
            (i >> 16) as u8,
            (i >> 8) as u8,
            i as u8,
        ])],
        // One pod in a hundred is being deleted (a rollout's old replicas):
        // the deletion side table is measured at a realistic churn.
        deletion_timestamp: i.is_multiple_of(100).then_some(1_767_323_045),
    }
}

fn result(v: serde_json::Value) {
    println!("RESULT {v}");
}

/// Heap bytes held by an index built from `pods` (events cloned and freed
/// inside the measured region, so only the index remains).
fn measure_index(pods: &[LeanPod]) -> (IndexState, i64, i64) {
    let rss0 = rss_bytes();
    let region = Region::new(GLOBAL);
    let mut s = IndexState::default();
    s.apply(IndexEvent::Init);
    for p in pods {
        s.apply(IndexEvent::InitApply(p.clone()));
    }
    s.apply(IndexEvent::InitDone);
    let bytes = net_bytes(&region);
    (s, bytes, rss_bytes() - rss0)
}

fn synthetic_run(n: usize) {
    eprintln!("podindex_scale: generating {n} synthetic pods");
    let pods: Vec<LeanPod> = (0..n).map(|i| synthetic(i, n)).collect();
    let event_bytes: usize = pods
        .iter()
        .map(|p| p.name.len() + p.uid.len() + p.pod_ips.len() * 17)
        .sum();

    let (state, bytes, rss) = measure_index(&pods);
    assert_eq!(state.len(), n);
    let breakdown: Vec<String> = state
        .heap_breakdown()
        .into_iter()
        .filter(|(_, b)| *b > 0)
        .map(|(k, b)| format!("{k} {:.1}", b as f64 / n as f64))
        .collect();
    println!("  estimated B/pod by structure: {}", breakdown.join(", "));
    drop(state);

    // Initial sync (Init, n x InitApply, InitDone) into a PodIndex, events pre-built.
    let mut events: Vec<IndexEvent> = Vec::with_capacity(n + 2);
    events.push(IndexEvent::Init);
    events.extend(pods.iter().cloned().map(IndexEvent::InitApply));
    events.push(IndexEvent::InitDone);
    let index = PodIndex::new();
    let t = Instant::now();
    for e in events {
        index.apply(e);
    }
    let sync_s = t.elapsed().as_secs_f64();
    assert_eq!(index.len() as usize, n);

    // n updates of existing pods (status flips), through the shared index.
    let updates: Vec<IndexEvent> = pods
        .iter()
        .map(|p| {
            let mut p = p.clone();
            p.phase = Phase::Pending;
            IndexEvent::Apply(p)
        })
        .collect();
    let t = Instant::now();
    for e in updates {
        index.apply(e);
    }
    let update_s = t.elapsed().as_secs_f64();

    // n Apply events of new pods into an empty synced index.
    let adds: Vec<IndexEvent> = pods.iter().cloned().map(IndexEvent::Apply).collect();
    let mut fresh = IndexState::default();
    let t = Instant::now();
    for e in adds {
        fresh.apply(e);
    }
    let add_s = t.elapsed().as_secs_f64();

    // n deletes.
    let deletes: Vec<IndexEvent> = pods.iter().cloned().map(IndexEvent::Delete).collect();
    let t = Instant::now();
    for e in deletes {
        fresh.apply(e);
    }
    let delete_s = t.elapsed().as_secs_f64();
    assert!(fresh.is_empty());

    // Lookups on the synced index.
    let t = Instant::now();
    let mut found = 0usize;
    index.read(|s| {
        for p in pods.iter().step_by(7) {
            found += s.get(&p.namespace, &p.name).is_some() as usize;
            found += s
                .on_node(
                    p.node.as_deref().unwrap(),
                    &p.namespace,
                    &p.service_account,
                    0,
                )
                .next()
                .is_some() as usize;
        }
    });
    let lookups = pods.len().div_ceil(7);
    let lookup_ns = t.elapsed().as_nanos() as f64 / lookups as f64;
    assert_eq!(found, 2 * lookups);

    // The ServiceAccount index local verification adds: one entry per
    // distinct (namespace, service account) of these pods, UUID UIDs.
    let mut accounts: Vec<(Arc<str>, Arc<str>)> = pods
        .iter()
        .map(|p| (p.namespace.clone(), p.service_account.clone()))
        .collect();
    accounts.sort();
    accounts.dedup();
    let lean: Vec<LeanAccount> = accounts
        .iter()
        .enumerate()
        .map(|(i, (ns, sa))| LeanAccount {
            namespace: Box::from(&**ns),
            name: Box::from(&**sa),
            uid: format!("{i:08x}-0000-4000-8000-000000000000").into_boxed_str(),
            deletion_timestamp: None,
        })
        .collect();
    let region = Region::new(GLOBAL);
    let acct = AccountState::from_list(lean.clone());
    let acct_bytes = net_bytes(&region);
    assert_eq!(acct.len(), lean.len());
    println!(
        "  service account index: {} accounts, heap {acct_bytes} B = {:.1} B/pod; pods + accounts {:.1} B/pod",
        lean.len(),
        acct_bytes as f64 / n as f64,
        (bytes + acct_bytes) as f64 / n as f64
    );

    println!(
        "synthetic {n} pods: index heap {bytes} B = {:.1} B/pod (RSS delta {:.1} B/pod; decoded events carry {:.1} B/pod of strings)",
        bytes as f64 / n as f64,
        rss as f64 / n as f64,
        event_bytes as f64 / n as f64
    );
    println!(
        "  initial sync {sync_s:.3}s ({:.0}/s), {n} updates {update_s:.3}s ({:.0}/s), {n} adds {add_s:.3}s, {n} deletes {delete_s:.3}s, get+on_node {lookup_ns:.0} ns",
        n as f64 / sync_s,
        n as f64 / update_s
    );
    result(serde_json::json!({
        "bench": "podindex", "source": "synthetic", "pods": n,
        "heap_bytes": bytes, "bytes_per_pod": bytes as f64 / n as f64,
        "rss_bytes_per_pod": rss as f64 / n as f64,
        "initial_sync_s": sync_s, "updates_s": update_s, "adds_s": add_s, "deletes_s": delete_s,
        "updates_per_s": n as f64 / update_s, "get_plus_on_node_ns": lookup_ns,
        "service_accounts": lean.len(), "account_heap_bytes": acct_bytes,
        "bytes_per_pod_with_accounts": (bytes + acct_bytes) as f64 / n as f64,
    }));
}

async fn real_run(n: usize, admin: &str, meshca: &str) -> anyhow::Result<()> {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
    use kube::api::{ListParams, PostParams};
    use kube::Api;

    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let client = |path: String| async move {
        let kc = kube::config::Kubeconfig::read_from(&path)?;
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
        anyhow::Ok(kube::Client::try_from(cfg)?)
    };
    let admin = client(admin.to_string()).await?;
    let all: Api<Pod> = Api::all(admin.clone());
    let existing = all.list_metadata(&ListParams::default().limit(1)).await?;
    let mut suffix = [0u8; 4];
    aws_lc_rs::rand::fill(&mut suffix).map_err(|_| anyhow::anyhow!("rng"))?;
    let ns = format!("meshca-scale-{}", hex::encode(suffix));
    eprintln!(
        "podindex_scale: creating {n} pods in namespace {ns} (cluster has {} pods already)",
        existing.metadata.remaining_item_count.unwrap_or(0) + existing.items.len() as i64
    );
    let nsobj: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": ns}}))?;
    Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &nsobj)
        .await?;
    let sas = 20;
    for i in 0..sas {
        let sa: ServiceAccount =
            serde_json::from_value(serde_json::json!({"metadata": {"name": format!("sa-{i}")}}))?;
        Api::<ServiceAccount>::namespaced(admin.clone(), &ns)
            .create(&PostParams::default(), &sa)
            .await?;
    }
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &ns);
    let t = Instant::now();
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(0..n)
        .map(|i| {
            let pods = pods.clone();
            async move {
                let pod: Pod = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": format!("app-{}-6d4b75cb6d-{i:05x}", i % 20),
                                 "labels": {"app": format!("app-{}", i % 20), "pod-template-hash": "6d4b75cb6d"}},
                    "spec": {"nodeName": format!("node-{:03}", i % 50), "serviceAccountName": format!("sa-{}", i % sas),
                             "automountServiceAccountToken": false, "terminationGracePeriodSeconds": 0,
                             "containers": [{"name": "app", "image": "example.invalid/app:1.0",
                                             "ports": [{"containerPort": 8080}]}]}
                }))?;
                pods.create(&PostParams::default(), &pod).await?;
                Ok(())
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let failed: Vec<_> = results.into_iter().filter_map(Result::err).collect();
    if let Some(e) = failed.first() {
        anyhow::bail!("{} of {n} pod creations failed, first: {e}", failed.len());
    }
    let create_s = t.elapsed().as_secs_f64();
    eprintln!(
        "podindex_scale: created {n} pods in {create_s:.1}s ({:.0}/s)",
        n as f64 / create_s
    );

    // Sync a PodIndex from the API server with meshca's own watcher and its
    // least-privilege kubeconfig.
    let meshca = client(meshca.to_string()).await?;
    let index = Arc::new(PodIndex::new());
    let rss0 = rss_bytes();
    let region = Region::new(GLOBAL);
    let t = Instant::now();
    let task = tokio::spawn(meshca::podindex::watch::run(
        meshca,
        index.clone(),
        meshca::podindex::listwatch::Timing::for_max_staleness(std::time::Duration::from_secs(60)),
    ));
    while !(index.is_synced() && index.len() as usize >= n) {
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(300),
            "index not synced after 300s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let sync_s = t.elapsed().as_secs_f64();
    let total = index.len() as usize;
    let process_bytes = net_bytes(&region);
    let process_rss = rss_bytes() - rss0;
    task.abort();

    // The index alone: rebuild it from the synced contents inside a region.
    let lean: Vec<LeanPod> = index.read(|s| s.iter().map(|p| p.to_lean()).collect());
    let (_state, bytes, _) = measure_index(&lean);
    println!(
        "real API server: {total} pods synced by the watcher in {sync_s:.2}s ({:.0} pods/s incl. list + decode); index heap {:.1} B/pod; whole process while syncing: +{:.1} B/pod heap, +{:.1} B/pod RSS",
        total as f64 / sync_s,
        bytes as f64 / total as f64,
        process_bytes as f64 / total as f64,
        process_rss as f64 / total as f64,
    );
    result(serde_json::json!({
        "bench": "podindex", "source": "kube-apiserver", "pods": total, "created": n,
        "create_s": create_s, "watch_sync_s": sync_s, "pods_per_s": total as f64 / sync_s,
        "bytes_per_pod": bytes as f64 / total as f64,
        "process_heap_bytes_per_pod_during_sync": process_bytes as f64 / total as f64,
        "process_rss_bytes_per_pod_during_sync": process_rss as f64 / total as f64,
    }));
    Ok(())
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes --bench; any other argument is a filter we don't use.
    let n = env_usize("PODINDEX_SYNTHETIC", 1_000_000);
    if n > 0 {
        synthetic_run(n);
    }
    let real = env_usize("PODINDEX_REAL", 10_000);
    match (
        std::env::var("KTE_ADMIN_KUBECONFIG"),
        std::env::var("KTE_MESHCA_KUBECONFIG"),
    ) {
        (Ok(admin), Ok(meshca)) if real > 0 => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(real_run(real, &admin, &meshca))?,
        _ => eprintln!(
            "podindex_scale: KTE_ADMIN_KUBECONFIG/KTE_MESHCA_KUBECONFIG not set; skipping the API server measurement"
        ),
    }
    Ok(())
}
