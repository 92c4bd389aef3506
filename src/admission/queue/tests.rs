use super::*;
use std::sync::mpsc;

fn later() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

fn pool_config(running: usize) -> PoolConfig {
    PoolConfig {
        max_running: running,
        max_queued: 8,
        lifo_after: Duration::from_secs(3600),
        nice: 0,
        inline: None,
        target: Duration::ZERO,
    }
}

fn pool(running: usize, queued: usize) -> FairQueue {
    FairQueue::new(
        PoolConfig {
            max_queued: queued,
            ..pool_config(running)
        },
        None,
    )
}

/// Occupies the `n` signing threads of `q` until the returned senders
/// are dropped; returns once all of them run.
async fn hold(
    q: &FairQueue,
    n: usize,
) -> (Vec<mpsc::Sender<()>>, Vec<tokio::task::JoinHandle<()>>) {
    let mut gates = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..n {
        let (tx, rx) = mpsc::channel::<()>();
        gates.push(tx);
        let q2 = q.clone();
        tasks.push(tokio::spawn(async move {
            q2.run(&format!("hold{i}"), later(), move || {
                let _ = rx.recv();
            })
            .await
            .unwrap();
        }));
    }
    while q.stats().0 < n {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    (gates, tasks)
}

async fn until_queued(q: &FairQueue, n: usize) {
    while q.stats().1 < n {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test]
async fn jobs_run_on_the_signing_threads_and_report_their_time() {
    let q = pool(2, 8);
    let here = std::thread::current().id();
    let (there, name) = q
        .run("a", later(), || {
            let t = std::thread::current();
            (t.id(), t.name().map(str::to_string))
        })
        .await
        .unwrap();
    assert_ne!(there, here);
    assert_eq!(
        name.as_deref().map(|n| n.starts_with("meshca-sign-")),
        Some(true)
    );
    // The thread times and counts its job just after the job answered
    // (the time includes handing the answer over).
    for _ in 0..5_000 {
        if q.completed() == 1 && q.service_time().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(q.completed(), 1);
    assert!(q.service_time().is_some());
}

fn inline_pool(running: usize) -> FairQueue {
    FairQueue::new(
        PoolConfig {
            inline: Some(Duration::from_secs(60)),
            ..pool_config(running)
        },
        None,
    )
}

fn on_signing_thread() -> bool {
    std::thread::current()
        .name()
        .is_some_and(|n| n.starts_with("meshca-sign-"))
}

#[tokio::test]
async fn an_unpressed_pool_signs_on_the_callers_thread_and_counts_it() {
    let q = inline_pool(2);
    let here = std::thread::current().id();
    let there = q
        .run("a", later(), || std::thread::current().id())
        .await
        .unwrap();
    assert_eq!(there, here);
    assert_eq!(q.completed(), 1);
    assert!(q.service_time().is_some());
    assert_eq!(q.stats(), (0, 0), "the slot is given back");
    // A job that panics gives its slot back too.
    let q2 = q.clone();
    let panicked = tokio::spawn(async move { q2.run("a", later(), || panic!("boom")).await });
    assert!(panicked.await.is_err());
    assert_eq!(q.stats(), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_a_job_waited_every_job_goes_to_the_signing_threads() {
    let q = inline_pool(1);
    // The one slot is held by a job running inline on a worker ...
    let (tx, rx) = mpsc::channel::<()>();
    let first = tokio::spawn({
        let q = q.clone();
        let job = move || {
            let _ = rx.recv();
            on_signing_thread()
        };
        async move { q.run("a", later(), job).await }
    });
    while q.stats().0 < 1 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // ... so the next one is queued, and a signing thread takes it.
    assert_eq!(q.run("b", later(), on_signing_thread).await, Ok(true));
    drop(tx);
    assert_eq!(first.await.unwrap(), Ok(false), "the first ran inline");
    // The pool is idle again, but a job waited within the window: still
    // the signing threads.
    while q.stats() != (0, 0) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(q.run("c", later(), on_signing_thread).await, Ok(true));
}

#[tokio::test]
async fn a_late_worker_sends_jobs_to_the_signing_threads() {
    let q = inline_pool(2);
    assert_eq!(q.run("a", later(), on_signing_thread).await, Ok(false));
    let watch = tokio::spawn(
        q.clone()
            .watch_lag(Duration::from_millis(5), Duration::from_millis(20)),
    );
    tokio::time::sleep(Duration::from_millis(10)).await;
    // The only worker is held (as by work waiting in front of it) well
    // past the probe's limit.
    std::thread::sleep(Duration::from_millis(100));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(q.backlog().lagged(Duration::from_secs(60)));
    assert_eq!(q.run("a", later(), on_signing_thread).await, Ok(true));
    // The watch ends with the pool.
    drop(q);
    let ended = tokio::time::timeout(Duration::from_secs(10), watch).await;
    assert!(matches!(ended, Ok(Ok(()))), "{ended:?}");
}

#[tokio::test]
async fn threads_bound_running_work_and_take_the_queue_in_turn() {
    let q = pool(2, 8);
    let (gates, held) = hold(&q, 2).await;
    let c = tokio::spawn({
        let q = q.clone();
        async move { q.run("c", later(), || 7).await }
    });
    until_queued(&q, 1).await;
    assert_eq!(q.stats(), (2, 1));
    drop(gates);
    assert_eq!(c.await.unwrap(), Ok(7));
    for t in held {
        t.await.unwrap();
    }
    // A thread counts its job done just after the job answered.
    for _ in 0..5_000 {
        if q.stats() == (0, 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(q.stats(), (0, 0));
}

/// A job queued while a free signing thread has not yet been scheduled
/// takes that thread's place, not a queue place: the pool holds its threads'
/// jobs and its queue's whichever of the two they are in when the next
/// request asks (the request gate's share of a connection counts both).
#[tokio::test]
async fn jobs_queued_before_a_free_thread_wakes_take_its_place() {
    let q = FairQueue::without_threads(
        PoolConfig {
            max_queued: 4,
            ..pool_config(2)
        },
        None,
    );
    let mut jobs = Vec::new();
    for i in 0..6usize {
        let j = tokio::spawn({
            let q = q.clone();
            async move { q.run(&format!("c{i}"), later(), move || i).await }
        });
        for _ in 0..5_000 {
            if q.stats().1 > i || j.is_finished() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(q.stats(), (0, i + 1), "request {i} was not queued");
        jobs.push(j);
    }
    // Threads' places and queue places are all taken: the next is shed.
    assert_eq!(
        q.run("late", later(), || 99).await,
        Err(ShedReason::QueueFull)
    );
    q.start_threads(0);
    for (i, j) in jobs.into_iter().enumerate() {
        assert_eq!(j.await.unwrap(), Ok(i));
    }
}

#[tokio::test]
async fn turns_alternate_over_callers() {
    let q = pool(1, 64);
    let (gates, _held) = hold(&q, 1).await;
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    // "greedy" queues 6 before "polite" queues 2.
    for (n, key) in ["greedy"; 6].into_iter().chain(["polite"; 2]).enumerate() {
        let (q2, served) = (q.clone(), served.clone());
        tasks.push(tokio::spawn(async move {
            q2.run(key, later(), move || served.lock().unwrap().push(key))
                .await
                .unwrap();
        }));
        until_queued(&q, n + 1).await;
    }
    drop(gates);
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
async fn under_overload_a_callers_newest_request_goes_first() {
    let q = FairQueue::new(
        PoolConfig {
            max_queued: 64,
            lifo_after: Duration::ZERO,
            ..pool_config(1)
        },
        None,
    );
    let (gates, _held) = hold(&q, 1).await;
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..4u32 {
        let (q2, served) = (q.clone(), served.clone());
        tasks.push(tokio::spawn(async move {
            q2.run("a", later(), move || served.lock().unwrap().push(i))
                .await
                .unwrap();
        }));
        until_queued(&q, i as usize + 1).await;
    }
    drop(gates);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*served.lock().unwrap(), vec![3, 2, 1, 0]);
}

#[tokio::test]
async fn a_full_queue_displaces_the_greediest_caller() {
    let q = pool(1, 3);
    let (_gates, _held) = hold(&q, 1).await;
    let mut greedy: Vec<_> = (0..3)
        .map(|_| Box::pin(q.run("greedy", later(), || ())))
        .collect();
    for g in &mut greedy {
        assert!(futures::poll!(g.as_mut()).is_pending());
    }
    let mut polite = Box::pin(q.run("polite", later(), || ()));
    assert!(futures::poll!(polite.as_mut()).is_pending());
    // The greedy caller's oldest waiter was shed; the others still wait.
    assert_eq!(
        greedy.remove(0).await.unwrap_err(),
        ShedReason::QueueDisplaced
    );
    for g in &mut greedy {
        assert!(futures::poll!(g.as_mut()).is_pending());
    }
    // A third caller finds two callers holding 2 and 1 places: it may
    // still displace one of greedy's (2 > 0 + 1).
    let mut third = Box::pin(q.run("third", later(), || ()));
    assert!(futures::poll!(third.as_mut()).is_pending());
    // Now every caller holds one place: a fourth is shed.
    assert_eq!(
        q.run("fourth", later(), || ()).await.unwrap_err(),
        ShedReason::QueueFull
    );
}

#[tokio::test]
async fn expired_and_cancelled_waiters_never_run() {
    let q = pool(1, 8);
    let (gates, held) = hold(&q, 1).await;
    let ran = Arc::new(AtomicUsize::new(0));
    let job = |ran: &Arc<AtomicUsize>| {
        let ran = ran.clone();
        move || {
            ran.fetch_add(1, Ordering::SeqCst);
        }
    };
    // Already past its start-by time: refused without queueing.
    assert_eq!(
        q.run("late", Instant::now(), job(&ran)).await.unwrap_err(),
        ShedReason::DeadlineExceeded
    );
    // Times out while waiting.
    let short = Instant::now() + Duration::from_millis(20);
    assert_eq!(
        q.run("short", short, job(&ran)).await.unwrap_err(),
        ShedReason::DeadlineExceeded
    );
    // Cancelled while waiting: leaves the queue at once.
    let mut cancelled = Box::pin(q.run("gone", later(), job(&ran)));
    assert!(futures::poll!(cancelled.as_mut()).is_pending());
    assert_eq!(q.stats(), (1, 1));
    drop(cancelled);
    assert_eq!(q.stats(), (1, 0));
    drop(gates);
    for t in held {
        t.await.unwrap();
    }
    // The slot is free and nothing else ran.
    while q.stats() != (0, 0) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_job_due_while_its_caller_waits_to_start_is_dropped_unrun() {
    // The thread is busy past the waiter's start-by time: when it comes
    // back, the expired waiter is skipped, not run.
    let q = pool(1, 8);
    let (gates, held) = hold(&q, 1).await;
    let ran = Arc::new(AtomicUsize::new(0));
    let r2 = ran.clone();
    let start_by = Instant::now() + Duration::from_millis(30);
    let waiter = tokio::spawn({
        let q = q.clone();
        async move {
            q.run("a", start_by, move || {
                r2.fetch_add(1, Ordering::SeqCst);
            })
            .await
        }
    });
    assert_eq!(waiter.await.unwrap(), Err(ShedReason::DeadlineExceeded));
    drop(gates);
    for t in held {
        t.await.unwrap();
    }
    assert_eq!(q.run("b", later(), || 1).await, Ok(1));
    assert_eq!(ran.load(Ordering::SeqCst), 0);
}

/// One signing thread with queue target `target`, newest first.
fn with_target(target: Duration) -> FairQueue {
    FairQueue::new(
        PoolConfig {
            max_queued: 64,
            lifo_after: Duration::ZERO,
            target,
            ..pool_config(1)
        },
        None,
    )
}

/// [`with_target`], its service time measured (far below the target),
/// and its thread held busy.
async fn busy_with_target(target: Duration) -> (FairQueue, Vec<mpsc::Sender<()>>) {
    let q = with_target(target);
    for _ in 0..20 {
        q.run("warm", later(), || ()).await.unwrap();
    }
    let (gates, _held) = hold(&q, 1).await;
    (q, gates)
}

type Ran = Arc<Mutex<Vec<&'static str>>>;

/// Queues, for caller `key` whose request arrived at `arrived`, a job
/// that notes `name` in `ran` when it runs.
fn spawn_noted(
    q: &FairQueue,
    key: &'static str,
    arrived: Instant,
    ran: &Ran,
    name: &'static str,
) -> tokio::task::JoinHandle<Result<(), ShedReason>> {
    let (q, ran) = (q.clone(), ran.clone());
    tokio::spawn(async move {
        q.run_arrived(key, arrived, later(), move || {
            ran.lock().unwrap().push(name)
        })
        .await
    })
}

/// One stall: the signing thread busy past the target (as when the whole
/// process is starved of CPU) while a request of one caller waits, then a
/// fresh request of another caller arrives. With `overloaded`, a stream
/// waits at the request gate meanwhile. Returns the two outcomes (old,
/// fresh) and the jobs that ran.
async fn one_stall(
    overloaded: bool,
) -> (
    Result<(), ShedReason>,
    Result<(), ShedReason>,
    Vec<&'static str>,
) {
    let target = Duration::from_millis(60);
    let (q, gates) = busy_with_target(target).await;
    let gate_waits = || {
        if overloaded {
            q.backlog().gate_waited();
        }
    };
    gate_waits();
    let ran = Ran::default();
    let old = spawn_noted(&q, "a", Instant::now(), &ran, "old");
    until_queued(&q, 1).await;
    tokio::time::sleep(target + Duration::from_millis(20)).await;
    // "old" is stale now; a fresh request of another caller arrives.
    let fresh = spawn_noted(&q, "b", Instant::now(), &ran, "fresh");
    until_queued(&q, 2).await;
    gate_waits();
    drop(gates);
    let fresh = fresh.await.unwrap();
    let old = old.await.unwrap();
    let ran = ran.lock().unwrap().clone();
    (old, fresh, ran)
}

/// Without overload one stall leaves a burst that drains in a few service
/// times: its stale request is served, not shed, though requests keep
/// arriving. Only a standing queue sheds without overload (below).
#[tokio::test]
async fn one_stall_is_served_not_shed() {
    let (old, fresh, ran) = one_stall(false).await;
    assert_eq!(fresh, Ok(()));
    assert_eq!(old, Ok(()));
    assert_eq!(ran.len(), 2);
}

/// The same stall under overload (streams wait at the request gate, over
/// their connections' shares): the stale request is shed at once, and the
/// fresh one is served.
#[tokio::test]
async fn one_stall_under_overload_sheds_stale_work() {
    let (old, fresh, ran) = one_stall(true).await;
    assert_eq!(fresh, Ok(()));
    assert_eq!(old, Err(ShedReason::QueueTimeout));
    assert_eq!(ran, ["fresh"]);
}

/// The target bounds a request's whole wait before signing: under
/// overload, one that spent most of it before the queue (parked at the
/// request gate) is stale after a short time in the queue, while one that
/// arrived later with the same time in the queue is served.
#[tokio::test]
async fn time_before_the_queue_counts_toward_the_target() {
    let target = Duration::from_millis(200);
    let (q, gates) = busy_with_target(target).await;
    q.backlog().gate_waited();
    let ran = Ran::default();
    let arrived_early = Instant::now()
        .checked_sub(target - Duration::from_millis(10))
        .unwrap();
    let parked = spawn_noted(&q, "a", arrived_early, &ran, "parked");
    let direct = spawn_noted(&q, "b", Instant::now(), &ran, "direct");
    until_queued(&q, 2).await;
    // Both have been queued 30 ms: "parked" is 220 ms past its arrival,
    // "direct" 30 ms (far from the target on a loaded machine too).
    tokio::time::sleep(Duration::from_millis(30)).await;
    let fresh = spawn_noted(&q, "c", Instant::now(), &ran, "fresh");
    until_queued(&q, 3).await;
    q.backlog().gate_waited();
    drop(gates);
    assert_eq!(parked.await.unwrap(), Err(ShedReason::QueueTimeout));
    assert_eq!(direct.await.unwrap(), Ok(()));
    assert_eq!(fresh.await.unwrap(), Ok(()));
    let ran = ran.lock().unwrap();
    assert!(!ran.contains(&"parked"), "{ran:?}");
    assert_eq!(ran.len(), 2, "{ran:?}");
}

/// A standing queue, with no overload signal: jobs of 15 ms on one
/// thread, requests arriving every 5 ms. Once the backlog has stood for two
/// staleness thresholds, a stale request is shed; and the target counts its
/// whole wait since it reached the server (one parked at the request gate
/// for most of it is shed though its turn comes the moment it is queued).
#[tokio::test]
async fn while_a_queue_stands_stale_work_is_shed() {
    let target = Duration::from_millis(40);
    let q = with_target(target);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let arrivals = {
        let (q, stop) = (q.clone(), stop.clone());
        tokio::spawn(async move {
            let mut jobs = Vec::new();
            let mut i = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let q = q.clone();
                let key = if i.is_multiple_of(2) { "x" } else { "y" };
                jobs.push(tokio::spawn(async move {
                    q.run(key, later(), || {
                        std::thread::sleep(Duration::from_millis(15))
                    })
                    .await
                }));
                i += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            for j in jobs {
                let _ = j.await.unwrap();
            }
        })
    };
    // Well past two thresholds of a standing queue (the threshold is raised
    // to four service times, 60 ms here, or more on a loaded machine).
    tokio::time::sleep(target * 10).await;
    let ran = Ran::default();
    let arrived_early = Instant::now().checked_sub(target * 25).unwrap();
    let parked = spawn_noted(&q, "parked", arrived_early, &ran, "parked");
    let outcome = parked.await.unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    arrivals.await.unwrap();
    assert_eq!(outcome, Err(ShedReason::QueueTimeout));
    assert!(ran.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_burst_tail_is_served_however_old_once_arrivals_stop() {
    let target = Duration::from_millis(30);
    let (q, gates) = busy_with_target(target).await;
    let tail = tokio::spawn({
        let q = q.clone();
        async move { q.run("a", later(), || 5).await }
    });
    until_queued(&q, 1).await;
    // Stale, and nothing else arrives: it is served, not shed.
    tokio::time::sleep(target * 3).await;
    drop(gates);
    assert_eq!(tail.await.unwrap(), Ok(5));
}

#[tokio::test]
async fn without_a_target_stale_work_goes_in_turn() {
    let q = pool(1, 64);
    let (gates, _held) = hold(&q, 1).await;
    let served = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for key in ["a", "b"] {
        let (q2, served) = (q.clone(), served.clone());
        tasks.push(tokio::spawn(async move {
            q2.run(key, later(), move || served.lock().unwrap().push(key))
                .await
                .unwrap();
        }));
        until_queued(&q, tasks.len()).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(gates);
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*served.lock().unwrap(), vec!["a", "b"]);
}

#[test]
fn ewma_table() {
    // (mean, sample, want)
    let cases = [
        (0, 1000, 1000),
        (0, 0, 1),
        (1600, 1600, 1600),
        (1600, 3200, 1700),
        (1600, 0, 1500),
        (1, 0, 1),
        (u64::MAX, u64::MAX, u64::MAX),
        // An outlier counts as four times the mean.
        (1600, 1_000_000, 1600 + 4800 / 16),
        (1600, 6400, 1600 + 4800 / 16),
    ];
    for (mean, sample, want) in cases {
        assert_eq!(ewma_ns(mean, sample), want, "{mean} {sample}");
    }
}

#[test]
fn dropping_the_last_handle_ends_the_threads() {
    let q = pool(2, 4);
    let weak = Arc::downgrade(&q.0 .0);
    drop(q);
    let t0 = Instant::now();
    while weak.strong_count() > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "threads still hold the pool"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}
