//! The loop over a scripted fake API server: evidence keeps a quiet index
//! fresh, silence makes it stale and restarts the watch, an expired
//! version relists.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::stream::BoxStream;
use futures::StreamExt;
use kube::api::{ObjectList, WatchEvent};
use serde_json::json;

use super::{run, Source, Timing};
use crate::podindex::watch::PodWire;
use crate::podindex::{LeanPod, PodIndex};
use crate::primitives::lock;

/// One step of a scripted watch stream.
enum Step {
    Event(Box<WatchEvent<PodWire>>),
    Sleep(Duration),
    /// Nothing more, and no end: an open, silent connection.
    Silent,
}

/// A scripted answer to one watch request.
enum Watch {
    Stream(Vec<Step>),
    Refuse(u16),
    /// The request is never answered.
    Hang,
}

#[derive(Default)]
struct Fake {
    lists: Mutex<VecDeque<ObjectList<PodWire>>>,
    watches: Mutex<VecDeque<Watch>>,
    /// The resource version of each watch request.
    asked: Mutex<Vec<String>>,
    list_calls: Mutex<usize>,
}

fn status(code: u16) -> kube::Error {
    kube::Error::Api(Box::new(
        serde_json::from_value(json!({"code": code, "message": "scripted"})).unwrap(),
    ))
}

impl Source for Arc<Fake> {
    type Object = PodWire;

    fn list(
        &self,
        _continue_token: Option<String>,
    ) -> futures::future::BoxFuture<'_, kube::Result<ObjectList<PodWire>>> {
        *lock(&self.list_calls) += 1;
        let next = lock(&self.lists).pop_front();
        Box::pin(async move {
            match next {
                Some(l) => Ok(l),
                None => futures::future::pending().await,
            }
        })
    }

    fn watch(
        &self,
        resource_version: &str,
        _timeout_secs: u32,
    ) -> futures::future::BoxFuture<
        '_,
        kube::Result<BoxStream<'static, kube::Result<WatchEvent<PodWire>>>>,
    > {
        lock(&self.asked).push(resource_version.to_string());
        let next = lock(&self.watches).pop_front().unwrap_or(Watch::Hang);
        Box::pin(async move {
            match next {
                Watch::Hang => futures::future::pending().await,
                Watch::Refuse(code) => Err(status(code)),
                Watch::Stream(steps) => Ok(scripted(steps)),
            }
        })
    }
}

fn scripted(steps: Vec<Step>) -> BoxStream<'static, kube::Result<WatchEvent<PodWire>>> {
    futures::stream::unfold(steps.into_iter(), |mut it| async move {
        loop {
            match it.next()? {
                Step::Event(e) => return Some((Ok(*e), it)),
                Step::Sleep(d) => tokio::time::sleep(d).await,
                Step::Silent => futures::future::pending::<()>().await,
            }
        }
    })
    .boxed()
}

fn pod(name: &str, rv: &str) -> serde_json::Value {
    json!({"metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                        "resourceVersion": rv},
           "spec": {"nodeName": "node-1", "serviceAccountName": "sa"}})
}

fn list(rv: &str, names: &[&str]) -> ObjectList<PodWire> {
    let items: Vec<_> = names.iter().map(|n| pod(n, rv)).collect();
    serde_json::from_value(json!({"metadata": {"resourceVersion": rv}, "items": items})).unwrap()
}

fn event(v: serde_json::Value) -> Step {
    Step::Event(Box::new(serde_json::from_value(v).unwrap()))
}

fn added(name: &str, rv: &str) -> Step {
    event(json!({"type": "ADDED", "object": pod(name, rv)}))
}

fn bookmark(rv: &str) -> Step {
    event(json!({"type": "BOOKMARK",
        "object": {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": rv}}}))
}

fn timing(silent_after: Duration) -> Timing {
    Timing {
        watch_timeout: silent_after / 2,
        silent_after,
        list_page_timeout: Duration::from_secs(5),
        backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(50),
    }
}

fn start(fake: &Arc<Fake>, t: Timing) -> (Arc<PodIndex>, tokio::task::JoinHandle<()>) {
    let index = Arc::new(PodIndex::new());
    let (f, i) = (fake.clone(), index.clone());
    let task = tokio::spawn(async move { run(f, &i, "pod", LeanPod::from, t).await });
    (index, task)
}

/// Polls `f` until it holds (or fails after `within`).
async fn until(what: &str, within: Duration, f: impl Fn() -> bool) {
    let deadline = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_silent_watch_goes_stale_and_is_started_again() {
    let fake = Arc::new(Fake::default());
    lock(&fake.lists).push_back(list("10", &["p1"]));
    lock(&fake.watches).extend([
        // A bookmark, then an open connection that says nothing.
        Watch::Stream(vec![bookmark("11"), Step::Silent]),
        // The next request is never answered (a stopped API server).
        Watch::Hang,
        // Then the API server is back.
        Watch::Stream(vec![added("p2", "12"), Step::Silent]),
    ]);
    let silent = Duration::from_millis(300);
    let (index, task) = start(&fake, timing(silent));
    until("synced", Duration::from_secs(5), || index.is_synced()).await;
    let synced = Instant::now();
    assert_eq!(index.disconnected_for(), None, "fresh after the list");
    until("stale", Duration::from_secs(5), || {
        index.disconnected_for().is_some()
    })
    .await;
    let noticed = synced.elapsed();
    assert!(
        noticed + Duration::from_millis(50) >= silent,
        "not before the bound: {noticed:?}"
    );
    // Started again from the bookmark's version, and again after the hang.
    until("back", Duration::from_secs(5), || {
        index.read(|s| s.get("ns", "p2").is_some())
    })
    .await;
    assert_eq!(index.disconnected_for(), None, "fresh again");
    assert_eq!(*lock(&fake.asked), ["10", "11", "11"]);
    assert_eq!(*lock(&fake.list_calls), 1, "no relist was needed");
    task.abort();
}

#[tokio::test]
async fn bookmarks_alone_keep_a_quiet_index_fresh() {
    let fake = Arc::new(Fake::default());
    lock(&fake.lists).push_back(list("10", &["p1"]));
    // Watches that end on their own, each with a bookmark and no change.
    for i in 0..6 {
        let rv = (11 + i).to_string();
        lock(&fake.watches).push_back(Watch::Stream(vec![
            Step::Sleep(Duration::from_millis(50)),
            bookmark(&rv),
            Step::Sleep(Duration::from_millis(50)),
        ]));
    }
    let silent = Duration::from_millis(400);
    let (index, task) = start(&fake, timing(silent));
    until("synced", Duration::from_secs(5), || index.is_synced()).await;
    // Every sample while the script runs (6 x 100 ms) is fresh.
    let mut samples = 0;
    while lock(&fake.asked).len() <= 6 {
        assert_eq!(index.disconnected_for(), None, "sample {samples}");
        samples += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(samples > 20, "{samples}");
    assert_eq!(lock(&fake.asked)[1..6], ["11", "12", "13", "14", "15"]);
    // Then the next watch hangs: stale after the bound, measured from the
    // last bookmark.
    until("stale", Duration::from_secs(5), || {
        index.disconnected_for().is_some()
    })
    .await;
    assert!(index.freshness_age().unwrap() > silent);
    task.abort();
}

#[tokio::test]
async fn an_expired_version_relists_and_a_refused_watch_is_a_disconnection() {
    let fake = Arc::new(Fake::default());
    lock(&fake.lists).extend([list("5", &["p1"]), list("9", &["p2"])]);
    lock(&fake.watches).extend([
        Watch::Stream(vec![event(
            json!({"type": "ERROR", "object": {"code": 410, "message": "too old"}}),
        )]),
        Watch::Refuse(500),
        Watch::Stream(vec![added("p3", "10"), Step::Silent]),
    ]);
    let (index, task) = start(&fake, timing(Duration::from_secs(5)));
    until("relisted and back", Duration::from_secs(5), || {
        index.read(|s| s.get("ns", "p3").is_some())
    })
    .await;
    index.read(|s| {
        assert!(s.get("ns", "p1").is_none(), "replaced by the relist");
        assert!(s.get("ns", "p2").is_some());
    });
    assert_eq!(*lock(&fake.list_calls), 2);
    assert_eq!(*lock(&fake.asked), ["5", "9", "9"]);
    assert_eq!(index.disconnected_for(), None);
    task.abort();
}

#[tokio::test]
async fn a_refused_watch_marks_the_index_disconnected_at_once() {
    let fake = Arc::new(Fake::default());
    lock(&fake.lists).push_back(list("5", &["p1"]));
    lock(&fake.watches).extend([Watch::Refuse(503), Watch::Hang]);
    let (index, task) = start(&fake, timing(Duration::from_secs(30)));
    until("disconnected", Duration::from_secs(5), || {
        index.disconnected_for().is_some()
    })
    .await;
    assert!(
        index.freshness_age().unwrap() < Duration::from_secs(30),
        "long before the silence bound"
    );
    task.abort();
}

#[test]
fn timing_follows_the_staleness_bound() {
    let s = Duration::from_secs;
    for (max, watch, silent) in [
        (0, 3, 6),
        (6, 3, 6),
        (10, 3, 6),
        (60, 20, 23),
        (300, 60, 63),
        (3600, 60, 63),
    ] {
        let t = Timing::for_max_staleness(s(max));
        assert_eq!(
            (t.watch_timeout, t.silent_after),
            (s(watch), s(silent)),
            "{max}"
        );
        assert!(
            max < 9 || t.silent_after <= s(max),
            "evidence comes within the bound: {max}"
        );
    }
}
