//! Cold token callers: N distinct, never-seen pod-bound tokens (one pod
//! each) against meshca with `--token-verification local` and `review`, on
//! the real kube-apiserver of scripts/kube-testenv. Reports CSR/s, latency
//! percentiles, and the API server's own count of TokenReviews
//! (`apiserver_request_total{resource="tokenreviews"}` from its /metrics).
//!
//!   scripts/kube-testenv up DIR && source DIR/env
//!   COLD_TOKENS=10000 cargo bench --bench cold_tokens
//!
//! Tokens carry the claims the TokenRequest API writes and are signed with
//! the cluster's own ServiceAccount key (tests/common `signed_token`), so
//! 2N tokens need no 2N TokenRequests. meshca runs in this process; the
//! load generator, meshca, kube-apiserver and etcd share the machine.
#![allow(clippy::unwrap_used)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use meshca::authn::local::TokenVerificationMode;
use meshca::ca::generate::KeyType;
use meshca::testing::{self, TestPki};

const CONCURRENCY: usize = 64;

async fn tokenreviews_at_apiserver(k: &common::Kte) -> u64 {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = k.admin.request_text(req).await.unwrap();
    text.lines()
        .filter(|l| {
            l.starts_with("apiserver_request_total{") && l.contains("resource=\"tokenreviews\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test --benches` lists; nothing to list.
    }
    let n: usize = std::env::var("COLD_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let k = common::kte().await;
    let ns = k.namespace("cold").await;
    k.service_account(&ns, "bench").await;
    let sa_uid = k.service_account_uid(&ns, "bench").await;
    let id = common::spiffe(&ns, "bench");

    // N pods, created CONCURRENCY at a time.
    let t = Instant::now();
    let api = kube::Api::<Pod>::namespaced(k.admin.clone(), &ns);
    let uids: Vec<(String, String)> = futures::stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            async move {
                let name = format!("p{i}");
                let pod: Pod = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": name},
                    "spec": {"nodeName": "node-a", "serviceAccountName": "bench",
                             "automountServiceAccountToken": false,
                             "containers": [{"name": "app", "image": "example.invalid/app:0"}]}
                }))
                .unwrap();
                let p = api.create(&PostParams::default(), &pod).await.unwrap();
                (name, p.metadata.uid.unwrap())
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    eprintln!("created {n} pods in {:?}", t.elapsed());

    // The signing key's id, as the API server puts it in every token it mints.
    let jwks = k
        .admin
        .request_text(
            http::Request::get("/openid/v1/jwks")
                .body(Vec::new())
                .unwrap(),
        )
        .await
        .unwrap();
    let jwks: serde_json::Value = serde_json::from_str(&jwks).unwrap();
    let kid = jwks["keys"][0]["kid"].as_str().unwrap().to_string();
    let key = rcgen::KeyPair::generate().unwrap();
    let csr = testing::csr_for(&key, &id);
    let mut lines = Vec::new();
    for mode in [TokenVerificationMode::Local, TokenVerificationMode::Review] {
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        let tokens: Vec<String> = uids
            .iter()
            .map(|(name, uid)| {
                k.signed_token_with_kid(
                    Some(&kid),
                    &ns,
                    "bench",
                    &sa_uid,
                    Some((name, uid)),
                    now,
                    now + 3600,
                )
            })
            .collect();
        let pki = TestPki::new(KeyType::EcdsaP256);
        let mut cfg = common::kube_config(&pki, k.meshca_kubeconfig(), &[]);
        let kube = cfg.kube.as_mut().unwrap();
        kube.token_verification.mode = mode;
        if mode == TokenVerificationMode::Review {
            // Budget out of the way: measure the API server round trip, not meshca's pacing.
            kube.review_limits.qps = 100_000;
            kube.review_limits.burst = 100_000;
            kube.review_limits.max_inflight = CONCURRENCY as u32;
            kube.review_limits.max_wait = Duration::from_secs(60);
        } else {
            // Local mode builds its own index; no impersonation needed.
        }
        cfg.transport.max_inflight_requests_per_ip = CONCURRENCY;
        let srv = common::start(cfg, pki).await;
        if mode.uses_local() {
            let (nsc, last) = (ns.clone(), format!("p{}", n - 1));
            srv.wait_index("all bench pods", move |s| s.get(&nsc, &last).is_some())
                .await;
            while srv.app.issuer_keys.as_ref().unwrap().current().is_none() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let mut clients = Vec::new();
        for _ in 0..4 {
            clients.push(
                testing::client(srv.app.addr, &srv.pki.ca.root_cert, None)
                    .await
                    .unwrap(),
            );
        }
        let before = tokenreviews_at_apiserver(&k).await;
        let started = Instant::now();
        let results: Vec<(bool, Duration)> = futures::stream::iter(tokens.iter().enumerate())
            .map(|(i, token)| {
                let mut c = clients[i % clients.len()].clone();
                let csr = csr.clone();
                async move {
                    let mut req = tonic::Request::new(testing::request(csr, 0, &[]));
                    req.metadata_mut()
                        .insert("authorization", format!("Bearer {token}").parse().unwrap());
                    let t = Instant::now();
                    let ok = c.create_certificate(req).await.is_ok();
                    (ok, t.elapsed())
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        let wall = started.elapsed();
        let after = tokenreviews_at_apiserver(&k).await;
        let ok = results.iter().filter(|r| r.0).count();
        let mut lat: Vec<Duration> = results.iter().filter(|r| r.0).map(|r| r.1).collect();
        lat.sort();
        let line = format!(
            "mode={:<7} tokens={n} ok={ok} errors={} csr_per_s={:.0} p50={:.1}ms p99={:.1}ms max={:.1}ms apiserver_tokenreviews={}",
            mode.as_str(),
            n - ok,
            ok as f64 / wall.as_secs_f64(),
            pct(&lat, 0.50).as_secs_f64() * 1e3,
            pct(&lat, 0.99).as_secs_f64() * 1e3,
            lat.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
            after - before,
        );
        println!("{line}");
        lines.push(line);
        srv.app.shutdown().await.unwrap();
    }
    println!("--\n{}", lines.join("\n"));
}
