//! Leaf validity rules (istiod's, made explicit): plain functions of `now`.

use std::time::Duration;
use time::OffsetDateTime;

/// istiod's `ClockSkewGracePeriod`: leaves are backdated by this much.
pub const CLOCK_SKEW_GRACE: Duration = Duration::from_secs(120);

/// Default and maximum workload certificate lifetimes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtlPolicy {
    pub default: Duration,
    pub max: Duration,
}

impl Default for TtlPolicy {
    fn default() -> Self {
        Self {
            default: Duration::from_secs(24 * 3600),
            max: Duration::from_secs(90 * 24 * 3600),
        }
    }
}

/// A leaf's validity window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    pub not_before: OffsetDateTime,
    pub not_after: OffsetDateTime,
    /// `not_after` was cut to the signing certificate's expiry.
    pub clamped: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TtlError {
    /// Rejected, not clamped, as istiod does; the message is istiod's.
    #[error("requested TTL {} is greater than the max allowed TTL {}", go_duration(*.requested_secs as u64), go_duration(.max.as_secs()))]
    TooLong { requested_secs: i64, max: Duration },
    #[error("signing certificate has expired at {0}")]
    SignerExpired(OffsetDateTime),
}

impl TtlError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::TooLong { .. } => "ttl_too_long",
            Self::SignerExpired(_) => "signer_expired",
        }
    }
}

/// Computes the validity of a leaf requested with `requested_secs`
/// (`validity_duration` from the wire, any i64).
pub fn validity(
    now: OffsetDateTime,
    requested_secs: i64,
    policy: &TtlPolicy,
    signer_not_after: OffsetDateTime,
) -> Result<Validity, TtlError> {
    // Compared in whole seconds before any multiplication, so huge values
    // cannot overflow (istiod's Go code wraps above ~9.2e9 s).
    let lifetime = if requested_secs <= 0 {
        policy.default
    } else if requested_secs as u64 > policy.max.as_secs() {
        return Err(TtlError::TooLong {
            requested_secs,
            max: policy.max,
        });
    } else {
        Duration::from_secs(requested_secs as u64)
    };
    if now >= signer_not_after {
        return Err(TtlError::SignerExpired(signer_not_after));
    }
    let wanted = now + lifetime;
    let (not_after, clamped) = if wanted >= signer_not_after {
        (signer_not_after, true)
    } else {
        (wanted, false)
    };
    Ok(Validity {
        not_before: now - CLOCK_SKEW_GRACE,
        not_after,
        clamped,
    })
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
    let mut total: u64 = 0;
    let mut num = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            num.push(c);
            continue;
        }
        let unit: u64 = match c {
            'h' => 3600,
            'm' if chars.peek() == Some(&'s') => {
                chars.next();
                if num.is_empty() {
                    return Err(format!("invalid duration {s:?}"));
                }
                num.clear(); // sub-second parts are ignored
                continue;
            }
            'm' => 60,
            's' => 1,
            'd' => 86400,
            _ => return Err(format!("invalid duration {s:?}: unknown unit {c:?}")),
        };
        let n: u64 = num.parse().map_err(|_| format!("invalid duration {s:?}"))?;
        num.clear();
        total = n
            .checked_mul(unit)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(|| format!("duration {s:?} overflows"))?;
    }
    if !num.is_empty() {
        return Err(format!("invalid duration {s:?}: missing unit"));
    }
    Ok(Duration::from_secs(total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;
    use time::macros::datetime;

    const NOW: OffsetDateTime = datetime!(2026-01-01 00:00 UTC);
    const SIGNER_END: OffsetDateTime = datetime!(2027-01-01 00:00 UTC);

    fn policy() -> TtlPolicy {
        TtlPolicy::default()
    }

    #[test_case(0, 24 * 3600 ; "zero uses default")]
    #[test_case(-5, 24 * 3600 ; "negative uses default")]
    #[test_case(i64::MIN, 24 * 3600 ; "min uses default")]
    #[test_case(3600, 3600 ; "explicit")]
    #[test_case(90 * 24 * 3600, 90 * 24 * 3600 ; "exactly max is allowed")]
    fn lifetime(requested: i64, want_secs: i64) {
        let v = validity(NOW, requested, &policy(), SIGNER_END).unwrap();
        assert_eq!(v.not_after - NOW, time::Duration::seconds(want_secs));
        assert_eq!(NOW - v.not_before, time::Duration::minutes(2));
        assert!(!v.clamped);
    }

    #[test_case(90 * 24 * 3600 + 1 ; "just over")]
    #[test_case(i64::MAX ; "overflowing")]
    #[test_case(9_300_000_000 ; "wraps in go")]
    fn too_long(requested: i64) {
        let err = validity(NOW, requested, &policy(), SIGNER_END).unwrap_err();
        assert_eq!(err.reason(), "ttl_too_long");
    }

    #[test]
    fn too_long_message_matches_istiod() {
        let p = TtlPolicy {
            default: Duration::from_secs(1800),
            max: Duration::from_secs(7200),
        };
        let err = validity(NOW, 3 * 3600, &p, SIGNER_END).unwrap_err();
        assert_eq!(
            err.to_string(),
            "requested TTL 3h0m0s is greater than the max allowed TTL 2h0m0s"
        );
    }

    #[test]
    fn clamps_to_signer_expiry() {
        let end = NOW + time::Duration::hours(1);
        let v = validity(NOW, 2 * 3600, &policy(), end).unwrap();
        assert_eq!(v.not_after, end);
        assert!(v.clamped);
    }

    #[test]
    fn expired_signer_is_refused() {
        let err = validity(NOW, 60, &policy(), NOW).unwrap_err();
        assert_eq!(err.reason(), "signer_expired");
    }

    #[test_case("24h", 86400 ; "hours")]
    #[test_case("2160h0m0s", 2160 * 3600 ; "go string")]
    #[test_case("1h30m", 5400 ; "mixed")]
    #[test_case("90s", 90 ; "seconds")]
    #[test_case("10d", 864000 ; "days")]
    fn parses_durations(s: &str, want: u64) {
        assert_eq!(parse_go_duration(s).unwrap(), Duration::from_secs(want));
    }

    #[test_case("" ; "empty")]
    #[test_case("24" ; "no unit")]
    #[test_case("h" ; "no number")]
    #[test_case("5y" ; "bad unit")]
    fn rejects_bad_durations(s: &str) {
        assert!(parse_go_duration(s).is_err());
    }

    #[test_case(0, "0s")]
    #[test_case(59, "59s")]
    #[test_case(60, "1m0s")]
    #[test_case(7200, "2h0m0s")]
    #[test_case(7261, "2h1m1s")]
    fn formats_like_go(secs: u64, want: &str) {
        assert_eq!(go_duration(secs), want);
    }
}
