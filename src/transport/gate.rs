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

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;

use super::limits::{admit_request, canonical_ip, RequestAdmission, RequestCaps};
use super::metrics::TransportMetrics;
use super::{ConnControl, Refusal, TransportLimits};
use crate::audit::aggregate::Aggregator;

#[derive(Debug)]
pub struct RequestGate {
    slots: Arc<Semaphore>,
    caps: RequestCaps,
    /// One semaphore per source IP with requests running or waiting; an
    /// entry leaves the map with its last user.
    per_ip: Mutex<HashMap<IpAddr, Arc<Semaphore>>>,
    queued: AtomicUsize,
    timeout: Duration,
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
        Self {
            slots: Arc::new(Semaphore::new(limits.max_inflight_requests)),
            caps: RequestCaps {
                inflight: limits.max_inflight_requests,
                inflight_per_ip: limits.max_inflight_requests_per_ip,
                queued: limits.max_queued_requests,
            },
            per_ip: Default::default(),
            queued: AtomicUsize::new(0),
            timeout: limits.request_timeout,
            metrics,
            aggregator,
        }
    }

    /// Each request's total time, from its headers to its answer.
    pub fn timeout(&self) -> Duration {
        self.timeout
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
    fn source(&self, ip: IpAddr) -> Arc<Semaphore> {
        let mut map = self.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(canonical_ip(ip))
            .or_insert_with(|| Arc::new(Semaphore::new(self.caps.inflight_per_ip)))
            .clone()
    }

    /// Drops the source's entry once nobody holds or waits on it. Callers
    /// clone the semaphore under the same lock, so a count of one (the map's
    /// own) means it is unused.
    fn release_source(&self, ip: IpAddr) {
        let ip = canonical_ip(ip);
        let mut map = self.per_ip.lock().unwrap_or_else(|p| p.into_inner());
        if map.get(&ip).is_some_and(|s| Arc::strong_count(s) == 1) {
            map.remove(&ip);
        }
    }

    pub async fn slot(&self, ip: Option<IpAddr>) -> Result<Slot<'_>, Refusal> {
        let source = ip.map(|ip| (ip, self.source(ip)));
        let mut slot = Slot {
            gate: self,
            ip: source.as_ref().map(|(ip, _)| *ip),
            source: None,
            global: None,
        };
        let inflight = self.caps.inflight - self.slots.available_permits().min(self.caps.inflight);
        let ip_inflight = source.as_ref().map_or(0, |(_, s)| {
            self.caps.inflight_per_ip - s.available_permits().min(self.caps.inflight_per_ip)
        });
        let queued = self.queued.load(Ordering::Acquire);
        if let RequestAdmission::Refuse(r) =
            admit_request(inflight, ip_inflight, queued, &self.caps)
        {
            drop(source);
            return Err(r);
        }
        let source = source.map(|(_, s)| s);
        // Fast path: both permits free, no queueing.
        if let Some(s) = &source {
            slot.source = s.clone().try_acquire_owned().ok();
        }
        if slot.source.is_some() || source.is_none() {
            slot.global = self.slots.clone().try_acquire_owned().ok();
        }
        if slot.global.is_some() {
            return Ok(slot);
        }
        self.queued.fetch_add(1, Ordering::AcqRel);
        let _queued = Queued(&self.queued);
        // The semaphores are never closed.
        if let (Some(s), None) = (source, &slot.source) {
            slot.source = Some(
                s.acquire_owned()
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
    ip: Option<IpAddr>,
    source: Option<tokio::sync::OwnedSemaphorePermit>,
    global: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.global = None;
        self.source = None;
        if let Some(ip) = self.ip {
            self.gate.release_source(ip);
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
        let first = g.slot(Some(a)).await.unwrap();
        // A second request from the same source waits although slots are free.
        let mut waiting = Box::pin(g.slot(Some(a)));
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        assert_eq!(g.queued.load(Ordering::Acquire), 1);
        // Another source runs at once.
        let other = g.slot(Some(b)).await.unwrap();
        drop(other);
        // Cancel the waiting request, then finish the first.
        drop(waiting);
        assert_eq!(g.queued.load(Ordering::Acquire), 0);
        drop(first);
        assert!(g.per_ip.lock().unwrap().is_empty());
        assert_eq!(g.slots.available_permits(), 4);
        // With the queue full, a source at its cap is refused with its own reason.
        let g = gate(4, 1, 0);
        let _first = g.slot(Some(a)).await.unwrap();
        assert_eq!(
            g.slot(Some(a)).await.err(),
            Some(Refusal::RequestPerIpLimit)
        );
        assert_eq!(g.per_ip.lock().unwrap().len(), 1);
    }
}
