//! A speed reference on the server's CPU (`--storm-speed-probe-cpu`).
//!
//! On a VM the work one CPU-second does can move by a third for tens of
//! seconds with no steal time at all (another guest on the same physical
//! core), so a peak measured before a storm is not the capacity during it.
//! A thread pinned to the server's CPU at nice 19 signs with ECDSA P-256,
//! the server's main work, in short bursts ([`BURST`] every [`PERIOD`]) and
//! counts signatures per second of its own CPU time. The server's quota is
//! CPU time on the same clock (steal excluded alike), so its capacity moves
//! with that rate: the storm's capacity is estimated as each neighbouring
//! peak scaled by the probe's rate in the storm over its rate in that peak.
//!
//! Bursts rather than a loop: a probe that never sleeps keeps the vCPU from
//! halting and competes with the server's wake-ups (measured: the server's
//! p99 doubled and a peak rose by a third), so it would change what it
//! measures. At about 2% of the CPU it does not.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{EcdsaKeyPair, ECDSA_P256_SHA256_ASN1_SIGNING};

/// How long the probe signs in each burst (wall clock), and how often.
pub const BURST: Duration = Duration::from_millis(1);
pub const PERIOD: Duration = Duration::from_millis(50);

/// The running probe; stopped and joined on drop.
pub struct SpeedProbe {
    counts: Arc<Counts>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Counts {
    ops: AtomicU64,
    /// The probe thread's CPU time in its bursts.
    cpu_ns: AtomicU64,
}

/// The probe's counts at an instant.
#[derive(Debug, Clone, Copy)]
pub struct Mark {
    ops: u64,
    cpu_ns: u64,
}

impl SpeedProbe {
    /// Starts the probe on `cpu`; fails when the thread cannot be pinned
    /// there or lowered to nice 19 (a probe competing with the server
    /// would measure the wrong thing).
    pub fn start(cpu: usize) -> anyhow::Result<Self> {
        let counts = Arc::new(Counts::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (ready, setup) = mpsc::channel();
        let (c, s) = (counts.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("speed-probe".into())
            .spawn(move || {
                let key = match prepare(cpu) {
                    Ok(key) => {
                        let _ = ready.send(Ok(()));
                        key
                    }
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                let rng = SystemRandom::new();
                while !s.load(Ordering::Relaxed) {
                    let cpu0 = thread_cpu_ns();
                    let end = Instant::now() + BURST;
                    let mut n = 0;
                    while Instant::now() < end {
                        if key.sign(&rng, b"meshca speed probe").is_ok() {
                            n += 1;
                        }
                    }
                    c.ops.fetch_add(n, Ordering::Relaxed);
                    c.cpu_ns
                        .fetch_add(thread_cpu_ns().saturating_sub(cpu0), Ordering::Relaxed);
                    std::thread::sleep(PERIOD.saturating_sub(BURST));
                }
            })
            .context("spawning the speed probe")?;
        setup
            .recv()
            .context("the speed probe exited during set-up")??;
        Ok(Self {
            counts,
            stop,
            thread: Some(thread),
        })
    }

    pub fn mark(&self) -> Mark {
        Mark {
            ops: self.counts.ops.load(Ordering::Relaxed),
            cpu_ns: self.counts.cpu_ns.load(Ordering::Relaxed),
        }
    }

    /// The probe's CPU time in its bursts since `m`.
    pub fn cpu_seconds_since(&self, m: Mark) -> f64 {
        self.mark().cpu_ns.saturating_sub(m.cpu_ns) as f64 / 1e9
    }

    /// Signatures per second of the probe's CPU time since `m`; None before
    /// a burst has ended.
    pub fn per_cpu_s_since(&self, m: Mark) -> Option<f64> {
        let now = self.mark();
        let cpu_ns = now.cpu_ns.checked_sub(m.cpu_ns).filter(|&c| c > 0)?;
        Some((now.ops - m.ops) as f64 / (cpu_ns as f64 / 1e9))
    }
}

impl Drop for SpeedProbe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The calling thread's CPU time, up to now: clock_gettime brings the
/// running thread's account up to date, where /proc's schedstat lags by up
/// to a scheduler tick (longer than a burst).
pub(super) fn thread_cpu_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    (t.tv_sec.max(0) as u64) * 1_000_000_000 + t.tv_nsec.max(0) as u64
}

/// Pins the calling thread to `cpu` at nice 19 and makes its signing key.
fn prepare(cpu: usize) -> anyhow::Result<EcdsaKeyPair> {
    let mut set = rustix::thread::CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set)
        .with_context(|| format!("pinning the speed probe to CPU {cpu}"))?;
    rustix::process::setpriority_process(Some(rustix::thread::gettid()), 19)
        .context("lowering the speed probe to nice 19")?;
    EcdsaKeyPair::generate(&ECDSA_P256_SHA256_ASN1_SIGNING)
        .map_err(|_| anyhow::anyhow!("generating the speed probe's P-256 key"))
}

/// The capacity during a storm, estimated from the peaks next to it: each
/// peak's rate times the storm's speed factor over that peak's, averaged.
/// A factor is what the server's CPU could do in that phase relative to
/// some unit (the probe's rate, or the share not stolen); None when any is
/// missing.
pub fn capacity_during(storm_factor: Option<f64>, peaks: &[(f64, Option<f64>)]) -> Option<f64> {
    let storm = storm_factor?;
    if peaks.is_empty() {
        return None;
    }
    let sum = peaks
        .iter()
        .map(|&(per_s, f)| Some(per_s * storm / f.filter(|f| *f > 0.0)?))
        .sum::<Option<f64>>()?;
    Some(sum / peaks.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_scales_each_peak_by_the_speed_in_the_storm() {
        // (storm factor, peaks (rate, factor), expected capacity)
        type Peaks = &'static [(f64, Option<f64>)];
        let cases: &[(Option<f64>, Peaks, Option<f64>)] = &[
            // No drift: the plain mean of the peaks.
            (
                Some(1.0),
                &[(800.0, Some(1.0)), (600.0, Some(1.0))],
                Some(700.0),
            ),
            // The probe ran a quarter slower in the storm than in both peaks.
            (
                Some(600.0),
                &[(800.0, Some(800.0)), (800.0, Some(800.0))],
                Some(600.0),
            ),
            // The second peak fell with the probe: both estimate the same capacity.
            (
                Some(700.0),
                &[(800.0, Some(700.0)), (600.0, Some(525.0))],
                Some(800.0),
            ),
            // One peak only (no peak after the last storm).
            (Some(500.0), &[(900.0, Some(600.0))], Some(750.0)),
            // Anything missing or zero: no estimate rather than a wrong one.
            (None, &[(800.0, Some(1.0))], None),
            (Some(1.0), &[(800.0, None)], None),
            (Some(1.0), &[(800.0, Some(0.0))], None),
            (Some(1.0), &[], None),
        ];
        for (storm, peaks, want) in cases {
            let got = capacity_during(*storm, peaks);
            match (got, want) {
                (Some(g), Some(w)) => {
                    assert!((g - w).abs() < 1e-9, "{storm:?} {peaks:?}: {g} != {w}")
                }
                _ => assert_eq!(got, *want, "{storm:?} {peaks:?}"),
            }
        }
    }

    #[test]
    fn the_probe_counts_signatures_on_its_cpu_and_stops() {
        let probe = SpeedProbe::start(0).expect("CPU 0 exists everywhere");
        let m = probe.mark();
        let deadline = Instant::now() + Duration::from_secs(10);
        while probe.mark().ops == m.ops && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            probe.per_cpu_s_since(m).is_some_and(|r| r > 0.0),
            "no signature counted in 10 s"
        );
        assert!(probe.cpu_seconds_since(m) > 0.0, "its CPU time is counted");
        drop(probe);
    }

    #[test]
    fn a_cpu_that_does_not_exist_is_refused() {
        let err = SpeedProbe::start(rustix::thread::CpuSet::MAX_CPU - 1)
            .err()
            .expect("no machine here has that many CPUs");
        assert!(format!("{err:#}").contains("pinning"), "{err:#}");
    }
}
