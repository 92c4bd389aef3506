//! The request gate: how many requests are handled and waiting, globally
//! and per source address, and how long each may take. It runs before a
//! request's message is read, so a waiting stream holds only its headers and
//! flow-control window. `grpc::RequestGateLayer` puts it in front of tonic's
//! routes and turns its refusals into gRPC statuses.
//!
//! Per-source fairness: a slot is taken before the body is read, so a
//! stream that never sends its body holds its slot until the request
//! timeout. Rather than reading the body before taking a slot (that would
//! need a second, unbounded buffer of up to `max_message_bytes` per waiting
//! stream, breaking the memory arithmetic in `transport::limits`), each
//! source IP may hold at most `max_inflight_requests_per_ip` slots; its
//! other requests wait in the shared, bounded queue. A few hostile IPs then
//! hold only their share and the remaining slots serve everyone else.
//!
//! Per-class fairness: one address can carry both kinds of caller (a NAT,
//! a node's shared address). A source is an address within an
//! [`AuthClass`], each with its own per-IP share, and unauthenticated
//! requests together hold at most their class's part of the slots and of
//! the queue ([`RequestCaps::unauthenticated`]), so authenticated callers
//! behind the same address keep slots no unauthenticated stream can take.
//! An unauthenticated stream also has `unauthenticated_body_timeout` from
//! its headers to send its whole message (`grpc::RequestGateLayer` resets
//! it after that): a stream that declares a message and never sends it
//! holds its place for that long, not for the request timeout.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;

use super::limits::{admit_request, canonical_ip, AuthClass, RequestAdmission, RequestCaps};
use super::metrics::TransportMetrics;
use super::{ConnControl, Refusal, TransportLimits};
use crate::audit::aggregate::Aggregator;

/// A source's share of the slots: its address within its [`AuthClass`].
type SourceKey = (AuthClass, IpAddr);

/// The unauthenticated class's own part of the pools
/// ([`RequestCaps::unauthenticated`]), taken before the global slot.
#[derive(Debug)]
struct ClassPart {
    slots: Arc<Semaphore>,
    caps: RequestCaps,
    queued: AtomicUsize,
}

#[derive(Debug)]
pub struct RequestGate {
    slots: Arc<Semaphore>,
    caps: RequestCaps,
    unauthenticated: ClassPart,
    /// One semaphore per source (address and class) with requests running
    /// or waiting; an entry leaves the map with its last user.
    per_ip: Mutex<HashMap<SourceKey, Arc<Semaphore>>>,
    queued: AtomicUsize,
    timeout: Duration,
    body_timeout: Duration,
    metrics: Option<Arc<TransportMetrics>>,
    /// Refusals are folded here per source address for the audit log.
    aggregator: Option<Arc<Aggregator>>,
}

impl RequestGate {
    pub fn new(
        limits: &TransportLimits,
        metrics: Option<Arc<TransportMetrics>>,
        aggregator: Option<Arc<Aggregator>>,
    ) -> Self {
        let u = RequestCaps::unauthenticated(limits);
        Self {
            slots: Arc::new(Semaphore::new(limits.max_inflight_requests)),
            caps: RequestCaps::all(limits),
            unauthenticated: ClassPart {
                slots: Arc::new(Semaphore::new(u.inflight)),
                caps: u,
                queued: AtomicUsize::new(0),
            },
            per_ip: Default::default(),
            queued: AtomicUsize::new(0),
            timeout: limits.request_timeout,
            body_timeout: limits.unauthenticated_body_timeout,
            metrics,
            aggregator,
        }
    }

    /// Each request's total time, from its headers to its answer.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// How long after its headers an unauthenticated stream may still wait
    /// for its message (zero: no bound of its own).
    pub fn body_timeout(&self) -> Duration {
        self.body_timeout
    }

    /// A stream the client cancelled: counts it on its connection, and
    /// counts a reset flood once the connection has cancelled too many.
    pub fn stream_cancelled(&self, control: &ConnControl, ip: Option<IpAddr>) {
        if control.stream_cancelled() {
            tracing::info!(
                reason = Refusal::StreamResetFlood.reason(),
                "closing a connection that cancels too many streams"
            );
            self.count(Refusal::StreamResetFlood, ip);
        }
    }

    /// Counts a refusal in metrics and, per source, in the audit log.
    pub fn count(&self, r: Refusal, ip: Option<IpAddr>) {
        if let Some(m) = &self.metrics {
            m.refused(r);
        }
        if let (Some(a), Some(ip)) = (&self.aggregator, ip) {
            a.fold_transport(canonical_ip(ip), r.reason());
        }
    }

    /// The source's semaphore, created on first use.
    fn source(&self, key: SourceKey) -> Arc<Semaphore> {
        let mut map = self.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        map.entry((key.0, canonical_ip(key.1)))
            .or_insert_with(|| Arc::new(Semaphore::new(self.caps.inflight_per_ip)))
            .clone()
    }

    /// Drops the source's entry once nobody holds or waits on it. Callers
    /// clone the semaphore under the same lock, so a count of one (the map's
    /// own) means it is unused.
    fn release_source(&self, key: SourceKey) {
        let key = (key.0, canonical_ip(key.1));
        let mut map = self.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        if map.get(&key).is_some_and(|s| Arc::strong_count(s) == 1) {
            map.remove(&key);
        }
    }

    /// Slots in use of a semaphore sized `cap`.
    fn used(s: &Semaphore, cap: usize) -> usize {
        cap - s.available_permits().min(cap)
    }

    /// A handler slot for a request from `ip` on a connection of `class`:
    /// its source's share (address and class), for an unauthenticated
    /// request its class's part, then a global slot; or a place in the
    /// queue until they are free.
    pub async fn slot(&self, ip: Option<IpAddr>, class: AuthClass) -> Result<Slot<'_>, Refusal> {
        let source = ip.map(|ip| ((class, ip), self.source((class, ip))));
        let mut slot = Slot {
            gate: self,
            key: source.as_ref().map(|(k, _)| *k),
            source: None,
            class: None,
            global: None,
        };
        let ip_inflight = source
            .as_ref()
            .map_or(0, |(_, s)| Self::used(s, self.caps.inflight_per_ip));
        let part = (class == AuthClass::Unauthenticated).then_some(&self.unauthenticated);
        // The class's own numbers for an unauthenticated request (its part
        // of the pools), all requests' for an authenticated one.
        let (inflight, queued, caps) = match part {
            Some(p) => (
                Self::used(&p.slots, p.caps.inflight),
                p.queued.load(Ordering::Acquire),
                p.caps,
            ),
            None => (
                Self::used(&self.slots, self.caps.inflight),
                self.queued.load(Ordering::Acquire),
                self.caps,
            ),
        };
        if let RequestAdmission::Refuse(r) = admit_request(inflight, ip_inflight, queued, &caps) {
            drop(source);
            return Err(r);
        }
        let source = source.map(|(_, s)| s);
        // Fast path: every permit free, no queueing.
        if let Some(s) = &source {
            slot.source = s.clone().try_acquire_owned().ok();
        }
        if slot.source.is_some() || source.is_none() {
            slot.class = match part {
                Some(p) => p.slots.clone().try_acquire_owned().ok(),
                None => None,
            };
            if part.is_none() || slot.class.is_some() {
                slot.global = self.slots.clone().try_acquire_owned().ok();
            }
        }
        if slot.global.is_some() {
            return Ok(slot);
        }
        self.queued.fetch_add(1, Ordering::AcqRel);
        let _queued = Queued(&self.queued);
        let _class_queued = part.map(|p| {
            p.queued.fetch_add(1, Ordering::AcqRel);
            Queued(&p.queued)
        });
        // The semaphores are never closed.
        if let (Some(s), None) = (source, &slot.source) {
            slot.source = Some(
                s.acquire_owned()
                    .await
                    .map_err(|_| Refusal::RequestQueueFull)?,
            );
        }
        if let (Some(p), None) = (part, &slot.class) {
            slot.class = Some(
                p.slots
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| Refusal::RequestQueueFull)?,
            );
        }
        slot.global = Some(
            self.slots
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| Refusal::RequestQueueFull)?,
        );
        Ok(slot)
    }
}

/// A request's handler slot and its source's share; released on drop.
pub struct Slot<'a> {
    gate: &'a RequestGate,
    key: Option<SourceKey>,
    source: Option<tokio::sync::OwnedSemaphorePermit>,
    class: Option<tokio::sync::OwnedSemaphorePermit>,
    global: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.global = None;
        self.class = None;
        self.source = None;
        if let Some(key) = self.key {
            self.gate.release_source(key);
        }
    }
}

/// Leaves the queue when dropped, also when the request is cancelled.
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(inflight: usize, per_ip: usize, queued: usize) -> Arc<RequestGate> {
        let limits = TransportLimits {
            max_inflight_requests: inflight,
            max_inflight_requests_per_ip: per_ip,
            max_queued_requests: queued,
            ..TransportLimits::default()
        };
        Arc::new(RequestGate::new(&limits, None, None))
    }

    /// A source's entry leaves the map with its last user, also when a
    /// waiting request is cancelled: the map never outgrows live requests.
    #[tokio::test]
    async fn per_source_entries_leave_with_their_last_request() {
        let g = gate(4, 1, 4);
        let (a, b) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let first = g.slot(Some(a), AuthClass::Authenticated).await.unwrap();
        // A second request from the same source waits although slots are free.
        let mut waiting = Box::pin(g.slot(Some(a), AuthClass::Authenticated));
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        assert_eq!(g.queued.load(Ordering::Acquire), 1);
        // Another source runs at once.
        let other = g.slot(Some(b), AuthClass::Authenticated).await.unwrap();
        drop(other);
        // Cancel the waiting request, then finish the first.
        drop(waiting);
        assert_eq!(g.queued.load(Ordering::Acquire), 0);
        drop(first);
        assert!(g.per_ip.lock().unwrap().is_empty());
        assert_eq!(g.slots.available_permits(), 4);
        // With the queue full, a source at its cap is refused with its own reason.
        let g = gate(4, 1, 0);
        let _first = g.slot(Some(a), AuthClass::Authenticated).await.unwrap();
        assert_eq!(
            g.slot(Some(a), AuthClass::Authenticated).await.err(),
            Some(Refusal::RequestPerIpLimit)
        );
        assert_eq!(g.per_ip.lock().unwrap().len(), 1);
    }

    /// One address, two classes: unauthenticated requests at their per-IP
    /// share and their class's part leave the authenticated callers behind
    /// the same address their own share and the rest of the slots.
    #[tokio::test]
    async fn unauthenticated_requests_leave_authenticated_ones_their_share() {
        use AuthClass::{Authenticated as A, Unauthenticated as U};
        // 8 slots: the unauthenticated part is 6, per source 2; queue 4 (2 for U).
        let g = gate(8, 2, 4);
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let other: IpAddr = "10.0.0.2".parse().unwrap();
        let third: IpAddr = "10.0.0.3".parse().unwrap();
        let mut held = Vec::new();
        for src in [ip, ip, other, other, third, third] {
            held.push(g.slot(Some(src), U).await.unwrap());
        }
        // The unauthenticated part is full: another source of that class
        // waits, and with its part of the queue full it is refused.
        let fourth: IpAddr = "10.0.0.4".parse().unwrap();
        let mut w1 = Box::pin(g.slot(Some(fourth), U));
        assert!(futures::poll!(w1.as_mut()).is_pending());
        let mut w2 = Box::pin(g.slot(Some(fourth), U));
        assert!(futures::poll!(w2.as_mut()).is_pending());
        let fifth: IpAddr = "10.0.0.5".parse().unwrap();
        assert_eq!(
            g.slot(Some(fifth), U).await.err(),
            Some(Refusal::RequestQueueFull)
        );
        // The authenticated caller on the same address runs at once, twice.
        let a1 = g.slot(Some(ip), A).await.unwrap();
        let a2 = g.slot(Some(ip), A).await.unwrap();
        assert_eq!(g.slots.available_permits(), 0);
        drop((a1, a2, w1, w2));
        drop(held);
        assert!(g.per_ip.lock().unwrap().is_empty());
        assert_eq!(g.unauthenticated.slots.available_permits(), 6);
        assert_eq!(g.unauthenticated.queued.load(Ordering::Acquire), 0);
        assert_eq!(g.queued.load(Ordering::Acquire), 0);
    }
}
