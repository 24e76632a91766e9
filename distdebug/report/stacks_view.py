"""``distdebug stacks`` in the terminal: the text of the groups ``analysis.stacks`` made (presentation lives in
report/, as ``top``'s live_view, ``diff``'s diffview and ``doctor``'s doctor_view do; ``--json`` prints the
groups as data)."""

from __future__ import annotations

from distdebug.analysis.stacks import Group, headline, script_frames, summary
from distdebug.findings import ranks_text


def render(groups: list[Group], missing: dict[int, str], native: dict[int, str], note: str | None,
           frames: int = 12) -> str:
    """The terminal text: the headline, then each group's main-thread stack (its innermost ``frames``), the
    step and collective each of its ranks is in, its other threads by name, and native frames if any."""
    lines = [headline(groups)] if groups else []
    for rank, why in sorted(missing.items()):
        lines.append(f"rank {rank}: no answer: {why}")
    for g in groups:
        lines.append("")
        lines.append(f"== {ranks_text(g.ranks)}: {g.summary}")
        for a in g.answers:
            ans = a.answer
            coll = ans.get("in_collective")
            inside = (f", inside {coll.get('op')} #{coll.get('seq')} for {coll.get('waiting_s')} s" if coll else "")
            lines.append(f"   rank {a.rank} (pid {ans.get('pid')} on {ans.get('host')}): step {ans.get('step')}, "
                         f"{ans.get('phase')}{inside}, last progress {ans.get('idle_s')} s ago")
        readable = script_frames(g.frames)
        shown = readable[-frames:]
        if len(readable) > len(shown):
            lines.append(f"   ... {len(readable) - len(shown)} outer frames")
        for f in shown:
            lines.append(f"   {f.get('file')}:{f.get('line')} in {f.get('func')}")
            if f.get("code"):
                lines.append(f"       {f['code']}")
        others = {t.get("name", "?"): t.get("frames", []) for t in g.answers[0].answer.get("threads", [])
                  if not t.get("main") and not str(t.get("name")).startswith("distdebug-")}
        for name, thread_frames in others.items():  # the script's own threads (distdebug's are in --json)
            lines.append(f"   thread {name} (rank {g.ranks[0]}): {summary(thread_frames)}")
        sample = next((r for r in g.ranks if r in native), None)  # one a group: the same stack (--json: all)
        if sample is not None:
            lines.append(f"   native (py-spy dump --native) of rank {sample}"
                         + (f", one of {len(g.ranks)}:" if len(g.ranks) > 1 else ":"))
            lines.extend(f"     {line}" for line in native[sample].rstrip().splitlines())
    if note:
        lines.append("")
        lines.append(note)
    return "\n".join(lines)
