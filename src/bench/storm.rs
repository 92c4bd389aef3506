//! `meshca-bench --mode storm`: a renewal storm. Many simulated node
//! proxies, each on its own connection and identity (mTLS, or pod-bound
//! tokens with `--storm-auth token`), each with at most `--streams` requests
//! in flight and a `grpc-timeout` of `--storm-deadline-ms`.
//!
//! 1. Peak: a closed loop from a subset of proxies measures goodput.
//! 2. Storm: every proxy starts requests on a fixed schedule so that all
//!    together offer `--storm-overload` times the peak; proxy 0 is greedy
//!    (`--storm-greedy` times the rate and in-flight cap of the others).
//! 3. Peak again (`--storm-peak-after`, the default): a VM's speed drifts
//!    by tens of percent within a minute, so the storm is compared with the
//!    mean of the peaks measured before and after it. Both are reported.
//! 4. With `--storm-rounds N`, steps 2 and 3 N times: each storm is compared
//!    with the peaks on either side of it, and the whole with the mean of
//!    those references, so a drift slower than a phase weighs on storm and
//!    peak alike. Each round is reported too.
//!
//! Reported: storm goodput / peak, p99 of the successes, each proxy's
//! goodput against its fair share, server RSS, and the server's own count
//! of certificates issued against the client's count of certificates
//! received (a certificate signed for a caller that had given up shows as a
//! difference).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use time::OffsetDateTime;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use super::{client_identity, csr_for, percentile, BenchArgs, CaClient, Mode};
use crate::ca::CaBundle;
use crate::identity::{SpiffeId, TrustDomain};
use crate::proto::istio_certificate_service_client::IstioCertificateServiceClient;
use crate::proto::IstioCertificateRequest;
use samples::{lowest_share, window_second, ProxyTally, StormSamples};
use scrape::{add_bucket_deltas, phase_work, quantile_ms, scrape};
pub use scrape::{quantile_ms_from_deltas, Buckets};

/// How storm proxies authenticate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StormAuth {
    Mtls,
    Token,
}

/// How a storm proxy behaves when a request fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClientModel {
    /// Worst case: requests start on a fixed schedule whatever the answers
    /// (a failed renewal is not retried, but the next one comes on time);
    /// requests over the in-flight cap are skipped.
    Open,
    /// ztunnel: each renewal (one identity) retries until it succeeds, with
    /// its own backoff (0.5-1 s, doubling, +-20 %, capped at 150 s) that
    /// ignores status codes and pushback; at most `--streams` fetches in
    /// flight per proxy, the others wait for a fetch slot.
    Ztunnel,
    /// istio-agent: up to 5 quick retries (100 ms doubling to 1.6 s, +-10 %)
    /// on Canceled, DeadlineExceeded, ResourceExhausted, Aborted, Internal
    /// and Unavailable, then the renewal is given up (counted `GaveUp`).
    Agent,
}

/// ztunnel's wait before retry number `attempt + 1` of one identity:
/// 0.5-1 s at first, doubling, +-20 %, at most 150 s. `draw` is random.
pub fn ztunnel_backoff(attempt: u32, draw: u64) -> Duration {
    let first_ms = 500 + (draw & 0xffff) % 501;
    let jitter_permille = 800 + ((draw >> 16) & 0xffff) % 401;
    let ms = (first_ms << attempt.min(20)) * jitter_permille / 1000;
    Duration::from_millis(ms.min(150_000))
}

/// istio-agent's wait before retry `attempt + 1` (0-based), or `None` once
/// its 5 retries are spent or the code is not one it retries.
pub fn agent_backoff(attempt: u32, outcome: &str, draw: u64) -> Option<Duration> {
    const RETRIED: [&str; 7] = [
        "Cancelled",
        "DeadlineExceeded",
        "ResourceExhausted",
        "Aborted",
        "Internal",
        "Unavailable",
        // The client's own timer is a DeadlineExceeded to the agent.
        "ClientTimeout",
    ];
    if attempt >= 5 || !RETRIED.contains(&outcome) {
        return None;
    }
    let jitter_permille = 900 + draw % 201;
    Some(Duration::from_millis(
        (100 << attempt) * jitter_permille / 1000,
    ))
}

/// One proxy: its connection, identity and request.
struct Proxy {
    client: CaClient,
    csr: String,
    bearer: Option<String>,
}

/// Results of one storm run.
#[derive(Debug, Clone, Serialize)]
pub struct StormResult {
    pub auth: StormAuth,
    pub client_model: ClientModel,
    pub proxies: usize,
    pub streams: usize,
    pub deadline_ms: u64,
    /// The capacity the storm is compared with: the mean of the peaks
    /// before and after it (the one before without `--storm-peak-after`);
    /// with several rounds, the mean of each round's.
    pub peak_per_s: f64,
    /// The closed-loop peak before the storm (it sets the offered rate).
    pub peak_before_per_s: f64,
    /// The same peak measured after the storm.
    pub peak_after_per_s: Option<f64>,
    /// Requests the server shed in the peak phases, before and after.
    pub peak_before_sheds: Option<u64>,
    /// Seconds each CPU was stolen by the hypervisor during the first peak
    /// (each round lists its storm's and its next peak's).
    pub peak_before_steal_per_cpu_s: Option<Vec<f64>>,
    /// The speed probe's signatures per second of its own CPU time in the first peak (each
    /// round lists its storm's and its next peak's); None without
    /// `--storm-speed-probe-cpu`.
    pub peak_before_probe_per_cpu_s: Option<f64>,
    /// Signing jobs the first peak ran on the requests' own workers (each
    /// round lists its next peak's).
    pub peak_before_inline_jobs: Option<u64>,
    pub peak_after_sheds: Option<u64>,
    /// The mean of the rounds' offered rates.
    pub offered_per_s: f64,
    /// Each storm round against the peaks next to it (one with the default
    /// `--storm-rounds 1`).
    pub rounds: Vec<StormRound>,
    /// Successes answered while the load was offered, per second of it.
    pub storm_ok_per_s: f64,
    /// `storm_ok_per_s / peak_per_s` (target >= 0.9).
    pub goodput_ratio: f64,
    /// The mean of the rounds' `goodput_ratio_steal_adjusted` (None when
    /// the steal time could not be read).
    pub goodput_ratio_steal_adjusted: Option<f64>,
    /// `storm_ok_per_s` over the mean of the rounds' capacities estimated
    /// with the speed probe ([`StormRound::capacity_speed_adjusted`]).
    pub goodput_ratio_speed_adjusted: Option<f64>,
    /// The signing threads' CPU per second of the storms over that of their
    /// neighbouring peaks, pooled as `goodput_ratio` is
    /// ([`StormRound::goodput_ratio_work`]); None when a round has none.
    pub goodput_ratio_work: Option<f64>,
    /// Every success over the time until the last request ended (the load
    /// window and the drain after it, in which no new work is offered and
    /// parked streams wait out their park before they are refused).
    pub storm_ok_per_s_with_drain: f64,
    pub goodput_ratio_with_drain: f64,
    /// From the end of the load window to the last request's end.
    pub drain_seconds: f64,
    pub storm_p50_ms: f64,
    pub storm_p99_ms: f64,
    pub storm_max_ms: f64,
    /// Outcomes by gRPC code (client view), plus `ClientTimeout`.
    pub outcomes: BTreeMap<String, usize>,
    /// Requests not started because the proxy already had its cap in flight.
    pub skipped_at_cap: usize,
    /// Well-behaved proxies' goodput over their fair share (storm goodput / proxies).
    pub fair_share_mean: f64,
    pub fair_share_p10: f64,
    pub fair_share_min: f64,
    /// Standard deviation of the well-behaved proxies' shares, and what
    /// counting alone gives a proxy with the fair share's successes
    /// (Poisson: 1/sqrt(successes)). A spread at or under the counting
    /// noise means the server adds no unfairness a run of this length can
    /// show; the lowest of many proxies then sits a few of these below 1.
    pub fair_share_sd: f64,
    pub fair_share_counting_sd: f64,
    /// The greedy proxy's goodput over its fair share.
    pub greedy_ratio: f64,
    /// Every proxy's requests over all rounds, the greedy one first.
    pub per_proxy: Vec<ProxyTally>,
    /// Server-side `issued` decisions during the storm (from /metrics).
    pub server_issued: Option<u64>,
    /// Server sheds during the storm by reason (from /metrics).
    pub server_shed: BTreeMap<String, u64>,
    /// Certificates the server issued minus those the clients received: work
    /// done for callers that had given up (target 0).
    pub issued_not_received: Option<i64>,
    pub server_rss_mib_before: Option<f64>,
    pub server_rss_mib_after: Option<f64>,
    pub server_rss_hwm_mib: Option<f64>,
    /// Renewals started per second (first attempts; retries not counted).
    pub renewals_per_s: f64,
    /// Requests sent per second, retries included.
    pub attempts_per_s: f64,
    /// Renewals given up (agent model) or still unfinished at the end.
    pub gave_up: usize,
    /// CPU-seconds of the server and of this generator during the storm
    /// phase (from /proc): they share the machine's cores.
    pub server_cpu_s: Option<f64>,
    pub generator_cpu_s: Option<f64>,
    pub storm_seconds: f64,
    /// 1-minute load average at the end of the storm phase.
    pub loadavg_1m: Option<f64>,
    /// Server CPU-seconds during the peak phases.
    pub peak_server_cpu_s: Option<f64>,
    /// Certificates per server CPU-second, storm over peak: how much of the
    /// server's CPU the storm's overhead (sheds, retries) costs, whatever CPU
    /// the generator and other processes left it (target near 1).
    pub goodput_per_cpu_ratio: Option<f64>,
    pub nproc: usize,
    pub date: String,
    /// Server-side p50 / p99 of the certificates issued during the storm
    /// phase, in ms, from the server's own
    /// `meshca_request_duration_seconds{decision="allow"}` buckets scraped
    /// before and after it (see `Metrics::request_duration` for what that
    /// clock covers: admission wait included, the audit writer's
    /// acknowledgement and the response write not). Each is the upper bound
    /// of the bucket holding the quantile (buckets double from 0.1 ms), so
    /// the true value is at most this and more than half of it; `"+Inf"`
    /// when it lies above the largest bound (3,276.8 ms). None when the
    /// scrape failed, nothing was issued, or the server restarted.
    #[serde(serialize_with = "finite_or_inf")]
    pub server_p50_ms: Option<f64>,
    #[serde(serialize_with = "finite_or_inf")]
    pub server_p99_ms: Option<f64>,
}

/// One storm phase and the closed-loop peaks on either side of it.
#[derive(Debug, Clone, Serialize)]
pub struct StormRound {
    pub peak_before_per_s: f64,
    /// None after the last round without `--storm-peak-after`.
    pub peak_after_per_s: Option<f64>,
    pub offered_per_s: f64,
    /// Successes answered within this storm's window, per second of it.
    pub ok_per_s: f64,
    /// `ok_per_s` over the mean of the peaks next to it.
    pub goodput_ratio: f64,
    /// The same with each phase's rate divided by the share of the server's
    /// CPU the hypervisor did not steal in it: a correction for a VM whose
    /// steal time moves between phases (a model; `goodput_ratio` is the
    /// measurement).
    pub goodput_ratio_steal_adjusted: Option<f64>,
    /// Successes answered in each whole second of the window (the onset
    /// of overload shows in the first ones).
    pub ok_by_second: Vec<usize>,
    /// Each proxy's successes in this round (the greedy one first).
    pub ok_by_proxy: Vec<usize>,
    /// The lowest well-behaved proxy's share in this round, and which
    /// proxy (index in `per_proxy`) it was.
    pub share_min: Option<f64>,
    pub share_min_proxy: Option<usize>,
    /// Seconds each CPU was stolen by the hypervisor during this storm and
    /// during the peak after it.
    pub steal_per_cpu_s: Option<Vec<f64>>,
    pub peak_after_steal_per_cpu_s: Option<Vec<f64>>,
    /// The speed probe's signatures per second of its CPU time (on the server's CPU) during
    /// this storm and during the peak after it.
    pub probe_per_cpu_s: Option<f64>,
    pub peak_after_probe_per_cpu_s: Option<f64>,
    /// The capacity during this storm: each neighbouring peak scaled by the
    /// probe's rate in the storm over its rate in that peak (the VM's speed
    /// moves without steal time; see `super::probe`).
    pub capacity_speed_adjusted: Option<f64>,
    /// `ok_per_s / capacity_speed_adjusted`.
    pub goodput_ratio_speed_adjusted: Option<f64>,
    /// CPU-seconds the server's signing threads (CSR verify and sign) used
    /// per second of this storm's window, and of the peak after it, each
    /// with the jobs that ran inline counted at the threads' cost per job
    /// (None when more than half did).
    pub job_cpu_per_s: Option<f64>,
    pub peak_after_job_cpu_per_s: Option<f64>,
    /// Signing jobs this storm, and the peak after it, ran on the requests'
    /// own workers instead of the signing threads (below overload).
    pub inline_jobs: Option<u64>,
    pub peak_after_inline_jobs: Option<u64>,
    /// `job_cpu_per_s` over the mean of the neighbouring peaks': the
    /// server's CPU that went into certificates, storm against peak. A
    /// slower CPU makes each job take longer in both, so this does not
    /// move with the VM's speed (given the same quota used in both).
    /// None without a reading for the storm or a neighbouring peak.
    pub goodput_ratio_work: Option<f64>,
}

impl StormRound {
    /// The capacity this storm is compared with: the mean of the peaks
    /// next to it (the one before when there is none after).
    fn reference(&self) -> f64 {
        self.peak_after_per_s.map_or(self.peak_before_per_s, |a| {
            (self.peak_before_per_s + a) / 2.0
        })
    }
}

/// JSON has no infinity (serde_json would write `null`, which reads as "not
/// measured"): a quantile in the `+Inf` bucket is written as `"+Inf"`.
fn finite_or_inf<S: serde::Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(x) if x.is_infinite() => s.serialize_str("+Inf"),
        Some(x) => s.serialize_f64(*x),
        None => s.serialize_none(),
    }
}

fn rss_mib(pid: u32, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

async fn connect_one(
    args: &BenchArgs,
    bundle: &CaBundle,
    identity: Option<&(String, String)>,
) -> anyhow::Result<CaClient> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(bundle.root_bundle()))
        .domain_name(args.server_name.clone());
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let channel = Channel::from_shared(format!("https://{}", args.target))?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .await
        .with_context(|| format!("connecting to {}", args.target))?;
    Ok(IstioCertificateServiceClient::new(channel))
}

/// Builds the proxies: identities (mTLS certificates or pod-bound tokens),
/// one CSR each, one connection each (a few handshakes at a time).
async fn proxies(
    args: &BenchArgs,
    bundle: &Arc<CaBundle>,
    td: &TrustDomain,
) -> anyhow::Result<Vec<Proxy>> {
    let n = args.pods.max(2);
    // (identity, mTLS certificate and key, bearer token)
    type Spec = (String, Option<(String, String)>, Option<String>);
    let mut specs: Vec<Spec> = Vec::new();
    match args.storm_auth {
        StormAuth::Mtls => {
            for i in 0..n {
                let id = SpiffeId::new(td.clone(), "meshca-storm", &format!("node-{i}"))?;
                let ident = client_identity(bundle, &id)?;
                specs.push((id.to_string(), Some(ident), None));
            }
        }
        StormAuth::Token => {
            let path = args
                .kubeconfig
                .as_ref()
                .context("--storm-auth token needs --kubeconfig (admin)")?;
            let kube = crate::app::kube_client(Some(path)).await?;
            let mut a = args.clone();
            a.mode = Mode::Token;
            a.pods = n;
            for c in super::kube_callers(&kube, &a, td).await? {
                specs.push((c.identity, None, c.bearer));
            }
        }
    }
    eprintln!("storm: connecting {} proxies", specs.len());
    let gate = Arc::new(tokio::sync::Semaphore::new(8));
    let mut tasks = Vec::new();
    for (id, ident, bearer) in specs {
        let (args, bundle, gate) = (args.clone(), bundle.clone(), gate.clone());
        tasks.push(tokio::spawn(async move {
            let _p = gate.acquire().await;
            let csr = csr_for(&args.key_type.generate()?, &id)?;
            let client = connect_one(&args, &bundle, ident.as_ref()).await?;
            anyhow::Ok(Proxy {
                client,
                csr,
                bearer,
            })
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await??);
    }
    Ok(out)
}

fn request(
    p: &Proxy,
    deadline: Duration,
) -> anyhow::Result<tonic::Request<IstioCertificateRequest>> {
    let mut req = tonic::Request::new(IstioCertificateRequest {
        csr: p.csr.clone(),
        validity_duration: 0,
        metadata: None,
    });
    req.set_timeout(deadline);
    if let Some(t) = &p.bearer {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse()?);
    }
    Ok(req)
}

/// One request's outcome: latency in ns for a success, or the error name.
async fn one(p: &Proxy, deadline: Duration) -> Result<u64, String> {
    let start = Instant::now();
    let Ok(req) = request(p, deadline) else {
        return Err("BadRequest".into());
    };
    let mut c = p.client.clone();
    match tokio::time::timeout(deadline, c.create_certificate(req)).await {
        Err(_) => Err("ClientTimeout".into()),
        Ok(Ok(r)) if r.get_ref().cert_chain.len() >= 2 => Ok(start.elapsed().as_nanos() as u64),
        Ok(Ok(_)) => Err("BadResponse".into()),
        Ok(Err(s)) => Err(format!("{:?}", s.code())),
    }
}

/// Closed loop over the first `k` proxies, `streams` each: the successes
/// answered within the `secs` window per second of it (as the storm's
/// goodput is counted), and all successes (the last requests end after it).
async fn peak(
    proxies: &Arc<Vec<Proxy>>,
    k: usize,
    streams: usize,
    secs: f64,
    deadline: Duration,
) -> (f64, usize) {
    let stop = Instant::now() + Duration::from_secs_f64(secs);
    let (within, all) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut tasks = Vec::new();
    for i in 0..k.min(proxies.len()) {
        for _ in 0..streams {
            let (proxies, within, all) = (proxies.clone(), within.clone(), all.clone());
            tasks.push(tokio::spawn(async move {
                while Instant::now() < stop {
                    if one(&proxies[i], deadline).await.is_ok() {
                        all.fetch_add(1, Ordering::Relaxed);
                        if Instant::now() <= stop {
                            within.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
    }
    for task in tasks {
        let _ = task.await;
    }
    (
        within.load(Ordering::Relaxed) as f64 / secs.max(1e-9),
        all.load(Ordering::Relaxed),
    )
}

/// One closed-loop peak phase: its rate, its successes, the server's CPU and
/// the requests the server shed in it (a peak that sheds spends CPU on
/// requests it does not answer).
struct TimedPeak {
    per_s: f64,
    certs: usize,
    server_cpu_s: Option<f64>,
    sheds: Option<u64>,
    steal_per_cpu_s: Option<Vec<f64>>,
    probe_per_cpu_s: Option<f64>,
    /// CPU-seconds of certificate work per second of the phase
    /// ([`scrape::job_cpu_with_inline`]); None when unread.
    job_cpu_per_s: Option<f64>,
    /// Signing jobs that ran on the requests' own workers in the phase.
    inline_jobs: Option<u64>,
}

/// The signing threads' CPU-seconds per second of `secs` since the reading
/// `before` (None if either reading failed).
fn signing_cpu_per_s(pid: Option<u32>, before: Option<f64>, secs: f64) -> Option<f64> {
    let now = pid.and_then(super::signing_cpu_seconds)?;
    Some((now - before?).max(0.0) / secs.max(1e-9))
}

/// The peaks' mean CPU-seconds of signing jobs per second (None if one
/// could not be read).
fn mean_job_cpu(peaks: &[TimedPeak]) -> Option<f64> {
    let sum = peaks.iter().map(|p| p.job_cpu_per_s).sum::<Option<f64>>()?;
    Some(sum / peaks.len().max(1) as f64)
}

async fn timed_peak(
    args: &BenchArgs,
    probe: Option<&super::probe::SpeedProbe>,
    proxies: &Arc<Vec<Proxy>>,
    k: usize,
    secs: f64,
    deadline: Duration,
) -> TimedPeak {
    // Scraped outside the CPU reading: rendering /metrics is not peak work.
    let scraped = scrape(args.admin_target).await;
    let cpu0 = args.server_pid.and_then(super::proc_cpu_seconds);
    let sign0 = args.server_pid.and_then(super::signing_cpu_seconds);
    let steal0 = super::steal_seconds_per_cpu();
    let probe0 = probe.map(|p| p.mark());
    let (per_s, certs) = peak(proxies, k, args.storm_peak_streams, secs, deadline).await;
    let thread_cpu_per_s = signing_cpu_per_s(args.server_pid, sign0, secs);
    let server_cpu_s = args
        .server_pid
        .and_then(super::proc_cpu_seconds)
        .zip(cpu0)
        .map(|(a, b)| a - b);
    let steal_per_cpu_s = super::steal_since(steal0);
    let probe_per_cpu_s = probe.zip(probe0).and_then(|(p, m)| p.per_cpu_s_since(m));
    let after = scrape(args.admin_target).await;
    let (job_cpu_per_s, inline_jobs) =
        phase_work(thread_cpu_per_s, scraped.as_ref(), after.as_ref());
    TimedPeak {
        per_s,
        steal_per_cpu_s,
        probe_per_cpu_s,
        certs,
        job_cpu_per_s,
        inline_jobs,
        sheds: scraped
            .zip(after)
            .map(|(b, a)| a.sheds_since(&b).values().sum()),
        server_cpu_s,
    }
}

/// One renewal under a retrying client model: attempts (each holding one
/// of the proxy's fetch slots) until one succeeds, the model gives up, or
/// the storm ends.
async fn renewal(
    model: ClientModel,
    proxies: Arc<Vec<Proxy>>,
    i: usize,
    slots: Arc<tokio::sync::Semaphore>,
    samples: Arc<Mutex<StormSamples>>,
    (start, stop): (Instant, Instant),
    deadline: Duration,
) {
    let mut attempt = 0u32;
    loop {
        if Instant::now() >= stop {
            samples.lock().map(|mut s| s.gave_up += 1).ok();
            return;
        }
        let r = {
            let Ok(_slot) = slots.acquire().await else {
                return;
            };
            if Instant::now() >= stop {
                samples.lock().map(|mut s| s.gave_up += 1).ok();
                return;
            }
            one(&proxies[i], deadline).await
        };
        if let Ok(mut s) = samples.lock() {
            s.record(i, &r, window_second(start, stop));
        }
        let Err(outcome) = r else { return };
        let draw = crate::ca::ttl::random_draw();
        let wait = match model {
            ClientModel::Ztunnel => ztunnel_backoff(attempt, draw),
            ClientModel::Agent => match agent_backoff(attempt, &outcome, draw) {
                Some(w) => w,
                None => {
                    samples.lock().map(|mut s| s.gave_up += 1).ok();
                    return;
                }
            },
            ClientModel::Open => return,
        };
        attempt += 1;
        tokio::time::sleep(wait).await;
    }
}

/// Open loop: proxy `i` starts a request every `1/rate_i` s (random phase)
/// unless it already has its cap in flight.
async fn storm(
    proxies: &Arc<Vec<Proxy>>,
    model: ClientModel,
    rate_each: f64,
    streams: usize,
    greedy: usize,
    secs: f64,
    deadline: Duration,
) -> StormSamples {
    let samples = Arc::new(Mutex::new(StormSamples::for_proxies(proxies.len())));
    let start = Instant::now();
    let stop = start + Duration::from_secs_f64(secs);
    let mut tickers = Vec::new();
    for i in 0..proxies.len() {
        let factor = if i == 0 { greedy as f64 } else { 1.0 };
        let cap = if i == 0 { streams * greedy } else { streams };
        let period = Duration::from_secs_f64(1.0 / (rate_each * factor));
        let phase = period.mul_f64((crate::ca::ttl::random_draw() % 1000) as f64 / 1000.0);
        let (proxies, samples) = (proxies.clone(), samples.clone());
        if model != ClientModel::Open {
            // Renewals come due on the schedule; each retries on its own.
            tickers.push(tokio::spawn(async move {
                let slots = Arc::new(tokio::sync::Semaphore::new(cap));
                let mut tick = tokio::time::interval_at((Instant::now() + phase).into(), period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                let mut running = Vec::new();
                loop {
                    tick.tick().await;
                    if Instant::now() >= stop {
                        break;
                    }
                    samples.lock().map(|mut s| s.renewals += 1).ok();
                    running.push(tokio::spawn(renewal(
                        model,
                        proxies.clone(),
                        i,
                        slots.clone(),
                        samples.clone(),
                        (start, stop),
                        deadline,
                    )));
                    running.retain(|t: &tokio::task::JoinHandle<()>| !t.is_finished());
                }
                for t in running {
                    let _ = t.await;
                }
            }));
            continue;
        }
        tickers.push(tokio::spawn(async move {
            let inflight = Arc::new(AtomicUsize::new(0));
            let mut tick = tokio::time::interval_at((Instant::now() + phase).into(), period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut running = Vec::new();
            loop {
                tick.tick().await;
                if Instant::now() >= stop {
                    break;
                }
                samples.lock().map(|mut s| s.renewals += 1).ok();
                if inflight.load(Ordering::Relaxed) >= cap {
                    samples.lock().map(|mut s| s.per_proxy_skipped[i] += 1).ok();
                    continue;
                }
                inflight.fetch_add(1, Ordering::Relaxed);
                let (proxies, samples, inflight) =
                    (proxies.clone(), samples.clone(), inflight.clone());
                running.push(tokio::spawn(async move {
                    let r = one(&proxies[i], deadline).await;
                    inflight.fetch_sub(1, Ordering::Relaxed);
                    if let Ok(mut s) = samples.lock() {
                        s.record(i, &r, window_second(start, stop));
                    }
                }));
                running.retain(|t: &tokio::task::JoinHandle<()>| !t.is_finished());
            }
            for t in running {
                let _ = t.await;
            }
        }));
    }
    for t in tickers {
        let _ = t.await;
    }
    let mut s = samples
        .lock()
        .map(|mut s| std::mem::take(&mut *s))
        .unwrap_or_default();
    s.latencies.sort_unstable();
    s
}

/// A bucket bound in ms for the summary line (`-` when not measured).
fn bound_ms(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(x) if x.is_infinite() => "+Inf".into(),
        Some(x) => format!("{x:.1}"),
    }
}

/// Runs the storm scenario and prints its results.
pub async fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let r = execute(args).await?;
    eprintln!(
        "storm [{:?} clients]: goodput {:.0}/s = {:.2} of peak {:.0}/s (before {:.0}/s, after {}) (target >= 0.90), {:.2} counting the {:.2} s drain; p99 of successes {:.1} ms (target < 100), server-side p50 / p99 of issued <= {} / {} ms; well-behaved share mean {:.2} p10 {:.2} min {:.2} (target >= 0.90), sd {:.3} (counting noise {:.3}); greedy {:.2}x its share; issued-not-received {:?}; RSS {:?} -> {:?} MiB (HWM {:?})",
        r.client_model,
        r.storm_ok_per_s,
        r.goodput_ratio,
        r.peak_per_s,
        r.peak_before_per_s,
        r.peak_after_per_s
            .map_or_else(|| "not measured".into(), |p| format!("{p:.0}/s")),
        r.goodput_ratio_with_drain,
        r.drain_seconds,
        r.storm_p99_ms,
        bound_ms(r.server_p50_ms),
        bound_ms(r.server_p99_ms),
        r.fair_share_mean,
        r.fair_share_p10,
        r.fair_share_min,
        r.fair_share_sd,
        r.fair_share_counting_sd,
        r.greedy_ratio,
        r.issued_not_received,
        r.server_rss_mib_before,
        r.server_rss_mib_after,
        r.server_rss_hwm_mib,
    );
    eprintln!(
        "storm [{:?} clients]: renewals {:.0}/s, requests {:.0}/s with retries, gave up {}; CPU-s in {:.1} s: server {:.1}, generator {:.1} (of {} cores); load average {:?}; certificates per server CPU-second, storm / peak: {:?}",
        r.client_model,
        r.renewals_per_s,
        r.attempts_per_s,
        r.gave_up,
        r.storm_seconds,
        r.server_cpu_s.unwrap_or(f64::NAN),
        r.generator_cpu_s.unwrap_or(f64::NAN),
        r.nproc,
        r.loadavg_1m,
        r.goodput_per_cpu_ratio,
    );
    super::emit_json(args, &serde_json::to_string(&r)?)
}

/// Runs the storm scenario and returns its results.
pub async fn execute(args: &BenchArgs) -> anyhow::Result<StormResult> {
    if !args.target.ip().is_loopback() {
        bail!("--target {} is not a loopback address", args.target);
    }
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let td = TrustDomain::new(&args.trust_domain)?;
    let bundle = Arc::new(CaBundle::load_dir(&args.ca_dir, OffsetDateTime::now_utc())?);
    let deadline = Duration::from_millis(args.storm_deadline_ms);
    let streams = args.streams.max(1);
    let proxies = Arc::new(proxies(args, &bundle, &td).await?);
    let n = proxies.len();
    // Warm every connection (and token cache) once.
    for p in proxies.iter() {
        for _ in 0..50 {
            if one(p, Duration::from_secs(5)).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let secs = args.storm_seconds;
    // Peak: enough concurrency to keep every signing slot busy, not so much
    // that admission sheds (the sheds are counted and warned about below).
    let k = args.storm_peak_proxies.min(n);
    let per = args.storm_peak_streams;
    let rounds = args.storm_rounds.max(1);
    eprintln!("storm: peak phase, {k} proxies x {per} in flight, {secs}s");
    let probe = args
        .storm_speed_probe_cpu
        .map(super::probe::SpeedProbe::start)
        .transpose()?;
    let probe = probe.as_ref();
    let mut peaks = vec![timed_peak(args, probe, &proxies, k, secs, deadline).await];
    let mut s = StormSamples::for_proxies(n);
    let mut round_results = Vec::with_capacity(rounds);
    // Each round's reference for the signing threads' work: the mean of its peaks'.
    let mut peak_job_cpus: Vec<Option<f64>> = Vec::with_capacity(rounds);
    let (mut server_issued, mut server_shed) = (Some(0u64), BTreeMap::new());
    let mut issued_latency: Option<Vec<(f64, u64)>> = None;
    let mut latency_ok = true;
    let (mut server_cpu_s, mut generator_cpu_s) = (Some(0.0), Some(0.0));
    let (mut elapsed, mut offered_sum) = (0.0, 0.0);
    let (mut rss_before, mut rss_after) = (None, None);
    let mut loadavg_1m = None;
    // The server's CPU (it is pinned when confined), for its steal time.
    let server_cpu = args.server_pid.and_then(super::proc_last_cpu);
    let cpu = |before: Option<f64>, pid: Option<u32>| {
        Some(pid.and_then(super::proc_cpu_seconds)? - before?)
    };
    for round in 0..rounds {
        // Each storm offers the overload against the peak just before it.
        let last_peak = peaks.last().map_or(0.0, |p| p.per_s);
        let offered = last_peak * args.storm_overload;
        offered_sum += offered;
        let rate_each = offered / (n - 1 + args.storm_greedy) as f64;
        eprintln!(
            "storm: peak {last_peak:.0}/s; storm phase {}/{rounds}, {n} proxies x {streams} in flight at {offered:.0}/s offered, {secs}s",
            round + 1
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        let before = scrape(args.admin_target).await;
        if round == 0 {
            rss_before = args.server_pid.and_then(|p| rss_mib(p, "VmRSS:"));
        }
        let server_cpu0 = args.server_pid.and_then(super::proc_cpu_seconds);
        let sign0 = args.server_pid.and_then(super::signing_cpu_seconds);
        let own_cpu0 = super::proc_cpu_seconds(std::process::id());
        let steal0 = super::steal_seconds_per_cpu();
        let probe0 = probe.map(|p| p.mark());
        let t = Instant::now();
        let one_round = storm(
            &proxies,
            args.storm_client,
            rate_each,
            streams,
            args.storm_greedy,
            secs,
            deadline,
        )
        .await;
        let round_elapsed = t.elapsed().as_secs_f64();
        // Per second of the window, as `ok_per_s` (after it no new work arrives).
        let thread_cpu_per_s = signing_cpu_per_s(args.server_pid, sign0, secs);
        let steal_per_cpu_s = super::steal_since(steal0);
        let probe_per_cpu_s = probe.zip(probe0).and_then(|(p, m)| p.per_cpu_s_since(m));
        elapsed += round_elapsed;
        server_cpu_s = server_cpu_s
            .zip(cpu(server_cpu0, args.server_pid))
            .map(|(a, b)| a + b);
        // The generator's own CPU, without the speed probe's (it runs on the server's CPU).
        let probe_cpu = probe
            .zip(probe0)
            .map_or(0.0, |(p, m)| p.cpu_seconds_since(m));
        generator_cpu_s = generator_cpu_s
            .zip(cpu(own_cpu0, Some(std::process::id())))
            .map(|(a, b)| a + b - probe_cpu);
        loadavg_1m = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|l| l.split_whitespace().next()?.parse().ok());
        // Let the server finish what it admitted before counting.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let after = scrape(args.admin_target).await;
        let (job_cpu_per_s, inline_jobs) =
            phase_work(thread_cpu_per_s, before.as_ref(), after.as_ref());
        // Right after the last storm, before the peak after it, as with one round.
        rss_after = args.server_pid.and_then(|p| rss_mib(p, "VmRSS:"));
        match (&before, &after) {
            (Some(b), Some(a)) => {
                server_issued = server_issued.map(|i| i + a.issued.saturating_sub(b.issued));
                for (reason, count) in a.sheds_since(b) {
                    *server_shed.entry(reason).or_default() += count;
                }
                latency_ok &=
                    add_bucket_deltas(&mut issued_latency, &b.issued_latency, &a.issued_latency);
            }
            _ => {
                server_issued = None;
                latency_ok = false;
            }
        }
        let ok_per_s = one_round.ok_in_window as f64 / secs.max(1e-9);
        let ok_by_second = one_round.ok_by_second.clone();
        let lowest = lowest_share(&one_round.tallies());
        let ok_by_proxy = one_round.per_proxy_ok.clone();
        s.absorb(one_round);
        // The peak after this storm: always between rounds; after the last
        // one with `--storm-peak-after`. As long a pause as before the
        // storm, so that no peak starts in the wake of a storm.
        if round + 1 < rounds || args.storm_peak_after {
            tokio::time::sleep(Duration::from_secs(2)).await;
            eprintln!("storm: peak phase again, {k} proxies x {per} in flight, {secs}s");
            let p = timed_peak(args, probe, &proxies, k, secs, deadline).await;
            eprintln!("storm: peak after storm {} {:.0}/s", round + 1, p.per_s);
            peaks.push(p);
        }
        let after_peak = (peaks.len() == round + 2).then(|| peaks[round + 1].per_s);
        // The same with each rate divided by the share of the server's CPU
        // the hypervisor left it in that phase.
        let left = |steal: &Option<Vec<f64>>, window: f64| {
            let stolen = steal.as_ref()?.get(server_cpu?)?;
            Some((1.0 - stolen / window.max(1e-9)).max(0.05))
        };
        let neighbours = &peaks[round..peaks.len().min(round + 2)];
        let scaled = |storm: Option<f64>, factor: &dyn Fn(&TimedPeak) -> Option<f64>| {
            let peaks: Vec<_> = neighbours.iter().map(|p| (p.per_s, factor(p))).collect();
            super::probe::capacity_during(storm, &peaks)
        };
        let steal_adjusted = scaled(left(&steal_per_cpu_s, round_elapsed), &|p| {
            left(&p.steal_per_cpu_s, secs)
        })
        .map(|c| ok_per_s / c.max(1e-9));
        let capacity_speed_adjusted = scaled(probe_per_cpu_s, &|p| p.probe_per_cpu_s);
        let peak_job_cpu = mean_job_cpu(neighbours);
        peak_job_cpus.push(peak_job_cpu);
        let mut r = StormRound {
            peak_before_per_s: last_peak,
            peak_after_per_s: after_peak,
            offered_per_s: offered,
            ok_per_s,
            goodput_ratio: 0.0,
            goodput_ratio_steal_adjusted: steal_adjusted,
            ok_by_second,
            ok_by_proxy,
            share_min: lowest.map(|l| l.1),
            share_min_proxy: lowest.map(|l| l.0),
            steal_per_cpu_s,
            peak_after_steal_per_cpu_s: peaks
                .get(round + 1)
                .and_then(|p| p.steal_per_cpu_s.clone()),
            probe_per_cpu_s,
            peak_after_probe_per_cpu_s: peaks.get(round + 1).and_then(|p| p.probe_per_cpu_s),
            capacity_speed_adjusted,
            goodput_ratio_speed_adjusted: capacity_speed_adjusted.map(|c| ok_per_s / c.max(1e-9)),
            job_cpu_per_s,
            inline_jobs,
            peak_after_job_cpu_per_s: peaks.get(round + 1).and_then(|p| p.job_cpu_per_s),
            peak_after_inline_jobs: peaks.get(round + 1).and_then(|p| p.inline_jobs),
            goodput_ratio_work: job_cpu_per_s
                .zip(peak_job_cpu)
                .map(|(s, p)| s / p.max(1e-9)),
        };
        r.goodput_ratio = ok_per_s / r.reference().max(1e-9);
        round_results.push(r);
    }
    s.latencies.sort_unstable();
    let rss_hwm = args.server_pid.and_then(|p| rss_mib(p, "VmHWM:"));
    let ok = s.latencies.len();
    let window = secs * rounds as f64;
    // Goodput while the storm was offered: after the window no new work
    // arrives, and the streams still parked wait out their park before they
    // are refused, so the drain would count time without load.
    let storm_ok_per_s = s.ok_in_window as f64 / window.max(1e-9);
    let storm_ok_per_s_with_drain = ok as f64 / elapsed;
    // Each storm is compared with the peaks next to it: the capacity is the
    // mean of the rounds' references.
    let peak_per_s = round_results.iter().map(StormRound::reference).sum::<f64>() / rounds as f64;
    let per_proxy = s.tallies();
    let mut ratios: Vec<f64> = per_proxy[1..].iter().map(|p| p.share).collect();
    ratios.sort_by(|a, b| a.total_cmp(b));
    let mean = ratios.iter().sum::<f64>() / ratios.len().max(1) as f64;
    let p10 = ratios.get(ratios.len() / 10).copied().unwrap_or(0.0);
    let sd = (ratios.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / ratios.len().max(1) as f64)
        .sqrt();
    let fair = ok as f64 / n as f64;
    let server_q = |q: f64| quantile_ms(issued_latency.as_ref().filter(|_| latency_ok)?, q);
    for p in &peaks {
        if let Some(n) = p.sheds.filter(|&n| n as f64 > 0.01 * p.certs as f64) {
            eprintln!(
                "storm: WARNING the server shed {n} requests in a peak phase ({} issued): the peak spends CPU on requests it does not answer; lower --storm-peak-streams or --storm-peak-proxies",
                p.certs
            );
        }
    }
    let peak_certs: f64 = peaks.iter().map(|p| p.certs as f64).sum();
    let peak_server_cpu_s = peaks.iter().map(|p| p.server_cpu_s).sum::<Option<f64>>();
    let first_peak = &peaks[0];
    let after_peak = (peaks.len() > rounds).then(|| &peaks[rounds]);
    let r = StormResult {
        auth: args.storm_auth,
        client_model: args.storm_client,
        proxies: n,
        streams,
        deadline_ms: args.storm_deadline_ms,
        peak_per_s,
        peak_before_per_s: first_peak.per_s,
        peak_after_per_s: after_peak.map(|p| p.per_s),
        peak_before_sheds: first_peak.sheds,
        peak_before_steal_per_cpu_s: first_peak.steal_per_cpu_s.clone(),
        peak_before_probe_per_cpu_s: first_peak.probe_per_cpu_s,
        peak_before_inline_jobs: first_peak.inline_jobs,
        peak_after_sheds: after_peak.and_then(|p| p.sheds),
        offered_per_s: offered_sum / rounds as f64,
        goodput_ratio_steal_adjusted: round_results
            .iter()
            .map(|r| r.goodput_ratio_steal_adjusted)
            .sum::<Option<f64>>()
            .map(|sum| sum / rounds as f64),
        goodput_ratio_speed_adjusted: round_results
            .iter()
            .map(|r| r.capacity_speed_adjusted)
            .sum::<Option<f64>>()
            .map(|sum| storm_ok_per_s / (sum / rounds as f64).max(1e-9)),
        goodput_ratio_work: round_results
            .iter()
            .map(|r| r.job_cpu_per_s)
            .sum::<Option<f64>>()
            .zip(peak_job_cpus.iter().copied().sum::<Option<f64>>())
            .map(|(storms, peaks)| storms / peaks.max(1e-9)),
        rounds: round_results,
        storm_ok_per_s,
        goodput_ratio: storm_ok_per_s / peak_per_s.max(1e-9),
        storm_ok_per_s_with_drain,
        goodput_ratio_with_drain: storm_ok_per_s_with_drain / peak_per_s.max(1e-9),
        drain_seconds: ((elapsed - window) / rounds as f64).max(0.0),
        storm_p50_ms: percentile(&s.latencies, 50.0),
        storm_p99_ms: percentile(&s.latencies, 99.0),
        storm_max_ms: percentile(&s.latencies, 100.0),
        outcomes: s.outcomes,
        skipped_at_cap: s.per_proxy_skipped.iter().sum(),
        fair_share_mean: mean,
        fair_share_p10: p10,
        fair_share_sd: sd,
        fair_share_counting_sd: 1.0 / fair.max(1.0).sqrt(),
        fair_share_min: ratios.first().copied().unwrap_or(0.0),
        greedy_ratio: per_proxy[0].share,
        per_proxy,
        server_issued,
        server_shed,
        issued_not_received: server_issued.map(|i| i as i64 - ok as i64),
        server_rss_mib_before: rss_before,
        server_rss_mib_after: rss_after,
        server_rss_hwm_mib: rss_hwm,
        renewals_per_s: s.renewals as f64 / window.max(1e-9),
        attempts_per_s: s.attempts as f64 / elapsed,
        gave_up: s.gave_up,
        server_cpu_s,
        generator_cpu_s,
        storm_seconds: elapsed,
        loadavg_1m,
        peak_server_cpu_s,
        goodput_per_cpu_ratio: match (peak_server_cpu_s, server_cpu_s) {
            (Some(pc), Some(sc)) if pc > 0.0 && sc > 0.0 => {
                Some((ok as f64 / sc) / (peak_certs / pc))
            }
            _ => None,
        },
        nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
        date: OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default(),
        server_p50_ms: server_q(0.50),
        server_p99_ms: server_q(0.99),
    };
    Ok(r)
}

mod samples;
mod scrape;

#[cfg(test)]
mod tests;
