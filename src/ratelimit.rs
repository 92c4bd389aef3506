//! Rate limiting: a token bucket with reservations, shared by every domain
//! that paces work (TokenReviews sent to the API server, requests admitted
//! per source).

use std::time::{Duration, Instant};

/// A token bucket: `burst` at once, then `per_sec`. It paces TokenReviews
/// and each source's signing requests at admission.
/// A caller may reserve a slot up to `max_wait` ahead; beyond that it is
/// refused with the wait it would have needed (a retry hint).
#[derive(Debug, Clone)]
pub struct TokenBucket {
    per_sec: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(per_sec: u32, burst: u32, now: Instant) -> Self {
        let burst = f64::from(burst.max(1));
        Self {
            per_sec: f64::from(per_sec.max(1)),
            burst,
            tokens: burst,
            at: now,
        }
    }

    /// Reserves one review: `Ok(wait)` to start after `wait` (at most
    /// `max_wait`), `Err(wait)` when the next free slot is further away.
    pub fn reserve(&mut self, now: Instant, max_wait: Duration) -> Result<Duration, Duration> {
        let now = now.max(self.at);
        let elapsed = now.duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.per_sec).min(self.burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Ok(Duration::ZERO);
        }
        // Reservations already handed out drive `tokens` below zero.
        let wait = Duration::from_secs_f64((1.0 - self.tokens) / self.per_sec);
        if wait > max_wait {
            return Err(wait);
        }
        self.tokens -= 1.0;
        Ok(wait)
    }

    /// Gives back a reserved slot whose work never started (a TokenReview
    /// refused by the in-flight cap), so a slow API server does not also burn
    /// the rate budget.
    pub fn refund(&mut self) {
        self.tokens = (self.tokens + 1.0).min(self.burst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_allows_the_burst_then_paces_or_refuses() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut b = TokenBucket::new(10, 3, t0);
        for _ in 0..3 {
            assert_eq!(b.reserve(t0, Duration::ZERO), Ok(Duration::ZERO));
        }
        let refused = b.reserve(t0, Duration::ZERO).unwrap_err();
        assert!(refused.abs_diff(ms(100)) < ms(1), "{refused:?}");
        let w1 = b.reserve(t0, Duration::from_secs(1)).unwrap();
        let w2 = b.reserve(t0, Duration::from_secs(1)).unwrap();
        assert!(w1.abs_diff(ms(100)) < ms(1) && w2.abs_diff(ms(200)) < ms(1));
        // A quiet second refills to the burst, never beyond.
        let t1 = t0 + Duration::from_secs(10);
        for _ in 0..3 {
            assert_eq!(b.reserve(t1, Duration::ZERO), Ok(Duration::ZERO));
        }
        assert!(b.reserve(t1, Duration::ZERO).is_err());
        b.refund();
        assert_eq!(b.reserve(t1, Duration::ZERO), Ok(Duration::ZERO));
        for _ in 0..10 {
            b.refund();
        }
        assert_eq!(b.tokens, 3.0, "never above the burst");
    }

    /// Over every window, reviews started <= burst + rate x window.
    #[test]
    fn bucket_never_exceeds_its_budget_over_any_window() {
        let t0 = Instant::now();
        let (rate, burst) = (50u32, 20u32);
        let mut b = TokenBucket::new(rate, burst, t0);
        let mut starts = Vec::new();
        let mut draw = 12345u64;
        for i in 0..5000u64 {
            // Arrivals at a pseudo-random 0-40 ms pace: well above the rate on average.
            draw = draw
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let at = t0 + Duration::from_micros(i * 4000 + (draw >> 40) % 4000);
            if let Ok(wait) = b.reserve(at, Duration::from_millis(300)) {
                assert!(wait <= Duration::from_millis(300));
                starts.push(at + wait);
            }
        }
        starts.sort();
        for (i, s) in starts.iter().enumerate() {
            for (j, e) in starts.iter().enumerate().skip(i) {
                let window = e.duration_since(*s).as_secs_f64();
                if window > 2.0 {
                    break;
                }
                let allowed = f64::from(burst) + f64::from(rate) * window + 1e-6;
                assert!(
                    ((j - i + 1) as f64) <= allowed,
                    "{} starts in {window}s",
                    j - i + 1
                );
            }
        }
        let span = starts
            .last()
            .unwrap()
            .duration_since(starts[0])
            .as_secs_f64();
        assert!(
            starts.len() as f64 >= f64::from(rate) * span * 0.95,
            "the budget is used"
        );
    }
}
