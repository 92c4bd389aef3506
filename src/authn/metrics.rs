//! Metric families of token verification (`authn::token`, `authn::local`,
//! `authn::jwks`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::metrics::labels::{ReasonLabels, RefusalLabels, ResultLabels};
use crate::metrics::Register;

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
        Self {
            verifications: registry.metric(
                "meshca_token_verifications",
                "Bearer token verifications by path (local, review) and result",
            ),
            local_outcomes: registry.metric(
                "meshca_token_local_outcomes",
                "Tokens local verification refused or handed to TokenReview, by reason",
            ),
            jwks_fetches: registry.metric(
                "meshca_jwks_fetches",
                "ServiceAccount issuer key fetches (OIDC discovery) by result",
            ),
            jwks_keys: registry.metric(
                "meshca_jwks_keys",
                "Keys in the last good ServiceAccount issuer key set",
            ),
        }
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

impl TokenReviewMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        Self {
            tokenreview_duration: registry.metric_with(
                "meshca_tokenreview_duration_seconds",
                "TokenReview round trip to the API server",
                Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            ),
            tokenreview_errors: registry.metric(
                "meshca_tokenreview_errors",
                "TokenReviews that could not be made (timeout, API error)",
            ),
            tokenreviews: registry.metric(
                "meshca_tokenreviews",
                "TokenReviews sent to the API server, by result (authenticated, rejected, error)",
            ),
            tokenreview_coalesced: registry.metric(
                "meshca_tokenreview_coalesced",
                "Requests that joined a TokenReview already in flight for the same token",
            ),
            tokenreview_negative_cache_hits: registry.metric(
                "meshca_tokenreview_negative_cache_hits",
                "Requests refused from the cache of tokens the API server rejected",
            ),
            tokenreview_precheck_rejected: registry.metric(
                "meshca_tokenreview_precheck_rejected",
                "Tokens dropped by the pre-check (not a JWT, expired) before any review",
            ),
            tokenreview_refused: registry.reasons(
                "meshca_tokenreview_refused",
                "Requests refused by the TokenReview budget, by reason",
                [REASON_BUDGET, REASON_INFLIGHT],
            ),
            tokenreview_inflight: registry.metric(
                "meshca_tokenreview_inflight",
                "TokenReviews outstanding at the API server",
            ),
        }
    }
}
