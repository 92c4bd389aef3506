//! Cold-restart storm at CI size, against the real
//! kube-apiserver of scripts/kube-testenv: pods exist, `meshca serve` (this
//! crate's binary) starts as a fresh process, and every pod asks for its
//! certificate at once through `meshca-bench --mode cold-restart`'s own code
//! path (src/bench/cold.rs), so the 10k run documented in docs/BENCHMARKS.md
//! cannot rot. Asserts that every pod is served and that the API server
//! counted exactly one TokenReview per distinct token (none with local
//! verification). No timing is asserted; the run's numbers are printed.
#![allow(clippy::unwrap_used)]

mod common;

use clap::Parser;
use meshca::bench::cold::ColdScenario;
use meshca::bench::BenchArgs;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

const PODS: usize = 300;
const NODES: usize = 10;

fn args(
    k: &common::Kte,
    ns: &str,
    data: &std::path::Path,
    scenario: &str,
    verification: &str,
) -> BenchArgs {
    Cli::try_parse_from([
        "bench",
        "--mode",
        "cold-restart",
        "--ca-dir",
        data.to_str().unwrap(),
        "--kubeconfig",
        k.dir.join("admin.kubeconfig").to_str().unwrap(),
        "--cold-server-kubeconfig",
        k.dir.join("meshca.kubeconfig").to_str().unwrap(),
        "--cold-server-bin",
        env!("CARGO_BIN_EXE_meshca"),
        "--cold-namespace",
        ns,
        "--cold-scenario",
        scenario,
        "--cold-verification",
        verification,
        "--pods",
        &PODS.to_string(),
        "--nodes",
        &NODES.to_string(),
        "--connections",
        "16",
        "--max-seconds",
        "60",
        "--ceiling-seconds",
        "0.2",
    ])
    .unwrap()
    .bench
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_restart_serves_every_pod_with_one_review_per_distinct_token() {
    let k = common::kte().await;
    let suffix = {
        let mut b = [0u8; 3];
        aws_lc_rs::rand::fill(&mut b).unwrap();
        hex::encode(b)
    };
    let ns = format!("cold-{suffix}");
    let data = tempfile::tempdir().unwrap();
    for (scenario, verification, want_reviews) in [
        (ColdScenario::Sidecar, "review", PODS as u64),
        (ColdScenario::Ambient, "review", NODES as u64),
        (ColdScenario::Sidecar, "local", 0),
    ] {
        let name = match scenario {
            ColdScenario::Sidecar => "sidecar",
            ColdScenario::Ambient => "ambient",
        };
        let a = args(&k, &ns, data.path(), name, verification);
        let r = meshca::bench::cold::execute(&a).await.unwrap();
        println!("{}", serde_json::to_string(&r).unwrap());
        assert_eq!(r.scenario, scenario);
        assert_eq!(
            (r.served, r.unserved),
            (PODS, 0),
            "{name}/{verification}: every pod is served: {r:?}"
        );
        assert_eq!(
            r.apiserver_tokenreviews,
            Some(want_reviews),
            "{name}/{verification}: TokenReviews the API server counted: {r:?}"
        );
        let distinct = if scenario == ColdScenario::Sidecar {
            PODS
        } else {
            NODES
        };
        assert_eq!(r.distinct_tokens, distinct);
        assert!(r.ready_s.is_some(), "the server became ready");
        assert!(r.attempts >= PODS as u64);
    }
}
