//! `meshca-bench --mode cold-restart`: a cold-restart storm, the worst case
//! for TokenReview load (every cache empty, every pod asking at once).
//!
//! `--pods` pods already exist, spread over `--nodes` nodes (setup, timed but
//! not part of the measurement). Then `meshca serve` is started as a fresh
//! process (empty pod index, empty token cache) and every pod asks for its
//! certificate at once:
//!
//! - `sidecar`: one distinct pod-bound token per pod, each pod its own
//!   caller with istio-agent's retry model;
//! - `ambient`: one ztunnel pod per node (one token each) requests the
//!   identity of every pod on its node by impersonation, at most 8 fetches in
//!   flight per ztunnel, with ztunnel's per-identity backoff.
//!
//! Everything is timed from the moment the server process is spawned. The
//! API server's own `apiserver_request_total{resource="tokenreviews"}` counts
//! the reviews; the finishing time is compared with what the TokenReview
//! budget (or, without reviews, the crypto ceiling) predicts.
//!
//! Every simulated pod shares 127.0.0.1, so the server's per-source-IP limits
//! are raised to its global ones (in a cluster each pod has its own IP); the
//! global limits stay at their defaults.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::ListParams;
use kube::{Api, Client};
use serde::Serialize;
use serde_json::json;
use time::OffsetDateTime;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};
use tonic::Code;

use super::{
    create_ignore_exists, csr_for, percentile, pod_token, proc_cpu_seconds, random_suffix,
    BenchArgs, CaClient,
};
use crate::ca::generate::KeyType;
use crate::ca::CaBundle;
use crate::identity::{SpiffeId, TrustDomain};
use crate::proto::istio_certificate_service_client::IstioCertificateServiceClient;
use crate::proto::IstioCertificateRequest;

/// Who asks for the certificates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ColdScenario {
    /// A sidecar per pod, each with its own pod-bound token.
    #[default]
    Sidecar,
    /// A ztunnel per node asking for every pod's identity by impersonation.
    Ambient,
}

/// Arguments of `--mode cold-restart` (the rest come from [`BenchArgs`]:
/// `--pods`, `--nodes`, `--connections`, `--max-seconds`, `--ca-dir`, ...).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ColdArgs {
    #[arg(long, value_enum, default_value_t = ColdScenario::Sidecar)]
    pub cold_scenario: ColdScenario,
    /// The server's `--token-verification` (review, local, local-then-review).
    #[arg(long, default_value = "review")]
    pub cold_verification: String,
    /// The `meshca` binary to start (default: `meshca` beside this binary).
    #[arg(long)]
    pub cold_server_bin: Option<PathBuf>,
    /// Kubeconfig the server uses (RBAC of a real meshca).
    #[arg(long, env = "KTE_MESHCA_KUBECONFIG")]
    pub cold_server_kubeconfig: Option<PathBuf>,
    /// Reuse (or create) the pods in this namespace, so several runs share one setup.
    #[arg(long)]
    pub cold_namespace: Option<String>,
    /// TokenReview budget given to the server, and used for the prediction.
    #[arg(long, default_value_t = 100)]
    pub cold_review_qps: u32,
    #[arg(long, default_value_t = 100)]
    pub cold_review_burst: u32,
    #[arg(long, default_value_t = 32)]
    pub cold_review_max_inflight: u32,
    /// Pods, ServiceAccounts and tokens created at once during setup.
    #[arg(long, default_value_t = 32)]
    pub cold_setup_concurrency: usize,
    /// More `meshca serve` flags (repeat the option per flag).
    #[arg(long = "cold-serve-arg", allow_hyphen_values = true)]
    pub cold_serve_args: Vec<String>,
}

/// One cold-restart run's results.
#[derive(Debug, Clone, Serialize)]
pub struct ColdResult {
    pub label: String,
    pub scenario: ColdScenario,
    pub verification: String,
    pub pods: usize,
    pub nodes: usize,
    /// Distinct bearer tokens presented (sidecar: one per pod; ambient: one per ztunnel).
    pub distinct_tokens: usize,
    pub setup_pods_s: f64,
    pub setup_tokens_s: f64,
    /// From spawning the server: its gRPC port accepts, /readyz says ready.
    pub listening_s: Option<f64>,
    pub ready_s: Option<f64>,
    pub served: usize,
    pub unserved: usize,
    /// Time from spawn until the last pod was served.
    pub last_served_s: Option<f64>,
    /// `served / last_served_s`.
    pub csr_per_s: f64,
    /// When each pod was served, from spawn.
    pub served_p50_s: f64,
    pub served_p99_s: f64,
    /// Latency of the successful attempts alone.
    pub attempt_ok_p50_ms: f64,
    pub attempt_ok_p99_ms: f64,
    pub attempts: u64,
    /// Attempts beyond each caller's first.
    pub retries: u64,
    pub max_attempts_per_pod: u32,
    /// Attempts by gRPC code (client view).
    pub attempts_by_code: BTreeMap<String, u64>,
    /// Non-issued decisions by reason, and the token and admission counters (server view).
    pub server_counters: BTreeMap<String, u64>,
    /// `apiserver_request_total{resource="tokenreviews"}` during the run (the API server's count).
    pub apiserver_tokenreviews: Option<u64>,
    pub review_qps: u32,
    pub review_burst: u32,
    pub review_max_inflight: u32,
    /// Mean TokenReview round trip the server measured.
    pub review_mean_ms: Option<f64>,
    /// Time from spawn the budget (reviews) or the crypto ceiling (no
    /// reviews) predicts for the last pod: listening + work / rate.
    pub predicted_s: Option<f64>,
    pub predicted_by: String,
    /// `last_served_s / predicted_s`.
    pub ratio_to_predicted: Option<f64>,
    pub ceiling_all_cores: Option<f64>,
    pub server_cpu_s: Option<f64>,
    pub server_rss_hwm_mib: Option<f64>,
    pub loadavg_before: String,
    pub loadavg_after: String,
    pub date: String,
}

/// One caller's request: its token, its CSR and, for ztunnel, the identity it asks for.
struct Job {
    bearer: Arc<str>,
    csr: String,
    impersonate: Option<String>,
}

/// What became of one pod.
#[derive(Debug, Default, Clone)]
struct PodOutcome {
    served_after: Option<Duration>,
    attempts: u32,
}

/// Per-attempt tallies shared by every caller.
#[derive(Default)]
struct Tally {
    by_code: BTreeMap<String, u64>,
    ok_latency_ns: Vec<u64>,
}

// ------------------------------------------------------------------ client retry models

/// Codes istio-agent retries within one round (`pkg/security/retry.go`).
pub fn agent_retries(code: Code) -> bool {
    matches!(
        code,
        Code::Cancelled
            | Code::DeadlineExceeded
            | Code::ResourceExhausted
            | Code::Aborted
            | Code::Internal
            | Code::Unavailable
    )
}

/// istio-agent: 5 retries after the first attempt, 100 ms doubling to 1.6 s,
/// with 10% jitter. `None`: the round is over.
pub fn agent_backoff(retry: u32, unit: f64) -> Option<Duration> {
    if retry >= 5 {
        return None;
    }
    let base = 0.1 * f64::from(1u32 << retry);
    Some(Duration::from_secs_f64(base * (0.9 + 0.2 * unit)))
}

/// Between failed rounds (the SDS request fails and is asked again): assumed
/// 1 s doubling to 30 s, 50-150% jitter. Not taken from istio's code.
pub fn agent_round_backoff(round: u32, unit: f64) -> Duration {
    let base = (1.0 * f64::from(1u32 << round.min(5))).min(30.0);
    Duration::from_secs_f64(base * (0.5 + unit))
}

/// ztunnel, per identity: a first delay of 0.5-1 s, doubling, ±20%, capped
/// at 150 s, no retry limit; it ignores status codes and pushback.
pub fn ztunnel_backoff(retry: u32, first: f64, unit: f64) -> Duration {
    let base = (first * f64::from(1u32 << retry.min(10))).min(150.0);
    Duration::from_secs_f64(base * (0.8 + 0.4 * unit))
}

/// A uniform number in [0, 1).
fn unit() -> f64 {
    let mut b = [0u8; 4];
    let _ = aws_lc_rs::rand::fill(&mut b);
    f64::from(u32::from_le_bytes(b)) / (f64::from(u32::MAX) + 1.0)
}

/// The time the budget predicts for `reviews` distinct tokens: the burst at
/// once, the rest at the lower of the token bucket's rate and what the
/// in-flight cap allows at the measured round trip.
pub fn budget_seconds(reviews: u64, qps: u32, burst: u32, inflight: u32, rtt: Option<f64>) -> f64 {
    let mut rate = f64::from(qps.max(1));
    if let Some(rtt) = rtt.filter(|r| *r > 0.0) {
        rate = rate.min(f64::from(inflight.max(1)) / rtt);
    }
    reviews.saturating_sub(u64::from(burst)) as f64 / rate
}

// ------------------------------------------------------------------ setup

struct Setup {
    ns: String,
    /// (pod, service account, uid, node index)
    pods: Vec<(String, String, String, usize)>,
    seconds: f64,
}

fn node_name(n: usize) -> String {
    format!("meshca-cold-node-{n}")
}

/// Pods `app-i` with ServiceAccount `sa-i` on node `i % nodes`; existing ones are reused.
async fn setup_pods(kube: &Client, args: &BenchArgs) -> anyhow::Result<Setup> {
    let t = Instant::now();
    let ns = args
        .cold
        .cold_namespace
        .clone()
        .unwrap_or_else(|| format!("meshca-cold-{}", random_suffix()));
    let nodes = args.nodes.max(1);
    create_ignore_exists(
        &Api::<Namespace>::all(kube.clone()),
        json!({"metadata": {"name": ns}}),
    )
    .await?;
    let pod_api = Api::<Pod>::namespaced(kube.clone(), &ns);
    let mut existing = BTreeMap::new();
    for p in pod_api.list(&ListParams::default()).await? {
        if let (Some(name), Some(uid)) = (p.metadata.name, p.metadata.uid) {
            existing.insert(name, uid);
        }
    }
    let missing: Vec<usize> = (0..args.pods)
        .filter(|i| !existing.contains_key(&format!("app-{i}")))
        .collect();
    eprintln!(
        "bench: namespace {ns}: {} pods exist, creating {} on {nodes} nodes",
        existing.len(),
        missing.len()
    );
    let sa_api = Api::<ServiceAccount>::namespaced(kube.clone(), &ns);
    let created: Vec<anyhow::Result<(String, String)>> = futures::stream::iter(missing)
        .map(|i| {
            let (sa_api, pod_api) = (sa_api.clone(), pod_api.clone());
            async move {
                let sa = format!("sa-{i}");
                create_ignore_exists(&sa_api, json!({"metadata": {"name": sa}})).await?;
                let name = format!("app-{i}");
                let uid = super::create_pod(&pod_api, &name, &sa, &node_name(i % nodes)).await?;
                Ok((name, uid))
            }
        })
        .buffer_unordered(args.cold.cold_setup_concurrency.max(1))
        .collect()
        .await;
    for c in created {
        let (name, uid) = c?;
        existing.insert(name, uid);
    }
    let mut pods = Vec::with_capacity(args.pods);
    for i in 0..args.pods {
        let name = format!("app-{i}");
        let uid = existing
            .get(&name)
            .with_context(|| format!("pod {name} missing after setup"))?
            .clone();
        pods.push((name, format!("sa-{i}"), uid, i % nodes));
    }
    Ok(Setup {
        ns,
        pods,
        seconds: t.elapsed().as_secs_f64(),
    })
}

// ------------------------------------------------------------------ server process

fn free_port() -> anyhow::Result<SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?)
}

/// A plain HTTP/1.1 GET to the admin port: (status, body).
pub(super) async fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: meshca\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

/// `name{labels} value` lines whose name starts with one of `prefixes`.
pub fn counters(text: &str, prefixes: &[&str]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        if !prefixes.iter().any(|p| series.starts_with(p)) {
            continue;
        }
        if let Ok(v) = value.parse::<f64>() {
            if v > 0.0 {
                out.insert(series.to_string(), v as u64);
            }
        }
    }
    out
}

fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Sum of `apiserver_request_total{resource="tokenreviews"}` from the API server's /metrics.
pub async fn apiserver_tokenreviews(kube: &Client) -> anyhow::Result<u64> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    let text = kube.request_text(req).await?;
    Ok(text
        .lines()
        .filter(|l| {
            l.starts_with("apiserver_request_total{") && l.contains("resource=\"tokenreviews\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn rss_hwm_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<f64>().ok()? / 1024.0)
}

/// Kills the server when the run ends, however it ends.
struct Server {
    child: tokio::process::Child,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

fn spawn_server(
    args: &BenchArgs,
    grpc: SocketAddr,
    admin: SocketAddr,
    kubeconfig: &std::path::Path,
) -> anyhow::Result<Server> {
    let bin = match &args.cold.cold_server_bin {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.with_file_name("meshca"),
    };
    let c = &args.cold;
    // Per-source-IP limits at the global ones: every simulated pod is 127.0.0.1.
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.arg("serve")
        .arg("--dev")
        .arg("--data-dir")
        .arg(&args.ca_dir)
        .arg("--listen")
        .arg(grpc.to_string())
        .arg("--admin-listen")
        .arg(admin.to_string())
        .arg("--kubernetes")
        .arg("on")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--token-verification")
        .arg(&c.cold_verification)
        .arg("--trusted-node-accounts")
        .arg(&args.node_account)
        .arg("--trust-domain")
        .arg(&args.trust_domain)
        .arg("--cluster-id")
        .arg(&args.cluster_id)
        .arg("--tokenreview-qps")
        .arg(c.cold_review_qps.to_string())
        .arg("--tokenreview-burst")
        .arg(c.cold_review_burst.to_string())
        .arg("--tokenreview-max-inflight")
        .arg(c.cold_review_max_inflight.to_string())
        .args(&c.cold_serve_args)
        .env("MESHCA_MAX_CONNECTIONS_PER_IP", "1024")
        .env("MESHCA_MAX_PENDING_HANDSHAKES_PER_IP", "128")
        .env("MESHCA_MAX_INFLIGHT_REQUESTS_PER_IP", "256")
        .env("MESHCA_ADMISSION_NEW_CALLER_QPS_PER_IP", "0")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(std::fs::File::create(args.ca_dir.join("cold-audit.jsonl"))?)
        .stderr(std::fs::File::create(args.ca_dir.join("cold-serve.log"))?)
        .kill_on_drop(true);
    let child = cmd
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    Ok(Server { child })
}

// ------------------------------------------------------------------ callers

async fn attempt(
    client: &mut CaClient,
    job: &Job,
    cluster_id: &str,
    tally: &std::sync::Mutex<Tally>,
) -> Code {
    let mut req = tonic::Request::new(IstioCertificateRequest {
        csr: job.csr.clone(),
        validity_duration: 0,
        metadata: job.impersonate.as_ref().map(|id| prost_types::Struct {
            fields: [(
                crate::grpc::IMPERSONATED_IDENTITY.to_string(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(id.clone())),
                },
            )]
            .into_iter()
            .collect(),
        }),
    });
    if let Ok(v) = format!("Bearer {}", job.bearer).parse() {
        req.metadata_mut().insert("authorization", v);
    }
    if let Ok(v) = cluster_id.parse() {
        req.metadata_mut().insert("clusterid", v);
    }
    let t = Instant::now();
    let code =
        match tokio::time::timeout(Duration::from_secs(30), client.create_certificate(req)).await {
            Ok(Ok(resp)) if resp.get_ref().cert_chain.len() >= 2 => Code::Ok,
            Ok(Ok(_)) => Code::Internal,
            Ok(Err(status)) => status.code(),
            Err(_) => Code::DeadlineExceeded,
        };
    let mut t2 = tally.lock().unwrap_or_else(|e| e.into_inner());
    *t2.by_code.entry(format!("{code:?}")).or_insert(0) += 1;
    if code == Code::Ok {
        t2.ok_latency_ns.push(t.elapsed().as_nanos() as u64);
    }
    code
}

/// istio-agent for one pod: rounds of 1 + 5 quick retries until served.
async fn sidecar(
    mut client: CaClient,
    job: Job,
    cluster_id: Arc<str>,
    t0: Instant,
    stop_at: Instant,
    tally: Arc<std::sync::Mutex<Tally>>,
) -> PodOutcome {
    let mut out = PodOutcome::default();
    let mut round = 0;
    loop {
        let mut retry = 0;
        loop {
            out.attempts += 1;
            let code = attempt(&mut client, &job, &cluster_id, &tally).await;
            if code == Code::Ok {
                out.served_after = Some(t0.elapsed());
                return out;
            }
            if Instant::now() >= stop_at {
                return out;
            }
            match agent_backoff(retry, unit()) {
                Some(d) if agent_retries(code) => tokio::time::sleep(d).await,
                _ => break,
            }
            retry += 1;
        }
        tokio::time::sleep(agent_round_backoff(round, unit())).await;
        round += 1;
    }
}

/// ztunnel for one identity: retries with its own backoff, never giving up;
/// `permits` holds its node's 8 fetches in flight.
async fn ztunnel_identity(
    mut client: CaClient,
    job: Job,
    cluster_id: Arc<str>,
    permits: Arc<tokio::sync::Semaphore>,
    t0: Instant,
    stop_at: Instant,
    tally: Arc<std::sync::Mutex<Tally>>,
) -> PodOutcome {
    let mut out = PodOutcome::default();
    let first = 0.5 + 0.5 * unit();
    let mut retry = 0;
    loop {
        let code = {
            let Ok(_permit) = permits.acquire().await else {
                return out;
            };
            out.attempts += 1;
            attempt(&mut client, &job, &cluster_id, &tally).await
        };
        if code == Code::Ok {
            out.served_after = Some(t0.elapsed());
            return out;
        }
        if Instant::now() >= stop_at {
            return out;
        }
        tokio::time::sleep(ztunnel_backoff(retry, first, unit())).await;
        retry += 1;
    }
}

fn lazy_channel(target: SocketAddr, tls: &ClientTlsConfig) -> anyhow::Result<CaClient> {
    // Lazy: the first request connects, and a refused connect is Unavailable (retried).
    let channel = Channel::from_shared(format!("https://{target}"))?
        .tls_config(tls.clone())?
        .connect_timeout(Duration::from_secs(5))
        .connect_lazy();
    Ok(IstioCertificateServiceClient::new(channel).max_decoding_message_size(4 * 1024 * 1024))
}

// ------------------------------------------------------------------ run

/// Runs the storm and prints its results.
pub async fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let r = execute(args).await?;
    print_human(&r);
    super::emit_json(args, &serde_json::to_string(&r)?)
}

/// Sets up the pods, starts the server, runs the storm; returns the results.
pub async fn execute(args: &BenchArgs) -> anyhow::Result<ColdResult> {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let c = &args.cold;
    let admin_kc = args
        .kubeconfig
        .as_ref()
        .context("cold-restart needs --kubeconfig (admin) to create pods and mint tokens")?;
    let server_kc = c
        .cold_server_kubeconfig
        .clone()
        .context("cold-restart needs --cold-server-kubeconfig (KTE_MESHCA_KUBECONFIG)")?;
    if args.pods == 0 {
        bail!("--pods must be at least 1");
    }
    let kube = crate::app::kube_client(Some(admin_kc)).await?;
    let td = TrustDomain::new(&args.trust_domain)?;
    std::fs::create_dir_all(&args.ca_dir)?;
    let ca_dir = crate::app::prepare_dev(&args.ca_dir, &td)?;
    let bundle = CaBundle::load_dir(&ca_dir, OffsetDateTime::now_utc())?;
    let nproc = std::thread::available_parallelism().map_or(1, |n| n.get());
    let ceiling = super::ceiling_if_asked(args, &bundle, &td, nproc)?;

    let setup = setup_pods(&kube, args).await?;
    eprintln!(
        "bench: {} pods ready in {:.1}s",
        setup.pods.len(),
        setup.seconds
    );

    // Tokens: fresh ones every run (minted here, so never seen by any meshca).
    let t = Instant::now();
    let ids: Vec<String> = setup
        .pods
        .iter()
        .map(|(_, sa, _, _)| SpiffeId::new(td.clone(), &setup.ns, sa).map(|s| s.to_string()))
        .collect::<Result<_, _>>()?;
    let bearers: Vec<Arc<str>> = match c.cold_scenario {
        ColdScenario::Sidecar => {
            let minted: Vec<anyhow::Result<String>> = futures::stream::iter(setup.pods.iter())
                .map(|(name, sa, uid, _)| pod_token(&kube, &setup.ns, sa, name, uid))
                .buffered(c.cold_setup_concurrency.max(1))
                .collect()
                .await;
            minted
                .into_iter()
                .map(|m| m.map(Arc::from))
                .collect::<anyhow::Result<_>>()?
        }
        ColdScenario::Ambient => {
            let tag = random_suffix();
            let zt: Vec<Arc<str>> = super::ztunnel_tokens(
                &kube,
                &args.node_account,
                &tag,
                args.nodes.max(1),
                node_name,
            )
            .await?
            .into_iter()
            .map(Arc::from)
            .collect();
            setup
                .pods
                .iter()
                .map(|(_, _, _, n)| zt[*n].clone())
                .collect()
        }
    };
    let distinct_tokens = bearers
        .iter()
        .map(|b| b.as_ref())
        .collect::<std::collections::HashSet<_>>()
        .len();
    let setup_tokens_s = t.elapsed().as_secs_f64();
    eprintln!("bench: {distinct_tokens} distinct tokens minted in {setup_tokens_s:.1}s");
    let keys_t = Instant::now();
    let csrs: Vec<String> = ids
        .iter()
        .map(|id| csr_for(&KeyType::generate(args.key_type)?, id))
        .collect::<anyhow::Result<_>>()?;
    eprintln!(
        "bench: {} keys and CSRs in {:.1}s",
        csrs.len(),
        keys_t.elapsed().as_secs_f64()
    );

    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(bundle.root_bundle()))
        .domain_name(args.server_name.clone());
    let grpc = free_port()?;
    let admin = free_port()?;
    let cluster_id: Arc<str> = Arc::from(args.cluster_id.as_str());
    let tally = Arc::new(std::sync::Mutex::new(Tally::default()));
    let loadavg_before = loadavg();
    let reviews_before = apiserver_tokenreviews(&kube).await?;

    // ---- the storm: from here on everything is timed from spawn
    let t0 = Instant::now();
    let stop_at = t0 + Duration::from_secs_f64(args.max_seconds);
    let server = spawn_server(args, grpc, admin, &server_kc)?;
    let pid = server.child.id();
    let serve_log = args.ca_dir.join("cold-serve.log");
    let watcher = tokio::spawn(async move {
        let (mut listening, mut ready) = (None, None);
        while ready.is_none() && t0.elapsed() < Duration::from_secs(600) {
            // The server's own "listening on" line (a probe connection would
            // show up in its transport refusals).
            if listening.is_none()
                && std::fs::read_to_string(&serve_log).is_ok_and(|l| l.contains("listening on"))
            {
                listening = Some(t0.elapsed());
            }
            if let Some((200, _)) = http_get(admin, "/readyz").await {
                ready = Some(t0.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (listening, ready)
    });

    let mut handles = Vec::with_capacity(args.pods);
    match c.cold_scenario {
        ColdScenario::Sidecar => {
            let clients: Vec<CaClient> = (0..args.connections.max(1))
                .map(|_| lazy_channel(grpc, &tls))
                .collect::<anyhow::Result<_>>()?;
            for (i, (bearer, csr)) in bearers.iter().zip(csrs).enumerate() {
                let job = Job {
                    bearer: bearer.clone(),
                    csr,
                    impersonate: None,
                };
                handles.push(tokio::spawn(sidecar(
                    clients[i % clients.len()].clone(),
                    job,
                    cluster_id.clone(),
                    t0,
                    stop_at,
                    tally.clone(),
                )));
            }
        }
        ColdScenario::Ambient => {
            // One connection and 8 fetch slots per ztunnel.
            let nodes = args.nodes.max(1);
            let clients: Vec<CaClient> = (0..nodes)
                .map(|_| lazy_channel(grpc, &tls))
                .collect::<anyhow::Result<_>>()?;
            let permits: Vec<_> = (0..nodes)
                .map(|_| Arc::new(tokio::sync::Semaphore::new(8)))
                .collect();
            for (((_, _, _, n), bearer), (csr, id)) in setup
                .pods
                .iter()
                .zip(&bearers)
                .zip(csrs.into_iter().zip(&ids))
            {
                let job = Job {
                    bearer: bearer.clone(),
                    csr,
                    impersonate: Some(id.clone()),
                };
                handles.push(tokio::spawn(ztunnel_identity(
                    clients[*n].clone(),
                    job,
                    cluster_id.clone(),
                    permits[*n].clone(),
                    t0,
                    stop_at,
                    tally.clone(),
                )));
            }
        }
    }
    let mut outcomes = Vec::with_capacity(handles.len());
    for h in handles {
        outcomes.push(h.await.unwrap_or_default());
    }
    let (listening, ready) = watcher.await.unwrap_or((None, None));
    let server_cpu_s = pid.and_then(proc_cpu_seconds);
    let server_rss_hwm_mib = pid.and_then(rss_hwm_mib);
    let metrics = http_get(admin, "/metrics")
        .await
        .map(|(_, b)| b)
        .unwrap_or_default();
    let reviews_after = apiserver_tokenreviews(&kube).await?;
    drop(server);
    let loadavg_after = loadavg();

    // ---- results
    let served: Vec<Duration> = outcomes.iter().filter_map(|o| o.served_after).collect();
    let mut served_ns: Vec<u64> = served.iter().map(|d| d.as_nanos() as u64).collect();
    served_ns.sort_unstable();
    let last = served_ns.last().map(|&n| n as f64 / 1e9);
    let attempts: u64 = outcomes.iter().map(|o| u64::from(o.attempts)).sum();
    let tally = std::mem::take(&mut *tally.lock().unwrap_or_else(|e| e.into_inner()));
    let mut ok_lat = tally.ok_latency_ns;
    ok_lat.sort_unstable();
    let mut server_counters = counters(
        &metrics,
        &[
            "meshca_decisions_total{decision=\"deny\"",
            "meshca_tokenreviews_total",
            "meshca_tokenreview_refused_total",
            "meshca_tokenreview_coalesced_total",
            "meshca_transport_refusals_total",
            "meshca_admission_shed_total",
            "meshca_token_verifications_total",
            "meshca_token_local_outcomes_total",
        ],
    );
    server_counters.retain(|_, v| *v > 0);
    let review_mean_ms = match (
        metric_value(&metrics, "meshca_tokenreview_duration_seconds_sum"),
        metric_value(&metrics, "meshca_tokenreview_duration_seconds_count"),
    ) {
        (Some(s), Some(n)) if n > 0.0 => Some(s / n * 1000.0),
        _ => None,
    };
    let listening_s = listening.map(|d| d.as_secs_f64());
    let (predicted_s, predicted_by) = predict(
        c,
        distinct_tokens as u64,
        args.pods,
        listening_s,
        ready.map(|d| d.as_secs_f64()),
        review_mean_ms,
        ceiling.as_ref().map(|c| c.all_cores),
    );
    let n_served = served_ns.len();
    Ok(ColdResult {
        label: args.label.clone(),
        scenario: c.cold_scenario,
        verification: c.cold_verification.clone(),
        pods: args.pods,
        nodes: args.nodes.max(1),
        distinct_tokens,
        setup_pods_s: setup.seconds,
        setup_tokens_s,
        listening_s,
        ready_s: ready.map(|d| d.as_secs_f64()),
        served: n_served,
        unserved: args.pods - n_served,
        last_served_s: last,
        csr_per_s: last
            .filter(|l| *l > 0.0)
            .map_or(0.0, |l| n_served as f64 / l),
        served_p50_s: percentile(&served_ns, 50.0) / 1000.0,
        served_p99_s: percentile(&served_ns, 99.0) / 1000.0,
        attempt_ok_p50_ms: percentile(&ok_lat, 50.0),
        attempt_ok_p99_ms: percentile(&ok_lat, 99.0),
        attempts,
        retries: attempts.saturating_sub(args.pods as u64),
        max_attempts_per_pod: outcomes.iter().map(|o| o.attempts).max().unwrap_or(0),
        attempts_by_code: tally.by_code,
        server_counters,
        apiserver_tokenreviews: reviews_after.checked_sub(reviews_before),
        review_qps: c.cold_review_qps,
        review_burst: c.cold_review_burst,
        review_max_inflight: c.cold_review_max_inflight,
        review_mean_ms,
        ratio_to_predicted: match (last, predicted_s) {
            (Some(l), Some(p)) if p > 0.0 => Some(l / p),
            _ => None,
        },
        predicted_s,
        predicted_by,
        ceiling_all_cores: ceiling.map(|c| c.all_cores),
        server_cpu_s,
        server_rss_hwm_mib,
        loadavg_before,
        loadavg_after,
        date: OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default(),
    })
}

/// When the last pod should be served: from the moment the server can
/// decide (listening; ready, i.e. the pod index synced, when local
/// verification or impersonation needs the index), plus the larger of the
/// review budget's time for the reviewed tokens and the crypto ceiling's
/// time for the certificates (CSR verify + sign on all cores; it leaves out
/// token checks and the transport, so it is a lower bound).
pub fn predict(
    c: &ColdArgs,
    distinct_tokens: u64,
    pods: usize,
    listening_s: Option<f64>,
    ready_s: Option<f64>,
    review_mean_ms: Option<f64>,
    ceiling_all_cores: Option<f64>,
) -> (Option<f64>, String) {
    let reviewing = c.cold_verification == "review";
    let needs_index = !reviewing || c.cold_scenario == ColdScenario::Ambient;
    let start = if needs_index { ready_s } else { listening_s };
    let review = if reviewing {
        budget_seconds(
            distinct_tokens,
            c.cold_review_qps,
            c.cold_review_burst,
            c.cold_review_max_inflight,
            review_mean_ms.map(|m| m / 1000.0),
        )
    } else {
        0.0
    };
    let crypto = ceiling_all_cores
        .filter(|c| *c > 0.0)
        .map_or(0.0, |c| pods as f64 / c);
    let by = format!(
        "{} + max(review budget {review:.1}s [{} reviews, burst {}, {}/s, {} in flight], crypto ceiling {crypto:.1}s)",
        if needs_index { "ready" } else { "listening" },
        if reviewing { distinct_tokens } else { 0 },
        c.cold_review_burst,
        c.cold_review_qps,
        c.cold_review_max_inflight
    );
    (start.map(|s| s + review.max(crypto)), by)
}

fn print_human(r: &ColdResult) {
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}s"));
    println!(
        "{} cold-restart {:?}/{}: {} pods on {} nodes, {} distinct tokens (setup: pods {:.1}s, tokens {:.1}s)",
        r.label, r.scenario, r.verification, r.pods, r.nodes, r.distinct_tokens, r.setup_pods_s, r.setup_tokens_s
    );
    println!(
        "  from spawn: listening {}, ready {}, last pod served {} ({} served, {} not); {:.0} CSR/s over the burst",
        opt(r.listening_s),
        opt(r.ready_s),
        opt(r.last_served_s),
        r.served,
        r.unserved,
        r.csr_per_s
    );
    println!(
        "  served at p50 {:.2}s p99 {:.2}s; successful attempts p50 {:.1} ms p99 {:.1} ms",
        r.served_p50_s, r.served_p99_s, r.attempt_ok_p50_ms, r.attempt_ok_p99_ms
    );
    println!(
        "  predicted {} ({}); ratio {}",
        opt(r.predicted_s),
        r.predicted_by,
        r.ratio_to_predicted
            .map_or("-".into(), |x| format!("{x:.2}"))
    );
    println!(
        "  attempts {} (retries {}, max per pod {}): {:?}",
        r.attempts, r.retries, r.max_attempts_per_pod, r.attempts_by_code
    );
    println!(
        "  TokenReviews at the API server {:?} (mean rtt {:?} ms); server CPU {:?}s, RSS peak {:?} MiB; load {} -> {}",
        r.apiserver_tokenreviews,
        r.review_mean_ms.map(|m| m.round()),
        r.server_cpu_s,
        r.server_rss_hwm_mib.map(|m| m.round()),
        r.loadavg_before,
        r.loadavg_after
    );
    for (k, v) in &r.server_counters {
        println!("  server {k} {v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_retries_five_times_then_ends_the_round() {
        let waits: Vec<f64> = (0..6)
            .map_while(|r| agent_backoff(r, 0.5))
            .map(|d| d.as_secs_f64())
            .collect();
        assert_eq!(waits.len(), 5);
        for (w, want) in waits.iter().zip([0.1, 0.2, 0.4, 0.8, 1.6]) {
            assert!((w - want).abs() < 1e-9, "{waits:?}");
        }
        assert!(agent_retries(Code::ResourceExhausted));
        assert!(agent_retries(Code::Unavailable));
        assert!(!agent_retries(Code::Unauthenticated));
        assert!(!agent_retries(Code::PermissionDenied));
    }

    #[test]
    fn ztunnel_backoff_doubles_with_jitter_and_caps_at_150s() {
        for (retry, first, u, lo, hi) in [
            (0, 0.5, 0.0, 0.4, 0.4),
            (0, 1.0, 1.0, 1.2, 1.2),
            (1, 0.5, 0.5, 1.0, 1.0),
            (20, 1.0, 0.5, 150.0, 150.0),
            (20, 1.0, 1.0, 180.0, 180.0),
        ] {
            let s = ztunnel_backoff(retry, first, u).as_secs_f64();
            assert!(s >= lo - 1e-9 && s <= hi + 1e-9, "{retry} {first} {u}: {s}");
        }
    }

    #[test]
    fn budget_prediction_takes_the_tighter_of_rate_and_inflight() {
        // 10k reviews, burst 100, 100/s: 99 s.
        assert_eq!(budget_seconds(10_000, 100, 100, 32, None), 99.0);
        // 32 in flight at 0.5 s each = 64/s binds before 100/s.
        assert!((budget_seconds(10_100, 100, 100, 32, Some(0.5)) - 10_000.0 / 64.0).abs() < 1e-9);
        assert_eq!(budget_seconds(50, 100, 100, 32, Some(0.01)), 0.0);
    }

    #[test]
    fn counters_pick_the_named_families() {
        let text = "meshca_decisions_total{decision=\"deny\",reason=\"x\"} 3\n\
                    meshca_decisions_total{decision=\"allow\",reason=\"issued\"} 9\n\
                    meshca_tokenreviews_total{result=\"authenticated\"} 4\n\
                    meshca_tokenreviews_total{result=\"error\"} 0\n# HELP x\n";
        let c = counters(
            text,
            &[
                "meshca_decisions_total{decision=\"deny\"",
                "meshca_tokenreviews_total",
            ],
        );
        assert_eq!(c.len(), 2, "{c:?}");
        assert_eq!(
            c["meshca_decisions_total{decision=\"deny\",reason=\"x\"}"],
            3
        );
    }
}
