//! The standard `process_*` metrics (the names Prometheus's own clients
//! export, so stock dashboards and alerts work) and `meshca_build_info`, read
//! from `/proc/self` at scrape time. A leaf: it imports no meshca module.

use std::fmt::Write as _;

/// What one scrape reads of the process.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub start_time_seconds: f64,
    pub threads: u64,
    pub open_fds: Option<u64>,
    pub max_fds: Option<u64>,
}

/// Parses `/proc/self/stat` (proc(5)): `ticks` is the clock tick rate,
/// `page` the page size, `boot_time` the `btime` of `/proc/stat`. The second
/// field (the command name) may hold spaces and parentheses, so fields are
/// counted from the last `)`.
pub fn parse_stat(stat: &str, ticks: u64, page: u64, boot_time: u64) -> Option<ProcessStats> {
    let after = &stat[stat.rfind(')')? + 1..];
    // `after` starts at field 3 (state); field N is at index N - 3.
    let f: Vec<&str> = after.split_whitespace().collect();
    let num = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    let ticks = ticks.max(1) as f64;
    Some(ProcessStats {
        cpu_seconds: (num(14)? + num(15)?) as f64 / ticks,
        threads: num(20)?,
        start_time_seconds: boot_time as f64 + num(22)? as f64 / ticks,
        virtual_bytes: num(23)?,
        resident_bytes: num(24)?.saturating_mul(page),
        open_fds: None,
        max_fds: None,
    })
}

/// `btime` of `/proc/stat`: boot time, in seconds since the epoch.
pub fn parse_boot_time(proc_stat: &str) -> Option<u64> {
    proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// The soft limit of `Max open files` in `/proc/self/limits`.
pub fn parse_max_fds(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// This process, now; `None` where `/proc` is not there.
pub fn read() -> Option<ProcessStats> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let boot = parse_boot_time(&std::fs::read_to_string("/proc/stat").ok()?)?;
    let mut s = parse_stat(
        &stat,
        rustix::param::clock_ticks_per_second(),
        rustix::param::page_size() as u64,
        boot,
    )?;
    s.open_fds = std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|d| d.count() as u64);
    s.max_fds = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| parse_max_fds(&l));
    Some(s)
}

/// The process families and `meshca_build_info` in the text exposition.
pub fn render(out: &mut String, stats: Option<&ProcessStats>, version: &str, commit: &str) {
    let _ = writeln!(
        out,
        "# HELP meshca_build_info The running meshca: version and git commit.\n# TYPE meshca_build_info gauge\nmeshca_build_info{{version=\"{}\",commit=\"{}\"}} 1",
        escape(version),
        escape(commit)
    );
    let Some(s) = stats else {
        return;
    };
    let mut family = |name: &str, kind: &str, help: &str, v: String| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
        );
    };
    family(
        "process_cpu_seconds_total",
        "counter",
        "Total user and system CPU time spent in seconds.",
        format!("{}", s.cpu_seconds),
    );
    family(
        "process_resident_memory_bytes",
        "gauge",
        "Resident memory size in bytes.",
        s.resident_bytes.to_string(),
    );
    family(
        "process_virtual_memory_bytes",
        "gauge",
        "Virtual memory size in bytes.",
        s.virtual_bytes.to_string(),
    );
    family(
        "process_start_time_seconds",
        "gauge",
        "Start time of the process since unix epoch in seconds.",
        format!("{}", s.start_time_seconds),
    );
    family(
        "process_threads",
        "gauge",
        "Number of OS threads in the process.",
        s.threads.to_string(),
    );
    if let Some(n) = s.open_fds {
        family(
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            n.to_string(),
        );
    }
    if let Some(n) = s.max_fds {
        family(
            "process_max_fds",
            "gauge",
            "Maximum number of open file descriptors.",
            n.to_string(),
        );
    }
}

/// A label value in the text format: backslash, quote and newline escaped.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    // A real line, with a command name holding a space and a parenthesis.
    const STAT: &str = "4242 (mesh ca) x) S 1 4242 4242 0 -1 4194560 9000 0 0 0 250 150 0 0 20 0 7 0 123400 987654321 5000 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0";

    #[test]
    fn stat_fields_are_counted_from_the_command_name_end() {
        let s = parse_stat(STAT, 100, 4096, 1_700_000_000).unwrap();
        assert_eq!(s.cpu_seconds, 4.0, "utime 250 + stime 150 ticks at 100/s");
        assert_eq!(s.threads, 7);
        assert_eq!(s.start_time_seconds, 1_700_000_000.0 + 1234.0);
        assert_eq!(s.virtual_bytes, 987_654_321);
        assert_eq!(s.resident_bytes, 5000 * 4096);
    }

    #[test]
    fn truncated_stat_is_none() {
        assert_eq!(parse_stat("4242 (meshca) S 1 2 3", 100, 4096, 0), None);
        assert_eq!(parse_stat("no parenthesis", 100, 4096, 0), None);
    }

    #[test]
    fn boot_time_and_fd_limit() {
        assert_eq!(
            parse_boot_time("cpu  1 2 3\nbtime 1765000000\nprocesses 9\n"),
            Some(1_765_000_000)
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \nMax open files            65536                524288               files     \n";
        assert_eq!(parse_max_fds(limits), Some(65536));
    }

    #[test]
    fn this_process_reads_and_renders() {
        let s = read().expect("/proc is there on Linux");
        assert!(s.resident_bytes > 0 && s.threads >= 1 && s.open_fds.unwrap() > 0);
        let mut out = String::new();
        render(&mut out, Some(&s), "1.2.3", "abc\"d");
        assert!(out.contains("meshca_build_info{version=\"1.2.3\",commit=\"abc\\\"d\"} 1\n"));
        for name in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_max_fds",
            "process_start_time_seconds",
        ] {
            assert!(out.contains(&format!("# TYPE {name} ")), "{name}: {out}");
        }
    }
}
