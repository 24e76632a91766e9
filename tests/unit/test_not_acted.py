"""Tier 1 (pure): every fault acts or says exactly why not (issue 46). A fault's ``not_acted`` records (its own
reasons: a parameter nobody else holds, a flip the optimizer rewrote, a NaN that never reached the loss, or the
end-of-run fallback) decide attach's never-acted verdict and line, the report's, and the replay's did-not-act
cells, which are counted apart from the detector's misses."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import torch

from distdebug.analysis.summary import NO_REASON, acted, never_acted, why_not
from distdebug.config import EXIT_NEVER_ACTED
from distdebug.context import RankContext, RankIdentity, StepEvent
from distdebug.fault_injection.console import summary
from distdebug.fault_injection.matrix import Cell, judge, judge_exit, junit_xml
from distdebug.fault_injection.registry import FAULTS, resolve
from distdebug.launch.attach import never_acted_message

FLIP = {"kind": "injected", "fault": "bitflip_param", "rank": 1, "step": 2, "param": "4.weight"}
UNDONE = {"kind": "not_acted", "fault": "bitflip_param", "rank": 1, "step": 2,
          "reason": "the flipped bit in 4.weight did not survive step 2"}
ALONE = {"kind": "not_acted", "fault": "bitflip_param", "rank": 1, "step": 2,
         "reason": "no other rank holds head.weight (sharded over ranks [0, 1] by FSDP2)"}


def test_a_fault_counts_as_acted_only_where_its_act_held():
    faults = [resolve("bitflip_param")]
    assert never_acted(faults, [FLIP]) == []
    assert never_acted(faults, [FLIP], [UNDONE]) == ["bitflip_param"]  # acted, then undone: not acted
    assert never_acted(faults, [], [ALONE]) == ["bitflip_param"]
    # A decline before the act (no model yet, a model in a later phase): the act holds.
    early = {**ALONE, "step": 1, "reason": "no optimizer was found"}
    assert acted([{**FLIP, "step": 3}], [early]) == {"bitflip_param"}
    # Every rank (rank=-1): one rank's act holds although another rank could not act.
    other = {**UNDONE, "rank": 0}
    assert acted([FLIP], [other]) == {"bitflip_param"}
    assert acted([{"fault": "nan_grad"}], []) == {"nan_grad"}  # records without rank or step (older runs)


def test_reasons_are_the_faults_own_once_each_with_the_ranks_that_gave_them():
    records = [ALONE, {**ALONE, "rank": 0}, {**ALONE, "rank": 1}, UNDONE,
               {"kind": "not_acted", "fault": "nan_grad", "rank": 0, "step": 3, "reason": "elsewhere"}]
    assert why_not(["bitflip_param"], records) == {"bitflip_param": [
        "no other rank holds head.weight (sharded over ranks [0, 1] by FSDP2) [ranks 0-1]",
        "the flipped bit in 4.weight did not survive step 2 [rank 1]"]}
    assert why_not(["duplicate_data"], records) == {}


def test_attach_says_the_faults_own_reason_and_the_generic_line_only_without_one():
    why = why_not(["bitflip_param"], [ALONE])
    assert never_acted_message(["bitflip_param"], why) == (
        "the training exited 0, but the fault injected on purpose never acted: bitflip_param: no other rank holds "
        "head.weight (sharded over ranks [0, 1] by FSDP2) [rank 1]")
    assert never_acted_message(["duplicate_data"], {}) == (  # issue 22's line, unchanged
        "the training exited 0, but the fault injected on purpose never acted: duplicate_data (nothing it acts "
        "through was there, or its step never came; distdebug faults replay SCRIPT says which faults can act on a "
        "script)")
    both = never_acted_message(["bitflip_param", "duplicate_data"], why)
    assert both.startswith("the training exited 0, but the faults injected on purpose never acted: bitflip_param: no "
                           "other rank holds head.weight")
    assert f"; duplicate_data ({NO_REASON}) (distdebug faults replay SCRIPT" in both


def _judge(injected, not_acted, findings=()):
    return judge(FAULTS["bitflip_param"](), 2, injected, list(findings), Cell("bitflip_param", "script", ""),
                 not_acted=not_acted)


def test_the_replay_scores_a_fault_that_did_not_act_with_its_reason_never_as_a_miss():
    undone = _judge([FLIP], [UNDONE])  # acted, undone: no finding, and yet no miss of the detector
    assert (undone.status, undone.reason) == ("did-not-act", "the flipped bit in 4.weight did not survive step 2 "
                                                             "[rank 1]")
    assert undone.ok and undone.applicable and undone.skipped
    alone = _judge([], [ALONE])
    assert alone.status == "did-not-act" and alone.reason.startswith("no other rank holds head.weight")
    # attach's exit 122 keeps the verdict; a crash under the fault is still an error.
    assert judge_exit(FAULTS["bitflip_param"](), EXIT_NEVER_ACTED, True, _judge([FLIP], [UNDONE]),
                      said=True).status == "did-not-act"
    # The fault's check of its effect is a guess the findings overrule: undone by its word, yet caught, is caught
    # (attach's exit 122 for it is no error either).
    found = [{"detector": "replica_divergence", "ranks": [0, 1], "step": 2, "subject": "4.weight"}]
    assert _judge([FLIP], [UNDONE], found).status == "caught-localised"
    assert judge_exit(FAULTS["bitflip_param"](), EXIT_NEVER_ACTED, True, _judge([FLIP], [UNDONE], found),
                      said=True).status == "caught-localised"
    assert judge_exit(FAULTS["bitflip_param"](), 1, False, _judge([], [ALONE])).status == "error"
    # Neither acted nor said why: a defect of the fault, the replay's error.
    silent = _judge([], [])
    assert silent.status == "error" and "gave no reason" in silent.reason
    # Another fault's reason is not this one's; a reason said before the act does not undo it.
    caught = _judge([FLIP], [{**UNDONE, "fault": "nan_grad"}, {**ALONE, "step": 1}],
                    [{"detector": "replica_divergence", "ranks": [0, 1], "step": 2, "subject": "4.weight"}])
    assert caught.status == "caught-localised"


def test_did_not_act_is_counted_apart_in_the_summary_and_skipped_in_junit():
    ok = Cell("nan_grad", "script", "", status="caught-localised")
    na = Cell("slow_link", "script", "", status="not-applicable", reason="acts on the doctor")
    dna = Cell("bitflip_param", "script", "", status="did-not-act", reason="no other rank holds head.weight")
    assert summary([ok, na]) == ("1 applicable, 1 caught-localised, 1 not applicable; 0 of 0 clean runs clean; "
                                 "0 failed")  # unchanged when every fault acted
    assert summary([ok, dna, na]) == ("2 applicable, 1 caught-localised, 1 did not act, 1 not applicable; 0 of 0 "
                                      "clean runs clean; 0 failed")
    suite = ET.fromstring(junit_xml([ok, dna, na])).find("testsuite")
    assert (suite.get("failures"), suite.get("skipped")) == ("0", "2")
    skip = {c.get("name"): c.find("skipped") for c in suite.iter("testcase")}
    assert skip["bitflip_param"].get("type") == "distdebug.did_not_act"
    assert skip["bitflip_param"].get("message") == "did not act: no other rank holds head.weight"
    assert skip["slow_link"].get("message") == "not applicable: acts on the doctor" and skip["nan_grad"] is None


class _Rank:
    """A rank's context whose event stream is a list."""

    def __init__(self, rank: int = 1, world: int = 2, model: torch.nn.Module | None = None) -> None:
        self.records: list[dict] = []
        me = RankIdentity(rank=rank, local_rank=rank, world_size=world, local_world_size=world, node=0, attempt=0,
                          host="h", pid=1)
        self.ctx = RankContext(identity=me, run_dir=None, rank_dir=None,
                               emit=lambda kind, **f: self.records.append({"kind": kind, **f}))
        if model is not None:
            self.ctx.models = [model]

    def said(self) -> list[str]:
        return [r["reason"] for r in self.records if r["kind"] == "not_acted"]


def _event(step: int, loss: float | None = 1.0, readout: dict | None = None) -> StepEvent:
    return StepEvent(rank=1, step=step, loss=loss, step_time_s=0.1, backward_calls=1, collectives=0,
                     readout=readout or {})


def _ran(fault, rank: _Rank, steps: int) -> list[str]:
    fault.setup(rank.ctx)
    fault.attach(rank.ctx)
    for s in range(1, steps + 1):
        fault.on_step(_event(s))
    fault.on_end()
    return rank.said()


def test_a_fault_that_gave_no_reason_says_at_the_end_why_from_what_it_knows():
    # Its step never came.
    assert _ran(FAULTS["skip_step"](rank=1, step=6), _Rank(), 3) == ["no optimizer was found: no step to skip"]
    assert _ran(FAULTS["straggler"](rank=1, step=6), _Rank(model=torch.nn.Linear(2, 2)), 3) == [
        "its step 6 never came: the script ran 3 steps"]
    # Its step came, and nothing it acts through ran: the fault's own words for what that is.
    assert _ran(FAULTS["slow_dataloader"](rank=1), _Rank(), 4) == [
        "nothing it acts through was there (a torch DataLoader iterated on its rank)"]
    assert _ran(FAULTS["seed_mismatch"](), _Rank(), 2) == [
        "nothing it acts through was there (a torch.manual_seed call of the script's: it made none)"]
    # A rank the job does not have: said once, by rank 0.
    assert _ran(FAULTS["hang"](rank=3, step=2), _Rank(rank=0), 3) == [
        "it acts on rank 3, and the job ran 2 ranks (0-1)"]
    assert _ran(FAULTS["hang"](rank=3, step=2), _Rank(rank=1), 3) == []
    assert _ran(FAULTS["hang"](rank=0, step=2), _Rank(rank=1), 3) == []  # not its rank: nothing to say
    # A fault that acted says nothing; nor does one that gave its reason already.
    fault = FAULTS["bad_env"](var="DISTDEBUG_TEST_UNUSED", value="x")
    assert _ran(fault, _Rank(), 2) == [] and fault.acted
    assert _ran(FAULTS["checkpoint_corruption"](rank=1), _Rank(), 2) == [
        "no checkpoint was loaded: the script never called torch.load on this rank"]


def test_bitflip_reads_its_flipped_word_again_at_the_steps_end():
    """The word written is compared on the device and read with the step's values (probe): a flip the
    training wrote over (ZeRO copying its partition back) is said; one that held is not."""
    for rewritten in (False, True):
        model = torch.nn.Linear(3, 2)
        rank = _Rank(model=model)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        rank.ctx.optimizers = [opt]
        fault = FAULTS["bitflip_param"](rank=1, step=2)
        fault.attach(rank.ctx)
        fault.on_step(_event(1))
        before = model.weight.detach().clone()
        model(torch.ones(1, 3)).sum().backward()
        opt.step()  # the flip, in the optimizer's post-hook
        assert fault.acted and not torch.equal(model.weight, before)
        if rewritten:
            with torch.no_grad():
                model.weight.copy_(before)
        probe = fault.probe(2)
        assert probe is not None and set(probe) == {"kept"}
        fault.on_step(_event(2, readout={"bitflip_param": {"kept": int(probe["kept"])}}))
        assert fault.probe(3) is None  # read once, at the flip's step
        assert rank.said() == ([
            "the flipped bit in weight did not survive step 2: the value was rewritten before the step ended "
            "(something after the optimizer's step wrote the parameter again: the script, or the framework it uses)"]
            if rewritten else [])


def test_nan_activation_says_when_its_nan_did_not_reach_the_loss():
    for loss, said in ((0.5, True), (math.nan, False), (None, False)):  # None: no loss on this rank, no verdict
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        rank = _Rank(model=model)
        fault = FAULTS["nan_activation"](rank=1, step=2, module="1")
        fault.attach(rank.ctx)
        fault.on_step(_event(1))
        assert torch.isnan(model(torch.ones(1, 2))).any() and fault.acted
        fault.on_step(_event(2, loss=loss))
        assert rank.said() == (["the NaN planted in 1's output in step 2 did not reach the step's loss (0.5 on this "
                                "rank): the loss does not depend on that element (masked, replaced or left unused "
                                "by the script)"] if said else [])


def test_nan_activation_names_an_output_it_cannot_plant_a_nan_in():
    class Tokens(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.long()

    model = torch.nn.Sequential(Tokens())
    rank = _Rank(model=model)
    fault = FAULTS["nan_activation"](rank=1, step=2, module="0")
    fault.attach(rank.ctx)
    fault.on_step(_event(1))
    model(torch.ones(2))
    assert rank.said() == ["0's output in step 2 is not a floating-point tensor (nor a tuple led by one: a Tensor): "
                           "no NaN can be planted in it"]
    assert _ran(FAULTS["nan_activation"](rank=1, step=2, module="missing"), _Rank(model=model), 3) == [
        "the model has no module named missing"]
