//! Label sets shared by the domains' metric families. A leaf: every
//! domain's `metrics` module may import it.

use prometheus_client::encoding::EncodeLabelSet;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// `allow` or `deny`.
    pub decision: &'static str,
    pub reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LatencyLabels {
    pub decision: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    pub reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceResultLabels {
    pub source: &'static str,
    pub result: &'static str,
}

impl From<&'static str> for RefusalLabels {
    fn from(reason: &'static str) -> Self {
        Self { reason }
    }
}

impl From<&'static str> for ReasonLabels {
    fn from(reason: &'static str) -> Self {
        Self {
            reason: reason.into(),
        }
    }
}
