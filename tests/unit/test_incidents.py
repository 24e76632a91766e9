"""Tier 1 (pure): findings grouped into incidents by shared cause, the root first (issue 39, item 4)."""

from __future__ import annotations

from distdebug.analysis.incidents import group
from distdebug.findings import Finding, Severity


def f(detector, subject, step, ranks, severity="error", **evidence):
    return Finding(severity=Severity(severity), detector=detector, ranks=ranks, step=step, subject=subject,
                   message=f"{detector} {subject}", evidence=evidence, fix=f"fix {detector}")


def shape(incidents):
    return [[(m.detector, m.subject) for m in i.members] for i in incidents]


def test_configuration_then_statistics_then_replicas_is_one_incident_with_the_configuration_first():
    """The issue's example: sorted by severity these are three rows with the cause last."""
    findings = [f("bn_divergence", "body.1", 2, [0, 1]),
                f("replica_divergence", "body.1.running_mean", 4, [1]),
                f("config_lint", "broadcast_buffers", 1, [0, 1], "warning", modules=["body.1", "body.4"]),
                f("straggler", "compute", 9, [1], "warning")]
    incidents = group(findings)
    assert shape(incidents) == [
        [("config_lint", "broadcast_buffers"), ("bn_divergence", "body.1"),
         ("replica_divergence", "body.1.running_mean")],
        [("straggler", "compute")]]
    assert incidents[0].severity == Severity.ERROR and incidents[0].root.fix == "fix config_lint"


def test_a_nan_origin_and_what_followed_are_one_incident_and_an_unrelated_problem_is_not():
    findings = [f("loss_nonfinite", "loss", 7, [0, 1]),
                f("nan_origin", "(input of Sequential)", 7, [1], origin="this rank"),
                f("nan_origin", "gradients", 7, [0], "warning", origin="another rank"),
                f("loss_scale", "skipped step", 7, [0, 1], "info"),
                f("nan_origin", "non-finite steps", 7, [0, 1], "warning"),
                f("data_order", "input batches", 2, [0, 1], "warning"),
                f("replica_divergence", "head.weight", 30, [1])]
    incidents = group(findings)
    nan = next(i for i in incidents if i.root.detector == "nan_origin")
    assert nan.root.subject == "(input of Sequential)"  # the origin, before what it spread to
    assert {(m.detector, m.subject) for m in nan.members} == {
        ("nan_origin", "(input of Sequential)"), ("nan_origin", "gradients"), ("nan_origin", "non-finite steps"),
        ("loss_nonfinite", "loss"), ("loss_scale", "skipped step"), ("replica_divergence", "head.weight")}
    assert [i.root.detector for i in incidents if i is not nan] == ["data_order"]


def test_effects_before_their_cause_or_on_other_ranks_or_modules_are_not_linked():
    findings = [f("bn_divergence", "body.4", 2, [0, 1]),
                f("replica_divergence", "head.weight", 4, [1]),  # not a BatchNorm buffer of body.4
                f("loss_spike", "loss", 3, [0], "warning"),
                f("rerun", "re-execution of step 4", 4, [1], "warning"),  # the verdict on the replica at step 4
                f("loss_spike", "loss across ranks", 3, [0], "warning"),  # the same spike, seen across ranks
                f("loss_spike", "loss", 3, [1], "warning")]  # another rank's own spike at the same step
    incidents = group(findings)
    assert sorted(shape(incidents)) == sorted([
        [("bn_divergence", "body.4"), ("loss_spike", "loss"), ("loss_spike", "loss across ranks"),
         ("loss_spike", "loss")],
        [("replica_divergence", "head.weight"), ("rerun", "re-execution of step 4")]])
    # a replica divergence at step 4 cannot come from a bn_divergence that starts at step 6; the other way it
    # can (a skipped step leaves rank 0 with other weights, which then compute other statistics): its root
    later = group([f("bn_divergence", "body.1", 6, [0, 1]), f("replica_divergence", "optimizer step count", 4, [0])])
    assert shape(later) == [[("replica_divergence", "optimizer step count"), ("bn_divergence", "body.1")]]


def test_unrelated_notes_of_one_detector_stay_apart_and_nothing_is_lost():
    findings = [f("config_lint", "find_unused_parameters", 1, [0, 1], "info"),
                f("config_lint", "torch.save of engine state", 1, [0], "warning"),
                f("memory", "activations", 3, [0], "info")]
    incidents = group(findings)
    assert len(incidents) == 3
    assert sorted(id(m) for i in incidents for m in i.members) == sorted(id(x) for x in findings)
    assert incidents[0].severity == Severity.WARNING  # the most severe first


def test_a_spikes_aftershocks_are_its_incident_and_a_later_spike_is_not():
    """The loss_spike fault on the DDP recipe: the corrupted step 20 (loss and gradient norm, both ranks), then
    the loss still off at steps 22-24 while the weights recover (one rank, then the other, then one rank
    departing from the other): one incident. A spike 40 steps later is another."""
    findings = [f("loss_spike", "grad_norm", 20, [0, 1], "warning"), f("loss_spike", "loss", 20, [0, 1], "warning"),
                f("loss_spike", "loss", 22, [0], "warning"), f("loss_spike", "loss", 23, [1], "warning"),
                f("loss_spike", "loss across ranks", 24, [1], "warning"), f("loss_spike", "loss", 60, [0], "warning")]
    incidents = group(findings)
    assert [(i.root.step, len(i.members)) for i in incidents] == [(20, 5), (60, 1)]
    assert incidents[0].root.detector == "loss_spike" and incidents[0].root.subject in ("loss", "grad_norm")


def test_a_rank_that_died_of_memory_is_the_root_of_the_hang_it_left_and_its_advice_says_so():
    """One causal model (cards.kinds) for the incidents and the advice: the out-of-memory error on rank 1 is
    why the others waited in their collective, and the hang verdict names rank 1 (the rank that died, at its
    step); the hang is its consequence in both. Its clean twins: a hang with no rank that died, a stall with no
    step, a hang on another rank, and an error after the hang began, each stay their own root."""
    from distdebug.report.knowledge import advise_all

    oom = f("oom", "out of memory in forward", 7, [1], "critical", phase="forward")
    hang = f("hang", "rank 1", 7, [1], "critical")
    (incident,) = group([hang, oom])
    assert incident.root is oom and incident.consequences() == [hang]
    advice = advise_all([hang, oom])
    assert "probably a consequence of the out-of-memory error from step 7 (DD403 oom" in advice[0].cause
    assert advice[0].consequence_of == "DD403 oom at step 7"
    assert "consequence" not in advice[1].cause and "activations" in advice[1].cause
    alone = f("hang", "rank 1", 7, [1], "critical")
    assert group([alone])[0].root is alone and "consequence" not in advise_all([alone])[0].cause
    stall = f("hang", "busy stall", None, [1], "warning")
    elsewhere = f("hang", "collective #41", 7, [0], "critical")
    late = f("oom", "out of memory in step", 9, [1], "critical", phase="step")
    for other in (stall, elsewhere):
        assert len(group([other, oom])) == 2
    assert len(group([hang, late])) == 2
    # a rank's DDP error (it raised: find_unused_parameters) is the same kind as a death: the hang's root
    raised = f("config_lint", "find_unused_parameters", 7, [1], raised=True)
    (incident,) = group([hang, raised])
    assert incident.root is raised and incident.consequences() == [hang]


def test_notes_beside_a_hang_and_a_rerun_verdict_are_never_called_consequences():
    """The incidents group what happened beside a hang (a straggler note, distdebug's own trouble) and a
    re-execution's verdict with what it diagnosed, but the advice calls none of them a consequence."""
    from distdebug.report.knowledge import advise_all

    hang = f("hang", "collective #41", 7, [1], "critical")
    note = f("straggler", "compute", 9, [1], "warning")
    div = f("replica_divergence", "w", 5, [1])
    verdict = f("rerun", "re-execution of step 5", 5, [1], verdict="transient")
    assert len(group([hang, note])) == 1 and group([hang, note])[0].consequences() == []
    assert "consequence" not in advise_all([hang, note])[1].cause
    (incident,) = group([div, verdict])
    assert incident.root is div and incident.consequences() == []
    assert "consequence" not in advise_all([div, verdict])[1].cause


def test_the_roots_own_event_carries_its_consequences():
    """BatchNorm statistics that differ on two modules at step 2 are one event; a replica divergence of the
    second module's buffer at step 4 follows from that event, though not from the root's own module."""
    from distdebug.report.knowledge import advise_all

    bn1, bn4 = f("bn_divergence", "body.1", 2, [0, 1]), f("bn_divergence", "body.4", 2, [0, 1])
    rep = f("replica_divergence", "body.4.running_mean", 4, [1])
    (incident,) = group([bn1, bn4, rep])
    assert incident.consequences() == [rep]
    assert "consequence of the BatchNorm statistics that differ from step 2" in advise_all([bn1, bn4, rep])[2].cause
