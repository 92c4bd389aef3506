//! Admission decisions as plain functions over plain numbers; the runtime in
//! [`super::queue`] only gathers the numbers and carries out the verdict.

use std::time::{Duration, Instant};

use super::ShedReason;

/// What the queue looks like when a request asks to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueState {
    /// Requests doing CPU-heavy work now.
    pub running: usize,
    pub max_running: usize,
    /// Requests waiting, all callers together.
    pub queued: usize,
    pub max_queued: usize,
    /// The start tag this request would get ([`super::fair`]): how far its
    /// caller is ahead of the others in recent service.
    pub tag: u64,
    /// The largest start tag waiting, if anyone waits.
    pub last_tag: Option<u64>,
}

/// The verdict for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// A slot is free and nobody waits: start now.
    Run,
    /// Wait for a slot, in tag order.
    Enqueue,
    /// The queue is full, but a waiter's caller is further ahead in recent
    /// service than this one: shed that waiter and take its place.
    EnqueueEvicting,
    Shed(ShedReason),
}

/// Run, wait, displace a waiter of a caller further ahead, or shed. A
/// request never jumps ahead of waiters (they would starve), and a full
/// queue sheds the request of the caller furthest ahead, so a caller
/// arriving ten times as often cannot take ten times the slots.
pub fn admit(s: &QueueState) -> Admit {
    if s.running < s.max_running && s.queued == 0 {
        return Admit::Run;
    }
    if s.queued < s.max_queued {
        return Admit::Enqueue;
    }
    match s.last_tag {
        Some(last) if last > s.tag => Admit::EnqueueEvicting,
        _ => Admit::Shed(ShedReason::QueueFull),
    }
}

/// How loaded the server is, for the pre-authentication decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Load {
    /// Slots free or a short queue.
    Normal,
    /// The queue is at least `busy_fraction` full: new, unauthenticated
    /// work (a TokenReview, then a queue slot) is shed first.
    Busy,
}

/// `Busy` from half the queue up: known callers still have the other half.
pub fn load(queued: usize, max_queued: usize) -> Load {
    if max_queued > 0 && queued * 2 >= max_queued {
        Load::Busy
    } else {
        Load::Normal
    }
}

/// Whether signing should leave the async workers for the blocking pool. A
/// lone caller signs on the worker (the hand-off cost two thread wake-ups
/// per request). Once another caller waits, or a quarter of the queue is
/// taken, the workers are needed to keep reading requests into the fair
/// queue: signing on them left the rest unread in socket buffers, where fair
/// order and deadlines cannot reach (a greedy connection then won: 2.6x its
/// share in tests/admission.rs on a loaded machine, and callers gave up
/// before the server saw their request).
pub fn sign_off_worker(queued: usize, max_queued: usize, others_waiting: bool) -> bool {
    max_queued > 0 && (others_waiting || queued * 4 >= max_queued)
}

/// Before authentication: known callers (warm token cache, verified client
/// certificate) go on; new ones are shed while busy. Costs nothing: no CSR
/// parse, no TokenReview.
pub fn pre_auth(known: bool, load: Load) -> Result<(), ShedReason> {
    match (known, load) {
        (true, _) | (false, Load::Normal) => Ok(()),
        (false, Load::Busy) => Err(ShedReason::NewCallerWhileBusy),
    }
}

/// The last moment work may start for a request that arrived at `arrived`
/// with `grpc-timeout` `timeout`: `margin` before its deadline, so the
/// certificate can still reach the caller (the caller's clock started
/// before ours). `max_wait` bounds callers that send no deadline.
pub fn start_by(
    arrived: Instant,
    timeout: Option<Duration>,
    margin: Duration,
    max_wait: Duration,
) -> Instant {
    let own = arrived + max_wait;
    match timeout {
        Some(t) => {
            let deadline = arrived.checked_add(t.saturating_sub(margin)).unwrap_or(own);
            deadline.min(own)
        }
        None => own,
    }
}

/// Parses a `grpc-timeout` header: at most 8 digits and a unit
/// (H, M, S, m, u, n). `None` for anything else (treated as no deadline).
pub fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The key callers share the queue by: the node proxy or workload pod a
/// token was bound to (a ztunnel asking for many identities is one caller),
/// else the authenticated identity (mTLS).
pub fn caller_key(caller: &crate::authn::Caller) -> String {
    match &caller.kube {
        Some(k) if !k.pod_name.is_empty() => {
            format!("pod:{}/{}", k.pod_namespace, k.pod_name)
        }
        _ => format!("id:{}", caller.identity),
    }
}

/// Per-identity issuance cap: a fixed window per identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapWindow {
    pub started: Instant,
    pub count: u32,
}

/// Counts one issuance against `w` (a fresh window once `window` passed):
/// the new state, or the wait until the window ends when over `max`.
pub fn cap_take(
    w: Option<CapWindow>,
    now: Instant,
    max: u32,
    window: Duration,
) -> Result<CapWindow, Duration> {
    let w = match w {
        Some(w) if now < w.started + window => w,
        _ => CapWindow {
            started: now,
            count: 0,
        },
    };
    if w.count >= max {
        return Err((w.started + window).saturating_duration_since(now));
    }
    Ok(CapWindow {
        count: w.count + 1,
        ..w
    })
}

/// The `grpc-retry-pushback-ms` a shed caller is given: `base` spread over
/// 50-150% by `draw` (so shed callers do not come back together), never
/// shorter than `at_least` (when the condition is known to last that long).
pub fn pushback(base: Duration, at_least: Duration, draw: u64) -> Duration {
    let permille = 500 + draw % 1001;
    let spread = base.mul_f64(permille as f64 / 1000.0);
    spread.max(at_least)
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn q(running: usize, queued: usize, tag: u64, last: Option<u64>) -> QueueState {
        QueueState {
            running,
            max_running: 2,
            queued,
            max_queued: 4,
            tag,
            last_tag: last,
        }
    }

    #[test_case(q(0, 0, 0, None), Admit::Run ; "idle")]
    #[test_case(q(1, 0, 9, None), Admit::Run ; "one slot left, whatever the caller's past")]
    #[test_case(q(2, 0, 0, None), Admit::Enqueue ; "slots busy")]
    #[test_case(q(1, 1, 0, Some(0)), Admit::Enqueue ; "free slot but waiters go first")]
    #[test_case(q(2, 3, 50, Some(3)), Admit::Enqueue ; "last queue place, even far ahead")]
    #[test_case(q(2, 4, 3, Some(10)), Admit::EnqueueEvicting ; "full, a waiter's caller is further ahead")]
    #[test_case(q(2, 4, 10, Some(10)), Admit::Shed(ShedReason::QueueFull) ; "full, tie keeps the waiter")]
    #[test_case(q(2, 4, 11, Some(10)), Admit::Shed(ShedReason::QueueFull) ; "full, we are furthest ahead")]
    fn admission_table(s: QueueState, want: Admit) {
        assert_eq!(admit(&s), want);
    }

    #[test_case(0, 128, false, false ; "idle: on the worker")]
    #[test_case(30, 128, false, false ; "one caller's closed loop of 32 in flight: on the worker")]
    #[test_case(1, 128, true, true ; "another caller waits: off the worker")]
    #[test_case(32, 128, false, true ; "a quarter full: off the worker")]
    #[test_case(128, 128, false, true ; "full: off the worker")]
    #[test_case(5, 0, true, false ; "no queue")]
    fn sign_off_worker_table(queued: usize, max: usize, others: bool, want: bool) {
        assert_eq!(sign_off_worker(queued, max, others), want);
    }

    #[test_case(0, 100, true, Ok(()) ; "idle known")]
    #[test_case(0, 100, false, Ok(()) ; "idle new")]
    #[test_case(49, 100, false, Ok(()) ; "under half new")]
    #[test_case(50, 100, false, Err(ShedReason::NewCallerWhileBusy) ; "half full new shed")]
    #[test_case(100, 100, true, Ok(()) ; "full known goes on to the queue")]
    #[test_case(0, 0, false, Ok(()) ; "no queue never busy")]
    fn pre_auth_table(queued: usize, max: usize, known: bool, want: Result<(), ShedReason>) {
        assert_eq!(pre_auth(known, load(queued, max)), want);
    }

    #[test_case("1S", Some(Duration::from_secs(1)))]
    #[test_case("100m", Some(Duration::from_millis(100)))]
    #[test_case("2H", Some(Duration::from_secs(7200)))]
    #[test_case("3M", Some(Duration::from_secs(180)))]
    #[test_case("99999999u", Some(Duration::from_micros(99_999_999)))]
    #[test_case("5n", Some(Duration::from_nanos(5)))]
    #[test_case("123456789m", None ; "nine digits")]
    #[test_case("m", None ; "no digits")]
    #[test_case("", None ; "empty")]
    #[test_case("10", None ; "no unit")]
    #[test_case("1x", None ; "bad unit")]
    #[test_case("-1S", None ; "sign")]
    #[test_case("1 S", None ; "space")]
    #[test_case("١S", None ; "non ascii digit")]
    fn grpc_timeout_table(v: &str, want: Option<Duration>) {
        assert_eq!(parse_grpc_timeout(v), want);
    }

    #[test]
    fn caller_key_table() {
        use crate::authn::{AuthnMethod, Caller, KubernetesInfo};
        let id: crate::identity::SpiffeId = "spiffe://cluster.local/ns/istio-system/sa/ztunnel"
            .parse()
            .unwrap();
        let pod = |name: &str| KubernetesInfo {
            pod_namespace: "istio-system".into(),
            pod_name: name.into(),
            ..Default::default()
        };
        let cases = [
            (None, "id:spiffe://cluster.local/ns/istio-system/sa/ztunnel"),
            (Some(pod("ztunnel-abc")), "pod:istio-system/ztunnel-abc"),
            (
                Some(pod("")),
                "id:spiffe://cluster.local/ns/istio-system/sa/ztunnel",
            ),
        ];
        for (kube, want) in cases {
            let c = Caller {
                method: AuthnMethod::TokenReview,
                identity: id.clone(),
                kube,
            };
            assert_eq!(caller_key(&c), want);
        }
    }

    #[test]
    fn start_by_table() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let wait = ms(1000);
        // (timeout, margin, expected offset from arrival)
        let cases = [
            (None, ms(10), ms(1000)),
            (Some(ms(100)), ms(10), ms(90)),
            (Some(ms(5)), ms(10), ms(0)),
            (Some(ms(5000)), ms(10), ms(1000)),
            (Some(Duration::MAX), ms(10), ms(1000)),
        ];
        for (timeout, margin, want) in cases {
            assert_eq!(
                start_by(t0, timeout, margin, wait),
                t0 + want,
                "{timeout:?}"
            );
        }
    }

    #[test]
    fn cap_window_table() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let w = |started, count| Some(CapWindow { started, count });
        // (state, now offset, expected count or wait)
        let cases: [(Option<CapWindow>, Duration, Result<u32, Duration>); 5] = [
            (None, s(0), Ok(1)),
            (w(t0, 1), s(1), Ok(2)),
            (w(t0, 2), s(1), Err(s(59))),
            (w(t0, 2), s(60), Ok(1)),
            (w(t0, 2), s(61), Ok(1)),
        ];
        for (state, at, want) in cases {
            let got = cap_take(state, t0 + at, 2, s(60)).map(|w| w.count);
            assert_eq!(got, want, "{state:?} at {at:?}");
        }
    }

    #[test]
    fn pushback_spreads_and_respects_floor() {
        let s = Duration::from_secs(1);
        assert_eq!(pushback(s, Duration::ZERO, 0), Duration::from_millis(500));
        assert_eq!(
            pushback(s, Duration::ZERO, 1000),
            Duration::from_millis(1500)
        );
        assert_eq!(
            pushback(s, Duration::from_secs(5), 0),
            Duration::from_secs(5)
        );
        let seen: std::collections::BTreeSet<_> = (0..2002u64)
            .map(|d| pushback(s, Duration::ZERO, d))
            .collect();
        assert_eq!(seen.len(), 1001);
    }
}
