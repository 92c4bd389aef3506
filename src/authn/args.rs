//! Flags of local token verification (`authn::local`, `authn::jwks`).

use std::time::Duration;

use super::token::ReviewLimits;
use crate::flags::{bounded_duration, err, ConfigError, MAX_PERIOD};

/// How bearer tokens are verified (`--token-verification`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TokenVerificationMode {
    /// A TokenReview for every new token (istiod's behaviour).
    #[default]
    Review,
    /// Locally only: nothing is sent to the API server per token.
    Local,
    /// Locally, and TokenReview for whatever local verification cannot decide.
    LocalThenReview,
}

impl TokenVerificationMode {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Review => "review",
            Self::Local => "local",
            Self::LocalThenReview => "local-then-review",
        }
    }
    pub fn uses_local(&self) -> bool {
        !matches!(self, Self::Review)
    }
}

/// Flags of token verification.
#[derive(Debug, Clone, clap::Args)]
pub struct TokenVerificationArgs {
    /// How bearer tokens are verified: `review` (a TokenReview per new token,
    /// as istiod), `local` (signature against the issuer's keys from the API
    /// server's OIDC discovery, claims, and the bound pod in the pod index;
    /// nothing sent per token), or `local-then-review` (local, and a
    /// TokenReview for what local verification cannot decide: unknown issuer
    /// or key, pod not in the index, index not synced).
    ///
    /// `local` checks what a TokenReview checks without sending one: the signature against the
    /// issuer keys from the API server's OIDC discovery; `iss`, `aud`, `exp`/`nbf`/`iat` with the
    /// API server's one-minute leeway; the ServiceAccount and the bound pod present in meshca's
    /// indexes with the token's UIDs and not deleted more than a minute ago (plus the pod's service
    /// account and node); an index whose watch is down past MESHCA_POD_INDEX_MAX_STALENESS decides
    /// nothing (retryable refusal). `local-then-review` sends to TokenReview what local
    /// verification cannot decide (unknown issuer or `kid`, an object not in an index or with
    /// another UID, an index not synced or stale). Both refuse every token a TokenReview refuses
    /// (docs/SECURITY.md, trust parity). They need `list`/`watch` on pods and serviceaccounts. The
    /// chart sets `local-then-review`. How it works: docs/configuration.md, Local token
    /// verification.
    #[arg(long, env = "MESHCA_TOKEN_VERIFICATION", value_enum, default_value_t = TokenVerificationMode::Review)]
    pub token_verification: TokenVerificationMode,
    /// Refuse tokens that are not bound to a pod (any verification mode).
    ///
    /// Reason `token_pod_binding_required`.
    #[arg(long, env = "MESHCA_TOKEN_REQUIRE_POD_BINDING", default_value_t = false, action = clap::ArgAction::Set)]
    pub token_require_pod_binding: bool,
    /// Periodic refresh of the issuer's keys.
    ///
    /// The keys are read through `/.well-known/openid-configuration` and `/openid/v1/jwks`, in
    /// every mode (the denylist's `token-key` entries need them too); a key the issuer removed
    /// stops verifying locally at the next refresh. After a failed fetch, retried every
    /// MESHCA_JWKS_MIN_REFRESH_INTERVAL.
    #[arg(long, env = "MESHCA_JWKS_REFRESH_INTERVAL", default_value = "10m")]
    pub jwks_refresh_interval: String,
    /// Fewest time between two key fetches (an unknown `kid` triggers one).
    ///
    /// An unknown `kid` triggers a fetch at most this often. A failed fetch keeps the last good
    /// keys, up to MESHCA_JWKS_MAX_AGE.
    #[arg(long, env = "MESHCA_JWKS_MIN_REFRESH_INTERVAL", default_value = "30s")]
    pub jwks_min_refresh_interval: String,
    /// Oldest the issuer's key set may be and still verify tokens locally
    /// (fetches keep failing): past it `local-then-review` asks TokenReview
    /// and `local` refuses retryably, so a key the issuer removed stops
    /// verifying within this bound. At least the refresh interval plus the
    /// minimum interval (one retry).
    ///
    /// `local` refuses with `token_local_keys_stale`. At least MESHCA_JWKS_REFRESH_INTERVAL +
    /// MESHCA_JWKS_MIN_REFRESH_INTERVAL.
    #[arg(long, env = "MESHCA_JWKS_MAX_AGE", default_value = "15m")]
    pub jwks_max_age: String,
}

/// Parsed [`TokenVerificationArgs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenVerification {
    pub mode: TokenVerificationMode,
    pub require_pod_binding: bool,
    pub refresh: super::jwks::RefreshPolicy,
}

impl Default for TokenVerification {
    fn default() -> Self {
        Self {
            mode: TokenVerificationMode::Review,
            require_pod_binding: false,
            refresh: Default::default(),
        }
    }
}

impl TokenVerificationArgs {
    pub fn parse(&self, fetch_timeout: Duration) -> Result<TokenVerification, ConfigError> {
        let interval = bounded_duration(
            "MESHCA_JWKS_REFRESH_INTERVAL",
            &self.jwks_refresh_interval,
            false,
            MAX_PERIOD,
        )?;
        let min_interval = bounded_duration(
            "MESHCA_JWKS_MIN_REFRESH_INTERVAL",
            &self.jwks_min_refresh_interval,
            false,
            MAX_PERIOD,
        )?;
        if min_interval > interval {
            return Err(err(
                "MESHCA_JWKS_MIN_REFRESH_INTERVAL",
                &self.jwks_min_refresh_interval,
                "must not exceed MESHCA_JWKS_REFRESH_INTERVAL",
            ));
        }
        let max_age =
            bounded_duration("MESHCA_JWKS_MAX_AGE", &self.jwks_max_age, false, MAX_PERIOD)?;
        // A set refreshed on time must never be judged too old: the periodic
        // fetch and at least one retry fit in the maximum age.
        if max_age < interval.saturating_add(min_interval) {
            return Err(err(
                "MESHCA_JWKS_MAX_AGE",
                &self.jwks_max_age,
                "must be at least MESHCA_JWKS_REFRESH_INTERVAL + MESHCA_JWKS_MIN_REFRESH_INTERVAL",
            ));
        }
        Ok(TokenVerification {
            mode: self.token_verification,
            require_pod_binding: self.token_require_pod_binding,
            refresh: super::jwks::RefreshPolicy {
                interval,
                min_interval,
                timeout: fetch_timeout,
                max_age,
            },
        })
    }
}

/// Flags of the TokenReview budget and the cache of rejected tokens.
#[derive(Debug, Clone, clap::Args)]
pub struct TokenReviewArgs {
    /// Sustained TokenReviews per second meshca may send to the API server.
    ///
    /// The TokenReview budget is a token bucket: this rate, `--tokenreview-burst` at once, and at
    /// most `--tokenreview-max-inflight` outstanding.
    #[arg(long, env = "MESHCA_TOKENREVIEW_QPS", default_value_t = ReviewLimits::default().qps)]
    pub tokenreview_qps: u32,
    /// TokenReviews meshca may send at once after a quiet period.
    #[arg(long, env = "MESHCA_TOKENREVIEW_BURST", default_value_t = ReviewLimits::default().burst)]
    pub tokenreview_burst: u32,
    /// TokenReviews outstanding at the API server at once.
    #[arg(long, env = "MESHCA_TOKENREVIEW_MAX_INFLIGHT", default_value_t = ReviewLimits::default().max_inflight)]
    pub tokenreview_max_inflight: u32,
    /// Longest a request waits for the TokenReview budget before it is refused (Unavailable).
    ///
    /// Beyond it the request gets `RESOURCE_EXHAUSTED` with a retry hint (`grpc-retry-pushback-ms`,
    /// RetryInfo) and the reason `tokenreview_budget_exhausted` or
    /// `tokenreview_inflight_exhausted`.
    #[arg(long, env = "MESHCA_TOKENREVIEW_MAX_WAIT", default_value = "1s")]
    pub tokenreview_max_wait: String,
    /// How long a token the API server rejected is refused without a new review (0s disables).
    ///
    /// Timeouts and transport errors are never cached. Short, because a pod-bound token can be
    /// rejected by an HA API server whose cache has not seen a new pod yet. A cached rejection has
    /// the original rejection's reason code.
    #[arg(long, env = "MESHCA_TOKEN_NEGATIVE_CACHE_TTL", default_value = "10s")]
    pub token_negative_cache_ttl: String,
    /// Most rejected tokens remembered at once.
    ///
    /// When full, further rejections are not cached (the budget still bounds reviews).
    #[arg(long, env = "MESHCA_TOKEN_NEGATIVE_CACHE_SIZE", default_value_t = ReviewLimits::default().negative_max_entries)]
    pub token_negative_cache_size: usize,
}

impl TokenReviewArgs {
    /// The TokenReview budget, in-flight cap and negative cache.
    pub fn parse(&self) -> Result<ReviewLimits, ConfigError> {
        let positive = |name, v: u32| {
            if v == 0 {
                Err(err(name, "0", "must be positive"))
            } else {
                Ok(v)
            }
        };
        // Bounded like every other duration: `Instant + d` must not overflow.
        let duration = |name, v: &str| bounded_duration(name, v, true, MAX_PERIOD);
        if self.token_negative_cache_size == 0 {
            return Err(err(
                "MESHCA_TOKEN_NEGATIVE_CACHE_SIZE",
                "0",
                "must be positive (MESHCA_TOKEN_NEGATIVE_CACHE_TTL=0s disables the cache)",
            ));
        }
        Ok(ReviewLimits {
            qps: positive("MESHCA_TOKENREVIEW_QPS", self.tokenreview_qps)?,
            burst: positive("MESHCA_TOKENREVIEW_BURST", self.tokenreview_burst)?,
            max_inflight: positive(
                "MESHCA_TOKENREVIEW_MAX_INFLIGHT",
                self.tokenreview_max_inflight,
            )?,
            max_wait: duration("MESHCA_TOKENREVIEW_MAX_WAIT", &self.tokenreview_max_wait)?,
            negative_ttl: duration(
                "MESHCA_TOKEN_NEGATIVE_CACHE_TTL",
                &self.token_negative_cache_ttl,
            )?,
            negative_max_entries: self.token_negative_cache_size,
        })
    }
}
