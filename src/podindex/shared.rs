//! What every watch-fed index shares: a state readers see through a lock
//! the watch holds only to swap or apply one event, a (re)list buffered
//! outside that lock, readiness and size mirrored in atomics (health checks
//! and metrics never take the lock the request path uses), and how long the
//! watch has been disconnected.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

use futures::{Stream, StreamExt};
use kube::runtime::watcher::Event;

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

/// Whether a watch is following its API server, lock-free: how long it has
/// been disconnected, if it is.
#[derive(Debug)]
pub struct WatchHealth {
    /// Milliseconds since `epoch` + 1 at which the watch lost the API
    /// server; 0 while connected.
    disconnected_at: AtomicU64,
    epoch: std::time::Instant,
}

impl Default for WatchHealth {
    fn default() -> Self {
        Self {
            disconnected_at: AtomicU64::new(0),
            epoch: std::time::Instant::now(),
        }
    }
}

impl WatchHealth {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }

    /// The watch failed: it stops following the API server from now (the
    /// first failure counts; later ones do not move it).
    pub fn mark_disconnected(&self) {
        let now = self.now_ms() + 1;
        let _ = self
            .disconnected_at
            .compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire);
    }

    /// The watch delivered a current event again.
    pub fn mark_connected(&self) {
        self.disconnected_at.store(0, Ordering::Release);
    }

    /// How long the watch has been disconnected; `None` while connected.
    pub fn disconnected_for(&self) -> Option<std::time::Duration> {
        match self.disconnected_at.load(Ordering::Acquire) {
            0 => None,
            at => Some(std::time::Duration::from_millis(
                self.now_ms().saturating_sub(at - 1),
            )),
        }
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

    /// The watch failed: the index stops following the API server from now
    /// (the first failure counts; later ones do not move it).
    pub fn mark_disconnected(&self) {
        self.health.mark_disconnected()
    }

    /// The watch delivered a current event again.
    pub fn mark_connected(&self) {
        self.health.mark_connected()
    }

    /// How long the watch has been disconnected; `None` while connected.
    pub fn disconnected_for(&self) -> Option<std::time::Duration> {
        self.health.disconnected_for()
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

/// Feeds `index` from a kube-runtime watch stream (with its backoff) until
/// the stream ends, turning each object into the index's lean form with
/// `lean`. A relist in progress is not current yet; any other event is. The
/// index keeps serving its last state while the API server is unreachable,
/// and says for how long.
pub async fn follow<K, S>(
    stream: impl Stream<Item = Result<Event<K>, kube::runtime::watcher::Error>>,
    index: &Shared<S>,
    what: &'static str,
    lean: impl Fn(K) -> S::Item,
) where
    S: Indexed,
{
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        match event {
            Ok(e) => {
                let done = matches!(e, Event::InitDone);
                if !matches!(e, Event::Init | Event::InitApply(_)) {
                    index.mark_connected();
                }
                index.apply(match e {
                    Event::Init => IndexEvent::Init,
                    Event::InitApply(o) => IndexEvent::InitApply(lean(o)),
                    Event::InitDone => IndexEvent::InitDone,
                    Event::Apply(o) => IndexEvent::Apply(lean(o)),
                    Event::Delete(o) => IndexEvent::Delete(lean(o)),
                });
                if done {
                    tracing::info!(objects = index.len(), "{what} index synced");
                }
            }
            Err(e) => {
                index.mark_disconnected();
                tracing::warn!(error = %e, "{what} watch error; retrying with backoff");
            }
        }
    }
}
