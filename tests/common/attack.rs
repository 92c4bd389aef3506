//! Harness for the adversarial suite (tests/adversarial.rs): the real release
//! binary under `serve --dev`, a well-behaved mTLS client measuring latency,
//! RSS sampling from /proc, and attack clients bound to 127.0.0.x sources.
//! Everything talks to 127.0.0.1 only and every attack is bounded in count
//! and time by its caller.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rcgen::KeyPair;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// The chart's memory limit (charts/meshca/values.yaml `resources.limits.memory`).
pub const MEMORY_LIMIT_BYTES: u64 = 256 * 1024 * 1024;
/// The good client's p99 bound. Generous on purpose: the suite runs on two
/// shared, loaded cores next to the attack clients; an unprotected server
/// shows up as errors or multi-second stalls, not as a few hundred ms.
pub const GOOD_P99_BOUND: Duration = Duration::from_secs(2);
/// One good request may take this long before it counts as an error.
pub const GOOD_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Audit line cap when the binary has no `--audit-max-line-bytes` flag.
pub const DEFAULT_AUDIT_LINE_CAP: usize = 16 * 1024;

/// Attack sources: loopback addresses other than the good client's 127.0.0.1,
/// so per-source-IP caps see several attackers and spare the good client.
pub fn attacker_ips() -> Vec<IpAddr> {
    (2..=5)
        .map(|i| IpAddr::V4(Ipv4Addr::new(127, 0, 0, i)))
        .collect()
}

/// The release binary under test: $MESHCA_RELEASE_BIN, else
/// $CARGO_TARGET_DIR/release/meshca, else target/release/meshca. Missing is a
/// failure, never a skip.
pub fn release_bin() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    if let Some(p) = std::env::var_os("MESHCA_RELEASE_BIN") {
        let p = manifest.join(p);
        assert!(
            p.is_file(),
            "MESHCA_RELEASE_BIN={} does not exist",
            p.display()
        );
        return p;
    }
    let mut candidates = Vec::new();
    if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
        candidates.push(manifest.join(t).join("release/meshca"));
    }
    candidates.push(manifest.join("target/release/meshca"));
    let bin = candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "the adversarial suite needs the release binary and found none at {candidates:?}: \
                 run `cargo build --release --bin meshca` first (scripts/test does), \
                 or set MESHCA_RELEASE_BIN"
            )
        });
    warn_if_stale(&bin, manifest);
    bin
}

/// A binary older than the sources tests old code: say so loudly.
fn warn_if_stale(bin: &Path, manifest: &Path) {
    fn newest(dir: &Path, acc: &mut Option<std::time::SystemTime>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                newest(&p, acc);
            } else if let Ok(m) = e.metadata().and_then(|m| m.modified()) {
                if acc.is_none_or(|a| m > a) {
                    *acc = Some(m);
                }
            }
        }
    }
    let mut src = None;
    newest(&manifest.join("src"), &mut src);
    let built = std::fs::metadata(bin).and_then(|m| m.modified()).ok();
    if let (Some(src), Some(built)) = (src, built) {
        if src > built {
            eprintln!(
                "WARNING: {} is older than src/: rebuild with `cargo build --release --bin meshca`",
                bin.display()
            );
        }
    }
}

/// Raises this process's open-file soft limit to its hard limit (the attacks
/// hold thousands of sockets; the server child inherits the limit).
pub fn raise_nofile() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut lim = getrlimit(Resource::Nofile);
    lim.current = lim.maximum;
    let _ = setrlimit(Resource::Nofile, lim);
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// Whether `flag` appears in `meshca serve --help`.
pub fn serve_has_flag(bin: &Path, flag: &str) -> Option<String> {
    let out = std::process::Command::new(bin)
        .args(["serve", "--help"])
        .output()
        .expect("meshca serve --help");
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    let at = help.find(flag)?;
    Some(help[at..].to_string())
}

/// The audit line cap the server enforces: the default of
/// `--audit-max-line-bytes` when the binary has the flag, else 16 KiB.
pub fn audit_line_cap(bin: &Path) -> usize {
    serve_has_flag(bin, "--audit-max-line-bytes")
        .and_then(|h| {
            let d = h.find("[default: ")?;
            let rest = &h[d + "[default: ".len()..];
            rest[..rest.find(']')?].trim().parse().ok()
        })
        .unwrap_or(DEFAULT_AUDIT_LINE_CAP)
}

/// A running `meshca serve --dev` (release binary) with a file audit sink.
pub struct Server {
    pub bin: PathBuf,
    pub child: tokio::process::Child,
    pub pid: u32,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub data: tempfile::TempDir,
    pub stderr_tail: Arc<Mutex<std::collections::VecDeque<String>>>,
}

impl Server {
    pub async fn start(extra: &[&str]) -> Self {
        let bin = release_bin();
        let data = tempfile::tempdir().expect("tempdir");
        let audit = data.path().join("audit/audit.log");
        std::fs::create_dir_all(audit.parent().expect("parent")).expect("audit dir");
        let mut child = meshca::testing::serve_dev_command(&bin, data.path())
            .args(["--audit-sink", "file", "--audit-file"])
            .arg(&audit)
            .args(extra)
            .env("RUST_LOG", "info")
            .spawn()
            .expect("spawn meshca");
        let pid = child.id().expect("pid");
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let tail = Arc::new(Mutex::new(std::collections::VecDeque::new()));
        let (addr, admin) = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(line) = lines.next_line().await.expect("stderr") {
                if let Some(rest) = line.strip_prefix("listening on ") {
                    // "listening on A (gRPC), B (health)"
                    let mut it = rest.split(' ');
                    let a = it.next().expect("addr").parse().expect("addr");
                    let b = it.nth(1).expect("admin").parse().expect("admin");
                    return (a, b);
                }
                eprintln!("meshca: {line}");
            }
            panic!("meshca exited before listening");
        })
        .await
        .expect("meshca starts within 60 s");
        let t = tail.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let mut t = t.lock().expect("tail");
                if t.len() == 50 {
                    t.pop_front();
                }
                t.push_back(line);
            }
        });
        Self {
            bin,
            child,
            pid,
            addr,
            admin,
            data,
            stderr_tail: tail,
        }
    }

    pub fn dev_client_file(&self, f: &str) -> String {
        std::fs::read_to_string(self.data.path().join("dev-client").join(f)).expect("dev-client")
    }

    pub fn root_pem(&self) -> String {
        self.dev_client_file("root-cert.pem")
    }

    /// (VmRSS, VmHWM) in bytes.
    pub fn memory(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid))
            .unwrap_or_else(|e| panic!("meshca (pid {}) is gone: {e}", self.pid));
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|kb| kb * 1024)
                .unwrap_or(0)
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// Panics with the server's last log lines if it has exited.
    pub fn assert_alive(&mut self, when: &str) {
        if let Ok(Some(status)) = self.child.try_wait() {
            let tail: Vec<_> = self
                .stderr_tail
                .lock()
                .expect("tail")
                .iter()
                .cloned()
                .collect();
            panic!(
                "meshca exited ({status}) {when}; last log lines:\n{}",
                tail.join("\n")
            );
        }
    }

    /// Still serving: a fresh mTLS connection gets a certificate and the
    /// health port answers.
    pub async fn assert_serving(&mut self, when: &str) {
        self.assert_alive(when);
        let good = GoodIdentity::from_server(self);
        let t = Instant::now();
        let r = tokio::time::timeout(GOOD_REQUEST_TIMEOUT, good.fresh_request(self.addr)).await;
        assert!(
            matches!(r, Ok(Ok(()))),
            "meshca does not issue on a fresh connection {when}: {r:?} after {:?}",
            t.elapsed()
        );
        let h = tokio::time::timeout(
            Duration::from_secs(10),
            meshca::testing::http_get(self.admin, "/healthz"),
        )
        .await;
        assert!(
            matches!(h, Ok((200, _))),
            "health port does not answer {when}: {h:?}"
        );
    }

    /// Stops the server with SIGTERM (a clean shutdown writes a final
    /// checkpoint), then checks the audit log end to end with the binary's
    /// own `audit verify --strict` and returns (longest line, lines, verify output).
    pub async fn stop_and_verify_audit(mut self) -> AuditSummary {
        self.assert_alive("before shutdown");
        let kill = std::process::Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()
            .expect("kill");
        assert!(kill.success());
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("meshca stops within 30 s of SIGTERM")
            .expect("wait");
        assert!(
            status.success(),
            "meshca exit status after SIGTERM: {status}"
        );
        let dir = self.data.path().join("audit");
        // Oldest first: audit.log.N ... audit.log.1, audit.log.
        let mut rotated: Vec<(u32, PathBuf)> = std::fs::read_dir(&dir)
            .expect("audit dir")
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let n = name.strip_prefix("audit.log.")?.parse().ok()?;
                Some((n, e.path()))
            })
            .collect();
        rotated.sort_by_key(|r| std::cmp::Reverse(r.0));
        let mut files: Vec<PathBuf> = rotated.into_iter().map(|(_, p)| p).collect();
        files.push(dir.join("audit.log"));
        let (mut longest, mut lines, mut bytes) = (0usize, 0usize, 0u64);
        let mut reasons = std::collections::BTreeMap::new();
        for f in &files {
            let data = std::fs::read(f).expect("audit file");
            bytes += data.len() as u64;
            for l in data.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                longest = longest.max(l.len());
                lines += 1;
                let r = serde_json::from_slice(l)
                    .ok()
                    .and_then(|v| reason_of(&v))
                    .unwrap_or_else(|| "(checkpoint or unparsable)".into());
                *reasons.entry(r).or_insert(0) += 1;
            }
        }
        let out = std::process::Command::new(&self.bin)
            .args(["audit", "verify", "--strict"])
            .args(&files)
            .output()
            .expect("audit verify");
        let report = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "`meshca audit verify --strict` fails on the audit log:\n{report}"
        );
        AuditSummary {
            longest_line: longest,
            lines,
            bytes,
            files: files.len(),
            verify: report.lines().next().unwrap_or_default().to_string(),
            reasons,
        }
    }
}

#[derive(Debug)]
pub struct AuditSummary {
    pub longest_line: usize,
    pub lines: usize,
    pub bytes: u64,
    pub files: usize,
    pub verify: String,
    /// Audit records by reason code.
    pub reasons: std::collections::BTreeMap<String, usize>,
}

/// The first `reason` string anywhere in an audit line's JSON.
fn reason_of(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::Object(m) => m
            .get("reason")
            .and_then(|r| r.as_str().map(str::to_string))
            .or_else(|| m.values().find_map(reason_of)),
        _ => None,
    }
}

/// The dev-client identity `serve --dev` writes, and a CSR for it.
#[derive(Clone)]
pub struct GoodIdentity {
    root: String,
    chain: String,
    key: String,
    csr: String,
}

pub const GOOD_ID: &str = "spiffe://cluster.local/ns/default/sa/default";

impl GoodIdentity {
    pub fn from_server(s: &Server) -> Self {
        let key = KeyPair::generate().expect("key");
        Self {
            root: s.root_pem(),
            chain: s.dev_client_file("cert-chain.pem"),
            key: s.dev_client_file("key.pem"),
            csr: meshca::testing::csr_for(&key, GOOD_ID),
        }
    }

    pub async fn client(
        &self,
        addr: SocketAddr,
    ) -> anyhow::Result<
        meshca::proto::istio_certificate_service_client::IstioCertificateServiceClient<
            tonic::transport::Channel,
        >,
    > {
        Ok(meshca::testing::client(addr, &self.root, Some((&self.chain, &self.key))).await?)
    }

    pub fn request(&self) -> meshca::proto::IstioCertificateRequest {
        meshca::testing::request(self.csr.clone(), 0, &[])
    }

    /// One request on a new connection (a new TLS handshake).
    pub async fn fresh_request(&self, addr: SocketAddr) -> anyhow::Result<()> {
        let mut c = self.client(addr).await?;
        let chain = c.create_certificate(self.request()).await?.into_inner();
        anyhow::ensure!(chain.cert_chain.len() >= 2, "short chain");
        Ok(())
    }
}

/// What the good client saw during one attack.
#[derive(Debug, Default)]
pub struct GoodStats {
    pub ok: usize,
    pub errors: Vec<String>,
    pub latencies: Vec<Duration>,
    /// One request per second on a fresh connection (new TLS handshake).
    pub fresh_ok: usize,
    pub fresh_errors: Vec<String>,
    pub fresh_latencies: Vec<Duration>,
}

fn percentile(v: &[Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let mut s = v.to_vec();
    s.sort();
    let i = ((s.len() as f64 * p).ceil() as usize).clamp(1, s.len()) - 1;
    s[i]
}

impl GoodStats {
    pub fn p50(&self) -> Duration {
        percentile(&self.latencies, 0.50)
    }
    pub fn p99(&self) -> Duration {
        percentile(&self.latencies, 0.99)
    }
    pub fn max(&self) -> Duration {
        self.latencies.iter().max().copied().unwrap_or_default()
    }
    pub fn fresh_p99(&self) -> Duration {
        percentile(&self.fresh_latencies, 0.99)
    }
}

/// A well-behaved mTLS client requesting certificates back to back on its own
/// connection, plus one fresh-connection request a second, until stopped.
pub struct GoodClient {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<GoodStats>,
}

impl GoodClient {
    pub async fn start(server: &Server) -> Self {
        let id = GoodIdentity::from_server(server);
        let addr = server.addr;
        let mut client = id.client(addr).await.expect("good client connects");
        // Warm up: the connection is established before the attack starts.
        client
            .create_certificate(id.request())
            .await
            .expect("good client's first request");
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let task = tokio::spawn(async move {
            let stats = Arc::new(Mutex::new(GoodStats::default()));
            let (fs, fstop, fid) = (stats.clone(), s.clone(), id.clone());
            let fresh = tokio::spawn(async move {
                while !fstop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    let r =
                        tokio::time::timeout(GOOD_REQUEST_TIMEOUT, fid.fresh_request(addr)).await;
                    let el = t.elapsed();
                    {
                        let mut st = fs.lock().expect("stats");
                        match r {
                            Ok(Ok(())) => {
                                st.fresh_ok += 1;
                                st.fresh_latencies.push(el);
                            }
                            Ok(Err(e)) => st.fresh_errors.push(format!("{e:#} after {el:?}")),
                            Err(_) => st.fresh_errors.push(format!("timed out after {el:?}")),
                        }
                    }
                    tokio::time::sleep(Duration::from_secs(1).saturating_sub(el)).await;
                }
            });
            while !s.load(Ordering::Relaxed) {
                let t = Instant::now();
                let r = tokio::time::timeout(
                    GOOD_REQUEST_TIMEOUT,
                    client.create_certificate(id.request()),
                )
                .await;
                let el = t.elapsed();
                {
                    let mut st = stats.lock().expect("stats");
                    match r {
                        Ok(Ok(resp)) if resp.get_ref().cert_chain.len() >= 2 => {
                            st.ok += 1;
                            st.latencies.push(el);
                        }
                        Ok(Ok(_)) => st.errors.push("short chain".into()),
                        Ok(Err(e)) => {
                            st.errors
                                .push(format!("{:?}: {} after {el:?}", e.code(), e.message()))
                        }
                        Err(_) => st.errors.push(format!("timed out after {el:?}")),
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let _ = fresh.await;
            Arc::try_unwrap(stats)
                .map(|m| m.into_inner().expect("stats"))
                .unwrap_or_default()
        });
        Self { stop, task }
    }

    pub async fn stop(self) -> GoodStats {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("good client task")
    }
}

/// Samples the server's VmRSS until stopped; returns the peak.
pub struct RssSampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

impl RssSampler {
    pub fn start(server: &Server) -> Self {
        let pid = server.pid;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let task = tokio::spawn(async move {
            let mut peak = 0;
            while !s.load(Ordering::Relaxed) {
                if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
                    let rss = status
                        .lines()
                        .find_map(|l| l.strip_prefix("VmRSS:"))
                        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                        .unwrap_or(0)
                        * 1024;
                    peak = peak.max(rss);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            peak
        });
        Self { stop, task }
    }

    pub async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("sampler")
    }
}

/// Counters an attack reports.
#[derive(Debug, Default)]
pub struct AttackStats {
    /// TCP connections attempted.
    pub attempted: AtomicUsize,
    /// TCP connects that succeeded.
    pub connected: AtomicUsize,
    /// TCP connects that failed or timed out.
    pub connect_failed: AtomicUsize,
    /// Connections that completed TLS (where the attack does a handshake).
    pub tls_ok: AtomicUsize,
    /// Connections the server closed (EOF, reset, GOAWAY) before the attack ended.
    pub closed_by_server: AtomicUsize,
    /// Streams opened (HEADERS sent).
    pub streams_opened: AtomicUsize,
    /// Streams the server answered or reset before the attack ended.
    pub streams_answered: AtomicUsize,
    /// Streams the client could not open (stream limit reached, connection gone).
    pub streams_blocked: AtomicUsize,
    /// Requests the server refused with a gRPC error (field attacks).
    pub refused: AtomicUsize,
    /// Requests the server accepted (must stay 0 for field attacks).
    pub accepted: AtomicUsize,
    /// Side probes (e.g. /healthz during the admin slowloris) that succeeded / failed.
    pub probes_ok: AtomicUsize,
    pub probes_failed: AtomicUsize,
    /// Refusals with a gRPC code that does not name the problem.
    pub imprecise_codes: AtomicUsize,
}

pub fn n(a: &AtomicUsize) -> usize {
    a.load(Ordering::Relaxed)
}

impl AttackStats {
    pub fn inc(a: &AtomicUsize) {
        a.fetch_add(1, Ordering::Relaxed);
    }
    pub fn held(&self) -> usize {
        n(&self.connected).saturating_sub(n(&self.closed_by_server))
    }
}

/// TCP connect from `src` to `dst` within `timeout`.
pub async fn connect_from(src: IpAddr, dst: SocketAddr, timeout: Duration) -> Option<TcpStream> {
    let sock = tokio::net::TcpSocket::new_v4().ok()?;
    sock.bind(SocketAddr::new(src, 0)).ok()?;
    tokio::time::timeout(timeout, sock.connect(dst))
        .await
        .ok()?
        .ok()
}

/// A TLS client config trusting the dev root, ALPN h2, no client certificate.
pub fn attacker_tls(root_pem: &str) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(root_pem.as_bytes()) {
        roots.add(c.expect("root pem")).expect("root");
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(cfg)
}

/// The bytes of a real ClientHello for `localhost`.
pub fn client_hello(cfg: &Arc<rustls::ClientConfig>) -> Vec<u8> {
    let mut conn = rustls::ClientConnection::new(
        cfg.clone(),
        ServerName::try_from("localhost").expect("name"),
    )
    .expect("client connection");
    let mut out = Vec::new();
    conn.write_tls(&mut out).expect("client hello");
    out
}

/// TCP + TLS (no client certificate) from `src`.
pub async fn tls_from(
    src: IpAddr,
    dst: SocketAddr,
    cfg: &Arc<rustls::ClientConfig>,
    stats: &AttackStats,
) -> Option<tokio_rustls::client::TlsStream<TcpStream>> {
    AttackStats::inc(&stats.attempted);
    let Some(tcp) = connect_from(src, dst, Duration::from_secs(5)).await else {
        AttackStats::inc(&stats.connect_failed);
        return None;
    };
    AttackStats::inc(&stats.connected);
    let tls = tokio_rustls::TlsConnector::from(cfg.clone());
    match tokio::time::timeout(
        Duration::from_secs(15),
        tls.connect(ServerName::try_from("localhost").expect("name"), tcp),
    )
    .await
    {
        Ok(Ok(s)) => {
            AttackStats::inc(&stats.tls_ok);
            Some(s)
        }
        _ => {
            AttackStats::inc(&stats.closed_by_server);
            None
        }
    }
}

/// Waits until the peer closes `r` (EOF or error), discarding what it sends.
pub async fn until_closed<R: tokio::io::AsyncRead + Unpin>(r: &mut R) {
    let mut buf = [0u8; 4096];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// Writes `payload` one byte every `every` until `deadline`, looping; returns
/// true if the server closed the connection first.
pub async fn trickle(
    mut tcp: TcpStream,
    payload: &[u8],
    every: Duration,
    deadline: Instant,
) -> bool {
    let (mut r, mut w) = tcp.split();
    let writer = async {
        let mut i = 0;
        loop {
            if w.write_all(&payload[i % payload.len()..][..1])
                .await
                .is_err()
            {
                return;
            }
            i += 1;
            tokio::time::sleep(every).await;
        }
    };
    tokio::select! {
        _ = until_closed(&mut r) => true,
        _ = writer => true,
        _ = tokio::time::sleep_until(deadline.into()) => false,
    }
}

/// Random bytes.
pub fn random(len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    aws_lc_rs::rand::fill(&mut b).expect("rand");
    b
}

/// The gRPC path of CreateCertificate.
pub const CREATE_PATH: &str = "/istio.v1.auth.IstioCertificateService/CreateCertificate";

/// A gRPC request head for CreateCertificate, as any client sends.
pub fn grpc_head(addr: SocketAddr) -> http::Request<()> {
    http::Request::builder()
        .method("POST")
        .uri(format!("https://localhost:{}{CREATE_PATH}", addr.port()))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("request")
}

/// One figure row for the report.
pub struct Figures<'a> {
    pub attack: &'a str,
    pub peak_rss: u64,
    pub hwm: u64,
    pub good: &'a GoodStats,
    pub stats: &'a AttackStats,
    pub audit: &'a AuditSummary,
    pub refusals: &'a std::collections::BTreeMap<String, u64>,
    pub elapsed: Duration,
}

impl std::fmt::Display for Figures<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let s = self.stats;
        write!(
            f,
            "FIGURES | {} | RSS peak {:.1} MiB (HWM {:.1}) | good: {} ok / {} err, p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms | fresh-conn: {} ok / {} err, p99 {:.1} ms | attack: {} attempted, {} connected, {} connect-failed, {} tls, {} closed by server, {} held at end, streams {} opened / {} answered / {} blocked, requests {} refused / {} accepted, probes {} ok / {} failed | server refusals {:?} | audit: {} lines, longest {} B, {} file(s), reasons {:?}, {} | {:.1} s",
            self.attack,
            mib(self.peak_rss),
            mib(self.hwm),
            self.good.ok,
            self.good.errors.len(),
            ms(self.good.p50()),
            ms(self.good.p99()),
            ms(self.good.max()),
            self.good.fresh_ok,
            self.good.fresh_errors.len(),
            ms(self.good.fresh_p99()),
            n(&s.attempted),
            n(&s.connected),
            n(&s.connect_failed),
            n(&s.tls_ok),
            n(&s.closed_by_server),
            s.held(),
            n(&s.streams_opened),
            n(&s.streams_answered),
            n(&s.streams_blocked),
            n(&s.refused),
            n(&s.accepted),
            n(&s.probes_ok),
            n(&s.probes_failed),
            self.refusals,
            self.audit.lines,
            self.audit.longest_line,
            self.audit.files,
            self.audit.reasons,
            self.audit.verify,
            self.elapsed.as_secs_f64(),
        )
    }
}

/// A plain HTTP/1.1 GET against the admin port from 127.0.0.1: the status
/// code, or None if the connection failed (never panics: used as a probe).
pub async fn try_http_get(addr: SocketAddr, path: &str) -> Option<u16> {
    try_http_get_body(addr, path).await.map(|(s, _)| s)
}

/// As [`try_http_get`], with the response body.
pub async fn try_http_get_body(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).await.ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: meshca\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

/// Non-zero `meshca_transport_refusals` counters from /metrics, by reason
/// (empty when the binary has no such metric).
pub async fn refusals(admin: SocketAddr) -> std::collections::BTreeMap<String, u64> {
    let body = tokio::time::timeout(
        Duration::from_secs(10),
        try_http_get_body(admin, "/metrics"),
    )
    .await
    .ok()
    .flatten()
    .map(|(_, b)| b)
    .unwrap_or_default();
    body.lines()
        .filter(|l| l.starts_with("meshca_transport_refusals"))
        .filter_map(|l| {
            let reason = l.split("reason=\"").nth(1)?.split('"').next()?.to_string();
            let v: f64 = l.rsplit(' ').next()?.parse().ok()?;
            (v > 0.0).then_some((reason, v as u64))
        })
        .collect()
}
