//! Leaf validity rules (istiod's, made explicit, plus renewal hygiene):
//! plain functions of `now` and a random draw.
//!
//! Clients do not jitter: ztunnel renews at exactly the midpoint of the
//! validity the CA writes, so leaves issued in one burst with one lifetime
//! renew in one burst. The CA therefore draws each leaf's lifetime from a band
//! below the granted TTL, and caps the backdate so the midpoint stays well in
//! the future (istiod's fixed 2-minute backdate makes a TTL <= 4 min renew in
//! a tight loop).

use std::time::Duration;

pub use crate::flags::{go_duration, parse_go_duration};
pub use crate::lifetime::{JitterBand, LifetimeChoice, MIN_JITTER_PERCENT};
use time::OffsetDateTime;

/// istiod's `ClockSkewGracePeriod`: leaves are backdated by at most this much.
pub const CLOCK_SKEW_GRACE: Duration = Duration::from_secs(120);

/// Default and maximum workload certificate lifetimes, and the renewal jitter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtlPolicy {
    pub default: Duration,
    pub max: Duration,
    /// `None` turns jitter off: every leaf lives exactly its granted TTL.
    pub jitter: Option<JitterBand>,
}

impl Default for TtlPolicy {
    fn default() -> Self {
        Self {
            default: Duration::from_secs(24 * 3600),
            max: Duration::from_secs(90 * 24 * 3600),
            jitter: Some(JitterBand::DEFAULT),
        }
    }
}

/// A leaf's validity and how it was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    pub validity: Validity,
    pub choice: LifetimeChoice,
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
/// (`validity_duration` from the wire, any i64), with a fresh random draw.
pub fn validity(
    now: OffsetDateTime,
    requested_secs: i64,
    policy: &TtlPolicy,
    signer_not_after: OffsetDateTime,
) -> Result<Validity, TtlError> {
    grant(now, requested_secs, policy, signer_not_after, random_draw()).map(|g| g.validity)
}

/// A uniform random u64 for [`grant`]. Jitter is not a security control, so
/// a (never seen) RNG failure degrades to the band's floor rather than failing.
pub fn random_draw() -> u64 {
    let mut b = [0u8; 8];
    match aws_lc_rs::rand::fill(&mut b) {
        Ok(()) => u64::from_le_bytes(b),
        Err(_) => 0,
    }
}

/// The lifetime in whole seconds drawn by `draw` from `band` of `granted`
/// (uniform over the integers of the band; `None` is exactly `granted`).
pub fn jittered_lifetime(granted: u64, band: Option<JitterBand>, draw: u64) -> u64 {
    let Some(b) = band else {
        return granted;
    };
    let g = u128::from(granted);
    let lo = (g * u128::from(b.min_percent)).div_ceil(100);
    let hi = (g * u128::from(b.max_percent) / 100).max(lo);
    let picked = lo + u128::from(draw) % (hi - lo + 1);
    u64::try_from(picked.min(g)).unwrap_or(granted)
}

/// The backdate for a leaf granted `granted` seconds and living `lifetime`:
/// istiod's 2 minutes, but never more than TTL/4, and never so much that the
/// midpoint `(lifetime - backdate) / 2` falls before TTL/4 after issuance.
pub fn backdate(granted: u64, lifetime: u64) -> u64 {
    CLOCK_SKEW_GRACE
        .as_secs()
        .min(granted / 4)
        .min(lifetime.saturating_sub(granted.div_ceil(2)))
}

/// [`validity`] with an explicit random draw (tests pin it), also returning
/// how the lifetime was chosen.
pub fn grant(
    now: OffsetDateTime,
    requested_secs: i64,
    policy: &TtlPolicy,
    signer_not_after: OffsetDateTime,
    draw: u64,
) -> Result<Grant, TtlError> {
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
    let granted_secs = lifetime.as_secs();
    let lifetime_secs = jittered_lifetime(granted_secs, policy.jitter, draw);
    let backdate_secs = backdate(granted_secs, lifetime_secs);
    // A date past the calendar's end (absurd configured max) is past the signer's too.
    let wanted = i64::try_from(lifetime_secs)
        .ok()
        .and_then(|s| now.checked_add(time::Duration::seconds(s)));
    let (not_after, clamped) = match wanted {
        Some(w) if w < signer_not_after => (w, false),
        _ => (signer_not_after, true),
    };
    Ok(Grant {
        validity: Validity {
            not_before: now - Duration::from_secs(backdate_secs),
            not_after,
            clamped,
        },
        choice: LifetimeChoice {
            granted_secs,
            band: policy.jitter,
            lifetime_secs,
            backdate_secs,
        },
    })
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

    /// Jitter off: istiod's validity exactly (for TTLs of 8 minutes and more).
    fn istiod() -> TtlPolicy {
        TtlPolicy {
            jitter: None,
            ..TtlPolicy::default()
        }
    }

    #[test_case(0, 24 * 3600 ; "zero uses default")]
    #[test_case(-5, 24 * 3600 ; "negative uses default")]
    #[test_case(i64::MIN, 24 * 3600 ; "min uses default")]
    #[test_case(3600, 3600 ; "explicit")]
    #[test_case(480, 480 ; "eight minutes still gets the full backdate")]
    #[test_case(90 * 24 * 3600, 90 * 24 * 3600 ; "exactly max is allowed")]
    fn lifetime_without_jitter_is_istiods(requested: i64, want_secs: i64) {
        for draw in [0, 1, u64::MAX] {
            let v = validity(NOW, requested, &istiod(), SIGNER_END).unwrap();
            let g = grant(NOW, requested, &istiod(), SIGNER_END, draw).unwrap();
            assert_eq!(v, g.validity, "no randomness without jitter");
            assert_eq!(v.not_after - NOW, time::Duration::seconds(want_secs));
            assert_eq!(NOW - v.not_before, time::Duration::minutes(2));
            assert!(!v.clamped);
            assert_eq!(g.choice.band, None);
        }
    }

    // (granted, backdate): min(2 min, TTL/4); istiod's 2 min made TTL <= 4 min renew at once.
    #[test_case(60, 15 ; "one minute")]
    #[test_case(240, 60 ; "four minutes")]
    #[test_case(479, 119 ; "just under eight minutes")]
    #[test_case(480, 120 ; "eight minutes")]
    #[test_case(86400, 120 ; "a day")]
    fn backdate_is_capped_at_a_quarter_of_the_ttl(granted: u64, want: u64) {
        assert_eq!(backdate(granted, granted), want);
        let g = grant(NOW, granted as i64, &istiod(), SIGNER_END, 0).unwrap();
        assert_eq!(g.choice.backdate_secs, want);
    }

    // (granted, band, draw) -> lifetime: uniform over the integers of the band.
    #[test_case(3600, 90, 100, 0, 3240 ; "floor")]
    #[test_case(3600, 90, 100, 360, 3600 ; "ceiling")]
    #[test_case(3600, 90, 100, 361, 3240 ; "wraps")]
    #[test_case(60, 90, 100, 6, 60 ; "one minute ceiling")]
    #[test_case(61, 90, 100, 0, 55 ; "floor rounds up")]
    #[test_case(1, 90, 100, u64::MAX, 1 ; "one second")]
    #[test_case(3600, 100, 100, 12345, 3600 ; "degenerate band")]
    fn jitter_draws_within_the_band(granted: u64, lo: u8, hi: u8, draw: u64, want: u64) {
        let band = JitterBand::new(lo, hi).unwrap();
        assert_eq!(jittered_lifetime(granted, Some(band), draw), want);
    }

    #[test_case("90-100", Some((90, 100)) ; "default")]
    #[test_case("75%-95%", Some((75, 95)) ; "with percent signs")]
    #[test_case("50-50", Some((50, 50)) ; "fixed half")]
    #[test_case("49-100", None ; "floor too low")]
    #[test_case("95-90", None ; "inverted")]
    #[test_case("90-101", None ; "above the ttl")]
    #[test_case("90", None ; "one number")]
    #[test_case("a-b", None ; "not numbers")]
    fn parses_bands(s: &str, want: Option<(u8, u8)>) {
        let got = JitterBand::parse(s)
            .ok()
            .map(|b| (b.min_percent, b.max_percent));
        assert_eq!(got, want);
    }

    /// The attack: a burst of issuance at one TTL renews in one burst. Every
    /// lifetime must lie in the band and the draws must cover it uniformly.
    #[test]
    fn ten_thousand_leaves_spread_uniformly_over_the_band() {
        const N: usize = 10_000;
        const BINS: usize = 10;
        let ttl = 3600u64;
        let (lo, hi) = (3240u64, 3600u64);
        let mut counts = [0usize; BINS];
        let mut seen = std::collections::HashSet::new();
        for _ in 0..N {
            let v = validity(NOW, ttl as i64, &policy(), SIGNER_END).unwrap();
            let life = (v.not_after - NOW).whole_seconds() as u64;
            assert!((lo..=hi).contains(&life), "{life} outside the band");
            assert_eq!((NOW - v.not_before).whole_seconds(), 120);
            seen.insert(life);
            let bin = ((life - lo) as usize * BINS / (hi - lo + 1) as usize).min(BINS - 1);
            counts[bin] += 1;
        }
        // Pearson's chi-square against uniform bins (sizes 36 or 37 of 361 values).
        let chi2: f64 = (0..BINS)
            .map(|b| {
                let width = (0..=(hi - lo))
                    .filter(|v| (*v as usize * BINS / (hi - lo + 1) as usize).min(BINS - 1) == b)
                    .count();
                let expected = N as f64 * width as f64 / (hi - lo + 1) as f64;
                (counts[b] as f64 - expected).powi(2) / expected
            })
            .sum();
        // 9 degrees of freedom: P(chi2 > 27.88) = 0.001 for a uniform draw.
        assert!(chi2 < 27.88, "not uniform: chi2 {chi2:.1}, bins {counts:?}");
        assert!(seen.len() > 300, "only {} distinct lifetimes", seen.len());
        assert!(
            seen.contains(&lo) || seen.contains(&(lo + 1)),
            "floor reached"
        );
        assert!(
            seen.contains(&hi) || seen.contains(&(hi - 1)),
            "ceiling reached"
        );
    }

    /// ztunnel renews at the written midpoint: it must be at least TTL/4 in
    /// the future for every TTL, at both ends of any allowed band.
    #[test]
    fn midpoint_is_at_least_a_quarter_ttl_after_issuance() {
        let mut ttls: Vec<u64> = vec![60, 61, 64, 90, 120, 239, 240, 241, 300, 479, 480, 481];
        ttls.extend([3600, 86400, 7 * 86400, 30 * 86400, 90 * 86400]);
        ttls.extend((60..=600).step_by(7));
        let bands = [
            None,
            Some(JitterBand::DEFAULT),
            Some(JitterBand::new(50, 100).unwrap()),
            Some(JitterBand::new(50, 50).unwrap()),
            Some(JitterBand::new(75, 80).unwrap()),
        ];
        for ttl in ttls {
            for band in bands {
                let p = TtlPolicy {
                    jitter: band,
                    ..policy()
                };
                for draw in [0, 1, 7, ttl / 20, ttl / 2, u64::MAX - 1, u64::MAX] {
                    let g = grant(NOW, ttl as i64, &p, SIGNER_END, draw).unwrap();
                    let v = g.validity;
                    let mid = v.not_before + (v.not_after - v.not_before) / 2;
                    assert!(
                        (mid - NOW) * 4 >= time::Duration::seconds(ttl as i64),
                        "ttl {ttl} band {band:?} draw {draw}: midpoint only {} after issuance",
                        mid - NOW
                    );
                    assert!(v.not_before <= NOW && v.not_after <= NOW + Duration::from_secs(ttl));
                    assert_eq!(
                        (g.choice.lifetime_secs, g.choice.backdate_secs),
                        (
                            (v.not_after - NOW).whole_seconds() as u64,
                            (NOW - v.not_before).whole_seconds() as u64
                        )
                    );
                }
            }
        }
    }

    #[test]
    fn absurd_max_ttl_clamps_instead_of_overflowing() {
        let p = TtlPolicy {
            max: Duration::from_secs(u64::MAX / 2),
            ..istiod()
        };
        let v = validity(NOW, i64::MAX, &p, SIGNER_END).unwrap();
        assert!(v.clamped && v.not_after == SIGNER_END);
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
            jitter: None,
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

    #[test_case("250ms", 250 ; "milliseconds")]
    #[test_case("1m500ms", 60_500 ; "minutes and milliseconds")]
    #[test_case("1s1ms", 1001 ; "seconds and milliseconds")]
    fn parses_milliseconds(s: &str, want: u64) {
        assert_eq!(parse_go_duration(s).unwrap(), Duration::from_millis(want));
    }

    #[test_case("" ; "empty")]
    #[test_case("24" ; "no unit")]
    #[test_case("h" ; "no number")]
    #[test_case("ms" ; "no number of milliseconds")]
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
