//! Metric families of token verification (`authn::token`, `authn::local`,
//! `authn::jwks`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::labels::{RefusalLabels, ResultLabels};

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
