//! Metric families of token verification (`authn::token`, `authn::local`,
//! `authn::jwks`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::metrics::labels::{ReasonLabels, RefusalLabels, ResultLabels};
use crate::metrics::register_reasons;

/// `meshca_tokenreview_refused` reason: the TokenReview budget is spent.
pub const REASON_BUDGET: &str = "tokenreview_budget_exhausted";
/// `meshca_tokenreview_refused` reason: too many TokenReviews outstanding.
pub const REASON_INFLIGHT: &str = "tokenreview_inflight_exhausted";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenPathLabels {
    /// `local` or `review`.
    pub path: &'static str,
    /// `allowed`, `refused`, `unavailable`, or `fell_back` (local only: sent to TokenReview).
    pub result: &'static str,
}

/// Metrics of `authn::local` and `authn::jwks`.
#[derive(Debug, Clone, Default)]
pub struct TokenPathMetrics {
    pub verifications: Family<TokenPathLabels, Counter>,
    /// Local refusals and fallbacks, by reason code.
    pub local_outcomes: Family<RefusalLabels, Counter>,
    /// Issuer key fetches by result (`ok`, `failed`).
    pub jwks_fetches: Family<ResultLabels, Counter>,
    /// Keys in the last good issuer key set.
    pub jwks_keys: Gauge,
}

impl TokenPathMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "meshca_token_verifications",
            "Bearer token verifications by path (local, review) and result",
            m.verifications.clone(),
        );
        registry.register(
            "meshca_token_local_outcomes",
            "Tokens local verification refused or handed to TokenReview, by reason",
            m.local_outcomes.clone(),
        );
        registry.register(
            "meshca_jwks_fetches",
            "ServiceAccount issuer key fetches (OIDC discovery) by result",
            m.jwks_fetches.clone(),
        );
        registry.register(
            "meshca_jwks_keys",
            "Keys in the last good ServiceAccount issuer key set",
            m.jwks_keys.clone(),
        );
        m
    }
}

/// Metrics of `authn::token`: the TokenReview round trips, their budget
/// and the caches in front of them.
#[derive(Debug)]
pub struct TokenReviewMetrics {
    pub tokenreview_duration: Histogram,
    pub tokenreview_errors: Counter,
    /// TokenReviews sent, by result (`authenticated`, `rejected`, `error`).
    pub tokenreviews: Family<ResultLabels, Counter>,
    pub tokenreview_coalesced: Counter,
    pub tokenreview_negative_cache_hits: Counter,
    pub tokenreview_precheck_rejected: Family<ReasonLabels, Counter>,
    pub tokenreview_refused: Family<ReasonLabels, Counter>,
    pub tokenreview_inflight: Gauge,
}

impl Default for TokenReviewMetrics {
    fn default() -> Self {
        Self {
            tokenreview_duration: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            tokenreview_errors: Counter::default(),
            tokenreviews: Family::default(),
            tokenreview_coalesced: Counter::default(),
            tokenreview_negative_cache_hits: Counter::default(),
            tokenreview_precheck_rejected: Family::default(),
            tokenreview_refused: Family::default(),
            tokenreview_inflight: Gauge::default(),
        }
    }
}

impl TokenReviewMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "meshca_tokenreview_duration_seconds",
            "TokenReview round trip to the API server",
            m.tokenreview_duration.clone(),
        );
        registry.register(
            "meshca_tokenreview_errors",
            "TokenReviews that could not be made (timeout, API error)",
            m.tokenreview_errors.clone(),
        );
        registry.register(
            "meshca_tokenreviews",
            "TokenReviews sent to the API server, by result (authenticated, rejected, error)",
            m.tokenreviews.clone(),
        );
        registry.register(
            "meshca_tokenreview_coalesced",
            "Requests that joined a TokenReview already in flight for the same token",
            m.tokenreview_coalesced.clone(),
        );
        registry.register(
            "meshca_tokenreview_negative_cache_hits",
            "Requests refused from the cache of tokens the API server rejected",
            m.tokenreview_negative_cache_hits.clone(),
        );
        registry.register(
            "meshca_tokenreview_precheck_rejected",
            "Tokens dropped by the pre-check (not a JWT, expired) before any review",
            m.tokenreview_precheck_rejected.clone(),
        );
        register_reasons(
            registry,
            "meshca_tokenreview_refused",
            "Requests refused by the TokenReview budget, by reason",
            &m.tokenreview_refused,
            [REASON_BUDGET, REASON_INFLIGHT],
        );
        registry.register(
            "meshca_tokenreview_inflight",
            "TokenReviews outstanding at the API server",
            m.tokenreview_inflight.clone(),
        );
        m
    }
}
