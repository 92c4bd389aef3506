//! Idle connections: what holding many mTLS connections costs the server.
//!
//! A mesh keeps a connection to its CA from every node proxy and sidecar
//! agent; most of the time they are idle. This mode opens `--connections`
//! mTLS HTTP/2 connections as the renewal identity, makes one
//! CreateCertificate on each (so TLS, HTTP/2 and the server's per-connection
//! state are all set up and warm), holds them idle for `--max-seconds`, and
//! reads the server's resident memory (`/proc/PID/status`) along the way.
//! The server must allow that many connections from one IP
//! (`--max-connections`, `--max-connections-per-ip`), and both processes
//! need that many file descriptors (`ulimit -n`).

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use time::OffsetDateTime;

use super::{call, connect, generate_logged, request_for, BenchArgs, Mode, Plan};
use crate::ca::CaBundle;
use crate::identity::TrustDomain;

/// One idle-connections measurement (printed as a JSON line).
#[derive(Debug, Serialize)]
pub struct IdleResult {
    pub label: String,
    pub mode: &'static str,
    pub connections: usize,
    /// Connections whose one request succeeded.
    pub ok: usize,
    pub open_seconds: f64,
    /// Server RSS with one warm connection.
    pub rss_one_kib: u64,
    /// Server RSS once every connection has made its request.
    pub rss_all_kib: u64,
    /// Server RSS after holding them idle for `--max-seconds`.
    pub rss_idle_kib: u64,
    /// `(rss_idle - rss_one) / (connections - 1)`: what one more idle
    /// connection costs the server.
    pub marginal_bytes_per_connection: f64,
    pub server_cpu_s_while_idle: Option<f64>,
}

/// Resident set size of `pid` in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

pub async fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let result = measure(args).await?;
    eprintln!(
        "bench: {} idle mTLS connections ({} ok, opened in {:.1}s): server RSS {} KiB with one, {} KiB with all, {} KiB after {}s idle: {:.0} B per connection",
        result.connections,
        result.ok,
        result.open_seconds,
        result.rss_one_kib,
        result.rss_all_kib,
        result.rss_idle_kib,
        args.max_seconds,
        result.marginal_bytes_per_connection
    );
    super::emit_json(args, &serde_json::to_string(&result)?)
}

pub(crate) async fn measure(args: &BenchArgs) -> anyhow::Result<IdleResult> {
    if !args.target.ip().is_loopback() {
        bail!("--target {} is not a loopback address", args.target);
    }
    let pid = args
        .server_pid
        .context("--mode idle-connections needs --server-pid to read the server's memory")?;
    if args.connections < 2 {
        bail!("--connections must be at least 2");
    }
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let td = TrustDomain::new(&args.trust_domain)?;
    let bundle = CaBundle::load_dir(&args.ca_dir, OffsetDateTime::now_utc())
        .with_context(|| format!("loading {}", args.ca_dir.display()))?;
    let mut a = args.clone();
    a.mode = Mode::MtlsRenewal;
    let plan = Plan::build(&a, &bundle, &td).await?;
    let nproc = std::thread::available_parallelism().map_or(1, |n| n.get());
    let csrs = generate_logged(&plan, a.key_type, 0, args.connections, nproc)?;

    a.connections = 1;
    let mut clients = connect(&a, &bundle, &plan).await?;
    let first = request_for(&plan, 0, csrs[0].clone(), args.validity_seconds)?;
    call(&mut clients[0], first)
        .await
        .map_err(|e| anyhow::anyhow!("the first request failed: {e}"))?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_one = rss_kib(pid).context("reading the server's RSS")?;

    let started = Instant::now();
    let mut ok = 1;
    for (i, csr) in csrs.iter().enumerate().skip(1) {
        let mut c = connect(&a, &bundle, &plan)
            .await
            .with_context(|| format!("opening connection {} of {}", i + 1, args.connections))?;
        if call(
            &mut c[0],
            request_for(&plan, i, csr.clone(), args.validity_seconds)?,
        )
        .await
        .is_ok()
        {
            ok += 1;
        }
        clients.extend(c);
        if (i + 1) % 1000 == 0 {
            eprintln!("bench: {} connections open", i + 1);
        }
    }
    let open_seconds = started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_all = rss_kib(pid).context("reading the server's RSS")?;
    let cpu0 = super::proc_cpu_seconds(pid);
    tokio::time::sleep(Duration::from_secs_f64(args.max_seconds)).await;
    let rss_idle = rss_kib(pid).context("reading the server's RSS")?;
    let cpu = cpu0.and_then(|c0| Some(super::proc_cpu_seconds(pid)? - c0));
    drop(clients);
    Ok(IdleResult {
        label: args.label.clone(),
        mode: "idle-connections",
        connections: args.connections,
        ok,
        open_seconds,
        rss_one_kib: rss_one,
        rss_all_kib: rss_all,
        rss_idle_kib: rss_idle,
        marginal_bytes_per_connection: (rss_idle.saturating_sub(rss_one) * 1024) as f64
            / (args.connections - 1) as f64,
        server_cpu_s_while_idle: cpu,
    })
}
