//! What the storm reads from the server's /metrics: issued certificates,
//! sheds by reason, the issued requests' latency histogram and the signing
//! jobs, and the arithmetic on two scrapes of them.

use std::collections::BTreeMap;

/// Adds the observations between two scrapes of a cumulative histogram
/// ([`bucket_deltas`]) to `acc`. False when they cannot be read or their
/// bounds differ from `acc`'s.
pub(super) fn add_bucket_deltas(
    acc: &mut Option<Buckets>,
    before: &[(f64, u64)],
    after: &[(f64, u64)],
) -> bool {
    let Some(deltas) = bucket_deltas(before, after) else {
        return false;
    };
    let sum = acc.get_or_insert_with(|| deltas.iter().map(|&(b, _)| (b, 0)).collect());
    if sum.len() != deltas.len() || sum.iter().zip(&deltas).any(|(t, d)| t.0 != d.0) {
        return false;
    }
    for (total, (_, n)) in sum.iter_mut().zip(deltas) {
        total.1 += n;
    }
    true
}

/// Cumulative histogram buckets as /metrics shows them: (upper bound in
/// seconds, count of observations at or below it), in the order exported
/// (ascending, `+Inf` last as `f64::INFINITY`).
pub type Buckets = Vec<(f64, u64)>;

/// The `q` quantile (0 < q <= 1) of the observations made between two
/// scrapes of the same cumulative histogram, in ms: the upper bound of the
/// bucket holding it (no interpolation; `f64::INFINITY` for the `+Inf`
/// bucket). None when nothing was observed in between, the two scrapes'
/// bounds differ, or any bucket went down (a counter reset: the server
/// restarted).
pub fn quantile_ms_from_deltas(before: &[(f64, u64)], after: &[(f64, u64)], q: f64) -> Option<f64> {
    quantile_ms(&bucket_deltas(before, after)?, q)
}

/// The observations between two scrapes of the same cumulative histogram,
/// cumulative too. None when the scrapes' bounds differ or any bucket went
/// down (a counter reset: the server restarted).
fn bucket_deltas(before: &[(f64, u64)], after: &[(f64, u64)]) -> Option<Buckets> {
    if before.len() != after.len() {
        return None;
    }
    before
        .iter()
        .zip(after)
        .map(|(&(b0, c0), &(b1, c1))| (b0 == b1 && c1 >= c0).then(|| (b1, c1 - c0)))
        .collect()
}

/// The `q` quantile (0 < q <= 1) of a cumulative histogram, in ms, as
/// [`quantile_ms_from_deltas`] gives it.
pub(super) fn quantile_ms(deltas: &[(f64, u64)], q: f64) -> Option<f64> {
    if !(q > 0.0 && q <= 1.0) {
        return None;
    }
    let total = deltas.last()?.1;
    if total == 0 {
        return None;
    }
    let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
    deltas
        .iter()
        .find(|&&(_, cum)| cum >= rank)
        // Rounded to the µs: the bounds are exported as decimal text.
        .map(|&(bound, _)| (bound * 1e6).round() / 1e3)
}

/// What the storm reads from the server's /metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Scraped {
    /// `meshca_decisions_total{...reason="issued"}`.
    pub(super) issued: u64,
    /// `meshca_admission_shed_total` by reason.
    pub(super) shed: BTreeMap<String, u64>,
    /// `meshca_request_duration_seconds_bucket{decision="allow",le=...}`.
    pub(super) issued_latency: Buckets,
    /// `meshca_admission_jobs_total`: signing jobs run to their end.
    pub(super) jobs: u64,
    /// `meshca_admission_inline_jobs_total`: of those, run on the request's own worker.
    pub(super) inline_jobs: u64,
}

impl Scraped {
    /// Sheds by reason since `before` (reasons with none left out; a
    /// counter that went back counts none).
    pub(super) fn sheds_since(&self, before: &Scraped) -> BTreeMap<String, u64> {
        self.shed
            .iter()
            .map(|(k, v)| {
                let was = before.shed.get(k).copied().unwrap_or(0);
                (k.clone(), v.saturating_sub(was))
            })
            .filter(|(_, v)| *v > 0)
            .collect()
    }

    /// Signing jobs since `before`, and how many of them ran inline.
    pub(super) fn jobs_since(&self, before: &Scraped) -> (u64, u64) {
        (
            self.jobs.saturating_sub(before.jobs),
            self.inline_jobs.saturating_sub(before.inline_jobs),
        )
    }
}

/// The CPU per second of a phase's certificate work, from the signing
/// threads' (`thread_cpu_per_s`) when `inline` of its `jobs` ran on the
/// requests' own workers instead (below overload): each such job is taken
/// to cost what one on the threads did. None when more than half ran
/// inline (too few on the threads to stand for the rest).
pub(super) fn job_cpu_with_inline(thread_cpu_per_s: f64, jobs: u64, inline: u64) -> Option<f64> {
    if inline == 0 {
        return Some(thread_cpu_per_s);
    }
    let on_threads = jobs.checked_sub(inline)?;
    (on_threads >= inline).then(|| thread_cpu_per_s * jobs as f64 / on_threads as f64)
}

/// A phase's certificate work per second ([`job_cpu_with_inline`]) and
/// the jobs it ran inline, from the signing threads' CPU reading and the
/// scrapes on either side of the phase (None where a reading is missing).
pub(super) fn phase_work(
    thread_cpu_per_s: Option<f64>,
    before: Option<&Scraped>,
    after: Option<&Scraped>,
) -> (Option<f64>, Option<u64>) {
    let jobs = before.zip(after).map(|(b, a)| a.jobs_since(b));
    let cpu = thread_cpu_per_s
        .zip(jobs)
        .and_then(|(cpu, (all, inline))| job_cpu_with_inline(cpu, all, inline));
    (cpu, jobs.map(|(_, inline)| inline))
}

/// Scrapes the admin port's /metrics.
pub(super) async fn scrape(admin: std::net::SocketAddr) -> Option<Scraped> {
    let (_, body) = crate::bench::cold::http_get(admin, "/metrics").await?;
    Some(parse_scrape(&body))
}

/// The value of label `name` in a `{a="x",b="y"}` label set.
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    labels
        .trim_start_matches('{')
        .trim_end_matches('}')
        .split(',')
        .find_map(|kv| {
            kv.strip_prefix(name)?
                .strip_prefix("=\"")?
                .strip_suffix('"')
        })
}

pub(super) fn parse_scrape(text: &str) -> Scraped {
    let mut out = Scraped::default();
    for line in text.lines() {
        let Some((name, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        if name.starts_with("meshca_decisions_total{") && name.contains("reason=\"issued\"") {
            out.issued += v as u64;
        }
        if let Some(rest) = name.strip_prefix("meshca_admission_shed_total{reason=\"") {
            let reason = rest.trim_end_matches("\"}").to_string();
            out.shed.insert(reason, v as u64);
        }
        match name {
            "meshca_admission_jobs_total" => out.jobs = v as u64,
            "meshca_admission_inline_jobs_total" => out.inline_jobs = v as u64,
            _ => {}
        }
        if let Some(labels) = name.strip_prefix("meshca_request_duration_seconds_bucket") {
            if label(labels, "decision") != Some("allow") {
                continue;
            }
            let bound = match label(labels, "le") {
                Some("+Inf") => f64::INFINITY,
                Some(b) => match b.parse::<f64>() {
                    Ok(b) => b,
                    Err(_) => continue,
                },
                None => continue,
            };
            out.issued_latency.push((bound, v as u64));
        }
    }
    out
}
