"""A card (distdebug.cards) as a person reads it: in the terminal (``distdebug explain``), as a docs page
(docs/gen.py writes one per card), and in the HTML report beside the findings of that kind.

One list of sections (``sections``) feeds every form, so the terminal and the docs say the same thing.
"""

from __future__ import annotations

import html

from distdebug import cards
from distdebug.cards import Card
from distdebug.cards.base import generic
from distdebug.cards.kinds import CAUSES, caused_by


def _names_of(kinds: list[str] | tuple[str, ...]) -> list[str]:
    """The cards whose kind (or a variant's kind) is one of ``kinds``."""
    return [f"{c.code} {c.name}" for c in cards.CARDS.values() if c.kinds & set(kinds)]


def causal(card: Card) -> tuple[list[str], list[str]]:
    """(what can cause this card's findings, what they can cause), as ``CODE name`` lists from the causal
    model (cards.kinds). A variant of another kind counts too (config_lint's broadcast_buffers)."""
    causes = sorted({n for k in card.kinds for n in _names_of(caused_by(k))})
    effects = sorted({n for k in card.kinds for n in _names_of(CAUSES.get(k, ()))})
    return causes, effects


def sections(card: Card) -> list[tuple[str, str | list[str]]]:
    """The card's sections in reading order: (heading, text or list of items)."""
    causes, effects = causal(card)
    out: list[tuple[str, str | list[str]]] = [
        ("What it finds", card.title),
        ("What it means", card.meaning),
        ("Source", card.source + ("" if card.default else " (off unless named in --detectors)")),
        ("Severities", ", ".join(card.severities)),
        ("Subject", card.subjects),
        ("Likely causes", list(card.causes)),
        ("Check", card.check),
        ("Fix", card.fix),
        ("Cases the report tells apart", [f"{v.case}: {generic(v.cause)}" for v in card.variants]),
    ]
    if card.options:
        out.append(("Options", [f"{card.name}.{o.key} (default {o.default!r})"
                                + (f", or attach {o.flag}" if o.flag else "") + f": {o.help}" for o in card.options]))
    if card.faults:
        out.append(("Reproduce it", [f"fault {f}: distdebug faults replay --fault {f} SCRIPT" for f in card.faults]))
    out.append(("Cost", card.cost))
    out.append(("Can follow from", causes or ["nothing else distdebug finds"]))
    out.append(("Can cause", effects or ["nothing else distdebug finds"]))
    return out


def text(card: Card) -> str:
    """``distdebug explain``'s output: plain text, wrapped by the terminal."""
    lines = [f"{card.code} {card.name}: {card.title}", ""]
    for head, body in sections(card)[1:]:
        if isinstance(body, list):
            lines.append(f"{head}:")
            lines += [f"  - {item}" for item in body]
        else:
            lines.append(f"{head}: {body}")
    return "\n".join(lines)


def markdown(card: Card) -> str:
    """The docs page of one card (MyST Markdown; the anchor is the code, lower case)."""
    lines = [f"({card.code.lower()})=", f"# {card.code} `{card.name}`", "", card.title[0].upper() + card.title[1:], ""]
    for head, body in sections(card)[1:]:
        lines.append(f"## {head}")
        lines.append("")
        if isinstance(body, list):
            lines += [f"- {item}" for item in body]
        else:
            lines.append(body)
        lines.append("")
    lines.append(f"In the terminal: `distdebug explain {card.code}`.")
    return "\n".join(lines) + "\n"


def html_block(card: Card) -> str:
    """The card inside the HTML report (self-contained: no network), its anchor the code."""
    parts = [f'<section class="card" id="{card.code}"><h3>{card.code} {html.escape(card.name)}</h3>']
    for head, body in sections(card)[:8]:
        if isinstance(body, list):
            items = "".join(f"<li>{html.escape(i)}</li>" for i in body)
            parts.append(f"<p><b>{html.escape(head)}</b></p><ul>{items}</ul>")
        else:
            parts.append(f"<p><b>{html.escape(head)}</b>: {html.escape(body)}</p>")
    parts.append(f"<p>More: <code>distdebug explain {card.code}</code>, or the page {card.code} in the docs "
                 f"(docs/reference/findings/{card.name}.md).</p></section>")
    return "".join(parts)
