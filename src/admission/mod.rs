//! Admission in front of signing: who may start CPU-heavy work (CSR verify
//! and sign) now, who waits, and who is shed, cheaply and with a pushback.
//!
//! - A global bound on running work, sized from the cores, with a bounded
//!   queue that is fair across callers ([`queue`]) and deadline-aware: work
//!   whose caller's `grpc-timeout` has passed (or will before it could
//!   answer) never starts, and a cancelled caller leaves the queue at once.
//! - Before authentication, new callers (no cached token review, no client
//!   certificate) are shed first while the queue is busy, and each source IP
//!   has a budget of such requests: a storm of unknown tokens cannot take
//!   the slots of callers already known.
//! - An optional per-identity issuance cap.
//!
//! Every shed has a stable reason (audit record and metrics) and a retry
//! hint. Decisions are plain functions in [`decide`].

pub mod decide;
pub mod fair;
pub mod metrics;
pub mod queue;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::authn::Familiarity;
use crate::flags::ConfigError;
use crate::primitives::lock;
use crate::ratelimit::TokenBucket;
pub use queue::{FairQueue, PoolConfig};

/// What admission reports: sheds by reason, slots in use and waiters after
/// each change, and the sizing before each signing job. The server's metrics
/// implement it (`metrics` here), so admission imports none.
pub trait AdmissionObserver: Send + Sync + std::fmt::Debug {
    fn shed(&self, reason: ShedReason);
    fn occupancy(&self, running: usize, queued: usize);
    /// The sized queue bound, the per-connection share of streams, and the
    /// mean service time of one signing job once measured.
    fn sizing(&self, queued: usize, per_connection: usize, service: Option<Duration>);
    /// A signing job ran to its end, on the caller's own worker (`inline`)
    /// or on a signing thread.
    fn job_done(&self, inline: bool);
}

/// Why a request was shed. Each is retryable: the caller is not at fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ShedReason {
    #[error("the signing queue is full")]
    QueueFull,
    #[error("displaced from the signing queue by a caller holding less of it")]
    QueueDisplaced,
    #[error("the caller's deadline passed (or would before an answer) while waiting")]
    DeadlineExceeded,
    #[error("new callers are shed while the signing queue is busy")]
    NewCallerWhileBusy,
    #[error("the source IP's budget for unauthenticated requests is spent")]
    SourceBudget,
    #[error("the identity reached its issuance cap for this window")]
    IdentityCap,
    #[error("too many identities are being counted by the issuance cap")]
    IdentityCapTableFull,
    /// Checked after the CSR was verified, right before signing.
    #[error("the caller's deadline passed before its certificate was signed")]
    DeadlineBeforeSign,
    /// Waited past the queue target (since its headers arrived) while
    /// requests kept arriving.
    #[error("waited for the signing queue past its target while newer work arrived")]
    QueueTimeout,
}

impl ShedReason {
    pub const ALL: [ShedReason; 9] = [
        Self::QueueFull,
        Self::QueueDisplaced,
        Self::DeadlineExceeded,
        Self::NewCallerWhileBusy,
        Self::SourceBudget,
        Self::IdentityCap,
        Self::IdentityCapTableFull,
        Self::DeadlineBeforeSign,
        Self::QueueTimeout,
    ];

    pub fn reason(&self) -> &'static str {
        match self {
            Self::QueueFull => "admission_queue_full",
            Self::QueueDisplaced => "admission_queue_displaced",
            Self::DeadlineExceeded => "admission_deadline_exceeded",
            Self::NewCallerWhileBusy => "admission_new_caller_busy",
            Self::SourceBudget => "admission_source_budget",
            Self::IdentityCap => "admission_identity_cap",
            Self::IdentityCapTableFull => "admission_identity_cap_table_full",
            Self::DeadlineBeforeSign => "admission_deadline_before_sign",
            Self::QueueTimeout => "admission_queue_timeout",
        }
    }
}

/// A shed request: why, and when to come back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("shed: {reason} (retry in {retry_after:?})")]
pub struct Shed {
    pub reason: ShedReason,
    pub retry_after: Duration,
}

/// Per-identity issuance cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdentityCap {
    pub max: u32,
    pub window: Duration,
}

/// Admission settings, parsed once at startup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// CSR verifications and signatures running at once.
    pub max_running: usize,
    /// Requests waiting for a slot, all callers together.
    pub max_queued: usize,
    /// Longest wait for a caller that sent no `grpc-timeout`.
    pub max_wait: Duration,
    /// Work must be able to start this long before the caller's deadline.
    pub deadline_margin: Duration,
    /// Base retry hint for a shed caller (spread 50-150%).
    pub pushback: Duration,
    /// Unauthenticated (not yet known) requests per second per source IP; 0 disables.
    pub new_caller_qps_per_ip: u32,
    pub new_caller_burst_per_ip: u32,
    pub identity_cap: Option<IdentityCap>,
    /// A caller's oldest request waiting this long: its turns serve its
    /// newest request first (adaptive LIFO).
    pub lifo_after: Duration,
    /// Niceness added to the signing threads, so that reading, classifying
    /// and shedding requests come first under a CPU limit.
    pub signing_nice: i32,
    /// While requests keep arriving, a queued request that has waited
    /// longer is shed instead of started ([`decide::stale_after`]).
    pub queue_target: Duration,
    /// Fewest streams in progress one connection is always allowed, however
    /// small the sized share ([`decide::size`]).
    pub min_streams_per_connection: usize,
    /// The advertised `SETTINGS_MAX_CONCURRENT_STREAMS` (the sized share's
    /// ceiling); set from the transport limits.
    pub max_streams_per_connection: usize,
    /// Longest a stream over its connection's share waits for a place
    /// (holding only its headers) before it is refused; 0: refused at once.
    pub stream_park: Duration,
    /// With a signing thread free and nothing waiting lately, sign on the
    /// request's own worker: no hand-off to a thread and back.
    pub sign_inline: bool,
}

/// How long after requests last waited for signing the per-connection
/// share is still enforced.
const PRESSURE_MEMORY: Duration = Duration::from_secs(1);

/// How often the async workers' lag is probed while signing may run inline.
const LAG_PROBE: Duration = Duration::from_millis(20);

/// A probe this late means work is waiting for the async workers.
const LAG_LIMIT: Duration = Duration::from_millis(10);

/// Most entries in the per-IP and per-identity tables; beyond, stale ones
/// are dropped first.
const MAX_TABLE: usize = 100_000;

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The sized queue's bound when `MESHCA_ADMISSION_MAX_QUEUED` is 0. In
/// practice the request gate's in-flight caps bound it much lower.
pub const MAX_SIZED_QUEUE: usize = 65_536;

/// The sized queue's floor: a short burst always finds room.
pub const MIN_SIZED_QUEUE: usize = 16;

impl Default for AdmissionConfig {
    fn default() -> Self {
        let running = cores();
        Self {
            max_running: running,
            max_queued: MAX_SIZED_QUEUE,
            max_wait: Duration::from_secs(5),
            deadline_margin: Duration::from_millis(10),
            pushback: Duration::from_secs(1),
            new_caller_qps_per_ip: 100,
            new_caller_burst_per_ip: 200,
            identity_cap: None,
            lifo_after: Duration::from_millis(10),
            signing_nice: 10,
            queue_target: Duration::from_millis(50),
            min_streams_per_connection: 1,
            max_streams_per_connection: 100,
            stream_park: Duration::from_millis(900),
            sign_inline: true,
        }
    }
}

/// Admission flags (flattened into `meshca serve`).
#[derive(Debug, Clone, clap::Args)]
pub struct AdmissionArgs {
    /// CSR verifications and signatures at once (0: one per core).
    ///
    /// They run on this many dedicated signing threads, never on the async workers that read,
    /// classify and shed requests; the rest wait in the admission queue.
    #[arg(long, env = "MESHCA_ADMISSION_MAX_RUNNING", default_value_t = 0)]
    pub admission_max_running: usize,
    /// Most requests waiting for a signing thread (0: as many as can be answered within the
    /// callers' typical deadline, at most 65,536); beyond, shed.
    ///
    /// 0 sizes the bound while running: as many as the signing threads answer within the callers'
    /// typical deadline (time per request × mean `grpc-timeout`, at least 16). The time per request
    /// is measured as the pool's time per completion while requests wait, so a CPU quota or busy
    /// neighbours count (`meshca_admission_service_seconds`, per signing thread); before that is
    /// measured, a job's own wall time. While the queue has shed work within the last second, the
    /// connections with a request in progress share what is answered within
    /// --admission-queue-target (otherwise within the deadline)
    /// (`meshca_admission_streams_per_connection`, at least --admission-min-streams-per-connection,
    /// at most --max-concurrent-streams). Turns go by start-time fair queueing over callers (node
    /// proxy pod, else identity) with each caller's recent service remembered after it leaves the
    /// queue (at most 65,536 callers); when full, the caller furthest ahead loses its oldest
    /// waiting request (`admission_queue_displaced`), else the newcomer is shed
    /// (`admission_queue_full`).
    #[arg(long, env = "MESHCA_ADMISSION_MAX_QUEUED", default_value_t = 0)]
    pub admission_max_queued: usize,
    /// Longest wait in the queue for callers sending no grpc-timeout.
    #[arg(long, env = "MESHCA_ADMISSION_MAX_WAIT", default_value = "5s")]
    pub admission_max_wait: String,
    /// Work never starts later than this before the caller's deadline.
    ///
    /// Refusal `admission_deadline_exceeded`; a cancelled caller leaves the queue at once.
    #[arg(long, env = "MESHCA_ADMISSION_DEADLINE_MARGIN", default_value = "10ms")]
    pub admission_deadline_margin: String,
    /// Base grpc-retry-pushback-ms / RetryInfo for shed callers (spread 50-150%).
    ///
    /// Sent as `grpc-retry-pushback-ms` and a `google.rpc.RetryInfo` detail with
    /// `RESOURCE_EXHAUSTED`.
    #[arg(long, env = "MESHCA_ADMISSION_PUSHBACK", default_value = "1s")]
    pub admission_pushback: String,
    /// Requests per second per source IP from callers not yet known (0: no budget).
    ///
    /// Callers not yet known are those that would need a TokenReview; the budget is checked before
    /// the review (`admission_source_budget`). While the queue is half full, callers not already
    /// known (no cached review, no client certificate) are shed first
    /// (`admission_new_caller_busy`).
    #[arg(
        long,
        env = "MESHCA_ADMISSION_NEW_CALLER_QPS_PER_IP",
        default_value_t = 100
    )]
    pub admission_new_caller_qps_per_ip: u32,
    /// Burst of such requests per source IP.
    #[arg(
        long,
        env = "MESHCA_ADMISSION_NEW_CALLER_BURST_PER_IP",
        default_value_t = 200
    )]
    pub admission_new_caller_burst_per_ip: u32,
    /// Certificates per identity per window (0: no cap).
    ///
    /// Over it, shed as `admission_identity_cap` with a retry hint at the window's end.
    #[arg(long, env = "MESHCA_IDENTITY_CAP", default_value_t = 0)]
    pub identity_cap: u32,
    /// The per-identity cap's window.
    #[arg(long, env = "MESHCA_IDENTITY_CAP_WINDOW", default_value = "1h")]
    pub identity_cap_window: String,
    /// A caller's oldest queued request waiting this long: its turns serve its newest first.
    ///
    /// Its oldest are then the ones left to expire; one caller's backlog never delays another
    /// caller's turn.
    #[arg(long, env = "MESHCA_ADMISSION_LIFO_AFTER", default_value = "10ms")]
    pub admission_lifo_after: String,
    /// While requests keep arriving, a queued request that waited longer is shed, not started
    /// (at least two fair rounds of the waiting callers; only under overload or from a queue
    /// that has stood for two targets; 0s: off).
    ///
    /// CoDel-style: the wait counts from the request's headers (the request gate and the queue
    /// together); the refusal is `admission_queue_timeout`, `RESOURCE_EXHAUSTED` with pushback, so
    /// the answers that go out are still useful and the queue's delay stays near the target. The
    /// target is raised to at least four service times (a slow signer such as an HSM) and two fair
    /// rounds of the callers waiting (a request waiting its fair turn is never stale); a caller
    /// alone in the queue is never stale (a node proxy's burst after a restart). Overload means the
    /// queue shed work, or streams waited at the request gate over their connection's share, within
    /// the last second; a standing queue has requests found waiting at every signing turn for two
    /// targets (CoDel's interval). One stall of the process at light load (CPU starvation, a VM
    /// pause) is worked through, not shed. Once arrivals pause for this long, a burst's tail is
    /// served however old.
    #[arg(long, env = "MESHCA_ADMISSION_QUEUE_TARGET", default_value = "50ms")]
    pub admission_queue_target: String,
    /// Niceness added to the signing threads (0-19; 0: same priority as request I/O).
    ///
    /// So that under a CPU limit reading, classifying and shedding requests come before signing.
    #[arg(long, env = "MESHCA_SIGNING_NICE", default_value_t = 10)]
    pub signing_nice: u32,
    /// Fewest streams in progress a connection is always allowed (the sized share's floor).
    ///
    /// The share applies only while requests wait for signing (or did within the last second): an
    /// unloaded server takes every stream up to --max-concurrent-streams.
    #[arg(
        long,
        env = "MESHCA_ADMISSION_MIN_STREAMS_PER_CONNECTION",
        default_value_t = 1
    )]
    pub admission_min_streams_per_connection: usize,
    /// Longest a stream over its connection's share waits for a place before it is refused
    /// (0s: refused at once; at most the request's grpc-timeout). Most of a typical 1 s
    /// deadline: a refusal brings the client's next request at once, a waiting stream costs
    /// only its headers.
    ///
    /// The stream waits at the request gate holding only its headers, before its message is read,
    /// for a place another stream of its connection frees. While the queue sheds work (overload), a
    /// freed place goes to the newest waiting stream, only one younger than a quarter of the queue
    /// target takes it (new work first), and an older one is refused at the end of this time
    /// (`RESOURCE_EXHAUSTED` with pushback, transport refusal `connection_stream_limit`, folded
    /// into aggregated audit records), never later than 20 ms before its own `grpc-timeout`;
    /// without overload it waits its turn until then.
    #[arg(long, env = "MESHCA_ADMISSION_STREAM_PARK", default_value = "900ms")]
    pub admission_stream_park: String,
    /// Sign on the request's own worker while no request has waited for a signing thread within
    /// the last second (false: always hand off to a signing thread).
    ///
    /// No hand-off to a signing thread and back: about 12% more certificates per CPU-second below
    /// overload. Inline also needs a 20 ms probe timer that never ran 10 ms late within the last
    /// second: under overload the backlog builds in front of the workers, where the queue cannot
    /// see it; the late timer is that signal, and from it on every request goes through the niced
    /// signing threads for at least a second (a slow HSM call that holds a worker trips it too).
    #[arg(long, env = "MESHCA_ADMISSION_SIGN_INLINE", default_value_t = true, action = clap::ArgAction::Set)]
    pub admission_sign_inline: bool,
}

impl AdmissionArgs {
    /// Parses and validates; every error names its variable.
    pub fn parse(&self) -> Result<AdmissionConfig, ConfigError> {
        let day = Duration::from_secs(24 * 3600);
        let dur = |name: &'static str, v: &str, zero_ok: bool| {
            crate::flags::bounded_duration(name, v, zero_ok, day)
        };
        let max_running = match self.admission_max_running {
            0 => cores(),
            n => crate::flags::bounded("MESHCA_ADMISSION_MAX_RUNNING", n, 1, 4096)?,
        };
        let max_queued = match self.admission_max_queued {
            0 => MAX_SIZED_QUEUE,
            n => crate::flags::bounded("MESHCA_ADMISSION_MAX_QUEUED", n, 1, 1_000_000)?,
        };
        let identity_cap = match self.identity_cap {
            0 => None,
            max => Some(IdentityCap {
                max,
                window: dur(
                    "MESHCA_IDENTITY_CAP_WINDOW",
                    &self.identity_cap_window,
                    false,
                )?,
            }),
        };
        Ok(AdmissionConfig {
            max_running,
            max_queued,
            max_wait: dur("MESHCA_ADMISSION_MAX_WAIT", &self.admission_max_wait, false)?,
            deadline_margin: dur(
                "MESHCA_ADMISSION_DEADLINE_MARGIN",
                &self.admission_deadline_margin,
                true,
            )?,
            pushback: dur("MESHCA_ADMISSION_PUSHBACK", &self.admission_pushback, false)?,
            new_caller_qps_per_ip: self.admission_new_caller_qps_per_ip,
            new_caller_burst_per_ip: self.admission_new_caller_burst_per_ip.max(1),
            identity_cap,
            lifo_after: dur(
                "MESHCA_ADMISSION_LIFO_AFTER",
                &self.admission_lifo_after,
                true,
            )?,
            signing_nice: crate::flags::bounded("MESHCA_SIGNING_NICE", self.signing_nice, 0, 19)?
                as i32,
            queue_target: dur(
                "MESHCA_ADMISSION_QUEUE_TARGET",
                &self.admission_queue_target,
                true,
            )?,
            min_streams_per_connection: crate::flags::bounded(
                "MESHCA_ADMISSION_MIN_STREAMS_PER_CONNECTION",
                self.admission_min_streams_per_connection,
                1,
                1_000_000,
            )?,
            max_streams_per_connection: AdmissionConfig::default().max_streams_per_connection,
            stream_park: dur(
                "MESHCA_ADMISSION_STREAM_PARK",
                &self.admission_stream_park,
                true,
            )?,
            sign_inline: self.admission_sign_inline,
        })
    }
}

/// What the request gate and the admission queue share: the sized limit of
/// streams in progress per connection, and how many connections have one.
#[derive(Debug)]
pub struct Concurrency {
    busy_connections: AtomicUsize,
    /// Streams in progress on all connections.
    in_progress: AtomicUsize,
    per_connection: AtomicUsize,
    floor_per_connection: AtomicUsize,
    shared: AtomicUsize,
    /// Requests waiting for a signing thread: the share is enforced only
    /// while some do or did lately, so an unloaded server never refuses a
    /// stream.
    backlog: Arc<queue::Backlog>,
    park: Duration,
    fresh: Duration,
    margin: Duration,
    max_wait: Duration,
}

impl Concurrency {
    fn new(cfg: &AdmissionConfig, backlog: Arc<queue::Backlog>) -> Arc<Self> {
        let park = cfg.stream_park;
        Arc::new(Self {
            busy_connections: AtomicUsize::new(0),
            in_progress: AtomicUsize::new(0),
            per_connection: AtomicUsize::new(cfg.max_streams_per_connection.max(1)),
            floor_per_connection: AtomicUsize::new(cfg.max_streams_per_connection.max(1)),
            shared: AtomicUsize::new(usize::MAX),
            backlog,
            park,
            max_wait: cfg.max_wait,
            // Within a quarter of the queue target a waiting stream is
            // still new work; past it, a freed place goes to newer streams.
            // What waits here adds to what waits in the queue behind: a
            // quarter keeps a success's whole wait near the target (half let
            // client p99 reach 100 ms at 25% of a core with a 50 ms target).
            fresh: match cfg.queue_target {
                t if t.is_zero() => park,
                t => t / 4,
            },
            margin: cfg.deadline_margin,
        })
    }

    /// Longest a stream over its connection's share may wait for a place:
    /// until shortly before the caller's own deadline (a cancelled stream
    /// would count against its connection), or `max_wait` without one.
    pub fn wait_limit(&self, timeout: Option<Duration>) -> Duration {
        timeout
            .map_or(self.max_wait, |t| t.min(self.max_wait))
            .saturating_sub(self.margin.saturating_mul(2))
    }

    /// A waiting stream younger than this takes a freed place; an older one
    /// waits out its time and is refused (new work first).
    pub fn fresh(&self) -> Duration {
        self.fresh
    }

    /// The configured wait of a stream over its share under overload.
    pub fn park(&self) -> Duration {
        self.park
    }

    /// Whether the signing queue shed work lately: more arrives than is
    /// answered in time. Without that (a burst the server works through
    /// in time) a stream over its share waits for a place however old.
    pub fn overloaded(&self) -> bool {
        self.backlog.shedding(PRESSURE_MEMORY)
    }

    /// A stream over its connection's share waits at the request gate:
    /// more is offered than is answered within the queue target.
    pub fn gate_waited(&self) {
        self.backlog.gate_waited();
    }

    /// Streams in progress one connection may have now.
    pub fn per_connection(&self) -> usize {
        self.per_connection.load(Ordering::Relaxed)
    }

    /// Whether a connection that had `before` streams in progress may open
    /// one more: within its share ([`decide::admits_stream`]), or while no
    /// request has waited for signing for a second.
    pub fn admits(&self, before: usize) -> bool {
        let share = decide::StreamShare {
            per_connection: self.per_connection(),
            floor_per_connection: self.floor_per_connection.load(Ordering::Relaxed),
            shared: self.shared.load(Ordering::Relaxed),
        };
        decide::admits_stream(before, self.in_progress.load(Ordering::Relaxed), &share)
            || !self.backlog.pressed(PRESSURE_MEMORY)
    }

    pub fn busy_connections(&self) -> usize {
        self.busy_connections.load(Ordering::Relaxed)
    }

    /// A connection went from `before` streams in progress to one more.
    pub fn opened(&self, before: usize) {
        self.in_progress.fetch_add(1, Ordering::Relaxed);
        if before == 0 {
            self.busy_connections.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A connection's stream ended, leaving `after` in progress.
    pub fn closed(&self, after: usize) {
        let _ = self
            .in_progress
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        if after == 0 {
            let _ = self
                .busy_connections
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
    }
}

#[derive(Debug)]
struct SourceBucket {
    bucket: TokenBucket,
    used: Instant,
}

/// The admission layer of one server.
#[derive(Debug)]
pub struct Admission {
    cfg: AdmissionConfig,
    queue: FairQueue,
    concurrency: Arc<Concurrency>,
    /// Exponentially weighted mean of the callers' deadlines (ns; 0 = none yet).
    deadline_ns: AtomicU64,
    sources: Mutex<HashMap<IpAddr, SourceBucket>>,
    caps: Mutex<HashMap<String, decide::CapWindow>>,
    metrics: Option<Arc<dyn AdmissionObserver>>,
}

fn draw() -> u64 {
    crate::ca::ttl::random_draw()
}

/// A counted issuance under the identity cap; given back unless committed
/// (a request that fails later does not use up its identity's cap).
#[derive(Debug)]
pub struct CapTicket<'a> {
    admission: &'a Admission,
    identity: Option<String>,
}

impl CapTicket<'_> {
    /// The certificate was issued: the count stays.
    pub fn commit(mut self) {
        self.identity = None;
    }
}

impl Drop for CapTicket<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.identity.take() {
            if let Some(w) = lock(&self.admission.caps).get_mut(&id) {
                w.count = w.count.saturating_sub(1);
            }
        }
    }
}

impl Admission {
    pub fn new(cfg: AdmissionConfig, metrics: Option<Arc<dyn AdmissionObserver>>) -> Self {
        let queue = FairQueue::new(
            PoolConfig {
                max_running: cfg.max_running,
                max_queued: cfg.max_queued,
                lifo_after: cfg.lifo_after,
                nice: cfg.signing_nice,
                target: cfg.queue_target,
                inline: cfg.sign_inline.then_some(PRESSURE_MEMORY),
            },
            metrics.clone(),
        );
        Self {
            concurrency: Concurrency::new(&cfg, queue.backlog()),
            queue,
            deadline_ns: AtomicU64::new(0),
            cfg,
            sources: Mutex::new(HashMap::new()),
            caps: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    pub fn config(&self) -> &AdmissionConfig {
        &self.cfg
    }

    /// Shared with the request gate, which enforces the per-connection share.
    pub fn concurrency(&self) -> Arc<Concurrency> {
        self.concurrency.clone()
    }

    /// The sizing now, from the measured service time, the callers' typical
    /// deadline and the busy connections ([`decide::size`]).
    pub fn sizing(&self) -> decide::Sizing {
        let deadline = match self.deadline_ns.load(Ordering::Relaxed) {
            0 => self.cfg.max_wait,
            ns => Duration::from_nanos(ns),
        };
        decide::size(
            self.queue.effective_service(),
            self.queue.max_running(),
            deadline,
            // Connections share what the queue target answers only under
            // overload (the queue shed work within the last second): a
            // burst the server works through in time keeps the deadline's
            // share and waits in the queue instead of at the gate.
            if self.concurrency.overloaded() {
                self.cfg.queue_target
            } else {
                Duration::ZERO
            },
            self.concurrency.busy_connections(),
            decide::SizingBounds {
                min_queued: MIN_SIZED_QUEUE,
                max_queued: self.cfg.max_queued,
                min_per_connection: self.cfg.min_streams_per_connection,
                max_per_connection: self.cfg.max_streams_per_connection,
            },
        )
    }

    /// Applies the sizing: the queue bound and the per-connection share.
    fn resize(&self) {
        let s = self.sizing();
        self.queue.set_sized_queued(s.queued);
        let c = &self.concurrency;
        c.per_connection
            .store(s.share.per_connection, Ordering::Relaxed);
        c.floor_per_connection
            .store(s.share.floor_per_connection, Ordering::Relaxed);
        c.shared.store(s.share.shared, Ordering::Relaxed);
        if let Some(m) = &self.metrics {
            m.sizing(
                s.queued,
                s.share.per_connection,
                self.queue.effective_service(),
            );
        }
    }

    /// A shed for `reason` now (counted, with a spread retry hint).
    pub fn shed_now(&self, reason: ShedReason) -> Shed {
        self.shed(reason, Duration::ZERO)
    }

    fn shed(&self, reason: ShedReason, at_least: Duration) -> Shed {
        if let Some(m) = &self.metrics {
            m.shed(reason);
        }
        Shed {
            reason,
            retry_after: decide::pushback(self.cfg.pushback, at_least, draw()),
        }
    }

    /// Before authentication: known callers pass; others are shed while
    /// the queue is busy, and those needing a TokenReview when their source
    /// IP's budget is spent.
    pub fn pre_auth(&self, ip: Option<IpAddr>, f: Familiarity) -> Result<(), Shed> {
        let known = f == Familiarity::Known;
        let (_, queued) = self.queue.stats();
        decide::pre_auth(known, decide::load(queued, self.cfg.max_queued))
            .map_err(|r| self.shed(r, Duration::ZERO))?;
        if f != Familiarity::New || self.cfg.new_caller_qps_per_ip == 0 {
            return Ok(());
        }
        let Some(ip) = ip.map(crate::transport::limits::canonical_ip) else {
            return Ok(());
        };
        let now = Instant::now();
        let (qps, burst) = (
            self.cfg.new_caller_qps_per_ip,
            self.cfg.new_caller_burst_per_ip,
        );
        let verdict = {
            let mut sources = lock(&self.sources);
            if sources.len() >= MAX_TABLE {
                // A bucket unused for the time it takes to refill is full again.
                let refill = Duration::from_secs_f64(f64::from(burst) / f64::from(qps));
                sources.retain(|_, b| now.duration_since(b.used) < refill);
            }
            if sources.len() >= MAX_TABLE && !sources.contains_key(&ip) {
                Err(Duration::ZERO)
            } else {
                let b = sources.entry(ip).or_insert_with(|| SourceBucket {
                    bucket: TokenBucket::new(qps, burst, now),
                    used: now,
                });
                b.used = now;
                b.bucket.reserve(now, Duration::ZERO).map(|_| ())
            }
        };
        verdict.map_err(|wait| self.shed(ShedReason::SourceBudget, wait))
    }

    /// Counts one issuance for `identity` under the cap (if any).
    pub fn take_identity(
        &self,
        identity: &(impl std::fmt::Display + ?Sized),
    ) -> Result<CapTicket<'_>, Shed> {
        let Some(cap) = self.cfg.identity_cap else {
            return Ok(CapTicket {
                admission: self,
                identity: None,
            });
        };
        // Formatted only when a cap is set: the common path allocates nothing.
        let identity = identity.to_string();
        let identity = identity.as_str();
        let now = Instant::now();
        let verdict = {
            let mut caps = lock(&self.caps);
            if caps.len() >= MAX_TABLE && !caps.contains_key(identity) {
                caps.retain(|_, w| now < w.started + cap.window);
            }
            if caps.len() >= MAX_TABLE && !caps.contains_key(identity) {
                Err((ShedReason::IdentityCapTableFull, Duration::ZERO))
            } else {
                let w = caps.get(identity).copied();
                match decide::cap_take(w, now, cap.max, cap.window) {
                    Ok(w) => {
                        caps.insert(identity.to_string(), w);
                        Ok(())
                    }
                    Err(wait) => Err((ShedReason::IdentityCap, wait)),
                }
            }
        };
        match verdict {
            Ok(()) => Ok(CapTicket {
                admission: self,
                identity: Some(identity.to_string()),
            }),
            Err((r, wait)) => Err(self.shed(r, wait)),
        }
    }

    /// The last moment work may start for a request that arrived at
    /// `arrived` with this `grpc-timeout`.
    pub fn start_by(&self, arrived: Instant, timeout: Option<Duration>) -> Instant {
        let seen = timeout.map_or(self.cfg.max_wait, |t| t.min(self.cfg.max_wait));
        let seen = u64::try_from(seen.saturating_sub(self.cfg.deadline_margin).as_nanos())
            .unwrap_or(u64::MAX);
        let _ = self
            .deadline_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |m| {
                Some(queue::ewma_ns(m, seen))
            });
        decide::start_by(
            arrived,
            timeout,
            self.cfg.deadline_margin,
            self.cfg.max_wait,
        )
    }

    /// Runs the CPU-heavy `job` on a signing thread at the turn of caller
    /// `key`, if that comes before `start_by`, for a request that arrived at
    /// `arrived` (its wait before the queue counts toward the queue target).
    pub async fn run<R: Send + 'static>(
        &self,
        key: &str,
        arrived: Instant,
        start_by: Instant,
        job: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, Shed> {
        self.resize();
        self.queue
            .run_arrived(key, arrived, start_by, job)
            .await
            .map_err(|r| self.shed(r, Duration::ZERO))
    }

    /// (running, queued) now.
    pub fn stats(&self) -> (usize, usize) {
        self.queue.stats()
    }

    /// The lag watch that stops inline signing under overload
    /// ([`FairQueue::watch_lag`]); `None` when jobs never run inline.
    pub fn lag_watch(&self) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        self.cfg
            .sign_inline
            .then(|| self.queue.clone().watch_lag(LAG_PROBE, LAG_LIMIT))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(cfg: AdmissionConfig) -> Admission {
        Admission::new(cfg, None)
    }

    #[test]
    fn reasons_are_distinct_and_prefixed() {
        let set: std::collections::BTreeSet<_> =
            ShedReason::ALL.iter().map(|r| r.reason()).collect();
        assert_eq!(set.len(), ShedReason::ALL.len());
        assert!(set.iter().all(|r| r.starts_with("admission_")));
    }

    #[test]
    fn source_budget_applies_to_new_callers_only() {
        let a = admission(AdmissionConfig {
            new_caller_qps_per_ip: 1,
            new_caller_burst_per_ip: 2,
            ..Default::default()
        });
        let ip = Some("10.0.0.1".parse().unwrap());
        assert!(a.pre_auth(ip, Familiarity::New).is_ok());
        assert!(a.pre_auth(ip, Familiarity::New).is_ok());
        let shed = a.pre_auth(ip, Familiarity::New).unwrap_err();
        assert_eq!(shed.reason, ShedReason::SourceBudget);
        assert!(shed.retry_after >= Duration::from_millis(500));
        // Known callers, and requests refused without a review (cached
        // rejection, failed pre-check), are not counted against the source.
        assert!(a.pre_auth(ip, Familiarity::Known).is_ok());
        assert!(a.pre_auth(ip, Familiarity::RefusedCheaply).is_ok());
        // Another source has its own budget.
        assert!(a
            .pre_auth(Some("10.0.0.2".parse().unwrap()), Familiarity::New)
            .is_ok());
    }

    #[test]
    fn identity_cap_counts_only_committed_issuance() {
        let a = admission(AdmissionConfig {
            identity_cap: Some(IdentityCap {
                max: 2,
                window: Duration::from_secs(3600),
            }),
            ..Default::default()
        });
        let id = "spiffe://cluster.local/ns/a/sa/b";
        a.take_identity(id).unwrap().commit();
        // Not committed (the request failed later): given back.
        drop(a.take_identity(id).unwrap());
        a.take_identity(id).unwrap().commit();
        let shed = a.take_identity(id).unwrap_err();
        assert_eq!(shed.reason, ShedReason::IdentityCap);
        assert!(shed.retry_after > Duration::from_secs(3000), "{shed:?}");
        // Other identities are not affected.
        a.take_identity("spiffe://cluster.local/ns/a/sa/c")
            .unwrap()
            .commit();
    }

    #[test]
    fn no_cap_by_default() {
        let a = admission(AdmissionConfig::default());
        for _ in 0..1000 {
            a.take_identity("spiffe://cluster.local/ns/a/sa/b")
                .unwrap()
                .commit();
        }
    }

    #[tokio::test]
    async fn new_callers_are_shed_first_while_busy() {
        let a = Arc::new(admission(AdmissionConfig {
            max_running: 1,
            max_queued: 2,
            // The held job blocks: on the test's one thread it must not run inline.
            sign_inline: false,
            ..Default::default()
        }));
        let later = Instant::now() + Duration::from_secs(60);
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let a2 = a.clone();
        let held = tokio::spawn(async move {
            a2.run("k", Instant::now(), later, move || {
                let _ = rx.recv();
            })
            .await
        });
        while a.stats().0 < 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut w = Box::pin(a.run("k", Instant::now(), later, || ()));
        assert!(futures::poll!(w.as_mut()).is_pending());
        for f in [Familiarity::New, Familiarity::RefusedCheaply] {
            let shed = a.pre_auth(None, f).unwrap_err();
            assert_eq!(shed.reason, ShedReason::NewCallerWhileBusy);
        }
        assert!(a.pre_auth(None, Familiarity::Known).is_ok());
        drop(tx);
        held.await.unwrap().unwrap();
    }
}
