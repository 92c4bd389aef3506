//! What every watch-fed index shares: a state readers see through a lock
//! the watch holds only to swap or apply one event, a (re)list buffered
//! outside that lock, readiness and size mirrored in atomics (health checks
//! and metrics never take the lock the request path uses), and whether the
//! watch still follows the API server, judged by evidence of freshness.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

use super::IndexEvent;
use crate::primitives::lock;

/// A state a watch feeds: built whole from a completed list, then changed
/// one event at a time.
pub trait Indexed: Default {
    type Item;
    fn from_list(items: Vec<Self::Item>) -> Self;
    fn apply(&mut self, event: IndexEvent<Self::Item>);
    fn synced(&self) -> bool;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Whether a watch is following its API server, lock-free. Freshness is
/// shown, not assumed: the watch marks each piece of evidence that the index
/// is current (a completed list, a watch the API server accepted, an event,
/// a bookmark), and the index counts as disconnected once it has gone
/// without evidence longer than the watch promises to bring some
/// ([`WatchHealth::expect_evidence_within`]), or once the watch failed. A
/// connection that stays open but silent (a partition, a stopped API
/// server) then goes stale like a broken one.
#[derive(Debug)]
pub struct WatchHealth {
    /// Milliseconds since `epoch` + 1 of the last evidence; 0 before any.
    fresh_at: AtomicU64,
    /// Milliseconds since `epoch` + 1 of the first failure since the last
    /// evidence; 0 while none.
    failed_at: AtomicU64,
    /// Longer than this (ms) without evidence, the watch is silent: no
    /// bound until a watch sets one.
    silent_after: AtomicU64,
    epoch: std::time::Instant,
}

impl Default for WatchHealth {
    fn default() -> Self {
        Self {
            fresh_at: AtomicU64::new(0),
            failed_at: AtomicU64::new(0),
            silent_after: AtomicU64::new(u64::MAX),
            epoch: std::time::Instant::now(),
        }
    }
}

impl WatchHealth {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }

    /// The watch brings evidence at least this often while it follows the
    /// API server; longer without any, the index counts as disconnected.
    pub fn expect_evidence_within(&self, bound: std::time::Duration) {
        let ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX);
        self.silent_after.store(ms, Ordering::Release);
    }

    /// Evidence that the index is current as of now.
    pub fn mark_fresh(&self) {
        self.fresh_at.store(self.now_ms() + 1, Ordering::Release);
        self.failed_at.store(0, Ordering::Release);
    }

    /// The watch failed or fell silent (the first failure since the last
    /// evidence counts; later ones do not move it).
    pub fn mark_disconnected(&self) {
        let now = self.now_ms() + 1;
        let _ = self
            .failed_at
            .compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Time since the last evidence that the index is current; `None`
    /// before any.
    pub fn freshness_age(&self) -> Option<std::time::Duration> {
        match self.fresh_at.load(Ordering::Acquire) {
            0 => None,
            at => Some(std::time::Duration::from_millis(
                self.now_ms().saturating_sub(at - 1),
            )),
        }
    }

    /// How long the index may have been missing changes, once its watch
    /// failed or fell silent: the time since the last evidence (since the
    /// failure when there never was any). `None` while the watch follows.
    pub fn disconnected_for(&self) -> Option<std::time::Duration> {
        let fresh = self.fresh_at.load(Ordering::Acquire);
        let failed = self.failed_at.load(Ordering::Acquire);
        let since = match (fresh, failed) {
            (0, 0) => return None,
            (0, f) => f - 1,
            (f, _) => f - 1,
        };
        let age = self.now_ms().saturating_sub(since);
        let silent = age > self.silent_after.load(Ordering::Acquire);
        (failed != 0 || silent).then(|| std::time::Duration::from_millis(age))
    }
}

/// The shared, concurrently readable index over state `S`.
pub struct Shared<S: Indexed> {
    state: RwLock<S>,
    /// A (re)list in progress, built into a new state without the lock the
    /// request path reads, then swapped in at `InitDone`.
    relist: Mutex<Option<Vec<S::Item>>>,
    synced: AtomicBool,
    /// Wakes [`Shared::wait_synced`] callers when the first list lands.
    synced_notify: tokio::sync::Notify,
    size: AtomicU64,
    events: AtomicU64,
    health: WatchHealth,
}

impl<S: Indexed> Default for Shared<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S: Indexed> std::fmt::Debug for Shared<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("synced", &self.is_synced())
            .field("len", &self.len())
            .field("disconnected_for", &self.disconnected_for())
            .finish_non_exhaustive()
    }
}

impl<S: Indexed> Shared<S> {
    pub fn new() -> Self {
        Self {
            state: RwLock::new(S::default()),
            relist: Mutex::new(None),
            synced: AtomicBool::new(false),
            synced_notify: tokio::sync::Notify::new(),
            size: AtomicU64::new(0),
            events: AtomicU64::new(0),
            health: WatchHealth::default(),
        }
    }

    /// Whether the watch follows the API server (see [`WatchHealth`]).
    pub fn health(&self) -> &WatchHealth {
        &self.health
    }

    /// The watch failed or fell silent (see [`WatchHealth::mark_disconnected`]).
    pub fn mark_disconnected(&self) {
        self.health.mark_disconnected()
    }

    /// How long the index may have been missing changes, once its watch
    /// failed or fell silent; `None` while it follows the API server (see
    /// [`WatchHealth::disconnected_for`]).
    pub fn disconnected_for(&self) -> Option<std::time::Duration> {
        self.health.disconnected_for()
    }

    /// Time since the last evidence that the index is current.
    pub fn freshness_age(&self) -> Option<std::time::Duration> {
        self.health.freshness_age()
    }

    pub fn apply(&self, event: IndexEvent<S::Item>) {
        let event = match event {
            IndexEvent::Init => {
                *lock(&self.relist) = Some(Vec::new());
                None
            }
            IndexEvent::InitApply(item) => match lock(&self.relist).as_mut() {
                Some(buf) => {
                    buf.push(item);
                    None
                }
                None => Some(IndexEvent::InitApply(item)),
            },
            IndexEvent::InitDone => {
                let items = lock(&self.relist).take().unwrap_or_default();
                let fresh = S::from_list(items);
                let old = std::mem::replace(&mut *self.write(), fresh);
                drop(old); // freed outside the lock
                None
            }
            other => Some(other),
        };
        let (synced, len) = {
            let mut s = self.write();
            if let Some(e) = event {
                s.apply(e);
            }
            (s.synced(), s.len())
        };
        self.synced.store(synced, Ordering::Release);
        if synced {
            self.synced_notify.notify_waiters();
        }
        self.size.store(len as u64, Ordering::Relaxed);
        self.events.fetch_add(1, Ordering::Relaxed);
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, S> {
        self.state
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// True once the first full list has been applied.
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// Waits at most `within` for the first full list; returns whether the
    /// index is synced. After a (re)start every caller arrives before the
    /// list does: waiting the second or two it takes beats refusing them
    /// (their clients back off for seconds, ztunnel doubling from ~1 s) or
    /// sending every token to TokenReview.
    pub async fn wait_synced(&self, within: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.synced_notify.notified();
            tokio::pin!(notified);
            // Registered before the check, so a sync between the two still wakes us.
            notified.as_mut().enable();
            if self.is_synced() {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.is_synced();
            }
        }
    }

    pub fn len(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn events_applied(&self) -> u64 {
        self.events.load(Ordering::Relaxed)
    }

    /// Runs `f` over a consistent view of the index.
    pub fn read<R>(&self, f: impl FnOnce(&S) -> R) -> R {
        match self.state.read() {
            Ok(s) => f(&s),
            Err(poisoned) => f(&poisoned.into_inner()),
        }
    }
}
