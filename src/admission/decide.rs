//! Admission decisions as plain functions over plain numbers; the runtime in
//! [`super::queue`] only gathers the numbers and carries out the verdict.

use std::time::{Duration, Instant};

use super::fair::Pick;
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
///
/// The pool holds `max_running + max_queued` jobs. A job queued for a
/// signing thread that is free but not yet awake takes that thread's place,
/// not a queue place: which of the two a job holds depends on when the
/// thread is scheduled, and the request gate's share (running plus queued)
/// must find room either way.
pub fn admit(s: &QueueState) -> Admit {
    let free_threads = s.max_running.saturating_sub(s.running);
    if free_threads > 0 && s.queued == 0 {
        return Admit::Run;
    }
    if s.queued < s.max_queued.saturating_add(free_threads) {
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

/// Which of a caller's waiting requests takes its turn: the oldest, unless
/// the oldest has already waited `lifo_after` (the caller is backlogged):
/// then the newest, whose answer is the most likely to still be of use
/// (adaptive LIFO). The oldest are then the ones left to expire.
pub fn pick(oldest_waited: Duration, lifo_after: Duration) -> Pick {
    if oldest_waited >= lifo_after {
        Pick::Newest
    } else {
        Pick::Oldest
    }
}

/// The wait (since a request arrived at the server, its wait at the request
/// gate included) past which it is stale: the queue target, raised to at
/// least four service times (so a slow signer, an HSM, with a short queue
/// is not taken for overload) and at least two fair rounds of the
/// `callers` waiting over the `running` signing threads (a request waiting
/// its fair turn is not stale). `None`, never: a caller alone in the queue
/// (its newest requests go first anyway, adaptive LIFO, and shedding its
/// older ones would serve no one else: a node proxy's burst after a
/// restart), or a zero target (off).
pub fn stale_after(
    target: Duration,
    service: Option<Duration>,
    callers: usize,
    running: usize,
) -> Option<Duration> {
    if target.is_zero() || callers < 2 {
        return None;
    }
    let rounds = (callers.saturating_mul(2) / running.max(1)).max(4);
    let floor = service.map_or(Duration::ZERO, |s| {
        s.saturating_mul(u32::try_from(rounds).unwrap_or(u32::MAX))
    });
    Some(target.max(floor))
}

/// Whether stale requests are shed: while requests keep arriving (the last
/// came less than `target` ago), a stale request is shed instead of started,
/// so the answers that go out are still useful and the queue's delay stays
/// near the target (CoDel-style queue target; within a backlogged caller,
/// adaptive LIFO serves the fresh ones first). Once arrivals stop (`quiet`
/// reaches the target), the stale requests of a burst's tail are served
/// however old. Zero turns it off.
pub fn hold_stale(quiet: Duration, target: Duration) -> bool {
    !target.is_zero() && quiet < target
}

/// A run of signing turns that found requests waiting (a backlog): when it
/// began and when a turn last found one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BacklogRun {
    pub since: Instant,
    pub last: Instant,
}

/// The run after a turn at `now` that found requests waiting: it goes on if
/// the last such turn was less than `after` (the staleness threshold) ago,
/// else a new run begins. A queue that empties for a moment does not end
/// it: in a storm the request gate holds the excess and the signing queue
/// empties between its arrivals.
pub fn note_backlog(run: Option<BacklogRun>, now: Instant, after: Duration) -> BacklogRun {
    match run {
        Some(r) if now.saturating_duration_since(r.last) < after => BacklogRun { last: now, ..r },
        _ => BacklogRun {
            since: now,
            last: now,
        },
    }
}

/// Whether stale requests are shed: under overload (`overloaded`: the
/// queue shed work or streams waited at the request gate lately, so that a
/// storm whose signing queue empties for moments keeps shedding), else only
/// from a standing queue, a backlog that has lasted two staleness
/// thresholds and still stands (CoDel's interval). One stall of the whole
/// process (CPU starvation, a VM pause) leaves a burst that is worked off
/// in a few service times, and shedding it would refuse callers whose
/// answers were still of use.
pub fn sheds_stale(
    run: Option<BacklogRun>,
    now: Instant,
    after: Duration,
    overloaded: bool,
) -> bool {
    overloaded
        || run.is_some_and(|r| {
            now.saturating_duration_since(r.last) < after
                && now.saturating_duration_since(r.since) >= after.saturating_mul(2)
        })
}

/// Limits of the concurrency sizing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizingBounds {
    pub min_queued: usize,
    pub max_queued: usize,
    /// Fewest streams in progress one connection is always allowed.
    pub min_per_connection: usize,
    /// Most (the advertised `SETTINGS_MAX_CONCURRENT_STREAMS`).
    pub max_per_connection: usize,
}

/// How much work the server holds at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizing {
    /// Requests that may wait for a signing thread.
    pub queued: usize,
    /// How the connections share the streams in progress.
    pub share: StreamShare,
}

/// The request gate's part of the sizing: streams in progress per
/// connection while the signing queue is pressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamShare {
    /// Requests in progress per connection; more are refused before their
    /// message is read.
    pub per_connection: usize,
    /// What every busy connection may hold whatever the others do: its
    /// equal part of `shared`, rounded down (at least the floor).
    pub floor_per_connection: usize,
    /// Requests in progress all connections together hold while pressed.
    pub shared: usize,
}

/// Accept only what can be answered in time. `running` signing threads,
/// each taking `service` per request (measured: the pool's time per
/// completion while backlogged, times `running`, so CPU limits count),
/// answer `running x deadline / service` requests within a `deadline` (the
/// callers' typical `grpc-timeout`): whatever waits beyond that would be
/// answered too late, so the queue holds no more. The connections share
/// what is answered within the queue `target` (the deadline when zero):
/// each of the `busy_connections` (connections with a request in progress)
/// may hold an equal part, and its further streams wait at the request
/// gate holding only their headers, or at the client. Until a service time
/// is measured the configured maximum applies.
pub fn size(
    service: Option<Duration>,
    running: usize,
    deadline: Duration,
    target: Duration,
    busy_connections: usize,
    b: SizingBounds,
) -> Sizing {
    let answerable = |within: Duration| match service {
        Some(s) if !s.is_zero() => {
            let n = within.as_nanos() * running as u128 / s.as_nanos();
            usize::try_from(n).unwrap_or(usize::MAX)
        }
        _ => b.max_queued.saturating_add(running),
    };
    let min_queued = b.min_queued.min(b.max_queued);
    let queued = answerable(deadline)
        .saturating_sub(running)
        .clamp(min_queued, b.max_queued);
    // Without a target shorter than the deadline the connections share
    // the whole sized queue; never more than it holds.
    let whole = queued.saturating_add(running);
    let shared = if target.is_zero() || target >= deadline {
        whole
    } else {
        answerable(target).min(whole)
    };
    let min_per = b.min_per_connection.min(b.max_per_connection);
    let busy = busy_connections.max(1);
    let per_connection = shared.div_ceil(busy).clamp(min_per, b.max_per_connection);
    Sizing {
        queued,
        share: StreamShare {
            per_connection,
            floor_per_connection: (shared / busy).clamp(min_per, b.max_per_connection),
            shared,
        },
    }
}

/// Whether a connection holding `before` of the `total` streams in
/// progress may start one more while the signing queue is pressed. Each
/// connection may hold its equal part rounded down; the part rounded up
/// (`per_connection`) only while all together hold less than `shared`.
/// Rounded up for every connection, 20 connections sharing 35 places held
/// 40: work past the queue target, shed after it was read and authenticated.
pub fn admits_stream(before: usize, total: usize, s: &StreamShare) -> bool {
    before < s.floor_per_connection || (before < s.per_connection && total < s.shared)
}

/// What a stream over its connection's share does when it looks for a
/// place at the request gate (on arrival, and each time one of its
/// connection's streams ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParkStep {
    /// Takes a free place if there is one, else waits on.
    TryPlace,
    /// Takes no place: it is refused when its park time ends.
    WaitOut,
    /// Leaves a freed place to a younger waiting stream and waits on.
    Yield,
}

/// New work first at the gate: under overload a stream that has waited
/// `fresh` or longer takes no freed place (a younger stream of its
/// connection does), so a stream's wait there stays within `fresh` and the
/// queue target behind it still holds. Within `fresh` a freed place goes
/// to the `newest` waiting stream: woken together, the streams otherwise
/// took places in no particular order, and a success waited up to `fresh`
/// at the gate before its queue wait began. It is not refused at once: an
/// answer brings the client's next request at once, a waiting stream
/// costs only its headers. Without overload (a burst worked through in
/// time) every stream waits its turn. The first look always tries.
pub fn park_step(
    waited: Duration,
    first_look: bool,
    overloaded: bool,
    fresh: Duration,
    newest: bool,
) -> ParkStep {
    match (first_look, overloaded) {
        (true, _) | (false, false) => ParkStep::TryPlace,
        (false, true) if waited >= fresh => ParkStep::WaitOut,
        (false, true) if !newest => ParkStep::Yield,
        (false, true) => ParkStep::TryPlace,
    }
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
    #[test_case(q(0, 4, 0, Some(0)), Admit::Enqueue ; "queue at its bound, threads free but not yet awake")]
    #[test_case(q(1, 4, 0, Some(0)), Admit::Enqueue ; "queue at its bound, one thread not yet awake")]
    #[test_case(q(1, 5, 0, Some(0)), Admit::Shed(ShedReason::QueueFull) ; "queue at its bound plus the waking thread's place")]
    #[test_case(q(0, 6, 3, Some(10)), Admit::EnqueueEvicting ; "queue at its bound plus the waking threads' places")]
    #[test_case(q(3, 4, 0, Some(0)), Admit::Shed(ShedReason::QueueFull) ; "an inline job over the threads frees no place")]
    fn admission_table(s: QueueState, want: Admit) {
        assert_eq!(admit(&s), want);
    }

    #[test_case(0, 10, Pick::Oldest ; "fresh: first come first served")]
    #[test_case(9, 10, Pick::Oldest ; "just under")]
    #[test_case(10, 10, Pick::Newest ; "at the bound: newest first")]
    #[test_case(900, 10, Pick::Newest ; "long backlog")]
    #[test_case(0, 0, Pick::Newest ; "zero bound: always newest")]
    fn pick_table(waited_ms: u64, lifo_after_ms: u64, want: Pick) {
        let ms = Duration::from_millis;
        assert_eq!(pick(ms(waited_ms), ms(lifo_after_ms)), want);
    }

    fn stale(
        waited: Duration,
        target: Duration,
        service: Option<Duration>,
        callers: usize,
        running: usize,
    ) -> bool {
        stale_after(target, service, callers, running).is_some_and(|after| waited > after)
    }

    #[test_case(0, 50, None, 1, false ; "fresh")]
    #[test_case(50, 50, None, 1, false ; "at the target")]
    #[test_case(51, 50, None, 2, true ; "past the target")]
    #[test_case(51, 0, None, 1, false ; "zero turns it off")]
    #[test_case(150, 50, Some(40), 1, false ; "slow signer: four service times")]
    #[test_case(161, 50, Some(40), 2, true ; "slow signer past four service times")]
    #[test_case(60, 50, Some(1), 2, true ; "fast signer: the target")]
    #[test_case(5_000, 50, Some(1), 1, false ; "a caller alone is never stale")]
    #[test_case(60, 50, Some(1), 40, false ; "forty callers: two rounds of 40 ms")]
    #[test_case(81, 50, Some(1), 40, true ; "past two rounds of forty callers")]
    #[test_case(60, 50, Some(1), 1_000_000, false ; "a huge round does not overflow")]
    fn stale_table(waited: u64, target: u64, service: Option<u64>, callers: usize, want: bool) {
        let ms = Duration::from_millis;
        assert_eq!(
            stale(ms(waited), ms(target), service.map(ms), callers, 1),
            want
        );
    }

    #[test]
    fn stale_rounds_share_the_running_threads() {
        let ms = Duration::from_millis;
        // Forty callers on four threads: ten turns each round, floor 20 ms.
        assert!(stale(ms(51), ms(50), Some(ms(1)), 40, 4));
        assert!(!stale(ms(51), ms(50), Some(ms(2)), 40, 2));
        assert!(
            !stale(ms(51), ms(50), Some(ms(1)), 40, 0),
            "0 threads counts as 1"
        );
    }

    #[test_case(0, 50, true ; "arriving now")]
    #[test_case(49, 50, true ; "arrived within the target")]
    #[test_case(50, 50, false ; "quiet for the target: a burst's tail")]
    #[test_case(0, 0, false ; "off")]
    fn hold_stale_table(quiet: u64, target: u64, want: bool) {
        let ms = Duration::from_millis;
        assert_eq!(hold_stale(ms(quiet), ms(target)), want);
    }

    // (since, last) of the run in ms, now, threshold, overloaded: shed stale?
    #[test_case(None, 0, 50, false, false ; "no run")]
    #[test_case(None, 0, 50, true, true ; "overloaded already")]
    #[test_case(Some((0, 0)), 0, 50, false, false ; "a run that begins now")]
    #[test_case(Some((0, 90)), 99, 50, false, false ; "one stall's burst, being worked off")]
    #[test_case(Some((0, 90)), 100, 50, false, true ; "two thresholds long: a standing queue")]
    #[test_case(Some((0, 40)), 100, 50, false, false ; "over: no backlog for a threshold")]
    #[test_case(Some((0, 5_000)), 5_010, 50, false, true ; "a storm's run goes on")]
    fn sheds_stale_table(
        run: Option<(u64, u64)>,
        now: u64,
        after: u64,
        overloaded: bool,
        want: bool,
    ) {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let run = run.map(|(since, last)| BacklogRun {
            since: t0 + ms(since),
            last: t0 + ms(last),
        });
        assert_eq!(sheds_stale(run, t0 + ms(now), ms(after), overloaded), want);
    }

    // (since, last) of the run in ms, now: (since, last) after a backlogged turn.
    #[test_case(None, 7, (7, 7) ; "a first backlog begins a run")]
    #[test_case(Some((0, 30)), 79, (0, 79) ; "within a threshold of the last: goes on")]
    #[test_case(Some((0, 30)), 80, (80, 80) ; "a threshold after the last: a new run")]
    fn note_backlog_table(run: Option<(u64, u64)>, now: u64, want: (u64, u64)) {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let at = |(since, last): (u64, u64)| BacklogRun {
            since: t0 + ms(since),
            last: t0 + ms(last),
        };
        assert_eq!(note_backlog(run.map(at), t0 + ms(now), ms(50)), at(want));
    }

    #[test]
    fn sizing_table() {
        let ms = |v: u64| Duration::from_millis(v);
        let us = |v: u64| Duration::from_micros(v);
        let b = SizingBounds {
            min_queued: 16,
            max_queued: 65_536,
            min_per_connection: 4,
            max_per_connection: 100,
        };
        // (service, running, deadline, busy connections, bounds, queued, per connection)
        let cases = [
            // Nothing measured yet: the configured maximum, each connection its max.
            (None, 1, ms(1000), 20, b, 65_536, 100),
            // One thread at 0.8 ms (a quarter core): 1,250 answerable in 1 s;
            // 20 connections share them: 63 each.
            (Some(us(800)), 1, ms(1000), 20, b, 1_249, 63),
            // Twice as fast, or twice the threads: twice the queue.
            (Some(us(400)), 1, ms(1000), 20, b, 2_499, 100),
            (Some(us(800)), 2, ms(1000), 20, b, 2_498, 100),
            // A 100 ms deadline holds a tenth.
            (Some(us(800)), 1, ms(100), 20, b, 124, 7),
            // 1,000 sidecars with one request each: the floor.
            (Some(us(800)), 1, ms(1000), 1000, b, 1_249, 4),
            // No busy connection yet counts as one.
            (Some(us(800)), 1, ms(100), 0, b, 124, 100),
            // Slow signer (HSM, 50 ms): 20 answerable.
            (Some(ms(50)), 1, ms(1000), 20, b, 19, 4),
            (Some(ms(100)), 1, ms(1000), 20, b, 16, 4),
            // A deadline shorter than one signature: still the minimum.
            (Some(ms(5)), 2, ms(1), 3, b, 16, 6),
            // The configured maximum caps the sized queue.
            (
                Some(us(100)),
                1,
                ms(5000),
                20,
                SizingBounds {
                    max_queued: 64,
                    ..b
                },
                64,
                4,
            ),
            // A floor above the advertised maximum yields to it.
            (
                Some(us(800)),
                1,
                ms(1000),
                1000,
                SizingBounds {
                    min_per_connection: 500,
                    ..b
                },
                1_249,
                100,
            ),
            // Zero service time is "not measured".
            (
                Some(Duration::ZERO),
                1,
                ms(1000),
                20,
                SizingBounds {
                    max_queued: 64,
                    ..b
                },
                64,
                4,
            ),
            // A huge deadline does not overflow.
            (
                Some(Duration::from_nanos(1)),
                4096,
                Duration::MAX,
                1,
                b,
                65_536,
                100,
            ),
        ];
        for (i, (service, running, deadline, busy, bounds, queued, per)) in
            cases.into_iter().enumerate()
        {
            let s = size(service, running, deadline, Duration::ZERO, busy, bounds);
            assert_eq!(
                (s.queued, s.share.per_connection),
                (queued, per),
                "case {i}"
            );
        }
    }

    #[test_case(50, 20, 4, 3, 62 ; "a 50 ms target: 62 answerable, 20 connections")]
    #[test_case(20, 20, 2, 1, 25 ; "a 20 ms target")]
    #[test_case(5_000, 20, 63, 62, 1_250 ; "a target past the deadline: the deadline")]
    #[test_case(0, 20, 63, 62, 1_250 ; "no target: the deadline")]
    #[test_case(50, 1, 62, 62, 62 ; "one busy connection takes all")]
    #[test_case(50, 1000, 1, 1, 62 ; "a thousand connections: the floor")]
    fn sizing_shares_what_the_target_answers(
        target_ms: u64,
        busy: usize,
        per: usize,
        floor: usize,
        shared: usize,
    ) {
        let b = SizingBounds {
            min_queued: 16,
            max_queued: 65_536,
            min_per_connection: 1,
            max_per_connection: 100,
        };
        let s = size(
            Some(Duration::from_micros(800)),
            1,
            Duration::from_secs(1),
            Duration::from_millis(target_ms),
            busy,
            b,
        );
        // The queue bound stays what the deadline answers.
        assert_eq!(s.queued, 1_249);
        assert_eq!(
            (
                s.share.per_connection,
                s.share.floor_per_connection,
                s.share.shared
            ),
            (per, floor, shared)
        );
    }

    /// 20 connections sharing 62 places: each holds 3 whatever the others
    /// do, a fourth only while all together hold fewer than 62.
    #[test_case(2, 61, true ; "under its equal part")]
    #[test_case(2, 70, true ; "under its equal part however full")]
    #[test_case(3, 61, true ; "the part rounded up while places are left")]
    #[test_case(3, 62, false ; "the part rounded up once all places are held")]
    #[test_case(4, 0, false ; "never past the part rounded up")]
    fn streams_share_places_rounded_down_then_up(before: usize, total: usize, want: bool) {
        let s = StreamShare {
            per_connection: 4,
            floor_per_connection: 3,
            shared: 62,
        };
        assert_eq!(admits_stream(before, total, &s), want);
    }

    #[test_case(0, true, true, 0, true, ParkStep::TryPlace ; "first look always tries, even with no fresh age")]
    #[test_case(0, true, true, 25, false, ParkStep::TryPlace ; "first look tries with older streams waiting")]
    #[test_case(24, false, true, 25, true, ParkStep::TryPlace ; "overloaded, still fresh, the newest")]
    #[test_case(3, false, true, 25, false, ParkStep::Yield ; "overloaded, fresh, a younger one waits")]
    #[test_case(25, false, true, 25, true, ParkStep::WaitOut ; "overloaded, at the fresh age: waits out")]
    #[test_case(400, false, false, 25, false, ParkStep::TryPlace ; "no overload: waits its turn however old")]
    #[test_case(400, true, true, 25, false, ParkStep::TryPlace ; "first look of a stream stamped late")]
    fn park_steps(
        waited_ms: u64,
        first: bool,
        overloaded: bool,
        fresh_ms: u64,
        newest: bool,
        step: ParkStep,
    ) {
        let ms = Duration::from_millis;
        assert_eq!(
            park_step(ms(waited_ms), first, overloaded, ms(fresh_ms), newest),
            step
        );
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
