//! Table tests of the index's update function and lookups.

use super::*;
use test_case::test_case;
use IndexEvent::*;

fn a() -> LeanPod {
    pod(
        "ns-a",
        "pod-a",
        "uid-a",
        Some("node-1"),
        "sa-a",
        Phase::Running,
    )
}
fn b() -> LeanPod {
    pod(
        "ns-a",
        "pod-b",
        "uid-b",
        Some("node-2"),
        "sa-a",
        Phase::Running,
    )
}

/// `has_live_pod` follows every way a pod enters or leaves the live set.
#[test]
fn live_pod_count_follows_phase_moves_and_deletes() {
    let uuid = |n: u8| format!("{n:08x}-0000-4000-8000-000000000000");
    let p = |name: &str, uid: String, node: Option<&str>, phase: Phase| {
        pod("ns-a", name, &uid, node, "sa-a", phase)
    };
    let mut s = IndexState::default();
    let live = |s: &IndexState| s.has_live_pod("ns-a", "sa-a", 0);
    assert!(!live(&s));
    s.apply(Apply(p("x", uuid(1), None, Phase::Pending)));
    assert!(live(&s), "an unscheduled pending pod is live");
    s.apply(Apply(p("y", uuid(2), Some("n"), Phase::Running)));
    // Fast path (same node/sa/ips): phase only.
    s.apply(Apply(p("y", uuid(2), Some("n"), Phase::Succeeded)));
    s.apply(Delete(p("x", uuid(1), None, Phase::Pending)));
    assert!(!live(&s), "only a succeeded pod is left");
    // Back to running via the fast path, then a node move (slow path).
    s.apply(Apply(p("y", uuid(2), Some("n"), Phase::Running)));
    assert!(live(&s));
    s.apply(Apply(p("y", uuid(2), Some("m"), Phase::Running)));
    assert!(live(&s));
    // A non-UUID uid goes through the side table.
    s.apply(Apply(p("z", "odd-uid".into(), Some("m"), Phase::Running)));
    s.apply(Apply(p("y", uuid(2), Some("m"), Phase::Failed)));
    assert!(live(&s), "z still runs");
    s.apply(Delete(p("z", "odd-uid".into(), Some("m"), Phase::Running)));
    assert!(!live(&s));
    assert!(!s.has_live_pod("ns-a", "other", 0));
    // A relist rebuilds the count from scratch.
    s.apply(Init);
    s.apply(InitApply(p("w", uuid(3), Some("n"), Phase::Running)));
    s.apply(InitDone);
    assert!(live(&s));
}

/// A deleting pod vouches for its service account and node until its
/// `deletionTimestamp` is more than the leeway in the past (the API
/// server's rule for bound tokens), whichever path the update took.
#[test]
fn deleting_pods_stop_counting_after_the_leeway() {
    let uuid = |n: u8| format!("{n:08x}-0000-4000-8000-000000000000");
    let deleting = |name: &str, uid: String, at: Option<i64>| LeanPod {
        deletion_timestamp: at,
        ..pod("ns-a", name, &uid, Some("n"), "sa-a", Phase::Running)
    };
    const T: i64 = 1_000_000;
    let on_n = |s: &IndexState, now: i64| {
        s.on_node("n", "ns-a", "sa-a", now)
            .map(|p| p.name.to_string())
            .collect::<Vec<_>>()
    };
    // (name, event, now, on node n, has live pod)
    let mut s = IndexState::default();
    s.apply(Apply(deleting("x", uuid(1), None)));
    assert_eq!(
        (on_n(&s, T), s.has_live_pod("ns-a", "sa-a", T)),
        (vec!["x".to_string()], true)
    );
    // Fast path: only the deletion timestamp changes.
    s.apply(Apply(deleting("x", uuid(1), Some(T))));
    assert_eq!(s.get("ns-a", "x").unwrap().deletion_timestamp, Some(T));
    let cases = [
        (T, true),
        (T + DELETION_LEEWAY_SECS, true),
        (T + DELETION_LEEWAY_SECS + 1, false),
    ];
    for (now, counts) in cases {
        assert_eq!(on_n(&s, now).len() == 1, counts, "on_node at {now}");
        assert_eq!(s.has_live_pod("ns-a", "sa-a", now), counts, "live at {now}");
        assert_eq!(s.get("ns-a", "x").unwrap().deleted_by(now), !counts);
    }
    // A second, healthy pod keeps the service account live.
    s.apply(Apply(deleting("y", uuid(2), None)));
    assert!(s.has_live_pod("ns-a", "sa-a", T + 1000));
    assert_eq!(on_n(&s, T + 1000), vec!["y".to_string()]);
    // Slow path (a node move) keeps the timestamp; a relist keeps it too.
    s.apply(Apply(LeanPod {
        node: Some(Arc::from("m")),
        ..deleting("x", uuid(1), Some(T))
    }));
    assert_eq!(s.get("ns-a", "x").unwrap().deletion_timestamp, Some(T));
    s.apply(Init);
    s.apply(InitApply(deleting("x", uuid(1), Some(T))));
    s.apply(InitDone);
    assert!(!s.has_live_pod("ns-a", "sa-a", T + 1000));
    assert!(s.has_live_pod("ns-a", "sa-a", T));
    // Deleting the object drops its side entry; a new pod in its slot starts clean.
    s.apply(Delete(deleting("x", uuid(1), Some(T))));
    s.apply(Apply(deleting("z", uuid(3), None)));
    assert_eq!(s.get("ns-a", "z").unwrap().deletion_timestamp, None);
    assert!(s.deleting.is_empty());
}

fn names_on(s: &IndexState, node: &str) -> Vec<String> {
    let mut v: Vec<String> = s
        .on_node(node, "ns-a", "sa-a", 0)
        .map(|p| p.name.to_string())
        .collect();
    v.sort();
    v
}

#[tokio::test]
async fn wait_synced_wakes_on_the_first_list_and_gives_up_at_its_bound() {
    let idx = std::sync::Arc::new(PodIndex::new());
    assert!(!idx.wait_synced(std::time::Duration::from_millis(20)).await);
    let feeder = {
        let idx = idx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            idx.apply(IndexEvent::Init);
            idx.apply(IndexEvent::InitDone);
        })
    };
    let t = std::time::Instant::now();
    assert!(idx.wait_synced(std::time::Duration::from_secs(30)).await);
    assert!(
        t.elapsed() < std::time::Duration::from_secs(20),
        "woken, not timed out"
    );
    feeder.await.unwrap();
    assert!(idx.wait_synced(std::time::Duration::ZERO).await);
}

#[test_case(vec![Init, InitApply(a()), InitDone], true, 1, &["pod-a"] ; "initial list")]
#[test_case(vec![Init, InitApply(a())], false, 0, &[] ; "not synced before InitDone")]
#[test_case(vec![Init, InitDone, Apply(a())], true, 1, &["pod-a"] ; "apply after sync")]
#[test_case(vec![Init, InitApply(a()), InitDone, Delete(a())], true, 0, &[] ; "delete")]
#[test_case(vec![Init, InitApply(a()), InitDone, Init, InitApply(b()), InitDone], true, 1, &[] ; "relist drops vanished pod")]
#[test_case(vec![Init, InitApply(a()), InitDone, Init, InitApply(a())], true, 1, &["pod-a"] ; "old contents kept during relist")]
#[test_case(vec![Init, InitApply(a()), InitDone, Apply(pod("ns-a", "pod-a", "uid-a", Some("node-2"), "sa-a", Phase::Running))], true, 1, &[] ; "moved node reindexed")]
#[test_case(vec![Init, InitApply(a()), InitDone, Apply(pod("ns-a", "pod-a", "uid-a", Some("node-1"), "sa-a", Phase::Failed))], true, 0, &[] ; "failed pod leaves")]
#[test_case(vec![Init, InitApply(a()), InitDone, Apply(pod("ns-a", "pod-a", "uid-a", Some("node-1"), "sa-a", Phase::Succeeded))], true, 1, &[] ; "succeeded pod kept but does not authorize")]
#[test_case(vec![Init, InitApply(pod("ns-a", "pod-a", "uid-a", None, "sa-a", Phase::Pending)), InitDone], true, 1, &[] ; "unscheduled pod not on node")]
#[test_case(vec![Init, InitApply(a()), InitDone, Delete(pod("ns-a", "pod-x", "u", Some("node-1"), "sa-a", Phase::Running))], true, 1, &["pod-a"] ; "delete of unknown pod is harmless")]
#[test_case(vec![Init, InitApply(a()), InitDone, Apply(pod("ns-a", "pod-a", "uid-new", Some("node-1"), "sa-a", Phase::Running))], true, 1, &["pod-a"] ; "recreated pod replaces uid")]
fn apply_sequences(events: Vec<IndexEvent>, synced: bool, len: usize, on_node_1: &[&str]) {
    let mut s = IndexState::default();
    let shared = PodIndex::new();
    for e in events {
        shared.apply(e.clone());
        s.apply(e);
    }
    assert_eq!(s.synced(), synced);
    assert_eq!(s.len(), len);
    assert_eq!(names_on(&s, "node-1"), on_node_1);
    // The shared index (which builds relists off-lock) agrees with the pure function.
    assert_eq!(shared.is_synced(), synced);
    assert_eq!(shared.len(), len as u64);
    assert_eq!(shared.read(|s| names_on(s, "node-1")), on_node_1);
}

#[test]
fn ip_index_follows_updates() {
    let mut s = IndexState::default();
    let mut p = a();
    p.pod_ips = vec!["10.0.0.5".parse().unwrap()];
    s.apply(Apply(p.clone()));
    assert_eq!(s.with_ip("10.0.0.5".parse().unwrap()).count(), 1);
    p.pod_ips = vec!["10.0.0.6".parse().unwrap()];
    s.apply(Apply(p.clone()));
    assert_eq!(s.with_ip("10.0.0.5".parse().unwrap()).count(), 0);
    s.apply(Delete(p));
    assert_eq!(s.with_ip("10.0.0.6".parse().unwrap()).count(), 0);
    assert!(s.by_ip4.is_empty() && s.by_node.is_empty() && s.ip_shared.is_empty());
}

#[test]
fn shared_ips_dual_stack_and_host_network() {
    let mut s = IndexState::default();
    let mut p = a();
    p.pod_ips = vec![
        "fd00::5".parse().unwrap(),
        "10.0.0.5".parse().unwrap(),
        "10.0.0.7".parse().unwrap(),
    ];
    let mut q = b();
    q.pod_ips = vec!["10.0.0.5".parse().unwrap()]; // host network: same address
    s.apply(Apply(p.clone()));
    s.apply(Apply(q.clone()));
    let names = |s: &IndexState, ip: &str| {
        let mut v: Vec<String> = s
            .with_ip(ip.parse().unwrap())
            .map(|p| p.name.to_string())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(&s, "10.0.0.5"), ["pod-a", "pod-b"]);
    assert_eq!(names(&s, "10.0.0.7"), ["pod-a"]);
    assert_eq!(names(&s, "fd00::5"), ["pod-a"]);
    let mut ips: Vec<IpAddr> = s.get("ns-a", "pod-a").unwrap().pod_ips().collect();
    ips.sort();
    let mut want = p.pod_ips.clone();
    want.sort();
    assert_eq!(ips, want);
    s.apply(Delete(p));
    assert_eq!(names(&s, "10.0.0.5"), ["pod-b"]);
    assert!(s.ip_shared.is_empty() && s.by_ip6.is_empty());
    s.apply(Delete(q));
    assert!(s.by_ip4.is_empty() && s.extra.is_empty());
}

#[test_case("8f14e45f-ceea-467a-9af0-5d0e5f6b0f2e" ; "canonical uuid")]
#[test_case("8F14E45F-CEEA-467A-9AF0-5D0E5F6B0F2E" ; "upper case kept verbatim")]
#[test_case("uid-a" ; "not a uuid")]
#[test_case("" ; "empty")]
fn uids_round_trip(uid: &str) {
    let mut s = IndexState::default();
    let mut p = a();
    p.uid = uid.into();
    s.apply(Apply(p.clone()));
    let got = s.get("ns-a", "pod-a").unwrap();
    assert_eq!(&*got.uid, uid);
    assert_eq!(got.to_lean(), p);
}

#[test]
fn strings_are_released_and_names_compacted() {
    let mut s = IndexState::default();
    let pods: Vec<LeanPod> = (0..3000)
        .map(|i| {
            pod(
                &format!("ns-{}", i % 7),
                &format!("pod-with-a-longish-name-{i}"),
                "8f14e45f-ceea-467a-9af0-5d0e5f6b0f2e",
                Some(&format!("node-{}", i % 11)),
                &format!("sa-{}", i % 13),
                Phase::Running,
            )
        })
        .collect();
    for p in &pods {
        s.apply(Apply(p.clone()));
    }
    for p in &pods[..2900] {
        s.apply(Delete(p.clone()));
    }
    assert_eq!(s.len(), 100);
    // 3000 names of ~29 bytes were written; compaction keeps garbage under 4 KiB here.
    assert!(
        s.names.len() < 100 * 30 + 4096,
        "arena compacted: {}",
        s.names.len()
    );
    for p in &pods[2900..] {
        assert_eq!(s.get(&p.namespace, &p.name).unwrap().to_lean(), *p);
        assert_eq!(
            s.on_node(
                p.node.as_deref().unwrap(),
                &p.namespace,
                &p.service_account,
                0
            )
            .filter(|q| q.name == &*p.name)
            .count(),
            1
        );
    }
    for p in &pods[2900..] {
        s.apply(Delete(p.clone()));
    }
    assert!(s.is_empty());
    assert!(s.strings.ids.is_empty(), "{:?}", s.strings.ids);
    assert!(s.by_name.is_empty() && s.by_node.is_empty());
}

thread_local! {
    /// Makes every name hash equal, to exercise the collision path.
    pub(super) static COLLIDE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[test]
fn long_names_and_hash_collisions_stay_correct() {
    COLLIDE.with(|c| c.set(true));
    let mut s = IndexState::default();
    let long = "x".repeat(300);
    let pods = [
        pod("ns-a", &long, "u", Some("node-1"), "sa-a", Phase::Running),
        pod(
            "ns-a",
            "pod-q",
            "u2",
            Some("node-1"),
            "sa-a",
            Phase::Running,
        ),
        pod(
            "ns-b",
            "pod-q",
            "u3",
            Some("node-2"),
            "sa-b",
            Phase::Running,
        ),
    ];
    for p in &pods {
        s.apply(Apply(p.clone()));
    }
    assert_eq!(s.name_collisions.len(), 2);
    for p in &pods {
        assert_eq!(s.get(&p.namespace, &p.name).unwrap().to_lean(), *p);
    }
    // Deleting the pod in the primary slot promotes a colliding one.
    s.apply(Delete(pods[0].clone()));
    assert!(s.get("ns-a", &long).is_none());
    for p in &pods[1..] {
        assert_eq!(s.get(&p.namespace, &p.name).unwrap().to_lean(), *p);
    }
    s.apply(Delete(pods[2].clone()));
    assert_eq!(s.get("ns-a", "pod-q").unwrap().to_lean(), pods[1]);
    assert!(s.get("ns-b", "pod-q").is_none());
    s.apply(Delete(pods[1].clone()));
    assert!(s.is_empty() && s.by_name.is_empty() && s.name_collisions.is_empty());
    COLLIDE.with(|c| c.set(false));
}

#[test]
fn shared_index_mirrors_readiness() {
    let idx = PodIndex::new();
    assert!(!idx.is_synced());
    idx.apply(Init);
    idx.apply(InitApply(a()));
    assert!(!idx.is_synced());
    idx.apply(InitDone);
    assert!(idx.is_synced());
    assert_eq!(idx.len(), 1);
    assert!(idx.read(|s| s.get("ns-a", "pod-a").is_some()));
}
