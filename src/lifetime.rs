//! How a leaf's lifetime is drawn and recorded: the jitter band (a flag
//! value) and the choice written into the audit record. A leaf shared by
//! `ca::ttl`, which draws lifetimes, and `audit`, which records them.

/// Lowest allowed band floor: with it the written midpoint can still be kept
/// at least TTL/4 after issuance (see `ca::ttl::grant`).
pub const MIN_JITTER_PERCENT: u8 = 50;

/// The share of the granted TTL a leaf's lifetime is drawn from, in percent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JitterBand {
    pub min_percent: u8,
    pub max_percent: u8,
}

impl JitterBand {
    /// 90-100%: a burst of issuance spreads its renewals over 5% of the TTL.
    pub const DEFAULT: Self = Self {
        min_percent: 90,
        max_percent: 100,
    };

    pub fn new(min_percent: u8, max_percent: u8) -> Result<Self, String> {
        if !(MIN_JITTER_PERCENT..=100).contains(&min_percent)
            || !(min_percent..=100).contains(&max_percent)
        {
            return Err(format!(
                "band must satisfy {MIN_JITTER_PERCENT} <= min <= max <= 100 (percent), got {min_percent}-{max_percent}"
            ));
        }
        Ok(Self {
            min_percent,
            max_percent,
        })
    }

    /// Parses `MIN-MAX` in percent, e.g. `90-100`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (lo, hi) = s
            .trim()
            .trim_end_matches('%')
            .split_once('-')
            .ok_or_else(|| format!("expected MIN-MAX in percent (e.g. 90-100), got {s:?}"))?;
        let num = |v: &str| {
            v.trim()
                .trim_end_matches('%')
                .parse::<u8>()
                .map_err(|_| format!("{v:?} is not a percentage"))
        };
        Self::new(num(lo)?, num(hi)?)
    }
}

impl std::fmt::Display for JitterBand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}%", self.min_percent, self.max_percent)
    }
}

/// How a leaf's lifetime was chosen; written into its audit record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LifetimeChoice {
    /// The TTL granted (requested, or the default).
    pub granted_secs: u64,
    /// The band the lifetime was drawn from; `None` when jitter is off.
    pub band: Option<JitterBand>,
    /// Drawn lifetime from issuance (before any cut to the signer's expiry).
    pub lifetime_secs: u64,
    /// How far `not_before` lies before issuance.
    pub backdate_secs: u64,
}
