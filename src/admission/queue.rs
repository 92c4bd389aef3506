//! The signing pool and the fair, deadline-aware queue in front of it.
//!
//! Requests wait as jobs in a [`FairTable`]: turns go by start-time fair
//! queueing over caller keys ([`super::fair`]), and a full queue sheds the
//! caller that has had the most recent service. A fixed set of signing
//! threads takes the next job itself when it is free, so the async workers
//! only read, classify and queue requests: signing never holds up the I/O
//! that reads the next request, learns its deadline and sheds it. The
//! signing threads run at a lower scheduling priority than the rest of the
//! process (`nice`), so under a CPU limit reading and shedding come first.
//!
//! Under overload (a caller's oldest request has waited `lifo_after`), a
//! caller's turn serves its newest request: answers that go out are still
//! useful, and the oldest requests are the ones left to expire.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::decide::{
    admit, hold_stale, note_backlog, pick, sheds_stale, stale_after, Admit, BacklogRun, QueueState,
};
use super::fair::{Entry, FairTable};
use super::ShedReason;

/// A queued job: called once, with `Ok` to run it or the reason it was shed;
/// it returns the delivery of its outcome to the waiting caller.
type Job = Box<dyn FnOnce(Result<(), ShedReason>) -> Deliver + Send>;

/// Hands a job's outcome to its caller. A signing thread calls it
/// ([`hand_over`]) once it has given the job's place back and taken the
/// next job out of the queue (or found none), outside the lock: an answered
/// caller's connection frees a place at the request gate at once, and the
/// request let in then must find a queue place free, not be shed as full;
/// and the woken caller may preempt the (niced) signing thread, so it must
/// not find the lock held.
type Deliver = Box<dyn FnOnce() + Send>;

/// Hands the pending outcome, if any, to its caller (lock not held).
fn hand_over(answer: &mut Option<Deliver>) {
    if let Some(d) = answer.take() {
        d();
    }
}

struct Waiter {
    start_by: Instant,
    /// When it entered the queue (adaptive LIFO looks at this).
    since: Instant,
    /// When its request arrived at the server, at or before `since`: the
    /// queue target bounds the whole wait before signing, the request
    /// gate's included.
    arrived: Instant,
    job: Job,
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("start_by", &self.start_by)
            .field("since", &self.since)
            .field("arrived", &self.arrived)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct State {
    running: usize,
    /// Signing threads waiting for work.
    idle: usize,
    /// When the last request was queued.
    last_arrival: Option<Instant>,
    /// The signing turns' current run of backlog
    /// ([`super::decide::sheds_stale`]).
    backlog_run: Option<BacklogRun>,
    closed: bool,
    drain: DrainMeter,
    table: FairTable<Waiter>,
}

/// How the pool is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Signing threads (jobs running at once).
    pub max_running: usize,
    /// Jobs waiting, at most (the sized bound is applied below it).
    pub max_queued: usize,
    /// A caller's oldest request waiting this long: its turns serve its newest.
    pub lifo_after: Duration,
    /// Niceness added to the signing threads (0: same priority as the rest).
    pub nice: i32,
    /// Queue target: while requests keep arriving, a job that has waited
    /// longer is not started ([`super::decide::stale_after`]; zero: never).
    pub target: Duration,
    /// A job that could start at once runs on the caller's own thread
    /// when no job has waited within this long (`None`: never). Below
    /// overload this saves two thread hand-offs per request; once jobs
    /// wait, every job goes through the niced signing threads, so reading
    /// and shedding keep their priority.
    pub inline: Option<Duration>,
}

#[derive(Debug)]
struct Inner {
    max_running: usize,
    max_queued: usize,
    /// The queue bound in force (at most `max_queued`), set from measured
    /// service times by the sizing in `super::Admission`.
    sized_queued: AtomicUsize,
    lifo_after: Duration,
    target: Duration,
    inline: Option<Duration>,
    state: Mutex<State>,
    work: Condvar,
    /// Exponentially weighted mean wall time of a job, in ns (0: none yet).
    service_ns: AtomicU64,
    /// Mean time between completions while jobs wait (ns; 0: none yet): the
    /// pool's real throughput, CPU quota and neighbours included.
    drain_ns: AtomicU64,
    /// When `drain_ns` was last sampled (ms since `started`).
    drained_at_ms: AtomicU64,
    started: Instant,
    /// Jobs waiting now and when some last did, readable without the lock.
    backlog: Arc<Backlog>,
    completed: AtomicU64,
    metrics: Option<Arc<dyn super::AdmissionObserver>>,
}

/// Closes the pool (its threads end) when the last handle is dropped.
#[derive(Debug)]
struct Handle(Arc<Inner>);

impl Drop for Handle {
    fn drop(&mut self) {
        let mut s = self.0.lock();
        s.closed = true;
        // Waiting jobs are dropped: their callers see the queue gone.
        s.table = FairTable::default();
        drop(s);
        self.0.work.notify_all();
    }
}

/// Shared handle to the pool and its queue.
#[derive(Debug, Clone)]
pub struct FairQueue(Arc<Handle>);

/// Takes a job out of the queue if its caller gives up (timeout, or its
/// request was dropped) before a signing thread took it.
struct WaitGuard<'a> {
    queue: &'a Inner,
    entry: Entry,
    waiting: bool,
}

impl WaitGuard<'_> {
    /// Whether the job was still waiting (and is now removed).
    fn leave(&mut self) -> bool {
        if !self.waiting {
            return false;
        }
        self.waiting = false;
        let mut s = self.queue.lock();
        let removed = s.table.remove(&self.entry);
        self.queue.gauges(&s);
        drop(s);
        // Dropped outside the lock: the job owns the caller's channel.
        removed.is_some()
    }
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        self.leave();
    }
}

/// How many jobs wait now, and when some last did.
#[derive(Debug)]
pub struct Backlog {
    waiting: AtomicUsize,
    epoch: Instant,
    /// When jobs last waited (ms since `epoch`, plus one; 0: never).
    last_ms: AtomicU64,
    /// When the queue last shed work (stale, full or displaced), likewise.
    shed_ms: AtomicU64,
    /// When the async workers were last seen late ([`FairQueue::watch_lag`]), likewise.
    lag_ms: AtomicU64,
    /// When a stream last waited at the request gate, over its
    /// connection's share, likewise.
    gated_ms: AtomicU64,
}

impl Backlog {
    fn new() -> Self {
        Self {
            waiting: AtomicUsize::new(0),
            epoch: Instant::now(),
            last_ms: AtomicU64::new(0),
            shed_ms: AtomicU64::new(0),
            lag_ms: AtomicU64::new(0),
            gated_ms: AtomicU64::new(0),
        }
    }

    fn now_mark(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(1)
    }

    fn within(&self, mark: &AtomicU64, within: Duration) -> bool {
        match mark.load(Ordering::Relaxed) {
            0 => false,
            ms => {
                let last = Duration::from_millis(ms - 1);
                self.epoch.elapsed().saturating_sub(last) < within
            }
        }
    }

    fn set(&self, waiting: usize) {
        self.waiting.store(waiting, Ordering::Relaxed);
        if waiting > 0 {
            self.last_ms.store(self.now_mark(), Ordering::Relaxed);
        }
    }

    fn shed(&self) {
        self.shed_ms.store(self.now_mark(), Ordering::Relaxed);
    }

    /// Whether the queue shed work (stale, full or displaced) within
    /// `within`: more arrives than the signing threads answer in time.
    pub fn shedding(&self, within: Duration) -> bool {
        self.within(&self.shed_ms, within)
    }

    /// A stream waits at the request gate, over its connection's share.
    pub fn gate_waited(&self) {
        self.gated_ms.store(self.now_mark(), Ordering::Relaxed);
    }

    /// Whether streams waited at the request gate within `within`: more is
    /// offered than what is answered within the queue target.
    pub fn gating(&self, within: Duration) -> bool {
        self.within(&self.gated_ms, within)
    }

    /// Whether the async workers ran late within `within`: work waits in
    /// front of them (sockets, streams not yet read), where the queue cannot
    /// see it.
    pub fn lagged(&self, within: Duration) -> bool {
        self.within(&self.lag_ms, within)
    }

    /// Whether jobs wait now or did within `within`: a queue that empties
    /// between two CPU-quota periods is still under pressure.
    pub fn pressed(&self, within: Duration) -> bool {
        self.waiting.load(Ordering::Relaxed) > 0 || self.within(&self.last_ms, within)
    }
}

/// Completions counted while the queue stays backlogged, for the pool's
/// throughput. Idle time between bursts is not counted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DrainMeter {
    since: Option<Instant>,
    done: u32,
}

/// A throughput sample covers at least this long, so that CPU-quota
/// periods (where the pool runs, then waits) average out.
const DRAIN_WINDOW: Duration = Duration::from_millis(100);

/// A throughput sample needs at least this many completions.
const DRAIN_MIN_DONE: u32 = 8;

/// A throughput sample older than this no longer sizes anything.
const DRAIN_FRESH: Duration = Duration::from_secs(10);

impl DrainMeter {
    /// A job completed at `now`, with jobs still waiting (`backlogged`) or
    /// not. Returns the time per completion once a window is full.
    pub fn completed(&mut self, now: Instant, backlogged: bool) -> Option<Duration> {
        if !backlogged {
            *self = Self::default();
            return None;
        }
        let Some(since) = self.since else {
            self.since = Some(now);
            return None;
        };
        self.done = self.done.saturating_add(1);
        let spent = now.saturating_duration_since(since);
        if spent < DRAIN_WINDOW || self.done < DRAIN_MIN_DONE {
            return None;
        }
        let per = spent / self.done;
        *self = Self {
            since: Some(now),
            done: 0,
        };
        Some(per)
    }
}

/// Weight of a new sample in the mean service time (1/16).
const EWMA_SHIFT: u32 = 4;

/// The new exponentially weighted mean after a sample (ns; 0 = none yet).
/// A sample counts for at most four times the mean, so one stall (a job
/// preempted for a whole CPU-quota period, a blocking call) moves it little,
/// while a lasting change still shows within a few dozen samples.
pub fn ewma_ns(mean: u64, sample: u64) -> u64 {
    if mean == 0 {
        return sample.max(1);
    }
    let m = i128::from(mean);
    let sample = i128::from(sample).min(m.saturating_mul(4));
    let next = m + ((sample - m) >> EWMA_SHIFT);
    u64::try_from(next.max(1)).unwrap_or(u64::MAX)
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        crate::primitives::lock(&self.state)
    }

    fn gauges(&self, s: &State) {
        self.backlog.set(s.table.len());
        if let Some(m) = &self.metrics {
            m.occupancy(s.running, s.table.len());
        }
    }

    fn bound(&self) -> usize {
        self.sized_queued
            .load(Ordering::Relaxed)
            .min(self.max_queued)
    }

    /// A signing thread: takes the next live job in fair order until closed.
    fn serve(&self) {
        let mut passed = Vec::new();
        // The last job's outcome, not yet handed to its caller.
        let mut answer: Option<Deliver> = None;
        let mut s = self.lock();
        loop {
            if s.closed {
                drop(s);
                hand_over(&mut answer);
                return;
            }
            let now = Instant::now();
            let (lifo_after, target) = (self.lifo_after, self.target);
            // A job's own time: the floor of staleness is a few jobs' work,
            // not the pool's throttled rate (which sizes the queue instead).
            let service = self.service_time();
            // Requests keep arriving: a stale request is not started (it is
            // shed at its deadline) while fresh ones come; a burst's tail,
            // with nothing arriving, is served however old.
            let quiet = s
                .last_arrival
                .map_or(Duration::MAX, |t| now.saturating_duration_since(t));
            let arriving = hold_stale(quiet, target);
            let callers = s.table.callers_waiting();
            let running = self.max_running;
            let after = stale_after(target, service, callers, running);
            let is_stale =
                |w: &Waiter| after.is_some_and(|a| now.saturating_duration_since(w.arrived) > a);
            // Stale requests are shed under overload (the queue sheds, or
            // streams wait at the request gate) or from a standing queue (a
            // backlog that has lasted); not from one stall's burst.
            if let Some(a) = after.filter(|_| !s.table.is_empty()) {
                s.backlog_run = Some(note_backlog(s.backlog_run, now, a));
            }
            let overloaded = self.backlog.shedding(super::PRESSURE_MEMORY)
                || self.backlog.gating(super::PRESSURE_MEMORY);
            let armed = after.is_some_and(|a| sheds_stale(s.backlog_run, now, a, overloaded));
            let next = s.table.pop_next_into(
                |w| w.start_by > now && !(armed && arriving && is_stale(w)),
                |oldest| pick(now.saturating_duration_since(oldest.since), lifo_after),
                |_| true,
                1,
                false,
                &mut passed,
            );
            if !passed.is_empty() {
                self.gauges(&s);
                drop(s);
                hand_over(&mut answer);
                self.backlog.shed();
                // Past their start-by time (their callers' own timers
                // usually got there first), or stale while newer work
                // arrives: shed.
                for w in passed.drain(..) {
                    let why = if w.start_by > now {
                        ShedReason::QueueTimeout
                    } else {
                        ShedReason::DeadlineExceeded
                    };
                    (w.job)(Err(why))();
                }
                s = self.lock();
                if let Some(w) = next {
                    s = self.run_one(s, w, &mut answer);
                }
                continue;
            }
            let Some(w) = next else {
                if let Some(d) = answer.take() {
                    drop(s);
                    d();
                    s = self.lock();
                    continue;
                }
                self.gauges(&s);
                s.idle += 1;
                s = if arriving && !s.table.is_empty() {
                    // Only stale work: wait for a fresh request, or until
                    // arrivals stop and the stale ones are served.
                    let wait = target.saturating_sub(quiet).max(Duration::from_millis(1));
                    self.work
                        .wait_timeout(s, wait)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                } else {
                    self.work.wait(s).unwrap_or_else(PoisonError::into_inner)
                };
                s.idle -= 1;
                continue;
            };
            s = self.run_one(s, w, &mut answer);
        }
    }

    /// Feeds a completion to the throughput meter (lock held).
    fn drained(&self, s: &mut State) {
        let now = Instant::now();
        let backlogged = !s.table.is_empty();
        if let Some(per) = s.drain.completed(now, backlogged) {
            let per = u64::try_from(per.as_nanos()).unwrap_or(u64::MAX);
            let at = u64::try_from(now.saturating_duration_since(self.started).as_millis())
                .unwrap_or(u64::MAX);
            let _ = self
                .drain_ns
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |m| {
                    // Each sample already averages a window: weight 1/4.
                    Some(if m == 0 { per } else { m - m / 4 + per / 4 }.max(1))
                });
            self.drained_at_ms.store(at, Ordering::Relaxed);
        }
    }

    /// A signing thread's time per request as its callers see it: the
    /// measured time per completion while backlogged times the threads,
    /// which counts CPU-quota throttling and neighbours between jobs, when
    /// sampled lately; else a job's own wall time.
    fn effective_service(&self) -> Option<Duration> {
        let threads = u32::try_from(self.max_running).unwrap_or(u32::MAX);
        self.drain_time()
            .map(|per| per.saturating_mul(threads))
            .or_else(|| self.service_time())
    }

    /// Time per completion while backlogged, if sampled recently.
    fn drain_time(&self) -> Option<Duration> {
        let ns = self.drain_ns.load(Ordering::Relaxed);
        if ns == 0 {
            return None;
        }
        let at = Duration::from_millis(self.drained_at_ms.load(Ordering::Relaxed));
        let age = self.started.elapsed().saturating_sub(at);
        (age <= DRAIN_FRESH).then(|| Duration::from_nanos(ns))
    }

    fn service_time(&self) -> Option<Duration> {
        match self.service_ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    /// Takes a place among the running jobs (lock held).
    fn take_slot(&self, s: &mut State) -> Slot<'_> {
        s.running += 1;
        self.gauges(s);
        Slot {
            pool: self,
            held: true,
        }
    }

    /// Gives a running job's place back and meters its completion; returns
    /// the lock.
    fn release(&self) -> MutexGuard<'_, State> {
        let mut s = self.lock();
        s.running -= 1;
        self.drained(&mut s);
        self.gauges(&s);
        s
    }

    /// Runs a queued job on this signing thread, first handing the previous
    /// job's outcome (`answer`) to its caller, and takes the lock back with
    /// this job's outcome in `answer` ([`Deliver`]).
    fn run_one<'a>(
        &'a self,
        mut s: MutexGuard<'a, State>,
        w: Waiter,
        answer: &mut Option<Deliver>,
    ) -> MutexGuard<'a, State> {
        let slot = self.take_slot(&mut s);
        drop(s);
        hand_over(answer);
        let deliver = self.timed(false, || (w.job)(Ok(())));
        let s = slot.give_back();
        *answer = Some(deliver);
        s
    }

    /// Runs `f`, counting it and its wall time as a completed job.
    fn timed<R>(&self, inline: bool, f: impl FnOnce() -> R) -> R {
        let t0 = Instant::now();
        let r = f();
        let took = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .service_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |m| {
                Some(ewma_ns(m, took))
            });
        self.completed.fetch_add(1, Ordering::Relaxed);
        if let Some(m) = &self.metrics {
            m.job_done(inline);
        }
        r
    }
}

/// A running job's place in the pool, given back when the job ends, even
/// if it panics.
struct Slot<'a> {
    pool: &'a Inner,
    held: bool,
}

impl<'a> Slot<'a> {
    fn give_back(mut self) -> MutexGuard<'a, State> {
        self.held = false;
        self.pool.release()
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if self.held {
            drop(self.pool.release());
        }
    }
}

/// Lowers the calling thread's scheduling priority by `nice` (Linux: the
/// niceness of one thread). Best effort: a failure is logged once per thread.
fn lower_priority(nice: i32) {
    if nice == 0 {
        return;
    }
    let tid = rustix::thread::gettid();
    let now = rustix::process::getpriority_process(Some(tid)).unwrap_or(0);
    if let Err(e) = rustix::process::setpriority_process(Some(tid), (now + nice).min(19)) {
        tracing::warn!(error = %e, nice, "could not lower the signing thread's priority");
    }
}

impl FairQueue {
    pub fn new(cfg: PoolConfig, metrics: Option<Arc<dyn super::AdmissionObserver>>) -> Self {
        let q = Self::without_threads(cfg, metrics);
        q.start_threads(cfg.nice);
        q
    }

    /// The pool before its signing threads start: tests use it to hold the
    /// threads back, as a scheduler may for a moment after a job is queued.
    fn without_threads(
        cfg: PoolConfig,
        metrics: Option<Arc<dyn super::AdmissionObserver>>,
    ) -> Self {
        let max_running = cfg.max_running.max(1);
        let inner = Arc::new(Inner {
            max_running,
            max_queued: cfg.max_queued,
            sized_queued: AtomicUsize::new(cfg.max_queued),
            lifo_after: cfg.lifo_after,
            target: cfg.target,
            inline: cfg.inline,
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            service_ns: AtomicU64::new(0),
            drain_ns: AtomicU64::new(0),
            drained_at_ms: AtomicU64::new(0),
            started: Instant::now(),
            backlog: Arc::new(Backlog::new()),
            completed: AtomicU64::new(0),
            metrics,
        });
        Self(Arc::new(Handle(inner)))
    }

    /// Starts the signing threads; each ends when the last handle is dropped.
    fn start_threads(&self, nice: i32) {
        let inner = &self.0 .0;
        for i in 0..inner.max_running {
            let inner = inner.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("meshca-sign-{i}"))
                .spawn(move || {
                    lower_priority(nice);
                    inner.serve();
                });
            if let Err(e) = spawned {
                tracing::error!(error = %e, "could not start a signing thread");
            }
        }
    }

    fn inner(&self) -> &Inner {
        &self.0 .0
    }

    /// Marks the async workers late whenever a timer of `period` fires more
    /// than `late` after it was due. Signing inline takes a worker away from
    /// reading; under overload the backlog builds in front of the workers,
    /// where the queue never sees it, so this is the signal that sends every
    /// job to the signing threads. Runs until the pool is dropped.
    pub async fn watch_lag(self, period: Duration, late: Duration) {
        let backlog = self.backlog();
        let weak = Arc::downgrade(&self.0);
        drop(self);
        while weak.strong_count() > 0 {
            let due = Instant::now() + period;
            tokio::time::sleep_until(due.into()).await;
            if due.elapsed() > late {
                backlog.lag_ms.store(backlog.now_mark(), Ordering::Relaxed);
            }
        }
    }

    /// (running, queued) now.
    pub fn stats(&self) -> (usize, usize) {
        let s = self.inner().lock();
        (s.running, s.table.len())
    }

    /// (callers with requests waiting, queued) now.
    pub fn callers(&self) -> (usize, usize) {
        let s = self.inner().lock();
        (s.table.callers_waiting(), s.table.len())
    }

    pub fn max_running(&self) -> usize {
        self.inner().max_running
    }

    /// The queue bound in force.
    pub fn max_queued(&self) -> usize {
        self.inner().bound()
    }

    /// Sets the queue bound (at most the configured maximum, at least 1).
    pub fn set_sized_queued(&self, n: usize) {
        self.inner().sized_queued.store(n.max(1), Ordering::Relaxed);
    }

    /// Mean wall time of a job, once one has run.
    pub fn service_time(&self) -> Option<Duration> {
        self.inner().service_time()
    }

    /// A signing thread's time per request, throttling included
    /// (`Inner::effective_service`).
    pub fn effective_service(&self) -> Option<Duration> {
        self.inner().effective_service()
    }

    /// Jobs waiting, lock-free (shared with the request gate).
    pub fn backlog(&self) -> Arc<Backlog> {
        self.inner().backlog.clone()
    }

    /// Jobs run to completion so far.
    pub fn completed(&self) -> u64 {
        self.inner().completed.load(Ordering::Relaxed)
    }

    /// Tests' shorthand: [`Self::run_arrived`] for a request that arrives
    /// as it is queued.
    #[cfg(test)]
    pub async fn run<R: Send + 'static>(
        &self,
        key: &str,
        start_by: Instant,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, ShedReason> {
        self.run_arrived(key, Instant::now(), start_by, f).await
    }

    /// Runs `f` on a signing thread when it is the turn of caller `key`, if
    /// that comes before `start_by`, for a request that arrived at the
    /// server at `arrived` (its headers): the time it spent before the
    /// queue counts toward the queue target. Dropping the returned future
    /// (the caller cancelled) takes the job out of the queue if it has not
    /// started; a started job always runs to its end.
    pub async fn run_arrived<R: Send + 'static>(
        &self,
        key: &str,
        arrived: Instant,
        start_by: Instant,
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, ShedReason> {
        let now = Instant::now();
        if now >= start_by {
            return Err(ShedReason::DeadlineExceeded);
        }
        let inner = self.inner();
        let (tx, mut rx) = oneshot::channel::<Result<R, ShedReason>>();
        let (entry, evicted) = {
            let mut s = inner.lock();
            if s.closed {
                return Err(ShedReason::QueueFull);
            }
            let verdict = admit(&QueueState {
                running: s.running,
                max_running: inner.max_running,
                queued: s.table.len(),
                max_queued: inner.bound(),
                tag: s.table.tag(key),
                last_tag: s.table.last_tag(),
            });
            let evicted = match verdict {
                Admit::Shed(r) => {
                    inner.backlog.shed();
                    return Err(r);
                }
                Admit::Run
                    if inner.inline.is_some_and(|quiet| {
                        !inner.backlog.pressed(quiet) && !inner.backlog.lagged(quiet)
                    }) =>
                {
                    // On the caller's own worker, in a slot of the pool.
                    let slot = inner.take_slot(&mut s);
                    drop(s);
                    let r = inner.timed(true, f);
                    drop(slot.give_back());
                    return Ok(r);
                }
                Admit::Run | Admit::Enqueue => None,
                Admit::EnqueueEvicting => s.table.pop_last().map(|(_, w)| w),
            };
            let job: Job = Box::new(move |go| {
                let out = go.map(|()| f());
                Box::new(move || {
                    let _ = tx.send(out);
                })
            });
            let entry = s.table.push(
                Arc::from(key),
                Waiter {
                    start_by,
                    since: now,
                    arrived: arrived.min(now),
                    job,
                },
            );
            s.last_arrival = Some(now);
            inner.gauges(&s);
            if s.idle > 0 {
                inner.work.notify_one();
            }
            (entry, evicted)
        };
        if let Some(w) = evicted {
            inner.backlog.shed();
            (w.job)(Err(ShedReason::QueueDisplaced))();
        }
        let mut guard = WaitGuard {
            queue: inner,
            entry,
            waiting: true,
        };
        let got = tokio::select! {
            r = &mut rx => r,
            _ = tokio::time::sleep_until(start_by.into()) => {
                if guard.leave() {
                    return Err(ShedReason::DeadlineExceeded);
                }
                // A signing thread took it before its start-by time: the
                // job runs to its end (its own last check is the deadline
                // before the signature).
                (&mut rx).await
            }
        };
        // Taken by a signing thread or shed: it already left the queue.
        guard.waiting = false;
        match got {
            Ok(r) => r,
            // Dropped from the queue as expired (or the pool closed).
            Err(_) => Err(ShedReason::DeadlineExceeded),
        }
    }
}

#[cfg(test)]
mod tests;
