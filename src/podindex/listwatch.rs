//! The list-then-watch loop that feeds every index (pods, ServiceAccounts),
//! with freshness bounded by evidence rather than by the absence of errors.
//!
//! kube-runtime's watcher hides what freshness needs: bookmarks, and the
//! moment the API server accepts a watch. This loop sees both and marks each
//! as evidence that the index is current ([`super::WatchHealth`]), as it does
//! a completed list and every event. The API server's watch cache sends a
//! bookmark two seconds before a watch's `timeoutSeconds` runs out
//! (k8s.io/apiserver, `cacheWatcher.nextBookmarkTime`), so a watch asked to
//! end every [`Timing::watch_timeout`] brings evidence that often even when
//! nothing changes. A watch that brings nothing for [`Timing::silent_after`]
//! is dropped and started again, and the index counts as disconnected: a
//! connection that stays open but silent (a partition, a stopped API server)
//! costs seconds, not the client's idle timeout of about five minutes.

use std::fmt::Debug;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::StreamExt;
use kube::api::{ListParams, ObjectList, WatchEvent, WatchParams};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;

use super::{IndexEvent, Indexed, Shared};

/// Objects per list page (kube-runtime's default).
const PAGE_SIZE: u32 = 500;

/// How often a watch must bring evidence, and how the loop retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// `timeoutSeconds` of each watch (whole seconds): the API server ends
    /// it then, with a bookmark two seconds before.
    pub watch_timeout: Duration,
    /// Longer than this without evidence (no answer to a watch request, no
    /// event, no bookmark), the watch is silent: it is started again and the
    /// index counts as disconnected.
    pub silent_after: Duration,
    /// Longest one list page may take.
    pub list_page_timeout: Duration,
    /// First pause after a failed request; doubles up to `max_backoff`.
    pub backoff: Duration,
    pub max_backoff: Duration,
}

impl Timing {
    /// Evidence at least every third of `max_staleness`: a watch ends every
    /// third (at least 3 s, the shortest that still gets its bookmark, and
    /// at most 60 s, the API server's own bookmark period), and one silent
    /// 3 s past that is started again.
    pub fn for_max_staleness(max_staleness: Duration) -> Self {
        let watch_timeout = Duration::from_secs((max_staleness.as_secs() / 3).clamp(3, 60));
        Self {
            watch_timeout,
            silent_after: watch_timeout + Duration::from_secs(3),
            list_page_timeout: Duration::from_secs(30),
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(10),
        }
    }

    fn timeout_secs(&self) -> u32 {
        u32::try_from(self.watch_timeout.as_secs())
            .unwrap_or(60)
            .max(1)
    }
}

/// The watch's answers: one list page, or a watch stream from a resource
/// version. The API server in production, a fake in unit tests.
pub trait Source: Send + Sync {
    type Object: Resource + Clone + Send + 'static;

    /// One page of the (consistent) list, from `continue_token`.
    fn list(
        &self,
        continue_token: Option<String>,
    ) -> BoxFuture<'_, kube::Result<ObjectList<Self::Object>>>;

    /// Changes after `resource_version`, with bookmarks; the API server ends
    /// the stream after `timeout_secs`.
    #[allow(clippy::type_complexity)]
    fn watch(
        &self,
        resource_version: &str,
        timeout_secs: u32,
    ) -> BoxFuture<'_, kube::Result<BoxStream<'static, kube::Result<WatchEvent<Self::Object>>>>>;
}

/// All objects of `api` (with `fields`, a field selector).
pub struct KubeSource<K> {
    pub api: Api<K>,
    pub fields: Option<&'static str>,
}

impl<K> Source for KubeSource<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    type Object = K;

    fn list(&self, continue_token: Option<String>) -> BoxFuture<'_, kube::Result<ObjectList<K>>> {
        let mut lp = ListParams::default().limit(PAGE_SIZE);
        if let Some(f) = self.fields {
            lp = lp.fields(f);
        }
        if let Some(c) = &continue_token {
            lp = lp.continue_token(c);
        }
        Box::pin(async move { self.api.list(&lp).await })
    }

    fn watch(
        &self,
        resource_version: &str,
        timeout_secs: u32,
    ) -> BoxFuture<'_, kube::Result<BoxStream<'static, kube::Result<WatchEvent<K>>>>> {
        // Bookmarks are on by default.
        let mut wp = WatchParams::default().timeout(timeout_secs);
        if let Some(f) = self.fields {
            wp = wp.fields(f);
        }
        let rv = resource_version.to_string();
        Box::pin(async move { self.api.watch(&wp, &rv).await.map(StreamExt::boxed) })
    }
}

/// Doubling pauses between failed requests.
struct Backoff {
    next: Duration,
    first: Duration,
    max: Duration,
}

impl Backoff {
    fn new(t: &Timing) -> Self {
        Self {
            next: t.backoff,
            first: t.backoff,
            max: t.max_backoff,
        }
    }

    async fn pause(&mut self) {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        tokio::time::sleep(d).await;
    }

    fn reset(&mut self) {
        self.next = self.first;
    }
}

fn gone(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 410)
}

/// Feeds `index` from `source` forever: a paginated list, then watches from
/// its resource version, each ended by the API server after
/// [`Timing::watch_timeout`] and resumed from the last version seen;
/// relists when that version has expired (410 Gone). `lean` turns each
/// object into the index's form. The index keeps serving its last state
/// while the API server is unreachable or silent, and says how stale it is.
pub async fn run<Src, S>(
    source: Src,
    index: &Shared<S>,
    what: &'static str,
    lean: impl Fn(Src::Object) -> S::Item,
    timing: Timing,
) where
    Src: Source,
    S: Indexed,
{
    index.health().expect_evidence_within(timing.silent_after);
    let mut backoff = Backoff::new(&timing);
    loop {
        let Some(rv) = relist(&source, index, what, &lean, &timing).await else {
            index.mark_disconnected();
            backoff.pause().await;
            continue;
        };
        backoff.reset();
        follow(&source, index, what, &lean, &timing, rv, &mut backoff).await;
    }
}

/// One complete list into `index`; its resource version, or `None` when it
/// failed (said in the log).
async fn relist<Src, S>(
    source: &Src,
    index: &Shared<S>,
    what: &'static str,
    lean: &impl Fn(Src::Object) -> S::Item,
    timing: &Timing,
) -> Option<String>
where
    Src: Source,
    S: Indexed,
{
    // The items are buffered by the index and swapped in whole at the end.
    index.apply(IndexEvent::Init);
    let mut continue_token = None;
    loop {
        let page = match tokio::time::timeout(
            timing.list_page_timeout,
            source.list(continue_token.take()),
        )
        .await
        {
            Ok(Ok(page)) => page,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "{what} list failed; retrying with backoff");
                return None;
            }
            Err(_) => {
                tracing::warn!(timeout = ?timing.list_page_timeout, "{what} list got no answer; retrying");
                return None;
            }
        };
        let rv = page.metadata.resource_version.filter(|v| !v.is_empty());
        continue_token = page.metadata.continue_.filter(|c| !c.is_empty());
        for o in page.items {
            index.apply(IndexEvent::InitApply(lean(o)));
        }
        if continue_token.is_some() {
            continue;
        }
        let Some(rv) = rv else {
            tracing::warn!("{what} list carried no resource version; retrying");
            return None;
        };
        index.apply(IndexEvent::InitDone);
        index.health().mark_fresh();
        tracing::info!(objects = index.len(), "{what} index synced");
        return Some(rv);
    }
}

/// Watches from `rv` until a relist is needed.
async fn follow<Src, S>(
    source: &Src,
    index: &Shared<S>,
    what: &'static str,
    lean: &impl Fn(Src::Object) -> S::Item,
    timing: &Timing,
    mut rv: String,
    backoff: &mut Backoff,
) where
    Src: Source,
    S: Indexed,
{
    let health = index.health();
    loop {
        let started = tokio::time::timeout(
            timing.silent_after,
            source.watch(&rv, timing.timeout_secs()),
        )
        .await;
        let mut stream = match started {
            Ok(Ok(s)) => s,
            Ok(Err(e)) if gone(&e) => {
                tracing::info!("{what} watch: resource version {rv} expired; relisting");
                return;
            }
            Ok(Err(e)) => {
                health.mark_disconnected();
                tracing::warn!(error = %e, "{what} watch failed to start; retrying with backoff");
                backoff.pause().await;
                continue;
            }
            Err(_) => {
                health.mark_disconnected();
                tracing::warn!(after = ?timing.silent_after, "{what} watch request got no answer; retrying");
                continue;
            }
        };
        // The API server took a watch from `rv`: it is up and streams every
        // change after it.
        health.mark_fresh();
        backoff.reset();
        let opened = tokio::time::Instant::now();
        let mut brought = false;
        loop {
            let next = tokio::time::timeout(timing.silent_after, stream.next()).await;
            let (event, version) = match next {
                Ok(Some(Ok(WatchEvent::Added(o) | WatchEvent::Modified(o)))) => {
                    let v = o.meta().resource_version.clone();
                    (Some(IndexEvent::Apply(lean(o))), v)
                }
                Ok(Some(Ok(WatchEvent::Deleted(o)))) => {
                    let v = o.meta().resource_version.clone();
                    (Some(IndexEvent::Delete(lean(o))), v)
                }
                Ok(Some(Ok(WatchEvent::Bookmark(b)))) => (None, Some(b.metadata.resource_version)),
                Ok(Some(Ok(WatchEvent::Error(e)))) if e.code == 410 => {
                    tracing::info!("{what} watch: resource version {rv} expired; relisting");
                    return;
                }
                Ok(Some(Ok(WatchEvent::Error(e)))) => {
                    tracing::warn!(code = e.code, message = %e.message, "{what} watch error; watching again");
                    break;
                }
                Ok(Some(Err(e))) => {
                    tracing::debug!(error = %e, "{what} watch stream ended with an error; watching again");
                    break;
                }
                // The API server ended the watch at its timeout.
                Ok(None) => break,
                Err(_) => {
                    health.mark_disconnected();
                    tracing::warn!(after = ?timing.silent_after, "{what} watch silent; starting it again");
                    break;
                }
            };
            match version.filter(|v| !v.is_empty()) {
                Some(v) => rv = v,
                // Kubernetes always sets it; without it no watch can resume.
                None if event.is_some() => {
                    tracing::warn!("{what} watch event without resource version; relisting");
                    return;
                }
                None => {}
            }
            if let Some(e) = event {
                index.apply(e);
            }
            health.mark_fresh();
            brought = true;
        }
        if !brought && opened.elapsed() < timing.watch_timeout / 2 {
            // A watch that ends early without bringing anything is not
            // retried hot.
            backoff.pause().await;
        }
    }
}

#[cfg(test)]
mod tests;
