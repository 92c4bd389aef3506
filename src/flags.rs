//! Parsing helpers of every domain's flags: the error that names the
//! variable, bounded counts and durations, Go-style durations, lists and
//! `namespace/name` references. A leaf: it imports no other module, so any
//! domain may own its flags and parse them here.

use std::time::Duration;

pub mod doc;

/// A setting that could not be parsed: names the variable, value and reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {name}={value:?}: {reason}")]
pub struct ConfigError {
    pub name: &'static str,
    pub value: String,
    pub reason: String,
}

impl ConfigError {
    pub fn reason(&self) -> &'static str {
        "config_invalid"
    }
}

pub(crate) fn err(name: &'static str, value: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        name,
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// Longest certificate lifetime accepted by the TTL flags: far inside the
/// `time` crate's range (year 9999), so `now + ttl` cannot overflow.
pub const MAX_TTL_LIMIT: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
/// Upper bound of the period and timeout flags: a day is already absurd for
/// any of them; beyond, `Instant + d` could overflow.
pub const MAX_PERIOD: Duration = Duration::from_secs(24 * 3600);

/// A duration flag within `(0, max]`, or `[0, max]` when `zero_ok`.
pub(crate) fn bounded_duration(
    name: &'static str,
    v: &str,
    zero_ok: bool,
    max: Duration,
) -> Result<Duration, ConfigError> {
    let d = parse_go_duration(v).map_err(|e| err(name, v, e))?;
    if d.is_zero() && !zero_ok {
        return Err(err(name, v, "must be positive"));
    }
    if d > max {
        return Err(err(
            name,
            v,
            format!("must be at most {}", go_duration(max.as_secs())),
        ));
    }
    Ok(d)
}

/// A duration flag within `[min, max]` (`min` > 0).
pub(crate) fn duration_between(
    name: &'static str,
    v: &str,
    min: Duration,
    max: Duration,
) -> Result<Duration, ConfigError> {
    let d = bounded_duration(name, v, false, max)?;
    if d < min {
        let shown = match min.subsec_millis() {
            0 => format!("{}s", min.as_secs()),
            _ => format!("{}ms", min.as_millis()),
        };
        return Err(err(name, v, format!("must be at least {shown}")));
    }
    Ok(d)
}

/// A ConfigMap reference `namespace/name` (both parts non-empty, one slash).
pub fn parse_configmap_ref(v: &str) -> Option<(String, String)> {
    v.split_once('/')
        .filter(|(n, m)| !n.is_empty() && !m.is_empty() && !m.contains('/'))
        .map(|(n, m)| (n.to_string(), m.to_string()))
}

/// A `namespace/name` ConfigMap flag of `meshca serve`: unset or blank is
/// none; set, it must parse and Kubernetes must be on.
pub(crate) fn configmap_flag(
    name: &'static str,
    v: Option<&str>,
    kube_on: bool,
) -> Result<Option<(String, String)>, ConfigError> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some(v) => {
            let r =
                parse_configmap_ref(v).ok_or_else(|| err(name, v, "expected namespace/name"))?;
            if !kube_on {
                return Err(err(name, v, "needs Kubernetes"));
            }
            Ok(Some(r))
        }
    }
}

/// A count or size flag within `[min, max]`.
pub(crate) fn bounded<T: PartialOrd + std::fmt::Display + Copy>(
    name: &'static str,
    v: T,
    min: T,
    max: T,
) -> Result<T, ConfigError> {
    if v < min || v > max {
        return Err(err(
            name,
            &v.to_string(),
            format!("must be between {min} and {max}"),
        ));
    }
    Ok(v)
}

/// The non-empty, trimmed items of a comma-separated flag.
pub(crate) fn list(s: &str) -> impl Iterator<Item = &str> {
    s.split(',').map(str::trim).filter(|s| !s.is_empty())
}

/// Formats whole seconds the way Go's `time.Duration.String` does (`2160h0m0s`).
pub fn go_duration(secs: u64) -> String {
    let (h, m, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
    if h > 0 {
        format!("{h}h{m}m{s}s")
    } else if m > 0 {
        format!("{m}m{s}s")
    } else {
        format!("{s}s")
    }
}

/// Parses a Go-style duration (`24h`, `90m`, `1h30m`, `3600s`, `2160h0m0s`).
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("empty duration".into());
    }
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    // In milliseconds: sub-second limits (e.g. a 250ms wait) matter; smaller units do not.
    let mut total: u64 = 0;
    let mut num = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let unit_ms: u64 = match c {
            'h' => 3_600_000,
            'm' if chars.peek() == Some(&'s') => {
                chars.next();
                1
            }
            'm' => 60_000,
            's' => 1000,
            'd' => 86_400_000,
            _ => return Err(format!("invalid duration {s:?}: unknown unit {c:?}")),
        };
        let n: u64 = num.parse().map_err(|_| format!("invalid duration {s:?}"))?;
        num.clear();
        total = n
            .checked_mul(unit_ms)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(|| format!("duration {s:?} overflows"))?;
    }
    if !num.is_empty() {
        return Err(format!("invalid duration {s:?}: missing unit"));
    }
    Ok(Duration::from_millis(total))
}
