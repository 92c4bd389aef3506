//! `meshca-bench`: a load generator for `IstioCertificateService/CreateCertificate`
//! (meshca or istiod) plus a measurement of this machine's crypto ceiling.
//!
//! Every request carries a fresh key's CSR; all keys and CSRs are generated
//! before the timed loop. N connections each carry M concurrent streams
//! (closed loop), or, with `--rate`, requests are started on a fixed schedule
//! and latency is measured from each request's scheduled start (no
//! coordinated omission). Results are printed for people and as one JSON line.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::PostParams;
use kube::{Api, Client};
use rcgen::{CertificateParams, DistinguishedName, KeyPair, SanType};
use serde::Serialize;
use serde_json::json;
use time::OffsetDateTime;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

pub mod cold;
pub mod idle;
pub mod probe;
pub mod storm;

use crate::ca::generate::KeyType;
use crate::ca::{csr, ttl, CaBundle};
use crate::identity::{SpiffeId, TrustDomain};
use crate::proto::istio_certificate_service_client::IstioCertificateServiceClient;
use crate::proto::IstioCertificateRequest;

/// What kind of caller the load imitates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// A workload renewing with its current certificate (mTLS client auth).
    MtlsRenewal,
    /// Sidecars: pod-bound ServiceAccount tokens (TokenReview), one per pod.
    Token,
    /// ztunnel-like node proxies: a ztunnel pod-bound token asking for the
    /// identity of a workload on its node (`ImpersonatedIdentity`).
    TokenImpersonation,
    /// Only measure the crypto ceiling; send no requests.
    CeilingOnly,
    /// A renewal storm of many node proxies at a multiple of the measured
    /// peak (see [`storm`]).
    Storm,
    /// Many idle mTLS connections: the server's memory per connection (see [`idle`]).
    IdleConnections,
    /// A cold restart: a fresh server process and every existing pod needing
    /// a certificate at once (see [`cold`]).
    ColdRestart,
}

/// `meshca-bench` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Server to load (gRPC over TLS). Only loopback addresses are accepted.
    #[arg(long, default_value = "127.0.0.1:15012")]
    pub target: SocketAddr,
    /// TLS name to verify in the server certificate (istiod: istiod.istio-system.svc).
    #[arg(long, default_value = "localhost")]
    pub server_name: String,
    /// CA directory shared with the server (cacerts or kubernetes.io/tls layout): its root
    /// bundle is trusted, and its signing key mints the mTLS client identity and measures
    /// the crypto ceiling.
    #[arg(long)]
    pub ca_dir: PathBuf,
    #[arg(long, value_enum, default_value_t = Mode::MtlsRenewal)]
    pub mode: Mode,
    /// HTTP/2 connections.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Concurrent streams (requests in flight) per connection.
    #[arg(long, default_value_t = 8)]
    pub streams: usize,
    /// Timed requests (one fresh key and CSR each); 0 sizes the run to fill
    /// --max-seconds (from --rate, or from the warmup's rate).
    #[arg(long, default_value_t = 20_000)]
    pub requests: usize,
    /// Untimed requests before the timed ones (after every caller succeeded once).
    #[arg(long, default_value_t = 500)]
    pub warmup: usize,
    /// Start requests at this total rate (CSR/s) instead of as fast as possible.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Stop the timed phase after this many seconds even if requests remain.
    #[arg(long, default_value_t = 120.0)]
    pub max_seconds: f64,
    /// Key type of the workload keys in the CSRs.
    #[arg(long, value_enum, default_value_t = KeyType::EcdsaP256)]
    pub key_type: KeyType,
    /// Seconds to measure the crypto ceiling (CSR verify + leaf sign); 0 skips it.
    #[arg(long, default_value_t = 3.0)]
    pub ceiling_seconds: f64,
    /// Admin kubeconfig of the cluster the server uses (token modes create pods and mint
    /// pod-bound tokens there).
    #[arg(long, env = "KTE_ADMIN_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Distinct callers (token: pods with their own ServiceAccount; impersonation:
    /// workload pods whose identities are requested).
    #[arg(long, default_value_t = 32)]
    pub pods: usize,
    /// Nodes the bench pods are spread over (impersonation: one ztunnel pod per node).
    #[arg(long, default_value_t = 4)]
    pub nodes: usize,
    /// Namespace and ServiceAccount of the ztunnel pods (must be in the server's
    /// CA_TRUSTED_NODE_ACCOUNTS).
    #[arg(long, default_value = "istio-system/ztunnel")]
    pub node_account: String,
    /// `clusterid` header sent by token callers.
    #[arg(long, default_value = "Kubernetes")]
    pub cluster_id: String,
    #[arg(long, env = "TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,
    /// Requested certificate lifetime in seconds (0: the server's default).
    #[arg(long, default_value_t = 0)]
    pub validity_seconds: i64,
    /// Name of the server under test in the results (e.g. meshca, istiod).
    #[arg(long, default_value = "meshca")]
    pub label: String,
    /// PID of the server, to report its CPU time (from /proc) per certificate.
    #[arg(long)]
    pub server_pid: Option<u32>,
    /// Append the JSON result line to this file as well.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Storm: how the proxies (--pods of them, --streams in flight each) authenticate.
    #[arg(long, value_enum, default_value_t = storm::StormAuth::Mtls)]
    pub storm_auth: storm::StormAuth,
    /// Storm: each request's grpc-timeout (the client gives up then too).
    #[arg(long, default_value_t = 1000)]
    pub storm_deadline_ms: u64,
    /// Storm: offered load as a multiple of the measured peak.
    #[arg(long, default_value_t = 3.0)]
    pub storm_overload: f64,
    /// Storm: proxy 0 offers this many times the others' rate and in-flight cap.
    #[arg(long, default_value_t = 10)]
    pub storm_greedy: usize,
    /// Storm: seconds of the peak phase and of the storm phase.
    #[arg(long, default_value_t = 10.0)]
    pub storm_seconds: f64,
    /// Storm: proxies in the closed-loop peak phase.
    #[arg(long, default_value_t = 64)]
    pub storm_peak_proxies: usize,
    /// Storm: requests in flight per proxy in the peak phase. One keeps the
    /// signing thread busy without a standing queue past the queue target:
    /// two made a server at a quarter of a core shed a seventh of the peak.
    #[arg(long, default_value_t = 1)]
    pub storm_peak_streams: usize,
    /// Storm: measure the peak again after the storm phase and compare the
    /// storm with the mean of both (a VM's speed drifts between phases).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub storm_peak_after: bool,
    /// Storm: storm phases, each followed by a peak (the last one only with
    /// `--storm-peak-after`); each storm is compared with its neighbouring peaks.
    #[arg(long, default_value_t = 1)]
    pub storm_rounds: usize,
    /// Storm: run a speed probe pinned to this CPU (the server's) at nice 19
    /// and estimate each storm's capacity from its rate (see `bench::probe`).
    #[arg(long)]
    pub storm_speed_probe_cpu: Option<usize>,
    /// Storm: the server's admin port (to count issued and shed requests).
    #[arg(long, default_value = "127.0.0.1:15014")]
    pub admin_target: SocketAddr,
    /// Storm: how the proxies retry (ztunnel and agent as the real clients,
    /// open as the worst case).
    #[arg(long, value_enum, default_value_t = storm::ClientModel::Ztunnel)]
    pub storm_client: storm::ClientModel,
    /// Cold restart (`--mode cold-restart`); `--ca-dir` is then the server's `--data-dir`.
    #[command(flatten)]
    pub cold: cold::ColdArgs,
}

/// Crypto ceiling: what this machine's cores can do with meshca's own
/// functions, without any transport.
#[derive(Debug, Clone, Serialize)]
pub struct Ceiling {
    /// `parse_and_verify` + `sign_leaf` per CPU-second of one thread (from
    /// /proc/thread-self/schedstat, so other load on the machine does not lower it).
    pub per_core: f64,
    /// The same per wall-clock second on one thread (lower when other
    /// processes compete for the core).
    pub per_core_wall: f64,
    /// Per wall-clock second on `threads` threads at once.
    pub all_cores: f64,
    pub threads: usize,
    /// Mean wall microseconds of each half on one thread.
    pub verify_us: f64,
    pub sign_us: f64,
}

/// One run's results.
#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    pub label: String,
    pub mode: Mode,
    pub key_type: String,
    pub ca_key: String,
    pub connections: usize,
    pub streams: usize,
    pub target_rate: Option<f64>,
    pub requests: usize,
    pub ok: usize,
    pub errors: BTreeMap<String, usize>,
    pub seconds: f64,
    pub csr_per_s: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
    pub ceiling: Option<Ceiling>,
    /// `csr_per_s / ceiling.all_cores`.
    pub ratio_vs_ceiling_all_cores: Option<f64>,
    /// `csr_per_s / ceiling.per_core`.
    pub ratio_vs_ceiling_per_core: Option<f64>,
    /// Server CPU seconds spent during the timed phase (from /proc/PID/stat).
    pub server_cpu_s: Option<f64>,
    /// Certificates per server CPU-second: comparable with `ceiling.per_core`.
    pub csr_per_server_cpu_s: Option<f64>,
    /// `csr_per_server_cpu_s / ceiling.per_core`: the share of the server's CPU
    /// time that the crypto alone would need (1.0 = nothing but crypto).
    pub server_cpu_ratio_vs_ceiling: Option<f64>,
    pub bench_cpu_s: f64,
    pub nproc: usize,
    pub date: String,
}

/// Runs the benchmark and prints its results.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.mode == Mode::Storm {
        return storm::run(&args).await;
    }
    if args.mode == Mode::IdleConnections {
        return idle::run(&args).await;
    }
    if args.mode == Mode::ColdRestart {
        return cold::run(&args).await;
    }
    let result = execute(&args).await?;
    print_human(&result);
    emit_json(&args, &serde_json::to_string(&result)?)
}

/// Prints a result's JSON line and appends it to `--json-out`.
fn emit_json(args: &BenchArgs, line: &str) -> anyhow::Result<()> {
    println!("{line}");
    if let Some(path) = &args.json_out {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        writeln!(f, "{line}")?;
    }
    Ok(())
}

/// The crypto ceiling, when `--ceiling-seconds` asks for one.
fn ceiling_if_asked(
    args: &BenchArgs,
    bundle: &CaBundle,
    td: &TrustDomain,
    nproc: usize,
) -> anyhow::Result<Option<Ceiling>> {
    if args.ceiling_seconds <= 0.0 {
        return Ok(None);
    }
    eprintln!(
        "bench: measuring the crypto ceiling ({}s x2)",
        args.ceiling_seconds
    );
    Ok(Some(measure_ceiling(
        bundle,
        td,
        args.key_type,
        args.ceiling_seconds,
        nproc,
    )?))
}

/// Runs the benchmark and returns its results (nothing printed but progress on stderr).
pub async fn execute(args: &BenchArgs) -> anyhow::Result<BenchResult> {
    if !args.target.ip().is_loopback() {
        bail!(
            "--target {} is not a loopback address: load tests only target this machine",
            args.target
        );
    }
    if args.connections == 0 || args.streams == 0 {
        bail!("--connections and --streams must be at least 1");
    }
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let td = TrustDomain::new(&args.trust_domain)?;
    let bundle = Arc::new(
        CaBundle::load_dir(&args.ca_dir, OffsetDateTime::now_utc())
            .with_context(|| format!("loading {}", args.ca_dir.display()))?,
    );
    let nproc = std::thread::available_parallelism().map_or(1, |n| n.get());

    let ceiling = ceiling_if_asked(args, &bundle, &td, nproc)?;
    if args.mode == Mode::CeilingOnly {
        return Ok(summarize(
            args,
            &bundle,
            Vec::new(),
            0.0,
            ceiling,
            None,
            0.0,
            nproc,
        ));
    }

    let plan = Arc::new(Plan::build(args, &bundle, &td).await?);
    if plan.callers.is_empty() {
        bail!("no callers to send requests as");
    }
    let clients = connect(args, &bundle, &plan).await?;
    // Every caller and connection once, until it succeeds: warms connections,
    // the TokenReview cache and waits for the server's pod index to show the
    // bench pods.
    warm_callers(&clients, &plan, args).await?;
    let mut warm_rate = None;
    if args.warmup > 0 {
        let csrs = Arc::new(generate_logged(
            &plan,
            args.key_type,
            0,
            args.warmup,
            nproc,
        )?);
        let w = drive(&clients, &plan, &csrs, 0, args.warmup, None, args).await;
        warm_rate = Some(w.ok_count() as f64 / w.seconds.max(1e-9));
        eprintln!(
            "bench: warmup {} requests, {} ok, {:.0}/s",
            args.warmup,
            w.ok_count(),
            warm_rate.unwrap_or(0.0)
        );
    }
    // --requests 0: as many as fit --max-seconds at the target rate, or at
    // 1.25x the warmup's rate (CSRs are pre-generated, so they must be counted first).
    let requests = match (args.requests, args.rate, warm_rate) {
        (0, Some(r), _) => (r * args.max_seconds).ceil() as usize,
        (0, None, Some(w)) => ((w * 1.25 * args.max_seconds).ceil() as usize).max(1000),
        (0, None, None) => bail!("--requests 0 needs --rate or a warmup to size the run"),
        (n, _, _) => n,
    };
    let (from, to) = (args.warmup, args.warmup + requests);
    let csrs = Arc::new(generate_logged(&plan, args.key_type, from, to, nproc)?);

    let cpu0 = args.server_pid.and_then(proc_cpu_seconds);
    let bench_cpu0 = proc_cpu_seconds(std::process::id()).unwrap_or(0.0);
    eprintln!(
        "bench: {requests} requests over {} connections x {} streams{} (at most {}s)",
        args.connections,
        args.streams,
        args.rate
            .map(|r| format!(" at {r:.0}/s"))
            .unwrap_or_default(),
        args.max_seconds
    );
    let run = drive(&clients, &plan, &csrs, from, to, args.rate, args).await;
    let server_cpu = match (cpu0, args.server_pid.and_then(proc_cpu_seconds)) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let bench_cpu = proc_cpu_seconds(std::process::id()).unwrap_or(0.0) - bench_cpu0;
    Ok(summarize(
        args,
        &bundle,
        run.samples,
        run.seconds,
        ceiling,
        server_cpu,
        bench_cpu,
        nproc,
    ))
}

// ------------------------------------------------------------------ callers

/// One distinct caller: how it authenticates and which identity its CSR names.
#[derive(Debug, Clone)]
struct Caller {
    identity: String,
    bearer: Option<String>,
    impersonate: Option<String>,
}

/// Who sends request `i`: `callers[i % callers.len()]`.
#[derive(Debug)]
struct Plan {
    callers: Vec<Caller>,
    client_identity: Option<(String, String)>,
    cluster_id: String,
    mode: Mode,
}

impl Plan {
    async fn build(args: &BenchArgs, bundle: &CaBundle, td: &TrustDomain) -> anyhow::Result<Self> {
        let mut plan = Plan {
            callers: Vec::new(),
            client_identity: None,
            cluster_id: args.cluster_id.clone(),
            mode: args.mode,
        };
        match args.mode {
            Mode::CeilingOnly | Mode::Storm | Mode::IdleConnections | Mode::ColdRestart => {}
            Mode::MtlsRenewal => {
                let id = SpiffeId::new(td.clone(), "meshca-bench", "bench")?;
                plan.client_identity = Some(client_identity(bundle, &id)?);
                plan.callers.push(Caller {
                    identity: id.to_string(),
                    bearer: None,
                    impersonate: None,
                });
            }
            Mode::Token | Mode::TokenImpersonation => {
                let path = args.kubeconfig.as_ref().context(
                    "token modes need --kubeconfig (admin) of the server's cluster to create pods and mint tokens",
                )?;
                let kube = crate::app::kube_client(Some(path)).await?;
                plan.callers = kube_callers(&kube, args, td).await?;
            }
        }
        Ok(plan)
    }
}

/// A client certificate chain (without root) and key for `id`, signed by the bundle.
fn client_identity(bundle: &CaBundle, id: &SpiffeId) -> anyhow::Result<(String, String)> {
    let validity = ttl::validity(
        OffsetDateTime::now_utc(),
        0,
        &Default::default(),
        bundle.signing_not_after(),
    )?;
    Ok(bundle.client_identity(id, &validity)?)
}

fn random_suffix() -> String {
    let mut b = [0u8; 4];
    let _ = aws_lc_rs::rand::fill(&mut b);
    hex::encode(b)
}

async fn create_ignore_exists<K>(api: &Api<K>, obj: serde_json::Value) -> anyhow::Result<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + Serialize + std::fmt::Debug,
{
    let obj: K = serde_json::from_value(obj)?;
    match api.create(&PostParams::default(), &obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Creates a pod bound to `node` (no scheduler runs in the test cluster); returns its UID.
/// One ztunnel pod per node (`node(n)` names node n) in the node account's
/// namespace (`NAMESPACE/SERVICEACCOUNT`); returns a pod-bound token for each.
async fn ztunnel_tokens(
    kube: &Client,
    node_account: &str,
    tag: &str,
    nodes: usize,
    node: impl Fn(usize) -> String,
) -> anyhow::Result<Vec<String>> {
    let (zns, zsa) = node_account
        .split_once('/')
        .context("--node-account must be NAMESPACE/SERVICEACCOUNT")?;
    create_ignore_exists(
        &Api::<Namespace>::all(kube.clone()),
        json!({"metadata": {"name": zns}}),
    )
    .await?;
    create_ignore_exists(
        &Api::<ServiceAccount>::namespaced(kube.clone(), zns),
        json!({"metadata": {"name": zsa}}),
    )
    .await?;
    let zpods = Api::<Pod>::namespaced(kube.clone(), zns);
    let mut out = Vec::new();
    for n in 0..nodes {
        let name = format!("ztunnel-{tag}-{n}");
        let uid = create_pod(&zpods, &name, zsa, &node(n)).await?;
        out.push(pod_token(kube, zns, zsa, &name, &uid).await?);
    }
    Ok(out)
}

async fn create_pod(api: &Api<Pod>, name: &str, sa: &str, node: &str) -> anyhow::Result<String> {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": "meshca-bench"}},
        "spec": {
            "nodeName": node, "serviceAccountName": sa,
            "automountServiceAccountToken": false, "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "app", "image": "example.invalid/app:0"}]
        }
    }))?;
    let created = api.create(&PostParams::default(), &pod).await?;
    created.metadata.uid.context("created pod has no uid")
}

async fn pod_token(
    kube: &Client,
    ns: &str,
    sa: &str,
    pod: &str,
    uid: &str,
) -> anyhow::Result<String> {
    let tr = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: Some(vec!["istio-ca".into()]),
            expiration_seconds: Some(3600),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(pod.into()),
                uid: Some(uid.into()),
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let out: TokenRequest = Api::<ServiceAccount>::namespaced(kube.clone(), ns)
        .create_subresource("token", sa, &PostParams::default(), &tr)
        .await?;
    out.status
        .and_then(|s| s.token)
        .context("TokenRequest without a token")
}

/// Creates the bench namespace, ServiceAccounts and pods, and mints pod-bound tokens.
async fn kube_callers(
    kube: &Client,
    args: &BenchArgs,
    td: &TrustDomain,
) -> anyhow::Result<Vec<Caller>> {
    let ns = format!("meshca-bench-{}", random_suffix());
    let nodes = args.nodes.max(1);
    let pods = args.pods.max(1);
    eprintln!("bench: creating namespace {ns} with {pods} pods on {nodes} nodes");
    create_ignore_exists(
        &Api::<Namespace>::all(kube.clone()),
        json!({"metadata": {"name": ns}}),
    )
    .await?;
    let sa_api = Api::<ServiceAccount>::namespaced(kube.clone(), &ns);
    let pod_api = Api::<Pod>::namespaced(kube.clone(), &ns);
    let node = |i: usize| format!("meshca-bench-node-{}", i % nodes);
    let mut workloads = Vec::new();
    for i in 0..pods {
        let sa = format!("sa-{i}");
        create_ignore_exists(&sa_api, json!({"metadata": {"name": sa}})).await?;
        let name = format!("app-{i}");
        let uid = create_pod(&pod_api, &name, &sa, &node(i)).await?;
        workloads.push((sa, name, uid));
    }
    let mut callers = Vec::new();
    match args.mode {
        Mode::Token => {
            for (sa, name, uid) in &workloads {
                callers.push(Caller {
                    identity: SpiffeId::new(td.clone(), &ns, sa)?.to_string(),
                    bearer: Some(pod_token(kube, &ns, sa, name, uid).await?),
                    impersonate: None,
                });
            }
        }
        Mode::TokenImpersonation => {
            let node_tokens = ztunnel_tokens(
                kube,
                &args.node_account,
                &ns["meshca-bench-".len()..],
                nodes,
                node,
            )
            .await?;
            for (i, (sa, _, _)) in workloads.iter().enumerate() {
                let id = SpiffeId::new(td.clone(), &ns, sa)?.to_string();
                callers.push(Caller {
                    identity: id.clone(),
                    bearer: Some(node_tokens[i % nodes].clone()),
                    impersonate: Some(id),
                });
            }
        }
        Mode::MtlsRenewal
        | Mode::CeilingOnly
        | Mode::Storm
        | Mode::IdleConnections
        | Mode::ColdRestart => {}
    }
    Ok(callers)
}

// ------------------------------------------------------------------ CSRs

fn csr_for(key: &KeyPair, id: &str) -> anyhow::Result<String> {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.subject_alt_names = vec![SanType::URI(id.to_string().try_into()?)];
    Ok(params.serialize_request(key)?.pem()?)
}

fn generate_logged(
    plan: &Plan,
    key_type: KeyType,
    from: usize,
    to: usize,
    threads: usize,
) -> anyhow::Result<Vec<String>> {
    let t = Instant::now();
    let out = pregenerate(plan, key_type, from, to, threads)?;
    eprintln!(
        "bench: generated {} {} keys and CSRs in {:.1}s ({} distinct identities)",
        out.len(),
        cli_name(key_type),
        t.elapsed().as_secs_f64(),
        plan.callers.len()
    );
    Ok(out)
}

/// Fresh keys and CSRs for requests `from..to` (request `i` names
/// `callers[i % len]`), made on all cores; element `i - from` is request `i`'s.
fn pregenerate(
    plan: &Plan,
    key_type: KeyType,
    from: usize,
    to: usize,
    threads: usize,
) -> anyhow::Result<Vec<String>> {
    let total = to.saturating_sub(from);
    let ids: Vec<&str> = plan.callers.iter().map(|c| c.identity.as_str()).collect();
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let threads = threads.max(1);
    let chunk = total.div_ceil(threads).max(1);
    let parts: Vec<anyhow::Result<Vec<String>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..total)
            .step_by(chunk)
            .map(|start| {
                let ids = &ids;
                s.spawn(move || {
                    (start..(start + chunk).min(total))
                        .map(|i| csr_for(&key_type.generate()?, ids[(from + i) % ids.len()]))
                        .collect::<anyhow::Result<Vec<_>>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("CSR thread panicked")))
            })
            .collect()
    });
    let mut out = Vec::with_capacity(total);
    for p in parts {
        out.extend(p?);
    }
    Ok(out)
}

// ------------------------------------------------------------------ ceiling

/// CSR parse+verify and leaf sign, with meshca's own functions, on one thread
/// and then on `threads` threads at once.
pub fn measure_ceiling(
    bundle: &CaBundle,
    td: &TrustDomain,
    key_type: KeyType,
    seconds: f64,
    threads: usize,
) -> anyhow::Result<Ceiling> {
    let id = SpiffeId::new(td.clone(), "meshca-bench", "ceiling")?;
    let pool: Vec<String> = (0..256)
        .map(|_| csr_for(&key_type.generate()?, &id.to_string()))
        .collect::<anyhow::Result<_>>()?;
    let one = |seconds: f64| -> anyhow::Result<(u64, Duration, Duration, f64)> {
        let cpu0 = thread_cpu_seconds();
        let deadline = Instant::now() + Duration::from_secs_f64(seconds);
        let (mut n, mut verify, mut sign) = (0u64, Duration::ZERO, Duration::ZERO);
        while Instant::now() < deadline {
            let pem = &pool[n as usize % pool.len()];
            let t0 = Instant::now();
            let csr = csr::parse_and_verify(pem)?;
            let t1 = Instant::now();
            let validity = ttl::validity(
                OffsetDateTime::now_utc(),
                0,
                &Default::default(),
                bundle.signing_not_after(),
            )?;
            let leaf = bundle.sign_leaf(&csr.spki_der, &id, csr.has_common_name, &validity)?;
            std::hint::black_box(leaf);
            let t2 = Instant::now();
            verify += t1 - t0;
            sign += t2 - t1;
            n += 1;
        }
        Ok((n, verify, sign, thread_cpu_seconds() - cpu0))
    };
    let t = Instant::now();
    let (n, verify, sign, cpu) = one(seconds)?;
    let per_core_wall = n as f64 / t.elapsed().as_secs_f64();
    let per_core = if cpu > 0.0 {
        n as f64 / cpu
    } else {
        per_core_wall
    };
    let t = Instant::now();
    let counts: Vec<anyhow::Result<(u64, Duration, Duration, f64)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads).map(|_| s.spawn(|| one(seconds))).collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("ceiling thread panicked")))
            })
            .collect()
    });
    let elapsed = t.elapsed().as_secs_f64();
    let mut all = 0u64;
    for c in counts {
        all += c?.0;
    }
    Ok(Ceiling {
        per_core,
        per_core_wall,
        all_cores: all as f64 / elapsed,
        threads,
        verify_us: verify.as_secs_f64() * 1e6 / n.max(1) as f64,
        sign_us: sign.as_secs_f64() * 1e6 / n.max(1) as f64,
    })
}

// ------------------------------------------------------------------ load

type CaClient = IstioCertificateServiceClient<Channel>;

async fn connect(
    args: &BenchArgs,
    bundle: &CaBundle,
    plan: &Plan,
) -> anyhow::Result<Vec<CaClient>> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(bundle.root_bundle()))
        .domain_name(args.server_name.clone());
    if let Some((cert, key)) = &plan.client_identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let mut clients = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        // One Endpoint::connect() is one HTTP/2 connection.
        let channel = Channel::from_shared(format!("https://{}", args.target))?
            .tls_config(tls.clone())?
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .with_context(|| format!("connecting to {}", args.target))?;
        clients.push(
            IstioCertificateServiceClient::new(channel).max_decoding_message_size(4 * 1024 * 1024),
        );
    }
    Ok(clients)
}

fn request_for(
    plan: &Plan,
    i: usize,
    csr: String,
    validity: i64,
) -> anyhow::Result<tonic::Request<IstioCertificateRequest>> {
    let caller = &plan.callers[i % plan.callers.len()];
    let metadata = caller.impersonate.as_ref().map(|id| prost_types::Struct {
        fields: [(
            crate::grpc::IMPERSONATED_IDENTITY.to_string(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::StringValue(id.clone())),
            },
        )]
        .into_iter()
        .collect(),
    });
    let mut req = tonic::Request::new(IstioCertificateRequest {
        csr,
        validity_duration: validity,
        metadata,
    });
    if let Some(token) = &caller.bearer {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse()?);
    }
    if plan.mode != Mode::MtlsRenewal {
        req.metadata_mut()
            .insert("clusterid", plan.cluster_id.parse()?);
    }
    Ok(req)
}

/// Sends one request; `Ok(())` only for a response that carries a chain.
async fn call(
    client: &mut CaClient,
    req: tonic::Request<IstioCertificateRequest>,
) -> Result<(), String> {
    match client.create_certificate(req).await {
        Ok(resp) if resp.get_ref().cert_chain.len() >= 2 => Ok(()),
        Ok(_) => Err("BadResponse".into()),
        Err(status) => Err(format!("{:?}", status.code())),
    }
}

async fn warm_callers(clients: &[CaClient], plan: &Plan, args: &BenchArgs) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    // Every caller, and every connection, once.
    for i in 0..plan.callers.len().max(clients.len()) {
        let caller = &plan.callers[i % plan.callers.len()];
        let mut client = clients[i % clients.len()].clone();
        loop {
            let csr = csr_for(&args.key_type.generate()?, &caller.identity)?;
            let req = request_for(plan, i, csr, args.validity_seconds)?;
            match call(&mut client, req).await {
                Ok(()) => break,
                Err(code) if Instant::now() < deadline => {
                    if i == 0 {
                        eprintln!("bench: waiting for the server to accept caller 0 ({code})");
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(code) => bail!(
                    "caller {i} ({}) still fails after 60s: {code}",
                    caller.identity
                ),
            }
        }
    }
    Ok(())
}

struct RunSamples {
    /// (latency ns, error) per request.
    samples: Vec<(u64, Option<String>)>,
    seconds: f64,
}

impl RunSamples {
    fn ok_count(&self) -> usize {
        self.samples.iter().filter(|s| s.1.is_none()).count()
    }
}

async fn drive(
    clients: &[CaClient],
    plan: &Arc<Plan>,
    csrs: &Arc<Vec<String>>,
    from: usize,
    to: usize,
    rate: Option<f64>,
    args: &BenchArgs,
) -> RunSamples {
    let next = Arc::new(AtomicUsize::new(from));
    let start = Instant::now();
    let stop_at = start + Duration::from_secs_f64(args.max_seconds);
    let mut tasks = Vec::new();
    for client in clients {
        for _ in 0..args.streams {
            let mut client = client.clone();
            let (next, plan, csrs) = (next.clone(), plan.clone(), csrs.clone());
            let validity = args.validity_seconds;
            tasks.push(tokio::spawn(async move {
                let mut samples = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= to {
                        break;
                    }
                    let t0 = match rate {
                        Some(r) => {
                            let at = start + Duration::from_secs_f64((i - from) as f64 / r);
                            tokio::time::sleep_until(at.into()).await;
                            at
                        }
                        None => Instant::now(),
                    };
                    if t0 > stop_at {
                        break;
                    }
                    let result = match request_for(&plan, i, csrs[i - from].clone(), validity) {
                        Ok(req) => call(&mut client, req).await,
                        Err(e) => Err(format!("BadRequest({e})")),
                    };
                    samples.push((t0.elapsed().as_nanos() as u64, result.err()));
                }
                samples
            }));
        }
    }
    let mut samples = Vec::with_capacity(to - from);
    for t in tasks {
        match t.await {
            Ok(s) => samples.extend(s),
            Err(e) => samples.push((0, Some(format!("TaskFailed({e})")))),
        }
    }
    RunSamples {
        samples,
        seconds: start.elapsed().as_secs_f64(),
    }
}

// ------------------------------------------------------------------ results

/// utime + stime of a process, in seconds.
fn proc_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / clock_ticks())
}

/// CPU time of the server's signing threads (`meshca-sign-*`), in seconds:
/// the sum of their scheduler runtime (/proc/PID/task/TID/schedstat, ns).
/// Read from outside, so the server's scheduling is left as it is (a thread
/// reading its own CPU clock charges its runtime at once, which moved the
/// niced signing threads' share under a quota).
fn signing_cpu_seconds(pid: u32) -> Option<f64> {
    let mut ns = 0u64;
    let mut threads = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        let dir = task.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with("meshca-sign") {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("schedstat")).ok()?;
        ns += stat.split_whitespace().next()?.parse::<u64>().ok()?;
        threads += 1;
    }
    (threads > 0).then(|| ns as f64 / 1e9)
}

/// Time the hypervisor ran something else while each CPU wanted to run
/// (`steal` of each `cpuN` line of /proc/stat), in seconds: it delays the
/// confined server (with paravirtual steal accounting the quota is charged
/// execution time only, so it does not take the server's capacity).
fn steal_seconds_per_cpu() -> Option<Vec<f64>> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    stat.lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .map(|l| {
            let steal: f64 = l.split_whitespace().nth(8)?.parse().ok()?;
            Some(steal / clock_ticks())
        })
        .collect()
}

/// The CPU a process last ran on (field 39 of /proc/PID/stat): the one it
/// is pinned to when it is.
fn proc_last_cpu(pid: u32) -> Option<usize> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().nth(36)?.parse().ok()
}

/// Per-CPU differences of two `steal_seconds_per_cpu` readings.
fn steal_since(before: Option<Vec<f64>>) -> Option<Vec<f64>> {
    let after = steal_seconds_per_cpu()?;
    let before = before.filter(|b| b.len() == after.len())?;
    Some(
        after
            .iter()
            .zip(&before)
            .map(|(a, b)| ((a - b) * 100.0).round() / 100.0)
            .collect(),
    )
}

/// CPU time of the calling thread, up to now ([`probe::thread_cpu_ns`]).
fn thread_cpu_seconds() -> f64 {
    probe::thread_cpu_ns() as f64 / 1e9
}

fn clock_ticks() -> f64 {
    // sysconf(_SC_CLK_TCK) is 100 on every Linux this runs on; no libc call needed.
    100.0
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64 / 1e6
}

#[allow(clippy::too_many_arguments)]
fn summarize(
    args: &BenchArgs,
    bundle: &CaBundle,
    samples: Vec<(u64, Option<String>)>,
    seconds: f64,
    ceiling: Option<Ceiling>,
    server_cpu: Option<f64>,
    bench_cpu: f64,
    nproc: usize,
) -> BenchResult {
    let mut errors = BTreeMap::new();
    let mut lat: Vec<u64> = Vec::with_capacity(samples.len());
    for (ns, err) in &samples {
        match err {
            None => lat.push(*ns),
            Some(code) => *errors.entry(code.clone()).or_insert(0) += 1,
        }
    }
    lat.sort_unstable();
    let ok = lat.len();
    let csr_per_s = if seconds > 0.0 {
        ok as f64 / seconds
    } else {
        0.0
    };
    let server_cpu_ratio_vs_ceiling = match (server_cpu, &ceiling) {
        (Some(cpu), Some(c)) if cpu > 0.0 && c.per_core > 0.0 => Some(ok as f64 / cpu / c.per_core),
        _ => None,
    };
    let mean_ms = if ok > 0 {
        lat.iter().map(|&v| v as f64).sum::<f64>() / ok as f64 / 1e6
    } else {
        0.0
    };
    BenchResult {
        label: args.label.clone(),
        mode: args.mode,
        key_type: cli_name(args.key_type),
        ca_key: bundle.key_algorithm().to_string(),
        connections: args.connections,
        streams: args.streams,
        target_rate: args.rate,
        requests: samples.len(),
        ok,
        errors,
        seconds,
        csr_per_s,
        p50_ms: percentile(&lat, 50.0),
        p90_ms: percentile(&lat, 90.0),
        p99_ms: percentile(&lat, 99.0),
        max_ms: lat.last().map_or(0.0, |&v| v as f64 / 1e6),
        mean_ms,
        ratio_vs_ceiling_all_cores: ceiling
            .as_ref()
            .filter(|_| ok > 0)
            .map(|c| csr_per_s / c.all_cores),
        ratio_vs_ceiling_per_core: ceiling
            .as_ref()
            .filter(|_| ok > 0)
            .map(|c| csr_per_s / c.per_core),
        ceiling,
        csr_per_server_cpu_s: server_cpu.filter(|c| *c > 0.0).map(|c| ok as f64 / c),
        server_cpu_ratio_vs_ceiling,
        server_cpu_s: server_cpu,
        bench_cpu_s: bench_cpu,
        nproc,
        date: OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default(),
    }
}

fn print_human(r: &BenchResult) {
    if let Some(c) = &r.ceiling {
        println!(
            "crypto ceiling ({} CSR, {} CA): {:.0} per CPU-second of one core ({:.0}/s wall; verify {:.1} us + sign {:.1} us), {:.0}/s wall on {} threads",
            r.key_type, r.ca_key, c.per_core, c.per_core_wall, c.verify_us, c.sign_us, c.all_cores, c.threads
        );
    }
    if r.mode == Mode::CeilingOnly {
        return;
    }
    println!(
        "{} {}: {} requests over {}x{} in {:.2}s{}",
        r.label,
        cli_name(r.mode),
        r.requests,
        r.connections,
        r.streams,
        r.seconds,
        r.target_rate
            .map(|t| format!(" (target {t:.0}/s)"))
            .unwrap_or_default()
    );
    println!(
        "  {:.0} CSR/s; latency p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        r.csr_per_s, r.p50_ms, r.p90_ms, r.p99_ms, r.max_ms
    );
    if r.errors.is_empty() {
        println!("  errors: none");
    } else {
        let errors: Vec<String> = r.errors.iter().map(|(k, n)| format!("{k}={n}")).collect();
        println!("  errors: {}", errors.join(", "));
    }
    if let (Some(a), Some(p)) = (r.ratio_vs_ceiling_all_cores, r.ratio_vs_ceiling_per_core) {
        println!(
            "  vs crypto ceiling: {:.0}% of all cores, {:.0}% of one core",
            a * 100.0,
            p * 100.0
        );
    }
    if let (Some(cpu), Some(per)) = (r.server_cpu_s, r.csr_per_server_cpu_s) {
        println!(
            "  server CPU {cpu:.2}s: {per:.0} CSR per server CPU-second{}; bench CPU {:.2}s",
            r.ceiling
                .as_ref()
                .map(|c| format!(
                    " = {:.0}% of the one-core ceiling",
                    per / c.per_core * 100.0
                ))
                .unwrap_or_default(),
            r.bench_cpu_s
        );
    }
}

/// How a flag value is spelled on the command line (not its Rust name).
fn cli_name(v: impl clap::ValueEnum) -> String {
    v.to_possible_value()
        .map(|p| p.get_name().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests;
