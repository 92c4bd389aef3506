//! The rotation's decision: which phase, which key signs, which roots are
//! trusted, and what the next step waits for. A pure function over plain
//! data; the controller feeds it and carries out the result.
//!
//! Phases of one rotation from generation *old* (signing when it began) to
//! *new* (staged by the operator):
//! - `Trust`: old + new roots published everywhere trust travels; old signs.
//!   Waits until every leaf issued before trust was published has expired
//!   (those holders may lack the new roots).
//! - `Switched`: new signs; old + new roots still published. Waits until
//!   every leaf signed by old has expired.
//! - `Retired`: new signs; only new roots published. Waits for the operator
//!   to promote new into the CA directory, which ends the rotation.
//!
//! When the roots do not change (new intermediate, same root) nothing new
//! has to reach clients and nothing is dropped, so both gates are open.

use serde::{Deserialize, Serialize};

/// Where the rotation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    #[default]
    Idle,
    Trust,
    Switched,
    Retired,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Trust => "trust",
            Self::Switched => "switched",
            Self::Retired => "retired",
        }
    }
    /// The metric value: 0 idle .. 3 retired.
    pub fn number(self) -> i64 {
        self as i64
    }
}

/// Why [`settle`] can block a rotation (`Decision::blocked`).
pub const BLOCKED_REASONS: [&str; 3] = [
    "rotation_old_material_missing",
    "rotation_new_material_missing",
    "rotation_third_generation_staged",
];

/// A step an operator may force before its gate opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    /// Trust -> Switched.
    Switch,
    /// Switched -> Retired.
    Retire,
}

/// One loaded generation of CA material, as the decision needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    /// Signing certificate key id.
    pub key_id: String,
    /// SHA-256 (hex) of each root certificate's DER.
    pub roots: Vec<String>,
}

/// What persists across restarts (the state file).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Progress {
    pub phase: Phase,
    pub old_key_id: Option<String>,
    pub new_key_id: Option<String>,
    /// Root fingerprints of old and new, fixed when the rotation began.
    #[serde(default)]
    pub old_roots: Vec<String>,
    #[serde(default)]
    pub new_roots: Vec<String>,
    pub trust_started_at: Option<i64>,
    /// Latest not_after of any leaf issued before trust was published.
    pub pre_trust_max_not_after: Option<i64>,
    pub switched_at: Option<i64>,
    /// Latest not_after of any leaf signed by old.
    pub old_max_not_after: Option<i64>,
    pub retired_at: Option<i64>,
}

/// Which generation's key signs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signer {
    Old,
    New,
}

/// Which roots are published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trust {
    Old,
    OldAndNew,
    New,
}

/// Inputs of one decision.
#[derive(Debug, Clone)]
pub struct Inputs<'a> {
    /// Unix seconds.
    pub now: i64,
    /// Material in the CA directory.
    pub current: &'a Generation,
    /// Material in the staging directory, if any.
    pub next: Option<&'a Generation>,
    /// Latest not_after of any leaf issued so far (durable mark), or, when
    /// the mark is unknown (state lost), a bound: now + the longest TTL.
    pub issued_max_not_after: i64,
    /// A step the operator forces.
    pub force: Option<Step>,
}

/// What the phase waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wait {
    pub what: &'static str,
    /// When it will be done (unix seconds), if it is a matter of time.
    pub until: Option<i64>,
}

/// A change of phase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub from: Phase,
    pub to: Phase,
    /// Forced by the operator before its gate opened.
    pub forced: bool,
}

/// The result of one decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub progress: Progress,
    pub signer: Signer,
    pub trust: Trust,
    pub waiting: Option<Wait>,
    pub transition: Option<Transition>,
    /// The material on disk cannot carry this phase out (reason code); the
    /// controller keeps serving what it served.
    pub blocked: Option<&'static str>,
    /// The forced step did not apply to this phase.
    pub force_ignored: bool,
}

fn subset(a: &[String], b: &[String]) -> bool {
    a.iter().all(|x| b.contains(x))
}

/// Decides at most one transition; call again until `transition` is `None`.
pub fn decide(p: &Progress, i: &Inputs<'_>) -> Decision {
    let mut out = Decision {
        progress: p.clone(),
        signer: Signer::Old,
        trust: Trust::Old,
        waiting: None,
        transition: None,
        blocked: None,
        force_ignored: false,
    };
    let old = p.old_key_id.as_deref();
    let new = p.new_key_id.as_deref();
    let (cur, next) = (
        Some(i.current.key_id.as_str()),
        i.next.map(|g| g.key_id.as_str()),
    );
    let go = |out: &mut Decision, to: Phase, forced: bool| {
        out.transition = Some(Transition {
            from: p.phase,
            to,
            forced,
        });
        out.progress.phase = to;
    };
    match p.phase {
        Phase::Idle => {
            out.force_ignored = i.force.is_some();
            if let Some(n) = i.next.filter(|n| n.key_id != i.current.key_id) {
                out.progress = Progress {
                    phase: Phase::Trust,
                    old_key_id: cur.map(str::to_string),
                    new_key_id: Some(n.key_id.clone()),
                    old_roots: i.current.roots.clone(),
                    new_roots: n.roots.clone(),
                    trust_started_at: Some(i.now),
                    pre_trust_max_not_after: Some(i.issued_max_not_after),
                    ..Default::default()
                };
                go(&mut out, Phase::Trust, false);
                out.trust = Trust::OldAndNew;
            }
        }
        Phase::Trust => {
            out.trust = Trust::OldAndNew;
            if cur != old {
                out.blocked = Some("rotation_old_material_missing");
                return out;
            }
            if next.is_some_and(|k| Some(k) != new) {
                out.blocked = Some("rotation_third_generation_staged");
                return out;
            }
            if next.is_none() {
                out.blocked = Some("rotation_new_material_missing");
                return out;
            }
            let until = p.pre_trust_max_not_after.unwrap_or(i64::MAX);
            // Same roots: nothing new had to reach anyone.
            let open = subset(&p.new_roots, &p.old_roots) || i.now >= until;
            let forced = i.force == Some(Step::Switch);
            out.force_ignored = i.force.is_some() && !forced;
            if open || forced {
                out.progress.switched_at = Some(i.now);
                out.progress.old_max_not_after = Some(i.issued_max_not_after);
                go(&mut out, Phase::Switched, forced && !open);
                out.signer = Signer::New;
            } else {
                out.waiting = Some(Wait {
                    what: "leaves issued before trust was published to expire",
                    until: Some(until),
                });
            }
        }
        Phase::Switched | Phase::Retired => {
            out.signer = Signer::New;
            out.trust = if p.phase == Phase::Switched {
                Trust::OldAndNew
            } else {
                Trust::New
            };
            if cur != new && next != new {
                out.blocked = Some("rotation_new_material_missing");
                return out;
            }
            if next.is_some_and(|k| Some(k) != new) && cur != new {
                out.blocked = Some("rotation_third_generation_staged");
                return out;
            }
            if p.phase == Phase::Retired {
                out.force_ignored = i.force.is_some();
                if cur == new && next.is_none_or(|k| Some(k) == new) {
                    // Promoted: the rotation is over.
                    out.progress = Progress::default();
                    go(&mut out, Phase::Idle, false);
                    out.signer = Signer::Old;
                    out.trust = Trust::Old;
                } else {
                    out.waiting = Some(Wait {
                        what: "the operator to promote the new material into the CA directory",
                        until: None,
                    });
                }
                return out;
            }
            let until = p.old_max_not_after.unwrap_or(i64::MAX);
            let open = subset(&p.old_roots, &p.new_roots) || i.now >= until;
            let forced = i.force == Some(Step::Retire);
            out.force_ignored = i.force.is_some() && !forced;
            if open || forced {
                out.progress.retired_at = Some(i.now);
                go(&mut out, Phase::Retired, forced && !open);
                out.trust = Trust::New;
            } else {
                out.waiting = Some(Wait {
                    what: "leaves signed by the old CA to expire",
                    until: Some(until),
                });
            }
        }
    }
    out
}

/// Runs [`decide`] until no transition is left (at most one per phase).
/// The force applies to the first step it fits.
pub fn settle(p: &Progress, i: &Inputs<'_>) -> (Decision, Vec<Transition>) {
    let mut progress = p.clone();
    let mut transitions = Vec::new();
    let mut force = i.force;
    loop {
        let mut d = decide(&progress, &Inputs { force, ..i.clone() });
        match d.transition.take() {
            Some(t) if transitions.len() < 4 => {
                let named = match force {
                    Some(Step::Switch) => t.to == Phase::Switched,
                    Some(Step::Retire) => t.to == Phase::Retired,
                    None => false,
                };
                if named {
                    force = None;
                }
                transitions.push(t);
                progress = d.progress;
            }
            _ => {
                // A force no step of this settle used is reported, not kept.
                d.force_ignored = force.is_some();
                return (d, transitions);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(key: &str, roots: &[&str]) -> Generation {
        Generation {
            key_id: key.into(),
            roots: roots.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn progress(phase: Phase, same_root: bool) -> Progress {
        Progress {
            phase,
            old_key_id: Some("k1".into()),
            new_key_id: Some("k2".into()),
            old_roots: vec!["r1".into()],
            new_roots: vec![if same_root { "r1" } else { "r2" }.into()],
            trust_started_at: Some(100),
            pre_trust_max_not_after: Some(500),
            switched_at: (phase >= Phase::Switched).then_some(600),
            old_max_not_after: (phase >= Phase::Switched).then_some(1000),
            retired_at: (phase == Phase::Retired).then_some(1100),
        }
    }

    struct Row {
        name: &'static str,
        phase: Phase,
        same_root: bool,
        now: i64,
        current: &'static str,
        next: Option<&'static str>,
        force: Option<Step>,
        // expected
        to: Option<(Phase, bool)>,
        signer: Signer,
        trust: Trust,
        waiting_until: Option<Option<i64>>,
        blocked: Option<&'static str>,
    }

    #[test]
    fn phase_table() {
        let rows = [
            Row {
                name: "idle, nothing staged",
                phase: Phase::Idle,
                same_root: false,
                now: 50,
                current: "k1",
                next: None,
                force: None,
                to: None,
                signer: Signer::Old,
                trust: Trust::Old,
                waiting_until: None,
                blocked: None,
            },
            Row {
                name: "idle, staged copy of current",
                phase: Phase::Idle,
                same_root: false,
                now: 50,
                current: "k1",
                next: Some("k1"),
                force: None,
                to: None,
                signer: Signer::Old,
                trust: Trust::Old,
                waiting_until: None,
                blocked: None,
            },
            Row {
                name: "idle, new staged: trust begins",
                phase: Phase::Idle,
                same_root: false,
                now: 50,
                current: "k1",
                next: Some("k2"),
                force: None,
                to: Some((Phase::Trust, false)),
                signer: Signer::Old,
                trust: Trust::OldAndNew,
                waiting_until: None,
                blocked: None,
            },
            Row {
                name: "trust, pre-trust leaves still valid",
                phase: Phase::Trust,
                same_root: false,
                now: 499,
                current: "k1",
                next: Some("k2"),
                force: None,
                to: None,
                signer: Signer::Old,
                trust: Trust::OldAndNew,
                waiting_until: Some(Some(500)),
                blocked: None,
            },
            Row {
                name: "trust, last pre-trust leaf expired",
                phase: Phase::Trust,
                same_root: false,
                now: 500,
                current: "k1",
                next: Some("k2"),
                force: None,
                to: Some((Phase::Switched, false)),
                signer: Signer::New,
                trust: Trust::OldAndNew,
                waiting_until: None,
                blocked: None,
            },
            Row {
                name: "trust, same root: no wait",
                phase: Phase::Trust,
                same_root: true,
                now: 101,
                current: "k1",
                next: Some("k2"),
                force: None,
                to: Some((Phase::Switched, false)),
                signer: Signer::New,
                trust: Trust::OldAndNew,
                waiting_until: None,
                blocked: None,
            },
            Row {
                name: "trust, forced switch",
                phase: Phase::Trust,
                same_root: false,
                now: 200,
                current: "k1",
                next: Some("k2"),
                force: Some(Step::Switch),
                to: Some((Phase::Switched, true)),
                signer: Signer::New,
                trust: Trust::OldAndNew,
                waiting_until: None,
                blocked: None,
            },
            Row {
                name: "trust, retire forced too early is ignored",
                phase: Phase::Trust,
                same_root: false,
                now: 200,
                current: "k1",
                next: Some("k2"),
                force: Some(Step::Retire),
                to: None,
                signer: Signer::Old,
                trust: Trust::OldAndNew,
                waiting_until: Some(Some(500)),
                blocked: None,
            },
            Row {
                name: "trust, staged material removed",
                phase: Phase::Trust,
                same_root: false,
                now: 600,
                current: "k1",
                next: None,
                force: None,
                to: None,
                signer: Signer::Old,
                trust: Trust::OldAndNew,
                waiting_until: None,
                blocked: Some("rotation_new_material_missing"),
            },
            Row {
                name: "trust, promoted too early",
                phase: Phase::Trust,
                same_root: false,
                now: 200,
                current: "k2",
                next: None,
                force: None,
                to: None,
                signer: Signer::Old,
                trust: Trust::OldAndNew,
                waiting_until: None,
                blocked: Some("rotation_old_material_missing"),
            },
            Row {
                name: "trust, third generation staged",
                phase: Phase::Trust,
                same_root: false,
                now: 600,
                current: "k1",
                next: Some("k3"),
                force: None,
                to: None,
                signer: Signer::Old,
                trust: Trust::OldAndNew,
                waiting_until: None,
                blocked: Some("rotation_third_generation_staged"),
            },
            Row {
                name: "switched, old leaves still valid",
                phase: Phase::Switched,
                same_root: false,
                now: 999,
                current: "k1",
                next: Some("k2"),
                force: None,
                to: None,
                signer: Signer::New,
                trust: Trust::OldAndNew,
                waiting_until: Some(Some(1000)),
                blocked: None,
            },
            Row {
                name: "switched, promoted early keeps old trust",
                phase: Phase::Switched,
                same_root: false,
                now: 999,
                current: "k2",
                next: None,
                force: None,
                to: None,
                signer: Signer::New,
                trust: Trust::OldAndNew,
                waiting_until: Some(Some(1000)),
                blocked: None,
            },
            Row {
                name: "switched, last old leaf expired",
                phase: Phase::Switched,
                same_root: false,
                now: 1000,
                current: "k1",
                next: Some("k2"),
                force: None,
                to: Some((Phase::Retired, false)),
                signer: Signer::New,
                trust: Trust::New,
                waiting_until: None,
                blocked: None,
            },
            Row {
                name: "switched, same root: nothing to drop",
                phase: Phase::Switched,
                same_root: true,
                now: 601,
                current: "k1",
                next: Some("k2"),
                force: None,
                to: Some((Phase::Retired, false)),
                signer: Signer::New,
                trust: Trust::New,
                waiting_until: None,
                blocked: None,
            },
            Row {
                name: "switched, forced retire",
                phase: Phase::Switched,
                same_root: false,
                now: 700,
                current: "k1",
                next: Some("k2"),
                force: Some(Step::Retire),
                to: Some((Phase::Retired, true)),
                signer: Signer::New,
                trust: Trust::New,
                waiting_until: None,
                blocked: None,
            },
            Row {
                name: "switched, new material gone",
                phase: Phase::Switched,
                same_root: false,
                now: 700,
                current: "k1",
                next: None,
                force: None,
                to: None,
                signer: Signer::New,
                trust: Trust::OldAndNew,
                waiting_until: None,
                blocked: Some("rotation_new_material_missing"),
            },
            Row {
                name: "retired, waiting for promotion",
                phase: Phase::Retired,
                same_root: false,
                now: 1200,
                current: "k1",
                next: Some("k2"),
                force: None,
                to: None,
                signer: Signer::New,
                trust: Trust::New,
                waiting_until: Some(None),
                blocked: None,
            },
            Row {
                name: "retired, promoted: done",
                phase: Phase::Retired,
                same_root: false,
                now: 1200,
                current: "k2",
                next: None,
                force: None,
                to: Some((Phase::Idle, false)),
                signer: Signer::Old,
                trust: Trust::Old,
                waiting_until: None,
                blocked: None,
            },
            Row {
                name: "retired, promoted, copy still staged: done",
                phase: Phase::Retired,
                same_root: false,
                now: 1200,
                current: "k2",
                next: Some("k2"),
                force: None,
                to: Some((Phase::Idle, false)),
                signer: Signer::Old,
                trust: Trust::Old,
                waiting_until: None,
                blocked: None,
            },
        ];
        for r in rows {
            let current = g(r.current, &["r1"]);
            let next = r
                .next
                .map(|k| g(k, &[if r.same_root { "r1" } else { "r2" }]));
            let p = if r.phase == Phase::Idle {
                Progress::default()
            } else {
                progress(r.phase, r.same_root)
            };
            let d = decide(
                &p,
                &Inputs {
                    now: r.now,
                    current: &current,
                    next: next.as_ref(),
                    issued_max_not_after: 777,
                    force: r.force,
                },
            );
            assert_eq!(
                d.transition.as_ref().map(|t| (t.to, t.forced)),
                r.to,
                "{}",
                r.name
            );
            assert_eq!(d.signer, r.signer, "{}", r.name);
            assert_eq!(d.trust, r.trust, "{}", r.name);
            assert_eq!(
                d.waiting.as_ref().map(|w| w.until),
                r.waiting_until,
                "{}",
                r.name
            );
            assert_eq!(d.blocked, r.blocked, "{}", r.name);
        }
    }

    /// The audit log tells an operator's override from a gate that opened:
    /// a force that arrives once nothing is left to wait for is not one.
    #[test]
    fn a_force_on_an_open_gate_is_not_recorded_as_forced() {
        let cases = [
            (Phase::Trust, Step::Switch, 500, Phase::Switched),
            (Phase::Switched, Step::Retire, 1000, Phase::Retired),
        ];
        for (phase, step, opens_at, to) in cases {
            let (k1, k2) = (g("k1", &["r1"]), g("k2", &["r2"]));
            for (now, forced) in [(opens_at - 1, true), (opens_at, false)] {
                let i = Inputs {
                    now,
                    current: &k1,
                    next: Some(&k2),
                    issued_max_not_after: 777,
                    force: Some(step),
                };
                let t = decide(&progress(phase, false), &i).transition;
                assert_eq!(
                    t.map(|t| (t.to, t.forced)),
                    Some((to, forced)),
                    "{phase:?} at {now}"
                );
            }
        }
    }

    #[test]
    fn gates_are_fixed_from_the_issuance_mark_at_each_step() {
        let (k1, k2) = (g("k1", &["r1"]), g("k2", &["r2"]));
        let i = |now, mark| Inputs {
            now,
            current: &k1,
            next: Some(&k2),
            issued_max_not_after: mark,
            force: None,
        };
        let d = decide(&Progress::default(), &i(100, 400));
        assert_eq!(d.progress.pre_trust_max_not_after, Some(400));
        assert_eq!(d.progress.trust_started_at, Some(100));
        // Leaves issued during trust move the mark, not the switch gate.
        let d2 = decide(&d.progress, &i(399, 900));
        assert!(d2.transition.is_none());
        let d3 = decide(&d.progress, &i(400, 900));
        assert_eq!(d3.progress.phase, Phase::Switched);
        // Old's last leaf is what was issued up to the switch.
        assert_eq!(d3.progress.old_max_not_after, Some(900));
    }

    #[test]
    fn settle_runs_a_same_root_rotation_through_to_retired() {
        let (k1, k2) = (g("k1", &["r1"]), g("k2", &["r1"]));
        let (d, t) = settle(
            &Progress::default(),
            &Inputs {
                now: 10,
                current: &k1,
                next: Some(&k2),
                issued_max_not_after: 9999,
                force: None,
            },
        );
        assert_eq!(
            t.iter().map(|t| t.to).collect::<Vec<_>>(),
            vec![Phase::Trust, Phase::Switched, Phase::Retired]
        );
        assert_eq!(d.signer, Signer::New);
        assert_eq!(d.waiting.unwrap().until, None);
    }

    #[test]
    fn a_force_is_used_once() {
        let (k1, k2) = (g("k1", &["r1"]), g("k2", &["r2"]));
        let p = progress(Phase::Trust, false);
        let (d, t) = settle(
            &p,
            &Inputs {
                now: 200,
                current: &k1,
                next: Some(&k2),
                issued_max_not_after: 5000,
                force: Some(Step::Switch),
            },
        );
        assert_eq!(t.len(), 1);
        assert!(t[0].forced);
        assert_eq!(d.progress.phase, Phase::Switched);
        assert!(!d.force_ignored);
        let (d, t) = settle(
            &p,
            &Inputs {
                now: 200,
                current: &k1,
                next: Some(&k2),
                issued_max_not_after: 5000,
                force: Some(Step::Retire),
            },
        );
        assert!(t.is_empty());
        assert!(d.force_ignored);
    }
}
