//! What a storm's clients saw: outcomes, latencies and each proxy's tally,
//! pooled over its rounds.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

#[derive(Default)]
pub(super) struct StormSamples {
    pub(super) latencies: Vec<u64>,
    /// Successes answered before the load window closed.
    pub(super) ok_in_window: usize,
    /// Those successes by the whole second of the window they ended in.
    pub(super) ok_by_second: Vec<usize>,
    pub(super) outcomes: BTreeMap<String, usize>,
    pub(super) per_proxy_ok: Vec<usize>,
    /// Each proxy's requests skipped at its in-flight cap, and refused or
    /// failed (any outcome but a success).
    pub(super) per_proxy_skipped: Vec<usize>,
    pub(super) per_proxy_failed: Vec<usize>,
    pub(super) renewals: usize,
    pub(super) attempts: usize,
    pub(super) gave_up: usize,
}

impl StormSamples {
    /// Adds another round's samples (latencies unsorted).
    pub(super) fn absorb(&mut self, o: StormSamples) {
        self.latencies.extend(o.latencies);
        self.ok_in_window += o.ok_in_window;
        for (k, v) in o.outcomes {
            *self.outcomes.entry(k).or_default() += v;
        }
        for (mine, theirs) in [
            (&mut self.per_proxy_ok, o.per_proxy_ok),
            (&mut self.per_proxy_skipped, o.per_proxy_skipped),
            (&mut self.per_proxy_failed, o.per_proxy_failed),
        ] {
            for (m, t) in mine.iter_mut().zip(theirs) {
                *m += t;
            }
        }
        self.renewals += o.renewals;
        self.attempts += o.attempts;
        self.gave_up += o.gave_up;
    }

    /// One request's outcome; `second`: the whole second of the load
    /// window in which it ended (None: after the window closed).
    pub(super) fn record(&mut self, i: usize, r: &Result<u64, String>, second: Option<usize>) {
        self.attempts += 1;
        match r {
            Ok(ns) => {
                self.latencies.push(*ns);
                if let Some(at) = second {
                    self.ok_in_window += 1;
                    if self.ok_by_second.len() <= at {
                        self.ok_by_second.resize(at + 1, 0);
                    }
                    self.ok_by_second[at] += 1;
                }
                self.per_proxy_ok[i] += 1;
                *self.outcomes.entry("Ok".into()).or_default() += 1;
            }
            Err(e) => {
                self.per_proxy_failed[i] += 1;
                *self.outcomes.entry(e.clone()).or_default() += 1
            }
        }
    }

    /// Empty samples for `n` proxies.
    pub(super) fn for_proxies(n: usize) -> Self {
        StormSamples {
            per_proxy_ok: vec![0; n],
            per_proxy_skipped: vec![0; n],
            per_proxy_failed: vec![0; n],
            ..Default::default()
        }
    }

    /// Each proxy's tally; its share is its successes over the fair share
    /// (all successes over the proxies).
    pub(super) fn tallies(&self) -> Vec<ProxyTally> {
        let n = self.per_proxy_ok.len().max(1);
        let fair = self.per_proxy_ok.iter().sum::<usize>() as f64 / n as f64;
        (0..self.per_proxy_ok.len())
            .map(|i| ProxyTally {
                ok: self.per_proxy_ok[i],
                skipped: self.per_proxy_skipped[i],
                failed: self.per_proxy_failed[i],
                share: self.per_proxy_ok[i] as f64 / fair.max(1e-9),
            })
            .collect()
    }
}

/// One proxy's requests in a storm (proxy 0 is the greedy one).
#[derive(Debug, Clone, Serialize)]
pub struct ProxyTally {
    pub ok: usize,
    /// Not started: the proxy already had its in-flight cap.
    pub skipped: usize,
    /// Refused or failed, whatever the code.
    pub failed: usize,
    /// `ok` over the fair share (all successes over the proxies).
    pub share: f64,
}

/// The lowest share among the well-behaved proxies (all but proxy 0) and
/// which proxy had it.
pub(super) fn lowest_share(t: &[ProxyTally]) -> Option<(usize, f64)> {
    t.iter()
        .enumerate()
        .skip(1)
        .map(|(i, p)| (i, p.share))
        .min_by(|a, b| a.1.total_cmp(&b.1))
}

/// The whole second of the window `start..=stop` that is now, if within it.
pub(super) fn window_second(start: Instant, stop: Instant) -> Option<usize> {
    let now = Instant::now();
    (now <= stop).then(|| now.duration_since(start).as_secs() as usize)
}
