//! One decider per PodCertificateRequest.
//!
//! Every replica watches every request. The status write is a
//! compare-and-swap (a PUT with the object's resourceVersion), so only one
//! status lands; but without more, both replicas would sign a leaf and
//! record it as issued before they race, and the audit log would show two
//! issuances for one request, one of them never delivered. So a replica
//! first claims the request: an annotation naming it and the time, written
//! with the same compare-and-swap. Only the claim's holder decides; the
//! others wait for the claim to lapse (a holder that died) and look again.
//! The spec of a request is immutable, so the claim write changes nothing
//! but the annotation.

use std::time::Duration;

/// The annotation a replica writes to claim a request: `HOLDER@UNIX_SECONDS`.
pub const ANNOTATION: &str = "meshca.io/decider";
/// How long a claim keeps other replicas off: far longer than signing and
/// an acknowledged audit record take, short beside the kubelet's patience.
pub const TTL: Duration = Duration::from_secs(30);
/// A claim dated further ahead than this is not honoured: nobody can park a
/// request by writing a claim in the future.
const FUTURE_SKEW: i64 = 5;

/// What a request's claim annotation means for `holder` now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// No claim, a lapsed one or an unreadable one: take it.
    Free,
    /// Ours (an earlier attempt of this process).
    Ours,
    /// Another replica's, for `remaining` more.
    Held { remaining: Duration },
}

/// Reads a claim annotation.
pub fn view(value: Option<&str>, holder: &str, now_unix: i64, ttl: Duration) -> View {
    let Some((who, at)) = value.and_then(|v| v.rsplit_once('@')) else {
        return View::Free;
    };
    let Ok(at) = at.parse::<i64>() else {
        return View::Free;
    };
    if who == holder {
        return View::Ours;
    }
    let ttl = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX);
    if at > now_unix.saturating_add(FUTURE_SKEW) {
        return View::Free;
    }
    let left = at.saturating_add(ttl).saturating_sub(now_unix);
    if left <= 0 {
        View::Free
    } else {
        View::Held {
            remaining: Duration::from_secs(left.unsigned_abs()),
        }
    }
}

/// The annotation value `holder` writes at `now_unix`.
pub fn value(holder: &str, now_unix: i64) -> String {
    format!("{holder}@{now_unix}")
}

/// This process's name as a claim holder: the replica (`POD_NAME`, which
/// the chart sets, or `HOSTNAME`) and a random suffix, so a restarted
/// replica does not mistake its predecessor's claim for its own.
pub fn holder() -> String {
    let replica = ["POD_NAME", "HOSTNAME"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
        .unwrap_or_else(|| "meshca".into());
    let mut r = [0u8; 4];
    // A failed draw leaves zeros: the replica name still tells replicas apart.
    let _ = aws_lc_rs::rand::fill(&mut r);
    format!("{replica}-{}", hex::encode(r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_read_as_a_table() {
        let ttl = Duration::from_secs(30);
        let now = 1_000_000;
        let held = |s| View::Held {
            remaining: Duration::from_secs(s),
        };
        let cases: &[(Option<&str>, View)] = &[
            (None, View::Free),
            (Some(""), View::Free),
            (Some("no-at-sign"), View::Free),
            (Some("a@not-a-number"), View::Free),
            (Some("me@999990"), View::Ours),
            (Some("me@1"), View::Ours),
            (Some("other@1000000"), held(30)),
            (Some("other@999990"), held(20)),
            (Some("other@999971"), held(1)),
            (Some("other@999970"), View::Free),
            (Some("other@1"), View::Free),
            // A little ahead (clock skew between replicas) holds...
            (Some("other@1000005"), held(35)),
            // ...far ahead does not.
            (Some("other@1000006"), View::Free),
            (Some("other@9223372036854775807"), View::Free),
            (Some("other@-9223372036854775808"), View::Free),
            // The holder is everything before the last '@'.
            (Some("me@x@999990"), held(20)),
        ];
        for (value, want) in cases {
            assert_eq!(view(*value, "me", now, ttl), *want, "{value:?}");
        }
        assert_eq!(
            view(Some(&value("me@x", now)), "me@x", now, ttl),
            View::Ours
        );
    }

    #[test]
    fn holders_differ_between_processes() {
        assert_ne!(holder(), holder());
    }
}
