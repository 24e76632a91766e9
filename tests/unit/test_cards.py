"""Tier 1: a card per kind of finding (issue 49). Every registered detector and every other source of
findings in distdebug/ (read from the source: a detector name written where a Finding is made) has a card;
the cards are complete (codes stable and unique, options that are exactly the detector's config fields,
faults that exist and reproduce it, kinds in the causal model); the detectors' one line, ``distdebug
detectors`` and ``distdebug explain`` read them; and the package imports no torch."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from distdebug import cards
from distdebug.cards.base import Context, fill, generic
from distdebug.cards.kinds import CAUSES, ORDER, SPREADS, WINDOW
from distdebug.cli import main
from distdebug.findings import Finding, Severity

ROOT = Path(__file__).resolve().parents[2]


def finding_sources() -> dict[str, str]:
    """Every detector name a Finding can carry, from the source of distdebug/: ``detector="name"`` keywords,
    ``DETECTOR = "name"`` constants, and the first argument of analysis/errors.py's ``finding(...)`` helper
    (the names a rank's error is diagnosed as) -> where it was seen."""
    out: dict[str, str] = {}
    for path in sorted((ROOT / "distdebug").rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "detector" and isinstance(node.value, ast.Constant):
                out.setdefault(str(node.value.value), where)
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "DETECTOR"
                                                      for t in node.targets):
                if isinstance(node.value, ast.Constant):
                    out.setdefault(str(node.value.value), where)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "finding" \
                    and node.args and isinstance(node.args[0], ast.Constant) and path.name == "errors.py":
                out.setdefault(str(node.args[0].value), where)
    return out


def test_the_source_scan_sees_every_kind_of_source():
    found = finding_sources()
    # a keyword (doctor), a constant (the hang judge, teardown, the volume guard), a rank's diagnosed error
    assert {"env_diff", "link_matrix", "hang", "teardown", "log_volume", "oom", "startup", "harness"} <= set(found)


def test_every_registered_detector_and_every_finding_source_has_a_card():
    from distdebug.detectors.registry import builtin

    registered = builtin()
    assert set(registered) - set(cards.CARDS) == set()
    assert set(finding_sources()) - set(cards.CARDS) == set()
    for name, cls in registered.items():
        card = cards.CARDS[name]
        assert cls.description == card.title  # the detector's one line is its card's
        assert cls.default == card.default, name
        config = getattr(cls, "Config", None)
        fields = [f.name for f in dataclasses.fields(config)] if config is not None else []
        # every option the detector takes is on its card, with its real default: nothing unlisted
        assert [o.key for o in card.options] == fields, name
        for o in card.options:
            assert o.default == getattr(config(), o.key) and o.help, (name, o.key)
    # a card is a kind someone makes: no card without a source
    assert set(cards.CARDS) - set(registered) - set(finding_sources()) == set()


def test_cards_are_complete_with_stable_unique_codes_and_known_faults():
    from distdebug.fault_injection.registry import FAULTS

    codes = [c.code for c in cards.CARDS.values()]
    assert len(set(codes)) == len(codes) and all(re.fullmatch(r"DD\d{3}", c) for c in codes)
    listed: set[str] = set()
    for name, card in cards.CARDS.items():
        assert (ROOT / "distdebug" / "cards" / f"{name}.py").is_file()  # one module a card
        for text in (card.title, card.meaning, card.subjects, card.check, card.fix, card.cost, card.noun):
            assert text.strip(), name
        assert card.causes and card.severities and set(card.severities) <= {s.value for s in Severity}
        assert card.family in cards.FAMILIES
        assert set(card.faults) <= set(FAULTS), name
        listed |= set(card.faults)
        assert card.kind in ORDER and all(v.kind in ORDER for v in card.variants if v.kind)
        assert card.variants[-1].when(Finding(severity=Severity.INFO, detector=name, ranks=[], step=None,
                                              subject="", message=""), Context())
        for v in card.variants:
            assert v.case and v.symptom is not None and v.cause and v.check
            for text in (v.symptom, v.cause, v.check, v.fix):
                assert "{" not in generic(text), (name, text)  # every placeholder is one a finding fills
    # every fault is some card's reproduction; the parity faults, of a class of parity's cause catalogue
    from distdebug.analysis.parity import CAUSES as PARITY_CAUSES

    parity = {f for f, c in FAULTS.items() if c.catcher == "parity"}
    assert set(FAULTS) - parity - listed == set() and parity and not parity & listed
    assert all(getattr(FAULTS[f], "cause", None) in PARITY_CAUSES for f in parity)
    # the causal model speaks only of kinds that exist
    assert set(CAUSES) <= set(ORDER) and all(set(v) <= set(ORDER) for v in CAUSES.values())
    assert all(a in ORDER and b in ORDER and b in CAUSES[a] for a, b in SPREADS)
    assert all(b in CAUSES[a] for a, b in WINDOW)


def test_lookup_by_code_or_name_and_templates_filled_from_the_finding():
    assert cards.lookup("dd201") is cards.lookup("replica-divergence") is cards.CARDS["replica_divergence"]
    assert cards.lookup("DD999") is None and cards.lookup("nope") is None
    f = Finding(severity=Severity.ERROR, detector="replica_divergence", ranks=[3], step=7, subject="w",
                message="m", evidence={"verdict": "x"})
    assert fill("{ranks} at{at} in {run_dir}: {ev[verdict]} {ev[absent]}", f, Context(run_dir="R")) == \
        "rank 3 at --step 7 in R: x ?"
    assert generic("{ranks} at{at}: {ev[verdict]}") == "the rank(s) at --step N: <verdict>"
    # a finding whose detector has no card (a plugin's) keeps its own fix and nothing more
    plugin = Finding(severity=Severity.ERROR, detector="mine", ranks=[0], step=1, subject="s", message="m",
                     fix="do this")
    assert cards.advise(plugin).fix == "do this" and cards.kind_of(plugin) == "other"


LEAK = re.compile(r"<\w+>|[{}]|\[\[|\]\]| ,|(?<![\w.])\(\s*\)|(?<=\s)\?(?=[\s,.;:)]|$)|  ")
"""What a template leaves in a text it did not fill: a placeholder, a brace, an optional segment's brackets, the
gap or empty brackets of a value that was not there, a lone ``?``, two spaces."""


def test_no_card_leaves_template_text_with_or_without_evidence_nor_in_explain():
    """Every case of every card, each of its texts, as the docs and explain print it and as a finding fills it,
    with every piece of evidence its templates name and with none (issue 63: explain printed "<checked>", the
    built page "non-finite , before" and "code and data ()")."""
    texts = 0
    for card in cards.CARDS.values():
        for v in card.variants:
            for name in ("symptom", "cause", "check", "fix"):
                t = getattr(v, name)
                keys = re.findall(r"\{ev\[(\w+)\]\}", t)
                # evidence is said only inside [[ ]]: a finding without it, and the docs, leave the words out
                assert not keys or re.sub(r"\[\[.*?\]\]", "", t).count("{ev[") == 0, (card.name, t)
                full = Finding(severity=Severity.ERROR, detector=card.name, ranks=[1], step=5, subject="layer.w",
                               message="m", evidence={k: f"value of {k}" for k in keys})
                bare = Finding(severity=Severity.WARNING, detector=card.name, ranks=[], step=None, subject="s",
                               message="m")
                for out in (generic(t), fill(t, full, Context(run_dir="RUN", root=full)), fill(t, bare, Context())):
                    assert not LEAK.search(out), (card.name, name, out)
                    texts += 1
                assert all(f"value of {k}" in fill(t, full, Context()) for k in keys)
    assert texts > 400
    for card in cards.CARDS.values():
        out = CliRunner().invoke(main, ["explain", card.code]).output
        assert not LEAK.search(out.replace("  -", "-").replace("  ", "")) and "<" not in out, (card.code, out)


def test_the_cards_import_no_torch():
    code = ("import sys, distdebug.cards, distdebug.report.cardview, distdebug.analysis.incidents; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'rich', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout.replace("'", '"')) == []


def test_explain_prints_the_card_and_bad_input_is_one_line():
    runner = CliRunner()
    r = runner.invoke(main, ["explain", "DD102"])
    assert r.exit_code == 0
    assert r.output.startswith("DD102 nan_origin:")
    for head in ("What it means:", "Likely causes:", "Check:", "Fix:", "Options:", "Reproduce it:", "Cost:",
                 "Can follow from:", "Can cause:"):
        assert head in r.output, head
    assert "nan_origin.stop (default False), or attach --stop-on-nan" in r.output
    assert "DD205 checkpoint_roundtrip" in r.output.split("Can follow from:")[1]  # a restore can bring a NaN
    every = runner.invoke(main, ["explain"])
    assert every.exit_code == 0 and len(every.output.splitlines()) == len(cards.CARDS)
    bad = runner.invoke(main, ["explain", "DD999"])
    assert bad.exit_code == 2 and "'distdebug explain' lists them" in bad.output


def test_detectors_lists_codes_and_every_detector_option_key():
    from distdebug.detectors.registry import builtin

    r = CliRunner().invoke(main, ["detectors", "--options"])
    assert r.exit_code == 0
    for name, cls in builtin().items():
        assert re.search(rf"^{cards.CARDS[name].code}  {name} ", r.output, re.M), name
        for f in dataclasses.fields(cls.Config) if getattr(cls, "Config", None) else []:
            assert f"--detector-option {name}.{f.name}=" in r.output, (name, f.name)


@pytest.mark.parametrize("args", [[], ["faults"]])
def test_a_bare_command_group_prints_its_help_and_exits_0(args):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "Commands:" in r.output and "error" not in r.output


def test_help_is_whole_and_every_option_says_what_it_does():
    import click

    def walk(cmd: click.Command, path: str) -> list[str]:
        out = [f"{path} {' / '.join(p.opts)}" for p in cmd.params
               if isinstance(p, click.Option) and not p.hidden and not p.help]
        for name, sub in getattr(cmd, "commands", {}).items():
            out += walk(sub, f"{path} {name}")
        return out

    assert walk(main, "distdebug") == []
    for args in ([], ["faults"]):
        r = CliRunner().invoke(main, [*args, "--help"])
        assert "..." not in r.output.split("Commands:")[1], r.output
    # defaults are shown (an option whose default is its detector's shows that one, in parentheses)
    text = " ".join(CliRunner().invoke(main, ["attach", "--help"]).output.split())
    assert "(loss_spike.threshold). [default: (8.0)]" in text and "[default: 256MiB]" in text


def test_every_severity_is_defined_once_and_said_where_fail_on_asks_for_one():
    """--fail-on asks the user to choose a severity: each is defined (findings.SEVERITY_MEANING), in both
    commands' --fail-on help and on the findings reference page."""
    from distdebug.findings import SEVERITY_MEANING

    assert list(SEVERITY_MEANING) == [s.value for s in Severity] and all(len(t) > 40 for t in SEVERITY_MEANING.values())
    page = (ROOT / "docs" / "reference" / "findings" / "index.md").read_text()
    for command in ("attach", "report"):
        text = " ".join(CliRunner().invoke(main, [command, "--help"]).output.split())
        fail_on = text[text.index("--fail-on"):]
        for name, meaning in SEVERITY_MEANING.items():
            assert f"{name}, {meaning.split(':')[0]}" in fail_on, (command, name)
            assert f"| `{name}` | {meaning} |" in page
