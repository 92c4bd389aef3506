//! The slots for CPU-heavy work and the fair, deadline-aware queue in front
//! of them. Waiters are ordered by start-time fair queueing over caller keys
//! ([`super::fair`]): a freed slot goes to the waiter whose caller has had
//! the least recent service, and a full queue sheds the waiter of the
//! caller that has had the most.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use tokio::sync::oneshot;

use super::decide::{admit, Admit, QueueState};
use super::fair::{FairTable, Place};
use super::ShedReason;

/// What a waiter is told.
#[derive(Debug)]
enum Grant {
    Run(Permit),
    Shed(ShedReason),
}

#[derive(Debug)]
struct Waiter {
    start_by: Instant,
    tx: oneshot::Sender<Grant>,
}

#[derive(Debug, Default)]
struct State {
    running: usize,
    table: FairTable<Waiter>,
}

#[derive(Debug)]
struct Inner {
    max_running: usize,
    max_queued: usize,
    state: Mutex<State>,
    metrics: Option<Arc<dyn super::AdmissionObserver>>,
}

/// Shared handle to the slots and queue.
#[derive(Debug, Clone)]
pub struct FairQueue(Arc<Inner>);

/// A slot for CPU-heavy work; handed to the next waiter when dropped.
#[derive(Debug)]
pub struct Permit {
    queue: Arc<Inner>,
    armed: bool,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.armed {
            self.armed = false;
            FairQueue(self.queue.clone()).release();
        }
    }
}

/// Removes a waiter that gave up (timeout, or its request was dropped).
struct WaitGuard<'a> {
    queue: &'a FairQueue,
    place: Place,
    /// Still in the queue (false once granted or shed).
    waiting: bool,
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        if !self.waiting {
            return;
        }
        let mut s = self.queue.lock();
        s.table.remove(self.place);
        self.queue.gauges(&s);
    }
}

impl FairQueue {
    pub fn new(
        max_running: usize,
        max_queued: usize,
        metrics: Option<Arc<dyn super::AdmissionObserver>>,
    ) -> Self {
        Self(Arc::new(Inner {
            max_running: max_running.max(1),
            max_queued,
            state: Mutex::new(State::default()),
            metrics,
        }))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.0.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn gauges(&self, s: &State) {
        if let Some(m) = &self.0.metrics {
            m.occupancy(s.running, s.table.len());
        }
    }

    /// (running, queued) now.
    pub fn stats(&self) -> (usize, usize) {
        let s = self.lock();
        (s.running, s.table.len())
    }

    pub fn max_queued(&self) -> usize {
        self.0.max_queued
    }

    /// (waiters, whether a caller other than `key` is among them), under one lock.
    pub fn waiting_besides(&self, key: &str) -> (usize, bool) {
        let s = self.lock();
        (s.table.len(), s.table.others_waiting(key))
    }

    fn permit(&self) -> Permit {
        Permit {
            queue: self.0.clone(),
            armed: true,
        }
    }

    /// Hands the slot to the next waiter, or frees it.
    fn release(&self) {
        loop {
            let next = {
                let mut s = self.lock();
                let now = Instant::now();
                // Waiters whose start-by time passed are dropped on the way
                // (their receiver sees the sender gone: deadline).
                let next = s.table.pop_next(|w| w.start_by > now);
                if next.is_none() {
                    s.running -= 1;
                }
                self.gauges(&s);
                next
            };
            let Some(w) = next else { return };
            match w.tx.send(Grant::Run(self.permit())) {
                Ok(()) => return,
                // The waiter is gone: the slot goes to the next one.
                Err(Grant::Run(mut p)) => p.armed = false,
                Err(Grant::Shed(_)) => return,
            }
        }
    }

    /// Waits for a slot under caller `key` until `start_by`. Dropping the
    /// returned future (the caller cancelled) leaves the queue at once.
    pub async fn acquire(&self, key: &str, start_by: Instant) -> Result<Permit, ShedReason> {
        let now = Instant::now();
        if now >= start_by {
            return Err(ShedReason::DeadlineExceeded);
        }
        let (place, mut rx, evicted) = {
            let mut s = self.lock();
            let verdict = admit(&QueueState {
                running: s.running,
                max_running: self.0.max_running,
                queued: s.table.len(),
                max_queued: self.0.max_queued,
                tag: s.table.tag(key),
                last_tag: s.table.last_tag(),
            });
            let evicted = match verdict {
                Admit::Run => {
                    s.table.start_now(&Arc::from(key));
                    s.running += 1;
                    self.gauges(&s);
                    return Ok(self.permit());
                }
                Admit::Shed(r) => return Err(r),
                Admit::Enqueue => None,
                Admit::EnqueueEvicting => s.table.pop_last().map(|(_, w)| w),
            };
            let (tx, rx) = oneshot::channel();
            let place = s.table.push(Arc::from(key), Waiter { start_by, tx });
            self.gauges(&s);
            (place, rx, evicted)
        };
        if let Some(w) = evicted {
            let _ = w.tx.send(Grant::Shed(ShedReason::QueueDisplaced));
        }
        let mut guard = WaitGuard {
            queue: self,
            place,
            waiting: true,
        };
        let granted = tokio::select! {
            g = &mut rx => g,
            _ = tokio::time::sleep_until(start_by.into()) => {
                drop(guard);
                // A grant may have landed just before the guard left the
                // queue; the permit then goes straight back (it is dropped).
                return Err(rx.try_recv().ok().map_or(ShedReason::DeadlineExceeded, |g| match g {
                    Grant::Shed(r) => r,
                    Grant::Run(_) => ShedReason::DeadlineExceeded,
                }));
            }
        };
        // Granted or shed: the waiter already left the queue.
        guard.waiting = false;
        match granted {
            Ok(Grant::Run(p)) if Instant::now() < start_by => Ok(p),
            Ok(Grant::Run(_)) => Err(ShedReason::DeadlineExceeded),
            Ok(Grant::Shed(r)) => Err(r),
            // Dropped from the queue as expired.
            Err(_) => Err(ShedReason::DeadlineExceeded),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    #[tokio::test]
    async fn slots_bound_running_work_and_pass_on_release() {
        let q = FairQueue::new(2, 8, None);
        let a = q.acquire("a", later()).await.unwrap();
        let _b = q.acquire("b", later()).await.unwrap();
        let mut c = Box::pin(q.acquire("c", later()));
        assert!(futures::poll!(c.as_mut()).is_pending());
        assert_eq!(q.stats(), (2, 1));
        drop(a);
        let _c = c.await.unwrap();
        assert_eq!(q.stats(), (2, 0));
    }

    #[tokio::test]
    async fn round_robin_over_callers() {
        let q = FairQueue::new(1, 64, None);
        let hold = q.acquire("x", later()).await.unwrap();
        let served = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        // "greedy" queues 6 before "polite" queues 2.
        for key in ["greedy"; 6].into_iter().chain(["polite"; 2]) {
            let (q2, served) = (q.clone(), served.clone());
            tasks.push(tokio::spawn(async move {
                let p = q2.acquire(key, later()).await.unwrap();
                served.lock().unwrap().push(key);
                tokio::task::yield_now().await;
                drop(p);
            }));
            // Enqueue in this exact order.
            while q.stats().1 < tasks.len() {
                tokio::task::yield_now().await;
            }
        }
        drop(hold);
        for t in tasks {
            t.await.unwrap();
        }
        let order = served.lock().unwrap().clone();
        assert_eq!(
            &order[..4],
            &["greedy", "polite", "greedy", "polite"],
            "turns alternate: {order:?}"
        );
    }

    #[tokio::test]
    async fn a_full_queue_displaces_the_greediest_caller() {
        let q = FairQueue::new(1, 3, None);
        let _hold = q.acquire("x", later()).await.unwrap();
        let mut greedy: Vec<_> = (0..3)
            .map(|_| Box::pin(q.acquire("greedy", later())))
            .collect();
        for g in &mut greedy {
            assert!(futures::poll!(g.as_mut()).is_pending());
        }
        let mut polite = Box::pin(q.acquire("polite", later()));
        assert!(futures::poll!(polite.as_mut()).is_pending());
        // The greedy caller's newest waiter was shed; the others still wait.
        assert_eq!(
            greedy.pop().unwrap().await.unwrap_err(),
            ShedReason::QueueDisplaced
        );
        for g in &mut greedy {
            assert!(futures::poll!(g.as_mut()).is_pending());
        }
        // A third caller finds two callers holding 2 and 1 places: it may
        // still displace one of greedy's (2 > 0 + 1).
        let mut third = Box::pin(q.acquire("third", later()));
        assert!(futures::poll!(third.as_mut()).is_pending());
        // Now every caller holds one place: a fourth is shed.
        assert_eq!(
            q.acquire("fourth", later()).await.unwrap_err(),
            ShedReason::QueueFull
        );
    }

    #[tokio::test]
    async fn expired_and_cancelled_waiters_never_get_a_slot() {
        let q = FairQueue::new(1, 8, None);
        let hold = q.acquire("x", later()).await.unwrap();
        // Already past its start-by time: refused without queueing.
        assert_eq!(
            q.acquire("late", Instant::now()).await.unwrap_err(),
            ShedReason::DeadlineExceeded
        );
        // Times out while waiting.
        let short = Instant::now() + Duration::from_millis(20);
        assert_eq!(
            q.acquire("short", short).await.unwrap_err(),
            ShedReason::DeadlineExceeded
        );
        // Cancelled while waiting: leaves the queue at once.
        let mut cancelled = Box::pin(q.acquire("gone", later()));
        assert!(futures::poll!(cancelled.as_mut()).is_pending());
        assert_eq!(q.stats(), (1, 1));
        drop(cancelled);
        assert_eq!(q.stats(), (1, 0));
        drop(hold);
        assert_eq!(q.stats(), (0, 0), "the slot is free, nobody took it");
    }
}
