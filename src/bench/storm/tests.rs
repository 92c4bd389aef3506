use super::scrape::{job_cpu_with_inline, parse_scrape, Scraped};
use super::*;

#[test]
fn ztunnel_backoff_table() {
    let ms = Duration::from_millis;
    // (attempt, draw, want): draw's low bits pick 0.5-1 s, bits 16+ the jitter.
    let mid = 200 << 16; // jitter 1.0
    let cases = [
        (0, mid, ms(500)),
        (0, mid + 500, ms(1000)),
        (1, mid, ms(1000)),
        (3, mid, ms(4000)),
        (0, 0, ms(400)),         // -20 %
        (0, 400 << 16, ms(600)), // +20 %
        (8, mid, ms(128_000)),
        (9, mid, ms(150_000)), // capped
        (40, mid + 500, ms(150_000)),
    ];
    for (attempt, draw, want) in cases {
        assert_eq!(ztunnel_backoff(attempt, draw), want, "{attempt} {draw}");
    }
}

#[test]
fn quantile_from_bucket_deltas_table() {
    const INF: f64 = f64::INFINITY;
    let b = |counts: [u64; 4]| -> Buckets {
        vec![
            (0.001, counts[0]),
            (0.002, counts[1]),
            (0.004, counts[2]),
            (INF, counts[3]),
        ]
    };
    let zero = b([0, 0, 0, 0]);
    // (before, after, q, want)
    let cases: Vec<(Buckets, Buckets, f64, Option<f64>)> = vec![
        // Nothing observed in between.
        (zero.clone(), zero.clone(), 0.99, None),
        (b([5, 7, 9, 9]), b([5, 7, 9, 9]), 0.5, None),
        // No buckets at all (metric missing from the scrape).
        (vec![], vec![], 0.5, None),
        // 100 observations: 50 <= 1 ms, 49 in (1, 2], 1 in (2, 4].
        (zero.clone(), b([50, 99, 100, 100]), 0.50, Some(1.0)),
        (zero.clone(), b([50, 99, 100, 100]), 0.51, Some(2.0)),
        (zero.clone(), b([50, 99, 100, 100]), 0.99, Some(2.0)),
        (zero.clone(), b([50, 99, 100, 100]), 1.0, Some(4.0)),
        // Only the deltas count: before already had 1,000 fast ones.
        (
            b([1000, 1000, 1000, 1000]),
            b([1000, 1000, 1010, 1010]),
            0.5,
            Some(4.0),
        ),
        // All in +Inf.
        (zero.clone(), b([0, 0, 0, 7]), 0.5, Some(INF)),
        (b([3, 3, 3, 3]), b([3, 3, 3, 10]), 0.99, Some(INF)),
        // One observation: every quantile is its bucket.
        (zero.clone(), b([0, 1, 1, 1]), 0.01, Some(2.0)),
        // Counter reset (server restarted): after < before.
        (b([10, 20, 30, 40]), b([1, 2, 3, 4]), 0.5, None),
        (b([10, 20, 30, 40]), b([10, 20, 29, 45]), 0.5, None),
        // Different bounds or lengths.
        (b([0, 0, 0, 0]), vec![(0.001, 1), (INF, 1)], 0.5, None),
        (
            vec![(0.001, 0), (0.003, 0), (0.004, 0), (INF, 0)],
            b([1, 1, 1, 1]),
            0.5,
            None,
        ),
        // q out of range.
        (zero.clone(), b([1, 1, 1, 1]), 0.0, None),
        (zero.clone(), b([1, 1, 1, 1]), 1.5, None),
    ];
    for (i, (before, after, q, want)) in cases.into_iter().enumerate() {
        assert_eq!(
            quantile_ms_from_deltas(&before, &after, q),
            want,
            "case {i}: {before:?} -> {after:?} q {q}"
        );
    }
}

/// The scrape reads the histogram as `Metrics` really renders it.
#[test]
fn scrape_reads_issued_latency_buckets() {
    use crate::metrics::Decision;
    use crate::telemetry::{Metrics, Snapshot};
    let m = Metrics::new();
    m.record(Decision::Allow, "issued", None, 0.00015);
    m.record(Decision::Allow, "issued", None, 0.003);
    m.record(Decision::Allow, "issued", None, 100.0);
    m.record(Decision::Deny, "admission_queue_full", None, 0.00001);
    let s = parse_scrape(&m.render(&Snapshot::default(), 0));
    assert_eq!(s.issued, 3);
    let b = &s.issued_latency;
    assert_eq!(b.len(), 17, "16 bounds and +Inf: {b:?}");
    assert_eq!(b[0], (0.0001, 0));
    assert_eq!(b[1].1, 1);
    assert_eq!(b.last(), Some(&(f64::INFINITY, 3)));
    assert!(b.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));
    let zero: Buckets = b.iter().map(|&(le, _)| (le, 0)).collect();
    assert_eq!(quantile_ms_from_deltas(&zero, b, 0.3), Some(0.2));
    assert_eq!(quantile_ms_from_deltas(&zero, b, 0.5), Some(3.2));
    assert_eq!(quantile_ms_from_deltas(&zero, b, 0.99), Some(f64::INFINITY));
}

/// The scrape reads the signing jobs, and those run inline, as the
/// admission metrics really render them; their deltas never go negative.
#[test]
fn scrape_reads_signing_jobs_and_inline_jobs() {
    use crate::admission::AdmissionObserver;
    use crate::telemetry::{Metrics, Snapshot};
    let m = Metrics::new();
    let before = parse_scrape(&m.render(&Snapshot::default(), 0));
    for inline in [true, false, false, true, false] {
        m.admission.job_done(inline);
    }
    let after = parse_scrape(&m.render(&Snapshot::default(), 0));
    assert_eq!((after.jobs, after.inline_jobs), (5, 2));
    assert_eq!(after.jobs_since(&before), (5, 2));
    assert_eq!(before.jobs_since(&after), (0, 0));
}

/// A phase's certificate work counts the jobs that ran inline at the
/// signing threads' cost per job, and has no figure once most ran inline.
#[test]
fn job_cpu_counts_inline_jobs_at_the_threads_cost() {
    for (thread_cpu, jobs, inline, want) in [
        (0.2, 10_000, 0, Some(0.2)),
        (0.2, 0, 0, Some(0.2)),
        (0.198, 10_000, 100, Some(0.2)),
        (0.1, 10_000, 5_000, Some(0.2)),
        (0.05, 10_000, 5_001, None),
        (0.0, 10_000, 10_000, None),
        (0.1, 5, 9, None),
    ] {
        let got = job_cpu_with_inline(thread_cpu, jobs, inline);
        assert_eq!(
            got.map(|c| (c * 1e6).round() / 1e6),
            want,
            "{thread_cpu} s/s on the threads, {jobs} jobs, {inline} inline"
        );
    }
}

/// A success answered after the load window counts in every figure of
/// the client's view except the goodput of the window.
#[test]
fn successes_after_the_window_count_only_with_the_drain() {
    let mut s = StormSamples::for_proxies(2);
    s.record(0, &Ok(5_000_000), Some(2));
    s.record(1, &Ok(900_000_000), None);
    s.record(1, &Err("ResourceExhausted".into()), Some(0));
    s.record(0, &Err("ResourceExhausted".into()), None);
    assert_eq!((s.ok_in_window, s.latencies.len(), s.attempts), (1, 2, 4));
    assert_eq!(s.ok_by_second, vec![0, 0, 1]);
    assert_eq!(s.per_proxy_ok, vec![1, 1]);
    assert_eq!(s.per_proxy_failed, vec![1, 1]);
    assert_eq!(s.outcomes.get("ResourceExhausted"), Some(&2));
}

/// Sheds between two scrapes: every reason's delta, a reason new in
/// the second scrape included, none for a reason that did not move, and
/// no negative delta after a counter reset.
#[test]
fn sheds_since_are_every_reason_delta() {
    let scraped = |pairs: &[(&str, u64)]| Scraped {
        shed: pairs.iter().map(|&(k, v)| (k.to_string(), v)).collect(),
        ..Default::default()
    };
    let cases = [
        (vec![], vec![], vec![]),
        (vec![("a", 5)], vec![("a", 5)], vec![]),
        (
            vec![("a", 5)],
            vec![("a", 9), ("b", 3)],
            vec![("a", 4), ("b", 3)],
        ),
        (
            vec![("a", 5), ("b", 2)],
            vec![("a", 1), ("b", 4)],
            vec![("b", 2)],
        ),
    ];
    for (before, after, want) in cases {
        let got = scraped(&after).sheds_since(&scraped(&before));
        assert_eq!(got, scraped(&want).shed, "{before:?} -> {after:?}");
    }
}

#[test]
fn infinite_quantile_is_written_as_a_string() {
    #[derive(Serialize)]
    struct T {
        #[serde(serialize_with = "finite_or_inf")]
        a: Option<f64>,
        #[serde(serialize_with = "finite_or_inf")]
        b: Option<f64>,
        #[serde(serialize_with = "finite_or_inf")]
        c: Option<f64>,
    }
    let t = T {
        a: Some(1.6),
        b: Some(f64::INFINITY),
        c: None,
    };
    assert_eq!(
        serde_json::to_string(&t).ok().as_deref(),
        Some(r#"{"a":1.6,"b":"+Inf","c":null}"#)
    );
}

#[test]
fn agent_backoff_table() {
    let ms = |v| Some(Duration::from_millis(v));
    let cases = [
        (0, "ResourceExhausted", 100, ms(100)),
        (4, "ResourceExhausted", 100, ms(1600)),
        (5, "ResourceExhausted", 100, None),
        (0, "Unavailable", 0, ms(90)),
        (0, "ClientTimeout", 200, ms(110)),
        (0, "Unauthenticated", 100, None),
        (0, "InvalidArgument", 100, None),
    ];
    for (attempt, code, draw, want) in cases {
        assert_eq!(agent_backoff(attempt, code, draw), want, "{attempt} {code}");
    }
}

/// Shares are each proxy's successes over all successes per proxy; the
/// lowest is looked for among the well-behaved proxies only.
#[test]
fn shares_are_over_the_fair_share_and_the_lowest_skips_the_greedy_proxy() {
    let mut s = StormSamples::for_proxies(3);
    for (i, n) in [(0, 1), (1, 3), (2, 2)] {
        for _ in 0..n {
            s.record(i, &Ok(1), Some(0));
        }
    }
    s.per_proxy_skipped[2] = 4;
    let t = s.tallies();
    let shares: Vec<f64> = t.iter().map(|p| p.share).collect();
    assert_eq!(shares, vec![0.5, 1.5, 1.0]);
    assert_eq!((t[2].ok, t[2].skipped, t[2].failed), (2, 4, 0));
    assert_eq!(lowest_share(&t), Some((2, 1.0)));
    assert_eq!(lowest_share(&t[..1]), None);
}
