//! The audit writer: one thread owns the chained sink and is fed through a
//! bounded channel, so serialization, write(2), checkpoint signing, rotation
//! and fsync never run on a runtime thread. A request waits (asynchronously)
//! for its record's acknowledgement; when the channel is full the request is
//! shed at once rather than blocking anything.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::aggregate::{unauthenticated_refusal, Aggregator, Key, Tally};
use super::chain::ChainedSink;
use super::{Ack, AuditError, AuditRecord, AuditRefusal, AuditSink, Decision};
use crate::ratelimit::TokenBucket;

/// Reason codes of requests shed by the writer.
pub const SHED_REASONS: [&str; 2] = ["audit_queue_full", "audit_writer_stopped"];

/// When a record counts as written (`--audit-fsync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FsyncPolicy {
    /// fsync after every record, before its acknowledgement.
    Always,
    /// Group commit: the records that arrive within one batch interval share
    /// one fsync; each is acknowledged after the fsync that covers it.
    Batch,
    /// Acknowledged once written to the kernel (no fsync but at rotation).
    Never,
}

impl FsyncPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Always => "always",
            Self::Batch => "batch",
            Self::Never => "never",
        }
    }
}

/// Settings of the writer thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterSettings {
    /// Records that may wait for the writer (`MESHCA_AUDIT_QUEUE`).
    pub queue: usize,
    pub fsync: FsyncPolicy,
    /// Longest a batch collects records before its fsync.
    pub batch_interval: Duration,
    /// A checkpoint is written when records are pending this long.
    pub checkpoint_interval: Duration,
    /// How often folded refusals are written as aggregate records.
    pub aggregate_interval: Duration,
    /// Refusals of unauthenticated callers written as full records per
    /// second (as many at once); the rest are folded into aggregates. 0:
    /// every one is folded.
    pub unauthenticated_rate: u32,
}

/// Default of `--audit-unauthenticated-rate`.
pub const DEFAULT_UNAUTHENTICATED_RATE: u32 = 20;

/// Something an anchor does with each checkpoint the writer writes (the
/// Kubernetes anchor; tests). Runs on the writer thread: must not block long.
pub trait CheckpointObserver: Send + Sync + std::fmt::Debug {
    fn checkpoint(&self, line: &str);
}

type Reply = oneshot::Sender<Result<(), AuditError>>;
type BlockingReply = mpsc::Sender<Result<(), AuditError>>;

enum Msg {
    Record(Box<AuditRecord>, Option<Reply>),
    /// An aggregate record and the key and tally it stands for.
    Folded(Box<AuditRecord>, Key, Tally),
    Checkpoint(&'static str, BlockingReply),
}

/// Who hears the outcome of a message.
enum Waiter {
    None,
    Request(Reply),
    Blocking(BlockingReply),
    /// An aggregate: put back into the table when it was not written.
    Fold(Key, Tally),
}

impl Waiter {
    fn send(self, r: Result<(), AuditError>) {
        match self {
            Self::None | Self::Fold(..) => {}
            Self::Request(w) => {
                let _ = w.send(r);
            }
            Self::Blocking(w) => {
                let _ = w.send(r);
            }
        }
    }
}

/// The handle requests use; cheap to share.
#[derive(Debug)]
pub struct AuditWriter {
    tx: Mutex<Option<SyncSender<Msg>>>,
    shed: Arc<AtomicU64>,
    /// Records the queue could not take, folded; the thread writes them.
    aggregator: Arc<Aggregator>,
    thread: Mutex<Option<JoinHandle<()>>>,
    run: super::chain::RunInfo,
    /// Full records left for unauthenticated callers' refusals.
    unauthenticated: Mutex<TokenBucket>,
    unauthenticated_rate: u32,
    /// Unauthenticated refusals folded (`meshca_audit_unauthenticated_folded_total`).
    folded: prometheus_client::metrics::counter::Counter,
}

impl AuditWriter {
    /// Starts the writer thread on `sink` (whose start checkpoint is written).
    /// `aggregator`: where records the queue cannot take are folded (and
    /// where the transport folds its refusals); the thread drains it into the
    /// chain every `aggregate_interval`.
    pub fn start(
        sink: ChainedSink,
        settings: WriterSettings,
        observer: Option<Arc<dyn CheckpointObserver>>,
        aggregator: Arc<Aggregator>,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel(settings.queue.max(1));
        let shed = sink.shed_counter();
        let run = sink.run().clone();
        if let (Some(o), Some(line)) = (&observer, sink.last_checkpoint()) {
            o.checkpoint(&line);
        }
        let worker = Worker::new(sink, settings, observer, aggregator.clone());
        let thread = std::thread::Builder::new()
            .name("meshca-audit".into())
            .spawn(move || worker.run(rx))?;
        let rate = settings.unauthenticated_rate;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            shed,
            aggregator,
            thread: Mutex::new(Some(thread)),
            run,
            unauthenticated: Mutex::new(TokenBucket::new(rate, rate, Instant::now())),
            unauthenticated_rate: rate,
            folded: Default::default(),
        })
    }

    /// Counts unauthenticated refusals folded into aggregates in `counter`.
    pub fn count_folds_in(mut self, counter: prometheus_client::metrics::counter::Counter) -> Self {
        self.folded = counter;
        self
    }

    /// Folds `record` when it is an unauthenticated caller's refusal past
    /// the rate: its count reaches the chain with the next aggregates, so
    /// an unauthenticated flood writes at most the rate in full records plus
    /// one aggregate per key and interval.
    fn folds(&self, record: &AuditRecord) -> bool {
        if !unauthenticated_refusal(record) {
            return false;
        }
        let within = self.unauthenticated_rate > 0
            && crate::primitives::lock(&self.unauthenticated)
                .reserve(Instant::now(), Duration::ZERO)
                .is_ok();
        if within {
            return false;
        }
        self.aggregator.fold_unauthenticated(record);
        self.folded.inc();
        true
    }

    /// The run the writer's checkpoints name.
    pub fn run(&self) -> &super::chain::RunInfo {
        &self.run
    }

    /// The table refusals are folded into (the transport adds its own).
    pub fn aggregator(&self) -> &Arc<Aggregator> {
        &self.aggregator
    }

    fn send(&self, msg: Msg) -> Result<(), AuditRefusal> {
        let tx = self
            .tx
            .lock()
            .map_err(|_| AuditRefusal::Shed("audit_writer_stopped"))?
            .clone();
        let Some(tx) = tx else {
            return Err(AuditRefusal::Shed("audit_writer_stopped"));
        };
        let (msg, reason) = match tx.try_send(msg) {
            Ok(()) => return Ok(()),
            Err(TrySendError::Full(m)) => (m, "audit_queue_full"),
            Err(TrySendError::Disconnected(m)) => (m, "audit_writer_stopped"),
        };
        self.shed.fetch_add(1, Ordering::Relaxed);
        // The record is not lost: it is counted under its reason and
        // caller, and the writer writes the count into the chain.
        if let Msg::Record(record, _) = &msg {
            self.aggregator.fold_record(record);
        }
        Err(AuditRefusal::Shed(reason))
    }

    /// Writes a checkpoint now and waits for it (blocking: call from a
    /// blocking context). Waits at most `timeout`.
    pub fn checkpoint_blocking(
        &self,
        reason: &'static str,
        timeout: Duration,
    ) -> Result<(), AuditError> {
        let (reply, rx) = mpsc::channel();
        let tx = self
            .tx
            .lock()
            .map_err(|_| AuditError("audit writer poisoned".into()))?
            .clone()
            .ok_or_else(|| AuditError("audit writer stopped".into()))?;
        // A checkpoint is never shed: wait for room, within the deadline.
        let deadline = Instant::now() + timeout;
        let mut msg = Msg::Checkpoint(reason, reply);
        loop {
            match tx.try_send(msg) {
                Ok(()) => break,
                Err(TrySendError::Full(m)) if Instant::now() < deadline => {
                    msg = m;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => {
                    return Err(AuditError(
                        "audit writer did not take the checkpoint".into(),
                    ))
                }
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(r) => r,
            _ => Err(AuditError(
                "audit writer did not write the checkpoint in time".into(),
            )),
        }
    }

    /// Writes the `shutdown` checkpoint and stops the thread (waits at most
    /// `timeout` for it). Requests after this are shed.
    pub fn shutdown_blocking(&self, timeout: Duration) -> Result<(), AuditError> {
        let result = self.checkpoint_blocking("shutdown", timeout);
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
        if result.is_ok() {
            if let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take()) {
                let _ = t.join();
            }
        }
        result
    }
}

impl AuditSink for AuditWriter {
    fn emit(&self, record: &AuditRecord) -> Result<(), AuditError> {
        if self.folds(record) {
            return Ok(());
        }
        self.send(Msg::Record(Box::new(record.clone()), None))
            .map_err(|e| AuditError(e.to_string()))
    }

    fn submit(&self, record: Box<AuditRecord>) -> Result<Ack, AuditRefusal> {
        if self.folds(&record) {
            return Ok(Ack::Written);
        }
        let (reply, rx) = oneshot::channel();
        self.send(Msg::Record(record, Some(reply)))?;
        Ok(Ack::Pending(rx))
    }
}

struct Worker {
    sink: ChainedSink,
    settings: WriterSettings,
    observer: Option<Arc<dyn CheckpointObserver>>,
    aggregator: Arc<Aggregator>,
    last_aggregate: Instant,
    last_checkpoint: Instant,
    /// Records written since the last checkpoint (time-based ones are only
    /// written when some are pending).
    pending: bool,
    /// Checkpoints of the sink already handed to the observer.
    anchored: u64,
}

/// Most messages written before one fsync (bounds the acknowledgement delay
/// of the first record in a long burst).
const MAX_BATCH: usize = 4096;
/// Longest sleep while a batch collects (the queue holds what arrives meanwhile).
const BATCH_SLICE: Duration = Duration::from_micros(250);

impl Worker {
    fn new(
        sink: ChainedSink,
        settings: WriterSettings,
        observer: Option<Arc<dyn CheckpointObserver>>,
        aggregator: Arc<Aggregator>,
    ) -> Self {
        Self {
            settings,
            observer,
            aggregator,
            last_aggregate: Instant::now(),
            last_checkpoint: Instant::now(),
            pending: false,
            anchored: sink.checkpoint_count(),
            sink,
        }
    }

    /// Folded refusals as record messages, at most once per interval
    /// (`force`: now, before a shutdown checkpoint).
    fn aggregates(&mut self, force: bool) -> Vec<Msg> {
        if !force && self.last_aggregate.elapsed() < self.settings.aggregate_interval {
            return Vec::new();
        }
        self.last_aggregate = Instant::now();
        let folded = self.aggregator.take();
        let now = time::OffsetDateTime::now_utc();
        folded
            .entries()
            .into_iter()
            .map(|(key, tally)| {
                let mut r = super::aggregate::record(&key, &tally, now);
                r.bound();
                Msg::Folded(Box::new(r), key, tally)
            })
            .collect()
    }

    fn run(mut self, rx: mpsc::Receiver<Msg>) {
        loop {
            let wait = self
                .settings
                .checkpoint_interval
                .saturating_sub(self.last_checkpoint.elapsed())
                .min(self.settings.aggregate_interval);
            let first = match rx.recv_timeout(wait) {
                Ok(m) => m,
                Err(RecvTimeoutError::Timeout) => {
                    let folded = self.aggregates(false);
                    if !folded.is_empty() && self.write_batch(folded) {
                        return;
                    }
                    if self.last_checkpoint.elapsed() >= self.settings.checkpoint_interval {
                        if self.pending {
                            let _ = self.checkpoint("periodic");
                        }
                        self.last_checkpoint = Instant::now();
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    // Every sender is gone without a shutdown message (the
                    // app was dropped): still close the run with a checkpoint.
                    let folded = self.aggregates(true);
                    if !folded.is_empty() {
                        let _ = self.write_batch(folded);
                    }
                    let _ = self.checkpoint("shutdown");
                    let lost = self.aggregator.take().total();
                    if lost > 0 {
                        tracing::error!(
                            refusals = lost,
                            "folded refusals could not be written before the audit writer stopped"
                        );
                    }
                    return;
                }
            };
            let mut batch = vec![first];
            let deadline = Instant::now() + self.settings.batch_interval;
            let mut slept = false;
            loop {
                let before = batch.len();
                while batch.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(m) => batch.push(m),
                        Err(_) => break,
                    }
                }
                let left = deadline.saturating_duration_since(Instant::now());
                // Commit at the end of the window, when the batch is full, or
                // as soon as a slice brings nothing new: then every sender
                // that is coming is already waiting on this batch (a closed
                // loop of callers), and holding the window open only adds
                // latency.
                let idle = slept && batch.len() == before;
                if self.settings.fsync != FsyncPolicy::Batch
                    || batch.len() >= MAX_BATCH
                    || left.is_zero()
                    || idle
                {
                    break;
                }
                // Sleep in slices through the batch window and take what
                // arrived. Waiting in recv_timeout made every record wake
                // this thread (a futex wake and two context switches per
                // request in the profile under load); a sleeping thread is not
                // woken by senders.
                std::thread::sleep(left.min(BATCH_SLICE));
                slept = true;
            }
            // Folded refusals go out with the batch (at most once per
            // interval), and all of them before a shutdown checkpoint.
            let shutdown = batch
                .iter()
                .any(|m| matches!(m, Msg::Checkpoint("shutdown", _)));
            let folded = self.aggregates(shutdown);
            if !folded.is_empty() {
                let at = batch
                    .iter()
                    .position(|m| matches!(m, Msg::Checkpoint("shutdown", _)))
                    .unwrap_or(batch.len());
                batch.splice(at..at, folded);
            }
            let stop = self.write_batch(batch);
            if stop {
                return;
            }
        }
    }

    /// Writes a batch, makes it durable per the policy, then acknowledges.
    /// Returns true after the shutdown checkpoint.
    fn write_batch(&mut self, batch: Vec<Msg>) -> bool {
        let mark = self.sink.mark();
        let mut acks: Vec<(Waiter, Result<(), AuditError>)> = Vec::new();
        let mut stop = false;
        // The batch's lines go out in one write(2): a write per record was a
        // visible share of the server's CPU. `always` keeps
        // one write and fsync per record.
        let staged = self.settings.fsync != FsyncPolicy::Always;
        if staged {
            self.sink.begin_stage();
        }
        for msg in batch {
            match msg {
                Msg::Record(mut record, reply) => {
                    // The request stopped waiting (cancelled, deadline): its
                    // certificate can no longer leave, so the log must not
                    // say it was issued.
                    if record.decision == Decision::Allow
                        && reply.as_ref().is_some_and(|r| r.is_closed())
                    {
                        record.decision = Decision::Deny;
                        record.reason = "request_abandoned".into();
                        record.detail =
                            Some("the caller stopped waiting before its record was written".into());
                    }
                    // Unstaged (`always`): each record is made durable alone.
                    let mark = if staged { None } else { self.sink.mark() };
                    let mut r = self.sink.emit(&record);
                    self.pending = true;
                    if r.is_ok() && !staged {
                        r = self.durable(mark.as_ref());
                    }
                    acks.push((reply.map_or(Waiter::None, Waiter::Request), r));
                }
                Msg::Folded(record, key, tally) => {
                    let mark = if staged { None } else { self.sink.mark() };
                    let mut r = self.sink.emit(&record);
                    self.pending = true;
                    if r.is_ok() && !staged {
                        r = self.durable(mark.as_ref());
                    }
                    acks.push((Waiter::Fold(key, tally), r));
                }
                Msg::Checkpoint(reason, reply) => {
                    let r = self.checkpoint(reason);
                    stop |= reason == "shutdown" && r.is_ok();
                    acks.push((Waiter::Blocking(reply), r));
                }
            }
        }
        let written = if staged {
            self.sink.end_stage()
        } else {
            Ok(())
        };
        if let Err(e) = written {
            // The staged lines are not in the log (the chain head is back
            // before them): none of the batch's records may be acknowledged,
            // nor a checkpoint among them anchored.
            self.anchored = self.sink.checkpoint_count();
            tracing::error!(error = %e, "audit write failed; the batch's records are refused");
            for (_, r) in &mut acks {
                if r.is_ok() {
                    *r = Err(AuditError(e.0.clone()));
                }
            }
        } else if self.settings.fsync == FsyncPolicy::Batch {
            if let Err(e) = self.durable(mark.as_ref()) {
                for (_, r) in &mut acks {
                    if r.is_ok() {
                        *r = Err(AuditError(e.0.clone()));
                    }
                }
            }
        }
        for (waiter, r) in acks {
            match waiter {
                // Counts are never lost to a failed write: they go back into
                // the table and out with the next drain (or at shutdown).
                Waiter::Fold(key, tally) if r.is_err() => self.aggregator.restore_one(key, tally),
                w => w.send(r),
            }
        }
        self.anchor();
        stop
    }

    /// fsync; when it fails, the lines since `mark` are cut off so no record
    /// of a refused request stays in the log.
    fn durable(&mut self, mark: Option<&super::chain::Mark>) -> Result<(), AuditError> {
        let r = self.sink.sync();
        if let Err(e) = &r {
            // A checkpoint in the undone lines must not be anchored.
            self.anchored = self.sink.checkpoint_count();
            let undone = mark.is_some_and(|m| self.sink.rollback(m));
            tracing::error!(error = %e, undone, "audit fsync failed; the records it should have covered are refused");
        }
        r
    }

    fn checkpoint(&mut self, reason: &str) -> Result<(), AuditError> {
        let mark = self.sink.mark();
        self.sink.checkpoint(reason)?;
        if self.settings.fsync != FsyncPolicy::Never || reason == "shutdown" {
            self.durable(mark.as_ref())?;
        } else {
            // Anchored below: it must be in the file first.
            self.sink.flush_staged()?;
        }
        self.pending = false;
        self.last_checkpoint = Instant::now();
        self.anchor();
        Ok(())
    }

    /// Hands the newest checkpoint (periodic, rotation, recovery or one
    /// asked for) to the observer once it is durable.
    fn anchor(&mut self) {
        let n = self.sink.checkpoint_count();
        if n == self.anchored {
            return;
        }
        self.anchored = n;
        if let (Some(o), Some(line)) = (&self.observer, self.sink.last_checkpoint()) {
            o.checkpoint(&line);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::chain::{Destination, SinkOptions};
    use crate::audit::verify::verify_lines;
    use time::OffsetDateTime;

    fn record(i: u64) -> AuditRecord {
        AuditRecord::new(
            OffsetDateTime::now_utc(),
            format!("req-{i}"),
            Decision::Allow,
            "issued".into(),
        )
    }

    /// Shuts the writer down from a test's runtime (it blocks).
    async fn shut_down(w: &Arc<AuditWriter>) {
        let w = w.clone();
        tokio::task::spawn_blocking(move || w.shutdown_blocking(Duration::from_secs(5)))
            .await
            .unwrap()
            .unwrap();
    }

    fn agg() -> Arc<Aggregator> {
        Arc::new(Aggregator::new(64))
    }

    fn settings(queue: usize, fsync: FsyncPolicy) -> WriterSettings {
        WriterSettings {
            queue,
            fsync,
            batch_interval: Duration::from_millis(2),
            checkpoint_interval: Duration::from_secs(60),
            aggregate_interval: Duration::from_millis(100),
            unauthenticated_rate: DEFAULT_UNAUTHENTICATED_RATE,
        }
    }

    /// A writer whose output blocks until released (a reader that stopped).
    #[derive(Clone)]
    struct Gate(Arc<(Mutex<bool>, std::sync::Condvar)>, Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Gate {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let (open, cv) = &*self.0;
            let mut o = open.lock().unwrap();
            while !*o {
                o = cv.wait(o).unwrap();
            }
            self.1.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_full_queue_sheds_at_once_and_the_checkpoint_counts_it() {
        let gate = Gate(Default::default(), Default::default());
        *gate.0 .0.lock().unwrap() = true;
        let sink = ChainedSink::open(SinkOptions::new(Destination::Writer(Box::new(
            gate.clone(),
        ))))
        .unwrap();
        *gate.0 .0.lock().unwrap() = false;
        let w = Arc::new(
            AuditWriter::start(sink, settings(2, FsyncPolicy::Never), None, agg()).unwrap(),
        );
        // The first record is taken by the thread and blocks in write; two
        // more fill the queue; the rest are shed without waiting.
        let mut waiting = vec![];
        let mut shed = 0;
        for i in 0..10 {
            match w.submit(Box::new(record(i))) {
                Ok(Ack::Pending(rx)) => waiting.push(rx),
                Ok(Ack::Written) => panic!("the writer never writes in place"),
                Err(AuditRefusal::Shed(r)) => {
                    assert_eq!(r, "audit_queue_full");
                    shed += 1;
                }
                Err(e) => panic!("{e}"),
            }
            if i == 0 {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        assert_eq!(waiting.len(), 3, "one in write, two queued");
        assert_eq!(shed, 7);
        {
            let (open, cv) = &*gate.0;
            *open.lock().unwrap() = true;
            cv.notify_all();
        }
        for rx in waiting {
            rx.await.unwrap().unwrap();
        }
        shut_down(&w).await;
        let data = gate.1.lock().unwrap().clone();
        let text = String::from_utf8(data).unwrap();
        let lines: Vec<(String, String)> = text
            .lines()
            .enumerate()
            .map(|(i, l)| (format!("mem:{}", i + 1), l.to_string()))
            .collect();
        let rep = verify_lines(&lines, None).unwrap();
        // The three written, and one aggregate standing for the seven shed:
        // issued records the queue could not take are refusals.
        assert_eq!(rep.records, 4);
        let last: serde_json::Value = serde_json::from_str(&lines.last().unwrap().1).unwrap();
        assert_eq!(last["reason"], "shutdown");
        assert_eq!(last["shed"], 7, "{last}");
        let folded: Vec<serde_json::Value> = lines
            .iter()
            .filter_map(|(_, l)| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["aggregate"].is_object())
            .collect();
        assert_eq!(folded.len(), 1, "{folded:?}");
        assert_eq!(folded[0]["reason"], "audit_queue_full");
        assert_eq!(folded[0]["decision"], "deny");
        assert_eq!(folded[0]["count"], 7);
        assert_eq!(folded[0]["aggregate"]["source"], "audit_queue_full");
    }

    #[tokio::test]
    async fn a_record_whose_caller_left_is_not_written_as_issued() {
        let gate = Gate(Default::default(), Default::default());
        *gate.0 .0.lock().unwrap() = true;
        let sink = ChainedSink::open(SinkOptions::new(Destination::Writer(Box::new(
            gate.clone(),
        ))))
        .unwrap();
        *gate.0 .0.lock().unwrap() = false;
        let w = AuditWriter::start(sink, settings(8, FsyncPolicy::Never), None, agg()).unwrap();
        let Ok(Ack::Pending(blocker)) = w.submit(Box::new(record(0))) else {
            panic!()
        };
        std::thread::sleep(Duration::from_millis(50));
        let Ok(Ack::Pending(gone)) = w.submit(Box::new(record(1))) else {
            panic!()
        };
        drop(gone);
        {
            let (open, cv) = &*gate.0;
            *open.lock().unwrap() = true;
            cv.notify_all();
        }
        blocker.await.unwrap().unwrap();
        tokio::task::spawn_blocking(move || w.shutdown_blocking(Duration::from_secs(5)))
            .await
            .unwrap()
            .unwrap();
        let text = String::from_utf8(gate.1.lock().unwrap().clone()).unwrap();
        let req1 = text.lines().find(|l| l.contains("\"req-1\"")).unwrap();
        let v: serde_json::Value = serde_json::from_str(req1).unwrap();
        assert_eq!(v["decision"], "deny");
        assert_eq!(v["reason"], "request_abandoned");
    }

    /// An output that refuses every write while `full` is set (ENOSPC).
    #[derive(Clone, Default)]
    struct Full(
        Arc<std::sync::atomic::AtomicBool>,
        Arc<Mutex<Vec<u8>>>,
        /// Writes refused so far.
        Arc<AtomicU64>,
    );
    impl std::io::Write for Full {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.0.load(Ordering::SeqCst) {
                self.2.fetch_add(1, Ordering::SeqCst);
                return Err(std::io::Error::from_raw_os_error(28));
            }
            self.1.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    // The batch's lines are written together: when that write fails, no
    // record of the batch is acknowledged and none is in the log.
    #[test_case::test_case(FsyncPolicy::Batch ; "batch")]
    #[test_case::test_case(FsyncPolicy::Never ; "never")]
    #[tokio::test]
    async fn a_batch_whose_write_fails_acknowledges_none_of_it(fsync: FsyncPolicy) {
        let out = Full::default();
        let sink = ChainedSink::open(SinkOptions::new(Destination::Writer(Box::new(out.clone()))))
            .unwrap();
        let w = Arc::new(AuditWriter::start(sink, settings(1024, fsync), None, agg()).unwrap());
        let submit_all = |range: std::ops::Range<u64>| {
            range
                .map(|i| match w.submit(Box::new(record(i))) {
                    Ok(Ack::Pending(rx)) => rx,
                    _ => panic!("not queued"),
                })
                .collect::<Vec<_>>()
        };
        out.0.store(true, Ordering::SeqCst);
        for rx in submit_all(0..50) {
            assert!(
                rx.await.unwrap().is_err(),
                "acknowledged an unwritten record"
            );
        }
        out.0.store(false, Ordering::SeqCst);
        for rx in submit_all(50..55) {
            rx.await.unwrap().unwrap();
        }
        shut_down(&w).await;
        let data = out.1.lock().unwrap().clone();
        let lines: Vec<(String, Vec<u8>)> = data
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .enumerate()
            .map(|(i, l)| (format!("mem:{i}"), l.to_vec()))
            .collect();
        let rep = verify_lines(&lines, None).unwrap();
        assert_eq!(rep.records, 5);
        let text = String::from_utf8_lossy(&data);
        assert!(!text.contains("\"req-0\"") && !text.contains("\"req-49\""));
    }

    #[tokio::test]
    async fn batch_mode_acknowledges_after_the_covering_fsync() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        let sink =
            ChainedSink::open(SinkOptions::new(Destination::file(&path, 1 << 30, 3))).unwrap();
        let w = Arc::new(
            AuditWriter::start(sink, settings(1024, FsyncPolicy::Batch), None, agg()).unwrap(),
        );
        let mut rxs = vec![];
        for i in 0..200 {
            match w.submit(Box::new(record(i))).unwrap() {
                Ack::Pending(rx) => rxs.push(rx),
                Ack::Written => panic!(),
            }
        }
        for rx in rxs {
            rx.await.unwrap().unwrap();
        }
        // Acknowledged means in the file (the fsync is not observable here;
        // the crash test kills the process to check it).
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text.lines().filter(|l| l.contains("\"audit\"")).count(),
            200
        );
        shut_down(&w).await;
        let lines = crate::audit::verify::read_lines(&[&path]).unwrap();
        let rep = verify_lines(&lines, None).unwrap();
        assert_eq!(rep.records, 200);
        assert!(matches!(
            w.submit(Box::new(record(1))),
            Err(AuditRefusal::Shed("audit_writer_stopped"))
        ));
    }

    /// The lines of a writer's output, for `verify_lines`.
    fn output_lines(data: &[u8]) -> Vec<(String, Vec<u8>)> {
        data.split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .enumerate()
            .map(|(i, l)| (format!("mem:{}", i + 1), l.to_vec()))
            .collect()
    }

    /// Sum of `count` over the aggregate records of `reason`.
    fn folded_count(lines: &[(String, Vec<u8>)], reason: &str) -> u64 {
        lines
            .iter()
            .filter_map(|(_, l)| serde_json::from_slice::<serde_json::Value>(l).ok())
            .filter(|v| v["aggregate"].is_object() && v["reason"] == reason)
            .map(|v| v["count"].as_u64().unwrap())
            .sum()
    }

    /// Folded counts whose aggregate records could not be written go back
    /// into the table and reach the log with a later write.
    #[test_case::test_case(FsyncPolicy::Batch ; "batch")]
    #[test_case::test_case(FsyncPolicy::Always ; "always")]
    #[tokio::test]
    async fn folded_counts_survive_a_failed_write(fsync: FsyncPolicy) {
        let out = Full::default();
        let sink = ChainedSink::open(SinkOptions::new(Destination::Writer(Box::new(out.clone()))))
            .unwrap();
        let aggregator = agg();
        let w = Arc::new(
            AuditWriter::start(sink, settings(64, fsync), None, aggregator.clone()).unwrap(),
        );
        out.0.store(true, Ordering::SeqCst);
        for _ in 0..7 {
            aggregator.fold_transport("10.0.0.9".parse().unwrap(), "message_too_large");
        }
        // Several aggregate intervals pass while every write fails.
        let deadline = Instant::now() + Duration::from_secs(5);
        while out.2.load(Ordering::SeqCst) < 3 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            out.2.load(Ordering::SeqCst) >= 3,
            "the writer tried to write them"
        );
        out.0.store(false, Ordering::SeqCst);
        for _ in 0..3 {
            aggregator.fold_transport("10.0.0.9".parse().unwrap(), "message_too_large");
        }
        shut_down(&w).await;
        let lines = output_lines(&out.1.lock().unwrap());
        verify_lines(&lines, None).unwrap();
        assert_eq!(folded_count(&lines, "message_too_large"), 10);
    }

    /// What is folded right before a stop is written before the shutdown
    /// checkpoint, however long the aggregate interval.
    #[tokio::test]
    async fn folded_counts_are_written_before_the_shutdown_checkpoint() {
        let out = Full::default();
        let sink = ChainedSink::open(SinkOptions::new(Destination::Writer(Box::new(out.clone()))))
            .unwrap();
        let aggregator = agg();
        let mut s = settings(64, FsyncPolicy::Batch);
        s.aggregate_interval = Duration::from_secs(3600);
        let w = Arc::new(AuditWriter::start(sink, s, None, aggregator.clone()).unwrap());
        for i in 0..5u8 {
            aggregator.fold_transport(std::net::IpAddr::from([10, 0, 0, i]), "request_timeout");
        }
        shut_down(&w).await;
        let lines = output_lines(&out.1.lock().unwrap());
        let rep = verify_lines(&lines, None).unwrap();
        assert_eq!(rep.last_checkpoint_reason.as_deref(), Some("shutdown"));
        assert_eq!(folded_count(&lines, "request_timeout"), 5);
        assert!(aggregator.is_empty());
    }

    fn refusal(i: u64, peer: &str) -> AuditRecord {
        let mut r = AuditRecord::new(
            OffsetDateTime::now_utc(),
            format!("anon-{i}"),
            Decision::Deny,
            "authn_no_credentials".into(),
        );
        r.peer = Some(peer.into());
        r
    }

    /// Past `--audit-unauthenticated-rate`, unauthenticated refusals are
    /// counted, not written one by one; authenticated refusals and issued
    /// records are never folded; every refusal is accounted for exactly.
    #[tokio::test]
    async fn unauthenticated_refusals_past_the_rate_are_folded_with_exact_counts() {
        let out = Full::default();
        let sink = ChainedSink::open(SinkOptions::new(Destination::Writer(Box::new(out.clone()))))
            .unwrap();
        let mut s = settings(64, FsyncPolicy::Batch);
        s.unauthenticated_rate = 5;
        let counter = prometheus_client::metrics::counter::Counter::default();
        let w = Arc::new(
            AuditWriter::start(sink, s, None, agg())
                .unwrap()
                .count_folds_in(counter.clone()),
        );
        const N: u64 = 1000;
        let started = Instant::now();
        for i in 0..N {
            match w.submit(Box::new(refusal(i, "10.1.1.1:4000"))).unwrap() {
                Ack::Written => {}
                Ack::Pending(rx) => rx.await.unwrap().unwrap(),
            }
        }
        let took = started.elapsed().as_secs_f64();
        let mut authed = refusal(N, "10.1.1.1:4000");
        authed.caller_identity = Some("spiffe://cluster.local/ns/a/sa/b".into());
        let Ok(Ack::Pending(rx)) = w.submit(Box::new(authed)) else {
            panic!("an authenticated refusal is written in full")
        };
        rx.await.unwrap().unwrap();
        let Ok(Ack::Pending(rx)) = w.submit(Box::new(record(N + 1))) else {
            panic!("an issued record is written in full")
        };
        rx.await.unwrap().unwrap();
        shut_down(&w).await;
        let lines = output_lines(&out.1.lock().unwrap());
        verify_lines(&lines, None).unwrap();
        let full = lines
            .iter()
            .filter_map(|(_, l)| serde_json::from_slice::<serde_json::Value>(l).ok())
            .filter(|v| {
                v["reason"] == "authn_no_credentials"
                    && v["aggregate"].is_null()
                    && v["caller_identity"].is_null()
            })
            .count() as u64;
        let folded = folded_count(&lines, "authn_no_credentials");
        // The burst, and what the bucket refilled while the loop ran.
        let most = 5 + (5.0 * took).ceil() as u64;
        assert!(
            (5..=most).contains(&full),
            "{full} full records in {took:.2}s"
        );
        assert_eq!(full + folded, N, "exact");
        assert_eq!(counter.get(), folded);
        let text = String::from_utf8_lossy(&out.1.lock().unwrap()).into_owned();
        assert!(text.contains("\"source\":\"unauthenticated\""), "{text}");
        assert!(text.contains(&format!("\"req-{}\"", N + 1)));
    }
}
